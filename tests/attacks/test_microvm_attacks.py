"""The attacks of this folder that apply to the microVM tier, against one real VM (its own
kernel, QEMU under TCG here: one template boot for the module, never more than one VM)."""

from __future__ import annotations

import os
import time

import pytest

from tests.attacks.conftest import require_tier
from tests.attacks.test_agent_memory import HELD, PROBE
from tests.backends.conftest import qemu_pids
from warmbox import Limits, Sandbox
from warmbox.errors import FileTooLarge, NotARegularFile

pytestmark = pytest.mark.sandbox

LIMITS = Limits(memory_mb=256, pids=128)


@pytest.fixture(scope="module")
def vm(home, runc_ready):
    engine = require_tier(home, "microvm")
    with Sandbox.create(tier="microvm", timeout=600, limits=LIMITS) as sb:
        yield sb
    left = qemu_pids(engine.runtime)
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"QEMU or relay processes left behind: {left}"


def test_microvm_user_code_cannot_touch_the_agents_memory(vm):
    agent = vm.commands.run("pgrep -u 1000 -o -f warmbox.guest.agent").stdout.strip()
    assert agent.isdigit(), agent
    r = vm.commands.run(["python3", "-c", PROBE, agent])
    assert r.exit_code == 0, r.stderr
    assert "mem:refused" in r.stdout and "ptrace:refused" in r.stdout, r.stdout


def test_microvm_code_context_holds_nothing_of_the_agent(vm):
    """The VM's code context is forked from its agent (a cgroup of the guest's): its own socket and
    /dev/null alone, in its own cgroup, and the agent's memory out of its reach."""
    held = eval(vm.run_code(HELD).stdout)
    sockets = [h for h in held if h.startswith("socket:")]
    assert len(sockets) == 1 and all(h == "/dev/null" or h in sockets for h in held), held
    cgroup = vm.run_code("open('/proc/self/cgroup').read().strip().rsplit('/', 1)[-1]").text
    assert cgroup.strip("'").startswith("cmd-"), cgroup
    agent = vm.commands.run("pgrep -u 1000 -o -f warmbox.guest.agent").stdout.strip()
    r = vm.run_code(f"import sys\nsys.argv[1:] = [{agent!r}]\n" + PROBE)
    assert "mem:refused" in r.stdout and "ptrace:refused" in r.stdout, r.stdout


def test_microvm_full_tmpfs_gets_enospc_and_the_vm_lives(vm):
    for where in ("/tmp", "/home/user", "/dev/shm"):
        r = vm.commands.run(f"dd if=/dev/zero of={where}/fill bs=1M 2>&1; echo rc=$?", timeout=120)
        assert "No space left on device" in r.stdout and "rc=1" in r.stdout, r.stdout
    r = vm.commands.run("python3 -c 'print(sum(range(10)))'", timeout=60)
    assert (r.exit_code, r.stdout) == (0, "45\n"), r
    vm.commands.run("rm -f /tmp/fill /home/user/fill /dev/shm/fill")


def test_microvm_files_read_is_bounded(vm):
    assert (
        vm.commands.run(
            "ln -sf /dev/zero /workspace/z && mkfifo /workspace/f && truncate -s 150M /workspace/big"
        ).exit_code
        == 0
    )
    t = time.monotonic()
    with pytest.raises(NotARegularFile):
        vm.files.read("/workspace/z")
    with pytest.raises(NotARegularFile):
        vm.files.read("/workspace/f", timeout=20)
    with pytest.raises(FileTooLarge):
        vm.files.read("/workspace/big", format="bytes")
    assert time.monotonic() - t < 20
    assert vm.commands.run("echo alive").stdout == "alive\n"
