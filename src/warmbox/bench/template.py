"""``warmbox bench template``: what a custom template costs to build and to start, against ``base``.

build:   a small custom template on top of ``base`` (two RUN steps, a COPY of a local directory,
         an ENV), built cold (a fresh nonce in its first step: no layer of it is cached), then
         rebuilt unchanged (every step a cache hit, no build sandbox). Goal: the cached rebuild
         takes < 10 % of the cold build.
start:   create -> first command, cold (``pool=False``), of the custom template and of the built-in
         ``base``, interleaved: both have the same warm-up (base's: none) and the same
         ``python3 -c 'print(2+2)'``; the custom one has three more layers in its overlay. Goal:
         custom within 1.1x of base at p50.
pool:    create -> first run_code from a warm pool of each (one pool per template, refilled to
         its target before every claim): the claim must not care which image the pool runs.

Everything runs in a private WARMBOX_HOME (its own registry, pools and daemon), removed at the
end; the custom template's layers stay in the host's layer store (its cache; ``warmbox template
gc`` collects them once no template records them).
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from warmbox.bench.common import EMPTY, _stats
from warmbox.bench.home import _print_table, _wait_quiet, in_own_home, write_config
from warmbox.errors import InvalidArgument, WarmboxError

NAME = "bench-custom"
GOAL_REBUILD_RATIO = 0.10  # cached rebuild / cold build
GOAL_START_RATIO = 1.1  # custom / base, create -> first command at p50
# the custom template's warm-up as a setting too: its pool's shape needs it before the first claim
TEMPLATES = {NAME: {"warmup_code": ""}}
POOLS = {
    "bench-tpl-base": {"template": "base", "min": 1, "max": 1, "target": 1, "refill_concurrency": 1},
    "bench-tpl-custom": {"template": NAME, "min": 1, "max": 1, "target": 1, "refill_concurrency": 1},
}


def validate(args: argparse.Namespace) -> None:
    if not 1 <= args.runs <= 1000:
        raise InvalidArgument(f"--runs must be in [1, 1000], got {args.runs}")


def custom_spec(nonce: str, context: Path) -> Any:
    """The benchmark's template: what a user adds to ``base`` for an app (a venv, data, code, config)."""
    from warmbox.templates import Template

    return (
        Template.from_template("base")
        .run(f"echo {nonce} > /opt/bench-nonce && python3 -m venv --system-site-packages /opt/app")
        .run("mkdir -p /opt/data && head -c 16777216 /dev/urandom > /opt/data/blob && ls -la /opt/data")
        .copy(str(context), "/opt/app/src/")
        .env({"BENCH_TEMPLATE": nonce})
        .warmup(code="")  # base's: the context starts at the first run_code
        .with_context(context)
    )


def _context(work: Path) -> Path:
    src = work / "context"
    (src / "pkg").mkdir(parents=True)
    for i in range(50):
        (src / "pkg" / f"mod{i}.py").write_text(f"VALUE = {i}\n" + "# padding\n" * 200)
    (src / "main.py").write_text("from pkg import mod1\nprint(mod1.VALUE)\n")
    return src


async def _build(home: Path, spec: Any) -> tuple[float, int, Any]:
    """(seconds, steps that ran in a build sandbox, TemplateInfo) of one build of ``spec`` as NAME."""
    from warmbox.sdk.templates import AsyncTemplates

    ran: list[int] = []

    def progress(ev: Any) -> None:
        if ev.status == "done" and ev.step > 0 and not ev.text.startswith("COPY"):
            ran.append(ev.step)

    t0 = time.perf_counter()
    info = await AsyncTemplates.build(spec, NAME, on_progress=progress, home=home)
    return time.perf_counter() - t0, len(ran), info


async def _first_command(home: Path, template: str, pool: bool) -> tuple[float, bool, list[Any]]:
    from warmbox.sdk.sandbox import AsyncSandbox

    t0 = time.perf_counter()
    sb = await AsyncSandbox.create(tier="container", timeout=120, template=template, pool=pool, home=home)
    try:
        if pool:
            ex = await sb.run_code("print(2+2)", timeout=120)
            ms = (time.perf_counter() - t0) * 1e3
            if ex.error or ex.stdout.strip() != "4":
                raise WarmboxError(f"run_code in a {template} sandbox failed: {ex.error}")
        else:
            r = await sb.commands.run(EMPTY, timeout=120)
            ms = (time.perf_counter() - t0) * 1e3
            if r.exit_code != 0 or r.stdout.strip() != "4":
                raise WarmboxError(f"{EMPTY} in a {template} sandbox failed: {r.stderr[-300:]}")
        env = await sb.commands.run(["sh", "-c", "echo ${BENCH_TEMPLATE:-none}"], timeout=60)
    finally:
        await sb.kill()
    if (env.stdout.strip() == "none") != (template == "base"):  # each ran its own image
        raise WarmboxError(f"a {template} sandbox ran the wrong image (BENCH_TEMPLATE={env.stdout.strip()})")
    return ms, sb.from_pool, sb.stage_timings


