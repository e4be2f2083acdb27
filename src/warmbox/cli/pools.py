"""``warmbox pool ls|resize|warm``, ``warmbox down`` and ``warmbox config``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from typing import TYPE_CHECKING

from warmbox import operations as ops
from warmbox.cli.context import transport
from warmbox.errors import ConfigError, WarmboxError

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine


def host_engine() -> Engine:
    """This home's engine itself, not a transport to its front: ``pool warm``, ``down`` and ``config``
    need its settings and its daemon, which are no operations."""
    from warmbox.engine.engine import Engine

    return Engine.for_home()


async def command(args: argparse.Namespace) -> int:
    if args.pool_command == "ls":
        rows = await transport().handle(ops.PoolsList())
        if args.json:
            print(json.dumps([dataclasses.asdict(r) for r in rows]))
            return 0
        print(
            f"{'POOL':<12} {'TIER':<10} {'TEMPLATE':<9} {'READY':>5} {'WARM':>4} {'TARGET':>6} {'MIN':>4} {'MAX':>4} "
            f"{'HITS':>6} {'MISSES':>6} {'FAILS':>5}  WARM-UP COST (cpu-s / GiB-s / wall-s)"
        )
        for r in rows:
            print(
                f"{r.name:<12} {r.tier:<10} {r.template:<9} {r.ready:>5} {r.warming:>4} {r.target:>6} {r.min:>4} "
                f"{r.max:>4} {r.hits:>6} {r.misses:>6} {r.warmup_failures:>5}  "
                f"{r.cost_cpu_s:.2f} / {r.cost_memory_gib_s:.3f} / {r.cost_wall_s:.1f}"
            )
            if r.last_error:
                print(f"{'':<12} last error: {r.last_error[:200]}")
        return 0
    if args.pool_command == "resize":
        st = await transport().handle(ops.PoolsResize(args.name, args.target, args.min, args.max))
        note = ""
        if args.target is not None and st.target != args.target:
            note = f" ({args.target} is {'above its max' if args.target > st.target else 'below its min'})"
        print(f"pool {st.name}: target {st.target}{note} (min {st.min}, max {st.max}), ready {st.ready}")
        if args.wait:
            return await warm([st.name], args.wait_timeout, held={st.name: st.target})
        return 0
    # `pool warm` stays on the engine: it needs the settings and ensure_daemon, which are no operations
    from warmbox.engine import pool

    engine = host_engine()
    settings = engine.settings()
    names = args.names or [n for n, r in ((r.name, r) for r in pool.status(engine, settings)) if r.target > 0]
    for n in names:
        if n not in settings.pools:
            raise WarmboxError(f"no pool {n!r} (pools: {', '.join(sorted(settings.pools))})")
    return await warm(names, args.wait_timeout)


async def warm(names: list[str], timeout: float, held: dict[str, int] | None = None) -> int:
    """Show a progress bar per pool until each has ``target`` ready sandboxes; else say why not
    (the time ran out: with the pool's last warm-up error; or a ``held`` target was changed)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from warmbox.engine import pool

    engine = host_engine()
    engine.ensure_daemon()
    deadline = time.monotonic() + timeout
    with Progress(
        TextColumn("pool {task.fields[pool]:<12}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        transient=False,
        disable=not sys.stderr.isatty(),
        console=None,
    ) as progress:
        tasks = {n: progress.add_task("", total=None, pool=n, note="") for n in names}
        while True:
            rows = {r.name: r for r in pool.status(engine, engine.settings())}
            done = True
            missing = [n for n in tasks if n not in rows]
            if missing:
                raise WarmboxError(f"pool {missing[0]!r} is no longer configured")
            for n, tid in tasks.items():
                r = rows[n]
                if held and n in held and r.target != held[n]:
                    print(
                        f"warmbox: pool {n}: its target became {r.target} (was {held[n]}) while waiting: another "
                        f"resize or a change of its configuration; {r.ready}/{r.target} ready",
                        file=sys.stderr,
                    )
                    return 1
                note = f"{r.warming} warming" + (f", last error: {r.last_error[:60]}" if r.last_error else "")
                progress.update(tid, total=max(r.target, 1), completed=min(r.ready, r.target), note=note)
                done = done and r.ready >= r.target
            if done:
                break
            if time.monotonic() > deadline:
                for n in names:
                    r = rows[n]
                    if r.ready < r.target:
                        print(
                            f"warmbox: pool {n}: {r.ready}/{r.target} ready, {r.warming} warming after {timeout:.0f} s"
                            + (f"; last error: {r.last_error}" if r.last_error else "; no warm-up failed: slow starts"),
                            file=sys.stderr,
                        )
                return 1
            await asyncio.sleep(0.2)
    for n in names:
        r = rows[n]
        print(f"pool {n}: {r.ready}/{r.target} ready")
    return 0


async def down() -> int:
    from warmbox.engine.daemon import down_home

    pid, left = await down_home(None)
    print(
        f"daemon {'stopped' if pid else 'was not running'}; no pooled sandboxes left"
        + (f"; {len(left)} claimed sandboxes keep running until their timeout" if left else "")
    )
    return 0


def show_config(as_json: bool) -> int:
    try:
        settings = host_engine().settings()
    except ConfigError as e:
        raise ConfigError(
            f"{e} (a warmbox serve or daemon of this home that read it before keeps its last good settings "
            "until it is fixed)"
        ) from None
    if as_json:
        print(json.dumps(dataclasses.asdict(settings)))
        return 0
    d = settings.defaults
    print(f"settings from: {settings.source}")
    print(f"defaults: tier={d.tier} template={d.template} timeout={d.timeout_s:.0f}s")
    print("templates:")
    for t in settings.templates.values():
        warm = (
            "no code context"
            if t.warmup_code is None
            else (repr(t.warmup_code[:60]) if t.warmup_code else "code context on first use")
        )
        cmds = f", {len(t.warmup_commands)} commands" if t.warmup_commands else ""
        print(f"  {t.name:<10} warm-up: {warm}{cmds}  {t.description}")
    if settings.registry_mirror:
        print(f"  (Docker Hub's images from the mirror {settings.registry_mirror})")
    print("pools:")
    for p in settings.pools.values():
        lim = p.limits
        print(
            f"  {p.name:<10} tier={p.tier} template={p.template} min={p.min} max={p.max} target={p.target} "
            f"max_age={p.max_age_s:.0f}s idle_shrink={p.idle_shrink_s:.0f}s limits=({lim.memory_mb} MiB, "
            f"{lim.cpus} cpus, {lim.pids} pids)"
        )
    from warmbox import config

    print("limits (the most one sandbox may ask for):")
    for key in config.LIMIT_KEYS:
        print(f"  {key:<17} {config._fmt(getattr(settings.limits, key)):<8} {settings.limits.sources.get(key, '')}")
    c = settings.cost
    if c.priced:
        print(f"cost: {c.cpu_hour:g} {c.currency} per CPU-hour, {c.gib_hour:g} {c.currency} per GiB-hour")
    return 0
