"""Teardown of the container and gVisor tiers without a sandbox: the runtime's delete, its bounds and errors."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from pathlib import Path

import pytest

from warmbox.backends.base import BackendHandle
from warmbox.backends.gvisor import GvisorBackend
from warmbox.backends.runc import RuncBackend
from warmbox.errors import SandboxError, SandboxTimeout

SID = "sb-0123456789ab"


def _handle(tmp_path: Path, tier: str = "container") -> BackendHandle:
    state = tmp_path / "sandboxes" / SID
    return BackendHandle(
        sandbox_id=SID,
        tier=tier,
        runtime_id=SID,
        state_dir=str(state),
        socket_path=str(state / "run" / "agent.sock"),
        uid_base=1 << 30,
    )


def _fake_runc(tmp_path: Path, script: str) -> RuncBackend:
    """A RuncBackend whose runtime is a shell script; each call's arguments go to ``calls``."""
    exe = tmp_path / "fake-runtime"
    exe.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n{script}\n')
    exe.chmod(0o755)
    backend = RuncBackend(tmp_path, runc=str(exe))
    backend.root = tmp_path / "records"  # not named runc: the fast lane refuses anything that looks like it
    (backend.root / SID).mkdir(parents=True)
    return backend


def _calls(tmp_path: Path) -> list[str]:
    """The runtime's arguments after ``--root DIR`` (gVisor's platform probe has its own root: not listed)."""
    lines = (tmp_path / "calls").read_text().splitlines()
    return [line.split(f"{tmp_path}/records ", 1)[1] for line in lines if f"{tmp_path}/records " in line]


def test_a_stopped_container_is_deleted_without_force(tmp_path):
    backend = _fake_runc(tmp_path, f"rm -r {tmp_path}/records/{SID}")
    asyncio.run(backend.delete_container(_handle(tmp_path)))
    assert _calls(tmp_path) == [f"delete {SID}"] and not (backend.root / SID).exists()
    asyncio.run(backend.delete_container(_handle(tmp_path)))  # gone already: runc is not asked again
    assert len(_calls(tmp_path)) == 1


def test_one_runc_still_sees_running_gets_force(tmp_path):
    backend = _fake_runc(
        tmp_path,
        f'case "$*" in *--force*) rm -r {tmp_path}/records/{SID};; '
        '*) echo "cannot delete container that is not stopped" >&2; exit 1;; esac',
    )
    asyncio.run(backend.delete_container(_handle(tmp_path)))
    assert _calls(tmp_path) == [f"delete {SID}", f"delete --force {SID}"] and not (backend.root / SID).exists()


def test_a_failed_delete_is_typed_and_names_runcs_reason(tmp_path):
    backend = _fake_runc(tmp_path, 'echo "permission denied, somehow" >&2; exit 1')
    with pytest.raises(SandboxError, match="runc delete failed: permission denied, somehow") as e:
        asyncio.run(backend.delete_container(_handle(tmp_path)))
    assert e.value.sandbox_id == SID


def test_a_runtime_that_hangs_is_killed_at_its_bound(tmp_path):
    backend = _fake_runc(tmp_path, "exec sleep 300")
    with pytest.raises(SandboxTimeout, match=r"fake-runtime delete did not finish within 0\.2 s"):
        asyncio.run(backend.runtime_cmd(_handle(tmp_path), "delete", SID, timeout=0.2))


@pytest.mark.parametrize("tier", ["container", "gvisor"])
def test_destroying_what_was_never_created_is_a_no_op(tmp_path, tier):
    """A creation that failed before anything existed, or a second destroy: no runtime is run, no error."""
    backend = RuncBackend(tmp_path) if tier == "container" else GvisorBackend(tmp_path)
    asyncio.run(backend.destroy(_handle(tmp_path, tier)))
    asyncio.run(backend.destroy(_handle(tmp_path, tier)))
    assert not (tmp_path / "sandboxes" / SID).exists()


# ---- gVisor: what runsc delete does for a stopped sandbox, without its wait for the host's init


def _runsc_record(tmp_path: Path, **change) -> tuple[GvisorBackend, Path, Path]:
    exe = tmp_path / "fake-runtime"  # the fallback: refuses, and says what it was asked
    exe.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\necho "fake runtime refused" >&2\nexit 1\n')
    exe.chmod(0o755)
    backend = GvisorBackend(tmp_path, runsc=str(exe))
    backend.root = tmp_path / "records"
    backend.root.mkdir(parents=True)
    state, lock = backend._state_files(_handle(tmp_path, "gvisor"))
    record = {
        "id": SID,
        "status": "running",
        "goferPid": 2**22 + 1,
        "sandbox": {"id": SID, "pid": 2**22 + 2},
        "spec": {"ociVersion": "1.0.2"},
    }  # pids above pid_max: processes that are gone
    record.update(change)
    state.write_text(json.dumps(record))
    lock.write_bytes(b"")
    return backend, state, lock


def test_a_stopped_gvisor_sandbox_is_forgotten_under_runscs_lock(tmp_path):
    backend, state, lock = _runsc_record(tmp_path)
    assert state.name == f"{SID}_sandbox:{SID}.state" and lock.name == f"{SID}_sandbox:{SID}.lock"
    asyncio.run(backend.delete_container(_handle(tmp_path, "gvisor")))
    assert not state.exists() and not lock.exists() and not (tmp_path / "calls").exists()  # runsc not asked


@pytest.mark.parametrize("case", ["locked", "hooks", "gofer running", "another file", "unreadable"])
def test_anything_unexpected_goes_to_runsc_delete(tmp_path, case):
    change = {
        "hooks": {"spec": {"ociVersion": "1.0.2", "hooks": {"poststop": [{"path": "/bin/true"}]}}},
        "gofer running": {"goferPid": os.getpid()},
    }.get(case, {})
    backend, state, lock = _runsc_record(tmp_path, **change)
    if case == "another file":
        (backend.root / f"{SID}_sandbox:{SID}.other").write_text("")
    if case == "unreadable":
        state.write_text("{")
    held = os.open(lock, os.O_RDWR)
    try:
        if case == "locked":
            fcntl.flock(held, fcntl.LOCK_EX)  # a runsc command working on the sandbox
        with pytest.raises(SandboxError, match="runsc delete failed: fake runtime refused") as e:
            asyncio.run(backend.delete_container(_handle(tmp_path, "gvisor")))
    finally:
        os.close(held)
    assert e.value.sandbox_id == SID
    assert _calls(tmp_path)[-1].endswith(f"delete --force {SID}")
    assert state.exists() and lock.exists()  # nothing was removed behind runsc's back


def test_a_missing_runtime_is_a_typed_error(tmp_path):
    backend = RuncBackend(tmp_path, runc=str(tmp_path / "no-such-runtime"))
    backend.root = tmp_path / "records"
    with pytest.raises(SandboxError, match=r"cannot run .*no-such-runtime"):
        asyncio.run(backend.runtime_cmd(_handle(tmp_path), "delete", SID))
