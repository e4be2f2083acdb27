"""Fixtures of the tier tests: the microVM tier's engine, checked for leftover VMs per module; teardown checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from warmbox.backends import workspace_disk
from warmbox.engine.engine import Engine


def live_pids(naming: str, *any_of: bytes) -> list[int]:
    """Running (not zombie) processes whose command line holds ``naming`` and, if given, one of ``any_of``."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            stat = (proc / "stat").read_bytes()
        except OSError:
            continue
        if stat[stat.rindex(b")") + 2 :][:1] in (b"Z", b"X"):
            continue
        if naming.encode() in cmd and (not any_of or any(x in cmd for x in any_of)):
            out.append(int(proc.name))
    return out


def qemu_pids(runtime: Path) -> list[int]:
    """QEMU and relay processes of this test home (their command lines name its runtime dir)."""
    return live_pids(str(runtime), b"qemu-system", b"vmrelay")


def recording(backend, monkeypatch) -> list[tuple[str, ...]]:
    """The runtime subcommands the container or gVisor backend runs from now on."""
    calls: list[tuple[str, ...]] = []
    run = backend.runtime_cmd

    async def recorded(handle, *args, **kw):
        calls.append(args)
        return await run(handle, *args, **kw)

    monkeypatch.setattr(backend, "runtime_cmd", recorded)
    return calls


def leftovers(backend, handle) -> dict[str, object]:
    """What a sandbox of the container or gVisor tier may leave on the host (``NOTHING`` once destroyed)."""
    sid = handle.sandbox_id
    return {
        "cgroups": [str(d) for d in backend.cgroup_dirs(sid) if d.exists()],
        "runtime": sorted(p.name for p in backend.root.glob(sid + "*")),
        "state_dir": os.path.exists(handle.state_dir),
        "mounts": workspace_disk.mounts_under(handle.state_dir),
        "loops": workspace_disk.loops_backed_by(handle.state_dir),
    }


NOTHING = {"cgroups": [], "runtime": [], "state_dir": False, "mounts": [], "loops": {}}


@pytest.fixture(scope="module")
def engine(home, runc_ready):
    """The microVM tier must run here; no QEMU or relay may outlive the module's tests."""
    engine = Engine.for_home(home)
    avail = engine.backend("microvm").probe()
    if not avail.available:
        pytest.fail(f"the microvm tier must run here (scripts/bootstrap installs QEMU): {avail.reason}")
    yield engine
    left = qemu_pids(engine.runtime)
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"QEMU or relay processes left behind: {left}"
