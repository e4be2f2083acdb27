"""Request ids, the access record of each request, and JSON logs (``warmbox serve --log-format json``).

Every HTTP request gets an id (random, made here; a client's own is never trusted), echoed as the
``X-Request-Id`` response header. Each log record made while a request is served carries it, with
the caller's tenant, the route template and the sandbox id of the route (when it has one). In JSON
format every record is one object per line: ts, level, msg, logger, then those fields; one
``request`` record per request adds method, status and duration_ms.

What is never logged: headers, query strings, bodies, raw paths (a file path or a preview URL is
the tenant's data), so never an API key or a secret; and messages are scrubbed of anything shaped
like a key (``wbx_...``) or a bearer token in case an error message carries one.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import json
import logging
import re
import secrets
import sys
import time
from typing import Any

from starlette.routing import BaseRoute, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from warmbox.server.metrics import HOST_TENANT, HttpMetrics

REQUEST_ID_HEADER = b"x-request-id"
ACCESS = logging.getLogger("warmbox.server.access")
LOG = logging.getLogger("warmbox.server")
_INTERNAL = b'{"error":{"code":"warmbox_error","message":"internal server error"}}'
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SECRETS = re.compile(r"(wbx_|[Bb]earer\s+)[A-Za-z0-9_\-.~+/=]+")


@dataclasses.dataclass
class RequestContext:
    """What the log records of one request carry; tenant is filled in once the caller is known,
    route and sandbox_id are read from the ASGI scope once the router has matched it."""

    request_id: str
    scope: Scope = dataclasses.field(repr=False)
    tenant: str | None = None

    @property
    def route(self) -> str:
        return route_template(self.scope)

    @property
    def sandbox_id(self) -> str:
        return _sandbox_id(self.scope)


_CURRENT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("warmbox_request", default=None)


def current() -> RequestContext | None:
    """The request being served by this task (None outside one)."""
    return _CURRENT.get()


def note_tenant(name: str) -> None:
    """Record the authenticated caller's tenant ("" for root on the unix socket) for the logs."""
    ctx = _CURRENT.get()
    if ctx is not None:
        ctx.tenant = name


def scrub(text: str) -> str:
    """``text`` with anything shaped like an API key or a bearer token replaced."""
    return _SECRETS.sub(lambda m: m.group(1) + "[redacted]", text)


def route_template(scope: Scope) -> str:
    """The matched route's template (``/v1/sandboxes/{sandbox_id}/exec``), ``unmatched`` if none:
    bounded, unlike the raw path."""
    route = scope.get("route")
    path = getattr(route, "path", None) if isinstance(route, BaseRoute) else None
    if not isinstance(path, str):
        return "unmatched"
    root = scope.get("root_path", "")
    root = root if isinstance(root, str) else ""
    # inside a mounted app root_path holds the mount's prefix; a Mount matched last (static files)
    # has its own path in root_path already
    full = root if isinstance(route, Mount) else root + path
    return full.rstrip("/") or "/"


def _sandbox_id(scope: Scope) -> str:
    params = scope.get("path_params")
    sid = params.get("sandbox_id") if isinstance(params, dict) else None
    if not isinstance(sid, str) or not sid:
        return ""
    return sid if _ID.match(sid) else "(invalid)"


class RequestLog:
    """ASGI middleware: a request id per HTTP request (and its X-Request-Id header), the request's
    count and latency in ``metrics``, and one access record at INFO (ERROR for a 5xx)."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics | None = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        ctx = RequestContext(secrets.token_hex(8), scope)
        token = _CURRENT.set(ctx)
        status = 500  # what the client gets if the app fails before answering
        started = False
        t0 = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = int(message["status"]), True
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (REQUEST_ID_HEADER, ctx.request_id.encode())],
                }
            await send(message)

        if self.metrics is not None and scope["type"] == "http":
            self.metrics.in_progress.inc()
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # logged here, inside the request's context (its id); the client gets a typed 500
            LOG.error("unhandled error", exc_info=True)
            if started or scope["type"] != "http":
                raise
            await send_with_id(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(_INTERNAL)).encode()),
                    ],
                }
            )
            await send_with_id({"type": "http.response.body", "body": _INTERNAL})
        finally:
            seconds = time.perf_counter() - t0
            route = ctx.route
            if scope["type"] == "http":
                if self.metrics is not None:
                    self.metrics.in_progress.dec()
                    self.metrics.observe(str(scope.get("method", "")), route, status, seconds)
                method = str(scope.get("method", ""))[:16]
                ACCESS.log(
                    logging.ERROR if status >= 500 else logging.INFO,
                    "%s %s %d %.1f ms",
                    method,
                    route,
                    status,
                    seconds * 1e3,
                    extra={"method": method, "status": status, "duration_ms": seconds * 1e3},
                )
            _CURRENT.reset(token)


_EXTRA = ("method", "status", "duration_ms")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601), level, msg, logger, the request's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "msg": scrub(record.getMessage()),
            "logger": record.name,
        }
        ctx = _CURRENT.get()
        if ctx is not None:
            out["request_id"] = ctx.request_id
            if ctx.tenant is not None:
                out["tenant"] = ctx.tenant or HOST_TENANT
            out["route"] = ctx.route
            sandbox_id = ctx.sandbox_id
            if sandbox_id:
                out["sandbox_id"] = sandbox_id
        for k in _EXTRA:
            v = record.__dict__.get(k)
            if v is not None:
                out[k] = round(v, 3) if isinstance(v, float) else v
        if record.exc_info:
            out["exc"] = scrub(self.formatException(record.exc_info))
        return json.dumps(out, separators=(",", ":"), default=str)


def configure(log_format: str) -> None:
    """Logging for ``warmbox serve``: "json" sends every record (INFO and up; the access records
    among them) to stderr as JSON lines; "text" leaves Python's defaults (warnings and errors)."""
    if log_format != "json":
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True


__all__ = ["JsonFormatter", "RequestContext", "RequestLog", "configure", "current", "note_tenant", "scrub"]
