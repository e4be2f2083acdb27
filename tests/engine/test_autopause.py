"""Auto-pause: idle and timed-out sandboxes paused by the daemon, auto-resume, paused retention."""

from __future__ import annotations

import dataclasses
import time

import pytest

from tests.conftest import set_config, wait_for
from warmbox import InvalidArgument, Lifecycle, Limits, Sandbox, SandboxNotFound, SandboxPaused, State
from warmbox import operations as ops
from warmbox.config import ConfigError, parse
from warmbox.engine import duties, front, snapstore
from warmbox.engine.engine import Engine
from warmbox.lifecycle import RETENTION_EXPIRED
from warmbox.models import validate_lifecycle
from warmbox.storage import snapshots as artifacts

WAIT_S = 30  # every wait below is bounded: the daemon acts within a tick (<= 1 s) of a deadline


def _state(engine: Engine, sid: str) -> State:
    return engine.info(sid)[0].state


# ---- without a sandbox


def test_every_operation_naming_a_sandbox_is_use_or_not_use():
    naming = {cls for cls in ops.REQUESTS.values() if any(f.name == "sandbox_id" for f in dataclasses.fields(cls))}
    assert not front.USE & front.NOT_USE
    missing = naming - front.USE - front.NOT_USE
    assert not missing, f"add to engine/front.py USE (works inside the sandbox) or NOT_USE: {missing}"
    assert front.USE | front.NOT_USE <= naming


def test_lifecycle_and_retention_settings_are_checked():
    assert validate_lifecycle(None) == Lifecycle()
    assert validate_lifecycle(Lifecycle("pause", 2.5, True)).idle_pause_after == 2.5
    for bad in (
        Lifecycle(on_timeout="sleep"),  # type: ignore[arg-type]
        Lifecycle(idle_pause_after=0),
        Lifecycle(idle_pause_after=-1),
        Lifecycle(idle_pause_after=float("nan")),
        Lifecycle(idle_pause_after=10 * 86400),
        Lifecycle(auto_resume="yes"),  # type: ignore[arg-type]
        {"on_timeout": "pause"},
    ):
        with pytest.raises(InvalidArgument):
            validate_lifecycle(bad)
    assert parse({"lifecycle": {"paused_retention": 60}}).paused_retention_s == 60.0
    assert parse({}).paused_retention_s == 7 * 24 * 3600.0
    for bad_value in (0, "1d", True):
        with pytest.raises(ConfigError, match="paused_retention"):
            parse({"lifecycle": {"paused_retention": bad_value}})
    with pytest.raises(ConfigError, match="unknown"):
        parse({"lifecycle": {"retention": 60}})


# ---- the container tier


@pytest.mark.sandbox
def test_an_idle_sandbox_is_paused_and_the_next_call_resumes_it(home, runc_ready):
    engine = Engine.for_home(home)
    sb = Sandbox.create(
        template="shell", timeout=300, lifecycle=Lifecycle(idle_pause_after=3, auto_resume=True), metadata={"t": "idle"}
    )
    sid = sb.sandbox_id
    try:
        assert sb.get_info().lifecycle == Lifecycle(idle_pause_after=3, auto_resume=True)
        sb.files.write("/workspace/kept.txt", "before")
        sb.run_code("x = 41")
        mine = sb.snapshot()
        # a command longer than the idle time is use, not idleness
        r = sb.commands.run("sleep 4; echo done", timeout=30)
        assert r.stdout == "done\n" and _state(engine, sid) in (State.READY, State.RUNNING)
        t0 = time.monotonic()
        wait_for(lambda: _state(engine, sid) is State.PAUSED, WAIT_S, "the daemon to pause the idle sandbox")
        assert time.monotonic() - t0 >= 2.5  # not before its idle time
        assert "idle" in engine.registry.sandboxes.ended_reason(sid)
        # nothing runs, nothing is held (released just after the pause is recorded)
        wait_for(lambda: not engine.backend("container")._pids(sid), WAIT_S, "the release")
        # the next call resumes it, transparently, under its id
        assert sb.files.read("/workspace/kept.txt") == "before"
        first = engine.registry.snapshots.auto_snapshots_of(sid)
        assert _state(engine, sid) in (State.READY, State.RUNNING)
        assert sb.run_code("x + 1").text == "42"
        assert sb.get_timings()["resume"] > 0
        assert sb.get_info().sandbox_id == sid
        # each automatic pause replaces the previous one; a snapshot the caller took stays theirs
        assert len(first) == 1 and mine.snapshot_id not in first
        # (marked once the pause is complete: just after the sandbox shows as paused)
        wait_for(
            lambda: (
                len(engine.registry.snapshots.auto_snapshots_of(sid)) == 1
                and engine.registry.snapshots.auto_snapshots_of(sid) != first
            ),
            WAIT_S,
            "the second idle pause",
        )
        second = engine.registry.snapshots.auto_snapshots_of(sid)
        assert _state(engine, sid) is State.PAUSED
        assert set(engine.registry.snapshots.snapshots_of(sid)) == {mine.snapshot_id, *second}
        sb.kill()  # and what automatic pauses saved ends with the sandbox
        assert engine.registry.snapshots.snapshots_of(sid) == [mine.snapshot_id]
    finally:
        sb.kill()


