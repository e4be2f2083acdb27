"""The async SDK: ``AsyncSandbox`` with ``commands``, ``files``, ``network`` and code contexts (E2B's shape).

Every call is one typed request of :mod:`warmbox.operations` sent through a
:class:`~warmbox.sdk.transport.Transport` (in process by default). The sync ``Sandbox`` is
derived from this module by :mod:`warmbox.sdk._sync`; nothing here is written twice.
"""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import Callable
from datetime import datetime
from os import PathLike
from pathlib import Path
from typing import Any, TypeVar, cast

from warmbox import operations as ops
from warmbox import transcript
from warmbox.errors import InvalidArgument, PortNotListening, SandboxNotFound
from warmbox.models import (
    ApprovalRequest,
    Execution,
    ExecutionError,
    Lifecycle,
    Limits,
    MetricSample,
    Requirements,
    Result,
    SandboxInfo,
    SandboxMetrics,
    SandboxQuery,
    SnapshotRef,
    StageTiming,
    State,
    TierChoice,
    Transcript,
    Volume,
    VolumeInfo,
    validate_lifecycle,
    validate_metadata,
    validate_query,
    validate_volumes,
)
from warmbox.sdk._sync import either
from warmbox.sdk.code import CodeContext, context_id
from warmbox.sdk.commands import DEFAULT_COMMAND_TIMEOUT_S, DEFAULT_MAX_OUTPUT, AsyncCommands
from warmbox.sdk.files import WORKDIR, AsyncFiles
from warmbox.sdk.network import AsyncNetwork
from warmbox.sdk.ports import PortForward
from warmbox.sdk.pty import AsyncPty
from warmbox.sdk.transport import Cancellable, LocalTransport, Transport, default_url
from warmbox.tiers import TIERS

# every name a tier goes by: refused as a template (a tier given where E2B's template goes)
TIER_NAMES = frozenset(alias for aliases, _ in TIERS.values() for alias in aliases)

R = TypeVar("R")


def _snapshot_id(ref: object) -> str:
    if isinstance(ref, SnapshotRef):
        return ref.snapshot_id
    if isinstance(ref, str):
        return ref
    raise InvalidArgument(f"expected a SnapshotRef or a snapshot/sandbox id, got {type(ref).__name__}")


def _epoch(at: object) -> Any:
    """A time as the operations take it: epoch seconds (a datetime's; anything else as given,
    for the front to check)."""
    return at.timestamp() if isinstance(at, datetime) else at


def _transport(
    transport: Transport | None,
    home: str | Path | None,
    api_url: str | None = None,
    api_key: str | None = None,
    request_timeout: float | None = None,
) -> Transport:
    """The transport a call uses: the one given; a warmbox server (api_url, or WARMBOX_API_URL when
    no home is given); else the in-process engine of ``home``. request_timeout: seconds one request
    to a server may take (E2B's name; None: each operation's own bound)."""
    if request_timeout is not None and (
        isinstance(request_timeout, bool) or not isinstance(request_timeout, (int, float)) or not request_timeout > 0
    ):
        raise InvalidArgument(f"request_timeout must be a positive number of seconds, got {request_timeout!r}")
    if sum(x is not None for x in (transport, home, api_url)) > 1:
        raise InvalidArgument("pass one of home (the in-process engine), api_url (a server) or transport")
    if transport is not None:
        return transport
    if api_url is not None or (home is None and default_url()):
        # lazily, by design: the HTTP client (aiohttp, ~180 ms to import) only when a server is addressed
        from warmbox.sdk.http import HttpTransport

        return HttpTransport(api_url, api_key, request_timeout=request_timeout)
    if api_key is not None:
        raise InvalidArgument("api_key needs api_url (or WARMBOX_API_URL): the in-process engine takes no key")
    return LocalTransport(home)


