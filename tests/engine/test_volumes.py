"""Named volumes: names, paths and sizes checked; the registry's in-use and sharing rules; and real
sandboxes of the container and gVisor tiers sharing a volume (owners right in each, read-only
refused, its size a hard limit, tenants apart, nothing left mounted after destroy, pause/resume)."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.attacks.conftest import require_tier
from tests.conftest import cli, wait_for
from warmbox import AsyncSandbox, Sandbox, Volume
from warmbox import operations as ops
from warmbox.backends import workspace_disk
from warmbox.engine import duties, volumes
from warmbox.engine.engine import Engine
from warmbox.engine.front import EngineFront
from warmbox.errors import (
    InvalidArgument,
    NoSpace,
    PathPermissionDenied,
    SandboxStartError,
    VolumeError,
    VolumeInUse,
    VolumeNotFound,
)
from warmbox.models import Limits, State, Tenant, validate_volumes
from warmbox.storage.registry import Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger


def _name() -> str:
    return "v" + secrets.token_hex(4)


# ---- no sandbox


@pytest.mark.parametrize(
    "path",
    ["data", "/", "/workspace", "/workspace/", "/proc/x", "/sys", "/dev/shm/x", "/opt/warmbox", "/run", "/a/../b", ""],
)
def test_a_mount_path_outside_what_a_volume_may_cover_is_refused(path):
    with pytest.raises(InvalidArgument):
        validate_volumes([Volume("data", path)])


def test_mount_paths_are_normalised_and_may_not_repeat_or_nest():
    assert validate_volumes([Volume("a", "/data//x/"), Volume("b", "/workspace/in")]) == (
        Volume("a", "/data/x"),
        Volume("b", "/workspace/in"),
    )
    for vols in ([Volume("a", "/data"), Volume("b", "/data/")], [Volume("a", "/data"), Volume("b", "/data/x")]):
        with pytest.raises(InvalidArgument, match="overlaps"):
            validate_volumes(vols)
    for bad in (["x"], [Volume("no/slash", "/d")], [Volume("", "/d")], [Volume("a", "/d", read_only="yes")]):  # type: ignore[list-item, arg-type]
        with pytest.raises(InvalidArgument):
            validate_volumes(bad)


def _registry(tmp: Path) -> Registry:
    return Registry(tmp / "r.db", ledger=UidLedger(tmp / "uids", slots=32, first=MAX_SLOTS - 100))


def _sandbox(reg: Registry, sid: str) -> None:
    reg.sandboxes.allocate(sid, "container", "base", 3600, Limits(), "/nonexistent", "/nonexistent")


def test_registry_volume_in_use_and_the_microvm_sharing_rule(tmp_path):
    reg = _registry(tmp_path)
    reg.volumes.add_volume("", "data", "vol-1", 64, 1.0)
    reg.volumes.add_volume("acme", "data", "vol-2", 64, 1.0)  # the same name, another tenant: another volume
    with pytest.raises(VolumeError, match="exists"):
        reg.volumes.add_volume("", "data", "vol-3", 64, 1.0)
    assert reg.volumes.volume("acme", "data")[0] == "vol-2"
    with pytest.raises(VolumeNotFound):
        reg.volumes.volume("other", "data")
    sids = [f"sb-{i:012x}" for i in range(1, 6)]
    for s in sids:
        _sandbox(reg, s)
    # host mounts share: rw and ro together
    reg.volumes.mount_volumes(sids[0], [("vol-1", "data", "/d", False)], exclusive=False)
    reg.volumes.mount_volumes(sids[1], [("vol-1", "data", "/d", True)], exclusive=False)
    assert reg.volumes.volume_users("vol-1") == sids[:2]
    # a microVM: not beside a read-write mount, not read-write beside anything
    for ro in (True, False):
        with pytest.raises(VolumeInUse):
            reg.volumes.mount_volumes(sids[2], [("vol-1", "data", "/d", ro)], exclusive=True)
    with pytest.raises(VolumeInUse, match=sids[0]):
        reg.volumes.remove_volume("", "data")
    reg.sandboxes.set_state(sids[0], State.DESTROYED, "test")
    reg.volumes.mount_volumes(sids[2], [("vol-1", "data", "/d", True)], exclusive=True)  # read-only beside read-only
    reg.sandboxes.set_state(sids[1], State.DESTROYED, "test")
    reg.sandboxes.set_state(sids[2], State.DESTROYED, "test")
    reg.volumes.mount_volumes(sids[3], [("vol-1", "data", "/d", False)], exclusive=True)  # alone: read-write
    with pytest.raises(VolumeInUse):  # and then no host mount either
        reg.volumes.mount_volumes(sids[4], [("vol-1", "data", "/d", True)], exclusive=False)
    reg.sandboxes.set_state(sids[3], State.DESTROYED, "test")
    assert reg.volumes.remove_volume("", "data") == "vol-1"
    with pytest.raises(VolumeNotFound):  # deleted between a create's lookup and its record
        reg.volumes.mount_volumes(sids[4], [("vol-1", "data", "/d", True)], exclusive=False)
    assert reg.volumes.volumes_of(sids[0]) == [("", "vol-1", "/d", False)]


def test_a_refused_mount_at_allocate_leaves_no_row_and_no_slot(tmp_path):
    """Mounts are written in allocate's transaction: VolumeInUse or VolumeNotFound there leaves no
    sandbox row (not even a destroyed one) and its uid slot free; a resume refused so stays paused."""
    reg = _registry(tmp_path)
    reg.volumes.add_volume("", "data", "vol-1", 64, 1.0)
    rw = [("vol-1", "data", "/d", False)]
    reg.sandboxes.allocate("sb-000000000001", "container", "base", 3600, Limits(), "/n", "/n", mounts=rw)
    assert reg.volumes.volume_users("vol-1") == ["sb-000000000001"]
    ledger = UidLedger(tmp_path / "uids", slots=32, first=MAX_SLOTS - 100)
    held = ledger.held()
    for mounts, error in ((rw, VolumeInUse), ([("vol-9", "gone", "/d", False)], VolumeNotFound)):
        with pytest.raises(error):
            reg.sandboxes.allocate(
                "sb-000000000003", "microvm", "base", 3600, Limits(), "/n", "/n", mounts=mounts, exclusive_mounts=True
            )
        assert all(i.sandbox_id != "sb-000000000003" for i, _ in reg.sandboxes.list(include_dead=True))
        assert ledger.held() == held  # the slot it took went back to the ledger
    reg.sandboxes.allocate("sb-000000000004", "container", "base", 3600, Limits(), "/n", "/n")
    reg.sandboxes.set_state("sb-000000000004", State.PAUSED, "paused")
    with pytest.raises(VolumeInUse):
        reg.sandboxes.reallocate("sb-000000000004", 60.0, Limits(), mounts=rw, exclusive_mounts=True)
    assert reg.sandboxes.get("sb-000000000004")[0].state is State.PAUSED
    assert reg.volumes.volumes_of("sb-000000000004") == []


def test_a_volume_image_is_a_sparse_ext4_of_its_size_owned_by_the_sandbox_user(tmp_path):
    engine = Engine(tmp_path / "home")
    info = asyncio.run(volumes.create(engine, "", "data", 64))
    disk = volumes.disk_of_name(engine, "", "data")
    assert disk.stat().st_size == 64 << 20 and disk.stat().st_mode & 0o777 == 0o600
    assert info.allocated_mb < 8, "the image is not sparse"
    r = subprocess.run(["debugfs", "-R", "stat /", str(disk)], capture_output=True, text=True, check=True)
    assert "User:  1000   Group:  1000" in r.stdout, r.stdout
    with pytest.raises(VolumeError, match="exists"):
        asyncio.run(volumes.create(engine, "", "data", 64))
    assert sorted(p.name for p in disk.parent.iterdir()) == [disk.name]  # no second image was made
    for bad in (0, 15, 1 << 21, "1G", True):
        with pytest.raises(InvalidArgument):
            asyncio.run(volumes.create(engine, "", "other", bad))
    volumes.delete(engine, "", "data")
    assert not disk.exists() and volumes.list(engine, "") == []


# ---- real volumes and sandboxes


def _loops(engine: Engine) -> dict[int, str]:
    return workspace_disk.loops_backed_by(engine.home / "volumes")


def _mounts(engine: Engine, sandbox_id: str) -> list[str]:
    return workspace_disk.mounts_under(engine.runtime / "sandboxes" / sandbox_id)


@pytest.fixture(params=["container", "gvisor"])
def tier(request, home, runc_ready) -> str:
    require_tier(home, request.param)
    return request.param


@pytest.mark.sandbox
def test_a_volume_is_shared_by_sandboxes_with_the_right_owners_and_left_unmounted(home, tier):
    engine = Engine.for_home(home)
    name = _name()
    info = Sandbox.create_volume(name, 64, home=home)
    assert info.size_mb == 64 and info.tenant == "" and info.mounted_by == ()
    disk = volumes.disk_of_name(engine, "", name)
    assert disk.stat().st_blocks * 512 < 8 << 20, "the image is not sparse"
    try:
        with Sandbox.create(tier=tier, pool=False, template="shell", home=home, volumes=[Volume(name, "/data")]) as a:
            r = a.commands.run("id -u; stat -c '%u %a' /data; echo hi > /data/f; mkdir /data/d; stat -c %u /data/f")
            assert r.stdout.split() == ["1000", "1000", "755", "1000"], r.stdout
            assert Sandbox.get_volume(name, home=home).mounted_by == (a.sandbox_id,)
            with pytest.raises(VolumeInUse):
                Sandbox.delete_volume(name, home=home)
            # a second sandbox (another host uid range) mounts it too, read-only, at the same time
            with Sandbox.create(
                tier=tier, pool=False, template="shell", home=home, volumes=[Volume(name, "/in", read_only=True)]
            ) as b:
                r = b.commands.run("cat /in/f; stat -c '%u %U' /in/f /in/d")
                assert r.stdout.split() == ["hi", "1000", "user", "1000", "user"], r.stdout
                with pytest.raises(PathPermissionDenied):
                    b.files.write("/in/g", "no")
                r = b.commands.run("touch /in/g 2>&1; echo rc=$?")
                assert "Read-only file system" in r.stdout and "rc=1" in r.stdout, r.stdout
                b_id = b.sandbox_id
            assert not _mounts(engine, b_id)
            a_id = a.sandbox_id
        assert not _mounts(engine, a_id)
        assert not _loops(engine), "a loop device outlived every mount of the volume"
        # a later sandbox sees what the first wrote, as its own user's
        with Sandbox.create(tier=tier, pool=False, template="shell", home=home, volumes=[Volume(name, "/data")]) as c:
            r = c.commands.run("cat /data/f; echo more >> /data/f; stat -c %U /data/f")
            assert r.stdout.split() == ["hi", "user"], r.stdout
    finally:
        Sandbox.delete_volume(name, home=home)
    assert not disk.exists()
    assert not _loops(engine)


@pytest.mark.sandbox
def test_a_full_volume_is_no_space_and_the_host_gives_no_more(home, runc_ready):
    name = _name()
    Sandbox.create_volume(name, 32, home=home)
    try:
        with Sandbox.create(
            tier="container", pool=False, template="shell", home=home, volumes=[Volume(name, "/workspace/v")]
        ) as sb:
            r = sb.commands.run("dd if=/dev/zero of=/workspace/v/fill bs=1M count=64 2>&1; echo rc=$?", timeout=120)
            assert "No space left on device" in r.stdout and "rc=1" in r.stdout, r.stdout
            with pytest.raises(NoSpace):
                sb.files.write("/workspace/v/more", b"x" * (1 << 20))
            sb.files.write("/workspace/w", b"the workspace is another filesystem")
        assert Sandbox.get_volume(name, home=home).allocated_mb <= 34
    finally:
        Sandbox.delete_volume(name, home=home)


@pytest.mark.sandbox
def test_a_tenant_never_sees_or_mounts_another_tenants_volume(home, runc_ready):
    engine = Engine.for_home(home)
    name = _name()

    async def go() -> None:
        acme, other = EngineFront(engine, Tenant("acme-vol")), EngineFront(engine, Tenant("other-vol"))
        try:
            await acme.handle(ops.VolumeCreate(name, 32))
            assert [v.name for v in await acme.handle(ops.VolumeList())] == [name]
            assert name not in [v.name for v in await other.handle(ops.VolumeList())]
            for req in (ops.VolumeGet(name), ops.VolumeDelete(name)):
                with pytest.raises(VolumeNotFound):
                    await other.handle(req)
            with pytest.raises(VolumeNotFound):
                await other.handle(ops.Create(tier="container", pool=False, volumes=(Volume(name, "/data"),)))
            with pytest.raises(VolumeNotFound):  # the host's own names are not a tenant's either
                await EngineFront(engine).handle(ops.VolumeGet(name))
            assert not [
                i for i, _ in engine.registry.sandboxes.list(tenant="other-vol") if i.state is not State.DESTROYED
            ]
        finally:
            await acme.handle(ops.VolumeDelete(name))

    asyncio.run(go())


@pytest.mark.sandbox
def test_pause_and_resume_mount_the_volume_again_and_snapshots_leave_it_out(home, runc_ready):
    engine = Engine.for_home(home)
    name = _name()
    Sandbox.create_volume(name, 32, home=home)

    async def go() -> None:
        sb = await AsyncSandbox.create(
            tier="container", pool=False, template="shell", home=home, volumes=[Volume(name, "/workspace/vol")]
        )
        try:
            await sb.commands.run("echo kept > /workspace/vol/f; echo ws > /workspace/w")
            ref = await sb.pause()
            assert not _mounts(engine, sb.sandbox_id) and not _loops(engine)
            assert (await AsyncSandbox.get_volume(name, home=home)).mounted_by == (sb.sandbox_id,)
            with pytest.raises(VolumeInUse):  # paused: still its volume
                await AsyncSandbox.delete_volume(name, home=home)
            sb2 = await AsyncSandbox.resume(sb.sandbox_id, home=home)
            try:
                r = await sb2.commands.run("cat /workspace/vol/f /workspace/w; echo new >> /workspace/vol/f")
                assert r.stdout.split() == ["kept", "ws"], r.stdout
                # a fork of the snapshot mounts the volume too; the snapshot itself never held its files
                fork = await AsyncSandbox.create(from_snapshot=ref, home=home)
                try:
                    r = await fork.commands.run("cat /workspace/vol/f")
                    assert r.stdout.split() == ["kept", "new"], r.stdout
                finally:
                    await fork.kill()
            finally:
                await sb2.kill()
        finally:
            await sb.kill()
        await AsyncSandbox.delete_volume(name, home=home)

    asyncio.run(go())
    assert not _loops(engine)


@pytest.mark.sandbox
def test_warmbox_volume_cli(runc_ready):
    name = _name()
    r = cli("volume", "create", name, "--size", "48M")
    assert r.returncode == 0 and f"volume {name}: 48 MiB" in r.stdout, r.stderr
    assert cli("volume", "create", name, "--size", "48M").returncode == 125
    assert cli("volume", "create", "x", "--size", "lots").returncode == 125
    r = cli("run", "--no-pool", "--template", "shell", "-v", f"{name}:/data:ro", "--", "stat", "-c", "%U", "/data")
    assert r.returncode == 0 and r.stdout.strip() == "user", r.stderr
    r = cli("volume", "ls")
    assert name in r.stdout and "48M" in r.stdout
    r = cli("volume", "rm", name)
    assert r.returncode == 0, r.stderr
    r = cli("volume", "show", name)
    assert r.returncode == 125 and "no volume named" in r.stderr


_KILLED_CREATOR = textwrap.dedent("""
    import os, sys
    from warmbox import Sandbox, Volume
    from warmbox.backends import gvisor, runc

    async def die(self, handle, ready):  # the volume is mounted: the creator dies here
        print(handle.sandbox_id, flush=True)
        os.kill(os.getpid(), 9)

    runc.RuncBackend.start = gvisor.GvisorBackend.start = die
    Sandbox.create(tier=sys.argv[1], pool=False, template="shell", timeout=60, volumes=[Volume(sys.argv[2], "/data")])
