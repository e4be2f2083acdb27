"""The proxy's wait for answers in the approval queue (network/asks.py), on a real registry."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

from warmbox import paths
from warmbox.network import asks
from warmbox.storage.registry import Registry


def test_the_watch_settles_answers_deadlines_and_withdraws(tmp_path):
    db = tmp_path / "registry.db"
    reg = Registry(db)
    me = paths.owner_tag(os.getpid())

    def question(timeout_s: float):
        return reg.approvals.open_approval("", "network", "x.test:80", "egress", timeout_s, sandbox_id="sb", waiter=me)

    async def main() -> None:
        watch = asks.AnswerWatch(db, asyncio.get_running_loop())
        try:
            # an answer written by another connection (as the engine's) settles the future
            a = question(30)
            fut = watch.wait(a.approval_id, a.deadline)
            await asyncio.sleep(0.2)
            assert not fut.done()
            Registry(db).approvals.answer_approval(a.approval_id, "allow_always", "root")
            watch.nudge()
            got = await asyncio.wait_for(fut, 10)
            assert (got.state, got.decision, got.answered_by) == ("approved", "allow_always", "root")

            # unanswered: settled at its deadline, and reads timed out (a late answer is refused)
            b = question(0.3)
            got = await asyncio.wait_for(watch.wait(b.approval_id, b.deadline), 10)
            assert time.time() >= b.deadline
            assert reg.approvals.approval(b.approval_id).state == "timed_out"

            # no longer waited for (the sandbox stopped): withdrawn, off the pending list
            c = question(30)
            watch.wait(c.approval_id, c.deadline)
            watch.cancel(c.approval_id)
            for _ in range(100):
                if reg.approvals.approval(c.approval_id).state != "pending":
                    break
                await asyncio.sleep(0.05)
            assert (reg.approvals.approval(c.approval_id).state, reg.approvals.approval(c.approval_id).answered_by) == (
                "timed_out",
                "withdrawn",
            )
            assert reg.approvals.approvals(None, pending_only=True) == []
        finally:
            watch.stop()

    asyncio.run(main())


def test_a_question_of_a_dead_proxy_reads_as_timed_out(tmp_path):
    reg = Registry(tmp_path / "registry.db")
    proxy = subprocess.Popen(["sleep", "60"])
    try:
        a = reg.approvals.open_approval(
            "", "network", "x.test:80", "egress", 30, sandbox_id="sb", waiter=paths.owner_tag(proxy.pid)
        )
        assert reg.approvals.approval(a.approval_id).state == "pending"
    finally:
        proxy.kill()
        proxy.wait()
    assert reg.approvals.approval(a.approval_id).state == "timed_out"
    assert reg.approvals.approvals(None, pending_only=True) == []
