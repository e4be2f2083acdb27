"""What the E2B adapter's three parts share: the caller's front, the sandbox access tokens, and
warmbox's typed errors in E2B's shapes (HTTP statuses with ``{code, message}``, Connect codes)."""

from __future__ import annotations

import dataclasses
import json
import posixpath
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from warmbox import errors
from warmbox import operations as ops
from warmbox.engine import signing
from warmbox.errors import InvalidArgument, Unauthenticated, WarmboxError
from warmbox.models import Tenant
from warmbox.server.tunnel import RelaySlots

R = TypeVar("R")
ENVD_PORT = 49983
INTERPRETER_PORT = 49999
# what the SDKs gate features on: >= 0.6.4 turns on everything warmbox implements (stdin=False,
# the default user, CloseStdin, octet-stream uploads)
ENVD_VERSION = "0.6.4"
SANDBOX_HEADER = "e2b-sandbox-id"
PORT_HEADER = "e2b-sandbox-port"
API_KEY_HEADER = "x-api-key"
ACCESS_TOKEN_HEADER = "x-access-token"
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"
# E2B resolves relative paths, and runs commands and code contexts, in the user's home (warmbox's
# sandbox user has the same home, kept by pause and snapshots as /workspace is)
HOME = "/home/user"


def e2b_path(path: object) -> str:
    """A path as E2B means it: a relative one is under the user's home (warmbox's own API puts it
    under /workspace); anything else is left for the operation to check."""
    if isinstance(path, str) and path and not path.startswith("/"):
        return posixpath.join(HOME, path)
    return path if isinstance(path, str) else ""


class Front(Protocol):
    """What the adapter runs operations on: the caller's tenant front (warmbox.server.app.Front)."""

    async def handle(self, request: ops.Request[R]) -> R: ...


class Service(Protocol):
    """The server's authentication and fronts (warmbox.server.app.Service)."""

    def authenticate_secret(self, secret: str) -> Tenant: ...

    def authenticate_key_id(self, key_id: str) -> Tenant: ...

    def sandbox_key_ids(self, sandbox_id: str) -> list[str]: ...

    @property
    def signer(self) -> signing.Signer: ...

    @property
    def ws_relays(self) -> RelaySlots: ...

    def front(self, tenant: Tenant | None) -> Any: ...


def api_secret(api_key: str) -> str:
    """The warmbox secret an X-API-KEY carries: the key itself (``wbx_...``), or its E2B form
    ``e2b_`` + the key's bytes in hex, which E2B's SDKs that check the key's shape accept (e2b
    before 2.5x refuses anything but ``e2b_<hex>`` before sending it)."""
    if not api_key.startswith("e2b_"):
        return api_key
    try:
        return bytes.fromhex(api_key[4:]).decode("ascii")
    except (ValueError, UnicodeDecodeError):
        raise Unauthenticated("an e2b_ key must be e2b_ + a warmbox key's bytes in hex") from None


class Tokens:
    """Sandbox access tokens: what E2B calls envdAccessToken and trafficAccessToken.

    A token names the API key that created or connected to the sandbox and is bound to that
    sandbox's id by an HMAC under the registry's signing key (:mod:`warmbox.engine.signing`, the
    key of warmbox's own signed URLs too), so it holds no state, outlives a server restart, is
    accepted by every server on the registry (a cluster's routers) and ends with its sandbox
    (another id, or a gone sandbox, fails the front's own checks). Data-plane requests carry no
    API key, only the token: it says whose front runs them. A revoked key's tokens stop at once.
    """

    def __init__(self, service: Service) -> None:
        self._service = service

    def issue(self, tenant: Tenant, sandbox_id: str) -> str:
        key_id = tenant.key_id
        if not key_id:
            raise Unauthenticated("E2B's API needs a tenant API key (X-API-KEY)")
        return self._service.signer.token(key_id, sandbox_id)

    def key_id(self, token: str, sandbox_id: str) -> str:
        """The key id a token for ``sandbox_id`` names; Unauthenticated if it is not one."""
        return self._service.signer.signer(token, sandbox_id)

    def check_file(self, key_ids: list[str], sandbox_id: str, query: Mapping[str, str], operation: str) -> str:
        """The key of ``key_ids`` whose token signed a file URL (E2B's v1 scheme) with ``query``'s
        path, username, signature and signature_expiration (Unauthenticated once it expired)."""
        at = signing.expiration(query.get("signature_expiration"))
        path, user = query.get("path", ""), query.get("username", "")
        return self._service.signer.check_file(
            key_ids, sandbox_id, path, operation, user, at, query.get("signature", "")
        )


@dataclasses.dataclass(frozen=True)
class Target:
    """A data-plane request's sandbox, and the front of the tenant whose token it carries."""

    front: Front
    sandbox_id: str


def data_target(service: Service, tokens: Tokens, headers: Mapping[str, str]) -> Target:
    """Who a data-plane request is from and which sandbox it is for: the E2b-Sandbox-Id header and
    the sandbox's access token (X-Access-Token, or E2B-Traffic-Access-Token), or an API key."""
    sandbox_id = headers.get(SANDBOX_HEADER, "")
    if not sandbox_id or len(sandbox_id) > 128:
        raise InvalidArgument("the E2b-Sandbox-Id header must name a sandbox")
    token = headers.get(ACCESS_TOKEN_HEADER) or headers.get(TRAFFIC_TOKEN_HEADER)
    if token:
        tenant = service.authenticate_key_id(tokens.key_id(token, sandbox_id))
    elif headers.get(API_KEY_HEADER):
        tenant = service.authenticate_secret(api_secret(headers[API_KEY_HEADER]))
    else:
        raise Unauthenticated("a sandbox access token (X-Access-Token) or an API key (X-API-KEY) is required")
    return Target(service.front(tenant), sandbox_id)


