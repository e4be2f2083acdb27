"""Ports through a real `warmbox serve`: the HTTP preview route and the ports.connect WebSocket, behind
the tenant's key (another tenant's sandbox is not found; no key is refused), over TCP and the unix socket."""

from __future__ import annotations

import asyncio
import http.client
import json
import typing

import aiohttp
import pytest

from tests.conftest import start_server
from tests.server.test_api import UnixHTTPConnection, call, code_of
from warmbox import Sandbox, api
from warmbox import operations as ops

pytestmark = pytest.mark.sandbox

# A tiny server in the sandbox: echoes the method, path, a header and the body it got, as JSON.
ECHO = r"""
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.dumps({"method": self.command, "path": self.path, "body": self.rfile.read(n).decode(),
                           "x_test": self.headers.get("X-Test"), "authorization": self.headers.get("Authorization"),
                           "host": self.headers.get("Host")}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-From-Sandbox", "yes")
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = do_PUT = _answer
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), H).serve_forever()
"""


@pytest.fixture(scope="module")
def setup(home, runc_ready):
    """A server; tenants "owner" (with a sandbox running ECHO on port 8000) and "stranger"."""
    from warmbox.engine.engine import Engine

    server = start_server(home, home / "ports-api.sock")
    try:
        registry = Engine.for_home(home).registry
        _k, owner = registry.tenants.create_key("port-owner")
        _k, stranger = registry.tenants.create_key("port-stranger")
        with Sandbox.create(tier="container", timeout=600, api_url=server.url, api_key=owner) as sb:
            sb.files.write("/workspace/echo.py", ECHO)
            sb.commands.run("cd /workspace && (python3 echo.py >/tmp/echo.log 2>&1 &)")
            sb.get_host(8000, check=True, timeout=20)
            yield server, owner, stranger, sb.sandbox_id
    finally:
        server.stop()


def _preview(sid: str, path: str = "") -> str:
    return f"{api.PREFIX}/sandboxes/{sid}/ports/8000/{path}"


def test_preview_proxies_a_request_and_never_passes_the_key_on(setup):
    server, owner, _stranger, sid = setup
    status, data = call(server, "POST", _preview(sid, "a/b?q=1"), b"payload", {"X-Test": "t"}, key=owner)
    assert status == 201, data
    assert data == {
        "method": "POST",
        "path": "/a/b?q=1",
        "body": "payload",
        "x_test": "t",
        "authorization": None,  # the tenant's key stays on the host
        "host": "localhost:8000",
    }


def test_preview_headers_and_over_the_unix_socket(setup):
    server, _owner, _stranger, sid = setup
    conn = UnixHTTPConnection(server.socket, 30)  # root on the unix socket: no key
    try:
        conn.request("GET", _preview(sid, "x"))
        r = conn.getresponse()
        body = r.read()
    finally:
        conn.close()
    assert r.status == 201 and json.loads(body)["path"] == "/x"
    status, data = call(server, "GET", _preview(sid).rstrip("/") + "?a=b", key=None)
    assert status == 201 and data["path"] == "/?a=b", (status, data)
    assert r.getheader("X-From-Sandbox") == "yes"
    assert r.getheader("Content-Security-Policy") == "sandbox"  # sandbox pages cannot script the API origin


def test_preview_and_tunnel_of_another_tenant_are_not_found(setup):
    server, _owner, stranger, sid = setup
    status, data = call(server, "GET", _preview(sid), key=stranger)
    assert status == 404 and code_of(data) == "sandbox_not_found", (status, data)
    status, data = call(server, "GET", _preview(sid).rstrip("/"), key=stranger)
    assert status == 404 and code_of(data) == "sandbox_not_found", (status, data)
    status, data = call(server, "GET", _preview("sb-000000000000"), key=stranger)
    assert status == 404 and code_of(data) == "sandbox_not_found", (status, data)
    status, data = call(server, "GET", _preview(sid), key="")  # TCP without a key
    assert status == 401 and code_of(data) == "unauthenticated", (status, data)
    first, _ = asyncio.run(_tunnel(server.url, stranger, sid, 8000, b""))
    assert first["error"]["code"] == "sandbox_not_found", first
    first, _ = asyncio.run(_tunnel(server.url, "wbx_nope", sid, 8000, b""))
    assert first["error"]["code"] == "unauthenticated", first


def test_preview_of_a_port_nothing_listens_on(setup):
    server, owner, _stranger, sid = setup
    status, data = call(server, "GET", f"{api.PREFIX}/sandboxes/{sid}/ports/8999/", key=owner)
    assert status == 502 and code_of(data) == "port_not_listening", (status, data)
    status, data = call(server, "GET", f"{api.PREFIX}/sandboxes/{sid}/ports/70000/", key=owner)
    assert status == 400 and code_of(data) == "invalid_argument", (status, data)


async def _tunnel(url: str, key: str, sid: str, port: int, send: bytes) -> tuple[dict[str, typing.Any], bytes]:
    """A raw ports.connect WebSocket: its first message, then (if ok) what came back for ``send``."""
    path = api.BY_OP[ops.Op.PORTS_CONNECT].path.format(sandbox_id=sid)
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(
            f"{url}{path}", params={"port": str(port)}, headers={"Authorization": f"Bearer {key}"}
        ) as ws,
    ):
        first = json.loads((await ws.receive(timeout=30)).data)
        got = b""
        if first.get("ok"):
            await ws.send_bytes(send)
            await ws.send_str('{"eof":true}')
            while True:
                msg = await ws.receive(timeout=30)
                if msg.type is aiohttp.WSMsgType.BINARY:
                    got += msg.data
                else:
                    assert msg.data == '{"eof":true}', msg
                    break
        return first, got


def test_tunnel_websocket_relays_bytes_and_a_plain_get_is_refused(setup):
    server, owner, _stranger, sid = setup
    first, got = asyncio.run(_tunnel(server.url, owner, sid, 8000, b"GET /raw HTTP/1.0\r\nX-Test: ws\r\n\r\n"))
    assert first == {"ok": True}
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 201") and json.loads(body)["x_test"] == "ws", got
    first, _ = asyncio.run(_tunnel(server.url, owner, sid, 8999, b""))
    assert first["error"]["code"] == "port_not_listening", first
    path = api.BY_OP[ops.Op.PORTS_CONNECT].path.format(sandbox_id=sid)
    status, data = call(server, "GET", f"{path}?port=8000", key=owner)
    assert status == 400 and "WebSocket" in data["error"]["message"], (status, data)


def test_get_host_over_the_unix_socket_as_root(setup):
    server, _owner, _stranger, sid = setup
    sb = Sandbox.connect(sid, api_url=server.unix_url)  # root by SO_PEERCRED, no key
    try:
        addr, port = sb.get_host(8000).rsplit(":", 1)
        conn = http.client.HTTPConnection(addr, int(port), timeout=30)
        try:
            conn.request("GET", "/via-unix")
            r = conn.getresponse()
            assert r.status == 201 and json.loads(r.read())["path"] == "/via-unix"
        finally:
            conn.close()
    finally:
        sb.close()  # lets go; the sandbox stays the owner's
