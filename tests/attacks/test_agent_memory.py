"""User code runs as the guest agent's uid but cannot read or write the agent's memory
(/proc/<agent>/mem, ptrace): the agent makes itself non-dumpable before any user process runs."""

from __future__ import annotations

import re

import pytest

from warmbox import Sandbox

pytestmark = pytest.mark.sandbox

PROBE = r"""
import ctypes, os, sys
agent = int(sys.argv[1])
try:
    with open(f"/proc/{agent}/mem", "rb") as f:
        maps = open(f"/proc/{agent}/maps").readline()
        f.seek(int(maps.split("-")[0], 16))
        f.read(16)
    print("mem:read")
except OSError as e:
    print("mem:refused", e.errno)
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(16, agent, 0, 0) == 0:  # PTRACE_ATTACH
    print("ptrace:attached")
    libc.ptrace(17, agent, 0, 0)  # PTRACE_DETACH
else:
    print("ptrace:refused", ctypes.get_errno())
"""


def test_user_code_cannot_touch_the_agents_memory(tier):
    with Sandbox.create(tier=tier, timeout=300, pool=False) as sb:
        r = sb.commands.run(["python3", "-c", PROBE, "1"])
        assert r.exit_code == 0, r.stderr
        assert "mem:read" not in r.stdout and "mem:refused" in r.stdout, r.stdout
        assert "ptrace:attached" not in r.stdout and "ptrace:refused" in r.stdout, r.stdout
        # and the user's own processes stay debuggable by the user (children are dumpable again);
        # /proc/self: on gVisor a command is PID 2 of its own PID namespace, /proc numbers the sandbox's
        r = sb.commands.run(["python3", "-c", "print(open('/proc/self/mem', 'rb') and 'own')"])
        assert r.stdout == "own\n", r.stderr
        assert sb.run_code("1 + 1").text == "2"


# what a code context's process holds: a context forked from the agent (container, microVM) has
# the agent's descriptors replaced by /dev/null, its own socket alone left
HELD = r"""
import os
seen = []
for n in sorted(os.listdir('/proc/self/fd'), key=int):
    try:
        seen.append(os.readlink(f'/proc/self/fd/{n}'))
    except OSError:  # the listing's own descriptor
        pass
print(sorted(seen))
"""


def test_a_code_context_holds_nothing_of_the_agent(tier):
    with Sandbox.create(tier=tier, timeout=300, pool=False) as sb:
        held = eval(sb.run_code(HELD).stdout)
        sockets = [h for h in held if h.startswith("socket:")]
        # its own socket to the agent; no listener, host connection or cgroup directory of the agent
        assert len(sockets) == 1 and all(h == "/dev/null" or h in sockets for h in held), held
        # and from the context too, the agent's memory is out of reach (the context is the user's)
        r = sb.run_code("import sys\nsys.argv[1:] = ['1']\n" + PROBE)
        assert r.error is None, r.error
        assert "mem:read" not in r.stdout and "mem:refused" in r.stdout, r.stdout
        assert "ptrace:attached" not in r.stdout and "ptrace:refused" in r.stdout, r.stdout
        assert sb.run_code("import os; os.getpid() != 1").text == "True"
        if tier == "container":  # its own cgroup below the sandbox's (a timeout's kill ends all of it)
            unified = sb.run_code("[x for x in open('/proc/self/cgroup').read().split() if x.startswith('0::')]")
            assert re.fullmatch(r"\['0::.*/cmd-\d+'\]", unified.text), unified.text
