"""A hostile server in the sandbox cannot break the preview route's response framing.

Red-team finding: the preview passed any status from 100 to 599 on with the body streamed after
it. A 1xx status (an interim answer: the client reads the next response after it) followed by
bytes, or a 204/304 with a body, made the API server write bytes a client does not take as that
response's body — on a kept-alive connection the sandbox's bytes stood where the next answer
goes — or fail with a traceback in its log. Now a status below 200 is a 502 and a 204/304 (or a
HEAD) gets no body.
"""

from __future__ import annotations

import pytest

from tests.attacks.conftest import http_server_source
from tests.conftest import start_server
from tests.server.test_api import UnixHTTPConnection
from warmbox import Sandbox, api

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(240)]

SERVER = http_server_source(
    r"""
FORGED = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nX-Forged: 1\r\n\r\nforged"
answers = {
    b"/interim": b"HTTP/1.0 100 Continue\r\n\r\n" + FORGED,
    b"/switch": b"HTTP/1.0 101 Switching Protocols\r\n\r\n" + FORGED,
    b"/nocontent": b"HTTP/1.0 204 No Content\r\n\r\n" + FORGED,
    b"/notmodified": b"HTTP/1.0 304 Not Modified\r\n\r\n" + FORGED,
}
"""
)


def test_a_hostile_server_cannot_put_its_bytes_where_the_next_response_goes(home, runc_ready):
    server = start_server(home, home / "preview-framing.sock", tcp=False)
    try:
        with Sandbox.create(tier="container", timeout=300, pool=False, api_url=server.unix_url) as sb:
            sb.files.write("/workspace/framing.py", SERVER)
            sb.commands.run("cd /workspace && (python3 framing.py >/tmp/f.log 2>&1 &)")
            sb.get_host(8000, check=True, timeout=20)
            base = f"{api.PREFIX}/sandboxes/{sb.sandbox_id}/ports/8000"

            for path, status in [("/interim", 502), ("/switch", 502), ("/nocontent", 204), ("/notmodified", 304)]:
                conn = UnixHTTPConnection(server.socket, 15)  # one kept-alive connection, two requests
                try:
                    conn.request("GET", base + path)
                    r = conn.getresponse()
                    body = r.read()
                    assert r.status == status and r.getheader("x-forged") is None, (path, r.status, body)
                    assert b"forged" not in body, (path, body)
                    conn.request("GET", base + "/ok")
                    r = conn.getresponse()
                    body = r.read()
                    assert (r.status, body, r.getheader("x-forged")) == (200, b"fine", None), (path, r.status, body)
                finally:
                    conn.close()
        assert "Traceback" not in server.output(), server.output()[-3000:]
    finally:
        assert server.stop() == 0, server.output()
