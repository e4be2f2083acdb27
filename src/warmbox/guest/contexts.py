"""Code contexts: long-lived interpreters (Python forked from the agent where it can, Node, bash) and their requests."""

from __future__ import annotations

import _socket as socket
import os
import sys
import threading
import time

from warmbox import protocol as p
from warmbox.guest import userenv
from warmbox.guest.base import _Fail
from warmbox.guest.scopes import Scope, _forked, _spawn, _which, fork_eligible

TYPE_CHECKING = False  # not typing's: the guest imports nothing it does not use at run time
if TYPE_CHECKING:
    from warmbox.guest.agent import Agent
    from warmbox.guest.connection import Connection


_GUEST_LIB = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CONTEXT_INTERRUPT_GRACE_S = 2.0
_CONTEXT_REPLIES = (p.Stdout, p.Stderr, p.Display, p.CodeDone, p.Ok)


def _found(name: str) -> str | None:
    try:
        return _which(name, os.environ.get("PATH", "/usr/bin:/bin"))
    except FileNotFoundError:
        return None


def _python_kernel(module: str):
    def argv(fd: int) -> tuple[str, list[str]]:
        boot = (
            f"import sys; sys.path.insert(0, {_GUEST_LIB!r}); from warmbox.guest import {module}; "
            f"sys.path.pop(0); {module}.main({fd:d})"
        )
        return sys.executable, [sys.executable, "-u", "-c", boot]

    return argv


def _node_kernel(fd: int) -> tuple[str, list[str]]:
    node = _found("node") or _found("nodejs") or "node"
    script = os.path.join(_GUEST_LIB, "warmbox", "guest", "kernel.js")
    # --expose-internals: the REPL's top-level-await transform (kernel.js works without it, less well)
    return node, [node, "--expose-internals", script, str(fd)]


def _context_command(language: str):
    """How a context of ``language`` starts (a function of the kernel's socket fd), or a typed
    failure naming the languages this sandbox has."""
    tools = {"python": None, "javascript": "node", "bash": "bash"}
    available = [lang for lang, tool in tools.items() if tool is None or _found(tool)]
    if language not in available:
        raise _Fail(
            p.ErrorCode.LANGUAGE_UNAVAILABLE,
            f"no {language!r} code contexts in this sandbox (available: {', '.join(available)})",
        )
    if language == "javascript":
        return _node_kernel
    return _python_kernel("kernel_bash" if language == "bash" else "kernel")


def _fork_python(agent: Agent, fd: int, python: str, cwd: str, env: dict[str, str]) -> Scope | None:
    """A Python context forked from the agent (None: the caller execs one). Its interpreter is the
    agent's, so an idle context costs the pages it wrote since, not an interpreter and its imports
    of its own: the kernel module is imported here, in the agent, for every context to share.
    Retried like ``_spawn`` while the pids limit is hit."""
    from warmbox.guest import kernel

    def child(procs: int, ready: int) -> None:
        code = 1
        try:
            _forked(agent.scopes, procs, ready, fd, cwd, env)
            kernel.from_fork(fd, python, _GUEST_LIB)
            code = 0
        except BaseException:  # nothing to report to: the agent sees the socket close
            pass
        finally:
            os._exit(code)

    delay = 0.005
    deadline = time.monotonic() + 2.0
    while True:
        try:
            return agent.scopes.fork(child)
        except BlockingIOError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


