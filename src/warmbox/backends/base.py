"""The Backend protocol: where a sandbox runs. What runs inside is the guest agent's business.

A backend creates the isolation boundary from a typed :class:`SandboxSpec`, starts the guest
agent in it, says where to connect, and destroys it leaving nothing behind. Handles are flat
records the engine persists, so any warmbox process can operate on any sandbox.
"""

from __future__ import annotations

import dataclasses
from typing import Awaitable, Callable, ClassVar, Protocol, TypeVar

from warmbox.models import Limits

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a tier can do; the engine and the tier selector read this, never the tier's name."""

    tier: str
    isolation: str  # one line: what separates the sandbox from the host
    memory_snapshot: bool
    filesystem_snapshot: bool
    custom_kernel: bool
    network_modes: tuple[str, ...]  # of "none", "allowlist", "internet"
    languages: tuple[str, ...]
    start_class: str  # order of magnitude of a cold start, e.g. "10-100ms"
    # every sandbox is restored from its shape's template memory snapshot (a cold boot is too slow)
    snapshot_start: bool = False
    # OOM kills happen in the sandbox's own kernel: the agent reports them with each command's
    # result (Exited.oom_kills), and the host does not read a counter around every call
    oom_counted_in_guest: bool = False
    # a unix socket bound in /workspace (a host directory) is a host socket, which the runtime's
    # memory checkpoint cannot save (gVisor: its Sentry panics and the sandbox dies): the engine
    # refuses such a pause up front, and reports a sandbox lost to a failed checkpoint
    checkpoint_saves_workspace_sockets: bool = True


@dataclasses.dataclass(frozen=True)
class Availability:
    available: bool
    reason: str  # why not (or what was found), in one line


@dataclasses.dataclass(frozen=True)
class SandboxSpec:
    """Everything a backend needs to build one sandbox."""

    sandbox_id: str
    state_dir: str  # host directory owned by this sandbox; removed on destroy
    uid_base: int  # first host uid/gid of the sandbox's private 65536-id range
    envs: tuple[tuple[str, str], ...]
    limits: Limits


@dataclasses.dataclass(frozen=True)
class BackendHandle:
    """Flat, persistable description of a created sandbox."""

    sandbox_id: str
    tier: str
    runtime_id: str
    state_dir: str
    socket_path: str
    uid_base: int


@dataclasses.dataclass(frozen=True)
class ResourceUsage:
    """Counters read from the sandbox's cgroups."""

    oom_kills: int
    memory_bytes: int
    cpu_ns: int


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
