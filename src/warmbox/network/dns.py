"""The little DNS warmbox needs: parse one question, answer A/AAAA, query an upstream over UDP.

Everything from the network is bounded and parsed defensively: a malformed packet raises
:class:`DnsFormatError`, never an IndexError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import secrets
import struct
from collections.abc import Sequence

A, AAAA, CNAME = 1, 28, 5
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
MAX_PACKET = 4096


class DnsFormatError(ValueError):
    """A packet that is not a well-formed DNS message."""


@dataclasses.dataclass(frozen=True)
class Question:
    txid: int
    name: str  # lower case, no trailing dot
    qtype: int
    rd: bool


def _read_name(buf: bytes, off: int, depth: int = 0) -> tuple[str, int]:
    labels: list[str] = []
    end = None
    for _ in range(128):
        if off >= len(buf):
            raise DnsFormatError("name runs past the packet")
        n = buf[off]
        if n & 0xC0 == 0xC0:
            if off + 1 >= len(buf) or depth > 8:
                raise DnsFormatError("bad compression pointer")
            ptr = ((n & 0x3F) << 8) | buf[off + 1]
            if ptr >= off:
                raise DnsFormatError("forward compression pointer")
            rest, _ = _read_name(buf, ptr, depth + 1)
            if rest:
                labels.append(rest)
            return ".".join(labels), off + 2
        if n & 0xC0:
            raise DnsFormatError("bad label type")
        off += 1
        if n == 0:
            end = off
            break
        label = buf[off : off + n]
        if len(label) != n:
            raise DnsFormatError("label runs past the packet")
        labels.append(label.decode("ascii", "replace").lower())
        off += n
    if end is None:
        raise DnsFormatError("too many labels")
    name = ".".join(labels)
    if len(name) > 253:
        raise DnsFormatError("name too long")
    return name, end


def _encode_name(name: str) -> bytes:
    out = bytearray()
    for label in name.split(".") if name else []:
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise ValueError(f"bad DNS label in {name!r}")
        out += bytes([len(raw)]) + raw
    return bytes(out) + b"\0"


def parse_query(buf: bytes) -> Question:
    if len(buf) < 12 or len(buf) > MAX_PACKET:
        raise DnsFormatError("packet too short or too long")
    txid, flags, qd, _an, _ns, _ar = struct.unpack("!6H", buf[:12])
    if flags & 0x8000 or (flags >> 11) & 0xF != 0 or qd != 1:
        raise DnsFormatError("not a standard query with one question")
    name, off = _read_name(buf, 12)
    if off + 4 > len(buf):
        raise DnsFormatError("question truncated")
    qtype, qclass = struct.unpack("!2H", buf[off : off + 4])
    if qclass != 1:
        raise DnsFormatError("not class IN")
    return Question(txid, name, qtype, bool(flags & 0x0100))


def build_query(name: str, qtype: int, txid: int) -> bytes:
    return struct.pack("!6H", txid, 0x0100, 1, 0, 0, 0) + _encode_name(name) + struct.pack("!2H", qtype, 1)


def build_response(q: Question, rcode: int, addresses: Sequence[str] = (), ttl: int = 30) -> bytes:
    """An answer to ``q`` with A/AAAA records for ``addresses`` (those matching its type)."""
    answers = bytearray()
    count = 0
    for a in addresses:
        ip = ipaddress.ip_address(a)
        if (ip.version == 4 and q.qtype == A) or (ip.version == 6 and q.qtype == AAAA):
            answers += b"\xc0\x0c" + struct.pack("!2HIH", q.qtype, 1, ttl, len(ip.packed)) + ip.packed
            count += 1
    flags = 0x8000 | (0x0100 if q.rd else 0) | 0x0080 | (rcode & 0xF)
    head = struct.pack("!6H", q.txid, flags, 1, count, 0, 0)
    return head + _encode_name(q.name) + struct.pack("!2H", q.qtype, 1) + bytes(answers)


def parse_answer(buf: bytes, txid: int, qtype: int) -> tuple[int, list[str]]:
    """(rcode, addresses of type ``qtype`` in the answer section) of an upstream response."""
    if len(buf) < 12:
        raise DnsFormatError("response too short")
    rid, flags, qd, an, _ns, _ar = struct.unpack("!6H", buf[:12])
    if rid != txid or not flags & 0x8000:
        raise DnsFormatError("not the response to our query")
    off = 12
    for _ in range(qd):
        _, off = _read_name(buf, off)
        off += 4
    out = []
    for _ in range(min(an, 64)):
        _, off = _read_name(buf, off)
        if off + 10 > len(buf):
            raise DnsFormatError("record truncated")
        rtype, _cls, _ttl, rdlen = struct.unpack("!2HIH", buf[off : off + 10])
        off += 10
        data = buf[off : off + rdlen]
        if len(data) != rdlen:
            raise DnsFormatError("record data truncated")
        off += rdlen
        if rtype == qtype == A and rdlen == 4:
            out.append(str(ipaddress.IPv4Address(data)))
        elif rtype == qtype == AAAA and rdlen == 16:
            out.append(str(ipaddress.IPv6Address(data)))
    return flags & 0xF, out


class _Once(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.reply: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: object) -> None:
        if not self.reply.done():
            self.reply.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.reply.done():
            self.reply.set_exception(exc)


async def query(servers: list[str], name: str, qtype: int, timeout: float = 2.0) -> tuple[int, list[str]]:
    """Ask each upstream server in turn (one UDP query each, ``timeout`` seconds per server).

    Returns (rcode, addresses); raises OSError/TimeoutError when no server answered.
    """
    loop = asyncio.get_running_loop()
    last: Exception = TimeoutError("no DNS server configured")
    for server in servers:
        txid = secrets.randbelow(65536)
        family = 10 if ":" in server else 2
        transport, proto = await loop.create_datagram_endpoint(_Once, remote_addr=(server, 53), family=family)
        try:
            transport.sendto(build_query(name, qtype, txid))
            deadline = loop.time() + timeout
            while True:
                data = await asyncio.wait_for(asyncio.shield(proto.reply), max(0.01, deadline - loop.time()))
                try:
                    return parse_answer(data, txid, qtype)
                except DnsFormatError:
                    proto.reply = loop.create_future()  # spoofed or stray: keep waiting
        except (TimeoutError, OSError) as e:
            last = e
        finally:
            transport.close()
    raise last if isinstance(last, OSError) else TimeoutError(f"no answer for {name} from {servers}")
