"""Snapshot artifacts: content-addressed, zstd-compressed blobs plus one typed manifest each.

Layout in the object store:
    blobs/sha256/<hex>          a compressed blob, named by the SHA-256 of its stored bytes
    snapshots/<snapshot_id>.json  the manifest, written last: a snapshot exists once it does

Blobs are shared by every snapshot that has the same content (dedup); ``gc`` deletes the ones
no manifest references. Reading verifies size and checksum before anything is restored, so a
truncated or corrupted artifact is an ArtifactCorrupt error and never a half-restored sandbox.
Manifests carry environment variable *names*, never values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from warmbox.errors import ArtifactCorrupt, StorageError, StorageFull
from warmbox.storage.objects import ObjectStore

FORMAT = 2
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class SnapshotManifest:
    """Everything needed to restore a snapshot, and nothing secret.

    memory: whether process memory is in the artifact (the runtime's checkpoint image, with
    /tmp and /home/user inside it; the filesystem blob then holds /workspace). False: files and
    serialisable code-context state only; restore starts fresh processes on the restored files.
    context_saved / context_skipped: the default code context's globals were pickled, except
    these names (unpicklable values: functions and classes defined in cells, open files, ...).
    """

    snapshot_id: str
    sandbox_id: str
    parent: str  # the snapshot the sandbox was restored from ("" if none)
    created_at: float
    tier: str
    template: str
    memory_mb: int
    cpus: float
    pids: int
    file_size_mb: int
    open_files: int
    tmp_mb: int
    memory: bool
    filesystem_sha256: str
    filesystem_bytes: int  # stored (compressed)
    filesystem_raw_bytes: int
    context_saved: bool
    context_skipped: tuple[str, ...]
    env_names: tuple[str, ...]
    memory_sha256: str = ""  # the runtime's checkpoint image (memory: true), else ""
    memory_bytes: int = 0
    memory_raw_bytes: int = 0
    format: int = FORMAT
    disk_mb: int = 0  # the sandbox's limits.disk_mb; 0: taken before /workspace had a quota (absent then)
    # the image the sandbox ran (``sha256:<hex>``) and its template version: a restore runs that
    # image again, never the template's latest ("": taken before images were recorded)
    image_id: str = ""
    template_version: int = 0
    # the sandbox's egress (engine.egress.EgressRecord JSON: policy and secret slots, never a
    # value); a resume or fork comes back with it. "": no network
    network: str = ""
    # the runtime and version that made the memory image ("runsc 0.0~20240729.0"; "" : files only,
    # or a memory snapshot from before it was recorded, which the tier's legacy_runtime made)
    runtime: str = ""

    @property
    def size_bytes(self) -> int:
        return self.filesystem_bytes + self.memory_bytes


def manifest_key(snapshot_id: str) -> str:
    return f"snapshots/{snapshot_id}.json"


def blob_key(sha256: str) -> str:
    return f"blobs/sha256/{sha256}"


def _zstd():
    try:
        import zstandard
    except ImportError:  # pragma: no cover - a declared dependency
        raise StorageError("snapshots need the zstandard package") from None
    return zstandard


class _HashingFile:
    """A write-only file that hashes what goes through it (one pass over the compressed bytes)."""

    def __init__(self, f) -> None:
        self.f = f
        self.h = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.h.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


class BlobWriter:
    """A blob compressed and hashed as it is written (a stream needs no raw copy on disk): ``write``
    the raw bytes, then ``store`` it; ``discard`` drops it. Its temp file lives in ``workdir``."""

    def __init__(self, workdir: Path, level: int = 3) -> None:
        zstd = _zstd()
        fd, tmp_name = tempfile.mkstemp(prefix=".blob-", dir=workdir)
        self.path = Path(tmp_name)
        self.raw_size = 0
        self._out = os.fdopen(fd, "wb")
        self._hashed = _HashingFile(self._out)
        self._z = zstd.ZstdCompressor(level=level, threads=-1).stream_writer(self._hashed, closefd=False)
        self._flush = zstd.FLUSH_FRAME

    def write(self, data: bytes) -> None:
        """Raises OSError (a full disk: ENOSPC) as the file's own write does."""
        self._z.write(data)
        self.raw_size += len(data)

    def store(self, store: ObjectStore) -> tuple[str, int, int]:
        """Finish the blob and store it (unless an identical one exists); (sha256, stored, raw) sizes.
        The temp file is gone afterwards, whatever happens."""
        try:
            try:
                self._z.flush(self._flush)
                self._z.close()
                self._out.close()
            except OSError as e:
                raise (StorageFull if e.errno == 28 else StorageError)(
                    f"compressing a snapshot: {e.strerror}"
                ) from None
            sha = self._hashed.h.hexdigest()
            if not store.exists(blob_key(sha)):
                move = getattr(store, "move_file", None)
                if move is not None:
                    move(blob_key(sha), self.path)  # same filesystem: a rename, not a copy
                else:
                    store.put_file(blob_key(sha), self.path)
            return sha, self._hashed.size, self.raw_size
        finally:
            self.discard()

    def discard(self) -> None:
        try:
            self._z.close()
        except Exception:  # closing after a failed write may fail again: nothing is kept anyway
            pass
        try:
            self._out.close()
        except OSError:
            pass
        self.path.unlink(missing_ok=True)


