"""What the E2B adapter's three parts share: the caller's front, the sandbox access tokens, and
warmbox's typed errors in E2B's shapes (HTTP statuses with ``{code, message}``, Connect codes)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import os
import posixpath
import secrets
import stat as statmod
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from warmbox import errors
from warmbox import operations as ops
from warmbox.errors import ConfigError, InvalidArgument, Unauthenticated, WarmboxError
from warmbox.models import Tenant

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
_TOKEN_PREFIX = "wbe2b_"
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

    def front(self, tenant: Tenant | None) -> Any: ...


TOKEN_KEY_FILE = "e2b-token.key"
_KEY_BYTES = 32


def token_key(home: Path) -> bytes:
    """The key the access tokens are signed with: ``<home>/e2b-token.key``, 32 random bytes made
    once (mode 0600, created exclusively: two servers starting together agree on one). Refused
    (ConfigError) if it is not a regular file of this user's, readable by others, or not 32 bytes."""
    path = home / TOKEN_KEY_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        tmp = home / f".{TOKEN_KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(wfd, secrets.token_bytes(_KEY_BYTES))
            os.fsync(wfd)
        finally:
            os.close(wfd)
        try:
            os.link(tmp, path)  # never replaces one another server made meanwhile
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"cannot read the E2B token key {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not statmod.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(f"the E2B token key {path} must be a regular file of this user's, mode 600")
        key = os.read(fd, _KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != _KEY_BYTES:
        raise ConfigError(f"the E2B token key {path} must hold {_KEY_BYTES} bytes (remove it to make a new one)")
    return key


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
    sandbox's id by an HMAC under the home's token key (:func:`token_key`), so it holds no state,
    outlives a server restart and ends with its sandbox (another id, or a gone sandbox, fails the
    front's own checks). Data-plane requests carry no API key, only the token: it says whose front
    runs them. A revoked key's tokens stop working at once.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) < 32:
            raise ConfigError("the E2B token key must be at least 32 bytes")
        self._secret = key

    def issue(self, tenant: Tenant, sandbox_id: str) -> str:
        key_id = tenant.key_id
        if not key_id:
            raise Unauthenticated("E2B's API needs a tenant API key (X-API-KEY)")
        return self.issue_for(key_id, sandbox_id)

    def issue_for(self, key_id: str, sandbox_id: str) -> str:
        return f"{_TOKEN_PREFIX}{key_id}.{self._mac(key_id, sandbox_id)}"

    def key_id(self, token: str, sandbox_id: str) -> str:
        """The key id a token for ``sandbox_id`` names; Unauthenticated if it is not one."""
        if not token.startswith(_TOKEN_PREFIX) or len(token) > 256:
            raise Unauthenticated("the sandbox access token is not one this server issued")
        key_id, _, mac = token[len(_TOKEN_PREFIX) :].rpartition(".")
        if not key_id or not hmac.compare_digest(mac.encode(), self._mac(key_id, sandbox_id).encode()):
            raise Unauthenticated("the sandbox access token is not valid for this sandbox (or this server restarted)")
        return key_id

    def _mac(self, key_id: str, sandbox_id: str) -> str:
        digest = hmac.new(self._secret, f"{key_id}\0{sandbox_id}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")


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


def file_signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    """E2B's v1 signature of a file URL: ``v1_`` + unpadded base64 of SHA-256 over
    ``path:operation:user:token[:expiration]`` (operation "read" or "write"; user "" for the
    default user; token the sandbox's envdAccessToken; expiration unix seconds)."""
    raw = f"{path}:{operation}:{user}:{token}" + ("" if expiration is None else f":{expiration}")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")


def signed_target(service: Service, tokens: Tokens, headers: Mapping[str, str], query: Mapping[str, str]) -> Target:
    """Who a signed ``/files`` URL is from: the key whose access token for this sandbox signed its
    path, operation (GET read, POST write, by ``operation``), user and expiration; Unauthenticated
    if none did or it expired. The URL's holder needs nothing else, as on E2B."""
    sandbox_id = headers.get(SANDBOX_HEADER, "")
    if not sandbox_id or len(sandbox_id) > 128:
        raise InvalidArgument("the E2b-Sandbox-Id header (or the Host of domain mode) must name a sandbox")
    signature = query.get("signature", "")
    expires = query.get("signature_expiration")
    expiration: int | None = None
    if expires is not None:
        if not expires.isdigit() or len(expires) > 12:
            raise InvalidArgument("signature_expiration must be unix seconds")
        expiration = int(expires)
        if expiration < time.time():
            raise Unauthenticated("the signed URL has expired")
    path, user, operation = query.get("path", ""), query.get("username", ""), query.get("operation", "")
    for key_id in service.sandbox_key_ids(sandbox_id)[:MAX_SIGNERS]:
        want = file_signature(path, operation, user, tokens.issue_for(key_id, sandbox_id), expiration)
        if hmac.compare_digest(want.encode(), signature.encode()):
            return Target(service.front(service.authenticate_key_id(key_id)), sandbox_id)
    raise Unauthenticated("the URL's signature is not valid for this sandbox, path, operation and user")


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
    "file_signature",
    "signed_target",
    "status_of",
    "token_key",
    "warmbox_error_response",
]
