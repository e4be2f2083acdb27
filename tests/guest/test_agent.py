"""The real guest agent, outside any sandbox, on a temp socket; the real host client talks to it.

The agent runs from the guest-only copy of the package (protocol + guest) in a bare
interpreter (-I -S: no site-packages), which proves the guest needs nothing but the stdlib.
"""

from __future__ import annotations

import asyncio
import os
import secrets
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


def _await_listening(sock) -> None:
    """The path exists from bind(); wait (bounded) until listen() lets a client in."""
    for _ in range(200):
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(sock))
            return
        except OSError:
            time.sleep(0.01)
        finally:
            probe.close()


@pytest.fixture(scope="module")
def guest_lib(tmp_path_factory) -> Path:
    image = build_image(tmp_path_factory.mktemp("images"))
    return image / GUEST_LIB.lstrip("/")


@pytest.fixture()
def agent(guest_lib: Path, tmp_path: Path):
    sock = tmp_path / "a.sock"
    boot = f"import sys; sys.path.insert(0, {str(guest_lib)!r}); from warmbox.guest.agent import main; main()"
    proc = subprocess.Popen([BARE, "-I", "-S", "-c", boot, str(sock)], cwd=tmp_path)
    _await_listening(sock)
    yield str(sock)
    proc.kill()
    proc.wait()


