"""``warmbox template build|ls|show|rm|gc``.

``build`` takes a Dockerfile (or a directory holding one), a Python file defining a
``warmbox.Template`` (the variable ``template``, or the only Template in it), a TOML file with
``[templates.NAME]`` tables, or a NAME: a built-in template with a spec (``browser``) or a
``[templates.NAME]`` of this home's warmbox.toml with build keys (see
:mod:`warmbox.templates.toml`). Progress: one bar per step on a terminal, plain lines otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from typing import Any

from warmbox import operations as ops
from warmbox.cli.context import MODULE_COMMANDS, pairs, transport
from warmbox.errors import InvalidArgument, WarmboxError
from warmbox.models import TemplateBuildEvent, TemplateInfo
from warmbox.network.policy import PRESETS, Network
from warmbox.templates import Template


def add_parser(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("template", help=MODULE_COMMANDS["template"])
    tsub = p.add_subparsers(dest="template_command", required=True, parser_class=parser_class)
    q = tsub.add_parser("build", help="build a template from a Dockerfile, a Python or TOML file, or a NAME")
    q.add_argument("source", help="Dockerfile (or its directory), file.py, file.toml, or a template NAME")
    q.add_argument("-n", "--name", "-t", dest="name", default=None, help="the template's name (default: derived)")
    q.add_argument("--context", default=None, help="COPY's base directory (default: the Dockerfile's)")
    q.add_argument("--build-arg", action="append", metavar="NAME=VALUE", help="a Dockerfile ARG value")
    q.add_argument(
        "--allow",
        action="append",
        metavar="HOST|*.DOMAIN|PRESET",
        help="the build's egress (RUN/apt/pip/npm steps; repeatable; default: none), added to the spec's; "
        "a preset names a registry's hosts: " + ", ".join(PRESETS),
    )
    q.add_argument("--json", action="store_true", help="the result (and events, one per line) as JSON")
    q = tsub.add_parser("ls", help="built templates (and the built-in ones)")
    q.add_argument("--json", action="store_true")
    q = tsub.add_parser("show", help="a template's record")
    q.add_argument("name")
    q.add_argument("--version", type=int, default=None)
    q.add_argument("--json", action="store_true")
    q = tsub.add_parser("rm", help="remove a template (every version, or --version)")
    q.add_argument("names", nargs="+")
    q.add_argument("--version", type=int, default=None)
    q = tsub.add_parser("gc", help="remove layers and microVM roots nothing uses (admin)")
    q.add_argument("--dry-run", action="store_true", help="only say what would go")
    q.add_argument("--json", action="store_true")


def _slug(text: str) -> str:
    name = re.sub(r"[^a-z0-9_.-]+", "-", text.lower()).strip("-.")
    return name[:63] or "template"


def _from_python(path: str) -> Template:
    import runpy

    scope = runpy.run_path(path, run_name="__warmbox_template__")
    if isinstance(scope.get("template"), Template):
        return scope["template"]  # type: ignore[no-any-return]
    found = [v for k, v in scope.items() if isinstance(v, Template) and not k.startswith("_")]
    if len(found) != 1:
        raise InvalidArgument(f"{path} must define one warmbox.Template (or name it `template`); found {len(found)}")
    return found[0]


def _from_toml(path: str, name: str | None) -> tuple[str, Template]:
    import tomllib

    from warmbox.templates.toml import spec_from_table

    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise InvalidArgument(f"cannot read {path}: {e}") from None
    tables = raw.get("templates", {})
    if not isinstance(tables, dict):
        raise InvalidArgument(f"{path}: [templates] must be a table")
    specs = {}
    for n, table in tables.items():
        if isinstance(table, dict):
            spec = spec_from_table(table, os.path.dirname(os.path.abspath(path)))
            if spec is not None:
                specs[n] = spec.warmup(table.get("warmup_code"), table.get("warmup_commands", ()))
    if name is not None:
        if name not in specs:
            raise InvalidArgument(f"{path} has no [templates.{name}] with a build spec (has: {', '.join(specs)})")
        return name, specs[name]
    if len(specs) != 1:
        raise InvalidArgument(f"{path} has {len(specs)} buildable templates ({', '.join(specs)}): pick one with --name")
    return next(iter(specs.items()))


def with_allowed(spec: Template, allow: list[str] | None) -> Template:
    """``spec`` whose build may also reach ``allow`` (hosts, patterns or presets; checked here,
    InvalidArgument before anything is built). A spec with the whole internet keeps it."""
    if not allow:
        return spec
    Network(allow=list(allow))  # each entry: a host, a pattern or a preset, else InvalidArgument
    net = spec.build_network
    if net.mode == "internet":
        return spec
    return spec.network([*net.allow, *(a for a in allow if a not in net.allow)])


def _named(name: str) -> Template:
    """A template NAME: a built-in one with a spec, or one of warmbox.toml with build keys."""
    from warmbox.config import load
    from warmbox.paths import default_home
    from warmbox.templates.builtins import builtin

    b = builtin(name)
    if b is not None:
        spec = b.template()
        if spec is None:
            raise InvalidArgument(f"{name!r} is the built-in image itself: `scripts/bootstrap install` builds it")
        return spec
    settings = load(default_home())
    t = settings.templates.get(name)
    if t is None or t.build is None:
        raise InvalidArgument(
            f"{name!r} is not a file, a built-in template with a spec, nor a [templates.{name}] of "
            f"{settings.source} with build keys (from/dockerfile/debian/oci/registry)"
        )
    return t.build.warmup(t.warmup_code or None, t.warmup_commands)


def resolve(source: str, name: str | None, context: str | None, build_args: dict[str, str]) -> tuple[str, Template]:
    """(name, spec) of what ``warmbox template build SOURCE`` builds."""
    if os.path.exists(source):
        path = source
        if path.endswith(".py"):
            t = _from_python(path)
            t = t if context is None else t.with_context(context)
            return name or _slug(os.path.splitext(os.path.basename(path))[0]), t
        if path.endswith(".toml"):
            n, t = _from_toml(path, name)
            return n, t if context is None else t.with_context(context)
        from warmbox.templates.dockerfile import parse_dockerfile, read_dockerfile

        text, shown, where = read_dockerfile(path)
        t = parse_dockerfile(text, source=shown, context=context or where, build_args=build_args)
        return name or _slug(os.path.basename(os.path.abspath(where))), t
    if os.sep in source or source.endswith((".py", ".toml")) or "Dockerfile" in source:
        raise InvalidArgument(f"{source}: no such file")
    return name or source, _named(source)


class _Progress:
    """Per-step lines: redrawn in place on a terminal (a bar per step), appended otherwise."""

    def __init__(self, stream: Any, as_json: bool) -> None:
        self.out = stream
        self.json = as_json
        self.tty = stream.isatty() and not as_json
        self.rows: dict[int, str] = {}
        self.status: dict[int, str] = {}
        self.drawn = 0

    def __call__(self, ev: TemplateBuildEvent) -> None:
        if self.json:
            print(json.dumps({"event": dataclasses.asdict(ev)}), file=self.out, flush=True)
            return
        mark = {"cached": "CACHED", "running": "...", "done": "DONE", "failed": "FAILED", "config": "CONFIG"}[ev.status]
        took = f" {ev.elapsed_s:.1f}s" if ev.elapsed_s else ""
        line = f"[{ev.step}/{ev.total}] {ev.text[:70]:<70} {mark}{took}"
        if ev.status == "failed" and ev.detail:
            line += "\n      " + ev.detail.splitlines()[0][:200]
        if not self.tty:
            if ev.status != "running" or not ev.detail:
                print(line, file=self.out, flush=True)
            return
        width = 20
        self.status[ev.step] = ev.status
        done = sum(1 for v in self.status.values() if v in ("done", "cached", "config"))
        bar = "#" * (width * done // (ev.total + 1))
        self.rows[ev.step] = line
        # redraw the block of step lines, then a total bar
        if self.drawn:
            self.out.write(f"\x1b[{self.drawn}F\x1b[J")
        lines = [self.rows[k] for k in sorted(self.rows)]
        lines.append(f"[{bar:<{width}}] {done}/{ev.total + 1}")
        self.out.write("\n".join(lines) + "\n")
        self.out.flush()
        self.drawn = sum(1 + line.count("\n") for line in lines)


def _log_path(t: object, name: str) -> str:
    """Where a build log is: its full path on this host (the engine in process), else its name in
    the server's build log directory."""
    from warmbox.engine.builder import log_dir
    from warmbox.sdk.transport import LocalTransport

    if isinstance(t, LocalTransport) and name:
        return str(log_dir(t.front.engine) / name)
    return f"{name} (in the server's build log directory)" if name else "none"


