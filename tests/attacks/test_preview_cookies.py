"""A sandbox's preview cannot plant cookies on the API's origin, nor read the browser's.

Red-team finding (issue 16's notes): the preview route passed a sandbox server's ``Set-Cookie`` on
and forwarded the client's ``Cookie`` header in. Every sandbox's preview is served from the API's
one origin, so a cookie set by one sandbox's page (``Path=/``) went with every later request to
any other sandbox's preview — a tenant's server could collect what another tenant's app stored in
the browser. Now neither header crosses the preview in either direction.
"""

from __future__ import annotations

import pytest

from tests.conftest import start_server
from tests.server.test_api import UnixHTTPConnection
from warmbox import Sandbox, api

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(240)]

# answers every request with a Set-Cookie, and its own request head as the body
SERVER = r"""
import socket
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 8000))
srv.listen(16)
while True:
    c, _ = srv.accept()
    data = b""
    while b"\r\n\r\n" not in data:
        part = c.recv(65536)
        if not part:
            break
        data += part
    head = data.partition(b"\r\n\r\n")[0]
    try:
        c.sendall(b"HTTP/1.0 200 OK\r\nSet-Cookie: stolen=1; Path=/\r\nSet-Cookie: other=2\r\n"
                  b"X-Kept: yes\r\n\r\n" + head)
    except OSError:
        pass
    c.close()
"""


def test_preview_passes_no_cookie_either_way(home, runc_ready):
    server = start_server(home, home / "preview-cookies.sock", tcp=False)
    try:
        with Sandbox.create(tier="container", timeout=300, pool=False, api_url=server.unix_url) as sb:
            sb.files.write("/workspace/cookies.py", SERVER)
            sb.commands.run("cd /workspace && (python3 cookies.py >/tmp/c.log 2>&1 &)")
            sb.get_host(8000, check=True, timeout=20)
            conn = UnixHTTPConnection(server.socket, 15)
            try:
                conn.request(
                    "GET",
                    f"{api.PREFIX}/sandboxes/{sb.sandbox_id}/ports/8000/x",
                    headers={"Cookie": "session=another-apps-secret", "X-Test": "t"},
                )
                r = conn.getresponse()
                body = r.read()
            finally:
                conn.close()
            assert r.status == 200, body
            assert r.getheader("x-kept") == "yes"  # other headers still pass
            assert r.getheader("set-cookie") is None, r.getheaders()
            assert b"another-apps-secret" not in body and b"x-test: t" in body.lower(), body
    finally:
        assert server.stop() == 0, server.output()
