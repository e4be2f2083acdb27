"""The little DNS warmbox needs, on dnspython: read one question, answer A/AAAA, ask an upstream over UDP.

A sandbox's query is hostile: it is parsed whole by dnspython (truncation, compression loops and
forward pointers, labels over 63 bytes, names over 255, counts that do not match the sections
are all its errors) and anything it refuses is a :class:`DnsFormatError`, never an exception of
dnspython's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import secrets
import socket
import struct
from collections.abc import Sequence

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rdataclass

A, AAAA, CNAME = 1, 28, 5
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
MAX_PACKET = 4096
MAX_ANSWERS = 64  # addresses taken from one upstream answer


class DnsFormatError(ValueError):
    """A packet that is not a well-formed DNS message (or not the one expected)."""


@dataclasses.dataclass(frozen=True)
class Question:
    txid: int
    name: str  # lower case, no trailing dot
    qtype: int
    rd: bool
    wire: bytes = dataclasses.field(default=b"", compare=False)  # the name as asked (dnspython's wire form)


def _text(name: dns.name.Name) -> str:
    """A name as text, lower case, without the final dot ("" for the root); bytes outside
    printable ASCII stay escaped (normalize_host refuses them)."""
    return "" if name == dns.name.root else name.to_text(omit_final_dot=True).lower()


def parse_query(buf: bytes) -> Question:
    """The one question of a standard query (DnsFormatError for anything else)."""
    if len(buf) > MAX_PACKET:
        raise DnsFormatError("packet too long")
    try:
        msg = dns.message.from_wire(buf)
    except (dns.exception.DNSException, ValueError, UnicodeError) as e:
        raise DnsFormatError(f"malformed query: {type(e).__name__}") from None
    if msg.flags & dns.flags.QR or msg.opcode() != dns.opcode.QUERY or len(msg.question) != 1:
        raise DnsFormatError("not a standard query with one question")
    q = msg.question[0]
    if q.rdclass != dns.rdataclass.IN:
        raise DnsFormatError("not class IN")
    return Question(msg.id, _text(q.name), int(q.rdtype), bool(msg.flags & dns.flags.RD), q.name.to_wire() or b"\0")


def format_error(buf: bytes) -> bytes | None:
    """The FORMERR answer to a malformed query whose header can be read (None: not even that, or
    not a query, which is dropped). It echoes the id and opcode only, no section."""
    if len(buf) < 12:
        return None
    txid, flags = struct.unpack("!2H", buf[:4])
    if flags & 0x8000:  # a response: never answered (no loops)
        return None
    return struct.pack("!6H", txid, 0x8000 | (flags & 0x7800) | (flags & 0x0100) | 0x0080 | FORMERR, 0, 0, 0, 0)


def _encode_name(name: str) -> bytes:
    out = bytearray()
    for label in name.split(".") if name else []:
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise ValueError(f"bad DNS label in {name!r}")
        out += bytes([len(raw)]) + raw
    return bytes(out) + b"\0"


def build_query(name: str, qtype: int, txid: int) -> bytes:
    """A recursive query for ``name`` (checked by the caller: normalize_host). Written with struct,
    as answers are (dnspython's renderer cost more than the rest of a lookup)."""
    return struct.pack("!6H", txid, 0x0100, 1, 0, 0, 0) + _encode_name(name) + struct.pack("!2H", qtype, 1)


def build_response(q: Question, rcode: int, addresses: Sequence[str] = (), ttl: int = 30) -> bytes:
    """An answer to ``q`` with A/AAAA records for ``addresses`` (those matching its type).

    Written with struct, not dnspython's renderer (15x its cost here, on every sandbox query):
    only the question is echoed, as dnspython read it, and every record points at it."""
    qname = q.wire or _encode_name(q.name)
    answers = bytearray()
    count = 0
    for a in addresses:
        ip = ipaddress.ip_address(a)
        if (ip.version == 4 and q.qtype == A) or (ip.version == 6 and q.qtype == AAAA):
            answers += b"\xc0\x0c" + struct.pack("!2HIH", q.qtype, 1, ttl, len(ip.packed)) + ip.packed
            count += 1
    flags = 0x8000 | (0x0100 if q.rd else 0) | 0x0080 | (rcode & 0xF)
    return struct.pack("!6H", q.txid, flags, 1, count, 0, 0) + qname + struct.pack("!2H", q.qtype, 1) + bytes(answers)


def _addresses(msg: dns.message.Message, qtype: int) -> list[str]:
    out: list[str] = []
    for rrset in msg.answer:
        if rrset.rdtype == qtype and rrset.rdclass == dns.rdataclass.IN and qtype in (A, AAAA):
            out += [str(ipaddress.ip_address(rd.address)) for rd in rrset]  # type: ignore[attr-defined]
    return out[:MAX_ANSWERS]


def _answer(buf: bytes, txid: int, name: str, qtype: int) -> dns.message.Message:
    """The upstream response ``buf``, read by dnspython, if it answers our query (same id, a
    response, our one question), else DnsFormatError."""
    try:
        msg = dns.message.from_wire(buf)
    except (dns.exception.DNSException, ValueError, UnicodeError) as e:
        raise DnsFormatError(f"malformed response: {type(e).__name__}") from None
    if msg.id != txid or not msg.flags & dns.flags.QR or len(msg.question) != 1:
        raise DnsFormatError("not the response to our query")
    q = msg.question[0]
    if q.rdtype != qtype or q.rdclass != dns.rdataclass.IN or _text(q.name) != name.lower():
        raise DnsFormatError("the response is to another question")
    return msg


def parse_answer(buf: bytes, txid: int, qtype: int, name: str | None = None) -> tuple[int, list[str]]:
    """(rcode, addresses of type ``qtype`` in the answer section) of an upstream response (to
    the question for ``name``, when given)."""
    if name is None:
        try:
            name = _text(dns.message.from_wire(buf, question_only=True).question[0].name)
        except (dns.exception.DNSException, ValueError, UnicodeError, IndexError) as e:
            raise DnsFormatError(f"malformed response: {type(e).__name__}") from None
    msg = _answer(buf, txid, name, qtype)
    return int(msg.rcode()), _addresses(msg, qtype)


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
    """Ask each upstream server in turn (one UDP query each, ``timeout`` seconds per server);
    a datagram that is not the answer to the query (spoofed, stray, malformed) is ignored.

    Returns (rcode, addresses); raises OSError/TimeoutError when no server answered.
    (The socket is asyncio's own: dnspython's asyncquery.udp cost twice as much per query here.)
    """
    loop = asyncio.get_running_loop()
    last: Exception = TimeoutError("no DNS server configured")
    for server in servers:
        txid = secrets.randbelow(65536)
        family = socket.AF_INET6 if ":" in server else socket.AF_INET
        transport, proto = await loop.create_datagram_endpoint(_Once, remote_addr=(server, 53), family=family)
        try:
            transport.sendto(build_query(name, qtype, txid))
            deadline = loop.time() + timeout
            while True:
                data = await asyncio.wait_for(asyncio.shield(proto.reply), max(0.01, deadline - loop.time()))
                try:
                    return parse_answer(data, txid, qtype, name)
                except DnsFormatError:
                    proto.reply = loop.create_future()  # spoofed, stray or malformed: keep waiting
        except (TimeoutError, OSError) as e:
            last = e
        finally:
            transport.close()
    raise last if isinstance(last, OSError) else TimeoutError(f"no answer for {name} from {servers}")
