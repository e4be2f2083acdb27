"""Attacks through E2B's wire dialect on a real `warmbox serve`: tenant B (its own key, its own
sandbox's access token, a forged token) goes for tenant A's sandbox through every E2B plane: the
control plane (X-API-KEY), envd's Connect RPC and /files, the code interpreter. Each answer is the
one an unknown sandbox gets (404) or a refused credential (401); A's sandbox is untouched."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import start_server
from tests.wsecho import WS_ECHO
from warmbox.engine.engine import Engine
from warmbox.server.tunnel import WS_PER_SANDBOX

pytestmark = pytest.mark.sandbox
httpx = pytest.importorskip("httpx")
pytest.importorskip("e2b", reason="the e2b extra (pip install -e '.[e2b]')")

RPC = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}


@pytest.fixture(scope="module")
def two_tenants(home, runc_ready):
    """A server; tenants A and B, each with a base sandbox made through E2B's create route."""
    server = start_server(home, home / "e2b-walls.sock")
    made: list[tuple[httpx.Client, str]] = []
    try:
        registry = Engine.for_home(home).registry
        out = {}
        for name in ("wall-a", "wall-b"):
            _k, key = registry.tenants.create_key(name)
            client = httpx.Client(base_url=server.url, timeout=60, headers={"X-API-KEY": key})
            r = client.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
            assert r.status_code == 201, r.text
            body = r.json()
            made.append((client, body["sandboxID"]))
            out[name] = (key, body["sandboxID"], body["envdAccessToken"])
        yield server.url, out
    finally:
        for client, sid in made:
            client.delete(f"/sandboxes/{sid}")
            client.close()
        server.stop()


def _data(sid: str, port: int, **extra: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port), **extra}


