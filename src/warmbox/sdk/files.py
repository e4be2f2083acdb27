"""``sandbox.files``: read and write the sandbox's filesystem (as the sandbox's user)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import queue
import tarfile
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from os import PathLike
from typing import Protocol, runtime_checkable

from warmbox import operations as ops
from warmbox import safetar
from warmbox.errors import FileTooLarge, GuestProtocolError, InvalidArgument, PathNotFound, UnsafeArchive
from warmbox.models import EntryInfo, FilesystemEvent, WriteEntry
from warmbox.sdk._ref import SandboxRef
from warmbox.sdk._sync import synchronize
from warmbox.sdk.transport import LocalTransport, Transport

DEFAULT_READ_MAX_BYTES = 100 << 20
DEFAULT_READ_TIMEOUT_S = 60.0
STREAM_CHUNK = 1 << 20  # bytes read from a file object at a time for a streamed write
PACK_CHUNK = 256 << 10  # bytes of a packed local directory handed over at a time
WORKDIR = "/workspace"


class AsyncFiles:
    """``sandbox.files``: read and write the sandbox's filesystem (as the sandbox's user)."""

    def __init__(self, sandbox: SandboxRef) -> None:
        self._sb = sandbox

    async def read(
        self,
        path: str,
        *,
        format: str = "text",
        max_bytes: int | None = None,
        timeout: float | None = DEFAULT_READ_TIMEOUT_S,
    ) -> str | bytes | AsyncFileStream:
        """A regular file's contents: ``format`` "text" (UTF-8), "bytes", or "stream" (an async
        iterator of bytes chunks, for ``async for``; the sync Sandbox: an iterator, ``for``).

        Symlinks are followed; a FIFO, device or socket raises NotARegularFile without being
        read. max_bytes: a larger file raises FileTooLarge (nothing partial is returned; a
        stream raises it after what fits). None: 100 MiB for "text" and "bytes" (what is read
        is held whole), no cap for a stream. A stream holds a few MiB at most however slowly
        it is consumed: use it for large files; close() it (or use ``with``) to stop early.
        timeout: seconds (None: no bound) for the whole read, or, for a stream, for each chunk;
        on expiry SandboxTimeout, and the read stops in the sandbox.
        """
        sb = self._sb
        if format not in ("text", "bytes", "stream"):
            raise InvalidArgument(f"format must be 'text', 'bytes' or 'stream', got {format!r}")
        if format == "stream":
            try:  # (over HTTP, a file known to be too large is refused here)
                chunks = await sb._run(ops.ReadFileStream(sb.sandbox_id, path, max_bytes=max_bytes, timeout=timeout))
            except FileTooLarge as e:
                raise _stream_too_large(e) from None
            stream = AsyncFileStream(chunks)
            await stream._start()
            return stream
        cap = DEFAULT_READ_MAX_BYTES if max_bytes is None else max_bytes
        try:
            data = await sb._run(ops.ReadFile(sb.sandbox_id, path, max_bytes=cap, timeout=timeout))
        except FileTooLarge as e:
            raise FileTooLarge(
                f'{e} (read more with max_bytes=N, or read it as format="stream": no cap unless given one)',
                e.sandbox_id,
            ) from None
        if format == "bytes":
            return data
        return str(data, "utf-8", "replace")

    async def write(self, path: str, data: FileData, *, mode: int = 0o644, append: bool = False) -> EntryInfo:
        """Create or replace a file (parent directories are created); returns its entry.

        data: text (UTF-8) or bytes; or, for large files, a stream: a binary file object (read in
        chunks), an iterable or async iterable of bytes chunks. A stream is sent as it is read,
        at the sandbox's pace (the host holds about one chunk at a time, whatever the size), and
        the file replaces ``path`` atomically once complete: a failed or interrupted write (the
        source raised, the sandbox's disk is full) leaves ``path`` as it was. ``append`` takes
        text or bytes only.
        """
        sb = self._sb
        if isinstance(data, (bytearray, memoryview)):
            data = bytes(data)
        if isinstance(data, (str, bytes)):
            return await sb._run(ops.WriteFile(sb.sandbox_id, path, data, mode=mode, append=append))
        if not isinstance(data, (SupportsRead, AsyncIterable, Iterable)):
            raise InvalidArgument(
                f"data must be str, bytes, a binary file object or an iterable of bytes, got {type(data).__name__}"
            )
        if append:
            raise InvalidArgument("append=True takes str or bytes, not a stream")
        return await sb._run(ops.WriteFileStream(sb.sandbox_id, path, _chunks(data), mode=mode))

    async def write_files(self, files: builtins.list[WriteEntry]) -> builtins.list[EntryInfo]:
        """Create or replace several files in one call, in order (parents are created); their
        entries. Every entry is checked first; a failure inside the sandbox stops at that file
        (the ones before it stay written) and raises its typed error."""
        if not isinstance(files, (builtins.list, tuple)):
            raise InvalidArgument(f"files must be a list of warmbox.WriteEntry, got {type(files).__name__}")
        return await self._sb._run(ops.WriteFiles(self._sb.sandbox_id, tuple(files)))

    async def rename(self, old_path: str, new_path: str) -> EntryInfo:
        """Move ``old_path`` to ``new_path`` (parents are created; a file there is replaced);
        returns the entry at its new path."""
        return await self._sb._run(ops.Rename(self._sb.sandbox_id, old_path, new_path))

    async def upload_dir(self, local_path: str | PathLike[str], remote_path: str) -> EntryInfo:
        """Copy the local directory ``local_path`` into the sandbox's ``remote_path`` (made if missing;
        what is there already stays unless replaced) as one tar stream, packed as it is sent (the
        host holds a few chunks whatever the size). Symlinks are copied as symlinks, never followed;
        FIFOs, devices and sockets are left out. The sandbox refuses a symlink that points out of
        ``remote_path`` (UnsafeArchive naming it; what came before it stays). Returns the entry
        of ``remote_path``."""
        fd = _local_dir(local_path, create=False)
        try:
            source = _Packer(fd)
            try:
                return await self._sb._run(ops.UploadDir(self._sb.sandbox_id, remote_path, source.chunks()))
            finally:
                await source.stop()
        finally:
            os.close(fd)

    async def download_dir(
        self, remote_path: str, local_path: str | PathLike[str], *, timeout: float | None = DEFAULT_READ_TIMEOUT_S
    ) -> None:
        """Copy the sandbox's directory ``remote_path`` into the local directory ``local_path`` (made
        if missing; files there are replaced by the sandbox's) as one tar stream, unpacked as it
        arrives. What the sandbox sends is held to one rule: every entry lands inside
        ``local_path`` — an absolute name, a '..' component, a symlink or hardlink pointing out, a
        device or FIFO raises UnsafeArchive naming it (what came before it stays), and no path
        component is followed through a symlink. timeout: seconds (None: none) for each chunk."""
        fd = _local_dir(local_path, create=True)
        try:
            chunks = await self._sb._run(ops.DownloadDir(self._sb.sandbox_id, remote_path, timeout=timeout))
            await unpack_stream(chunks, fd, self._sb.sandbox_id)
        finally:
            os.close(fd)

    async def watch_dir(
        self, path: str, on_event: Callable[[FilesystemEvent], object], *, recursive: bool = False
    ) -> AsyncWatchHandle:
        """Watch the directory ``path`` (recursive: and every directory below it, new ones
        included; links are not followed): ``on_event(FilesystemEvent(name, type))`` is called for
        each change (``name`` relative to ``path``; type create, write, remove, rename or chmod),
        in order, until the handle's stop() or the directory's removal. The callback may be a
        coroutine function (awaited before the next event); while it is busy, events wait in the
        sandbox (a flood beyond the kernel's queue is dropped there, not held here). The sync
        Sandbox calls it on its event-loop thread. A missing path or a file raises here."""
        if not callable(on_event):
            raise InvalidArgument("on_event must be a callable taking a warmbox.FilesystemEvent")
        watch = await self._sb._run(ops.WatchDir(self._sb.sandbox_id, path, recursive=recursive, on_event=on_event))
        return AsyncWatchHandle(watch)

    async def list(self, path: str = WORKDIR, *, depth: int = 1) -> builtins.list[EntryInfo]:
        return await self._sb._run(ops.ListDir(self._sb.sandbox_id, path, depth=depth))

    async def get_info(self, path: str) -> EntryInfo:
        return await self._sb._run(ops.Stat(self._sb.sandbox_id, path))

    async def exists(self, path: str) -> bool:
        try:
            await self.get_info(path)
        except PathNotFound:
            return False
        return True

    async def make_dir(self, path: str) -> bool:
        """Create a directory and its parents; False if it already existed."""
        return await self._sb._run(ops.MakeDir(self._sb.sandbox_id, path))

    async def remove(self, path: str) -> None:
        """Remove a file or a directory tree."""
        await self._sb._run(ops.Remove(self._sb.sandbox_id, path))

    async def download_url(
        self, path: str, *, expires_in: float = 3600.0, user: str = "user", base_url: str | None = None
    ) -> str:
        """A URL whose holder reads the file ``path`` (a plain GET, no API key) for ``expires_in``
        seconds (at most 7 days), as ``user``. It names this path of this sandbox only, and stops
        working at its expiry or when the sandbox ends (not when the API key that asked is revoked:
        it is signed for the key's tenant).
        base_url: the server's address as its users reach it (default: the server this Sandbox talks
        to; in process: this home's ``[server]`` address, where ``warmbox serve`` listens)."""
        return await self._signed(path, False, expires_in, user, base_url)

    async def upload_url(
        self, path: str, *, expires_in: float = 3600.0, user: str = "user", base_url: str | None = None
    ) -> str:
        """A URL whose holder writes the file ``path``: a PUT or POST of the file's bytes as the raw
        body (it replaces the file when complete; the answer is its EntryInfo as JSON). As
        :meth:`download_url` otherwise."""
        return await self._signed(path, True, expires_in, user, base_url)

    async def _signed(self, path: str, write: bool, expires_in: float, user: str, base_url: str | None) -> str:
        base = base_url if base_url is not None else _server_url(self._sb._transport)
        if not base.startswith(("http://", "https://")):
            raise InvalidArgument(f"base_url must be http(s)://host[:port], got {base!r}")
        sb = self._sb
        url = await sb._run(ops.SignFileUrl(sb.sandbox_id, path, write=write, user=user, expires_in=expires_in))
        return base.rstrip("/") + url


def _server_url(transport: Transport) -> str:
    """The address of the server a transport's operations go to, for the URLs it signs."""
    if isinstance(transport, LocalTransport):
        server = transport.front.engine.settings().server
        return f"{'https' if server.tls_cert else 'http'}://{server.host}:{server.port}"
    # here, not at the top: aiohttp (~120 ms) only where a server is addressed (issue 38); an
    # HttpTransport given has loaded it already
    from warmbox.sdk.http import HttpTransport

    if isinstance(transport, HttpTransport):
        if transport.base_url is None:
            raise InvalidArgument("a server reached over a unix socket has no URL to sign: pass base_url=")
        return transport.base_url
    raise InvalidArgument("this transport has no server address: pass base_url=")


def _local_dir(path: object, *, create: bool) -> int:
    """An fd of a local directory given by the caller (made if ``create``); InvalidArgument otherwise."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgument(f"a local directory path must be a str or path, got {type(path).__name__}")
    if create:
        os.makedirs(path, exist_ok=True)
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise InvalidArgument(f"{os.fspath(path)!r} is not a local directory") from None


class _Packer:
    """A local directory packed (safetar.pack) on a worker thread into chunks for ``async for``;
    at most a few chunks wait between the two (the thread blocks while the sandbox is slower)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=4)
        self._stopped = threading.Event()
        self._thread: asyncio.Future[None] | None = None
        self._buf = bytearray()

    # ---- on the worker thread

    def write(self, data: bytes) -> int:  # what tarfile writes
        self._buf += data
        if len(self._buf) >= PACK_CHUNK:
            self._put(bytes(self._buf))
            self._buf.clear()
        return len(data)

    def flush(self) -> None:
        pass

    def _put(self, item: bytes | BaseException | None) -> None:
        while not self._stopped.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise _Stopped

    def _run(self) -> None:
        try:
            try:
                safetar.pack(self._fd, self)  # type: ignore[arg-type]
                if self._buf:
                    self._put(bytes(self._buf))
                self._put(None)
            except _Stopped:
                raise
            except BaseException as e:  # the caller's own directory failed to read: raised to the caller
                self._put(e)
        except _Stopped:
            return

    def _get(self) -> bytes | BaseException | None:
        while True:
            try:
                return self._queue.get(timeout=0.2)
            except queue.Empty:
                if self._stopped.is_set():
                    return None

    # ---- on the event loop

    async def chunks(self) -> AsyncIterator[bytes]:
        self._thread = asyncio.ensure_future(asyncio.to_thread(self._run))
        while True:
            item = await asyncio.to_thread(self._get)
            if isinstance(item, BaseException):
                raise item
            if item is None:
                return
            yield item

    async def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            await self._thread


class _Stopped(Exception):
    pass


_ABORT = object()


async def unpack_stream(chunks: ops.ChunkStream, fd: int, sandbox_id: str) -> None:
    """Unpack a tar stream from the sandbox into the local directory ``fd`` (safetar.extract on a
    worker thread, fed a few chunks ahead). UnsafeArchive for a member outside the directory;
    GuestProtocolError for a stream that is no tar archive. The stream is cancelled on any error."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[object] = asyncio.Queue(maxsize=4)

    class Reader:
        def __init__(self) -> None:
            self.data = b""
            self.eof = False

        def read(self, n: int = -1) -> bytes:  # on the worker thread
            while not self.data and not self.eof:
                item = asyncio.run_coroutine_threadsafe(q.get(), loop).result()
                if item is _ABORT:
                    raise _Stopped
                if item is None:
                    self.eof = True
                else:
                    assert isinstance(item, bytes)
                    self.data = item
            n = len(self.data) if n < 0 else n
            out, self.data = self.data[:n], self.data[n:]
            return out

    work = asyncio.ensure_future(asyncio.to_thread(safetar.extract, Reader(), fd))  # type: ignore[arg-type]
    try:
        while not work.done():
            chunk = await chunks.next()
            put = asyncio.ensure_future(q.put(chunk))
            await asyncio.wait({put, work}, return_when=asyncio.FIRST_COMPLETED)
            if not put.done():
                put.cancel()
            if chunk is None:
                break
        try:
            await work
        except safetar.UnsafeArchive as e:
            raise UnsafeArchive(f"download refused: {e}", sandbox_id) from None
        except tarfile.TarError as e:
            raise GuestProtocolError(f"the sandbox sent a malformed archive: {e}", sandbox_id) from None
    finally:
        chunks.cancel()
        if not work.done():
            while not q.empty():
                q.get_nowait()
            q.put_nowait(_ABORT)
            with contextlib.suppress(BaseException):
                await work


@runtime_checkable
class SupportsRead(Protocol):
    """A binary file object (``open(p, "rb")``, ``io.BytesIO``, a socket's makefile)."""

    def read(self, size: int = -1, /) -> bytes: ...


FileData = str | bytes | SupportsRead | Iterable[bytes] | AsyncIterable[bytes]


async def _chunks(data: object) -> AsyncIterator[bytes]:
    """A streamed write's source as bytes chunks; a file object is read off the event loop."""
    if isinstance(data, SupportsRead):
        while True:
            chunk = await asyncio.to_thread(data.read, STREAM_CHUNK)
            if not chunk:
                return
            yield _as_bytes(chunk)
    elif isinstance(data, AsyncIterable):
        async for chunk in data:
            yield _as_bytes(chunk)
    else:
        assert isinstance(data, Iterable)
        for chunk in data:
            yield _as_bytes(chunk)


def _as_bytes(chunk: object) -> bytes:
    if isinstance(chunk, bytes):
        return chunk
    if isinstance(chunk, (bytearray, memoryview)):
        return bytes(chunk)
    raise InvalidArgument(f"a streamed write's chunks must be bytes, got {type(chunk).__name__}")


def _stream_too_large(e: FileTooLarge) -> FileTooLarge:
    """A stream's FileTooLarge (only with a max_bytes given), saying which argument to change."""
    return FileTooLarge(f"{e} (a larger max_bytes=N, or none: a stream has no cap)", e.sandbox_id)


class AsyncFileStream:
    """What ``files.read(path, format="stream")`` returns: the file's bytes in chunks (up to
    256 KiB each) for ``async for`` (the sync Sandbox's twin: ``for``). Flow-controlled: the
    sandbox sends a few MiB ahead of what was taken, no more. close() (or leaving a ``with``
    block, or dropping the stream) stops the read in the sandbox; an error (FileTooLarge when
    the file grew past max_bytes, SandboxTimeout when a chunk took longer than the timeout)
    is raised by the iteration, after the chunks that came before it."""

    def __init__(self, chunks: ops.ChunkStream) -> None:
        self._path = chunks.path
        self._chunks = chunks
        self._loop = asyncio.get_running_loop()
        self._first: bytes | None = None

    @property
    def path(self) -> str:
        return self._path

    @property
    def bytes_read(self) -> int:
        """Bytes received so far."""
        return self._chunks.received

    async def _start(self) -> None:
        """Wait for the first answer, so a missing file or a FIFO raises from files.read itself."""
        self._first = await self._next()

    async def _next(self) -> bytes | None:
        try:
            return await self._chunks.next()
        except FileTooLarge as e:
            raise _stream_too_large(e) from None

    def __aiter__(self) -> AsyncFileStream:
        return self

    async def __anext__(self) -> bytes:
        data, self._first = self._first, None
        if data is None and not self._chunks.done:
            data = await self._next()
        if data is None:
            raise StopAsyncIteration
        return data

    async def close(self) -> None:
        """Stop the read (in the sandbox too); what was not taken is dropped. Idempotent."""
        self._first = None
        self._chunks.cancel()

    async def __aenter__(self) -> AsyncFileStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __del__(self) -> None:
        chunks = self.__dict__.get("_chunks")
        if chunks is not None and not chunks.done:
            try:
                self._loop.call_soon_threadsafe(chunks.cancel)
            except RuntimeError:  # the loop is closed: so is the connection
                pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={self._path!r}, bytes_read={self.bytes_read})"


class AsyncWatchHandle:
    """What ``files.watch_dir`` returns: stop() ends the watch (in the sandbox too); wait() until it
    ends (the directory was removed, or an error: raised, as is an exception of the callback)."""

    def __init__(self, watch: ops.DirWatch) -> None:
        self._watch = watch

    @property
    def stopped(self) -> bool:
        """The watch is over (stopped, the directory went, or it failed)."""
        return self._watch.done

    async def stop(self) -> None:
        """Stop watching; idempotent."""
        self._watch.stop()

    async def wait(self, timeout: float | None = None) -> None:
        """Until the watch ends; timeout: seconds (None: no bound), then TimeoutError."""
        await asyncio.wait_for(self._watch.wait(), timeout)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(stopped={self.stopped})"


FileStream = synchronize(AsyncFileStream, "FileStream")
WatchHandle = synchronize(AsyncWatchHandle, "WatchHandle")

__all__ = ["AsyncFileStream", "AsyncFiles", "AsyncWatchHandle", "FileStream", "WatchHandle"]
