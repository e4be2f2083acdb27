"""Requests that run a command to its end: exec (output streamed, stdin fed) and signal."""

from __future__ import annotations

import _signal as signal  # type: ignore[import-not-found]  # no stub: a C module, the wrapper's core
import os
import select
import threading
import time

from warmbox import protocol as p
from warmbox.guest.base import Inbox, _Fail
from warmbox.guest.reaper import kill_tree
from warmbox.guest.scopes import Scope, _exit_status, _spawn, _which

TYPE_CHECKING = False  # not typing's: the guest imports nothing it does not use at run time
if TYPE_CHECKING:
    from warmbox.guest.agent import Agent
    from warmbox.guest.connection import Connection


_READ = 64 << 10
_EXIT_GRACE_S = 0.1  # output still drained after the main process exited
_KILL_WAIT_S = 5.0


def _exec(agent: Agent, conn: Connection, msg: p.Exec) -> None:
    agent.busy.enter()
    try:
        _exec_inner(agent, conn, msg)
    finally:
        agent.busy.exit()


def _exec_inner(agent: Agent, conn: Connection, msg: p.Exec) -> None:
    if not msg.argv or any("\0" in a for a in msg.argv):
        raise _Fail(p.ErrorCode.INVALID, "argv must be a non-empty list without NUL bytes")
    agent.hardened.wait(5)  # no user process before the agent is out of its reach
    start = time.monotonic()
    if any("\0" in k or "=" in k or "\0" in v for k, v in msg.env.items()):
        raise _Fail(p.ErrorCode.INVALID, "environment names and values must not contain NUL bytes (names: '=')")
    env = dict(os.environ)
    env.update(msg.env)
    cwd = msg.cwd or None
    if cwd is not None and not os.path.isdir(cwd):
        raise _Fail(p.ErrorCode.NOT_FOUND, f"working directory {cwd} does not exist")
    argv = list(msg.argv)
    oom_before = agent.oom.read()
    pipes = [os.pipe(), os.pipe()]  # stdout, stderr
    stdin_r, stdin_w = os.pipe() if msg.stdin else (None, None)
    scope = None
    reads: list[int] = []  # the pipes' read ends, once the child has the write ends
    try:
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) if stdin_r is None else None
        stdin_fd = stdin_r if stdin_r is not None else null
        assert stdin_fd is not None
        stdio = (stdin_fd, pipes[0][1], pipes[1][1])
        try:
            exe = argv[0] if "/" in argv[0] else _which(argv[0], env.get("PATH", ""))
            scope = _spawn(agent, exe, argv, env, cwd, stdio)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
            code = 127 if isinstance(e, FileNotFoundError) else 126
            conn.send(p.Stderr(id=msg.id, data=f"{msg.argv[0]}: {e.strerror}\n".encode()))
            conn.send(
                p.Exited(
                    id=msg.id,
                    exit_code=code,
                    signal=0,
                    timed_out=False,
                    truncated=False,
                    duration_ms=(time.monotonic() - start) * 1e3,
                    oom_kills=0 if oom_before >= 0 else -1,
                )
            )
            return
        finally:
            for fd in (pipes[0][1], pipes[1][1], stdin_r, null):
                if fd is not None:
                    os.close(fd)
            reads = [pipes[0][0], pipes[1][0]]
        conn.send(p.Started(id=msg.id, pid=scope.pid))
        if stdin_w is not None:
            threading.Thread(target=_feed_stdin, args=(conn.inbox(msg.id), stdin_w), daemon=True).start()
            stdin_w = None  # the feeder owns it now
        timed_out, truncated = _pump(conn, msg, scope, reads, start)
        status = scope.status()
        if status is None:  # pipes closed, process alive: wait for it (bounded by the deadline)
            remaining = None if msg.timeout_s <= 0 else max(0.0, start + msg.timeout_s - time.monotonic())
            status = scope.wait(remaining)
            if status is None:
                timed_out = True
                scope.kill()
                status = scope.wait(_KILL_WAIT_S)
        code, sig = _exit_status(status)
        conn.send(
            p.Exited(
                id=msg.id,
                exit_code=code,
                signal=sig,
                timed_out=timed_out,
                truncated=truncated,
                duration_ms=(time.monotonic() - start) * 1e3,
                oom_kills=agent.oom.since(oom_before),
            )
        )
    finally:
        if scope is not None:
            agent.scopes.finish(scope)
        for fd in (stdin_w, *reads):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _feed_stdin(inbox: Inbox, fd: int) -> None:
    try:
        while True:
            item = inbox.get()
            if not isinstance(item, p.StdinData):  # None: the connection or the request is gone
                break
            view = memoryview(item.data)
            while view:
                view = view[os.write(fd, view) :]
            if item.eof:
                break
    except OSError:
        pass
    finally:
        os.close(fd)


def _pump(conn: Connection, msg: p.Exec, scope: Scope, pipes: list[int], start: float) -> tuple[bool, bool]:
    """Stream output until both pipes close (or the exit grace ends). Returns (timed_out, truncated)."""
    poller = select.poll()
    kinds = {pipes[0]: p.Stdout, pipes[1]: p.Stderr}
    wake_r = scope.wake_fd
    for fd in (*kinds, wake_r):
        poller.register(fd, select.POLLIN)
    deadline = start + msg.timeout_s if msg.timeout_s > 0 else None
    exited_at = None
    timed_out = truncated = False
    sent = 0
    while kinds:
        now = time.monotonic()
        waits = []
        if deadline is not None and not timed_out:
            waits.append(deadline - now)
        if exited_at is not None:
            waits.append(exited_at + _EXIT_GRACE_S - now)
        wait_ms = max(0, int(min(waits) * 1000) + 1) if waits else None
        events = poller.poll(wait_ms)
        now = time.monotonic()
        for fd, _ in events:
            if fd == wake_r:
                scope.collect()
                poller.unregister(wake_r)
                exited_at = now
                continue
            data = os.read(fd, _READ)
            if not data:
                poller.unregister(fd)
                del kinds[fd]
                continue
            room = msg.max_output - sent
            if len(data) > room:
                truncated = True
                data = data[: max(room, 0)]
            if data:
                sent += len(data)
                conn.send(kinds[fd](id=msg.id, data=data))
        if deadline is not None and not timed_out and now >= deadline:
            timed_out = True
            scope.kill()
            exited_at = exited_at or now
        elif exited_at is not None and now >= exited_at + _EXIT_GRACE_S:
            break
    return timed_out, truncated


def _signal(agent: Agent, conn: Connection, msg: p.Signal) -> None:
    if msg.pid <= 1 or not 1 <= msg.signum <= 64:
        raise _Fail(p.ErrorCode.INVALID, "bad pid or signal number")
    scope = agent.scopes.find(msg.pid)
    if scope is None and not os.path.exists(f"/proc/{msg.pid}"):
        raise _Fail(p.ErrorCode.NOT_FOUND, f"no process {msg.pid}")
    if scope is None:  # not a running command's: its tree, as far as it can be walked
        kill_tree(msg.pid, msg.signum)
    elif msg.signum == signal.SIGKILL:
        scope.kill()
    else:
        scope.signal(msg.signum)
    conn.send(p.Ok(id=msg.id))
