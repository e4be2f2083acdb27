"""Creates through the router spread over the cluster's nodes, and each sandbox runs where the
registry says it does."""

from __future__ import annotations

import collections
import concurrent.futures

import pytest

from tests.cluster.conftest import on_node, sdk
from warmbox import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]


def test_creates_spread_over_the_three_nodes_and_run_where_the_registry_says(cluster):
    # 6 at once, 3 at a time (the router books each placement before the next: no burst lands on one node)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        boxes = list(pool.map(lambda _i: Sandbox.create(timeout=300, **sdk(cluster)), range(6)))
    try:
        where = {b.sandbox_id: cluster.node_of(b.sandbox_id) for b in boxes}
        per_node = collections.Counter(where.values())
        assert set(per_node) == set(cluster.nodes), f"not spread over every node: {dict(per_node)}"
        assert max(per_node.values()) - min(per_node.values()) <= 1, f"uneven: {dict(per_node)}"
        for b in boxes:
            node = where[b.sandbox_id]
            assert on_node(cluster, node, b.sandbox_id), f"{b.sandbox_id} is not on {node}'s disk"
            others = [n for n in cluster.nodes if n != node]
            assert not any(on_node(cluster, n, b.sandbox_id) for n in others)
            r = b.commands.run(f"echo {b.sandbox_id} > /workspace/me && cat /workspace/me")
            assert r.stdout.strip() == b.sandbox_id
    finally:
        for b in boxes:
            b.kill()
