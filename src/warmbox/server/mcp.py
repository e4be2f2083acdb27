"""The MCP server: the sandbox tools an agent needs, each a thin adapter over one engine operation.

``build_mcp(transport_for)`` returns an :class:`~mcp.server.mcpserver.MCPServer` (the official
``mcp`` SDK). Every tool call asks ``transport_for(ctx)`` for the :class:`Transport` to run its
operation on, so the same tools serve two ways:

- stdio (``warmbox mcp``): one transport for the process's life,
  ``build_mcp(lambda ctx: transport).run_stdio_async()``.
- streamable HTTP, mounted by the HTTP server at ``/mcp``: the transport of the tenant that
  authenticated the HTTP request carrying the call. There ``ctx.request_context.request`` is the
  Starlette ``Request`` of that POST (:func:`http_request_of`), so whatever the server's auth put
  on ``request.state`` (or in ``request.scope``) names the tenant.

Errors reach the model as tool errors (``isError``) whose text starts with a code: a
:class:`WarmboxError` is ``<its class in snake case>: <message>`` (``sandbox_not_found: ...``),
arguments outside a tool's schema are ``invalid_argument: ...``, an unknown tool is
``unknown_tool: ...``, and anything else is ``internal_error: <type>`` (the traceback goes to the
server's log, never to the client).

Argument names follow the SDK's: ``run_command(command=)``, ``resume(sandbox_id=)``. The names
of earlier releases (``cmd``, ``snapshot``) are still accepted (:data:`ALIASES`) but not listed
in the schemas.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.types import CallToolResult, ContentBlock, ImageContent, InputRequiredResult, TextContent, ToolAnnotations
from pydantic import BaseModel, Field, ValidationError

from warmbox import Network, __version__, transcript
from warmbox import operations as ops
from warmbox.errors import InvalidArgument, WarmboxError
from warmbox.models import (
    CommandResult,
    EntryInfo,
    Execution,
    ProcessInfo,
    SandboxInfo,
    SandboxQuery,
    SnapshotRef,
    StageTiming,
    State,
)
from warmbox.sdk.transport import Transport
from warmbox.tiers import TIERS

log = logging.getLogger(__name__)
R = TypeVar("R")

TransportFor = Callable[[Context[Any, Any]], Transport]
"""Which transport a tool call runs on, given the call's MCP context (see the module docstring)."""

INSTRUCTIONS = (
    "Sandboxes for running untrusted code. create_sandbox gives an id; pass it to run_command (a bash "
    "command line), run_code (Python cells whose variables persist between calls), read_file / write_file / "
    "list_files (relative paths are under /workspace), start_command / process_output / list_processes / "
    "kill_process (servers and long jobs in the background), snapshot / pause (resume brings a paused "
    "sandbox back), get_sandbox and export_sandbox (its record and history), and kill_sandbox when done. "
    "A sandbox also ends by itself at its timeout. Errors start with a code "
    "(sandbox_not_found: ..., invalid_argument: ...)."
)
ALIASES: dict[str, dict[str, str]] = {"run_command": {"cmd": "command"}, "resume": {"snapshot": "sandbox_id"}}
"""Per tool, an argument's earlier name -> its name now (accepted, not in the schema)."""
MAX_TOOL_TEXT = 1 << 20  # characters of process output or transcript one tool result carries
MAX_OUTPUT_WAIT_S = 60.0
REPLAY_GRACE_S = 2.0  # past its wait, process_output still takes what the process's buffer replays

# ---- the tools' argument types (their descriptions are the schema's)