def _row(i: TemplateInfo) -> str:
    age = time.time() - i.created_at
    return (
        f"{i.name:<20} {i.version:>3} {i.image_id.removeprefix('sha256:')[:12]:<12} {len(i.layers):>6} "
        f"{i.size_bytes / (1 << 20):>9.1f} {age:>8.0f}s  {i.source}"
    )


def _shown(field: str, value: object) -> list[str]:
    """A TemplateInfo field as lines for people (no Python reprs): a list one item a line, env as
    NAME=VALUE, the size in MiB, the time in UTC; [] for an empty value."""
    if field == "warmup_code" and not value:
        return ["(no code context)" if value is None else "(a code context, no code)"]
    if value is None or value == "" or value == ():
        return []
    if isinstance(value, tuple):  # env: (name, value) pairs; layers, warmup_commands: strings
        return [f"{v[0]}={v[1]}" if isinstance(v, tuple) else str(v) for v in value]
    if field == "size_bytes" and isinstance(value, int):
        return [f"{value / (1 << 20):.1f} MiB ({value} bytes)"]
    if field == "created_at" and isinstance(value, float):
        return [time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(value))]
    if isinstance(value, str):
        return value.splitlines() or [value]
    return [str(value)]


async def command(args: argparse.Namespace) -> int:
    from warmbox.templates.context import pack_context  # tarfile: not for the parser (warmbox --help)

    t = transport()
    if args.template_command == "build":
        name, spec = resolve(args.source, args.name, args.context, pairs(args.build_arg, "--build-arg", "NAME"))
        spec = with_allowed(spec, args.allow)
        for note in spec.notes:
            print(f"note: {note}", file=sys.stderr)
        context = pack_context(spec)
        progress = _Progress(sys.stdout if args.json else sys.stderr, args.json)
        t0 = time.monotonic()
        info = await t.handle(ops.TemplateBuild(name, spec, context, progress))
        if args.json:
            print(json.dumps({"result": dataclasses.asdict(info)}))
        else:
            print(
                f"built {info.name} version {info.version} ({info.image_id}) in {time.monotonic() - t0:.1f} s; "
                f"log: {_log_path(t, info.build_log)}"
            )
        return 0
    if args.template_command == "ls":
        from warmbox.templates.builtins import BUILTINS

        rows = await t.handle(ops.TemplateList())
        if args.json:
            print(json.dumps([dataclasses.asdict(r) for r in rows]))
            return 0
        print(f"{'NAME':<20} {'VER':>3} {'IMAGE':<12} {'LAYERS':>6} {'SIZE(MiB)':>9} {'AGE':>9}  SOURCE")
        for r in rows:
            print(_row(r))
        built = {r.name for r in rows}
        for n, b in BUILTINS.items():
            if n not in built:
                state = "built-in image" if b.spec is None else f"built-in, not built (warmbox template build {n})"
                print(f"{n:<20} {'-':>3} {'-':<12} {'-':>6} {'-':>9} {'-':>9}  {state}")
        return 0
    if args.template_command == "gc":
        rep = await t.handle(ops.TemplateGc(args.dry_run))
        if args.json:
            print(json.dumps(dataclasses.asdict(rep)))
            return 0
        verb = "would remove" if rep.dry_run else "removed"
        for d in rep.layers:
            print(f"{verb} layer {d}")
        for r in rep.roots:
            print(f"{verb} microVM root {r}")
        for r in rep.kept_roots:
            print(f"kept microVM root {r}: another home's registry could not be read")
        for d in rep.shared_layers:
            print(f"{verb} shared layer {d} from the cluster's object store")
        print(
            f"{verb} {len(rep.layers)} layer(s), {len(rep.roots)} microVM root(s): "
            f"{rep.bytes_freed / (1 << 20):.1f} MiB ({rep.bytes_freed} bytes)"
        )
        return 0
    if args.template_command == "show":
        info = await t.handle(ops.TemplateGet(args.name, args.version))
        if args.json:
            print(json.dumps(dataclasses.asdict(info)))
            return 0
        for f in dataclasses.fields(info):
            lines = _shown(f.name, getattr(info, f.name))
            print(f"{f.name:<16} {lines[0] if lines else '-'}")
            for line in lines[1:]:
                print(f"{'':<16} {line}")
        return 0
    status = 0
    for name in args.names:
        try:
            gone = await t.handle(ops.TemplateDelete(name, args.version))
        except WarmboxError as e:
            print(f"warmbox: error: {e}", file=sys.stderr)
            status = 125
            continue
        print(f"{name}: removed version(s) {', '.join(str(i.version) for i in gone)}")
    return status
