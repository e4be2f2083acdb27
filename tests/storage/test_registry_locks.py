"""Every wait on a PostgreSQL registry is bounded (issue 39, item 3): a node stopped (SIGSTOP)
while it holds a registry lock blocks the other nodes only until the server ends its session
(idle_in_transaction_session_timeout), a lock held longer fails a write with RegistryBusy after its
retry budget, a statement past statement_timeout is RegistryBusy too. Real PostgreSQL (tests/pgserver.py),
real processes; each registry has its own uid ledger (another host)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from warmbox.errors import RegistryBusy
from warmbox.models import Limits, NodeInfo, State
from warmbox.storage.registry import Registry
from warmbox.storage.sql import Bounds
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger

PG = pytest.mark.sandbox  # a real PostgreSQL server

ROOT = Path(__file__).resolve().parents[2]

# A node's registry process that takes the tenant's quota lock and a row lock, says so, and waits
# (the parent stops it there): what a node stopped in the middle of a create holds.
_HOLDER = """
import sys
from pathlib import Path
from warmbox.storage.registry import Registry
from warmbox.storage.sql import Bounds
from warmbox.storage.uidslots import UidLedger, MAX_SLOTS
dsn, tmp, idle_s = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
reg = Registry(dsn, "n1", ledger=UidLedger(tmp / "uids-n1", slots=8, first=MAX_SLOTS - 30),
               bounds=Bounds(lock_s=1, statement_s=10, idle_s=idle_s))
with reg.dialect.transaction(["tenant:acme"]) as db:
    db.execute("SELECT name FROM tenants WHERE name=? FOR UPDATE", ("acme",))
    pid = db.execute("SELECT pg_backend_pid()").fetchone()[0]
    print(pid, flush=True)
    sys.stdin.readline()  # stopped here; woken, it goes on with its transaction
    db.execute("SELECT 1")
