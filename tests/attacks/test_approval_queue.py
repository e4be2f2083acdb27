"""Attacks on the approval queue through a real `warmbox serve`: a tenant over its budget tries
to approve its own start; another tenant tries to read or answer that question; an answer is
sent twice."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import start_server
from warmbox.engine.engine import Engine

pytestmark = pytest.mark.sandbox


def _http(url: str, method: str, path: str, key: str, body: dict | None = None) -> tuple[int, object]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()


def test_a_tenant_can_neither_lift_its_own_budget_nor_see_or_answer_another_tenants_questions(
    home: Path, runc_ready: None
):
    registry = Engine.for_home(home).registry
    stamp = time.time_ns() % 10**9
    _, owner = registry.tenants.create_key(f"apq-owner{stamp}", budget_cpu_h=0.001)  # any start goes past it
    _, other = registry.tenants.create_key(f"apq-other{stamp}")
    _, admin = registry.tenants.create_key(f"apq-ops{stamp}", admin=True)
    srv = start_server(home, home / "apq.sock", env={"WARMBOX_APPROVALS__TIMEOUT": "60"})
    created: list[tuple[int, object]] = []
    try:
        body = {"limits": {"memory_mb": 256, "cpus": 1}, "pool": False}
        t = threading.Thread(target=lambda: created.append(_http(srv.url, "POST", "/v1/sandboxes", owner, body)))
        t.start()
        deadline = time.monotonic() + 30
        while True:
            status, pending = _http(srv.url, "GET", "/v1/approvals?pending_only=true", owner)
            assert status == 200
            if pending:
                break
            assert time.monotonic() < deadline, "the create asked no question"
            time.sleep(0.05)
        [q] = pending  # type: ignore[misc]
        aid = q["approval_id"]
        assert q["kind"] == "create" and q["state"] == "pending" and "over budget" in q["reason"]

        # the owner cannot approve its own start over budget
        status, err = _http(srv.url, "POST", f"/v1/approvals/{aid}", owner, {"decision": "approve"})
        assert (status, err["error"]["code"]) == (403, "forbidden")  # type: ignore[index]
        # another tenant neither sees nor answers it (not found, as an unknown id)
        assert _http(srv.url, "GET", "/v1/approvals", other) == (200, [])
        for decision in ("approve", "deny"):
            status, err = _http(srv.url, "POST", f"/v1/approvals/{aid}", other, {"decision": decision})
            assert (status, err["error"]["code"]) == (404, "approval_not_found")  # type: ignore[index]
        status, unknown = _http(srv.url, "POST", "/v1/approvals/ap-0000000000000000", other, {"decision": "deny"})
        assert (status, unknown["error"]["code"]) == (404, "approval_not_found")  # type: ignore[index]
        assert not created  # still waiting

        # the operator (an admin key) sees every tenant's and answers; a second answer is refused
        status, everyone = _http(srv.url, "GET", "/v1/approvals", admin)
        assert status == 200 and aid in {a["approval_id"] for a in everyone}  # type: ignore[union-attr]
        status, answered = _http(srv.url, "POST", f"/v1/approvals/{aid}", admin, {"decision": "deny"})
        assert status == 200 and answered["state"] == "denied"  # type: ignore[index]
        t.join(30)
        [(status, err)] = created
        assert status == 403 and err["error"]["code"] == "approval_denied"  # type: ignore[index]
        assert err["error"]["approval_id"] == aid and err["error"]["state"] == "denied"  # type: ignore[index]
        status, again = _http(srv.url, "POST", f"/v1/approvals/{aid}", admin, {"decision": "approve"})
        assert (status, again["error"]["code"], again["error"]["state"]) == (409, "approval_closed", "denied")  # type: ignore[index]
        assert _http(srv.url, "GET", "/v1/sandboxes?include_dead=true", owner) == (200, [])
    finally:
        t.join(60)
        srv.stop()