SandboxId = Annotated[str, Field(description="The sandbox's id (sb-...), as create_sandbox returned it.")]
SandboxPath = Annotated[
    str, Field(description="A path in the sandbox; relative paths are under /workspace, '..' is refused.")
]
CommandTimeout = Annotated[
    float, Field(gt=0, description="Seconds, wall clock; on expiry the process tree is killed (timed_out).")
]
Tier = Annotated[
    str | None,
    Field(
        description=f"Isolation tier: one of {', '.join(TIERS)}, or auto (the tier warmbox advise picks for "
        "untrusted Python); default: the server's configured tier."
    ),
]
SaveMemory = Annotated[
    bool, Field(description="Save processes too (only where the tier can); default: files and code-context variables.")
]
Metadata = Annotated[
    dict[str, str] | None,
    Field(description="Your labels for the sandbox (string keys and values), shown by get_sandbox and list_sandboxes."),
]
Pid = Annotated[int, Field(gt=0, description="The background process's pid, as start_command returned it.")]
NetworkSpec = Annotated[
    Literal["none", "internet"] | list[str],
    Field(
        description="Egress: 'none' (no network, the default), 'internet' (public addresses only), or a list "
        "of hosts the sandbox may reach ('pypi.org', '*.github.com', an IP address or CIDR); "
        "everything else is denied."
    ),
]
IdempotencyKey = Annotated[
    str | None,
    Field(
        min_length=1,
        max_length=255,
        description="Repeating a call with the same key never runs it twice: the repeat gets the first "
        "call's result (or waits for it); the same key with other arguments is an idempotency_conflict.",
    ),
]


# ---- what the tools return (typed: each is the tool's output schema)


class SandboxOut(BaseModel):
    """One sandbox."""

    sandbox_id: str
    tier: str
    template: str
    state: str = Field(description="creating, ready, running, paused, destroyed or failed")
    created_at: float = Field(description="unix seconds")
    expires_at: float = Field(description="unix seconds; the sandbox is destroyed then")
    memory_mb: int
    cpus: float
    from_pool: bool = Field(description="it was handed out of a warm pool")
    parent_snapshot: str = Field(description="the snapshot it was restored or forked from ('' if none)")
    metadata: dict[str, str] = Field(default_factory=dict, description="the labels given at create")
    start_ms: dict[str, float] = Field(
        default_factory=dict, description="create/resume only: the start's stage timings, milliseconds"
    )

    @classmethod
    def of(cls, info: SandboxInfo, timings: tuple[StageTiming, ...] = ()) -> SandboxOut:
        return cls(
            sandbox_id=info.sandbox_id,
            tier=info.tier,
            template=info.template,
            state=info.state.value,
            created_at=info.created_at,
            expires_at=info.expires_at,
            memory_mb=info.memory_mb,
            cpus=info.cpus,
            from_pool=info.from_pool,
            parent_snapshot=info.parent_snapshot,
            metadata=dict(info.metadata),
            start_ms={t.stage: round(t.duration_ms, 3) for t in timings},
        )


class SandboxesOut(BaseModel):
    sandboxes: list[SandboxOut]


class CommandOut(BaseModel):
    """A command's outcome; never silently partial."""

    exit_code: int = Field(description="the exit status, or 128+N when killed by signal N")
    stdout: str
    stderr: str
    timed_out: bool = Field(description="the timeout fired and the process tree was killed")
    truncated: bool = Field(description="output passed the output cap; the rest was discarded")
    oom_killed: bool = Field(description="the kernel's OOM killer killed a process of the sandbox meanwhile")
    signal: int = Field(description="the signal that ended the process, 0 if it exited")
    duration_ms: float

    @classmethod
    def of(cls, r: CommandResult) -> CommandOut:
        return cls(
            exit_code=r.exit_code,
            stdout=r.stdout,
            stderr=r.stderr,
            timed_out=r.timed_out,
            truncated=r.truncated,
            oom_killed=r.oom_killed,
            signal=r.signal,
            duration_ms=r.duration_ms,
        )


class CodeErrorOut(BaseModel):
    """An exception the code raised."""

    name: str
    value: str
    traceback: str


class ResultOut(BaseModel):
    """One displayed value of a cell, in the representations it offered (images are image content blocks)."""

    is_main_result: bool = Field(description="the value of the cell's last expression")
    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    latex: str | None = None
    json_data: str | None = Field(default=None, description="its JSON representation, as text")
    images: list[str] = Field(
        default_factory=list, description="MIME types of its images, sent as image content in this order"
    )


class RunCodeOut(BaseModel):
    """A cell's outcome; ``error`` is the exception the code raised (the call itself succeeded)."""

    text: str | None = Field(description="the last expression's value as text (None if the cell ends otherwise)")
    stdout: str
    stderr: str
    error: CodeErrorOut | None
    results: list[ResultOut]
    timed_out: bool
    truncated: bool
    oom_killed: bool
    execution_count: int
    duration_ms: float


EntryKind = Literal["file", "dir", "symlink", "other"]
_KINDS: dict[str, EntryKind] = {"file": "file", "dir": "dir", "symlink": "symlink"}


