"""A tenant's key cannot log the operator out of the console (through a real `warmbox serve`).

Red-team finding: the console keeps at most auth.MAX_SESSIONS sessions and dropped the oldest of
anyone's when full. Logging in needs only the key (and the login form's own CSRF pair, which a
script fetches once), so a tenant that logged in MAX_SESSIONS times ended the operator's session
(and every other tenant's). Sessions are now also bounded per key: a key's own oldest go first.
"""

from __future__ import annotations

import http.client
import re
import time
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import pytest

from tests.conftest import start_server
from warmbox.engine.engine import Engine
from warmbox.server.console import auth

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(120)]


def _login(conn: http.client.HTTPConnection, form_csrf: str, key: str) -> str:
    """POST the login form on a kept-alive connection; the session cookie it set."""
    body = urlencode({"csrf": form_csrf, "key": key})
    conn.request(
        "POST",
        "/ui/login",
        body=body,
        headers={"Content-Type": "application/x-www-form-urlencoded", "Cookie": f"{auth.LOGIN_COOKIE}={form_csrf}"},
    )
    r = conn.getresponse()
    r.read()
    assert r.status == 303, r.status
    [cookie] = [v for k, v in r.getheaders() if k.lower() == "set-cookie" and v.startswith(auth.COOKIE + "=")]
    return cookie.split(";")[0]


def _home_status(conn: http.client.HTTPConnection, cookie: str) -> int:
    conn.request("GET", "/ui/", headers={"Cookie": cookie})
    r = conn.getresponse()
    r.read()
    return r.status


def test_a_tenant_cannot_log_the_operator_out(home: Path, runc_ready: None):
    registry = Engine.for_home(home).registry
    stamp = time.time_ns() % 10**9
    _, tenant = registry.tenants.create_key(f"sess-evil{stamp}")
    _, admin = registry.tenants.create_key(f"sess-ops{stamp}", admin=True)
    srv = start_server(home, home / "sess.sock")
    u = urlsplit(srv.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("GET", "/ui/login")
        r = conn.getresponse()
        form_csrf = re.search(r'name="csrf" value="([^"]+)"', r.read().decode()).group(1)  # type: ignore[union-attr]
        operator = _login(conn, form_csrf, admin)
        assert _home_status(conn, operator) == 200
        for _ in range(auth.MAX_SESSIONS):  # the same form token serves every attempt
            mine = _login(conn, form_csrf, tenant)
        assert _home_status(conn, operator) == 200, "the operator's session was dropped"
        assert _home_status(conn, mine) == 200  # the tenant's newest session works
    finally:
        conn.close()
        srv.stop()