def test_another_tenants_key_gets_not_found_on_every_plane(two_tenants):
    url, t = two_tenants
    key_b = t["wall-b"][0]
    _key_a, sid_a, _token_a = t["wall-a"]
    with httpx.Client(base_url=url, timeout=60, headers={"X-API-KEY": key_b}) as b:
        assert sid_a not in {s["sandboxID"] for s in b.get("/v2/sandboxes").json()}
        for method, path, body in (
            ("GET", f"/sandboxes/{sid_a}", None),
            ("DELETE", f"/sandboxes/{sid_a}", None),
            ("POST", f"/sandboxes/{sid_a}/timeout", {"timeout": 1}),
            ("POST", f"/sandboxes/{sid_a}/pause", {}),
            ("POST", f"/v2/sandboxes/{sid_a}/connect", {"timeout": 10}),
            ("GET", f"/sandboxes/{sid_a}/metrics", None),
        ):
            r = b.request(method, path, json=body)
            assert (r.status_code, r.json()["code"]) == (404, 404), (method, path, r.text)
        envd = _data(sid_a, 49983)
        for rpc, body in (
            ("/process.Process/List", {}),
            ("/filesystem.Filesystem/ListDir", {"path": "/workspace"}),
            ("/filesystem.Filesystem/Remove", {"path": "/workspace"}),
        ):
            r = b.post(rpc, json=body, headers={**envd, **RPC})
            assert (r.status_code, r.json()["code"]) == (404, "not_found"), (rpc, r.text)
        r = b.get("/files", params={"path": "/etc/hostname"}, headers=envd)
        assert r.status_code == 404
        r = b.post(
            "/files",
            params={"path": "/workspace/planted"},
            content=b"x",
            headers={**envd, "Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 404
        jupyter = _data(sid_a, 49999)
        assert b.post("/execute", json={"code": "open('/workspace/x','w')"}, headers=jupyter).status_code == 404
        assert b.post("/contexts", json={}, headers=jupyter).status_code == 404


def test_a_sandbox_token_opens_only_its_own_sandbox(two_tenants):
    url, t = two_tenants
    _key_a, sid_a, token_a = t["wall-a"]
    _key_b, sid_b, token_b = t["wall-b"]
    with httpx.Client(base_url=url, timeout=60) as http:
        # B's token, its key's id, a forged MAC, no credential: never A's front
        forged = token_b.rsplit(".", 1)[0] + "." + token_a.rsplit(".", 1)[1]
        for token in (token_b, forged, token_a + "x", ""):
            headers = {**_data(sid_a, 49983), **RPC}
            if token:
                headers["X-Access-Token"] = token
            r = http.post("/process.Process/List", json={}, headers=headers)
            assert (r.status_code, r.json()["code"]) == (401, "unauthenticated"), (token[:12], r.text)
            r = http.post(
                "/execute", json={"code": "1"}, headers={**_data(sid_a, 49999), "E2B-Traffic-Access-Token": token}
            )
            assert r.status_code == 401, r.text
        # A's token on B's sandbox is refused too; each token works on its own sandbox
        r = http.post(
            "/process.Process/List", json={}, headers={**_data(sid_b, 49983), "X-Access-Token": token_a, **RPC}
        )
        assert r.status_code == 401
        for sid, token in ((sid_a, token_a), (sid_b, token_b)):
            r = http.post(
                "/process.Process/List", json={}, headers={**_data(sid, 49983), "X-Access-Token": token, **RPC}
            )
            assert r.status_code == 200, r.text


def test_another_tenant_reaches_no_port_of_a_sandbox(two_tenants):
    """get_host's ports (domain mode's Host, or the routing headers): B's key is not found, B's own
    sandbox's token is refused, no credential is refused, on A's sandbox; A's own token gets through
    to the port (nothing listens there: 502)."""
    url, t = two_tenants
    key_b, _sid_b, token_b = t["wall-b"]
    _key_a, sid_a, token_a = t["wall-a"]
    host = {"Host": f"8000-{sid_a}.e2b.test"}
    with httpx.Client(base_url=url, timeout=60) as c:
        for routing in (host, _data(sid_a, 8000)):
            assert c.get("/", headers={**routing, "X-API-KEY": key_b}).status_code == 404
            assert c.get("/", headers={**routing, "E2B-Traffic-Access-Token": token_b}).status_code == 401
            assert c.get("/", headers=routing).status_code == 401
        # the Host wins over headers naming B's own sandbox
        spoof = {**host, "E2b-Sandbox-Id": _sid_b, "X-API-KEY": key_b}
        assert c.get("/", headers=spoof).status_code == 404
        r = c.get("/", headers={**host, "E2B-Traffic-Access-Token": token_a})
        assert r.status_code == 502, r.text


def _signed(path: str, operation: str, token: str, expiration: int | None = None) -> dict[str, str]:
    from e2b.sandbox.signature import get_signature  # E2B's own signer, as its SDKs sign

    sig = get_signature(path, operation, None, token, None if expiration is None else expiration)
    query = {"path": path, "signature": sig["signature"]}
    if sig["expiration"] is not None:
        query["signature_expiration"] = str(sig["expiration"])
    return query


def test_a_signed_file_url_opens_only_what_it_was_signed_for(two_tenants):
    """Signed /files URLs: B's token signing for A's sandbox, A's read URL used to write, for
    another path, or expired, are 401 and touch nothing; A's own read URL works."""
    url, t = two_tenants
    _key_b, _sid_b, token_b = t["wall-b"]
    _key_a, sid_a, token_a = t["wall-a"]
    envd = _data(sid_a, 49983)
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/files", params=_signed("/etc/hostname", "read", token_a), headers=envd).status_code == 200
        assert c.get("/files", params=_signed("/etc/hostname", "read", token_b), headers=envd).status_code == 401
        planted = {**_signed("/home/user/planted", "write", token_b), "username": ""}
        r = c.post("/files", params=planted, files={"file": ("planted", b"x")}, headers=envd)
        assert r.status_code == 401
        as_write = _signed("/home/user/planted", "read", token_a)
        r = c.post("/files", params=as_write, files={"file": ("planted", b"x")}, headers=envd)
        assert r.status_code == 401
        moved = {**_signed("/etc/hostname", "read", token_a), "path": "/etc/passwd"}
        assert c.get("/files", params=moved, headers=envd).status_code == 401
        expired = _signed("/etc/hostname", "read", token_a, -5)
        assert c.get("/files", params=expired, headers=envd).status_code == 401
        # nothing was written by the refused uploads
        r = c.get("/files", params={"path": "/home/user/planted"}, headers={**envd, "X-Access-Token": token_a})
        assert r.status_code == 404


def _sign(c: httpx.Client, key: str, sid: str, path: str, **body: object) -> httpx.Response:
    return c.post(
        f"/v1/sandboxes/{sid}/files/signed_url",
        json={"path": path, **body},
        headers={"Authorization": f"Bearer {key}"},
    )


def test_a_warmbox_signed_url_opens_only_what_it_was_signed_for(two_tenants):
    """files.sign_url (warmbox's own signed URLs, the same key and scheme as E2B's): the URL alone
    reads or writes the one path it names; another path, sandbox, operation or signer, an expired
    URL or one of an ended sandbox is 401 or not found, and writes nothing; B cannot have a URL
    signed for A's sandbox."""
    url, t = two_tenants
    key_a, sid_a, _token_a = t["wall-a"]
    key_b, sid_b, _token_b = t["wall-b"]
    with httpx.Client(base_url=url, timeout=60) as c:
        r = _sign(c, key_a, sid_a, "/workspace/up.txt", write=True)
        assert r.status_code == 200, r.text
        up = r.json()
        assert key_a not in up and "Bearer" not in up
        assert c.put(up, content=b"signed bytes").status_code == 200
        read = _sign(c, key_a, sid_a, "/workspace/up.txt").json()
        assert c.get(read).content == b"signed bytes"
        # the read URL does not write; the upload URL does not read; nor for another path or sandbox
        assert c.put(read, content=b"overwritten").status_code == 401
        assert c.get(up).status_code == 401
        assert c.get(read.replace("up.txt", "other.txt")).status_code == 401
        assert c.get(read.replace(sid_a, sid_b)).status_code == 401
        # B: no URL for A's sandbox; B's own URL turned to A's sandbox or signed by A's key id: 401
        assert _sign(c, key_b, sid_a, "/workspace/up.txt").status_code == 404
        read_b = _sign(c, key_b, sid_b, "/workspace/up.txt").json()
        assert c.get(read_b.replace(sid_b, sid_a)).status_code == 401
        signer_b = read_b.split("signer=")[1].split("&")[0]
        signer_a = read.split("signer=")[1].split("&")[0]
        assert c.get(read_b.replace(signer_b, signer_a)).status_code == 401
        # expired, and an expiry moved later
        short = _sign(c, key_a, sid_a, "/workspace/up.txt", expires_in=1).json()
        later = short.split("signature_expiration=")[1].split("&")[0]
        assert c.get(short.replace(later, str(int(later) + 3600))).status_code == 401
        time.sleep(max(0.0, int(later) + 1.05 - time.time()))
        r = c.get(short)
        assert r.status_code == 401 and "expired" in r.text
        assert c.get(read).content == b"signed bytes"  # nothing was overwritten
        # a sandbox's URLs end with it
        made = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60}, headers={"X-API-KEY": key_a})
        assert made.status_code == 201, made.text
        sid_gone = made.json()["sandboxID"]
        gone = _sign(c, key_a, sid_gone, "/etc/hostname").json()
        assert c.get(gone).status_code == 200
        assert c.delete(f"/sandboxes/{sid_gone}", headers={"X-API-KEY": key_a}).status_code == 204
        assert c.get(gone).status_code == 404


