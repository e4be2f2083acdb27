"""``warmbox bench profile``: what the third question (the I/O profile) costs on each tier of this host.

Per available tier, in one run: a compute loop (``for x in data: calculate(x)``) and three syscall
loops — fork + wait, a 4 KiB file created/written/closed/opened/read/closed/unlinked in the working
directory (/workspace in a sandbox; on the host, a filesystem made as a sandbox's /workspace is), a
loopback TCP connect/accept/send/recv/close — each timed by the same script inside a sandbox of the
tier and on the host (first, and after each tier: the fastest host run counts, as load on a shared
host only slows), as microseconds per round: the least of many short batches, each loop bounded in
rounds and in seconds. Reported as ratios sandbox / host; ``syscall`` is the geometric mean of the
three syscall loops.

The result is cached in the home (``<home>/cache/tier-profile.json``, with the host's kernel, CPU
and the time) and read by ``warmbox.choose_tier`` / ``warmbox advise`` / ``tier="auto"``.

The sandboxes are the home's own (``pool=False``, killed at the end): a microVM starts from the
home's template snapshot, which a private benchmark home would have to boot under TCG first
(~70 s measured here) — the profile is about this home's engine anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from warmbox.errors import WarmboxError
from warmbox.models import HostProfile, TierProfile

LOOPS = r"""
import json, os, socket, sys, tempfile, time
BUDGET = float(sys.argv[1])
def calculate(x):
    return (x * x + 3 * x) % 7
data = range(2000)
def compute():
    for x in data:
        calculate(x)
def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
here = os.getcwd() if os.access(os.getcwd(), os.W_OK) else None
d = tempfile.mkdtemp(dir=here)
path = os.path.join(d, "f")
blob = b"x" * 4096
def files():
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.write(fd, blob)
    os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    os.read(fd, 8192)
    os.close(fd)
    os.unlink(path)
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(8)
addr = srv.getsockname()
def sock():
    c = socket.create_connection(addr)
    a, _ = srv.accept()
    c.sendall(b"ping")
    a.recv(16)
    a.close()
    c.close()
def timed(fn, batch):
    fn()
    best, n, t0 = float("inf"), 0, time.perf_counter()
    while True:
        t = time.perf_counter()
        for _ in range(batch):
            fn()
        best = min(best, (time.perf_counter() - t) / batch)
        n += batch
        if time.perf_counter() - t0 > BUDGET or n >= 200 * batch:
            return best * 1e6, n
out = {}
for name, fn, batch in (("compute", compute, 5), ("fork", fork, 3), ("files", files, 10), ("socket", sock, 10)):
    out[name] = timed(fn, batch)
os.rmdir(d)
print(json.dumps(out))
"""
LOOP_NAMES = ("compute", "fork", "files", "socket")
MAX_OUTPUT = 4096
HOST_DISK_MB = 64


def _parse(text: str, where: str) -> dict[str, float]:
    """The loops' JSON line: microseconds per round of each loop (WarmboxError if it is not that)."""
    try:
        data = json.loads(text.strip().splitlines()[-1])
        out = {k: float(data[k][0]) for k in LOOP_NAMES}
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise WarmboxError(f"bench profile: the loops in {where} printed no result ({e}): {text[-300:]!r}") from None
    if not all(math.isfinite(v) and v > 0 for v in out.values()):
        raise WarmboxError(f"bench profile: the loops in {where} printed {out}")
    return out


def host_python() -> str:
    """The host's Debian python3 (the built-in image's interpreter is Debian's too), else this one."""
    return shutil.which("python3", path="/usr/bin:/bin") or sys.executable


