"""Ray as a warmbox cluster's membership: the head, a node's raylet (a fate-shared child of the
node process), and the list of nodes with the capacity each advertises, read from Ray's GCS.

Ray supplies only membership, advertised capacity and liveness; warmbox places sandboxes itself.
Each raylet runs as ``ray start --address HEAD --block`` in the caller's process group, with
PR_SET_PDEATHSIG, so a node process SIGKILLed (alone or with its group) takes its Ray node down:
Ray then reports the node dead within the head's health check (``HEALTH_CHECK``: ~0.8 s).

Every Ray process started here has usage stats off, its own temp dir (``RAY_TMPDIR`` and
``--temp-dir``: the ``ray_current_cluster`` file and session sockets stay in it), Ray's TLS on
with the member's certificate of the cluster's CA (cluster/tls.py: the GCS checks a raylet's
certificate against the address Ray gives it) and Ray's token
authentication on, with the cluster's token file (``[cluster] token_file``, the peer token): Ray
listens on every address, and without it anyone reaching the head's port ran code as root on
every node (a ``num_cpus=0`` task is placed even on nodes that offer no CPU). Processes are
stopped by PID, never with ``ray stop`` (it kills every Ray process on the host, other clusters'
too). Nothing here imports ``ray`` except :func:`nodes` (a GCS client, no driver: it needs no
raylet on the caller's host, and costs ~60 MB RSS, imported on first use).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from warmbox.cluster.tls import Member
from warmbox.errors import ClusterError

SLOTS = "warmbox_slots"  # sandboxes a node offers
MEMORY_MB = "warmbox_memory_mb"  # MiB a node offers to sandboxes
TIER_PREFIX = "warmbox_tier_"  # one per tier the node's doctor says runs: warmbox_tier_container = 1
NODE_PREFIX = "wbnode-"  # wbnode-<name> = 1: pins a Ray node to a warmbox node name

# on the head only. Ray's default declares a raylet dead after ~12.5 s. A SIGKILLed raylet refuses
# every check at once, so it is reported after threshold x period (~0.8 s here); a raylet that
# stops answering (a stopped or unreachable host) after threshold x (timeout + period) = 4.8 s,
# which is also how long a raylet starved by a loaded host may go silent before Ray (and so the
# router) gives it up: a false verdict loses every live sandbox of that node. A raylet is checked
# from 0.5 s after it joined (Ray's default waits 5 s: a node killed within 5 s of a rejoin was
# reported ~3 s later than any other, one failover in five in bench cluster)
HEALTH_CHECK: Mapping[str, int] = {
    "health_check_initial_delay_ms": 500,
    "health_check_period_ms": 200,
    "health_check_failure_threshold": 4,
    "health_check_timeout_ms": 1000,
}
OBJECT_STORE_MB = 80  # warmbox puts nothing in Ray's object store; Ray's default is 30 % of RAM
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
AUTH_MODE, AUTH_TOKEN_PATH, AUTH_TOKEN = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"
ADDRESS = re.compile(r"^[A-Za-z0-9.\-]+:\d{1,5}$|^\[[0-9A-Fa-f:]+\]:\d{1,5}$")

# run as ``python -I -S -c _EXEC_WITH_PDEATHSIG PARENT_PID ARGV...``: ask the kernel to SIGTERM the
# child when its parent thread dies, then exec (a preexec_fn is unsafe in a threaded parent)
_EXEC_WITH_PDEATHSIG = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGTERM,0,0,0)\n"  # PR_SET_PDEATHSIG
    "os.getppid()==int(sys.argv[1]) or os._exit(1)\n"  # the parent died before the prctl
    "os.execv(sys.argv[2],sys.argv[2:])\n"
)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What a node advertises to Ray: its name, sandbox slots, memory for sandboxes, tiers."""

    name: str
    slots: int
    memory_mb: int
    tiers: tuple[str, ...]

    def resources(self) -> dict[str, float]:
        out: dict[str, float] = {
            SLOTS: float(self.slots),
            MEMORY_MB: float(self.memory_mb),
            NODE_PREFIX + self.name: 1.0,
        }
        out.update({TIER_PREFIX + t: 1.0 for t in self.tiers})
        return out


@dataclasses.dataclass(frozen=True)
class RayNode:
    """One Ray node as the GCS reports it (dead ones keep the resources they advertised)."""

    node_id: str  # hex
    alive: bool
    ip: str  # its node manager's address
    is_head: bool
    name: str  # the warmbox node name of its wbnode-<name> resource; "" for the head and others
    slots: int
    memory_mb: int
    tiers: tuple[str, ...]


