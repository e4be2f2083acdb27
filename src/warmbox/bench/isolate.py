"""``warmbox bench start --tier isolate``: Tier 1 against the raw engine (isolated-vm in a plain Node.js), same run.

Measured, interleaved where they compete:

- warm create -> first ``return 'ab'.toUpperCase()`` (a pooled isolate claimed, the snippet run
  through the SDK), cold create -> first (a new isolate in the running host), and the raw engine
  doing the same (``new Isolate`` + ``createContext`` + the snippet, in one Node.js process);
- snippet runs/s: one sandbox, serial, and ``CONCURRENCY`` sandboxes at once; raw: the same snippet
  in one isolate (``context.eval``, the async path the host uses) in a loop;
- idle isolate memory: the host process's RSS delta per sandbox with ``IDLE_COUNT`` sandboxes
  created through warmbox, against the RSS delta of as many raw isolates with a context each.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from warmbox.bench.common import _stats
from warmbox.bench.home import _wait_quiet
from warmbox.errors import WarmboxError

SNIPPET = "(() => { return 'ab'.toUpperCase() })()"
POOL = "bench-isolate"
POOL_SIZE = 8
MEMORY_MB = 64
IDLE_COUNT = 50  # x MEMORY_MB (+2): within one tenant host's isolate budget (backends.isolate.HOST_BUDGET_MB)
RATE_SECONDS = 2.0
CONCURRENCY = 4

POOLS: dict[str, dict[str, Any]] = {
    POOL: {
        "tier": "isolate",
        "template": "base",
        "min": POOL_SIZE,
        "max": POOL_SIZE,
        "target": POOL_SIZE,
        "refill_concurrency": 2,
        "limits": {"memory_mb": MEMORY_MB},
    }
}

# the raw engine: the same work in a plain Node.js with isolated-vm, no warmbox, no jail
RAW = r"""
const ivm = require(process.argv[2]);
const [runs, seconds, idle, memoryMb] = process.argv.slice(3).map(Number);
const snippet = process.argv[7];
const now = () => Number(process.hrtime.bigint()) / 1e6;
(async () => {
  const first = [];
  for (let i = 0; i < runs; i++) {
    const t0 = now();
    const iso = new ivm.Isolate({ memoryLimit: memoryMb });
    const ctx = await iso.createContext();
    const r = await ctx.eval(snippet, { timeout: 1000 });
    first.push(now() - t0);
    if (r !== 'AB') throw new Error('raw snippet gave ' + r);
    iso.dispose();
  }
  const iso = new ivm.Isolate({ memoryLimit: memoryMb });
  const ctx = await iso.createContext();
  let n = 0;
  const end = now() + seconds * 1000;
  while (now() < end) { await ctx.eval(snippet, { timeout: 1000 }); n++; }
  const rate = n / seconds;
  global.gc && global.gc();
  await new Promise((r) => setTimeout(r, 200));
  const before = process.memoryUsage().rss;
  const keep = [];
  for (let i = 0; i < idle; i++) {
    const isolate = new ivm.Isolate({ memoryLimit: memoryMb });
    const context = await isolate.createContext();
    await context.eval('1');
    keep.push([isolate, context]);
  }
  await new Promise((r) => setTimeout(r, 500));
  const perIsolate = (process.memoryUsage().rss - before) / idle;
  console.log(JSON.stringify({ first_ms: first, runs_per_s: rate, idle_bytes: perIsolate }));
})();
"""


def _raw(engine_dir: Path, runs: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".js", delete=False) as f:
        f.write(RAW)
    try:
        r = subprocess.run(
            ["node", f.name, str(engine_dir), str(runs), str(RATE_SECONDS), str(IDLE_COUNT), str(MEMORY_MB), SNIPPET],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        Path(f.name).unlink()
    if r.returncode != 0:
        raise WarmboxError(f"the raw isolated-vm run failed: {r.stderr.strip()[-400:]}")
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


async def _first(home: Path, pool: bool) -> tuple[float, bool]:
    from warmbox.models import Limits
    from warmbox.sdk.sandbox import AsyncSandbox

    limits = Limits(memory_mb=MEMORY_MB)  # the pool's shape
    t0 = time.perf_counter()
    sb = await AsyncSandbox.create(tier="isolate", timeout=120, pool=pool, limits=limits, home=home)
    try:
        ex = await sb.run_code(SNIPPET, language="javascript")
        ms = (time.perf_counter() - t0) * 1e3
    finally:
        await sb.kill()
    if ex.text != "'AB'":
        raise WarmboxError(f"the snippet gave {ex.text!r} ({ex.error})")
    return ms, sb.from_pool


async def _rate(home: Path, sandboxes: int) -> float:
    """Snippet runs/s through the SDK, ``sandboxes`` at once, each serial."""
    from warmbox.models import Limits
    from warmbox.sdk.sandbox import AsyncSandbox

    boxes = [
        await AsyncSandbox.create(
            tier="isolate", timeout=120, pool=False, limits=Limits(memory_mb=MEMORY_MB), home=home
        )
        for _ in range(sandboxes)
    ]
    try:
        for sb in boxes:  # one untimed run each (the first compile)
            await sb.run_code(SNIPPET, language="javascript")
        counts = [0] * sandboxes
        end = time.perf_counter() + RATE_SECONDS

        async def loop(i: int) -> None:
            while time.perf_counter() < end:
                await boxes[i].run_code(SNIPPET, language="javascript")
                counts[i] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(loop(i) for i in range(sandboxes)))
        return sum(counts) / (time.perf_counter() - t0)
    finally:
        for sb in boxes:
            await sb.kill()


async def _idle(home: Path) -> float:
    """The host's RSS delta per idle sandbox, IDLE_COUNT sandboxes made through warmbox."""
    from warmbox.backends.isolate import IsolateBackend
    from warmbox.engine.engine import Engine
    from warmbox.models import Limits
    from warmbox.sdk.sandbox import AsyncSandbox

    backend = Engine.for_home(home).backend("isolate")
    assert isinstance(backend, IsolateBackend)
    await asyncio.sleep(0.5)
    before = backend.host_stats()
    boxes = []
    try:
        for _ in range(IDLE_COUNT):
            sb = await AsyncSandbox.create(
                tier="isolate", timeout=300, pool=False, limits=Limits(memory_mb=MEMORY_MB), home=home
            )
            boxes.append(sb)
        await asyncio.sleep(0.5)
        after = backend.host_stats()
    finally:
        for sb in boxes:
            await sb.kill()
    if before is None or after is None:
        raise WarmboxError("the isolate host did not report its memory")
    return (int(after["rss"]) - int(before["rss"])) / IDLE_COUNT