def put_blob(store: ObjectStore, raw: Path, workdir: Path, level: int = 3) -> tuple[str, int, int]:
    """Compress ``raw`` and store it (unless an identical blob exists); (sha256, stored, raw) sizes."""
    blob = BlobWriter(workdir, level)
    try:
        with open(raw, "rb") as src:
            while chunk := src.read(_CHUNK):
                blob.write(chunk)
    except OSError as e:
        blob.discard()
        raise (StorageFull if e.errno == 28 else StorageError)(f"compressing a snapshot: {e.strerror}") from None
    return blob.store(store)


def get_blob(store: ObjectStore, sha256: str, size: int, raw_size: int, dest: Path, workdir: Path) -> None:
    """Fetch, verify (size, SHA-256) and decompress a blob into ``dest``; ArtifactCorrupt if anything is off."""
    zstd = _zstd()
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=".get-", dir=workdir)
    except OSError as e:
        raise StorageError(f"fetching a snapshot: {e.strerror}") from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        store.get_file(blob_key(sha256), tmp)
        got = tmp.stat().st_size
        if got != size:
            raise ArtifactCorrupt(f"blob {sha256[:12]} is {got} bytes, the manifest says {size} (truncated?)")
        h = hashlib.sha256()
        with open(tmp, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        if h.hexdigest() != sha256:
            raise ArtifactCorrupt(f"blob {sha256[:12]} fails its checksum")
        try:
            with open(tmp, "rb") as src, open(dest, "wb") as out:
                zstd.ZstdDecompressor().copy_stream(src, out)
        except zstd.ZstdError as e:
            raise ArtifactCorrupt(f"blob {sha256[:12]} does not decompress: {e}") from None
        except OSError as e:
            raise (StorageFull if e.errno == 28 else StorageError)(f"unpacking a snapshot: {e.strerror}") from None
        if dest.stat().st_size != raw_size:
            raise ArtifactCorrupt(
                f"blob {sha256[:12]} decompressed to {dest.stat().st_size} bytes, expected {raw_size}"
            )
    finally:
        tmp.unlink(missing_ok=True)


def save_manifest(store: ObjectStore, m: SnapshotManifest, workdir: Path) -> None:
    body = json.dumps(dataclasses.asdict(m), sort_keys=True).encode()
    fd, tmp_name = tempfile.mkstemp(prefix=".manifest-", dir=workdir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        store.put_file(manifest_key(m.snapshot_id), Path(tmp_name))
    finally:
        Path(tmp_name).unlink(missing_ok=True)


def load_manifest(store: ObjectStore, snapshot_id: str, workdir: Path) -> SnapshotManifest:
    fd, tmp_name = tempfile.mkstemp(prefix=".manifest-", dir=workdir)
    os.close(fd)
    try:
        store.get_file(manifest_key(snapshot_id), Path(tmp_name))
        try:
            raw = json.loads(Path(tmp_name).read_bytes())
            fields = {f.name: f for f in dataclasses.fields(SnapshotManifest)}
            if isinstance(raw, dict):
                raw.setdefault("disk_mb", 0)  # a manifest from before disk quotas
                raw.setdefault("image_id", "")  # ... and from before images were recorded
                raw.setdefault("template_version", 0)
                raw.setdefault("network", "")  # ... and from before a snapshot kept its network
                raw.setdefault("runtime", "")  # ... and from before its runtime was recorded
            if not isinstance(raw, dict) or set(raw) != set(fields):
                raise ValueError("unexpected fields")
            for k in ("context_skipped", "env_names"):
                if not isinstance(raw[k], list) or not all(isinstance(x, str) for x in raw[k]):
                    raise ValueError(f"{k} must be a list of strings")
                raw[k] = tuple(raw[k])
            m = SnapshotManifest(**raw)
            if m.format != FORMAT or m.snapshot_id != snapshot_id:
                raise ValueError("wrong format or id")
            json_types: dict[str, type | tuple[type, ...]] = {
                "str": str,
                "int": int,
                "float": (int, float),
                "bool": bool,
            }
            for name, f in fields.items():
                want = json_types.get(str(f.type))
                if want is not None and not isinstance(getattr(m, name), want):
                    raise ValueError(f"{name} has the wrong type")
        except (ValueError, TypeError, KeyError) as e:
            raise ArtifactCorrupt(f"snapshot {snapshot_id}: manifest is not valid ({e})") from None
        return m
    finally:
        Path(tmp_name).unlink(missing_ok=True)


def list_manifests(store: ObjectStore) -> list[str]:
    return [k[len("snapshots/") : -len(".json")] for k in store.list("snapshots") if k.endswith(".json")]


GC_GRACE_S = 3600.0  # a blob younger than this may belong to a snapshot being written


def gc(store: ObjectStore, workdir: Path, grace_s: float = GC_GRACE_S) -> tuple[int, list[str]]:
    """Delete blobs no readable manifest references and older than ``grace_s``.

    Returns (blobs deleted, ids of unreadable manifests: those snapshots cannot be restored
    and are left for ``snapshots rm``).
    """
    keep: set[str] = set()
    broken: list[str] = []
    for sid in list_manifests(store):
        try:
            m = load_manifest(store, sid, workdir)
            keep.update(x for x in (m.filesystem_sha256, m.memory_sha256) if x)
        except ArtifactCorrupt:
            broken.append(sid)
    removed = 0
    now = time.time()
    for key in store.list("blobs/sha256"):
        if key.rsplit("/", 1)[-1] in keep:
            continue
        if now - store.modified(key) < grace_s:
            continue
        store.delete(key)
        removed += 1
    return removed, broken


def new_snapshot_id() -> str:
    import secrets

    return f"snap-{time.strftime('%Y%m%d')}-{secrets.token_hex(6)}"
