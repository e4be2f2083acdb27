"""Packets the egress rules refused, read from nftables' ``log group`` over NFLOG netlink (stdlib only).

The egress namespace's rules (:mod:`warmbox.network.netns`) log every packet a sandbox sends
that is not to the proxy or resolver (a raw IP, another port of the gateway, ICMP, UDP) before
they refuse it, limited per sandbox address in the kernel (``update @lograte { ip saddr limit
rate ... }``) and cut to its first :data:`SNAPLEN` bytes. Only packets whose source address
matches their veth (the ``peers`` set) are logged, so the address names the sandbox.

:class:`Reader` parses them into :class:`Refused` records; the proxy aggregates and audits them
(bounded: see ``Proxy.refused``). Everything here reads kernel messages, never guest data
beyond the packet headers, and every length is checked.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import struct

NETLINK_NETFILTER = 12
GROUP = 7  # the nftables ``log group`` of the egress rules
SNAPLEN = 64  # bytes of each refused packet copied to the reader: IP + TCP/UDP/ICMP headers
RCVBUF = 256 << 10  # the kernel's queue for this socket; a flood beyond it is dropped (ENOBUFS)
PREFIX = "wb-refused"

_NFNL_SUBSYS_ULOG = 4
_NFULNL_MSG_PACKET = 0
_NFULNL_MSG_CONFIG = 1
_NFULA_CFG_CMD = 1
_NFULA_CFG_MODE = 2
_NFULNL_CFG_CMD_BIND = 1
_NFULNL_COPY_PACKET = 2
_NFULA_PAYLOAD = 9
_NFULA_PREFIX = 10
_NLM_F_REQUEST = 1
_NLM_F_ACK = 4
_NLMSG_ERROR = 2
_NLA_TYPE_MASK = 0x3FFF


@dataclasses.dataclass(frozen=True)
class Refused:
    """One refused packet: its source (the sandbox's address), destination, protocol and port
    (TCP/UDP destination port; ICMP: its type)."""

    source: str
    destination: str
    protocol: str  # "tcp" | "udp" | "icmp" | "ip<number>"
    port: int


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n % 4)


def _config(group: int, attrs: bytes, seq: int) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(group)) + attrs
    kind = (_NFNL_SUBSYS_ULOG << 8) | _NFULNL_MSG_CONFIG
    return struct.pack("=IHHII", 16 + len(body), kind, _NLM_F_REQUEST | _NLM_F_ACK, seq, 0) + body


def open_socket(group: int = GROUP) -> socket.socket:
    """A netlink socket bound to NFLOG ``group`` of the calling thread's network namespace
    (the caller enters the egress namespace first). Raises OSError if the kernel refuses."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        s.bind((0, 0))
        s.settimeout(2.0)
        mode = struct.pack(">IBB", SNAPLEN, _NFULNL_COPY_PACKET, 0) + b"\0\0"
        for seq, attrs in enumerate(
            (_attr(_NFULA_CFG_CMD, bytes([_NFULNL_CFG_CMD_BIND])), _attr(_NFULA_CFG_MODE, mode)), 1
        ):
            s.send(_config(group, attrs, seq))
            _ack(s.recv(4096), seq)
        s.setblocking(False)
        return s
    except BaseException:
        s.close()
        raise


def _ack(data: bytes, seq: int) -> None:
    if len(data) < 20:
        raise OSError("NFLOG: short netlink answer")
    _, kind, _, got, _ = struct.unpack_from("=IHHII", data)
    if kind != _NLMSG_ERROR or got != seq:
        raise OSError(f"NFLOG: unexpected netlink answer (type {kind})")
    (err,) = struct.unpack_from("=i", data, 16)
    if err != 0:
        raise OSError(-err, f"NFLOG config refused: errno {-err}")


def parse(data: bytes) -> list[Refused]:
    """The refused packets in one netlink datagram (messages of other kinds are skipped)."""
    out: list[Refused] = []
    off = 0
    while off + 16 <= len(data):
        length, kind, _, _, _ = struct.unpack_from("=IHHII", data, off)
        if length < 16 or off + length > len(data):
            break
        if kind == (_NFNL_SUBSYS_ULOG << 8) | _NFULNL_MSG_PACKET and length >= 20:
            got = _packet(data[off + 20 : off + length])
            if got is not None:
                out.append(got)
        off += (length + 3) & ~3
    return out


def _packet(attrs: bytes) -> Refused | None:
    payload = b""
    prefix = b""
    off = 0
    while off + 4 <= len(attrs):
        n, kind = struct.unpack_from("=HH", attrs, off)
        if n < 4 or off + n > len(attrs):
            break
        kind &= _NLA_TYPE_MASK
        if kind == _NFULA_PAYLOAD:
            payload = attrs[off + 4 : off + n]
        elif kind == _NFULA_PREFIX:
            prefix = attrs[off + 4 : off + n].rstrip(b"\0")
        off += (n + 3) & ~3
    if prefix != PREFIX.encode() or len(payload) < 20 or payload[0] >> 4 != 4:
        return None
    ihl = (payload[0] & 0x0F) * 4
    proto = payload[9]
    src = str(ipaddress.IPv4Address(payload[12:16]))
    dst = str(ipaddress.IPv4Address(payload[16:20]))
    port = 0
    name = {6: "tcp", 17: "udp", 1: "icmp"}.get(proto, f"ip{proto}")
    if proto in (6, 17) and len(payload) >= ihl + 4:
        port = int.from_bytes(payload[ihl + 2 : ihl + 4], "big")
    elif proto == 1 and len(payload) > ihl:
        port = payload[ihl]
    return Refused(src, dst, name, port)
