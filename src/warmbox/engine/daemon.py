"""The per-home daemon: reaps expired sandboxes, keeps the warm pools filled, samples meters.

One per WARMBOX_HOME (it holds ``daemon.lock`` and writes its pid to ``daemon.pid``); any
warmbox process starts it on demand (``Engine.ensure_daemon``). It exits once no sandbox is
live, no pool wants one, and that lasted ``[daemon] idle_exit`` seconds. SIGTERM (``warmbox
down``) stops refills, destroys pooled sandboxes and exits; callers' sandboxes stay (they have
their own timeouts; the next daemon reaps them). A daemon killed with SIGKILL loses nothing: the
next one adopts the pooled sandboxes and destroys creations whose creator died.

Who restarts a killed daemon: its guard (engine/guard.py, stdlib only). ``warmbox down`` stops
the guard first, then the daemon.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import sys
import time
from pathlib import Path

from warmbox.engine import duties, egress, meters
from warmbox.engine.engine import Engine
from warmbox.engine.guard import GuardKeeper, guard_pid_of, pid_of, take_lock, write_pid
from warmbox.engine.pool import PoolManager
from warmbox.errors import WarmboxError
from warmbox.network import netns
from warmbox.paths import default_home

TICK_S = 0.25  # while pools are active
POLL_S = 1.0
SAMPLE_S = 1.0


async def run(home: Path) -> None:
    lock = home / "daemon.lock"
    try:
        fd = take_lock(lock)
    except OSError:
        return  # the home is gone
    if fd is None:
        return
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)  # before anyone can find the pid file
    loop.add_signal_handler(signal.SIGINT, stop.set)
    write_pid(home / "daemon.pid", os.getpid())
    keeper = GuardKeeper(home)
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
                    await meters.sample(engine)
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
                    if duties.next_expiry(engine) is None and not _pools_want(engine):
                        on_purpose = True
                        try:
                            await asyncio.to_thread(engine.stop_shared_hosts)
                        except Exception as e:
                            print(
                                f"warmbox daemon: stopping hosts: {type(e).__name__}: {e}", file=sys.stderr, flush=True
                            )
                        return
                    fd = take_lock(lock)
                    if fd is None:
                        on_purpose = True
                        return  # another daemon took over
                    write_pid(home / "daemon.pid", os.getpid())
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
            write_pid(home / "daemon.stopped", os.getpid())
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
                await meters.sample(engine)
            except Exception as e:
                print(f"warmbox node: sampling: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        delay = TICK_S if wanted else POLL_S
        if nxt is not None:
            delay = min(delay, max(nxt - now, 0.02))
        await _sleep(stop, delay)


def hold_lock(home: Path) -> int | None:
    """Take ``home``'s daemon lock for this process (:func:`tend`); None: a daemon holds it."""
    return take_lock(home / "daemon.lock")


async def _iteration(engine, pools, last_complaint: str):
    """Reap, then tend the pools. Returns (settings or a new complaint, pools want work, next expiry)."""
    complaint = None
    try:
        settings = engine.settings()
    except WarmboxError as e:  # a broken config must not stop reaping
        settings = None
        if str(e) != last_complaint:
            print(f"warmbox daemon: {e}", file=sys.stderr, flush=True)
            complaint = str(e)
    await duties.reap(engine)
    wanted = await pools.tick(settings) if settings is not None else pools.busy
    return (complaint if complaint is not None else settings), wanted, duties.next_expiry(engine)


def _pools_want(engine) -> bool:
    try:
        settings = engine.settings()
    except Exception:
        return False
    rows = engine.registry.pools.pool_rows()
    return any((rows[n].target if n in rows else pc.target) > 0 for n, pc in settings.pools.items())


async def _sleep(stop: asyncio.Event, delay: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), delay)
    except TimeoutError:
        pass


def main() -> None:
    args = sys.argv[1:]
    asyncio.run(run(Path(args[0]) if args else default_home()))


if __name__ == "__main__":
    main()


async def stop_guard(home: Path) -> None:
    """SIGTERM ``home``'s daemon guard and wait (at most 10 s) until it is gone."""
    pid = guard_pid_of(home)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while guard_pid_of(home) == pid and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def down_home(home: Path | str | None) -> tuple[int | None, list[str]]:
    """Stop ``home``'s daemon (it destroys its pooled sandboxes), then clean what a killed one
    left: creations whose creator died and pooled sandboxes. Returns (daemon pid, claimed ids left)."""
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
    await duties.reap(engine)
    await PoolManager(engine).drain()
    if not engine.registry.egress.live_links():  # no sandbox needs egress: the proxy and its netns go
        await egress.stop_proxy(engine.home)
        if egress.proxy_pid(engine.home) is None:
            await netns.remove_egress(netns.egress_name(engine.runtime))
    await asyncio.to_thread(engine.stop_shared_hosts)  # e.g. the isolate tier's host, once its sandboxes are gone
    return pid, [i.sandbox_id for i in engine.list()]
