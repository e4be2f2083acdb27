"""Backends: where a sandbox runs. One file per tier; ``load`` makes the backend of a tier (see warmbox.tiers)."""

from __future__ import annotations

from pathlib import Path

from warmbox.backends.base import Backend
from warmbox.errors import BackendUnavailable
from warmbox.tiers import TIERS, canonical_tier

__all__ = ["TIERS", "Backend", "canonical_tier", "load"]


def load(tier: str, runtime: Path) -> Backend:
    """The backend of a canonical tier name, or BackendUnavailable if this build lacks it."""
    target = TIERS[tier][1]
    if target is None:
        raise BackendUnavailable(tier, "not implemented in this version of warmbox")
    module, cls = target.split(":")
    import importlib

    return getattr(importlib.import_module(module), cls)(runtime)
