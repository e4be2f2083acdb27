"""A node stopped while it holds a registry lock does not stop the cluster's creates (issue 39).

A node's process frozen mid-transaction (SIGSTOP, a paused VM, a host that stopped answering)
keeps its PostgreSQL transaction open and its locks held: a tenant's quota lock, taken by every
create of that tenant on any node. With no bound, every other node's create for the tenant waited
as long as the node stayed stopped. Now every registry connection sets lock_timeout,
statement_timeout and idle_in_transaction_session_timeout: the server ends the stopped node's
session after [cluster] idle_timeout, its locks go, and the waiting create (its lock wait timed
out, its transaction retried within retry_budget) goes through.

Against a real `warmbox serve` whose engine is node "n2" of a real PostgreSQL registry, creating
real container sandboxes; node "n1" is a real process holding the lock in a real transaction.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from tests.attacks.conftest import create_over_api, end_node_server
from tests.conftest import start_server
from warmbox.models import NodeInfo
from warmbox.storage.registry import Registry

pytestmark = pytest.mark.sandbox

ROOT = Path(__file__).resolve().parents[2]
IDLE_S = 3  # the cluster's [cluster] idle_timeout here (default 10): the test waits it out once

# node n1's registry process, stopped in the middle of a create of tenant acme: the quota lock and
# the tenant's row held in an open transaction
_HOLDER = """
import sys
from pathlib import Path
from warmbox.storage.registry import Registry
from warmbox.storage.sql import Bounds
from warmbox.storage.uidslots import UidLedger, MAX_SLOTS
reg = Registry(sys.argv[1], "n1", ledger=UidLedger(Path(sys.argv[2]), slots=4, first=MAX_SLOTS - 40),
               bounds=Bounds(lock_s=1, idle_s=float(sys.argv[3])))
with reg.dialect.transaction(["tenant:acme"]) as db:
    db.execute("SELECT name FROM tenants WHERE name=? FOR UPDATE", ("acme",))
    print(db.execute("SELECT pg_backend_pid()").fetchone()[0], flush=True)
    sys.stdin.readline()
    db.execute("SELECT 1")
"""


def test_a_stopped_node_holding_a_tenants_lock_does_not_block_the_other_nodes(pg_fresh_dsn, runc_ready):
    dsn = pg_fresh_dsn
    home = Path(tempfile.mkdtemp(prefix="wbsn-", dir="/tmp"))
    (home / "warmbox.toml").write_text("[daemon]\nidle_exit = 3\n\n[pools]\n")
    router = Registry(dsn)  # the router's view of the shared registry
    router.nodes.join_node(NodeInfo("n2", address="http://127.0.0.1:1", slots=4, tiers=("container",)))
    _, key = router.tenants.create_key("acme")
    env = {
        "WARMBOX_CLUSTER__REGISTRY": dsn,
        "WARMBOX_CLUSTER__NODE": "n2",
        "WARMBOX_CLUSTER__DIRECT_ACCESS": "true",  # the test calls the node as the router would
        "WARMBOX_CLUSTER__LOCK_TIMEOUT": "1",
        "WARMBOX_CLUSTER__IDLE_TIMEOUT": str(IDLE_S),
    }
    srv = start_server(home, home / "api.sock", env=env)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, dsn, str(home / "uids-n1"), str(IDLE_S)],
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    made: list[str] = []
    try:
        assert holder.stdout is not None and holder.stdin is not None
        backend = int(holder.stdout.readline())
        with psycopg.connect(dsn, autocommit=True) as db:  # n1 holds the quota lock, really
            held = db.execute("SELECT locktype FROM pg_locks WHERE pid=%s AND granted", (backend,)).fetchall()
        assert ("advisory",) in held
        os.kill(holder.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        took = []
        for _ in range(3):
            status, opened = create_over_api(srv.url, key)
            assert status in (200, 201), opened
            made.append(opened["info"]["sandbox_id"])
            took.append(round(time.monotonic() - t0, 1))
        # the first create waited for n1's session to end (IDLE_S, plus its own create); none
        # waited for n1 to wake: it is still stopped
        assert took[-1] < 60, took
        assert holder.poll() is None and Path(f"/proc/{holder.pid}/stat").read_text().split(") ")[1][0] == "T"
        with psycopg.connect(dsn, autocommit=True) as db:  # n1's session was ended (its exit may lag a moment)
            deadline = time.monotonic() + 10
            while db.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE pid=%s", (backend,)).fetchone() != (0,):
                assert time.monotonic() < deadline, "the stopped node's session still runs"
                time.sleep(0.05)
        assert {router.nodes.node_of(sid) for sid in made} == {"n2"}
        print("creates done at (s after n1 stopped):", took)
        os.kill(holder.pid, signal.SIGCONT)  # woken, n1 finds its transaction ended: it wrote nothing
        holder.stdin.write("go on\n")
        holder.stdin.flush()
        assert holder.wait(30) != 0
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)
        holder.wait(30)
        for f in (holder.stdin, holder.stdout):
            if f is not None:
                f.close()
        end_node_server(srv, router, key, home)
