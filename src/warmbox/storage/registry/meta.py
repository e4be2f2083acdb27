"""MetaStore: the registry's own small facts (meta_text)."""

from __future__ import annotations

from warmbox.storage.registry.db import Store, _retried


class MetaStore(Store):
    """The registry's own small facts (meta_text)."""

    def meta_text(self, key: str) -> str:
        row = self._read("SELECT value FROM meta_text WHERE key=?", (key,))
        return row[0] if row else ""

    @_retried
    def set_meta_text(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute(self._sql.upsert("meta_text", ("key", "value"), ("key",)), (key, value))

    @_retried
    def add_meta_text(self, key: str, value: str) -> None:
        """Set ``key`` only if it has no value yet (two processes racing keep the first's)."""
        with self._tx() as db:
            db.execute(self._sql.upsert("meta_text", ("key", "value"), ("key",), update=()), (key, value))
