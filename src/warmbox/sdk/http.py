"""The SDK over the network: a Transport that speaks warmbox's HTTP API (``warmbox serve``).

Same requests, same typed results, same error classes as in process: the route of each operation
comes from :mod:`warmbox.api`, bodies and results go through :mod:`warmbox.wire`, and an error
arrives as its stable ``code`` and is raised again as its class. Commands and code runs stream
their output (NDJSON) into the request's callbacks.

A dropped connection is retried where that is safe (the operation is idempotent, or the request
never left, or it carries an idempotency key); otherwise — a write, a command or create sent with
``idempotency=False`` — :class:`~warmbox.errors.ConnectionLost` says the outcome is unknown, never a
silent partial result. A create, command or code run without a key of the caller's gets one made
here (``auto-`` and 128 random bits) in the ``Idempotency-Key`` header, so this transport's own
retry of it never runs it twice; ``idempotency=False`` sends none.

``api_url``: ``http(s)://host:port`` or ``unix:/path/to/api.sock``.
"""

from __future__ import annotations

import asyncio
import collections.abc
import dataclasses
import inspect
import json
import os
import secrets
import ssl
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import aiohttp
from aiohttp.http_exceptions import LineTooLong

from warmbox import api, transcript, wire
from warmbox import operations as ops
from warmbox.apicodec import build as _build
from warmbox.apicodec import error as _error
from warmbox.apicodec import sinks as _sinks
from warmbox.errors import ConnectionLost, InvalidArgument, WarmboxError
from warmbox.models import (
    ApprovalRequest,
    CommandResult,
    EntryInfo,
    FilesystemEvent,
    ProcessEvent,
    Result,
    TemplateBuildEvent,
)
from warmbox.sdk.transport import default_url

R = TypeVar("R")
RETRIES = (0.1, 0.3, 0.8, 1.5)  # pauses between attempts of a retryable request (about 3 s in all)
HEARTBEAT_S = 60.0  # a stream silent this long (the server sends a blank line every 15 s) is dead
JSON_READ_S = 900.0  # the longest one JSON operation may take (a cold microVM, a large snapshot)
MAX_LINE = 1 << 30  # the longest NDJSON line read (a result with its output), see _line


class _Stream:
    """A file read arriving as a chunked HTTP body (ChunkStream)."""

    def __init__(self, path: str, response: aiohttp.ClientResponse) -> None:
        self._path = path
        self._response = response
        self._received = 0
        self._done = False

    @property
    def path(self) -> str:
        return self._path

    @property
    def received(self) -> int:
        return self._received

    @property
    def done(self) -> bool:
        return self._done

    async def next(self) -> bytes | None:
        if self._done:
            return None
        try:
            chunk = await self._response.content.readany()
        except (aiohttp.ClientError, OSError) as e:
            self._done = True
            self._response.close()
            raise ConnectionLost(
                f"the read of {self._path} ended after {self._received} bytes without completing "
                f"({type(e).__name__}); nothing partial should be used"
            ) from None
        if not chunk:
            self._done = True
            self._response.release()
            return None
        self._received += len(chunk)
        return chunk

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._response.close()


class _ProcStream:
    """A background process's output arriving as NDJSON (operations.ProcessStream)."""

    def __init__(self, pid: int, response: aiohttp.ClientResponse, url: str) -> None:
        self._pid = pid
        self._response = response
        self._url = url
        self._result: CommandResult | None = None
        self._done = False

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def result(self) -> CommandResult | None:
        return self._result

    async def next(self) -> ProcessEvent | None:
        while not self._done:
            try:
                line = await _line(self._response)
            except (*_DROPPED, TimeoutError, aiohttp.ServerTimeoutError) as e:
                self.cancel()
                raise ConnectionLost(
                    f"the connection to {self._url} dropped while following process {self._pid} "
                    f"({type(e).__name__}); the process itself was not affected"
                ) from None
            if not line:
                self.cancel()
                raise ConnectionLost(f"the server ended the output of process {self._pid} without its result")
            if not line.strip():
                continue  # heartbeat
            msg = json.loads(line)
            if "result" in msg:
                self._result = wire.decode(CommandResult, msg["result"], "result")
                self._done = True
                self._response.release()
                return None
            if "error" in msg:
                self.cancel()
                raise wire.error_from_wire(msg["error"])
            if "lost" in msg:
                return ProcessEvent("lost", size=int(msg["lost"]))
            if "pty" in msg:
                return ProcessEvent("pty", data=wire.decode(bytes, msg["pty"], "pty"))
            for kind in ("stdout", "stderr"):
                if kind in msg:
                    return ProcessEvent(kind, text=str(msg[kind]))
        return None

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._response.close()


