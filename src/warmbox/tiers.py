"""The isolation tiers by name: canonical names, their aliases, and the module of each backend."""

from __future__ import annotations

from warmbox.errors import InvalidArgument

# tier name -> (aliases, backend "module:class"); the backend is imported lazily (backends.load),
# so a tier's optional tools stay optional. A new tier is one row here and one file in backends/.
TIERS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "container": (("container", "runc"), "warmbox.backends.runc:RuncBackend"),
    "gvisor": (("gvisor", "runsc"), "warmbox.backends.gvisor:GvisorBackend"),
    "microvm": (("microvm", "qemu"), "warmbox.backends.microvm:MicroVMBackend"),
    "isolate": (("isolate", "v8", "wasm"), None),
}


def canonical_tier(name: object) -> str:
    """The canonical name of a tier or one of its aliases; InvalidArgument naming the known ones."""
    if not isinstance(name, str):
        raise InvalidArgument(f"tier must be a string, got {name!r}")
    for tier, (aliases, _) in TIERS.items():
        if name in aliases:
            return tier
    known = ", ".join(sorted(a for aliases, _ in TIERS.values() for a in aliases))
    raise InvalidArgument(f"unknown tier {name!r} (known: {known})")
