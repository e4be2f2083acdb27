"""/metrics and the JSON logs of a real `warmbox serve` (--log-format json): a tenant creates a
container sandbox, runs a command, pauses and resumes it, kills it (which writes its command
records); the scrape's counters are what it did, and the log has one record per request with its
id, tenant, route and sandbox id."""

from __future__ import annotations

import http.client
import json
import secrets
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProc, start_server
from tests.server.test_api import UnixHTTPConnection
from warmbox.engine.engine import Engine

pytestmark = pytest.mark.sandbox


def _call(server: ServerProc, method: str, path: str, body: dict | None = None, key: str | None = None):
    """(status, body bytes, X-Request-Id); over TCP with ``key``, else the unix socket as root."""
    if key is None:
        conn: http.client.HTTPConnection = UnixHTTPConnection(server.socket, timeout=120)
    else:
        u = urlsplit(server.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if body is not None:
        data = json.dumps(body)
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        return r.status, r.read(), r.getheader("x-request-id", "")
    finally:
        conn.close()


def _samples(text: str) -> list[tuple[str, dict, float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def _get(samples, name: str, **labels: str) -> float | None:
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


@pytest.fixture(scope="module")
def json_server(home: Path, runc_ready: None):
    s = start_server(home, home / "api-metrics.sock", env={"WARMBOX_SERVER__LOG_FORMAT": "json"})
    try:
        yield s
    finally:
        assert s.stop() == 0, s.output()


def test_scrape_counts_what_a_tenant_did(json_server, home):
    tenant = f"metrics-{secrets.token_hex(3)}"
    _key_id, key = Engine.for_home(home).registry.tenants.create_key(tenant)
    status, body, create_id = _call(json_server, "POST", "/v1/sandboxes", {"timeout": 120}, key=key)
    assert status == 200, body
    sid = json.loads(body)["info"]["sandbox_id"]
    try:
        status, body, exec_id = _call(json_server, "POST", f"/v1/sandboxes/{sid}/commands", {"cmd": "echo hi"}, key)
        assert status == 200 and b'"exit_code":0' in body, body
        status, body, _ = _call(json_server, "POST", f"/v1/sandboxes/{sid}/pause", {}, key)
        assert status == 200, body
        status, body, _ = _call(json_server, "POST", f"/v1/sandboxes/{sid}/resume", {}, key)
        assert status == 200, body
    finally:
        status, body, _ = _call(json_server, "DELETE", f"/v1/sandboxes/{sid}", key=key)
        assert status == 200, body

    status, body, _ = _call(json_server, "GET", "/metrics", key=key)
    assert status == 200, body
    mine = _samples(body.decode())
    assert {lab["tenant"] for _, lab, _ in mine if "tenant" in lab} == {tenant}
    t = {"tenant": tenant, "tier": "container"}
    assert _get(mine, "warmbox_sandbox_creates_total", source="cold", **t) == 1
    assert _get(mine, "warmbox_sandbox_create_failures_total", **t) == 0
    assert _get(mine, "warmbox_sandbox_pauses_total", **t) == 1
    assert _get(mine, "warmbox_sandbox_resumes_total", **t) == 1
    assert _get(mine, "warmbox_sandbox_resume_failures_total", **t) == 0
    assert _get(mine, "warmbox_sandboxes", tenant=tenant) is None  # destroyed: no longer a sandbox by state
    stage = {"tier": "container", "request_path": "true"}
    for s in ("allocation", "filesystem", "runtime"):
        assert _get(mine, "warmbox_stage_duration_seconds_count", stage=s, **stage) == 1, s
    assert _get(mine, "warmbox_pause_duration_seconds_count", tier="container") == 1
    assert _get(mine, "warmbox_resume_duration_seconds_count", tier="container") == 1
    assert (_get(mine, "warmbox_pause_duration_seconds_sum", tier="container") or 0) > 0
    assert _get(mine, "warmbox_command_duration_seconds_count", kind="command", tier="container") == 1
    assert (_get(mine, "warmbox_command_duration_seconds_sum", kind="command", tier="container") or 0) > 0
    assert _get(mine, "warmbox_command_outcomes_total", kind="command", tier="container", outcome="nonzero_exit") == 0
    assert _get(mine, "warmbox_tenant_cpu_seconds_total", tenant=tenant) is not None
    assert _get(mine, "warmbox_http_requests_total", route="/v1/sandboxes") is None  # host-wide: root's and admins'

    status, body, _ = _call(json_server, "GET", "/metrics")  # root on the unix socket: everything
    assert status == 200
    every = _samples(body.decode())
    for route, method in (("/v1/sandboxes", "POST"), ("/v1/sandboxes/{sandbox_id}/commands", "POST")):
        assert _get(every, "warmbox_http_requests_total", route=route, method=method, status="200") == 1, route
    assert _get(every, "warmbox_sandbox_creates_total", source="cold", **t) == 1
    assert (_get(every, "warmbox_http_request_duration_seconds_count", route="/v1/sandboxes", method="POST")) == 1

    log = json_server.log.read_text()  # the whole log (output() is its tail)
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    by_id = {r["request_id"]: r for r in records if r.get("logger") == "warmbox.server.access"}
    create, run = by_id[create_id], by_id[exec_id]
    assert create["tenant"] == tenant and create["route"] == "/v1/sandboxes" and create["status"] == 200
    assert run["sandbox_id"] == sid and run["route"] == "/v1/sandboxes/{sandbox_id}/commands"
    assert run["level"] == "info" and run["duration_ms"] > 0 and run["ts"]
    assert key not in log and key.split("_", 1)[1] not in log
