"""GuestSession: the only code that speaks the wire protocol to a guest agent; callers get typed results.

Everything the guest sends is parsed by :mod:`warmbox.engine.guest_client` into the closed set of
messages; here each exchange (exec, code, files, usage, configure, quiesce) becomes one method
returning a flat record from :mod:`warmbox.models`, and every guest ``Failure`` becomes the most
specific :class:`~warmbox.errors.WarmboxError`. No other module builds requests.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import codecs
import io
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import cast

from warmbox import protocol as p
from warmbox.engine.guest_client import (
    OUTPUT_BACKLOG,
    READ_WINDOW,
    WRITE_WINDOW,
    FileRead,
    GuestClient,
    PortTunnel,
    Stream,
    open_port,
)
from warmbox.errors import (
    ContextError,
    FileTooLarge,
    GuestProtocolError,
    InvalidArgument,
    IsADirectory,
    NoSpace,
    NotADirectory,
    NotARegularFile,
    PathExists,
    PathNotFound,
    PathPermissionDenied,
    PortNotListening,
    ProcessNotFound,
    SandboxError,
    SandboxStartError,
    SandboxTimeout,
    UnsafeArchive,
    Unsupported,
    UnsupportedLanguage,
)
from warmbox.models import (
    CodeContext,
    CommandResult,
    EntryInfo,
    Execution,
    ExecutionError,
    FilesystemEvent,
    FilesystemEventType,
    ProcessEvent,
    ProcessInfo,
    Result,
)
from warmbox.operations import WatchTask

MAX_PROCESS_LIST_BYTES = 16 << 20  # commands.list: what a guest's answer may make the host hold
MAX_CONTEXT_LIST = 256  # contexts.list: entries a guest may answer (agents hold at most 64, plus the defaults)
MAX_CONTEXT_LIST_BYTES = 1 << 20  # and the bytes of their names and directories
HOST_GRACE_S = 15.0  # the host's bound = the guest's timeout + this (kill and interrupt waits)
MAX_DISPLAY_BYTES = 64 << 20
MAX_RESULTS = 4096  # results of one run (display() calls, charts)
PING_TIMEOUT_S = 30.0
QUIESCE_REPLY_S = 30.0  # the agent's answer to Quiesce
QUIESCE_CLOSE_S = 5.0  # a quiesced agent closes its last connection within this (else: checkpoint anyway)
_ERR_TAIL = 64 << 10
TAR_MAX = 1 << 50  # a directory's tar stream has no size bound of its own (the sandbox's disk has)
UNCAPPED_READ = 1 << 50  # a streamed read without max_bytes: no bound of its own, as TAR_MAX

OomCounter = Callable[[], Awaitable[int]]
TextSink = Callable[[str], object]
ResultSink = Callable[[Result], object]
BytesSink = Callable[[bytes], object]
EventSink = Callable[[FilesystemEvent], object]

_FILE_ERRORS: dict[p.ErrorCode, type[SandboxError]] = {
    p.ErrorCode.NOT_FOUND: PathNotFound,
    p.ErrorCode.EXISTS: PathExists,
    p.ErrorCode.IS_A_DIRECTORY: IsADirectory,
    p.ErrorCode.NOT_A_DIRECTORY: NotADirectory,
    p.ErrorCode.PERMISSION_DENIED: PathPermissionDenied,
    p.ErrorCode.NO_SPACE: NoSpace,
    p.ErrorCode.NOT_REGULAR: NotARegularFile,
    p.ErrorCode.TOO_LARGE: FileTooLarge,
    p.ErrorCode.UNSAFE_ARCHIVE: UnsafeArchive,
}
_MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
_BASE64_FIELDS = frozenset({"png", "jpeg", "pdf"})


def _result(main: bool, fields: dict[str, object]) -> Result:
    return Result(is_main_result=main, **fields)  # type: ignore[arg-type]


def raise_failure(f: p.Failure, sandbox_id: str, what: str) -> None:
    """The typed error for a guest's Failure answer (always raises)."""
    cls = _FILE_ERRORS.get(f.code)
    if cls is not None:
        raise cls(f"{what}: {f.message}", sandbox_id)
    if f.code in (p.ErrorCode.CONTEXT_NOT_FOUND, p.ErrorCode.CONTEXT_DIED):
        raise ContextError(f"{what}: {f.message}", sandbox_id)
    if f.code is p.ErrorCode.INVALID:
        raise InvalidArgument(f"{what}: {f.message}")
    if f.code is p.ErrorCode.LANGUAGE_UNAVAILABLE:
        raise UnsupportedLanguage(f"{what}: {f.message}")
    raise SandboxError(f"{what}: {f.message}", sandbox_id)


