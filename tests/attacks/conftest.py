"""Attack tests: each runs one attack from a hostile sandbox user against a real sandbox.

This folder is the list of what warmbox withstands; ``warmbox doctor --security`` names the
test that proves each guarantee. Tests are parametrised over the tiers an attack applies to.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.backends.conftest import debian_layer, qemu_pids  # noqa: F401  (debian_layer: a fixture)
from tests.conftest import wait_for
from tests.templates.conftest import oci_layout, python_rootfs  # noqa: F401  (fixtures: an OCI image with python3)
from warmbox import protocol as p
from warmbox.engine import teardown
from warmbox.engine.daemon import down_home
from warmbox.engine.engine import Engine
from warmbox.paths import runtime_dir

pytestmark = pytest.mark.sandbox


def require_tier(home, tier: str) -> Engine:
    """The engine of the session home; the tier must run here (bootstrap installs every tier)."""
    engine = Engine.for_home(home)
    avail = engine.backend(tier).probe()
    if not avail.available:
        pytest.fail(f"the {tier} tier must run here (scripts/bootstrap installs it): {avail.reason}")
    return engine


@pytest.fixture(params=["container", "gvisor"])
def tier(request, home, runc_ready) -> str:
    """The shared-filesystem tiers (microVM attacks live in their own modules: at most two VMs)."""
    require_tier(home, request.param)
    return request.param


def scripted_agent(path: str, script: Callable[[socket.socket, p.Message | None], None]) -> threading.Thread:
    """A hostile agent (the guest is untrusted) on the unix socket ``path``, on a thread of its own:
    it takes one connection, reads the host's first request and hands both to ``script``; the
    host dropping the connection (OSError) ends it quietly; then both sockets are closed."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            script(conn, p.recv_message(conn, p.HOST_TO_GUEST))
        except OSError:
            pass
        finally:
            conn.close()
            listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def http_server_source(answers: str) -> str:
    """A hostile HTTP server's Python source, to run in the sandbox on 127.0.0.1:8000: ``answers``
    (source) defines the dict ``answers`` of request path -> raw response bytes; it reads a request
    head, sends the answer for its path (else a plain 200 "fine") and closes."""
    return (
        "import socket\n"
        + answers.strip("\n")
        + r"""
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 8000))
srv.listen(16)
while True:
    c, _ = srv.accept()
    data = b""
    while b"\r\n\r\n" not in data:
        part = c.recv(65536)
        if not part:
            break
        data += part
    path = data.split(b" ")[1] if data.count(b" ") >= 2 else b"/"
    try:
        c.sendall(answers.get(path, b"HTTP/1.0 200 OK\r\n\r\nfine"))
    except OSError:
        pass
    c.close()
"""
    )


def home_procs(home: Path, arg: bytes = b"") -> list[int]:
    """Running processes with ``home`` as one of their arguments (and ``arg`` as another, if given):
    a home's daemon (``warmbox.engine.daemon``) and guard (``--guard``), found by command line."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            stat = (proc / "stat").read_bytes()
        except OSError:
            continue
        if stat[stat.rindex(b")") + 2 :][:1] in (b"Z", b"X") or str(home).encode() not in cmd:
            continue
        if not arg or arg in cmd:
            out.append(int(proc.name))
    return out


@pytest.fixture
def private_home(runc_ready):
    """A home of its own: its daemon is the one killed (the session's keeps serving the others);
    nothing of it (sandboxes, VMs, daemon, guard, dirs) outlives the test."""
    h = Path(f"/tmp/wbd-{secrets.token_hex(3)}")
    h.mkdir(mode=0o700)
    (h / "warmbox.toml").write_text("[daemon]\nidle_exit = 2\n")
    engine = Engine(h)
    try:
        yield engine
    finally:
        from warmbox.engine.daemon import down_home

        asyncio.run(down_home(h))
        for info in engine.list(include_pooled=True):
            asyncio.run(teardown.destroy(engine, info.sandbox_id, "test cleanup"))
        left = qemu_pids(engine.runtime)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not home_procs(h), 15, "the daemon and its guard to end")
        shutil.rmtree(engine.runtime, ignore_errors=True)
        shutil.rmtree(h, ignore_errors=True)
        assert not left, f"QEMU or relay processes left behind: {left}"


def create_over_api(url: str, key: str) -> tuple[int, dict]:
    """POST /v1/sandboxes (a container, 60 s) with ``key``: (status, JSON answer)."""
    body = json.dumps({"tier": "container", "timeout": 60}).encode()
    req = urllib.request.Request(
        url + "/v1/sandboxes",
        data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def kill_over_api(url: str, key: str, sid: str) -> None:
    req = urllib.request.Request(
        f"{url}/v1/sandboxes/{sid}", headers={"Authorization": f"Bearer {key}"}, method="DELETE"
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status in (200, 204)


def end_node_server(srv, router, key: str, home: Path) -> None:
    """Teardown of a test's node server: whatever a failed run left is ended by the server
    (``key``'s sandboxes), then the server, its home's daemon, runtime dir and home."""
    for info, _ in router.sandboxes.list(include_pooled=True):
        try:
            kill_over_api(srv.url, key, info.sandbox_id)
        except (OSError, urllib.error.HTTPError):
            pass
    srv.stop()
    asyncio.run(down_home(home))
    shutil.rmtree(runtime_dir(home), ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)
    router.close()


def read_answer(conn, r, stream_s: float | None) -> bytes:
    """``r``'s body; an NDJSON stream (endless: approvals, process output) is read for
    ``stream_s`` seconds only (None: to its end)."""
    if stream_s is None or not r.getheader("content-type", "").startswith("application/x-ndjson"):
        return r.read()
    assert conn.sock is not None
    conn.sock.settimeout(stream_s)
    data = b""
    try:
        while chunk := r.read1(65536):
            data += chunk
    except TimeoutError:
        pass
    return data
