"""A tenant (or anyone on the node network) goes around the router, straight to a node (issue 39).

Measured before: a tenant key sent to a node's API was served there (``GET /v1/sandboxes`` with a
tenant key at a node's address: 200), so a tenant who could reach a node skipped the router's
placement and rate limit, and nothing on the node held creates to its slots. The router's calls
to a node, token included, went over plain HTTP.

Now a node's API answers only the router (the cluster token, over mutual TLS with a certificate
of the cluster's CA), admin keys and root on its socket; a tenant key is Forbidden (403) unless the
operator sets ``[cluster] direct_access = true``, and either way a node refuses a create past its
slots (NoCapacity, 503). A plain-HTTP connection, a TLS one without a client certificate and one
with a certificate of another CA get no answer at all; the router refuses a node whose certificate
is not of the cluster's CA (so an impostor at a node's address never sees the token).

Against a real `warmbox node join` (Ray head, PostgreSQL) on this host.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import ssl
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.attacks.cluster_node import OneNode, one_node
from warmbox import operations as ops
from warmbox.cluster import tls
from warmbox.cluster.router import Cluster
from warmbox.errors import ConnectionLost
from warmbox.models import NodeInfo
from warmbox.sdk.http import HttpTransport
from warmbox.server import peer

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]
SLOTS = 2
CREATE = {"tier": "container", "timeout": 300, "pool": False}


@pytest.fixture(scope="module")
def dsn(pg_server) -> Iterator[str]:
    url = pg_server.create_database()
    yield url
    pg_server.drop_database(url)


@pytest.fixture(scope="module")
def node(dsn: str, runc_ready: None) -> Iterator[OneNode]:
    with one_node(dsn, slots=SLOTS) as n:
        yield n


def _code(body: bytes) -> str:
    """The typed error's code of an answer ("" for an answer that is not an error)."""
    got = json.loads(body)
    return got["error"]["code"] if isinstance(got, dict) and "error" in got else ""


def test_a_tenant_key_at_a_node_is_refused(node: OneNode) -> None:
    _, mallory = node.registry.tenants.create_key("mallory")
    _, admin = node.registry.tenants.create_key("ops", admin=True)
    tenant = {"Authorization": f"Bearer {mallory}"}
    # over the router's own TLS, so only the node's API judges the key
    for method, path, body in (
        ("GET", "/v1/sandboxes", None),
        ("POST", "/v1/sandboxes", CREATE),
        ("POST", "/v1/snapshots/gc", {}),
    ):
        status, out = node.call(method, path, body, headers=tenant)
        assert (status, _code(out)) == (403, "forbidden"), (path, out[:300])
        assert b"router" in out  # says where tenant keys go
    # a forged peer header: a tenant key, or a guessed token, naming a tenant (as before)
    for bearer in (mallory, secrets.token_urlsafe(32), node.token[:-1]):
        for extra in ({peer.TENANT: "victim"}, {peer.TENANT: "mallory", peer.ADMIN: "1"}):
            status, out = node.call("GET", "/v1/sandboxes", headers={"Authorization": f"Bearer {bearer}", **extra})
            assert (status, _code(out)) == (401, "unauthenticated"), (bearer[:4], extra)
    assert node.registry.sandboxes.list(tenant="mallory") == []
    # controls: the router (token + tenant) and an admin key are served
    assert node.call("GET", "/v1/sandboxes")[0] == 200
    assert node.call("GET", "/v1/sandboxes", headers={"Authorization": f"Bearer {admin}"})[0] == 200


def _raw_plain(url: str, token: str) -> bytes:
    """A plain-HTTP request (the token in clear) to the node's TLS port: what comes back, if anything."""
    u = urllib.parse.urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(
            f"GET /v1/sandboxes HTTP/1.1\r\nHost: n1\r\nAuthorization: Bearer {token}\r\n"
            f"{peer.TENANT}: mallory\r\nConnection: close\r\n\r\n".encode()
        )
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
    return out


