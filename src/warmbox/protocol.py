"""The one wire protocol between host and guest: length-prefixed frames, one typed message each.

Stdlib-only on purpose: the guest agent imports this module inside the sandbox with
``python3 -I -S`` and nothing else of warmbox.

Frame layout (all integers big-endian)::

    u32 header_len | u32 body_len | header (UTF-8 JSON object) | body (raw bytes)

The header carries ``{"type": <name>, "id": <request id>, ...fields}``; a message's single
``bytes`` field (``data``) travels in the body so file contents and command output are never
base64-inflated. Decoding is closed: an unknown ``type``, an unknown or missing field, a
wrong field type, or a frame larger than :data:`MAX_FRAME` is a :class:`ProtocolViolation`.
Every message belongs to one direction; each side decodes only what the other side may send.

Messages declare their fields as plain class annotations (``argv: list[str]``), read back as
strings (``from __future__ import annotations``) against a small closed table of wire types when
the class is created: no dataclasses, enum or typing at runtime, because the guest agent pays for
every import on each sandbox's cold start.
"""

from __future__ import annotations

import struct

try:  # the json package's C accelerator alone: json itself imports re and enum (~0.6 MiB, ~4 ms)
    import _json as _cjson
except ImportError:  # pragma: no cover - an interpreter without it: the json package (_loads, _dumps)
    _cjson = None  # type: ignore[assignment]

TYPE_CHECKING = False  # typing itself is not imported at runtime: see the module docstring
if TYPE_CHECKING:
    from typing import ClassVar, Protocol, Self, TypeVar

    _C = TypeVar("_C", bound="_Closed")

    class _Readable(Protocol):
        def recv(self, n: int, /) -> bytes: ...


# v7: listing and restarting code contexts, a run's own environment, start-and-follow (issue 32);
# v6: templates and volumes (issue 17); v5: background processes, ports, files (16)
PROTOCOL_VERSION = 7
# The oldest agent the host still speaks to (a paused sandbox's memory holds the agent it had):
# it gets none of the newer messages, each refused on the host with the version it needs.
MIN_PROTOCOL_VERSION = 6
MAX_HEADER = 1 << 20  # 1 MiB of JSON is far more than any legal header
MAX_BODY = 4 << 20  # bytes per frame; larger payloads are chunked
MAX_FRAME = 8 + MAX_HEADER + MAX_BODY
CHUNK = 256 << 10  # preferred payload size when streaming files
_PREFIX = struct.Struct(">II")
PREFIX_SIZE = _PREFIX.size


class ProtocolViolation(Exception):
    """The peer sent something outside the protocol (malformed, oversized, unknown)."""


class _Member:
    """Declares one constant of a :class:`_Closed` set: ``NOT_FOUND = _Member("not_found")``.

    Replaced by the member itself when the class is created; ``__get__`` only tells type checkers
    that ``ErrorCode.NOT_FOUND`` is an ``ErrorCode``.
    """

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    def __get__(self, instance: object, owner: type[_C]) -> _C:
        return owner(self.value)


class _Closed(str):
    """A closed set of string constants: members are singletons, an unknown value raises.

    Used instead of enum.Enum, whose import alone costs the guest ~2 ms per cold start.
    """

    _members: ClassVar[dict[str, _Closed]]

    def __init_subclass__(cls) -> None:
        cls._members = {}
        for name, value in list(vars(cls).items()):
            if isinstance(value, _Member):
                member = str.__new__(cls, value.value)
                cls._members[value.value] = member
                setattr(cls, name, member)

    def __new__(cls, value: object) -> Self:
        member = cls._members.get(value) if isinstance(value, str) else None
        if not isinstance(member, cls):
            raise ValueError(f"{value!r} is not a valid {cls.__name__}")
        return member

    @property
    def value(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str.__str__(self)!r})"


