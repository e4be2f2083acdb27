"""``warmbox pool ls|resize|warm``, ``warmbox down`` and ``warmbox config``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import sys
import time

from warmbox.errors import WarmboxError


def _engine():
    from warmbox.engine.engine import Engine

    return Engine.for_home()


async def command(args: argparse.Namespace) -> int:
    from warmbox.engine import pool

    engine = _engine()
    settings = engine.settings()
    if args.pool_command == "ls":
        rows = pool.status(engine, settings)
        if args.json:
            print(json.dumps([dataclasses.asdict(r) for r in rows]))
            return 0
        print(f"{'POOL':<12} {'TIER':<10} {'TEMPLATE':<9} {'READY':>5} {'WARM':>4} {'TARGET':>6} {'MIN':>4} {'MAX':>4} "
              f"{'HITS':>6} {'MISSES':>6} {'FAILS':>5}  WARM-UP COST (cpu-s / GiB-s / wall-s)")
        for r in rows:
            print(f"{r.name:<12} {r.tier:<10} {r.template:<9} {r.ready:>5} {r.warming:>4} {r.target:>6} {r.min:>4} "
                  f"{r.max:>4} {r.hits:>6} {r.misses:>6} {r.warmup_failures:>5}  "
                  f"{r.cost_cpu_s:.2f} / {r.cost_memory_gib_s:.3f} / {r.cost_wall_s:.1f}")
            if r.last_error:
                print(f"{'':<12} last error: {r.last_error[:200]}")
        return 0
    if args.pool_command == "resize":
        st = pool.resize(engine, settings, args.name, args.target, args.min, args.max)
        print(f"pool {st.name}: target {st.target} (min {st.min}, max {st.max}), ready {st.ready}")
        if args.wait:
            return await warm([st.name], args.wait_timeout)
        return 0
    names = args.names or [n for n, r in ((r.name, r) for r in pool.status(engine, settings)) if r.target > 0]
    for n in names:
        if n not in settings.pools:
            raise WarmboxError(f"no pool {n!r} (pools: {', '.join(sorted(settings.pools))})")
    return await warm(names, args.wait_timeout)


async def warm(names: list[str], timeout: float) -> int:
    """Show a progress bar per pool until each has ``target`` ready sandboxes."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from warmbox.engine import pool

    engine = _engine()
    engine.ensure_daemon()
    deadline = time.monotonic() + timeout
    with Progress(TextColumn("pool {task.fields[pool]:<12}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[note]}"), TimeElapsedColumn(), transient=False,
                  disable=not sys.stderr.isatty(), console=None) as progress:
        tasks = {n: progress.add_task("", total=None, pool=n, note="") for n in names}
        while True:
            rows = {r.name: r for r in pool.status(engine, engine.settings())}
            done = True
            missing = [n for n in tasks if n not in rows]
            if missing:
                raise WarmboxError(f"pool {missing[0]!r} is no longer configured")
            for n, tid in tasks.items():
                r = rows[n]
                note = f"{r.warming} warming" + (f", last error: {r.last_error[:60]}" if r.last_error else "")
                progress.update(tid, total=max(r.target, 1), completed=min(r.ready, r.target), note=note)
                done = done and r.ready >= r.target
            if done:
                break
            if time.monotonic() > deadline:
                for n in names:
                    r = rows[n]
                    if r.ready < r.target:
                        print(f"warmbox: pool {n}: {r.ready}/{r.target} ready after {timeout:.0f} s"
                              + (f"; last error: {r.last_error}" if r.last_error else ""), file=sys.stderr)
                return 1
            await asyncio.sleep(0.2)
    for n in names:
        r = rows[n]
        print(f"pool {n}: {r.ready}/{r.target} ready")
    return 0


async def _stop_guard(home) -> None:
    """SIGTERM ``home``'s daemon guard and wait (at most 10 s) until it is gone."""
    from warmbox.engine import daemon

    guard = daemon.guard_pid_of(home)
    if guard is None:
        return
    try:
        os.kill(guard, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while daemon.guard_pid_of(home) == guard and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def down_home(home) -> tuple[int | None, list[str]]:
    """Stop ``home``'s daemon (it destroys its pooled sandboxes), then clean what a killed one
    left: creations whose creator died and pooled sandboxes. Returns (daemon pid, claimed ids left)."""
    from warmbox.engine import daemon
    from warmbox.engine.engine import Engine
    from warmbox.engine.pool import PoolManager

    engine = Engine.for_home(home)
    # its guard first (it would start a new daemon after the one stopped here only if that one
    # died unasked, but it may be starting one right now, after a crash: it stops that one too)
    await _stop_guard(engine.home)
    pid = daemon.pid_of(engine.home)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pid = None
        # it destroys its pooled sandboxes first: allow ~1 s each, at least two minutes
        limit = max(120.0, 1.0 * len(engine.list(include_pooled=True)))
        deadline = time.monotonic() + limit
        while pid is not None and daemon.pid_of(engine.home) == pid and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await _stop_guard(engine.home)  # one the daemon started again just before it was told to stop
        if pid is not None and daemon.pid_of(engine.home) == pid:
            raise WarmboxError(f"the daemon (pid {pid}) did not stop within {limit:.0f} s")
    await engine.reap()
    await PoolManager(engine).drain()
    if not engine.registry.live_links():  # no sandbox needs egress: the proxy and its netns go
        from warmbox.engine import egress
        from warmbox.network import netns

        await egress.stop_proxy(engine.home)
        if egress.proxy_pid(engine.home) is None:
            await netns.remove_egress(netns.egress_name(engine.runtime))
    return pid, [i.sandbox_id for i in engine.list()]


async def down() -> int:
    pid, left = await down_home(None)
    print(f"daemon {'stopped' if pid else 'was not running'}; no pooled sandboxes left"
          + (f"; {len(left)} claimed sandboxes keep running until their timeout" if left else ""))
    return 0


def show_config(as_json: bool) -> int:
    settings = _engine().settings()
    if as_json:
        print(json.dumps(dataclasses.asdict(settings)))
        return 0
    d = settings.defaults
    print(f"settings from: {settings.source}")
    print(f"defaults: tier={d.tier} template={d.template} timeout={d.timeout_s:.0f}s")
    print("templates:")
    for t in settings.templates.values():
        warm = "no code context" if t.warmup_code is None else (repr(t.warmup_code[:60]) if t.warmup_code else
                                                                  "code context started")
        cmds = f", {len(t.warmup_commands)} commands" if t.warmup_commands else ""
        print(f"  {t.name:<10} warm-up: {warm}{cmds}  {t.description}")
    print("pools:")
    for p in settings.pools.values():
        lim = p.limits
        print(f"  {p.name:<10} tier={p.tier} template={p.template} min={p.min} max={p.max} target={p.target} "
              f"max_age={p.max_age_s:.0f}s idle_shrink={p.idle_shrink_s:.0f}s limits=({lim.memory_mb} MiB, "
              f"{lim.cpus} cpus, {lim.pids} pids)")
    from warmbox import config

    print("limits (the most one sandbox may ask for):")
    for key in config.LIMIT_KEYS:
        print(f"  {key:<17} {config._fmt(getattr(settings.limits, key)):<8} {settings.limits.sources.get(key, '')}")
    return 0
