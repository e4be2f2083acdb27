"""Robustness: the egress proxy is SIGKILLed (the OOM killer, an operator, a crash) (issue 13).

Egress used to die silently: the sandbox lost its allowed destinations and ``network.update()``
still returned as if something enforced the new policy. Now a supervisor restarts the proxy
with the live sandboxes' policies (and their secrets), an update made while nothing serves
restarts it or raises :class:`NetworkError`, and the audit log records the outage. Whatever
happens, deny-all holds: a denied host is never reached, not even while no proxy runs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.network.conftest import ATTACKER, net_home, world  # noqa: F401 - the fake internet fixtures
from warmbox import Network, NetworkError, Sandbox
from warmbox.engine import egress

pytestmark = pytest.mark.sandbox
CURL = "curl -sS -o /dev/null -w '%{http_code}' --max-time 3 "
RECOVER_S = 15.0  # a restarted proxy serves again within this


def code(sb, url: str, extra: str = "") -> str:
    r = sb.commands.run(["/bin/bash", "-c", f"{CURL}{extra} {url}"], timeout=30)
    return r.stdout.strip() or "000"


def assert_deny_all_holds(sb, world) -> None:
    """The denied host answers 403 (a proxy decided) or nothing (none runs): never its server."""
    assert code(sb, "http://attacker.example.com/x") in ("403", "000")
    assert code(sb, f"http://{ATTACKER}/x", "--noproxy '*'") == "000"  # no route around the proxy
    assert world.log("attacker") == []


def kill(pid: int) -> None:
    """SIGKILL ``pid`` and wait (bounded) until it is gone or a zombie."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z"):
                return
        except OSError:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} survived SIGKILL")


def recovered(sb, world, url: str = "http://allowed.test/hello.txt") -> bool:
    """Poll (bounded) until ``url`` works again, checking deny-all on every round."""
    deadline = time.monotonic() + RECOVER_S
    for _ in range(60):
        assert_deny_all_holds(sb, world)
        if code(sb, url) == "200":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return False


def test_killed_proxy_is_restarted_or_updates_fail_loudly(net_home, world):
    world.clear_logs()
    with Sandbox.create(tier="container", network=Network(allow=["allowed.test"]), timeout=180, home=net_home) as sb:
        assert code(sb, "http://allowed.test/hello.txt") == "200"
        pid = egress.proxy_pid(net_home)
        assert pid is not None
        kill(pid)
        if recovered(sb, world):
            assert egress.proxy_pid(net_home) not in (None, pid)
            sb.network.update(Network(allow=["api.test"]))  # the restarted proxy enforces updates
            assert code(sb, "http://api.test/hello.txt") == "200"
            assert code(sb, "http://allowed.test/hello.txt") == "403"
        else:
            with pytest.raises(NetworkError):
                sb.network.update(Network(allow=["api.test"]))
        assert_deny_all_holds(sb, world)
        log = sb.network.log()
        # the audit log runs on across the outage, which it records
        kinds = [(e.kind, e.rule) for e in log]
        assert ("http", "allow:allowed.test") in kinds and ("proxy", "proxy-restart") in kinds
        outage = next(e for e in log if e.kind == "proxy")
        assert outage.decision == "deny" and f"pid {pid}" in outage.detail and "signal 9" in outage.detail
        assert log.index(outage) < len(log) - 1  # attempts after the restart are audited too
    assert world.log("attacker") == []


def test_secrets_survive_a_proxy_restart(net_home, world):
    import json

    from warmbox import Secret

    world.clear_logs()
    value = "sk-REAL-" + os.urandom(8).hex()
    fetch = 'curl -sS --max-time 3 -H "Authorization: Bearer $WBT_KEY" https://api.test/headers'
    with Sandbox.create(
        tier="container",
        network=Network(allow=["api.test"]),
        secrets={"WBT_KEY": Secret(value, ["api.test"])},
        timeout=180,
        home=net_home,
    ) as sb:

        def sh(cmd):
            return sb.commands.run(["/bin/bash", "-c", cmd], timeout=30)

        assert json.loads(sh(fetch).stdout)["Authorization"] == f"Bearer {value}"
        kill(egress.proxy_pid(net_home))
        deadline = time.monotonic() + RECOVER_S
        for _ in range(60):
            r = sh(fetch)
            if r.exit_code == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        # the same CA (the one the sandbox trusts) and the same substitution, after the restart
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout)["Authorization"] == f"Bearer {value}"
        assert [rec["headers"].get("Authorization") for rec in world.log("allowed")] == [f"Bearer {value}"] * 2


