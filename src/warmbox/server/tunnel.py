"""Ports over HTTP: a WebSocket relaying one ``ports.connect`` tunnel, the HTTP preview of a sandbox's
server, and WebSocket upgrades relayed to that server.

All sit on a :class:`~warmbox.operations.PortStream` the tenant's front opened (authentication and
tenancy are the caller's, in :mod:`warmbox.server.app` and :mod:`warmbox.server.e2b.ports`). What
the sandbox's server sends is bounded here: a response head of at most MAX_HEAD bytes, bodies
streamed (never held whole); a relayed WebSocket's messages at most WS_MAX_MESSAGE bytes each way,
in at most WS_MAX_FRAMES frames, its handshake within WS_HANDSHAKE_S, it is closed after WS_IDLE_S
without a message, and a sandbox has at most WS_PER_SANDBOX open at once (RelaySlots).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.websockets import WebSocket, WebSocketState
from websockets.client import ClientProtocol
from websockets.frames import CloseCode, Frame, Opcode
from websockets.http11 import Response as WsResponse
from websockets.protocol import State as WsState
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from warmbox import operations as ops
from warmbox.errors import RateLimited

EOF = '{"eof":true}'
OK = '{"ok":true}'
MAX_HEAD = 64 << 10  # a preview response's status line and headers
# hop-by-hop headers (RFC 9110 7.6.1) and what the proxy sets itself; never passed on
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        "authorization",
        # every sandbox's preview shares the API's origin: a cookie one sandbox sets would be sent
        # to every other sandbox's preview (and a cookie the browser holds would reach the sandbox)
        "cookie",
        "set-cookie",
    }
)


_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class _Gone(Exception):
    """The WebSocket client went away (or broke the tunnel protocol)."""


async def relay_websocket(ws: WebSocket, stream: ops.PortStream) -> None:
    """Relay between an accepted WebSocket (see api.TUNNEL_PROTOCOL) and ``stream`` until both
    sides ended their data, either side broke, or the client left; ``stream`` is closed after."""

    async def upstream() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                raise _Gone
            data = msg.get("bytes")
            if data is not None:
                await stream.write(data)
            elif msg.get("text") == EOF:
                await stream.write_eof()
            else:
                raise _Gone  # outside the protocol: the tunnel ends

    async def downstream() -> None:
        while (data := await stream.read()) is not None:
            await ws.send_bytes(data)
        await ws.send_text(EOF)

    tasks = {asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())}
    try:
        # ends when one side raised (a disconnect is _Gone) or both finished their data
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        stream.close()
        with contextlib.suppress(Exception):
            await ws.close()


def _request_head(request: Request, port: int, path: str, length: int) -> bytes:
    target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
    lines = [f"{request.method} {target} HTTP/1.0", f"Host: localhost:{port}", "Connection: close"]
    for name, value in request.headers.items():
        if name.lower() not in _HOP:
            lines.append(f"{name}: {value}")
    if length or request.method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _bad_gateway(message: str) -> Response:
    return JSONResponse({"error": {"code": "sandbox_error", "message": message}}, status_code=502)


# What a sandbox's page may do in a browser. On the API's own origin (the preview route, E2B's
# header routing) nothing: no scripts. On a port's own origin (E2B's domain mode,
# {port}-{id}.{domain}) its scripts run, but in an opaque origin (no allow-same-origin): the host
# shares its site with api.{domain} and every other sandbox, so a real origin could set cookies for
# {domain} (over the console's) and send the console's SameSite cookies; an opaque one can do neither.
CSP_SHARED_ORIGIN = "sandbox"
CSP_OWN_ORIGIN = "sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads"


async def preview(
    request: Request, stream: ops.PortStream, port: int, path: str, body: bytes, csp: str = CSP_SHARED_ORIGIN
) -> Response:
    """Proxy one plain HTTP request to the server on ``port`` (HTTP/1.0: it answers without
    chunking and closes). The response's body is streamed; ``stream`` is closed at its end.
    csp: the answer's Content-Security-Policy (CSP_OWN_ORIGIN where the port has a host of its own)."""
    try:
        if any(c in path for c in "\r\n ") or "\r" in request.url.query or "\n" in request.url.query:
            stream.close()
            return _bad_gateway("the path must not contain spaces or line breaks")
        await stream.write(_request_head(request, port, path, len(body)) + body)
        await stream.write_eof()
        head = b""
        rest = b""
        while b"\r\n\r\n" not in head:
            data = await stream.read()
            if data is None:
                stream.close()
                return _bad_gateway(f"the server on port {port} closed without a complete response")
            head += data
            if len(head) > MAX_HEAD and b"\r\n\r\n" not in head[: MAX_HEAD + 4]:
                stream.close()
                return _bad_gateway(f"the server on port {port} sent a response head over {MAX_HEAD} bytes")
        head, _, rest = head.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            stream.close()
            return _bad_gateway(f"the server on port {port} sent no HTTP response")
        status = int(parts[1])
        if not 200 <= status <= 599:  # an interim (1xx) answer is not the response: never passed on
            stream.close()
            return _bad_gateway(f"the server on port {port} answered status {status}")
        headers: list[tuple[str, str]] = []
        for line in header_lines:
            name, sep, value = line.partition(":")
            name, value = name.strip(), value.strip()
            # a bare LF or other control character would split or corrupt our own response: dropped
            if sep and name and name.lower() not in _HOP and not _CONTROL.search(line):
                headers.append((name, value))
    except BaseException:
        stream.close()
        raise

    # a response that has no body by its status or method: what the server sent after the head is
    # dropped (written on, it would stand where the client reads the next response)
    bodiless = status in (204, 304) or request.method == "HEAD"

    async def body_chunks() -> AsyncIterator[bytes]:
        try:
            if bodiless:
                return
            if rest:
                yield rest
            while (data := await stream.read()) is not None:
                yield data
        finally:
            stream.close()

    # closed after the body too (a client that left before it was streamed never runs the generator)
    response = StreamingResponse(body_chunks(), status_code=status, background=BackgroundTask(stream.close))
    for name, value in headers:
        response.headers.append(name, value)
    # the sandbox's content never runs with an origin that reaches the API's or another sandbox's
    response.headers["content-security-policy"] = csp
    response.headers["x-content-type-options"] = "nosniff"
    return response


