"""The HTTP API against a real `warmbox serve` on the session home: bad input on every route (generated
from warmbox.api.ROUTES), faults (a killed server, dropped and slow uploads, oversized requests), the
non-root unix-socket lane, and tenants' keys (scoping, revocation, quotas).

Raw requests go over the unix socket as root (no key needed); the SDK goes the same way unless a
test is about keys (TCP with a Bearer key)."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import importlib.util
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import typing
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import pytest

from tests.conftest import ServerProc, set_config, start_server
from warmbox import api, wire
from warmbox import operations as ops
from warmbox.engine import teardown
from warmbox.errors import ConnectionLost, Unauthenticated
from warmbox.sdk.sandbox import AsyncSandbox

pytestmark = pytest.mark.sandbox  # every test here talks to a server that runs an engine

FAKE_ID = "sb-000000000000"
BODY_TIMEOUT_S = 2  # the module server's [server] body_timeout (the slow-client test waits it out)
MAX_BODY_MB = 2  # the module server's [server] max_body_mb
TYPED = {"invalid_argument", "invalid_path", "limit_too_high", "sandbox_not_found"}


# ---- plumbing


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float = 30) -> None:
        super().__init__("warmbox", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(str(self._path))
        self.sock = s


def call(
    server: ServerProc,
    method: str,
    path: str,
    body: bytes | str | dict | None = None,
    headers: dict[str, str] | None = None,
    *,
    key: str | None = None,
    timeout: float = 60,
) -> tuple[int, typing.Any]:
    """One request: over TCP with ``key``, else over the unix socket as root. (status, JSON or bytes)."""
    if key is None:
        conn: http.client.HTTPConnection = UnixHTTPConnection(server.socket, timeout)
    else:
        u = urlsplit(server.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    h = dict(headers or {})
    if key:
        h["Authorization"] = f"Bearer {key}"
    if isinstance(body, dict):
        body = json.dumps(body)
        h.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    if r.getheader("content-type", "").startswith(("application/json", "application/x-ndjson")) and data.strip():
        first = data.strip().splitlines()[0]
        return r.status, json.loads(first)
    return r.status, data


def code_of(data: typing.Any) -> str:
    assert isinstance(data, dict) and isinstance(data.get("error"), dict), data
    return data["error"]["code"]


def alive(server: ServerProc) -> None:
    status, data = call(server, "GET", f"{api.PREFIX}/sandboxes", timeout=20)
    assert status == 200 and isinstance(data, list), (status, data)


def url_of(route: api.Route, sandbox_id: str = FAKE_ID, **ids: str) -> str:
    values = {
        "sandbox_id": sandbox_id,
        "snapshot": "snap-x",
        "snapshot_id": "snap-x",
        "context": "ctx",
        "name": "default",
        "approval_id": "ap-0000000000000000",
        **ids,
    }
    return route.path.format(**{f: values[f] for f in route.path_fields})


def wire_fields(route: api.Route) -> dict[str, typing.Any]:
    """The fields a route's request takes from its body or query (not the path, not callbacks, not
    a raw route's ``data``: that is the body itself, see request_parts)."""
    cls = ops.REQUESTS[route.op]
    hints = wire.hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if f.init
        and not f.metadata.get("local")
        and f.name not in route.path_fields
        and not (route.body == "raw" and f.name == "data")
    }


def _fits(tp: typing.Any, value: object) -> bool:
    try:
        wire.decode(tp, value, "x")
    except Exception:
        return False
    return True


def _known_valid() -> dict[typing.Any, object]:
    """Valid wire values of the record types no simple value fits."""
    from warmbox.templates import Template

    return {Template: wire.encode(Template.from_template("base"))}


def valid_value(tp: typing.Any) -> object:
    known = _known_valid()
    if tp in known:
        return known[tp]
    for v in ("x", 1, 1.0, False, [], {}):
        if _fits(tp, v):
            return v
    raise AssertionError(f"no simple valid value for {tp}")