def _sandbox_query(query: object) -> SandboxQuery | None:
    """A list query as a SandboxQuery record (a plain dict, as E2B takes one, is converted)."""
    if query is None:
        return None
    if isinstance(query, SandboxQuery):
        return validate_query(query)
    if not isinstance(query, dict):
        raise InvalidArgument(f"query must be a warmbox.SandboxQuery or a dict, got {type(query).__name__}")
    unknown = sorted(str(k) for k in query if k not in ("metadata", "state"))
    if unknown:
        raise InvalidArgument(f"query takes 'metadata' and 'state', not {', '.join(map(repr, unknown))}")
    state = query.get("state")
    if isinstance(state, (str, State)):
        state = (state,)
    elif isinstance(state, list):
        state = tuple(state)
    return validate_query(SandboxQuery(metadata=query.get("metadata"), state=state))


async def _once(t: Transport, request: ops.Request[R], owned: bool) -> R:
    """One request on a transport made for it (closed after) or given by the caller (left open)."""
    try:
        return await t.handle(request)
    finally:
        if owned:
            await t.close()


async def _export(t: Transport, request: ops.Export, path: str | PathLike[str] | None, fmt: str) -> Transcript:
    if fmt not in ("ndjson", "json"):
        raise InvalidArgument(f"format must be 'ndjson' or 'json', got {fmt!r}")
    got = await t.handle(request)
    if path is not None:
        await asyncio.to_thread(transcript.write, got, path, "json" if fmt == "json" else "ndjson")
    return got


async def _kill_by_id(
    cls: type,
    sandbox_id: str,
    *,
    home: str | Path | None = None,
    transport: Transport | None = None,
    api_url: str | None = None,
    api_key: str | None = None,
    request_timeout: float | None = None,
) -> bool:
    """``Sandbox.kill(sandbox_id)``: destroy a sandbox by id (False: there was none of that id)."""
    if not isinstance(sandbox_id, str) or not sandbox_id:
        raise InvalidArgument(f"kill on the class takes a sandbox id, got {sandbox_id!r}")
    t = _transport(transport, home, api_url, api_key, request_timeout)
    try:
        return await _once(t, ops.Kill(sandbox_id), transport is None)
    except SandboxNotFound:
        return False


