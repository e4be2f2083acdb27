"""A cluster node's reconcile against real sandboxes (runc, runsc): what the registry no longer
gives the node (its sandbox lost when the node was marked down) is ended on the host, and its row
stays lost."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from warmbox import Sandbox
from warmbox.backends.base import Inventory
from warmbox.engine import teardown
from warmbox.engine.engine import Engine
from warmbox.errors import SandboxLost
from warmbox.models import NodeInfo, State

pytestmark = pytest.mark.sandbox

GONE = {"cgroups": [], "runtime_state": False, "state_dir": False, "mounts": []}


def traces(engine: Engine, tier: str, sandbox_id: str) -> dict[str, object]:
    """What of one sandbox is on the host: its cgroups (its processes are in them), the runtime's
    record of it, its state directory, its mounts."""
    backend = engine.backend(tier)
    return {
        "cgroups": [str(d) for d in backend.cgroup_dirs(sandbox_id) if d.exists()],  # type: ignore[attr-defined]
        "runtime_state": isinstance(backend, Inventory) and sandbox_id in backend.held(),
        "state_dir": (engine.runtime / "sandboxes" / sandbox_id).exists(),
        "mounts": [ln for ln in Path("/proc/mounts").read_text().splitlines() if sandbox_id in ln],
    }


@pytest.mark.parametrize("tier", ["container", "gvisor"])
def test_a_fenced_node_ends_its_lost_sandbox_and_leaves_the_row_lost(node_homes, tier):
    engine = node_homes.add("n1")
    avail = engine.backend(tier).probe()
    if not avail.available:
        pytest.fail(f"the {tier} tier must run here (scripts/bootstrap installs it): {avail.reason}")
    epoch = engine.registry.nodes.join_node(NodeInfo("n1", slots=4, tiers=(tier,)))
    sb = Sandbox.create(tier=tier, timeout=120, pool=False, home=engine.home)
    sid = sb.sandbox_id
    _, handle = engine.info(sid)
    assert handle.node == "n1" and engine.registry.nodes.node_of(sid) == "n1"
    sb.commands.run("sleep 1000 > /dev/null 2>&1 &")  # a background process must go too
    assert asyncio.run(teardown.node_heartbeat(engine, epoch))
    assert engine.registry.nodes.nodes()[0].live == 1
    # the node is declared dead (its process SIGKILLed, say): its container still runs on the host
    assert engine.registry.nodes.mark_node_down("n1", "test: node killed") == [sid]
    live = traces(engine, tier, sid)
    assert live["runtime_state"] and live["state_dir"] and live["cgroups"] and live["mounts"], live
    # its next heartbeat is refused: it ends what is no longer its own, at once
    t0 = time.perf_counter()
    assert not asyncio.run(teardown.node_heartbeat(engine, epoch))
    took = time.perf_counter() - t0
    assert traces(engine, tier, sid) == GONE, f"reconcile left {traces(engine, tier, sid)}"
    assert engine.info(sid)[0].state is State.LOST  # the row is untouched
    assert [t.to_state for t in engine.registry.sandboxes.transitions(sid)][-1] == "lost"
    with pytest.raises(SandboxLost, match="lost with node 'n1' \\(node n1 down: test: node killed\\)"):
        sb.commands.run("echo still here?")  # the session it held went with the container
    with pytest.raises(SandboxLost):
        Sandbox.connect(sid, home=engine.home)
    # a rejoin under a new epoch reconciles again: nothing is left to end
    epoch = engine.registry.nodes.join_node(NodeInfo("n1"))
    assert asyncio.run(teardown.reconcile_node(engine)) == []
    assert asyncio.run(teardown.node_heartbeat(engine, epoch))
    sb.kill()  # kill is the one way out of lost: records only
    assert engine.info(sid)[0].state is State.DESTROYED
    print(f"fenced heartbeat + reconcile of one {tier} sandbox: {took * 1000:.0f} ms")
