"""Fixtures of the engine tests. ``node_homes``: homes that are cluster nodes on this host
(``[cluster] node``), each with its own runtime, for the node tests (which must not change the
session's home); ``share`` makes a node use another node's registry (SQLite follows the symlink:
one database, one WAL)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from warmbox.engine import teardown
from warmbox.engine.daemon import down_home
from warmbox.engine.engine import Engine


class NodeHomes:
    def __init__(self) -> None:
        self.engines: list[Engine] = []

    def add(self, name: str, *, share: Engine | None = None) -> Engine:
        home = Path(f"/tmp/wbt-{secrets.token_hex(3)}")
        home.mkdir(mode=0o700)
        (home / "warmbox.toml").write_text(f'[daemon]\nidle_exit = 3\n\n[cluster]\nnode = "{name}"\n')
        if share is not None:
            os.symlink(share.home / "registry.db", home / "registry.db")
        engine = Engine.for_home(home)
        self.engines.append(engine)
        assert engine.node == name
        avail = engine.backend("container").probe()
        if not avail.available:
            pytest.fail(f"the container tier must run here (scripts/bootstrap installs it): {avail.reason}")
        return engine

    def close(self) -> None:
        """Kill every node's sandboxes, stop their daemons, then prove nothing is left behind."""
        left = []
        for engine in reversed(self.engines):
            for info, _ in engine.registry.sandboxes.list(include_pooled=True, local=True):
                asyncio.run(teardown.destroy(engine, info.sandbox_id, "test over"))
            asyncio.run(down_home(engine.home))
            asyncio.run(teardown.reconcile_node(engine))  # what a failed test left lost (no list shows it) goes too
            for sub in ("sandboxes", "runc"):
                d = engine.runtime / sub
                left += [f"{engine.node}:{sub}/{n}" for n in (sorted(os.listdir(d)) if d.is_dir() else [])]
            engine.registry.close()
            Engine._instances.pop(engine.home.resolve(), None)
            shutil.rmtree(engine.runtime, ignore_errors=True)
            shutil.rmtree(engine.home, ignore_errors=True)
        assert not left, f"nodes left {left}"


@pytest.fixture
def node_homes() -> Iterator[NodeHomes]:
    homes = NodeHomes()
    try:
        yield homes
    finally:
        homes.close()