def normalize_address(address: str) -> str:
    """A head's GCS address, HOST:PORT (``ray://`` accepted); InvalidArgument-free: ClusterError."""
    addr = address.strip().removeprefix("ray://")
    if not ADDRESS.match(addr):
        raise ClusterError(f"the Ray head address must be HOST:PORT, got {address!r}")
    return addr


def auth_env(token_file: str | Path) -> dict[str, str]:
    """Ray's token authentication with the cluster's token file (checked as the peer token is:
    a regular file of the caller's, 0600, long enough; ClusterError otherwise)."""
    if not token_file:
        raise ClusterError(
            "Ray needs the cluster's token ([cluster] token_file): without it anyone reaching the head "
            "runs code on every node"
        )
    from warmbox.server.peer import read_token

    read_token(token_file)
    return {AUTH_MODE: "token", AUTH_TOKEN_PATH: str(Path(token_file).absolute())}


def use_auth(token_file: str | Path, tls: Member) -> None:
    """This process's own Ray clients (a GCS client, ``ray.init``) authenticate with
    ``token_file`` and speak TLS with ``tls`` (its certificate presented, the cluster's CA the only
    root). Ray reads these settings once per process: they are refreshed here when they change (a
    process talks to one cluster; tests switch between clusters)."""
    want = {**auth_env(token_file), **tls.ray_env()}
    if all(os.environ.get(k) == v for k, v in want.items()) and AUTH_TOKEN not in os.environ:
        return
    os.environ.update(want)
    os.environ.pop(AUTH_TOKEN, None)
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]
    except ImportError:
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def ray_env(tmpdir: Path, token_file: str | Path, tls: Member) -> dict[str, str]:
    """The environment of every Ray process warmbox starts: usage stats off, its own temp dir,
    token authentication with ``token_file``, TLS on every gRPC channel with ``tls`` (the member's
    certificate as server and client, the cluster's CA as the only root)."""
    env = dict(os.environ)
    env.pop(AUTH_TOKEN, None)
    env.update(auth_env(token_file))
    env.update(tls.ray_env())
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_TMPDIR"] = str(tmpdir)
    return env


