"""The HTTP API: an ASGI app (Starlette) that maps each route of :mod:`warmbox.api` onto one operation.

Every request is authenticated (a bearer key, or the caller's uid on the unix socket), rate limited
per key, decoded strictly by :mod:`warmbox.wire` and handed to that tenant's engine front — the
front scopes every id to its tenant (another tenant's id is "not found") and checks quotas. The
app adds no behaviour of its own: what a route does is what the operation does in process.

Starlette, not FastAPI: the routes are generated from the one list of operations and decoded by the
same codec the client uses, so FastAPI's per-function signatures and its pydantic models would be a
second copy of the models; Starlette also costs less per request (the goal is <= 1 ms added).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import secrets as _secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar, cast

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from warmbox import api, errors, transcript, wire
from warmbox import operations as ops
from warmbox.config import ServerSettings
from warmbox.engine import signing
from warmbox.engine.engine import Engine
from warmbox.engine.front import EngineFront
from warmbox.engine.stats import RegistryStats
from warmbox.errors import Forbidden, InvalidArgument, RateLimited, Unauthenticated, WarmboxError
from warmbox.models import ApprovalRequest, EntryInfo, FilesystemEvent, ProcessEvent, Tenant
from warmbox.server import logs, peer
from warmbox.server import tunnel as ports
from warmbox.server.e2b import Dialect
from warmbox.server.metrics import Exposition
from warmbox.server.streams import raw_body

log = logging.getLogger("warmbox.server")
R = TypeVar("R")
MAX_JSON = 16 << 20  # a JSON body (a command's stdin is the largest thing in one)
HEARTBEAT_S = 15.0  # a blank line on a silent stream this often
PEER_UID = "warmbox.peer_uid"  # ASGI scope key: the caller's uid on the unix socket (SO_PEERCRED), set
# by the server's protocol only; never derived from anything the client sends (headers, addresses)
MAX_OUTPUT = 64 << 20  # the most output one command or cell may return through the server


class BodyTooLarge(InvalidArgument):
    """A request body over its bound: HTTP 413; its code stays ``invalid_argument`` (clients know it)."""


STATUS: tuple[tuple[type[WarmboxError], int], ...] = (
    (BodyTooLarge, 413),
    (errors.Unauthenticated, 401),
    (errors.Forbidden, 403),
    (errors.RateLimited, 429),
    (errors.QuotaExceeded, 429),
    (errors.ApprovalDenied, 403),
    (errors.ApprovalNotFound, 404),
    (errors.ApprovalClosed, 409),
    (errors.FileTooLarge, 413),
    (errors.TemplateNotFound, 404),
    (errors.TemplateInUse, 409),
    (errors.TemplateMismatch, 409),
    (errors.IdempotencyConflict, 409),
    (errors.OutcomeUnknown, 409),
    (errors.ImageRegistryUnreachable, 502),
    (errors.TemplateBuildError, 422),
    (errors.CorruptLayer, 500),
    (errors.VolumeNotFound, 404),
    (errors.VolumeInUse, 409),
    (errors.VolumeElsewhere, 409),
    (errors.UnsafeArchive, 422),
    (errors.LimitTooHigh, 422),
    (errors.InvalidArgument, 400),
    (errors.SandboxNotFound, 404),
    (errors.SandboxLost, 410),
    (errors.PathNotFound, 404),
    (errors.ContextError, 404),
    (errors.PortNotListening, 502),
    (errors.ProcessNotFound, 404),
    (errors.PathExists, 409),
    (errors.SandboxStateError, 409),
    (errors.NotADirectory, 409),
    (errors.IsADirectory, 409),
    (errors.NotARegularFile, 409),
    (errors.PathPermissionDenied, 403),
    (errors.NoSpace, 507),
    (errors.StorageFull, 507),
    (errors.SnapshotUnsupported, 422),
    (errors.Unsupported, 422),
    (errors.SandboxTimeout, 504),
    (errors.BackendUnavailable, 503),
    (errors.NoCapacity, 503),
    (errors.NodeFenced, 503),
    (errors.RegistryBusy, 503),  # a registry lock held past its bound (a stopped node): retry later
    (errors.NoSuitableTier, 422),
    (errors.GuestConnectionError, 502),
    (errors.NodeNotFound, 404),
    (errors.RouteNotFound, 404),  # 405 where the path is known (_not_allowed)
    (errors.DrainRefused, 409),
    (errors.NotACluster, 422),
    (errors.ConnectionLost, 502),  # a cluster's router could not reach (or lost) the node
    (errors.NetworkError, 503),  # the egress proxy could not be reached (e.g. none runs for a no-network sandbox)
)


def status_of(exc: WarmboxError) -> int:
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def error_response(exc: WarmboxError) -> JSONResponse:
    headers = {}
    if isinstance(exc, RateLimited):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    return JSONResponse({"error": wire.error_to_wire(exc)}, status_code=status_of(exc), headers=headers)


class RateLimiter:
    """A token bucket per key: ``rate`` requests/s on average, bursts up to one second's worth (>= 5)."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, key: str, rate: float) -> None:
        if rate <= 0:
            return
        now = time.monotonic()
        burst = max(rate, 5.0)
        tokens, at = self._buckets.get(key, (burst, now))
        tokens = min(burst, tokens + (now - at) * rate)
        if tokens < 1:
            self._buckets[key] = (tokens, now)
            raise RateLimited(f"more than {rate:g} requests/s for this key", retry_after=(1 - tokens) / rate)
        self._buckets[key] = (tokens - 1, now)


@dataclasses.dataclass
class _Pending:
    tenant: str
    sandbox_id: str
    answer: asyncio.Future[str]