class _Watch(ops.WatchTask):
    """A files.watch_dir over HTTP (DirWatch): a task reads the event lines into the callback."""

    def __init__(
        self, response: aiohttp.ClientResponse, on_event: Callable[[FilesystemEvent], object], url: str
    ) -> None:
        self._response = response
        self._url = url
        super().__init__(on_event)

    async def _run(self) -> None:
        try:
            while line := await _line(self._response):
                if not line.strip():
                    continue  # heartbeat
                msg = json.loads(line)
                if "event" in msg:
                    event = wire.decode(FilesystemEvent, msg["event"], "event")
                    await self._deliver(event)
                elif "error" in msg:
                    raise wire.error_from_wire(msg["error"])
                elif "end" in msg:
                    return
            raise ConnectionLost(f"the server ended files.watch_dir without saying why ({self._url})")
        except asyncio.CancelledError:
            raise
        except (*_DROPPED, TimeoutError, aiohttp.ServerTimeoutError, ValueError) as e:
            self._error = ConnectionLost(f"the watch's connection to {self._url} failed ({type(e).__name__})")
        except BaseException as e:  # a typed error from the server, or the callback's own
            self._error = e
        finally:
            self._response.close()

    def _halt(self) -> None:
        self._response.close()


class _Subscription:
    def __init__(self, task: asyncio.Task[None]) -> None:
        self._task = task

    def cancel(self) -> None:
        self._task.cancel()


# a connection that broke after the request may have left: the outcome is unknown
_DROPPED = (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)


KEPT_IDLE = 8  # sessions of one loop kept with no open transport (the least recently used go first)


class _LoopSessions:
    """One event loop's aiohttp sessions, one per server and client settings, shared by its open
    transports. A sandbox made over HTTP used to open a session and a connection of its own: ~0.7 ms
    more per create on this loaded 2-core host than a kept-alive connection (docs/performance.md).
    A session no transport holds is kept for the next one (at most KEPT_IDLE of them: a router's
    transports to many nodes and tenants come and go); the rest are closed when the loop finalizes
    its async generators (``asyncio.run``'s end; the sync API's loop thread at the process's exit),
    which the pending ``finally`` of ``_closer`` hooks into."""

    def __init__(self) -> None:
        self.sessions: dict[tuple[object, ...], aiohttp.ClientSession] = {}  # in order of last release
        self.holders: dict[tuple[object, ...], int] = {}
        self.closer: collections.abc.AsyncGenerator[None] | None = None

    def hold(self, key: tuple[object, ...]) -> None:
        self.holders[key] = self.holders.get(key, 0) + 1

    async def release(self, key: tuple[object, ...]) -> None:
        left = self.holders.get(key, 1) - 1
        if left > 0:
            self.holders[key] = left
            return
        self.holders.pop(key, None)
        session = self.sessions.pop(key, None)
        if session is not None:
            self.sessions[key] = session  # last released: kept longest
        idle = [k for k in self.sessions if k not in self.holders]
        for k in idle[: max(0, len(idle) - KEPT_IDLE)]:
            await self.sessions.pop(k).close()

    async def _closer(self) -> collections.abc.AsyncGenerator[None]:
        try:
            yield
        finally:
            for session in list(self.sessions.values()):
                await session.close()
            self.sessions.clear()


_LOOPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopSessions] = weakref.WeakKeyDictionary()


async def _loop_sessions() -> _LoopSessions:
    loop = asyncio.get_running_loop()
    got = _LOOPS.get(loop)
    if got is None:
        got = _LOOPS[loop] = _LoopSessions()
        got.closer = got._closer()  # held here: the loop keeps only a weak reference to it
        await got.closer.__anext__()  # registered with the loop (its firstiter hook), held at its yield
    return got


