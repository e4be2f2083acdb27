"""``warmbox bench start``: create -> first command, warmbox cold vs raw runc vs raw bwrap.

All three run the same command in the same run, interleaved; raw runc uses the very OCI
config warmbox generates (same user namespace, seccomp, cgroups, mounts) with the command as
its process, so the ratio isolates what warmbox adds: its guest agent, registry and socket.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from warmbox.errors import WarmboxError

EMPTY = ["python3", "-c", "print(2+2)"]
AGENT = ["python3", "-c", (
    "import numpy, pandas\n"
    "rng = numpy.random.default_rng(0)\n"
    "pandas.DataFrame(rng.normal(size=(1000, 4)), columns=list('abcd')).to_csv('/tmp/d.csv', index=False)\n"
    "print(pandas.read_csv('/tmp/d.csv').describe().loc['mean'].round(3).to_dict())")]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _bwrap_argv(cmd: list[str]) -> list[str]:
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr",
            "--ro-bind", "/etc/alternatives", "/etc/alternatives", "--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", "/workspace", "--chdir", "/workspace"]
    for link in ("bin", "sbin", "lib", "lib64"):
        if os.path.islink("/" + link):
            argv += ["--symlink", os.readlink("/" + link), "/" + link]
    return argv + ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", *cmd]


class _RawRunc:
    """The same OCI config as warmbox's, run in the foreground by runc with ``cmd`` as PID 1."""

    def __init__(self, runtime: Path) -> None:
        from warmbox.backends.runc import RuncBackend
        from warmbox.storage.registry import MAX_SLOTS, UID_BASE, UID_RANGE

        self.backend = RuncBackend(runtime)
        self.dir = runtime / "bench-raw"
        self.uid_base = UID_BASE + MAX_SLOTS * UID_RANGE  # last slot: never handed to a sandbox
        self.n = 0

    def run(self, cmd: list[str]) -> tuple[float, str]:
        from warmbox.backends.base import SandboxSpec
        from warmbox.backends.runc import GUEST_GID, GUEST_UID
        from warmbox.models import Limits

        self.n += 1
        cid = f"wbbench-{os.getpid()}-{self.n}"
        d = self.dir / cid
        ws = d / "workspace"
        t0 = time.perf_counter()
        ws.mkdir(parents=True)
        os.chown(ws, self.uid_base + GUEST_UID, self.uid_base + GUEST_GID)
        spec = SandboxSpec(sandbox_id=cid, state_dir=str(d), uid_base=self.uid_base, envs=(), limits=Limits())
        config = self.backend.config(spec, self.backend.image(), ws)
        config["process"]["args"] = cmd
        (d / "config.json").write_text(json.dumps(config))
        try:
            out = subprocess.run([self.backend.runc, "--root", str(self.backend.root), "run", "--bundle", str(d), cid],
                                 capture_output=True, text=True, timeout=120)
            ms = (time.perf_counter() - t0) * 1e3
        finally:
            subprocess.run([self.backend.runc, "--root", str(self.backend.root), "delete", "--force", cid],
                           capture_output=True)
            shutil.rmtree(d, ignore_errors=True)
        if out.returncode != 0:
            raise WarmboxError(f"raw runc failed: {out.stderr.strip()[-300:]}")
        return ms, out.stdout


async def _warmbox(cmd: list[str]) -> tuple[float, str, dict[str, float]]:
    from warmbox.sdk.sandbox import AsyncSandbox

    t0 = time.perf_counter()
    sb = await AsyncSandbox.create("container", timeout=120)
    try:
        r = await sb.commands.run(cmd, timeout=120)
        ms = (time.perf_counter() - t0) * 1e3
    finally:
        await sb.kill()
    if r.exit_code != 0:
        raise WarmboxError(f"warmbox run failed: {r.stderr[-300:]}")
    return ms, r.stdout, sb.timings


def _bwrap(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(_bwrap_argv(cmd), capture_output=True, text=True, timeout=120)
    ms = (time.perf_counter() - t0) * 1e3
    if out.returncode != 0:
        raise WarmboxError(f"bwrap failed: {out.stderr.strip()[-300:]}")
    return ms, out.stdout


async def bench_start(runs: int = 20, as_json: bool = False, variant: str = "both") -> int:
    from warmbox.engine.engine import Engine

    raw = _RawRunc(Engine.for_home().runtime)
    have_bwrap = shutil.which("bwrap") is not None
    variants = {"empty": EMPTY, "agent": AGENT}
    chosen = list(variants) if variant == "both" else [variant]
    report: dict = {"runs": runs, "variants": {}}
    for name in chosen:
        cmd = variants[name]
        # one untimed warm-up of each so page cache and image build are out of the numbers
        await _warmbox(cmd)
        raw.run(cmd)
        if have_bwrap:
            _bwrap(cmd)
        samples: dict[str, list[float]] = {"warmbox_cold": [], "raw_runc": [], "raw_bwrap": []}
        stages: dict[str, list[float]] = {}
        outputs = set()
        for i in range(runs):
            order = ["warmbox_cold", "raw_runc", "raw_bwrap"]
            order = order[i % 3:] + order[:i % 3]  # rotate so no method always runs first
            for m in order:
                if m == "warmbox_cold":
                    ms, out, timings = await _warmbox(cmd)
                    for k, v in timings.items():
                        stages.setdefault(k, []).append(v)
                elif m == "raw_runc":
                    ms, out = raw.run(cmd)
                elif have_bwrap:
                    ms, out = _bwrap(cmd)
                else:
                    continue
                samples[m].append(ms)
                outputs.add(out.strip())
        stats = {m: {"p50_ms": statistics.median(v), "p95_ms": _pct(v, 0.95), "min_ms": min(v), "n": len(v)}
                 for m, v in samples.items() if v}
        ratio = {f"warmbox_cold/{m}": stats["warmbox_cold"]["p50_ms"] / stats[m]["p50_ms"]
                 for m in ("raw_runc", "raw_bwrap") if m in stats}
        report["variants"][name] = {
            "command": cmd, "stats": stats, "ratios_p50": ratio,
            "warmbox_stages_p50_ms": {k: statistics.median(v) for k, v in stages.items()},
            "distinct_outputs": len(outputs),
        }
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        for name, v in report["variants"].items():
            print(f"bench start [{name}] {' '.join(v['command'])[:60]!r}  ({runs} interleaved runs each)")
            for m, s in v["stats"].items():
                print(f"  {m:<13} p50 {s['p50_ms']:8.1f} ms   p95 {s['p95_ms']:8.1f} ms   min {s['min_ms']:8.1f} ms")
            for k, r in v["ratios_p50"].items():
                print(f"  ratio {k:<24} {r:5.2f}x")
            print("  warmbox stages p50: " + ", ".join(f"{k}={x:.1f}" for k, x in v["warmbox_stages_p50_ms"].items()))
    return 0
