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

Messages declare their fields as a compact ``FIELDS`` spec instead of using dataclasses and
typing: the guest agent pays for every import on each sandbox's cold start.
"""

from __future__ import annotations

import json
import struct

PROTOCOL_VERSION = 4
MAX_HEADER = 1 << 20  # 1 MiB of JSON is far more than any legal header
MAX_BODY = 4 << 20  # bytes per frame; larger payloads are chunked
MAX_FRAME = 8 + MAX_HEADER + MAX_BODY
CHUNK = 256 << 10  # preferred payload size when streaming files
_PREFIX = struct.Struct(">II")
PREFIX_SIZE = _PREFIX.size


class ProtocolViolation(Exception):
    """The peer sent something outside the protocol (malformed, oversized, unknown)."""


class _Closed(str):
    """A closed set of string constants: members are singletons, an unknown value raises.

    Used instead of enum.Enum, whose import alone costs the guest ~2 ms per cold start.
    """

    _members: dict

    def __init_subclass__(cls) -> None:
        cls._members = {}
        for name, value in list(vars(cls).items()):
            if name.isupper() and isinstance(value, str):
                member = str.__new__(cls, value)
                cls._members[value] = member
                setattr(cls, name, member)

    def __new__(cls, value: object) -> "_Closed":
        try:
            return cls._members[value]
        except (KeyError, TypeError):
            raise ValueError(f"{value!r} is not a valid {cls.__name__}") from None

    @property
    def value(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str.__str__(self)!r})"


class ErrorCode(_Closed):
    """Closed set of error codes the guest may report."""

    NOT_FOUND = "not_found"
    EXISTS = "exists"
    IS_A_DIRECTORY = "is_a_directory"
    NOT_A_DIRECTORY = "not_a_directory"
    PERMISSION_DENIED = "permission_denied"
    NO_SPACE = "no_space"
    INVALID = "invalid"
    EXEC_FAILED = "exec_failed"
    CONTEXT_NOT_FOUND = "context_not_found"
    CONTEXT_DIED = "context_died"
    NOT_REGULAR = "not_regular"  # a read of a FIFO, device or socket: refused, never read
    TOO_LARGE = "too_large"  # a read of more than its max_bytes
    INTERNAL = "internal"


class FileType(_Closed):
    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    OTHER = "other"


_ENUMS = {"ErrorCode": ErrorCode, "FileType": FileType}
_SCALARS = {"str": str, "int": int, "float": float, "bool": bool, "bytes": bytes}


class Message:
    """Base of every message: keyword construction, equality and repr from ``FIELDS``.

    ``FIELDS`` is ``"name:type ..."`` with type one of str, int, float, bool, bytes,
    list[str], dict[str,str], or an enum above. At most one field is bytes (the body).
    """

    FIELDS = ""
    _spec: tuple[tuple[str, str], ...] = ()
    _body: str | None = None
    __slots__ = ("id",)

    def __init_subclass__(cls) -> None:
        spec = tuple(tuple(item.split(":", 1)) for item in cls.FIELDS.split())
        assert not {"id", "type"} & {n for n, _ in spec}, "id and type are frame keys"
        cls._spec = spec  # type: ignore[assignment]
        bodies = [n for n, t in spec if t == "bytes"]
        assert len(bodies) <= 1, cls
        cls._body = bodies[0] if bodies else None
        cls.__slots__ = tuple(n for n, _ in spec)

    def __init__(self, id: int, **values: object) -> None:
        self.id = id
        names = {n for n, _ in self._spec}
        if set(values) != names:
            raise TypeError(f"{type(self).__name__}: expected fields {sorted(names)}, got {sorted(values)}")
        for name, value in values.items():
            setattr(self, name, value)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            getattr(self, n) == getattr(other, n) for n in ("id", *(n for n, _ in self._spec)))

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={getattr(self, n)!r}" for n in ("id", *(n for n, _ in self._spec)))
        return f"{type(self).__name__}({parts})"


class Ping(Message):
    FIELDS = ""


class Exec(Message):
    """Run a process. ``argv`` is exec'd directly; a shell string is sent as ``["/bin/sh", "-c", cmd]``.

    ``timeout_s`` is wall-clock seconds (0 = none); on expiry every process the command ever
    started is killed, double-forked and setsid()ed ones included (its own cgroup or PID
    namespace: agent.Scopes). On a normal exit what it left running stays. ``max_output`` caps
    stdout+stderr bytes. When ``stdin`` is true the host follows with :class:`StdinData` frames.
    """
    FIELDS = "argv:list[str] env:dict[str,str] cwd:str timeout_s:float max_output:int stdin:bool"


class StdinData(Message):
    FIELDS = "data:bytes eof:bool"


class Signal(Message):
    """Send ``signum`` to the whole process tree of a running exec (by its Started pid); SIGKILL
    ends every process it ever started, as a timeout does. Another pid: its tree, best effort."""
    FIELDS = "pid:int signum:int"


class ReadFile(Message):
    """Read a regular file: answered by Chunk frames, then ChunkEnd, or a Failure at any point.

    Anything but a regular file (FIFO, device, socket; symlinks are followed) is refused with
    NOT_REGULAR without being read. ``max_bytes``: a file larger than that is refused up front
    (TOO_LARGE), and one that turns out longer while it is read (it grows, or reports st_size 0
    like /proc files) fails with TOO_LARGE before more than ``max_bytes`` was sent.
    ``window``: flow control, bytes the agent may send beyond what the host acknowledged with
    :class:`ReadAck` (0 = no flow control). The host stops a read early with :class:`Cancel`.
    """
    FIELDS = "path:str max_bytes:int window:int"


class ReadAck(Message):
    """During a ReadFile: the host took ``bytes`` more of its data (opens the agent's window)."""
    FIELDS = "bytes:int"


class Cancel(Message):
    """Stop the ReadFile with this id (no answer; frames the agent already sent still arrive)."""
    FIELDS = ""


class WriteFile(Message):
    """Start a file upload; :class:`Chunk` frames follow, then :class:`ChunkEnd`."""
    FIELDS = "path:str mode:int append:bool"


class ListDir(Message):
    FIELDS = "path:str depth:int"


class Stat(Message):
    FIELDS = "path:str"


class MakeDir(Message):
    FIELDS = "path:str parents:bool"


class Remove(Message):
    FIELDS = "path:str recursive:bool"


class ContextCreate(Message):
    """Create a code context (a long-lived interpreter). ``name`` empty = guest picks one."""
    FIELDS = "name:str language:str cwd:str env:dict[str,str]"


class ContextRun(Message):
    FIELDS = "context:str code:str timeout_s:float max_output:int"


class ContextDelete(Message):
    FIELDS = "context:str"


class Configure(Message):
    """Adopt a new caller (a pool claim): add ``env`` to every later process and code context.

    reset_counts: execution counts and usage counters restart from zero. Answered by UsageReport
    (the counters *before* the reset), or Ok inside a code context.
    """

    FIELDS = "env:dict[str,str] reset_counts:bool"


class Reseed(Message):
    """After a restore from a memory snapshot: every sandbox restored from one snapshot starts with
    the same random-generator states. The agent reseeds the user-space generators it can reach
    (each code context's ``random`` module and NumPy's global generator, when imported) from
    ``seed`` (host entropy, 32..64 bytes) plus its own ``os.urandom``, and answers Ok. (The guest
    kernel's generator is reseeded by the tier before the agent is reachable: see the microvm
    backend.) Inside a code context it is answered by Ok too."""

    FIELDS = "seed:bytes"


class Quiesce(Message):
    """Before a memory checkpoint: the agent answers Ok, then closes its listening socket and every
    connection (host sockets cannot be checkpointed) and listens again once the host creates a
    ``resume`` file next to its socket (after the restore). Only for an agent listening on a path."""

    FIELDS = ""


class GetUsage(Message):
    """Ask for the agent's usage counters; answered by UsageReport."""

    FIELDS = ""


class Chunk(Message):
    FIELDS = "data:bytes"


class ChunkEnd(Message):
    FIELDS = ""


class Pong(Message):
    FIELDS = "version:int pid:int"


class Started(Message):
    """``pid``: the command's process as the agent sees it; where commands get their own PID
    namespace, its init (the command itself is PID 2 in there)."""
    FIELDS = "pid:int"


class Stdout(Message):
    FIELDS = "data:bytes"


class Stderr(Message):
    FIELDS = "data:bytes"


class Exited(Message):
    """Final frame of an exec. ``signal`` is 0 unless the process died of a signal. ``oom_kills``:
    how many processes the OOM killer ended in the agent's own cgroup while it ran (the guest's
    kernel counts them: microvm), or -1 where the agent cannot see that counter (the host reads
    the sandbox's cgroup instead)."""
    FIELDS = "exit_code:int signal:int timed_out:bool truncated:bool duration_ms:float oom_kills:int"


class Ok(Message):
    FIELDS = ""


class Failure(Message):
    FIELDS = "code:ErrorCode message:str"


class Entry(Message):
    """One file-system entry (answer to Stat, or one of many answering ListDir)."""
    FIELDS = "name:str path:str kind:FileType size:int mode:int mtime:float target:str"


class ContextCreated(Message):
    FIELDS = "context:str"


class Display(Message):
    """One representation of one output of a code run.

    ``result`` numbers the outputs of the run (several mimes share one number); ``main`` marks
    the value of the cell's last expression. ``mime`` e.g. text/plain, text/html, image/png.
    """
    FIELDS = "mime:str data:bytes main:bool result:int"


class UsageReport(Message):
    """busy_ms: time with at least one command or code run in progress; runs: how many started."""

    FIELDS = "busy_ms:float runs:int uptime_ms:float"


class CodeDone(Message):
    """End of a code run. ``error_name`` empty means success. ``oom_kills`` as in Exited (the
    agent fills it in; the code context sends -1)."""
    FIELDS = ("error_name:str error_value:str traceback:str timed_out:bool truncated:bool execution_count:int "
              "duration_ms:float oom_kills:int")


HOST_TO_GUEST: tuple[type[Message], ...] = (
    Ping, Exec, StdinData, Signal, ReadFile, WriteFile, ListDir, Stat, MakeDir, Remove,
    ContextCreate, ContextRun, ContextDelete, Configure, GetUsage, Quiesce, Reseed, Chunk, ChunkEnd,
    ReadAck, Cancel,
)
GUEST_TO_HOST: tuple[type[Message], ...] = (
    Pong, Started, Stdout, Stderr, Exited, Ok, Failure, Entry, ContextCreated, Display,
    CodeDone, UsageReport, Chunk, ChunkEnd,
)
# The code-context kernel and the agent exchange ContextRun / Stdout / Stderr / Display / CodeDone,
# and Configure / Reseed / Ok.


def encode(msg: Message) -> bytes:
    cls = type(msg)
    header: dict = {"type": cls.__name__, "id": msg.id}
    body = b""
    for name, _ in cls._spec:
        value = getattr(msg, name)
        if name == cls._body:
            body = bytes(value)
        elif isinstance(value, _Closed):
            header[name] = value.value
        else:
            header[name] = value
    raw = json.dumps(header, separators=(",", ":")).encode()  # ASCII: lone surrogates survive
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


def decode(header: bytes, body: bytes, allowed: tuple[type[Message], ...]) -> Message:
    """Parse one frame into a message of one of the ``allowed`` classes, or raise."""
    try:
        obj = json.loads(header)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ProtocolViolation("header is not JSON") from None
    if type(obj) is not dict:
        raise ProtocolViolation("header is not an object")
    kind = obj.pop("type", None)
    cls = next((c for c in allowed if c.__name__ == kind), None)
    if cls is None:
        raise ProtocolViolation(f"unexpected message type {kind!r}")
    rid = obj.pop("id", None)
    if type(rid) is not int or not 0 <= rid < 1 << 53:
        raise ProtocolViolation(f"{kind}: id must be a non-negative integer")
    expected = {n for n, _ in cls._spec if n != cls._body}
    if set(obj) != expected:
        extra, missing = set(obj) - expected, expected - set(obj)
        raise ProtocolViolation(f"{kind}: unknown fields {sorted(extra)} missing {sorted(missing)}")
    if body and cls._body is None:
        raise ProtocolViolation(f"{kind} carries no body")
    values = {n: _check(n, obj[n], t) for n, t in cls._spec if n != cls._body}
    if cls._body is not None:
        values[cls._body] = body
    return cls(rid, **values)


def split_prefix(prefix: bytes) -> tuple[int, int]:
    """Return (header_len, body_len) from the 8-byte prefix, enforcing the size bounds."""
    hlen, blen = _PREFIX.unpack(prefix)
    if hlen > MAX_HEADER or blen > MAX_BODY:
        raise ProtocolViolation(f"frame too large ({hlen}+{blen} bytes)")
    return hlen, blen



def recv_exact(sock, n: int) -> bytes:
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


def recv_message(sock, allowed: tuple[type[Message], ...]) -> Message | None:
    """Blocking receive of one message; None at EOF. Used by the guest side."""
    prefix = recv_exact(sock, PREFIX_SIZE)
    if not prefix:
        return None
    hlen, blen = split_prefix(prefix)
    header = recv_exact(sock, hlen) if hlen else b""
    body = recv_exact(sock, blen) if blen else b""
    if len(header) != hlen or len(body) != blen:
        raise ProtocolViolation("connection closed mid-frame")
    return decode(header, body, allowed)
