"""Teardown: destroying sandboxes, and ending what this node holds that is no longer its own
(sandboxes whose host process died, a fenced node's runtime, template VMs whose creator died)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from warmbox import backends
from warmbox.backends.base import Inventory, SharedHost
from warmbox.engine import egress, meters, snapstore
from warmbox.errors import SandboxNotFound, WarmboxError
from warmbox.lifecycle import LIVE, Operation
from warmbox.models import BackendHandle, SandboxInfo, State
from warmbox.paths import owner_alive

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine

_SANDBOX_ID = re.compile(r"sb-[0-9a-f]{12}")
TEMPLATE_VMS_KEY = "template-vms"  # see mark_template_vm


async def destroy(engine: Engine, sandbox_id: str, reason: str = "killed") -> bool:
    """Destroy a sandbox; False if it was already gone. Leaves no process, mount, cgroup or dir."""
    info, handle = engine.info(sandbox_id)
    if info.state is State.DESTROYED:
        return False
    engine.check(Operation.DESTROY, info, None if info.state is State.LOST else handle)
    engine.command_log.flush()  # its records are written before it is seen to end
    if info.state is State.LOST or handle.node != engine.node:
        # lost: its runtime died with its node; another node's paused one: what its pause
        # left is on that node. Only its records end here; that node's reconcile removes the
        # rest (its link record stays for it: the link's address and name are that node's).
        # One lost here with its host process (SharedHost.tend_hosts) on this very node: what
        # is left of it here (its state dir) goes now, if marking it lost could not remove it.
        if info.state is State.LOST and handle.node == engine.node and Path(handle.state_dir).exists():
            backend = engine.backend(info.tier)
            if isinstance(backend, SharedHost):
                try:
                    await backend.destroy(handle)
                except WarmboxError:
                    pass  # best effort: its records end either way
        engine.registry.sandboxes.set_state(sandbox_id, State.DESTROYED, reason)
        engine.registry.usage.finalize(sandbox_id)
        if info.state is State.PAUSED:
            engine.registry.egress.set_egress(sandbox_id, "")  # the kept record of a paused one
        _forget_auto_snapshots(engine, info)
        return True
    if info.state is not State.PAUSED:
        await meters.read(engine, info, handle, None)  # last readings before the cgroup goes
    if info.state is not State.PAUSED or Path(handle.state_dir).exists():  # paused: leftovers only
        await engine.backend(info.tier).destroy(handle)
    await egress.release(engine, sandbox_id)
    engine.registry.sandboxes.set_state(sandbox_id, State.DESTROYED, reason)
    engine.registry.usage.finalize(sandbox_id)
    _forget_auto_snapshots(engine, info)
    return True


def _forget_auto_snapshots(engine: Engine, info: SandboxInfo) -> None:
    if info.lifecycle.pauses:  # what automatic pauses saved of it ends with it
        for snap in engine.registry.snapshots.auto_snapshots_of(info.sandbox_id):
            try:
                snapstore.delete(engine, snap)
            except WarmboxError:
                pass


async def lost_hosts(engine: Engine) -> list[str]:
    """Mark ``lost``, at once, the sandboxes whose host process ended under them (a tier with
    shared host processes: ``SharedHost.tend_hosts``, which also ends hosts idle for a while),
    and remove what is left of them here; returns their ids. Every reap runs it (the daemon:
    each tick), and so does a call that finds its sandbox's connection gone."""
    live: dict[str, list[BackendHandle]] = {}
    for info, handle in engine.registry.sandboxes.list(include_pooled=True, local=True):
        if info.state in (State.READY, State.RUNNING, State.POOLED):
            live.setdefault(info.tier, []).append(handle)
    lost: list[str] = []
    for tier in backends.TIERS:
        try:
            b = engine.backend(tier)
        except WarmboxError:
            continue
        if not isinstance(b, SharedHost):
            continue
        handles = live.get(tier, [])
        dead = await asyncio.to_thread(b.tend_hosts, handles)
        if not dead:
            continue
        changed = engine.registry.nodes.mark_lost(dead, f"the {tier} tier's host process that held it ended")
        for handle in handles:
            if handle.sandbox_id in changed:
                try:
                    await b.destroy(handle)  # its state dir; nothing of it runs any more
                except WarmboxError:
                    pass
        lost += changed
    return lost


