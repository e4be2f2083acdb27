"""Background reaper: destroys sandboxes whose timeout expired, whether or not anyone is connected.

One per WARMBOX_HOME (it holds ``reaper.lock``); started on demand by the engine and gone once
no live sandbox is left for IDLE_EXIT_S.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
import time
from pathlib import Path

POLL_S = 1.0
IDLE_EXIT_S = 10.0


def _lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


async def run(home: Path) -> None:
    from warmbox.engine.engine import Engine

    lock = home / "reaper.lock"
    fd = _lock(lock)
    if fd is None:
        return
    engine = Engine(home)
    idle_since: float | None = None
    while True:
        await engine.reap()
        nxt = engine.next_expiry()
        now = time.time()
        if nxt is None:
            idle_since = idle_since or now
            if now - idle_since >= IDLE_EXIT_S:
                # Unlock, then look once more: a creator that found the lock held has already
                # registered its sandbox, so it is visible here; otherwise it takes the lock itself.
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                if engine.next_expiry() is None:
                    return
                fd = _lock(lock)
                if fd is None:
                    return
            await asyncio.sleep(POLL_S)
            continue
        idle_since = None
        await asyncio.sleep(min(max(nxt - now, 0.02), POLL_S))


def main() -> None:
    home = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if home is None:
        from warmbox.engine.engine import default_home

        home = default_home()
    asyncio.run(run(home))


if __name__ == "__main__":
    main()
