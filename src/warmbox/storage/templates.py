"""Template versions in a home's registry and their layers in the host's shared layer store, kept
in step: a recorded version pins its layers (every home's gc sees the pin), a removed one unpins
them, and :func:`collect` removes the layers nothing records or pins.

In a cluster (``[cluster] object_store``) the layer blobs travel through the shared object store,
content-addressed under ``layers/sha256/<hex>`` (not ``blobs/``: snapshots' gc owns that prefix):
:func:`share_layers` uploads a version's blobs before it is recorded, :func:`fetch_layers` brings
the ones a node lacks into its layer store (bounded, re-hashed, unpacked as hostile like any blob),
and :func:`collect_shared` deletes the blobs no template version of the shared registry names."""

from __future__ import annotations

import builtins
import re
import time
from collections.abc import Iterable
from pathlib import Path

from warmbox.errors import ArtifactCorrupt, CorruptLayer
from warmbox.models import LayerInfo, TemplateInfo
from warmbox.storage.layers import LayerStore, hex_of
from warmbox.storage.objects import ObjectStore
from warmbox.storage.registry import PG_KEY_PREFIX, Registry

PIN_PREFIX = "template:"


def pin_name(registry: Registry, tenant: str, name: str, version: int) -> str:
    """The pin of one template version: its registry's key (the SQLite file's path, or
    ``pg:<cluster id>/<node>``), tenant, name and version."""
    return f"{PIN_PREFIX}{registry.key}#{tenant}/{name}/{version}"


def pin_registry(pin: str) -> str:
    """The registry key a template pin names ("" if it is not a template pin)."""
    return pin[len(PIN_PREFIX) :].rpartition("#")[0] if pin.startswith(PIN_PREFIX) else ""


def registry_gone(key: str) -> bool:
    """Whether the registry a pin names is gone (a removed home's file). A PostgreSQL registry's
    key names no file: never gone from here (its pins go with its template versions)."""
    return bool(key) and not key.startswith(PG_KEY_PREFIX) and not Path(key).exists()


def add_template(registry: Registry, store: LayerStore, info: TemplateInfo) -> TemplateInfo:
    """TemplateStore.template_add, its layers pinned in the store (the record returned: its version)."""
    out = registry.templates.template_add(info)
    store.pin(pin_name(registry, out.tenant, out.name, out.version), out.layers)
    return out


def delete_template(
    registry: Registry, store: LayerStore, name: str, version: int | None = None, tenant: str = ""
) -> builtins.list[TemplateInfo]:
    """TemplateStore.template_delete, the removed versions' pins dropped (their layers stay until collect)."""
    removed = registry.templates.template_delete(name, version, tenant)
    for t in removed:
        store.unpin(pin_name(registry, t.tenant, t.name, t.version))
    return removed


def collect(
    registry: Registry, store: LayerStore, *, keep: Iterable[str] = (), min_age_s: float = 0.0
) -> builtins.list[str]:
    """Remove the layers no version of this registry records, no pin names and ``keep`` (e.g. the
    built-in image's, snapshots' recorded images') does not list; the digests removed. Pins of
    template versions whose registry file is gone (a removed home) are dropped first. Run it
    under the build lock, or with ``min_age_s``, so an in-flight build's layers stay."""
    for pin in store.pinned():
        if registry_gone(pin_registry(pin)):
            store.unpin(pin)
    return store.gc({*registry.templates.template_layers(), *keep}, min_age_s=min_age_s)


# ---- layers shared through the cluster's object store

LAYER_PREFIX = "layers/sha256"
SHARED_GRACE_S = 3600.0  # a shared blob younger than this may be a version being recorded: gc keeps it
_HEX = re.compile(r"[0-9a-f]{64}")


def layer_key(digest: str) -> str:
    """The object key of a layer blob: ``layers/sha256/<hex>`` (InvalidArgument for a non-digest)."""
    return f"{LAYER_PREFIX}/{hex_of(digest)}"


