"""Attack: use a shared named volume to reach the host or another sandbox.

A volume is written by one sandbox and mounted by others (and kept by the host between them).
Sandbox A plants symlinks (to ``/``, to a host file), a FIFO and a setuid-looking file in it; then:
- the host never resolves a path inside a volume (it opens the image, the loop device and the
  per-sandbox mount point only): tearing A down and deleting the volume leave the host's files
  the links name untouched;
- sandbox B mounting the volume resolves A's links in its own root (its own /etc/hostname, not
  the host's), and the mount is nosuid/nodev;
- a read-only mount stays read-only: writes fail with EROFS (PathPermissionDenied through the
  files API), and a remount read-write fails, also as the nested root user where the tier offers
  one (the kernel locked the flag when the mount entered the sandbox's user namespace).
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

import pytest

from tests.attacks.conftest import require_tier
from warmbox import Sandbox, Volume
from warmbox.backends import workspace_disk
from warmbox.errors import PathPermissionDenied

pytestmark = pytest.mark.sandbox


def test_links_planted_in_a_volume_reach_neither_the_host_nor_another_sandbox(home, tier, tmp_path):
    engine = require_tier(home, tier)
    name = "atk" + secrets.token_hex(4)
    marker = tmp_path / "host-secret"
    marker.write_text("host only\n")
    marker.chmod(0o644)
    Sandbox.create_volume(name, 32, home=home)
    try:
        with Sandbox.create(tier=tier, pool=False, template="shell", home=home, volumes=[Volume(name, "/data")]) as a:
            r = a.commands.run(
                f"ln -s / /data/root && ln -s {marker} /data/secret && ln -s /etc/hostname /data/hn && "
                "mkfifo /data/fifo && cp /bin/true /data/suid && chmod 4755 /data/suid && echo planted"
            )
            assert "planted" in r.stdout, r.stdout + r.stderr
        with Sandbox.create(
            tier=tier, pool=False, template="shell", home=home, volumes=[Volume(name, "/in", read_only=True)]
        ) as b:
            r = b.commands.run("cat /in/hn; cat /in/secret 2>&1; ls /in/root/ | head -3; echo; cat /etc/hostname")
            lines = r.stdout.split("\n")
            assert lines[0] == lines[-2] and lines[0] != socket.gethostname(), r.stdout  # B's own hostname
            assert "host only" not in r.stdout, "a link in the volume reached the host's file"
            if tier == "container":  # gVisor's mountinfo does not list these options
                opts = b.commands.run("grep ' /in ' /proc/self/mountinfo").stdout
                assert "nosuid" in opts and "nodev" in opts and " ro," in opts, opts
            # the read-only mount stays read-only, even for the nested root where the tier has one
            with pytest.raises(PathPermissionDenied):
                b.files.write("/in/x", "no")
            r = b.commands.run("mount -o remount,rw /in 2>&1; touch /in/x 2>&1; echo rc=$?")
            assert "rc=1" in r.stdout and "Read-only file system" in r.stdout, r.stdout
            if engine.backend(tier).capabilities().root_user:
                r = b.commands.run(
                    "mount -o remount,rw /in 2>&1; mount -o remount,bind,rw /in 2>&1; touch /in/x 2>&1; echo rc=$?",
                    user="root",
                )
                assert "rc=1" in r.stdout and "Read-only file system" in r.stdout, r.stdout
            r = b.commands.run("ls /in")
            assert "x" not in r.stdout.split(), r.stdout
    finally:
        Sandbox.delete_volume(name, home=home)
    assert marker.read_text() == "host only\n" and Path("/etc/hostname").exists()
    assert not workspace_disk.loops_backed_by(engine.home / "volumes")
