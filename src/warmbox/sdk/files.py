"""``sandbox.files``: read and write the sandbox's filesystem (as the sandbox's user)."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from warmbox import operations as ops
from warmbox.errors import InvalidArgument, PathNotFound
from warmbox.models import EntryInfo, WriteEntry
from warmbox.sdk._sync import synchronize

if TYPE_CHECKING:
    from warmbox.sdk.sandbox import AsyncSandbox

DEFAULT_READ_MAX_BYTES = 100 << 20
DEFAULT_READ_TIMEOUT_S = 60.0
STREAM_CHUNK = 1 << 20  # bytes read from a file object at a time for a streamed write
WORKDIR = "/workspace"


class AsyncFiles:
    """``sandbox.files``: read and write the sandbox's filesystem (as the sandbox's user)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def read(
        self,
        path: str,
        *,
        format: str = "text",
        max_bytes: int = DEFAULT_READ_MAX_BYTES,
        timeout: float | None = DEFAULT_READ_TIMEOUT_S,
    ) -> str | bytes | AsyncFileStream:
        """A regular file's contents: ``format`` "text" (UTF-8), "bytes", or "stream" (an async
        iterator of bytes chunks, for ``async for``; the sync Sandbox: an iterator, ``for``).

        Symlinks are followed; a FIFO, device or socket raises NotARegularFile without being
        read. max_bytes: a larger file raises FileTooLarge (nothing partial is returned; a
        stream raises it after what fits), at most that much is ever held. A stream holds a few
        MiB at most however slowly it is consumed: use it for large files; close() it (or use
        ``with``) to stop early. timeout: seconds (None: no bound) for the whole read, or, for
        a stream, for each chunk; on expiry SandboxTimeout, and the read stops in the sandbox.
        """
        sb = self._sb
        if format not in ("text", "bytes", "stream"):
            raise InvalidArgument(f"format must be 'text', 'bytes' or 'stream', got {format!r}")
        if format == "stream":
            chunks = await sb._run(ops.ReadFileStream(sb.sandbox_id, path, max_bytes=max_bytes, timeout=timeout))
            stream = AsyncFileStream(chunks)
            await stream._start()
            return stream
        data = await sb._run(ops.ReadFile(sb.sandbox_id, path, max_bytes=max_bytes, timeout=timeout))
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
        self._first = await self._chunks.next()

    def __aiter__(self) -> AsyncFileStream:
        return self

    async def __anext__(self) -> bytes:
        data, self._first = self._first, None
        if data is None and not self._chunks.done:
            data = await self._chunks.next()
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


FileStream = synchronize(AsyncFileStream, "FileStream")

__all__ = ["AsyncFileStream", "AsyncFiles", "FileStream"]
