"""Attack: fill /workspace until the host's disk is full.

/workspace used to be a plain directory on the host's disk: ``dd if=/dev/zero of=/workspace/fill``
ran until the disk holding /var/lib/warmbox was full, for every sandbox on the host. Now it is
its own filesystem of ``limits.disk_mb`` (a sparse ext4 image, loop-mounted, on the container
and gVisor tiers): the writer gets ENOSPC, files.write gets NoSpace, the host gives at most
``disk_mb``, and nothing of it (mount, loop device, image) is left once the sandbox is gone —
also when the process that created it was killed half-way. Snapshots keep the workspace, and a
snapshot that cannot fit its sandbox's disk is a typed error.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest

from tests.attacks.conftest import require_tier
from tests.conftest import set_config, wait_for
from warmbox import Limits, Sandbox, State, config
from warmbox.backends import workspace_disk
from warmbox.engine import duties, teardown
from warmbox.errors import InvalidArgument, LimitTooHigh, NoSpace

pytestmark = pytest.mark.sandbox

QUOTA = Limits(disk_mb=64)
DD_BOUND_MB = 256  # the attack is ``dd`` without a count; bounded here so a broken quota cannot fill the host


def _leftovers(engine, sandbox_id: str) -> tuple[list[str], dict[int, str]]:
    """Mounts and loop devices of one sandbox's state dir (in this mount namespace)."""
    state = engine.runtime / "sandboxes" / sandbox_id
    return workspace_disk.mounts_under(state), workspace_disk.loops_backed_by(state)


def _image(engine, sandbox_id: str):
    return engine.runtime / "sandboxes" / sandbox_id / workspace_disk.IMAGE


def test_filling_the_workspace_stops_at_its_quota_and_the_host_keeps_its_space(home, tier):
    engine = require_tier(home, tier)
    with Sandbox.create(tier=tier, timeout=300, pool=False, template="shell", limits=QUOTA) as sb:
        sid = sb.sandbox_id
        mounts, loops = _leftovers(engine, sid)
        assert mounts and loops, "the workspace is not its own filesystem"
        r = sb.commands.run("df -m /workspace | tail -1; stat -c '%U %a' /workspace")
        size_mb = int(r.stdout.split()[1])
        assert 48 <= size_mb <= 64 and r.stdout.split()[-2:] == ["user", "700"], r.stdout
        free_before = os.statvfs(engine.runtime).f_bavail * os.statvfs(engine.runtime).f_frsize
        r = sb.commands.run(
            f"dd if=/dev/zero of=/workspace/fill bs=1M count={DD_BOUND_MB} 2>&1; echo rc=$?; "
            "stat -c %s /workspace/fill",
            timeout=120,
        )
        assert "No space left on device" in r.stdout and "rc=1" in r.stdout, r.stdout
        written = int(r.stdout.split()[-1])
        assert 40 << 20 <= written <= 64 << 20, f"dd stopped after {written >> 20} MiB"
        # what the host gave: the image's blocks (exact), and its free space (other writers may run too)
        img = _image(engine, sid).stat()
        assert img.st_size == 64 << 20 and img.st_blocks * 512 <= 64 << 20
        st = os.statvfs(engine.runtime)
        assert free_before - st.f_bavail * st.f_frsize <= (64 + 192) << 20
        # the files API sees a full disk as NoSpace, and the sandbox answers on
        with pytest.raises(NoSpace):
            sb.files.write("/workspace/big.bin", b"\0" * (100 << 20))
        assert sb.commands.run("echo alive").stdout == "alive\n"
        assert sb.run_code("6 * 7").text == "42"
        sb.commands.run("rm -f /workspace/fill /workspace/big.bin")
        sb.files.write("/workspace/after.txt", "room again")  # freed space is usable again
        assert sb.files.read("/workspace/after.txt") == "room again"
    assert engine.info(sid)[0].state is State.DESTROYED
    assert _leftovers(engine, sid) == ([], {})
    assert not (engine.runtime / "sandboxes" / sid).exists()


