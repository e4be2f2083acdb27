"""The seam under the SDK: a Transport carries one typed request of warmbox.operations to an engine.

``LocalTransport`` runs the engine front in this process (the embedded default: no server).
A remote transport (HTTP, a later issue) implements the same three methods; tests may use a
fake. One transport serves one event loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from warmbox import operations as ops
from warmbox.models import ApprovalRequest

R = TypeVar("R")


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Transport(Protocol):
    """What the SDK needs of an engine: run an operation, subscribe to approvals, close."""

    async def handle(self, request: ops.Request[R]) -> R:
        """Run one operation; its typed result, or a typed WarmboxError."""
        ...

    async def subscribe_approvals(self, sandbox_id: str, hook: Callable[[ApprovalRequest], object]) -> Cancellable:
        """Answer the sandbox's network approval questions with ``hook`` until cancelled."""
        ...

    async def close(self) -> None:
        """Let go of every connection (no sandbox is ended). Idempotent."""
        ...


def default_url() -> str | None:
    """The server every call goes to when none is named (WARMBOX_API_URL), or None: in process."""
    return os.environ.get("WARMBOX_API_URL") or None


class LocalTransport:
    """The engine of a warmbox home, in this process (needs root on the sandbox host)."""

    def __init__(self, home: str | Path | None = None) -> None:
        # lazily, by design: an SDK (or CLI) process that talks to a server never loads the engine
        from warmbox.engine.engine import Engine
        from warmbox.engine.front import EngineFront

        self.front = EngineFront(Engine.for_home(home))

    async def handle(self, request: ops.Request[R]) -> R:
        return await self.front.handle(request)

    async def subscribe_approvals(self, sandbox_id: str, hook: Callable[[ApprovalRequest], object]) -> Cancellable:
        return await self.front.subscribe_approvals(sandbox_id, hook)

    async def close(self) -> None:
        await self.front.close()


__all__ = ["Cancellable", "LocalTransport", "Transport", "default_url"]
