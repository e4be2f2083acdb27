"""One real cluster node for the attack tests marked cluster: a Ray head, `warmbox node join n1`
(its own home, the test's PostgreSQL database) and the cluster's certificates, as the router would
have them. Not a test module: the fixtures of test_node_heartbeat.py and test_node_access.py."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from warmbox.cluster import membership, tls
from warmbox.cluster.node import ray_tmpdir
from warmbox.paths import runtime_dir
from warmbox.server import peer
from warmbox.storage.registry import Registry

SRC = Path(__file__).resolve().parents[2] / "src"
UP_WITHIN_S = 90.0  # a node's start on a loaded 2-core host: doctor, its raylet, its API


@dataclasses.dataclass
class OneNode:
    """A running node: its API's URL (https), the cluster's token, the shared registry, and the
    directory of the cluster's certificates (the CA key is there too: tests issue certificates)."""

    url: str
    token: str
    registry: Registry
    tls_dir: Path
    home: Path

    def router_context(self) -> ssl.SSLContext:
        """TLS as the router makes it: the cluster's CA, the router's certificate."""
        return tls.member(self.tls_dir, tls.ROUTER).client_context()

    def call(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        headers: dict[str, str] | None = None,
        context: ssl.SSLContext | None = None,
        timeout: float = 300,
    ) -> tuple[int, bytes]:
        """(status, body) of one request; ``headers`` default to the router's for tenant mallory."""
        h = {"Authorization": f"Bearer {self.token}", peer.TENANT: "mallory"} if headers is None else headers
        req = urllib.request.Request(
            self.url + path,
            data=None if body is None else json.dumps(body).encode(),
            headers={**h, "Content-Type": "application/json"},
            method=method,
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=context or self.router_context()) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()


@contextlib.contextmanager
def one_node(dsn: str, *, slots: int = 4, config: str = "[daemon]\nidle_exit = 3\n\n[pools]\n") -> Iterator[OneNode]:
    """Node n1 of a fresh cluster (head, certificates, token) on ``dsn``; everything it made is
    removed after (its sandboxes killed through its API as the router's root, by PID otherwise)."""
    d = Path(tempfile.mkdtemp(prefix="wbnd-", dir="/tmp"))  # short: Ray's sockets
    token = d / "cluster.token"
    peer.ensure_token(token)
    head = membership.start_head(d / "h", token_file=token, tls=tls.head_member(d, tls.local_ips()))
    tls.issue(d, tls.ROUTER)
    tls.issue(d, tls.node_member("n1"), tls.local_ips())  # its Ray address: the GCS checks it
    home = d / "n1"
    home.mkdir()
    (home / "warmbox.toml").write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMBOX_", "RAY_"))}
    env.update(
        PYTHONPATH=str(SRC),
        WARMBOX_HOME=str(home),
        WARMBOX_CLUSTER__REGISTRY=dsn,
        WARMBOX_CLUSTER__TOKEN_FILE=str(token),
        RAY_USAGE_STATS_ENABLED="0",
    )
    log = home / "node.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "warmbox.cli.main",
                "node",
                "join",
                head.address,
                "--name",
                "n1",
                "--slots",
                f"{slots}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    registry = Registry(dsn)
    node: OneNode | None = None
    try:
        deadline = time.monotonic() + UP_WITHIN_S
        url = ""
        while not url:
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("node n1 up: api "):
                    url = line.split()[4].rstrip(",")
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.1)
        node = OneNode(url, peer.read_token(token), registry, d, home)
        yield node
    finally:
        if node is not None:
            for info, _ in registry.sandboxes.list(include_pooled=True):
                with contextlib.suppress(OSError):
                    node.call(
                        "DELETE", f"/v1/sandboxes/{info.sandbox_id}", headers={"Authorization": f"Bearer {node.token}"}
                    )
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
