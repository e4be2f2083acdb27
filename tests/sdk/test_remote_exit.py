"""A script that uses a warmbox server and exits leaves nothing open behind it (issue 34)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import start_server
from warmbox import Sandbox

SCRIPT = """
from warmbox import Sandbox
sb = Sandbox.create(timeout=120, pool=False)
print(sb.sandbox_id, flush=True)
sb.commands.run("true")
sb.pause()
assert sb.get_info().state.value == "paused" and not sb.is_running()  # questions that do not resume it
"""


@pytest.mark.sandbox
def test_a_remote_pause_then_exit_prints_no_unclosed_session(home, runc_ready, api_server):
    r = subprocess.run(
        [sys.executable, "-X", "dev", "-c", SCRIPT],  # dev mode: ResourceWarnings are shown too
        capture_output=True,
        text=True,
        timeout=300,
        env={**api_server.client_env, "WARMBOX_HOME": str(home), "PATH": "/usr/bin:/bin"},
    )
    sid = r.stdout.strip()
    try:
        assert r.returncode == 0, r.stderr
        assert sid.startswith("sb-"), r.stdout
        assert "Unclosed" not in r.stderr and "ResourceWarning" not in r.stderr, r.stderr
    finally:
        if sid.startswith("sb-"):
            Sandbox.connect(sid, **_remote(api_server)).kill()


def _remote(server) -> dict:
    return {"api_url": server.client_env["WARMBOX_API_URL"], "api_key": server.client_env["WARMBOX_API_KEY"]}


@pytest.mark.sandbox
@pytest.mark.in_process("starts its own server on uvloop")
def test_serve_on_uvloop_creates_runs_code_and_commands(home, runc_ready):
    """`warmbox serve --loop uvloop`: the engine's guest connection took only asyncio's own
    transport class, so every start failed there at the agent's first request."""
    pytest.importorskip("uvloop")
    server = start_server(home, home / "uvloop.sock", tcp=False, args=("--loop", "uvloop"))
    try:
        with Sandbox.create(tier="container", timeout=120, run_code="print(2+2)", api_url=server.unix_url) as sb:
            assert sb.first_execution is not None and sb.first_execution.stdout == "4\n"
            assert sb.commands.run("echo hi").stdout == "hi\n"
    finally:
        assert server.stop() == 0, server.output()
