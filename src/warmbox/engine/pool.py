"""Warm pools: keep N ready sandboxes per (tier, template, limits) shape, refilled in the background.

Who does what:
- A caller's ``provision.create`` claims a pooled sandbox in one registry transaction (so two
  callers never get the same one), reconfigures it for the caller (env, counters) and uses it.
  The claimed sandbox is the caller's until destroyed; it never returns to a pool.
- The daemon (engine/daemon.py) runs a :class:`PoolManager`: each tick it compares every pool's
  ready + warming count with its target and starts refills (at most ``refill_concurrency`` at
  once per pool), or retires surplus sandboxes. A sandbox becomes ``pooled`` only after its
  guest answered and its template's warm-up succeeded; a failed warm-up is recorded on the pool
  (``last_error``, a ``warmup_failed`` event), the sandbox destroyed, and retried with backoff.

Autoscaling between the pool's min and max:
- every miss (a matching create that found the pool empty) raises the target by one;
- after ``idle_shrink`` seconds without any request the target halves (not below min).
``warmbox pool resize NAME N`` sets the target by hand and holds it: the registry keeps it, and
idle shrinking stops at N (N becomes the pool's min unless ``--min`` says how far it may shrink).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

from warmbox.config import PoolConfig, Settings
from warmbox.engine import provision, resolve, teardown
from warmbox.errors import InvalidArgument, WarmboxError
from warmbox.models import PoolStatus
from warmbox.storage.registry import PoolRow, Registry

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine

BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
DESTROY_CONCURRENCY = 4


def bounds(pc: PoolConfig, min_override: int | None, max_override: int | None) -> tuple[int, int]:
    lo = pc.min if min_override is None else min_override
    hi = pc.max if max_override is None else max_override
    return lo, max(lo, hi)


def status(engine: Engine, settings: Settings) -> list[PoolStatus]:
    rows = engine.registry.pools.pool_rows()
    out = []
    for pc in settings.pools.values():
        row = rows.get(pc.name)
        lo, hi = bounds(pc, row.min_override if row else None, row.max_override if row else None)
        try:
            ready, warming = engine.registry.pools.pool_counts(pc.name, resolve.pool_shape(engine, pc, build=False))
        except WarmboxError:  # its image is not built (yet) or gone: nothing of it is ready
            ready, warming = 0, engine.registry.pools.pool_counts(pc.name)[1]
        hits, misses, failures, cpu_s, gib_s, wall_s = engine.registry.pools.pool_totals(pc.name)
        out.append(
            PoolStatus(
                name=pc.name,
                tier=pc.tier,
                template=pc.template,
                min=lo,
                max=hi,
                target=row.target if row else pc.target,
                ready=ready,
                warming=warming,
                hits=hits,
                misses=misses,
                warmup_failures=failures,
                last_error=row.last_error if row else "",
                cost_cpu_s=cpu_s,
                cost_memory_gib_s=gib_s,
                cost_wall_s=wall_s,
            )
        )
    return out


def configured_row(reg: Registry, pc: PoolConfig, row: PoolRow | None) -> PoolRow:
    """The pool's row, made for a new pool or reset when its configured target changed."""
    if row is None or row.config_target != pc.target:
        reg.pools.ensure_pool(pc.name, pc.target)
        row = reg.pools.pool_rows()[pc.name]
    return row


def resize(
    engine: Engine,
    settings: Settings,
    name: str,
    target: int | None = None,
    min: int | None = None,
    max: int | None = None,
) -> PoolStatus:
    """Set a pool's target (clamped to its bounds) and/or its min/max; the daemon acts on it."""
    pc = settings.pools.get(name)
    if pc is None:
        raise InvalidArgument(f"no pool {name!r} (pools: {', '.join(sorted(settings.pools)) or 'none'})")
    for label, v in (("target", target), ("min", min), ("max", max)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1000):
            raise InvalidArgument(f"{label} must be an integer in [0, 1000], got {v!r}")
    # the row records the configured target first: else the daemon's next tick would take this
    # resize for a changed configuration and put the target back to the configured one
    row = configured_row(engine.registry, pc, engine.registry.pools.pool_rows().get(name))
    new_max = max if max is not None else (row.max_override if row else None)
    eff_max = pc.max if new_max is None else new_max
    if target is not None and min is None:
        # an explicit target holds (issue 38): idle shrinking stops at it (never below the
        # configured min; at most max); ``--min M`` with it lets the pool shrink down to M
        min = sorted((pc.min, target, eff_max))[1]
    new_min = min if min is not None else (row.min_override if row else None)
    eff_min = pc.min if new_min is None else new_min
    if eff_max < eff_min:
        raise InvalidArgument(f"max ({eff_max}) is below min ({eff_min})")
    lo, hi = bounds(pc, new_min, new_max)
    current = row.target if row else pc.target
    new = target if target is not None else current
    new = sorted((lo, new, hi))[1]
    engine.registry.pools.set_pool(
        name,
        target=new,
        min_override=min if min is not None else False,
        max_override=max if max is not None else False,
        kind="resized",
        detail=f"target={new} min={lo} max={hi}",
        demand=True,  # an idle period counts from the operator's word, not from the last create
    )
    engine.ensure_daemon()
    return next(s for s in status(engine, settings) if s.name == name)


class PoolShare(Protocol):
    """How a cluster node takes part in pools shared by every node of the registry (a pool's
    target is cluster-wide there): the daemon of a node keeps only its share ready."""

    def share(self, pool: PoolConfig, target: int) -> int:
        """This node's part of the cluster-wide ``target`` of ``pool`` (0 while it is not up)."""
        ...