@pytest.mark.sandbox
def test_a_call_during_the_daemons_memory_pause_waits_for_it_and_resumes(home, runc_ready):
    """gVisor's idle pause checkpoints for a second or more: a call then found the agent gone and
    the runtime not alive, and destroyed the sandbox as dead under its pauser (SandboxNotFound,
    its snapshot lost; seen by bench session's autopause strategy). It waits for the pause now."""
    engine = Engine.for_home(home)
    avail = engine.backend("gvisor").probe()
    assert avail.available, avail.reason
    sb = Sandbox.create(
        tier="gvisor", template="shell", timeout=300, lifecycle=Lifecycle(idle_pause_after=1, auto_resume=True)
    )
    sid = sb.sandbox_id
    try:
        sb.files.write("/workspace/kept.txt", "before")
        sb.run_code("x = 41")
        wait_for(lambda: snapstore.pause_running(engine, sid), WAIT_S, "the daemon's memory pause to start")
        assert sb.files.read("/workspace/kept.txt") == "before"  # during the pause: waits, then resumes
        assert sb.run_code("x + 1").text == "42" and sb.get_timings()["resume"] > 0
        assert _state(engine, sid) in (State.READY, State.RUNNING)
    finally:
        sb.kill()


@pytest.mark.sandbox
def test_without_auto_resume_a_paused_sandbox_raises_until_connected(home, runc_ready):
    engine = Engine.for_home(home)
    sb = Sandbox.create(template="shell", timeout=300, lifecycle=Lifecycle(idle_pause_after=1))
    try:
        sb.files.write("/workspace/kept.txt", "v")
        wait_for(lambda: _state(engine, sb.sandbox_id) is State.PAUSED, WAIT_S, "the idle pause")
        with pytest.raises(SandboxPaused, match=r"paused .*idle"):
            sb.commands.run("true")
        with pytest.raises(SandboxPaused):
            sb.files.read("/workspace/kept.txt")
        assert _state(engine, sb.sandbox_id) is State.PAUSED  # nothing resumed it
        with Sandbox.connect(sb.sandbox_id) as back:  # an explicit connect resumes it
            assert back.sandbox_id == sb.sandbox_id and back.files.read("/workspace/kept.txt") == "v"
    finally:
        sb.kill()


