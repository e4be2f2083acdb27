"""VolumeStore: a tenant's volumes and which sandboxes mount them."""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from warmbox.errors import RegistryError, VolumeError, VolumeInUse, VolumeNotFound
from warmbox.models import State
from warmbox.storage.registry.common import _HOLDING, _in
from warmbox.storage.registry.db import Store, _retried
from warmbox.storage.sql import Conn

# (volume_id, name, path, read_only) of each volume a sandbox mounts
Mounts = Sequence[tuple[str, str, str, bool]]

# a volume mounted by a sandbox in one of these states is in use (paused: it is mounted again on
# resume; failed: its teardown, which unmounts it, is still owed)
_MOUNTING = (*_HOLDING, State.PAUSED.value)


class VolumeStore(Store):
    """A tenant's volumes and which sandboxes mount them."""

    @_retried
    def add_volume(self, tenant: str, name: str, volume_id: str, size_mb: int, created_at: float) -> None:
        """Record a new volume; VolumeError if the tenant has one of that name."""
        try:
            with self._tx(f"volume:{tenant}/{name}") as db:
                if db.execute("SELECT 1 FROM volumes WHERE tenant=? AND name=?", (tenant, name)).fetchone():
                    raise VolumeError(f"a volume named {name!r} exists already", volume=name)
                db.execute(
                    "INSERT INTO volumes (tenant, name, volume_id, size_mb, created_at, node) VALUES (?,?,?,?,?,?)",
                    (tenant, name, volume_id, size_mb, created_at, self.node),
                )
        except self._errors as e:
            raise RegistryError(f"registry error: {e}") from None

    def volume(self, tenant: str, name: str) -> tuple[str, int, float]:
        """(volume_id, size_mb, created_at) of the tenant's volume; VolumeNotFound if it has none of that name."""
        row = self._read("SELECT volume_id, size_mb, created_at FROM volumes WHERE tenant=? AND name=?", (tenant, name))
        if row is None:
            raise VolumeNotFound(f"no volume named {name!r}", volume=name)
        return row[0], row[1], row[2]

    def volumes(self, tenant: str | None) -> builtins.list[tuple[str, str, str, int, float]]:
        """(tenant, name, volume_id, size_mb, created_at) of a tenant's volumes (None: everyone's), by name."""
        if tenant is None:
            return self._read(
                "SELECT tenant, name, volume_id, size_mb, created_at FROM volumes ORDER BY name", many=True
            )
        return self._read(
            "SELECT tenant, name, volume_id, size_mb, created_at FROM volumes WHERE tenant=? ORDER BY name",
            (tenant,),
            many=True,
        )

    def volume_users(self, volume_id: str) -> builtins.list[str]:
        """The sandboxes that mount the volume and are live, paused or owe their teardown."""
        rows = self._read(
            "SELECT m.sandbox_id FROM sandbox_volumes m JOIN sandboxes s ON s.sandbox_id = m.sandbox_id "
            f"WHERE m.volume_id=? AND s.state IN {_in(_MOUNTING)} ORDER BY s.created_at",
            (volume_id, *_MOUNTING),
            many=True,
        )
        return [r[0] for r in rows]

    @_retried
    def remove_volume(self, tenant: str, name: str) -> str:
        """Forget a volume; its volume_id (whose image the caller deletes). VolumeNotFound, or
        VolumeInUse while a sandbox mounts it (checked in the transaction that removes the row,
        against the one that records a mount: neither can slip between the other's check and write)."""
        try:
            with self._tx() as db:
                row = db.execute(
                    "SELECT volume_id FROM volumes WHERE tenant=? AND name=?" + self._sql.for_update(), (tenant, name)
                ).fetchone()
                if row is None:
                    raise VolumeNotFound(f"no volume named {name!r}", volume=name)
                users = db.execute(
                    "SELECT m.sandbox_id FROM sandbox_volumes m JOIN sandboxes s ON s.sandbox_id = m.sandbox_id "
                    f"WHERE m.volume_id=? AND s.state IN {_in(_MOUNTING)}",
                    (row[0], *_MOUNTING),
                ).fetchall()
                if users:
                    raise VolumeInUse(
                        f"volume {name!r} is mounted by {', '.join(sorted(u[0] for u in users))} (live or paused)",
                        volume=name,
                    )
                db.execute("DELETE FROM volumes WHERE volume_id=?", (row[0],))
                return str(row[0])
        except self._errors as e:
            raise RegistryError(f"registry error: {e}") from None

    @_retried
    def mount_volumes(
        self, sandbox_id: str, mounts: builtins.list[tuple[str, str, str, bool]], *, exclusive: bool
    ) -> None:
        """Record that the sandbox mounts the volumes ``(volume_id, name, path, read_only)`` (ids
        the caller resolved in the tenant's names). A resume (the same sandbox id) replaces its
        earlier record.

        VolumeNotFound for a volume deleted meanwhile. exclusive: the tier mounts the volume's
        image as a disk of its own kernel (a microVM), not through the host's one shared mount:
        then a read-write mount must be the volume's only one, and a read-only one refuses a volume
        mounted read-write anywhere (ext4 is not a shared filesystem: two kernels writing one image
        corrupt it, and a guest reading it while the host writes reads garbage). Conversely a host
        mount refuses a volume a microVM mounts read-write. VolumeInUse then. Checked in the
        transaction that writes the record, against remove_volume's.
        """
        try:
            with self._tx() as db:
                self.mount_in(db, sandbox_id, mounts, exclusive=exclusive)
        except self._errors as e:
            raise RegistryError(f"registry error: {e}") from None

    def mount_in(self, db: Conn, sandbox_id: str, mounts: Mounts, *, exclusive: bool) -> None:
        """mount_volumes on the caller's transaction ``db`` (SandboxStore.allocate's and reallocate's,
        which hold the uid ledger and the tenant's lock first: the lock order is ledger, tenant,
        volumes everywhere). A refusal rolls back the caller's whole transaction."""
        if mounts and self._sql.for_update():  # PostgreSQL: against remove_volume and other mounts
            ids = sorted({m[0] for m in mounts})  # one lock order
            db.execute(
                f"SELECT volume_id FROM volumes WHERE volume_id IN {_in(tuple(ids))} ORDER BY volume_id"
                + self._sql.for_update(),
                ids,
            ).fetchall()
        for volume_id, name, _, read_only in mounts:
            if not db.execute("SELECT 1 FROM volumes WHERE volume_id=?", (volume_id,)).fetchone():
                raise VolumeNotFound(f"no volume named {name!r} (deleted)", volume=name)
            others = db.execute(
                "SELECT m.sandbox_id, m.read_only, m.exclusive FROM sandbox_volumes m JOIN sandboxes s "
                f"ON s.sandbox_id = m.sandbox_id WHERE m.volume_id=? AND m.sandbox_id<>? AND s.state IN "
                f"{_in(_MOUNTING)}",
                (volume_id, sandbox_id, *_MOUNTING),
            ).fetchall()
            for other, other_ro, other_exclusive in others:
                if (exclusive or other_exclusive) and not (read_only and other_ro):
                    raise VolumeInUse(
                        f"volume {name!r} is mounted {'read-only' if other_ro else 'read-write'} by {other}; "
                        "a microVM mounts a volume as a disk of its own kernel, so it shares one only "
                        "read-only with read-only mounts",
                        volume=name,
                    )
        db.execute("DELETE FROM sandbox_volumes WHERE sandbox_id=?", (sandbox_id,))
        for volume_id, _, path, read_only in mounts:
            db.execute(
                "INSERT INTO sandbox_volumes (sandbox_id, volume_id, path, read_only, exclusive) VALUES (?,?,?,?,?)",
                (sandbox_id, volume_id, path, int(read_only), int(exclusive)),
            )

    def volumes_of(self, sandbox_id: str) -> builtins.list[tuple[str, str, str, bool]]:
        """(volume name, volume_id, path, read_only) of what a sandbox mounts (its volume may be gone: name "")."""
        rows = self._read(
            "SELECT COALESCE(v.name, ''), m.volume_id, m.path, m.read_only FROM sandbox_volumes m "
            "LEFT JOIN volumes v ON v.volume_id = m.volume_id WHERE m.sandbox_id=? ORDER BY m.rowid",
            (sandbox_id,),
            many=True,
        )
        return [(r[0], r[1], r[2], bool(r[3])) for r in rows]

    def volume_node(self, volume_id: str) -> str:
        """The node holding the volume's disk ("": a single host's); VolumeNotFound if no such volume."""
        row = self._read("SELECT node FROM volumes WHERE volume_id=?", (volume_id,))
        if row is None:
            raise VolumeNotFound(f"no volume {volume_id!r}", volume=volume_id)
        return str(row[0])

    def volume_nodes(self) -> dict[str, str]:
        """volume_id -> the node holding its disk, of every volume."""
        return {r[0]: r[1] for r in self._read("SELECT volume_id, node FROM volumes", many=True)}
