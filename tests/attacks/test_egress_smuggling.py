"""Attack: smuggle a second request past the egress proxy to the upstream it connects to.

A proxy and the server behind it that read one request's framing differently (a Content-Length
next to a Transfer-Encoding, two Content-Lengths, a header folded onto the next line, a bare LF,
a Transfer-Encoding other than chunked, a chunk size past 64 bits) disagree on where it ends: the
rest is a request the proxy never decided, audited or checked (to a shared CDN address, one for
another name). The proxy read heads by hand before; llhttp reads them now, strictly. The fake
world's lax server on allowed.test:8080 reads requests as such servers do (bare LF, obs-fold, first
Content-Length, no Transfer-Encoding) and logs every request line and byte it gets. Each form sent
from the sandbox must get the proxy's 400, its connection closed, and the server no request, nor
any byte, of the smuggled one.
"""

from __future__ import annotations

import json
import secrets
import time

import pytest

from tests.network.conftest import net_home, world  # noqa: F401 - the fake internet fixtures
from warmbox import Network, Sandbox
from warmbox.network import netns

pytestmark = pytest.mark.sandbox

CLIENT = r"""
import json, socket, sys
forms = json.loads(sys.argv[1])
out = {}
for name, wire in forms.items():
    s = socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=8)
    s.sendall(wire.encode("latin-1"))
    got, closed = b"", False
    try:
        while True:
            data = s.recv(65536)
            if not data:
                closed = True
                break
            got += data
    except ConnectionResetError:
        closed = True
    except OSError:
        pass
    s.close()
    out[name] = {"response": got.decode("latin-1"), "closed": closed}
print(json.dumps(out))
"""


def forms(token: str) -> dict[str, str]:
    """Each smuggling form, for the proxy (absolute-form), carrying GET /smuggled-<token>."""
    smuggle = f"GET /smuggled-{token} HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    chunked = f"{len(smuggle):x}\r\n{smuggle}\r\n0\r\n\r\n"
    start = "POST http://allowed.test:8080/up HTTP/1.1\r\nHost: allowed.test:8080\r\n"
    return {
        "cl-te": start + "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked,
        "te-cl": start + "Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n" + chunked,
        "obs-fold": start + "Transfer-Encoding: chunked\r\nContent-Length:\r\n 4\r\n\r\n" + chunked,
        "bare-lf": start + "Transfer-Encoding: chunked\r\nX-Pad: a\nContent-Length: 4\r\n\r\n" + chunked,
        "cl-cl": start + f"Content-Length: 4\r\nContent-Length: {4 + len(smuggle)}\r\n\r\nabcd" + smuggle,
        "te-gzip": start + "Transfer-Encoding: gzip, chunked\r\n\r\n" + chunked,
        "te-identity": start + "Transfer-Encoding: identity\r\nContent-Length: 4\r\n\r\nabcd" + smuggle,
        # 2**64 + 4: a parser that wraps at 64 bits reads 4 bytes of chunk and the smuggled request next
        "chunk-overflow": start + f"Transfer-Encoding: chunked\r\n\r\n1{4:016x}\r\nabcd\r\n{smuggle}0\r\n\r\n",
    }


@pytest.mark.parametrize("tier", ["container", "gvisor"])
def test_request_smuggling_through_the_proxy_is_refused(net_home, world, tier):
    world.clear_logs()
    token = secrets.token_hex(6)
    attacks = forms(token)
    control = "POST http://allowed.test:8080/control HTTP/1.1\r\nHost: allowed.test:8080\r\nContent-Length: 2\r\n\r\nhi"
    with Sandbox.create(tier, network=Network(allow=["allowed.test"]), timeout=300, home=net_home) as sb:
        sb.files.write("/tmp/smuggle.py", CLIENT)
        run = ["python3", "/tmp/smuggle.py", "", netns.GATEWAY, str(netns.PROXY_PORT)]
        # the path works: a well-formed request through the proxy reaches the lax server
        r = sb.commands.run([*run[:2], json.dumps({"control": control}), *run[3:]], timeout=60)
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout)["control"]["response"].startswith("HTTP/1.1 200 OK"), r.stdout
        r = sb.commands.run([*run[:2], json.dumps(attacks), *run[3:]], timeout=300)
        assert r.exit_code == 0, r.stderr
        got = json.loads(r.stdout)
        passed = {
            name: seen["response"].split("\r\n\r\n")[0]
            for name, seen in got.items()
            if not (seen["response"].startswith("HTTP/1.1 400 Bad Request\r\n") and seen["closed"])
            or "X-Warmbox-Egress: error" not in seen["response"].split("\r\n\r\n")[0]
        }
        assert not passed, f"not refused with the proxy's 400 and a close: {passed}"
        time.sleep(1.0)  # the lax server logs a connection's bytes when it ends (0.5 s after a close)
        lines = [rec["line"] for rec in world.log("lax")]
        assert lines == ["POST /control HTTP/1.1"], f"the upstream read these requests: {lines}"
        assert not [rec for rec in world.log("lax-raw") if token in rec["raw"]]
        # every attempt is audited
        refused = [e for e in sb.network.log() if e.rule == "bad-request" or "bad request" in e.detail]
        assert len(refused) == len(attacks), [(e.rule, e.detail) for e in sb.network.log()]
