"""The approval gate: steps that cost money wait for a human's answer in the registry's queue.

A start (create, fork, resume) over its tenant's daily budget, and — as ``[approvals]`` says — a
create above a memory size or on a listed tier, or a pool resize above a target, opens a question
(:class:`~warmbox.models.Approval`, a registry row) and waits for its answer: Approve lets the step
go on, Deny or the deadline raise :class:`~warmbox.errors.ApprovalDenied` before anything was
claimed or made. The row is the truth, so the waiter and the answerer may be different processes
(a CLI waiting, the server's dashboard answering; a restart of either side in between loses
nothing). ``[approvals] webhook`` is told of every question and may answer it at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import urllib.request

from warmbox.config import ApprovalSettings
from warmbox.engine.engine import Engine
from warmbox.errors import ApprovalClosed, ApprovalDenied, InvalidArgument
from warmbox.models import COST_DECISIONS, NETWORK_DECISIONS, Approval, BudgetStatus, Limits, Tenant

HOUR = 3600.0
_MAX_WEBHOOK_REPLY = 4096
# open cost questions (create, resume, pool resize) one tenant may have waiting: each is a held
# request, and an unbounded number of them buried every other tenant's questions in the queue
# (the operator's page shows the newest 1000); network asks have their own bound (the proxy's)
MAX_OPEN_PER_TENANT = 32


def start_reasons(
    settings: ApprovalSettings,
    kind: str,
    tier: str,
    limits: Limits,
    budget: BudgetStatus | None,
    running: tuple[int, float] = (0, 0.0),
) -> list[str]:
    """Why a start of ``kind`` ("create" or "resume") of a ``tier`` sandbox with ``limits`` needs
    approval (empty: it does not). budget: the tenant's status today (None: no tenant, no budget).
    running: the memory (MiB) and CPUs of the tenant's sandboxes already live.

    Over budget: today's use plus what the new sandbox *and the live ones* would use in
    ``budget_lookahead_s`` at their full CPUs and memory goes past a daily limit (a tenant at or over
    its budget always asks). Counting only the new one let a burst of starts each pass alone."""
    out: list[str] = []
    if kind == "create":
        if settings.memory_above_mb and limits.memory_mb > settings.memory_above_mb:
            out.append(f"memory {limits.memory_mb} MiB is above {settings.memory_above_mb} MiB")
        if tier in settings.tiers:
            out.append(f"the {tier} tier needs approval")
    if budget is not None:
        ahead = settings.budget_lookahead_s / HOUR
        live_mb, live_cpus = running
        for what, used, limit, more, live in (
            ("CPU-hours", budget.cpu_used_h, budget.cpu_limit_h, limits.cpus * ahead, live_cpus * ahead),
            (
                "GiB-hours",
                budget.gib_used_h,
                budget.gib_limit_h,
                limits.memory_mb / 1024 * ahead,
                live_mb / 1024 * ahead,
            ),
        ):
            if limit and (used + live + more > limit or used >= limit):
                also = f", +{live:.2g} for the ones running" if live else ""
                out.append(f"over budget: {used:.3g} of {limit:g} {what} used today (+{more:.2g} for this start{also})")
    return out


def needed(engine: Engine, tenant: Tenant | None) -> bool:
    """Whether any start could need approval now (a create rule is set, or the tenant has a
    budget): when not, the caller skips working out what it would start."""
    settings = engine.settings().approvals
    if settings.memory_above_mb or settings.tiers:
        return True
    if tenant is None:
        return False
    b = engine.registry.usage.budget_status(tenant.name)
    return bool(b.cpu_limit_h or b.gib_limit_h)


async def gate_start(
    engine: Engine, tenant: Tenant | None, kind: str, tier: str, limits: Limits, *, sandbox_id: str = ""
) -> Approval | None:
    """Wait for approval if this start needs it (:func:`start_reasons`); None if it does not, the
    approved question if it did; ApprovalDenied if denied or unanswered by the deadline."""
    settings = engine.settings().approvals
    budget = None
    if tenant is not None:
        budget = engine.registry.usage.budget_status(tenant.name, warn_ratio=settings.warn_ratio)
        if not (budget.cpu_limit_h or budget.gib_limit_h):
            budget = None
    running = (
        engine.registry.usage.live_footprint(tenant.name) if budget is not None and tenant is not None else (0, 0.0)
    )
    reasons = start_reasons(settings, kind, tier, limits, budget, running)
    if not reasons:
        return None
    what = "resume sandbox " + sandbox_id if kind == "resume" else "create a sandbox"
    if kind == "create" and sandbox_id:
        what = f"fork snapshot {sandbox_id}"
    subject = f"{what}: {tier}, {limits.memory_mb} MiB, {limits.cpus:g} CPUs"
    return await require(
        engine,
        "" if tenant is None else tenant.name,
        kind,
        subject,
        "; ".join(reasons),
        sandbox_id="" if kind == "create" else sandbox_id,
    )


async def gate_pool_resize(engine: Engine, tenant: Tenant | None, pool: str, target: int | None) -> Approval | None:
    """Wait for approval of a pool resize to ``target`` above ``[approvals] pool_target_above``."""
    settings = engine.settings()
    above = settings.approvals.pool_target_above
    if not above or pool not in settings.pools or isinstance(target, bool) or not isinstance(target, int):
        return None  # no rule, or a request pools.resize refuses anyway
    if target <= above:
        return None
    return await require(
        engine,
        "" if tenant is None else tenant.name,
        "pool_resize",
        f"resize pool {pool} to {target} ready sandboxes",
        f"a target above {above} needs approval",
    )


async def require(
    engine: Engine, tenant: str, kind: str, subject: str, reason: str, *, sandbox_id: str = ""
) -> Approval:
    """Ask (:func:`ask`) and return the approved question; ApprovalDenied otherwise."""
    a = await ask(engine, tenant, kind, subject, reason, sandbox_id=sandbox_id)
    if a.state == "approved":
        return a
    if a.state == "denied":
        why = f"denied by {a.answered_by or 'an operator'}"
    else:
        why = f"not answered within {a.deadline - a.created_at:g} s"
    raise ApprovalDenied(
        f"{subject}: needs approval ({reason}) and was {why} (approval {a.approval_id})",
        approval_id=a.approval_id,
        state=a.state,
        reason=reason,
    )


async def ask(
    engine: Engine,
    tenant: str,
    kind: str,
    subject: str,
    reason: str,
    *,
    sandbox_id: str = "",
    timeout_s: float | None = None,
) -> Approval:
    """Open a question in the queue, tell the webhook, and wait for its answer (or deadline:
    ``timeout_s``, default ``[approvals] timeout``). Returns the question as it ended: approved,
    denied or timed_out (a network question's ``decision`` says which allow). A cancelled wait
    (the caller went away) withdraws the question: it reads as timed_out. ApprovalDenied at once,
    with no question asked, when MAX_OPEN_PER_TENANT of the tenant's cost questions already wait."""
    settings = engine.settings().approvals
    reg = engine.registry
    if kind != "network":  # no await between this count and the row's insert below
        waiting = reg.approvals.approvals(tenant, pending_only=True, limit=1000)
        if sum(1 for q in waiting if q.kind != "network") >= MAX_OPEN_PER_TENANT:
            raise ApprovalDenied(
                f"{subject}: needs approval ({reason}), but {MAX_OPEN_PER_TENANT} questions of "
                f"{'the host' if not tenant else 'tenant ' + repr(tenant)} already wait for an answer",
                state="denied",
                reason="too many questions waiting",
            )
    a = reg.approvals.open_approval(
        tenant,
        kind,
        subject,
        reason,
        settings.timeout_s if timeout_s is None else timeout_s,
        sandbox_id=sandbox_id,
        waiter=engine.owner,
    )
    try:
        if settings.webhook:
            decision = await tell_webhook(settings, a)
            if decision:
                try:
                    reg.approvals.answer_approval(a.approval_id, decision, "webhook")
                except (ApprovalClosed, InvalidArgument):
                    pass  # answered meanwhile, or a decision not of its kind: the queue decides
        return await reg.approvals.wait_approval(a.approval_id)
    except BaseException:
        reg.approvals.withdraw_approval(a.approval_id)
        raise


async def tell_webhook(settings: ApprovalSettings, a: Approval) -> str:
    """POST the question (JSON: the Approval's fields) to ``[approvals] webhook``; its decision if
    the reply is ``{"decision": <one of the question's decisions>}``, else "" (no answer: the
    queue decides). A webhook that fails or is slow only loses its say."""
    body = json.dumps(dataclasses.asdict(a)).encode()
    try:
        decision = await asyncio.wait_for(
            asyncio.to_thread(_post, settings.webhook, body, settings.webhook_timeout_s),
            settings.webhook_timeout_s + 1,
        )
    except (TimeoutError, OSError, ValueError):
        return ""
    allowed = NETWORK_DECISIONS if a.kind == "network" else COST_DECISIONS
    return decision if decision in allowed else ""


def _post(url: str, body: bytes, timeout: float) -> str:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:  # an operator-configured URL
        raw = r.read(_MAX_WEBHOOK_REPLY + 1)
    if not raw.strip() or len(raw) > _MAX_WEBHOOK_REPLY:
        return ""
    answer = json.loads(raw)
    return str(answer.get("decision", "")) if isinstance(answer, dict) else ""
