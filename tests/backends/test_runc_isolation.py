"""The contract of Tier 2, each item checked by real code inside a real runc sandbox."""

from __future__ import annotations

import os
import time

import pytest

from tests.backends.conftest import NOTHING, leftovers, recording
from warmbox import Limits, Sandbox
from warmbox.guest import userenv

pytestmark = pytest.mark.sandbox


def run(sb, cmd, **kw):
    return sb.commands.run(cmd, timeout=kw.pop("timeout", 30), **kw)


def test_code_runs_as_unprivileged_user_with_no_capabilities(sb):
    assert run(sb, "id -u").stdout.strip() == "1000"
    status = run(sb, "cat /proc/self/status").stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[cap].strip(), 16) == 0, cap
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"


def test_user_namespace_maps_to_unprivileged_host_ids(sb):
    uid_map = run(sb, "cat /proc/self/uid_map").stdout.split()
    inside, outside, size = map(int, uid_map[:3])
    assert inside == 0 and outside >= 2_000_000 and size == 65536
    # host-side view: every process in the sandbox's cgroup runs as an unprivileged host uid
    from warmbox.engine.engine import Engine

    backend = Engine.for_home().backend("container")
    pids = backend._pids(sb.sandbox_id)
    assert pids
    for pid in pids:
        uids = open(f"/proc/{pid}/status").read().split("Uid:")[1].split()[:4]
        assert all(int(u) == outside + 1000 for u in uids), (pid, uids)


def test_own_namespaces(sb):
    host_ns = {n: os.readlink(f"/proc/self/ns/{n}") for n in ("pid", "mnt", "ipc", "uts", "net", "cgroup", "user")}
    inside = run(sb, "for n in pid mnt ipc uts net cgroup user; do echo $n $(readlink /proc/self/ns/$n); done").stdout
    for line in inside.strip().splitlines():
        name, ident = line.split()
        assert ident != host_ns[name], f"{name} namespace is shared with the host"


def test_host_processes_are_invisible(sb):
    pids = run(sb, "ls /proc | grep -E '^[0-9]+$'").stdout.split()
    assert "1" in pids and len(pids) < 10, pids
    assert run(sb, "cat /proc/1/cmdline | tr '\\0' ' '").stdout.startswith("/usr/bin/python3 -I -S")


