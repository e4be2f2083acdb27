"""The CLI's lifecycle options: metadata and auto-pause at create, ls by metadata and state, resume by id."""

from __future__ import annotations

import json
import secrets
import time

import pytest

from tests.conftest import POOLED_LIMITS_MB, cli, wait_for
from warmbox.engine.engine import Engine


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


def _left(sid: str) -> float:
    """Seconds until ``sid`` expires, by `warmbox ls --json`."""
    r = cli("ls", "--json")
    assert r.returncode == 0, r.stderr
    [rec] = [x for x in json.loads(r.stdout) if x["sandbox_id"] == sid]
    assert rec["state"] in ("ready", "running"), rec["state"]
    return rec["expires_at"] - time.time()


# Issue 34: a sandbox a pool handed out came back from a pause with the pool's 3600 s.
@pytest.mark.sandbox
@pytest.mark.one_host("waits for the iso pool of the session's home")
@pytest.mark.parametrize("kind", ["cold", "pooled"])
def test_exec_and_resume_of_a_paused_sandbox_keep_its_timeout(home, runc_ready, kind):
    if kind == "pooled":
        engine = Engine.for_home(home)
        engine.ensure_daemon()
        wait_for(lambda: engine.registry.pools.pool_counts("iso")[0] >= 1, 120, "the iso pool to fill")
    shape = ["--memory", str(POOLED_LIMITS_MB)] if kind == "pooled" else ["--no-pool"]
    r = cli("create", "--timeout", "120", "--json", *shape)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    sid = rec["sandbox_id"]
    try:
        assert rec["from_pool"] is (kind == "pooled")
        assert cli("pause", sid).returncode == 0
        r = cli("exec", sid, "--", "true")  # resumes it
        assert r.returncode == 0, r.stderr
        assert 60 < _left(sid) <= 121, "exec resumed it without the 120 s it was created with"
        assert cli("pause", sid).returncode == 0
        r = cli("resume", sid)
        assert r.returncode == 0, r.stderr
        assert 60 < _left(sid) <= 121, "resume did not give it the 120 s it was created with"
        assert cli("pause", sid).returncode == 0
        r = cli("resume", sid, "--timeout", "200")
        assert r.returncode == 0, r.stderr
        assert 140 < _left(sid) <= 201
    finally:
        cli("kill", sid)
