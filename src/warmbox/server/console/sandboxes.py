"""The sandbox list (refreshed every 1.5 s) and one sandbox's page."""

from __future__ import annotations

import dataclasses

from markupsafe import Markup
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from warmbox import operations as ops
from warmbox import transcript
from warmbox.errors import SandboxNotFound, WarmboxError
from warmbox.models import NetEvent, SandboxInfo, SandboxMetrics, StageTiming
from warmbox.server.console import charts
from warmbox.server.console.web import PREFIX, Console, Viewer

NAV = ("Sandboxes", f"{PREFIX}/")
MAX_ROWS = 200  # the list shows the newest this many (ended ones only when asked)
MAX_NET_EVENTS = 500  # the newest egress attempts on a sandbox's page
MAX_COMMANDS = 200  # the newest commands and code runs on a sandbox's page
REFRESH_MS = 1000


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the list: the sandbox and its cost so far (None: its meters could not be read)."""

    info: SandboxInfo
    metrics: SandboxMetrics | None


async def _metered(viewer: Viewer, sandbox_id: str, fresh: bool = False) -> SandboxMetrics | None:
    """Its cost so far: fresh (its agent asked for busy time and command count: one sandbox's page)
    or as last sampled (every row of the list); None if it went away meanwhile."""
    try:
        return await viewer.front.handle(ops.Metrics(sandbox_id, fresh=fresh))
    except WarmboxError:
        return None


async def rows(viewer: Viewer, ended: bool) -> list[Row]:
    """The viewer's sandboxes, newest first (at most MAX_ROWS), each with its metered cost."""
    infos = await viewer.front.handle(ops.ListSandboxes(include_dead=ended))
    mine = sorted((i for i in infos if viewer.sees(i)), key=lambda i: i.created_at, reverse=True)[:MAX_ROWS]
    return [Row(i, await _metered(viewer, i.sandbox_id)) for i in mine]


def _ended(request: Request) -> bool:
    return request.query_params.get("ended", "") in ("1", "true", "on")


def routes(console: Console) -> list[BaseRoute]:
    async def sandbox_list(request: Request, viewer: Viewer) -> Response:
        ended = _ended(request)
        return console.render(
            request,
            viewer,
            "sandboxes.html",
            rows=await rows(viewer, ended),
            ended=ended,
            refresh_ms=REFRESH_MS,
            max_rows=MAX_ROWS,
        )

    async def sandbox_rows(request: Request, viewer: Viewer) -> Response:
        ended = _ended(request)
        return console.render(request, viewer, "_sandbox_rows.html", rows=await rows(viewer, ended), ended=ended)

    async def _details(viewer: Viewer, sandbox_id: str) -> dict[str, object]:
        info = await viewer.front.handle(ops.Info(sandbox_id))
        if not viewer.sees(info):
            raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id)
        events: list[NetEvent] = await viewer.front.handle(ops.NetworkLog(sandbox_id))
        commands = await viewer.front.handle(ops.Commands(sandbox_id, limit=MAX_COMMANDS, newest_first=True))
        snapshots = [s for s in await viewer.front.handle(ops.ListSnapshots()) if s[1] == sandbox_id]
        return {
            "info": info,
            "metrics": await _metered(viewer, sandbox_id, fresh=True),
            "events": list(reversed(events[-MAX_NET_EVENTS:])),
            "events_total": len(events),
            "denied": sum(1 for e in events if e.decision != "allow"),
            "snapshots": sorted(snapshots, key=lambda s: s[2], reverse=True),
            "max_net_events": MAX_NET_EVENTS,
            "commands": commands,
            "max_commands": MAX_COMMANDS,
        }

    async def sandbox_page(request: Request, viewer: Viewer) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        details = await _details(viewer, sandbox_id)
        timings: list[StageTiming] = await viewer.front.handle(ops.Timings(sandbox_id))
        start = charts.ordered(timings)  # a start's stages only (a pause or resume is timed apart)
        details["timings"] = start + [t for t in timings if t not in start]  # the waterfall's order, then pause/resume
        details["start_ms"] = sum(t.duration_ms for t in start if t.on_request_path)
        details["pooled_ms"] = sum(t.duration_ms for t in start if not t.on_request_path)
        details["waterfall"] = Markup(charts.waterfall_svg(timings))  # charts escapes what it draws
        details["refresh_ms"] = REFRESH_MS
        return console.render_with(request, viewer, "sandbox.html", details)

    async def sandbox_live(request: Request, viewer: Viewer) -> Response:
        details = await _details(viewer, request.path_params["sandbox_id"])
        return console.render_with(request, viewer, "_sandbox_live.html", details)

    async def export(request: Request, viewer: Viewer, form: dict[str, str]) -> Response:
        """POST (CSRF-checked) /ui/sandboxes/{id}/export: the transcript of GET /v1/.../export as a
        download (a browser has the console's cookie, never a key for /v1)."""
        sandbox_id = request.path_params["sandbox_id"]
        info = await viewer.front.handle(ops.Info(sandbox_id))
        if not viewer.sees(info):
            raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id)
        body = transcript.dumps(await viewer.front.handle(ops.Export(sandbox_id)), "ndjson")
        # the id passed Info (sb- and 12 hex digits): safe in a header; served as a download, never rendered
        return Response(
            body,
            media_type="application/x-ndjson",
            headers={"content-disposition": f'attachment; filename="{info.sandbox_id}.ndjson"'},
        )

    return [
        Route(f"{PREFIX}/", console.page(sandbox_list), methods=["GET"]),
        Route(f"{PREFIX}/sandboxes/{{sandbox_id}}/export", console.action(export), methods=["POST"]),
        Route(f"{PREFIX}/frag/sandboxes", console.fragment(sandbox_rows), methods=["GET"]),
        Route(f"{PREFIX}/sandboxes/{{sandbox_id}}", console.page(sandbox_page), methods=["GET"]),
        Route(f"{PREFIX}/frag/sandboxes/{{sandbox_id}}", console.fragment(sandbox_live), methods=["GET"]),
    ]


__all__ = ["NAV", "Row", "routes", "rows"]
