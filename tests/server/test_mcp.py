"""The MCP server: tools, schemas and the error contract in process over a fake transport (fast lane),
then `warmbox mcp` as an agent runs it: the SDK's stdio client spawning it, real container sandboxes."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from mcp import Client, StdioServerParameters
from mcp.types import CallToolResult, ImageContent, TextContent

from warmbox import Network
from warmbox import operations as ops
from warmbox.engine import teardown
from warmbox.errors import SandboxNotFound
from warmbox.models import CommandResult, Execution, Result, SandboxInfo, StageTiming, State
from warmbox.server.mcp import build_mcp, error_code

TOOLS = {
    "create_sandbox",
    "run_command",
    "run_code",
    "read_file",
    "write_file",
    "list_files",
    "snapshot",
    "pause",
    "resume",
    "kill_sandbox",
    "list_sandboxes",
    "get_sandbox",
    "export_sandbox",
    "start_command",
    "list_processes",
    "process_output",
    "send_stdin",
    "kill_process",
}
SID = "sb-0123456789ab"


# A valid 2x2 RGB PNG from the standard library, for the fake transport here and for the sandbox's Python
# (which has no imaging library).
PNG_SOURCE = """
import struct, zlib

def png(width=2, height=2):
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\\0" + b"\\xff\\x00\\x00" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return b"\\x89PNG\\r\\n\\x1a\\n" + body
"""
# prints the bytes it displays: the guest's zlib may compress differently from the host's
PNG_CELL = (
    PNG_SOURCE + "\nclass Chart:\n    def _repr_png_(self):\n        return png()\n\nprint(png().hex())\nChart()\n"
)
_ns: dict[str, Any] = {}
exec(PNG_SOURCE, _ns)
_png: Callable[[], bytes] = _ns["png"]


class FakeTransport:
    """Answers from ``answer`` and records what the tools sent."""

    def __init__(self, answer: Callable[[ops.Request[Any]], Any]) -> None:
        self.answer = answer
        self.sent: list[ops.Request[Any]] = []

    async def handle(self, request: ops.Request[Any]) -> Any:
        self.sent.append(request)
        return self.answer(request)

    async def subscribe_approvals(self, sandbox_id: str, hook: object) -> Any:
        raise NotImplementedError

    async def close(self) -> None:
        pass


def _info() -> SandboxInfo:
    return SandboxInfo(SID, "container", State.READY, 1.0, 2.0, 512, 1.0, 256, "base")


def _answer(request: ops.Request[Any]) -> Any:
    if isinstance(request, ops.Create):
        return ops.Opened(_info(), (StageTiming(SID, "allocation", 1.5),))
    if isinstance(request, ops.Exec):
        if request.sandbox_id != SID:
            raise SandboxNotFound(f"sandbox {request.sandbox_id} not found", request.sandbox_id)
        return CommandResult(3, "hi\n", "", False, False, False, 0, 1.0, 7)
    if isinstance(request, ops.RunCode):
        results = (Result(False, text="<Chart>", png=base64.b64encode(_png()).decode()), Result(True, text="42"))
        return Execution(results, "out\n", "", None, False, False, False, 1, 2.0)
    if isinstance(request, ops.ReadFile):
        return b"\xff\xfe binary"
    if isinstance(request, ops.Kill):
        raise RuntimeError("a bug with a secret in its message")
    raise AssertionError(f"unexpected {request!r}")


def _with_client(fn: Callable[[Client, FakeTransport], Awaitable[None]]) -> FakeTransport:
    fake = FakeTransport(_answer)

    async def main() -> None:
        async with Client(build_mcp(lambda ctx: fake)) as client:
            await fn(client, fake)

    asyncio.run(main())
    return fake


def _text(r: Any) -> str:
    assert isinstance(r, CallToolResult)
    assert isinstance(r.content[0], TextContent)
    return r.content[0].text


def test_tools_are_listed_with_typed_schemas():
    async def check(client: Client, fake: FakeTransport) -> None:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == TOOLS
        for t in tools.values():
            assert t.description, t.name
            assert t.output_schema is not None, t.name  # every tool has a typed result
            for name, prop in t.input_schema.get("properties", {}).items():
                assert "type" in prop or "anyOf" in prop, (t.name, name, prop)  # nothing untyped
                assert prop.get("description"), (t.name, name)
        run = tools["run_command"].input_schema
        assert run["required"] == ["sandbox_id", "command"]  # the SDK's name; `cmd` is a hidden alias
        assert tools["resume"].input_schema["required"] == ["sandbox_id"]
        assert run["properties"]["timeout"]["exclusiveMinimum"] == 0
        net = tools["create_sandbox"].input_schema["properties"]["network"]["anyOf"]
        assert {"enum": ["none", "internet"], "type": "string"} in net
        assert {"items": {"type": "string"}, "type": "array"} in net
        assert set(tools["run_code"].output_schema["properties"]) >= {"text", "stdout", "stderr", "error", "results"}
        assert tools["kill_sandbox"].annotations and tools["kill_sandbox"].annotations.destructive_hint
        assert tools["read_file"].annotations and tools["read_file"].annotations.read_only_hint

    _with_client(check)


def test_tools_send_operations_and_return_structured_results():
    async def check(client: Client, fake: FakeTransport) -> None:
        r = await client.call_tool("create_sandbox", {"network": ["pypi.org", "*.github.com"], "timeout": 30})
        assert not r.is_error, _text(r)
        assert r.structured_content["sandbox_id"] == SID and r.structured_content["start_ms"] == {"allocation": 1.5}
        assert json.loads(_text(r))["sandbox_id"] == SID
        r = await client.call_tool(
            "run_command", {"sandbox_id": SID, "command": "echo hi", "cwd": "src", "idempotency_key": "step-1"}
        )
        assert r.structured_content["exit_code"] == 3 and r.structured_content["stdout"] == "hi\n"
        r = await client.call_tool("run_command", {"sandbox_id": SID, "cmd": "echo hi", "cwd": "src"})  # earlier name
        assert not r.is_error and r.structured_content["exit_code"] == 3
        r = await client.call_tool("run_code", {"sandbox_id": SID, "code": "Chart(); 6*7", "language": "python"})
        out = r.structured_content
        assert out["text"] == "42" and out["stdout"] == "out\n" and out["error"] is None
        assert [x["images"] for x in out["results"]] == [["image/png"], []]
        images = [c for c in r.content if isinstance(c, ImageContent)]
        assert len(images) == 1 and images[0].mime_type == "image/png"
        assert base64.b64decode(images[0].data) == _png()

    fake = _with_client(check)
    create, run, run_alias, code = fake.sent
    assert create == ops.Create(network=Network(allow=["pypi.org", "*.github.com"]), timeout=30)
    assert run == ops.Exec(SID, "echo hi", cwd="src", timeout=60.0, idempotency_key="step-1")
    assert run_alias == ops.Exec(SID, "echo hi", cwd="src", timeout=60.0)
    assert code == ops.RunCode(SID, "Chart(); 6*7", context="default", timeout=60.0, language="python")


def test_errors_are_tool_errors_starting_with_the_warmbox_code():
    assert error_code(SandboxNotFound("x")) == "sandbox_not_found"

    async def check(client: Client, fake: FakeTransport) -> None:
        async def error(tool: str, args: dict[str, Any]) -> str:
            r = await client.call_tool(tool, args)
            assert isinstance(r, CallToolResult) and r.is_error, (tool, args, r)
            text = _text(r)
            assert "Traceback" not in text and "Error executing tool" not in text, text
            return text

        text = await error("run_command", {"sandbox_id": "sb-000000000000", "command": "true"})
        assert text == "sandbox_not_found: sandbox sb-000000000000 not found"
        # arguments outside the schema: refused before any operation is sent
        assert (await error("run_command", {"sandbox_id": SID, "command": "true", "timeout": -1})).startswith(
            "invalid_argument: run_command: timeout:"
        )
        assert (await error("run_command", {"command": "true"})).startswith(
            "invalid_argument: run_command: sandbox_id:"
        )
        assert (await error("create_sandbox", {"network": "wifi"})).startswith("invalid_argument: create_sandbox:")
        assert (await error("list_files", {"sandbox_id": SID, "depth": 0})).startswith("invalid_argument:")
        # refused by warmbox's own validation (an allowlist entry that is no host)
        assert (await error("create_sandbox", {"network": ["not a host!"]})).startswith("invalid_argument:")
        assert (await error("read_file", {"sandbox_id": SID, "path": "bin"})).startswith(
            "invalid_argument: bin is not UTF-8 text"
        )
        assert (await error("no_such_tool", {})).startswith("unknown_tool: no tool 'no_such_tool'")
        assert (await error("run_command", {"sandbox_id": SID, "command": "a", "cmd": "b"})) == (
            "invalid_argument: run_command: give command (or its earlier name cmd), not both"
        )
        # a bug: its type, never its message or traceback
        text = await error("kill_sandbox", {"sandbox_id": SID})
        assert text.startswith("internal_error: RuntimeError in kill_sandbox") and "secret" not in text

    fake = _with_client(check)
    assert [type(r).__name__ for r in fake.sent] == ["Exec", "ReadFile", "Kill"]


def test_each_call_asks_for_its_transport_with_its_context():
    seen: list[Any] = []
    fake = FakeTransport(_answer)

    def transport_for(ctx: Any) -> FakeTransport:
        seen.append(ctx)
        return fake

    async def main() -> None:
        async with Client(build_mcp(transport_for)) as client:
            await client.call_tool("run_command", {"sandbox_id": SID, "command": "true"})
            await client.call_tool("run_command", {"sandbox_id": SID, "command": "true"})

    asyncio.run(main())
    assert len(seen) == 2 and seen[0] is not seen[1]
    assert seen[0].request_context.request is None  # in process / stdio: no HTTP request to read a tenant from


def test_mounted_over_http_each_call_runs_on_the_transport_of_its_requests_tenant():
    """The recipe for the HTTP server: auth puts the tenant on the request's state, transport_for reads it."""
    import httpx2
    from mcp.client.streamable_http import streamable_http_client
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Mount

    from warmbox.server.mcp import http_request_of

    tenants = {"alice": FakeTransport(_answer), "bob": FakeTransport(_answer)}

    class BearerTenant:  # stands in for the server's authentication
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                token = dict(scope["headers"]).get(b"authorization", b"").decode().removeprefix("Bearer ")
                scope.setdefault("state", {})["tenant"] = token
            await self.app(scope, receive, send)

    server = build_mcp(lambda ctx: tenants[http_request_of(ctx).state.tenant])
    mcp_app = server.streamable_http_app(streamable_http_path="/", stateless_http=True, json_response=True)
    app = Starlette(routes=[Mount("/mcp", app=mcp_app)], middleware=[Middleware(BearerTenant)])
    base = "http://127.0.0.1:8000"  # the SDK's DNS-rebinding check wants a loopback host with a port

    async def main() -> None:
        async with server.session_manager.run():  # a mounted app's lifespan does not run: the parent's must
            for tenant, calls in (("alice", 2), ("bob", 1)):
                http = httpx2.AsyncClient(
                    transport=httpx2.ASGITransport(app=app),
                    base_url=base,
                    headers={"Authorization": f"Bearer {tenant}"},
                )
                async with Client(streamable_http_client(f"{base}/mcp/", http_client=http)) as client:
                    for _ in range(calls):
                        r = await client.call_tool("run_command", {"sandbox_id": SID, "command": "true"})
                        assert not r.is_error and r.structured_content["exit_code"] == 3

    asyncio.run(main())
    assert {name: len(t.sent) for name, t in tenants.items()} == {"alice": 2, "bob": 1}


