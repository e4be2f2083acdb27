"""Policy decisions, the DNS codec and the proxy's parsers, without any sandbox or packet."""

from __future__ import annotations

import asyncio
import ssl
import struct

import pytest

from warmbox import InvalidArgument, Network, Secret
from warmbox.network import dns
from warmbox.network.http1 import MAX_HEAD, Request, RequestReader
from warmbox.network.policy import Policy, is_blocked, normalize_host
from warmbox.network.proxy import BadRequest, parse_sni, split_hostport


@pytest.mark.parametrize(
    "addr",
    [
        "169.254.169.254",
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "::1",
        "fe80::1",
        "fd00::1",
        "::ffff:169.254.169.254",
        "::ffff:10.0.0.1",
        "not-an-ip",
    ],
)
def test_blocked_addresses(addr):
    assert is_blocked(addr)


@pytest.mark.parametrize("addr", ["198.51.100.10", "203.0.113.66", "8.8.8.8", "2606:4700::1111"])
def test_public_addresses_not_blocked(addr):
    assert not is_blocked(addr)


def test_decisions_allow_deny_wildcards_cidr_and_ask():
    pol = Policy.of(
        Network(allow=["PyPI.org.", "*.githubusercontent.com", "203.0.113.0/24"], deny=["evil.githubusercontent.com"])
    )
    assert pol.decide_name("pypi.org") == ("allow", "allow:pypi.org")
    assert pol.decide_name("raw.githubusercontent.com") == ("allow", "allow:*.githubusercontent.com")
    assert pol.decide_name("githubusercontent.com") == ("deny", "default-deny")  # wildcard = subdomains only
    assert pol.decide_name("evil.githubusercontent.com") == ("deny", "deny:evil.githubusercontent.com")
    # a CIDR rule decides IP literals; it never makes an unknown name worth resolving (issue 13)
    assert pol.decide_name("notpypi.org") == ("deny", "default-deny")
    assert pol.decide_name("203.0.113.9") == ("allow", "allow:203.0.113.0/24")
    assert pol.decide_name("198.51.100.1") == ("deny", "default-deny")
    assert Policy.of("none").decide_name("pypi.org") == ("deny", "policy:none")
    assert Policy.of("internet").decide_name("anything.example") == ("allow", "internet")
    ask = Policy.of(Network(allow=["a.test"], on_unknown="ask"))
    assert ask.decide_name("b.test") == ("ask", "")
    assert ask.with_allowed("b.test").decide_name("b.test") == ("allow", "allow:b.test")
    cidr_ask = Policy.of(Network(allow=["203.0.113.0/24"], on_unknown="ask"))
    assert cidr_ask.decide_name("x.test") == ("ask", "") and cidr_ask.decide_name("203.0.113.1")[0] == "allow"
    assert cidr_ask.decide_name("198.51.100.1") == ("ask", "")
    assert Policy.from_json(pol.to_json()) == pol


def test_deny_cidr_refuses_addresses_of_allowed_names_and_literals():
    pol = Policy.of(Network(allow=["a.test", "*.b.test", "198.51.100.0/24"], deny=["198.51.100.128/25", "192.0.2.7"]))
    assert pol.decide_name("a.test") == ("allow", "allow:a.test")  # by name; its addresses checked next
    assert pol.denies_address("198.51.100.200") == "deny:198.51.100.128/25"
    assert pol.denies_address("192.0.2.7") == "deny:192.0.2.7"
    assert pol.denies_address("198.51.100.1") == "" and pol.denies_address("203.0.113.1") == ""
    assert pol.decide_name("198.51.100.200") == ("deny", "deny:198.51.100.128/25")  # deny wins for literals
    assert pol.decide_name("198.51.100.1") == ("allow", "allow:198.51.100.0/24")
    assert pol.decide_name("192.0.2.7") == ("deny", "deny:192.0.2.7")
    assert pol.decide_name("x.b.test")[0] == "allow" and pol.decide_name("198.51.100.1.b.test")[0] == "allow"
    assert Policy.of("internet").denies_address("198.51.100.1") == ""


@pytest.mark.parametrize(
    "bad",
    [
        {"allow": "pypi.org"},
        {"allow": ["a b"]},
        {"allow": ["*evil.com"]},
        {"allow": ["1.2.3.0/99"]},
        {"deny": [""]},
        {"on_unknown": "maybe"},
    ],
)
def test_bad_policies_are_typed_errors(bad):
    with pytest.raises(InvalidArgument):
        Network(**bad)
    with pytest.raises(InvalidArgument):
        Policy.of("everything")


def test_secret_validation_and_repr_hides_value():
    s = Secret("sk-123", hosts=["api.openai.com", "*.example.com"])
    assert "sk-123" not in repr(s) and s.applies_to("api.openai.com") and s.applies_to("x.example.com")
    assert not s.applies_to("api.openai.com.evil.test")
    for bad in (
        {"value": "", "hosts": ["a.test"]},
        {"value": "a\nb", "hosts": ["a.test"]},
        {"value": "v", "hosts": []},
        {"value": "v", "hosts": ["10.0.0.0/8"]},
        {"value": "v", "hosts": "a.test"},
    ):
        with pytest.raises(InvalidArgument):
            Secret(**bad)


