"""The same SDK on Tier 1: Sandbox.create(tier="isolate"), run_code in JavaScript, Unsupported for the rest."""

from __future__ import annotations

import pytest

from warmbox import InvalidArgument, Sandbox, Unsupported
from warmbox.backends.isolate import IsolateBackend
from warmbox.engine.engine import Engine


@pytest.fixture(scope="module")
def iso_host(home, runc_ready):
    backend = Engine.for_home(home).backend("isolate")
    assert isinstance(backend, IsolateBackend)
    yield backend
    backend.stop_host()


@pytest.mark.sandbox
def test_create_run_code_and_unsupported_commands(iso_host):
    with Sandbox.create(tier="isolate", timeout=120) as sb:
        assert sb.get_info().tier == "isolate"
        e = sb.run_code("var n = 20; 'ab'.toUpperCase()", language="javascript")
        assert e.error is None and e.text == "'AB'"
        assert sb.run_code("n + 1", language="js").text == "21"
        (ctx,) = sb.list_code_contexts()
        assert (ctx.id, ctx.language) == ("default-javascript", "javascript")
        sb.restart_code_context(ctx)  # its state goes, its id stays
        assert sb.run_code("typeof n", language="js").text == "'undefined'"
        with pytest.raises(InvalidArgument, match="no environment variables"):
            sb.run_code("1", language="js", envs={"A": "b"})
        with pytest.raises(Unsupported, match="no commands"):
            sb.commands.run("echo hi")
        with pytest.raises(Unsupported, match="filesystem"):
            sb.files.list("/")
