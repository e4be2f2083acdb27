"""The console's frame: who is looking (a :class:`Viewer`), how a page, a fragment, a JSON read
or a form post is authenticated, and the headers every console response carries.

A page module registers routes whose handlers take ``(request, viewer)``; wrapping them with
:meth:`Console.page`, :meth:`Console.fragment`, :meth:`Console.data` or :meth:`Console.action`
does the authentication (and for posts the same-origin and CSRF checks) before they run.
Everything is rendered by Jinja2 with autoescaping on: whatever a sandbox produced (command text,
host names, metadata) reaches the page as text, never as markup.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import secrets
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from warmbox.errors import InvalidArgument, Unauthenticated, WarmboxError
from warmbox.models import SandboxInfo, Tenant
from warmbox.server.app import PEER_UID, Front, Service, _body, error_response, status_of
from warmbox.server.console import auth
from warmbox.wire import error_code

PREFIX = auth.PATH  # every console URL starts with it ("/ui")
LOGIN = f"{PREFIX}/login"
HOME = f"{PREFIX}/"
STATIC = f"{PREFIX}/static"
# no inline script or style anywhere (an injected <script> or on*= attribute would not run even
# if escaping failed); scripts, styles and fetches only from this origin; never framed
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS: tuple[tuple[str, str], ...] = (
    ("content-security-policy", CSP),
    ("x-frame-options", "DENY"),
    ("cache-control", "no-store"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "same-origin"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
)
MAX_FORM = 16 << 10  # a console form post (a CSRF token and a few fields)
_TENANT_MAX = 64


class NotLoggedIn(Exception):
    """No session cookie (or an expired, closed or revoked one) and no other credential."""


@dataclasses.dataclass(frozen=True)
class Viewer:
    """Who is looking at the console.

    tenant: the key's tenant (admin flag included); None for root on the unix socket.
    admin: root, or an admin key: sees every tenant's sandboxes (``front`` is the host's).
    front: the engine front every read of sandboxes goes through (a tenant key: its own tenant's;
        an admin key: the host's, which sees every tenant's).
    actor: the front of the credential itself, for what is done in its name (answering an
        approval records who answered): the key's own front, the host's for root.
    scope: the tenant whose things to show (a tenant key: its own; an admin: the ``?tenant=``
        filter, or None for all tenants).
    csrf: the token every form post of this viewer must carry.
    """

    tenant: Tenant | None
    admin: bool
    front: Front
    actor: Front
    scope: str | None
    csrf: str
    session: bool = False  # logged in with a cookie (it can log out); False: root, a uid or a bearer key

    @property
    def name(self) -> str:
        if self.tenant is None:
            return "root"
        return f"{self.tenant.name}{' (admin)' if self.tenant.admin else ''}"

    @property
    def query(self) -> str:
        """The query string that keeps an admin's tenant filter on links ("" when none)."""
        return self.with_query()

    def with_query(self, **params: object) -> str:
        """``?`` + the admin's tenant filter and ``params`` (those not None/False), url-encoded; "" if none."""
        out: dict[str, str] = {}
        if self.admin and self.scope is not None:
            out["tenant"] = self.scope
        for k, v in params.items():
            if v is not None and v is not False:
                out[k] = "1" if v is True else str(v)
        return "?" + urllib.parse.urlencode(out) if out else ""

    def sees(self, info: SandboxInfo) -> bool:
        """Whether a sandbox is in this viewer's scope (the front already hides other tenants'
        from a tenant key; this applies an admin's filter)."""
        return self.scope is None or info.tenant == self.scope


Handler = Callable[[Request, Viewer], Awaitable[Response]]
FormHandler = Callable[[Request, Viewer, dict[str, str]], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


def secured(response: Response) -> Response:
    """The console's headers on a response (what a handler set itself stays)."""
    for name, value in HEADERS:
        if name not in response.headers:
            response.headers[name] = value
    return response


def same_origin(request: Request) -> bool:
    """A form post came from a console page: the browser's Sec-Fetch-Site and Origin say so when
    sent (a non-browser client sends neither; its CSRF token still has to match). A sandbox
    preview is an opaque origin ("null"): refused. Origin's host is compared with the Host header,
    not its scheme: behind a TLS-terminating proxy the server itself sees plain http."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None:
        return True
    scheme, sep, netloc = origin.partition("://")
    host = request.headers.get("host", "")
    return bool(sep) and scheme in ("http", "https") and bool(host) and netloc == host


async def read_form(request: Request, timeout_s: float) -> dict[str, str]:
    """A url-encoded form body, at most MAX_FORM bytes, each field once; InvalidArgument otherwise."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/x-www-form-urlencoded":
        raise InvalidArgument("a console form must be sent as application/x-www-form-urlencoded")
    raw = await _body(request, MAX_FORM, timeout_s)
    try:
        pairs = urllib.parse.parse_qsl(raw.decode(), keep_blank_values=True, max_num_fields=32)
    except (UnicodeDecodeError, ValueError):
        raise InvalidArgument("the form is not valid url-encoded UTF-8") from None
    form: dict[str, str] = {}
    for k, v in pairs:
        if k in form:
            raise InvalidArgument(f"form field {k!r} given twice")
        form[k] = v
    return form


# ---- template filters (what the pages show of numbers and times)


def fmt_age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def fmt_money(value: float, currency: str) -> str:
    """An amount of money for a label: 4 decimals below 1 (a sandbox costs fractions of a cent), 2 above."""
    v = value if math.isfinite(value) and value > 0 else 0.0
    return f"{v:.4f} {currency}" if v < 1 else f"{v:,.2f} {currency}"


def fmt_when(ts: float) -> str:
    if not ts:
        return "—"
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def fmt_bytes(n: float) -> str:
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} GiB"


