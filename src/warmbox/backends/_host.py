"""Host confinement shared by the tiers, written once: cgroups, spawning, process waits, the agent wait."""

from __future__ import annotations

import asyncio
import fcntl
import functools
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from warmbox.errors import GuestConnectionError, SandboxError, SandboxStartError, SandboxTimeout

if TYPE_CHECKING:
    from warmbox.models import Limits

T = TypeVar("T")

GUEST_UID = 1000  # the sandbox user inside every tier (host uid: the sandbox's uid_base + this)
GUEST_GID = 1000
# /etc/gitconfig of every tier's image: `git commit` works out of the box (no identity to set)
GITCONFIG = """[user]
	name = warmbox sandbox
	email = sandbox@warmbox.invalid
[init]
	defaultBranch = main
[safe]
	directory = *
"""
# the egress resolver's address as the sandbox sees it (its resolv.conf): the same value as
# warmbox.network.netns.GATEWAY, which backends may not import (a test pins the two together)
EGRESS_GATEWAY = "10.239.0.1"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# A SIGKILLed process is gone within milliseconds; one still running after this (seconds, wall clock)
# is stuck in the kernel, and its sandbox's teardown fails typed (the engine retries it later).
KILL_TIMEOUT_S = 5.0
# ... and one not gone after this long gets a second SIGKILL, through the freezer (one forked as the
# first kill ran, where neither cgroup.kill nor a freezer took it; one outside the unified subtree).
KILL_AGAIN_S = 0.5


# --------------------------------------------------------------------------- cgroups


def host_pids() -> int:
    """How many tasks the host can hold: min(kernel.pid_max, kernel.threads-max)."""
    out = []
    for name in ("pid_max", "threads-max"):
        try:
            out.append(int(Path("/proc/sys/kernel", name).read_text()))
        except (OSError, ValueError):
            out.append(32768)
    return min(out)


@functools.lru_cache(maxsize=1)
def cgroup_v2() -> bool:
    """The host mounts only the unified hierarchy. Read on every command's OOM check: the layout
    never changes while warmbox runs."""
    return (CGROUP_ROOT / "cgroup.controllers").exists()


@functools.lru_cache(maxsize=1)
def unified_root() -> Path | None:
    """The host's cgroup v2 hierarchy: /sys/fs/cgroup, or /sys/fs/cgroup/unified in the hybrid
    layout (no controllers there, but cgroup.kill works); None on a pure v1 host."""
    if cgroup_v2():
        return CGROUP_ROOT
    hybrid = CGROUP_ROOT / "unified"
    return hybrid if (hybrid / "cgroup.procs").exists() else None


def parse_oom_kills(data: bytes) -> int:
    """The ``oom_kill`` line of memory.events (v2) or memory.oom_control (v1); 0 without one."""
    if data.startswith(b"oom_kill "):
        start = 9
    else:
        i = data.find(b"\noom_kill ")
        if i < 0:
            return 0
        start = i + 10
    j = data.find(b"\n", start)
    try:
        return int(data[start : j if j >= 0 else None])
    except ValueError:
        return 0


