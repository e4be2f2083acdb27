"""``warmbox bench start|burst|exec|density`` — every figure measured in the same run, interleaved.

(``warmbox bench api``, the HTTP API against the engine in process, is :mod:`warmbox.bench.api`.)

start:   create -> first command for a warm-pool sandbox, a cold warmbox sandbox, raw ``runc run``
         (the very OCI config warmbox generates — same user namespace, seccomp, cgroups, mounts —
         with the command as its process) and raw ``bwrap``; for the empty loop and the
         real-agent command (numpy + pandas, write and describe a 1,000-row CSV).
         ``warm_pool`` runs the code in the pooled sandbox's already started Python (that is
         what a warm pool is for); ``warm_pool_exec`` runs the very same ``python3 -c`` process
         as the cold rows, to show what a fresh interpreter costs on top.
burst:   N concurrent creates (+ first command) against a pool of N and a smaller one.
exec:    commands/s for ``true`` in one warm sandbox; empty request round trip vs a raw
         unix-socket round trip between two processes (the physical floor).
density: idle warm sandboxes per step until a count or memory bound; memory per sandbox as
         the cgroup sees it, as private (USS) and proportional (PSS) pages of its processes,
         and as the host's MemAvailable drop; against raw runc containers (the same OCI
         config) whose PID 1 is a bare sleeping ``python3``, measured in the same run.

The benchmarks run in a private WARMBOX_HOME with their own pools (never the user's), which
is stopped and removed at the end. Results: a readable table, or JSON with ``--json``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from warmbox.bench.common import EMPTY, VARIANTS, _pct, _stats
from warmbox.bench.home import _print_table, _progress, _wait_quiet
from warmbox.bench.raw import (
    _blocking_ping_rtt,
    _bwrap,
    _raw_fs_snapshot,
    _raw_rtt,
    _RawRunc,
    _RawRunsc,
    raw_template_loop,
)
from warmbox.errors import WarmboxError

# ---------------------------------------------------------------------------- helpers


async def _cold(home: Path, cmd: list[str]) -> tuple[float, str, list]:
    from warmbox.sdk.sandbox import AsyncSandbox

    t0 = time.perf_counter()
    sb = await AsyncSandbox.create(tier="container", timeout=120, template="shell", pool=False, home=home)
    try:
        r = await sb.commands.run(cmd, timeout=120)
        ms = (time.perf_counter() - t0) * 1e3
    finally:
        await sb.kill()
    if r.exit_code != 0:
        raise WarmboxError(f"warmbox run failed: {r.stderr[-300:]}")
    return ms, r.stdout, sb.stage_timings


async def _warm(home: Path, template: str, code: str | None, cmd: list[str] | None) -> tuple[float, str, list, bool]:
    from warmbox.sdk.sandbox import AsyncSandbox

    t0 = time.perf_counter()
    sb = await AsyncSandbox.create(tier="container", timeout=120, template=template, home=home)
    try:
        if code is not None:
            ex = await sb.run_code(code, timeout=120)
            ms = (time.perf_counter() - t0) * 1e3
            if ex.error:
                raise WarmboxError(f"warm run failed: {ex.error.name}: {ex.error.value}")
            stdout = ex.stdout
        else:
            assert cmd is not None
            r = await sb.commands.run(cmd, timeout=120)
            ms = (time.perf_counter() - t0) * 1e3
            if r.exit_code != 0:
                raise WarmboxError(f"warm run failed: {r.stderr[-300:]}")
            stdout = r.stdout
    finally:
        await sb.kill()
    return ms, stdout, sb.stage_timings, sb.from_pool


# ---------------------------------------------------------------------------- start


async def bench_start(home: Path, runs: int, variant: str) -> dict:
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    raw = _RawRunc(engine.runtime)
    have_bwrap = shutil.which("bwrap") is not None
    chosen = list(VARIANTS) if variant == "both" else [variant]
    report: dict = {"bench": "start", "runs": runs, "variants": {}}
    methods = ["warm_pool", "warm_pool_exec", "warmbox_cold", "raw_runc"] + (["raw_bwrap"] if have_bwrap else [])
    progress, _ = _progress(0, "bench start")
    with progress:
        for name in chosen:
            cmd, code, template = VARIANTS[name]
            pool = f"bench-{template}"
            task = progress.add_task(name, total=runs * len(methods))
            engine.ensure_daemon()
            await _wait_quiet(engine, pool)
            # one untimed round of each so page cache and the image build are out of the numbers
            await _cold(home, cmd)
            raw.run(cmd)
            if have_bwrap:
                _bwrap(cmd)
            samples: dict[str, list[float]] = {m: [] for m in methods}
            stages: dict[str, dict[str, list[float]]] = {"warm_pool": {}, "warmbox_cold": {}}
            outputs: set[str] = set()
            misses = 0
            for i in range(runs):
                order = methods[i % len(methods) :] + methods[: i % len(methods)]  # rotate the order
                for m in order:
                    if m.startswith("warm_pool"):
                        await _wait_quiet(engine, pool)
                        ms, out, st, hit = await _warm(
                            home, template, code if m == "warm_pool" else None, None if m == "warm_pool" else cmd
                        )
                        misses += not hit
                    elif m == "warmbox_cold":
                        ms, out, st = await _cold(home, cmd)
                    elif m == "raw_runc":
                        ms, out = raw.run(cmd)
                        st = []
                    else:
                        ms, out = _bwrap(cmd)
                        st = []
                    if m in stages:
                        for t in st:
                            if t.on_request_path:
                                stages[m].setdefault(t.stage, []).append(t.duration_ms)
                    samples[m].append(ms)
                    outputs.add(out.strip())
                    progress.advance(task)
            stats = {m: _stats(v) for m, v in samples.items() if v}
            ratios = {}
            for a in ("warm_pool", "warmbox_cold"):
                for b in ("warmbox_cold", "raw_runc", "raw_bwrap"):
                    if a != b and b in stats:
                        ratios[f"{a}/{b}"] = stats[a]["p50_ms"] / stats[b]["p50_ms"]
            report["variants"][name] = {
                "command": cmd,
                "warm_pool_code": code,
                "template": template,
                "stats": stats,
                "ratios_p50": ratios,
                "pool_misses": misses,
                "stages_on_request_path_p50_ms": {
                    m: {k: statistics.median(v) for k, v in d.items()} for m, d in stages.items()
                },
                "distinct_outputs": len(outputs),
            }
    return report


def _print_start(report: dict) -> None:
    for name, v in report["variants"].items():
        extra = [f"ratio {k:<26} {r:6.3f}x" for k, r in v["ratios_p50"].items()]
        for m, d in v["stages_on_request_path_p50_ms"].items():
            extra.append(f"{m} stages on the request path, p50 ms: " + ", ".join(f"{k}={x:.2f}" for k, x in d.items()))
        extra.append(f"pool misses during the run: {v['pool_misses']}; distinct outputs: {v['distinct_outputs']}")
        _print_table(
            f"bench start [{name}] {' '.join(v['command'])[:60]!r}  ({report['runs']} interleaved runs each)",
            v["stats"],
            extra,
        )


# ---------------------------------------------------------------------------- burst


async def bench_burst(home: Path, burst: int, pool_sizes: list[int]) -> dict:
    from warmbox.engine import pool as pools
    from warmbox.engine.engine import Engine
    from warmbox.sdk.sandbox import AsyncSandbox

    engine = Engine.for_home(home)
    report: dict = {"bench": "burst", "burst": burst, "runs": []}
    for size in pool_sizes:
        pools.resize(engine, engine.settings(), "bench-burst", size, min=size, max=size)
        await _wait_quiet(engine, "bench-burst", timeout=600)

        async def one(t0: float) -> tuple[float, bool, Any]:
            sb = await AsyncSandbox.create(tier="container", timeout=300, template="base", home=home)
            r = await sb.run_code("print(2+2)")
            ms = (time.perf_counter() - t0) * 1e3
            if r.stdout.strip() != "4":
                raise WarmboxError(f"burst sandbox answered {r.stdout!r}")
            return ms, sb.from_pool, sb

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(t0) for _ in range(burst)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        ok = [r for r in results if not isinstance(r, BaseException)]
        await asyncio.gather(*(sb.kill() for _, _, sb in ok), return_exceptions=True)
        pools.resize(engine, engine.settings(), "bench-burst", 0, min=0, max=0)
        if errors:
            raise WarmboxError(f"{len(errors)} of {burst} burst creates failed: {errors[0]}")
        lat = [ms for ms, _, _ in ok]
        hits = [ms for ms, hit, _ in ok if hit]
        cold = [ms for ms, hit, _ in ok if not hit]
        st = _stats(lat)
        report["runs"].append(
            {
                "pool": size,
                "hits": len(hits),
                "cold": len(cold),
                "stats": st,
                "p99_over_p50": st["p99_ms"] / st["p50_ms"],
                "hit_stats": _stats(hits) if hits else None,
                "cold_stats": _stats(cold) if cold else None,
            }
        )
        await _wait_quiet(engine, "bench-burst")
    return report


def _print_burst(report: dict) -> None:
    for r in report["runs"]:
        s = r["stats"]
        print(
            f"bench burst: {report['burst']} concurrent creates + first run_code, pool of {r['pool']} "
            f"({r['hits']} hits, {r['cold']} cold)"
        )
        print(f"  all   p50 {s['p50_ms']:8.1f} ms   p99 {s['p99_ms']:8.1f} ms   p99/p50 {r['p99_over_p50']:.2f}")
        for k in ("hit_stats", "cold_stats"):
            if r[k]:
                print(f"  {k[:-6]:<5} p50 {r[k]['p50_ms']:8.1f} ms   p99 {r[k]['p99_ms']:8.1f} ms   (n={r[k]['n']})")


# ---------------------------------------------------------------------------- exec


async def bench_exec(home: Path, seconds: float) -> dict:
    from warmbox.engine.engine import Engine
    from warmbox.sdk.sandbox import AsyncSandbox

    sb = await AsyncSandbox.create(tier="container", timeout=300, template="shell", pool=False, home=home)
    try:
        await sb.commands.run(["true"])
        rates = {}
        for conc in (1, 4):
            n = 0
            t0 = time.perf_counter()
            end = t0 + seconds

            async def worker(end: float = end) -> None:
                nonlocal n
                while time.perf_counter() < end:
                    r = await sb.commands.run(["true"])
                    if r.exit_code != 0:
                        raise WarmboxError("`true` failed")
                    n += 1

            await asyncio.gather(*(worker() for _ in range(conc)))
            rates[f"concurrency_{conc}"] = n / (time.perf_counter() - t0)
        keyed = await _keyed_cost(sb, seconds)
        await sb.run_code("1")  # untimed: starts the code context
        cells = 0
        t0 = time.perf_counter()
        while time.perf_counter() < t0 + seconds:
            ex = await sb.run_code("1")
            if ex.error is not None:
                raise WarmboxError(f"run_code failed: {ex.error.name}")
            cells += 1
        code_rate = cells / (time.perf_counter() - t0)
        pings = []
        for _ in range(2000):
            t = time.perf_counter()
            await sb.ping()
            pings.append((time.perf_counter() - t) * 1e6)
        socket_path = Engine.for_home(home).info(sb.sandbox_id)[1].socket_path
        blocking = await asyncio.to_thread(_blocking_ping_rtt, socket_path, 2000)
        raw = await asyncio.to_thread(_raw_rtt, 2000)
    finally:
        await sb.kill()
    us = lambda v: {"p50_us": statistics.median(v), "p99_us": _pct(v, 0.99), "min_us": min(v)}  # noqa: E731
    return {
        "bench": "exec",
        "true_per_second": rates,
        "idempotency_key": keyed,
        "run_code_per_second": code_rate,
        "ping_sdk_asyncio": us(pings),
        "ping_blocking_client": us(blocking),
        "raw_unix_socket_rtt": us(raw),
        "ratio_ping_sdk/raw": statistics.median(pings) / statistics.median(raw),
        "ratio_ping_blocking/raw": statistics.median(blocking) / statistics.median(raw),
    }


IDEMPOTENCY_GOAL_MS = 0.3  # a keyed commands.run("true") may cost this much more at p50 (issue 37)


async def _keyed_cost(sb: Any, seconds: float) -> dict[str, Any]:
    """commands.run(["true"]) without and with an idempotency key, in alternation (the same drift
    on both): each one's p50 and what the key adds (its registry record before and after)."""
    plain: list[float] = []
    keyed: list[float] = []
    run = secrets.token_hex(4)
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end or len(keyed) < 50:
        t = time.perf_counter()
        await sb.commands.run(["true"])
        plain.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        await sb.commands.run(["true"], idempotency_key=f"bench-{run}-{i}")
        keyed.append((time.perf_counter() - t) * 1e3)
        i += 1
    added = statistics.median(keyed) - statistics.median(plain)
    return {
        "runs": len(keyed),
        "unkeyed_p50_ms": statistics.median(plain),
        "keyed_p50_ms": statistics.median(keyed),
        "added_p50_ms": added,
        "goal_ms": IDEMPOTENCY_GOAL_MS,
        "goal_met": added <= IDEMPOTENCY_GOAL_MS,
    }


