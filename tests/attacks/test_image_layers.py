"""Attacks on a template image's layers (container and gVisor tiers; build sandboxes: container).

- A sandbox writing through its root (its own upper layer) fills only that layer's bound (a
  tmpfs charged to the sandbox), never a shared layer: another sandbox of the image does not
  see the write, and the image's files stay unwritable (they are nobody's to the sandbox).
- A build sandbox plants symlinks (absolute and climbing), a hardlink, a FIFO, a socket and tries a
  device node in its upper layer; the layer store's walk (add_tree) follows none of them: the
  links are stored as links, the FIFO and socket are skipped without being opened.
- A sandbox whose creator and then daemon were SIGKILLed while it started leaves no mount: the
  restarted daemon's recovery unmounts its root overlay and tmpfs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.attacks.conftest import home_procs, require_tier
from tests.backends.test_image_root import image_of, launch, sh
from tests.conftest import wait_for
from warmbox.backends import rootfs, workspace_disk
from warmbox.engine import teardown
from warmbox.models import LAYER_UID_BASE, Limits

pytestmark = pytest.mark.sandbox

UPPER_MB = 24


def _fs_type(path: str) -> str:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == path:
                return fields[fields.index("-") + 1]
    return ""


def test_a_sandbox_fills_only_its_own_bounded_layer(tier, home, debian_layer):
    engine = require_tier(home, tier)
    image = image_of(debian_layer)
    limits = Limits(tmp_mb=UPPER_MB)

    async def go():
        a = await launch(engine, tier, image, limits=limits)
        b = await launch(engine, tier, image, limits=limits)
        try:
            state = a.handle.state_dir
            assert _fs_type(os.path.join(state, rootfs.RW)) == "tmpfs"  # the upper layer: not the host's disk
            rc, out = await sh(a, "dd if=/dev/zero of=/var/tmp/fill bs=1M count=200 2>&1; du -m /var/tmp/fill")
            assert rc == 0 or "No space left" in out, out
            assert "No space left on device" in out, out
            assert int(out.splitlines()[-1].split()[0]) <= UPPER_MB, out
            # the shared layers: read-only to the sandbox, and untouched
            rc, out = await sh(a, "echo x >> /etc/os-release; echo x > /usr/bin/python3; rm -f /usr/bin/ls; echo rc=$?")
            assert "Permission denied" in out and os.path.exists(os.path.join(debian_layer, "usr/bin/ls")), out
            rc, out = await sh(a, "ls /var/tmp; cat /etc/os-release | tail -1")
            assert "fill" in out and not out.endswith("\nx")
            assert not os.path.exists(os.path.join(debian_layer, "var/tmp/fill"))
            rc, out = await sh(b, "ls -A /var/tmp; echo end")
            assert out == "end", out  # the other sandbox of the image does not see it
            # the full layer of one does not stop the other
            rc, out = await sh(b, "echo fine > /var/tmp/mine && cat /var/tmp/mine")
            assert (rc, out) == (0, "fine")
        finally:
            for got in (a, b):
                await got.session.close()
                await teardown.destroy(engine, got.sandbox_id, "test over")
        for got in (a, b):
            assert workspace_disk.mounts_under(got.handle.state_dir) == []

    asyncio.run(go())


def test_planted_links_fifos_and_devices_in_a_build_layer_are_not_followed(home, runc_ready, debian_layer, tmp_path):
    from warmbox.storage.layers import LayerStore

    engine = require_tier(home, "container")
    upper = tmp_path / "upper"
    upper.mkdir()
    secret = tmp_path / "host-secret"
    secret.write_text("HOST SECRET\n")
    secret.chmod(0o600)

    async def go():
        got = await launch(engine, "container", image_of(debian_layer), build_upper=str(upper))
        try:
            rc, out = await sh(
                got,
                f"mkdir -p /srv/p && cd /srv/p && ln -s {secret} abs && ln -s ../../../../../../{secret} climb && "
                "ln -s /etc/shadow shadow && ln /etc/passwd hard && mkfifo fifo && "
                "python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"/srv/p/sock\")' && "
                "(mknod dev c 1 3 2>&1 || true); ls -l /srv/p",
            )
            assert rc == 0, out
            assert "Operation not permitted" in out, out  # no device node, even as the build's root
        finally:
            await got.session.close()
            await teardown.destroy(engine, got.sandbox_id, "test over")

    asyncio.run(go())
    planted = upper / "srv/p"
    assert {p.name for p in planted.iterdir()} == {"abs", "climb", "shadow", "hard", "fifo", "sock"}
    store = LayerStore(tmp_path / "cache")
    # a FIFO opened by the walk would block it: bounded here
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        info = pool.submit(store.add_tree, upper, owner_base=LAYER_UID_BASE).result(timeout=120)
    out = Path(info.path) / "srv/p"
    assert os.readlink(out / "abs") == str(secret) and os.path.islink(out / "climb")
    assert os.readlink(out / "shadow") == "/etc/shadow"
    assert not (out / "fifo").exists() and not (out / "sock").exists() and not (out / "dev").exists()
    assert (out / "hard").read_text() == (Path(debian_layer) / "etc/passwd").read_text()
    for parent, _, files in os.walk(info.path):
        for n in files:
            p = os.path.join(parent, n)
            if os.path.isfile(p) and not os.path.islink(p) and os.path.getsize(p) < 4096:
                assert b"HOST SECRET" not in Path(p).read_bytes(), p


def test_a_killed_creator_and_daemon_leave_no_mount(private_home, debian_layer, tmp_path):
    engine = private_home
    h = engine.home
    code = (
        "import asyncio, sys\n"
        "from warmbox.config import Template\n"
        "from warmbox.engine import provision\n"
        "from warmbox.engine.engine import Engine\n"
        "from warmbox.engine.start import StartRecord\n"
        "from warmbox.models import ImageRef, Limits\n"
        f"e = Engine.for_home({str(h)!r})\n"
        "t = Template('slow', warmup_code=None, warmup_commands=('sleep 300',))\n"
        f"img = ImageRef('test', 1, 'sha256:' + 'cd' * 32, ({debian_layer!r},))\n"
        "rec = StartRecord.internal('container', 'slow', 600, Limits())\n"
        "asyncio.run(provision.launch(e, provision.LaunchSpec(rec, image=img), provision.Cold(t)))\n"
    )
    creator = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "WARMBOX_HOME": str(h)})
    try:
        sandboxes = engine.runtime / "sandboxes"

        def mounted() -> list[str]:
            return [m for m in workspace_disk.mounts_under(sandboxes) if m.endswith("/" + rootfs.ROOT)]

        root = wait_for(mounted, 60, "the creator's sandbox root to be mounted")[0]
        state = os.path.dirname(root)
        wait_for(lambda: any(b"sleep" in p for p in _cmdlines_in(state)), 60, "the warm-up to run")
        daemon = wait_for(lambda: home_procs(h, b"warmbox.engine.daemon"), 10, "the daemon to run")
        creator.kill()
        creator.wait()
        os.kill(daemon[0], signal.SIGKILL)
        # the guard restarts the daemon, whose reaper destroys the creation of a dead creator
        wait_for(lambda: not workspace_disk.mounts_under(state), 60, "the recovery to unmount the root")
        wait_for(lambda: not os.path.exists(state), 30, "the state dir to go")
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.wait()


def _cmdlines_in(state: str) -> list[bytes]:
    """Command lines of the processes of the sandbox whose state dir is ``state`` (its cgroup)."""
    from warmbox.backends._host import SandboxCgroup

    out = []
    for pid in SandboxCgroup(os.path.basename(state)).members():
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            pass
    return out
