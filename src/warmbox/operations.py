"""The one list of operations: every SDK call, CLI command and (later) HTTP route is one typed request here.

Each request is a frozen record naming its :class:`Op` and its result type; the engine front
(:mod:`warmbox.engine.front`) has exactly one handler per op, and a transport
(:mod:`warmbox.sdk.transport`) carries requests to it — in process, or over the network. Fields
marked ``local`` (streaming callbacks) are not data: a remote transport feeds them from the
stream it receives instead of sending them.
"""

from __future__ import annotations

import dataclasses
import enum
import posixpath
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from warmbox.errors import InvalidArgument, InvalidPath, WarmboxError
from warmbox.lazy import lazy_module
from warmbox.models import (
    Approval,
    CodeContext,
    CommandRecord,
    CommandResult,
    EntryInfo,
    Execution,
    FilesystemEvent,
    Lifecycle,
    Limits,
    MetricSample,
    NetEvent,
    PoolStatus,
    ProcessEvent,
    ProcessInfo,
    Requirements,
    Result,
    SandboxInfo,
    SandboxMetrics,
    SandboxQuery,
    SnapshotRef,
    StageTiming,
    TemplateBuildEvent,
    TemplateInfo,
    TierChoice,
    TierStatus,
    Transcript,
    Volume,
    VolumeInfo,
    WriteEntry,
    record,
)

if TYPE_CHECKING:
    from warmbox import templates
    from warmbox.network import policy
else:  # types of two fields, run when first resolved (a create's network, a build's template): exec loads neither
    policy = lazy_module("warmbox.network.policy")
    templates = lazy_module("warmbox.templates")

R = TypeVar("R")
TextSink = Callable[[str], object]
ResultSink = Callable[[Result], object]
WORKDIR = "/workspace"
_MAX_PATH = 4096


def sandbox_path(path: object) -> str:
    """Normalise a path for the files API: relative paths are under /workspace; '..' is refused."""
    if not isinstance(path, str):
        raise InvalidPath(f"path must be a string, got {type(path).__name__}")
    if not path or "\0" in path or len(path) > _MAX_PATH:
        raise InvalidPath(f"path {path[:80]!r} is empty, too long or contains a NUL byte")
    if ".." in path.split("/"):
        raise InvalidPath(f"path {path!r} contains a '..' component")
    return posixpath.normpath(posixpath.join(WORKDIR, path))


_MAX_TEXT_DEPTH = 16
# a command's argv may carry bytes that are not UTF-8, as Python spells them (os.fsdecode's
# surrogateescape: U+DC80..U+DCFF): they reach the sandbox as those bytes
_OS_BYTES_FIELDS = frozenset({"cmd"})


def check_text(value: object, where: str = "request") -> None:
    """InvalidArgument naming the place if a string anywhere in ``value`` (a request, its records,
    lists, tuples and dicts, keys included) cannot be UTF-8: a lone UTF-16 surrogate such as
    "\\ud800", which JSON's \\u escapes can carry. Nothing below (the registry, the guest protocol,
    a log) can store or send one, so every operation is refused here, before anything is claimed."""
    found = _bad_text(value, 0, False)
    if found is None:
        return
    at, text = found
    for part in reversed(at):
        if isinstance(part, int):
            where += f"[{part}]"
        elif isinstance(part, tuple):  # ("key", k): the key k itself; ("value", k): what k holds
            where += " key" if part[0] == "key" else f"[{part[1]!r}]"
        else:
            where = part if where == "request" else f"{where}.{part}"
    if text is None:
        raise InvalidArgument(f"{where}: nested too deeply")
    pos = next(i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff")
    raise InvalidArgument(f"{where} is not valid Unicode text: a lone surrogate ({text[pos]!r}) at character {pos}")


_Where = list[str | int | tuple[str, object]]


def _bad_text(value: object, depth: int, os_bytes: bool) -> tuple[_Where, str | None] | None:
    """(where, the string) of the first string UTF-8 cannot hold in ``value``, its path reversed
    (built only when there is one: every request is checked); the string is None when ``value``
    nests deeper than _MAX_TEXT_DEPTH. ``os_bytes``: an argv's strings, which may spell non-UTF-8
    bytes with surrogateescape."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8", "surrogateescape" if os_bytes else "strict")
        except UnicodeEncodeError:
            return [], value
        return None
    if value is None or isinstance(value, (int, float, bytes)):
        return None
    if depth > _MAX_TEXT_DEPTH:
        return [], None
    found: tuple[_Where, str | None] | None = None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if (found := _bad_text(item, depth + 1, os_bytes)) is not None:
                found[0].append(i)
                return found
    elif isinstance(value, dict):
        for k, item in value.items():
            if (found := _bad_text(k, depth + 1, False)) is not None:
                found[0].append(("key", k))
                return found
            if (found := _bad_text(item, depth + 1, False)) is not None:
                found[0].append(("value", k))
                return found
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for name in _data_fields(type(value)):
            field = getattr(value, name, None)
            if (found := _bad_text(field, depth + 1, name in _OS_BYTES_FIELDS and isinstance(field, list))) is not None:
                found[0].append(name)
                return found
    return None


_DATA_FIELDS: dict[type, tuple[str, ...]] = {}


def _data_fields(cls: type) -> tuple[str, ...]:
    """A record's fields that hold data (not streaming callbacks); cached: every request is checked."""
    names = _DATA_FIELDS.get(cls)
    if names is None:
        names = _DATA_FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get("local"))
    return names


