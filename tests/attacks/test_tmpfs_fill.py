"""Filling the sandbox's tmpfs mounts gets ENOSPC; the sandbox and its agent live on.

/tmp, /home/user and /dev/shm are tmpfs charged to the memory limit: sized alike, full ones
used to leave nothing for the processes, and the OOM killer took the guest agent.
"""

from __future__ import annotations

import pytest

from warmbox import Limits, Sandbox

pytestmark = pytest.mark.sandbox


@pytest.mark.parametrize("memory_mb", [256, 512])
def test_full_tmpfs_mounts_get_enospc_and_the_sandbox_lives(tier, memory_mb):
    with Sandbox.create(tier=tier, timeout=300, pool=False, limits=Limits(memory_mb=memory_mb)) as sb:
        for where in ("/tmp", "/home/user", "/dev/shm"):
            r = sb.commands.run(f"dd if=/dev/zero of={where}/fill bs=1M 2>&1; echo rc=$?", timeout=60)
            assert "No space left on device" in r.stdout and "rc=1" in r.stdout, r.stdout
            assert not r.oom_killed
        r = sb.commands.run("python3 -c 'print(sum(range(10)))'")
        assert (r.exit_code, r.stdout) == (0, "45\n"), "a full tmpfs left no memory for a small process"
        assert sb.run_code("40 + 2").text == "42"
        if tier == "container":  # a memory hog is the one killed, not the agent (gVisor: its Sentry)
            r = sb.commands.run(f"python3 -c 'x = bytearray({memory_mb} << 20)'", timeout=60)
            assert r.oom_killed and r.exit_code != 0
            assert sb.commands.run("echo alive").stdout == "alive\n"
