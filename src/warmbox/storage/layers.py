"""The host's content-addressed image layer store, and the step cache (build step key → layer).

Under ``<cache>/layers/``:

- ``blobs/sha256/<hex>``: each layer as a tar (gzip or zstd compressed if it came so from an OCI
  image); ``<hex>`` is the sha256 of these bytes, the layer's digest.
- ``dirs/<hex>/``: the layer unpacked (owners shifted to ``uidslots.LAYER_UID_BASE + u``, overlay
  whiteouts: a 0/0 character device for a deleted path, ``trusted.overlay.opaque=y`` on an opaque
  directory); what overlay mounts and ext4 images are made from. Remade from the blob (verified)
  when missing.
- ``steps/<sha256 of key>``: the step cache, one file holding a layer digest.
- ``tmp/``: work in progress; everything appears by an atomic rename, so concurrent processes
  (several warmbox homes share the cache) never see a half-written blob or directory.

Blobs use OCI whiteout names (``.wh.NAME``, ``.wh..wh..opq``), so a layer can be exported as an
OCI layer as is. A directory tree becomes a layer by :meth:`LayerStore.add_tree`, which treats it as
hostile (a build sandbox's upper directory was written by untrusted code): walked with directory
fds, never following a link, every file checked to be the inode that was lstat'ed, owners checked,
total size bounded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from warmbox import safetar
from warmbox.errors import CorruptLayer, InvalidArgument, TemplateBuildError, TemplateError
from warmbox.models import ImageRef, LayerInfo, TemplateInfo
from warmbox.storage.uidslots import LAYER_UID_BASE

RENAME_TRIES = 5  # an unpacked layer's rename into place, against a removal of the same directory

DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
MAX_LAYER_BYTES = 64 << 30  # regular-file bytes in one layer (a tree packed or a blob unpacked)
_COPY = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPAQUE = ("trusted.overlay.opaque", "user.overlay.opaque")
# overlay features whose upper entries do not hold the whole content (a renamed directory, a
# file whose data stays below): a layer cannot be made from them
_UNSUPPORTED_XATTRS = (
    "trusted.overlay.redirect",
    "trusted.overlay.metacopy",
    "user.overlay.redirect",
    "user.overlay.metacopy",
)
_MAX_PIN = 1 << 20  # bytes of one pin file
_STALE_TMP_S = 6 * 3600.0  # work files left this long in tmp/ are an interrupted process's
_GZIP = b"\x1f\x8b"
_ZSTD = b"\x28\xb5\x2f\xfd"


def hex_of(digest: str) -> str:
    """The hex part of a ``sha256:<hex>`` digest; InvalidArgument for anything else."""
    m = DIGEST.match(digest) if isinstance(digest, str) else None
    if m is None:
        raise InvalidArgument(f"not a layer digest (sha256:<64 hex>): {str(digest)[:100]!r}")
    return m.group(1)


class LayerStore:
    """Layers under ``cache/layers`` (``cache``: the host-wide image cache,
    ``microvm_image.cache_dir()``; tests give a temp one). max_layer_bytes: the most regular-file
    bytes one layer may hold, packed or unpacked (TemplateError beyond)."""

    def __init__(self, cache: Path, *, max_layer_bytes: int = MAX_LAYER_BYTES) -> None:
        self.root = Path(cache) / "layers"
        self.blobs = self.root / "blobs" / "sha256"
        self.dirs = self.root / "dirs"
        self.steps = self.root / "steps"
        self.pins = self.root / "pins"
        self.tmp = self.root / "tmp"
        self.max_layer_bytes = max_layer_bytes
        self._made = False

    # ---- plumbing

    def _ensure(self) -> None:
        if self._made:
            return
        # dirs/ is root's alone: a layer keeps its files' modes, setuid and setgid bits included, and
        # its owners are the layer uid range — a host user who reached a layer could run a setuid
        # file a build planted as host uid LAYER_UID_BASE (which owns every layer) and read every
        # tenant's files. Sandboxes do not need to: their overlay reads its lower layers with the
        # mounter's (root's) rights, and so does a microVM root's mapped mkfs, through an overlay.
        for d, mode in ((self.root, 0o755), (self.dirs, 0o700), (self.blobs.parent, 0o700)):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, mode)
        for d in (self.blobs, self.steps, self.pins, self.tmp):
            d.mkdir(mode=0o700, exist_ok=True)
        self._made = True

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        """Adds and reads hold the store's lock shared; gc and remove exclusively (nothing they
        remove can be half-way into use)."""
        self._ensure()
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def _temp(self, kind: str) -> Path:
        return self.tmp / f"{kind}-{os.getpid()}-{time.monotonic_ns()}"

    def work_file(self, kind: str) -> Path:
        """A new path under the store's ``tmp/`` (root's alone) for work in progress, e.g. a
        download that add_blob then verifies; the caller removes it (gc removes old ones)."""
        self._ensure()
        return self._temp(kind)

    def _info(self, hexd: str) -> LayerInfo:
        blob = self.blobs / hexd
        try:
            size = blob.stat().st_size
        except FileNotFoundError:
            size = 0
        return LayerInfo(f"sha256:{hexd}", size, str(self.dirs / hexd))

    # ---- public API

    def has(self, digest: str) -> bool:
        """Whether the layer's blob is in the store (not verified)."""
        return (self.blobs / hex_of(digest)).is_file()

    def digests(self) -> list[str]:
        """Every layer whose blob is in the store, sorted."""
        if not self.blobs.is_dir():
            return []
        return sorted(f"sha256:{n}" for n in os.listdir(self.blobs) if re.fullmatch(r"[0-9a-f]{64}", n))

    def add_tree(self, src: Path, *, owner_base: int, max_bytes: int | None = None) -> LayerInfo:
        """The directory tree ``src`` as a layer (stored, unpacked): what it holds, its owners
        shifted from ``owner_base + u`` to the layer's u, overlay whiteouts (0/0 character devices,
        opaque directories) written as OCI ones. The tree is walked as hostile: nothing is
        followed, FIFOs/sockets/other devices are skipped (never opened), an owner outside
        ``[owner_base, owner_base + 65536)`` or more than ``max_bytes`` (default: the store's
        bound) of regular files is a TemplateError naming the path; nothing is stored then.
        The same tree gives the same digest (entries sorted, mtimes kept)."""
        limit = self.max_layer_bytes if max_bytes is None else max_bytes
        with self._locked(False):
            tmp = self._temp("blob")
            try:
                root_fd = os.open(src, _DIR_FLAGS)
            except OSError as e:
                raise TemplateError(f"cannot read the layer tree {src}: {e.strerror}") from None
            try:
                with open(tmp, "xb") as raw:
                    out = _Hashing(raw)
                    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
                        _Packer(tar, owner_base, limit).walk(root_fd, "", 0)
                    raw.flush()
                    os.fsync(raw.fileno())
                hexd = out.hash.hexdigest()
                os.replace(tmp, self.blobs / hexd)  # an identical blob may be there: same bytes
            finally:
                os.close(root_fd)
                tmp.unlink(missing_ok=True)
            return self._unpacked(hexd, verified=True)

    def add_blob(self, path: Path, *, digest: str | None = None, media_type: str = "") -> LayerInfo:
        """An OCI layer blob (tar, tar+gzip or tar+zstd; ``media_type`` is informative: the bytes
        say which) copied into the store and unpacked. ``digest``: what the blob must hash to
        (CorruptLayer if it does not); None: computed. A hostile archive (a member out of the
        layer, a write through a symlink, a device or FIFO, a hardlink to something it did not
        write, more than the store's bound) is a TemplateError naming the member; nothing stays."""
        try:
            src = open(path, "rb")
        except OSError as e:
            raise TemplateError(f"cannot read the layer blob {path}: {e.strerror}") from None
        with src:
            return self.add_stream(src, digest=digest, media_type=media_type, shown=str(path))

    def add_stream(
        self, src: BinaryIO, *, digest: str | None = None, media_type: str = "", shown: str = "a stream"
    ) -> LayerInfo:
        """add_blob of an open file (read to its end; not closed): ``shown`` names it in errors."""
        want = hex_of(digest) if digest is not None else None
        if "+" in media_type and not media_type.endswith(("+gzip", "+zstd")):
            raise TemplateError(f"layer media type {media_type!r} is not supported (tar, tar+gzip, tar+zstd)")
        with self._locked(False):
            if want is not None and (self.dirs / want).is_dir() and (self.blobs / want).is_file():
                return self._info(want)
            tmp = self._temp("blob")
            try:
                with open(tmp, "xb") as raw:
                    h = hashlib.sha256()
                    n, most = 0, 2 * self.max_layer_bytes + (16 << 20)  # the files' bytes + tar headers
                    while chunk := src.read(_COPY):
                        n += len(chunk)
                        if n > most:
                            raise TemplateError(f"layer blob {shown} is larger than {most} bytes")
                        h.update(chunk)
                        raw.write(chunk)
                    raw.flush()
                    os.fsync(raw.fileno())
                hexd = h.hexdigest()
                if want is not None and hexd != want:
                    raise CorruptLayer(f"layer blob {shown} hashes to sha256:{hexd}, not {digest}", value=digest or "")
                os.replace(tmp, self.blobs / hexd)
            finally:
                tmp.unlink(missing_ok=True)
            try:
                return self._unpacked(hexd, verified=True)
            except (TemplateError, CorruptLayer):
                (self.blobs / hexd).unlink(missing_ok=True)  # a hostile or broken layer stays out
                raise

    def get(self, digest: str) -> LayerInfo:
        """The layer, unpacked from its blob if its directory is missing (the blob verified
        first: CorruptLayer if it does not match the digest or is missing)."""
        hexd = hex_of(digest)
        with self._locked(False):
            return self._unpacked(hexd, verified=False)

    def verify(self, digest: str) -> None:
        """Re-hash the layer's blob: CorruptLayer if it is missing or does not match."""
        hexd = hex_of(digest)
        _check_blob(self.blobs / hexd, hexd)

    def remove(self, digest: str) -> bool:
        """Remove the layer (blob and directory); whether it was there. The caller makes sure no
        template or sandbox uses it."""
        hexd = hex_of(digest)
        with self._locked(True):
            return self._remove(hexd)

    # ---- pins: what other warmbox homes (and built-in images) use, for every home's gc to see

    def pin(self, name: str, digests: Iterable[str]) -> None:
        """Record that ``name`` (e.g. ``"<registry path>#<tenant>/<template>/<version>"`` or
        ``"builtin:<key>"``) uses these layers: gc keeps them until ``unpin(name)``, whoever runs
        it. The store is shared by every warmbox home on the host; a home's own registry does not
        know the others' templates, pins do. Pinning a name again replaces its layers."""
        ds = [f"sha256:{hex_of(d)}" for d in digests]
        if not isinstance(name, str) or not name or len(name) > 4096:
            raise InvalidArgument("a pin name must be a non-empty string of at most 4096 characters")
        self._ensure()
        tmp = self._temp("pin")
        tmp.write_text(json.dumps({"name": name, "layers": ds}))
        os.replace(tmp, self.pins / _step_name(name))

    def unpin(self, name: str) -> bool:
        """Drop the pin ``name``; whether there was one."""
        self._ensure()
        try:
            (self.pins / _step_name(name)).unlink()
            return True
        except FileNotFoundError:
            return False

    def pinned(self) -> dict[str, tuple[str, ...]]:
        """Every pin: name → its layer digests (unreadable pin files are skipped)."""
        self._ensure()
        out: dict[str, tuple[str, ...]] = {}
        for entry in sorted(os.listdir(self.pins)):
            try:
                with open(self.pins / entry, "rb") as f:
                    doc = json.loads(f.read(_MAX_PIN))
                name, ds = doc["name"], doc["layers"]
                if isinstance(name, str) and isinstance(ds, list):
                    out[name] = tuple(d for d in ds if isinstance(d, str) and DIGEST.match(d))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    def gc(self, keep: Iterable[str], *, min_age_s: float = 0.0) -> list[str]:
        """Remove every layer neither in ``keep`` (digests) nor pinned (see pin) whose blob was
        added or used more than ``min_age_s`` seconds ago, leftovers of interrupted adds, and
        step-cache entries naming a removed layer; the digests removed, sorted. A layer an
        in-flight build made but nothing records yet is not kept: hold the build lock or pass
        ``min_age_s``."""
        kept = {hex_of(d) for d in keep}
        kept |= {hex_of(d) for ds in self.pinned().values() for d in ds}
        now = time.time()
        removed: list[str] = []
        with self._locked(True):
            names = set(os.listdir(self.blobs)) | {n for n in os.listdir(self.dirs) if not n.startswith(".")}
            for hexd in sorted(names):
                if not re.fullmatch(r"[0-9a-f]{64}", hexd) or hexd in kept:
                    continue
                try:
                    used = (self.blobs / hexd).stat().st_mtime
                except FileNotFoundError:
                    used = 0.0
                if now - used < min_age_s:
                    continue
                if self._remove(hexd):
                    removed.append(f"sha256:{hexd}")
            for entry in os.listdir(self.tmp):  # a pull or bootstrap works here unlocked: old ones only
                with contextlib.suppress(FileNotFoundError):
                    if now - (self.tmp / entry).lstat().st_mtime > _STALE_TMP_S:
                        _rmtree(self.tmp / entry)
            for entry in os.listdir(self.dirs):
                if entry.startswith("."):
                    _rmtree(self.dirs / entry)
            for entry in os.listdir(self.steps):
                text = _read_small(self.steps / entry)
                m = DIGEST.match(text or "")
                if m is None or not (self.blobs / m.group(1)).is_file():
                    (self.steps / entry).unlink(missing_ok=True)
        return removed

    # ---- step cache

    def cached_step(self, key: str) -> str | None:
        """The layer digest cached for a build step key, or None (none cached, or the layer is gone)."""
        self._ensure()
        text = _read_small(self.steps / _step_name(key))
        m = DIGEST.match(text or "")
        if m is None or not (self.blobs / m.group(1)).is_file():
            return None
        return text

    def cache_step(self, key: str, digest: str) -> None:
        """Record that the build step ``key`` made the layer ``digest`` (replacing any earlier)."""
        hex_of(digest)
        self._ensure()
        tmp = self._temp("step")
        tmp.write_text(digest)
        os.replace(tmp, self.steps / _step_name(key))

    # ---- internals

    def _unpacked(self, hexd: str, *, verified: bool) -> LayerInfo:
        """dirs/<hexd>, unpacked from the blob if missing; ``verified``: the blob was just hashed."""
        final = self.dirs / hexd
        blob = self.blobs / hexd
        if final.is_dir():
            with contextlib.suppress(OSError):
                os.utime(blob)  # gc's clock: last use
            return self._info(hexd)
        if not verified:
            _check_blob(blob, hexd)
        tmp = self.dirs / f".tmp-{hexd[:16]}-{os.getpid()}-{time.monotonic_ns()}"
        os.mkdir(tmp, 0o755)
        try:
            os.chown(tmp, LAYER_UID_BASE, LAYER_UID_BASE)
            _unpack(blob, tmp, safetar.LayerRules(LAYER_UID_BASE, max_bytes=self.max_layer_bytes), hexd)
            for attempt in range(RENAME_TRIES):
                try:
                    os.rename(tmp, final)
                    break
                except OSError:
                    if final.is_dir():  # another process won the race
                        break
                    # (ENOTEMPTY from a directory being removed at that moment, gone by the check)
                    if attempt == RENAME_TRIES - 1:
                        raise
                    time.sleep(0.01)
        finally:
            if tmp.exists():
                _rmtree(tmp)
        return self._info(hexd)

    def _remove(self, hexd: str) -> bool:
        found = False
        final = self.dirs / hexd
        if final.exists():
            gone = self.dirs / f".gone-{hexd[:16]}-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(final, gone)  # out of sight at once, then removed
            _rmtree(gone)
            found = True
        try:
            (self.blobs / hexd).unlink()
            found = True
        except FileNotFoundError:
            pass
        return found