LOCAL = {"local": True}  # field metadata of a streaming callback: never serialised, fed by the transport


class Op(str, enum.Enum):
    """Every operation of the engine front, once."""

    CREATE = "create"
    CONNECT = "connect"
    RESUME = "resume"
    DETACH = "detach"
    LIST = "list"
    INFO = "info"
    TIMINGS = "timings"
    LOGS = "logs"
    DOCTOR = "doctor"
    CHOOSE_TIER = "tiers.choose"
    KILL = "kill"
    SET_TIMEOUT = "set_timeout"
    METRICS = "metrics"
    METRICS_HISTORY = "metrics.history"
    PING = "ping"
    RECORD_FIRST_COMMAND = "timings.first_command"
    EXEC = "exec"
    RUN_CODE = "run_code"
    CREATE_AND_RUN = "create_and_run"
    CREATE_CONTEXT = "contexts.create"
    REMOVE_CONTEXT = "contexts.remove"
    LIST_CONTEXTS = "contexts.list"
    RESTART_CONTEXT = "contexts.restart"
    COMMANDS_START = "commands.start"
    COMMANDS_CONNECT = "commands.connect"
    COMMANDS_START_CONNECT = "commands.start_connect"
    COMMANDS_SEND_STDIN = "commands.send_stdin"
    COMMANDS_KILL = "commands.kill"
    COMMANDS_LIST = "commands.list"
    COMMANDS_HISTORY = "commands.history"
    PTY_RESIZE = "pty.resize"
    FILES_READ = "files.read"
    FILES_READ_STREAM = "files.read_stream"
    FILES_WRITE = "files.write"
    FILES_WRITE_STREAM = "files.write_stream"
    FILES_WRITE_MANY = "files.write_files"
    FILES_RENAME = "files.rename"
    FILES_UPLOAD_DIR = "files.upload_dir"
    FILES_DOWNLOAD_DIR = "files.download_dir"
    FILES_WATCH = "files.watch_dir"
    FILES_LIST = "files.list"
    FILES_STAT = "files.stat"
    FILES_MAKE_DIR = "files.make_dir"
    FILES_REMOVE = "files.remove"
    FILES_SIGN_URL = "files.sign_url"
    SNAPSHOT = "snapshot"
    PAUSE = "pause"
    LIST_SNAPSHOTS = "snapshots.list"
    DELETE_SNAPSHOT = "snapshots.delete"
    GC_SNAPSHOTS = "snapshots.gc"
    NETWORK_UPDATE = "network.update"
    NETWORK_POLICY = "network.policy"
    NETWORK_LOG = "network.log"
    POOLS_LIST = "pools.list"
    POOLS_RESIZE = "pools.resize"
    PORTS_CONNECT = "ports.connect"
    VOLUME_CREATE = "volumes.create"
    VOLUME_LIST = "volumes.list"
    VOLUME_GET = "volumes.get"
    VOLUME_DELETE = "volumes.delete"
    TEMPLATE_BUILD = "templates.build"
    TEMPLATE_LIST = "templates.list"
    TEMPLATE_GET = "templates.get"
    TEMPLATE_DELETE = "templates.delete"
    TEMPLATE_GC = "templates.gc"
    EXPORT = "export"
    APPROVALS_LIST = "approvals.list"
    APPROVAL_ANSWER = "approvals.answer"
    NODE_DRAIN = "nodes.drain"


class Request(Generic[R]):
    """Base of every request; ``op`` names it in the one list."""

    op: ClassVar[Op]


@record
class Opened:
    """A sandbox a caller holds: its record and its start's stage timings."""

    info: SandboxInfo
    timings: tuple[StageTiming, ...]


EventSink = Callable[[FilesystemEvent], object]  # may return an awaitable: awaited before the next event


class DirWatch(Protocol):
    """A running ``files.watch_dir``: its callback gets each change until stop() or the end."""

    @property
    def done(self) -> bool:
        """Over: stopped, the directory went, or the connection failed."""
        ...

    def stop(self) -> None:
        """Stop watching (in the sandbox too); idempotent. On the event loop."""
        ...

    async def wait(self) -> None:
        """Until it is over; raises what ended it other than stop() or the directory going (a
        typed error, or the callback's own exception)."""
        ...


class WatchTask:
    """What both transports' DirWatch share: a task runs the subclass's ``_run`` (which passes each
    event to ``_deliver``), keeps its error for wait(); stop() calls the subclass's ``_halt`` (its
    source: the guest stream, the HTTP response) and cancels the task.

    asyncio is imported where it is used, by design: a WatchTask lives on a running loop (whose
    caller loaded asyncio), and the table of operations is imported by processes that run none
    (``warmbox --help``, the CLI's thin path: issue 38)."""

    def __init__(self, on_event: EventSink) -> None:
        import asyncio

        self._on_event = on_event
        self._error: BaseException | None = None
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        raise NotImplementedError

    def _halt(self) -> None:
        raise NotImplementedError

    async def _deliver(self, event: FilesystemEvent) -> None:
        import inspect

        result = self._on_event(event)
        if inspect.isawaitable(result):
            await result

    @property
    def done(self) -> bool:
        return self._task.done()

    def stop(self) -> None:
        self._halt()
        self._task.cancel()

    async def wait(self) -> None:
        import asyncio

        try:
            await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if not self._task.cancelled():
                raise  # the caller's wait was cancelled, not the watch
        if self._error is not None:
            raise self._error


