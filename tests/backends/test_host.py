"""The host plumbing every tier shares (backends/_host.py), without a sandbox."""

from __future__ import annotations

import ast
import asyncio
import os
import time
from pathlib import Path

import pytest

from warmbox.backends import _host as host
from warmbox.errors import GuestConnectionError, SandboxStartError
from warmbox.models import Limits

BACKENDS = Path(host.__file__).parent


def test_the_resolver_address_is_the_egress_gateway():
    from warmbox.network import netns

    assert host.EGRESS_GATEWAY == netns.GATEWAY


def test_no_tier_reaches_into_another_tier_or_the_network_layer():
    tiers = {"runc", "gvisor", "microvm", "microvm_image", "vmrelay", "isolate"}
    for path in BACKENDS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("warmbox.network"), f"{path.name} imports {node.module}"
                if node.module.split(".")[-1] in tiers:
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    assert not private, f"{path.name} imports {private} from {node.module}"
                if node.module == "warmbox.backends":
                    assert not {a.name for a in node.names} & (tiers - {"microvm_image"}), (
                        f"{path.name} imports a tier module whole"
                    )
            elif isinstance(node, ast.Import):
                assert not [a.name for a in node.names if a.name.startswith("warmbox.network")], path.name


def test_oom_kills_are_read_from_either_layout(tmp_path):
    v1 = b"oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"
    v2 = b"low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n"
    assert host.parse_oom_kills(v1) == 3 and host.parse_oom_kills(v2) == 2
    assert host.parse_oom_kills(b"oom_kill 7") == 7
    assert host.parse_oom_kills(b"oom_group_kill 5\n") == 0 and host.parse_oom_kills(b"") == 0
    assert host.parse_oom_kills(b"oom_kill x\n") == 0
    (tmp_path / "memory.events").write_bytes(v2)
    assert host.read_oom_kills(str(tmp_path / "memory.events")) == 2
    assert host.read_oom_kills(str(tmp_path / "gone")) == 0


def _fake(root: Path, v2: bool, sandbox_id: str = "sb1") -> host.SandboxCgroup:
    cg = host.SandboxCgroup(sandbox_id)
    cg.root, cg.v2 = root, v2
    return cg