class EntryOut(BaseModel):
    """One file-system entry."""

    name: str
    path: str
    type: EntryKind
    size: int = Field(description="bytes")
    mode: int = Field(description="permission bits")
    modified: float = Field(description="unix seconds")
    symlink_target: str | None = None

    @classmethod
    def of(cls, e: EntryInfo) -> EntryOut:
        return cls(
            name=e.name,
            path=e.path,
            type=_KINDS.get(e.type, "other"),
            size=e.size,
            mode=e.mode,
            modified=e.modified,
            symlink_target=e.symlink_target,
        )


class EntriesOut(BaseModel):
    path: str
    entries: list[EntryOut]


class FileTextOut(BaseModel):
    path: str
    content: str
    size: int = Field(description="bytes")


class SnapshotOut(BaseModel):
    """A snapshot: pass its id (or, for a paused sandbox, the sandbox's id) to resume."""

    snapshot_id: str
    sandbox_id: str
    created_at: float = Field(description="unix seconds")
    memory: bool = Field(description="processes were saved too (else files and code-context variables)")
    size_bytes: int
    context_saved: bool = Field(description="the default code context's variables are in it")
    context_skipped: list[str] = Field(description="code-context variables that could not be saved")

    @classmethod
    def of(cls, s: SnapshotRef) -> SnapshotOut:
        return cls(
            snapshot_id=s.snapshot_id,
            sandbox_id=s.sandbox_id,
            created_at=s.created_at,
            memory=s.memory,
            size_bytes=s.size_bytes,
            context_saved=s.context_saved,
            context_skipped=list(s.context_skipped),
        )


class ProcessOut(BaseModel):
    """A running background process."""

    pid: int
    command: str = Field(description="what was started (a command line runs as bash -c)")
    cwd: str
    tag: str = Field(description="the label given at start ('' if none)")

    @classmethod
    def of(cls, p: ProcessInfo) -> ProcessOut:
        command = p.args[-1] if p.cmd == "/bin/bash" and len(p.args) == 2 and p.args[0] == "-c" else p.cmd
        if command == p.cmd and p.args:
            command = " ".join([p.cmd, *p.args])
        return cls(pid=p.pid, command=command, cwd=p.cwd, tag=p.tag)


class ProcessesOut(BaseModel):
    processes: list[ProcessOut]


class StartedOut(BaseModel):
    sandbox_id: str
    pid: int = Field(description="pass it to process_output, kill_process or send_stdin")


class ProcessOutputOut(BaseModel):
    """A background process's output so far (what its bounded buffer still holds) and whether it ended."""

    pid: int
    stdout: str
    stderr: str
    running: bool = Field(description="still running when the wait ended")
    exit_code: int | None = Field(description="once ended: its exit status (128+N when killed by signal N)")
    lost_bytes: int = Field(description="output dropped before what is shown (the buffer is bounded)")
    truncated: bool = Field(description="more output than one result carries: the oldest part was cut")


class ExportOut(BaseModel):
    """Everything recorded of a sandbox, one JSON record a line (its record, stage timings, state
    changes, commands and code runs, egress events, snapshots and cost)."""

    sandbox_id: str
    records: int
    ndjson: str
    truncated: bool = Field(description="the transcript (or this result) holds only the newest records")


class KillOut(BaseModel):
    sandbox_id: str
    killed: bool = Field(description="False: it had already ended")


def _run_code_result(ex: Execution) -> CallToolResult:
    """The cell as JSON text plus one image block per PNG/JPEG it displayed; the JSON is also structured."""
    images: list[ContentBlock] = []
    results = []
    for r in ex.results:
        mimes = []
        for mime, data in (("image/png", r.png), ("image/jpeg", r.jpeg)):
            if data:
                images.append(ImageContent(data=data, mime_type=mime))  # already base64, as MCP wants
                mimes.append(mime)
        results.append(
            ResultOut(
                is_main_result=r.is_main_result,
                text=r.text,
                html=r.html,
                markdown=r.markdown,
                svg=r.svg,
                latex=r.latex,
                json_data=r.json,
                images=mimes,
            )
        )
    err = ex.error
    out = RunCodeOut(
        text=ex.text,
        stdout=ex.stdout,
        stderr=ex.stderr,
        error=CodeErrorOut(name=err.name, value=err.value, traceback=err.traceback) if err else None,
        results=results,
        timed_out=ex.timed_out,
        truncated=ex.truncated,
        oom_killed=ex.oom_killed,
        execution_count=ex.execution_count,
        duration_ms=ex.duration_ms,
    )
    text: list[ContentBlock] = [TextContent(text=out.model_dump_json(indent=2))]
    return CallToolResult(content=text + images, structured_content=out.model_dump(mode="json"))