@pytest.fixture(scope="module")
def ws_echo(two_tenants):
    """WS_ECHO running on port 8765 of tenant A's sandbox."""
    from warmbox import Sandbox

    url, t = two_tenants
    key_a, sid_a, _token_a = t["wall-a"]
    sb = Sandbox.connect(sid_a, api_url=url, api_key=key_a)
    try:
        sb.files.write("/workspace/ws_echo.py", WS_ECHO)
        sb.commands.run("cd /workspace && (python3 ws_echo.py >/tmp/ws_echo.log 2>&1 &)")
        sb.get_host(8765, check=True, timeout=30)
    finally:
        sb.close()
    return url, t


def test_a_websocket_to_a_sandbox_port_is_relayed_with_the_http_checks_and_bounds(ws_echo):
    """get_host's ports (E2B's headers or domain Host) and warmbox's preview route relay a WebSocket
    upgrade both ways: A's token (or key) gets its server, with its subprotocol, close codes passed
    on and no credential or cookie passed to it; B's key is not found, B's token or none refused;
    a message over the bound either way closes the socket with 1009."""
    url, t = ws_echo
    key_a, sid_a, token_a = t["wall-a"]
    key_b, _sid_b, token_b = t["wall-b"]
    aiohttp = pytest.importorskip("aiohttp")
    ws_url = url.replace("http://", "ws://")
    bearer = {"Authorization": f"Bearer {key_a}"}
    token = {**_data(sid_a, 8765), "E2B-Traffic-Access-Token": token_a}

    async def main() -> None:
        async with aiohttp.ClientSession() as http:
            routes = (
                ("/chat?room=1", {**_data(sid_a, 8765), "E2B-Traffic-Access-Token": token_a}),
                ("/chat?room=1", {"Host": f"8765-{sid_a}.e2b.test", "X-API-KEY": key_a}),
                (f"/v1/sandboxes/{sid_a}/ports/8765/chat?room=1", {"Authorization": f"Bearer {key_a}"}),
            )
            for path, headers in routes:
                headers = {**headers, "Cookie": "session=1"}
                async with http.ws_connect(ws_url + path, headers=headers, protocols=("wbtest",)) as ws:
                    assert ws.protocol == "wbtest"
                    seen = await ws.receive_json(timeout=30)
                    assert seen == {"path": "/chat?room=1", "leaked": []}, (path, seen)
                    await ws.send_str("hé")
                    assert await ws.receive_str(timeout=30) == "hé"
                    await ws.send_bytes(b"\0\1\2")
                    assert await ws.receive_bytes(timeout=30) == b"\0\1\2"
                    await ws.send_str("bye")
                    msg = await ws.receive(timeout=30)
                    assert msg.type is aiohttp.WSMsgType.CLOSE and ws.close_code == 4001, (path, msg)
            headers = {**_data(sid_a, 8765), "E2B-Traffic-Access-Token": token_a}
            async with http.ws_connect(ws_url + "/", headers=headers, max_msg_size=0) as ws:
                await ws.receive_json(timeout=30)
                await ws.send_str("big")  # the sandbox's 2 MiB message is not relayed
                msg = await ws.receive(timeout=30)
                # the relay's close frame says 1009 (ws.close_code may read 1006 when the relay drops the TCP
                # connection before aiohttp's answer to that frame goes out, as it once did under load)
                assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1009, msg
            async with http.ws_connect(ws_url + "/", headers=headers) as ws:
                await ws.receive_json(timeout=30)
                await ws.send_str("frags")  # a message of 5,000 empty fragments: not held frame by frame
                msg = await ws.receive(timeout=30)
                # the relay's close frame says 1009 (ws.close_code may read 1006 when the relay drops the TCP
                # connection before aiohttp's answer to that frame goes out, as it once did under load)
                assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1009, msg
            async with http.ws_connect(ws_url + "/", headers=headers) as ws:
                await ws.receive_json(timeout=30)
                try:
                    await ws.send_bytes(b"y" * (2 << 20))  # nor the client's
                except ConnectionError:  # closed (1009) while the last of it was still being written
                    pass
                msg = await ws.receive(timeout=30)
                assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), msg
                assert ws.close_code == 1009, msg
            for headers, status in (
                ({**_data(sid_a, 8765), "X-API-KEY": key_b}, 404),
                ({"Host": f"8765-{sid_a}.e2b.test", "X-API-KEY": key_b}, 404),
                ({**_data(sid_a, 8765), "E2B-Traffic-Access-Token": token_b}, 401),
                (_data(sid_a, 8765), 401),
                (_data(sid_a, 49983), 400),
            ):
                with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                    await http.ws_connect(ws_url + "/", headers=headers)
                assert e.value.status == status, headers
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await http.ws_connect(
                    f"{ws_url}/v1/sandboxes/{sid_a}/ports/8765/", headers={"Authorization": f"Bearer {key_b}"}
                )
            assert e.value.status == 404
            # at most WS_PER_SANDBOX at once to one sandbox, whichever route: the next is 429 until one ends
            held = []
            try:
                for i in range(WS_PER_SANDBOX):
                    route = (ws_url + "/", token) if i % 2 else (f"{ws_url}/v1/sandboxes/{sid_a}/ports/8765/", bearer)
                    held.append(await http.ws_connect(route[0], headers=route[1]))
                for route in ((ws_url + "/", token), (f"{ws_url}/v1/sandboxes/{sid_a}/ports/8765/", bearer)):
                    with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                        await http.ws_connect(route[0], headers=route[1])
                    assert e.value.status == 429
                await held.pop().close()
                async with http.ws_connect(ws_url + "/", headers=token) as ws:
                    assert "path" in await ws.receive_json(timeout=30)
            finally:
                for ws in held:
                    await ws.close()

    asyncio.run(main())