def process_failure(f: p.Failure, sandbox_id: str, what: str) -> None:
    """The typed error for a Failure answering a request about a process (always raises)."""
    if f.code is p.ErrorCode.NOT_FOUND:
        raise ProcessNotFound(f"{what}: {f.message}", sandbox_id)
    raise_failure(f, sandbox_id, what)


def _entry(e: p.Entry) -> EntryInfo:
    return EntryInfo(
        name=e.name,
        path=e.path,
        type=e.kind.value,
        size=e.size,
        mode=e.mode,
        modified=e.mtime,
        symlink_target=e.target or None,
    )


class _Output:
    """stdout/stderr of one run: kept as bytes (or passed on raw), handed to callbacks as text."""

    def __init__(
        self,
        on_stdout: TextSink | None,
        on_stderr: TextSink | None,
        cap: int,
        sandbox_id: str,
        stdout_sink: BytesSink | None = None,
    ) -> None:
        self.cap = cap
        self.sandbox_id = sandbox_id
        self.out, self.err = bytearray(), bytearray()
        self.size = 0
        self._raw = stdout_sink
        self._on = {p.Stdout: on_stdout, p.Stderr: on_stderr}
        self._decoders = {
            p.Stdout: codecs.getincrementaldecoder("utf-8")("replace"),
            p.Stderr: codecs.getincrementaldecoder("utf-8")("replace"),
        }

    def feed(self, msg: p.Message) -> bool:
        """Take a Stdout/Stderr frame; False for any other message."""
        kind = type(msg)
        if kind is p.Stdout:
            assert isinstance(msg, p.Stdout)
            data = msg.data
            if self._raw is not None:
                self._raw(data)
            else:
                self.out += data
        elif kind is p.Stderr:
            assert isinstance(msg, p.Stderr)
            data = msg.data
            self.err += data
            if self._raw is not None and len(self.err) > _ERR_TAIL:  # a stream's stderr: its tail is enough
                del self.err[:-_ERR_TAIL]
        else:
            return False
        self.size += len(data)
        if self.size > self.cap:  # the guest ignored the cap: it is misbehaving
            raise GuestProtocolError("guest sent more output than the cap", self.sandbox_id)
        callback = self._on[kind]
        if callback is not None:
            callback(self._decoders[kind].decode(data))
        return True

    def text(self) -> tuple[str, str]:
        return self.out.decode("utf-8", "replace"), self.err.decode("utf-8", "replace")


WATCH_WINDOW = 256  # events the agent may send beyond what the callback took


class DirWatcher(WatchTask):
    """One running WatchDir: a task takes each FsEvent, awaits ``on_event`` with it, then acks it
    (so the guest sends at most WATCH_WINDOW events ahead of the callback); ends at stop(), when
    the directory goes, or at an error (kept for wait())."""

    def __init__(self, sandbox_id: str, path: str, stream: Stream, on_event: EventSink) -> None:
        self.sandbox_id = sandbox_id
        self.path = path
        self._stream = stream
        super().__init__(on_event)

    async def _run(self) -> None:
        stream, taken = self._stream, 0
        try:
            while True:
                msg = await stream.next(p.FsEvent, p.ChunkEnd)
                if isinstance(msg, p.ChunkEnd):
                    return  # the directory itself went
                if isinstance(msg, p.Failure):
                    raise_failure(msg, self.sandbox_id, f"watch {self.path}")
                assert isinstance(msg, p.FsEvent)
                event = FilesystemEvent(name=msg.name, type=FilesystemEventType(msg.kind.value))
                await self._deliver(event)
                taken += 1
                if taken >= WATCH_WINDOW // 4:
                    await stream.send(p.ReadAck(stream.id, bytes=taken))
                    taken = 0
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a typed error, or the callback's own: wait() raises it
            self._error = e
        finally:
            stream.cancel()  # the guest stops (no-op once the stream is closed)

    def _halt(self) -> None:
        self._stream.cancel()


class FileChunks:
    """One flow-controlled file read: ``await next()`` gives the next chunk (None at the end) and
    raises typed errors (FileTooLarge, SandboxTimeout, ...); ``cancel()`` stops it in the guest."""

    def __init__(self, sandbox_id: str, path: str, reader: FileRead, timeout: float | None) -> None:
        self.sandbox_id = sandbox_id
        self.path = path
        self._reader = reader
        self._timeout = timeout

    @property
    def received(self) -> int:
        return self._reader.received

    @property
    def done(self) -> bool:
        return self._reader.done

    async def next(self) -> bytes | None:
        if self._reader.done:
            return None
        try:
            msg = await self._reader.next(self._timeout)
        except SandboxTimeout:
            raise SandboxTimeout(f"read {self.path}: no data within {self._timeout:g} s", self.sandbox_id) from None
        if isinstance(msg, p.Failure):
            raise_failure(msg, self.sandbox_id, f"read {self.path}")
        return msg.data if isinstance(msg, p.Chunk) else None

    def cancel(self) -> None:
        """Stop the read in the guest (no-op once over). On the event loop."""
        self._reader.cancel()


