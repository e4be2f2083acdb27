"""Which image a sandbox runs: a template's latest built version, a snapshot's recorded image, or
the built-in image (one Debian tree for templates base, pydata and shell on every tier).

The built-in image is two layers in the host's layer store: the mmdebstrap tree of
``warmbox.images.BUILTIN_PACKAGES`` and a small one of warmbox's files (the sandbox user, git's
and matplotlib's settings, matplotlib's font list made by the image's own Python). It is built
once per ``images.builtin_key()`` (``scripts/bootstrap install`` does it; otherwise the first
sandbox that needs it waits for it, under a host-wide lock) and recorded in
``<image cache>/<builtin key>.json``: what a restore of an older snapshot finds its image by.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from warmbox import images as spec
from warmbox.backends import microvm_image
from warmbox.backends._host import GITCONFIG, GUEST_GID, GUEST_UID
from warmbox.backends.runc import MATPLOTLIBRC, keep_only_font_list
from warmbox.errors import SandboxStartError, TemplateMismatch, TemplateNotFound
from warmbox.models import ImageRef
from warmbox.storage import layers

FONT_DIR = "opt/warmbox/matplotlib"  # the font list code contexts copy into the user's cache
_ETC = {
    "hostname": "sandbox\n",
    "hosts": "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n",
    "timezone": "Etc/UTC\n",
    "matplotlibrc": MATPLOTLIBRC,
    "gitconfig": GITCONFIG,
}


def cache() -> Path:
    """The host-wide image cache (``WARMBOX_IMAGE_CACHE`` overrides)."""
    return microvm_image.cache_dir()


def store() -> layers.LayerStore:
    """The host's layer store, under the image cache."""
    return layers.LayerStore(cache())


@dataclasses.dataclass(frozen=True)
class BuiltinRecord:
    """One build of the built-in image: its layer digests (bottom first) and image id."""

    key: str
    image_id: str
    layers: tuple[str, ...]
    built_at: float
    build_s: float


def _record_path(key: str) -> Path:
    return cache() / f"{key}.json"


