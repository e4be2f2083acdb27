"""SandboxStore: the sandboxes, their transitions and stage timings, and their uid slots."""

from __future__ import annotations

import builtins
import dataclasses
import functools
import json
import time
import typing

from warmbox.errors import InvalidArgument, RegistryError, SandboxNotFound, SandboxStateError
from warmbox.lifecycle import LIVE, RESUMING, check_transition
from warmbox.models import (
    BackendHandle,
    Lifecycle,
    Limits,
    Requirements,
    SandboxInfo,
    StageTiming,
    State,
    Tenant,
    TierChoice,
    Transition,
)
from warmbox.storage.registry.common import (
    _COLUMNS,
    _HOLDING,
    _LIVE,
    _in,
    _node_name,
    _strings,
    _tenant_lock,
    unknown_sandbox,
)
from warmbox.storage.registry.db import Database, Store, _retried
from warmbox.storage.uidslots import UID_BASE, UID_RANGE

if typing.TYPE_CHECKING:
    from warmbox.storage.registry.tenants import TenantStore
    from warmbox.storage.registry.volumes import Mounts, VolumeStore

# what `warmbox ls` shows: the caller's sandboxes, running or paused (not the pools')
_USER = (*(s.value for s in LIVE if s not in (State.POOLED, State.RETIRING)), State.PAUSED.value)


# what counts against a tenant's quotas: sandboxes holding (or about to hold) memory and CPU. A
# paused one has released its runtime (it is a snapshot until resumed, and the resume counts).
# a paused sandbox this node looks after (its retention): its own, and those of nodes marked down
_PAUSED_HERE = "(node=? OR node IN (SELECT name FROM nodes WHERE state='down'))"


class NewSandbox(typing.Protocol):
    """What a start records about a new sandbox besides its shape (engine.start.StartRecord): read by
    allocate and a pool claim, written in the transaction that makes the sandbox count. Secret
    values are not among these: they never reach the registry."""

    @property
    def metadata(self) -> typing.Mapping[str, str]: ...
    @property
    def lifecycle(self) -> Lifecycle: ...
    @property
    def requirements(self) -> Requirements | None: ...  # tier="auto": what was asked ...
    @property
    def choice(self) -> TierChoice | None: ...  # ... and why this tier


# the columns start_values fills, in its order
START_COLUMNS = (
    "metadata",
    "on_timeout",
    "idle_pause_after",
    "auto_resume",
    "requirements",
    "tier_reasons",
    "tier_rejected",
)


def start_values(start: NewSandbox | None) -> tuple[object, ...]:
    """The row's START_COLUMNS for ``start`` (None: the columns' defaults)."""
    if start is None:
        return ("{}", "kill", 0.0, 0, "", "[]", "{}")
    lc, req, choice = start.lifecycle, start.requirements, start.choice
    picked = req is not None and choice is not None
    return (
        json.dumps(dict(start.metadata), sort_keys=True, ensure_ascii=False),
        lc.on_timeout,
        lc.idle_pause_after or 0.0,
        int(lc.auto_resume),
        json.dumps(dataclasses.asdict(req), sort_keys=True) if picked and req is not None else "",
        json.dumps(list(choice.reasons), ensure_ascii=False) if picked and choice is not None else "[]",
        json.dumps(choice.rejected, sort_keys=True, ensure_ascii=False) if picked and choice is not None else "{}",
    )


def _requirements(text: str) -> Requirements | None:
    """A row's Requirements (JSON of the start's record; "" or anything unreadable: None)."""
    try:
        v = json.loads(text) if text else None
        return Requirements(**v) if isinstance(v, dict) else None
    except (ValueError, TypeError, InvalidArgument):
        return None


def _metadata(text: str) -> dict[str, str]:
    """A row's metadata (JSON written by allocate or a pool claim; anything else reads as none)."""
    try:
        v = json.loads(text or "{}")
    except ValueError:
        return {}
    if not isinstance(v, dict):
        return {}
    return {k: x for k, x in v.items() if isinstance(k, str) and isinstance(x, str)}


_TIMING_COLUMNS = ("sandbox_id", "stage", "duration_ms", "on_path")