class PortConnection:
    """A TCP connection to a port inside the sandbox, relayed over the agent's connection.

    ``read()`` gives the server's bytes (None at its end of data); ``write()`` sends bytes to it,
    waiting while the agent's window is full; ``write_eof()`` half-closes; ``close()`` ends the
    connection in the sandbox (always call it; idempotent). Errors are typed (GuestProtocolError
    for a guest breaking the tunnel's rules, SandboxError for a connection that broke).
    """

    def __init__(self, sandbox_id: str, port: int, tunnel: PortTunnel) -> None:
        self.sandbox_id = sandbox_id
        self.port = port
        self._tunnel = tunnel
        self.on_close: Callable[[], object] | None = None  # called once, by the first close()

    async def read(self) -> bytes | None:
        msg = await self._tunnel.read()
        if isinstance(msg, p.Failure):
            raise SandboxError(f"port {self.port}: {msg.message}", self.sandbox_id)
        return None if msg is None else cast(p.Chunk, msg).data

    async def write(self, data: bytes) -> None:
        await self._tunnel.write(data)

    async def write_eof(self) -> None:
        await self._tunnel.write_eof()

    def close(self) -> None:
        self._tunnel.cancel()
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()


class ProcessOutput:
    """A background process's output over the guest connection (operations.ProcessStream): events
    until it ends, then ``result``. ``pty``: the output is a terminal's (raw bytes, not text)."""

    def __init__(self, sandbox_id: str, pid: int, stream: Stream, pty: bool) -> None:
        self.sandbox_id = sandbox_id
        self._pid = pid
        self._stream = stream
        self._pty = pty
        self._result: CommandResult | None = None
        self._done = False
        self.stdout_bytes = self.stderr_bytes = 0  # of the output received (what was lost is not here)
        # called once with the result when the process's end arrives (the front records it)
        self.on_end: Callable[[CommandResult, ProcessOutput], object] | None = None
        self._decoders = {
            p.Stdout: codecs.getincrementaldecoder("utf-8")("replace"),
            p.Stderr: codecs.getincrementaldecoder("utf-8")("replace"),
        }

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def result(self) -> CommandResult | None:
        return self._result

    async def next(self) -> ProcessEvent | None:
        while not self._done:
            try:
                msg = await self._stream.next(p.Stdout, p.Stderr, p.OutputLost, p.Exited)
            except BaseException:
                self.cancel()
                raise
            if isinstance(msg, p.Failure):
                self.cancel()
                process_failure(msg, self.sandbox_id, f"commands.connect({self._pid})")
            if isinstance(msg, p.OutputLost):
                return ProcessEvent("lost", size=msg.size)
            if isinstance(msg, p.Exited):
                self._done = True
                self._stream.close()
                self._result = CommandResult(
                    exit_code=msg.exit_code,
                    stdout="",
                    stderr="",
                    timed_out=False,
                    truncated=msg.truncated,
                    oom_killed=False,
                    signal=msg.signal,
                    duration_ms=msg.duration_ms,
                    pid=self._pid,
                )
                on_end, self.on_end = self.on_end, None
                if on_end is not None:
                    on_end(self._result, self)
                return None
            assert isinstance(msg, (p.Stdout, p.Stderr))
            if isinstance(msg, p.Stdout):
                self.stdout_bytes += len(msg.data)
            else:
                self.stderr_bytes += len(msg.data)
            if self._pty:
                return ProcessEvent("pty", data=msg.data)
            text = self._decoders[type(msg)].decode(msg.data)
            if text:
                return ProcessEvent("stdout" if isinstance(msg, p.Stdout) else "stderr", text=text)
        return None

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._stream.cancel()


