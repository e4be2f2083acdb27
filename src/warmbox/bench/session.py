"""``warmbox bench session``: what an agent session costs, turn by turn, with the model's think time.

coding:  a six-turn coding session on a small project written into the sandbox (a Python package
         with a pytest suite, a Node.js app whose build needs a local ``file:`` dependency): read
         the repository, run the tests, read the failure, edit the code, run the tests again,
         ``npm install`` (offline: only the local dependency) and build.
data:    a data agent: pandas on an uploaded CSV (load, group, a matplotlib chart, a last cell
         that reads the variables the first ones made).

Between turns the agent waits ``--think`` seconds (20 by default, scaled by ``--think-scale``).
Each session runs per tier (container, gvisor, microvm: the isolate tier has no commands) and
per strategy:

keep:       one sandbox, alive between turns.
recreate:   a new sandbox each turn (``pool=False``: a pooled one would be idle cost too), the
            state uploaded again (the project as it is; the CSV and the cells so far), destroyed
            after the turn.
pause:      ``pause()`` after each turn (with memory where the tier has memory snapshots), the
            same sandbox id resumed at the next one.
autopause:  ``Lifecycle(idle_pause_after=..., auto_resume=True)``: the daemon pauses it while the
            model thinks, the next operation resumes it.

Per turn: the latency on the agent's path split into ``prep`` (create + upload, or resume) and the
turn itself; per think interval: GiB-s and CPU-s from warmbox's metering (``metrics``: readings
before and after the interval, so a paused sandbox holds nothing); money at ``--cpu-hour`` and
``--gib-hour`` prices; bytes stored (snapshots, or the state the client keeps to upload again).
What survives a pause is checked: files, the code context's variables, a background process.
Raw baseline in the same run: each turn as a plain ``runc run`` of the same OCI config with the
state copied into its workspace (no state survives a raw run: the data turns replay their cells).

Sessions run concurrently but one turn at a time (a lock): turns are timed alone, and the think
intervals overlap. Everything runs in a private WARMBOX_HOME, removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from warmbox.bench.home import in_own_home
from warmbox.bench.raw import _RawRunc
from warmbox.errors import InvalidArgument, WarmboxError

TIERS = ("container", "gvisor", "microvm")
STRATEGIES = ("keep", "recreate", "pause", "autopause")
SESSIONS = ("coding", "data")
DEFAULT_STRATEGIES = ("keep", "recreate", "pause")
# E2B's published per-second prices (1 vCPU, 1 GiB) as hourly ones; a [cost] setting overrides these
DEFAULT_CPU_HOUR = 0.0504
DEFAULT_GIB_HOUR = 0.0162
AUTOPAUSE_AFTER_S = 1.0  # idle_pause_after of the autopause strategy
GOAL_PAUSE_ADDED_MS = {"container": 150.0, "gvisor": 500.0}
GOAL_IDLE_CUT = 0.90

# ---------------------------------------------------------------------------- the sessions

STATS_BUGGY = '''"""Small statistics helpers."""


def mean(xs):
    return sum(xs) / (len(xs) + 1)


def spread(xs):
    return max(xs) - min(xs)
'''
STATS_FIXED = STATS_BUGGY.replace("(len(xs) + 1)", "len(xs)")
TESTS = """from calc.stats import mean, spread


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_spread():
    assert spread([3, 9, 4]) == 6