def ray_binary() -> str:
    """The ``ray`` CLI of this interpreter's environment."""
    here = Path(sys.executable).with_name("ray")
    if here.exists():
        return str(here)
    found = shutil.which("ray")
    if found is None:
        raise ClusterError("the ray command is not installed (pip install 'warmbox[cluster]')")
    return found


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _running(pid: int) -> bool:
    """The pid exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] not in (b"Z", b"X")


def _names(path: str, needle: str) -> bool:
    """``path`` (or a ``--flag=path`` argument) is ``needle`` or under it (not a sibling it prefixes)."""
    return path.endswith(needle) or needle + "/" in path


def _open_files(pid: int) -> list[str]:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    out = []
    for fd in fds:
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


def processes_in(tmpdir: Path) -> list[int]:
    """PIDs of running processes of the Ray node living in ``tmpdir``: their command line names it
    (--temp-dir, --session-dir ...) or they hold a file under it open (Ray's agents retitle
    themselves ``ray::DashboardAgent``, but keep their logs and sockets there). Never this process."""
    needle = str(tmpdir)
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        if not _running(pid):
            continue
        if any(_names(a, needle) for a in _cmdline(pid)) or any(_names(f, needle) for f in _open_files(pid)):
            out.append(pid)
    return out


class RayProcess:
    """A ``ray start --block`` child (a head or a node's raylet) and the temp dir it owns."""

    def __init__(self, proc: subprocess.Popen[bytes], tmpdir: Path, log: Path, head: bool) -> None:
        self.proc = proc
        self.tmpdir = tmpdir
        self.log = log
        self.head = head
        self.address = ""  # the head's GCS address HOST:PORT
        self.node_id = ""  # this Ray node's id (hex), from its raylet's command line
        self.node_ip = ""  # the address Ray gave this node (its raylet's --node_ip_address)
        self.raylet_pid: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        """Its ``ray start`` and its raylet both run (``ray start --block`` exits within ~1 s of a
        subprocess dying unasked; a raylet that exits on its own, e.g. told by the GCS it was
        declared dead, is seen here at once)."""
        if self.proc.poll() is not None:
            return False
        return self.raylet_pid is None or _running(self.raylet_pid)

    def _wait_started(self, timeout_s: float) -> None:
        marker = self.tmpdir / "ray_current_cluster"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ClusterError(f"ray start exited with status {self.proc.returncode}: {self._tail()}")
            if marker.exists():
                raylet = self._find_raylet()
                if raylet is not None:
                    self.raylet_pid, self.node_id, self.node_ip = raylet
                    if self.head:
                        self.address = marker.read_text().strip()
                    return
            time.sleep(0.1)
        self.stop()
        raise ClusterError(f"ray start did not come up within {timeout_s:g} s: {self._tail()}")

    def _find_raylet(self) -> tuple[int, str, str] | None:
        """(pid, node id, node IP) of the raylet ``ray start`` runs, once it runs."""
        for child in _children(self.pid):
            argv = _cmdline(child)
            if argv and argv[0].endswith("/raylet"):
                flags = dict(a[2:].split("=", 1) for a in argv[1:] if a.startswith("--") and "=" in a)
                if flags.get("node_id"):
                    return child, flags["node_id"], flags.get("node_ip_address", "")
        return None

    def _tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        errs = [ln for ln in lines if "ERROR" in ln or "Error" in ln]
        return (errs or lines or ["(empty log)"])[-1][-300:]

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM ``ray start`` (it stops its processes), wait, then SIGKILL whatever still runs
        with this temp dir in its command line (by PID). Returns ray start's exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in processes_in(self.tmpdir):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return self.proc.returncode


def _start(
    args: list[str], tmpdir: Path, head: bool, timeout_s: float, token_file: str | Path, tls: Member
) -> RayProcess:
    env = ray_env(tmpdir, token_file, tls)  # refused before anything starts without a valid token
    tmpdir.mkdir(parents=True, exist_ok=True)
    (tmpdir / "ray_current_cluster").unlink(missing_ok=True)
    log = tmpdir / ("head.log" if head else "raylet.log")
    argv = [
        ray_binary(),
        "start",
        "--block",
        f"--temp-dir={tmpdir}",
        "--disable-usage-stats",
        f"--object-store-memory={OBJECT_STORE_MB << 20}",
        "--include-log-monitor=False",  # it streams worker output to drivers: warmbox runs no Ray workers
        *args,
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            close_fds=True,
        )
    rp = RayProcess(proc, tmpdir, log, head)
    rp._wait_started(timeout_s)
    return rp


def start_head(
    tmpdir: Path,
    system_config: Mapping[str, int] | None = None,
    *,
    token_file: str | Path,
    tls: Member,
    port: int = 0,
    num_cpus: int = 0,
    timeout_s: float = START_TIMEOUT_S,
) -> RayProcess:
    """A Ray head (GCS) as a child of this process; ``.address`` is its HOST:PORT. system_config:
    Ray's on the head (default HEALTH_CHECK). token_file: the cluster's token (Ray's token
    authentication; required). tls: the head's certificate (cluster.tls.head_member; Ray's TLS).
    port 0: any free port. ``.stop()`` ends it: stop every node first (a node whose head went
    first drains for 30 s)."""
    config = dict(HEALTH_CHECK if system_config is None else system_config)
    args = ["--head", f"--port={port}", f"--num-cpus={num_cpus}", "--include-dashboard=False"]
    if config:
        args.append("--system-config=" + json.dumps(config, separators=(",", ":")))
    return _start(args, Path(tmpdir), True, timeout_s, token_file, tls)


def start_raylet(
    address: str,
    tmpdir: Path,
    capacity: Capacity,
    *,
    token_file: str | Path,
    tls: Member,
    num_cpus: int = 0,
    timeout_s: float = START_TIMEOUT_S,
) -> RayProcess:
    """This node's raylet joined to the head at ``address``, advertising ``capacity`` as custom
    resources, as a fate-shared child: same process group as the caller, and SIGTERMed by the
    kernel when the caller dies. token_file: the cluster's token (required); tls: the node's
    certificate (Ray's TLS). num_cpus 0: Ray
    prestarts no worker processes here (a task asking for no CPU could still be placed: only
    the token keeps strangers from submitting one). ``.node_id`` is the Ray node's id."""
    addr = normalize_address(address)
    args = [
        f"--address={addr}",
        f"--num-cpus={num_cpus}",
        "--resources=" + json.dumps(capacity.resources(), separators=(",", ":"), sort_keys=True),
    ]
    return _start(args, Path(tmpdir), False, timeout_s, token_file, tls)


CONNECT_TIMEOUT_S = 5.0  # an unreachable head is reported within this (Ray's own client waits ~40 s)


def _gcs(address: str, token_file: str | Path, tls: Member, timeout_s: float = CONNECT_TIMEOUT_S) -> Any:
    """A GCS client of the head at ``address``, or ClusterError within ``timeout_s``.

    Ray has no public driverless API for its node table: ``ray.nodes()`` (a DeveloperAPI) needs
    ``ray.init``, which makes the caller a driver with a core worker and a job of its own. So this
    is Ray's own GcsClient, whose constructor waits ~40 s for a head that refuses or does not
    answer, and whose reconnect limit (RAY_gcs_rpc_server_reconnect_timeout_s) ends the whole
    process when it runs out. Bounded here instead: a TCP connect to the head first (a refused or
    silent port fails at once or after ``timeout_s``), then the constructor in a daemon thread
    awaited for what is left of ``timeout_s`` (a head that accepts but hangs: the thread finishes
    on its own, ~40 s later)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    use_auth(token_file, tls)
    try:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]  # compiled, no stub
    except ImportError:
        raise ClusterError("ray is not installed (pip install 'warmbox[cluster]')") from None
    addr = normalize_address(address)
    deadline = time.monotonic() + timeout_s
    host, _, port = addr.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot reach the Ray head at {address}: {e}") from None
    got: list[Any] = []
    done = threading.Event()

    def construct() -> None:
        try:
            got.append(GcsClient(address=addr))
        except Exception as e:  # ray's RpcError and friends
            got.append(e)
        finally:
            done.set()

    threading.Thread(target=construct, name="warmbox-gcs-connect", daemon=True).start()
    if not done.wait(max(0.1, deadline - time.monotonic())):
        raise ClusterError(f"the Ray head at {address} accepted a connection but did not answer within {timeout_s:g} s")
    if isinstance(got[0], Exception):
        raise ClusterError(f"cannot reach the Ray head at {address}: {got[0]}") from None
    return got[0]


class Membership:
    """A connection to a head's GCS (no Ray driver): the nodes and their advertised capacity.
    token_file: the cluster's token (Ray's token authentication); tls: this member's certificate
    (Ray's TLS: the GCS accepts no other)."""

    def __init__(self, address: str, token_file: str | Path, tls: Member) -> None:
        self.address = normalize_address(address)
        self._client = _gcs(self.address, token_file, tls)

    def nodes(self, timeout_s: float = 5.0) -> list[RayNode]:
        """Every node the GCS knows, alive and dead (a dead one keeps its resources)."""
        try:
            infos = self._client.get_all_node_info(timeout=timeout_s)
        except Exception as e:
            raise ClusterError(f"the Ray head at {self.address} did not answer: {e}") from None
        return [_node(info) for info in infos.values()]

    def alive(self, timeout_s: float = 5.0) -> list[RayNode]:
        return [n for n in self.nodes(timeout_s) if n.alive]

    def find(self, name: str, timeout_s: float = 5.0) -> RayNode | None:
        """The Ray node advertising ``wbnode-<name>``: the alive one if any, else the newest dead."""
        found = [n for n in self.nodes(timeout_s) if n.name == name]
        found.sort(key=lambda n: n.alive)
        return found[-1] if found else None


def _node(info: Any) -> RayNode:
    res = dict(info.resources_total)
    names = [k.removeprefix(NODE_PREFIX) for k in res if k.startswith(NODE_PREFIX)]
    return RayNode(
        node_id=info.node_id.hex(),
        alive=info.state == 0,  # GcsNodeInfo.ALIVE
        ip=info.node_manager_address,
        is_head=bool(info.is_head_node),
        name=names[0] if len(names) == 1 else "",
        slots=int(res.get(SLOTS, 0)),
        memory_mb=int(res.get(MEMORY_MB, 0)),
        tiers=tuple(sorted(k.removeprefix(TIER_PREFIX) for k in res if k.startswith(TIER_PREFIX))),
    )


__all__ = [
    "HEALTH_CHECK",
    "MEMORY_MB",
    "NODE_PREFIX",
    "SLOTS",
    "TIER_PREFIX",
    "Capacity",
    "Membership",
    "RayNode",
    "RayProcess",
    "auth_env",
    "normalize_address",
    "processes_in",
    "ray_env",
    "start_head",
    "start_raylet",
    "use_auth",
]
