"""Usage buckets, daily budgets and the approval queue in the registry (no sandbox: rows only)."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warmbox.errors import ApprovalClosed, ApprovalNotFound, InvalidArgument
from warmbox.models import Limits, Tenant, UsageBucket
from warmbox.storage.registry import SCHEMA_VERSION, Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
H0 = 1_800_000_000.0  # an hour's start (divisible by 3600), 2027-01-15 08:00 UTC


def _registry(tmp: Path, at: str | None = None) -> Registry:
    return Registry(at or tmp / "r.db", ledger=UidLedger(tmp / "uids", slots=8, first=MAX_SLOTS - 50))


def _start(reg: Registry, sid: str, tenant: str | None, at: float) -> None:
    t = None if tenant is None else Tenant(tenant)
    reg.sandboxes.allocate(sid, "container", "base", 86400, Limits(), "/nonexistent", "/nonexistent", tenant=t)
    # the meter starts at ``at`` (allocate stamps the wall clock); written as any client would
    reg.db.conn.execute("UPDATE meters SET sampled_at=? WHERE sandbox_id=?", (at, sid))


# ---- usage


def test_readings_fold_into_hourly_buckets_per_tenant(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    _start(reg, "sb-00000000000a", "acme", H0)
    _start(reg, "sb-00000000000b", "beta", H0)
    _start(reg, "sb-00000000000c", None, H0)  # the host's: tenant ""
    # 1 GiB flat for 10 s and 2 CPU-seconds, for each of the three
    reg.usage.sample([(s, GIB, 0) for s in ("sb-00000000000a", "sb-00000000000b", "sb-00000000000c")], now=H0)
    reg.usage.sample([(s, GIB, 2_000_000_000) for s in ("sb-00000000000a", "sb-00000000000b")], now=H0 + 10)
    # acme, the next hour: 20 s more at 1 GiB, CPU counter to 5 s (3 s more)
    reg.usage.sample([("sb-00000000000a", GIB, 5_000_000_000)], now=H0 + 3600 + 10)
    got = reg.usage.usage("acme", since=H0 + 1800)  # since: rounded down to its hour
    assert [(b.tenant, b.hour) for b in got] == [("acme", H0), ("acme", H0 + 3600)]
    assert got[0].cpu_s == pytest.approx(2.0) and got[0].gib_s == pytest.approx(10.0)
    # a reading counts in the hour it was taken: the 3600 s since the last one land in H0+1h
    assert got[1].cpu_s == pytest.approx(3.0) and got[1].gib_s == pytest.approx(3600.0)
    every = reg.usage.usage(None, since=H0, until=H0 + 3600)
    # the host's sandbox had one reading only (nothing used between two): no bucket
    assert [(b.tenant, b.hour) for b in every] == [("acme", H0), ("beta", H0)]
    assert every[1] == UsageBucket("beta", H0, pytest.approx(2.0), pytest.approx(10.0))
    assert reg.usage.usage("nobody", since=0) == []


def test_a_counter_that_goes_back_counts_nothing_and_a_resume_counts_again(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    _start(reg, "sb-00000000000a", "acme", H0)
    reg.usage.sample([("sb-00000000000a", 0, 4_000_000_000)], now=H0 + 1)
    reg.usage.sample([("sb-00000000000a", 0, 1_000_000_000)], now=H0 + 2)  # a stale reading: no negative use
    assert reg.usage.usage("acme", since=H0)[0].cpu_s == pytest.approx(4.0)


# ---- budgets


def test_budget_status_is_todays_use_against_the_daily_budget(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    reg.tenants.create_key("acme", budget_cpu_h=2.0, budget_gib_h=10.0)
    day = H0 - H0 % 86400
    _start(reg, "sb-00000000000a", "acme", day - 100)
    reg.usage.sample([("sb-00000000000a", 0, 3600_000_000_000)], now=day - 1)  # 1 CPU-hour yesterday: not counted
    reg.usage.sample([("sb-00000000000a", 8 * GIB, 3600_000_000_000 + 5760_000_000_000)], now=day + 3600)
    b = reg.usage.budget_status("acme", now=day + 7200)
    assert b.day == day and b.cpu_limit_h == 2.0 and b.gib_limit_h == 10.0
    assert b.cpu_used_h == pytest.approx(1.6)  # 5760 s
    assert b.cpu_ratio == pytest.approx(0.8) and b.warning and not b.exceeded
    assert b.gib_used_h == pytest.approx((0 + 8) / 2 * 3601 / 3600)  # trapezoid from 0 to 8 GiB over 3601 s
    assert not reg.usage.budget_status("acme", now=day + 7200, warn_ratio=0.9).warning
    reg.tenants.create_key("beta", budget_gib_h=1)
    reg.tenants.create_key("gamma")  # no budget: not listed
    assert reg.usage.budgets(now=day + 7200) == [
        reg.usage.budget_status("acme", now=day + 7200),
        reg.usage.budget_status("beta", now=day + 7200),
    ]
    reg.usage.set_budget("acme", cpu_h=1.5)
    b = reg.usage.budget_status("acme", now=day + 7200)
    assert b.exceeded and b.cpu_ratio > 1 and b.gib_limit_h == 10.0  # gib kept (None: unchanged)
    reg.usage.set_budget("acme", cpu_h=0, gib_h=0)
    b = reg.usage.budget_status("acme", now=day + 7200)
    assert (b.cpu_ratio, b.gib_ratio, b.warning, b.exceeded) == (0.0, 0.0, False, False)
    assert reg.usage.budget_status("nobody").cpu_limit_h == 0.0
    with pytest.raises(InvalidArgument):
        reg.usage.set_budget("nobody", cpu_h=1)
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(InvalidArgument):
            reg.usage.set_budget("acme", cpu_h=bad)  # type: ignore[arg-type]
    key = reg.tenants.create_key("acme", budget_gib_h=3)[1]
    t = reg.tenants.authenticate(key)
    assert t is not None and (t.budget_cpu_h, t.budget_gib_h) == (0.0, 3.0)
    assert [(k.tenant, k.budget_cpu_h, k.budget_gib_h) for k in reg.tenants.list_keys() if k.tenant == "acme"] == [
        ("acme", 0.0, 3.0),
        ("acme", 0.0, 3.0),
    ]


def test_a_version_12_registry_gains_the_budget_columns_and_the_new_tables(tmp_path):
    db = sqlite3.connect(tmp_path / "r.db")
    db.executescript(
        "CREATE TABLE tenants (name TEXT PRIMARY KEY, created_at REAL NOT NULL, max_sandboxes INTEGER NOT NULL "
        "DEFAULT 0, max_memory_mb INTEGER NOT NULL DEFAULT 0, max_cpus REAL NOT NULL DEFAULT 0, tiers TEXT NOT "
        "NULL DEFAULT '', rate_per_s REAL NOT NULL DEFAULT 0);"
        "INSERT INTO tenants (name, created_at) VALUES ('old', 1.0); PRAGMA user_version=12;"
    )
    db.close()
    reg = _registry(tmp_path)
    assert reg.db.read("PRAGMA user_version")[0] == SCHEMA_VERSION
    assert reg.tenants.tenant("old").budget_cpu_h == 0.0
    reg.usage.set_budget("old", gib_h=1)
    assert reg.usage.budget_status("old").gib_limit_h == 1.0
    assert reg.approvals.approvals(None) == [] and reg.usage.usage(None, 0) == []


# ---- the approval queue


def test_a_question_is_answered_exactly_once(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    a = reg.approvals.open_approval("acme", "create", "create a sandbox: container", "over budget", 60)
    assert a.state == "pending" and a.approval_id.startswith("ap-") and a.deadline == pytest.approx(a.created_at + 60)
    assert reg.approvals.approvals("acme", pending_only=True) == [a]
    with pytest.raises(InvalidArgument, match="approve"):
        reg.approvals.answer_approval(a.approval_id, "allow_once", "key-1")  # a network decision for a create
    with pytest.raises(ApprovalNotFound):
        reg.approvals.answer_approval(a.approval_id, "approve", "key-2", tenant="beta")  # another tenant's
    got = reg.approvals.answer_approval(a.approval_id, "approve", "key-1", tenant="acme")
    assert (got.state, got.decision, got.answered_by) == ("approved", "approve", "key-1")
    assert reg.approvals.approval(a.approval_id) == got
    for decision in ("deny", "approve"):
        with pytest.raises(ApprovalClosed) as e:
            reg.approvals.answer_approval(a.approval_id, decision, "key-3")
        assert e.value.state == "approved" and e.value.approval_id == a.approval_id
    assert reg.approvals.approvals("acme", pending_only=True) == []
    n = reg.approvals.open_approval(
        "acme", "network", "pypi.org:443 (connect)", "on_unknown=ask", 60, sandbox_id="sb-1"
    )
    with pytest.raises(InvalidArgument):
        reg.approvals.answer_approval(n.approval_id, "approve", "key-1")
    assert reg.approvals.answer_approval(n.approval_id, "allow_always", "key-1").state == "approved"
    d = reg.approvals.open_approval("", "pool_resize", "pool py to 40", "above 10", 60)
    assert reg.approvals.answer_approval(d.approval_id, "deny", "root").state == "denied"
    assert [x.approval_id for x in reg.approvals.approvals(None)] == [d.approval_id, n.approval_id, a.approval_id]
    assert [x.approval_id for x in reg.approvals.approvals("acme", limit=1)] == [n.approval_id]
    with pytest.raises(ApprovalNotFound):
        reg.approvals.approval("ap-nope")
    with pytest.raises(InvalidArgument):
        reg.approvals.open_approval("acme", "lunch", "s", "r", 60)


def test_two_racing_answers_have_one_winner(tmp_path, registry_at):
    regs = [_registry(tmp_path, at=registry_at) for _ in range(4)]
    a = regs[0].approvals.open_approval("acme", "create", "s", "r", 60)
    import threading

    won, lost = [], []
    barrier = threading.Barrier(4)

    def answer(reg: Registry, decision: str) -> None:
        barrier.wait()
        try:
            won.append(reg.approvals.answer_approval(a.approval_id, decision, decision))
        except ApprovalClosed:
            lost.append(decision)

    threads = [threading.Thread(target=answer, args=(r, d)) for r, d in zip(regs, ["approve", "deny"] * 2, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(won) == 1 and len(lost) == 3
    assert regs[1].approvals.approval(a.approval_id).decision == won[0].decision


def test_an_unanswered_question_times_out_and_a_late_answer_is_refused(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    a = reg.approvals.open_approval("acme", "create", "s", "r", 0.3)
    t0 = time.monotonic()
    got = asyncio.run(reg.approvals.wait_approval(a.approval_id))
    assert got.state == "timed_out" and got.decision == "" and 0.25 <= time.monotonic() - t0 < 5
    with pytest.raises(ApprovalClosed):
        reg.approvals.answer_approval(a.approval_id, "approve", "key-1")
    assert (
        _registry(tmp_path, at=registry_at).approvals.approval(a.approval_id).state == "timed_out"
    )  # recorded, not only computed


def test_a_question_whose_waiter_died_reads_as_timed_out(tmp_path, registry_at):
    reg = _registry(tmp_path, at=registry_at)
    from warmbox.paths import owner_tag

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    a = reg.approvals.open_approval("acme", "create", "s", "r", 60, waiter=owner_tag(proc.pid))
    assert reg.approvals.approval(a.approval_id).state == "pending"
    proc.communicate(b"", timeout=30)  # the waiting process ends
    assert reg.approvals.approval(a.approval_id).state == "timed_out"
    assert reg.approvals.approvals("acme", pending_only=True) == []
    with pytest.raises(ApprovalClosed):
        reg.approvals.answer_approval(a.approval_id, "approve", "root")
    b = reg.approvals.open_approval("acme", "create", "s", "r", 60)
    reg.approvals.withdraw_approval(b.approval_id)
    w = reg.approvals.approval(b.approval_id)
    assert (w.state, w.answered_by) == ("timed_out", "withdrawn")


def test_the_waiter_gets_an_answer_given_by_another_registry_and_another_process(tmp_path, registry_at):
    # two connections to one registry
    waiter, answerer = _registry(tmp_path, at=registry_at), _registry(tmp_path, at=registry_at)
    a = waiter.approvals.open_approval("acme", "resume", "resume sb-1", "over budget", 30, sandbox_id="sb-1")

    async def wait_and_answer() -> tuple:
        task = asyncio.ensure_future(waiter.approvals.wait_approval(a.approval_id))
        await asyncio.sleep(0.2)
        assert not task.done()
        t0 = time.monotonic()
        answerer.approvals.answer_approval(a.approval_id, "deny", "key-9")
        got = await task
        return got, time.monotonic() - t0

    got, latency = asyncio.run(wait_and_answer())
    assert (got.state, got.decision, got.answered_by) == ("denied", "deny", "key-9")
    assert latency < 2.0  # polled: at most poll_s (0.2 s) after the answer, with room for a loaded host

    # answered through the waiter's own Registry (one process: the server's waiter and its dashboard),
    # from another thread: woken at once, not at the next poll
    c = waiter.approvals.open_approval("acme", "create", "s", "r", 30)

    async def same_object() -> object:
        task = asyncio.ensure_future(waiter.approvals.wait_approval(c.approval_id, poll_s=60, first_poll_s=60))
        await asyncio.sleep(0.2)  # it read the row once and sleeps (a poll would come after 60 s)
        await asyncio.to_thread(waiter.approvals.answer_approval, c.approval_id, "approve", "here")
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(same_object()).state == "approved"  # type: ignore[attr-defined]
    assert waiter.approvals._approval_waiters == {}

    # the answerer is another process (the server, say) that starts after the question was asked
    b = waiter.approvals.open_approval("acme", "create", "s", "r", 30)
    code = (
        "import sys; from pathlib import Path; from warmbox.storage.registry import Registry; "
        "from warmbox.storage.uidslots import UidLedger; "
        f"r = Registry({registry_at!r}, ledger=UidLedger(Path({str(tmp_path / 'uids')!r}), slots=8)); "
        f"print(r.approvals.answer_approval({b.approval_id!r}, 'approve', 'other-process').state)"
    )

    async def wait_for_process() -> object:
        task = asyncio.ensure_future(waiter.approvals.wait_approval(b.approval_id))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src")}, stdout=subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert out.decode().strip() == "approved"
        return await asyncio.wait_for(task, 5)

    got = asyncio.run(wait_for_process())
    assert got.state == "approved" and got.answered_by == "other-process"
