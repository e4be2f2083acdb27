"""Restore, resume and fork: a snapshot started again as a sandbox (taking one: checkpoint.py;
where they are kept: snapstore.py; the start itself: provision.py), and the snapshots' gc.

A snapshot with memory continues its processes (provision.restore_memory); one of files only
starts a fresh sandbox of its template and unpacks the files into it, then loads the default
code context's saved globals.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from warmbox.engine import checkpoint, egress, provision, snapstore, teardown
from warmbox.engine import volumes as volumes_mod
from warmbox.engine.provision import Launched
from warmbox.engine.start import StartRecord
from warmbox.errors import InvalidArgument, SandboxError, SandboxNotFound, WarmboxError
from warmbox.lifecycle import Operation
from warmbox.models import Limits, StageTiming, State, Tenant
from warmbox.paths import owner_alive
from warmbox.storage import snapshots as snaps
from warmbox.storage.objects import LocalObjectStore

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine


def resolve(engine: Engine, ref: str) -> snaps.SnapshotManifest:
    """A snapshot id, or a paused sandbox's id (its latest snapshot) -> its verified manifest."""
    if not isinstance(ref, str) or not ref:
        raise InvalidArgument(f"expected a snapshot id or sandbox id, got {ref!r}")
    if ref.startswith("sb-"):
        ids = engine.registry.snapshots.snapshots_of(ref)
        if not ids:
            raise SandboxNotFound(f"sandbox {ref} has no snapshot", ref)
        ref = ids[-1]
    if not ref.startswith("snap-") or "/" in ref:
        raise InvalidArgument(f"{ref!r} is not a snapshot id (snap-…) or sandbox id (sb-…)")
    return snaps.load_manifest(snapstore.store_for(engine), ref, snapstore.workdir(engine))


async def restore(
    engine: Engine,
    m: snaps.SnapshotManifest,
    *,
    timeout: float | None,
    envs: dict[str, str] | None,
    pool: bool = True,
    tenant: Tenant | None = None,
    resume_of: str = "",
    network: bool = False,
    record: StartRecord | None = None,
) -> Launched:
    """A new running sandbox with the snapshot's files and context state.

    The artifact is fetched and verified first: a corrupt one raises before any sandbox exists.
    tenant: whose the new sandbox is (QuotaExceeded before anything is fetched or made).
    resume_of: a paused sandbox started again under its own id instead of a new sandbox (a
    failure leaves it paused).
    network: the caller links it after the start (provision.LaunchSpec.network).
    record: the caller's (provision.LaunchSpec.record), written with the new sandbox's row.
    """
    if m.memory:
        if envs:
            raise InvalidArgument("a memory snapshot continues its processes as they were: envs cannot change")
        return await provision.restore_memory(
            engine, m, timeout=timeout, tenant=tenant, resume_of=resume_of, network=network, record=record
        )
    op = snapstore.Op(engine, "restore")
    work = op.path
    raw = work / "files.tar"
    try:
        limits = snapstore.limits_of(m)
        snapstore.check_fits(m, (limits.disk_mb + 2 * limits.tmp_mb) << 20)  # /workspace, /tmp and /home/user
        if tenant is not None:
            engine.registry.tenants.check_quota(tenant, m.tier, limits)
        image = await asyncio.to_thread(snapstore.image_of, engine, m, tenant)  # gone: refused before the fetch
        snaps.get_blob(
            snapstore.store_for(engine), m.filesystem_sha256, m.filesystem_bytes, m.filesystem_raw_bytes, raw, work
        )
        got = await provision.create(
            engine,
            tier=m.tier,
            timeout=timeout,
            envs=envs,
            limits=limits,
            template=m.template,
            pool=pool,
            tenant=tenant,
            resume_of=resume_of,
            mounts=() if resume_of else volumes_mod.of_sandbox(engine, m.sandbox_id),  # a resume: its own
            image=image,
            egress_link=network,
            record=record,
        )
        info, session = got.info, got.session
        try:
            code, err = await checkpoint.guest_exec(
                session,
                ["/bin/tar", "-C", "/", "--numeric-owner", "--no-overwrite-dir", "-xpf", "-"],
                info.sandbox_id,
                source=raw,
            )
            if code != 0 and snapstore.disk_full(err):
                raise snapstore.too_big(m, limits, err[-300:], info.sandbox_id)
            if code != 0:
                raise SandboxError(f"restoring files: tar exited {code}: {err[-300:]}", info.sandbox_id)
            if m.context_saved:
                _, done = await checkpoint.run_code(session, checkpoint.LOAD, info.sandbox_id)
                if done.error is not None:
                    raise SandboxError(
                        f"restoring the code context: {done.error.name}: {done.error.value}", info.sandbox_id
                    )
            engine.registry.sandboxes.set_parent(info.sandbox_id, m.snapshot_id)
        except BaseException:
            await session.close()
            try:
                await _undo_start(engine, got, "restore failed", resumed=bool(resume_of))
            except WarmboxError:
                pass
            raise
        got.info, _ = engine.info(info.sandbox_id)
        return got
    finally:
        op.close()


