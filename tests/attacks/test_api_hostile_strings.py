"""Hostile strings in every string field of every operation, over a real `warmbox serve`.

A lone UTF-16 surrogate ("\\ud800", a JSON escape no UTF-8 can hold) in a create's metadata, a
``files/batch`` path or a ``files/rename`` path was a 500 with a UnicodeEncodeError traceback in the
server's log, and a create had first claimed a pooled sandbox and destroyed it. Now the request is
refused (400 invalid_argument) where requests are decoded, before anything is looked up or claimed.

The fields are enumerated from the operations' request records (recursively: records, lists,
dicts and their keys, ``object`` fields), so a new field or operation is fuzzed too. Each string
gets a lone surrogate (400 invalid_argument), a NUL and a 100,000-character string (a typed answer:
never a 5xx). Path and query fields get the surrogate's UTF-8 bytes percent-encoded. One server, one
sandbox for the operations that name one; the pool's claims and the tenant's sandboxes are the same
after as before, the sandbox still answers, and the server logged no traceback."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import http.client
import json
import types
import typing
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import pytest

from tests.attacks.conftest import read_answer
from tests.conftest import ServerProc, start_server
from warmbox import api, wire
from warmbox import operations as ops
from warmbox.api import Route
from warmbox.engine import teardown
from warmbox.engine.engine import Engine
from warmbox.errors import InvalidArgument
from warmbox.operations import Op
from warmbox.templates import Template

pytestmark = pytest.mark.sandbox

SURROGATE = "\ud800"
NASTY = {"surrogate": "a" + SURROGATE + "b", "nul": "a\x00b", "long": "x" * 100_000}
# starts, ends or builds for real when a NUL or long value is accepted (the surrogate reaches every op)
HEAVY = {Op.CREATE, Op.RESUME, Op.PAUSE, Op.TEMPLATE_BUILD, Op.NODE_DRAIN, Op.KILL}


# ---- every string of every operation


def example(tp: Any, depth: int = 0) -> Any:
    """A wire value of type ``tp`` with every optional part present (so its strings can be reached)."""
    if depth > 8:
        return None
    if tp is Any or tp is object:
        return "x"
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        return example(str if str in arms else arms[0], depth + 1)
    if origin is typing.Literal:
        return typing.get_args(tp)[0]
    if origin in (list, tuple, collections_abc_sequence()) or tp in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis] or [str]
        return [example(a, depth + 1) for a in args]
    if origin is dict or tp is dict:
        args = typing.get_args(tp) or (str, str)
        return {"k": example(args[1], depth + 1)}
    if isinstance(tp, type):
        if tp is Template:
            return wire.encode(Template.from_template("base").run("true").env({"K": "v"}), tag_bytes=True)
        if issubclass(tp, enum.Enum):
            return next(iter(tp)).value
        if tp is bool:
            return False
        if tp in (int, float):
            return 1
        if tp is str:
            return "x"
        if tp is bytes:
            return "eA=="
        if dataclasses.is_dataclass(tp):
            h = wire.hints(tp)
            return {
                f.name: example(h[f.name], depth + 1)
                for f in dataclasses.fields(tp)
                if f.init and not f.metadata.get("local")
            }
    return None


def collections_abc_sequence() -> Any:
    from collections.abc import Sequence

    return Sequence


def strings(value: Any, at: tuple = ()) -> list[tuple]:
    """Where the strings of a JSON value are: paths of keys/indexes; ("key", k) for a dict's key."""
    if isinstance(value, str):
        return [at]
    out: list[tuple] = []
    if isinstance(value, list):
        for i, v in enumerate(value):
            out += strings(v, (*at, i))
    elif isinstance(value, dict):
        for k, v in value.items():
            out.append((*at, ("key", k)))
            out += strings(v, (*at, k))
    return out


def put(value: Any, at: tuple, nasty: str) -> Any:
    """``value`` with the string at ``at`` replaced by ``nasty``."""
    if not at:
        return nasty
    head, rest = at[0], at[1:]
    if isinstance(head, tuple):  # a dict's key
        out = dict(value)
        out[nasty] = out.pop(head[1])
        return out
    if isinstance(value, list):
        return [put(v, rest, nasty) if i == head else v for i, v in enumerate(value)]
    return {k: put(v, rest, nasty) if k == head else v for k, v in value.items()}


