"""The engine front: one handler per operation of :mod:`warmbox.operations`, typed request -> typed result.

A front is one client's view of the engine: it validates every request (so every transport gets
the same typed errors), keeps that client's connections to the sandboxes it holds (one
:class:`~warmbox.engine.session.GuestSession` each, on the client's event loop), and maps each op
onto the engine, the snapshot module and the session. Nothing else in the SDK, CLI or server
reaches below it, but for the registry stores the server's Service holds by name (server/app.py):
``tenants`` and ``sandboxes`` for its key checks (whose key, whose sandbox: before a front is
chosen), ``usage`` and ``pools`` for the console's cost and pool pages (reads, no sandbox).

A front is the host's (``tenant=None``: every sandbox and snapshot, admin operations) or one
tenant's. A tenant's front is where tenancy is enforced, once for every transport: an id of
another tenant's sandbox or snapshot gets exactly the error of an id that does not exist (its
existence is never confirmed), lists hold only the tenant's own, every start (cold, pooled
claim, fork, resume) is stamped with the tenant and checked against its quotas and tiers in the
registry transaction that makes the sandbox count, and admin-only operations need an admin key.
"""

from __future__ import annotations

import asyncio
import builtins
import collections.abc
import dataclasses
import functools
import math
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from warmbox import api, transcript
from warmbox import operations as ops
from warmbox.backends.base import SharedHost
from warmbox.engine import (
    approvals,
    checkpoint,
    checks,
    commandlog,
    duties,
    egress,
    idempotency,
    meters,
    provision,
    resolve,
    signing,
    snapstore,
    teardown,
    tierprofile,
    volumes,
)
from warmbox.engine import pool as pools
from warmbox.engine import snapshot as snapshots
from warmbox.engine.engine import Engine
from warmbox.engine.provision import Launched
from warmbox.engine.session import GuestSession, ProcessOutput
from warmbox.engine.start import StartRecord
from warmbox.errors import (
    Forbidden,
    GuestConnectionError,
    InvalidArgument,
    NotACluster,
    SandboxPaused,
    SnapshotUnsupported,
    TemplateInUse,
    Unsupported,
    UnsupportedLanguage,
    WarmboxError,
)
from warmbox.lifecycle import Operation
from warmbox.models import (
    LANGUAGE_ALIASES,
    Approval,
    ApprovalRequest,
    Capabilities,
    CodeContext,
    CommandRecord,
    CommandResult,
    EntryInfo,
    Execution,
    Lifecycle,
    MetricSample,
    NetEvent,
    PoolStatus,
    ProcessInfo,
    Requirements,
    SandboxInfo,
    SandboxMetrics,
    SnapshotRef,
    StageTiming,
    State,
    TemplateInfo,
    Tenant,
    TierChoice,
    TierStatus,
    Transcript,
    VolumeInfo,
    WriteEntry,
    validate_envs,
    validate_lifecycle,
    validate_metadata,
    validate_query,
    validate_timeout,
)
from warmbox.operations import sandbox_path
from warmbox.paths import hide_host_paths
from warmbox.storage.registry import METRIC_SAMPLE_EVERY_S, METRIC_SAMPLES_KEPT, Registry, unknown_sandbox

R = TypeVar("R")
MAX_HISTORY = 10000  # command records one Commands call returns at most
MAX_TRACKED = 4096  # background processes (and code contexts) a front remembers for their records
BUSY_AHEAD_S = 3600.0  # while an operation runs, its sandbox's last use is recorded this far ahead

# The operations that count as use of a sandbox: each one resets the sandbox's idle time
# (Lifecycle.idle_pause_after) and, on a paused sandbox created with Lifecycle(auto_resume=True),
# resumes it first (else SandboxPaused). An operation that works inside a sandbox belongs here;
# every other one naming a sandbox is in NOT_USE (tests/engine/test_autopause.py holds the two
# to cover every such operation).
USE: frozenset[type[Any]] = frozenset(
    {
        ops.Connect,
        ops.Ping,
        ops.Exec,
        ops.StartProcess,
        ops.ConnectProcess,
        ops.StartAndConnect,
        ops.SendStdin,
        ops.KillProcess,
        ops.ListProcesses,
        ops.ResizePty,
        ops.RunCode,
        ops.CreateContext,
        ops.RemoveContext,
        ops.ListContexts,
        ops.RestartContext,
        ops.ReadFile,
        ops.ReadFileStream,
        ops.WriteFile,
        ops.WriteFileStream,
        ops.WriteFiles,
        ops.Rename,
        ops.UploadDir,
        ops.DownloadDir,
        ops.ListDir,
        ops.Stat,
        ops.MakeDir,
        ops.Remove,
        ops.WatchDir,
        ops.UpdateNetwork,
        ops.PortConnect,
    }
)
# naming a sandbox without using it: records, costs, logs, and the lifecycle's own operations
NOT_USE: frozenset[type[Any]] = frozenset(
    {
        ops.Detach,
        ops.Info,
        ops.Timings,
        ops.Logs,
        ops.Kill,
        ops.SetTimeout,
        ops.Metrics,
        ops.MetricsHistory,
        ops.RecordFirstCommand,
        ops.Snapshot,
        ops.Pause,
        ops.NetworkPolicy,
        ops.NetworkLog,
        ops.Commands,
        ops.Export,
        ops.SignFileUrl,
    }
)
# operations of USE that may run again after a pause cut them short (with auto_resume): reads that
# change nothing. Anything else (a command, a cell, a write) may have done part of its work, so
# running it twice is the caller's decision: it gets SandboxPaused, and its next call resumes.
REPEATABLE: frozenset[type[Any]] = frozenset(
    {ops.Ping, ops.ListProcesses, ops.ReadFile, ops.ReadFileStream, ops.ListDir, ops.Stat, ops.DownloadDir}
)
# operations a tier may lack, by the Capabilities field that says it has them: refused up front with
# Unsupported naming the tier's capabilities (the isolate tier has no commands, files or ports)
NEEDS: dict[type[Any], str] = {
    **dict.fromkeys(
        (
            ops.Exec,
            ops.StartProcess,
            ops.ConnectProcess,
            ops.StartAndConnect,
            ops.SendStdin,
            ops.KillProcess,
            ops.ListProcesses,
            ops.ResizePty,
        ),
        "commands",
    ),
    **dict.fromkeys(
        (
            ops.ReadFile,
            ops.ReadFileStream,
            ops.WriteFile,
            ops.WriteFileStream,
            ops.WriteFiles,
            ops.Rename,
            ops.UploadDir,
            ops.DownloadDir,
            ops.ListDir,
            ops.Stat,
            ops.MakeDir,
            ops.Remove,
            ops.WatchDir,
            ops.SignFileUrl,
        ),
        "files",
    ),
    ops.PortConnect: "ports",
}
_NEEDS_WHAT = {
    "commands": "commands (commands.run, background processes)",
    "files": "filesystem (files.*)",
    "ports": "ports",
}


def _has(caps: Capabilities) -> dict[str, bool]:
    return {"commands": caps.commands, "files": caps.files, "ports": caps.ports}


REATTACH_S = 15.0  # after a failed memory pause, how long the agent may take to listen again


# the requests naming a sandbox, derived from the one list: a new op cannot be left unscoped
_NAMES_SANDBOX: frozenset[type[Any]] = frozenset(
    cls for cls in ops.REQUESTS.values() if any(f.name == "sandbox_id" for f in dataclasses.fields(cast(Any, cls)))
)


class Subscription:
    """Answers a sandbox's network approval questions until cancelled."""

    def __init__(self, task: asyncio.Task[None]) -> None:
        self._task = task

    def cancel(self) -> None:
        self._task.cancel()


