"""The one list of operations, the engine front's handlers, and the SDK over a fake transport (no sandbox)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from warmbox import operations as ops
from warmbox.models import CommandResult, SandboxInfo, StageTiming, State


def test_every_operation_has_one_request_and_one_handler(tmp_path):
    from warmbox.engine.engine import Engine
    from warmbox.engine.front import EngineFront

    assert set(ops.REQUESTS) == set(ops.Op)
    assert all(cls.op is op for op, cls in ops.REQUESTS.items())
    front = EngineFront(Engine(tmp_path / "home"))
    assert set(front._handlers) == set(ops.REQUESTS.values())  # a forgotten handler fails here


def test_streaming_callbacks_are_local_fields_not_data():
    local = {f.name for f in dataclasses.fields(ops.Exec) if f.metadata.get("local")}
    assert local == {"on_stdout", "on_stderr"}
    a = ops.Exec("sb-000000000000", "true", on_stdout=print)
    assert a == ops.Exec("sb-000000000000", "true")  # callbacks do not make a different request


def test_an_unknown_request_is_a_typed_error(tmp_path):
    from warmbox.engine.engine import Engine
    from warmbox.engine.front import EngineFront
    from warmbox.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="not an operation"):
        asyncio.run(EngineFront(Engine(tmp_path / "home")).handle(object()))  # type: ignore[arg-type]


class FakeTransport:
    """A transport that answers from a script and records what the SDK sent."""

    def __init__(self) -> None:
        self.sent: list[ops.Request] = []
        self.closed = False

    async def handle(self, request):
        self.sent.append(request)
        if isinstance(request, ops.Create):
            info = SandboxInfo("sb-0123456789ab", "container", State.READY, 0.0, 1e12, 512, 1.0, 256, "base")
            return ops.Opened(info, (StageTiming("sb-0123456789ab", "allocation", 1.0, True),))
        if isinstance(request, ops.Exec):
            if request.on_stdout:
                request.on_stdout("hi\n")
            return CommandResult(
                exit_code=0,
                stdout="hi\n",
                stderr="",
                timed_out=False,
                truncated=False,
                oom_killed=False,
                signal=0,
                duration_ms=1.0,
                pid=7,
            )
        return None

    async def subscribe_approvals(self, sandbox_id, hook):
        raise AssertionError("not used")

    async def close(self) -> None:
        self.closed = True


def test_the_sdk_is_a_thin_layer_over_its_transport():
    from warmbox.sdk import AsyncSandbox

    async def go():
        t = FakeTransport()
        sb = await AsyncSandbox.create(template="base", transport=t)
        seen: list[str] = []
        r = await sb.commands.run("echo hi", on_stdout=seen.append)
        await sb.close()
        return t, sb, r, seen

    t, sb, r, seen = asyncio.run(go())
    kinds = [type(x).__name__ for x in t.sent]
    assert kinds == ["Create", "Exec", "RecordFirstCommand", "Detach"] and t.closed
    assert t.sent[1] == ops.Exec("sb-0123456789ab", "echo hi")
    assert r.stdout == "hi\n" and seen == ["hi\n"] and "first_command" in sb.timings


def test_home_and_transport_are_exclusive():
    from warmbox.errors import InvalidArgument
    from warmbox.sdk import AsyncSandbox

    with pytest.raises(InvalidArgument, match="pass one of home"):
        asyncio.run(AsyncSandbox.connect("sb-0123456789ab", home="/tmp/x", transport=FakeTransport()))
    with pytest.raises(InvalidArgument, match="pass one of home"):
        asyncio.run(AsyncSandbox.list(home="/tmp/x", api_url="http://127.0.0.1:1"))
    with pytest.raises(InvalidArgument, match="api_key needs api_url"):
        asyncio.run(AsyncSandbox.list(home="/tmp/x", api_key="k"))


def test_capabilities_are_declared_protocols_that_agree_with_the_flags(tmp_path):
    from warmbox import backends
    from warmbox.backends.base import Configurable, SnapshotCapable, TemplateCapable

    for tier, (_, target) in backends.TIERS.items():
        if target is None:
            continue
        b = backends.load(tier, tmp_path / "runtime")
        caps = b.capabilities()
        assert caps.memory_snapshot == isinstance(b, SnapshotCapable), tier
        if caps.snapshot_start or caps.memory_snapshot:
            assert isinstance(b, TemplateCapable), tier  # its templates are keyed by its machine
        assert caps.tier == tier
    assert isinstance(backends.load("microvm", tmp_path / "runtime"), Configurable)


def test_pool_operations_list_the_configured_pools_and_refuse_an_unknown_one(tmp_path):
    from warmbox.engine.engine import Engine
    from warmbox.engine.front import EngineFront
    from warmbox.errors import InvalidArgument

    home = tmp_path / "home"
    home.mkdir()
    (home / "warmbox.toml").write_text("[pools.p]\ntemplate = 'base'\nmin = 0\nmax = 2\ntarget = 1\n")
    front = EngineFront(Engine(home))
    rows = asyncio.run(front.handle(ops.PoolsList()))
    assert [(r.name, r.target, r.min, r.max, r.ready) for r in rows] == [("p", 1, 0, 2, 0)]
    with pytest.raises(InvalidArgument, match="no pool 'nope'"):
        asyncio.run(front.handle(ops.PoolsResize("nope", 1)))
    with pytest.raises(InvalidArgument, match="target must be an integer"):
        asyncio.run(front.handle(ops.PoolsResize("p", -1)))  # refused before anything is written or started
