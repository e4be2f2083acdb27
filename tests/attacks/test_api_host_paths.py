"""No host path reaches a tenant through the API. Every route of a real `warmbox serve` (enumerated
from the app itself: a new route is walked too, or this test fails naming it) is called with a
tenant's key while real sandboxes (container and gVisor), a named volume mounted by one, a snapshot
and built templates exist; then with unknown ids, another tenant's ids and values that raise typed
errors (LimitTooHigh of a volume or a disk, a failed build, a volume in use, an unknown route).
MCP's tools and the console's pages too. No answer may hold the home, the runtime or image
directories, /var/lib/warmbox, a host temporary directory, the operator's home or the server's source tree (a
traceback), and the server logs no traceback.

Before: ``POST /v1/volumes`` and ``GET /v1/volumes/{name}`` answered ``"disk": "<home>/volumes/
vol-….img"``, a template's ``build_log`` and a failed build's error named the log's host path, a
volume or disk LimitTooHigh named the directory whose disk was full, and ``/logs`` passed the
runtimes' host paths through."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import os
import re
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

import warmbox
from tests.attacks.conftest import read_answer, require_tier
from tests.conftest import ServerProc, start_server
from tests.server.test_api import request_parts, required
from warmbox import api, paths, wire
from warmbox.api import Route
from warmbox.backends import microvm_image
from warmbox.engine import teardown
from warmbox.engine.engine import Engine
from warmbox.operations import Op
from warmbox.templates import Template

pytestmark = pytest.mark.sandbox

FAKE_ID = "sb-000000000000"
ENDLESS_S = 3.0  # how long a stream that never ends by itself (a watch, a follow) is read
FINITE = {Op.EXEC, Op.RUN_CODE, Op.TEMPLATE_BUILD, Op.EXPORT}  # NDJSON answers that end by themselves


def forbidden(home: Path) -> list[str]:
    """What no answer may contain: host directories, and the server's own files (a traceback)."""
    engine = Engine.for_home(home)
    return sorted(
        {
            str(home),
            str(engine.runtime),
            str(microvm_image.cache_dir()),
            paths.DEFAULT_RUNTIME_ROOT,
            "/tmp/wb",  # test homes, WARMBOX_RUNTIME_DIRs (a sandbox's own /tmp is its business)
            "/tmp/tmp",  # Python's tempfile directories (a build's context, a download)
            str(Path.home()) + "/",
            str(Path(warmbox.__file__).parent),
            sys.prefix,
            "Traceback (most recent call last)",
            "/dev/kvm",
            *(p for p in map(shutil.which, ("runc", "runsc", "qemu-system-x86_64", "node")) if p),
        }
    )


@dataclasses.dataclass
class Answer:
    label: str
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body.splitlines()[0]) if self.body.strip() else None


