"""What someone who knows Docker types (issue 34): `run CMD` without `--`, `ps`, `kill --all`,
`logs ID` with process output and `-f`, `port-forward --check` saying what it waits for, `ls` of a
paused sandbox, `template show` in plain text. (`exec -it`: tests/cli/test_shell.py.)"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import cli
from warmbox import Sandbox
from warmbox.cli.main import _parse


def test_the_command_starts_at_the_first_word_that_is_not_ours():
    assert _parse(["run", "python3", "-c", "print(1)"]).cmd == ["python3", "-c", "print(1)"]
    args = _parse(["run", "--timeout", "60", "-e", "A=1", "bash", "-c", "echo $A"])
    assert (args.timeout, args.env, args.cmd) == (60.0, ["A=1"], ["bash", "-c", "echo $A"])
    args = _parse(["exec", "-it", "sb-1", "bash", "-l"])
    assert (args.interactive, args.tty, args.sandbox_id, args.cmd) == (True, True, "sb-1", ["bash", "-l"])
    args = _parse(["exec", "sb-1", "--cwd", "/tmp", "-e", "A=1", "--", "pwd"])  # the separator still works
    assert (args.cwd, args.env, args.cmd) == ("/tmp", ["A=1"], ["pwd"])
    assert _parse(["exec", "sb-1", "git", "log", "--", "f"]).cmd == ["git", "log", "--", "f"]
    assert _parse(["--api-url", "http://x", "run", "--no-pool", "ls", "-la"]).cmd == ["ls", "-la"]
    assert _parse(["shell", "sb-1", "-u", "root", "top", "-b"]).cmd == ["top", "-b"]
    assert _parse(["ps", "-a"]).all is True
    r = cli("run", "--bogus", "ls")  # an option of none of ours is still argparse's error, not a command
    assert r.returncode == 125 and "unrecognized arguments: --bogus" in r.stderr


@pytest.mark.sandbox
def test_run_and_exec_take_a_command_without_a_separator(home, runc_ready):
    r = cli("run", "--timeout", "60", "python3", "-c", "print(1)")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "1\n"
    r = cli("create", "--timeout", "120")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    try:
        r = cli("exec", sid, "sh", "-c", "echo $0 -n", "x")
        assert (r.returncode, r.stdout) == (0, "x -n\n"), r.stderr
    finally:
        cli("kill", sid)


@pytest.mark.sandbox
def test_ps_lists_kill_all_destroys_and_ls_gives_a_paused_sandbox_no_deadline(home, runc_ready):
    run = secrets.token_hex(4)
    ids = []
    for _ in range(2):
        r = cli("create", "--timeout", "120", "--metadata", f"run={run}")
        assert r.returncode == 0, r.stderr
        ids.append(r.stdout.strip())
    try:
        r = cli("ps")
        assert r.returncode == 0 and all(sid in r.stdout for sid in ids), r.stderr
        assert cli("pause", ids[1]).returncode == 0
        rows = {line.split()[0]: line.split() for line in cli("ls").stdout.splitlines()[1:]}
        # ID TIER TEMPLATE STATE POOL AGE EXPIRES MEM CPUS
        assert rows[ids[0]][6].endswith("s") and int(rows[ids[0]][6][:-1]) > 60
        assert rows[ids[1]][3] == "paused" and rows[ids[1]][6] == "-", rows[ids[1]]
        r = cli("kill")
        assert r.returncode == 125 and "--all" in r.stderr
        r = cli("kill", "--all")
        assert r.returncode == 0, r.stderr
        assert all(f"{sid} destroyed" in r.stdout for sid in ids)
        left = json.loads(cli("ls", "--json", "--metadata", f"run={run}").stdout)
        assert left == []
    finally:
        for sid in ids:
            cli("kill", sid)


@pytest.mark.sandbox
def test_logs_shows_background_output_and_follows_it(home, runc_ready):
    with Sandbox.create(timeout=120) as sb:
        serving = sb.commands.run("for i in 1 2 3; do echo served-$i; done; echo oops >&2; sleep 120", background=True)
        wait = sb.commands.run("echo first; sleep 10; echo second", background=True)
        try:
            time.sleep(0.5)
            r = cli("logs", sb.sandbox_id)
            assert r.returncode == 0, r.stderr
            assert f"[{serving.pid}] served-3" in r.stdout and f"[{serving.pid}] oops" in r.stderr
            assert f"[{wait.pid}] first" in r.stdout
            serving.kill()
            t0 = time.monotonic()
            r = cli("logs", "-f", sb.sandbox_id)  # follows until the last process ended
            assert r.returncode == 0, r.stderr
            assert r.stdout.splitlines()[-1].endswith("second")
            assert 1 < time.monotonic() - t0 < 60  # it waited for "second"
        finally:
            serving.kill()


@pytest.mark.sandbox
def test_port_forward_check_says_what_it_waits_for(home, runc_ready):
    r = cli("create", "--timeout", "120")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    proc = subprocess.Popen(
        [sys.executable, "-m", "warmbox.cli.main", "port-forward", sid, "8000", "--check"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        assert proc.stderr is not None and proc.stdout is not None
        ready, _, _ = select.select([proc.stderr], [], [], 60)
        assert ready, "port-forward --check said nothing"
        said = proc.stderr.readline()
        assert "waiting (30 s at most)" in said and "port 8000" in said and sid in said
        r = cli("exec", sid, "sh", "-c", "(python3 -m http.server 8000 >/dev/null 2>&1 &)")
        assert r.returncode == 0, r.stderr
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline().startswith("127.0.0.1:")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait(30)
        cli("kill", sid)


@pytest.mark.sandbox
@pytest.mark.one_host(
    "a build's layers go to the cluster's object store (moto S3 in the lane: ~45 s against ~3 s on one host); "
    "the CLI's output is the same"
)
def test_template_show_is_plain_text(home, runc_ready, tmp_path):
    name = f"show-{secrets.token_hex(3)}"
    (tmp_path / "Dockerfile").write_text("FROM base\nENV GREETING=hi\nENV OTHER=2\n")
    r = cli("template", "build", str(tmp_path), "--name", name, timeout=300)
    assert r.returncode == 0, r.stderr
    try:
        r = cli("template", "show", name)
        assert r.returncode == 0, r.stderr
        assert "('" not in r.stdout and "((" not in r.stdout, r.stdout  # it printed Python tuple reprs
        lines = r.stdout.splitlines()
        [env] = [i for i, line in enumerate(lines) if line.startswith("env ")]
        assert lines[env].split() == ["env", "GREETING=hi"] and lines[env + 1].split() == ["OTHER=2"]
        assert any(line.split()[:1] == ["layers"] and "sha256:" in line for line in lines)
    finally:
        cli("template", "rm", name)
