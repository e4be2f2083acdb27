"""The sandbox state machine: every operation named once, with the states it is legal in."""

from __future__ import annotations

import enum

from warmbox.errors import SandboxNotFound, SandboxStateError
from warmbox.models import State

# creating [-> pooled] -> ready <-> running -> destroyed ; creating -> failed (start error).
# A claimed (ready) sandbox never goes back to pooled: pooled sandboxes are single-use.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.CREATING: frozenset({State.POOLED, State.READY, State.FAILED, State.DESTROYED}),
    State.POOLED: frozenset({State.READY, State.RETIRING, State.DESTROYED}),
    State.RETIRING: frozenset({State.DESTROYED, State.FAILED}),
    State.READY: frozenset({State.RUNNING, State.PAUSED, State.DESTROYED}),
    State.RUNNING: frozenset({State.READY, State.PAUSED, State.DESTROYED}),
    State.PAUSED: frozenset({State.DESTROYED}),  # resumed as a new sandbox, or deleted
    State.FAILED: frozenset({State.DESTROYED}),
    State.DESTROYED: frozenset(),
}
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
    Operation.METRICS: frozenset({State.READY, State.RUNNING, State.DESTROYED}),
    Operation.CLAIM: frozenset({State.POOLED}),
    Operation.SNAPSHOT: _USABLE,
    Operation.RESUME: frozenset({State.PAUSED}),
    Operation.DESTROY: frozenset(
        {State.CREATING, State.POOLED, State.RETIRING, State.READY, State.RUNNING, State.FAILED, State.PAUSED}
    ),
}


def check(op: Operation, state: State, sandbox_id: str) -> None:
    """Raise a typed error if ``op`` is illegal in ``state``."""
    if state in LEGAL[op]:
        return
    if state is State.DESTROYED:
        raise SandboxNotFound(f"sandbox {sandbox_id} was destroyed", sandbox_id)
    raise SandboxStateError(
        f"{op.name.lower()} is not allowed on sandbox {sandbox_id} in state {state.value}", sandbox_id
    )


def check_transition(old: State, new: State, sandbox_id: str) -> None:
    if new not in TRANSITIONS[old]:
        raise SandboxStateError(f"sandbox {sandbox_id}: illegal transition {old.value} -> {new.value}", sandbox_id)
