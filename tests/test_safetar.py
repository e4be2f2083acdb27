"""safetar without a sandbox: a tree packs and unpacks whole; every escape is refused, nothing written outside."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from warmbox import safetar


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def _m(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    return info


def _unpack(dest: Path, buf: io.BytesIO) -> int:
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return safetar.extract(buf, fd)  # type: ignore[arg-type]
    finally:
        os.close(fd)


def test_a_tree_round_trips_with_links_kept_and_specials_left_out(tmp_path):
    src = tmp_path / "src"
    (src / "sub/deeper").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub/deeper/b.bin").write_bytes(bytes(range(256)) * 1000)
    (src / "sub/x.sh").write_text("#!/bin/sh\n")
    (src / "sub/x.sh").chmod(0o750)
    os.symlink("../a.txt", src / "sub/link")
    os.symlink("/etc/passwd", src / "abs-link")  # stored as a link, never followed when packing
    os.mkfifo(src / "fifo")
    out = io.BytesIO()
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    safetar.pack(fd, out)  # type: ignore[arg-type]
    os.close(fd)
    names = sorted(tarfile.open(fileobj=io.BytesIO(out.getvalue())).getnames())
    assert names == ["a.txt", "abs-link", "sub", "sub/deeper", "sub/deeper/b.bin", "sub/link", "sub/x.sh"]
    dest = tmp_path / "dest"
    dest.mkdir()
    out.seek(0)
    with pytest.raises(safetar.UnsafeArchive, match="abs-link"):  # the absolute link is refused here
        _unpack(dest, out)
    out2 = io.BytesIO()
    os.unlink(src / "abs-link")
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    safetar.pack(fd, out2)  # type: ignore[arg-type]
    os.close(fd)
    out2.seek(0)
    assert _unpack(dest, out2) == 6
    assert (dest / "a.txt").read_text() == "alpha"
    assert (dest / "sub/deeper/b.bin").read_bytes() == bytes(range(256)) * 1000
    assert os.readlink(dest / "sub/link") == "../a.txt" and (dest / "sub/x.sh").stat().st_mode & 0o777 == 0o750


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ([(_m("/tmp/abs-escape"), b"x")], "absolute"),
        ([(_m("../up-escape"), b"x")], r"'\.\.'"),
        ([(_m("a/../../up2"), b"x")], r"'\.\.'"),
        ([(_m("out", tarfile.SYMTYPE, "/"), None)], "symlink out"),
        ([(_m("d/out", tarfile.SYMTYPE, "../../x"), None)], "symlink out"),
        ([(_m("h", tarfile.LNKTYPE, "../outside.txt"), None)], r"'\.\.'"),
        ([(_m("h", tarfile.LNKTYPE, "never-written"), None)], "hardlink"),
        ([(_m("dev", tarfile.CHRTYPE), None)], "device"),
        ([(_m("fifo", tarfile.FIFOTYPE), None)], "FIFO"),
        ([(_m("", tarfile.REGTYPE), b"x")], "empty"),
    ],
)
def test_escapes_are_refused(tmp_path, members, why):
    dest = tmp_path / "dest"
    dest.mkdir()
    (tmp_path / "outside.txt").write_text("keep")
    with pytest.raises(safetar.UnsafeArchive, match=why):
        _unpack(dest, _tar(*members))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "outside.txt"]
    assert (tmp_path / "outside.txt").read_text() == "keep"


def test_a_planted_symlink_is_never_followed(tmp_path):
    """A link (inside-pointing, or planted before the extraction) never carries a later member out."""
    dest = tmp_path / "dest"
    dest.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, dest / "planted")  # e.g. left by an earlier download
    with pytest.raises(safetar.UnsafeArchive, match="not a directory"):
        _unpack(dest, _tar((_m("planted/owned"), b"x")))
    with pytest.raises(safetar.UnsafeArchive, match="not a directory"):
        _unpack(dest, _tar((_m("in", tarfile.SYMTYPE, "."), None), (_m("in/x"), b"x")))
    with pytest.raises(safetar.UnsafeArchive, match="not a directory"):
        _unpack(
            dest, _tar((_m("l", tarfile.SYMTYPE, "sub"), None), (_m("sub", tarfile.DIRTYPE), None), (_m("l/f"), b""))
        )
    assert list(outside.iterdir()) == []
    # a file member replaces a planted link itself, never what it points to
    (outside / "victim").write_text("keep")
    os.symlink(outside / "victim", dest / "f")
    _unpack(dest, _tar((_m("f"), b"new")))
    assert (outside / "victim").read_text() == "keep" and (dest / "f").read_text() == "new"


def test_a_hardlink_to_a_member_later_replaced_by_a_symlink_is_refused(tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    buf = _tar(
        (_m("a/b/f"), b"x"),
        (_m("a/b/f", tarfile.SYMTYPE, "../../.."), None),  # not inside: refused already
    )
    with pytest.raises(safetar.UnsafeArchive):
        _unpack(dest, buf)
    buf = _tar((_m("a/f"), b"x"), (_m("a/f", tarfile.SYMTYPE, "g"), None), (_m("h", tarfile.LNKTYPE, "a/f"), None))
    with pytest.raises(safetar.UnsafeArchive, match="hardlink"):
        _unpack(dest, buf)


def test_not_a_tar_is_a_tar_error(tmp_path):
    with pytest.raises(tarfile.TarError):
        _unpack(tmp_path, io.BytesIO(b"this is not a tar archive" * 100))
