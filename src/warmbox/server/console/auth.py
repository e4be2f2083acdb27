"""The console's sessions: an opaque token in a cookie for a key the operator pasted once.

The cookie holds a random token, never the API key; the server keeps only the token's SHA-256,
the key's id (re-checked on every request: a revoked key ends its sessions at once), a CSRF token
and an expiry. Sessions live in the server's memory: a restart logs everyone out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

SESSION_TTL_S = 8 * 3600.0  # a session's whole life, however busy (the list refreshes every 1.5 s)
MAX_SESSIONS = 4096  # past this, the oldest sessions are dropped (each login adds one)
# one key's open sessions: its own oldest go first (without it, a tenant logging in MAX_SESSIONS
# times dropped everyone's session, the operator's too)
MAX_SESSIONS_PER_KEY = 16
LOGIN_TTL_S = 600.0  # the login form's CSRF cookie
COOKIE = "warmbox_console"  # over TLS: "__Secure-" + COOKIE (the browser then refuses it without Secure)
LOGIN_COOKIE = "warmbox_console_login"
PATH = "/ui"  # the cookie's Path: never sent to /v1 (the API and the sandboxes' port previews)
_MAX_TOKEN = 128  # a cookie value longer than any token we issue is not looked up


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Session:
    """One login: the key's id, the CSRF token its forms carry, and when it ends (unix seconds)."""

    key_id: str
    csrf: str
    created_at: float
    expires_at: float


class Sessions:
    """Open sessions by the SHA-256 of their token (a leaked table holds no usable cookie)."""

    def __init__(
        self,
        ttl_s: float = SESSION_TTL_S,
        limit: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.time,
        per_key: int = MAX_SESSIONS_PER_KEY,
    ) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self.per_key = per_key
        self._clock = clock
        self._by_digest: dict[str, Session] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._by_digest)

    def open(self, key_id: str) -> tuple[str, Session]:
        """A new session for ``key_id``: (the token for the cookie, the session)."""
        now = self._clock()
        self._expire(now)
        mine = [d for d, s in self._by_digest.items() if s.key_id == key_id]  # oldest first
        for d in mine[: max(0, len(mine) - self.per_key + 1)]:
            del self._by_digest[d]
        while len(self._by_digest) >= self.limit:
            del self._by_digest[next(iter(self._by_digest))]
        token = secrets.token_urlsafe(32)
        session = Session(key_id, secrets.token_urlsafe(32), now, now + self.ttl_s)
        self._by_digest[_digest(token)] = session
        return token, session

    def get(self, token: str | None) -> Session | None:
        """The live session of a cookie's token; None if unknown, expired or malformed."""
        if not token or len(token) > _MAX_TOKEN:
            return None
        digest = _digest(token)
        session = self._by_digest.get(digest)
        if session is None:
            return None
        if session.expires_at <= self._clock():
            del self._by_digest[digest]
            return None
        return session

    def close(self, token: str | None) -> bool:
        """End a session (logout); False if there was none."""
        if not token or len(token) > _MAX_TOKEN:
            return False
        return self._by_digest.pop(_digest(token), None) is not None

    def close_key(self, key_id: str) -> int:
        """End every session of a key (it was found revoked); how many."""
        gone = [d for d, s in self._by_digest.items() if s.key_id == key_id]
        for d in gone:
            del self._by_digest[d]
        return len(gone)

    def _expire(self, now: float) -> None:
        # sessions are added in time order with one lifetime: the expired ones are at the front
        while self._by_digest:
            first = next(iter(self._by_digest))
            if self._by_digest[first].expires_at > now:
                break
            del self._by_digest[first]


def same_token(given: str | None, expected: str) -> bool:
    """A CSRF token check in constant time (an absent or empty token never matches)."""
    return bool(given) and bool(expected) and hmac.compare_digest(str(given).encode(), expected.encode())


class PeerTokens:
    """CSRF tokens of callers without a session (root on the unix socket, a bearer key):
    an HMAC of who they are under a key made at server start."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def token(self, identity: str) -> str:
        return hmac.new(self._key, identity.encode(), hashlib.sha256).hexdigest()


def cookie_name(secure: bool) -> str:
    return ("__Secure-" if secure else "") + COOKIE


def set_cookie_header(name: str, value: str, *, path: str, max_age: int, secure: bool) -> str:
    """A Set-Cookie value: HttpOnly (no script reads it), SameSite=Strict (no other site's page,
    and no sandbox preview — an opaque origin — sends it), Secure over TLS, host-only (no Domain)."""
    parts = [f"{name}={value}", f"Path={path}", f"Max-Age={max_age}", "HttpOnly", "SameSite=Strict"]
    if secure:
        parts.append("Secure")
    return "; ".join(parts)


__all__ = [
    "COOKIE",
    "LOGIN_COOKIE",
    "PATH",
    "SESSION_TTL_S",
    "PeerTokens",
    "Session",
    "Sessions",
    "cookie_name",
    "same_token",
    "set_cookie_header",
]