class HttpTransport:
    """Operations sent to a warmbox server, on the connections its event loop keeps to it (shared
    by every transport of the loop with the same server, key and settings: _LoopSessions);
    ``close()`` waits for its background requests and lets go of them.

    Built on aiohttp: on this 2-core host one small request costs 0.39-0.46 ms with it against
    0.87 ms with httpx (the API's goal is <= 1 ms added per operation)."""

    def __init__(
        self,
        api_url: str | None = None,
        api_key: str | None = None,
        *,
        verify: bool | str | ssl.SSLContext = True,
        connect_timeout: float = 10.0,
        headers: collections.abc.Mapping[str, str] | None = None,
        request_timeout: float | None = None,
        idempotency: bool = True,
    ) -> None:
        """request_timeout: seconds one JSON request may take in all (E2B's name; a stream, a
        process followed, a watch keep their own bounds); None: up to 900 s of silence.
        idempotency: give each create, command and code run without a key one of its own (see above)."""
        self._auto_keys = idempotency
        url = api_url or default_url()
        if not url:
            raise InvalidArgument("api_url (or WARMBOX_API_URL) is required for the HTTP transport")
        key = api_key if api_key is not None else os.environ.get("WARMBOX_API_KEY")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._headers.update(headers or {})  # sent with every request (a cluster's router: who the caller is)
        if url.startswith("unix:"):
            self._uds: str | None = url[5:]
            self._base = "http://warmbox"
        elif url.startswith(("http://", "https://")):
            self._uds = None
            self._base = url.rstrip("/")
        else:
            raise InvalidArgument(f"api_url must be http(s)://host:port or unix:/path, got {url!r}")
        if isinstance(verify, str):
            ssl.create_default_context(cafile=verify)  # an unreadable CA file fails here, not at the first call
        self._verify = verify
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self.url = url
        # the server's http(s) address (None over a unix socket): what signed file URLs start with
        self.base_url: str | None = None if self._uds is not None else self._base
        self._header_key = tuple(sorted(self._headers.items()))
        self._held: tuple[_LoopSessions, tuple[object, ...]] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    async def _client(self) -> aiohttp.ClientSession:
        """This loop's session to this server with these settings (see _LoopSessions), held by
        this transport until its close()."""
        shared = await _loop_sessions()
        key = (self._uds, self._base, self._verify, self._connect_timeout, self._request_timeout, self._header_key)
        if self._held is None:
            shared.hold(key)
            self._held = (shared, key)
        session = shared.sessions.get(key)
        if session is None or session.closed:
            verify = self._verify
            if isinstance(verify, str):
                verify = ssl.create_default_context(cafile=verify)
            ssl_arg: bool | ssl.SSLContext = verify if not isinstance(verify, bool) or not verify else True
            connector: aiohttp.BaseConnector = (
                aiohttp.UnixConnector(path=self._uds) if self._uds else aiohttp.TCPConnector(ssl=ssl_arg)
            )
            session = shared.sessions[key] = aiohttp.ClientSession(
                base_url=self._base,
                connector=connector,
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(
                    total=self._request_timeout, sock_connect=self._connect_timeout, sock_read=JSON_READ_S
                ),
                auto_decompress=False,
            )
        return session

    # ---- Transport

    async def handle(self, request: ops.Request[R]) -> R:
        route = api.BY_OP[request.op]
        if route.kind == "background":  # off the caller's path, like in process
            t = asyncio.ensure_future(self._send(request))
            self._background.add(t)
            t.add_done_callback(self._background.discard)
            return None  # type: ignore[return-value]
        if route.streamed:
            return await self._write_stream(request)  # type: ignore[return-value]
        return await self._send(request)

    async def _write_stream(self, request: ops.Request[Any]) -> EntryInfo:
        """A streamed upload: an error of the caller's source is raised as itself (aiohttp would
        report it as a broken connection); the server then abandons the write."""
        assert isinstance(request, (ops.WriteFileStream, ops.UploadDir))  # the requests of streamed routes
        failed: list[Exception] = []

        async def body() -> collections.abc.AsyncIterator[bytes]:
            try:
                async for chunk in request.data:
                    yield chunk
            except Exception as e:  # not a cancellation: aiohttp cancels the body when an answer comes early
                failed.append(e)
                raise

        if not isinstance(request.data, collections.abc.AsyncIterator):
            raise InvalidArgument(f"data must be an async iterator of bytes, got {type(request.data).__name__}")
        try:
            return await self._send(dataclasses.replace(request, data=body()))
        except BaseException:
            if failed:
                raise failed[0] from None
            raise

    async def subscribe_approvals(self, sandbox_id: str, hook: Callable[[ApprovalRequest], object]) -> _Subscription:
        if not callable(hook):
            raise InvalidArgument("on_approval must be a callable")
        subscribed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self._approvals(sandbox_id, hook, subscribed))
        try:
            await asyncio.wait_for(asyncio.shield(subscribed), 10)
        except BaseException:
            task.cancel()
            raise
        return _Subscription(task)

    async def close(self) -> None:
        for t in list(self._background):
            try:
                await asyncio.wait_for(t, 2)
            except (TimeoutError, WarmboxError):
                pass
        if self._held is not None:
            held, self._held = self._held, None
            if held[0] is _LOOPS.get(asyncio.get_running_loop()):
                await held[0].release(held[1])

    # ---- requests

    def _build(self, request: ops.Request[Any]) -> tuple[api.Route, dict[str, Any]]:
        return _build(request)

    async def _send(self, request: ops.Request[R]) -> R:
        key = None
        if isinstance(request, (ops.Create, ops.Exec, ops.RunCode, ops.CreateAndRun)):
            key = request.idempotency_key
            if key is None and self._auto_keys:
                key = f"auto-{secrets.token_hex(16)}"
            request = dataclasses.replace(request, idempotency_key=None)  # type: ignore[assignment]
        route, kwargs = self._build(request)
        if key is not None:
            kwargs["headers"] = {**kwargs.get("headers", {}), api.IDEMPOTENCY_HEADER: key}
        url = route.url(request)
        read = _READERS[route.kind]
        attempt = 0
        while True:
            try:
                return await read(self, request, route, url, kwargs, key is not None)  # type: ignore[no-any-return]
            except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError) as e:
                raise ConnectionLost(f"TLS with {self.url} failed: {e} (is its certificate trusted?)") from None
            except aiohttp.ClientConnectorError as e:
                failure: Exception = e  # the request never reached the server: safe to send again
            except _DROPPED as e:
                if not route.idempotent and key is None:
                    raise ConnectionLost(
                        f"the connection to {self.url} dropped during {request.op.value}: "
                        "it may or may not have taken effect"
                    ) from None
                failure = e  # a keyed call sent again gets the first one's result, never a second run
            except (TimeoutError, aiohttp.ServerTimeoutError):
                raise ConnectionLost(f"{self.url} did not answer {request.op.value} in time") from None
            if attempt >= len(RETRIES):
                again = f": repeat it with idempotency_key={key!r} to get its result" if key is not None else ""
                raise ConnectionLost(f"cannot reach the warmbox server at {self.url}: {failure}{again}") from None
            await asyncio.sleep(RETRIES[attempt])
            attempt += 1

    # ---- one reader per route kind (api.KINDS): how its answer is read; _READERS maps them

    async def _json(
        self, request: ops.Request[R], route: api.Route, url: str, kwargs: dict[str, Any], keyed: bool
    ) -> R:
        async with (await self._client()).request(route.method, url, **kwargs) as response:
            body = await response.read()
        if response.status >= 400:
            raise _error(response.status, body)
        try:
            data = json.loads(body)
        except ValueError:
            raise WarmboxError(f"the server sent an unreadable {request.op.value} result") from None
        return wire.decode(wire.result_type(type(request)), data, "result")  # type: ignore[no-any-return]

    async def _nothing(
        self, request: ops.Request[Any], route: api.Route, url: str, kwargs: dict[str, Any], keyed: bool
    ) -> None:
        """detach: the server holds the guest connection, shared by the tenant's clients; nothing
        here to let go."""
        return None

    async def _bytes(
        self, request: ops.Request[Any], route: api.Route, url: str, kwargs: dict[str, Any], keyed: bool
    ) -> bytes:
        """files.read: the whole file."""
        async with (await self._client()).request(route.method, url, **kwargs) as response:
            body = await response.read()
        if response.status >= 400:
            raise _error(response.status, body)
        return body

    async def _transcript(
        self, request: ops.Request[Any], route: api.Route, url: str, kwargs: dict[str, Any], keyed: bool
    ) -> Any:
        """export: NDJSON records, read by warmbox.transcript."""
        async with (await self._client()).request(route.method, url, **kwargs) as response:
            body = await response.read()
        if response.status >= 400:
            raise _error(response.status, body)
        return transcript.loads(body)

    async def _ndjson(
        self, request: ops.Request[R], route: api.Route, url: str, kwargs: dict[str, Any], keyed: bool
    ) -> R:
        """keyed: the request carries an idempotency key; a connection dropped mid-stream is then
        raised as itself, and _send sends it again (the server attaches it to the same run)."""
        async with (await self._client()).request(
            route.method, url, timeout=aiohttp.ClientTimeout(total=None, sock_read=HEARTBEAT_S), **kwargs
        ) as response:
            if response.status >= 400:
                raise _error(response.status, await response.read())
            on_out, on_err = _sinks(request)
            try:
                while line := await _line(response):
                    if not line.strip():
                        continue  # heartbeat
                    msg = json.loads(line)
                    if "result" in msg:
                        return wire.decode(wire.result_type(type(request)), msg["result"], "result")  # type: ignore[no-any-return]
                    if "error" in msg:
                        raise wire.error_from_wire(msg["error"])
                    if "stdout" in msg and on_out is not None:
                        on_out(msg["stdout"])
                    elif "stderr" in msg and on_err is not None:
                        on_err(msg["stderr"])
                    elif (
                        "display" in msg
                        and isinstance(request, (ops.RunCode, ops.CreateAndRun))
                        and request.on_result is not None
                    ):
                        request.on_result(wire.decode(Result, msg["display"], "display"))
                    elif (
                        "progress" in msg and isinstance(request, ops.TemplateBuild) and request.on_progress is not None
                    ):
                        got = request.on_progress(wire.decode(TemplateBuildEvent, msg["progress"], "progress"))
                        if inspect.isawaitable(got):
                            await got
            except _DROPPED as e:
                if keyed:
                    raise
                raise ConnectionLost(
                    f"the connection to {self.url} dropped while {request.op.value} ran ({type(e).__name__}): "
                    "its outcome is unknown; the sandbox itself was not affected"
                ) from None
            except (TimeoutError, aiohttp.ServerTimeoutError) as e:
                raise ConnectionLost(
                    f"the connection to {self.url} dropped while {request.op.value} ran ({type(e).__name__}): "
                    "its outcome is unknown; the sandbox itself was not affected"
                ) from None
            raise ConnectionLost(f"the server ended {request.op.value} without a result: its outcome is unknown")

    async def _follow_response(self, route: api.Route, url: str, kwargs: dict[str, Any]) -> aiohttp.ClientResponse:
        response = await (await self._client()).request(
            route.method, url, timeout=aiohttp.ClientTimeout(total=None, sock_read=HEARTBEAT_S), **kwargs
        )
        if response.status >= 400:
            body = await response.read()
            response.release()
            raise _error(response.status, body)
        return response

    async def _follow(
        self, request: ops.Request[Any], route: api.Route, url: str, kwargs: dict[str, Any], keyed: bool
    ) -> _ProcStream:
        """commands.connect: the process's events, then its result."""
        assert isinstance(request, ops.ConnectProcess)  # the only request of a "follow" route
        return _ProcStream(request.pid, await self._follow_response(route, url, kwargs), self.url)

    async def _start_follow(
        self, request: ops.Request[Any], route: api.Route, url: str, kwargs: dict[str, Any], keyed: bool
    ) -> _ProcStream:
        """commands.start_connect: its pid first (or the error that stopped the start), then as _follow."""
        response = await self._follow_response(route, url, kwargs)
        try:
            first = await _line(response)
            msg = json.loads(first) if first.strip() else None
            if isinstance(msg, dict) and "error" in msg:
                raise wire.error_from_wire(msg["error"])
            if not isinstance(msg, dict) or not isinstance(msg.get("pid"), int):
                raise ConnectionLost(f"the server ended commands.start_connect before its pid: {first[:200]!r}")
        except BaseException:
            response.close()
            raise
        return _ProcStream(msg["pid"], response, self.url)

    async def _watch(
        self, request: ops.Request[Any], route: api.Route, url: str, kwargs: dict[str, Any], keyed: bool
    ) -> _Watch:
        """files.watch_dir: NDJSON events; its first line says it is watching (or the error)."""
        assert isinstance(request, ops.WatchDir)  # the only request of a "watch" route
        if not callable(request.on_event):
            raise InvalidArgument("on_event must be a callable taking a warmbox.FilesystemEvent")
        response = await (await self._client()).request(
            route.method, url, timeout=aiohttp.ClientTimeout(total=None, sock_read=HEARTBEAT_S), **kwargs
        )
        try:
            if response.status >= 400:
                raise _error(response.status, await response.read())
            first = await _line(response)
            if not first.startswith(b'{"watching"'):
                raise ConnectionLost(f"the server ended files.watch_dir before it watched: {first[:200]!r}")
        except BaseException:
            response.close()
            raise
        return _Watch(response, request.on_event, self.url)

    async def _open_stream(
        self, request: ops.Request[Any], route: api.Route, url: str, kwargs: dict[str, Any], keyed: bool
    ) -> _Stream:
        """files.read_stream, files.download_dir: a chunked body (ChunkStream)."""
        assert isinstance(request, (ops.ReadFileStream, ops.DownloadDir))
        response = await (await self._client()).request(route.method, url, **kwargs)
        if response.status >= 400:
            body = await response.read()
            response.release()
            raise _error(response.status, body)
        return _Stream(response.headers.get("X-Warmbox-Path", request.path), response)

    async def _open_tunnel(
        self, request: ops.Request[Any], route: api.Route, url: str, kwargs: dict[str, Any], keyed: bool
    ) -> _Tunnel:
        """ports.connect: a WebSocket (api.TUNNEL_PROTOCOL); its first message says ok or the error."""
        assert isinstance(request, ops.PortConnect)  # the only request of a "tunnel" route
        try:
            ws = await (await self._client()).ws_connect(url, params=kwargs.get("params"), max_msg_size=_WS_MAX)
        except aiohttp.WSServerHandshakeError as e:
            raise WarmboxError(f"the server refused the tunnel (HTTP {e.status}): {e.message}") from None
        try:
            first = await ws.receive(timeout=request.timeout + 30)
            if first.type is not aiohttp.WSMsgType.TEXT:
                raise ConnectionLost(f"the tunnel to port {request.port} closed before it opened")
            data = json.loads(first.data)
            if isinstance(data, dict) and "error" in data:
                raise wire.error_from_wire(data["error"])
            if data != {"ok": True}:
                raise WarmboxError("the server sent an unreadable tunnel answer")
        except BaseException:
            await ws.close()
            raise
        return _Tunnel(ws, request.port, self._background)

    # ---- approvals (not an operation)

    async def _approvals(
        self, sandbox_id: str, hook: Callable[[ApprovalRequest], object], subscribed: asyncio.Future[None]
    ) -> None:
        path = api.APPROVALS.format(sandbox_id=sandbox_id)
        while True:
            try:
                async with (await self._client()).get(
                    path, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=HEARTBEAT_S)
                ) as response:
                    if response.status >= 400:
                        err = _error(response.status, await response.read())
                        if not subscribed.done():
                            subscribed.set_exception(err)
                        return
                    async for line in response.content:
                        if not line.strip():
                            continue
                        msg = json.loads(line)
                        if "subscribed" in msg:
                            if not subscribed.done():
                                subscribed.set_result(None)
                            continue
                        q = ApprovalRequest(sandbox_id, str(msg["host"]), int(msg["port"]), str(msg["kind"]))
                        t = asyncio.ensure_future(self._answer(sandbox_id, str(msg["request_id"]), hook, q))
                        self._background.add(t)
                        t.add_done_callback(self._background.discard)
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.5)  # the server restarted or the stream broke: subscribe again

    async def _answer(
        self, sandbox_id: str, request_id: str, hook: Callable[[ApprovalRequest], object], q: ApprovalRequest
    ) -> None:
        try:
            decision = hook(q)
            if asyncio.iscoroutine(decision) or isinstance(decision, asyncio.Future):
                decision = await decision
        except Exception:
            decision = "deny"
        if decision not in api.DECISIONS:
            decision = "deny"
        path = api.APPROVAL_ANSWER.format(sandbox_id=sandbox_id, request_id=request_id)
        try:
            async with (await self._client()).post(path, json={"decision": decision}) as response:
                await response.read()
        except (aiohttp.ClientError, OSError):
            pass  # unanswered: the proxy denies at its timeout


