"""The host's GuestClient against scripted agents on a temp socket: deadlines, violations, flow control."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from warmbox import protocol as p
from warmbox.engine.guest_client import GuestClient
from warmbox.errors import GuestConnectionError, GuestProtocolError, SandboxTimeout


class FakeAgent:
    """Accepts one connection and runs ``script(conn, reader)`` on it in a thread."""

    def __init__(self, path: Path, script: Callable[[socket.socket, p.SocketReader], None]) -> None:
        self.path = str(path)
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(self.path)
        self.listener.listen(1)
        self.seen: list[p.Message] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            conn, _ = self.listener.accept()
            try:
                script(conn, _Recording(p.SocketReader(conn, p.HOST_TO_GUEST), self.seen))
            except OSError:
                pass
            except BaseException as e:  # surfaced by the test
                self.error = e
            finally:
                self.stop.wait(10)
                conn.close()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.listener.close()
        assert self.error is None, self.error


class _Recording:
    def __init__(self, reader: p.SocketReader, seen: list[p.Message]) -> None:
        self.reader = reader
        self.seen = seen

    def recv(self) -> p.Message | None:
        msg = self.reader.recv()
        if msg is not None:
            self.seen.append(msg)
        return msg


@pytest.fixture()
def fake(tmp_path):
    agents: list[FakeAgent] = []

    def start(script) -> FakeAgent:
        agents.append(FakeAgent(tmp_path / f"a{len(agents)}.sock", script))
        return agents[-1]

    yield start
    for a in agents:
        a.close()


def _exec(i: int) -> p.Exec:
    return p.Exec(i, argv=["x"], env={}, cwd="", timeout_s=0, max_output=1 << 20, stdin=False)


def test_a_guest_that_never_answers_gives_sandbox_timeout_at_the_bound(fake):
    agent = fake(lambda conn, r: r.recv())  # reads the request, says nothing

    async def go():
        c = await GuestClient.connect(agent.path, "sb")
        try:
            t = time.monotonic()
            async with c.request(_exec, timeout=0.3) as s:
                with pytest.raises(SandboxTimeout):
                    await s.get()
            took = time.monotonic() - t
            with pytest.raises(SandboxTimeout):  # a per-wait bound on a stream without a deadline
                stream = await c.open(_exec)
                await stream.get(timeout=0.1)
            return took, c.closed
        finally:
            await c.close()

    took, closed = asyncio.run(go())
    assert 0.25 <= took < 2.0 and not closed  # a timeout ends the request, not the connection


def test_a_guest_that_floods_output_still_times_out(fake):
    def flood(conn, r):
        req = r.recv()
        frame = p.encode(p.Stdout(req.id, data=b"x" * 100))
        while not agent.stop.is_set():
            conn.sendall(frame * 50)

    agent = fake(flood)

    async def go():
        c = await GuestClient.connect(agent.path, "sb")
        got = 0
        try:
            t = time.monotonic()
            async with c.request(_exec, timeout=0.3) as s:
                with pytest.raises(SandboxTimeout):
                    while True:
                        await s.get()
                        got += 1
            return time.monotonic() - t, got
        finally:
            agent.stop.set()
            await c.close()

    took, got = asyncio.run(go())
    assert got > 0 and took < 2.0


@pytest.mark.parametrize("case", ["garbage", "wrong direction", "failure id 0", "oversized"])
def test_a_protocol_violation_closes_the_connection(fake, case):
    def bad(conn, r):
        req = r.recv()
        conn.sendall(p.encode(p.Stdout(req.id, data=b"before")))
        if case == "garbage":
            conn.sendall(struct.pack(">II", 5, 0) + b"notjs")
        elif case == "wrong direction":
            conn.sendall(p.encode(_exec(req.id)))
        elif case == "failure id 0":
            conn.sendall(p.encode(p.Failure(0, code=p.ErrorCode.INVALID, message="bad frame")))
        else:
            conn.sendall(struct.pack(">II", 10, p.MAX_BODY + 1))

    agent = fake(bad)

    async def go():
        c = await GuestClient.connect(agent.path, "sb")
        try:
            async with c.request(_exec, timeout=5) as s:
                first = await s.get()
                with pytest.raises(GuestProtocolError) as err:
                    await s.get()
                with pytest.raises(GuestProtocolError):  # and stays so
                    await s.get()
            with pytest.raises(GuestProtocolError):
                await c.call(lambda i: p.Ping(i), p.Pong)
            return first, err.value, c.closed
        finally:
            await c.close()

    first, err, closed = asyncio.run(go())
    assert first == p.Stdout(1, data=b"before")  # what came before the violation was delivered
    assert closed and err.sandbox_id == "sb"


def test_frames_split_anywhere_and_interleaved_reach_their_requests(fake):
    def answer(conn, r):
        a, b = r.recv(), r.recv()
        stream = b"".join(
            p.encode(m)
            for m in [
                p.Stdout(b.id, data=b"to b"),
                p.Stdout(a.id, data=b"to a"),
                p.Pong(99, version=4, pid=1),
                p.Exited(a.id, exit_code=1, signal=0, timed_out=False, truncated=False, duration_ms=1.0, oom_kills=-1),
                p.Exited(b.id, exit_code=2, signal=0, timed_out=False, truncated=False, duration_ms=1.0, oom_kills=-1),
            ]
        )
        for i in range(len(stream)):  # one byte at a time
            conn.sendall(stream[i : i + 1])
        r.recv()  # until the host closes

    agent = fake(answer)

    async def go():
        c = await GuestClient.connect(agent.path, "sb")
        try:
            sa, sb = await c.open(_exec, timeout=10), await c.open(_exec, timeout=10)
            got = {}
            for s in (sa, sb):
                got[s.id] = [await s.get(), await s.get()]
                s.close()
            return got
        finally:
            await c.close()

    got = asyncio.run(go())
    assert [m.data for m, _ in got.values()] == [b"to a", b"to b"]
    assert [e.exit_code for _, e in got.values()] == [1, 2]  # the unknown id 99 was dropped


def test_a_large_upload_waits_for_a_slow_agent_and_arrives_whole(fake):
    size = 24 << 20

    def slow(conn, r):
        req = r.recv()
        conn.sendall(p.encode(p.Ok(req.id)))
        n = 0
        while True:
            m = r.recv()
            if isinstance(m, p.ChunkEnd):
                break
            n += len(m.data)
            time.sleep(0.002)
            conn.sendall(p.encode(p.WriteAck(req.id, bytes=len(m.data))))  # what it wrote opens the window
        conn.sendall(
            p.encode(
                p.Entry(req.id, name="f", path="/f", kind=p.FileType.FILE, size=n, mode=0o644, mtime=0.0, target="")
            )
        )

    agent = fake(slow)

    async def go():
        c = await GuestClient.connect(agent.path, "sb")
        ticks = 0

        async def ticker():  # the loop stays responsive while the upload waits for room
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.get_running_loop().create_task(ticker())
        try:
            entry = await c.upload("/f", bytes(size))
            return entry, ticks, c._transport.get_write_buffer_size()
        finally:
            t.cancel()
            await c.close()

    entry, ticks, buffered = asyncio.run(go())
    assert isinstance(entry, p.Entry) and entry.size == size
    assert ticks > 5 and buffered < 4 << 20


def test_an_abandoned_read_sends_cancel_and_a_flood_past_the_window_is_a_violation(fake):
    def serve(conn, r):
        req = r.recv()
        conn.sendall(p.encode(p.Chunk(req.id, data=b"a" * 10)))
        m = r.recv()
        assert isinstance(m, p.Cancel) and m.id == req.id
        req = r.recv()  # a second read: ignores the window
        frame = p.encode(p.Chunk(req.id, data=bytes(p.CHUNK)))
        for _ in range(8):
            conn.sendall(frame)

    agent = fake(serve)

    async def go():
        c = await GuestClient.connect(agent.path, "sb")
        try:
            read = await c.read_file("/x", max_bytes=1 << 30)
            first = await read.next(timeout=5)
            read.cancel()
            read2 = await c.read_file("/y", max_bytes=1 << 30, window=p.CHUNK)
            await asyncio.sleep(0.5)  # takes nothing while the guest sends past its window
            with pytest.raises(GuestProtocolError, match="window"):
                while True:
                    await read2.next(timeout=5)
            return first
        finally:
            await c.close()

    first = asyncio.run(go())
    assert first == p.Chunk(1, data=b"a" * 10)
    assert [type(m) for m in agent.seen] == [p.ReadFile, p.Cancel, p.ReadFile]


def test_connection_loss_ends_every_request(fake):
    agent = fake(lambda conn, r: (r.recv(), r.recv(), conn.shutdown(socket.SHUT_RDWR)))

    async def go():
        c = await GuestClient.connect(agent.path, "sb")
        try:
            a, b = await c.open(_exec), await c.open(_exec, timeout=30)
            errors = []
            for s in (a, b):
                with pytest.raises(GuestConnectionError) as e:
                    await s.get()
                errors.append(e.value)
            with pytest.raises(GuestConnectionError):
                await c.call(lambda i: p.Ping(i), p.Pong)
            return errors, c.closed
        finally:
            await c.close()

    errors, closed = asyncio.run(go())
    assert closed and all("closed" in str(e) for e in errors)


def test_a_cancelled_sender_does_not_end_another_senders_wait_for_room(fake):
    size = 16 << 20

    def slow(conn, r):
        a, b = r.recv(), r.recv()
        conn.sendall(p.encode(p.Ok(a.id)) + p.encode(p.Ok(b.id)))
        n = 0
        while True:
            m = r.recv()
            if m is None:
                return
            if isinstance(m, p.Chunk) and m.id == b.id:
                n += len(m.data)
            if isinstance(m, p.ChunkEnd) and m.id == b.id:
                break
            time.sleep(0.01)
        conn.sendall(
            p.encode(p.Entry(b.id, name="b", path="/b", kind=p.FileType.FILE, size=n, mode=0o644, mtime=0.0, target=""))
        )

    agent = fake(slow)

    async def go():
        c = await GuestClient.connect(agent.path, "sb")
        try:
            # window=0: no acks, so both fill the transport's buffer and wait for room there
            a = asyncio.ensure_future(c.upload("/a", bytes(size), window=0))
            await asyncio.sleep(0)
            b = asyncio.ensure_future(c.upload("/b", bytes(size), window=0))
            for _ in range(500):  # both wait for room soon (bounded: 10 s on a loaded host)
                if c._paused is not None:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
            assert c._paused is not None and not a.done() and not b.done()
            a.cancel()
            entry = await asyncio.wait_for(b, 60)
            return a.cancelled(), entry
        finally:
            await c.close()

    a_cancelled, entry = asyncio.run(go())
    assert a_cancelled and isinstance(entry, p.Entry) and entry.size == size


def test_an_upload_sends_no_more_than_its_window_beyond_the_agents_acks(fake):
    got: list[int] = []

    def silent(conn, r):  # takes the data but never acknowledges any of it
        req = r.recv()
        conn.sendall(p.encode(p.Ok(req.id)))
        while (m := r.recv()) is not None:
            if isinstance(m, p.Chunk):
                got.append(len(m.data))

    agent = fake(silent)
    pulled = 0

    async def source():
        nonlocal pulled
        for _ in range(64):
            pulled += 1
            yield bytes(p.CHUNK)

    async def go():
        c = await GuestClient.connect(agent.path, "sb")
        try:
            with pytest.raises(SandboxTimeout):
                await c.upload("/f", source(), window=4 * p.CHUNK, wait=0.5)
        finally:
            await c.close()

    asyncio.run(go())
    assert sum(got) == 4 * p.CHUNK and pulled == 5  # the window, and the one chunk waiting for room
