"""Host side of the wire protocol: one multiplexed connection to a sandbox's guest agent.

Everything read from the guest is decoded into the closed set of guest->host messages; a
frame outside it closes the connection with :class:`GuestProtocolError`.

The connection is an :class:`asyncio.Protocol`: frames are parsed in ``data_received`` and
handed straight to the waiting request (one event-loop pass from the socket to the caller),
and each request's deadline is one timer, not a timeout task per frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import stat
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import cast

from warmbox import protocol as p
from warmbox.errors import GuestConnectionError, GuestProtocolError, InvalidArgument, SandboxError, SandboxTimeout

_END = object()
_OVERFLOW = object()
_FLOOD = object()
OUTPUT_BACKLOG = 4 << 20  # bytes of a followed process's output the host holds for a slow reader
OUTPUT_BACKLOG_TOTAL = 16 << 20  # the same, for all followers of one sandbox together
MAX_QUEUED = 1024  # frames a bounded stream holds untaken (besides its data's byte bound)
READ_WINDOW = 4 << 20  # bytes a ReadFile may have in flight: what a slow reader holds on the host at most
WRITE_WINDOW = 1 << 20  # bytes a WriteFile may have in flight beyond the guest's acks (4 chunks)
UPLOAD_WAIT_S = 120.0  # the longest the guest may take to write one window (or to finish an upload)


class GuestClient(asyncio.Protocol):
    """A connection to one guest agent. Requests are concurrent; each gets its own frame stream."""

    def __init__(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id
        self._loop = asyncio.get_running_loop()
        self._ids = itertools.count(1)
        self._streams: dict[int, Stream] = {}
        self._error: Exception | None = None
        self._frames = p.FrameReader(p.GUEST_TO_HOST)
        self._transport: asyncio.Transport | None = None
        self._paused: asyncio.Future[None] | None = None  # set while the transport's buffer is full
        self._lost: asyncio.Future[None] = self._loop.create_future()
        self._backlog = 0  # output bytes all lossy streams hold untaken (at most OUTPUT_BACKLOG_TOTAL)

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
            client = cls(sandbox_id)
            await client._loop.create_unix_connection(lambda: client, f"/proc/self/fd/{fd}")
        except OSError as e:
            raise GuestConnectionError(f"cannot reach the guest agent: {e.strerror or e}", sandbox_id) from None
        finally:
            os.close(fd)
        return client

    # ---- asyncio.Protocol (called by the event loop)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # not an isinstance check: uvloop's transports have asyncio.Transport's methods but not its
        # class, and that assertion failed every start under uvloop (at the agent's first request)
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._error is not None:
            return
        frames = self._frames
        frames.feed(data)
        try:
            while (msg := frames.next()) is not None:
                stream = self._streams.get(msg.id)
                if stream is not None:
                    stream._feed(msg)
                elif isinstance(msg, p.Failure) and msg.id == 0:
                    self._fail(GuestProtocolError(f"guest rejected a frame: {msg.message}", self.sandbox_id))
                    return
        except p.ProtocolViolation as e:
            self._fail(GuestProtocolError(f"guest violated the protocol: {e}", self.sandbox_id))

    def eof_received(self) -> bool:
        self._fail(GuestConnectionError("connection to the guest agent closed", self.sandbox_id))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(GuestConnectionError("connection to the guest agent closed", self.sandbox_id))
        if not self._lost.done():
            self._lost.set_result(None)

    def pause_writing(self) -> None:
        if self._paused is None:
            self._paused = self._loop.create_future()

    def resume_writing(self) -> None:
        paused, self._paused = self._paused, None
        if paused is not None and not paused.done():
            paused.set_result(None)

    def _fail(self, err: Exception) -> None:
        """The connection is over (the first reason sticks): every stream ends with ``err``."""
        if self._error is not None:
            return
        self._error = err
        for stream in self._streams.values():
            stream._feed(_END)
        self.resume_writing()  # a sender waiting for room sees the error
        if self._transport is not None:
            self._transport.close()

    # ---- requests

    async def send(self, msg: p.Message) -> None:
        if self._error is not None:
            raise self._error
        try:
            frame = p.encode(msg)
        except p.ProtocolViolation as e:
            raise InvalidArgument(f"request too large for the sandbox protocol: {e}") from None
        assert self._transport is not None
        self._transport.write(frame)
        if self._paused is not None:  # flow control: wait until the transport's buffer drained
            await asyncio.shield(self._paused)  # one sender's cancellation must not end the others' wait
            if self._error is not None:
                raise GuestConnectionError("connection to the guest agent closed", self.sandbox_id)

    async def open(
        self,
        make: Callable[[int], p.Message],
        timeout: float | None = None,
        budget: int | None = None,
        *,
        frames: int | None = None,
        lossy: int | None = None,
    ) -> Stream:
        """Send ``make(id)``; the :class:`Stream` of the guest's answers, until its ``close()``.

        timeout: seconds, wall clock, for the whole exchange — the host's own bound, so a
        guest that never answers cannot hang the caller (SandboxTimeout). budget: bytes of
        Chunk data the stream may hold untaken; a guest that sends more violates the protocol.
        frames: frames it may hold untaken (more: GuestProtocolError). lossy: bytes of
        Stdout/Stderr data it may hold untaken; beyond them output is dropped and the reader gets
        an OutputLost of its size before the next frame kept (a live process's output has no
        flow control: a reader slower than the process must not grow the host).
        """
        rid = next(self._ids)
        deadline = None if timeout is None else self._loop.time() + timeout
        stream = Stream(self, rid, deadline, budget, frames=frames, lossy=lossy)
        self._streams[rid] = stream
        try:
            await self.send(make(rid))
        except BaseException:
            stream.close()
            raise
        return stream

    def request(self, make: Callable[[int], p.Message], timeout: float | None = None) -> _Request:
        """``async with client.request(make) as stream``: send ``make(id)`` and get the
        :class:`Stream` of the guest's answers to it, closed on exit (see open)."""
        return _Request(self, make, timeout)

    async def read_file(
        self, path: str, *, max_bytes: int, timeout: float | None = None, window: int = READ_WINDOW
    ) -> FileRead:
        """Start a flow-controlled ReadFile of ``path`` (see :class:`FileRead`)."""
        return await self.read_stream(
            lambda i: p.ReadFile(i, path=path, max_bytes=max_bytes, window=window), max_bytes, timeout, window
        )

    async def read_stream(
        self, make: Callable[[int], p.Message], max_bytes: int, timeout: float | None, window: int = READ_WINDOW
    ) -> FileRead:
        """Send ``make(id)`` (a ReadFile or TarCreate with this ``window``) and read its answer as a
        flow-controlled :class:`FileRead`."""
        stream = await self.open(make, timeout, budget=window + p.CHUNK if window else None)
        return FileRead(stream, max_bytes, window)

    async def call(self, make: Callable[[int], p.Message], expect: type[p.Message]) -> p.Message:
        """One request, one answer of type ``expect`` (a Failure is returned as-is)."""
        stream = await self.open(make)
        try:
            return await stream.next(expect)
        finally:
            stream.close()

    async def upload(
        self,
        path: str,
        data: bytes | AsyncIterator[bytes],
        *,
        mode: int = 0o644,
        append: bool = False,
        atomic: bool = False,
        window: int = WRITE_WINDOW,
        wait: float | None = UPLOAD_WAIT_S,
    ) -> p.Message:
        """Write ``data`` (bytes, or chunks of any size taken one at a time) to ``path`` in the
        sandbox: the file's Entry, or the guest's Failure. Flow-controlled: at most ``window``
        bytes are sent beyond what the guest wrote, so the host holds the chunk being sent and no
        more; a source that raises ends the upload (an atomic one leaves the target as it was).
        wait: seconds the guest may take for each answer (SandboxTimeout), not for the whole upload."""
        return await self.send_stream(
            lambda i: p.WriteFile(i, path=path, mode=mode, append=append, window=window, atomic=atomic),
            data,
            window=window,
            wait=wait,
        )

    async def send_stream(
        self,
        make: Callable[[int], p.Message],
        data: bytes | AsyncIterator[bytes],
        *,
        window: int = WRITE_WINDOW,
        wait: float | None = UPLOAD_WAIT_S,
    ) -> p.Message:
        """Send ``make(id)`` (a WriteFile or TarExtract with this ``window``), then ``data`` as its
        flow-controlled Chunk frames (see upload); the guest's last answer, or its Failure."""
        async with self.request(make) as stream:
            ready = await stream.next(p.Ok, timeout=wait)
            if isinstance(ready, p.Failure):
                return ready
            try:
                return await self._send_data(stream, data, window, wait)
            except BaseException:  # the source failed, a bound expired, the caller gave up
                stream.cancel()  # the guest abandons the upload (an atomic one leaves no trace)
                raise

    async def _send_data(
        self, stream: Stream, data: bytes | AsyncIterator[bytes], window: int, wait: float | None
    ) -> p.Message:
        sent = acked = 0
        chunks: AsyncIterator[bytes] = _pieces(data) if isinstance(data, bytes) else data
        async for chunk in chunks:
            for off in range(0, len(chunk), p.CHUNK):
                piece = chunk[off : off + p.CHUNK]
                while True:  # the guest's acks so far; wait for one while the window is full
                    full = window and sent - acked >= window
                    msg = await stream.next(p.WriteAck, timeout=wait) if full else stream.poll()
                    if msg is None:
                        break
                    if isinstance(msg, p.Failure):
                        return msg
                    if not isinstance(msg, p.WriteAck) or msg.bytes <= 0:
                        what = type(msg).__name__
                        raise GuestProtocolError(f"guest answered {what} during an upload", self.sandbox_id)
                    acked += msg.bytes
                await stream.send(p.Chunk(stream.id, data=piece))
                sent += len(piece)
        await stream.send(p.ChunkEnd(stream.id))
        while True:
            end = await stream.next(p.WriteAck, p.Entry, timeout=wait)
            if not isinstance(end, p.WriteAck):
                return end

    async def close(self) -> None:
        self._fail(GuestConnectionError("client closed", self.sandbox_id))
        if self._transport is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._lost)

    async def wait_lost(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until the agent has ended the connection; whether it did."""
        if self._transport is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self._lost), timeout)
        except TimeoutError:
            return False
        return True

    @property
    def closed(self) -> bool:
        return self._error is not None


async def _pieces(data: bytes) -> AsyncIterator[bytes]:
    yield data


class _Request:
    """What :meth:`GuestClient.request` returns: a plain async context manager (no generator)."""

    __slots__ = ("_client", "_make", "_stream", "_timeout")

    def __init__(self, client: GuestClient, make: Callable[[int], p.Message], timeout: float | None) -> None:
        self._client = client
        self._make = make
        self._timeout = timeout
        self._stream: Stream | None = None

    async def __aenter__(self) -> Stream:
        self._stream = await self._client.open(self._make, self._timeout)
        return self._stream

    async def __aexit__(self, *exc: object) -> None:
        if self._stream is not None:
            self._stream.close()


class Stream:
    """The frames answering one request."""

    def __init__(
        self,
        client: GuestClient,
        rid: int,
        deadline: float | None = None,
        budget: int | None = None,
        *,
        frames: int | None = None,
        lossy: int | None = None,
    ) -> None:
        self.client = client
        self.id = rid
        self._items: deque = deque()
        self._waiter: asyncio.Future[bool] | None = None  # a get() waiting for the next frame
        self._deadline = deadline
        self._timer: asyncio.TimerHandle | None = None  # the deadline's one timer, from the first wait
        self._budget = budget
        self._held = 0  # bytes of Chunk data queued, not yet taken
        self._frames = MAX_QUEUED if frames is None and lossy is not None else frames
        self._lossy = lossy
        self._dropped = 0  # output bytes dropped (lossy), not yet told to the reader
        self._flooded = False

    def _feed(self, msg: object) -> None:
        """A frame from the connection (or _END)."""
        if msg is not _END and (self._frames is not None or self._lossy is not None):
            if self._flooded:
                return
            if not self._bound(msg):
                return
        if self._budget is not None and isinstance(msg, p.Chunk):
            if self._held < 0:  # overflowed before: the rest is dropped
                return
            self._held += len(msg.data)
            if self._held > self._budget:
                self._held = -1
                msg = _OVERFLOW
        self._items.append(msg)
        self._wake(True)

    def _bound(self, msg: object) -> bool:
        """Apply the frame and lossy bounds to an arriving frame; whether it is queued. A lossy
        stream's data beyond its bounds is dropped (counted); any other frame beyond them (a few
        more are allowed: a process's end after a full backlog) is a flood: GuestProtocolError."""
        queued = len(self._items)
        if self._lossy is not None and isinstance(msg, (p.Stdout, p.Stderr, p.OutputLost)):
            size = msg.size if isinstance(msg, p.OutputLost) else len(msg.data)
            if (
                isinstance(msg, p.OutputLost)
                or queued >= MAX_QUEUED
                or self._held + size > self._lossy
                or self.client._backlog + size > OUTPUT_BACKLOG_TOTAL  # many slow followers
            ):
                self._dropped += max(0, size)  # told to the reader before the next frame kept
                return False
            self._held += size
            self.client._backlog += size
        elif self._frames is not None and queued >= self._frames + (16 if self._lossy is not None else 0):
            self._flooded = True
            self._items.append(_FLOOD)
            self._wake(True)
            return False
        if self._dropped:
            self._items.append(p.OutputLost(self.id, size=self._dropped))
            self._dropped = 0
        return True

    def _wake(self, arrived: bool) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(arrived)

    def _timed_out(self) -> SandboxTimeout:
        return SandboxTimeout("the guest agent did not finish in time (host-side bound)", self.client.sandbox_id)

    async def get(self, timeout: float | None = None) -> p.Message:
        """The next frame; ``timeout`` (seconds) bounds this one wait, on top of the deadline."""
        loop = self.client._loop
        if self._deadline is not None and loop.time() >= self._deadline:
            raise self._timed_out()
        if not self._items:
            if self._waiter is not None:
                raise RuntimeError("another get() of this stream is waiting")
            waiter = self._waiter = loop.create_future()
            if self._deadline is not None and self._timer is None:
                self._timer = loop.call_at(self._deadline, self._wake, False)
            handle = None if timeout is None else loop.call_later(max(timeout, 0), self._wake, False)
            try:
                arrived = await waiter
            finally:
                self._waiter = None
                if handle is not None:
                    handle.cancel()
            if not arrived:
                raise self._timed_out()
        item = self._items[0]
        if item is _END:  # stays: every later get() raises too
            assert self.client._error is not None
            raise self.client._error
        return self._take()

    def _take(self) -> p.Message:
        """Take the first queued item (not _END); typed errors for the bounds' markers."""
        item = self._items[0]
        if item is _FLOOD:  # stays: every later call raises too
            raise GuestProtocolError(
                "the guest sent more frames than the host holds for a reader", self.client.sandbox_id
            )
        self._items.popleft()
        if item is _OVERFLOW:
            raise GuestProtocolError("the guest sent more file data than the read's window", self.client.sandbox_id)
        if self._budget is not None and isinstance(item, p.Chunk):
            self._held -= len(item.data)
        elif self._lossy is not None and isinstance(item, (p.Stdout, p.Stderr)):
            self._held -= len(item.data)
            self.client._backlog -= len(item.data)
        assert isinstance(item, p.Message)
        return item

    def close(self) -> None:
        """Stop routing the guest's answers here (later ones are dropped); idempotent."""
        if self.client._streams.get(self.id) is self:
            del self.client._streams[self.id]
            if self._lossy is not None:  # what it holds no longer counts against the others
                self.client._backlog -= self._held
                self._held = 0
                self._items = deque(i for i in self._items if not isinstance(i, (p.Stdout, p.Stderr)))
        if self._timer is not None and self._waiter is None:  # a get() still waiting keeps its bound
            self._timer.cancel()
            self._timer = None

    def cancel(self) -> None:
        """Tell the guest to stop this request (a ReadFile), then close; no-op once closed. On the loop."""
        if self.client._streams.get(self.id) is not self:
            return
        self.close()
        if self.client._error is None and self.client._transport is not None:
            with contextlib.suppress(Exception):  # best effort: a broken connection ends the read anyway
                self.client._transport.write(p.encode(p.Cancel(self.id)))

    def poll(self) -> p.Message | None:
        """The next frame if one has arrived, else None (never waits); errors as in get()."""
        if not self._items:
            return None
        item = self._items[0]
        if item is _END:  # stays: every later call raises too
            assert self.client._error is not None
            raise self.client._error
        return self._take()

    async def next(self, *expect: type[p.Message], timeout: float | None = None) -> p.Message:
        """Next frame, which must be one of ``expect`` or a Failure."""
        msg = await self.get(timeout)
        if not isinstance(msg, (p.Failure, *expect)):
            raise GuestProtocolError(
                f"guest answered {type(msg).__name__}, expected {'/'.join(e.__name__ for e in expect)}",
                self.client.sandbox_id,
            )
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
                    raise GuestProtocolError(
                        f"the guest sent more than max_bytes ({self.max_bytes})", self.stream.client.sandbox_id
                    )
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


PORT_WINDOW = 1 << 20  # bytes a port tunnel may have in flight each way


class PortTunnel(Stream):
    """One PortConnect after its Ok: a byte stream to a TCP connection inside the sandbox.

    Flow-controlled both ways (see protocol.PortConnect): the guest may hold at most ``window``
    of this side's bytes unacknowledged, and this side holds at most ``window`` + one chunk of the
    guest's untaken; an acknowledgement of more than was sent is a protocol violation. One reader
    and one writer may run at once. :meth:`close` (always, at the end) ends it in the guest.
    """

    def __init__(self, client: GuestClient, rid: int, window: int) -> None:
        super().__init__(client, rid, None, window + p.CHUNK)
        self.window = window
        self._sent = 0
        self._acked = 0
        self._unacked = 0  # taken by read(), not yet acknowledged to the guest
        self._ack_every = max(1, window // 4)
        self._room: asyncio.Future[None] | None = None
        self._bad = ""  # the guest broke the tunnel's rules
        self._failed = ""  # the guest ended the tunnel (its Failure)
        self.eof = False  # the guest's end of data arrived

    def _feed(self, msg: object) -> None:
        if type(msg) is p.PortAck:
            assert isinstance(msg, p.PortAck)
            self._acked += msg.bytes
            if msg.bytes < 0 or self._acked > self._sent:
                self._bad = "the guest acknowledged more port data than it was sent"
                msg = _OVERFLOW
            else:
                self._wake_writer()
                return
        super()._feed(msg)
        if self._held < 0 and not self._bad:
            self._bad = "the guest sent more port data than the tunnel's window"
        if isinstance(msg, p.Failure):
            self._failed = msg.message
        if self._bad or self._failed or msg is _END:
            self._wake_writer()

    def _wake_writer(self) -> None:
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)

    def _check(self) -> None:
        if self._bad:
            raise GuestProtocolError(self._bad, self.client.sandbox_id)
        if self.client._error is not None:
            raise self.client._error

    async def read(self) -> p.Message | None:
        """The next Chunk (its data was taken: the guest may send more), a Failure, or None at the
        guest's end of data."""
        if self.eof:
            return None
        self._check()
        try:
            msg = await self.next(p.Chunk, p.ChunkEnd)
        except GuestProtocolError:
            self._check()  # the tunnel's own reason, if it has one
            raise
        if isinstance(msg, p.ChunkEnd):
            self.eof = True
            return None
        if isinstance(msg, p.Chunk):
            self._unacked += len(msg.data)
            if self._unacked >= self._ack_every:
                await self.send(p.ReadAck(self.id, bytes=self._unacked))
                self._unacked = 0
        return msg

    async def write(self, data: bytes) -> None:
        """Send ``data`` into the connection, waiting while the guest's window is full."""
        view = memoryview(data)
        while view:
            while True:
                self._check()
                if self._failed:
                    raise SandboxError(
                        f"the port connection in the sandbox ended: {self._failed}", self.client.sandbox_id
                    )
                if self._sent - self._acked < self.window:
                    break
                self._room = self.client._loop.create_future()
                await self._room
            n = min(len(view), p.CHUNK, self.window - (self._sent - self._acked))
            self._sent += n
            await self.send(p.Chunk(self.id, data=bytes(view[:n])))
            view = view[n:]

    async def write_eof(self) -> None:
        """This side's end of data (the server reads EOF; it may still answer)."""
        self._check()
        await self.send(p.ChunkEnd(self.id))

    async def answer(self) -> p.Message:
        """The guest's answer to the PortConnect: Ok or a Failure."""
        return await self.next(p.Ok)


async def open_port(client: GuestClient, port: int, window: int = PORT_WINDOW) -> tuple[PortTunnel, p.Message]:
    """Send a PortConnect; the tunnel and the guest's answer (Ok or Failure; on a Failure the
    tunnel is closed already)."""
    rid = next(client._ids)
    tunnel = PortTunnel(client, rid, window)
    client._streams[rid] = tunnel
    try:
        await client.send(p.PortConnect(rid, port=port, window=window))
        answer = await tunnel.answer()
    except BaseException:
        tunnel.cancel()
        raise
    if isinstance(answer, p.Failure):
        tunnel.close()
    return tunnel, answer
