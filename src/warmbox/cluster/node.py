"""``warmbox node join HEAD``: one engine per host, as its own process, serving its API to the router.

What the node process does, in order:
1. reconciles (``teardown.reconcile_node``): destroys local sandboxes the registry no longer gives
   this node as live (a previous life was marked down meanwhile);
2. starts its raylet as a fate-shared child (membership.start_raylet), advertising its capacity as
   Ray custom resources (slots, memory, the tiers its ``doctor`` says run, ``wbnode-<name>``);
3. serves the node API (server/serve.listen: the same app as ``warmbox serve``) over mutual TLS
   with its cluster certificate (cluster/tls.py); the router reaches it with the cluster token
   (server/peer.py); tenant keys are refused unless ``[cluster] direct_access``;
4. joins the registry (``join_node``: address, Ray node id, slots, tiers; a new epoch);
5. runs the daemon's duties for its home in process (reaper, its share of the pools, meters),
   and heartbeats every HEARTBEAT_S. It exits when the registry says it is fenced (marked down,
   or a newer life of it joined) or when its raylet is gone (Ray would report it dead anyway).

SIGTERM/SIGINT: a graceful leave. It sets itself ``draining`` (the router stops placing), closes
its API (requests in flight finish), destroys its pooled sandboxes, marks itself down (its live
sandboxes become ``lost``: callers get a typed error; paused ones resume on another node), tears
down their local runtime, stops its raylet and exits 0. ``warmbox node drain`` (the router) first
moves sandboxes off a node that should leave without losing any.

The engine is not a Ray actor: Ray kills an actor's child processes with it, and runc, runsc and
QEMU helpers are children (docs/cluster-research.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import shutil
import signal
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from warmbox import config
from warmbox.cluster import membership, tls
from warmbox.cluster.membership import Capacity, RayProcess
from warmbox.cluster.placement import NodeLoad, split_target
from warmbox.config import PoolConfig, ServerSettings
from warmbox.errors import ClusterError, ConfigError, WarmboxError
from warmbox.models import Limits, NodeInfo
from warmbox.storage.registry import Registry

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine

HEARTBEAT_S = 1.0
EXIT_FENCED = 3  # the registry fenced this node (marked down, or a newer life of it joined)
EXIT_RAYLET = 4  # its raylet is gone
HOST_RESERVE_MB = 1024  # memory kept back from sandboxes for the host, warmbox and Ray
SLOTS_PER_CPU = 8  # the default slot count's cap per host CPU
LEAVE_TIMEOUT_S = 120.0  # a graceful leave's teardown (pooled and lost sandboxes) is bounded by this


@dataclasses.dataclass(frozen=True)
class NodeOptions:
    """``warmbox node join``'s flags; None/0/"": from ``[cluster]``/``[server]``.

    head: the Ray head's address (HOST:PORT; ``ray://`` accepted); name: the node's name; slots:
    sandboxes it offers; host/port: its API's TCP address (port 0: any free port, the registry
    carries it); socket: its unix socket ("-": none; default under its runtime dir)."""

    head: str = ""
    name: str = ""
    slots: int = 0
    host: str | None = None
    port: int = 0
    socket: str | None = None


def ray_tmpdir(home: Path) -> Path:
    """This home's Ray temp dir: short (Ray's unix sockets live under it) and one per home, so
    a rejoin sweeps what a killed life left."""
    return Path("/tmp") / f"wbray-{hashlib.sha256(str(home).encode()).hexdigest()[:10]}"


def default_slots(memory_mb: int) -> int:
    """As many default-size sandboxes as the memory holds, at most SLOTS_PER_CPU per CPU."""
    return max(1, min(memory_mb // Limits.memory_mb, SLOTS_PER_CPU * (os.cpu_count() or 1)))


class NodeShare:
    """A node's share of the cluster-wide pool targets (engine/pool.py PoolShare): the targets are
    split over the up nodes that run the pool's tier, by slots (placement.split_target). Every
    node autoscales the shared targets (PoolManager._autoscale: each miss counted once, by
    whichever node looks first). The node list is re-read once a second."""

    def __init__(self, registry: Registry, name: str) -> None:
        self.registry = registry
        self.name = name
        self._nodes: list[NodeInfo] = []
        self._read_at = -1.0

    def _view(self) -> list[NodeInfo]:
        now = time.monotonic()
        if now - self._read_at >= 1.0:
            self._nodes = self.registry.nodes.nodes()
            self._read_at = now
        return self._nodes

    def share(self, pool: PoolConfig, target: int) -> int:
        loads = [
            NodeLoad(
                node=n.name,
                tiers=n.tiers,
                slots=n.slots,
                live=n.live,
                memory_mb=n.memory_mb,
                memory_used_mb=0,
                state=n.state,
            )
            for n in self._view()
        ]
        return split_target(target, loads, tier=pool.tier, key=pool.name).get(self.name, 0)


def _settings(home: Path, opts: NodeOptions) -> tuple[config.Settings, str, str]:
    """The node's settings with its name and head in the environment (so its engine, registry and
    any process it starts see them as ``[cluster] node`` / ``ray``); returns (settings, name, head)."""
    base = config.load(home).cluster
    name = opts.name or base.node
    head = opts.head or base.ray
    if not name:
        raise ConfigError("a node needs a name: --name or [cluster] node")
    if not head:
        raise ConfigError("a node needs the Ray head's address: HEAD or [cluster] ray")
    os.environ["WARMBOX_CLUSTER__NODE"] = name
    os.environ["WARMBOX_CLUSTER__RAY"] = membership.normalize_address(head)
    settings = config.load(home)  # validates the name as [cluster] node
    if not settings.cluster.token_file:
        raise ConfigError(
            "a node needs [cluster] token_file: the secret it shares with the router (made 0600 if missing; "
            "`warmbox cluster token FILE` makes one)"
        )
    return settings, name, settings.cluster.ray


def _api_settings(settings: ServerSettings, opts: NodeOptions, member: tls.Member, direct: bool) -> ServerSettings:
    """The node API's listeners: TLS with the node's cluster certificate, and a client certificate
    signed by the cluster's CA asked of every TCP caller (the router's; only checked when given
    with ``direct`` access). The unix socket stays for root and admins on the host."""
    return dataclasses.replace(
        settings,
        host=settings.host if opts.host is None else opts.host,
        port=opts.port,
        socket=settings.socket if opts.socket is None else opts.socket,
        tls_cert=str(member.cert),
        tls_key=str(member.key),
        tls_client_ca=str(member.ca),
        tls_client_optional=direct,
    )


def _advertised(address: str, raylet: RayProcess) -> str:
    """The API address others dial: a wildcard listen address becomes this node's Ray IP."""
    for wild in ("://0.0.0.0:", "://[::]:"):
        if wild in address and raylet.node_ip:
            return address.replace(wild, f"://{raylet.node_ip}:")
    return address


