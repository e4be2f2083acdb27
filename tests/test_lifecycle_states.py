"""The sandbox state machine (warmbox.lifecycle) without a sandbox."""

import pytest

from warmbox.errors import SandboxNotFound, SandboxStateError
from warmbox.lifecycle import LEGAL, Operation, check
from warmbox.models import State


def test_each_lifecycle_operation_is_its_own_member_with_its_legal_states():
    assert len({op.value for op in Operation}) == len(Operation) == len(LEGAL)
    assert Operation.SNAPSHOT is not Operation.EXEC and Operation.SNAPSHOT.name == "SNAPSHOT"


def test_an_illegal_operation_names_itself_and_the_state():
    with pytest.raises(SandboxStateError, match="snapshot is not allowed on sandbox sb-1 in state paused"):
        check(Operation.SNAPSHOT, State.PAUSED, "sb-1")
    with pytest.raises(SandboxNotFound):
        check(Operation.EXEC, State.DESTROYED, "sb-1")
    check(Operation.RESUME, State.PAUSED, "sb-1")


def test_a_lost_sandbox_allows_only_kill_and_its_error_names_the_node():
    from warmbox.errors import SandboxLost
    from warmbox.lifecycle import LOSABLE, TRANSITIONS, lost

    for op in Operation:
        if op is Operation.DESTROY:
            check(op, State.LOST, "sb-1")
            continue
        with pytest.raises(SandboxLost, match="sandbox sb-1 was lost with node 'n2' \\(node n2 down: gone\\)") as e:
            check(op, State.LOST, "sb-1", "node n2 down: gone", "n2")
        assert (e.value.node, e.value.reason) == ("n2", "node n2 down: gone")
    assert TRANSITIONS[State.LOST] == {State.DESTROYED}
    assert all(State.LOST in TRANSITIONS[s] for s in LOSABLE) and State.PAUSED not in LOSABLE
    assert State.LOST not in TRANSITIONS[State.PAUSED]  # a paused sandbox survives its node
    assert not isinstance(lost("sb-1", ""), SandboxNotFound) and "its node" in str(lost("sb-1", ""))


def test_a_lost_sandbox_is_http_410_and_comes_back_as_itself_over_the_wire():
    from warmbox import wire
    from warmbox.errors import SandboxLost
    from warmbox.lifecycle import lost
    from warmbox.server.app import status_of

    err = lost("sb-1", "n2", "node n2 down: gone")
    assert status_of(err) == 410
    back = wire.error_from_wire(wire.error_to_wire(err))
    assert isinstance(back, SandboxLost) and (back.sandbox_id, back.node, back.reason) == ("sb-1", "n2", err.reason)
    assert wire.error_code(err) == "sandbox_lost"
