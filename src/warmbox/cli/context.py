"""What the CLI's commands share: their way to the engine (a transport), the server they go to, KEY=VALUE flags.

Every subcommand module imports from here, never from main.py (main.py imports them: the other way
would be a circle). Nothing here loads asyncio, the SDK or the engine at import (``warmbox --help``).
"""

from __future__ import annotations

import os
from typing import Any

from warmbox.errors import WarmboxError

OPEN: list[Any] = []  # transports the command opened: closed before the loop ends


def transport() -> Any:
    """The CLI's only way to the engine: a warmbox server (--api-url / WARMBOX_API_URL), else
    this home's engine in process. Closed by :func:`closing` when the command ends."""
    t: Any
    if api_url():  # the HTTP client (aiohttp) only then
        from warmbox.sdk.http import HttpTransport

        t = HttpTransport()
    else:
        from warmbox.sdk.transport import LocalTransport

        t = LocalTransport()
    OPEN.append(t)
    return t


def api_url() -> str | None:
    """The server every command goes to (--api-url, WARMBOX_API_URL), as the SDK's default_url
    reads it (sdk.transport: not loaded for this)."""
    return os.environ.get("WARMBOX_API_URL") or None


async def closing(run: Any) -> int:
    """Await a command's coroutine, then close every transport it opened."""
    try:
        return int(await run)
    finally:
        while OPEN:
            await OPEN.pop().close()


def pairs(values: list[str] | None, flag: str, key: str = "KEY") -> dict[str, str]:
    """``flag``'s KEY=VALUE items as a dict (WarmboxError naming the flag for an item without "=")."""
    out = {}
    for item in values or []:
        if "=" not in item:
            raise WarmboxError(f"{flag} expects {key}=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k] = v
    return out
