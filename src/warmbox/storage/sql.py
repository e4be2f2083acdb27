"""The registry's SQL seam: one Registry writes its statements once (``?`` placeholders), and a
Dialect carries what differs between SQLite (embedded, one host) and PostgreSQL (shared by the
nodes of a cluster): connecting, transactions and their locks, upserts, DDL types, schema version.

Transactions. SQLite: ``BEGIN IMMEDIATE`` on the one shared connection (a database-wide writer
lock: every write transaction is serialized). PostgreSQL: READ COMMITTED on a pooled connection,
so the invariants the global lock gave are taken explicitly: ``for_update()`` row locks (a state
check and its update; ``SKIP LOCKED`` for pool claims) and advisory transaction locks named by
the caller (``transaction("tenant:acme")``: a quota's count and its insert; two clients
counting at once would both pass a quota of 3 and reach 6). Locks are taken in sorted order at
the start of the transaction, before any row lock.

Every wait is bounded (Bounds): PostgreSQL's lock_timeout, statement_timeout and
idle_in_transaction_session_timeout are set on every connection (the last ends the session of a
node stopped or gone mid-transaction, so the locks it held go); SQLite's busy timeout. A wait past
its bound is RegistryBusy (the transaction rolled back: the registry retries it, storage/registry/db.py).

Foreign errors (sqlite3.Error, psycopg.Error) become RegistryError at the transaction boundary
and (PostgreSQL) at each read; PostgreSQL's SUM of an integer column (numeric) reads as an int,
as SQLite's does, not a Decimal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from warmbox.errors import RegistryBusy, RegistryError, RegistrySchemaError

PG_SCHEMES = ("postgresql://", "postgres://")
# tables whose readers order by SQLite's implicit rowid: PostgreSQL gets a real column of that name
ROWID_TABLES = ("transitions", "timings", "pool_events", "sandbox_volumes")
MIGRATE_COMMAND = "warmbox db migrate"
# version 18: each pool event records the transaction that wrote it (PostgreSQL): readers follow
# events up to the oldest transaction still running (storage/registry/pools.py, engine/stats.py), so
# inserting one takes no cluster-wide lock
POOL_EVENT_XID_VERSION = 18
# the id of the current transaction (assigned if it has none), and the horizon: every transaction
# below it has ended, so no event below it can still appear
PG_XACT_ID = "pg_current_xact_id()::text::bigint"
PG_XACT_HORIZON = "pg_snapshot_xmin(pg_current_snapshot())::text::bigint"
MIGRATE_BOUND_S = 600  # a migration's own lock wait and statements (DDL on big tables): ten minutes


@dataclasses.dataclass(frozen=True)
class Bounds:
    """How long a registry waits (seconds, wall clock; ``[cluster]`` settings, docs/cluster.md).
    lock_s: for a lock (PostgreSQL lock_timeout); statement_s: for one statement
    (statement_timeout); idle_s: a transaction open between statements before the server ends its
    session (idle_in_transaction_session_timeout); sqlite_busy_s: SQLite's busy timeout (the
    database-wide writer lock); retry_budget_s: how long a write that timed out is retried."""

    lock_s: float = 5.0
    statement_s: float = 30.0
    idle_s: float = 10.0
    sqlite_busy_s: float = 30.0
    retry_budget_s: float = 30.0

    def pg_options(self) -> str:
        """The libpq ``options`` that set them on a PostgreSQL session (milliseconds)."""
        return " ".join(
            f"-c {name}={max(1, round(s * 1000))}"
            for name, s in (
                ("lock_timeout", self.lock_s),
                ("statement_timeout", self.statement_s),
                ("idle_in_transaction_session_timeout", self.idle_s),
            )
        )


DEFAULT_BOUNDS = Bounds()


def is_url(location: str | Path) -> bool:
    """Whether a registry location is a PostgreSQL URL (else: a SQLite file path)."""
    return isinstance(location, str) and location.startswith(PG_SCHEMES)


class Cursor(Protocol):
    rowcount: int

    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class Conn(Protocol):
    """What the registry's code calls: a sqlite3.Connection, or a PostgreSQL one behind a shim."""

    def execute(self, sql: str, parameters: Any = (), /) -> Any: ...
    def executemany(self, sql: str, seq_of_parameters: Iterable[Any], /) -> Any: ...


