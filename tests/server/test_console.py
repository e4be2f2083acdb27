"""The console in process (Starlette's test client, a temp registry, no sandbox): sessions, the
login cookie, CSRF and origin checks, security headers, tenant scoping and escaped rendering."""

from __future__ import annotations

import json
import re
import time

import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

from warmbox.config import ServerSettings
from warmbox.engine import meters
from warmbox.engine.engine import Engine
from warmbox.engine.start import StartRecord
from warmbox.models import CommandRecord, Limits, NetEvent, State, Tenant
from warmbox.server.app import PEER_UID, build_app
from warmbox.server.console import auth, web

BASE = "http://127.0.0.1:7420"
HOSTILE = '"><img src=x onerror=alert(1)><script>alert(2)</script>'


@pytest.fixture
def engine(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMBOX_RUNTIME_DIR", str(tmp_path / "rt"))
    e = Engine.for_home(tmp_path / "home")
    made: list[str] = []
    e.made = made  # type: ignore[attr-defined]
    yield e
    for sid in made:  # registry rows hold host-wide uid slots until destroyed
        e.registry.sandboxes.set_state(sid, State.DESTROYED, "test over")


def _app(engine):
    return build_app(engine, ServerSettings(), mcp=False)


@pytest.fixture
def client(engine):
    with TestClient(_app(engine), base_url=BASE) as c:
        yield c


def _sandbox(engine, sid: str, tenant: str | None, **meta: str) -> str:
    t = None if tenant is None else engine.registry.tenants.tenant(tenant)
    rec = StartRecord("container", "base", 300.0, Limits(), tenant=t, metadata=meta)
    engine.registry.sandboxes.allocate(
        sid, "container", "base", 300.0, Limits(), "/nonexistent", "/nonexistent", tenant=t, start=rec
    )
    engine.made.append(sid)
    engine.registry.sandboxes.set_state(sid, State.READY, "up")
    return sid


def _login(c: TestClient, key: str):
    r = c.get("/ui/login")
    assert r.status_code == 200, r.text
    token = re.search(r'name="csrf" value="([^"]+)"', r.text).group(1)
    return c.post("/ui/login", data={"csrf": token, "key": key}, follow_redirects=False)


def _csrf(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


# ---- sessions (pure)


def test_sessions_keep_only_a_digest_and_end():
    now = [1000.0]
    s = auth.Sessions(ttl_s=60, limit=3, clock=lambda: now[0])
    token, session = s.open("key-a")
    assert s.get(token) == session and session.expires_at == 1060
    assert token not in repr(s._by_digest) and session.csrf != token  # the table holds no cookie value
    assert s.get(token + "x") is None and s.get("") is None and s.get(None) is None and s.get("a" * 500) is None
    now[0] = 1060.0
    assert s.get(token) is None and len(s) == 0  # expired: gone
    t1, _ = s.open("key-a")
    t2, _ = s.open("key-b")
    assert s.close(t1) and not s.close(t1) and s.get(t2) is not None
    for _ in range(5):
        s.open("key-c")
    assert len(s) == 3 and s.get(t2) is None  # bounded: the oldest went
    assert s.close_key("key-c") == 3 and len(s) == 0


def test_csrf_tokens_compare_strictly():
    assert auth.same_token("abc", "abc")
    assert not auth.same_token("abd", "abc") and not auth.same_token("", "") and not auth.same_token(None, "abc")
    p = auth.PeerTokens()
    assert p.token("uid:0") == p.token("uid:0") != p.token("uid:1") != auth.PeerTokens().token("uid:1")


# ---- login, cookie, logout


def test_pages_need_a_login(client, engine):
    r = client.get("/", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/"
    for path in ("/ui/", "/ui/sandboxes/sb-0123456789ab"):
        r = client.get(path, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/ui/login", path
    r = client.get("/ui/frag/sandboxes")
    assert r.status_code == 401
    # a key is not a session cookie, and a made-up cookie is nothing
    _, key = engine.registry.tenants.create_key("acme")
    client.cookies.set("warmbox_console", key)
    assert client.get("/ui/", follow_redirects=False).status_code == 303


def test_login_sets_an_opaque_strict_httponly_cookie(client, engine):
    _, key = engine.registry.tenants.create_key("acme")
    r = _login(client, key)
    assert r.status_code == 303 and r.headers["location"] == "/ui/"
    cookie = next(c for c in r.headers.get_list("set-cookie") if c.startswith("warmbox_console="))
    value = cookie.split(";")[0].split("=", 1)[1]
    assert key not in cookie and len(value) >= 40
    attrs = {a.strip().split("=")[0].lower(): a for a in cookie.split(";")[1:]}
    assert "httponly" in attrs and attrs["samesite"].strip() == "SameSite=Strict"
    assert attrs["path"].strip() == "Path=/ui" and "secure" not in attrs and "domain" not in attrs
    r = client.get("/ui/")
    assert r.status_code == 200 and 'data-viewer="acme"' in r.text


def test_login_over_tls_sets_a_secure_prefixed_cookie(engine):
    _, key = engine.registry.tenants.create_key("acme")
    with TestClient(_app(engine), base_url="https://console.example") as c:
        r = _login(c, key)
        assert r.status_code == 303
        cookie = next(x for x in r.headers.get_list("set-cookie") if x.startswith("__Secure-warmbox_console="))
        assert "; Secure" in cookie and "HttpOnly" in cookie
        assert c.get("/ui/").status_code == 200


def test_a_wrong_key_or_a_forged_login_form_is_refused(client, engine):
    r = _login(client, "wbx_not-a-key")
    assert r.status_code == 401 and 'id="login-error"' in r.text and "warmbox_console=" not in str(r.headers)
    _, key = engine.registry.tenants.create_key("acme")
    client.cookies.clear()
    r = client.post("/ui/login", data={"csrf": "guess", "key": key}, follow_redirects=False)
    assert r.status_code == 403 and not any(c.startswith("warmbox_console=") for c in r.headers.get_list("set-cookie"))
    r = client.post("/ui/login", data={"key": key}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403


def test_logout_needs_the_csrf_token_and_ends_the_session(client, engine):
    _, key = engine.registry.tenants.create_key("acme")
    _login(client, key)
    csrf = _csrf(client.get("/ui/").text)
    assert client.post("/ui/logout", data={"x": "1"}, follow_redirects=False).status_code == 403
    assert client.post("/ui/logout", data={"csrf": csrf + "x"}, follow_redirects=False).status_code == 403
    r = client.post("/ui/logout", data={"csrf": csrf}, headers={"Origin": "null"}, follow_redirects=False)
    assert r.status_code == 403  # an opaque origin (a sandbox preview) cannot post
    r = client.post("/ui/logout", data={"csrf": csrf}, headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403
    assert client.get("/ui/", follow_redirects=False).status_code == 200  # none of those logged out
    r = client.post("/ui/logout", data={"csrf": csrf}, headers={"Origin": BASE}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    old = client.cookies.get("warmbox_console")
    assert not old  # cleared
    assert client.get("/ui/", follow_redirects=False).status_code == 303


def test_a_revoked_key_ends_its_sessions(client, engine):
    key_id, key = engine.registry.tenants.create_key("acme")
    _login(client, key)
    assert client.get("/ui/", follow_redirects=False).status_code == 200
    engine.registry.tenants.revoke_key(key_id)
    assert client.get("/ui/", follow_redirects=False).status_code == 303
    assert client.get("/ui/frag/sandboxes").status_code == 401


def test_console_responses_carry_the_security_headers(client, engine):
    _, key = engine.registry.tenants.create_key("acme")
    for r in (client.get("/ui/login"), _login(client, key), client.get("/ui/"), client.get("/ui/frag/sandboxes")):
        assert r.headers["content-security-policy"] == web.CSP
        assert "'unsafe-inline'" not in web.CSP and "frame-ancestors 'none'" in web.CSP
        assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store"
        assert r.headers["x-content-type-options"] == "nosniff"
    r = client.get("/ui/static/console.js")
    assert r.status_code == 200 and r.headers["x-content-type-options"] == "nosniff"
    html = client.get("/ui/").text
    assert "<script>" not in html and not re.search(r"<script(?![^>]*\bsrc=)", html)  # no inline script
    assert not re.search(r"\son[a-z]+=", html) and " style=" not in html


def test_the_api_does_not_take_the_console_cookie(client, engine):
    _, key = engine.registry.tenants.create_key("acme")
    _login(client, key)
    r = client.get("/v1/sandboxes")  # the cookie is scoped to /ui; even if sent, /v1 wants a key
    assert r.status_code == 401
    token = client.cookies.get("warmbox_console")
    r = client.get("/v1/sandboxes", headers={"Cookie": f"warmbox_console={token}"})
    assert r.status_code == 401
    # nor does a sandbox's port preview (the only /v1 route serving sandbox content to a browser)
    r = client.get("/v1/sandboxes/sb-0123456789ab/ports/8000/", headers={"Cookie": f"warmbox_console={token}"})
    assert r.status_code == 401


# ---- who sees what


def test_a_tenant_sees_only_its_sandboxes_and_an_admin_sees_all(engine):
    _, acme = engine.registry.tenants.create_key("acme")
    _, other = engine.registry.tenants.create_key("globex")
    _, admin = engine.registry.tenants.create_key("ops", admin=True)
    mine = _sandbox(engine, "sb-00000000a001", "acme")
    theirs = _sandbox(engine, "sb-00000000b001", "globex")
    with TestClient(_app(engine), base_url=BASE) as c:
        _login(c, acme)
        page = c.get("/ui/").text + c.get("/ui/frag/sandboxes").text
        assert mine in page and theirs not in page and 'data-tenant="globex"' not in page
        r = c.get(f"/ui/sandboxes/{theirs}")
        assert r.status_code == 404 and theirs in r.text and "globex" not in r.text
        r = c.get(f"/ui/frag/sandboxes/{theirs}")
        assert r.status_code == 404
        r = c.get("/ui/?tenant=globex")  # a tenant key's filter is its own tenant, whatever it asks
        assert theirs not in r.text and mine in r.text
        assert c.get(f"/ui/sandboxes/{mine}").status_code == 200
    with TestClient(_app(engine), base_url=BASE) as c:
        _login(c, other)
        assert mine not in c.get("/ui/frag/sandboxes").text
    with TestClient(_app(engine), base_url=BASE) as c:
        _login(c, admin)
        rows = c.get("/ui/frag/sandboxes").text
        assert mine in rows and theirs in rows and ">globex<" in rows
        rows = c.get("/ui/frag/sandboxes?tenant=acme").text
        assert mine in rows and theirs not in rows
        r = c.get(f"/ui/sandboxes/{theirs}")
        assert r.status_code == 200 and 'data-field="tenant">globex<' in r.text


def test_root_on_the_unix_socket_needs_no_login(engine):
    sid = _sandbox(engine, "sb-00000000c001", None)
    app = _app(engine)

    async def as_uid(scope, receive, send, uid=0):
        if scope["type"] == "http":
            scope = {**scope, PEER_UID: uid}
        await app(scope, receive, send)

    with TestClient(as_uid, base_url="http://localhost") as c:
        r = c.get("/ui/", follow_redirects=False)
        assert r.status_code == 200 and sid in r.text and 'data-viewer="root"' in r.text
        assert 'id="logout"' not in r.text
        assert c.get("/ui/login", follow_redirects=False).status_code == 303  # nothing to log in to

    async def as_stranger(scope, receive, send):
        await as_uid(scope, receive, send, uid=4242)

    with TestClient(as_stranger, base_url="http://localhost") as c:
        r = c.get("/ui/", follow_redirects=False)
        assert r.status_code == 401 and sid not in r.text


# ---- escaping


def test_what_a_sandbox_produced_is_rendered_escaped(engine):
    _, key = engine.registry.tenants.create_key("acme")
    sid = _sandbox(engine, "sb-00000000d001", "acme", note=HOSTILE, **{HOSTILE[:20]: "k"})
    engine.registry.egress.add_net_event(
        NetEvent(sid, 1.0, "http", HOSTILE, "", 80, "deny", "default-deny", detail=HOSTILE)
    )
    engine.registry.egress.add_net_event(
        NetEvent(sid, 2.0, "connect", "pypi.org", "1.2.3.4", 443, "allow", "allow:pypi.org")
    )
    with TestClient(_app(engine), base_url=BASE) as c:
        _login(c, key)
        for path in (f"/ui/sandboxes/{sid}", f"/ui/frag/sandboxes/{sid}"):
            r = c.get(path)
            assert r.status_code == 200
            assert "<img" not in r.text and "<script>alert" not in r.text and "onerror=alert(1)>" not in r.text
            assert "&lt;img src=x onerror=alert(1)&gt;" in r.text  # shown, as text
        live = c.get(f"/ui/frag/sandboxes/{sid}").text
        assert 'data-decision="deny"' in live and 'class="net-deny"' in live and 'data-count="1"' in live


def test_viewer_query_keeps_only_an_admins_filter(engine):
    front = object()
    admin = web.Viewer(tenant=None, admin=True, front=front, actor=front, scope="a&b", csrf="x")  # type: ignore[arg-type]
    assert admin.query == "?tenant=a%26b" and admin.with_query(ended=True) == "?tenant=a%26b&ended=1"
    plain = web.Viewer(tenant=Tenant("acme"), admin=False, front=front, actor=front, scope="acme", csrf="x")  # type: ignore[arg-type]
    assert plain.query == "" and plain.with_query(ended=False) == ""


def _command(sid: str, text: str, **outcome) -> CommandRecord:
    fields = {"timed_out": False, "truncated": False, "oom_killed": False, "error": "", "exit_code": 0}
    fields.update(outcome)
    return CommandRecord(
        sandbox_id=sid, seq=0, kind="command", text=text, text_truncated=False, language="", started_at=1.0,
        duration_ms=12.5, stdout_bytes=3, stderr_bytes=0, **fields,
    )  # fmt: skip


def test_commands_show_their_outcomes_escaped(engine):
    _, key = engine.registry.tenants.create_key("acme")
    sid = _sandbox(engine, "sb-00000000e001", "acme")
    engine.registry.commands.add_commands(
        [
            _command(sid, f"echo {HOSTILE}"),
            _command(sid, "sleep 99", timed_out=True, exit_code=None, error="SandboxTimeout"),
            _command(sid, "python3 big.py", truncated=True),
            _command(sid, "python3 hog.py", oom_killed=True, exit_code=137),
        ]
    )
    with TestClient(_app(engine), base_url=BASE) as c:
        _login(c, key)
        html = c.get(f"/ui/sandboxes/{sid}").text
        part = html.split('id="commands"')[1].split("</table>")[0]
        assert "<img" not in part and "&lt;img src=x onerror=alert(1)&gt;" in part
        rows = re.findall(
            r'<tr data-seq="(\d)"[^>]*data-timed-out="(\d)" data-truncated="(\d)" data-oom-killed="(\d)"', part
        )
        assert rows == [("4", "0", "0", "1"), ("3", "0", "1", "0"), ("2", "1", "0", "0"), ("1", "0", "0", "0")]
        for flag in ("flag-timed_out", "flag-truncated", "flag-oom_killed"):
            assert flag in part


def test_export_is_a_csrf_checked_download_of_the_viewers_sandboxes(engine):
    _, key = engine.registry.tenants.create_key("acme")
    engine.registry.tenants.create_key("globex")
    sid = _sandbox(engine, "sb-00000000f001", "acme")
    theirs = _sandbox(engine, "sb-00000000f002", "globex")
    engine.registry.commands.add_commands([_command(sid, f"echo {HOSTILE}")])
    with TestClient(_app(engine), base_url=BASE) as c:
        _login(c, key)
        csrf = _csrf(c.get(f"/ui/sandboxes/{sid}").text)
        assert 'id="export-button"' in c.get(f"/ui/sandboxes/{sid}").text
        assert c.post(f"/ui/sandboxes/{sid}/export", data={"csrf": "nope"}).status_code == 403
        r = c.post(f"/ui/sandboxes/{sid}/export", data={"csrf": csrf})
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        assert r.headers["content-disposition"] == f'attachment; filename="{sid}.ndjson"'
        lines = [json.loads(line) for line in r.text.splitlines()]
        assert {"sandbox", "command"} <= {x["type"] for x in lines}
        assert any(x["type"] == "command" and x["text"] == f"echo {HOSTILE}" for x in lines)
        r = c.post(f"/ui/sandboxes/{theirs}/export", data={"csrf": csrf})
        assert r.status_code == 404 and "globex" not in r.text


# ---- approvals


def test_approvals_page_scopes_buttons_and_answers(engine):
    _, acme = engine.registry.tenants.create_key("acme")
    _, admin = engine.registry.tenants.create_key("ops", admin=True)
    engine.registry.tenants.create_key("globex")
    sid = _sandbox(engine, "sb-0000000aa001", "acme")
    net = engine.registry.approvals.open_approval(
        "acme", "network", f"{HOSTILE}:443", "egress outside the allowlist", 300, sandbox_id=sid
    )
    cost = engine.registry.approvals.open_approval(
        "acme", "create", "a microvm sandbox, 16384 MiB", "over the size rule", 300
    )
    other = engine.registry.approvals.open_approval("globex", "create", "globex create", "over budget", 300)
    with TestClient(_app(engine), base_url=BASE) as c:
        _login(c, acme)
        html = c.get("/ui/approvals").text
        frag = c.get("/ui/frag/approvals").text
        for page in (html, frag):
            assert net.approval_id in page and cost.approval_id in page and other.approval_id not in page
            assert "<img" not in page and "<script>alert" not in page
            assert "&lt;img src=x onerror=alert(1)&gt;&lt;script&gt;alert(2)&lt;/script&gt;:443" in page
        row = frag.split(f'data-approval-id="{net.approval_id}"')[1].split("</tr>")[0]
        assert re.findall(r'data-decision="(\w+)"', row) == ["allow_once", "allow_always", "deny"]
        row = frag.split(f'data-approval-id="{cost.approval_id}"')[1].split("</tr>")[0]
        assert "data-decision" not in row  # a create is the operator's to answer
        csrf = _csrf(html)
        r = c.post(f"/ui/approvals/{net.approval_id}", data={"csrf": "x", "decision": "deny"})
        assert r.status_code == 403 and engine.registry.approvals.approval(net.approval_id).state == "pending"
        r = c.post(f"/ui/approvals/{cost.approval_id}", data={"csrf": csrf, "decision": "approve"})
        assert r.status_code == 403 and engine.registry.approvals.approval(cost.approval_id).state == "pending"
        r = c.post(f"/ui/approvals/{other.approval_id}", data={"csrf": csrf, "decision": "approve"})
        assert r.status_code == 404 and engine.registry.approvals.approval(other.approval_id).state == "pending"
        r = c.post(
            f"/ui/approvals/{net.approval_id}", data={"csrf": csrf, "decision": "allow_once"}, follow_redirects=False
        )
        assert r.status_code == 303 and r.headers["location"] == "/ui/approvals"
        got = engine.registry.approvals.approval(net.approval_id)
        assert got.state == "approved" and got.decision == "allow_once"
        r = c.post(f"/ui/approvals/{net.approval_id}", data={"csrf": csrf, "decision": "deny"})
        assert r.status_code == 409  # answered once only
    with TestClient(_app(engine), base_url=BASE) as c:
        login = _login(c, admin)
        assert login.status_code == 303
        frag = c.get("/ui/frag/approvals?tenant=globex").text
        assert other.approval_id in frag and cost.approval_id not in frag
        csrf = _csrf(c.get("/ui/approvals").text)
        r = c.post(f"/ui/approvals/{cost.approval_id}", data={"csrf": csrf, "decision": "deny"}, follow_redirects=False)
        assert r.status_code == 303
        got = engine.registry.approvals.approval(cost.approval_id)
        assert got.state == "denied" and got.answered_by.startswith("key-")
        closed = c.get("/ui/frag/approvals").text.split('id="approvals-closed"')[1]
        assert f'data-approval-id="{cost.approval_id}"' in closed and f'data-approval-id="{net.approval_id}"' in closed


def test_same_origin_reads_the_browsers_headers():
    def req(**headers: str):
        scope = {
            "type": "http",
            "method": "POST",
            "scheme": "http",
            "path": "/ui/logout",
            "query_string": b"",
            "headers": [
                (k.replace("_", "-").encode(), v.encode()) for k, v in {"host": "c.example", **headers}.items()
            ],
        }
        return Request(scope)

    assert web.same_origin(req())  # a non-browser client: the CSRF token decides
    assert web.same_origin(req(origin="http://c.example")) and web.same_origin(req(sec_fetch_site="same-origin"))
    assert web.same_origin(req(origin="https://c.example"))  # TLS ended by a proxy in front
    for bad in ({"origin": "null"}, {"origin": "https://evil.example"}, {"origin": "http://c.example.evil"}):
        assert not web.same_origin(req(**bad)), bad
    assert not web.same_origin(req(sec_fetch_site="cross-site")) and not web.same_origin(
        req(sec_fetch_site="same-site")
    )


def test_the_nav_badge_counts_open_questions_in_scope(engine):
    _, acme = engine.registry.tenants.create_key("acme")
    engine.registry.tenants.create_key("globex")
    with TestClient(_app(engine), base_url=BASE) as c:
        _login(c, acme)
        assert 'id="approvals-badge-slot"' in c.get("/ui/").text
        assert c.get("/ui/frag/approvals/count").text.strip() == ""
        engine.registry.approvals.open_approval("acme", "network", "a.example:443", "ask", 300)
        engine.registry.approvals.open_approval("globex", "network", "b.example:443", "ask", 300)
        assert 'data-count="1"' in c.get("/ui/frag/approvals/count").text


def test_a_flooding_tenant_cannot_hide_anothers_question_from_a_filtered_admin(engine, monkeypatch):
    from warmbox.server.console import approvals

    monkeypatch.setattr(approvals, "MAX_PENDING", 5)  # the page's bound, small for the test
    _, admin = engine.registry.tenants.create_key("ops", admin=True)
    victim = engine.registry.approvals.open_approval("victim", "create", "v", "over budget", 300)
    for _ in range(8):
        engine.registry.approvals.open_approval("evil", "create", "x", "y", 300)
    with TestClient(_app(engine), base_url=BASE) as c:
        _login(c, admin)
        everyone = c.get("/ui/frag/approvals").text
        assert victim.approval_id not in everyone and 'id="approvals-more"' in everyone  # says it is cut
        assert victim.approval_id in c.get("/ui/frag/approvals?tenant=victim").text
        assert 'data-count="1"' in c.get("/ui/frag/approvals/count?tenant=victim").text


def test_the_nav_shows_a_budget_past_its_warning_on_every_page(engine):
    import time

    from warmbox.storage.registry import _add_usage

    _, acme = engine.registry.tenants.create_key("acme")
    _, globex = engine.registry.tenants.create_key("globex")
    _, admin = engine.registry.tenants.create_key("ops", admin=True)
    engine.registry.usage.set_budget("acme", cpu_h=0.01)  # 36 cpu-seconds a day
    engine.registry.usage.set_budget("globex", cpu_h=1)
    with TestClient(_app(engine), base_url=BASE) as c:
        _login(c, acme)
        assert 'id="budget-badge-slot"' in c.get("/ui/").text
        assert c.get("/ui/frag/cost/budget").text.strip() == ""  # nothing used yet
        with engine.registry.db.tx() as db:
            _add_usage(db, "acme", time.time(), 30.0, 0.0)  # 83 % of acme's day
        got = c.get("/ui/frag/cost/budget").text
        assert 'id="budget-badge"' in got and ">83 %<" in got and 'data-exceeded="false"' in got
    with TestClient(_app(engine), base_url=BASE) as c:
        _login(c, globex)  # another tenant's warning is not its own
        assert c.get("/ui/frag/cost/budget").text.strip() == ""
    with TestClient(_app(engine), base_url=BASE) as c:
        _login(c, admin)
        assert 'data-count="1"' in c.get("/ui/frag/cost/budget").text  # tenants past the warning
        assert c.get("/ui/frag/cost/budget?tenant=globex").text.strip() == ""
        with engine.registry.db.tx() as db:
            _add_usage(db, "acme", time.time(), 10.0, 0.0)  # 111 %
        assert 'data-exceeded="true"' in c.get("/ui/frag/cost/budget?tenant=acme").text


def test_a_sandboxs_page_agrees_with_itself_and_shows_money(engine):
    """Issue 34, item 17: the metrics panel counts the commands its table lists (not the agent's
    count); a paused sandbox still shows its metered cost; [cost] prices show money beside cpu-s
    and GiB-s on the sandbox's page, the list and the cost page."""
    _, key = engine.registry.tenants.create_key("acme")
    sid = _sandbox(engine, "sb-00000000c051", "acme")
    engine.registry.usage.sample([(sid, 1 << 30, 3600 * 10**9)], now=time.time() + 1)  # 1 cpu-hour, 1 GiB
    engine.registry.commands.add_commands([_command(sid, "make"), _command(sid, "pytest"), _command(sid, "git diff")])
    engine.registry.usage.set_busy(sid, 10.0, 7)  # what an agent reported: its own count, warm-up included
    engine.registry.sandboxes.set_state(sid, State.PAUSED, "paused")
    with engine.registry.db.tx() as db:  # made and paused an hour ago, within a second
        db.execute("UPDATE sandboxes SET created_at=created_at-3600, ended_at=ended_at-3600 WHERE sandbox_id=?", (sid,))
    (engine.home / "warmbox.toml").write_text('[cost]\ncpu_hour = 0.5\ngib_hour = 0.25\ncurrency = "EUR"\n')
    with TestClient(_app(engine), base_url=BASE) as c:
        _login(c, key)
        page = c.get(f"/ui/sandboxes/{sid}").text
        shown = int(re.search(r'data-field="commands">(\d+)<', page).group(1))
        listed = len(re.findall(r"<tr data-seq=", page.split('id="commands"')[1].split("</table>")[0]))
        assert shown == listed == 3
        m = meters.metered(engine, sid)
        assert m.cpu_s == pytest.approx(3600)
        money = float(re.search(r'<dd data-field="money" data-value="([0-9.]+)"', page).group(1))
        assert money == pytest.approx(0.5 + m.memory_gib_s / 3600 * 0.25, rel=1e-4) and money > 0.5
        assert f"{money:.4f} EUR" in page
        rows = c.get("/ui/").text
        assert re.search(r'data-field="age">([^<]*)<', rows).group(1) == "1h 00m"  # was 0s: the time it ran
        assert '<th class="num">Cost (EUR)</th>' in rows
        assert float(re.search(r'<td class="num" data-field="money" data-value="([0-9.]+)"', rows).group(1)) == money
        cost = c.get("/ui/cost").text
        assert "<th>cost (EUR)</th>" in cost and 'class="money"' in cost
    (engine.home / "warmbox.toml").write_text("")
    with TestClient(_app(engine), base_url=BASE) as c:  # no prices: no money shown
        _login(c, key)
        assert 'data-field="money"' not in c.get(f"/ui/sandboxes/{sid}").text
        assert "Cost (" not in c.get("/ui/").text
