"""Network questions (on_unknown="ask") nobody answers live go to the approval queue: the operator's
answer there (allow once, allow always, deny) decides the waiting connection, and no answer denies."""

from __future__ import annotations

import asyncio
import time

import pytest

from warmbox import Network, Sandbox
from warmbox import operations as ops
from warmbox.engine.engine import Engine
from warmbox.engine.front import EngineFront

pytestmark = pytest.mark.sandbox
CURL = "curl -sS -o /dev/null -w '%{http_code}' --max-time 20 "


def questions(home, sandbox_id: str) -> list:
    rows = asyncio.run(EngineFront(Engine.for_home(home)).handle(ops.ApprovalsList(pending_only=True)))
    return [a for a in rows if a.sandbox_id == sandbox_id and a.state == "pending"]


def question(home, sandbox_id: str, subject: str):
    """The pending question about ``subject``, once it is there (bounded wait)."""
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        found = [a for a in questions(home, sandbox_id) if a.subject == subject]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no question about {subject}: {questions(home, sandbox_id)}")


def answer(home, approval_id: str, decision: str):
    return asyncio.run(EngineFront(Engine.for_home(home)).handle(ops.ApprovalAnswer(approval_id, decision)))


def dial(sb, url: str):
    return sb.commands.run(["/bin/bash", "-c", f"{CURL}{url}"], background=True)


def test_network_questions_are_answered_from_the_queue(net_home, world):
    world.clear_logs()
    with Sandbox.create(
        tier="container", network=Network(allow=[], on_unknown="ask"), timeout=120, home=net_home
    ) as sb:
        sid = sb.sandbox_id
        # allow once: this connection goes through
        h = dial(sb, "http://allowed.test/hello.txt")
        q = question(net_home, sid, "allowed.test:80")
        assert (q.kind, q.tenant, q.state) == ("network", "", "pending")
        assert 4 < q.deadline - q.created_at <= 5.5  # net_home's [network] approval_timeout
        answered = answer(net_home, q.approval_id, "allow_once")
        assert (answered.state, answered.decision) == ("approved", "allow_once")
        assert h.wait().stdout == "200"
        assert [r["path"] for r in world.log("allowed")] == ["/hello.txt"]

        # allow always: the host joins the policy; the next connection is not asked about
        h = dial(sb, "http://api.test/hello.txt")
        answer(net_home, question(net_home, sid, "api.test:80").approval_id, "allow_always")
        assert h.wait().stdout == "200"
        assert "api.test" in sb.network.policy()
        r = sb.commands.run(["/bin/bash", "-c", f"{CURL}http://api.test/hello.txt"], timeout=30)
        assert r.stdout == "200" and questions(net_home, sid) == []

        # deny: the connection is refused, the server never sees it
        h = dial(sb, "http://attacker.example.com/upload")
        answer(net_home, question(net_home, sid, "attacker.example.com:80").approval_id, "deny")
        assert h.wait().stdout == "403"

        # no answer: denied at the deadline, the row reads timed out
        t0 = time.monotonic()
        h = dial(sb, "http://rebind.test/hello.txt")
        q = question(net_home, sid, "rebind.test:80")
        assert h.wait().stdout == "403" and time.monotonic() - t0 < 8
        rows = asyncio.run(EngineFront(Engine.for_home(net_home)).handle(ops.ApprovalsList()))
        assert [a.state for a in rows if a.approval_id == q.approval_id] == ["timed_out"]

        rules = [(e.host, e.decision, e.rule) for e in sb.network.log() if e.kind == "http"]
        assert rules == [
            ("allowed.test", "allow", "approval:allow_once"),
            ("api.test", "allow", "approval:allow_always"),
            ("api.test", "allow", "allow:api.test"),
            ("attacker.example.com", "deny", "approval:deny"),
            ("rebind.test", "deny", "approval:timeout"),
        ]
    assert world.log("attacker") == []
