"""A process killed in the middle of a snapshot or a pause loses nothing and leaves nothing.

Every snapshot/restore keeps its temp artifacts in one locked directory; once its process is
gone, recovery (the daemon's reaper, ``warmbox snapshots gc``) removes them whatever their age,
and finishes a pause that was killed after its checkpoint had already stopped the runtime.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.attacks.conftest import require_tier
from tests.conftest import cli, wait_for
from warmbox import Sandbox, State
from warmbox.engine import checkpoint, snapstore

pytestmark = pytest.mark.sandbox


def _ops(home: Path, kind: str) -> list[Path]:
    return sorted((home / "tmp").glob(f"{snapstore.OP_PREFIX}{kind}-*")) if (home / "tmp").is_dir() else []


def _du(path: Path) -> int:
    return sum(f.lstat().st_blocks * 512 for f in path.rglob("*") if not f.is_symlink())


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_killed_snapshot_leaves_no_temp_files(home, runc_ready):
    require_tier(home, "container")
    sb = Sandbox.create(tier="container", timeout=300, pool=False)
    proc = None
    try:
        assert sb.commands.run("head -c 150M /dev/urandom > /workspace/big").exit_code == 0
        proc = _start(f"from warmbox import Sandbox; Sandbox.connect({sb.sandbox_id!r}).snapshot()")
        # killed while it streams the files: its temp dir already holds tens of MB
        op = wait_for(lambda: [d for d in _ops(home, "snapshot") if _du(d) > 20 << 20], 60, "a big temp artifact")[0]
        _kill(proc)
        assert op.exists()
        time.sleep(snapstore.OP_MIN_AGE_S + 0.5)
        r = cli("snapshots", "gc")
        assert r.returncode == 0, r.stderr
        assert not op.exists(), "a dead snapshot's temp files survived gc"
        assert not _ops(home, "snapshot")
        assert sb.commands.run("echo alive").stdout == "alive\n"  # the sandbox itself runs on
    finally:
        if proc is not None:
            _kill(proc)
        sb.kill()


def test_pause_killed_after_its_checkpoint_ends_paused_and_resumable(home, runc_ready):
    """The gVisor checkpoint stops the sandbox's runtime; a pauser killed after it used to
    lose the workspace and the processes. Now recovery finishes the pause."""
    engine = require_tier(home, "gvisor")
    sb = Sandbox.create(tier="gvisor", timeout=300)
    sid = sb.sandbox_id
    proc = None
    try:
        sb.run_code("x = 41")
        assert sb.commands.run("head -c 64M /dev/urandom > /workspace/data && md5sum /workspace/data").exit_code == 0
        digest = sb.commands.run("md5sum < /workspace/data").stdout
        proc = _start(f"from warmbox import Sandbox; Sandbox.connect({sid!r}).pause(memory=True)")
        wait_for(lambda: any((d / "checkpointed").exists() for d in _ops(home, "pause")), 60, "the checkpoint")
        _kill(proc)
        info, _ = engine.info(sid)
        assert info.state is not State.PAUSED, "the pause finished before the kill: the test proves nothing"

        # recovery (the daemon's reaper, or ``snapshots gc``: here called directly, so a daemon busy
        # with other work on a loaded host cannot make the wait long) finishes the dead pauser's pause
        def recovered() -> bool:
            asyncio.run(checkpoint.recover(engine))  # whoever takes the op's lock first finishes it
            return engine.info(sid)[0].state is State.PAUSED

        wait_for(recovered, 120, "recovery to finish the pause", 0.5)
        assert "paused to snap-" in engine.registry.sandboxes.transitions(sid)[-1].reason
        wait_for(lambda: not _ops(home, "pause"), 10, "the recovered pause's temp dir to go")
        sb = Sandbox.resume(sid)
        assert sb.run_code("x + 1").text == "42"  # the processes continued
        assert sb.commands.run("md5sum < /workspace/data").stdout == digest
    finally:
        if proc is not None:
            _kill(proc)
        try:
            sb.kill()
        except Exception:
            pass


def test_half_copied_memory_image_of_a_dead_process_is_removed(home, runc_ready):
    """A process killed while it copied a memory image into the cache (up to ~1 GB) left a
    .tmp-* directory there that nothing removed."""
    engine = require_tier(home, "gvisor")
    cache = snapstore.memory_cache(engine)
    cache.mkdir(parents=True, exist_ok=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = cache / f".tmp-snap-20260101-000000000000-{dead.pid}-1"
    stale.mkdir()
    (stale / "checkpoint.img").write_bytes(b"\0" * 4096)
    mine = cache / f".tmp-snap-20260101-000000000001-{os.getpid()}-2"  # a live process's: kept
    mine.mkdir()
    try:
        r = cli("snapshots", "gc")
        assert r.returncode == 0, r.stderr
        assert not stale.exists() and mine.exists()
    finally:
        import shutil

        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(mine, ignore_errors=True)
