"""The approval gate and the queue's operations on the engine front. Fast lane: every start here is
denied or times out before anything is claimed or made (the approved ones run in
tests/engine/test_approvals_sandbox.py)."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest

from warmbox import operations as ops
from warmbox.config import ApprovalSettings
from warmbox.engine.approvals import start_reasons
from warmbox.engine.engine import Engine
from warmbox.engine.front import EngineFront
from warmbox.errors import ApprovalClosed, ApprovalDenied, ApprovalNotFound, Forbidden
from warmbox.models import BudgetStatus, Limits, Tenant


def _engine(tmp: Path, approvals: str = "", timeout: float = 5) -> Engine:
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    (home / "warmbox.toml").write_text(
        f"[pools.py]\ntemplate = 'base'\nmax = 100\n[approvals]\ntimeout = {timeout}\n" + approvals
    )
    return Engine(home)


def _status(cpu_used: float = 0, cpu_limit: float = 0, gib_used: float = 0, gib_limit: float = 0) -> BudgetStatus:
    return BudgetStatus("acme", 0.0, cpu_used, cpu_limit, 0, gib_used, gib_limit, 0, False, False)


def test_start_reasons():
    s = ApprovalSettings(memory_above_mb=8192, tiers=("microvm",), budget_lookahead_s=3600)
    lim = Limits(memory_mb=1024, cpus=1)
    assert start_reasons(s, "create", "container", lim, None) == []
    assert start_reasons(s, "create", "container", Limits(memory_mb=8192), None) == []  # at the size: fine
    [r] = start_reasons(s, "create", "container", Limits(memory_mb=8193), None)
    assert "8193 MiB is above 8192 MiB" in r
    assert start_reasons(s, "create", "microvm", lim, None) == ["the microvm tier needs approval"]
    assert start_reasons(s, "resume", "microvm", Limits(memory_mb=9000), None) == []  # size and tier: creates only
    # budget: today's use + an hour (the lookahead) of the new sandbox's full CPUs / memory
    assert start_reasons(s, "resume", "container", lim, _status(cpu_used=8.9, cpu_limit=10)) == []
    [r] = start_reasons(s, "resume", "container", lim, _status(cpu_used=9.1, cpu_limit=10))
    assert r.startswith("over budget: 9.1 of 10 CPU-hours")
    assert start_reasons(s, "create", "container", lim, _status(gib_used=38.9, gib_limit=40)) == []
    assert len(start_reasons(s, "create", "container", lim, _status(gib_used=39.1, gib_limit=40))) == 1
    # the tenant's live sandboxes count too: 0.5 + 1 h of the new one + 1 h of 9 running CPUs > 10
    [r] = start_reasons(s, "create", "container", lim, _status(cpu_used=0.5, cpu_limit=10), (1024, 9.0))
    assert r.startswith("over budget: 0.5 of 10 CPU-hours") and "+9 for the ones running" in r
    assert start_reasons(s, "create", "container", lim, _status(cpu_used=0.5, cpu_limit=10), (1024, 8.0)) == []
    none = ApprovalSettings(budget_lookahead_s=0)
    assert start_reasons(none, "create", "container", lim, _status(cpu_used=10, cpu_limit=10)) != []  # at it: asks
    assert start_reasons(none, "create", "container", lim, _status(cpu_used=5, cpu_limit=0)) == []  # 0: no budget


async def _answer_when_asked(engine: Engine, front: EngineFront, decision: str) -> str:
    """Wait (bounded) for a pending question, answer it through ``front``; its id."""
    for _ in range(200):
        pending = engine.registry.approvals.approvals(None, pending_only=True)
        if pending:
            await front.handle(ops.ApprovalAnswer(pending[0].approval_id, decision))
            return pending[0].approval_id
        await asyncio.sleep(0.025)
    raise AssertionError("no question was asked")


def test_a_denied_create_over_budget_fails_and_leaves_nothing(tmp_path):
    engine = _engine(tmp_path)
    engine.registry.tenants.create_key("acme", budget_cpu_h=0.001)  # 3.6 CPU-s: a minute of 1 CPU is past it
    tenant = engine.registry.tenants.tenant("acme")
    user, operator = EngineFront(engine, tenant=tenant), EngineFront(engine)

    async def go() -> tuple[BaseException, str]:
        create = asyncio.ensure_future(user.handle(ops.Create(limits=Limits(memory_mb=256, cpus=1))))
        aid = await _answer_when_asked(engine, operator, "deny")
        with pytest.raises(ApprovalDenied) as e:
            await create
        return e.value, aid

    err, aid = asyncio.run(go())
    assert err.state == "denied" and err.approval_id == aid and "over budget" in err.reason
    assert "denied by root" in str(err)
    a = engine.registry.approvals.approval(aid)
    assert (a.tenant, a.kind, a.sandbox_id, a.decision, a.answered_by) == ("acme", "create", "", "deny", "root")
    assert "container, 256 MiB, 1 CPUs" in a.subject
    assert engine.list(include_dead=True, tenant="acme") == [] and engine.list(include_dead=True) == []


def test_an_unanswered_create_times_out(tmp_path):
    engine = _engine(tmp_path, "memory_above_mb = 1000\ntiers = ['gvisor']\n", timeout=0.3)
    front = EngineFront(engine)
    t0 = time.monotonic()
    with pytest.raises(ApprovalDenied) as e:
        asyncio.run(front.handle(ops.Create(limits=Limits(memory_mb=1001))))
    assert e.value.state == "timed_out" and "not answered within 0.3 s" in str(e.value)
    assert time.monotonic() - t0 < 5
    with pytest.raises(ApprovalDenied):  # a listed tier (an alias of it too)
        asyncio.run(front.handle(ops.Create(tier="runsc")))
    with pytest.raises(ApprovalClosed):
        asyncio.run(front.handle(ops.ApprovalAnswer(e.value.approval_id, "approve")))
    assert engine.list(include_dead=True) == []


def test_a_pool_resize_above_the_limit_waits_for_approval(tmp_path):
    engine = _engine(tmp_path, "pool_target_above = 10\n")
    front = EngineFront(engine)

    async def go() -> None:
        resize = asyncio.ensure_future(front.handle(ops.PoolsResize("py", target=11)))
        aid = await _answer_when_asked(engine, front, "deny")
        with pytest.raises(ApprovalDenied):
            await resize
        assert engine.registry.approvals.approval(aid).kind == "pool_resize"

    asyncio.run(go())
    assert "py" not in engine.registry.pools.pool_rows()  # nothing was written


class _Hook(http.server.BaseHTTPRequestHandler):
    reply: ClassVar[bytes] = b""
    seen: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        self.seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.reply)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hook():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Hook.seen = []
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_the_webhook_is_told_and_may_answer_at_once(tmp_path, hook):
    url = f"http://127.0.0.1:{hook.server_address[1]}/approve"
    engine = _engine(tmp_path, f"memory_above_mb = 1000\nwebhook = '{url}'\n")
    front = EngineFront(engine)
    _Hook.reply = b'{"decision": "deny"}'
    t0 = time.monotonic()
    with pytest.raises(ApprovalDenied) as e:
        asyncio.run(front.handle(ops.Create(limits=Limits(memory_mb=2000))))
    assert time.monotonic() - t0 < 3 and "denied by webhook" in str(e.value)
    [q] = _Hook.seen
    assert q["approval_id"] == e.value.approval_id and q["kind"] == "create" and q["state"] == "pending"
    # a reply that is no decision (or one of another kind) leaves the question to the queue
    engine = _engine(tmp_path, f"memory_above_mb = 1000\nwebhook = '{url}'\n", timeout=0.3)
    front = EngineFront(engine)
    for reply in (b"", b'{"decision": "allow_once"}', b"not json", b'["approve"]'):
        _Hook.reply = reply
        with pytest.raises(ApprovalDenied) as e:
            asyncio.run(front.handle(ops.Create(limits=Limits(memory_mb=2000))))
        assert e.value.state == "timed_out", reply


def test_tenants_see_their_own_questions_and_answer_only_network_ones(tmp_path):
    engine = _engine(tmp_path)
    reg = engine.registry
    for name in ("acme", "beta"):
        reg.tenants.create_key(name)
    _, admin_secret = reg.tenants.create_key("ops", admin=True)
    admin = reg.tenants.authenticate(admin_secret)
    acme, beta = (
        EngineFront(engine, tenant=reg.tenants.tenant("acme")),
        EngineFront(engine, tenant=reg.tenants.tenant("beta")),
    )
    cost = reg.approvals.open_approval("acme", "create", "create a sandbox", "over budget", 60)
    net = reg.approvals.open_approval(
        "acme", "network", "evil.example:443 (connect)", "on_unknown=ask", 60, sandbox_id="sb-1"
    )
    other = reg.approvals.open_approval("beta", "create", "create a sandbox", "over budget", 60)

    def run(front: EngineFront, req: ops.Request) -> object:
        return asyncio.run(front.handle(req))

    assert [a.approval_id for a in run(acme, ops.ApprovalsList())] == [net.approval_id, cost.approval_id]
    assert [a.approval_id for a in run(beta, ops.ApprovalsList(pending_only=True))] == [other.approval_id]
    everyone = EngineFront(engine, tenant=admin)
    assert len(run(everyone, ops.ApprovalsList())) == 3 == len(run(EngineFront(engine), ops.ApprovalsList()))
    assert [a.approval_id for a in run(everyone, ops.ApprovalsList(tenant="beta"))] == [other.approval_id]
    assert run(acme, ops.ApprovalsList(tenant="beta")) == []  # not its to see
    assert len(run(acme, ops.ApprovalsList(tenant="acme"))) == 2
    with pytest.raises(Forbidden):  # its own budget is not its to lift
        run(acme, ops.ApprovalAnswer(cost.approval_id, "approve"))
    with pytest.raises(ApprovalNotFound):  # another tenant's: not found, whatever its kind
        run(beta, ops.ApprovalAnswer(net.approval_id, "deny"))
    got = run(acme, ops.ApprovalAnswer(net.approval_id, "allow_once"))
    assert (got.state, got.decision, got.answered_by) == ("approved", "allow_once", "tenant:acme")
    got = run(everyone, ops.ApprovalAnswer(other.approval_id, "approve"))
    assert got.answered_by == admin.key_id
    with pytest.raises(ApprovalClosed):
        run(everyone, ops.ApprovalAnswer(other.approval_id, "deny"))
    for bad in (ops.ApprovalsList(limit=0), ops.ApprovalsList(pending_only="yes"), ops.ApprovalAnswer("", "deny")):  # type: ignore[arg-type]
        with pytest.raises(Exception) as e:
            run(acme, bad)
        assert type(e.value).__name__ == "InvalidArgument"


def test_a_create_with_a_bad_option_is_refused_before_anyone_is_asked(tmp_path):
    """The start record is checked whole before the approval gate: nobody is asked about a create
    that could not start anyway (envs, timeout, template, secrets without a network)."""
    from warmbox.errors import InvalidArgument

    engine = _engine(tmp_path, "memory_above_mb = 1000\n", timeout=0.3)
    front = EngineFront(engine)
    big = Limits(memory_mb=2000)
    for bad in (
        ops.Create(limits=big, envs={"1bad": "x"}),
        ops.Create(limits=big, timeout=-1),
        ops.Create(limits=big, template=7),  # type: ignore[arg-type]
        ops.Create(limits=big, secrets={"T": object()}),
    ):
        with pytest.raises(InvalidArgument):
            asyncio.run(front.handle(bad))
    assert engine.registry.approvals.approvals(None) == []


def test_a_cancelled_wait_withdraws_its_question(tmp_path):
    engine = _engine(tmp_path, "memory_above_mb = 1000\n")
    front = EngineFront(engine)

    async def go() -> None:
        create = asyncio.ensure_future(front.handle(ops.Create(limits=Limits(memory_mb=2000))))
        for _ in range(200):
            if engine.registry.approvals.approvals(None, pending_only=True):
                break
            await asyncio.sleep(0.025)
        create.cancel()
        with pytest.raises(asyncio.CancelledError):
            await create

    asyncio.run(go())
    [a] = engine.registry.approvals.approvals(None)
    assert (a.state, a.answered_by) == ("timed_out", "withdrawn")


def test_tenant_budget_from_keys_create(tmp_path):
    from warmbox.cli.keys import parse_budget

    assert parse_budget("cpu=10h,mem=40GiBh") == (10.0, 40.0)
    assert parse_budget("mem=0") == (None, 0.0)
    for bad in ("cpu=10GiBh", "mem=3h", "gpu=1", "cpu=-1", "cpu=1h,"):
        with pytest.raises(Exception) as e:
            parse_budget(bad)
        assert type(e.value).__name__ == "InvalidArgument"
    assert Tenant("x").budget_cpu_h == 0.0


def test_the_cli_sets_and_shows_budgets_and_answers_questions(tmp_path, monkeypatch, capsys):
    from warmbox.cli.main import main

    engine = _engine(tmp_path)
    monkeypatch.setenv("WARMBOX_HOME", str(engine.home))
    for k in ("WARMBOX_API_URL", "WARMBOX_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    assert main(["keys", "create", "--tenant", "acme", "--budget", "cpu=10h,mem=40GiBh"]) == 0
    assert main(["keys", "ls"]) == 0
    assert "cpu=10h,mem=40GiBh" in capsys.readouterr().out
    assert main(["keys", "budget", "--tenant", "acme", "--set", "cpu=0.5", "--json"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert (b["cpu_limit_h"], b["gib_limit_h"], b["warning"]) == (0.5, 40.0, False)
    assert main(["keys", "create", "--tenant", "acme", "--budget", "gpu=1"]) == 125
    net = engine.registry.approvals.open_approval("acme", "network", "x.example:443 (connect)", "on_unknown=ask", 60)
    cost = engine.registry.approvals.open_approval("acme", "create", "create \x1b[31ma sandbox", "over budget", 60)
    assert main(["approvals", "ls"]) == 0
    out = capsys.readouterr().out
    assert net.approval_id in out and cost.approval_id in out and "\x1b" not in out  # no terminal escapes
    assert main(["approvals", "approve", net.approval_id, "--always"]) == 0
    assert main(["approvals", "deny", cost.approval_id]) == 0
    assert main(["approvals", "deny", cost.approval_id]) == 125  # answered once
    assert capsys.readouterr().out.splitlines() == [
        f"{net.approval_id}: approved (allow_always)",
        f"{cost.approval_id}: denied (deny)",
    ]
    assert engine.registry.approvals.approval(net.approval_id).decision == "allow_always"
    assert engine.registry.approvals.approval(cost.approval_id).decision == "deny"
    assert main(["approvals", "ls"]) == 0 and net.approval_id not in capsys.readouterr().out  # pending only
