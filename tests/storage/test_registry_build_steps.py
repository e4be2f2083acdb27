"""Schema 17: a tenant's template build-step cache in the registry (SQLite and PostgreSQL), read only
by that tenant; a version 16 registry migrates to it with no step rows (the host-wide cache of
earlier versions is never read for a tenant)."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from warmbox.errors import InvalidArgument
from warmbox.storage import registry as registry_mod
from warmbox.storage.registry import SCHEMA_VERSION, Registry

KEY = hashlib.sha256(b"a step").hexdigest()
LAYER_A = "sha256:" + "a" * 64
LAYER_B = "sha256:" + "b" * 64


def test_a_tenants_step_is_found_by_that_tenant_only(registry_at):
    reg, other_node = Registry(registry_at, "n1"), Registry(registry_at, "n2")
    try:
        assert reg.templates.build_step("alice", KEY) is None
        reg.templates.record_build_step("alice", KEY, LAYER_A)
        assert reg.templates.build_step("alice", KEY) == LAYER_A
        assert reg.templates.build_step("bob", KEY) is None  # the same key, another tenant: nothing
        assert other_node.templates.build_step("alice", KEY) == LAYER_A  # a cluster's nodes share the rows
        reg.templates.record_build_step("bob", KEY, LAYER_B)
        reg.templates.record_build_step("alice", KEY, LAYER_B)  # rebuilt: replaced
        assert (reg.templates.build_step("alice", KEY), reg.templates.build_step("bob", KEY)) == (LAYER_B, LAYER_B)
        for bad in (
            lambda: reg.templates.build_step("", KEY),  # the host's steps never live here
            lambda: reg.templates.record_build_step("", KEY, LAYER_A),
            lambda: reg.templates.record_build_step("alice", "not-a-key", LAYER_A),
            lambda: reg.templates.record_build_step("alice", KEY, "sha256:short"),
        ):
            with pytest.raises(InvalidArgument):
                bad()
    finally:
        reg.close()
        other_node.close()


def test_a_version_16_registry_gets_the_build_step_table(tmp_path: Path):
    table = registry_mod.SCHEMA.index("CREATE TABLE IF NOT EXISTS build_steps")
    end = registry_mod.SCHEMA.index(");", table) + 2
    schema = registry_mod.SCHEMA[:table] + registry_mod.SCHEMA[end:]
    db = sqlite3.connect(tmp_path / "r.db")
    db.executescript(schema)
    db.execute("PRAGMA user_version = 16")
    db.commit()
    assert db.execute("SELECT name FROM sqlite_master WHERE name='build_steps'").fetchone() is None
    db.close()
    reg = Registry(tmp_path / "r.db")
    try:
        assert reg.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 17
        assert reg.templates.build_step("alice", KEY) is None
        reg.templates.record_build_step("alice", KEY, LAYER_A)
        assert reg.templates.build_step("alice", KEY) == LAYER_A
    finally:
        reg.close()


@pytest.mark.sandbox  # a real PostgreSQL server
def test_a_version_16_postgresql_registry_is_migrated_by_warmbox_db_migrate(pg_fresh_dsn, tmp_path):
    import psycopg

    from warmbox.errors import RegistrySchemaError
    from warmbox.storage.uidslots import MAX_SLOTS, UidLedger

    def open_() -> Registry:
        return Registry(pg_fresh_dsn, "", ledger=UidLedger(tmp_path / "uids", slots=16, first=MAX_SLOTS - 60))

    open_().close()
    with psycopg.connect(pg_fresh_dsn, autocommit=True) as db:
        db.execute("DROP TABLE build_steps")
        db.execute("DELETE FROM schema_version")
        db.execute("INSERT INTO schema_version VALUES (16, 0)")
    with pytest.raises(RegistrySchemaError, match="warmbox db migrate"):
        open_()
    assert registry_mod.migrate(pg_fresh_dsn) == (16, SCHEMA_VERSION)
    reg = open_()
    try:
        reg.templates.record_build_step("alice", KEY, LAYER_A)
        assert reg.templates.build_step("alice", KEY) == LAYER_A and reg.templates.build_step("bob", KEY) is None
    finally:
        reg.close()