class Walker:
    """Requests over TCP with a key; every answer is kept to be searched for host paths."""

    def __init__(self, server: ServerProc) -> None:
        self.server = server
        self.answers: list[Answer] = []
        self.walked: set[tuple[str, str]] = set()  # (method, route template)

    def call(
        self,
        method: str,
        path: str,
        body: bytes | dict | None = None,
        *,
        key: str,
        headers: dict[str, str] | None = None,
        route: str = "",
        finite: bool = True,
        label: str = "",
    ) -> Answer:
        u = urlsplit(self.server.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        h = {"Authorization": f"Bearer {key}", **(headers or {})}
        if isinstance(body, dict):
            body = json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        try:
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            data = read_answer(conn, r, None if finite else ENDLESS_S)
        finally:
            conn.close()
        a = Answer(label or f"{method} {path}", r.status, data)
        self.answers.append(a)
        self.walked.add((method, route or path))
        return a

    def leaks(self, needles: list[str]) -> list[str]:
        out = []
        for a in self.answers:
            text = a.body.decode("utf-8", "replace")
            for n in needles:
                if n in text:
                    at = text.index(n)
                    out.append(f"{a.label} -> {a.status}: {n!r} in ...{text[max(0, at - 120) : at + 120]!r}")
        return out


# ---- the route table, as the server builds it


def app_routes(home: Path) -> list[tuple[str, str]]:
    """(method, path template) of every route of the app `warmbox serve` runs (MCP and console
    included; "MOUNT" for a mounted app, "WS" for a WebSocket)."""
    from starlette.routing import Mount, WebSocketRoute
    from starlette.routing import Route as StarRoute

    from warmbox.config import ServerSettings
    from warmbox.server.app import build_app

    app = build_app(Engine.for_home(home), ServerSettings(metrics=True), mcp=True, console=True)
    out: list[tuple[str, str]] = []

    def walk(routes: list[Any], prefix: str) -> None:
        for r in routes:
            if isinstance(r, Mount):
                out.append(("MOUNT", prefix + r.path))
            elif isinstance(r, WebSocketRoute):
                out.append(("WS", prefix + r.path))
            elif isinstance(r, StarRoute):
                out.extend((m, prefix + r.path) for m in sorted((r.methods or {"GET"}) - {"HEAD"}))

    walk(app.routes, "")
    asyncio.run(app.state.service.close())
    return out


def _op_route(method: str, template: str) -> Route | None:
    for r in api.ROUTES:
        if r.method == method and r.path == template:
            return r
    return None


# ---- the world the walk sees


@dataclasses.dataclass
class World:
    server: ServerProc
    key: str  # tenant A's
    other: str  # tenant B's
    admin: str  # an admin key (admin-only routes; a tenant key gets Forbidden)
    sid: str  # A's container sandbox, mounting the volume
    gvisor: str  # A's gVisor sandbox
    volume: str
    template: str
    snapshot: str
    pid: int  # a background process in sid
    context: str  # a code context in sid
    made: list[str]  # every sandbox id seen, killed at the end


def _ok(a: Answer) -> Any:
    assert 200 <= a.status < 300, (a.label, a.status, a.body[:2000])
    return a.json()


def _result(a: Answer) -> Any:
    """The result of an NDJSON answer (its last line)."""
    assert a.status == 200, (a.label, a.status, a.body[:2000])
    last = json.loads([x for x in a.body.splitlines() if x.strip()][-1])
    assert "result" in last, last
    return last["result"]


@pytest.fixture(scope="module")
def world(home: Path, runc_ready: None):
    require_tier(home, "gvisor")
    server = start_server(home, home / "paths.sock", mcp=True)
    engine = Engine.for_home(home)
    _, key = engine.registry.tenants.create_key("paths-a")
    _, other = engine.registry.tenants.create_key("paths-b")
    _, admin = engine.registry.tenants.create_key("paths-op", admin=True)
    w = Walker(server)
    made: list[str] = []
    P = api.PREFIX
    try:
        volume = f"pv-{secrets.token_hex(3)}"
        _ok(w.call("POST", f"{P}/volumes", {"name": volume, "size_mb": 32}, key=key, route=f"{P}/volumes"))
        body = {"tier": "container", "pool": False, "timeout": 600, "metadata": {"who": "walk"}}
        body["volumes"] = [{"name": volume, "path": "/data"}]
        sid = _ok(w.call("POST", f"{P}/sandboxes", body, key=key))["info"]["sandbox_id"]
        made.append(sid)
        gv = {"tier": "gvisor", "pool": False, "timeout": 600}
        gvisor = _ok(w.call("POST", f"{P}/sandboxes", gv, key=key))["info"]["sandbox_id"]
        made.append(gvisor)
        for f in ("f.txt", "g.txt"):
            w.call("PUT", f"{P}/sandboxes/{sid}/files/content?path=/workspace/{f}", b"data\n", key=key)
        w.call("POST", f"{P}/sandboxes/{sid}/files/dir", {"path": "/workspace/d"}, key=key)
        pid = _ok(w.call("POST", f"{P}/sandboxes/{sid}/processes", {"cmd": "sleep 600"}, key=key))
        context = _ok(w.call("POST", f"{P}/sandboxes/{sid}/contexts", {}, key=key))
        snapshot = _ok(w.call("POST", f"{P}/sandboxes/{sid}/snapshots", {}, key=key))["snapshot_id"]
        template = f"pt-{secrets.token_hex(3)}"
        spec = wire.encode(Template.from_template("base").run("echo built > /opt/built"), tag_bytes=True)
        _result(w.call("POST", f"{P}/templates", {"name": template, "template": spec}, key=key))
        yield World(server, key, other, admin, sid, gvisor, volume, template, snapshot, pid, context, made)
    finally:
        server.stop()
        for i in made:
            asyncio.run(teardown.destroy(engine, i, "test cleanup"))
        for t in ("paths-a", "paths-b"):
            for v in engine.registry.volumes.volumes(t):
                asyncio.run(_delete_volume(engine, t, v[1]))
        w.answers.clear()


async def _delete_volume(engine: Engine, tenant: str, name: str) -> None:
    from warmbox.engine import volumes

    volumes.delete(engine, tenant, name)


# ---- what each route is called with


LATE = (  # routes that end or change what the others use: walked last, in this order
    Op.FILES_REMOVE,
    Op.FILES_RENAME,
    Op.REMOVE_CONTEXT,
    Op.COMMANDS_KILL,
    Op.DETACH,
    Op.DELETE_SNAPSHOT,
    Op.VOLUME_DELETE,
    Op.TEMPLATE_DELETE,
    Op.PAUSE,
    Op.RESUME,
    Op.KILL,
)


def _values(w: World, op: Op | None, template: str) -> dict[str, object]:
    """Path parameters: the world's objects."""
    name = {
        "/volumes/": w.volume,
        "/templates/": w.template,
        "/pools/": "iso",
        "/nodes/": "n1",
    }
    by_prefix = next((v for k, v in name.items() if k in template), "x")
    if op in (Op.VOLUME_DELETE, Op.TEMPLATE_DELETE):
        by_prefix = "walk-2"  # made by the walk's own create / build
    return {
        "sandbox_id": w.sid,
        "snapshot": w.sid if op is Op.RESUME else w.snapshot,
        "snapshot_id": w.snapshot,
        "context": w.context,
        "name": by_prefix,
        "approval_id": "ap-0000000000000000",
        "request_id": "nope",
        "port": 8000,
        "path": "index.html",
    }


def _fields(w: World, route: Route) -> dict[str, object]:
    """A call that does something real where the route's request allows it; generic values else."""
    f = required(route)
    f.pop("data", None)
    ws = "/workspace"
    base = wire.encode(Template.from_template("base"), tag_bytes=True)
    more: dict[Op, dict[str, object]] = {
        Op.CREATE: {"tier": "container", "pool": False, "timeout": 120, "metadata": {"who": "walk"}},
        Op.EXEC: {"cmd": "echo hi; ls /workspace /data"},
        Op.RUN_CODE: {"code": "import os; os.getcwd()"},
        Op.COMMANDS_START: {"cmd": "sleep 1"},
        Op.COMMANDS_CONNECT: {"pid": w.pid},
        Op.COMMANDS_SEND_STDIN: {"pid": w.pid, "data": "x"},
        Op.COMMANDS_KILL: {"pid": w.pid},
        Op.PTY_RESIZE: {"pid": w.pid, "cols": 80, "rows": 24},
        Op.FILES_READ: {"path": f"{ws}/f.txt"},
        Op.FILES_READ_STREAM: {"path": f"{ws}/f.txt"},
        Op.FILES_WRITE: {"path": f"{ws}/w.txt"},
        Op.FILES_WRITE_STREAM: {"path": f"{ws}/ws.txt"},
        Op.FILES_WRITE_MANY: {"files": [{"path": f"{ws}/m.txt", "data": "x"}]},
        Op.FILES_RENAME: {"old_path": f"{ws}/g.txt", "new_path": f"{ws}/h.txt"},
        Op.FILES_UPLOAD_DIR: {"path": f"{ws}/up"},
        Op.FILES_DOWNLOAD_DIR: {"path": f"{ws}/d"},
        Op.FILES_WATCH: {"path": f"{ws}/d"},
        Op.FILES_LIST: {"path": ws},
        Op.FILES_STAT: {"path": f"{ws}/f.txt"},
        Op.FILES_MAKE_DIR: {"path": f"{ws}/d2"},
        Op.FILES_REMOVE: {"path": f"{ws}/f.txt"},
        Op.VOLUME_CREATE: {"name": "walk-2", "size_mb": 16},
        Op.TEMPLATE_BUILD: {"name": "walk-2", "template": base},
        Op.NETWORK_UPDATE: {"network": "none"},
        Op.SET_TIMEOUT: {"timeout": 600},
        Op.PORTS_CONNECT: {"port": 8000},
        Op.APPROVAL_ANSWER: {"decision": "deny"},
        Op.NODE_DRAIN: {"timeout": 5},
    }
    f.update(more.get(route.op, {}))
    for k in route.path_fields:
        f.pop(k, None)
    return f


def _raw_body(route: Route) -> bytes | None:
    if route.op is Op.FILES_UPLOAD_DIR:
        import io
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("u.txt")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"u\n"))
        return buf.getvalue()
    return b"written\n" if route.body == "raw" else None