class ChunkStream(Protocol):
    """A flow-controlled read in progress (``files.read`` with format="stream")."""

    @property
    def path(self) -> str:
        """The file's normalised path."""
        ...

    @property
    def received(self) -> int: ...

    @property
    def done(self) -> bool: ...

    async def next(self) -> bytes | None:
        """The next chunk; None at the end. Typed errors (FileTooLarge, SandboxTimeout, ...)."""
        ...

    def cancel(self) -> None:
        """Stop the read in the sandbox; idempotent. On the event loop."""
        ...


class PortStream(Protocol):
    """A TCP connection to a port inside the sandbox (``ports.connect``), relayed by its agent."""

    async def read(self) -> bytes | None:
        """The server's next bytes; None at its end of data. Typed errors."""
        ...

    async def write(self, data: bytes) -> None:
        """Send ``data`` to the server (waits while the tunnel's window is full)."""
        ...

    async def write_eof(self) -> None:
        """Half-close: the server reads EOF and may still answer."""
        ...

    def close(self) -> None:
        """End the connection in the sandbox; idempotent. On the event loop."""
        ...


class ProcessStream(Protocol):
    """A background process's output as it comes (``commands.connect``): events, then its result."""

    @property
    def pid(self) -> int: ...

    async def next(self) -> ProcessEvent | None:
        """The next piece of output; None once the process ended (then ``result`` is set). Typed
        errors (SandboxTimeout, GuestConnectionError, ConnectionLost, ...)."""
        ...

    @property
    def result(self) -> CommandResult | None:
        """How the process ended, once ``next()`` returned None."""
        ...

    def cancel(self) -> None:
        """Stop following it (the process runs on); idempotent. On the event loop."""
        ...


# ---- sandboxes


@record
class Create(Request[Opened]):
    """A new sandbox (from a pool, cold, or forked from ``from_snapshot``). Defaults: warmbox.toml.

    tier "auto": the tier ``ChooseTier(requirements)`` picks (requirements default: untrusted
    Python, compute); the choice and its reasons are kept in the sandbox's record."""

    op: ClassVar[Op] = Op.CREATE
    tier: str | None = None
    timeout: float | None = None
    envs: dict[str, str] | None = None
    limits: Limits | None = None
    template: str | None = None
    pool: bool = True
    from_snapshot: str | None = None
    network: policy.Network | str = "none"  # "none", "internet" or a warmbox.Network
    secrets: dict[str, Any] | None = None  # name -> warmbox.Secret
    metadata: dict[str, str] | None = None  # shown in get_info(), matched by list(query=)
    lifecycle: Lifecycle | None = None  # auto-pause: on timeout, when idle; auto-resume
    volumes: tuple[Volume, ...] | None = None  # named volumes mounted into it (never from a pool)
    requirements: Requirements | None = None  # the four questions, for tier="auto"
    idempotency_key: str | None = None  # a repeat with this key gets this create's sandbox (HTTP: Idempotency-Key)


@record
class Connect(Request[Opened]):
    """Attach to a live sandbox by id (legal while ready/running); a paused one is resumed.

    timeout: seconds; a paused sandbox resumes with it (None: its own), a running one lives at
    least that long from now (a later deadline is kept, as E2B's connect does)."""

    op: ClassVar[Op] = Op.CONNECT
    sandbox_id: str
    timeout: float | None = None


@record
class Resume(Request[Opened]):
    """A paused sandbox (its id or a snapshot id) running again."""

    op: ClassVar[Op] = Op.RESUME
    snapshot: str
    timeout: float | None = None
    envs: dict[str, str] | None = None
    secrets: dict[str, Any] | None = None  # name -> value (str) or warmbox.Secret: never stored


@record
class Detach(Request[None]):
    """Let go of a sandbox without ending it (its connection closes; it runs until its timeout)."""

    op: ClassVar[Op] = Op.DETACH
    sandbox_id: str


@record
class ListSandboxes(Request[list[SandboxInfo]]):
    """Live sandboxes (include_dead: ended ones too); reap: first end the expired and the orphaned."""

    op: ClassVar[Op] = Op.LIST
    include_dead: bool = False
    reap: bool = False
    query: SandboxQuery | None = None  # by metadata and state (E2B's SandboxQuery)


@record
class Info(Request[SandboxInfo]):
    op: ClassVar[Op] = Op.INFO
    sandbox_id: str


@record
class Timings(Request[list[StageTiming]]):
    """A sandbox's stage timings (kept after it ended)."""

    op: ClassVar[Op] = Op.TIMINGS
    sandbox_id: str


@record
class Logs(Request[str]):
    """The tails of a sandbox's runtime logs (runc/runsc, a Sentry panic, QEMU), also after it ended."""

    op: ClassVar[Op] = Op.LOGS
    sandbox_id: str


@record
class Doctor(Request[list[TierStatus]]):
    """Which tiers this host can run, and why not."""

    op: ClassVar[Op] = Op.DOCTOR


@record
class ChooseTier(Request[TierChoice]):
    """The tier for code of these requirements on this host, why, and why not each other tier
    (NoSuitableTier when none is strong enough: never a weaker one)."""

    op: ClassVar[Op] = Op.CHOOSE_TIER
    requirements: Requirements


