"""`warmbox port-forward ID PORT`: prints the host address, relays until interrupted, ends with its sandbox."""

from __future__ import annotations

import http.client
import os
import select
import signal
import subprocess
import sys

import pytest

from tests.conftest import cli


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "warmbox.cli.main", "port-forward", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )


def _first_line(proc: subprocess.Popen, timeout: float = 60) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "port-forward printed no address"
    return proc.stdout.readline().strip()


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise


@pytest.mark.sandbox
def test_port_forward_relays_until_interrupted_and_ends_with_the_sandbox(home, runc_ready):
    r = cli("create", "--timeout", "300")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    try:
        r = cli(
            "exec",
            sid,
            "--",
            "sh",
            "-c",
            "cd /workspace && echo hi > f && (python3 -m http.server 8000 >/dev/null 2>&1 &)",
        )
        assert r.returncode == 0, r.stderr
        proc = _start(sid, "8000", "--check")
        try:
            host = _first_line(proc)
            addr, port = host.rsplit(":", 1)
            conn = http.client.HTTPConnection(addr, int(port), timeout=30)
            conn.request("GET", "/f")
            resp = conn.getresponse()
            assert (resp.status, resp.read()) == (200, b"hi\n")
            conn.close()
        finally:
            assert _stop(proc) == 0, proc.stderr.read() if proc.stderr else ""
        assert cli("exec", sid, "--", "echo", "alive").stdout == "alive\n"  # let go of, not ended
        proc = _start(sid, "8000")
        try:
            _first_line(proc)
            assert cli("kill", sid).returncode == 0
            assert proc.wait(30) == 125  # the sandbox ended: so does the forward
        finally:
            _stop(proc)
    finally:
        cli("kill", sid)
