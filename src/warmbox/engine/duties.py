"""The lifecycle's duties: connecting to a live sandbox, its timeout, idle pauses, the retention of
paused sandboxes, and the reaper (the daemon runs these each tick; any process may)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from warmbox import config
from warmbox.backends.base import SharedHost
from warmbox.engine import checkpoint, egress, provision, snapstore, teardown
from warmbox.engine import snapshot as snapshots
from warmbox.engine.provision import Launched
from warmbox.errors import (
    GuestConnectionError,
    SandboxNotFound,
    SandboxPaused,
    SnapshotUnsupported,
    WarmboxError,
)
from warmbox.lifecycle import EXPIRED, LIVE, RESUMING, RETENTION_EXPIRED, Operation, gone
from warmbox.models import SandboxInfo, State
from warmbox.paths import owner_alive

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine

CREATE_DEADLINE_S = provision.WARMUP_TIMEOUT_S + 300.0


async def expire(engine: Engine, info: SandboxInfo) -> None:
    """A usable sandbox whose timeout ran out: paused (``Lifecycle(on_timeout="pause")``, if the
    pause works) or destroyed. Always raises: SandboxPaused, or SandboxNotFound saying it expired."""
    if info.lifecycle.on_timeout == "pause":
        try:
            await auto_pause(engine, info.sandbox_id, "its timeout ran out")
        except WarmboxError:
            pass  # the timeout is a hard limit: destroyed below
        else:
            raise engine.paused_error(info.sandbox_id)
    try:
        await teardown.destroy(engine, info.sandbox_id, EXPIRED)
    except SandboxNotFound:
        pass
    raise gone(info.sandbox_id, EXPIRED)


async def auto_pause(engine: Engine, sandbox_id: str, why: str) -> None:
    """Pause a sandbox no caller asked to pause (idle, or its timeout ran out): with its memory
    where the tier can, else (or if that is refused, e.g. sockets in /workspace) its files."""
    info, _ = engine.info(sandbox_id)
    parent = engine.registry.sandboxes.parent(sandbox_id)
    m = None
    if engine.backend(info.tier).capabilities().memory_snapshot:
        try:
            m = await checkpoint.pause(engine, sandbox_id, None, memory=True, parent=parent, why=why)
        except SnapshotUnsupported:
            pass
    if m is None:
        m = await checkpoint.pause(engine, sandbox_id, None, memory=False, parent=parent, why=why)
    # the sandbox resumes from this one: the earlier automatic ones are nobody's (their blobs
    # go at the next gc); snapshots the caller took or paused to are never touched
    engine.registry.snapshots.mark_auto(m.snapshot_id)
    for old in engine.registry.snapshots.auto_snapshots_of(sandbox_id):
        if old != m.snapshot_id:
            try:
                snapstore.delete(engine, old)
            except WarmboxError:
                pass


async def open(engine: Engine, sandbox_id: str) -> Launched:
    """Connect to a live sandbox by id (from any process)."""
    info, handle = engine.info(sandbox_id)
    if info.state is State.PAUSED:
        raise engine.paused_error(sandbox_id)
    engine.check(Operation.EXEC, info, handle)
    if info.expires_at <= time.time():
        await expire(engine, info)
    engine.ensure_daemon()  # a live sandbox has a reaper (one flock probe when it runs)
    try:
        session = await engine.connect(handle)
    except GuestConnectionError:
        # being paused by another process (the daemon's idle pause), or paused just now: its
        # runtime is gone because its state is in a snapshot, not because it died
        await snapstore.wait_pause(engine, sandbox_id)
        if engine.info(sandbox_id)[0].state is State.PAUSED:
            raise engine.paused_error(sandbox_id) from None
        if isinstance(engine.backend(info.tier), SharedHost):
            await teardown.lost_hosts(engine)  # its host process ended: lost (here, or by the reaper meanwhile)
            engine.check(Operation.EXEC, engine.info(sandbox_id)[0])  # SandboxLost if so
        if not await engine.backend(info.tier).alive(handle):
            await teardown.destroy(engine, sandbox_id, "found dead")
            raise SandboxNotFound(f"sandbox {sandbox_id} is no longer running", sandbox_id) from None
        raise
    return Launched(info, handle, session, engine.registry.sandboxes.timings(sandbox_id))


async def reap(engine: Engine) -> list[str]:
    """Destroy expired sandboxes, failed teardowns and creations whose creator died; first
    finish or undo snapshot operations whose process died (a pause after its checkpoint)."""
    await checkpoint.recover(engine)
    reaped = await lifecycle_duties(engine)
    now = time.time()
    reaped += await teardown.reap_template_vms(engine)
    orphans = {
        sid
        for sid, owner in engine.registry.sandboxes.creating_with_owner()
        if owner and not owner_alive(owner, engine.node)
    }
    for info, _ in engine.registry.sandboxes.list(include_pooled=True, local=True):
        if info.state in (State.CREATING, State.RETIRING) and info.sandbox_id not in orphans:
            # its creator lives and will finish or clean up; only a start stuck far beyond
            # any real one is taken away from it
            expired = now - info.created_at > CREATE_DEADLINE_S
        else:
            expired = info.state in LIVE and info.expires_at <= now
        if (
            expired
            and info.state in (State.READY, State.RUNNING)
            and info.lifecycle.on_timeout == "pause"
            and info.sandbox_id not in orphans
        ):
            try:
                await expire(engine, info)  # paused (or, if that fails, destroyed): it always raises
            except (SandboxPaused, SandboxNotFound):  # paused, or (its pause failed) destroyed
                reaped.append(info.sandbox_id)
            except Exception:
                pass
            continue
        if info.sandbox_id in orphans and engine.registry.sandboxes.ended_reason(info.sandbox_id) == RESUMING:
            try:  # a resume whose process died: paused again (its snapshot is untouched), not lost
                await teardown.unresume(engine, info.sandbox_id)
                reaped.append(info.sandbox_id)
            except Exception:
                pass
            continue
        if expired or info.state is State.FAILED or info.sandbox_id in orphans:
            why = (
                ("retirer process died" if info.state is State.RETIRING else "creator process died")
                if info.sandbox_id in orphans
                else "pool max_age reached"
                if info.state is State.POOLED
                else EXPIRED
            )
            try:
                if await teardown.destroy(engine, info.sandbox_id, why):
                    reaped.append(info.sandbox_id)
            except Exception:  # one bad sandbox must not stop the reaper; retried next round
                continue
    for sid, owner in engine.registry.sandboxes.paused_with_owner():  # a pause killed while releasing
        if owner and not owner_alive(owner, engine.node):
            info, handle = engine.registry.sandboxes.get(sid)
            try:
                if Path(handle.state_dir).exists():
                    await engine.backend(info.tier).destroy(handle)
                    reaped.append(sid)
                await egress.suspend(engine, sid)  # its link too (its policy kept for the resume)
                engine.registry.sandboxes.released(sid, owner)
            except Exception:
                continue
    for info, _ in engine.registry.sandboxes.holding():
        if info.state is State.FAILED and info.sandbox_id not in reaped:
            try:
                if await teardown.destroy(engine, info.sandbox_id, "teardown retried"):
                    reaped.append(info.sandbox_id)
            except Exception:
                continue
    await teardown.lost_hosts(engine)
    return reaped


def _retention(engine: Engine) -> float:
    try:
        return engine.settings().paused_retention_s
    except WarmboxError:  # a broken config must not stop the duties
        return config.PAUSED_RETENTION_S


async def _runs_processes(engine: Engine, sandbox_id: str) -> bool:
    """Whether background processes (commands.run(background=True), terminals) still run in
    the sandbox: they count as use, so an idle pause never ends a server or a shell."""
    try:
        got = await open(engine, sandbox_id)
    except WarmboxError:
        return False
    try:
        return bool(await got.session.processes())
    except WarmboxError:
        return False
    finally:
        await got.session.close()


async def lifecycle_duties(engine: Engine) -> list[str]:
    """Pause the sandboxes idle past their ``idle_pause_after``; delete the sandboxes paused
    longer than ``[lifecycle] paused_retention``, with their snapshots (a timeout with
    ``on_timeout="pause"`` is the reaper's: see ``expire``). Returns the ids acted on."""
    idle, expired = engine.registry.sandboxes.lifecycle_due(time.time(), _retention(engine))
    done = []
    for sid in idle:
        try:
            if await _runs_processes(engine, sid):  # a background process or terminal is use
                engine.registry.sandboxes.touch(sid, time.time())
                continue
            await auto_pause(engine, sid, "idle")
            done.append(sid)
        except Exception:  # tried again after another idle period
            try:
                engine.registry.sandboxes.touch(sid, time.time())
            except WarmboxError:
                pass
    for sid in expired:
        try:
            for snap in engine.registry.snapshots.snapshots_of(sid):
                snapstore.delete(engine, snap)
            if await teardown.destroy(engine, sid, RETENTION_EXPIRED):
                done.append(sid)
        except Exception:  # retried next round
            continue
    if expired:
        try:
            await snapshots.gc(engine)  # their blobs, unless another snapshot shares them
        except Exception:
            pass
    return done


def next_expiry(engine: Engine) -> float | None:
    """The next moment the daemon has work: a timeout, an idle pause, a paused sandbox's end."""
    found = [i.expires_at for i in engine.holding()]
    duty = engine.registry.sandboxes.next_lifecycle_deadline(_retention(engine))
    if duty is not None:
        found.append(duty)
    return min(found) if found else None
