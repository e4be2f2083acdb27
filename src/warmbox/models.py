"""Flat, typed records shared by the SDK, engine, CLI and backends."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import reprlib
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from warmbox.errors import InvalidArgument

_T = TypeVar("_T")
_FIELDS: dict[type, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {}


def _record_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """A record's (repr, compare, hash) field names, as dataclasses picks them; cached per class."""
    got = _FIELDS.get(cls)
    if got is None:
        fs = dataclasses.fields(cls)
        got = _FIELDS[cls] = (
            tuple(f.name for f in fs if f.repr),
            tuple(f.name for f in fs if f.compare),
            tuple(f.name for f in fs if (f.compare if f.hash is None else f.hash)),
        )
    return got


@reprlib.recursive_repr()
def _record_repr(self: Any) -> str:
    names = _record_fields(type(self))[0]
    return f"{type(self).__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"


def _record_eq(self: Any, other: object) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented  # type: ignore[no-any-return]  # as a dataclass does
    names = _record_fields(type(self))[1]
    return bool(tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names))


def _record_hash(self: Any) -> int:
    return hash(tuple(getattr(self, n) for n in _record_fields(type(self))[2]))


def _record_setattr(self: Any, name: str, value: object) -> None:
    if name in self.__dict__:  # __init__ sets each field once; nothing sets one again
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
    object.__setattr__(self, name, value)


def _record_delattr(self: Any, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


def _record(cls: type[_T]) -> type[_T]:
    """A frozen dataclass, cheap to build: dataclasses generates (and compiles) only ``__init__``;
    repr, ==, hash and the refusal of assignments are the same five functions for every record.
    ``@dataclass(frozen=True)`` compiles six functions per class, and the ~120 records of this
    module and warmbox.operations made it ~100 ms of every ``import warmbox`` (issue 38).
    Differences from frozen=True: none observable through fields, repr, ==, hash, replace,
    asdict; an attribute that is not a field may be set once (frozen=True refuses it)."""
    cls = dataclasses.dataclass(repr=False, eq=False)(cls)
    for name, fn in (
        ("__repr__", _record_repr),
        ("__eq__", _record_eq),
        ("__hash__", _record_hash),
        ("__setattr__", _record_setattr),
        ("__delattr__", _record_delattr),
    ):
        if name not in cls.__dict__:
            setattr(cls, name, fn)
    return cls


if TYPE_CHECKING:  # what the checker sees: a frozen dataclass
    from typing_extensions import dataclass_transform

    @dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, dataclasses.Field))
    def record(cls: type[_T]) -> type[_T]: ...
else:
    record = _record


def _positive(name: str, value: float, *, integer: bool = False, minimum: float = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise InvalidArgument(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value) or value <= minimum:
        raise InvalidArgument(f"{name} must be > {minimum}, got {value!r}")


@record
class Limits:
    """Resource limits of one sandbox, enforced by cgroups and rlimits.

    memory_mb: memory cgroup limit in MiB (no swap); tmpfs contents count against it.
    cpus: CPU quota in cores (1.5 = 150 ms of CPU per 100 ms).
    pids: maximum number of processes and threads.
    file_size_mb: largest file a process may write (RLIMIT_FSIZE), MiB.
    open_files: open file descriptors per process (RLIMIT_NOFILE).
    tmp_mb: size of the /tmp and /home/user tmpfs mounts, MiB each; at most memory_mb (tmpfs
        pages are charged to the sandbox's memory). Default: 256, or memory_mb when that is less.
        The container and gVisor tiers cap both mounts (and /dev/shm) further so that, full, they
        leave a quarter of memory_mb (at least 96 MiB) to the processes: a writer gets ENOSPC
        instead of the OOM killer taking the guest agent (512 MiB -> 160 MiB each).
    disk_mb: size of /workspace, MiB: its own filesystem (a sparse image on the host, a virtual
        disk in a microVM), so a writer gets ENOSPC there, and the host disk never gives the
        sandbox more than this. The host pays only for what is written. Default: 10 GiB — room
        for a cloned repository with its virtualenv or node_modules and a build; a sandbox is
        also refused when the disk holding the sandboxes has less than this free (beyond a
        reserve of 2 % of it, at least 1 GiB). Its filesystem's own metadata takes a little
        (64 MiB: ~58 MiB usable; 10 GiB: ~1.5 %).

    Each is also bounded by the host (memory, CPUs, pids, ...) and by ``[limits] max_*`` in
    warmbox.toml: a sandbox asking for more is refused with LimitTooHigh before it is created.
    """

    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 256
    file_size_mb: int = 1024
    open_files: int = 1024
    tmp_mb: int = None  # type: ignore[assignment]  # None: min(256, memory_mb)
    disk_mb: int = 10240

    def __post_init__(self) -> None:
        if self.tmp_mb is None:
            object.__setattr__(
                self,
                "tmp_mb",
                min(256, self.memory_mb)
                if isinstance(self.memory_mb, int) and not isinstance(self.memory_mb, bool)
                else 256,
            )
        _positive("limits.memory_mb", self.memory_mb, integer=True, minimum=15)
        _positive("limits.cpus", self.cpus, minimum=0.009)
        _positive("limits.pids", self.pids, integer=True, minimum=7)
        _positive("limits.file_size_mb", self.file_size_mb, integer=True)
        _positive("limits.open_files", self.open_files, integer=True, minimum=15)
        _positive("limits.tmp_mb", self.tmp_mb, integer=True)
        _positive("limits.disk_mb", self.disk_mb, integer=True, minimum=15)


class State(str, enum.Enum):
    """Lifecycle states of a sandbox (see warmbox.lifecycle for the legal operations)."""

    CREATING = "creating"
    POOLED = "pooled"  # warmed up, waiting in a pool; nobody may connect until it is claimed
    RETIRING = "retiring"  # leaving its pool unused (shrink, stale shape, shutdown): being destroyed
    READY = "ready"
    PAUSED = "paused"  # snapshotted, every resource released; resume() brings it back
    RUNNING = "running"
    DESTROYED = "destroyed"
    FAILED = "failed"
    LOST = "lost"  # its node died (or was fenced): every operation but kill raises SandboxLost


NODE_STATES = ("up", "draining", "down")


@record
class NodeInfo:
    """One node of a cluster, as the registry's ``nodes`` table holds it.

    name: the node's name (``[cluster] node``); address: its API server (URL or host:port);
    ray_node_id: its raylet's node id ("" if unknown); epoch: bumped at every join and every
    mark-down (a heartbeat with an older epoch is fenced); state: one of NODE_STATES; slots:
    sandboxes it offers; memory_mb: memory it offers; tiers: the tiers it runs; joined_at,
    heartbeat_at: unix seconds; pooled, live: its pooled and live (not pooled) sandboxes at its
    last heartbeat.
    """

    name: str
    address: str = ""
    ray_node_id: str = ""
    epoch: int = 0
    state: str = "up"
    slots: int = 0
    memory_mb: int = 0
    tiers: tuple[str, ...] = ()
    joined_at: float = 0.0
    heartbeat_at: float = 0.0
    pooled: int = 0
    live: int = 0


@record
class NodeUsage:
    """What one node holds now, from the registry's rows (placement reads it).

    live: its creating, retiring, ready and running sandboxes; memory_mb: their memory limits
    summed; pooled: (pool name, ready pooled sandboxes) per pool; pooled_memory_mb: the memory
    limits of those pooled sandboxes summed (they hold it as much as a user's).
    """

    node: str
    live: int = 0
    memory_mb: int = 0
    pooled: tuple[tuple[str, int], ...] = ()
    pooled_memory_mb: int = 0


STAGES = ("allocation", "filesystem", "runtime", "dependencies", "network", "first_command")


@record
class StageTiming:
    """One stage of one sandbox start, in milliseconds.

    stage: one of STAGES. ``allocation`` is a pool claim on a hit, the registry insert when
    cold. on_request_path: False for the stages a pool did before anyone asked (a pooled
    sandbox's filesystem, runtime and dependencies), True for what the caller waited for.
    """

    sandbox_id: str
    stage: str
    duration_ms: float
    on_request_path: bool = True


@record
class Transition:
    """One state change of one sandbox; the registry keeps them all, in order."""

    sandbox_id: str
    at: float  # unix seconds
    from_state: str
    to_state: str
    reason: str


@record
class SandboxInfo:
    """What the registry knows about one sandbox."""

    sandbox_id: str
    tier: str
    state: State
    created_at: float  # unix seconds
    expires_at: float  # unix seconds
    memory_mb: int
    cpus: float
    pids: int
    template: str
    pool: str = ""  # the pool it came from ("" when created cold)
    claimed_at: float = 0.0  # unix seconds it was handed out of the pool (0 when cold)
    parent_snapshot: str = ""  # the snapshot it was restored or forked from ("" when created)
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)  # given at create (E2B's metadata)
    lifecycle: Lifecycle = dataclasses.field(default_factory=lambda: Lifecycle())  # given at create
    # the template version it runs (0: a built-in template) and that version's image
    # (``sha256:<hex>``; "" for a sandbox from before templates were versioned)
    template_version: int = 0
    image_id: str = ""
    # tier="auto": what was asked (the four questions), why this tier, and why not each other one
    # (None / empty when the caller named the tier)
    requirements: Requirements | None = None
    tier_reasons: tuple[str, ...] = ()
    tier_rejected: dict[str, str] = dataclasses.field(default_factory=dict)
    tenant: str = ""  # whose it is ("": created without a key, by the host's root)

    @property
    def from_pool(self) -> bool:
        return bool(self.pool)


