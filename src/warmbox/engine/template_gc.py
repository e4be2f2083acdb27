"""Template gc: the layers nothing uses any more and the microVM roots of images nothing runs.

Layers live in the host's shared layer store (see ``storage.templates``): this home keeps its
template versions' layers, the built-in image builds' and those of every image its live or
paused sandboxes and snapshots recorded; other homes' template versions pin theirs. A microVM root
(``<cache>/microvm-roots/<image id[:32]>-<agent hash>.ext4``) goes when no template version,
built-in build, sandbox or snapshot of this home names its image and no other home's registry (the
pins name them) does either, or when it was made for another guest agent: a restore (resume,
fork, template snapshot) always runs on the current agent's root and refuses a disk made with
another, so an older agent's root serves nothing new (a VM running on it keeps its open file).
Everything runs under the host's build lock, so no build's young layers are taken."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sqlite3
from pathlib import Path

from warmbox import operations as ops
from warmbox.backends import microvm_image
from warmbox.engine import images
from warmbox.engine.engine import Engine
from warmbox.storage import templates as stored
from warmbox.storage.layers import LayerStore, hex_of
from warmbox.storage.objects import open_store
from warmbox.storage.registry import PG_KEY_PREFIX, Registry

_ROOT_NAME = re.compile(r"([0-9a-f]{16,32})-([0-9a-f]{16})\.ext4")


def _size(path: Path) -> int:
    """Bytes ``path`` takes on disk (allocated blocks), links never followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    total = st.st_blocks * 512
    if not os.path.isdir(path) or os.path.islink(path):
        return total
    for parent, dirs, files in os.walk(path):  # never follows links (followlinks=False)
        for name in (*dirs, *files):
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(parent, name)).st_blocks * 512
    return total


def _layer_bytes(store: LayerStore, digest: str) -> int:
    h = hex_of(digest)
    return _size(store.blobs / h) + _size(store.dirs / h)


def recorded_images(engine: Engine) -> set[str]:
    """Image ids this home's sandboxes (not destroyed) and snapshots recorded."""
    return engine.registry.templates.recorded_image_ids()


def layers_in_use(engine: Engine) -> set[str]:
    """Layer digests a layer gc must keep for this home: every template version's (of any
    tenant) and every built-in image build's recorded on this host (snapshots of an older
    built-in image restore on it). Other homes share the store: a host-wide gc unions theirs."""
    return engine.registry.templates.template_layers() | {d for r in images.builtin_records() for d in r.layers}


def _other_homes_images(store: LayerStore, own: Registry) -> set[str] | None:
    """Image ids the other homes that pin layers (their registries) record: template versions,
    sandboxes not destroyed, snapshots; None when one cannot be read (then nothing is known).
    Another node of the same cluster shares this registry (read already); another PostgreSQL
    registry cannot be read from here (its key holds no URL): then nothing is known."""
    out: set[str] = set()
    paths = set()
    cluster = own.key.rpartition("/")[0] + "/" if own.shared else None
    for pin in store.pinned():
        key = stored.pin_registry(pin)
        if not key or key == own.key or (cluster is not None and key.startswith(cluster)):
            continue
        if key.startswith(PG_KEY_PREFIX):
            return None
        paths.add(key)
    for path in sorted(paths):
        if stored.registry_gone(path):
            continue  # a removed home: collect drops its pins
        try:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
            try:
                rows = db.execute(
                    "SELECT image_id FROM templates UNION SELECT image_id FROM sandboxes WHERE state<>'destroyed' "
                    "UNION SELECT image_id FROM snapshots"
                ).fetchall()
            finally:
                db.close()
        except sqlite3.Error:
            return None
        out.update(r[0] for r in rows if isinstance(r[0], str))
    return out


def _lock(cache: Path) -> int:
    """The host's build lock (engine/builder.py holds it for a whole build), blocking."""
    cache.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache / "build.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def gc(engine: Engine, *, dry_run: bool = False, min_age_s: float = 0.0) -> ops.TemplateGcReport:
    """Remove (``dry_run``: only name) the unused layers and microVM roots; what went and its bytes."""
    cache = images.cache()
    store = images.store()
    fd = _lock(cache)
    try:
        used_ids = recorded_images(engine)
        keep = set(layers_in_use(engine))
        infos = engine.registry.templates.template_list()
        for info in infos:
            if info.image_id in used_ids:
                keep.update(info.layers)
        builtin = images.builtin_records()
        for rec in builtin:
            if rec.image_id in used_ids:
                keep.update(rec.layers)
        if dry_run:
            own = {hex_of(d) for d in keep} | {hex_of(d) for ds in _live_pins(store).values() for d in ds}
            layers = [d for d in store.digests() if hex_of(d) not in own]
            freed = sum(_layer_bytes(store, d) for d in layers)
        else:
            sizes = {d: _layer_bytes(store, d) for d in store.digests()}
            layers = stored.collect(engine.registry, store, keep=keep, min_age_s=min_age_s)
            freed = sum(sizes.get(d, 0) for d in layers)
        ids = used_ids | {i.image_id for i in infos} | {r.image_id for r in builtin}
        others = _other_homes_images(store, engine.registry)
        roots, kept, root_bytes = _roots(cache, ids, others, dry_run)
        url = engine.settings().cluster.object_store
        shared = stored.collect_shared(open_store(url), engine.registry, dry_run=dry_run) if url else []
    finally:
        os.close(fd)
    return ops.TemplateGcReport(
        tuple(layers), tuple(roots), freed + root_bytes, dry_run, tuple(kept), shared_layers=tuple(shared)
    )


def _live_pins(store: LayerStore) -> dict[str, tuple[str, ...]]:
    """The pins a collect keeps (those of removed homes go)."""
    out = {}
    for name, ds in store.pinned().items():
        if stored.registry_gone(stored.pin_registry(name)):
            continue
        out[name] = ds
    return out


def _roots(cache: Path, ids: set[str], others: set[str] | None, dry_run: bool) -> tuple[list[str], list[str], int]:
    """(roots removed, roots kept because other homes could not be read, bytes freed)."""
    roots_dir = cache / microvm_image.ROOTS
    if not roots_dir.is_dir():
        return [], [], 0
    current = microvm_image.agent_hash()
    mine = {i.removeprefix("sha256:")[:32] for i in ids if i}
    theirs = None if others is None else {i.removeprefix("sha256:")[:32] for i in others if i}
    removed, kept, freed = [], [], 0
    with open(roots_dir / ".lock", "a") as lock:  # image_root's: no root is half-made meanwhile
        fcntl.flock(lock, fcntl.LOCK_EX)
        for entry in sorted(os.listdir(roots_dir)):
            m = _ROOT_NAME.fullmatch(entry)
            if m is None:
                continue
            image, agent = m.groups()
            if agent == current and image in mine:
                continue
            if agent == current and (theirs is None or image in theirs):
                if theirs is None:
                    kept.append(entry)
                continue
            path = roots_dir / entry
            size = _size(path)
            if not dry_run:
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
            removed.append(entry)
            freed += size
    return removed, kept, freed


__all__ = ["gc", "recorded_images"]
