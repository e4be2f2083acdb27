"""Attack: malformed DNS queries from a sandbox at the egress resolver.

The resolver's codec was hand-written; dnspython reads the queries now. Truncated packets,
compression pointers that loop or point at themselves, labels over 63 bytes, names over 255,
counts that promise records the packet lacks, trailing bytes: each gets FORMERR or is dropped
(never an answer: the old codec answered the last three), is audited, goes nowhere upstream,
and the resolver (the same proxy process, not a restarted one) answers the next good query.
"""

from __future__ import annotations

import json
import struct

import pytest

from tests.network.conftest import ALLOWED, net_home, world  # noqa: F401 - the fake internet fixtures
from warmbox import Network, Sandbox
from warmbox.engine import egress
from warmbox.network import netns

pytestmark = pytest.mark.sandbox


def header(qd: int = 1, an: int = 0, ar: int = 0) -> bytes:
    return struct.pack("!6H", 0x1234, 0x0100, qd, an, 0, ar)


QUESTION = b"\x07allowed\x04test\x00\x00\x01\x00\x01"
MALFORMED = {
    "short-header": b"\x12\x34\x01\x00\x00",
    "truncated-name": header() + b"\x07allowed\x04te",
    "truncated-question": header() + QUESTION[:-2],
    "compression-loop": header() + b"\xc0\x0e\xc0\x0c\x00\x01\x00\x01",
    "self-pointer": header() + b"\xc0\x0c\x00\x01\x00\x01",
    "oversize-label": header() + b"\x40" + b"a" * 64 + b"\x00\x00\x01\x00\x01",
    "reserved-label-type": header() + b"\x80abc\x00\x00\x01\x00\x01",
    "name-over-255": header() + (b"\x3f" + b"a" * 63) * 4 + b"\x00\x00\x01\x00\x01",
    "two-questions-one-sent": header(qd=2) + QUESTION,
    "no-question": header(qd=0),
    "answers-promised-none-sent": header(an=3) + QUESTION,
    "additional-promised-none-sent": header(ar=1) + QUESTION,
    "trailing-junk": header() + QUESTION + b"junk",
}

CLIENT = r"""
import json, socket, struct, sys
cases = {k: bytes.fromhex(v) for k, v in json.loads(sys.argv[1]).items()}
good = struct.pack("!6H", 0x4242, 0x0100, 1, 0, 0, 0) + b"\x07allowed\x04test\x00\x00\x01\x00\x01"
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((sys.argv[2], 53))
out = {}

def ask(packet, wait):
    s.sendall(packet)
    s.settimeout(wait)
    try:
        return s.recv(4096).hex()
    except (TimeoutError, socket.timeout):
        return None

for name, packet in cases.items():
    out[name] = {"reply": ask(packet, 1.5), "then": ask(good, 10)}
print(json.dumps(out))
"""


@pytest.mark.parametrize("tier", ["container", "gvisor"])
def test_malformed_queries_get_formerr_and_the_resolver_goes_on(net_home, world, tier):
    world.clear_logs()
    with Sandbox.create(tier=tier, network=Network(allow=["allowed.test"]), timeout=120, home=net_home) as sb:
        sb.files.write("/tmp/dnsprobe.py", CLIENT)
        pid = egress.proxy_pid(net_home)
        cases = json.dumps({k: v.hex() for k, v in MALFORMED.items()})
        r = sb.commands.run(["python3", "/tmp/dnsprobe.py", cases, netns.GATEWAY], timeout=300)
        assert r.exit_code == 0, r.stderr
        got = json.loads(r.stdout)
        answered, lost = {}, {}
        for name, seen in got.items():
            reply = bytes.fromhex(seen["reply"] or "")
            # FORMERR: a response (QR) with rcode 1 and the query's id; never an answer
            if reply and not (reply[:2] == b"\x12\x34" and reply[2] & 0x80 and reply[3] & 0xF == 1):
                answered[name] = seen["reply"]
            then = bytes.fromhex(seen["then"] or "")
            if not (then[:2] == b"\x42\x42" and then[3] & 0xF == 0 and bytes(map(int, ALLOWED.split("."))) in then):
                lost[name] = seen["then"]
        assert not answered, f"malformed queries answered: {answered}"
        assert not lost, f"the good query after these was not answered: {lost}"
        assert egress.proxy_pid(net_home) == pid  # the same resolver answered throughout
        assert {q["name"] for q in world.log("dns")} <= {"allowed.test"}
        malformed = [e for e in sb.network.log() if e.rule == "malformed-query"]
        assert len(malformed) == len(MALFORMED), [(e.rule, e.detail) for e in sb.network.log()]