def _read_record(path: Path) -> BuiltinRecord | None:
    try:
        raw = json.loads(path.read_text())
        return BuiltinRecord(
            key=str(raw["key"]),
            image_id=str(raw["image_id"]),
            layers=tuple(str(d) for d in raw["layers"]),
            built_at=float(raw["built_at"]),
            build_s=float(raw["build_s"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def builtin_record() -> BuiltinRecord | None:
    """The current built-in image's record, or None while it is not built (``warmbox doctor``)."""
    return _read_record(_record_path(spec.builtin_key()))


def builtin_records() -> list[BuiltinRecord]:
    """Every built-in image recorded on this host (older package lists too), newest first."""
    found = [_read_record(p) for p in cache().glob("builtin-*.json")]
    return sorted((r for r in found if r is not None), key=lambda r: -r.built_at)


def _layer_dirs(template: str, version: int, image_id: str, digests: tuple[str, ...]) -> tuple[str, ...]:
    """The unpacked directories of an image's layers: TemplateMismatch if one is no longer in the
    store (removed by gc), CorruptLayer if one fails its digest."""
    st = store()
    for d in digests:
        if not st.has(d):
            raise TemplateMismatch(
                f"template {template!r} version {version} (image {image_id}) needs layer {d}, "
                "which is no longer in the layer store",
                template=template,
            )
    return tuple(st.get(d).path for d in digests)


def _ref(template: str, version: int, image_id: str, digests: tuple[str, ...]) -> ImageRef:
    return ImageRef(template, version, image_id, _layer_dirs(template, version, image_id, digests))


_built: dict[str, BuiltinRecord] = {}  # per process: the record of the current key, once read


def builtin_image(template: str = "base", *, build: bool = True) -> ImageRef:
    """The built-in image as ``template`` (one of images.BUILTIN_TEMPLATES, or a warm-up-only
    template of warmbox.toml): built first if missing (minutes; ``build=False``: TemplateNotFound
    instead)."""
    key = spec.builtin_key()
    rec = _built.get(key) or builtin_record()
    if rec is None:
        if not build:
            raise TemplateNotFound(
                "the built-in image is not built yet (scripts/bootstrap install builds it)", template=template
            )
        rec = build_builtin()
    try:
        ref = _ref(template, spec.BUILTIN_VERSION, rec.image_id, rec.layers)
        if key not in _built:  # once per process: a build from before layer pins gets its pin
            store().pin(f"builtin:{key}", rec.layers)
    except TemplateMismatch:  # its layers were collected: build it again
        if not build:
            raise
        _record_path(key).unlink(missing_ok=True)
        _built.pop(key, None)
        rec = build_builtin()
        ref = _ref(template, spec.BUILTIN_VERSION, rec.image_id, rec.layers)
    _built[key] = rec
    return ref


def builtin_image_id() -> str | None:
    """The current built-in image's id from its record (its layers not looked up), or None while
    it is not built."""
    rec = _built.get(spec.builtin_key()) or builtin_record()
    return rec.image_id if rec is not None else None


def builtin_by_id(template: str, image_id: str) -> ImageRef:
    """The built-in image whose id is ``image_id`` (a snapshot's), current or older: its layers
    must still be in the store (TemplateMismatch otherwise)."""
    for rec in builtin_records():
        if rec.image_id == image_id:
            return _ref(template, spec.BUILTIN_VERSION, rec.image_id, rec.layers)
    raise TemplateMismatch(
        f"the snapshot ran built-in image {image_id}, which this host no longer has "
        f"(the built-in package list changed since); restore it on a host that has it",
        template=template,
    )


def build_builtin() -> BuiltinRecord:
    """Build the built-in image (once per key, host-wide: other builders wait for this one)."""
    key = spec.builtin_key()
    root = cache()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".builtin-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rec = builtin_record()
        if rec is not None:
            try:
                _ref("base", spec.BUILTIN_VERSION, rec.image_id, rec.layers)
                return rec
            except TemplateMismatch:
                pass
        t0 = time.monotonic()
        st = store()
        debian = microvm_image.debian_tree(root)  # mmdebstrap, shared with the microVM image's build
        base = st.add_tree(debian, owner_base=0)  # a plain tree: root is 0
        work = Path(tempfile.mkdtemp(prefix=".tmp-builtin-", dir=root))
        try:
            top = work / "layer"
            _warmbox_files(debian, top)
            config = st.add_tree(top, owner_base=0)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        digests = (base.digest, config.digest)
        rec = BuiltinRecord(
            key=key,
            image_id=layers.image_id_of(digests, (), "", ""),
            layers=digests,
            built_at=time.time(),
            build_s=round(time.monotonic() - t0, 1),
        )
        st.pin(f"builtin:{key}", digests)  # a layer gc (of any home) keeps them
        tmp = root / f".{key}.json.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(rec), indent=1))
        os.rename(tmp, _record_path(key))
        return rec


def _warmbox_files(debian: Path, out: Path) -> None:
    """The top layer of the built-in image: /etc files for the sandbox user, mount points, and
    matplotlib's font list made by the image's Python (chroot into the tree, as root: the tree is
    the build's own, no sandbox ever wrote it)."""
    (out / "etc").mkdir(parents=True)
    for name, text in _ETC.items():
        (out / "etc" / name).write_text(text)
    for name, line in (("passwd", "user:x:1000:1000:user:/home/user:/bin/bash\n"), ("group", "user:x:1000:\n")):
        # Debian's system users stay (apt's _apt, ...); the sandbox user is uid 1000
        have = [x for x in (debian / "etc" / name).read_text().splitlines(keepends=True) if x.strip()]
        taken = any(x.split(":")[2:3] == ["1000"] or x.startswith("user:") for x in have)
        (out / "etc" / name).write_text("".join(have) + ("" if taken else line))
    os.symlink("/usr/share/zoneinfo/Etc/UTC", out / "etc/localtime")
    for d in ("workspace", "home/user", "run", "tmp", "opt/warmbox"):
        (out / d).mkdir(parents=True, exist_ok=True)
    os.chmod(out / "tmp", 0o1777)
    os.chown(out / "home/user", GUEST_UID, GUEST_GID)
    seed = "/tmp/.wb-fonts-" + hashlib.sha256(os.urandom(8)).hexdigest()[:8]
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    try:
        r = subprocess.run(
            [chroot, str(debian), "/usr/bin/python3", "-I", "-c", "import matplotlib.font_manager"],
            env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "MPLCONFIGDIR": seed, "MATPLOTLIBRC": "/nonexistent"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        if r.returncode != 0:
            raise SandboxStartError(f"building the built-in image: matplotlib's font list: {r.stderr.strip()[-300:]}")
        made = debian / seed.lstrip("/")
        keep_only_font_list(made)
        shutil.copytree(made, out / FONT_DIR)
    finally:
        shutil.rmtree(debian / seed.lstrip("/"), ignore_errors=True)


def image_ref(info, object_store: str = "") -> ImageRef:
    """The ImageRef of a built template version (``models.TemplateInfo``): its layers in the store
    (TemplateMismatch if one is gone, CorruptLayer if one fails its digest). ``object_store``: the
    cluster's shared store URL (``[cluster] object_store``); the layers this host lacks are fetched
    from it first (storage.templates.fetch_layers: bounded, re-hashed; CorruptLayer if refused)."""
    st = store()
    if object_store and any(not st.has(d) for d in info.layers):
        from warmbox.storage import templates
        from warmbox.storage.objects import open_store

        templates.fetch_layers(open_store(object_store), st, info.layers)
    _layer_dirs(info.name, info.version, info.image_id, info.layers)
    return layers.image_ref(st, info)


def main() -> int:
    """``python -m warmbox.engine.images``: build the built-in image unless built (scripts/bootstrap)."""
    import sys

    rec = builtin_record()
    if rec is not None:
        try:
            _ref("base", spec.BUILTIN_VERSION, rec.image_id, rec.layers)
            print(f"built-in image {rec.key}: built ({rec.image_id})")
            return 0
        except TemplateMismatch:
            pass
    print(f"built-in image {spec.builtin_key()}: building (mmdebstrap, a few minutes) ...", file=sys.stderr)
    rec = build_builtin()
    print(f"built-in image {rec.key}: built in {rec.build_s:.0f} s ({rec.image_id})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
