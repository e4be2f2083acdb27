"""Cluster peer authentication in process (Starlette's test client, no sandbox): the cluster token
plus X-Warmbox-Tenant is that tenant; the headers with anything but the token are refused."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from warmbox.config import ServerSettings
from warmbox.engine.engine import Engine
from warmbox.errors import ClusterError
from warmbox.server import peer
from warmbox.server.app import build_app


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    return tmp_path / "cluster.token"


@pytest.fixture
def engine(tmp_path, monkeypatch, token_file):
    monkeypatch.setenv("WARMBOX_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("WARMBOX_CLUSTER__TOKEN_FILE", str(token_file))
    peer.ensure_token(token_file)
    return Engine.for_home(tmp_path / "home")


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, ServerSettings(), mcp=False), raise_server_exceptions=False) as c:
        yield c


def _code(r) -> str:
    return r.json()["error"]["code"]


def test_the_token_with_a_tenant_header_is_that_tenant(client, engine, token_file):
    token = peer.read_token(token_file)
    engine.registry.tenants.create_key("acme", max_sandboxes=1)
    h = {"Authorization": f"Bearer {token}", peer.TENANT: "acme"}
    assert client.get("/v1/sandboxes", headers=h).status_code == 200
    # not an admin unless the router says the caller's key is one
    r = client.post("/v1/snapshots/gc", headers=h, json={})
    assert r.status_code == 403 and _code(r) == "forbidden"
    r = client.post("/v1/snapshots/gc", headers={**h, peer.ADMIN: "1"}, json={})
    assert r.status_code == 200, r.text
    # a tenant with no recorded quotas is still that tenant (unlimited), as a mapped uid's
    assert client.get("/v1/sandboxes", headers={**h, peer.TENANT: "newcomer"}).status_code == 200
    # the token alone is the host's root
    r = client.post("/v1/snapshots/gc", headers={"Authorization": f"Bearer {token}"}, json={})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name", ["", " acme", "a/b", "-x", "x" * 65, "acme\u00e9".encode()])
def test_a_malformed_tenant_header_is_refused(client, token_file, name: str | bytes):
    h = {"Authorization": f"Bearer {peer.read_token(token_file)}", peer.TENANT: name}
    r = client.get("/v1/sandboxes", headers=h)
    assert r.status_code == 401 and _code(r) == "unauthenticated", name


def test_peer_headers_need_the_token(client, engine, token_file):
    _, secret = engine.registry.tenants.create_key("mallory")
    token = peer.read_token(token_file)
    for auth in (f"Bearer {secret}", f"Bearer {token[:-1]}", f"Bearer {token}x", "Bearer " + "A" * len(token), None):
        for extra in ({peer.TENANT: "acme"}, {peer.ADMIN: "1"}, {peer.KEY_ID: "k1"}):
            h = dict(extra, **({"Authorization": auth} if auth else {}))
            r = client.get("/v1/sandboxes", headers=h)
            assert r.status_code == 401 and _code(r) == "unauthenticated", (auth, extra)
    # the key alone still works
    assert client.get("/v1/sandboxes", headers={"Authorization": f"Bearer {secret}"}).status_code == 200


def test_without_a_token_the_headers_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMBOX_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.delenv("WARMBOX_CLUSTER__TOKEN_FILE", raising=False)
    engine = Engine.for_home(tmp_path / "plain")
    with TestClient(build_app(engine, ServerSettings(), mcp=False), raise_server_exceptions=False) as c:
        r = c.get("/v1/sandboxes", headers={"Authorization": "Bearer " + "t" * 43, peer.TENANT: "acme"})
        assert r.status_code == 401 and "no [cluster] token_file" in r.json()["error"]["message"]


def test_the_token_file_is_made_0600_once_and_checked(tmp_path):
    path = tmp_path / "t"
    tokens: list[str] = []
    threads = [threading.Thread(target=lambda: tokens.append(peer.ensure_token(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(tokens)) == 1 and len(tokens[0]) >= peer.MIN_TOKEN
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]  # no temporary file left
    os.chmod(path, 0o644)
    with pytest.raises(ClusterError, match="readable by others"):
        peer.read_token(path)
    os.chmod(path, 0o600)
    path.write_text("short\n")
    with pytest.raises(ClusterError, match="printable characters"):
        peer.read_token(path)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(ClusterError, match="cannot read"):
        peer.read_token(link)
    with pytest.raises(ClusterError, match="cannot read"):
        peer.read_token(tmp_path / "missing")
