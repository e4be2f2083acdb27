"""An engine that is one cluster node: the rows it writes are its node's, another node's live rows
are never judged or touched here, and a lost sandbox answers SandboxLost until it is killed."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from warmbox.engine import duties, meters, teardown
from warmbox.engine.engine import Engine
from warmbox.errors import SandboxLost, SandboxStateError
from warmbox.models import Limits, State
from warmbox.storage.registry import Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger


def _engine(tmp: Path, node: str) -> Engine:
    home = tmp / f"home-{node}"
    home.mkdir()
    (home / "warmbox.toml").write_text(f'[cluster]\nnode = "{node}"\n')
    engine = Engine(home)
    # these rows never run: a ledger of their own, so they hold no real uid range of this host
    engine.registry.close()
    engine.registry = Registry(
        tmp / "shared.db", engine.node, ledger=UidLedger(tmp / f"uids-{node}", slots=8, first=MAX_SLOTS - 40)
    )
    return engine


def test_an_engine_writes_its_node_and_refuses_another_nodes_live_sandbox(tmp_path):
    n1, n2 = _engine(tmp_path, "n1"), _engine(tmp_path, "n2")
    assert (n1.node, n2.node) == ("n1", "n2") and Engine(tmp_path / "solo").node == ""
    sid = "sb-00000000e001"
    n2.registry.sandboxes.allocate(sid, "container", "base", 300.0, Limits(), "/nonexistent", "/nonexistent")
    n2.registry.sandboxes.set_state(sid, State.READY, "up")
    assert n1.registry.nodes.node_of(sid) == "n2" and n1.info(sid)[1].node == "n2"
    # n1 may read it (get_info, list) but never connect, measure or destroy it: its processes are n2's
    with pytest.raises(SandboxStateError, match="runs on node 'n2', not on this one \\('n1'\\)"):
        asyncio.run(duties.open(n1, sid))
    with pytest.raises(SandboxStateError, match="runs on node 'n2'"):
        asyncio.run(teardown.destroy(n1, sid))
    with pytest.raises(SandboxStateError, match="runs on node 'n2'"):
        asyncio.run(meters.metrics(n1, sid))
    assert n1.info(sid)[0].state is State.READY
    assert asyncio.run(duties.reap(n1)) == [] and n1.holding() == []  # its reaper does not see n2's rows
    # n2 dies: the sandbox is lost, for every operation but kill, from any node
    assert n1.registry.nodes.mark_node_down("n2", "raylet gone") == [sid]
    for engine in (n1, n2):
        with pytest.raises(SandboxLost, match="lost with node 'n2' \\(node n2 down: raylet gone\\)"):
            asyncio.run(duties.open(engine, sid))
        with pytest.raises(SandboxLost):
            engine.set_timeout(sid, 60.0)
    assert asyncio.run(teardown.destroy(n1, sid, "killed")) is True  # records only: its runtime died with n2
    assert n1.info(sid)[0].state is State.DESTROYED
    assert [t.to_state for t in n1.registry.sandboxes.transitions(sid)][-2:] == ["lost", "destroyed"]
    assert asyncio.run(teardown.destroy(n1, sid)) is False


def test_reconcile_ends_only_what_the_registry_no_longer_gives_this_node(tmp_path):
    n1, n2 = _engine(tmp_path, "n1"), _engine(tmp_path, "n2")
    mine = n1.runtime / "sandboxes"
    mine.mkdir(parents=True)
    theirs = tmp_path / "n2-runtime"  # n2's state directories, visible here: n2 runs on this same host
    rows = {
        "sb-00000000f001": ("n1", State.RUNNING, ""),  # its own, live: kept
        "sb-00000000f002": ("n1", State.LOST, ""),  # lost when n1 was marked down: ended
        "sb-00000000f003": ("n2", State.RUNNING, "here"),  # n2 runs it on this host now: kept
        "sb-00000000f004": ("n2", State.RUNNING, "elsewhere"),  # n2 runs it on another host: ended
        "sb-00000000f005": ("n1", State.DESTROYED, ""),  # killed from another node meanwhile: ended
        "sb-00000000f006": ("n1", State.PAUSED, "9:9"),  # its pauser is still releasing it: kept
    }
    for sid, (node, state, extra) in rows.items():
        reg = n1.registry if node == "n1" else n2.registry
        state_dir = theirs / sid if extra == "here" else mine / sid
        reg.sandboxes.allocate(sid, "container", "base", 300.0, Limits(), str(state_dir), "/nonexistent")
        reg.sandboxes.set_state(sid, State.READY, "up")
        if state is State.LOST:
            reg.sandboxes.set_state(sid, State.LOST, "node n1 down: test")
        elif state is not State.RUNNING:
            reg.sandboxes.set_state(sid, state, "test", owner=extra or None)
        (mine / sid / "run").mkdir(parents=True)  # what this node's runtime holds of each
        if extra == "here":
            (theirs / sid).mkdir(parents=True)
    (mine / "not-a-sandbox").mkdir()
    ended = asyncio.run(teardown.reconcile_node(n1))
    assert sorted(ended) == ["sb-00000000f002", "sb-00000000f004", "sb-00000000f005"]
    assert sorted(os.listdir(mine)) == ["not-a-sandbox", "sb-00000000f001", "sb-00000000f003", "sb-00000000f006"]
    for sid, (_, state, _) in rows.items():
        assert n1.info(sid)[0].state is (State.READY if state is State.RUNNING else state)  # rows untouched


def test_a_paused_sandbox_of_another_node_is_forgotten_here_and_its_leftovers_go_with_its_node(tmp_path):
    n1, n2 = _engine(tmp_path, "n1"), _engine(tmp_path, "n2")
    sid = "sb-00000000e002"
    left = n2.runtime / "sandboxes" / sid
    n2.registry.sandboxes.allocate(
        sid, "container", "base", 300.0, Limits(), str(left), str(left / "run" / "agent.sock")
    )
    n2.registry.sandboxes.set_state(sid, State.READY, "up")
    n2.registry.sandboxes.set_state(sid, State.PAUSED, "paused", owner="")
    (left / "run").mkdir(parents=True)  # what a pause cut short left on n2
    assert asyncio.run(teardown.destroy(n1, sid, "retention")) is True  # n1's duties delete it (n2 is down, say)
    assert n1.info(sid)[0].state is State.DESTROYED
    assert left.exists()  # n1 never touches n2's runtime
    assert asyncio.run(teardown.reconcile_node(n2)) == [sid] and not left.exists()
