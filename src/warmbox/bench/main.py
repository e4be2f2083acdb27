"""``warmbox bench``: the command the CLI calls, which runs the benchmark its arguments name.

Each benchmark is a module of this package (``container`` holds start, burst, exec, snapshot and
density); this module only validates the arguments and dispatches (the parser is the CLI's).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from warmbox.bench import api, cli, cluster, container, e2b, isolate, microvm, profile, session, template
from warmbox.bench.common import VARIANTS, check_ranges
from warmbox.bench.home import _make_home, _remove_home
from warmbox.errors import InvalidArgument, WarmboxError

POOLS = {
    "bench-base": {"template": "base", "min": 2, "max": 2, "target": 2, "refill_concurrency": 1},
    "bench-pydata": {
        "template": "pydata",
        "min": 2,
        "max": 2,
        "target": 2,
        "refill_concurrency": 1,
        "limits": {"memory_mb": 512},
    },
    "bench-burst": {"template": "base", "min": 0, "max": 0, "target": 0, "refill_concurrency": 2},
    "bench-density-base": {"template": "base", "min": 0, "max": 0, "limits": {"memory_mb": 128}},
    "bench-density-shell": {"template": "shell", "min": 0, "max": 0, "limits": {"memory_mb": 96}},
}


def _validate(args: argparse.Namespace) -> None:
    table: dict[str, list[tuple[str, float, float]]] = {
        "start": [("runs", 1, 10000)],
        "burst": [("burst", 1, 500)],
        "exec": [("seconds", 0.01, 3600)],
        "snapshot": [("runs", 1, 1000), ("mb", 0, 4096)],
        "density": [("max", 1, 2000), ("step", 1, 2000), ("memory_bound_gib", 0.01, 1024), ("claims", 0, 1000)],
    }
    check_ranges(args, table[args.bench])
    if args.bench == "burst" and (not args.pools or any(not 0 <= n <= 500 for n in args.pools)):
        raise InvalidArgument("--pools sizes must be in [0, 500]")


async def _command_api(args: argparse.Namespace) -> int:
    api.validate(args)
    home = _make_home(api.pool_config(args.refill_concurrency))
    try:
        report = await api.bench_api(home, args)
    finally:
        await _remove_home(home)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        api.print_report(report)
    return 0


async def command(args: argparse.Namespace) -> int:
    if args.bench == "api":
        return await _command_api(args)
    if args.bench == "e2b":
        return await e2b.command(args)
    if args.bench == "cluster":
        return await cluster.command(args)
    if args.bench == "session":
        return await session.command(args)
    if args.bench == "template":
        return await template.command(args)
    if args.bench == "cli":
        return await cli.command(args)
    if args.bench == "profile":
        return await profile.command(args)
    if args.bench == "start" and args.runs is None:
        args.runs = {"microvm": 5, "isolate": 200}.get(args.tier, 20)
    _validate(args)
    variant = getattr(args, "variant", "both")
    wanted = {
        "start": tuple(f"bench-{VARIANTS[v][2]}" for v in VARIANTS if variant in (v, "both"))
        if getattr(args, "tier", "container") == "container"
        else (),
        "burst": ("bench-burst",),
        "exec": (),
        "snapshot": ("bench-pydata",) if getattr(args, "tier", "container") == "container" else (),
        "density": (f"bench-density-{getattr(args, 'template', 'base')}",),
    }[args.bench]
    pools = {k: v for k, v in POOLS.items() if k in wanted}
    if args.bench == "start" and args.tier == "isolate":
        pools = dict(isolate.POOLS)
    home = _make_home(pools)
    try:
        if args.bench == "start" and args.tier == "isolate":
            report = await isolate.bench_start(home, args.runs)
            printer: Callable[[dict[str, Any]], None] = isolate.print_report
        elif args.bench == "start" and args.tier == "microvm":
            report = await microvm.bench_start(home, args.runs, args.variant)
            printer = container._print_microvm
        elif args.bench == "start":
            report = await container.bench_start(home, args.runs, args.variant)
            printer = container._print_start
        elif args.bench == "burst":
            report = await container.bench_burst(home, args.burst, args.pools)
            printer = container._print_burst
        elif args.bench == "exec":
            report = await container.bench_exec(home, args.seconds)
            printer = container._print_exec
        elif args.bench == "snapshot":
            if args.tier == "microvm":
                report = await microvm.bench_snapshot(home, args.runs)
            elif args.tier == "gvisor":
                report = await container.bench_snapshot_gvisor(home, args.runs)
            else:
                report = await container.bench_snapshot(home, args.runs, args.mb)
            printer = container._print_snapshot
        else:
            if args.template not in ("base", "shell"):
                raise WarmboxError("bench density --template must be base or shell")
            report = await container.bench_density(
                home, args.max, args.step, args.memory_bound_gib, args.template, args.claims
            )
            printer = container._print_density
    finally:
        await _remove_home(home)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        printer(report)
    return 0
