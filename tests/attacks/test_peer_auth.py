"""Attacks on cluster peer authentication, against a real `warmbox serve` (a node's API server is
the same app): a tenant's key, a guessed token, or any key on a server without a cluster token,
sent with the peer headers (X-Warmbox-Tenant / -Admin / -Key-Id) a router uses to say whom it
forwards for, must not act as another tenant, as an admin, or as the host's root."""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import start_server
from warmbox.engine.engine import Engine
from warmbox.server import peer

pytestmark = pytest.mark.sandbox


def _get(url: str, path: str, headers: dict[str, str], method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url + path, headers=headers, method=method, data=b"{}" if method == "POST" else None)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]["code"]


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("peer") / "cluster.token"
    peer.ensure_token(path)
    return path


@pytest.fixture(scope="module")
def node_server(home: Path, runc_ready: None, token_file: Path):
    srv = start_server(home, home / "peer.sock", env={"WARMBOX_CLUSTER__TOKEN_FILE": str(token_file)})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain_server(home: Path, runc_ready: None):
    srv = start_server(home, home / "peer-plain.sock")
    yield srv
    srv.stop()


def test_a_tenant_key_with_peer_headers_cannot_act_as_another_tenant_or_admin(node_server, home, token_file):
    _, mallory = Engine.for_home(home).registry.tenants.create_key("mallory")
    for extra in ({peer.TENANT: "victim"}, {peer.ADMIN: "1"}, {peer.TENANT: "mallory", peer.ADMIN: "1"}):
        h = {"Authorization": f"Bearer {mallory}", **extra}
        assert _get(node_server.url, "/v1/sandboxes", h) == (401, "unauthenticated"), extra
        assert _get(node_server.url, "/v1/snapshots/gc", h, "POST") == (401, "unauthenticated"), extra
    # control: the real token does act for the tenant it names
    token = peer.read_token(token_file)
    assert _get(node_server.url, "/v1/sandboxes", {"Authorization": f"Bearer {token}", peer.TENANT: "victim"})[0] == 200


def test_a_guessed_token_is_refused(node_server, token_file):
    token = peer.read_token(token_file)
    guesses = [
        secrets.token_urlsafe(32),
        token[:-1],
        token + "A",
        token.upper() if token.upper() != token else "x" * 43,
    ]
    for guess in guesses:
        for extra in ({peer.TENANT: "victim"}, {}):
            status, code = _get(
                node_server.url, "/v1/snapshots/gc", {"Authorization": f"Bearer {guess}", **extra}, "POST"
            )
            assert (status, code) == (401, "unauthenticated"), (guess, extra)


def test_a_server_without_a_cluster_token_refuses_peer_headers(plain_server, home):
    _, key = Engine.for_home(home).registry.tenants.create_key("mallory")
    for bearer in (key, secrets.token_urlsafe(32), ""):
        h = {peer.TENANT: "victim", peer.ADMIN: "1"}
        if bearer:
            h["Authorization"] = f"Bearer {bearer}"
        assert _get(plain_server.url, "/v1/sandboxes", h) == (401, "unauthenticated"), bearer