class ErrorCode(_Closed):
    """Closed set of error codes the guest may report."""

    NOT_FOUND = _Member("not_found")
    EXISTS = _Member("exists")
    IS_A_DIRECTORY = _Member("is_a_directory")
    NOT_A_DIRECTORY = _Member("not_a_directory")
    PERMISSION_DENIED = _Member("permission_denied")
    NO_SPACE = _Member("no_space")
    INVALID = _Member("invalid")
    EXEC_FAILED = _Member("exec_failed")
    CONTEXT_NOT_FOUND = _Member("context_not_found")
    CONTEXT_DIED = _Member("context_died")
    LANGUAGE_UNAVAILABLE = _Member("language_unavailable")  # no code contexts of that language here
    NOT_REGULAR = _Member("not_regular")  # a read of a FIFO, device or socket: refused, never read
    TOO_LARGE = _Member("too_large")  # a read of more than its max_bytes
    UNSAFE_ARCHIVE = _Member("unsafe_archive")  # a tar member outside its directory, or a device/FIFO
    CONNECTION_REFUSED = _Member("connection_refused")  # PortConnect: nothing listens on that port
    INTERNAL = _Member("internal")


class FileType(_Closed):
    FILE = _Member("file")
    DIR = _Member("dir")
    SYMLINK = _Member("symlink")
    OTHER = _Member("other")


class FsEventType(_Closed):
    """What happened to a watched entry (E2B's FilesystemEventType; fsnotify's names)."""

    CREATE = _Member("create")  # made, or moved in
    WRITE = _Member("write")
    REMOVE = _Member("remove")
    RENAME = _Member("rename")  # moved away (its new name, if watched, is a create)
    CHMOD = _Member("chmod")  # mode, owner or times changed


_ENUMS: dict[str, type[_Closed]] = {"ErrorCode": ErrorCode, "FileType": FileType, "FsEventType": FsEventType}
_SCALARS: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool, "bytes": bytes}
# Every annotation a message field may have, spelled without spaces: anything else is refused
# when the message class is created, so the decoder below knows how to check each field.
WIRE_TYPES = frozenset((*_SCALARS, "list[str]", "dict[str,str]", *_ENUMS))


class Message:
    """Base of every message: keyword construction, equality and repr from its field annotations.

    Each annotation of a subclass is one field, in order; its type is one of :data:`WIRE_TYPES`.
    At most one field is ``bytes``: it travels as the frame's body. ``FIELDS`` (derived, do not
    set) holds ``(name, type)`` pairs for the decoder, type spelled as in ``WIRE_TYPES``.
    """

    FIELDS: ClassVar[tuple[tuple[str, str], ...]] = ()
    _body: ClassVar[str | None] = None
    _names: ClassVar[frozenset[str]] = frozenset()
    _header: ClassVar[tuple[tuple[str, str, type | None], ...]] = ()  # FIELDS but the body; scalar type
    _header_names: ClassVar[frozenset[str]] = frozenset()
    __slots__ = ("id",)
    id: int

    def __init_subclass__(cls) -> None:
        fields = dict(cls.FIELDS)
        # The class's own annotations only (the parent's fields are in FIELDS already); not
        # inspect.get_annotations, whose import the guest would pay for.
        for name, annotation in cls.__dict__.get("__annotations__", {}).items():  # noqa: RUF063
            if not isinstance(annotation, str):
                raise TypeError(
                    f"{cls.__name__}.{name}: annotations must be strings (from __future__ import annotations)"
                )
            tp = "".join(annotation.split())
            if tp not in WIRE_TYPES:
                raise TypeError(f"{cls.__name__}.{name}: {annotation!r} is not a wire type {sorted(WIRE_TYPES)}")
            if name == "type" or hasattr(Message, name):  # id, type: frame keys; the rest: Message's own
                raise TypeError(f"{cls.__name__}.{name}: reserved name")
            fields[name] = tp
        bodies = [n for n, t in fields.items() if t == "bytes"]
        if len(bodies) > 1:
            raise TypeError(f"{cls.__name__}: more than one bytes field {bodies}")
        cls.FIELDS = tuple(fields.items())
        cls._body = bodies[0] if bodies else None
        # Precomputed once per class for the hot path (every frame, on both sides).
        cls._names = frozenset(fields)
        cls._header = tuple((n, t, _SCALARS.get(t)) for n, t in cls.FIELDS if t != "bytes")
        cls._header_names = frozenset(n for n, _, _ in cls._header)

    def __init__(self, id: int, **values: object) -> None:
        self.id = id
        if values.keys() != self._names:
            raise TypeError(f"{type(self).__name__}: expected fields {sorted(self._names)}, got {sorted(values)}")
        self.__dict__.update(values)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            getattr(self, n) == getattr(other, n) for n in ("id", *(n for n, _ in self.FIELDS))
        )

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={getattr(self, n)!r}" for n in ("id", *(n for n, _ in self.FIELDS)))
        return f"{type(self).__name__}({parts})"


