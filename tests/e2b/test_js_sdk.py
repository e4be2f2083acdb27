"""E2B's JavaScript SDKs (``e2b``, ``@e2b/code-interpreter`` as pinned in tests/e2b/package.json)
under Node against the lane's warmbox serve: tests/e2b/js/sdk_lane.mjs runs create, commands
(foreground, exit code, background with stdin, list, kill), files, run_code (text, an error, a PNG
chart), the tenant wall, metrics history, a snapshot and a sandbox from it, a network update,
pause and connect, and kill; each check prints ``ok <name>``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox

HERE = Path(__file__).resolve().parent
CHECKS = (
    "commands.foreground",
    "commands.exit_code",
    "commands.stdin",
    "commands.list",
    "commands.kill",
    "files",
    "run_code.text",
    "run_code.error",
    "run_code.png",
    "tenant_wall",
    "snapshot_metrics_network",
    "pause_connect",
    "kill",
)


def test_the_javascript_sdks_drive_a_sandbox(e2b_server, tmp_path: Path) -> None:
    node = shutil.which("node")
    assert node, "Node.js is needed (scripts/bootstrap installs it)"
    assert (HERE / "node_modules" / "@e2b" / "code-interpreter").is_dir(), (
        "E2B's JavaScript SDKs are not installed: scripts/bootstrap install (npm install in tests/e2b)"
    )
    # beside the lane's node_modules: Node resolves packages from the script's folder
    shutil.copyfile(HERE / "js" / "sdk_lane.mjs", tmp_path / "sdk_lane.mjs")
    (tmp_path / "node_modules").symlink_to(HERE / "node_modules")
    r = subprocess.run(
        [node, str(tmp_path / "sdk_lane.mjs")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **e2b_server.env, "KEY_B": e2b_server.key_b},
    )
    passed = [line[3:] for line in r.stdout.splitlines() if line.startswith("ok ")]
    assert r.returncode == 0, f"passed {passed}; then:\n{r.stderr[-4000:]}"
    assert tuple(passed) == CHECKS
    assert r.stdout.rstrip().endswith("done")
