"""``warmbox advise``: the four questions on the command line (the decision, why, and why not the others)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli
from tests.engine.test_tier_selector import _available, _profile


@pytest.fixture
def profiled(home):
    """The session home with a measured profile of this host in its cache (removed after)."""
    from warmbox.engine import tierprofile
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    if not all(_available(engine)[t] for t in ("container", "gvisor", "microvm")):
        pytest.skip("this host cannot run every tier (warmbox doctor)")
    path = tierprofile.save_profile(home, _profile(engine))
    yield home
    path.unlink(missing_ok=True)


@pytest.mark.one_host("the tier profile it measures is in the session home; the cluster's nodes choose by their own")
def test_advise_prints_the_tier_why_and_why_not(profiled):
    r = cli("advise", "--language", "python", "--untrusted", "--io", "syscall-heavy")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "tier: microvm"
    assert "  + syscall-heavy work runs at ~7.3x the host's time here (measured:" in r.stdout
    assert any(line.startswith("  - container: too weak for untrusted code") for line in lines)
    assert any(line.startswith("  - gvisor: slower for syscall-heavy work: ~19.9x") for line in lines)

    r = cli("advise", "--language", "python", "--untrusted", "--json")
    choice = json.loads(r.stdout)
    assert choice["tier"] == "gvisor" and choice["profile_at"] > 0
    assert "slower for compute work: ~21.0x" in choice["rejected"]["microvm"]

    r = cli("advise", "--language", "python", "--trusted", "--io", "syscall-heavy", "--guest-kernel")
    assert r.stdout.startswith("tier: microvm\n") and "has a guest kernel of its own" in r.stdout


def test_advise_refuses_bad_questions_in_one_line(home):
    r = cli("advise", "--language", "cobol")
    assert r.returncode == 125 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "python, javascript, bash, c, wasm" in r.stderr
    r = cli("advise", "--io", "disk")
    assert r.returncode == 125 and "invalid choice: 'disk'" in r.stderr
    r = cli("advise", "--trusted", "--untrusted")
    assert r.returncode == 125 and "not allowed with argument" in r.stderr


def test_advise_without_a_strong_enough_tier_exits_1_with_every_reason(home):
    r = cli("advise", "--language", "wasm", "--untrusted")
    if r.returncode == 0:  # a tier of this build runs wasm (the isolate tier)
        assert r.stdout.startswith("tier: ")
        return
    assert r.returncode == 1 and r.stdout.startswith("no tier on this host fits: language=wasm")
    assert "  - container: does not run wasm" in r.stdout


@pytest.mark.sandbox
def test_create_with_the_questions_picks_the_tier_and_ls_shows_why(profiled, runc_ready):
    r = cli("create", "--trusted", "--io", "syscall-heavy", "--template", "shell", "--timeout", "60")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    try:
        row = next(s for s in json.loads(cli("ls", "--json").stdout) if s["sandbox_id"] == sid)
        assert row["tier"] == "container"
        assert row["requirements"] == {
            "language": "python",
            "trusted": True,
            "io": "syscall-heavy",
            "guest_kernel": False,
        }
        assert "trusted code: any isolation qualifies, so the cost decides" in row["tier_reasons"]
        assert row["tier_rejected"]["gvisor"].startswith("slower for syscall-heavy work")
    finally:
        assert cli("kill", sid).returncode == 0
    r = cli("create", "--tier", "gvisor", "--untrusted")
    assert r.returncode == 125 and 'pass tier="auto"' in r.stderr