def required(route: api.Route) -> dict[str, object]:
    cls = ops.REQUESTS[route.op]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    return {
        n: valid_value(tp)
        for n, tp in wire_fields(route).items()
        if fields[n].default is dataclasses.MISSING and fields[n].default_factory is dataclasses.MISSING
    }


def wrong_json(tp: typing.Any) -> object | None:
    for v in ({"nested": [1]}, "not-a-number", 3.5, True, [1, "a"], 7):
        if not _fits(tp, v):
            return v
    return None  # typed Any/object: anything goes at this layer


def wrong_query(tp: typing.Any) -> str | None:
    from warmbox.server.app import _query_value

    for text in ("not-a-number", "maybe", "1.5"):
        if not _fits(tp, _query_value(tp, text, "x")):
            return text
    return None


def request_parts(route: api.Route, fields: dict[str, object]) -> tuple[str, bytes | None, dict[str, str]]:
    """(query string, body, headers) carrying ``fields`` the way ``route`` takes them."""
    if route.body == "json":
        return "", json.dumps(fields).encode(), {"Content-Type": "application/json"}
    data = fields.pop("data", b"x") if route.body == "raw" else None
    q = {k: ("null" if v is None else json.dumps(v) if not isinstance(v, str) else v) for k, v in fields.items()}
    body = data if isinstance(data, bytes) or data is None else str(data).encode()
    return ("?" + urlencode(q)) if q else "", body, {}


def _cases() -> list[typing.Any]:
    out = []
    for r in api.ROUTES:
        for name, tp in wire_fields(r).items():
            if name == "data" and r.body == "raw":
                continue
            bad = wrong_json(tp) if r.body == "json" else wrong_query(tp)
            if bad is not None:
                out.append(pytest.param(r, name, bad, id=f"{r.op.value}-{name}"))
    return out


# ---- the module's server and sandbox


@pytest.fixture(scope="module")
def server(home: Path, runc_ready: None):
    s = start_server(
        home,
        home / "api-mod.sock",
        env={"WARMBOX_SERVER__BODY_TIMEOUT": str(BODY_TIMEOUT_S), "WARMBOX_SERVER__MAX_BODY_MB": str(MAX_BODY_MB)},
    )
    try:
        yield s
    finally:
        status = s.stop()
        assert status == 0, f"warmbox serve exited with {status} on SIGTERM:\n{s.output()}"


@pytest.fixture(scope="module")
def live(server: ServerProc):
    """One sandbox made over the API (root on the unix socket); its id."""

    async def make() -> str:
        sb = await AsyncSandbox.create(api_url=server.unix_url, timeout=600)
        await sb.close()
        return sb.sandbox_id

    sid = asyncio.run(make())
    try:
        yield sid
    finally:
        call(server, "DELETE", f"{api.PREFIX}/sandboxes/{sid}")


def live_ids(home: Path) -> set[str]:
    from warmbox.engine.engine import Engine

    # a pool's refill in progress is listed while it is created: it was never anyone's
    return {i.sandbox_id for i in Engine.for_home(home).list() if not (i.pool and not i.claimed_at)}


# ---- bad input, generated from the route table


@pytest.mark.parametrize("route", [r for r in api.ROUTES if r.body == "json"], ids=lambda r: r.op.value)
@pytest.mark.parametrize("body", [b"{not json", b'{"a": ', b"[1, 2]", b'"text"', b"\xff\xfe"], ids=str)
def test_malformed_json_is_400_with_a_code(server, route, body):
    status, data = call(server, route.method, url_of(route), body, {"Content-Type": "application/json"})
    assert status == 400 and code_of(data) == "invalid_argument", (status, data)
    alive(server)


@pytest.mark.parametrize("route", api.ROUTES, ids=lambda r: r.op.value)
def test_unknown_field_is_400_naming_it(server, route):
    query, body, headers = request_parts(route, {**required(route), "bogus_field_x": 1})
    status, data = call(server, route.method, url_of(route) + query, body, headers)
    assert status == 400 and code_of(data) == "invalid_argument", (status, data)
    assert "bogus_field_x" in data["error"]["message"]
    alive(server)


