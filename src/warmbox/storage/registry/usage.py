"""UsageStore: what sandboxes used (meters, hourly usage) and the tenants' budgets."""

from __future__ import annotations

import builtins
import dataclasses
import math
import time

from warmbox.errors import InvalidArgument
from warmbox.models import BudgetStatus, UsageBucket
from warmbox.storage.registry.common import _POOL_COST_COLUMNS, _QUOTA, GIB, HOUR, _add_usage, _in, _quota
from warmbox.storage.registry.db import Store, _retried
from warmbox.storage.sql import Conn

DAY = 86400.0
METRIC_SAMPLE_EVERY_S = 5.0  # a sandbox's metrics history takes a reading at most this often (E2B's period) ...
METRIC_SAMPLES_KEPT = 720  # ... and keeps its latest this many (an hour at 5 s) while it lives


@dataclasses.dataclass(frozen=True)
class Meter:
    """Raw cumulative counters of one sandbox and the baseline taken when it left its pool."""

    sandbox_id: str
    sampled_at: float
    memory_bytes: int
    peak_bytes: int
    gib_s: float
    cpu_ns: int
    busy_ms: float
    commands: int
    base_cpu_ns: int
    base_gib_s: float
    base_busy_ms: float
    base_commands: int
    final: bool


# A meters row as Registry.meter selects it: Meter's fields in order, ``final`` still SQLite's 0/1.
_MeterRow = tuple[str, float, int, int, float, int, float, int, int, float, float, int, int]


def _add_metric_sample(
    db: Conn, sandbox_id: str, now: float, cpu_ns: int, memory_bytes: int, last: tuple[float, int], cpus: float
) -> None:
    """A reading into the sandbox's metrics history (in the caller's transaction), if its latest is
    METRIC_SAMPLE_EVERY_S old; the oldest beyond METRIC_SAMPLES_KEPT go. Its CPU use is over the
    time since the history's latest reading (else the meter's ``last`` one), in percent of its
    ``cpus``; a counter that went back (a resumed runtime starts at 0) counts from 0."""
    prev = db.execute(
        "SELECT at, cpu_ns FROM metric_samples WHERE sandbox_id=? ORDER BY at DESC LIMIT 1", (sandbox_id,)
    ).fetchone()
    if prev is not None and now - prev[0] < METRIC_SAMPLE_EVERY_S:
        return
    at, before = prev if prev is not None else last
    used = cpu_ns - before if cpu_ns >= before else cpu_ns
    dt = now - at
    pct = 100.0 * used / 1e9 / dt / max(cpus, 1e-9) if dt > 0 else 0.0
    db.execute(
        "INSERT INTO metric_samples (sandbox_id, at, cpu_ns, cpu_pct, memory_bytes) VALUES (?, ?, ?, ?, ?)",
        (sandbox_id, now, cpu_ns, round(min(pct, 100.0), 2), memory_bytes),
    )
    old = db.execute(
        "SELECT at FROM metric_samples WHERE sandbox_id=? ORDER BY at DESC LIMIT 1 OFFSET ?",
        (sandbox_id, METRIC_SAMPLES_KEPT),
    ).fetchone()
    if old is not None:
        db.execute("DELETE FROM metric_samples WHERE sandbox_id=? AND at<=?", (sandbox_id, old[0]))


def _budget(
    tenant: str, day: float, cpu_s: float, gib_s: float, cpu_limit: float, gib_limit: float, warn_ratio: float
) -> BudgetStatus:
    cpu_h, gib_h = cpu_s / HOUR, gib_s / HOUR
    cpu_ratio = cpu_h / cpu_limit if cpu_limit else 0.0
    gib_ratio = gib_h / gib_limit if gib_limit else 0.0
    top = max(cpu_ratio, gib_ratio)
    return BudgetStatus(
        tenant, day, cpu_h, cpu_limit, cpu_ratio, gib_h, gib_limit, gib_ratio, top >= warn_ratio, top >= 1.0
    )


