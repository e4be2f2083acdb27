"""The daemon's guard: a stdlib-only process that restarts a home's daemon when it dies unasked.

Every daemon runs beside a guard (``guard.py --guard``, a process of a few MiB holding
``guard.lock``, pid in ``guard.pid``): the guard waits on the daemon's pidfd and, when the daemon
ends without having said it leaves on purpose (``daemon.stopped`` names the pid of the last daemon
that left on purpose: idle, SIGTERM, another daemon took over), starts a new one. The daemon in
turn starts a new guard when its guard is gone (checked every tick: :class:`GuardKeeper`).
``Engine.ensure_daemon`` (:func:`ensure`) starts the guard first and the guard the daemon, so
from the first ``ensure_daemon`` of a create on, one SIGKILL of either process at any moment is
repaired: a sandbox outlives its timeout by at most RESPAWN_MIN_S + a daemon start + one destroy
(measured on a 2-core host: 0.2 s after a kill seconds before the deadline, 0.6 s after one just
before it; tests/attacks/test_daemon_death.py holds it to 15 s). A daemon that keeps dying young
is restarted with a doubling delay (at most RESPAWN_MAX_S), and given up after GIVE_UP_AFTER such
deaths in a row. Killing the daemon and its guard together leaves the timeouts to the next
create, connect or set_timeout on this home (each ensures the daemon) or ``warmbox ls`` (reaps).

This file runs as a script, ``python -I -S guard.py --guard HOME``: it imports the standard
library only (tests/test_layers.py holds it to that), so a guard is up in milliseconds.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import sys
import time
from pathlib import Path

GUARD_WATCH_S = 5.0  # the guard re-reads daemon.pid this often (a death wakes it at once)
RESPAWN_MIN_S = 0.2  # a killed daemon is restarted this long after its death...
RESPAWN_MAX_S = 30.0  # ...doubling up to this while daemons keep dying young
STABLE_S = 10.0  # a daemon that lived this long died "old": the delay starts over
GIVE_UP_AFTER = 10  # young deaths in a row after which the guard stops restarting
GUARD_SPAWN_EVERY_S = 1.0  # a daemon starts at most one guard a second


def take_lock(path: Path) -> int | None:
    """An exclusive flock on ``path`` (made if missing): its fd, or None while another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _read_pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 else None


def write_pid(path: Path, pid: int) -> None:
    """Atomically (a reader never sees it half-written); a home removed meanwhile is no error."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(str(pid))
        os.rename(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def _cmdline(pid: int) -> list[bytes] | None:
    """argv of a running (not zombie) process, or None."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    if stat[stat.rindex(b")") + 2 :][:1] in (b"Z", b"X"):
        return None
    return cmd


def _is_daemon(pid: int, home: Path) -> bool:
    """``pid`` runs (not a zombie) and is a daemon of ``home`` (pids are reused)."""
    cmd = _cmdline(pid)
    return cmd is not None and b"warmbox.engine.daemon" in cmd and str(home).encode() in cmd


def pid_of(home: Path) -> int | None:
    """The running daemon's pid for ``home``, or None. Never touches the lock (a probe that took
    it, even briefly, could make a daemon re-locking after its idle check think it lost)."""
    pid = _read_pid(home / "daemon.pid")
    return pid if pid is not None and _is_daemon(pid, home) else None


def guard_pid_of(home: Path) -> int | None:
    """The running guard's pid for ``home``, or None."""
    pid = _read_pid(home / "guard.pid")
    cmd = _cmdline(pid) if pid is not None else None
    if cmd is not None and b"--guard" in cmd and str(home).encode() in cmd:
        return pid
    return None


def _spawn(home: Path, argv: list[str]) -> int:
    """Start ``argv`` in its own session: stdin/stdout /dev/null, stderr appended to daemon.log.
    posix_spawn: safe from the daemon's threads, and the guard needs no subprocess module."""
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        log = os.open(home / "daemon.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError:
        log = os.dup(null)
    try:
        return os.posix_spawn(
            argv[0],
            argv,
            dict(os.environ),
            setsid=True,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, null, 0),
                (os.POSIX_SPAWN_DUP2, null, 1),
                (os.POSIX_SPAWN_DUP2, log, 2),
            ],
        )
    finally:
        os.close(null)
        os.close(log)


def _spawn_daemon(home: Path) -> int:
    return _spawn(home, [sys.executable, "-m", "warmbox.engine.daemon", str(home)])


def spawn_guard(home: Path, *, daemon: int | None = None) -> int:
    """Start a guard for ``home``: of the running ``daemon`` (its pid), else it starts the daemon
    first. It imports nothing but the standard library (-I -S: no site, no script dir), so it is
    up in milliseconds."""
    argv = [sys.executable, "-I", "-S", str(Path(__file__).resolve()), "--guard", str(home)]
    return _spawn(home, argv + (["--daemon", str(daemon)] if daemon is not None else ["--start"]))


_started: list[int] = []  # guards this process started (each forks and ends at once: reaped here)


def ensure(home: Path) -> None:
    """Start ``home``'s daemon (through its guard) unless one holds the lock."""
    for pid in list(_started):
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                _started.remove(pid)
        except ChildProcessError:
            _started.remove(pid)
    fd = take_lock(home / "daemon.lock")
    if fd is None:
        return  # a daemon holds it (and keeps a guard)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    _started.append(spawn_guard(home))


def _reap_children() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _say(msg: str) -> None:
    print(f"warmbox guard: {msg}", file=sys.stderr, flush=True)