# ---- WebSocket upgrades to a sandbox's server: the client's WebSocket is accepted here and each
# message relayed as a message of a WebSocket this side opens to the server (websockets' sans-I/O
# client over the port tunnel), so both sides' frames are parsed by a kept library and bounded

WS_MAX_MESSAGE = 1 << 20  # bytes of one message, either way (a larger one closes with 1009)
WS_HANDSHAKE_S = 30.0  # the sandbox's server answers the upgrade within this
WS_IDLE_S = 300.0  # a relayed WebSocket with no message either way this long is closed (1001)
WS_MAX_FRAMES = 1024  # frames of one message from the sandbox's server (empty ones too; 1009 beyond)
WS_PER_SANDBOX = 64  # relayed WebSockets open at once to one sandbox's ports, per server (429 beyond)
# request headers never passed to the sandbox's server: hop-by-hop, the handshake's own (the
# relay makes its own), credentials and cookies (as for the preview)
_WS_DROP = _HOP | {
    "sec-websocket-key",
    "sec-websocket-version",
    "sec-websocket-extensions",
    "sec-websocket-protocol",
    "sec-websocket-accept",
}


class RelaySlots:
    """The relayed WebSockets each sandbox has open on this server: at most ``limit`` at once (each
    holds a tunnel and two sockets of the host's until it ends)."""

    def __init__(self, limit: int = WS_PER_SANDBOX) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}

    def take(self, sandbox_id: str) -> None:
        """One more for ``sandbox_id``; RateLimited when it has ``limit`` open. Give it back with
        :meth:`give` once the relay ended."""
        n = self._open.get(sandbox_id, 0)
        if n >= self.limit:
            raise RateLimited(
                f"sandbox {sandbox_id} has {n} WebSockets relayed to its ports (at most {self.limit} at once)"
            )
        self._open[sandbox_id] = n + 1

    def give(self, sandbox_id: str) -> None:
        n = self._open.get(sandbox_id, 0) - 1
        if n > 0:
            self._open[sandbox_id] = n
        else:
            self._open.pop(sandbox_id, None)


