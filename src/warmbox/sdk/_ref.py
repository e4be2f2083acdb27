"""What a sandbox's parts (commands, files, network, pty) need of the sandbox: its id, its transport, _run."""

from __future__ import annotations

from typing import Protocol, TypeVar

from warmbox import operations as ops
from warmbox.sdk.transport import Transport

R = TypeVar("R")


class SandboxRef(Protocol):
    """The sandbox as its parts see it (AsyncSandbox is one): they point at this, not at the class."""

    _transport: Transport

    @property
    def sandbox_id(self) -> str: ...

    async def _run(self, request: ops.Request[R]) -> R:
        """Run one operation on this sandbox's transport (refused once the sandbox was killed here)."""
        ...