def test_killed_supervisor_update_restarts_or_fails_loudly(net_home, world):
    world.clear_logs()
    with Sandbox.create(tier="container", network=Network(allow=["allowed.test"]), timeout=180, home=net_home) as sb:
        assert code(sb, "http://allowed.test/hello.txt") == "200"
        proxy, sup = egress.proxy_pid(net_home), egress.supervisor_pid(net_home)
        assert proxy is not None and sup is not None
        kill(sup)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proxy}").exists() and time.monotonic() < deadline:  # it dies with its supervisor
            time.sleep(0.02)
        assert not Path(f"/proc/{proxy}").exists()
        assert_deny_all_holds(sb, world)  # nothing runs: nothing is reachable
        assert code(sb, "http://allowed.test/hello.txt") == "000"
        try:
            sb.network.update(Network(allow=["allowed.test", "api.test"]))
        except NetworkError:
            assert sb.network.policy() == "allow allowed.test"  # not stored as if enforced
        else:  # it said ok: then something serves it, now
            assert egress.supervisor_pid(net_home) not in (None, sup)
            assert code(sb, "http://api.test/hello.txt") == "200"
            assert code(sb, "http://allowed.test/hello.txt") == "200"
            outage = [e for e in sb.network.log() if e.kind == "proxy"]
            assert [e.rule for e in outage] == ["proxy-restart"] and f"pid {sup}" in outage[0].detail
        assert_deny_all_holds(sb, world)


def test_proxy_that_cannot_restart_fails_updates_loudly(net_home, world):
    world.clear_logs()
    cfg = net_home / "warmbox.toml"
    good = cfg.read_text()
    with Sandbox.create(tier="container", network=Network(allow=["allowed.test"]), timeout=180, home=net_home) as sb:
        assert code(sb, "http://allowed.test/hello.txt") == "200"
        try:
            # a restarted proxy cannot get into its upstream namespace any more
            cfg.write_text(good.replace(f'upstream_netns = "{world.up}"', f'upstream_netns = "{world.up}-gone"'))
            kill(egress.proxy_pid(net_home))
            t0 = time.monotonic()
            with pytest.raises(NetworkError, match="egress proxy"):
                sb.network.update(Network(allow=["allowed.test", "api.test"]))
            assert time.monotonic() - t0 < 30
            assert sb.network.policy() == "allow allowed.test"
            assert_deny_all_holds(sb, world)
            # the update gave up on its own wait; the supervisor gives up after its backoffs (3.85 s
            # of them, more on a loaded host) and only then audits proxy-down
            wait_for(
                lambda: "proxy-down" in [e.rule for e in sb.network.log() if e.kind == "proxy"],
                60,
                "the supervisor to give up and audit proxy-down",
            )
        finally:
            cfg.write_text(good)
        sb.network.update(Network(allow=["allowed.test", "api.test"]))  # fixed: restarted, and ok is true
        assert code(sb, "http://api.test/hello.txt") == "200"
        assert_deny_all_holds(sb, world)
        outage = [e for e in sb.network.log() if e.kind == "proxy"]
        assert outage[0].rule == "proxy-restart" and outage[-1].rule == "proxy-restart"  # died ... back
        assert "was down; started again" in outage[-1].detail


def test_approvals_are_asked_again_after_a_restart(net_home, world):
    world.clear_logs()
    asked = []

    def hook(req):
        asked.append(req.host)
        return "allow_once" if req.host == "allowed.test" else "deny"

    with Sandbox.create(
        tier="container", network=Network(on_unknown="ask"), on_approval=hook, timeout=180, home=net_home
    ) as sb:
        assert code(sb, "http://allowed.test/hello.txt") == "200"
        kill(egress.proxy_pid(net_home))
        assert recovered(sb, world)  # the SDK subscribed to the new proxy: its hook answers again
        assert asked[0] == "allowed.test" and asked[-1] == "allowed.test" and asked.count("allowed.test") >= 2
        assert set(asked) <= {"allowed.test", "attacker.example.com"}