class Ping(Message):
    pass


class Exec(Message):
    """Run a process. ``argv`` is exec'd directly; a shell string is sent as ``["/bin/sh", "-c", cmd]``.

    ``timeout_s`` is wall-clock seconds (0 = none); on expiry every process the command ever
    started is killed, double-forked and setsid()ed ones included (its own cgroup or PID
    namespace: agent.Scopes). On a normal exit what it left running stays. ``max_output`` caps
    stdout+stderr bytes. When ``stdin`` is true the host follows with :class:`StdinData` frames.
    """

    argv: list[str]
    env: dict[str, str]
    cwd: str
    timeout_s: float
    max_output: int
    stdin: bool


class StdinData(Message):
    data: bytes
    eof: bool


class Signal(Message):
    """Send ``signum`` to the whole process tree of a running exec (by its Started pid); SIGKILL
    ends every process it ever started, as a timeout does. Another pid: its tree, best effort."""

    pid: int
    signum: int


class Spawn(Message):
    """Start a background process and answer :class:`Started` at once; it outlives this request and
    this connection. Its stdout and stderr (or, with ``pty_cols`` > 0, its terminal's output)
    go into a bounded ring in the agent, read with :class:`Attach`; when the ring is full its
    oldest bytes are dropped (and an attach says how many). Nobody has to read it: the process
    never blocks on its output. ``tag``: the caller's label, shown by :class:`ProcList`.
    ``user``: "user" (the sandbox user) or "root" (root of a user namespace: see the agent).
    """

    argv: list[str]
    env: dict[str, str]
    cwd: str
    tag: str
    user: str
    pty_cols: int
    pty_rows: int


class SpawnFollow(Spawn):
    """Start a background process as :class:`Spawn` does and follow it as :class:`Attach` does, in
    one request (v7): :class:`Started`, its output from the first byte, then :class:`Exited`. It
    is a background process like any (ProcList, Attach, ProcInput, Signal reach it; a Cancel stops
    the following only). ``stdin`` false: its stdin is closed at the start."""

    stdin: bool


class Attach(Message):
    """Stream a background process's output (Stdout/Stderr frames) from byte ``offset`` of it (0:
    all the ring still holds; :class:`OutputLost` first when bytes before the ring's start were
    asked for), live until it ends, then :class:`Exited`. ``output`` false: only the Exited.
    The host stops it early with :class:`Cancel`."""

    pid: int
    offset: int
    output: bool


class ProcInput(Message):
    """Bytes for a background process's stdin (or terminal); ``eof`` closes it. Answered by Ok."""

    pid: int
    data: bytes
    eof: bool


class ProcResize(Message):
    """New size of a background process's terminal; answered by Ok."""

    pid: int
    cols: int
    rows: int


class ProcList(Message):
    """The running background processes: one :class:`ProcEntry` each, then Ok."""


