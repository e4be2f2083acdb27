"""The registry's database layer: its connections, write transactions and their retries, the host uid
ledger's claims and the node's fence (the SQL dialect seam is storage/sql.py)."""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import random
import re
import sqlite3
import threading
import time
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

from warmbox.config import ClusterSettings
from warmbox.errors import NoCapacity, NodeFenced, RegistryBusy, RegistryError, RegistrySchemaError
from warmbox.models import Limits
from warmbox.storage.registry.common import _HOLDING, _SPARE, _in
from warmbox.storage.registry.schema import _ADDED_COLUMNS, _NET_LINK_COLUMNS, SCHEMA, SCHEMA_VERSION, schema_statements
from warmbox.storage.sql import DEFAULT_BOUNDS, Bounds, Conn, PostgresDialect, SqliteDialect, dialect_for, is_url
from warmbox.storage.uidslots import UidLedger, registry_holds, row_holds

_F = typing.TypeVar("_F", bound=Callable[..., typing.Any])
_retrying = threading.local()  # .active: this thread is inside a retried write (inner writes do not retry)


def _retried(method: _F) -> _F:
    """A registry write whose transaction timed out (RegistryBusy: a lock or statement past its
    bound, the transaction rolled back, nothing of it written) runs again after a growing, jittered
    pause, until the registry's retry budget; then the last RegistryBusy, saying how long it waited.
    Each method so marked writes in exactly one transaction (running it again repeats nothing)."""

    @functools.wraps(method)
    def run(self: Store, *args: typing.Any, **kwargs: typing.Any) -> typing.Any:
        if getattr(_retrying, "active", False):
            return method(self, *args, **kwargs)
        _retrying.active = True
        try:
            start = time.monotonic()
            pause, tries = 0.05, 0
            while True:
                tries += 1
                try:
                    return method(self, *args, **kwargs)
                except RegistryBusy as e:
                    waited = time.monotonic() - start
                    if waited + pause > self.bounds.retry_budget_s:
                        raise RegistryBusy(
                            f"{e} (tried {tries} times in {waited:.1f} s; nothing was changed: retry later)",
                            waited_s=waited,
                        ) from None
                    time.sleep(pause * (0.5 + random.random()))
                    pause = min(pause * 2, 1.0)
        finally:
            _retrying.active = False

    return typing.cast(_F, run)


PG_KEY_PREFIX = "pg:"


def redacted(url: str) -> str:
    """A PostgreSQL URL as an error may show it: no password."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


def bounds_of(cluster: ClusterSettings) -> Bounds:
    """The registry's waits as ``[cluster]`` sets them (SQLite keeps its own busy timeout)."""
    return Bounds(
        lock_s=cluster.lock_timeout,
        statement_s=cluster.statement_timeout,
        idle_s=cluster.idle_timeout,
        retry_budget_s=cluster.retry_budget,
    )


