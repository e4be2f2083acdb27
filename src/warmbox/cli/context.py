"""What the CLI's commands share: their way to the engine (a transport), the server they go to, KEY=VALUE flags.

Every subcommand module imports from here, never from main.py (main.py imports them: the other way
would be a circle). Nothing here loads asyncio, the SDK or the engine at import (``warmbox --help``).
"""

from __future__ import annotations

import argparse
import os

from warmbox.errors import WarmboxError

TYPE_CHECKING = False  # typing costs --help ~2 ms; mypy reads any TYPE_CHECKING as True (annotations are strings)
if TYPE_CHECKING:
    from typing import Any

OPEN: list[Any] = []  # transports the command opened: closed before the loop ends

# the subcommands whose parsers their own modules build (keys.py, ...): main lists them with this
# help without importing the module, which it does only when the command is asked for
MODULE_COMMANDS = {
    "keys": "API keys of tenants: create (secret shown once), ls, revoke",
    "approvals": "the approval queue: ls, approve ID, deny ID",
    "volume": "named volumes: create, ls, show, rm",
    "db": "the registry's schema: migrate it to this warmbox's, or show its version",
    "template": "build, list, show and remove templates",
    "node": "this home as a cluster node: join; the cluster's nodes: ls, drain",
    "cluster": "a cluster's Ray head and peer token",
}


class _Unbuilt:
    """A subcommand's parser that is not built (another command was asked for): every call on it,
    or on what it returns, does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self


class Subcommands:
    """The top parser's subcommands, built lazily: only the one asked for (``only``; None: every one)
    gets its arguments and nested commands; the others are listed (name and help) only when that one
    is not built (``--help``, a bad word: argparse shows the list), as 32 parsers cost every
    ``warmbox exec`` ~3 ms."""

    def __init__(self, sub: Any, only: str | None) -> None:
        self.sub = sub
        self.only = only
        self.choices = sub.choices
        self._unbuilt: list[tuple[str, str | None]] = []  # (name, help) of the commands not asked for

    def wants(self, name: str) -> bool:
        return self.only is None or self.only == name

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        if self.wants(name):
            return self.sub.add_parser(name, **kwargs)
        self._unbuilt.append((name, kwargs.get("help")))
        return _Unbuilt()

    def listed(self, name: str) -> None:
        """A module's command not asked for: listed with its help, the module not imported."""
        self._unbuilt.append((name, MODULE_COMMANDS[name]))

    def done(self) -> dict[str, argparse.ArgumentParser]:
        """Every command built, by name (the commands not asked for listed, in order, if none was)."""
        if self.only not in self.sub.choices:
            for name, help in self._unbuilt:
                self.sub.add_parser(name, help=help)
        return dict(self.sub.choices)


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


def loop_factory(args: argparse.Namespace) -> Any:
    """The event loop a command runs on: asyncio's, or uvloop's for ``serve --loop uvloop``."""
    if getattr(args, "loop", "asyncio") != "uvloop":
        return None
    import importlib

    try:
        uvloop = importlib.import_module("uvloop")  # optional: not a dependency of warmbox
    except ImportError:
        raise WarmboxError("--loop uvloop needs uvloop (pip install uvloop)") from None
    return uvloop.new_event_loop


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


def option_words(p: argparse.ArgumentParser, argv: list[str], i: int) -> int | None:
    """The index of the first word at or after ``i`` that is neither an option of ``p`` nor an
    option's value; None at an option ``p`` does not have (argparse then says so)."""
    options = p._option_string_actions
    while i < len(argv):
        word = argv[i]
        if not word.startswith("-") or word in ("-", "--"):
            return i
        if word.startswith("--"):
            name, eq, _ = word.partition("=")
            found = [o for o in options if o.startswith("--") and o.startswith(name)]  # argparse takes a prefix
            if name not in options and len(found) != 1:
                return None
            action = options[name if name in options else found[0]]
            i += 1 if eq or action.nargs == 0 else 2
            continue
        i += 1
        for j in range(1, len(word)):  # -x, -xVALUE, or flags together (-it)
            short = options.get("-" + word[j])
            if short is None:
                return None
            if short.nargs != 0:
                i += j + 1 == len(word)  # its value is the next word
                break
    return i
