"""A node's host dies (SIGKILL of the node's process group and everything it started, but not its
sandboxes' containers: they are what a rejoining node must clean up).

- its running sandboxes report SandboxLost (typed, naming the node; no call hangs);
- a sandbox paused on it resumes on another node, files and code-context state intact;
- the node rejoins under the same name and home and leaves no orphan: no runc container, no state
  dir, no cgroup, no process of a sandbox the cluster marked lost.

The tests of this module share one kill (module fixture ``killed``) and run in file order.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from tests.cluster.conftest import on_node, process_alive, runc_state, sdk, start_time
from tests.cluster.harness import DOWN_TIMEOUT_S, Cluster
from warmbox import Sandbox, SandboxLost, WarmboxError
from warmbox.models import State

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]

CALL_BOUND_S = DOWN_TIMEOUT_S  # no call on a dead node's sandbox takes longer than its detection


@dataclasses.dataclass
class Killed:
    node: str
    running: Sandbox  # was running on ``node``
    paused_id: str  # was paused on ``node`` (its snapshot in the shared S3 prefix)
    memory_id: str  # was paused with its memory on ``node`` (gVisor), "" if that tier does not run here
    memory_pid: int  # a process running in it when it was paused
    init_pid: int  # the running sandbox's container init on the node's host, and its start time
    init_start: str
    first_call: tuple[float, BaseException | None]  # the call made right after the kill: seconds, error


@pytest.fixture(scope="module")
def killed(cluster: Cluster, home):
    from warmbox.engine.engine import Engine

    made: list[Sandbox] = []
    node = "n1"
    try:
        memory: Sandbox | None = None
        with cluster.only(node):
            if Engine.for_home(home).backend("gvisor").probe().available:  # a tier with memory snapshots
                memory = Sandbox.create(tier="gvisor", timeout=600, **sdk(cluster))
                made.append(memory)
            running = Sandbox.create(timeout=600, **sdk(cluster))
            made.append(running)
            paused = Sandbox.create(timeout=600, **sdk(cluster))
            made.append(paused)
        assert {cluster.node_of(b.sandbox_id) for b in made} == {node}
        paused.files.write("/workspace/keep.txt", "kept across a host's death")
        paused.run_code("answer = 6 * 7")
        paused.pause()
        memory_pid = 0
        if memory is not None:
            memory_pid = memory.commands.run("sleep 100000", background=True).pid
            memory.files.write("/workspace/keep.txt", "memory too")
            memory.pause(memory=True)
        running.files.write("/workspace/lost.txt", "gone with the host")
        state = runc_state(cluster, node, running.sandbox_id)
        assert state is not None, f"{running.sandbox_id} has no runc container on {node}"
        pid = int(state["init_process_pid"])
        init_start = start_time(pid)

        cluster.kill_node(node, wait_down=False)
        t0 = time.monotonic()
        err: BaseException | None = None
        try:
            running.commands.run("true", timeout=CALL_BOUND_S)
        except WarmboxError as e:
            err = e
        first = (time.monotonic() - t0, err)
        cluster.wait_state(node, "down")
        yield Killed(
            node, running, paused.sandbox_id, memory.sandbox_id if memory else "", memory_pid, pid, init_start, first
        )
    finally:
        for b in made:
            try:
                b.kill()
            except WarmboxError:
                pass


def test_a_call_right_after_the_kill_fails_typed_and_bounded(killed: Killed):
    seconds, err = killed.first_call
    assert err is not None, "a command ran on a sandbox whose host was SIGKILLed"
    assert seconds < CALL_BOUND_S, f"the call took {seconds:.1f} s"
    assert isinstance(err, SandboxLost), f"{type(err).__name__}: {err}"


def test_its_running_sandboxes_report_lost_naming_the_node(cluster: Cluster, killed: Killed):
    sid = killed.running.sandbox_id
    for call in (
        lambda: killed.running.commands.run("true"),
        lambda: killed.running.files.read("/workspace/lost.txt"),
        lambda: Sandbox.connect(sid, **sdk(cluster)),
    ):
        t0 = time.monotonic()
        with pytest.raises(SandboxLost) as e:
            call()
        assert time.monotonic() - t0 < 10, "a lost sandbox's error must not wait"
        assert e.value.node == killed.node and e.value.sandbox_id == sid
    info = next(i for i, _h in cluster.registry().sandboxes.list(include_dead=True) if i.sandbox_id == sid)
    assert info.state == State.LOST


def test_a_sandbox_paused_there_resumes_on_another_node_intact(cluster: Cluster, killed: Killed):
    with Sandbox.resume(killed.paused_id, **sdk(cluster)) as back:
        assert back.sandbox_id == killed.paused_id  # one id for a sandbox's life
        node = cluster.node_of(back.sandbox_id)
        assert node != killed.node and cluster.nodes[node].alive
        assert on_node(cluster, node, back.sandbox_id)
        assert back.files.read("/workspace/keep.txt") == "kept across a host's death"
        assert back.run_code("answer").text == "42"
        assert back.commands.run("echo alive").stdout == "alive\n"
        back.kill()


def test_a_sandbox_paused_there_with_its_memory_resumes_elsewhere_with_its_processes(cluster: Cluster, killed: Killed):
    if not killed.memory_id:
        pytest.skip("the gvisor tier (memory snapshots) does not run on this host")
    with Sandbox.resume(killed.memory_id, **sdk(cluster)) as back:
        assert cluster.node_of(back.sandbox_id) != killed.node
        assert back.files.read("/workspace/keep.txt") == "memory too"
        # the same process, not a fresh start: it ran before the pause, on the dead node
        assert killed.memory_pid in {p.pid for p in back.commands.list()}
        r = back.commands.run("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done")
        assert "sleep 100000" in [ln.strip() for ln in r.stdout.splitlines()], r.stdout
        back.kill()


def test_the_node_rejoins_under_its_name_and_leaves_no_orphan(cluster: Cluster, killed: Killed):
    sid = killed.running.sandbox_id
    # the premise: its host "died" but the container outlived the node's processes (one machine)
    orphan_before = process_alive(killed.init_pid, killed.init_start)
    cluster.restart_node(killed.node)  # same name, home and runtime dir; waits until up
    assert cluster.node_state(killed.node) == "up"
    assert runc_state(cluster, killed.node, sid) is None, "runc container of a lost sandbox left"
    assert not on_node(cluster, killed.node, sid), "state dir of a lost sandbox left"
    assert not process_alive(killed.init_pid, killed.init_start), (
        f"the lost sandbox's init (pid {killed.init_pid}) still runs (it ran before the rejoin: {orphan_before})"
    )
    from warmbox.backends import _host

    assert not [d for d in _host.SandboxCgroup(sid).every_dir() if d.exists()], "cgroup of a lost sandbox left"
    # a lost sandbox still answers typed, and kill ends its record
    with pytest.raises(SandboxLost):
        killed.running.commands.run("true")
    assert killed.running.kill() is True
    info = next(i for i, _h in cluster.registry().sandboxes.list(include_dead=True) if i.sandbox_id == sid)
    assert info.state == State.DESTROYED
