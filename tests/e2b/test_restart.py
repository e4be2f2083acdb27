"""A sandbox an E2B SDK holds keeps working across a restart of `warmbox serve`: its access token
is signed with the registry's signing key (warmbox.engine.signing), not a secret of one server process."""

from __future__ import annotations

import socket

import pytest

from tests.conftest import start_server

pytestmark = pytest.mark.sandbox
e2b = pytest.importorskip("e2b", reason="the e2b extra (pip install -e '.[e2b]')")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_held_sandbox_survives_a_server_restart(home, runc_ready, monkeypatch):
    from warmbox.engine.engine import Engine

    port = _free_port()
    args = ("--port", str(port))
    server = start_server(home, home / "e2b-restart.sock", args=args)
    _k, key = Engine.for_home(home).registry.tenants.create_key("e2b-restart")
    for name, value in {"E2B_API_URL": server.url, "E2B_SANDBOX_URL": server.url, "E2B_API_KEY": key}.items():
        monkeypatch.setenv(name, value)
    sb = e2b.Sandbox.create(timeout=120)
    try:
        sb.files.write("/workspace/r.txt", "before")
        assert server.stop() == 0
        server = start_server(home, home / "e2b-restart.sock", args=args)
        assert sb.files.read("/workspace/r.txt") == "before"  # the same token, a new server
        assert sb.commands.run("echo after").stdout == "after\n"
        assert len(bytes.fromhex(Engine.for_home(home).registry.meta.meta_text("signing_key"))) == 32
    finally:
        sb.kill()
        server.stop()
