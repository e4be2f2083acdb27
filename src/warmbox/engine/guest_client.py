"""Host side of the wire protocol: one multiplexed connection to a sandbox's guest agent.

Everything read from the guest is decoded into the closed set of guest->host messages; a
frame outside it closes the connection with :class:`GuestProtocolError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import stat
from collections.abc import AsyncIterator

from warmbox import protocol as p
from warmbox.errors import GuestConnectionError, GuestProtocolError, InvalidArgument, SandboxTimeout

_END = object()
_OVERFLOW = object()
READ_WINDOW = 4 << 20  # bytes a ReadFile may have in flight: what a slow reader holds on the host at most


class GuestClient:
    """A connection to one guest agent. Requests are concurrent; each gets its own frame stream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sandbox_id: str) -> None:
        self._reader = reader
        self._writer = writer
        self.sandbox_id = sandbox_id
        self._ids = itertools.count(1)
        self._streams: dict[int, Stream] = {}
        self._error: Exception | None = None
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(cls, socket_path: str, sandbox_id: str) -> GuestClient:
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
                stream = self._streams.get(msg.id)
                if stream is not None:
                    stream._feed(msg)
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
        for stream in self._streams.values():
            stream._q.put_nowait(_END)
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

    async def open(self, make, timeout: float | None = None, budget: int | None = None) -> Stream:
        """Send ``make(id)``; the :class:`Stream` of the guest's answers, until its ``close()``.

        timeout: seconds, wall clock, for the whole exchange — the host's own bound, so a
        guest that never answers cannot hang the caller (SandboxTimeout). budget: bytes of
        Chunk data the stream may hold untaken; a guest that sends more violates the protocol.
        """
        rid = next(self._ids)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        stream = Stream(self, rid, deadline, budget)
        self._streams[rid] = stream
        try:
            await self.send(make(rid))
        except BaseException:
            stream.close()
            raise
        return stream

    @contextlib.asynccontextmanager
    async def request(self, make, timeout: float | None = None) -> AsyncIterator[Stream]:
        """Send ``make(id)`` and yield a :class:`Stream` of the guest's answers to it (see open)."""
        stream = await self.open(make, timeout)
        try:
            yield stream
        finally:
            stream.close()

    async def read_file(self, path: str, *, max_bytes: int, timeout: float | None = None,
                        window: int = READ_WINDOW) -> FileRead:
        """Start a flow-controlled ReadFile of ``path`` (see :class:`FileRead`)."""
        stream = await self.open(lambda i: p.ReadFile(i, path=path, max_bytes=max_bytes, window=window),
                                 timeout, budget=window + p.CHUNK if window else None)
        return FileRead(stream, max_bytes, window)

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

    def __init__(self, client: GuestClient, rid: int, deadline: float | None = None,
                 budget: int | None = None) -> None:
        self.client = client
        self.id = rid
        self._q: asyncio.Queue = asyncio.Queue()
        self._deadline = deadline
        self._budget = budget
        self._held = 0  # bytes of Chunk data queued, not yet taken

    def _feed(self, msg: p.Message) -> None:
        """A frame from the read loop."""
        if self._budget is not None and isinstance(msg, p.Chunk):
            if self._held < 0:  # overflowed before: the rest is dropped
                return
            self._held += len(msg.data)
            if self._held > self._budget:
                self._held = -1
                self._q.put_nowait(_OVERFLOW)
                return
        self._q.put_nowait(msg)

    async def get(self, timeout: float | None = None) -> p.Message:
        """The next frame; ``timeout`` (seconds) bounds this one wait, on top of the deadline."""
        waits = [] if timeout is None else [timeout]
        if self._deadline is not None:
            waits.append(self._deadline - asyncio.get_running_loop().time())
        if not waits:
            item = await self._q.get()
        else:
            try:
                item = await asyncio.wait_for(self._q.get(), max(min(waits), 0))
            except TimeoutError:
                raise SandboxTimeout("the guest agent did not finish in time (host-side bound)",
                                     self.client.sandbox_id) from None
        if item is _END:
            self._q.put_nowait(_END)
            assert self.client._error is not None
            raise self.client._error
        if item is _OVERFLOW:
            raise GuestProtocolError("the guest sent more file data than the read's window", self.client.sandbox_id)
        if self._budget is not None and isinstance(item, p.Chunk):
            self._held -= len(item.data)
        return item

    def close(self) -> None:
        """Stop routing the guest's answers here (later ones are dropped); idempotent."""
        if self.client._streams.get(self.id) is self:
            del self.client._streams[self.id]

    def cancel(self) -> None:
        """Tell the guest to stop this request (a ReadFile), then close; no-op once closed. On the loop."""
        if self.client._streams.get(self.id) is not self:
            return
        self.close()
        if self.client._error is None:
            with contextlib.suppress(Exception):  # best effort: a broken connection ends the read anyway
                self.client._writer.write(p.encode(p.Cancel(self.id)))

    async def next(self, *expect: type[p.Message], timeout: float | None = None) -> p.Message:
        """Next frame, which must be one of ``expect`` or a Failure."""
        msg = await self.get(timeout)
        if not isinstance(msg, (p.Failure, *expect)):
            raise GuestProtocolError(
                f"guest answered {type(msg).__name__}, expected {'/'.join(e.__name__ for e in expect)}",
                self.client.sandbox_id)
        return msg

    async def send(self, msg: p.Message) -> None:
        await self.client.send(msg)


class FileRead:
    """One ReadFile, flow-controlled: the guest sends at most ``window`` bytes beyond what was
    taken here, so a slow consumer holds at most that much on the host; never more than
    ``max_bytes`` in all. Whoever stops before the end calls :meth:`cancel` (the guest stops)."""

    def __init__(self, stream: Stream, max_bytes: int, window: int) -> None:
        self.stream = stream
        self.max_bytes = max_bytes
        self.received = 0
        self.done = False
        self._ack_every = max(1, window // 4)
        self._unacked = 0

    async def next(self, timeout: float | None = None) -> p.Message:
        """The next Chunk, ChunkEnd or Failure (after the last two the read is over). timeout:
        seconds for this one wait (SandboxTimeout; the read is cancelled on any error)."""
        if self.done:
            raise RuntimeError("the read is over")
        try:
            msg = await self.stream.next(p.Chunk, p.ChunkEnd, timeout=timeout)
            if isinstance(msg, p.Chunk):
                self.received += len(msg.data)
                if self.received > self.max_bytes:
                    raise GuestProtocolError(f"the guest sent more than max_bytes ({self.max_bytes})",
                                             self.stream.client.sandbox_id)
                self._unacked += len(msg.data)
                if self._unacked >= self._ack_every:
                    await self.stream.send(p.ReadAck(self.stream.id, bytes=self._unacked))
                    self._unacked = 0
                return msg
        except BaseException:
            self.cancel()
            raise
        self.done = True
        self.stream.close()
        return msg

    def cancel(self) -> None:
        """Stop the read in the guest (no-op once it is over). Call on the event loop."""
        if not self.done:
            self.done = True
            self.stream.cancel()
