"""The Backend protocol: where a sandbox runs. What runs inside is the guest agent's business.

A backend creates the isolation boundary from a typed :class:`SandboxSpec`, starts the guest
agent in it, says where to connect, and destroys it leaving nothing behind. Handles are flat
records the engine persists, so any warmbox process can operate on any sandbox.
"""

from __future__ import annotations

from typing import Awaitable, Callable, ClassVar, Protocol, TypeVar

from warmbox.models import (Availability, BackendHandle, Capabilities, ResourceUsage,  # noqa: F401 - re-exported
                            SandboxSpec)

T = TypeVar("T")


class Backend(Protocol):
    tier: ClassVar[str]
    # files in a sandbox's state dir whose tails ``warmbox logs`` shows (kept after destroy)
    runtime_logs: ClassVar[tuple[str, ...]]

    def capabilities(self) -> Capabilities: ...

    def probe(self) -> Availability:
        """Can this host run the tier? Cheap; no sandbox is started."""
        ...

    async def create(self, spec: SandboxSpec) -> BackendHandle:
        """Build the sandbox's filesystem and runtime configuration (stage ``filesystem``)."""
        ...

    async def start(self, handle: BackendHandle, ready: Callable[[], Awaitable[T]]) -> T:
        """Start the guest agent (stage ``runtime``).

        ``ready`` (typically: connect and ping the agent at ``handle.socket_path``) is run as
        soon as the socket accepts connections, concurrently with the runtime's own start; its
        result is returned once both succeeded. A runtime failure wins over ready's error.
        """
        ...

    async def usage(self, handle: BackendHandle) -> ResourceUsage: ...

    async def oom_kills(self, handle: BackendHandle) -> int:
        """Just the OOM-kill counter of ``usage`` (read before and after every command: cheap)."""
        ...

    async def alive(self, handle: BackendHandle) -> bool: ...

    def netns_path(self, handle: BackendHandle) -> str:
        """Path of the running sandbox's network namespace (tiers with a network mode besides "none")."""
        ...

    async def destroy(self, handle: BackendHandle) -> None:
        """Stop everything and remove every trace (processes, cgroups, runtime state, dirs).

        Idempotent: destroying a half-created or already destroyed sandbox succeeds.
        """
        ...