class ReadFile(Message):
    """Read a regular file: answered by Chunk frames, then ChunkEnd, or a Failure at any point.

    Anything but a regular file (FIFO, device, socket; symlinks are followed) is refused with
    NOT_REGULAR without being read. ``max_bytes``: a file larger than that is refused up front
    (TOO_LARGE), and one that turns out longer while it is read (it grows, or reports st_size 0
    like /proc files) fails with TOO_LARGE before more than ``max_bytes`` was sent.
    ``window``: flow control, bytes the agent may send beyond what the host acknowledged with
    :class:`ReadAck` (0 = no flow control). The host stops a read early with :class:`Cancel`.
    """

    path: str
    max_bytes: int
    window: int


class ReadAck(Message):
    """During a ReadFile: the host took ``bytes`` more of its data (opens the agent's window)."""

    bytes: int


class Cancel(Message):
    """Stop the ReadFile or PortConnect with this id (no answer; frames the agent already sent
    still arrive)."""


class PortConnect(Message):
    """Open a TCP connection to ``port`` on the sandbox's own loopback and relay its bytes.

    Answered by Ok once connected, or a Failure (CONNECTION_REFUSED: nothing listens there). Then
    both ways: :class:`Chunk` frames carry data, :class:`ChunkEnd` is that side's end of data
    (a half-close). The host always ends a tunnel with :class:`Cancel` (the agent then closes the
    connection without an answer); a Failure from the agent ends it too. Flow control both ways:
    the agent sends at most ``window`` bytes beyond what the host acknowledged with
    :class:`ReadAck`; the host at most ``window`` beyond the agent's :class:`PortAck` (bytes
    written into the connection).
    """

    port: int
    window: int


class PortAck(Message):
    """During a PortConnect: the agent wrote ``bytes`` more of the host's data into the connection."""

    bytes: int


class WriteFile(Message):
    """Start a file upload: the agent answers Ok once it can take data; :class:`Chunk` frames
    follow, then :class:`ChunkEnd`; the answer is the file's Entry (or a Failure at any point).

    ``window``: flow control, bytes the host may send beyond what the agent acknowledged with
    :class:`WriteAck` (0 = none). ``atomic``: the data goes to a new temporary file in the same
    directory, which replaces ``path`` (by rename) only once all of it is written; a failed or
    abandoned upload leaves ``path`` as it was (``append`` must then be false).
    """

    path: str
    mode: int
    append: bool
    window: int
    atomic: bool


class WriteAck(Message):
    """During a WriteFile: the agent wrote ``bytes`` more of its data (opens the host's window)."""

    bytes: int


class TarCreate(Message):
    """Pack the directory ``path`` as a tar stream (see warmbox.safetar.pack: links are stored,
    never followed), answered like a ReadFile: Chunk frames within ``window`` bytes beyond the
    host's ReadAcks, then ChunkEnd, or a Failure; the host stops it early with Cancel."""

    path: str
    window: int


class TarExtract(Message):
    """Unpack a tar stream into the directory ``path`` (made if missing), sent like a WriteFile's
    data (Ok, then Chunk frames within ``window`` beyond the agent's WriteAcks, then ChunkEnd);
    answered by the directory's Entry, or UNSAFE_ARCHIVE naming the first member that would land
    outside it (what came before stays)."""

    path: str
    window: int


class WatchDir(Message):
    """Watch the directory ``path`` (and, if ``recursive``, every directory below it, new ones
    included; links are not followed): answered by Ok once watching, then a :class:`FsEvent` per
    change, at most ``window`` beyond what the host acknowledged with ReadAck (``bytes`` counts
    events; while the window is full the kernel's queue fills and then drops events). Ends with
    ChunkEnd when the directory itself goes; the host stops it with Cancel (no answer)."""

    path: str
    recursive: bool
    window: int


class FsEvent(Message):
    """One change below a watched directory; ``name`` is relative to it ("sub/file")."""

    name: str
    kind: FsEventType


class Rename(Message):
    """Move ``old`` to ``new`` (parents of ``new`` are created; a file there is replaced); answered
    by the Entry of ``new``."""

    old: str
    new: str


class ListDir(Message):
    path: str
    depth: int


class Stat(Message):
    path: str


class MakeDir(Message):
    path: str
    parents: bool


class Remove(Message):
    path: str
    recursive: bool


