"""Aggregates of the registry for ``/metrics``: counts, sums and cumulative histogram buckets.

The registry is the source of truth shared by every warmbox process (the CLI creates sandboxes, the
daemon fills pools), so the server derives its domain metrics from it at scrape time instead of
counting in its own process. Every family is an SQL aggregate over bounded label sets, all read in
one read transaction on a read-only connection of its own: the families agree with each other, and
the engine's connection (its writes and transactions) is never shared with the scraping thread.
SQLite: one BEGIN on a ``mode=ro`` connection (one WAL snapshot); PostgreSQL (a cluster's shared
registry): ``REPEATABLE READ READ ONLY`` (one snapshot). The SQL is written once for both.

The cost of a scrape is bounded by what is alive, not by history: the rows of a sandbox destroyed
more than SETTLE_S ago never change again, so they are aggregated once, at the first scrape that
sees them settled, and kept in memory; each scrape reads only the sandboxes not settled yet (live,
paused, recently ended), through their indexed sandbox_id. Pool events are append-only and read
from the last row seen. A new server process reads all history once, at its first scrape.

Labels are only values the code bounds (states, tiers, stages, kinds, tenant and pool names the
operator made); never a sandbox id or anything a sandbox or a tenant's policy chose (an egress
rule's host pattern is cut to its class: "allow:pypi.org" -> "allow").
"""

from __future__ import annotations

import dataclasses
import math
import re
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from warmbox.errors import RegistryError
from warmbox.models import State
from warmbox.storage.sql import DEFAULT_BOUNDS, PG_XACT_HORIZON, Bounds, is_url, pg_sql

# bounds (seconds) of the histograms derived from rows: fixed, so a series never changes its buckets
STAGE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
COMMAND_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
APPROVAL_BUCKETS_S = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 14400.0)
PAUSE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# a destroyed sandbox's rows are final this long after it ended (its proxy's last byte counts and
# its meters' final reading are written within seconds of the destroy)
SETTLE_S = 300.0

OWN_FAMILY_STAGES = ("pause", "resume")  # timings kept in their own families (not part of a start)
DAY = 86400.0  # budgets are per UTC day
_RESOURCES = (("cpu", 1, 2), ("memory", 3, 4))  # resource label, columns (used, limit) of a _budgets row
COMMAND_OUTCOMES = ("timed_out", "oom_killed", "truncated", "error", "nonzero_exit")
_SHOWN = tuple(s.value for s in State if s is not State.DESTROYED)  # destroyed: ever growing, a counter's job
_LABEL = re.compile(r"^[a-z][a-z0-9_-]{0,31}(:[a-z][a-z0-9_-]{0,31})?$")


@dataclasses.dataclass(frozen=True)
class Value:
    """One series of a counter or gauge: its label values (in its family's LABELS order) and value."""

    labels: tuple[str, ...]
    value: float


@dataclasses.dataclass(frozen=True)
class Buckets:
    """One series of a histogram: cumulative counts, one per bound of its family (observations <=
    bound), the count of all observations (the +Inf bucket) and their sum in seconds."""

    labels: tuple[str, ...]
    cumulative: tuple[int, ...]
    count: int
    sum: float


@dataclasses.dataclass(frozen=True)
class RegistryTotals:
    """What one scrape read; tenant labels are the registry's ("" = the host's own sandboxes).
    The label names of each family, in order, are in :data:`LABELS`."""

    sandboxes: tuple[Value, ...]
    creates: tuple[Value, ...]
    create_failures: tuple[Value, ...]
    pauses: tuple[Value, ...]
    resumes: tuple[Value, ...]
    resume_failures: tuple[Value, ...]
    stages: tuple[Buckets, ...]
    pause_seconds: tuple[Buckets, ...]
    resume_seconds: tuple[Buckets, ...]
    commands: tuple[Buckets, ...]
    command_outcomes: tuple[Value, ...]
    pool_target: tuple[Value, ...]
    pool_ready: tuple[Value, ...]
    pool_warming: tuple[Value, ...]
    pool_events: tuple[Value, ...]
    pool_cpu_seconds: tuple[Value, ...]
    pool_gib_seconds: tuple[Value, ...]
    snapshots: tuple[Value, ...]
    snapshot_bytes: tuple[Value, ...]
    snapshot_max_bytes: tuple[Value, ...]
    egress: tuple[Value, ...]
    egress_bytes: tuple[Value, ...]
    cpu_seconds: tuple[Value, ...]
    gib_seconds: tuple[Value, ...]
    budget_used_hours: tuple[Value, ...]
    budget_limit_hours: tuple[Value, ...]
    budget_ratio: tuple[Value, ...]
    approvals_pending: tuple[Value, ...]
    approvals_opened: tuple[Value, ...]
    approvals_closed: tuple[Value, ...]
    approval_wait: tuple[Buckets, ...]
    read_seconds: float  # how long the read took (wall clock)
    sandboxes_read: int  # how many sandboxes' rows this read aggregated (the rest came from memory)