class _WsRefused(Exception):
    """The sandbox's server did not take the upgrade: why, for the client's 502."""


async def _ws_handshake(
    stream: ops.PortStream, port: int, target: str, headers: list[tuple[str, str]], subprotocols: list[str]
) -> tuple[ClientProtocol, WsResponse, list[Frame]]:
    """Open a WebSocket to the server on ``port`` over ``stream``: the protocol, the server's
    answer, and any frames that came with it."""
    proto = ClientProtocol(
        parse_uri(f"ws://localhost:{port}{target}"),
        subprotocols=[Subprotocol(p) for p in subprotocols] or None,
        max_size=WS_MAX_MESSAGE,
    )
    request = proto.connect()
    for name, value in headers:
        request.headers[name] = value
    proto.send_request(request)
    for out in proto.data_to_send():
        await stream.write(out)
    try:
        async with asyncio.timeout(WS_HANDSHAKE_S):
            while True:
                data = await stream.read()
                if data is None:
                    raise _WsRefused(f"the server on port {port} closed without answering the WebSocket upgrade")
                proto.receive_data(data)
                events = proto.events_received()
                if events:
                    break
    except TimeoutError:
        raise _WsRefused(f"the server on port {port} did not answer the upgrade within {WS_HANDSHAKE_S:g} s") from None
    response = events[0]
    if not isinstance(response, WsResponse) or proto.handshake_exc is not None or proto.state is not WsState.OPEN:
        status = response.status_code if isinstance(response, WsResponse) else 0
        raise _WsRefused(f"the server on port {port} refused the WebSocket upgrade (status {status})")
    return proto, response, [e for e in events[1:] if isinstance(e, Frame)]