"""


def _registry(dsn: str, tmp: Path, node: str, bounds: Bounds) -> Registry:
    return Registry(dsn, node, ledger=UidLedger(tmp / f"uids-{node}", slots=8, first=MAX_SLOTS - 20), bounds=bounds)


def _holder(dsn: str, tmp: Path, idle_s: float) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, dsn, str(tmp), str(idle_s)],
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the holder's backend pid, once it holds both locks
    assert line.strip().isdigit(), f"the holder did not start (exit {proc.poll()})"
    return proc, int(line)


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
    proc.wait(30)
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


def _backend_alive(dsn: str, pid: int, wait_s: float = 10.0) -> bool:
    """Whether the backend ``pid`` still runs after ``wait_s`` (it lets its locks go as it aborts,
    a moment before its process has exited)."""
    deadline = time.monotonic() + wait_s
    with psycopg.connect(dsn, autocommit=True) as db:
        while db.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE pid=%s", (pid,)).fetchone()[0]:
            if time.monotonic() > deadline:
                return True
            time.sleep(0.05)
    return False


def _locks_of(dsn: str, pid: int) -> set[str]:
    with psycopg.connect(dsn, autocommit=True) as db:
        return {r[0] for r in db.execute("SELECT locktype FROM pg_locks WHERE pid=%s AND granted", (pid,))}


@PG
def test_a_stopped_node_holding_a_quota_lock_blocks_the_others_only_until_its_session_ends(pg_fresh_dsn, tmp_path):
    dsn = pg_fresh_dsn
    idle_s = 3.0
    bounds = Bounds(lock_s=1, statement_s=10, idle_s=idle_s, retry_budget_s=30)
    n2 = _registry(dsn, tmp_path, "n2", bounds)
    n2.nodes.join_node(NodeInfo("n2", address="http://127.0.0.1:1", slots=8, tiers=("container",)))
    n2.tenants.create_key("acme")
    acme = n2.tenants.tenant("acme")
    proc, backend = _holder(dsn, tmp_path, idle_s)
    try:
        assert {"advisory", "transactionid"} <= _locks_of(dsn, backend)  # it holds them, really
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        made = []
        for i in range(3):  # node n2 keeps creating for the same tenant
            sid = f"sb-00000000{i:04x}"
            n2.sandboxes.allocate(sid, "container", "base", 60, Limits(), "/nonexistent", "/nonexistent", tenant=acme)
            made.append((sid, time.monotonic() - t0))
        took = made[0][1]
        # the first waited for the stopped node's session to be ended (idle_s), no more than the
        # budget; the ones after it did not wait at all
        assert took < bounds.retry_budget_s, made
        assert made[-1][1] - took < 5, made
        assert not _backend_alive(dsn, backend)  # the server ended the stopped node's session
        assert [n2.sandboxes.get(sid)[0].state for sid, _ in made] == [State.CREATING] * 3
        os.kill(proc.pid, signal.SIGCONT)  # woken, it finds its transaction gone: it committed nothing
        assert proc.stdin is not None
        proc.stdin.write("go on\n")
        proc.stdin.flush()
        assert proc.wait(30) != 0
        print("creates done at (s after the stop):", [round(t, 2) for _, t in made])
    finally:
        _end(proc)
        n2.close()


@PG
def test_a_lock_held_past_the_retry_budget_is_registry_busy_and_writes_nothing(pg_fresh_dsn, tmp_path):
    dsn = pg_fresh_dsn
    bounds = Bounds(lock_s=0.3, statement_s=10, idle_s=10, retry_budget_s=2)
    reg = _registry(dsn, tmp_path, "n2", bounds)
    reg.tenants.create_key("acme")
    acme = reg.tenants.tenant("acme")
    # a live holder the server does not end (it is not idle: it sleeps inside a statement)
    holder = psycopg.connect(dsn, autocommit=True)
    try:
        holder.execute("BEGIN")
        holder.execute("SELECT pg_advisory_xact_lock(hashtextextended('tenant:acme', 0))")
        t0 = time.monotonic()
        with pytest.raises(RegistryBusy, match=r"lock timeout.*tried") as e:
            reg.sandboxes.allocate(
                "sb-0000000000b1", "container", "base", 60, Limits(), "/nonexistent", "/nonexistent", tenant=acme
            )
        waited = time.monotonic() - t0
        assert 1.5 <= waited < 10 and 1.5 <= e.value.waited_s <= waited
        assert "retry later" in str(e.value)
        assert reg.sandboxes.list(include_dead=True) == []  # nothing written
        assert list((tmp_path / "uids-n2").glob("[0-9]*")) == []  # no uid slot kept
        holder.execute("ROLLBACK")
        reg.sandboxes.allocate(
            "sb-0000000000b1", "container", "base", 60, Limits(), "/nonexistent", "/nonexistent", tenant=acme
        )
    finally:
        holder.close()
        reg.close()


@PG
def test_a_statement_past_its_bound_is_registry_busy(pg_fresh_dsn, tmp_path):
    reg = _registry(pg_fresh_dsn, tmp_path, "n2", Bounds(statement_s=0.5))
    try:
        with pytest.raises(RegistryBusy, match="statement timeout"):
            reg.db.read("SELECT pg_sleep(3)")
        with reg.dialect.connection() as c:  # the session's settings, as PostgreSQL has them
            got = [
                c.execute(f"SHOW {n}").fetchone()[0] for n in ("lock_timeout", "idle_in_transaction_session_timeout")
            ]
        assert got == ["5s", "10s"]
    finally:
        reg.close()


@PG
def test_pool_events_take_no_cluster_wide_lock_and_one_committed_late_is_counted_once(pg_fresh_dsn, tmp_path):
    dsn = pg_fresh_dsn
    bounds = Bounds(lock_s=2, retry_budget_s=0)  # a wait for a lock would fail this test
    n1 = _registry(dsn, tmp_path, "n1", bounds)
    n2 = _registry(dsn, tmp_path, "n2", bounds)
    try:
        n2.pools.ensure_pool("p", 1)
        seen, counted = 0, 0
        # node n1's claim is slow to commit: its miss has the lower rowid but commits last
        with n1.dialect.transaction() as db:
            n1.pools._pool_event(db, ("p", time.time(), "miss", "", "n1"))
            t0 = time.monotonic()
            n2.pools.pool_event("p", "miss", detail="n2")  # no wait for n1's transaction
            assert time.monotonic() - t0 < bounds.lock_s
            misses, seen = n2.pools.unseen_misses("p", seen)  # what an autoscaler on n2 reads meanwhile
            counted += misses
        rowids = n2.db.read("SELECT detail, rowid FROM pool_events ORDER BY rowid", many=True)
        assert [r[0] for r in rowids] == ["n1", "n2"]  # n1's row: lower rowid, committed later
        for _ in range(2):
            misses, seen = n2.pools.unseen_misses("p", seen)
            counted += misses
        assert counted == 2  # each miss once: a rowid cursor would have skipped n1's
    finally:
        n1.close()
        n2.close()


@PG
def test_migrating_to_event_transactions_counts_no_old_miss_again(pg_fresh_dsn, tmp_path):
    from warmbox.storage import registry as registry_mod

    dsn = pg_fresh_dsn
    reg = _registry(dsn, tmp_path, "n1", Bounds())
    reg.pools.ensure_pool("p", 1)
    for _ in range(3):
        reg.pools.pool_event("p", "miss")
    reg.close()
    with psycopg.connect(dsn, autocommit=True) as db:  # the registry as version 17 left it: rowid cursors
        db.execute("ALTER TABLE pool_events DROP COLUMN xid")
        db.execute("UPDATE pool_state SET events_seen = 2")  # the autoscaler saw two of the three
        db.execute("DELETE FROM schema_version")
        db.execute("INSERT INTO schema_version VALUES (17, 0)")
    assert registry_mod.migrate(dsn) == (17, registry_mod.SCHEMA_VERSION)
    reg = _registry(dsn, tmp_path, "n1", Bounds())
    try:
        seen = reg.pools.pool_rows()["p"].events_seen
        assert reg.pools.unseen_misses("p", seen)[0] == 0  # the old events are behind the cursor now
        reg.pools.pool_event("p", "miss")
        assert reg.pools.unseen_misses("p", seen)[0] == 1
    finally:
        reg.close()


@pytest.mark.parametrize("where", ["file", "env"])
def test_the_bounds_are_cluster_settings(tmp_path, monkeypatch, where):
    from warmbox.config import load
    from warmbox.errors import ConfigError
    from warmbox.storage.registry import bounds_of

    monkeypatch.delenv("WARMBOX_CONFIG", raising=False)
    home = tmp_path / "h"
    home.mkdir()
    assert bounds_of(load(home).cluster) == Bounds()  # 5 s lock, 30 s statement, 10 s idle, 30 s retries
    settings = {"lock_timeout": "2", "statement_timeout": "20", "idle_timeout": "4.5", "retry_budget": "12"}
    for k, v in settings.items():
        if where == "env":
            monkeypatch.setenv(f"WARMBOX_CLUSTER__{k.upper()}", v)
    if where == "file":
        (home / "warmbox.toml").write_text("[cluster]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    b = bounds_of(load(home).cluster)
    assert (b.lock_s, b.statement_s, b.idle_s, b.retry_budget_s) == (2, 20, 4.5, 12)
    assert (
        b.pg_options() == "-c lock_timeout=2000 -c statement_timeout=20000 -c idle_in_transaction_session_timeout=4500"
    )
    for k in settings:
        monkeypatch.delenv(f"WARMBOX_CLUSTER__{k.upper()}", raising=False)
    for bad in ("lock_timeout = 0", 'idle_timeout = "10s"', "statement_timeout = -1"):
        (home / "warmbox.toml").write_text(f"[cluster]\n{bad}\n")
        with pytest.raises(ConfigError, match="cluster\\."):
            load(home)


def test_a_sqlite_writer_lock_held_past_the_busy_timeout_is_registry_busy(tmp_path):
    import sqlite3

    bounds = Bounds(sqlite_busy_s=0.2, retry_budget_s=1)
    reg = Registry(tmp_path / "r.db", ledger=UidLedger(tmp_path / "uids", slots=8, first=MAX_SLOTS - 20), bounds=bounds)
    other = sqlite3.connect(tmp_path / "r.db", isolation_level=None)  # another process's writer, holding on
    try:
        other.execute("BEGIN IMMEDIATE")
        t0 = time.monotonic()
        with pytest.raises(RegistryBusy, match=r"busy timeout.*tried") as e:
            reg.tenants.create_key("acme")
        assert 0.8 <= e.value.waited_s <= time.monotonic() - t0 < 10
        other.execute("ROLLBACK")
        reg.tenants.create_key("acme")  # the lock gone, the same write goes through
    finally:
        other.close()
        reg.close()