@dataclasses.dataclass
class World:
    server: ServerProc
    key: str
    sid: str
    pid: int


BASE: dict[Op, dict[str, object]] = {  # valid calls: a surrogate anywhere else must be all that is wrong
    Op.CREATE: {
        "tier": "container",
        "template": "base",
        "limits": {"memory_mb": 500},  # the shape of the session's pool "iso": a create claims from it
        "metadata": {"k": "v"},
        "envs": {"K": "v"},
        "timeout": 60,
    },
    Op.EXEC: {"cmd": "true", "envs": {"K": "v"}, "cwd": "/workspace", "stdin": "in"},
    Op.RUN_CODE: {"code": "1", "context": "default"},
    Op.FILES_WRITE_MANY: {"files": [{"path": "/workspace/a.txt", "data": "x"}]},
    Op.FILES_RENAME: {"old_path": "/workspace/a.txt", "new_path": "/workspace/b.txt"},
    Op.COMMANDS_START: {"cmd": "true", "tag": "t"},
    Op.COMMANDS_SEND_STDIN: {"data": "x"},
    Op.LIST: {"query": {"metadata": {"k": "v"}}},
    Op.NETWORK_UPDATE: {"network": {"allow": ["example.com"]}},
    Op.VOLUME_CREATE: {"size_mb": 16},
}


def cases() -> list[Any]:
    out = []
    for route in api.ROUTES:
        if route.response == "websocket":
            continue
        cls = ops.REQUESTS[route.op]
        hints = wire.hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init or f.metadata.get("local") or (route.body == "raw" and f.name == "data"):
                continue
            value = BASE.get(route.op, {}).get(f.name, example(hints[f.name]))
            for at in strings(value):
                for kind in NASTY:
                    if kind != "surrogate" and route.op in HEAVY:
                        continue
                    where = "path" if f.name in route.path_fields else route.body
                    cid = f"{route.op.value}-{f.name}{''.join(f'[{a!r}]' for a in at)}-{kind}"
                    out.append(pytest.param(route, f.name, value, at, kind, where, id=cid[:120]))
    return out


CASES = cases()


# ---- the server and its sandbox