def _call_op(w: World, walker: Walker, route: Route, key: str, values: dict[str, object], **fields: object) -> Answer:
    query, body, headers = request_parts(route, dict(fields))
    raw = _raw_body(route)
    if raw is not None:
        body = raw
    url = route.path.format(**{k: values[k] for k in route.path_fields}) + query
    a = walker.call(route.method, url, body, key=key, headers=headers, route=route.path, finite=route.op in FINITE)
    if route.op is Op.CREATE and a.status == 200:
        w.made.append(a.json()["info"]["sandbox_id"])
    return a


def _call_other(w: World, walker: Walker, method: str, template: str, key: str) -> None:
    """A route that is not an operation: its path parameters filled (the live gVisor sandbox), an
    empty body."""
    values = {**_values(w, None, template), "sandbox_id": w.gvisor}
    url = re.sub(r"{(\w+)(:\w+)?}", lambda m: str(values.get(m.group(1), "x")), template)
    body = b"" if method in ("POST", "PUT", "PATCH") else None
    walker.call(method, url, body, key=key, route=template, finite=False)


def test_no_route_answers_a_host_path(world: World, home: Path):
    w = world
    walker = Walker(w.server)
    routes = app_routes(home)
    ops_first = sorted(
        (r for r in routes if _op_route(*r) is not None),
        key=lambda r: LATE.index(_op_route(*r).op) if _op_route(*r).op in LATE else -1,  # type: ignore[union-attr]
    )
    admin_only = {Op.GC_SNAPSHOTS, Op.TEMPLATE_GC, Op.POOLS_RESIZE, Op.NODE_DRAIN}
    # 1. every operation's route, as a call that works where it can
    for method, template in ops_first:
        route = _op_route(method, template)
        assert route is not None
        values = _values(w, route.op, template)
        if route.op is Op.VOLUME_DELETE:  # in use first: VolumeInUse
            _call_op(w, walker, route, w.key, {**values, "name": w.volume})
        _call_op(w, walker, route, w.key, values, **_fields(w, route))
        if route.op in admin_only:
            _call_op(w, walker, route, w.admin, values, **_fields(w, route))
    # the gVisor sandbox's record, logs, metrics and transcript; the ended one's kept logs
    for op in (Op.INFO, Op.LOGS, Op.METRICS, Op.EXPORT, Op.EXEC):
        route = api.BY_OP[op]
        _call_op(w, walker, route, w.key, {"sandbox_id": w.gvisor}, **_fields(w, route))
        _call_op(w, walker, route, w.key, {"sandbox_id": w.sid}, **_fields(w, route))
    # 2. routes that are not operations (previews, approvals, health, metrics, the console, MCP's mount)
    for method, template in routes:
        if _op_route(method, template) is None and method not in ("MOUNT", "WS"):
            _call_other(w, walker, method, template, w.key)
    # 3. typed errors: unknown ids, another tenant's ids, values that are refused
    refused: dict[Op, dict[str, object]] = {  # nothing is made by these passes
        Op.CREATE: {"tier": "no-such-tier"},
        Op.VOLUME_CREATE: {"name": "walk-3", "size_mb": 1},
        Op.TEMPLATE_BUILD: {"name": "walk-3", "template": {"source": 5}},
    }
    for route in api.ROUTES:
        values = {**_values(w, route.op, route.path), "sandbox_id": FAKE_ID, "snapshot": "snap-nope"}
        values.update(snapshot_id="snap-nope", name="nope", context="nope")
        fields = {**_fields(w, route), **refused.get(route.op, {})}
        _call_op(w, walker, route, w.key, values, **fields)
        _call_op(w, walker, route, w.other, _values(w, route.op, route.path), **fields)
    P = api.PREFIX
    failing = wire.encode(Template.from_template("base").run("echo about to fail; exit 3"), tag_bytes=True)
    for method, path, body in (
        ("POST", f"{P}/volumes", {"name": "huge", "size_mb": 1 << 20}),  # LimitTooHigh: more than is free
        ("POST", f"{P}/sandboxes", {"tier": "container", "pool": False, "limits": {"disk_mb": 10**7}}),
        ("POST", f"{P}/sandboxes", {"tier": "container", "pool": False, "volumes": [{"name": "nope", "path": "/d"}]}),
        ("POST", f"{P}/sandboxes", {"tier": "container", "pool": False, "template": "no-such-template"}),
        ("POST", f"{P}/templates", {"name": "walk-fail", "template": failing}),
        ("GET", f"{P}/nowhere", None),
        ("PATCH", f"{P}/sandboxes", None),
    ):
        a = walker.call(method, path, body, key=w.key)
        assert a.status >= 400 or path.endswith("/templates"), (a.label, a.status, a.body[:500])
    # 4. MCP's tools, each called (MCP over the same tenant's key)
    _walk_mcp(w, walker)

    if os.environ.get("WBT_WALK_DUMP"):
        Path(os.environ["WBT_WALK_DUMP"]).write_text(
            "\n".join(f"{a.status} {a.label[:150]} {a.body[:300]!r}" for a in walker.answers)
        )
    leaks = walker.leaks(forbidden(home))
    assert not leaks, "host paths reached a tenant:\n" + "\n".join(leaks[:40])
    log = w.server.log.read_text(errors="replace")
    assert "Traceback" not in log, log[-6000:]
    missing = [r for r in routes if r[0] not in ("MOUNT", "WS") and r not in walker.walked]
    assert not missing, f"routes this test does not walk: {missing}"
    assert {r for r in routes if r[0] == "MOUNT"} >= {("MOUNT", "/mcp")}


