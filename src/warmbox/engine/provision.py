"""The one provisioning pipeline: every sandbox start (create, pool refill, template, resume, fork) runs here.

``launch(engine, spec, boot)`` allocates an id, a state directory and a registry row, builds the
sandbox with its backend, starts its agent (``Cold``: a fresh boot, then the template's warm-up;
``Restore``: a memory image continued), checks the agent, records the stage timings and the new
state, and returns one :class:`Launched` record. ``claim`` hands out a pooled sandbox as the same
record. A start that fails anywhere is torn down here, once, whatever the boot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING

from warmbox.backends.base import Backend, SharedHost, SnapshotCapable
from warmbox.config import PoolConfig, Template
from warmbox.engine import egress, volumes
from warmbox.engine.session import GuestSession, OomCounter
from warmbox.errors import BackendUnavailable, InvalidArgument, NoSpace, SandboxStartError, WarmboxError
from warmbox.models import (
    BackendHandle,
    ImageRef,
    Limits,
    SandboxInfo,
    SandboxSpec,
    StageTiming,
    State,
    Tenant,
    VolumeMount,
)

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with its NUL
WARMUP_TIMEOUT_S = 600.0
AGENT_TIMEOUT_S = 30.0  # from the runtime's start to the agent's answer (a host-side bound)
CLAIM_CONFIGURE_TIMEOUT_S = 10.0
_TAR_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What sandbox to start: its shape, lifetime and environment, and whose it is."""

    tier: str
    template: str
    timeout_s: float  # lifetime from the moment it is usable, seconds
    limits: Limits
    envs: tuple[tuple[str, str], ...] = ()
    pool: str = ""  # the pool it is made for ("": a caller's sandbox)
    shape: str = ""  # config.shape_key of a pool's sandbox
    tenant: Tenant | None = None  # whose it is (None: the host's); its quotas are checked at the insert
    resume_of: str = ""  # a paused sandbox started again under its own id ("": a new sandbox)
    image: ImageRef | None = None  # the image it runs (None: its template's latest, Engine.image_for)
    volumes: tuple[VolumeMount, ...] = ()  # named volumes mounted into it
    build_upper: str = ""  # a template build sandbox (SandboxSpec.build_upper)
    # it gets an egress link: on a tier whose interfaces are fixed at start (link_before_start) the
    # link is prepared before its runtime starts (a resume of a sandbox that kept a policy: always)
    network: bool = False


@dataclasses.dataclass(frozen=True)
class Cold:
    """Boot the tier's runtime and run the template's warm-up."""

    template: Template


@dataclasses.dataclass(frozen=True)
class Restore:
    """Continue a memory snapshot: ``memory_dir`` holds the runtime's image, ``workspace_tar``
    the /workspace archive unpacked into the new sandbox before its runtime starts."""

    snapshot_id: str
    memory_dir: Path
    workspace_tar: Path


Boot = Cold | Restore


@dataclasses.dataclass
class Launched:
    """A started sandbox: its registry record, backend handle, connected session, stage timings."""

    info: SandboxInfo
    handle: BackendHandle
    session: GuestSession
    timings: list[StageTiming]

    @property
    def sandbox_id(self) -> str:
        return self.info.sandbox_id


def session_oom(backend: Backend, handle: BackendHandle) -> OomCounter | None:
    """The host-side OOM counter a session reads around each call (None: the guest counts them)."""
    if backend.capabilities().oom_counted_in_guest:
        return None
    return lambda: backend.oom_kills(handle)


async def connect(backend: Backend, handle: BackendHandle) -> GuestSession:
    """A session to a running sandbox's agent (GuestConnectionError if it does not listen)."""
    return await GuestSession.connect(handle.socket_path, handle.sandbox_id, session_oom(backend, handle))


