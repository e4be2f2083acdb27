"""Backends: where a sandbox runs. One file per tier; ``resolve`` maps tier names to them."""

from __future__ import annotations

from pathlib import Path

from warmbox.backends.base import Backend
from warmbox.errors import BackendUnavailable, InvalidArgument

# tier name -> (aliases, backend module:class); imported lazily so optional tools stay optional
TIERS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "container": (("container", "runc"), "warmbox.backends.runc:RuncBackend"),
    "gvisor": (("gvisor", "runsc"), "warmbox.backends.gvisor:GvisorBackend"),
    "microvm": (("microvm", "qemu"), "warmbox.backends.microvm:MicroVMBackend"),
    "isolate": (("isolate", "v8", "wasm"), None),
}


def canonical_tier(name: object) -> str:
    if not isinstance(name, str):
        raise InvalidArgument(f"tier must be a string, got {name!r}")
    for tier, (aliases, _) in TIERS.items():
        if name in aliases:
            return tier
    known = ", ".join(sorted(a for aliases, _ in TIERS.values() for a in aliases))
    raise InvalidArgument(f"unknown tier {name!r} (known: {known})")


def load(tier: str, runtime: Path) -> Backend:
    """The backend of a canonical tier name, or BackendUnavailable if this build lacks it."""
    target = TIERS[tier][1]
    if target is None:
        raise BackendUnavailable(tier, "not implemented in this version of warmbox")
    module, cls = target.split(":")
    import importlib

    return getattr(importlib.import_module(module), cls)(runtime)