def sandbox_row(r: tuple) -> tuple[SandboxInfo, BackendHandle]:
    """A sandboxes row (its columns as _COLUMNS lists them) as the info and handle it records."""
    (
        sid,
        tier,
        template,
        state,
        created,
        expires,
        mem,
        cpus,
        pids,
        slot,
        runtime_id,
        state_dir,
        socket_path,
        pool,
        claimed_at,
        parent,
        metadata,
        on_timeout,
        idle_pause_after,
        auto_resume,
        template_version,
        image_id,
        requirements,
        tier_reasons,
        tier_rejected,
        tenant,
        node,
    ) = r
    info = SandboxInfo(
        sandbox_id=sid,
        tier=tier,
        state=State(state),
        created_at=created,
        expires_at=expires,
        memory_mb=mem,
        cpus=cpus,
        pids=pids,
        template=template,
        pool=pool,
        claimed_at=claimed_at,
        parent_snapshot=parent or "",
        metadata=_metadata(metadata),
        lifecycle=Lifecycle(
            on_timeout="pause" if on_timeout == "pause" else "kill",
            idle_pause_after=idle_pause_after if idle_pause_after and idle_pause_after > 0 else None,
            auto_resume=bool(auto_resume),
        ),
        template_version=template_version or 0,
        image_id=image_id or "",
        requirements=_requirements(requirements),
        tier_reasons=_strings(tier_reasons),
        tier_rejected=_metadata(tier_rejected),
        tenant=tenant or "",
    )
    handle = BackendHandle(
        sandbox_id=sid,
        tier=tier,
        runtime_id=runtime_id,
        state_dir=state_dir,
        socket_path=socket_path,
        uid_base=UID_BASE + slot * UID_RANGE,
        node=node,
    )
    return info, handle


