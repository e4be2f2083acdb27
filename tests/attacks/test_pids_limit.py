"""Attack: run into limits.pids and hope the sandbox goes down with it.

On gVisor the host's pids cgroup used to hold limits.pids for the Sentry, the gofer and the ptrace
stubs as well as for the sandbox's processes, so the Sentry itself could not start a host thread
at the limit: ``Limits(pids=128)`` lost the sandbox at its first pipeline, ``Limits(pids=64)``
failed its create (``fatal error: newosproc``), and a fork bomb at the default 256 ended the
sandbox within a second (a panic in ``ptrace.newSubprocess``). Now limits.pids is the Sentry's own
pids cgroup: a fork past it gets EAGAIN, as on the container tier, and the sandbox lives.
"""

from __future__ import annotations

import time

import pytest

from warmbox import Limits, Sandbox

pytestmark = pytest.mark.sandbox

# the bomb of the report: every process forks for ever, EAGAIN ignored; the first EAGAIN is noted
PY_BOMB = (
    "import errno, os\n"
    "seen = False\n"
    "while True:\n"
    "    try:\n"
    "        os.fork()\n"
    "    except OSError as e:\n"
    "        if e.errno == errno.EAGAIN and not seen:\n"
    "            seen = True\n"
    "            os.close(os.open('/tmp/eagain', os.O_WRONLY | os.O_CREAT, 0o644))\n"
)
SH_BOMB = "b(){ b | b & }; b; sleep 60"  # the shell's (dash), much lighter on memory than Python's
BOMB_S = 3  # how long a bomb runs before its command's timeout ends it (see the gVisor bound below)


def _processes(sb) -> int:
    """Processes in the sandbox, as the agent sees them (no command of its own to count)."""
    return sum(e.name.isdigit() for e in sb.files.list("/proc"))


def _settles(sb, base: int, bound_s: float = 20.0) -> int:
    deadline = time.monotonic() + bound_s
    n = _processes(sb)
    while n > base and time.monotonic() < deadline:
        time.sleep(0.2)
        n = _processes(sb)
    return n


@pytest.mark.parametrize("pids", [64, 128])
def test_low_pids_limits_create_and_run_pipelines(tier, pids):
    with Sandbox.create(tier=tier, timeout=300, pool=False, limits=Limits(pids=pids)) as sb:
        for _ in range(3):
            r = sb.commands.run("echo hi | tr a b | grep -c .")
            assert (r.exit_code, r.stdout) == (0, "1\n"), r.stderr
        r = sb.run_code("sum(range(10))")
        assert r.error is None and r.text == "45"


def test_fork_bomb_gets_eagain_and_the_sandbox_lives(tier):
    # memory: Python's children each dirty ~2 MiB of copied pages, and on gVisor the Sentry holds
    # them all: at the default 512 MiB the memory limit (the host's OOM killer takes the Sentry)
    # would end this sandbox before the pids limit is in question
    with Sandbox.create(tier=tier, timeout=300, pool=False, limits=Limits(memory_mb=3072)) as sb:
        sb.files.write("/tmp/bomb.py", PY_BOMB)
        sb.commands.run("true")  # the agent's resident helpers (gVisor's wb-init --serve) start with a first command
        base = _processes(sb)
        bomb = sb.commands.run("python3 /tmp/bomb.py", background=True)
        # gVisor forks slowly: the bomb reached the default 256 after ~6 s here, longer under load
        deadline = time.monotonic() + 120
        while not sb.files.exists("/tmp/eagain"):  # no process: the agent reads it (none could start)
            assert time.monotonic() < deadline, "no fork got EAGAIN"
            time.sleep(0.5)
        time.sleep(1)  # held at the limit
        t0 = time.monotonic()
        sb.commands.kill(bomb.pid)
        assert _settles(sb, base) <= base, "the fork bomb's processes outlived their kill"
        assert time.monotonic() - t0 < 20
        r = sb.commands.run("echo hi | tr a b | grep -c .")
        assert (r.exit_code, r.stdout) == (0, "1\n"), r.stderr
        assert sb.run_code("2 + 2").text == "4"


def test_shell_fork_bomb_at_the_default_limits(tier):
    with Sandbox.create(tier=tier, timeout=300, pool=False) as sb:
        sb.commands.run("true")  # the agent's resident helpers (gVisor's wb-init --serve) start with a first command
        base = _processes(sb)
        r = sb.commands.run(SH_BOMB, timeout=BOMB_S)
        assert r.timed_out
        assert _settles(sb, base) <= base, "the fork bomb's processes outlived its timeout"
        for _ in range(2):  # the sandbox answers, and can fork again
            r = sb.commands.run("echo hi | tr a b | grep -c .")
            assert (r.exit_code, r.stdout) == (0, "1\n"), r.stderr


def test_the_sandbox_user_cannot_raise_or_leave_its_pids_cgroup(home, runc_ready):
    """gVisor: the pids cgroup is root's inside the Sentry. Neither the sandbox user nor root of a
    user namespace of its own (``user="root"``) can raise pids.max, leave the cgroup or make
    another, and the limit is the sandbox's limits.pids."""
    with Sandbox.create(tier="gvisor", timeout=300, pool=False, limits=Limits(pids=100)) as sb:
        r = sb.commands.run(
            "cat /sys/fs/cgroup/sandbox/pids.max; grep -o ':pids:.*' /proc/self/cgroup; grep CapEff /proc/self/status"
        )
        assert r.stdout.split("\n")[:3] == ["100", ":pids:/sandbox", "CapEff:\t0000000000000000"], r.stdout
        tries = (
            "echo 100000 > /sys/fs/cgroup/sandbox/pids.max",
            "echo $$ > /sys/fs/cgroup/cgroup.procs",
            "mkdir /sys/fs/cgroup/mine",
            "umount /sys/fs/cgroup",
        )
        for user in ("user", "root"):
            for attempt in tries:
                r = sb.commands.run(attempt, user=user)
                assert r.exit_code != 0, (user, attempt, r.stdout)
        r = sb.commands.run("cat /sys/fs/cgroup/sandbox/pids.max; grep -o ':pids:.*' /proc/self/cgroup")
        assert r.stdout.split("\n")[:2] == ["100", ":pids:/sandbox"], r.stdout
