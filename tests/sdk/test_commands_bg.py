"""Background commands against real sandboxes: handles, connect from another client, list, kill, stdin."""

from __future__ import annotations

import asyncio
import time

import pytest

from warmbox import AsyncSandbox, CommandResult, InvalidArgument, ProcessNotFound, Sandbox, Unsupported


@pytest.fixture(scope="module")
def box(home, runc_ready):
    with Sandbox.create(tier="container", timeout=600) as sb:
        yield sb


@pytest.mark.sandbox
def test_background_command_streams_and_waits(box):
    seen: list[str] = []
    t0 = time.monotonic()
    h = box.commands.run(
        "echo start; sleep 1; echo err >&2; echo end", background=True, on_stdout=seen.append, tag="bg-1"
    )
    assert time.monotonic() - t0 < 1.0 and h.pid > 1  # returned before the command ended
    r = h.wait()
    assert isinstance(r, CommandResult) and (r.exit_code, r.stdout, r.stderr) == (0, "start\nend\n", "err\n")
    assert "".join(seen) == "start\nend\n" and r.pid == h.pid and not r.truncated
    assert h.exit_code == 0


@pytest.mark.sandbox
def test_list_connect_from_another_client_stdin_and_kill(box):
    h = box.commands.run("read a; echo got $a; sleep 600", background=True, envs={"K": "v"}, cwd="/tmp", tag="srv")
    listed = {p.pid: p for p in box.commands.list()}
    assert h.pid in listed
    info = listed[h.pid]
    assert (info.cmd, info.args[-1], info.envs, info.cwd, info.tag) == (
        "/bin/bash",
        "read a; echo got $a; sleep 600",
        {"K": "v"},
        "/tmp",
        "srv",
    )
    other = Sandbox.connect(box.sandbox_id)  # another client (over HTTP in the http lane)
    try:
        h2 = other.commands.connect(h.pid)
        other.commands.send_stdin(h.pid, "hello\n")
        deadline = time.monotonic() + 10
        while "got hello" not in h2.stdout and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h2.stdout == "got hello\n"
        assert other.commands.kill(h.pid) is True
        r = h2.wait()
        assert r.signal == 9 and r.exit_code == 137 and r.stdout == "got hello\n"
    finally:
        other.close()
    assert h.wait().signal == 9  # the first handle sees the same end
    assert h.pid not in {p.pid for p in box.commands.list()}
    assert box.commands.kill(h.pid) is False  # not running any more
    assert box.commands.run("pgrep -x sleep", timeout=10).exit_code == 1  # its children died with it


@pytest.mark.sandbox
def test_iteration_stdin_at_start_and_typed_errors(box):
    h = box.commands.run("cat; echo done >&2", background=True, stdin="piped\n")
    h.send_stdin("more", eof=True)
    items = list(h)
    assert ("piped\n" in "".join(o for o, _, _ in items if o)) and ("done\n", None) in [(e, x) for _, e, x in items]
    assert h.wait().stdout == "piped\nmore"
    with pytest.raises(ProcessNotFound):  # a pid that is no background process
        box.commands.connect(999999).wait()
    with pytest.raises(InvalidArgument):
        box.commands.kill(-5)
    with pytest.raises(InvalidArgument):
        box.commands.send_stdin(1, 42)  # type: ignore[arg-type]
    before = {p.pid for p in box.commands.list()}
    for background in (True, False):  # refused before anything starts: no process left unfollowed
        with pytest.raises(InvalidArgument, match="max_output"):
            box.commands.run("sleep 30", background=background, stdin=iter([b""]), max_output=0)
    assert {p.pid for p in box.commands.list()} == before


@pytest.mark.sandbox
def test_a_background_command_outlives_its_client(box):
    async def start() -> int:
        sb = await AsyncSandbox.connect(box.sandbox_id)
        h = await sb.commands.run("sleep 0.5; echo late", background=True)
        await sb.close()  # the client goes; the process does not
        return h.pid

    pid = asyncio.run(start())
    r = box.commands.connect(pid).wait()
    assert (r.exit_code, r.stdout) == (0, "late\n")


@pytest.mark.sandbox
def test_foreground_stdin_streams_from_an_iterable(box):
    def lines():
        yield "first\n"
        time.sleep(0.3)  # the command has the first line before the iterable is done
        yield b"second\n"

    seen: list[str] = []
    r = box.commands.run("while read l; do echo got $l; done", stdin=lines(), on_stdout=seen.append, timeout=20)
    assert (r.exit_code, r.stdout) == (0, "got first\ngot second\n") and "".join(seen) == r.stdout
    r = box.commands.run("cat; sleep 30", stdin=iter([b"x"]), timeout=1)
    assert r.timed_out and r.signal == 9 and r.stdout == "x"

    def broken():
        yield "ok\n"
        raise RuntimeError("the caller's source failed")

    with pytest.raises(RuntimeError, match="source failed"):
        box.commands.run("cat", stdin=broken(), timeout=20)
    with pytest.raises(InvalidArgument):
        box.commands.run("cat", stdin=[1, 2], timeout=20)  # type: ignore[list-item]


@pytest.mark.sandbox
def test_async_stdin(box):
    async def main() -> str:
        sb = await AsyncSandbox.connect(box.sandbox_id)
        try:

            async def gen():
                for i in range(3):
                    yield f"{i}\n"
                    await asyncio.sleep(0.05)

            r = await sb.commands.run("wc -l", stdin=gen(), timeout=20)
            return r.stdout.strip()
        finally:
            await sb.close()

    assert asyncio.run(main()) == "3"


@pytest.mark.sandbox
@pytest.mark.parametrize("tier", ["container", "gvisor", "microvm"])
def test_user_root_where_the_tier_offers_it(home, runc_ready, tier):
    from warmbox.engine.engine import Engine

    caps = Engine.for_home(home).backend(tier).capabilities()
    with Sandbox.create(tier=tier, timeout=300, pool=False) as sb:
        assert sb.commands.run("id -u", timeout=20).stdout == "1000\n"  # the default is unchanged
        if not caps.root_user:
            with pytest.raises(Unsupported) as e:
                sb.commands.run("id -u", user="root")
            assert e.value.tier == tier and e.value.reason == caps.root_user_reason
            pytest.skip(f"{tier}: {caps.root_user_reason}")
        r = sb.commands.run("id -u; touch /workspace/by-root; cat", user="root", stdin="in\n", timeout=20)
        assert (r.exit_code, r.stdout) == (0, "0\nin\n"), r.stderr
        # root of its own namespace only: the file is the sandbox user's, the system stays out of reach
        assert sb.files.get_info("/workspace/by-root").size == 0
        assert sb.commands.run("stat -c %u /workspace/by-root", timeout=20).stdout == "1000\n"
        r = sb.commands.run("touch /usr/bin/x", user="root", timeout=20)
        assert r.exit_code != 0
        h = sb.commands.run("sleep 600", user="root", background=True)
        assert h.kill() and h.wait().signal == 9
