"""The richer files API against real sandboxes: write_files, rename, streamed reads and writes."""

from __future__ import annotations

import os

import pytest

from warmbox import (
    InvalidArgument,
    InvalidPath,
    IsADirectory,
    NoSpace,
    NotADirectory,
    PathNotFound,
    Sandbox,
    UnsafeArchive,
    WriteEntry,
)
from warmbox.errors import FileTooLarge


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
def test_a_streamed_read_of_200_mb_has_no_cap_and_too_large_names_max_bytes(box):
    """Issue 34: files.read(p, format="stream") of a 200 MB file raised FileTooLarge at 100 MiB."""
    size = 200 * 10**6
    assert box.commands.run(f"truncate -s {size} /workspace/big.bin").exit_code == 0  # sparse: no disk
    try:
        total = 0
        with box.files.read("/workspace/big.bin", format="stream") as stream:
            for chunk in stream:
                total += len(chunk)
        assert total == size
        # a whole read still holds at most 100 MiB by default; its error says how to read more
        with pytest.raises(FileTooLarge, match=r'max_bytes=N, or read it as format="stream"'):
            box.files.read("/workspace/big.bin", format="bytes")
        with pytest.raises(FileTooLarge, match=r"a larger max_bytes=N"):  # a stream given a cap keeps it
            box.files.read("/workspace/big.bin", format="stream", max_bytes=1 << 20)
    finally:
        box.files.remove("/workspace/big.bin")


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


def _pattern(n_chunks: int, size: int = 256 << 10):
    for i in range(n_chunks):
        yield bytes([i % 251]) * size


@pytest.mark.sandbox
def test_streamed_write_from_a_generator_a_file_object_and_an_async_iterator(box, tmp_path):
    want = b"".join(_pattern(13, 100_003))  # chunks of odd sizes: split and joined again
    e = box.files.write("big/gen.bin", _pattern(13, 100_003), mode=0o600)
    assert (e.path, e.size, e.mode) == ("/workspace/big/gen.bin", len(want), 0o600)
    local = tmp_path / "src.bin"
    local.write_bytes(want)
    with local.open("rb") as f:
        assert box.files.write("big/file.bin", f).size == len(want)

    async def agen():
        for c in _pattern(13, 100_003):
            yield c

    assert box.files.write("big/agen.bin", agen()).size == len(want)
    for name in ("gen", "file", "agen"):
        stream = box.files.read(f"big/{name}.bin", format="stream")
        chunks = list(stream)
        assert b"".join(chunks) == want and len(chunks) > 1
    assert box.files.write("big/empty.bin", iter(())).size == 0


@pytest.mark.sandbox
def test_streamed_write_replaces_atomically_and_a_failed_one_leaves_the_target(box):
    box.files.write("atomic/t.txt", "old")

    def failing():
        yield b"new data " * 1000
        yield b"more"
        raise RuntimeError("the source broke")

    with pytest.raises(Exception, match="the source broke"):
        box.files.write("atomic/t.txt", failing())
    assert box.files.read("atomic/t.txt") == "old"
    with pytest.raises(InvalidArgument, match="must be bytes"):
        box.files.write("atomic/t.txt", iter([b"ok", "text is not a chunk"]))
    assert box.files.read("atomic/t.txt") == "old"
    box.files.write("atomic/t.txt", iter([b"new ", b"contents"]))
    assert box.files.read("atomic/t.txt") == "new contents"
    names = [e.name for e in box.files.list("atomic")]
    assert names == ["t.txt"], names  # no temporary file stays behind


@pytest.mark.sandbox
def test_a_streamed_write_that_fills_the_disk_is_no_space_and_leaves_nothing(box):
    box.files.write("/tmp/ns/target.bin", "old")
    chunk = b"x" * (1 << 20)
    with pytest.raises(NoSpace):  # /tmp is a tmpfs of 256 MiB: the sandbox's own refusal, mid-stream
        box.files.write("/tmp/ns/target.bin", iter([chunk] * 300))
    assert box.files.read("/tmp/ns/target.bin") == "old"
    assert [e.name for e in box.files.list("/tmp/ns")] == ["target.bin"]  # no temporary file stays


