"""Draining a node (the router's side of ``warmbox node drain NAME``): move its sandboxes, then mark it down.

1. The node is set ``draining``: placement skips it from now on (it still runs its own sandboxes).
2. Each of its live sandboxes is paused on it (its files and code-context state go to the shared
   object store) and resumed on the node placement picks: the same id, the same files; a client
   that holds it sees one slower call. A sandbox still being created is waited for; one that
   cannot be resumed without its secrets' values (never stored) stays paused, resumable by its
   owner on any node; one that mounts named volumes (their disks are this host's) stays paused,
   its files saved; one whose move fails is reported in ``failed``.
3. The node is marked down (its epoch moves on: it is fenced and leaves; its pooled sandboxes go
   with it, the other nodes' pool shares grow to the cluster's target) — unless a sandbox could
   not be paused: then it stays ``draining`` (nothing lost; the drain can be run again).

Refused with DrainRefused when the node is the last one up (its sandboxes would have nowhere to go)
or is already down; NodeNotFound for a name the registry does not know.
"""

from __future__ import annotations

import asyncio
import logging
import time

from warmbox import operations as ops
from warmbox.cluster.router import DOWN, DRAINING, UP, Cluster, ClusterFront
from warmbox.errors import DrainRefused, InvalidArgument, NodeNotFound, SecretsRequired, WarmboxError
from warmbox.models import State

log = logging.getLogger("warmbox.cluster.drain")
WAIT_S = 0.25  # between two looks at sandboxes still being created on the node
MOVABLE = (State.READY, State.RUNNING)


async def drain(cluster: Cluster, name: str, timeout: float = 600.0) -> ops.DrainReport:
    """Drain the node ``name`` (see the module docstring); what was done."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"a node name is required, got {name!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
        raise InvalidArgument(f"timeout must be a number of seconds in (0, 86400], got {timeout!r}")
    node = cluster.nodes(fresh=True).get(name)
    if node is None:
        raise NodeNotFound(f"no node {name!r} in the cluster (warmbox node ls)", node=name)
    if node.state == DOWN:
        raise DrainRefused(f"node {name!r} is down already: nothing runs there", node=name)
    others = [n.name for n in cluster.up() if n.name != name]
    if not others:
        raise DrainRefused(
            f"node {name!r} is the last node up: its sandboxes would have nowhere to go (join another node first)",
            node=name,
        )
    if node.state == UP:
        cluster.registry.nodes.set_node_state(name, DRAINING)
    cluster.nodes(fresh=True)
    root = ClusterFront(cluster, None)
    moved: list[str] = []
    paused: list[str] = []
    failed: list[str] = []
    still_running: list[str] = []
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    while True:
        mine = [
            (info, _)
            for info, _ in cluster.registry.sandboxes.list(states=(State.CREATING, *MOVABLE))
            if info.sandbox_id not in done and cluster.registry.nodes.node_of(info.sandbox_id) == name
        ]
        ready = [info for info, _ in mine if info.state in MOVABLE]
        for info in ready:
            sid = info.sandbox_id
            done.add(sid)
            try:
                await root.handle(ops.Pause(sid))
            except WarmboxError as e:
                failed.append(f"{sid}: pause failed (it runs on, on this node): {e}")
                still_running.append(sid)
                continue
            if cluster.registry.volumes.volumes_of(sid):
                paused.append(sid)  # its volumes' disks are this node's: it resumes where they are
                continue
            try:
                await root.handle(ops.Resume(sid))
            except SecretsRequired:
                paused.append(sid)  # its owner resumes it with its secrets, on any node
                continue
            except WarmboxError as e:
                failed.append(f"{sid}: paused, but its resume elsewhere failed (it stays paused): {e}")
                continue
            moved.append(sid)
            log.info("drain %s: moved %s to %s", name, sid, cluster.registry.nodes.node_of(sid))
        if len(ready) == len(mine):
            break  # nothing left being created
        if time.monotonic() > deadline:
            failed.extend(
                f"{i.sandbox_id}: still being created when the drain's {timeout:g} s ran out" for i, _ in mine
            )
            break
        await asyncio.sleep(WAIT_S)
    for info, _ in cluster.registry.sandboxes.list(states=(State.PAUSED,)):
        sid = info.sandbox_id
        if sid not in done and cluster.registry.nodes.node_of(sid) == name:
            paused.append(sid)  # any node resumes it: the next call on it moves it
    if still_running:  # marking the node down would lose them: it stays draining, the drain can be run again
        log.warning("drain %s: %d sandbox(es) could not be paused; the node stays draining", name, len(still_running))
        state = DRAINING
    else:
        lost = cluster.registry.nodes.mark_node_down(name, "drained")
        cluster.node_down(name, "drained")
        state = DOWN
        if lost:
            log.info("drain %s: %d sandbox(es) left on it (pooled or late) marked lost", name, len(lost))
    cluster.nodes(fresh=True)
    return ops.DrainReport(node=name, moved=tuple(moved), paused=tuple(paused), failed=tuple(failed), state=state)


__all__ = ["drain"]
