"""The Backend protocol: where a sandbox runs. What runs inside is the guest agent's business.

A backend creates the isolation boundary from a typed :class:`SandboxSpec`, starts the guest
agent in it, says where to connect, and destroys it leaving nothing behind. Handles are flat
records the engine persists, so any warmbox process can operate on any sandbox.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar, runtime_checkable

from warmbox.models import Availability, BackendHandle, Capabilities, ImageRef, ResourceUsage, SandboxSpec

if TYPE_CHECKING:
    from warmbox.config import Settings

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


# ---- optional capabilities: declared here, implemented by a tier, checked by the engine with isinstance


@runtime_checkable
class Configurable(Protocol):
    """A tier that reads warmbox.toml (the engine calls ``configure`` once, when it loads the tier)."""

    def configure(self, settings: Settings) -> None: ...


@runtime_checkable
class SnapshotCapable(Protocol):
    """A tier with memory snapshots (``Capabilities.memory_snapshot``): checkpoint a running
    sandbox's processes and memory, and continue them in a new sandbox."""

    async def checkpoint(self, handle: BackendHandle, image_dir: Path) -> Path:
        """Write the runtime's image into ``image_dir``; the runtime stops with it. Returns the image."""
        ...

    async def restore(self, handle: BackendHandle, image_dir: Path, ready: Callable[[], Awaitable[T]]) -> T:
        """Continue the image in ``image_dir`` in the created (not started) sandbox ``handle``;
        ``ready`` as in :meth:`Backend.start`."""
        ...

    async def resume_listening(self, handle: BackendHandle) -> None:
        """Tell a quiesced agent (one whose checkpoint did not happen) to listen again."""
        ...


@runtime_checkable
class TemplateCapable(Protocol):
    """A tier whose template snapshots are tied to its machine: ``template_fingerprint`` is part of
    the template's key (a changed image or machine makes a new template instead of a failing
    restore), and ``template_warmup`` commands run in a template sandbox before it is saved and in
    every pooled copy before it is handed out (their files are then in the guest's page cache)."""

    template_warmup: ClassVar[tuple[tuple[str, ...], ...]]

    def template_fingerprint(self, image: ImageRef | None = None) -> str:
        """The key part of a template snapshot of sandboxes running ``image`` (None: the tier's
        built-in image)."""
        ...


@runtime_checkable
class Diagnosable(Protocol):
    """A tier whose ``warmbox doctor`` line needs more than ``probe`` (which stays cheap and starts
    nothing): e.g. gVisor runs runsc once to learn its version and which platform works."""

    def diagnose(self) -> Availability:
        """``probe()``'s answer with what only starting the runtime tells."""
        ...


@runtime_checkable
class RuntimeVersioned(Protocol):
    """A tier whose memory images load only into the runtime version that made them (gVisor: a
    runsc image holds the Sentry's own state, in that version's format)."""

    # what made the memory images recorded before versions were (schema < 18)
    legacy_runtime: ClassVar[str]

    def runtime_version(self) -> str:
        """This host's runtime and version as a snapshot records it ("runsc 0.0~20240729.0")."""
        ...


@runtime_checkable
class SharedHost(Protocol):
    """A tier whose sandboxes live in long-running host processes under the runtime dir (the
    isolate tier's jailed V8 host, one per tenant). The engine stops them once no sandbox of the
    tier is left (``warmbox down``, the daemon's idle exit); the next sandbox starts one again."""

    def stop_host(self) -> None:
        """End every host process and everything in them; remove their runtime state (idempotent)."""
        ...

    def tend_hosts(self, handles: Sequence[BackendHandle]) -> list[str]:
        """Given the tier's live sandboxes of this runtime dir (ready, running, pooled): the ids of
        those whose host process has ended (the engine marks them lost), after ending the hosts
        that held none of them for a while. Cheap: the reaper calls it every tick."""
        ...


class UidSlots(Protocol):
    """The host-wide uid ledger, for a tier's own host processes (no sandbox row holds them)."""

    def claim(self, holder: str) -> int:
        """The first host uid of a free 65536-uid range, recorded as ``holder``'s."""
        ...

    def release(self, holder: str, uid_base: int) -> None:
        """Give the range back, if (and only if) the ledger still records it as ``holder``'s."""
        ...

    def forget_gone(self, holder: str) -> bool:
        """Give back the ranges recorded as ``holder``'s by a home that is gone (nothing runs in
        them); True when none of ``holder``'s is left."""
        ...


@runtime_checkable
class HostUids(Protocol):
    """A tier that runs host processes of its own (the isolate tier's tenant hosts): the engine
    hands it the ledger when it loads the tier, so those run as uid ranges no one else has, and
    its WARMBOX_HOME, so they end with it."""

    def use_home(self, home: Path, slots: UidSlots) -> None: ...


@runtime_checkable
class Inventory(Protocol):
    """A tier whose runtime keeps its own record of each sandbox under the runtime dir (runc's and
    runsc's state directories), which can outlive the sandbox's state directory (a teardown cut
    short). A node's reconcile reads it so no such sandbox is left behind."""

    def held(self) -> set[str]:
        """Ids of the sandboxes the runtime has a record of under this runtime dir."""
        ...
