"""The router's watch on the nodes: Ray's liveness and the registry's heartbeats -> a node marked down.

Every PERIOD_S the monitor reads the node rows and asks Ray which raylets are alive (sooner while a
call waits on a node that stopped answering: Cluster.settle wakes it). A node that is
not down whose raylet Ray reports dead, or whose last heartbeat is older than ``heartbeat_timeout_s``,
is marked down in the registry (``NodeStore.mark_node_down``: its live sandboxes become lost, its
paused ones stay resumable on any node, its epoch moves on so it is fenced), and this router ends
every call still waiting on it (:meth:`Cluster.node_down`). Several routers may watch one cluster:
the mark is conditional on the epoch the monitor saw (a node that rejoined meanwhile is left
alone) and marking a node that is already down changes nothing, so whichever router comes first
acts and the others only end their own calls.

Ray's view unknown (the head unreachable): heartbeats alone decide, and Ray's silence marks nothing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

from warmbox.cluster.router import DOWN, UP, Cluster
from warmbox.cluster.tls import Member
from warmbox.errors import ClusterError, WarmboxError
from warmbox.models import NodeInfo

log = logging.getLogger("warmbox.cluster.monitor")
PERIOD_S = 0.25  # a round is two short reads (Ray's node table, the registry's node rows)
HEARTBEAT_TIMEOUT_S = 10.0  # a node heartbeats every second or so: ten missed ones and it is down
RAY_TIMEOUT_S = 2.0  # a GCS answer later than this: Ray's view is unknown this round

AliveIds = Callable[[], frozenset[str] | None]


def verdict(node: NodeInfo, alive: frozenset[str] | None, now: float, heartbeat_timeout_s: float) -> str:
    """Why ``node`` must be marked down ("" when it must not). Pure: the monitor's whole rule."""
    if node.state == DOWN:
        return ""
    if alive is not None and node.ray_node_id and node.ray_node_id not in alive:
        return f"Ray reports its raylet {node.ray_node_id[:12]} dead"
    age = now - node.heartbeat_at
    if node.heartbeat_at > 0 and age > heartbeat_timeout_s:
        return f"no heartbeat for {age:.1f} s (limit {heartbeat_timeout_s:g} s)"
    return ""


def ray_alive(address: str, token_file: str, tls: Member) -> AliveIds:
    """What Ray says is alive, from the head's GCS at ``address`` (HOST:PORT): a client of its own,
    no Ray driver in the router, authenticated with the cluster's token over TLS with the router's
    certificate. None for a round whose answer did not come (Ray unknown)."""
    from warmbox.cluster.membership import Membership

    membership = Membership(address, token_file, tls)  # ClusterError if the head cannot be reached at start

    def alive() -> frozenset[str] | None:
        try:
            return frozenset(n.node_id for n in membership.alive(timeout_s=RAY_TIMEOUT_S))
        except ClusterError:
            return None  # the head is unreachable: Ray's view is unknown, never "all dead"

    return alive


class Monitor:
    """The watch task of one router (start() / stop())."""

    def __init__(
        self,
        cluster: Cluster,
        alive: AliveIds | None,
        *,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        period_s: float = PERIOD_S,
    ) -> None:
        self.cluster = cluster
        self._alive = alive
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.period_s = period_s
        self._task: asyncio.Task[None] | None = None
        self._epochs: dict[str, int] = {}
        self._kick = asyncio.Event()
        cluster.wake = self._kick.set  # a caller waiting on a node's verdict (Cluster.settle)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except WarmboxError as e:  # the registry is down: nothing is marked; /readyz says so
                log.warning("cluster monitor: %s", e)
            except Exception:
                log.exception("cluster monitor failed a round")
            self._kick.clear()
            try:  # the next round after period_s, or at once when a caller waits on a verdict
                await asyncio.wait_for(self._kick.wait(), self.period_s)
            except TimeoutError:
                pass

    async def _ray(self) -> frozenset[str] | None:
        if self._alive is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._alive), RAY_TIMEOUT_S)
        except TimeoutError:
            return None

    async def tick(self) -> list[str]:
        """One round: read, judge, mark. The names of the nodes this round found down."""
        alive = await self._ray()
        nodes = await asyncio.to_thread(self.cluster.registry.nodes.nodes)
        self.cluster.ray_alive = alive
        self.cluster.set_view(nodes)
        now = time.time()
        found = []
        for node in nodes:
            if node.state == UP and self._epochs.get(node.name, node.epoch) != node.epoch:
                self.cluster.node_back(node.name)  # rejoined under a new epoch
            self._epochs[node.name] = node.epoch
            if node.state == DOWN:
                self.cluster.node_down(node.name, "marked down")  # by another router, or a drain
                continue
            why = verdict(node, alive, now, self.heartbeat_timeout_s)
            if not why:
                continue
            found.append(node.name)
            self.cluster.node_down(node.name, why)  # this router's calls end now, whoever marks it
            lost = await asyncio.to_thread(
                functools.partial(self.cluster.registry.nodes.mark_node_down, node.name, why, epoch=node.epoch)
            )
            log.warning("node %s marked down (%s): %d sandbox(es) lost", node.name, why, len(lost))
        if found:
            self.cluster.set_view(await asyncio.to_thread(self.cluster.registry.nodes.nodes))
        return found


__all__ = ["HEARTBEAT_TIMEOUT_S", "Monitor", "ray_alive", "verdict"]