def read_oom_kills(path: str) -> int:
    """``parse_oom_kills`` of the file at ``path``, 0 when it is gone. One open/read/close: it is
    read around every command."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError:
        return 0
    return parse_oom_kills(data)


def _stat_value(path: Path, key: str) -> int:
    """The value of ``key`` in a flat-keyed cgroup file (memory.stat, cpu.stat); ValueError without it."""
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    raise ValueError(f"no {key} in {path}")


class SandboxCgroup:
    """One sandbox's host cgroups: ``/sys/fs/cgroup/warmbox/<sandbox id>`` with cgroup v2, else that
    path under each v1 hierarchy (``/sys/fs/cgroup/memory/warmbox/<sandbox id>`` ...). runc and
    runsc make it from the OCI config's ``cgroupsPath`` (``path``); the microVM tier makes it
    itself (``create``). Every read tolerates a cgroup that is already gone."""

    CONTROLLERS = ("memory", "cpu", "cpuacct", "pids")  # what warmbox bounds and meters

    def __init__(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id
        self.root = CGROUP_ROOT
        self.v2 = cgroup_v2()
        self.unified = unified_root()
        self.rel = Path("warmbox") / sandbox_id

    @property
    def path(self) -> str:
        """The cgroup as an OCI ``linux.cgroupsPath``."""
        return f"/{self.rel}"

    def file(self, controller: str, name: str) -> Path:
        """``name`` in the directory of ``controller``'s hierarchy (the one directory with v2)."""
        return self.root / self.rel / name if self.v2 else self.root / controller / self.rel / name

    def dirs(self) -> list[Path]:
        """The directories of the controllers warmbox bounds (memory, cpu, pids), one per hierarchy."""
        if self.v2:
            return [self.root / self.rel]
        seen, out = set(), []
        for c in self.CONTROLLERS:
            real = (self.root / c).resolve()
            if real not in seen:  # cpu and cpuacct may be one hierarchy ("cpu,cpuacct")
                seen.add(real)
                out.append(self.root / c / self.rel)
        return out

    def every_dir(self) -> list[Path]:
        """Its directory in every mounted hierarchy (runc makes one in each, and the agent's
        per-command cgroups live in the unified one): what a teardown removes and a leak check reads."""
        if self.v2:
            return [self.root / self.rel]
        return [d / self.rel for d in self.root.iterdir() if d.is_dir() and not d.is_symlink()]

    def create(self, memory_mb: int, cpus: float, pids: int) -> list[str]:
        """Make the cgroup with these bounds (memory without swap, a CPU quota, a pids bound);
        returns the ``cgroup.procs`` files a process writes itself into (``spawn``'s cgroup_procs)."""
        try:
            if self.v2:  # controllers enabled top-down, as runc does
                parent = self.root / "warmbox"
                parent.mkdir(exist_ok=True)
                for d in (self.root, parent):
                    (d / "cgroup.subtree_control").write_text("+memory +cpu +pids")
            for d in self.dirs():
                d.mkdir(parents=True, exist_ok=True)
            quota = max(1000, int(cpus * 100_000))
            if self.v2:
                self.file("", "memory.max").write_text(str(memory_mb << 20))
                if self.file("", "memory.swap.max").exists():  # absent without swap accounting
                    self.file("", "memory.swap.max").write_text("0")
                self.file("", "cpu.max").write_text(f"{quota} 100000")
                self.file("", "pids.max").write_text(str(pids))
            else:
                self.file("memory", "memory.limit_in_bytes").write_text(str(memory_mb << 20))
                self.file("cpu", "cpu.cfs_period_us").write_text("100000")
                self.file("cpu", "cpu.cfs_quota_us").write_text(str(quota))
                self.file("pids", "pids.max").write_text(str(pids))
        except OSError as e:
            self.remove()
            raise SandboxStartError(
                f"cannot set up the host cgroup {self.rel}: {e.strerror or e}", self.sandbox_id
            ) from None
        return [str(d / "cgroup.procs") for d in self.dirs()]

    def add_memory(self, extra_mb: int) -> None:
        """Raise the memory bound by ``extra_mb`` (best effort)."""
        f = self.file("", "memory.max") if self.v2 else self.file("memory", "memory.limit_in_bytes")
        try:
            f.write_text(str(int(f.read_text()) + (extra_mb << 20)))
        except (OSError, ValueError):
            pass

    def delegate(self, uid: int, gid: int) -> int | None:
        """Its directory in the unified hierarchy, made now and given to ``uid``:``gid``, opened
        (O_DIRECTORY, close-on-exec) for the guest agent to put each command in a child cgroup;
        None on a host without cgroup v2."""
        if self.unified is None:
            return None
        d = self.unified / self.rel
        try:
            d.mkdir(parents=True, exist_ok=True)
            for target in (d, d / "cgroup.procs"):  # procs: moving a process needs the common ancestor's
                os.chown(target, uid, gid)
            return os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise SandboxStartError(
                f"cannot delegate the sandbox's cgroup {d}: {e.strerror or e}", self.sandbox_id
            ) from None

    def procs(self) -> list[int]:
        """The pids in its pids-controller cgroup ([] once it is gone)."""
        try:
            return [int(x) for x in self.file("pids", "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def members(self) -> set[int]:
        """Every process inside: those of the directories warmbox bounds and of its unified-hierarchy
        subtree, children included (the agent's per-command cgroups are there). A process that has
        exited is listed by none (a zombie leaves its cgroups as it exits)."""
        dirs = self.dirs()
        if self.unified is not None:
            top = self.unified / self.rel
            dirs += [Path(parent) for parent, _, _ in os.walk(top)] if top.is_dir() else []
        found: set[int] = set()
        for d in dict.fromkeys(dirs):
            try:
                found.update(int(x) for x in (d / "cgroup.procs").read_bytes().split())
            except (OSError, ValueError):
                pass
        return found

    def oom_file(self) -> Path:
        return self.file("", "memory.events") if self.v2 else self.file("memory", "memory.oom_control")

    def oom_kills(self) -> int:
        return read_oom_kills(str(self.oom_file()))

    def memory_bytes(self) -> int:
        """Memory charged to it (page cache and tmpfs included). Raises OSError/ValueError."""
        f = self.file("", "memory.current") if self.v2 else self.file("memory", "memory.usage_in_bytes")
        return int(f.read_text())

    def anon_bytes(self) -> int:
        """Anonymous memory of its processes. Raises OSError/ValueError."""
        if self.v2:
            return _stat_value(self.file("", "memory.stat"), "anon")
        return _stat_value(self.file("memory", "memory.stat"), "rss")

    def cpu_ns(self) -> int:
        """CPU time of its processes. Raises OSError/ValueError."""
        if self.v2:
            return _stat_value(self.file("", "cpu.stat"), "usage_usec") * 1000
        return int(self.file("cpuacct", "cpuacct.usage").read_text())

    def kill(self) -> bool:
        """SIGKILL every process of its unified-hierarchy subtree in one write (``cgroup.kill``, Linux
        >= 5.14): the kernel takes the processes forked meanwhile too. False when that subtree holds
        none (runc puts a container there, runsc on a hybrid host does not) or has no cgroup.kill:
        then ``kill_all``."""
        if self.unified is None:
            return False
        d = self.unified / self.rel
        try:
            with open(d / "cgroup.events", "rb") as f:
                if b"populated 1" not in f.read(256):
                    return False
            fd = os.open(d / "cgroup.kill", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, b"1")
            finally:
                os.close(fd)
        except OSError:
            return False
        return True

    async def kill_and_wait(self, timeout: float = KILL_TIMEOUT_S) -> None:
        """Kill every process inside and wait until each has exited (a zombie has: it holds no memory,
        CPU, file or mount), on pidfds in the event loop, without polling. Processes that outlive the
        first kill by KILL_AGAIN_S get a second one (``kill_all``); SandboxTimeout naming them if one
        still runs after ``timeout`` seconds (wall clock)."""
        deadline = time.monotonic() + timeout
        again = time.monotonic() + KILL_AGAIN_S
        if not self.kill():
            self.kill_all()
        while pids := [pid for pid in self.members() if running(pid)]:
            now = time.monotonic()
            if now >= deadline:
                raise SandboxTimeout(
                    f"processes {sorted(pids)[:8]} of the sandbox did not exit within {timeout:g} s of SIGKILL",
                    self.sandbox_id,
                )
            if await wait_exited(pids, min(again, deadline) - now) and time.monotonic() >= again:
                self.kill_all()
                again = deadline

    def kill_all(self, also: Iterable[int] = ()) -> None:
        """SIGKILL every process inside (and ``also``), frozen first where a v1 freezer cgroup
        exists, so nothing forks meanwhile."""
        pids = set(also) | self.members()
        if not pids:
            return
        freezer = None if self.v2 else self.file("freezer", "freezer.state")
        try:
            if freezer is not None and freezer.exists():
                freezer.write_text("FROZEN")
            else:
                freezer = None
        except OSError:
            freezer = None
        for pid in pids | self.members():  # read again once frozen: what forked meanwhile
            kill(pid)
        try:
            if freezer is not None:
                freezer.write_text("THAWED")  # SIGKILL is delivered on thaw
        except OSError:
            pass

    def _rmdir_all(self) -> list[tuple[Path, OSError]]:
        busy = []
        for d in self.every_dir():
            # child cgroups (the agent's per-command ones) first, deepest first: a cgroup with
            # children stays. Another process may be removing the same tree: what vanishes is fine.
            for parent, children, _ in os.walk(d, topdown=False):
                for name in children:
                    try:
                        os.rmdir(os.path.join(parent, name))
                    except OSError:
                        pass
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                busy.append((d, e))
        return busy

    def try_remove(self) -> bool:
        """One pass of ``remove`` that never waits: True when nothing of it is left."""
        return not self._rmdir_all()

    def remove(self, timeout: float = 5.0) -> None:
        """Kill what is left inside, then remove its directory in every hierarchy. The kernel may
        lag a moment after the last process exits, so a busy one is retried for ``timeout``
        seconds; then SandboxError (the engine retries the teardown later)."""
        self.kill_all()
        deadline = time.monotonic() + timeout
        attempt = 0
        while busy := self._rmdir_all():
            if time.monotonic() > deadline:
                d, e = busy[0]
                raise SandboxError(f"the host cgroup {d} stays busy: {e.strerror or e}", self.sandbox_id)
            attempt += 1
            if attempt % 50 == 0:
                self.kill_all()
            time.sleep(0.01)


# --------------------------------------------------------------------------- processes


def running(pid: int) -> bool:
    """The process exists and is not a zombie. A sandbox's init is reparented to the host's init
    when its runtime exits, and on some hosts that reaps only every second or two: a zombie holds
    no memory, CPU or open files, so it keeps no teardown waiting."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] not in (b"Z", b"X")


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal ``pid``; one that is gone already is no error."""
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def failure_excerpt(text: str, limit: int = 1200, tail_chars: int = 300) -> str:
    """A bounded, one-line excerpt of a runtime's failure output for an error message.

    A Go panic's cause is at its head (the ``panic:`` / ``fatal error:`` line and the first
    goroutine's frames), not at the end, where only the RPC server's frames are: keep the text
    from that line (or from the start) and the last ``tail_chars``. A Go value dumped in the
    message (``encoding error at object tcp.endpoint{...}: <cause>``, kilobytes) is cut to its
    head so that the cause after it stays in. Control characters are replaced (the output can
    hold text the guest influenced)."""
    clean = "".join(c if c.isprintable() or c == "\n" else " " if c == "\t" else "?" for c in text)
    lines = [_cut_values(ln.strip()) for ln in clean.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if "panic:" in ln or ln.startswith("fatal error:")), 0)
    head = " | ".join(lines[start:])
    if len(head) <= limit:
        return head or "(no output)"
    rest = " | ".join(lines)
    return head[: limit - tail_chars - 5] + " ... " + rest[-tail_chars:]


def _cut_values(line: str, keep: int = 120) -> str:
    """``line`` with each outermost ``{...}`` longer than ``keep`` cut to its first ``keep``
    characters and ``...}``; braces inside quotes count too (a cut only shortens)."""
    out: list[str] = []
    depth = 0
    kept = 0
    for c in line:
        if depth == 0:
            out.append(c)
            if c == "{":
                depth, kept = 1, 0
            continue
        depth += (c == "{") - (c == "}")
        if depth == 0:
            out.append("...}" if kept > keep else "}")
        elif kept < keep:
            out.append(c)
        kept += 1
    return "".join(out)


def tail(path: Path, limit: int = 600) -> str:
    """The last lines of a log, on one line, for an error message."""
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return "(no log)"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-4:])[-limit:] or "(empty log)"


