"""A real warmbox cluster on this host, for the cluster lane (tests/cluster, pytest --api=cluster).

    PostgreSQL (tests/pgserver.py, a database of its own) ── the shared registry
    moto S3 (tests/s3server.py, a prefix of its own) ──────── the shared snapshots
    Ray head (warmbox.cluster.membership.start_head) ─┬─ `warmbox node join` n1 (own home, runtime dir, raylet child)
                                                       ├─ `warmbox node join` n2
                                                       └─ `warmbox node join` n3
    `warmbox serve --cluster HEAD` (the router: the SDK's URL, a tenant key of the shared registry)

Every process started here carries ``WARMBOX_TEST_CLUSTER=<tag>`` (and a node's, ``WARMBOX_TEST_NODE=
<tag>/<name>``) in its environment: a node's raylet, Ray agents, daemon and proxy inherit it, so
"nothing left" is checked, and a crash simulated, by that mark (by PID, never by a process name).
Sandboxes' own processes do not inherit it (runc gives them the image's environment), which is
what a node that died and came back must clean up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import warmbox
from tests.conftest import BASE_CONFIG, ServerProc, start_server, wait_for

SRC = Path(warmbox.__file__).resolve().parent.parent  # the warmbox this test session imports
NODE_NAMES = ("n1", "n2", "n3")
SLOTS = 6  # per node: the SDK suite keeps a few sandboxes at once; tests/cluster fill to a quota below it
NODE_CONFIG = BASE_CONFIG  # the session home's: the iso pool (target 1, split over the nodes), no built-in pool
ROUTER_CONFIG = "[daemon]\nidle_exit = 3\n"
START_TIMEOUT_S = 90.0  # a node: its raylet (~3 s), its API server, its first registry heartbeat
DOWN_TIMEOUT_S = 30.0  # a SIGKILLed node marked down (Ray's tuned health check: ~2.4 s)
STOP_TIMEOUT_S = 60.0  # a node told to stop (SIGTERM: down in the registry, raylet stopped)
VIEW_TTL_S = 0.6  # a router rereads the node list at least this often (warmbox.cluster.router.VIEW_TTL_S)
LOGS_ENV = "WARMBOX_CLUSTER_LOGS"  # a dir: the router's and nodes' logs are copied there at the end (CI keeps them)
MARK = "WARMBOX_TEST_CLUSTER"
NODE_MARK = "WARMBOX_TEST_NODE"


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k] = v
    return out


def _state(pid: int) -> bytes:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return stat[stat.rindex(b")") + 2 :][:1]
    except (OSError, ValueError):
        return b"X"


def marked(name: str, value: str) -> list[int]:
    """PIDs of running (not zombie) processes whose environment has ``name=value``; never this one."""
    want = value.encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        if _environ(pid).get(name.encode()) == want and _state(pid) not in (b"Z", b"X"):
            out.append(pid)
    return out


def describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "?"
        out.append(f"{pid}: {cmd[:160]}")
    return out


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclasses.dataclass
class Node:
    """One `warmbox node join` process: its own home and runtime dir, its own process group."""

    name: str
    home: Path
    runtime: Path
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = None

    def start(self, head: str) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "warmbox.cli.main",
                    "node",
                    "join",
                    head,
                    "--name",
                    self.name,
                    "--slots",
                    str(SLOTS),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own process group: kill9() ends it and its raylet
                cwd=self.home,
            )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def leftovers(self) -> list[int]:
        """Its processes still running (raylet, Ray agents, daemon, proxy ...): found by its mark."""
        return marked(NODE_MARK, self.env[NODE_MARK])

    def kill9(self) -> None:
        """The host dies: SIGKILL its whole process group, then every process of the node that left
        the group (the daemon and proxy are double-forked; Ray agents). Its sandboxes stay, as
        orphans a restarted node must clean up."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        deadline = time.monotonic() + 10
        while (left := self.leftovers()) and time.monotonic() < deadline:
            kill_all(left)
            time.sleep(0.05)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM (graceful: the node says down, stops its raylet and exits), SIGKILL of its group
        after ``timeout``. Its exit status (None: was not running)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


