"""The registry's schema, for ``warmbox db``: where a home's registry is, its version, a migration."""

from __future__ import annotations

from pathlib import Path

from warmbox.config import load
from warmbox.storage.registry import SCHEMA_VERSION, migrate, redacted, schema_version
from warmbox.storage.sql import is_url


def location(home: Path, given: str | None = None) -> tuple[Path | str, str]:
    """(where the registry is, how to show it: a URL without its password). given: a
    ``postgresql://`` URL or a SQLite file; default ``[cluster] registry``, else the home's file."""
    if given:
        where: Path | str = given if is_url(given) else Path(given)
    else:
        where = load(home).cluster.registry or home / "registry.db"
    return where, redacted(str(where)) if is_url(where) else str(where)


__all__ = ["SCHEMA_VERSION", "location", "migrate", "schema_version"]
