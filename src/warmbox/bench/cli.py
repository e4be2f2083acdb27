"""``warmbox bench cli``: the command line as a person meets it, whole processes timed from spawn to
exit, interleaved in one run with ``podman run --rm`` of the same root filesystem (issue 38).

Measured, each once per round and in the same order every round: ``warmbox --help``; ``warmbox run
-- python3 -c 'print(2+2)'`` from a warm pool; ``warmbox exec ID -- true`` in a live sandbox (both
on the thin path: a ``warmbox serve`` of the benchmark's home runs); and podman's ``run --rm
--network=none`` of the rootfs warmbox's base template runs (``--rootfs IMAGE:O`` with the host's
/usr mounted read-only, as the container tier does). ``--bridge`` adds podman's default network
(it makes a CNI bridge and firewall chains on the host, left there by podman). Each command
waits, untimed, for the pool to hold a sandbox again, so every timed run is a pool hit and no
refill of the pool (each run's claim starts one) is timed with the command after it. The floor
of every warmbox command is timed beside them: ``python -c pass`` of warmbox's own interpreter.

The goals of the issue: ``--help`` <= 60 ms; ``run`` <= 0.5 x podman --network=none; ``exec`` <= 80 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from warmbox.bench.common import EMPTY, _stats
from warmbox.bench.home import _wait_quiet, in_own_home
from warmbox.errors import WarmboxError

POOL = {"bench-cli": {"template": "base", "min": 1, "max": 1, "target": 1, "refill_concurrency": 1}}
GOALS = {"help": 60.0, "exec": 80.0}  # ms; run: RUN_RATIO x podman --network=none
RUN_RATIO = 0.5


def _warmbox_argv() -> list[str]:
    """The ``warmbox`` console script beside this interpreter (what a user types), else ``-m``."""
    script = Path(sys.executable).with_name("warmbox")
    return [str(script)] if script.exists() else [sys.executable, "-m", "warmbox.cli.main"]


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=300)
    return (time.perf_counter() - t0) * 1e3, out


def _serve(wb: list[str], env: dict[str, str], log: Any) -> subprocess.Popen[bytes]:
    """``warmbox serve`` of the benchmark's home on its unix socket only (the thin path's engine)."""
    return subprocess.Popen([*wb, "serve", "--host", ""], stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)


def _podman_argv(image: Path, network: str | None) -> list[str]:
    podman = shutil.which("podman")
    if podman is None:
        raise WarmboxError("bench cli needs podman for its baseline (scripts/bootstrap installs it)")
    net = [f"--network={network}"] if network else []
    # this host's hard limits are below podman's defaults (1M files): runc could not set them
    limits = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
    return [podman, "run", "--rm", *net, *limits, "-v", "/usr:/usr:ro", "--rootfs", f"{image}:O", *EMPTY]


async def bench_cli(home: Path, runs: int, bridge: bool) -> dict[str, Any]:
    from warmbox.backends.runc import RuncBackend
    from warmbox.engine.engine import Engine
    from warmbox.server.serve import socket_path

    engine = Engine.for_home(home)
    image = RuncBackend(engine.runtime).image()
    env = {k: v for k, v in os.environ.items() if k not in ("WARMBOX_API_URL", "WARMBOX_API_KEY")}
    env["WARMBOX_HOME"] = str(home)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed warmbox has its bytecode: so does this one
    wb = _warmbox_argv()
    log = open(home / "serve.log", "wb")  # closed below, after the server ended
    server = _serve(wb, env, log)
    sid = ""
    try:
        deadline = time.monotonic() + 60
        sock = socket_path(home, engine.settings().server)  # where the thin path looks for it
        while not sock.is_socket():
            if server.poll() is not None or time.monotonic() > deadline:
                raise WarmboxError(f"warmbox serve did not start: {(home / 'serve.log').read_text()[-500:]}")
            await asyncio.sleep(0.05)
        engine.ensure_daemon()
        await _wait_quiet(engine, "bench-cli")
        _ms, out = _timed([*wb, "create", "--no-pool", "--timeout", "900"], env)
        if out.returncode != 0:
            raise WarmboxError(f"warmbox create failed: {out.stderr.strip()}")
        sid = out.stdout.strip()
        # compiled bytecode and warm page cache for every command before anything is timed
        _timed([*wb, "--help"], env)
        _timed([*wb, "exec", sid, "--", "true"], env)
        _timed(_podman_argv(image, "none"), env)
        commands: dict[str, list[str]] = {
            "python": [sys.executable, "-c", "pass"],  # the interpreter's own start: no command is faster
            "help": [*wb, "--help"],
            "run": [*wb, "run", "--json", "--", *EMPTY],
            "exec": [*wb, "exec", "--json", sid, "--", "true"],
            "podman_none": _podman_argv(image, "none"),
        }
        if bridge:
            commands["podman"] = _podman_argv(image, None)
        times: dict[str, list[float]] = {k: [] for k in commands}
        paths: dict[str, set[str]] = {"run": set(), "exec": set()}
        misses = 0
        for _ in range(runs):
            for name, argv in commands.items():
                # untimed: the pool holds its sandbox again, and no refill (started by the last run's
                # claim) competes for the CPU with the command timed next
                await _wait_quiet(engine, "bench-cli")
                ms, out = _timed(argv, env)
                if out.returncode != 0 or (name.startswith("podman") and out.stdout != "4\n"):
                    raise WarmboxError(f"{name} failed ({out.returncode}): {(out.stderr or out.stdout)[-300:]}")
                times[name].append(ms)
                if name in paths:
                    rec = json.loads(out.stdout)
                    paths[name].add(rec["via"])
                    misses += name == "run" and not rec["from_pool"]
        stats = {k: _stats(v) for k, v in times.items()}
        base = stats["podman_none"]["p50_ms"]
        return {
            "runs": runs,
            "stats": stats,
            "via": {k: sorted(v) for k, v in paths.items()},
            "pool_misses": misses,
            "run_vs_podman_none": stats["run"]["p50_ms"] / base,
            "goals": {
                "help_ms": GOALS["help"],
                "exec_ms": GOALS["exec"],
                "run_vs_podman_none": RUN_RATIO,
                "met": {
                    "help": stats["help"]["p50_ms"] <= GOALS["help"],
                    "exec": stats["exec"]["p50_ms"] <= GOALS["exec"],
                    "run": stats["run"]["p50_ms"] <= RUN_RATIO * base,
                },
            },
            "load_1min": os.getloadavg()[0],
        }
    finally:
        if sid:
            _timed([*wb, "kill", sid], env)
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)
        log.close()


def print_report(r: dict[str, Any]) -> None:
    names = {
        "python": "python -c pass (floor)",
        "help": "warmbox --help",
        "run": "warmbox run (pool)",
        "exec": "warmbox exec -- true",
        "podman_none": "podman run --network=none",
        "podman": "podman run (bridge)",
    }
    print(f"whole process, {r['runs']} interleaved rounds (load average {r['load_1min']:.1f}):")
    for k, s in r["stats"].items():
        print(f"  {names[k]:<26} p50 {s['p50_ms']:8.1f} ms   p95 {s['p95_ms']:8.1f} ms   min {s['min_ms']:8.1f} ms")
    g = r["goals"]
    met = g["met"]
    print(
        f"  paths: run {', '.join(r['via']['run'])}; exec {', '.join(r['via']['exec'])}; pool misses {r['pool_misses']}"
    )
    print(
        f"goals: --help <= {g['help_ms']:.0f} ms: {'met' if met['help'] else 'NOT met'}; "
        f"exec <= {g['exec_ms']:.0f} ms: {'met' if met['exec'] else 'NOT met'}; "
        f"run <= {g['run_vs_podman_none']} x podman --network=none ({r['run_vs_podman_none']:.2f} x): "
        f"{'met' if met['run'] else 'NOT met'}"
    )


async def command(args: argparse.Namespace) -> int:
    from warmbox.bench.common import check_ranges

    check_ranges(args, [("runs", 1, 1000)])
    await in_own_home(POOL, lambda home: bench_cli(home, args.runs, args.bridge), print_report, args.json)
    return 0
