"""E2B's control plane (REST, JSON; the key in ``X-API-KEY``) as operations on the key's tenant
front: create, connect/resume, list, info, kill, timeouts, pause, metrics and their history, logs,
network updates, snapshots and forks. Errors are E2B's
``{code, message}`` with the statuses its SDKs turn into their exceptions."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
import json
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from warmbox import api
from warmbox import operations as ops
from warmbox.errors import (
    InvalidArgument,
    SandboxNotFound,
    SandboxStateError,
    SnapshotUnsupported,
    Unauthenticated,
    WarmboxError,
)
from warmbox.models import Lifecycle, MetricSample, SandboxInfo, SandboxQuery, SnapshotRef, State
from warmbox.network.policy import Network
from warmbox.server.e2b import table
from warmbox.server.e2b.common import (
    ENVD_VERSION,
    Front,
    Service,
    Tokens,
    answer,
    api_secret,
    error_response,
    json_body,
    status_of,
)

MAX_BODY = 1 << 20
# E2B's template names -> warmbox's built-in templates (any other name: a warmbox template of that name)
TEMPLATES = {"base": "base", "code-interpreter-v1": "pydata", "code-interpreter": "pydata"}
DEFAULT_TIMEOUT_S = 300  # E2B's default sandbox timeout
MAX_PAGE = 1000
FORK_TIMEOUT_S = 15  # E2B's default timeout of a fork
MAX_FORKS = 20  # forks one call makes at most (E2B's bound)
_ALIVE = (State.CREATING, State.READY, State.RUNNING)
Handler = Callable[["Call"], Awaitable[Response]]
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Call:
    """One control-plane request: its front, tenant key's tokens, path parameter and body."""

    request: Request
    front: Front
    tenant: Any
    sandbox_id: str
    body: dict[str, Any]


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


def _state(info: SandboxInfo) -> str:
    return "paused" if info.state == State.PAUSED else "running"


def _template_id(info: SandboxInfo) -> str:
    reverse = {"pydata": "code-interpreter-v1"}
    return reverse.get(info.template, info.template)


def _number(body: dict[str, Any], key: str, default: int | None = None, *, low: int = 0, high: int = 86400 * 30) -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise InvalidArgument(f"{key} must be a number from {low} to {high}, got {value!r}")
    return int(value)


def _str_map(body: dict[str, Any], key: str) -> dict[str, str] | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InvalidArgument(f"{key} must be an object of string values")
    return value


_NETWORK_FIELDS = {"allowOut", "denyOut", "allowPublicTraffic"}


def _network(given: object) -> str | Network:
    """E2B's ``network`` as a warmbox egress policy. E2B allows everything unless denied, and an
    ``allowOut`` entry wins over a ``denyOut`` one; warmbox denies everything not allowed. So
    ``allowOut`` becomes warmbox's allowlist, and the rest stays denied (denyOut adds nothing)."""
    if not given:
        return "none"
    if not isinstance(given, dict):
        raise InvalidArgument("network must be an object")
    unknown = sorted(set(given) - _NETWORK_FIELDS)
    if unknown:
        raise InvalidArgument(f"network fields {unknown} are not mapped onto warmbox's egress policies yet")
    for key in ("allowOut", "denyOut"):
        value = given.get(key)
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            raise InvalidArgument(f"network.{key} must be a list of strings")
    allow = given.get("allowOut") or []
    return Network(allow=tuple(allow)) if allow else "none"


def _paged(params: Any, items: list[T], limit: int | None) -> tuple[list[T], dict[str, str]]:
    """The page of ``items`` E2B's ``nextToken`` (an offset this server gave) and ``limit`` ask
    for, and the ``x-next-token`` header of the next page, if any."""
    start = 0
    if params.get("nextToken"):
        try:
            start = int(base64.urlsafe_b64decode(params["nextToken"].encode()).decode())
        except (ValueError, binascii.Error, UnicodeDecodeError):
            raise InvalidArgument("nextToken is not one this server gave") from None
    page = items[start : start + limit] if limit else items[start:]
    headers = {}
    if limit and start + limit < len(items):
        headers["x-next-token"] = base64.urlsafe_b64encode(str(start + limit).encode()).decode()
    return page, headers


def _query_int(params: Any, key: str, default: int | None, low: int, high: int) -> int | None:
    raw = params.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgument(f"{key} must be a whole number, got {raw[:40]!r}") from None
    if not low <= value <= high:
        raise InvalidArgument(f"{key} must be from {low} to {high}, got {value}")
    return value


