"""Attack: make the operator's browser run a sandbox's script through the console.

Everything a sandbox produces reaches the console: the command lines it was given, the host
names it asked the egress resolver for (a raw DNS query carries any bytes in a label, and the
resolver logs the refused name as the host), its metadata. A sandbox that plants
``"><img src=x onerror=...>`` or ``<script>`` there must show up as text: the pages are rendered
with autoescaping and served under a CSP without inline script. And a tenant key's console
session never sees another tenant's sandbox (the list leaves it out, its page is "not found").
Against a real ``warmbox serve`` over HTTP, with real sandboxes.
"""

from __future__ import annotations

import http.client
import re
import time
import urllib.parse

import pytest

from tests.conftest import start_server
from tests.network.conftest import net_home, world  # noqa: F401 - the fake internet fixtures
from warmbox import Network, Sandbox
from warmbox.engine.engine import Engine

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(240)]

IMG = '"><img src=x onerror=alert(1)>'
SCRIPT = "<script>alert(2)</script>"
# a raw DNS query from inside the sandbox, each hostile string one label (the resolver refuses
# the name and logs it, lower-cased, as the host it was asked for)
DNS = r"""
import socket, struct
ns = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]
for label in (IMG, SCRIPT):
    q = struct.pack("!6H", 0x4242, 0x0100, 1, 0, 0, 0) + bytes([len(label)]) + label.encode() + b"\x07example\x00"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    s.sendto(q + struct.pack("!2H", 1, 1), (ns, 53))
    try:
        s.recv(512)
    except OSError:
        pass
    s.close()
"""


class Browser:
    """A cookie-keeping HTTP client for the console (no redirects followed)."""

    def __init__(self, url: str) -> None:
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.origin = url
        self.cookies: dict[str, str] = {}

    def request(self, method: str, path: str, form: dict[str, str] | None = None) -> tuple[int, dict, str]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=20)
        headers = {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())}
        body = None
        if form is not None:
            body = urllib.parse.urlencode(form)
            headers.update({"Content-Type": "application/x-www-form-urlencoded", "Origin": self.origin})
        try:
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            text = r.read().decode()
            for name, value in r.getheaders():
                if name.lower() == "set-cookie":
                    k, _, v = value.split(";")[0].partition("=")
                    if v:
                        self.cookies[k] = v
                    else:
                        self.cookies.pop(k, None)
            return r.status, {k.lower(): v for k, v in r.getheaders()}, text
        finally:
            conn.close()

    def login(self, key: str) -> None:
        status, _, html = self.request("GET", "/ui/login")
        assert status == 200, html
        csrf = re.search(r'name="csrf" value="([^"]+)"', html).group(1)
        status, headers, html = self.request("POST", "/ui/login", {"csrf": csrf, "key": key})
        assert status == 303 and headers["location"] == "/ui/", (status, html)


def test_sandbox_output_is_escaped_and_other_tenants_are_invisible(net_home, world):  # noqa: F811
    engine = Engine.for_home(net_home)
    _, acme = engine.registry.tenants.create_key("xss-acme")
    _, globex = engine.registry.tenants.create_key("xss-globex")
    server = start_server(net_home, net_home / "console-xss.sock")
    try:
        kw = {"timeout": 120, "pool": False, "api_url": server.url}
        net = Network(allow=["allowed.test"])
        with (
            Sandbox.create(tier="container", network=net, metadata={"note": IMG}, api_key=acme, **kw) as sb,
            Sandbox.create(tier="container", api_key=globex, **kw) as other,
        ):
            sb.files.write("/tmp/dns.py", f"IMG = {IMG!r}\nSCRIPT = {SCRIPT!r}\n" + DNS)
            assert sb.commands.run("python3 /tmp/dns.py", timeout=30).exit_code == 0
            sb.commands.run(["echo", IMG, SCRIPT])

            b = Browser(server.url)
            b.login(acme)
            page = f"/ui/sandboxes/{sb.sandbox_id}"
            deadline = time.monotonic() + 15  # the resolver's audit rows and command records land asynchronously
            while True:
                status, headers, html = b.request("GET", page)
                assert status == 200, html
                hosts = re.findall(r'<tr class="net-deny" data-decision="deny" data-host="([^"]*)"', html)
                if (len(hosts) >= 2 and "onerror" in html.split('id="commands"')[-1]) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            # the resolver's log reached the page: the names as dnspython writes them (presentation
            # format: a space is \032, a paren \( ...), and HTML-escaped on it
            assert "onerror=alert\\(1\\)&gt;" in " ".join(hosts), hosts
            assert "&lt;script&gt;alert\\(2\\)&lt;/script&gt;" in " ".join(hosts), hosts
            for path in (page, f"/ui/frag/sandboxes/{sb.sandbox_id}", "/ui/", "/ui/frag/sandboxes"):
                status, headers, html = b.request("GET", path)
                assert status == 200, (path, html)
                assert "<img" not in html and "<script>alert" not in html and "onerror=alert(1)>" not in html, path
                assert "script-src 'self'" in headers["content-security-policy"], headers
                assert "unsafe-inline" not in headers["content-security-policy"]
            status, _, html = b.request("GET", page)
            assert html.count("&lt;img src=x onerror=alert(1)&gt;") >= 2  # metadata, command (the log: above)
            assert "&lt;script&gt;alert(2)&lt;/script&gt;" in html.split('id="commands"')[1]

            # the other tenant's sandbox: not in acme's list, and its page is "not found"
            for path in ("/ui/", "/ui/frag/sandboxes", "/ui/?ended=1&tenant=xss-globex"):
                status, _, html = b.request("GET", path)
                assert status == 200 and sb.sandbox_id in html and other.sandbox_id not in html, path
            for path in (f"/ui/sandboxes/{other.sandbox_id}", f"/ui/frag/sandboxes/{other.sandbox_id}"):
                status, _, html = b.request("GET", path)
                assert status == 404 and "xss-globex" not in html, (path, status)
            g = Browser(server.url)
            g.login(globex)
            status, _, html = g.request("GET", "/ui/")
            assert other.sandbox_id in html and sb.sandbox_id not in html
    finally:
        assert server.stop() == 0, server.output()