@dataclasses.dataclass
class Cluster:
    """The lane's cluster; ``client_env``: what the SDK sets to use the router as tenant "pytest"."""

    dir: Path
    tag: str
    dsn: str
    s3: Any  # tests.s3server.S3Server
    prefix: str
    token_file: Path
    head: Any = None  # warmbox.cluster.membership.RayProcess
    nodes: dict[str, Node] = dataclasses.field(default_factory=dict)
    router: ServerProc | None = None
    client_env: dict[str, str] = dataclasses.field(default_factory=dict)
    admin_key: str = ""  # an admin key's secret (tenant "ops"): drains, and kills of any tenant's sandbox
    _registry: Any = None

    # ---- start

    @classmethod
    def start(cls, dsn: str, s3: Any) -> Cluster:
        tag = secrets.token_hex(3)
        root = Path(f"/tmp/wbc-{tag}")  # short: unix sockets live under it
        root.mkdir(mode=0o700)
        token = root / "token"
        token.write_text(secrets.token_urlsafe(32) + "\n")
        token.chmod(0o600)
        c = cls(root, tag, dsn, s3, f"c-{tag}", token)
        try:
            from warmbox.cluster import membership, tls

            # the cluster's CA beside the token, as `warmbox cluster head` makes it; every member's
            # certificate as `warmbox cluster cert` issues it: all of the lane runs on mutual TLS
            c.head = membership.start_head(root / "ray", token_file=token, tls=tls.head_member(root, tls.local_ips()))
            tls.issue(root, tls.ROUTER)
            for name in NODE_NAMES:  # all three at once: their raylets start in parallel
                c._node(name).start(c.head.address)
            for name in NODE_NAMES:
                c.wait_up(name)
            router_home = root / "router"
            router_home.mkdir(mode=0o700)
            # no [pools]: the router learns the nodes' pools from the registry (tests/cluster/test_pool_split.py)
            (router_home / "warmbox.toml").write_text(ROUTER_CONFIG)
            c.router = start_server(
                router_home,
                router_home / "api.sock",
                env=c._base_env(),
                args=("--cluster", c.head.address),
                timeout=START_TIMEOUT_S,
            )
            _key_id, secret = c.registry().tenants.create_key("pytest")
            c.client_env = {"WARMBOX_API_URL": c.router.url, "WARMBOX_API_KEY": secret}
            _key_id, c.admin_key = c.registry().tenants.create_key("ops", admin=True)
        except BaseException:
            problems = c.stop()
            if problems:
                print("cluster teardown after a failed start:", *problems, sep="\n  ", file=sys.stderr)
            raise
        return c

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMBOX_", "AWS_", "RAY_"))}
        env.update(self.s3.env)  # AWS_* fake credentials and WARMBOX_S3_ENDPOINT, passed explicitly
        env.update(
            {
                MARK: self.tag,
                "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_TMPDIR": str(self.dir / "ray"),
                "WARMBOX_CLUSTER__REGISTRY": self.dsn,
                "WARMBOX_CLUSTER__OBJECT_STORE": f"s3://{self.s3.bucket}/{self.prefix}",
                "WARMBOX_OBJECT_STORE": f"s3://{self.s3.bucket}/{self.prefix}",
                "WARMBOX_CLUSTER__TOKEN_FILE": str(self.token_file),
                # this checkout's warmbox, whatever the cwd (a node runs in its home)
                "PYTHONPATH": os.pathsep.join(
                    [str(SRC), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
                ),
            }
        )
        return env

    def _node(self, name: str) -> Node:
        from warmbox.cluster import tls

        home = self.dir / name
        home.mkdir(mode=0o700, exist_ok=True)
        tls.issue(self.dir, tls.node_member(name), tls.local_ips())  # its Ray address: the GCS checks it
        (home / "warmbox.toml").write_text(NODE_CONFIG)
        from warmbox.paths import runtime_dir

        env = self._base_env()
        env.update(
            {
                NODE_MARK: f"{self.tag}/{name}",
                "WARMBOX_HOME": str(home),
                "WARMBOX_CLUSTER__NODE": name,
                "WARMBOX_CLUSTER__SLOTS": str(SLOTS),
            }
        )
        node = Node(name, home, runtime_dir(home), env, home / "node.log")
        self.nodes[name] = node
        return node

    # ---- the registry and the nodes' states

    def member(self, name: str) -> Any:
        """A member's TLS files (warmbox.cluster.tls.Member): "router", "head" or "node-NAME"."""
        from warmbox.cluster import tls

        return tls.member(self.dir, name)

    def registry(self) -> Any:
        """The shared PostgreSQL registry, as any non-node process sees it (node "")."""
        if self._registry is None:
            from warmbox.storage.registry import Registry

            self._registry = Registry(self.dsn)
        return self._registry

    def node_row(self, name: str) -> Any:
        """The node's registry row (models.NodeInfo), None before it first joined."""
        return next((info for info in self.registry().nodes.nodes() if info.name == name), None)

    def node_state(self, name: str) -> str:
        row = self.node_row(name)
        return row.state if row is not None else ""

    def wait_up(self, name: str, timeout: float = START_TIMEOUT_S, after_epoch: int = 0) -> None:
        """Until the node's row is up under an epoch above ``after_epoch`` (a rejoin: a new life)."""
        node = self.nodes[name]

        def up() -> bool:
            if not node.alive:
                raise AssertionError(f"node {name} exited ({node.proc and node.proc.returncode}):\n{node.output()}")
            row = self.node_row(name)
            return row is not None and row.state == "up" and row.epoch > after_epoch

        try:
            wait_for(up, timeout, f"node {name} up in the registry", interval=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{node.output()}") from None

    def wait_state(self, name: str, state: str, timeout: float = DOWN_TIMEOUT_S) -> None:
        wait_for(lambda: self.node_state(name) == state, timeout, f"node {name} {state} in the registry", 0.1)

    def node_of(self, sandbox_id: str) -> str:
        return self.registry().nodes.node_of(sandbox_id)

    @contextlib.contextmanager
    def only(self, name: str):
        """Within: the router places new sandboxes on node ``name`` only (the others are set
        draining, which stops placement and nothing else); after: every such node up again."""
        others = [n for n in self.nodes if n != name and self.node_state(n) == "up"]
        for n in others:
            self.registry().nodes.set_node_state(n, "draining")
        time.sleep(VIEW_TTL_S)  # the router's view of the nodes is this old at most
        try:
            yield
        finally:
            for n in others:
                self.registry().nodes.set_node_state(n, "up")
            time.sleep(VIEW_TTL_S)

    # ---- failures

    def kill_node(self, name: str, *, wait_down: bool = True) -> None:
        """SIGKILL node ``name`` (its host dies); by default wait until the cluster marks it down."""
        self.nodes[name].kill9()
        if wait_down:
            self.wait_state(name, "down")

    def restart_node(self, name: str) -> Node:
        """Start node ``name`` again under the same name, home and runtime dir; wait until it is up."""
        node = self.nodes[name]
        assert not node.alive, f"node {name} still runs"
        row = self.node_row(name)
        node.start(self.head.address)
        self.wait_up(name, after_epoch=row.epoch if row is not None else 0)
        return node

    def ensure_all_up(self) -> None:
        """Restart any node a test left dead, drained or fenced (the next module starts from 3 up
        nodes); set back up one left draining. A node marked down that still runs is leaving (it was
        fenced): it is let exit first, never set up again under its old life (its raylet is going)."""
        for name, node in self.nodes.items():
            if node.alive and self.node_state(name) == "down":
                try:
                    node.proc.wait(STOP_TIMEOUT_S)  # type: ignore[union-attr]
                except subprocess.TimeoutExpired:
                    pass  # a fenced node that does not leave: ended below like a dead host
                if node.alive:
                    node.kill9()
            if not node.alive:
                node.kill9()  # its stragglers, if any
                self.restart_node(name)
            elif self.node_state(name) == "draining":
                self.registry().nodes.set_node_state(name, "up")

    # ---- stop

    def stop(self) -> list[str]:
        """Router, then nodes (SIGTERM, in parallel), then the head; then prove nothing is left:
        no process with the cluster's mark, no runc container or sandbox dir in any node's runtime
        dir. Returns the problems found (each also cleaned up here)."""
        problems: list[str] = []
        if self.router is not None:
            status = self.router.stop()
            if status != 0:
                problems.append(f"the router exited with {status} on SIGTERM:\n{self.router.output()}")
        running = [n for n in self.nodes.values() if n.alive]
        for node in running:
            os.kill(node.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
        for node in running:
            status = node.stop()
            if status != 0:
                problems.append(f"node {node.name} exited with {status} on SIGTERM:\n{node.output()}")
        for node in self.nodes.values():
            left = node.leftovers()
            if left:
                problems.append(f"node {node.name} left processes: {describe(left)}")
                kill_all(left)
        if self.head is not None:
            from warmbox.cluster import membership

            self.head.stop()
            left = membership.processes_in(self.dir / "ray")
            if left:
                problems.append(f"Ray processes left: {describe(left)}")
                kill_all(left)
        left = marked(MARK, self.tag)
        if left:
            problems.append(f"processes left: {describe(left)}")
            kill_all(left)
        for node in self.nodes.values():
            problems += _clean_runtime(node)
        if self._registry is not None:
            with contextlib.suppress(Exception):
                self._registry.close()
        self.keep_logs(os.environ.get(LOGS_ENV, ""))
        shutil.rmtree(self.dir, ignore_errors=True)
        return problems

    def keep_logs(self, dest: str) -> None:
        """Copy the router's and every node's log to ``dest``/<tag>/ (nothing if ``dest`` is "")."""
        if not dest:
            return
        out = Path(dest) / self.tag
        out.mkdir(parents=True, exist_ok=True)
        for log in [*self.dir.glob("router/*.log"), *(n.log for n in self.nodes.values())]:
            with contextlib.suppress(OSError):
                shutil.copy(log, out / f"{log.parent.name}-{log.name}")


def _clean_runtime(node: Node) -> list[str]:
    """What a node left in its runtime dir (runc containers, sandbox dirs, mounts): reported, then
    removed (runc delete by name, workspace disks released), so one failure does not leak into the host."""
    rt = node.runtime
    problems = []
    runc_root = rt / "runc"
    containers = [p.name for p in runc_root.iterdir()] if runc_root.is_dir() else []
    if containers:
        problems.append(f"node {node.name} left runc containers: {containers}")
        for cid in containers:
            runc = ["runc", "--root", str(runc_root)]
            subprocess.run([*runc, "delete", "--force", cid], capture_output=True, timeout=30)
    from warmbox.backends import rootfs, workspace_disk

    sandboxes = [p.name for p in (rt / "sandboxes").iterdir()] if (rt / "sandboxes").is_dir() else []
    if sandboxes:
        problems.append(f"node {node.name} left sandbox dirs: {sandboxes}")
    for name in sandboxes:  # never rmtree through a mount: the root overlay and the workspace disk first
        with contextlib.suppress(OSError):
            rootfs.release(rt / "sandboxes" / name)
        with contextlib.suppress(OSError):
            workspace_disk.release(rt / "sandboxes" / name)
    mounts = workspace_disk.mounts_under(rt)
    if mounts:
        problems.append(f"node {node.name} left mounts: {mounts}")
    else:
        shutil.rmtree(rt, ignore_errors=True)
    # the node's Ray temp dir (warmbox.cluster.node: /tmp/wbray-<the runtime dir's hash>), if it left it
    shutil.rmtree(Path("/tmp") / f"wbray-{rt.name[:10]}", ignore_errors=True)
    return problems