def test_a_node_refuses_plaintext_and_callers_without_a_cluster_certificate(node: OneNode) -> None:
    assert node.url.startswith("https://")
    assert not _raw_plain(node.url, node.token).startswith(b"HTTP/")  # no HTTP answer: TLS or nothing
    # TLS that trusts the node, but shows no certificate: refused in the handshake
    bare = ssl.create_default_context(cafile=str(node.tls_dir / tls.CA_CERT))
    with pytest.raises(OSError):
        node.call("GET", "/v1/sandboxes", context=bare, timeout=30)
    # a certificate of another CA (same names, another key): refused too
    with tempfile.TemporaryDirectory(prefix="wbca-") as other:
        tls.ensure_ca(Path(other))
        forged = tls.issue(Path(other), tls.ROUTER)
        ctx = ssl.create_default_context(cafile=str(node.tls_dir / tls.CA_CERT))
        ctx.load_cert_chain(str(forged.cert), str(forged.key))
        with pytest.raises(OSError):
            node.call("GET", "/v1/sandboxes", context=ctx, timeout=30)
    assert node.call("GET", "/v1/sandboxes")[0] == 200  # control: the router's certificate


class _Impostor:
    """A TLS server at 127.0.0.1 with a certificate of another CA (for 127.0.0.1): what it reads."""

    def __init__(self, cert: tls.Member) -> None:
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(str(cert.cert), str(cert.key))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(30)
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            try:
                with self.ctx.wrap_socket(conn, server_side=True) as tls_conn:
                    tls_conn.settimeout(10)
                    self.received += tls_conn.recv(65536)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        self.thread.join(30)


def test_the_router_refuses_a_node_that_is_not_of_the_cluster(node: OneNode, tmp_path: Path) -> None:
    other = tmp_path / "other-ca"
    tls.ensure_ca(other)
    impostor = _Impostor(tls.issue(other, tls.node_member("n1")))
    node_row = NodeInfo(name="n1", address=f"https://127.0.0.1:{impostor.port}", slots=1, tiers=("container",))
    cluster = Cluster(node.registry, node.token, lambda: None, node.router_context())  # type: ignore[arg-type,return-value]

    async def call() -> None:
        t = cluster.transport(node_row, None)
        try:
            await t.handle(ops.ListSandboxes())
        finally:
            await cluster.close()

    try:
        with pytest.raises(ConnectionLost, match="TLS"):
            asyncio.run(call())
    finally:
        impostor.close()
    assert node.token.encode() not in impostor.received and impostor.received == b""
    # a node row with a plain http:// address is never sent the token either
    plain = Cluster(node.registry, node.token, lambda: None, node.router_context())  # type: ignore[arg-type,return-value]
    with pytest.raises(ConnectionLost, match="without TLS"):
        plain.transport(NodeInfo(name="n1", address=node.url.replace("https://", "http://"), slots=1), None)


def test_a_node_holds_creates_to_its_slots(node: OneNode) -> None:
    """The router places by a view that may be stale (and several routers place at once): the node
    itself refuses the create past its slots, typed, and makes nothing."""
    made = []
    try:
        for _ in range(SLOTS):
            status, out = node.call("POST", "/v1/sandboxes", CREATE)
            assert status == 200, out[:500]
            made.append(json.loads(out)["info"]["sandbox_id"])
        status, out = node.call("POST", "/v1/sandboxes", CREATE)
        assert (status, _code(out)) == (503, "no_capacity"), out[:500]
        assert f"{SLOTS} slots".encode() in out
        assert sorted(i.sandbox_id for i, _ in node.registry.sandboxes.list(tenant="mallory")) == sorted(made)
    finally:
        for sid in made:
            node.call("DELETE", f"/v1/sandboxes/{sid}")


def test_with_direct_access_a_tenant_key_is_served_and_slots_still_hold(pg_fresh_dsn: str, runc_ready: None) -> None:
    config = "[daemon]\nidle_exit = 3\n\n[pools]\n\n[cluster]\ndirect_access = true\n"
    with one_node(pg_fresh_dsn, slots=1, config=config) as n:
        _, key = n.registry.tenants.create_key("carol")
        ca_only = ssl.create_default_context(cafile=str(n.tls_dir / tls.CA_CERT))  # a tenant has no cluster cert

        async def run() -> tuple[str, Exception | None]:
            t = HttpTransport(n.url, key, verify=ca_only)
            try:
                opened = await t.handle(ops.Create(tier="container", timeout=300, pool=False))
                try:
                    await t.handle(ops.Create(tier="container", timeout=300, pool=False))
                    refused = None
                except Exception as e:
                    refused = e
                await t.handle(ops.Kill(opened.info.sandbox_id))
                return opened.info.sandbox_id, refused
            finally:
                await t.close()

        sid, refused = asyncio.run(run())
        assert sid.startswith("sb-")
        assert type(refused).__name__ == "NoCapacity", refused
        assert [i.tenant for i, _ in n.registry.sandboxes.list(tenant="carol")] == []
