"""``warmbox bench e2b`` in a short mode: it runs both SDKs, reports its structure and goals, and
leaves nothing behind. It asserts behaviour (pool hits, both sides measured), never speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cli

pytestmark = pytest.mark.sandbox
pytest.importorskip("e2b_code_interpreter", reason="the e2b extra (pip install -e '.[e2b]')")


def test_bench_e2b_short(runc_ready):
    before = set(Path("/tmp").glob("wbbench-*"))  # another bench (a parallel session) may run meanwhile
    r = cli("bench", "e2b", "--runs", "2", "--execs", "3", "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not set(Path("/tmp").glob("wbbench-*")) - before, "the benchmark left its home behind"
    rep = json.loads(r.stdout)
    assert rep["warm"]["from_pool"] == {"e2b": 2, "warmbox": 2}
    for part, n in (("warm", 2), ("exec", 3)):
        assert {s: v["n"] for s, v in rep[part]["stats"].items()} == {"e2b": n, "warmbox": n}
    assert set(rep["goals"]) == {
        "e2b_warm_create_first_run_code_p50_ms<=15",
        "e2b_commands_run_true_p50_ms<=5",
    }


def test_bench_e2b_refuses_a_bad_range():
    r = cli("bench", "e2b", "--runs", "0")
    assert r.returncode != 0 and "runs" in r.stderr and "Traceback" not in r.stderr
