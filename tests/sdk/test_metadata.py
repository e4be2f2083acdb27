"""Sandbox metadata: given at create, shown in get_info(), matched by list(query=) — in process and over HTTP."""

from __future__ import annotations

import secrets

import pytest

from warmbox import InvalidArgument, Sandbox, SandboxQuery, State


@pytest.mark.sandbox
def test_metadata_is_shown_and_listed_by_query_through_a_pause(home, runc_ready):
    run = secrets.token_hex(4)  # this test's own sandboxes only (the session's home is shared)
    a = Sandbox.create(template="shell", timeout=120, metadata={"run": run, "user": "ada", "note": "é ✓"})
    b = Sandbox.create(template="shell", timeout=120, metadata={"run": run, "user": "bob"})
    try:
        assert a.get_info().metadata == {"run": run, "user": "ada", "note": "é ✓"}
        ids = lambda infos: {i.sandbox_id for i in infos}  # noqa: E731
        assert ids(Sandbox.list(query=SandboxQuery(metadata={"run": run}))) == {a.sandbox_id, b.sandbox_id}
        assert ids(Sandbox.list(query={"metadata": {"run": run, "user": "bob"}})) == {b.sandbox_id}
        assert ids(Sandbox.list(query={"metadata": {"run": run, "user": "eve"}})) == set()
        a.pause()
        # E2B's states: "running" means alive (ready or running here), "paused" the paused ones
        assert ids(Sandbox.list(query={"metadata": {"run": run}, "state": ["paused"]})) == {a.sandbox_id}
        assert ids(Sandbox.list(query=SandboxQuery(metadata={"run": run}, state=(State.RUNNING,)))) == {b.sandbox_id}
        back = Sandbox.connect(a.sandbox_id)  # the resumed sandbox keeps its metadata
        assert back.get_info().metadata["user"] == "ada"
        back.kill()
        assert ids(Sandbox.list(query={"metadata": {"run": run}, "state": ["destroyed"]})) == {a.sandbox_id}
    finally:
        a.kill()
        b.kill()


@pytest.mark.sandbox
@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({"n": 1}, "must be a string"),
        ({1: "x"}, "metadata key"),
        ({"k": "x" * 3000}, "at most 2048 characters"),
        ({f"k{i}": "v" for i in range(65)}, "at most 64 entries"),
        (["k", "v"], "must be a dict"),
    ],
)
def test_bad_metadata_is_refused_typed_before_anything_starts(home, runc_ready, metadata, match):
    before = {i.sandbox_id for i in Sandbox.list(include_dead=True)}
    with pytest.raises(InvalidArgument, match=match):
        Sandbox.create(template="shell", timeout=60, metadata=metadata)
    assert {i.sandbox_id for i in Sandbox.list(include_dead=True)} == before


@pytest.mark.sandbox
def test_a_bad_query_is_refused_typed(home, runc_ready):
    with pytest.raises(InvalidArgument, match="'metadata' and 'state'"):
        Sandbox.list(query={"meta": {}})
    with pytest.raises(InvalidArgument, match="state"):
        Sandbox.list(query={"state": ["sleeping"]})
