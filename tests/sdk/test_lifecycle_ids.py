"""One id for a sandbox's whole life: pause, then resume or connect, gives back the same sandbox."""

from __future__ import annotations

import time

import pytest

from tests.conftest import over_cluster, pooled_sandbox, wait_for
from warmbox import Lifecycle, Limits, Sandbox, SandboxNotFound, SandboxPaused, State
from warmbox.engine.engine import Engine


@pytest.mark.sandbox
def test_pause_then_connect_or_resume_keeps_the_id_the_timeout_and_the_state(home, runc_ready):
    sb = Sandbox.create(template="shell", timeout=200)
    try:
        sid = sb.sandbox_id
        sb.files.write("/workspace/kept.txt", "turn 1")
        sb.run_code("seen = {'turn': 1}")
        ref = sb.pause()
        assert ref.sandbox_id == sid and sb.state is State.PAUSED
        info = sb.get_info()
        assert info.state is State.PAUSED and info.sandbox_id == sid

        back = Sandbox.connect(sid)  # connecting to a paused sandbox resumes it, under its id
        assert back.sandbox_id == sid
        assert back.files.read("/workspace/kept.txt") == "turn 1"
        assert back.run_code("seen").text == "{'turn': 1}"
        assert back.timings["resume"] > 0
        info = back.get_info()
        assert info.state in (State.READY, State.RUNNING)
        # the timeout it was created with, counted from the resume (not the default, not what was left)
        assert 200 - 15 < info.expires_at - time.time() <= 200

        # a fork of its snapshot is another sandbox; the original is untouched
        with Sandbox.create(from_snapshot=ref, timeout=60) as fork:
            assert fork.sandbox_id != sid
            assert fork.files.read("/workspace/kept.txt") == "turn 1"
            fork.files.write("/workspace/kept.txt", "fork")
        assert back.files.read("/workspace/kept.txt") == "turn 1"

        back.pause()
        again = Sandbox.resume(sid, timeout=100)  # told otherwise: the new timeout
        assert again.sandbox_id == sid and again.files.read("/workspace/kept.txt") == "turn 1"
        assert 100 - 15 < again.get_info().expires_at - time.time() <= 100
        assert again.kill() is True
        with pytest.raises(SandboxNotFound, match="destroyed"):
            Sandbox.connect(sid)
    finally:
        sb.kill()


@pytest.mark.sandbox
def test_an_expired_sandbox_says_expired_not_a_connection_error(home, runc_ready):
    sb = Sandbox.create(template="shell", timeout=2)
    try:
        assert sb.commands.run("true").exit_code == 0  # a held connection
        Engine.for_home(home).ensure_daemon()
        wait_for(lambda: sb.get_info().state is State.DESTROYED, 30, "the reaper to end the expired sandbox")
        with pytest.raises(SandboxNotFound, match="expired"):
            sb.commands.run("true")
        with pytest.raises(SandboxNotFound, match="expired"):
            Sandbox.connect(sb.sandbox_id)
    finally:
        sb.kill()


@pytest.mark.sandbox
def test_a_command_cut_short_by_the_timeout_says_expired(home, runc_ready):
    sb = Sandbox.create(template="shell", timeout=3)
    try:
        Engine.for_home(home).ensure_daemon()
        t0 = time.monotonic()
        with pytest.raises(SandboxNotFound, match="expired"):
            sb.commands.run("sleep 60", timeout=120)
        assert time.monotonic() - t0 < 30
    finally:
        sb.kill()


@pytest.mark.sandbox
@pytest.mark.parametrize("tier", ["gvisor", "microvm"])
def test_a_memory_pause_resumes_under_the_same_id(home, runc_ready, tier):
    avail = Engine.for_home(home).backend(tier).probe()
    if not avail.available:
        pytest.skip(f"tier {tier} is not available here: {avail.reason}")
    # the microVM's shape of tests/backends/test_microvm.py (small under TCG); gVisor's default
    limits = Limits(memory_mb=256, pids=64, tmp_mb=64) if tier == "microvm" else None
    sb = Sandbox.create(tier=tier, timeout=120, limits=limits)
    try:
        sb.run_code("counter = 41")
        ref = sb.pause(memory=True)
        assert ref.memory and ref.sandbox_id == sb.sandbox_id
        with Sandbox.connect(sb.sandbox_id) as back:
            assert back.sandbox_id == sb.sandbox_id
            assert back.run_code("counter + 1").text == "42"
            assert back.timings["resume"] > 0
    finally:
        sb.kill()


