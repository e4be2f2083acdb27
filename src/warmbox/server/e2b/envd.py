"""E2B's in-sandbox daemon (envd, port 49983) as operations: its Connect RPC services
``process.Process`` and ``filesystem.Filesystem`` (served by the ``connectrpc`` library over the
message and service modules shipped inside the ``e2b`` package: the JSON and binary codecs, unary
calls and server-streaming envelopes), and its plain HTTP routes ``/files`` and ``/health``."""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import dataclasses
import json
import secrets
import stat as statmod
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_pb as fpb
from e2b.envd.filesystem.filesystem_connect import Filesystem, FilesystemASGIApplication
from e2b.envd.process import process_pb as ppb
from e2b.envd.process.process_connect import Process, ProcessASGIApplication
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp
from python_multipart.multipart import parse_options_header
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from warmbox import operations as ops
from warmbox.errors import InvalidArgument, SandboxNotFound, WarmboxError
from warmbox.models import CommandResult, EntryInfo, FilesystemEvent, FilesystemEventType, State
from warmbox.server.e2b.common import (
    HOME,
    Service,
    Target,
    Tokens,
    answer,
    connect_error,
    data_target,
    e2b_path,
    error_response,
    signed_target,
)
from warmbox.server.e2b.common import warmbox_error_response as http_error
from warmbox.server.streams import raw_body

T = TypeVar("T")
MAX_MESSAGE = 16 << 20  # one Connect message (a stdin chunk is the largest)
KEEPALIVE_HEADER = "keepalive-ping-interval"
_FILE_TYPES = {"file": fpb.FileType.FILE, "dir": fpb.FileType.DIRECTORY, "symlink": fpb.FileType.SYMLINK}
_KIND = {"file": statmod.S_IFREG, "dir": statmod.S_IFDIR, "symlink": statmod.S_IFLNK}
_SIGNALS = {ppb.Signal.SIGKILL: 9, ppb.Signal.SIGTERM: 15}


def username(headers: Any) -> str:
    """The user of an envd call: ``Authorization: Basic base64("<user>:")`` (absent: "user")."""
    header = headers.get("authorization", "")
    if not header:
        return "user"
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        raise InvalidArgument("envd takes the user as 'Authorization: Basic base64(<user>:)'")
    try:
        user = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise InvalidArgument("the Authorization header's user is not base64 of '<user>:'") from None
    return user or "user"


def entry_pb(e: EntryInfo) -> fpb.EntryInfo:
    """A warmbox entry as envd's EntryInfo."""
    seconds = int(e.modified)
    return fpb.EntryInfo(
        name=e.name,
        type=_FILE_TYPES.get(e.type, fpb.FileType.UNSPECIFIED),
        path=e.path,
        size=e.size,
        mode=e.mode & 0o7777,
        permissions=statmod.filemode(_KIND.get(e.type, 0) | (e.mode & 0o7777)),
        owner="user",
        group="user",
        modified_time=Timestamp(seconds=seconds, nanos=int((e.modified - seconds) * 1e9)),
        symlink_target=e.symlink_target,
        is_symlink=e.type == "symlink",
    )


def end_event(result: CommandResult | None) -> ppb.ProcessEvent.EndEvent:
    """How a process ended, as envd says it (killed by a signal: exit code -1, ``signal: <name>``)."""
    if result is None:
        return ppb.ProcessEvent.EndEvent(
            exit_code=-1, exited=False, status="unknown", error="the process's end was not seen"
        )
    if result.signal:
        names = {9: "killed", 15: "terminated", 2: "interrupt", 1: "hangup"}
        return ppb.ProcessEvent.EndEvent(
            exit_code=-1, exited=False, status=f"signal: {names.get(result.signal, str(result.signal))}"
        )
    return ppb.ProcessEvent.EndEvent(exit_code=result.exit_code, exited=True, status=f"exit status {result.exit_code}")


