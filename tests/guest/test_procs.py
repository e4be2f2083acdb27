"""Background processes in the real guest agent (outside any sandbox): rings, attach, input, PTY."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import pytest

from warmbox import protocol as p
from warmbox.backends.runc import GUEST_LIB, build_image
from warmbox.engine.guest_client import GuestClient
from warmbox.guest import procs as bg

BARE = "/usr/bin/python3"


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    lib = build_image(tmp_path_factory.mktemp("images")) / GUEST_LIB.lstrip("/")
    tmp = tmp_path_factory.mktemp("agent")
    sock = tmp / "a.sock"
    boot = f"import sys; sys.path.insert(0, {str(lib)!r}); from warmbox.guest.agent import main; main()"
    proc = subprocess.Popen([BARE, "-I", "-S", "-c", boot, str(sock)], cwd=tmp)
    for _ in range(200):
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(sock))
            break
        except OSError:
            time.sleep(0.01)
        finally:
            probe.close()
    yield str(sock)
    proc.kill()
    proc.wait()


async def _spawn(c: GuestClient, argv, *, cols=0, rows=0, tag="") -> int:
    m = await c.call(
        lambda i: p.Spawn(i, argv=argv, env={"X": "1"}, cwd="", tag=tag, user="user", pty_cols=cols, pty_rows=rows),
        p.Started,
    )
    assert isinstance(m, p.Started), m
    return m.pid


async def _attach(c: GuestClient, pid: int, offset: int = 0, output: bool = True):
    frames = []
    async with c.request(lambda i: p.Attach(i, pid=pid, offset=offset, output=output), timeout=20) as s:
        while True:
            m = await s.get()
            frames.append(m)
            if isinstance(m, (p.Exited, p.Failure)):
                return frames


def _out(frames, kind=p.Stdout) -> bytes:
    return b"".join(f.data for f in frames if isinstance(f, kind))


def test_background_process_outlives_its_connection_and_is_read_later(agent):
    async def main():
        c = await GuestClient.connect(agent, "t")
        pid = await _spawn(c, ["/bin/sh", "-c", "echo out; echo err >&2; read line; echo got $line"], tag="t1")
        await c.close()
        c = await GuestClient.connect(agent, "t")
        entries = []
        async with c.request(lambda i: p.ProcList(i)) as s:
            while not isinstance(m := await s.get(), p.Ok):
                entries.append(m)
        assert [(e.pid, e.tag, e.env, e.argv[0]) for e in entries] == [(pid, "t1", {"X": "1"}, "/bin/sh")]
        ok = await c.call(lambda i: p.ProcInput(i, pid=pid, data=b"hello\n", eof=False), p.Ok)
        assert isinstance(ok, p.Ok), ok
        frames = await _attach(c, pid)
        assert _out(frames) == b"out\ngot hello\n" and _out(frames, p.Stderr) == b"err\n"
        assert frames[-1].exit_code == 0 and not frames[-1].truncated
        again = await _attach(c, pid, offset=4)  # a late reader: from an offset, ended already
        assert _out(again) == b"got hello\n" or _out(again).endswith(b"got hello\n")
        gone = await c.call(lambda i: p.ProcInput(i, pid=pid, data=b"x", eof=False), p.Ok)
        assert isinstance(gone, p.Failure)
        # closing the input of a process that ended is no error (a foreground run closes its
        # stdin right after the start, and a quick command may have ended by then)
        for _ in range(2):
            closed = await c.call(lambda i: p.ProcInput(i, pid=pid, data=b"", eof=True), p.Ok)
            assert isinstance(closed, p.Ok), closed
        await c.close()

    asyncio.run(main())


def test_unread_flood_is_bounded_and_the_reader_is_told(agent):
    async def main():
        c = await GuestClient.connect(agent, "t")
        n = 8 * bg.RING_BYTES
        pid = await _spawn(c, ["/bin/sh", "-c", f"head -c {n} /dev/zero; echo end"])
        frames = await _attach(c, pid, output=False)  # waits for the end without reading output
        assert frames[-1].exit_code == 0
        frames = await _attach(c, pid)
        lost = sum(f.size for f in frames if isinstance(f, p.OutputLost))
        data = _out(frames)
        assert data.endswith(b"end\n") and len(data) <= bg.RING_BYTES
        assert lost + len(data) == n + 4 and frames[-1].truncated
        await c.close()

    asyncio.run(main())


def test_kill_ends_the_process_group_and_a_pty_has_a_size(agent):
    async def main():
        c = await GuestClient.connect(agent, "t")
        pid = await _spawn(c, ["/bin/sh", "-c", "sleep 100 & sleep 100"])
        ok = await c.call(lambda i: p.Signal(i, pid=pid, signum=9), p.Ok)
        assert isinstance(ok, p.Ok)
        frames = await _attach(c, pid)
        assert frames[-1].signal == 9
        tty = await _spawn(c, ["/bin/sh"], cols=100, rows=30)
        await c.call(lambda i: p.ProcInput(i, pid=tty, data=b"stty size; tty\n", eof=False), p.Ok)
        await asyncio.sleep(0.5)
        ok = await c.call(lambda i: p.ProcResize(i, pid=tty, cols=120, rows=40), p.Ok)
        assert isinstance(ok, p.Ok)
        await c.call(lambda i: p.ProcInput(i, pid=tty, data=b"stty size; exit 3\n", eof=False), p.Ok)
        frames = await _attach(c, tty)
        screen = _out(frames)
        assert b"30 100" in screen and b"40 120" in screen and b"/dev/pts/" in screen, screen
        assert frames[-1].exit_code == 3
        await c.close()

    asyncio.run(main())


def test_a_hostile_agents_endless_process_list_is_refused(tmp_path):
    """A guest answering commands.list with entry after entry cannot make the host hold them all."""
    import threading

    from warmbox.engine.session import MAX_PROCESS_LIST_BYTES, GuestSession
    from warmbox.errors import GuestProtocolError

    path = str(tmp_path / "hostile.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    sent = [0]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            req = p.recv_message(conn, p.HOST_TO_GUEST)
            big = {f"K{i}": "v" * 1000 for i in range(500)}  # ~0.5 MB per entry
            try:
                while sent[0] < 4 * MAX_PROCESS_LIST_BYTES:
                    conn.sendall(p.encode(p.ProcEntry(req.id, pid=2, argv=["x"], env=big, cwd="/", tag="", pty=False)))
                    sent[0] += 500_000
            except OSError:
                pass  # the host hung up: it refused the list

    t = threading.Thread(target=serve, daemon=True)
    t.start()

    async def main() -> None:
        session = await GuestSession.connect(path, "hostile")
        try:
            with pytest.raises(GuestProtocolError, match="process list"):
                await session.processes()
        finally:
            await session.close()

    asyncio.run(main())
    t.join(10)
    listener.close()
    assert sent[0] < 4 * MAX_PROCESS_LIST_BYTES  # it stopped reading long before the guest stopped sending
