"""Measure the E2B dialect against warmbox's own SDK over HTTP, in one run on one server.

    .venv/bin/python -m tests.e2b.bench [runs]

Starts `warmbox serve` on a fresh home with a warm pool of the pydata template (E2B's
code-interpreter-v1), then, for each SDK (the official ``e2b_code_interpreter`` through E2B's
routes; ``warmbox.Sandbox`` through /v1): a warm create followed by the first
``run_code("print(2+2)")`` (pool refilled between runs), and ``commands.run("true")`` round trips
on one sandbox. Prints p50/p90 in ms. Bounded: ``runs`` of each (default 20), then everything
it made is removed.
"""

from __future__ import annotations

import os
import secrets
import shutil
import statistics
import sys
import time
from pathlib import Path

from tests.conftest import start_server

CONFIG = """
[daemon]
idle_exit = 30

[pools.ci]
template = "pydata"
tier = "container"
min = 2
max = 2
target = 2
"""


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _wait_pool(engine, want: int, timeout: float = 120.0) -> None:
    from warmbox.engine import pool

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(p.ready for p in pool.status(engine, engine.settings()) if p.name == "ci") >= want:
            return
        time.sleep(0.2)
    raise SystemExit("the pool did not refill in time")


def main(runs: int) -> None:
    import asyncio

    from e2b_code_interpreter import Sandbox as E2BSandbox

    from warmbox import Sandbox as WbSandbox
    from warmbox.engine.daemon import down_home
    from warmbox.engine.engine import Engine

    home = Path(f"/tmp/wbbench-{secrets.token_hex(3)}")
    home.mkdir(mode=0o700)
    (home / "warmbox.toml").write_text(CONFIG)
    os.environ["WARMBOX_HOME"] = str(home)
    server = start_server(home, home / "api.sock")
    engine = Engine.for_home(home)
    try:
        _k, key = engine.registry.create_key("bench")
        engine.ensure_daemon()  # it fills the pool (a create would start it too)
        os.environ.update(E2B_API_URL=server.url, E2B_SANDBOX_URL=server.url, E2B_API_KEY=key)
        wb = {"api_url": server.url, "api_key": key}
        results: dict[str, list[float]] = {}
        for name in ("e2b", "warmbox"):
            firsts, pooled = [], 0
            for _ in range(runs):
                _wait_pool(engine, 2)
                t0 = time.perf_counter()
                if name == "e2b":
                    sb = E2BSandbox.create()
                    assert sb.run_code("print(2+2)").logs.stdout[0].startswith("4")
                    sid = sb.sandbox_id
                else:
                    sb = WbSandbox.create(template="pydata", tier="container", **wb)
                    assert sb.run_code("print(2+2)").stdout == "4\n"
                    sid = sb.sandbox_id
                firsts.append((time.perf_counter() - t0) * 1000)
                pooled += bool(engine.info(sid)[0].pool)
                sb.kill()
            results[f"{name} warm create -> first run_code (ms, {pooled}/{runs} from the pool)"] = firsts
            _wait_pool(engine, 2)
            sb = E2BSandbox.create() if name == "e2b" else WbSandbox.create(template="pydata", tier="container", **wb)
            trips = []
            for _ in range(runs + 3):
                t0 = time.perf_counter()
                sb.commands.run("true")
                trips.append((time.perf_counter() - t0) * 1000)
            sb.kill()
            results[f"{name} commands.run('true') (ms)"] = trips[3:]  # the first ones open connections
        for label, xs in results.items():
            print(f"{label}: p50 {statistics.median(xs):.1f}  p90 {_pct(xs, 0.9):.1f}  (n={len(xs)})")
    finally:
        server.stop()
        asyncio.run(down_home(home))
        for info in engine.list():
            asyncio.run(engine.destroy(info.sandbox_id, "bench teardown"))
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
