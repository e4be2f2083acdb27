"""Egress approvals through the HTTP API: the proxy's questions reach a remote client's hook over
the server's NDJSON stream, its answers come back, and what it denies stays denied."""

from __future__ import annotations

import pytest

from tests.attacks.test_egress_proxy_death import assert_deny_all_holds, code
from tests.conftest import start_server
from tests.network.conftest import net_home, world  # noqa: F401 - the fake internet fixtures
from warmbox import Network, Sandbox

pytestmark = pytest.mark.sandbox


def test_approvals_over_http(net_home, world):
    from warmbox.engine.engine import Engine

    world.clear_logs()
    _, key = Engine.for_home(net_home).registry.tenants.create_key("approver")
    server = start_server(net_home, net_home / "api.sock")
    asked: list[str] = []

    def hook(req):
        asked.append(f"{req.host}:{req.port}:{req.kind}")
        return "allow_once" if req.host == "allowed.test" else "deny"

    try:
        with Sandbox.create(
            tier="container",
            network=Network(on_unknown="ask"),
            on_approval=hook,
            timeout=180,
            api_url=server.url,
            api_key=key,
        ) as sb:
            assert code(sb, "http://allowed.test/hello.txt") == "200"  # asked, allowed once
            assert code(sb, "http://api.test/hello.txt") == "403"  # asked, denied
            assert_deny_all_holds(sb, world)
            assert asked[:2] == ["allowed.test:80:http", "api.test:80:http"]
            # api.test and allowed.test are one fake server (its log is "allowed"): the Host tells them apart
            hosts = [rec["headers"].get("Host", "") for rec in world.log("allowed")]
            assert hosts == ["allowed.test"], hosts  # the denied name never reached it
            assert sb.network.policy().endswith("ask for others")
            kinds = {e.kind for e in sb.network.log()}
            assert kinds, "every attempt is in the audit log"
    finally:
        server.stop()
