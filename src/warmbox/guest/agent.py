"""Guest agent: PID 1 of a sandbox; serves exec, files and code contexts over the wire protocol.

Stdlib-only. It listens on an inherited unix socket (fd 3, passed by the backend) or on a path
given on the command line (tests). As PID 1 it reaps every orphan; exit statuses of its own
children are routed to the request that started them.

Its parts import one way, each only lower ones and at module level (a part imported lazily, on a
worker thread, would hold the import lock that scopes._fork_quiet waits to see free):
base < reaper < scopes < {commands, files, ports, contexts, background} < dispatch < connection
< agent. Handlers take ``(agent, conn, msg)``; a part names Agent and Connection for its types only.
"""

from __future__ import annotations

# C modules directly: the pure-Python socket and signal wrappers import enum and selectors.
import _signal as signal  # type: ignore[import-not-found]  # no stub: a C module, the wrapper's core
import _socket as socket
import os
import select
import sys
import threading
import time

from warmbox import protocol as p
from warmbox.guest import procs as bg
from warmbox.guest import userenv
from warmbox.guest.base import _Fail
from warmbox.guest.connection import Connection, Workers
from warmbox.guest.contexts import Context
from warmbox.guest.reaper import Reaper
from warmbox.guest.scopes import Scopes

# Imports are kept to what the boot path needs: every millisecond here is on each cold start.


class OomCounter:
    """The ``oom_kill`` count of the agent's own cgroup (v2 ``memory.events``), where the agent can
    read it: in a microVM the guest kernel's OOM killer is invisible to the host. Elsewhere
    (containers: the host reads the sandbox's cgroup) every reading is -1."""

    def __init__(self) -> None:
        self.path: str | None = None
        try:
            with open("/proc/self/cgroup", "rb") as f:
                lines = f.read().decode("ascii", "replace").splitlines()
        except OSError:
            return
        unified = [ln[3:] for ln in lines if ln.startswith("0::/")]
        if unified:
            self.path = "/sys/fs/cgroup" + unified[0].rstrip("/") + "/memory.events"
            if self.read() < 0:  # not mounted where the agent can see it
                self.path = None

    def read(self) -> int:
        if self.path is None:
            return -1
        try:
            with open(self.path, "rb") as f:
                for line in f.read(4096).splitlines():
                    if line.startswith(b"oom_kill "):
                        return int(line[9:])
        except (OSError, ValueError):
            pass
        return -1

    def since(self, before: int) -> int:
        """Kills since ``before`` (a read()); -1 when either reading is unknown."""
        if before < 0:
            return -1
        now = self.read()
        return max(0, now - before) if now >= 0 else -1


class Busy:
    """Wall time with at least one command or code run in progress (for idle-time metering)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.since = 0.0
        self.total = 0.0
        self.runs = 0
        self.boot = time.monotonic()

    def enter(self) -> None:
        with self.lock:
            self.runs += 1
            if self.active == 0:
                self.since = time.monotonic()
            self.active += 1

    def exit(self) -> None:
        with self.lock:
            self.active -= 1
            if self.active == 0:
                self.total += time.monotonic() - self.since

    def report(self, msg_id: int) -> p.UsageReport:
        with self.lock:
            now = time.monotonic()
            busy = self.total + (now - self.since if self.active else 0.0)
            return p.UsageReport(id=msg_id, busy_ms=busy * 1e3, runs=self.runs, uptime_ms=(now - self.boot) * 1e3)

    def reset(self) -> None:
        with self.lock:
            self.total = 0.0
            self.runs = 0
            self.since = time.monotonic()
            self.boot = self.since


class SerialPort:
    """A virtio-serial port (microVM tier) used where a connected socket would be.

    The host side is one stream that comes and goes: a read returns EOF while no host is
    connected (between two host processes, across a pause or restore), and a write blocks
    until one is. One lock for all writers: the kernel splits large writes, and frames of an
    old and a new host connection must never interleave.
    """

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self._lock = threading.Lock()

    def recv(self, n: int) -> bytes:
        return os.read(self.fd, n)

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        with self._lock:
            while view:
                view = view[os.write(self.fd, view) :]

    def wait_host(self) -> None:
        """Until a host is connected and has sent something (poll reports HUP while none is)."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while True:
            events = poller.poll()
            if events and not events[0][1] & select.POLLHUP:
                return
            time.sleep(0.01)

    def shutdown(self, how: int) -> None:
        pass

    def close(self) -> None:
        pass  # the port outlives every host connection