async def _undo_start(engine: Engine, got: Launched, why: str, *, resumed: bool) -> None:
    """End a sandbox whose start went wrong after its launch: destroyed, or (a resume) its
    runtime torn down and the sandbox paused again, its snapshot untouched."""
    if not resumed:
        await teardown.destroy(engine, got.sandbox_id, why)
        return
    await engine.backend(got.info.tier).destroy(got.handle)
    await egress.suspend(engine, got.sandbox_id)
    engine.registry.sandboxes.set_state(got.sandbox_id, State.PAUSED, f"{why}; still paused")
    engine.registry.usage.finalize(got.sandbox_id)


async def resume(
    engine: Engine,
    ref: str,
    *,
    timeout: float | None,
    envs: dict[str, str] | None,
    tenant: Tenant | None = None,
    secrets: object = None,
) -> Launched:
    """A paused sandbox (its id) running again under the same id, or a fork of a snapshot (its
    id) as a new sandbox (:func:`fork`). tenant: whose the running sandbox is (a paused sandbox
    holds nothing: the resumed one is what counts against quotas).

    A resumed sandbox keeps the lifetime it was created with (``timeout`` None) and its egress
    policy (a link of its own again); ``secrets`` gives the values of the secrets it had (env
    name -> str or warmbox.Secret: never stored), SecretsRequired naming those missing before
    anything is done. Its stage timings gain ``resume`` (ms, the whole resume).
    """
    if not (isinstance(ref, str) and ref.startswith("sb-")):
        m = resolve(engine, ref)
        if not _pause_of_paused(engine, m):
            return await fork(engine, m, timeout=timeout, envs=envs, tenant=tenant, secrets=secrets)
        ref = m.sandbox_id  # the snapshot pause() handed out: continue that sandbox, under its id
    t0 = time.perf_counter()
    info, _ = engine.info(ref)
    if info.state is not State.PAUSED:
        engine.check(Operation.RESUME, info)
    record = egress.paused_record(engine, ref)
    secret_map = egress.secrets_for(record, secrets, ref, f"sandbox {ref}")
    m = resolve(engine, ref)
    if timeout is None:
        timeout = engine.registry.sandboxes.timeout_of(ref) or None
    await _released(engine, ref)
    got = await restore(engine, m, timeout=timeout, envs=envs, tenant=tenant, resume_of=ref)
    try:
        if record is not None:
            await egress.reestablish(engine, got.handle, got.session, record, secret_map)
    except BaseException:
        await got.session.close()
        try:
            await _undo_start(engine, got, "network setup after resume failed", resumed=True)
        except WarmboxError:
            pass
        raise
    engine.registry.sandboxes.add_timings([StageTiming(ref, "resume", (time.perf_counter() - t0) * 1e3, True)])
    got.timings = engine.registry.sandboxes.timings(ref)
    got.info, _ = engine.info(ref)
    return got


