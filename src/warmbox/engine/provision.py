"""The one provisioning pipeline: every sandbox start (create, pool refill, template, resume, fork) runs here.

``launch(engine, spec, boot)`` allocates an id, a state directory and a registry row, builds the
sandbox with its backend, starts its agent (``Cold``: a fresh boot, then the template's warm-up;
``Restore``: a memory image continued), checks the agent, records the stage timings and the new
state, and returns one :class:`Launched` record. ``claim`` hands out a pooled sandbox as the same
record. A start that fails anywhere is torn down here, once, whatever the boot.

``create`` is a caller's start (a pool claim, else cold, else from the shape's template memory
snapshot on a tier that starts that way), ``create_pooled`` a pool's; ``restore_memory`` continues
a memory snapshot as a new (or the resumed) sandbox, and ``template_snapshot`` makes a shape's
template snapshot once (it pauses a warmed sandbox: checkpoint.pause).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import hashlib
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from warmbox import backends, config
from warmbox.backends.base import Backend, SharedHost, SnapshotCapable, TemplateCapable
from warmbox.config import PoolConfig, Template
from warmbox.engine import checkpoint, egress, resolve, snapstore, teardown
from warmbox.engine import volumes as volumes_mod
from warmbox.engine.session import AGENT_TIMEOUT_S, GuestSession, session_oom
from warmbox.engine.start import StartRecord
from warmbox.errors import (
    BackendUnavailable,
    InvalidArgument,
    NoSpace,
    SandboxError,
    SandboxStartError,
    StorageError,
    WarmboxError,
)
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
    validate_timeout,
)
from warmbox.storage import snapshots as snaps

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with its NUL
WARMUP_TIMEOUT_S = 600.0
CLAIM_CONFIGURE_TIMEOUT_S = 10.0
_TAR_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What sandbox to start (``start``: its shape, lifetime, environment, whose it is, and what its
    row records), and the provisioning details no caller of the front chooses."""

    start: StartRecord
    pool: str = ""  # the pool it is made for ("": a caller's sandbox)
    shape: str = ""  # config.shape_key of a pool's sandbox
    image: ImageRef | None = None  # the image it runs (None: its template's latest, resolve.image_for)
    resume_of: str = ""  # a paused sandbox started again under its own id ("": a new sandbox)
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


async def connect(backend: Backend, handle: BackendHandle) -> GuestSession:
    """A session to a running sandbox's agent (GuestConnectionError if it does not listen)."""
    return await GuestSession.connect(handle.socket_path, handle.sandbox_id, session_oom(backend, handle))