# made on first use: run_code without a context (per language)
_DEFAULT_CONTEXTS = {"default": "python", "default-javascript": "javascript", "default-bash": "bash"}


class Agent:
    def __init__(
        self,
        listener: socket.socket | None,
        path: str | None = None,
        serial: SerialPort | None = None,
        cgroup_fd: int | None = None,
    ) -> None:
        self.listener = listener
        self.path = path  # where it listens, when not on an inherited fd
        self.serial = serial
        self.quiescing = threading.Event()
        # SIGUSR1: the host says "listen again". A plain flag and a self-pipe, never a lock: the
        # handler runs in the main thread, which may hold that lock at that moment (an Event's
        # set() in the handler of its own waiter deadlocked the agent: 1 gVisor resume in ~20)
        self.resume_signalled = False
        self._resume_r, self._resume_w = os.pipe()
        os.set_blocking(self._resume_r, False)
        os.set_blocking(self._resume_w, False)
        self._conns: set = set()
        self._conns_lock = threading.Lock()
        self.reaper = Reaper()
        self.oom = OomCounter()
        self.busy = Busy()
        self.workers = Workers()
        self.scopes = Scopes(self, cgroup_fd)
        self.procs = bg.ProcTable()
        self.procs.release_scope = self.scopes.finish
        self.hardened = threading.Event()  # set once the agent is not dumpable (see harden())
        self._contexts: dict[str, Context] = {}
        self._ctx_lock = threading.Lock()
        self._ctx_seq = 0

    def new_context(self, name: str, language: str, cwd: str, env: dict[str, str]) -> Context:
        self.hardened.wait(5)
        with self._ctx_lock:
            if not name:
                self._ctx_seq += 1
                name = f"ctx-{self._ctx_seq}"
            if name in self._contexts:
                raise _Fail(p.ErrorCode.EXISTS, f"context {name} exists")
            if len(self._contexts) >= 64:
                raise _Fail(p.ErrorCode.INVALID, "too many code contexts (64)")
            ctx = Context(self, name, language, cwd, env)
            self._contexts[name] = ctx
            return ctx

    def get_context(self, name: str) -> Context:
        with self._ctx_lock:
            ctx = self._contexts.get(name)
        if ctx is None and name in _DEFAULT_CONTEXTS:
            try:
                return self.new_context(name, _DEFAULT_CONTEXTS[name], os.environ.get("HOME", "/"), {})
            except _Fail as e:
                if e.code is not p.ErrorCode.EXISTS:
                    raise
                return self.get_context(name)
        if ctx is None:
            raise _Fail(p.ErrorCode.CONTEXT_NOT_FOUND, f"no code context {name!r}")
        return ctx

    def contexts(self) -> list[Context]:
        with self._ctx_lock:
            return list(self._contexts.values())

    def drop_context(self, ctx: Context) -> None:
        """Forget ``ctx`` (not a context that replaced it under its name: see restart_context)."""
        with self._ctx_lock:
            if self._contexts.get(ctx.name) is ctx:
                del self._contexts[ctx.name]

    def restart_context(self, name: str) -> None:
        """A fresh interpreter under ``name`` with the old one's language, working directory and
        creation environment; the old one and what its cells started are ended, a run in progress
        with them (it reports the interpreter died)."""
        with self._ctx_lock:
            old = self._contexts.get(name)
        if old is None:  # a default context not started yet is started fresh; any other is unknown
            self.get_context(name)
            return
        old.scope.kill()  # before its lock: a running cell ends now, and its run lets the lock go
        with old.lock:
            old.kill()
            try:
                fresh = Context(self, name, old.language, old.cwd, old.env)
            except BaseException:
                self.drop_context(old)  # ended: its name is free, not a dead context's
                raise
            with self._ctx_lock:
                self._contexts[name] = fresh

    def serve_forever(self) -> None:
        while True:
            try:
                assert self.listener is not None  # serve_forever runs only with a listening socket
                fd, _ = self.listener._accept()  # type: ignore[attr-defined]  # _socket.socket has it, unstubbed
                sock = socket.socket(fileno=fd)
            except InterruptedError:  # pragma: no cover
                continue
            except OSError:
                if not self.quiescing.is_set():
                    raise
                self._await_resume()
                continue
            conn = Connection(self, sock)
            with self._conns_lock:
                self._conns.add(conn)
            # A worker already waiting takes the connection (a hand-off, ~25 us); a thread started
            # for it would keep its first request waiting ~0.3 ms.
            if not self.workers.submit(self._serve, conn):  # no thread could be started (limits.pids)
                self._serve_refused(conn)
            self.workers.spare()  # the next connection finds one waiting too (started off its path)

    def serve_serial(self) -> None:
        """One host connection at a time over the VM's port (the host multiplexes its clients)."""
        serial = self.serial
        assert serial is not None
        while True:
            serial.wait_host()
            conn = Connection(self, serial)
            with self._conns_lock:
                self._conns.add(conn)
            self._serve(conn)

    def _serve(self, conn: Connection) -> None:
        try:
            conn.serve()
        finally:
            with self._conns_lock:
                self._conns.discard(conn)

    def _serve_refused(self, conn: Connection) -> None:
        """No thread for a new connection: close it (the host sees the connection end) and keep
        accepting; a later connection gets a thread once processes ended."""
        with self._conns_lock:
            self._conns.discard(conn)
        try:
            conn.sock.close()
        except OSError:
            pass

    def quiesce(self, keep: Connection | None = None) -> None:
        """Drop every host socket but ``keep`` (see protocol.Quiesce); serve_forever waits for the
        resume trigger. Returns once they are closed (bounded): the caller then answers on ``keep``
        and drops it too, and the host checkpoints only after that (a host socket still open
        makes gVisor's checkpoint fail, and the sandbox was lost with it).

        Only a trigger that comes after this one counts: a SIGUSR1 or ``resume`` file of an earlier
        resume (the agent had seen the file and listened before the signal came) would otherwise
        make it listen again at once, before the checkpoint or before the host cleared run/."""
        self.resume_signalled = False
        self._drain_resume()
        if self.path is not None:
            try:
                os.unlink(os.path.join(os.path.dirname(self.path), "resume"))
            except OSError:
                pass
        self.quiescing.set()
        others = [c for c in list(self._conns) if c is not keep]
        for sock in [c.sock for c in others] + ([self.listener] if self.listener is not None else []):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            if self.listener is not None:
                self.listener.close()
        except OSError:
            pass
        # each connection's reader closes its socket as it ends (the main thread may stay in
        # accept() on the closed listener until the checkpoint: gVisor saves that, and the
        # restored accept() fails with EBADF, which sends it to _await_resume)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(c in self._conns for c in others):
            time.sleep(0.002)

    def on_resume_signal(self, *_: object) -> None:
        """SIGUSR1's handler (main thread): counts only while quiesced; takes no lock."""
        if self.quiescing.is_set():
            self.resume_signalled = True
            try:
                os.write(self._resume_w, b"\0")
            except OSError:  # full: a byte is there already
                pass

    def _drain_resume(self) -> None:
        try:
            while os.read(self._resume_r, 64):
                pass
        except OSError:  # empty
            pass

    def _await_resume(self) -> None:
        """Wait for the host's ``resume`` file (the host removed the old socket), listen again.
        A bind that fails (a guest process holds the name) waits for the next trigger: the
        agent never exits here, or the sandbox would be lost."""
        path = self.path
        assert path is not None  # only an agent listening on a path is quiesced
        trigger = os.path.join(os.path.dirname(path), "resume")
        while True:
            # the host signals SIGUSR1 (gVisor may cache the directory, so a file it made can stay
            # unseen); the file is the fallback, for restores of images of older agents' hosts
            while not self.resume_signalled and not os.path.lexists(trigger):
                select.select([self._resume_r], [], [], 0.02)  # the handler's byte ends it at once
            self.resume_signalled = False
            self._drain_resume()
            for stale in (path, trigger):
                try:
                    os.unlink(stale)
                except OSError:
                    pass
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(path)
                listener.listen(128)
            except OSError:
                listener.close()
                time.sleep(0.05)
                continue
            self.listener = listener
            self.quiescing.clear()
            return