async def launch(engine: Engine, spec: LaunchSpec, boot: Boot) -> Launched:
    """Start one sandbox (see the module docstring); typed errors, nothing left behind on failure."""
    t0 = time.perf_counter()
    backend = engine.backend(spec.tier)
    if isinstance(boot, Restore) and not isinstance(backend, SnapshotCapable):
        raise BackendUnavailable(spec.tier, "this tier cannot restore memory snapshots")
    avail = await asyncio.to_thread(backend.probe)  # the first probe of a tier may boot a probe guest
    if not avail.available:
        raise BackendUnavailable(spec.tier, avail.reason)
    images = backend.capabilities().images
    if spec.image is None and images:  # every sandbox runs an image: its template's latest (never the host's /usr)
        spec = dataclasses.replace(spec, image=await asyncio.to_thread(engine.image_for, spec.template, spec.tenant))
    sandbox_id = spec.resume_of or "sb-" + secrets.token_hex(6)
    state_dir = engine.runtime / "sandboxes" / sandbox_id
    socket_path = str(state_dir / "run" / "agent.sock")
    if len(socket_path) > MAX_SOCKET_PATH:
        raise InvalidArgument(f"runtime dir {engine.runtime} is too long for a unix socket path")
    lim = spec.limits
    if spec.resume_of:  # the same row and id; a new uid range, this node's directory and socket
        engine.registry.sandboxes.reallocate(
            sandbox_id,
            spec.timeout_s,
            lim,
            owner=engine.owner,
            tenant=spec.tenant,
            state_dir=str(state_dir),
            socket_path=socket_path,
        )
    else:
        engine.registry.sandboxes.allocate(
            sandbox_id,
            spec.tier,
            spec.template,
            spec.timeout_s,
            lim,
            str(state_dir),
            socket_path,
            pool=spec.pool,
            owner=engine.owner,
            shape=spec.shape,
            tenant=spec.tenant,
            template_version=spec.image.version if spec.image is not None else 0,
            image_id=spec.image.image_id if spec.image is not None else "",
        )
    if not spec.pool:
        engine.ensure_daemon()  # from here on, a crash of this process is cleaned up by the daemon
    info, handle = engine.registry.sandboxes.get(sandbox_id)
    if spec.resume_of and state_dir.exists():  # leftovers of a pause whose release was cut short
        try:
            await backend.destroy(handle)
        except BaseException as e:
            await engine.cleanup_failed(sandbox_id, handle, backend, e, resumed=True)
            raise
    state_dir.parent.mkdir(mode=0o711, exist_ok=True)
    state_dir.mkdir(mode=0o711)
    t1 = t2 = t3 = t4 = time.perf_counter()
    session: GuestSession | None = None
    prep_s = 0.0  # of the network stage: the link made before the start (link_before_start)
    try:
        ns = ""
        if backend.capabilities().link_before_start and (
            spec.network or (spec.resume_of and egress.paused_record(engine, sandbox_id) is not None)
        ):
            ns = await egress.prepare(engine, handle)
            prep_s = time.perf_counter() - t1
        if spec.volumes:  # recorded before anything is mounted: a delete or another tier's mount waits its turn
            volumes.record(engine, sandbox_id, spec.volumes, backend.capabilities().volume_own_disk)
        handle = await backend.create(
            SandboxSpec(
                sandbox_id=sandbox_id,
                state_dir=str(state_dir),
                uid_base=handle.uid_base,
                envs=spec.envs if isinstance(boot, Cold) else (),
                limits=lim,
                image=spec.image,
                volumes=spec.volumes,
                build_upper=spec.build_upper,
                netns=ns,
                tenant=spec.tenant.name if spec.tenant is not None else "",
            )
        )
        if isinstance(boot, Restore):
            await _unpack_workspace(engine, boot, state_dir, lim, sandbox_id)
        t2 = time.perf_counter()

        async def ready() -> GuestSession:
            nonlocal session
            session = await connect(backend, handle)
            if not isinstance(boot, Restore):
                await asyncio.wait_for(session.ping(), AGENT_TIMEOUT_S)
                return session
            # every restore of one image holds the same generator states: reseeded before anyone
            # gets the sandbox; sent with the ping, not after it (a restored guest runs either slowly
            # the first time: a microVM under TCG translates the code again); the ping's error first
            got = await asyncio.gather(
                asyncio.wait_for(session.ping(), AGENT_TIMEOUT_S),
                asyncio.wait_for(session.reseed(), AGENT_TIMEOUT_S),
                return_exceptions=True,
            )
            for r in got:
                if isinstance(r, BaseException):
                    raise r
            return session

        if isinstance(boot, Restore):
            assert isinstance(backend, SnapshotCapable)
            session = await backend.restore(handle, boot.memory_dir, ready)
        else:
            session = await backend.start(handle, ready)
        t3 = t4 = time.perf_counter()
        if isinstance(boot, Cold) and images:  # a tier without images has no template warm-up either
            await warm_up(session, boot.template)
            t4 = time.perf_counter()
        if spec.pool:  # the pool pays for what it took so far: a reading before anyone can claim it
            u = await backend.usage(handle)
            if u.oom_kills and isinstance(boot, Cold):
                raise SandboxStartError(
                    f"template {boot.template.name} warm-up hit the memory limit ({lim.memory_mb} MiB): OOM kill",
                    sandbox_id,
                )
            engine.registry.usage.sample([(sandbox_id, u.memory_bytes, u.cpu_ns)])
    except BaseException as e:
        if session is not None:
            await session.close()
        await engine.cleanup_failed(sandbox_id, handle, backend, e, resumed=bool(spec.resume_of))
        try:  # a prepared link (a resumed sandbox keeps its policy and secrets for the next try)
            await egress.unprepare(engine, sandbox_id)
        except WarmboxError:
            pass  # best effort: the start's own error is the one to report
        if isinstance(e, (WarmboxError, asyncio.CancelledError, KeyboardInterrupt)):
            raise
        if isinstance(e, asyncio.TimeoutError):
            raise SandboxStartError(f"guest agent did not answer within {AGENT_TIMEOUT_S:g} s", sandbox_id) from None
        raise SandboxStartError(f"sandbox start failed: {type(e).__name__}: {e}", sandbox_id) from None
    on_path = not spec.pool
    timings = [
        StageTiming(sandbox_id, "allocation", (t1 - t0) * 1e3, on_path),
        StageTiming(sandbox_id, "filesystem", (t2 - t1 - prep_s) * 1e3, on_path),
        StageTiming(sandbox_id, "runtime", (t3 - t2) * 1e3, on_path),
    ]
    if isinstance(boot, Cold) and images and (boot.template.warmup_code is not None or boot.template.warmup_commands):
        timings.append(StageTiming(sandbox_id, "dependencies", (t4 - t3) * 1e3, on_path))
    if prep_s:  # the link made before the start (egress.attach adds the rest of the stage)
        timings.append(StageTiming(sandbox_id, "network", prep_s * 1e3, on_path))
    try:
        if not spec.resume_of:  # a resume keeps its start's timings; its caller records ``resume``
            engine.registry.sandboxes.add_timings(timings)
        # the lifetime starts now that it is usable, not when its start began
        engine.registry.sandboxes.set_expiry(sandbox_id, time.time() + spec.timeout_s)
        if spec.resume_of:
            why = f"resumed from {boot.snapshot_id}" if isinstance(boot, Restore) else "resumed"
        elif isinstance(boot, Restore):
            why = f"restored from {boot.snapshot_id}"
        else:
            why = "warmed up for pool " + spec.pool if spec.pool else "guest agent answered"
        engine.registry.sandboxes.set_state(
            sandbox_id, State.POOLED if spec.pool else State.READY, why, expected=State.CREATING
        )
        if isinstance(boot, Restore):
            engine.registry.sandboxes.set_parent(sandbox_id, boot.snapshot_id)
        info, _ = engine.registry.sandboxes.get(sandbox_id)
    except BaseException:
        await session.close()
        raise
    return Launched(info, handle, session, timings)