def guard(home: Path, daemon: int | None) -> None:
    """The guard's life: watch this home's daemon, restart it when it dies without meaning to.
    SIGTERM ends it, and a daemon it is still starting (``warmbox down`` stops the guard first)."""
    if os.fork():
        os._exit(0)  # the guard is no child of whoever started it (an SDK process reaps this one)
    try:
        fd = take_lock(home / "guard.lock")
    except OSError:
        return  # the home is gone
    if fd is None:
        if daemon is None:  # a guard runs, but it may be leaving with its daemon: start one anyway
            _spawn_daemon(home)  # (it takes the daemon lock or, finding it held, ends at once)
        return
    write_pid(home / "guard.pid", os.getpid())
    g = _Guard(home)

    def leave(*_):
        if g.starting is not None and pid_of(home) != g.starting:
            try:
                os.kill(g.starting, signal.SIGTERM)
            except OSError:
                pass
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    try:
        g.watch(daemon)
    finally:
        if _read_pid(home / "guard.pid") == os.getpid():
            try:
                (home / "guard.pid").unlink()
            except OSError:
                pass
        os.close(fd)


def _ended(pidfd: int, wait: float = 0.0) -> bool:
    return bool(select.select([pidfd], [], [], wait)[0])


class _Guard:
    """Follows the daemon through a pidfd: its end wakes the guard at once, and a pidfd cannot
    name a reused pid."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.watched: int | None = None
        self.pidfd: int | None = None
        self.since = time.monotonic()
        self.starting: int | None = None  # a daemon this guard started that has no pid file yet

    def follow(self, pid: int) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
        self.watched, self.pidfd, self.since = pid, None, time.monotonic()
        try:
            self.pidfd = os.pidfd_open(pid)
        except OSError:
            pass  # already gone

    def start_daemon(self) -> None:
        self.starting = _spawn_daemon(self.home)
        self.follow(self.starting)

    def watch(self, daemon: int | None) -> None:
        home = self.home
        delay = RESPAWN_MIN_S
        young = 0
        if daemon is None:
            self.start_daemon()
        elif _is_daemon(daemon, home):
            self.follow(daemon)
        else:  # it died while this guard started: restarted below unless it left on purpose
            self.watched = daemon
        try:
            while True:
                if not home.is_dir():
                    return
                live = pid_of(home)
                if live is not None and live != self.watched:
                    self.follow(live)  # another daemon took over
                if live is not None and live == self.starting:
                    self.starting = None  # it is up
                if self.pidfd is not None and not _ended(self.pidfd):
                    # it runs; one just started has no pid file yet: look again soon
                    _ended(self.pidfd, GUARD_WATCH_S if live == self.watched else 0.05)
                    _reap_children()
                    continue
                _reap_children()
                self.starting = None
                if pid_of(home) is not None:
                    continue
                if self.watched is None or _read_pid(home / "daemon.stopped") == self.watched:
                    return  # no daemon, or it left on purpose: nothing to guard
                if time.monotonic() - self.since >= STABLE_S:
                    delay, young = RESPAWN_MIN_S, 0
                else:
                    young += 1
                    if young > GIVE_UP_AFTER:
                        _say(
                            f"{young - 1} daemons in a row died within {STABLE_S:.0f} s; not starting "
                            "another (the next warmbox operation on this home starts one)"
                        )
                        return
                _say(
                    f"the daemon (pid {self.watched}) ended without leaving on purpose; starting a new one "
                    f"in {delay:.1f} s"
                )
                time.sleep(delay)
                delay = min(delay * 2, RESPAWN_MAX_S)
                _reap_children()
                if pid_of(home) is not None or not home.is_dir():
                    continue  # someone started one meanwhile
                self.start_daemon()
        finally:
            if self.pidfd is not None:
                os.close(self.pidfd)


class GuardKeeper:
    """The daemon's side: a guard runs as long as the daemon does (checked every tick, cheaply:
    a poll of the guard's pidfd)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.pidfd: int | None = None
        self.child: int | None = None
        self.spawned_at = -GUARD_SPAWN_EVERY_S

    def ensure(self) -> None:
        if self.child is not None:  # reap the guard we started, once it ends (only that pid: the
            try:  # event loop's child watcher owns the others)
                if os.waitpid(self.child, os.WNOHANG)[0]:
                    self.child = None
            except ChildProcessError:
                self.child = None
        if self.pidfd is not None:
            if not select.select([self.pidfd], [], [], 0)[0]:
                return  # it runs
            os.close(self.pidfd)
            self.pidfd = None
        pid = guard_pid_of(self.home)
        if pid is not None:
            try:
                self.pidfd = os.pidfd_open(pid)
                return
            except OSError:
                pass
        if time.monotonic() - self.spawned_at < GUARD_SPAWN_EVERY_S:
            return  # the one just started is still taking its lock
        self.spawned_at = time.monotonic()
        try:
            self.child = spawn_guard(self.home, daemon=os.getpid())
        except OSError as e:
            print(f"warmbox daemon: cannot start its guard: {e}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--guard"] and args[2:] == ["--start"]:
        guard(Path(args[1]), None)
    elif args[:1] == ["--guard"] and len(args) == 4 and args[2] == "--daemon" and args[3].isdigit():
        guard(Path(args[1]), int(args[3]))
    else:
        sys.exit("usage: guard.py --guard HOME (--start | --daemon PID)")


if __name__ == "__main__":
    main()