async def fork(
    engine: Engine,
    m: snaps.SnapshotManifest,
    *,
    timeout: float | None,
    envs: dict[str, str] | None,
    pool: bool = True,
    tenant: Tenant | None = None,
    secrets: object = None,
    record: StartRecord | None = None,
) -> Launched:
    """A new sandbox from snapshot ``m`` (:func:`restore`) with the snapshot's egress policy on a
    link, address and audit log of its own; its secrets keep their placeholders and get the
    values in ``secrets`` (SecretsRequired naming those missing, before anything is made) and a
    new CA. The origin is untouched. record: the caller's (provision.LaunchSpec.record)."""
    net = egress.EgressRecord.from_json(m.network)
    secret_map = egress.secrets_for(net, secrets, m.sandbox_id, f"snapshot {m.snapshot_id}")
    if net is not None:
        egress.check_tier(engine, m.tier, net.policy_of())
    got = await restore(
        engine, m, timeout=timeout, envs=envs, pool=pool, tenant=tenant, network=net is not None, record=record
    )
    if net is not None:
        try:
            got.timings.append(await egress.reestablish(engine, got.handle, got.session, net, secret_map))
        except BaseException:
            await got.session.close()
            await teardown.destroy(engine, got.sandbox_id, "network setup of the fork failed")
            raise
    return got


def start_of(engine: Engine, ref: str) -> tuple[str, str, str, Limits]:
    """What ``resume(ref)`` would start, before it does: ("resume", sandbox_id, tier, limits) for a
    paused sandbox continued under its id, ("create", snapshot_id, tier, limits) for a fork."""
    if isinstance(ref, str) and ref.startswith("sb-"):
        info, _ = engine.info(ref)
        return "resume", ref, info.tier, engine.registry.sandboxes.limits(ref)
    m = resolve(engine, ref)
    if _pause_of_paused(engine, m):
        return "resume", m.sandbox_id, m.tier, snapstore.limits_of(m)
    return "create", m.snapshot_id, m.tier, snapstore.limits_of(m)


def _pause_of_paused(engine: Engine, m: snaps.SnapshotManifest) -> bool:
    """Whether ``m`` is the latest snapshot of a sandbox that is paused: the one its pause made,
    so resuming it continues that sandbox (a fork would leave it paused until its retention)."""
    try:
        info, _ = engine.info(m.sandbox_id)
    except WarmboxError:
        return False
    return info.state is State.PAUSED and engine.registry.snapshots.snapshots_of(m.sandbox_id)[-1:] == [m.snapshot_id]


RELEASE_WAIT_S = 60.0


async def _released(engine: Engine, sandbox_id: str) -> None:
    """Wait until the pause of ``sandbox_id`` has released everything (it records ``paused``
    first, then tears the runtime and its link down: a resume must not start under it). A pauser
    that died meanwhile, or one slower than RELEASE_WAIT_S, leaves leftovers the resume removes."""
    deadline = time.monotonic() + RELEASE_WAIT_S
    while time.monotonic() < deadline:
        owner = engine.registry.sandboxes.owner_of(sandbox_id)
        if (
            not owner
            or not owner_alive(owner, engine.node)
            or (owner == engine.owner and sandbox_id not in checkpoint.releasing)
        ):
            return  # released, its pauser is gone, or this process's release ended (a failed one)
        if engine.info(sandbox_id)[0].state is not State.PAUSED:
            return  # resumed or ended meanwhile: the resume's own checks say so
        await asyncio.sleep(0.02)


async def gc(engine: Engine, grace_s: float | None = None) -> tuple[int, list[str]]:
    """Recover dead operations (see ``recover``), then delete unreferenced blobs and caches."""
    store = snapstore.store_for(engine)
    if isinstance(store, LocalObjectStore):
        store.clean_partial()
    await checkpoint.recover(engine)
    got = snaps.gc(store, snapstore.workdir(engine), snaps.GC_GRACE_S if grace_s is None else grace_s)
    import shutil

    cache = snapstore.memory_cache(engine)
    if cache.is_dir():  # unpacked memory images of snapshots that no longer exist
        for d in cache.iterdir():
            if d.name.startswith("snap-") and not store.exists(snaps.manifest_key(d.name)):
                shutil.rmtree(d, ignore_errors=True)
    return got


__all__ = ["resolve", "restore", "resume", "fork", "gc"]
