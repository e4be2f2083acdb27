"""Background processes: start (pipes or a terminal), attach, input, resize, list (rings in procs.py)."""

from __future__ import annotations

import os
import select
import sys
import time

from warmbox import protocol as p
from warmbox.guest import procs as bg
from warmbox.guest.base import Inbox, _Fail
from warmbox.guest.scopes import _exit_status, _spawn, _which

TYPE_CHECKING = False  # not typing's: the guest imports nothing it does not use at run time
if TYPE_CHECKING:
    from warmbox.guest.agent import Agent
    from warmbox.guest.connection import Connection


# A terminal's process gets it as its controlling terminal: it leads a session (spawn makes it
# one, except under a PID namespace's init, whose session it shares), makes the terminal (its
# stdin) its own, then runs the command.
_CTTY = (
    "import fcntl,os,sys,termios\n"
    "try:\n os.setsid()\n"
    "except OSError:\n pass\n"
    "fcntl.ioctl(0,termios.TIOCSCTTY,0)\n"
    "a=sys.argv[1:]\n"
    "try:\n os.execvpe(a[0],a,os.environ)\n"
    "except OSError as e:\n"
    " sys.stderr.write(f'{a[0]}: {e.strerror}\\n')\n"
    " os._exit(127 if isinstance(e,FileNotFoundError) else 126)\n"
)


def _winsize(cols: int, rows: int) -> bytes:
    return rows.to_bytes(2, sys.byteorder) + cols.to_bytes(2, sys.byteorder) + bytes(4)


def _spawn_bg(agent: Agent, conn: Connection, msg: p.Spawn) -> None:
    proc = _start_bg(agent, msg)
    conn.send(p.Started(id=msg.id, pid=proc.pid))


def _spawn_follow(agent: Agent, conn: Connection, msg: p.SpawnFollow) -> None:
    proc = _start_bg(agent, msg)
    conn.send(p.Started(id=msg.id, pid=proc.pid))
    if not msg.stdin and proc.master is None:
        _close_stdin(proc)
    _follow(agent, conn, msg.id, proc, 0, True)


def _close_stdin(proc: bg.Proc) -> None:
    with proc.stdin_lock:  # a writer holds its own dup: closing this never hits a reused fd
        fd, proc.stdin = proc.stdin, None
    if fd is not None:
        os.close(fd)


def _start_bg(agent: Agent, msg: p.Spawn) -> bg.Proc:
    if not msg.argv or any("\0" in a for a in msg.argv):
        raise _Fail(p.ErrorCode.INVALID, "argv must be a non-empty list without NUL bytes")
    if any("\0" in k or "=" in k or "\0" in v for k, v in msg.env.items()):
        raise _Fail(p.ErrorCode.INVALID, "environment names and values must not contain NUL bytes (names: '=')")
    if msg.user not in ("user", "root"):
        raise _Fail(p.ErrorCode.INVALID, f"user must be 'user' or 'root', got {msg.user!r}")
    pty = msg.pty_cols > 0 or msg.pty_rows > 0
    if pty and not (0 < msg.pty_cols < 10000 and 0 < msg.pty_rows < 10000):
        raise _Fail(p.ErrorCode.INVALID, "a terminal's cols and rows must be from 1 to 9999")
    agent.hardened.wait(5)
    if agent.procs.running() >= bg.MAX_RUNNING:
        raise _Fail(p.ErrorCode.EXEC_FAILED, f"too many background processes ({bg.MAX_RUNNING} run)")
    env = dict(os.environ)
    if pty:
        env["TERM"] = "xterm-256color"
    env.update(msg.env)
    cwd = msg.cwd or None
    if cwd is not None and not os.path.isdir(cwd):
        raise _Fail(p.ErrorCode.NOT_FOUND, f"working directory {cwd} does not exist")
    argv = list(msg.argv)
    try:
        exe = argv[0] if "/" in argv[0] else _which(argv[0], env.get("PATH", ""))
        # uid 0 of a user namespace of its own, mapped onto the sandbox user; an agent that is root
        # of its sandbox already (a template build sandbox) runs it as itself
        if msg.user == "root" and os.geteuid() != 0:
            argv = ["unshare", "--map-root-user", "--", exe, *argv[1:]]
            exe = _which("unshare", env.get("PATH", ""))
    except FileNotFoundError as e:
        raise _Fail(p.ErrorCode.EXEC_FAILED, f"{e.filename}: command not found") from None
    parent: list[int] = []  # fds the agent keeps
    child: list[int] = []  # fds only the child keeps (closed here after the spawn)
    try:
        if pty:
            import fcntl
            import termios

            master, slave = os.openpty()
            parent.append(master)
            child.append(slave)
            fcntl.ioctl(master, termios.TIOCSWINSZ, _winsize(msg.pty_cols, msg.pty_rows))
            os.set_blocking(master, False)
            stdio = (slave, slave, slave)
            exe, argv = sys.executable, [sys.executable, "-I", "-S", "-c", _CTTY, exe, *argv[1:]]
            outputs = {master: bg.PTY}
            stdin_w: int | None = master
        else:
            (out_r, out_w), (err_r, err_w), (in_r, in_w) = os.pipe(), os.pipe(), os.pipe()
            parent += [out_r, err_r, in_w]
            child += [out_w, err_w, in_r]
            os.set_blocking(in_w, False)
            stdio = (in_r, out_w, err_w)
            outputs = {out_r: bg.STDOUT, err_r: bg.STDERR}
            stdin_w = in_w
            master = None
        try:
            scope = _spawn(agent, exe, argv, env, cwd, stdio)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
            raise _Fail(p.ErrorCode.EXEC_FAILED, f"{msg.argv[0]}: {e.strerror}") from None
    except BaseException:
        for fd in parent:
            os.close(fd)
        raise
    finally:
        for fd in child:
            os.close(fd)
    proc = bg.Proc(
        scope.pid, scope, list(msg.argv), dict(msg.env), cwd or os.getcwd(), msg.tag, outputs, stdin_w, master
    )
    agent.procs.add(proc)
    return proc


