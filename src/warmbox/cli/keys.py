"""``warmbox keys create|ls|revoke``: the API keys tenants use with ``warmbox serve`` (host-local, root)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
from typing import Any

from warmbox.cli.context import MODULE_COMMANDS
from warmbox.errors import InvalidArgument, WarmboxError
from warmbox.models import Tenant


def add_parser(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("keys", help=MODULE_COMMANDS["keys"])
    ksub = p.add_subparsers(dest="keys_command", required=True, parser_class=parser_class)
    q = ksub.add_parser("create", help="a new key for a tenant (made if new); sets the tenant's quotas given")
    q.add_argument("--tenant", required=True, metavar="NAME")
    q.add_argument("--admin", action="store_true", help="the key may run admin-only operations (snapshot gc)")
    q.add_argument("--max-sandboxes", type=int, default=None, metavar="N", help="live sandboxes at once (0: any)")
    q.add_argument("--max-memory-gb", type=float, default=None, metavar="G", help="memory of live sandboxes, GiB")
    q.add_argument("--max-cpus", type=float, default=None, metavar="C", help="CPU cores of live sandboxes")
    q.add_argument("--tiers", default=None, metavar="T[,T]", help="the tiers it may use (default: every tier)")
    q.add_argument("--rate", type=float, default=None, metavar="R", help="requests per second per key (0: any)")
    q.add_argument(
        "--budget",
        default=None,
        metavar="cpu=10h,mem=40GiBh",
        help="the tenant's use per UTC day: CPU-hours and memory GiB-hours (0: no budget); a start past "
        "it waits for approval (warmbox approvals)",
    )
    q.add_argument("--json", action="store_true")
    q = ksub.add_parser("ls", help="every key (never a secret), its tenant's quotas and budget")
    q.add_argument("--json", action="store_true")
    q = ksub.add_parser("revoke", help="revoke a key; its next request is refused")
    q.add_argument("key_id")
    q = ksub.add_parser("budget", help="a tenant's use today against its daily budget (--set: change the budget)")
    q.add_argument("--tenant", required=True, metavar="NAME")
    q.add_argument("--set", default=None, metavar="cpu=10h,mem=40GiBh", help="the new budget (0: none)")
    q.add_argument("--json", action="store_true")


def _registry():
    from warmbox.engine.engine import Engine

    return Engine.for_home().registry


def _memory_mb(gb: float | None) -> int | None:
    if gb is None:
        return None
    if not math.isfinite(gb) or gb < 0:
        raise InvalidArgument(f"--max-memory-gb must be a number of GiB >= 0 (0: unlimited), got {gb!r}")
    return round(gb * 1024)


_BUDGET = re.compile(r"^(cpu|mem)=(\d+(?:\.\d*)?|\.\d+)(h|gibh|gbh)?$", re.IGNORECASE)


def parse_budget(text: str | None) -> tuple[float | None, float | None]:
    """``cpu=10h,mem=40GiBh`` (either part; a bare number: hours) as (cpu_h, gib_h), None where unset."""
    if text is None:
        return None, None
    got: dict[str, float] = {}
    for part in text.replace(" ", "").split(","):
        m = _BUDGET.match(part)
        unit = (m.group(3) or "").lower() if m else ""
        if (
            not m
            or (m.group(1).lower() == "cpu" and unit not in ("", "h"))
            or (m.group(1).lower() == "mem" and unit == "h")
        ):
            raise InvalidArgument(
                f"--budget takes cpu=HOURSh and/or mem=GiBh per day, e.g. cpu=10h,mem=40GiBh (0: none), got {text!r}"
            )
        got[m.group(1).lower()] = float(m.group(2))
    return got.get("cpu"), got.get("mem")


def _tiers(text: str | None) -> list[str] | None:
    if text is None:
        return None
    tiers = [t.strip() for t in text.split(",") if t.strip()]
    if not tiers:
        raise InvalidArgument("--tiers takes tier names separated by commas, e.g. container,gvisor")
    return tiers


async def command(args: argparse.Namespace) -> int:
    if args.keys_command == "create":
        return _create(args)
    if args.keys_command == "budget":
        return _budget_command(args)
    if args.keys_command == "revoke":
        if not _registry().tenants.revoke_key(args.key_id):
            raise WarmboxError(f"no live key {args.key_id!r} (`warmbox keys ls` lists them)")
        print(f"{args.key_id} revoked")
        return 0
    return _ls(args)


def _create(args: argparse.Namespace) -> int:
    reg = _registry()
    cpu_h, gib_h = parse_budget(args.budget)
    key_id, secret = reg.tenants.create_key(
        args.tenant,
        admin=args.admin,
        max_sandboxes=args.max_sandboxes,
        max_memory_mb=_memory_mb(args.max_memory_gb),
        max_cpus=args.max_cpus,
        tiers=_tiers(args.tiers),
        rate_per_s=args.rate,
        budget_cpu_h=cpu_h,
        budget_gib_h=gib_h,
    )
    t = reg.tenants.tenant(args.tenant)
    if args.json:
        print(json.dumps({"key_id": key_id, "tenant": t.name, "admin": args.admin, "secret": secret}))
        return 0
    print(f"key {key_id} of tenant {t.name}{' (admin)' if args.admin else ''}; quotas: {_quotas(t)}")
    print(secret)
    print("This secret is shown once: store it now. warmbox keeps only its hash (lost: revoke it, create another).")
    return 0


def _quotas(t: Tenant) -> str:
    parts = [
        f"sandboxes {t.max_sandboxes or 'any'}",
        f"memory {f'{t.max_memory_mb / 1024:g} GiB' if t.max_memory_mb else 'any'}",
        f"cpus {f'{t.max_cpus:g}' if t.max_cpus else 'any'}",
        f"tiers {','.join(t.tiers) if t.tiers else 'any'}",
        f"rate {f'{t.rate_per_s:g}/s' if t.rate_per_s else 'any'}",
        f"budget {_budget(t.budget_cpu_h, t.budget_gib_h)} per day",
    ]
    return ", ".join(parts)


def _budget_command(args: argparse.Namespace) -> int:
    from warmbox.engine.engine import Engine

    engine = Engine.for_home()
    reg = engine.registry
    reg.tenants.tenant(args.tenant)  # InvalidArgument if there is none
    if args.set is not None:
        cpu_h, gib_h = parse_budget(args.set)
        reg.usage.set_budget(args.tenant, cpu_h=cpu_h, gib_h=gib_h)
    b = reg.usage.budget_status(args.tenant, warn_ratio=engine.settings().approvals.warn_ratio)
    if args.json:
        print(json.dumps(dataclasses.asdict(b)))
        return 0
    day = time.strftime("%Y-%m-%d", time.gmtime(b.day))
    print(f"tenant {b.tenant}, {day} (UTC): budget {_budget(b.cpu_limit_h, b.gib_limit_h)} per day")
    for what, used, limit, ratio in (
        ("cpu", b.cpu_used_h, b.cpu_limit_h, b.cpu_ratio),
        ("mem", b.gib_used_h, b.gib_limit_h, b.gib_ratio),
    ):
        unit = "h" if what == "cpu" else "GiBh"
        of = f" of {limit:g}{unit} ({ratio:.0%})" if limit else " (no budget)"
        print(f"  {what}: {used:.4g}{unit} used{of}")
    if b.exceeded:
        print("  over budget: every start waits for approval (warmbox approvals ls)")
    elif b.warning:
        print("  warning: past the warning ratio ([approvals] warn_ratio)")
    return 0


def _budget(cpu_h: float, gib_h: float) -> str:
    parts = [f"cpu={cpu_h:g}h"] if cpu_h else []
    parts += [f"mem={gib_h:g}GiBh"] if gib_h else []
    return ",".join(parts) or "none"


def _ls(args: argparse.Namespace) -> int:
    keys = _registry().tenants.list_keys()
    if args.json:
        print(json.dumps([dataclasses.asdict(k) for k in keys]))
        return 0
    print(
        f"{'KEY':<16} {'TENANT':<16} {'ADMIN':<5} {'CREATED':<16} {'REVOKED':<16} {'SANDBOXES':>9} {'MEM GiB':>7} "
        f"{'CPUS':>5} {'RATE/s':>6} {'BUDGET/day':<20} TIERS"
    )
    for k in keys:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(k.created_at))
        revoked = time.strftime("%Y-%m-%d %H:%M", time.localtime(k.revoked_at)) if k.revoked_at else "-"
        print(
            f"{k.key_id:<16} {k.tenant:<16} {'yes' if k.admin else 'no':<5} {created:<16} {revoked:<16} "
            f"{k.max_sandboxes or '-':>9} {f'{k.max_memory_mb / 1024:g}' if k.max_memory_mb else '-':>7} "
            f"{f'{k.max_cpus:g}' if k.max_cpus else '-':>5} {f'{k.rate_per_s:g}' if k.rate_per_s else '-':>6} "
            f"{_budget(k.budget_cpu_h, k.budget_gib_h) if k.budget_cpu_h or k.budget_gib_h else '-':<20} "
            f"{','.join(k.tiers) if k.tiers else 'any'}"
        )
    return 0