class Front(Protocol):
    """What the server runs an operation on: one host's EngineFront, or a cluster's ClusterFront
    (warmbox.cluster.router), which forwards it to the node that should run it."""

    async def handle(self, request: ops.Request[R]) -> R: ...

    async def subscribe_approvals(self, sandbox_id: str, hook: Callable[[ApprovalRequest], object]) -> Any: ...

    async def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Fronts:
    """Where a server's operations run, when not on this host's engine: ``make(tenant)`` builds a
    tenant's front; ``ready()`` is "" when the server can serve, else why not (``/readyz``);
    ``start``/``stop`` run with the app (a cluster's monitor)."""

    make: Callable[[Tenant | None], Front]
    ready: Callable[[], str]
    start: Callable[[], Awaitable[None]]
    stop: Callable[[], Awaitable[None]]


class Service:
    """The state behind the app: the engine, one front per tenant, the limiter, open approvals.

    fronts: a cluster's (the engine then only authenticates: its registry is the cluster's).
    Requests go through a front; the server reads the registry itself only through the stores held
    here by name: ``tenants`` and ``sandboxes`` (whose key or sandbox a request is: the key checks,
    before there is a front) and, for the console's cost and pool pages, ``usage`` and ``pools``."""

    def __init__(self, engine: Engine, settings: ServerSettings, fronts: Fronts | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.fronts = fronts
        self.tenants = engine.registry.tenants  # keys and quotas: authentication
        self.sandboxes = engine.registry.sandboxes  # only a sandbox's tenant (sandbox_tenant)
        self.usage = engine.registry.usage  # the console's cost page and budget badge
        self.pools = engine.registry.pools  # the console's pool charts (their events)
        self.stopping = False  # SIGTERM: /readyz says so while the last requests finish
        self.peers = dict(settings.peers)
        self.approval_timeout_s = engine.settings().network.approval_timeout_s + 1  # the proxy's wait, and a margin
        self.limiter = RateLimiter()
        self.ws_relays = ports.RelaySlots()  # WebSockets relayed to sandbox ports (preview and E2B's)
        # a cluster node: the secret the router presents for requests it forwards (None: no peers)
        token_file = engine.settings().cluster.token_file
        self.peer_token: bytes | None = peer.read_token(token_file).encode() if token_file else None
        # a cluster node's own API (not a router's): it answers the router (the token), admin keys and
        # root on its socket; a tenant's key or mapped uid goes to the router, which places and limits
        cluster = engine.settings().cluster
        self.node_only = "" if fronts is not None or cluster.direct_access else cluster.node
        self._fronts: dict[tuple[str, bool, str], Front] = {}
        self._pending: dict[str, _Pending] = {}
        # /metrics: the registry's aggregates read on a connection of their own, and the HTTP counters
        self.exposition = (
            Exposition(
                RegistryStats(engine.registry.location, bounds=engine.registry.bounds),
                warn_ratio=lambda: engine.settings().approvals.warn_ratio,
            )
            if settings.metrics
            else None
        )

    def front(self, tenant: Tenant | None) -> Front:
        """The front of a tenant (None: the host's root, which sees every sandbox)."""
        # a front per tenant and admin flag (the flag is a key's, not the tenant's); never mutated, so
        # one request's key cannot lend its rights to another's. Quotas are re-read at each start.
        # A cluster's front also tells the node the key's id, so it is one per key there.
        if tenant is None:
            name = ("", True, "")
        else:
            name = (tenant.name, tenant.admin, tenant.key_id if self.fronts is not None else "")
        f = self._fronts.get(name)
        if f is None:
            f = self._fronts[name] = (
                EngineFront(self.engine, tenant=tenant) if self.fronts is None else self.fronts.make(tenant)
            )
        return f

    def ready(self) -> str:
        """ "" when this server can take requests (/readyz), else why not."""
        if self.stopping:
            return "shutting down"
        if self.fronts is not None:
            return self.fronts.ready()
        try:
            self.sandboxes.sandbox_tenant("sb-000000000000")  # one indexed read
        except WarmboxError as e:
            return f"the registry does not answer: {e}"
        return ""

    async def close(self) -> None:
        fronts, self._fronts = self._fronts, {}
        for f in fronts.values():
            await f.close()
        if self.exposition is not None:
            self.exposition.close()

    def authenticate_secret(self, secret: str) -> Tenant:
        """The tenant of a live API key's secret, rate limited per key; Unauthenticated otherwise."""
        tenant = self.tenants.authenticate(secret)
        if tenant is None:
            raise Unauthenticated("unknown or revoked API key")
        return self._admit(tenant, tenant.key_id or tenant.name)

    def sandbox_key_ids(self, sandbox_id: str) -> list[str]:
        """The live API keys of the tenant a sandbox belongs to (none for an unknown sandbox or one
        of the host's): whose access tokens may have signed an E2B file URL for it."""
        tenant = self.sandboxes.sandbox_tenant(sandbox_id)
        if not tenant:
            return []
        return [k.key_id for k in self.tenants.list_keys() if k.tenant == tenant and not k.revoked_at]

    @functools.cached_property
    def signer(self) -> signing.Signer:
        """Access tokens and signed file URLs, under the registry's signing key (a cluster's router
        and nodes share it: the router checks what a node signed)."""
        return signing.Signer(signing.registry_key(self.engine.registry))

    def authenticate_signer(self, signer: str) -> Tenant | None:
        """The caller a signed URL acts for (its ``signer``: an API key's id, refused once revoked;
        ``~<tenant>``, a caller without a key; ``~``, the host's root), rate limited as that caller."""
        if not signer.startswith(signing.ROOT_SIGNER):
            return self.authenticate_key_id(signer)
        name = signer[len(signing.ROOT_SIGNER) :]
        if not name:
            logs.note_tenant("")
            return None
        try:
            tenant = self.tenants.tenant(name)
        except InvalidArgument:  # no quotas recorded for it: unlimited, as a mapped uid's tenant
            tenant = Tenant(name=name)
        return self._admit(tenant, signer)

    def authenticate_key_id(self, key_id: str) -> Tenant:
        """What :meth:`authenticate_secret` answers for the key with this id (the console's
        sessions hold a key's id, never its secret): a revoked key is refused at once."""
        tenant = self.tenants.key_tenant(key_id)
        if tenant is None:
            raise Unauthenticated("the API key this session was opened with is revoked or unknown")
        return self._admit(tenant, tenant.key_id or tenant.name)

    def _admit(self, tenant: Tenant, bucket: str) -> Tenant:
        """An authenticated caller: named in this request's log records, and rate limited per
        ``bucket`` (its key, or its uid on the unix socket)."""
        logs.note_tenant(tenant.name)
        if self.node_only and not tenant.admin:
            raise Forbidden(
                f"this is cluster node {self.node_only!r}: tenant keys go to the cluster's router (its API "
                "answers only the router and admin keys, unless [cluster] direct_access = true)"
            )
        self.limiter.take(bucket, tenant.rate_per_s)
        return tenant

    def authenticate_peer(self, request: HTTPConnection, secret: str) -> Tenant | None:
        """A request a cluster peer (the router) forwards: the cluster token, and the tenant it
        authenticated in ``X-Warmbox-Tenant`` (absent: the host's root). Not rate limited here:
        the router limited the caller's own key. Unauthenticated without a configured token or
        with another secret."""
        if self.peer_token is None:
            raise Unauthenticated("cluster peer headers are refused: this server has no [cluster] token_file")
        if not hmac.compare_digest(secret.encode(), self.peer_token):
            raise Unauthenticated("cluster peer headers need the cluster token as the bearer key")
        name = request.headers.get(peer.TENANT)
        if name is None:
            logs.note_tenant("")
            return None
        if not peer.TENANT_NAME.match(name):
            raise Unauthenticated(f"{peer.TENANT} must name a tenant (letters, digits, '_', '.', '@', '-')")
        try:
            tenant = self.tenants.tenant(name)
        except InvalidArgument:  # no quotas recorded for it: unlimited, as a mapped uid's tenant
            tenant = Tenant(name=name)
        admin = request.headers.get(peer.ADMIN, "") == "1"
        key_id = request.headers.get(peer.KEY_ID, "")
        logs.note_tenant(tenant.name)
        return dataclasses.replace(tenant, admin=admin, key_id=key_id)

    def authenticate(self, request: HTTPConnection) -> Tenant | None:
        """The caller's tenant (None: root on the unix socket or a cluster peer without a
        tenant); Unauthenticated otherwise."""
        header = request.headers.get("authorization", "")
        if header:
            scheme, _, secret = header.partition(" ")
            if scheme.lower() != "bearer" or not secret.strip():
                raise Unauthenticated("the Authorization header must be 'Bearer <key>'")
            secret = secret.strip()
            if self.peer_token is not None and hmac.compare_digest(secret.encode(), self.peer_token):
                return self.authenticate_peer(request, secret)
            if any(h in request.headers for h in peer.HEADERS):
                return self.authenticate_peer(request, secret)  # refused: only the token may carry them
            return self.authenticate_secret(secret)
        if any(h in request.headers for h in peer.HEADERS):
            raise Unauthenticated("cluster peer headers need the cluster token as the bearer key")
        uid = request.scope.get(PEER_UID)
        if isinstance(uid, int):
            if uid == 0:
                logs.note_tenant("")
                return None
            name = self.peers.get(uid)
            if name is not None:
                try:
                    tenant = self.tenants.tenant(name)
                except InvalidArgument:  # mapped in [server] peers but never given quotas: unlimited
                    tenant = Tenant(name=name)
                return self._admit(tenant, f"uid:{uid}")
            raise Unauthenticated(f"uid {uid} is not mapped to a tenant ([server] peers) and sent no key")
        raise Unauthenticated("an API key is required: 'Authorization: Bearer <key>'")


# ---- decoding


def _query_value(tp: Any, text: str, where: str) -> object:
    """A query-string value as JSON-ish data for the codec (numbers and booleans parsed)."""
    import typing

    args = typing.get_args(tp) or (tp,)
    if text in ("", "null") and type(None) in args:
        return None
    if any(dataclasses.is_dataclass(a) for a in args):  # a record (list's query) is one JSON value
        try:
            return wire.loads(text)
        except InvalidArgument:
            return text  # the codec refuses it, naming the field
    if bool in args:
        if text in ("true", "1"):
            return True
        if text in ("false", "0"):
            return False
    if int in args or float in args:
        try:
            return int(text)
        except ValueError:
            try:
                return float(text)
            except ValueError:
                pass
    return text


async def _body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, at most ``limit`` bytes, arriving within ``timeout_s``; typed errors otherwise."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {int(declared)} bytes is larger than the limit of {limit} bytes")
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"request body is larger than the limit of {limit} bytes")
                parts.append(chunk)
    except TimeoutError:
        raise InvalidArgument(f"request body did not arrive within {timeout_s:g} s") from None
    return b"".join(parts)