def image_id_of(layers: Sequence[str], env: Sequence[tuple[str, str]], workdir: str, user: str) -> str:
    """``sha256:<hex>`` over the canonical JSON of an image: its layer digests (bottom first) and
    config. Two builds giving the same layers and config have the same id."""
    doc = {"layers": list(layers), "env": [[k, v] for k, v in env], "workdir": workdir, "user": user}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def image_ref(store: LayerStore, info: TemplateInfo) -> ImageRef:
    """The ImageRef of a template version: each layer resolved (and unpacked if needed) in the
    store; CorruptLayer for a layer missing or not matching its digest."""
    dirs = tuple(store.get(d).path for d in info.layers)
    return ImageRef(
        template=info.name,
        version=info.version,
        image_id=info.image_id,
        layers=dirs,
        env=info.env,
        workdir=info.workdir,
        user=info.user,
    )


# ---- Debian via mmdebstrap

DEBIAN_EXCLUDES = (
    "/usr/share/man/*",
    "/usr/share/doc/*",
    "/usr/share/locale/*",
    "/usr/share/info/*",
    "/usr/share/lintian/*",
    "/usr/share/zoneinfo/right/*",
)
_SUITE = re.compile(r"^[a-z][a-z0-9.-]{0,39}$")
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]{0,99}(:[a-z0-9-]{1,20})?(=[A-Za-z0-9.+~:-]{1,100})?$")
_MIRROR = re.compile(r"^(https?|file)://[^\s]{1,500}$")


