"""Idempotency keys over a real `warmbox serve`, each test doing what an agent framework does when
it replays a step (a checkpoint resumed, a retry after a timeout): the step never runs twice.

- the client is killed mid-command and the step replayed: it attaches to the same run, one
  process ran, and a later replay gets the same recorded result;
- the HTTP transport's own retry of a dropped connection (its automatic key) runs nothing twice;
- the same key with other arguments is a 409; two tenants using one key string do not collide;
- a replay after the server restarts gets the recorded result; one whose server died mid-command
  is OutcomeUnknown, and the command is not run again;
- E2B's create with its Idempotency-Key header returns the same sandbox.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import cli, start_server, wait_for
from warmbox import AsyncSandbox, Sandbox
from warmbox.engine.engine import Engine
from warmbox.errors import ConnectionLost, IdempotencyConflict, OutcomeUnknown, WarmboxError
from warmbox.sdk.http import HttpTransport

pytestmark = pytest.mark.sandbox

# one line per run in the sandbox, then (after a pause: time to cut or kill the caller) the count
STEP = "echo start; echo $$ >> /workspace/{f}; sleep {s}; echo runs=$(wc -l < /workspace/{f})"


@pytest.fixture(scope="module")
def server(home: Path, runc_ready: None):
    srv = start_server(home, home / "idem.sock")
    registry = Engine.for_home(home).registry
    srv.client_env = {"a": registry.tenants.create_key("idem-a")[1], "b": registry.tenants.create_key("idem-b")[1]}
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def box(server):
    with Sandbox.create(
        tier="container", timeout=600, pool=False, api_url=server.url, api_key=server.client_env["a"]
    ) as sb:
        yield sb


def _lines(sb: Sandbox, name: str) -> int:
    return int(sb.commands.run(f"cat /workspace/{name} 2>/dev/null | wc -l").stdout)


_CLIENT = """
import sys
from warmbox import Sandbox
sb = Sandbox.connect(sys.argv[1], api_url=sys.argv[2], api_key=sys.argv[3])
sb.commands.run(sys.argv[4], idempotency_key=sys.argv[5], timeout=60, on_stdout=print)  # streamed: the
print("finished")  # server sees the connection end at once (not at its next heartbeat)
"""


def test_a_client_killed_mid_command_then_replayed_runs_it_once(server, box):
    cmd = STEP.format(f="killed", s=3)
    client = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, box.sandbox_id, server.url, server.client_env["a"], cmd, "step-1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: _lines(box, "killed") == 1, 60, "the client's command to start", interval=0.05)
    finally:
        client.kill()
        client.wait(10)
    assert b"finished" not in client.stdout.read()  # type: ignore[union-attr]
    client.stdout.close()  # type: ignore[union-attr]
    started = time.monotonic()
    attached = box.commands.run(cmd, idempotency_key="step-1")  # still running: waits for that run
    assert time.monotonic() - started < 10
    assert (attached.exit_code, attached.stdout) == (0, "start\nruns=1\n")
    again = box.commands.run(cmd, idempotency_key="step-1")  # finished: its record
    assert again == attached
    assert _lines(box, "killed") == 1


class _CuttingProxy:
    """A loopback TCP proxy to the server that cuts the connection of the next request whose head
    has ``mark`` ``after`` seconds after it passed (the network dropping mid-command)."""

    def __init__(self, target: str, mark: bytes, after: float = 0.6) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.mark, self.after = mark, after
        self.armed = threading.Event()
        self.cut = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, outgoing: bool) -> None:
        try:
            while data := src.recv(65536):
                if outgoing and self.armed.is_set() and self.mark in data:
                    self.armed.clear()
                    threading.Timer(self.after, self._close, (src, dst)).start()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._close(src, dst)

    def _close(self, *socks: socket.socket) -> None:
        for s in socks:
            if s.fileno() != -1:
                self.cut += 1
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


def test_the_http_transports_own_retry_of_a_dropped_command_runs_it_once(server, box):
    proxy = _CuttingProxy(server.url, b"/commands")
    via = Sandbox.connect(box.sandbox_id, api_url=proxy.url, api_key=server.client_env["a"])
    try:
        proxy.armed.set()
        got = via.commands.run(STEP.format(f="auto", s=2))  # no key of the caller's: the transport's own
        assert not proxy.armed.is_set() and (got.exit_code, got.stdout) == (0, "start\nruns=1\n")
        assert _lines(box, "auto") == 1
        # without the transport's key the drop is an unknown outcome (what the key fixes)
        proxy.armed.set()
        asyncio.run(_unkeyed_drop(box.sandbox_id, proxy.url, server.client_env["a"]))
    finally:
        via.close()
        proxy.close()


async def _unkeyed_drop(sandbox_id: str, url: str, key: str) -> None:
    t = HttpTransport(url, key, idempotency=False)
    try:
        sb = await AsyncSandbox.connect(sandbox_id, transport=t)
        with pytest.raises(ConnectionLost, match=r"may or may not|outcome is unknown"):
            await sb.commands.run(STEP.format(f="bare", s=2))
    finally:
        await t.close()


def test_a_key_reused_with_other_arguments_is_a_conflict(server, box, home):
    # a create refused before it made anything frees its key (a repeat runs it again), as Stripe's do
    with pytest.raises(WarmboxError, match="no-such"):
        Sandbox.create(
            tier="container",
            template="no-such",
            idempotency_key="bad",
            api_url=server.url,
            api_key=server.client_env["a"],
        )
    assert Engine.for_home(home).registry.idempotency.key_record("idem-a", "", "bad") is None
    first = box.commands.run("echo one", idempotency_key="step-c")
    with pytest.raises(IdempotencyConflict, match="other arguments"):
        box.commands.run("echo two", idempotency_key="step-c")
    with pytest.raises(IdempotencyConflict, match="used for a command, not a code run"):
        box.run_code("1 + 1", idempotency_key="step-c")
    assert box.commands.run("echo one", idempotency_key="step-c") == first
    # the CLI's --idempotency-key, a piped stdin part of what a repeat must match
    env = {"WARMBOX_API_URL": server.url, "WARMBOX_API_KEY": server.client_env["a"]}
    argv = ("exec", box.sandbox_id, "--json", "--idempotency-key", "cli-1", "--", "sh", "-c", STEP.format(f="cli", s=0))
    runs = [cli(*argv, env=env, input="in") for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    assert json.loads(runs[0].stdout)["stdout"] == json.loads(runs[1].stdout)["stdout"] == "start\nruns=1\n"
    other = cli(*argv, env=env, input="other")
    assert other.returncode != 0 and "other arguments" in other.stderr


def test_two_tenants_using_one_key_string_do_not_collide(server, box):
    kw = {"timeout": 120, "pool": False, "api_url": server.url}
    a = Sandbox.create(tier="container", api_key=server.client_env["a"], idempotency_key="create-1", **kw)
    b = Sandbox.create(tier="container", api_key=server.client_env["b"], idempotency_key="create-1", **kw)
    try:
        assert a.sandbox_id != b.sandbox_id
        again = Sandbox.create(tier="container", api_key=server.client_env["a"], idempotency_key="create-1", **kw)
        assert again.sandbox_id == a.sandbox_id  # a repeat creates nothing
        with pytest.raises(IdempotencyConflict):
            Sandbox.create(
                tier="container", api_key=server.client_env["a"], idempotency_key="create-1", **{**kw, "timeout": 60}
            )
        # B's command under a key A used on its own sandbox runs (its own key), and sees nothing of A's
        ran = b.commands.run("echo b", idempotency_key="step-c")
        assert ran.stdout == "b\n"
    finally:
        a.kill()
        b.kill()
    ended = Sandbox.create(tier="container", api_key=server.client_env["a"], idempotency_key="create-1", **kw)
    assert ended.sandbox_id == a.sandbox_id  # the same id after it ended; using it says so
    with pytest.raises(WarmboxError, match=r"not found|destroyed|ended"):
        ended.commands.run("true")


def test_replays_across_a_server_restart(home: Path, runc_ready: None):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ("--port", str(port))
    server = start_server(home, home / "idem-restart.sock", args=args)
    key = Engine.for_home(home).registry.tenants.create_key("idem-restart")[1]
    sb = Sandbox.create(tier="container", timeout=300, pool=False, api_url=server.url, api_key=key)
    try:
        done = sb.commands.run(STEP.format(f="restart", s=0), idempotency_key="before")
        assert server.stop() == 0
        server = start_server(home, home / "idem-restart.sock", args=args)
        assert sb.commands.run(STEP.format(f="restart", s=0), idempotency_key="before") == done
        assert _lines(sb, "restart") == 1
        # the server dies mid-command: the replay says so, and never runs it again
        long = STEP.format(f="died", s=30)
        thread = threading.Thread(target=_quietly, args=(sb, long), daemon=True)
        thread.start()
        wait_for(lambda: _lines(sb, "died") == 1, 60, "the command to start", interval=0.05)
        server.kill9()
        thread.join(30)
        server = start_server(home, home / "idem-restart.sock", args=args)
        with pytest.raises(OutcomeUnknown, match="ended before recording its result"):
            sb.commands.run(long, idempotency_key="mid")
        assert _lines(sb, "died") == 1
    finally:
        sb.kill()
        server.stop()


def _quietly(sb: Sandbox, cmd: str) -> None:
    try:
        sb.commands.run(cmd, idempotency_key="mid", timeout=60)
    except Exception:
        pass  # the server was killed under it


def test_e2b_create_with_an_idempotency_key_header(server):
    def create(key: str | None) -> tuple[int, dict]:
        headers = {"X-API-KEY": server.client_env["b"], "Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        body = json.dumps({"templateID": "base", "timeout": 60}).encode()
        req = urllib.request.Request(f"{server.url}/sandboxes", body, headers, method="POST")
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())

    ids = []
    try:
        for key in ("e2b-1", "e2b-1", None):
            status, got = create(key)
            assert status == 201
            ids.append(got["sandboxID"])
        assert ids[0] == ids[1] != ids[2]
    finally:
        for sid in set(ids):
            req = urllib.request.Request(
                f"{server.url}/sandboxes/{sid}", headers={"X-API-KEY": server.client_env["b"]}, method="DELETE"
            )
            urllib.request.urlopen(req, timeout=60).close()


def test_malformed_keys_and_misplaced_headers_are_refused_typed(server, box):
    def post(path: str, body: dict, key: str) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {server.client_env['a']}", "Content-Type": "application/json"}
        req = urllib.request.Request(f"{server.url}{path}", json.dumps(body).encode(), headers, method="POST")
        req.add_unredirected_header("Idempotency-Key", key)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read().splitlines()[-1])
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    path = f"/v1/sandboxes/{box.sandbox_id}/commands"
    for key in ("x" * 256, "tab\there", "\u00e9t\u00e9".encode().decode("latin-1")):
        status, got = post(path, {"cmd": "true"}, key)
        assert (status, got["error"]["code"]) == (400, "invalid_argument"), key
    status, got = post(path, {"cmd": "true", "idempotency_key": "a"}, "b")
    assert (status, got["error"]["code"]) == (400, "invalid_argument") and "differ" in got["error"]["message"]
    status, got = post(f"/v1/sandboxes/{box.sandbox_id}/files/dir", {"path": "d"}, "k")
    assert status == 400 and "takes no Idempotency-Key" in got["error"]["message"]
    status, got = post(path, {"cmd": "echo $((6*7))"}, "wire-1")
    assert status == 200 and got["result"]["stdout"] == "42\n"
