"""Schema 21: a sandbox's metrics history (SQLite and PostgreSQL): a reading every 5 s at most, its
CPU use over the time since the reading before, a bounded ring, gone when the sandbox ends; a
version 20 registry gets the table."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from warmbox.models import Limits, State
from warmbox.storage import registry as registry_mod
from warmbox.storage.registry import METRIC_SAMPLE_EVERY_S, METRIC_SAMPLES_KEPT, SCHEMA_VERSION, Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger

T0 = 1_800_000_000.0


def _registry(tmp: Path, at: str | Path) -> Registry:
    return Registry(at, ledger=UidLedger(tmp / "uids", slots=8, first=MAX_SLOTS - 70))


def _readings(reg: Registry, sid: str, ring: int) -> None:
    """The history of ``sid`` over a few readings, then ``ring`` more (the ring's bound when it is
    METRIC_SAMPLES_KEPT), then its end."""
    reg.sandboxes.allocate(sid, "container", "base", 86400, Limits(cpus=2), "/nonexistent", "/nonexistent")
    reg.db.conn.execute("UPDATE meters SET sampled_at=? WHERE sandbox_id=?", (T0, sid))
    reg.usage.sample([(sid, 100, 1_000_000_000)], now=T0 + 1)  # 1 CPU-second in 1 s of 2 CPUs: 50 %
    reg.usage.sample([(sid, 200, 1_500_000_000)], now=T0 + 2)  # under 5 s after it: no reading
    reg.usage.sample([(sid, 300, 11_000_000_000)], now=T0 + 1 + METRIC_SAMPLE_EVERY_S)  # 10 CPU-s in 5 s: 100 %
    reg.usage.sample([(sid, 400, 500_000_000)], now=T0 + 1 + 2 * METRIC_SAMPLE_EVERY_S)  # a counter back at 0
    got = reg.usage.metric_samples(sid, 0, T0 + 100)
    assert got == [(T0 + 1, 50.0, 100), (T0 + 6, 100.0, 300), (T0 + 11, 5.0, 400)]
    assert reg.usage.metric_samples(sid, T0 + 2, T0 + 6) == [(T0 + 6, 100.0, 300)]
    assert reg.usage.metric_samples(sid, 0, T0 + 100, limit=1) == [(T0 + 11, 5.0, 400)]  # the latest
    for i in range(3, ring + 3):
        reg.usage.sample([(sid, i, 0)], now=T0 + 1 + i * METRIC_SAMPLE_EVERY_S)
    kept = reg.usage.metric_samples(sid, 0, T0 + 1e6, limit=METRIC_SAMPLES_KEPT)
    assert len(kept) == min(ring + 3, METRIC_SAMPLES_KEPT) and kept[-1][2] == ring + 2
    (count,) = reg.db.conn.execute("SELECT COUNT(*) FROM metric_samples WHERE sandbox_id=?", (sid,)).fetchone()
    assert count == len(kept)
    reg.sandboxes.set_state(sid, State.DESTROYED, "test over")
    reg.usage.finalize(sid)
    assert reg.usage.metric_samples(sid, 0, T0 + 1e6) == []


def test_readings_every_5_s_a_bounded_ring_that_ends_with_the_sandbox(tmp_path):
    reg = _registry(tmp_path, tmp_path / "r.db")
    try:
        _readings(reg, "sb-0000000000e1", METRIC_SAMPLES_KEPT)
    finally:
        reg.close()


def test_a_version_20_registry_gets_the_metric_samples_table(tmp_path: Path):
    schema = registry_mod.SCHEMA[: registry_mod.SCHEMA.index("CREATE TABLE IF NOT EXISTS metric_samples")]
    db = sqlite3.connect(tmp_path / "r.db")
    db.executescript(schema)
    db.execute("PRAGMA user_version = 20")
    db.commit()
    db.close()
    reg = _registry(tmp_path, tmp_path / "r.db")
    try:
        assert reg.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 21
        assert reg.usage.metric_samples("sb-0000000000e2", 0, T0) == []
    finally:
        reg.close()


@pytest.mark.sandbox  # a real PostgreSQL server
def test_a_version_20_postgresql_registry_is_migrated_by_warmbox_db_migrate(pg_fresh_dsn, tmp_path):
    import psycopg

    from warmbox.errors import RegistrySchemaError

    _registry(tmp_path, pg_fresh_dsn).close()
    with psycopg.connect(pg_fresh_dsn, autocommit=True) as db:
        db.execute("DROP TABLE metric_samples")
        db.execute("DELETE FROM schema_version")
        db.execute("INSERT INTO schema_version VALUES (20, 0)")
    with pytest.raises(RegistrySchemaError, match="warmbox db migrate"):
        _registry(tmp_path, pg_fresh_dsn)
    assert registry_mod.migrate(pg_fresh_dsn) == (20, SCHEMA_VERSION)
    reg = _registry(tmp_path, pg_fresh_dsn)
    try:
        assert reg.usage.metric_samples("sb-0000000000e2", 0, T0) == []
        _readings(reg, "sb-0000000000e3", 5)  # the same SQL on PostgreSQL (the ring's bound: SQLite's test)
    finally:
        reg.close()
