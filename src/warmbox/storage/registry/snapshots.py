"""SnapshotStore: the snapshots of sandboxes."""

from __future__ import annotations

import builtins

from warmbox.models import SnapshotRecord
from warmbox.storage.registry.db import Store, _retried


class SnapshotStore(Store):
    """The snapshots of sandboxes."""

    @_retried
    def add_snapshot(self, snapshot_id: str, sandbox_id: str, created_at: float, size: int, runtime: str = "") -> None:
        """Record a snapshot; it belongs to its sandbox's tenant. runtime: what made its memory image
        ("runsc 0.0~20240729.0"; "" for a files-only snapshot)."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO snapshots (snapshot_id, sandbox_id, created_at, size_bytes, tenant, image_id, runtime) "
                "VALUES (?,?,?,?, COALESCE((SELECT tenant FROM sandboxes WHERE sandbox_id=?), ''), "
                "COALESCE((SELECT image_id FROM sandboxes WHERE sandbox_id=?), ''), ?)",
                (snapshot_id, sandbox_id, created_at, size, sandbox_id, sandbox_id, runtime),
            )

    def snapshot_runtime(self, snapshot_id: str) -> str | None:
        """The runtime recorded for a snapshot ("" : files only or recorded before version 19);
        None if the registry has no such snapshot."""
        row = self._read("SELECT runtime FROM snapshots WHERE snapshot_id=?", (snapshot_id,))
        return None if row is None else str(row[0])

    @_retried
    def mark_auto(self, snapshot_id: str) -> None:
        """The snapshot was made by an automatic pause (idle, timeout): internal to its sandbox."""
        with self._tx() as db:
            db.execute("UPDATE snapshots SET auto=1 WHERE snapshot_id=?", (snapshot_id,))

    def auto_snapshots_of(self, sandbox_id: str) -> builtins.list[str]:
        """The snapshots automatic pauses made of ``sandbox_id``, oldest first."""
        rows = self._read(
            "SELECT snapshot_id FROM snapshots WHERE sandbox_id=? AND auto=1 ORDER BY created_at",
            (sandbox_id,),
            many=True,
        )
        return [r[0] for r in rows]

    def snapshot_tenant(self, snapshot_id: str) -> str | None:
        """The tenant a snapshot belongs to; None if the registry has no such snapshot."""
        row = self._read("SELECT tenant FROM snapshots WHERE snapshot_id=?", (snapshot_id,))
        return None if row is None else row[0]

    def snapshot_sandbox(self, snapshot_id: str) -> str | None:
        """The sandbox a snapshot was taken of; None if the registry has no such snapshot (one
        read by the primary key: a router resolves a create's snapshot with it)."""
        row = self._read("SELECT sandbox_id FROM snapshots WHERE snapshot_id=?", (snapshot_id,))
        return None if row is None else row[0]

    def snapshot_records(self, sandbox_id: str) -> builtins.list[SnapshotRecord]:
        """The snapshots of ``sandbox_id`` the registry still holds, oldest first."""
        rows = self._read(
            "SELECT snapshot_id, sandbox_id, created_at, size_bytes, auto FROM snapshots WHERE sandbox_id=? "
            "ORDER BY created_at",
            (sandbox_id,),
            many=True,
        )
        return [SnapshotRecord(r[0], r[1], r[2], r[3], bool(r[4])) for r in rows]

    def snapshots_of(self, sandbox_id: str) -> builtins.list[str]:
        rows = self._read(
            "SELECT snapshot_id FROM snapshots WHERE sandbox_id=? ORDER BY created_at", (sandbox_id,), many=True
        )
        return [r[0] for r in rows]

    def all_snapshots(self, tenant: str | None = None) -> builtins.list[tuple[str, str, float, int]]:
        """(snapshot_id, sandbox_id, created_at, size_bytes), oldest first; tenant: only that tenant's."""
        q = "SELECT snapshot_id, sandbox_id, created_at, size_bytes FROM snapshots"
        rows = self._read(
            q + (" WHERE tenant=?" if tenant is not None else "") + " ORDER BY created_at",
            (tenant,) if tenant is not None else (),
            many=True,
        )
        return [tuple(r) for r in rows]

    @_retried
    def remove_snapshot(self, snapshot_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM snapshots WHERE snapshot_id=?", (snapshot_id,))
