"""The API tier of a cluster: a front that runs each operation on the node that should run it.

``warmbox serve --cluster HEAD`` serves the same HTTP API as ``warmbox serve``; its front is a
:class:`ClusterFront` (the :class:`~warmbox.sdk.transport.Transport` protocol, like EngineFront)
that forwards each typed request over :class:`~warmbox.sdk.http.HttpTransport` to a node's own API
server, as a cluster peer (the shared token, and who the caller is in headers the node trusts only
with that token). Results, streams and typed errors come back as they would in process: a command's
output, a file stream, a process's output, a directory watch and a port tunnel are relayed piece by
piece (never a whole body held here).

Which node runs an operation is :data:`RULES` (one rule per operation, a test checks none is
missing). A node is *up* when the registry says ``up`` and Ray has its raylet alive; *serving* when
up or ``draining`` (a draining node takes no new sandbox but still runs its own until moved).

When the monitor (:mod:`warmbox.cluster.monitor`) marks a node down, every call forwarded to it
that is still waiting is ended at once with SandboxLost (an operation on a sandbox) or
ConnectionLost (anything else: its outcome is unknown), and its connections are closed so open
streams end too: a dead node never makes a caller hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import itertools
import logging
import secrets
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from warmbox import operations as ops
from warmbox.cluster.placement import NodeLoad, Want, place, take
from warmbox.config import Settings
from warmbox.errors import (
    ConnectionLost,
    Forbidden,
    InvalidArgument,
    NoCapacity,
    NodeFenced,
    SandboxLost,
    SandboxNotFound,
    VolumeElsewhere,
    WarmboxError,
)
from warmbox.lifecycle import lost
from warmbox.models import (
    ApprovalRequest,
    Limits,
    NodeInfo,
    NodeUsage,
    PoolStatus,
    SandboxInfo,
    State,
    Tenant,
    TierStatus,
    Volume,
)
from warmbox.sdk.http import HttpTransport
from warmbox.sdk.transport import Cancellable
from warmbox.server import peer
from warmbox.storage.registry import Registry, unknown_sandbox
from warmbox.tiers import canonical_tier

log = logging.getLogger("warmbox.cluster")
R = TypeVar("R")
VIEW_TTL_S = 0.5  # the node list is read from the registry at most this often per router
UP, DRAINING, DOWN = "up", "draining", "down"
# a sandbox's node stopped answering: how long its caller waits for the monitor's verdict (the
# heartbeat limit, 10 s, and a margin; Ray's health check usually decides in 1-6 s) before the
# connection's own error is raised instead of SandboxLost
SETTLE_S = 12.0
MAX_TRANSPORTS = 1024  # transports (HTTP sessions) to nodes kept open: one per node and caller's key
EVICT_IDLE_S = 300.0  # past MAX_TRANSPORTS, one unused this long is closed (an open stream on it ends)
SETTLE_POLL_S = 0.25

# headers of a forwarded request (with ``Authorization: Bearer <cluster token>``): who the caller
# is. A node believes them only from a request bearing the cluster's token (server/peer.py).
TENANT_HEADER = peer.TENANT  # absent: the host's root
ADMIN_HEADER = peer.ADMIN  # "1": the caller's key is an admin key
KEY_HEADER = peer.KEY_ID  # the caller's key id (for logs and approvals)


class Rule(enum.Enum):
    """Where an operation runs."""

    OWNER = "owner"  # the node that owns the sandbox (registry.nodes.node_of): see ClusterFront._owner
    PLACE = "place"  # a new sandbox (create, fork): the node placement.place() picks
    RESUME = "resume"  # a paused sandbox: its own node if up, else the node placement picks
    ANY = "any"  # the answer is in the shared registry or object store: any up node (round robin)
    ALL = "all"  # per-host state: every up node, the answers merged
    VOLUME = "volume"  # a named volume's own node (its disk is there)
    ROUTER = "router"  # the router itself (a drain)


# What a node answers on a lost sandbox (from the shared registry): its record and history, and a
# kill (which forgets it). Every other operation on it is SandboxLost, said by the router itself.
LOST_ANSWERED: frozenset[type[ops.Request[Any]]] = frozenset(
    {ops.Info, ops.Timings, ops.Logs, ops.Metrics, ops.Commands, ops.Export, ops.NetworkLog, ops.Kill, ops.Detach}
)

# Operations without a sandbox id, and why they run where they do. Every operation naming a
# sandbox (a ``sandbox_id`` field) is Rule.OWNER.
RULES_BY_OP: dict[type[ops.Request[Any]], Rule] = {
    ops.Create: Rule.PLACE,
    ops.Resume: Rule.RESUME,
    ops.ListSandboxes: Rule.ANY,  # the registry is shared; with reap=True every node reaps its own (ALL)
    ops.Doctor: Rule.ALL,  # which tiers: a tier is available when some up node runs it
    ops.ChooseTier: Rule.ANY,  # tiers are the same on every node of a cluster (one config)
    ops.ListSnapshots: Rule.ANY,  # registry + shared object store
    ops.DeleteSnapshot: Rule.ANY,
    ops.GcSnapshots: Rule.ANY,  # one node sweeps the shared store (two at once would race)
    ops.PoolsList: Rule.ALL,  # targets, hits and costs are the registry's; ready/warming each node's: summed
    ops.PoolsResize: Rule.ANY,  # a cluster-wide target in the registry; nodes split it
    ops.VolumeCreate: Rule.ANY,  # its disk is made on that node; sandboxes mounting it run there
    ops.VolumeList: Rule.ANY,  # registry rows
    ops.VolumeGet: Rule.ANY,
    ops.VolumeDelete: Rule.VOLUME,  # only the node holding the disk deletes it
    ops.TemplateBuild: Rule.ANY,  # versions are registry rows; layers go to the object store
    ops.TemplateList: Rule.ANY,
    ops.TemplateGet: Rule.ANY,
    ops.TemplateDelete: Rule.ANY,
    ops.TemplateGc: Rule.ALL,  # layers live on each host: each collects its own; reports merged
    ops.ApprovalsList: Rule.ANY,  # the approval queue is registry rows
    ops.ApprovalAnswer: Rule.ANY,
    ops.NodeDrain: Rule.ROUTER,
    ops.CreateAndRun: Rule.PLACE,  # its create placed as one, its run on the sandbox's node
}


def rule_of(cls: type[ops.Request[Any]]) -> Rule:
    """Where requests of ``cls`` run (InvalidArgument for something not an operation)."""
    got = RULES_BY_OP.get(cls)
    if got is not None:
        return got
    if cls in ops.REQUESTS.values() and any(f.name == "sandbox_id" for f in dataclasses.fields(cast(Any, cls))):
        return Rule.OWNER
    raise InvalidArgument(f"not an operation: {cls.__name__}")


def peer_headers(tenant: Tenant | None) -> dict[str, str]:
    """The headers naming the caller on a forwarded request (none: the host's root)."""
    if tenant is None:
        return {}
    out = {TENANT_HEADER: tenant.name}
    if tenant.admin:
        out[ADMIN_HEADER] = "1"
    if tenant.key_id:
        out[KEY_HEADER] = tenant.key_id
    return out


def node_load(node: NodeInfo, usage: NodeUsage | None, pool_yields: bool = False) -> NodeLoad:
    """A node as placement sees it: its registry row (capacity, state) and what its sandboxes' rows
    hold now (``usage``; None: it holds none). Pooled sandboxes hold a slot and their memory too,
    unless ``pool_yields``: a user's paused sandbox coming back goes before a node's warm spares
    (its pool shrinks to make room)."""
    live = memory = 0
    pooled: tuple[tuple[str, int], ...] = ()
    if usage is not None:
        pooled = usage.pooled
        live = usage.live + (0 if pool_yields else sum(n for _, n in pooled))
        memory = usage.memory_mb + (0 if pool_yields else usage.pooled_memory_mb)
    return NodeLoad(
        node=node.name,
        tiers=tuple(node.tiers),
        slots=node.slots,
        live=live,
        memory_mb=node.memory_mb,
        memory_used_mb=memory,
        pooled=pooled,
        state=node.state,
    )


PoolShapes = Mapping[tuple[str, str, Limits], str]  # (tier, template, limits) -> the pool's name


def want_of(
    settings: Settings,
    tier: str,
    limits: Limits | None,
    template: object = None,
    pool: object = True,
    pools: PoolShapes | None = None,
) -> Want:
    """What a create asks placement for: its tier, memory, and the pool (by name) whose ready
    sandboxes it could claim ("" when it takes none). pools: the pools the nodes hold ready
    sandboxes of, by shape (Cluster.pools, from the registry); None: this router's own
    ``[pools]``. InvalidArgument for a tier or limits the node would refuse anyway."""
    tier = canonical_tier(tier)
    limits = limits or Limits()
    shape = ""
    if pool is True:
        name = template if isinstance(template, str) else settings.defaults.template
        if pools is not None:
            shape = pools.get((tier, name, limits), "")
        else:
            pc = settings.pool_for(tier, name, limits)
            shape = pc.name if pc is not None else ""
    return Want(tier=tier, shape=shape, memory_mb=limits.memory_mb)


def merge_doctor(answers: list[tuple[str, list[TierStatus]]]) -> list[TierStatus]:
    """One tier list for the cluster: a tier is available when some node runs it; the reason names
    the nodes (each node's own reason when none runs it)."""
    tiers: dict[str, list[tuple[str, TierStatus]]] = {}
    for node, statuses in answers:
        for s in statuses:
            tiers.setdefault(s.tier, []).append((node, s))
    out = []
    for tier, per in tiers.items():
        yes = [n for n, s in per if s.available]
        if yes:
            first = next(s for _, s in per if s.available)
            out.append(TierStatus(tier, True, f"on {', '.join(yes)}: {first.reason}"))
        else:
            out.append(TierStatus(tier, False, "; ".join(f"{n}: {s.reason}" for n, s in per)))
    return out


def merge_pools(answers: list[list[PoolStatus]]) -> list[PoolStatus]:
    """The cluster's pools: each node counts its own ready and warming sandboxes (summed here);
    target, bounds, hits, misses and costs are the shared registry's (the same from every node)."""
    out: dict[str, PoolStatus] = {}
    for statuses in answers:
        for p in statuses:
            got = out.get(p.name)
            out[p.name] = (
                p
                if got is None
                else dataclasses.replace(got, ready=got.ready + p.ready, warming=got.warming + p.warming)
            )
    return list(out.values())


def merge_gc(reports: list[ops.TemplateGcReport]) -> ops.TemplateGcReport:
    return ops.TemplateGcReport(
        layers=tuple(x for r in reports for x in r.layers),
        roots=tuple(x for r in reports for x in r.roots),
        bytes_freed=sum(r.bytes_freed for r in reports),
        dry_run=all(r.dry_run for r in reports),
        kept_roots=tuple(x for r in reports for x in r.kept_roots),
        shared_layers=tuple(sorted({x for r in reports for x in r.shared_layers})),
    )


class Cluster:
    """What every ClusterFront of one router shares: the registry, the peer token, the node view
    (registry rows + Ray's liveness, which the monitor keeps), one HTTP transport per node and
    caller, and the calls in flight to each node.

    ray_alive: the Ray node ids Ray reports alive (None: Ray's view is unknown, the registry's
    state alone counts). settings: this router's settings (its defaults for a create's tier).
    tls: the router's side of the mutual TLS to the nodes (cluster.tls.Member.client_context: its
    certificate, the cluster's CA as the only root); with it, a node advertising a plain http://
    address is never sent the token (None: no TLS, for a test of the router alone)."""

    def __init__(
        self, registry: Registry, token: str, settings: Callable[[], Settings], tls: ssl.SSLContext | None = None
    ) -> None:
        self.registry = registry
        self._token = token
        self._tls = tls
        self._settings = settings
        self.ray_alive: frozenset[str] | None = None
        self._view: dict[str, NodeInfo] = {}
        self._read_at = -1.0
        self._usage: dict[str, NodeUsage] | None = None
        self._pools: dict[tuple[str, str, Limits], str] | None = None
        self._booked: dict[str, NodeLoad] = {}  # placements made since the last read of the view
        self._transports: dict[tuple[str, str, tuple[tuple[str, str], ...]], HttpTransport] = {}
        self._used: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
        self.max_transports = MAX_TRANSPORTS
        self.evict_idle_s = EVICT_IDLE_S
        self._inflight: dict[str, set[asyncio.Task[Any]]] = {}
        self._aborted: dict[asyncio.Task[Any], tuple[str, str]] = {}
        self._down: dict[str, str] = {}  # node -> why, as this router learned it
        self._rr = itertools.count()
        self._closed = False
        self._closing: set[asyncio.Future[None]] = set()  # transports of nodes gone down, closing
        self.wake: Callable[[], None] = lambda: None  # the monitor's next round now (Monitor sets it)

    # ---- the view

    def nodes(self, fresh: bool = False) -> dict[str, NodeInfo]:
        """Every node of the registry by name (read at most every VIEW_TTL_S unless ``fresh``)."""
        now = time.monotonic()
        if fresh or now - self._read_at >= VIEW_TTL_S:
            self.set_view(self.registry.nodes.nodes())
        return self._view

    def set_view(self, nodes: list[NodeInfo]) -> None:
        self._view = {n.name: n for n in nodes}
        self._read_at = time.monotonic()
        self._usage = None
        self._pools = None
        self._booked = {}

    def usage(self) -> dict[str, NodeUsage]:
        """What each node's sandboxes hold, read once per view (placement only needs it)."""
        if self._usage is None:
            self._usage = {u.node: u for u in self.registry.nodes.node_usage()}
        return self._usage

    def pools(self) -> PoolShapes:
        """The pools the nodes hold ready sandboxes of, by shape, read from the registry once per
        view: the nodes' ``[pools]`` (a pool none holds a sandbox of now changes no placement)."""
        if self._pools is None:
            self._pools = {(tier, tpl, lim): name for name, tier, tpl, lim in self.registry.pools.pool_shapes()}
        return self._pools

    def alive(self, node: NodeInfo) -> bool:
        """Ray has its raylet alive (or Ray's view is unknown, or the node gave no Ray id)."""
        return self.ray_alive is None or not node.ray_node_id or node.ray_node_id in self.ray_alive

    def up(self, fresh: bool = False) -> list[NodeInfo]:
        """Nodes that take new sandboxes, by name."""
        return sorted(
            (n for n in self.nodes(fresh).values() if n.state == UP and self.alive(n) and n.name not in self._down),
            key=lambda n: n.name,
        )

    def serving(self, name: str) -> NodeInfo | None:
        """The node ``name`` if it runs its sandboxes (up or draining, and alive)."""
        n = self.nodes().get(name)
        if n is None or n.state not in (UP, DRAINING) or not self.alive(n) or name in self._down:
            return None
        return n

    def any_up(self, exclude: str = "") -> NodeInfo:
        """One up node, round robin (NoCapacity when there is none)."""
        nodes = [n for n in self.up() if n.name != exclude] or self.up()
        if not nodes:
            raise NoCapacity(self.no_node_message())
        return nodes[next(self._rr) % len(nodes)]

    def no_node_message(self) -> str:
        view = self.nodes()
        if not view:
            return "the cluster has no node: start one with `warmbox node join HEAD`"
        return "no node of the cluster is up: " + "; ".join(
            f"{n.name}: {n.state if n.state == DOWN or self.alive(n) else 'dead (Ray)'}"
            for n in sorted(view.values(), key=lambda n: n.name)
        )

    def place(self, want: Want, exclude: str = "", *, pool_yields: bool = False) -> NodeInfo:
        """The up node that should take ``want`` (NoCapacity naming why each node cannot).
        pool_yields: pooled sandboxes hold no slot (a paused sandbox moving: see node_load)."""
        up = [n for n in self.up() if n.name != exclude]
        usage = self.usage() if up else {}
        loads = [self._booked.get(n.name) or node_load(n, usage.get(n.name), pool_yields) for n in up]
        if not loads:
            raise NoCapacity(self.no_node_message())
        # a salt per create: routers with views of their own do not all pick the same best node
        name = place(loads, want, secrets.token_hex(8))
        chosen = next(x for x in loads if x.node == name)
        self._booked[name] = take(chosen, want)  # until the next read: the next create sees this one
        return self._view[name]

    def ready(self) -> str:
        """ "" when this router can serve (its registry answers, a node is up); else why not."""
        try:
            up = self.up(fresh=True)
        except WarmboxError as e:
            return f"the registry does not answer: {e}"
        return "" if up else self.no_node_message()

    # ---- transports and calls in flight

    def transport(self, node: NodeInfo, tenant: Tenant | None) -> HttpTransport:
        """The transport to ``node`` as ``tenant`` (one per node and key: the key's id travels in
        its headers). At most ``max_transports``: past that, those unused ``evict_idle_s`` are closed."""
        headers = tuple(sorted(peer_headers(tenant).items()))
        key = (node.name, node.address, headers)
        t = self._transports.pop(key, None)  # re-inserted last: the dict is in order of use
        if t is None:
            if self._closed:
                raise ConnectionLost("the router is shutting down")
            if self._tls is not None and not node.address.startswith("https://"):
                # the token would travel in clear to whoever answers there: refused, typed
                raise ConnectionLost(f"node {node.name!r} serves its API without TLS ({node.address}): not used")
            t = HttpTransport(node.address, self._token, headers=dict(headers), verify=self._tls or True)
            self._evict()
        self._transports[key] = t
        self._used[key] = time.monotonic()
        return t

    def _evict(self) -> None:
        if len(self._transports) < self.max_transports:
            return
        now = time.monotonic()
        for key in list(self._transports)[: len(self._transports) - self.max_transports + 1]:
            if now - self._used.get(key, now) < self.evict_idle_s:
                break  # in order of use: the rest are newer
            self._close_later(self._transports.pop(key))
            self._used.pop(key, None)

    def _close_later(self, t: HttpTransport) -> None:
        closing = asyncio.ensure_future(t.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    def enter(self, node: str, task: asyncio.Task[Any]) -> None:
        self._inflight.setdefault(node, set()).add(task)

    def leave(self, node: str, task: asyncio.Task[Any]) -> None:
        calls = self._inflight.get(node)
        if calls is not None:
            calls.discard(task)

    def aborted(self, task: asyncio.Task[Any]) -> tuple[str, str] | None:
        """(node, why) if ``task`` was cancelled because its node went down."""
        return self._aborted.pop(task, None)

    def node_down(self, name: str, reason: str) -> None:
        """``name`` is down: end every call in flight to it (their callers get a typed error at
        once) and close its connections (open streams end). Idempotent."""
        self._down[name] = reason
        for task in list(self._inflight.pop(name, ())):
            if not task.done():
                self._aborted[task] = (name, reason)
                task.cancel()
        for key in [k for k in self._transports if k[0] == name]:
            self._close_later(self._transports.pop(key))
            self._used.pop(key, None)

    def node_back(self, name: str) -> None:
        """``name`` rejoined (a new epoch, state up): calls go to it again."""
        self._down.pop(name, None)

    def down_reason(self, name: str) -> str | None:
        """Why ``name`` is down (this router's word, else the registry's state), None if it is not."""
        if name in self._down:
            return self._down[name]
        n = self.nodes(fresh=True).get(name)
        if n is None:
            return "it left the cluster"
        if n.state == DOWN:
            return "marked down"
        if not self.alive(n):
            return "Ray reports it dead"
        return None

    async def settle(self, name: str, within: float) -> str | None:
        """Why ``name`` is down, waiting up to ``within`` seconds for the monitor to decide (None: it
        is not down, as far as anyone knows by then)."""
        deadline = time.monotonic() + within
        while True:
            reason = self.down_reason(name)
            if reason is not None or time.monotonic() >= deadline:
                return reason
            self.wake()  # a caller waits on this verdict: Ray is asked now, not at the next period
            await asyncio.sleep(SETTLE_POLL_S)

    def settings(self) -> Settings:
        return self._settings()

    async def close(self) -> None:
        self._closed = True
        transports, self._transports = self._transports, {}
        for t in transports.values():
            await t.close()


class ClusterFront:
    """One caller's handle on the cluster (the Transport protocol): each operation on the node
    :data:`RULES_BY_OP` names. tenant: whose requests these are (None: the host's root)."""

    def __init__(self, cluster: Cluster, tenant: Tenant | None = None) -> None:
        self.cluster = cluster
        self.tenant = tenant

    async def handle(self, request: ops.Request[R]) -> R:
        ops.check_text(request)  # before a node is chosen (the node's own front checks again)
        rule = rule_of(type(request))
        if rule is Rule.OWNER:
            return await self._owner(request)
        if isinstance(request, ops.CreateAndRun):
            return cast(R, await ops.create_and_run(self.handle, request))
        if rule is Rule.PLACE:
            return cast(R, await self._create(cast(ops.Create, request)))
        if rule is Rule.RESUME:
            return cast(R, await self._resume(cast(ops.Resume, request)))
        if rule is Rule.ROUTER:
            return cast(R, await self._drain(cast(ops.NodeDrain, request)))
        if rule is Rule.VOLUME:
            name = cast(ops.VolumeDelete, request).name
            node = self._volume_home(self._named_volumes([name])) if isinstance(name, str) else None
            return await self._forward(node or self.cluster.any_up(), request)
        if rule is Rule.ALL or (isinstance(request, ops.ListSandboxes) and request.reap):
            return await self._all(request)
        return await self._any(request)

    async def subscribe_approvals(self, sandbox_id: str, hook: Callable[[ApprovalRequest], object]) -> Cancellable:
        node = await self._target(sandbox_id)
        return await self.cluster.transport(node, self.tenant).subscribe_approvals(sandbox_id, hook)

    async def close(self) -> None:
        pass  # the transports are the cluster's, shared by every front of this router

    # ---- rules

    async def _owner(self, request: ops.Request[R]) -> R:
        sid = cast(Any, request).sandbox_id
        if not isinstance(sid, str) or not sid.startswith("sb-"):
            return await self._forward(self.cluster.any_up(), request)  # it refuses the id, typed
        node = await self._target(sid, type(request))
        try:
            return await self._forward(node, request, sid)
        except SandboxLost:
            moved = self._moved_off(sid, node.name) if isinstance(request, ops.Connect) else None
            if moved is None:
                raise
            return await self._forward(moved, request, sid)

    def _moved_off(self, sid: str, dead: str) -> NodeInfo | None:
        """Where a connect (or resume) goes when the node it was sent to went down during the call
        while the sandbox was paused there (the registry keeps a paused sandbox paused when its
        node is marked down: nothing of it ran): the node placement picks, in the same call,
        instead of the caller hearing SandboxLost and trying again (a failover's last step).
        None when it was not paused: it is lost."""
        info = self._own(sid)
        if info.state is not State.PAUSED or self.cluster.down_reason(dead) is None:
            return None
        return self._move(sid, info.tier, info.memory_mb, exclude=dead)

    async def _target(self, sid: str, request: type[ops.Request[Any]] = ops.Info) -> NodeInfo:
        """The node to send an operation on ``sid`` to: its owner while that node serves; a paused
        sandbox whose node is gone or draining moves to the node placement picks (any node resumes
        it from the shared store); anything else on a node that is gone goes to any up node, which
        answers from the shared registry (SandboxLost for a lost one, its record for a read)."""
        owner = self.cluster.registry.nodes.node_of(sid)
        node = self.cluster.serving(owner) if owner else None
        if node is not None and node.state == UP:
            return node
        info = self._own(sid)
        if info.state is State.PAUSED:
            return self._move(sid, info.tier, info.memory_mb, exclude=owner)
        if node is not None:  # draining: it still runs its sandboxes
            return node
        if info.state is State.LOST and request not in LOST_ANSWERED:
            raise lost(sid, owner, self.cluster.registry.sandboxes.ended_reason(sid))  # no node needed to say so
        return self.cluster.any_up(exclude=owner)

    def _own(self, sid: str) -> SandboxInfo:
        """The sandbox's record if it is this caller's (another tenant's: the error of an unknown id,
        before the router changes anything for it)."""
        info, _ = self.cluster.registry.sandboxes.get(sid)
        if self.tenant is not None and info.tenant != self.tenant.name:
            raise unknown_sandbox(sid)
        return info

    def _move(self, sid: str, tier: str, memory_mb: int, exclude: str = "") -> NodeInfo:
        """Where a paused sandbox resumes, its row given to that node first: its volumes' node if
        it mounts any (VolumeElsewhere if that is not up), else the node placement picks."""
        home = self._volume_home(self._mounted(sid))
        if home is not None:
            if home.name != self.cluster.registry.nodes.node_of(sid):
                self.cluster.registry.sandboxes.move(sid, home.name)
            return home
        want = Want(tier=canonical_tier(tier), memory_mb=max(1, memory_mb))
        target = self.cluster.place(want, exclude=exclude, pool_yields=True)
        self.cluster.registry.sandboxes.move(sid, target.name)
        log.info("sandbox %s moves to node %s", sid, target.name)
        return target

    async def _create(self, r: ops.Create) -> ops.Opened:
        settings = self.cluster.settings()
        template: object = r.template
        home: NodeInfo | None = None  # the node holding its volumes' disks: it runs there
        if isinstance(r.from_snapshot, str):
            tier, limits = self._snapshot_shape(r.from_snapshot)
            template = None
            sid = self._snapshot_sandbox(r.from_snapshot)
            if sid:
                home = self._volume_home(self._mounted(sid))
        else:
            tier = r.tier if isinstance(r.tier, str) and r.tier else settings.defaults.tier
            limits = r.limits if isinstance(r.limits, Limits) else None
            if isinstance(r.volumes, (tuple, list)) and r.volumes:
                home = self._volume_home(self._named_volumes([v.name for v in r.volumes if isinstance(v, Volume)]))
        if home is not None:
            return await self._forward(home, r)
        if not isinstance(r.from_snapshot, str) and (tier == "auto" or r.requirements is not None):
            choice = await self._any(ops.ChooseTier(r.requirements or _default_requirements()))
            tier = choice.tier
        try:
            pooled = r.pool and not r.volumes and r.from_snapshot is None
            want = want_of(settings, tier, limits, template, pooled, self.cluster.pools() if pooled else None)
        except InvalidArgument:
            return await self._forward(self.cluster.any_up(), r)  # the node refuses it, typed
        node = self.cluster.place(want)
        try:
            return await self._forward(node, r)
        except NodeFenced:  # marked down since this router's last look: nothing was made there
            return await self._forward(self.cluster.place(want, exclude=node.name), r)

    # ---- named volumes: a volume's disk is on the node that made it; what mounts it runs there

    def _named_volumes(self, names: list[str]) -> list[tuple[str, str]]:
        """(name, volume id) of the caller's volumes of these names (VolumeNotFound for one it has not)."""
        owner = "" if self.tenant is None else self.tenant.name
        return [(name, self.cluster.registry.volumes.volume(owner, name)[0]) for name in names if isinstance(name, str)]

    def _mounted(self, sid: str) -> list[tuple[str, str]]:
        """(name, volume id) of what the sandbox ``sid`` mounts."""
        return [(name or vid, vid) for name, vid, _, _ in self.cluster.registry.volumes.volumes_of(sid)]

    def _volume_home(self, volumes: list[tuple[str, str]]) -> NodeInfo | None:
        """The node holding these volumes' disks, up (None: no volume, or a single host's).
        VolumeElsewhere when they are on several nodes, or on one that is not up."""
        homes: dict[str, str] = {}
        for name, vid in volumes:
            holder = self.cluster.registry.volumes.volume_node(vid)
            if holder:
                homes.setdefault(holder, name)
        if not homes:
            return None
        if len(homes) > 1:
            where = ", ".join(f"{name} on {node}" for node, name in sorted(homes.items()))
            first_node, first_name = next(iter(sorted(homes.items())))
            raise VolumeElsewhere(
                f"these volumes' disks are on different nodes ({where}): one sandbox mounts volumes of one node",
                volume=first_name,
                node=first_node,
            )
        node_name, name = next(iter(homes.items()))
        home = self.cluster.serving(node_name)
        if home is None or home.state != UP:
            row = self.cluster.nodes().get(node_name)
            state = "gone" if row is None else row.state if row.state != UP else "dead (Ray)"
            raise VolumeElsewhere(
                f"volume {name}'s disk is on node {node_name}, which is {state}: what mounts it runs there only",
                volume=name,
                node=node_name,
            )
        return home

    def _snapshot_sandbox(self, ref: str) -> str:
        """The sandbox a snapshot (or a paused sandbox's id) was taken of ("" if unknown)."""
        if ref.startswith("sb-"):
            return ref
        return self.cluster.registry.snapshots.snapshot_sandbox(ref) or ""  # one read by its key, never a scan

    def _snapshot_shape(self, ref: str) -> tuple[str, Limits | None]:
        """The tier and memory of the sandbox a snapshot (or a paused sandbox's id) was taken of."""
        # one read by the snapshot's key: a scan of every tenant's snapshots here held the router's
        # event loop ~0.1-0.2 s per request at 100k snapshots, for every caller of this router
        sid = ref if ref.startswith("sb-") else (self.cluster.registry.snapshots.snapshot_sandbox(ref) or "")
        if not sid:
            return self.cluster.settings().defaults.tier, None  # the node says it is unknown
        try:
            info, _ = self.cluster.registry.sandboxes.get(sid)
        except SandboxNotFound:
            return self.cluster.settings().defaults.tier, None
        return info.tier, Limits(memory_mb=max(1, info.memory_mb))

    async def _resume(self, r: ops.Resume) -> ops.Opened:
        ref = r.snapshot
        if isinstance(ref, str) and ref.startswith("sb-"):
            owner = self.cluster.registry.nodes.node_of(ref)
            node = self.cluster.serving(owner) if owner else None
            if node is not None and node.state == UP:
                try:
                    return await self._forward(node, r, ref)
                except SandboxLost:  # its node went down during the call: as a connect's
                    moved = self._moved_off(ref, node.name)
                    if moved is None:
                        raise
                    return await self._forward(moved, r, ref)
            info = self._own(ref)
            if info.state is State.PAUSED:
                node = self._move(ref, info.tier, info.memory_mb, exclude=owner)
                try:
                    return await self._forward(node, r, ref)
                except NodeFenced:  # as for a create: nothing was resumed there
                    return await self._forward(self._move(ref, info.tier, info.memory_mb, exclude=node.name), r, ref)
            return await self._forward(node or self.cluster.any_up(), r, ref)  # refused there, typed
        if isinstance(ref, str):
            sid = self._snapshot_sandbox(ref)
            home = self._volume_home(self._mounted(sid)) if sid else None
            if home is not None:
                return await self._forward(home, r)
            tier, limits = self._snapshot_shape(ref)
            return await self._forward(
                self.cluster.place(want_of(self.cluster.settings(), tier, limits, pool=False)), r
            )
        return await self._forward(self.cluster.any_up(), r)

    async def _any(self, request: ops.Request[R]) -> R:
        node = self.cluster.any_up()
        try:
            return await self._forward(node, request)
        except ConnectionLost:
            if not _idempotent(request) or len(self.cluster.up()) < 2:
                raise
            return await self._forward(self.cluster.any_up(exclude=node.name), request)  # once more, elsewhere

    async def _all(self, request: ops.Request[R]) -> R:
        nodes = self.cluster.up()
        if not nodes:
            raise NoCapacity(self.cluster.no_node_message())
        answers = await asyncio.gather(*(self._forward(n, request) for n in nodes))
        if isinstance(request, ops.Doctor):
            return cast(
                R, merge_doctor([(n.name, cast(list[TierStatus], a)) for n, a in zip(nodes, answers, strict=True)])
            )
        if isinstance(request, ops.TemplateGc):
            return cast(R, merge_gc(cast(list[ops.TemplateGcReport], answers)))
        if isinstance(request, ops.PoolsList):
            return cast(R, merge_pools(cast(list[list[PoolStatus]], answers)))
        return answers[0]  # list(reap=True): every node reaped its own; the registry's list is one

    async def _drain(self, r: ops.NodeDrain) -> ops.DrainReport:
        if self.tenant is not None and not self.tenant.admin:
            raise Forbidden(f"draining a node is for admin keys; tenant {self.tenant.name!r}'s key is not one")
        from warmbox.cluster.drain import drain

        return await drain(self.cluster, r.name, r.timeout)

    # ---- forwarding

    async def _forward(self, node: NodeInfo, request: ops.Request[R], sandbox_id: str = "") -> R:
        """``request`` on ``node``, as this front's caller. A node that goes down meanwhile ends the
        call at once: SandboxLost for an operation on a sandbox, else ConnectionLost."""
        task = asyncio.current_task()
        assert task is not None
        self.cluster.enter(node.name, task)
        try:
            try:
                return await self.cluster.transport(node, self.tenant).handle(request)
            finally:
                self.cluster.leave(node.name, task)  # before any wait below: node_down cancels only calls
        except asyncio.CancelledError:
            why = self.cluster.aborted(task)
            if why is None:
                raise  # the caller went away
            task.uncancel()
            raise self._node_lost(node.name, why[1], request, sandbox_id) from None
        except ConnectionLost:
            # the node stopped answering: if it died, the monitor says so within its bounds (Ray's
            # health check, the heartbeat limit); the caller gets that verdict, typed, not a guess
            reason = await self.cluster.settle(node.name, SETTLE_S if sandbox_id else 0.0)
            if reason is None:
                raise
            raise self._node_lost(node.name, reason, request, sandbox_id) from None

    def _node_lost(self, node: str, why: str, request: ops.Request[Any], sandbox_id: str) -> WarmboxError:
        if sandbox_id:
            try:
                self._own(sandbox_id)  # the node never judged the caller: another tenant's id stays unknown
            except WarmboxError as e:
                return e
            return lost(sandbox_id, node, why)
        return ConnectionLost(f"node {node!r} went down during {request.op.value} ({why}): its outcome is unknown")


def _idempotent(request: ops.Request[Any]) -> bool:
    from warmbox import api

    return api.BY_OP[request.op].idempotent


def _default_requirements() -> Any:
    from warmbox.models import Requirements

    return Requirements()


__all__ = [
    "ADMIN_HEADER",
    "KEY_HEADER",
    "RULES_BY_OP",
    "TENANT_HEADER",
    "Cluster",
    "ClusterFront",
    "Rule",
    "merge_doctor",
    "merge_gc",
    "merge_pools",
    "node_load",
    "peer_headers",
    "rule_of",
]