def _proc(agent: Agent, pid: int) -> bg.Proc:
    proc = agent.procs.get(pid)
    if proc is None:
        raise _Fail(p.ErrorCode.NOT_FOUND, f"no background process {pid} (ended long ago, or never one)")
    return proc


def _attach(agent: Agent, conn: Connection, msg: p.Attach) -> None:
    _follow(agent, conn, msg.id, _proc(agent, msg.pid), max(0, msg.offset), msg.output)


def _follow(agent: Agent, conn: Connection, rid: int, proc: bg.Proc, offset: int, output: bool) -> None:
    """Stream ``proc``'s output from ``offset`` (``output`` false: none), then its Exited, as the
    answer to request ``rid``; until the host's Cancel or the connection's end."""
    inbox = conn.inbox(rid)
    table = agent.procs
    lost_total = 0
    while True:
        with table.changed:
            while True:
                lost, chunks, nxt = proc.snapshot(offset) if output else (0, [], offset)
                ended = not proc.running
                if lost or chunks or ended or conn.closed:
                    break
                table.changed.wait(0.5)
                if inbox.poll() is not Inbox.EMPTY:  # Cancel, or None: the connection is gone
                    return
        if conn.closed or inbox.poll() is not Inbox.EMPTY:
            return
        if lost:
            lost_total += lost
            conn.send(p.OutputLost(id=rid, size=lost))
        for kind, data in chunks:
            conn.send((p.Stderr if kind == bg.STDERR else p.Stdout)(id=rid, data=data))
        offset = nxt
        if ended and not lost and not chunks:
            code, sig = _exit_status(proc.status)
            conn.send(
                p.Exited(
                    id=rid,
                    exit_code=code,
                    signal=sig,
                    timed_out=False,
                    truncated=lost_total > 0,
                    duration_ms=((proc.ended or proc.started) - proc.started) * 1e3,
                    oom_kills=-1,
                )
            )
            return


def _proc_input(agent: Agent, conn: Connection, msg: p.ProcInput) -> None:
    proc = _proc(agent, msg.pid)
    with proc.stdin_lock:
        fd = None if proc.stdin is None else os.dup(proc.stdin)  # closing the original cannot hit us
    if fd is None:
        if msg.eof and not msg.data:  # closing a closed input is done: a start that ended first races it
            conn.send(p.Ok(id=msg.id))
            return
        raise _Fail(p.ErrorCode.INVALID, f"the input of process {msg.pid} is closed (it ended, or got eof)")
    try:
        data = memoryview(msg.data + (b"\x04" if msg.eof and proc.master is not None else b""))
        deadline = time.monotonic() + 10.0
        while data:
            try:
                data = data[os.write(fd, data) :]
                continue
            except BlockingIOError:
                pass
            except OSError as e:  # EPIPE: nobody reads it any more
                raise _Fail(p.ErrorCode.INVALID, f"process {msg.pid} does not take input: {e.strerror}") from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Fail(p.ErrorCode.INVALID, f"process {msg.pid} did not read its input within 10 s")
            select.select([], [fd], [], left)
    finally:
        os.close(fd)
    if msg.eof and proc.master is None:
        with proc.stdin_lock:
            if proc.stdin is not None:
                os.close(proc.stdin)
                proc.stdin = None
    conn.send(p.Ok(id=msg.id))


def _proc_resize(agent: Agent, conn: Connection, msg: p.ProcResize) -> None:
    if not (0 < msg.cols < 10000 and 0 < msg.rows < 10000):
        raise _Fail(p.ErrorCode.INVALID, "a terminal's cols and rows must be from 1 to 9999")
    proc = _proc(agent, msg.pid)
    import fcntl
    import termios

    with proc.stdin_lock:
        if proc.master is None:
            raise _Fail(p.ErrorCode.INVALID, f"process {msg.pid} has no terminal (or it ended)")
        fcntl.ioctl(proc.master, termios.TIOCSWINSZ, _winsize(msg.cols, msg.rows))
    conn.send(p.Ok(id=msg.id))


def _proc_list(agent: Agent, conn: Connection, msg: p.ProcList) -> None:
    for proc in agent.procs.list():
        conn.send(
            p.ProcEntry(
                id=msg.id,
                pid=proc.pid,
                argv=proc.argv,
                env=proc.env,
                cwd=proc.cwd,
                tag=proc.tag,
                pty=proc.master is not None,
            )
        )
    conn.send(p.Ok(id=msg.id))
