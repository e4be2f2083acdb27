"""The CLI as a user runs it: separate processes sharing the embedded registry."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli


@pytest.mark.sandbox
def test_run_prints_output_and_exits_with_status(home, runc_ready):
    r = cli("run", "--", "python3", "-c", "print(2+2)")
    assert (r.returncode, r.stdout) == (0, "4\n"), r.stderr
    r = cli("run", "--", "sh", "-c", "echo oops >&2; exit 3")
    assert r.returncode == 3 and r.stderr == "oops\n"


@pytest.mark.sandbox
def test_run_json_record(home, runc_ready):
    r = cli("run", "--json", "--", "sh", "-c", "exit 3")
    assert r.returncode == 3
    rec = json.loads(r.stdout)
    assert {"exit_code", "stdout", "stderr", "timed_out", "truncated", "duration_ms", "timings"} <= set(rec)
    assert rec["exit_code"] == 3 and rec["timed_out"] is False
    assert set(rec["timings"]) >= {"allocation", "filesystem", "runtime"}


@pytest.mark.sandbox
def test_create_exec_ls_kill_across_processes(home, runc_ready):
    r = cli("create", "--timeout", "120")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    try:
        assert cli("exec", sid, "--", "sh", "-c", "echo kept > /workspace/f").returncode == 0
        r = cli("exec", sid, "--", "cat", "/workspace/f")
        assert r.stdout == "kept\n"
        ls = json.loads(cli("ls", "--json").stdout)
        assert any(s["sandbox_id"] == sid and s["state"] == "ready" for s in ls)
        assert sid in cli("ls", "--timings").stdout
    finally:
        r = cli("kill", sid)
    assert r.returncode == 0 and "destroyed" in r.stdout
    r = cli("exec", sid, "--", "true")
    assert r.returncode == 125 and r.stderr.startswith("warmbox: error:") and "Traceback" not in r.stderr


def test_bad_input_is_one_line_error(home):
    for args in (
        ["run", "--tier", "nope", "--", "true"],
        ["run", "--timeout", "-5", "--", "true"],
        ["exec", "sb-000000000000", "--", "true"],
        ["run"],
        ["kill", "../x"],
        ["run", "--memory", "abc"],
    ):
        r = cli(*args)
        assert r.returncode == 125, (args, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)


def test_a_reader_that_leaves_ends_the_cli_quietly(tmp_path):
    """``warmbox advise ... | head -1``: the pipe's reader is gone when the CLI writes."""
    import os
    import subprocess
    import sys

    r, w = os.pipe()
    os.close(r)  # every write to w now fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "warmbox.cli.main", "advise", "--language", "python", "--untrusted"],
            stdout=w,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=60,
            env={**os.environ, "WARMBOX_HOME": str(tmp_path)},
        )
    finally:
        os.close(w)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == "", proc.stderr


@pytest.mark.sandbox
def test_doctor(home):
    r = cli("doctor", "--json")
    rows = {row["tier"]: row for row in json.loads(r.stdout)}
    assert rows["container"]["available"] is True
    assert rows["gvisor"]["available"] is True
    assert rows["microvm"]["available"] is True and "accelerator" in rows["microvm"]["reason"]
    assert rows["isolate"]["available"] is True and rows["isolate"]["reason"]
