"""A tenant cannot make the cluster's router scan every tenant's snapshots per request (issue 20).

A create from a snapshot (and a resume by snapshot name) asks the router for the snapshot's
sandbox (its tier and memory, for placement). The router read the whole ``snapshots`` table for
that, on its event loop: at 100k snapshots (any tenants') 0.1-0.2 s per request, so a tenant
repeating ``create(from_snapshot="no-such")`` held every other caller of that router. It now
reads one row by the snapshot's key: PostgreSQL's own counters say no row of the table is
scanned, however many requests.

A real ClusterFront on a real PostgreSQL registry with 20,000 snapshots of another tenant.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from warmbox import operations as ops
from warmbox.cluster.router import Cluster, ClusterFront
from warmbox.config import load
from warmbox.errors import NoCapacity, WarmboxError
from warmbox.models import Tenant
from warmbox.storage.registry import Registry

pytestmark = pytest.mark.sandbox
SNAPSHOTS = 20_000
REQUESTS = 50


def _rows_read(dsn: str) -> int:
    """Rows of ``snapshots`` read so far (by scans and by index), as PostgreSQL counts them: its
    backends flush their counts when they end, so callers close their connections first."""
    import psycopg

    time.sleep(0.5)  # the closed connections' backends have exited and flushed
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0) FROM pg_stat_user_tables "
            "WHERE relname='snapshots'"
        ).fetchone()
    return int(row[0])


def test_a_create_from_an_unknown_snapshot_reads_one_row_not_the_table(pg_fresh_dsn, tmp_path):
    import psycopg

    with psycopg.connect(pg_fresh_dsn, autocommit=True) as c, c.cursor() as cur:
        Registry(pg_fresh_dsn).close()  # the schema
        now = time.time()
        cur.executemany(
            "INSERT INTO snapshots (snapshot_id, sandbox_id, created_at, size_bytes, tenant) VALUES (%s,%s,%s,%s,%s)",
            [(f"snap-{i:012x}", f"sb-{i:012x}", now, 1000, "victim") for i in range(SNAPSHOTS)],
        )
    before = _rows_read(pg_fresh_dsn)
    registry = Registry(pg_fresh_dsn)
    front = ClusterFront(Cluster(registry, "t" * 32, lambda: load(tmp_path / "home")), Tenant(name="mallory"))
    try:
        for i in range(REQUESTS):
            for request in (ops.Create(from_snapshot=f"no-such-{i}"), ops.Resume(snapshot=f"no-such-{i}")):
                with pytest.raises(WarmboxError) as caught:  # no node is up: nowhere to place it
                    asyncio.run(front.handle(request))
                assert isinstance(caught.value, NoCapacity), caught.value
    finally:
        registry.close()
    read = _rows_read(pg_fresh_dsn) - before
    assert read < REQUESTS * 2 * 2, f"{read} snapshot rows read for {REQUESTS * 2} requests"  # a scan: 2,000,000
