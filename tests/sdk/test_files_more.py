"""The richer files API against real sandboxes: write_files, rename, streamed reads and writes."""

from __future__ import annotations

import pytest

from warmbox import (
    InvalidArgument,
    InvalidPath,
    IsADirectory,
    PathNotFound,
    Sandbox,
    WriteEntry,
)


@pytest.fixture(scope="module")
def box(home, runc_ready):
    with Sandbox.create(tier="container", timeout=600) as sb:
        yield sb


@pytest.mark.sandbox
def test_write_files_writes_many_in_one_call(box):
    entries = box.files.write_files(
        [
            WriteEntry("many/a.txt", "alpha"),
            WriteEntry("/workspace/many/deep/b.bin", b"\x00\xffbeta"),
            WriteEntry("/tmp/c.txt", ""),
        ]
    )
    assert [e.path for e in entries] == ["/workspace/many/a.txt", "/workspace/many/deep/b.bin", "/tmp/c.txt"]
    assert [e.size for e in entries] == [5, 6, 0] and all(e.type == "file" for e in entries)
    assert box.files.read("many/a.txt") == "alpha"
    assert box.files.read("many/deep/b.bin", format="bytes") == b"\x00\xffbeta"
    assert box.files.write_files([]) == []


@pytest.mark.sandbox
def test_write_files_checks_every_entry_before_writing(box):
    with pytest.raises(InvalidPath):
        box.files.write_files([WriteEntry("ok-first.txt", "x"), WriteEntry("../escape.txt", "y")])
    assert not box.files.exists("ok-first.txt")  # nothing was written
    with pytest.raises(InvalidArgument, match=r"files\[0\]"):
        box.files.write_files([("a.txt", "x")])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        box.files.write_files([WriteEntry("a.txt", 42)])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        box.files.write_files("a.txt")  # type: ignore[arg-type]
    box.files.make_dir("a-dir")
    with pytest.raises(IsADirectory):  # the sandbox's own refusal, typed; the first file stays written
        box.files.write_files([WriteEntry("before-dir.txt", "1"), WriteEntry("a-dir", "2")])
    assert box.files.read("before-dir.txt") == "1"


@pytest.mark.sandbox
def test_rename_moves_files_and_directories(box):
    box.files.write("ren/old.txt", "data")
    e = box.files.rename("ren/old.txt", "ren/sub/new.txt")  # the new parent is made
    assert (e.path, e.type, e.size) == ("/workspace/ren/sub/new.txt", "file", 4)
    assert not box.files.exists("ren/old.txt")
    assert box.files.read("ren/sub/new.txt") == "data"
    box.files.write("ren/other.txt", "replaced")
    box.files.rename("ren/sub/new.txt", "ren/other.txt")  # a file there is replaced, like mv
    assert box.files.read("ren/other.txt") == "data"
    d = box.files.rename("ren/sub", "ren/moved")
    assert d.type == "dir" and box.files.exists("ren/moved") and not box.files.exists("ren/sub")


@pytest.mark.sandbox
def test_rename_bad_paths_get_typed_errors(box):
    with pytest.raises(PathNotFound, match="nope"):
        box.files.rename("nope.txt", "there.txt")
    assert not box.files.exists("there.txt")
    with pytest.raises(InvalidPath):
        box.files.rename("x.txt", "../../etc/passwd")
    with pytest.raises(InvalidPath):
        box.files.rename("", "y.txt")
    with pytest.raises(InvalidPath):
        box.files.rename(7, "y.txt")  # type: ignore[arg-type]
