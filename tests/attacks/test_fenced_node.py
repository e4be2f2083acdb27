"""A node marked down while its process still serves keeps taking creates (issue 20).

The router's monitor marks a node down when Ray loses it or its heartbeat is late; the node's own
process may still run (a stalled event loop, a partition from Ray but not from PostgreSQL, a drain)
and serve the requests already on their way until its next heartbeat. Before the fix a create it
served then left a live row on a down node: mark_node_down had already run and never runs again
for a down node, so the sandbox was neither lost nor reachable (the router answered "runs on node
n1"), its tenant's quota stayed consumed, a host uid slot stayed held. Now every start checks the
node's row in its own transaction: NodeFenced (503), nothing written, no slot taken.

Against a real `warmbox serve` whose engine is node "n1" of a real PostgreSQL registry.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.attacks.conftest import create_over_api, end_node_server, kill_over_api
from tests.conftest import start_server
from warmbox.models import NodeInfo
from warmbox.storage.registry import Registry
from warmbox.storage.uidslots import UidLedger

pytestmark = pytest.mark.sandbox


def _slots_of(key: str) -> list[int]:
    ledger = UidLedger()
    out = []
    for entry in sorted(ledger.dir.glob("[0-9]*")):
        try:
            holder = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        if holder.get("registry") == key:
            out.append(int(entry.name))
    return out


def test_a_node_marked_down_starts_nothing(pg_fresh_dsn, runc_ready):
    home = Path(tempfile.mkdtemp(prefix="wbfn-", dir="/tmp"))
    (home / "warmbox.toml").write_text("[daemon]\nidle_exit = 3\n\n[pools]\n")
    router = Registry(pg_fresh_dsn)  # the router's view of the shared registry
    router.nodes.join_node(NodeInfo("n1", address="http://127.0.0.1:1", slots=4, tiers=("container",)))
    _, key = router.tenants.create_key("acme")
    # the tenant's key straight to the node (direct access on): the fence must refuse, not the
    # node-only rule (tests/attacks/test_node_access.py)
    env = {
        "WARMBOX_CLUSTER__REGISTRY": pg_fresh_dsn,
        "WARMBOX_CLUSTER__NODE": "n1",
        "WARMBOX_CLUSTER__DIRECT_ACCESS": "true",
    }
    srv = start_server(home, home / "api.sock", env=env)
    node_key = Registry(pg_fresh_dsn, "n1").key
    try:
        # control: while the node is up, a create is served (so the refusal below is the fence)
        status, opened = create_over_api(srv.url, key)
        assert status in (200, 201), opened
        sid = opened["info"]["sandbox_id"]
        assert router.nodes.node_of(sid) == "n1"
        kill_over_api(srv.url, key, sid)

        router.nodes.mark_node_down("n1", "redteam: its heartbeat was late")
        before = {i.sandbox_id for i, _ in router.sandboxes.list(include_dead=True)}
        for _ in range(3):
            status, err = create_over_api(srv.url, key)
            assert (status, err["error"]["code"]) == (503, "node_fenced"), err
        assert {i.sandbox_id for i, _ in router.sandboxes.list(include_dead=True)} == before  # no row written
        assert _slots_of(node_key) == []  # no host uid slot taken
        assert router.sandboxes.list(tenant="acme") == []  # nothing live counts against its quota
    finally:
        end_node_server(srv, router, key, home)
