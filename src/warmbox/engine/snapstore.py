"""Where snapshots are kept: the object store, the operations' locked temp directories (``Op``,
``pause_running``), the cached memory images, and the checks of a snapshot against this host
(its runtime, its image, whether it fits a sandbox's limits). No sandbox is started or paused here.
"""

from __future__ import annotations

import asyncio
import contextvars
import fcntl
import json
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from warmbox.backends.base import RuntimeVersioned, TemplateCapable
from warmbox.engine import resolve
from warmbox.errors import (
    InvalidArgument,
    NoSpace,
    SnapshotRuntimeMismatch,
    StorageError,
    StorageFull,
    TemplateMismatch,
)
from warmbox.models import ImageRef, Limits, Tenant
from warmbox.storage import snapshots as snaps
from warmbox.storage.objects import LocalObjectStore, ObjectStore

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine


def store_for(engine: Engine) -> ObjectStore:
    """The configured object store: ``[cluster] object_store`` (the one every node shares), else
    WARMBOX_OBJECT_STORE, else a local directory under WARMBOX_HOME."""
    url = engine.settings().cluster.object_store or os.environ.get("WARMBOX_OBJECT_STORE", "")
    if url.startswith("s3://"):
        from warmbox.storage.objects import S3ObjectStore

        bucket, _, prefix = url[5:].partition("/")
        return S3ObjectStore(bucket, prefix, endpoint_url=os.environ.get("WARMBOX_S3_ENDPOINT") or None)
    if url:
        return LocalObjectStore(Path(url))
    return LocalObjectStore(engine.home / "objects")


def workdir(engine: Engine) -> Path:
    """The home's temp directory of snapshot operations (their ``Op`` directories, fetched blobs)."""
    d = engine.home / "tmp"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


OP_PREFIX = ".op-"
OP_MIN_AGE_S = 5.0  # an op dir younger than this may not be locked by its creator yet


# the sandbox whose memory pause the current task runs (its sub-tasks inherit it): a wait for
# "the pause under way" from inside that pause would wait for itself
own_pause: contextvars.ContextVar[str] = contextvars.ContextVar("warmbox_own_pause", default="")