def debian_layer(
    store: LayerStore,
    suite: str,
    packages: Sequence[str],
    *,
    mirror: str | None = None,
    variant: str = "minbase",
    excludes: Sequence[str] = DEBIAN_EXCLUDES,
    prepare: Callable[[Path], None] | None = None,
    prepare_key: str = "",
    timeout_s: float = 1800.0,
) -> LayerInfo:
    """A Debian root (mmdebstrap ``--variant=minbase --include=packages``; ``excludes``: dpkg
    path-exclude patterns, by default docs, man pages and locales; apt's caches emptied) as one
    layer, cached in the step cache by all the arguments: the bootstrap runs once per host.
    ``mirror``: an http(s)/file URL (None: the host's apt sources). ``prepare``: called with the
    root directory (host owners, ids 0..65535) before it becomes the layer, to add or change
    files; ``prepare_key`` names what it does (part of the cache key: change it when it changes).
    TemplateBuildError if mmdebstrap fails (its output's end in the message)."""
    if not isinstance(suite, str) or not _SUITE.match(suite):
        raise InvalidArgument(f"not a Debian suite name: {suite!r}")
    if isinstance(packages, str):
        raise InvalidArgument("packages must be a list of package names, not one string")
    pkgs = sorted(set(packages))
    for p in pkgs:
        if not isinstance(p, str) or not _PACKAGE.match(p):
            raise InvalidArgument(f"not a Debian package name: {p!r}")
    if mirror is not None and not _MIRROR.match(mirror):
        raise InvalidArgument(f"mirror must be an http(s):// or file:// URL, got {mirror!r}")
    if variant not in ("minbase", "essential", "required", "important", "standard", "custom", "apt"):
        raise InvalidArgument(f"not an mmdebstrap variant: {variant!r}")
    if isinstance(excludes, str) or not all(isinstance(x, str) and x.startswith("/") for x in excludes):
        raise InvalidArgument(f"excludes must be a list of absolute path patterns, got {excludes!r}")
    key = "debian:" + json.dumps([suite, pkgs, mirror or "", variant, list(excludes), prepare_key])
    cached = store.cached_step(key)
    if cached is not None:
        return store.get(cached)
    store._ensure()
    tmp = store._temp("debian")
    argv = ["mmdebstrap", f"--variant={variant}", "--quiet", "--mode=root"]
    if pkgs:
        argv.append("--include=" + ",".join(pkgs))
    argv += [f"--dpkgopt=path-exclude={x}" for x in excludes]
    argv += ["--dpkgopt=path-include=/usr/share/doc/*/copyright", suite, str(tmp)]
    if mirror is not None:
        argv.append(mirror)
    step = f"debian:{suite}"
    try:
        try:
            r = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout_s)
        except FileNotFoundError:
            raise TemplateBuildError("mmdebstrap is not installed (scripts/bootstrap install)", step=step) from None
        except subprocess.TimeoutExpired:
            raise TemplateBuildError(f"mmdebstrap of {suite} took over {timeout_s:.0f} s", step=step) from None
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip()[-2000:]
            raise TemplateBuildError(f"mmdebstrap of {suite} {pkgs} failed ({r.returncode}): {tail}", step=step)
        for junk in ("var/cache/apt", "var/lib/apt/lists"):
            junk_dir = tmp / junk
            if junk_dir.is_dir():
                for entry in os.listdir(junk_dir):
                    _rmtree(junk_dir / entry)
        if prepare is not None:
            prepare(tmp)
        info = store.add_tree(tmp, owner_base=0)
    finally:
        if tmp.exists():
            _rmtree(tmp)
    store.cache_step(key, info.digest)
    return info