def _print_exec(r: dict) -> None:
    print("bench exec: one warm sandbox")
    for k, v in r["true_per_second"].items():
        print(f"  `true` commands/s, {k.replace('_', ' ')}: {v:8.0f}")
    k = r["idempotency_key"]
    print(
        f"  `true` p50 unkeyed {k['unkeyed_p50_ms']:.3f} ms, keyed {k['keyed_p50_ms']:.3f} ms: "
        f"+{k['added_p50_ms']:.3f} ms ({k['runs']} each; goal <= {k['goal_ms']} ms: "
        f"{'met' if k['goal_met'] else 'NOT met'})"
    )
    print(f"  run_code('1') cells/s, concurrency 1: {r['run_code_per_second']:8.0f}")
    for k in ("ping_sdk_asyncio", "ping_blocking_client", "raw_unix_socket_rtt"):
        v = r[k]
        print(f"  {k:<22} p50 {v['p50_us']:8.1f} us   p99 {v['p99_us']:8.1f} us   min {v['min_us']:7.1f} us")
    print(
        f"  ratio empty request (SDK) / raw socket round trip: {r['ratio_ping_sdk/raw']:.1f}x; "
        f"blocking client / raw: {r['ratio_ping_blocking/raw']:.1f}x"
    )


# ---------------------------------------------------------------------------- density


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _smaps(pid: int) -> tuple[int, int, int]:
    """(rss, pss, uss) bytes of one process."""
    rss = pss = uss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            parts = line.split()
            if parts[0] == "Rss:":
                rss = int(parts[1]) * 1024
            elif parts[0] == "Pss:":
                pss = int(parts[1]) * 1024
            elif parts[0] in ("Private_Clean:", "Private_Dirty:"):
                uss += int(parts[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return rss, pss, uss


RAW_IDLE = ["python3", "-c", "import time; time.sleep(1e9)"]  # the floor of an idle sandbox with Python


def _idle_memory(members: list[tuple[int, list[int]]], drop: int) -> dict[str, float]:
    """Per-member means in MiB of (cgroup charge, that member's pids): the cgroup's own count
    (memory.usage: anonymous, page cache, tmpfs, kernel memory), USS, PSS and RSS summed over its
    processes, and the host's MemAvailable ``drop``."""
    cg = rss = pss = uss = 0
    for charge, pids in members:
        cg += charge
        for pid in pids:
            r, ps, us = _smaps(pid)
            rss, pss, uss = rss + r, pss + ps, uss + us
    k = max(1, len(members))
    return {
        "cgroup_mib_per_sandbox": cg / k / 2**20,
        "uss_mib_per_sandbox": uss / k / 2**20,
        "pss_mib_per_sandbox": pss / k / 2**20,
        "rss_mib_per_sandbox": rss / k / 2**20,
        "host_memavailable_drop_mib_per_sandbox": drop / k / 2**20,
    }


async def _raw_idle(runtime: Path, k: int) -> dict[str, float]:
    """``k`` raw runc containers (warmbox's own OCI config) whose PID 1 is a bare ``python3`` asleep:
    the floor an idle sandbox with a Python interpreter is compared with, in the same run."""
    from warmbox.backends import _host as host

    raw = _RawRunc(runtime)
    ids: list[str] = []
    try:
        before = _mem_available()
        for _ in range(k):
            ids.append(await asyncio.to_thread(raw.start, RAW_IDLE))
        await asyncio.sleep(1.0)  # as the sandboxes: settled to idle
        members = []
        for cid in ids:
            cgroup = host.SandboxCgroup(cid)
            members.append((cgroup.memory_bytes(), cgroup.procs()))
        return {"containers": len(ids), **_idle_memory(members, before - _mem_available())}
    finally:
        for cid in ids:
            await asyncio.to_thread(raw.delete, cid)


async def _first_use(home: Path, pool: str, claims: int, idle: int) -> dict[str, Any]:
    """With ``idle`` sandboxes of ``pool`` idle: ``claims`` creates from it, each timed to its first
    ``run_code`` (a template that starts no context starts one there) and to its first command."""
    from warmbox.engine.engine import Engine
    from warmbox.sdk.sandbox import AsyncSandbox

    engine = Engine.for_home(home)
    row = engine.settings().pools[pool]
    code_ms: list[float] = []
    cmd_ms: list[float] = []
    hits = 0
    for i in range(claims):
        await _wait_quiet(engine, pool, timeout=900)  # (the last claim's refill done)
        t0 = time.perf_counter()
        sb = await AsyncSandbox.create(tier="container", template=row.template, limits=row.limits, home=home)
        try:
            hits += sb.from_pool
            if i % 2 == 0:
                ex = await sb.run_code("2+2", timeout=120)
                code_ms.append((time.perf_counter() - t0) * 1e3)
                if ex.text != "4":
                    raise WarmboxError(f"first run_code answered {ex.text!r}: {ex.error}")
            else:
                await sb.commands.run(EMPTY, timeout=120, check=True)
                cmd_ms.append((time.perf_counter() - t0) * 1e3)
        finally:
            await sb.kill()
    out: dict[str, Any] = {"idle_sandboxes": idle, "claims": claims, "pool_hits": hits}
    if code_ms:
        out["create_first_run_code"] = _stats(code_ms)
    if cmd_ms:
        out["create_first_command"] = _stats(cmd_ms)
    return out


async def bench_density(home: Path, maximum: int, step: int, bound_gib: float, template: str, claims: int = 0) -> dict:
    from warmbox.engine import pool as pools
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    backend = engine.backend("container")
    from warmbox.backends.runc import RuncBackend

    assert isinstance(backend, RuncBackend)  # the density count reads the runc tier's cgroups
    name = f"bench-density-{template}"
    raw = await _raw_idle(engine.runtime, min(step, 4))
    base_avail = _mem_available()
    steps = []
    n = 0
    progress, _ = _progress(0, "bench density")
    with progress:
        task = progress.add_task(template, total=maximum)
        while n < maximum:
            n = min(maximum, n + step)
            pools.resize(engine, engine.settings(), name, n, min=n, max=n)
            await _wait_quiet(engine, name, timeout=900)
            await asyncio.sleep(1.0)  # let the guests settle to idle
            ids = engine.registry.pools.pooled(name)
            members = []
            for sid in ids:
                _, handle = engine.info(sid)
                members.append(((await backend.usage(handle)).memory_bytes, backend.sandbox_pids(sid)))
            drop = base_avail - _mem_available()
            row = {"sandboxes": len(ids), **_idle_memory(members, drop), "host_processes_per_sandbox": 0}
            row["host_memavailable_mib"] = _mem_available() / 2**20
            row["cgroup_over_raw"] = row["cgroup_mib_per_sandbox"] / max(raw["cgroup_mib_per_sandbox"], 1e-9)
            steps.append(row)
            progress.update(task, completed=n)
            if drop >= bound_gib * 2**30:
                break
    first_use = await _first_use(home, name, claims, len(ids)) if claims else {}
    pools.resize(engine, engine.settings(), name, 0, min=0, max=0)
    await _wait_quiet(engine, name)
    return {
        "bench": "density",
        "template": template,
        "bound_gib": bound_gib,
        "steps": steps,
        "first_use": first_use,
        "raw_python_idle": raw,
        "note": "runc leaves no host process per sandbox (no shim); host cost is the kernel's. raw_python_idle: "
        "raw runc containers (the same OCI config) whose PID 1 is python3 -c 'import time; time.sleep(1e9)'",
    }


def _print_density(r: dict) -> None:
    print(f"bench density: idle warm sandboxes of template {r['template']!r} (bound {r['bound_gib']} GiB)")
    print(
        f"  {'N':>5} {'cgroup MiB':>11} {'USS MiB':>8} {'PSS MiB':>8} {'RSS MiB':>8} "
        f"{'MemAvail drop MiB':>18}  (per sandbox)"
    )
    raw = r["raw_python_idle"]
    for label, s in [*((str(s["sandboxes"]), s) for s in r["steps"]), (f"raw x{raw['containers']}", raw)]:
        print(
            f"  {label:>5} {s['cgroup_mib_per_sandbox']:>11.2f} {s['uss_mib_per_sandbox']:>8.2f} "
            f"{s['pss_mib_per_sandbox']:>8.2f} {s['rss_mib_per_sandbox']:>8.2f} "
            f"{s['host_memavailable_drop_mib_per_sandbox']:>18.2f}"
        )
    if r["steps"]:
        print(
            f"  host MemAvailable with {r['steps'][-1]['sandboxes']}: {r['steps'][-1]['host_memavailable_mib']:.0f} MiB"
        )
    fu = r["first_use"]
    for k in ("create_first_run_code", "create_first_command"):
        if k in fu:
            s = fu[k]
            print(
                f"  {k} with {fu['idle_sandboxes']} idle: p50 {s['p50_ms']:.1f} ms  p99 {s['p99_ms']:.1f} ms "
                f"(n={s['n']}, pool hits {fu['pool_hits']}/{fu['claims']})"
            )
    last = r["steps"][-1] if r["steps"] else None
    if last is not None:
        print(
            f"  raw: runc containers with the same OCI config, PID 1 a bare sleeping python3; "
            f"cgroup per sandbox / raw: {last['cgroup_over_raw']:.2f}x"
        )


# ---------------------------------------------------------------------------- snapshot


async def bench_snapshot(home: Path, runs: int, mb: int) -> dict:
    from warmbox.engine.engine import Engine
    from warmbox.sdk.sandbox import AsyncSandbox

    engine = Engine.for_home(home)
    engine.ensure_daemon()
    await _wait_quiet(engine, "bench-pydata")
    rows: dict[str, list[float]] = {
        k: []
        for k in (
            "snapshot_ms",
            "pause_ms",
            "resume_first_pool_ms",
            "resume_first_cold_ms",
            "raw_tar_zstd_ms",
            "raw_untar_ms",
        )
    }
    sizes = {}
    work = home / "bench-raw"
    work.mkdir()
    for _ in range(runs):
        sb = await AsyncSandbox.create(template="pydata", timeout=600, pool=False, home=home)
        await sb.commands.run(
            f"head -c {mb << 20} /dev/urandom > /workspace/data.bin && seq 1 200000 > /workspace/lines.txt"
        )
        r = await sb.run_code("import pandas\ndf = pandas.DataFrame({'a': range(100000), 'b': range(100000)})")
        if r.error:
            raise WarmboxError(f"bench snapshot setup: {r.error.value}")
        handle = engine.info(sb.sandbox_id)[1]
        mem = (await engine.usage(handle)).memory_bytes
        ws = Path(handle.state_dir) / "workspace"
        raw_save, raw_restore, raw_size = await asyncio.to_thread(_raw_fs_snapshot, ws, work)
        t0 = time.perf_counter()
        await sb.snapshot()
        rows["snapshot_ms"].append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        ref = await sb.pause()
        rows["pause_ms"].append((time.perf_counter() - t0) * 1e3)
        rows["raw_tar_zstd_ms"].append(raw_save)
        rows["raw_untar_ms"].append(raw_restore)
        sizes = {
            "artifact_bytes": ref.size_bytes,
            "raw_tar_zstd_bytes": raw_size,
            "resident_memory_bytes": mem,
            "workspace_random_mib": mb,
        }
        for key, use_pool in (("resume_first_pool_ms", True), ("resume_first_cold_ms", False)):
            if use_pool:
                await _wait_quiet(engine, "bench-pydata")
            t0 = time.perf_counter()
            back = await AsyncSandbox.create(from_snapshot=ref, timeout=600, pool=use_pool, home=home)
            r = await back.run_code("df.shape")
            rows[key].append((time.perf_counter() - t0) * 1e3)
            if r.text != "(100000, 2)":
                raise WarmboxError(f"restored sandbox answered {r.text!r}")
            await back.kill()
    stats = {k: _stats(v) for k, v in rows.items()}
    ratio = lambda a, b: stats[a]["p50_ms"] / stats[b]["p50_ms"]  # noqa: E731
    return {
        "bench": "snapshot",
        "tier": "container",
        "memory_snapshot": False,
        "runs": runs,
        "sizes": sizes,
        "stats": stats,
        "ratios_p50": {
            "snapshot/raw_tar_zstd": ratio("snapshot_ms", "raw_tar_zstd_ms"),
            "resume_first_pool/raw_untar": ratio("resume_first_pool_ms", "raw_untar_ms"),
        },
        "note": "container tier: files + code-context state (no CRIU on this kernel); pause = snapshot + "
        "destroy (the destroy waits until every process of the sandbox has exited)",
    }


async def bench_snapshot_gvisor(home: Path, runs: int) -> dict:
    from warmbox.engine import snapshot as snapshots
    from warmbox.engine.engine import Engine
    from warmbox.sdk.sandbox import AsyncSandbox

    engine = Engine.for_home(home)
    raw = _RawRunsc(engine.runtime)
    rows: dict[str, list[float]] = {
        k: []
        for k in (
            "cold_start_first_ms",
            "pause_ms",
            "restore_first_ms",
            "raw_runsc_run_ms",
            "raw_checkpoint_ms",
            "raw_restore_ms",
        )
    }
    sizes: dict[str, int] = {}
    for _ in range(runs):
        t0 = time.perf_counter()
        sb = await AsyncSandbox.create(tier="gvisor", template="pydata", timeout=600, pool=False, home=home)
        r = await sb.run_code("df = pandas.DataFrame({'a': range(1000)})\nlen(df)")
        rows["cold_start_first_ms"].append((time.perf_counter() - t0) * 1e3)
        if r.text != "1000":
            raise WarmboxError(f"gvisor sandbox answered {r.text!r}")
        mem = (await engine.usage(engine.info(sb.sandbox_id)[1])).memory_bytes
        t0 = time.perf_counter()
        ref = await sb.pause(memory=True)
        rows["pause_ms"].append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        back = await AsyncSandbox.resume(ref, home=home)
        r = await back.run_code("len(df)")
        rows["restore_first_ms"].append((time.perf_counter() - t0) * 1e3)
        if r.text != "1000":
            raise WarmboxError(f"restored sandbox answered {r.text!r}")
        await back.kill()
        ms, _ = await asyncio.to_thread(raw.run, EMPTY)
        rows["raw_runsc_run_ms"].append(ms)
        ck, rs, size = await asyncio.to_thread(raw.checkpoint_restore, raw_template_loop("pydata"))
        rows["raw_checkpoint_ms"].append(ck)
        rows["raw_restore_ms"].append(rs)
        sizes = {
            "artifact_bytes": ref.size_bytes,
            "checkpoint_image_bytes": snapshots.resolve(engine, ref.snapshot_id).memory_raw_bytes,
            "resident_memory_bytes": mem,
            "raw_checkpoint_image_bytes": size,
        }
    stats = {k: _stats(v) for k, v in rows.items()}
    ratio = lambda a, b: stats[a]["p50_ms"] / stats[b]["p50_ms"]  # noqa: E731
    return {
        "bench": "snapshot",
        "tier": "gvisor",
        "memory_snapshot": True,
        "runs": runs,
        "sizes": sizes,
        "stats": stats,
        "ratios_p50": {
            "pause/raw_checkpoint": ratio("pause_ms", "raw_checkpoint_ms"),
            "restore_first/raw_restore": ratio("restore_first_ms", "raw_restore_ms"),
            "cold_start_first/restore_first": ratio("cold_start_first_ms", "restore_first_ms"),
        },
        "platform": raw.backend.platform()[0],
        "runsc_version": raw.backend.version(),
        "note": "pause = quiesce + host tar of /workspace + runsc checkpoint + compress/store + destroy; "
        "raw runsc rows: the same bundle with a plain python process that ran the template's warm-up "
        "(pydata: numpy, pandas, requests, matplotlib.pyplot imported), same run",
    }


def _print_microvm(r: dict) -> None:
    extra = [f"accelerator: {r['accelerator']} ({r['accelerator_why']}); guest kernel {r['kernel']}"]
    extra += [f"ratio {k}: {v:.2f}x" for k, v in r["ratios_p50"].items()]
    if r["restore_stages_p50_ms"]:
        extra.append(
            "warmbox restore stages on the request path, p50 ms: "
            + ", ".join(f"{k}={v:.1f}" for k, v in r["restore_stages_p50_ms"].items())
        )
    extra += [f"goal {k}: {g['measured']} -> {'met' if g['met'] else 'NOT met'}" for k, g in r.get("goals", {}).items()]
    _print_table(
        f"bench start [tier microvm, {r['accelerator']}] create->first command ({r['runs']} interleaved runs)",
        r["stats"],
        extra,
    )


def _print_snapshot(r: dict) -> None:
    accel = f", {r['accelerator']}" if "accelerator" in r else ""
    _print_table(
        f"bench snapshot [tier {r['tier']}{accel}, memory snapshot: {r['memory_snapshot']}] ({r['runs']} runs)",
        {k.removesuffix("_ms"): v for k, v in r["stats"].items()},
        [f"sizes: {json.dumps(r['sizes'])}"] + [f"ratio {k}: {v:.2f}x" for k, v in r["ratios_p50"].items()],
    )
