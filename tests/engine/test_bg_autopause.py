"""A running background process counts as use of its sandbox: no idle pause while it runs."""

from __future__ import annotations

import time

import pytest

from tests.conftest import wait_for
from warmbox import Lifecycle, Sandbox, State
from warmbox.engine.engine import Engine


@pytest.mark.sandbox
def test_a_background_process_keeps_its_sandbox_from_the_idle_pause(home, runc_ready):
    engine = Engine.for_home(home)
    sb = Sandbox.create(template="shell", timeout=300, lifecycle=Lifecycle(idle_pause_after=1, auto_resume=True))
    sid = sb.sandbox_id
    try:
        h = sb.commands.run("sleep 600", background=True)
        h.disconnect()  # nobody follows it: it runs on its own
        time.sleep(4)  # idle past idle_pause_after several daemon ticks over
        assert engine.info(sid)[0].state in (State.READY, State.RUNNING)
        assert [p.pid for p in sb.commands.list()] == [h.pid]
        sb.commands.kill(h.pid)
        wait_for(lambda: engine.info(sid)[0].state is State.PAUSED, 30, "the idle pause once nothing runs")
    finally:
        sb.kill()
