"""Guest agent: PID 1 of a sandbox; serves exec, files and code contexts over the wire protocol.

Stdlib-only. It listens on an inherited unix socket (fd 3, passed by the backend) or on a path
given on the command line (tests). As PID 1 it reaps every orphan; exit statuses of its own
children are routed to the request that started them.
"""

from __future__ import annotations

# C modules directly: the pure-Python socket and signal wrappers import enum and selectors.
import _signal as signal  # type: ignore[import-not-found]  # no stub: a C module, the wrapper's core
import _socket as socket
import collections
import errno
import os
import select
import stat as stat_mod
import struct
import sys
import threading
import time

from warmbox import protocol as p
from warmbox.guest import procs as bg
from warmbox.guest import userenv

TYPE_CHECKING = False  # not typing's: the guest imports nothing it does not use at run time
if TYPE_CHECKING:
    from typing import Any

# Imports are kept to what the boot path needs: every millisecond here is on each cold start.
_GUEST_LIB = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_READ = 64 << 10
_EXIT_GRACE_S = 0.1  # output still drained after the main process exited
_KILL_WAIT_S = 5.0
_CONTEXT_INTERRUPT_GRACE_S = 2.0

_ERRNO = {
    errno.ENOENT: p.ErrorCode.NOT_FOUND,
    errno.EEXIST: p.ErrorCode.EXISTS,
    errno.EISDIR: p.ErrorCode.IS_A_DIRECTORY,
    errno.ENOTDIR: p.ErrorCode.NOT_A_DIRECTORY,
    errno.EACCES: p.ErrorCode.PERMISSION_DENIED,
    errno.EPERM: p.ErrorCode.PERMISSION_DENIED,
    errno.EROFS: p.ErrorCode.PERMISSION_DENIED,
    errno.ENOSPC: p.ErrorCode.NO_SPACE,
    errno.EDQUOT: p.ErrorCode.NO_SPACE,
    errno.EFBIG: p.ErrorCode.NO_SPACE,
    errno.ENOTEMPTY: p.ErrorCode.EXISTS,
}


class Inbox:
    """Unbounded FIFO for follow-up frames of one request (queue.Queue without its imports)."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()

    def put(self, item: object) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def get(self) -> object:
        with self._cond:
            while not self._items:
                self._cond.wait()
            return self._items.popleft()

    EMPTY = object()

    def poll(self) -> object:
        """The next item without waiting, or ``Inbox.EMPTY``."""
        with self._cond:
            return self._items.popleft() if self._items else Inbox.EMPTY


class _Fail(Exception):
    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _oserror(e: OSError) -> _Fail:
    code = _ERRNO.get(e.errno or 0, p.ErrorCode.INTERNAL)
    return _Fail(code, f"{e.strerror or e}: {e.filename}" if e.filename else str(e))


# --------------------------------------------------------------------------- reaping


class Reaper:
    """Single owner of waitpid(): reaps every child and orphan, hands statuses to waiters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._statuses: dict[int, int] = {}
        self._wakeups: dict[int, int] = {}  # pid -> write end of a pipe poked on exit
        self._events: dict[int, threading.Event] = {}
        self._have_children = threading.Event()
        threading.Thread(target=self._run, name="reaper", daemon=True).start()

    def register(self, pid: int, wakeup_fd: int | None = None) -> threading.Event:
        with self._lock:
            ev = self._events.setdefault(pid, threading.Event())
            if wakeup_fd is not None:
                self._wakeups[pid] = wakeup_fd
            if pid in self._statuses:
                ev.set()
                if wakeup_fd is not None:
                    os.write(wakeup_fd, b"x")
        self._have_children.set()
        return ev

    def status(self, pid: int) -> int | None:
        with self._lock:
            return self._statuses.get(pid)

    def forget(self, pid: int) -> None:
        with self._lock:
            self._statuses.pop(pid, None)
            self._events.pop(pid, None)
            self._wakeups.pop(pid, None)

    def _run(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                # No children: sleep until register() says one exists. Clearing *after* the
                # wait means a registration that raced the ECHILD is never missed.
                self._have_children.wait(1.0)
                self._have_children.clear()
                continue
            except InterruptedError:  # pragma: no cover
                continue
            with self._lock:
                self._statuses[pid] = status
                ev = self._events.get(pid)
                if ev is not None:
                    ev.set()
                fd = self._wakeups.get(pid)
                if fd is not None:
                    try:
                        os.write(fd, b"x")
                    except OSError:
                        pass
                if len(self._statuses) > 4096:  # orphans nobody waits for: bound the memory
                    for k in [k for k in self._statuses if k not in self._events][:2048]:
                        del self._statuses[k]


def _proc_table() -> list[tuple[int, int, int, int]]:
    """(pid, ppid, pgrp, session) for every visible process."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        rest = raw[raw.rfind(b")") + 2 :].split()
        try:
            out.append((int(name), int(rest[1]), int(rest[2]), int(rest[3])))
        except (IndexError, ValueError):
            continue
    return out


def kill_tree(root: int, sig: int = signal.SIGKILL, rounds: int = 8) -> None:
    """Signal ``root``, its process group and session, and every descendant.

    For SIGKILL the tree is first frozen with SIGSTOP, round by round, so a process that
    setsid()s or double-forks cannot escape by being reparented before it is found.
    """
    me = os.getpid()
    targets: set[int] = set()
    for _ in range(rounds):
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, ppid, _, _ in table:
            children.setdefault(ppid, []).append(pid)
        found = {pid for pid, _, pgrp, sid in table if pgrp == root or sid == root}
        stack = [root, *targets]
        while stack:
            cur = stack.pop()
            if cur not in found:
                found.add(cur)
            stack.extend(c for c in children.get(cur, ()) if c not in found)
        found.discard(me)
        alive = {row[0] for row in table}
        new = (found & alive) - targets
        if not new:
            break
        targets |= new
        if sig != signal.SIGKILL:
            break
        for t in new:
            try:
                os.kill(t, signal.SIGSTOP)
            except OSError:
                pass
    try:
        os.killpg(root, sig)
    except OSError:
        pass
    for t in targets:
        try:
            os.kill(t, sig)
        except OSError:
            pass


# --------------------------------------------------------------------------- scopes


class Scope:
    """Every process one command or code context ever starts.

    ``kill()`` ends all of them, double-forked and setsid()ed ones included, by a kernel
    mechanism (see :class:`Scopes`). ``pid`` is the process the agent waits for and reports as
    ``Started.pid``; ``wake_fd`` becomes readable when that process has ended.
    """

    pid: int
    wake_fd: int

    def collect(self) -> None:
        """Consume what made ``wake_fd`` readable (once)."""

    def status(self) -> int | None:
        """The wait status of the command's process once it ended, else None."""
        raise NotImplementedError

    def wait(self, timeout: float | None) -> int | None:
        """Until the command's process ended (None: without bound); its status or None."""
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def signal(self, sig: int) -> None:
        """A signal other than SIGKILL to every process of the tree (best effort)."""
        raise NotImplementedError

    def interrupt(self) -> None:
        """SIGINT to the command's own process only (a code context's interpreter)."""
        raise NotImplementedError

    def close(self) -> None:
        """After the run; processes it left behind keep running."""


class _ReapedScope(Scope):
    """The command is the agent's own child: the reaper has its status."""

    def __init__(self, agent: Agent, pid: int) -> None:
        self.agent = agent
        self.pid = pid
        self.wake_fd, self._wake_w = os.pipe()
        self._event = agent.reaper.register(pid, self._wake_w)
        self._closed: int | None = None  # after close: the last status known (SIGKILL: none was)

    def collect(self) -> None:
        os.read(self.wake_fd, 64)

    def status(self) -> int | None:
        if self._closed is not None:
            return self._closed
        return self.agent.reaper.status(self.pid)

    def wait(self, timeout: float | None) -> int | None:
        self._event.wait(timeout)
        return self.status()

    def signal(self, sig: int) -> None:
        kill_tree(self.pid, sig)

    def interrupt(self) -> None:
        try:
            os.kill(self.pid, signal.SIGINT)
        except OSError:
            pass

    def close(self) -> None:
        status = self.agent.reaper.status(self.pid)
        self._closed = signal.SIGKILL if status is None else status
        self.agent.reaper.forget(self.pid)  # before closing the pipe: the reaper writes to it
        for fd in (self.wake_fd, self._wake_w):
            os.close(fd)


class _TreeScope(_ReapedScope):
    """No kernel mechanism (no spawn library, or the sandbox offers neither a cgroup nor user
    namespaces): the tree is walked, which misses processes re-parented to the agent."""

    def kill(self) -> None:
        kill_tree(self.pid)


class _CgroupScope(_ReapedScope):
    def __init__(self, agent: Agent, pid: int, scopes: Scopes, name: str) -> None:
        super().__init__(agent, pid)
        self.scopes = scopes
        self.name = name

    def kill(self) -> None:
        self.scopes.cgroup_kill(self.name)

    def signal(self, sig: int) -> None:
        for pid in self.scopes.cgroup_pids(self.name):  # the whole cgroup: orphans too
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def close(self) -> None:
        super().close()
        self.scopes.release(self.name)


_STARTED, _NOT_STARTED = 0x7FFFFFFE, 0x7FFFFFFD  # init.c's first word on its report pipe


def _started(report: int) -> bool:
    """Whether the init's command runs (init.c writes it first, then the wait status); an init
    that died first (or says nothing in 10 s) counts as started: its wait tells the rest."""
    data = b""
    deadline = time.monotonic() + 10.0
    while len(data) < 4:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([report], [], [], left)[0]:
            return True
        chunk = os.read(report, 4 - len(data))
        if not chunk:
            return True
        data += chunk
    return int.from_bytes(data, sys.byteorder, signed=True) != _NOT_STARTED


class _PidnsScope(Scope):
    """The command is PID 2 of its own PID namespace under an init (init.c) re-parented to the
    agent; ``pid`` is that init. It writes the command's wait status on a pipe (``wake_fd``) and
    lives on while processes the command left behind do."""

    def __init__(self, agent: Agent, init: int, report: int) -> None:
        self.agent = agent
        self.pid = init
        self.wake_fd = report
        self._status: int | None = None
        self._done = False

    def collect(self) -> None:
        if self._done:
            return
        data = b""
        while len(data) < 4:
            chunk = os.read(self.wake_fd, 4 - len(data))
            if not chunk:
                break
            data += chunk
        self._done = True
        # no status: the init died first (it was killed), and the command with it
        self._status = int.from_bytes(data, sys.byteorder, signed=True) if len(data) == 4 else signal.SIGKILL

    def status(self) -> int | None:
        if not self._done and select.select([self.wake_fd], [], [], 0)[0]:
            self.collect()
        return self._status

    def wait(self, timeout: float | None) -> int | None:
        if not self._done and select.select([self.wake_fd], [], [], timeout)[0]:
            self.collect()
        return self._status

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)  # the kernel then kills the whole namespace
        except OSError:
            pass

    def signal(self, sig: int) -> None:
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, ppid, _, _ in table:
            children.setdefault(ppid, []).append(pid)
        stack = list(children.get(self.pid, ()))  # all of the namespace: its orphans go to the init
        while stack:
            cur = stack.pop()
            try:
                os.kill(cur, sig)
            except OSError:
                pass
            stack.extend(children.get(cur, ()))

    def interrupt(self) -> None:
        try:
            os.kill(self.pid, signal.SIGINT)  # the init passes it on to the command
        except OSError:
            pass

    def close(self) -> None:
        self.status()
        self._done = True  # no more reads of the closed pipe
        if self._status is None:
            self._status = signal.SIGKILL
        os.close(self.wake_fd)


