"""scripts/simulate-cluster: deterministic, places with placement.place (checked against the whole view), and its
counters add up. Pure: no sandbox, no process."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "simulate-cluster"


@pytest.fixture(scope="module")
def sim():
    loader = importlib.machinery.SourceFileLoader("simulate_cluster", str(SCRIPT))
    spec = importlib.util.spec_from_loader("simulate_cluster", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulate_cluster"] = module  # dataclasses look their module up while the script runs
    try:
        loader.exec_module(module)
        yield module
    finally:
        del sys.modules["simulate_cluster"]


def run(sim, scenario: str, **kw):
    p = sim.Params(nodes=kw.pop("nodes", 20), minutes=kw.pop("minutes", 1.0), check=kw.pop("check", 2000), **kw)
    p = dataclasses.replace(p, **{k: v for k, v in sim.SCENARIOS[scenario].items() if k not in kw})
    return sim.Sim(p, scenario).run()


@pytest.mark.parametrize("scenario", ["steady", "spike", "failures"])
def test_a_run_is_deterministic_and_matches_place_over_the_whole_view(sim, scenario):
    a = run(sim, scenario)  # --check: every create also placed over the full view (SystemExit if they differ)
    b = run(sim, scenario)
    assert a == b
    assert a["creates_per_s"] > 0 and 0 < a["pool_hit_rate"] <= 1
    assert a["registry_tx_per_s"] > a["registry_tx_per_s_without_sampler"] > 0


def test_failures_lose_sandboxes_and_pools_refill_elsewhere(sim):
    r = run(sim, "failures", mtbf_h=0.02, repair_s=30.0)
    assert r["node_failures"] >= 5 and r["lost_sandboxes"] > 0
    assert r["pool_hit_rate"] > 0.9  # the dead nodes' shares were refilled on the others


def test_a_spike_past_the_pools_misses_and_deeper_pools_cover_it(sim):
    shallow = run(sim, "spike", minutes=2.0, pool_per_node=1.0)
    deep = run(sim, "spike", minutes=2.0, pool_per_node=8.0)
    assert shallow["pool_hit_rate"] < deep["pool_hit_rate"]
    assert deep["pooled_shape_ms_p99"] < shallow["pooled_shape_ms_p99"]


def test_a_spike_queues_on_a_small_router_tier(sim):
    unbounded = run(sim, "spike", minutes=2.0)
    small = run(sim, "spike", minutes=2.0, router_cores=1)
    assert small["create_ms_p99"] > 2 * unbounded["create_ms_p99"]


def test_routers_with_their_own_views_herd_unless_each_create_is_salted(sim):
    """Four routers, each placing from its own 0.5 s-old view: without a salt all send a burst to
    the same best node (measured 0.87 on 100 nodes); with one per create (cluster/router.py), the
    creates of a pooled shape spread in proportion to what each node holds (measured 1.0)."""
    exact = run(sim, "steady", nodes=100, minutes=1.0, check=0)
    herd = run(sim, "steady", nodes=100, minutes=1.0, routers=4, salted=False)
    salted = run(sim, "steady", nodes=100, minutes=1.0, routers=4)
    assert exact["pool_hit_rate"] == 1.0 and herd["pool_hit_rate"] < 0.95 <= salted["pool_hit_rate"]


def test_a_full_cluster_refuses_with_no_capacity(sim):
    r = run(sim, "steady", util=1.5, pool_per_node=0.0, minutes=2.0)
    assert r["placement_failures"] > 0


def test_the_command_line_prints_a_table(sim, capsys):
    assert sim.main(["--nodes", "5", "--scenarios", "steady", "--minutes", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["scenario", "nodes", "creates/s"]
    assert "steady" in out
