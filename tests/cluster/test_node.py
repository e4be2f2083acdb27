"""`warmbox node join` processes against a real Ray head and a real PostgreSQL registry on this host:
two nodes register and advertise their capacity; SIGKILL of a node's process group takes its Ray
node down; SIGTERM is a graceful leave (exit 0, nothing of it left, marked down)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from warmbox.cluster import membership, tls
from warmbox.cluster.membership import Membership, RayProcess
from warmbox.cluster.node import EXIT_FENCED, EXIT_RAYLET, ray_tmpdir
from warmbox.paths import runtime_dir
from warmbox.server import peer
from warmbox.storage.registry import Registry

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]
UP_WITHIN_S = 90.0  # a node's start: doctor, its raylet (~3 s), its API; generous on a loaded 2-core host
DEAD_WITHIN_S = 15.0  # the tuned health check: ~6 s measured after a group SIGKILL
SRC = Path(__file__).resolve().parents[2] / "src"


class NodeProc:
    """One `warmbox node join` child in its own session (process group), with its own home."""

    def __init__(self, name: str, head: str, dsn: str, token: Path, slots: int = 2) -> None:
        self.name = name
        self.home = Path(tempfile.mkdtemp(prefix=f"wbn-{name}-", dir="/tmp"))
        tls.issue(token.parent, tls.node_member(name), tls.local_ips())  # `warmbox cluster cert NAME --ip IP`
        (self.home / "warmbox.toml").write_text("[daemon]\nidle_exit = 3\n")
        self.log = self.home / "node.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("WARMBOX_")}
        env.update(
            PYTHONPATH=str(SRC),
            WARMBOX_HOME=str(self.home),
            WARMBOX_CLUSTER__REGISTRY=dsn,
            WARMBOX_CLUSTER__TOKEN_FILE=str(token),
            RAY_USAGE_STATS_ENABLED="0",
        )
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "warmbox.cli.main", "node", "join", head, "--name", name, "--slots", str(slots)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.address = ""
        self.ray_node_id = ""

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_up(self) -> None:
        deadline = time.monotonic() + UP_WITHIN_S
        while True:
            for line in self.output().splitlines():
                if line.startswith(f"node {self.name} up: api "):
                    # node NAME up: api URL, ray node ID
                    self.address = line.split()[4].rstrip(",")
                    self.ray_node_id = line.split()[-1]
                    return
            assert self.proc.poll() is None, f"node {self.name} exited {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"node {self.name} not up in {UP_WITHIN_S} s:\n{self.output()}"
            time.sleep(0.1)

    def pids(self) -> list[int]:
        """Its process and everything of its Ray node still running."""
        own = [self.proc.pid] if self.proc.poll() is None else []
        return own + membership.processes_in(ray_tmpdir(self.home))

    def kill(self) -> None:
        """SIGKILL whatever of it still runs, by PID; remove its home."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        for pid in membership.processes_in(ray_tmpdir(self.home)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(ray_tmpdir(self.home), ignore_errors=True)
        rt = runtime_dir(self.home)
        assert not (rt / "sandboxes").is_dir() or not os.listdir(rt / "sandboxes"), "a node test left sandboxes"
        shutil.rmtree(rt, ignore_errors=True)  # its API socket; no sandbox ran there
        shutil.rmtree(self.home, ignore_errors=True)