@record
class Kill(Request[bool]):
    """Destroy a sandbox; False if it was already gone."""

    op: ClassVar[Op] = Op.KILL
    sandbox_id: str


@record
class SetTimeout(Request[float]):
    """Let the sandbox live ``timeout`` more seconds from now; returns the new expiry (epoch s)."""

    op: ClassVar[Op] = Op.SET_TIMEOUT
    sandbox_id: str
    timeout: float


@record
class Metrics(Request[SandboxMetrics]):
    """A sandbox's usage and cost so far. fresh=False: the meters as the daemon last sampled them
    (at most ~1 s old while it lives; busy/idle as of its last command), without reading its
    cgroup or asking its agent — what a page refreshing every second asks for every sandbox."""

    op: ClassVar[Op] = Op.METRICS
    sandbox_id: str
    fresh: bool = True


@record
class MetricsHistory(Request[list[MetricSample]]):
    """A sandbox's metrics history: the readings taken in [start, end] (epoch seconds; None: from
    its start / until now), oldest first, at most ``limit`` (1-720: the latest of them). Read every
    5 s while it runs (none while it is paused; one is taken now when the latest is older); the
    latest 720 are kept (an hour), and they end with the sandbox."""

    op: ClassVar[Op] = Op.METRICS_HISTORY
    sandbox_id: str
    start: float | None = None
    end: float | None = None
    limit: int = 720


@record
class Ping(Request[None]):
    """One empty round trip to the sandbox's agent (it answers, or a typed error says why not)."""

    op: ClassVar[Op] = Op.PING
    sandbox_id: str


@record
class RecordFirstCommand(Request[None]):
    """The client's measure of its first command or cell on the sandbox (stage ``first_command``:
    from sending it to having its result, ms); recorded once per sandbox, later ones are ignored."""

    op: ClassVar[Op] = Op.RECORD_FIRST_COMMAND
    sandbox_id: str
    duration_ms: float


# ---- commands and code


@record
class Exec(Request[CommandResult]):
    """Run ``cmd`` (a bash string or an argv list); timeout: seconds, wall clock (None/0: none)."""

    op: ClassVar[Op] = Op.EXEC
    sandbox_id: str
    cmd: str | list[str]
    envs: dict[str, str] | None = None
    cwd: str | None = None
    timeout: float | None = 60.0
    stdin: str | bytes | None = None
    max_output: int = 10 << 20
    on_stdout: TextSink | None = dataclasses.field(default=None, compare=False, repr=False, metadata=LOCAL)
    on_stderr: TextSink | None = dataclasses.field(default=None, compare=False, repr=False, metadata=LOCAL)
    idempotency_key: str | None = None  # a repeat with this key gets this run's result (HTTP: Idempotency-Key)


@record
class StartProcess(Request[int]):
    """Start ``cmd`` in the background (or, with pty_cols/pty_rows, on a terminal of that size); its
    pid. It runs until it ends or is killed, whoever reads its output; see ConnectProcess."""

    op: ClassVar[Op] = Op.COMMANDS_START
    sandbox_id: str
    cmd: str | list[str]
    envs: dict[str, str] | None = None
    cwd: str | None = None
    tag: str = ""
    user: str = "user"
    pty_cols: int = 0
    pty_rows: int = 0


@record
class StartAndConnect(Request[ProcessStream]):
    """StartProcess and ConnectProcess in one step, one round trip to the sandbox: the stream of
    the new background process (its ``pid`` at once), from its first byte. It is a background
    process like any (list, connect, send_stdin, kill reach it); cancelling the stream leaves it
    running. ``stdin`` false: its stdin is closed at the start."""

    op: ClassVar[Op] = Op.COMMANDS_START_CONNECT
    sandbox_id: str
    cmd: str | list[str]
    envs: dict[str, str] | None = None
    cwd: str | None = None
    tag: str = ""
    user: str = "user"
    pty_cols: int = 0
    pty_rows: int = 0
    stdin: bool = True


@record
class ConnectProcess(Request[ProcessStream]):
    """Follow a background process's output (what its bounded ring still holds, then live) until it
    ends; ``output`` false: only its end. Any client, any number of times."""

    op: ClassVar[Op] = Op.COMMANDS_CONNECT
    sandbox_id: str
    pid: int
    output: bool = True
    pty: bool = False  # a terminal's output: "pty" events of raw bytes instead of text


@record
class SendStdin(Request[None]):
    """Bytes (text: UTF-8) for a background process's stdin or terminal; ``eof`` closes its stdin
    (a terminal gets ^D)."""

    op: ClassVar[Op] = Op.COMMANDS_SEND_STDIN
    sandbox_id: str
    pid: int
    data: str | bytes
    eof: bool = False


@record
class KillProcess(Request[bool]):
    """End a process and every process it started (its cgroup or process group); False if it was
    not running. ``signal``: another signal number instead (to all of them)."""

    op: ClassVar[Op] = Op.COMMANDS_KILL
    sandbox_id: str
    pid: int
    signal: int = 9


@record
class ListProcesses(Request[list[ProcessInfo]]):
    """The sandbox's running background processes and terminals."""

    op: ClassVar[Op] = Op.COMMANDS_LIST
    sandbox_id: str


@record
class ResizePty(Request[None]):
    """A terminal's new size (its processes get SIGWINCH)."""

    op: ClassVar[Op] = Op.PTY_RESIZE
    sandbox_id: str
    pid: int
    cols: int
    rows: int


