"""Ray membership against a real Ray head and raylets on this host: what a node advertises, and a
raylet sharing its node process's fate (SIGKILL of the group, or of the node process alone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from warmbox.cluster import membership, tls
from warmbox.cluster.membership import Capacity, Membership, RayProcess
from warmbox.errors import ClusterError
from warmbox.server import peer

pytestmark = [pytest.mark.sandbox, pytest.mark.cluster]
DEAD_WITHIN_S = 15.0  # tuned health check: ~2.4 s measured; the bound leaves room for a loaded host


@pytest.fixture(scope="module")
def ray_tmp() -> Iterator[Path]:
    # short: Ray's unix sockets live under it (108 bytes at most)
    with tempfile.TemporaryDirectory(prefix="wbm-", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def token(ray_tmp: Path) -> Path:
    path = ray_tmp / "cluster.token"
    peer.ensure_token(path)
    return path


@pytest.fixture(scope="module")
def head(ray_tmp: Path, token: Path) -> Iterator[RayProcess]:
    h = membership.start_head(ray_tmp / "head", token_file=token, tls=tls.head_member(ray_tmp, tls.local_ips()))
    try:
        yield h
    finally:
        h.stop()
        assert membership.processes_in(ray_tmp / "head") == []


def _until(pred, timeout_s: float) -> float:
    """Seconds until pred() held (polled every 0.1 s); fails after timeout_s."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def _router(ray_tmp: Path) -> tls.Member:
    """The router's certificate (its GCS client speaks Ray's TLS with it)."""
    return tls.issue(ray_tmp, tls.ROUTER)


def _gone(tmp: Path) -> bool:
    return membership.processes_in(tmp) == []


def test_a_node_advertises_its_capacity_and_a_graceful_stop_leaves_nothing(
    head: RayProcess, ray_tmp: Path, token: Path
) -> None:
    tmp = ray_tmp / "n1"
    cap = Capacity(name="n1", slots=3, memory_mb=2048, tiers=("container", "isolate"))
    node = membership.start_raylet(
        head.address, tmp, cap, token_file=token, tls=tls.issue(ray_tmp, tls.node_member("n1"), tls.local_ips())
    )
    try:
        assert node.alive() and node.node_id and node.raylet_pid
        assert os.getpgid(node.raylet_pid) == os.getpgid(0)  # fate-shared: in our process group
        mem = Membership(head.address, token, _router(ray_tmp))
        _until(lambda: (n := mem.find("n1")) is not None and n.alive, 10)
        found = mem.find("n1")
        assert found is not None
        assert (found.node_id, found.slots, found.memory_mb, found.tiers) == (node.node_id, 3, 2048, cap.tiers)
        assert not found.is_head
        heads = [n for n in mem.alive() if n.is_head]
        assert len(heads) == 1 and heads[0].name == "" and heads[0].slots == 0
    finally:
        node.stop()
    assert _gone(tmp)
    assert not node.alive()
    _until(lambda: not mem.find("n1").alive, DEAD_WITHIN_S)  # type: ignore[union-attr]


# a node process: its raylet as a child, then it waits; prints the Ray node id when up
NODE_PROCESS = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from warmbox.cluster import membership, tls
    cap = membership.Capacity(sys.argv[3], 1, 512, ())
    member = tls.member(Path(sys.argv[4]).parent, tls.node_member(sys.argv[3]))
    node = membership.start_raylet(sys.argv[1], Path(sys.argv[2]), cap, token_file=sys.argv[4], tls=member)
    print(node.node_id, flush=True)
    time.sleep(600)
    """
)


def _node_process(head: RayProcess, tmp: Path, name: str, token: Path) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, PYTHONPATH=str(Path(membership.__file__).parents[2]))
    tls.issue(token.parent, tls.node_member(name), tls.local_ips())
    proc = subprocess.Popen(
        [sys.executable, "-c", NODE_PROCESS, head.address, str(tmp), name, str(token)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, as `warmbox node join` under a supervisor
    )
    assert proc.stdout is not None
    node_id = proc.stdout.readline().strip()
    assert node_id, "the node process did not start its raylet"
    return proc, node_id


@pytest.mark.parametrize("what", ["group", "process"])
def test_sigkill_of_the_node_takes_its_ray_node_down(head: RayProcess, ray_tmp: Path, token: Path, what: str) -> None:
    """SIGKILL of the node's process group (everything dies at once), or of the node process alone
    (its raylet is told by PR_SET_PDEATHSIG): Ray reports the node dead, nothing of it is left."""
    tmp = ray_tmp / f"k-{what}"
    name = f"k-{what}"
    proc, node_id = _node_process(head, tmp, name, token)
    try:
        mem = Membership(head.address, token, _router(ray_tmp))
        _until(lambda: (n := mem.find(name)) is not None and n.alive, 10)
        assert mem.find(name).node_id == node_id  # type: ignore[union-attr]
        if what == "group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        took = _until(lambda: not mem.find(name).alive, DEAD_WITHIN_S)  # type: ignore[union-attr]
        print(f"{what}: Ray reported the node dead {took:.2f} s after the SIGKILL")
        _until(lambda: _gone(tmp), 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in membership.processes_in(tmp):
            os.kill(pid, signal.SIGKILL)


def test_a_bad_head_address_is_a_typed_error() -> None:
    with pytest.raises(ClusterError, match="HOST:PORT"):
        membership.normalize_address("not an address")
    assert membership.normalize_address("ray://10.0.0.1:6379") == "10.0.0.1:6379"


def test_warmbox_cluster_head_runs_until_sigterm(ray_tmp: Path, token: Path) -> None:
    tmp = ray_tmp / "cli-head"
    env = dict(os.environ, PYTHONPATH=str(Path(membership.__file__).parents[2]))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "warmbox.cli.main",
            "cluster",
            "head",
            "--temp-dir",
            str(tmp),
            "--token-file",
            str(token),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.startswith("cluster CA made in "):  # the first head beside this token makes the CA
            line = proc.stdout.readline()
        assert line.startswith("ray head at "), line
        address = line.split()[3]
        heads = [n for n in Membership(address, token, _router(ray_tmp)).alive() if n.is_head]
        assert len(heads) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert _gone(tmp)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in membership.processes_in(tmp):
            os.kill(pid, signal.SIGKILL)


def test_an_unreachable_head_is_reported_within_five_seconds(head: RayProcess, ray_tmp: Path, token: Path) -> None:
    """Ray's GCS client waits ~40 s for a head that is not there; the router's membership says so
    within membership.CONNECT_TIMEOUT_S (5 s): a refused port at once, a silent one at the bound."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts (the kernel's backlog) and never answers
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    try:
        for sock, bound in ((refused, 1.0), (silent, membership.CONNECT_TIMEOUT_S + 2.0)):
            t0 = time.monotonic()
            with pytest.raises(ClusterError, match=r"Ray head at 127\.0\.0\.1"):
                Membership(f"127.0.0.1:{sock.getsockname()[1]}", token, _router(ray_tmp))
            assert time.monotonic() - t0 < bound
    finally:
        silent.close()
        refused.close()