@pytest.mark.parametrize("tier,memory", [("container", False), ("gvisor", True)])
def test_pause_and_resume_keep_the_workspace_and_its_quota(home, runc_ready, tier, memory):
    """gVisor: a memory snapshot (/workspace tarred on the host as its owner, unpacked into the
    new sandbox's disk); container: a file snapshot (tarred in the guest)."""
    engine = require_tier(home, tier)
    sb = Sandbox.create(tier=tier, timeout=300, pool=False, template="shell", limits=QUOTA)
    try:
        sb.commands.run(
            "mkdir -p /workspace/d && head -c 5000000 /dev/urandom > /workspace/d/blob && "
            "ln -s /etc/passwd /workspace/link && echo kept > /workspace/kept.txt",
            timeout=60,
        )
        digest = sb.commands.run("sha256sum /workspace/d/blob").stdout.split()[0]
        ref = sb.pause(memory=memory)
        assert _leftovers(engine, sb.sandbox_id) == ([], {})  # paused: nothing held
        with Sandbox.resume(sb.sandbox_id, timeout=120) as back:
            assert back.files.read("/workspace/kept.txt") == "kept\n"
            r = back.commands.run(
                "sha256sum /workspace/d/blob; readlink /workspace/link; "
                "df -m /workspace | tail -1; stat -c '%U %a' /workspace"
            )
            lines = r.stdout.split("\n")
            assert lines[0].split()[0] == digest and lines[1] == "/etc/passwd", r.stdout
            assert 48 <= int(lines[2].split()[1]) <= 64 and lines[3] == "user 700", r.stdout
            r = back.commands.run(
                f"dd if=/dev/zero of=/workspace/fill bs=1M count={DD_BOUND_MB} 2>&1; echo rc=$?", timeout=120
            )
            assert "No space left on device" in r.stdout and "rc=1" in r.stdout, r.stdout
            new_id = back.sandbox_id
            assert _leftovers(engine, new_id)[0]
        assert _leftovers(engine, new_id) == ([], {})
        assert ref.snapshot_id
    finally:
        if engine.info(sb.sandbox_id)[0].state is not State.DESTROYED:
            asyncio.run(teardown.destroy(engine, sb.sandbox_id, "test cleanup"))


@pytest.mark.parametrize("tier,memory", [("container", False), ("gvisor", True)])
def test_a_snapshot_larger_than_its_new_disk_is_a_typed_error(home, runc_ready, tier, memory):
    """A snapshot comes back with its sandbox's limits; one whose files do not fit them (a
    manifest with a smaller disk_mb, as a snapshot of another warmbox could be) is NoSpace,
    and the sandbox made for it is gone. Clearly too big: refused before any sandbox exists."""
    import dataclasses

    from warmbox.engine import snapstore
    from warmbox.storage import snapshots as snaps

    engine = require_tier(home, tier)
    sb = Sandbox.create(tier=tier, timeout=300, pool=False, template="shell", limits=QUOTA)
    try:
        sb.commands.run("head -c 40000000 /dev/urandom > /workspace/blob", timeout=60)
        ref = sb.pause(memory=True) if memory else sb.snapshot()
    finally:
        if engine.info(sb.sandbox_id)[0].state is not State.PAUSED:
            sb.kill()
    store = snapstore.store_for(engine)
    m = snaps.load_manifest(store, ref.snapshot_id, snapstore.workdir(engine))
    # 40 MB of files: more than a 32 MiB disk holds (found unpacking), far more than 16 MiB (up front;
    # a file snapshot also holds /tmp and /home/user, so only its unpacking can tell)
    cases = [(32, 1)] + ([(16, 0)] if memory else [])
    try:
        for disk_mb, sandboxes in cases:
            forged = dataclasses.replace(m, snapshot_id=snaps.new_snapshot_id(), disk_mb=disk_mb)
            snaps.save_manifest(store, forged, snapstore.workdir(engine))
            before = {i.sandbox_id for i in engine.list(include_dead=True)}
            try:
                with pytest.raises(NoSpace, match=f"limits.disk_mb = {disk_mb}"):
                    Sandbox.create(from_snapshot=forged.snapshot_id, timeout=60)
            finally:
                snapstore.delete(engine, forged.snapshot_id)
            made = [i for i in engine.list(include_dead=True) if i.sandbox_id not in before and not i.pool]
            assert len(made) == sandboxes and all(i.state is State.DESTROYED for i in made), made
            for i in made:
                assert _leftovers(engine, i.sandbox_id) == ([], {})
        with Sandbox.create(from_snapshot=ref, timeout=120) as again:  # its own disk: fits
            assert again.commands.run("stat -c %s /workspace/blob").stdout == "40000000\n"
    finally:
        if engine.info(sb.sandbox_id)[0].state is State.PAUSED:
            asyncio.run(teardown.destroy(engine, sb.sandbox_id, "test cleanup"))


