"""`warmbox exec` forwards a piped stdin and takes its options after the sandbox id."""

from __future__ import annotations

import pytest

from tests.conftest import cli


@pytest.fixture(scope="module")
def sid(home, runc_ready):
    r = cli("create", "--timeout", "300")
    assert r.returncode == 0, r.stderr
    yield r.stdout.strip()
    cli("kill", r.stdout.strip())


@pytest.mark.sandbox
def test_piped_stdin_reaches_the_command(sid):
    r = cli("exec", sid, "--", "bash", input="echo hi\n")
    assert (r.returncode, r.stdout) == (0, "hi\n"), r.stderr
    big = "x" * (3 << 20) + "\n"  # larger than one frame, streamed in chunks
    r = cli("exec", sid, "--", "wc", "-c", input=big)
    assert (r.returncode, r.stdout.strip()) == (0, str(len(big))), r.stderr
    r = cli("exec", sid, "--", "sh", "-c", "cat; exit 4", input="")  # an empty pipe: EOF at once
    assert (r.returncode, r.stdout) == (4, "")
    r = cli("exec", sid, "--", "true")  # /dev/null is not forwarded: the plain path
    assert r.returncode == 0


@pytest.mark.sandbox
def test_options_after_the_id(sid):
    r = cli(
        "exec", sid, "--cwd", "/tmp", "-e", "A=1", "--", "sh", "-c", 'pwd; echo "$A"; echo "$@"', "sh", "--cwd", "x"
    )
    assert (r.returncode, r.stdout) == (0, "/tmp\n1\n--cwd x\n"), r.stderr
    r = cli("exec", sid, "--cmd-timeout", "1", "--", "bash", input="sleep 30\n")  # streamed stdin: still bounded
    assert r.returncode == 137 and "timed out" in r.stderr, (r.returncode, r.stderr)


@pytest.mark.sandbox
def test_exec_as_root_where_the_tier_offers_it(sid, home):
    r = cli("exec", sid, "--user", "root", "--", "id", "-u")  # the container tier: refused, saying why
    assert r.returncode == 125 and "seccomp" in r.stderr and "Traceback" not in r.stderr
    r = cli("create", "--tier", "gvisor", "--timeout", "120")
    assert r.returncode == 0, r.stderr
    gid = r.stdout.strip()
    try:
        r = cli("exec", gid, "-u", "root", "--", "sh", "-c", "id -u; cat", input="piped\n")
        assert (r.returncode, r.stdout) == (0, "0\npiped\n"), r.stderr
    finally:
        cli("kill", gid)
