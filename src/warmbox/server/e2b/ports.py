"""Any other port of a sandbox (what ``get_host(port)`` names): one HTTP request, or a WebSocket
upgrade, relayed to the server listening there, over warmbox's port tunnel (the ``ports.connect``
operation; the WebSocket's messages bounded as :func:`warmbox.server.tunnel.relay_upgrade` says).

Access is the data plane's: the sandbox's access token (``E2B-Traffic-Access-Token`` or
``X-Access-Token``) or an API key of the tenant that owns it; another tenant's sandbox is not found.
warmbox serves no port without one (E2B's ``allowPublicTraffic=False`` for every sandbox): the
credentials and E2B's routing headers are not passed on to the sandbox's server."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from warmbox import operations as ops
from warmbox.errors import InvalidArgument, WarmboxError
from warmbox.server import tunnel
from warmbox.server.e2b.common import (
    ACCESS_TOKEN_HEADER,
    API_KEY_HEADER,
    PORT_HEADER,
    SANDBOX_HEADER,
    TRAFFIC_TOKEN_HEADER,
    Service,
    Tokens,
    answer,
    data_target,
    error_response,
    warmbox_error_response,
)

# what says who may reach the sandbox and which one: the sandbox's server never sees them
_PRIVATE = frozenset(
    {
        SANDBOX_HEADER.encode(),
        PORT_HEADER.encode(),
        ACCESS_TOKEN_HEADER.encode(),
        TRAFFIC_TOKEN_HEADER.encode(),
        API_KEY_HEADER.encode(),
    }
)
BODY_TIMEOUT_S = 60.0


class Ports:
    """The plane of every sandbox port but envd's and the code interpreter's.

    max_body: the largest request body relayed, bytes (it is read whole before the tunnel opens)."""

    def __init__(self, service: Service, tokens: Tokens, max_body: int) -> None:
        self._service = service
        self._tokens = tokens
        self._max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send, port: int, own_host: bool = False) -> None:
        """own_host: routed by its Host (domain mode: the port is an origin of its own)."""
        csp = tunnel.CSP_OWN_ORIGIN if own_host else tunnel.CSP_SHARED_ORIGIN
        await answer(lambda request: self._relay(request, port, csp), scope, receive, send)

    async def websocket(self, scope: Scope, receive: Receive, send: Send, port: int) -> None:
        """A WebSocket upgrade to ``port``: the same access checks as an HTTP request (refused with
        E2B's error answer before the upgrade), then its messages relayed both ways."""
        ws = WebSocket(scope, receive, send)
        try:
            if not 1 <= port <= 65535:
                raise InvalidArgument(f"port {port} is not a TCP port")
            t = data_target(self._service, self._tokens, ws.headers)
            await t.front.handle(ops.Info(t.sandbox_id))  # the tenant's own sandbox, else not found
            self._service.ws_relays.take(t.sandbox_id)
        except WarmboxError as e:
            await tunnel.deny(ws, warmbox_error_response(e))
            return
        try:
            try:
                stream = await t.front.handle(ops.PortConnect(t.sandbox_id, port))
            except WarmboxError as e:
                await tunnel.deny(ws, warmbox_error_response(e))
                return
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() not in _PRIVATE]}
            await tunnel.relay_upgrade(WebSocket(scope, receive, send), stream, port, scope["path"].lstrip("/"))
        finally:
            self._service.ws_relays.give(t.sandbox_id)

    async def _relay(self, request: Request, port: int, csp: str) -> Response:
        if not 1 <= port <= 65535:
            return error_response(400, f"port {port} is not a TCP port")
        t = data_target(self._service, self._tokens, request.headers)
        await t.front.handle(ops.Info(t.sandbox_id))  # the tenant's own sandbox, else not found
        body = await self._body(request)
        stream = await t.front.handle(ops.PortConnect(t.sandbox_id, port))
        scope = dict(request.scope)
        scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k.lower() not in _PRIVATE]
        path = request.url.path.lstrip("/")
        return await tunnel.preview(Request(scope), stream, port, path, body, csp)

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_body:
            raise InvalidArgument(
                f"request body of {declared} bytes is larger than the limit of {self._max_body} bytes"
            )
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self._max_body:
                        raise InvalidArgument(f"request body is larger than the limit of {self._max_body} bytes")
                    parts.append(chunk)
        except TimeoutError:
            raise InvalidArgument(f"request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
        return b"".join(parts)


__all__ = ["Ports"]