class ContextCreate(Message):
    """Create a code context (a long-lived interpreter). ``name`` empty = guest picks one."""

    name: str
    language: str
    cwd: str
    env: dict[str, str]


class ContextRun(Message):
    context: str
    code: str
    timeout_s: float
    max_output: int


class ContextRunEnv(ContextRun):
    """A ContextRun with variables set for that run only (v7): the interpreter's environment is
    what it was before once the run ends (a variable the run's own code set is kept, as E2B's)."""

    env: dict[str, str]


class ContextDelete(Message):
    context: str


class ContextList(Message):
    """The code contexts (v7): one :class:`ContextEntry` each, then Ok. The default contexts are
    listed once they run."""


class ContextRestart(Message):
    """End a context's interpreter and every process its cells started, and start a fresh one
    with the same name, language, working directory and creation environment (v7); answered by Ok."""

    context: str


class Configure(Message):
    """Adopt a new caller (a pool claim): add ``env`` to every later process and code context.

    reset_counts: execution counts and usage counters restart from zero. Answered by UsageReport
    (the counters *before* the reset), or Ok inside a code context.
    """

    env: dict[str, str]
    reset_counts: bool


class Reseed(Message):
    """After a restore from a memory snapshot: every sandbox restored from one snapshot starts with
    the same random-generator states. The agent reseeds the user-space generators it can reach
    (each code context's ``random`` module and NumPy's global generator, when imported) from
    ``seed`` (host entropy, 32..64 bytes) plus its own ``os.urandom``, and answers Ok. (The guest
    kernel's generator is reseeded by the tier before the agent is reachable: see the microvm
    backend.) Inside a code context it is answered by Ok too."""

    seed: bytes


class Quiesce(Message):
    """Before a memory checkpoint: the agent answers Ok, then closes its listening socket and every
    connection (host sockets cannot be checkpointed) and listens again once the host creates a
    ``resume`` file next to its socket (after the restore). Only for an agent listening on a path."""


class GetUsage(Message):
    """Ask for the agent's usage counters; answered by UsageReport."""


class Chunk(Message):
    data: bytes


class ChunkEnd(Message):
    pass


class Pong(Message):
    version: int
    pid: int


class Started(Message):
    """``pid``: the command's process as the agent sees it; where commands get their own PID
    namespace, its init (the command itself is PID 2 in there)."""

    pid: int


class Stdout(Message):
    data: bytes


class Stderr(Message):
    data: bytes


class Exited(Message):
    """Final frame of an exec. ``signal`` is 0 unless the process died of a signal. ``oom_kills``:
    how many processes the OOM killer ended in the agent's own cgroup while it ran (the guest's
    kernel counts them: microvm), or -1 where the agent cannot see that counter (the host reads
    the sandbox's cgroup instead)."""

    exit_code: int
    signal: int
    timed_out: bool
    truncated: bool
    duration_ms: float
    oom_kills: int


class OutputLost(Message):
    """During an Attach: ``size`` bytes of the process's output were dropped from its ring before
    what follows (nobody read them in time)."""

    size: int


class ProcEntry(Message):
    """One running background process (answer to ProcList). ``env``: what the caller gave."""

    pid: int
    argv: list[str]
    env: dict[str, str]
    cwd: str
    tag: str
    pty: bool


class Ok(Message):
    pass


class Failure(Message):
    code: ErrorCode
    message: str


class Entry(Message):
    """One file-system entry (answer to Stat, or one of many answering ListDir)."""

    name: str
    path: str
    kind: FileType
    size: int
    mode: int
    mtime: float
    target: str


class ContextCreated(Message):
    context: str


class ContextEntry(Message):
    """One code context (answer to ContextList)."""

    context: str
    language: str
    cwd: str


class Display(Message):
    """One representation of one output of a code run.

    ``result`` numbers the outputs of the run (several mimes share one number); ``main`` marks
    the value of the cell's last expression. ``mime`` e.g. text/plain, text/html, image/png.
    Every result has a text/plain representation, sent last: the host takes the result as
    complete then (and hands it to a result callback).
    """

    mime: str
    data: bytes
    main: bool
    result: int


