"""What every benchmark's run shares: a private home made for it (its own warmbox.toml) and removed
after, a pool waited on until it is quiet, a table of timings, a progress bar."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from warmbox.errors import WarmboxError


def _progress(total: int, what: str):
    """A rich progress bar on a terminal (stderr); nothing otherwise."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn(what),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
        disable=not sys.stderr.isatty(),
    )
    return progress, total


_SAVED_ENV: dict[str, str] = {}


def _make_home(pools: dict[str, dict[str, Any]], templates: dict[str, dict[str, Any]] | None = None) -> Path:
    """A private WARMBOX_HOME whose warmbox.toml declares only ``pools`` and ``templates`` (never
    the user's)."""
    from warmbox.engine.engine import Engine

    home = Path(f"/tmp/wbbench-{secrets.token_hex(3)}")
    home.mkdir(mode=0o700)
    write_config(home, pools, templates)
    for k in list(os.environ):  # the user's config and overrides are not the benchmark's
        if k == "WARMBOX_CONFIG" or (k.startswith("WARMBOX_") and "__" in k):
            _SAVED_ENV[k] = os.environ.pop(k)
    Engine.for_home(home)
    return home


def write_config(
    home: Path, pools: dict[str, dict[str, Any]], templates: dict[str, dict[str, Any]] | None = None
) -> None:
    """(Re)write a benchmark home's warmbox.toml: its daemon reads it again on its next tick."""

    def table(name: str, body: dict[str, Any]) -> list[str]:
        lines = [f"[{name}]"]
        for k, v in body.items():
            if isinstance(v, dict):
                v = "{ " + ", ".join(f"{a} = {json.dumps(b)}" for a, b in v.items()) + " }"
            else:
                v = json.dumps(v)
            lines.append(f"{k} = {v}")
        return lines

    lines = ["[daemon]", "idle_exit = 2", "[pools]"]
    for name, body in pools.items():
        lines += table(f"pools.{name}", body)
    for name, body in (templates or {}).items():
        lines += table(f"templates.{name}", body)
    (home / "warmbox.toml").write_text("\n".join(lines) + "\n")


async def _remove_home(home: Path) -> None:
    from warmbox.engine import guard, teardown
    from warmbox.engine.daemon import down_home
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    try:
        try:
            await down_home(home)
        except WarmboxError:  # a daemon too slow to stop: end it, and destroy its sandboxes here
            pid = guard.pid_of(home)
            if pid is not None:
                os.kill(pid, 9)
        for info in engine.list(include_pooled=True) + [i for i in engine.holding() if i.state.value == "failed"]:
            await teardown.destroy(engine, info.sandbox_id, "benchmark finished")
    finally:
        os.environ.update(_SAVED_ENV)
    # only now, with no sandbox left, may their directories go
    if not engine.holding():
        shutil.rmtree(home, ignore_errors=True)
        if not os.environ.get("WARMBOX_RUNTIME_DIR"):
            shutil.rmtree(engine.runtime, ignore_errors=True)
    Engine._instances.pop(home, None)


async def in_own_home(
    pools: dict[str, dict[str, Any]],
    run: Callable[[Path], Awaitable[dict[str, Any]]],
    printer: Callable[[dict[str, Any]], None],
    as_json: bool,
    templates: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One benchmark run in a private home made for it (``pools``, ``templates``) and removed
    after, its report printed as JSON or by ``printer``; the report."""
    home = _make_home(pools, templates)
    try:
        report = await run(home)
    finally:
        await _remove_home(home)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        printer(report)
    return report


async def _wait_quiet(engine: Any, pool: str, timeout: float = 300.0) -> None:
    """Until the pool holds its target and nothing is being warmed (no refill competes for CPU)."""
    deadline = time.monotonic() + timeout
    while True:
        engine.settings()  # a broken config is a typed error now, not a timeout later
        row = engine.registry.pools.pool_rows().get(pool)
        ready, warming = engine.registry.pools.pool_counts(pool)
        if row is not None and ready == row.target and warming == 0:
            return
        if time.monotonic() > deadline:
            err = row.last_error if row else ""
            raise WarmboxError(
                f"pool {pool} did not fill within {timeout:.0f} s ({ready} ready)" + (f": {err}" if err else "")
            )
        await asyncio.sleep(0.05)


def _print_table(title: str, stats: dict[str, dict[str, float]], extra: list[str] | tuple[()] = ()) -> None:
    print(title)
    for m, s in stats.items():
        print(
            f"  {m:<15} p50 {s['p50_ms']:8.2f} ms   p95 {s['p95_ms']:8.2f} ms   p99 {s['p99_ms']:8.2f} ms"
            f"   min {s['min_ms']:8.2f} ms   (n={s['n']})"
        )
    for line in extra:
        print("  " + line)
