"""Fixtures of the tier tests: the microVM tier's engine, checked for leftover VMs per module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from warmbox.engine.engine import Engine


def qemu_pids(runtime: Path) -> list[int]:
    """QEMU and relay processes of this test home (their command lines name its runtime dir)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if str(runtime).encode() in cmd and (b"qemu-system" in cmd or b"vmrelay" in cmd):
            out.append(int(proc.name))
    return out


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
