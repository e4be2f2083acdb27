"""A node's share of cluster-wide pool targets (cluster/node.py NodeShare) over a real registry:
the up nodes that run the pool's tier split the target by slots; one up node autoscales."""

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
    assert [shares[n].scales() for n in "abc"] == [True, False, False]
    reg.nodes.set_node_state("a", "draining")
    fresh = {n: NodeShare(reg, n) for n in "abc"}  # (a share re-reads the nodes once a second)
    assert fresh["a"].share(pool, 5) == 0 and fresh["b"].share(pool, 5) == 5
    assert [fresh[n].scales() for n in "abc"] == [False, True, False]
    reg.nodes.mark_node_down("b", "test")
    assert NodeShare(reg, "b").share(pool, 5) == 0 and NodeShare(reg, "c").scales()