@record
class Commands(Request[list[CommandRecord]]):
    """A sandbox's recorded commands, code runs and followed background processes (kept after it
    ended): those with seq > ``after_seq``, at most ``limit`` (1-10000), the oldest of them first
    (newest_first: the newest, newest first). Each is its outcome and byte counts, never its
    environment or output."""

    op: ClassVar[Op] = Op.COMMANDS_HISTORY
    sandbox_id: str
    limit: int = 1000
    after_seq: int = 0
    newest_first: bool = False


@record
class RunCode(Request[Execution]):
    """Run a cell in a code context ("default" unless named). ``envs``: variables for this run
    only; after it each is back as it was (unless the cell itself changed it)."""

    op: ClassVar[Op] = Op.RUN_CODE
    sandbox_id: str
    code: str
    context: str = "default"
    timeout: float | None = 60.0
    max_output: int = 10 << 20
    on_stdout: TextSink | None = dataclasses.field(default=None, compare=False, repr=False, metadata=LOCAL)
    on_stderr: TextSink | None = dataclasses.field(default=None, compare=False, repr=False, metadata=LOCAL)
    on_result: ResultSink | None = dataclasses.field(default=None, compare=False, repr=False, metadata=LOCAL)
    language: str | None = None  # with no context: the default context of this language
    idempotency_key: str | None = None  # a repeat with this key gets this run's result (HTTP: Idempotency-Key)
    envs: dict[str, str] | None = None


@record
class Started:
    """A sandbox just created and its first code run's outcome (CreateAndRun)."""

    opened: Opened
    execution: Execution
    run_ms: float  # the run's own time, wall clock (the sandbox's first_command stage)


@record
class CreateAndRun(Request[Started]):
    """A create and its first code run in one request: one round trip over HTTP instead of two.
    ``create`` as Create, then ``code`` as RunCode in the new sandbox's default context (of
    ``language``). An error of the code is in the execution; a run that fails otherwise kills the
    sandbox it made and raises. ``idempotency_key``: the create's and the run's (a repeat gets the
    same sandbox and the same run's result; a keyed request cancelled during its run keeps its
    sandbox for that repeat)."""

    op: ClassVar[Op] = Op.CREATE_AND_RUN
    create: Create
    code: str
    language: str | None = None
    timeout: float | None = 60.0  # the run's, seconds
    max_output: int = 10 << 20
    on_stdout: TextSink | None = dataclasses.field(default=None, compare=False, repr=False, metadata=LOCAL)
    on_stderr: TextSink | None = dataclasses.field(default=None, compare=False, repr=False, metadata=LOCAL)
    on_result: ResultSink | None = dataclasses.field(default=None, compare=False, repr=False, metadata=LOCAL)
    idempotency_key: str | None = None

    def run(self, sandbox_id: str) -> RunCode:
        """The code run of this request in ``sandbox_id``."""
        return RunCode(
            sandbox_id,
            self.code,
            timeout=self.timeout,
            max_output=self.max_output,
            on_stdout=self.on_stdout,
            on_stderr=self.on_stderr,
            on_result=self.on_result,
            language=self.language,
            idempotency_key=self.idempotency_key,
        )


async def create_and_run(handle: Callable[[Request[Any]], Awaitable[Any]], r: CreateAndRun) -> Started:
    """CreateAndRun as its create then its run, each through ``handle`` (a front's or the cluster
    router's, with every check of its own)."""
    if not isinstance(r.create, Create):
        raise InvalidArgument(f"create must be a Create, got {type(r.create).__name__}")
    if not isinstance(r.code, str):  # refused before a sandbox is made for it
        raise InvalidArgument(f"code must be a str, got {type(r.code).__name__}")
    if r.create.idempotency_key is not None and r.create.idempotency_key != r.idempotency_key:
        raise InvalidArgument("a CreateAndRun's key is its own idempotency_key, not its create's")
    opened: Opened = await handle(dataclasses.replace(r.create, idempotency_key=r.idempotency_key))
    sandbox_id = opened.info.sandbox_id
    started = time.perf_counter()
    try:
        execution: Execution = await handle(r.run(sandbox_id))
    except BaseException as e:
        # cancelled (a dropped connection) with a key: kept, for the repeat that gets it and the run
        if isinstance(e, WarmboxError) or r.idempotency_key is None:
            try:
                await handle(Kill(sandbox_id))
            except Exception:  # the run's own error is the one the caller needs
                pass
        raise
    return Started(opened, execution, (time.perf_counter() - started) * 1e3)


@record
class CreateContext(Request[str]):
    """A new code context; returns its id."""

    op: ClassVar[Op] = Op.CREATE_CONTEXT
    sandbox_id: str
    language: str = "python"
    cwd: str = "/workspace"
    envs: dict[str, str] | None = None


@record
class RemoveContext(Request[None]):
    op: ClassVar[Op] = Op.REMOVE_CONTEXT
    sandbox_id: str
    context: str


@record
class ListContexts(Request[list[CodeContext]]):
    """The sandbox's code contexts: those created, and the default ones that have run."""

    op: ClassVar[Op] = Op.LIST_CONTEXTS
    sandbox_id: str


@record
class RestartContext(Request[None]):
    """A fresh interpreter for a code context: same id, language, working directory and creation
    variables, no state; what its cells started ends, a run in progress with it."""

    op: ClassVar[Op] = Op.RESTART_CONTEXT
    sandbox_id: str
    context: str


