"""Shared fixtures. Sandbox tests use real runc sandboxes in a private WARMBOX_HOME."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cgroup_leftovers() -> list[str]:
    out = []
    base = Path("/sys/fs/cgroup")
    for d in base.glob("*/warmbox/sb-*"):
        out.append(str(d))
    for d in base.glob("warmbox/sb-*"):
        out.append(str(d))
    return out


@pytest.fixture(scope="session")
def home() -> Path:
    """A private WARMBOX_HOME (short path: unix sockets live under it)."""
    path = Path(f"/tmp/wbt-{secrets.token_hex(3)}")
    path.mkdir(mode=0o700)
    old = os.environ.get("WARMBOX_HOME")
    os.environ["WARMBOX_HOME"] = str(path)
    before = set(_cgroup_leftovers())
    parents_before = {str(d) for d in Path("/sys/fs/cgroup").glob("*/warmbox")}
    yield path
    # every test must have cleaned up after itself; prove it, then remove what is left
    from warmbox.engine.engine import Engine
    import asyncio

    engine = Engine.for_home(path)
    live = engine.list()
    for info in live:
        asyncio.run(engine.destroy(info.sandbox_id, "test session teardown"))
    rt = engine.runtime
    runc_state = [p.name for p in (rt / "runc").iterdir()] if (rt / "runc").is_dir() else []
    leftovers = set(_cgroup_leftovers()) - before
    sandboxes = [p.name for p in (rt / "sandboxes").iterdir()] if (rt / "sandboxes").is_dir() else []
    _stop_reaper(path)
    for d in Path("/sys/fs/cgroup").glob("*/warmbox"):  # runc's parent cgroups, if we made them
        if str(d) not in parents_before:
            try:
                d.rmdir()
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(rt, ignore_errors=True)
    if old is None:
        os.environ.pop("WARMBOX_HOME", None)
    else:
        os.environ["WARMBOX_HOME"] = old
    assert not live, f"tests left live sandboxes: {[i.sandbox_id for i in live]}"
    assert not runc_state, f"runc containers left: {runc_state}"
    assert not leftovers, f"cgroups left: {sorted(leftovers)}"
    assert not sandboxes, f"sandbox dirs left: {sandboxes}"


def _stop_reaper(path: Path) -> None:
    """End the reaper this session's home started (found by its command line, ended by PID)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"warmbox.engine.reaper" in cmd and str(path).encode() in cmd:
            try:
                os.kill(int(proc.name), 15)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="session")
def runc_ready(home: Path) -> None:
    from warmbox.engine.engine import Engine

    avail = Engine.for_home(home).backend("container").probe()
    if not avail.available:
        pytest.fail(f"the container tier must run here (scripts/bootstrap installs it): {avail.reason}")


@pytest.fixture(scope="module")
def sb(home: Path, runc_ready: None):
    """One sandbox shared by the read-only checks of a module."""
    from warmbox import Sandbox

    with Sandbox.create(timeout=600, envs={"GREETING": "hi"}) as box:
        yield box


def host_python() -> str:
    return sys.executable


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "warmbox.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
