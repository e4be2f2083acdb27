"""Cluster peers: the secret the API tier (router) and the nodes share, and the headers a peer
request carries. A node's API server takes ``Authorization: Bearer <cluster token>`` plus
``X-Warmbox-Tenant: NAME`` as that tenant (the router authenticated the caller's own key and rate
limited it); the token without a tenant header is the host's root (the router's admin view).

The token lives in ``[cluster] token_file`` (mode 0600, created by ``warmbox cluster token`` or by
the first node or router that starts without one). A server with no token refuses peer headers.
In a cluster the token only travels inside mutual TLS (cluster/tls.py): a node's API asks every
caller for a certificate of the cluster's CA, and the router checks the node's.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from warmbox import paths
from warmbox.errors import ClusterError

TENANT = "x-warmbox-tenant"  # the tenant a peer request acts as (absent: the host's root)
ADMIN = "x-warmbox-admin"  # "1": the caller's key is an admin key
KEY_ID = "x-warmbox-key-id"  # the caller's key id (for logs and approvals)
HEADERS = (TENANT, ADMIN, KEY_ID)
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")  # as the registry's tenant names
MIN_TOKEN = 32  # characters: a shorter secret is refused, whoever wrote the file
MAX_TOKEN = 4096


def read_token(path: str | Path) -> str:
    """The token in ``path``; ClusterError if it is missing, unreadable, too short, readable by
    others than its owner, or owned by another user (it lets its holder act as any tenant)."""
    p = Path(path)
    raw = paths.read_member_file(p, f"the cluster token {p}", MAX_TOKEN, private=True)
    token = raw.decode(errors="replace").strip()
    if len(token) < MIN_TOKEN or not token.isprintable():
        raise ClusterError(f"the cluster token {p} must be {MIN_TOKEN}-{MAX_TOKEN} printable characters")
    return token


def ensure_token(path: str | Path) -> str:
    """The token in ``path``, made first (0600) if there is none. Written whole to a temporary
    file, then linked into place: a concurrent starter reads either no file or the whole token,
    and never replaces one that exists."""
    p = Path(path)
    if p.exists() or p.is_symlink():
        return read_token(p)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, (secrets.token_urlsafe(32) + "\n").encode())
        finally:
            os.close(fd)
        try:
            os.link(tmp, p)
        except FileExistsError:
            pass  # another process made it first: theirs is the token
    except OSError as e:
        raise ClusterError(f"cannot create the cluster token {p}: {e.strerror}") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return read_token(p)


__all__ = ["ADMIN", "HEADERS", "KEY_ID", "TENANT", "TENANT_NAME", "ensure_token", "read_token"]
