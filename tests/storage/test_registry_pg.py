"""The registry on a real PostgreSQL (tests/pgserver.py): its schema version and `warmbox db
migrate`, and the invariants SQLite's one writer lock gave for free, now held by row and advisory
locks between processes that share nothing but the database (each its own uid ledger: another host)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest

from warmbox.errors import RegistrySchemaError
from warmbox.models import Limits, State, TemplateInfo
from warmbox.storage import templates as stored
from warmbox.storage.layers import LayerStore
from warmbox.storage.registry import SCHEMA_VERSION, Registry, schema_version
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger, registry_holds

pytestmark = pytest.mark.sandbox  # a real PostgreSQL server

ROOT = Path(__file__).resolve().parents[2]


def _registry(dsn: str, tmp: Path, node: str = "", host: str = "h1") -> Registry:
    # one uid ledger per simulated host: these rows never run, so they hold no real range of this host
    return Registry(dsn, node, ledger=UidLedger(tmp / f"uids-{host}", slots=16, first=MAX_SLOTS - 60))


def _sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as db:
        for s in statements:
            db.execute(s)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "warmbox.cli.main", *args],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_an_empty_database_gets_the_schema_and_another_version_is_refused_until_migrated(pg_fresh_dsn, tmp_path):
    dsn = pg_fresh_dsn
    assert schema_version(dsn) is None
    reg = _registry(dsn, tmp_path)
    assert schema_version(dsn) == SCHEMA_VERSION
    assert reg.key.startswith("pg:") and dsn not in reg.key and reg.path is None and reg.shared
    reg.close()
    # the same database as version 14 left it: no node column, no nodes table
    _sql(
        dsn,
        "ALTER TABLE sandboxes DROP COLUMN node",
        "DROP TABLE nodes",
        "DELETE FROM schema_version",
        "INSERT INTO schema_version VALUES (14, 0)",
    )
    with pytest.raises(RegistrySchemaError, match="warmbox db migrate") as e:
        _registry(dsn, tmp_path)
    assert (e.value.found, e.value.expected) == (14, SCHEMA_VERSION)
    status = _cli("db", "status", "--registry", dsn)
    assert status.returncode == 1 and "older: run `warmbox db migrate`" in status.stdout
    out = _cli("db", "migrate", "--registry", dsn)
    assert out.returncode == 0, out.stderr
    assert f"schema version 14 -> {SCHEMA_VERSION}" in out.stdout
    again = _cli("db", "migrate", "--registry", dsn)
    assert again.returncode == 0 and "(up to date)" in again.stdout
    reg = _registry(dsn, tmp_path, "n1")
    reg.sandboxes.allocate("sb-0000000000e1", "container", "base", 60, Limits(), "/nonexistent", "/nonexistent")
    assert reg.nodes.node_of("sb-0000000000e1") == "n1"  # the migrated column is there
    reg.sandboxes.set_state("sb-0000000000e1", State.DESTROYED, "test over")
    reg.close()
    # a registry a newer warmbox migrated: this one refuses it rather than write what it does not know
    _sql(dsn, f"INSERT INTO schema_version VALUES ({SCHEMA_VERSION + 1}, 0)")
    with pytest.raises(RegistrySchemaError, match="upgrade warmbox"):
        _registry(dsn, tmp_path)
    assert _cli("db", "migrate", "--registry", dsn).returncode != 0


def test_nodes_starting_together_make_the_schema_once(pg_fresh_dsn, tmp_path):
    errors: list[BaseException] = []
    regs: list[Registry] = []

    def start(i: int) -> None:
        try:
            regs.append(_registry(pg_fresh_dsn, tmp_path, f"n{i}", host=f"h{i}"))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and len(regs) == 4
    with psycopg.connect(pg_fresh_dsn) as db:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        assert db.execute("SELECT COUNT(*) FROM meta_text WHERE key='cluster_id'").fetchone() == (1,)
    assert len({r.key.rpartition("/")[0] for r in regs}) == 1  # one cluster id, made once
    for r in regs:
        r.close()


# A worker process: its own Registry and uid ledger (another host); starts at ``start`` (unix s).
_WORKER = """
import json, sys, time
from pathlib import Path
from warmbox.errors import QuotaExceeded
from warmbox.models import Limits, State, Tenant
from warmbox.storage.registry import Registry
from warmbox.storage.uidslots import UidLedger, MAX_SLOTS
dsn, tmp, i, mode, start, seconds = sys.argv[1:7]
i = int(i)
reg = Registry(dsn, "n0" if mode == "claim" else f"n{i}",
               ledger=UidLedger(Path(tmp) / f"uids-{i}", slots=16, first=MAX_SLOTS - 60))
while time.time() < float(start):
    time.sleep(0.001)
out = {"made": 0, "refused": 0, "max_live": 0, "claimed": []}
if mode == "quota":
    end = time.time() + float(seconds)
    n = 0
    held = []  # each worker keeps up to 2: 4 workers want 8, the quota allows 3
    while time.time() < end:
        sid = f"sb-{i:02d}{n:010d}"
        n += 1
        try:
            reg.sandboxes.allocate(sid, "container", "base", 60, Limits(), "/nonexistent", "/nonexistent",
                         tenant=Tenant("acme", max_sandboxes=3))
        except QuotaExceeded:
            out["refused"] += 1
            if held:
                reg.sandboxes.set_state(held.pop(0), State.DESTROYED, "done")
            continue
        out["made"] += 1
        held.append(sid)
        live = reg.db.conn.execute(
            "SELECT COUNT(*) FROM sandboxes WHERE tenant='acme' AND state IN ('creating','ready','running')"
        ).fetchone()[0]
        out["max_live"] = max(out["max_live"], live)
        if len(held) == 2:
            reg.sandboxes.set_state(held.pop(0), State.DESTROYED, "done")
    for sid in held:
        reg.sandboxes.set_state(sid, State.DESTROYED, "done")
