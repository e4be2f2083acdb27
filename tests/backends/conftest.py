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


# --------------------------------------------------------------------------- image layers made by hand

TEST_LAYERS = Path("/var/lib/warmbox/test-layers")


def shifted_copy(tree: Path, out: Path) -> Path:
    """``tree`` copied to ``out`` with every owner shifted into the layer range (an image's uid u is
    host uid LAYER_UID_BASE + u), once per host (temp dir + rename, under a lock): what a layer of
    the store looks like, made without it."""
    import fcntl
    import shutil
    import subprocess
    import time

    from warmbox.models import LAYER_UID_BASE

    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_dir():
            return out
        tmp = out.parent / f".tmp-{os.getpid()}-{time.monotonic_ns()}"
        try:
            subprocess.run(["cp", "-a", "--reflink=auto", str(tree), str(tmp)], check=True, timeout=1200)
            for parent, dirs, files in os.walk(tmp):
                for name in (*dirs, *files):
                    p = os.path.join(parent, name)
                    st = os.lstat(p)
                    os.lchown(p, LAYER_UID_BASE + st.st_uid, LAYER_UID_BASE + st.st_gid)
                    if not os.path.islink(p) and st.st_mode & 0o6000:  # chown clears setuid/setgid
                        os.chmod(p, st.st_mode & 0o7777)
            st = os.lstat(tmp)
            os.chown(tmp, LAYER_UID_BASE + st.st_uid, LAYER_UID_BASE + st.st_gid)
            os.rename(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def debian_tree() -> Path:
    """The microVM image's Debian tree on this host (scripts/bootstrap builds it)."""
    from warmbox.backends import microvm_image

    tree = microvm_image.cache_dir() / microvm_image._debian_key_name()
    if not tree.is_dir():
        pytest.fail(f"no Debian tree {tree} (scripts/bootstrap builds the microVM image, which makes it)")
    return tree


@pytest.fixture(scope="session")
def debian_layer() -> str:
    """A Debian bookworm layer (python3, apt, dpkg, coreutils...) with owners in the layer range."""
    tree = debian_tree()
    return str(shifted_copy(tree, TEST_LAYERS / f"{tree.name}-shifted"))