# ---- errors


def error_code(e: WarmboxError) -> str:
    """The code a client sees for ``e``: its class name in snake case (SandboxNotFound -> sandbox_not_found)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(e).__name__).lower()


def tool_error(code: str, message: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(text=f"{code}: {message}")], is_error=True)


def _invalid_arguments(e: ValidationError) -> str:
    """Which arguments failed and why (never their values: they are the caller's data)."""
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}" for err in e.errors())


def _aliased(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` with the earlier names of ``name``'s arguments (:data:`ALIASES`) renamed."""
    renames = ALIASES.get(name)
    if not renames or not any(old in arguments for old in renames):
        return arguments
    out = dict(arguments)
    for old, new in renames.items():
        if old in out:
            if new in out:
                raise InvalidArgument(f"{name}: give {new} (or its earlier name {old}), not both")
            out[new] = out.pop(old)
    return out


def _bounded(text: str) -> tuple[str, bool]:
    """The newest MAX_TOOL_TEXT characters of ``text``, and whether any were cut."""
    return (text[-MAX_TOOL_TEXT:], True) if len(text) > MAX_TOOL_TEXT else (text, False)


class WarmboxMCP(MCPServer[Any]):
    """The SDK's server with warmbox's error contract on every tool call (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tool_names: set[str] = set()

    def add_tool(self, fn: Callable[..., Any], name: str | None = None, *args: Any, **kwargs: Any) -> None:
        super().add_tool(fn, name, *args, **kwargs)
        self.tool_names.add(name or fn.__name__)

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None
    ) -> CallToolResult | InputRequiredResult:
        if name not in self.tool_names:
            return tool_error("unknown_tool", f"no tool {name!r} (tools: {', '.join(sorted(self.tool_names))})")
        try:
            arguments = _aliased(name, arguments or {})
        except InvalidArgument as e:
            return tool_error("invalid_argument", str(e))
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as e:
            cause = e.__cause__
            if isinstance(cause, WarmboxError):
                return tool_error(error_code(cause), str(cause))
            if isinstance(cause, ValidationError):
                return tool_error("invalid_argument", f"{name}: {_invalid_arguments(cause)}")
            if isinstance(e, UnexpectedToolError):
                log.error("tool %s failed", name, exc_info=cause)
                kind = type(cause).__name__ if cause is not None else "error"
                return tool_error("internal_error", f"{kind} in {name} (the server's log has the details)")
            return tool_error("invalid_argument", str(e))


def http_request_of(ctx: Context[Any, Any]) -> Any:
    """The HTTP request that carried this call (a Starlette ``Request``), or None on stdio."""
    return ctx.request_context.request


def build_mcp(transport_for: TransportFor, *, name: str = "warmbox") -> WarmboxMCP:
    """The warmbox MCP server; each tool call runs its operation on ``transport_for(ctx)``.

    ``transport_for`` is called once per tool call, on the event loop, with that call's context;
    it returns a transport it owns (build_mcp never closes one). A WarmboxError it raises (say,
    the tenant is unknown) reaches the client as that error's code. Serve it with
    ``run_stdio_async()``, or mount it in the HTTP server (tests/server/test_mcp.py does this)::

        mcp = build_mcp(lambda ctx: transport_of(http_request_of(ctx).state.tenant))
        app = Starlette(
            routes=[..., Mount("/mcp", app=mcp.streamable_http_app(
                streamable_http_path="/", stateless_http=True, json_response=True,
                transport_security=...))],  # the default only accepts loopback Host headers
            lifespan=lambda app: mcp.session_manager.run(),  # a mounted app's own lifespan does not run
        )

    The tenant is read per call from the request that carried it, so a (stateful) MCP session
    id never carries a tenant from one request to another.
    """
    server = WarmboxMCP(name=name, instructions=INSTRUCTIONS, version=__version__)
    read_only = ToolAnnotations(read_only_hint=True, idempotent_hint=True)

    async def run(ctx: Context[Any, Any], request: ops.Request[R]) -> R:
        return await transport_for(ctx).handle(request)

    @server.tool()
    async def create_sandbox(
        ctx: Context[Any, Any],
        tier: Tier = None,
        template: Annotated[
            str | None, Field(description="base, pydata, shell or one the server defines; default: its default")
        ] = None,
        network: NetworkSpec = "none",
        timeout: Annotated[
            float | None, Field(gt=0, description="Lifetime in seconds; default: the server's (300 s).")
        ] = None,
        metadata: Metadata = None,
        idempotency_key: IdempotencyKey = None,
    ) -> SandboxOut:
        """Create a sandbox (from a warm pool when one matches) and return its id and record."""
        net: Network | str = network if isinstance(network, str) else Network(allow=network)
        request = ops.Create(
            tier=tier,
            template=template,
            network=net,
            timeout=timeout,
            metadata=metadata,
            idempotency_key=idempotency_key,
        )
        opened = await run(ctx, request)
        return SandboxOut.of(opened.info, opened.timings)

    @server.tool()
    async def run_command(
        ctx: Context[Any, Any],
        sandbox_id: SandboxId,
        command: Annotated[str, Field(description="A bash command line, run with bash -c.")],
        cwd: Annotated[str | None, Field(description="Working directory; default /workspace.")] = None,
        timeout: CommandTimeout = 60.0,
        idempotency_key: IdempotencyKey = None,
    ) -> CommandOut:
        """Run a shell command in the sandbox and wait for it; returns its exit code, stdout, stderr
        and what cut it short. For a server or a long job use start_command."""
        request = ops.Exec(sandbox_id, command, cwd=cwd, timeout=timeout, idempotency_key=idempotency_key)
        return CommandOut.of(await run(ctx, request))

    @server.tool()
    async def start_command(
        ctx: Context[Any, Any],
        sandbox_id: SandboxId,
        command: Annotated[str, Field(description="A bash command line, run with bash -c in the background.")],
        cwd: Annotated[str | None, Field(description="Working directory; default /workspace.")] = None,
        tag: Annotated[str, Field(max_length=256, description="Your label for it, shown by list_processes.")] = "",
    ) -> StartedOut:
        """Start a command in the background (a server, a watcher, a long build) and return its pid at
        once; it runs until it ends, kill_process, or the sandbox ends. process_output reads its output."""
        pid = await run(ctx, ops.StartProcess(sandbox_id, command, cwd=cwd, tag=tag))
        return StartedOut(sandbox_id=sandbox_id, pid=pid)

    @server.tool(annotations=read_only)
    async def list_processes(ctx: Context[Any, Any], sandbox_id: SandboxId) -> ProcessesOut:
        """The sandbox's running background processes."""
        procs = await run(ctx, ops.ListProcesses(sandbox_id))
        return ProcessesOut(processes=[ProcessOut.of(p) for p in procs if not p.pty])

    @server.tool(annotations=read_only)
    async def process_output(
        ctx: Context[Any, Any],
        sandbox_id: SandboxId,
        pid: Pid,
        wait: Annotated[
            float,
            Field(
                ge=0,
                le=MAX_OUTPUT_WAIT_S,
                description="Seconds to wait for it to end (0: return at once with what it printed so far).",
            ),
        ] = 0.0,
    ) -> ProcessOutputOut:
        """A background process's output so far, and its exit code once it ended (waiting up to ``wait`` s)."""
        stream = await run(ctx, ops.ConnectProcess(sandbox_id, pid))
        out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        held = {"stdout": 0, "stderr": 0}
        cut = False
        lost = 0
        ended = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        hard = deadline + REPLAY_GRACE_S  # a chatty process never keeps the call past this
        try:
            while (now := loop.time()) < hard:
                # what is buffered comes at once; past the deadline only that, never a wait for more
                left = min(max(deadline - now, 0.5), hard - now)
                try:
                    ev = await asyncio.wait_for(stream.next(), left)
                except TimeoutError:
                    break
                if ev is None:
                    ended = True
                    break
                if ev.kind in out:
                    out[ev.kind].append(ev.text)
                    held[ev.kind] += len(ev.text)
                    if held[ev.kind] > 2 * MAX_TOOL_TEXT:  # keep the newest: memory stays bounded
                        text, _ = _bounded("".join(out[ev.kind]))
                        out[ev.kind], held[ev.kind], cut = [text], len(text), True
                elif ev.kind == "lost":
                    lost += ev.size
        finally:
            stream.cancel()
        stdout, cut_out = _bounded("".join(out["stdout"]))
        stderr, cut_err = _bounded("".join(out["stderr"]))
        result = stream.result if ended else None
        return ProcessOutputOut(
            pid=pid,
            stdout=stdout,
            stderr=stderr,
            running=not ended,
            exit_code=result.exit_code if result is not None else None,
            lost_bytes=lost,
            truncated=cut or cut_out or cut_err,
        )

    @server.tool()
    async def send_stdin(
        ctx: Context[Any, Any],
        sandbox_id: SandboxId,
        pid: Pid,
        data: Annotated[str, Field(description="Text for the process's stdin (UTF-8).")],
        eof: Annotated[bool, Field(description="Close its stdin after the text.")] = False,
    ) -> StartedOut:
        """Write to a background process's stdin."""
        await run(ctx, ops.SendStdin(sandbox_id, pid, data, eof=eof))
        return StartedOut(sandbox_id=sandbox_id, pid=pid)

    @server.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=True))
    async def kill_process(
        ctx: Context[Any, Any],
        sandbox_id: SandboxId,
        pid: Pid,
        signal: Annotated[int, Field(ge=1, le=64, description="The signal number; default 9 (SIGKILL).")] = 9,
    ) -> KillOut:
        """End a background process and every process it started."""
        killed = await run(ctx, ops.KillProcess(sandbox_id, pid, signal=signal))
        return KillOut(sandbox_id=sandbox_id, killed=killed)

    @server.tool()
    async def run_code(
        ctx: Context[Any, Any],
        sandbox_id: SandboxId,
        code: Annotated[str, Field(description="Python source; the last expression's value is returned.")],
        context: Annotated[
            str, Field(min_length=1, description="The code context; its variables persist between calls.")
        ] = "default",
        timeout: CommandTimeout = 60.0,
        language: Annotated[
            Literal["python", "javascript", "bash"] | None,
            Field(description="With no context: the default context of this language (Python unless given)."),
        ] = None,
        idempotency_key: IdempotencyKey = None,
    ) -> Annotated[CallToolResult, RunCodeOut]:
        """Run a cell in a persistent interpreter (Python unless ``language`` says javascript or bash):
        the last expression's value as text, stdout, stderr, the exception if one was raised, and
        displayed images (matplotlib charts, objects with _repr_png_ / _repr_jpeg_, display(obj)) as
        image content."""
        request = ops.RunCode(
            sandbox_id, code, context=context, timeout=timeout, language=language, idempotency_key=idempotency_key
        )
        return _run_code_result(await run(ctx, request))

    @server.tool(annotations=read_only)
    async def read_file(
        ctx: Context[Any, Any],
        sandbox_id: SandboxId,
        path: SandboxPath,
        max_bytes: Annotated[int, Field(gt=0, description="Refuse files larger than this (file_too_large).")] = 1 << 20,
    ) -> FileTextOut:
        """Read a UTF-8 text file from the sandbox."""
        data = await run(ctx, ops.ReadFile(sandbox_id, path, max_bytes=max_bytes))
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(
                f"{path} is not UTF-8 text ({len(data)} bytes); read it with run_command (e.g. base64 or xxd)"
            ) from None
        return FileTextOut(path=ops.sandbox_path(path), content=text, size=len(data))

    @server.tool()
    async def write_file(
        ctx: Context[Any, Any],
        sandbox_id: SandboxId,
        path: SandboxPath,
        content: Annotated[str, Field(description="The text to write (UTF-8).")],
        append: Annotated[bool, Field(description="Append instead of replacing the file.")] = False,
    ) -> EntryOut:
        """Write a text file in the sandbox (parent directories are created); returns its entry."""
        return EntryOut.of(await run(ctx, ops.WriteFile(sandbox_id, path, content, append=append)))

    @server.tool(annotations=read_only)
    async def list_files(
        ctx: Context[Any, Any],
        sandbox_id: SandboxId,
        path: SandboxPath = "/workspace",
        depth: Annotated[int, Field(ge=1, le=10, description="1: the directory's entries; 2: and theirs ...")] = 1,
    ) -> EntriesOut:
        """List a directory in the sandbox."""
        entries = await run(ctx, ops.ListDir(sandbox_id, path, depth))
        return EntriesOut(path=ops.sandbox_path(path), entries=[EntryOut.of(e) for e in entries])

    @server.tool()
    async def snapshot(
        ctx: Context[Any, Any],
        sandbox_id: SandboxId,
        memory: SaveMemory = False,
    ) -> SnapshotOut:
        """Save the sandbox's files and code-context state; it keeps running. Resume the snapshot id later."""
        return SnapshotOut.of(await run(ctx, ops.Snapshot(sandbox_id, memory=memory)))

    @server.tool()
    async def pause(
        ctx: Context[Any, Any],
        sandbox_id: SandboxId,
        memory: SaveMemory = False,
    ) -> SnapshotOut:
        """Snapshot the sandbox, then release it (nothing runs, nothing is billed) until resume."""
        return SnapshotOut.of(await run(ctx, ops.Pause(sandbox_id, memory=memory)))

    @server.tool()
    async def resume(
        ctx: Context[Any, Any],
        sandbox_id: Annotated[
            str,
            Field(
                description="The paused sandbox's id (sb-...), as pause returned it; a snapshot id (snap-...) "
                "forks a new sandbox from that snapshot instead."
            ),
        ],
        timeout: Annotated[
            float | None, Field(gt=0, description="Lifetime in seconds from now; default: the sandbox's own.")
        ] = None,
    ) -> SandboxOut:
        """Bring a paused sandbox back (same sandbox_id), or fork a new one from a snapshot id (a new sandbox_id)."""
        opened = await run(ctx, ops.Resume(sandbox_id, timeout=timeout))
        return SandboxOut.of(opened.info, opened.timings)

    @server.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=True))
    async def kill_sandbox(ctx: Context[Any, Any], sandbox_id: SandboxId) -> KillOut:
        """Destroy the sandbox and everything in it."""
        return KillOut(sandbox_id=sandbox_id, killed=await run(ctx, ops.Kill(sandbox_id)))

    @server.tool(annotations=read_only)
    async def list_sandboxes(
        ctx: Context[Any, Any],
        include_dead: Annotated[bool, Field(description="Include destroyed and failed sandboxes.")] = False,
        metadata: Annotated[
            dict[str, str] | None,
            Field(description="Only sandboxes whose metadata holds every one of these key/value pairs."),
        ] = None,
    ) -> SandboxesOut:
        """The sandboxes you have (running, ready or paused; with include_dead, ended ones too)."""
        states = tuple(State) if include_dead else None
        query = SandboxQuery(metadata=metadata, state=states) if metadata else None
        infos = await run(ctx, ops.ListSandboxes(include_dead=include_dead, reap=True, query=query))
        return SandboxesOut(sandboxes=[SandboxOut.of(i) for i in infos])

    @server.tool(annotations=read_only)
    async def get_sandbox(ctx: Context[Any, Any], sandbox_id: SandboxId) -> SandboxOut:
        """One sandbox's record: its state, lifetime (expires_at), limits and metadata."""
        return SandboxOut.of(await run(ctx, ops.Info(sandbox_id)))

    @server.tool(annotations=read_only)
    async def export_sandbox(ctx: Context[Any, Any], sandbox_id: SandboxId) -> ExportOut:
        """Everything recorded of a sandbox, in any state (destroyed too), as NDJSON: its record, stage
        timings, state changes, commands and code runs, egress events, snapshots and cost."""
        t = await run(ctx, ops.Export(sandbox_id))
        lines = transcript.dumps(t).decode().splitlines(keepends=True)
        head, rest = lines[:2], lines[2:]  # what the file is and the sandbox's record: always kept
        kept: list[str] = []
        size = sum(map(len, head))
        for line in reversed(rest):  # then the newest records (the cost last), whole lines, within the bound
            size += len(line)
            if size > MAX_TOOL_TEXT:
                break
            kept.append(line)
        kept = head + kept[::-1]
        cut = len(kept) < len(lines)
        return ExportOut(sandbox_id=sandbox_id, records=len(kept), ndjson="".join(kept), truncated=t.truncated or cut)

    return server


__all__ = ["TransportFor", "WarmboxMCP", "build_mcp", "error_code", "http_request_of", "tool_error"]
