"""Named volumes: create, list, get, delete, and what a sandbox mounts (resolved for its backend).

A volume belongs to a tenant (``""``: the host's); a tenant never sees, mounts or deletes
another's: a name that is not its own is VolumeNotFound, exactly as an unknown one. Its image is
``<home>/volumes/<volume_id>.img`` (:mod:`warmbox.backends.volume_disk`); the registry holds its
record and every sandbox's mounts of it, so a volume mounted by a live or paused sandbox cannot be
deleted (VolumeInUse), and a microVM's read-write mount stays its only one.

A volume is external state: snapshots do not hold its files (their archive stops at its mount
point), and a sandbox started again from one (a resume, or a fork) mounts the volumes its origin
mounted, as they are now, under the same checks as a create.

In a cluster a volume's disk stays on the node that made it (the registry records that node):
every sandbox mounting it runs there, and only that node deletes it. Another node refuses such a
create, resume, fork or delete with VolumeElsewhere naming the node, before anything is done (an
ext4 image has one writer host; moving one through the object store is not done).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING

from warmbox.backends import volume_disk
from warmbox.errors import LimitTooHigh, VolumeElsewhere, VolumeError, VolumeNotFound
from warmbox.models import (
    VolumeInfo,
    VolumeMount,
    validate_volume_name,
    validate_volume_size,
    validate_volumes,
)

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine


def volumes_dir(engine: Engine) -> Path:
    return engine.home / "volumes"


def disk_of(engine: Engine, volume_id: str) -> Path:
    return volumes_dir(engine) / f"{volume_id}.img"


def disk_of_name(engine: Engine, tenant: str, name: str) -> Path:
    """The host path of a tenant's volume's image, for the host's own use (an operator's tools,
    tests): no VolumeInfo carries it. VolumeNotFound if the tenant has no volume of that name."""
    return disk_of(engine, engine.registry.volumes.volume(tenant, validate_volume_name(name))[0])


def _info(
    engine: Engine, tenant: str, name: str, volume_id: str, size_mb: int, created_at: float, node: str
) -> VolumeInfo:
    disk = disk_of(engine, volume_id)
    try:
        allocated = -(-(os.stat(disk).st_blocks * 512) // (1 << 20)) if _local(engine, node) else 0
    except OSError:
        allocated = 0
    return VolumeInfo(
        name=name,
        tenant=tenant,
        size_mb=size_mb,
        created_at=created_at,
        allocated_mb=allocated,
        mounted_by=tuple(engine.registry.volumes.volume_users(volume_id)),
        node=node,
    )


def _local(engine: Engine, node: str) -> bool:
    """Whether a volume of ``node`` has its disk here ("" : a single host's volume: this home's)."""
    return not node or node == engine.node


def check_here(engine: Engine, name: str, volume_id: str) -> None:
    """VolumeElsewhere when the volume's disk is on another node of the cluster."""
    node = engine.registry.volumes.volume_node(volume_id)
    if not _local(engine, node):
        here = f"node {engine.node!r}" if engine.node else "a host outside the cluster's nodes"
        raise VolumeElsewhere(
            f"volume {name!r} is a disk on node {node!r}, not on {here}: a sandbox mounting it runs "
            f"on {node!r}, and only {node!r} deletes it (volumes do not move between nodes)",
            volume=name,
            node=node,
        )


def _check_room(where: Path, size_mb: int) -> None:
    """LimitTooHigh when the volume alone could not fit what is free on the home's disk."""
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize >> 20
    if size_mb > free:
        raise LimitTooHigh(  # no host path: a tenant reads this
            f"size_mb={size_mb} is more than the {free} MiB free on the disk holding the volumes",
            limit="size_mb",
            value=size_mb,
            maximum=free,
            source="the free space of the disk holding the volumes",
        )