def _walk_mcp(w: World, walker: Walker) -> None:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async def main() -> None:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {w.key}"}, timeout=300)
        async with Client(streamable_http_client(f"{w.server.url}/mcp/", http_client=http)) as c:
            tools = (await c.list_tools()).tools
            assert tools
            late = ("pause", "resume", "kill_sandbox")
            for t in sorted(tools, key=lambda t: late.index(t.name) if t.name in late else -1):
                props = t.input_schema.get("properties", {})
                args: dict[str, object] = {}
                for name in t.input_schema.get("required", []):
                    args[name] = {
                        "sandbox_id": w.gvisor,
                        "snapshot": w.snapshot,
                        "path": "/workspace/nope.txt",
                        "cmd": "echo hi",
                        "code": "1 + 1",
                        "content": "x",
                    }.get(name, "x")
                cases = [args] + ([{**args, "sandbox_id": FAKE_ID}] if "sandbox_id" in props else [])
                for case in cases:
                    r = await c.call_tool(t.name, case)
                    text = json.dumps(r.model_dump(mode="json"), default=str)
                    walker.answers.append(Answer(f"mcp {t.name} {case}", 0 if r.is_error else 200, text.encode()))
                    if t.name == "create_sandbox" and not r.is_error and r.structured_content:
                        w.made.append(r.structured_content["sandbox_id"])

    asyncio.run(main())


def test_the_walk_sees_what_the_server_answered_before(home: Path):
    """The search finds the leaks this test was written for, as the server sent them before: a
    volume's record with its disk's host path, a failed build naming its log's host path."""
    before = [
        json.dumps({"name": "v", "disk": f"{home}/volumes/vol-0123456789abcdef.img"}),
        json.dumps({"error": {"code": "template_build_error", "log": f"{home}/templates/logs/t-1.log"}}),
        json.dumps({"reason": f"runc at {shutil.which('runc')}"}),
    ]
    walker = Walker.__new__(Walker)
    walker.answers = [Answer(f"before {i}", 200, b.encode()) for i, b in enumerate(before)]
    assert len(walker.leaks(forbidden(home))) >= len(before)