# ---- helpers


class _Hashing:
    """A write-only file object hashing what passes through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.hash = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        return self.raw.write(data)


class _Packer:
    """Writes a hostile directory tree as a layer tar (see LayerStore.add_tree)."""

    def __init__(self, tar: tarfile.TarFile, owner_base: int, max_bytes: int) -> None:
        self.tar = tar
        self.base = owner_base
        self.max_bytes = max_bytes
        self.total = 0
        self.links: dict[tuple[int, int], str] = {}  # (dev, ino) of a multiply-linked file → its first name

    def _owner(self, st: os.stat_result, path: str) -> tuple[int, int]:
        uid, gid = st.st_uid - self.base, st.st_gid - self.base
        if not (0 <= uid < 65536 and 0 <= gid < 65536):
            raise TemplateError(
                f"layer tree entry {path[:200]!r} is owned by {st.st_uid}:{st.st_gid}, outside the "
                f"uid range {self.base}..{self.base + 65535} of the tree"
            )
        return uid, gid

    def _info(self, name: str, st: os.stat_result, path: str) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.uid, info.gid = self._owner(st, path)
        info.uname = info.gname = ""
        info.mode = stat.S_IMODE(st.st_mode)
        info.mtime = max(0, int(st.st_mtime))
        return info

    def walk(self, fd: int, prefix: str, depth: int) -> None:
        """Depth first, sorted; the fds held are the current path's directories."""
        if depth > safetar.MAX_DEPTH:
            raise TemplateError(f"layer tree deeper than {safetar.MAX_DEPTH} directories at {prefix[:200]!r}")
        for name in sorted(os.listdir(fd)):
            sub = self._one(fd, name, prefix + name)
            if sub is None:
                continue
            try:
                self.walk(sub, prefix + name + "/", depth + 1)
            finally:
                os.close(sub)

    def _one(self, dir_fd: int, name: str, path: str) -> int | None:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # an overlay whiteout: made with the mounter's ids
            dirname, _, base = path.rpartition("/")
            info = tarfile.TarInfo((dirname + "/" if dirname else "") + safetar.LayerRules.WHITEOUT + base)
            info.mode = 0o600
            self.tar.addfile(info)
            return None
        if stat.S_ISLNK(st.st_mode):
            info = self._info(path, st, path)
            info.type = tarfile.SYMTYPE
            info.linkname = os.readlink(name, dir_fd=dir_fd)
            self.tar.addfile(info)
            return None
        if stat.S_ISDIR(st.st_mode):
            info = self._info(path, st, path)
            try:
                fd = safetar.open_dir(name, dir_fd, path, path, create=False)
            except (OSError, safetar.UnsafeArchive) as e:
                raise TemplateError(f"layer tree entry {path[:200]!r} changed while it was read: {e}") from None
            try:
                _refuse_overlay_features(fd, path)
                info.type = tarfile.DIRTYPE
                info.mtime = 0  # it changes as entries come and go; a layer's digest depends on content only
                self.tar.addfile(info)
                if any(_xattr(fd, x) == b"y" for x in _OPAQUE):
                    opq = tarfile.TarInfo(path + "/" + safetar.LayerRules.OPAQUE)
                    opq.mode = 0o600
                    self.tar.addfile(opq)
            except BaseException:
                os.close(fd)
                raise
            return fd
        if not stat.S_ISREG(st.st_mode):
            return None  # FIFO, socket, device: never opened, not part of a layer
        info = self._info(path, st, path)
        if st.st_nlink > 1:
            first = self.links.get((st.st_dev, st.st_ino))
            if first is not None:
                info.type = tarfile.LNKTYPE
                info.linkname = first
                self.tar.addfile(info)
                return None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as e:
            raise TemplateError(f"cannot read layer tree entry {path[:200]!r}: {e.strerror}") from None
        try:
            fst = os.fstat(fd)
            if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(fst.st_mode):
                raise TemplateError(f"layer tree entry {path[:200]!r} changed while it was read")
            _refuse_overlay_features(fd, path)
            self.total += fst.st_size
            if self.total > self.max_bytes:
                raise TemplateError(f"the layer holds more than {self.max_bytes} bytes (at {path[:200]!r})")
            info.size = fst.st_size
            self.tar.addfile(info, safetar._Exact(fd, fst.st_size))  # type: ignore[arg-type]
        finally:
            os.close(fd)
        if st.st_nlink > 1 and len(self.links) < safetar.MAX_LINKABLE:
            self.links[(st.st_dev, st.st_ino)] = path
        return None