class Dialect:
    """The base: what a registry needs from its database (see the two below)."""

    name = ""
    errors: tuple[type[Exception], ...] = ()
    greatest = "MAX"  # the scalar maximum of two values: SQLite MAX(a, b), PostgreSQL GREATEST(a, b)
    cross_join = "CROSS JOIN"  # a join whose order the planner keeps (SQLite); PostgreSQL: plain JOIN

    def reader(self) -> Conn:
        """The connection for reads outside a transaction."""
        raise NotImplementedError

    def transaction(self, locks: Sequence[str] = ()) -> contextlib.AbstractContextManager[Conn]:
        """A write transaction; ``locks``: advisory lock names held until it ends (PostgreSQL)."""
        raise NotImplementedError

    def for_update(self, *, skip_locked: bool = False) -> str:
        """The suffix of a SELECT that locks the rows it returns until the transaction ends."""
        return ""

    def upsert(self, table: str, cols: Sequence[str], key: Sequence[str], update: Sequence[str] | None = None) -> str:
        """INSERT of ``cols`` into ``table`` that, on a conflict on ``key``, replaces the row (update
        None: SQLite's INSERT OR REPLACE; PostgreSQL updates the other columns) or (update=()) keeps
        the old row (INSERT OR IGNORE)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SqliteDialect(Dialect):
    """One file, one connection shared by the threads of this process (``check_same_thread=False``)."""

    name = "sqlite"
    errors = (sqlite3.Error,)

    def __init__(self, path: Path, bounds: Bounds = DEFAULT_BOUNDS) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(
            str(path), timeout=bounds.sqlite_busy_s, isolation_level=None, check_same_thread=False
        )
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")

    def reader(self) -> Conn:
        return self.conn

    def transaction(self, locks: Sequence[str] = ()) -> contextlib.AbstractContextManager[Conn]:
        return _SqliteTx(self.conn)  # BEGIN IMMEDIATE is already the one writer lock: ``locks`` add nothing

    def upsert(self, table: str, cols: Sequence[str], key: Sequence[str], update: Sequence[str] | None = None) -> str:
        verb = "INSERT OR IGNORE" if update is not None and not update else "INSERT OR REPLACE"
        return f"{verb} INTO {table} ({', '.join(cols)}) VALUES ({','.join('?' * len(cols))})"

    def close(self) -> None:
        self.conn.close()


class _SqliteTx:
    """BEGIN IMMEDIATE ... COMMIT, translating sqlite errors at this one boundary."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise _sqlite_error("registry unavailable", e) from None
        return self.db

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
            except sqlite3.Error as e:
                raise _sqlite_error("registry commit failed", e) from None
        else:
            self.db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise _sqlite_error("registry error", exc) from None


