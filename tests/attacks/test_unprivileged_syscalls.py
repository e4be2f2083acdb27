"""Privileged-looking calls from the unprivileged sandbox user fail (or stay inside nested
namespaces) and never end the sandbox. The red team saw `mount -t tmpfs` and `unshare -Ur`
end a gVisor sandbox; on this runsc they do not reproduce, and this test keeps it so.
A sandbox that does die leaves its runtime logs (`warmbox logs ID`)."""

from __future__ import annotations

import pytest

from tests.conftest import cli
from warmbox import Limits, Sandbox

pytestmark = pytest.mark.sandbox

CALLS = [
    ("mount -t tmpfs none /mnt", False),
    ("unshare -Ur sh -c 'echo inner'", None),  # container: refused by seccomp; gVisor: a nested user ns
    ("unshare -Urm sh -c 'mount -t tmpfs none /mnt && echo mounted'", None),
    ("unshare -Urn sh -c 'ip link set lo up && echo net'", None),
    ("unshare -Urpf sh -c 'echo pidns'", None),
    ('python3 -c \'import ctypes; print(ctypes.CDLL(None).mount(b"none", b"/mnt", b"tmpfs", 0, None))\'', None),
    ("python3 -c 'import ctypes; print(ctypes.CDLL(None).unshare(0x10000000))'", None),  # CLONE_NEWUSER
    ("python3 -c 'import os; os.setuid(0)'", False),
    ("chroot / true", False),
]


@pytest.mark.parametrize("memory_mb", [256, 1024])
def test_privileged_calls_fail_or_stay_nested_and_the_sandbox_lives(tier, memory_mb):
    with Sandbox.create(tier=tier, timeout=300, pool=False, limits=Limits(memory_mb=memory_mb)) as sb:
        for cmd, succeeds in CALLS:
            r = sb.commands.run(cmd, timeout=30)
            if succeeds is not None:
                assert (r.exit_code == 0) == succeeds, (cmd, r.exit_code, r.stderr)
            after = sb.commands.run("echo alive; id -u")
            assert after.stdout == "alive\n1000\n", f"the sandbox did not survive {cmd!r}: {after}"
        assert sb.commands.run("grep -c tmpfs /proc/mounts").exit_code == 0
        assert sb.commands.run("touch /mnt/x").exit_code != 0, "a mount leaked out of a nested namespace"
        sid = sb.sandbox_id
    # its runtime logs outlive it
    r = cli("logs", sid)
    assert r.returncode == 0 and "agent.log" in r.stdout, (r.returncode, r.stdout[-300:], r.stderr[-300:])
