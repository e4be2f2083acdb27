"""examples/e2b_agent.py and examples/e2b_agent.mjs, one agent written the way E2B's documentation
writes it in each language, run unchanged (their own process, E2B's environment variables, the
official SDKs: Python's from the e2b extra, JavaScript's from tests/e2b/package.json) against the
lane's warmbox serve."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox
pytest.importorskip("e2b_code_interpreter", reason="the e2b extra (pip install -e '.[e2b]')")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "e2b_agent.py"
NODE_MODULES = Path(__file__).resolve().parent / "node_modules"


def test_the_e2b_agent_runs_unchanged(e2b_server, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(EXAMPLE), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **e2b_server.env},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "'sales.csv'" in out.split("\n")[0]  # files.list('.') of the home it wrote into
    assert "east      3\nnorth    17\nsouth     5\n" in out  # the model's groupby, printed in the sandbox
    assert "result: 6.25" in out
    assert "shell: ['5', 'Python'," in out
    charts = sorted(tmp_path.glob("chart-1-*.png"))
    assert charts and charts[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_e2b_agent_runs_unchanged_in_javascript(e2b_server, tmp_path: Path) -> None:
    node = shutil.which("node")
    assert node, "Node.js is needed (scripts/bootstrap installs it)"
    assert (NODE_MODULES / "@e2b" / "code-interpreter").is_dir(), (
        "E2B's JavaScript SDKs are not installed: scripts/bootstrap install (npm install in tests/e2b)"
    )
    # the script as it is, beside the lane's node_modules (Node resolves packages from the script's folder)
    work = tmp_path / "agent"
    work.mkdir()
    shutil.copyfile(EXAMPLES / "e2b_agent.mjs", work / "e2b_agent.mjs")
    (work / "node_modules").symlink_to(NODE_MODULES)
    r = subprocess.run(
        [node, str(work / "e2b_agent.mjs"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **e2b_server.env},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "'sales.csv'" in out.split("\n")[0]
    assert "east      3\nnorth    17\nsouth     5\n" in out
    assert "result: 6.25" in out
    assert "js: '2,4,6'" in out  # the last expression's value as text (Node's inspect of a string)
    assert "shell: [ '5', 'Python'," in out
    charts = sorted(tmp_path.glob("chart-1-*.png"))
    assert charts and charts[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
