"""`warmbox node drain NAME` moves every sandbox off a node (pause, resume elsewhere) with nothing
lost, and the node leaves the cluster (state down); the other nodes' sandboxes are not touched."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import on_node, sdk
from tests.cluster.harness import Cluster
from tests.conftest import cli, wait_for
from warmbox import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]


def test_drain_moves_every_sandbox_off_the_node_with_nothing_lost(cluster: Cluster):
    boxes = [Sandbox.create(timeout=600, **sdk(cluster)) for _ in range(4)]
    try:
        where = {b.sandbox_id: cluster.node_of(b.sandbox_id) for b in boxes}
        node = max(set(where.values()), key=list(where.values()).count)  # the node with the most
        moving = [b for b in boxes if where[b.sandbox_id] == node]
        staying = [b for b in boxes if where[b.sandbox_id] != node]
        for b in boxes:
            b.files.write("/workspace/mine.txt", b.sandbox_id)
            b.run_code(f"me = {b.sandbox_id!r}")

        env = {"WARMBOX_API_URL": cluster.client_env["WARMBOX_API_URL"], "WARMBOX_API_KEY": cluster.admin_key}
        r = cli("node", "drain", node, env=env, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        cluster.wait_state(node, "down")
        wait_for(lambda: not cluster.nodes[node].alive, 30, f"the drained node {node} to leave")

        for b in moving:
            now = cluster.node_of(b.sandbox_id)
            assert now != node and now in cluster.nodes, f"{b.sandbox_id} still on {now}"
            assert not on_node(cluster, node, b.sandbox_id), f"{b.sandbox_id}'s state dir left on {node}"
        for b in staying:
            assert cluster.node_of(b.sandbox_id) == where[b.sandbox_id], "a sandbox of another node moved"
        for b in boxes:
            with Sandbox.connect(b.sandbox_id, **sdk(cluster)) as again:
                assert again.files.read("/workspace/mine.txt") == b.sandbox_id
                assert again.run_code("me").text == repr(b.sandbox_id)
                assert again.commands.run("echo ok").stdout == "ok\n"
        # a create after the drain never lands on the drained node
        with Sandbox.create(timeout=60, **sdk(cluster)) as extra:
            assert cluster.node_of(extra.sandbox_id) != node
            extra.kill()
    finally:
        for b in boxes:
            b.kill()