class UsageStore(Store):
    """What sandboxes used (meters, hourly usage) and the tenants' budgets."""

    @_retried
    def sample(self, samples: builtins.list[tuple[str, int, int]], now: float | None = None) -> None:
        """Fold (sandbox_id, memory_bytes, cpu_ns) readings into the meters (memory x time)."""
        now = time.time() if now is None else now
        used: dict[str, builtins.list[float]] = {}  # tenant -> [cpu_s, gib_s] of this round
        with self._tx() as db:
            for sid, mem, cpu in samples:
                row = db.execute(
                    "SELECT m.sampled_at, m.memory_bytes, m.final, m.cpu_ns, s.tenant, s.cpus FROM meters m "
                    "JOIN sandboxes s USING (sandbox_id) WHERE sandbox_id=?",
                    (sid,),
                ).fetchone()
                if row is None or row[2]:
                    continue
                dt = max(0.0, now - row[0])
                # trapezoid between the last reading and this one
                add = (row[1] + mem) / 2 / GIB * dt
                top = self._sql.greatest
                db.execute(
                    f"UPDATE meters SET sampled_at=?, memory_bytes=?, peak_bytes={top}(peak_bytes, ?), "
                    f"gib_s=gib_s+?, cpu_ns={top}(cpu_ns, ?) WHERE sandbox_id=?",
                    (now, mem, mem, add, cpu, sid),
                )
                u = used.setdefault(row[4], [0.0, 0.0])
                u[0] += max(0, cpu - row[3]) / 1e9
                u[1] += add
                _add_metric_sample(db, sid, now, cpu, mem, (row[0], row[3]), row[5])
            for tenant, (cpu_s, gib_s) in sorted(used.items()):  # one row order for every writer
                _add_usage(db, tenant, now, cpu_s, gib_s)

    @_retried
    def set_busy(self, sandbox_id: str, busy_ms: float, commands: int) -> None:
        with self._tx() as db:
            top = self._sql.greatest
            db.execute(
                f"UPDATE meters SET busy_ms={top}(busy_ms, ?), commands={top}(commands, ?) "
                "WHERE sandbox_id=? AND final=0",
                (busy_ms, commands, sandbox_id),
            )

    @_retried
    def finalize(self, sandbox_id: str) -> None:
        """Freeze the meters of an ended sandbox; an unclaimed pooled one is all the pool's cost."""
        with self._tx() as db:
            db.execute("UPDATE meters SET final=1, memory_bytes=0 WHERE sandbox_id=?", (sandbox_id,))
            db.execute("DELETE FROM metric_samples WHERE sandbox_id=?", (sandbox_id,))  # its history ends with it
            row = db.execute(
                "SELECT s.pool, s.claimed_at, s.created_at, s.ended_at, m.cpu_ns, m.gib_s "
                "FROM sandboxes s JOIN meters m USING (sandbox_id) WHERE sandbox_id=?",
                (sandbox_id,),
            ).fetchone()
            if row and row[0] and not row[1]:
                end = row[3] or time.time()
                db.execute(
                    self._sql.upsert("pool_costs", _POOL_COST_COLUMNS, ("sandbox_id",)),
                    (row[0], sandbox_id, row[4] / 1e9, row[5], max(0.0, end - row[2])),
                )

    def meter(self, sandbox_id: str) -> Meter | None:
        row: _MeterRow | None = self._db.execute(
            "SELECT sandbox_id, sampled_at, memory_bytes, peak_bytes, gib_s, cpu_ns, busy_ms, commands, "
            "base_cpu_ns, base_gib_s, base_busy_ms, base_commands, final FROM meters WHERE sandbox_id=?",
            (sandbox_id,),
        ).fetchone()
        return None if row is None else Meter(*row[:-1], bool(row[-1]))

    def metric_samples(
        self, sandbox_id: str, start: float, end: float, limit: int = METRIC_SAMPLES_KEPT
    ) -> builtins.list[tuple[float, float, int]]:
        """(at, cpu_pct, memory_bytes) of a sandbox's metrics history in [start, end], oldest first:
        at most ``limit``, the latest of them. cpu_pct: its CPU time over the time since the reading
        before it, in percent of its CPUs (0-100)."""
        rows = self._db.execute(
            "SELECT at, cpu_pct, memory_bytes FROM metric_samples WHERE sandbox_id=? AND at>=? AND at<=? "
            "ORDER BY at DESC LIMIT ?",
            (sandbox_id, start, end, limit),
        ).fetchall()
        return [(r[0], r[1], r[2]) for r in reversed(rows)]

    def ended_at(self, sandbox_id: str) -> float:
        row = self._db.execute("SELECT ended_at FROM sandboxes WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        return row[0] if row else 0.0

    def usage(self, tenant: str | None, since: float, until: float | None = None) -> builtins.list[UsageBucket]:
        """The hourly use of ``tenant``'s sandboxes (None: every tenant's) in the hours that start
        in [since rounded down to its hour, until), oldest first. A reading is counted in the hour
        it was taken (the daemon reads every second: an hour's edge moves at most that much)."""
        lo = math.floor(since / HOUR) * HOUR
        hi = math.inf if until is None else until
        sql = "SELECT tenant, hour, cpu_s, gib_s FROM usage WHERE hour>=? AND hour<?"
        args: tuple = (lo, hi)
        if tenant is not None:
            sql, args = sql + " AND tenant=?", (*args, tenant)
        rows = self._read(sql + " ORDER BY hour, tenant", args, many=True)
        return [UsageBucket(*r) for r in rows]

    @_retried
    def set_budget(self, tenant: str, *, cpu_h: float | None = None, gib_h: float | None = None) -> None:
        """A tenant's daily budget (CPU-hours, GiB-hours per UTC day; 0: none; None: keep);
        InvalidArgument if there is no such tenant or a value is not a number >= 0."""
        for name, v in (("budget cpu_h", cpu_h), ("budget gib_h", gib_h)):
            if v is not None:
                _quota(name, v, integer=False)
        with self._tx() as db:
            if db.execute("SELECT 1 FROM tenants WHERE name=?", (tenant,)).fetchone() is None:
                raise InvalidArgument(f"no tenant {tenant!r}")
            if cpu_h is not None:
                db.execute("UPDATE tenants SET budget_cpu_h=? WHERE name=?", (cpu_h, tenant))
            if gib_h is not None:
                db.execute("UPDATE tenants SET budget_gib_h=? WHERE name=?", (gib_h, tenant))

    def budget_status(self, tenant: str, now: float | None = None, *, warn_ratio: float = 0.8) -> BudgetStatus:
        """``tenant``'s use since UTC midnight against its daily budget (a tenant with no row or
        no budget: limits 0, ratios 0). warn_ratio: the ratio from which ``warning`` is set."""
        now = time.time() if now is None else now
        day = math.floor(now / DAY) * DAY
        budget = self._read("SELECT budget_cpu_h, budget_gib_h FROM tenants WHERE name=?", (tenant,))
        cpu_limit, gib_limit = budget if budget is not None else (0.0, 0.0)
        cpu_s, gib_s = self._read(
            "SELECT COALESCE(SUM(cpu_s), 0), COALESCE(SUM(gib_s), 0) FROM usage WHERE tenant=? AND hour>=?",
            (tenant, day),
        )
        return _budget(tenant, day, cpu_s, gib_s, cpu_limit, gib_limit, warn_ratio)

    def live_footprint(self, tenant: str) -> tuple[int, float]:
        """The memory (MiB) and CPUs of ``tenant``'s live sandboxes (creating, ready, running: the
        ones its quotas count)."""
        mb, cpus = self._read(
            f"SELECT COALESCE(SUM(memory_mb), 0), COALESCE(SUM(cpus), 0) FROM sandboxes "
            f"WHERE tenant=? AND state IN {_in(_QUOTA)}",
            (tenant, *_QUOTA),
        )
        return int(mb), float(cpus)

    def budgets(self, now: float | None = None, *, warn_ratio: float = 0.8) -> builtins.list[BudgetStatus]:
        """:meth:`budget_status` of every tenant that has a budget, by name (two reads in all: for
        a scrape or a dashboard page)."""
        now = time.time() if now is None else now
        day = math.floor(now / DAY) * DAY
        limits = self._read(
            "SELECT name, budget_cpu_h, budget_gib_h FROM tenants WHERE budget_cpu_h>0 OR budget_gib_h>0 ORDER BY name",
            many=True,
        )
        used = {
            r[0]: (r[1], r[2])
            for r in self._read(
                "SELECT tenant, SUM(cpu_s), SUM(gib_s) FROM usage WHERE hour>=? GROUP BY tenant", (day,), many=True
            )
        }
        return [_budget(name, day, *used.get(name, (0.0, 0.0)), cpu, gib, warn_ratio) for name, cpu, gib in limits]