def pause_running(engine: Engine, sandbox_id: str) -> bool:
    """Whether a memory pause of ``sandbox_id`` is under way in any process (the daemon's idle
    pause among them): its op directory records the sandbox and its creator holds the lock. Never
    the pause the calling task itself is part of."""
    if own_pause.get() == sandbox_id:
        return False
    for path in workdir(engine).glob(f"{OP_PREFIX}pause-*"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # ended meanwhile
        try:
            rec = os.open("op.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                fields = json.loads(os.read(rec, 1 << 16))
            finally:
                os.close(rec)
            if not isinstance(fields, dict) or fields.get("sandbox_id") != sandbox_id:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True  # its pauser holds it
        except (OSError, ValueError):
            continue  # not recorded yet, or ended meanwhile
        finally:
            os.close(fd)
    return False


async def wait_pause(engine: Engine, sandbox_id: str, timeout_s: float = 300.0) -> None:
    """Until no pause of ``sandbox_id`` is under way (or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while pause_running(engine, sandbox_id) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


class Op:
    """The temp directory of one snapshot/restore operation, locked (flock) while it runs.

    Every temp artifact of the operation lives in it, so a killed process leaves one directory
    whose lock is free: ``recover`` (the daemon, ``snapshots gc``) removes it, whatever its age,
    or finishes what it recorded (a pause killed after its checkpoint).
    """

    def __init__(self, engine: Engine, kind: str) -> None:
        try:
            self.path = Path(tempfile.mkdtemp(prefix=f"{OP_PREFIX}{kind}-", dir=workdir(engine)))
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise storage_error(e, f"{kind}: temp space") from None
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    @classmethod
    def adopt(cls, path: Path) -> Op | None:
        """Take over an orphaned op directory (None if someone else just did)."""
        op = cls.__new__(cls)
        op.path = path
        try:
            op.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(op.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(op.fd)
            return None
        return op

    def record(self, **fields) -> None:
        """What a recoverer needs to finish or undo the operation (written atomically)."""
        tmp = self.path / "op.json.tmp"
        tmp.write_text(json.dumps(fields))
        os.rename(tmp, self.path / "op.json")

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self.fd)

    def __enter__(self) -> Op:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def runtime_of(engine: Engine, tier: str) -> str:
    """What makes a memory image on this host for ``tier`` ("runsc 0.0~20240729.0"; "" : a tier
    whose images are not tied to a runtime version)."""
    backend = engine.backend(tier)
    return backend.runtime_version() if isinstance(backend, RuntimeVersioned) else ""


def check_runtime(engine: Engine, m: snaps.SnapshotManifest) -> None:
    """SnapshotRuntimeMismatch unless this host's runtime made ``m``'s memory image (a snapshot
    recorded without one was made by the tier's ``legacy_runtime``). Files-only snapshots pass."""
    if not m.memory:
        return
    backend = engine.backend(m.tier)
    if not isinstance(backend, RuntimeVersioned):
        return
    recorded, here = m.runtime or backend.legacy_runtime, backend.runtime_version()
    if recorded != here:
        raise SnapshotRuntimeMismatch(
            f"snapshot {m.snapshot_id} holds memory made by {recorded}, and this host runs {here}, which cannot "
            "load it: restore its files instead (a new sandbox from a files-only snapshot) or resume it on a "
            f"host with {recorded}",
            recorded=recorded,
            runtime=here,
        )


def storage_error(e: OSError, what: str) -> StorageError:
    if e.errno in (28, 122):  # ENOSPC, EDQUOT
        return StorageFull(f"{what}: no space left for the artifact ({e.strerror})")
    return StorageError(f"{what}: {e.strerror or e}")


def image_of(engine: Engine, m: snaps.SnapshotManifest, tenant: Tenant | None = None) -> ImageRef:
    """The image ``m`` was taken on, which its restore runs again (resolve.recorded_image:
    TemplateMismatch if it is gone, CorruptLayer if a layer fails its digest). A memory snapshot
    holds processes that mapped that image's files: one from before images were recorded is
    refused rather than continued on another image."""
    if m.memory and not m.image_id:
        raise TemplateMismatch(
            f"snapshot {m.snapshot_id} holds memory taken before sandbox images were recorded: it "
            "cannot be continued on an image it may not have run (restore its files with a newer snapshot)",
            template=m.template,
        )
    return resolve.recorded_image(engine, m.template, m.template_version, m.image_id, tenant)


def template_key(engine: Engine, tier: str, shape: str, image: ImageRef | None = None) -> str:
    """Registry key of a shape's template snapshot. A tier whose snapshots only restore into
    the same machine (microvm: same image and QEMU command line) adds that fingerprint, so a
    changed image or machine makes a new template instead of a failing restore."""
    backend = engine.backend(tier)
    return f"template:{shape}" + (
        f":{backend.template_fingerprint(image)}" if isinstance(backend, TemplateCapable) else ""
    )


def memory_cache(engine: Engine) -> Path:
    return engine.runtime / "memory-cache"


def keep_memory(engine: Engine, snapshot_id: str, image: Path) -> None:
    """Move a fresh memory image into the cache, so its first restore needs no unpacking."""
    import shutil

    cache = memory_cache(engine) / snapshot_id
    tmp = cache.parent / f".tmp-{snapshot_id}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        cache.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp.mkdir()
        shutil.move(str(image), tmp / "checkpoint.img")
        os.rename(tmp, cache)
    except OSError:
        pass  # only a cache: a restore unpacks the blob instead
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def link_cached_memory(engine: Engine, snapshot_id: str, dest: Path) -> bool:
    """Hard-link the snapshot's kept memory image (``keep_memory``) to ``dest``; False if there is
    none (or it is on another filesystem): then the blob is unpacked. A link, not the cache's path,
    so that a concurrent resume dropping the cache cannot take the file from under this restore."""
    try:
        os.link(memory_cache(engine) / snapshot_id / "checkpoint.img", dest, follow_symlinks=False)
    except OSError:
        return False
    return True


def cached_memory(engine: Engine, m: snaps.SnapshotManifest, work: Path) -> Path:
    """The snapshot's memory image, unpacked and verified once, then read in place by every
    restore (tiers that start each sandbox from a template: no decompression on their path)."""
    cache = memory_cache(engine) / m.snapshot_id
    if (cache / "checkpoint.img").is_file():
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = cache.parent / f".tmp-{m.snapshot_id}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        snaps.get_blob(
            store_for(engine), m.memory_sha256, m.memory_bytes, m.memory_raw_bytes, tmp / "checkpoint.img", work
        )
        try:
            os.rename(tmp, cache)
        except OSError:  # another restore unpacked it first
            pass
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return cache


def limits_of(m: snaps.SnapshotManifest) -> Limits:
    """The limits a snapshot comes back with: its sandbox's (a manifest from before disk quotas
    gets the default disk)."""
    return Limits(
        memory_mb=m.memory_mb,
        cpus=m.cpus,
        pids=m.pids,
        file_size_mb=m.file_size_mb,
        open_files=m.open_files,
        tmp_mb=m.tmp_mb,
        **({"disk_mb": m.disk_mb} if m.disk_mb else {}),
    )


def check_fits(m: snaps.SnapshotManifest, room: int) -> None:
    """NoSpace up front when the snapshot's files are clearly larger than the sandbox's filesystems
    (a margin for archive headers and disk-image metadata; a closer miss is the unpacking's NoSpace)."""
    if m.filesystem_raw_bytes > room + room // 32 + (16 << 20):
        raise NoSpace(
            f"snapshot {m.snapshot_id} holds {m.filesystem_raw_bytes >> 20} MiB of files: more than "
            f"the {room >> 20} MiB its sandbox's disk{' and tmpfs mounts' if not m.memory else ''} can hold "
            f"(limits.disk_mb = {limits_of(m).disk_mb})",
            m.sandbox_id,
        )


def disk_full(tar_stderr: str) -> bool:
    """GNU tar ran out of room: ENOSPC, or the short write a full filesystem gives it."""
    return "No space left on device" in tar_stderr or ": Wrote only " in tar_stderr


def too_big(m: snaps.SnapshotManifest, limits: Limits, detail: str, sandbox_id: str) -> NoSpace:
    return NoSpace(
        f"snapshot {m.snapshot_id} does not fit the disk of its new sandbox (limits.disk_mb = "
        f"{limits.disk_mb}): {detail.strip()[-200:]}",
        sandbox_id,
    )


def delete(engine: Engine, snapshot_id: str) -> None:
    """Forget a snapshot (its blob goes at the next gc). Works on an unreadable manifest too."""
    if not isinstance(snapshot_id, str) or not snapshot_id.startswith("snap-") or "/" in snapshot_id:
        raise InvalidArgument(f"{snapshot_id!r} is not a snapshot id")
    store = store_for(engine)
    store.delete(snaps.manifest_key(snapshot_id))
    engine.registry.snapshots.remove_snapshot(snapshot_id)
    import shutil

    shutil.rmtree(memory_cache(engine) / snapshot_id, ignore_errors=True)