MAX_IDLE_PAUSE_AFTER_S = 7 * 24 * 3600.0


@record
class Lifecycle:
    """What happens to a sandbox nobody uses (E2B's auto-pause), given at create.

    on_timeout: "kill" (default) destroys it when its timeout runs out; "pause" pauses it instead
        (a snapshot in the object store; nothing runs, nothing is held), kept for ``[lifecycle]
        paused_retention`` seconds of warmbox.toml, then deleted with its snapshots.
    idle_pause_after: seconds without an SDK operation on it (commands, code, files, ports,
        connect: engine/front.py's ``USE``) after which the daemon pauses it; None: never.
    auto_resume: the next such operation on the paused sandbox resumes it first, transparently
        (its timings gain ``resume``); False: those operations raise ``SandboxPaused``.
        ``connect`` and ``resume`` resume a paused sandbox either way.
    """

    on_timeout: Literal["kill", "pause"] = "kill"
    idle_pause_after: float | None = None
    auto_resume: bool = False

    @property
    def pauses(self) -> bool:
        """Whether anything but an explicit pause() can pause the sandbox."""
        return self.on_timeout == "pause" or self.idle_pause_after is not None


def validate_lifecycle(lifecycle: object) -> Lifecycle:
    """A create's lifecycle (None: the default, kill on timeout), checked (InvalidArgument)."""
    if lifecycle is None:
        return Lifecycle()
    if not isinstance(lifecycle, Lifecycle):
        raise InvalidArgument(f"lifecycle must be a warmbox.Lifecycle, got {type(lifecycle).__name__}")
    if lifecycle.on_timeout not in ("kill", "pause"):
        raise InvalidArgument(f"lifecycle.on_timeout must be 'kill' or 'pause', got {lifecycle.on_timeout!r}")
    idle = lifecycle.idle_pause_after
    if idle is not None:
        _positive("lifecycle.idle_pause_after", idle)
        if idle > MAX_IDLE_PAUSE_AFTER_S:
            raise InvalidArgument(
                f"lifecycle.idle_pause_after must be at most {MAX_IDLE_PAUSE_AFTER_S:.0f} seconds "
                f"(or None), got {idle!r}"
            )
    if not isinstance(lifecycle.auto_resume, bool):
        raise InvalidArgument(f"lifecycle.auto_resume must be True or False, got {lifecycle.auto_resume!r}")
    return lifecycle


MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY = 256  # characters
MAX_METADATA_VALUE = 2048  # characters
MAX_METADATA_BYTES = 16 << 10  # all keys and values, UTF-8


@record
class SandboxQuery:
    """Which sandboxes ``Sandbox.list`` returns (E2B's ``SandboxQuery``; a plain dict with these
    keys is taken too).

    metadata: only sandboxes whose metadata holds every one of these key/value pairs.
    state: only sandboxes in one of these states (default: running and paused ones, not ended
    ones). ``running`` matches ready sandboxes too: E2B's running is "alive", whether or not a
    command runs at this moment.
    """

    metadata: dict[str, str] | None = None
    state: tuple[State, ...] | None = None


DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 24 * 3600.0
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def validate_timeout(timeout: object, name: str = "timeout") -> float:
    """A timeout in seconds: a finite number > 0 and <= MAX_TIMEOUT_S (InvalidArgument naming ``name``)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout):
        raise InvalidArgument(f"{name} must be a number of seconds, got {timeout!r}")
    if timeout <= 0 or timeout > MAX_TIMEOUT_S:
        raise InvalidArgument(f"{name} must be > 0 and <= {MAX_TIMEOUT_S:.0f} seconds, got {timeout!r}")
    return float(timeout)


def validate_envs(envs: object) -> tuple[tuple[str, str], ...]:
    """Environment variables (None: none) as (name, value) pairs: shell-style names, values without NUL."""
    if envs is None:
        return ()
    if not isinstance(envs, dict):
        raise InvalidArgument(f"envs must be a dict of str to str, got {type(envs).__name__}")
    out = []
    for k, v in envs.items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise InvalidArgument(f"environment variable name {k!r} is not valid")
        if not isinstance(v, str) or "\0" in v:
            raise InvalidArgument(f"environment variable {k} must be a string without NUL bytes")
        out.append((k, v))
    return tuple(out)


def validate_metadata(metadata: object) -> dict[str, str]:
    """Sandbox metadata: a dict of string keys to string values, bounded (InvalidArgument otherwise)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise InvalidArgument(f"metadata must be a dict of str to str, got {type(metadata).__name__}")
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise InvalidArgument(f"metadata holds at most {MAX_METADATA_ENTRIES} entries, got {len(metadata)}")
    size = 0
    for k, v in metadata.items():
        if not isinstance(k, str) or not k or len(k) > MAX_METADATA_KEY or "\0" in k:
            raise InvalidArgument(
                f"metadata key {k!r} must be a non-empty string of at most {MAX_METADATA_KEY} characters"
            )
        if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE or "\0" in v:
            raise InvalidArgument(
                f"metadata[{k!r}] must be a string of at most {MAX_METADATA_VALUE} characters, got "
                f"{type(v).__name__ if not isinstance(v, str) else f'{len(v)} characters'}"
            )
        size += len(k.encode("utf-8", "surrogatepass")) + len(v.encode("utf-8", "surrogatepass"))
    if size > MAX_METADATA_BYTES:
        raise InvalidArgument(f"metadata is {size} bytes: at most {MAX_METADATA_BYTES} (keys and values, UTF-8)")
    return dict(metadata)


def validate_query(query: object) -> SandboxQuery:
    """A list query, checked (states as State, "running" widened to ready too); the SDK makes
    E2B's plain dict into a SandboxQuery first."""
    if query is None:
        return SandboxQuery()
    if not isinstance(query, SandboxQuery):
        raise InvalidArgument(f"query must be a warmbox.SandboxQuery or a dict, got {type(query).__name__}")
    states = query.state
    if states is not None:
        if isinstance(states, (str, State)):
            states = (states,)
        if not isinstance(states, (list, tuple)):
            raise InvalidArgument(f"query state must be a list of states, got {type(states).__name__}")
        try:
            states = tuple(State(s) for s in states)
        except ValueError:
            raise InvalidArgument(
                f"query state must hold states ({', '.join(s.value for s in State)}), got {list(query.state or ())!r}"
            ) from None
        if State.RUNNING in states and State.READY not in states:
            states = (*states, State.READY)  # E2B's running: alive, whether or not a command runs
    return SandboxQuery(metadata=validate_metadata(query.metadata) or None, state=states)


