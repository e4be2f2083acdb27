"""One tenant's key cannot make the router's monitor take a whole node down (issue 20).

The monitor marks a node down when its heartbeat is older than HEARTBEAT_TIMEOUT_S (10 s): every
live sandbox on it, whoever's, becomes lost and the node is fenced. The heartbeat used to run on
the node's event loop, next to its API: measured, 24 concurrent exports of one sandbox whose
command records were at the export cap (32 MiB of text; ~0.4 s each on the loop) aged the
heartbeat to 12.8 s. It now beats from a thread of its own: a busy loop is a slow node, not a
dead one.

Against a real `warmbox node join` on a real Ray head and PostgreSQL registry; the tenant's requests
reach the node as the router forwards them (the cluster token, its tenant header, mutual TLS).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest

from tests.attacks.cluster_node import OneNode, one_node
from warmbox import transcript
from warmbox.cluster.monitor import HEARTBEAT_TIMEOUT_S
from warmbox.cluster.node import HEARTBEAT_S
from warmbox.models import CommandRecord

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]
EXPORTS = 32  # concurrent: ~13 s of the node's loop (24 aged a loop-driven heartbeat to 12.8 s)
CELL = 4096


@pytest.fixture
def node(pg_fresh_dsn: str, runc_ready: None) -> Iterator[OneNode]:
    """A real node n1 (own home, Ray head, the test's database, mutual TLS)."""
    with one_node(pg_fresh_dsn) as n:
        yield n


def _call(node: OneNode, method: str, path: str, body: dict | None = None) -> bytes:
    """One of tenant mallory's requests as the router forwards it to the node."""
    status, out = node.call(method, path, body)
    assert status == 200, (status, out[:500])
    return out


def test_a_tenants_burst_of_heavy_requests_does_not_stop_the_nodes_heartbeat(node):
    registry = node.registry
    sid = json.loads(_call(node, "POST", "/v1/sandboxes", {"tier": "container", "timeout": 300}))["info"]["sandbox_id"]
    # the sandbox's records at the export cap (what ~40 s of 4 KiB run_code cells write)
    now = time.time()
    row = CommandRecord(
        sid, 0, "code", "#" + "x" * (CELL - 1), True, "python", now, 0.3, None, "", False, False, False, 0, 0
    )
    for _ in range(0, transcript.MAX_COMMAND_TEXT // CELL + 500, 2000):
        registry.commands.add_commands([row] * 2000)
    ages: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            (n1,) = [n for n in registry.nodes.nodes() if n.name == "n1"]
            ages.append(time.time() - n1.heartbeat_at)
            time.sleep(0.2)

    def export() -> None:
        assert len(_call(node, "GET", f"/v1/sandboxes/{sid}/export")) > transcript.MAX_COMMAND_TEXT // 2

    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.monotonic()
    flood = [threading.Thread(target=export) for _ in range(EXPORTS)]
    for t in flood:
        t.start()
    for t in flood:
        t.join()
    took = time.monotonic() - t0
    time.sleep(2 * HEARTBEAT_S)
    done.set()
    watcher.join()
    print(f"{EXPORTS} exports took {took:.1f} s; the heartbeat's worst age {max(ages):.1f} s")
    assert took > HEARTBEAT_TIMEOUT_S / 2  # the node really was busy for a while
    assert max(ages) < HEARTBEAT_TIMEOUT_S / 2, max(ages)
    (n1,) = [n for n in registry.nodes.nodes() if n.name == "n1"]
    assert n1.state == "up"
