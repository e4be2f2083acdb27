"""The app in process (Starlette's test client, no sandbox): authentication, rate limits, refusals
of the listener settings, and typed errors for requests that never reach a sandbox."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from warmbox import api
from warmbox.config import ServerSettings
from warmbox.engine.engine import Engine
from warmbox.errors import ConfigError
from warmbox.server.app import RateLimiter, build_app
from warmbox.server.serve import check_listen, is_loopback


@pytest.fixture
def engine(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMBOX_RUNTIME_DIR", str(tmp_path / "rt"))
    return Engine.for_home(tmp_path / "home")


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, ServerSettings(), mcp=False), raise_server_exceptions=False) as c:
        yield c


def _error(r) -> str:
    return r.json()["error"]["code"]


def test_every_route_needs_a_key(client):
    for route in api.ROUTES:
        path = route.path.format(**dict.fromkeys(route.path_fields, "sb-0123456789ab"))
        r = client.request(route.method, path)
        assert r.status_code == 401 and _error(r) == "unauthenticated", (route, r.text)
    for header in ("Bearer", "Bearer wbx_nope", "Basic dXNlcjpwYXNz", "bearer  "):
        r = client.get("/v1/sandboxes", headers={"Authorization": header})
        assert r.status_code == 401 and _error(r) == "unauthenticated", header


def test_a_key_works_until_revoked(client, engine):
    key_id, secret = engine.registry.tenants.create_key("acme")
    auth = {"Authorization": f"Bearer {secret}"}
    r = client.get("/v1/sandboxes", headers=auth)
    assert r.status_code == 200 and r.json() == []
    r = client.get("/v1/sandboxes/sb-0123456789ab", headers=auth)
    assert r.status_code == 404 and _error(r) == "sandbox_not_found"
    assert engine.registry.tenants.revoke_key(key_id)
    r = client.get("/v1/sandboxes", headers=auth)
    assert r.status_code == 401 and _error(r) == "unauthenticated"


def test_admin_only_operations(client, engine):
    _, plain = engine.registry.tenants.create_key("acme")
    _, admin = engine.registry.tenants.create_key("ops", admin=True)
    r = client.post("/v1/snapshots/gc", headers={"Authorization": f"Bearer {plain}"}, json={})
    assert r.status_code == 403 and _error(r) == "forbidden"
    r = client.post("/v1/pools/default/resize", headers={"Authorization": f"Bearer {plain}"}, json={"target": 1})
    assert r.status_code == 403 and _error(r) == "forbidden"
    r = client.post("/v1/snapshots/gc", headers={"Authorization": f"Bearer {admin}"}, json={})
    assert r.status_code == 200, r.text


def test_rate_limit_per_key(client, engine):
    _, slow = engine.registry.tenants.create_key("slow", rate_per_s=2)
    _, fast = engine.registry.tenants.create_key("fast")
    codes = [client.get("/v1/sandboxes", headers={"Authorization": f"Bearer {slow}"}).status_code for _ in range(12)]
    assert codes[:5] == [200] * 5 and 429 in codes  # a burst of max(rate, 5), then refused
    r = client.get("/v1/sandboxes", headers={"Authorization": f"Bearer {slow}"})
    assert r.status_code == 429 and _error(r) == "rate_limited" and int(r.headers["retry-after"]) >= 1
    r = client.get("/v1/sandboxes", headers={"Authorization": f"Bearer {fast}"})
    assert r.status_code == 200  # another key is not affected


def test_rate_limiter_refills():
    lim = RateLimiter()
    for _ in range(5):
        lim.take("k", 1.0)
    with pytest.raises(Exception, match="requests/s"):
        lim.take("k", 1.0)
    lim.take("other", 0)  # 0: unlimited


@pytest.mark.parametrize(
    ("method", "path", "kw", "code", "status"),
    [
        ("POST", "/v1/sandboxes", {"content": b"{nope"}, "invalid_argument", 400),
        ("POST", "/v1/sandboxes", {"json": [1, 2]}, "invalid_argument", 400),
        ("POST", "/v1/sandboxes", {"json": {"tier": 5}}, "invalid_argument", 400),
        ("POST", "/v1/sandboxes", {"json": {"limits": {"memory_mb": 10**12}}}, "limit_too_high", 422),
        ("POST", "/v1/sandboxes", {"json": {"network": {"allow": "x"}}}, "invalid_argument", 400),
        ("POST", "/v1/sandboxes", {"json": {"secrets": {"T": {"value": "v"}}}}, "invalid_argument", 400),
        ("GET", "/v1/sandboxes?include_dead=maybe", {}, "invalid_argument", 400),
        ("GET", "/v1/sandboxes?bogus=1", {}, "invalid_argument", 400),
        ("GET", "/v1/sandboxes/not-an-id", {}, "sandbox_not_found", 404),
        ("POST", "/v1/sandboxes", {"json": {"timeout": 10**400}}, "invalid_argument", 400),
        ("POST", "/v1/sandboxes", {"content": b'{"timeout": NaN}'}, "invalid_argument", 400),
        ("POST", "/v1/sandboxes", {"content": b'{"timeout": Infinity}'}, "invalid_argument", 400),
        ("POST", "/v1/sandboxes", {"content": b"[" * 5000 + b"]" * 5000}, "invalid_argument", 400),
        ("GET", "/v1/snapshots?bogus=" + "9" * 500, {}, "invalid_argument", 400),
        ("GET", "/v1/nowhere", {}, "route_not_found", 404),
        ("PATCH", "/v1/sandboxes", {}, "route_not_found", 405),
    ],
)
def test_bad_input_is_a_typed_4xx(client, engine, method, path, kw, code, status):
    _, secret = engine.registry.tenants.create_key("acme")
    r = client.request(method, path, headers={"Authorization": f"Bearer {secret}"}, **kw)
    assert (r.status_code, _error(r)) == (status, code), r.text
    assert client.get("/v1/sandboxes", headers={"Authorization": f"Bearer {secret}"}).status_code == 200


def test_what_the_server_holds_is_bounded_whatever_the_client_asks():
    from warmbox import operations as ops
    from warmbox.server.app import MAX_OUTPUT, _bound

    settings = ServerSettings(max_body_mb=2)
    assert _bound(ops.Exec("sb-1", "true", max_output=10**11), settings).max_output == MAX_OUTPUT
    assert _bound(ops.RunCode("sb-1", "1", max_output=10**11), settings).max_output == MAX_OUTPUT
    assert _bound(ops.ReadFile("sb-1", "f"), settings).max_bytes == 2 << 20  # a larger file: FileTooLarge
    assert _bound(ops.ReadFile("sb-1", "f", max_bytes=10), settings).max_bytes == 10
    assert _bound(ops.ReadFileStream("sb-1", "f"), settings).max_bytes is None  # streamed: not held, no cap


def test_nan_is_refused_naming_the_field():
    from warmbox import operations as ops
    from warmbox import wire
    from warmbox.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="timeout must be a finite number"):
        wire.decode_record(ops.Create, wire.loads(b'{"timeout": NaN}'))


def test_openapi_is_served(client):
    r = client.get("/v1/openapi.json")
    assert r.status_code == 200 and r.json()["openapi"].startswith("3.")


def test_listen_refuses_clear_text_off_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    check_listen(ServerSettings(host="127.0.0.1"))
    with pytest.raises(ConfigError, match="without TLS"):
        check_listen(ServerSettings(host="0.0.0.0"))
    check_listen(ServerSettings(host="0.0.0.0", tls_cert="c.pem", tls_key="k.pem"))


def test_health_and_readiness_need_no_key_and_say_nothing_of_tenants(client, engine):
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"ok": True}
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json() == {"ok": True}
    client.app.state.service.stopping = True  # SIGTERM: load balancers stop sending while it finishes
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json() == {"ok": False, "reason": "shutting down"}


def test_a_node_drain_on_one_host_is_a_typed_refusal(client, engine):
    _, plain = engine.registry.tenants.create_key("acme")
    _, admin = engine.registry.tenants.create_key("ops", admin=True)
    r = client.post("/v1/nodes/n1/drain", headers={"Authorization": f"Bearer {plain}"}, json={})
    assert r.status_code == 403 and _error(r) == "forbidden"
    r = client.post("/v1/nodes/n1/drain", headers={"Authorization": f"Bearer {admin}"}, json={})
    assert r.status_code == 422 and _error(r) == "not_a_cluster" and r.json()["error"]["node"] == "n1"


def test_tcp_connections_are_served_without_nagle():
    """A response goes out in pieces (head, then body): with Nagle on, each kept-alive request
    waited ~40 ms for the client's delayed ACK (a cluster's router forwards every call over TCP).
    asyncio turns Nagle off only on sockets made with proto=IPPROTO_TCP; ours are made with 0."""
    import socket

    from warmbox.server.serve import _no_delay, _tcp_socket

    listener = _tcp_socket("127.0.0.1", 0)
    client = socket.create_connection(listener.getsockname())
    conn, _ = listener.accept()
    try:
        assert conn.proto == 0 and conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        _no_delay(conn)
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        a, b = socket.socketpair()  # a unix socket: left alone
        _no_delay(a)
        a.close()
        b.close()
    finally:
        for s in (conn, client, listener):
            s.close()
