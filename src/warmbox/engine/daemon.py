"""The per-home daemon: reaps expired sandboxes, keeps the warm pools filled, samples meters.

One per WARMBOX_HOME (it holds ``daemon.lock`` and writes its pid to ``daemon.pid``); any
warmbox process starts it on demand (``Engine.ensure_daemon``). It exits once no sandbox is
live, no pool wants one, and that lasted ``[daemon] idle_exit`` seconds. SIGTERM (``warmbox
down``) stops refills, destroys pooled sandboxes and exits; callers' sandboxes stay (they have
their own timeouts; the next daemon reaps them). A daemon killed with SIGKILL loses nothing: the
next one adopts the pooled sandboxes and destroys creations whose creator died.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import sys
import time
from pathlib import Path

TICK_S = 0.25  # while pools are active
POLL_S = 1.0
SAMPLE_S = 1.0


def _lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def pid_of(home: Path) -> int | None:
    """The running daemon's pid for ``home``, or None. Never touches the lock (a probe that took
    it, even briefly, could make a daemon re-locking after its idle check think it lost)."""
    try:
        pid = int((home / "daemon.pid").read_text().strip())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (OSError, ValueError):
        return None
    if stat[stat.rindex(b")") + 2:][:1] in (b"Z", b"X"):
        return None
    if b"warmbox.engine.daemon" in cmd and str(home).encode() in cmd:
        return pid
    return None


async def run(home: Path) -> None:
    from warmbox.engine.engine import Engine
    from warmbox.engine.pool import PoolManager
    from warmbox.errors import WarmboxError

    lock = home / "daemon.lock"
    fd = _lock(lock)
    if fd is None:
        return
    (home / "daemon.pid").write_text(str(os.getpid()))
    engine = Engine(home)
    pools = PoolManager(engine)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    idle_since: float | None = None
    last_sample = 0.0
    last_complaint = ""
    settings = None
    try:
        while not stop.is_set():
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
                        return
                    fd = _lock(lock)
                    if fd is None:
                        return  # another daemon took over
                    (home / "daemon.pid").write_text(str(os.getpid()))
                    idle_since = None
            else:
                idle_since = None
            delay = TICK_S if wanted else POLL_S
            if nxt is not None:
                delay = min(delay, max(nxt - now, 0.02))
            await _sleep(stop, delay)
        await pools.drain()
    finally:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


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
    rows = engine.registry.pool_rows()
    return any((rows[n].target if n in rows else pc.target) > 0 for n, pc in settings.pools.items())


async def _sleep(stop: asyncio.Event, delay: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), delay)
    except asyncio.TimeoutError:
        pass


def main() -> None:
    home = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if home is None:
        from warmbox.engine.engine import default_home

        home = default_home()
    asyncio.run(run(home))


if __name__ == "__main__":
    main()