# ---- cluster node


async def reconcile_node(engine: Engine) -> list[str]:
    """End what this home's runtime still holds that the registry does not give this node to
    run: a sandbox lost when the node was marked down, destroyed meanwhile, or handed to
    another node (a paused one resumed elsewhere); also the leftovers of a pause of this
    node's that its dead process did not release. Only local things go (processes, runtime
    records, state directory, network); the registry rows are left as they are. Called at a
    node's start, and when a heartbeat finds it fenced. Returns the ids ended."""
    sandboxes = engine.runtime / "sandboxes"
    found: dict[str, str] = {}  # sandbox id -> tier, "" until the row or a runtime says
    try:
        names = os.listdir(sandboxes)
    except FileNotFoundError:
        names = []
    for name in names:
        if _SANDBOX_ID.fullmatch(name):
            found.setdefault(name, "")
    for tier in backends.TIERS:
        try:
            b = engine.backend(tier)
        except WarmboxError:
            continue
        if isinstance(b, Inventory):
            for sid in b.held():
                found[sid] = tier
    ended: list[str] = []
    for sid, tier in sorted(found.items()):
        state_dir = sandboxes / sid
        uid_base = 0
        try:
            info, handle = engine.registry.sandboxes.get(sid)
        except SandboxNotFound:
            pass  # no row: this node's runtime alone knows it, and nobody can use it
        else:
            if not _reconcile_ends(engine, info, handle, state_dir):
                continue
            tier, uid_base = info.tier, handle.uid_base
        if not tier:
            continue  # a bare directory without a row: nothing says which tier removes it
        local = BackendHandle(
            sid, tier, sid, str(state_dir), str(state_dir / "run" / "agent.sock"), uid_base, engine.node
        )
        try:
            await engine.backend(tier).destroy(local)
            await egress.discard(engine, sid)
        except (WarmboxError, OSError):
            continue  # tried again at the next reconcile
        ended.append(sid)
    return ended


def _reconcile_ends(engine: Engine, info: SandboxInfo, handle: BackendHandle, state_dir: Path) -> bool:
    """Whether the reconcile ends this home's copy of a sandbox whose row is ``info``."""
    if handle.node == engine.node:
        if info.state in LIVE or info.state is State.FAILED:
            return False  # this node's: its own duties (the reaper) look after it
        if info.state is State.PAUSED:
            return not engine.registry.sandboxes.owner_of(info.sandbox_id)  # a pauser still releasing it: its job
        return True  # lost or destroyed
    if info.state in LIVE or info.state is State.FAILED or info.state is State.PAUSED:
        # Another node's now. Cgroups and named network namespaces are named by sandbox id
        # host-wide: when that node runs on this same host (its state directory is here, and is
        # not ours), ending our copy would end its sandbox too; its resume removes what it must.
        theirs = Path(handle.state_dir)
        if theirs != state_dir and theirs.exists():
            return False
    return True


async def node_heartbeat(engine: Engine, epoch: int) -> bool:
    """One heartbeat of this node (``[cluster] node``), joined under ``epoch``: its live and
    pooled counts go to the registry. False: the node is fenced (marked down, or joined again
    under a newer epoch): what it ran is no longer its own, so it is ended here at once
    (``reconcile_node``) and the node process must stop serving and exit."""
    live, pooled = engine.registry.nodes.local_counts()
    if engine.registry.nodes.heartbeat(engine.node, epoch, live, pooled):
        return True
    await reconcile_node(engine)
    return False


