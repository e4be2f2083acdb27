"""An engine that is one cluster node: the rows it writes are its node's, another node's live rows
are never judged or touched here, and a lost sandbox answers SandboxLost until it is killed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

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
    n2.registry.allocate(sid, "container", "base", 300.0, Limits(), "/nonexistent", "/nonexistent")
    n2.registry.set_state(sid, State.READY, "up")
    assert n1.registry.node_of(sid) == "n2" and n1.info(sid)[1].node == "n2"
    # n1 may read it (get_info, list) but never connect, measure or destroy it: its processes are n2's
    with pytest.raises(SandboxStateError, match="runs on node 'n2', not on this one \\('n1'\\)"):
        asyncio.run(n1.open(sid))
    with pytest.raises(SandboxStateError, match="runs on node 'n2'"):
        asyncio.run(n1.destroy(sid))
    with pytest.raises(SandboxStateError, match="runs on node 'n2'"):
        asyncio.run(n1.metrics(sid))
    assert n1.info(sid)[0].state is State.READY
    assert asyncio.run(n1.reap()) == [] and n1.holding() == []  # its reaper does not see n2's rows
    # n2 dies: the sandbox is lost, for every operation but kill, from any node
    assert n1.registry.mark_node_down("n2", "raylet gone") == [sid]
    for engine in (n1, n2):
        with pytest.raises(SandboxLost, match="lost with node 'n2' \\(node n2 down: raylet gone\\)"):
            asyncio.run(engine.open(sid))
        with pytest.raises(SandboxLost):
            engine.set_timeout(sid, 60.0)
    assert asyncio.run(n1.destroy(sid, "killed")) is True  # records only: its runtime died with n2
    assert n1.info(sid)[0].state is State.DESTROYED
    assert [t.to_state for t in n1.registry.transitions(sid)][-2:] == ["lost", "destroyed"]
    assert asyncio.run(n1.destroy(sid)) is False
