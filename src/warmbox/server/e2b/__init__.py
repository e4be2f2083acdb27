"""E2B's wire dialect on warmbox serve's port: one more adapter over the one list of operations.

A request with an ``E2b-Sandbox-Id`` header, or whose Host is ``{port}-{sandboxID}.{domain}`` (E2B's
domain mode: ``E2B_DOMAIN`` with wildcard DNS and TLS; the Host wins over the headers), is for a
sandbox's data plane, by port: 49983 is envd (:mod:`.envd`: Connect RPC and ``/files``), 49999 the
code interpreter (:mod:`.interpreter`), any other a server inside the sandbox (:mod:`.ports`).
A request for ``/sandboxes``, ``/v2/sandboxes`` (...) or carrying
``X-API-KEY`` (to a path that is not warmbox's own: /v1, /mcp, the console, health, metrics) is
for the control plane (:mod:`.control`). Anything else goes on to warmbox's own routes.

Every call runs as operations on the tenant front of the caller's key (the control plane's
``X-API-KEY``; the data plane's sandbox access token names the key that got it): the adapter has no
other way into the engine and no tenant check of its own. :mod:`.table` lists every E2B call with
its operations."""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from warmbox.server.e2b.common import (
    API_KEY_HEADER,
    ENVD_PORT,
    INTERPRETER_PORT,
    PORT_HEADER,
    SANDBOX_HEADER,
    Service,
    Tokens,
    error_response,
)
from warmbox.server.e2b.control import Control
from warmbox.server.e2b.interpreter import Interpreter
from warmbox.server.e2b.ports import Ports
from warmbox.server.tunnel import deny

if TYPE_CHECKING:
    from warmbox.server.e2b.envd import Envd

# warmbox's own routes: a request for them goes on to them, whatever E2B header it carries
WARMBOX_PATHS = ("/v1/", "/mcp", "/ui", "/healthz", "/readyz", "/metrics")
# domain mode's Host: its first label is {port}-{sandboxID} (warmbox's ids are sb- and 12 hex digits)
_DOMAIN_HOST = re.compile(rb"([0-9]{1,5})-(sb-[0-9a-f]{12})\.[^:]+(?::[0-9]{1,5})?")
_ROUTING = (SANDBOX_HEADER.encode(), PORT_HEADER.encode())


def domain_route(scope: Scope) -> Scope | None:
    """``scope`` with the E2b-Sandbox-Id/Port headers its Host names (``{port}-{sandboxID}.{domain}``,
    any headers of those names dropped), or None when the Host is not of that form."""
    host = next((v for k, v in scope["headers"] if k == b"host"), b"")
    m = _DOMAIN_HOST.fullmatch(host.lower())
    if m is None:
        return None
    headers = [(k, v) for k, v in scope["headers"] if k not in _ROUTING]
    headers += [(_ROUTING[0], m.group(2)), (_ROUTING[1], m.group(1))]
    return {**scope, "headers": headers}


class Dialect:
    """ASGI middleware in front of warmbox's routes: E2B's requests go to their plane, the rest on.

    max_body_mb: the largest file ``POST /files`` and ``GET /files`` move ([server] max_body_mb).
    The sandbox access tokens are signed with the registry's signing key (``service.signer``)."""

    def __init__(self, app: ASGIApp, service: Service, max_body_mb: int) -> None:
        self.app = app
        tokens = Tokens(service)
        self.control = Control(service, tokens)
        self._envd: Envd | None = None
        self._envd_args = (service, tokens, max_body_mb << 20)
        self.interpreter = Interpreter(service, tokens)
        self.ports = Ports(service, tokens, max_body_mb << 20)

    @property
    def envd(self) -> Envd:
        """envd's plane, made at its first request: its modules come from the ``e2b`` package, whose
        import loads the whole E2B SDK (about 0.6 s), which no server that never sees one should pay."""
        if self._envd is None:
            self._envd = importlib.import_module("warmbox.server.e2b.envd").Envd(*self._envd_args)
        return self._envd

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        routed = domain_route(scope)
        scope = routed or scope
        headers = Headers(scope=scope)
        if SANDBOX_HEADER in headers:
            port = headers.get(PORT_HEADER, str(ENVD_PORT))
            if port == str(ENVD_PORT):
                await self.envd(scope, receive, send)
            elif port == str(INTERPRETER_PORT):
                await self.interpreter(scope, receive, send)
            elif port.isdigit() and len(port) <= 5:
                await self.ports(scope, receive, send, int(port), own_host=routed is not None)
            else:
                await error_response(400, "E2b-Sandbox-Port must be a port number")(scope, receive, send)
            return
        path = scope["path"]
        ours = path == "/" or path.startswith(WARMBOX_PATHS)
        if Control.claims(path) or (API_KEY_HEADER in headers and not ours):
            await self.control(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket for a sandbox port (get_host's, by Host or the routing headers) is relayed to
        the server there; envd's and the code interpreter's ports take none; anything else goes on
        to warmbox's own routes (ports.connect's tunnel, the preview's upgrades)."""
        routed = domain_route(scope) or scope
        headers = Headers(scope=routed)
        if SANDBOX_HEADER not in headers:
            await self.app(scope, receive, send)
            return
        port = headers.get(PORT_HEADER, str(ENVD_PORT))
        if port.isdigit() and len(port) <= 5 and int(port) not in (ENVD_PORT, INTERPRETER_PORT):
            await self.ports.websocket(routed, receive, send, int(port))
            return
        ws = WebSocket(routed, receive, send)
        await deny(ws, error_response(400, f"port {port} of a sandbox takes no WebSocket"))


__all__ = ["Dialect"]