def _say(msg: str) -> None:
    print(f"warmbox node: {msg}", file=sys.stderr, flush=True)


async def _main(home: Path, opts: NodeOptions) -> int:
    from warmbox.engine import daemon, teardown
    from warmbox.engine.engine import Engine
    from warmbox.engine.pool import PoolManager
    from warmbox.server import peer
    from warmbox.server.serve import listen

    settings, name, head = _settings(home, opts)
    peer.ensure_token(settings.cluster.token_file)
    # the node's certificate from the cluster's CA (`warmbox cluster cert NAME`): its API's TLS and Ray's
    member = tls.member(tls.directory(settings.cluster.tls_dir, settings.cluster.token_file), tls.node_member(name))
    lock = daemon.hold_lock(home)
    if lock is None:  # a standalone daemon runs for this home: the node takes its duties over
        await daemon.down_home(home)
        lock = daemon.hold_lock(home)
        if lock is None:
            raise ClusterError(f"another process holds {home / 'daemon.lock'}: is a node already running here?")
    engine = Engine.for_home(home)
    registry = engine.registry
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    destroyed = await teardown.reconcile_node(engine)
    if destroyed:
        _say(f"reconciled: destroyed {len(destroyed)} local sandboxes the registry no longer gives this node")
    tiers = tuple(t.tier for t in engine.doctor() if t.available)
    memory_mb = max(0, config.host_capacity().memory_mb - HOST_RESERVE_MB)
    slots = opts.slots or settings.cluster.slots or default_slots(memory_mb)
    capacity = Capacity(name=name, slots=slots, memory_mb=memory_mb, tiers=tiers)
    # from this (the main) thread: PR_SET_PDEATHSIG follows the thread that started the child
    tmp = ray_tmpdir(home)
    if tmp.exists() and not membership.processes_in(tmp):
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed life left (logs, sockets): nothing runs in it
    raylet = membership.start_raylet(head, tmp, capacity, token_file=settings.cluster.token_file, tls=member)
    served = None
    code = 0
    try:
        # Ray's GCS checks the raylet's certificate against the address Ray gave it; the router, the API's
        tls.check_covers(member, name, (raylet.node_ip,))
        api = _api_settings(settings.server, opts, member, settings.cluster.direct_access)
        served = await listen(engine, home, api, mcp=False)
        address = _advertised(served.addresses[0], raylet)
        if address.startswith("https://"):
            tls.check_covers(member, name, (urllib.parse.urlsplit(address).hostname or "",))
        epoch = registry.nodes.join_node(
            NodeInfo(
                name=name, address=address, ray_node_id=raylet.node_id, slots=slots, memory_mb=memory_mb, tiers=tiers
            )
        )
        print(f"node {name} up: api {address}, ray node {raylet.node_id}", flush=True)
        pools = PoolManager(engine, split=NodeShare(registry, name))
        duties = asyncio.ensure_future(daemon.tend(engine, pools, stop))
        code = await _heartbeat(engine, epoch, raylet, stop)
        stop.set()
        if code != EXIT_FENCED:  # fenced: the registry has moved on; nothing of the node's row is ours to write
            try:
                registry.nodes.set_node_state(name, "draining")  # no new placements while it leaves
            except WarmboxError as e:
                _say(f"cannot set itself draining: {e}")
        await served.close()  # requests in flight finish
        served = None
        await duties
        async with asyncio.timeout(LEAVE_TIMEOUT_S):
            if code != EXIT_FENCED:
                await pools.drain()  # its pooled sandboxes go (they are this node's)
                lost = registry.nodes.mark_node_down(name, "left" if code == 0 else "its raylet is gone", epoch=epoch)
                if lost:
                    _say(f"left with {len(lost)} live sandboxes, now lost: {', '.join(lost[:10])}")
            await teardown.reconcile_node(engine)  # the local runtime of what is no longer this node's goes
    finally:
        if served is not None:
            await served.close()
        raylet.stop()
        if not membership.processes_in(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
    return code


async def _heartbeat(engine: Engine, epoch: int, raylet: RayProcess, stop: asyncio.Event) -> int:
    """Heartbeat until ``stop`` (0), a fence (EXIT_FENCED: what is no longer this node's is ended
    here first) or the raylet's end (EXIT_RAYLET).

    The beats come from a thread of their own, not from the event loop the node's API and duties
    share: a burst of heavy requests (one tenant's 24 concurrent exports held the loop ~13 s)
    would otherwise age the heartbeat past the monitor's limit, and a node marked down loses every
    tenant's live sandboxes. A slow loop is a slow node; a dead one stops beating (its process,
    its raylet, or its way to the registry)."""
    from warmbox.engine import teardown

    loop = asyncio.get_running_loop()
    verdict: asyncio.Future[int] = loop.create_future()
    halt = threading.Event()

    def settle(code: int) -> None:
        if not verdict.done():
            verdict.set_result(code)

    def beat() -> None:
        code = 0
        while not halt.is_set():
            if not raylet.alive():
                code = EXIT_RAYLET
                break
            try:
                live, pooled = engine.registry.nodes.local_counts()
                if not engine.registry.nodes.heartbeat(engine.node, epoch, live, pooled):
                    code = EXIT_FENCED
                    break
            except WarmboxError as e:  # a registry hiccup: the next beat tries again
                _say(f"heartbeat: {e}")
            halt.wait(HEARTBEAT_S)
        loop.call_soon_threadsafe(settle, code)

    thread = threading.Thread(target=beat, name="warmbox-heartbeat", daemon=True)
    thread.start()
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((verdict, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        halt.set()
        stopped.cancel()
        await asyncio.to_thread(thread.join)
    code = verdict.result() if verdict.done() else 0
    if code == EXIT_RAYLET:
        _say("its raylet is gone: leaving")
    elif code == EXIT_FENCED:
        _say(f"fenced by the registry (epoch {epoch} is no longer this node's): leaving")
        await teardown.reconcile_node(engine)  # what it ran is no longer its own: ended here at once
    return code


async def join(home: Path, opts: NodeOptions) -> int:
    """The node process's life, on the main thread's event loop; returns its exit status (0: it
    left on SIGTERM/SIGINT; EXIT_FENCED, EXIT_RAYLET)."""
    return await _main(home, opts)


__all__ = ["EXIT_FENCED", "EXIT_RAYLET", "HEARTBEAT_S", "NodeOptions", "NodeShare", "join", "ray_tmpdir"]
