"""MCP over streamable HTTP at /mcp of a real `warmbox serve`: the SDK's HTTP client, real keys,
real container sandboxes; each tenant sees only its own sandboxes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, TextContent

from warmbox.engine import teardown

pytestmark = pytest.mark.sandbox


def start_server(home: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """A real `warmbox serve` on 127.0.0.1 (any free port, no unix socket); its base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "warmbox.cli.main", "serve", "--port", "0", "--socket", "-", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "WARMBOX_HOME": str(home)},
    )
    deadline = time.monotonic() + 30
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "listening on http://127.0.0.1:PORT"
    if not line.startswith("listening on ") or time.monotonic() > deadline:
        proc.kill()
        raise AssertionError(f"server did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    return proc, line.split()[2]


def stop_server(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def test_mcp_over_http_is_per_tenant(home: Path, runc_ready: None) -> None:
    from warmbox.engine.engine import Engine

    reg = Engine.for_home(home).registry
    _, alice = reg.tenants.create_key("mcp-alice")
    _, bob = reg.tenants.create_key("mcp-bob")
    proc, base = start_server(home)
    ids: list[str] = []

    def client(key: str) -> Client:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=120)
        return Client(streamable_http_client(f"{base}/mcp/", http_client=http), read_timeout_seconds=120)

    async def main() -> None:
        async with client(alice) as a:
            r = await a.call_tool("create_sandbox", {"tier": "container", "timeout": 300})
            assert isinstance(r, CallToolResult) and not r.is_error, r.content
            sid = r.structured_content["sandbox_id"]
            ids.append(sid)
            r = await a.call_tool("run_code", {"sandbox_id": sid, "code": "print('hi'); 6 * 7"})
            assert not r.is_error and (r.structured_content["text"], r.structured_content["stdout"]) == ("42", "hi\n")
        async with client(bob) as b:
            r = await b.call_tool("run_command", {"sandbox_id": sid, "command": "true"})
            assert r.is_error and isinstance(r.content[0], TextContent)
            assert r.content[0].text.startswith("sandbox_not_found: ")  # alice's id does not exist for bob
            listed = (await b.call_tool("list_sandboxes", {})).structured_content["sandboxes"]
            assert sid not in {s["sandbox_id"] for s in listed}
        async with client(alice) as a:
            r = await a.call_tool("kill_sandbox", {"sandbox_id": sid})
            assert not r.is_error and r.structured_content["killed"] is True
        async with httpx2.AsyncClient() as anon:  # no key: refused before MCP sees it
            r2 = await anon.post(f"{base}/mcp/", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
            assert r2.status_code == 401 and r2.json()["error"]["code"] == "unauthenticated"

    try:
        asyncio.run(main())
    finally:
        stop_server(proc)
        eng = Engine.for_home(home)
        for sid in ids:
            asyncio.run(teardown.destroy(eng, sid, "test cleanup"))
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    # the port is free again: no process the server started (the engine's daemon) kept its socket
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5).close()
