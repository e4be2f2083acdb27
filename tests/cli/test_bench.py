"""The benchmarks run in CI in a short mode: they must keep working and report sane structure.

They assert behaviour (pool hits, outputs, clean-up), never speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cli

# the benchmarks make their own home and run its engine in process (home=): no server in between
pytestmark = pytest.mark.in_process("the benchmarks run their own home's engine in process")


def _bench(*args: str, timeout: float = 600) -> dict:
    before = set(Path("/tmp").glob("wbbench-*"))  # another bench (a parallel session) may run meanwhile
    r = cli("bench", *args, "--json", timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    left = set(Path("/tmp").glob("wbbench-*")) - before
    assert not left, f"the benchmark left its home behind: {sorted(left)}"
    return json.loads(r.stdout)


@pytest.mark.sandbox
def test_bench_start_short(runc_ready):
    rep = _bench("start", "--runs", "2", "--variant", "empty")
    v = rep["variants"]["empty"]
    assert set(v["stats"]) >= {"warm_pool", "warm_pool_exec", "warmbox_cold", "raw_runc"}
    assert all(s["n"] == 2 and s["p50_ms"] > 0 for s in v["stats"].values())
    assert v["pool_misses"] == 0 and v["distinct_outputs"] == 1  # every method printed 4
    assert set(v["stages_on_request_path_p50_ms"]["warm_pool"]) == {"allocation", "first_command"}
    cold = set(v["stages_on_request_path_p50_ms"]["warmbox_cold"])
    assert {"allocation", "filesystem", "runtime", "first_command"} <= cold
    assert v["ratios_p50"]["warmbox_cold/raw_runc"] > 0


@pytest.mark.sandbox
def test_bench_exec_short(runc_ready):
    rep = _bench("exec", "--seconds", "0.3")
    assert rep["true_per_second"]["concurrency_1"] > 0 and rep["true_per_second"]["concurrency_4"] > 0
    assert rep["raw_unix_socket_rtt"]["p50_us"] > 0
    assert rep["ping_sdk_asyncio"]["p50_us"] > rep["raw_unix_socket_rtt"]["p50_us"]


@pytest.mark.sandbox
def test_bench_burst_short(runc_ready):
    rep = _bench("burst", "--burst", "4", "--pools", "4", "2")
    covered, short = rep["runs"]
    # (the whole report on failure: a clean-clone run once had a filled pool of 4 give 0 hits)
    assert covered["pool"] == 4 and covered["hits"] == 4 and covered["cold"] == 0, rep
    assert short["pool"] == 2 and short["hits"] + short["cold"] == 4 and short["cold"] >= 1, rep
    assert covered["p99_over_p50"] >= 1


@pytest.mark.sandbox
def test_bench_density_short(runc_ready):
    rep = _bench("density", "--max", "2", "--step", "1", "--claims", "2")
    assert [s["sandboxes"] for s in rep["steps"]] == [1, 2]
    fu = rep["first_use"]  # a claim from the full pool timed to its first run_code, one to its first command
    assert fu["idle_sandboxes"] == 2 and fu["pool_hits"] == 2
    assert fu["create_first_run_code"]["n"] == 1 and fu["create_first_command"]["n"] == 1
    raw = rep["raw_python_idle"]  # the same run's floor: raw runc, PID 1 a bare sleeping python3
    assert raw["containers"] == 1 and raw["cgroup_mib_per_sandbox"] > 0
    assert 0 < raw["uss_mib_per_sandbox"] <= raw["rss_mib_per_sandbox"]
    for s in [*rep["steps"], raw]:
        assert s["cgroup_mib_per_sandbox"] > 0 and 0 < s["uss_mib_per_sandbox"] <= s["rss_mib_per_sandbox"]
    assert all(s["cgroup_over_raw"] > 0 for s in rep["steps"])


@pytest.mark.sandbox
def test_bench_snapshot_short(runc_ready):
    rep = _bench("snapshot", "--runs", "1", "--mb", "1")
    assert rep["memory_snapshot"] is False and rep["sizes"]["artifact_bytes"] > 1 << 20
    assert all(s["n"] == 1 and s["p50_ms"] > 0 for s in rep["stats"].values())
    assert set(rep["ratios_p50"]) == {"snapshot/raw_tar_zstd", "resume_first_pool/raw_untar"}


@pytest.mark.sandbox
def test_bench_snapshot_gvisor_short(runc_ready):
    rep = _bench("snapshot", "--tier", "gvisor", "--runs", "1")
    assert rep["memory_snapshot"] is True and rep["sizes"]["artifact_bytes"] > 0
    assert set(rep["stats"]) >= {"pause_ms", "restore_first_ms", "raw_checkpoint_ms", "raw_restore_ms"}
    assert all(s["p50_ms"] > 0 for s in rep["stats"].values())


@pytest.mark.sandbox
def test_bench_api_short(runc_ready):
    """Both sides of every part measured, the burst's creates all pool hits, nothing left behind:
    no sandbox, no server (its pid is gone), no home."""
    rep = _bench(
        "api", "--runs", "1", "--execs", "10", "--file-mb", "1", "--file-runs", "1",
        "--creates", "6", "--clients", "2", "--concurrency", "2",
    )  # fmt: skip
    assert rep["transport"] == "unix" and rep["url"].startswith("unix:")
    parts = (rep["warm"]["two_requests"], rep["warm"]["one_request"], rep["exec"], rep["info"])
    for part in parts:
        assert set(part["stats"]) == {"http", "in_process"}
        assert all(s["p50_ms"] > 0 for s in part["stats"].values())
    for how in ("two_requests", "one_request"):
        assert rep["warm"][how]["pool_misses"] == {"http": 0, "in_process": 0}
    for op in ("upload", "download"):
        assert all(r["p50_mib_s"] > 0 for r in rep["files"][op]["rates"].values())
    b = rep["burst"]
    for side in ("http", "in_process"):
        assert b[side]["stats"]["n"] == 6 and b[side]["pool_hits"] == 6 and b[side]["creates_per_s"] > 0
    assert b["http"]["in_flight"] == 4 and b["in_process"]["in_flight"] == 2
    assert len(rep["goals"]) == 3 and all(isinstance(g["met"], bool) for g in rep["goals"].values())
    pid = rep["server_pid"]
    assert not Path(f"/proc/{pid}").exists() or b"warmbox" not in Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.sandbox
def test_bench_api_over_tcp_smallest(runc_ready):
    """--tcp: the server's admin key is a tenant's, and every part still reaches its sandboxes
    (issue 34: it stopped at `no sandbox sb-…`)."""
    rep = _bench(
        "api", "--tcp", "--runs", "1", "--execs", "1", "--file-mb", "1", "--file-runs", "1",
        "--creates", "1", "--clients", "1", "--concurrency", "1",
    )  # fmt: skip
    assert rep["transport"] == "tcp" and rep["url"].startswith("http://127.0.0.1:")
    for part in (rep["warm"]["two_requests"], rep["warm"]["one_request"], rep["exec"], rep["info"]):
        assert all(s["n"] == 1 and s["p50_ms"] > 0 for s in part["stats"].values())
    assert all(r["p50_mib_s"] > 0 for r in rep["files"]["download"]["rates"].values())
    assert rep["burst"]["http"]["pool_hits"] == 1


@pytest.mark.sandbox
def test_bench_template_short(runc_ready):
    """A cold build that starts build sandboxes, a rebuild that starts none, both templates started
    cold and claimed from their pools (every claim a hit), the goals reported."""
    rep = _bench("template", "--runs", "1")
    b = rep["build"]
    assert b["cold_build_sandboxes"] == 2 and b["cold_s"] > b["cached_rebuild_s"] > 0
    assert b["layers"] >= 5 and b["size_bytes"] > 16 << 20  # base's layers + 3 (the 16 MiB blob among them)
    assert set(rep["stats"]) == {"cold_base", "cold_custom", "pool_base", "pool_custom"}
    assert all(s["n"] == 1 and s["p50_ms"] > 0 for s in rep["stats"].values())
    assert rep["pool_misses"] == 0
    assert len(rep["goals"]) == 3 and all(isinstance(g["met"], bool) for g in rep["goals"].values())


@pytest.mark.sandbox
def test_bench_session_short(runc_ready, tmp_path):
    """The coding session on the container tier with a half-second think: keep-alive and pause play
    every turn as expected (tests fail, then pass after the edit; the Node build with its local
    dependency), pause keeps the files but (no memory snapshot here) not the background process,
    the raw runc turns ran, the goals and the chart are there."""
    stem = tmp_path / "chart"
    rep = _bench(
        "session", "--tier", "container", "--session", "coding", "--strategy", "keep", "--strategy", "pause",
        "--think", "1", "--think-scale", "0.5", "--chart", str(stem),
    )  # fmt: skip
    rows = {r["strategy"]: r for r in rep["rows"]}
    assert set(rows) == {"keep", "pause"} and rep["think_s"] == 0.5
    for r in rows.values():
        assert r["all_ok"], r
        assert [t["turn"] for t in r["turns"]] == ["read", "test", "failure", "edit", "retest", "build"]
        assert all(t["total_ms"] >= t["prep_ms"] >= 0 for t in r["turns"]) and len(r["idle"]) == 5
    assert rows["keep"]["kept"] == {"files": True, "background": True} and rows["keep"]["stored_bytes"] == 0
    assert rows["pause"]["kept"] == {"files": True, "background": False} and rows["pause"]["stored_bytes"] > 0
    assert rows["pause"]["later_turn_prep_mean_ms"] > 0 and rows["pause"]["pause_mean_ms"] > 0
    assert rows["keep"]["idle_gib_s"] > 0 and rows["pause"]["idle_gib_s"] < rows["keep"]["idle_gib_s"]
    assert [t["turn"] for t in rep["raw"]["coding"]] == [t["turn"] for t in rows["keep"]["turns"]]
    assert [(g["strategy"], g["added_goal_ms"]) for g in rep["goals"]] == [("pause", 150.0)]
    assert stem.with_suffix(".png").read_bytes()[:4] == b"\x89PNG" and b"<svg" in stem.with_suffix(".svg").read_bytes()


@pytest.mark.parametrize(
    "args",
    [
        ["session", "--think", "-1"],
        ["session", "--think-scale", "2"],
        ["density", "--claims", "-1"],
        ["api", "--creates", "0"],
        ["api", "--clients", "5", "--creates", "4"],
        ["start", "--runs", "0"],
        ["burst", "--burst", "0"],
        ["density", "--step", "0"],
        ["exec", "--seconds", "-1"],
        ["snapshot", "--mb", "-1"],
        ["template", "--runs", "0"],
        ["cluster", "--nodes", "4"],
        ["cluster", "--failovers", "-1"],
    ],
)
def test_bench_bad_arguments_are_typed(args):
    r = cli("bench", *args)
    assert r.returncode == 125 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _qemus() -> set[int]:
    out = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"qemu-system" in (proc / "cmdline").read_bytes():
                out.add(int(proc.name))
        except OSError:
            pass
    return out


@pytest.mark.sandbox
@pytest.mark.timeout(900)
def test_bench_microvm_short(runc_ready):
    """Restore and cold boot against raw QEMU; pause/resume against raw migrate: one run each."""
    tiers = {t["tier"]: t for t in json.loads(cli("doctor", "--json").stdout)}
    assert tiers["microvm"]["available"], tiers["microvm"]["reason"]
    before = _qemus()
    rep = _bench("start", "--tier", "microvm", "--runs", "1", "--variant", "empty")
    assert rep["accelerator"] in ("tcg", "kvm") and rep["kernel"].endswith("-amd64")
    assert set(rep["stats"]) == {
        "warmbox_restore_first",
        "raw_qemu_restore_first",
        "warmbox_cold_boot_first",
        "raw_qemu_boot_first",
    }
    assert all(s["n"] == 1 and s["p50_ms"] > 0 for s in rep["stats"].values())
    assert {"allocation", "filesystem", "runtime", "first_command"} <= set(rep["restore_stages_p50_ms"])
    assert set(rep["goals"]) == {
        "restore_first_p50_ms<=400",
        "restore_first/raw_qemu_restore<=1.3",
        "cold_boot_first/raw_qemu_boot<=1.2",
    }
    rep = _bench("snapshot", "--tier", "microvm", "--runs", "1")
    assert rep["memory_snapshot"] is True and rep["sizes"]["artifact_bytes"] > 0
    assert set(rep["stats"]) == {"pause_ms", "resume_first_ms", "raw_save_ms", "raw_restore_first_ms"}
    assert _qemus() <= before, "the benchmark left a VM running"


def test_bench_session_prices_come_from_the_users_cost_settings(tmp_path, monkeypatch):
    """bench session prices idle time at the user's [cost] (the first-hour issue's settings) when
    it sets prices; else at E2B's published ones; a flag still wins."""
    import argparse

    from warmbox.bench import session

    def args(**kw):
        return argparse.Namespace(think=1.0, think_scale=1.0, cpu_hour=None, gib_hour=None, **kw)

    monkeypatch.delenv("WARMBOX_CONFIG", raising=False)
    monkeypatch.setenv("WARMBOX_HOME", str(tmp_path))
    a = args()
    session.validate(a)
    assert (a.cpu_hour, a.gib_hour) == (session.DEFAULT_CPU_HOUR, session.DEFAULT_GIB_HOUR)
    (tmp_path / "warmbox.toml").write_text("[cost]\ncpu_hour = 0.2\ngib_hour = 0.03\n")
    a = args()
    session.validate(a)
    assert (a.cpu_hour, a.gib_hour) == (0.2, 0.03)
    a = argparse.Namespace(think=1.0, think_scale=1.0, cpu_hour=1.5, gib_hour=None)
    session.validate(a)
    assert (a.cpu_hour, a.gib_hour) == (1.5, 0.03)
