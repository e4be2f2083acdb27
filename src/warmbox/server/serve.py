"""``warmbox serve``: the API on TCP (127.0.0.1:7420 by default, TLS optional) and on a unix socket.

The unix socket identifies callers by ``SO_PEERCRED`` (root is the host's admin; other uids are
mapped to tenants by ``[server] peers``), so an agent no longer needs root to use warmbox. A
non-loopback TCP address is refused without TLS. Both listeners serve the same app in one process
and one event loop (the engine's sessions live on it).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import socket
import ssl
import struct
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from warmbox.config import ServerSettings
from warmbox.engine.engine import Engine
from warmbox.errors import ConfigError
from warmbox.paths import runtime_dir
from warmbox.server.app import PEER_UID, Fronts, build_app

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _unix_peer_uid(sock: socket.socket | None) -> int | None:
    """The uid of a unix socket's peer (SO_PEERCRED: the kernel's word); None for any other socket."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    _pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return int(uid)


def _no_delay(sock: socket.socket | None) -> None:
    """TCP_NODELAY on a TCP connection: a response is written in pieces (head, then body), and
    with Nagle the second waits for the client's delayed ACK, ~40 ms per request on a kept-alive
    connection. asyncio sets it only on sockets made with proto=IPPROTO_TCP; a listener made with
    proto 0 (ours, and most) hands out connections without it."""
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _protocol_base() -> type[asyncio.Protocol]:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:  # httptools is optional in uvicorn: fall back to the pure-Python parser
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


MAX_HEAD = 64 << 10  # request line + headers; httptools has no bound of its own (h11's is 16 KiB)
MAX_CONNECTIONS = 1000  # concurrent connections per listener; more are answered 503
# a tunnel WebSocket's messages (the SDK sends at most 256 KiB each) and how many may wait unread:
# what one connection can make the server hold (uvicorn's defaults, 16 MiB x 32, are 512 MiB)
WS_MAX_MESSAGE = 1 << 20
WS_MAX_QUEUE = 4
_TOO_LARGE = b'{"error":{"code":"invalid_argument","message":"request line and headers over %d bytes"}}' % MAX_HEAD
_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_TOO_LARGE), _TOO_LARGE)
)