LABELS: dict[str, tuple[str, ...]] = {
    "sandboxes": ("tenant", "state", "tier"),
    "creates": ("tenant", "tier", "source"),
    "create_failures": ("tenant", "tier"),
    "pauses": ("tenant", "tier"),
    "resumes": ("tenant", "tier"),
    "resume_failures": ("tenant", "tier"),
    "stages": ("stage", "tier", "request_path"),
    "pause_seconds": ("tier",),
    "resume_seconds": ("tier",),
    "commands": ("kind", "tier"),
    "command_outcomes": ("kind", "tier", "outcome"),
    "pool_target": ("pool",),
    "pool_ready": ("pool",),
    "pool_warming": ("pool",),
    "pool_events": ("pool", "kind"),
    "pool_cpu_seconds": ("pool",),
    "pool_gib_seconds": ("pool",),
    "snapshots": ("tenant",),
    "snapshot_bytes": ("tenant",),
    "snapshot_max_bytes": ("tenant",),
    "egress": ("tenant", "kind", "decision", "rule"),
    "egress_bytes": ("tenant", "direction"),
    "cpu_seconds": ("tenant",),
    "gib_seconds": ("tenant",),
    "budget_used_hours": ("tenant", "resource"),
    "budget_limit_hours": ("tenant", "resource"),
    "budget_ratio": ("tenant", "resource"),
    "approvals_pending": ("tenant", "kind"),
    "approvals_opened": ("tenant", "kind"),
    "approvals_closed": ("tenant", "kind", "state"),
    "approval_wait": ("kind", "state"),
}


def label(value: object) -> str:
    """A label value from a column the code fills with a closed set of words; anything else "other"."""
    return value if isinstance(value, str) and _LABEL.match(value) else "other"


def _count_if(cond: str) -> str:
    """How many rows of the group meet ``cond`` (portable: PostgreSQL cannot SUM a boolean)."""
    return f"SUM(CASE WHEN {cond} THEN 1 ELSE 0 END)"


def _bucket_sql(expr: str, bounds: tuple[float, ...]) -> str:
    """One SUM per bound (cumulative counts), then the sum and the count; ``expr`` in milliseconds."""
    sums = ", ".join(_count_if(f"{expr} <= {b * 1e3!r}") for b in bounds)
    return f"{sums}, SUM({expr}), COUNT(*)"


def _positive(expr: str) -> str:
    return f"CASE WHEN {expr} > 0 THEN {expr} ELSE 0 END"


# Per-sandbox families: each query selects (part, tenant, labels..., values...) over the sandboxes
# in the temp table ``scope`` (part 1: settled by this read, to be kept; part 0: not settled yet).
# Its key is (tenant, labels...); values are summed elementwise.
@dataclasses.dataclass(frozen=True)
class _Family:
    name: str
    sql: str
    width: int  # label columns after part, tenant included
    clean: tuple[bool, ...]  # per label column: pass through label() (closed sets) or keep (tenant names)