def _query_fields(route: api.Route, conn: HTTPConnection) -> dict[str, object]:
    hints = wire.hints(ops.REQUESTS[route.op])
    data: dict[str, object] = {}
    for k, v in conn.query_params.multi_items():
        if k in data:
            raise InvalidArgument(f"query parameter {k!r} given twice")
        if k == "stream" and route.response == "ndjson":
            continue
        data[k] = _query_value(hints.get(k, str), v, k)
    return data


async def _body_chunks(request: Request, timeout_s: float) -> AsyncIterator[bytes]:
    """The body as it arrives, one received piece at a time (the server's transport stops reading
    while a piece waits: the sandbox's pace reaches the client); each must come within ``timeout_s``."""
    pieces = request.stream().__aiter__()
    while True:
        try:
            async with asyncio.timeout(timeout_s):
                chunk = await anext(pieces)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise InvalidArgument(f"the request body stalled: nothing arrived for {timeout_s:g} s") from None
        if chunk:
            yield chunk


async def decode_request(route: api.Route, request: Request, settings: ServerSettings) -> ops.Request[Any]:
    cls = ops.REQUESTS[route.op]
    given = dict(request.path_params)
    data: dict[str, object] = {}
    if route.body in ("query", "raw"):
        data = _query_fields(route, request)
    if route.body == "raw":
        if route.streamed:  # into the sandbox as it arrives, never held whole
            data["data"] = _body_chunks(request, settings.body_timeout_s)
        else:
            data["data"] = await _body(request, settings.max_body_mb << 20, settings.body_timeout_s)
        if "data" in request.query_params:
            raise InvalidArgument("the file's bytes are the request body, not a query parameter")
    elif route.body == "json":
        raw = await _body(request, MAX_JSON, settings.body_timeout_s)
        if raw.strip():
            body = wire.loads(raw)
            if not isinstance(body, dict):
                raise InvalidArgument("the request body must be a JSON object")
            data = body
        for k in request.query_params:
            if k != "stream" or route.response != "ndjson":
                raise InvalidArgument(f"unknown query parameter {k!r} (this route takes a JSON body)")
    if route.body == "raw":
        payload = data.pop("data")
        req = wire.decode_record(cls, data, "query", **given, data=payload)
    else:
        req = wire.decode_record(cls, data, "body" if route.body == "json" else "query", **given)
    req = _keyed(req, request.headers.get(api.IDEMPOTENCY_HEADER))
    ops.check_text(req)  # a lone surrogate (a JSON "\ud800" escape) anywhere: refused before the front
    return _bound(_adapt(req), settings)


