"""One tenant's key cannot make the router's monitor take a whole node down (issue 20).

The monitor marks a node down when its heartbeat is older than HEARTBEAT_TIMEOUT_S (10 s): every
live sandbox on it, whoever's, becomes lost and the node is fenced. The heartbeat used to run on
the node's event loop, next to its API: measured, 24 concurrent exports of one sandbox whose
command records were at the export cap (32 MiB of text; ~0.4 s each on the loop) aged the
heartbeat to 12.8 s. It now beats from a thread of its own: a busy loop is a slow node, not a
dead one.

Against a real `warmbox node join` on a real Ray head and PostgreSQL registry.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from warmbox import transcript
from warmbox.cluster import membership
from warmbox.cluster.monitor import HEARTBEAT_TIMEOUT_S
from warmbox.cluster.node import HEARTBEAT_S, ray_tmpdir
from warmbox.models import CommandRecord
from warmbox.paths import runtime_dir
from warmbox.server import peer
from warmbox.storage.registry import Registry

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]
SRC = Path(__file__).resolve().parents[2] / "src"
EXPORTS = 32  # concurrent: ~13 s of the node's loop (24 aged a loop-driven heartbeat to 12.8 s)
CELL = 4096


@pytest.fixture
def node(pg_fresh_dsn: str, runc_ready: None) -> Iterator[tuple[str, str, Registry]]:
    """A real node n1 (own home, Ray head, the test's database): (its API URL, a tenant key, registry)."""
    d = Path(tempfile.mkdtemp(prefix="wbhb-", dir="/tmp"))
    token = d / "cluster.token"
    peer.ensure_token(token)
    home = d / "n1"
    home.mkdir()
    (home / "warmbox.toml").write_text("[daemon]\nidle_exit = 3\n\n[pools]\n")
    head = membership.start_head(d / "h", token_file=token)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMBOX_", "RAY_"))}
    env.update(
        PYTHONPATH=str(SRC),
        WARMBOX_HOME=str(home),
        WARMBOX_CLUSTER__REGISTRY=pg_fresh_dsn,
        WARMBOX_CLUSTER__TOKEN_FILE=str(token),
        RAY_USAGE_STATS_ENABLED="0",
    )
    log = home / "node.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "warmbox.cli.main", "node", "join", head.address, "--name", "n1", "--slots", "4"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    registry = Registry(pg_fresh_dsn)
    url = ""
    try:
        deadline = time.monotonic() + 90
        while not url:
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("node n1 up: api "):
                    url = line.split()[4].rstrip(",")
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.1)
        _, key = registry.create_key("mallory")
        yield url, key, registry
    finally:
        for info, _ in registry.list(include_pooled=True):
            try:
                _call(url, key, "DELETE", f"/v1/sandboxes/{info.sandbox_id}")
            except OSError:
                pass
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in membership.processes_in(ray_tmpdir(home)):
            os.kill(pid, signal.SIGKILL)
        head.stop()
        registry.close()
        shutil.rmtree(ray_tmpdir(home), ignore_errors=True)
        shutil.rmtree(runtime_dir(home), ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)


def _call(url: str, key: str, method: str, path: str, body: dict | None = None) -> bytes:
    req = urllib.request.Request(
        url + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        method=method,
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.read()


def test_a_tenants_burst_of_heavy_requests_does_not_stop_the_nodes_heartbeat(node):
    url, key, registry = node
    sid = json.loads(_call(url, key, "POST", "/v1/sandboxes", {"tier": "container", "timeout": 300}))["info"][
        "sandbox_id"
    ]
    # the sandbox's records at the export cap (what ~40 s of 4 KiB run_code cells write)
    now = time.time()
    row = CommandRecord(
        sid, 0, "code", "#" + "x" * (CELL - 1), True, "python", now, 0.3, None, "", False, False, False, 0, 0
    )
    for _ in range(0, transcript.MAX_COMMAND_TEXT // CELL + 500, 2000):
        registry.add_commands([row] * 2000)
    ages: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            (n1,) = [n for n in registry.nodes() if n.name == "n1"]
            ages.append(time.time() - n1.heartbeat_at)
            time.sleep(0.2)

    def export() -> None:
        assert len(_call(url, key, "GET", f"/v1/sandboxes/{sid}/export")) > transcript.MAX_COMMAND_TEXT // 2

    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.monotonic()
    flood = [threading.Thread(target=export) for _ in range(EXPORTS)]
    for t in flood:
        t.start()
    for t in flood:
        t.join()
    took = time.monotonic() - t0
    time.sleep(2 * HEARTBEAT_S)
    done.set()
    watcher.join()
    print(f"{EXPORTS} exports took {took:.1f} s; the heartbeat's worst age {max(ages):.1f} s")
    assert took > HEARTBEAT_TIMEOUT_S / 2  # the node really was busy for a while
    assert max(ages) < HEARTBEAT_TIMEOUT_S / 2, max(ages)
    (n1,) = [n for n in registry.nodes() if n.name == "n1"]
    assert n1.state == "up"
