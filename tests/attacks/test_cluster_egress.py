"""A sandbox on one cluster node attacks the cluster's other members through its egress (issue 20).

A cluster's nodes talk over a node network: each node's API (peer token), Ray's GCS and raylets,
PostgreSQL. When those hosts have public or global IPv6 addresses, nothing in ALWAYS_BLOCKED (private
ranges, loopback, ...) covers them, and the proxy only refused *its own* host's addresses: a
sandbox allowed "internet" reached every other node. The proxy now also refuses every member
the registry and ``[cluster]`` name (nodes' API hosts, the Ray head, the registry's host).

The "other node" is 203.0.113.66 in this session's fake world (tests/network/conftest.py):
never a real address.
"""

from __future__ import annotations

import pytest

from tests.network.conftest import ALLOWED, ATTACKER, a_net_home, world  # noqa: F401 - the fake internet
from warmbox import Sandbox
from warmbox.engine.engine import Engine
from warmbox.models import NodeInfo

pytestmark = pytest.mark.sandbox
CURL = "curl -sS -o /dev/null -w '%{http_code}' --max-time 5 "


def code(sb: Sandbox, url: str) -> str:
    r = sb.commands.run(["/bin/bash", "-c", CURL + url], timeout=30)
    return r.stdout.strip() or "000"


def test_a_sandbox_cannot_reach_another_cluster_node(world, runc_ready):  # noqa: F811 - fixture
    with a_net_home(world, f"wbt-ce{world.tag}", 5) as home:
        # another node of this cluster, as its row in the shared registry names it
        Engine.for_home(home).registry.nodes.join_node(
            NodeInfo("peer-node", address=f"http://{ATTACKER}:80", slots=4, tiers=("container",))
        )
        world.clear_logs()
        with Sandbox.create(tier="container", network="internet", timeout=120, home=home) as sb:
            assert code(sb, f"http://{ALLOWED}/hello.txt") == "200"  # internet is open: the control
            assert code(sb, f"http://{ATTACKER}/v1/sandboxes") == "403"  # by address
            assert code(sb, "http://attacker.example.com/v1/sandboxes") == "403"  # by a name for it
            assert code(sb, f"https://{ATTACKER}:443/") in ("403", "000")  # another port of the same host
            assert world.log("attacker") == []  # nothing ever reached the node
            denied = [e for e in sb.network.log() if e.host in (ATTACKER, "attacker.example.com")]
            assert denied and all(e.decision == "deny" for e in denied), denied