def peercred_protocol(head_timeout_s: float = 30.0) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, with the caller's uid (``SO_PEERCRED``) in the ASGI scope under
    PEER_UID on unix sockets; nothing a client sends can set that key. A request whose
    line and headers pass MAX_HEAD bytes is answered 431 and the connection closed (httptools
    would buffer a header of any size); one whose head is still incomplete ``head_timeout_s`` after
    its first byte is closed (uvicorn's keep-alive timer stops at the first byte: a client
    trickling a header would hold the connection forever)."""
    base: Any = _protocol_base()

    class PeerCredProtocol(base):  # type: ignore[misc]
        _head_bytes = 0
        _in_head = True  # reading a request line and headers (not a body)

        _peer_uid: int | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            self._peer_uid = _unix_peer_uid(sock)
            _no_delay(sock)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._peer_uid is not None:
                self.scope[PEER_UID] = self._peer_uid

        _tail = b""  # the last bytes of the head so far (its end may straddle two reads)
        _head_timer: asyncio.TimerHandle | None = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self._in_head and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                if self._head_timer is None:
                    self._head_timer = asyncio.get_running_loop().call_later(head_timeout_s, self._head_expired)
                end = (self._tail + data).find(b"\r\n\r\n")
                self._head_bytes += len(data) if end < 0 else end + 4 - len(self._tail)
                self._tail = (self._tail + data)[-3:]
                if self._head_bytes > MAX_HEAD:
                    if not self.transport.is_closing():
                        self.transport.write(_431)
                        self.transport.close()
                    return
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._in_head = False
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes, self._tail = True, 0, b""

    return PeerCredProtocol


def peercred_ws_protocol() -> type[asyncio.Protocol] | None:
    """uvicorn's WebSocket protocol (the ports.connect tunnel), with PEER_UID in the scope as on
    HTTP requests: an upgraded connection gets a protocol object (and scope) of its own."""
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    if AutoWebSocketsProtocol is None:
        return None
    base: Any = AutoWebSocketsProtocol

    class PeerCredWebSocket(base):  # type: ignore[misc]
        _peer_uid: int | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            self._peer_uid = _unix_peer_uid(sock)
            _no_delay(sock)

        async def run_asgi(self) -> None:
            if self._peer_uid is not None:
                self.scope[PEER_UID] = self._peer_uid
            await super().run_asgi()

    return PeerCredWebSocket


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def socket_path(home: Path, settings: ServerSettings) -> Path:
    return Path(settings.socket) if settings.socket else runtime_dir(home) / "api.sock"


def check_listen(settings: ServerSettings) -> None:
    """Refuse a non-loopback address without TLS (keys are always required on TCP)."""
    if settings.host and not is_loopback(settings.host) and not (settings.tls_cert and settings.tls_key):
        raise ConfigError(
            f"refusing to listen on {settings.host}:{settings.port} without TLS: API keys would travel in clear text. "
            "Pass --tls-cert and --tls-key (or [server] tls_cert/tls_key), or listen on 127.0.0.1 and use a proxy."
        )


def _tcp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(512)
    return sock


def _unix_socket(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        with_stale = path.exists() or path.is_symlink()
        if with_stale:
            path.unlink()  # a previous server's socket: nothing listens on it
    else:
        raise ConfigError(f"another server already listens on {path}")
    finally:
        probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o111)  # rw for everyone: callers are told apart by their uid, not the file mode
    try:
        sock.bind(str(path))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {path}: {e.strerror}") from None
    finally:
        os.umask(old)
    sock.listen(512)
    return sock


def _client_cert_reqs(settings: ServerSettings) -> ssl.VerifyMode:
    """What a TCP client must show: a certificate signed by ``tls_client_ca`` (required, or checked
    when presented with ``tls_client_optional``), or nothing without a client CA."""
    if not settings.tls_client_ca:
        return ssl.CERT_NONE
    return ssl.CERT_OPTIONAL if settings.tls_client_optional else ssl.CERT_REQUIRED


def _ssl_context(settings: ServerSettings) -> ssl.SSLContext | None:
    """The listener's TLS, loaded once here so a bad file is a ConfigError before anything listens."""
    if not settings.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
        if settings.tls_client_ca:
            ctx.load_verify_locations(settings.tls_client_ca)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot load the TLS certificate/key/client CA: {e}") from None
    ctx.verify_mode = _client_cert_reqs(settings)
    return ctx


class Listening:
    """The app served on its listeners (see :func:`listen`); ``addresses``: ``http(s)://HOST:PORT``
    and/or ``unix:/path``, the TCP one first."""

    def __init__(
        self, app: Any, listeners: list[tuple[uvicorn.Server, socket.socket]], addresses: list[str], unix: Path | None
    ) -> None:
        self.app = app
        self._listeners = listeners
        self.addresses = addresses
        self._unix = unix
        self._loops: list[asyncio.Task[None]] = []

    async def _start(self) -> None:
        for server, sock in self._listeners:
            if not server.config.loaded:
                server.config.load()
            server.lifespan = server.config.lifespan_class(server.config)
            await server.startup(sockets=[sock])
            if server.should_exit:
                raise ConfigError("the server could not start (see the log above)")
            self._loops.append(asyncio.ensure_future(server.main_loop()))  # keeps the Date header current

    def stopping(self) -> None:
        """From now on /readyz answers 503 (the requests in flight still finish)."""
        self.app.state.service.stopping = True

    async def close(self) -> None:
        """Stop accepting, let requests in flight finish (uvicorn's graceful timeout), run the
        app's shutdown (it closes the tenants' fronts) and remove the unix socket."""
        for t in self._loops:
            t.cancel()
        for server, sock in self._listeners:
            server.should_exit = True
            try:
                await server.shutdown(sockets=[sock])
            except Exception as e:  # one listener failing to close must not keep the other open
                print(f"warmbox serve: closing a listener failed: {e}", file=sys.stderr)
        if self._unix is not None:
            try:
                self._unix.unlink()
            except OSError:
                pass