def _until(pred, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def head(token: Path) -> Iterator[RayProcess]:
    with tempfile.TemporaryDirectory(prefix="wbnh-", dir="/tmp") as d:
        h = membership.start_head(Path(d) / "h", token_file=token, tls=tls.head_member(token.parent, tls.local_ips()))
        try:
            yield h
        finally:
            h.stop()


@pytest.fixture(scope="module")
def dsn(pg_server) -> Iterator[str]:
    url = pg_server.create_database()
    yield url
    pg_server.drop_database(url)


@pytest.fixture(scope="module")
def token(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("node-token") / "cluster.token"
    peer.ensure_token(path)
    return path


def _router(token: Path) -> tls.Member:
    """The router's certificate: Ray's GCS and the nodes' APIs take no caller without one."""
    return tls.issue(token.parent, tls.ROUTER)


@pytest.fixture
def nodes() -> Iterator[list[NodeProc]]:
    """The node processes a test starts; each ended by PID and its home removed after it."""
    made: list[NodeProc] = []
    yield made
    for n in made:
        n.cleanup()


def _start(head: RayProcess, dsn: str, token: Path, made: list[NodeProc], *names: str) -> list[NodeProc]:
    new = [NodeProc(n, head.address, dsn, token, slots=2 + i) for i, n in enumerate(names)]
    made.extend(new)
    for n in new:
        n.wait_up()
    return new


def test_two_nodes_register_and_advertise_their_capacity(head, dsn, token, nodes) -> None:
    a, b = _start(head, dsn, token, nodes, f"a{secrets.token_hex(2)}", f"b{secrets.token_hex(2)}")
    reg = Registry(dsn)
    rows = {n.name: n for n in reg.nodes.nodes()}
    router = _router(token)
    mem = Membership(head.address, token, router)
    for node, slots in ((a, 2), (b, 3)):
        row = rows[node.name]
        assert (row.state, row.address, row.ray_node_id, row.slots) == ("up", node.address, node.ray_node_id, slots)
        assert row.epoch >= 1 and row.memory_mb > 0 and "container" in row.tiers
        ray_node = mem.find(node.name)
        assert ray_node is not None and ray_node.alive
        assert (ray_node.node_id, ray_node.slots, ray_node.memory_mb) == (node.ray_node_id, slots, row.memory_mb)
        assert ray_node.tiers == tuple(sorted(row.tiers))
        # its API answers a peer (the router) with the cluster token
        req = urllib.request.Request(
            node.address + "/v1/sandboxes",
            headers={"Authorization": f"Bearer {peer.read_token(token)}", peer.TENANT: "acme"},
        )
        assert node.address.startswith("https://")
        with urllib.request.urlopen(req, timeout=30, context=router.client_context()) as r:
            assert r.status == 200 and json.loads(r.read()) == []
    _until(
        lambda: all(n.heartbeat_at > rows[n.name].heartbeat_at for n in reg.nodes.nodes() if n.name in rows), 10, "beat"
    )


def test_sigkill_of_a_nodes_group_takes_its_ray_node_down(head, dsn, token, nodes) -> None:
    (a,) = _start(head, dsn, token, nodes, f"k{secrets.token_hex(2)}")
    mem = Membership(head.address, token, _router(token))
    assert mem.find(a.name).alive  # type: ignore[union-attr]
    os.killpg(a.proc.pid, signal.SIGKILL)
    a.proc.wait(10)
    took = _until(lambda: not mem.find(a.name).alive, DEAD_WITHIN_S, "Ray reports the node dead")  # type: ignore[union-attr]
    print(f"SIGKILL of the node's group: Ray reported it dead after {took:.2f} s")
    _until(lambda: a.pids() == [], 30, "every process of the node ends")


def test_sigterm_is_a_graceful_leave(head, dsn, token, nodes) -> None:
    (a,) = _start(head, dsn, token, nodes, f"t{secrets.token_hex(2)}")
    mem = Membership(head.address, token, _router(token))
    pids = a.pids()
    assert len(pids) >= 3, pids  # the node, ray start, its raylet (and Ray's agents)
    t0 = time.monotonic()
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(60) == 0, a.output()
    print(f"SIGTERM: the node left in {time.monotonic() - t0:.2f} s")
    _until(lambda: not any(membership._running(p) for p in pids), 10, "none of its processes runs")
    assert not mem.find(a.name).alive  # type: ignore[union-attr]
    assert not ray_tmpdir(a.home).exists(), "a node leaving on SIGTERM removes its Ray temp dir"
    row = {n.name: n for n in Registry(dsn).nodes.nodes()}[a.name]
    assert row.state == "down"


def test_a_fenced_node_exits_and_leaves_nothing(head, dsn, token, nodes) -> None:
    """The registry marks the node down (the router's monitor would): its next heartbeat is
    refused and it leaves with EXIT_FENCED, its raylet with it."""
    (a,) = _start(head, dsn, token, nodes, f"f{secrets.token_hex(2)}")
    pids = a.pids()
    Registry(dsn).nodes.mark_node_down(a.name, "test: fenced")
    assert a.proc.wait(30) == EXIT_FENCED, a.output()
    assert "fenced by the registry" in a.output()
    _until(lambda: not any(membership._running(p) for p in pids), 10, "none of its processes runs")


def test_a_node_whose_raylet_dies_leaves_and_marks_itself_down(head, dsn, token, nodes) -> None:
    (a,) = _start(head, dsn, token, nodes, f"r{secrets.token_hex(2)}")
    raylet = next(p for p in a.pids() if membership._cmdline(p)[0].endswith("/raylet"))
    os.kill(raylet, signal.SIGKILL)
    assert a.proc.wait(30) == EXIT_RAYLET, a.output()
    row = {n.name: n for n in Registry(dsn).nodes.nodes()}[a.name]
    assert row.state == "down"
    _until(lambda: a.pids() == [], 30, "every process of the node ends")


def test_a_nodes_sandbox_works_through_its_api_and_is_lost_when_it_leaves(head, dsn, token, nodes, runc_ready) -> None:
    """A peer (the router) creates and runs a sandbox on the node; SIGTERM: the node leaves, the
    sandbox is lost (callers get the typed error from the registry) and its runtime is gone."""
    import asyncio

    from warmbox import operations as ops
    from warmbox.models import State
    from warmbox.sdk.http import HttpTransport

    (a,) = _start(head, dsn, token, nodes, f"s{secrets.token_hex(2)}")

    async def run() -> str:
        t = HttpTransport(
            a.address, peer.read_token(token), headers={peer.TENANT: "acme"}, verify=_router(token).client_context()
        )
        try:
            opened = await t.handle(ops.Create(tier="container", timeout=300, pool=False))
            sid = opened.info.sandbox_id
            r = await t.handle(ops.Exec(sid, ["sh", "-c", "echo hi from $(hostname)"]))
            assert r.exit_code == 0 and r.stdout.startswith("hi from"), r
            return sid
        finally:
            await t.close()

    sid = asyncio.run(run())
    reg = Registry(dsn)
    info, handle = reg.sandboxes.get(sid)
    assert info.tenant == "acme" and reg.nodes.node_of(sid) == a.name and Path(handle.state_dir).is_dir()
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(120) == 0, a.output()
    assert reg.sandboxes.get(sid)[0].state is State.LOST
    assert not Path(handle.state_dir).exists(), "the node left its sandbox's runtime behind"