def share_layers(
    objects: ObjectStore, store: LayerStore, digests: Iterable[str], *, grace_s: float = SHARED_GRACE_S
) -> builtins.list[str]:
    """Upload the layer blobs the object store lacks; the digests uploaded. Create-once by
    head-then-put (same key, same bytes: a race writes the same object twice). A blob is re-hashed
    before it leaves (a damaged local copy is not spread). One already there but older than half
    the gc grace is written again, so a :func:`collect_shared` running meanwhile cannot take it
    before the version naming it is recorded (call this BEFORE recording the version)."""
    out = []
    for d in dict.fromkeys(digests):
        key = layer_key(d)
        if objects.exists(key):
            try:
                fresh = time.time() - objects.modified(key) < grace_s / 2
            except ArtifactCorrupt:  # deleted since
                fresh = False
            if fresh:
                continue
        store.verify(d)
        objects.put_file(key, store.blobs / hex_of(d))
        out.append(d)
    return out


def fetch_layer(objects: ObjectStore, store: LayerStore, digest: str, *, max_bytes: int | None = None) -> LayerInfo:
    """Bring one layer from the object store into ``store``: at most ``max_bytes`` read (default:
    what add_stream accepts), written under the store's tmp/, then added with add_blob, which
    re-hashes it against ``digest`` and unpacks it as hostile. CorruptLayer (nothing kept) if the
    object is missing, larger than the bound or not the digest's bytes; StorageError if the
    store cannot be reached."""
    key = layer_key(digest)
    limit = 2 * store.max_layer_bytes + (16 << 20) if max_bytes is None else max_bytes
    tmp = store.work_file("fetch")
    try:
        with open(tmp, "xb") as f:
            try:
                objects.get_bounded(key, f, limit)
            except CorruptLayer:
                raise
            except ArtifactCorrupt as e:
                raise CorruptLayer(
                    f"layer {digest} is not on this node and cannot be fetched from {objects.describe()}: {e}",
                    value=digest,
                ) from None
        try:
            return store.add_blob(tmp, digest=digest)
        except CorruptLayer as e:
            raise CorruptLayer(f"{e} (fetched from {objects.describe()}: refused)", value=digest) from None
    finally:
        tmp.unlink(missing_ok=True)


def fetch_layers(
    objects: ObjectStore, store: LayerStore, digests: Iterable[str], *, max_bytes: int | None = None
) -> builtins.list[str]:
    """fetch_layer for each digest whose blob ``store`` lacks; the digests fetched."""
    out = []
    for d in dict.fromkeys(digests):
        if not store.has(d):
            fetch_layer(objects, store, d, max_bytes=max_bytes)
            out.append(d)
    return out


def collect_shared(
    objects: ObjectStore, registry: Registry, *, grace_s: float = SHARED_GRACE_S, dry_run: bool = False
) -> builtins.list[str]:
    """Delete the shared layer blobs no template version of ``registry`` (the cluster's: every
    node's, every tenant's) names and older than ``grace_s``; the digests deleted (``dry_run``:
    only named). Keys under the prefix that are not ``<64 hex>`` are left alone."""
    keep = {d[7:] for d in registry.templates.template_layers() if d.startswith("sha256:")}
    now = time.time()
    removed = []
    for key in objects.list(LAYER_PREFIX):
        name = key.rpartition("/")[2]
        if key != f"{LAYER_PREFIX}/{name}" or not _HEX.fullmatch(name) or name in keep:
            continue
        try:
            if now - objects.modified(key) < grace_s:
                continue
        except ArtifactCorrupt:
            continue
        if not dry_run:
            objects.delete(key)
        removed.append(f"sha256:{name}")
    return removed


__all__ = [
    "LAYER_PREFIX",
    "PIN_PREFIX",
    "SHARED_GRACE_S",
    "add_template",
    "collect",
    "collect_shared",
    "delete_template",
    "fetch_layer",
    "fetch_layers",
    "layer_key",
    "pin_name",
    "pin_registry",
    "registry_gone",
    "share_layers",
]
