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