class GuestSession:
    """One connection to a sandbox's guest agent, spoken through typed methods.

    ``oom``: reads the host's OOM-kill counter of the sandbox (tiers whose OOM killer is the
    host's); None where the guest's own kernel counts them and reports them with each result.
    Requests may run concurrently; each has the host's own time bound.
    """

    def __init__(self, client: GuestClient, oom: OomCounter | None = None) -> None:
        self._client = client
        self._oom = oom
        self._watches: set[DirWatcher] = set()
        self._version: int | None = None  # the agent's protocol version, once a ping said it
        self.sandbox_id = client.sandbox_id

    @classmethod
    async def connect(cls, socket_path: str, sandbox_id: str, oom: OomCounter | None = None) -> GuestSession:
        return cls(await GuestClient.connect(socket_path, sandbox_id), oom)

    @property
    def closed(self) -> bool:
        return self._client.closed

    async def close(self) -> None:
        await self._client.close()

    # ---- agent control

    async def ping(self, what: str = "guest agent") -> int:
        """The agent's protocol version, checked against the ones we speak (SandboxStartError otherwise)."""
        pong = await self._client.call(lambda i: p.Ping(i), p.Pong)
        if not isinstance(pong, p.Pong):
            raise SandboxStartError(f"{what} answered {pong!r}", self.sandbox_id)
        if not p.MIN_PROTOCOL_VERSION <= pong.version <= p.PROTOCOL_VERSION:
            raise SandboxStartError(
                f"{what} speaks protocol v{pong.version}, this warmbox v{p.MIN_PROTOCOL_VERSION}"
                f"..v{p.PROTOCOL_VERSION} (a snapshot of another warmbox version cannot be restored)",
                self.sandbox_id,
            )
        self._version = pong.version
        return pong.version

    async def _require(self, version: int, what: str) -> None:
        """Unsupported unless the agent speaks ``version`` (an agent an older warmbox started, kept
        in a paused sandbox's memory, knows fewer messages: one it does not know ends its connection)."""
        if self._version is None:
            await self.ping()
        assert self._version is not None
        if self._version < version:
            raise Unsupported(
                f"{what}: this sandbox's guest agent speaks protocol v{self._version} (it was started "
                f"by an older warmbox and kept in a snapshot); v{version} is needed",
                reason=f"guest agent protocol v{self._version}",
            )

    async def configure(self, env: dict[str, str], *, reset_counts: bool) -> None:
        """Add ``env`` to every later process's environment; reset_counts: cell numbers and
        usage counters restart from zero."""
        reply = await self._client.call(lambda i: p.Configure(i, env=env, reset_counts=reset_counts), p.UsageReport)
        if isinstance(reply, p.Failure):
            raise SandboxError(f"configure: {reply.message}", self.sandbox_id)

    async def reseed(self, seed: bytes | None = None) -> None:
        """New random generator states (every restore of one memory image would share them)."""
        value = os.urandom(32) if seed is None else seed
        reply = await self._client.call(lambda i: p.Reseed(i, seed=value), p.Ok)
        if isinstance(reply, p.Failure):
            raise SandboxError(f"reseed: {reply.message}", self.sandbox_id)

    async def quiesce(self, wait_closed: bool = False) -> None:
        """The agent drops its sockets for a memory checkpoint (a signal makes it listen again).
        wait_closed: the agent's sockets are host sockets (Capabilities.quiesce_drops_connection):
        return once it has ended this connection too, its last."""
        try:  # the agent answers at once; one that does not must not hold the pause forever
            reply = await asyncio.wait_for(self._client.call(lambda i: p.Quiesce(i), p.Ok), QUIESCE_REPLY_S)
        except TimeoutError:
            raise SandboxTimeout(f"quiesce: no answer within {QUIESCE_REPLY_S:g} s", self.sandbox_id) from None
        if isinstance(reply, p.Failure):
            raise SandboxError(f"quiesce: {reply.message}", self.sandbox_id)
        # the agent answers once its other sockets are closed, then ends this connection: the
        # checkpoint waits for that (a host socket open in the sandbox makes gVisor's save fail)
        if wait_closed:
            await self._client.wait_lost(QUIESCE_CLOSE_S)

    async def usage(self) -> tuple[float, int] | None:
        """(busy ms, runs) as the agent counts them; None if the answer is implausible."""
        r = await self._client.call(lambda i: p.GetUsage(i), p.UsageReport)
        if isinstance(r, p.UsageReport) and math.isfinite(r.busy_ms) and r.busy_ms >= 0 and r.runs >= 0:
            return r.busy_ms, r.runs
        return None

    # ---- commands and code

    async def _oom_before(self) -> int:
        return -1 if self._oom is None else await self._oom()

    async def _oom_killed(self, before: int, reported: int) -> bool:
        """Whether the call lost a process to the OOM killer: the host's counter against ``before``
        (an agent in a container could report anything), or the guest kernel's own count."""
        if self._oom is None:
            return reported > 0
        return (await self._oom()) > before

    async def exec(
        self,
        argv: builtins.list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str = "",
        timeout_s: float = 0.0,
        max_output: int = 1 << 20,
        stdin: bytes | Path | None = None,
        on_stdout: TextSink | None = None,
        on_stderr: TextSink | None = None,
        stdout_sink: BytesSink | None = None,
        what: str = "commands.run",
    ) -> CommandResult:
        """Run ``argv`` and wait for it. timeout_s: the guest's bound, seconds (0: none); the host
        waits that + HOST_GRACE_S. stdin: bytes, or a host file streamed in chunks. stdout_sink:
        stdout goes there raw and is not kept (``stdout`` is then empty)."""
        output = _Output(on_stdout, on_stderr, max_output, self.sandbox_id, stdout_sink)
        oom_before = await self._oom_before()
        pid = 0
        async with self._client.request(
            lambda i: p.Exec(
                i,
                argv=argv,
                env=env or {},
                cwd=cwd,
                timeout_s=timeout_s,
                max_output=max_output,
                stdin=stdin is not None,
            ),
            timeout=timeout_s + HOST_GRACE_S if timeout_s else None,
        ) as stream:
            if isinstance(stdin, bytes):
                for off in range(0, len(stdin), p.CHUNK):
                    await stream.send(p.StdinData(stream.id, data=stdin[off : off + p.CHUNK], eof=False))
                await stream.send(p.StdinData(stream.id, data=b"", eof=True))
            elif stdin is not None:
                with open(stdin, "rb") as f:
                    while chunk := f.read(p.CHUNK):
                        await stream.send(p.StdinData(stream.id, data=chunk, eof=False))
                await stream.send(p.StdinData(stream.id, data=b"", eof=True))
            while True:
                msg = await stream.next(p.Started, p.Stdout, p.Stderr, p.Exited)
                if output.feed(msg):
                    continue
                if isinstance(msg, p.Started):
                    pid = msg.pid
                elif isinstance(msg, p.Failure):
                    raise_failure(msg, self.sandbox_id, what)
                elif isinstance(msg, p.Exited):
                    exited = msg
                    break
        oom = await self._oom_killed(oom_before, exited.oom_kills)
        stdout, stderr = output.text()
        return CommandResult(
            exit_code=exited.exit_code,
            stdout=stdout,
            stderr=stderr,
            timed_out=exited.timed_out,
            truncated=exited.truncated,
            oom_killed=oom,
            signal=exited.signal,
            duration_ms=exited.duration_ms,
            pid=pid,
        )

    async def spawn(
        self,
        argv: builtins.list[str],
        *,
        env: dict[str, str],
        cwd: str,
        tag: str,
        user: str,
        cols: int = 0,
        rows: int = 0,
    ) -> int:
        """Start a background process (a terminal of cols x rows when given); its pid."""
        msg = await self._client.call(
            lambda i: p.Spawn(i, argv=argv, env=env, cwd=cwd, tag=tag, user=user, pty_cols=cols, pty_rows=rows),
            p.Started,
        )
        if isinstance(msg, p.Failure):
            raise_failure(msg, self.sandbox_id, "commands.run(background=True)")
        assert isinstance(msg, p.Started)
        return msg.pid

    async def spawn_follow(
        self,
        argv: builtins.list[str],
        *,
        env: dict[str, str],
        cwd: str,
        tag: str,
        user: str,
        cols: int = 0,
        rows: int = 0,
        stdin: bool = True,
    ) -> ProcessOutput:
        """Start a background process and follow it in one request (spawn, then attach from its
        first byte, without a second round trip); ``stdin`` false: its stdin closed at the start.
        An agent of protocol v6 gets the two requests instead."""
        if self._version is None:
            await self.ping()
        if self._version is not None and self._version < 7:
            pid = await self.spawn(argv, env=env, cwd=cwd, tag=tag, user=user, cols=cols, rows=rows)
            out = await self.attach(pid, pty=bool(cols))
            if not stdin and not cols:
                try:
                    await self.send_input(pid, b"", eof=True)
                except (InvalidArgument, ProcessNotFound):
                    pass  # it ended already, its stdin with it
            return out

        def make(i: int) -> p.Message:
            return p.SpawnFollow(
                i, argv=argv, env=env, cwd=cwd, tag=tag, user=user, pty_cols=cols, pty_rows=rows, stdin=stdin
            )

        stream = await self._client.open(make, lossy=OUTPUT_BACKLOG)
        try:
            msg = await stream.next(p.Started)
        except BaseException:
            stream.cancel()
            raise
        if isinstance(msg, p.Failure):
            stream.close()
            raise_failure(msg, self.sandbox_id, "commands.run")
        assert isinstance(msg, p.Started)
        return ProcessOutput(self.sandbox_id, msg.pid, stream, bool(cols))

    async def attach(self, pid: int, *, output: bool = True, pty: bool = False) -> ProcessOutput:
        """Follow a background process's output (no host-side time bound: it may run for ever). The
        agent sends output as it comes: what a slow reader leaves beyond OUTPUT_BACKLOG bytes is
        dropped on the host and reported as a "lost" event."""
        stream = await self._client.open(lambda i: p.Attach(i, pid=pid, offset=0, output=output), lossy=OUTPUT_BACKLOG)
        return ProcessOutput(self.sandbox_id, pid, stream, pty)

    async def send_input(self, pid: int, data: bytes, *, eof: bool = False) -> None:
        for off in range(0, max(len(data), 1), p.CHUNK):

            def make(
                i: int, part: bytes = data[off : off + p.CHUNK], last: bool = off + p.CHUNK >= len(data)
            ) -> p.Message:
                return p.ProcInput(i, pid=pid, data=part, eof=eof and last)

            msg = await self._client.call(make, p.Ok)
            if isinstance(msg, p.Failure):
                process_failure(msg, self.sandbox_id, f"send_stdin({pid})")

    async def resize(self, pid: int, cols: int, rows: int) -> None:
        msg = await self._client.call(lambda i: p.ProcResize(i, pid=pid, cols=cols, rows=rows), p.Ok)
        if isinstance(msg, p.Failure):
            process_failure(msg, self.sandbox_id, f"pty.resize({pid})")

    async def signal(self, pid: int, signum: int) -> bool:
        """Signal a process's whole tree (SIGKILL: every process it started); False if there is none."""
        msg = await self._client.call(lambda i: p.Signal(i, pid=pid, signum=signum), p.Ok)
        if isinstance(msg, p.Failure):
            if msg.code is p.ErrorCode.NOT_FOUND:
                return False
            raise_failure(msg, self.sandbox_id, f"commands.kill({pid})")
        return True

    async def processes(self) -> builtins.list[ProcessInfo]:
        out: builtins.list[ProcessInfo] = []
        held = 0  # bytes of what the guest sent, roughly
        async with self._client.request(lambda i: p.ProcList(i)) as stream:
            while True:
                msg = await stream.next(p.ProcEntry, p.Ok)
                if isinstance(msg, p.Failure):
                    raise_failure(msg, self.sandbox_id, "commands.list")
                if isinstance(msg, p.Ok):
                    return out
                assert isinstance(msg, p.ProcEntry)
                held += 64 + len(msg.cwd) + len(msg.tag) + sum(map(len, msg.argv))
                held += sum(len(k) + len(v) for k, v in msg.env.items())
                if held > MAX_PROCESS_LIST_BYTES:  # a guest cannot grow the host's list without bound
                    raise GuestProtocolError("guest sent a process list larger than the host's bound", self.sandbox_id)
                out.append(
                    ProcessInfo(
                        pid=msg.pid,
                        cmd=msg.argv[0] if msg.argv else "",
                        args=tuple(msg.argv[1:]),
                        envs=dict(msg.env),
                        cwd=msg.cwd,
                        tag=msg.tag,
                        pty=msg.pty,
                    )
                )

    async def run_code(
        self,
        code: str,
        *,
        context: str = "default",
        timeout_s: float = 0.0,
        max_output: int = 1 << 20,
        on_stdout: TextSink | None = None,
        on_stderr: TextSink | None = None,
        on_result: ResultSink | None = None,
        env: dict[str, str] | None = None,
    ) -> Execution:
        """Run a cell in a code context; its exception is ``Execution.error``, never raised.
        ``on_result`` gets each result once it is complete (the next one began, or the run ended).
        ``env``: variables for this run only (already validated)."""
        if env:
            await self._require(7, "env_vars for one run")
        output = _Output(on_stdout, on_stderr, max_output, self.sandbox_id)
        displays: dict[int, dict[str, object]] = {}
        display_bytes = 0
        mains: set[int] = set()
        current: int | None = None  # the result whose representations are arriving
        delivered: set[int] = set()

        def deliver(index: int | None) -> None:
            if on_result is not None and index is not None and index not in delivered and index in displays:
                delivered.add(index)
                on_result(_result(index in mains, displays[index]))

        oom_before = await self._oom_before()
        async with self._client.request(
            lambda i: (
                p.ContextRunEnv(i, context=context, code=code, timeout_s=timeout_s, max_output=max_output, env=env)
                if env
                else p.ContextRun(i, context=context, code=code, timeout_s=timeout_s, max_output=max_output)
            ),
            timeout=timeout_s + HOST_GRACE_S if timeout_s else None,
        ) as stream:
            while True:
                msg = await stream.next(p.Stdout, p.Stderr, p.Display, p.CodeDone)
                if output.feed(msg):
                    continue
                if isinstance(msg, p.Display):
                    display_bytes += len(msg.data) + 64  # empty frames count too
                    if display_bytes > MAX_DISPLAY_BYTES or len(displays) > MAX_RESULTS:
                        raise GuestProtocolError("guest sent too much rich output", self.sandbox_id)
                    field = _MIME_FIELDS.get(msg.mime)
                    if field is None:
                        continue
                    if msg.result != current:
                        deliver(current)
                        current = msg.result
                    bucket = displays.setdefault(msg.result, {})
                    bucket[field] = (
                        base64.b64encode(msg.data).decode("ascii")
                        if field in _BASE64_FIELDS
                        else msg.data.decode("utf-8", "replace")
                    )
                    if msg.main:
                        mains.add(msg.result)
                    if field == "text":  # the last representation of a result
                        deliver(msg.result)
                elif isinstance(msg, p.Failure):
                    raise_failure(msg, self.sandbox_id, "run_code")
                elif isinstance(msg, p.CodeDone):
                    deliver(current)
                    done = msg
                    break
        oom = await self._oom_killed(oom_before, done.oom_kills)
        results = tuple(_result(k in mains, v) for k, v in sorted(displays.items()))
        error = ExecutionError(done.error_name, done.error_value, done.traceback) if done.error_name else None
        stdout, stderr = output.text()
        return Execution(
            results=results,
            stdout=stdout,
            stderr=stderr,
            error=error,
            timed_out=done.timed_out,
            truncated=done.truncated,
            oom_killed=oom,
            execution_count=done.execution_count,
            duration_ms=done.duration_ms,
        )

    async def create_context(self, language: str, cwd: str, env: dict[str, str]) -> str:
        reply = await self._client.call(
            lambda i: p.ContextCreate(i, name="", language=language, cwd=cwd, env=env), p.ContextCreated
        )
        if isinstance(reply, p.Failure):
            raise_failure(reply, self.sandbox_id, "create_code_context")
        assert isinstance(reply, p.ContextCreated)
        return reply.context

    async def delete_context(self, context: str) -> None:
        reply = await self._client.call(lambda i: p.ContextDelete(i, context=context), p.Ok)
        if isinstance(reply, p.Failure):
            raise_failure(reply, self.sandbox_id, "remove_code_context")

    async def list_contexts(self) -> list[CodeContext]:
        await self._require(7, "listing code contexts")
        out: list[CodeContext] = []
        held = 0
        async with self._client.request(lambda i: p.ContextList(i)) as stream:
            while True:
                msg = await stream.next(p.ContextEntry, p.Ok)
                if isinstance(msg, p.Failure):
                    raise_failure(msg, self.sandbox_id, "list_code_contexts")
                if isinstance(msg, p.Ok):
                    return out
                assert isinstance(msg, p.ContextEntry)
                held += len(msg.context) + len(msg.language) + len(msg.cwd)
                # a guest cannot grow the host's list without bound
                if len(out) >= MAX_CONTEXT_LIST or held > MAX_CONTEXT_LIST_BYTES:
                    raise GuestProtocolError("guest sent more code contexts than the host's bound", self.sandbox_id)
                out.append(CodeContext(id=msg.context, language=msg.language, cwd=msg.cwd))

    async def restart_context(self, context: str) -> None:
        await self._require(7, "restarting a code context")
        reply = await self._client.call(lambda i: p.ContextRestart(i, context=context), p.Ok)
        if isinstance(reply, p.Failure):
            raise_failure(reply, self.sandbox_id, "restart_code_context")

    # ---- ports

    async def connect_port(self, port: int, timeout: float = PING_TIMEOUT_S) -> PortConnection:
        """A TCP connection to ``port`` on the sandbox's loopback (PortNotListening if refused).
        timeout: seconds for the agent's answer."""
        try:
            tunnel, answer = await asyncio.wait_for(open_port(self._client, port), timeout)
        except TimeoutError:
            raise SandboxTimeout(
                f"port {port}: the agent did not answer within {timeout:g} s", self.sandbox_id
            ) from None
        if isinstance(answer, p.Failure):
            if answer.code is p.ErrorCode.CONNECTION_REFUSED:
                raise PortNotListening(f"port {port}: {answer.message}", self.sandbox_id)
            raise_failure(answer, self.sandbox_id, f"port {port}")
        return PortConnection(self.sandbox_id, port, tunnel)

    # ---- files (paths already normalised by the caller)

    async def read_stream(self, path: str, *, max_bytes: int | None, timeout: float | None) -> FileChunks:
        """Start a flow-controlled read (``max_bytes`` None: no cap); ``timeout`` bounds each chunk's wait."""
        cap = UNCAPPED_READ if max_bytes is None else max_bytes
        return FileChunks(self.sandbox_id, path, await self._client.read_file(path, max_bytes=cap), timeout)

    async def read(self, path: str, *, max_bytes: int, timeout: float | None) -> bytes:
        """A whole file; ``timeout`` bounds the whole read (SandboxTimeout; the read stops in the guest)."""
        reader = await self._client.read_file(path, max_bytes=max_bytes, timeout=timeout)
        buf = io.BytesIO()  # grows in place: its getvalue() is no second copy
        try:
            while True:
                try:
                    msg = await reader.next()
                except SandboxTimeout:
                    raise SandboxTimeout(f"read {path}: not done within {timeout:g} s", self.sandbox_id) from None
                if isinstance(msg, p.Failure):
                    raise_failure(msg, self.sandbox_id, f"read {path}")
                if isinstance(msg, p.ChunkEnd):
                    break
                assert isinstance(msg, p.Chunk)
                buf.write(msg.data)
        finally:
            reader.cancel()  # no-op after the end
        return buf.getvalue()

    async def write(self, path: str, data: bytes, *, mode: int = 0o644, append: bool = False) -> EntryInfo:
        msg = await self._client.upload(path, data, mode=mode, append=append)
        if isinstance(msg, p.Failure):
            raise_failure(msg, self.sandbox_id, f"write {path}")
        assert isinstance(msg, p.Entry)
        return _entry(msg)

    async def rename(self, old: str, new: str) -> EntryInfo:
        msg = await self._client.call(lambda i: p.Rename(i, old=old, new=new), p.Entry)
        if isinstance(msg, p.Failure):
            raise_failure(msg, self.sandbox_id, f"rename {old} to {new}")
        assert isinstance(msg, p.Entry)
        return _entry(msg)

    async def write_stream(self, path: str, chunks: AsyncIterator[bytes], *, mode: int = 0o644) -> EntryInfo:
        """Write a file from chunks taken one at a time (flow-controlled: the host holds about one
        chunk); the file replaces ``path`` atomically once complete, and a failed or abandoned
        write leaves ``path`` as it was."""
        msg = await self._client.upload(path, chunks, mode=mode, atomic=True)
        if isinstance(msg, p.Failure):
            raise_failure(msg, self.sandbox_id, f"write {path}")
        assert isinstance(msg, p.Entry)
        return _entry(msg)

    async def pack(self, path: str, *, timeout: float | None) -> FileChunks:
        """The directory ``path`` as a flow-controlled tar stream; ``timeout`` bounds each chunk's wait."""
        reader = await self._client.read_stream(lambda i: p.TarCreate(i, path=path, window=READ_WINDOW), TAR_MAX, None)
        return FileChunks(self.sandbox_id, path, reader, timeout)

    async def unpack(self, path: str, chunks: AsyncIterator[bytes]) -> EntryInfo:
        """Extract a tar stream into the directory ``path`` (flow-controlled like write_stream);
        UnsafeArchive names the first member that would land outside it."""
        msg = await self._client.send_stream(lambda i: p.TarExtract(i, path=path, window=WRITE_WINDOW), chunks)
        if isinstance(msg, p.Failure):
            raise_failure(msg, self.sandbox_id, f"upload to {path}")
        if not isinstance(msg, p.Entry):
            raise GuestProtocolError(f"guest answered {type(msg).__name__} to an upload", self.sandbox_id)
        return _entry(msg)

    async def watch(self, path: str, recursive: bool, on_event: EventSink) -> DirWatcher:
        """Watch a directory (see DirWatcher); a missing path or a file raises here."""
        stream = await self._client.open(
            lambda i: p.WatchDir(i, path=path, recursive=recursive, window=WATCH_WINDOW),
            frames=WATCH_WINDOW + 8,  # a guest ignoring the window gets GuestProtocolError, not host memory
        )
        try:
            ready = await stream.next(p.Ok, timeout=PING_TIMEOUT_S)
            if isinstance(ready, p.Failure):
                raise_failure(ready, self.sandbox_id, f"watch {path}")
        except BaseException:
            stream.cancel()
            raise
        watcher = DirWatcher(self.sandbox_id, path, stream, on_event)
        self._watches.add(watcher)  # held while it runs, whoever else lets go of it
        watcher._task.add_done_callback(lambda _: self._watches.discard(watcher))
        return watcher

    async def list(self, path: str, depth: int) -> builtins.list[EntryInfo]:
        entries: builtins.list[EntryInfo] = []
        async with self._client.request(lambda i: p.ListDir(i, path=path, depth=depth)) as stream:
            while True:
                msg = await stream.next(p.Entry, p.Ok)
                if isinstance(msg, p.Failure):
                    raise_failure(msg, self.sandbox_id, f"list {path}")
                if isinstance(msg, p.Ok):
                    return entries
                assert isinstance(msg, p.Entry)
                entries.append(_entry(msg))

    async def stat(self, path: str) -> EntryInfo:
        msg = await self._client.call(lambda i: p.Stat(i, path=path), p.Entry)
        if isinstance(msg, p.Failure):
            raise_failure(msg, self.sandbox_id, f"stat {path}")
        assert isinstance(msg, p.Entry)
        return _entry(msg)

    async def make_dir(self, path: str) -> bool:
        """Create a directory and its parents; False if it already existed."""
        msg = await self._client.call(lambda i: p.MakeDir(i, path=path, parents=True), p.Ok)
        if isinstance(msg, p.Failure):
            if msg.code is p.ErrorCode.EXISTS:
                return False
            raise_failure(msg, self.sandbox_id, f"make_dir {path}")
        return True

    async def remove(self, path: str) -> None:
        msg = await self._client.call(lambda i: p.Remove(i, path=path, recursive=True), p.Ok)
        if isinstance(msg, p.Failure):
            raise_failure(msg, self.sandbox_id, f"remove {path}")
