"""Modules run on first use of one of their attributes (importlib's LazyLoader): names a module needs
for its annotations or on some paths only, without their import cost on every other (issue 38)."""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing's own costs an import; mypy reads any TYPE_CHECKING as True
if TYPE_CHECKING:
    from types import ModuleType


def lazy_module(name: str) -> ModuleType:
    """The module ``name``, run on first use of one of its attributes (its parent packages are
    imported now). Already imported: that module."""
    if name in sys.modules:
        return sys.modules[name]
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module {name}")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


__all__ = ["lazy_module"]