# ---- files (relative paths are under /workspace)


@record
class ReadFile(Request[bytes]):
    """A whole regular file, at most ``max_bytes``; timeout: seconds for the whole read (None: none)."""

    op: ClassVar[Op] = Op.FILES_READ
    sandbox_id: str
    path: str
    max_bytes: int = 100 << 20
    timeout: float | None = 60.0


@record
class ReadFileStream(Request[ChunkStream]):
    """A file in flow-controlled chunks; max_bytes: None for no cap (a stream is never held
    whole); timeout: seconds per chunk (None: none)."""

    op: ClassVar[Op] = Op.FILES_READ_STREAM
    sandbox_id: str
    path: str
    max_bytes: int | None = None
    timeout: float | None = 60.0


@record
class WriteFile(Request[EntryInfo]):
    op: ClassVar[Op] = Op.FILES_WRITE
    sandbox_id: str
    path: str
    data: str | bytes
    mode: int = 0o644
    append: bool = False


@record
class WriteFileStream(Request[EntryInfo]):
    """Create or replace a file from chunks of bytes, taken one at a time as the sandbox writes them
    (the host holds about one chunk, whatever the size). The file replaces ``path`` atomically when
    complete (a new file beside it, renamed over it); a failed or abandoned write leaves ``path``
    as it was. Over HTTP the chunks are the request's raw body, streamed."""

    op: ClassVar[Op] = Op.FILES_WRITE_STREAM
    sandbox_id: str
    path: str
    data: AsyncIterator[bytes]
    mode: int = 0o644


@record
class WriteFiles(Request[list[EntryInfo]]):
    """Create or replace several files in one call, in order (parents are created); their entries.
    A failure stops at that file (the ones before it are written) with its typed error."""

    op: ClassVar[Op] = Op.FILES_WRITE_MANY
    sandbox_id: str
    files: tuple[WriteEntry, ...]


@record
class SignFileUrl(Request[str]):
    """A URL that lets whoever holds it, with no API key, read (``write`` False: GET) or write
    (``write`` True: PUT or POST of the file's bytes as the raw body) the file ``path`` of this
    sandbox as ``user`` ("user": the files API acts as the sandbox's user), for ``expires_in``
    seconds (at most 7 days). It is signed for the caller's tenant under the registry's signing
    key (:mod:`warmbox.engine.signing`): it names no other path, sandbox or operation, and stops
    working at its expiry or when the sandbox ends (revoking the key that asked does not end it:
    keep ``expires_in`` short). The answer is the URL's path and query, to be put after the
    server's address (the SDK's ``files.download_url``/``upload_url`` do)."""

    op: ClassVar[Op] = Op.FILES_SIGN_URL
    sandbox_id: str
    path: str
    write: bool = False
    user: str = "user"
    expires_in: float = 3600.0


@record
class Rename(Request[EntryInfo]):
    """Move ``old_path`` to ``new_path`` (parents created; a file there is replaced); its new entry."""

    op: ClassVar[Op] = Op.FILES_RENAME
    sandbox_id: str
    old_path: str
    new_path: str


@record
class UploadDir(Request[EntryInfo]):
    """Unpack a tar stream (uncompressed; chunks taken as the sandbox writes them) into the
    directory ``path`` (made if missing); its entry. A member that would land outside it (an
    absolute name, '..', a symlink or hardlink out) or is a device or FIFO raises UnsafeArchive
    naming it (members before it stay); nothing in the sandbox follows a symlink while unpacking.
    Over HTTP the archive is the request's raw body, streamed."""

    op: ClassVar[Op] = Op.FILES_UPLOAD_DIR
    sandbox_id: str
    path: str
    data: AsyncIterator[bytes]


@record
class DownloadDir(Request[ChunkStream]):
    """The directory ``path`` as a tar stream in flow-controlled chunks (symlinks stored as links,
    never followed; FIFOs, devices and sockets left out); timeout: seconds per chunk (None: none)."""

    op: ClassVar[Op] = Op.FILES_DOWNLOAD_DIR
    sandbox_id: str
    path: str
    timeout: float | None = 60.0


@record
class WatchDir(Request[DirWatch]):
    """Watch the directory ``path`` (recursive: and every directory below it, new ones included;
    links are not followed): ``on_event`` gets a FilesystemEvent per change (inotify in the
    sandbox: create, write, remove, rename, chmod) until the watch is stopped or the directory
    goes. Flow-controlled: events wait in the sandbox while the callback is busy (the kernel drops
    the excess of a flood), never on the host. Over HTTP: NDJSON event lines."""

    op: ClassVar[Op] = Op.FILES_WATCH
    sandbox_id: str
    path: str
    recursive: bool = False
    on_event: EventSink | None = dataclasses.field(default=None, compare=False, repr=False, metadata=LOCAL)


@record
class ListDir(Request[list[EntryInfo]]):
    op: ClassVar[Op] = Op.FILES_LIST
    sandbox_id: str
    path: str = "/workspace"
    depth: int = 1


@record
class Stat(Request[EntryInfo]):
    op: ClassVar[Op] = Op.FILES_STAT
    sandbox_id: str
    path: str


@record
class MakeDir(Request[bool]):
    """Create a directory and its parents; False if it existed."""

    op: ClassVar[Op] = Op.FILES_MAKE_DIR
    sandbox_id: str
    path: str


