"""The host-wide ledger of uid slots: which sandbox of which WARMBOX_HOME holds each uid range.

Every sandbox runs as its own range of 65536 host uids (slot ``n`` = ``UID_BASE + n * UID_RANGE``
on). Registries are per home, so the ranges are handed out here, once per host: one file per held
slot in ``/var/lib/warmbox/uids/<slot>`` (``O_CREAT|O_EXCL``: EEXIST if the slot is taken),
naming the registry and the sandbox that hold it. Every read and change is made under
``flock(.lock)`` (which also holds the round-robin position), and a claimer keeps that lock until
its registry row is committed, so a claim's row is visible to anyone who may look at the slot.

A slot is released when its sandbox is destroyed. One whose holder crashed, or whose home went
away, is reclaimed only when the host runs out of free slots, and only if the holder's registry
says that sandbox no longer holds it (its row is destroyed, paused with nothing left, or gone,
or the registry itself is gone) and no host process runs in its range.

A PostgreSQL registry (``pg:<cluster id>/<node>``) has no file here and its URL is never written
down, so only a registry of the same cluster can read its rows. Another one judges it gone when
no process of this host has it open (each holds a shared flock on its lease file,
``registries/<sha256 of the key>``, from its first claim to its close: a claim in progress, whose
sandbox has no state directory yet, is never judged) and the sandbox's state directory, recorded
in the entry, is gone too (a paused or stopped sandbox's leftovers still hold the range). Entries
without a state directory (host processes, older warmbox) are never judged so.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from warmbox.models import LAYER_UID_BASE as LAYER_UID_BASE

LEDGER_DIR = Path("/var/lib/warmbox/uids")
UID_BASE = 2_000_000
UID_RANGE = 65536
# Image layers are stored with their owners shifted into this range (an image's uid u is host uid
# LAYER_UID_BASE + u): sandboxes read them as nobody, and a template build sandbox, which runs with
# this uid base (one build per host at a time, under BUILD_LOCK), owns them as their image owners.
# (defined in warmbox.models, below the backends, which read it too)

MAX_SLOTS = (2**32 - UID_BASE) // UID_RANGE - 1  # slots 0 .. MAX_SLOTS-1; slot MAX_SLOTS is the bench's

# a row of a registry, in one of these states, holds its slot (paused: while its leftovers exist)
HOLDING_STATES = ("creating", "pooled", "retiring", "ready", "running", "failed")

# (registry key: a SQLite file's path or pg:<cluster>/<node>, sandbox id, slot) -> held? ; None:
# cannot tell (then it is held)
HolderCheck = Callable[[str, str, int], "bool | None"]


class LedgerError(OSError):
    pass


def slot_of_uid(uid: int) -> int | None:
    if uid < UID_BASE:
        return None
    slot = (uid - UID_BASE) // UID_RANGE
    return slot if slot <= MAX_SLOTS else None


def uid_base(slot: int) -> int:
    return UID_BASE + slot * UID_RANGE


class UidLedger:
    """directory, first, slots: the host's ledger hands out slots 0 .. MAX_SLOTS-1; a test's own
    ledger may hand out fewer, from ``first`` on."""

    def __init__(self, directory: Path = LEDGER_DIR, slots: int = MAX_SLOTS, first: int = 0) -> None:
        self.dir = Path(directory)
        self.slots = slots
        self.first = first
        self._lock_fd: int | None = None

    def _entry(self, slot: int) -> Path:
        return self.dir / str(slot)

    @contextlib.contextmanager
    def locked(self) -> Iterator[UidLedger]:
        """Hold the ledger's lock (every claim, release and reclaim happens under it)."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._lock_fd = fd
            yield self
        finally:
            self._lock_fd = None
            os.close(fd)  # drops the lock

    # ---- entries (call these under locked())

    def holder(self, slot: int) -> dict | None:
        """The entry of a held slot ({"registry", "sandbox_id", "pid", "at"}), {} if unreadable, None if free."""
        try:
            raw = self._entry(slot).read_bytes()
        except FileNotFoundError:
            return None
        try:
            entry = json.loads(raw)
            if (
                isinstance(entry, dict)
                and isinstance(entry.get("registry"), str)
                and isinstance(entry.get("sandbox_id"), str)
            ):
                return entry
        except ValueError:
            pass
        return {}

    def held(self) -> list[int]:
        try:
            return sorted(int(n) for n in os.listdir(self.dir) if n.isdigit())
        except FileNotFoundError:
            return []

    def lease(self, registry: str) -> int:
        """Hold ``registry``'s lease (a shared flock, see the module's docstring) until the fd
        returned is closed: while it is held, no slot of that PostgreSQL registry is judged gone."""
        leases = self.dir / "registries"
        leases.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(leases / _lease_name(registry), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _leased(self, registry: str) -> bool:
        """Whether a process of this host holds ``registry``'s lease (unsure: True)."""
        try:
            fd = os.open(self.dir / "registries" / _lease_name(registry), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return False
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)  # drops the probe's lock
        return False

    def _pg_gone(self, entry: dict) -> bool:
        """Whether the PostgreSQL registry of ``entry`` no longer holds its slot on this host: no
        process here has it open and the sandbox's recorded state directory is gone."""
        state_dir = entry.get("state_dir")
        if not entry["registry"].startswith("pg:") or not isinstance(state_dir, str) or not state_dir:
            return False
        return not self._leased(entry["registry"]) and not os.path.lexists(state_dir)

    def _create(self, slot: int, registry: str, sandbox_id: str, state_dir: str = "") -> bool:
        """Create the slot's entry; False if it exists. Under the lock nobody reads it half-written
        (one left half-written by a crash reads as unreadable: stale unless its range is in use)."""
        try:
            fd = os.open(self._entry(slot), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(
                fd,
                json.dumps(
                    {
                        "registry": registry,
                        "sandbox_id": sandbox_id,
                        "pid": os.getpid(),
                        "at": time.time(),
                        "state_dir": state_dir,
                    }
                ).encode(),
            )
        finally:
            os.close(fd)
        return True

    def claim(
        self,
        registry: str,
        sandbox_id: str,
        *,
        skip: frozenset[int] | set[int] = frozenset(),
        check: HolderCheck | None = None,
        state_dir: str = "",
    ) -> int:
        """Take a free slot for ``sandbox_id`` of ``registry`` (round robin over the host: a slot
        just released is the last to be handed out again); reclaims stale ones when none is free.

        skip: slots the caller knows are in use (its own sandboxes from before the ledger).
        state_dir: the sandbox's state directory (recorded: while it exists, the slot is held).
        Raises LedgerError when every slot is held.
        """
        start = self._next()
        for i in range(self.slots):
            slot = self.first + (start - self.first + i) % self.slots
            if slot not in skip and self._create(slot, registry, sandbox_id, state_dir):
                self._set_next(slot + 1)
                return slot
        for slot in self.reclaim(check, start=start):
            if slot not in skip and self._create(slot, registry, sandbox_id, state_dir):
                self._set_next(slot + 1)
                return slot
        raise LedgerError(f"all {self.slots} uid ranges of this host are held ({self.dir})")

    def adopt(self, slot: int, registry: str, sandbox_id: str, state_dir: str = "") -> bool:
        """Record a slot a sandbox already holds (made before the ledger existed); False if
        another holder has it."""
        entry = self.holder(slot)
        if entry is not None:
            return bool(entry) and entry["registry"] == registry and entry["sandbox_id"] == sandbox_id
        return self._create(slot, registry, sandbox_id, state_dir)

    def release(self, slot: int, registry: str, sandbox_id: str) -> bool:
        """Free ``slot`` if (and only if) it is still recorded as this sandbox's."""
        entry = self.holder(slot)
        if not entry or entry["registry"] != registry or entry["sandbox_id"] != sandbox_id:
            return False
        self._entry(slot).unlink(missing_ok=True)
        return True

    def forget_gone(self, holder: str) -> bool:
        """Free the slots recorded as ``holder``'s (a host process of a home, not a sandbox) whose
        registry is gone and in whose range no process runs (a zombie still counts); True when
        none of ``holder``'s is left. Call under locked()."""
        busy = _slots_with_processes()
        left = False
        for slot in self.held():
            entry = self.holder(slot)
            if not entry or entry["sandbox_id"] != holder:
                continue
            if slot in busy or entry["registry"].startswith("pg:") or Path(entry["registry"]).exists():
                left = True
                continue
            self._entry(slot).unlink(missing_ok=True)
        return not left

    def reclaim(self, check: HolderCheck | None = None, *, start: int = 0) -> list[int]:
        """Free every slot whose holder no longer holds it; returns them, in round-robin order from ``start``."""
        busy = _slots_with_processes()
        freed = []
        for slot in sorted(self.held(), key=lambda s: (s - start) % self.slots):
            if not self.first <= slot < self.first + self.slots or slot in busy:
                continue
            entry = self.holder(slot)
            if entry is None:
                freed.append(slot)
                continue
            if entry:  # an unreadable entry is stale only if nothing runs in its range
                held = (check or registry_holds)(entry["registry"], entry["sandbox_id"], slot)
                if held is None:  # its registry cannot be read from here: gone, or not judged
                    held = not self._pg_gone(entry)
                if held:
                    continue
            self._entry(slot).unlink(missing_ok=True)
            freed.append(slot)
        return freed

    # ---- the round-robin position, kept in the lock file (no file to create per claim)

    def _next(self) -> int:
        if self._lock_fd is None:  # not under locked(): no position to read
            return self.first
        try:
            n = int(os.pread(self._lock_fd, 32, 0).split()[0])
        except (OSError, ValueError, IndexError):
            n = self.first
        return self.first + (n - self.first) % self.slots

    def _set_next(self, n: int) -> None:
        if self._lock_fd is None:
            raise RuntimeError("the uid ledger's position is written only under locked()")
        os.pwrite(self._lock_fd, f"{self.first + (n - self.first) % self.slots:<20}\n".encode(), 0)


def _lease_name(registry: str) -> str:
    return hashlib.sha256(registry.encode()).hexdigest()[:32]


def registry_holds(registry: str, sandbox_id: str, slot: int) -> bool | None:
    """Whether another home's registry still counts ``slot`` as held by ``sandbox_id``.

    False when the registry file is gone, the row is gone, has another slot, or its state no
    longer holds one; None when the registry cannot be read (then nobody takes the slot). A
    PostgreSQL registry's key (``pg:<cluster>/<node>``) names no file and no URL: None (a missing
    file must never free the slot of a live sandbox; that registry answers for its own keys).
    """
    if registry.startswith("pg:"):
        return None
    path = Path(registry)
    if not path.exists():
        return False
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            row = db.execute(
                "SELECT state, uid_slot, state_dir FROM sandboxes WHERE sandbox_id=?", (sandbox_id,)
            ).fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return None
    return row_holds(row, slot)


def row_holds(row: tuple | None, slot: int) -> bool:
    """(state, uid_slot, state_dir) of a registry row -> does it hold ``slot``?"""
    if row is None:
        return False
    state, row_slot, state_dir = row
    if row_slot != slot:
        return False
    if state in HOLDING_STATES:
        return True
    # paused: its release did not finish yet; lost (its node marked down while it ran on this
    # host): the node's reconcile has not torn it down yet
    return state in ("paused", "lost") and Path(state_dir).exists()


def _slots_with_processes() -> set[int]:
    """Slots with a process running in their uid range right now (never reclaimed)."""
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
            uids = status.split(b"\nUid:", 1)[1].split(b"\n", 1)[0].split()
        except (OSError, IndexError):
            continue
        for u in uids:
            slot = slot_of_uid(int(u))
            if slot is not None:
                out.add(slot)
    return out
