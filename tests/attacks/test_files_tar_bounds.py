"""download_dir's host-side extractor against a hostile sandbox: no link out, bounded memory.

Red-team findings: (1) a symlink chain passed the lexical check — ``a/b/l -> ../..`` (the
directory itself) then ``x -> a/b/l/../victim`` reads as inside by its text but resolves beside
the local directory, so download_dir left a link out of it for the caller's next open to follow;
(2) tarfile holds an extended header (GNU long name, pax) whole, whatever size it claims, and a
stream's TarFile keeps every member it read: a compromised agent's archive grew the caller's
process by the stream's size.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.attacks.test_files_read import SMALL, PeakGrowth
from tests.attacks.test_files_tar import _FileChunks
from warmbox import AsyncSandbox, Sandbox, UnsafeArchive
from warmbox.sdk.files import unpack_stream

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(300)]


def _escapes(local: str) -> list[str]:
    """Entries below ``local`` that resolve outside it."""
    root = os.path.realpath(local)
    out = []
    for dirpath, dirnames, filenames in os.walk(local):
        for name in dirnames + filenames:
            real = os.path.realpath(os.path.join(dirpath, name))
            if real != root and not real.startswith(root + "/"):
                out.append(os.path.join(dirpath, name))
    return out


def test_a_symlink_chain_out_of_a_downloaded_directory_is_refused(home, runc_ready, tmp_path):
    local = tmp_path / "local"
    (tmp_path / "victim").mkdir()
    with Sandbox.create(tier="container", timeout=300, home=home) as sb:
        r = sb.commands.run(
            "mkdir -p /workspace/d/a/b && ln -s ../.. /workspace/d/a/b/l && ln -s a/b/l/../victim /workspace/d/x"
        )
        assert r.exit_code == 0, r.stderr
        with pytest.raises(UnsafeArchive, match="symlink out"):
            sb.files.download_dir("d", local)
        assert not _escapes(str(local)), _escapes(str(local))
        # a link inside by its leading '..' still comes down
        sb.commands.run("rm /workspace/d/x && mkdir /workspace/d/c && ln -s ../a/b /workspace/d/c/up")
        sb.files.download_dir("d", tmp_path / "good")
        assert os.readlink(tmp_path / "good/c/up") == "../a/b"
    assert list((tmp_path / "victim").iterdir()) == []


# A compromised agent's tar stream (the sandbox user writes it, the host extractor reads it):
# a GNU long name claiming 192 MiB, 300 000 members that change nothing ("./"), and files whose
# modification times no file can have (before, an OverflowError or ValueError reached the caller).
_CRAFT = r"""
import sys, tarfile
kind, out = sys.argv[1], open(sys.argv[2], "wb")
if kind == "long header":
    info = tarfile.TarInfo("x")
    info.type, info.size = tarfile.GNUTYPE_LONGNAME, 192 << 20
    out.write(info.tobuf(format=tarfile.GNU_FORMAT))
    block = b"a" * (1 << 20)
    for _ in range(192):
        out.write(block)
elif kind.startswith("long "):  # a name or link no file system takes (an untyped OSError before)
    info = tarfile.TarInfo("n" * 300 if kind == "long name" else "l")
    if kind == "long link":
        info.type, info.linkname = tarfile.SYMTYPE, "b/" * 3000
    else:
        info.size = 1
    out.write(info.tobuf(format=tarfile.PAX_FORMAT) + (b"x" + bytes(511) if info.size else b""))
elif kind == "bad times":
    for i, mtime in enumerate(("nan", "1e400", "-1e30", str(1 << 80))):
        info = tarfile.TarInfo(f"t{i}")
        info.size, info.pax_headers = 1, {"mtime": mtime}
        out.write(info.tobuf(format=tarfile.PAX_FORMAT) + b"x" + bytes(511))
else:
    info = tarfile.TarInfo("./")
    info.type = tarfile.DIRTYPE
    out.write(info.tobuf(format=tarfile.GNU_FORMAT) * 300_000)
out.write(bytes(1024))
"""


@pytest.mark.parametrize("kind", ["long header", "many members", "bad times", "long name", "long link"])
def test_a_crafted_download_stream_keeps_the_host_extractor_bounded(home, runc_ready, tmp_path, kind):
    local = tmp_path / "local"
    local.mkdir()

    async def go() -> int:
        sb = await AsyncSandbox.create(tier="container", timeout=300, home=home)
        try:
            await sb.files.write("/tmp/craft.py", _CRAFT)
            r = await sb.commands.run(f"python3 /tmp/craft.py '{kind}' /workspace/crafted.tar", timeout=120)
            assert r.exit_code == 0, r.stderr
            stream = await sb.files.read("crafted.tar", format="stream", max_bytes=1 << 30)
            fd = os.open(local, os.O_RDONLY | os.O_DIRECTORY)
            try:
                with PeakGrowth() as mem:
                    if kind in ("long header", "long name", "long link"):
                        why = {"long header": "extended header", "long name": "component", "long link": "target"}
                        with pytest.raises(UnsafeArchive, match=why[kind]):
                            await unpack_stream(_FileChunks(stream), fd, sb.sandbox_id)
                    else:  # nothing to refuse: unpacked (a time no file can have is left as now)
                        await unpack_stream(_FileChunks(stream), fd, sb.sandbox_id)
            finally:
                os.close(fd)
                await stream.close()
            return mem.growth
        finally:
            await sb.kill()

    growth = asyncio.run(go())
    assert growth < SMALL, f"a crafted download stream made the host hold {growth >> 20} MiB"
    if kind == "bad times":
        assert sorted(p.name for p in local.iterdir()) == ["t0", "t1", "t2", "t3"]
    else:
        assert list(local.iterdir()) == []