@record
class Remove(Request[None]):
    op: ClassVar[Op] = Op.FILES_REMOVE
    sandbox_id: str
    path: str


# ---- snapshots


@record
class Snapshot(Request[SnapshotRef]):
    """Save files and code-context state (memory=True: processes too, where the tier can)."""

    op: ClassVar[Op] = Op.SNAPSHOT
    sandbox_id: str
    memory: bool = False
    env_names: tuple[str, ...] = ()


@record
class Pause(Request[SnapshotRef]):
    """Snapshot, then release everything; the sandbox is paused until resumed."""

    op: ClassVar[Op] = Op.PAUSE
    sandbox_id: str
    memory: bool = False
    env_names: tuple[str, ...] = ()


@record
class ListSnapshots(Request[list[tuple[str, str, float, int]]]):
    """(snapshot_id, sandbox_id, created_at, size_bytes) of every snapshot."""

    op: ClassVar[Op] = Op.LIST_SNAPSHOTS


@record
class DeleteSnapshot(Request[None]):
    """Forget a snapshot (its blobs go at the next gc); works on an unreadable manifest too."""

    op: ClassVar[Op] = Op.DELETE_SNAPSHOT
    snapshot_id: str


@record
class GcReport:
    """What a snapshot gc did: blobs deleted, manifests that cannot be read, the store it swept."""

    removed: int
    broken: tuple[str, ...]
    store: str


@record
class GcSnapshots(Request[GcReport]):
    """Finish or undo dead snapshot operations, then delete unreferenced blobs (now: no grace period)."""

    op: ClassVar[Op] = Op.GC_SNAPSHOTS
    now: bool = False


# ---- network


@record
class UpdateNetwork(Request[str]):
    """Replace the egress policy; returns it in words."""

    op: ClassVar[Op] = Op.NETWORK_UPDATE
    sandbox_id: str
    network: policy.Network | str  # as Create's


@record
class NetworkPolicy(Request[str]):
    op: ClassVar[Op] = Op.NETWORK_POLICY
    sandbox_id: str


@record
class NetworkLog(Request[list[NetEvent]]):
    op: ClassVar[Op] = Op.NETWORK_LOG
    sandbox_id: str


@record
class Export(Request[Transcript]):
    """Everything recorded of a sandbox, in any state (destroyed too): its record, stage timings,
    state changes, commands and code runs, egress events, snapshots and cost
    (:mod:`warmbox.transcript` writes it as NDJSON). Each snapshot's id starts a new sandbox at
    that checkpoint: ``create(from_snapshot=id)``."""

    op: ClassVar[Op] = Op.EXPORT
    sandbox_id: str


# ---- warm pools


@record
class PoolsList(Request[list[PoolStatus]]):
    """Every configured warm pool: target, bounds, ready/warming counts, hits/misses, warm-up cost."""

    op: ClassVar[Op] = Op.POOLS_LIST


@record
class PoolsResize(Request[PoolStatus]):
    """Set a pool's target (clamped to its bounds) and/or its min/max (None: keep); the daemon acts on it."""

    op: ClassVar[Op] = Op.POOLS_RESIZE
    name: str
    target: int | None = None
    min: int | None = None
    max: int | None = None


# ---- ports


@record
class PortConnect(Request[PortStream]):
    """One TCP connection to ``port`` on the sandbox's own loopback (what ``get_host`` forwards
    each accepted connection to); PortNotListening if nothing listens there. The sandbox gets no
    network by it: the agent dials its own loopback. timeout: seconds for the connect."""

    op: ClassVar[Op] = Op.PORTS_CONNECT
    sandbox_id: str
    port: int
    timeout: float = 30.0


# ---- named volumes (a tenant's own: another tenant's name is VolumeNotFound, as an unknown one)


@record
class VolumeCreate(Request[VolumeInfo]):
    """A new empty volume of ``size_mb`` MiB (its limit: a writer inside gets NoSpace); VolumeError
    if one of that name exists. Mount it with ``create(volumes=[Volume(name, path)])``."""

    op: ClassVar[Op] = Op.VOLUME_CREATE
    name: str
    size_mb: int


@record
class VolumeList(Request[list[VolumeInfo]]):
    """Your volumes, by name."""

    op: ClassVar[Op] = Op.VOLUME_LIST


@record
class VolumeGet(Request[VolumeInfo]):
    op: ClassVar[Op] = Op.VOLUME_GET
    name: str


@record
class VolumeDelete(Request[None]):
    """Delete a volume and its files; VolumeInUse while a live or paused sandbox mounts it."""

    op: ClassVar[Op] = Op.VOLUME_DELETE
    name: str


# ---- templates

ProgressSink = Callable[[TemplateBuildEvent], object]  # may return an awaitable: awaited


@record
class TemplateBuild(Request[TemplateInfo]):
    """Build ``template`` as the next version of the template ``name`` (the same spec and image as
    the latest version: that version again). context: a tar of the COPY steps' sources, made on the
    caller's side (``warmbox.engine.builder.pack_context``; the SDK and CLI make it). on_progress:
    a TemplateBuildEvent per step as it goes (cached / running / done / failed / config). Over
    HTTP: NDJSON events, then the result. TemplateBuildError names a failed step and its log."""

    op: ClassVar[Op] = Op.TEMPLATE_BUILD
    name: str
    template: templates.Template
    context: bytes | None = None
    on_progress: ProgressSink | None = dataclasses.field(default=None, compare=False, repr=False, metadata=LOCAL)


