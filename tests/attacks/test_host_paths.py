"""A sandbox cannot make the host (root) write, truncate or chown a host file through a path
it controls: the gVisor agent's /run (a host directory) and memory-snapshot workspace trees."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from pathlib import Path

import pytest

from tests.attacks.conftest import require_tier
from tests.conftest import wait_for
from warmbox import Sandbox, Volume
from warmbox import protocol as p
from warmbox.backends import hostfs
from warmbox.engine import checkpoint
from warmbox.engine import snapshot as snapshots
from warmbox.engine.guest_client import GuestClient
from warmbox.errors import SnapshotUnsupported, StorageError, WarmboxError

pytestmark = pytest.mark.sandbox


@pytest.fixture
def victim():
    """A root-owned host file the sandbox must never be able to touch."""
    path = Path(f"/tmp/wbt-victim-{secrets.token_hex(4)}")
    path.write_text("host data\n")
    os.chmod(path, 0o600)
    yield path
    path.unlink(missing_ok=True)


def _untouched(path: Path) -> None:
    st = path.stat()
    assert path.read_text() == "host data\n", "the host truncated or rewrote a file named by the guest"
    assert (st.st_uid, st.st_gid) == (0, 0), f"the host chowned a file named by the guest to {st.st_uid}"


def test_resume_trigger_never_follows_a_planted_symlink(home, runc_ready, victim):
    """Red-team breach: when a checkpoint failed, the host told the quiesced agent to listen
    again by writing and chowning /run/resume as root — and the guest had made it a symlink
    to a host file. The same host operation, against a real quiesced agent."""
    engine = require_tier(home, "gvisor")
    with Sandbox.create(tier="gvisor", timeout=300) as sb:
        assert sb.commands.run(f"ln -sfn {victim} /run/resume").exit_code == 0
        _info, handle = engine.info(sb.sandbox_id)

        async def quiesce_then_resume() -> None:
            client = await GuestClient.connect(handle.socket_path, sb.sandbox_id)
            assert isinstance(await client.call(lambda i: p.Quiesce(i), p.Ok), p.Ok)
            await client.close()
            await engine.backend("gvisor").resume_listening(handle)

        asyncio.run(quiesce_then_resume())
        _untouched(victim)
        # the agent listens again
        wait_for(lambda: hostfs.is_socket(Path(handle.socket_path).parent, "agent.sock"), 10, "the agent to listen")
        again = Sandbox.connect(sb.sandbox_id)
        assert again.commands.run("echo alive").stdout == "alive\n"
        _untouched(victim)


def test_pause_with_a_socket_in_workspace_is_refused_and_the_sandbox_lives(home, runc_ready):
    """A unix socket bound in /workspace (a host directory under gVisor) made runsc's checkpoint
    panic and the sandbox die; the pause is now refused before anything stops."""
    require_tier(home, "gvisor")
    with Sandbox.create(tier="gvisor", timeout=300) as sb:
        sb.commands.run(
            "nohup python3 -c 'import socket,time; s=socket.socket(socket.AF_UNIX); "
            's.bind("/workspace/hold.sock"); s.listen(); time.sleep(600)\' >/dev/null 2>&1 &'
        )
        wait_for(lambda: "hold.sock" in sb.commands.run("ls /workspace").stdout, 10, "the socket")
        with pytest.raises(SnapshotUnsupported, match=r"hold\.sock"):
            sb.pause(memory=True)
        assert sb.commands.run("echo alive").stdout == "alive\n"
        assert "hold.sock" in sb.commands.run("ls /workspace").stdout


def test_pause_with_a_socket_in_a_volume_is_refused_and_the_sandbox_lives(home, runc_ready):
    """The sockets are looked for on the host (by find as the tree's owner): a writable volume is a
    host directory too, below /workspace or elsewhere, and a link to a socket is not one."""
    require_tier(home, "gvisor")
    name = f"wbt-{secrets.token_hex(3)}"
    Sandbox.create_volume(name, 32, home=home)
    try:
        sb = Sandbox.create(tier="gvisor", pool=False, home=home, volumes=[Volume(name, "/data")], timeout=300)
        try:
            assert sb.commands.run("mkdir -p /data/deep/er && ln -s /run/agent.sock /workspace/link").exit_code == 0
            sb.commands.run(
                "nohup python3 -c 'import socket,time; s=socket.socket(socket.AF_UNIX); "
                's.bind("/data/deep/er/v.sock"); s.listen(); time.sleep(600)\' >/dev/null 2>&1 &'
            )
            wait_for(lambda: "v.sock" in sb.commands.run("ls /data/deep/er").stdout, 10, "the socket")
            with pytest.raises(SnapshotUnsupported, match=r"/data/deep/er/v\.sock") as e:
                sb.pause(memory=True)
            assert "link" not in str(e.value)
            assert sb.commands.run("echo alive").stdout == "alive\n"
        finally:
            sb.kill()
    finally:
        Sandbox.delete_volume(name, home=home)


def test_restore_races_a_planted_resume_symlink(home, runc_ready, victim):
    """The racier variant: a restored process keeps planting /run/resume while the host tells
    the restored agent to listen again (every resume and fork of a memory snapshot)."""
    require_tier(home, "gvisor")
    sb = Sandbox.create(tier="gvisor", timeout=300)
    try:
        sb.commands.run(
            f"nohup sh -c 'while :; do ln -sfn {victim} /run/resume.x && "
            f"mv -T /run/resume.x /run/resume; done' >/dev/null 2>&1 &"
        )
        time.sleep(0.3)
        sb.pause(memory=True)
        _untouched(victim)
        sb = Sandbox.resume(sb.sandbox_id)
        _untouched(victim)
        assert sb.commands.run("echo alive").stdout == "alive\n"
        _untouched(victim)
    finally:
        with contextlib.suppress(WarmboxError):
            sb.kill()


def test_memory_snapshot_keeps_absolute_symlinks_and_sparse_files(home, runc_ready, victim):
    """A venv (absolute symlinks) and big sparse files survive pause/resume as data: no host
    path is followed, the archive stays small, the links come back as links."""
    engine = require_tier(home, "gvisor")
    sb = Sandbox.create(tier="gvisor", timeout=300)
    try:
        r = sb.commands.run(
            f"cd /workspace && python3 -m venv --without-pip v && ln -s {victim} host-link && "
            "for i in 1 2 3; do truncate -s 1023M sparse$i; done && echo x >> sparse1 && "
            "mkdir d && ln -s /etc/passwd d/abs && ln -s ../v/bin/python3 d/rel"
        )
        assert r.exit_code == 0, r.stderr
        ref = sb.pause(memory=True)
        raw = snapshots.resolve(engine, ref.snapshot_id).filesystem_raw_bytes
        assert raw < 64 << 20, f"sparse files were expanded in the archive: {raw} bytes"
        _untouched(victim)
        sb = Sandbox.resume(sb.sandbox_id)
        r = sb.commands.run(
            "cd /workspace && readlink host-link d/abs d/rel && v/bin/python -c 'print(42)' && "
            "stat -c '%s %b' sparse1 sparse2 && tail -c 2 sparse1"
        )
        assert r.exit_code == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[:4] == [str(victim), "/etc/passwd", "../v/bin/python3", "42"]
        size1 = int(lines[4].split()[0])
        size2 = int(lines[5].split()[0])
        assert size1 == (1023 << 20) + 2 and size2 == 1023 << 20
        # gVisor reports st_blocks = size / 512: look at the host's file (this test only reads it)
        _, handle = engine.info(sb.sandbox_id)
        ws = hostfs.open_dir(Path(handle.state_dir) / "workspace")
        try:
            blocks = os.stat("sparse2", dir_fd=ws, follow_symlinks=False).st_blocks
        finally:
            os.close(ws)
        assert blocks * 512 < 1 << 20, f"a sparse file came back expanded: {blocks * 512} bytes on the host"
        assert lines[6] == "x"
        # the files belong to the sandbox user inside, as before the pause
        assert sb.commands.run("stat -c %u /workspace/sparse1 /workspace/v").stdout.split() == ["1000", "1000"]
        _untouched(victim)
    finally:
        with contextlib.suppress(WarmboxError):
            sb.kill()


def test_memory_snapshot_over_the_cap_is_refused_and_the_sandbox_continues(home, runc_ready, monkeypatch):
    """WARMBOX_SNAPSHOT_MAX_BYTES applies to the host-side workspace tar too; a pause that
    cannot be stored after its checkpoint stopped the runtime continues the sandbox from its
    own image instead of losing it."""
    require_tier(home, "gvisor")
    monkeypatch.setattr(checkpoint, "MAX_SNAPSHOT_BYTES", 8 << 20)
    with Sandbox.create(tier="gvisor", timeout=300) as sb:
        sb.run_code("x = 41")
        assert sb.commands.run("head -c 20M /dev/urandom > /workspace/big").exit_code == 0
        digest = sb.commands.run("md5sum < /workspace/big").stdout
        with pytest.raises(StorageError, match="WARMBOX_SNAPSHOT_MAX_BYTES"):
            sb.pause(memory=True)
        assert sb.run_code("x + 1").text == "42", "the processes did not continue"
        assert sb.commands.run("md5sum < /workspace/big").stdout == digest