MAX_SIGNERS = 64  # the keys of one tenant a signed URL is checked against


def signed_target(service: Service, tokens: Tokens, headers: Mapping[str, str], query: Mapping[str, str]) -> Target:
    """Who a signed ``/files`` URL is from: the key whose access token for this sandbox signed its
    path, operation (GET read, POST write, by ``operation``), user and expiration; Unauthenticated
    if none did or it expired. The URL's holder needs nothing else, as on E2B."""
    sandbox_id = headers.get(SANDBOX_HEADER, "")
    if not sandbox_id or len(sandbox_id) > 128:
        raise InvalidArgument("the E2b-Sandbox-Id header (or the Host of domain mode) must name a sandbox")
    signers = service.sandbox_key_ids(sandbox_id)[:MAX_SIGNERS]
    key_id = tokens.check_file(signers, sandbox_id, query, query.get("operation", ""))
    return Target(service.front(service.authenticate_key_id(key_id)), sandbox_id)


# ---- errors

# the status E2B's SDKs turn into their own exception, by warmbox error class (the first match)
_STATUS: tuple[tuple[type[WarmboxError], int], ...] = (
    (errors.Unauthenticated, 401),
    (errors.Forbidden, 403),
    (errors.ApprovalDenied, 403),
    (errors.RateLimited, 429),
    (errors.QuotaExceeded, 429),
    (errors.SandboxNotFound, 404),
    (errors.TemplateNotFound, 404),
    (errors.PathNotFound, 404),
    (errors.ProcessNotFound, 404),
    (errors.ContextError, 404),
    (errors.SandboxLost, 404),
    (errors.FileTooLarge, 413),
    (errors.InvalidArgument, 400),
    (errors.PathExists, 409),
    (errors.SandboxStateError, 409),
    (errors.NotADirectory, 400),
    (errors.IsADirectory, 400),
    (errors.NotARegularFile, 400),
    (errors.PathPermissionDenied, 403),
    (errors.NoSpace, 507),
    (errors.StorageFull, 507),
    (errors.Unsupported, 400),
    (errors.SnapshotUnsupported, 400),
    (errors.LimitTooHigh, 400),
    (errors.SandboxTimeout, 504),
    (errors.NoCapacity, 503),
    (errors.BackendUnavailable, 503),
    (errors.GuestConnectionError, 502),
    (errors.PortNotListening, 502),
    (errors.ConnectionLost, 502),
)

_CODE: dict[int, Code] = {
    400: Code.INVALID_ARGUMENT,
    401: Code.UNAUTHENTICATED,
    403: Code.PERMISSION_DENIED,
    404: Code.NOT_FOUND,
    409: Code.FAILED_PRECONDITION,
    413: Code.RESOURCE_EXHAUSTED,
    429: Code.RESOURCE_EXHAUSTED,
    502: Code.UNAVAILABLE,
    503: Code.UNAVAILABLE,
    504: Code.DEADLINE_EXCEEDED,
    507: Code.RESOURCE_EXHAUSTED,
}


def status_of(exc: WarmboxError) -> int:
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    """E2B's error body: ``{"code": <status>, "message": ...}`` (its SDKs read both)."""
    body = json.dumps({"code": status, "message": message}, separators=(",", ":"))
    return Response(body, status_code=status, media_type="application/json", headers=dict(headers or {}))


def warmbox_error_response(exc: WarmboxError) -> Response:
    headers = {}
    if isinstance(exc, errors.RateLimited):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    return error_response(status_of(exc), str(exc), headers)


async def json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """A request's JSON object body, read up to ``max_bytes`` (an empty body is ``{}``);
    InvalidArgument for a larger body, one that is not JSON, or JSON that is not an object."""
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise InvalidArgument(f"the request body is larger than {max_bytes} bytes")
        parts.append(chunk)
    raw = b"".join(parts)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise InvalidArgument(f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return body


async def answer(handler: Callable[[Request], Awaitable[Response]], scope: Scope, receive: Receive, send: Send) -> None:
    """One plane's request: ``handler``'s response, or E2B's error body for what it raised."""
    request = Request(scope, receive)
    try:
        response = await handler(request)
    except WarmboxError as e:
        response = warmbox_error_response(e)
    except HTTPException as e:  # Starlette's parsers (a malformed multipart body): outside its handlers here
        response = error_response(e.status_code, str(e.detail))
    except ClientDisconnect:  # the client went before its body arrived: nobody to answer
        response = Response(status_code=400)
    await response(scope, receive, send)


def connect_error(exc: WarmboxError) -> ConnectError:
    """A warmbox error as the Connect error E2B's envd would answer."""
    if isinstance(exc, errors.PathExists):
        return ConnectError(Code.ALREADY_EXISTS, str(exc))
    return ConnectError(_CODE.get(status_of(exc), Code.INTERNAL), str(exc))


__all__ = [
    "answer",
    "json_body",
    "ENVD_PORT",
    "ENVD_VERSION",
    "INTERPRETER_PORT",
    "Front",
    "Service",
    "Target",
    "Tokens",
    "api_secret",
    "connect_error",
    "data_target",
    "e2b_path",
    "error_response",
    "signed_target",
    "status_of",
    "warmbox_error_response",
]