_KILLED_CREATOR = textwrap.dedent("""
    import os, sys
    from warmbox import Limits, Sandbox
    from warmbox.backends import gvisor, runc

    async def die(self, handle, ready):  # the workspace disk is mounted: the creator dies here
        print(handle.sandbox_id, flush=True)
        os.kill(os.getpid(), 9)

    runc.RuncBackend.start = gvisor.GvisorBackend.start = die
    Sandbox.create(tier=sys.argv[1], pool=False, template="shell", limits=Limits(disk_mb=64), timeout=60)
""")


def test_a_creator_killed_with_the_disk_mounted_leaves_nothing_once_reaped(home, tier):
    engine = require_tier(home, tier)
    r = subprocess.run(
        [sys.executable, "-c", _KILLED_CREATOR, tier],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert r.returncode == -9, r.stderr[-2000:]
    sid = r.stdout.split()[0]
    if not _leftovers(engine, sid)[0]:
        # the session's pool daemon reaps orphans too, and on a loaded host it can get there before
        # this line (CI, 2026-12-05): then its teardown unmounted the disk and is about to end the
        # row (it unmounts first), and nothing may be left
        wait_for(lambda: engine.info(sid)[0].state is State.DESTROYED, 60, "the daemon's teardown to end the row", 0.1)

    def reaped() -> bool:
        try:
            asyncio.run(duties.reap(engine))
        except Exception:
            pass  # the daemon may be reaping it at the same time
        return engine.info(sid)[0].state is State.DESTROYED

    wait_for(reaped, 60, "the reaper to destroy the orphan")
    assert _leftovers(engine, sid) == ([], {})
    assert not (engine.runtime / "sandboxes" / sid).exists()


def test_teardown_is_idempotent_removes_stacked_mounts_and_never_a_busy_one(home, runc_ready):
    """release() unmounts whatever is stacked on the workspace and is a no-op the second time; a
    mount still busy makes it fail (the sandbox's teardown then fails and is retried), and the
    tree under it is left alone."""
    engine = require_tier(home, "container")
    cache = engine.backend("container").disk_cache()
    state = engine.runtime / "test-release"
    state.mkdir(parents=True, mode=0o711)
    try:
        workspace_disk.attach(state, cache, 32, 0, 0)
        workspace_disk.attach(state, cache, 32, 0, 0)  # a repeated create: still one filesystem
        assert workspace_disk.mounts_under(state) == [str(state / "workspace")]
        (state / "workspace" / "kept").write_text("x")
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "stacked", str(state / "workspace")], check=True)
        assert workspace_disk.mounts_under(state) == [str(state / "workspace")] * 2
        busy = os.open(state / "workspace", os.O_RDONLY | os.O_DIRECTORY)  # holds the top mount
        try:
            with pytest.raises(OSError):
                workspace_disk.release(state, timeout=0.2)
            assert workspace_disk.mounts_under(state) == [str(state / "workspace")] * 2
        finally:
            os.close(busy)
        assert workspace_disk.release(state) == []
        assert workspace_disk.release(state) == []  # again: nothing to do
        assert workspace_disk.mounts_under(state) == [] and workspace_disk.loops_backed_by(state) == {}
        assert not (state / "workspace" / "kept").exists()  # that was on the disk, gone with it
    finally:
        try:
            workspace_disk.release(state)
        finally:
            subprocess.run(["rm", "-rf", "--one-file-system", str(state)], check=False)


