"""A cluster node's reconcile against a real container: what the registry no longer gives the node
(its sandbox lost when the node was marked down) is ended on the host, and its row stays lost."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.engine.test_lifecycle import traces
from warmbox import Sandbox
from warmbox.errors import SandboxLost
from warmbox.models import NodeInfo, State

pytestmark = pytest.mark.sandbox

GONE = {"cgroups": [], "runc_state": False, "state_dir": False, "procs": [], "mounts": []}


def test_a_fenced_node_ends_its_lost_container_and_leaves_the_row_lost(node_homes):
    engine = node_homes.add("n1")
    epoch = engine.registry.join_node(NodeInfo("n1", slots=4, tiers=("container",)))
    sb = Sandbox.create(tier="container", timeout=120, pool=False, home=engine.home)
    sid = sb.sandbox_id
    _, handle = engine.info(sid)
    assert handle.node == "n1" and engine.registry.node_of(sid) == "n1"
    uid = handle.uid_base + 1000
    sb.commands.run("sleep 1000 > /dev/null 2>&1 &")  # a background process must go too
    assert asyncio.run(engine.node_heartbeat(epoch))
    assert engine.registry.nodes()[0].live == 1
    # the node is declared dead (its process SIGKILLed, say): its container still runs on the host
    assert engine.registry.mark_node_down("n1", "test: node killed") == [sid]
    live = traces(engine, sid, uid)
    assert live["runc_state"] and live["state_dir"] and live["procs"] and live["cgroups"]
    # its next heartbeat is refused: it ends what is no longer its own, at once
    t0 = time.perf_counter()
    assert not asyncio.run(engine.node_heartbeat(epoch))
    took = time.perf_counter() - t0
    assert traces(engine, sid, uid) == GONE, f"reconcile left {traces(engine, sid, uid)}"
    assert engine.info(sid)[0].state is State.LOST  # the row is untouched
    assert [t.to_state for t in engine.registry.transitions(sid)][-1] == "lost"
    with pytest.raises(SandboxLost, match="lost with node 'n1' \\(node n1 down: test: node killed\\)"):
        sb.commands.run("echo still here?")  # the session it held went with the container
    with pytest.raises(SandboxLost):
        Sandbox.connect(sid, home=engine.home)
    # a rejoin under a new epoch reconciles again: nothing is left to end
    epoch = engine.registry.join_node(NodeInfo("n1"))
    assert asyncio.run(engine.reconcile_node()) == []
    assert asyncio.run(engine.node_heartbeat(epoch))
    sb.kill()  # kill is the one way out of lost: records only
    assert engine.info(sid)[0].state is State.DESTROYED
    print(f"fenced heartbeat + reconcile of one container: {took * 1000:.0f} ms")
