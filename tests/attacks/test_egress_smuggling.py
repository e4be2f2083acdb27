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
from warmbox import Network, Sandbox, Secret
from warmbox.network import netns

pytestmark = pytest.mark.sandbox

CLIENT = r"""
import json, os, socket, ssl, sys
forms = json.loads(sys.argv[1])
gateway, port, tls = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "tls"
out = {}
for name, wire in forms.items():
    s = socket.create_connection((gateway, port), timeout=8)
    if tls:  # through a CONNECT the proxy intercepts (the sandbox holds a secret for the host)
        s.sendall(b"CONNECT allowed.test:8443 HTTP/1.1\r\nHost: allowed.test:8443\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        s = ssl.create_default_context().wrap_socket(s, server_hostname="allowed.test")
    s.sendall(wire.replace("{KEY}", os.environ.get("TOKEN", "")).encode("latin-1"))
    got, closed = b"", False
    try:
        while True:
            data = s.recv(65536)
            if not data:
                closed = True
                break
            got += data
    except (ConnectionResetError, ssl.SSLError):
        closed = True
    except OSError:
        pass
    s.close()
    out[name] = {"response": got.decode("latin-1"), "closed": closed}
print(json.dumps(out))
"""


def forms(token: str, start: str) -> dict[str, str]:
    """Each smuggling form, after the request line and Host of ``start``, carrying GET /smuggled-<token>."""
    smuggle = f"GET /smuggled-{token} HTTP/1.1\r\nHost: allowed.test\r\nX-Key: {{KEY}}\r\n\r\n"
    chunked = f"{len(smuggle):x}\r\n{smuggle}\r\n0\r\n\r\n"
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


def fronted(token: str) -> dict[str, str]:
    """Requests inside a tunnel to allowed.test:8443 that name another host (a CDN's address routes
    by Host: the other name would get the request, with the secret swapped in for allowed.test)."""
    ask = f"/fronted-{token} HTTP/1.1\r\nX-Key: {{KEY}}\r\n"
    return {
        "host-other": f"GET {ask}Host: other.example\r\n\r\n",
        "host-other-port": f"GET {ask}Host: allowed.test:9443\r\n\r\n",
        "host-two": f"GET {ask}Host: allowed.test:8443\r\nHost: other.example\r\n\r\n",
        "host-none": f"GET {ask}\r\n",
        "absolute-form": f"GET https://other.example{ask}Host: allowed.test:8443\r\n\r\n",
    }


def attack(sb, world, mode: str, start: str, extra: dict[str, str] | None = None) -> None:
    """A well-formed request reaches the lax server through the proxy; every smuggling form (and
    each of ``extra``) is the proxy's 400 and a close, audited, and the server reads nothing of it."""
    token = secrets.token_hex(6)
    attacks = forms(token, start) | (extra or {})
    sb.files.write("/tmp/smuggle.py", CLIENT)

    def send(wires: dict[str, str]) -> dict[str, dict]:
        argv = ["python3", "/tmp/smuggle.py", json.dumps(wires), netns.GATEWAY, str(netns.PROXY_PORT), mode]
        r = sb.commands.run(argv, timeout=300)
        assert r.exit_code == 0, r.stderr
        return json.loads(r.stdout)

    control = send({"control": start.replace("/up ", "/control ") + "X-Key: {KEY}\r\nContent-Length: 2\r\n\r\nhi"})
    assert control["control"]["response"].startswith("HTTP/1.1 200 OK"), control
    got = send(attacks)
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


@pytest.mark.parametrize("tier", ["container", "gvisor"])
def test_request_smuggling_through_the_proxy_is_refused(net_home, world, tier):
    world.clear_logs()
    with Sandbox.create(tier=tier, network=Network(allow=["allowed.test"]), timeout=300, home=net_home) as sb:
        attack(sb, world, "http", "POST http://allowed.test:8080/up HTTP/1.1\r\nHost: allowed.test:8080\r\n")


@pytest.mark.parametrize("tier", ["container", "gvisor"])
def test_request_smuggling_inside_an_intercepted_tunnel_is_refused(net_home, world, tier):
    """Where the proxy swaps a secret into the headers: a request it read as body but the server
    as a request (or the reverse) would carry the secret where the sandbox can read it back."""
    world.clear_logs()
    value = "sk-REAL-" + secrets.token_hex(8)
    net = Network(allow=["allowed.test"])
    secret = {"TOKEN": Secret(value, hosts=["allowed.test"])}
    with Sandbox.create(tier=tier, network=net, secrets=secret, timeout=300, home=net_home) as sb:
        token = secrets.token_hex(6)
        attack(sb, world, "tls", "POST /up HTTP/1.1\r\nHost: allowed.test:8443\r\n", fronted(token))
        assert value not in json.dumps([e.__dict__ for e in sb.network.log()])
        assert not [rec for rec in world.log("lax-raw") if token in rec["raw"] or value in rec["raw"]]


def test_a_plain_requests_host_is_the_urls(net_home, world):
    """Plain HTTP through the proxy: the upstream gets the Host of the URL the policy decided on,
    never the client's own (another name on the same address). The proxy is the same for every
    tier: one tier is enough."""
    world.clear_logs()
    token = secrets.token_hex(6)
    wire = f"GET http://allowed.test:8080/fronted-{token} HTTP/1.1\r\nHost: other.example\r\nConnection: close\r\n\r\n"
    with Sandbox.create(tier="container", network=Network(allow=["allowed.test"]), timeout=300, home=net_home) as sb:
        sb.files.write("/tmp/smuggle.py", CLIENT)
        argv = [
            "python3",
            "/tmp/smuggle.py",
            json.dumps({"fronted": wire}),
            netns.GATEWAY,
            str(netns.PROXY_PORT),
            "http",
        ]
        r = sb.commands.run(argv, timeout=120)
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout)["fronted"]["response"].startswith("HTTP/1.1 200 OK"), r.stdout
    time.sleep(1.0)  # the lax server logs a connection's bytes when it ends
    raw = [rec["raw"] for rec in world.log("lax-raw") if token in rec["raw"]]
    assert len(raw) == 1 and "\r\nHost: allowed.test:8080\r\n" in raw[0], raw
    assert "other.example" not in raw[0], raw
