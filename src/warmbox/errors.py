"""Every error warmbox raises. One root, the tree below; foreign errors are translated at the edges.

WarmboxError
├── InvalidArgument (ValueError)        bad input from the caller; nothing was changed
│   ├── InvalidPath                     a sandbox path outside the files API's rules
│   ├── LimitTooHigh                    a limit above the host's capacity or an admin maximum
│   ├── UnsupportedLanguage             a code-context language the sandbox has not (``available``)
│   └── IdempotencyConflict             an idempotency key reused with other arguments (HTTP 409)
├── BackendUnavailable                  the tier cannot run on this host (``reason`` says why)
├── NoSuitableTier                      no tier this host runs meets the requirements (``rejected``: each tier, why not)
├── SandboxError                        something about one sandbox (``sandbox_id``)
│   ├── SandboxNotFound                 unknown id, or the sandbox was destroyed
│   ├── SandboxStateError               operation illegal in the sandbox's current state
│   │   └── SandboxPaused                   the sandbox is paused (and not created to auto-resume)
│   │       └── SecretsRequired                 a resume or fork lacks secret values (``missing``: their names)
│   ├── SandboxLost                     its node died or was fenced (``node``, ``reason``); only kill is allowed
│   ├── SandboxStartError               the backend failed to bring the sandbox up
│   ├── GuestConnectionError            the guest agent cannot be reached / went away
│   ├── GuestProtocolError              the guest sent something outside the protocol
│   ├── SandboxTimeout (TimeoutError)   a wait on the sandbox exceeded its bound
│   ├── CommandFailed                   ``check=True`` and the command exited non-zero
│   ├── FilesError                      a files-API operation failed inside the sandbox
│   │   ├── PathNotFound (FileNotFoundError)
│   │   ├── PathExists (FileExistsError)
│   │   ├── NotADirectory (NotADirectoryError)
│   │   ├── IsADirectory (IsADirectoryError)
│   │   ├── PathPermissionDenied (PermissionError)
│   │   ├── NotARegularFile             a read of a FIFO, device, socket (never opened by the host)
│   │   ├── FileTooLarge                a read past ``max_bytes``: nothing partial is returned
│   │   ├── UnsafeArchive               a tar member outside its directory (absolute, '..', a link out) or a device/FIFO
│   │   └── NoSpace                     ENOSPC/EDQUOT inside the sandbox (disk or tmpfs full)
│   ├── ContextError                    a code context is unknown or died
│   ├── PortNotListening (ConnectionRefusedError)  get_host/a tunnel: nothing listens on that port
│   └── ProcessNotFound (LookupError)   no background process with that pid (commands.connect, ...)
├── RegistryError                       the registry's database (SQLite file or PostgreSQL) failed
│   ├── RegistrySchemaError             its schema is older (``warmbox db migrate``) or newer than this warmbox
│   └── RegistryBusy                    a lock or statement timed out, retried until its budget: nothing was changed
├── ConfigError                         warmbox.toml or a WARMBOX_* override is invalid
├── NetworkError                        egress setup (namespace, link, rules) or the egress proxy failed
├── StorageError                        the object store (snapshot artifacts) failed
│   ├── StorageFull                     no space left where artifacts are written
│   └── ArtifactCorrupt                 an artifact is missing, truncated or fails its checksum
├── SnapshotUnsupported                 the tier cannot take the snapshot asked for (e.g. memory)
│   └── SnapshotRuntimeMismatch         a memory snapshot made by another runtime version (``recorded``, ``runtime``)
├── TemplateError                       a template (``template``: its name; ``step``: the step, if any)
│   ├── TemplateNotFound (LookupError)  no built template of that name (or that version/image)
│   ├── TemplateBuildError              a build step failed (``step``; ``log``: the build log's name)
│   ├── TemplateInUse                   removal refused: a sandbox, pool or snapshot uses it
│   ├── TemplateMismatch                a pool, snapshot or restore recorded another image than the one at hand
│   └── ImageRegistryUnreachable        a FROM image's registry (or its mirror) could not be connected to (``registry``)
├── DockerfileError (InvalidArgument)   an unsupported or malformed instruction (``line``: its number)
├── CorruptLayer (ArtifactCorrupt)      an image layer whose content does not match its digest
├── VolumeError                         a named volume (``volume``: its name)
│   ├── VolumeNotFound (LookupError)    no volume of that name (for this tenant)
│   ├── VolumeInUse                     removal refused: a sandbox mounts it
│   └── VolumeElsewhere                 its disk is on another node (``node``): mount or delete it there
├── Unsupported                         the sandbox's tier cannot do what was asked (``reason`` says why)
├── QuotaExceeded                       a tenant's quota (sandboxes, memory, cpus, tiers) refuses a start
├── ApprovalError                       something about one approval question (``approval_id``)
│   ├── ApprovalDenied                  a step that needed approval was denied, or its question timed out (``state``)
│   ├── ApprovalNotFound (LookupError)  no approval question with that id (for this tenant)
│   └── ApprovalClosed                  the question was answered already (or timed out): one answer each
├── Forbidden                           an admin-only operation asked for by a tenant that is not admin
├── Unauthenticated                     the server refused the key (none, unknown or revoked)
├── RouteNotFound (LookupError)         the server has no such route, or not for that method (HTTP 404/405)
├── RateLimited                         too many requests for the key (``retry_after`` seconds)
├── ConnectionLost                      the connection to the server failed or dropped mid-operation
├── OutcomeUnknown                      a keyed call was accepted but its result was never recorded (``state``)
└── ClusterError                        something about a warmbox cluster (its nodes, placement, routing)
    ├── NoCapacity                      no node can take a create now (``rejected``: each node, why not)
    └── NodeError                       something about one node (``node``: its name)
        ├── NodeNotFound (LookupError)  no node of that name in the cluster's registry
        ├── DrainRefused                a drain of the last node up, or of a node that is down
        ├── NodeFenced                  this node was marked down or joined again: it starts no sandbox
        └── NotACluster                 a cluster operation (a drain) sent to a single host's server
"""

