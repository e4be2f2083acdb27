"""How the agent starts processes so that a kill ends all they started (cgroup, PID namespace or tree)."""

from __future__ import annotations

import _signal as signal  # type: ignore[import-not-found]  # no stub: a C module, the wrapper's core
import _socket as socket
import collections
import errno
import os
import select
import sys
import threading
import time

from warmbox import protocol as p
from warmbox.guest.base import _Fail
from warmbox.guest.reaper import _proc_table, kill_tree

TYPE_CHECKING = False  # not typing's: the guest imports nothing it does not use at run time
if TYPE_CHECKING:
    from typing import Any

    from warmbox.guest.agent import Agent


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


_DEFAULT_SIGNALS = tuple(
    s
    for s in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGXFSZ)
    if s is not None
)


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


def _which(name: str, path: str) -> str:
    for d in path.split(":"):
        cand = os.path.join(d or ".", name)
        if os.access(cand, os.X_OK) and not os.path.isdir(cand):
            return cand
    raise FileNotFoundError(errno.ENOENT, "command not found", name)


def _exit_status(status: int | None) -> tuple[int, int]:
    """(exit code, signal) of a wait status: 128+N and N if signal N ended it; (-1, 0) if unknown."""
    if status is None:
        return -1, 0
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), 0
