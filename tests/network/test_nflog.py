"""The NFLOG reader's parsing and the proxy's bounds on refused packets, fed kernel-format messages
(the real egress path: tests/attacks/test_egress_audit.py)."""

from __future__ import annotations

import ipaddress
import os
import random
import socket
import struct

import pytest

from warmbox import config
from warmbox.models import Limits, State
from warmbox.network import netns, nflog
from warmbox.network.policy import Policy
from warmbox.network.proxy import REFUSED_KEYS, REFUSED_READS, REFUSED_ROWS, Proxy


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n % 4)


def message(src: str, dst: str, proto: int, l4: bytes, prefix: str = nflog.PREFIX) -> bytes:
    """One NFULNL_MSG_PACKET as the kernel sends it (packet header, prefix, payload)."""
    ip = bytes([0x45, 0]) + struct.pack(">H", 20 + len(l4)) + b"\0" * 5 + bytes([proto]) + b"\0\0"
    ip += ipaddress.IPv4Address(src).packed + ipaddress.IPv4Address(dst).packed
    body = struct.pack("=BBH", socket.AF_INET, 0, socket.htons(nflog.GROUP))
    body += _attr(1, struct.pack(">HBB", 0x0800, 0, 0)) + _attr(10, prefix.encode() + b"\0") + _attr(9, ip + l4)
    return struct.pack("=IHHII", 16 + len(body), 4 << 8, 0, 0, 0) + body


def tcp(src: str, dst: str, port: int) -> bytes:
    return message(src, dst, 6, struct.pack(">HH", 40000, port) + b"\0" * 16)


def test_parse_tcp_udp_icmp_and_skip_others():
    data = (
        tcp("10.239.0.16", "203.0.113.66", 443)
        + message("10.239.0.16", "203.0.113.66", 17, struct.pack(">HHHH", 5353, 53, 8, 0))
        + message("10.239.0.17", "10.239.0.1", 1, bytes([8, 0, 0, 0]))
        + message("10.239.0.16", "203.0.113.1", 6, b"\0" * 20, prefix="someone-else")
    )
    assert nflog.parse(data) == [
        nflog.Refused("10.239.0.16", "203.0.113.66", "tcp", 443),
        nflog.Refused("10.239.0.16", "203.0.113.66", "udp", 53),
        nflog.Refused("10.239.0.17", "10.239.0.1", "icmp", 8),
    ]


def test_parse_never_raises_on_truncated_or_garbage_input():
    rng = random.Random(18)
    good = tcp("10.239.0.16", "203.0.113.66", 443)
    for n in range(len(good)):
        nflog.parse(good[:n])
    for _ in range(2000):
        blob = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        nflog.parse(bytes(blob))
        nflog.parse(os.urandom(rng.randint(0, 200)))


@pytest.fixture
def proxy(tmp_path):
    p = Proxy(tmp_path, config.load(tmp_path))
    sid = "sb-0000000000aa"
    p.registry.sandboxes.allocate(sid, "container", "base", 300.0, Limits(), "/nonexistent", "/nonexistent")
    p.registry.sandboxes.set_state(sid, State.READY, "up")
    p.registry.egress.set_link(sid, "10.239.0.16", "wbs0", Policy("allowlist").to_json())
    yield p, sid
    p.registry.sandboxes.set_state(sid, State.DESTROYED, "test over")
    p.registry.close()


def test_refused_packets_are_held_and_written_within_their_bounds(proxy):
    p, sid = proxy
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    theirs.setblocking(False)
    mine.settimeout(5)  # a test bug, not a hang
    assert REFUSED_READS > 32
    try:
        rows = 0
        for round_ in range(4):  # a flood of distinct destinations, flushed once a round
            for i in range(3 * REFUSED_KEYS):
                mine.send(tcp("10.239.0.16", f"203.0.113.{i % 256}", 1 + round_ * 5000 + i))
                if i % 32 == 31:  # the socket's queue is small: read as the event loop would
                    p.read_refused(theirs)
            p.read_refused(theirs)
            assert len(p.refused) <= REFUSED_KEYS  # held between flushes: bounded
            p.flush_refused()
            got = [e for e in p.registry.egress.net_events(sid) if e.rule == "raw-ip"]
            assert len(got) - rows <= REFUSED_KEYS
            rows = len(got)
        assert rows == REFUSED_ROWS  # itemised up to the bound...
        (bound,) = [e for e in p.registry.egress.net_events(sid) if e.rule == "audit-bound"]
        total = 4 * 3 * REFUSED_KEYS - REFUSED_ROWS
        assert bound.decision == "deny" and bound.detail.startswith(f"{total} more packets")  # ...then counted
        # a packet from an address no sandbox holds is not audited against anyone
        mine.send(tcp("10.239.0.99", netns.GATEWAY, 22))
        p.read_refused(theirs)
        p.flush_refused()
        assert len(p.registry.egress.net_events(sid)) == REFUSED_ROWS + 1
    finally:
        mine.close()
        theirs.close()