async def bench_start(home: Path, runs: int) -> dict[str, Any]:
    from warmbox.backends.isolate import IsolateBackend
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    backend = engine.backend("isolate")
    assert isinstance(backend, IsolateBackend)
    avail = backend.probe()
    if not avail.available:
        raise WarmboxError(f"the isolate tier is unavailable: {avail.reason}")
    try:
        engine.ensure_daemon()
        await _wait_quiet(engine, POOL)
        await _first(home, True)  # untimed: the first compile, the first claim
        await _first(home, False)
        warm: list[float] = []
        cold: list[float] = []
        misses = 0
        for _ in range(runs):
            await _wait_quiet(engine, POOL)
            ms, hit = await _first(home, True)
            warm.append(ms)
            misses += not hit
            cold.append((await _first(home, False))[0])
        raw = await asyncio.to_thread(_raw, backend.engine_dir, runs)
        serial = await _rate(home, 1)
        parallel = await _rate(home, CONCURRENCY)
        idle = await _idle(home)
        stats = {"warm_pool": _stats(warm), "warmbox_cold": _stats(cold), "raw_isolate": _stats(raw["first_ms"])}
        return {
            "bench": "start",
            "tier": "isolate",
            "runs": runs,
            "snippet": SNIPPET,
            "stats": stats,
            "ratios_p50": {
                "warm_pool/raw_isolate": stats["warm_pool"]["p50_ms"] / stats["raw_isolate"]["p50_ms"],
                "warmbox_cold/raw_isolate": stats["warmbox_cold"]["p50_ms"] / stats["raw_isolate"]["p50_ms"],
            },
            "pool_misses": misses,
            "runs_per_s": {"warmbox_1": serial, f"warmbox_{CONCURRENCY}": parallel, "raw_isolate": raw["runs_per_s"]},
            "idle_mib_per_isolate": {"warmbox": idle / (1 << 20), "raw_isolate": raw["idle_bytes"] / (1 << 20)},
            "idle_count": IDLE_COUNT,
        }
    finally:
        from warmbox.engine.daemon import down_home

        await down_home(home)  # its pool's sandboxes, then the isolate host


def print_report(r: dict[str, Any]) -> None:
    print(f"bench start [tier isolate] create -> first {r['snippet']!r} ({r['runs']} interleaved runs)")
    for m, s in r["stats"].items():
        print(
            f"  {m:<15} p50 {s['p50_ms']:8.3f} ms   p95 {s['p95_ms']:8.3f} ms   p99 {s['p99_ms']:8.3f} ms"
            f"   min {s['min_ms']:8.3f} ms   (n={s['n']})"
        )
    for k, v in r["ratios_p50"].items():
        print(f"  ratio {k:<26} {v:7.2f}x")
    print("  snippet runs/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in r["runs_per_s"].items()))
    print(
        f"  idle memory per isolate ({r['idle_count']} live): "
        + ", ".join(f"{k} {v:.2f} MiB" for k, v in r["idle_mib_per_isolate"].items())
    )
    print(f"  pool misses during the run: {r['pool_misses']}")
