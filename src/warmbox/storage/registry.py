"""The registry: an embedded SQLite file holding every sandbox, its transitions and stage timings.

It is the source of truth shared by every warmbox process on the host (CLI, SDK, reaper).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from warmbox.backends.base import BackendHandle
from warmbox.engine.lifecycle import LIVE, check_transition
from warmbox.errors import RegistryError, SandboxNotFound
from warmbox.models import SandboxInfo, StageTiming, State, Transition

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id  TEXT PRIMARY KEY,
    tier        TEXT NOT NULL,
    template    TEXT NOT NULL,
    state       TEXT NOT NULL,
    created_at  REAL NOT NULL,
    expires_at  REAL NOT NULL,
    memory_mb   INTEGER NOT NULL,
    cpus        REAL NOT NULL,
    pids        INTEGER NOT NULL,
    uid_slot    INTEGER NOT NULL,
    runtime_id  TEXT NOT NULL,
    state_dir   TEXT NOT NULL,
    socket_path TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE TABLE IF NOT EXISTS transitions (
    sandbox_id TEXT NOT NULL,
    at         REAL NOT NULL,
    from_state TEXT NOT NULL,
    to_state   TEXT NOT NULL,
    reason     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS transitions_sandbox ON transitions(sandbox_id);
CREATE TABLE IF NOT EXISTS timings (
    sandbox_id  TEXT NOT NULL,
    stage       TEXT NOT NULL,
    duration_ms REAL NOT NULL,
    PRIMARY KEY (sandbox_id, stage)
);
"""

UID_BASE = 2_000_000
UID_RANGE = 65536
MAX_SLOTS = (2**32 - UID_BASE) // UID_RANGE - 1

_LIVE = tuple(s.value for s in LIVE)
_HOLDING = (*_LIVE, State.FAILED.value)  # states whose uid range is still in use


class Registry:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
        except (sqlite3.Error, OSError) as e:
            raise RegistryError(f"cannot open the registry at {path}: {e}") from None

    def close(self) -> None:
        self._db.close()

    def _tx(self):
        return _Tx(self._db)

    # ---- sandboxes

    def allocate(self, sandbox_id: str, tier: str, template: str, timeout_s: float, memory_mb: int,
                 cpus: float, pids: int, state_dir: str, socket_path: str) -> int:
        """Insert a sandbox in state ``creating`` with a free uid slot; returns the slot."""
        now = time.time()
        with self._tx() as db:
            used = {r[0] for r in db.execute(
                f"SELECT uid_slot FROM sandboxes WHERE state IN ({','.join('?' * len(_HOLDING))})", _HOLDING)}
            slot = next(i for i in range(MAX_SLOTS + 1) if i not in used)
            db.execute(
                "INSERT INTO sandboxes VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (sandbox_id, tier, template, State.CREATING.value, now, now + timeout_s, memory_mb,
                 cpus, pids, slot, sandbox_id, state_dir, socket_path))
            db.execute("INSERT INTO transitions VALUES (?,?,?,?,?)",
                       (sandbox_id, now, "", State.CREATING.value, "create"))
        return slot

    def set_state(self, sandbox_id: str, new: State, reason: str) -> State:
        """Record a transition; returns the previous state. Illegal transitions raise."""
        with self._tx() as db:
            row = db.execute("SELECT state FROM sandboxes WHERE sandbox_id=?", (sandbox_id,)).fetchone()
            if row is None:
                raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox_id)
            old = State(row[0])
            if old is new:
                return old
            check_transition(old, new, sandbox_id)
            db.execute("UPDATE sandboxes SET state=? WHERE sandbox_id=?", (new.value, sandbox_id))
            db.execute("INSERT INTO transitions VALUES (?,?,?,?,?)",
                       (sandbox_id, time.time(), old.value, new.value, reason))
        return old

    def set_expiry(self, sandbox_id: str, expires_at: float) -> None:
        with self._tx() as db:
            db.execute("UPDATE sandboxes SET expires_at=? WHERE sandbox_id=?", (expires_at, sandbox_id))

    def get(self, sandbox_id: str) -> tuple[SandboxInfo, BackendHandle]:
        row = self._db.execute("SELECT * FROM sandboxes WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox_id)
        return self._row(row)

    def list(self, include_dead: bool = False) -> list[tuple[SandboxInfo, BackendHandle]]:
        if include_dead:
            rows = self._db.execute("SELECT * FROM sandboxes ORDER BY created_at").fetchall()
        else:
            rows = self._db.execute(
                f"SELECT * FROM sandboxes WHERE state IN ({','.join('?' * len(_LIVE))}) ORDER BY created_at",
                _LIVE).fetchall()
        return [self._row(r) for r in rows]

    @staticmethod
    def _row(r: tuple) -> tuple[SandboxInfo, BackendHandle]:
        (sid, tier, template, state, created, expires, mem, cpus, pids, slot, runtime_id,
         state_dir, socket_path) = r
        info = SandboxInfo(sandbox_id=sid, tier=tier, state=State(state), created_at=created,
                           expires_at=expires, memory_mb=mem, cpus=cpus, pids=pids, template=template)
        handle = BackendHandle(sandbox_id=sid, tier=tier, runtime_id=runtime_id, state_dir=state_dir,
                               socket_path=socket_path, uid_base=UID_BASE + slot * UID_RANGE)
        return info, handle

    # ---- history

    def transitions(self, sandbox_id: str) -> list[Transition]:
        rows = self._db.execute(
            "SELECT sandbox_id, at, from_state, to_state, reason FROM transitions WHERE sandbox_id=? ORDER BY rowid",
            (sandbox_id,)).fetchall()
        return [Transition(*r) for r in rows]

    def add_timing(self, sandbox_id: str, stage: str, duration_ms: float) -> None:
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO timings VALUES (?,?,?)", (sandbox_id, stage, duration_ms))

    def add_timings(self, timings: list[StageTiming]) -> None:
        with self._tx() as db:
            db.executemany("INSERT OR REPLACE INTO timings VALUES (?,?,?)",
                           [(t.sandbox_id, t.stage, t.duration_ms) for t in timings])

    def timings(self, sandbox_id: str) -> list[StageTiming]:
        rows = self._db.execute(
            "SELECT sandbox_id, stage, duration_ms FROM timings WHERE sandbox_id=? ORDER BY rowid",
            (sandbox_id,)).fetchall()
        return [StageTiming(*r) for r in rows]


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT, translating sqlite errors at this one boundary."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise RegistryError(f"registry unavailable: {e}") from None
        return self.db

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
            except sqlite3.Error as e:
                raise RegistryError(f"registry commit failed: {e}") from None
        else:
            self.db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise RegistryError(f"registry error: {exc}") from None