""")


@pytest.mark.sandbox
def test_a_creator_killed_with_a_volume_mounted_leaves_no_mount_once_reaped(home, tier):
    """The daemon's crash recovery (reap: the backend's destroy) unmounts the volume; the
    volume is in use until then, and its loop device goes with its last mount."""
    engine = Engine.for_home(home)
    name = _name()
    Sandbox.create_volume(name, 32, home=home)
    try:
        r = subprocess.run(
            [sys.executable, "-c", _KILLED_CREATOR, tier, name],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert r.returncode == -9, r.stderr[-2000:]
        sid = r.stdout.split()[0]
        assert _mounts(engine, sid) and _loops(engine), "the volume was not mounted when the creator died"
        with pytest.raises(VolumeInUse):
            Sandbox.delete_volume(name, home=home)

        def reaped() -> bool:
            try:
                asyncio.run(duties.reap(engine))
            except Exception:
                pass  # the daemon may be reaping it at the same time
            return engine.info(sid)[0].state is State.DESTROYED

        wait_for(reaped, 60, "the reaper to destroy the orphan")
        assert not _mounts(engine, sid) and not _loops(engine)
    finally:
        Sandbox.delete_volume(name, home=home)


@pytest.mark.sandbox
def test_a_failed_create_unmounts_what_it_mounted_and_an_image_link_is_never_followed(home, runc_ready):
    """Two volumes, the second's mount point in the image is a symlink (/bin -> usr/bin on Debian):
    the create fails with a typed error before the runtime runs, the first volume is unmounted, and
    nothing was made where the link points."""
    engine = Engine.for_home(home)
    a, b = _name(), _name()
    for n in (a, b):
        Sandbox.create_volume(n, 32, home=home)
    try:
        before = {i.sandbox_id for i, _ in engine.registry.sandboxes.list(include_dead=True)}
        with pytest.raises(SandboxStartError, match="not a directory"):
            Sandbox.create(
                tier="container",
                pool=False,
                template="shell",
                home=home,
                volumes=[Volume(a, "/workspace/a"), Volume(b, "/bin/vol")],
            )
        assert not Path("/usr/bin/vol").exists()
        failed = [i for i, _ in engine.registry.sandboxes.list(include_dead=True) if i.sandbox_id not in before]
        assert failed and all(i.state is State.DESTROYED for i in failed)
        assert not any(_mounts(engine, i.sandbox_id) for i in failed) and not _loops(engine)
        assert Sandbox.get_volume(a, home=home).mounted_by == ()
    finally:
        for n in (a, b):
            Sandbox.delete_volume(n, home=home)


@pytest.mark.sandbox
def test_a_gvisor_memory_pause_keeps_its_processes_and_mounts_the_volume_again(home, runc_ready):
    require_tier(home, "gvisor")
    engine = Engine.for_home(home)
    name = _name()
    Sandbox.create_volume(name, 32, home=home)
    try:
        sb = Sandbox.create(tier="gvisor", pool=False, home=home, volumes=[Volume(name, "/data")])
        try:
            sb.commands.run("echo before > /data/f")
            # the code context's process holds a file of the volume open across the checkpoint
            sb.run_code("f = open('/data/f'); x = 41")
            assert sb.pause(memory=True).memory
            assert not _mounts(engine, sb.sandbox_id) and not _loops(engine)
            back = Sandbox.connect(sb.sandbox_id, home=home)
            assert back.run_code("f.seek(0); (x + 1, f.read().strip())").text == "(42, 'before')"
            r = back.commands.run("echo after >> /data/f; cat /data/f")
            assert r.stdout.split() == ["before", "after"], r.stdout + r.stderr
        finally:
            Sandbox.connect(sb.sandbox_id, home=home).kill()
        assert not _loops(engine)
    finally:
        Sandbox.delete_volume(name, home=home)
