"""NodeStore: the nodes of a cluster, their epochs and heartbeats, and the sandboxes a node's death loses."""

from __future__ import annotations

import builtins
import time

from warmbox.errors import InvalidArgument
from warmbox.lifecycle import LOSABLE
from warmbox.models import NODE_STATES, NodeInfo, NodeUsage, State
from warmbox.storage.registry.common import _MAX_APPROVAL_TEXT, _in, _node_name, _split, unknown_sandbox
from warmbox.storage.registry.db import Store, _retried

_NODE_COLUMNS = (
    "name, address, ray_node_id, epoch, state, slots, memory_mb, tiers, joined_at, heartbeat_at, pooled, live"
)

_LOSABLE = tuple(s.value for s in LOSABLE)


class NodeStore(Store):
    """The nodes of a cluster, their epochs and heartbeats, and the sandboxes a node's death loses."""

    @_retried
    def join_node(self, info: NodeInfo) -> int:
        """Record ``info.name`` as up with what it offers (its epoch, joined_at, heartbeat_at,
        pooled and live as given are ignored); returns its new epoch, one past any it had: a
        process of its previous life heartbeating with the old epoch is fenced."""
        _node_name(info.name)
        now = time.time()
        with self._tx(f"node:{info.name}") as db:  # two joins of one name: two epochs
            row = db.execute("SELECT epoch FROM nodes WHERE name=?", (info.name,)).fetchone()
            epoch = (row[0] if row else 0) + 1
            db.execute(
                f"INSERT INTO nodes ({_NODE_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,0,0) ON CONFLICT (name) DO UPDATE "
                "SET address=excluded.address, ray_node_id=excluded.ray_node_id, epoch=excluded.epoch, "
                "state=excluded.state, slots=excluded.slots, memory_mb=excluded.memory_mb, tiers=excluded.tiers, "
                "joined_at=excluded.joined_at, heartbeat_at=excluded.heartbeat_at, pooled=0, live=0",
                (
                    info.name,
                    info.address,
                    info.ray_node_id,
                    epoch,
                    "up",
                    max(0, int(info.slots)),
                    max(0, int(info.memory_mb)),
                    ",".join(info.tiers),
                    now,
                    now,
                ),
            )
        if info.name == self.node:
            self._base.epoch = epoch  # what this process's starts are checked against (_check_fence)
            self._base.slots = max(0, int(info.slots))  # and the bound they are held to (_check_slots)
        return epoch

    @_retried
    def heartbeat(self, name: str, epoch: int, live: int, pooled: int) -> bool:
        """A node says it is alive, with its live and pooled sandbox counts. False: it is fenced
        (marked down, or rejoined under a newer epoch): that process must stop serving and exit."""
        with self._tx() as db:
            n = db.execute(
                "UPDATE nodes SET heartbeat_at=?, live=?, pooled=? WHERE name=? AND epoch=? AND state<>'down'",
                (time.time(), max(0, int(live)), max(0, int(pooled)), name, epoch),
            ).rowcount
        return n == 1

    def nodes(self) -> builtins.list[NodeInfo]:
        """Every node that ever joined (down ones too), by name."""
        rows = self._read(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY name", many=True)
        return [
            NodeInfo(r[0], r[1], r[2], r[3], r[4], r[5], r[6], _split(r[7]), r[8], r[9], r[10], r[11]) for r in rows
        ]

    def local_counts(self) -> tuple[int, int]:
        """This node's (live sandboxes: creating, retiring, ready, running; pooled ones)."""
        busy = (State.CREATING.value, State.RETIRING.value, State.READY.value, State.RUNNING.value)
        live = self._read(f"SELECT COUNT(*) FROM sandboxes WHERE node=? AND state IN {_in(busy)}", (self.node, *busy))
        pooled = self._read("SELECT COUNT(*) FROM sandboxes WHERE node=? AND state=?", (self.node, State.POOLED.value))
        return int(live[0]), int(pooled[0])

    def node_usage(self) -> builtins.list[NodeUsage]:
        """Per node with any: its live sandboxes, their memory, its pooled ones by pool (by name)."""
        busy = (State.CREATING.value, State.RETIRING.value, State.READY.value, State.RUNNING.value)
        rows = self._read(
            f"SELECT node, COUNT(*), COALESCE(SUM(memory_mb),0) FROM sandboxes WHERE state IN {_in(busy)} "
            "GROUP BY node",
            busy,
            many=True,
        )
        pools = self._read(
            "SELECT node, pool, COUNT(*), COALESCE(SUM(memory_mb),0) FROM sandboxes WHERE state=? "
            "GROUP BY node, pool ORDER BY node, pool",
            (State.POOLED.value,),
            many=True,
        )
        live = {r[0]: (int(r[1]), int(r[2])) for r in rows}
        pooled: dict[str, builtins.list[tuple[str, int]]] = {}
        pooled_mb: dict[str, int] = {}
        for node, pool, n, mb in pools:
            pooled.setdefault(node, []).append((pool, int(n)))
            pooled_mb[node] = pooled_mb.get(node, 0) + int(mb)
        return [
            NodeUsage(node, *live.get(node, (0, 0)), tuple(pooled.get(node, ())), pooled_mb.get(node, 0))
            for node in sorted(set(live) | set(pooled))
        ]

    def node_of(self, sandbox_id: str) -> str:
        """The node that owns a sandbox ("" = one host); SandboxNotFound if there is no such row."""
        row = self._read("SELECT node FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
        if row is None:
            raise unknown_sandbox(sandbox_id)
        return row[0]

    @_retried
    def set_node_state(self, name: str, state: str) -> None:
        """Set a node up or draining (a draining node takes no new sandboxes). "down" is
        :meth:`mark_node_down`: no live sandbox stays on a node that is down."""
        if state not in NODE_STATES:
            raise InvalidArgument(f"a node state is one of {', '.join(NODE_STATES)}, got {state!r}")
        if state == "down":
            self.mark_node_down(name, "set down")
            return
        with self._tx() as db:
            if db.execute("UPDATE nodes SET state=? WHERE name=?", (state, name)).rowcount != 1:
                raise InvalidArgument(f"no node {name!r}")

    @_retried
    def mark_node_down(self, name: str, reason: str, *, epoch: int | None = None) -> builtins.list[str]:
        """Node ``name`` is gone (Ray lost it, its heartbeat stopped, it left): its epoch is bumped
        (its process, if it still runs, is fenced: it starts no sandbox, and its next heartbeat
        says so), its creating, pooled, retiring, ready and running sandboxes become ``lost`` with
        ``reason``; returns their ids. Its paused sandboxes stay paused (their snapshots are in
        the shared store): any node resumes them. A node that never joined gets a row, down.
        epoch: the epoch the caller judged dead: if the node is down already or has joined again
        since (another epoch), nothing changes and [] is returned (a stale verdict, or a second
        monitor marking the same death)."""
        _node_name(name)
        reason = f"node {name} down: {reason}"[:_MAX_APPROVAL_TEXT]
        now = time.time()
        with self._tx() as db:
            if epoch is not None:
                row = db.execute(
                    "SELECT state, epoch FROM nodes WHERE name=?" + self._sql.for_update(), (name,)
                ).fetchone()
                if row is None or row[0] == "down" or row[1] != epoch:
                    return []
            db.execute(
                "INSERT INTO nodes (name, epoch, state) VALUES (?,1,'down') ON CONFLICT (name) DO UPDATE "
                "SET epoch=nodes.epoch+1, state='down'",
                (name,),
            )
            rows = db.execute(
                f"SELECT sandbox_id, state FROM sandboxes WHERE node=? AND state IN {_in(_LOSABLE)} "
                "ORDER BY created_at" + self._sql.for_update(),  # no state change slips in meanwhile
                (name, *_LOSABLE),
            ).fetchall()
            for sid, old in rows:
                db.execute(
                    "UPDATE sandboxes SET state=?, ended_at=?, owner='' WHERE sandbox_id=?",
                    (State.LOST.value, now, sid),
                )
                db.execute("INSERT INTO transitions VALUES (?,?,?,?,?)", (sid, now, old, State.LOST.value, reason))
            # a pause its process did not finish releasing: that process is gone with the node
            db.execute(
                "UPDATE sandboxes SET owner='' WHERE node=? AND state=?",
                (name, State.PAUSED.value),
            )
        return [r[0] for r in rows]

    @_retried
    def mark_lost(self, sandbox_ids: builtins.list[str], reason: str) -> builtins.list[str]:
        """These sandboxes' runtime ended under them (on this host: the isolate host process that
        held them died): each still creating, pooled, retiring, ready or running becomes ``lost``
        with ``reason`` (every operation but kill then raises SandboxLost). Returns those changed."""
        reason = reason[:_MAX_APPROVAL_TEXT]
        now = time.time()
        changed = []
        with self._tx() as db:
            for sid in sandbox_ids:
                row = db.execute(
                    "SELECT state FROM sandboxes WHERE sandbox_id=?" + self._sql.for_update(), (sid,)
                ).fetchone()
                if row is None or row[0] not in _LOSABLE:
                    continue
                db.execute(
                    "UPDATE sandboxes SET state=?, ended_at=?, owner='' WHERE sandbox_id=?",
                    (State.LOST.value, now, sid),
                )
                db.execute("INSERT INTO transitions VALUES (?,?,?,?,?)", (sid, now, row[0], State.LOST.value, reason))
                changed.append(sid)
        return changed