def _xattr(fd: int, name: str) -> bytes | None:
    try:
        return os.getxattr(fd, name)
    except OSError:
        return None


def _refuse_overlay_features(fd: int, path: str) -> None:
    for x in _UNSUPPORTED_XATTRS:
        if _xattr(fd, x) is not None:
            raise TemplateError(
                f"layer tree entry {path[:200]!r} carries {x}: an overlay mounted with redirect_dir or "
                "metacopy cannot become a layer (mount the build overlay with redirect_dir=off,metacopy=off)"
            )


def _check_blob(blob: Path, hexd: str) -> None:
    digest = f"sha256:{hexd}"
    h = hashlib.sha256()
    try:
        with open(blob, "rb") as f:
            while chunk := f.read(_COPY):
                h.update(chunk)
    except FileNotFoundError:
        raise CorruptLayer(f"layer {digest} is missing from the layer store", value=digest) from None
    if h.hexdigest() != hexd:
        raise CorruptLayer(f"layer {digest}: its blob hashes to sha256:{h.hexdigest()}", value=digest)


def _unpack(blob: Path, dest: Path, rules: safetar.LayerRules, hexd: str) -> None:
    """Extract a (verified) blob into the empty directory ``dest``."""
    digest = f"sha256:{hexd}"
    fd = os.open(dest, _DIR_FLAGS)
    try:
        with open(blob, "rb") as f:
            magic = f.read(4)
            f.seek(0)
            if magic.startswith(_ZSTD):
                _unpack_zstd(blob, fd, rules, digest)
                return
            stream: BinaryIO = f
            if magic.startswith(_GZIP):
                import gzip

                stream = gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[assignment]
            try:
                safetar.extract(stream, fd, layer=rules)
            except safetar.UnsafeArchive as e:
                raise TemplateError(f"layer {digest} refused: {e}") from None
            except (tarfile.TarError, EOFError, OSError) as e:
                if isinstance(e, OSError) and e.errno is not None:
                    raise
                raise CorruptLayer(f"layer {digest} is not a readable tar archive: {e}", value=digest) from None
    finally:
        os.close(fd)


