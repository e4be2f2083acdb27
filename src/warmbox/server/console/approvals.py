"""The approval queue: create / resume / pool-resize questions (Approve, Deny) and network asks
(Allow once, Allow always, Deny), refreshed every 1.5 s so a new question shows without a reload."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from warmbox import operations as ops
from warmbox.errors import InvalidArgument
from warmbox.models import COST_DECISIONS, NETWORK_DECISIONS, Approval
from warmbox.server.console.web import PREFIX, Console, Viewer

NAV = ("Approvals", f"{PREFIX}/approvals")
BADGE = f"{PREFIX}/frag/approvals/count"  # the number waiting, next to the nav link on every page
REFRESH_MS = 1000
RECENT = 50  # answered or timed-out questions shown under the open ones
MAX_PENDING = 1000  # open questions shown (the queue's own bounds keep it far below)
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
LABELS = {"approve": "Approve", "deny": "Deny", "allow_once": "Allow once", "allow_always": "Allow always"}
OUTCOMES = {"approve": "approved", "deny": "denied", "allow_once": "allowed once", "allow_always": "allowed always"}


def decisions(a: Approval, viewer: Viewer) -> tuple[str, ...]:
    """The buttons this viewer gets for a pending question: a network ask is its tenant's to
    answer; a create, resume or pool resize is the operator's (an admin key or root)."""
    if a.state != "pending":
        return ()
    if a.kind == "network":
        return NETWORK_DECISIONS
    return COST_DECISIONS if viewer.admin else ()


async def queue(viewer: Viewer) -> tuple[list[Approval], list[Approval]]:
    """(open questions oldest first, the newest RECENT closed ones) in the viewer's scope."""
    # the scope goes into the query (not filtered after its limit): a tenant flooding the queue
    # cannot push another tenant's questions off an admin's filtered page
    open_ = await viewer.actor.handle(ops.ApprovalsList(pending_only=True, limit=MAX_PENDING, tenant=viewer.scope))
    recent = await viewer.actor.handle(ops.ApprovalsList(limit=min(1000, len(open_) + RECENT), tenant=viewer.scope))
    pending = sorted(open_, key=lambda a: a.created_at)
    closed = [a for a in recent if a.state != "pending"][:RECENT]
    return pending, closed


def routes(console: Console) -> list[BaseRoute]:
    def context(viewer: Viewer, pending: list[Approval], closed: list[Approval]) -> dict[str, object]:
        return {
            "pending": [(a, decisions(a, viewer)) for a in pending],
            "more": len(pending) >= MAX_PENDING,
            "closed": closed,
            "labels": LABELS,
            "outcomes": OUTCOMES,
            "refresh_ms": REFRESH_MS,
        }

    async def approvals_page(request: Request, viewer: Viewer) -> Response:
        pending, closed = await queue(viewer)
        return console.render_with(request, viewer, "approvals.html", context(viewer, pending, closed))

    async def approvals_rows(request: Request, viewer: Viewer) -> Response:
        pending, closed = await queue(viewer)
        return console.render_with(request, viewer, "_approvals.html", context(viewer, pending, closed))

    async def answer(request: Request, viewer: Viewer, form: dict[str, str]) -> Response:
        approval_id = request.path_params["approval_id"]
        decision = form.get("decision", "")
        if not _ID.fullmatch(approval_id):
            raise InvalidArgument("not an approval id")
        if decision not in LABELS:
            raise InvalidArgument(f"decision must be one of {', '.join(LABELS)}")
        await viewer.actor.handle(ops.ApprovalAnswer(approval_id, decision))
        return RedirectResponse(f"{PREFIX}/approvals{viewer.query}", status_code=303)

    async def approvals_badge(request: Request, viewer: Viewer) -> Response:
        q = ops.ApprovalsList(pending_only=True, limit=MAX_PENDING, tenant=viewer.scope)
        waiting: list[Approval] = await viewer.actor.handle(q)
        return console.render(request, viewer, "_approvals_badge.html", count=len(waiting))

    return [
        Route(f"{PREFIX}/approvals", console.page(approvals_page), methods=["GET"]),
        Route(BADGE, console.fragment(approvals_badge), methods=["GET"]),
        Route(f"{PREFIX}/frag/approvals", console.fragment(approvals_rows), methods=["GET"]),
        Route(f"{PREFIX}/approvals/{{approval_id}}", console.action(answer), methods=["POST"]),
    ]


__all__ = ["NAV", "decisions", "queue", "routes"]
