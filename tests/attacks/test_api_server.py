"""Attacks on the API server itself (who it thinks the caller is, what a client can hold).

- A TCP client without a key claims to be a unix-socket peer (root) through proxy headers:
  uvicorn would rewrite the ASGI client from X-Forwarded-For; identity never comes from it.
- A non-admin key of a tenant borrows the admin flag of another key of the same tenant by
  sending its body slowly while the admin key makes a request (the fronts were shared).
- A client trickles a request header and never finishes it (slowloris).
- A tenant scrapes /metrics to learn about another tenant's sandboxes, and a sandbox's command
  text tries to become a metric label or value.

Each runs against a real `warmbox serve`.
"""

from __future__ import annotations

import http.client
import json
import secrets
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import start_server
from warmbox.engine.engine import Engine

pytestmark = pytest.mark.sandbox


def _raw(url: str, request: bytes, timeout: float = 20) -> tuple[int, dict]:
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body or b"null")


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


@pytest.fixture(scope="module")
def server(home: Path, runc_ready: None):
    srv = start_server(home, home / "identity.sock")
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    "headers",
    [
        "X-Forwarded-For: unix-peer-uid",
        "X-Forwarded-For: unix-peer-uid:0",
        "X-Forwarded-For: 127.0.0.1\r\nX-Forwarded-Proto: http",
        "X-Real-IP: 127.0.0.1\r\nForwarded: for=unix-peer-uid",
    ],
)
def test_proxy_headers_do_not_make_a_tcp_caller_root(server, headers):
    req = f"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n{headers}\r\nConnection: close\r\n\r\n".encode()
    status, body = _raw(server.url, req)
    assert (status, body["error"]["code"]) == (401, "unauthenticated")
    req = (
        f"POST /v1/snapshots/gc HTTP/1.1\r\nHost: x\r\n{headers}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    )
    status, body = _raw(server.url, req.encode())
    assert (status, body["error"]["code"]) == (401, "unauthenticated")


def test_a_plain_key_cannot_borrow_an_admin_keys_rights(server, home):
    registry = Engine.for_home(home).registry
    _, plain = registry.tenants.create_key("shared-tenant")
    _, admin = registry.tenants.create_key("shared-tenant", admin=True)
    u = urlsplit(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=20) as slow:
        # the plain key's admin-only request: headers now, the body after the admin key's request
        slow.sendall(
            f"POST /v1/snapshots/gc HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {plain}\r\n"
            "Content-Length: 2\r\nConnection: close\r\n\r\n".encode()
        )
        time.sleep(0.3)
        req = f"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {admin}\r\nConnection: close\r\n\r\n"
        status, _ = _raw(server.url, req.encode())
        assert status == 200
        slow.sendall(b"{}")
        data = b""
        while chunk := slow.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert int(head.split()[1]) == 403 and json.loads(body)["error"]["code"] == "forbidden"


def test_a_trickled_header_does_not_hold_a_connection(home: Path, runc_ready: None):
    """Slowloris: a client sends part of a request line and then nothing. The server closes the
    connection once the head is overdue (uvicorn's own keep-alive timer stops at the first byte)."""
    srv = start_server(home, home / "slow.sock", env={"WARMBOX_SERVER__BODY_TIMEOUT": "1"})
    try:
        u = urlsplit(srv.url)
        with socket.create_connection((u.hostname, u.port), timeout=20) as s:
            s.sendall(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            t0 = time.monotonic()
            assert s.recv(100) == b""  # closed by the server, no answer
            assert time.monotonic() - t0 < 10
    finally:
        srv.stop()


def _http(url: str, method: str, path: str, key: str, body: dict | None = None) -> tuple[int, bytes]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    headers = {"Authorization": f"Bearer {key}"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_metrics_show_a_tenant_nothing_of_another_and_no_sandbox_data(server, home):
    """Tenant "owner" runs a command in a real sandbox; tenant "spy" scrapes /metrics with its key
    and sees only its own tenant's series (none of owner's, no host-wide families); the full
    scrape (an admin key) carries no sandbox id and nothing of the command's text."""
    registry = Engine.for_home(home).registry
    _, owner = registry.tenants.create_key("metrics-owner")
    _, spy = registry.tenants.create_key("metrics-spy")
    _, ops = registry.tenants.create_key("metrics-ops", admin=True)
    marker = "zq" + secrets.token_hex(4)
    status, data = _http(server.url, "POST", "/v1/sandboxes", owner, {"timeout": 120})
    assert status == 200, data
    sid = json.loads(data)["info"]["sandbox_id"]
    try:
        status, data = _http(server.url, "POST", f"/v1/sandboxes/{sid}/commands", owner, {"cmd": f"echo {marker}"})
        assert status == 200 and marker.encode() in data, data
        status, spied_b = _http(server.url, "GET", "/metrics", spy)
        assert status == 200
    finally:
        assert _http(server.url, "DELETE", f"/v1/sandboxes/{sid}", owner)[0] == 200
    status, every_b = _http(server.url, "GET", "/metrics", ops)  # after the kill: its command is recorded
    assert status == 200
    spied, everything = spied_b.decode(), every_b.decode()
    assert "metrics-owner" not in spied and sid not in spied and "warmbox_http_requests" not in spied
    assert "warmbox_pool_" not in spied and "process_cpu" not in spied
    # the full view has owner's series and its command (so the checks above and below mean something)
    assert 'tenant="metrics-owner"' in everything and "warmbox_command_duration_seconds_count{" in everything
    assert sid not in everything and marker not in everything