@pytest.mark.sandbox
def test_on_timeout_pause_pauses_instead_of_killing(home, runc_ready):
    engine = Engine.for_home(home)
    sb = Sandbox.create(template="shell", timeout=3, lifecycle=Lifecycle(on_timeout="pause"))
    try:
        sb.files.write("/workspace/kept.txt", "v")
        wait_for(lambda: _state(engine, sb.sandbox_id) is not State.READY, WAIT_S, "the timeout")
        assert _state(engine, sb.sandbox_id) is State.PAUSED
        assert "timeout ran out" in engine.registry.sandboxes.ended_reason(sb.sandbox_id)
        with pytest.raises(SandboxPaused):
            sb.commands.run("true")
        back = Sandbox.connect(sb.sandbox_id)
        assert back.files.read("/workspace/kept.txt") == "v"
        assert 0 < back.get_info().expires_at - time.time() <= 3  # its own timeout again, from the resume
        back.kill()
    finally:
        sb.kill()


@pytest.mark.sandbox
def test_paused_sandboxes_are_deleted_with_their_snapshots_after_the_retention(home, runc_ready):
    engine = Engine.for_home(home)
    store = snapstore.store_for(engine)
    set_config(home, "\n[lifecycle]\npaused_retention = 2\n")
    try:
        sb = Sandbox.create(template="shell", timeout=300)
        sid = sb.sandbox_id
        ref = sb.pause()
        assert store.exists(artifacts.manifest_key(ref.snapshot_id))
        engine.ensure_daemon()
        wait_for(lambda: _state(engine, sid) is State.DESTROYED, WAIT_S, "the paused retention to end it")
        assert engine.registry.sandboxes.ended_reason(sid) == RETENTION_EXPIRED
        assert engine.registry.snapshots.snapshots_of(sid) == []
        assert not store.exists(artifacts.manifest_key(ref.snapshot_id))
        with pytest.raises(SandboxNotFound, match="expired"):
            Sandbox.connect(sid)
    finally:
        set_config(home)


@pytest.mark.sandbox
def test_a_resume_whose_process_died_leaves_the_sandbox_paused_not_lost(home, runc_ready):
    import asyncio
    import subprocess

    from warmbox.paths import owner_tag

    engine = Engine.for_home(home)
    sb = Sandbox.create(template="shell", timeout=120)
    try:
        sb.files.write("kept.txt", "v")
        sb.pause()
        proc = subprocess.Popen(["sleep", "30"])
        dead = owner_tag(proc.pid)  # a resumer that dies at once
        proc.kill()
        proc.wait()
        engine.registry.sandboxes.reallocate(
            sb.sandbox_id, 60.0, Limits(), owner=dead
        )  # its resume began, then nothing
        assert _state(engine, sb.sandbox_id) is State.CREATING
        asyncio.run(duties.reap(engine))
        assert _state(engine, sb.sandbox_id) is State.PAUSED
        assert "resumer process died" in engine.registry.sandboxes.ended_reason(sb.sandbox_id)
        with Sandbox.connect(sb.sandbox_id) as back:
            assert back.files.read("kept.txt") == "v"
    finally:
        sb.kill()


@pytest.mark.sandbox
def test_a_command_cut_short_by_a_timeout_pause_is_not_run_again(home, runc_ready):
    """With auto_resume, a command the timeout pause interrupted raises SandboxPaused instead of
    running a second time after the resume (it may have done part of its work); the next call
    resumes the sandbox."""
    engine = Engine.for_home(home)
    sb = Sandbox.create(template="shell", timeout=3, lifecycle=Lifecycle(on_timeout="pause", auto_resume=True))
    try:
        engine.ensure_daemon()
        t0 = time.monotonic()
        with pytest.raises(SandboxPaused, match="not run again"):
            sb.commands.run("echo ran >> /workspace/count; sleep 60", timeout=120)
        assert time.monotonic() - t0 < WAIT_S
        assert sb.files.read("/workspace/count") == "ran\n"  # resumed by this call; the command ran once
        assert _state(engine, sb.sandbox_id) is State.READY
    finally:
        sb.kill()


def test_only_reads_are_repeated_after_a_pause():
    assert front.REPEATABLE <= front.USE
    for op in (ops.Exec, ops.RunCode, ops.StartProcess, ops.WriteFile, ops.WriteFiles, ops.Remove, ops.Rename):
        assert op not in front.REPEATABLE
