"""The registry's nodes (schema 15): membership, fencing, lost sandboxes, and node-scoped queries."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from warmbox.errors import InvalidArgument, NodeFenced, SandboxLost, SandboxNotFound, SandboxStateError
from warmbox.lifecycle import Operation, check
from warmbox.models import Limits, NodeInfo, NodeUsage, State
from warmbox.paths import owner_alive, owner_tag
from warmbox.storage import registry as registry_mod
from warmbox.storage.registry import SCHEMA_VERSION, Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger


def _registry(tmp: Path, node: str = "", host: str = "h1", at: str | None = None) -> Registry:
    # one uid ledger per simulated host: these rows never run, so they hold no real range of this host
    return Registry(at or tmp / "r.db", node, ledger=UidLedger(tmp / f"uids-{host}", slots=16, first=MAX_SLOTS - 60))


def _sandbox(reg: Registry, sid: str, state: State, *, pool: str = "", owner: str = "") -> int:
    slot = reg.sandboxes.allocate(
        sid, "container", "base", 300.0, Limits(), "/nonexistent", "/nonexistent", pool=pool, owner=owner
    )
    if state is State.CREATING:
        return slot
    if state is State.POOLED:
        reg.sandboxes.set_state(sid, State.POOLED, "warm")
        return slot
    reg.sandboxes.set_state(sid, State.READY, "up")
    if state is not State.READY:
        reg.sandboxes.set_state(sid, state, "test", owner=owner or None)
    return slot


def _v14(tmp: Path) -> None:
    """A version 14 registry: no sandboxes.node, no nodes table, net_links' address unique host-wide."""
    schema = registry_mod.SCHEMA
    schema = schema.replace(
        "    tier_rejected TEXT NOT NULL DEFAULT '{}',\n    node        TEXT NOT NULL DEFAULT ''\n",
        "    tier_rejected TEXT NOT NULL DEFAULT '{}'\n",
    )
    schema = schema.replace("CREATE INDEX IF NOT EXISTS sandboxes_node ON sandboxes(node, state);\n", "")
    old_links = (
        "    address     TEXT NOT NULL,\n    ifname      TEXT NOT NULL,\n    policy      TEXT NOT NULL,\n"
        "    updated_at  REAL NOT NULL,\n    node        TEXT NOT NULL DEFAULT '',\n    UNIQUE (node, address)\n"
    )
    assert old_links in schema and "sandboxes_node" not in schema
    schema = schema.replace(
        old_links,
        "    address     TEXT NOT NULL UNIQUE,\n    ifname      TEXT NOT NULL,\n    policy      TEXT NOT NULL,\n"
        "    updated_at  REAL NOT NULL\n",
    )
    start = schema.index("CREATE TABLE IF NOT EXISTS nodes")
    schema = schema[:start] + schema[schema.index(");", start) + 2 :]
    db = sqlite3.connect(tmp / "r.db")
    db.executescript(schema)
    db.execute(
        "INSERT INTO sandboxes (sandbox_id, tier, template, state, created_at, expires_at, memory_mb, cpus, pids, "
        "uid_slot, runtime_id, state_dir, socket_path) VALUES "
        "('sb-00000000000a', 'container', 'base', 'running', 1, 9e9, 512, 1.0, 256, 3, 'x', '/nonexistent', '/x')"
    )
    db.execute("INSERT INTO net_links VALUES ('sb-00000000000a', '10.200.0.1', 'wb0', '{}', 1)")
    db.execute("PRAGMA user_version = 14")
    db.commit()
    db.close()


def test_a_version_14_registry_migrates_its_rows_to_the_single_host_node(tmp_path):
    _v14(tmp_path)
    reg = _registry(tmp_path)
    assert reg.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert reg.nodes.node_of("sb-00000000000a") == ""
    assert reg.sandboxes.get("sb-00000000000a")[1].node == ""
    assert reg.egress.link("sb-00000000000a") == ("10.200.0.1", "wb0", "{}")  # the link survived the rebuild
    assert reg.egress.link_by_address("10.200.0.1") == ("sb-00000000000a", "{}")
    assert reg.egress.live_links() == 1 and reg.nodes.nodes() == []
    assert "net_links_old" not in {r[0] for r in reg.db.conn.execute("SELECT name FROM sqlite_master")}
    reg.close()
    reg = _registry(tmp_path)  # opening it again is a no-op
    assert reg.egress.link("sb-00000000000a") is not None
    reg.close()


