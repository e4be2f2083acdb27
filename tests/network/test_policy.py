"""Policy decisions, the DNS codec and the proxy's parsers, without any sandbox or packet."""

from __future__ import annotations

import ssl

import pytest

from warmbox import InvalidArgument, Network, Secret
from warmbox.network import dns
from warmbox.network.policy import Policy, is_blocked, normalize_host
from warmbox.network.proxy import BadRequest, parse_sni, split_head, split_hostport


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
    ):
        with pytest.raises(dns.DnsFormatError):
            dns.parse_query(junk)
    with pytest.raises(dns.DnsFormatError):
        dns.parse_answer(resp, 1, dns.A)  # not the response to our query


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


def test_request_head_parsing_is_strict():
    head = split_head(b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test\r\n\r\n")
    assert head[:3] == ("CONNECT", "a.test:443", "HTTP/1.1")
    for bad in (
        b"GET\r\n\r\n",
        b"GET / HTTP/2\r\n\r\n",
        b"GET / HTTP/1.1\r\nNoColon\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
    ):
        with pytest.raises(BadRequest):
            split_head(bad)
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