async def unresume(engine: Engine, sandbox_id: str) -> None:
    """Take back a resume whose process died: its runtime (if any) torn down, paused again."""
    info, handle = engine.info(sandbox_id)
    if Path(handle.state_dir).exists():
        await engine.backend(info.tier).destroy(handle)
    await egress.suspend(engine, sandbox_id)
    engine.registry.sandboxes.set_state(
        sandbox_id, State.PAUSED, "resumer process died; still paused", expected=State.CREATING
    )
    engine.registry.usage.finalize(sandbox_id)


# ---- template VMs in the making (snapshot.template_snapshot)
#
# A shape's template sandbox is no caller's: from the end of its start until it is paused
# into the template snapshot it is READY with a 1 h timeout, so neither the creating-orphan
# rule nor its timeout would end it soon if its creator died. Its creator marks it (meta
# ``template-vms``: {sandbox id: {"owner": creator's tag, "key": template key}}) and the
# reaper ends a marked sandbox whose creator is gone, adopting its snapshot as the shape's
# template if the pause got that far.


def _template_marks(engine: Engine, change: Callable[[dict], object] | None = None) -> dict[str, dict]:
    fd = os.open(engine.home / "template-vms.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for one read-modify-write of one row
        try:
            marks = json.loads(engine.registry.meta.meta_text(TEMPLATE_VMS_KEY) or "{}")
        except ValueError:
            marks = {}
        if not isinstance(marks, dict):
            marks = {}
        if change is not None:
            change(marks)
            engine.registry.meta.set_meta_text(TEMPLATE_VMS_KEY, json.dumps(marks))
        return marks
    finally:
        os.close(fd)


def mark_template_vm(engine: Engine, sandbox_id: str, key: str) -> None:
    """This process makes ``sandbox_id`` into the template ``key``: if it dies first, the
    reaper destroys the sandbox."""
    _template_marks(engine, lambda m: m.__setitem__(sandbox_id, {"owner": engine.owner, "key": key}))


def unmark_template_vm(engine: Engine, sandbox_id: str) -> None:
    _template_marks(engine, lambda m: m.pop(sandbox_id, None))


async def reap_template_vms(engine: Engine) -> list[str]:
    """Destroy the marked template VMs whose creator died (the reaper's part); their ids."""
    if not engine.registry.meta.meta_text(TEMPLATE_VMS_KEY).strip("{} "):
        return []  # nothing marked: no lock taken (the daemon looks every tick)
    reaped = []
    for sid, mark in _template_marks(engine).items():
        owner = mark.get("owner") if isinstance(mark, dict) else None
        if isinstance(owner, str) and owner and owner_alive(owner, engine.node):
            continue  # its creator is still at it
        try:
            info, handle = engine.registry.sandboxes.get(sid)
        except SandboxNotFound:
            unmark_template_vm(engine, sid)
            continue
        if (
            info.state in (State.READY, State.RUNNING)
            and _pause_pending(engine, sid)
            and not await engine.backend(info.tier).alive(handle)
        ):
            continue  # its memory is saved (nothing runs): recovery finishes the pause, then below
        why = "template creator died"
        if info.state is State.PAUSED:  # paused (by its creator, or by recovery) but not recorded
            key = mark.get("key")
            taken = engine.registry.snapshots.snapshots_of(sid)
            if taken and isinstance(key, str) and key.startswith("template:"):
                if not engine.registry.meta.meta_text(key):
                    engine.registry.meta.set_meta_text(key, taken[-1])
                if engine.registry.meta.meta_text(key) == taken[-1]:
                    why = f"became template snapshot {taken[-1]} (recorded after its creator died)"
        try:
            if await destroy(engine, sid, why):
                reaped.append(sid)
        except Exception:  # retried next round
            continue
        unmark_template_vm(engine, sid)
    return reaped


def _pause_pending(engine: Engine, sandbox_id: str) -> bool:
    """A pause of ``sandbox_id`` left its operation directory (snapshot.recover finishes it)."""
    for op in (engine.home / "tmp").glob(snapstore.OP_PREFIX + "pause-*"):
        try:
            rec = json.loads((op / "op.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("sandbox_id") == sandbox_id:
            return True
    return False
