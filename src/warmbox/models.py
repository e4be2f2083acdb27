"""Flat, typed records shared by the SDK, engine, CLI and backends."""

from __future__ import annotations

import dataclasses
import enum
import math

from warmbox.errors import InvalidArgument


def _positive(name: str, value: float, *, integer: bool = False, minimum: float = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise InvalidArgument(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value) or value <= minimum:
        raise InvalidArgument(f"{name} must be > {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox, enforced by cgroups and rlimits.

    memory_mb: memory cgroup limit in MiB (no swap); tmpfs contents count against it.
    cpus: CPU quota in cores (1.5 = 150 ms of CPU per 100 ms).
    pids: maximum number of processes and threads.
    file_size_mb: largest file a process may write (RLIMIT_FSIZE), MiB.
    open_files: open file descriptors per process (RLIMIT_NOFILE).
    tmp_mb: size of the /tmp and /home/user tmpfs mounts, MiB each.
    """

    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 256
    file_size_mb: int = 1024
    open_files: int = 1024
    tmp_mb: int = 256

    def __post_init__(self) -> None:
        _positive("limits.memory_mb", self.memory_mb, integer=True, minimum=15)
        _positive("limits.cpus", self.cpus, minimum=0.009)
        _positive("limits.pids", self.pids, integer=True, minimum=7)
        _positive("limits.file_size_mb", self.file_size_mb, integer=True)
        _positive("limits.open_files", self.open_files, integer=True, minimum=15)
        _positive("limits.tmp_mb", self.tmp_mb, integer=True)


class State(str, enum.Enum):
    """Lifecycle states of a sandbox (see engine.lifecycle for the legal operations)."""

    CREATING = "creating"
    READY = "ready"
    RUNNING = "running"
    DESTROYED = "destroyed"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class StageTiming:
    """One stage of one sandbox start, in milliseconds."""

    sandbox_id: str
    stage: str
    duration_ms: float


@dataclasses.dataclass(frozen=True)
class Transition:
    """One state change of one sandbox; the registry keeps them all, in order."""

    sandbox_id: str
    at: float  # unix seconds
    from_state: str
    to_state: str
    reason: str


@dataclasses.dataclass(frozen=True)
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


@dataclasses.dataclass(frozen=True)
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


@dataclasses.dataclass(frozen=True)
class Result:
    """One output of a code run, in every representation the object offered."""

    is_main_result: bool
    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: bytes | None = None
    jpeg: bytes | None = None
    latex: str | None = None
    json: str | None = None


@dataclasses.dataclass(frozen=True)
class ExecutionError:
    """An exception raised by user code in a code context."""

    name: str
    value: str
    traceback: str


@dataclasses.dataclass(frozen=True)
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


@dataclasses.dataclass(frozen=True)
class EntryInfo:
    """One file-system entry inside a sandbox."""

    name: str
    path: str
    type: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int
    modified: float  # unix seconds
    symlink_target: str | None


@dataclasses.dataclass(frozen=True)
class TierStatus:
    """What ``warmbox doctor`` reports for one tier."""

    tier: str
    available: bool
    reason: str