@pytest.mark.parametrize("route,field,bad", _cases())
def test_wrong_type_is_400_naming_the_field(server, home, route, field, bad):
    before = live_ids(home)
    fields = {**required(route), field: bad}
    if route.body == "json":
        query, body, headers = request_parts(route, fields)
    else:
        query, body, headers = request_parts(route, {k: v for k, v in fields.items() if k != field})
        query += ("&" if query else "?") + urlencode({field: bad})
    status, data = call(server, route.method, url_of(route) + query, body, headers)
    assert status == 400 and code_of(data) == "invalid_argument", (status, data)
    assert field in data["error"]["message"], data
    assert live_ids(home) <= before  # nothing was created on the way
    alive(server)


FILE_ROUTES = [r for r in api.ROUTES if "path" in wire_fields(r)]


@pytest.mark.parametrize("route", FILE_ROUTES, ids=lambda r: r.op.value)
@pytest.mark.parametrize("path", ["../../etc/passwd", "/workspace/../../etc/passwd", "a/../../b", "x\0y", ""])
def test_path_traversal_is_invalid_path(server, live, route, path):
    query, body, headers = request_parts(route, {**required(route), "path": path})
    status, data = call(server, route.method, url_of(route, live) + query, body, headers)
    assert status == 400 and code_of(data) == "invalid_path", (status, data)
    alive(server)


@pytest.mark.parametrize(
    "body",
    [
        {"limits": {"memory_mb": 10**12}},
        {"limits": {"memory_mb": 10**40}},
        {"limits": {"cpus": 1e9}},
        {"limits": {"pids": 10**12}},
        {"limits": {"disk_mb": 10**15}},
        {"timeout": 1e308},
        {"timeout": -1},
        {"limits": {"memory_mb": -5}},
        {"limits": {"cpus": float("nan")}},
        {"tier": "../../bin/sh"},
    ],
    ids=lambda b: json.dumps(b)[:40],
)
def test_absurd_create_arguments_are_typed_4xx_and_create_nothing(server, home, body):
    before = live_ids(home)
    status, data = call(server, "POST", f"{api.PREFIX}/sandboxes", body)
    assert 400 <= status < 500 and code_of(data) in TYPED, (status, data)
    assert live_ids(home) <= before
    alive(server)


def test_absurd_set_timeout_is_typed(server, live):
    status, data = call(server, "POST", f"{api.PREFIX}/sandboxes/{live}/timeout", {"timeout": 1e308})
    assert 400 <= status < 500 and code_of(data) in TYPED, (status, data)
    alive(server)


def test_approval_questions_of_an_ended_sandbox_are_not_found_at_once(server):
    """Its proxy will never ask: 404 sandbox_not_found, not a 500 network_error after a 10 s wait."""

    async def make() -> str:
        sb = await AsyncSandbox.create(api_url=server.unix_url, timeout=120, pool=False)
        await sb.kill()
        return sb.sandbox_id

    sid = asyncio.run(make())
    t0 = time.monotonic()
    status, data = call(server, "GET", f"{api.PREFIX}/sandboxes/{sid}/network/approvals")
    assert status == 404 and code_of(data) == "sandbox_not_found", (status, data)
    assert time.monotonic() - t0 < 5


def test_approval_questions_with_no_egress_proxy_are_a_typed_503(server):
    """A live sandbox with no network has no proxy to ask: 503 network_error, never a 500."""

    async def make() -> str:
        sb = await AsyncSandbox.create(api_url=server.unix_url, timeout=120, pool=False)
        return sb.sandbox_id

    sid = asyncio.run(make())
    try:
        status, data = call(server, "GET", f"{api.PREFIX}/sandboxes/{sid}/network/approvals")
        assert status == 503 and code_of(data) == "network_error", (status, data)
    finally:
        call(server, "DELETE", f"{api.PREFIX}/sandboxes/{sid}")


def test_unknown_route_and_method_are_json(server):
    for path in ("/v1/nope", "/nope", f"{api.PREFIX}/sandboxes/{FAKE_ID}/nope", "/v1/../../etc/passwd"):
        status, data = call(server, "GET", path)
        assert status == 404 and code_of(data) == "route_not_found", (path, status, data)
    status, data = call(server, "PATCH", f"{api.PREFIX}/sandboxes")
    assert status == 405 and code_of(data) == "route_not_found", (status, data)
    alive(server)


