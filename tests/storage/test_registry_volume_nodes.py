"""Schema 16: the registry records the node holding each volume's disk (SQLite and PostgreSQL), and
a version 15 registry migrates its volumes to the single host's ("")."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from warmbox.errors import VolumeNotFound
from warmbox.storage import registry as registry_mod
from warmbox.storage.registry import SCHEMA_VERSION, Registry


def test_a_volume_is_recorded_on_the_node_that_made_it(registry_at):
    a, b = Registry(registry_at, "a"), Registry(registry_at, "b")
    try:
        a.volumes.add_volume("t1", "data", "vol-00000000000000a1", 64, 1.0)
        b.volumes.add_volume("t1", "other", "vol-00000000000000b1", 64, 2.0)
        assert (
            b.volumes.volume_node("vol-00000000000000a1") == "a"
            and a.volumes.volume_node("vol-00000000000000b1") == "b"
        )
        assert a.volumes.volume_nodes() == {"vol-00000000000000a1": "a", "vol-00000000000000b1": "b"}
        with pytest.raises(VolumeNotFound):
            a.volumes.volume_node("vol-0000000000000000")
    finally:
        a.close()
        b.close()


def test_a_version_15_registry_gets_volume_nodes(tmp_path: Path):
    schema = registry_mod.SCHEMA
    with_node = (
        "    created_at  REAL NOT NULL,\n    node        TEXT NOT NULL DEFAULT '',\n    PRIMARY KEY (tenant, name)"
    )
    assert with_node in schema
    schema = schema.replace(with_node, "    created_at  REAL NOT NULL,\n    PRIMARY KEY (tenant, name)")
    db = sqlite3.connect(tmp_path / "r.db")
    db.executescript(schema)
    db.execute("INSERT INTO volumes VALUES ('', 'old', 'vol-0000000000000001', 64, 1.0)")
    db.execute("PRAGMA user_version = 15")
    db.commit()
    db.close()
    reg = Registry(tmp_path / "r.db", "n1")
    try:
        assert reg.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 16
        assert reg.volumes.volume_node("vol-0000000000000001") == ""  # a single host's volume
        reg.volumes.add_volume("", "new", "vol-0000000000000002", 64, 2.0)
        assert reg.volumes.volume_nodes() == {"vol-0000000000000001": "", "vol-0000000000000002": "n1"}
    finally:
        reg.close()
