"""The router on a real cluster (tests/cluster/harness.py): what the issue's tests do not already
cover. A command in flight when its node's host dies ends typed (SandboxLost) once the cluster
knows, never a hang; the router's health endpoints; a node's drain report and its refusals; E2B's
routes (its SDK, unchanged) through the router."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import urllib.request

import aiohttp
import pytest

from tests.cluster.conftest import sdk
from tests.cluster.harness import DOWN_TIMEOUT_S, Cluster
from tests.wsecho import WS_ECHO
from warmbox import Sandbox, SandboxLost, WarmboxError
from warmbox import operations as ops
from warmbox.errors import DrainRefused, Forbidden, NodeNotFound
from warmbox.sdk.http import HttpTransport

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_health_and_readiness_of_the_router(cluster: Cluster):
    url = cluster.client_env["WARMBOX_API_URL"]
    assert _get(f"{url}/healthz") == (200, b'{"ok":true}')
    assert _get(f"{url}/readyz") == (200, b'{"ok":true}')


def _drain(cluster: Cluster, name: str, key: str) -> ops.DrainReport:
    async def go() -> ops.DrainReport:
        t = HttpTransport(cluster.client_env["WARMBOX_API_URL"], api_key=key)
        try:
            return await t.handle(ops.NodeDrain(name))
        finally:
            await t.close()

    return asyncio.run(go())


def test_drain_refusals_through_the_api(cluster: Cluster):
    with pytest.raises(Forbidden):
        _drain(cluster, "n1", cluster.client_env["WARMBOX_API_KEY"])  # a tenant key
    with pytest.raises(NodeNotFound):
        _drain(cluster, "nope", cluster.admin_key)
    others = [n for n in cluster.nodes if n != "n1"]
    for n in others:  # n1 the last node up
        cluster.registry().nodes.set_node_state(n, "draining")
    try:
        with pytest.raises(DrainRefused, match="last node up"):
            _drain(cluster, "n1", cluster.admin_key)
        assert cluster.node_state("n1") == "up"
    finally:
        for n in others:
            cluster.registry().nodes.set_node_state(n, "up")


def test_a_command_in_flight_when_its_node_dies_ends_lost(cluster: Cluster):
    """SIGKILL of the node's whole host while ``sleep 600`` runs there through the router: the call
    ends with SandboxLost (naming the node) within the cluster's detection bound, not at 600 s."""
    sb = Sandbox.create(timeout=600, **sdk(cluster))
    node = cluster.node_of(sb.sandbox_id)
    outcome: list[BaseException | None] = []
    ended = threading.Event()

    def run() -> None:
        try:
            sb.commands.run("sleep 600", timeout=700)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)
        ended.set()

    t = threading.Thread(target=run, daemon=True)
    try:
        t.start()
        time.sleep(1.5)  # the command runs on the node
        assert not ended.is_set(), outcome
        t0 = time.monotonic()
        cluster.kill_node(node, wait_down=False)
        assert ended.wait(DOWN_TIMEOUT_S), f"the call did not end {DOWN_TIMEOUT_S:g} s after its node's death"
        took = time.monotonic() - t0
        err = outcome[0]
        assert isinstance(err, SandboxLost), f"{type(err).__name__}: {err}"
        assert err.node == node and err.sandbox_id == sb.sandbox_id
        print(f"in-flight command on a killed node: SandboxLost after {took:.1f} s")
    finally:
        try:
            sb.kill()
        except WarmboxError:
            pass
        cluster.wait_state(node, "down")
        cluster.restart_node(node)


def test_the_router_serves_e2b_routes(cluster: Cluster, monkeypatch: pytest.MonkeyPatch):
    """E2B's official SDK against the router: create, commands.run, files, a WebSocket to a port,
    kill (its envd, port and control-plane routes run as operations on the router's fronts,
    forwarded to the nodes)."""
    e2b = pytest.importorskip("e2b", reason="the e2b extra (pip install -e '.[e2b]')")
    url = cluster.client_env["WARMBOX_API_URL"]
    for name, value in {"E2B_API_URL": url, "E2B_SANDBOX_URL": url}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("E2B_API_KEY", cluster.client_env["WARMBOX_API_KEY"])
    sb = e2b.Sandbox.create(timeout=120)
    try:
        assert sb.commands.run("echo from-a-node").stdout == "from-a-node\n"
        sb.files.write("e2b.txt", "through the router")
        assert sb.files.read("/home/user/e2b.txt") == "through the router"
        assert cluster.registry().nodes.node_of(sb.sandbox_id) in cluster.nodes
        # a WebSocket to a server in the sandbox (get_host's port), over the node's port tunnel
        sb.files.write("ws_echo.py", WS_ECHO)
        sb.commands.run("python3 /home/user/ws_echo.py", background=True)
        sb.commands.run("for i in $(seq 200); do (: >/dev/tcp/127.0.0.1/8765) 2>/dev/null && break; sleep 0.05; done")
        key = os.environ["E2B_API_KEY"]
        headers = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8765", "X-API-KEY": key}

        async def echo() -> str:
            async with aiohttp.ClientSession() as http, http.ws_connect(url + "/c", headers=headers) as ws:
                assert (await ws.receive_json(timeout=30))["path"] == "/c"
                await ws.send_str("via the router")
                return await ws.receive_str(timeout=30)

        assert asyncio.run(echo()) == "via the router"
    finally:
        sb.kill()
    assert e2b.Sandbox.kill(sb.sandbox_id) is False  # gone
