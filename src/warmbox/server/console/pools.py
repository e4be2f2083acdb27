"""The console's pools page: one card per warm pool (fill now, target, hits, misses, hit rate) with charts over time.

Pools are the host's, shared by every tenant, and any key may list them (``ops.PoolsList``);
the page shows what that operation shows plus the pool's events as charts — never the ids of
the sandboxes in those events, which belong to whoever claimed them.
"""

from __future__ import annotations

import dataclasses
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from warmbox import operations as ops
from warmbox.errors import InvalidArgument
from warmbox.models import PoolStatus
from warmbox.server.console import charts
from warmbox.server.console.web import PREFIX, Console, Viewer

NAV = ("Pools", f"{PREFIX}/pools")
RANGES = {"1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400}
DEFAULT_RANGE = "6h"
REFRESH_MS = 10_000  # the charts reload this often while the page is visible


def window(request: Request) -> tuple[str, int]:
    """The ``?range=`` asked for and its seconds; InvalidArgument for one not in RANGES."""
    name = request.query_params.get("range", DEFAULT_RANGE)
    if name not in RANGES:
        raise InvalidArgument(f"range must be one of {', '.join(RANGES)}, got {name[:40]!r}")
    return name, RANGES[name]


@dataclasses.dataclass(frozen=True)
class PoolCard:
    """What one pool's card shows (the template escapes every text)."""

    name: str
    dom: str  # element-id fragment (charts.dom_id)
    tier: str
    template: str
    ready: int
    warming: int
    target: int
    min: int
    max: int
    hits: int
    misses: int
    hit_rate: float | None  # %, None before the first claim
    warmup_failures: int
    last_error: str
    cost_cpu_s: float
    cost_gib_s: float

    @classmethod
    def of(cls, s: PoolStatus) -> PoolCard:
        return cls(
            s.name,
            charts.dom_id(s.name),
            s.tier,
            s.template,
            s.ready,
            s.warming,
            s.target,
            s.min,
            s.max,
            s.hits,
            s.misses,
            charts.hit_rate(s),
            s.warmup_failures,
            s.last_error,
            s.cost_cpu_s,
            s.cost_memory_gib_s,
        )


def routes(console: Console) -> list[BaseRoute]:
    async def page(request: Request, viewer: Viewer) -> Response:
        rng, _ = window(request)
        statuses = await viewer.front.handle(ops.PoolsList())
        return console.render(
            request,
            viewer,
            "pools.html",
            cards=[PoolCard.of(s) for s in statuses],
            range=rng,
            ranges=list(RANGES),
            src=f"{PREFIX}/pools.json?range={rng}",
            refresh_ms=REFRESH_MS,
            amount=charts.fmt_amount,
        )

    async def data(request: Request, viewer: Viewer) -> Response:
        rng, seconds = window(request)
        statuses = await viewer.front.handle(ops.PoolsList())
        store = console.service.pools
        now = time.time()
        since = now - seconds
        pools = []
        for s in statuses:
            # a pool younger than the range starts at its first event, not with hours of "0 ready"
            first = store.pool_first_event(s.name)
            start = now if first is None else min(now, max(since, first))
            events = store.pool_events(s.name, start)
            card = PoolCard.of(s)
            pools.append(
                {
                    "name": s.name,
                    "id": card.dom,
                    "ready": s.ready,
                    "target": s.target,
                    "hits": s.hits,
                    "misses": s.misses,
                    "hit_rate": card.hit_rate,
                    # what static/charts.js writes into the card's #pool-<id>-<field> elements at each reload
                    "fields": {
                        "ready": s.ready,
                        "target": s.target,
                        "warming": s.warming,
                        "hits": s.hits,
                        "misses": s.misses,
                        "hit-rate": card.hit_rate,
                        "failures": s.warmup_failures,
                    },
                    "charts": [
                        charts.pool_fill(s, events, since=start, now=now).to_json(),
                        charts.pool_hit_rate(s, events, since=start, now=now).to_json(),
                    ],
                }
            )
        return JSONResponse({"range": rng, "since": since, "now": now, "pools": pools})

    return [
        Route(f"{PREFIX}/pools", console.page(page)),
        Route(f"{PREFIX}/pools.json", console.data(data)),
    ]