def spawn(
    argv: list[str], log: Path, fds: Sequence[int] = (), *, detach: bool = False, cgroup_procs: Sequence[str] = ()
) -> int:
    """Start ``argv`` with stdin from /dev/null, stdout and stderr appended to ``log`` and ``fds``
    (open in this process) as its fds 3, 4, ...; returns its pid.

    Not detached: posix_spawn, a child of this process (``wait_exit`` reaps it). Detached: its
    own session, reaped by init (a double fork), inside the cgroups whose ``cgroup.procs`` files
    are given, joined before exec so that every page it touches is charged there.
    """
    if cgroup_procs and not detach:
        raise ValueError("only a detached process joins cgroups before exec")
    opened: list[int] = []
    try:
        # copies at high numbers: dup2(n, n) onto its own number would keep CLOEXEC
        for fd in fds:
            opened.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 32))
        high = opened[:]
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        opened.append(null)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        opened.append(out)
        if not detach:
            actions = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, out, 1), (os.POSIX_SPAWN_DUP2, out, 2)]
            actions += [(os.POSIX_SPAWN_DUP2, fd, 3 + n) for n, fd in enumerate(high)]
            exe = argv[0] if os.path.isabs(argv[0]) else shutil.which(argv[0]) or argv[0]
            return os.posix_spawn(exe, argv, dict(os.environ), file_actions=actions)
        return _spawn_detached(argv, null, out, high, cgroup_procs)
    finally:
        for fd in opened:
            os.close(fd)