def _keyed(req: ops.Request[Any], header: str | None) -> ops.Request[Any]:
    """The ``Idempotency-Key`` header as the request's idempotency_key (a body field gives the
    same; the two differing is refused). Only a create, a command and a code run take one."""
    if header is None:
        return req
    if not isinstance(req, (ops.Create, ops.Exec, ops.RunCode, ops.CreateAndRun)):
        raise InvalidArgument(
            f"{req.op.value} takes no {api.IDEMPOTENCY_HEADER} (a create, a command or a code run does)"
        )
    if req.idempotency_key is not None and req.idempotency_key != header:
        raise InvalidArgument(f"the {api.IDEMPOTENCY_HEADER} header and the body's idempotency_key differ")
    return dataclasses.replace(req, idempotency_key=header)


def _bound(req: ops.Request[Any], settings: ServerSettings) -> ops.Request[Any]:
    """What the server holds in memory for one request is bounded whatever the client asks: a
    command's output is cut at MAX_OUTPUT (``truncated``), a whole-file read at max_body_mb
    (``FileTooLarge`` beyond; files/stream is never held whole)."""
    if (
        isinstance(req, (ops.Exec, ops.RunCode, ops.CreateAndRun))
        and isinstance(req.max_output, int)
        and req.max_output > MAX_OUTPUT
    ):
        return dataclasses.replace(req, max_output=MAX_OUTPUT)
    cap = settings.max_body_mb << 20
    if isinstance(req, ops.ReadFile) and isinstance(req.max_bytes, int) and req.max_bytes > cap:
        return dataclasses.replace(req, max_bytes=cap)
    return req


def _adapt(req: ops.Request[Any]) -> ops.Request[Any]:
    """Wire forms of the fields typed ``Any`` in the operations (secrets)."""
    if isinstance(req, ops.CreateAndRun) and isinstance(req.create, ops.Create):
        return dataclasses.replace(req, create=cast(ops.Create, _adapt(req.create)))
    if isinstance(req, (ops.Create, ops.Resume)) and req.secrets is not None:
        from warmbox.network.policy import Secret

        # a value alone (a resume or fork: the hosts recorded with the sandbox) stays a string
        sec: dict[str, Any] = {
            str(k): v if isinstance(v, str) else wire.decode_record(Secret, v, f"secrets[{k!r}]")
            for k, v in req.secrets.items()
        }
        req = dataclasses.replace(req, secrets=sec)
    return req


# ---- responses


def _json(value: object) -> Response:
    return Response(json.dumps(wire.encode(value), separators=(",", ":")), media_type="application/json")


