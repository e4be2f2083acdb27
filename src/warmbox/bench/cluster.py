"""``warmbox bench cluster`` — a warmbox cluster of 1, 2 and 3 nodes on this host, through its router.

Everything runs on this one machine, so more nodes bring no more CPU: the numbers show what the
cluster layer costs (router hop, registry on PostgreSQL, placement) and that placement spreads,
not a speed-up.

The benchmark starts its own cluster in a private directory: a PostgreSQL server (Debian's, as the
``postgres`` user, on a unix socket; durability off: the disk is not what is measured), a Ray head
(token authentication), ``warmbox node join`` processes (each with its own home and runtime dir,
sharing one local object-store directory for snapshots) and the router ``warmbox serve --cluster``.
Every node's home declares the same pool; its cluster-wide target (``--pool``, default
``--creates``: every burst create can be a hit) is split over the up nodes. Then, with 1, then 2,
then 3 nodes up (each joins between steps):

warm:     create (a pool hit) -> first ``run_code("print(2+2)")`` -> kill through the router, one at
          a time, the pools refilled before each; p50/p99, misses, and which node each landed on.
burst:    ``--creates`` creates + first ``run_code`` from ``--clients`` client processes
          (``--concurrency`` in flight each), the pools full before; creates/s over the burst,
          p50/p99, pool hits, the router's CPU per create.
failover: (the last step, ``--failovers`` times) a sandbox through the router, a file written, paused;
          a second one on the same node running ``sleep``; that node SIGKILLed (its process group
          and every process of its node); then connect (which resumes it) until it answers ``cat``
          of that file on another node: seconds from the kill to the answer, to the node marked
          down in the registry, and to the call in flight's end (SandboxLost); the issue's goal
          (p50 <= 3 s, max <= 5 s over >= 5) met or not. The node rejoins after.

Every process is ended by its PID, the directories removed. Results: a table, or JSON (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from warmbox.bench.api import CODE, Server, _remote_burst, _warm_once
from warmbox.bench.common import _stats, check_ranges
from warmbox.errors import WarmboxError

POOL = "bench-cluster"
NODE_NAMES = ("n1", "n2", "n3")
MARK = "WARMBOX_BENCH_CLUSTER"  # in every process the benchmark starts: what is left is found by it
START_TIMEOUT_S = 120.0
DOWN_TIMEOUT_S = 60.0
FAILOVER_TIMEOUT_S = 90.0
GOAL_RUNS, GOAL_P50_S, GOAL_MAX_S = 5, 3.0, 5.0  # issue 39's failover bound
PG_ROOT = Path("/usr/lib/postgresql")


# ---------------------------------------------------------------------------- PostgreSQL


class Postgres:
    """A throwaway PostgreSQL server in ``dir`` (Debian's binaries as ``postgres``; no TCP)."""

    def __init__(self, root: Path) -> None:
        versions = sorted(
            (p for p in PG_ROOT.glob("*/bin") if (p / "initdb").exists() and p.parent.name.isdigit()),
            key=lambda p: int(p.parent.name),
        )
        if not versions:
            raise WarmboxError(f"bench cluster needs PostgreSQL under {PG_ROOT} (scripts/bootstrap installs it)")
        self.bin = versions[-1]
        pw = pwd.getpwnam("postgres")
        self._as = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", "--reset-env"]
        self.dir = Path(f"{root}-pg")  # beside the cluster's 0700 dir: the postgres user must reach it
        self.dir.mkdir(mode=0o755)
        os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.data = self.dir / "data"
        self.log = self.dir / "pg.log"
        self.dsn = f"postgresql://warmbox@/postgres?host={self.dir}"
        self.pid: int | None = None

    def start(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "warmbox", "--auth=trust", "-E", "UTF8", "--no-locale",
                  "--no-sync", "--no-instructions")  # fmt: skip
        opts = (
            f"-c listen_addresses='' -c unix_socket_directories={self.dir} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c shared_buffers=32MB -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "30", "-o", opts, "start")
        self.pid = int((self.data / "postmaster.pid").read_text().split()[0])

    def _run(self, tool: str, *args: str) -> None:
        r = subprocess.run(
            [*self._as, str(self.bin / tool), *args], cwd=self.dir, capture_output=True, text=True, timeout=60
        )
        if r.returncode != 0:
            raise WarmboxError(f"{tool} failed ({r.returncode}): {r.stderr.strip()[-500:]}")

    def stop(self) -> None:
        if self.pid is None and not (self.data / "postmaster.pid").exists():
            return
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "30", "stop")
        except (WarmboxError, subprocess.TimeoutExpired):
            if self.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGQUIT)
        self.pid = None

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------- processes


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        return entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def marked(value: str) -> list[int]:
    """PIDs of running processes whose environment has ``MARK=value`` (never this one)."""
    entry = f"{MARK}={value}".encode()
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit()
        and int(p.name) != os.getpid()
        and _environ_has(int(p.name), entry)
        and _running(int(p.name))
    ]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class NodeProc:
    """One ``warmbox node join`` process in its own process group, home and runtime dir."""

    def __init__(self, name: str, home: Path, env: dict[str, str], head: str, slots: int) -> None:
        self.name = name
        self.home = home
        self.env = env
        self.head = head
        self.slots = slots
        self.log = home / "node.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "warmbox.cli.main", "node", "join", self.head, "--name", self.name]
        argv += ["--slots", str(self.slots)]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                cwd=self.home, start_new_session=True,
            )  # fmt: skip

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace").strip()[-600:]
        except OSError:
            return "(no log)"

    def leftovers(self) -> list[int]:
        from warmbox.cluster import membership, node

        return sorted(set(marked(self.env[MARK])) | set(membership.processes_in(node.ray_tmpdir(self.home))))

    def kill9(self) -> None:
        """The host dies: SIGKILL its process group, then every process of the node that left it."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        deadline = time.monotonic() + 10
        while (left := self.leftovers()) and time.monotonic() < deadline:
            kill_all(left)
            time.sleep(0.05)

    def stop(self, timeout: float = 90.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        kill_all(self.leftovers())


class Router(Server):
    """``warmbox serve --cluster HEAD`` (bench api's Server, with the cluster's settings); TCP, a
    key of tenant ``bench`` from the shared registry."""

    def __init__(self, home: Path, env: dict[str, str], head: str, key: str) -> None:
        super().__init__(home, tcp=True)
        self.env = env
        self.head = head
        self.key = key

    def start(self) -> None:
        import re

        from warmbox.bench.api import SERVER_START_S, _readline

        sock = self.home / "api.sock"
        argv = [sys.executable, "-m", "warmbox.cli.main", "serve", "--socket", str(sock), "--no-mcp"]
        argv += ["--port", "0", "--cluster", self.head]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                argv, env=self.env, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, cwd=self.home
            )
        assert self.proc.stdout is not None
        line = _readline(self.proc.stdout, SERVER_START_S)
        m = re.match(r"listening on (.*)", line.decode(errors="replace").strip())
        if m is None:
            raise WarmboxError(f"the router did not start: {self.tail()}")
        self.url = next(a for a in m.group(1).split(" and ") if a.startswith("http"))


class LocalCluster:
    """PostgreSQL + a Ray head + nodes + a router, all on this host, in ``/tmp/wbbc-<hex>``."""

    def __init__(self, slots: int, pool: int) -> None:
        self.tag = secrets.token_hex(3)
        self.dir = Path(f"/tmp/wbbc-{self.tag}")  # short: unix sockets live under it
        self.dir.mkdir(mode=0o700)
        self.slots = slots
        self.pool = pool  # the cluster-wide target of the benchmark's pool, split over the up nodes
        self.token = self.dir / "token"
        self.token.write_text(secrets.token_urlsafe(32) + "\n")
        self.token.chmod(0o600)
        self.objects = self.dir / "objects"
        self.objects.mkdir(mode=0o700)
        self.pg = Postgres(self.dir)
        self.head: Any = None
        self.nodes: dict[str, NodeProc] = {}
        self.router: Router | None = None
        self._registry: Any = None

    def env(self) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("WARMBOX_", "RAY_"))}
        keep.update(
            {
                MARK: self.tag,
                "RAY_USAGE_STATS_ENABLED": "0",
                "WARMBOX_CLUSTER__REGISTRY": self.pg.dsn,
                "WARMBOX_CLUSTER__TOKEN_FILE": str(self.token),
                "WARMBOX_OBJECT_STORE": str(self.objects),  # one directory every node of this host shares
            }
        )
        return keep

    def peer_token(self) -> str:
        return self.token.read_text().strip()

    def router_tls(self) -> Any:
        """The router's side of the mutual TLS to a node (an ssl.SSLContext)."""
        from warmbox.cluster import tls

        return tls.member(self.dir, tls.ROUTER).client_context()

    def registry(self) -> Any:
        if self._registry is None:
            from warmbox.storage.registry import Registry

            self._registry = Registry(self.pg.dsn)
        return self._registry

    def start(self) -> None:
        from warmbox.cluster import membership, tls

        self.pg.start()
        self.registry()  # the schema, made once here before any node opens it
        # the cluster CA beside the token (as `warmbox cluster head` makes it), the head and router certificates
        self.head = membership.start_head(
            self.dir / "ray", token_file=self.token, tls=tls.head_member(self.dir, tls.local_ips())
        )
        tls.issue(self.dir, tls.ROUTER)
        self.add_node()
        router_home = self.dir / "router"
        router_home.mkdir(mode=0o700)
        self._write_config(router_home)
        _key_id, key = self.registry().tenants.create_key("bench")
        self.router = Router(router_home, {**self.env(), "WARMBOX_HOME": str(router_home)}, self.head.address, key)
        self.router.start()

    def _write_config(self, home: Path) -> None:
        target = self.pool
        (home / "warmbox.toml").write_text(
            "[daemon]\nidle_exit = 3600\n\n"
            f'[pools.{POOL}]\ntemplate = "base"\ntier = "container"\nmin = {target}\nmax = {target}\n'
            f"target = {target}\nidle_shrink = 3600\nrefill_concurrency = 2\n"
        )

    def add_node(self) -> str:
        from warmbox.cluster import tls

        name = NODE_NAMES[len(self.nodes)]
        home = self.dir / name
        home.mkdir(mode=0o700)
        tls.issue(self.dir, tls.node_member(name), tls.local_ips())  # `warmbox cluster cert NAME --ip IP`
        self._write_config(home)
        env = {**self.env(), "WARMBOX_HOME": str(home), "WARMBOX_CLUSTER__NODE": name}
        env["WARMBOX_CLUSTER__SLOTS"] = str(self.slots)
        env[MARK] = f"{self.tag}/{name}"
        node = NodeProc(name, home, env, self.head.address, self.slots)
        self.nodes[name] = node
        node.start()
        self.wait_state(name, "up", START_TIMEOUT_S)
        return name

    def state(self, name: str) -> str:
        return next((i.state for i in self.registry().nodes.nodes() if i.name == name), "")

    def wait_state(self, name: str, state: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.state(name) != state:
            node = self.nodes[name]
            if state == "up" and not node.alive:
                raise WarmboxError(f"node {name} exited ({node.proc and node.proc.returncode}): {node.tail()}")
            if time.monotonic() > deadline:
                raise WarmboxError(f"node {name} not {state} within {timeout:g} s: {node.tail()}")
            time.sleep(0.05)

    def settled(self) -> tuple[bool, str]:
        """Whether every up node holds exactly its share of the pool (placement.split_target, as the
        nodes split it) ready, and nothing is being created or retired; and what is there now."""
        from warmbox.cluster.placement import NodeLoad, split_target

        reg = self.registry()
        up = [i for i in reg.nodes.nodes() if i.state == "up"]
        loads = [NodeLoad(i.name, tuple(i.tiers), i.slots, 0, i.memory_mb, 0) for i in up]
        shares = split_target(self.pool, loads, tier="container", key=POOL)
        usage = {u.node: u for u in reg.nodes.node_usage()}
        now = {}
        for i in up:
            u = usage.get(i.name)
            ready = sum(n for p, n in u.pooled if p == POOL) if u else 0
            now[i.name] = (ready, u.live if u else 0)
        ok = all(now[name] == (shares.get(name, 0), 0) for name in now)
        return ok, f"want {shares}, (ready, busy) now {now}"

    def wait_pools(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            ok, what = self.settled()
            if ok:
                return
            if time.monotonic() > deadline:
                raise WarmboxError(f"the pools did not settle within {timeout:g} s: {what}")
            time.sleep(0.05)

    def restart(self, name: str) -> None:
        node = self.nodes[name]
        node.start()
        self.wait_state(name, "up", START_TIMEOUT_S)

    def stop(self) -> list[str]:
        """Router, nodes (SIGTERM: each ends its sandboxes), head, PostgreSQL; what was left, killed."""
        problems: list[str] = []
        if self.router is not None:
            self.router.stop()
        for node in self.nodes.values():
            if node.alive:
                node.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        for node in self.nodes.values():
            node.stop()
        if self.head is not None:
            self.head.stop()
        if self._registry is not None:
            with contextlib.suppress(Exception):
                self._registry.close()
        self.pg.stop()
        self.pg.remove()
        from warmbox.cluster.node import ray_tmpdir

        for node in self.nodes.values():  # the nodes' Ray temp dirs (one per home, outside it)
            shutil.rmtree(ray_tmpdir(node.home), ignore_errors=True)
        left = marked(self.tag) + [p for n in self.nodes.values() for p in marked(f"{self.tag}/{n.name}")]
        if left:
            problems.append(f"processes left (killed): {sorted(set(left))}")
            kill_all(left)
        problems += self._runtime_leftovers()
        shutil.rmtree(self.dir, ignore_errors=True)
        return problems

    def _runtime_leftovers(self) -> list[str]:
        from warmbox.paths import runtime_dir

        out = []
        for node in self.nodes.values():
            rt = runtime_dir(node.home)
            runc = rt / "runc"
            left = [p.name for p in runc.iterdir()] if runc.is_dir() else []
            if left:
                out.append(f"node {node.name} left runc containers: {left}")
            else:
                shutil.rmtree(rt, ignore_errors=True)
        return out


# ---------------------------------------------------------------------------- the parts


async def part_warm(cluster: LocalCluster, runs: int) -> dict[str, Any]:
    """Warm create -> first run_code through the router, and (alternating, same run) straight to the
    node the router picks for it (n1: equal nodes tie by name) as a cluster peer: what the router adds."""
    router = cluster.router
    assert router is not None
    via_router: dict[str, Any] = {"api_url": router.url, "api_key": router.key}
    direct = next(i.address for i in cluster.registry().nodes.nodes() if i.name == NODE_NAMES[0])
    await asyncio.to_thread(cluster.wait_pools)
    await _warm_once(via_router)  # untimed: imports, the first connection
    samples: dict[str, list[float]] = {"router": [], "direct": []}
    misses = 0
    nodes: Counter[str] = Counter()
    for i in range(runs):
        for side in ("router", "direct") if i % 2 == 0 else ("direct", "router"):
            await asyncio.to_thread(cluster.wait_pools)  # a refill never competes with a timed create
            if side == "router":
                ms, hit, sandbox_id = await _warm_on(via_router)
                nodes[await asyncio.to_thread(cluster.registry().nodes.node_of, sandbox_id)] += 1
            else:
                ms, hit, sandbox_id = await _warm_direct(direct, cluster.peer_token(), cluster.router_tls())
            samples[side].append(ms)
            misses += not hit
    router_stats, direct_stats = _stats(samples["router"]), _stats(samples["direct"])
    return {
        "stats": router_stats,
        "direct_stats": direct_stats,
        "added_p50_ms": router_stats["p50_ms"] - direct_stats["p50_ms"],
        "runs": runs,
        "pool_misses": misses,
        "nodes": dict(sorted(nodes.items())),
    }


async def _warm_direct(url: str, token: str, verify: Any) -> tuple[float, bool, str]:
    from warmbox.sdk.http import HttpTransport
    from warmbox.server import peer

    # one per sandbox, as the SDK makes; over the mutual TLS the router uses
    transport = HttpTransport(url, token, headers={peer.TENANT: "bench"}, verify=verify)
    try:
        return await _warm_on({"transport": transport})
    finally:
        await transport.close()


async def _warm_on(where: dict[str, Any]) -> tuple[float, bool, str]:
    from warmbox.sdk.sandbox import AsyncSandbox

    t0 = time.perf_counter()
    sb = await AsyncSandbox.create(tier="container", timeout=120, template="base", **where)
    try:
        ex = await sb.run_code(CODE)
        ms = (time.perf_counter() - t0) * 1e3
        if ex.error or ex.stdout.strip() != "4":
            raise WarmboxError(f"warm sandbox answered {ex.stdout!r} {ex.error}")
    finally:
        try:
            await sb.kill()
        finally:
            await sb.close()
    return ms, sb.from_pool, sb.sandbox_id


async def part_burst(cluster: LocalCluster, creates: int, clients: int, concurrency: int) -> dict[str, Any]:
    router = cluster.router
    assert router is not None
    await asyncio.to_thread(cluster.wait_pools)
    before = await asyncio.to_thread(_bench_sandboxes, cluster)
    r = await _remote_burst(router, clients, creates, concurrency)
    after = await asyncio.to_thread(_bench_sandboxes, cluster)
    spread = Counter(node for sid, node in after.items() if sid not in before)
    done = len(r["latencies_ms"])
    return {
        "creates": creates,
        "completed": done,
        "creates_per_s": done / r["wall_s"] if r["wall_s"] else 0.0,
        "stats": _stats(r["latencies_ms"]) if done else None,
        "hits": r["hits"],
        "nodes": dict(sorted(spread.items())),
        "errors": r["errors"][:5],
        "router_cpu_ms_per_create": r["server_cpu_s"] * 1e3 / done if done else None,
    }


def _bench_sandboxes(cluster: LocalCluster) -> dict[str, str]:
    """Every sandbox of the benchmark's tenant, ended ones too: id -> its node."""
    return {info.sandbox_id: handle.node for info, handle in cluster.registry().sandboxes.list(True, tenant="bench")}


async def part_failover(cluster: LocalCluster, times: int) -> dict[str, Any]:
    from warmbox.sdk.sandbox import AsyncSandbox

    router = cluster.router
    assert router is not None
    where: dict[str, Any] = {"api_url": router.url, "api_key": router.key}
    runs = []
    for _ in range(times):
        await asyncio.to_thread(cluster.wait_pools)
        sb = await AsyncSandbox.create(tier="container", timeout=600, template="base", **where)
        token = secrets.token_hex(8)
        try:
            await sb.files.write("/workspace/failover.txt", token)
            await sb.pause()
        finally:
            await sb.close()
        victim = await asyncio.to_thread(cluster.registry().nodes.node_of, sb.sandbox_id)
        busy = await _sandbox_on(cluster, victim, where)  # a call in flight there when it dies
        call = asyncio.ensure_future(busy.commands.run("sleep 300", timeout=600)) if busy else None
        if call is not None:
            await asyncio.sleep(0.3)  # the command runs on the node
        t0 = time.monotonic()
        await asyncio.to_thread(cluster.nodes[victim].kill9)
        down_at = asyncio.ensure_future(asyncio.to_thread(_wait_down, cluster, victim))
        in_flight = asyncio.ensure_future(_ended(call, t0)) if call is not None else None
        attempts = 0
        answered = None
        while time.monotonic() - t0 < FAILOVER_TIMEOUT_S:
            attempts += 1
            tried = time.monotonic()
            try:
                back = await AsyncSandbox.connect(sb.sandbox_id, **where)
            except WarmboxError:
                await asyncio.sleep(0.1)
                continue
            connected = time.monotonic()
            try:
                out = await back.commands.run("cat /workspace/failover.txt")
                if out.stdout.strip() != token:
                    raise WarmboxError(f"the file came back as {out.stdout[:80]!r}, not {token!r}")
                answered = time.monotonic() - t0
                now_on = await asyncio.to_thread(cluster.registry().nodes.node_of, sb.sandbox_id)
                await back.kill()
            finally:
                await back.close()
            break
        seen_down = await down_at
        ended = await in_flight if in_flight is not None else None
        if busy is not None:
            try:
                await busy.kill()  # lost: kill forgets it
            finally:
                await busy.close()
        if answered is None:
            raise WarmboxError(f"the paused sandbox did not answer within {FAILOVER_TIMEOUT_S:g} s of its node's death")
        run = {"node": victim, "now_on": now_on, "seconds": answered, "down_after_s": seen_down - t0, "tries": attempts}
        # the last connect: from its call (sent while the node was not yet known dead) to its answer
        run["connect_s"], run["connect_sent_s"] = connected - tried, tried - t0
        if ended is not None:
            run["in_flight_s"], run["in_flight_error"] = ended
        runs.append(run)
        await asyncio.to_thread(cluster.restart, victim)
    secs = sorted(r["seconds"] for r in runs)
    flight = sorted(r["in_flight_s"] for r in runs if "in_flight_s" in r)
    p50, worst = _median(secs), secs[-1]
    return {
        "runs": runs,
        "seconds_p50": p50,
        "seconds_max": worst,
        "down_after_s_p50": _median(sorted(r["down_after_s"] for r in runs)),
        "in_flight_s_max": flight[-1] if flight else None,
        # issue 39: p50 <= 3 s and worst <= 5 s over at least 5 failovers; calls in flight end
        # (SandboxLost) within the same bound
        "goal_met": len(runs) >= GOAL_RUNS
        and p50 <= GOAL_P50_S
        and worst <= GOAL_MAX_S
        and all(r.get("in_flight_error", "SandboxLost") == "SandboxLost" for r in runs)
        and (not flight or flight[-1] <= GOAL_MAX_S),
    }


def _median(xs: list[float]) -> float:
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


async def _sandbox_on(cluster: LocalCluster, node: str, where: dict[str, Any]) -> Any:
    """A running sandbox on ``node`` through the router (placement is salted: a few tries; the
    ones landing elsewhere are killed), or None."""
    from warmbox.sdk.sandbox import AsyncSandbox

    for _ in range(10):  # 2 nodes drawn evenly: none there after 10 is a 1-in-1,000 run
        sb = await AsyncSandbox.create(tier="container", timeout=600, template="base", **where)
        if await asyncio.to_thread(cluster.registry().nodes.node_of, sb.sandbox_id) == node:
            return sb
        try:
            await sb.kill()
        finally:
            await sb.close()
    return None


async def _ended(call: asyncio.Future[Any], t0: float) -> tuple[float, str]:
    """Seconds from ``t0`` until the call in flight ended, and the name of its error ("" if none)."""
    try:
        await asyncio.wait_for(call, FAILOVER_TIMEOUT_S)
        error = ""
    except WarmboxError as e:
        error = type(e).__name__
    except TimeoutError:
        error = "still running"
    return time.monotonic() - t0, error


def _wait_down(cluster: LocalCluster, name: str) -> float:
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while cluster.state(name) != "down" and time.monotonic() < deadline:
        time.sleep(0.05)
    return time.monotonic()


# ---------------------------------------------------------------------------- the command


def validate(args: argparse.Namespace) -> None:
    check_ranges(
        args,
        (
            ("nodes", 1, 3),
            ("runs", 1, 1000),
            ("creates", 1, 500),
            ("clients", 1, 16),
            ("concurrency", 1, 64),
            ("failovers", 0, 20),
            ("slots", 2, 256),
            ("pool", 0, 500),
        ),
    )


async def bench_cluster(args: argparse.Namespace) -> dict[str, Any]:
    cluster = LocalCluster(args.slots, args.pool or args.creates)
    report: dict[str, Any] = {"steps": [], "host_cpus": os.cpu_count()}
    try:
        t0 = time.monotonic()
        await asyncio.to_thread(cluster.start)
        report["start_s"] = time.monotonic() - t0
        for n in range(1, args.nodes + 1):
            if n > 1:
                t0 = time.monotonic()
                await asyncio.to_thread(cluster.add_node)
                join_s = time.monotonic() - t0
            else:
                join_s = report["start_s"]
            step: dict[str, Any] = {"nodes": n, "join_s": join_s}
            step["warm"] = await part_warm(cluster, args.runs)
            step["burst"] = await part_burst(cluster, args.creates, args.clients, args.concurrency)
            report["steps"].append(step)
        if args.failovers:
            report["failover"] = await part_failover(cluster, args.failovers)
    finally:
        report["problems"] = await asyncio.to_thread(cluster.stop)
    return report


def print_report(r: dict[str, Any]) -> None:
    print(f"warmbox bench cluster (this host: {r['host_cpus']} CPUs; cluster up in {r['start_s']:.1f} s)")
    print(
        "nodes  warm create->first p50/p99 ms  (direct to the node)  misses  warm on      creates/s  burst p50/p99 ms"
        "  hits   burst on             router CPU ms/create"
    )
    for s in r["steps"]:
        w, b = s["warm"], s["burst"]
        spread = " ".join(f"{k}:{v}" for k, v in w["nodes"].items())
        burst_on = " ".join(f"{k}:{v}" for k, v in b["nodes"].items())
        bs = b["stats"] or {"p50_ms": 0.0, "p99_ms": 0.0}
        cpu = b["router_cpu_ms_per_create"]
        d = w["direct_stats"]
        print(
            f"{s['nodes']:>5}  {w['stats']['p50_ms']:>12.2f} / {w['stats']['p99_ms']:<13.2f}  "
            f"({d['p50_ms']:>6.2f} / {d['p99_ms']:<6.2f})      {w['pool_misses']:>6}  "
            f"{spread:<11}  {b['creates_per_s']:>9.1f}  {bs['p50_ms']:>7.1f} / {bs['p99_ms']:<7.1f}  "
            f"{b['hits']:>2}/{b['completed']:<3}  {burst_on:<19}  {'' if cpu is None else f'{cpu:.2f}'}"
        )
        if b["errors"]:
            print(f"       burst errors: {b['errors']}")
    f = r.get("failover")
    if f:
        print(
            f"failover (node SIGKILL -> paused sandbox answering on another node): p50 {f['seconds_p50']:.2f} s, "
            f"max {f['seconds_max']:.2f} s; node marked down after p50 {f['down_after_s_p50']:.2f} s"
            + (
                ""
                if f["in_flight_s_max"] is None
                else f"; calls in flight ended after max {f['in_flight_s_max']:.2f} s"
            )
            + f" (goal p50 <= {GOAL_P50_S:g} s, max <= {GOAL_MAX_S:g} s over >= {GOAL_RUNS}: "
            + ("met)" if f["goal_met"] else "NOT met)")
        )
        for run in f["runs"]:
            flight = (
                f", the call in flight: {run['in_flight_error'] or 'no error'} after {run['in_flight_s']:.2f} s"
                if "in_flight_s" in run
                else ""
            )
            print(
                f"  {run['node']} killed -> {run['now_on']}: {run['seconds']:.2f} s "
                f"(down after {run['down_after_s']:.2f} s, {run['tries']} tries{flight})"
            )
    for p in r["problems"]:
        print(f"cleanup: {p}")


async def command(args: argparse.Namespace) -> int:
    validate(args)
    report = await bench_cluster(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 1 if report["problems"] else 0


__all__ = ["LocalCluster", "bench_cluster", "command", "print_report"]