else:
    while True:
        got = reg.pools.claim("p", "shape-1", 60, f"owner-{i}", Tenant(f"t{i}"))  # four tenants: no common lock
        if got is None:
            break
        out["claimed"].append(got[0].sandbox_id)
print(json.dumps(out))
"""


def _workers(dsn: str, tmp: Path, mode: str, n: int = 4, seconds: float = 2.0) -> list[dict]:
    start = time.time() + 3.0  # every worker has imported warmbox and connected by then
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, dsn, str(tmp), str(i), mode, str(start), str(seconds)],
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT / "src")},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    return outs


def test_four_hosts_creating_at_once_never_exceed_a_tenants_quota(pg_fresh_dsn, tmp_path):
    """Each worker creates, counts the tenant's live sandboxes, destroys, for 2 s. Without the
    tenant's advisory lock (READ COMMITTED: count, then insert), this reached 4-6 live on a quota
    of 3; SQLite's BEGIN IMMEDIATE serialized it."""
    _registry(pg_fresh_dsn, tmp_path).close()  # the schema, before the race
    outs = _workers(pg_fresh_dsn, tmp_path, "quota")
    made = sum(o["made"] for o in outs)
    assert made >= 20 and sum(o["refused"] for o in outs) > 0  # they did race (and were refused)
    assert max(o["max_live"] for o in outs) <= 3, outs


def test_a_pooled_sandbox_is_claimed_exactly_once(pg_fresh_dsn, tmp_path):
    reg = _registry(pg_fresh_dsn, tmp_path, "n0")
    ids = [f"sb-00000000p{i:03d}" for i in range(12)]
    for sid in ids:
        reg.sandboxes.allocate(
            sid, "container", "base", 600, Limits(), "/nonexistent", "/nonexistent", pool="p", shape="shape-1"
        )
        reg.sandboxes.set_state(sid, State.POOLED, "warm")
    outs = _workers(pg_fresh_dsn, tmp_path, "claim")
    claimed = [sid for o in outs for sid in o["claimed"]]
    assert sorted(claimed) == ids  # every one, none twice
    for n, o in enumerate(outs):  # each went to the tenant that claimed it
        assert sorted(i.sandbox_id for i, _ in reg.sandboxes.list(tenant=f"t{n}")) == sorted(o["claimed"])
    hits, misses, *_ = reg.pools.pool_totals("p")
    assert (hits, misses) == (12, 4)  # each worker's last claim found none
    reg.close()


def test_a_postgresql_registrys_slots_and_pins_never_read_as_a_removed_home(pg_fresh_dsn, tmp_path):
    a = _registry(pg_fresh_dsn, tmp_path, "a")
    b = _registry(pg_fresh_dsn, tmp_path, "b")  # another node of the cluster on this host: the same ledger
    slot = a.sandboxes.allocate("sb-0000000000f1", "container", "base", 60, Limits(), "/nonexistent", "/nonexistent")
    # a key that names no file: never "gone" (the ledger would reclaim a live sandbox's slot)
    assert registry_holds(a.key, "sb-0000000000f1", slot) is None
    assert registry_holds("pg:another-cluster/x", "sb-0000000000f1", slot) is None
    # another node of the same cluster answers from the shared database
    assert b.db.holds(a.key, "sb-0000000000f1", slot) is True
    a.sandboxes.set_state("sb-0000000000f1", State.DESTROYED, "test over")
    assert b.db.holds(a.key, "sb-0000000000f1", slot) is False
    store = LayerStore(tmp_path / "cache")
    info = TemplateInfo("web", 0, "sha256:" + "a" * 64, ("sha256:" + "b" * 64,), spec_hash="s1")
    out = stored.add_template(a, store, info)
    pin = stored.pin_name(a, out.tenant, out.name, out.version)
    assert pin.startswith(f"template:{a.key}#") and pg_fresh_dsn not in pin
    stored.collect(a, store)
    assert pin in store.pinned()  # not dropped as a removed home's
    a.close()
    b.close()


def test_hostile_text_is_stored_not_refused(pg_fresh_dsn, tmp_path):
    """A NUL byte or a lone surrogate (a guest's bytes) would make PostgreSQL refuse the row and
    with it the whole batch; the registry stores a replacement character instead."""
    from warmbox.models import NetEvent

    reg = _registry(pg_fresh_dsn, tmp_path)
    reg.sandboxes.allocate("sb-0000000000g1", "container", "base", 60, Limits(), "/nonexistent", "/nonexistent")
    reg.egress.add_net_events([NetEvent("sb-0000000000g1", 1.0, "dns", "a\x00b\udc80.example", "", 53, "deny", "x")])
    (e,) = reg.egress.net_events("sb-0000000000g1")
    assert e.host == "a\ufffdb\ufffd.example"
    reg.sandboxes.set_state("sb-0000000000g1", State.DESTROYED, "test over")
    reg.close()