def _unpack_zstd(blob: Path, fd: int, rules: safetar.LayerRules, digest: str) -> None:
    if shutil.which("zstd") is None:
        raise TemplateError(f"layer {digest} is zstd-compressed and zstd is not installed")
    proc = subprocess.Popen(["zstd", "-dcq", "--", str(blob)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    try:
        safetar.extract(proc.stdout, fd, layer=rules)  # type: ignore[arg-type]
    except safetar.UnsafeArchive as e:
        raise TemplateError(f"layer {digest} refused: {e}") from None
    except tarfile.TarError as e:
        raise CorruptLayer(f"layer {digest} is not a readable tar archive: {e}", value=digest) from None
    finally:
        proc.stdout.close()
        proc.kill()
        proc.wait()


def _step_name(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidArgument("a step cache key must be a non-empty string")
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def _read_small(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(200).decode("ascii", "replace").strip()
    except OSError:
        return None


def _rmtree(path: Path) -> None:
    """Remove a tree we made (shutil's fd-based walk: never follows a symlink in it)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    shutil.rmtree(path, ignore_errors=True)


__all__ = [
    "DEBIAN_EXCLUDES",
    "DIGEST",
    "MAX_LAYER_BYTES",
    "LayerStore",
    "debian_layer",
    "hex_of",
    "image_id_of",
    "image_ref",
]
