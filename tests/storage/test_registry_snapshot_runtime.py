"""Schema 19: each snapshot records the runtime and version that made its memory image (SQLite and
PostgreSQL); a version 17 registry migrates with "" for its snapshots (a gVisor memory snapshot
among them then counts as runsc 2022's, engine.snapshot.check_runtime)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from warmbox.storage import registry as registry_mod
from warmbox.storage.registry import SCHEMA_VERSION, Registry

RUNTIME = "runsc 0.0~20240729.0"


def test_a_snapshot_records_its_runtime(registry_at):
    reg = Registry(registry_at, "n1")
    try:
        reg.snapshots.add_snapshot("snap-mem", "sb-a", 1.0, 10, RUNTIME)
        reg.snapshots.add_snapshot("snap-files", "sb-a", 2.0, 10)
        assert reg.snapshots.snapshot_runtime("snap-mem") == RUNTIME
        assert reg.snapshots.snapshot_runtime("snap-files") == ""
        assert reg.snapshots.snapshot_runtime("snap-none") is None
    finally:
        reg.close()


def _schema_17() -> str:
    schema = registry_mod.SCHEMA.replace(",\n    runtime     TEXT NOT NULL DEFAULT ''\n);", "\n);")
    assert schema != registry_mod.SCHEMA
    return schema


def test_a_version_17_registry_gets_the_runtime_column(tmp_path: Path):
    db = sqlite3.connect(tmp_path / "r.db")
    db.executescript(_schema_17())
    db.execute(
        "INSERT INTO snapshots (snapshot_id, sandbox_id, created_at, size_bytes) VALUES ('snap-old', 'sb', 1, 1)"
    )
    db.execute("PRAGMA user_version = 17")
    db.commit()
    db.close()
    reg = Registry(tmp_path / "r.db")
    try:
        assert reg.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 19
        assert reg.snapshots.snapshot_runtime("snap-old") == ""  # made before runtimes were recorded
        reg.snapshots.add_snapshot("snap-new", "sb", 2.0, 1, RUNTIME)
        assert reg.snapshots.snapshot_runtime("snap-new") == RUNTIME
    finally:
        reg.close()


@pytest.mark.sandbox  # a real PostgreSQL server
def test_a_version_17_postgresql_registry_is_migrated_by_warmbox_db_migrate(pg_fresh_dsn, tmp_path):
    import psycopg

    from warmbox.errors import RegistrySchemaError
    from warmbox.storage.uidslots import MAX_SLOTS, UidLedger

    def open_() -> Registry:
        return Registry(pg_fresh_dsn, "", ledger=UidLedger(tmp_path / "uids", slots=16, first=MAX_SLOTS - 60))

    open_().close()
    with psycopg.connect(pg_fresh_dsn, autocommit=True) as db:
        db.execute("ALTER TABLE snapshots DROP COLUMN runtime")
        db.execute(
            "INSERT INTO snapshots (snapshot_id, sandbox_id, created_at, size_bytes) VALUES ('snap-old', 'sb', 1, 1)"
        )
        db.execute("DELETE FROM schema_version")
        db.execute("INSERT INTO schema_version VALUES (17, 0)")
    with pytest.raises(RegistrySchemaError, match="warmbox db migrate"):
        open_()
    assert registry_mod.migrate(pg_fresh_dsn) == (17, SCHEMA_VERSION)
    reg = open_()
    try:
        assert reg.snapshots.snapshot_runtime("snap-old") == ""
        reg.snapshots.add_snapshot("snap-new", "sb", 2.0, 1, RUNTIME)
        assert reg.snapshots.snapshot_runtime("snap-new") == RUNTIME
    finally:
        reg.close()
