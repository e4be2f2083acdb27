"""examples/ run as a user runs them: a separate Python process, in process or (--api=http) over
HTTP through WARMBOX_API_URL, against real sandboxes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.sandbox
def test_e2b_port_runs_and_draws_its_chart(home: Path, runc_ready: None, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / "e2b_port.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stdout: 14" in r.stdout  # the cell's print
    assert "x,y\n1,1\n2,4\n3,9\n" in r.stdout  # the file, served by the background server via get_host
    chart = tmp_path / "chart0.png"
    data = chart.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, len(data)
