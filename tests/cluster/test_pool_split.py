"""A pool declared on the nodes splits over them: the up nodes keep the cluster-wide target between
them (placement.split_target: by slots), and the router, which has no ``[pools]`` of its own,
learns the pool from the registry and sends a create of the pool's shape to a node holding a ready
sandbox of it. Target 2 over the lane's 3 equal nodes: two nodes hold one each, the third none (a
router that did not know the pool would send the create there, to the most free slots: a miss)."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.cluster.conftest import sdk
from tests.conftest import POOLED_LIMITS_MB, wait_for
from warmbox import Limits, Sandbox
from warmbox import operations as ops
from warmbox.cluster.placement import NodeLoad, split_target

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]

POOL = "iso"  # tests/conftest.py BASE_CONFIG: target 1 (min 1, max 1), the nodes' and the session home's
SETTLE_S = 90.0  # refills on a loaded 2-core host; a settled pool is reached in a few seconds
REPEAT = int(os.environ.get("WARMBOX_TEST_SPLIT_REPEAT", "1"))  # the test run N times over (its flake check)


def _resize(cluster, target: int) -> None:
    from warmbox.sdk.http import HttpTransport

    async def go() -> None:
        t = HttpTransport(cluster.client_env["WARMBOX_API_URL"], api_key=cluster.admin_key)
        try:
            await t.handle(ops.PoolsResize(POOL, target=target, min=target, max=target))
        finally:
            await t.close()

    asyncio.run(go())


def _shares(cluster, target: int) -> dict[str, int]:
    up = [n for n in cluster.registry().nodes.nodes() if n.state == "up"]
    loads = [NodeLoad(n.name, tuple(n.tiers), n.slots, 0, n.memory_mb, 0) for n in up]
    return split_target(target, loads, tier="container", key=POOL)


def _ready(cluster) -> tuple[dict[str, int], int]:
    """Ready sandboxes of the pool per node, and how many of the pool are being created anywhere."""
    usage = {u.node: u for u in cluster.registry().nodes.node_usage()}
    ready = {n: sum(c for p, c in usage[n].pooled if p == POOL) if n in usage else 0 for n in cluster.nodes}
    warming = sum(
        1 for info, _h in cluster.registry().sandboxes.list() if info.state.value == "creating" and not info.tenant
    )
    return ready, warming


def _settled(cluster, target: int) -> bool:
    want = _shares(cluster, target)
    ready, warming = _ready(cluster)
    return warming == 0 and all(ready[n] == want.get(n, 0) for n in ready)


@pytest.mark.parametrize("run", range(REPEAT))
def test_a_pool_splits_over_the_nodes_and_the_router_learns_it(cluster, run):
    _resize(cluster, 2)
    try:
        wait_for(lambda: _settled(cluster, 2), SETTLE_S, f"the pool split as {_shares(cluster, 2)}: {_ready(cluster)}")
        holders = {n for n, k in _shares(cluster, 2).items() if k}
        assert len(holders) == 2
        sb = Sandbox.create(limits=Limits(memory_mb=POOLED_LIMITS_MB), timeout=120, **sdk(cluster))
        try:
            assert sb.from_pool, f"a miss: placed on {cluster.node_of(sb.sandbox_id)}, ready was {_ready(cluster)}"
            assert cluster.node_of(sb.sandbox_id) in holders
            assert sb.commands.run("echo ok").stdout.strip() == "ok"
        finally:
            sb.kill()
        # the node that gave one refills its share (every node keeps its own part)
        wait_for(lambda: _settled(cluster, 2), SETTLE_S, f"the pool refilled: {_ready(cluster)}")
    finally:
        _resize(cluster, 1)
        wait_for(lambda: _settled(cluster, 1), SETTLE_S, f"the pool back to 1: {_ready(cluster)}")
