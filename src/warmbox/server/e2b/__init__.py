"""E2B's wire dialect on warmbox serve's port: one more adapter over the one list of operations.

A request with an ``E2b-Sandbox-Id`` header is for a sandbox's data plane, by ``E2b-Sandbox-Port``:
49983 is envd (:mod:`.envd`: Connect RPC and ``/files``), 49999 the code interpreter
(:mod:`.interpreter`). A request for ``/sandboxes``, ``/v2/sandboxes`` (...) or carrying
``X-API-KEY`` (to a path that is not warmbox's own: /v1, /mcp, the console, health, metrics) is
for the control plane (:mod:`.control`). Anything else goes on to warmbox's own routes.

Every call runs as operations on the tenant front of the caller's key (the control plane's
``X-API-KEY``; the data plane's sandbox access token names the key that got it): the adapter has no
other way into the engine and no tenant check of its own. :mod:`.table` lists every E2B call with
its operations."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from warmbox.server.e2b.common import (
    API_KEY_HEADER,
    ENVD_PORT,
    INTERPRETER_PORT,
    PORT_HEADER,
    SANDBOX_HEADER,
    Service,
    Tokens,
    error_response,
    token_key,
)
from warmbox.server.e2b.control import Control
from warmbox.server.e2b.interpreter import Interpreter

if TYPE_CHECKING:
    from warmbox.server.e2b.envd import Envd

# warmbox's own routes: a request for them goes on to them, whatever E2B header it carries
WARMBOX_PATHS = ("/v1/", "/mcp", "/ui", "/healthz", "/readyz", "/metrics")


class Dialect:
    """ASGI middleware in front of warmbox's routes: E2B's requests go to their plane, the rest on.

    max_body_mb: the largest file ``POST /files`` and ``GET /files`` move ([server] max_body_mb).
    token_key: what the sandbox access tokens are signed with (:func:`.common.token_key`)."""

    def __init__(self, app: ASGIApp, service: Service, max_body_mb: int, token_key: bytes) -> None:
        self.app = app
        tokens = Tokens(token_key)
        self.control = Control(service, tokens)
        self._envd: Envd | None = None
        self._envd_args = (service, tokens, max_body_mb << 20)
        self.interpreter = Interpreter(service, tokens)

    @property
    def envd(self) -> Envd:
        """envd's plane, made at its first request: its modules come from the ``e2b`` package, whose
        import loads the whole E2B SDK (about 0.6 s), which no server that never sees one should pay."""
        if self._envd is None:
            self._envd = importlib.import_module("warmbox.server.e2b.envd").Envd(*self._envd_args)
        return self._envd

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if SANDBOX_HEADER in headers:
            port = headers.get(PORT_HEADER, str(ENVD_PORT))
            if port == str(ENVD_PORT):
                await self.envd(scope, receive, send)
            elif port == str(INTERPRETER_PORT):
                await self.interpreter(scope, receive, send)
            else:
                answer = error_response(
                    502, f"port {port[:16]!r} of a sandbox is reached through get_host's domain mode: not supported yet"
                )
                await answer(scope, receive, send)
            return
        path = scope["path"]
        ours = path == "/" or path.startswith(WARMBOX_PATHS)
        if Control.claims(path) or (API_KEY_HEADER in headers and not ours):
            await self.control(scope, receive, send)
            return
        await self.app(scope, receive, send)


__all__ = ["Dialect", "token_key"]
