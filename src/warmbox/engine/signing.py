"""Sandbox access tokens and signed file URLs, under one key kept in the registry.

The key is 32 random bytes in the registry's ``meta_text`` table (``signing_key``, hex), made by the
first process that needs it: a cluster's router (which checks a URL or a token) and its nodes
(which run ``files.sign_url``) share the registry, so they share the key; nothing else stores it
and no answer carries it. Holding the registry already means holding every sandbox.

A token names its *signer* (an API key's id; ``~<tenant>`` for a caller without a key: a uid
mapped to a tenant; ``~`` for the host's root) and is bound to one sandbox id by an HMAC under the
key (E2B's envdAccessToken: the E2B adapter hands it out). A file URL's signature is E2B's v1
scheme over the path, the operation, the user, the signer's token for the sandbox and the
expiry: the one the E2B SDKs compute themselves from the token, and the one ``files.sign_url``
computes for warmbox's own URLs, so the two planes check URLs with the same function.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Iterable

from warmbox.errors import ConfigError, InvalidArgument, Unauthenticated
from warmbox.storage.registry import Registry

KEY_NAME = "signing_key"
_KEY_BYTES = 32
TOKEN_PREFIX = "wbe2b_"
ROOT_SIGNER = "~"  # the host's root: no tenant
MAX_EXPIRES_S = 7 * 86400.0  # the longest a signed URL of warmbox's own may live
OPERATIONS = ("read", "write")


def registry_key(registry: Registry) -> bytes:
    """The signing key of ``registry``, made (once, whichever process is first) if it has none."""
    text = registry.meta.meta_text(KEY_NAME)
    if not text:
        registry.meta.add_meta_text(KEY_NAME, secrets.token_bytes(_KEY_BYTES).hex())  # never replaces one
        text = registry.meta.meta_text(KEY_NAME)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != _KEY_BYTES:
        raise ConfigError(f"the registry's {KEY_NAME} is not {_KEY_BYTES} bytes in hex (delete it to make a new one)")
    return key


def tenant_signer(tenant: str | None) -> str:
    """The signer of a caller without an API key: ``~<tenant>``, or ``~`` for the host's root."""
    return ROOT_SIGNER + (tenant or "")


def file_signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    """E2B's v1 signature of a file URL: ``v1_`` + unpadded base64 of SHA-256 over
    ``path:operation:user:token[:expiration]`` (operation "read" or "write"; user "" for the
    default user; token the sandbox's access token; expiration unix seconds)."""
    raw = f"{path}:{operation}:{user}:{token}" + ("" if expiration is None else f":{expiration}")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")


def expiration(value: str | None, now: float | None = None) -> int | None:
    """A URL's ``signature_expiration`` (unix seconds) parsed; Unauthenticated once it passed."""
    if value is None:
        return None
    if not value.isdigit() or len(value) > 12:
        raise InvalidArgument("signature_expiration must be unix seconds")
    at = int(value)
    if at < (time.time() if now is None else now):
        raise Unauthenticated("the signed URL has expired")
    return at


class Signer:
    """Tokens and file signatures under one key (:func:`registry_key`)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < _KEY_BYTES:
            raise ConfigError(f"a signing key must be at least {_KEY_BYTES} bytes")
        self._key = key

    def token(self, signer: str, sandbox_id: str) -> str:
        """``signer``'s access token for ``sandbox_id``."""
        return f"{TOKEN_PREFIX}{signer}.{self._mac(signer, sandbox_id)}"

    def signer(self, token: str, sandbox_id: str) -> str:
        """Who a token for ``sandbox_id`` names; Unauthenticated if this key did not make it for it."""
        if not token.startswith(TOKEN_PREFIX) or len(token) > 256:
            raise Unauthenticated("the sandbox access token is not one this server issued")
        signer, _, mac = token[len(TOKEN_PREFIX) :].rpartition(".")
        if not signer or not hmac.compare_digest(mac.encode(), self._mac(signer, sandbox_id).encode()):
            raise Unauthenticated("the sandbox access token is not valid for this sandbox")
        return signer

    def sign_file(self, signer: str, sandbox_id: str, path: str, operation: str, user: str, at: int | None) -> str:
        """The signature of a URL that lets its holder ``operation`` ``path`` of ``sandbox_id`` as
        ``user`` until ``at`` (unix seconds), on ``signer``'s behalf."""
        return file_signature(path, operation, user, self.token(signer, sandbox_id), at)

    def check_file(
        self,
        signers: Iterable[str],
        sandbox_id: str,
        path: str,
        operation: str,
        user: str,
        at: int | None,
        signature: str,
    ) -> str:
        """The one of ``signers`` whose signature ``signature`` is (the caller checked the expiry
        with :func:`expiration`); Unauthenticated if none's is."""
        if operation not in OPERATIONS:
            raise Unauthenticated("a signed URL is for reading (GET) or writing (POST/PUT) a file")
        given = signature.encode()
        for signer in signers:
            if hmac.compare_digest(self.sign_file(signer, sandbox_id, path, operation, user, at).encode(), given):
                return signer
        raise Unauthenticated("the URL's signature is not valid for this sandbox, path, operation and user")

    def _mac(self, signer: str, sandbox_id: str) -> str:
        digest = hmac.new(self._key, f"{signer}\0{sandbox_id}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")


__all__ = [
    "KEY_NAME",
    "MAX_EXPIRES_S",
    "OPERATIONS",
    "ROOT_SIGNER",
    "Signer",
    "expiration",
    "file_signature",
    "registry_key",
    "tenant_signer",
]