async def _unpack_workspace(engine: Engine, boot: Restore, state_dir: Path, limits: Limits, sandbox_id: str) -> None:
    """The snapshot's /workspace, unpacked by tar as the workspace's owner (the sandbox's uid on
    gVisor): what it creates is the sandbox's, and no entry can make the host write outside it."""
    from warmbox.backends import hostfs

    try:
        await hostfs.tar_extract(state_dir / "workspace", boot.workspace_tar, timeout=_TAR_TIMEOUT_S)
    except NoSpace as e:  # the workspace's own filesystem (limits.disk_mb) is full
        raise NoSpace(
            f"snapshot {boot.snapshot_id} does not fit the disk of its new sandbox (limits.disk_mb = "
            f"{limits.disk_mb}): {str(e).strip()[-200:]}",
            sandbox_id,
        ) from None


async def claim(
    engine: Engine,
    pc: PoolConfig,
    shape: str,
    timeout_s: float,
    envs: tuple[tuple[str, str], ...],
    t0: float,
    tenant: Tenant | None = None,
) -> Launched | None:
    """A ready sandbox of pool ``pc`` for a caller, or None if the pool has none. A pooled sandbox
    that fails its check is destroyed and the next one taken. tenant: the caller's (the claim
    stamps it; QuotaExceeded leaves the sandbox in the pool). A tier whose sandboxes live in host
    processes per tenant (SharedHost) hands its pooled ones, made in the in-process SDK's host,
    to that tenant (None) only: another tenant's sandbox must not live in that host."""
    if tenant is not None and isinstance(engine.backend(pc.tier), SharedHost):
        return None
    while True:
        got = engine.registry.pools.claim(pc.name, shape, timeout_s, engine.owner, tenant)
        if got is None:
            return None
        info, handle = got
        sid = info.sandbox_id
        backend = engine.backend(info.tier)
        session = None
        try:
            # connecting proves the agent lives (its listening socket dies with it); the
            # warm-up already reset its counters, so only a caller's env needs a round trip
            session = await connect(backend, handle)
            if envs:
                await asyncio.wait_for(session.configure(dict(envs), reset_counts=True), CLAIM_CONFIGURE_TIMEOUT_S)
        except (TimeoutError, WarmboxError, OSError) as e:
            # it died or misbehaves while pooled: never hand it out; take the next one
            if session is not None:
                await session.close()
            engine.registry.pools.pool_event(pc.name, "claim_failed", sid, f"{type(e).__name__}: {e}"[:500])
            try:
                await engine.destroy(sid, "pooled sandbox failed its claim check")
            except WarmboxError:
                pass
            continue
        except BaseException:
            if session is not None:
                await session.close()
            await engine.destroy(sid, "claim interrupted")
            raise
        alloc = StageTiming(sid, "allocation", (time.perf_counter() - t0) * 1e3, True)
        engine.registry.sandboxes.add_timings([alloc])
        engine.ensure_daemon()
        timings = [t for t in engine.registry.sandboxes.timings(sid) if t.stage != "allocation"]
        return Launched(info, handle, session, [alloc, *timings])