"""
PROJECT = {
    "proj/calc/__init__.py": "",
    "proj/calc/stats.py": STATS_BUGGY,
    "proj/tests/__init__.py": "",
    "proj/tests/test_stats.py": TESTS,
    "proj/fmtlib/package.json": json.dumps({"name": "fmtlib", "version": "1.0.0", "main": "index.js"}),
    "proj/fmtlib/index.js": "exports.banner = (s) => `== ${s} ==`;\n",
    "proj/web/package.json": json.dumps(
        {
            "name": "web",
            "version": "1.0.0",
            "private": True,
            "scripts": {"build": "node build.js"},
            "dependencies": {"fmtlib": "file:../fmtlib"},
        }
    ),
    "proj/web/build.js": (
        "const fs = require('fs');\nconst { banner } = require('fmtlib');\n"
        "fs.mkdirSync('dist', { recursive: true });\n"
        "fs.writeFileSync('dist/app.js', `console.log(${JSON.stringify(banner('built'))});\\n`);\n"
    ),
}
NPM = "npm_config_cache=/tmp/.npm npm"


@dataclasses.dataclass(frozen=True)
class Turn:
    """One agent turn: a shell command, a code cell, or a file edit (``path`` gets ``text``)."""

    name: str
    kind: str  # "sh" | "code" | "edit"
    text: str
    expect_exit: int = 0
    expect_out: str = ""
    path: str = ""


CODING = (
    Turn(
        "read",
        "sh",
        "cd /workspace/proj && find . -type f -not -path '*/node_modules/*' | sort && "
        "cat calc/stats.py tests/test_stats.py web/package.json",
        expect_out="def mean",
    ),
    Turn("test", "sh", "cd /workspace/proj && python3 -m pytest -q -p no:cacheprovider tests", 1, "1 failed"),
    Turn(
        "failure",
        "sh",
        "cd /workspace/proj && python3 -m pytest -q -p no:cacheprovider -x -k mean --tb=short tests; "
        "grep -n 'def mean' -A1 calc/stats.py",
        expect_out="len(xs) + 1",
    ),
    Turn("edit", "edit", STATS_FIXED, path="proj/calc/stats.py"),
    Turn("retest", "sh", "cd /workspace/proj && python3 -m pytest -q -p no:cacheprovider tests", 0, "2 passed"),
    Turn(
        "build",
        "sh",
        f"cd /workspace/proj/web && {NPM} install --offline --no-audit --no-fund --loglevel=error && "
        f"{NPM} run --silent build && node dist/app.js",
        expect_out="== built ==",
    ),
)
DATA = (
    Turn(
        "load",
        "code",
        "import pandas as pd\ndf = pd.read_csv('/workspace/sales.csv')\ndf.shape",
        expect_out="(20000, 4)",
    ),
    Turn(
        "group",
        "code",
        "summary = df.groupby('region')['sales'].agg(['count', 'mean', 'sum']).round(2)\nsummary",
        expect_out="count",
    ),
    Turn(
        "chart",
        "code",
        "import os\nimport matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots()\nsummary['sum'].plot.bar(ax=ax)\nfig.savefig('/workspace/chart.png')\n"
        "plt.close(fig)\nos.path.getsize('/workspace/chart.png') > 1000",
        expect_out="True",
    ),
    Turn("recall", "code", "int(summary['count'].sum()), len(df)", expect_out="(20000, 20000)"),
)


def _csv() -> str:
    regions = ("north", "south", "east", "west", "centre")
    rows = ["day,region,units,sales"]
    for i in range(20000):
        units = (i * 7919) % 97 + 1
        rows.append(f"{i % 365},{regions[i % len(regions)]},{units},{units * ((i * 31) % 13 + 2) / 4:.2f}")
    return "\n".join(rows) + "\n"


def _write_state(root: Path, session: str) -> None:
    """The state the agent starts from, on the client: the project, or the CSV."""
    files = PROJECT if session == "coding" else {"sales.csv": _csv()}
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _state_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------- one session


@dataclasses.dataclass
class _Run:
    session: str
    tier: str
    strategy: str
    turns: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    idle: list[dict[str, float]] = dataclasses.field(default_factory=list)
    pauses_ms: list[float] = dataclasses.field(default_factory=list)
    sandboxes: list[str] = dataclasses.field(default_factory=list)
    stored_bytes: int = 0
    kept: dict[str, bool | None] = dataclasses.field(default_factory=dict)
    wall_s: float = 0.0
    error: str = ""


class _Player:
    """Plays one (session, tier, strategy); turns hold ``lock`` so that they are timed alone."""

    def __init__(self, home: Path, run: _Run, lock: asyncio.Lock, think_s: float, work: Path) -> None:
        from warmbox.engine.engine import Engine

        self.home = home
        self.run = run
        self.lock = lock
        self.think_s = think_s
        self.state = work / f"{run.session}-{run.tier}-{run.strategy}"
        _write_state(self.state, run.session)
        self.engine = Engine.for_home(home)
        self.memory = self.engine.backend(run.tier).capabilities().memory_snapshot
        self.turns = CODING if run.session == "coding" else DATA
        self.sb: Any = None
        self.waited = 0.0

    async def _locked(self) -> None:
        t0 = time.perf_counter()
        await self.lock.acquire()
        self.waited += time.perf_counter() - t0

    async def _create(self) -> Any:
        from warmbox.models import Lifecycle
        from warmbox.sdk.sandbox import AsyncSandbox

        lifecycle = None
        if self.run.strategy == "autopause":
            lifecycle = Lifecycle(idle_pause_after=AUTOPAUSE_AFTER_S, auto_resume=True)
        template = "base" if self.run.session == "coding" else "pydata"
        sb = await AsyncSandbox.create(
            tier=self.run.tier, template=template, timeout=3600, pool=False, lifecycle=lifecycle, home=self.home
        )
        self.run.sandboxes.append(sb.sandbox_id)
        await sb.files.upload_dir(self.state, "/workspace")
        return sb

    async def _meter(self) -> tuple[float, float]:
        """(GiB-s, CPU-s) the metering recorded for every sandbox of this run so far."""
        from warmbox.models import State

        gib = cpu = 0.0
        for sid in self.run.sandboxes:
            running = self.engine.info(sid)[0].state in (State.READY, State.RUNNING)
            # a paused or ended one is not read (nothing runs): its meters as last recorded
            m = await self.engine.metrics(sid) if running else self.engine.metered(sid)
            gib, cpu = gib + m.memory_gib_s, cpu + m.cpu_s
        return gib, cpu

    async def _do(self, turn: Turn, replay: tuple[Turn, ...]) -> tuple[bool, str]:
        """Run one turn in ``self.sb``; (as expected, a short reason when not)."""
        sb = self.sb
        for cell in replay:  # recreate: the cells before this one, to rebuild the context's state
            ex = await sb.run_code(cell.text, timeout=600)
            if ex.error:
                return False, f"replay {cell.name}: {ex.error.name}"
        if turn.kind == "edit":
            await sb.files.write(f"/workspace/{turn.path}", turn.text)
            (self.state / turn.path).write_text(turn.text)  # what a later recreate uploads
            return True, ""
        if turn.kind == "code":
            ex = await sb.run_code(turn.text, timeout=600)
            if ex.error:
                return False, f"{ex.error.name}: {ex.error.value[:120]}"
            out = (ex.text or "") + ex.stdout
        else:
            r = await sb.commands.run(turn.text, timeout=600)
            if r.exit_code != turn.expect_exit:
                return False, f"exit {r.exit_code}: {(r.stderr or r.stdout)[-200:]}"
            out = r.stdout + r.stderr
        if turn.expect_out not in out:
            return False, f"no {turn.expect_out!r} in output: {out[-200:]!r}"
        return True, ""

    async def play(self) -> _Run:
        from warmbox.sdk.sandbox import AsyncSandbox

        run = self.run
        t_start = time.perf_counter()
        try:
            g0 = c0 = t_end = 0.0
            for i, turn in enumerate(self.turns):
                if i:  # the interval since the turn's end: the pause or kill, then the think time
                    await asyncio.sleep(self.think_s)
                    g1, c1 = await self._meter()
                    run.idle.append({"s": time.perf_counter() - t_end, "gib_s": g1 - g0, "cpu_s": c1 - c0})
                await self._locked()
                try:
                    # autopause: the latest resume's time, to tell a resume of this turn from an old one
                    before = (await self.sb.get_timings()).get("resume") if run.strategy == "autopause" and i else None
                    t0 = time.perf_counter()
                    resumed_ms = 0.0
                    if self.sb is None or run.strategy == "recreate":
                        self.sb = await self._create()
                    elif run.strategy == "pause":
                        self.sb = await AsyncSandbox.resume(run.sandboxes[0], home=self.home)
                    t1 = time.perf_counter()
                    replay = self.turns[:i] if run.strategy == "recreate" and turn.kind == "code" else ()
                    ok, why = await self._do(turn, replay)
                    t2 = time.perf_counter()
                    if run.strategy == "autopause" and i:
                        after = (await self.sb.get_timings()).get("resume")
                        resumed_ms = after if after is not None and after != before else 0.0
                    # (not with autopause: a running background process is use, never auto-paused)
                    if i == 0 and run.session == "coding" and run.strategy in ("keep", "pause"):
                        await self.sb.commands.run("sleep 86400", background=True, tag="bench-bg")
                    if i == len(self.turns) - 1:
                        await self._check_kept(ok)
                    prep_ms = (t1 - t0) * 1e3 + resumed_ms
                    total_ms = (t2 - t0) * 1e3
                    run.turns.append(
                        {
                            "turn": turn.name,
                            "prep_ms": prep_ms,
                            "command_ms": total_ms - prep_ms,
                            "total_ms": total_ms,
                            "ok": ok,
                            "why": why,
                        }
                    )
                    g0, c0 = await self._meter()
                    t_end = time.perf_counter()
                    await self._after_turn(i == len(self.turns) - 1)
                finally:
                    self.lock.release()
        except WarmboxError as e:
            run.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            run.wall_s = time.perf_counter() - t_start - self.waited
            await self._end()
        return run

    async def _after_turn(self, last: bool) -> None:
        run = self.run
        if run.strategy == "recreate":
            run.stored_bytes = max(run.stored_bytes, _state_bytes(self.state))
            await self.sb.kill()
            self.sb = None
        elif run.strategy == "pause" and not last:
            t0 = time.perf_counter()
            ref = await self.sb.pause(memory=self.memory)
            run.pauses_ms.append((time.perf_counter() - t0) * 1e3)
            run.stored_bytes = max(run.stored_bytes, ref.size_bytes)

    async def _check_kept(self, last_ok: bool) -> None:
        """What the sandbox still has at the last turn: its files (the edit), the context's variables
        (the data session's last cell reads them), the background process of the first turn."""
        run = self.run
        if run.session == "coding":
            r = await self.sb.commands.run("grep -c 'len(xs)$' /workspace/proj/calc/stats.py", timeout=60)
            run.kept["files"] = r.stdout.strip() == "1"
            if run.strategy in ("keep", "pause"):
                procs = await self.sb.commands.list()
                run.kept["background"] = any(p.tag == "bench-bg" for p in procs)
        else:
            run.kept["files"] = await self.sb.files.exists("/workspace/chart.png")
            run.kept["context"] = last_ok if run.strategy != "recreate" else None

    async def _end(self) -> None:
        from warmbox.sdk.sandbox import AsyncSandbox

        if self.sb is not None:
            try:
                await self.sb.kill()
            except WarmboxError:
                pass
        for sid in self.run.sandboxes:  # a paused one too
            try:
                await AsyncSandbox.kill(sid, home=self.home)
            except WarmboxError:
                pass


# ---------------------------------------------------------------------------- raw baseline


def _raw_session(runtime: Path, session: str, work: Path) -> list[dict[str, Any]]:
    """Each turn as a plain ``runc run`` of warmbox's OCI config, the state copied in first."""
    raw = _RawRunc(runtime)
    state = work / f"raw-{session}"
    _write_state(state, session)
    turns = CODING if session == "coding" else DATA
    rows = []
    for i, turn in enumerate(turns):
        if turn.kind == "edit":
            (state / turn.path).write_text(turn.text)
            cmd = ["true"]
        elif turn.kind == "code":
            script = "\n".join(t.text for t in turns[: i + 1])
            cmd = ["python3", "-c", script]
        else:
            cmd = ["bash", "-c", turn.text]
        ms, _out = raw.run(cmd, seed=state, check=turn.expect_exit == 0)
        rows.append({"turn": turn.name, "total_ms": ms})
    return rows


# ---------------------------------------------------------------------------- the report


def _money(cpu_s: float, gib_s: float, prices: dict[str, float]) -> float:
    return cpu_s * prices["cpu_hour"] / 3600 + gib_s * prices["gib_hour"] / 3600


def _summary(run: _Run, prices: dict[str, float], think_s: float) -> dict[str, Any]:
    turns = run.turns
    idle_gib = sum(x["gib_s"] for x in run.idle)
    idle_cpu = sum(x["cpu_s"] for x in run.idle)
    n_idle = max(1, len(run.idle))
    return {
        "session": run.session,
        "tier": run.tier,
        "strategy": run.strategy,
        "turns": turns,
        "idle": run.idle,
        "pauses_ms": run.pauses_ms,
        "all_ok": bool(turns) and all(t["ok"] for t in turns) and not run.error,
        "error": run.error,
        "turn_total_p50_ms": statistics.median(t["total_ms"] for t in turns) if turns else None,
        # the turns after the first: the first is a create for every strategy
        "later_turn_prep_mean_ms": statistics.fmean(t["prep_ms"] for t in turns[1:]) if len(turns) > 1 else None,
        "later_turn_total_mean_ms": statistics.fmean(t["total_ms"] for t in turns[1:]) if len(turns) > 1 else None,
        "pause_mean_ms": statistics.fmean(run.pauses_ms) if run.pauses_ms else None,
        "wall_s": run.wall_s,
        "idle_s": sum(x["s"] for x in run.idle),
        "idle_gib_s": idle_gib,
        "idle_cpu_s": idle_cpu,
        "idle_gib_s_per_think": idle_gib / n_idle,
        "idle_money": _money(idle_cpu, idle_gib, prices),
        "stored_bytes": run.stored_bytes,
        "kept": run.kept,
        "sandboxes": len(run.sandboxes),
        "think_s": think_s,
    }


def _goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pause against keep-alive, per session and tier: time added per turn, idle GiB-s cut."""
    by = {(r["session"], r["tier"], r["strategy"]): r for r in rows}
    out = []
    for (session, tier, strategy), r in by.items():
        keep = by.get((session, tier, "keep"))
        if strategy not in ("pause", "autopause") or keep is None or r["later_turn_total_mean_ms"] is None:
            continue
        # what pausing adds on the agent's path: turns 2.. against keep-alive's (the resume, and
        # any slower command after it: a context started again, caches gone)
        added = r["later_turn_total_mean_ms"] - keep["later_turn_total_mean_ms"]
        cut = 1 - r["idle_gib_s"] / keep["idle_gib_s"] if keep["idle_gib_s"] > 0 else None
        goal_ms = GOAL_PAUSE_ADDED_MS.get(tier)
        out.append(
            {
                "session": session,
                "tier": tier,
                "strategy": strategy,
                "added_per_turn_ms": added,
                "resume_mean_ms": r["later_turn_prep_mean_ms"],
                "added_goal_ms": goal_ms,
                "added_met": None if goal_ms is None else added <= goal_ms,
                "idle_gib_s_cut": cut,
                "idle_cut_met": None if cut is None else cut >= GOAL_IDLE_CUT,
                "kept": r["kept"],
            }
        )
    return out


def _chart(report: dict[str, Any], stem: Path) -> list[str]:
    """Per-turn latency against idle GiB-s per think interval, one panel per session; PNG and SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sessions = sorted({r["session"] for r in report["rows"]})
    fig, axes = plt.subplots(1, len(sessions), figsize=(6.5 * len(sessions), 4.8), squeeze=False)
    markers = {"keep": "o", "recreate": "s", "pause": "^", "autopause": "v"}
    colors = {"container": "tab:blue", "gvisor": "tab:green", "microvm": "tab:red"}
    for ax, session in zip(axes[0], sessions, strict=True):
        for r in report["rows"]:
            if r["session"] != session or r["later_turn_total_mean_ms"] is None:
                continue
            ax.scatter(
                r["idle_gib_s_per_think"],
                r["later_turn_total_mean_ms"],
                marker=markers[r["strategy"]],
                color=colors[r["tier"]],
                s=60,
                label=f"{r['tier']} {r['strategy']}",
            )
        raw = report["raw"].get(session)
        if raw:
            ax.axhline(statistics.fmean(t["total_ms"] for t in raw[1:]), color="grey", ls="--", label="raw runc run")
        xs = [r["idle_gib_s_per_think"] for r in report["rows"] if r["session"] == session]
        ax.set_xscale("symlog", linthresh=1e-3)
        ax.set_xlim(0, max([1e-3, *xs]) * 3)
        ax.set_yscale("log")
        ax.margins(y=0.2)
        ax.set_xlabel(f"idle GiB-s per think interval ({report['think_s']:g} s)")
        ax.set_ylabel("mean latency of turns 2.. on the agent's path (ms)")
        ax.set_title(f"{session} session")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    paths = []
    for ext in ("png", "svg"):
        p = stem.with_suffix(f".{ext}")
        fig.savefig(p)
        paths.append(str(p))
    plt.close(fig)
    return paths


def print_report(r: dict[str, Any]) -> None:
    p = r["prices"]
    print(
        f"bench session: think {r['think_s']:g} s, prices ${p['cpu_hour']}/CPU-h ${p['gib_hour']}/GiB-h; "
        f"load {r['load_before']} -> {r['load_after']}"
    )
    head = (
        f"  {'session':<7} {'tier':<9} {'strategy':<9} {'ok':<3} {'prep ms':>8} {'turn ms':>8} {'pause ms':>8} "
        f"{'wall s':>7} {'idle GiB-s':>10} {'idle CPU-s':>10} {'idle $':>10} {'stored B':>10}  kept"
    )
    print(head)
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for x in r["rows"]:
        kept = ",".join(f"{k}={'y' if v else ('-' if v is None else 'NO')}" for k, v in x["kept"].items())
        print(
            f"  {x['session']:<7} {x['tier']:<9} {x['strategy']:<9} {'y' if x['all_ok'] else 'NO':<3} "
            f"{fmt(x['later_turn_prep_mean_ms'], '8.1f')} {fmt(x['later_turn_total_mean_ms'], '8.1f')} "
            f"{fmt(x['pause_mean_ms'], '8.1f')} {x['wall_s']:7.1f} {x['idle_gib_s']:10.4f} {x['idle_cpu_s']:10.3f} "
            f"{x['idle_money']:10.2e} {x['stored_bytes']:10d}  {kept}"
        )
        for t in x["turns"]:
            if not t["ok"]:
                print(f"      turn {t['turn']}: {t['why']}")
        if x["error"]:
            print(f"      error: {x['error']}")
    print("  (prep/turn ms: means over turns 2.. on the agent's path; turn includes prep)")
    for session, raw in r["raw"].items():
        print(f"  raw runc run per turn, {session}: " + ", ".join(f"{t['turn']} {t['total_ms']:.0f} ms" for t in raw))
    for g in r["goals"]:
        met = {True: "met", False: "NOT met", None: "no goal"}
        cut = "-" if g["idle_gib_s_cut"] is None else f"{g['idle_gib_s_cut'] * 100:.1f} %"
        print(
            f"  goal {g['session']}/{g['tier']}/{g['strategy']}: +{g['added_per_turn_ms']:.1f} ms per turn "
            f"(resume {g['resume_mean_ms']:.1f} ms; {met[g['added_met']]}), idle GiB-s cut {cut} "
            f"({met[g['idle_cut_met']]})"
        )
    if r["chart"]:
        print("  chart: " + " ".join(r["chart"]))


# ---------------------------------------------------------------------------- entry


def validate(args: argparse.Namespace) -> None:
    if not 0 <= args.think <= 3600:
        raise InvalidArgument(f"--think must be in [0, 3600], got {args.think}")
    if not 0 <= args.think_scale <= 1:
        raise InvalidArgument(f"--think-scale must be in [0, 1], got {args.think_scale}")
    user = user_prices()
    for name, fallback in (("cpu_hour", DEFAULT_CPU_HOUR), ("gib_hour", DEFAULT_GIB_HOUR)):
        if getattr(args, name) is None:  # the user's [cost] when it sets prices, else E2B's
            setattr(args, name, user[name] if user else fallback)
        if not 0 <= getattr(args, name) <= 1000:
            raise InvalidArgument(f"--{name.replace('_', '-')} must be in [0, 1000], got {getattr(args, name)}")


def user_prices() -> dict[str, float] | None:
    """The ``[cost]`` prices of the user's warmbox.toml (the bench's own home has none), or None
    when it sets none or cannot be read (the bench still runs, at E2B's prices)."""
    from warmbox import config, paths

    try:
        cost = config.load(paths.default_home()).cost
    except WarmboxError:
        return None
    return {"cpu_hour": cost.cpu_hour, "gib_hour": cost.gib_hour} if cost.priced else None


async def bench_session(home: Path, args: argparse.Namespace) -> dict[str, Any]:
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    tiers = list(dict.fromkeys(args.tier or TIERS))
    strategies = list(dict.fromkeys(args.strategy or DEFAULT_STRATEGIES))
    sessions = list(dict.fromkeys(args.session or SESSIONS))
    usable = {s.tier for s in engine.doctor() if s.available}
    missing = [t for t in tiers if t not in usable]
    if missing and args.tier:
        raise WarmboxError(f"tier(s) not available on this host: {', '.join(missing)} (warmbox doctor)")
    tiers = [t for t in tiers if t in usable]
    think = args.think * args.think_scale
    prices = {"cpu_hour": args.cpu_hour, "gib_hour": args.gib_hour}
    load_before = os.getloadavg()[0]
    lock = asyncio.Lock()
    work = Path(tempfile.mkdtemp(prefix="wbbench-session-"))
    try:
        players = [
            _Player(home, _Run(session, tier, strategy), lock, think, work)
            for session in sessions
            for tier in tiers
            for strategy in strategies
        ]
        runs = await asyncio.gather(*(p.play() for p in players))
        async with lock:  # the raw baseline alone too
            raw = {s: await asyncio.to_thread(_raw_session, engine.runtime, s, work) for s in sessions}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [_summary(run, prices, think) for run in runs]
    report: dict[str, Any] = {
        "bench": "session",
        "think_s": think,
        "prices": prices,
        "tiers": tiers,
        "strategies": strategies,
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "rows": rows,
        "raw": raw,
        "goals": _goals(rows),
        "chart": [],
    }
    if args.chart:
        report["chart"] = _chart(report, Path(args.chart))
    return report


async def command(args: argparse.Namespace) -> int:
    validate(args)
    report = await in_own_home({}, lambda home: bench_session(home, args), print_report, args.json)
    return 0 if all(r["all_ok"] for r in report["rows"]) else 1


__all__ = ["command"]
