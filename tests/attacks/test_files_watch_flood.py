"""files.watch_dir under an event flood: a sandbox user making files as fast as it can while the
host's callback is slow cannot grow the host's memory (events wait in the sandbox, and its kernel
drops the excess), and the watch still stops at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.attacks.test_files_read import PeakGrowth
from warmbox import AsyncSandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(240)]

FILES = 300_000
BOUND = 24 << 20  # an unbounded host queue would hold FILES events: well over 100 MB


def test_an_event_flood_with_a_slow_callback_keeps_host_memory_small(home, runc_ready):
    """The callback is a coroutine function that sleeps: the event loop stays free to read the
    agent's connection meanwhile, so only the watch's own window keeps events in the sandbox (a
    callback blocking the loop would throttle the socket instead, which proves nothing)."""

    async def go() -> tuple[int, float, int, int]:
        sb = await AsyncSandbox.create(tier="container", timeout=300, home=home)
        try:
            await sb.files.make_dir("flood")
            taken: list[str] = []

            async def slow(event) -> None:
                taken.append(event.name)
                await asyncio.sleep(0.002)

            with PeakGrowth() as growth:
                handle = await sb.files.watch_dir("flood", slow)
                r = await sb.commands.run(
                    f"python3 -c \"[open(f'/workspace/flood/{{i}}', 'w').close() for i in range({FILES})]\"",
                    timeout=180,
                )
                assert r.exit_code == 0, r.stderr
                await asyncio.sleep(1)  # the callback keeps taking events meanwhile
                t0 = time.monotonic()
                await handle.stop()
                stop_s = time.monotonic() - t0
                n = len(taken)
                await asyncio.sleep(0.5)
            return growth.growth, stop_s, n, len(taken)
        finally:
            await sb.kill()

    grew, stop_s, n, later = asyncio.run(go())
    assert grew < BOUND, f"host memory grew {grew >> 20} MiB"
    assert stop_s < 2
    assert 0 < n < FILES  # the slow callback saw a part; the rest waited in the sandbox or was dropped
    assert later == n  # nothing is delivered after stop()