def _host_loops(budget: float, cwd: Path) -> dict[str, float]:
    r = subprocess.run([host_python(), "-c", LOOPS, str(budget)], cwd=cwd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise WarmboxError(f"bench profile: the loops failed on the host: {r.stderr[-300:]}")
    return _parse(r.stdout, "the host")


@contextlib.contextmanager
def _host_disk(runtime: Path) -> Iterator[Path]:
    """A directory on the very kind of filesystem a sandbox's /workspace is (a sparse ext4 image
    without a journal, loop-mounted with direct I/O: workspace_disk), for the host's file loop: on
    the host's own journaled disk the same loop measured 22-200 us per round as other writers came
    and went, which made every tier's file ratio noise. Unmounted and removed after."""
    from warmbox.backends import workspace_disk

    state = Path(tempfile.mkdtemp(prefix="profile-", dir=runtime))
    try:
        workspace_disk.attach(state, runtime / "images" / "disks", HOST_DISK_MB, 0, 0)
        yield state / workspace_disk.MOUNT_POINT
    finally:
        workspace_disk.release(state)
        shutil.rmtree(state, ignore_errors=True)


async def _tier_loops(home: Path, tier: str, budget: float) -> tuple[dict[str, float], float]:
    """The loops in a fresh sandbox of ``tier`` of this home; (us per round, create seconds)."""
    from warmbox.sdk import AsyncSandbox

    t0 = time.perf_counter()
    sb = await AsyncSandbox.create(tier=tier, template="shell", pool=False, timeout=300, home=home)
    created = time.perf_counter() - t0
    try:
        r = await sb.commands.run(["python3", "-c", LOOPS, str(budget)], timeout=120, max_output=MAX_OUTPUT)
        if not r.ok:
            raise WarmboxError(f"bench profile: the loops failed on {tier}: {r.stderr[-300:]}")
        return _parse(r.stdout, f"a {tier} sandbox"), created
    finally:
        await sb.kill()


def _ratios(tier: str, cost_note: str, got: dict[str, float], host: dict[str, float]) -> TierProfile:
    r = {k: got[k] / host[k] for k in LOOP_NAMES}
    syscall = (r["fork"] * r["files"] * r["socket"]) ** (1 / 3)
    return TierProfile(
        tier=tier,
        compute=round(r["compute"], 2),
        syscall=round(syscall, 2),
        fork=round(r["fork"], 2),
        files=round(r["files"], 2),
        socket=round(r["socket"], 2),
        cost_note=cost_note,
    )


async def bench_profile(tiers: list[str] | None, budget: float) -> dict[str, Any]:
    """Measure, cache in the home, and return the report (the profile and each sandbox's create time)."""
    from warmbox.engine.engine import Engine
    from warmbox.paths import default_home

    home = default_home()
    engine = Engine.for_home(home)
    engine.runtime.mkdir(parents=True, exist_ok=True, mode=0o711)
    with _host_disk(engine.runtime) as host_dir:
        return await _measure(engine, home, host_dir, tiers, budget)


async def _measure(engine: Any, home: Path, host_dir: Path, tiers: list[str] | None, budget: float) -> dict[str, Any]:
    from warmbox.engine import tierprofile

    t_start = time.perf_counter()
    hosts = [await asyncio.to_thread(_host_loops, budget, host_dir)]
    cost_notes: dict[str, str] = {}
    skipped: dict[str, str] = {}
    created: dict[str, float] = {}
    sandbox_us: dict[str, dict[str, float]] = {}
    for c in await asyncio.to_thread(tierprofile.candidates, engine):
        if tiers and c.tier not in tiers:
            skipped[c.tier] = "not asked for (--tier)"
        elif c.capabilities is None or not c.available:
            skipped[c.tier] = f"not available: {c.reason}"
        elif not c.capabilities.commands:
            skipped[c.tier] = "runs code only: the loops need processes and files"
        else:
            sandbox_us[c.tier], created[c.tier] = await _tier_loops(home, c.tier, budget)
            # asked after the run: what the sandbox ran on (gVisor's platform is probed at its first start)
            cost_notes[c.tier] = engine.backend(c.tier).capabilities().cost_note
            hosts.append(await asyncio.to_thread(_host_loops, budget, host_dir))  # interleaved: the host's load changes
    host = {k: min(h[k] for h in hosts) for k in LOOP_NAMES}  # the fastest host run: load only slows
    rows = [_ratios(t, cost_notes[t], us, host) for t, us in sandbox_us.items()]
    kernel, model, cpus = tierprofile.host_facts()
    profile = HostProfile(
        measured_at=time.time(),
        kernel=kernel,
        cpu_model=model,
        cpus=cpus,
        tiers=tuple(rows),
        skipped=skipped,
        host_us={k: round(v, 2) for k, v in host.items()},
    )
    path = tierprofile.save_profile(home, profile)
    from warmbox.wire import encode

    return {
        "profile": encode(profile),
        "cached_at": str(path),
        "sandbox_us": {t: {k: round(v, 2) for k, v in us.items()} for t, us in sandbox_us.items()},
        "host_runs_us": [{k: round(v, 2) for k, v in h.items()} for h in hosts],
        "create_s": {t: round(s, 2) for t, s in created.items()},
        "budget_s_per_loop": budget,
        "total_s": round(time.perf_counter() - t_start, 1),
        "host_python": host_python(),
    }


def print_report(rep: dict[str, Any]) -> None:
    p = rep["profile"]
    print(f"tier profile of this host ({p['kernel']}, {p['cpus']} CPUs {p['cpu_model']}), sandbox / host:")
    print(f"  {'tier':<10} {'compute':>8} {'syscall':>8} {'fork':>8} {'files':>8} {'socket':>8}  create")
    for t in p["tiers"]:
        cols = "".join(f" {t[k]:>7.2f}x" for k in ("compute", "syscall", "fork", "files", "socket"))
        print(f"  {t['tier']:<10}{cols}  {rep['create_s'][t['tier']]:.1f} s")
    host = p["host_us"]
    print("  host, us per round: " + ", ".join(f"{k} {host[k]:.1f}" for k in LOOP_NAMES))
    for tier, why in p["skipped"].items():
        print(f"  {tier}: skipped ({why})")
    print(f'cached in {rep["cached_at"]} (read by warmbox advise and tier="auto"); {rep["total_s"]} s in all')


async def command(args: argparse.Namespace) -> int:
    if not 0.01 <= args.budget <= 10:
        raise WarmboxError(f"--budget is seconds per loop, 0.01 to 10, got {args.budget}")
    if args.tier:
        from warmbox.tiers import canonical_tier

        args.tier = [canonical_tier(t) for t in args.tier]
    rep = await bench_profile(args.tier, args.budget)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print_report(rep)
    return 0