def harden(agent: Agent) -> None:
    """Make the agent non-dumpable: user code runs as the agent's uid, and could otherwise read
    and write the agent's memory through /proc/1/mem or attach with ptrace. Children get the
    flag back at exec (they are the user's). In a thread: importing ctypes costs ~5 ms, off the
    start path; commands and contexts wait for it (``agent.hardened``), and for the spawn
    library (:class:`Scopes`), loaded here for the same reason."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
            print(f"warmbox agent: prctl(PR_SET_DUMPABLE) failed: errno {ctypes.get_errno()}", file=sys.stderr)
        if os.getpid() != 1:  # (tests) orphans, the commands' PID-namespace inits among them, come to us
            libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception as e:  # no ctypes in the image: say so, keep serving
        print(f"warmbox agent: cannot make itself non-dumpable: {e}", file=sys.stderr)
    try:
        agent.scopes.setup()
    except Exception as e:
        print(f"warmbox agent: no spawn library ({e}): a timed-out command's orphans may survive", file=sys.stderr)
    finally:
        agent.hardened.set()
    agent.workers.spare()  # off the start path too: a worker waits for the first request or connection


def _start_hardening(agent: Agent) -> None:
    threading.Thread(target=harden, args=(agent,), daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    """argv: [--cgroup-fd N] then ``--serial PORT`` (microVM), a socket path, or nothing (fd 3).

    --cgroup-fd: an inherited cgroup v2 directory for the commands' cgroups (see Scopes)."""
    argv = sys.argv[1:] if argv is None else argv
    userenv.setup()  # the venv and npm prefix of /home/user, before any command or context
    cgroup_fd = None
    if argv[:1] == ["--cgroup-fd"]:
        cgroup_fd, argv = int(argv[1]), argv[2:]
    if argv and argv[0] == "--serial":
        agent = Agent(None, serial=SerialPort(argv[1]), cgroup_fd=cgroup_fd)
        _start_hardening(agent)
        if os.getpid() == 1:
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(s, lambda *_: os._exit(0))
        agent.serve_serial()
        return
    if argv:
        # a resume trigger before its handler below means nothing (as PID 1 drops it): never the
        # default action, which ends the process (a test's agent, not PID 1, signalled at once)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(argv[0])
        listener.listen(128)
    else:
        listener = socket.socket(fileno=3)
        os.set_inheritable(3, False)
    if os.getpid() == 1:
        # PID 1 gets no default signal actions; make the obvious ones end the sandbox.
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, lambda *_: os._exit(0))
    agent = Agent(listener, argv[0] if argv else None, cgroup_fd=cgroup_fd)
    _start_hardening(agent)
    if argv:  # listening on a path: after a quiesce the host's SIGUSR1 says "listen again"
        signal.signal(signal.SIGUSR1, agent.on_resume_signal)
    agent.serve_forever()


if __name__ == "__main__":  # pragma: no cover
    main()
