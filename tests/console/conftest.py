"""The console's browser lane: one real `warmbox serve` (real container sandboxes) and one headless
Debian chromium driven by Playwright, shared by every test of tests/console.

    Playwright ─► /usr/bin/chromium (headless) ─► http://127.0.0.1:PORT/ui/ ─► warmbox serve ─► engine
                                                                                   └─ egress proxy ─► fake world netns

The server's home routes its egress proxy only into the fake internet of tests/network (never the
machine's uplink). Tenants: ``acme`` and ``umbrella`` (tenant keys), ``spender`` (a tenant whose
daily budget any start exceeds) and ``ops`` (an admin key), made with the real ``warmbox keys create``.
Screenshots go to bench-results/console/ (ignored by git).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, ServerProc, cli, start_server
from tests.network.conftest import world  # noqa: F401 - the fake internet (session fixture)
from warmbox.engine import teardown

SHOTS = ROOT / "bench-results" / "console"
# the browser never waits longer than this for a page element (ms); the list's own bound is stricter
UI_TIMEOUT_MS = 15_000


@dataclasses.dataclass(frozen=True)
class Key:
    tenant: str
    key_id: str
    secret: str
    admin: bool


@dataclasses.dataclass
class Console:
    """The lane's server and the keys made for it."""

    home: Path
    server: ServerProc
    keys: dict[str, Key]

    @property
    def url(self) -> str:
        return self.server.url

    def api(self, who: str, method: str, path: str, body: object = None, timeout: float = 30) -> object:
        """One /v1 request with ``who``'s key; the decoded JSON (raises urllib's HTTPError on >= 400)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.keys[who].secret}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=timeout) as r:  # loopback only: the lane's server
            return json.loads(r.read() or b"null")

    def sdk(self, who: str) -> dict[str, str]:
        """Sandbox.create(**console.sdk("acme")): the SDK over HTTP with ``who``'s key."""
        return {"api_url": self.url, "api_key": self.keys[who].secret}


def _config(world) -> str:  # noqa: F811 - the fixture's value
    return f"""
[daemon]
idle_exit = 3

[pools.console]
template = "base"
tier = "container"
min = 1
max = 1
target = 1
limits = {{ memory_mb = 256 }}

[network]
upstream_netns = "{world.up}"
upstream_dns = ["192.0.2.2"]
upstream_ca = "{world.dir / "ca.pem"}"
approval_timeout = 60

[approvals]
timeout = 60
"""


def _make_key(home: Path, tenant: str, *extra: str) -> Key:
    r = cli("keys", "create", "--tenant", tenant, "--json", *extra, env={"WARMBOX_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    return Key(d["tenant"], d["key_id"], d["secret"], bool(d["admin"]))


@pytest.fixture(scope="package")
def console(world, runc_ready: None) -> Iterator[Console]:  # noqa: F811
    """The lane's `warmbox serve` on its own home (TCP on 127.0.0.1, a free port), ended by PID."""
    from warmbox.engine import egress
    from warmbox.engine.daemon import down_home
    from warmbox.engine.engine import Engine
    from warmbox.network import netns

    home = Path(f"/tmp/wbt-c{world.tag}")
    home.mkdir(mode=0o700)
    (home / "warmbox.toml").write_text(_config(world))
    server = None
    try:
        keys = {
            "acme": _make_key(home, "acme"),
            "umbrella": _make_key(home, "umbrella"),
            "ops": _make_key(home, "ops", "--admin"),
            # any start of this tenant goes past its budget (60 s of a CPU is 0.017 CPU-hours)
            "spender": _make_key(home, "spender", "--budget", "cpu=0.001h"),
        }
        server = start_server(home, home / "api.sock")
        assert server.url.startswith("http://127.0.0.1:"), server.url
        yield Console(home, server, keys)
    finally:
        status = server.stop() if server is not None else 0
        engine = Engine.for_home(home)
        # the tests end what they make; the pool's sandboxes are the daemon's (down_home ends them)
        left = [i.sandbox_id for i in engine.list() if not i.pool]
        try:
            for info in engine.list():
                asyncio.run(teardown.destroy(engine, info.sandbox_id, "console lane teardown"))
        finally:  # the daemon and proxy end even if a destroy failed (they would keep the pool's sandbox)
            asyncio.run(down_home(home))
        egress_ns = netns.egress_name(engine.runtime)
        proxy_left = egress.proxy_pid(home)
        ns_left = os.path.exists(netns.netns_path(egress_ns))
        log = server.output() if server is not None else ""
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(engine.runtime, ignore_errors=True)
        assert status == 0, f"warmbox serve exited with {status} on SIGTERM:\n{log}"
        assert not left, f"console tests left sandboxes: {left}"
        assert proxy_left is None, "the egress proxy outlived `warmbox down`"
        assert not ns_left, f"egress namespace {egress_ns} left"


def _children() -> dict[int, list[tuple[int, str, bytes]]]:
    """ppid -> [(pid, start time, argv[0])] of every process now."""
    out: dict[int, list[tuple[int, str, bytes]]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            argv0 = (proc / "cmdline").read_bytes().split(b"\0")[0]
        except (OSError, IndexError):
            continue
        out.setdefault(int(fields[1]), []).append((int(proc.name), fields[19], argv0))
    return out


def _playwright_tree() -> list[tuple[int, str]]:
    """(pid, start time) of this process's Playwright driver and everything under it (chromium's
    browser, zygotes, renderers, GPU and utility processes); not the server, which is ours too."""
    kids = _children()
    roots = [(p, t) for p, t, a in kids.get(os.getpid(), []) if a.endswith(b"playwright/driver/node")]
    tree, todo = list(roots), [p for p, _ in roots]
    while todo:
        for p, t, _a in kids.get(todo.pop(), []):
            tree.append((p, t))
            todo.append(p)
    return tree


def _alive(pid: int, start: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19] == start
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="package")
def browser(console: Console) -> Iterator[object]:
    """Headless Debian chromium under Playwright (never a downloaded browser: executable_path).

    Playwright launches chromium with --no-sandbox unless chromium_sandbox=True; as root (this lane
    runs as root: it needs runc) chromium's own sandbox refuses to start ("Chromium sandboxing
    failed"), so it stays off. The browser loads only the lane's server on loopback. Teardown
    closes it, then ends by PID whatever of the driver's process tree outlived the close.

    Package scope, after ``console``: while Playwright's sync API is started, its event loop counts
    as running in this thread, so asyncio.run() (other fixtures' teardowns, other packages' tests)
    fails until it is stopped; the SDK's sync API is fine (its loop runs in its own thread)."""
    from playwright.sync_api import sync_playwright

    from warmbox.templates.builtins import CHROMIUM

    pw = sync_playwright().start()
    procs: list[tuple[int, str]] = []
    try:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield b
        finally:
            procs = _playwright_tree()
            b.close()
    finally:
        procs = procs or _playwright_tree()
        pw.stop()
        deadline = time.monotonic() + 5  # the driver exits at stop(); its children a moment later
        while (left := [pid for pid, start in procs if _alive(pid, start)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in left:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        assert not left, f"Playwright/chromium processes outlived close(): {left}"