def test_guest_imports_only_stdlib(guest_lib: Path):
    code = (
        f"import sys; sys.path.insert(0, {str(guest_lib)!r}); import warmbox.guest.agent, warmbox.guest.kernel; "
        "bad = [m for m in sys.modules if m.startswith('warmbox') and m not in "
        "('warmbox', 'warmbox.protocol', 'warmbox.guest') and not m.startswith('warmbox.guest.')]; "
        "print(bad)"
    )
    out = subprocess.run([BARE, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def _exec(c: GuestClient, argv, timeout_s=10.0, max_output=1 << 20, stdin=None):
    frames = []
    async with c.request(
        lambda i: p.Exec(
            i, argv=argv, env={}, cwd="", timeout_s=timeout_s, max_output=max_output, stdin=stdin is not None
        )
    ) as s:
        if stdin is not None:
            await s.send(p.StdinData(s.id, data=stdin, eof=True))
        while True:
            m = await s.get()
            frames.append((time.monotonic(), m))
            if isinstance(m, (p.Exited, p.Failure)):
                return frames


def test_exec_streams_before_exit_and_reports_status(agent):
    async def go():
        c = await GuestClient.connect(agent, "t")
        frames = await _exec(c, ["sh", "-c", "echo one; sleep 0.5; echo two >&2; exit 7"])
        await c.close()
        return frames

    frames = asyncio.run(go())
    kinds = [type(m).__name__ for _, m in frames]
    assert kinds[0] == "Started" and kinds[-1] == "Exited"
    first_out = next(t for t, m in frames if isinstance(m, p.Stdout))
    end = frames[-1][0]
    assert end - first_out > 0.3, "stdout must arrive while the command still runs"
    ex = frames[-1][1]
    assert (ex.exit_code, ex.signal, ex.timed_out) == (7, 0, False)
    assert b"".join(m.data for _, m in frames if isinstance(m, p.Stderr)) == b"two\n"


def test_timeout_kills_the_tree_even_after_setsid(agent):
    # durations unique to this run: the check below reads the whole host's process list, where a
    # sandbox of another test (or person) may run its own `sleep 1000`
    tag = f"{secrets.randbelow(10**6):06d}"

    async def go():
        c = await GuestClient.connect(agent, "t")
        t0 = time.monotonic()
        script = f"sleep 1000.{tag} & setsid sleep 1001.{tag} & sleep 1002.{tag}; wait"
        frames = await _exec(c, ["sh", "-c", script], timeout_s=0.5)
        took = time.monotonic() - t0
        await c.close()
        return frames, took

    frames, took = asyncio.run(go())
    ex = frames[-1][1]
    assert ex.timed_out and ex.signal == 9 and took < 3
    time.sleep(0.1)
    leftover = subprocess.run(["pgrep", "-f", f"sleep 100[012][.]{tag}"], capture_output=True, text=True).stdout.split()
    assert leftover == [], f"processes of the timed-out command survived: {leftover}"


def test_output_cap_sets_truncated(agent):
    async def go():
        c = await GuestClient.connect(agent, "t")
        frames = await _exec(c, ["sh", "-c", "head -c 5000000 /dev/zero"], max_output=100_000)
        await c.close()
        return frames

    frames = asyncio.run(go())
    got = sum(len(m.data) for _, m in frames if isinstance(m, p.Stdout))
    assert got == 100_000 and frames[-1][1].truncated and frames[-1][1].exit_code == 0


def test_stdin_and_missing_binary(agent):
    async def go():
        c = await GuestClient.connect(agent, "t")
        a = await _exec(c, ["cat"], stdin=b"hello")
        b = await _exec(c, ["/nonexistent/bin"])
        await c.close()
        return a, b

    a, b = asyncio.run(go())
    assert b"".join(m.data for _, m in a if isinstance(m, p.Stdout)) == b"hello"
    assert b[-1][1].exit_code == 127


def test_requests_and_connections_are_served_while_one_blocks(agent):
    """The thread that read a blocking request handles it: reading goes on elsewhere, so a ping,
    a second command and a new connection are answered while it runs; many short connections
    in a row are each served (a worker waits for the next one)."""

    async def go():
        c = await GuestClient.connect(agent, "t")
        try:
            slow = asyncio.ensure_future(_exec(c, ["sh", "-c", "sleep 1; echo slow"]))
            await asyncio.sleep(0.2)
            t = time.monotonic()
            pong = await c.call(lambda i: p.Ping(i), p.Pong)
            fast = await _exec(c, ["echo", "fast"])
            other = await GuestClient.connect(agent, "t")
            other_pong = await other.call(lambda i: p.Ping(i), p.Pong)
            await other.close()
            during = time.monotonic() - t
            slow_frames = await slow
            answered = 0
            for _ in range(30):
                d = await GuestClient.connect(agent, "t")
                answered += isinstance(await _exec(d, ["true"]), list)
                await d.close()
            return pong, fast, other_pong, during, slow_frames, answered
        finally:
            await c.close()

    pong, fast, other_pong, during, slow_frames, answered = asyncio.run(go())
    assert isinstance(pong, p.Pong) and isinstance(other_pong, p.Pong)
    assert b"".join(m.data for _, m in fast if isinstance(m, p.Stdout)) == b"fast\n"
    assert during < 0.7, "answered while the slow command ran"
    assert b"".join(m.data for _, m in slow_frames if isinstance(m, p.Stdout)) == b"slow\n"
    assert answered == 30


def test_hostile_host_frame_gets_failure_not_crash(agent):
    s = socket.socket(socket.AF_UNIX)
    s.connect(agent)
    s.sendall(b"\x00\x00\x00\x05\x00\x00\x00\x00notjs")
    reply = p.recv_message(s, p.GUEST_TO_HOST)
    assert isinstance(reply, p.Failure) and reply.code is p.ErrorCode.INVALID
    s.close()

    async def still_alive():
        c = await GuestClient.connect(agent, "t")
        pong = await c.call(lambda i: p.Ping(i), p.Pong)
        await c.close()
        return pong

    assert isinstance(asyncio.run(still_alive()), p.Pong)


def test_code_context_state_errors_and_interrupt(agent):
    async def run(c, code, timeout=5.0, ctx="default"):
        out = []
        async with c.request(
            lambda i: p.ContextRun(i, context=ctx, code=code, timeout_s=timeout, max_output=1 << 20)
        ) as s:
            while True:
                m = await s.get()
                out.append(m)
                if isinstance(m, (p.CodeDone, p.Failure)):
                    return out

    async def go():
        c = await GuestClient.connect(agent, "t")
        await run(c, "import math; x = 41")
        r1 = await run(c, "x + 1")
        r2 = await run(c, "print('hi'); 1/0")
        r3 = await run(c, "import time\nwhile True: time.sleep(0.01)", timeout=0.5)
        r4 = await run(c, "x")  # state survived the interrupt
        r5 = await run(c, "1", ctx="nope")
        await c.close()
        return r1, r2, r3, r4, r5

    r1, r2, r3, r4, r5 = asyncio.run(go())
    assert [m.data for m in r1 if isinstance(m, p.Display) and m.mime == "text/plain"] == [b"42"]
    assert r2[-1].error_name == "ZeroDivisionError" and b"hi" in b"".join(m.data for m in r2 if isinstance(m, p.Stdout))
    assert r3[-1].timed_out and r3[-1].error_name == "KeyboardInterrupt"
    assert [m.data for m in r4 if isinstance(m, p.Display)] == [b"41"]
    assert isinstance(r5[-1], p.Failure) and r5[-1].code is p.ErrorCode.CONTEXT_NOT_FOUND


def test_reseed_gives_code_contexts_new_generator_states(agent):
    """What a restore from a memory snapshot sends: the context's ``random`` no longer repeats."""

    async def text(c, code):
        async with c.request(
            lambda i: p.ContextRun(i, context="default", code=code, timeout_s=10, max_output=1 << 20)
        ) as s:
            while True:
                m = await s.get()
                if isinstance(m, p.Display):
                    return m.data.decode()
                if isinstance(m, (p.CodeDone, p.Failure)):
                    raise AssertionError(m)

    async def go():
        c = await GuestClient.connect(agent, "t")
        try:
            await text(c, "import random; random.seed(7); 0")
            same = await text(c, "random.random()")
            await text(c, "random.seed(7); 0")  # the state every restore of one snapshot would share
            ok = await c.call(lambda i: p.Reseed(i, seed=os.urandom(32)), p.Ok)
            after = await text(c, "random.random()")
            bad = await c.call(lambda i: p.Reseed(i, seed=b"short"), p.Ok)
            return same, ok, after, bad
        finally:
            await c.close()

    same, ok, after, bad = asyncio.run(go())
    assert isinstance(ok, p.Ok) and after != same
    assert isinstance(bad, p.Failure) and bad.code is p.ErrorCode.INVALID


# ---- a command's scope: its own PID namespace (no cgroup handed over), or its own cgroup


def _unified() -> Path | None:
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return Path("/sys/fs/cgroup")
    hybrid = Path("/sys/fs/cgroup/unified")
    return hybrid if (hybrid / "cgroup.procs").exists() else None


@pytest.fixture(params=["pidns", "cgroup"])
def scoped_agent(request, guest_lib: Path, tmp_path: Path):
    """The agent in either mode (as root on the host: its own cgroup is made here)."""
    sock = tmp_path / "a.sock"
    args, fds, cg = [str(sock)], (), None
    if request.param == "cgroup":
        root = _unified()
        if root is None or os.geteuid() != 0:
            pytest.skip("needs root and a cgroup v2 hierarchy")
        cg = root / f"wb-test-{os.getpid()}-{time.monotonic_ns()}"
        cg.mkdir()
        fd = os.open(cg, os.O_RDONLY | os.O_DIRECTORY)
        os.set_inheritable(fd, True)
        args, fds = ["--cgroup-fd", str(fd), str(sock)], (fd,)
    boot = f"import sys; sys.path.insert(0, {str(guest_lib)!r}); from warmbox.guest.agent import main; main({args!r})"
    proc = subprocess.Popen([BARE, "-I", "-S", "-c", boot], cwd=tmp_path, pass_fds=fds)
    for fd in fds:
        os.close(fd)
    if cg is not None:  # the agent moves its own children: it must be in the hierarchy's subtree
        (cg / "cgroup.procs").write_text(str(proc.pid))
    _await_listening(sock)
    yield request.param, str(sock)
    proc.kill()
    proc.wait()
    if cg is not None:
        (cg / "cgroup.kill").write_text("1")
        for _ in range(100):
            try:
                for sub in [d for d in cg.iterdir() if d.is_dir()]:
                    sub.rmdir()
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def _left(pattern: str) -> list[str]:
    """This run's sleeps only: anchored (no shell whose command line names them) and tagged with
    this pid (pgrep sees the whole host: other worktrees run this test concurrently)."""
    return subprocess.run(
        ["pgrep", "-f", f"^sleep 1{os.getpid()}{pattern}$"], capture_output=True, text=True, check=False
    ).stdout.split()


async def _await_left(pattern: str, count: int) -> list[str]:
    """Bounded: a loaded host can take longer than a fixed pause to start (or end) them."""
    for _ in range(100):
        if len(left := _left(pattern)) == count:
            break
        await asyncio.sleep(0.05)
    return left


def _escaping(n: int) -> str:
    """Four sleeps (``_left(f"{n}[1-4]")``) that leave the command's process tree in three ways.
    The interpreter by path: a version manager's ``python3`` shim on PATH takes ~0.2 s idle."""
    t = f"1{os.getpid()}{n}"
    return (
        f"setsid sh -c 'sleep {t}1 &'; (trap '' TERM HUP INT; sleep {t}2 &); "
        f"{BARE} -I -S -c 'import os; os.fork() and os._exit(0); os.setsid(); "
        f'os.execvp("sleep", ["sleep", "{t}3"])\'; sleep {t}4'
    )


def test_each_mode_ends_all_a_timed_out_or_killed_command_started(scoped_agent):
    mode, sock = scoped_agent

    async def go():
        c = await GuestClient.connect(sock, "t")
        try:
            where = await _exec(c, ["sh", "-c", "echo $$; cat /proc/self/cgroup | tail -1"])
            timed = await _exec(c, ["sh", "-c", _escaping(210)], timeout_s=1.0)
            left_timed = _left("210[1-4]")
            # a Signal(SIGKILL) to the command's pid (no timeout): the same
            async with c.request(
                lambda i: p.Exec(
                    i, argv=["sh", "-c", _escaping(220)], env={}, cwd="", timeout_s=0, max_output=1 << 20, stdin=False
                )
            ) as s:
                started = await s.get()
                assert len(await _await_left("220[1-4]", 4)) == 4
                ok = await c.call(lambda i: p.Signal(i, pid=started.pid, signum=9), p.Ok)
                while not isinstance(m := await s.get(), (p.Exited, p.Failure)):
                    pass
            left_killed = await _await_left("220[1-4]", 0)
            # a normal exit: what it started on purpose stays
            tag = f"1{os.getpid()}230"
            await _exec(c, ["sh", "-c", f"nohup sleep {tag}1 >/dev/null 2>&1 & setsid sh -c 'sleep {tag}2 &'"])
            kept = await _await_left("230[12]", 2)
            return where, timed, left_timed, ok, m, left_killed, kept
        finally:
            await c.close()
            for pid in _left("2[123]0[1-4]"):  # what this test left running
                os.kill(int(pid), 9)

    where, timed, left_timed, ok, killed, left_killed, kept = asyncio.run(go())
    out = b"".join(m.data for _, m in where if isinstance(m, p.Stdout)).decode().split("\n")
    if mode == "pidns":
        assert out[0] == "2", out  # PID 2 of its own namespace
    else:
        assert out[1].startswith("0::/") and "/cmd-" in out[1], out  # its own cgroup
    assert timed[-1][1].timed_out and timed[-1][1].signal == 9
    assert left_timed == [], f"processes of the timed-out command survived ({mode})"
    assert isinstance(ok, p.Ok) and isinstance(killed, p.Exited) and killed.signal == 9
    assert left_killed == [], f"processes of the killed command survived ({mode})"
    assert len(kept) == 2, f"background processes of a normal exit were killed ({mode})"