from __future__ import annotations


class WarmboxError(Exception):
    """Root of every warmbox error."""


class InvalidArgument(WarmboxError, ValueError):
    """The caller passed a value warmbox does not accept."""


class InvalidPath(InvalidArgument):
    """A path the files API refuses (empty, NUL byte, '..' component, too long)."""


class LimitTooHigh(InvalidArgument):
    """A resource limit above what this host has or what ``[limits] max_*`` in warmbox.toml allows.

    limit: the Limits field (e.g. ``"memory_mb"``); value: what was asked for; maximum: the most
    allowed, in that field's unit; source: where that maximum comes from (a file, a variable, the host).
    """

    def __init__(
        self, message: str, *, limit: str = "", value: float = 0, maximum: float = 0, source: str = ""
    ) -> None:
        super().__init__(message)
        self.limit = limit
        self.value = value
        self.maximum = maximum
        self.source = source


class UnsupportedLanguage(InvalidArgument):
    """A code-context language this sandbox cannot run: ``language`` as asked, ``available`` the
    ones it can (``Capabilities.context_languages`` of its tier, less what its image lacks)."""

    def __init__(self, message: str, *, language: str = "", available: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.language = language
        self.available = available


class IdempotencyConflict(InvalidArgument):
    """An idempotency key the tenant already used (on this sandbox) for another call: another
    operation, command, code or template. Nothing was run; use a new key for a new call."""


class BackendUnavailable(WarmboxError):
    """A tier that cannot run on this host; ``reason`` is what ``warmbox doctor`` prints."""

    def __init__(self, tier: str, reason: str) -> None:
        super().__init__(f"tier {tier!r} is unavailable: {reason}")
        self.tier = tier
        self.reason = reason


class NoSuitableTier(WarmboxError):
    """``tier="auto"`` / ``choose_tier``: no tier this host can run meets the requirements (never a
    weaker one instead). ``rejected``: one ``"tier: why not"`` per tier."""

    def __init__(self, message: str, rejected: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.rejected = rejected


class SandboxError(WarmboxError):
    def __init__(self, message: str, sandbox_id: str | None = None) -> None:
        super().__init__(message)
        self.sandbox_id = sandbox_id


class SandboxNotFound(SandboxError):
    pass


class SandboxStateError(SandboxError):
    pass


class SandboxPaused(SandboxStateError):
    """The sandbox is paused (by pause(), its idle time or its timeout) and was not created with
    ``Lifecycle(auto_resume=True)``: ``Sandbox.connect(id)`` or ``resume(id)`` runs it again."""


class SandboxLost(SandboxError):
    """The sandbox's node died (or was fenced off the cluster) while it ran: its processes and
    memory are gone. Every operation but kill raises this; kill forgets it. node: the node it
    ran on; reason: why the node was marked down."""

    def __init__(self, message: str, sandbox_id: str | None = None, *, node: str = "", reason: str = "") -> None:
        super().__init__(message, sandbox_id)
        self.node = node
        self.reason = reason


class SecretsRequired(SandboxPaused):
    """A resume (or a fork) of a sandbox that had secrets, without their values: warmbox never
    stores them, so the caller passes them again (``resume(id, secrets={...})``). Nothing was
    done: a paused sandbox stays paused. missing: the env names of the secrets not given."""

    def __init__(self, message: str, sandbox_id: str | None = None, *, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message, sandbox_id)
        self.missing = missing


class SandboxStartError(SandboxError):
    pass


class GuestConnectionError(SandboxError):
    pass


class GuestProtocolError(SandboxError):
    pass


class SandboxTimeout(SandboxError, TimeoutError):
    pass


class CommandFailed(SandboxError):
    def __init__(self, message: str, sandbox_id: str | None, result: object) -> None:
        super().__init__(message, sandbox_id)
        self.result = result


class FilesError(SandboxError):
    pass


class PathNotFound(FilesError, FileNotFoundError):
    pass


class PathExists(FilesError, FileExistsError):
    pass


class NotADirectory(FilesError, NotADirectoryError):
    pass


class IsADirectory(FilesError, IsADirectoryError):
    pass


class PathPermissionDenied(FilesError, PermissionError):
    pass


class NotARegularFile(FilesError):
    """files.read of something that is not a regular file (FIFO, device, socket): refused in the guest."""


class FileTooLarge(FilesError):
    """files.read of a file larger than ``max_bytes``; nothing partial is returned."""


class UnsafeArchive(FilesError):
    """A directory upload or download refused at an archive member that would land outside its
    directory (an absolute name, a '..' component, a symlink or hardlink pointing out) or is a
    device or FIFO; the message names the member. Members before it were extracted."""


class NoSpace(FilesError):
    pass


class ContextError(SandboxError):
    pass


class PortNotListening(SandboxError, ConnectionRefusedError):
    """Nothing listens on the sandbox port a tunnel (``get_host``) was asked to reach."""


class ProcessNotFound(SandboxError, LookupError):
    """No background process with that pid (it never was one, or it ended long ago)."""


class RegistryError(WarmboxError):
    pass


class RegistrySchemaError(RegistryError):
    """A shared (PostgreSQL) registry whose schema version is not this warmbox's: ``found``, the
    registry's; ``expected``, this warmbox's. Older: run ``warmbox db migrate``; newer: upgrade."""

    def __init__(self, message: str, *, found: int, expected: int) -> None:
        super().__init__(message)
        self.found = found
        self.expected = expected


class RegistryBusy(RegistryError):
    """A registry transaction waited past its bound (PostgreSQL's lock_timeout or statement_timeout,
    SQLite's busy timeout) on every try within its retry budget: nothing it would have written was
    committed (HTTP 503: retry later). ``waited_s``: seconds spent, wall clock."""

    def __init__(self, message: str, *, waited_s: float = 0.0) -> None:
        super().__init__(message)
        self.waited_s = waited_s


class ConfigError(WarmboxError):
    """Settings that cannot be used; the message names the file (or variable) and the key."""


class StorageError(WarmboxError):
    """The object store failed; nothing half-written is visible."""


class StorageFull(StorageError):
    pass


class ArtifactCorrupt(StorageError):
    """A snapshot artifact is missing, truncated or does not match its checksum: nothing was restored."""


class Unsupported(WarmboxError):
    """The sandbox's tier cannot do this (e.g. user="root" on the container tier); see Capabilities.

    tier: the tier; reason: why not, in words."""

    def __init__(self, message: str, tier: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.tier = tier
        self.reason = reason


class SnapshotUnsupported(WarmboxError):
    """The sandbox's tier cannot take this kind of snapshot (``capabilities()`` says what it can)."""


class SnapshotRuntimeMismatch(SnapshotUnsupported):
    """A memory snapshot's image was made by another runtime or version than this host's, which
    cannot load it: ``recorded`` is what made it ("runsc 0.0~20221219.0"), ``runtime`` what runs
    here. Its files still restore (a files-only snapshot of them, or a new sandbox)."""

    def __init__(self, message: str, *, recorded: str = "", runtime: str = "") -> None:
        super().__init__(message)
        self.recorded = recorded
        self.runtime = runtime


class TemplateError(WarmboxError):
    """Something about one template: ``template`` is its name, ``step`` the step concerned ("" if none)."""

    def __init__(self, message: str, *, template: str = "", step: str = "") -> None:
        super().__init__(message)
        self.template = template
        self.step = step


class TemplateNotFound(TemplateError, LookupError):
    """No built template of that name (or of that version or image id)."""


class TemplateBuildError(TemplateError):
    """A build step failed; ``step`` names it (index and text), ``log`` is the build log's file
    name in the server's build log directory (``<home>/templates/logs``), not a host path."""

    def __init__(self, message: str, *, template: str = "", step: str = "", log: str = "") -> None:
        super().__init__(message, template=template, step=step)
        self.log = log


class TemplateInUse(TemplateError):
    """Removal refused: a sandbox, pool or snapshot still uses the template (the message says which)."""


class TemplateMismatch(TemplateError):
    """A pool, snapshot or restore recorded another image of the template than the one at hand."""


class ImageRegistryUnreachable(TemplateError):
    """The registry a source image is pulled from (Docker Hub's mirror, if one is set) could not be
    connected to: ``registry`` is its ``host:port``. Nothing was built."""

    def __init__(self, message: str, *, registry: str = "", template: str = "", step: str = "") -> None:
        super().__init__(message, template=template, step=step)
        self.registry = registry


class DockerfileError(InvalidArgument):
    """A Dockerfile instruction warmbox does not support or cannot parse: ``line`` is its number
    (1-based), ``source`` the file."""

    def __init__(self, message: str, *, line: int = 0, source: str = "") -> None:
        super().__init__(message)
        self.line = line
        self.source = source


class CorruptLayer(ArtifactCorrupt):
    """An image layer whose content does not match its digest (``value``: the digest expected)."""

    def __init__(self, message: str, *, value: str = "") -> None:
        super().__init__(message)
        self.value = value


class VolumeError(WarmboxError):
    """Something about one named volume: ``volume`` is its name."""

    def __init__(self, message: str, *, volume: str = "") -> None:
        super().__init__(message)
        self.volume = volume


class VolumeNotFound(VolumeError, LookupError):
    """No volume of that name (for this tenant)."""


class VolumeInUse(VolumeError):
    """Removal refused: a sandbox mounts the volume."""


class VolumeElsewhere(VolumeError):
    """In a cluster, a volume's disk lives on the node that made it (``node``): a sandbox mounting
    it (a create, resume or fork) runs there, and only that node deletes it. Asked of another
    node: refused, nothing done (a router places such a create on ``node``)."""

    def __init__(self, message: str, *, volume: str = "", node: str = "") -> None:
        super().__init__(message, volume=volume)
        self.node = node


class NetworkError(WarmboxError):
    """Giving a sandbox its egress link failed, or the egress proxy could not be started or reached."""


class QuotaExceeded(WarmboxError):
    """A start that would take a tenant past its quota; nothing was created.

    limit: ``"sandboxes"``, ``"memory_mb"``, ``"cpus"`` or ``"tier"``; value: what the tenant would
    have with this start (for ``"tier"``: the tier asked for); maximum: the quota (for ``"tier"``:
    the allowed tiers, comma-separated).
    """

    def __init__(self, message: str, *, limit: str, value: float | str, maximum: float | str) -> None:
        super().__init__(message)
        self.limit = limit
        self.value = value
        self.maximum = maximum


class ApprovalError(WarmboxError):
    """Something about one question of the approval queue: ``approval_id`` is its id."""

    def __init__(self, message: str, *, approval_id: str = "") -> None:
        super().__init__(message)
        self.approval_id = approval_id


class ApprovalDenied(ApprovalError):
    """A step that needs a human's approval (a start over the tenant's budget, a large or
    listed-tier create, a pool resize) was denied, or nobody answered by its deadline; nothing was
    started. state: ``"denied"`` or ``"timed_out"``; reason: why it needed approval."""

    def __init__(self, message: str, *, approval_id: str = "", state: str = "denied", reason: str = "") -> None:
        super().__init__(message, approval_id=approval_id)
        self.state = state
        self.reason = reason


class ApprovalNotFound(ApprovalError, LookupError):
    """No approval question with that id (another tenant's is not found either)."""


class ApprovalClosed(ApprovalError):
    """An answer to a question no longer open: answered already (each is answered exactly once)
    or timed out. state: what it is now."""

    def __init__(self, message: str, *, approval_id: str = "", state: str = "") -> None:
        super().__init__(message, approval_id=approval_id)
        self.state = state


class Forbidden(WarmboxError):
    """An admin-only operation (e.g. snapshot gc) asked for with a key that is not an admin key."""


class Unauthenticated(WarmboxError):
    """The warmbox server refused the request: no key, an unknown or a revoked key (HTTP 401)."""


class RouteNotFound(WarmboxError, LookupError):
    """The server has no route of that path (HTTP 404), or not for that method (HTTP 405): a
    mistyped URL, or a server older than its client. Nothing was done."""


class RateLimited(WarmboxError):
    """Too many requests for this key; ``retry_after`` seconds until the next is accepted (HTTP 429)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ConnectionLost(WarmboxError):
    """The connection to the warmbox server failed or dropped. For an operation that is not safe to
    repeat (a command, a create, a write) the outcome is unknown: the message says which it was."""


class OutcomeUnknown(WarmboxError):
    """A repeat of a keyed call whose first run was accepted (its key recorded before it started)
    but whose result was never recorded: the server process that ran it ended meanwhile. The call
    was not run again. ``state``: what is known ("started"); the message names the sandbox and when."""

    def __init__(self, message: str, *, state: str = "started") -> None:
        super().__init__(message)
        self.state = state


class ClusterError(WarmboxError):
    """Something about a warmbox cluster: its nodes, placement or routing."""


class NoCapacity(ClusterError):
    """A cluster has no node that can take this create now: none is up, runs the tier, or has a free
    slot and the memory (HTTP 503: retry later, or add nodes). Nothing was created. ``rejected``:
    one ``"node: why not"`` per node."""

    def __init__(self, message: str, rejected: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.rejected = rejected


class NodeError(ClusterError):
    """Something about one node of a cluster; ``node``: its name."""

    def __init__(self, message: str, node: str = "") -> None:
        super().__init__(message)
        self.node = node


class NodeNotFound(NodeError, LookupError):
    """No node of that name in the cluster's registry (HTTP 404)."""


class DrainRefused(NodeError):
    """A drain that cannot be done: the node is the last one up (its sandboxes would have nowhere
    to go), or it is already down (HTTP 409). Nothing was changed."""


class NodeFenced(NodeError):
    """This node was marked down (or its name joined again under a newer epoch) while this
    process still ran: it starts no sandbox (create, pool refill, claim, resume) (HTTP 503: the
    cluster places it on another node). Nothing was changed; the node process exits at its next
    heartbeat."""


class NotACluster(NodeError):
    """A cluster operation (draining a node) sent to a server that is not a cluster's API tier
    (``warmbox serve --cluster``) (HTTP 422)."""
