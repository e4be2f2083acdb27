"""Port forwards (get_host) give the host a way in, never the sandbox a way out: while a forward is open
the sandbox still has no route anywhere; a connection storm on the host listener is bounded; a hostile
agent breaking the tunnel's rules (flooding past the window, acknowledging bytes never sent, garbage
frames, silence) is a typed error on the host, which holds a bounded amount of memory and stays up."""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import threading
import time

import pytest

from tests.attacks.conftest import http_server_source, scripted_agent
from tests.attacks.test_files_read import SMALL, PeakGrowth
from tests.conftest import wait_for
from warmbox import Sandbox
from warmbox import protocol as p
from warmbox.engine.guest_client import PORT_WINDOW, GuestClient
from warmbox.engine.session import GuestSession
from warmbox.errors import GuestConnectionError, GuestProtocolError, SandboxTimeout
from warmbox.sdk.ports import MAX_CONNECTIONS

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(240)]

SERVER = "cd /workspace && (python3 -m http.server 8000 >/dev/null 2>&1 &)"

# From inside the sandbox: every way out fails fast, while the host's forward is open and in use.
PROBE = r"""
import errno, socket, sys
targets = [("192.0.2.1", 80), ("127.0.0.1", int(sys.argv[1]))] + [(a, int(sys.argv[1])) for a in sys.argv[2:]]
for host, port in targets:
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, port))
        print("connected", host, port)
    except OSError as e:
        print("refused", host, port, errno.errorcode.get(e.errno, e))
    finally:
        s.close()
try:
    routes = [line.split()[1] for line in open("/proc/net/route").readlines()[1:]]
except OSError:
    routes = []
print("default route:", "00000000" in routes)
"""


def _host_addresses() -> list[str]:
    """This machine's own non-loopback IPv4 addresses (the sandbox must not reach them either)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines() if " lo " not in line][:4]


def test_an_open_forward_gives_the_sandbox_no_way_out(tier):
    with Sandbox.create(tier=tier, timeout=300, pool=False) as sb:
        sb.commands.run(SERVER)
        host = sb.get_host(8000, check=True, timeout=20)
        addr, port = host.rsplit(":", 1)
        assert addr == "127.0.0.1"  # the listener is on the host's loopback only
        held = socket.create_connection((addr, int(port)), timeout=10)  # a connection in use meanwhile
        try:
            held.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert held.recv(12).startswith(b"HTTP/1.")
            t0 = time.monotonic()
            r = sb.commands.run(["python3", "-c", PROBE, port, *_host_addresses()], timeout=60)
            assert r.exit_code == 0, r.stderr
            assert "connected" not in r.stdout, r.stdout
            assert r.stdout.count("refused") >= 2 and "default route: False" in r.stdout, r.stdout
            assert time.monotonic() - t0 < 40
            held.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # the forward still works meanwhile
        finally:
            held.close()


def _established_on_8000(sb) -> int:
    """Server-side TCP connections on the sandbox's port 8000 (its /proc/net/tcp and tcp6)."""
    r = sb.commands.run("cat /proc/net/tcp /proc/net/tcp6 2>/dev/null")
    n = 0
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[1].endswith(":1F40") and parts[3] == "01":
            n += 1
    return n


def test_a_connection_storm_on_the_forward_is_bounded(home, runc_ready):
    with Sandbox.create(tier="container", timeout=300, pool=False) as sb:
        sb.commands.run(SERVER)
        addr, port = sb.get_host(8000, check=True, timeout=20).rsplit(":", 1)
        storm = []
        try:
            for _ in range(4 * MAX_CONNECTIONS):
                s = socket.socket()
                s.settimeout(10)
                try:
                    s.connect((addr, int(port)))
                except OSError:
                    s.close()
                    continue
                storm.append(s)
            time.sleep(1)
            inside = _established_on_8000(sb)
            assert 0 < inside <= MAX_CONNECTIONS, inside  # the rest were dropped at once, not queued
        finally:
            for s in storm:
                s.close()
        wait_for(lambda: _established_on_8000(sb) == 0, 30, "the storm's tunnels to close in the sandbox")
        with socket.create_connection((addr, int(port)), timeout=10) as s:  # and the forward still serves
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert s.recv(12).startswith(b"HTTP/1.0 200")
        assert sb.commands.run("echo ok").stdout == "ok\n"