# CROSS JOIN: SQLite then keeps this order (scope outermost; the temp table has no statistics and
# the planner would otherwise scan the large table and probe scope for each of its rows). PostgreSQL
# has no CROSS JOIN ... ON: there it reads as a plain JOIN (its planner has the statistics).
_JOIN = "FROM scope x CROSS JOIN sandboxes s ON s.sandbox_id = x.sandbox_id"
_FAMILIES = (
    # a create is a sandbox asked for by someone: made cold (or from a snapshot; a failed start
    # counts, and in create_failures too), or claimed from a pool; a pool's warm-up nobody claimed
    # is the pool's (warmbox_pool_warmups_total, its failures warmbox_pool_warmup_failures_total)
    _Family(
        "creates",
        "SELECT x.part, s.tenant, s.tier, CASE WHEN s.pool='' THEN 'cold' ELSE 'pool' END, COUNT(*) "
        f"{_JOIN} WHERE s.pool='' OR s.claimed_at>0 GROUP BY 1, 2, 3, 4",
        3,
        (False, True, False),
    ),
    _Family(
        "moves",
        "SELECT x.part, s.tenant, s.tier, "
        + _count_if("t.from_state='creating' AND t.to_state='failed' AND (s.pool='' OR s.claimed_at>0)")
        + ", "
        + _count_if("t.from_state IN ('ready','running') AND t.to_state='paused'")
        + ", "
        + _count_if("t.from_state='paused' AND t.to_state='creating'")
        + ", "
        + _count_if("t.from_state='creating' AND t.to_state='paused'")
        + " "
        f"{_JOIN} CROSS JOIN transitions t ON t.sandbox_id = x.sandbox_id GROUP BY 1, 2, 3",
        2,
        (False, True),
    ),
    _Family(
        "stages",
        "SELECT x.part, s.tenant, t.stage, s.tier, CASE WHEN t.on_path<>0 THEN 'true' ELSE 'false' END, "
        f"{_bucket_sql('t.duration_ms', STAGE_BUCKETS_S)} {_JOIN} CROSS JOIN timings t ON t.sandbox_id = x.sandbox_id "
        f"WHERE t.stage NOT IN {OWN_FAMILY_STAGES!r} GROUP BY 1, 2, 3, 4, 5",
        4,
        (False, True, True, False),
    ),
    _Family(
        "own_stages",
        f"SELECT x.part, s.tenant, t.stage, s.tier, {_bucket_sql('t.duration_ms', PAUSE_BUCKETS_S)} "
        f"{_JOIN} CROSS JOIN timings t ON t.sandbox_id = x.sandbox_id WHERE t.stage IN {OWN_FAMILY_STAGES!r} "
        "GROUP BY 1, 2, 3, 4",
        3,
        (False, True, True),
    ),
    _Family(
        "egress",
        "SELECT x.part, s.tenant, e.kind, e.decision, "
        "CASE WHEN e.rule LIKE 'allow:%' THEN 'allow' WHEN e.rule LIKE 'deny:%' THEN 'deny' ELSE e.rule END, "
        f"COUNT(*), SUM(e.bytes_up), SUM(e.bytes_down) {_JOIN} CROSS JOIN net_events e ON e.sandbox_id = x.sandbox_id "
        "GROUP BY 1, 2, 3, 4, 5",
        4,
        (False, True, True, True),
    ),
    _Family(
        "cost",
        f"SELECT x.part, s.tenant, SUM({_positive('m.cpu_ns - m.base_cpu_ns')}) / 1e9, "
        f"SUM({_positive('m.gib_s - m.base_gib_s')}) "
        f"{_JOIN} CROSS JOIN meters m ON m.sandbox_id = x.sandbox_id WHERE s.pool='' OR s.claimed_at>0 GROUP BY 1, 2",
        1,
        (False,),
    ),
    # the pool's own cost: its sandboxes that ended unclaimed (as PoolStore.pool_totals counts it)
    _Family(
        "pool_costs",
        "SELECT x.part, '', c.pool, SUM(c.cpu_s), SUM(c.gib_s) "
        "FROM scope x CROSS JOIN pool_costs c ON c.sandbox_id = x.sandbox_id GROUP BY 1, 2, 3",
        2,
        (False, False),
    ),
)
# the commands table is the ``records`` part's (one row per command, code run or process)
_COMMANDS = _Family(
    "commands",
    "SELECT x.part, s.tenant, c.kind, s.tier, "
    f"{_bucket_sql('c.duration_ms', COMMAND_BUCKETS_S)}, "
    "SUM(c.timed_out), SUM(c.oom_killed), SUM(c.truncated), "
    + _count_if("c.error<>''")
    + ", "
    + _count_if("c.error='' AND c.timed_out=0 AND c.oom_killed=0 AND c.exit_code<>0")
    + " "
    f"{_JOIN} CROSS JOIN commands c ON c.sandbox_id = x.sandbox_id GROUP BY 1, 2, 3, 4",
    3,
    (False, True, True),
)