async def create(engine: Engine, tenant: str, name: object, size_mb: object) -> VolumeInfo:
    """A new empty volume of ``size_mb`` MiB; VolumeError if the tenant has one of that name."""
    name = validate_volume_name(name)
    size = validate_volume_size(size_mb)
    try:  # before the mkfs (add_volume checks again, atomically)
        engine.registry.volumes.volume(tenant, name)
    except VolumeNotFound:
        pass
    else:
        raise VolumeError(f"a volume named {name!r} exists already", volume=name)
    root = volumes_dir(engine)
    root.mkdir(mode=0o700, exist_ok=True)
    _check_room(root, size)
    volume_id = "vol-" + secrets.token_hex(8)
    disk = disk_of(engine, volume_id)
    await asyncio.to_thread(volume_disk.make_image, disk, size)
    now = time.time()
    try:
        engine.registry.volumes.add_volume(tenant, name, volume_id, size, now)  # on this node
    except BaseException:
        _remove_files(disk)
        raise
    return _info(engine, tenant, name, volume_id, size, now, engine.registry.node)


def get(engine: Engine, tenant: str, name: object) -> VolumeInfo:
    name = validate_volume_name(name)
    volume_id, size_mb, created_at = engine.registry.volumes.volume(tenant, name)
    return _info(engine, tenant, name, volume_id, size_mb, created_at, engine.registry.volumes.volume_node(volume_id))


def list(engine: Engine, tenant: str | None) -> builtins.list[VolumeInfo]:
    """A tenant's volumes by name (None: every tenant's)."""
    nodes = engine.registry.volumes.volume_nodes()
    return [
        _info(engine, t, n, vid, size, at, nodes.get(vid, ""))
        for t, n, vid, size, at in engine.registry.volumes.volumes(tenant)
    ]


def delete(engine: Engine, tenant: str, name: object) -> None:
    """Delete a volume and its files; VolumeInUse while a live or paused sandbox mounts it."""
    name = validate_volume_name(name)
    check_here(engine, name, engine.registry.volumes.volume(tenant, name)[0])
    volume_id = engine.registry.volumes.remove_volume(tenant, name)
    _remove_files(disk_of(engine, volume_id))


def _remove_files(disk: Path) -> None:
    for path in (disk, volume_disk.lock_path(disk)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def resolve(engine: Engine, tenant: str, volumes: object) -> tuple[VolumeMount, ...]:
    """A create's ``volumes`` checked (names, paths) and looked up (VolumeNotFound for a name not
    the tenant's) as the mounts a backend gets. Mount records are written by :func:`record`."""
    out = []
    for v in validate_volumes(volumes):
        volume_id, _, _ = engine.registry.volumes.volume(tenant, v.name)
        check_here(engine, v.name, volume_id)
        out.append(VolumeMount(v.name, v.path, v.read_only, str(disk_of(engine, volume_id))))
    return tuple(out)


def volume_id_of(mount: VolumeMount) -> str:
    """The volume id in a mount's image path (``<home>/volumes/<volume_id>.img``)."""
    return Path(mount.disk).stem


def of_sandbox(engine: Engine, sandbox_id: str) -> tuple[VolumeMount, ...]:
    """What a sandbox mounted, for a sandbox started again from it (its resume, or a fork of one of
    its snapshots): VolumeNotFound if one of its volumes was deleted since."""
    out = []
    for name, volume_id, path, read_only in engine.registry.volumes.volumes_of(sandbox_id):
        if not name:
            raise VolumeNotFound(f"a volume sandbox {sandbox_id} mounted at {path} was deleted", volume=volume_id)
        check_here(engine, name, volume_id)
        out.append(VolumeMount(name, path, read_only, str(disk_of(engine, volume_id))))
    return tuple(out)


def records(mounts: tuple[VolumeMount, ...]) -> builtins.list[tuple[str, str, str, bool]]:
    """A sandbox's mounts as the registry records them with its row (allocate's and reallocate's
    ``mounts``, before its backend mounts anything: VolumeNotFound if a volume went meanwhile,
    VolumeInUse where the tier's sharing rule refuses, VolumeStore.mount_volumes)."""
    return [(volume_id_of(m), m.name, m.path, m.read_only) for m in mounts]
