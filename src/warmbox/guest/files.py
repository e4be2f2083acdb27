"""File requests: read and write (windowed), tar in and out, watch, list, stat, rename, mkdir, remove."""

from __future__ import annotations

import errno
import os
import select
import stat as stat_mod
import struct

from warmbox import protocol as p
from warmbox.guest.base import Inbox, _Fail

TYPE_CHECKING = False  # not typing's: the guest imports nothing it does not use at run time
if TYPE_CHECKING:
    from warmbox.guest.agent import Agent
    from warmbox.guest.connection import Connection


def _entry(rid: int, path: str, name: str | None = None) -> p.Entry:
    st = os.lstat(path)
    if stat_mod.S_ISLNK(st.st_mode):
        kind, target = p.FileType.SYMLINK, os.readlink(path)
    elif stat_mod.S_ISDIR(st.st_mode):
        kind, target = p.FileType.DIR, ""
    elif stat_mod.S_ISREG(st.st_mode):
        kind, target = p.FileType.FILE, ""
    else:
        kind, target = p.FileType.OTHER, ""
    return p.Entry(
        rid,
        name=name if name is not None else os.path.basename(path) or "/",
        path=path,
        kind=kind,
        size=st.st_size,
        mode=stat_mod.S_IMODE(st.st_mode),
        mtime=st.st_mtime,
        target=target,
    )


_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY  # a FIFO cannot hold the open


def _not_regular(path: str) -> _Fail:
    return _Fail(p.ErrorCode.NOT_REGULAR, f"{path} is not a regular file (a FIFO, device or socket): not read")


def _read_file(agent: Agent, conn: Connection, msg: p.ReadFile) -> None:
    """Stream a regular file (see protocol.ReadFile): never more than max_bytes, at most ``window``
    bytes ahead of the host's acks; stops when the host cancels or goes away."""
    if msg.max_bytes < 0 or msg.window < 0:
        raise _Fail(p.ErrorCode.INVALID, "max_bytes and window must not be negative")
    inbox = conn.inbox(msg.id)
    st = os.stat(msg.path)  # no open at all (no device side effects) for what is refused anyway
    if not (stat_mod.S_ISREG(st.st_mode) or stat_mod.S_ISDIR(st.st_mode)):
        raise _not_regular(msg.path)
    try:
        fd = os.open(msg.path, _READ_FLAGS)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket swapped in since the stat
            raise _not_regular(msg.path) from None
        raise
    try:
        st = os.fstat(fd)  # what was opened decides: the path may have been swapped meanwhile
        if stat_mod.S_ISDIR(st.st_mode):
            raise _Fail(p.ErrorCode.IS_A_DIRECTORY, f"{msg.path} is a directory")
        if not stat_mod.S_ISREG(st.st_mode):
            raise _not_regular(msg.path)
        if st.st_size > msg.max_bytes:
            raise _Fail(
                p.ErrorCode.TOO_LARGE, f"{msg.path} is {st.st_size} bytes, more than max_bytes ({msg.max_bytes})"
            )
        os.set_blocking(fd, True)
        sent = acked = 0
        while True:
            while True:  # the host's acks and cancels; wait for acks while the window is full
                full = msg.window and sent - acked >= msg.window
                item = inbox.get() if full else inbox.poll()
                if item is Inbox.EMPTY:
                    break
                if item is None or isinstance(item, p.Cancel):
                    return  # the host went away or stopped the read: no answer
                if isinstance(item, p.ReadAck):
                    acked += item.bytes
            if conn.closed:
                return
            data = os.read(fd, min(p.CHUNK, msg.max_bytes - sent + 1))
            if not data:
                break
            if sent + len(data) > msg.max_bytes:
                raise _Fail(
                    p.ErrorCode.TOO_LARGE,
                    f"{msg.path} is longer than max_bytes ({msg.max_bytes}): "
                    "it grew while it was read, or its size was not known up front",
                )
            conn.send(p.Chunk(id=msg.id, data=data))
            sent += len(data)
    finally:
        os.close(fd)
    conn.send(p.ChunkEnd(id=msg.id))


