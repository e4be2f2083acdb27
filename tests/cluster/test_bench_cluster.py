"""`warmbox bench cluster` in a short mode: its own cluster on this host (PostgreSQL, Ray head, 2 nodes, router),
warm creates and a burst through the router with 1 then 2 nodes, one node SIGKILLed under a paused sandbox; the
report's structure, placement spread and failover, and nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]


def test_bench_cluster_short(runc_ready):
    argv = [sys.executable, "-m", "warmbox.cli.main", "bench", "cluster", "--json"]
    argv += ["--nodes", "2", "--runs", "3", "--creates", "6", "--clients", "1", "--concurrency", "3"]
    argv += ["--failovers", "1", "--slots", "8"]
    before = {p.name for p in Path("/tmp").glob("wbbc-*")}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    r = json.loads(out.stdout)
    assert r["problems"] == []
    assert [s["nodes"] for s in r["steps"]] == [1, 2]
    for step in r["steps"]:
        warm, burst = step["warm"], step["burst"]
        assert warm["runs"] == 3 and warm["pool_misses"] == 0  # the pools were full before each timed create
        assert 0 < warm["stats"]["p50_ms"] <= warm["stats"]["p99_ms"]
        assert burst["completed"] == 6 and not burst["errors"] and burst["creates_per_s"] > 0
        # the cluster-wide pool (6, split over the nodes) was full before; each create draws its node
        # in proportion to what it holds, so concurrent creates can both draw the node with one left
        assert burst["hits"] >= 5, burst  # one miss at most (seen 1 run in 3)
        assert sum(burst["nodes"].values()) == 6
    assert set(r["steps"][1]["burst"]["nodes"]) == {"n1", "n2"}  # a burst spreads over both nodes
    (run,) = r["failover"]["runs"]
    assert run["now_on"] != run["node"] and 0 < run["down_after_s"] <= run["seconds"]
    # the failover bound (p50 <= 3 s, max <= 5 s, measured over 5+ by the command itself) with room
    # for a loaded CI host; Ray's default health check alone took 12.5 s
    assert run["seconds"] < 10 and run["tries"] == 1  # the connect sent to the dead node resumed elsewhere
    assert run["in_flight_error"] == "SandboxLost" and run["in_flight_s"] < 10
    assert r["failover"]["goal_met"] is False  # one failover: too few to claim the goal
    assert {p.name for p in Path("/tmp").glob("wbbc-*")} == before  # its directory is gone