# ---- a hostile agent (the guest is untrusted): a scripted agent on a temp socket


def _hostile_agent(path: str, case: str, stop: threading.Event) -> threading.Thread:
    def script(conn: socket.socket, req: p.Message | None) -> None:
        assert isinstance(req, p.PortConnect) and req.window > 0
        if case == "never answers":
            stop.wait(30)
            return
        conn.sendall(p.encode(p.Ok(req.id)))
        if case == "floods past the window":
            frame = p.encode(p.Chunk(req.id, data=bytes(p.CHUNK)))
            for _ in range((512 << 20) // p.CHUNK):
                if stop.is_set():
                    break
                conn.sendall(frame)
        elif case == "acknowledges bytes never sent":
            conn.sendall(p.encode(p.PortAck(req.id, bytes=1 << 40)))
        elif case == "sends a garbage frame":
            conn.sendall(struct.pack(">II", 1 << 30, 1 << 30) + b"x" * 64)
        stop.wait(30)

    return scripted_agent(path, script)


@pytest.mark.parametrize(
    "case", ["floods past the window", "acknowledges bytes never sent", "sends a garbage frame", "never answers"]
)
def test_a_hostile_agent_cannot_bloat_or_hang_the_host_through_a_tunnel(tmp_path, case):
    path = str(tmp_path / "agent.sock")
    stop = threading.Event()
    thread = _hostile_agent(path, case, stop)

    async def run() -> int:
        session = GuestSession(await GuestClient.connect(path, "sb-hostile"))
        try:
            if case == "never answers":
                with pytest.raises(SandboxTimeout):
                    await session.connect_port(8000, timeout=1)
                return 0
            stream = await session.connect_port(8000)
            with PeakGrowth() as mem:
                await asyncio.sleep(1.0)  # a reader that takes nothing for a while
                with pytest.raises((GuestProtocolError, GuestConnectionError)):
                    got = 0
                    while True:
                        await stream.write(bytes(PORT_WINDOW))  # past the window: needs the agent's acks
                        data = await asyncio.wait_for(stream.read(), 10)
                        assert data is not None
                        got += len(data)
            stream.close()
            return mem.growth
        finally:
            stop.set()
            await session.close()

    growth = asyncio.run(run())
    thread.join(10)
    assert growth < SMALL, f"a hostile agent made the host hold {growth >> 20} MiB"


# ---- a hostile server in the sandbox behind the HTTP preview route

HOSTILE_SERVER = http_server_source(
    r"""
answers = {
    b"/split": b"HTTP/1.0 200 OK\r\nX-A: a\nSet-Cookie: evil=1\r\nContent-Type: text/html\r\n\r\n"
    b"<script>steal()</script>",
    b"/bighead": b"HTTP/1.0 200 OK\r\n" + b"X-Big: " + b"b" * (200 << 10) + b"\r\n\r\nbody",
    b"/garbage": b"NOT HTTP AT ALL\r\n\r\n",
    b"/status": b"HTTP/1.0 999 Nope\r\n\r\n",
}
"""
)


def test_a_hostile_server_cannot_split_or_script_the_preview(home, runc_ready):
    from tests.conftest import start_server
    from tests.server.test_api import UnixHTTPConnection
    from warmbox import api

    server = start_server(home, home / "ports-attack.sock", tcp=False)
    try:
        with Sandbox.create(tier="container", timeout=300, pool=False, api_url=server.unix_url) as sb:
            sb.files.write("/workspace/hostile.py", HOSTILE_SERVER)
            sb.commands.run("cd /workspace && (python3 hostile.py >/tmp/h.log 2>&1 &)")
            sb.get_host(8000, check=True, timeout=20)

            def get(path: str) -> tuple[int, dict[str, str], bytes]:
                conn = UnixHTTPConnection(server.socket, 30)
                try:
                    conn.request("GET", f"{api.PREFIX}/sandboxes/{sb.sandbox_id}/ports/8000{path}")
                    r = conn.getresponse()
                    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
                finally:
                    conn.close()

            status, headers, body = get("/split")
            assert status == 200 and body == b"<script>steal()</script>", (status, body)
            assert "set-cookie" not in headers and "x-a" not in headers, headers  # the split line is dropped
            assert headers["content-security-policy"] == "sandbox" and headers["x-content-type-options"] == "nosniff"
            for path in ("/bighead", "/garbage", "/status"):
                status, _, body = get(path)
                assert status == 502 and b"sandbox_error" in body, (path, status, body[:200])
            assert get("/ok")[0] == 200  # the server (and the route) still serve
    finally:
        assert server.stop() == 0, server.output()


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_tunnel_client_flooding_a_server_that_never_reads_holds_bounded_server_memory(home, runc_ready):
    """A tenant's WebSocket pushing data at a sandbox server that never reads: the API server holds
    at most the tunnel's window and a few messages (its reads stop), and an oversized message ends
    the WebSocket."""
    import aiohttp

    from tests.conftest import start_server
    from warmbox import api
    from warmbox import operations as ops
    from warmbox.engine.engine import Engine

    server = start_server(home, home / "ports-flood.sock")
    try:
        _k, key = Engine.for_home(home).registry.tenants.create_key("port-flood")
        with Sandbox.create(tier="container", timeout=300, pool=False, api_url=server.url, api_key=key) as sb:
            sb.commands.run(
                '(python3 -c \'import socket,time; s=socket.socket(); s.bind(("127.0.0.1", 8000)); s.listen(4); '
                "c=s.accept(); time.sleep(600)' >/dev/null 2>&1 &)"
            )
            sb.get_host(8000, check=True, timeout=20)
            path = api.BY_OP[ops.Op.PORTS_CONNECT].path.format(sandbox_id=sb.sandbox_id)

            async def flood() -> tuple[int, int, object]:
                async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
                    base = _rss_kib(server.proc.pid)
                    sent = 0
                    async with session.ws_connect(f"{server.url}{path}", params={"port": "8000"}) as ws:
                        assert (await ws.receive(timeout=30)).data == '{"ok":true}'
                        chunk = bytes(1 << 20)  # the largest message the server takes
                        try:
                            async with asyncio.timeout(8):
                                while sent < (1 << 30):
                                    await ws.send_bytes(chunk)
                                    sent += len(chunk)
                        except TimeoutError:
                            pass  # the sends stopped: the server no longer reads
                        peak = _rss_kib(server.proc.pid) - base
                    async with session.ws_connect(f"{server.url}{path}", params={"port": "8000"}) as ws:
                        assert (await ws.receive(timeout=30)).data == '{"ok":true}'
                        try:
                            await ws.send_bytes(bytes(4 << 20))  # over the server's message bound
                            end: object = (await ws.receive(timeout=30)).type
                        except (aiohttp.ClientError, ConnectionError):
                            end = "reset"  # the server closed while the message was still coming
                    return sent, peak, end

            sent, peak_kib, end = asyncio.run(flood())
            assert sent < 256 << 20, f"the server took {sent >> 20} MiB from a tunnel nobody reads"
            assert peak_kib < 64 << 10, f"the server's memory rose by {peak_kib >> 10} MiB"
            assert end in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, "reset"), end
            assert sb.commands.run("echo ok").stdout == "ok\n"
    finally:
        assert server.stop() == 0, server.output()
