"""The fast lane's run-time guard (tests/conftest.py) knows the command lines only sandbox tests may run."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import _sandbox_process
from warmbox.network.supervisor import launch_argv


@pytest.mark.parametrize(
    "argv",
    [
        ["runc", "--root", "/run/wb/runc", "run", "sb-1"],
        ["/usr/bin/runsc", "--rootless", "run"],
        ["qemu-system-x86_64", "-accel", "kvm"],
        ["ip", "netns", "add", "wbt-x"],
        ["sh", "-c", "ip netns exec e true"],
        [sys.executable, "-m", "warmbox.engine.daemon", "/tmp/home"],
        [*launch_argv(), "/tmp/home"],
        b"/usr/sbin/runc",
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head"],
        ["/venv/bin/ray", "start", "--address", "192.0.2.2:6379", "--block"],
        ["/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet", "--node_ip_address=192.0.2.2"],
        ["setpriv", "--reuid=postgres", "/usr/lib/postgresql/15/bin/initdb", "-D", "/tmp/pg/data"],
        ["/usr/lib/postgresql/15/bin/pg_ctl", "-D", "/tmp/pg/data", "start"],
        [sys.executable, "-m", "warmbox.cli.main", "node", "join", "192.0.2.2:6379"],
        [sys.executable, "-m", "warmbox.cli.main", "serve", "--cluster", "192.0.2.2:6379"],
    ],
)
def test_sandbox_command_lines_are_recognised(argv):
    assert _sandbox_process(argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["ip", "addr"],
        ["qemu-img", "create", "-f", "qcow2", "x"],
        [sys.executable, "-m", "warmbox.cli.main", "doctor"],
        ["sh", "-c", "echo runcible"],
        [sys.executable, "-I", "-S", "vmrelay.py", "a.sock", "b.sock"],
        [sys.executable, "-m", "warmbox.cli.main", "node", "ls"],
        [sys.executable, "-m", "warmbox.cli.main", "serve", "--port", "0"],
        ["psql", "postgresql://warmbox@/postgres?host=/tmp/pg"],
    ],
)
def test_pure_command_lines_are_not(argv):
    assert _sandbox_process(argv) is None