def test_openapi_document(server):
    if importlib.util.find_spec("warmbox.server.openapi") is None:
        pytest.skip("warmbox.server.openapi is not there yet")
    status, doc = call(server, "GET", f"{api.PREFIX}/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")
    for r in api.ROUTES:
        assert r.method.lower() in doc["paths"][r.path], r.path


# ---- oversized and slow requests


def _raw(server: ServerProc, head: bytes, body_parts: typing.Iterable[bytes] = (), pause: float = 0.0) -> bytes:
    """Send ``head`` then each part (``pause`` s apart) on a unix connection; the server's answer."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(server.socket))
    try:
        s.sendall(head)
        for part in body_parts:
            time.sleep(pause)
            try:
                s.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed: read its answer
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out:
                headers, _, rest = out.partition(b"\r\n\r\n")
                length = [ln for ln in headers.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
                if length and len(rest) >= int(length[0].split(b":")[1]):
                    break
        return out
    finally:
        s.close()


def _parse(raw: bytes) -> tuple[int, typing.Any]:
    assert raw.startswith(b"HTTP/1.1 "), raw[:200]
    status = int(raw.split(b" ", 2)[1])
    _, _, body = raw.partition(b"\r\n\r\n")
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def test_oversized_header_is_refused(server):
    head = (
        f"GET {api.PREFIX}/sandboxes HTTP/1.1\r\nHost: warmbox\r\nX-Big: {'a' * 100_000}\r\nConnection: close\r\n\r\n"
    ).encode()
    raw = _raw(server, head)
    assert raw == b"" or 400 <= _parse(raw)[0] < 500, raw[:300]
    alive(server)


def test_oversized_body_is_413_with_a_code(server, live):
    size = (MAX_BODY_MB << 20) + 1
    path = f"{api.PREFIX}/sandboxes/{live}/files/content?path=big.bin"
    # declared too large: refused before any byte is read
    head = f"PUT {path} HTTP/1.1\r\nHost: warmbox\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n".encode()
    status, data = _parse(_raw(server, head))
    assert status == 413 and code_of(data) == "invalid_argument", (status, data)
    # chunked, no length: refused once the limit is passed
    status, data = call(server, "PUT", path, iter([b"x" * (1 << 20)] * (MAX_BODY_MB + 1)))
    assert status == 413 and code_of(data) == "invalid_argument", (status, data)
    # a JSON body over its bound too
    status, data = call(server, "POST", f"{api.PREFIX}/sandboxes/{live}/commands", b"x" * ((16 << 20) + 1))
    assert status == 413 and code_of(data) == "invalid_argument", (status, data)
    status, data = call(server, "GET", f"{api.PREFIX}/sandboxes/{live}/files/stat?path=big.bin")
    assert status == 404 and code_of(data) == "path_not_found", (status, data)
    alive(server)


def test_slow_body_past_body_timeout_is_400(server, live):
    path = f"{api.PREFIX}/sandboxes/{live}/files/content?path=slow.bin"
    head = f"PUT {path} HTTP/1.1\r\nHost: warmbox\r\nContent-Length: 100\r\n\r\n".encode()
    t0 = time.monotonic()
    raw = _raw(server, head, [b"x"] * (BODY_TIMEOUT_S * 4 + 4), pause=0.5)
    status, data = _parse(raw)
    assert status == 400 and code_of(data) == "invalid_argument", (status, data)
    assert "did not arrive" in data["error"]["message"] and time.monotonic() - t0 < BODY_TIMEOUT_S + 10
    status, data = call(server, "GET", f"{api.PREFIX}/sandboxes/{live}/files/stat?path=slow.bin")
    assert status == 404, (status, data)
    alive(server)


def test_client_dropping_mid_upload_leaves_no_file(server, live):
    path = f"{api.PREFIX}/sandboxes/{live}/files/content?path=half.bin"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(server.socket))
    s.sendall(f"PUT {path} HTTP/1.1\r\nHost: warmbox\r\nContent-Length: {1 << 20}\r\n\r\n".encode())
    s.sendall(b"y" * (1 << 19))
    s.close()
    time.sleep(1)
    status, data = call(server, "GET", f"{api.PREFIX}/sandboxes/{live}/files/list?path=/workspace")
    assert status == 200 and "half.bin" not in {e["name"] for e in data}, data
    alive(server)


# ---- a server killed while a command streams


def test_server_killed_mid_command_client_gets_connection_lost_sandbox_survives(home, runc_ready):
    from warmbox.engine.engine import Engine
    from warmbox.models import State

    sock = home / "api-kill.sock"
    first = start_server(home, sock, tcp=False)
    second: ServerProc | None = None
    sid = ""
    try:

        async def run_and_kill() -> str:
            sb = await AsyncSandbox.create(api_url=first.unix_url, timeout=300)
            nonlocal sid
            sid = sb.sandbox_id
            asyncio.get_running_loop().call_later(0.7, first.kill9)
            seen: list[str] = []
            t0 = time.monotonic()
            with pytest.raises(ConnectionLost):
                await asyncio.wait_for(sb.commands.run("sleep 2; echo done", on_stdout=seen.append), 30)
            assert time.monotonic() - t0 < 10
            await sb.close()
            return sid

        asyncio.run(run_and_kill())
        info, _ = Engine.for_home(home).info(sid)
        assert info.state not in (State.DESTROYED, State.FAILED), info
        second = start_server(home, sock, tcp=False)

        async def reconnect() -> str:
            sb = await AsyncSandbox.connect(sid, api_url=second.unix_url)
            try:
                r = await sb.commands.run("echo back")
                return r.stdout
            finally:
                await sb.kill()

        assert asyncio.run(reconnect()) == "back\n"
    finally:
        if second is None and sid:  # the sandbox was not killed through a server
            asyncio.run(teardown.destroy(Engine.for_home(home), sid, "test clean-up"))
        for s in (first, second):
            if s is not None:
                s.stop()


# ---- the non-root lane: SO_PEERCRED on the unix socket

CHILD = """
import asyncio, os, sys
from warmbox import AsyncSandbox
from warmbox.errors import Unauthenticated