def _dns_header(qd: int = 1, an: int = 0, ar: int = 0, flags: int = 0x0100) -> bytes:
    return struct.pack("!6H", 0x1234, flags, qd, an, 0, ar)


# malformed queries (tests/attacks/test_egress_dns_malformed.py sends them from a sandbox)
MALFORMED_DNS = {
    "truncated": _dns_header() + b"\x07allowed\x04te",
    "no-question": _dns_header() + b"\x07allowed\x04test\x00\x00\x01",
    "compression-loop": _dns_header() + b"\xc0\x0e\xc0\x0c\x00\x01\x00\x01",
    "self-pointer": _dns_header() + b"\xc0\x0c\x00\x01\x00\x01",
    "oversize-label": _dns_header() + b"\x40" + b"a" * 64 + b"\x00\x00\x01\x00\x01",
    "long-name": _dns_header()
    + b"\x3f"
    + b"a" * 63
    + b"\x3f"
    + b"b" * 63
    + b"\x3f"
    + b"c" * 63
    + b"\x3f"
    + b"d" * 63
    + b"\x00\x00\x01\x00\x01",
    "two-questions-one-sent": _dns_header(qd=2) + b"\x07allowed\x04test\x00\x00\x01\x00\x01",
    "answer-count-no-answer": _dns_header(an=3) + b"\x07allowed\x04test\x00\x00\x01\x00\x01",
    "trailing-junk": _dns_header() + b"\x07allowed\x04test\x00\x00\x01\x00\x01" + b"junk",
}


def test_dns_round_trip_and_malformed_input():
    q = dns.parse_query(dns.build_query("Allowed.Test", dns.A, 4242))
    assert (q.txid, q.name, q.qtype) == (4242, "allowed.test", dns.A)
    resp = dns.build_response(q, dns.NOERROR, ["198.51.100.10", "2001:db8::1"])
    assert dns.parse_answer(resp, 4242, dns.A) == (0, ["198.51.100.10"])
    assert dns.parse_answer(dns.build_response(q, dns.NXDOMAIN), 4242, dns.A) == (3, [])
    for junk in (
        b"",
        b"\x00" * 11,
        b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xc0\x0c\x00\x01\x00\x01",
        b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x3fabc",
        *MALFORMED_DNS.values(),
    ):
        with pytest.raises(dns.DnsFormatError):
            dns.parse_query(junk)
    with pytest.raises(dns.DnsFormatError):
        dns.parse_answer(resp, 1, dns.A)  # not the response to our query