def _call(w: World, method: str, url: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
    u = urlsplit(w.server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request(method, url, body=body, headers={"Authorization": f"Bearer {w.key}", **headers})
        r = conn.getresponse()
        data = read_answer(conn, r, 3 if r.status == 200 else None)
    finally:
        conn.close()
    return r.status, data


def _q(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


def _request(w: World, route: Route, field: str, value: Any) -> tuple[str, str, bytes | None, dict[str, str]]:
    """(method, url, body, headers) of the route's request with ``field`` = ``value``, the rest valid."""
    cls = ops.REQUESTS[route.op]
    hints = wire.hints(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("local") or f.name in route.path_fields:
            continue
        if route.body == "raw" and f.name == "data":
            continue
        if f.name in BASE.get(route.op, {}):
            fields[f.name] = BASE[route.op][f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            fields[f.name] = {"pid": w.pid}.get(f.name, example(hints[f.name]))
    params = {"sandbox_id": w.sid, "snapshot": w.sid, "snapshot_id": "snap-x", "context": "default", "name": "x"}
    params.update(approval_id="ap-0000000000000000")
    if field in route.path_fields:
        params[field] = value
    else:
        fields[field] = value
    url = route.path.format(**{k: _q(str(params[k])) for k in route.path_fields})
    if route.body == "json":
        return route.method, url, json.dumps(fields).encode(), {"Content-Type": "application/json"}
    q = "&".join(f"{k}={_q(v if isinstance(v, str) else json.dumps(v))}" for k, v in fields.items())
    body = b"bytes\n" if route.body == "raw" else None
    return route.method, url + ("?" + q if q else ""), body, {}


@pytest.fixture(scope="module")
def world(home: Path, runc_ready: None):
    server = start_server(home, home / "strings.sock")
    engine = Engine.for_home(home)
    _, key = engine.registry.tenants.create_key("strings")
    w = World(server, key, "", 0)
    made: list[str] = []
    try:
        status, data = _call(w, "POST", f"{api.PREFIX}/sandboxes", json.dumps(BASE[Op.CREATE]).encode(), {})
        assert status == 200, data
        w.sid = json.loads(data)["info"]["sandbox_id"]
        made.append(w.sid)
        sb = f"{api.PREFIX}/sandboxes/{w.sid}"
        status, data = _call(w, "POST", f"{sb}/processes", json.dumps({"cmd": "sleep 900"}).encode(), {})
        assert status == 200, data
        w.pid = json.loads(data)
        yield w
    finally:
        server.stop()
        for sid in made:
            asyncio.run(teardown.destroy(engine, sid, "test cleanup"))


@pytest.fixture(scope="module")
def before(world: World, home: Path):
    """The pool's claims and the tenant's live sandboxes before the fuzz; checked after it."""
    state = _state(world, home)
    yield state
    assert _state(world, home) == state, "a request with a hostile string claimed or made a sandbox"
    log = world.server.log.read_text(errors="replace")
    assert "Traceback" not in log and "UnicodeEncodeError" not in log, log[-6000:]
    status, data = _call(world, "POST", f"{api.PREFIX}/sandboxes/{world.sid}/ping", b"{}", {})
    assert status == 200, data


def _state(w: World, home: Path) -> tuple[Any, ...]:
    engine = Engine.for_home(home)
    pools = [(p.name, p.hits, p.misses) for p in asyncio.run(_pools(engine))]
    live = sorted(i.sandbox_id for i in engine.list() if i.tenant == "strings")
    return pools, live


async def _pools(engine: Engine) -> list[Any]:
    from warmbox.engine.front import EngineFront

    front = EngineFront(engine)
    try:
        return await front.handle(ops.PoolsList())
    finally:
        await front.close()


@pytest.mark.parametrize("route,field,value,at,kind,where", CASES)
def test_a_hostile_string_in_any_field_is_a_typed_answer(world, before, route, field, value, at, kind, where):
    method, url, body, headers = _request(world, route, field, put(value, at, NASTY[kind]))
    status, data = _call(world, method, url, body, headers)
    assert status < 500, (status, data[:600])
    if status >= 400:
        error = json.loads(data)["error"]
        assert isinstance(error.get("code"), str) and error["code"] in wire.ERRORS, error
    if kind == "surrogate" and where == "json":  # a \ud800 escape: refused as it is decoded
        assert status == 400 and json.loads(data)["error"]["code"] == "invalid_argument", (status, data[:600])


def test_every_operation_with_a_string_is_fuzzed():
    """The enumeration reaches the fields of the report: a create's metadata (keys and values), a
    files/batch entry's path, both paths of a rename; and every route taking a string."""
    ids = {c.id for c in CASES}
    for want in ("create-metadata[('key', 'k')]", "create-metadata['k']", "files.write_files-files[0]['path']"):
        assert any(i.startswith(want) for i in ids), want
    assert any(i.startswith("files.rename-old_path") for i in ids) and any(
        i.startswith("files.rename-new_path") for i in ids
    )
    fuzzed = {c.values[0].op for c in CASES}
    with_strings = {
        r.op
        for r in api.ROUTES
        if r.response != "websocket" and any(strings(example(t)) for t in wire.hints(ops.REQUESTS[r.op]).values())
    }
    assert with_strings <= fuzzed


def test_the_in_process_front_refuses_before_claiming(home: Path, runc_ready: None):
    """The SDK in process (no server, no codec): the same refusal before the pool is touched."""
    from warmbox.engine.front import EngineFront

    engine = Engine.for_home(home)
    before = [(p.name, p.hits, p.misses) for p in asyncio.run(_pools(engine))]

    async def create() -> None:
        front = EngineFront(engine)
        try:
            with pytest.raises(InvalidArgument, match="surrogate"):
                await front.handle(ops.Create(tier="container", template="base", metadata={"k": SURROGATE}))
            with pytest.raises(InvalidArgument, match=r"files\[0\]\.path"):
                await front.handle(ops.WriteFiles("sb-000000000000", (ops.WriteEntry("a" + SURROGATE, b""),)))
        finally:
            await front.close()

    asyncio.run(create())
    assert [(p.name, p.hits, p.misses) for p in asyncio.run(_pools(engine))] == before