async def main():
    print("ME", os.getuid(), flush=True)
    try:
        sb = await AsyncSandbox.create(api_url=sys.argv[1], timeout=120)
    except Unauthenticated as e:
        print("UNAUTHENTICATED", e, flush=True)
        return
    try:
        r = await sb.commands.run("id -u")
        print("EXEC", r.exit_code, r.stdout.strip(), flush=True)
        await sb.files.write("nobody.txt", "from nobody")
        print("READ", await sb.files.read("nobody.txt"), flush=True)
    finally:
        print("KILLED", await sb.kill(), flush=True)

asyncio.run(main())
"""


def _as_uid(uid: int, args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    """Run python ``args`` as ``uid`` (no groups) with warmbox importable; a python that uid can
    run (the venv's may live under a 0700 home) is looked for first."""
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": os.pathsep.join(paths)}
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    for py in (sys.executable, "/usr/bin/python3"):
        probe = subprocess.run(
            [*drop, py, "-c", "import aiohttp, warmbox.sdk"], env=env, capture_output=True, timeout=60
        )
        if probe.returncode == 0:
            return subprocess.run([*drop, py, *args], env=env, capture_output=True, text=True, timeout=timeout)
    pytest.skip(f"no python that uid {uid} can run with warmbox importable: {probe.stderr[-300:]!r}")


@pytest.fixture
def peer_server(home: Path, runc_ready: None):
    """A server whose socket is in a world-traversable dir (the session home is 0700), with
    [server] peers = { 65534 = "nobody-tenant" }."""
    from warmbox.engine.engine import Engine

    Engine.for_home(home)  # the registry exists before the server (a peer's tenant needs no key)
    public = Path(f"/tmp/wbt-pub-{secrets.token_hex(3)}")
    public.mkdir(mode=0o755)
    public.chmod(0o755)
    set_config(home, '\n[server]\npeers = { 65534 = "nobody-tenant" }\n')
    s = None
    try:
        s = start_server(home, public / "api.sock", tcp=False)
        yield s
    finally:
        set_config(home)
        if s is not None:
            s.stop()
        shutil.rmtree(public, ignore_errors=True)


def test_mapped_uid_works_without_root(peer_server, home):
    before = live_ids(home)
    r = _as_uid(65534, ["-c", CHILD, peer_server.unix_url])
    lines = dict(ln.split(" ", 1) for ln in r.stdout.splitlines() if " " in ln)
    assert lines.get("ME") == "65534", (r.stdout, r.stderr[-2000:], peer_server.output())
    assert lines.get("EXEC", "").split(" ")[0] == "0", (r.stdout, r.stderr[-2000:], peer_server.output())
    assert lines.get("READ") == "from nobody" and lines.get("KILLED") == "True", (r.stdout, r.stderr[-2000:])
    assert live_ids(home) <= before


def test_unmapped_uid_is_unauthenticated(peer_server, home):
    r = _as_uid(65533, ["-c", CHILD, peer_server.unix_url])
    assert "UNAUTHENTICATED" in r.stdout, (r.stdout, r.stderr[-2000:])


# ---- tenants' keys (registry.tenants.create_key / revoke_key; EngineFront scoping) over TCP


def _registry(home: Path) -> typing.Any:
    from warmbox.engine.engine import Engine

    return Engine.for_home(home).registry


def test_no_key_or_a_bad_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}):
        u = urlsplit(server.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=20)
        conn.request("GET", f"{api.PREFIX}/sandboxes", headers=headers)
        r = conn.getresponse()
        data = json.loads(r.read())
        conn.close()
        assert r.status == 401 and code_of(data) == "unauthenticated", (headers, r.status, data)

    async def sdk() -> None:
        with pytest.raises(Unauthenticated):
            await AsyncSandbox.create(api_url=server.url, api_key="nope")

    asyncio.run(sdk())


