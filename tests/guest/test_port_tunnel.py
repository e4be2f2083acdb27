"""PortConnect against the real guest agent (outside any sandbox, on a temp socket) and TCP servers on
this machine's loopback: bytes both ways under flow control, half-close, refusal, and a host cancel
that frees an agent stuck writing to a server that never reads."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import pytest

from tests.guest.test_agent import agent, guest_lib  # noqa: F401  # fixtures: the real agent
from warmbox import protocol as p
from warmbox.engine.guest_client import PORT_WINDOW, GuestClient
from warmbox.engine.session import GuestSession
from warmbox.errors import InvalidArgument, PortNotListening


class Server:
    """A TCP server on 127.0.0.1: ``handle(conn)`` runs for each connection, in a thread."""

    def __init__(self, handle) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.done = threading.Event()
        self.result: list[object] = []

        def run() -> None:
            conn, _ = self.sock.accept()
            conn.settimeout(20)
            try:
                self.result.append(handle(conn))
            except OSError as e:
                self.result.append(e)
            finally:
                conn.close()
                self.done.set()

        threading.Thread(target=run, daemon=True).start()

    def close(self) -> None:
        self.sock.close()


def _upper_until_eof(conn: socket.socket) -> int:
    """Read to EOF, then answer with the bytes upper-cased (needs the host's half-close)."""
    data = bytearray()
    while chunk := conn.recv(1 << 16):
        data += chunk
    conn.sendall(bytes(data).upper())
    return len(data)


def _never_reads(conn: socket.socket) -> None:
    """Never reads a byte (its buffers fill up), until the test ends."""
    threading.Event().wait(20)


async def _session(path: str) -> GuestSession:
    return GuestSession(await GuestClient.connect(path, "sb-test"))


def test_bytes_both_ways_through_the_window_and_a_half_close(agent):  # noqa: F811
    server = Server(_upper_until_eof)
    payload = bytes(range(97, 123)) * ((4 * PORT_WINDOW) // 26)  # 4 windows' worth, a-z

    async def run() -> bytes:
        s = await _session(agent)
        try:
            stream = await s.connect_port(server.port)
            await stream.write(payload)
            await stream.write_eof()
            got = bytearray()
            while (data := await stream.read()) is not None:
                got += data
            stream.close()
            return bytes(got)
        finally:
            await s.close()

    try:
        assert asyncio.run(run()) == payload.upper()
        assert server.done.wait(10) and server.result == [len(payload)]
    finally:
        server.close()


def test_a_port_nothing_listens_on_is_refused(agent):  # noqa: F811
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()

    async def run() -> None:
        s = await _session(agent)
        try:
            with pytest.raises(PortNotListening, match=str(port)):
                await s.connect_port(port)
            with pytest.raises(InvalidArgument):
                await s.connect_port(0)
            await s.ping()  # the connection is fine after both
        finally:
            await s.close()

    asyncio.run(run())


def _agent_load(pid: int) -> tuple[int, int]:
    """(open fds, threads) of the agent process."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def test_a_host_cancel_frees_an_agent_stuck_on_a_server_that_never_reads(agent):  # noqa: F811
    """The agent's worker blocks writing into a full connection; the host's Cancel still ends the
    tunnel in the agent at once (its socket and both threads go; TCP may deliver what was written)."""
    server = Server(_never_reads)

    async def run() -> None:
        s = await _session(agent)
        try:
            pong = await s._client.call(lambda i: p.Ping(i), p.Pong)
            assert isinstance(pong, p.Pong)
            fds, _threads = _agent_load(pong.pid)
            stream = await s.connect_port(server.port)
            writer = asyncio.ensure_future(stream.write(bytes(64 * PORT_WINDOW)))
            await asyncio.sleep(1.5)
            assert not writer.done()  # held by the window: the agent cannot write it all
            assert _agent_load(pong.pid)[0] == fds + 1  # the tunnel's socket
            writer.cancel()
            stream.close()  # Cancel while the agent's worker is stuck in a write
            for _ in range(100):
                if _agent_load(pong.pid)[0] == fds:
                    break
                await asyncio.sleep(0.05)
            assert _agent_load(pong.pid)[0] == fds, "the agent kept the tunnel's socket"
            await s.ping()
        finally:
            await s.close()

    try:
        asyncio.run(run())
    finally:
        server.close()