def _spawn_detached(argv: list[str], null: int, out: int, fds: list[int], cgroup_procs: Sequence[str]) -> int:
    r, w = os.pipe()
    try:
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            try:
                os.setsid()
                grandchild = os.fork()
                if grandchild:
                    os.write(w, str(grandchild).encode())
                    os._exit(0)
                os.dup2(null, 0)
                os.dup2(out, 1)
                os.dup2(out, 2)
                for procs in cgroup_procs:  # before exec: every page the program touches is charged there
                    try:
                        fd = os.open(procs, os.O_WRONLY)
                        os.write(fd, str(os.getpid()).encode())
                        os.close(fd)
                    except OSError as e:
                        os.write(2, f"warmbox: cannot join the cgroup {procs}: {e}\n".encode())
                        os._exit(126)
                for n, fd in enumerate(fds):
                    os.dup2(fd, 3 + n)  # dup2 clears CLOEXEC on the copy
                os.closerange(3 + len(fds), 1 << 16)
                os.execvp(argv[0], argv)
            finally:
                os._exit(127)
        os.close(w)
        w = -1
        os.waitpid(child, 0)
        pid = int(os.read(r, 32) or b"0")
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
    if pid <= 0:
        raise SandboxStartError(f"could not start {argv[0]}")
    return pid