def test_revoked_key_fails_at_once(server, home):
    key_id, secret = _registry(home).tenants.create_key("revoke-me")
    assert call(server, "GET", f"{api.PREFIX}/sandboxes", key=secret)[0] == 200
    assert _registry(home).tenants.revoke_key(key_id)
    status, data = call(server, "GET", f"{api.PREFIX}/sandboxes", key=secret)
    assert status == 401 and code_of(data) == "unauthenticated", (status, data)


def test_quota_max_sandboxes_refuses_the_second_create(server, home):
    _key, secret = _registry(home).tenants.create_key("quota-one", max_sandboxes=1)
    status, first = call(server, "POST", f"{api.PREFIX}/sandboxes", {"timeout": 120}, key=secret)
    assert status == 200, first
    sid = first["info"]["sandbox_id"]
    try:
        before = live_ids(home)
        status, data = call(server, "POST", f"{api.PREFIX}/sandboxes", {"timeout": 120}, key=secret)
        assert status == 429 and code_of(data) == "quota_exceeded", (status, data)
        assert live_ids(home) == before
        status, mine = call(server, "GET", f"{api.PREFIX}/sandboxes", key=secret)
        assert [i["sandbox_id"] for i in mine] == [sid]
    finally:
        call(server, "DELETE", f"{api.PREFIX}/sandboxes/{sid}", key=secret)


# every route naming a tenant's resource (a sandbox, snapshot or context; a pool is the host's)
ID_ROUTES = [r for r in api.ROUTES if set(r.path_fields) - {"name"}]


@pytest.fixture(scope="module")
def other_tenants(server, home):
    """Tenant "owner" with a live sandbox and a snapshot of it; tenant "stranger"'s key."""
    registry = _registry(home)
    _k, owner = registry.tenants.create_key("owner")
    _k, stranger = registry.tenants.create_key("stranger")
    status, opened = call(server, "POST", f"{api.PREFIX}/sandboxes", {"timeout": 600}, key=owner)
    assert status == 200, opened
    sid = opened["info"]["sandbox_id"]
    snap = ""
    try:
        status, ref = call(server, "POST", f"{api.PREFIX}/sandboxes/{sid}/snapshots", {}, key=owner, timeout=300)
        assert status == 200, ref
        snap = ref["snapshot_id"]
        yield owner, stranger, sid, snap
    finally:
        call(server, "DELETE", f"{api.PREFIX}/sandboxes/{sid}", key=owner)
        if snap:
            call(server, "DELETE", f"{api.PREFIX}/snapshots/{snap}", key=owner)