async def listen(
    engine: Engine, home: Path, settings: ServerSettings, *, mcp: bool = True, fronts: Fronts | None = None
) -> Listening:
    """Serve ``engine``'s API on ``settings``' TCP address and unix socket (``warmbox serve``, and a
    cluster node's API); returns once both accept. ``close()`` it when done. fronts: see serve()."""
    check_listen(settings)
    import logging

    from warmbox.server import logs

    logs.configure(settings.log_format)
    logging.getLogger("mcp").setLevel(logging.WARNING)  # its session manager announces itself at INFO
    # json: uvicorn's records go through the root's JSON handler (its own config would replace it)
    log_config: Any = None if settings.log_format == "json" else LOGGING_CONFIG
    app = build_app(engine, settings, mcp=mcp, fronts=fronts)
    protocol = peercred_protocol(min(settings.body_timeout_s, 30.0))  # a head is small: at most 30 s
    ws_protocol = peercred_ws_protocol() or "none"
    listeners: list[tuple[uvicorn.Server, socket.socket]] = []
    addresses = []
    tls = _ssl_context(settings)
    if settings.host:
        tcp = _tcp_socket(settings.host, settings.port)
        port = tcp.getsockname()[1]
        scheme = "https" if tls else "http"
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        addresses.append(f"{scheme}://{host}:{port}")
        cfg = uvicorn.Config(
            app,
            http=protocol,
            ws=ws_protocol,
            ws_max_size=WS_MAX_MESSAGE,
            ws_max_queue=WS_MAX_QUEUE,
            lifespan="on",
            log_level="warning",
            access_log=False,
            proxy_headers=False,  # X-Forwarded-For must never change who the caller is
            limit_concurrency=MAX_CONNECTIONS,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=5,
            log_config=log_config,
            ssl_certfile=settings.tls_cert or None,
            ssl_keyfile=settings.tls_key or None,
            ssl_ca_certs=settings.tls_client_ca or None,
            ssl_cert_reqs=_client_cert_reqs(settings),
        )
        listeners.append((uvicorn.Server(cfg), tcp))
    upath = socket_path(home, settings)
    unix_path: Path | None = None
    if str(upath) != "-":
        unix = _unix_socket(upath)
        unix_path = upath
        addresses.append(f"unix:{upath}")
        cfg = uvicorn.Config(
            app,
            http=protocol,
            ws=ws_protocol,
            ws_max_size=WS_MAX_MESSAGE,
            ws_max_queue=WS_MAX_QUEUE,
            lifespan="off" if listeners else "on",
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            limit_concurrency=MAX_CONNECTIONS,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=5,
            log_config=log_config,
        )
        listeners.append((uvicorn.Server(cfg), unix))
    if not listeners:
        raise ConfigError("nothing to listen on: give a host or a unix socket")
    served = Listening(app, listeners, addresses, unix_path)
    try:
        await served._start()
    except BaseException:
        await served.close()
        raise
    return served


async def serve(
    home: Path,
    settings: ServerSettings,
    *,
    mcp: bool = True,
    fronts: Callable[[Engine], Awaitable[Fronts]] | None = None,
) -> None:
    """Listen until SIGTERM/SIGINT; prints one ``listening`` line with the addresses when ready.

    fronts: where the operations run instead of this host's engine, built on it (a cluster's API
    tier: ``warmbox serve --cluster``, warmbox.cluster.api); the engine then only authenticates."""
    check_listen(settings)
    engine = Engine.for_home(home)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    served = await listen(engine, home, settings, mcp=mcp, fronts=None if fronts is None else await fronts(engine))
    try:
        print("listening on " + " and ".join(served.addresses), flush=True)
        await stop.wait()
        served.stopping()  # /readyz: 503 while the requests in flight finish
    finally:
        await served.close()


__all__ = ["Listening", "check_listen", "is_loopback", "listen", "peercred_protocol", "serve", "socket_path"]