async def launch(engine: Engine, spec: LaunchSpec, boot: Boot) -> Launched:
    """Start one sandbox (see the module docstring); typed errors, nothing left behind on failure."""
    t0 = time.perf_counter()
    rec = spec.start
    backend = engine.backend(rec.tier)
    if isinstance(boot, Restore) and not isinstance(backend, SnapshotCapable):
        raise BackendUnavailable(rec.tier, "this tier cannot restore memory snapshots")
    avail = await asyncio.to_thread(backend.probe)  # the first probe of a tier may boot a probe guest
    if not avail.available:
        raise BackendUnavailable(rec.tier, avail.reason)
    images = backend.capabilities().images
    if spec.image is None and images:  # every sandbox runs an image: its template's latest (never the host's /usr)
        spec = dataclasses.replace(
            spec, image=await asyncio.to_thread(resolve.image_for, engine, rec.template, rec.tenant)
        )
    sandbox_id = spec.resume_of or "sb-" + secrets.token_hex(6)
    state_dir = engine.runtime / "sandboxes" / sandbox_id
    socket_path = str(state_dir / "run" / "agent.sock")
    if len(socket_path) > MAX_SOCKET_PATH:
        raise InvalidArgument(f"runtime dir {engine.runtime} is too long for a unix socket path")
    lim = rec.limits
    if spec.resume_of:  # the same row and id; a new uid range, this node's directory and socket
        engine.registry.sandboxes.reallocate(
            sandbox_id,
            rec.timeout_s,
            lim,
            owner=engine.owner,
            tenant=rec.tenant,
            state_dir=str(state_dir),
            socket_path=socket_path,
            mounts=volumes_mod.records(rec.volumes),
            exclusive_mounts=backend.capabilities().volume_own_disk,
        )
    else:
        engine.registry.sandboxes.allocate(
            sandbox_id,
            rec.tier,
            rec.template,
            rec.timeout_s,
            lim,
            str(state_dir),
            socket_path,
            pool=spec.pool,
            owner=engine.owner,
            shape=spec.shape,
            tenant=rec.tenant,
            template_version=spec.image.version if spec.image is not None else 0,
            image_id=spec.image.image_id if spec.image is not None else "",
            start=rec,
            mounts=volumes_mod.records(rec.volumes),
            exclusive_mounts=backend.capabilities().volume_own_disk,
        )
    if not spec.pool:
        engine.ensure_daemon()  # from here on, a crash of this process is cleaned up by the daemon
    info, handle = engine.registry.sandboxes.get(sandbox_id)
    if spec.resume_of and state_dir.exists():  # leftovers of a pause whose release was cut short
        try:
            await backend.destroy(handle)
        except BaseException as e:
            await cleanup_failed(engine, sandbox_id, handle, backend, e, resumed=True)
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
        handle = await backend.create(
            SandboxSpec(
                sandbox_id=sandbox_id,
                state_dir=str(state_dir),
                uid_base=handle.uid_base,
                envs=rec.envs if isinstance(boot, Cold) else (),
                limits=lim,
                image=spec.image,
                volumes=rec.volumes,
                build_upper=spec.build_upper,
                netns=ns,
                tenant=rec.tenant.name if rec.tenant is not None else "",
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
        await cleanup_failed(engine, sandbox_id, handle, backend, e, resumed=bool(spec.resume_of))
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
        engine.registry.sandboxes.set_expiry(sandbox_id, time.time() + rec.timeout_s)
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


async def claim(engine: Engine, pc: PoolConfig, shape: str, t0: float, rec: StartRecord) -> Launched | None:
    """A ready sandbox of pool ``pc`` for a caller, or None if the pool has none. A pooled sandbox
    that fails its check is destroyed and the next one taken. tenant: the caller's (the claim
    stamps it; QuotaExceeded leaves the sandbox in the pool). A tier whose sandboxes live in host
    processes per tenant (SharedHost) hands its pooled ones, made in the in-process SDK's host,
    to that tenant (None) only: another tenant's sandbox must not live in that host. ``rec``: the
    caller's start (its timeout, envs and tenant), its record written with the claim."""
    tenant, envs = rec.tenant, rec.envs
    if tenant is not None and isinstance(engine.backend(pc.tier), SharedHost):
        return None
    while True:
        got = engine.registry.pools.claim(pc.name, shape, rec.timeout_s, engine.owner, tenant, rec)
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
                await teardown.destroy(engine, sid, "pooled sandbox failed its claim check")
            except WarmboxError:
                pass
            continue
        except BaseException:
            if session is not None:
                await session.close()
            await teardown.destroy(engine, sid, "claim interrupted")
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


# ---- create: a caller's, a pool's, from a template's memory snapshot


async def create(
    engine: Engine,
    *,
    tier: str | None = None,
    timeout: float | None = None,
    envs: dict[str, str] | None = None,
    limits: Limits | None = None,
    template: str | None = None,
    pool: bool = True,
    tenant: Tenant | None = None,
    resume_of: str = "",
    mounts: tuple[VolumeMount, ...] = (),
    image: ImageRef | None = None,
    egress_link: bool = False,
    record: StartRecord | None = None,
) -> Launched:
    """The engine's start of a caller's sandbox in a shape it knows (a fork's or a resume's):
    the options checked (StartRecord.checked), then :func:`start`. resume_of: start this paused
    sandbox again under its id, with the volumes it mounted. mounts: volumes resolved already (a
    fork of a snapshot mounts its origin's). image: run this image (a snapshot's recorded one)
    instead of the template's latest. egress_link: the caller links it after the start (a fork's
    recorded policy): on a tier whose interfaces are fixed at start, its link is prepared before
    (never from a pool). record: the caller's (a fork's metadata and lifecycle), written with the row."""
    rec = StartRecord.checked(
        engine,
        tier=tier,
        template=template,
        timeout=timeout,
        envs=envs,
        limits=limits,
        tenant=tenant,
        pool=pool and not resume_of,
        mounts=volumes_mod.of_sandbox(engine, resume_of) if resume_of else mounts,
        image_given=image is not None,
    ).recording(record)
    return await start(engine, rec, resume_of=resume_of, image=image, egress_link=egress_link)


async def start(
    engine: Engine,
    rec: StartRecord,
    *,
    resume_of: str = "",
    image: ImageRef | None = None,
    egress_link: bool = False,
) -> Launched:
    """A ready sandbox for ``rec`` (StartRecord.build or .checked) with a connected session and its
    stage timings.

    Taken from a pool of the same (tier, template, limits) when one has a ready sandbox
    (``rec.pool`` False: never; nor with volumes, nor linked before its start), otherwise created
    cold, with the template's warm-up run. A network policy other than "none" links it to the
    egress proxy (stage ``network``). The record is written with the sandbox's row or its pool
    claim; QuotaExceeded before anything is claimed or made. resume_of, image, egress_link: as
    for :func:`create`.
    """
    t0 = time.perf_counter()
    policy = rec.network
    # a tier whose interfaces are fixed at start gets its link before it starts: never a pooled one
    linked_at_start = (policy.enabled or egress_link) and engine.backend(rec.tier).capabilities().link_before_start
    pool = rec.pool and not resume_of and not rec.volumes and not linked_at_start
    got = await _create(engine, rec, pool, t0, resume_of, image, network=policy.enabled or egress_link)
    if policy.enabled:
        try:
            prepared = sum(t.duration_ms for t in got.timings if t.stage == "network")  # before start
            timing = await egress.attach(
                engine, got.handle, got.session, policy, dict(rec.secrets), prepared_ms=prepared
            )
            got.timings = [t for t in got.timings if t.stage != "network"] + [timing]
        except BaseException:
            await got.session.close()
            await teardown.destroy(engine, got.sandbox_id, "network setup failed")
            raise
    return got


async def _create(
    engine: Engine,
    rec: StartRecord,
    pool: bool,
    t0: float,
    resume_of: str = "",
    image: ImageRef | None = None,
    *,
    network: bool = False,
) -> Launched:
    settings = engine.settings()
    tier, template, limits, tenant = rec.tier, rec.template, rec.limits, rec.tenant
    tmpl = resolve.template(engine, template, tenant)
    if tenant is not None:  # early, before any work; the claim or insert checks again, atomically
        engine.registry.tenants.check_quota(tenant, tier, limits)
    pc = settings.pool_for(tier, template, limits) if pool else None
    images = engine.backend(tier).capabilities().images
    if pc is not None and image is None:
        # a claim hands out a running sandbox, its layers mounted: the image id its shape needs is
        # read from the template's record, without looking each layer up in the store (a flock
        # and a utime per layer, 0.1 ms each, on the warm path); a tier without images: none
        image_id = resolve.image_id_for(engine, template, tenant) if images else ""
        if image_id is not None:
            shape = config.shape_key(tier, tmpl, limits, image_id)
            got = await claim(engine, pc, shape, t0, rec)
            if got is not None:
                return got
            pc = None  # a miss: the cold start below
    if image is None and images:  # off the event loop: the first sandbox on a fresh host builds the built-in image
        image = await asyncio.to_thread(resolve.image_for, engine, template, tenant)
    if pc is not None:
        shape = config.shape_key(tier, tmpl, limits, image.image_id if image is not None else "")
        got = await claim(engine, pc, shape, t0, rec)
        if got is not None:
            return got
    if engine.backend(tier).capabilities().snapshot_start:
        return await _start_from_template(engine, rec, tmpl, t0, resume_of, image, network=network)
    spec = LaunchSpec(dataclasses.replace(rec, template=tmpl.name), resume_of=resume_of, image=image, network=network)
    return await launch(engine, spec, Cold(tmpl))


async def _start_from_template(
    engine: Engine,
    rec: StartRecord,
    tmpl: Template,
    t0: float,
    resume_of: str = "",
    image: ImageRef | None = None,
    *,
    network: bool = False,
) -> Launched:
    """A tier whose cold start is too slow (microvm under TCG) restores every sandbox from
    its shape's template memory snapshot; the first create of a shape boots and saves it
    (stage ``template``, on that one create's path)."""
    tier, limits, tenant, env_pairs = rec.tier, rec.limits, rec.tenant, rec.envs
    backend = engine.backend(tier)
    # off the event loop: the first probe may boot a probe guest, the first template key
    # builds the tier's image (a minute, once per host)
    avail = await asyncio.to_thread(backend.probe)
    if not avail.available:
        raise BackendUnavailable(tier, avail.reason)
    if image is None:
        image = await asyncio.to_thread(resolve.image_for, engine, tmpl.name, tenant)
    shape = config.shape_key(tier, tmpl, limits, image.image_id)
    made = not engine.registry.meta.meta_text(
        await asyncio.to_thread(snapstore.template_key, engine, tier, shape, image)
    )
    m = await template_snapshot(engine, tier, tmpl, limits, shape, image)
    t1 = time.perf_counter()
    got = await restore_memory(
        engine,
        m,
        timeout=rec.timeout_s,
        tenant=tenant,
        resume_of=resume_of,
        volumes=rec.volumes,
        network=network,
        record=rec,
    )
    try:
        if env_pairs:
            await asyncio.wait_for(got.session.configure(dict(env_pairs), reset_counts=True), 30)
    except BaseException:
        await got.session.close()
        await teardown.destroy(engine, got.sandbox_id, "configuration after restore failed")
        raise
    if made and not resume_of:
        tt = StageTiming(got.sandbox_id, "template", (t1 - t0) * 1e3, True)
        engine.registry.sandboxes.add_timings([tt])
        got.timings.insert(0, tt)
    return got


async def create_pooled(engine: Engine, pc: PoolConfig) -> str:
    """Create and warm one sandbox for a pool (off any request path); returns its id."""
    tier, tmpl = backends.canonical_tier(pc.tier), resolve.template(engine, pc.template)
    backend = engine.backend(tier)
    image = await asyncio.to_thread(resolve.image_for, engine, pc.template) if backend.capabilities().images else None
    shape = config.shape_key(tier, tmpl, pc.limits, image.image_id if image is not None else "")
    if backend.capabilities().memory_snapshot:
        # restore a checkpoint of the warmed template instead of booting and warming again
        m = await template_snapshot(engine, tier, tmpl, pc.limits, shape, image)
        got = await restore_memory(engine, m, timeout=pc.max_age_s, pool=pc.name, shape=shape)
        try:
            # off any request path: under TCG a restored VM re-translates the code of its
            # first commands; running them now makes a claimed sandbox's first command fast
            if isinstance(backend, TemplateCapable):
                for argv in backend.template_warmup:
                    await got.session.exec(list(argv), timeout_s=600.0)
        except BaseException:
            await got.session.close()
            await teardown.destroy(engine, got.sandbox_id, "pool warm-up after restore failed")
            raise
    else:
        got = await launch(
            engine,
            LaunchSpec(StartRecord.internal(tier, tmpl.name, pc.max_age_s, pc.limits), pc.name, shape, image),
            Cold(tmpl),
        )
    await got.session.close()
    return got.sandbox_id


async def cleanup_failed(
    engine: Engine,
    sandbox_id: str,
    handle: BackendHandle,
    backend: Backend,
    why: BaseException,
    *,
    resumed: bool = False,
) -> None:
    """Tear down a start that failed (launch): the row stays ``creating`` (ours)
    meanwhile, so no reaper destroys it concurrently. A failed resume leaves the sandbox
    paused (its snapshot is untouched), to be resumed again."""
    try:
        await backend.destroy(handle)
    except Exception:
        # FAILED keeps its uid range, and the reaper retries the teardown
        engine.registry.sandboxes.set_state(
            sandbox_id, State.FAILED, f"start failed: {type(why).__name__}; teardown failed"
        )
        return
    if resumed:
        engine.registry.sandboxes.set_state(
            sandbox_id, State.PAUSED, f"resume failed: {type(why).__name__}; still paused"
        )
    else:
        engine.registry.sandboxes.set_state(
            sandbox_id, State.DESTROYED, f"start failed: {type(why).__name__}; cleaned up"
        )
    engine.registry.usage.finalize(sandbox_id)


# ---- memory snapshots started: restores and the shapes' template snapshots


async def restore_memory(
    engine: Engine,
    m: snaps.SnapshotManifest,
    *,
    timeout: float | None,
    pool: str = "",
    shape: str = "",
    tenant: Tenant | None = None,
    resume_of: str = "",
    volumes: tuple[VolumeMount, ...] | None = None,
    network: bool = False,
    record: StartRecord | None = None,
) -> Launched:
    """A new sandbox continuing a memory snapshot: same processes, memory, /tmp; /workspace restored.

    pool/shape: restore it into a warm pool (state ``pooled``) — a template snapshot's copy.
    tenant: whose the new sandbox is (quotas checked before anything is fetched, and at its insert).
    resume_of: the paused sandbox continued under its own id (instead of a new one).
    volumes: what it mounts (None: what the snapshot's sandbox mounted, as its processes expect).
    network: it gets an egress link (LaunchSpec.network). record: the caller's (LaunchSpec.record).
    """
    if volumes is None:
        volumes = volumes_mod.of_sandbox(engine, resume_of or m.sandbox_id)

    timeout_s = validate_timeout(engine.settings().defaults.timeout_s if timeout is None else timeout)
    with snapstore.Op(engine, "restore") as op:
        work = op.path
        ws_tar = work / "workspace.tar"
        limits = snapstore.limits_of(m)
        snapstore.check_fits(m, limits.disk_mb << 20)  # before anything is fetched
        snapstore.check_runtime(engine, m)
        if tenant is not None:
            engine.registry.tenants.check_quota(tenant, m.tier, limits)
        image = await asyncio.to_thread(snapstore.image_of, engine, m, tenant)  # gone: refused before the fetch
        store = snapstore.store_for(engine)
        snaps.get_blob(store, m.filesystem_sha256, m.filesystem_bytes, m.filesystem_raw_bytes, ws_tar, work)
        memory_dir = work
        snapshot_start = engine.backend(m.tier).capabilities().snapshot_start
        if snapshot_start:
            memory_dir = snapstore.cached_memory(engine, m, work)
        elif not snapstore.link_cached_memory(engine, m.snapshot_id, work / "checkpoint.img"):
            snaps.get_blob(store, m.memory_sha256, m.memory_bytes, m.memory_raw_bytes, work / "checkpoint.img", work)
        rec = StartRecord.internal(m.tier, m.template, timeout_s, limits, tenant)
        rec = dataclasses.replace(rec, volumes=volumes).recording(record)
        spec = LaunchSpec(rec, pool, shape, image, resume_of, network=network)
        got = await launch(engine, spec, Restore(m.snapshot_id, memory_dir, ws_tar))
        if resume_of and not snapshot_start:  # the paused sandbox runs again: its pause's image is not needed here
            shutil.rmtree(snapstore.memory_cache(engine) / m.snapshot_id, ignore_errors=True)
        return got


async def template_snapshot(
    engine: Engine, tier: str, tmpl: Template, limits: Limits, shape: str, image: ImageRef | None = None
) -> snaps.SnapshotManifest:
    """The memory snapshot of a warmed-up template sandbox (made once per shape, then reused).

    Pools of a tier with memory snapshots restore their sandboxes from it instead of booting
    and warming each one (under gVisor a cold Python + pandas start costs seconds). One maker
    per shape and home, across processes (an flock: a killed maker holds it no longer); the
    template sandbox of a maker that died is destroyed by the reaper (teardown.mark_template_vm).
    """
    lock = _template_locks.setdefault(shape, asyncio.Lock())
    async with lock:  # concurrent refills make one template, not one each
        fd = await _template_flock(engine, shape)
        try:
            return await _template_snapshot(engine, tier, tmpl, limits, shape, image)
        finally:
            os.close(fd)


_template_locks: dict[str, asyncio.Lock] = {}


async def _template_flock(engine: Engine, shape: str) -> int:
    """The shape's template lock (``templates/<hash>.lock`` in the home), waited for without
    blocking the event loop: another process may be making the same template."""

    d = engine.home / "templates"
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(
            d / f"{hashlib.sha256(shape.encode()).hexdigest()[:16]}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
    except OSError as e:
        raise snapstore.storage_error(e, "template lock") from None
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                await asyncio.sleep(0.1)
    except BaseException:
        os.close(fd)
        raise


async def _template_snapshot(
    engine: Engine, tier: str, tmpl: Template, limits: Limits, shape: str, image: ImageRef | None
) -> snaps.SnapshotManifest:
    store = snapstore.store_for(engine)
    if image is None:
        image = resolve.image_for(engine, tmpl.name)
    key = snapstore.template_key(engine, tier, shape, image)
    sid = engine.registry.meta.meta_text(key)
    if sid:
        try:
            return snaps.load_manifest(store, sid, snapstore.workdir(engine))
        except StorageError:
            pass  # gone or damaged: make a new one
    got = await launch(
        engine, LaunchSpec(StartRecord.internal(tier, tmpl.name, 3600.0, limits), image=image), Cold(tmpl)
    )
    info, session = got.info, got.session
    try:
        # from here until it is recorded as the template, a death of this process leaves a
        # READY sandbox nobody would end for an hour: marked, the reaper ends it at once
        teardown.mark_template_vm(engine, info.sandbox_id, key)
        # a tier's own warm-up before the image is taken (microvm: the files of the commands a
        # sandbox runs first are then in the guest's page cache, not read from its disk each time)
        backend = engine.backend(tier)
        for argv in backend.template_warmup if isinstance(backend, TemplateCapable) else ():
            code, err = await checkpoint.guest_exec(session, list(argv), info.sandbox_id)
            if code != 0:
                raise SandboxError(f"template warm-up {argv[0]} exited {code}: {err[-200:]}", info.sandbox_id)
        m = await checkpoint.pause(engine, info.sandbox_id, session, memory=True)
        engine.registry.meta.set_meta_text(key, m.snapshot_id)  # first: a death after it loses nothing
        engine.registry.sandboxes.set_state(
            info.sandbox_id, State.DESTROYED, f"became template snapshot {m.snapshot_id}"
        )
    except BaseException:
        await session.close()
        try:
            await teardown.destroy(engine, info.sandbox_id, "template snapshot failed")
        except WarmboxError:
            pass
        raise
    finally:
        try:
            teardown.unmark_template_vm(engine, info.sandbox_id)
        except (WarmboxError, OSError):
            pass  # the reaper unmarks it once it sees this process gone
    return m
