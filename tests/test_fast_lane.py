"""The fast lane's run-time guard (tests/conftest.py) knows the command lines only sandbox tests may run."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import _sandbox_process
from warmbox.network.proxy import launch_argv


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
    ],
)
def test_pure_command_lines_are_not(argv):
    assert _sandbox_process(argv) is None