_Acc = dict[tuple[str, ...], list[float]]


def _add(acc: _Acc, key: tuple[str, ...], values: Sequence[Any]) -> None:
    old = acc.get(key)
    vals = [float(v or 0) for v in values]
    if old is None:
        acc[key] = vals
    else:
        for i, v in enumerate(vals):
            old[i] += v


class RegistryStats:
    """Reads :class:`RegistryTotals` from the registry at ``path`` (a SQLite file, or a PostgreSQL
    URL: Registry.location), one read at a time (a lock: concurrent scrapes wait rather than run
    the aggregates twice), keeping the settled aggregates. bounds: its PostgreSQL connection's
    waits (the registry's)."""

    def __init__(self, path: Path | str, settle_s: float = SETTLE_S, bounds: Bounds = DEFAULT_BOUNDS) -> None:
        self.path = path
        self.settle_s = settle_s
        self.bounds = bounds
        self._pg = is_url(path)
        self._db: Any = None
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._settled: dict[str, _Acc] = {}  # family -> aggregates of the settled sandboxes
        self._settled_until = 0.0  # destroyed sandboxes that ended at or before this are in _settled
        self._pool_events: _Acc = {}
        self._pool_rowid = 0  # pool events up to this rowid (PostgreSQL: below this xid) are in _pool_events

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _conn(self) -> Any:
        if self._db is None:
            # read-only: a scrape can never change the registry, whatever its SQL says (the temp
            # table of the sandboxes in scope lives in this connection's own memory)
            if self._pg:
                self._db = _PgStatsConn(str(self.path), self.bounds)
                return self._db
            db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5, check_same_thread=False)
            db.isolation_level = None  # transactions are explicit (BEGIN ... COMMIT below)
            db.execute("PRAGMA temp_store=MEMORY")
            db.execute("CREATE TEMP TABLE scope (sandbox_id TEXT PRIMARY KEY, part INTEGER NOT NULL)")
            self._db = db
        return self._db

    def read(self, tenant: str | None = None) -> RegistryTotals:
        """Every family; ``tenant``: only that tenant's series (and none of the host's pools)."""
        with self._lock:
            t0 = time.perf_counter()
            try:
                db = self._conn()
                # one snapshot for every family (SQLite: of the WAL)
                db.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY" if self._pg else "BEGIN")
                try:
                    return self._read(db, tenant, t0)
                finally:
                    db.execute("DELETE FROM scope")
                    db.execute("COMMIT")
            except _ERRORS as e:
                if self._db is not None:
                    self._db.close()
                    self._db = None
                self._reset()  # a half-applied read must not stay in the settled aggregates
                raise RegistryError(f"registry read for the metrics failed: {e}") from None

    def _has_table(self, db: Any, name: str) -> bool:
        if self._pg:
            return bool(db.execute("SELECT to_regclass(?) IS NOT NULL", (name,)).fetchone()[0])
        return bool(db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone())

    def _columns(self, db: Any, table: str) -> set[str]:
        if self._pg:
            rows = db.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name=? "
                "AND table_schema=current_schema()",
                (table,),
            ).fetchall()
            return {r[0] for r in rows}
        return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}

    def _read(self, db: Any, tenant: str | None, t0: float) -> RegistryTotals:
        def q(sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
            return db.execute(sql.replace("CROSS JOIN", "JOIN") if self._pg else sql, args).fetchall()

        # the sandboxes to read: those settling now (part 1, every tenant's: then kept), and those
        # not settled (part 0, only ``tenant``'s if given)
        before = self._settled_until
        until = max(before, time.time() - self.settle_s)
        destroyed = State.DESTROYED.value
        settles = "(state=? AND ended_at>? AND ended_at<=?)"
        only_tenant = "" if tenant is None else " AND tenant=?"
        db.execute(
            f"INSERT INTO scope SELECT sandbox_id, CASE WHEN {settles} THEN 1 ELSE 0 END FROM sandboxes "
            f"WHERE {settles} OR ((state<>? OR ended_at>?){only_tenant})",
            (destroyed, before, until) * 2 + (destroyed, until) + (() if tenant is None else (tenant,)),
        )
        scoped = q("SELECT COUNT(*) FROM scope")[0][0]
        families = [*_FAMILIES]
        if self._has_table(db, "commands"):
            families.append(_COMMANDS)
        fresh: dict[str, _Acc] = {}
        settling: dict[str, _Acc] = {}
        for f in families:
            for row in q(f.sql):
                key = tuple(label(v) if c else str(v) for v, c in zip(row[1 : 1 + f.width], f.clean, strict=True))
                _add((settling if row[0] else fresh).setdefault(f.name, {}), key, row[1 + f.width :])
        # pool events: append-only, read from the last one seen (SQLite: by rowid, committed in
        # that order; PostgreSQL: by writing transaction, up to the oldest one still running)
        if self._pg and "xid" in self._columns(db, "pool_events"):
            last = q(f"SELECT {PG_XACT_HORIZON}")[0][0]
            new_events = q(
                "SELECT pool, kind, COUNT(*) FROM pool_events WHERE xid>=? AND xid<? GROUP BY pool, kind",
                (self._pool_rowid, last),
            )
        else:
            last = q("SELECT COALESCE(MAX(rowid), 0) FROM pool_events")[0][0]
            new_events = q(
                "SELECT pool, kind, COUNT(*) FROM pool_events WHERE rowid>? AND rowid<=? GROUP BY pool, kind",
                (self._pool_rowid, last),
            )
        # everything read: only now fold the settled part in (an error above leaves the state as it was)
        for name, acc in settling.items():
            into = self._settled.setdefault(name, {})
            for key, vals in acc.items():
                _add(into, key, vals)
        self._settled_until = until
        for pool, kind, count in new_events:
            _add(self._pool_events, (str(pool), str(kind)), (count,))
        self._pool_rowid = last

        def merged(name: str) -> _Acc:
            out: _Acc = {}
            for src in (self._settled.get(name, {}), fresh.get(name, {})):
                for key, vals in src.items():
                    if tenant is None or key[0] == tenant:
                        _add(out, key, vals)
            return out

        only = "" if tenant is None else " AND tenant=?"
        targs: tuple[str, ...] = () if tenant is None else (tenant,)
        shown = ",".join("?" * len(_SHOWN))
        sandboxes = q(
            f"SELECT tenant, state, tier, COUNT(*) FROM sandboxes WHERE state IN ({shown}){only} "
            "GROUP BY tenant, state, tier",
            (*_SHOWN, *targs),
        )
        snaps = q(
            f"SELECT tenant, COUNT(*), SUM(size_bytes), MAX(size_bytes) FROM snapshots WHERE 1=1{only} GROUP BY tenant",
            targs,
        )
        moves, stages, own = merged("moves"), merged("stages"), merged("own_stages")
        egress, cost, commands = merged("egress"), merged("cost"), merged("commands")
        pools = self._pools(db, merged("pool_costs")) if tenant is None else ((),) * 6
        budgets = self._budgets(db, tenant) if self._has_table(db, "usage") else []
        approvals = self._approvals(db, tenant) if self._has_table(db, "approvals") else []
        n_ap = len(APPROVAL_BUCKETS_S)
        n_cmd = len(COMMAND_BUCKETS_S)
        return RegistryTotals(
            sandboxes=_values((r[0], label(r[1]), label(r[2]), r[3]) for r in sandboxes),
            creates=_values((*k, v[0]) for k, v in merged("creates").items()),
            create_failures=_values((*k, v[0]) for k, v in moves.items()),
            pauses=_values((*k, v[1]) for k, v in moves.items()),
            resumes=_values((*k, v[2]) for k, v in moves.items()),
            resume_failures=_values((*k, v[3]) for k, v in moves.items()),
            stages=_buckets((k[1:], v) for k, v in stages.items()),
            pause_seconds=_buckets((k[2:], v) for k, v in own.items() if k[1] == "pause"),
            resume_seconds=_buckets((k[2:], v) for k, v in own.items() if k[1] == "resume"),
            commands=_buckets((k[1:], v[: n_cmd + 2]) for k, v in commands.items()),
            command_outcomes=_values(
                (*k[1:], outcome, v[n_cmd + 2 + i])
                for k, v in commands.items()
                for i, outcome in enumerate(COMMAND_OUTCOMES)
            ),
            pool_target=pools[0],
            pool_ready=pools[1],
            pool_warming=pools[2],
            pool_events=pools[3],
            pool_cpu_seconds=pools[4],
            pool_gib_seconds=pools[5],
            snapshots=_values((r[0], r[1]) for r in snaps),
            snapshot_bytes=_values((r[0], r[2]) for r in snaps),
            snapshot_max_bytes=_values((r[0], r[3]) for r in snaps),
            egress=_values((*k, v[0]) for k, v in egress.items()),
            egress_bytes=_values(
                [(k[0], "up", v[1]) for k, v in egress.items()] + [(k[0], "down", v[2]) for k, v in egress.items()]
            ),
            cpu_seconds=_values((*k, v[0]) for k, v in cost.items()),
            gib_seconds=_values((*k, v[1]) for k, v in cost.items()),
            budget_used_hours=_values((r[0], res, r[used]) for r in budgets for res, used, _ in _RESOURCES),
            budget_limit_hours=_values((r[0], res, r[limit]) for r in budgets for res, _, limit in _RESOURCES),
            budget_ratio=_values(
                (r[0], res, r[used] / r[limit]) for r in budgets for res, used, limit in _RESOURCES if r[limit] > 0
            ),
            approvals_pending=_values((r[0], r[1], r[3]) for r in approvals if r[2] == "pending"),
            approvals_opened=_values((r[0], r[1], r[3]) for r in approvals),
            approvals_closed=_values((r[0], r[1], r[2], r[3]) for r in approvals if r[2] != "pending"),
            approval_wait=_buckets(
                ((r[1], r[2]), (*r[4 : 4 + n_ap], r[4 + n_ap] * 1e3, r[3])) for r in approvals if r[2] != "pending"
            ),
            read_seconds=time.perf_counter() - t0,
            sandboxes_read=scoped,
        )

    @staticmethod
    def _approvals(db: Any, tenant: str | None) -> list[tuple[Any, ...]]:
        """(tenant, kind, state, count, wait buckets (cumulative)..., wait sum in s) of the approval
        queue; a pending question past its deadline counts as timed_out (as ApprovalStore.approvals
        reads it). The queue holds human-rate questions: one GROUP BY over it."""
        state = "CASE WHEN state='pending' AND deadline<? THEN 'timed_out' ELSE state END"
        wait = "(CASE WHEN answered_at>0 THEN answered_at ELSE deadline END - created_at)"
        sums = ", ".join(_count_if(f"{wait} <= {b!r}") for b in APPROVAL_BUCKETS_S)
        only = "" if tenant is None else " WHERE tenant=?"
        rows = db.execute(
            f"SELECT tenant, kind, {state}, COUNT(*), {sums}, SUM({wait}) FROM approvals{only} GROUP BY 1, 2, 3",
            (time.time(), *(() if tenant is None else (tenant,))),
        ).fetchall()
        return [(r[0], label(r[1]), label(r[2]), *r[3:]) for r in rows]

    def _budgets(self, db: Any, tenant: str | None) -> list[tuple[Any, ...]]:
        """(tenant, cpu hours used today, cpu budget, GiB-hours used today, GiB-hours budget) of the
        tenants with a daily budget: as UsageStore.budget_status counts them (the usage table's hours
        since UTC midnight); none before the approvals part's tables exist."""
        if not {"budget_cpu_h", "budget_gib_h"} <= self._columns(db, "tenants"):
            return []
        day = math.floor(time.time() / DAY) * DAY
        only = "" if tenant is None else " AND t.name=?"
        return db.execute(
            "SELECT t.name, COALESCE(SUM(u.cpu_s), 0) / 3600.0, t.budget_cpu_h, COALESCE(SUM(u.gib_s), 0) / 3600.0, "
            "t.budget_gib_h FROM tenants t LEFT JOIN usage u ON u.tenant = t.name AND u.hour >= ? "
            f"WHERE (t.budget_cpu_h > 0 OR t.budget_gib_h > 0){only} GROUP BY t.name",
            (day,) if tenant is None else (day, tenant),
        ).fetchall()

    def _pools(self, db: Any, costs: _Acc) -> tuple[tuple[Value, ...], ...]:
        target = db.execute("SELECT name, target FROM pool_state").fetchall()
        names = [r[0] for r in target]
        ready = dict(
            db.execute(
                "SELECT pool, COUNT(*) FROM sandboxes WHERE state=? AND pool<>'' AND expires_at>? GROUP BY pool",
                (State.POOLED.value, time.time() + 1),
            ).fetchall()
        )
        warming = dict(
            db.execute(
                "SELECT pool, COUNT(*) FROM sandboxes WHERE state=? AND pool<>'' GROUP BY pool", (State.CREATING.value,)
            ).fetchall()
        )
        events: dict[str, dict[str, float]] = {}
        for (pool, kind), (count,) in self._pool_events.items():
            events.setdefault(pool, {})[kind] = count
        rows = []
        for pool in sorted(set(names) | set(events)):
            ev = events.get(pool, {})
            # as PoolStore.pool_totals counts them: a claim whose check failed took the next sandbox
            hits = ev.get("hit", 0) - ev.get("claim_failed", 0)
            for kind, count in (
                ("hit", hits),
                ("miss", ev.get("miss", 0)),
                ("warmed", ev.get("warmed", 0)),
                ("warmup_failed", ev.get("warmup_failed", 0)),
            ):
                rows.append((pool, kind, max(0, count)))
        return (
            _values(target),
            _values((p, ready.get(p, 0)) for p in names),
            _values((p, warming.get(p, 0)) for p in names),
            _values(rows),
            _values((k[1], v[0]) for k, v in costs.items()),
            _values((k[1], v[1]) for k, v in costs.items()),
        )


class _PgStatsConn:
    """The scrape's own PostgreSQL connection (autocommit: read() opens its one transaction), with
    its temp table ``scope``, speaking the registry's ``?`` paramstyle."""

    def __init__(self, url: str, bounds: Bounds) -> None:
        import psycopg

        from warmbox.storage.sql import numeric_loader

        self.conn = psycopg.connect(
            url, autocommit=True, connect_timeout=10, application_name="warmbox-metrics", options=bounds.pg_options()
        )
        self.conn.adapters.register_loader("numeric", numeric_loader())
        # made outside the read-only transactions (which may write only to temp tables)
        self.conn.execute("CREATE TEMP TABLE scope (sandbox_id TEXT PRIMARY KEY, part INTEGER NOT NULL)")

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        return self.conn.execute(pg_sql(sql), tuple(args))

    def close(self) -> None:
        self.conn.close()


def _pg_errors() -> tuple[type[Exception], ...]:
    try:
        import psycopg
    except ImportError:
        return ()
    return (psycopg.Error,)


_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, *_pg_errors())


