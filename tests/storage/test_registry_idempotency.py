"""Schema 20: idempotency keys (SQLite and PostgreSQL): one claim wins, a repeat reads the record,
keys are a tenant's and a scope's, expire, and a sandbox's keys end with it; a version 19 registry
gets the table."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from warmbox.models import Limits, State
from warmbox.storage import registry as registry_mod
from warmbox.storage.registry import SCHEMA_VERSION, KeyClaim, Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger


def _registry(tmp: Path, at: str | Path) -> Registry:
    return Registry(at, ledger=UidLedger(tmp / "uids", slots=16, first=MAX_SLOTS - 60))


def _claim(tenant: str, scope: str, key: str, holder: str, ttl: float = 60.0, fp: str = "fp") -> KeyClaim:
    now = time.time()
    return KeyClaim(tenant, scope, key, "command", fp, holder, now, now + ttl, 0.0)


def test_one_claim_wins_and_a_repeat_reads_its_record(tmp_path, registry_at):
    reg = _registry(tmp_path, registry_at)
    sid = "sb-0000000000f1"
    try:
        reg.sandboxes.allocate(sid, "container", "base", 300.0, Limits(), "/nonexistent", "/nonexistent")
        first = _claim("acme", sid, "k", "h/1")
        assert reg.idempotency.claim_key(first) is None
        got = reg.idempotency.claim_key(_claim("acme", sid, "k", "h/2", fp="other"))
        assert got is not None and (got.state, got.claim.holder, got.claim.fingerprint) == ("started", "h/1", "fp")
        # another tenant, another sandbox: the same string is another key
        assert reg.idempotency.claim_key(_claim("other", sid, "k", "h/3")) is None
        assert reg.idempotency.claim_key(_claim("acme", "sb-0000000000f2", "k", "h/4")) is None
        reg.idempotency.finish_keys([(first, "done", '{"exit_code": 0}', "")])
        rec = reg.idempotency.key_record("acme", sid, "k")
        assert rec is not None and (rec.state, rec.result) == ("done", '{"exit_code": 0}')
        # an outcome is written only by the claim that holds the key
        reg.idempotency.finish_keys([(_claim("acme", sid, "k", "h/2"), "failed", "{}", "")])
        assert reg.idempotency.key_record("acme", sid, "k").state == "done"  # type: ignore[union-attr]
        # a claim whose call did nothing is released: the key is free again
        freed = _claim("acme", sid, "freed", "h/7")
        assert reg.idempotency.claim_key(freed) is None
        reg.idempotency.release_key(freed)
        assert (
            reg.idempotency.key_record("acme", sid, "freed") is None
            and reg.idempotency.claim_key(_claim("acme", sid, "freed", "h/8")) is None
        )
        # an expired record is replaced by the next claim
        assert reg.idempotency.claim_key(_claim("acme", "", "old", "h/5", ttl=-1)) is None
        assert reg.idempotency.key_record("acme", "", "old") is None
        assert reg.idempotency.claim_key(_claim("acme", "", "old", "h/6")) is None
        assert reg.idempotency.key_record("acme", "", "old").claim.holder == "h/6"  # type: ignore[union-attr]
        # a sandbox's keys end with it; a create's (scope "") stay
        reg.sandboxes.set_state(sid, State.DESTROYED, "test over")
        assert (
            reg.idempotency.key_record("acme", sid, "k") is None
            and reg.idempotency.key_record("other", sid, "k") is None
        )
        assert reg.idempotency.key_record("acme", "", "old") is not None
    finally:
        reg.db.conn.execute("DELETE FROM idempotency_keys WHERE tenant IN ('acme', 'other')")
        reg.close()


def test_a_version_19_registry_gets_the_keys_table(tmp_path: Path):
    schema = registry_mod.SCHEMA[: registry_mod.SCHEMA.index("CREATE TABLE IF NOT EXISTS idempotency_keys")]
    db = sqlite3.connect(tmp_path / "r.db")
    db.executescript(schema)
    db.execute("PRAGMA user_version = 19")
    db.commit()
    db.close()
    reg = _registry(tmp_path, tmp_path / "r.db")
    try:
        assert reg.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert reg.idempotency.claim_key(_claim("acme", "", "k", "h/1")) is None
    finally:
        reg.close()


@pytest.mark.sandbox  # a real PostgreSQL server
def test_a_version_19_postgresql_registry_is_migrated_by_warmbox_db_migrate(pg_fresh_dsn, tmp_path):
    import psycopg

    from warmbox.errors import RegistrySchemaError

    _registry(tmp_path, pg_fresh_dsn).close()
    with psycopg.connect(pg_fresh_dsn, autocommit=True) as db:
        db.execute("DROP TABLE idempotency_keys")
        db.execute("DELETE FROM schema_version")
        db.execute("INSERT INTO schema_version VALUES (19, 0)")
    with pytest.raises(RegistrySchemaError, match="warmbox db migrate"):
        _registry(tmp_path, pg_fresh_dsn)
    assert registry_mod.migrate(pg_fresh_dsn) == (19, SCHEMA_VERSION)
    reg = _registry(tmp_path, pg_fresh_dsn)
    try:
        assert reg.idempotency.claim_key(_claim("acme", "", "k", "h/1")) is None
        assert reg.idempotency.claim_key(_claim("acme", "", "k", "h/2")).claim.holder == "h/1"  # type: ignore[union-attr]
    finally:
        reg.close()
