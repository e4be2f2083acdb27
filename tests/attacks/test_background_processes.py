"""Background processes cannot take the agent down: output nobody reads stays in a bounded ring
(the agent's memory does not grow with it, and it keeps answering), and starting processes until
the pids limit gets a typed error while the sandbox still answers and recovers."""

from __future__ import annotations

import time

import pytest

from warmbox import Limits, Sandbox, SandboxError
from warmbox.guest import procs as bg

pytestmark = pytest.mark.sandbox


def _agent_rss_kib(sb) -> int:
    status = sb.files.read("/proc/1/status")  # the agent is PID 1 of the sandbox
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


def test_output_flood_with_no_reader_keeps_the_agent_bounded(home, runc_ready):
    with Sandbox.create(tier="container", timeout=300, pool=False) as sb:
        before = _agent_rss_kib(sb)
        handles = [sb.commands.run("yes 0123456789abcdef0123456789abcdef", background=True) for _ in range(4)]
        for h in handles:
            h.disconnect()  # nobody reads them any more
        time.sleep(4)  # at full speed each writes hundreds of MB meanwhile
        t0 = time.monotonic()
        r = sb.commands.run("echo alive", timeout=10)
        assert r.stdout == "alive\n" and time.monotonic() - t0 < 2.0
        grown = _agent_rss_kib(sb) - before
        assert grown < (bg.TOTAL_BYTES >> 10) + 16 * 1024, f"agent grew by {grown} KiB"
        late = sb.commands.connect(handles[0].pid)  # a late reader is told what it missed
        first = next(iter(late))
        assert first[0] and set(first[0]) <= set("0123456789abcdef\n")  # the ring's tail, cut anywhere
        for h in handles:
            assert sb.commands.kill(h.pid)
        r = late.wait()
        assert r.truncated and r.signal == 9


def test_background_processes_up_to_the_pids_limit(tier):
    with Sandbox.create(tier=tier, timeout=300, pool=False, limits=Limits(pids=64)) as sb:
        started: list[int] = []
        refused: SandboxError | None = None
        for _ in range(10_000):
            try:
                h = sb.commands.run("exec sleep 600", background=True)
            except SandboxError as e:
                refused = e
                break
            h.disconnect()
            started.append(h.pid)
        assert refused is not None and "limits.pids" in str(refused), refused
        assert 10 < len(started) < 64
        sb.ping()  # the sandbox still answers
        # a request that needs an agent thread waits until the disconnected followers' threads have
        # ended (at the limit none can start: a typed refusal meanwhile, seen once on a loaded host)
        deadline = time.monotonic() + 30
        while True:
            try:
                listed = sb.commands.list()
                break
            except SandboxError as e:
                assert "limits.pids" in str(e) and time.monotonic() < deadline, e
                time.sleep(0.2)
        assert {p.pid for p in listed} >= set(started)
        for pid in started:
            sb.commands.kill(pid)
        deadline = time.monotonic() + 10
        while sb.commands.list() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sb.commands.run("echo recovered", timeout=20).stdout == "recovered\n"