def test_a_v1_cgroup_is_read_per_controller(tmp_path):
    cg = _fake(tmp_path, v2=False)
    for c in ("memory", "cpuacct", "pids", "freezer"):
        (tmp_path / c / cg.rel).mkdir(parents=True)
    (tmp_path / "cpu").symlink_to("cpuacct")  # one hierarchy under two names, as "cpu,cpuacct" is
    (tmp_path / "memory" / cg.rel / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    (tmp_path / "memory" / cg.rel / "memory.usage_in_bytes").write_text("4096\n")
    (tmp_path / "memory" / cg.rel / "memory.stat").write_text("cache 10\nrss 2048\nrss_huge 0\n")
    (tmp_path / "cpuacct" / cg.rel / "cpuacct.usage").write_text("123456\n")
    (tmp_path / "pids" / cg.rel / "cgroup.procs").write_text("10\n11\n")
    assert cg.path == "/warmbox/sb1"
    assert cg.oom_kills() == 1 and cg.memory_bytes() == 4096 and cg.anon_bytes() == 2048 and cg.cpu_ns() == 123456
    assert cg.procs() == [10, 11]
    assert [d.relative_to(tmp_path).parts[0] for d in cg.dirs()] == ["memory", "cpu", "pids"]
    assert sorted(d.relative_to(tmp_path).parts[0] for d in cg.every_dir()) == ["cpuacct", "freezer", "memory", "pids"]


def test_a_v2_cgroup_is_one_directory(tmp_path):
    cg = _fake(tmp_path, v2=True)
    d = tmp_path / cg.rel
    d.mkdir(parents=True)
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n")
    (d / "memory.current").write_text("8192\n")
    (d / "memory.stat").write_text("anon 4096\nfile 0\n")
    (d / "cpu.stat").write_text("usage_usec 250\nuser_usec 200\n")
    assert cg.dirs() == cg.every_dir() == [d]
    assert (cg.oom_kills(), cg.memory_bytes(), cg.anon_bytes(), cg.cpu_ns()) == (0, 8192, 4096, 250_000)
    (d / "cpu.stat").write_text("user_usec 200\n")
    with pytest.raises(ValueError):
        cg.cpu_ns()


def test_a_cgroup_that_is_gone_reads_as_empty(tmp_path):
    cg = _fake(tmp_path, v2=False)
    assert cg.procs() == [] and cg.oom_kills() == 0
    with pytest.raises(OSError):
        cg.memory_bytes()
    cg.remove(timeout=0)  # nothing there: nothing to do


def test_remove_takes_child_cgroups_first_and_reports_one_that_stays(tmp_path):
    from warmbox.errors import SandboxError

    cg = _fake(tmp_path, v2=True)
    for sub in ("cmd-1/inner", "cmd-2"):
        (tmp_path / cg.rel / sub).mkdir(parents=True)
    cg.remove(timeout=0)
    assert not (tmp_path / cg.rel).exists()
    (tmp_path / cg.rel).mkdir()
    (tmp_path / cg.rel / "stuck").write_text("")  # a plain directory with a file: rmdir fails
    with pytest.raises(SandboxError, match="stays busy") as e:
        cg.remove(timeout=0)
    assert e.value.sandbox_id == "sb1"


def test_tmpfs_leaves_memory_to_the_processes():
    assert host.tmpfs_sizes(Limits(memory_mb=512, tmp_mb=512)) == (160, 64)
    assert host.tmpfs_sizes(Limits(memory_mb=512, tmp_mb=64)) == (64, 64)
    assert host.tmpfs_sizes(Limits(memory_mb=256, tmp_mb=512), shm_mb=64) == (48, 64)


def test_tail_of_a_log(tmp_path):
    log = tmp_path / "log"
    assert host.tail(log) == "(no log)"
    log.write_text("\n\n")
    assert host.tail(log) == "(empty log)"
    log.write_text("".join(f"line {i}\n\n" for i in range(6)))
    assert host.tail(log) == "line 2 | line 3 | line 4 | line 5"
    assert host.tail(log, 6) == "line 5"


def test_a_go_panic_keeps_its_cause_not_only_the_rpc_frames():
    # the shape of a failed ``runsc checkpoint``: the cause at the head, 60 frames, the RPC server's last
    frames = "".join(f"gvisor.dev/gvisor/pkg/sentry/x.f{i}(0xc000)\n\t/x.go:{i} +0x1\n" for i in range(60))
    out = (
        "W1205 checkpoint: urpc error\n"
        "panic: endpoint cannot be saved in connected state: local 10.0.0.2:4242\x1b[31m\n\n"
        "goroutine 1 [running]:\n" + frames + "gvisor.dev/gvisor/pkg/urpc.(*Server).StartHandling.func1()\n"
    )
    msg = host.failure_excerpt(out)
    assert "panic: endpoint cannot be saved in connected state: local 10.0.0.2:4242" in msg
    assert "goroutine 1 [running]: | gvisor.dev/gvisor/pkg/sentry/x.f0" in msg  # the first frames
    assert "| /x.go:0 +0x1 |" in msg  # a frame's tab-indented line
    assert msg.endswith("StartHandling.func1()")  # and the tail
    assert len(msg) <= 1200 and "\x1b" not in msg and "\n" not in msg
    assert host.failure_excerpt("short failure\n") == "short failure"
    assert host.failure_excerpt("x" * 5000).endswith("x" * 300) and len(host.failure_excerpt("x" * 5000)) <= 1200
    assert host.failure_excerpt("") == "(no output)"


def test_a_go_value_dump_does_not_push_the_cause_out():
    # a failed ``runsc checkpoint`` of a sandbox with a TCP connection open: the object dump is kilobytes
    dump = "tcp.endpoint{TSOffset:tcp.TSOffset{milliseconds:0xa7}, " + ", ".join(f"f{i}:{i}" for i in range(900)) + "}"
    out = f"checkpoint failed: encoding error at object {dump}: endpoint cannot be saved in connected state\n"
    msg = host.failure_excerpt(out + "goroutine 7 [running]:\n" + "x.f()\n\t/x.go:1\n" * 80)
    assert "encoding error at object tcp.endpoint{TSOffset:tcp.TSOffset{milliseconds:0xa7}, f0:0" in msg
    assert "...}: endpoint cannot be saved in connected state" in msg and len(msg) <= 1200
    assert host.failure_excerpt("a {b} {c{d}e} {") == "a {b} {c{d}e} {"  # short values and a stray brace


def test_running_and_kill():
    assert host.running(os.getpid())
    assert not host.running(2**22 + 12345)  # above pid_max: never a process
    host.kill(2**22 + 12345)  # a process that is gone is no error


def test_spawn_passes_fds_and_reaps_its_child(tmp_path):
    r, w = os.pipe()
    try:
        pid = host.spawn(["sh", "-c", 'read x <&3; echo "got $x"; echo oops >&2; exit 7'], tmp_path / "log", [r])
        os.write(w, b"hello\n")
        assert asyncio.run(host.wait_exit(pid)) == 7
    finally:
        os.close(r)
        os.close(w)
    assert (tmp_path / "log").read_text() == "got hello\noops\n"
    with pytest.raises(ValueError):
        host.spawn(["true"], tmp_path / "log", cgroup_procs=["/nonexistent/cgroup.procs"])


def test_a_detached_process_is_not_our_child(tmp_path):
    r, w = os.pipe()
    try:
        pid = host.spawn(
            ["sh", "-c", 'read x <&3; read y <&4; echo "$x $y $(ls /proc/self/fd | wc -l)"'],
            tmp_path / "log",
            [r, r],
            detach=True,
        )
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        assert host.running(pid)
        os.write(w, b"one\ntwo\n")
        assert asyncio.run(host.wait_gone(pid, 10))
    finally:
        os.close(r)
        os.close(w)
    x, y, nfds = (tmp_path / "log").read_text().split()
    assert (x, y) == ("one", "two") and int(nfds) <= 6  # 0-4 (+ ls's own directory fd): nothing else leaked


def _agent_wait(ready, listening=lambda: True, stopped=False, timeout=5.0):
    async def dead() -> bool:
        return stopped

    return asyncio.run(
        host.wait_for_agent(
            ready,
            listening,
            dead,
            lambda: "the log says why",
            where="a test VM",
            sandbox_id="sb1",
            timeout=timeout,
            poll=0.001,
        )
    )


def test_the_agent_wait_retries_a_socket_that_does_not_accept_yet():
    polls, calls = [], []

    def listening() -> bool:
        polls.append(1)
        return len(polls) > 3

    async def ready():
        calls.append(1)
        if len(calls) < 3:
            raise GuestConnectionError("refused", "sb1")
        return "client"

    assert _agent_wait(ready, listening) == "client"
    assert len(polls) == 4 and len(calls) == 3


def test_the_agent_wait_fails_typed():
    async def refused():
        raise GuestConnectionError("refused", "sb1")

    async def slow():
        await asyncio.sleep(30)

    with pytest.raises(SandboxStartError, match="did not come up in a test VM: the log says why"):
        _agent_wait(refused)
    with pytest.raises(SandboxStartError, match="did not come up in a test VM") as e:
        _agent_wait(refused, listening=lambda: False, stopped=True)
    assert e.value.sandbox_id == "sb1"
    t0 = time.monotonic()
    with pytest.raises(SandboxStartError, match="a test VM stopped during start"):
        _agent_wait(slow, stopped=True)
    with pytest.raises(SandboxStartError, match="did not answer within 0 s"):
        _agent_wait(slow, timeout=0.3)
    assert time.monotonic() - t0 < 5


# ---- teardown: killing a cgroup's processes and waiting for them without polling


def _sleeper(tmp_path: Path) -> int:
    """A detached process (not our child, as a sandbox's are not) that runs until killed."""
    return host.spawn(["sleep", "300"], tmp_path / "sleeper.log", detach=True)


def test_waiting_for_exits_is_an_event_and_bounded(tmp_path):
    a, b = _sleeper(tmp_path), _sleeper(tmp_path)
    try:

        async def scenario():
            asyncio.get_running_loop().call_later(0.05, host.kill, a)
            t0 = time.monotonic()
            left = await host.wait_exited([a, b], 0.3)
            waited = time.monotonic() - t0
            host.kill(b)
            t1 = time.monotonic()
            assert await host.wait_exited([b, 2**22 + 12345], 10) == []  # above pid_max: gone already
            return left, waited, time.monotonic() - t1

        left, waited, after_kill = asyncio.run(scenario())
        assert left == [b] and 0.3 <= waited < 2  # a's exit did not end the wait for b; the bound did
        assert after_kill < 1  # woken by b's exit, not by the 10 s bound
    finally:
        host.kill(a)
        host.kill(b)


def test_a_zombie_counts_as_exited(tmp_path):
    pid = host.spawn(["true"], tmp_path / "log")  # our child: a zombie until waited for
    try:
        time.sleep(0.2)
        assert not host.running(pid)
        assert asyncio.run(host.wait_exited([pid], 5)) == []
    finally:
        os.waitpid(pid, 0)


def _v1_with_procs(root: Path, pids: list[int]) -> host.SandboxCgroup:
    cg = _fake(root, v2=False)
    cg.unified = None
    for c in ("memory", "cpu", "cpuacct", "pids"):
        (root / c / cg.rel).mkdir(parents=True)
    (root / "pids" / cg.rel / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    return cg


def test_kill_and_wait_kills_every_member_and_returns_when_they_have_exited(tmp_path):
    pids = [_sleeper(tmp_path), _sleeper(tmp_path)]
    try:
        cg = _v1_with_procs(tmp_path / "cg", pids)
        assert cg.members() == set(pids)
        t0 = time.monotonic()
        asyncio.run(cg.kill_and_wait(timeout=10))  # no cgroup.kill here: kill_all, then the pidfds
        assert time.monotonic() - t0 < 2 and not any(host.running(p) for p in pids)
    finally:
        for p in pids:
            host.kill(p)


def test_a_process_that_does_not_die_is_a_typed_timeout(tmp_path, monkeypatch):
    from warmbox.errors import SandboxTimeout

    pid = _sleeper(tmp_path)
    try:
        cg = _v1_with_procs(tmp_path / "cg", [pid])
        monkeypatch.setattr(host, "kill", lambda pid, sig=9: None)  # as if stuck in the kernel
        t0 = time.monotonic()
        with pytest.raises(SandboxTimeout, match=f"processes \\[{pid}\\] of the sandbox did not exit") as e:
            asyncio.run(cg.kill_and_wait(timeout=0.3))
        assert e.value.sandbox_id == "sb1" and time.monotonic() - t0 < 3
    finally:
        monkeypatch.undo()
        host.kill(pid)


def test_cgroup_kill_is_used_only_where_the_unified_subtree_holds_the_processes(tmp_path):
    cg = _fake(tmp_path / "v1", v2=False)
    unified = tmp_path / "unified"
    cg.unified = unified
    assert not cg.kill()  # no such directory: kill_all's turn
    d = unified / cg.rel
    (d / "cmd-1").mkdir(parents=True)
    (d / "cgroup.procs").write_text("")
    (d / "cmd-1" / "cgroup.procs").write_text("4242\n")  # the agent's per-command cgroup, one level down
    (d / "cgroup.kill").write_text("")
    (d / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    assert not cg.kill() and (d / "cgroup.kill").read_text() == ""  # empty (runsc's case): nothing written
    (d / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    assert cg.kill() and (d / "cgroup.kill").read_text() == "1"
    assert cg.members() == {4242}


def test_try_remove_never_waits(tmp_path):
    cg = _fake(tmp_path, v2=True)
    (tmp_path / cg.rel / "cmd-1").mkdir(parents=True)
    assert cg.try_remove() and not (tmp_path / cg.rel).exists()
    (tmp_path / cg.rel).mkdir()
    (tmp_path / cg.rel / "stuck").write_text("")
    t0 = time.monotonic()
    assert not cg.try_remove() and time.monotonic() - t0 < 0.5