class UsageReport(Message):
    """busy_ms: time with at least one command or code run in progress; runs: how many started."""

    busy_ms: float
    runs: int
    uptime_ms: float


class CodeDone(Message):
    """End of a code run. ``error_name`` empty means success. ``oom_kills`` as in Exited (the
    agent fills it in; the code context sends -1)."""

    error_name: str
    error_value: str
    traceback: str
    timed_out: bool
    truncated: bool
    execution_count: int
    duration_ms: float
    oom_kills: int


HOST_TO_GUEST: tuple[type[Message], ...] = (
    Ping,
    Exec,
    StdinData,
    Signal,
    Spawn,
    SpawnFollow,
    Attach,
    ProcInput,
    ProcResize,
    ProcList,
    ReadFile,
    WriteFile,
    TarCreate,
    TarExtract,
    WatchDir,
    Rename,
    ListDir,
    Stat,
    MakeDir,
    Remove,
    ContextCreate,
    ContextRun,
    ContextRunEnv,
    ContextDelete,
    ContextList,
    ContextRestart,
    Configure,
    GetUsage,
    Quiesce,
    Reseed,
    Chunk,
    ChunkEnd,
    ReadAck,
    Cancel,
    PortConnect,
)
GUEST_TO_HOST: tuple[type[Message], ...] = (
    Pong,
    Started,
    Stdout,
    Stderr,
    Exited,
    OutputLost,
    ProcEntry,
    Ok,
    Failure,
    Entry,
    ContextCreated,
    ContextEntry,
    Display,
    CodeDone,
    UsageReport,
    Chunk,
    ChunkEnd,
    PortAck,
    WriteAck,
    FsEvent,
)
# The code-context kernel and the agent exchange ContextRun(Env) / Stdout / Stderr / Display / CodeDone,
# and Configure / Reseed / Ok.


def _not_json(o: object) -> object:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


_CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}


