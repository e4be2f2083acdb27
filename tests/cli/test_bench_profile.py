"""``warmbox bench profile`` in a short mode (two tiers, 0.1 s per loop): it runs the loops in real
sandboxes and on the host, caches the ratios in the home, and the selector reads them. Structure and
plausibility only, never speed goals."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import cli

pytestmark = pytest.mark.in_process("bench profile runs and caches in its home's engine in process")


@pytest.mark.sandbox
def test_bench_profile_short_is_cached_and_read_by_the_selector(home, runc_ready):
    from warmbox.engine import tierprofile
    from warmbox.engine.engine import Engine
    from warmbox.models import Requirements

    engine = Engine.for_home(home)
    if not next(c for c in tierprofile.candidates(engine) if c.tier == "gvisor").available:
        pytest.skip("this host cannot run gvisor")
    path = tierprofile.profile_path(home)
    path.unlink(missing_ok=True)
    try:
        r = cli("bench", "profile", "--tier", "container", "--tier", "runsc", "--budget", "0.1", "--json", timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        rep = json.loads(r.stdout)
        assert rep["cached_at"] == str(path) and path.is_file()
        profile, why = tierprofile.load_profile(home)
        assert profile is not None, why
        assert profile.measured_at == rep["profile"]["measured_at"]
        rows = {t.tier: t for t in profile.tiers}
        assert set(rows) == {"container", "gvisor"}
        assert profile.skipped["microvm"] == "not asked for (--tier)"
        for t in rows.values():
            ratios = (t.compute, t.syscall, t.fork, t.files, t.socket)
            assert all(math.isfinite(x) and x > 0 for x in ratios), t
            assert t.cost_note == engine.backend(t.tier).capabilities().cost_note
            assert math.isclose(t.syscall, (t.fork * t.files * t.socket) ** (1 / 3), rel_tol=0.02)
        assert len(rep["host_runs_us"]) == 3 and all(v > 0 for v in profile.host_us.values())
        if "ptrace" in rows["gvisor"].cost_note:  # each syscall is two ptrace stops: fork costs far more there
            assert rows["gvisor"].fork > rows["gvisor"].compute
        choice = tierprofile.choose(engine, Requirements("python", trusted=True))
        assert choice.profile_at == profile.measured_at
        assert any("measured" in reason for reason in choice.reasons)

        r = cli("bench", "profile", "--budget", "0")
        assert r.returncode == 125 and "--budget is seconds per loop" in r.stderr
    finally:
        path.unlink(missing_ok=True)
