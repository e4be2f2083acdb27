"""The session-end check (tests/leftovers.py) finds what a home of the run left, and only that."""

from __future__ import annotations

import subprocess
import sys

from tests import leftovers


def test_a_process_of_a_run_home_is_found_and_another_homes_is_not(tmp_path):
    ours, other = tmp_path / "runs" / "h", tmp_path / "elsewhere"
    for h in (ours, other):
        h.mkdir(parents=True)
    (ours / "registry.db").write_bytes(b"")  # a home, as far as the finder goes
    assert leftovers.homes_under(tmp_path / "runs") == [ours]
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [subprocess.Popen([*sleeper, str(h / "x")]) for h in (ours, other)]
    try:
        found = leftovers.scan([leftovers.Home(ours)])
        assert [line.split()[1] for line in found] == [str(procs[0].pid)], found
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert leftovers.scan([leftovers.Home(ours)]) == []
