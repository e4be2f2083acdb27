"""``warmbox bench e2b`` — E2B's official Python SDK against warmbox serve, beside warmbox's own SDK
over HTTP, in one run on one server.

warm:  a create from a warm pool of ``pydata`` (E2B's ``code-interpreter-v1``) then the first
       ``run_code("print(2+2)")``, through ``e2b_code_interpreter.AsyncSandbox`` (E2B's routes)
       and ``warmbox.AsyncSandbox`` (/v1), alternating per run, the pool refilled before each.
exec:  ``commands.run("true")`` round trips on one sandbox each way.

Goals (issue 32): E2B warm p50 <= 15 ms, E2B exec p50 <= 5 ms. The server is a subprocess on the
benchmark's private home, reached over 127.0.0.1 with a key the benchmark creates; every sandbox
is killed, the server stopped by its pid and the home removed at the end. Needs the ``e2b`` extra
(``pip install 'warmbox[e2b]'``).
"""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path
from typing import Any

from warmbox.bench.api import Server
from warmbox.bench.common import _stats, check_ranges
from warmbox.bench.home import _wait_quiet, in_own_home
from warmbox.errors import WarmboxError

POOL = "bench-e2b"
TEMPLATE = "pydata"  # what E2B's code-interpreter-v1 maps to
CODE = "print(2+2)"
GOAL_WARM_MS = 15.0
GOAL_EXEC_MS = 5.0
SIDES = ("e2b", "warmbox")


def pool_config() -> dict[str, dict[str, Any]]:
    return {POOL: {"template": TEMPLATE, "tier": "container", "min": 2, "max": 2, "target": 2, "idle_shrink": 3600}}


def validate(args: argparse.Namespace) -> None:
    check_ranges(args, [("runs", 1, 1000), ("execs", 1, 100000)])


def _e2b() -> Any:
    try:
        return importlib.import_module("e2b_code_interpreter")
    except ImportError:
        raise WarmboxError("warmbox bench e2b needs E2B's SDK: pip install 'warmbox[e2b]'") from None


async def _open(side: str, server: Server) -> Any:
    """A sandbox from the pool, by one SDK or the other (both over the server's TCP port)."""
    assert server.key is not None
    if side == "e2b":
        where = {"api_key": server.key, "api_url": server.url, "sandbox_url": server.url}
        return await _e2b().AsyncSandbox.create(**where)
    from warmbox.sdk.sandbox import AsyncSandbox

    return await AsyncSandbox.create(template=TEMPLATE, tier="container", api_url=server.url, api_key=server.key)


async def _first_cell(side: str, sb: Any) -> None:
    ex = await sb.run_code(CODE)
    out = "".join(ex.logs.stdout) if side == "e2b" else ex.stdout
    if out != "4\n":
        raise WarmboxError(f"{side}: run_code({CODE!r}) printed {out!r}")


async def part_warm(home: Path, server: Server, runs: int) -> dict[str, Any]:
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    samples: dict[str, list[float]] = {s: [] for s in SIDES}
    pooled = dict.fromkeys(SIDES, 0)
    for i in range(runs):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            await _wait_quiet(engine, POOL)
            t0 = time.perf_counter()
            sb = await _open(side, server)
            try:
                await _first_cell(side, sb)
                samples[side].append((time.perf_counter() - t0) * 1000)
                pooled[side] += bool(engine.info(sb.sandbox_id)[0].pool)
            finally:
                await sb.kill()
    return {"stats": {s: _stats(v) for s, v in samples.items()}, "from_pool": pooled, "runs": runs}


async def part_exec(home: Path, server: Server, execs: int) -> dict[str, Any]:
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    samples: dict[str, list[float]] = {}
    for side in SIDES:
        await _wait_quiet(engine, POOL)
        sb = await _open(side, server)
        try:
            for _ in range(3):  # connections opened, the login shell's files cached
                await sb.commands.run("true")
            await _wait_quiet(engine, POOL)  # the pool's refill after this claim competes for CPU no more
            times = []
            for _ in range(execs):
                t0 = time.perf_counter()
                await sb.commands.run("true")
                times.append((time.perf_counter() - t0) * 1000)
            samples[side] = times
        finally:
            await sb.kill()
    return {"stats": {s: _stats(v) for s, v in samples.items()}, "runs": execs}


async def bench_e2b(home: Path, args: argparse.Namespace) -> dict[str, Any]:
    from warmbox.engine.engine import Engine

    _e2b()  # before anything starts: the extra is there
    t_start = time.monotonic()
    engine = Engine.for_home(home)
    engine.ensure_daemon()
    await _wait_quiet(engine, POOL)
    server = Server(home, tcp=True)
    try:
        server.start()
        report: dict[str, Any] = {
            "bench": "e2b",
            "url": server.url,
            "warm": await part_warm(home, server, args.runs),
            "exec": await part_exec(home, server, args.execs),
        }
        if server.proc is not None and server.proc.poll() is not None:
            raise WarmboxError(f"warmbox serve exited during the benchmark: {server.tail()}")
    finally:
        server.stop()
    warm, exe = report["warm"]["stats"]["e2b"]["p50_ms"], report["exec"]["stats"]["e2b"]["p50_ms"]
    report["goals"] = {
        f"e2b_warm_create_first_run_code_p50_ms<={GOAL_WARM_MS:g}": {
            "measured": round(warm, 3),
            "met": warm <= GOAL_WARM_MS,
        },
        f"e2b_commands_run_true_p50_ms<={GOAL_EXEC_MS:g}": {"measured": round(exe, 3), "met": exe <= GOAL_EXEC_MS},
    }
    report["seconds"] = time.monotonic() - t_start
    return report


async def command(args: argparse.Namespace) -> int:
    validate(args)
    _e2b()
    await in_own_home(pool_config(), lambda home: bench_e2b(home, args), print_report, args.json)
    return 0


def print_report(r: dict[str, Any]) -> None:
    for title, part in (("warm create -> first run_code", r["warm"]), ('commands.run("true")', r["exec"])):
        print(f"{title} ({part['runs']} runs a side)")
        for side, s in part["stats"].items():
            extra = f"   from the pool {part['from_pool'][side]}/{part['runs']}" if "from_pool" in part else ""
            print(f"  {side:<8} p50 {s['p50_ms']:8.2f} ms   p99 {s['p99_ms']:8.2f} ms{extra}")
    for goal, g in r["goals"].items():
        print(f"goal {goal}: {g['measured']:.2f} {'met' if g['met'] else 'NOT met'}")
    print(f"({r['seconds']:.0f} s)")


__all__ = ["bench_e2b", "command", "pool_config", "print_report", "validate"]
