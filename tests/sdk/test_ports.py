"""Ports: a server in the sandbox reached from the host through get_host (a tunnel over the agent's
connection; the sandbox gets no network by it)."""

from __future__ import annotations

import concurrent.futures
import http.client
import socket
import time

import pytest

from tests.conftest import wait_for
from warmbox import AsyncSandbox, InvalidArgument, PortNotListening, Sandbox, SandboxNotFound
from warmbox.sdk.ports import CONNECT_WAIT_S

SERVER = "cd /workspace && (python3 -m http.server {port} >/tmp/http-{port}.log 2>&1 &)"


def _http_get(host: str, path: str = "/", timeout: float = 30) -> tuple[int, bytes]:
    addr, port = host.rsplit(":", 1)
    conn = http.client.HTTPConnection(addr, int(port), timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _unix_get(path: str, url: str = "/", timeout: float = 30) -> tuple[int, bytes]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(f"GET {url} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _serve(sb, port: int = 8000) -> str:
    sb.commands.run(SERVER.format(port=port))
    return sb.get_host(port, check=True, timeout=20)


@pytest.fixture(scope="module")
def box(home, runc_ready):
    with Sandbox.create(tier="container", timeout=600) as sb:
        yield sb


@pytest.mark.sandbox
def test_a_server_in_the_sandbox_is_reachable_from_the_host(box):
    box.files.write("/workspace/hello.txt", "hello from the sandbox")
    host = _serve(box)
    assert host.startswith("127.0.0.1:")
    assert _http_get(host, "/hello.txt") == (200, b"hello from the sandbox")
    assert box.get_host(8000) == host  # one forward per port
    for _ in range(5):  # a bounded number of requests, each a connection of its own
        assert _http_get(host, "/hello.txt")[0] == 200


@pytest.mark.sandbox
def test_concurrent_connections_and_a_large_body(box):
    blob = bytes(range(256)) * (24 << 12)  # 24 MiB: many windows' worth each way
    box.files.write("/workspace/big.bin", blob)
    host = _serve(box)
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda _: _http_get(host, "/big.bin", 120), range(2)))
    assert got == [(200, blob), (200, blob)], [(s, len(b)) for s, b in got]
    assert time.monotonic() - t0 < 60


@pytest.mark.sandbox
def test_a_connection_waits_for_a_server_still_starting(box):
    box.files.write("/workspace/late.txt", "late")
    host = box.get_host(8003)  # nothing listens yet
    box.commands.run("cd /workspace && (sleep 1.5; python3 -m http.server 8003 >/dev/null 2>&1) >/dev/null 2>&1 &")
    assert _http_get(host, "/late.txt") == (200, b"late")


@pytest.mark.sandbox
def test_unix_socket_forward(box):
    import os
    import stat

    box.files.write("/workspace/u.txt", "over a unix socket")
    _serve(box)
    path = box.get_host(8000, unix=True)
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert _unix_get(path, "/u.txt") == (200, b"over a unix socket")


@pytest.mark.sandbox
def test_nothing_listening_is_a_typed_error(box):
    t0 = time.monotonic()
    with pytest.raises(PortNotListening, match="8123"):
        box.get_host(8123, check=True, timeout=1)
    assert time.monotonic() - t0 < 10
    host = box.get_host(8124)  # no check: the forward exists; a connection waits for a server, then closes
    addr, port = host.rsplit(":", 1)
    t0 = time.monotonic()
    with socket.create_connection((addr, int(port)), timeout=10) as s:
        s.settimeout(CONNECT_WAIT_S + 10)
        assert s.recv(1) == b""
    assert CONNECT_WAIT_S - 0.5 < time.monotonic() - t0 < CONNECT_WAIT_S + 5
    with pytest.raises(InvalidArgument):
        box.get_host(0)
    with pytest.raises(InvalidArgument):
        box.get_host(70000)


@pytest.mark.sandbox
async def _async_forward_goes_with_the_sandbox() -> None:
    sb = await AsyncSandbox.create(tier="container", timeout=120)
    try:
        await sb.commands.run(SERVER.format(port=8001))
        host = await sb.get_host(8001, check=True, timeout=20)
        addr, port = host.rsplit(":", 1)
    finally:
        await sb.kill()
    with pytest.raises(OSError):
        socket.create_connection((addr, int(port)), timeout=5).close()
    with pytest.raises(SandboxNotFound):
        await sb.get_host(8001)


@pytest.mark.sandbox
def test_the_forward_goes_with_the_sandbox(home, runc_ready):
    import asyncio

    asyncio.run(_async_forward_goes_with_the_sandbox())


@pytest.mark.sandbox
def test_the_forward_closes_when_the_sandbox_is_killed_elsewhere(home, runc_ready):
    sb = Sandbox.create(tier="container", timeout=120)
    try:
        host = _serve(sb, 8002)
        assert _http_get(host)[0] == 200
        Sandbox.connect(sb.sandbox_id).kill()  # another client ends it
        addr, port = host.rsplit(":", 1)

        def refused() -> bool:
            try:
                with socket.create_connection((addr, int(port)), timeout=5) as s:
                    s.settimeout(5)
                    assert s.recv(1) == b""  # accepted, then closed: nothing to relay to
                return False
            except ConnectionRefusedError:
                return True

        wait_for(refused, 15, "the forward to close after the sandbox ended")
    finally:
        sb.close()


@pytest.mark.sandbox
@pytest.mark.parametrize("tier", ["gvisor", "microvm"])
def test_other_tiers(home, runc_ready, tier):
    from warmbox.engine.engine import Engine

    avail = Engine.for_home(home).backend(tier).probe()
    if not avail.available:
        pytest.skip(f"{tier}: {avail.reason}")
    with Sandbox.create(tier=tier, timeout=300) as sb:
        sb.files.write("/workspace/t.txt", tier)
        host = _serve(sb)
        assert _http_get(host, "/t.txt") == (200, tier.encode())


@pytest.mark.sandbox
@pytest.mark.one_host("watches the sandbox's state in the session home's engine")
def test_an_open_connection_keeps_an_idle_sandbox_from_pausing(home, runc_ready):
    from warmbox import Lifecycle, State
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    sb = Sandbox.create(tier="container", timeout=300, lifecycle=Lifecycle(idle_pause_after=2))
    try:
        addr, port = _serve(sb, 8004).rsplit(":", 1)
        with socket.create_connection((addr, int(port)), timeout=10) as held:  # open, silent
            time.sleep(1)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5:  # more than twice the idle time
                assert engine.info(sb.sandbox_id)[0].state is not State.PAUSED, "paused under an open connection"
                time.sleep(0.25)
            held.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert held.recv(12).startswith(b"HTTP/1.0 200")
        wait_for(lambda: engine.info(sb.sandbox_id)[0].state is State.PAUSED, 30, "the idle pause once it closed")
        # paused (no auto-resume): a connection is closed, the forward itself stays for after a resume
        with socket.create_connection((addr, int(port)), timeout=10) as s:
            s.settimeout(10)
            assert s.recv(1) == b""
        with socket.create_connection((addr, int(port)), timeout=10):
            pass
    finally:
        sb.kill()