def _started(pid: int) -> ppb.ProcessEvent:
    event: Oneof[Literal["start"], ppb.ProcessEvent.StartEvent] = Oneof("start", ppb.ProcessEvent.StartEvent(pid=pid))
    return ppb.ProcessEvent(event=event)


def _keepalive() -> ppb.ProcessEvent:
    event: Oneof[Literal["keepalive"], ppb.ProcessEvent.KeepAlive] = Oneof("keepalive", ppb.ProcessEvent.KeepAlive())
    return ppb.ProcessEvent(event=event)


def _ended(result: CommandResult | None) -> ppb.ProcessEvent:
    event: Oneof[Literal["end"], ppb.ProcessEvent.EndEvent] = Oneof("end", end_event(result))
    return ppb.ProcessEvent(event=event)


def _data(kind: str, chunk: bytes) -> ppb.ProcessEvent:
    if kind == "stdout":
        out: Oneof[Literal["stdout"], bytes] = Oneof("stdout", chunk)
        data = ppb.ProcessEvent.DataEvent(output=out)
    elif kind == "stderr":
        err: Oneof[Literal["stderr"], bytes] = Oneof("stderr", chunk)
        data = ppb.ProcessEvent.DataEvent(output=err)
    else:
        pty: Oneof[Literal["pty"], bytes] = Oneof("pty", chunk)
        data = ppb.ProcessEvent.DataEvent(output=pty)
    event: Oneof[Literal["data"], ppb.ProcessEvent.DataEvent] = Oneof("data", data)
    return ppb.ProcessEvent(event=event)


def _keepalive_s(ctx: RequestContext[Any, Any]) -> float:
    """How often a silent stream sends a keepalive: the client's Keepalive-Ping-Interval (1-300 s)."""
    try:
        interval = float(ctx.request_headers.get(KEEPALIVE_HEADER, "") or 0)
    except ValueError:
        interval = 0.0
    return min(max(interval, 1.0), 300.0) if interval else 30.0


def _left_s(ctx: RequestContext[Any, Any]) -> float | None:
    """Seconds left of the call's deadline (the client's Connect-Timeout-Ms), or None."""
    left = ctx.timeout_ms
    return None if left is None else max(left / 1000.0, 0.0)


class _Rpc:
    """What both services share: the call's target, and warmbox errors as Connect errors."""

    def __init__(self, service: Service, tokens: Tokens) -> None:
        self._service = service
        self._tokens = tokens

    def target(self, ctx: RequestContext[Any, Any]) -> Target:
        try:
            return data_target(self._service, self._tokens, ctx.request_headers)
        except WarmboxError as e:
            raise connect_error(e) from None

    async def run(self, t: Target, request: ops.Request[T]) -> T:
        try:
            return await t.front.handle(request)
        except WarmboxError as e:
            raise connect_error(e) from None


def _selector_pid(selector: Any) -> tuple[int | None, str | None]:
    match selector.selector if selector is not None else None:
        case Oneof(field="pid", value=pid):
            return int(pid), None
        case Oneof(field="tag", value=tag):
            return None, str(tag)
    raise ConnectError(Code.INVALID_ARGUMENT, "a process selector (pid or tag) is required")