def _bounded_commands(reg: Registry, sandbox_id: str, limit: int, text_budget: int) -> tuple[list[CommandRecord], bool]:
    """A sandbox's oldest command records, at most ``limit`` of them and ``text_budget`` characters
    of text in all (read a page at a time: what a sandbox ran bounds no export's memory); and
    whether some are missing (more than those bounds, or the registry kept only its first and
    latest records)."""
    out: list[CommandRecord] = []
    after, left, gap = 0, text_budget, False
    while True:
        page = reg.commands.commands(sandbox_id, min(1000, limit + 1 - len(out)), after_seq=after)
        for c in page:
            left -= len(c.text)
            if len(out) >= limit or left < 0:
                return out, True
            gap = gap or c.seq != (out[-1].seq if out else 0) + 1  # the registry dropped middle records
            out.append(c)
        if len(page) < 1000 or not page:
            return out, gap
        after = page[-1].seq


class EngineFront:
    """One client's handle on the engine (see the module docstring). Use on one event loop.

    tenant: whose requests these are (None: the host's root, which sees everything).
    """

    def __init__(self, engine: Engine, tenant: Tenant | None = None) -> None:
        if tenant is not None and (not isinstance(tenant, Tenant) or not tenant.name):
            raise InvalidArgument(f"tenant must be a warmbox.models.Tenant with a name, got {tenant!r}")
        self.engine = engine
        self.tenant = tenant
        self._owned: set[str] = set()  # ids checked to be this tenant's (a sandbox's tenant never changes)
        self._sessions: dict[str, GuestSession] = {}
        self._lifecycles: dict[str, Lifecycle] = {}
        self._tiers: dict[str, str] = {}  # a sandbox's tier never changes: read once per front
        self._in_use: dict[str, int] = {}
        self._first_done: set[str] = set()
        self._log = engine.command_log
        # background processes started here, until a client follows one to its end: (text, started_at)
        self._started: dict[tuple[str, int], tuple[tuple[str, bool], float]] = {}
        self._contexts: dict[tuple[str, str], str] = {}  # code contexts made here: their language
        self._default_language: dict[str, str] = {}  # a tier's "default" context's language
        self._signing: signing.Signer | None = None  # made at the first files.sign_url
        self._handlers: dict[type[Any], Callable[[Any], Awaitable[Any]]] = {
            ops.Create: self.create,
            ops.Connect: self.connect,
            ops.Resume: self.resume,
            ops.Detach: self.detach,
            ops.ListSandboxes: self.list,
            ops.Info: self.info,
            ops.Timings: self.timings,
            ops.Logs: self.logs,
            ops.Doctor: self.doctor,
            ops.ChooseTier: self.choose_tier,
            ops.Kill: self.kill,
            ops.SetTimeout: self.set_timeout,
            ops.Metrics: self.metrics,
            ops.MetricsHistory: self.metrics_history,
            ops.Ping: self.ping,
            ops.RecordFirstCommand: self.record_first_command,
            ops.Exec: self.exec,
            ops.StartProcess: self.start_process,
            ops.ConnectProcess: self.connect_process,
            ops.StartAndConnect: self.start_and_connect,
            ops.SendStdin: self.send_stdin,
            ops.KillProcess: self.kill_process,
            ops.ListProcesses: self.list_processes,
            ops.ResizePty: self.resize_pty,
            ops.RunCode: self.run_code,
            ops.CreateContext: self.create_context,
            ops.RemoveContext: self.remove_context,
            ops.ListContexts: self.list_contexts,
            ops.RestartContext: self.restart_context,
            ops.ReadFile: self.read_file,
            ops.ReadFileStream: self.read_file_stream,
            ops.WriteFile: self.write_file,
            ops.WriteFileStream: self.write_file_stream,
            ops.WriteFiles: self.write_files,
            ops.Rename: self.rename,
            ops.UploadDir: self.upload_dir,
            ops.DownloadDir: self.download_dir,
            ops.WatchDir: self.watch_dir,
            ops.ListDir: self.list_dir,
            ops.Stat: self.stat,
            ops.MakeDir: self.make_dir,
            ops.Remove: self.remove,
            ops.SignFileUrl: self.sign_file_url,
            ops.Snapshot: self.snapshot,
            ops.Pause: self.pause,
            ops.ListSnapshots: self.list_snapshots,
            ops.DeleteSnapshot: self.delete_snapshot,
            ops.GcSnapshots: self.gc_snapshots,
            ops.UpdateNetwork: self.update_network,
            ops.NetworkPolicy: self.network_policy,
            ops.NetworkLog: self.network_log,
            ops.PoolsList: self.pools_list,
            ops.PoolsResize: self.pools_resize,
            ops.PortConnect: self.port_connect,
            ops.VolumeCreate: self.volume_create,
            ops.VolumeList: self.volume_list,
            ops.VolumeGet: self.volume_get,
            ops.VolumeDelete: self.volume_delete,
            ops.TemplateBuild: self.template_build,
            ops.TemplateList: self.template_list,
            ops.TemplateGet: self.template_get,
            ops.TemplateDelete: self.template_delete,
            ops.TemplateGc: self.template_gc,
            ops.Commands: self.commands,
            ops.Export: self.export,
            ops.ApprovalsList: self.approvals_list,
            ops.ApprovalAnswer: self.approval_answer,
            ops.NodeDrain: self.node_drain,
            ops.CreateAndRun: self.create_and_run,
        }

    async def handle(self, request: ops.Request[R]) -> R:
        """Run one operation. Its typed errors name no host directory (Engine.redact_error): a
        runtime's or the kernel's message may, and every caller, in process or remote, reads them."""
        try:
            return await self._handle(request)
        except WarmboxError as e:
            self.engine.redact_error(e)
            raise

    async def _handle(self, request: ops.Request[R]) -> R:
        handler = self._handlers.get(type(request))
        if handler is None:
            raise InvalidArgument(f"not an operation: {type(request).__name__}")
        ops.check_text(request)  # before anything is looked up, claimed or made
        if self.tenant is not None:
            self._scope(request, self.tenant)
        need = NEEDS.get(type(request))
        if need is not None:
            self._check_capability(cast(Any, request).sandbox_id, need)
        if type(request) in USE and isinstance(cast(Any, request).sandbox_id, str):
            return cast(R, await self._use(request, handler))
        try:
            return cast(R, await handler(request))
        except GuestConnectionError:
            if type(request) in _NAMES_SANDBOX:
                await self._lost(cast(Any, request).sandbox_id)
            raise

    def _tier(self, sandbox_id: str) -> str:
        """A sandbox's tier (it never changes: read once per front)."""
        tier = self._tiers.get(sandbox_id)
        if tier is None:
            tier = self._tiers[sandbox_id] = self.engine.info(sandbox_id)[0].tier
        return tier

    def _check_capability(self, sandbox_id: object, need: str) -> None:
        """Unsupported, naming what the sandbox's tier can do, if its Capabilities lack ``need``."""
        if not isinstance(sandbox_id, str):
            return  # the handler refuses a malformed id
        tier = self._tier(sandbox_id)
        caps = self.engine.backend(tier).capabilities()
        present = _has(caps)
        if present[need]:
            return
        has = [f"languages {', '.join(caps.context_languages)}", f"network {', '.join(caps.network_modes)}"]
        has += [name for name, yes in present.items() if yes]
        reason = f"the {tier} tier has no {_NEEDS_WHAT[need]}; it has: {'; '.join(has)} ({caps.isolation})"
        raise Unsupported(f"sandbox {sandbox_id}: {reason}", tier=tier, reason=reason)

    async def _use(self, request: ops.Request[Any], handler: Callable[[Any], Awaitable[Any]]) -> Any:
        """An operation of ``USE``: a paused sandbox is resumed first if it was created to
        (``Lifecycle.auto_resume``; else SandboxPaused), and its idle time counts from its end."""
        sid: str = cast(Any, request).sandbox_id
        lifecycle = self._lifecycle(sid)
        connect = isinstance(request, ops.Connect)  # resumes a paused sandbox itself, whatever its lifecycle
        if not connect and not self._live(sid) and lifecycle.pauses:
            await snapstore.wait_pause(self.engine, sid)  # the daemon's idle pause under way: its end
        if not connect and not self._live(sid) and self.engine.info(sid)[0].state is State.PAUSED:
            if not lifecycle.auto_resume:
                raise self.engine.paused_error(sid)
            await self.resume(ops.Resume(sid))
        idle_counted = lifecycle.idle_pause_after is not None
        if idle_counted:
            self._busy(sid, +1)
        try:
            for attempt in (1, 2):
                try:
                    try:
                        return await handler(request)
                    except GuestConnectionError:
                        await self._lost(sid)  # a typed error if it ended or was paused meanwhile
                        raise
                except SandboxPaused as e:  # paused under it (its timeout, or idle in another client's view)
                    if attempt == 2 or connect or not lifecycle.auto_resume:
                        raise
                    if type(request) not in REPEATABLE:
                        raise SandboxPaused(
                            f"sandbox {sid} was paused while this {type(request).__name__} ran; it may have done "
                            "part of its work, so it was not run again: the next call resumes the sandbox",
                            sid,
                        ) from e
                    await self.resume(ops.Resume(sid))
            raise AssertionError("unreachable")
        finally:
            if idle_counted:
                self._busy(sid, -1)

    def _lifecycle(self, sandbox_id: str) -> Lifecycle:
        """A sandbox's lifecycle (fixed at its create: read once per front)."""
        got = self._lifecycles.get(sandbox_id)
        if got is None:
            got = self._lifecycles[sandbox_id] = self.engine.info(sandbox_id)[0].lifecycle
        return got

    def _live(self, sandbox_id: str) -> bool:
        s = self._sessions.get(sandbox_id)
        return s is not None and not s.closed

    def _busy(self, sandbox_id: str, delta: int) -> None:
        """Count this front's operations on a sandbox; while any runs it is not idle (its last use
        is recorded an hour ahead), and its idle time starts when the last one ends."""
        n = self._in_use.get(sandbox_id, 0) + delta
        if n > 0:
            self._in_use[sandbox_id] = n
        else:
            self._in_use.pop(sandbox_id, None)
        if (delta > 0 and n == 1) or n <= 0:
            try:
                self.engine.registry.sandboxes.touch(sandbox_id, time.time() + (BUSY_AHEAD_S if n > 0 else 0.0))
            except WarmboxError:
                pass  # a busy registry must not fail the user's operation

    async def _lost(self, sandbox_id: str) -> None:
        """The connection to a sandbox broke: if that is because the sandbox ended or was paused
        (its timeout ran out, it was killed or paused meanwhile), raise that typed error instead."""
        await snapstore.wait_pause(self.engine, sandbox_id)  # a pause under way: its outcome
        try:
            info, _ = self.engine.info(sandbox_id)
        except WarmboxError:
            return
        if info.state in (State.READY, State.RUNNING) and info.expires_at <= time.time():
            await self._drop(sandbox_id)
            await duties.expire(self.engine, info)
        if info.state in (State.READY, State.RUNNING) and isinstance(self.engine.backend(info.tier), SharedHost):
            await teardown.lost_hosts(self.engine)  # its host process ended: lost, at once (here or by the reaper)
            info, _ = self.engine.info(sandbox_id)
        if info.state is State.PAUSED:
            await self._drop(sandbox_id)
            raise self.engine.paused_error(sandbox_id) from None
        if info.state not in (State.READY, State.RUNNING):
            await self._drop(sandbox_id)
            self.engine.check(Operation.EXEC, info)

    # ---- tenancy

    def _scope(self, request: ops.Request[Any], tenant: Tenant) -> None:
        """Refuse, before any work, what names something not the tenant's or needs an admin key."""
        if type(request) in _NAMES_SANDBOX:
            self._own(cast(Any, request).sandbox_id)
        if isinstance(request, ops.Resume):
            self._own_snapshot(request.snapshot)
        elif isinstance(request, ops.Create) and request.from_snapshot is not None:
            self._own_snapshot(request.from_snapshot)
        elif isinstance(request, ops.DeleteSnapshot):
            self._own_snapshot(request.snapshot_id)
        elif isinstance(request, ops.GcSnapshots) and not tenant.admin:
            raise Forbidden(f"snapshot gc is for admin keys; tenant {tenant.name!r}'s key is not one")
        elif isinstance(request, ops.TemplateGc) and not tenant.admin:
            raise Forbidden(f"template gc is for admin keys; tenant {tenant.name!r}'s key is not one")
        elif isinstance(request, ops.PoolsResize) and not tenant.admin:
            raise Forbidden(f"resizing a pool is for admin keys; tenant {tenant.name!r}'s key is not one")
        elif isinstance(request, ops.NodeDrain) and not tenant.admin:
            raise Forbidden(f"draining a node is for admin keys; tenant {tenant.name!r}'s key is not one")

    def _own(self, sandbox_id: object) -> None:
        """Pass if the sandbox is this front's tenant's; otherwise the error of an unknown id."""
        if self.tenant is None or (isinstance(sandbox_id, str) and sandbox_id in self._owned):
            return
        if (
            isinstance(sandbox_id, str)
            and self.engine.registry.sandboxes.sandbox_tenant(sandbox_id) == self.tenant.name
        ):
            self._owned.add(sandbox_id)
            return
        self.engine.info(sandbox_id)  # type: ignore[arg-type]  # a malformed or unknown id: its own error
        raise unknown_sandbox(cast(str, sandbox_id))  # another tenant's: the same error as an unknown one

    def _own_snapshot(self, ref: object) -> None:
        """A snapshot id or a paused sandbox's id that is not the tenant's: the error of an unknown one.
        A malformed ref passes: the handler refuses it (InvalidArgument) before touching anything."""
        if self.tenant is None:
            return
        if isinstance(ref, str) and ref.startswith("sb-"):
            self._own(ref)
        elif (
            checks.is_snapshot_id(ref)
            and self.engine.registry.snapshots.snapshot_tenant(cast(str, ref)) != self.tenant.name
        ):
            raise checks.unknown_snapshot(cast(str, ref))

    async def close(self) -> None:
        """Let go of every sandbox this front holds (none is ended); their records are written."""
        self._log.flush()
        self.engine.keys.flush()
        sessions, self._sessions = self._sessions, {}
        for s in sessions.values():
            await s.close()

    def _tenant_name(self) -> str | None:
        return None if self.tenant is None else self.tenant.name

    # ---- sessions

    async def _hold(self, got: Launched) -> ops.Opened:
        self._tiers[got.sandbox_id] = got.info.tier
        old = self._sessions.pop(got.sandbox_id, None)
        self._sessions[got.sandbox_id] = got.session
        if old is not None and old is not got.session:
            await old.close()
        if any(t.stage == "first_command" for t in got.timings):
            self._first_done.add(got.sandbox_id)
        return ops.Opened(got.info, tuple(got.timings))

    async def _session(self, sandbox_id: str) -> GuestSession:
        s = self._sessions.get(sandbox_id)
        if s is not None and not s.closed:
            return s
        got = await duties.open(self.engine, sandbox_id)
        await self._hold(got)
        return got.session

    def _held(self, sandbox_id: str) -> GuestSession | None:
        return self._sessions.get(sandbox_id)

    async def _drop(self, sandbox_id: str) -> None:
        s = self._sessions.pop(sandbox_id, None)
        if s is not None:
            await s.close()

    def _write_timing(self, sandbox_id: str, stage: str, ms: float) -> None:
        try:
            self.engine.registry.sandboxes.add_timing(sandbox_id, stage, ms)
        except WarmboxError:
            pass  # a busy registry must not fail the user's command

    # ---- sandboxes

    async def create(self, r: ops.Create) -> ops.Opened:
        if r.idempotency_key is None:
            return await self._create_opened(r)
        key = idempotency.check_key(r.idempotency_key)
        validate_metadata(r.metadata)  # refused before the key is claimed
        validate_lifecycle(r.lifecycle)
        return await self.engine.keys.run(
            tenant=self._tenant_name() or "",
            scope="",
            key=key,
            op="create",
            fingerprint=idempotency.fingerprint(r),
            timeout_s=0.0,
            result_type=ops.Opened,
            call=lambda _: self._create_opened(r),
        )

    async def create_and_run(self, r: ops.CreateAndRun) -> ops.Started:
        """The create, then the run, each as its own operation (every check of each)."""
        return await ops.create_and_run(self._handle, r)

    async def _create_opened(self, r: ops.Create) -> ops.Opened:
        rec = await StartRecord.build(self.engine, r, self.tenant)  # before any work
        await self._approve_create(r, rec)
        return await self._hold(await self._create(r, rec))

    async def _approve_create(self, r: ops.Create, rec: StartRecord) -> None:
        """Wait for approval if this create needs it (engine.approvals): before anything is
        claimed or made, so a denied one leaves nothing behind."""
        if not approvals.needed(self.engine, self.tenant):
            return
        if r.from_snapshot is not None:
            if not isinstance(r.from_snapshot, str):
                return  # _create refuses it
            _, _, tier, limits = snapshots.start_of(self.engine, r.from_snapshot)
            await approvals.gate_start(self.engine, self.tenant, "create", tier, limits, sandbox_id=r.from_snapshot)
            return
        if self.tenant is not None:  # refusals that need nobody's approval come first (the record's too)
            self.engine.registry.tenants.check_quota(self.tenant, rec.tier, rec.limits)
        await approvals.gate_start(self.engine, self.tenant, "create", rec.tier, rec.limits)

    async def _create(self, r: ops.Create, rec: StartRecord) -> Launched:
        if r.from_snapshot is not None:
            if r.network != "none":
                raise InvalidArgument(
                    "a sandbox forked from a snapshot has its snapshot's network policy; "
                    "change it with network.update()"
                )
            if r.tier is not None or r.limits is not None or r.template is not None or r.volumes:
                raise InvalidArgument(
                    "from_snapshot takes its tier, template, limits and volumes from the snapshot's sandbox"
                )
            m = snapshots.resolve(self.engine, r.from_snapshot)
            return await snapshots.fork(
                self.engine,
                m,
                timeout=r.timeout,
                envs=r.envs,
                pool=r.pool,
                tenant=self.tenant,
                secrets=r.secrets,
                record=rec,
            )
        return await provision.start(self.engine, rec)

    async def connect(self, r: ops.Connect) -> ops.Opened:
        timeout = None if r.timeout is None else validate_timeout(r.timeout)
        info, _ = self.engine.info(r.sandbox_id)
        if info.state is State.PAUSED:  # connecting to a paused sandbox resumes it (its id, its timeout)
            return await self.resume(ops.Resume(r.sandbox_id, timeout=timeout))
        held = self._sessions.get(r.sandbox_id)
        try:
            if held is not None and not held.closed:  # another client of this front holds it: share, never replace
                if info.expires_at > time.time():
                    self.engine.check(Operation.EXEC, info)
                    self._extend(r.sandbox_id, info.expires_at, timeout)
                    info = self.engine.info(r.sandbox_id)[0]
                    return ops.Opened(info, tuple(self.engine.registry.sandboxes.timings(r.sandbox_id)))
            opened = await self._hold(await duties.open(self.engine, r.sandbox_id))
        except SandboxPaused:  # its timeout ran out and it was paused (Lifecycle(on_timeout="pause")) just now
            return await self.resume(ops.Resume(r.sandbox_id, timeout=timeout))
        if self._extend(r.sandbox_id, opened.info.expires_at, timeout):
            opened = dataclasses.replace(opened, info=self.engine.info(r.sandbox_id)[0])
        return opened

    def _extend(self, sandbox_id: str, expires_at: float, timeout: float | None) -> bool:
        """A connect given ``timeout`` to a running sandbox: it lives at least that long from now."""
        if timeout is None or time.time() + timeout <= expires_at:
            return False
        self.engine.set_timeout(sandbox_id, timeout)
        return True

    async def resume(self, r: ops.Resume) -> ops.Opened:
        if isinstance(r.snapshot, str) and approvals.needed(self.engine, self.tenant):
            kind, ref, tier, limits = snapshots.start_of(self.engine, r.snapshot)
            await approvals.gate_start(self.engine, self.tenant, kind, tier, limits, sandbox_id=ref)
        got = await snapshots.resume(
            self.engine, r.snapshot, timeout=r.timeout, envs=r.envs, tenant=self.tenant, secrets=r.secrets
        )
        return await self._hold(got)

    async def detach(self, r: ops.Detach) -> None:
        await self._drop(r.sandbox_id)
        self._log.flush()

    async def list(self, r: ops.ListSandboxes) -> builtins.list[SandboxInfo]:
        if r.reap:
            await duties.reap(self.engine)
        query = validate_query(r.query)
        return self.engine.list(r.include_dead, tenant=self._tenant_name(), query=query)

    async def info(self, r: ops.Info) -> SandboxInfo:
        return self.engine.info(r.sandbox_id)[0]

    async def timings(self, r: ops.Timings) -> builtins.list[StageTiming]:
        self.engine.info(r.sandbox_id)
        return self.engine.registry.sandboxes.timings(r.sandbox_id)

    async def logs(self, r: ops.Logs) -> str:
        return self.engine.logs(r.sandbox_id)

    async def doctor(self, r: ops.Doctor) -> builtins.list[TierStatus]:
        got = await asyncio.to_thread(self.engine.doctor)  # a first probe may boot a probe guest
        if self.tenant is None:
            return got  # the host's own operator: where runc or /dev/kvm are is what it asks
        return [dataclasses.replace(t, reason=self._about_host(t.reason)) for t in got]

    def _about_host(self, text: str) -> str:
        """Text about this host as a tenant reads it: no host path (see paths.hide_host_paths)."""
        return hide_host_paths(self.engine.redact(text))

    async def choose_tier(self, r: ops.ChooseTier) -> TierChoice:
        if not isinstance(r.requirements, Requirements):
            raise InvalidArgument(f"requirements must be a warmbox.Requirements, got {type(r.requirements).__name__}")
        # a first probe may boot a probe guest (doctor's reason for a thread)
        got = await asyncio.to_thread(tierprofile.choose, self.engine, r.requirements, self.tenant)
        if self.tenant is None:
            return got
        return dataclasses.replace(
            got,
            reasons=tuple(self._about_host(x) for x in got.reasons),
            rejected={k: self._about_host(v) for k, v in got.rejected.items()},
        )

    async def kill(self, r: ops.Kill) -> bool:
        await self._drop(r.sandbox_id)
        return await teardown.destroy(self.engine, r.sandbox_id, "killed")

    async def set_timeout(self, r: ops.SetTimeout) -> float:
        return self.engine.set_timeout(r.sandbox_id, r.timeout)

    async def metrics(self, r: ops.Metrics) -> SandboxMetrics:
        if not isinstance(r.fresh, bool):
            raise InvalidArgument(f"fresh must be True or False, got {r.fresh!r}")
        self._log.flush()  # its count is of the recorded commands: this front's queued ones too
        if not r.fresh:
            return meters.metered(self.engine, r.sandbox_id)
        return await meters.metrics(self.engine, r.sandbox_id, self._held(r.sandbox_id))

    async def metrics_history(self, r: ops.MetricsHistory) -> builtins.list[MetricSample]:
        start, end = checks.epoch(r.start, "start"), checks.epoch(r.end, "end")
        if isinstance(r.limit, bool) or not isinstance(r.limit, int) or not 1 <= r.limit <= METRIC_SAMPLES_KEPT:
            raise InvalidArgument(f"limit must be an integer from 1 to {METRIC_SAMPLES_KEPT}, got {r.limit!r}")
        info, _ = self.engine.info(r.sandbox_id)
        now = time.time()
        if info.state in (State.READY, State.RUNNING) and (end is None or end >= now):
            latest = self.engine.registry.usage.metric_samples(r.sandbox_id, 0.0, now, 1)
            if not latest or now - latest[0][0] >= METRIC_SAMPLE_EVERY_S:
                await meters.metrics(self.engine, r.sandbox_id, self._held(r.sandbox_id))  # a reading, into the history
        since = info.claimed_at or info.created_at  # a pool's warm-up is not the user's
        rows = self.engine.registry.usage.metric_samples(
            r.sandbox_id, max(start or 0.0, since), time.time() if end is None else end, r.limit
        )
        cpus = max(1, math.ceil(info.cpus))
        return [MetricSample(at, pct, cpus, mem, info.memory_mb << 20) for at, pct, mem in rows]

    async def record_first_command(self, r: ops.RecordFirstCommand) -> None:
        ms = r.duration_ms
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 <= ms < 86400e3:
            raise InvalidArgument(f"duration_ms must be a number of milliseconds, got {ms!r}")
        if r.sandbox_id in self._first_done:
            return
        self._first_done.add(r.sandbox_id)
        # written right after the caller has its result, not on its path
        asyncio.get_running_loop().call_soon(self._write_timing, r.sandbox_id, "first_command", float(ms))

    async def ping(self, r: ops.Ping) -> None:
        await (await self._session(r.sandbox_id)).ping()

    # ---- records

    async def commands(self, r: ops.Commands) -> builtins.list[CommandRecord]:
        limit, after = r.limit, r.after_seq
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_HISTORY:
            raise InvalidArgument(f"limit must be an integer from 1 to {MAX_HISTORY}, got {limit!r}")
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise InvalidArgument(f"after_seq must be an integer >= 0, got {after!r}")
        if not isinstance(r.newest_first, bool):
            raise InvalidArgument(f"newest_first must be a boolean, got {r.newest_first!r}")
        self.engine.info(r.sandbox_id)  # an unknown id is SandboxNotFound, not an empty list
        self._log.flush()
        return self.engine.registry.commands.commands(r.sandbox_id, limit, after_seq=after, newest_first=r.newest_first)

    async def export(self, r: ops.Export) -> Transcript:
        info, _ = self.engine.info(r.sandbox_id)
        self._log.flush()
        if info.state in (State.READY, State.RUNNING):  # read its meters now; else the last ones recorded
            metrics = await meters.metrics(self.engine, r.sandbox_id, self._held(r.sandbox_id))
        else:
            metrics = meters.recorded(self.engine, info)
        reg, n = self.engine.registry, transcript.MAX_RECORDS
        commands, cut = _bounded_commands(reg, r.sandbox_id, n, transcript.MAX_COMMAND_TEXT)
        events = reg.egress.net_events(r.sandbox_id, n + 1)
        transitions = reg.sandboxes.transitions(r.sandbox_id)
        return Transcript(
            sandbox=self.engine.info(r.sandbox_id)[0],
            timings=tuple(reg.sandboxes.timings(r.sandbox_id)),
            transitions=tuple(transitions[:n]),
            commands=tuple(commands),
            net_events=tuple(events[:n]),
            snapshots=tuple(reg.snapshots.snapshot_records(r.sandbox_id)),
            metrics=metrics,
            exported_at=time.time(),
            truncated=cut or max(len(events), len(transitions)) > n,
        )

    # ---- commands and code

    async def exec(self, r: ops.Exec) -> CommandResult:
        argv = checks.argv(r.cmd)
        env = dict(validate_envs(r.envs))
        cwd = sandbox_path(r.cwd) if r.cwd is not None else ""
        t = checks.optional_timeout(r.timeout)
        cap = checks.positive_int(r.max_output, "max_output")
        if r.stdin is not None and not isinstance(r.stdin, (str, bytes)):
            raise InvalidArgument("stdin must be str or bytes")
        data = r.stdin.encode() if isinstance(r.stdin, str) else r.stdin
        session = await self._session(r.sandbox_id)
        text = commandlog.command_text(r.cmd if isinstance(r.cmd, str) else argv)

        async def run(_: object = None) -> CommandResult:
            started = time.time()
            try:
                got = await session.exec(
                    argv,
                    env=env,
                    cwd=cwd,
                    timeout_s=t,
                    max_output=cap,
                    stdin=data,
                    on_stdout=r.on_stdout,
                    on_stderr=r.on_stderr,
                )
            except BaseException as e:
                self._log.add(commandlog.failed(r.sandbox_id, "command", text, "", started, e))
                raise
            self._log.add(commandlog.of_command(r.sandbox_id, "command", text, started, got))
            return got

        if r.idempotency_key is None:
            return await run()
        return await self._keyed(r, "command", t, CommandResult, run)

    async def _keyed(
        self,
        r: ops.Exec | ops.RunCode,
        op: str,
        timeout_s: float,
        result_type: Any,
        call: Callable[[Any], Awaitable[R]],
    ) -> R:
        """A command or code run under its idempotency key (engine/idempotency.py), scoped to its sandbox."""
        return await self.engine.keys.run(
            tenant=self._tenant_name() or "",
            scope=r.sandbox_id,
            key=idempotency.check_key(r.idempotency_key),
            op=op,
            fingerprint=idempotency.fingerprint(r),
            timeout_s=timeout_s,
            result_type=result_type,
            call=call,
        )

    async def start_process(self, r: ops.StartProcess) -> int:
        argv, env, cwd, cols, rows = self._process_start(r)
        session = await self._session(r.sandbox_id)
        started = time.time()
        pid = await session.spawn(argv, env=env, cwd=cwd, tag=r.tag, user=r.user, cols=cols, rows=rows)
        self._track_started(r, argv, pid, started)
        return pid

    async def start_and_connect(self, r: ops.StartAndConnect) -> ops.ProcessStream:
        argv, env, cwd, cols, rows = self._process_start(r)
        if not isinstance(r.stdin, bool):
            raise InvalidArgument(f"stdin must be a boolean, got {r.stdin!r}")
        session = await self._session(r.sandbox_id)
        started = time.time()
        stream = await session.spawn_follow(
            argv, env=env, cwd=cwd, tag=r.tag, user=r.user, cols=cols, rows=rows, stdin=r.stdin
        )
        self._track_started(r, argv, stream.pid, started)
        stream.on_end = functools.partial(self._process_ended, r.sandbox_id)
        return stream

    def _track_started(
        self, r: ops.StartProcess | ops.StartAndConnect, argv: builtins.list[str], pid: int, started: float
    ) -> None:
        """Remember a started process until a client following it sees its end (its record then)."""
        if len(self._started) >= MAX_TRACKED:  # never followed to their end: forget the oldest
            del self._started[next(iter(self._started))]
        text = commandlog.command_text(r.cmd if isinstance(r.cmd, str) else argv)
        self._started[(r.sandbox_id, pid)] = (text, started)

    def _process_start(
        self, r: ops.StartProcess | ops.StartAndConnect
    ) -> tuple[builtins.list[str], dict[str, str], str, int, int]:
        """A process start's checked argv, environment, directory and terminal size."""
        argv = checks.argv(r.cmd)
        env = dict(validate_envs(r.envs))
        cwd = sandbox_path(r.cwd) if r.cwd is not None else ""
        if not isinstance(r.tag, str) or len(r.tag) > 256 or "\0" in r.tag:
            raise InvalidArgument(f"tag must be a string of at most 256 characters, got {r.tag!r}")
        if r.user not in ("user", "root"):
            raise InvalidArgument(f"user must be 'user' or 'root', got {r.user!r}")
        if r.user == "root":
            info, _ = self.engine.info(r.sandbox_id)
            caps = self.engine.backend(info.tier).capabilities()
            if not caps.root_user:
                raise Unsupported(
                    f"user='root' is not available on the {info.tier} tier: {caps.root_user_reason}",
                    tier=info.tier,
                    reason=caps.root_user_reason,
                )
        cols, rows = checks.size(r.pty_cols, "pty_cols", zero=True), checks.size(r.pty_rows, "pty_rows", zero=True)
        if (cols == 0) != (rows == 0):
            raise InvalidArgument("a terminal needs both pty_cols and pty_rows (or neither)")
        return argv, env, cwd, cols, rows

    async def connect_process(self, r: ops.ConnectProcess) -> ops.ProcessStream:
        pid = checks.pid(r.pid)
        if not isinstance(r.output, bool) or not isinstance(r.pty, bool):
            raise InvalidArgument("output and pty must be booleans")
        stream = await (await self._session(r.sandbox_id)).attach(pid, output=r.output, pty=r.pty)
        if (r.sandbox_id, pid) in self._started:
            stream.on_end = functools.partial(self._process_ended, r.sandbox_id)
        return stream

    def _process_ended(self, sandbox_id: str, result: CommandResult, stream: ProcessOutput) -> None:
        """A background process this front started ended, seen by a client following it: its record
        (once, whoever else follows it too)."""
        got = self._started.pop((sandbox_id, result.pid), None)
        if got is None:
            return
        text, started = got
        record = commandlog.of_command(sandbox_id, "process", text, started, result)
        self._log.add(dataclasses.replace(record, stdout_bytes=stream.stdout_bytes, stderr_bytes=stream.stderr_bytes))

    async def send_stdin(self, r: ops.SendStdin) -> None:
        pid = checks.pid(r.pid)
        data = checks.file_bytes(r.data, "data")
        if not isinstance(r.eof, bool):
            raise InvalidArgument(f"eof must be a boolean, got {r.eof!r}")
        await (await self._session(r.sandbox_id)).send_input(pid, data, eof=r.eof)

    async def kill_process(self, r: ops.KillProcess) -> bool:
        pid = checks.pid(r.pid)
        if isinstance(r.signal, bool) or not isinstance(r.signal, int) or not 1 <= r.signal <= 64:
            raise InvalidArgument(f"signal must be a signal number from 1 to 64, got {r.signal!r}")
        return await (await self._session(r.sandbox_id)).signal(pid, r.signal)

    async def list_processes(self, r: ops.ListProcesses) -> builtins.list[ProcessInfo]:
        return await (await self._session(r.sandbox_id)).processes()

    async def resize_pty(self, r: ops.ResizePty) -> None:
        pid = checks.pid(r.pid)
        cols, rows = checks.size(r.cols, "cols"), checks.size(r.rows, "rows")
        await (await self._session(r.sandbox_id)).resize(pid, cols, rows)

    async def run_code(self, r: ops.RunCode) -> Execution:
        if not isinstance(r.code, str):
            raise InvalidArgument(f"code must be a string, got {type(r.code).__name__}")
        if not isinstance(r.context, str) or not r.context:
            raise InvalidArgument(f"context must be a context id, got {r.context!r}")
        context = r.context
        if r.language is not None:
            if context != "default":
                raise InvalidArgument("run_code takes a context or a language, not both")
            language = self._language(r.sandbox_id, r.language)
            context = "default" if language == "python" else f"default-{language}"
        t = checks.optional_timeout(r.timeout)
        cap = checks.positive_int(r.max_output, "max_output")
        env = dict(validate_envs(r.envs)) or None
        session = await self._session(r.sandbox_id)
        text = commandlog.bounded_text(r.code)

        async def run(_: object = None) -> Execution:
            started = time.time()
            try:
                got = await session.run_code(
                    r.code,
                    context=context,
                    timeout_s=t,
                    max_output=cap,
                    on_stdout=r.on_stdout,
                    on_stderr=r.on_stderr,
                    on_result=r.on_result,
                    env=env,
                )
            except BaseException as e:
                language = self._context_language(r.sandbox_id, context)
                self._log.add(commandlog.failed(r.sandbox_id, "code", text, language, started, e))
                if isinstance(e, UnsupportedLanguage):
                    raise self._unsupported(r.sandbox_id, r.language or "", str(e)) from None
                raise
            language = self._context_language(r.sandbox_id, context)
            self._log.add(commandlog.of_execution(r.sandbox_id, text, language, started, got))
            return got

        if r.idempotency_key is None:
            return await run()
        return await self._keyed(r, "code run", t, Execution, run)

    def _context_language(self, sandbox_id: str, context: str) -> str:
        """The language of a code context, for its records ("" for another client's context)."""
        got = self._contexts.get((sandbox_id, context))
        if got is not None:
            return got
        if context.startswith("default-"):
            return context[len("default-") :]
        if context == "default":  # python where the tier has it, else the tier's first language
            tier = self._tier(sandbox_id)
            got = self._default_language.get(tier)
            if got is None:
                languages = self.engine.backend(tier).capabilities().context_languages
                got = self._default_language[tier] = (
                    "python" if "python" in languages else (languages[0] if languages else "")
                )
            return got
        return ""

    def _language(self, sandbox_id: str, language: object) -> str:
        """The canonical name of a code-context language the sandbox's tier has, or UnsupportedLanguage."""
        tier = self._tier(sandbox_id)
        available = self.engine.backend(tier).capabilities().context_languages
        name = language.lower() if isinstance(language, str) else ""
        name = LANGUAGE_ALIASES.get(name, name)
        if name not in available:
            raise UnsupportedLanguage(
                f"no {language!r} code contexts on the {tier} tier (available: {', '.join(available)})",
                language=str(language),
                available=available,
            )
        return name

    def _unsupported(self, sandbox_id: str, language: str, message: str) -> UnsupportedLanguage:
        """The sandbox's own refusal (its image lacks the interpreter), with what it does have."""
        info, _ = self.engine.info(sandbox_id)
        caps = self.engine.backend(info.tier).capabilities().context_languages
        return UnsupportedLanguage(message, language=language, available=tuple(x for x in caps if x != language))

    async def create_context(self, r: ops.CreateContext) -> str:
        cwd = sandbox_path(r.cwd)
        env = dict(validate_envs(r.envs))
        language = self._language(r.sandbox_id, r.language)
        try:
            context = await (await self._session(r.sandbox_id)).create_context(language, cwd, env)
        except UnsupportedLanguage as e:
            raise self._unsupported(r.sandbox_id, language, str(e)) from None
        if len(self._contexts) < MAX_TRACKED:
            self._contexts[(r.sandbox_id, context)] = language
        return context

    async def remove_context(self, r: ops.RemoveContext) -> None:
        await (await self._session(r.sandbox_id)).delete_context(r.context)
        self._contexts.pop((r.sandbox_id, r.context), None)

    async def list_contexts(self, r: ops.ListContexts) -> builtins.list[CodeContext]:
        return await (await self._session(r.sandbox_id)).list_contexts()

    async def restart_context(self, r: ops.RestartContext) -> None:
        if not isinstance(r.context, str) or not r.context:
            raise InvalidArgument(f"context must be a context id, got {r.context!r}")
        await (await self._session(r.sandbox_id)).restart_context(r.context)

    # ---- files

    async def read_file(self, r: ops.ReadFile) -> bytes:
        path = sandbox_path(r.path)
        checks.positive_int(r.max_bytes, "max_bytes")
        t = checks.optional_timeout(r.timeout) or None
        return await (await self._session(r.sandbox_id)).read(path, max_bytes=r.max_bytes, timeout=t)

    async def read_file_stream(self, r: ops.ReadFileStream) -> ops.ChunkStream:
        path = sandbox_path(r.path)
        if r.max_bytes is not None:  # None: no cap
            checks.positive_int(r.max_bytes, "max_bytes")
        t = checks.optional_timeout(r.timeout) or None
        return await (await self._session(r.sandbox_id)).read_stream(path, max_bytes=r.max_bytes, timeout=t)

    async def write_file(self, r: ops.WriteFile) -> EntryInfo:
        path = sandbox_path(r.path)
        checks.check_mode(r.mode)
        raw = checks.file_bytes(r.data, "data")
        return await (await self._session(r.sandbox_id)).write(path, raw, mode=r.mode, append=r.append)

    async def write_file_stream(self, r: ops.WriteFileStream) -> EntryInfo:
        path = sandbox_path(r.path)
        checks.check_mode(r.mode)
        if not isinstance(r.data, collections.abc.AsyncIterator):
            raise InvalidArgument(f"data must be an async iterator of bytes, got {type(r.data).__name__}")
        return await (await self._session(r.sandbox_id)).write_stream(path, checks.checked_chunks(r.data), mode=r.mode)

    async def upload_dir(self, r: ops.UploadDir) -> EntryInfo:
        path = sandbox_path(r.path)
        if not isinstance(r.data, collections.abc.AsyncIterator):
            raise InvalidArgument(f"data must be an async iterator of bytes, got {type(r.data).__name__}")
        return await (await self._session(r.sandbox_id)).unpack(path, checks.checked_chunks(r.data))

    async def download_dir(self, r: ops.DownloadDir) -> ops.ChunkStream:
        path = sandbox_path(r.path)
        t = checks.optional_timeout(r.timeout) or None
        return await (await self._session(r.sandbox_id)).pack(path, timeout=t)

    async def watch_dir(self, r: ops.WatchDir) -> ops.DirWatch:
        path = sandbox_path(r.path)
        if not isinstance(r.recursive, bool):
            raise InvalidArgument(f"recursive must be true or false, got {r.recursive!r}")
        if not callable(r.on_event):
            raise InvalidArgument("on_event must be a callable taking a warmbox.FilesystemEvent")
        return await (await self._session(r.sandbox_id)).watch(path, r.recursive, r.on_event)

    async def write_files(self, r: ops.WriteFiles) -> builtins.list[EntryInfo]:
        if not isinstance(r.files, (list, tuple)):
            raise InvalidArgument(f"files must be a list of warmbox.WriteEntry, got {type(r.files).__name__}")
        todo: builtins.list[tuple[str, bytes]] = []
        for i, entry in enumerate(r.files):  # every entry is checked before anything is written
            if not isinstance(entry, WriteEntry):
                raise InvalidArgument(f"files[{i}] must be a warmbox.WriteEntry, got {type(entry).__name__}")
            todo.append((sandbox_path(entry.path), checks.file_bytes(entry.data, f"files[{i}].data")))
        session = await self._session(r.sandbox_id)
        return [await session.write(path, raw) for path, raw in todo]

    async def rename(self, r: ops.Rename) -> EntryInfo:
        old, new = sandbox_path(r.old_path), sandbox_path(r.new_path)
        return await (await self._session(r.sandbox_id)).rename(old, new)

    async def list_dir(self, r: ops.ListDir) -> builtins.list[EntryInfo]:
        path = sandbox_path(r.path)
        if isinstance(r.depth, bool) or not isinstance(r.depth, int) or r.depth < 1:
            raise InvalidArgument(f"depth must be an integer >= 1, got {r.depth!r}")
        return await (await self._session(r.sandbox_id)).list(path, r.depth)

    async def stat(self, r: ops.Stat) -> EntryInfo:
        return await (await self._session(r.sandbox_id)).stat(sandbox_path(r.path))

    async def make_dir(self, r: ops.MakeDir) -> bool:
        return await (await self._session(r.sandbox_id)).make_dir(sandbox_path(r.path))

    async def remove(self, r: ops.Remove) -> None:
        await (await self._session(r.sandbox_id)).remove(sandbox_path(r.path))

    async def sign_file_url(self, r: ops.SignFileUrl) -> str:
        path = sandbox_path(r.path)
        if not isinstance(r.write, bool):
            raise InvalidArgument(f"write must be true or false, got {r.write!r}")
        if r.user != "user":
            raise InvalidArgument(f"user must be 'user' (the files API acts as the sandbox's user), got {r.user!r}")
        expires_in = r.expires_in
        if (
            isinstance(expires_in, bool)
            or not isinstance(expires_in, (int, float))
            or not 0 < expires_in <= signing.MAX_EXPIRES_S
        ):
            raise InvalidArgument(f"expires_in must be seconds, more than 0 and at most {signing.MAX_EXPIRES_S:g}")
        info = self.engine.info(r.sandbox_id)[0]
        if info.state is not State.PAUSED:  # a paused one: its URL works once it is resumed
            self.engine.check(Operation.EXEC, info)
        # signed for the tenant, not the key: a server's front is one per tenant (not per key), so
        # which of the tenant's keys asked is not known here
        signer = signing.tenant_signer(self._tenant_name())
        at = int(time.time() + expires_in)
        operation = "write" if r.write else "read"
        signature = self._signer().sign_file(signer, r.sandbox_id, path, operation, r.user, at)
        query = urllib.parse.urlencode(
            {"path": path, "username": r.user, "signer": signer, "signature_expiration": at, "signature": signature}
        )
        return api.SIGNED_FILE.format(sandbox_id=urllib.parse.quote(r.sandbox_id, safe="")) + "?" + query

    def _signer(self) -> signing.Signer:
        if self._signing is None:
            self._signing = signing.Signer(signing.registry_key(self.engine.registry))
        return self._signing

    # ---- snapshots

    async def snapshot(self, r: ops.Snapshot) -> SnapshotRef:
        m = await checkpoint.snapshot(
            self.engine,
            r.sandbox_id,
            self._held(r.sandbox_id),
            memory=r.memory,
            parent=self.engine.registry.sandboxes.parent(r.sandbox_id),
            env_names=r.env_names,
        )
        return checks.snapshot_ref(m)

    async def pause(self, r: ops.Pause) -> SnapshotRef:
        session = self._sessions.pop(r.sandbox_id, None)
        try:
            m = await checkpoint.pause(
                self.engine,
                r.sandbox_id,
                session,
                memory=r.memory,
                parent=self.engine.registry.sandboxes.parent(r.sandbox_id),
                env_names=r.env_names,
            )
        except SnapshotUnsupported:
            if session is not None:  # refused before the snapshot began: the session is as it was
                self._sessions[r.sandbox_id] = session
            raise
        except BaseException:
            if session is not None:
                self._sessions[r.sandbox_id] = session
            if r.memory:  # the agent dropped its sockets for the checkpoint: attach again if it still runs
                await self._reattach(r.sandbox_id)
            raise
        return checks.snapshot_ref(m)

    async def _reattach(self, sandbox_id: str) -> None:
        """A new connection to a (still running) sandbox's agent, waiting for it to listen."""
        await self._drop(sandbox_id)
        deadline = time.monotonic() + REATTACH_S
        while True:
            try:
                await self._hold(await duties.open(self.engine, sandbox_id))
                return
            except GuestConnectionError:
                if time.monotonic() > deadline:
                    return  # the next call reports the dead connection
                await asyncio.sleep(0.05)
            except WarmboxError:
                return  # gone or paused after all: the next call says so

    async def list_snapshots(self, r: ops.ListSnapshots) -> builtins.list[tuple[str, str, float, int]]:
        return self.engine.registry.snapshots.all_snapshots(self._tenant_name())

    async def delete_snapshot(self, r: ops.DeleteSnapshot) -> None:
        snapstore.delete(self.engine, r.snapshot_id)

    async def gc_snapshots(self, r: ops.GcSnapshots) -> ops.GcReport:
        removed, broken = await snapshots.gc(self.engine, 0.0 if r.now else None)
        store = self.engine.redact(snapstore.store_for(self.engine).describe())  # an admin key's, yet no host path
        return ops.GcReport(removed, tuple(broken), store)

    # ---- network

    async def update_network(self, r: ops.UpdateNetwork) -> str:
        policy = await egress.update(self.engine, r.sandbox_id, r.network, await self._session(r.sandbox_id))
        return policy.describe()

    async def network_policy(self, r: ops.NetworkPolicy) -> str:
        return egress.policy(self.engine, r.sandbox_id).describe()

    async def network_log(self, r: ops.NetworkLog) -> builtins.list[NetEvent]:
        return egress.log(self.engine, r.sandbox_id)

    # ---- ports

    async def port_connect(self, r: ops.PortConnect) -> ops.PortStream:
        if isinstance(r.port, bool) or not isinstance(r.port, int) or not 0 < r.port < 65536:
            raise InvalidArgument(f"port must be a TCP port number (1..65535), got {r.port!r}")
        t = validate_timeout(r.timeout, "timeout")
        stream = await (await self._session(r.sandbox_id)).connect_port(r.port, t)
        if self._lifecycle(r.sandbox_id).idle_pause_after is not None:
            # an open connection is use for as long as it is open, not only when it opens
            self._busy(r.sandbox_id, +1)
            stream.on_close = lambda: self._busy(r.sandbox_id, -1)
        return stream

    # ---- warm pools

    async def pools_list(self, r: ops.PoolsList) -> builtins.list[PoolStatus]:
        return pools.status(self.engine, self.engine.settings())

    async def pools_resize(self, r: ops.PoolsResize) -> PoolStatus:
        if not isinstance(r.name, str) or not r.name:
            raise InvalidArgument(f"name must be a pool name, got {r.name!r}")
        await approvals.gate_pool_resize(self.engine, self.tenant, r.name, r.target)
        # resize validates target/min/max, writes the registry and makes sure the daemon runs to act on it
        return pools.resize(self.engine, self.engine.settings(), r.name, r.target, r.min, r.max)

    # ---- the approval queue: a tenant key sees its own tenant's questions and answers its network
    # ones; a question about cost (a start over budget, a large create, a pool resize) is the
    # operator's to answer: an admin key's (which sees every tenant's) or the host's

    def _sees_all(self) -> bool:
        return self.tenant is None or self.tenant.admin

    async def approvals_list(self, r: ops.ApprovalsList) -> builtins.list[Approval]:
        if not isinstance(r.pending_only, bool):
            raise InvalidArgument(f"pending_only must be true or false, got {r.pending_only!r}")
        if isinstance(r.limit, bool) or not isinstance(r.limit, int) or not 1 <= r.limit <= 1000:
            raise InvalidArgument(f"limit must be an integer in [1, 1000], got {r.limit!r}")
        if r.tenant is not None and not isinstance(r.tenant, str):
            raise InvalidArgument(f"tenant must be a tenant name, got {r.tenant!r}")
        tenant = r.tenant if self._sees_all() else self._tenant_name()
        if r.tenant is not None and tenant != r.tenant:
            return []  # another tenant's: none (whether it has any is not said)
        return self.engine.registry.approvals.approvals(tenant, pending_only=r.pending_only, limit=r.limit)

    async def approval_answer(self, r: ops.ApprovalAnswer) -> Approval:
        if not isinstance(r.approval_id, str) or not r.approval_id:
            raise InvalidArgument(f"approval_id must be an approval id (ap-…), got {r.approval_id!r}")
        if not isinstance(r.decision, str):
            raise InvalidArgument(f"decision must be a string, got {r.decision!r}")
        reg = self.engine.registry
        scope = None if self._sees_all() else self._tenant_name()
        a = reg.approvals.approval(r.approval_id, tenant=scope)  # another tenant's: not found
        if a.kind != "network" and not self._sees_all():
            assert self.tenant is not None
            raise Forbidden(
                f"a {a.kind} question is the operator's to answer (an admin key); "
                f"tenant {self.tenant.name!r}'s key is not one"
            )
        if self.tenant is None:
            by = "root"
        else:
            by = self.tenant.key_id or f"tenant:{self.tenant.name}"
        answered = reg.approvals.answer_approval(r.approval_id, r.decision, by, tenant=scope)
        if answered.kind == "network":  # the egress proxy waits for it: it looks at once
            await egress.approval_answered(self.engine.home, answered.approval_id)
        return answered

    async def node_drain(self, r: ops.NodeDrain) -> ops.DrainReport:
        raise NotACluster(
            f"this server runs one host's engine: drain node {r.name!r} through the cluster's API tier "
            "(warmbox serve --cluster)",
            node=r.name if isinstance(r.name, str) else "",
        )

    # ---- named volumes (the tenant's own; the host's front: the host's, tenant "")

    def _volume_owner(self) -> str:
        return "" if self.tenant is None else self.tenant.name

    async def volume_create(self, r: ops.VolumeCreate) -> VolumeInfo:
        return await volumes.create(self.engine, self._volume_owner(), r.name, r.size_mb)

    async def volume_list(self, r: ops.VolumeList) -> builtins.list[VolumeInfo]:
        return volumes.list(self.engine, self._volume_owner())

    async def volume_get(self, r: ops.VolumeGet) -> VolumeInfo:
        return volumes.get(self.engine, self._volume_owner(), r.name)

    async def volume_delete(self, r: ops.VolumeDelete) -> None:
        volumes.delete(self.engine, self._volume_owner(), r.name)

    # ---- templates

    async def template_build(self, r: ops.TemplateBuild) -> TemplateInfo:
        from warmbox.engine import builder
        from warmbox.templates import OciSource, RegistrySource, check_template

        t = check_template(r.template)
        if isinstance(t.source, OciSource) and self.tenant is not None and not self.tenant.admin:
            raise Forbidden(
                "from_oci reads a path on the server's host: admin keys only (push the image to a registry)"
            )
        if isinstance(t.source, RegistrySource) and self.tenant is not None and not self.tenant.admin:
            host = t.source.ref.split("/", 1)[0].lower()
            allowed = self.engine.settings().server.template_registries
            if host not in allowed:
                raise Forbidden(
                    f"the registry {host} is not one a tenant may pull from (the pull runs on the server's host): "
                    f"the server's [server] template_registries lists {', '.join(allowed) or 'none'}"
                )
        if r.context is not None and not isinstance(r.context, bytes):
            raise InvalidArgument(f"context must be bytes (a tar), got {type(r.context).__name__}")
        if r.on_progress is not None and not callable(r.on_progress):
            raise InvalidArgument("on_progress must be a callable")
        return await builder.build(
            self.engine, r.name, t, context=r.context, on_progress=r.on_progress, tenant=self.tenant
        )

    async def template_list(self, r: ops.TemplateList) -> builtins.list[TemplateInfo]:
        return self.engine.registry.templates.template_list(self._tenant_name())

    async def template_get(self, r: ops.TemplateGet) -> TemplateInfo:
        return self.engine.registry.templates.template_get(
            checks.template_name(r.name), checks.version(r.version), self._tenant_name() or ""
        )

    async def template_delete(self, r: ops.TemplateDelete) -> builtins.list[TemplateInfo]:
        name, version = checks.template_name(r.name), checks.version(r.version)
        owner = self._tenant_name() or ""
        self.engine.registry.templates.template_get(name, version, owner)  # TemplateNotFound first
        users = resolve.template_users(self.engine, name, version, self.tenant)
        if users:
            raise TemplateInUse(
                f"template {name!r} is in use by {', '.join(users[:10])}{' ...' if len(users) > 10 else ''}",
                template=name,
            )
        from warmbox.engine import images
        from warmbox.storage.templates import delete_template

        return delete_template(self.engine.registry, images.store(), name, version, owner)  # and unpinned

    async def template_gc(self, r: ops.TemplateGc) -> ops.TemplateGcReport:
        from warmbox.engine import template_gc

        if not isinstance(r.dry_run, bool):
            raise InvalidArgument(f"dry_run must be a boolean, got {r.dry_run!r}")
        return await asyncio.to_thread(template_gc.gc, self.engine, dry_run=r.dry_run)

    async def subscribe_approvals(self, sandbox_id: str, hook: Callable[[ApprovalRequest], object]) -> Subscription:
        """Answer the egress proxy's approval questions for ``sandbox_id`` with ``hook`` (a local
        callable: allow_once / allow_always / deny) until the subscription is cancelled."""
        if not callable(hook):
            raise InvalidArgument("on_approval must be a callable")
        self._own(sandbox_id)
        info, _ = self.engine.info(sandbox_id)
        if info.state in (State.DESTROYED, State.LOST, State.FAILED):  # its proxy will never ask
            self.engine.check(Operation.EXEC, info)  # SandboxNotFound "was destroyed", SandboxLost, ...
        subscribed = asyncio.Event()
        task = asyncio.ensure_future(egress.approvals(self.engine.home, sandbox_id, hook, subscribed))  # type: ignore[arg-type]
        try:
            await asyncio.wait_for(subscribed.wait(), 10)
        except TimeoutError:
            task.cancel()
            raise egress.EgressError("could not subscribe to the egress proxy's approval requests") from None
        return Subscription(task)


__all__ = ["EngineFront", "Subscription", "sandbox_path"]