async def warm_up(session: GuestSession, tmpl: Template) -> None:
    """Run a template's warm-up; any failure raises SandboxStartError naming what failed."""
    sid = session.sandbox_id
    for cmd in tmpl.warmup_commands:
        try:
            r = await session.exec(
                ["/bin/bash", "-c", cmd], timeout_s=WARMUP_TIMEOUT_S, max_output=1 << 20, what="exec"
            )
        except WarmboxError as e:
            if isinstance(e, SandboxStartError):
                raise
            raise SandboxStartError(f"template {tmpl.name} warm-up command {cmd!r}: {e}", sid) from None
        if r.oom_killed:
            raise SandboxStartError(f"template {tmpl.name} warm-up command {cmd!r} hit the memory limit: OOM kill", sid)
        if r.exit_code != 0 or r.timed_out:
            tail = (r.stdout + r.stderr)[-400:]
            raise SandboxStartError(
                f"template {tmpl.name} warm-up command {cmd!r} exited {r.exit_code}"
                f"{' (timed out)' if r.timed_out else ''}: {tail.strip()}",
                sid,
            )
    # empty warm-up code: nothing to import, so no context is started before the first run_code
    # (forked from the agent then, tens of ms; an idle context costs ~4 MiB: docs/performance.md)
    if tmpl.warmup_code:
        try:
            ex = await session.run_code(tmpl.warmup_code, timeout_s=WARMUP_TIMEOUT_S, max_output=1 << 20)
        except WarmboxError as e:
            raise SandboxStartError(f"template {tmpl.name} warm-up: {e}", sid) from None
        if ex.oom_killed:
            raise SandboxStartError(f"template {tmpl.name} warm-up hit the memory limit: OOM kill", sid)
        if ex.error is not None or ex.timed_out:
            err = ex.error
            raise SandboxStartError(
                f"template {tmpl.name} warm-up failed: {err.name if err else ''}: {err.value if err else 'timed out'}"[
                    :800
                ],
                sid,
            )
    if tmpl.warmup_code is not None or tmpl.warmup_commands:
        # the caller's first cell is cell 1, and its busy/idle counters start at zero
        try:
            await session.configure({}, reset_counts=True)
        except WarmboxError as e:
            raise SandboxStartError(f"template {tmpl.name} warm-up: {e}", sid) from None