class Context:
    """A long-lived interpreter process (guest/kernel.py, kernel.js, kernel_bash.py) reached over a
    socketpair. A Python one is forked from the agent where the scope allows (_fork_python)."""

    def __init__(self, agent: Agent, name: str, language: str, cwd: str, env: dict[str, str]) -> None:
        exe_argv = _context_command(language)
        self.name = name
        self.language = language
        self.cwd = cwd
        self.env = env  # what it was created with: a restart starts it again with the same
        self.lock = threading.Lock()
        self.agent = agent
        self.dead = False
        if cwd and not os.path.isdir(cwd):
            raise _Fail(p.ErrorCode.NOT_FOUND, f"working directory {cwd} does not exist")
        ours, theirs = socket.socketpair()
        full_env = dict(os.environ)
        full_env.update(env)
        exe, argv = exe_argv(theirs.fileno())
        if exe == sys.executable:  # a Python kernel runs in the sandbox's venv: what pip installed imports
            exe = argv[0] = userenv.python(full_env)
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            scope = None
            if language == "python" and agent.scopes.can_fork() and fork_eligible(exe, full_env):
                scope = _fork_python(agent, theirs.fileno(), exe, cwd, full_env)
            self.scope = scope or _spawn(
                agent,
                exe,
                argv,
                full_env,
                cwd or None,
                (null, null, null),
                keep_fd=theirs.fileno(),
            )
        except BlockingIOError:
            ours.close()
            raise _Fail(
                p.ErrorCode.EXEC_FAILED,
                "the sandbox's process limit (limits.pids) is reached; the code context could not be started",
            ) from None
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(null)
        self.sock = ours
        self.reader = p.SocketReader(ours, _CONTEXT_REPLIES)

    @property
    def alive(self) -> bool:
        return self.scope.status() is None

    def kill(self) -> None:
        """End the interpreter and every process its cells started (once)."""
        if self.dead:
            return
        self.dead = True
        self.scope.kill()
        self.agent.scopes.finish(self.scope)
        try:
            self.sock.close()
        except OSError:
            pass

    def run(self, conn: Connection, msg: p.ContextRun) -> None:
        start = time.monotonic()
        deadline = start + msg.timeout_s if msg.timeout_s > 0 else None
        interrupted_at = None
        oom_before = self.agent.oom.read()
        self.sock.sendall(p.encode(msg))
        while True:
            now = time.monotonic()
            if deadline is not None:
                limit = (interrupted_at + _CONTEXT_INTERRUPT_GRACE_S) if interrupted_at else deadline
                self.sock.settimeout(max(0.0, limit - now))
            else:
                self.sock.settimeout(None)
            try:
                reply = self.reader.recv()
                if isinstance(reply, p.Ok):  # only a Configure or Reseed is answered by Ok
                    raise p.ProtocolViolation("Ok during a run")
            except socket.timeout:
                if interrupted_at is None:
                    interrupted_at = time.monotonic()
                    self.scope.interrupt()
                    continue
                self.kill()
                self.agent.drop_context(self)
                conn.send(
                    self._died(
                        msg,
                        start,
                        "the run ignored the interrupt and was killed",
                        True,
                        self.agent.oom.since(oom_before),
                    )
                )
                return
            except (OSError, p.ProtocolViolation):
                reply = None
            if reply is None:
                self.kill()
                self.agent.drop_context(self)
                conn.send(
                    self._died(
                        msg,
                        start,
                        "the interpreter process died",
                        interrupted_at is not None,
                        self.agent.oom.since(oom_before),
                    )
                )
                return
            reply.id = msg.id
            if isinstance(reply, p.CodeDone):
                if interrupted_at is not None:
                    reply.timed_out = True
                reply.oom_kills = self.agent.oom.since(oom_before)
                conn.send(reply)
                return
            conn.send(reply)

    def configure(self, msg: p.Configure | p.Reseed) -> None:
        """Pass a Configure or Reseed to the interpreter (caller holds ``lock``); a dead one is dropped."""
        try:
            self.sock.settimeout(30.0)  # an idle interpreter answers in ms; a loaded TCG guest is slow
            self.sock.sendall(p.encode(msg))
            reply = self.reader.recv()
            if reply is not None and not isinstance(reply, p.Ok):
                raise p.ProtocolViolation(f"{type(reply).__name__} answering a {type(msg).__name__}")
        except (OSError, p.ProtocolViolation):
            reply = None
        finally:
            try:
                self.sock.settimeout(None)
            except OSError:
                pass
        if reply is None:
            self.kill()
            self.agent.drop_context(self)

    @staticmethod
    def _died(msg: p.ContextRun, start: float, why: str, timed_out: bool, oom_kills: int) -> p.CodeDone:
        return p.CodeDone(
            id=msg.id,
            error_name="ContextDied",
            error_value=why,
            traceback="",
            timed_out=timed_out,
            truncated=False,
            execution_count=0,
            duration_ms=(time.monotonic() - start) * 1e3,
            oom_kills=oom_kills,
        )


def _context_create(agent: Agent, conn: Connection, msg: p.ContextCreate) -> None:
    ctx = agent.new_context(msg.name, msg.language, msg.cwd, msg.env)
    conn.send(p.ContextCreated(id=msg.id, context=ctx.name))


def _context_run(agent: Agent, conn: Connection, msg: p.ContextRun) -> None:
    if isinstance(msg, p.ContextRunEnv):
        for k, v in msg.env.items():
            if not k or "=" in k or "\0" in k or "\0" in v:
                raise _Fail(p.ErrorCode.INVALID, f"invalid environment variable {k!r}")
    ctx = agent.get_context(msg.context)
    with ctx.lock:
        if not ctx.alive:
            agent.drop_context(ctx)
            ctx.kill()  # what its cells left running goes with it
            raise _Fail(p.ErrorCode.CONTEXT_DIED, f"context {msg.context} died")
        agent.busy.enter()
        try:
            ctx.run(conn, msg)
        finally:
            agent.busy.exit()


def _context_delete(agent: Agent, conn: Connection, msg: p.ContextDelete) -> None:
    ctx = agent.get_context(msg.context)
    agent.drop_context(ctx)
    ctx.kill()
    conn.send(p.Ok(id=msg.id))


def _context_list(agent: Agent, conn: Connection, msg: p.ContextList) -> None:
    for ctx in agent.contexts():
        conn.send(p.ContextEntry(id=msg.id, context=ctx.name, language=ctx.language, cwd=ctx.cwd))
    conn.send(p.Ok(id=msg.id))


def _context_restart(agent: Agent, conn: Connection, msg: p.ContextRestart) -> None:
    agent.restart_context(msg.context)
    conn.send(p.Ok(id=msg.id))


def _configure(agent: Agent, conn: Connection, msg: p.Configure) -> None:
    for k, v in msg.env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise _Fail(p.ErrorCode.INVALID, f"invalid environment variable {k!r}")
    os.environ.update(msg.env)
    for ctx in agent.contexts():
        with ctx.lock:
            if ctx.alive:
                ctx.configure(msg)
    report = agent.busy.report(msg.id)
    if msg.reset_counts:
        agent.busy.reset()
    conn.send(report)


def _reseed(agent: Agent, conn: Connection, msg: p.Reseed) -> None:
    if not 32 <= len(msg.seed) <= 64:
        raise _Fail(p.ErrorCode.INVALID, "a reseed carries 32..64 bytes")
    for ctx in agent.contexts():
        if not ctx.lock.acquire(timeout=0.05):  # running a cell the snapshot caught: it keeps its state
            continue
        try:
            if ctx.alive:
                ctx.configure(p.Reseed(id=msg.id, seed=msg.seed + os.urandom(16)))
        finally:
            ctx.lock.release()
    conn.send(p.Ok(id=msg.id))
