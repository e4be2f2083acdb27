"""Lifecycle: registry states, timeouts enforced by the background reaper, nothing leaks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from warmbox import Sandbox, SandboxNotFound, State
from warmbox.engine.engine import Engine

pytestmark = pytest.mark.sandbox


def traces(engine: Engine, sandbox_id: str, init_uid: int) -> dict[str, object]:
    """Everything on the host that could belong to one sandbox."""
    backend = engine.backend("container")
    cgroups = [str(d) for d in backend.cgroup_dirs(sandbox_id) if d.exists()]
    runc_state = (backend.root / sandbox_id).exists()
    state_dir = (engine.runtime / "sandboxes" / sandbox_id).exists()
    procs = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                status = (p / "status").read_text()
                uid = int(status.split("Uid:")[1].split()[0])
            except (OSError, IndexError, ValueError):
                continue
            if "\nState:\tZ" in status:  # exited, waiting for the host's init to reap it
                continue
            if uid == init_uid:
                procs.append(p.name)
    mounts = [ln for ln in Path("/proc/mounts").read_text().splitlines() if sandbox_id in ln]
    return {"cgroups": cgroups, "runc_state": runc_state, "state_dir": state_dir, "procs": procs, "mounts": mounts}


def _host_uid(sb) -> int:
    _, handle = Engine.for_home().info(sb.sandbox_id)
    return handle.uid_base + 1000


def test_kill_leaves_nothing(home, runc_ready):
    sb = Sandbox.create(timeout=60)
    engine = Engine.for_home()
    uid = _host_uid(sb)
    sb.commands.run("sleep 1000 > /dev/null 2>&1 &")  # a background process must go too
    live = traces(engine, sb.sandbox_id, uid)
    assert live["cgroups"] and live["runc_state"] and live["state_dir"] and live["procs"]
    sb.kill()
    assert traces(engine, sb.sandbox_id, uid) == {
        "cgroups": [],
        "runc_state": False,
        "state_dir": False,
        "procs": [],
        "mounts": [],
    }
    info, _ = engine.info(sb.sandbox_id)
    assert info.state is State.DESTROYED
    states = [t.to_state for t in engine.registry.sandboxes.transitions(sb.sandbox_id)]
    assert states == ["creating", "ready", "destroyed"]


def test_timeout_expiry_destroys_without_any_client(home, runc_ready):
    sb = Sandbox.create(timeout=2)
    engine = Engine.for_home()
    uid = _host_uid(sb)
    sid = sb.sandbox_id
    sb.close()  # walk away without killing it
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        info, _ = engine.info(sid)
        if info.state is State.DESTROYED:
            break
        time.sleep(0.2)
    assert engine.info(sid)[0].state is State.DESTROYED, "the reaper did not destroy the expired sandbox"
    assert engine.registry.sandboxes.transitions(sid)[-1].reason == "timeout expired"
    assert traces(engine, sid, uid) == {
        "cgroups": [],
        "runc_state": False,
        "state_dir": False,
        "procs": [],
        "mounts": [],
    }
    with pytest.raises(SandboxNotFound):
        Sandbox.connect(sid)


def test_set_timeout_extends_life(home, runc_ready):
    with Sandbox.create(timeout=2) as sb:
        sb.set_timeout(60)
        time.sleep(3)
        assert sb.is_running() and sb.commands.run("echo up").stdout == "up\n"


def test_uid_ranges_are_private_per_sandbox(home, runc_ready):
    with Sandbox.create(timeout=30) as a, Sandbox.create(timeout=30) as b:
        assert _host_uid(a) != _host_uid(b)
        assert abs(_host_uid(a) - _host_uid(b)) >= 65536


def test_failed_start_is_cleaned_up_and_typed(home, runc_ready, monkeypatch):
    from warmbox.errors import SandboxStartError

    engine = Engine.for_home()
    backend = engine.backend("container")
    monkeypatch.setattr(backend, "runc", "/bin/false")
    before = {i.sandbox_id for i in engine.list(include_dead=True)}
    with pytest.raises(SandboxStartError):
        Sandbox.create(timeout=30)
    new = [i for i in engine.list(include_dead=True) if i.sandbox_id not in before]
    assert len(new) == 1 and new[0].state is State.DESTROYED
    assert not (engine.runtime / "sandboxes" / new[0].sandbox_id).exists()
