"""Directory upload/download as tar streams: an archive from either side lands inside its target.

Upload: a hostile API client sends crafted tars (absolute names, '..', symlinks and hardlinks out,
devices, FIFOs, a write through a link the sandbox user planted) to files.upload_dir; the agent
refuses each with UnsafeArchive and nothing appears outside the target in the sandbox.
Download: a hostile sandbox sends links out of the directory (and, as a compromised agent would,
crafted tars) to files.download_dir; the host refuses them and writes nothing outside the local
directory, never through a symlink planted there.
"""

from __future__ import annotations

import asyncio
import io
import os
import tarfile

import pytest

from tests.attacks.conftest import require_tier
from warmbox import Sandbox, UnsafeArchive
from warmbox import operations as ops
from warmbox.engine.front import EngineFront
from warmbox.sdk.files import unpack_stream

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(300)]


def _m(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes = b"pwned\n") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    if kind == tarfile.CHRTYPE:
        info.devmajor, info.devminor = 1, 3  # /dev/null's numbers
    return info, data if kind == tarfile.REGTYPE else None


def _tar(*members: tuple) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


# (what it tries, the archive, what the refusal names)
ATTACKS = [
    ("absolute name", _tar(_m("ok.txt"), _m("/tmp/abs-pwned")), "absolute"),
    ("dot-dot", _tar(_m("../dotdot-pwned")), r"'\.\.'"),
    ("deep dot-dot", _tar(_m("a/b/../../../deep-pwned")), r"'\.\.'"),
    ("symlink out, then write through it", _tar(_m("esc", tarfile.SYMTYPE, "/tmp"), _m("esc/link-pwned")), "out"),
    ("relative symlink out", _tar(_m("d/esc", tarfile.SYMTYPE, "../../tmp")), "out"),
    ("hardlink to a host-side file", _tar(_m("h", tarfile.LNKTYPE, "/etc/passwd")), "absolute"),
    ("hardlink out", _tar(_m("h", tarfile.LNKTYPE, "../../etc/passwd")), r"'\.\.'"),
    ("device", _tar(_m("null", tarfile.CHRTYPE)), "device"),
    ("FIFO", _tar(_m("fifo", tarfile.FIFOTYPE)), "FIFO"),
    ("write through a link the sandbox user planted", _tar(_m("planted/planted-pwned")), "not a directory"),
]


async def _chunks(data: bytes):
    for off in range(0, len(data), 64 << 10):
        yield data[off : off + 64 << 10]


def test_crafted_tars_uploaded_into_the_sandbox_are_refused_and_land_nowhere(home, tier):
    engine = require_tier(home, tier)

    async def go() -> None:
        front = EngineFront(engine)
        opened = await front.handle(ops.Create(tier=tier, timeout=300, pool=False))
        sid = opened.info.sandbox_id
        try:

            async def sh(cmd: str) -> str:
                r = await front.handle(ops.Exec(sid, cmd, timeout=30))
                assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
                return r.stdout

            # the sandbox user plants a link in the target, hoping the agent writes through it
            await sh("mkdir -p /workspace/target && ln -s /tmp /workspace/target/planted")
            for what, archive, why in ATTACKS:
                with pytest.raises(UnsafeArchive, match=why):
                    await front.handle(ops.UploadDir(sid, "target", _chunks(archive)))
                    pytest.fail(f"{what}: not refused")
            # one search after all of them: no attack removes files, so a file any of them made is
            # still there (a search of the whole root per attack took 80 s on gVisor's gofer)
            found = await sh("find / -xdev -name '*-pwned' 2>/dev/null; ls -A /tmp /workspace")
            assert "pwned" not in found, found
            assert await sh("cat /etc/passwd | head -1") == "root:x:0:0:root:/root:/usr/sbin/nologin\n"
            listing = (await sh("cd /workspace/target && find . | sort")).split()
            assert listing == [".", "./d", "./ok.txt", "./planted"], (
                listing
            )  # names are checked before anything is made
            # and a good archive still goes in, after all that
            await front.handle(ops.UploadDir(sid, "target", _chunks(_tar(_m("fine/ok2.txt", data=b"ok")))))
            assert await sh("cat /workspace/target/fine/ok2.txt") == "ok"
        finally:
            await front.handle(ops.Kill(sid))
            await front.close()

    asyncio.run(go())


def test_a_link_out_of_a_downloaded_directory_is_refused_on_the_host(home, runc_ready, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    (tmp_path / "victim").mkdir()
    os.symlink(tmp_path / "victim", local / "planted")  # a link already in the local directory
    with Sandbox.create(tier="container", timeout=300, home=home) as sb:
        sb.commands.run("mkdir -p /workspace/d/planted && echo x > /workspace/d/planted/f")
        with pytest.raises(UnsafeArchive, match="not a directory"):
            sb.files.download_dir("d", local)  # never written through the local link
        sb.commands.run("rm -rf /workspace/d && mkdir -p /workspace/d && ln -s / /workspace/d/root")
        with pytest.raises(UnsafeArchive, match="symlink out"):
            sb.files.download_dir("d", local)
    assert list((tmp_path / "victim").iterdir()) == []
    assert sorted(p.name for p in local.iterdir()) == ["planted"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local", "victim"]


class _FileChunks:
    """A file of the sandbox read as a stream, standing in for the tar stream of a compromised agent."""

    def __init__(self, stream) -> None:
        self._it = stream
        self.path = "crafted.tar"
        self.received = 0
        self.done = False

    async def next(self):
        try:
            chunk = await self._it.__anext__()
        except StopAsyncIteration:
            self.done = True
            return None
        self.received += len(chunk)
        return chunk

    def cancel(self) -> None:
        self.done = True


def test_crafted_tars_from_a_compromised_agent_are_refused_by_the_host_extractor(home, runc_ready, tmp_path):
    """Whatever the tar stream holds (the agent in the sandbox would have to be subverted to send
    these), the host-side extractor that download_dir uses writes nothing outside its directory."""
    from warmbox import AsyncSandbox

    local = tmp_path / "local"
    local.mkdir()
    (tmp_path / "victim").mkdir()
    os.symlink(tmp_path / "victim", local / "planted")

    async def go() -> None:
        sb = await AsyncSandbox.create(tier="container", timeout=300, home=home)
        try:
            for what, archive, why in ATTACKS:
                await sb.files.write("crafted.tar", archive)  # made by the sandbox user
                stream = await sb.files.read("crafted.tar", format="stream")
                fd = os.open(local, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    with pytest.raises(UnsafeArchive, match=why):
                        await unpack_stream(_FileChunks(stream), fd, sb.sandbox_id)
                finally:
                    os.close(fd)
                    await stream.close()
                leaked = [p for p in tmp_path.rglob("*") if "pwned" in p.name and p.parent != local]
                assert not leaked, (what, leaked)
        finally:
            await sb.kill()

    asyncio.run(go())
    assert list((tmp_path / "victim").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local", "victim"]
    assert not os.path.exists("/tmp/abs-pwned")
