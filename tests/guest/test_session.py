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