# ---- `warmbox mcp` over stdio, real sandboxes


def _server() -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=["-m", "warmbox.cli.main", "mcp"], env=dict(os.environ))


@pytest.mark.sandbox
def test_warmbox_mcp_over_stdio_drives_a_real_sandbox(home, runc_ready):
    ids: list[str] = []  # every sandbox this test made, for cleanup if it fails

    async def call(client: Client, tool: str, **args: Any) -> dict[str, Any]:
        r = await client.call_tool(tool, args)
        assert isinstance(r, CallToolResult) and not r.is_error, (tool, r.content)
        return r.structured_content

    async def main() -> None:
        async with Client(_server(), read_timeout_seconds=120) as client:
            from warmbox import __version__

            assert client.server_info is not None and client.server_info.version == __version__ != ""
            assert {t.name for t in (await client.list_tools()).tools} == TOOLS
            box = await call(client, "create_sandbox", tier="container", timeout=300, metadata={"agent": "mcp-test"})
            sid = box["sandbox_id"]
            ids.append(sid)
            assert box["state"] in ("ready", "running") and box["tier"] == "container" and box["start_ms"]
            assert sid in {s["sandbox_id"] for s in (await call(client, "list_sandboxes"))["sandboxes"]}
            listed = (await call(client, "list_sandboxes", metadata={"agent": "mcp-test"}))["sandboxes"]
            assert [s["sandbox_id"] for s in listed] == [sid]
            assert (await call(client, "list_sandboxes", metadata={"agent": "other"}))["sandboxes"] == []
            assert (await call(client, "get_sandbox", sandbox_id=sid))["metadata"] == {"agent": "mcp-test"}

            # background processes: a server-like loop, a job that ends, their output and kill
            srv = await call(client, "start_command", sandbox_id=sid, command="echo up; cat", tag="echoer")
            job = await call(client, "start_command", sandbox_id=sid, command="echo done; echo err >&2; exit 4")
            procs = (await call(client, "list_processes", sandbox_id=sid))["processes"]
            assert {"pid": srv["pid"], "command": "echo up; cat", "cwd": "/workspace", "tag": "echoer"} in procs
            out = await call(client, "process_output", sandbox_id=sid, pid=job["pid"], wait=30)
            assert (out["stdout"], out["stderr"], out["running"], out["exit_code"]) == ("done\n", "err\n", False, 4)
            await call(client, "send_stdin", sandbox_id=sid, pid=srv["pid"], data="ping\n")
            out = await call(client, "process_output", sandbox_id=sid, pid=srv["pid"], wait=1)
            assert out["running"] is True and out["stdout"].startswith("up\n"), out
            assert (await call(client, "kill_process", sandbox_id=sid, pid=srv["pid"]))["killed"] is True
            out = await call(client, "process_output", sandbox_id=sid, pid=srv["pid"], wait=30)
            assert out["running"] is False and out["stdout"] == "up\nping\n", out

            out = await call(client, "run_command", sandbox_id=sid, command="echo hi; echo oops >&2; exit 3")
            assert (out["exit_code"], out["stdout"], out["stderr"], out["timed_out"]) == (3, "hi\n", "oops\n", False)
            out = await call(client, "run_command", sandbox_id=sid, command="sleep 5", timeout=0.5)
            assert out["timed_out"] is True

            await call(client, "write_file", sandbox_id=sid, path="notes/a.txt", content="héllo\n")
            got = await call(client, "read_file", sandbox_id=sid, path="/workspace/notes/a.txt")
            assert got == {"path": "/workspace/notes/a.txt", "content": "héllo\n", "size": 7}
            names = [e["name"] for e in (await call(client, "list_files", sandbox_id=sid, path="notes"))["entries"]]
            assert names == ["a.txt"]

            out = await call(client, "run_code", sandbox_id=sid, code="x = 6\nprint('out')\nx * 7")
            assert (out["text"], out["stdout"], out["error"]) == ("42", "out\n", None)
            out = await call(client, "run_code", sandbox_id=sid, code="x / 0")  # the context kept x
            assert out["error"]["name"] == "ZeroDivisionError"

            # an image result: the guest's kernel sends what _repr_png_ returns (no imaging library needed)
            r = await client.call_tool("run_code", {"sandbox_id": sid, "code": PNG_CELL})
            assert isinstance(r, CallToolResult) and not r.is_error, r.content
            images = [c for c in r.content if isinstance(c, ImageContent)]
            assert [i.mime_type for i in images] == ["image/png"]
            assert base64.b64decode(images[0].data) == bytes.fromhex(r.structured_content["stdout"].strip())
            assert r.structured_content["results"][0]["images"] == ["image/png"]

            snap = await call(client, "pause", sandbox_id=sid)
            assert snap["sandbox_id"] == sid
            back = await call(client, "resume", sandbox_id=sid)
            assert back["sandbox_id"] == sid  # one id for the sandbox's whole life
            got = await call(client, "read_file", sandbox_id=sid, path="notes/a.txt")
            assert got["content"] == "héllo\n"
            assert (await call(client, "run_code", sandbox_id=sid, code="x"))["text"] == "6"  # variables too

            r = await client.call_tool("run_command", {"sandbox_id": "sb-000000000000", "command": "true"})
            assert isinstance(r, CallToolResult) and r.is_error
            assert _text(r).startswith("sandbox_not_found: ")

            assert (await call(client, "kill_sandbox", sandbox_id=sid))["killed"] is True
            # its history after the end: every command above is in it
            ex = await call(client, "export_sandbox", sandbox_id=sid)
            assert ex["sandbox_id"] == sid and ex["truncated"] is False
            kinds = [json.loads(line)["type"] for line in ex["ndjson"].splitlines()]
            assert len(kinds) == ex["records"] and kinds[:2] == ["export", "sandbox"] and "command" in kinds
            r = await client.call_tool("run_command", {"sandbox_id": sid, "command": "true"})
            assert isinstance(r, CallToolResult) and r.is_error
            assert _text(r) == f"sandbox_not_found: sandbox {sid} was destroyed"

    try:
        asyncio.run(main())
    finally:
        from warmbox.engine.engine import Engine

        engine = Engine.for_home(home)
        live = {i.sandbox_id for i in engine.list()}
        for sid in ids:
            if sid in live:  # the test failed with it alive
                asyncio.run(teardown.destroy(engine, sid, "test cleanup"))


