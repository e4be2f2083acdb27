"""Which node takes a create, and how a cluster-wide pool target splits over nodes: pure functions, no I/O.

The router calls :func:`place` inside the allocation with a view of every node (Ray's node list
joined with the registry's load); the node daemons call :func:`split_target` for their pool share.
Both are deterministic: the same view gives the same answer on every router, so a test (and the
simulation in scripts/simulate-cluster) can predict them.

Order of preference in :func:`place`:
1. a node holding a ready pooled sandbox of the wanted shape: a claim there takes milliseconds,
   a cold start hundreds of milliseconds (tier 2 on the dev host) to seconds;
2. then the node with the most free slots (spread: Ray's default scheduler packs, see
   docs/cluster-research.md), then the most free memory;
3. then the node name (ascending), so ties never depend on the order of the view.

Several routers each place from their own view, read every 0.5 s: with that rule they all send a
burst to the same best node, which runs out of pooled sandboxes while the others keep theirs (the
simulation's hit rate fell to 87 % with 4 routers on 100 nodes). So a router passes a ``salt`` of
its own per create, and :func:`place` then draws among the nodes holding a ready sandbox of the
shape with odds in proportion to how many each holds (weighted rendezvous hashing: the same answer
for the same view and salt); with none, the salt breaks ties of free slots and memory in place of
the name. Without a salt, the fixed order above.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Sequence

from warmbox.errors import InvalidArgument, NoCapacity

UP = "up"
MAX_NAMED = 8  # nodes named one by one in a NoCapacity message; the rest are counted by reason


@dataclasses.dataclass(frozen=True)
class NodeLoad:
    """One node as placement sees it.

    node: its name (``[cluster] node``); tiers: the tiers it runs (its ``doctor``); slots: how many
    sandboxes it takes at once; live: sandboxes holding a slot now (creating, pooled, ready,
    running: every one with a process on the node); memory_mb: memory it gives sandboxes, MiB;
    memory_used_mb: the limits of those ``live`` sandboxes summed, MiB; pooled: (shape key, ready
    count) per pool shape it holds ready (``config.shape_key``); state: ``"up"``, ``"draining"``
    or ``"down"`` (only ``"up"`` takes creates).
    """

    node: str
    tiers: tuple[str, ...]
    slots: int
    live: int
    memory_mb: int
    memory_used_mb: int
    pooled: tuple[tuple[str, int], ...] = ()
    state: str = UP

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - self.live)

    @property
    def free_memory_mb(self) -> int:
        return max(0, self.memory_mb - self.memory_used_mb)

    def ready(self, shape: str) -> int:
        """Ready pooled sandboxes of ``shape`` ("" never matches: a create without a pool shape)."""
        if not shape:
            return 0
        return sum(n for key, n in self.pooled if key == shape)


@dataclasses.dataclass(frozen=True)
class Want:
    """What a create asks for: its tier, its pool shape key ("" when no pool has its shape) and
    its memory limit in MiB."""

    tier: str
    shape: str = ""
    memory_mb: int = 512

    def __post_init__(self) -> None:
        if not self.tier:
            raise InvalidArgument("placement needs a tier")
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int) or self.memory_mb <= 0:
            raise InvalidArgument(f"memory_mb must be a positive integer, got {self.memory_mb!r}")


def why_not(load: NodeLoad, want: Want) -> str:
    """Why ``load`` cannot take ``want`` ("" when it can). A ready pooled sandbox of the shape
    already holds its slot and memory, so a node with one needs neither free."""
    if load.state != UP:
        return load.state
    if want.tier not in load.tiers:
        return f"does not run tier {want.tier}"
    if load.ready(want.shape) > 0:
        return ""
    if load.free_slots <= 0:
        return f"no free slot ({load.live}/{load.slots})"
    if load.free_memory_mb < want.memory_mb:
        return f"{load.free_memory_mb} MiB free < {want.memory_mb} MiB"
    return ""


def rank(load: NodeLoad, want: Want) -> tuple[int, int, int, str]:
    """Sort key of a node that can take ``want``: smaller is better."""
    return (0 if load.ready(want.shape) > 0 else 1, -load.free_slots, -load.free_memory_mb, load.node)


def place(nodes: Sequence[NodeLoad], want: Want, salt: str = "") -> str:
    """The name of the node that should take ``want``; raises NoCapacity (naming why each node was
    rejected) when none can. ``nodes`` in any order; a name listed twice is a caller bug. salt: a
    router's own per create (see the module's docstring); "" for the fixed order."""
    fits: list[NodeLoad] = []
    rejected: list[str] = []
    for load in sorted(nodes, key=lambda n: n.node):
        reason = why_not(load, want)
        if reason:
            rejected.append(f"{load.node}: {reason}")
        else:
            fits.append(load)
    warm = [n for n in fits if n.ready(want.shape) > 0]
    if warm and salt:
        return drawn(warm, [n.ready(want.shape) for n in warm], salt)
    if fits and salt:  # ties of free slots and memory broken by the salt, not always the first name
        return min(fits, key=lambda n: (*rank(n, want)[:3], _salted(salt, n.node))).node
    if fits:
        return min(fits, key=lambda n: rank(n, want)).node
    raise NoCapacity(_message(want, rejected), rejected=tuple(rejected))


def drawn(nodes: Sequence[NodeLoad], weights: Sequence[int], salt: str) -> str:
    """One of ``nodes`` (not empty), each with odds in proportion to its weight (> 0), decided by
    ``salt``: weighted rendezvous hashing, so the same salt and view always draw the same node and
    a node that leaves the view moves only its own share."""

    def score(item: tuple[NodeLoad, int]) -> float:
        n, w = item
        return -math.log(_salted(salt, n.node)) / w

    return min(zip(nodes, weights, strict=True), key=score)[0].node


def _salted(salt: str, node: str) -> float:
    """A number in (0, 1), uniform over salts, fixed for a salt and a node."""
    digest = hashlib.sha256(f"{salt}\0{node}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") + 1) / (2**64 + 2)


def _message(want: Want, rejected: list[str]) -> str:
    what = f"a {want.tier} sandbox of {want.memory_mb} MiB"
    if not rejected:
        return f"no node can take {what}: the cluster has no node"
    named = "; ".join(rejected[:MAX_NAMED])
    rest = rejected[MAX_NAMED:]
    if rest:
        counts: dict[str, int] = {}
        for r in rest:
            why = r.split(": ", 1)[1]
            why = (
                "no free slot"
                if why.startswith("no free slot")
                else ("too little memory" if "MiB free" in why else why)
            )
            counts[why] = counts.get(why, 0) + 1
        named += f"; and {len(rest)} more (" + ", ".join(f"{n} {w}" for w, n in sorted(counts.items())) + ")"
    return f"no node can take {what}: {named}"


def take(load: NodeLoad, want: Want) -> NodeLoad:
    """``load`` after it took ``want`` (a claimed pooled sandbox when it had one of the shape, else a
    new one holding a slot and memory): how a router keeps its view right between two reads of the
    registry, and how the simulation books a create."""
    if load.ready(want.shape) > 0:
        pooled, left = [], 1
        for key, n in load.pooled:
            if key == want.shape and left and n > 0:
                n, left = n - 1, 0
            if n > 0:
                pooled.append((key, n))
        return dataclasses.replace(load, pooled=tuple(pooled))
    return dataclasses.replace(load, live=load.live + 1, memory_used_mb=load.memory_used_mb + want.memory_mb)


def split_target(target: int, nodes: Iterable[NodeLoad], *, tier: str = "", key: str = "") -> dict[str, int]:
    """A cluster-wide pool target split over the nodes that are up (and run ``tier``, if given), in
    proportion to their slots; the shares sum to ``target`` (empty when no node qualifies). The
    remainder goes by largest fraction, ties in an order fixed by ``key`` (the pool's name), so
    different pools do not all give their spare sandbox to the same node. A node with no slot
    gets 0 unless every qualifying node has none (then the split is even)."""
    if isinstance(target, bool) or not isinstance(target, int) or target < 0:
        raise InvalidArgument(f"a pool target must be an integer >= 0, got {target!r}")
    up = sorted({n.node: n for n in nodes if n.state == UP and (not tier or tier in n.tiers)}.values(), key=_name)
    if not up:
        return {}
    weights = [max(0, n.slots) for n in up]
    if sum(weights) == 0:
        weights = [1] * len(up)
    total = sum(weights)
    shares = {n.node: target * w // total for n, w in zip(up, weights, strict=True)}
    left = target - sum(shares.values())

    def order(item: tuple[NodeLoad, int]) -> tuple[int, bytes]:
        n, w = item
        salt = hashlib.sha256(f"{key}\0{n.node}".encode()).digest()
        return (-(target * w % total), salt)

    for n, _ in sorted(zip(up, weights, strict=True), key=order)[:left]:
        shares[n.node] += 1
    return shares


def _name(n: NodeLoad) -> str:
    return n.node


__all__ = ["NodeLoad", "Want", "drawn", "place", "rank", "split_target", "take", "why_not"]
