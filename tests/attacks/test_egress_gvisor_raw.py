"""Attack: root in a gVisor sandbox with a network link sends hand-made packets past the proxy.

gVisor's netstack gives root (``user="root"``) raw IP sockets (and packet sockets, which this
runsc cannot write yet) on the sandbox's eth0, so root can put hand-made packets on the link: a
DNS query straight to the upstream resolver, and queries from a neighbour's address (spoofed).
The egress namespace's rules accept from a link only its own address, to the proxy and resolver
ports; nothing is forwarded. The fake world's resolver logs every query it receives: none of
these may reach it, and the spoofed ones must not reach warmbox's resolver either (they would be
answered and audited as the neighbour's). A control query from the link's own address to
warmbox's resolver shows the packets do get out (without the source check the test fails).
"""

from __future__ import annotations

import secrets
import time

import pytest

from tests.network.conftest import net_home, world  # noqa: F401 - the fake internet fixtures
from warmbox import Network, Sandbox
from warmbox.engine.engine import Engine
from warmbox.network import netns

pytestmark = pytest.mark.sandbox
UPSTREAM = "192.0.2.2"  # the fake world's resolver (the proxy's upstream_dns)

SEND = r"""
import socket, struct, sys
own, neighbour, gateway, upstream, token = sys.argv[1:6]

def csum(b):
    b += b"\0" * (len(b) % 2)
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xFFFF)
    return ~(s + (s >> 16)) & 0xFFFF

def query(name):
    q = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack("!6H", 0x1234, 0x0100, 1, 0, 0, 0) + q + struct.pack("!2H", 1, 1)

def packet(src, dst, name):
    data = query(name)
    udp = struct.pack("!4H", 40000, 53, 8 + len(data), 0) + data
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!2BH", 0, 17, len(udp))
    udp = udp[:6] + struct.pack("!H", csum(pseudo + udp) or 0xFFFF) + udp[8:]
    ip = struct.pack("!2B3H2BH4s4s", 0x45, 0, 20 + len(udp), 0x4242, 0, 64, 17, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    return ip[:10] + struct.pack("!H", csum(ip)) + ip[12:] + udp

def send(label, kind, src, dst):
    data = packet(src, dst, f"{label}-{token}.example")
    try:
        if kind == "raw":  # IP header included: the source is the sender's choice
            socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW).sendto(data, (dst, 0))
        else:  # a whole frame on eth0 (broadcast: no ARP needed)
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
            eth = b"\xff" * 6 + b"\x02\x00\x00\x00\x00\x01" + b"\x08\x00"
            s.sendto(eth + data, ("eth0", 0x0800, 0, 1, b"\xff" * 6))
        print(label, "sent")
    except OSError as e:  # e.g. no route inside, or a socket kind this runsc cannot write
        print(label, "refused", e.errno)

for kind in ("raw", "frame"):
    for _ in range(2):
        send(f"{kind}ctl", kind, own, gateway)
        send(f"{kind}spoof", kind, neighbour, gateway)
        send(f"{kind}direct", kind, own, upstream)
        send(f"{kind}spoofdirect", kind, neighbour, upstream)
print("done")
"""


def test_root_in_gvisor_cannot_get_raw_or_spoofed_packets_past_the_egress_rules(net_home, world):
    world.clear_logs()
    token = secrets.token_hex(6)
    engine = Engine.for_home(net_home)
    net = Network(allow=["allowed.test"])
    with (
        Sandbox.create(tier="container", template="shell", network=net, timeout=120, home=net_home) as neighbour,
        Sandbox.create(tier="gvisor", template="shell", network=net, timeout=120, home=net_home) as sb,
    ):
        own = engine.registry.egress.link(sb.sandbox_id)[0]
        theirs = engine.registry.egress.link(neighbour.sandbox_id)[0]
        r = sb.commands.run(
            ["python3", "-c", SEND, own, theirs, netns.GATEWAY, UPSTREAM, token], user="root", timeout=60
        )
        assert r.exit_code == 0 and r.stdout.endswith("done\n"), (r.stdout, r.stderr)
        deadline = time.monotonic() + 5
        mine = set()
        while time.monotonic() < deadline and f"rawctl-{token}.example" not in mine:
            time.sleep(0.2)
            mine = {e.host for e in sb.network.log() if e.kind == "dns"}
        # the control: a raw packet from the link's own address reaches warmbox's resolver (denied)
        assert "rawctl sent" in r.stdout and f"rawctl-{token}.example" in mine, (r.stdout, mine)
        # nothing reached the fake world's resolver: not the direct queries, not the denied control
        assert not [q["name"] for q in world.log("dns") if token in q["name"]]
        # the spoofed queries never reached warmbox's resolver, as either sandbox
        heard = mine | {e.host for e in neighbour.network.log()}
        assert not {h for h in heard if token in h and "ctl-" not in h}, (r.stdout, heard)