def _write_file(agent: Agent, conn: Connection, msg: p.WriteFile) -> None:
    """Take an upload (see protocol.WriteFile): acks every quarter window; an atomic one goes to a
    temporary file beside the target, renamed over it at the end and removed on any failure."""
    if msg.window < 0 or (msg.atomic and msg.append):
        raise _Fail(p.ErrorCode.INVALID, "window must not be negative; an atomic write cannot append")
    inbox = conn.inbox(msg.id)
    parent = os.path.dirname(msg.path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    mode = msg.mode & 0o7777 or 0o644
    tmp = None
    if msg.atomic:
        try:
            if stat_mod.S_ISDIR(os.lstat(msg.path).st_mode):  # refused now, not after all the data came
                raise _Fail(p.ErrorCode.IS_A_DIRECTORY, f"{msg.path} is a directory")
        except FileNotFoundError:
            pass
        # beside the target (one filesystem: the rename is atomic); the name fits NAME_MAX
        tmp = os.path.join(parent, f".{os.path.basename(msg.path)[:200]}.wb-{os.urandom(6).hex()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    else:
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if msg.append else os.O_TRUNC)
        fd = os.open(msg.path, flags, mode)
    done = False
    try:
        if tmp is not None:
            os.fchmod(fd, mode)  # the umask does not apply: the file gets the mode asked for
        conn.send(p.Ok(id=msg.id))  # ready: the host may now stream chunks
        ack_every = max(1, msg.window // 4)
        unacked = 0
        while True:
            item = inbox.get()
            if item is None or isinstance(item, p.Cancel):
                return  # connection gone, or the host abandoned the upload: no answer
            if isinstance(item, p.ChunkEnd):
                break
            if not isinstance(item, p.Chunk):
                raise _Fail(p.ErrorCode.INVALID, f"write {msg.path}: expected file data, got {type(item).__name__}")
            view = memoryview(item.data)
            while view:
                view = view[os.write(fd, view) :]
            unacked += len(item.data)
            if msg.window and unacked >= ack_every:
                conn.send(p.WriteAck(id=msg.id, bytes=unacked))
                unacked = 0
        if tmp is not None:
            os.rename(tmp, msg.path)
        done = True
    finally:
        os.close(fd)
        if tmp is not None and not done:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    conn.send(_entry(msg.id, msg.path))


class _Abandoned(Exception):
    """The host cancelled a tar transfer or went away: the handler ends without an answer."""


class _TarOut:
    """The file object safetar.pack writes to: Chunk frames of up to CHUNK bytes, each sent once the
    host's window has room (its ReadAcks arrive in the request's inbox)."""

    def __init__(self, conn: Connection, rid: int, window: int) -> None:
        self.conn = conn
        self.id = rid
        self.window = window
        self.inbox = conn.inbox(rid)
        self.buf = bytearray()
        self.sent = self.acked = 0

    def write(self, data: bytes) -> int:
        self.buf += data
        while len(self.buf) >= p.CHUNK:
            self._send(bytes(self.buf[: p.CHUNK]))
            del self.buf[: p.CHUNK]
        return len(data)

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        if self.buf:
            self._send(bytes(self.buf))
            self.buf.clear()

    def _send(self, data: bytes) -> None:
        while True:
            full = self.window and self.sent - self.acked >= self.window
            item = self.inbox.get() if full else self.inbox.poll()
            if item is Inbox.EMPTY:
                break
            if item is None or isinstance(item, p.Cancel) or self.conn.closed:
                raise _Abandoned
            if isinstance(item, p.ReadAck):
                self.acked += item.bytes
        if self.conn.closed:
            raise _Abandoned
        self.conn.send(p.Chunk(id=self.id, data=data))
        self.sent += len(data)


class _TarIn:
    """The file object safetar.extract reads from: the host's Chunk frames, each acknowledged
    (WriteAck) once taken, so the host sends at most its window ahead."""

    def __init__(self, conn: Connection, rid: int, window: int) -> None:
        self.conn = conn
        self.id = rid
        self.window = window
        self.inbox = conn.inbox(rid)
        self.data = memoryview(b"")
        self.ended = False
        self.unacked = 0

    def read(self, n: int = -1) -> bytes:
        while not self.data and not self.ended:
            item = self.inbox.get()
            if item is None or isinstance(item, p.Cancel):
                raise _Abandoned
            if isinstance(item, p.ChunkEnd):
                self.ended = True
            elif isinstance(item, p.Chunk):
                self.data = memoryview(item.data)
                self.unacked += len(item.data)
                if self.window and self.unacked >= max(1, self.window // 4):
                    self.conn.send(p.WriteAck(id=self.id, bytes=self.unacked))
                    self.unacked = 0
            else:
                raise _Fail(p.ErrorCode.INVALID, f"tar upload: expected data, got {type(item).__name__}")
        n = len(self.data) if n < 0 else n
        out, self.data = bytes(self.data[:n]), self.data[n:]
        return out

    def drain(self) -> None:
        """Take the rest of the stream (tar's zero blocks, padding) up to its ChunkEnd."""
        while not self.ended:
            self.data = memoryview(b"")
            self.read(1 << 20)


def _tar_create(agent: Agent, conn: Connection, msg: p.TarCreate) -> None:
    from warmbox import safetar

    if msg.window < 0:
        raise _Fail(p.ErrorCode.INVALID, "window must not be negative")
    fd = os.open(msg.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root itself may be a link
    out = _TarOut(conn, msg.id, msg.window)
    try:
        safetar.pack(fd, out)  # type: ignore[arg-type]
        out.finish()
    except _Abandoned:
        return
    finally:
        os.close(fd)
    conn.send(p.ChunkEnd(id=msg.id))


def _tar_extract(agent: Agent, conn: Connection, msg: p.TarExtract) -> None:
    import tarfile

    from warmbox import safetar

    if msg.window < 0:
        raise _Fail(p.ErrorCode.INVALID, "window must not be negative")
    os.makedirs(msg.path, exist_ok=True)
    fd = os.open(msg.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    source = _TarIn(conn, msg.id, msg.window)
    try:
        conn.send(p.Ok(id=msg.id))  # ready: the host may now stream the archive
        safetar.extract(source, fd)  # type: ignore[arg-type]
        source.drain()
    except _Abandoned:
        return
    except safetar.UnsafeArchive as e:
        raise _Fail(p.ErrorCode.UNSAFE_ARCHIVE, str(e)) from None
    except tarfile.TarError as e:
        raise _Fail(p.ErrorCode.INVALID, f"not a tar archive ({e})") from None
    finally:
        os.close(fd)
    conn.send(_entry(msg.id, msg.path))


# inotify(7): the watched events, and what each becomes (fsnotify's mapping, as E2B reports them)
_IN_MODIFY, _IN_ATTRIB, _IN_MOVED_FROM, _IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
_IN_CREATE, _IN_DELETE, _IN_DELETE_SELF, _IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
_IN_Q_OVERFLOW, _IN_IGNORED, _IN_ISDIR = 0x4000, 0x8000, 0x40000000
_IN_ONLYDIR, _IN_DONT_FOLLOW = 0x1000000, 0x2000000
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_WATCH_MASK = (
    _IN_MODIFY | _IN_ATTRIB | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE | _IN_DELETE_SELF | _IN_MOVE_SELF
)
_MAX_WATCHES = 8192  # directories one recursive watch follows at most


class _Inotify:
    """inotify through libc (ctypes: the stdlib has no binding); watches by descriptor -> relative dir."""

    def __init__(self) -> None:
        import ctypes

        self._libc = ctypes.CDLL(None, use_errno=True)
        self._ctypes = ctypes
        self.fd = self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.dirs: dict[int, str] = {}

    def add(self, path: str, rel: str) -> None:
        if len(self.dirs) >= _MAX_WATCHES:
            return
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), _WATCH_MASK | _IN_ONLYDIR | _IN_DONT_FOLLOW)
        if wd < 0:
            err = self._ctypes.get_errno()
            if not rel:  # the root: its error is the answer
                raise OSError(err, os.strerror(err), path)
            return  # a subdirectory gone or unreadable meanwhile
        self.dirs[wd] = rel

    def add_tree(self, path: str, rel: str) -> None:
        """``path`` and every directory below it (links not followed)."""
        self.add(path, rel)
        for top, dirnames, _ in os.walk(path):
            for d in dirnames:
                full = os.path.join(top, d)
                if not os.path.islink(full):
                    sub = os.path.relpath(full, path)
                    self.add(full, os.path.join(rel, sub) if rel else sub)

    def events(self) -> list[tuple[int, int, str]]:
        """(wd, mask, name) of what is queued; [] if nothing."""
        try:
            buf = os.read(self.fd, 64 << 10)
        except BlockingIOError:
            return []
        out, off = [], 0
        while off + 16 <= len(buf):
            wd, mask, _cookie, size = struct.unpack_from("iIII", buf, off)
            name = buf[off + 16 : off + 16 + size].split(b"\0", 1)[0]
            out.append((wd, mask, os.fsdecode(name)))
            off += 16 + size
        return out

    def close(self) -> None:
        os.close(self.fd)


def _watch_dir(agent: Agent, conn: Connection, msg: p.WatchDir) -> None:
    """Report changes below a directory (see protocol.WatchDir) until the host cancels."""
    if msg.window < 1:
        raise _Fail(p.ErrorCode.INVALID, "window must be at least 1")
    inbox = conn.inbox(msg.id)
    st = os.stat(msg.path)
    if not stat_mod.S_ISDIR(st.st_mode):
        raise _Fail(p.ErrorCode.NOT_A_DIRECTORY, f"{msg.path} is not a directory")
    watch = _Inotify()
    try:
        if msg.recursive:
            watch.add_tree(msg.path, "")
        else:
            watch.add(msg.path, "")
        conn.send(p.Ok(id=msg.id))
        sent = acked = 0
        while True:
            while True:  # the host's acks and cancel; wait for acks while the window is full
                full = sent - acked >= msg.window
                item = inbox.get() if full else inbox.poll()
                if item is Inbox.EMPTY:
                    break
                if item is None or isinstance(item, p.Cancel):
                    return
                if isinstance(item, p.ReadAck):
                    acked += item.bytes
            if conn.closed:
                return
            ready, _, _ = select.select([watch.fd], [], [], 0.2)
            if not ready:
                continue
            for wd, mask, name in watch.events():
                if mask & _IN_Q_OVERFLOW:
                    continue
                base = watch.dirs.get(wd)
                if base is None:
                    continue
                if mask & _IN_IGNORED:
                    del watch.dirs[wd]
                    if base == "":  # the watched directory itself is gone
                        conn.send(p.ChunkEnd(id=msg.id))
                        return
                    continue
                if mask & (_IN_DELETE_SELF | _IN_MOVE_SELF):
                    if base == "":
                        conn.send(p.ChunkEnd(id=msg.id))
                        return
                    continue  # a subdirectory: its parent reports it
                rel = os.path.join(base, name) if base else name
                if mask & (_IN_CREATE | _IN_MOVED_TO):
                    kind = p.FsEventType.CREATE
                    if msg.recursive and mask & _IN_ISDIR:
                        watch.add_tree(os.path.join(msg.path, rel), rel)
                elif mask & _IN_DELETE:
                    kind = p.FsEventType.REMOVE
                elif mask & _IN_MOVED_FROM:
                    kind = p.FsEventType.RENAME
                elif mask & _IN_MODIFY:
                    kind = p.FsEventType.WRITE
                elif mask & _IN_ATTRIB:
                    kind = p.FsEventType.CHMOD
                else:
                    continue
                conn.send(p.FsEvent(id=msg.id, name=rel, kind=kind))
                sent += 1
    finally:
        watch.close()


def _rename(agent: Agent, conn: Connection, msg: p.Rename) -> None:
    os.lstat(msg.old)  # a missing source is NOT_FOUND naming it, before any directory is made
    parent = os.path.dirname(msg.new)
    if parent:
        os.makedirs(parent, exist_ok=True)
    os.rename(msg.old, msg.new)
    conn.send(_entry(msg.id, msg.new))


def _list_dir(agent: Agent, conn: Connection, msg: p.ListDir) -> None:
    if not os.path.isdir(msg.path):
        raise _Fail(
            p.ErrorCode.NOT_A_DIRECTORY if os.path.exists(msg.path) else p.ErrorCode.NOT_FOUND,
            f"{msg.path} is not a directory",
        )
    depth = max(1, min(msg.depth, 32))
    todo = [(msg.path, 1)]
    while todo:
        d, level = todo.pop(0)
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            path = os.path.join(d, name)
            try:
                entry = _entry(msg.id, path, name)
            except OSError:
                continue
            conn.send(entry)
            if entry.kind is p.FileType.DIR and level < depth:
                todo.append((path, level + 1))
    conn.send(p.Ok(id=msg.id))


def _stat(agent: Agent, conn: Connection, msg: p.Stat) -> None:
    conn.send(_entry(msg.id, msg.path))


def _make_dir(agent: Agent, conn: Connection, msg: p.MakeDir) -> None:
    if msg.parents:
        if os.path.isdir(msg.path):
            raise _Fail(p.ErrorCode.EXISTS, f"{msg.path} exists")
        os.makedirs(msg.path)
    else:
        os.mkdir(msg.path)
    conn.send(p.Ok(id=msg.id))


def _remove(agent: Agent, conn: Connection, msg: p.Remove) -> None:
    st = os.lstat(msg.path)
    if stat_mod.S_ISDIR(st.st_mode):
        if msg.recursive:
            import shutil  # only for this rare operation

            shutil.rmtree(msg.path)
        else:
            os.rmdir(msg.path)
    else:
        os.unlink(msg.path)
    conn.send(p.Ok(id=msg.id))