async def bench_template(home: Path, runs: int) -> dict[str, Any]:
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    t_start = time.monotonic()
    report: dict[str, Any] = {"bench": "template", "runs": runs, "template": NAME}
    work = Path(tempfile.mkdtemp(prefix="wbbench-tpl-"))
    try:
        spec = custom_spec(secrets.token_hex(8), _context(work))
        report["steps"] = spec.describe()
        await _first_command(home, "base", pool=False)  # the built-in image is there before any timing
        cold_s, cold_launched, info = await _build(home, spec)
        warm_s, warm_launched, again = await _build(home, spec)
        if warm_launched or again.image_id != info.image_id:
            raise WarmboxError(f"the unchanged rebuild started {warm_launched} build sandbox(es) or changed the image")
        report["build"] = {
            "cold_s": round(cold_s, 3),
            "cold_build_sandboxes": cold_launched,
            "cached_rebuild_s": round(warm_s, 3),
            "rebuild_over_cold": round(warm_s / cold_s, 4),
            "image_id": info.image_id,
            "layers": len(info.layers),
            "size_bytes": info.size_bytes,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # cold starts, interleaved (one untimed round each first: page cache, the overlay's layers)
    for t in ("base", NAME):
        await _first_command(home, t, pool=False)
    cold: dict[str, list[float]] = {"base": [], NAME: []}
    stages: dict[str, dict[str, list[float]]] = {"base": {}, NAME: {}}
    for i in range(runs):
        for t in ("base", NAME) if i % 2 == 0 else (NAME, "base"):
            ms, _, st = await _first_command(home, t, pool=False)
            cold[t].append(ms)
            for s in st:
                if s.on_request_path:
                    stages[t].setdefault(s.stage, []).append(s.duration_ms)
    # warm-pool claims, interleaved, each pool full and quiet before each claim
    write_config(home, POOLS, TEMPLATES)
    engine.ensure_daemon()
    pooled: dict[str, list[float]] = {"base": [], NAME: []}
    misses = 0
    for i in range(runs):
        for t in ("base", NAME) if i % 2 == 0 else (NAME, "base"):
            for p in POOLS:
                await _wait_quiet(engine, p)
            ms, hit, _ = await _first_command(home, t, pool=True)
            misses += not hit
            pooled[t].append(ms)
    start = {f"cold_{'custom' if t == NAME else t}": _stats(v) for t, v in cold.items()}
    start.update({f"pool_{'custom' if t == NAME else t}": _stats(v) for t, v in pooled.items()})
    report["stats"] = start
    ratio_cold = start["cold_custom"]["p50_ms"] / start["cold_base"]["p50_ms"]
    ratio_pool = start["pool_custom"]["p50_ms"] / start["pool_base"]["p50_ms"]
    report["ratios_p50"] = {
        "cold_custom/cold_base": round(ratio_cold, 3),
        "pool_custom/pool_base": round(ratio_pool, 3),
    }
    report["pool_misses"] = misses
    report["cold_stages_on_request_path_p50_ms"] = {
        ("custom" if t == NAME else t): {k: round(statistics.median(v), 2) for k, v in d.items()}
        for t, d in stages.items()
    }
    b = report["build"]
    report["goals"] = {
        f"cached_rebuild/cold_build<{GOAL_REBUILD_RATIO:g}": _goal(
            b["rebuild_over_cold"], b["rebuild_over_cold"] < GOAL_REBUILD_RATIO
        ),
        f"cold_custom/cold_base<={GOAL_START_RATIO:g}": _goal(ratio_cold, ratio_cold <= GOAL_START_RATIO),
        f"pool_custom/pool_base<={GOAL_START_RATIO:g}": _goal(ratio_pool, ratio_pool <= GOAL_START_RATIO),
    }
    report["seconds"] = round(time.monotonic() - t_start, 1)
    return report


def _goal(measured: float, met: bool) -> dict[str, Any]:
    return {"measured": round(measured, 3), "met": met}


def print_report(r: dict[str, Any]) -> None:
    b = r["build"]
    print(f"bench template: {r['template']} = " + " | ".join(r["steps"]))
    print(
        f"  cold build {b['cold_s']:.2f} s ({b['cold_build_sandboxes']} build sandboxes, {b['layers']} layers,"
        f" {b['size_bytes'] / 1e6:.1f} MB); cached rebuild {b['cached_rebuild_s']:.3f} s"
        f" ({100 * b['rebuild_over_cold']:.1f} % of cold)"
    )
    _print_table(
        f"create -> first command ({r['runs']} interleaved runs each; cold: python3 -c, pool: run_code)",
        r["stats"],
        [f"ratio {k}: {v:.3f}x" for k, v in r["ratios_p50"].items()]
        + [
            f"cold {t} stages on the request path, p50 ms: " + ", ".join(f"{k}={x:.2f}" for k, x in d.items())
            for t, d in r["cold_stages_on_request_path_p50_ms"].items()
        ]
        + [f"pool misses: {r['pool_misses']}"],
    )
    for k, g in r["goals"].items():
        print(f"goal {k}: {g['measured']} -> {'met' if g['met'] else 'NOT met'}")
    print(f"({r['seconds']:.0f} s in all)")


async def command(args: argparse.Namespace) -> int:
    validate(args)
    # the pools come once the custom template is built
    await in_own_home({}, lambda home: bench_template(home, args.runs), print_report, args.json, TEMPLATES)
    return 0