@record
class CommandResult:
    """Outcome of one command. Never silently partial: every flag is explicit.

    exit_code: the process's exit status, or 128+N when killed by signal N.
    signal: the signal that ended the process, 0 if it exited.
    timed_out: the command's timeout fired and its process tree was killed.
    truncated: output passed ``max_output`` bytes; the rest was discarded.
    oom_killed: the kernel's OOM killer killed a process of the sandbox during the command.
    duration_ms: wall-clock time inside the guest.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    oom_killed: bool
    signal: int
    duration_ms: float
    pid: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed


MAX_COMMAND_TEXT = 4096  # bytes of a command's or cell's text kept in its CommandRecord (UTF-8)
COMMAND_KINDS = ("command", "code", "process")


@record
class CommandRecord:
    """One command or code run of a sandbox, as the registry keeps it (``CommandStore.commands``).

    Never its environment (it may hold secrets) and never its output: byte counts and outcome only.
    kind: "command" (``commands.run``, foreground), "code" (``run_code``), "process" (a background
    process, recorded when a client followed it to its end through the front that started it).
    text: the command line (an argv list shell-quoted) or the cell's code, cut to MAX_COMMAND_TEXT
    UTF-8 bytes (``text_truncated``). It is the caller's input: hostile to a browser showing it.
    language: a cell's ("python", "javascript", "bash"); "" for commands.
    started_at: unix seconds. duration_ms: the guest's measure (the host's wall clock if the call
    failed before a result). exit_code: None for a cell, or when no exit was seen (an error).
    error: "" if the call returned; a cell's exception name ("ZeroDivisionError"); for a call that
    raised, the warmbox error's class name ("SandboxTimeout", "GuestConnectionError").
    stdout_bytes / stderr_bytes: UTF-8 bytes of the output returned (after any truncation).
    seq: 1, 2, ... within the sandbox, in the order the records were written.
    """

    sandbox_id: str
    seq: int
    kind: str
    text: str
    text_truncated: bool
    language: str
    started_at: float
    duration_ms: float
    exit_code: int | None
    error: str
    timed_out: bool
    truncated: bool
    oom_killed: bool
    stdout_bytes: int
    stderr_bytes: int


@record
class Result:
    """One output of a code run (a displayed object, a chart, the last expression's value), in
    every representation the object offered: E2B's ``Result``.

    Images and PDF are base64 strings (``base64.b64decode(r.png)`` gives the PNG file); ``json``
    is JSON text; the others are text. ``is_main_result``: the value of the cell's last expression.
    """

    is_main_result: bool
    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: str | None = None
    jpeg: str | None = None
    pdf: str | None = None
    latex: str | None = None
    json: str | None = None
    javascript: str | None = None

    def formats(self) -> list[str]:
        """The representations present besides ``text``, in E2B's order (e.g. ``["html"]``)."""
        present = (
            ("html", self.html),
            ("markdown", self.markdown),
            ("svg", self.svg),
            ("png", self.png),
            ("jpeg", self.jpeg),
            ("pdf", self.pdf),
            ("latex", self.latex),
            ("json", self.json),
            ("javascript", self.javascript),
        )
        return [name for name, value in present if value is not None]


@record
class Logs:
    """A run's output as E2B's ``Logs``: one entry per line (its newline kept), stdout and stderr."""

    stdout: list[str]
    stderr: list[str]


@record
class CodeContext:
    """A code interpreter whose state persists between ``run_code`` calls: its id, its language,
    its working directory ("" where the tier has none: the isolate tier)."""

    id: str
    language: str
    cwd: str


@record
class ExecutionError:
    """An exception raised by user code in a code context."""

    name: str
    value: str
    traceback: str


@record
class Execution:
    """Outcome of ``run_code``: ``text`` is the last expression's value as text (None if none)."""

    results: tuple[Result, ...]
    stdout: str
    stderr: str
    error: ExecutionError | None
    timed_out: bool
    truncated: bool
    oom_killed: bool
    execution_count: int
    duration_ms: float

    @property
    def text(self) -> str | None:
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None

    @property
    def logs(self) -> Logs:
        """stdout and stderr as lists of lines (E2B's ``execution.logs``)."""
        return Logs(self.stdout.splitlines(keepends=True), self.stderr.splitlines(keepends=True))


@record
class EntryInfo:
    """One file-system entry inside a sandbox."""

    name: str
    path: str
    type: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int
    modified: float  # unix seconds
    symlink_target: str | None


class FilesystemEventType(str, enum.Enum):
    """What happened to an entry below a watched directory (E2B's names)."""

    CREATE = "create"  # made, or moved in
    WRITE = "write"
    REMOVE = "remove"
    RENAME = "rename"  # moved away (a new name inside the watched tree is a CREATE)
    CHMOD = "chmod"  # mode, owner or times changed


@record
class FilesystemEvent:
    """One change seen by ``files.watch_dir``: ``name`` relative to the watched directory ("sub/f")."""

    name: str
    type: FilesystemEventType


@record
class WriteEntry:
    """One file of ``files.write_files``: its path in the sandbox and its contents (text is UTF-8)."""

    path: str
    data: str | bytes


@record
class ProcessInfo:
    """A running background process (``commands.list()``), E2B's shape.

    pid: its id for connect/kill/send_stdin; cmd and args: what was started (a shell string runs
    as ``/bin/bash -c <string>``); envs: the variables the caller gave; tag: the caller's label
    ("" when none); pty: a terminal (``sandbox.pty``) rather than a command.
    """

    pid: int
    cmd: str
    args: tuple[str, ...]
    envs: dict[str, str]
    cwd: str
    tag: str = ""
    pty: bool = False


@record
class ProcessEvent:
    """One piece of a background process's output, in order: ``kind`` "stdout" or "stderr" (``text``),
    "pty" (a terminal's raw bytes in ``data``), or "lost" (``size`` bytes were dropped before what
    follows: the agent keeps a bounded ring of each process's output and nobody read them in time)."""

    kind: str
    text: str = ""
    data: bytes = b""
    size: int = 0


@record
class TierStatus:
    """What ``warmbox doctor`` reports for one tier."""

    tier: str
    available: bool
    reason: str


@record
class MetricSample:
    """One reading of a sandbox's metrics history (``get_metrics``; E2B's ``get_metrics`` samples).

    timestamp: when it was read, epoch seconds. cpu_used_pct: CPU time since the reading before
    it over that time, in percent of its CPUs (0-100). cpu_count: its CPUs (rounded up to 1).
    memory_bytes / memory_total_bytes: memory in use then / its memory limit."""

    timestamp: float
    cpu_used_pct: float
    cpu_count: int
    memory_bytes: int
    memory_total_bytes: int


@record
class SandboxMetrics:
    """Cost of one sandbox for its user (a pooled sandbox's warm-up is the pool's, not here).

    cpu_s: CPU time of every process in the sandbox (cgroup cpuacct), seconds.
    memory_gib_s: memory in use integrated over time (sampled), GiB x seconds.
    wall_s: seconds since it was created (or handed out of a pool) until now or its end.
    busy_s / idle_s: of wall_s, seconds with at least one command or code run in progress / none.
    memory_bytes / memory_peak_bytes: now (0 once ended) / highest sampled.
    commands: commands and code runs recorded for it (what ``commands()`` lists; a pool's warm-up
    is not among them).
    final: True once the sandbox ended and these numbers are frozen in the registry.
    """

    sandbox_id: str
    cpu_s: float
    memory_gib_s: float
    wall_s: float
    busy_s: float
    idle_s: float
    memory_bytes: int
    memory_peak_bytes: int
    commands: int
    final: bool


@record
class PoolStatus:
    """One pool as ``warmbox pool ls`` shows it; costs are what warming its sandboxes took."""

    name: str
    tier: str
    template: str
    min: int
    max: int
    target: int
    ready: int  # pooled sandboxes waiting
    warming: int  # being created or warmed up now
    hits: int
    misses: int
    warmup_failures: int
    last_error: str
    cost_cpu_s: float
    cost_memory_gib_s: float
    cost_wall_s: float


@record
class PoolEvent:
    """Something that happened to a pool: hit, miss, warmed, warmup_failed, retired, resized, scaled."""

    pool: str
    at: float  # unix seconds
    kind: str
    sandbox_id: str
    detail: str


@record
class SnapshotRef:
    """A snapshot as the SDK hands it out; pass it (or its id) to resume() or create(from_snapshot=)."""

    snapshot_id: str
    sandbox_id: str
    created_at: float
    tier: str
    template: str
    memory: bool  # False: files + code-context state only (the tier cannot snapshot memory)
    size_bytes: int
    context_skipped: tuple[str, ...]  # context variables that could not be saved
    context_saved: bool = True  # the default context's variables are in it
    files_raw_bytes: int = 0  # the files' size before compression
    files_bytes: int = 0  # the files as stored


@record
class SnapshotRecord:
    """A snapshot as the registry keeps it: ``create(from_snapshot=snapshot_id)`` starts a new
    sandbox from it (a replay from that checkpoint) while it exists. auto: made by an automatic
    pause (idle or timeout), deleted with its sandbox."""

    snapshot_id: str
    sandbox_id: str
    created_at: float  # unix seconds
    size_bytes: int
    auto: bool = False


@record
class Tenant:
    """Who a request is from: a tenant's name and quotas, and the API key it came with.

    Quotas count the tenant's live sandboxes (creating, ready, running; a paused one holds no
    memory or CPU and does not count). 0 means unlimited. tiers: the tiers it may use (empty:
    every tier). rate_per_s: requests per second per key (the server enforces it). admin and
    key_id are the key's: an admin key may run admin-only operations (snapshot gc).
    budget_cpu_h, budget_gib_h: what its sandboxes may use per UTC day (CPU-hours, GiB-hours of
    memory; 0: no budget); a start that would go past it waits for an operator's approval.
    """

    name: str
    admin: bool = False
    max_sandboxes: int = 0
    max_memory_mb: int = 0
    max_cpus: float = 0.0
    tiers: tuple[str, ...] = ()
    rate_per_s: float = 0.0
    key_id: str = ""
    budget_cpu_h: float = 0.0
    budget_gib_h: float = 0.0


@record
class KeyInfo:
    """One API key as ``warmbox keys ls`` shows it (never its secret), with its tenant's quotas."""

    key_id: str
    tenant: str
    created_at: float  # unix seconds
    revoked_at: float  # unix seconds; 0 while the key is live
    admin: bool
    max_sandboxes: int = 0
    max_memory_mb: int = 0
    max_cpus: float = 0.0
    tiers: tuple[str, ...] = ()
    rate_per_s: float = 0.0
    budget_cpu_h: float = 0.0  # per UTC day; 0: no budget
    budget_gib_h: float = 0.0


@record
class UsageBucket:
    """What one tenant's sandboxes used in one UTC hour (the meters' readings, as they came in).

    tenant: "" for the host's own sandboxes and for warm pools before a claim (the pools' cost).
    hour: unix seconds of the hour's start. cpu_s: CPU-seconds; gib_s: GiB-seconds of memory."""

    tenant: str
    hour: float
    cpu_s: float
    gib_s: float


@record
class BudgetStatus:
    """A tenant's use today (since UTC midnight, ``day``) against its daily budget.

    A limit of 0 is no budget (its ratio is 0). ratio = used / limit. warning: some ratio is at or
    past ``[approvals] warn_ratio`` (0.8); exceeded: some ratio is at or past 1."""

    tenant: str
    day: float  # unix seconds of the UTC day's start
    cpu_used_h: float
    cpu_limit_h: float
    cpu_ratio: float
    gib_used_h: float
    gib_limit_h: float
    gib_ratio: float
    warning: bool
    exceeded: bool


APPROVAL_KINDS = ("create", "resume", "pool_resize", "network")
APPROVAL_STATES = ("pending", "approved", "denied", "timed_out")
COST_DECISIONS = ("approve", "deny")  # the answers to a create, resume or pool_resize question
NETWORK_DECISIONS = ("allow_once", "allow_always", "deny")  # the answers to a network question


@record
class Approval:
    """A question for a human, in the approval queue (the registry's row is the truth).

    kind: what waits — "create", "resume", "pool_resize" or "network" (an egress destination
    outside the sandbox's allowlist, its policy on_unknown="ask"). subject: what is asked for, in
    words (sandbox text is the sandbox's: escape it when shown). reason: why it needs approval.
    deadline: unix seconds; unanswered by then it is "timed_out" (the waiter is refused).
    decision: COST_DECISIONS or NETWORK_DECISIONS by kind ("" while pending or timed out).
    answered_by: the key id that answered, "root" (the host), "webhook"; "" when it timed out,
    "withdrawn" when its waiter gave up first (the caller went away).
    """

    approval_id: str
    tenant: str  # "" : the host's
    sandbox_id: str  # the sandbox concerned ("" for a create, which has none yet, or a pool resize)
    kind: str
    subject: str
    reason: str
    created_at: float
    deadline: float
    state: str = "pending"
    decision: str = ""
    answered_by: str = ""
    answered_at: float = 0.0


@record
class NetEvent:
    """One egress attempt of a sandbox, as the proxy or resolver saw and decided it, or as the
    egress rules refused it (a packet not for the proxy: kind "tcp"/"udp"/"icmp", rule "raw-ip"
    or "port-not-allowed", the packets counted in ``detail``; logged at a bounded rate)."""

    sandbox_id: str
    at: float  # unix seconds
    kind: str  # "http" (forward proxy), "connect" (HTTPS/CONNECT tunnel), "dns"; "tcp"/"udp"/"icmp" (refused)
    host: str  # destination name as asked for (or the IP literal)
    address: str  # the address the proxy resolved and used ("" if none)
    port: int
    decision: str  # "allow" | "deny"
    rule: str  # what decided: "allow:pypi.org", "default-deny", "blocked-address", "approval:deny" ...
    bytes_up: int = 0  # sandbox -> destination
    bytes_down: int = 0  # destination -> sandbox
    detail: str = ""


@record
class ApprovalRequest:
    """An egress attempt outside a sandbox's allowlist waiting for the approval hook."""

    sandbox_id: str
    host: str
    port: int
    kind: str  # "http" | "connect"


@record
class Transcript:
    """Everything the registry keeps of one sandbox, for an audit or a replay (``warmbox export``):
    its record, its start's stage timings, every state change, command and code run, egress event
    and snapshot (each kind oldest first), and its cost (final once it ended). Kept after the
    sandbox was destroyed. Any ``snapshots[i].snapshot_id`` still present can start a new sandbox
    at that checkpoint: ``Sandbox.create(from_snapshot=...)``. :mod:`warmbox.transcript` writes it
    as one typed record per line (NDJSON)."""

    sandbox: SandboxInfo
    timings: tuple[StageTiming, ...]
    transitions: tuple[Transition, ...]
    commands: tuple[CommandRecord, ...]
    net_events: tuple[NetEvent, ...]
    snapshots: tuple[SnapshotRecord, ...]
    metrics: SandboxMetrics
    exported_at: float  # unix seconds
    truncated: bool = False  # a kind had more records than one transcript holds (the oldest are here)


# ---- records shared by the backends and the engine (a tier's description and its handles)


CONTEXT_LANGUAGES = ("python", "javascript", "bash")
# other spellings run_code(language=) and create_code_context accept (E2B's "js" among them)
LANGUAGE_ALIASES = {"py": "python", "python3": "python", "js": "javascript", "node": "javascript", "sh": "bash"}


@record
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
    # a TCP connection over the sandbox's network link (not loopback: that one is saved) survives the
    # runtime's memory checkpoint, or is reset by it; False (runsc 2022: its Sentry refuses to save
    # one, and the sandbox dies): the engine refuses such a pause up front, the sandbox keeps running
    checkpoint_saves_connections: bool = True
    # the agent's sockets are host sockets (gVisor's --host-uds): a quiesced agent closes every one,
    # the host's connection last, and the checkpoint waits for that (one left open fails the save)
    quiesce_drops_connection: bool = False
    # languages of code contexts (create_code_context / run_code(language=)); a sandbox whose image
    # lacks the interpreter (node) refuses that one with UnsupportedLanguage naming the others
    context_languages: tuple[str, ...] = CONTEXT_LANGUAGES
    # commands may run with user="root": uid 0 of a user namespace nested in the sandbox's, holding
    # every capability over that namespace only (the sandbox user's files and its own namespaces:
    # nothing the sandbox user could not reach); root_user_reason says why not where it is False
    root_user: bool = False
    root_user_reason: str = "this tier does not offer it"
    # a named volume's ext4 image is a disk of the sandbox's own kernel (a microVM), not the host's
    # one shared mount: a read-write volume is then mounted by one sandbox at a time
    # (VolumeStore.mount_volumes)
    volume_own_disk: bool = False
    # the sandbox's network interfaces are fixed when its runtime starts (gVisor reads its namespace
    # once; a VM's NIC): the engine prepares the egress link before the start (SandboxSpec.netns),
    # never from a pool, and a sandbox started without one cannot be given one later
    link_before_start: bool = False
    # ---- what the tier selector (warmbox.choose_tier: warmbox.tiers.choose) weighs
    # strength of the boundary between the code and the host (ISOLATION_RANKS): 1 = namespaces and
    # seccomp on the shared host kernel; 2 = a kernel or engine of its own in between, on an OS jail
    # (gVisor's Sentry, a V8 isolate): made for hostile multi-tenant code; 3 = a guest kernel behind
    # a virtual machine. 0: not declared, never chosen for untrusted code.
    isolation_rank: int = 0
    # processes and files (commands, files, pty); False: code runs only (an isolate)
    commands: bool = True
    # the slowdown against the host the tier declares for a CPU loop and for a syscall loop (fork,
    # files, a loopback socket), used when this host has no measured profile of the tier (warmbox
    # bench profile); cost_note says where it comes from ("ptrace platform: ...")
    cpu_slowdown: float = 1.0
    syscall_slowdown: float = 1.0
    cost_note: str = ""
    # order of magnitude of a cold start, milliseconds (breaks ties between tiers of equal cost)
    start_ms: float = 100.0
    # what the engine refuses up front (Unsupported naming these capabilities) where a tier lacks
    # it, besides ``commands`` above: files: the files API; ports: port forwarding into the sandbox
    files: bool = True
    ports: bool = True
    # sandboxes run a template's image (root filesystem) and its warm-up; without: the template
    # names only a shape (the isolate tier: an isolate has no filesystem to put an image in)
    images: bool = True


ISOLATION_RANKS = {
    1: "namespaces and seccomp on the shared host kernel",
    2: "a kernel or engine of its own between the code and the host kernel",
    3: "a guest kernel behind a virtual-machine boundary",
}
UNTRUSTED_MIN_RANK = 2  # untrusted (public, multi-tenant) code needs at least this isolation rank

IO_PROFILES = ("compute", "syscall-heavy", "network")
# languages a tier may run (Capabilities.languages, after REQUIREMENT_ALIASES); tools there such as
# "git" are not languages and are ignored
REQUIREMENT_LANGUAGES = ("python", "javascript", "bash", "c", "wasm")
REQUIREMENT_ALIASES = {
    **LANGUAGE_ALIASES,
    "shell": "bash",
    "typescript": "javascript",
    "ts": "javascript",
    "webassembly": "wasm",
    "gcc": "c",
}


def canonical_language(name: str) -> str:
    """The selector's name of a language (``node`` -> ``javascript``); "" if it is not one."""
    name = REQUIREMENT_ALIASES.get(name.lower(), name.lower())
    return name if name in REQUIREMENT_LANGUAGES else ""


@record
class Requirements:
    """The four questions behind ``tier="auto"`` (``warmbox.choose_tier``, ``warmbox advise``).

    language: what the code is written in: python, javascript (js, node), bash (sh), c, wasm.
    trusted: True for your own developers' agents (trusted-ish code); False (default) for code from
        the public, a multi-tenant product: only tiers of isolation rank >= 2 qualify.
    io: "compute" (CPU loops), "syscall-heavy" (fork, exec, files: builds, package installs, git)
        or "network" (sockets, egress: the tier must offer a network mode besides "none").
    guest_kernel: a dedicated guest kernel is needed (kernel modules, a specialised Linux, the
        strongest multi-tenant boundary).

    Bad values are InvalidArgument naming the allowed ones.
    """

    language: str = "python"
    trusted: bool = False
    io: Literal["compute", "syscall-heavy", "network"] = "compute"
    guest_kernel: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.language, str) or not canonical_language(self.language):
            aliases = sorted(k for k in REQUIREMENT_ALIASES if k not in REQUIREMENT_LANGUAGES)
            raise InvalidArgument(
                f"requirements.language must be one of {', '.join(REQUIREMENT_LANGUAGES)} "
                f"(or {', '.join(aliases)}), got {self.language!r}"
            )
        object.__setattr__(self, "language", canonical_language(self.language))
        if self.io not in IO_PROFILES:
            raise InvalidArgument(f"requirements.io must be one of {', '.join(IO_PROFILES)}, got {self.io!r}")
        for name in ("trusted", "guest_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"requirements.{name} must be True or False, got {getattr(self, name)!r}")


@record
class TierChoice:
    """What ``warmbox.choose_tier`` decided: the tier, why (one sentence each), and every other
    tier with why not. profile_at: when the measured profile it used was taken (unix seconds; 0:
    none, the tiers' declared costs decided)."""

    tier: str
    reasons: tuple[str, ...]
    rejected: dict[str, str]
    profile_at: float = 0.0


@record
class TierProfile:
    """One tier's measured cost on this host (``warmbox bench profile``): each loop's time in a
    sandbox of the tier over the same loop's on the host, in the same run (1.0 = as fast).

    compute: a CPU loop (``for x in data: calculate(x)``). fork, files, socket: fork + wait,
    create/write/close/open/read/close/unlink of a 4 KiB file, a loopback TCP connect/accept/send/
    recv/close. syscall: the geometric mean of those three. cost_note: the tier's
    ``Capabilities.cost_note`` when measured (its platform, accelerator: another one now and the
    measurement is not used).
    """

    tier: str
    compute: float
    syscall: float
    fork: float
    files: float
    socket: float
    cost_note: str = ""


@record
class HostProfile:
    """The cached result of ``warmbox bench profile``: the host it was measured on, when, and
    each tier's ratios (``skipped``: tiers not measured, and why; ``host_us``: each loop on the
    host, microseconds per round)."""

    measured_at: float  # unix seconds
    kernel: str
    cpu_model: str
    cpus: int
    tiers: tuple[TierProfile, ...]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    host_us: dict[str, float] = dataclasses.field(default_factory=dict)


@record
class TierCandidate:
    """One tier as the selector sees it: its declared capabilities (None: this build cannot load
    it) and whether this host (and the caller's key) can run it (``reason``: why not, or what runs it)."""

    tier: str
    capabilities: Capabilities | None
    available: bool
    reason: str


@record
class Availability:
    available: bool
    reason: str  # why not (or what was found), in one line


# Image layers are stored with their owners shifted into this range: an image's uid u is host uid
# LAYER_UID_BASE + u (storage.uidslots re-exports it; backends read it here, below storage).
LAYER_UID_BASE = 1_000_000
# The isolate tier's host processes (one per tenant) each run as uid 1000 of a range of this size,
# a slot of the host-wide uid ledger (storage.uidslots) mapped in their own user namespace.
ISOLATE_UID_RANGE = 65536


@record
class ImageRef:
    """The root filesystem a sandbox runs: one built version of a template.

    layers: host directories of its unpacked layers, bottom first (overlay lowerdirs are these
    reversed); read-only, shared by every sandbox of the image, owners shifted into
    ``uidslots.LAYER_UID_BASE``. image_id: ``sha256:<hex>`` over the layers' digests and the config
    below; what pools, snapshots and restores record and compare. env/workdir/user: the image's
    config (Dockerfile ENV, WORKDIR, USER); sandboxes start with them.
    """

    template: str
    version: int
    image_id: str
    layers: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    workdir: str = ""
    user: str = ""


@record
class LayerInfo:
    """One content-addressed image layer in the host's layer store.

    digest: ``sha256:<hex>`` of the layer's blob (a tar, possibly gzip/zstd-compressed as an OCI
    registry served it): what templates record. size_bytes: the blob's size in bytes. path: the
    host directory of the unpacked layer (owners shifted into ``uidslots.LAYER_UID_BASE``,
    overlay whiteouts); read-only, shared.
    """

    digest: str
    size_bytes: int
    path: str


@record
class OciImage:
    """An OCI image imported into the layer store: its layers bottom first and its config
    (``env`` in order, ``cmd`` = the config's Entrypoint followed by its Cmd)."""

    layers: tuple[LayerInfo, ...]
    env: tuple[tuple[str, str], ...]
    workdir: str
    user: str
    cmd: tuple[str, ...]


@record
class TemplateInfo:
    """One built version of a template, as the registry records it.

    version: 1, 2, ... per (tenant, name), assigned by ``TemplateStore.template_add`` (never reused).
    image_id: ``sha256:<hex>`` over layers + env/workdir/user (``storage.layers.image_id_of``).
    layers: layer digests, bottom first. source: where the bottom came from ("debian:bookworm",
    "dockerfile:/path", "oci:/path", "registry:host/x:tag"). spec_hash: the build spec's hash (the
    same spec and image as the latest version adds no version). size_bytes: the layers' blobs.
    created_at: epoch seconds. build_log: the build log's file name in the server's build log
    directory (``<home>/templates/logs``; "" if none): a name, never a host path.
    """

    name: str
    version: int
    image_id: str
    layers: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    workdir: str = ""
    user: str = ""
    warmup_code: str | None = None
    warmup_commands: tuple[str, ...] = ()
    source: str = ""
    spec_hash: str = ""
    size_bytes: int = 0
    created_at: float = 0.0
    build_log: str = ""
    tenant: str = ""
    description: str = ""


@record
class TemplateBuildEvent:
    """One step's progress in a template build (streamed while it builds).

    step: 0 for the image source, then 1..total for the steps. text: the step in one line
    ("RUN make"). status: "cached" (its layer was reused: no sandbox), "running", "done", "failed",
    or "config" (ENV/WORKDIR/USER: the image's config, no layer). elapsed_s: seconds since the step
    began (0 for "running"). detail: the layer digest when done/cached, the reason when failed, an
    output line while running (the build log has all of it).
    """

    step: int
    total: int
    text: str
    status: Literal["cached", "running", "done", "failed", "config"]
    elapsed_s: float = 0.0
    detail: str = ""


@record
class VolumeMount:
    """A named volume mounted into one sandbox: ``disk`` is the host path of the volume's ext4
    image (its size is the volume's limit), ``path`` where the sandbox sees it. Host-internal:
    what a backend gets in its SandboxSpec, never part of an operation's result."""

    name: str
    path: str
    read_only: bool
    disk: str


VOLUME_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
MIN_VOLUME_MB = 16  # ext4 with a journal needs a few MiB of its own
MAX_VOLUME_MB = 1 << 20  # 1 TiB (sparse: the host pays for what is written)
# where a volume may not be mounted: the sandbox's own filesystems and the guest agent's files
_VOLUME_FORBIDDEN = ("/proc", "/sys", "/dev", "/opt/warmbox", "/run")


def validate_volume_name(name: object) -> str:
    """A volume's name: 1-63 of letters, digits, ``_ . -``, starting with a letter or digit."""
    if not isinstance(name, str) or not VOLUME_NAME.match(name):
        raise InvalidArgument(
            f"a volume name is 1-63 letters, digits, '_', '.' or '-' starting with a letter or digit, got {name!r}"
        )
    return name


def validate_volume_size(size_mb: object) -> int:
    """A volume's size in MiB (MIN_VOLUME_MB .. MAX_VOLUME_MB)."""
    if isinstance(size_mb, bool) or not isinstance(size_mb, int) or not MIN_VOLUME_MB <= size_mb <= MAX_VOLUME_MB:
        raise InvalidArgument(f"size_mb must be an integer from {MIN_VOLUME_MB} to {MAX_VOLUME_MB}, got {size_mb!r}")
    return size_mb


@record
class Volume:
    """A named volume mounted into a sandbox: ``Sandbox.create(volumes=[Volume("datasets",
    "/data", read_only=True)])``. The volume is made first (``warmbox volume create NAME --size 1G``
    or ``Sandbox.create_volume``); its files outlive every sandbox that mounts it.

    name: the volume's name (yours: another tenant's volume of the same name is another volume).
    path: where the sandbox sees it: absolute, not ``/``, not /workspace itself, not under /proc,
        /sys, /dev, /run or /opt/warmbox.
    read_only: mounted read-only (a write gets PathPermissionDenied / EROFS inside).
    """

    name: str
    path: str
    read_only: bool = False


def validate_volumes(volumes: object) -> tuple[Volume, ...]:
    """A create's ``volumes``: a list of Volume, each name valid, each path allowed and distinct."""
    if volumes is None:
        return ()
    if not isinstance(volumes, (list, tuple)) or not all(isinstance(v, Volume) for v in volumes):
        raise InvalidArgument("volumes must be a list of warmbox.Volume(name, path, read_only=False)")
    if len(volumes) > 16:
        raise InvalidArgument(f"at most 16 volumes per sandbox, got {len(volumes)}")
    seen: set[str] = set()
    out = []
    for v in volumes:
        validate_volume_name(v.name)
        if not isinstance(v.read_only, bool):
            raise InvalidArgument(f"volume {v.name!r}: read_only must be a bool, got {v.read_only!r}")
        path = v.path
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path or len(path) > 1024:
            raise InvalidArgument(f"volume {v.name!r}: the mount path must be an absolute path, got {path!r}")
        if any(part in (".", "..") for part in path.split("/")):
            raise InvalidArgument(f"volume {v.name!r}: the mount path {path!r} has a '.' or '..' component")
        path = "/" + "/".join(p for p in path.split("/") if p)
        if path == "/":
            raise InvalidArgument(f"volume {v.name!r}: cannot be mounted over /")
        if path == "/workspace":
            raise InvalidArgument(f"volume {v.name!r}: cannot be mounted over /workspace itself (a path under it can)")
        for bad in _VOLUME_FORBIDDEN:
            if path == bad or path.startswith(bad + "/"):
                raise InvalidArgument(f"volume {v.name!r}: cannot be mounted at {path} (under {bad})")
        for other in seen:
            if path == other or path.startswith(other + "/") or other.startswith(path + "/"):
                raise InvalidArgument(f"volume {v.name!r}: mount path {path} overlaps another volume's ({other})")
        seen.add(path)
        out.append(Volume(v.name, path, v.read_only))
    return tuple(out)


@record
class VolumeInfo:
    """A named volume's record.

    name: its name (unique per tenant). tenant: whose ("" : the host's). size_mb: its size, MiB:
    the limit of what it holds (a writer inside gets NoSpace). created_at: epoch seconds.
    allocated_mb: what its disk (a sparse ext4 image) takes on the host's disk now (MiB, rounded
    up). mounted_by: the ids of the live or paused sandboxes mounting it. node: in a cluster, the
    node holding its disk, where every sandbox mounting it runs ("" on a single host);
    allocated_mb is that node's (0 when read on another node). Where the disk is on the host is
    the host's own business (``engine.volumes.disk_of``): no caller is told a host path.
    """

    name: str
    tenant: str
    size_mb: int
    created_at: float
    allocated_mb: int = 0
    mounted_by: tuple[str, ...] = ()
    node: str = ""


@record
class SandboxSpec:
    """Everything a backend needs to build one sandbox."""

    sandbox_id: str
    state_dir: str  # host directory owned by this sandbox; removed on destroy
    uid_base: int  # first host uid/gid of the sandbox's private 65536-id range
    envs: tuple[tuple[str, str], ...]
    limits: Limits
    image: ImageRef | None = None  # None: the tier's built-in image
    volumes: tuple[VolumeMount, ...] = ()
    # a template build sandbox: this empty host directory is the writable upper layer over
    # ``image`` (it becomes the step's new layer); the sandbox runs as root of its user namespace
    # with uid base uidslots.LAYER_UID_BASE (one build per host at a time). "": an ordinary sandbox.
    build_upper: str = ""
    # a network namespace the engine prepared (its egress link already in it) for the runtime to run
    # in, on a tier with Capabilities.link_before_start; "": the runtime's own, empty one
    netns: str = ""
    # whose sandbox it is: the tenant's name ("": the in-process SDK's, a tenant of its own); a tier
    # with host processes shared by sandboxes runs one per tenant
    tenant: str = ""


@record
class BackendHandle:
    """Flat, persistable description of a created sandbox."""

    sandbox_id: str
    tier: str
    runtime_id: str
    state_dir: str
    socket_path: str
    uid_base: int
    node: str = ""  # the cluster node where it runs and these paths exist ("" = one host)


@record
class ResourceUsage:
    """Counters read from the sandbox's cgroups."""

    oom_kills: int
    memory_bytes: int
    cpu_ns: int
