"""A node's share of cluster-wide pool targets (cluster/node.py NodeShare) over a real registry:
the up nodes that run the pool's tier split the target by slots."""

from __future__ import annotations

from warmbox.cluster.node import NodeShare
from warmbox.config import PoolConfig
from warmbox.models import NodeInfo
from warmbox.storage.registry import Registry


def _pool(name: str, tier: str = "container") -> PoolConfig:
    return PoolConfig(name=name, template="base", tier=tier, min=0, max=10, target=0)


def test_shares_sum_to_the_target_over_the_up_nodes(tmp_path) -> None:
    reg = Registry(tmp_path / "r.db")
    for name, slots, tiers in (("a", 4, ("container",)), ("b", 4, ("container", "gvisor")), ("c", 8, ("gvisor",))):
        reg.nodes.join_node(NodeInfo(name=name, slots=slots, tiers=tiers))
    shares = {n: NodeShare(reg, n) for n in "abc"}
    pool = _pool("p")
    assert [shares[n].share(pool, 5) for n in "abc"] in ([3, 2, 0], [2, 3, 0])
    gv = _pool("g", "gvisor")
    assert shares["b"].share(gv, 6) + shares["c"].share(gv, 6) == 6
    assert shares["c"].share(gv, 6) == 4  # 8 of the 12 gvisor slots
    reg.nodes.set_node_state("a", "draining")
    fresh = {n: NodeShare(reg, n) for n in "abc"}  # (a share re-reads the nodes once a second)
    assert fresh["a"].share(pool, 5) == 0 and fresh["b"].share(pool, 5) == 5
    reg.nodes.mark_node_down("b", "test")
    assert NodeShare(reg, "b").share(pool, 5) == 0 and NodeShare(reg, "c").share(gv, 6) == 6


def test_every_node_autoscales_the_shared_target_and_counts_each_miss_once(tmp_path, monkeypatch) -> None:
    """No node is special: whichever looks first after misses raises the cluster-wide target by
    them, once; a node that read the pool's row before another node (or an operator's resize)
    changed it leaves the newer target alone instead of writing its own over it."""
    from warmbox.engine import pool as pools_mod
    from warmbox.engine.engine import Engine

    h = tmp_path / "h"
    h.mkdir()
    (h / "warmbox.toml").write_text("[pools.x]\ntemplate = 'base'\nmin = 0\nmax = 9\ntarget = 0\n")
    engine = Engine(h)
    monkeypatch.setattr(engine, "ensure_daemon", lambda: None)  # no daemon: the looks are done below
    reg = engine.registry
    try:
        settings = engine.settings()
        pc = settings.pools["x"]
        pools_mod.configured_row(reg, pc, None)
        a = pools_mod.PoolManager(engine, split=NodeShare(reg, "a"))
        b = pools_mod.PoolManager(engine, split=NodeShare(reg, "b"))
        for _ in range(3):
            reg.pools.pool_event("x", "miss")
        stale = reg.pools.pool_rows()["x"]
        assert b._autoscale(pc, stale) == 3  # b (not the first name) raises it
        assert a._autoscale(pc, stale) == 3  # a read the row before: the misses are not counted again
        reg.pools.pool_event("x", "miss")
        assert a._autoscale(pc, stale) == 3 and reg.pools.pool_rows()["x"].target == 3
        assert a._autoscale(pc, reg.pools.pool_rows()["x"]) == 4  # the new miss, once
        assert b._autoscale(pc, reg.pools.pool_rows()["x"]) == 4
        before = reg.pools.pool_rows()["x"]
        pools_mod.resize(engine, settings, "x", 7, min=0)  # an operator's word between a read and a write
        reg.pools.pool_event("x", "miss")
        assert b._autoscale(pc, before) == 7 and reg.pools.pool_rows()["x"].target == 7
    finally:
        reg.close()
