"""The CLI's thin path: the commands people type most (run, exec, ls, kill) sent to an engine that
already runs, a ``warmbox serve`` of this home on its unix socket, instead of building an engine in
every process (issue 38). One blocking HTTP/1.1 connection of the standard library: no event loop,
no aiohttp, no engine are loaded; requests and answers go through the same codec as the SDK's HTTP
transport (:mod:`warmbox.apicodec`, :mod:`warmbox.wire`), so they mean exactly what they mean there.

The server is this home's when its socket is the home's default one (``<runtime dir>/api.sock``,
see :func:`warmbox.server.serve.socket_path`), the file is a socket owned by root or by us, and the
process listening on it (SO_PEERCRED) runs as root or as us; the server sees our uid the same way.
A home whose warmbox.toml moves the socket elsewhere takes the in-process path.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import struct
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
MAX_LINE = 1 << 30  # the longest NDJSON line taken (a result with its output)
_CRED = struct.Struct("3i")


def home_socket() -> Path:
    """Where a ``warmbox serve`` of this home (WARMBOX_HOME) listens by default."""
    return runtime_dir(resolve_home(None)) / "api.sock"


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 over the server's unix socket; every (re)connection checks who listens there."""

    def __init__(self, path: Path) -> None:
        super().__init__("warmbox", timeout=JSON_READ_S)
        self.path = path

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
        self.sock = sock


class ThinClient:
    """Operations sent one at a time to a server's unix socket, blocking. ``open()`` gives one when
    a server of this home answers there, else None (nothing was sent: the caller runs in process)."""

    def __init__(self, conn: _UnixConnection) -> None:
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
        conn = _UnixConnection(path)
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
            if self._conn.sock is not None:
                self._conn.sock.settimeout(self._conn.timeout)
            self._conn.request(route.method, url, body=body, headers=headers)
            response = self._conn.getresponse()
            if response.status >= 400:
                raise apicodec.error(response.status, response.read())
            if route.response == "ndjson":
                return self._ndjson(request, response)
            data = response.read()
        except (OSError, http.client.HTTPException) as e:
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

    def _ndjson(self, request: ops.Request[R], response: http.client.HTTPResponse) -> R:
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


__all__ = ["ThinClient", "home_socket"]