class SandboxStore(Store):
    """The sandboxes, their transitions and stage timings, and their uid slots."""

    def __init__(self, base: Database, tenants: TenantStore, volumes: VolumeStore) -> None:
        super().__init__(base)
        self._tenants = tenants  # quotas are checked in the transaction that inserts the row
        self._volumes = volumes  # and volume mounts written there (VolumeStore.mount_in)

    @_retried
    def allocate(
        self,
        sandbox_id: str,
        tier: str,
        template: str,
        timeout_s: float,
        limits: Limits,
        state_dir: str,
        socket_path: str,
        *,
        pool: str = "",
        owner: str = "",
        shape: str = "",
        tenant: Tenant | None = None,
        template_version: int = 0,
        image_id: str = "",
        start: NewSandbox | None = None,
        mounts: Mounts = (),
        exclusive_mounts: bool = False,
    ) -> int:
        """Insert a sandbox in state ``creating`` with a uid slot free on the whole host; returns the slot.

        start: what the start records besides the shape (metadata, lifecycle, the tier's choice),
        in the same row and transaction: a refused or failed insert leaves none of it.
        mounts, exclusive_mounts: the volumes it mounts, recorded in the same transaction
        (VolumeStore.mount_volumes: VolumeNotFound, VolumeInUse leave no row and no slot).

        The slot is claimed in the host-wide ledger (no other home's sandbox can have it) and
        released when the sandbox is destroyed. Limits are checked (check_limits) first.
        tenant: whose it is; its quotas are checked in the transaction that inserts the row
        (QuotaExceeded: no row, no slot).
        """
        if self.check_limits is not None:
            self.check_limits(limits)
        now = time.time()
        with self._base.claiming(*_tenant_lock(tenant)) as (ledger, db):
            if tenant is not None:
                self._tenants.check_quota_in(db, tenant, tier, limits.memory_mb, limits.cpus)
            held = db.execute(
                f"SELECT uid_slot, state FROM sandboxes WHERE state IN {_in(_HOLDING)} AND node=?",
                (*_HOLDING, self.node),
            ).fetchall()
            self._base.check_slots([r[1] for r in held], spare=bool(pool))
            used = {r[0] for r in held}
            slot = ledger.claim(
                self._key, sandbox_id, skip=used, check=functools.partial(self._base.holds, db=db), state_dir=state_dir
            )
            try:
                db.execute(
                    "INSERT INTO sandboxes (sandbox_id, tier, template, state, created_at, expires_at, "
                    "memory_mb, cpus, pids, uid_slot, runtime_id, state_dir, socket_path, pool, owner, shape, "
                    "file_size_mb, open_files, tmp_mb, disk_mb, tenant, timeout_s, last_used, template_version, "
                    f"image_id, node, {', '.join(START_COLUMNS)}) "
                    f"VALUES ({','.join('?' * (26 + len(START_COLUMNS)))})",
                    (
                        sandbox_id,
                        tier,
                        template,
                        State.CREATING.value,
                        now,
                        now + timeout_s,
                        limits.memory_mb,
                        limits.cpus,
                        limits.pids,
                        slot,
                        sandbox_id,
                        state_dir,
                        socket_path,
                        pool,
                        owner,
                        shape,
                        limits.file_size_mb,
                        limits.open_files,
                        limits.tmp_mb,
                        limits.disk_mb,
                        tenant.name if tenant is not None else "",
                        timeout_s,
                        now,
                        template_version,
                        image_id,
                        self.node,
                        *start_values(start),
                    ),
                )
                if mounts:
                    self._volumes.mount_in(db, sandbox_id, mounts, exclusive=exclusive_mounts)
                db.execute(
                    "INSERT INTO transitions VALUES (?,?,?,?,?)",
                    (sandbox_id, now, "", State.CREATING.value, "create" + (f" for pool {pool}" if pool else "")),
                )
                db.execute("INSERT INTO meters (sandbox_id, sampled_at) VALUES (?,?)", (sandbox_id, now))
            except BaseException:
                ledger.release(slot, self._key, sandbox_id)
                raise
        return slot

    @_retried
    def reallocate(
        self,
        sandbox_id: str,
        timeout_s: float,
        limits: Limits,
        *,
        owner: str = "",
        tenant: Tenant | None = None,
        state_dir: str | None = None,
        socket_path: str | None = None,
        mounts: Mounts = (),
        exclusive_mounts: bool = False,
    ) -> int:
        """Take a paused sandbox back to ``creating`` under its own id (a resume): a uid slot free
        on the whole host, a new deadline, its meters open again; returns the slot. It becomes
        this registry's node's (a sandbox paused on one node resumes on any), with the state
        directory and agent socket given (the resuming node's; None: the ones it had).

        Exactly one caller wins (SandboxStateError for the others: it is no longer paused).
        limits: the snapshot's, checked (check_limits) first, as at an allocate: maxima lowered
        since the pause refuse it. tenant: the resumer's; quotas are checked in the same
        transaction (a paused sandbox holds nothing, the resumed one counts). mounts,
        exclusive_mounts: as at an allocate.
        """
        if self.check_limits is not None:
            self.check_limits(limits)
        now = time.time()
        with self._base.claiming(*_tenant_lock(tenant)) as (ledger, db):
            row = db.execute(
                "SELECT state, tier, memory_mb, cpus, uid_slot, state_dir FROM sandboxes WHERE sandbox_id=?"
                + self._sql.for_update(),
                (sandbox_id,),
            ).fetchone()
            if row is None:
                raise unknown_sandbox(sandbox_id)
            if row[0] != State.PAUSED.value:
                raise SandboxStateError(f"sandbox {sandbox_id} is {row[0]}, not paused", sandbox_id)
            if tenant is not None:
                self._tenants.check_quota_in(db, tenant, row[1], row[2], row[3])
            ledger.release(row[4], self._key, sandbox_id)  # its old range (released by its pause)
            held = db.execute(
                f"SELECT uid_slot, state FROM sandboxes WHERE state IN {_in(_HOLDING)} AND node=?",
                (*_HOLDING, self.node),
            ).fetchall()
            self._base.check_slots([r[1] for r in held], spare=False)
            used = {r[0] for r in held}
            slot = ledger.claim(
                self._key,
                sandbox_id,
                skip=used,
                check=functools.partial(self._base.holds, db=db),
                state_dir=row[5] if state_dir is None else state_dir,
            )
            try:
                db.execute(
                    "UPDATE sandboxes SET state=?, uid_slot=?, expires_at=?, owner=?, ended_at=0, "
                    "timeout_s=?, last_used=?, node=? WHERE sandbox_id=?",
                    (State.CREATING.value, slot, now + timeout_s, owner, timeout_s, now, self.node, sandbox_id),
                )
                if state_dir is not None or socket_path is not None:
                    db.execute(
                        "UPDATE sandboxes SET state_dir=COALESCE(?, state_dir), socket_path=COALESCE(?, socket_path) "
                        "WHERE sandbox_id=?",
                        (state_dir, socket_path, sandbox_id),
                    )
                db.execute(
                    "INSERT INTO transitions VALUES (?,?,?,?,?)",
                    (sandbox_id, now, State.PAUSED.value, State.CREATING.value, RESUMING),
                )
                # the meters go on: a new runtime's CPU counter starts at 0 again
                db.execute(
                    "UPDATE meters SET final=0, memory_bytes=0, sampled_at=?, "
                    "base_cpu_ns=base_cpu_ns-cpu_ns, cpu_ns=0 WHERE sandbox_id=?",
                    (now, sandbox_id),
                )
                if mounts:  # what it mounts now (its record replaced): refused, it stays paused
                    self._volumes.mount_in(db, sandbox_id, mounts, exclusive=exclusive_mounts)
            except BaseException:
                ledger.release(slot, self._key, sandbox_id)
                raise
        return slot

    @_retried
    def touch(self, sandbox_id: str, until: float) -> None:
        """The sandbox is used until ``until`` (unix seconds): its idle time counts from then."""
        with self._tx() as db:
            db.execute("UPDATE sandboxes SET last_used=? WHERE sandbox_id=?", (until, sandbox_id))

    def lifecycle_due(self, now: float, retention_s: float) -> tuple[builtins.list[str], builtins.list[str]]:
        """What the lifecycle duties owe now: ([sandbox_id] idle past their idle_pause_after, to
        pause; [sandbox_id] paused longer than ``retention_s``, to delete). Timeouts are the reaper's."""
        usable = (State.READY.value, State.RUNNING.value)
        rows = self._read(
            f"SELECT sandbox_id FROM sandboxes WHERE state IN {_in(usable)} AND idle_pause_after>0 "
            "AND last_used+idle_pause_after<=? AND expires_at>? AND node=? ORDER BY created_at",
            (*usable, now, now, self.node),
            many=True,
        )
        old = self._read(
            f"SELECT sandbox_id FROM sandboxes WHERE state=? AND ended_at>0 AND ended_at+?<=? AND {_PAUSED_HERE} "
            "ORDER BY ended_at",
            (State.PAUSED.value, retention_s, now, self.node),
            many=True,
        )
        return [r[0] for r in rows], [r[0] for r in old]

    def next_lifecycle_deadline(self, retention_s: float) -> float | None:
        """The earliest moment a lifecycle duty falls due (an idle pause, a paused sandbox's end)."""
        usable = (State.READY.value, State.RUNNING.value)
        idle = self._read(
            "SELECT MIN(last_used+idle_pause_after) FROM sandboxes "
            f"WHERE state IN {_in(usable)} AND idle_pause_after>0 AND node=?",
            (*usable, self.node),
        )
        paused = self._read(
            f"SELECT MIN(ended_at+?) FROM sandboxes WHERE state=? AND ended_at>0 AND {_PAUSED_HERE}",
            (retention_s, State.PAUSED.value, self.node),
        )
        found = [v for v in (idle[0] if idle else None, paused[0] if paused else None) if v is not None]
        return min(found) if found else None

    def owner_of(self, sandbox_id: str) -> str:
        """The tag of the process working on a sandbox ("" when none: a paused one is released)."""
        row = self._read("SELECT owner FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
        return row[0] if row else ""

    @_retried
    def released(self, sandbox_id: str, owner: str) -> None:
        """The pause ``owner`` recorded has released everything: a resume may begin."""
        with self._tx() as db:
            db.execute(
                "UPDATE sandboxes SET owner='' WHERE sandbox_id=? AND state=? AND owner=?",
                (sandbox_id, State.PAUSED.value, owner),
            )

    def timeout_of(self, sandbox_id: str) -> float:
        """The lifetime a sandbox was last given (at its start, its claim from a pool, a set_timeout or
        a resume given one); 0: unknown, a row from before version 7."""
        row = self._read("SELECT timeout_s FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
        return float(row[0]) if row else 0.0

    def ended_reason(self, sandbox_id: str) -> str:
        """The reason of a sandbox's last transition (why a destroyed one ended)."""
        row = self._read("SELECT reason FROM transitions WHERE sandbox_id=? ORDER BY rowid DESC LIMIT 1", (sandbox_id,))
        return row[0] if row else ""

    def _release(self, sandbox_id: str, slot: int) -> None:
        try:
            with self.ledger.locked() as ledger:
                ledger.release(slot, self._key, sandbox_id)
        except OSError:
            pass  # left for a reclaim: the registry says it no longer holds the slot

    @_retried
    def set_state(
        self, sandbox_id: str, new: State, reason: str, *, expected: State | None = None, owner: str | None = None
    ) -> State:
        """Record a transition; returns the previous state. Illegal transitions raise.

        expected: only move if the current state is this one (else SandboxStateError).
        """
        with self._tx() as db:
            row = db.execute(
                "SELECT state, uid_slot FROM sandboxes WHERE sandbox_id=?" + self._sql.for_update(), (sandbox_id,)
            ).fetchone()
            if row is None:
                raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox_id)
            old = State(row[0])
            if expected is not None and old is not expected:
                raise SandboxStateError(f"sandbox {sandbox_id} is {old.value}, not {expected.value}", sandbox_id)
            if old is new:
                return old
            check_transition(old, new, sandbox_id)
            now = time.time()
            db.execute(
                "UPDATE sandboxes SET state=?, ended_at=? WHERE sandbox_id=?",
                (new.value, now if new in (State.DESTROYED, State.PAUSED) else 0, sandbox_id),
            )
            if owner is not None:
                db.execute("UPDATE sandboxes SET owner=? WHERE sandbox_id=?", (owner, sandbox_id))
            db.execute("INSERT INTO transitions VALUES (?,?,?,?,?)", (sandbox_id, now, old.value, new.value, reason))
            if new in (State.DESTROYED, State.FAILED):  # a sandbox's command keys end with it (a create's stay)
                db.execute("DELETE FROM idempotency_keys WHERE scope=?", (sandbox_id,))
        if new is State.DESTROYED:  # committed: its uid range is free for any home
            self._release(sandbox_id, row[1])
        return old

    @_retried
    def set_expiry(self, sandbox_id: str, expires_at: float, timeout_s: float | None = None) -> None:
        """A new deadline; ``timeout_s``: also the lifetime a resume gives it from now on."""
        with self._tx() as db:
            if timeout_s is None:
                db.execute("UPDATE sandboxes SET expires_at=? WHERE sandbox_id=?", (expires_at, sandbox_id))
            else:
                db.execute(
                    "UPDATE sandboxes SET expires_at=?, timeout_s=? WHERE sandbox_id=?",
                    (expires_at, timeout_s, sandbox_id),
                )

    def get(self, sandbox_id: str) -> tuple[SandboxInfo, BackendHandle]:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM sandboxes WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        if row is None:
            raise unknown_sandbox(sandbox_id)
        return sandbox_row(row)

    def sandbox_tenant(self, sandbox_id: str) -> str | None:
        """The tenant a sandbox belongs to ("": the host's, or a pool's until claimed); None if unknown."""
        row = self._read("SELECT tenant FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
        return None if row is None else row[0]

    # From here on `list` in the class body is this method: later signatures spell builtins.list.
    def list(
        self,
        include_dead: bool = False,
        *,
        include_pooled: bool = False,
        tenant: str | None = None,
        states: tuple[State, ...] | None = None,
        metadata: dict[str, str] | None = None,
        local: bool = False,
    ) -> list[tuple[SandboxInfo, BackendHandle]]:
        """tenant: only that tenant's sandboxes (None: everyone's). states: only these (instead of
        the live ones, or all with include_dead). metadata: only those whose metadata holds every
        one of these pairs. local: only this node's (else every node's)."""
        where: builtins.list[str] = []
        args: builtins.list[object] = []
        if local:
            where.append("node=?")
            args.append(self.node)
        if states is not None:
            values = tuple(s.value for s in states)
            where.append(f"state IN {_in(values)}" if values else "1=0")
            args.extend(values)
        elif not include_dead:
            live = _LIVE if include_pooled else _USER
            where.append(f"state IN {_in(live)}")
            args.extend(live)
        if tenant is not None:
            where.append("tenant=?")
            args.append(tenant)
        q = f"SELECT {_COLUMNS} FROM sandboxes" + (" WHERE " + " AND ".join(where) if where else "")
        rows = self._db.execute(q + " ORDER BY created_at", args).fetchall()
        out = [sandbox_row(r) for r in rows]
        if metadata:
            want = metadata.items()
            out = [(i, h) for i, h in out if want <= i.metadata.items()]
        return out

    def holding(self) -> builtins.list[tuple[SandboxInfo, BackendHandle]]:
        """This node's live sandboxes (pooled too) plus failed ones whose teardown is still owed."""
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM sandboxes WHERE state IN {_in(_HOLDING)} AND node=? ORDER BY created_at",
            (*_HOLDING, self.node),
        ).fetchall()
        return [sandbox_row(r) for r in rows]

    def paused_with_owner(self) -> builtins.list[tuple[str, str]]:
        """This node's paused sandboxes, with the tag of the process still releasing each ("": none)."""
        rows = self._read(
            "SELECT sandbox_id, owner FROM sandboxes WHERE state=? AND node=?",
            (State.PAUSED.value, self.node),
            many=True,
        )
        return [(r[0], r[1]) for r in rows]

    def creating_with_owner(self) -> builtins.list[tuple[str, str]]:
        """This node's sandboxes some process is creating or retiring right now, with that process's tag."""
        rows = self._db.execute(
            "SELECT sandbox_id, owner FROM sandboxes WHERE state IN (?,?) AND node=?",
            (State.CREATING.value, State.RETIRING.value, self.node),
        ).fetchall()
        return [(r[0], r[1]) for r in rows]

    def limits(self, sandbox_id: str) -> Limits:
        row = self._read(
            "SELECT memory_mb, cpus, pids, file_size_mb, open_files, tmp_mb, disk_mb FROM sandboxes WHERE sandbox_id=?",
            (sandbox_id,),
        )
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox_id)
        return Limits(*row)

    @_retried
    def claim_host_slot(self, holder: str) -> int:
        """A uid slot of the host-wide ledger for a process of this home that is no sandbox (the
        isolate tier's host of one tenant), recorded as ``holder``'s; returns the slot. While its
        process runs no one reclaims it (a process in its range); released by release_host_slot."""
        with self._base.claiming() as (ledger, db):
            used = {
                r[0]
                for r in db.execute(
                    f"SELECT uid_slot FROM sandboxes WHERE state IN {_in(_HOLDING)} AND node=?", (*_HOLDING, self.node)
                )
            }
            return ledger.claim(self._key, holder, skip=used, check=functools.partial(self._base.holds, db=db))

    def release_host_slot(self, holder: str, slot: int) -> None:
        """Give back a slot claim_host_slot took, if the ledger still records it as ``holder``'s."""
        try:
            with self.ledger.locked() as ledger:
                ledger.release(slot, self._key, holder)
        except OSError as e:
            raise RegistryError(f"cannot release a uid range in {self.ledger.dir}: {e}") from None

    @_retried
    def move(self, sandbox_id: str, node: str) -> None:
        """Give a paused sandbox to ``node`` (the one resuming it). SandboxStateError if it is
        not paused: a running sandbox's processes cannot move."""
        _node_name(node, empty=True)
        with self._tx() as db:
            row = db.execute(
                "SELECT state FROM sandboxes WHERE sandbox_id=?" + self._sql.for_update(), (sandbox_id,)
            ).fetchone()
            if row is None:
                raise unknown_sandbox(sandbox_id)
            if row[0] != State.PAUSED.value:
                raise SandboxStateError(f"sandbox {sandbox_id} is {row[0]}, not paused: it cannot move", sandbox_id)
            db.execute("UPDATE sandboxes SET node=? WHERE sandbox_id=?", (node, sandbox_id))

    @_retried
    def set_parent(self, sandbox_id: str, snapshot_id: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE sandboxes SET parent_snapshot=? WHERE sandbox_id=?", (snapshot_id, sandbox_id))

    def parent(self, sandbox_id: str) -> str:
        row = self._db.execute("SELECT parent_snapshot FROM sandboxes WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        return row[0] if row else ""

    def transitions(self, sandbox_id: str) -> builtins.list[Transition]:
        rows = self._db.execute(
            "SELECT sandbox_id, at, from_state, to_state, reason FROM transitions WHERE sandbox_id=? ORDER BY rowid",
            (sandbox_id,),
        ).fetchall()
        return [Transition(*r) for r in rows]

    @_retried
    def add_timing(self, sandbox_id: str, stage: str, duration_ms: float) -> None:
        with self._tx() as db:
            db.execute(
                self._sql.upsert("timings", _TIMING_COLUMNS, ("sandbox_id", "stage"), ()),
                (sandbox_id, stage, duration_ms, 1),
            )

    @_retried
    def add_timings(self, timings: builtins.list[StageTiming]) -> None:
        with self._tx() as db:
            db.executemany(
                self._sql.upsert("timings", _TIMING_COLUMNS, ("sandbox_id", "stage")),
                [(t.sandbox_id, t.stage, t.duration_ms, int(t.on_request_path)) for t in timings],
            )

    def timings(self, sandbox_id: str) -> builtins.list[StageTiming]:
        rows = self._db.execute(
            "SELECT sandbox_id, stage, duration_ms, on_path FROM timings WHERE sandbox_id=? ORDER BY rowid",
            (sandbox_id,),
        ).fetchall()
        return [StageTiming(r[0], r[1], r[2], bool(r[3])) for r in rows]
