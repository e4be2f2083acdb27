"""The CLI's lifecycle options: metadata and auto-pause at create, ls by metadata and state, resume by id."""

from __future__ import annotations

import json
import secrets

import pytest

from tests.conftest import cli


@pytest.mark.sandbox
def test_create_with_metadata_and_a_lifecycle_then_ls_by_query_and_resume(home, runc_ready):
    run = secrets.token_hex(4)
    r = cli("create", "--template", "shell", "--metadata", f"run={run}", "--idle-pause", "600", "--on-timeout", "pause")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    try:
        r = cli("ls", "--json", "--metadata", f"run={run}")
        assert r.returncode == 0, r.stderr
        [rec] = json.loads(r.stdout)
        assert rec["sandbox_id"] == sid and rec["metadata"] == {"run": run}
        assert rec["lifecycle"] == {"on_timeout": "pause", "idle_pause_after": 600.0, "auto_resume": False}
        assert json.loads(cli("ls", "--json", "--metadata", f"run={run}", "--state", "paused").stdout) == []
        assert cli("pause", sid).returncode == 0
        paused = json.loads(cli("ls", "--json", "--metadata", f"run={run}", "--state", "paused").stdout)
        assert [p["sandbox_id"] for p in paused] == [sid]
        r = cli("resume", sid, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["sandbox_id"] == sid  # the same sandbox, not a new one
        r = cli("ls", "--state", "sleeping")
        assert r.returncode == 125 and "state" in r.stderr and "Traceback" not in r.stderr
        r = cli("create", "--metadata", "novalue")
        assert r.returncode == 125 and "KEY=VALUE" in r.stderr
    finally:
        cli("kill", sid)
