"""PoolStore: warm pools, the claim that hands a pooled sandbox to one caller, and the pools' events and costs."""

from __future__ import annotations

import builtins
import dataclasses
import time
import typing

from warmbox.models import BackendHandle, Limits, PoolEvent, SandboxInfo, State, Tenant
from warmbox.storage.registry.common import _COLUMNS, _POOL_COST_COLUMNS, GIB, _add_usage, _tenant_lock
from warmbox.storage.registry.db import Database, Store, _retried
from warmbox.storage.registry.sandboxes import START_COLUMNS, NewSandbox, sandbox_row, start_values
from warmbox.storage.sql import PG_XACT_HORIZON, Conn

if typing.TYPE_CHECKING:
    from warmbox.storage.registry.tenants import TenantStore


@dataclasses.dataclass(frozen=True)
class PoolRow:
    name: str
    target: int
    min_override: int | None
    max_override: int | None
    last_error: str
    last_error_at: float
    last_demand_at: float
    events_seen: int
    config_target: int | None


class PoolStore(Store):
    """Warm pools, the claim that hands a pooled sandbox to one caller, and the pools' events and costs."""

    def __init__(self, base: Database, tenants: TenantStore) -> None:
        super().__init__(base)
        self._tenants = tenants  # a claim checks the claimer's quotas in its own transaction

    def _pool_event(self, db: Conn, row: tuple[str, float, str, str, str]) -> None:
        """Append a pool event in the transaction ``db``. Its readers follow events by cursor: on
        SQLite by rowid (the one writer lock commits them in rowid order); on PostgreSQL by the
        transaction that wrote each (its ``xid`` column's default), up to the oldest one still
        running, so events need no cluster-wide lock (a row committed late under a lower rowid is
        still read, once)."""
        db.execute("INSERT INTO pool_events VALUES (?,?,?,?,?)", row)

    @_retried
    def claim(
        self,
        pool: str,
        shape: str,
        timeout_s: float,
        owner: str,
        tenant: Tenant | None = None,
        start: NewSandbox | None = None,
    ) -> tuple[SandboxInfo, BackendHandle] | None:
        """Atomically hand the oldest pooled sandbox of ``pool`` built to ``shape`` to one caller.

        None (and a recorded miss) if there is none. This transaction is the only way from the
        pool to a caller, so two callers can never receive the same sandbox. tenant: the caller's;
        the claim stamps it, after its quotas are checked in the same transaction (QuotaExceeded:
        the sandbox stays in the pool). start: the caller's record (metadata, lifecycle, the tier's
        choice), written with the claim (SandboxStore.allocate's ``start``).
        """
        now = time.time()
        with self._tx(*_tenant_lock(tenant)) as db:
            self._base.check_fence(db)
            # SKIP LOCKED (PostgreSQL): concurrent claims take different rows instead of queueing
            row = db.execute(
                "SELECT sandbox_id FROM sandboxes WHERE pool=? AND shape=? AND state=? AND expires_at>? AND node=? "
                "ORDER BY created_at LIMIT 1" + self._sql.for_update(skip_locked=True),
                (pool, shape, State.POOLED.value, now + 1, self.node),
            ).fetchone()
            db.execute("UPDATE pool_state SET last_demand_at=? WHERE name=?", (now, pool))
            if row is None:
                self._pool_event(db, (pool, now, "miss", "", ""))
                return None
            sid = row[0]
            if tenant is not None:
                tier, mem, cpus = db.execute(
                    "SELECT tier, memory_mb, cpus FROM sandboxes WHERE sandbox_id=?", (sid,)
                ).fetchone()
                self._tenants.check_quota_in(db, tenant, tier, mem, cpus)
            db.execute(
                # its timeout becomes the caller's (it had the pool's max_age): a resume renews that one
                # and its idle time counts from the claim (last_used), not from its warm-up
                "UPDATE sandboxes SET state=?, claimed_at=?, expires_at=?, timeout_s=?, owner=?, tenant=?, "
                "last_used=?, " + ", ".join(f"{c}=?" for c in START_COLUMNS) + " WHERE sandbox_id=?",
                (
                    State.READY.value,
                    now,
                    now + timeout_s,
                    timeout_s,
                    owner,
                    tenant.name if tenant else "",
                    now,
                    *start_values(start),
                    sid,
                ),
            )
            db.execute(
                "INSERT INTO transitions VALUES (?,?,?,?,?)",
                (sid, now, State.POOLED.value, State.READY.value, f"claimed from pool {pool}"),
            )
            # What it cost so far is the pool's: the meter, brought up to now from its last
            # reading (an idle pooled sandbox's memory is flat, its CPU ~0), becomes the
            # user's zero, and the pool is billed for it.
            m = db.execute(
                "SELECT cpu_ns, gib_s, busy_ms, commands, memory_bytes, sampled_at FROM meters WHERE sandbox_id=?",
                (sid,),
            ).fetchone()
            if m is not None:
                gib_s = m[1] + m[4] / GIB * max(0.0, now - m[5])
                # the meters row before the usage row, as sample() takes them (no lock-order cycle)
                db.execute(
                    "UPDATE meters SET base_cpu_ns=?, base_gib_s=?, base_busy_ms=?, base_commands=?, "
                    "busy_ms=0, commands=0, gib_s=?, sampled_at=? WHERE sandbox_id=?",
                    (m[0], gib_s, m[2], m[3], gib_s, now, sid),
                )
                _add_usage(db, "", now, 0.0, gib_s - m[1])  # the pool's, as a reading now would have
                created = db.execute("SELECT created_at FROM sandboxes WHERE sandbox_id=?", (sid,)).fetchone()[0]
                db.execute(
                    self._sql.upsert("pool_costs", _POOL_COST_COLUMNS, ("sandbox_id",)),
                    (pool, sid, m[0] / 1e9, gib_s, max(0.0, now - created)),
                )
            r = db.execute(f"SELECT {_COLUMNS} FROM sandboxes WHERE sandbox_id=?", (sid,)).fetchone()
            self._pool_event(db, (pool, now, "hit", sid, ""))
        return sandbox_row(r)

    @_retried
    def retire(self, pool: str, owner: str, *, keep_shape: str | None = None, limit: int | None = None) -> list[str]:
        """Atomically move pooled sandboxes of ``pool`` to ``retiring`` (never connectable again).

        keep_shape: only those built to another shape (stale after a config change).
        limit: at most this many, oldest first. Returns their ids; the caller destroys them.
        """
        now = time.time()
        probe = "SELECT 1 FROM sandboxes WHERE pool=? AND state=? AND node=?" + (
            " AND shape<>?" if keep_shape is not None else ""
        )
        if (
            self._db.execute(
                probe, (pool, State.POOLED.value, self.node, *(() if keep_shape is None else (keep_shape,)))
            ).fetchone()
            is None
        ):
            return []  # the common case, without a write transaction
        with self._tx() as db:
            q = "SELECT sandbox_id FROM sandboxes WHERE pool=? AND state=? AND node=?"
            args: list = [pool, State.POOLED.value, self.node]
            if keep_shape is not None:
                q += " AND shape<>?"
                args.append(keep_shape)
            q += " ORDER BY created_at"
            if limit is not None:
                q += " LIMIT ?"
                args.append(limit)
            # SKIP LOCKED (PostgreSQL): a row a claim holds right now is not retired (it is leaving)
            ids = [r[0] for r in db.execute(q + self._sql.for_update(skip_locked=True), args).fetchall()]
            for sid in ids:
                db.execute(
                    "UPDATE sandboxes SET state=?, owner=? WHERE sandbox_id=?", (State.RETIRING.value, owner, sid)
                )
                db.execute(
                    "INSERT INTO transitions VALUES (?,?,?,?,?)",
                    (sid, now, State.POOLED.value, State.RETIRING.value, f"retired from pool {pool}"),
                )
            for sid in ids:
                self._pool_event(db, (pool, now, "retired", sid, ""))
        return ids

    def pool_rows(self) -> dict[str, PoolRow]:
        rows = self._db.execute(
            "SELECT name, target, min_override, max_override, last_error, last_error_at, "
            "last_demand_at, events_seen, config_target FROM pool_state"
        ).fetchall()
        return {r[0]: PoolRow(*r) for r in rows}

    @_retried
    def ensure_pool(self, name: str, target: int) -> None:
        """Create the pool's row, or reset its target when the configured target changed."""
        with self._tx() as db:
            db.execute(
                self._sql.upsert("pool_state", ("name", "target", "last_demand_at", "config_target"), ("name",), ()),
                (name, target, time.time(), target),
            )
            db.execute(
                "UPDATE pool_state SET target=?, config_target=? WHERE name=? AND "
                "(config_target IS NULL OR config_target<>?)",
                (target, target, name, target),
            )

    @_retried
    def set_pool(
        self,
        name: str,
        *,
        target: int | None = None,
        min_override: int | bool | None = False,
        max_override: int | bool | None = False,
        error: str | None = None,
        kind: str = "",
        detail: str = "",
        demand: bool = False,
    ) -> None:
        """Update a pool's row (False = leave that override unchanged) and log an event if ``kind``;
        demand: count it as demand (an idle period starts now)."""
        now = time.time()
        with self._tx() as db:
            db.execute(
                self._sql.upsert("pool_state", ("name", "target", "last_demand_at"), ("name",), ()),
                (name, target or 0, now),
            )
            if target is not None:
                db.execute("UPDATE pool_state SET target=? WHERE name=?", (target, name))
            if min_override is not False:
                db.execute("UPDATE pool_state SET min_override=? WHERE name=?", (min_override, name))
            if max_override is not False:
                db.execute("UPDATE pool_state SET max_override=? WHERE name=?", (max_override, name))
            if error is not None:
                db.execute("UPDATE pool_state SET last_error=?, last_error_at=? WHERE name=?", (error, now, name))
            if demand:
                db.execute("UPDATE pool_state SET last_demand_at=? WHERE name=?", (now, name))
            if kind:
                self._pool_event(db, (name, now, kind, "", detail))

    @_retried
    def scale(self, name: str, seen: tuple[int, int], to: tuple[int, int], demand_at: float) -> bool:
        """Move a pool's (target, events seen) from ``seen`` to ``to`` and its idle clock to
        ``demand_at``, only if the row still holds ``seen``: False when another node (or an
        operator's resize) moved it first, so every miss is counted once and a resize stands."""
        with self._tx() as db:
            return bool(
                db.execute(
                    "UPDATE pool_state SET target=?, events_seen=?, last_demand_at=? "
                    "WHERE name=? AND target=? AND events_seen=?",
                    (to[0], to[1], demand_at, name, seen[0], seen[1]),
                ).rowcount
            )

    @_retried
    def pool_event(self, pool: str, kind: str, sandbox_id: str = "", detail: str = "") -> None:
        with self._tx() as db:
            self._pool_event(db, (pool, time.time(), kind, sandbox_id, detail))

    def pool_events(self, pool: str, since: float = 0.0) -> builtins.list[PoolEvent]:
        rows = self._db.execute(
            "SELECT pool, at, kind, sandbox_id, detail FROM pool_events WHERE pool=? AND at>=? ORDER BY rowid",
            (pool, since),
        ).fetchall()
        return [PoolEvent(*r) for r in rows]

    def pool_first_event(self, pool: str) -> float | None:
        """When the pool's first recorded event happened (unix s; None: none yet): where its charts start."""
        row = self._read("SELECT MIN(at) FROM pool_events WHERE pool=?", (pool,))  # index pool_events(pool, at)
        return None if row is None or row[0] is None else float(row[0])

    def unseen_misses(self, pool: str, seen: int) -> tuple[int, int]:
        """(misses recorded past the cursor ``seen``, the new cursor) — for the autoscaler. The
        cursor: SQLite, the newest event's rowid; PostgreSQL, the oldest transaction still running
        (every event of a transaction below it is committed or never will be)."""
        if self.shared:
            count, horizon = self._db.execute(
                f"SELECT (SELECT COUNT(*) FROM pool_events WHERE pool=? AND kind='miss' AND xid>=? AND xid<h.x), "
                f"h.x FROM (SELECT {PG_XACT_HORIZON} AS x) h",
                (pool, seen),
            ).fetchone()
            return count, max(horizon, seen)
        row = self._db.execute(
            "SELECT COUNT(*), MAX(rowid) FROM pool_events WHERE pool=? AND rowid>? AND kind='miss'", (pool, seen)
        ).fetchone()
        newest = self._db.execute("SELECT COALESCE(MAX(rowid), 0) FROM pool_events").fetchone()[0]
        return row[0], max(newest, seen)

    @_retried
    def set_events_seen(self, pool: str, seen: int) -> None:
        with self._tx() as db:
            db.execute("UPDATE pool_state SET events_seen=? WHERE name=?", (seen, pool))

    def pool_counts(self, pool: str, shape: str | None = None) -> tuple[int, int]:
        """This node's (pooled, of ``shape`` if given, and not expiring within a second; being created)."""
        now = time.time()
        q = "SELECT COUNT(*) FROM sandboxes WHERE pool=? AND state=? AND expires_at>? AND node=?"
        args: list = [pool, State.POOLED.value, now + 1, self.node]
        if shape is not None:
            q += " AND shape=?"
            args.append(shape)
        ready = self._db.execute(q, args).fetchone()[0]
        warming = self._db.execute(
            "SELECT COUNT(*) FROM sandboxes WHERE pool=? AND state=? AND node=?",
            (pool, State.CREATING.value, self.node),
        ).fetchone()[0]
        return ready, warming

    def pooled(self, pool: str) -> builtins.list[str]:
        rows = self._db.execute(
            "SELECT sandbox_id FROM sandboxes WHERE pool=? AND state=? AND node=? ORDER BY created_at",
            (pool, State.POOLED.value, self.node),
        ).fetchall()
        return [r[0] for r in rows]

    def pool_shapes(self) -> builtins.list[tuple[str, str, str, Limits]]:
        """(pool, tier, template, limits) of each pool some node holds a ready sandbox of: what a
        cluster's router knows of the nodes' pools (it has no ``[pools]`` of its own)."""
        rows = self._read(
            "SELECT DISTINCT pool, tier, template, memory_mb, cpus, pids, file_size_mb, open_files, tmp_mb, disk_mb "
            "FROM sandboxes WHERE state=? AND pool<>''",
            (State.POOLED.value,),
            many=True,
        )
        return [
            (r[0], r[1], r[2], Limits(int(r[3]), float(r[4]), int(r[5]), int(r[6]), int(r[7]), int(r[8]), int(r[9])))
            for r in rows
        ]

    def pool_totals(self, pool: str) -> tuple[int, int, int, float, float, float]:
        """(hits, misses, warm-up failures, cpu_s, GiB-s, wall_s) of a pool so far."""
        counts = dict(
            self._db.execute("SELECT kind, COUNT(*) FROM pool_events WHERE pool=? GROUP BY kind", (pool,)).fetchall()
        )
        cost = self._db.execute(
            "SELECT COALESCE(SUM(cpu_s),0), COALESCE(SUM(gib_s),0), COALESCE(SUM(wall_s),0) "
            "FROM pool_costs WHERE pool=?",
            (pool,),
        ).fetchone()
        hits = counts.get("hit", 0) - counts.get("claim_failed", 0)  # a failed claim check took the next one
        return (hits, counts.get("miss", 0), counts.get("warmup_failed", 0), *cost)