def fmt_num(v: float, digits: int = 2) -> str:
    return f"{v:,.{digits}f}"


class _Static(StaticFiles):
    """The console's scripts and styles, with the console's headers (cacheable: no-store is for pages)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-content-type-options", b"nosniff"))
                headers.append((b"cross-origin-resource-policy", b"same-origin"))
                message = {**message, "headers": headers}
            await send(message)

        await super().__call__(scope, receive, send_with_headers)


class Console:
    """The console of one server: its sessions, templates, navigation and the route wrappers."""

    def __init__(self, service: Service, sessions: auth.Sessions | None = None) -> None:
        self.service = service
        self.sessions = sessions or auth.Sessions()
        self.peer_tokens = auth.PeerTokens()
        self.nav: list[tuple[str, str]] = []  # (label, path) of each page module, in PAGES order
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
            autoescape=True,  # every template, whatever its name: sandbox output is text, never markup
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters.update(age=fmt_age, when=fmt_when, bytes=fmt_bytes, num=fmt_num, money=fmt_money)
        self.env.globals.update(prefix=PREFIX, static=STATIC)

    @property
    def body_timeout_s(self) -> float:
        return self.service.settings.body_timeout_s

    def static_app(self) -> StaticFiles:
        return _Static(directory=str(Path(__file__).parent / "static"))

    # ---- who is looking

    def viewer(self, request: Request) -> Viewer:
        """The viewer of a request: its session cookie, else (no login needed) root or a mapped uid
        on the unix socket or an API key in an Authorization header, exactly as the API takes
        them. NotLoggedIn when there is none; the API's typed errors for a refused credential."""
        secure = request.url.scheme == "https"
        session = self.sessions.get(request.cookies.get(auth.cookie_name(secure)))
        tenant: Tenant | None
        if session is not None:
            try:
                tenant = self.service.authenticate_key_id(session.key_id)
            except Unauthenticated:
                self.sessions.close_key(session.key_id)
                raise NotLoggedIn from None
            csrf = session.csrf
        elif PEER_UID in request.scope or "authorization" in request.headers:
            tenant = self.service.authenticate(request)
            uid = request.scope.get(PEER_UID)
            who = f"key:{tenant.key_id}" if tenant is not None and tenant.key_id else f"uid:{uid}"
            csrf = self.peer_tokens.token(who)
        else:
            raise NotLoggedIn
        admin = tenant is None or tenant.admin
        scope: str | None
        if admin:
            wanted = request.query_params.get("tenant", "")
            if len(wanted) > _TENANT_MAX:
                raise InvalidArgument(f"tenant filter longer than {_TENANT_MAX} characters")
            scope = wanted or None
        else:
            assert tenant is not None
            scope = tenant.name
        # an admin key sees every tenant (the host's front); a tenant key only its own
        front = self.service.front(None if admin else tenant)
        actor = self.service.front(tenant)
        return Viewer(
            tenant=tenant, admin=admin, front=front, actor=actor, scope=scope, csrf=csrf, session=session is not None
        )

    # ---- rendering

    def render(
        self, request: Request, viewer: Viewer | None, template: str, status: int = 200, **context: object
    ) -> Response:
        """A template (full page or fragment) as an HTML response with the console's headers.
        The template sees ``viewer``, ``nav``, ``path`` (this request's), ``now`` and ``context``."""
        return self.render_with(request, viewer, template, context, status)

    def render_with(
        self, request: Request, viewer: Viewer | None, template: str, context: Mapping[str, object], status: int = 200
    ) -> Response:
        """:meth:`render` with the context as one mapping."""
        html = self.env.get_template(template).render(
            {
                **context,
                "viewer": viewer,
                "nav": self.nav,
                "path": request.url.path,
                "now": time.time(),
                "cost": self.service.engine.settings().cost,  # [cost] prices: money beside cpu-s and GiB-s
            }
        )
        return secured(HTMLResponse(html, status_code=status))

    def error_page(self, request: Request, viewer: Viewer | None, exc: WarmboxError) -> Response:
        return self.render(request, viewer, "error.html", status=status_of(exc), error=exc, code=error_code(exc))

    # ---- route wrappers

    def page(self, handler: Handler) -> Endpoint:
        """A GET page: not logged in -> redirect to the login page; typed errors -> an error page."""

        async def endpoint(request: Request) -> Response:
            try:
                viewer = self.viewer(request)
            except NotLoggedIn:
                return secured(RedirectResponse(LOGIN, status_code=303))
            except WarmboxError as e:
                return self.error_page(request, None, e)
            try:
                return secured(await handler(request, viewer))
            except WarmboxError as e:
                return self.error_page(request, viewer, e)

        endpoint.__name__ = handler.__name__
        return endpoint

    def fragment(self, handler: Handler) -> Endpoint:
        """A GET of a piece of a page (what console.js swaps in): 401 when not logged in (the
        script then goes to the login page); typed errors as a one-line HTML note."""

        async def endpoint(request: Request) -> Response:
            try:
                viewer = self.viewer(request)
            except NotLoggedIn:
                return secured(Response("not logged in", status_code=401, media_type="text/plain"))
            except WarmboxError as e:
                return self.render(request, None, "_error.html", status=status_of(e), error=e, code=error_code(e))
            try:
                return secured(await handler(request, viewer))
            except WarmboxError as e:
                return self.render(request, viewer, "_error.html", status=status_of(e), error=e, code=error_code(e))

        endpoint.__name__ = handler.__name__
        return endpoint

    def data(self, handler: Handler) -> Endpoint:
        """A GET of JSON: errors (401 when not logged in) as the API's JSON errors."""

        async def endpoint(request: Request) -> Response:
            try:
                viewer = self.viewer(request)
                return secured(await handler(request, viewer))
            except NotLoggedIn:
                return secured(error_response(Unauthenticated("log in to the console first")))
            except WarmboxError as e:
                return secured(error_response(e))

        endpoint.__name__ = handler.__name__
        return endpoint

    def action(self, handler: FormHandler) -> Endpoint:
        """A form POST: same origin, a logged-in viewer and that viewer's CSRF token, checked
        before ``handler`` runs with the form's fields."""

        async def endpoint(request: Request) -> Response:
            if not same_origin(request):
                return secured(JSONResponse(_refusal("cross-site form post refused"), status_code=403))
            try:
                viewer = self.viewer(request)
            except NotLoggedIn:
                return secured(RedirectResponse(LOGIN, status_code=303))
            except WarmboxError as e:
                return self.error_page(request, None, e)
            try:
                form = await read_form(request, self.body_timeout_s)
                if not auth.same_token(form.get("csrf"), viewer.csrf):
                    return secured(JSONResponse(_refusal("missing or wrong CSRF token"), status_code=403))
                return secured(await handler(request, viewer, form))
            except WarmboxError as e:
                return self.error_page(request, viewer, e)

        endpoint.__name__ = handler.__name__
        return endpoint

    # ---- login and logout

    async def login_page(self, request: Request) -> Response:
        try:
            self.viewer(request)
            return secured(RedirectResponse(HOME, status_code=303))  # already in
        except (NotLoggedIn, WarmboxError):
            pass
        return self._login_form(request, "", 200)

    def _login_form(self, request: Request, error: str, status: int) -> Response:
        token = secrets.token_urlsafe(32)  # random per form: only the cookie set with it matches
        response = self.render(request, None, "login.html", status=status, login_csrf=token, error=error)
        response.headers.append(
            "set-cookie",
            auth.set_cookie_header(
                auth.LOGIN_COOKIE, token, path=LOGIN, max_age=int(auth.LOGIN_TTL_S), secure=_secure(request)
            ),
        )
        return response

    async def login(self, request: Request) -> Response:
        """POST /ui/login: the pasted key, checked like a request carrying it; a session on success."""
        if not same_origin(request):
            return secured(JSONResponse(_refusal("cross-site login refused"), status_code=403))
        try:
            form = await read_form(request, self.body_timeout_s)
            if not auth.same_token(form.get("csrf"), request.cookies.get(auth.LOGIN_COOKIE, "")):
                return self._login_form(request, "The login form expired: paste the key again.", 403)
            tenant = self.service.authenticate_secret(form.get("key", "").strip())
        except WarmboxError as e:
            return self._login_form(request, str(e), status_of(e))
        token, _ = self.sessions.open(tenant.key_id)
        response = secured(RedirectResponse(HOME, status_code=303))
        secure = _secure(request)
        response.headers.append(
            "set-cookie",
            auth.set_cookie_header(
                auth.cookie_name(secure), token, path=PREFIX, max_age=int(self.sessions.ttl_s), secure=secure
            ),
        )
        response.headers.append(
            "set-cookie", auth.set_cookie_header(auth.LOGIN_COOKIE, "", path=LOGIN, max_age=0, secure=secure)
        )
        return response

    async def logout(self, request: Request, viewer: Viewer, form: Mapping[str, str]) -> Response:
        secure = _secure(request)
        self.sessions.close(request.cookies.get(auth.cookie_name(secure)))
        response = RedirectResponse(LOGIN, status_code=303)
        response.headers.append(
            "set-cookie",
            auth.set_cookie_header(auth.cookie_name(secure), "", path=PREFIX, max_age=0, secure=secure),
        )
        return response


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


def _refusal(message: str) -> dict[str, object]:
    return {"error": {"code": "forbidden", "message": message}}


__all__ = ["CSP", "HOME", "LOGIN", "PREFIX", "STATIC", "Console", "NotLoggedIn", "Viewer", "secured"]