def test_a_sandbox_page_never_runs_with_an_origin_that_reaches_the_api(ws_echo):
    """A page a sandbox serves: on the API's own origin (E2B's header routing, the preview route)
    it runs no script (CSP sandbox); on its own host (domain mode) its scripts run, but in an opaque
    origin (no allow-same-origin): the host shares its site with api.{domain} and the console, so
    it could otherwise set cookies over theirs and send their SameSite cookies."""
    from warmbox.server.tunnel import CSP_OWN_ORIGIN

    url, t = ws_echo
    key_a, sid_a, token_a = t["wall-a"]
    assert "allow-same-origin" not in CSP_OWN_ORIGIN and "allow-top-navigation" not in CSP_OWN_ORIGIN
    with httpx.Client(base_url=url, timeout=60) as c:
        for path, headers, csp in (
            ("/", {**_data(sid_a, 8765), "E2B-Traffic-Access-Token": token_a}, "sandbox"),
            (f"/v1/sandboxes/{sid_a}/ports/8765/", {"Authorization": f"Bearer {key_a}"}, "sandbox"),
            ("/", {"Host": f"8765-{sid_a}.e2b.test", "E2B-Traffic-Access-Token": token_a}, CSP_OWN_ORIGIN),
        ):
            r = c.get(path, headers=headers)
            assert r.status_code == 200 and "<script>" in r.text, (path, r.text)
            assert r.headers["content-security-policy"] == csp, path
            assert r.headers["x-content-type-options"] == "nosniff"
