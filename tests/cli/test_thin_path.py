"""The CLI's thin path (issue 38): run, exec, ls and kill reach a running ``warmbox serve`` of the
home on its unix socket instead of building an engine, and --json says which path was taken."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import cli, start_server


@pytest.mark.sandbox
def test_run_exec_ls_kill_go_to_the_running_server(home, runc_ready):
    from warmbox.cli.thin import home_socket

    if os.environ.get("WARMBOX_API_URL"):
        pytest.skip("a named server (the HTTP lanes) is the path there")
    server = start_server(home, home_socket(), tcp=False)
    sid = ""
    try:
        r = cli("run", "--json", "--", "sh", "-c", "echo out; echo err >&2; exit 3")
        rec = json.loads(r.stdout)
        assert (r.returncode, rec["via"], rec["stdout"], rec["stderr"]) == (3, "server", "out\n", "err\n"), r.stderr
        assert "first_command" in rec["timings"] and rec["sandbox_id"]
        sid = cli("create", "--timeout", "120").stdout.strip()
        r = cli("exec", sid, "--", "sh", "-c", "echo streamed; exit 4")  # output streamed as the command writes it
        assert (r.returncode, r.stdout) == (4, "streamed\n"), r.stderr
        r = cli("exec", "--json", "-e", "A=1", sid, "--", "sh", "-c", "echo $A")
        assert json.loads(r.stdout)["via"] == "server" and json.loads(r.stdout)["stdout"] == "1\n", r.stderr
        step = ("exec", "--json", "--idempotency-key", "k1", sid, "--", "sh", "-c", "echo $$ >> /tmp/k; wc -l < /tmp/k")
        keyed = [json.loads(cli(*step).stdout) for _ in range(2)]  # a replayed step runs once
        assert [(k["via"], k["stdout"]) for k in keyed] == [("server", "1\n")] * 2
        r = cli("exec", sid, "--", "cat", input="piped")  # stdin to forward: the full client, same sandbox
        assert (r.returncode, r.stdout) == (0, "piped"), r.stderr
        probe = (
            "import json, sys; from warmbox.cli.main import main; code = main(sys.argv[1:]); "
            "print(json.dumps(sorted(sys.modules)), file=sys.stderr); sys.exit(code)"
        )
        r = subprocess.run(
            [sys.executable, "-c", probe, "exec", sid, "--", "true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
        loaded = set(json.loads(r.stderr.splitlines()[-1]))
        assert r.returncode == 0 and not {"asyncio", "aiohttp", "warmbox.engine", "warmbox.sdk"} & loaded, r.stderr
        rows = json.loads(cli("ls", "--json").stdout)
        assert [row["via"] for row in rows if row["sandbox_id"] == sid] == ["server"]
        r = cli("exec", "sb-000000000000", "--", "true")  # the server's typed error, one line
        assert r.returncode == 125 and "sb-000000000000" in r.stderr and "Traceback" not in r.stderr
        r = cli("kill", sid)
        assert (r.returncode, r.stdout) == (0, f"{sid} destroyed\n"), r.stderr
        sid = ""
    finally:
        if sid:
            cli("kill", sid)
        server.stop(grace=10)
    rows = json.loads(cli("ls", "-a", "--json").stdout)  # no server: in process
    assert {row["via"] for row in rows} == {"in-process"} and rec["sandbox_id"] in {row["sandbox_id"] for row in rows}
