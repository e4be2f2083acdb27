"""Host side of the wire protocol: one multiplexed connection to a sandbox's guest agent.

Everything read from the guest is decoded into the closed set of guest->host messages; a
frame outside it closes the connection with :class:`GuestProtocolError`.
"""

from __future__ import annotations

import asyncio
import os
import stat
import contextlib
import itertools
from collections.abc import AsyncIterator

from warmbox import protocol as p
from warmbox.errors import GuestConnectionError, GuestProtocolError, InvalidArgument, SandboxTimeout

_END = object()


class GuestClient:
    """A connection to one guest agent. Requests are concurrent; each gets its own frame stream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sandbox_id: str) -> None:
        self._reader = reader
        self._writer = writer
        self.sandbox_id = sandbox_id
        self._ids = itertools.count(1)
        self._streams: dict[int, asyncio.Queue] = {}
        self._error: Exception | None = None
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(cls, socket_path: str, sandbox_id: str) -> "GuestClient":
        """Connect to the agent's socket. The last path component may live in a directory the
        guest can write (gVisor tier): it is opened with O_PATH|O_NOFOLLOW and must be a socket,
        and the connection goes to that very inode (/proc/self/fd/N), so a symlink or a file the
        guest swapped in cannot point the host at some other host socket."""
        try:
            fd = os.open(socket_path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise GuestConnectionError(f"cannot reach the guest agent: {e.strerror or e}", sandbox_id) from None
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                raise GuestConnectionError("the guest agent's socket path is not a socket", sandbox_id)
            reader, writer = await asyncio.open_unix_connection(f"/proc/self/fd/{fd}", limit=p.MAX_FRAME)
        except OSError as e:
            raise GuestConnectionError(f"cannot reach the guest agent: {e.strerror or e}", sandbox_id) from None
        finally:
            os.close(fd)
        return cls(reader, writer, sandbox_id)

    async def _read_loop(self) -> None:
        err: Exception
        try:
            while True:
                prefix = await self._reader.readexactly(p.PREFIX_SIZE)
                hlen, blen = p.split_prefix(prefix)
                header = await self._reader.readexactly(hlen)
                body = await self._reader.readexactly(blen) if blen else b""
                msg = p.decode(header, body, p.GUEST_TO_HOST)
                q = self._streams.get(msg.id)
                if q is not None:
                    q.put_nowait(msg)
                elif isinstance(msg, p.Failure) and msg.id == 0:
                    raise GuestProtocolError(f"guest rejected a frame: {msg.message}", self.sandbox_id)
        except p.ProtocolViolation as e:
            err = GuestProtocolError(f"guest violated the protocol: {e}", self.sandbox_id)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            err = GuestConnectionError("connection to the guest agent closed", self.sandbox_id)
        except GuestProtocolError as e:
            err = e
        except asyncio.CancelledError:
            err = GuestConnectionError("client closed", self.sandbox_id)
        self._error = err
        for q in self._streams.values():
            q.put_nowait(_END)
        self._writer.close()

    async def send(self, msg: p.Message) -> None:
        if self._error is not None:
            raise self._error
        try:
            frame = p.encode(msg)
        except p.ProtocolViolation as e:
            raise InvalidArgument(f"request too large for the sandbox protocol: {e}") from None
        self._writer.write(frame)
        try:
            await self._writer.drain()
        except (ConnectionError, OSError):
            raise GuestConnectionError("connection to the guest agent closed", self.sandbox_id) from None

    @contextlib.asynccontextmanager
    async def request(self, make, timeout: float | None = None) -> AsyncIterator["Stream"]:
        """Send ``make(id)`` and yield a :class:`Stream` of the guest's answers to it.

        timeout: seconds, wall clock, for the whole exchange — the host's own bound, so a
        guest that never answers cannot hang the caller (SandboxTimeout).
        """
        rid = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            await self.send(make(rid))
            yield Stream(self, rid, q, deadline)
        finally:
            self._streams.pop(rid, None)

    async def call(self, make, expect: type[p.Message]) -> p.Message:
        """One request, one answer of type ``expect`` (a Failure is returned as-is)."""
        async with self.request(make) as stream:
            return await stream.next(expect)

    async def upload(self, path: str, data: bytes, *, mode: int = 0o644, append: bool = False) -> p.Message:
        """Write ``data`` to ``path`` in the sandbox: the file's Entry, or the guest's Failure."""
        async with self.request(lambda i: p.WriteFile(i, path=path, mode=mode, append=append)) as stream:
            ready = await stream.next(p.Ok)
            if isinstance(ready, p.Failure):
                return ready
            for off in range(0, len(data), p.CHUNK):
                await stream.send(p.Chunk(stream.id, data=data[off:off + p.CHUNK]))
            await stream.send(p.ChunkEnd(stream.id))
            return await stream.next(p.Entry)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    @property
    def closed(self) -> bool:
        return self._error is not None


class Stream:
    """The frames answering one request."""

    def __init__(self, client: GuestClient, rid: int, q: asyncio.Queue, deadline: float | None = None) -> None:
        self.client = client
        self.id = rid
        self._q = q
        self._deadline = deadline

    async def get(self) -> p.Message:
        if self._deadline is None:
            item = await self._q.get()
        else:
            remaining = self._deadline - asyncio.get_running_loop().time()
            try:
                item = await asyncio.wait_for(self._q.get(), max(remaining, 0))
            except asyncio.TimeoutError:
                raise SandboxTimeout("the guest agent did not finish in time (host-side bound)",
                                     self.client.sandbox_id) from None
        if item is _END:
            self._q.put_nowait(_END)
            assert self.client._error is not None
            raise self.client._error
        return item

    async def next(self, *expect: type[p.Message]) -> p.Message:
        """Next frame, which must be one of ``expect`` or a Failure."""
        msg = await self.get()
        if not isinstance(msg, (p.Failure, *expect)):
            raise GuestProtocolError(
                f"guest answered {type(msg).__name__}, expected {'/'.join(e.__name__ for e in expect)}",
                self.client.sandbox_id)
        return msg

    async def send(self, msg: p.Message) -> None:
        await self.client.send(msg)
