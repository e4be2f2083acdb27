"""Template versions in a home's registry and their layers in the host's shared layer store, kept
in step: a recorded version pins its layers (every home's gc sees the pin), a removed one unpins
them, and :func:`collect` removes the layers nothing records or pins."""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from pathlib import Path

from warmbox.models import TemplateInfo
from warmbox.storage.layers import LayerStore
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
    """Registry.template_add, its layers pinned in the store (the record returned: its version)."""
    out = registry.template_add(info)
    store.pin(pin_name(registry, out.tenant, out.name, out.version), out.layers)
    return out


def delete_template(
    registry: Registry, store: LayerStore, name: str, version: int | None = None, tenant: str = ""
) -> builtins.list[TemplateInfo]:
    """Registry.template_delete, the removed versions' pins dropped (their layers stay until collect)."""
    removed = registry.template_delete(name, version, tenant)
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
    return store.gc({*registry.template_layers(), *keep}, min_age_s=min_age_s)


__all__ = ["PIN_PREFIX", "add_template", "collect", "delete_template", "pin_name", "pin_registry", "registry_gone"]