class _Scan:
    """What json.JSONDecoder gives its C scanner: json.loads' defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_CONSTANTS.__getitem__)


_WS = " \t\n\r"  # JSON's whitespace
# json.dumps(o, separators=(",", ":")) and json.loads(b), through _json directly
_SCANNER = _cjson.make_scanner(_Scan()) if _cjson is not None else None  # type: ignore[arg-type]
_ENCODE = (
    _cjson.make_encoder(None, _not_json, _cjson.encode_basestring_ascii, None, ":", ",", False, False, True)
    if _cjson is not None
    else None
)


def _dumps(o: object) -> str:
    """``json.dumps(o, separators=(",", ":"))`` (ASCII: lone surrogates survive)."""
    if _ENCODE is None:  # pragma: no cover
        import json

        return json.dumps(o, separators=(",", ":"))
    return "".join(_ENCODE(o, 0))


def _loads(data: bytes) -> object:
    """``json.loads(data)``: the same value, or ValueError, for the same bytes."""
    # a BOM or a NUL among the first bytes: json reads UTF-16/32 or UTF-8-sig, let it
    if _SCANNER is None or data[:1] in (b"\xef", b"\xfe", b"\xff") or b"\0" in data[:4]:
        import json

        return json.loads(data)
    s = data.decode("utf-8", "surrogatepass")
    try:
        obj, end = _SCANNER(s, len(s) - len(s.lstrip(_WS)))
    except Exception:  # not JSON: json says how (the scanner's own errors need json.decoder imported)
        import json

        return json.loads(data)
    if s[end:].lstrip(_WS):  # extra data
        import json

        return json.loads(data)
    return obj


def encode(msg: Message) -> bytes:
    cls = type(msg)
    header: dict[str, object] = {"type": cls.__name__, "id": msg.id}
    for name, _, _ in cls._header:
        header[name] = getattr(msg, name)  # a _Closed member is a str: JSON writes its value
    body = b"" if cls._body is None else bytes(getattr(msg, cls._body))
    raw = _dumps(header).encode()  # ASCII: lone surrogates survive
    if len(raw) > MAX_HEADER or len(body) > MAX_BODY:
        raise ProtocolViolation(f"{cls.__name__} frame too large ({len(raw)}+{len(body)} bytes)")
    return _PREFIX.pack(len(raw), len(body)) + raw + body


def _check(name: str, value: object, tp: str) -> object:
    scalar = _SCALARS.get(tp)
    if scalar is not None:
        if scalar is float and type(value) is int:
            return float(value)
        if type(value) is not scalar:
            raise ProtocolViolation(f"field {name!r} must be {tp}")
        return value
    if tp == "list[str]":
        if type(value) is not list or any(type(v) is not str for v in value):
            raise ProtocolViolation(f"field {name!r} must be a list of strings")
        return value
    if tp == "dict[str,str]":
        if type(value) is not dict or any(type(v) is not str for v in value.values()):
            raise ProtocolViolation(f"field {name!r} must be an object of strings")
        return value
    try:
        return _ENUMS[tp](value)
    except (KeyError, ValueError):
        raise ProtocolViolation(f"field {name!r}: unknown value {value!r}") from None


_INDEXES: dict[tuple[type[Message], ...], dict[str, type[Message]]] = {}


def _index(allowed: tuple[type[Message], ...]) -> dict[str, type[Message]]:
    """``allowed`` by class name (callers pass a few constant tuples: the cache stays small)."""
    index = _INDEXES.get(allowed)
    if index is None:
        index = {c.__name__: c for c in allowed}
        if len(_INDEXES) < 64:
            _INDEXES[allowed] = index
    return index


def decode(header: bytes, body: bytes, allowed: tuple[type[Message], ...]) -> Message:
    """Parse one frame into a message of one of the ``allowed`` classes, or raise."""
    return _decode(header, body, _index(allowed))


def _decode(header: bytes, body: bytes, index: dict[str, type[Message]]) -> Message:
    try:
        obj = _loads(header)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ProtocolViolation("header is not JSON") from None
    if type(obj) is not dict:
        raise ProtocolViolation("header is not an object")
    kind = obj.pop("type", None)
    cls = index.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolViolation(f"unexpected message type {kind!r}")
    rid = obj.pop("id", None)
    if type(rid) is not int or not 0 <= rid < 1 << 53:
        raise ProtocolViolation(f"{kind}: id must be a non-negative integer")
    if obj.keys() != cls._header_names:
        extra, missing = obj.keys() - cls._header_names, cls._header_names - obj.keys()
        raise ProtocolViolation(f"{kind}: unknown fields {sorted(extra)} missing {sorted(missing)}")
    if body and cls._body is None:
        raise ProtocolViolation(f"{kind} carries no body")
    for name, tp, scalar in cls._header:
        value = obj[name]
        if scalar is None or type(value) is not scalar:  # the common case is checked inline
            obj[name] = _check(name, value, tp)
    if cls._body is not None:
        obj[cls._body] = body
    # Every field was checked above: construct without __init__'s second check of the names.
    msg = cls.__new__(cls)
    msg.id = rid
    vars(msg).update(obj)
    return msg


def split_prefix(prefix: bytes) -> tuple[int, int]:
    """Return (header_len, body_len) from the 8-byte prefix, enforcing the size bounds."""
    hlen, blen = _PREFIX.unpack(prefix)
    if hlen > MAX_HEADER or blen > MAX_BODY:
        raise ProtocolViolation(f"frame too large ({hlen}+{blen} bytes)")
    return hlen, blen


class FrameReader:
    """Splits a byte stream into messages: :meth:`feed` what arrived, then :meth:`next` until None.

    A frame's size bounds are checked as soon as its prefix is in, so what is held beyond the
    last feed is at most one incomplete frame (:data:`MAX_FRAME`).
    """

    __slots__ = ("_buf", "_index", "_pos")

    def __init__(self, allowed: tuple[type[Message], ...]) -> None:
        self._buf: bytes | bytearray = b""
        self._pos = 0  # where the next frame starts in _buf
        self._index = _index(allowed)

    def feed(self, data: bytes) -> None:
        if self._pos == len(self._buf):  # all taken: parse ``data`` in place, no copy
            self._buf, self._pos = data, 0
            return
        buf = self._buf
        if type(buf) is not bytearray:
            buf = self._buf = bytearray(memoryview(buf)[self._pos :])
            self._pos = 0
        buf += data

    def next(self) -> Message | None:
        """The next complete message, or None until more is fed. A bad frame raises
        ProtocolViolation once the ones before it were taken."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos >= PREFIX_SIZE:
            hlen, blen = _PREFIX.unpack_from(buf, pos)
            if hlen > MAX_HEADER or blen > MAX_BODY:
                raise ProtocolViolation(f"frame too large ({hlen}+{blen} bytes)")
            start = pos + PREFIX_SIZE
            mid = start + hlen
            end = mid + blen
            if end <= len(buf):
                self._pos = end
                if type(buf) is bytes:
                    header, body = buf[start:mid], buf[mid:end]
                else:
                    with memoryview(buf) as view:  # one copy each, and the view is gone before buf changes
                        header, body = bytes(view[start:mid]), bytes(view[mid:end])
                return _decode(header, body, self._index)
        if pos and type(buf) is bytearray:
            del buf[:pos]
            self._pos = 0
        return None

    def pending(self) -> int:
        """Bytes held of a frame that is not complete yet."""
        return len(self._buf) - self._pos

    def missing(self) -> int:
        """Bytes still to come before the frame in progress is complete (a lower bound while its
        prefix is not in)."""
        held = len(self._buf) - self._pos
        if held < PREFIX_SIZE:
            return PREFIX_SIZE - held
        hlen, blen = _PREFIX.unpack_from(self._buf, self._pos)
        return max(PREFIX_SIZE + int(hlen) + int(blen) - held, 0)