_LEVELS = ("debug", "info", "warn", "error")
_LOG_LEVEL = {"debug": "debug", "info": "info", "warning": "warn", "warn": "warn", "error": "error", "fatal": "error"}
MAX_LOG_LINES = 1000  # E2B's default and largest page of log lines
MAX_METRICS_IDS = 100  # sandboxes one GET /sandboxes/metrics asks for
MAX_JSON_LINE = 64 << 10  # a runtime's log line read as JSON at most (a longer one is text)
MAX_SEARCH = 1024  # the longest logs search string


def _log_entries(text: str, started: float) -> list[tuple[float, str, str]]:
    """(at, level, message) of each line of a sandbox's runtime logs (``logs``: redacted, bounded).
    A runtime's JSON line (runc's: ``{"level", "msg", "time"}``) gives its own time and level; any
    other line is "info" at the sandbox's start (the tails carry no time of their own)."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        at, level, message = started, "info", line
        if line.startswith("{") and len(line) <= MAX_JSON_LINE:
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):  # the agent's log is the guest's text: anything
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("msg"), str):
                message = obj["msg"]
                level = _LOG_LEVEL.get(str(obj.get("level", "")).lower()[:16], "info")
                if isinstance(obj.get("time"), str):
                    try:
                        t = datetime.datetime.fromisoformat(obj["time"]).timestamp()
                    except (ValueError, OverflowError, OSError):
                        t = -1.0
                    at = t if 0 <= t < 1e11 else at
        out.append((at, level, message))
    return out


class Control:
    """The control plane's routes (table.ROUTES, plane "api") and its ASGI entry."""

    def __init__(self, service: Service, tokens: Tokens) -> None:
        self._service = service
        self._tokens = tokens
        handlers: dict[tuple[str, str], Handler] = {
            ("POST", "/sandboxes"): self.create,
            ("POST", "/v2/sandboxes"): self.create,
            ("GET", "/sandboxes"): self.list_v1,
            ("GET", "/v2/sandboxes"): self.list_v2,
            ("GET", "/sandboxes/{id}"): self.info,
            ("DELETE", "/sandboxes/{id}"): self.kill,
            ("POST", "/sandboxes/{id}/timeout"): self.set_timeout,
            ("POST", "/sandboxes/{id}/refreshes"): self.refresh,
            ("POST", "/sandboxes/{id}/pause"): self.pause,
            ("POST", "/sandboxes/{id}/connect"): self.connect,
            ("POST", "/v2/sandboxes/{id}/connect"): self.connect,
            ("POST", "/sandboxes/{id}/resume"): self.resume,
            ("GET", "/sandboxes/{id}/metrics"): self.metrics,
            ("GET", "/sandboxes/metrics"): self.metrics_of_many,
            ("GET", "/sandboxes/{id}/logs"): self.logs_v1,
            ("GET", "/v2/sandboxes/{id}/logs"): self.logs_v2,
            ("PUT", "/sandboxes/{id}/network"): self.update_network,
            ("POST", "/sandboxes/{id}/fork"): self.fork,
            ("POST", "/sandboxes/{id}/snapshots"): self.create_snapshot,
            ("GET", "/snapshots"): self.list_snapshots,
            ("DELETE", "/templates/{id}"): self.delete_template,
        }
        self._routes: list[tuple[re.Pattern[str], str, str, Handler | None, str]] = []
        for r in table.ROUTES:
            if r.plane != "api":
                continue
            handler = handlers.pop((r.method, r.path), None)
            if handler is None and not r.unsupported:
                raise AssertionError(f"the E2B table's {r.method} {r.path} has no handler")
            pattern = re.compile("^" + "(?P<id>[^/]+)".join(re.escape(p) for p in r.path.split("{id}")) + "$")
            self._routes.append((pattern, r.method, r.path, handler, r.unsupported))
        if handlers:
            raise AssertionError(f"handlers missing from the E2B table: {sorted(handlers)}")

    @staticmethod
    def claims(path: str) -> bool:
        """Whether a request without a sandbox header is for E2B's control plane."""
        return path.startswith(("/sandboxes", "/v2/sandboxes", "/snapshots", "/templates", "/v2/templates"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await answer(self._dispatch, scope, receive, send)

    async def _dispatch(self, request: Request) -> Response:
        path, method = request.url.path.rstrip("/") or "/", request.method
        allowed = []
        for pattern, m, _, handler, unsupported in self._routes:
            match = pattern.match(path)
            if match is None:
                continue
            if m != method:
                allowed.append(m)
                continue
            tenant = self._authenticate(request)
            if handler is None:
                return error_response(400, f"{method} {path}: {unsupported} (warmbox)")
            sandbox_id = match.groupdict().get("id") or ""
            body = await json_body(request, MAX_BODY) if method in ("POST", "PUT") else {}
            return await handler(Call(request, self._service.front(tenant), tenant, sandbox_id, body))
        if allowed:
            return error_response(405, f"{method} is not allowed on {path} (allowed: {', '.join(allowed)})")
        self._authenticate(request)  # an unknown route says so only to a caller with a key
        return error_response(404, f"E2B's API route {method} {path} is not served by warmbox")

    def _authenticate(self, request: Request) -> Any:
        secret = request.headers.get("x-api-key", "")
        if not secret:
            raise Unauthenticated("an API key is required: the X-API-KEY header (E2B_API_KEY)")
        return self._service.authenticate_secret(api_secret(secret))

    # ---- shapes

    def _sandbox(self, call: Call, info: SandboxInfo) -> dict[str, Any]:
        """E2B's Sandbox (what create and connect answer): the ids, envd's version, the tokens."""
        token = self._tokens.issue(call.tenant, info.sandbox_id)
        return {
            "templateID": _template_id(info),
            "sandboxID": info.sandbox_id,
            "clientID": "warmbox",
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": token,
            "trafficAccessToken": token,
            "domain": None,
        }

    @staticmethod
    def _listed(info: SandboxInfo) -> dict[str, Any]:
        return {
            "templateID": _template_id(info),
            "sandboxID": info.sandbox_id,
            "clientID": "warmbox",
            "startedAt": _iso(info.created_at),
            "endAt": _iso(info.expires_at),
            "cpuCount": max(1, round(info.cpus)),
            "memoryMB": info.memory_mb,
            "diskSizeMB": 0,
            "state": _state(info),
            "envdVersion": ENVD_VERSION,
            "metadata": dict(info.metadata),
        }

    @staticmethod
    def _json(value: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
        return Response(json.dumps(value), status_code=status, media_type="application/json", headers=headers)

    async def _live(self, call: Call) -> SandboxInfo:
        """The sandbox's record while it is alive or paused; SandboxNotFound once it ended."""
        info = await call.front.handle(ops.Info(call.sandbox_id))
        if info.state not in (*_ALIVE, State.PAUSED):
            raise SandboxNotFound(f"sandbox {call.sandbox_id} is {info.state.value}")
        return info

    # ---- routes

    async def create(self, call: Call) -> Response:
        body = call.body
        template = body.get("templateID")
        if not isinstance(template, str) or not template:
            raise InvalidArgument("templateID is required")
        timeout = _number(body, "timeout", DEFAULT_TIMEOUT_S, low=1)
        network = _network(body.get("network"))
        for field in ("volumeMounts", "mcp", "iam"):
            if body.get(field):
                raise InvalidArgument(f"{field} is not supported by warmbox's E2B API yet")
        auto_pause = body.get("autoPause", False)
        resume = body.get("autoResume")
        auto_resume = isinstance(resume, dict) and resume.get("enabled") is True
        if not isinstance(auto_pause, bool):
            raise InvalidArgument("autoPause must be true or false")
        lifecycle = Lifecycle(on_timeout="pause" if auto_pause else "kill", auto_resume=auto_resume)
        # Sandbox.create(snapshot_id): a snapshot's id as the template forks it
        snapshot = template if template.startswith("snap-") else None
        opened = await call.front.handle(
            ops.Create(
                template=None if snapshot else TEMPLATES.get(template, template),
                from_snapshot=snapshot,
                timeout=float(timeout),
                envs=_str_map(body, "envVars"),
                metadata=_str_map(body, "metadata"),
                lifecycle=lifecycle if lifecycle != Lifecycle() else None,
                # deny-all stays warmbox's default whatever allow_internet_access says (docs/e2b.md)
                network=network,
                # E2B's header: a repeat gets the first create's sandbox (engine/idempotency.py)
                idempotency_key=call.request.headers.get(api.IDEMPOTENCY_HEADER),
            )
        )
        return self._json(self._sandbox(call, opened.info), 201)

    async def _page(self, call: Call, query: SandboxQuery, default_limit: int | None) -> Response:
        params = call.request.query_params
        limit = default_limit
        if "limit" in params:
            try:
                limit = int(params["limit"])
            except ValueError:
                raise InvalidArgument(f"limit must be a number, got {params['limit']!r}") from None
            if not 1 <= limit <= MAX_PAGE:
                raise InvalidArgument(f"limit must be from 1 to {MAX_PAGE}")
        infos = await call.front.handle(ops.ListSandboxes(query=query))
        infos = sorted(infos, key=lambda i: (-i.created_at, i.sandbox_id))
        page, headers = _paged(params, infos, limit)
        return self._json([self._listed(i) for i in page], headers=headers)

    @staticmethod
    def _metadata(params: Any) -> dict[str, str] | None:
        raw = params.get("metadata")
        if not raw:
            return None
        try:
            pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, max_num_fields=64, strict_parsing=True)
        except ValueError as e:
            raise InvalidArgument(f"metadata must be key=value pairs (at most 64): {e}") from None
        return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}

    async def list_v1(self, call: Call) -> Response:
        query = SandboxQuery(metadata=self._metadata(call.request.query_params), state=(State.RUNNING,))
        return await self._page(call, query, None)

    async def list_v2(self, call: Call) -> Response:
        params = call.request.query_params
        states: tuple[State, ...] | None = None
        if params.get("state"):
            names = [s for s in params["state"].split(",") if s]
            if not set(names) <= {"running", "paused"}:
                raise InvalidArgument(f"state must be running and/or paused, got {params['state']!r}")
            states = tuple(State(s) for s in names)
        return await self._page(call, SandboxQuery(metadata=self._metadata(params), state=states), 100)

    async def info(self, call: Call) -> Response:
        info = await self._live(call)
        detail = self._listed(info)
        detail["envdAccessToken"] = self._tokens.issue(call.tenant, info.sandbox_id)
        detail["allowInternetAccess"] = False
        return self._json(detail)

    async def kill(self, call: Call) -> Response:
        await self._live(call)
        if not await call.front.handle(ops.Kill(call.sandbox_id)):
            raise SandboxNotFound(f"sandbox {call.sandbox_id} not found")
        return Response(status_code=204)

    async def set_timeout(self, call: Call) -> Response:
        timeout = _number(call.body, "timeout", low=0)
        await call.front.handle(ops.SetTimeout(call.sandbox_id, float(timeout)))
        return Response(status_code=204)

    async def refresh(self, call: Call) -> Response:
        duration = _number(call.body, "duration", 0, low=0, high=3600)
        await call.front.handle(ops.SetTimeout(call.sandbox_id, float(duration or 60)))
        return Response(status_code=204)

    async def pause(self, call: Call) -> Response:
        info = await self._live(call)
        if info.state == State.PAUSED:
            return error_response(409, f"sandbox {call.sandbox_id} is already paused")
        memory = call.body.get("memory", True)  # E2B's default: a full memory snapshot
        if not isinstance(memory, bool):
            raise InvalidArgument("memory must be true or false")
        try:
            # where the sandbox's tier snapshots memory (gVisor, microVM) its processes are kept too
            await call.front.handle(ops.Pause(call.sandbox_id, memory=memory))
        except SnapshotUnsupported:
            if not memory:
                raise
            # refused before anything was done: this tier (the container's) keeps files and contexts
            await call.front.handle(ops.Pause(call.sandbox_id))
        return Response(status_code=204)

    async def connect(self, call: Call) -> Response:
        timeout = _number(call.body, "timeout", DEFAULT_TIMEOUT_S, low=0)
        info = await self._live(call)
        if info.state == State.PAUSED:
            opened = await call.front.handle(ops.Resume(call.sandbox_id, timeout=float(timeout) or None))
            return self._json(self._sandbox(call, opened.info), 201)
        if timeout and time.time() + timeout > info.expires_at:  # E2B: a connect only lengthens it
            try:
                await call.front.handle(ops.SetTimeout(call.sandbox_id, float(timeout)))
            except SandboxStateError:
                pass  # it is being paused or ended right now: its record says what it is
        return self._json(self._sandbox(call, await self._live(call)))

    async def resume(self, call: Call) -> Response:
        timeout = _number(call.body, "timeout", DEFAULT_TIMEOUT_S, low=0)
        info = await self._live(call)
        if info.state != State.PAUSED:
            return error_response(409, f"sandbox {call.sandbox_id} is not paused")
        opened = await call.front.handle(ops.Resume(call.sandbox_id, timeout=float(timeout) or None))
        return self._json(self._sandbox(call, opened.info), 201)

    @staticmethod
    def _sample(m: MetricSample) -> dict[str, Any]:
        # whole seconds, as E2B's: the SDKs send start and end back in whole seconds (Python's cut,
        # JavaScript's rounded), and a reading's own time must find it again
        at = datetime.datetime.fromtimestamp(int(m.timestamp), datetime.UTC)
        return {
            "timestamp": at.isoformat().replace("+00:00", "Z"),
            "timestampUnix": int(m.timestamp),
            "cpuCount": m.cpu_count,
            "cpuUsedPct": m.cpu_used_pct,
            "memUsed": m.memory_bytes,
            "memTotal": m.memory_total_bytes,
            "memCache": 0,
            "diskUsed": 0,
            "diskTotal": 0,
        }

    async def metrics(self, call: Call) -> Response:
        params = call.request.query_params
        now = int(time.time())
        start = _query_int(params, "start", None, 0, now + 86400)
        end = _query_int(params, "end", None, 0, now + 86400)
        if start is not None and end is not None and start > end:
            raise InvalidArgument("start must not be after end")
        await self._live(call)
        # E2B's times are whole seconds: the readings within the end's second count
        history = ops.MetricsHistory(call.sandbox_id, start, None if end is None else end + 0.999)
        return self._json([self._sample(m) for m in await call.front.handle(history)])

    async def metrics_of_many(self, call: Call) -> Response:
        raw = call.request.query_params.get("sandbox_ids", "")
        ids = list(dict.fromkeys(i for i in raw.split(",") if i))
        if not ids:
            raise InvalidArgument("sandbox_ids must name at least one sandbox (comma-separated)")
        if len(ids) > MAX_METRICS_IDS:
            raise InvalidArgument(f"sandbox_ids names more than {MAX_METRICS_IDS} sandboxes")
        out = {}
        for sandbox_id in ids:
            try:
                got = await call.front.handle(ops.MetricsHistory(sandbox_id, limit=1))
            except SandboxNotFound:
                continue  # unknown or another tenant's: not listed, as one that is not running
            if got:
                out[sandbox_id] = self._sample(got[-1])
        return self._json({"sandboxes": out})

    async def _log_lines(self, call: Call) -> list[tuple[float, str, str]]:
        info = await self._live(call)
        return _log_entries(await call.front.handle(ops.Logs(call.sandbox_id)), info.created_at)

    @staticmethod
    def _entry(at: float, level: str, message: str) -> dict[str, Any]:
        return {"timestamp": _iso(at), "level": level, "message": message, "fields": {}}

    async def logs_v1(self, call: Call) -> Response:
        params = call.request.query_params
        start = _query_int(params, "start", 0, 0, 1 << 53)
        limit = _query_int(params, "limit", MAX_LOG_LINES, 0, MAX_LOG_LINES)
        lines = [e for e in await self._log_lines(call) if e[0] * 1000 >= (start or 0)][: limit or 0]
        return self._json(
            {
                "logs": [{"timestamp": _iso(at), "line": message} for at, _, message in lines],
                "logEntries": [self._entry(*e) for e in lines],
            }
        )

    async def logs_v2(self, call: Call) -> Response:
        params = call.request.query_params
        cursor = _query_int(params, "cursor", None, 0, 1 << 53)
        limit = _query_int(params, "limit", MAX_LOG_LINES, 0, MAX_LOG_LINES) or 0
        direction = params.get("direction", "forward")
        if direction not in ("forward", "backward"):
            raise InvalidArgument(f"direction must be forward or backward, got {direction[:40]!r}")
        level = params.get("level", "debug")
        if level not in _LEVELS:
            raise InvalidArgument(f"level must be one of {', '.join(_LEVELS)}, got {level[:40]!r}")
        search = params.get("search", "")
        if len(search) > MAX_SEARCH:
            raise InvalidArgument(f"search must be at most {MAX_SEARCH} characters")
        lines = [
            e for e in await self._log_lines(call) if _LEVELS.index(e[1]) >= _LEVELS.index(level) and search in e[2]
        ]
        if direction == "backward":
            lines = [e for e in reversed(lines) if cursor is None or e[0] * 1000 <= cursor]
        else:
            lines = [e for e in lines if cursor is None or e[0] * 1000 >= cursor]
        return self._json({"logs": [self._entry(*e) for e in lines[:limit]]})

    async def update_network(self, call: Call) -> Response:
        body = dict(call.body)
        # the Python SDK's body spells it allow_internet_access, E2B's API allowInternetAccess
        allow_internet = body.pop("allow_internet_access", body.pop("allowInternetAccess", None))
        if allow_internet is not None and not isinstance(allow_internet, bool):
            raise InvalidArgument("allowInternetAccess must be true or false")
        for key in ("dnsServers", "rules"):
            if body.get(key):
                raise InvalidArgument(f"network {key} is not mapped onto warmbox's egress policies")
            body.pop(key, None)
        if body.pop("egressProxy", None) is not None:
            raise InvalidArgument("network egressProxy is not mapped onto warmbox's egress policies")
        await self._live(call)
        # replaced whole, as E2B's update: deny-all stays whatever allowInternetAccess says (docs/e2b.md)
        await call.front.handle(ops.UpdateNetwork(call.sandbox_id, _network(body) if body else "none"))
        return Response(status_code=204)

    async def _snapshot(self, call: Call, memory: bool) -> SnapshotRef:
        """A snapshot of the sandbox, which runs on: with its memory where the tier snapshots it
        and ``memory`` asks for it, else files and code contexts (as pause does)."""
        try:
            return await call.front.handle(ops.Snapshot(call.sandbox_id, memory=memory))
        except SnapshotUnsupported:
            if not memory:
                raise
            return await call.front.handle(ops.Snapshot(call.sandbox_id))

    async def create_snapshot(self, call: Call) -> Response:
        if call.body.get("name"):
            raise InvalidArgument("warmbox's snapshots have no names: leave name out and use the snapshot's id")
        memory = call.body.get("memory", True)  # E2B's default: a full memory snapshot
        if not isinstance(memory, bool):
            raise InvalidArgument("memory must be true or false")
        info = await self._live(call)
        if info.state == State.PAUSED:
            raise SandboxStateError(f"sandbox {call.sandbox_id} is paused: connect to it first")
        ref = await self._snapshot(call, memory)
        return self._json({"snapshotID": ref.snapshot_id, "names": []}, 201)

    async def list_snapshots(self, call: Call) -> Response:
        params = call.request.query_params
        limit = _query_int(params, "limit", 100, 1, MAX_PAGE)
        of, name = params.get("sandboxID"), params.get("name")
        rows = [
            r
            for r in await call.front.handle(ops.ListSnapshots())
            if (not of or r[1] == of) and (not name or r[0] == name)
        ]
        rows.sort(key=lambda r: (-r[2], r[0]))
        page, headers = _paged(params, rows, limit)
        return self._json([{"snapshotID": r[0], "names": []} for r in page], headers=headers)

    async def delete_template(self, call: Call) -> Response:
        if not call.sandbox_id.startswith("snap-"):
            raise InvalidArgument(
                "only snapshots (snap-...) are deleted through E2B's API; delete templates with warmbox"
            )
        await call.front.handle(ops.DeleteSnapshot(call.sandbox_id))
        return Response(status_code=204)

    async def fork(self, call: Call) -> Response:
        timeout = _number(call.body, "timeout", FORK_TIMEOUT_S, low=1)
        count = _number(call.body, "count", 1, low=1, high=MAX_FORKS)
        info = await self._live(call)
        if info.state == State.PAUSED:
            raise SandboxStateError(f"sandbox {call.sandbox_id} is paused: connect to it first")
        ref = await self._snapshot(call, True)  # once, whatever the count (E2B's fork)
        results: list[dict[str, Any]] = []
        try:
            for _ in range(count):
                try:
                    opened = await call.front.handle(ops.Create(from_snapshot=ref.snapshot_id, timeout=float(timeout)))
                except WarmboxError as e:  # each fork fails on its own, as E2B's
                    results.append({"error": {"code": status_of(e), "message": str(e)}})
                    continue
                results.append({"sandbox": self._sandbox(call, opened.info)})
        finally:
            try:  # the forks have their own copies; the snapshot was only the fork's means
                await call.front.handle(ops.DeleteSnapshot(ref.snapshot_id))
            except WarmboxError:
                pass
        return self._json(results, 201)


__all__ = ["TEMPLATES", "Control"]
