"""HTTP/1 requests from a hostile client, parsed by llhttp (through httptools), for the egress proxy.

llhttp runs strict: a Content-Length next to a Transfer-Encoding, two Content-Lengths, an
obs-fold continuation line, a bare LF, a chunk size past 64 bits, a method or a version it does
not know are parse errors. On top of it a request's Transfer-Encoding must be exactly
``chunked`` and a request that switches protocols (CONNECT, Upgrade) carries no body. Every
failure is a :class:`BadRequest`.

The upstream never gets the client's framing, only the proxy's reading of it: the head is
written anew with one ``Content-Length`` or ``Transfer-Encoding: chunked`` of the proxy's own and
the body is re-chunked from what llhttp decoded, so no byte the proxy took for body can be a
request to the upstream, nor the other way round. Bodies stream through (at most one read of
READ_SIZE bytes is held); heads are bounded by MAX_HEAD bytes and a deadline.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import AsyncIterator

import httptools

MAX_HEAD = 64 * 1024
READ_SIZE = 65536
# trailers a server that merges them into the head could take for framing or routing: not passed on
TRAILERS_DROPPED = frozenset({"content-length", "transfer-encoding", "host", "connection", "trailer"})


class BadRequest(Exception):
    """A request the proxy refuses to parse (answered 400, and the connection closed)."""


@dataclasses.dataclass
class Request:
    """One request head as llhttp read it."""

    method: str
    target: str  # as sent: absolute-form, authority-form (CONNECT) or origin-form
    version: str  # "HTTP/1.0" or "HTTP/1.1"
    headers: list[tuple[str, str]]  # as sent (latin-1), less Content-Length and Transfer-Encoding
    length: int | None  # the Content-Length; None when chunked or without a body
    chunked: bool
    upgrade: bool  # CONNECT, or an Upgrade llhttp stopped at: what follows is not HTTP/1

    def encode_head(self, start: str, headers: list[tuple[str, str]]) -> bytes:
        """``start`` line and ``headers`` with this request's framing, the proxy's own."""
        if self.chunked:
            headers = [*headers, ("Transfer-Encoding", "chunked")]
        elif self.length is not None:
            headers = [*headers, ("Content-Length", str(self.length))]
        return (start + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode("latin-1")


class RequestReader:
    """Reads requests one after the other from ``reader`` (keep-alive, pipelined or not)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.leftover = b""  # bytes after an upgrade's head (a CONNECT's early TLS bytes)
        self._parser = httptools.HttpRequestParser(self)
        self._events: collections.deque[tuple[str, object]] = collections.deque()
        self._error: BadRequest | None = None
        self._url = bytearray()
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_size = 0
        self._head_raw = 0
        self._in_head = False
        self._closed = False  # EOF seen, or an upgrade: nothing more is parsed

    # ---- llhttp's callbacks (called from feed_data)

    def on_message_begin(self) -> None:
        self._in_head, self._url, self._headers, self._head_size, self._head_raw = True, bytearray(), [], 0, 0

    def on_url(self, url: bytes) -> None:
        self._grow(len(url))
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow(len(name) + len(value) + 4)
        if self._in_head:
            self._headers.append((name, value))
        elif name.lower().decode("latin-1") not in TRAILERS_DROPPED:  # a chunked body's trailer
            self._events.append(("trailer", (name, value)))

    def on_headers_complete(self) -> None:
        self._in_head = False
        try:
            self._events.append(("head", self._request()))
        except BadRequest as e:
            self._error = e
            raise

    def on_body(self, body: bytes) -> None:
        self._events.append(("data", body))

    def on_message_complete(self) -> None:
        self._events.append(("end", None))

    def _grow(self, n: int) -> None:
        self._head_size += n
        if self._head_size > MAX_HEAD:
            self._error = BadRequest("head too large")
            raise self._error

    def _request(self) -> Request:
        version = self._parser.get_http_version()
        if version not in ("1.0", "1.1"):
            raise BadRequest(f"HTTP/{version} is not proxied")
        headers, length, te = [], None, []
        for name, value in self._headers:
            k, v = name.decode("latin-1"), value.decode("latin-1").strip()
            if k.lower() == "content-length":
                length = int(v)  # llhttp allows one, of digits only
            elif k.lower() == "transfer-encoding":
                te.append(v)
            else:
                headers.append((k, v))
        if te and (len(te) != 1 or te[0].lower() != "chunked"):
            raise BadRequest(f"Transfer-Encoding {', '.join(te)!r} (only chunked is accepted)")
        method = self._parser.get_method().decode("ascii")
        upgrade = self._parser.should_upgrade() or method == "CONNECT"
        if upgrade and (te or length):
            raise BadRequest("a body on a CONNECT or Upgrade request")
        return Request(method, self._url.decode("latin-1"), f"HTTP/{version}", headers, length, bool(te), upgrade)

    # ---- reading

    def _feed(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            self.leftover = data[int(e.args[0]) :]
            self._closed = True
        except httptools.HttpParserError as e:
            raise self._error or BadRequest(str(e) or type(e).__name__) from None
        if self._error is not None:
            raise self._error
        if self._in_head:  # llhttp holds no whitespace, but a head still ends within a bound
            self._head_raw += len(data)
            if self._head_raw > 2 * MAX_HEAD:
                raise BadRequest("head too large")

    async def _read(self) -> bool:
        """Feed one read to llhttp (False at the end of the stream)."""
        data = await self.reader.read(READ_SIZE)
        if not data:
            self._closed = True
            return False
        self._feed(data)
        return True

    async def head(self, timeout: float) -> Request | None:
        """The next request's head, within ``timeout`` seconds (TimeoutError); None if the client
        closed the connection (or switched protocols) before one began. The previous request's
        body must have been read (:meth:`body`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self._events:
                kind, value = self._events.popleft()
                if kind != "head" or not isinstance(value, Request):
                    raise RuntimeError(f"a request's {kind} before its head: its body was not read")
                return value
            if self._closed:
                if self._in_head:
                    raise BadRequest("incomplete head")
                return None
            await asyncio.wait_for(self._read(), max(0.0, deadline - loop.time()))

    async def body(self, request: Request) -> AsyncIterator[bytes]:
        """The current request's body as the upstream gets it, piece by piece (chunked: re-chunked,
        its trailers after the last chunk); nothing for a request without one."""
        trailers: list[tuple[bytes, bytes]] = []
        while True:
            while self._events:
                kind, value = self._events[0]
                if kind == "head":
                    raise RuntimeError("the next request's head before this one's end")
                self._events.popleft()
                if kind == "end":
                    if request.chunked:
                        yield b"0\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in trailers) + b"\r\n"
                    return
                if kind == "trailer" and isinstance(value, tuple):
                    trailers.append(value)
                elif kind == "data" and isinstance(value, bytes) and value:
                    yield b"%x\r\n%b\r\n" % (len(value), value) if request.chunked else value
            if self._closed or not await self._read():
                raise BadRequest("body ended early")