class SocketReader:
    """Blocking reads of whole messages (guest side): one ``recv`` takes in every frame that has
    arrived, and the next calls are served from that buffer. A ``recv`` that raises (a socket
    timeout) loses nothing: the next call goes on where it stopped."""

    __slots__ = ("_frames", "_size", "sock")

    def __init__(self, sock: _Readable, allowed: tuple[type[Message], ...], size: int = 64 << 10) -> None:
        self.sock = sock
        self._frames = FrameReader(allowed)
        self._size = size

    def recv(self) -> Message | None:
        """The next message; None at a clean EOF (between frames)."""
        frames = self._frames
        while True:
            msg = frames.next()
            if msg is not None:
                return msg
            # at most the rest of one frame beyond ``size``: bounded by MAX_FRAME
            data = self.sock.recv(max(self._size, frames.missing()))
            if not data:
                if frames.pending():
                    raise ProtocolViolation("connection closed mid-frame")
                return None
            frames.feed(data)


def recv_exact(sock: _Readable, n: int) -> bytes:
    """Blocking read of exactly n bytes from a socket; b'' at a clean EOF before any byte."""
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            if buf:
                raise ProtocolViolation("connection closed mid-frame")
            return b""
        buf += part
    return bytes(buf)


def recv_message(sock: _Readable, allowed: tuple[type[Message], ...]) -> Message | None:
    """Blocking receive of one message; None at EOF. Reads no byte beyond it (the socket may be
    handed on); a reader that owns its socket uses :class:`SocketReader` (fewer recv calls)."""
    prefix = recv_exact(sock, PREFIX_SIZE)
    if not prefix:
        return None
    hlen, blen = split_prefix(prefix)
    header = recv_exact(sock, hlen) if hlen else b""
    body = recv_exact(sock, blen) if blen else b""
    if len(header) != hlen or len(body) != blen:
        raise ProtocolViolation("connection closed mid-frame")
    return _decode(header, body, _index(allowed))