class Scopes:
    """How commands and code contexts are started so that a timeout or kill ends all they started.

    - ``cgroup``: the agent was handed a cgroup v2 directory (an fd; writable through no path in
      the sandbox, so user code can neither reach it nor move itself out). Each command runs in
      its own child cgroup and is killed with ``cgroup.kill``. Pids, ``ps`` and ``kill`` are as
      without it. (container tier: by the host; microVM: by the guest's init)
    - ``pidns``: each command is PID 2 of its own PID namespace (in a user namespace that maps
      the sandbox uid and gid to themselves), under an init the agent kills (made by a resident
      ``wb-init --serve``: an exec of wb-init per command would cost as much as the command's). Inside a command
      ``$$`` and getpid() count from 2 in that namespace, while ``/proc`` (``ps``) shows the
      sandbox's numbering, so ``kill`` of a pid read from ``ps`` or ``pgrep`` misses, and a command
      cannot signal processes another command started; files of uids other than the sandbox
      user's show as nobody (65534). (gVisor: no host cgroup reaches its kernel, its cgroupfs is
      root's, and the agent has no capability to make one)
    - ``tree``: neither is available; the process tree is walked (misses re-parented orphans).

    On a normal exit the processes a command leaves behind (``nohup server &``) keep running;
    a runaway one (a fork bomb) is bounded by limits.pids and limits.cpus, not ended.
    """

    def __init__(self, agent: Agent, cgroup_fd: int | None) -> None:
        self.agent = agent
        self.cgroup_fd = cgroup_fd
        self.mode = "tree"
        self._lib: Any = None  # ctypes.CDLL of spawn.so (its functions are looked up by name)
        self._libc: Any = None
        self._lock = threading.Lock()
        self._seq = 0
        self._free: list[str] = []  # empty cgroups, ready for the next command
        self._busy: collections.deque = collections.deque()  # released but still populated
        self.by_pid: dict[int, Scope] = {}
        self._server = None  # the socket to wb-init --serve (pidns mode), started on first use
        self._server_failed = False
        self._server_lock = threading.Lock()

    def setup(self) -> None:
        """Load the spawn library and choose the mode (off the start path: ctypes costs ~5 ms)."""
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(here, "spawn.so")
        self._init_exe = os.path.join(here, "wb-init")
        if not (os.path.exists(path) and os.access(self._init_exe, os.X_OK)):
            print("warmbox agent: no spawn helpers: a timed-out command's orphans may survive", file=sys.stderr)
            return
        import ctypes

        lib: Any = ctypes.CDLL(path, use_errno=True)
        ptrs = ctypes.POINTER(ctypes.c_char_p)
        lib.wb_spawn_cgroup.argtypes = [ctypes.c_char_p, ptrs, ptrs, ctypes.c_char_p] + [ctypes.c_int] * 5
        lib.wb_spawn_cgroup.restype = ctypes.c_int
        self._ctypes = ctypes
        self._lib = lib
        self._libc = ctypes.CDLL(None, use_errno=True)  # prctl in a forked context (fork)
        if self.cgroup_fd is not None:
            try:
                os.set_inheritable(self.cgroup_fd, False)
                os.stat("cgroup.kill", dir_fd=self.cgroup_fd)  # a kernel without it: ENOENT
                if not os.access("cgroup.procs", os.W_OK, dir_fd=self.cgroup_fd):
                    raise OSError(errno.EACCES, "its cgroup.procs is not the sandbox user's")
                self.mode = "cgroup"
                return
            except OSError as e:
                print(f"warmbox agent: the host's cgroup is unusable ({e}); using PID namespaces", file=sys.stderr)
        self.mode = "pidns"

    def spawn(
        self,
        exe: str,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None,
        stdio: tuple[int, int, int],
        keep_fd: int = -1,
    ) -> Scope:
        """Start ``argv`` (``exe`` resolved) in a new session with default signal actions.

        Raises BlockingIOError while the pids limit is hit, OSError when nothing started.
        """
        with self._lock:
            mode = self.mode
        scope: Scope | None
        if mode == "cgroup":
            scope = self._spawn_cgroup(exe, argv, env, cwd, stdio, keep_fd)
        elif mode == "pidns":
            scope = self._spawn_pidns(exe, argv, env, cwd, stdio, keep_fd)
            if scope is None:  # no user namespaces here after all
                with self._lock:
                    self.mode = "tree"
                print(
                    "warmbox agent: user namespaces are refused: a timed-out command's orphans may survive",
                    file=sys.stderr,
                )
                scope = self._spawn_tree(exe, argv, env, cwd, stdio, keep_fd)
        else:
            scope = self._spawn_tree(exe, argv, env, cwd, stdio, keep_fd)
        with self._lock:
            self.by_pid[scope.pid] = scope
        return scope

    def fork(self, child: Any) -> Scope | None:
        """A child of the agent (``os.fork``: the agent's memory shared copy-on-write) in the scope a
        spawn would give it, running ``child(procs_fd, ready_fd)``, which never returns: it first
        moves itself into the command's cgroup (a write of "0" to ``procs_fd``; -1 in tree mode),
        then writes one byte to ``ready_fd`` (0: in its scope, else an errno), then drops all of the
        agent it holds (:func:`_forked`). None when this mode cannot (pidns: a process cannot enter
        a new PID namespace and stay the agent's child without an exec) or no instant without an
        import in progress came (:func:`_fork_quiet`): the caller execs instead.
        Raises BlockingIOError while the pids limit is hit, OSError when the child could not enter
        its scope."""
        if not self.can_fork():
            return None
        with self._lock:
            mode = self.mode
        name = scope = None
        procs = -1
        ready_r, ready_w = os.pipe()
        try:
            if mode == "cgroup":
                name = self._take()
                procs = os.open(f"{name}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.cgroup_fd)
            pid = _fork_quiet()
            if pid == 0:
                child(procs, ready_w)  # never returns (os._exit)
            if pid is None:
                return None
            scope = _TreeScope(self.agent, pid) if name is None else _CgroupScope(self.agent, pid, self, name)
            os.close(ready_w)
            ready_w = -1
            # EOF: it died first (killed meanwhile, say); nothing within 30 s: it never will
            status = os.read(ready_r, 1) if select.select([ready_r], [], [], 30.0)[0] else b""
            err = status[0] if status else errno.EIO
            if err:
                scope.kill()
                os.kill(pid, signal.SIGKILL)  # (maybe not in its cgroup)
                scope.close()
                raise OSError(err, f"the code context could not enter its scope: {os.strerror(err)}")
        finally:
            if scope is None and name is not None:
                self.release(name)
            for fd in (procs, ready_r, ready_w):
                if fd >= 0:
                    os.close(fd)
        with self._lock:
            self.by_pid[pid] = scope
        return scope

    def can_fork(self) -> bool:
        """Whether ``fork`` may give a child (its mode and the libc it needs), before anything is paid."""
        with self._lock:
            return self.mode in ("cgroup", "tree") and self._libc is not None

    def prctl(self, option: int, value: int) -> int:
        """prctl(2) with one argument (libc of the agent, loaded by setup): 0 or -1."""
        return int(self._libc.prctl(option, value, 0, 0, 0))

    def finish(self, scope: Scope) -> None:
        """The run is over (idempotent): release what the scope holds."""
        with self._lock:
            if self.by_pid.get(scope.pid) is not scope:
                return
            del self.by_pid[scope.pid]
        scope.close()

    def find(self, pid: int) -> Scope | None:
        with self._lock:
            return self.by_pid.get(pid)

    def _cargs(self, exe: str, argv: list[str], env: dict[str, str], cwd: str | None) -> tuple:
        c = self._ctypes
        args = (c.c_char_p * (len(argv) + 1))(*[os.fsencode(a) for a in argv], None)
        envp = (c.c_char_p * (len(env) + 1))(*[os.fsencode(f"{k}={v}") for k, v in env.items()], None)
        return os.fsencode(exe), args, envp, os.fsencode(cwd) if cwd else None

    def _spawn_cgroup(self, exe, argv, env, cwd, stdio, keep_fd) -> Scope:
        name = self._take()
        try:
            procs = os.open(f"{name}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.cgroup_fd)
            try:
                pid = self._lib.wb_spawn_cgroup(*self._cargs(exe, argv, env, cwd), *stdio, keep_fd, procs)
            finally:
                os.close(procs)
            if pid < 0:
                raise OSError(-pid, os.strerror(-pid))
        except BaseException:
            self.release(name)
            raise
        return _CgroupScope(self.agent, pid, self, name)

    def _spawn_pidns(self, exe, argv, env, cwd, stdio, keep_fd) -> Scope | None:
        report_r, report_w = os.pipe()
        try:
            try:
                init = self._ask_server(exe, argv, env, cwd, stdio, keep_fd, report_w)
                if init is None:
                    init = self._exec_helper(exe, argv, env, cwd, stdio, keep_fd, report_w)
            finally:
                os.close(report_w)
        except BaseException:
            os.close(report_r)
            raise
        if init > 0:
            if not _started(report_r):
                os.close(report_r)
                raise BlockingIOError(errno.EAGAIN, "no process could be started")
            return _PidnsScope(self.agent, init, report_r)
        os.close(report_r)
        if -init in (errno.EPERM, errno.EACCES, errno.EINVAL, errno.ENOSYS, errno.EUSERS, errno.ENOSPC):
            return None  # no user namespaces here: the caller falls back
        if -init == errno.EAGAIN:
            raise BlockingIOError(errno.EAGAIN, "no process could be started")
        raise OSError(-init, f"cannot create the command's namespaces: {os.strerror(-init)}")

    def _ask_server(self, exe, argv, env, cwd, stdio, keep_fd, report_w) -> int | None:
        """The init's pid (or -errno) from ``wb-init --serve``, which clones inits without an exec
        per command (each costs as much as the command's own under gVisor); None: ask wb-init."""
        fields = [str(keep_fd), cwd or "", exe, str(len(argv)), *argv, *[f"{k}={v}" for k, v in env.items()]]
        payload = b"\0".join(os.fsencode(f) for f in fields)
        if len(payload) > 120 << 10:
            return None
        fds = [*stdio, report_w] + ([keep_fd] if keep_fd >= 0 else [])
        rights = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in fds)
        with self._server_lock:
            if self._server is None and not self._server_failed:
                self._server = self._start_server()
            if self._server is None:
                return None
            try:
                self._server.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
                reply = self._server.recv(4)
            except OSError as e:
                if e.errno == errno.EMSGSIZE:  # larger than the socket takes: this one execs wb-init
                    return None
                reply = b""
            if len(reply) != 4:  # it died: every command from now on execs wb-init itself
                print("warmbox agent: the init server is gone; commands exec wb-init", file=sys.stderr)
                self._server.close()
                self._server, self._server_failed = None, True
                return None
        return int.from_bytes(reply, sys.byteorder, signed=True)

    def _start_server(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            pid = _posix_spawn(
                self._init_exe,
                [self._init_exe, "--serve", "3"],
                dict(os.environ),
                (null, null, null),
                {3: theirs.fileno()},
            )
        except OSError as e:
            print(f"warmbox agent: cannot start the init server ({e}); commands exec wb-init", file=sys.stderr)
            ours.close()
            self._server_failed = True
            return None
        finally:
            theirs.close()
            os.close(null)
        self.agent.reaper.register(pid)
        return ours

    def _exec_helper(self, exe, argv, env, cwd, stdio, keep_fd, report_w) -> int:
        """The init's pid (or -errno) from an exec of wb-init for this command alone."""
        ctl_r, ctl_w = os.pipe()
        ctl, report = [fd for fd in (3, 4, 5) if fd != keep_fd][:2]  # the helper's fd numbers
        helper = [self._init_exe, str(ctl), str(report), str(keep_fd), cwd or "", exe, *argv]
        try:
            try:
                helper_pid = _posix_spawn(
                    self._init_exe, helper, env, stdio, {ctl: ctl_w, report: report_w, keep_fd: keep_fd}
                )
            finally:
                os.close(ctl_w)
            self.agent.reaper.register(helper_pid)  # it exits at once; the init is re-parented to us
            data = b""
            while len(data) < 4:
                chunk = os.read(ctl_r, 4 - len(data))
                if not chunk:
                    break
                data += chunk
            self.agent.reaper.forget(helper_pid)
        finally:
            os.close(ctl_r)
        return int.from_bytes(data, sys.byteorder, signed=True) if len(data) == 4 else -errno.EIO

    def _spawn_tree(self, exe, argv, env, cwd, stdio, keep_fd) -> Scope:
        if cwd is not None:  # posix_spawn cannot chdir; coreutils env can, at the cost of one exec
            argv, exe = ["/usr/bin/env", "-C", cwd, "--", *argv], "/usr/bin/env"
        return _TreeScope(self.agent, _posix_spawn(exe, argv, env, stdio, {keep_fd: keep_fd}))

    # cgroups: one per running command, reused once empty (mkdir+rmdir of a cgroup cost more)

    def _take(self) -> str:
        with self._lock:
            for _ in range(min(4, len(self._busy))):  # a few reads per command, oldest first
                name = self._busy.popleft()
                (self._busy if self._populated(name) else self._free).append(name)
            if self._free:
                return self._free.pop()
            self._seq += 1
            name = f"cmd-{self._seq}"
        os.mkdir(name, 0o755, dir_fd=self.cgroup_fd)
        return name

    def release(self, name: str) -> None:
        with self._lock:
            self._busy.append(name)
            while len(self._busy) > 64:  # many left-behind servers: stop tracking the oldest cgroups
                self._busy.popleft()

    def _populated(self, name: str) -> bool:
        try:
            fd = os.open(f"{name}/cgroup.events", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.cgroup_fd)
            try:
                return b"populated 0" not in os.read(fd, 256)
            finally:
                os.close(fd)
        except OSError:
            return True

    def cgroup_pids(self, name: str) -> list[int]:
        try:
            fd = os.open(f"{name}/cgroup.procs", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.cgroup_fd)
        except OSError:
            return []
        try:
            data = b""
            while chunk := os.read(fd, 65536):
                data += chunk
        finally:
            os.close(fd)
        return [int(x) for x in data.split()]

    def cgroup_kill(self, name: str) -> None:
        fd = os.open(f"{name}/cgroup.kill", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.cgroup_fd)
        try:
            os.write(fd, b"1")
        finally:
            os.close(fd)


def _posix_spawn(
    exe: str, argv: list[str], env: dict[str, str], stdio: tuple[int, int, int], extra: dict[int, int]
) -> int:
    """posix_spawn in a new session, default signal actions; ``extra``: child fd -> parent fd
    (-1 keys are skipped). Each goes through a high copy: a dup2 onto itself would keep CLOEXEC."""
    import fcntl  # not on the boot path

    copies = {target: fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for target, fd in extra.items() if target >= 0}
    try:
        actions = [(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(stdio)]
        actions += [(os.POSIX_SPAWN_DUP2, copy, target) for target, copy in copies.items()]
        return os.posix_spawn(
            exe, argv, env, file_actions=actions, setsid=True, setsigdef=_DEFAULT_SIGNALS, setsigmask=()
        )
    finally:
        for copy in copies.values():
            os.close(copy)


def _fork_quiet(tries: int = 500) -> int | None:
    """os.fork() at an instant when no thread of the agent is importing a module (the global
    import lock held, no module lock taken): a module half imported by another thread would be
    half imported, its lock held forever, in the child. None if no such instant came within
    ~1 s, or this interpreter's import machinery is not the one this knows.

    Every object then alive is frozen first (gc.freeze, after a collection: what is garbage now
    is freed, not frozen), on both sides: a collection walking them would write to each, and
    copy every page of them. The agent's frozen objects are never collected again; one of them
    that becomes cyclic garbage later stays (the agent's are long-lived: modules, its tables)."""
    import _imp  # builtin, imported by every interpreter at start
    import gc

    locks = getattr(sys.modules.get("_frozen_importlib"), "_module_locks", None)
    if not isinstance(locks, dict):
        return None
    gc.collect()
    for _ in range(tries):
        _imp.acquire_lock()
        try:
            if not locks:
                gc.freeze()
                return os.fork()
        finally:
            _imp.release_lock()
        time.sleep(0.002)
    return None


_KEPT: list[object] = []  # a forked context's old stdio objects: never finalised (see _forked)


def _forked(scopes: Scopes, procs: int, ready: int, keep_fd: int, cwd: str, env: dict[str, str]) -> None:
    """In a process just forked from the agent (one thread, the agent's memory): enter the
    command's scope, then drop everything of the agent: every descriptor but ``keep_fd``, its
    signal handlers and mask; dumpable again, as an exec'd process would be (the agent is not:
    see harden()). Its memory is a copy of the agent's, which holds nothing the sandbox's user
    cannot read anyway (no secret value ever enters a sandbox); what user code must never get
    is the agent's descriptors (host connections, the listener, the cgroup directory) and
    access to the agent's own memory, and it gets neither. Raises OSError."""
    os.setsid()
    try:
        if procs >= 0:
            os.write(procs, b"0")
    except OSError as e:
        os.write(ready, bytes([e.errno or errno.EIO]))
        raise
    os.write(ready, b"\0")
    # each descriptor of the agent becomes /dev/null (close-on-exec) rather than closed: a Python
    # object of the agent that owns one may close that number later, and must never close a
    # descriptor the user's code opened meanwhile under it
    null = os.open(os.devnull, os.O_RDWR)
    for fd in sorted(int(n) for n in os.listdir("/proc/self/fd")):
        if fd in (keep_fd, null):
            continue
        try:
            os.fstat(fd)
        except OSError:  # the listing's own directory, closed since
            continue
        os.dup2(null, fd, inheritable=fd <= 2)
    if null > 2:
        os.close(null)
    for sig in range(1, signal.NSIG):  # the agent's handlers (exit on SIGTERM, resume on SIGUSR1)
        try:
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    scopes.prctl(4, 1)  # PR_SET_DUMPABLE: the user's own process, debuggable by the user
    # new stdio over /dev/null; the agent's objects are kept, never finalised: another thread may
    # have held one's lock at the fork, and a flush would wait for it forever
    _KEPT.extend((sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__))
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    for name in ("stdin", "stdout", "stderr"):
        setattr(sys, f"__{name}__", getattr(sys, name))  # (typeshed calls them final)
    if cwd:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)


def fork_eligible(python: str, env: dict[str, str]) -> bool:
    """Whether a Python context may be forked from the agent rather than exec'd: ``python`` is the
    agent's own binary (the venv's interpreter is a link to it) and ``env`` sets no variable
    Python would read at start (kernel.FORK_ENV_OK)."""
    from warmbox.guest import kernel

    if not hasattr(type(sys.flags), "__match_args__"):  # (3.10+) kernel.from_fork rebuilds sys.flags
        return False
    try:
        if os.path.realpath(python) != os.path.realpath(sys.executable):
            return False
    except OSError:
        return False
    return not any(
        k.startswith("PYTHON") and k not in kernel.FORK_ENV_OK and k not in kernel.FORK_ENV_FOREIGN for k in env
    )


# --------------------------------------------------------------------------- connection


class Workers:
    """Threads that outlive one request: a thread start costs ~130 us, a hand-off ~25 us.

    A request never waits for a free worker (one is started when none is idle); at most
    ``keep`` idle workers stay, the rest end.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.tasks: collections.deque = collections.deque()
        self.cond = threading.Condition(threading.Lock())
        self.idle = 0

    def submit(self, fn, arg) -> bool:
        """Run ``fn(arg)`` on a worker; False (nothing queued) if no thread could be started."""
        with self.cond:
            self.tasks.append((fn, arg))
            if self.idle > len(self.tasks) - 1:
                self.cond.notify()
                return True
        try:
            threading.Thread(target=self._run, daemon=True).start()
        except RuntimeError:  # e.g. the pids cgroup is full (threads count)
            with self.cond:
                try:
                    self.tasks.remove((fn, arg))
                except ValueError:
                    return True  # an idle worker took it meanwhile
            return False
        return True

    def spare(self) -> None:
        """Start a worker unless one is idle (call off any request's path): the next connection or
        request is then handed off, not kept waiting for a thread start."""
        with self.cond:
            if self.idle > len(self.tasks):
                return
        try:
            threading.Thread(target=self._run, daemon=True).start()
        except RuntimeError:  # the pids limit: the next submit tries again
            pass

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.tasks:
                    if self.idle >= self.keep:
                        return
                    self.idle += 1
                    self.cond.wait()
                    self.idle -= 1
                fn, arg = self.tasks.popleft()
            fn(arg)


class Connection:
    def __init__(self, agent: Agent, sock: socket.socket | SerialPort) -> None:
        self.agent = agent
        self.sock = sock
        self.reader = p.SocketReader(sock, p.HOST_TO_GUEST)  # one recv takes in every frame that arrived
        self._send_lock = threading.Lock()
        self._inboxes: dict[int, Inbox] = {}
        self._inbox_lock = threading.Lock()
        self.tunnels: dict[int, _Tunnel] = {}  # running PortConnects (under _inbox_lock)
        self.closed = False

    def send(self, msg: p.Message) -> None:
        data = p.encode(msg)
        with self._send_lock:
            if self.closed:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed = True

    def inbox(self, rid: int) -> Inbox:
        with self._inbox_lock:
            box = self._inboxes.get(rid)
            if box is None:
                box = self._inboxes[rid] = Inbox()
            return box

    def serve(self) -> None:
        try:
            while True:
                try:
                    msg = self.reader.recv()
                except p.ProtocolViolation as e:
                    self.send(p.Failure(id=0, code=p.ErrorCode.INVALID, message=str(e)))
                    break
                except OSError:
                    break
                if msg is None:
                    break
                if isinstance(msg, p.StdinData):
                    self.inbox(msg.id).put(msg)
                    continue
                if isinstance(msg, (p.Chunk, p.ChunkEnd)):  # for a running upload only: after its
                    with self._inbox_lock:  # failure the rest is dropped, not queued forever
                        box = self._inboxes.get(msg.id)
                    if box is not None:
                        box.put(msg)
                    continue
                if isinstance(msg, (p.ReadAck, p.Cancel)):  # for a running read only: late ones are dropped
                    with self._inbox_lock:
                        box = self._inboxes.get(msg.id)
                        tunnel = self.tunnels.get(msg.id) if isinstance(msg, p.Cancel) else None
                    if box is not None:
                        box.put(msg)
                    if tunnel is not None:  # now: its worker may be stuck writing to a server that never reads
                        tunnel.stop()
                    continue
                if isinstance(msg, _PREPARED):
                    self.inbox(msg.id)  # before its worker starts: a Cancel (or data) may come first
                if type(msg) in _INLINE:  # answered at once, no thread hand-off
                    self._handle(msg)
                    continue
                if not self.agent.workers.submit(self._handle, msg):
                    with self._inbox_lock:
                        self._inboxes.pop(msg.id, None)
                    self.send(
                        p.Failure(
                            id=msg.id,
                            code=p.ErrorCode.EXEC_FAILED,
                            message="the sandbox's process limit (limits.pids) is reached; "
                            "the agent could not start a thread for this request",
                        )
                    )
        finally:
            self.closed = True
            with self._inbox_lock:
                for q in self._inboxes.values():
                    q.put(None)
                tunnels = list(self.tunnels.values())
            for t in tunnels:
                t.stop()
            try:
                self.sock.close()
            except OSError:
                pass

    def _handle(self, msg: p.Message) -> None:
        try:
            handler = _HANDLERS[type(msg)]
            handler(self.agent, self, msg)
        except _Fail as e:
            self.send(p.Failure(id=msg.id, code=e.code, message=str(e)))
        except OSError as e:
            f = _oserror(e)
            self.send(p.Failure(id=msg.id, code=f.code, message=str(f)))
        except Exception as e:  # a bug in the agent must not kill the connection
            self.send(p.Failure(id=msg.id, code=p.ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}"))
        finally:
            with self._inbox_lock:
                self._inboxes.pop(msg.id, None)


# --------------------------------------------------------------------------- handlers


def _ping(agent: Agent, conn: Connection, msg: p.Ping) -> None:
    conn.send(p.Pong(id=msg.id, version=p.PROTOCOL_VERSION, pid=os.getpid()))


def _spawn(
    agent: Agent,
    exe: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str | None,
    stdio: tuple[int, int, int],
    keep_fd: int = -1,
) -> Scope:
    """agent.scopes.spawn; while the pids limit is hit (EAGAIN: e.g. a killed fork bomb's
    processes are still being reaped) retry for up to ~2 s before giving up (EXEC_FAILED)."""
    delay = 0.005
    deadline = time.monotonic() + 2.0
    while True:
        try:
            return agent.scopes.spawn(exe, argv, env, cwd, stdio, keep_fd)
        except BlockingIOError:
            if time.monotonic() + delay > deadline:
                raise _Fail(
                    p.ErrorCode.EXEC_FAILED,
                    "the sandbox's process limit (limits.pids) is reached; no process could be started",
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


def _exit_status(status: int | None) -> tuple[int, int]:
    """(exit code, signal) of a wait status: 128+N and N if signal N ended it; (-1, 0) if unknown."""
    if status is None:
        return -1, 0
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), 0


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


_DEFAULT_SIGNALS = tuple(
    s
    for s in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGXFSZ)
    if s is not None
)


def _which(name: str, path: str) -> str:
    for d in path.split(":"):
        cand = os.path.join(d or ".", name)
        if os.access(cand, os.X_OK) and not os.path.isdir(cand):
            return cand
    raise FileNotFoundError(errno.ENOENT, "command not found", name)


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


def _entry(rid: int, path: str, name: str | None = None) -> p.Entry:
    st = os.lstat(path)
    if stat_mod.S_ISLNK(st.st_mode):
        kind, target = p.FileType.SYMLINK, os.readlink(path)
    elif stat_mod.S_ISDIR(st.st_mode):
        kind, target = p.FileType.DIR, ""
    elif stat_mod.S_ISREG(st.st_mode):
        kind, target = p.FileType.FILE, ""
    else:
        kind, target = p.FileType.OTHER, ""
    return p.Entry(
        rid,
        name=name if name is not None else os.path.basename(path) or "/",
        path=path,
        kind=kind,
        size=st.st_size,
        mode=stat_mod.S_IMODE(st.st_mode),
        mtime=st.st_mtime,
        target=target,
    )


_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY  # a FIFO cannot hold the open


def _not_regular(path: str) -> _Fail:
    return _Fail(p.ErrorCode.NOT_REGULAR, f"{path} is not a regular file (a FIFO, device or socket): not read")


def _read_file(agent: Agent, conn: Connection, msg: p.ReadFile) -> None:
    """Stream a regular file (see protocol.ReadFile): never more than max_bytes, at most ``window``
    bytes ahead of the host's acks; stops when the host cancels or goes away."""
    if msg.max_bytes < 0 or msg.window < 0:
        raise _Fail(p.ErrorCode.INVALID, "max_bytes and window must not be negative")
    inbox = conn.inbox(msg.id)
    st = os.stat(msg.path)  # no open at all (no device side effects) for what is refused anyway
    if not (stat_mod.S_ISREG(st.st_mode) or stat_mod.S_ISDIR(st.st_mode)):
        raise _not_regular(msg.path)
    try:
        fd = os.open(msg.path, _READ_FLAGS)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket swapped in since the stat
            raise _not_regular(msg.path) from None
        raise
    try:
        st = os.fstat(fd)  # what was opened decides: the path may have been swapped meanwhile
        if stat_mod.S_ISDIR(st.st_mode):
            raise _Fail(p.ErrorCode.IS_A_DIRECTORY, f"{msg.path} is a directory")
        if not stat_mod.S_ISREG(st.st_mode):
            raise _not_regular(msg.path)
        if st.st_size > msg.max_bytes:
            raise _Fail(
                p.ErrorCode.TOO_LARGE, f"{msg.path} is {st.st_size} bytes, more than max_bytes ({msg.max_bytes})"
            )
        os.set_blocking(fd, True)
        sent = acked = 0
        while True:
            while True:  # the host's acks and cancels; wait for acks while the window is full
                full = msg.window and sent - acked >= msg.window
                item = inbox.get() if full else inbox.poll()
                if item is Inbox.EMPTY:
                    break
                if item is None or isinstance(item, p.Cancel):
                    return  # the host went away or stopped the read: no answer
                if isinstance(item, p.ReadAck):
                    acked += item.bytes
            if conn.closed:
                return
            data = os.read(fd, min(p.CHUNK, msg.max_bytes - sent + 1))
            if not data:
                break
            if sent + len(data) > msg.max_bytes:
                raise _Fail(
                    p.ErrorCode.TOO_LARGE,
                    f"{msg.path} is longer than max_bytes ({msg.max_bytes}): "
                    "it grew while it was read, or its size was not known up front",
                )
            conn.send(p.Chunk(id=msg.id, data=data))
            sent += len(data)
    finally:
        os.close(fd)
    conn.send(p.ChunkEnd(id=msg.id))


def _write_file(agent: Agent, conn: Connection, msg: p.WriteFile) -> None:
    """Take an upload (see protocol.WriteFile): acks every quarter window; an atomic one goes to a
    temporary file beside the target, renamed over it at the end and removed on any failure."""
    if msg.window < 0 or (msg.atomic and msg.append):
        raise _Fail(p.ErrorCode.INVALID, "window must not be negative; an atomic write cannot append")
    inbox = conn.inbox(msg.id)
    parent = os.path.dirname(msg.path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    mode = msg.mode & 0o7777 or 0o644
    tmp = None
    if msg.atomic:
        try:
            if stat_mod.S_ISDIR(os.lstat(msg.path).st_mode):  # refused now, not after all the data came
                raise _Fail(p.ErrorCode.IS_A_DIRECTORY, f"{msg.path} is a directory")
        except FileNotFoundError:
            pass
        # beside the target (one filesystem: the rename is atomic); the name fits NAME_MAX
        tmp = os.path.join(parent, f".{os.path.basename(msg.path)[:200]}.wb-{os.urandom(6).hex()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    else:
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if msg.append else os.O_TRUNC)
        fd = os.open(msg.path, flags, mode)
    done = False
    try:
        if tmp is not None:
            os.fchmod(fd, mode)  # the umask does not apply: the file gets the mode asked for
        conn.send(p.Ok(id=msg.id))  # ready: the host may now stream chunks
        ack_every = max(1, msg.window // 4)
        unacked = 0
        while True:
            item = inbox.get()
            if item is None or isinstance(item, p.Cancel):
                return  # connection gone, or the host abandoned the upload: no answer
            if isinstance(item, p.ChunkEnd):
                break
            if not isinstance(item, p.Chunk):
                raise _Fail(p.ErrorCode.INVALID, f"write {msg.path}: expected file data, got {type(item).__name__}")
            view = memoryview(item.data)
            while view:
                view = view[os.write(fd, view) :]
            unacked += len(item.data)
            if msg.window and unacked >= ack_every:
                conn.send(p.WriteAck(id=msg.id, bytes=unacked))
                unacked = 0
        if tmp is not None:
            os.rename(tmp, msg.path)
        done = True
    finally:
        os.close(fd)
        if tmp is not None and not done:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    conn.send(_entry(msg.id, msg.path))


class _Abandoned(Exception):
    """The host cancelled a tar transfer or went away: the handler ends without an answer."""


class _TarOut:
    """The file object safetar.pack writes to: Chunk frames of up to CHUNK bytes, each sent once the
    host's window has room (its ReadAcks arrive in the request's inbox)."""

    def __init__(self, conn: Connection, rid: int, window: int) -> None:
        self.conn = conn
        self.id = rid
        self.window = window
        self.inbox = conn.inbox(rid)
        self.buf = bytearray()
        self.sent = self.acked = 0

    def write(self, data: bytes) -> int:
        self.buf += data
        while len(self.buf) >= p.CHUNK:
            self._send(bytes(self.buf[: p.CHUNK]))
            del self.buf[: p.CHUNK]
        return len(data)

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        if self.buf:
            self._send(bytes(self.buf))
            self.buf.clear()

    def _send(self, data: bytes) -> None:
        while True:
            full = self.window and self.sent - self.acked >= self.window
            item = self.inbox.get() if full else self.inbox.poll()
            if item is Inbox.EMPTY:
                break
            if item is None or isinstance(item, p.Cancel) or self.conn.closed:
                raise _Abandoned
            if isinstance(item, p.ReadAck):
                self.acked += item.bytes
        if self.conn.closed:
            raise _Abandoned
        self.conn.send(p.Chunk(id=self.id, data=data))
        self.sent += len(data)


class _TarIn:
    """The file object safetar.extract reads from: the host's Chunk frames, each acknowledged
    (WriteAck) once taken, so the host sends at most its window ahead."""

    def __init__(self, conn: Connection, rid: int, window: int) -> None:
        self.conn = conn
        self.id = rid
        self.window = window
        self.inbox = conn.inbox(rid)
        self.data = memoryview(b"")
        self.ended = False
        self.unacked = 0

    def read(self, n: int = -1) -> bytes:
        while not self.data and not self.ended:
            item = self.inbox.get()
            if item is None or isinstance(item, p.Cancel):
                raise _Abandoned
            if isinstance(item, p.ChunkEnd):
                self.ended = True
            elif isinstance(item, p.Chunk):
                self.data = memoryview(item.data)
                self.unacked += len(item.data)
                if self.window and self.unacked >= max(1, self.window // 4):
                    self.conn.send(p.WriteAck(id=self.id, bytes=self.unacked))
                    self.unacked = 0
            else:
                raise _Fail(p.ErrorCode.INVALID, f"tar upload: expected data, got {type(item).__name__}")
        n = len(self.data) if n < 0 else n
        out, self.data = bytes(self.data[:n]), self.data[n:]
        return out

    def drain(self) -> None:
        """Take the rest of the stream (tar's zero blocks, padding) up to its ChunkEnd."""
        while not self.ended:
            self.data = memoryview(b"")
            self.read(1 << 20)


def _tar_create(agent: Agent, conn: Connection, msg: p.TarCreate) -> None:
    from warmbox import safetar

    if msg.window < 0:
        raise _Fail(p.ErrorCode.INVALID, "window must not be negative")
    fd = os.open(msg.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root itself may be a link
    out = _TarOut(conn, msg.id, msg.window)
    try:
        safetar.pack(fd, out)  # type: ignore[arg-type]
        out.finish()
    except _Abandoned:
        return
    finally:
        os.close(fd)
    conn.send(p.ChunkEnd(id=msg.id))


def _tar_extract(agent: Agent, conn: Connection, msg: p.TarExtract) -> None:
    import tarfile

    from warmbox import safetar

    if msg.window < 0:
        raise _Fail(p.ErrorCode.INVALID, "window must not be negative")
    os.makedirs(msg.path, exist_ok=True)
    fd = os.open(msg.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    source = _TarIn(conn, msg.id, msg.window)
    try:
        conn.send(p.Ok(id=msg.id))  # ready: the host may now stream the archive
        safetar.extract(source, fd)  # type: ignore[arg-type]
        source.drain()
    except _Abandoned:
        return
    except safetar.UnsafeArchive as e:
        raise _Fail(p.ErrorCode.UNSAFE_ARCHIVE, str(e)) from None
    except tarfile.TarError as e:
        raise _Fail(p.ErrorCode.INVALID, f"not a tar archive ({e})") from None
    finally:
        os.close(fd)
    conn.send(_entry(msg.id, msg.path))


# inotify(7): the watched events, and what each becomes (fsnotify's mapping, as E2B reports them)
_IN_MODIFY, _IN_ATTRIB, _IN_MOVED_FROM, _IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
_IN_CREATE, _IN_DELETE, _IN_DELETE_SELF, _IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
_IN_Q_OVERFLOW, _IN_IGNORED, _IN_ISDIR = 0x4000, 0x8000, 0x40000000
_IN_ONLYDIR, _IN_DONT_FOLLOW = 0x1000000, 0x2000000
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_WATCH_MASK = (
    _IN_MODIFY | _IN_ATTRIB | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE | _IN_DELETE_SELF | _IN_MOVE_SELF
)
_MAX_WATCHES = 8192  # directories one recursive watch follows at most


class _Inotify:
    """inotify through libc (ctypes: the stdlib has no binding); watches by descriptor -> relative dir."""

    def __init__(self) -> None:
        import ctypes

        self._libc = ctypes.CDLL(None, use_errno=True)
        self._ctypes = ctypes
        self.fd = self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.dirs: dict[int, str] = {}

    def add(self, path: str, rel: str) -> None:
        if len(self.dirs) >= _MAX_WATCHES:
            return
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), _WATCH_MASK | _IN_ONLYDIR | _IN_DONT_FOLLOW)
        if wd < 0:
            err = self._ctypes.get_errno()
            if not rel:  # the root: its error is the answer
                raise OSError(err, os.strerror(err), path)
            return  # a subdirectory gone or unreadable meanwhile
        self.dirs[wd] = rel

    def add_tree(self, path: str, rel: str) -> None:
        """``path`` and every directory below it (links not followed)."""
        self.add(path, rel)
        for top, dirnames, _ in os.walk(path):
            for d in dirnames:
                full = os.path.join(top, d)
                if not os.path.islink(full):
                    sub = os.path.relpath(full, path)
                    self.add(full, os.path.join(rel, sub) if rel else sub)

    def events(self) -> list[tuple[int, int, str]]:
        """(wd, mask, name) of what is queued; [] if nothing."""
        try:
            buf = os.read(self.fd, 64 << 10)
        except BlockingIOError:
            return []
        out, off = [], 0
        while off + 16 <= len(buf):
            wd, mask, _cookie, size = struct.unpack_from("iIII", buf, off)
            name = buf[off + 16 : off + 16 + size].split(b"\0", 1)[0]
            out.append((wd, mask, os.fsdecode(name)))
            off += 16 + size
        return out

    def close(self) -> None:
        os.close(self.fd)


def _watch_dir(agent: Agent, conn: Connection, msg: p.WatchDir) -> None:
    """Report changes below a directory (see protocol.WatchDir) until the host cancels."""
    if msg.window < 1:
        raise _Fail(p.ErrorCode.INVALID, "window must be at least 1")
    inbox = conn.inbox(msg.id)
    st = os.stat(msg.path)
    if not stat_mod.S_ISDIR(st.st_mode):
        raise _Fail(p.ErrorCode.NOT_A_DIRECTORY, f"{msg.path} is not a directory")
    watch = _Inotify()
    try:
        if msg.recursive:
            watch.add_tree(msg.path, "")
        else:
            watch.add(msg.path, "")
        conn.send(p.Ok(id=msg.id))
        sent = acked = 0
        while True:
            while True:  # the host's acks and cancel; wait for acks while the window is full
                full = sent - acked >= msg.window
                item = inbox.get() if full else inbox.poll()
                if item is Inbox.EMPTY:
                    break
                if item is None or isinstance(item, p.Cancel):
                    return
                if isinstance(item, p.ReadAck):
                    acked += item.bytes
            if conn.closed:
                return
            ready, _, _ = select.select([watch.fd], [], [], 0.2)
            if not ready:
                continue
            for wd, mask, name in watch.events():
                if mask & _IN_Q_OVERFLOW:
                    continue
                base = watch.dirs.get(wd)
                if base is None:
                    continue
                if mask & _IN_IGNORED:
                    del watch.dirs[wd]
                    if base == "":  # the watched directory itself is gone
                        conn.send(p.ChunkEnd(id=msg.id))
                        return
                    continue
                if mask & (_IN_DELETE_SELF | _IN_MOVE_SELF):
                    if base == "":
                        conn.send(p.ChunkEnd(id=msg.id))
                        return
                    continue  # a subdirectory: its parent reports it
                rel = os.path.join(base, name) if base else name
                if mask & (_IN_CREATE | _IN_MOVED_TO):
                    kind = p.FsEventType.CREATE
                    if msg.recursive and mask & _IN_ISDIR:
                        watch.add_tree(os.path.join(msg.path, rel), rel)
                elif mask & _IN_DELETE:
                    kind = p.FsEventType.REMOVE
                elif mask & _IN_MOVED_FROM:
                    kind = p.FsEventType.RENAME
                elif mask & _IN_MODIFY:
                    kind = p.FsEventType.WRITE
                elif mask & _IN_ATTRIB:
                    kind = p.FsEventType.CHMOD
                else:
                    continue
                conn.send(p.FsEvent(id=msg.id, name=rel, kind=kind))
                sent += 1
    finally:
        watch.close()


def _rename(agent: Agent, conn: Connection, msg: p.Rename) -> None:
    os.lstat(msg.old)  # a missing source is NOT_FOUND naming it, before any directory is made
    parent = os.path.dirname(msg.new)
    if parent:
        os.makedirs(parent, exist_ok=True)
    os.rename(msg.old, msg.new)
    conn.send(_entry(msg.id, msg.new))


def _list_dir(agent: Agent, conn: Connection, msg: p.ListDir) -> None:
    if not os.path.isdir(msg.path):
        raise _Fail(
            p.ErrorCode.NOT_A_DIRECTORY if os.path.exists(msg.path) else p.ErrorCode.NOT_FOUND,
            f"{msg.path} is not a directory",
        )
    depth = max(1, min(msg.depth, 32))
    todo = [(msg.path, 1)]
    while todo:
        d, level = todo.pop(0)
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            path = os.path.join(d, name)
            try:
                entry = _entry(msg.id, path, name)
            except OSError:
                continue
            conn.send(entry)
            if entry.kind is p.FileType.DIR and level < depth:
                todo.append((path, level + 1))
    conn.send(p.Ok(id=msg.id))


def _stat(agent: Agent, conn: Connection, msg: p.Stat) -> None:
    conn.send(_entry(msg.id, msg.path))


def _make_dir(agent: Agent, conn: Connection, msg: p.MakeDir) -> None:
    if msg.parents:
        if os.path.isdir(msg.path):
            raise _Fail(p.ErrorCode.EXISTS, f"{msg.path} exists")
        os.makedirs(msg.path)
    else:
        os.mkdir(msg.path)
    conn.send(p.Ok(id=msg.id))


def _remove(agent: Agent, conn: Connection, msg: p.Remove) -> None:
    st = os.lstat(msg.path)
    if stat_mod.S_ISDIR(st.st_mode):
        if msg.recursive:
            import shutil  # only for this rare operation

            shutil.rmtree(msg.path)
        else:
            os.rmdir(msg.path)
    else:
        os.unlink(msg.path)
    conn.send(p.Ok(id=msg.id))


_PORT_CONNECT_S = 5.0  # a connect on the sandbox's own loopback answers at once; a full backlog may not


def _port_socket(port: int) -> socket.socket:
    """A connection to ``port`` on the sandbox's loopback: IPv4 first, then IPv6 (a server bound
    to ::1 only). Nothing but loopback is ever dialled: the tunnel cannot reach out of the sandbox."""
    refused: OSError | None = None
    for family, addr in ((socket.AF_INET, ("127.0.0.1", port)), (socket.AF_INET6, ("::1", port, 0, 0))):
        s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(_PORT_CONNECT_S)
        try:
            s.connect(addr)
        except OSError as e:
            s.close()
            if e.errno in (errno.ECONNREFUSED, errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.ENETUNREACH):
                refused = refused or e
                continue
            if isinstance(e, TimeoutError) or e.errno == errno.ETIMEDOUT:
                raise _Fail(
                    p.ErrorCode.CONNECTION_REFUSED, f"port {port}: no answer within {_PORT_CONNECT_S:g} s"
                ) from None
            raise
        s.settimeout(None)
        return s
    raise _Fail(p.ErrorCode.CONNECTION_REFUSED, f"nothing listens on port {port} in the sandbox ({refused})")


class _Tunnel:
    """The connection side of one PortConnect: a thread sends what the server writes (within the
    host's window); the request's worker writes the host's data into the connection."""

    def __init__(self, conn: Connection, msg: p.PortConnect, sock: socket.socket) -> None:
        self.conn = conn
        self.id = msg.id
        self.window = msg.window
        self.sock = sock
        self.cond = threading.Condition()
        self.sent = self.acked = 0
        self.stopped = False

    def ack(self, n: int) -> None:
        with self.cond:
            self.acked += n
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def pump(self) -> None:
        """Connection -> host until the server's end of data (ChunkEnd), or the tunnel stops."""
        while True:
            with self.cond:
                while not self.stopped and self.window and self.sent - self.acked >= self.window:
                    self.cond.wait()
                if self.stopped or self.conn.closed:
                    return
                room = self.window - (self.sent - self.acked) if self.window else p.CHUNK
            try:
                data = self.sock.recv(min(p.CHUNK, room))
            except OSError:
                data = b""  # a reset: the host sees the end of data
            with self.cond:
                if self.stopped:
                    return
                self.sent += len(data)
            if not data:
                self.conn.send(p.ChunkEnd(id=self.id))
                return
            self.conn.send(p.Chunk(id=self.id, data=data))


def _port_connect(agent: Agent, conn: Connection, msg: p.PortConnect) -> None:
    """Relay one TCP connection to the sandbox's loopback (see protocol.PortConnect)."""
    if not 0 < msg.port < 65536 or msg.window < 0:
        raise _Fail(p.ErrorCode.INVALID, f"port must be 1..65535 and window not negative, got {msg.port}")
    inbox = conn.inbox(msg.id)
    tunnel = _Tunnel(conn, msg, _port_socket(msg.port))
    with conn._inbox_lock:
        conn.tunnels[msg.id] = tunnel
    reader: threading.Thread | None = None
    try:
        conn.send(p.Ok(id=msg.id))
        reader = threading.Thread(target=tunnel.pump, name=f"port-{msg.id}", daemon=True)
        try:
            reader.start()
        except RuntimeError:  # the pids limit: no thread for the other direction
            reader = None
            raise _Fail(
                p.ErrorCode.EXEC_FAILED, "the sandbox's process limit is reached: no thread for the tunnel"
            ) from None
        while True:
            item = inbox.get()
            if item is None or isinstance(item, p.Cancel):
                return  # the host went away or ended the tunnel: no answer
            if isinstance(item, p.ReadAck):
                tunnel.ack(item.bytes)
            elif isinstance(item, p.Chunk):
                try:
                    tunnel.sock.sendall(item.data)
                except OSError as e:
                    raise _Fail(
                        p.ErrorCode.CONNECTION_REFUSED, f"port {msg.port}: the connection broke ({e})"
                    ) from None
                conn.send(p.PortAck(id=msg.id, bytes=len(item.data)))
            elif isinstance(item, p.ChunkEnd):
                try:
                    tunnel.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            else:
                raise _Fail(p.ErrorCode.INVALID, f"port tunnel: unexpected {type(item).__name__}")
    finally:
        with conn._inbox_lock:
            conn.tunnels.pop(msg.id, None)
        tunnel.stop()
        if reader is not None:
            reader.join()  # nothing is sent for this id after the handler's own last frame
        tunnel.sock.close()


# --------------------------------------------------------------------------- code contexts


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


def _quiesce(agent: Agent, conn: Connection, msg: p.Quiesce) -> None:
    if agent.serial is not None:  # a VM: its memory snapshot holds the port; nothing to drop
        conn.send(p.Ok(id=msg.id))
        return
    if agent.path is None:
        raise _Fail(p.ErrorCode.INVALID, "this agent listens on an inherited socket: nothing to quiesce")
    agent.quiesce(keep=conn)
    conn.send(p.Ok(id=msg.id))
    try:  # the host waits for this connection's end before its checkpoint
        conn.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _get_usage(agent: Agent, conn: Connection, msg: p.GetUsage) -> None:
    conn.send(agent.busy.report(msg.id))


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


# --------------------------------------------------------------------------- background processes

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


_HANDLERS: dict[type[p.Message], Any] = {
    p.Ping: _ping,
    p.Exec: _exec,
    p.Signal: _signal,
    p.ReadFile: _read_file,
    p.WriteFile: _write_file,
    p.Rename: _rename,
    p.TarCreate: _tar_create,
    p.TarExtract: _tar_extract,
    p.WatchDir: _watch_dir,
    p.ListDir: _list_dir,
    p.Stat: _stat,
    p.MakeDir: _make_dir,
    p.Remove: _remove,
    p.ContextCreate: _context_create,
    p.ContextRun: _context_run,
    p.ContextRunEnv: _context_run,
    p.ContextDelete: _context_delete,
    p.ContextList: _context_list,
    p.ContextRestart: _context_restart,
    p.Configure: _configure,
    p.GetUsage: _get_usage,
    p.Quiesce: _quiesce,
    p.Reseed: _reseed,
    p.PortConnect: _port_connect,
    p.Spawn: _spawn_bg,
    p.Attach: _attach,
    p.SpawnFollow: _spawn_follow,
    p.ProcInput: _proc_input,
    p.ProcResize: _proc_resize,
    p.ProcList: _proc_list,
}
# requests whose inbox exists before their worker starts: their data, acks or Cancel may come first
_PREPARED = (p.ReadFile, p.PortConnect, p.WriteFile, p.Attach, p.SpawnFollow, p.TarCreate, p.TarExtract, p.WatchDir)
_INLINE = frozenset({p.Ping, p.GetUsage, p.Signal})  # never block: handled on the reader thread


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


# --------------------------------------------------------------------------- agent


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