@pytest.mark.parametrize("route", ID_ROUTES, ids=lambda r: r.op.value)
def test_another_tenants_ids_are_not_found_on_every_route(server, home, other_tenants, route):
    owner, stranger, sid, snap = other_tenants
    fields = dict(required(route))
    if "cmd" in fields:
        fields["cmd"] = "true"
    query, body, headers = request_parts(route, fields)
    url = url_of(route, sid, snapshot=snap, snapshot_id=snap, context="default")
    status, data = call(server, route.method, url + query, body, headers, key=stranger, timeout=120)
    assert status == 404, (route.op.value, status, data)
    # untouched: the owner still has it
    status, info = call(server, "GET", f"{api.PREFIX}/sandboxes/{sid}", key=owner)
    assert status == 200 and info["state"] in ("ready", "running"), (status, info)


def test_approvals_stream_of_another_tenant_is_not_found(server, other_tenants):
    _owner, stranger, sid, _snap = other_tenants
    status, data = call(server, "GET", api.APPROVALS.format(sandbox_id=sid), key=stranger)
    assert status == 404, (status, data)


def test_a_tenants_volumes_are_its_own_over_the_api(server, home, other_tenants):
    """Volumes over HTTP with tenants' keys: the owner's volume is mounted into its sandbox (the
    Create's volumes go over the wire as records); to another tenant the name is not found on every
    volume route and in a create, and its own volume of the same name is another volume."""
    owner, stranger, _sid, _snap = other_tenants
    name = "api" + secrets.token_hex(3)
    status, info = call(server, "POST", f"{api.PREFIX}/volumes", {"name": name, "size_mb": 32}, key=owner)
    assert status == 200 and info["name"] == name and info["tenant"] == "owner", info
    try:
        for method, path in (("GET", f"/volumes/{name}"), ("DELETE", f"/volumes/{name}")):
            status, data = call(server, method, api.PREFIX + path, key=stranger)
            assert status == 404 and code_of(data) == "volume_not_found", (path, status, data)
        status, data = call(server, "GET", f"{api.PREFIX}/volumes", key=stranger)
        assert status == 200 and name not in [v["name"] for v in data], data
        body = {"timeout": 60, "pool": False, "volumes": [{"name": name, "path": "/data", "read_only": False}]}
        status, data = call(server, "POST", f"{api.PREFIX}/sandboxes", body, key=stranger)
        assert status == 404 and code_of(data) == "volume_not_found", data
        status, opened = call(server, "POST", f"{api.PREFIX}/sandboxes", body, key=owner, timeout=120)
        assert status == 200, opened
        sid = opened["info"]["sandbox_id"]
        try:
            status, info = call(server, "GET", f"{api.PREFIX}/volumes/{name}", key=owner)
            assert status == 200 and info["mounted_by"] == [sid], info
            status, data = call(server, "DELETE", f"{api.PREFIX}/volumes/{name}", key=owner)
            assert status == 409 and code_of(data) == "volume_in_use", data
        finally:
            call(server, "DELETE", f"{api.PREFIX}/sandboxes/{sid}", key=owner)
        # the stranger's own volume of the same name
        status, info = call(server, "POST", f"{api.PREFIX}/volumes", {"name": name, "size_mb": 16}, key=stranger)
        assert status == 200 and info["tenant"] == "stranger" and info["size_mb"] == 16, info
        assert call(server, "DELETE", f"{api.PREFIX}/volumes/{name}", key=stranger)[0] == 200
    finally:
        status, data = call(server, "DELETE", f"{api.PREFIX}/volumes/{name}", key=owner)
        assert status == 200, data