class PoolManager:
    """The daemon's half of the pools: refill, retire, autoscale. One per daemon. split: on a
    cluster node, its share of each pool (None: one host, the whole target)."""

    def __init__(self, engine: Engine, split: PoolShare | None = None) -> None:
        self.engine = engine
        self.split = split
        self.refills: dict[str, set[asyncio.Task]] = {}
        self.failures: dict[str, int] = {}
        self.retry_at: dict[str, float] = {}

    @property
    def busy(self) -> bool:
        return any(self.refills.values())

    async def tick(self, settings: Settings) -> bool:
        """One pass over every pool; True while some pool wants sandboxes or refills run."""
        reg = self.engine.registry
        rows = reg.pools.pool_rows()
        wanted = False
        for pc in settings.pools.values():
            row = configured_row(reg, pc, rows.get(pc.name))
            target = self._autoscale(pc, row)
            if self.split is not None:
                target = self.split.share(pc, target)
            try:  # off the loop: a fresh host builds the built-in image first
                shape = await asyncio.to_thread(resolve.pool_shape, self.engine, pc)
            except WarmboxError as e:  # no image for its template now: tried again next tick
                reg.pools.set_pool(pc.name, error=f"{type(e).__name__}: {e}"[:500])
                continue
            stale = reg.pools.retire(pc.name, self.engine.owner, keep_shape=shape)  # built to an old config
            await self._destroy(stale, "pool config changed")
            tasks = self.refills.setdefault(pc.name, set())
            ready, _ = reg.pools.pool_counts(pc.name, shape)
            if ready > target:
                await self._destroy(reg.pools.retire(pc.name, self.engine.owner, limit=ready - target), "pool shrank")
            missing = target - ready - len(tasks)
            room = pc.refill_concurrency - len(tasks)
            if missing > 0 and room > 0 and time.time() >= self.retry_at.get(pc.name, 0.0):
                for _ in range(min(missing, room)):
                    task = asyncio.ensure_future(self._refill(pc))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            wanted = wanted or target > 0 or bool(tasks)
        for name in rows:  # pools removed from the config: their sandboxes go
            if name not in settings.pools:
                await self._destroy(reg.pools.retire(name, self.engine.owner), "pool no longer configured")
        return wanted or self.busy

    def _autoscale(self, pc: PoolConfig, row: PoolRow) -> int:
        """The pool's target after the misses since the last look (each raises it by one) or an
        idle period (it halves), within its bounds.

        On a cluster every node autoscales the shared target: the new target, the misses' cursor
        and the idle clock are written in one update conditional on the row this node read, so of
        nodes looking at once exactly one counts those misses (or that idle period); the others
        take the target as it now is. No node is special: any up node raises the target."""
        reg = self.engine.registry
        lo, hi = bounds(pc, row.min_override, row.max_override)
        now = time.time()
        # misses since the last look (kept in the registry: a miss that started this daemon counts)
        misses, newest = reg.pools.unseen_misses(pc.name, row.events_seen)
        target = row.target
        new = target + misses
        idle = not misses and target > lo and now - row.last_demand_at >= pc.idle_shrink_s
        if idle:
            new = target // 2  # and the next halving waits another idle period
        new = sorted((lo, new, hi))[1]
        if newest == row.events_seen and new == target and not idle:
            return target
        won = reg.pools.scale(pc.name, (target, row.events_seen), (new, newest), now if idle else row.last_demand_at)
        if not won:  # another node (or a resize) moved the row first
            fresh = reg.pools.pool_rows().get(pc.name)
            return target if fresh is None else sorted((lo, fresh.target, hi))[1]
        if idle:
            reg.pools.set_pool(pc.name, kind="scaled", detail=f"idle {pc.idle_shrink_s:.0f}s: target {target}->{new}")
        elif new != target:
            reg.pools.set_pool(
                pc.name, kind="scaled" if misses else "", detail=f"{misses} misses: target {target}->{new}"
            )
        return new

    async def _refill(self, pc: PoolConfig) -> None:
        reg = self.engine.registry
        try:
            sid = await provision.create_pooled(self.engine, pc)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # recorded on the pool, retried with backoff; never handed out
            why = f"{type(e).__name__}: {e}" if not isinstance(e, WarmboxError) else str(e)
            n = self.failures[pc.name] = self.failures.get(pc.name, 0) + 1
            self.retry_at[pc.name] = time.time() + min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (n - 1))
            reg.pools.set_pool(pc.name, error=why[:1000], kind="warmup_failed", detail=why[:1000])
            return
        self.failures.pop(pc.name, None)
        self.retry_at.pop(pc.name, None)
        reg.pools.pool_event(pc.name, "warmed", sid)

    async def _destroy(self, ids: list[str], why: str) -> None:
        """Destroy retired sandboxes, a few at a time (each waits on runc and the kernel)."""
        gate = asyncio.Semaphore(DESTROY_CONCURRENCY)

        async def one(sid: str) -> None:
            async with gate:
                try:
                    await teardown.destroy(self.engine, sid, why)
                except WarmboxError:
                    pass  # FAILED keeps it on the reaper's list

        await asyncio.gather(*(one(sid) for sid in ids))

    async def drain(self) -> None:
        """Stop refilling and destroy every pooled sandbox (daemon shutdown, ``warmbox down``)."""
        tasks = [t for ts in self.refills.values() for t in ts]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for name in list(self.engine.registry.pools.pool_rows()):
            await self._destroy(self.engine.registry.pools.retire(name, self.engine.owner), "daemon stopped")
