"""The per-home daemon: reaps expired sandboxes, keeps the warm pools filled, samples meters.

One per WARMBOX_HOME (it holds ``daemon.lock`` and writes its pid to ``daemon.pid``); any
warmbox process starts it on demand (``Engine.ensure_daemon``). It exits once no sandbox is
live, no pool wants one, and that lasted ``[daemon] idle_exit`` seconds. SIGTERM (``warmbox
down``) stops refills, destroys pooled sandboxes and exits; callers' sandboxes stay (they have
their own timeouts; the next daemon reaps them). A daemon killed with SIGKILL loses nothing: the
next one adopts the pooled sandboxes and destroys creations whose creator died.

Who restarts a killed daemon: its guard. Every daemon runs beside a guard (``daemon.py --guard``,
a stdlib-only process of a few MiB holding ``guard.lock``, pid in ``guard.pid``): the guard waits
on the daemon's pidfd and, when the daemon ends without having said it leaves on purpose
(``daemon.stopped`` names the pid of the last daemon that left on purpose: idle, SIGTERM, another
daemon took over), starts a new one. The daemon in turn starts a new guard when its guard is gone
(checked every tick). ``Engine.ensure_daemon`` starts the guard first and the guard the daemon, so
from the first ``ensure_daemon`` of a create on, one SIGKILL of either process at any moment is
repaired: a sandbox outlives its timeout by at most RESPAWN_MIN_S + a daemon start + one destroy
(measured on a 2-core host: 0.2 s after a kill seconds before the deadline, 0.6 s after one just
before it; tests/attacks/test_daemon_death.py holds it to 15 s). A daemon that keeps dying young
is restarted with a doubling delay (at most RESPAWN_MAX_S), and given up after GIVE_UP_AFTER such
deaths in a row. Killing the daemon and its guard together leaves the timeouts to the next
create, connect or set_timeout on this home (each ensures the daemon) or ``warmbox ls`` (reaps).
``warmbox down`` stops the guard first, then the daemon.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

TICK_S = 0.25  # while pools are active
POLL_S = 1.0
SAMPLE_S = 1.0
GUARD_WATCH_S = 5.0  # the guard re-reads daemon.pid this often (a death wakes it at once)
RESPAWN_MIN_S = 0.2  # a killed daemon is restarted this long after its death...
RESPAWN_MAX_S = 30.0  # ...doubling up to this while daemons keep dying young
STABLE_S = 10.0  # a daemon that lived this long died "old": the delay starts over
GIVE_UP_AFTER = 10  # young deaths in a row after which the guard stops restarting
GUARD_SPAWN_EVERY_S = 1.0  # a daemon starts at most one guard a second


def _lock(path: Path) -> int | None:
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


def _write_pid(path: Path, pid: int) -> None:
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
    fd = _lock(home / "daemon.lock")
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
        fd = _lock(home / "guard.lock")
    except OSError:
        return  # the home is gone
    if fd is None:
        if daemon is None:  # a guard runs, but it may be leaving with its daemon: start one anyway
            _spawn_daemon(home)  # (it takes the daemon lock or, finding it held, ends at once)
        return
    _write_pid(home / "guard.pid", os.getpid())
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


class _GuardKeeper:
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


async def run(home: Path) -> None:
    import asyncio

    from warmbox.engine.engine import Engine
    from warmbox.engine.pool import PoolManager

    lock = home / "daemon.lock"
    try:
        fd = _lock(lock)
    except OSError:
        return  # the home is gone
    if fd is None:
        return
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)  # before anyone can find the pid file
    loop.add_signal_handler(signal.SIGINT, stop.set)
    _write_pid(home / "daemon.pid", os.getpid())
    keeper = _GuardKeeper(home)
    keeper.ensure()
    on_purpose = False  # only a daemon that leaves on purpose says so; any other end is restarted
    try:
        engine = Engine(home)
        pools = PoolManager(engine)
        idle_since: float | None = None
        last_sample = 0.0
        last_complaint = ""
        settings = None
        while not stop.is_set():
            keeper.ensure()
            try:
                settings, wanted, nxt = await _iteration(engine, pools, last_complaint)
            except Exception as e:  # a transient registry/IO error must not end the daemon
                print(f"warmbox daemon: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                await _sleep(stop, 1.0)
                continue
            if isinstance(settings, str):
                last_complaint, settings = settings, None
            now = time.time()
            if now - last_sample >= SAMPLE_S:
                last_sample = now
                try:
                    await engine.sample()
                except Exception as e:
                    print(f"warmbox daemon: sampling: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if nxt is None and not wanted:
                idle_since = idle_since or now
                limit = settings.daemon_idle_exit_s if settings is not None else 10.0
                if now - idle_since >= limit:
                    # Unlock, then look once more: a creator (or a resize) that found the lock
                    # held has already registered its work, so it is visible here; later ones
                    # find the lock free and start a daemon themselves.
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
                    fd = None
                    if engine.next_expiry() is None and not _pools_want(engine):
                        on_purpose = True
                        try:
                            await asyncio.to_thread(engine.stop_shared_hosts)
                        except Exception as e:
                            print(
                                f"warmbox daemon: stopping hosts: {type(e).__name__}: {e}", file=sys.stderr, flush=True
                            )
                        return
                    fd = _lock(lock)
                    if fd is None:
                        on_purpose = True
                        return  # another daemon took over
                    _write_pid(home / "daemon.pid", os.getpid())
                    idle_since = None
            else:
                idle_since = None
            delay = TICK_S if wanted else POLL_S
            if nxt is not None:
                delay = min(delay, max(nxt - now, 0.02))
            await _sleep(stop, delay)
        await pools.drain()
    finally:
        if on_purpose or stop.is_set():  # the guard reads it once this process has ended
            _write_pid(home / "daemon.stopped", os.getpid())
        keeper.close()
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


async def tend(engine, pools, stop: asyncio.Event) -> None:
    """The daemon's duties (reap, pools, meters) in the calling process until ``stop`` is set: a
    cluster node runs them beside its API, for as long as it runs (no idle exit, no guard: a node
    killed takes them with it, and its sandboxes are then the cluster's to mark lost). The
    caller holds ``daemon.lock`` (:func:`hold_lock`), so no standalone daemon starts meanwhile,
    and drains the pools itself when it stops."""
    last_sample = 0.0
    last_complaint = ""
    while not stop.is_set():
        try:
            settings, wanted, nxt = await _iteration(engine, pools, last_complaint)
        except Exception as e:  # a transient registry/IO error must not end the duties
            print(f"warmbox node: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            await _sleep(stop, 1.0)
            continue
        if isinstance(settings, str):
            last_complaint = settings
        now = time.time()
        if now - last_sample >= SAMPLE_S:
            last_sample = now
            try:
                await engine.sample()
            except Exception as e:
                print(f"warmbox node: sampling: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        delay = TICK_S if wanted else POLL_S
        if nxt is not None:
            delay = min(delay, max(nxt - now, 0.02))
        await _sleep(stop, delay)


def hold_lock(home: Path) -> int | None:
    """Take ``home``'s daemon lock for this process (:func:`tend`); None: a daemon holds it."""
    return _lock(home / "daemon.lock")


async def _iteration(engine, pools, last_complaint: str):
    """Reap, then tend the pools. Returns (settings or a new complaint, pools want work, next expiry)."""
    from warmbox.errors import WarmboxError

    complaint = None
    try:
        settings = engine.settings()
    except WarmboxError as e:  # a broken config must not stop reaping
        settings = None
        if str(e) != last_complaint:
            print(f"warmbox daemon: {e}", file=sys.stderr, flush=True)
            complaint = str(e)
    await engine.reap()
    wanted = await pools.tick(settings) if settings is not None else pools.busy
    return (complaint if complaint is not None else settings), wanted, engine.next_expiry()


def _pools_want(engine) -> bool:
    try:
        settings = engine.settings()
    except Exception:
        return False
    rows = engine.registry.pools.pool_rows()
    return any((rows[n].target if n in rows else pc.target) > 0 for n, pc in settings.pools.items())


async def _sleep(stop: asyncio.Event, delay: float) -> None:
    import asyncio

    try:
        await asyncio.wait_for(stop.wait(), delay)
    except TimeoutError:
        pass


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--guard"]:  # run as a script by spawn_guard: stdlib only
        if args[2:] == ["--start"]:
            guard(Path(args[1]), None)
        elif len(args) == 4 and args[2] == "--daemon" and args[3].isdigit():
            guard(Path(args[1]), int(args[3]))
        else:
            sys.exit("usage: daemon.py --guard HOME (--start | --daemon PID)")
        return
    home = Path(args[0]) if args else None
    if home is None:
        from warmbox.paths import default_home

        home = default_home()
    import asyncio  # not at the top: the guard runs this file and needs none of it

    asyncio.run(run(home))


if __name__ == "__main__":
    main()


# ---- stopping a home (``warmbox down``, the benchmarks and the tests' homes)


async def stop_guard(home: Path) -> None:
    """SIGTERM ``home``'s daemon guard and wait (at most 10 s) until it is gone."""
    import asyncio

    guard = guard_pid_of(home)
    if guard is None:
        return
    try:
        os.kill(guard, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while guard_pid_of(home) == guard and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def down_home(home: Path | str | None) -> tuple[int | None, list[str]]:
    """Stop ``home``'s daemon (it destroys its pooled sandboxes), then clean what a killed one
    left: creations whose creator died and pooled sandboxes. Returns (daemon pid, claimed ids left)."""
    import asyncio

    from warmbox.engine.engine import Engine
    from warmbox.engine.pool import PoolManager
    from warmbox.errors import WarmboxError

    engine = Engine.for_home(home)
    # its guard first (it would start a new daemon after the one stopped here only if that one
    # died unasked, but it may be starting one right now, after a crash: it stops that one too)
    await stop_guard(engine.home)
    pid = pid_of(engine.home)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pid = None
        # it destroys its pooled sandboxes first: allow ~1 s each, at least two minutes
        limit = max(120.0, 1.0 * len(engine.list(include_pooled=True)))
        deadline = time.monotonic() + limit
        while pid is not None and pid_of(engine.home) == pid and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await stop_guard(engine.home)  # one the daemon started again just before it was told to stop
        if pid is not None and pid_of(engine.home) == pid:
            raise WarmboxError(f"the daemon (pid {pid}) did not stop within {limit:.0f} s")
    await engine.reap()
    await PoolManager(engine).drain()
    if not engine.registry.egress.live_links():  # no sandbox needs egress: the proxy and its netns go
        from warmbox.engine import egress
        from warmbox.network import netns

        await egress.stop_proxy(engine.home)
        if egress.proxy_pid(engine.home) is None:
            await netns.remove_egress(netns.egress_name(engine.runtime))
    await asyncio.to_thread(engine.stop_shared_hosts)  # e.g. the isolate tier's host, once its sandboxes are gone
    return pid, [i.sandbox_id for i in engine.list()]
