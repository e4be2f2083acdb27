"""GuestSession, the only speaker of the protocol, against the real agent on a temp socket: typed results."""

from __future__ import annotations

import asyncio

import pytest

from tests.guest.test_agent import agent, guest_lib  # noqa: F401 - fixtures: the real agent, outside a sandbox
from warmbox.engine.session import GuestSession
from warmbox.errors import InvalidArgument, IsADirectory, PathNotFound
from warmbox.models import CommandResult, EntryInfo, Execution


def _run(coro):
    return asyncio.run(coro)


def test_exec_gives_a_command_result_with_streamed_output(agent):  # noqa: F811
    async def go():
        s = await GuestSession.connect(agent, "t")
        seen: list[str] = []
        try:
            r = await s.exec(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"], timeout_s=10, on_stdout=seen.append)
            piped = await s.exec(["/bin/cat"], stdin=b"in\n", timeout_s=10)
            raw: list[bytes] = []
            sunk = await s.exec(["/bin/echo", "raw"], stdout_sink=raw.append, timeout_s=10)
        finally:
            await s.close()
        return r, seen, piped, raw, sunk

    r, seen, piped, raw, sunk = _run(go())
    assert isinstance(r, CommandResult) and r.exit_code == 3 and r.stdout == "out\n" and r.stderr == "err\n"
    assert "".join(seen) == "out\n" and r.pid > 0 and not r.oom_killed
    assert piped.stdout == "in\n"
    assert b"".join(raw) == b"raw\n" and sunk.stdout == ""  # a sink's output is not kept


def test_code_and_files_are_typed_and_failures_are_typed_errors(agent, tmp_path):  # noqa: F811
    async def go():
        s = await GuestSession.connect(agent, "t")
        try:
            ex = await s.run_code("x = 20\nx + 22", timeout_s=30)
            bad = await s.run_code("1/0", timeout_s=30)
            entry = await s.write(str(tmp_path / "f.txt"), b"hello")
            data = await s.read(str(tmp_path / "f.txt"), max_bytes=100, timeout=10)
            listing = await s.list(str(tmp_path), 1)
            assert await s.make_dir(str(tmp_path / "d")) is True
            assert await s.make_dir(str(tmp_path / "d")) is False
            with pytest.raises(PathNotFound):
                await s.stat(str(tmp_path / "missing"))
            with pytest.raises(IsADirectory):
                await s.read(str(tmp_path / "d"), max_bytes=100, timeout=10)
            with pytest.raises(PathNotFound, match="working directory"):
                await s.exec(["/bin/true"], cwd=str(tmp_path / "no-such-dir"), timeout_s=5)
            with pytest.raises(InvalidArgument):  # the guest refuses it: INVALID
                await s.exec(["/bin/true"], env={"A=B": "x"}, timeout_s=5)
            usage = await s.usage()
        finally:
            await s.close()
        return ex, bad, entry, data, listing, usage

    ex, bad, entry, data, listing, usage = _run(go())
    assert isinstance(ex, Execution) and ex.text == "42" and ex.error is None
    assert bad.error is not None and bad.error.name == "ZeroDivisionError"
    assert isinstance(entry, EntryInfo) and entry.size == 5 and data == b"hello"
    assert "f.txt" in {e.name for e in listing}
    assert usage is not None and usage[1] >= 2


def test_spawn_follow_is_one_request_and_a_background_process(agent):  # noqa: F811
    async def go():
        s = await GuestSession.connect(agent, "t")
        try:
            out = await s.spawn_follow(
                ["/bin/sh", "-c", "echo hi; read x || echo eof; sleep 0.3; echo err >&2; exit 4"],
                env={},
                cwd="/",
                tag="sf",
                user="user",
                stdin=False,
            )
            listed = {p.pid: p.tag for p in await s.processes()}  # a background process like any
            events = []
            while (ev := await out.next()) is not None:
                events.append((ev.kind, ev.text))
        finally:
            await s.close()
        return out, listed, events

    out, listed, events = _run(go())
    assert listed.get(out.pid) == "sf"
    assert "".join(t for k, t in events if k == "stdout") == "hi\neof\n"  # its stdin was closed at the start
    assert "".join(t for k, t in events if k == "stderr") == "err\n"
    assert out.result is not None and out.result.exit_code == 4 and out.result.pid == out.pid


def test_an_agent_of_protocol_v6_is_spoken_to_without_the_v7_messages(tmp_path):
    """A paused sandbox's agent from before v7: ping accepted; the newer operations are refused on
    the host (Unsupported), and a start-and-follow becomes a Spawn and an Attach. The fake agent
    answers only v6 messages; a v7 one reaching it fails the test."""
    import socket
    import threading

    from warmbox import protocol as p
    from warmbox.errors import Unsupported

    path = str(tmp_path / "v6.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    seen: list[str] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while (req := p.recv_message(conn, p.HOST_TO_GUEST)) is not None:
                seen.append(type(req).__name__)
                if isinstance(req, p.Ping):
                    conn.sendall(p.encode(p.Pong(req.id, version=6, pid=1)))
                elif type(req) is p.Spawn:
                    conn.sendall(p.encode(p.Started(req.id, pid=7)))
                elif isinstance(req, p.Attach):
                    conn.sendall(p.encode(p.Stdout(req.id, data=b"old\n")))
                    conn.sendall(
                        p.encode(
                            p.Exited(
                                req.id,
                                exit_code=0,
                                signal=0,
                                timed_out=False,
                                truncated=False,
                                duration_ms=1.0,
                                oom_kills=-1,
                            )
                        )
                    )
                else:
                    return  # what a v6 agent does with a message it does not know: it hangs up

    t = threading.Thread(target=serve, daemon=True)
    t.start()

    async def main() -> None:
        s = await GuestSession.connect(path, "old")
        try:
            assert await s.ping() == 6
            with pytest.raises(Unsupported, match="protocol v6"):
                await s.list_contexts()
            with pytest.raises(Unsupported, match="protocol v6"):
                await s.restart_context("default")
            with pytest.raises(Unsupported, match="protocol v6"):
                await s.run_code("1", env={"A": "b"})
            out = await s.spawn_follow(["true"], env={}, cwd="/", tag="", user="user", cols=80, rows=24)
            assert out.pid == 7 and (await out.next()).data == b"old\n" and await out.next() is None
        finally:
            await s.close()

    _run(main())
    t.join(10)
    listener.close()
    assert seen == ["Ping", "Spawn", "Attach"]


def test_a_hostile_agents_endless_context_list_is_refused(tmp_path):
    """A guest answering contexts.list with entry after entry cannot make the host hold them all."""
    import socket
    import threading

    from warmbox import protocol as p
    from warmbox.engine.session import MAX_CONTEXT_LIST
    from warmbox.errors import GuestProtocolError

    path = str(tmp_path / "hostile.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    sent = [0]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while (req := p.recv_message(conn, p.HOST_TO_GUEST)) is not None:
                if isinstance(req, p.Ping):
                    conn.sendall(p.encode(p.Pong(req.id, version=p.PROTOCOL_VERSION, pid=1)))
                    continue
                try:
                    while sent[0] < 100 * MAX_CONTEXT_LIST:
                        conn.sendall(
                            p.encode(p.ContextEntry(req.id, context=f"c{sent[0]}", language="x" * 4000, cwd="/"))
                        )
                        sent[0] += 1
                except OSError:
                    return  # the host hung up: it refused the list

    t = threading.Thread(target=serve, daemon=True)
    t.start()

    async def main() -> None:
        s = await GuestSession.connect(path, "hostile")
        try:
            with pytest.raises(GuestProtocolError, match="code contexts"):
                await s.list_contexts()
        finally:
            await s.close()

    _run(main())
    t.join(10)
    listener.close()
    assert sent[0] < 100 * MAX_CONTEXT_LIST