class AsyncSandbox:
    """A running sandbox. Create with :meth:`create`, reattach by id with :meth:`connect`.

    ``async with`` kills it on exit (E2B's shape); :meth:`close` lets go of it without ending it.
    """

    _SYNC_ATTRS = ("commands", "files", "network", "pty")

    def __init__(self, transport: Transport, opened: ops.Opened, env_names: tuple[str, ...] = ()) -> None:
        self._transport = transport
        self._info = opened.info
        self._stages = list(opened.timings)
        self._env_names = env_names
        self._active = 0
        self._killed = False
        self._paused = False  # paused through this object (and not used since): not killed on exit
        self._closed = False
        self._approvals: Cancellable | None = None
        self._owns_transport = False  # made for this sandbox by create/connect/resume: released by kill()
        self._forwards: dict[tuple[int, bool], PortForward] = {}
        self._first_execution: Execution | None = None
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.network = AsyncNetwork(self)
        self.pty = AsyncPty(self)

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.sandbox_id!r}, tier={self.tier!r}, state={self.state.value!r})"

    # ---- construction

    @classmethod
    async def create(
        cls,
        template: str | None = None,
        *,
        tier: str | None = None,
        timeout: float | None = None,
        envs: dict[str, str] | None = None,
        limits: Limits | None = None,
        pool: bool = True,
        from_snapshot: SnapshotRef | str | None = None,
        network: Any = "none",
        secrets: dict[str, Any] | None = None,
        on_approval: Callable[[ApprovalRequest], object] | None = None,
        metadata: dict[str, str] | None = None,
        lifecycle: Lifecycle | None = None,
        volumes: builtins.list[Volume] | None = None,
        requirements: Requirements | None = None,
        home: str | Path | None = None,
        transport: Transport | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
        idempotency_key: str | None = None,
        run_code: str | None = None,
    ) -> AsyncSandbox:
        """Create and start a sandbox (defaults for template, tier and timeout: warmbox.toml).

        template: the first argument, as in E2B (``Sandbox.create("pydata")``): "base" (Python
            context started at the first run_code), "pydata" (numpy/pandas imported), "shell", or one from warmbox.toml
            or built with Templates.build; its warm-up has run before the sandbox is returned. A
            tier's name here is an InvalidArgument that says to pass ``tier=``.
        tier: keyword only: "container" (runc), "gvisor" (runsc) or "microvm" (QEMU); see ``warmbox doctor``.
            "auto": the tier :meth:`choose_tier` picks for ``requirements`` (default: untrusted
            Python, compute), among tiers with egress when ``network`` is a policy; the choice and
            its reasons are in ``get_info()`` (``requirements``, ``tier_reasons``,
            ``tier_rejected``). NoSuitableTier when no tier is strong enough.
        requirements: Requirements(language, trusted, io, guest_kernel) for tier="auto" (given
            alone, it implies tier="auto").
        timeout: seconds the sandbox lives (wall clock) before it is destroyed; see set_timeout.
        envs: environment of every process in the sandbox, on top of PATH, HOME and LANG only.
        pool: take a ready sandbox from a matching warm pool when one is there (``from_pool``);
            False always creates cold. A pooled sandbox never served anyone before.
        from_snapshot: fork a new sandbox from a snapshot (its tier, template, limits and network
            policy; the origin is untouched). Environment and secret values are never stored in
            snapshots: pass envs, and secrets as for ``resume`` (SecretsRequired names the missing).
        network: "none" (default: loopback only), "internet" (any public address; never cloud
            metadata, private, link-local or the host's own), or warmbox.Network(allow=[...],
            deny=[...], on_unknown="deny"|"ask"); an entry may name a registry's preset
            ("pypi", "npm", "github", ...). Egress goes through warmbox's proxy, whose
            address is in HTTP(S)_PROXY; every attempt is in ``network.log()``.
        secrets: env name -> warmbox.Secret(value, hosts=[...]): the sandbox's env gets only a
            placeholder; the proxy puts the value into request headers to those hosts only.
        on_approval: with on_unknown="ask", called with an ApprovalRequest for each destination
            outside the allowlist; return "allow_once", "allow_always" or "deny" (may be async).
            The connection waits for it (network.approval_timeout, then denied). Without
            one, the question waits in the approval queue (``warmbox approvals``, the dashboard).
        metadata: your own string keys and values (at most 64 entries, 16 KiB), shown in
            ``get_info().metadata`` and matched by ``list(query=SandboxQuery(metadata=...))``.
        lifecycle: Lifecycle(on_timeout="kill"|"pause", idle_pause_after=seconds|None,
            auto_resume=bool): pause it (to the object store; nothing runs or is held) when its
            timeout runs out or it was not used for idle_pause_after seconds; with auto_resume
            the next operation on it resumes it (``get_timings()["resume"]``), else that
            operation raises SandboxPaused. Paused sandboxes are deleted after ``[lifecycle]
            paused_retention`` (warmbox.toml).
        volumes: [Volume(name, path, read_only=False)]: your named volumes (``create_volume``)
            mounted at those paths, on every tier; their files outlive the sandbox. Such a
            sandbox is never taken from a pool. A microVM mounts a read-write volume alone
            (VolumeInUse while any other sandbox mounts it); read-only ones are shared.
        home: the warmbox home of the in-process engine (default: WARMBOX_HOME).
        api_url, api_key: a warmbox server (``warmbox serve``: ``http(s)://host:port`` or
            ``unix:/path``) and its key; default WARMBOX_API_URL / WARMBOX_API_KEY when no home is
            given. transport: any other way to reach an engine. At most one of home, api_url, transport.
        request_timeout: seconds each request to a server may take (E2B's name; ConnectionLost
            after it); the in-process engine sends no requests, so it bounds nothing there.
        idempotency_key: a repeat with the same key (same tenant, same arguments) creates nothing:
            it returns the first create's sandbox, even if that one has ended since (then using it
            says so); other arguments are IdempotencyConflict. Kept ``[lifecycle]
            idempotency_ttl`` (24 h).
        run_code: a first code cell run in the new sandbox's default context in the same request
            (one round trip to a server instead of two); its Execution is ``first_execution``. An
            error of the code is in it; a run that fails otherwise kills the sandbox and raises.
        """
        if isinstance(template, str) and (template == "auto" or template in TIER_NAMES):
            raise InvalidArgument(
                f"{template!r} is a tier, not a template: Sandbox.create(tier={template!r}) (the first "
                'argument is the template, as in E2B: Sandbox.create("base", tier=...))'
            )
        if on_approval is not None and not callable(on_approval):
            raise InvalidArgument("on_approval must be a callable")
        if metadata is not None:
            validate_metadata(metadata)  # the same check as the engine's, before the wire's JSON
        if lifecycle is not None:
            validate_lifecycle(lifecycle)
        if requirements is not None and not isinstance(requirements, Requirements):
            raise InvalidArgument(f"requirements must be a warmbox.Requirements, got {type(requirements).__name__}")
        t = _transport(transport, home, api_url, api_key, request_timeout)
        snap = _snapshot_id(from_snapshot) if from_snapshot is not None else None
        create = ops.Create(
            tier=tier,
            timeout=timeout,
            envs=envs,
            limits=limits,
            template=template,
            pool=pool,
            from_snapshot=snap,
            network=network,
            secrets=secrets,
            metadata=metadata,
            lifecycle=lifecycle,
            volumes=None if volumes is None else tuple(validate_volumes(volumes)),
            requirements=requirements,
            idempotency_key=idempotency_key if run_code is None else None,
        )
        request: ops.Create | ops.CreateAndRun = create
        if run_code is not None:
            request = ops.CreateAndRun(create, run_code, idempotency_key=idempotency_key)
        sb = await cls._open(t, transport is None, request, tuple(envs or ()))
        if on_approval is not None:
            try:
                sb._approvals = await t.subscribe_approvals(sb.sandbox_id, on_approval)
            except BaseException:
                await sb.kill()
                raise
        return sb

    @classmethod
    async def _open(
        cls,
        t: Transport,
        owned: bool,
        request: ops.Request[ops.Opened] | ops.CreateAndRun,
        env_names: tuple[str, ...] = (),
    ) -> AsyncSandbox:
        """A sandbox from a create (and its first run), resume or connect on ``t``; a transport made
        for it (``owned``) is closed if the request fails, and released by the sandbox's kill() otherwise."""
        try:
            got: Any = await t.handle(cast(ops.Request[Any], request))
        except BaseException:
            if owned:
                await t.close()
            raise
        started = got if isinstance(got, ops.Started) else None
        sb = cls(t, got.opened if started is not None else got, env_names)
        sb._owns_transport = owned
        if started is not None:
            sb._first_execution = started.execution
            sb._stages.append(StageTiming(sb.sandbox_id, "first_command", started.run_ms, True))
            await t.handle(ops.RecordFirstCommand(sb.sandbox_id, started.run_ms))
        return sb

    @classmethod
    async def resume(
        cls,
        snapshot: SnapshotRef | str,
        *,
        timeout: float | None = None,
        envs: dict[str, str] | None = None,
        secrets: dict[str, Any] | None = None,
        home: str | Path | None = None,
        transport: Transport | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ) -> AsyncSandbox:
        """Bring back a paused sandbox by its id: the same ``sandbox_id`` runs again, with the
        timeout it was created with unless ``timeout`` is given, and its network policy.
        The SnapshotRef that ``pause()`` returned does the same while its sandbox is paused; any
        other snapshot (SnapshotRef or snapshot id) forks a new sandbox from it (with the
        snapshot's network policy, on a link, address, CA and ``network.log()`` of its own).

        secrets: the values of the secrets the sandbox was created with (env name -> the value,
        for the hosts it had, or a warmbox.Secret): warmbox never stores them, so a resume or
        fork without them raises SecretsRequired naming the missing ones, and changes nothing
        (a paused sandbox stays paused). Their placeholders in the sandbox's env stay the same.

        Files and the default code context's state are restored; on a tier without memory
        snapshots, processes that ran before the pause are not (they start fresh). The stage
        ``resume`` in ``timings`` is how long the resume took (ms).
        """
        t = _transport(transport, home, api_url, api_key, request_timeout)
        request = ops.Resume(_snapshot_id(snapshot), timeout=timeout, envs=envs, secrets=secrets)
        return await cls._open(t, transport is None, request, tuple(envs or ()))

    @classmethod
    async def choose_tier(
        cls,
        requirements: Requirements | None = None,
        *,
        home: str | Path | None = None,
        transport: Transport | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ) -> TierChoice:
        """The tier for code of ``requirements`` (default: untrusted Python, compute) on the engine's
        host: the four questions (language, trusted, io, guest_kernel) against each tier's declared
        capabilities, whether the host runs it, and the host's measured ``warmbox bench profile``.
        Returns ``TierChoice(tier, reasons, rejected={tier: why not})``; NoSuitableTier when no tier
        is strong enough (never a weaker one). ``create(tier="auto", requirements=...)`` uses it."""
        if requirements is not None and not isinstance(requirements, Requirements):
            raise InvalidArgument(f"requirements must be a warmbox.Requirements, got {type(requirements).__name__}")
        t = _transport(transport, home, api_url, api_key, request_timeout)
        return await _once(t, ops.ChooseTier(requirements or Requirements()), transport is None)

    @classmethod
    async def list_snapshots(
        cls,
        *,
        home: str | Path | None = None,
        transport: Transport | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ) -> builtins.list[tuple[str, str, float, int]]:
        """(snapshot_id, sandbox_id, created_at, size_bytes) of every snapshot in this home (or,
        on a server, of the key's tenant)."""
        t = _transport(transport, home, api_url, api_key, request_timeout)
        return await _once(t, ops.ListSnapshots(), transport is None)

    @classmethod
    async def create_volume(
        cls,
        name: str,
        size_mb: int,
        *,
        home: str | Path | None = None,
        transport: Transport | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ) -> VolumeInfo:
        """A new empty named volume of ``size_mb`` MiB (its limit: a writer inside gets NoSpace;
        the host's disk pays only for what is written). Mount it with ``create(volumes=[Volume(name,
        "/data")])``. name: 1-63 letters, digits, ``_ . -``; VolumeError if you have one of that name."""
        t = _transport(transport, home, api_url, api_key, request_timeout)
        return await _once(t, ops.VolumeCreate(name, size_mb), transport is None)

    @classmethod
    async def list_volumes(
        cls,
        *,
        home: str | Path | None = None,
        transport: Transport | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ) -> builtins.list[VolumeInfo]:
        """Your named volumes, by name (``mounted_by``: the live or paused sandboxes mounting each)."""
        t = _transport(transport, home, api_url, api_key, request_timeout)
        return await _once(t, ops.VolumeList(), transport is None)

    @classmethod
    async def get_volume(
        cls,
        name: str,
        *,
        home: str | Path | None = None,
        transport: Transport | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ) -> VolumeInfo:
        """One of your volumes (VolumeNotFound if you have none of that name)."""
        t = _transport(transport, home, api_url, api_key, request_timeout)
        return await _once(t, ops.VolumeGet(name), transport is None)

    @classmethod
    async def delete_volume(
        cls,
        name: str,
        *,
        home: str | Path | None = None,
        transport: Transport | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ) -> None:
        """Delete a volume and its files (VolumeInUse while a live or paused sandbox mounts it)."""
        t = _transport(transport, home, api_url, api_key, request_timeout)
        await _once(t, ops.VolumeDelete(name), transport is None)

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        timeout: float | None = None,
        home: str | Path | None = None,
        transport: Transport | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ) -> AsyncSandbox:
        """Attach to a live sandbox created by any process (or, through a server, any machine);
        a paused one is resumed first (same id, as ``resume``).

        timeout: seconds. A paused sandbox resumes with it (None: the timeout it was created with,
        or last given by ``set_timeout``); a running one lives at least that long from now (a
        later deadline is kept, as in E2B)."""
        return await cls._open(
            _transport(transport, home, api_url, api_key, request_timeout),
            transport is None,
            ops.Connect(sandbox_id, timeout=timeout),
        )

    @classmethod
    async def list(
        cls,
        *,
        home: str | Path | None = None,
        include_dead: bool = False,
        query: SandboxQuery | dict[str, Any] | None = None,
        transport: Transport | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ) -> builtins.list[SandboxInfo]:
        """Your sandboxes, running and paused (include_dead: ended ones too). query: only those
        matching a SandboxQuery(metadata={...}, state=[...]) or a dict with those keys (E2B's)."""
        q = _sandbox_query(query)
        t = _transport(transport, home, api_url, api_key, request_timeout)
        return await _once(t, ops.ListSandboxes(include_dead, query=q), transport is None)

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
    def stage_timings(self) -> builtins.list[StageTiming]:
        return list(self._stages)

    @property
    def first_execution(self) -> Execution | None:
        """The Execution of ``create(run_code=...)`` (None without it)."""
        return self._first_execution

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
        if self._paused:
            return State.PAUSED
        return State.RUNNING if self._active else State.READY

    # ---- lifecycle

    async def get_info(self) -> SandboxInfo:
        return await self._ask(ops.Info(self.sandbox_id))

    async def get_timings(self) -> dict[str, float]:
        """Every stage timing the engine recorded for this sandbox, ms (``timings`` holds those of
        this object's start): also ``resume``, the last resume's (an automatic one's too)."""
        stages = await self._ask(ops.Timings(self.sandbox_id))
        return {t.stage: t.duration_ms for t in stages}

    async def is_running(self) -> bool:
        if self._killed:
            return False
        info = await self._ask(ops.Info(self.sandbox_id))
        return info.state in (State.READY, State.RUNNING) and info.expires_at > time.time()

    async def metrics(self) -> SandboxMetrics:
        """This sandbox's cost so far: cpu-s, memory GiB-s, wall/busy/idle seconds (final once
        destroyed). A pooled sandbox's warm-up is accounted to its pool, not here."""
        return await self._ask(ops.Metrics(self.sandbox_id))

    async def get_metrics(
        self, start: datetime | float | None = None, end: datetime | float | None = None
    ) -> builtins.list[MetricSample]:
        """This sandbox's metrics history, oldest first: a reading every 5 s while it runs (CPU use
        since the reading before, memory in use), from ``start`` (a datetime or epoch seconds; None:
        its start) until ``end`` (None: now, with a reading taken now if the latest is older). The
        latest 720 readings (an hour) are kept while it lives."""
        return await self._ask(ops.MetricsHistory(self.sandbox_id, _epoch(start), _epoch(end)))

    async def export(self, path: str | PathLike[str] | None = None, *, format: str = "ndjson") -> Transcript:
        """Everything recorded of this sandbox (also once it ended): its record, stage timings,
        state changes, every command and code run with its outcome and duration (never its
        environment or output), egress events, snapshots and cost. ``path``: also write it there,
        one typed record per line (``format="ndjson"``) or as a JSON array (``"json"``); see
        :mod:`warmbox.transcript`. A snapshot's ``snapshot_id`` in it starts a new sandbox at that
        checkpoint: ``create(from_snapshot=...)`` (a replay from a known state)."""
        return await _export(self._transport, ops.Export(self.sandbox_id), path, format)

    @classmethod
    async def export_transcript(
        cls,
        sandbox_id: str,
        path: str | PathLike[str] | None = None,
        *,
        format: str = "ndjson",
        home: str | Path | None = None,
        transport: Transport | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ) -> Transcript:
        """:meth:`export` of any sandbox of yours by id, in any state (a destroyed one's rows stay)."""
        t = _transport(transport, home, api_url, api_key, request_timeout)
        try:
            return await _export(t, ops.Export(sandbox_id), path, format)
        finally:
            if transport is None:
                await t.close()

    async def ping(self) -> None:
        """One empty round trip to the sandbox's agent: returns when it answered (a liveness check)."""
        await self._run(ops.Ping(self.sandbox_id))

    async def snapshot(self, *, memory: bool = False) -> SnapshotRef:
        """Save this sandbox's files and code-context state; it keeps running.

        memory=True asks for process memory too: SnapshotUnsupported on a tier that cannot.
        """
        return await self._run(ops.Snapshot(self.sandbox_id, memory=memory, env_names=self._env_names))

    async def pause(self, *, memory: bool = False) -> SnapshotRef:
        """Snapshot, then release everything (no process, CPU or memory is left). The sandbox keeps
        its id: ``resume(id)`` or ``connect(id)`` runs it again."""
        ref = await self._run(ops.Pause(self.sandbox_id, memory=memory, env_names=self._env_names))
        self._paused = True
        await self._close_forwards()
        await self._let_go_if_paused()
        return ref

    async def _ask(self, request: ops.Request[R]) -> R:
        """A question about the sandbox that never resumes it (its record, timings, cost)."""
        try:
            return await self._transport.handle(request)
        finally:
            await self._let_go_if_paused()

    async def _let_go_if_paused(self) -> None:
        """A paused sandbox holds nothing: neither does a transport made for it between calls
        (a later call connects again), so a script that ends there leaves no connection open."""
        if self._paused and self._owns_transport:
            await self._transport.close()

    async def set_timeout(self, timeout: float) -> None:
        """Let the sandbox live ``timeout`` more seconds from now; a resume after a pause gives it
        ``timeout`` seconds again."""
        await self._transport.handle(ops.SetTimeout(self.sandbox_id, timeout))

    async def _kill(self) -> bool:
        """Destroy the sandbox and everything it holds. False if it was already gone.

        Also a class method, as in E2B: ``Sandbox.kill(sandbox_id, home=..., api_url=...)``
        destroys a sandbox by id without connecting to it (False: there was none of that id)."""
        self._killed = True
        if self._approvals is not None:
            self._approvals.cancel()
        await self._close_forwards()
        try:
            return await self._transport.handle(ops.Kill(self.sandbox_id))
        finally:
            if self._owns_transport:  # nothing is left to do with it: let go of its connections
                await self.close()

    kill = either(_kill, _kill_by_id)

    async def close(self) -> None:
        """Let go of the sandbox without ending it: its connection closes, it runs on until its
        timeout, and ``connect`` (from any process) reaches it again. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._approvals is not None:
            self._approvals.cancel()
        await self._close_forwards()
        try:
            await self._transport.handle(ops.Detach(self.sandbox_id))
        finally:
            await self._transport.close()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._killed and not self._paused:
            await self.kill()
        await self.close()

    # ---- ports

    async def get_host(self, port: int, *, unix: bool = False, check: bool = False, timeout: float = 10.0) -> str:
        """A host address where ``port`` of the sandbox is reachable: ``"127.0.0.1:<port>"`` (a
        listener on this host's loopback), or with ``unix=True`` the path of a unix socket in a
        directory only this user can enter. Every connection to it is relayed to the sandbox's
        own loopback by its agent: the sandbox gets no network by it. One forward per port, made
        on the first call and kept until this object closes or the sandbox ends.

        check: first wait up to ``timeout`` seconds for something to listen on ``port``
        (PortNotListening otherwise). Without it, a connection made while nothing listens waits
        up to 5 s for a server to start, then is closed.
        """
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise InvalidArgument(f"port must be a TCP port number (1..65535), got {port!r}")
        if self._closed or self._killed:
            raise SandboxNotFound(f"sandbox {self.sandbox_id} was closed or destroyed here", self.sandbox_id)
        if check:
            await self._wait_listening(port, timeout)
        key = (port, bool(unix))
        forward = self._forwards.get(key)
        if forward is None or forward.closed:
            forward = PortForward(self._transport, self.sandbox_id, port, bool(unix))
            await forward.start()
            self._forwards[key] = forward
        return forward.host

    # ---- signed file URLs (E2B's names on the sandbox; the same as files.download_url / upload_url)

    async def download_url(
        self, path: str, *, expires_in: float = 3600.0, user: str = "user", base_url: str | None = None
    ) -> str:
        """A URL whose holder reads the file ``path`` with a plain GET: :meth:`AsyncFiles.download_url`."""
        return await self.files.download_url(path, expires_in=expires_in, user=user, base_url=base_url)

    async def upload_url(
        self, path: str, *, expires_in: float = 3600.0, user: str = "user", base_url: str | None = None
    ) -> str:
        """A URL whose holder writes the file ``path`` (PUT or POST of its bytes): :meth:`AsyncFiles.upload_url`."""
        return await self.files.upload_url(path, expires_in=expires_in, user=user, base_url=base_url)

    async def _wait_listening(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                stream = await self._run(ops.PortConnect(self.sandbox_id, port))
            except PortNotListening:
                if time.monotonic() >= deadline:
                    raise PortNotListening(
                        f"nothing listens on port {port} in sandbox {self.sandbox_id} (waited {timeout:g} s)",
                        self.sandbox_id,
                    ) from None
                await asyncio.sleep(0.1)
                continue
            stream.close()
            return

    async def _close_forwards(self) -> None:
        forwards, self._forwards = list(self._forwards.values()), {}
        for f in forwards:
            await f.close()

    # ---- one request on this sandbox (commands, files, code and network go through here)

    async def _run(self, request: ops.Request[R]) -> R:
        if self._killed:
            raise SandboxNotFound(f"sandbox {self.sandbox_id} was destroyed", self.sandbox_id)
        self._active += 1
        try:
            started = time.perf_counter()
            result = await self._transport.handle(request)
        finally:
            self._active -= 1
        self._paused = False  # it answered: it runs (again)
        if isinstance(request, (ops.Exec, ops.RunCode)) and not any(t.stage == "first_command" for t in self._stages):
            ms = (time.perf_counter() - started) * 1e3
            self._stages.append(StageTiming(self.sandbox_id, "first_command", ms, True))
            await self._transport.handle(ops.RecordFirstCommand(self.sandbox_id, ms))
        return result

    # ---- code contexts

    async def create_code_context(
        self, language: str = "python", *, cwd: str = WORKDIR, envs: dict[str, str] | None = None
    ) -> CodeContext:
        """A new interpreter whose state persists between runs: "python" (charts and rich results),
        "javascript" (Node.js; top-level await; the last expression's value as text; ``js`` too)
        or "bash" (cd, variables and functions persist; a non-zero exit status is the run's error
        ``ExitCode``). Another language: UnsupportedLanguage naming the available ones."""
        context = await self._run(ops.CreateContext(self.sandbox_id, language, cwd, envs))
        return CodeContext(id=context, language=language, cwd=ops.sandbox_path(cwd))

    async def remove_code_context(self, context: CodeContext | str) -> None:
        await self._run(ops.RemoveContext(self.sandbox_id, context_id(context)))

    async def list_code_contexts(self) -> builtins.list[CodeContext]:
        """The sandbox's code contexts: those created, and the default ones that have run."""
        return await self._run(ops.ListContexts(self.sandbox_id))

    async def restart_code_context(self, context: CodeContext | str | None = None) -> None:
        """A fresh interpreter for ``context`` (the default Python one for None): same id,
        language and working directory, no state; what its cells started ends."""
        await self._run(ops.RestartContext(self.sandbox_id, context_id(context)))

    async def run_code(
        self,
        code: str,
        *,
        context: CodeContext | str | None = None,
        timeout: float | None = DEFAULT_COMMAND_TIMEOUT_S,
        on_stdout: Callable[[str], object] | None = None,
        on_stderr: Callable[[str], object] | None = None,
        on_result: Callable[[Result], object] | None = None,
        on_error: Callable[[ExecutionError], object] | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        language: str | None = None,
        idempotency_key: str | None = None,
        envs: dict[str, str] | None = None,
    ) -> Execution:
        """Run code in a stateful context: ``context``, or the default one of ``language``
        ("python" unless given; "javascript", "bash": see ``create_code_context``). ``envs``:
        environment variables for this run only (each is back as it was after it, unless the
        cell itself changed it).

        The value of the last expression is the main result (``Execution.text``); charts
        (``plt.show()``, figures left open) and ``display(obj)`` add results. Exceptions come back
        as ``Execution.error``, never raised. timeout: seconds, wall clock; on expiry the cell is
        interrupted (state kept), or the context killed if it ignores that. Callbacks, as E2B's:
        ``on_stdout``/``on_stderr`` get output as it is printed, ``on_result`` each result once
        complete, ``on_error`` the cell's exception at its end.
        idempotency_key: a repeat with the same key (on this sandbox) never runs the cell again: it
        gets the first run's Execution (or waits for it); see ``commands.run``.
        """
        execution = await self._run(
            ops.RunCode(
                self.sandbox_id,
                code,
                context_id(context),
                timeout=timeout,
                max_output=max_output,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                on_result=on_result,
                language=language,
                idempotency_key=idempotency_key,
                envs=envs,
            )
        )
        if on_error is not None and execution.error is not None:
            on_error(execution.error)
        return execution


__all__ = ["AsyncCommands", "AsyncFiles", "AsyncNetwork", "AsyncSandbox", "CodeContext"]
