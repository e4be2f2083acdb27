"""The console's cost page: cpu-hours and GiB-hours per tenant over time, against the tenant's daily budget.

A tenant key sees its own tenant only, whatever it asks for; an admin key (or root on the unix
socket) sees every tenant's, one line each, and picks one with ``?tenant=`` (``Viewer.scope``).
With one tenant shown, its budget per UTC day and the warning share are drawn as lines, and
today's use so far is a running line beside the per-hour bars.
"""

from __future__ import annotations

import dataclasses
import time
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from warmbox.errors import InvalidArgument
from warmbox.models import BudgetStatus, UsageBucket
from warmbox.server.console import charts
from warmbox.server.console.web import PREFIX, Console, Viewer

NAV = ("Cost", f"{PREFIX}/cost")
BADGE = f"{PREFIX}/frag/cost/budget"
# range -> (seconds shown, bucket seconds)
RANGES = {"24h": (86400, 3600), "7d": (7 * 86400, 3600), "30d": (30 * 86400, 86400)}
DEFAULT_RANGE = "24h"
MAX_TENANTS = 10  # lines on one chart; the rest are counted, not drawn
MAX_ROWS = 100  # tenants in the totals table (largest first)
REFRESH_MS = 30_000


def window(request: Request) -> tuple[str, int, int]:
    """The ``?range=`` asked for, its seconds and its bucket; InvalidArgument for one not in RANGES."""
    name = request.query_params.get("range", DEFAULT_RANGE)
    if name not in RANGES:
        raise InvalidArgument(f"range must be one of {', '.join(RANGES)}, got {name[:40]!r}")
    return (name, *RANGES[name])


def scope(viewer: Viewer) -> str | None:
    """The tenant shown (None: all). A tenant key's own, always; an admin's choice."""
    if viewer.tenant is not None and not viewer.admin:
        return viewer.tenant.name
    return viewer.scope


@dataclasses.dataclass(frozen=True)
class Total:
    """One tenant's use over the range shown."""

    tenant: str
    dom: str
    cpu_h: float
    gib_h: float
    today: float  # today's highest budget ratio (0: no budget)
    warning: bool  # today's use is past the warning share of its budget
    exceeded: bool


@dataclasses.dataclass(frozen=True)
class View:
    """Everything the page and its JSON show for one (viewer, range)."""

    tenant: str | None
    range: str
    bucket_s: int
    since: float
    now: float
    shown: tuple[str, ...]  # tenants drawn, largest first (one when ``tenant`` is set)
    tenant_count: int  # tenants with any use in the range
    totals: tuple[Total, ...]  # the MAX_ROWS largest
    total_count: int
    cpu: charts.Chart
    gib: charts.Chart
    budget: BudgetStatus | None  # the one tenant's today, if it has a budget
    warn_ratio: float


def build(console: Console, viewer: Viewer, request: Request) -> View:
    rng, seconds, bucket_s = window(request)
    who = scope(viewer)
    usage_store = console.service.usage
    now = time.time()
    since = now - seconds
    usage: list[UsageBucket] = usage_store.usage(who, since)
    warn = console.service.engine.settings().approvals.warn_ratio
    budget = None
    if who is not None:
        shown, count = [who], 1
        status = usage_store.budget_status(who, now, warn_ratio=warn)
        if status.cpu_limit_h > 0 or status.gib_limit_h > 0:
            budget = status
    else:
        shown, count = charts.top_tenants(usage, MAX_TENANTS)
    cpu, gib = charts.cost_charts(
        usage,
        tenants=shown,
        since=since,
        now=now,
        bucket_s=bucket_s,
        budget=charts.Budget(budget.cpu_limit_h, budget.gib_limit_h, warn) if budget is not None else None,
    )
    sums: dict[str, list[float]] = {}
    for u in usage:
        s = sums.setdefault(u.tenant, [0.0, 0.0])
        s[0] += u.cpu_s / 3600
        s[1] += u.gib_s / 3600
    order = sorted(sums, key=lambda t: (-sums[t][0], -sums[t][1], t))
    budgets = {b.tenant: b for b in usage_store.budgets(now, warn_ratio=warn)}  # two reads, whatever the tenants
    totals = []
    for t in order[:MAX_ROWS]:
        b = budgets.get(t)
        if b is None:
            totals.append(Total(t, charts.dom_id(t), sums[t][0], sums[t][1], 0.0, False, False))
        else:
            ratio = max(b.cpu_ratio, b.gib_ratio)
            totals.append(Total(t, charts.dom_id(t), sums[t][0], sums[t][1], ratio, b.warning, b.exceeded))
    return View(who, rng, bucket_s, since, now, tuple(shown), count, tuple(totals), len(order), cpu, gib, budget, warn)


def tenants(console: Console, viewer: Viewer) -> list[str]:
    """The tenants an admin may pick: every key's (revoked ones too: their use stays)."""
    if not viewer.admin:
        return []
    return sorted({k.tenant for k in console.service.tenants.list_keys() if k.tenant})


def routes(console: Console) -> list[BaseRoute]:
    async def page(request: Request, viewer: Viewer) -> Response:
        v = build(console, viewer, request)
        q = f"range={v.range}" + (
            f"&tenant={quote(v.tenant, safe='')}" if v.tenant is not None and viewer.admin else ""
        )
        return console.render(
            request,
            viewer,
            "cost.html",
            view=v,
            tenants=tenants(console, viewer),
            ranges=list(RANGES),
            src=f"{PREFIX}/cost.json?{q}",
            refresh_ms=REFRESH_MS,
            amount=charts.fmt_amount,
        )

    async def data(request: Request, viewer: Viewer) -> Response:
        v = build(console, viewer, request)
        b = v.budget
        return JSONResponse(
            {
                "tenant": v.tenant,
                "range": v.range,
                "bucket_s": v.bucket_s,
                "since": v.since,
                "now": v.now,
                "tenants": list(v.shown),
                "tenant_count": v.tenant_count,
                "budget": None if b is None else dataclasses.asdict(b),
                "charts": [v.cpu.to_json(), v.gib.to_json()],
            }
        )

    async def badge(request: Request, viewer: Viewer) -> Response:
        # the budget warning on every page (the nav's Cost link): the viewer's tenant's, or for an
        # admin, how many tenants (in its filter) passed [approvals] warn_ratio of today's budget
        warn = console.service.engine.settings().approvals.warn_ratio
        who = scope(viewer)
        statuses = [b for b in console.service.usage.budgets(warn_ratio=warn) if who in (None, b.tenant)]
        hot = [b for b in statuses if b.warning or b.exceeded]
        return console.render(
            request,
            viewer,
            "_budget_badge.html",
            count=len(hot),
            exceeded=any(b.exceeded for b in hot),
            ratio=max((max(b.cpu_ratio, b.gib_ratio) for b in hot), default=0.0),
            one=who is not None,
        )

    return [
        Route(f"{PREFIX}/cost", console.page(page)),
        Route(f"{PREFIX}/cost.json", console.data(data)),
        Route(BADGE, console.fragment(badge), methods=["GET"]),
    ]