def _sqlite_error(what: str, e: sqlite3.Error) -> RegistryError:
    """RegistryBusy for SQLite's busy timeout (another writer held the database past it), else RegistryError."""
    if getattr(e, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return RegistryBusy(f"{what}: the registry's writer lock was held past its busy timeout ({e})")
    return RegistryError(f"{what}: {e}")


# ---- PostgreSQL


@functools.lru_cache(maxsize=4096)
def pg_sql(sql: str) -> str:
    """A statement written for SQLite's paramstyle in psycopg's: ``?`` -> ``%s``, ``%`` -> ``%%``.
    (The registry's SQL has no ``?`` inside a string literal.)"""
    return sql.replace("%", "%%").replace("?", "%s")


_DDL_TYPES = (
    (re.compile(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b"), "BIGSERIAL PRIMARY KEY"),
    (re.compile(r"\bINTEGER\b"), "BIGINT"),  # SQLite's INTEGER is 64-bit (cpu_ns, bytes), int4 is not
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),  # float4 would lose seconds off unix timestamps
)


def pg_ddl(ddl: str) -> str:
    """A SQLite DDL statement in PostgreSQL's types (ADD COLUMN made idempotent)."""
    for pattern, repl in _DDL_TYPES:
        ddl = pattern.sub(repl, ddl)
    ddl = re.sub(r"^\s*ALTER TABLE (\w+) ADD COLUMN ", r"ALTER TABLE IF EXISTS \1 ADD COLUMN IF NOT EXISTS ", ddl)
    return ddl


def _clean(v: object) -> object:
    """A parameter as PostgreSQL takes what SQLite took: bools as 0/1 (the schema has no boolean
    columns), text without NUL bytes or lone surrogates (replaced by U+FFFD, as a guest's bytes
    could carry them: one refused row would fail its whole batch)."""
    if type(v) is str:
        if v.isascii():
            return v.replace("\x00", "\ufffd") if "\x00" in v else v
        try:
            v.encode()
        except UnicodeEncodeError:  # lone surrogates (the only str UTF-8 cannot encode)
            v = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in v)
        return v.replace("\x00", "\ufffd") if "\x00" in v else v
    if type(v) is bool:
        return int(v)
    return v


def _args(args: Any) -> Any:
    if isinstance(args, dict):
        return {k: _clean(v) for k, v in args.items()}
    return tuple(_clean(v) for v in args)


class _Rows:
    """A read's result, fetched whole (its connection is back in the pool already)."""

    def __init__(self, rows: list[tuple[Any, ...]], rowcount: int) -> None:
        self.rows = rows
        self.rowcount = rowcount

    def fetchone(self) -> Any:
        return self.rows[0] if self.rows else None

    def fetchall(self) -> list[Any]:
        return self.rows

    def __iter__(self) -> Iterator[Any]:
        return iter(self.rows)


class _PgTxConn:
    """A pooled connection inside a transaction, speaking the registry's paramstyle."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def execute(self, sql: str, parameters: Any = (), /) -> Any:
        return self.conn.execute(pg_sql(sql), _args(parameters))

    def executemany(self, sql: str, seq_of_parameters: Iterable[Any], /) -> Any:
        with self.conn.cursor() as cur:
            cur.executemany(pg_sql(sql), [_args(a) for a in seq_of_parameters])


class _PgReader:
    """Reads outside a transaction: each on a pooled connection in autocommit (it sees every
    committed write), its rows fetched whole, a failure a RegistryError."""

    def __init__(self, dialect: PostgresDialect) -> None:
        self.dialect = dialect

    def execute(self, sql: str, parameters: Any = (), /) -> _Rows:
        import psycopg

        try:
            with self.dialect.connection() as c:
                cur = c.execute(pg_sql(sql), _args(parameters))
                return _Rows(cur.fetchall() if cur.description else [], cur.rowcount)
        except psycopg.Error as e:
            raise _pg_error("registry read failed", e) from None

    def executemany(self, sql: str, seq_of_parameters: Iterable[Any], /) -> None:
        raise RegistryError("a write outside a transaction")  # the registry writes only in transactions


def _pg_message(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# SQLSTATEs after which PostgreSQL has rolled the transaction back, so running it again is safe:
# lock_not_available (lock_timeout), query_canceled (statement_timeout), deadlock_detected,
# serialization_failure, idle_in_transaction_session_timeout (this session's transaction was ended)
_RETRIABLE = ("55P03", "57014", "40P01", "40001", "25P03")


def _pg_error(what: str, e: Exception) -> RegistryError:
    """RegistryBusy for a wait past its bound (or a deadlock), else RegistryError."""
    if getattr(e, "sqlstate", None) in _RETRIABLE:
        return RegistryBusy(f"{what}: {_pg_message(e)}")
    return RegistryError(f"{what}: {_pg_message(e)}")


def numeric_loader() -> type:
    """numeric (a SUM of bigint) as SQLite gives it: an int when whole, else a float (not Decimal)."""
    from decimal import Decimal

    from psycopg.adapt import Loader

    class _Number(Loader):
        def load(self, data: Any) -> int | float:
            d = Decimal(bytes(data).decode())
            if d.is_finite() and d == d.to_integral_value():
                return int(d)
            return float(d)

    return _Number


class PostgresDialect(Dialect):
    """A PostgreSQL registry: connections in a small pool (the registry is called from threads:
    asyncio.to_thread), opened on demand, at most ``idle_max`` kept idle."""

    name = "postgresql"
    greatest = "GREATEST"
    cross_join = "JOIN"

    def __init__(
        self, url: str, *, idle_max: int = 4, connect_timeout_s: int = 10, bounds: Bounds = DEFAULT_BOUNDS
    ) -> None:
        try:
            import psycopg
        except ImportError:
            raise RegistryError("a PostgreSQL registry needs psycopg: pip install 'warmbox[cluster]'") from None
        self.url = url
        self.errors = (psycopg.Error,)
        self.idle_max = idle_max
        self.connect_timeout_s = connect_timeout_s
        self.bounds = bounds
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._loader = numeric_loader()
        self._reader = _PgReader(self)
        self._closed = False

    def _connect(self, bounds: Bounds | None = None) -> Any:
        import psycopg

        c = psycopg.connect(
            self.url,
            autocommit=True,
            connect_timeout=self.connect_timeout_s,
            application_name="warmbox",
            options=(bounds or self.bounds).pg_options(),
        )
        c.adapters.register_loader("numeric", self._loader)
        return c

    @contextlib.contextmanager
    def connection(self) -> Iterator[Any]:
        """A pooled connection (autocommit; idle when handed back, else closed)."""
        from psycopg import pq

        with self._lock:
            c = self._idle.pop() if self._idle else None
        if c is None or c.closed or c.broken:
            c = self._connect()
        try:
            yield c
        finally:
            if c.closed or c.broken or c.info.transaction_status != pq.TransactionStatus.IDLE:
                c.close()
            else:
                with self._lock:
                    keep = not self._closed and len(self._idle) < self.idle_max
                    if keep:
                        self._idle.append(c)
                if not keep:
                    c.close()

    def reader(self) -> Conn:
        return self._reader

    @contextlib.contextmanager
    def transaction(self, locks: Sequence[str] = ()) -> Iterator[Conn]:
        import psycopg

        try:
            with self.connection() as c, c.transaction():
                for name in sorted(set(locks)):
                    c.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (name,))
                yield _PgTxConn(c)
        except psycopg.Error as e:
            raise _pg_error("registry error", e) from None

    def for_update(self, *, skip_locked: bool = False) -> str:
        return " FOR UPDATE SKIP LOCKED" if skip_locked else " FOR UPDATE"

    def upsert(self, table: str, cols: Sequence[str], key: Sequence[str], update: Sequence[str] | None = None) -> str:
        head = f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({','.join('?' * len(cols))}) ON CONFLICT "
        if update is not None and not update:
            return head + "DO NOTHING"
        sets = [c for c in cols if c not in key] if update is None else list(update)
        return head + f"({', '.join(key)}) DO UPDATE SET " + ", ".join(f"{c}=excluded.{c}" for c in sets)

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for c in idle:
            c.close()

    # ---- the schema: a schema_version table; changed only by migrate(), under a session lock

    def schema_version(self) -> int | None:
        """The registry's schema version; None for an empty database (no registry tables yet)."""
        rows = self._reader.execute(
            "SELECT to_regclass('schema_version') IS NOT NULL, to_regclass('sandboxes') IS NOT NULL"
        ).fetchone()
        if not rows[0]:
            return 0 if rows[1] else None
        v = self._reader.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0]
        return int(v)

    def migrate(self, statements: Sequence[str], version: int, *, now: float) -> tuple[int, int]:
        """Bring the schema to ``version`` (``statements``: idempotent SQLite DDL, in order: added
        columns, then the tables; made PostgreSQL's here) in one transaction, under an advisory
        session lock: nodes starting together migrate once. Returns (version before, after);
        RegistrySchemaError if the database is newer than ``version``."""
        import psycopg

        long = Bounds(lock_s=MIGRATE_BOUND_S, statement_s=MIGRATE_BOUND_S, idle_s=MIGRATE_BOUND_S)
        try:
            with contextlib.closing(self._connect(long)) as c:  # its own bounds; never pooled
                c.execute("SELECT pg_advisory_lock(hashtextextended('warmbox:migrate', 0))")
                try:
                    with c.transaction():
                        c.execute(
                            "CREATE TABLE IF NOT EXISTS schema_version ("
                            "version BIGINT PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
                        )
                        before = c.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0]
                        if before > version:
                            raise RegistrySchemaError(_newer(before, version), found=before, expected=version)
                        if before < version:
                            for stmt in statements:
                                c.execute(pg_ddl(stmt))
                            for table in ROWID_TABLES:  # what ORDER BY rowid reads (last: positional inserts)
                                c.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS rowid BIGSERIAL")
                            c.execute(
                                "ALTER TABLE pool_events ADD COLUMN IF NOT EXISTS xid BIGINT NOT NULL "
                                f"DEFAULT ({PG_XACT_ID})"
                            )
                            if 0 < before < POOL_EVENT_XID_VERSION:  # the autoscaler's cursor: rowids -> xids
                                c.execute(f"UPDATE pool_state SET events_seen = {PG_XACT_ID} + 1")
                            c.execute(
                                "INSERT INTO meta_text (key, value) VALUES ('cluster_id', md5(random()::text)) "
                                "ON CONFLICT DO NOTHING"
                            )
                            c.execute("INSERT INTO schema_version VALUES (%s, %s)", (version, now))
                finally:
                    c.execute("SELECT pg_advisory_unlock(hashtextextended('warmbox:migrate', 0))")
        except psycopg.Error as e:
            raise RegistryError(f"cannot migrate the registry: {_pg_message(e)}") from None
        return int(before), version

    def check_schema(self, statements: Sequence[str], version: int, *, now: float) -> None:
        """At open: an empty database gets the schema; one at another version is refused
        (RegistrySchemaError naming the command that migrates it)."""
        found = self.schema_version()
        if found is None:
            self.migrate(statements, version, now=now)
        elif found < version:
            raise RegistrySchemaError(
                f"the PostgreSQL registry has schema version {found}, this warmbox needs {version}: "
                f"run `{MIGRATE_COMMAND}` (with the same [cluster] registry) once, then start again",
                found=found,
                expected=version,
            )
        elif found > version:
            raise RegistrySchemaError(_newer(found, version), found=found, expected=version)


def _newer(found: int, version: int) -> str:
    return (
        f"the PostgreSQL registry has schema version {found}, newer than this warmbox's {version}: "
        "upgrade warmbox on this node (every node and the API tier run the same version)"
    )


def dialect_for(location: str | Path, bounds: Bounds = DEFAULT_BOUNDS) -> Dialect:
    """The dialect of a registry location: a ``postgresql://`` URL or a SQLite file path."""
    if is_url(location):
        return PostgresDialect(str(location), bounds=bounds)
    return SqliteDialect(Path(location), bounds)


__all__ = [
    "DEFAULT_BOUNDS",
    "MIGRATE_COMMAND",
    "PG_XACT_HORIZON",
    "POOL_EVENT_XID_VERSION",
    "Bounds",
    "PG_SCHEMES",
    "Conn",
    "Cursor",
    "Dialect",
    "PostgresDialect",
    "SqliteDialect",
    "dialect_for",
    "is_url",
    "pg_ddl",
    "pg_sql",
]