async def relay_upgrade(ws: WebSocket, stream: ops.PortStream, port: int, path: str) -> None:
    """Relay the WebSocket ``ws`` (not yet accepted) to the server on ``port`` at ``path`` (and the
    client's query): the server's subprotocol is the client's, messages go both ways until either
    side closes (its close code passed on), a message is too large, or WS_IDLE_S of silence.
    ``stream`` is closed after. A server that refuses the upgrade is the client's 502."""
    if any(c in path for c in "\r\n ") or any(c in ws.url.query for c in "\r\n "):
        stream.close()
        await deny(ws, _bad_gateway("the path must not contain spaces or line breaks"))
        return
    target = "/" + path + (f"?{ws.url.query}" if ws.url.query else "")
    headers = [(k, v) for k, v in ws.headers.items() if k.lower() not in _WS_DROP and not _CONTROL.search(v)]
    offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    try:
        proto, response, early = await _ws_handshake(stream, port, target, headers, offered)
    except _WsRefused as e:
        stream.close()
        await deny(ws, _bad_gateway(str(e)))
        return
    except BaseException:
        stream.close()
        raise
    try:
        await ws.accept(subprotocol=response.headers.get("Sec-WebSocket-Protocol"))
    except BaseException:  # the client left meanwhile
        stream.close()
        raise
    last = [asyncio.get_running_loop().time()]
    parts: list[bytes] = []
    closing: list[int] = []  # the close code to end the client's side with

    async def flush() -> None:
        for data in proto.data_to_send():
            if data:
                await stream.write(data)
            else:
                await stream.write_eof()

    async def close_server(code: int) -> None:
        if proto.state is WsState.OPEN:
            proto.send_close(code)
            await flush()

    async def to_client(frames: list[Frame]) -> bool:
        """Pass the server's frames on; False once it closed."""
        for f in frames:
            last[0] = asyncio.get_running_loop().time()
            if f.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
                if f.opcode is not Opcode.CONT:
                    parts.clear()
                    parts.append(b"t" if f.opcode is Opcode.TEXT else b"b")
                if len(parts) > WS_MAX_FRAMES:  # endless empty fragments would grow the list, not the size
                    closing.append(CloseCode.MESSAGE_TOO_BIG)
                    await close_server(CloseCode.MESSAGE_TOO_BIG)
                    return False
                parts.append(bytes(f.data))
                if f.fin and parts:
                    kind, body = parts[0], b"".join(parts[1:])
                    parts.clear()
                    if kind == b"t":
                        await ws.send_text(body.decode())  # UTF-8 checked by the parser
                    else:
                        await ws.send_bytes(body)
            elif f.opcode is Opcode.CLOSE:  # (close_code is set only once the connection is closed)
                closing.append(_sendable(proto.close_rcvd.code if proto.close_rcvd is not None else None))
                return False
        return True

    async def downstream() -> None:
        if not await to_client(early):
            return
        while (data := await stream.read()) is not None:
            proto.receive_data(data)
            await flush()  # pongs and the close handshake
            if not await to_client([e for e in proto.events_received() if isinstance(e, Frame)]):
                return
            if proto.state is not WsState.OPEN:  # the parser failed it (a message too large, bad UTF-8)
                sent = proto.close_sent
                closing.append(_sendable(sent.code if sent is not None else None))
                return
        closing.append(CloseCode.GOING_AWAY)  # the server's connection ended without a close

    async def upstream() -> None:
        while True:
            msg = await ws.receive()
            last[0] = asyncio.get_running_loop().time()
            if msg["type"] == "websocket.disconnect":
                await close_server(_sendable(msg.get("code")))
                return
            text, data = msg.get("text"), msg.get("bytes")
            size = len(text.encode()) if text is not None else len(data or b"")
            if size > WS_MAX_MESSAGE:
                closing.append(CloseCode.MESSAGE_TOO_BIG)
                await close_server(CloseCode.MESSAGE_TOO_BIG)
                return
            if proto.state is not WsState.OPEN:
                return
            if text is not None:
                proto.send_text(text.encode())
            else:
                proto.send_binary(data or b"")
            await flush()

    async def idle() -> None:
        loop = asyncio.get_running_loop()
        while (left := last[0] + WS_IDLE_S - loop.time()) > 0:
            await asyncio.sleep(left)
        closing.append(CloseCode.GOING_AWAY)

    tasks = {asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream()), asyncio.ensure_future(idle())}
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        stream.close()
        if ws.client_state is WebSocketState.CONNECTED and ws.application_state is WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await ws.close(code=closing[0] if closing else CloseCode.NORMAL_CLOSURE)


def _sendable(code: int | None) -> int:
    """A close code a close frame may carry: what says none was given (1005), or that the
    connection broke (1006, 1015), becomes 1000 / 1001."""
    if code is None or code == CloseCode.NO_STATUS_RCVD:
        return CloseCode.NORMAL_CLOSURE
    if code in (CloseCode.ABNORMAL_CLOSURE, CloseCode.TLS_HANDSHAKE) or not 1000 <= code <= 4999:
        return CloseCode.GOING_AWAY
    return code


async def deny(ws: WebSocket, response: Response) -> None:
    """Refuse a WebSocket before it is accepted: ``response`` as the HTTP answer where the server
    can send one (ASGI's denial response), else a close (uvicorn answers 403)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(response)
    else:
        await ws.close(code=CloseCode.POLICY_VIOLATION)


def error_message(error: object) -> str:
    return json.dumps({"error": error}, separators=(",", ":"))


__all__ = [
    "CSP_OWN_ORIGIN",
    "CSP_SHARED_ORIGIN",
    "EOF",
    "MAX_HEAD",
    "OK",
    "RelaySlots",
    "WS_HANDSHAKE_S",
    "WS_MAX_FRAMES",
    "WS_IDLE_S",
    "WS_MAX_MESSAGE",
    "WS_PER_SANDBOX",
    "deny",
    "error_message",
    "preview",
    "relay_upgrade",
    "relay_websocket",
]
