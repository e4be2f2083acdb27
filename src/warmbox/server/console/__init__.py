"""The operator's console: server-rendered pages at /ui/ of ``warmbox serve``, behind the API's keys.

Each page module (listed in PAGES) exposes ``NAV = (label, path)`` and ``routes(console)``; see
:mod:`warmbox.server.console.web` for how a route is authenticated and rendered.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from warmbox.server.app import Service
from warmbox.server.console import approvals, cost, pools, sandboxes
from warmbox.server.console.web import HOME, LOGIN, PREFIX, STATIC, Console, secured

PAGES = (sandboxes, approvals, pools, cost)  # in navigation order


async def _home(request: Request) -> Response:
    return secured(RedirectResponse(HOME, status_code=303))


def routes(service: Service) -> list[BaseRoute]:
    """The console's routes on ``service`` (the same Service as the API's: keys, fronts, limits)."""
    console = Console(service)
    out: list[BaseRoute] = [
        Route("/", _home, methods=["GET"]),
        Route(PREFIX, _home, methods=["GET"]),
        Route(LOGIN, console.login_page, methods=["GET"]),
        Route(LOGIN, console.login, methods=["POST"]),
        Route(f"{PREFIX}/logout", console.action(console.logout), methods=["POST"]),
        Mount(STATIC, app=console.static_app()),
    ]
    for page in PAGES:
        console.nav.append(page.NAV)
        out.extend(page.routes(console))
    return out


__all__ = ["PAGES", "routes"]