def _values(rows: Iterable[Sequence[Any]]) -> tuple[Value, ...]:
    """Rows (labels..., value) summed by their labels (a label cleaned to "other" merges series)."""
    out: dict[tuple[str, ...], float] = {}
    for r in rows:
        key = tuple(str(x) for x in r[:-1])
        out[key] = out.get(key, 0.0) + float(r[-1] or 0)
    return tuple(Value(k, v) for k, v in sorted(out.items()))


def _buckets(rows: Iterable[tuple[tuple[str, ...], Sequence[float]]]) -> tuple[Buckets, ...]:
    """(labels, [cumulative counts..., sum in ms, count]) summed by labels (the tenant dropped first)."""
    out: _Acc = {}
    for key, vals in rows:
        _add(out, key, vals)
    return tuple(Buckets(k, tuple(int(c) for c in v[:-2]), int(v[-1]), v[-2] / 1e3) for k, v in sorted(out.items()))


__all__ = [
    "APPROVAL_BUCKETS_S",
    "COMMAND_BUCKETS_S",
    "COMMAND_OUTCOMES",
    "LABELS",
    "PAUSE_BUCKETS_S",
    "SETTLE_S",
    "STAGE_BUCKETS_S",
    "Buckets",
    "RegistryStats",
    "RegistryTotals",
    "Value",
    "label",
]
