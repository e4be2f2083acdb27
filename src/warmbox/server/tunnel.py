"""Ports over HTTP: a WebSocket relaying one ``ports.connect`` tunnel, and the HTTP preview of a sandbox's server.

Both sit on a :class:`~warmbox.operations.PortStream` the tenant's front opened (authentication and
tenancy are the caller's, in :mod:`warmbox.server.app`). What the sandbox's server sends is bounded
here: a response head of at most MAX_HEAD bytes, bodies streamed (never held whole).
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
from starlette.websockets import WebSocket

from warmbox import operations as ops

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


async def preview(request: Request, stream: ops.PortStream, port: int, path: str, body: bytes) -> Response:
    """Proxy one plain HTTP request to the server on ``port`` (HTTP/1.0: it answers without
    chunking and closes). The response's body is streamed; ``stream`` is closed at its end."""
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
    # the sandbox's content is served from the API's origin: never let it run scripts there
    response.headers["content-security-policy"] = "sandbox"
    response.headers["x-content-type-options"] = "nosniff"
    return response


def error_message(error: object) -> str:
    return json.dumps({"error": error}, separators=(",", ":"))


__all__ = ["EOF", "MAX_HEAD", "OK", "error_message", "preview", "relay_websocket"]
