"""``warmbox volume create|ls|rm|show`` and the ``--volume NAME:PATH[:ro]`` option of run/create."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from typing import Any

from warmbox import operations as ops
from warmbox.cli.context import MODULE_COMMANDS, transport
from warmbox.errors import InvalidArgument
from warmbox.models import Volume

_SIZE = re.compile(r"^(\d+)\s*([MGT]?)i?B?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``512M``, ``1G``, ``2T`` or a plain number of MiB, as MiB."""
    m = _SIZE.match(text.strip())
    if not m:
        raise InvalidArgument(f"--size takes a size such as 512M, 1G or 2T (MiB when no unit), got {text!r}")
    return int(m.group(1)) << {"": 0, "M": 0, "G": 10, "T": 20}[m.group(2).upper()]


def parse_mount(text: str) -> Volume:
    """``NAME:PATH`` or ``NAME:PATH:ro`` (``:rw`` too) as a Volume."""
    parts = text.split(":")
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        return Volume(parts[0], parts[1], read_only=parts[2] == "ro")
    if len(parts) == 2:
        return Volume(parts[0], parts[1])
    raise InvalidArgument(f"--volume takes NAME:PATH or NAME:PATH:ro, got {text!r}")


def add_parser(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("volume", help=MODULE_COMMANDS["volume"])
    vsub = p.add_subparsers(dest="volume_command", required=True, parser_class=parser_class)
    q = vsub.add_parser("create", help="a new empty volume (ext4 of --size: its limit)")
    q.add_argument("name")
    q.add_argument("--size", required=True, help="its size: 512M, 1G, 2T (MiB without a unit)")
    q.add_argument("--json", action="store_true")
    q = vsub.add_parser("ls", help="your volumes")
    q.add_argument("--json", action="store_true")
    q = vsub.add_parser("show", help="one volume's record")
    q.add_argument("name")
    q.add_argument("--json", action="store_true")
    q = vsub.add_parser("rm", help="delete volumes and their files (refused while a sandbox mounts one)")
    q.add_argument("names", nargs="+")


def _print(rows: list, as_json: bool) -> None:
    if as_json:
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
        return
    now = time.time()
    print(f"{'NAME':<24} {'SIZE':>8} {'USED':>8} {'AGE':>8}  MOUNTED BY")
    for v in rows:
        print(
            f"{v.name:<24} {v.size_mb:>7}M {v.allocated_mb:>7}M {now - v.created_at:>7.0f}s  "
            f"{', '.join(v.mounted_by) or '-'}"
        )


async def command(args: argparse.Namespace) -> int:
    t = transport()
    if args.volume_command == "create":
        v = await t.handle(ops.VolumeCreate(args.name, parse_size(args.size)))
        if args.json:
            print(json.dumps(dataclasses.asdict(v)))
        else:
            print(f"volume {v.name}: {v.size_mb} MiB")
        return 0
    if args.volume_command == "ls":
        _print(await t.handle(ops.VolumeList()), args.json)
        return 0
    if args.volume_command == "show":
        _print([await t.handle(ops.VolumeGet(args.name))], args.json)
        return 0
    for name in args.names:
        await t.handle(ops.VolumeDelete(name))
        print(f"volume {name} deleted")
    return 0