@pytest.mark.sandbox
def test_streamed_write_bad_input_gets_typed_errors(box):
    with pytest.raises(InvalidPath):
        box.files.write("../../etc/x", iter([b"x"]))
    box.files.make_dir("sdir")
    with pytest.raises(IsADirectory):
        box.files.write("sdir", iter([b"x"]))
    with pytest.raises(InvalidArgument, match="append"):
        box.files.write("s.txt", iter([b"x"]), append=True)
    with pytest.raises(InvalidArgument, match="data must be"):
        box.files.write("s.txt", 42)  # type: ignore[arg-type]
    assert not box.files.exists("s.txt")


def _tree(root):
    (root / "sub/deeper").mkdir(parents=True)
    (root / "a.txt").write_text("alpha")
    (root / "sub/deeper/b.bin").write_bytes(os.urandom(700_000))
    (root / "sub/run.sh").write_text("#!/bin/sh\necho ran\n")
    (root / "sub/run.sh").chmod(0o755)
    os.symlink("../a.txt", root / "sub/link")
    os.mkfifo(root / "fifo")  # left out, never opened


def _snapshot(root):
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir",)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[rel] = ("file", f.read(), os.stat(p).st_mode & 0o777)
    return out


@pytest.mark.sandbox
def test_upload_dir_and_download_dir_round_trip_a_tree(box, tmp_path):
    src = tmp_path / "src"
    _tree(src)
    e = box.files.upload_dir(src, "up/tree")
    assert (e.path, e.type) == ("/workspace/up/tree", "dir")
    assert box.commands.run("/workspace/up/tree/sub/run.sh").stdout == "ran\n"
    assert box.files.get_info("up/tree/sub/link").symlink_target == "../a.txt"
    assert not box.files.exists("up/tree/fifo")
    back = tmp_path / "back"
    box.files.download_dir("up/tree", back)
    assert _snapshot(back) == _snapshot(src)  # the FIFO is in neither
    (src / "sub/deeper/b.bin").write_text("replaced")
    (src / "sub/deeper/new.txt").write_text("new")
    box.files.upload_dir(src / "sub/deeper", "up/tree/sub")  # into an existing directory: merged
    assert box.files.read("up/tree/sub/b.bin") == "replaced" and box.files.read("up/tree/sub/new.txt") == "new"
    assert box.files.exists("up/tree/sub/run.sh")
    with pytest.raises(UnsafeArchive, match="link"):  # here sub/link would point out of its target
        box.files.upload_dir(src / "sub", "up/other")
    os.symlink("/etc", src / "aa-link")  # refused first, while a large file still waits to be sent
    (src / "zz-big.bin").write_bytes(os.urandom(20 << 20))
    with pytest.raises(UnsafeArchive, match="aa-link"):
        box.files.upload_dir(src, "up/third")


@pytest.mark.sandbox
def test_upload_and_download_dir_bad_input_gets_typed_errors(box, tmp_path):
    with pytest.raises(InvalidArgument, match="not a local directory"):
        box.files.upload_dir(tmp_path / "missing", "x")
    with pytest.raises(InvalidPath):
        box.files.upload_dir(tmp_path, "../../etc")
    with pytest.raises(PathNotFound):
        box.files.download_dir("no/such/dir", tmp_path / "d")
    box.files.write("plain.txt", "x")
    with pytest.raises(NotADirectory):
        box.files.download_dir("plain.txt", tmp_path / "d2")
    box.commands.run("mkdir -p /workspace/esc && ln -sfn /etc /workspace/esc/etc && echo x > /workspace/esc/f")
    dest = tmp_path / "esc"
    with pytest.raises(UnsafeArchive, match="symlink out"):
        box.files.download_dir("esc", dest)  # a link out of the directory is refused on the host
    assert not (dest / "etc").exists() and not (dest / "etc").is_symlink()