# ---- limits: the admin maximum, the host's size and its free space


def test_disk_limits_are_checked_against_the_maximum_and_the_free_space(home, runc_ready):
    host = config.HostCapacity(memory_mb=8192, cpus=4, pids=32768, open_files=1 << 20, disk_mb=100_000)
    m = config.parse({}, host=host).limits
    assert m.max_disk_mb == 100_000 and "size of the disk" in m.sources["max_disk_mb"]
    m.check(Limits())
    with pytest.raises(LimitTooHigh, match=r"limits.disk_mb = 100001 is above \[limits\] max_disk_mb = 100000"):
        m.check(Limits(disk_mb=100_001))
    m = config.parse({"limits": {"max_disk_mb": 2048}}, "/etc/wb.toml", host=host).limits
    with pytest.raises(LimitTooHigh, match=r"max_disk_mb = 2048 MiB \(/etc/wb.toml \[limits\] max_disk_mb\)") as e:
        m.check(Limits(disk_mb=4096))
    assert (e.value.limit, e.value.value, e.value.maximum) == ("disk_mb", 4096, 2048)
    with pytest.raises(InvalidArgument, match=r"limits\.disk_mb must be > 15"):
        Limits(disk_mb=15)
    # through the engine: refused before any row or directory exists
    engine = require_tier(home, "container")
    before = {i.sandbox_id for i in engine.list(include_dead=True)}
    set_config(home, "\n[limits]\nmax_disk_mb = 10240\n")  # the session's pool keeps the default disk
    try:
        with pytest.raises(LimitTooHigh, match=r"disk_mb = 10241 is above \[limits\] max_disk_mb = 10240"):
            Sandbox.create(limits=Limits(disk_mb=10241), timeout=60)
    finally:
        set_config(home)
    # a disk the host could not give: more than is free where the sandboxes live (less a reserve)
    st = os.statvfs(engine.runtime)
    free_mb, total_mb = st.f_bavail * st.f_frsize >> 20, st.f_blocks * st.f_frsize >> 20
    ask = min(total_mb, free_mb - config.disk_reserve_mb(total_mb) + 1024)
    with pytest.raises(LimitTooHigh, match=r"limits.disk_mb = \d+ is above the free space of the disk holding"):
        Sandbox.create(limits=Limits(disk_mb=ask), timeout=60)
    assert {i.sandbox_id for i in engine.list(include_dead=True)} == before


# ---- microVM: the size of its virtual disk is the quota (one VM at a time; TCG here)


def test_microvm_workspace_is_a_disk_of_its_quota(home, runc_ready):
    """The template of the shape is booted with an empty ext4 of disk_mb as its disk's backing:
    the guest's filesystem ends there, and the qcow2 on the host never grows past it."""
    from tests.backends.conftest import qemu_pids

    engine = require_tier(home, "microvm")
    with Sandbox.create(tier="microvm", timeout=600, limits=Limits(memory_mb=256, pids=128, disk_mb=64)) as sb:
        r = sb.commands.run("df -m /workspace | tail -1", timeout=60)
        assert 48 <= int(r.stdout.split()[1]) <= 64, r.stdout
        r = sb.commands.run(
            f"dd if=/dev/zero of=/workspace/fill bs=1M count={DD_BOUND_MB} 2>&1; echo rc=$?; "
            "sync; stat -c %s /workspace/fill",
            timeout=300,
        )
        assert "No space left on device" in r.stdout and "rc=1" in r.stdout, r.stdout
        assert 40 << 20 <= int(r.stdout.split()[-1]) <= 64 << 20, r.stdout
        with pytest.raises(NoSpace):
            sb.files.write("/workspace/big.bin", b"\0" * (100 << 20))
        assert sb.commands.run("echo alive", timeout=60).stdout == "alive\n"
        disk = engine.runtime / "sandboxes" / sb.sandbox_id / "workspace" / "disk.qcow2"
        assert disk.stat().st_blocks * 512 <= (64 + 4) << 20  # the overlay: data + qcow2 metadata
    left = qemu_pids(engine.runtime)
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"QEMU or relay processes left behind: {left}"
