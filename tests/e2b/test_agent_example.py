"""examples/e2b_agent.py, an agent written the way E2B's documentation writes one, run unchanged
(its own Python process, E2B's environment variables) against the lane's warmbox serve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox
pytest.importorskip("e2b_code_interpreter", reason="the e2b extra (pip install -e '.[e2b]')")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "e2b_agent.py"


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
