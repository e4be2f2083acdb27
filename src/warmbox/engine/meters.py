"""Meters: memory and cpu readings of live sandboxes, and what a sandbox has cost so far."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from warmbox.engine.session import GuestSession
from warmbox.errors import WarmboxError
from warmbox.lifecycle import Operation
from warmbox.models import BackendHandle, SandboxInfo, SandboxMetrics, State

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine


async def sample(engine: Engine) -> None:
    """One memory/cpu reading of every live sandbox, folded into its meter (the daemon's job)."""
    readings = []
    for info, handle in engine.registry.sandboxes.list(include_pooled=True, local=True):
        if info.state is State.CREATING:
            continue
        try:
            u = await engine.backend(info.tier).usage(handle)
        except (WarmboxError, OSError):
            continue
        readings.append((info.sandbox_id, u.memory_bytes, u.cpu_ns))
    if readings:
        engine.registry.usage.sample(readings)


async def metrics(engine: Engine, sandbox_id: str, session: GuestSession | None = None) -> SandboxMetrics:
    """The user's cost of a sandbox so far (or final, once it ended)."""
    info, handle = engine.info(sandbox_id)
    if info.state not in (State.DESTROYED, State.PAUSED):  # a paused one's stand still: as recorded
        engine.check(Operation.METRICS, info, handle)
        await read(engine, info, handle, session)
    return recorded(engine, info)


def metered(engine: Engine, sandbox_id: str) -> SandboxMetrics:
    """The cost of a sandbox as its meters last recorded it (no reading of the sandbox)."""
    return recorded(engine, engine.info(sandbox_id)[0])


async def read(engine: Engine, info: SandboxInfo, handle: BackendHandle, session: GuestSession | None) -> None:
    """Read a sandbox's meters now (its usage, and the guest's busy counters while it runs) into
    the registry; a reading that fails leaves the last one standing. session: the caller's (kept
    open), else one of its own for the guest's counters."""
    try:
        u = await engine.backend(info.tier).usage(handle)
        engine.registry.usage.sample([(info.sandbox_id, u.memory_bytes, u.cpu_ns)])
    except (WarmboxError, OSError):
        pass
    if info.state not in (State.READY, State.RUNNING):
        return
    own = session is None
    try:
        if session is None:
            session = await asyncio.wait_for(GuestSession.connect(handle.socket_path, info.sandbox_id), 1)
        r = await asyncio.wait_for(session.usage(), 2)
        if r is not None:
            engine.registry.usage.set_busy(info.sandbox_id, *r)
    except (TimeoutError, WarmboxError, OSError):
        pass  # the last known counters stand
    finally:
        if own and session is not None:
            await session.close()


def recorded(engine: Engine, info: SandboxInfo) -> SandboxMetrics:
    """The user's cost of a sandbox in any state as last recorded, without reading it."""
    m = engine.registry.usage.meter(info.sandbox_id)
    start = info.claimed_at or info.created_at
    end = engine.registry.usage.ended_at(info.sandbox_id) or time.time()
    wall = max(0.0, end - start)
    # the commands recorded (what commands() lists), not the agent's count: that one is the
    # guest's word, counts a pool's warm-up, and starts again at 0 in a resumed runtime
    commands = engine.registry.commands.command_count(info.sandbox_id)
    if m is None:
        dead = info.state is State.DESTROYED
        return SandboxMetrics(info.sandbox_id, 0.0, 0.0, wall, 0.0, wall, 0, 0, commands, dead)
    busy = min(wall, m.busy_ms / 1e3)
    return SandboxMetrics(
        sandbox_id=info.sandbox_id,
        cpu_s=max(0, m.cpu_ns - m.base_cpu_ns) / 1e9,
        memory_gib_s=max(0.0, m.gib_s - m.base_gib_s),
        wall_s=wall,
        busy_s=busy,
        idle_s=wall - busy,
        memory_bytes=m.memory_bytes,
        memory_peak_bytes=m.peak_bytes,
        commands=commands,
        final=m.final,
    )
