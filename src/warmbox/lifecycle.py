"""The sandbox state machine: every operation named once, with the states it is legal in."""

from __future__ import annotations

import enum

from warmbox.errors import SandboxLost, SandboxNotFound, SandboxStateError
from warmbox.models import State

# creating [-> pooled] -> ready <-> running -> destroyed ; creating -> failed (start error).
# A claimed (ready) sandbox never goes back to pooled: pooled sandboxes are single-use.
# ready/running -> paused -> creating (a resume, same id) -> ready; a failed resume -> paused again.
# A node marked down: its creating/pooled/retiring/ready/running sandboxes -> lost (kill: destroyed);
# its paused ones stay paused (their snapshot is in the shared store: any node resumes them).
TRANSITIONS: dict[State, frozenset[State]] = {
    State.CREATING: frozenset({State.POOLED, State.READY, State.FAILED, State.DESTROYED, State.PAUSED, State.LOST}),
    State.POOLED: frozenset({State.READY, State.RETIRING, State.DESTROYED, State.LOST}),
    State.RETIRING: frozenset({State.DESTROYED, State.FAILED, State.LOST}),
    State.READY: frozenset({State.RUNNING, State.PAUSED, State.DESTROYED, State.LOST}),
    State.RUNNING: frozenset({State.READY, State.PAUSED, State.DESTROYED, State.LOST}),
    State.PAUSED: frozenset({State.CREATING, State.DESTROYED}),  # resumed under its id, or deleted
    State.FAILED: frozenset({State.DESTROYED}),
    State.LOST: frozenset({State.DESTROYED}),  # only by kill
    State.DESTROYED: frozenset(),
}
# what a node marked down loses (its paused sandboxes are not among them)
LOSABLE = frozenset({State.CREATING, State.POOLED, State.RETIRING, State.READY, State.RUNNING})
LIVE = frozenset({State.CREATING, State.POOLED, State.RETIRING, State.READY, State.RUNNING})


class Operation(enum.Enum):
    """Operations on a sandbox; ``legal`` names the states each may be called in."""

    EXEC = "exec"  # commands.run, run_code, files.*, connect
    SET_TIMEOUT = "set_timeout"
    METRICS = "metrics"
    CLAIM = "claim"  # hand a pooled sandbox to one caller
    SNAPSHOT = "snapshot"  # snapshot (keeps running) and pause
    RESUME = "resume"
    DESTROY = "destroy"  # kill (of a paused one: forget it)

    @property
    def legal(self) -> frozenset[State]:
        return LEGAL[self]


_USABLE = frozenset({State.READY, State.RUNNING})
LEGAL: dict[Operation, frozenset[State]] = {
    Operation.EXEC: _USABLE,
    Operation.SET_TIMEOUT: _USABLE,
    Operation.METRICS: frozenset({State.READY, State.RUNNING, State.PAUSED, State.DESTROYED}),
    Operation.CLAIM: frozenset({State.POOLED}),
    Operation.SNAPSHOT: _USABLE,
    Operation.RESUME: frozenset({State.PAUSED}),
    Operation.DESTROY: frozenset(
        {
            State.CREATING,
            State.POOLED,
            State.RETIRING,
            State.READY,
            State.RUNNING,
            State.FAILED,
            State.PAUSED,
            State.LOST,
        }
    ),
}


def check(op: Operation, state: State, sandbox_id: str, ended: str = "", node: str = "") -> None:
    """Raise a typed error if ``op`` is illegal in ``state``. ended: why a destroyed sandbox
    ended (the reason of its last transition): one that ran out of time says "expired"; for a
    lost one, why its node was marked down. node: the node a lost sandbox ran on."""
    if state in LEGAL[op]:
        return
    if state is State.DESTROYED:
        raise gone(sandbox_id, ended)
    if state is State.LOST:
        raise lost(sandbox_id, node, ended)
    raise SandboxStateError(
        f"{op.name.lower()} is not allowed on sandbox {sandbox_id} in state {state.value}", sandbox_id
    )


def gone(sandbox_id: str, ended: str = "") -> SandboxNotFound:
    """The error for a destroyed sandbox; ``ended`` is the reason it was destroyed."""
    if ended in EXPIRED_REASONS:
        return SandboxNotFound(f"sandbox {sandbox_id} expired (its timeout ran out) and was destroyed", sandbox_id)
    return SandboxNotFound(f"sandbox {sandbox_id} was destroyed", sandbox_id)


def lost(sandbox_id: str, node: str, reason: str = "") -> SandboxLost:
    """The error for a sandbox whose node (or, on one host, its runtime's host process) died: only
    kill is allowed on it."""
    where = f" with node {node!r}" if node else "" if reason else " with its node"
    return SandboxLost(
        f"sandbox {sandbox_id} was lost{where}" + (f" ({reason})" if reason else "") + "; only kill is allowed",
        sandbox_id,
        node=node,
        reason=reason,
    )


# the reasons recorded when a sandbox's time ran out (a paused one: its retention)
EXPIRED = "timeout expired"
RETENTION_EXPIRED = "paused retention expired"
EXPIRED_REASONS = frozenset({EXPIRED, RETENTION_EXPIRED})
RESUMING = "resume"  # paused -> creating: a resume under the same id is under way


def check_transition(old: State, new: State, sandbox_id: str) -> None:
    if new not in TRANSITIONS[old]:
        raise SandboxStateError(f"sandbox {sandbox_id}: illegal transition {old.value} -> {new.value}", sandbox_id)