def test_seccomp_blocks_escape_syscalls(sb):
    r = run(sb, "unshare -U true; echo rc=$?")
    assert "rc=0" not in r.stdout
    code = (
        "import ctypes, errno, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "nr = {'mount': 165, 'unshare': 272, 'keyctl': 250, 'bpf': 321, 'perf_event_open': 298,"
        " 'ptrace': 101, 'io_uring_setup': 425, 'setns': 308, 'add_key': 248, 'userfaultfd': 323}\n"
        "for name, n in sorted(nr.items()):\n"
        "    rc = libc.syscall(n, 0, 0, 0, 0, 0)\n"
        "    print(name, rc, ctypes.get_errno())\n"
    )
    if os.uname().machine != "x86_64":
        pytest.skip("syscall numbers above are x86_64")
    out = run(sb, ["python3", "-c", code]).stdout
    for line in out.strip().splitlines():
        name, rc, err = line.split()
        assert rc == "-1" and err == "1", f"{name} was not refused with EPERM: {line}"


def test_proc_paths_masked_and_readonly(sb):
    assert run(sb, "cat /proc/kcore | head -c 1 | wc -c").stdout.strip() == "0"
    assert run(sb, "cat /proc/keys | wc -c").stdout.strip() == "0"
    r = run(sb, "echo 1 > /proc/sys/kernel/panic")
    assert r.exit_code != 0
    r = run(sb, "echo b > /proc/sysrq-trigger")
    assert r.exit_code != 0


def test_readonly_root_writable_workspace_and_tmp(sb):
    for path in ("/usr/evil", "/etc/evil", "/bin/evil", "/opt/warmbox/evil", "/evil"):
        r = run(sb, f"touch {path}")
        assert r.exit_code != 0, path
    assert run(sb, "echo ok > /workspace/w && echo ok > /tmp/t && cat /workspace/w /tmp/t").stdout == "ok\nok\n"


def test_minimal_etc_and_no_host_secrets(sb):
    r = run(sb, "cat /etc/shadow")
    assert r.exit_code != 0
    # the image's /etc/passwd (Debian's system users) with warmbox's root, user and nobody first
    lines = run(sb, "cat /etc/passwd").stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["root", "user", "nobody"]
    assert all(int(line.split(":")[2]) < 1000 for line in lines[3:]), lines
    assert run(sb, "ls /root 2>&1; ls /home").stdout.split() in (
        ["user"],
        ["ls:", "cannot", "open", "directory", "'/root':", "Permission", "denied", "user"],
    )
    sockets = run(sb, "find / -xdev -type s 2>/dev/null; find /run /tmp /var -type s 2>/dev/null").stdout.strip()
    assert sockets == ""


def test_environment_is_exactly_what_was_passed(sb):
    env = dict(line.split("=", 1) for line in run(sb, ["env"]).stdout.strip().splitlines())
    assert env == {
        "GREETING": "hi",
        # the image's own: its venv and npm prefix first on PATH, proxy variables that say "no network"
        "PATH": f"{userenv.VENV}/bin:{userenv.NPM_PREFIX}/bin:"
        + "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "VIRTUAL_ENV": userenv.VENV,
        "npm_config_prefix": userenv.NPM_PREFIX,
        **userenv.OFFLINE_ENV,
        "HOME": "/home/user",
        "LANG": "C.UTF-8",
    }
    assert "WARMBOX_HOME" in os.environ  # set on the host, and still not inside


def test_only_loopback_network(sb):
    devs = [ln.split(":")[0].strip() for ln in run(sb, "cat /proc/net/dev").stdout.splitlines()[2:]]
    assert devs == ["lo"]
    r = run(sb, ["python3", "-c", "import socket; s = socket.socket(); s.settimeout(2); s.connect(('192.0.2.1', 80))"])
    assert r.exit_code != 0 and "Network is unreachable" in r.stderr
    # loopback itself works
    r = run(
        sb,
        [
            "python3",
            "-c",
            (
                "import socket; a = socket.socket(); a.bind(('127.0.0.1', 0)); a.listen(); "
                "b = socket.create_connection(a.getsockname()); print('lo ok')"
            ),
        ],
    )
    assert r.stdout == "lo ok\n"


def test_proc_self_exe_cannot_be_overwritten(sb):
    r = run(sb, ["python3", "-c", "open('/proc/self/exe', 'wb').write(b'x')"])
    assert r.exit_code != 0
    r = run(sb, "cp /bin/true /proc/1/exe")
    assert r.exit_code != 0


def test_no_host_file_descriptors_inherited(sb):
    fds = run(sb, "ls -l /proc/self/fd | tail -n +2").stdout.strip().splitlines()
    targets = sorted(line.split("-> ")[1] for line in fds)
    # stdin /dev/null, stdout/stderr pipes, and ls's own directory fd
    assert len(targets) == 4, targets
    assert targets[0] == "/dev/null" and targets[1].startswith("/proc/")
    assert all(t.startswith("pipe:") for t in targets[2:])


def test_tools_work_inside(sb):
    r = run(
        sb,
        "node -e 'console.log(6*7)'; printf 'int main(){return 3;}' > /tmp/a.c && gcc -o /tmp/a /tmp/a.c "
        "&& /tmp/a; echo $?; git --version | cut -d' ' -f1",
    )
    assert r.stdout.split() == ["42", "3", "git"], r.stderr


def test_sandboxes_cannot_see_each_other(home, runc_ready):
    with Sandbox.create(timeout=60) as a, Sandbox.create(timeout=60) as b:
        a.files.write("/workspace/secret.txt", "a's data")
        r = b.commands.run("cat /workspace/secret.txt; ls -A /workspace; ls /proc | grep -cE '^[0-9]+$'")
        assert "a's data" not in r.stdout and r.stdout.split()[0] == r.stdout.split()[-1]
        assert a.commands.run("cat /proc/self/uid_map").stdout != b.commands.run("cat /proc/self/uid_map").stdout


def test_memory_bomb_is_oom_killed(home, runc_ready):
    with Sandbox.create(timeout=60, limits=Limits(memory_mb=128)) as s:
        t0 = time.monotonic()
        r = s.commands.run(["python3", "-c", "x = b'a' * (1 << 30); print('survived')"], timeout=30)
        assert r.oom_killed and r.signal == 9 and "survived" not in r.stdout
        assert time.monotonic() - t0 < 20
        assert s.commands.run("echo alive").stdout == "alive\n"


def test_fork_bomb_is_contained_by_pids_limit(home, runc_ready):
    with Sandbox.create(timeout=60, limits=Limits(pids=64)) as s:
        t0 = time.monotonic()
        r = s.commands.run("bomb() { bomb | bomb & }; bomb; sleep 2; ls /proc | grep -cE '^[0-9]+$'", timeout=5)
        # the host stays responsive while the bomb runs
        assert time.monotonic() - t0 < 15
        assert r.timed_out or r.exit_code == 0
        assert s.commands.run("echo alive", timeout=20).stdout == "alive\n"
        cur = s.commands.run("ls /proc | grep -cE '^[0-9]+$'").stdout.strip()
        assert int(cur) <= 64


def test_cpu_quota_applies(home, runc_ready):
    with Sandbox.create(timeout=60, limits=Limits(cpus=0.25)) as s:
        code = (
            "import time\nt = time.time(); c = time.process_time()\nwhile time.time() - t < 1.0: pass\n"
            "print(time.process_time() - c)"
        )
        used = float(s.commands.run(["python3", "-c", code]).stdout)
        assert used < 0.5, f"a 0.25-cpu sandbox burnt {used:.2f} cpu-s in 1 s of wall time"


def test_rlimits_file_size_and_open_files(home, runc_ready):
    with Sandbox.create(timeout=60, limits=Limits(file_size_mb=1, open_files=64)) as s:
        r = s.commands.run("head -c 3000000 /dev/zero > /workspace/big; echo rc=$?; stat -c %s /workspace/big")
        assert "rc=0" not in r.stdout and r.stdout.split()[-1] == str(1 << 20)
        r = s.commands.run(["python3", "-c", "fs = [open('/dev/null') for _ in range(100)]"])
        assert r.exit_code != 0 and "Too many open files" in r.stderr


def test_teardown_kills_through_the_cgroup_deletes_without_force_and_repeats_harmlessly(home, runc_ready, monkeypatch):
    """runc's ``delete --force`` sleeps 100 ms after its SIGKILL: the backend kills and waits itself, so
    runc only deletes a stopped container; a second teardown finds nothing to do."""
    import asyncio

    from warmbox.backends import _host as host
    from warmbox.engine.engine import Engine

    engine = Engine.for_home(home)
    backend = engine.backend("container")
    calls = recording(backend, monkeypatch)
    sb = Sandbox.create(timeout=60)
    sb.commands.run("sleep 1000 > /dev/null 2>&1 &")
    _, handle = engine.info(sb.sandbox_id)
    pids = host.SandboxCgroup(sb.sandbox_id).members()
    assert len(pids) >= 2 and leftovers(backend, handle) != NOTHING
    sb.kill()
    assert calls == [("delete", sb.sandbox_id)]
    assert not [p for p in pids if host.running(p)] and leftovers(backend, handle) == NOTHING
    asyncio.run(backend.destroy(handle))
    assert calls == [("delete", sb.sandbox_id)] and leftovers(backend, handle) == NOTHING