@record
class TemplateList(Request[list[TemplateInfo]]):
    """Every built template version of the caller's (all versions; the latest last per name)."""

    op: ClassVar[Op] = Op.TEMPLATE_LIST


@record
class TemplateGet(Request[TemplateInfo]):
    """One built template: its latest version, or ``version``; TemplateNotFound if none."""

    op: ClassVar[Op] = Op.TEMPLATE_GET
    name: str
    version: int | None = None


@record
class TemplateDelete(Request[list[TemplateInfo]]):
    """Remove a template's versions (all, or ``version``); the records removed. TemplateInUse if a
    sandbox, pool or snapshot uses it (its layers go at the next layer gc)."""

    op: ClassVar[Op] = Op.TEMPLATE_DELETE
    name: str
    version: int | None = None


@record
class TemplateGcReport:
    """What a template gc removed (dry_run: would remove): layer digests, microVM root files, the
    bytes they took; roots kept only because another home's registry could not be read;
    shared_layers: the layer blobs deleted from the cluster's object store (no template version
    of the shared registry names them; older than the grace period)."""

    layers: tuple[str, ...]
    roots: tuple[str, ...]
    bytes_freed: int
    dry_run: bool
    kept_roots: tuple[str, ...] = ()
    shared_layers: tuple[str, ...] = ()


@record
class TemplateGc(Request[TemplateGcReport]):
    """Remove the layers no template version, built-in image, sandbox or snapshot (of any home)
    uses and the microVM roots of images nothing runs (admin); dry_run: only say what."""

    op: ClassVar[Op] = Op.TEMPLATE_GC
    dry_run: bool = False


# ---- the approval queue (questions a step waits on: a start over budget, a large create, a network ask)


@record
class ApprovalsList(Request[list[Approval]]):
    """The approval questions, newest first: a tenant key's own tenant's, an admin key's (and the
    host's) every tenant's. pending_only: only those still open. limit: at most this many (1-1000).
    tenant: only that tenant's ("" the host's; None: all the caller may see; a tenant key naming
    another tenant gets none)."""

    op: ClassVar[Op] = Op.APPROVALS_LIST
    pending_only: bool = False
    limit: int = 200
    tenant: str | None = None


@record
class ApprovalAnswer(Request[Approval]):
    """Answer an open question, once (ApprovalClosed for a second answer or after its deadline):
    "approve"/"deny" a create, resume or pool resize (an admin key's, or the host's, to give),
    "allow_once"/"allow_always"/"deny" a network question (its tenant's key may answer it)."""

    op: ClassVar[Op] = Op.APPROVAL_ANSWER
    approval_id: str
    decision: str


# ---- cluster nodes (the API tier of a cluster, ``warmbox serve --cluster``; a single host refuses them)


@record
class DrainReport:
    """What a node drain did: the sandboxes moved to other nodes (paused there, resumed here: the
    same ids, files and code-context state kept), those already paused (left paused: any node
    resumes them), those it could not move (``failed``: "id: why"), and the node's state after."""

    node: str
    moved: tuple[str, ...]
    paused: tuple[str, ...]
    failed: tuple[str, ...]
    state: str


@record
class NodeDrain(Request[DrainReport]):
    """Take a node out of service (admin): no new sandbox is placed on it; each of its live
    sandboxes is paused and resumed on another node; then it is marked down (it stays draining,
    the report's ``state``, if a sandbox could not be paused: run the drain again). DrainRefused for
    the last node that is up; NodeNotFound for an unknown name. timeout: seconds for the whole drain."""

    op: ClassVar[Op] = Op.NODE_DRAIN
    name: str
    timeout: float = 600.0


REQUESTS: dict[Op, type[Request[Any]]] = {
    cls.op: cls
    for cls in (
        Create,
        Connect,
        Resume,
        Detach,
        ListSandboxes,
        Info,
        Timings,
        Logs,
        Doctor,
        ChooseTier,
        Kill,
        SetTimeout,
        Metrics,
        MetricsHistory,
        Ping,
        RecordFirstCommand,
        Exec,
        StartProcess,
        ConnectProcess,
        StartAndConnect,
        SendStdin,
        KillProcess,
        ListProcesses,
        ResizePty,
        RunCode,
        CreateAndRun,
        CreateContext,
        RemoveContext,
        ListContexts,
        RestartContext,
        ReadFile,
        ReadFileStream,
        WriteFile,
        WriteFileStream,
        WriteFiles,
        Rename,
        SignFileUrl,
        UploadDir,
        DownloadDir,
        WatchDir,
        ListDir,
        Stat,
        MakeDir,
        Remove,
        Snapshot,
        Pause,
        ListSnapshots,
        DeleteSnapshot,
        GcSnapshots,
        UpdateNetwork,
        NetworkPolicy,
        NetworkLog,
        PoolsList,
        PoolsResize,
        PortConnect,
        VolumeCreate,
        VolumeList,
        VolumeGet,
        VolumeDelete,
        TemplateBuild,
        TemplateList,
        TemplateGet,
        TemplateDelete,
        TemplateGc,
        Commands,
        Export,
        ApprovalsList,
        ApprovalAnswer,
        NodeDrain,
    )
}
