"""An E2B Python SDK from before the /v2 routes (e2b 2.45, installed beside the venv by
scripts/bootstrap) against the lane's warmbox serve: ``POST /sandboxes``, its connect route, and
its key check, which takes only ``e2b_<hex>``: the E2B form of a warmbox key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox

VERSION = "2.45.0"
SDK = Path(__file__).resolve().parents[2] / ".venv" / f"e2b-{VERSION}"
SCRIPT = """
import importlib.metadata
import e2b
from e2b import Sandbox

print("e2b", importlib.metadata.version("e2b"))
sb = Sandbox.create(metadata={"sdk": "old"})
print("run", sb.commands.run("echo $((1 + 1))").stdout.strip())
sb.files.write("/workspace/o.txt", "kept")
sb.pause()
again = Sandbox.connect(sb.sandbox_id)
print("same", again.sandbox_id == sb.sandbox_id, again.files.read("/workspace/o.txt"))
found = Sandbox.list(query=e2b.SandboxQuery(metadata={"sdk": "old"})).next_items()
print("listed", [s.sandbox_id for s in found] == [sb.sandbox_id])
print("killed", Sandbox.kill(sb.sandbox_id))
"""


def test_an_sdk_before_the_v2_routes(e2b_server):
    assert (SDK / f"e2b-{VERSION}.dist-info").is_dir(), f"e2b {VERSION} is not installed: scripts/bootstrap install"
    key = "e2b_" + e2b_server.key_a.encode().hex()
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **e2b_server.env, "E2B_API_KEY": key, "PYTHONPATH": str(SDK)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[:5] == [f"e2b {VERSION}", "run 2", "same True kept", "listed True", "killed True"]