@pytest.mark.sandbox
def test_an_idle_pause_and_its_auto_resume_work_through_any_transport(home, runc_ready):
    keep = Sandbox.create(template="shell", timeout=120, lifecycle=Lifecycle(idle_pause_after=1, auto_resume=True))
    stay = Sandbox.create(template="shell", timeout=120, lifecycle=Lifecycle(idle_pause_after=1))
    try:
        keep.files.write("kept.txt", "v")
        for sb in (keep, stay):
            wait_for(lambda sb=sb: sb.get_info().state is State.PAUSED, 30, "the idle pause")
        assert keep.files.read("kept.txt") == "v"  # resumed by the call
        # (its state now may be paused again: one idle second under load is enough)
        assert keep.get_timings()["resume"] > 0
        with pytest.raises(SandboxPaused, match="paused"):
            stay.commands.run("true")
    finally:
        keep.kill()
        stay.kill()


@pytest.mark.sandbox
def test_resuming_the_ref_pause_returned_continues_that_sandbox(home, runc_ready):
    """resume(ref) with the SnapshotRef of pause() is resume(id) (nothing left paused behind); an
    older snapshot of the same sandbox still forks."""
    sb = Sandbox.create(template="shell", timeout=120)
    sid = sb.sandbox_id
    try:
        sb.files.write("/workspace/v.txt", "1")
        older = sb.snapshot()
        sb.files.write("/workspace/v.txt", "2")
        ref = sb.pause()
        with Sandbox.resume(ref) as back:
            assert back.sandbox_id == sid
            assert back.files.read("/workspace/v.txt") == "2"
            with Sandbox.resume(older) as fork:
                assert fork.sandbox_id != sid
                assert fork.files.read("/workspace/v.txt") == "1"
    finally:
        sb.kill()


def _left(sb) -> float:
    """Seconds until ``sb`` expires, by its record."""
    return sb.get_info().expires_at - time.time()


def _lifetime_sandbox(home, request, kind: str, timeout: float):
    """A sandbox created with ``timeout``: cold, or claimed from the ``iso`` pool (whose sandboxes
    wait there under the pool's max_age of 3600 s)."""
    if kind == "cold":
        return Sandbox.create(timeout=timeout, pool=False)
    cluster = request.getfixturevalue("cluster") if over_cluster(request.node) else None
    return pooled_sandbox(home, cluster, timeout=timeout)


# Issue 34: a sandbox claimed from a pool came back from a pause with the pool's 3600 s.
@pytest.mark.sandbox
@pytest.mark.parametrize("kind", ["cold", "pooled"])
def test_connect_resumes_with_the_sandboxs_own_timeout_or_the_one_given(home, runc_ready, request, kind):
    sb = _lifetime_sandbox(home, request, kind, 120)
    try:
        sid = sb.sandbox_id
        assert 60 < _left(sb) <= 121
        sb.pause()
        back = Sandbox.connect(sid)  # its own timeout, counted from the resume
        assert 60 < _left(back) <= 121, "not the 120 s it was created with"
        back.pause()
        back = Sandbox.connect(sid, timeout=200)  # told otherwise: that one, and it keeps it
        assert 140 < _left(back) <= 201
        back.pause()
        back = Sandbox.connect(sid)
        assert 140 < _left(back) <= 201
        # a running sandbox: a longer timeout extends it, a shorter one never cuts it short
        again = Sandbox.connect(sid, timeout=900)
        assert 840 < _left(again) <= 901
        again.close()
        again = Sandbox.connect(sid, timeout=30)
        assert 840 < _left(again) <= 901
        again.close()
        back.close()
    finally:
        sb.kill()


@pytest.mark.sandbox
@pytest.mark.parametrize("kind", ["cold", "pooled"])
def test_resume_keeps_the_sandboxs_own_timeout_or_takes_the_one_given(home, runc_ready, request, kind):
    sb = _lifetime_sandbox(home, request, kind, 120)
    try:
        sid = sb.sandbox_id
        sb.set_timeout(150)  # its lifetime from now on
        sb.pause()
        back = Sandbox.resume(sid)
        assert 90 < _left(back) <= 151, "not the 150 s it was last given"
        back.pause()
        back = Sandbox.resume(sid, timeout=200)
        assert 140 < _left(back) <= 201
        back.close()
    finally:
        sb.kill()