def test_join_heartbeat_and_fencing_by_epoch_and_by_down(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    e1 = reg.nodes.join_node(
        NodeInfo("n1", address="http://127.0.0.1:9001", slots=8, memory_mb=4096, tiers=("container",))
    )
    assert e1 == 1
    assert reg.nodes.heartbeat("n1", e1, live=2, pooled=1)
    (n,) = reg.nodes.nodes()
    assert (n.name, n.address, n.epoch, n.state, n.slots, n.memory_mb, n.tiers, n.live, n.pooled) == (
        "n1",
        "http://127.0.0.1:9001",
        1,
        "up",
        8,
        4096,
        ("container",),
        2,
        1,
    )
    assert n.heartbeat_at >= n.joined_at > 0
    e2 = reg.nodes.join_node(NodeInfo("n1", address="http://127.0.0.1:9002"))  # the node restarted
    assert e2 == 2
    assert not reg.nodes.heartbeat("n1", e1, live=0, pooled=0)  # its previous life is fenced
    assert reg.nodes.heartbeat("n1", e2, live=0, pooled=0)
    assert reg.nodes.nodes()[0].live == 0 and reg.nodes.nodes()[0].address == "http://127.0.0.1:9002"
    reg.nodes.set_node_state("n1", "draining")
    assert reg.nodes.nodes()[0].state == "draining" and reg.nodes.heartbeat(
        "n1", e2, live=0, pooled=0
    )  # draining: still up
    assert reg.nodes.mark_node_down("n1", "raylet gone") == []
    assert reg.nodes.nodes()[0].state == "down" and reg.nodes.nodes()[0].epoch == 3
    assert not reg.nodes.heartbeat("n1", e2, live=0, pooled=0)
    assert not reg.nodes.heartbeat("n1", 3, live=0, pooled=0)  # down: even the current epoch is fenced
    assert reg.nodes.join_node(NodeInfo("n1")) == 4 and reg.nodes.nodes()[0].state == "up"
    assert not reg.nodes.heartbeat("nobody", 1, live=0, pooled=0)
    with pytest.raises(InvalidArgument):
        reg.nodes.set_node_state("n1", "sleeping")
    with pytest.raises(InvalidArgument):
        reg.nodes.set_node_state("nobody", "draining")
    with pytest.raises(InvalidArgument):
        reg.nodes.join_node(NodeInfo("Bad Name"))
    reg.close()


def test_a_node_marked_down_loses_its_running_sandboxes_and_leaves_paused_ones_resumable_anywhere(
    tmp_path, registry_at
):
    a = _registry(tmp_path, "a", at=registry_at, host="h1")
    b = _registry(tmp_path, "b", at=registry_at, host="h2")
    a.nodes.join_node(NodeInfo("a"))
    b.nodes.join_node(NodeInfo("b"))
    ids = {s: f"sb-00000000a{i:03x}" for i, s in enumerate(State) if s is not State.DESTROYED}
    for state in (State.CREATING, State.POOLED, State.READY, State.RUNNING, State.PAUSED):
        _sandbox(a, ids[state], state, pool="p" if state is State.POOLED else "", owner="1:2")
    a.pools.retire("p", "1:2")  # the pooled one leaves: retiring
    _sandbox(a, "sb-00000000aaaa", State.POOLED, pool="p")
    _sandbox(b, "sb-00000000bbbb", State.RUNNING)
    lost = a.nodes.mark_node_down("a", "heartbeat stopped")
    assert sorted(lost) == sorted(
        [ids[State.CREATING], ids[State.POOLED], ids[State.READY], ids[State.RUNNING], "sb-00000000aaaa"]
    )
    for sid in lost:
        info, handle = b.sandboxes.get(sid)
        assert info.state is State.LOST and handle.node == "a"
        assert b.sandboxes.transitions(sid)[-1].reason == "node a down: heartbeat stopped"
        with pytest.raises(SandboxLost, match="lost with node 'a'") as e:
            check(Operation.EXEC, info.state, sid, b.sandboxes.ended_reason(sid), b.nodes.node_of(sid))
        assert (e.value.node, e.value.reason, e.value.sandbox_id) == ("a", "node a down: heartbeat stopped", sid)
        with pytest.raises(SandboxStateError, match="illegal transition lost -> ready"):
            b.sandboxes.set_state(sid, State.READY, "back?")
    # the other node's sandbox is untouched; the paused one stays paused, its pauser's tag cleared
    assert b.sandboxes.get("sb-00000000bbbb")[0].state is State.RUNNING
    paused = ids[State.PAUSED]
    assert b.sandboxes.get(paused)[0].state is State.PAUSED and b.sandboxes.owner_of(paused) == ""
    assert a.nodes.mark_node_down("a", "again") == []  # nothing left to lose
    # node b resumes it: the row becomes b's
    b.sandboxes.reallocate(paused, 60.0, Limits(), owner="3:4")
    assert b.nodes.node_of(paused) == "b" and b.sandboxes.get(paused)[1].node == "b"
    # kill is the one way out of lost
    b.sandboxes.set_state(ids[State.READY], State.DESTROYED, "killed")
    assert b.sandboxes.get(ids[State.READY])[0].state is State.DESTROYED
    # lost rows hold no slot in the node's queries
    assert {i.sandbox_id for i, _ in a.sandboxes.holding()} == set()
    a.close()
    b.close()


def test_node_scoped_queries_see_only_their_own_rows(tmp_path, registry_at):
    a = _registry(tmp_path, "a", at=registry_at, host="h1")
    b = _registry(tmp_path, "b", at=registry_at, host="h2")
    # two hosts: their uid slots are independent (each its own ledger; the used set is per node)
    sa = _sandbox(a, "sb-0000000000a1", State.RUNNING, owner="1:1")
    sb = _sandbox(b, "sb-0000000000b1", State.RUNNING, owner="1:1")
    assert sa == sb
    assert (a.nodes.node_of("sb-0000000000a1"), b.nodes.node_of("sb-0000000000b1")) == ("a", "b")
    _sandbox(a, "sb-0000000000a2", State.CREATING, owner="5:5")
    _sandbox(a, "sb-0000000000a3", State.PAUSED, owner="6:6")
    _sandbox(a, "sb-0000000000a4", State.POOLED, pool="p")
    assert {i.sandbox_id for i, _ in b.sandboxes.holding()} == {"sb-0000000000b1"}
    assert b.sandboxes.creating_with_owner() == [] and b.sandboxes.paused_with_owner() == []
    assert a.sandboxes.creating_with_owner() == [("sb-0000000000a2", "5:5")]
    assert a.sandboxes.paused_with_owner() == [("sb-0000000000a3", "6:6")]
    assert b.pools.pool_counts("p") == (0, 0) and a.pools.pool_counts("p") == (1, 0)
    assert b.pools.pooled("p") == [] and a.pools.pooled("p") == ["sb-0000000000a4"]
    assert (
        b.pools.claim("p", "", 60.0, "7:7") is None
    )  # another node's pooled sandbox runs there: never handed out here
    assert b.pools.retire("p", "7:7") == []
    assert {i.sandbox_id for i, _ in b.sandboxes.list(include_pooled=True, local=True)} == {"sb-0000000000b1"}
    assert len(b.sandboxes.list(include_pooled=True)) == 4  # the API's list is cluster-wide (paused: not live)
    # the same address on two nodes: two links (each node's proxy finds its own)
    a.egress.set_link("sb-0000000000a1", "10.200.0.9", "wb9", '{"a":1}')
    b.egress.set_link("sb-0000000000b1", "10.200.0.9", "wb9", '{"b":1}')
    assert a.egress.link_by_address("10.200.0.9") == ("sb-0000000000a1", '{"a":1}')
    assert b.egress.link_by_address("10.200.0.9") == ("sb-0000000000b1", '{"b":1}')
    assert a.egress.live_links() == b.egress.live_links() == 1
    a.nodes.mark_node_down("a", "gone")
    # a lost sandbox's link is no longer live (its address serves nobody), but its record stays for
    # its node's reconcile, which removes the link itself
    assert a.egress.live_links() == 0 and a.egress.link_by_address("10.200.0.9") is None
    assert a.egress.link("sb-0000000000a1") is not None and a.egress.link_node("sb-0000000000a1") == "a"
    assert b.egress.link_by_address("10.200.0.9") == ("sb-0000000000b1", '{"b":1}') and b.egress.live_links() == 1
    assert b.nodes.local_counts() == (1, 0) and a.nodes.local_counts() == (0, 0)
    assert b.nodes.node_usage() == [NodeUsage("b", live=1, memory_mb=512)]
    a.close()
    b.close()


def test_move_only_a_paused_sandbox_and_node_usage(tmp_path, registry_at):
    a = _registry(tmp_path, "a", at=registry_at)
    _sandbox(a, "sb-0000000000c1", State.RUNNING)
    _sandbox(a, "sb-0000000000c2", State.PAUSED)
    _sandbox(a, "sb-0000000000c3", State.POOLED, pool="p")
    _sandbox(a, "sb-0000000000c4", State.POOLED, pool="q")
    with pytest.raises(SandboxStateError, match="not paused"):
        a.sandboxes.move("sb-0000000000c1", "b")
    with pytest.raises(SandboxNotFound):
        a.sandboxes.move("sb-0000000000ff", "b")
    with pytest.raises(SandboxNotFound):
        a.nodes.node_of("sb-0000000000ff")
    with pytest.raises(InvalidArgument):
        a.sandboxes.move("sb-0000000000c2", "no/such")
    a.sandboxes.move("sb-0000000000c2", "b")
    assert a.nodes.node_of("sb-0000000000c2") == "b"
    assert a.sandboxes.paused_with_owner() == []  # b's now
    # pooled sandboxes hold their memory too: the router counts it (cluster/router.py node_load)
    usage = NodeUsage("a", live=1, memory_mb=512, pooled=(("p", 1), ("q", 1)), pooled_memory_mb=1024)
    assert a.nodes.node_usage() == [usage]
    a.close()


def test_paused_retention_of_a_down_node_falls_to_the_nodes_still_up(tmp_path, registry_at):
    a = _registry(tmp_path, "a", at=registry_at, host="h1")
    b = _registry(tmp_path, "b", at=registry_at, host="h2")
    _sandbox(a, "sb-0000000000d1", State.PAUSED)
    _sandbox(a, "sb-0000000000d2", State.RUNNING)
    far = 9e9
    assert b.sandboxes.lifecycle_due(far, 0.0) == ([], [])  # a is up: its paused sandboxes are its own duty
    assert a.sandboxes.lifecycle_due(far, 0.0)[1] == ["sb-0000000000d1"]
    a.nodes.mark_node_down("a", "gone")
    assert b.sandboxes.lifecycle_due(far, 0.0)[1] == ["sb-0000000000d1"]
    assert b.sandboxes.next_lifecycle_deadline(0.0) is not None
    a.close()
    b.close()


def test_a_fenced_node_starts_no_sandbox(tmp_path, registry_at):
    """A node marked down, or whose name joined again elsewhere, while its process still runs: its
    creates, claims and resumes are refused in the transaction that would write them."""
    a = _registry(tmp_path, "a", at=registry_at, host="h1")
    _sandbox(a, "sb-0000000000e1", State.PAUSED)
    _sandbox(a, "sb-0000000000e2", State.POOLED, pool="p")
    epoch = a.nodes.join_node(NodeInfo("a"))
    assert a.db.epoch == epoch
    _sandbox(a, "sb-0000000000e3", State.RUNNING)  # up: it starts sandboxes
    assert sorted(a.nodes.mark_node_down("a", "late heartbeat")) == ["sb-0000000000e2", "sb-0000000000e3"]
    held = a.ledger.held()
    with pytest.raises(NodeFenced, match="node 'a' was marked down") as e:
        _sandbox(a, "sb-0000000000e4", State.CREATING)
    assert e.value.node == "a"
    with pytest.raises(NodeFenced):
        a.sandboxes.reallocate("sb-0000000000e1", 60.0, Limits())
    with pytest.raises(NodeFenced):
        a.pools.claim("p", "", 60.0, "1:1")
    with pytest.raises(SandboxNotFound):
        a.sandboxes.get("sb-0000000000e4")  # nothing was written
    assert a.sandboxes.get("sb-0000000000e1")[0].state is State.PAUSED and a.ledger.held() == held  # no slot taken
    # the node's name joins again from another process: this one stays fenced, the new one starts
    again = _registry(tmp_path, "a", at=registry_at, host="h1")
    again.nodes.join_node(NodeInfo("a"))
    with pytest.raises(NodeFenced, match="joined again"):
        _sandbox(a, "sb-0000000000e4", State.CREATING)
    _sandbox(again, "sb-0000000000e4", State.CREATING)
    # a node that never joined (one host, tests) is not checked
    _sandbox(_registry(tmp_path, "z", at=registry_at, host="h2"), "sb-0000000000e5", State.CREATING)
    a.close()
    again.close()


def test_a_stale_verdict_marks_nothing_down(tmp_path, registry_at):
    reg = _registry(tmp_path, "", at=registry_at)
    _sandbox(_registry(tmp_path, "n1", at=registry_at), "sb-0000000000f1", State.RUNNING)
    first = reg.nodes.join_node(NodeInfo("n1"))
    second = reg.nodes.join_node(NodeInfo("n1"))  # it restarted after the monitor read `first`
    assert reg.nodes.mark_node_down("n1", "old news", epoch=first) == []
    assert reg.nodes.nodes()[0].state == "up" and reg.nodes.nodes()[0].epoch == second
    assert reg.nodes.mark_node_down("n1", "gone", epoch=second) == ["sb-0000000000f1"]
    assert reg.nodes.nodes()[0].epoch == second + 1
    assert reg.nodes.mark_node_down("n1", "gone too", epoch=second) == []  # a second monitor: one bump
    assert reg.nodes.mark_node_down("n1", "gone too", epoch=second + 1) == []  # already down
    assert reg.nodes.nodes()[0].epoch == second + 1
    assert reg.nodes.mark_node_down("nobody", "x", epoch=1) == [] and [n.name for n in reg.nodes.nodes()] == ["n1"]
    reg.close()


def test_a_process_tag_of_another_node_is_never_judged_by_this_hosts_proc(tmp_path, registry_at):
    me = owner_tag(os.getpid(), "n1")
    assert me.startswith("n1/") and owner_alive(me, "n1")
    dead = "n1/999999999:1"  # no such pid here
    assert not owner_alive(dead, "n1")  # its own node judges it: gone
    assert owner_alive(dead, "n2") and owner_alive(dead, "")  # elsewhere: cannot tell, so alive
    assert not owner_alive("999999999:1", "n1")  # a one-host tag is judged here
    # a network question a node's proxy waits on stays pending for the router (another host)
    router, node = _registry(tmp_path, "", at=registry_at), _registry(tmp_path, "n1", at=registry_at)
    a = node.approvals.open_approval("t", "network", "x.test:443", "egress", 60, waiter=dead)
    assert router.approvals.approval(a.approval_id).state == "pending"
    assert node.approvals.approval(a.approval_id).state == "timed_out"  # its own node sees the proxy gone
    router.close()
    node.close()
