"""ApprovalStore: the questions a sandbox's egress or cost puts to a person, and their answers."""

from __future__ import annotations

import builtins
import dataclasses
import math
import secrets
import time
from collections.abc import Callable

from warmbox.errors import ApprovalClosed, ApprovalNotFound, InvalidArgument
from warmbox.models import APPROVAL_KINDS, COST_DECISIONS, NETWORK_DECISIONS, Approval
from warmbox.paths import owner_alive
from warmbox.storage.registry.common import _MAX_APPROVAL_TEXT
from warmbox.storage.registry.db import Database, Store, _retried

_APPROVAL_COLUMNS = (
    "approval_id, tenant, sandbox_id, kind, subject, reason, created_at, deadline, state, decision, "
    "answered_by, answered_at, waiter"
)


def _approval(r: tuple, now: float, node: str = "") -> Approval:
    """A row as the record callers see: a pending question past its deadline, or whose waiting
    process is gone, is timed_out (nobody acts on it any more). node: the reader's (a waiter on
    another node is judged alive: this host's /proc cannot tell)."""
    state = r[8]
    if state == "pending" and (r[7] <= now or (r[12] and not owner_alive(r[12], node))):
        state = "timed_out"
    return Approval(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], state, r[9], r[10], r[11])


class ApprovalStore(Store):
    """The questions a sandbox's egress or cost puts to a person, and their answers."""

    def __init__(self, base: Database) -> None:
        super().__init__(base)
        # waiters of this process on approval questions: an answer given through this object wakes
        # them at once (others' answers are seen by polling). approval_id -> wake-ups.
        self._approval_waiters: dict[str, builtins.list[Callable[[], object]]] = {}

    @_retried
    def open_approval(
        self,
        tenant: str,
        kind: str,
        subject: str,
        reason: str,
        timeout_s: float,
        *,
        sandbox_id: str = "",
        waiter: str = "",
        now: float | None = None,
    ) -> Approval:
        """A new pending question, answerable until ``timeout_s`` from now. waiter: the owner tag
        (paths.owner_tag) of the process that waits for it: if that process dies, the question
        reads as timed out (nobody would act on an answer). Texts are bounded (500 characters)."""
        if kind not in APPROVAL_KINDS:
            raise InvalidArgument(f"kind must be one of {list(APPROVAL_KINDS)}, got {kind!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise InvalidArgument(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        now = time.time() if now is None else now
        a = Approval(
            "ap-" + secrets.token_hex(8),
            tenant,
            sandbox_id,
            kind,
            subject[:_MAX_APPROVAL_TEXT],
            reason[:_MAX_APPROVAL_TEXT],
            now,
            now + timeout_s,
        )
        with self._tx() as db:
            db.execute(
                "INSERT INTO approvals (approval_id, tenant, sandbox_id, kind, subject, reason, created_at, deadline, "
                "state, waiter) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (a.approval_id, a.tenant, a.sandbox_id, a.kind, a.subject, a.reason, now, a.deadline, a.state, waiter),
            )
        return a

    def approval(self, approval_id: str, *, tenant: str | None = None, now: float | None = None) -> Approval:
        """One question as it stands (ApprovalNotFound if unknown, or not ``tenant``'s when given)."""
        row = self._read(f"SELECT {_APPROVAL_COLUMNS} FROM approvals WHERE approval_id=?", (approval_id,))
        if row is None or (tenant is not None and row[1] != tenant):
            raise ApprovalNotFound(f"no approval {approval_id}", approval_id=str(approval_id)[:80])
        return _approval(row, time.time() if now is None else now, self.node)

    def approvals(
        self, tenant: str | None, *, pending_only: bool = False, limit: int = 200, now: float | None = None
    ) -> builtins.list[Approval]:
        """The questions of ``tenant`` (None: every tenant's), newest first; pending_only: only
        those still open. A pending one past its deadline, or whose waiter died, reads as timed_out."""
        now = time.time() if now is None else now
        sql = f"SELECT {_APPROVAL_COLUMNS} FROM approvals"
        where: builtins.list[str] = []
        args: builtins.list[object] = []
        if tenant is not None:
            where.append("tenant=?")
            args.append(tenant)
        if pending_only:
            where += ["state='pending'", "deadline>?"]
            args.append(now)
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self._read(sql + " ORDER BY created_at DESC LIMIT ?", (*args, max(1, int(limit))), many=True)
        out = [_approval(r, now, self.node) for r in rows]
        return [a for a in out if a.state == "pending"] if pending_only else out

    @_retried
    def answer_approval(
        self, approval_id: str, decision: str, answered_by: str, *, tenant: str | None = None, now: float | None = None
    ) -> Approval:
        """Answer an open question, exactly once: a second answer (or one after its deadline, or
        after its waiter died) is ApprovalClosed; an unknown id, or another tenant's when
        ``tenant`` is given, ApprovalNotFound; a decision not of its kind, InvalidArgument."""
        now = time.time() if now is None else now
        with self._tx() as db:
            row = db.execute(
                f"SELECT {_APPROVAL_COLUMNS} FROM approvals WHERE approval_id=?" + self._sql.for_update(),
                (approval_id,),
            ).fetchone()
            if row is None or (tenant is not None and row[1] != tenant):
                raise ApprovalNotFound(f"no approval {approval_id}", approval_id=str(approval_id)[:80])
            a = _approval(row, now, self.node)
            allowed = NETWORK_DECISIONS if a.kind == "network" else COST_DECISIONS
            if decision not in allowed:
                raise InvalidArgument(f"a {a.kind} question is answered with one of {list(allowed)}, got {decision!r}")
            if a.state != "pending":
                raise ApprovalClosed(
                    f"approval {approval_id} is {a.state}"
                    + (f" ({a.decision} by {a.answered_by})" if a.decision else "")
                    + ": each question is answered once",
                    approval_id=approval_id,
                    state=a.state,
                )
            state = "denied" if decision == "deny" else "approved"
            db.execute(
                "UPDATE approvals SET state=?, decision=?, answered_by=?, answered_at=? "
                "WHERE approval_id=? AND state='pending'",
                (state, decision, answered_by[:200], now, approval_id),
            )
        for wake in self._approval_waiters.get(approval_id, ()):
            wake()
        return dataclasses.replace(a, state=state, decision=decision, answered_by=answered_by[:200], answered_at=now)

    @_retried
    def _expire_approval(self, approval_id: str, now: float) -> None:
        """Close a question whose deadline passed (timed_out), unless an answer came first."""
        with self._tx() as db:
            db.execute(
                "UPDATE approvals SET state='timed_out', answered_at=? WHERE approval_id=? AND state='pending'",
                (now, approval_id),
            )

    @_retried
    def withdraw_approval(self, approval_id: str) -> None:
        """The waiter gave up (cancelled, or failed): close the question as timed_out, answered_by
        "withdrawn", unless it was answered (nobody would act on a later answer)."""
        with self._tx() as db:
            db.execute(
                "UPDATE approvals SET state='timed_out', answered_by='withdrawn', answered_at=? "
                "WHERE approval_id=? AND state='pending'",
                (time.time(), approval_id),
            )

    async def wait_approval(self, approval_id: str, *, poll_s: float = 0.2, first_poll_s: float = 0.05) -> Approval:
        """Wait for a question's answer (from any process: the row is the truth) until its
        deadline; returns it answered, or timed_out (then recorded so: a late answer is refused).
        Reads the row every ``first_poll_s`` at first, backing off to ``poll_s`` (one indexed read, ~20 µs, each);
        an answer given through this Registry object (this process's server, say) wakes it at once."""
        import asyncio

        loop = asyncio.get_running_loop()
        answered = asyncio.Event()

        def wake() -> None:  # answer_approval may run on another thread: hand the wake-up to our loop
            loop.call_soon_threadsafe(answered.set)

        waiters = self._approval_waiters.setdefault(approval_id, [])
        waiters.append(wake)
        delay = first_poll_s
        try:
            while True:
                now = time.time()
                a = self.approval(approval_id, now=now)
                if a.state == "timed_out":  # its deadline passed: recorded, unless an answer won the race
                    self._expire_approval(approval_id, now)
                    return self.approval(approval_id, now=now)
                if a.state != "pending":
                    return a
                try:
                    await asyncio.wait_for(answered.wait(), min(delay, max(0.0, a.deadline - now)))
                except TimeoutError:
                    pass
                delay = min(poll_s, delay * 1.5)
        finally:
            waiters.remove(wake)
            if not waiters:
                self._approval_waiters.pop(approval_id, None)
