"""The real agent's richer files handlers without a sandbox: watch (inotify), tar both ways, atomic
streamed writes, rename — through the real host session, on a temp directory."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
from pathlib import Path

import pytest

from tests.guest.test_agent import agent, guest_lib  # noqa: F401  (fixtures)
from warmbox import safetar
from warmbox.engine.session import GuestSession
from warmbox.errors import PathNotFound, UnsafeArchive
from warmbox.models import FilesystemEventType as T


async def _chunks(data: bytes, size: int = 100_000):
    for off in range(0, len(data), size):
        yield data[off : off + size]


def test_watch_reports_changes_and_ends_with_the_directory(agent, tmp_path: Path):  # noqa: F811
    d = tmp_path / "w"
    (d / "old").mkdir(parents=True)

    async def go():
        s = await GuestSession.connect(agent, "sb")
        try:
            seen: list[tuple[str, T]] = []
            watch = await s.watch(str(d), True, lambda e: seen.append((e.name, e.type)))
            (d / "f").write_text("a")
            os.chmod(d / "f", 0o600)
            os.rename(d / "f", d / "g")
            (d / "old" / "inner").write_text("b")
            (d / "new").mkdir()
            await asyncio.sleep(0.3)  # the agent adds its watch
            (d / "new" / "deep").write_text("c")
            os.unlink(d / "g")
            await asyncio.sleep(0.5)
            for name in os.listdir(d / "new"):
                os.unlink(d / "new" / name)
            for sub in ("new", "old"):
                for name in os.listdir(d / sub):
                    os.unlink(d / sub / name)
                os.rmdir(d / sub)
            os.rmdir(d)
            await asyncio.wait_for(watch.wait(), 10)  # the directory went: over, no error
            return seen
        finally:
            await s.close()

    seen = asyncio.run(go())
    for want in [
        ("f", T.CREATE),
        ("f", T.WRITE),
        ("f", T.CHMOD),
        ("f", T.RENAME),
        ("g", T.CREATE),
        ("old/inner", T.CREATE),
        ("new", T.CREATE),
        ("new/deep", T.CREATE),
        ("g", T.REMOVE),
    ]:
        assert want in seen, (want, seen)


def test_watch_of_a_missing_directory_is_path_not_found(agent, tmp_path: Path):  # noqa: F811
    async def go():
        s = await GuestSession.connect(agent, "sb")
        try:
            with pytest.raises(PathNotFound):
                await s.watch(str(tmp_path / "nope"), False, print)
        finally:
            await s.close()

    asyncio.run(go())


def test_tar_both_ways_and_an_unsafe_upload(agent, tmp_path: Path):  # noqa: F811
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f.bin").write_bytes(os.urandom(600_000))
    os.symlink("sub/f.bin", src / "link")
    out = io.BytesIO()
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    safetar.pack(fd, out)  # type: ignore[arg-type]
    os.close(fd)
    bad = io.BytesIO()
    with tarfile.open(fileobj=bad, mode="w") as tar:
        info = tarfile.TarInfo("escape")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc"
        tar.addfile(info)

    async def go():
        s = await GuestSession.connect(agent, "sb")
        try:
            entry = await s.unpack(str(tmp_path / "up"), _chunks(out.getvalue()))
            assert entry.type == "dir"
            with pytest.raises(UnsafeArchive, match="escape"):
                await s.unpack(str(tmp_path / "up2"), _chunks(bad.getvalue()))
            stream = await s.pack(str(tmp_path / "up"), timeout=10)
            got = bytearray()
            while (chunk := await stream.next()) is not None:
                got += chunk
            return bytes(got)
        finally:
            await s.close()

    packed = asyncio.run(go())
    assert (tmp_path / "up" / "sub" / "f.bin").read_bytes() == (src / "sub" / "f.bin").read_bytes()
    assert os.readlink(tmp_path / "up" / "link") == "sub/f.bin"
    assert not (tmp_path / "up2" / "escape").is_symlink()
    names = sorted(tarfile.open(fileobj=io.BytesIO(packed)).getnames())
    assert names == ["link", "sub", "sub/f.bin"]


def test_an_abandoned_streamed_write_leaves_the_target_and_no_temporary_file(agent, tmp_path: Path):  # noqa: F811
    target = tmp_path / "t.txt"
    target.write_text("old")

    async def failing():
        yield b"x" * 300_000
        raise RuntimeError("source broke")

    async def go():
        s = await GuestSession.connect(agent, "sb")
        try:
            with pytest.raises(RuntimeError, match="source broke"):
                await s.write_stream(str(target), failing())
            for _ in range(100):  # the agent removes its temporary file once it has the Cancel
                if not [n for n in os.listdir(tmp_path) if n.startswith(".t.txt.")]:
                    break
                await asyncio.sleep(0.02)
            assert target.read_text() == "old"
            e = await s.write_stream(str(target), _chunks(b"new"))
            assert e.size == 3
            moved = await s.rename(str(target), str(tmp_path / "sub" / "moved.txt"))
            assert moved.path == str(tmp_path / "sub" / "moved.txt")
        finally:
            await s.close()

    asyncio.run(go())
    assert (tmp_path / "sub" / "moved.txt").read_text() == "new"
    assert sorted(n for n in os.listdir(tmp_path) if n != "a.sock") == ["sub"]
