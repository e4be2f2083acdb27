"""Code-context kernel for bash: one long-lived shell whose working directory and variables survive.

Started by the agent like kernel.py (a socketpair fd) and speaking the same frames. Each cell is
written to a file the shell ``source``s (stdin: /dev/null), so ``cd``, variables and functions
stay; a marker with the exit status follows on stdout and stderr. A non-zero status is the run's
error (``ExitCode``, its value the number). SIGINT (sent on timeout) is passed to the shell's
process group: the running command ends and the shell's trap leaves the cell.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time

from warmbox import protocol as p

_SETUP = "trap 'return 130 2>/dev/null' INT\n"


class Shell:
    def __init__(self) -> None:
        self.token = os.urandom(8).hex()
        self.marker = f"\x1fWB{self.token}:".encode()
        self.dir = f"/tmp/.wb-bash-{os.getpid()}-{self.token}"
        os.mkdir(self.dir, 0o700)
        self.proc = subprocess.Popen(
            ["bash", "--norc", "--noprofile"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(_SETUP.encode())
        self.proc.stdin.flush()
        self.cells = 0

    def run(self, code: str, emit, interrupted) -> int | None:
        """Run one cell: ``emit(kind, bytes)`` for output as it comes; its exit status, or None if
        the shell died. ``interrupted()`` is polled: True once the cell must stop."""
        self.cells += 1
        path = f"{self.dir}/cell-{self.cells}.sh"
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(code + "\n")
        marker = self.marker.decode()
        command = (
            f"source {path} </dev/null; __wb_status=$?; rm -f {path}; "
            f"printf '{marker}%d\\n' \"$__wb_status\"; printf '{marker}\\n' >&2\n"
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None and self.proc.stderr is not None
        try:
            self.proc.stdin.write(command.encode())
            self.proc.stdin.flush()
        except OSError:
            return None
        streams = {self.proc.stdout.fileno(): p.Stdout, self.proc.stderr.fileno(): p.Stderr}
        pending = dict.fromkeys(streams, b"")
        status: int | None = None
        open_fds = set(streams)
        signalled = 0.0
        while open_fds:
            if interrupted() and time.monotonic() - signalled > 0.2:
                signalled = time.monotonic()
                try:
                    os.killpg(self.proc.pid, signal.SIGINT)
                except OSError:
                    pass
            try:
                ready, _, _ = select.select(list(open_fds), [], [], 0.1)
            except InterruptedError:
                continue
            for fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None  # the shell exited (``exit`` in a cell)
                buf = pending[fd] + chunk
                at = buf.find(self.marker)
                if at >= 0:
                    emit(streams[fd], buf[:at])
                    rest = buf[at + len(self.marker) :]
                    if b"\n" not in rest:  # the status is still on its way
                        pending[fd] = buf[at:]
                        continue
                    if streams[fd] is p.Stdout:
                        line = rest.split(b"\n", 1)[0]
                        status = int(line) if line.strip().isdigit() else 1
                    open_fds.discard(fd)
                    pending[fd] = b""
                    continue
                keep = len(self.marker) - 1  # a marker may be split across reads
                emit(streams[fd], buf[:-keep] if len(buf) > keep else b"")
                pending[fd] = buf[-keep:] if len(buf) > keep else buf
        return status


class _Output:
    """A run's output frames, at most ``max_output`` bytes (then ``truncated``)."""

    def __init__(self, sock: socket.socket, msg: p.ContextRun) -> None:
        self.sock = sock
        self.msg = msg
        self.sent = 0
        self.truncated = False

    def emit(self, kind: type, data: bytes) -> None:
        room = self.msg.max_output - self.sent
        if len(data) > room:
            self.truncated = True
            data = data[: max(room, 0)]
        if not data:
            return
        self.sent += len(data)
        for off in range(0, len(data), p.CHUNK):
            self.sock.sendall(p.encode(kind(id=self.msg.id, data=data[off : off + p.CHUNK])))


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    stop = [False]

    def on_sigint(signum: int, frame: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGINT, on_sigint)
    shell = Shell()
    count = 0
    while True:
        try:
            msg = p.recv_message(sock, (p.ContextRun, p.ContextRunEnv, p.Configure, p.Reseed))
        except (OSError, p.ProtocolViolation):
            break
        if msg is None:
            break
        if isinstance(msg, p.Configure):
            if msg.reset_counts:
                count = 0
            exports = "".join(f"export {k}={_quote(v)}\n" for k, v in msg.env.items() if k.isidentifier())
            if exports:
                shell.run(exports, lambda kind, data: None, lambda: False)
            sock.sendall(p.encode(p.Ok(id=msg.id)))
            continue
        if isinstance(msg, p.Reseed):
            sock.sendall(p.encode(p.Ok(id=msg.id)))
            continue
        if not isinstance(msg, p.ContextRun):
            break
        count += 1
        start = time.monotonic()
        stop[0] = False
        out = _Output(sock, msg)
        env = msg.env if isinstance(msg, p.ContextRunEnv) else {}
        own = [k for k in env if k.isidentifier()]
        if own:  # the run's own variables: each one's old value kept in a shell variable, then set
            saves = "".join(f"__wb_set_{k}=${{{k}+1}}; __wb_old_{k}=${{{k}-}}; " for k in own)
            sets = "".join(f"export {k}={_quote(env[k])}\n" for k in own)
            shell.run(saves + "\n" + sets, lambda kind, data: None, lambda: False)
        status = shell.run(msg.code, out.emit, lambda: stop[0])
        if own and status is not None:  # back as each was, unless the cell itself changed it
            restores = "".join(
                f'if [ "${{{k}-}}" = {_quote(env[k])} ]; then if [ -n "$__wb_set_{k}" ]; then '
                f'export {k}="$__wb_old_{k}"; else unset {k}; fi; fi; unset __wb_set_{k} __wb_old_{k}\n'
                for k in own
            )
            shell.run(restores, lambda kind, data: None, lambda: False)
        if status is None:
            break  # the shell is gone: the agent reports the context died
        interrupted = stop[0] and status == 130
        sock.sendall(
            p.encode(
                p.CodeDone(
                    id=msg.id,
                    error_name="KeyboardInterrupt" if interrupted else ("ExitCode" if status else ""),
                    error_value=str(status) if status else "",
                    traceback="",
                    timed_out=False,
                    truncated=out.truncated,
                    execution_count=count,
                    duration_ms=(time.monotonic() - start) * 1e3,
                    oom_kills=-1,
                )
            )
        )
    try:
        os.killpg(shell.proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"