@pytest.mark.sandbox
@pytest.mark.parametrize("tier", ["gvisor", "microvm"])
def test_the_files_api_on_the_other_tiers(home, runc_ready, tier, tmp_path):
    from warmbox.engine.engine import Engine

    avail = Engine.for_home(home).backend(tier).probe()
    if not avail.available:
        pytest.skip(f"the {tier} tier does not run here: {avail.reason}")
    with Sandbox.create(tier=tier, timeout=300) as sb:
        sb.files.write_files([WriteEntry("t/a.txt", "alpha"), WriteEntry("t/b.bin", b"\x00\x01")])
        assert sb.files.rename("t/a.txt", "t/sub/c.txt").path == "/workspace/t/sub/c.txt"
        assert sb.files.write("t/big.bin", _pattern(9)).size == 9 * (256 << 10)
        assert b"".join(sb.files.read("t/big.bin", format="stream")) == b"".join(_pattern(9))
        src = tmp_path / "src"
        _tree(src)
        sb.files.upload_dir(src, "up")
        back = tmp_path / "back"
        sb.files.download_dir("up", back)
        assert _snapshot(back) == _snapshot(src)
        assert sb.files.read("t/sub/c.txt") == "alpha"
        seen = []
        handle = sb.files.watch_dir("t", seen.append)
        sb.commands.run("echo x > /workspace/t/new.txt")
        _wait_until(lambda: ("new.txt", "create") in [(e.name, e.type.value) for e in seen])
        handle.stop()


def _wait_until(pred, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.sandbox
def test_watch_dir_reports_create_write_chmod_rename_remove(box):
    from warmbox import FilesystemEvent
    from warmbox import FilesystemEventType as T

    box.files.make_dir("w")
    seen: list[FilesystemEvent] = []
    handle = box.files.watch_dir("w", seen.append)
    box.commands.run("cd /workspace/w && echo a > f && chmod 600 f && mv f g && rm g && mkdir d && touch d/inner")
    _wait_until(lambda: any(e.name == "d" and e.type is T.CREATE for e in seen))
    handle.stop()
    box.files.write("w/after-stop", "x")
    kinds = [(e.name, e.type) for e in seen]
    for want in [("f", T.CREATE), ("f", T.WRITE), ("f", T.CHMOD), ("f", T.RENAME), ("g", T.CREATE), ("g", T.REMOVE)]:
        assert want in kinds, (want, kinds)
    assert not any(n.startswith(("d/", "after-stop")) for n, _ in kinds), kinds  # not recursive; stopped
    assert handle.stopped


@pytest.mark.sandbox
def test_watch_dir_recursive_follows_new_directories_and_ends_with_the_directory(box):
    from warmbox import FilesystemEventType as T

    box.files.make_dir("wr/old")
    seen = []
    handle = box.files.watch_dir("wr", seen.append, recursive=True)
    box.commands.run(
        "mkdir -p /workspace/wr/new && sleep 0.3 && echo x > /workspace/wr/new/f && echo y > /workspace/wr/old/g"
    )
    _wait_until(lambda: ("new/f", T.CREATE) in [(e.name, e.type) for e in seen])
    _wait_until(lambda: ("old/g", T.CREATE) in [(e.name, e.type) for e in seen])
    box.files.remove("wr")
    handle.wait(timeout=10)  # the directory went: the watch is over
    assert handle.stopped


@pytest.mark.sandbox
def test_watch_dir_bad_paths_get_typed_errors(box):
    with pytest.raises(PathNotFound):
        box.files.watch_dir("no-such-dir", print)
    box.files.write("wfile", "x")
    with pytest.raises(NotADirectory):
        box.files.watch_dir("wfile", print)
    with pytest.raises(InvalidPath):
        box.files.watch_dir("../etc", print)
    with pytest.raises(InvalidArgument):
        box.files.watch_dir("w", "not callable")  # type: ignore[arg-type]


@pytest.mark.sandbox
def test_watch_dir_takes_a_coroutine_callback_and_its_error_ends_the_watch(box):
    import asyncio

    from warmbox import AsyncSandbox

    async def go():
        sb = await AsyncSandbox.connect(box.sandbox_id)
        try:
            await run(sb)
        finally:
            await sb.close()

    async def run(sb):
        got = []

        async def on_event(e):
            await asyncio.sleep(0.01)
            got.append(e.name)
            if e.name == "boom":
                raise RuntimeError("callback failed")

        await sb.files.make_dir("wa")
        handle = await sb.files.watch_dir("wa", on_event)
        await sb.files.write("wa/one", "1")
        await sb.files.write("wa/boom", "2")
        with pytest.raises(RuntimeError, match="callback failed"):
            await handle.wait(timeout=10)
        assert got[0] == "one" and "boom" in got and handle.stopped

    asyncio.run(go())