_Reader = Callable[
    [HttpTransport, ops.Request[Any], api.Route, str, dict[str, Any], bool], collections.abc.Awaitable[Any]
]
# each route kind's reader; "background" is read as JSON (handle sends it off the caller's path)
_READERS: dict[api.Kind, _Reader] = {
    "json": HttpTransport._json,
    "background": HttpTransport._json,
    "detach": HttpTransport._nothing,
    "run": HttpTransport._ndjson,
    "follow": HttpTransport._follow,
    "start_follow": HttpTransport._start_follow,
    "watch": HttpTransport._watch,
    "transcript": HttpTransport._transcript,
    "bytes": HttpTransport._bytes,
    "file_stream": HttpTransport._open_stream,
    "tunnel": HttpTransport._open_tunnel,
}


async def _line(response: aiohttp.ClientResponse) -> bytes:
    """One NDJSON line (b"" at the end). A result line holds a command's whole output (max_output
    is caller-chosen, and JSON escapes may make it six times longer), so aiohttp's default bound of
    512 KiB per line does not apply; MAX_LINE only stops a runaway server."""
    try:
        return await response.content.readline(max_line_length=MAX_LINE)
    except LineTooLong:
        raise WarmboxError(f"the server sent a stream line longer than {MAX_LINE >> 20} MiB") from None


