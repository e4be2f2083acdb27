"""The async SDK: ``AsyncSandbox`` with ``commands``, ``files`` and code contexts (E2B's shape).

The sync ``Sandbox`` is derived from this module by :mod:`warmbox.sdk._sync`; nothing here
is written twice.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import io
import posixpath
import time
from collections.abc import Callable
from pathlib import Path

from warmbox import protocol as p
from warmbox.backends.base import BackendHandle
from warmbox.engine import snapshot as snapshots
from warmbox.engine.engine import Engine, validate_envs, validate_timeout
from warmbox.engine.guest_client import FileRead, GuestClient
from warmbox.lifecycle import Operation, check
from warmbox.errors import (CommandFailed, ContextError, FilesError, FileTooLarge, GuestProtocolError,
                            InvalidArgument, InvalidPath, IsADirectory, NoSpace, NotADirectory, NotARegularFile,
                            PathExists, PathNotFound, PathPermissionDenied, SandboxError, SandboxTimeout,
                            WarmboxError)
from warmbox.models import (ApprovalRequest, CommandResult, EntryInfo, Execution, ExecutionError, Limits, NetEvent,
                            Result, SandboxInfo, SandboxMetrics, SnapshotRef, StageTiming, State)
from warmbox.network.policy import Network, Secret
from warmbox.sdk._sync import synchronize

DEFAULT_COMMAND_TIMEOUT_S = 60.0
DEFAULT_MAX_OUTPUT = 10 << 20
HOST_GRACE_S = 15.0  # the host's bound = the guest's timeout + this (kill and interrupt waits)
MAX_DISPLAY_BYTES = 64 << 20
DEFAULT_READ_MAX_BYTES = 100 << 20
DEFAULT_READ_TIMEOUT_S = 60.0
WORKDIR = "/workspace"
_MAX_PATH = 4096

_FILE_ERRORS: dict[p.ErrorCode, type[SandboxError]] = {
    p.ErrorCode.NOT_FOUND: PathNotFound,
    p.ErrorCode.EXISTS: PathExists,
    p.ErrorCode.IS_A_DIRECTORY: IsADirectory,
    p.ErrorCode.NOT_A_DIRECTORY: NotADirectory,
    p.ErrorCode.PERMISSION_DENIED: PathPermissionDenied,
    p.ErrorCode.NO_SPACE: NoSpace,
    p.ErrorCode.NOT_REGULAR: NotARegularFile,
    p.ErrorCode.TOO_LARGE: FileTooLarge,
}
_MIME_FIELDS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
    "image/png": "png", "image/jpeg": "jpeg", "text/latex": "latex", "application/json": "json",
}


def sandbox_path(path: object) -> str:
    """Normalise a path for the files API: relative paths are under /workspace; '..' is refused."""
    if not isinstance(path, str):
        raise InvalidPath(f"path must be a string, got {type(path).__name__}")
    if not path or "\0" in path or len(path) > _MAX_PATH:
        raise InvalidPath(f"path {path[:80]!r} is empty, too long or contains a NUL byte")
    if ".." in path.split("/"):
        raise InvalidPath(f"path {path!r} contains a '..' component")
    return posixpath.normpath(posixpath.join(WORKDIR, path))


def _optional_timeout(timeout: float | None, name: str = "timeout") -> float:
    return 0.0 if timeout is None or timeout == 0 else validate_timeout(timeout, name)


def _max_output(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(f"max_output must be a positive number of bytes, got {value!r}")
    return value


def _raise_failure(f: p.Failure, sandbox_id: str, what: str) -> None:
    cls = _FILE_ERRORS.get(f.code)
    if cls is not None:
        raise cls(f"{what}: {f.message}", sandbox_id)
    if f.code in (p.ErrorCode.CONTEXT_NOT_FOUND, p.ErrorCode.CONTEXT_DIED):
        raise ContextError(f"{what}: {f.message}", sandbox_id)
    if f.code is p.ErrorCode.INVALID:
        raise InvalidArgument(f"{what}: {f.message}")
    raise SandboxError(f"{what}: {f.message}", sandbox_id)


def _entry(e: p.Entry) -> EntryInfo:
    return EntryInfo(name=e.name, path=e.path, type=e.kind.value, size=e.size, mode=e.mode,
                     modified=e.mtime, symlink_target=e.target or None)


def _snapshot_id(ref: object) -> str:
    if isinstance(ref, SnapshotRef):
        return ref.snapshot_id
    if isinstance(ref, str):
        return ref
    raise InvalidArgument(f"expected a SnapshotRef or a snapshot/sandbox id, got {type(ref).__name__}")


def _ref(m) -> SnapshotRef:
    return SnapshotRef(snapshot_id=m.snapshot_id, sandbox_id=m.sandbox_id, created_at=m.created_at, tier=m.tier,
                       template=m.template, memory=m.memory, size_bytes=m.size_bytes,
                       context_skipped=m.context_skipped)


class _Output:
    """stdout/stderr of one run: accumulated as bytes, handed to callbacks as decoded text."""

    def __init__(self, on_stdout: Callable[[str], object] | None, on_stderr: Callable[[str], object] | None,
                 cap: int, sandbox_id: str) -> None:
        self.cap = cap
        self.sandbox_id = sandbox_id
        self.out, self.err = bytearray(), bytearray()
        self._sinks = {p.Stdout: (self.out, on_stdout, codecs.getincrementaldecoder("utf-8")("replace")),
                       p.Stderr: (self.err, on_stderr, codecs.getincrementaldecoder("utf-8")("replace"))}

    def feed(self, msg: p.Message) -> bool:
        """Take a Stdout/Stderr frame; False for any other message."""
        sink = self._sinks.get(type(msg))
        if sink is None:
            return False
        buf, callback, decoder = sink
        buf += msg.data
        if self.size > self.cap:  # the guest ignored the cap: it is misbehaving
            raise GuestProtocolError("guest sent more output than the cap", self.sandbox_id)
        if callback:
            callback(decoder.decode(msg.data))
        return True

    @property
    def size(self) -> int:
        return len(self.out) + len(self.err)

    def text(self) -> tuple[str, str]:
        return self.out.decode("utf-8", "replace"), self.err.decode("utf-8", "replace")


@dataclasses.dataclass(frozen=True)
class CodeContext:
    """A code interpreter whose state persists between ``run_code`` calls."""

    id: str
    language: str
    cwd: str


class AsyncSandbox:
    """A running sandbox. Create with :meth:`create`, reattach by id with :meth:`connect`."""

    _SYNC_ATTRS = ("commands", "files", "network")

    def __init__(self, engine: Engine, info: SandboxInfo, handle: BackendHandle, client: GuestClient,
                 timings: list[StageTiming]) -> None:
        self._engine = engine
        self._info = info
        self._handle = handle
        self._client = client
        self._stages = list(timings)
        self._backend = engine.backend(info.tier)
        self._oom_in_guest = self._backend.capabilities().oom_counted_in_guest
        self._env_names: tuple[str, ...] = ()
        self._active = 0
        self._killed = False
        self._approvals: asyncio.Task | None = None
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.network = AsyncNetwork(self)

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.sandbox_id!r}, tier={self.tier!r}, state={self.state.value!r})"

    # ---- construction

    @classmethod
    async def create(cls, tier: str | None = None, *, timeout: float | None = None,
                     envs: dict[str, str] | None = None, limits: Limits | None = None,
                     template: str | None = None, pool: bool = True,
                     from_snapshot: "SnapshotRef | str | None" = None,
                     network: "str | Network" = "none", secrets: "dict[str, Secret] | None" = None,
                     on_approval: "Callable[[ApprovalRequest], object] | None" = None,
                     home: str | Path | None = None) -> "AsyncSandbox":
        """Create and start a sandbox (defaults for tier, timeout and template: warmbox.toml).

        tier: "container" (runc); other tiers raise BackendUnavailable until they exist.
        timeout: seconds the sandbox lives (wall clock) before it is destroyed; see set_timeout.
        envs: environment of every process in the sandbox, on top of PATH, HOME and LANG only.
        template: "base" (Python context started), "pydata" (numpy/pandas imported), "shell",
            or one from warmbox.toml; its warm-up has run before the sandbox is returned.
        pool: take a ready sandbox from a matching warm pool when one is there (``from_pool``);
            False always creates cold. A pooled sandbox never served anyone before.
        from_snapshot: fork a new sandbox from a snapshot (its tier, template and limits; the
            origin is untouched). Environment values are never stored in snapshots: pass envs.
        network: "none" (default: loopback only), "internet" (any public address; never cloud
            metadata, private, link-local or the host's own), or warmbox.Network(allow=[...],
            deny=[...], on_unknown="deny"|"ask"). Egress goes through warmbox's proxy, whose
            address is in HTTP(S)_PROXY; every attempt is in ``network.log()``.
        secrets: env name -> warmbox.Secret(value, hosts=[...]): the sandbox's env gets only a
            placeholder; the proxy puts the value into request headers to those hosts only.
        on_approval: with on_unknown="ask", called with an ApprovalRequest for each destination
            outside the allowlist; return "allow_once", "allow_always" or "deny" (may be async).
            The connection waits for it (network.approval_timeout, then denied).
        """
        engine = Engine.for_home(home)
        if on_approval is not None and not callable(on_approval):
            raise InvalidArgument("on_approval must be a callable")
        if from_snapshot is not None and (network != "none" or secrets):
            raise InvalidArgument("a sandbox forked from a snapshot starts without network; use network.update()")
        if from_snapshot is not None:
            if tier is not None or limits is not None or template is not None:
                raise InvalidArgument("from_snapshot takes its tier, template and limits from the snapshot")
            m = snapshots.resolve(engine, _snapshot_id(from_snapshot))
            info, handle, client, timings = await snapshots.restore(engine, m, timeout=timeout, envs=envs, pool=pool)
        else:
            info, handle, client, timings = await engine.create(
                tier=tier, timeout=timeout, envs=envs, limits=limits, template=template, pool=pool,
                network=network, secrets=secrets)
        sb = cls(engine, info, handle, client, timings)
        sb._env_names = tuple(envs or ())
        if on_approval is not None:
            try:
                await sb._subscribe(on_approval)
            except BaseException:
                await sb.kill()
                raise
        return sb

    async def _subscribe(self, hook: Callable) -> None:
        from warmbox.engine import egress

        subscribed = asyncio.Event()
        self._approvals = asyncio.ensure_future(egress.approvals(self._engine.home, self.sandbox_id, hook, subscribed))
        try:
            await asyncio.wait_for(subscribed.wait(), 10)
        except asyncio.TimeoutError:
            raise egress.EgressError("could not subscribe to the egress proxy's approval requests") from None

    @classmethod
    async def resume(cls, snapshot: "SnapshotRef | str", *, timeout: float | None = None,
                     envs: dict[str, str] | None = None, home: str | Path | None = None) -> "AsyncSandbox":
        """Bring back a paused sandbox (by its id or a SnapshotRef) as a new running sandbox.

        Files and the default code context's state are restored; on a tier without memory
        snapshots, processes that ran before the pause are not (they start fresh).
        """
        engine = Engine.for_home(home)
        info, handle, client, timings = await snapshots.resume(engine, _snapshot_id(snapshot),
                                                               timeout=timeout, envs=envs)
        sb = cls(engine, info, handle, client, timings)
        sb._env_names = tuple(envs or ())
        return sb

    @classmethod
    async def list_snapshots(cls, *, home: str | Path | None = None) -> list[tuple[str, str, float, int]]:
        """(snapshot_id, sandbox_id, created_at, size_bytes) of every snapshot in this home."""
        return Engine.for_home(home).registry.all_snapshots()

    @classmethod
    async def connect(cls, sandbox_id: str, *, home: str | Path | None = None) -> "AsyncSandbox":
        """Attach to a live sandbox created by any process."""
        engine = Engine.for_home(home)
        info, handle, client = await engine.open(sandbox_id)
        return cls(engine, info, handle, client, engine.registry.timings(sandbox_id))

    @classmethod
    async def list(cls, *, home: str | Path | None = None, include_dead: bool = False) -> list[SandboxInfo]:
        return Engine.for_home(home).list(include_dead)

    # ---- properties

    @property
    def sandbox_id(self) -> str:
        return self._info.sandbox_id

    @property
    def id(self) -> str:
        return self._info.sandbox_id

    @property
    def tier(self) -> str:
        return self._info.tier

    @property
    def timings(self) -> dict[str, float]:
        """Stage timings of this sandbox's start, ms: allocation, filesystem, runtime,
        dependencies (template warm-up), first_command. See ``stage_timings`` for which of them
        the caller waited for (a pooled sandbox's were done before it was requested)."""
        return {t.stage: t.duration_ms for t in self._stages}

    @property
    def stage_timings(self) -> list[StageTiming]:
        return list(self._stages)

    @property
    def from_pool(self) -> bool:
        """True if this sandbox was handed out ready from a warm pool."""
        return self._info.from_pool

    @property
    def template(self) -> str:
        return self._info.template

    @property
    def state(self) -> State:
        if self._killed:
            return State.DESTROYED
        return State.RUNNING if self._active else State.READY

    # ---- lifecycle

    async def get_info(self) -> SandboxInfo:
        info, _ = self._engine.info(self.sandbox_id)
        return info

    async def is_running(self) -> bool:
        if self._killed:
            return False
        info, _ = self._engine.info(self.sandbox_id)
        return info.state in (State.READY, State.RUNNING) and info.expires_at > time.time()

    async def metrics(self) -> SandboxMetrics:
        """This sandbox's cost so far: cpu-s, memory GiB-s, wall/busy/idle seconds (final once
        destroyed). A pooled sandbox's warm-up is accounted to its pool, not here."""
        return await self._engine.metrics(self.sandbox_id, None if self._killed else self._client)

    async def snapshot(self, *, memory: bool = False) -> SnapshotRef:
        """Save this sandbox's files and code-context state; it keeps running.

        memory=True asks for process memory too: SnapshotUnsupported on a tier that cannot.
        """
        self._check_usable()
        m = await snapshots.snapshot(self._engine, self.sandbox_id, self._client, memory=memory,
                                     parent=self._engine.registry.parent(self.sandbox_id), env_names=self._env_names)
        return _ref(m)

    async def pause(self, *, memory: bool = False) -> SnapshotRef:
        """Snapshot, then release everything (no process, CPU or memory is left); resume() later."""
        self._check_usable()
        try:
            m = await snapshots.pause(self._engine, self.sandbox_id, self._client, memory=memory,
                                      parent=self._engine.registry.parent(self.sandbox_id), env_names=self._env_names)
        except BaseException:
            if memory:  # the agent dropped its sockets for the checkpoint: attach again if it still runs
                await self._reattach()
            raise
        self._killed = True
        return _ref(m)

    async def _reattach(self, within_s: float = 15.0) -> None:
        """A new connection to this (still running) sandbox's agent, waiting for it to listen."""
        from warmbox.errors import GuestConnectionError

        await self._client.close()
        deadline = time.monotonic() + within_s
        while True:
            try:
                _, _, self._client = await self._engine.open(self.sandbox_id)
                return
            except GuestConnectionError:
                if time.monotonic() > deadline:
                    return  # the next call reports the dead connection
                await asyncio.sleep(0.05)
            except WarmboxError:
                return  # gone or paused after all: the next call says so

    async def set_timeout(self, timeout: float) -> None:
        """Let the sandbox live ``timeout`` more seconds from now."""
        self._engine.set_timeout(self.sandbox_id, timeout)

    async def kill(self) -> bool:
        """Destroy the sandbox and everything it holds. False if it was already gone."""
        self._killed = True
        if self._approvals is not None:
            self._approvals.cancel()
        await self._client.close()
        return await self._engine.destroy(self.sandbox_id, "killed")

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._killed:
            await self.kill()

    # ---- plumbing shared by commands/files/code

    def _check_usable(self) -> None:
        if self._killed:
            check(Operation.EXEC, State.DESTROYED, self.sandbox_id)

    async def _oom_before(self) -> int:
        """The host's reading of the sandbox's OOM-kill counter before a call, or -1 on tiers whose
        agent counts OOM kills itself (microvm: the guest kernel's OOM killer; no host read)."""
        if self._oom_in_guest:
            return -1
        return await self._backend.oom_kills(self._handle)

    async def _oom_killed(self, before: int, reported: int) -> bool:
        """Whether the call lost a process to the OOM killer: the agent's count on tiers whose
        kernel is the sandbox's own (``reported``; -1 = unknown), else the host's counter against
        ``before`` (an agent in a container could report anything)."""
        if self._oom_in_guest:  # only there: elsewhere the host's cgroup counter decides
            return reported > 0
        return (await self._backend.oom_kills(self._handle)) > before

    def _record_first(self, started: float) -> None:
        if not any(t.stage == "first_command" for t in self._stages):
            ms = (time.perf_counter() - started) * 1e3
            self._stages.append(StageTiming(self.sandbox_id, "first_command", ms, True))
            # written right after the caller has its result, not on its path
            asyncio.get_running_loop().call_soon(self._write_timing, "first_command", ms)

    def _write_timing(self, stage: str, ms: float) -> None:
        try:
            self._engine.registry.add_timing(self.sandbox_id, stage, ms)
        except WarmboxError:
            pass  # a busy registry must not fail the user's command; the SDK object keeps it

    # ---- code contexts

    async def create_code_context(self, language: str = "python", *, cwd: str = WORKDIR,
                                  envs: dict[str, str] | None = None) -> CodeContext:
        self._check_usable()
        cwd = sandbox_path(cwd)
        env = dict(validate_envs(envs))
        reply = await self._client.call(
            lambda i: p.ContextCreate(i, name="", language=language, cwd=cwd, env=env), p.ContextCreated)
        if isinstance(reply, p.Failure):
            _raise_failure(reply, self.sandbox_id, "create_code_context")
        return CodeContext(id=reply.context, language=language, cwd=cwd)

    async def remove_code_context(self, context: CodeContext | str) -> None:
        self._check_usable()
        name = context.id if isinstance(context, CodeContext) else context
        reply = await self._client.call(lambda i: p.ContextDelete(i, context=name), p.Ok)
        if isinstance(reply, p.Failure):
            _raise_failure(reply, self.sandbox_id, "remove_code_context")

    async def run_code(self, code: str, *, context: CodeContext | str | None = None,
                       timeout: float | None = DEFAULT_COMMAND_TIMEOUT_S,
                       on_stdout: Callable[[str], object] | None = None,
                       on_stderr: Callable[[str], object] | None = None,
                       max_output: int = DEFAULT_MAX_OUTPUT) -> Execution:
        """Run Python in a stateful context (the default one unless ``context`` is given).

        The value of the last expression is the main result (``Execution.text``); exceptions
        come back as ``Execution.error``, never raised. timeout: seconds, wall clock; on expiry
        the cell is interrupted (state kept), or the context killed if it ignores that.
        """
        self._check_usable()
        if not isinstance(code, str):
            raise InvalidArgument(f"code must be a string, got {type(code).__name__}")
        name = "default" if context is None else (context.id if isinstance(context, CodeContext) else context)
        t = _optional_timeout(timeout)
        cap = _max_output(max_output)
        started = time.perf_counter()
        oom_before = await self._oom_before()
        output = _Output(on_stdout, on_stderr, cap, self.sandbox_id)
        displays: dict[int, dict[str, object]] = {}
        display_bytes = 0
        mains: set[int] = set()
        self._active += 1
        try:
            async with self._client.request(
                    lambda i: p.ContextRun(i, context=name, code=code, timeout_s=t, max_output=cap),
                    timeout=t + HOST_GRACE_S if t else None) as stream:
                while True:
                    msg = await stream.next(p.Stdout, p.Stderr, p.Display, p.CodeDone)
                    if output.feed(msg):
                        continue
                    if isinstance(msg, p.Display):
                        display_bytes += len(msg.data)
                        if display_bytes > MAX_DISPLAY_BYTES:
                            raise GuestProtocolError("guest sent too much rich output", self.sandbox_id)
                        field = _MIME_FIELDS.get(msg.mime)
                        if field is None:
                            continue
                        bucket = displays.setdefault(msg.result, {})
                        bucket[field] = msg.data if field in ("png", "jpeg") else msg.data.decode("utf-8", "replace")
                        if msg.main:
                            mains.add(msg.result)
                    elif isinstance(msg, p.Failure):
                        _raise_failure(msg, self.sandbox_id, "run_code")
                    else:
                        done = msg
                        break
        finally:
            self._active -= 1
        oom = await self._oom_killed(oom_before, done.oom_kills)
        self._record_first(started)
        results = tuple(Result(is_main_result=k in mains, **v) for k, v in sorted(displays.items()))  # type: ignore[arg-type]
        error = (ExecutionError(done.error_name, done.error_value, done.traceback)
                 if done.error_name else None)
        stdout, stderr = output.text()
        return Execution(results=results, stdout=stdout, stderr=stderr, error=error, timed_out=done.timed_out,
                         truncated=done.truncated, oom_killed=oom, execution_count=done.execution_count,
                         duration_ms=done.duration_ms)


class AsyncCommands:
    """``sandbox.commands``: run processes inside the sandbox."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def run(self, cmd: str | list[str], *, envs: dict[str, str] | None = None, cwd: str | None = None,
                  timeout: float | None = DEFAULT_COMMAND_TIMEOUT_S, stdin: str | bytes | None = None,
                  on_stdout: Callable[[str], object] | None = None,
                  on_stderr: Callable[[str], object] | None = None,
                  max_output: int = DEFAULT_MAX_OUTPUT, check: bool = False) -> CommandResult:
        """Run ``cmd`` (a shell string for bash, or an argv list) and wait for it.

        timeout: seconds, wall clock (None or 0: no limit); on expiry every process the command
        started is killed, double-forked and setsid()ed ones included, and ``timed_out`` is set.
        What it starts and leaves running when it exits normally (``nohup server &``) stays;
        a runaway one is bounded by limits.pids and limits.cpus. On gVisor a command runs in its
        own PID namespace: ``$$`` counts from 2 there while ``ps`` shows the sandbox's pids, and a
        command cannot signal what another one started (agent.Scopes).
        Output beyond ``max_output`` bytes (stdout+stderr) is dropped and ``truncated`` set.
        ``check=True`` raises CommandFailed on a non-zero exit.
        """
        sb = self._sb
        sb._check_usable()
        if isinstance(cmd, str):
            if not cmd.strip():
                raise InvalidArgument("cmd must not be empty")
            argv = ["/bin/bash", "-c", cmd]
        elif isinstance(cmd, (list, tuple)) and cmd and all(isinstance(a, str) for a in cmd):
            argv = list(cmd)
        else:
            raise InvalidArgument("cmd must be a non-empty string or list of strings")
        if any("\0" in a for a in argv):
            raise InvalidArgument("cmd must not contain NUL bytes")
        env = dict(validate_envs(envs))
        workdir = sandbox_path(cwd) if cwd is not None else ""
        t = _optional_timeout(timeout)
        cap = _max_output(max_output)
        if stdin is not None and not isinstance(stdin, (str, bytes)):
            raise InvalidArgument("stdin must be str or bytes")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        started = time.perf_counter()
        oom_before = await sb._oom_before()
        output = _Output(on_stdout, on_stderr, cap, sb.sandbox_id)
        pid = 0
        sb._active += 1
        try:
            async with sb._client.request(lambda i: p.Exec(
                    i, argv=argv, env=env, cwd=workdir, timeout_s=t, max_output=cap,
                    stdin=data is not None), timeout=t + HOST_GRACE_S if t else None) as stream:
                if data is not None:
                    for off in range(0, len(data), p.CHUNK):
                        await stream.send(p.StdinData(stream.id, data=data[off:off + p.CHUNK], eof=False))
                    await stream.send(p.StdinData(stream.id, data=b"", eof=True))
                while True:
                    msg = await stream.next(p.Started, p.Stdout, p.Stderr, p.Exited)
                    if output.feed(msg):
                        continue
                    if isinstance(msg, p.Started):
                        pid = msg.pid
                    elif isinstance(msg, p.Failure):
                        _raise_failure(msg, sb.sandbox_id, "commands.run")
                    else:
                        exited = msg
                        break
        finally:
            sb._active -= 1
        oom = await sb._oom_killed(oom_before, exited.oom_kills)
        sb._record_first(started)
        stdout, stderr = output.text()
        result = CommandResult(exit_code=exited.exit_code, stdout=stdout, stderr=stderr, timed_out=exited.timed_out,
                               truncated=exited.truncated, oom_killed=oom, signal=exited.signal,
                               duration_ms=exited.duration_ms, pid=pid)
        if check and not result.ok:
            raise CommandFailed(f"command exited with {result.exit_code}", sb.sandbox_id, result)
        return result


class AsyncNetwork:
    """The sandbox's egress: its policy, changes to it, and the audit log of every attempt."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def update(self, network: "str | Network") -> None:
        """Replace the policy; the next connection and DNS lookup obey it (open ones continue)."""
        self._sb._check_usable()
        await self._sb._engine.set_network(self._sb.sandbox_id, network, self._sb._client)

    async def policy(self) -> str:
        """The policy in force, in words ("none", "internet", "allow a, b; deny c")."""
        return self._sb._engine.network_policy(self._sb.sandbox_id).describe()

    async def log(self) -> list[NetEvent]:
        """Every egress attempt so far (connections and DNS lookups), oldest first."""
        return self._sb._engine.network_log(self._sb.sandbox_id)


class AsyncFiles:
    """``sandbox.files``: read and write the sandbox's filesystem (as the sandbox's user)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def read(self, path: str, *, format: str = "text", max_bytes: int = DEFAULT_READ_MAX_BYTES,
                   timeout: float | None = DEFAULT_READ_TIMEOUT_S) -> "str | bytes | AsyncFileStream":
        """A regular file's contents: ``format`` "text" (UTF-8), "bytes", or "stream" (an async
        iterator of bytes chunks, for ``async for``; the sync Sandbox: an iterator, ``for``).

        Symlinks are followed; a FIFO, device or socket raises NotARegularFile without being
        read. max_bytes: a larger file raises FileTooLarge (nothing partial is returned; a
        stream raises it after what fits), at most that much is ever held. A stream holds a few
        MiB at most however slowly it is consumed: use it for large files; close() it (or use
        ``with``) to stop early. timeout: seconds (None: no bound) for the whole read, or, for
        a stream, for each chunk; on expiry SandboxTimeout, and the read stops in the sandbox.
        """
        sb = self._sb
        sb._check_usable()
        if format not in ("text", "bytes", "stream"):
            raise InvalidArgument(f"format must be 'text', 'bytes' or 'stream', got {format!r}")
        path = sandbox_path(path)
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise InvalidArgument(f"max_bytes must be a positive number of bytes, got {max_bytes!r}")
        t = _optional_timeout(timeout) or None
        if format == "stream":
            stream = AsyncFileStream(sb.sandbox_id, path, await sb._client.read_file(path, max_bytes=max_bytes), t)
            await stream._start()
            return stream
        reader = await sb._client.read_file(path, max_bytes=max_bytes, timeout=t)
        buf = io.BytesIO()  # grows in place: its getvalue() is no second copy
        try:
            while True:
                try:
                    msg = await reader.next()
                except SandboxTimeout:
                    raise SandboxTimeout(f"read {path}: not done within {t:g} s", sb.sandbox_id) from None
                if isinstance(msg, p.Failure):
                    _raise_failure(msg, sb.sandbox_id, f"read {path}")
                if isinstance(msg, p.ChunkEnd):
                    break
                buf.write(msg.data)
        finally:
            reader.cancel()  # no-op after the end
        if format == "bytes":
            return buf.getvalue()
        with buf.getbuffer() as view:
            return str(view, "utf-8", "replace")

    async def write(self, path: str, data: str | bytes, *, mode: int = 0o644, append: bool = False) -> EntryInfo:
        """Create or replace a file (parent directories are created); returns its entry."""
        self._sb._check_usable()
        path = sandbox_path(path)
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise InvalidArgument(f"mode must be a permission number from 0 to 0o7777, got {mode!r}")
        if isinstance(data, str):
            raw = data.encode()
        elif isinstance(data, (bytes, bytearray, memoryview)):
            raw = bytes(data)
        else:
            raise InvalidArgument(f"data must be str or bytes, got {type(data).__name__}")
        msg = await self._sb._client.upload(path, raw, mode=mode, append=append)
        if isinstance(msg, p.Failure):
            _raise_failure(msg, self._sb.sandbox_id, f"write {path}")
        return _entry(msg)

    async def list(self, path: str = WORKDIR, *, depth: int = 1) -> list[EntryInfo]:
        self._sb._check_usable()
        path = sandbox_path(path)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise InvalidArgument(f"depth must be an integer >= 1, got {depth!r}")
        entries = []
        async with self._sb._client.request(lambda i: p.ListDir(i, path=path, depth=depth)) as stream:
            while True:
                msg = await stream.next(p.Entry, p.Ok)
                if isinstance(msg, p.Failure):
                    _raise_failure(msg, self._sb.sandbox_id, f"list {path}")
                if isinstance(msg, p.Ok):
                    return entries
                entries.append(_entry(msg))

    async def get_info(self, path: str) -> EntryInfo:
        self._sb._check_usable()
        path = sandbox_path(path)
        msg = await self._sb._client.call(lambda i: p.Stat(i, path=path), p.Entry)
        if isinstance(msg, p.Failure):
            _raise_failure(msg, self._sb.sandbox_id, f"stat {path}")
        return _entry(msg)

    async def exists(self, path: str) -> bool:
        try:
            await self.get_info(path)
        except PathNotFound:
            return False
        return True

    async def make_dir(self, path: str) -> bool:
        """Create a directory and its parents; False if it already existed."""
        self._sb._check_usable()
        path = sandbox_path(path)
        msg = await self._sb._client.call(lambda i: p.MakeDir(i, path=path, parents=True), p.Ok)
        if isinstance(msg, p.Failure):
            if msg.code is p.ErrorCode.EXISTS:
                return False
            _raise_failure(msg, self._sb.sandbox_id, f"make_dir {path}")
        return True

    async def remove(self, path: str) -> None:
        """Remove a file or a directory tree."""
        self._sb._check_usable()
        path = sandbox_path(path)
        msg = await self._sb._client.call(lambda i: p.Remove(i, path=path, recursive=True), p.Ok)
        if isinstance(msg, p.Failure):
            _raise_failure(msg, self._sb.sandbox_id, f"remove {path}")


class AsyncFileStream:
    """What ``files.read(path, format="stream")`` returns: the file's bytes in chunks (up to
    256 KiB each) for ``async for`` (the sync Sandbox's twin: ``for``). Flow-controlled: the
    sandbox sends a few MiB ahead of what was taken, no more. close() (or leaving a ``with``
    block, or dropping the stream) stops the read in the sandbox; an error (FileTooLarge when
    the file grew past max_bytes, SandboxTimeout when a chunk took longer than the timeout)
    is raised by the iteration, after the chunks that came before it."""

    def __init__(self, sandbox_id: str, path: str, reader: FileRead, timeout: float | None) -> None:
        self._sandbox_id = sandbox_id
        self._path = path
        self._reader = reader
        self._timeout = timeout
        self._loop = asyncio.get_running_loop()
        self._first: bytes | None = None

    @property
    def path(self) -> str:
        return self._path

    @property
    def bytes_read(self) -> int:
        """Bytes received so far."""
        return self._reader.received

    async def _start(self) -> None:
        """Wait for the first answer, so a missing file or a FIFO raises from files.read itself."""
        self._first = await self._take()

    async def _take(self) -> bytes | None:
        try:
            msg = await self._reader.next(self._timeout)
        except SandboxTimeout:
            raise SandboxTimeout(f"read {self._path}: no data within {self._timeout:g} s", self._sandbox_id) from None
        if isinstance(msg, p.Failure):
            _raise_failure(msg, self._sandbox_id, f"read {self._path}")
        return msg.data if isinstance(msg, p.Chunk) else None

    def __aiter__(self) -> "AsyncFileStream":
        return self

    async def __anext__(self) -> bytes:
        data, self._first = self._first, None
        if data is None and not self._reader.done:
            data = await self._take()
        if data is None:
            raise StopAsyncIteration
        return data

    async def close(self) -> None:
        """Stop the read (in the sandbox too); what was not taken is dropped. Idempotent."""
        self._first = None
        self._reader.cancel()

    async def __aenter__(self) -> "AsyncFileStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __del__(self) -> None:
        reader = getattr(self, "_reader", None)
        if reader is not None and not reader.done:
            try:
                self._loop.call_soon_threadsafe(reader.cancel)
            except RuntimeError:  # the loop is closed: so is the connection
                pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={self._path!r}, bytes_read={self.bytes_read})"


FileStream = synchronize(AsyncFileStream, "FileStream")

__all__ = ["AsyncSandbox", "AsyncCommands", "AsyncFiles", "AsyncFileStream", "CodeContext", "FileStream",
           "FilesError", "sandbox_path"]
