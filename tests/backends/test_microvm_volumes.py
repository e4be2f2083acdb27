"""Named volumes on the microVM tier: a volume disk per slot, mounted by the guest's root helper.

Under TCG (run under ``flock /work/vm.lock``). At most one VM runs at a time here; the container
sandboxes beside it share the volume the way the sharing rule allows (ext4 is not a shared
filesystem: a microVM's read-write volume is its alone, read-only ones are shared).
"""

from __future__ import annotations

import json
import secrets

import pytest

from tests.backends.conftest import qemu_pids
from warmbox import Limits, Sandbox, Volume
from warmbox.backends import workspace_disk
from warmbox.errors import PathPermissionDenied, SandboxStartError, VolumeInUse

LIMITS = Limits(memory_mb=224, pids=64, tmp_mb=64)  # a shape of its own: test_microvm times its first template
pytestmark = pytest.mark.sandbox


@pytest.fixture
def volume(engine):
    name = "mv" + secrets.token_hex(4)
    Sandbox.create_volume(name, 64, home=engine.home)
    yield name
    Sandbox.delete_volume(name, home=engine.home)
    assert not workspace_disk.loops_backed_by(engine.home / "volumes")


def test_a_microvm_mounts_a_volume_alone_read_write_and_the_next_sandbox_reads_it(engine, volume):
    home = engine.home
    with Sandbox.create(
        tier="microvm", timeout=300, limits=LIMITS, home=home, volumes=[Volume(volume, "/workspace/data")]
    ) as vm:
        r = vm.commands.run(
            "id -u; stat -c '%u %a' /workspace/data; echo from-vm > /workspace/data/f; mkdir /workspace/data/d; "
            "grep ' /workspace/data ' /proc/self/mountinfo"
        )
        lines = r.stdout.splitlines()
        assert lines[:2] == ["1000", "1000 755"], r.stdout + r.stderr
        assert "rw," in lines[2] and "nosuid" in lines[2] and "nodev" in lines[2], lines[2]
        # its own disk: no other sandbox may mount it meanwhile, read-only neither
        for ro in (False, True):
            with pytest.raises(VolumeInUse):
                Sandbox.create(
                    tier="container", pool=False, template="shell", home=home, volumes=[Volume(volume, "/d", ro)]
                )
        with pytest.raises(VolumeInUse):
            Sandbox.delete_volume(volume, home=home)
        # pause and resume (memory): the guest still has it mounted, writes still reach it
        vm.pause(memory=True)
        vm2 = Sandbox.connect(vm.sandbox_id, home=home)
        r = vm2.commands.run("cat /workspace/data/f; echo after-resume >> /workspace/data/f; sync")
        assert r.stdout.split() == ["from-vm"], r.stdout + r.stderr
        vm2.kill()
    assert not qemu_pids(engine.runtime)
    with Sandbox.create(
        tier="container", pool=False, template="shell", home=home, volumes=[Volume(volume, "/data", read_only=True)]
    ) as c:
        r = c.commands.run("cat /data/f; stat -c %U /data/f /data/d")
        assert r.stdout.split() == ["from-vm", "after-resume", "user", "user"], r.stdout + r.stderr


def test_a_read_only_volume_is_shared_with_a_microvm_and_refuses_its_writes(engine, volume):
    home = engine.home
    with Sandbox.create(tier="container", pool=False, template="shell", home=home, volumes=[Volume(volume, "/d")]) as c:
        c.commands.run("echo shared > /d/f")
    with Sandbox.create(
        tier="container", pool=False, template="shell", home=home, volumes=[Volume(volume, "/d", read_only=True)]
    ) as c:
        with Sandbox.create(
            tier="microvm",
            timeout=300,
            limits=LIMITS,
            home=home,
            volumes=[Volume(volume, "/mnt", read_only=True)],
        ) as vm:
            assert vm.commands.run("cat /mnt/f").stdout == "shared\n"
            assert c.commands.run("cat /d/f").stdout == "shared\n"
            with pytest.raises(PathPermissionDenied):
                vm.files.write("/mnt/g", "no")
            r = vm.commands.run("mount -o remount,rw /mnt 2>&1; touch /mnt/g 2>&1; echo rc=$?", user="root")
            assert "rc=1" in r.stdout, r.stdout
            # below the guest kernel too: QEMU has the image read-only (its fds and the drive), so
            # not even a guest root that remounted it could write a byte
            argv = json.loads((engine.runtime / "sandboxes" / vm.sandbox_id / "qemu.argv").read_text())
            drive = next(a for a in argv if a.startswith("id=vol0,"))
            assert "readonly=on" in drive, drive
    assert not qemu_pids(engine.runtime)


def test_a_mount_point_the_read_only_root_image_lacks_is_a_clear_error(engine, volume):
    with pytest.raises(SandboxStartError, match="mount point"):
        Sandbox.create(
            tier="microvm", timeout=60, limits=LIMITS, home=engine.home, volumes=[Volume(volume, "/nodir/x")]
        )
    assert not qemu_pids(engine.runtime)