_WS_MAX = 8 << 20  # the largest WebSocket message taken from the server (it sends at most one chunk)
_WS_SEND = 256 << 10  # the largest sent (the server's bound is 1 MiB)


class _Tunnel:
    """ports.connect over a WebSocket (PortStream): binary messages are data, {"eof": true} an end of data."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, port: int, background: set[asyncio.Task[Any]]) -> None:
        self._ws = ws
        self._port = port
        self._background = background
        self._eof = False

    async def read(self) -> bytes | None:
        if self._eof:
            return None
        msg = await self._ws.receive()
        if msg.type is aiohttp.WSMsgType.BINARY:
            return bytes(msg.data)
        if msg.type is aiohttp.WSMsgType.TEXT and msg.data == '{"eof":true}':
            self._eof = True
            return None
        raise ConnectionLost(f"the tunnel to port {self._port} closed before the end of data")

    async def write(self, data: bytes) -> None:
        try:
            for off in range(0, len(data), _WS_SEND):  # the server takes messages of at most 1 MiB
                await self._ws.send_bytes(data[off : off + _WS_SEND])
        except (aiohttp.ClientError, ConnectionError) as e:
            raise ConnectionLost(f"the tunnel to port {self._port} broke: {e}") from None

    async def write_eof(self) -> None:
        try:
            await self._ws.send_str('{"eof":true}')
        except (aiohttp.ClientError, ConnectionError) as e:
            raise ConnectionLost(f"the tunnel to port {self._port} broke: {e}") from None

    def close(self) -> None:
        if not self._ws.closed:
            t = asyncio.ensure_future(self._ws.close())
            self._background.add(t)
            t.add_done_callback(self._background.discard)


__all__ = ["HttpTransport", "default_url"]