class _Chatty:
    """A background process that never stops printing (ConnectProcess's stream)."""

    pid = 7
    result = None

    def __init__(self) -> None:
        self.cancelled = False

    async def next(self) -> Any:
        from warmbox.models import ProcessEvent

        await asyncio.sleep(0)
        return ProcessEvent("stdout", "x" * 65536)

    def cancel(self) -> None:
        self.cancelled = True


def test_process_output_of_an_endless_process_is_bounded_in_time_and_size():
    from warmbox.server.mcp import MAX_TOOL_TEXT, REPLAY_GRACE_S

    chatty = _Chatty()
    fake = FakeTransport(lambda r: chatty if isinstance(r, ops.ConnectProcess) else _answer(r))

    async def main() -> None:
        async with Client(build_mcp(lambda ctx: fake)) as client:
            t0 = asyncio.get_running_loop().time()
            r = await client.call_tool("process_output", {"sandbox_id": SID, "pid": 7, "wait": 1})
            took = asyncio.get_running_loop().time() - t0
            assert not r.is_error, _text(r)
            out = r.structured_content
            assert out["running"] is True and out["exit_code"] is None and out["truncated"] is True
            assert len(out["stdout"]) == MAX_TOOL_TEXT
            assert took < 1 + REPLAY_GRACE_S + 5, took  # the wait, the replay's grace, a loaded host's slack

    asyncio.run(main())
    assert chatty.cancelled