class ProcessService(_Rpc, Process):
    """``process.Process``: commands are warmbox background processes (commands.*)."""

    async def _pid(self, t: Target, selector: Any) -> int:
        pid, tag = _selector_pid(selector)
        if pid is not None:
            return pid
        for p in await self.run(t, ops.ListProcesses(t.sandbox_id)):
            if p.tag == tag:
                return p.pid
        raise ConnectError(Code.NOT_FOUND, f"no process with tag {tag!r}")

    async def list(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        procs = await self.run(t, ops.ListProcesses(t.sandbox_id))
        return ppb.ListResponse(
            processes=[
                ppb.ProcessInfo(
                    config=ppb.ProcessConfig(cmd=p.cmd, args=list(p.args), envs=dict(p.envs), cwd=p.cwd or None),
                    pid=p.pid,
                    tag=p.tag or None,
                )
                for p in procs
            ]
        )

    async def start(self, request: Any, ctx: RequestContext[Any, Any]) -> AsyncIterator[Any]:
        t = self.target(ctx)
        cfg = request.process
        if cfg is None or not cfg.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "StartRequest.process.cmd is required")
        try:
            user = username(ctx.request_headers)
        except WarmboxError as e:
            raise connect_error(e) from None
        cols = rows = 0
        if request.has_field("pty") and request.pty is not None and request.pty.size is not None:
            cols, rows = request.pty.size.cols, request.pty.size.rows
        # stdin: unset means open (envd's default for old SDKs); the SDKs send false unless asked
        stdin = not request.has_field("stdin") or bool(request.stdin) or bool(cols)
        start = ops.StartAndConnect(
            t.sandbox_id,
            _shell(cfg.cmd, list(cfg.args)),
            envs=dict(cfg.envs) or None,
            cwd=e2b_path(cfg.cwd) if cfg.has_field("cwd") and cfg.cwd else HOME,
            tag=request.tag if request.has_field("tag") else "",
            user=user,
            pty_cols=cols,
            pty_rows=rows,
            stdin=stdin,
        )
        stream = await self.run(t, start)  # one round trip: started and followed in one guest request
        try:
            yield ppb.StartResponse(event=_started(stream.pid))
        except BaseException:
            stream.cancel()  # the client went away: the process runs on
            raise
        async for ev in self._follow(stream, ctx):
            yield ppb.StartResponse(event=ev)

    async def connect(self, request: Any, ctx: RequestContext[Any, Any]) -> AsyncIterator[Any]:
        t = self.target(ctx)
        pid = await self._pid(t, request.process)
        procs = await self.run(t, ops.ListProcesses(t.sandbox_id))
        pty = any(p.pid == pid and p.pty for p in procs)
        events = self._follow(await self.run(t, ops.ConnectProcess(t.sandbox_id, pid, pty=pty)), ctx)
        first = await anext(events)  # a process that is not there fails before the start event
        yield ppb.ConnectResponse(event=_started(pid))
        yield ppb.ConnectResponse(event=first)
        async for ev in events:
            yield ppb.ConnectResponse(event=ev)

    async def _follow(self, stream: ops.ProcessStream, ctx: RequestContext[Any, Any]) -> AsyncIterator[Any]:
        """The process's output events, keepalives while it is silent, then its end event."""
        interval = _keepalive_s(ctx)
        nxt: asyncio.Future[Any] | None = None
        try:
            while True:
                if nxt is None:
                    nxt = asyncio.ensure_future(stream.next())
                left = _left_s(ctx)
                done, _ = await asyncio.wait({nxt}, timeout=interval if left is None else min(interval, left))
                if not done:
                    if (left := _left_s(ctx)) is not None and left <= 0:
                        # the call's deadline (the SDK's timeout): the stream ends, the process runs on
                        raise ConnectError(Code.DEADLINE_EXCEEDED, "the call's timeout passed; the process runs on")
                    yield _keepalive()
                    continue
                try:
                    ev = nxt.result()
                except WarmboxError as e:
                    raise connect_error(e) from None
                nxt = None
                if ev is None:
                    yield _ended(stream.result)
                    return
                if ev.kind in ("stdout", "stderr"):
                    yield _data(ev.kind, ev.text.encode("utf-8", "surrogateescape"))
                elif ev.kind == "pty":
                    yield _data("pty", ev.data)
                # "lost" (output dropped from the agent's ring before anyone read it): envd has no such event
        finally:
            if nxt is not None:
                nxt.cancel()
            stream.cancel()  # the client went away or the process ended: the process itself runs on

    async def send_input(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        pid = await self._pid(t, request.process)
        await self.run(t, ops.SendStdin(t.sandbox_id, pid, _input_bytes(request.input)))
        return ppb.SendInputResponse()

    async def stream_input(self, request: AsyncIterator[Any], ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        pid: int | None = None
        async for msg in request:
            match msg.event:
                case Oneof(field="start", value=start):
                    pid = await self._pid(t, start.process)
                case Oneof(field="data", value=data):
                    if pid is None:
                        raise ConnectError(Code.INVALID_ARGUMENT, "StreamInput must start with a start event")
                    await self.run(t, ops.SendStdin(t.sandbox_id, pid, _input_bytes(data.input)))
        return ppb.StreamInputResponse()

    async def close_stdin(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        pid = await self._pid(t, request.process)
        await self.run(t, ops.SendStdin(t.sandbox_id, pid, b"", eof=True))
        return ppb.CloseStdinResponse()

    async def send_signal(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        pid = await self._pid(t, request.process)
        signum = _SIGNALS.get(request.signal)
        if signum is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM")
        if not await self.run(t, ops.KillProcess(t.sandbox_id, pid, signal=signum)):
            raise ConnectError(Code.NOT_FOUND, f"process {pid} is not running")
        return ppb.SendSignalResponse()

    async def update(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        pid = await self._pid(t, request.process)
        if request.pty is not None and request.pty.size is not None:
            size = request.pty.size
            await self.run(t, ops.ResizePty(t.sandbox_id, pid, size.cols, size.rows))
        return ppb.UpdateResponse()


def _input_bytes(given: Any) -> bytes:
    match given.input if given is not None else None:
        case Oneof(field="stdin" | "pty", value=data):
            return bytes(data)
    raise ConnectError(Code.INVALID_ARGUMENT, "ProcessInput needs stdin or pty bytes")


class FilesystemService(_Rpc, Filesystem):
    """``filesystem.Filesystem``: warmbox's files.* operations."""

    def __init__(self, service: Service, tokens: Tokens) -> None:
        super().__init__(service, tokens)
        self._watchers = Watchers()

    async def stat(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        return fpb.StatResponse(entry=entry_pb(await self.run(t, ops.Stat(t.sandbox_id, e2b_path(request.path)))))

    async def make_dir(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        if not await self.run(t, ops.MakeDir(t.sandbox_id, e2b_path(request.path))):
            raise ConnectError(Code.ALREADY_EXISTS, f"directory {request.path!r} already exists")
        return fpb.MakeDirResponse(entry=entry_pb(await self.run(t, ops.Stat(t.sandbox_id, e2b_path(request.path)))))

    async def move(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        entry = await self.run(t, ops.Rename(t.sandbox_id, e2b_path(request.source), e2b_path(request.destination)))
        return fpb.MoveResponse(entry=entry_pb(entry))

    async def list_dir(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        depth = request.depth or 1
        entries = await self.run(t, ops.ListDir(t.sandbox_id, e2b_path(request.path), depth=depth))
        return fpb.ListDirResponse(entries=[entry_pb(e) for e in entries])

    async def remove(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        await self.run(t, ops.Remove(t.sandbox_id, e2b_path(request.path)))
        return fpb.RemoveResponse()

    async def watch_dir(self, request: Any, ctx: RequestContext[Any, Any]) -> AsyncIterator[Any]:
        t = self.target(ctx)
        interval = _keepalive_s(ctx)
        queue: asyncio.Queue[FilesystemEvent] = asyncio.Queue(maxsize=64)  # a slow client slows the watch
        req = ops.WatchDir(t.sandbox_id, e2b_path(request.path), recursive=request.recursive, on_event=queue.put)
        watch = await self.run(t, req)
        ended = asyncio.ensure_future(watch.wait())
        try:
            started: Oneof[Literal["start"], fpb.WatchDirResponse.StartEvent] = Oneof(
                "start", fpb.WatchDirResponse.StartEvent()
            )
            yield fpb.WatchDirResponse(event=started)
            while True:
                got = asyncio.ensure_future(queue.get())
                left = _left_s(ctx)
                wait = interval if left is None else min(interval, left)
                done, _ = await asyncio.wait({got, ended}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if got in done:
                    yield _fs_response(got.result())
                    continue
                got.cancel()
                if ended not in done and (left := _left_s(ctx)) is not None and left <= 0:
                    raise ConnectError(Code.DEADLINE_EXCEEDED, "the watch's timeout passed")
                if ended not in done:
                    alive: Oneof[Literal["keepalive"], fpb.WatchDirResponse.KeepAlive] = Oneof(
                        "keepalive", fpb.WatchDirResponse.KeepAlive()
                    )
                    yield fpb.WatchDirResponse(event=alive)
                    continue
                while not queue.empty():
                    yield _fs_response(queue.get_nowait())
                exc = ended.exception()
                if isinstance(exc, WarmboxError):
                    raise connect_error(exc)
                return
        finally:
            ended.cancel()
            watch.stop()  # the client went away, or the watch is over

    async def create_watcher(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        watcher_id = await self._watchers.create(t, e2b_path(request.path), request.recursive)
        return fpb.CreateWatcherResponse(watcher_id=watcher_id)

    async def get_watcher_events(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        return fpb.GetWatcherEventsResponse(events=[_fs_event(e) for e in self._watchers.take(t, request.watcher_id)])

    async def remove_watcher(self, request: Any, ctx: RequestContext[Any, Any]) -> Any:
        t = self.target(ctx)
        self._watchers.remove(t, request.watcher_id)
        return fpb.RemoveWatcherResponse()


_EVENT_TYPES = {
    FilesystemEventType.CREATE: fpb.EventType.CREATE,
    FilesystemEventType.WRITE: fpb.EventType.WRITE,
    FilesystemEventType.REMOVE: fpb.EventType.REMOVE,
    FilesystemEventType.RENAME: fpb.EventType.RENAME,
    FilesystemEventType.CHMOD: fpb.EventType.CHMOD,
}


def _fs_event(e: FilesystemEvent) -> fpb.FilesystemEvent:
    return fpb.FilesystemEvent(name=e.name, type=_EVENT_TYPES.get(e.type, fpb.EventType.UNSPECIFIED))


def _fs_response(e: FilesystemEvent) -> fpb.WatchDirResponse:
    event: Oneof[Literal["filesystem"], fpb.FilesystemEvent] = Oneof("filesystem", _fs_event(e))
    return fpb.WatchDirResponse(event=event)


@dataclasses.dataclass
class _Watcher:
    front: Any
    sandbox_id: str
    watch: ops.DirWatch
    events: collections.deque[FilesystemEvent]


class Watchers:
    """E2B's polled watchers (CreateWatcher / GetWatcherEvents / RemoveWatcher): dialect state
    warmbox itself does not need, so it lives here, bounded. Each is a ``files.watch_dir`` of the
    creator's front whose events wait in a ring (the oldest dropped past MAX_EVENTS); its id is
    random and answers only the same tenant's calls for the same sandbox (anything else: not
    found). A watcher whose watch ended (the directory went, the sandbox ended) is dropped once
    its last events were taken, and at each create."""

    MAX_PER_SANDBOX = 32
    MAX_TOTAL = 1024
    MAX_EVENTS = 10_000

    def __init__(self) -> None:
        self._by_id: dict[str, _Watcher] = {}

    def _sweep(self) -> None:
        for wid in [w for w, v in self._by_id.items() if v.watch.done and not v.events]:
            del self._by_id[wid]

    async def create(self, t: Target, path: str, recursive: bool) -> str:
        self._sweep()
        mine = sum(1 for w in self._by_id.values() if w.sandbox_id == t.sandbox_id)
        if mine >= self.MAX_PER_SANDBOX or len(self._by_id) >= self.MAX_TOTAL:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, f"too many watchers (at most {self.MAX_PER_SANDBOX} a sandbox)")
        events: collections.deque[FilesystemEvent] = collections.deque(maxlen=self.MAX_EVENTS)
        try:
            watch = await t.front.handle(ops.WatchDir(t.sandbox_id, path, recursive=recursive, on_event=events.append))
        except WarmboxError as e:
            raise connect_error(e) from None
        watcher_id = secrets.token_urlsafe(16)
        self._by_id[watcher_id] = _Watcher(t.front, t.sandbox_id, watch, events)
        return watcher_id

    def _get(self, t: Target, watcher_id: str) -> _Watcher:
        w = self._by_id.get(watcher_id)
        if w is None or w.sandbox_id != t.sandbox_id or w.front is not t.front:
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id[:40]!r} not found")
        return w

    def take(self, t: Target, watcher_id: str) -> list[FilesystemEvent]:
        """The events since the last call; NOT_FOUND once the watch ended and all were taken."""
        w = self._get(t, watcher_id)
        if w.watch.done and not w.events:
            del self._by_id[watcher_id]
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id[:40]!r} ended (the directory or sandbox went)")
        out = list(w.events)
        w.events.clear()
        return out

    def remove(self, t: Target, watcher_id: str) -> None:
        w = self._get(t, watcher_id)
        w.watch.stop()
        del self._by_id[watcher_id]


# ---- plain HTTP: /files and /health


def _written(e: EntryInfo) -> dict[str, str]:
    return {"name": e.name, "type": "dir" if e.type == "dir" else "file", "path": e.path}


class Files:
    """``GET /files?path=`` (a file's bytes, streamed from the sandbox as the client takes them) and
    ``POST /files`` (multipart: each part's filename is its path; or the octet-stream body for
    ``?path=``, gzip allowed), each file streamed into the sandbox a piece at a time (files.write_stream:
    it replaces the path only when complete): JSON ``[{name, type, path}]``. At most ``max_bytes``
    a file ([server] max_body_mb)."""

    CHUNK = 1 << 20

    def __init__(self, service: Service, tokens: Tokens, max_bytes: int) -> None:
        self._service = service
        self._tokens = tokens
        self._max = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await answer(self._handle, scope, receive, send)

    async def _handle(self, request: Request) -> Response:
        if request.method not in ("GET", "POST"):
            return error_response(405, f"{request.method} is not allowed on /files")
        signed = "signature" in request.query_params
        if signed:
            operation = "read" if request.method == "GET" else "write"
            query = {**request.query_params, "operation": operation}
            t = signed_target(self._service, self._tokens, request.headers, query)
        else:
            t = data_target(self._service, self._tokens, request.headers)
        username(request.headers)  # checked; the files API acts as the sandbox's user
        if request.method == "GET":
            return await self._download(t, e2b_path(request.query_params.get("path", "")))
        ctype, _ = parse_options_header(request.headers.get("content-type", ""))
        if ctype == b"multipart/form-data":
            # a signed URL writes the path it was signed for, whatever the part's filename says
            written = await self._multipart(t, request, only=signed)
        else:
            path = e2b_path(request.query_params.get("path", ""))
            write = ops.WriteFileStream(t.sandbox_id, path, self._body(request))
            written = [await t.front.handle(write)]
        return Response(json.dumps([_written(e) for e in written]), media_type="application/json")

    async def _download(self, t: Target, path: str) -> Response:
        stream = await t.front.handle(ops.ReadFileStream(t.sandbox_id, path, max_bytes=self._max))
        body = await raw_body(stream)  # errors before the first byte are a plain error answer
        return StreamingResponse(body, media_type="application/octet-stream")

    async def _body(self, request: Request) -> AsyncIterator[bytes]:
        """The request body as it arrives (gunzipped for Content-Encoding: gzip), bounded."""
        gz = request.headers.get("content-encoding", "").lower() == "gzip"
        inflate = zlib.decompressobj(wbits=31) if gz else None
        size = 0
        async for chunk in request.stream():
            if inflate is not None:
                try:
                    chunk = inflate.decompress(chunk, self._max + 1 - size)
                except zlib.error as e:
                    raise InvalidArgument(f"the gzip body does not decompress: {e}") from None
            size += len(chunk)
            if size > self._max:
                raise InvalidArgument(f"the upload is larger than the server's limit of {self._max} bytes")
            if chunk:
                yield chunk

    async def _multipart(self, t: Target, request: Request, only: bool = False) -> list[EntryInfo]:
        """only: every part is written to the ``path`` parameter (a signed URL's), and there is one."""
        fallback = request.query_params.get("path", "")
        # the parser spools each part to a temporary file past 1 MiB; each is then streamed on
        async with request.form(max_files=1000, max_fields=1000, max_part_size=self._max) as form:
            parts = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
            if only and (len(parts) != 1 or not fallback):
                raise InvalidArgument("a signed upload URL takes one file part, written to the path it names")
            files = [(e2b_path(fallback if only else (v.filename or fallback)), v) for v in parts]
            if not files:
                raise InvalidArgument("the multipart body holds no file part")
            written = []
            for path, upload in files:
                written.append(await t.front.handle(ops.WriteFileStream(t.sandbox_id, path, self._part(upload))))
        return written

    async def _part(self, upload: UploadFile) -> AsyncIterator[bytes]:
        while chunk := await upload.read(self.CHUNK):
            yield chunk


def _shell(cmd: str, args: list[str]) -> list[str]:
    """The argv of E2B's Start. What its SDKs send for ``commands.run``, ``/bin/bash -l -c <cmd>``,
    runs as ``/bin/bash -c <cmd>``, and a terminal's ``/bin/bash -i -l`` as ``/bin/bash -i``: in
    warmbox's images a login shell reads only Debian's /etc/profile, which sets PATH anew (the
    sandbox's own, /home/user/.venv/bin first, would be lost: ``pip install`` would reach the
    system's Python and be refused), and its start costs about 2 ms of every command. Any other
    argv runs as given."""
    if cmd == "/bin/bash" and len(args) == 3 and args[:2] == ["-l", "-c"]:
        return [cmd, "-c", args[2]]
    if cmd == "/bin/bash" and args == ["-i", "-l"]:
        return [cmd, "-i"]
    return [cmd, *args]


class Envd:
    """The envd plane of every sandbox: Connect RPC paths to their service, plain HTTP routes."""

    def __init__(self, service: Service, tokens: Tokens, max_bytes: int) -> None:
        self._process = ProcessASGIApplication(ProcessService(service, tokens), read_max_bytes=MAX_MESSAGE)
        self._filesystem = FilesystemASGIApplication(FilesystemService(service, tokens), read_max_bytes=MAX_MESSAGE)
        self._files = Files(service, tokens, max_bytes)
        self._service = service
        self._tokens = tokens

    async def _health(self, request: Request) -> Response:
        """204 while the sandbox is alive; 502 once it ended (how E2B's proxy says it is gone)."""
        try:
            t = data_target(self._service, self._tokens, request.headers)
            info = await t.front.handle(ops.Info(t.sandbox_id))
        except SandboxNotFound:
            return error_response(502, "The sandbox was not found")
        except WarmboxError as e:
            return http_error(e)
        if info.state not in (State.CREATING, State.READY, State.RUNNING):
            return error_response(502, f"The sandbox is {info.state.value}")
        return Response(status_code=204)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        app: Callable[[Scope, Receive, Send], Awaitable[None]]
        if path.startswith("/process.Process/"):
            app = self._process
        elif path.startswith("/filesystem.Filesystem/"):
            app = self._filesystem
        elif path == "/files":
            app = self._files
        elif path == "/health" and scope["method"] == "GET":
            app = await self._health(Request(scope, receive))
        else:
            app = error_response(404, f"envd has no route {scope['method']} {path}")
        await app(scope, receive, send)


__all__ = ["Envd", "FilesystemService", "ProcessService", "entry_pb", "username"]
