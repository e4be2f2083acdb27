"""The CLI's thin path: the commands people type most (run, exec, ls, kill) sent to an engine that
already runs, a ``warmbox serve`` of this home on its unix socket, instead of building an engine in
every process (issue 38). One blocking HTTP/1.1 connection on a plain socket: no event loop, no
aiohttp, no engine, not even http.client (its email and ssl imports were ~15 ms of every command)
are loaded; requests and answers go through the same codec as the SDK's HTTP transport
(:mod:`warmbox.apicodec`, :mod:`warmbox.wire`), so they mean exactly what they mean there. The
HTTP read here is only what that server sends (a status line, headers, a body by Content-Length or
chunked), every read bounded; it is read only from a peer checked to be root or us.

The server is this home's when its socket is the home's default one (``<runtime dir>/api.sock``,
see :func:`warmbox.server.serve.socket_path`), the file is a socket owned by root or by us, and the
process listening on it (SO_PEERCRED) runs as root or as us; the server sees our uid the same way.
A home whose warmbox.toml moves the socket elsewhere takes the in-process path.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode

from warmbox import apicodec, wire
from warmbox import operations as ops
from warmbox.errors import ConnectionLost, WarmboxError
from warmbox.paths import resolve_home, runtime_dir

R = TypeVar("R")
JSON_READ_S = 900.0  # as the HTTP transport: the longest one JSON operation may take
HEARTBEAT_S = 60.0  # a stream silent this long is dead (the server sends a blank line every 15 s)
MAX_LINE = 1 << 30  # the longest NDJSON line taken (a result with its output), and answer
MAX_HEAD_LINE = 64 << 10  # the longest status line, header line or chunk-size line
MAX_HEADERS = 100
_CRED = struct.Struct("3i")


def home_socket() -> Path:
    """Where a ``warmbox serve`` of this home (WARMBOX_HOME) listens by default."""
    return runtime_dir(resolve_home(None)) / "api.sock"


class _Closed(OSError):
    """The server ended the connection or sent what is not an HTTP/1.1 answer."""


class _Connection:
    """One keep-alive HTTP/1.1 connection to the server's unix socket, (re)opened on first use;
    every opening checks who listens there (SO_PEERCRED)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.timeout = JSON_READ_S
        self.sock: socket.socket | None = None
        self._file: Any = None
        self._keep = False  # the last answer left the connection open for the next request

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(self.timeout)
            sock.connect(str(self.path))
            _pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            if uid not in (0, os.getuid()):
                raise ConnectionRefusedError(f"{self.path} is served by uid {uid}")
        except BaseException:
            sock.close()
            raise
        self.sock, self._file, self._keep = sock, sock.makefile("rb"), True

    def close(self) -> None:
        if self.sock is not None:
            self._file.close()
            self.sock.close()
        self.sock, self._file, self._keep = None, None, False

    def request(self, method: str, url: str, body: bytes | None, headers: dict[str, str]) -> _Response:
        if self.sock is None or not self._keep:
            self.close()
            self.connect()
        assert self.sock is not None
        self.sock.settimeout(self.timeout)
        body = body or b""
        head = [f"{method} {url} HTTP/1.1", "Host: warmbox", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        response = _Response(self._file)
        self._keep = response.keep
        return response


class _Response:
    """An answer's status and body (its headers read and kept only for framing)."""

    def __init__(self, file: Any) -> None:
        self._file = file
        status = self._line(MAX_HEAD_LINE).split(None, 2)
        if len(status) < 2 or not status[0].startswith(b"HTTP/1.") or not status[1].isdigit():
            raise _Closed("the server sent no HTTP/1.1 status line")
        self.status = int(status[1])
        headers: dict[bytes, bytes] = {}
        for _ in range(MAX_HEADERS + 1):
            line = self._line(MAX_HEAD_LINE)
            if line in (b"\r\n", b"\n"):
                break
            name, sep, value = line.partition(b":")
            if not sep:
                raise _Closed("the server sent a header line without a colon")
            headers[name.strip().lower()] = value.strip()
        else:
            raise _Closed(f"the server sent more than {MAX_HEADERS} headers")
        connection = headers.get(b"connection", b"").lower()
        self.keep = status[0] == b"HTTP/1.1" and connection != b"close"
        self._chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        self._left: int | None = 0 if self.status in (204, 304) else None
        if not self._chunked and self._left is None:
            length = headers.get(b"content-length")
            if length is None or not length.isdigit():
                self._left, self.keep = MAX_LINE, False  # until the server closes
            else:
                self._left = int(length)
        self._buf = bytearray()
        self._done = False

    def _line(self, limit: int) -> bytes:
        line = self._file.readline(limit + 1)
        if not line:
            raise _Closed("the server closed the connection")
        if len(line) > limit:
            raise _Closed(f"the server sent a line longer than {limit} bytes")
        return bytes(line)

    def _more(self) -> bytes:
        """The body's next bytes as they arrive; b"" at its end."""
        if self._done:
            return b""
        if not self._chunked:
            assert self._left is not None
            data = self._file.read1(min(self._left, 1 << 16)) if self._left else b""
            self._left -= len(data)
            if not data:
                self._done = True
                if self._left and self.keep:
                    raise _Closed("the server closed the connection before the end of its answer")
            return bytes(data)
        size_line = self._line(MAX_HEAD_LINE).split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise _Closed("the server sent an unreadable chunk size") from None
        if size == 0:
            while self._line(MAX_HEAD_LINE) not in (b"\r\n", b"\n"):  # trailers, unused
                pass
            self._done = True
            return b""
        if size > MAX_LINE:
            raise _Closed(f"the server sent a chunk larger than {MAX_LINE} bytes")
        data = self._file.read(size)
        if len(data) < size or self._file.readline(3) not in (b"\r\n", b"\n"):
            raise _Closed("the server closed the connection inside a chunk")
        return bytes(data)

    def read(self, limit: int = MAX_LINE) -> bytes:
        """The rest of the body (at most ``limit`` bytes: _Closed beyond)."""
        out = [bytes(self._buf)]
        got = len(self._buf)
        del self._buf[:]
        while data := self._more():
            got += len(data)
            if got > limit:
                raise _Closed(f"the server sent an answer longer than {limit} bytes")
            out.append(data)
        return b"".join(out)

    def readline(self, limit: int) -> bytes:
        """The body's next line with its newline (or its last bytes), at most ``limit + 1`` bytes."""
        seen = 0
        while (cut := self._buf.find(b"\n", seen) + 1) == 0 and len(self._buf) <= limit:
            seen = len(self._buf)
            data = self._more()
            if not data:
                cut = seen
                break
            self._buf += data
        cut = min(cut or len(self._buf), limit + 1)
        line = bytes(self._buf[:cut])
        del self._buf[:cut]
        return line


class ThinClient:
    """Operations sent one at a time to a server's unix socket, blocking. ``open()`` gives one when
    a server of this home answers there, else None (nothing was sent: the caller runs in process)."""

    def __init__(self, conn: _Connection) -> None:
        self.path = conn.path
        self._conn = conn

    @classmethod
    def open(cls, path: Path | None = None) -> ThinClient | None:
        path = home_socket() if path is None else path
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in (0, os.getuid()):
            return None
        conn = _Connection(path)
        conn.timeout = 5.0
        try:
            conn.connect()
        except OSError:  # nothing listens (a stale socket), or not ours: no server
            return None
        conn.timeout = JSON_READ_S
        return cls(conn)

    def close(self) -> None:
        self._conn.close()

    def handle(self, request: ops.Request[R]) -> R:
        """One operation; its typed result, or the typed error the server answered. A command's
        output goes to the request's on_stdout/on_stderr as it arrives."""
        route, kwargs = apicodec.build(request)
        url = route.url(request)
        if kwargs.get("params"):
            url += "?" + urlencode(kwargs["params"])
        body = kwargs.get("data")
        if isinstance(body, str):
            body = body.encode()
        try:
            return self._exchange(request, route, url, body, kwargs.get("headers") or {})
        except BaseException:  # an answer half read (^C, a broken stream): the next request reconnects
            self._conn.close()
            raise

    def _exchange(self, request: ops.Request[R], route: Any, url: str, body: bytes | None, headers: dict) -> R:
        try:
            self._conn.timeout = HEARTBEAT_S if route.response == "ndjson" else JSON_READ_S
            response = self._conn.request(route.method, url, body, headers)
            if response.status >= 400:
                raise apicodec.error(response.status, response.read())
            if route.response == "ndjson":
                return self._ndjson(request, response)
            data = response.read()
        except OSError as e:
            raise ConnectionLost(
                f"the connection to the warmbox server at unix:{self.path} broke during {request.op.value} "
                f"({type(e).__name__}): its outcome is unknown"
            ) from None
        if route.response == "raw":
            return data  # type: ignore[return-value]
        try:
            decoded = json.loads(data)
        except ValueError:
            raise WarmboxError(f"the server sent an unreadable {request.op.value} result") from None
        return wire.decode(wire.result_type(type(request)), decoded, "result")  # type: ignore[no-any-return]

    def _ndjson(self, request: ops.Request[R], response: _Response) -> R:
        on_out, on_err = apicodec.sinks(request)
        while line := response.readline(MAX_LINE + 1):
            if len(line) > MAX_LINE:
                raise WarmboxError(f"the server sent a line longer than {MAX_LINE} bytes")
            if not line.strip():
                continue  # heartbeat
            try:
                msg: Any = json.loads(line)
            except ValueError:
                msg = None
            if not isinstance(msg, dict):
                raise WarmboxError(f"the server sent an unreadable {request.op.value} stream")
            if "result" in msg:
                response.read()  # the end of the chunked body: the connection is ready for the next request
                return wire.decode(wire.result_type(type(request)), msg["result"], "result")  # type: ignore[no-any-return]
            if "error" in msg:
                response.read()
                raise wire.error_from_wire(msg["error"])
            if "stdout" in msg and on_out is not None:
                on_out(msg["stdout"])
            elif "stderr" in msg and on_err is not None:
                on_err(msg["stderr"])
        raise ConnectionLost(f"the server ended {request.op.value} without a result: its outcome is unknown")


class Transport:
    """The thin client as the CLI commands' transport: its blocking calls behind ``await``."""

    def __init__(self, client: ThinClient) -> None:
        self.client = client

    async def handle(self, request: ops.Request[R]) -> R:
        return self.client.handle(request)

    @staticmethod
    def run(coro: Coroutine[Any, Any, int]) -> int:
        """A command's coroutine whose awaits never suspend (the client blocks in them), run to its
        end without an event loop: the thin path loads no asyncio."""
        try:
            coro.send(None)
        except StopIteration as done:
            return int(done.value)
        coro.close()
        raise RuntimeError("a thin-path command waited on an event loop")


__all__ = ["ThinClient", "Transport", "home_socket"]
