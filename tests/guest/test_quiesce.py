"""A quiesced agent (before a memory checkpoint) and its resume trigger, on a temp socket outside any
sandbox: the real agent from the guest-only copy of the package, the real host client.

gVisor resumes hung (1 in ~10-20) on three races these tests pin down: the agent answered Quiesce
before its sockets were closed (the checkpoint then failed and the sandbox was lost); a SIGUSR1 of
an earlier resume made the next quiesced agent listen again at once; and the handler of that
signal took a lock its own thread could hold (an Event's set()), which deadlocked the agent.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warmbox import protocol as p
from warmbox.backends.runc import GUEST_LIB, build_image
from warmbox.engine.guest_client import GuestClient

BARE = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def _accepts(sock: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(str(sock))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _wait_accepts(sock: Path, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _accepts(sock):
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def guest_lib(tmp_path_factory) -> Path:
    image = build_image(tmp_path_factory.mktemp("images"))
    return image / GUEST_LIB.lstrip("/")


@pytest.fixture()
def agent(guest_lib: Path, tmp_path: Path):
    sock = tmp_path / "agent.sock"
    boot = f"import sys; sys.path.insert(0, {str(guest_lib)!r}); from warmbox.guest.agent import main; main()"
    proc = subprocess.Popen([BARE, "-I", "-S", "-c", boot, str(sock)], cwd=tmp_path)
    assert _wait_accepts(sock), "the agent did not listen"
    asyncio.run(_ping(sock))  # answered: its SIGUSR1 handler is installed (a signal before would end it)
    yield proc, sock
    proc.kill()
    proc.wait()


async def _ping(sock: Path) -> None:
    c = await GuestClient.connect(str(sock), "sb")
    try:
        assert isinstance(await c.call(lambda i: p.Ping(i), p.Pong), p.Pong)
    finally:
        await c.close()


async def _quiesce(sock: Path, other: socket.socket) -> None:
    c = await GuestClient.connect(str(sock), "sb")
    try:
        reply = await c.call(lambda i: p.Quiesce(i), p.Ok)
        assert isinstance(reply, p.Ok), reply
        # every other host connection was closed before the answer: nothing open at the checkpoint
        other.setblocking(False)
        assert other.recv(1) == b"", "another connection was still open when Quiesce was answered"
        assert await c.wait_lost(5.0), "the agent did not end the quiescing connection"
    finally:
        await c.close()


def _trigger(proc: subprocess.Popen, sock: Path) -> None:
    """What the gVisor host does: the old socket removed, a new ``resume`` file, SIGUSR1."""
    sock.unlink(missing_ok=True)
    (sock.parent / "resume").touch()
    os.kill(proc.pid, signal.SIGUSR1)


def test_quiesce_closes_every_socket_before_answering_and_waits_for_its_own_trigger(agent):
    proc, sock = agent
    for round_ in range(3):
        # a SIGUSR1 while listening (a late signal of the previous resume) must not count later
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.05)
        other = socket.socket(socket.AF_UNIX)
        other.connect(str(sock))
        try:
            asyncio.run(_quiesce(sock, other))
        finally:
            other.close()
        time.sleep(0.3)
        assert not _accepts(sock), f"round {round_}: the quiesced agent listened again untold"
        assert proc.poll() is None
        _trigger(proc, sock)
        assert _wait_accepts(sock), f"round {round_}: the agent did not listen again when told"
        assert not (sock.parent / "resume").exists(), "the agent left its trigger behind"


def test_resume_signals_in_a_burst_never_wedge_the_agent(agent):
    """The handler once set a threading.Event its own waiting thread held the lock of: a signal at
    that moment deadlocked the agent. Signals arriving while it waits (every few ms) must not."""
    proc, sock = agent
    for round_ in range(5):
        other = socket.socket(socket.AF_UNIX)
        other.connect(str(sock))
        try:
            asyncio.run(_quiesce(sock, other))
        finally:
            other.close()
        sock.unlink(missing_ok=True)
        for _ in range(200):  # the waits last 20 ms each: signals land at every point of them
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.0007)
        assert _wait_accepts(sock), f"round {round_}: the agent stopped answering after a burst of signals"
        assert proc.poll() is None
