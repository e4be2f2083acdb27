"""The E2B lane: the official E2B SDKs (``e2b``, ``e2b-code-interpreter``: the ``e2b`` extra) drive
real sandboxes through one real `warmbox serve`, shared by the lane's modules."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from tests.conftest import ServerProc, start_server


@dataclasses.dataclass
class E2BServer:
    """The lane's server and two tenants' keys; ``env``: what an E2B client sets to use it."""

    server: ServerProc
    key_a: str
    key_b: str

    @property
    def env(self) -> dict[str, str]:
        return {"E2B_API_URL": self.server.url, "E2B_SANDBOX_URL": self.server.url, "E2B_API_KEY": self.key_a}


@pytest.fixture(scope="package")
def e2b_server(home: Path, runc_ready: None):
    """One `warmbox serve` for the lane (this package's modules share it; it stops when they are
    done); tenant A's key in E2B_API_KEY meanwhile (the SDKs read their settings from the
    environment, as E2B's documentation has users do). Ended by PID."""
    from warmbox.engine.engine import Engine

    server = start_server(home, home / "e2b-api.sock")
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")}
    try:
        registry = Engine.for_home(home).registry
        _k, key_a = registry.tenants.create_key("e2b-a")
        _k, key_b = registry.tenants.create_key("e2b-b")
        got = E2BServer(server, key_a, key_b)
        os.environ.pop("E2B_DOMAIN", None)
        os.environ.update(got.env)
        yield got
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        status = server.stop()
        assert status == 0, f"warmbox serve exited with {status} on SIGTERM:\n{server.output()}"