def _line(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


async def _next(queue: asyncio.Queue[tuple[str, object]]) -> tuple[str, object]:
    """The next event of a run, or a heartbeat after HEARTBEAT_S of silence."""
    try:
        async with asyncio.timeout(HEARTBEAT_S):
            return await queue.get()
    except TimeoutError:
        return ("heartbeat", None)


# ---- one answer per route kind (api.KINDS); ANSWERS maps them


async def _answer_json(front: Front, req: ops.Request[Any], request: Request) -> Response:
    return _json(await front.handle(req))


async def _detach(front: Front, req: ops.Request[Any], request: Request) -> Response:
    """The guest connection is the server's, shared by the tenant's clients: nothing to let go,
    but the same checks and errors as any id."""
    assert isinstance(req, ops.Detach)
    await front.handle(ops.Info(req.sandbox_id))
    return _json(None)


async def _bytes(front: Front, req: ops.Request[Any], request: Request) -> Response:
    return Response(await front.handle(req), media_type="application/octet-stream")


async def _transcript(front: Front, req: ops.Request[Any], request: Request) -> Response:
    """NDJSON records (warmbox.transcript), not a run's stream."""
    return Response(transcript.dumps(await front.handle(req)), media_type="application/x-ndjson")


async def _tunnel_get(front: Front, req: ops.Request[Any], request: Request) -> Response:
    """A WebSocket (tunnel_endpoint): a plain GET only gets the checks and errors."""
    assert isinstance(req, ops.PortConnect)
    await front.handle(ops.Info(req.sandbox_id))
    raise InvalidArgument(f"ports.connect is a WebSocket upgrade on this route: {api.TUNNEL_PROTOCOL}")


async def _run(front: Front, req: ops.Request[Any], request: Request) -> Response:
    return await _ndjson(front, req, request.query_params.get("stream") in ("1", "true"))


async def _ndjson(front: Front, req: ops.Request[Any], stream: bool) -> Response:
    """A command or code run: output events while it runs (when asked), then its result or error.
    Errors before anything was sent are a plain error response with the right status."""
    assert isinstance(req, (ops.Exec, ops.RunCode, ops.CreateAndRun, ops.TemplateBuild))
    queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
    if stream and isinstance(req, ops.TemplateBuild):
        req = dataclasses.replace(req, on_progress=lambda ev: queue.put_nowait(("progress", wire.encode(ev))))
    elif stream:
        assert isinstance(req, (ops.Exec, ops.RunCode, ops.CreateAndRun))
        req = dataclasses.replace(
            req,
            on_stdout=lambda s: queue.put_nowait(("stdout", s)),
            on_stderr=lambda s: queue.put_nowait(("stderr", s)),
        )
        if isinstance(req, (ops.RunCode, ops.CreateAndRun)):
            req = dataclasses.replace(req, on_result=lambda r: queue.put_nowait(("display", wire.encode(r))))
    run: ops.Request[Any] = req
    task = asyncio.ensure_future(front.handle(run))
    task.add_done_callback(lambda _: queue.put_nowait(("done", None)))
    first: tuple[str, object] = ("heartbeat", None)
    try:
        if stream:
            first = await _next(queue)
        else:
            await asyncio.wait({task}, timeout=HEARTBEAT_S)
            if task.done():
                first = queue.get_nowait()
    except BaseException:
        task.cancel()
        raise
    if first[0] == "done":
        exc = task.exception()
        if exc is not None:
            if isinstance(exc, WarmboxError):
                return error_response(exc)
            raise exc
        return Response(_line({"result": wire.encode(task.result())}), media_type="application/x-ndjson")

    async def lines() -> AsyncIterator[bytes]:
        item = first
        try:
            while True:
                kind, value = item
                if kind == "done":
                    exc = task.exception()
                    if exc is None:
                        yield _line({"result": wire.encode(task.result())})
                    elif isinstance(exc, WarmboxError):
                        yield _line({"error": wire.error_to_wire(exc)})
                    else:
                        log.error("operation failed", exc_info=exc)
                        yield _line({"error": {"code": "warmbox_error", "message": "internal error"}})
                    return
                yield b"\n" if kind == "heartbeat" else _line({kind: value})  # blank: the server lives
                item = await _next(queue)
        finally:
            if not task.done():  # the client went away: stop the command in the sandbox
                task.cancel()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def _file_stream(front: Front, req: ops.Request[Any], request: Request) -> Response:
    assert isinstance(req, (ops.ReadFileStream, ops.DownloadDir))
    return await _stream_file(front, req)


async def _stream_file(front: Front, req: ops.ReadFileStream | ops.DownloadDir) -> Response:
    """A file as a chunked raw body. Errors before the first byte are error responses; an error
    after it ends the connection without the closing chunk, so no client takes it as complete."""
    stream = await front.handle(req)
    body = await raw_body(stream)
    return StreamingResponse(body, media_type="application/octet-stream", headers={"X-Warmbox-Path": stream.path})


def _event_line(ev: ProcessEvent) -> bytes:
    if ev.kind == "lost":
        return _line({"lost": ev.size})
    if ev.kind == "pty":
        return _line({"pty": wire.encode(ev.data)})
    return _line({ev.kind: ev.text})


async def _follow(front: Front, req: ops.Request[Any], request: Request) -> Response:
    assert isinstance(req, ops.ConnectProcess)
    return await _stream_process(front, req, pid_first=False)


async def _start_follow(front: Front, req: ops.Request[Any], request: Request) -> Response:
    assert isinstance(req, ops.StartAndConnect)
    return await _stream_process(front, req, pid_first=True)


async def _stream_process(front: Front, req: ops.ConnectProcess | ops.StartAndConnect, pid_first: bool) -> Response:
    """A background process's output as NDJSON events ({"stdout"|"stderr": text}, {"pty": base64},
    {"lost": bytes}), blank heartbeat lines, then {"result": CommandResult} or {"error": ...}; a
    start's first line is {"pid": int} (pid_first). The process is not touched when the client goes away."""
    stream = await front.handle(req)
    queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue(maxsize=64)  # a slow client slows the reads

    async def pump() -> None:
        try:
            while (ev := await stream.next()) is not None:
                await queue.put(("event", ev))
            await queue.put(("done", stream.result))
        except WarmboxError as e:
            await queue.put(("error", e))

    task = asyncio.ensure_future(pump())

    async def lines() -> AsyncIterator[bytes]:
        try:
            if pid_first:
                yield _line({"pid": stream.pid})
            while True:
                kind, value = await _next(queue)
                if kind == "heartbeat":
                    yield b"\n"
                elif kind == "event":
                    assert isinstance(value, ProcessEvent)
                    yield _event_line(value)
                elif kind == "done":
                    yield _line({"result": wire.encode(value)})
                    return
                else:
                    assert isinstance(value, WarmboxError)
                    yield _line({"error": wire.error_to_wire(value)})
                    return
        finally:
            task.cancel()
            stream.cancel()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def _watch(front: Front, req: ops.Request[Any], request: Request) -> Response:
    """A directory watch as NDJSON: {"watching": path}, then {"event": FilesystemEvent} lines and
    blank heartbeats, then {"end": null} when the directory goes or {"error": ...}. A slow client
    slows the watch (the bounded queue holds back the acks; the sandbox's kernel drops a flood)."""
    assert isinstance(req, ops.WatchDir)
    queue: asyncio.Queue[FilesystemEvent] = asyncio.Queue(maxsize=64)
    watch = await front.handle(dataclasses.replace(req, on_event=queue.put))  # typed errors: a plain answer

    async def lines() -> AsyncIterator[bytes]:
        ended = asyncio.ensure_future(watch.wait())
        try:
            yield _line({"watching": req.path})
            while True:
                got = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({got, ended}, timeout=HEARTBEAT_S, return_when=asyncio.FIRST_COMPLETED)
                if got in done:
                    yield _line({"event": wire.encode(got.result())})
                    continue
                got.cancel()
                if ended not in done:
                    yield b"\n"  # heartbeat: the client knows the server lives
                    continue
                while not queue.empty():
                    yield _line({"event": wire.encode(queue.get_nowait())})
                exc = ended.exception()
                if isinstance(exc, WarmboxError):
                    yield _line({"error": wire.error_to_wire(exc)})
                elif exc is not None:
                    log.error("watch failed", exc_info=exc)
                    yield _line({"error": {"code": "warmbox_error", "message": "internal error"}})
                else:
                    yield _line({"end": None})
                return
        finally:
            watch.stop()  # the client went away, or the watch is over
            ended.cancel()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


_Answer = Callable[[Front, ops.Request[Any], Request], Awaitable[Response]]
# each route kind's answer; a "background" one is plain JSON (its client does not wait for it)
ANSWERS: dict[api.Kind, _Answer] = {
    "json": _answer_json,
    "background": _answer_json,
    "detach": _detach,
    "run": _run,
    "follow": _follow,
    "start_follow": _start_follow,
    "watch": _watch,
    "transcript": _transcript,
    "bytes": _bytes,
    "file_stream": _file_stream,
    "tunnel": _tunnel_get,
}


def endpoint(service: Service, route: api.Route) -> Callable[[Request], Awaitable[Response]]:
    answer = ANSWERS[route.kind]

    async def handle(request: Request) -> Response:
        try:
            front = service.front(service.authenticate(request))
            req = await decode_request(route, request, service.settings)
            return await answer(front, req, request)
        except WarmboxError as e:
            return error_response(e)
        except ClientDisconnect:
            return Response(status_code=400)

    handle.__name__ = route.op.name.lower()
    return handle


# ---- ports: the WebSocket of ports.connect, and the HTTP preview (not an operation)


def tunnel_endpoint(service: Service) -> Callable[[WebSocket], Awaitable[None]]:
    route = api.BY_OP[ops.Op.PORTS_CONNECT]

    async def tunnel(ws: WebSocket) -> None:
        await ws.accept()
        try:
            front = service.front(service.authenticate(ws))
            req = wire.decode_record(ops.PortConnect, _query_fields(route, ws), "query", **ws.path_params)
            stream = await front.handle(req)
        except WarmboxError as e:
            await ws.send_text(ports.error_message(wire.error_to_wire(e)))
            await ws.close()
            return
        await ws.send_text(ports.OK)
        await ports.relay_websocket(ws, stream)

    return tunnel


def preview_endpoint(service: Service) -> Callable[[Request], Awaitable[Response]]:
    async def proxy(request: Request) -> Response:
        try:
            front = service.front(service.authenticate(request))
            sandbox_id = request.path_params["sandbox_id"]
            port = request.path_params["port"]
            await front.handle(ops.Info(sandbox_id))  # scoped first: another tenant's id is not found
            body = await _body(request, service.settings.max_body_mb << 20, service.settings.body_timeout_s)
            stream = await front.handle(ops.PortConnect(sandbox_id, port))
            return await ports.preview(request, stream, port, request.path_params.get("path", ""), body)
        except WarmboxError as e:
            return error_response(e)
        except ClientDisconnect:
            return Response(status_code=400)

    return proxy


# ---- signed file URLs (files.sign_url's): the signature is the credential, no API key


def signed_file_endpoint(service: Service) -> Callable[[Request], Awaitable[Response]]:
    async def signed(request: Request) -> Response:
        try:
            sandbox_id = request.path_params["sandbox_id"]
            q = request.query_params
            for name in q:
                if name not in _SIGNED_QUERY or len(q.getlist(name)) > 1:
                    raise InvalidArgument(f"a signed URL takes {', '.join(_SIGNED_QUERY)} once each, not {name!r}")
            at = signing.expiration(q.get("signature_expiration"))
            if at is None:
                raise Unauthenticated("a signed URL of warmbox's carries its expiry (signature_expiration)")
            path, user, signer = q.get("path", ""), q.get("username", ""), q.get("signer", "")
            operation = "read" if request.method == "GET" else "write"
            service.signer.check_file([signer], sandbox_id, path, operation, user, at, q.get("signature", ""))
            front = service.front(service.authenticate_signer(signer))
            if operation == "read":
                return await _stream_file(front, ops.ReadFileStream(sandbox_id, path))
            chunks = _body_chunks(request, service.settings.body_timeout_s)
            written: EntryInfo = await front.handle(ops.WriteFileStream(sandbox_id, path, chunks))
            return _json(written)
        except WarmboxError as e:
            return error_response(e)
        except ClientDisconnect:
            return Response(status_code=400)

    return signed


_SIGNED_QUERY = ("path", "username", "signer", "signature_expiration", "signature")


def preview_websocket_endpoint(service: Service) -> Callable[[WebSocket], Awaitable[None]]:
    """A WebSocket upgrade on the preview's route: relayed to the sandbox's server (its messages
    bounded: :func:`warmbox.server.tunnel.relay_upgrade`) after the same checks as the preview."""

    async def upgrade(ws: WebSocket) -> None:
        try:
            front = service.front(service.authenticate(ws))
            sandbox_id = ws.path_params["sandbox_id"]
            port = ws.path_params["port"]
            await front.handle(ops.Info(sandbox_id))  # scoped first: another tenant's id is not found
            service.ws_relays.take(sandbox_id)
        except WarmboxError as e:
            await ports.deny(ws, error_response(e))
            return
        try:
            try:
                stream = await front.handle(ops.PortConnect(sandbox_id, port))
            except WarmboxError as e:
                await ports.deny(ws, error_response(e))
                return
            await ports.relay_upgrade(ws, stream, port, ws.path_params.get("path", ""))
        finally:
            service.ws_relays.give(sandbox_id)

    return upgrade


# ---- approvals (not operations: a stream of questions, one answer each)


def approvals_endpoint(service: Service) -> Callable[[Request], Awaitable[Response]]:
    async def questions(request: Request) -> Response:
        try:
            tenant = service.authenticate(request)
            front = service.front(tenant)
            sandbox_id = request.path_params["sandbox_id"]
            await front.handle(ops.Info(sandbox_id))  # scoped: another tenant's id is not found
        except WarmboxError as e:
            return error_response(e)
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        owner = "" if tenant is None else tenant.name

        async def hook(q: ApprovalRequest) -> str:
            request_id = _secrets.token_urlsafe(12)
            fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            service._pending[request_id] = _Pending(owner, sandbox_id, fut)
            try:
                queue.put_nowait(_line({"request_id": request_id, **wire.encode(q)}))
                # the proxy stops waiting at its own timeout: so does the question here
                return await asyncio.wait_for(fut, service.approval_timeout_s)
            except TimeoutError:
                return "deny"
            finally:
                service._pending.pop(request_id, None)

        try:
            sub = await front.subscribe_approvals(sandbox_id, hook)
        except WarmboxError as e:
            return error_response(e)

        async def lines() -> AsyncIterator[bytes]:
            try:
                yield _line({"subscribed": sandbox_id})
                while True:
                    try:
                        yield await asyncio.wait_for(queue.get(), HEARTBEAT_S)
                    except TimeoutError:
                        yield b"\n"  # keep-alive: a dead client is noticed
            finally:
                sub.cancel()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return questions


def answer_endpoint(service: Service) -> Callable[[Request], Awaitable[Response]]:
    async def answer(request: Request) -> Response:
        try:
            tenant = service.authenticate(request)
            owner = "" if tenant is None else tenant.name
            raw = await _body(request, 4096, service.settings.body_timeout_s)
            body = wire.loads(raw or b"{}")
            decision = body.get("decision") if isinstance(body, dict) else None
            if decision not in api.DECISIONS:
                raise InvalidArgument(f"decision must be one of {list(api.DECISIONS)}, got {decision!r}")
            p = service._pending.get(request.path_params["request_id"])
            if p is None or p.sandbox_id != request.path_params["sandbox_id"] or p.tenant != owner:
                raise InvalidArgument("no open approval question with that id (answered, timed out or unknown)")
            if not p.answer.done():
                p.answer.set_result(decision)
            return _json(None)
        except WarmboxError as e:
            return error_response(e)

    return answer


# ---- MCP at /mcp: the same tools as `warmbox mcp`, on the authenticated tenant's front

TENANT_KEY = "warmbox.tenant"  # the ASGI scope key where _Authenticated puts the caller's tenant


class FrontTransport:
    """A tenant's engine front as a Transport (what the server's MCP tools run on)."""

    def __init__(self, front: Front) -> None:
        self.front = front

    async def handle(self, request: ops.Request[Any]) -> Any:
        return await self.front.handle(request)

    async def subscribe_approvals(self, sandbox_id: str, hook: Callable[[ApprovalRequest], object]) -> Any:
        return await self.front.subscribe_approvals(sandbox_id, hook)

    async def close(self) -> None:
        pass  # the front is the server's, shared by the tenant's requests


class _Authenticated:
    """Authenticates every HTTP request to a mounted app (MCP) like the /v1 routes, and puts the
    tenant into the scope; refusals are the API's typed errors."""

    def __init__(self, service: Service, app: ASGIApp) -> None:
        self.service = service
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                scope[TENANT_KEY] = self.service.authenticate(Request(scope))
            except WarmboxError as e:
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _mcp(service: Service) -> tuple[BaseRoute, Callable[[], contextlib.AbstractAsyncContextManager[Any]]]:
    from mcp.server.transport_security import TransportSecuritySettings

    from warmbox.server.mcp import build_mcp, http_request_of

    def transport_for(ctx: Any) -> FrontTransport:
        request = http_request_of(ctx)
        if request is None or TENANT_KEY not in request.scope:
            raise Unauthenticated("an MCP call over HTTP must come through the authenticated /mcp route")
        return FrontTransport(service.front(request.scope[TENANT_KEY]))

    server = build_mcp(transport_for)
    app = server.streamable_http_app(
        streamable_http_path="/",
        stateless_http=True,
        json_response=True,
        max_request_body_size=MAX_JSON,
        # Host-header checks guard unauthenticated local servers against DNS rebinding; every
        # request here carries a key (a browser cannot add one cross-origin) or comes over the
        # unix socket, and a real host name must work behind TLS.
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    return Mount("/mcp", app=_Authenticated(service, app)), server.session_manager.run


# ---- the app


def routes(service: Service) -> list[BaseRoute]:
    out: list[BaseRoute] = [Route(r.path, endpoint(service, r), methods=[r.method]) for r in api.ROUTES]
    out.append(WebSocketRoute(api.BY_OP[ops.Op.PORTS_CONNECT].path, tunnel_endpoint(service)))
    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    out.append(Route(api.PREVIEW, preview_endpoint(service), methods=methods))
    out.append(Route(api.PREVIEW_ROOT, preview_endpoint(service), methods=methods))
    out.append(WebSocketRoute(api.PREVIEW, preview_websocket_endpoint(service)))
    out.append(WebSocketRoute(api.PREVIEW_ROOT, preview_websocket_endpoint(service)))
    out.append(Route(api.SIGNED_FILE, signed_file_endpoint(service), methods=["GET", "PUT", "POST"]))
    out.append(Route(api.APPROVALS, approvals_endpoint(service), methods=["GET"]))
    out.append(Route(api.APPROVAL_ANSWER, answer_endpoint(service), methods=["POST"]))
    out.append(Route(f"{api.PREFIX}/openapi.json", _openapi, methods=["GET"]))
    out.append(Route(api.HEALTHZ, _healthz, methods=["GET"]))
    out.append(Route(api.READYZ, readyz_endpoint(service), methods=["GET"]))
    if service.exposition is not None:
        out.append(Route(api.METRICS, metrics_endpoint(service), methods=["GET"]))
    return out


def metrics_endpoint(service: Service) -> Callable[[Request], Awaitable[Response]]:
    """GET /metrics: every family for root and admin keys, a tenant's own series for its key (see
    server/metrics.py). The registry's aggregates run in a worker thread, off the event loop."""
    exposition = service.exposition
    assert exposition is not None

    async def scrape(request: Request) -> Response:
        try:
            tenant = service.authenticate(request)
        except WarmboxError as e:
            return error_response(e)
        body, content_type = await asyncio.to_thread(exposition.render, tenant, request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    return scrape


# ---- health (no key: what a load balancer or an orchestrator probes; they say nothing about tenants)


async def _healthz(request: Request) -> Response:
    """GET /healthz: the process serves requests (its event loop turns)."""
    return JSONResponse({"ok": True})


def readyz_endpoint(service: Service) -> Callable[[Request], Awaitable[Response]]:
    """GET /readyz: 200 when requests can be served (the registry answers; a cluster's router: and
    a node is up), else 503 with the reason; 503 from SIGTERM on, while the last requests finish.
    A warmbox.toml broken since the server read it is ``config_error`` in the 200: it serves on
    the last good settings. Anyone may ask, so it says where the reason is, not the reason (it
    holds a host path, and may quote a value)."""

    async def readyz(request: Request) -> Response:
        why = await asyncio.to_thread(service.ready)
        if why:
            return JSONResponse({"ok": False, "reason": why}, status_code=503)
        body: dict[str, object] = {"ok": True}
        if await asyncio.to_thread(service.engine.config_error):  # still serving, on the last good settings
            body["config_error"] = (
                "the settings file changed and cannot be used: serving on the last good settings "
                "(why: the server's log, or warmbox config on its host)"
            )
        return JSONResponse(body)

    return readyz


async def _openapi(request: Request) -> Response:
    from warmbox.server.openapi import document

    return JSONResponse(document())


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(errors.RouteNotFound(f"no route {request.method} {request.url.path}"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    e = errors.RouteNotFound(f"{request.method} is not allowed on {request.url.path}")
    return JSONResponse({"error": wire.error_to_wire(e)}, status_code=405)


async def _internal(request: Request, exc: Exception) -> Response:
    # only reached without RequestLog (which logs the error with the request's id and answers 500)
    log.error("unhandled error on %s", logs.route_template(request.scope), exc_info=exc)
    return JSONResponse({"error": {"code": "warmbox_error", "message": "internal server error"}}, status_code=500)


def build_app(
    engine: Engine, settings: ServerSettings, *, mcp: bool = True, console: bool = True, fronts: Fronts | None = None
) -> Starlette:
    """The ASGI app over ``engine``: the /v1 routes, MCP (streamable HTTP) at /mcp, and the
    operator's console at /ui/ (``/`` redirects there). fronts: a cluster's (the operations run on
    its nodes; ``engine`` only authenticates, on the cluster's registry)."""
    service = Service(engine, settings, fronts)
    extra: list[BaseRoute] = []
    if console:
        from warmbox.server import console as web_console

        extra.extend(web_console.routes(service))
    mcp_running: Callable[[], contextlib.AbstractAsyncContextManager[Any]] | None = None
    if mcp:
        mount, mcp_running = _mcp(service)
        extra.append(mount)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if fronts is not None:
            await fronts.start()
        try:
            if mcp_running is not None:
                async with mcp_running():  # a mounted app's own lifespan does not run
                    yield
            else:
                yield
        finally:
            await service.close()
            if fronts is not None:
                await fronts.stop()

    app = Starlette(
        routes=routes(service) + extra,
        exception_handlers={404: _not_found, 405: _not_allowed, 500: _internal},
        lifespan=lifespan,
        # request ids, the access record and the HTTP metrics of every request; then E2B's wire dialect
        # (warmbox.server.e2b: its control plane and sandbox data planes, on the tenant fronts)
        middleware=[
            Middleware(logs.RequestLog, metrics=service.exposition.http if service.exposition else None),
            Middleware(Dialect, service=service, max_body_mb=settings.max_body_mb),
        ],
    )
    app.state.service = service
    return app


__all__ = ["PEER_UID", "Front", "FrontTransport", "Fronts", "RateLimiter", "Service", "build_app", "status_of"]
