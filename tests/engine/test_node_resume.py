"""A sandbox paused on one node resumes on another: two homes on this host as nodes "a" and "b",
sharing one registry (b's registry file is a's) and one object store, each with its own runtime."""

from __future__ import annotations

import asyncio

import pytest

from warmbox import Sandbox
from warmbox.engine import teardown
from warmbox.models import State

pytestmark = pytest.mark.sandbox


def test_a_sandbox_paused_on_node_a_resumes_on_node_b_with_its_files(node_homes, tmp_path, monkeypatch):
    monkeypatch.setenv("WARMBOX_OBJECT_STORE", str(tmp_path / "store"))  # shared, set before any daemon starts
    a = node_homes.add("a")
    b = node_homes.add("b", share=a)
    assert (a.node, b.node) == ("a", "b") and a.registry.key == b.registry.key
    sb = Sandbox.create(tier="container", timeout=120, pool=False, home=a.home)
    sid = sb.sandbox_id
    sb.files.write("/home/user/notes.txt", "written on node a\n")
    sb.commands.run("mkdir -p /workspace/proj && echo 42 > /workspace/proj/answer")
    assert a.registry.nodes.node_of(sid) == "a"
    sb.pause()
    assert b.info(sid)[0].state is State.PAUSED
    assert not (a.runtime / "sandboxes" / sid).exists()  # a paused sandbox holds nothing on its node
    # node a goes down: the paused sandbox stays paused, resumable anywhere
    assert sid not in b.registry.nodes.mark_node_down("a", "test: node a gone")
    assert b.info(sid)[0].state is State.PAUSED
    sb2 = Sandbox.resume(sid, home=b.home)
    try:
        assert sb2.sandbox_id == sid
        info, handle = b.info(sid)
        assert (
            info.state in (State.READY, State.RUNNING) and handle.node == "b" and b.registry.nodes.node_of(sid) == "b"
        )
        assert handle.state_dir == str(b.runtime / "sandboxes" / sid)
        assert sb2.files.read("/home/user/notes.txt") == "written on node a\n"
        assert sb2.commands.run("cat /workspace/proj/answer").stdout == "42\n"
        assert [t.to_state for t in b.registry.sandboxes.transitions(sid)][-3:] == ["paused", "creating", "ready"]
        # node a comes back: its reconcile ends what it lost (its pool's sandbox), never the
        # sandbox b now runs (on this same host, cgroups and netns are named by sandbox id)
        ended = asyncio.run(teardown.reconcile_node(a))
        assert sid not in ended and all(a.info(i)[0].state is State.LOST for i in ended)
        assert sb2.commands.run("echo alive").stdout == "alive\n"
        with pytest.raises(Exception, match="runs on node 'b'"):
            asyncio.run(teardown.destroy(a, sid))  # a is not where it runs
    finally:
        sb2.kill()
    assert b.info(sid)[0].state is State.DESTROYED
