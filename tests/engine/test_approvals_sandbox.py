"""Starts over a tenant's daily budget wait in the approval queue, with real container sandboxes:
denied, nothing is left behind; approved (from another process: the CLI), the start finishes; a
resume over budget likewise."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.conftest import cli, set_config, start_server
from warmbox import operations as ops
from warmbox.engine import teardown
from warmbox.engine.engine import Engine
from warmbox.engine.front import EngineFront
from warmbox.errors import ApprovalDenied
from warmbox.models import Approval, Limits, State

pytestmark = pytest.mark.sandbox
LIMITS = Limits(memory_mb=256, cpus=1)


@pytest.fixture
def budgeted(home: Path, runc_ready: None):
    """The home's engine and the front of a tenant whose budget (0.001 CPU-hours a day) any start
    goes past; questions time out after 60 s (the tests answer each within a few)."""
    set_config(home, "\n[approvals]\ntimeout = 60\n")
    engine = Engine.for_home(home)
    tenant = f"apv{time.time_ns() % 10**9}"
    engine.registry.tenants.create_key(tenant, budget_cpu_h=0.001)
    try:
        yield engine, EngineFront(engine, tenant=engine.registry.tenants.tenant(tenant)), tenant
    finally:
        set_config(home)


async def _asked(engine: Engine, tenant: str) -> Approval:
    for _ in range(400):
        pending = engine.registry.approvals.approvals(tenant, pending_only=True)
        if pending:
            return pending[0]
        await asyncio.sleep(0.025)
    raise AssertionError(f"no question was asked for tenant {tenant}")


async def _answered(engine: Engine, tenant: str, start: Awaitable[Any], answer: Any) -> tuple[Any, Approval]:
    """Run ``start``, answer the question it asks with ``answer(approval)``; (its outcome, the question)."""
    task = asyncio.ensure_future(start)
    a = await _asked(engine, tenant)
    assert not task.done()  # it waits for the answer
    await answer(a)
    try:
        return await asyncio.wait_for(task, 120), engine.registry.approvals.approval(a.approval_id)
    except ApprovalDenied as e:
        return e, engine.registry.approvals.approval(a.approval_id)


def _orphan_slots(engine: Engine) -> set[str]:
    """Sandbox ids this home's registry holds uid slots for in the host-wide ledger without a row
    (what a start refused half-way could leave; other homes' and sessions' entries are not ours)."""
    led = engine.registry.ledger
    with led.locked():
        entries = [led.holder(s) for s in led.held()]
    held = {e["sandbox_id"] for e in entries if e and e.get("registry") == engine.registry.key}
    return held - {i.sandbox_id for i in engine.list(include_dead=True, include_pooled=True)}


def test_a_create_over_budget_is_denied_cleanly_then_approved_from_the_cli(budgeted):
    engine, front, tenant = budgeted
    operator = EngineFront(engine)

    async def deny(a: Approval) -> None:
        await operator.handle(ops.ApprovalAnswer(a.approval_id, "deny"))

    async def approve_from_the_cli(a: Approval) -> None:  # another process, as an operator would
        r = await asyncio.to_thread(cli, "approvals", "approve", a.approval_id)
        assert r.returncode == 0 and "approved (approve)" in r.stdout, r.stderr

    async def go() -> None:
        err, a = await _answered(engine, tenant, front.handle(ops.Create(limits=LIMITS, pool=False)), deny)
        assert isinstance(err, ApprovalDenied) and err.state == "denied" and a.kind == "create"
        # refused before its id was allocated: no row, no uid slot; so no cgroup or directory was
        # made for it (the host's cgroups are shared with other sessions: not compared here)
        assert engine.list(include_dead=True, tenant=tenant) == [] and _orphan_slots(engine) == set()

        opened, a = await _answered(
            engine, tenant, front.handle(ops.Create(limits=LIMITS, pool=False)), approve_from_the_cli
        )
        sid = opened.info.sandbox_id
        try:
            assert (a.state, a.answered_by) == ("approved", "root")
            r = await front.handle(ops.Exec(sid, "echo ok"))
            assert r.stdout == "ok\n"
            ls = await asyncio.to_thread(cli, "approvals", "ls", "--all")
            assert a.approval_id in ls.stdout and "over budget" in ls.stdout
        finally:
            await operator.handle(ops.Kill(sid))
            await front.close()

    asyncio.run(go())


def test_a_resume_over_budget_waits_denied_stays_paused_approved_runs(budgeted):
    engine, front, tenant = budgeted
    operator = EngineFront(engine)

    async def deny(a: Approval) -> None:
        assert a.kind == "resume" and a.sandbox_id == sid
        await operator.handle(ops.ApprovalAnswer(a.approval_id, "deny"))

    async def approve_from_another_thread(a: Approval) -> None:
        answer = ops.ApprovalAnswer(a.approval_id, "approve")
        await asyncio.to_thread(lambda: asyncio.run(EngineFront(Engine.for_home(engine.home)).handle(answer)))

    engine.registry.usage.set_budget(tenant, cpu_h=0)  # no budget while it is made and paused
    sid = ""

    async def go() -> None:
        nonlocal sid
        opened = await front.handle(ops.Create(limits=LIMITS, pool=False))
        sid = opened.info.sandbox_id
        try:
            await front.handle(ops.WriteFile(sid, "/workspace/kept.txt", b"kept"))
            await front.handle(ops.Pause(sid))
            engine.registry.usage.set_budget(tenant, cpu_h=0.001)
            err, _ = await _answered(engine, tenant, front.handle(ops.Resume(sid)), deny)
            assert isinstance(err, ApprovalDenied)
            assert engine.info(sid)[0].state is State.PAUSED
            opened, a = await _answered(engine, tenant, front.handle(ops.Resume(sid)), approve_from_another_thread)
            assert a.state == "approved" and opened.info.sandbox_id == sid
            assert await front.handle(ops.ReadFile(sid, "/workspace/kept.txt")) == b"kept"
        finally:
            await operator.handle(ops.Kill(sid))
            await front.close()

    asyncio.run(go())


def test_a_waiting_cli_gets_the_answer_given_after_the_server_restarted(home: Path, runc_ready: None):
    """The CLI (the host's engine in its own process) waits on a create above [approvals]
    memory_above_mb; the server restarts meanwhile, and an admin key approves through the new one:
    the row is the truth, so the CLI's create finishes."""
    set_config(home, "\n[approvals]\ntimeout = 60\nmemory_above_mb = 300\n")
    _, admin = Engine.for_home(home).registry.tenants.create_key(f"apr-ops{time.time_ns() % 10**9}", admin=True)
    srv = start_server(home, home / "apr.sock")
    env = {k: v for k, v in os.environ.items() if k not in ("WARMBOX_API_URL", "WARMBOX_API_KEY")}
    waiter = subprocess.Popen(
        [sys.executable, "-m", "warmbox.cli.main", "create", "--memory", "320", "--no-pool"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    sid = ""
    try:
        engine = Engine.for_home(home)
        q = asyncio.run(_asked(engine, ""))
        assert q.kind == "create" and "320 MiB is above 300 MiB" in q.reason
        assert srv.stop() == 0
        srv = start_server(home, home / "apr.sock")
        assert waiter.poll() is None  # still waiting
        status, got = _post(srv.url, f"/v1/approvals/{q.approval_id}", admin, {"decision": "approve"})
        assert status == 200 and got["state"] == "approved", got
        out, err = waiter.communicate(timeout=120)
        assert waiter.returncode == 0, err
        sid = out.strip().splitlines()[-1]
        assert engine.info(sid)[0].state in (State.READY, State.RUNNING)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait(10)
        if sid:
            asyncio.run(teardown.destroy(Engine.for_home(home), sid))
        srv.stop()
        set_config(home)


def _post(url: str, path: str, key: str, body: dict) -> tuple[int, Any]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Authorization": f"Bearer {key}"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()
