"""A command's processes cannot outlive its timeout: double-forked, setsid()ed, signal-ignoring
and process-group-changing processes, a bounded fork bomb, and what a code cell started all end
with the command (its own cgroup on the container tier, its own PID namespace on gVisor). What
a command starts on purpose and leaves behind when it exits normally keeps running."""

from __future__ import annotations

import re
import time

import pytest

from warmbox import Sandbox

pytestmark = pytest.mark.sandbox

ESCAPES = (
    # double fork + setsid: re-parented to the agent, in a session of its own
    "setsid sh -c 'sleep 1001 &' ; "
    # ignores SIGTERM, SIGHUP and SIGINT (inherited SIG_IGN), double-forked too
    "(trap '' TERM HUP INT; sleep 1002 &) ; "
    # its own process group (job control), then disowned
    "bash -c 'set -m; sleep 1003 & disown' ; "
    # setsid + new process group from Python, then the parent exits
    "python3 -c 'import os, time; os.fork() and os._exit(0); os.setsid(); os.fork() and os._exit(0); "
    'os.setpgid(0, 0); os.execvp("sleep", ["sleep", "1004"])\' ; '
    "sleep 60"
)


def _sleeps(sb, pattern: str = "sleep 10[0-9][0-9]") -> list[str]:
    out = sb.commands.run(["ps", "-eo", "pid,args"]).stdout
    return [line for line in out.splitlines() if re.search(pattern + r"\b", line)]


def _wait_gone(sb, pattern: str, bound_s: float) -> list[str]:
    deadline = time.monotonic() + bound_s
    left = _sleeps(sb, pattern)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _sleeps(sb, pattern)
    return left


def test_timeout_kills_double_forked_setsid_and_signal_ignoring_processes(tier):
    with Sandbox.create(tier=tier, timeout=300, pool=False) as sb:
        r = sb.commands.run(ESCAPES, timeout=4)
        assert r.timed_out and r.signal == 9, (r.exit_code, r.stderr)
        assert _wait_gone(sb, "sleep 100[1-4]", 5.0) == [], "processes of the timed-out command survived"
        # and they had all started (the check above is not vacuous)
        r = sb.commands.run(ESCAPES.replace("sleep 60", "sleep 1; ps -eo args"), timeout=30)
        assert r.exit_code == 0 and all(f"sleep 100{i}" in r.stdout for i in range(1, 5)), r.stdout
        for line in _sleeps(sb, "sleep 100[1-4]"):
            sb.commands.run(["kill", "-9", line.split()[0]])


def test_background_processes_of_a_normal_exit_keep_running(tier):
    with Sandbox.create(tier=tier, timeout=300, pool=False) as sb:
        r = sb.commands.run("nohup sleep 1011 >/dev/null 2>&1 & setsid sh -c 'sleep 1012 &'; echo started")
        assert r.exit_code == 0 and not r.timed_out and r.stdout == "started\n", r.stderr
        time.sleep(0.5)
        left = _sleeps(sb, "sleep 101[12]")
        assert len(left) == 2, left
        # a later command's timeout does not touch them
        assert sb.commands.run("sleep 30", timeout=1).timed_out
        assert len(_sleeps(sb, "sleep 101[12]")) == 2


def _process_count(sb) -> int:
    """Processes in the sandbox, as the agent sees them (no command of its own to count)."""
    return sum(e.name.isdigit() for e in sb.files.list("/proc"))


def test_fork_bomb_ends_with_its_timeout(tier):
    # a smaller tree on gVisor, where each fork costs ~50 times the host's (its bound at limits.pids:
    # test_pids_limit.py)
    depth = 7 if tier == "container" else 4
    with Sandbox.create(tier=tier, timeout=300, pool=False) as sb:
        sb.commands.run("true")  # the agent's resident helpers (gVisor's wb-init --serve) start with a first command
        base = _process_count(sb)
        # a binary fork tree whose every node is orphaned at once (double fork), 2^depth leaves
        # that each leave their session and ignore SIGTERM
        bomb = (
            "b(){ if [ $1 -le 0 ]; then trap '' TERM HUP; exec setsid sleep 1020; fi; "
            f"(b $(($1-1)) &); (b $(($1-1)) &); }}; b {depth}; sleep 60"
        )
        r = sb.commands.run(bomb, timeout=5)
        assert r.timed_out
        deadline = time.monotonic() + 10
        while _process_count(sb) > base and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _process_count(sb) <= base, "the fork bomb's processes outlived its timeout"
        assert sb.commands.run("echo alive").stdout == "alive\n"


def test_killed_code_context_takes_what_its_cells_started(tier):
    with Sandbox.create(tier=tier, timeout=300, pool=False) as sb:
        ex = sb.run_code(
            "import subprocess\n"
            "subprocess.run(['sh', '-c', \"setsid sh -c 'sleep 1030 &'\"])\n"
            "subprocess.Popen(['sleep', '1031'], start_new_session=True)\n"
            "'ok'"
        )
        assert ex.error is None and ex.text == "'ok'", ex.error
        assert len(_sleeps(sb, "sleep 103[01]")) == 2
        # a cell that ignores the interrupt: its context is killed, with everything it started
        ex = sb.run_code(
            "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: time.sleep(0.05)", timeout=1
        )
        assert ex.timed_out
        assert _wait_gone(sb, "sleep 103[01]", 5.0) == [], "processes of the killed context survived"
        assert sb.run_code("1 + 1").text == "2"