async def wait_exit(pid: int) -> int:
    """Wait for our child ``pid`` to exit (a pidfd in the event loop, no thread) and reap it;
    returns its exit code (-N for a signal)."""
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: None if done.done() else done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    _, status = os.waitpid(pid, 0)  # noqa: ASYNC222 - it has exited: this returns at once
    return os.waitstatus_to_exitcode(status)


async def wait_exited(pids: Iterable[int], timeout: float, poll: float = 0.005) -> list[int]:
    """Wait (``timeout``: seconds, wall clock) until none of ``pids`` (children or not) is
    ``running``; returns those still running at the deadline. Each exit is an event: a pidfd
    turns readable in the event loop when its process has exited, zombie or reaped (once open, it
    names that process, not its number). Only a process without a pidfd (a thread id, a kernel
    before 5.3) is polled, every ``poll`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    fds: dict[int, int] = {}
    polled: list[int] = []
    pending: set[int] = set()
    try:
        for pid in dict.fromkeys(pids):
            try:
                fds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            except OSError:
                polled.append(pid)
        if fds:
            # those already gone answer a zero-timeout poll: no event loop round for them
            ready = select.poll()
            for fd in fds.values():
                ready.register(fd, select.POLLIN)
            gone = {fd for fd, _ in ready.poll(0)}
            pending = {pid for pid, fd in fds.items() if fd not in gone}
            if pending:
                done = loop.create_future()

                def exited(pid: int) -> None:
                    loop.remove_reader(fds[pid])
                    pending.discard(pid)
                    if not pending and not done.done():
                        done.set_result(None)

                for pid in pending:
                    loop.add_reader(fds[pid], exited, pid)
                try:
                    await asyncio.wait_for(done, timeout)
                except TimeoutError:
                    pass
                finally:
                    for pid in pending:
                        loop.remove_reader(fds[pid])
        polled = [pid for pid in polled if running(pid)]
        while polled and time.monotonic() < deadline:  # without a pidfd there is no event to wait for
            await asyncio.sleep(poll)
            polled = [pid for pid in polled if running(pid)]
    finally:
        for fd in fds.values():
            os.close(fd)
    return sorted(pending) + polled


async def wait_gone(pid: int, timeout: float, poll: float = 0.005) -> bool:
    """Wait (``timeout``: seconds, wall clock) until ``pid``, not our child, is no longer ``running``
    (``wait_exited``: an event, polled only without a pidfd)."""
    return not await wait_exited([pid], timeout, poll)


async def wait_for_agent(
    ready: Callable[[], Awaitable[T]],
    listening: Callable[[], bool],
    stopped: Callable[[], Awaitable[bool]],
    why: Callable[[], str],
    *,
    where: str,
    sandbox_id: str,
    timeout: float,
    poll: float = 0.005,
    check_every: int = 1,
) -> T:
    """For a tier whose guest agent binds its socket itself: wait until ``listening()``, then
    ``ready()`` (connect + ping) until it connects. The socket exists from bind() but accepts
    only after listen(), so a refused connection is retried (50 times).

    stopped: the sandbox died (asked every ``check_every`` polls, and every 0.25 s while ready()
    runs); why: what its logs say; where: the sandbox's kind, for messages ("gVisor");
    timeout: seconds, wall clock, from this call. Each failure is a SandboxStartError.
    """
    deadline = time.monotonic() + timeout
    polls = 0
    while not listening():
        polls += 1
        if time.monotonic() > deadline or (polls % check_every == 0 and await stopped()):
            raise SandboxStartError(f"the guest agent did not come up in {where}: {why()}", sandbox_id)
        await asyncio.sleep(poll)
    for attempt in range(50):
        task = asyncio.ensure_future(ready())
        try:
            while not task.done():
                await asyncio.wait([task], timeout=0.25)
                if task.done():
                    break
                if await stopped():
                    raise SandboxStartError(f"{where} stopped during start: {why()}", sandbox_id)
                if time.monotonic() > deadline:
                    raise SandboxStartError(
                        f"the guest agent did not answer within {timeout:.0f} s: {why()}", sandbox_id
                    )
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        try:
            return task.result()
        except GuestConnectionError:
            if attempt == 49 or await stopped():
                raise SandboxStartError(f"the guest agent did not come up in {where}: {why()}", sandbox_id) from None
            await asyncio.sleep(0.02)
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- what tiers share inside


def tmpfs_sizes(lim: Limits, shm_mb: int | None = None) -> tuple[int, int]:
    """(size of /tmp and of /home/user, size of /dev/shm) in MiB.

    tmpfs pages are charged to the sandbox's memory limit, so full tmpfs mounts must leave room
    for the processes: together they get at most memory_mb minus a quarter of it (≥ 96 MiB,
    for the guest agent, the code contexts and gVisor's own kernel). A writer that fills
    them gets ENOSPC; without this, filling /tmp and /home/user OOM-killed the guest agent.
    """
    shm = max(1, min(64, lim.memory_mb // 8)) if shm_mb is None else shm_mb
    budget = lim.memory_mb - max(96, lim.memory_mb // 4) - shm
    return max(1, min(lim.tmp_mb, budget // 2)), shm


def build_spawn_helpers(sources: Path, out: Path) -> None:
    """The guest agent's spawn.so and wb-init (guest/spawn.c, guest/init.c: how a command gets its
    own cgroup or PID namespace) from ``sources`` into ``out``, with the host's gcc (every tier's
    guest has Debian's glibc, as the host)."""
    for cmd in (
        ["-shared", "-fPIC", "-o", str(out / "spawn.so"), str(sources / "spawn.c")],
        ["-static", "-s", "-o", str(out / "wb-init"), str(sources / "init.c")],
    ):
        r = subprocess.run(
            ["gcc", "-O2", "-Wall", "-Werror", *cmd], capture_output=True, text=True, timeout=120, check=False
        )
        if r.returncode != 0:
            raise SandboxStartError(
                f"building the guest agent's spawn helpers failed (gcc, libc6-dev): {r.stderr.strip()[-300:]}"
            )


async def communicate(proc: asyncio.subprocess.Process, timeout: float) -> bytes | None:
    """``proc``'s stderr once it has exited, or None after ``timeout`` seconds (wall clock: then it
    is killed and reaped)."""
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None
    return err or b""
