"""``sandbox.files``: read and write the sandbox's filesystem (as the sandbox's user)."""

from __future__ import annotations

import asyncio
import builtins
from typing import TYPE_CHECKING

from warmbox import operations as ops
from warmbox.errors import InvalidArgument, PathNotFound
from warmbox.models import EntryInfo, WriteEntry
from warmbox.sdk._sync import synchronize

if TYPE_CHECKING:
    from warmbox.sdk.sandbox import AsyncSandbox

DEFAULT_READ_MAX_BYTES = 100 << 20
DEFAULT_READ_TIMEOUT_S = 60.0
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

    async def write(self, path: str, data: str | bytes, *, mode: int = 0o644, append: bool = False) -> EntryInfo:
        """Create or replace a file (parent directories are created); returns its entry."""
        return await self._sb._run(ops.WriteFile(self._sb.sandbox_id, path, data, mode=mode, append=append))

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
