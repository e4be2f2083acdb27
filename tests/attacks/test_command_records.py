"""What a sandbox sends back cannot poison or inflate the command records (the audit trail).

Red-team finding while building them: a record's duration, exit code and error name come from the
guest. A NaN duration (JSON allows it on the wire) is stored by SQLite as NULL, an exit code past
64 bits does not fit an INTEGER: either made the whole batch insert fail, and the batch stayed
queued, so every later record of every sandbox failed with it (and a destroy, which writes the
queue first, raised). A cell's exception can carry any class name (markup, 100 KB). The registry
now bounds and types every field of a row itself, and a batch it refuses cannot block the rest.
"""

from __future__ import annotations

import asyncio
import math
import socket

import pytest

from tests.attacks.conftest import scripted_agent
from warmbox import AsyncSandbox, Sandbox
from warmbox import protocol as p
from warmbox.engine import commandlog
from warmbox.engine.engine import Engine
from warmbox.engine.guest_client import GuestClient
from warmbox.engine.session import GuestSession
from warmbox.storage.registry import MAX_COMMAND_ERROR

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(120)]

HOSTILE_NAME = "<img src=x onerror=alert(1)>" + "A" * 100_000


def test_a_cells_exception_name_is_bounded_and_inert_in_the_records(home, runc_ready):
    code = f"E = type({HOSTILE_NAME!r}, (Exception,), {{}})\nraise E('x')"
    with Sandbox.create(tier="container", template="base", timeout=120) as sb:
        got = sb.run_code(code)
        assert got.error is not None and got.error.name.startswith("<img")  # the caller still sees what ran
        sb.run_code("1 + 1")  # recording goes on
        records = sb.commands.history()
        t = sb.export()
    bad, ok = records[-2], records[-1]
    assert bad.error.startswith("?img?src?x?onerror?alert?1??") and len(bad.error) == MAX_COMMAND_ERROR
    assert ok.error == "" and ok.text == "1 + 1"
    assert t.commands[-2:] == (bad, ok)


def test_a_hostile_agents_numbers_cannot_block_the_records(tmp_path, home, runc_ready):
    """An agent answering a command with a NaN duration and a 70-bit exit code: recorded (as 0 and
    "no exit code"), the record queued after it is written too, and a destroy (which writes the
    queue first) still works."""
    path = str(tmp_path / "agent.sock")

    def script(conn: socket.socket, first: p.Message | None) -> None:
        assert isinstance(first, p.Exec)
        conn.sendall(p.encode(p.Started(first.id, pid=7)))
        frame = p.encode(
            p.Exited(
                first.id, exit_code=1 << 70, signal=0, timed_out=False, truncated=False, duration_ms=1.0, oom_kills=-1
            )
        )
        conn.sendall(frame.replace(b'"duration_ms":1.0', b'"duration_ms":NaN'))
        conn.recv(1)  # until the host hangs up

    thread = scripted_agent(path, script)
    engine = Engine.for_home(home)
    log = engine.command_log

    async def run() -> None:
        session = GuestSession(await GuestClient.connect(path, "sb-hostile0000"))
        try:
            hostile = await session.exec(["true"])
        finally:
            await session.close()
        assert hostile.exit_code == 1 << 70 and math.isnan(hostile.duration_ms)  # as the agent sent them
        sb = await AsyncSandbox.create(tier="container", template="shell", timeout=60, pool=False, home=home)
        try:
            log.add(commandlog.of_command(sb.sandbox_id, "command", ("hostile", False), 1.0, hostile))
            await sb.commands.run("echo after")  # queued behind it
        finally:
            assert await sb.kill()  # writes the queue first
        first, after = engine.registry.commands.commands(sb.sandbox_id)
        assert (first.text, first.exit_code, first.duration_ms) == ("hostile", None, 0.0)
        assert (after.text, after.exit_code) == ("echo after", 0)
        assert log.pending == 0

    asyncio.run(run())
    thread.join(10)