# the request smuggling forms (tests/attacks/test_egress_smuggling.py sends them from a sandbox)
SMUGGLE = "GET /smuggled HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
SMUGGLING = {
    "cl-te": f"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
    f"{len(SMUGGLE):x}\r\n{SMUGGLE}\r\n0\r\n\r\n",
    "te-cl": f"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n"
    f"{len(SMUGGLE):x}\r\n{SMUGGLE}\r\n0\r\n\r\n",
    "obs-fold": f"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\r\n chunked\r\nContent-Length: 4\r\n\r\n"
    f"{len(SMUGGLE):x}\r\n{SMUGGLE}\r\n0\r\n\r\n",
    "bare-lf": f"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nX-Pad: a\nContent-Length: 4\r\n\r\n"
    f"{len(SMUGGLE):x}\r\n{SMUGGLE}\r\n0\r\n\r\n",
    "cl-cl": f"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nContent-Length: {4 + len(SMUGGLE)}\r\n\r\n"
    f"abcd{SMUGGLE}",
    "te-gzip": f"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
    f"{len(SMUGGLE):x}\r\n{SMUGGLE}\r\n0\r\n\r\n",
    "chunk-overflow": "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    f"1{0:016x}\r\n{SMUGGLE}\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("form", sorted(SMUGGLING))
def test_request_smuggling_forms_are_bad_requests(form):
    for chunks in (1, 7):
        with pytest.raises(BadRequest):
            read_requests(SMUGGLING[form].encode(), chunks)


def test_bodies_reach_upstream_in_the_proxys_own_framing():
    wire = (
        b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc"
        b"POST /b HTTP/1.1\r\nHost: a\r\ntransfer-encoding: Chunked\r\n\r\n"
        b"2;ext=x\r\nde\r\n1\r\nf\r\n0\r\nX-T: 1\r\nHost: b\r\n\r\n"
        b"GET /c HTTP/1.0\r\n\r\n"
    )
    for chunks in (1, 5, len(wire)):
        (a, body_a), (b, body_b), (c, body_c) = read_requests(wire, chunks)
        assert (a.target, a.length, a.chunked, body_a) == ("/a", 3, False, b"abc")
        assert (
            a.encode_head("POST /a HTTP/1.1", a.headers) == b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\n"
        )
        assert (b.target, b.length, b.chunked, body_b) == (
            "/b",
            None,
            True,
            b"2\r\nde\r\n1\r\nf\r\n0\r\nX-T: 1\r\n\r\n",
        )
        assert b.encode_head("POST /b HTTP/1.1", b.headers).endswith(b"Host: a\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert (c.target, c.version, c.length, body_c) == ("/c", "HTTP/1.0", None, b"")


def test_sni_parse_from_a_real_client_hello():
    ctx = ssl.create_default_context()
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname="api.test")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    assert parse_sni(out.read()) == "api.test"
    with pytest.raises(BadRequest):
        parse_sni(b"\x16\x03\x01\x00")
    with pytest.raises(BadRequest):
        parse_sni(b"GET / HTTP/1.1\r\n")


def read_requests(wire: bytes, chunks: int = 1) -> list[tuple[Request, bytes]]:
    """Every request (head, body as the upstream gets it) llhttp reads from ``wire``, fed to it in
    ``chunks`` pieces; the first BadRequest is raised."""

    async def run() -> list[tuple[Request, bytes]]:
        reader = asyncio.StreamReader()
        step = max(1, len(wire) // chunks)
        for i in range(0, len(wire), step):
            reader.feed_data(wire[i : i + step])
        reader.feed_eof()
        rr, out = RequestReader(reader), []
        while (req := await rr.head(5)) is not None:
            out.append((req, b"".join([piece async for piece in rr.body(req)])))
            if req.upgrade:
                break
        return out

    return asyncio.run(run())


def test_request_head_parsing_is_strict():
    [(head, body)] = read_requests(b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test\r\n\r\n")
    assert (head.method, head.target, head.version, head.upgrade, body) == (
        "CONNECT",
        "a.test:443",
        "HTTP/1.1",
        True,
        b"",
    )
    for bad in (
        b"GET\r\n\r\n",
        b"GET / HTTP/2\r\n\r\n",
        b"GET / HTTP/1.1\r\nNoColon\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD + b"\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a",  # the client left mid-head
    ):
        with pytest.raises(BadRequest):
            read_requests(bad, chunks=3)
    assert split_hostport("[2001:db8::1]:8443", 443) == ("2001:db8::1", 8443)
    assert split_hostport("a.test", 443) == ("a.test", 443)
    for bad in ("a.test:0", "a.test:99999", "a.test:x"):
        with pytest.raises(BadRequest):
            split_hostport(bad, 443)


@pytest.mark.parametrize("host", ["2606:4700::1%<img src=x onerror=alert(1)>", "[2001:db8::1%eth0]", "fe80::1%25lo"])
def test_ipv6_zone_ids_are_refused(host):
    # a zone id is free text: it must not reach the audit log or the operator's approval queue
    with pytest.raises(InvalidArgument):
        normalize_host(host)
    assert normalize_host("[2606:4700::1]") == "2606:4700::1"


def test_presets_stand_for_their_hosts_and_warmbox_toml_adds_its_own(tmp_path):
    from warmbox import config
    from warmbox.errors import ConfigError
    from warmbox.network.policy import PRESETS, refusal

    p = Policy.of(Network(allow=["pypi", "example.org"], deny=["github"]))
    assert p.allow == ("pypi.org", "files.pythonhosted.org", "example.org")
    assert p.deny == PRESETS["github"]
    (tmp_path / "warmbox.toml").write_text(
        '[network]\npip_index_url = "http://mirror.example/simple"\n'
        '[network.presets]\npypi = ["mirror.example"]\ninternal = ["git.corp.example"]\n'
    )
    net = config.load(tmp_path).network
    p = Policy.of(Network(allow=["pypi", "internal"]), net.preset_map(), net.mirror_hosts())
    assert p.allow == ("mirror.example", "git.corp.example")
    assert net.mirror_env() == {"PIP_INDEX_URL": "http://mirror.example/simple", "PIP_TRUSTED_HOST": "mirror.example"}
    assert Policy.of("internet", net.preset_map(), net.mirror_hosts()).allow == ()
    for bad, why in (
        ('extra_ca = "/nonexistent.pem"', "cannot be read"),
        (f'extra_ca = "{tmp_path / "warmbox.toml"}"', "not a bundle of PEM certificates"),
        ('pip_index_url = "ftp://x.example/"', "http"),
        ('npm_registry = "https://u:p@x.example/"', "no credentials"),
        ("presets = { x = [] }", "non-empty list"),
        ('presets = { x = ["not a host"] }', "not a valid host name"),
    ):
        (tmp_path / "warmbox.toml").write_text(f"[network]\n{bad}\n")
        with pytest.raises(ConfigError, match=why):
            config.load(tmp_path)
    # the refusal is one line of printable ASCII naming the host, the rule and the fix
    line = refusal("files.pythonhosted.org", 443, "default-deny")
    assert line.isascii() and line.isprintable() and "--allow pypi" in line
    assert "deny rule *.example.com" in refusal("a.example.com", 80, "deny:*.example.com")
