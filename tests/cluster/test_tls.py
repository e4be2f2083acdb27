"""The lane's cluster runs on mutual TLS (issue 39): every node's API is https and refuses a
plain-HTTP caller and one without a certificate of the cluster's CA, a tenant key is refused there,
and every Ray process of every node runs with Ray's TLS on. (The attacks themselves, on a node of
their own: tests/attacks/test_node_access.py, test_ray_auth.py.)"""

from __future__ import annotations

import json
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.cluster.harness import NODE_MARK, _environ, marked
from warmbox.cluster import tls
from warmbox.server import peer

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]


def _get(url: str, headers: dict[str, str], context: ssl.SSLContext) -> tuple[int, str]:
    req = urllib.request.Request(url + "/v1/sandboxes", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]["code"]


def _plain(url: str, token: str) -> bytes:
    u = urllib.parse.urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(f"GET /v1/sandboxes HTTP/1.1\r\nHost: n\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
        s.settimeout(10)
        try:
            return s.recv(65536)
        except OSError:
            return b""


def test_every_node_of_the_lane_speaks_only_mutual_tls(cluster):
    token = cluster.token_file.read_text().strip()
    router = cluster.member(tls.ROUTER).client_context()
    bare = ssl.create_default_context(cafile=str(cluster.dir / tls.CA_CERT))
    _, key = cluster.registry().tenants.create_key("tls-lane")
    for name in cluster.nodes:
        url = cluster.node_row(name).address
        assert url.startswith("https://"), url
        assert not _plain(url, token).startswith(b"HTTP/"), name  # the token in clear gets no HTTP answer
        with pytest.raises(OSError):
            _get(url, {"Authorization": f"Bearer {token}"}, bare)  # no client certificate
        assert _get(url, {"Authorization": f"Bearer {token}", peer.TENANT: "tls-lane"}, router) == (200, "")
        assert _get(url, {"Authorization": f"Bearer {key}"}, router) == (403, "forbidden")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_every_ray_process_of_the_nodes_runs_with_rays_tls(cluster):
    # the raylets warmbox starts: a short-lived process Ray spawns (seen once: RAY_USE_TLS without
    # the CA variable) is Ray's to configure, and this test checks what warmbox gives Ray
    for name, node in cluster.nodes.items():
        pids = [
            p
            for p in marked(NODE_MARK, node.env[NODE_MARK])
            if b"RAY_USE_TLS" in _environ(p) and b"raylet" in _cmdline(p).split(b"\0")[0]
        ]
        assert pids, f"node {name}: no raylet with RAY_USE_TLS"
        for pid in pids:
            env = _environ(pid)
            assert env[b"RAY_USE_TLS"] == b"1"
            assert env[b"RAY_TLS_CA_CERT"] == str(cluster.dir / tls.CA_CERT).encode()
            assert env[b"RAY_TLS_SERVER_CERT"].endswith(f"node-{name}.crt".encode())