def schema_version(location: Path | str) -> int | None:
    """A registry's schema version without opening (or migrating) it; None: no registry there yet."""
    if is_url(location):
        d = PostgresDialect(str(location))
        try:
            return d.schema_version()
        finally:
            d.close()
    path = Path(location)
    if not path.exists():
        return None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            return int(db.execute("PRAGMA user_version").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error as e:
        raise RegistryError(f"cannot read the registry at {path}: {e}") from None


def migrate(location: Path | str) -> tuple[int, int]:
    """Bring a registry's schema to this warmbox's (``warmbox db migrate``): (version before, after).
    PostgreSQL: one transaction under an advisory lock (nodes starting together migrate once);
    SQLite migrates itself at every open already."""
    if is_url(location):
        d = PostgresDialect(str(location))
        try:
            return d.migrate(schema_statements(), SCHEMA_VERSION, now=time.time())
        finally:
            d.close()
    path = Path(location)
    before = schema_version(path) or 0
    Database(path).close()  # a SQLite registry migrates itself at its open
    return before, SCHEMA_VERSION


class Database:
    """The registry's connection and write transactions, shared by its stores (Registry's
    arguments; see there). It owns what every store's writes rest on: the reader connection,
    the dialect, the retry bounds, the host uid ledger and this node's fence (its epoch and
    slots, set by NodeStore.join_node)."""

    def __init__(
        self,
        location: Path | str,
        node: str = "",
        *,
        ledger: UidLedger | None = None,
        check_limits: Callable[[Limits], None] | None = None,
        bounds: Bounds = DEFAULT_BOUNDS,
    ) -> None:
        url = is_url(location)
        self.bounds = bounds
        self.location = location  # what it was opened with (RegistryStats opens its own connection there)
        # the file (None for PostgreSQL: there is no file, and its URL may hold a password)
        self.path: Path | None = None if url else Path(location)
        self.node = node
        self.epoch: int | None = None  # this node's, from this object's join_node (None: not joined here)
        self.slots = 0  # the sandboxes this node offers, from this object's join_node (0: no bound here)
        self.ledger = ledger if ledger is not None else UidLedger()
        self.check_limits = check_limits
        self._adopted = False
        self._lease: int | None = None  # this PostgreSQL registry's lease in the uid ledger (an fd)
        where = redacted(str(location)) if url else str(location)
        try:
            self._sql = dialect_for(location, bounds)
            self.errors: tuple[type[Exception], ...] = self._sql.errors
            self.conn: Conn = self._sql.reader()
            self._migrate()
        except (sqlite3.Error, OSError) as e:
            raise RegistryError(f"cannot open the registry at {where}: {e}") from None
        except RegistryError as e:
            if isinstance(e, RegistrySchemaError):
                raise
            raise RegistryError(f"cannot open the registry at {where}: {e}") from None
        self._cluster = ""
        if self.path is not None:
            self._key = str(self.path.resolve())  # how the ledger names this registry
        else:
            # never the URL: the cluster's own id (made by its first migration) and this node
            row = self.read("SELECT value FROM meta_text WHERE key=?", ("cluster_id",))
            self._cluster = row[0] if row else ""
            self._key = f"{PG_KEY_PREFIX}{self._cluster}/{node}"
        retried: tuple[type[BaseException], ...] = (*self.errors, OSError, RegistryError)
        try:
            self._adopt()
        except retried:
            pass  # retried at the first allocate

    @property
    def key(self) -> str:
        """How the host's uid ledger and layer pins name this registry: its file's resolved path,
        or ``pg:<cluster id>/<node>`` for a PostgreSQL one (never its URL)."""
        return self._key

    @property
    def shared(self) -> bool:
        """Whether the registry is a PostgreSQL database (shared by a cluster's nodes)."""
        return isinstance(self._sql, PostgresDialect)

    @property
    def dialect(self) -> SqliteDialect | PostgresDialect:
        assert isinstance(self._sql, (SqliteDialect, PostgresDialect))
        return self._sql

    def _adopt(self) -> None:
        """Record in the host ledger the slots this home's sandboxes from before it hold."""
        rows = self.conn.execute(
            f"SELECT sandbox_id, uid_slot FROM sandboxes WHERE state IN {_in(_HOLDING)} AND node=?",
            (*_HOLDING, self.node),
        ).fetchall()
        if any(self.ledger.holder(slot) is None for _, slot in rows):
            with self.ledger.locked() as ledger:
                for sid, slot in rows:
                    row = self.conn.execute(
                        "SELECT state, uid_slot, state_dir FROM sandboxes WHERE sandbox_id=?", (sid,)
                    ).fetchone()
                    if row_holds(row, slot):  # still (a destroy may have released it meanwhile)
                        ledger.adopt(slot, self._key, sid, row[2])
        self._adopted = True

    def holds(self, registry: str, sandbox_id: str, slot: int, db: Conn | None = None) -> bool | None:
        """Whether the registry ``registry`` (a ledger key) still counts ``slot`` as held by
        ``sandbox_id``; db: the caller's transaction, if any. Another node of this cluster (same
        host, same ledger) is answered from this same shared database."""
        if registry != self._key and not (self._cluster and registry.startswith(f"{PG_KEY_PREFIX}{self._cluster}/")):
            return registry_holds(registry, sandbox_id, slot)
        row = (
            (db or self.conn)
            .execute("SELECT state, uid_slot, state_dir FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
            .fetchone()
        )
        return row_holds(row, slot)

    def _migrate(self) -> None:
        if isinstance(self._sql, PostgresDialect):
            self._sql.check_schema(schema_statements(), SCHEMA_VERSION, now=time.time())
            return
        assert isinstance(self._sql, SqliteDialect)
        db = self._sql.conn
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version >= SCHEMA_VERSION:
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            for stmt in _ADDED_COLUMNS:  # "ALTER TABLE t ADD COLUMN c ..."
                table, column = stmt.split()[2], stmt.split()[5]
                cols = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                if cols and column not in cols:
                    db.execute(stmt)
            for table, column, ddl in (
                ("pool_state", "events_seen", "INTEGER NOT NULL DEFAULT 0"),
                ("pool_state", "config_target", "INTEGER"),
            ):
                cols = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                if cols and column not in cols:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {ddl}")
            link_cols = {r[1] for r in db.execute("PRAGMA table_info(net_links)")}
            if link_cols and "node" not in link_cols:  # version 15: address unique per node, not globally
                db.execute("ALTER TABLE net_links RENAME TO net_links_old")
            for stmt in SCHEMA.split(";"):
                if stmt.strip():
                    db.execute(stmt)
            if link_cols and "node" not in link_cols:
                db.execute(
                    f"INSERT INTO net_links ({_NET_LINK_COLUMNS}) "
                    "SELECT sandbox_id, address, ifname, policy, updated_at, '' FROM net_links_old"
                )
                db.execute("DROP TABLE net_links_old")
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._sql.close()
        lease, self._lease = self._lease, None
        if lease is not None:
            os.close(lease)

    def read(self, sql: str, args: tuple = (), *, many: bool = False) -> typing.Any:
        try:
            cur = self.conn.execute(sql, args)
            return cur.fetchall() if many else cur.fetchone()
        except self.errors as e:
            raise RegistryError(f"registry read failed: {e}") from None

    def tx(self, *locks: str) -> contextlib.AbstractContextManager[Conn]:
        """A write transaction; ``locks``: names of advisory locks it holds (PostgreSQL; SQLite's
        BEGIN IMMEDIATE already serializes every writer): "tenant:<name>" around a quota's check
        and the write it allows."""
        return self._sql.transaction(locks)

    @contextlib.contextmanager
    def claiming(self, *locks: str) -> Iterator[tuple[UidLedger, Conn]]:
        """The host-wide uid ledger's lock and a transaction for claiming a slot: the lock is held
        until the row is committed (whoever looks at the slot to reclaim it then sees the sandbox
        holding it); a ledger or database failure is a RegistryError."""
        try:
            if not self._adopted:
                self._adopt()
            with self.ledger.locked() as ledger, self.tx(*locks) as db:
                if self._lease is None and self.shared:  # held to close(): no claim of ours is judged gone
                    self._lease = ledger.lease(self._key)
                self.check_fence(db)
                yield ledger, db
        except OSError as e:
            raise RegistryError(f"cannot claim a uid range in {self.ledger.dir}: {e}") from None
        except self.errors as e:
            raise RegistryError(f"registry error: {e}") from None

    def check_fence(self, db: Conn) -> None:
        """NodeFenced if this node may start no sandbox: its row says down, or another process
        joined under its name since this object's join_node. Read in the transaction that would
        write the sandbox (PostgreSQL: a share lock, so mark_node_down waits for it and then
        sees the row it wrote). One host (node ""), or a node that never joined: nothing to check."""
        if not self.node:
            return
        row = db.execute(
            "SELECT state, epoch FROM nodes WHERE name=?" + (" FOR SHARE" if self.shared else ""), (self.node,)
        ).fetchone()
        if row is None:
            return
        if row[0] == "down" or (self.epoch is not None and row[1] != self.epoch):
            why = "marked down" if row[0] == "down" else f"joined again (epoch {row[1]}, this process has {self.epoch})"
            raise NodeFenced(f"node {self.node!r} was {why}: it starts no sandbox", self.node)

    def check_slots(self, states: builtins.list[str], spare: bool) -> None:
        """NoCapacity if this node has no slot for one more sandbox (its own bound, whoever placed
        the create: the router, or a caller with direct access). ``states``: those of the sandboxes
        holding a uid range here. A warm spare (``spare``) counts every one of them; a user's
        sandbox (a create or a resume) counts all but the pool's spares: the pool shrinks to make
        room, as the router's placement assumes. One host, or a node that never joined: no bound."""
        if not self.node or self.slots <= 0:
            return
        held = len(states) if spare else sum(1 for s in states if s not in _SPARE)
        if held >= self.slots:
            what = "sandboxes" if spare else "sandboxes besides its warm spares"
            raise NoCapacity(
                f"node {self.node!r} has no free slot: {held} {what} hold its {self.slots} (nothing was created)",
                (f"{self.node}: {held} of {self.slots} slots taken",),
            )


class Store:
    """One data area of the registry over the shared Database: a store reads with ``_read`` and
    ``_db`` and writes in ``_tx`` (``_retried`` retries a write that timed out), as the node
    ``node``. Writes that span stores run in one transaction: the caller hands its ``db`` to the
    peer's ``..._in(db, ...)`` method."""

    def __init__(self, base: Database) -> None:
        self._base = base

    @property
    def node(self) -> str:
        return self._base.node

    @property
    def bounds(self) -> Bounds:
        return self._base.bounds

    @property
    def ledger(self) -> UidLedger:
        return self._base.ledger

    @property
    def check_limits(self) -> Callable[[Limits], None] | None:
        return self._base.check_limits

    @property
    def shared(self) -> bool:
        return self._base.shared

    @property
    def _db(self) -> Conn:
        return self._base.conn

    @property
    def _sql(self) -> SqliteDialect | PostgresDialect:
        return self._base.dialect

    @property
    def _errors(self) -> tuple[type[Exception], ...]:
        return self._base.errors

    @property
    def _key(self) -> str:
        return self._base.key

    def _read(self, sql: str, args: tuple = (), *, many: bool = False) -> typing.Any:
        return self._base.read(sql, args, many=many)

    def _tx(self, *locks: str) -> contextlib.AbstractContextManager[Conn]:
        return self._base.tx(*locks)
