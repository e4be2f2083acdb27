"""Tier 4 (microVM): own kernel, started from memory snapshots, the same SDK calls, nothing left.

Under TCG on this host. One template boot for the whole module (every sandbox here has the
same shape, so all of them are restores of it); never more than two VMs run at once (the
module's ``vm`` plus at most one more).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.backends.conftest import qemu_pids as _qemu_pids
from warmbox import Limits, Sandbox, State
from warmbox import protocol as p
from warmbox.backends import microvm_net
from warmbox.backends.microvm import GUEST_OVERHEAD_MB, HOST_CPU_HEADROOM, HOST_OVERHEAD_MB, TCG_CACHE_MB, HostCgroup
from warmbox.engine import teardown
from warmbox.engine.guest_client import GuestClient
from warmbox.guest import userenv

LIMITS = Limits(memory_mb=256, pids=64, tmp_mb=64)


@pytest.fixture(scope="module")
def vm(engine):
    os.environ["WB_HOST_ONLY_SECRET"] = "host-secret-value"
    try:
        with Sandbox.create(tier="microvm", timeout=600, limits=LIMITS, envs={"GREETING": "hi"}) as sb:
            yield sb
    finally:
        os.environ.pop("WB_HOST_ONLY_SECRET", None)


@pytest.mark.sandbox
def test_the_first_create_boots_a_template_and_later_ones_restore_it(engine, vm):
    stages = engine.timings(vm.sandbox_id)
    assert {"template", "allocation", "filesystem", "runtime"} <= set(stages)
    assert stages["template"] > stages["runtime"]  # booting the template costs more than a restore
    with Sandbox.create(tier="microvm", timeout=60, limits=LIMITS) as other:
        assert "template" not in engine.timings(other.sandbox_id)  # only a restore of the same template
        reasons = [t.reason for t in engine.registry.sandboxes.transitions(other.sandbox_id)]
        snap = next(r for r in reasons if r.startswith("restored from snap-"))
        assert snap in [t.reason for t in engine.registry.sandboxes.transitions(vm.sandbox_id)]
        assert other.commands.run("cat /workspace/data.txt 2>/dev/null || echo fresh").stdout == "fresh\n"
        # both are restores of one memory image: their random generators must still differ
        draws = [
            (
                s.commands.run("head -c 16 /dev/urandom | od -An -tx1").stdout,
                s.commands.run(["python3", "-c", "import os; print(os.urandom(8).hex())"]).stdout,
                s.run_code("import random, os; (random.random(), os.urandom(8).hex())").text,
            )
            for s in (vm, other)
        ]
        assert all(len(d[0].split()) == 16 for d in draws)
        assert not {*draws[0]} & {*draws[1]}, draws


@pytest.mark.sandbox
def test_own_kernel_and_no_host_filesystem(vm):
    r = vm.commands.run("uname -r; cat /proc/cmdline; cat /proc/mounts")
    lines = r.stdout.splitlines()
    assert lines[0] != os.uname().release and lines[0].endswith("-amd64")
    boot_id = vm.commands.run("cat /proc/sys/kernel/random/boot_id").stdout.strip()
    assert boot_id and boot_id != Path("/proc/sys/kernel/random/boot_id").read_text().strip()  # another kernel
    assert "rdinit=/init" in lines[1]
    kinds = {ln.split()[2] for ln in lines[2:]}
    assert not kinds & {"9p", "virtiofs", "fuse", "nfs", "overlay"}  # nothing shared from the host
    devices = {ln.split()[0] for ln in lines[2:] if ln.startswith("/dev/")}
    assert devices == {"/dev/vda", "/dev/vdb"}
    marker = Path(f"/tmp/wbt-host-marker-{os.getpid()}")
    marker.write_text("host only")
    try:
        r = vm.commands.run(f"ls {marker} 2>&1; ls /var/lib/warmbox 2>&1; hostname")
        assert "No such file" in r.stdout.splitlines()[0] and "No such file" in r.stdout.splitlines()[1]
        assert r.stdout.splitlines()[2] == "sandbox"
    finally:
        marker.unlink()


@pytest.mark.sandbox
def test_non_root_no_capabilities_no_host_env(vm):
    r = vm.commands.run("id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status")
    out = r.stdout.split()
    assert out[0] == "1000"
    assert out[1:] == ["CapEff:", "0000000000000000", "CapBnd:", "0000000000000000", "NoNewPrivs:", "1"]
    env = dict(ln.split("=", 1) for ln in vm.commands.run(["/usr/bin/env"]).stdout.splitlines() if "=" in ln)
    image = {"VIRTUAL_ENV", "npm_config_prefix", *userenv.OFFLINE_ENV}  # the image's own (guest/userenv.py)
    assert set(env) == {"PATH", "HOME", "LANG", "GREETING", *image} and env["GREETING"] == "hi"
    assert "host-secret-value" not in vm.commands.run("cat /proc/1/environ /proc/cmdline").stdout
    assert vm.commands.run("test -w /usr || echo ro").stdout.strip() == "ro"


@pytest.mark.sandbox
def test_the_guest_has_the_agent_toolchain(vm):
    """What agents run: Node.js, gcc, git and NumPy inside the VM's own root image."""
    r = vm.commands.run(
        "cd /workspace && node -e 'console.log(6 * 7)' && printf 'int main(void){return 7;}' > t.c "
        "&& gcc t.c -o t && { ./t; echo rc=$?; } && git init -q r && git -C r status --short "
        "&& python3 -c 'import numpy; print(numpy.arange(4).sum())'",
        timeout=120,
    )
    assert r.stdout.split() == ["42", "rc=7", "6"], r


@pytest.mark.sandbox
def test_the_nic_leads_nowhere_without_a_policy(vm):
    # every VM has its NIC (its memory image needs it); without a policy its namespace has no link
    r = vm.commands.run(["python3", "-c", "import socket; print(sorted(n for _, n in socket.if_nameindex()))"])
    assert r.stdout.strip() == "['eth0', 'lo']"
    # loopback is up: a server and its client inside the VM talk over 127.0.0.1
    r = vm.commands.run(
        [
            "python3",
            "-c",
            "import socket, threading\ns = socket.create_server(('127.0.0.1', 0))\n"
            "threading.Thread(target=lambda: s.accept()[0].sendall(b'over lo'), daemon=True).start()\n"
            "print(socket.create_connection(s.getsockname(), 5).recv(100).decode())",
        ],
        timeout=30,
    )
    assert r.stdout.strip() == "over lo", r
    r = vm.commands.run(
        [
            "python3",
            "-c",
            "import socket\ntry:\n socket.create_connection(('10.0.2.2', 80), 2)\n"
            " print('connected')\nexcept OSError as e:\n print('refused', e.errno)",
        ]
    )
    assert r.stdout.startswith("refused")


@pytest.mark.sandbox
def test_files_contexts_and_a_timeout_that_kills_the_tree(vm):
    vm.files.write("/workspace/data.txt", "on the VM's own disk")
    assert vm.files.read("/workspace/data.txt") == "on the VM's own disk"
    vm.run_code("x = 41")
    assert vm.run_code("x + 1").text == "42"
    t0 = time.monotonic()
    r = vm.commands.run("sleep 1000 & sleep 1000", timeout=2)
    assert r.timed_out and time.monotonic() - t0 < 15
    assert vm.commands.run("pgrep -c sleep || true").stdout.strip() in ("0", "")


@pytest.mark.sandbox
def test_limits_hold_inside_the_guest(vm):
    t0 = time.monotonic()
    r = vm.commands.run(
        ["python3", "-c", "x = [b'a' * (128 << 20) for _ in range(3)]; print('survived')"], timeout=120
    )  # each part fits the VM's RAM (352 MiB), all three not the cgroup's 256
    assert "survived" not in r.stdout and r.exit_code != 0 and r.oom_killed  # the guest kernel's OOM kill
    print(f"OOM kill after {time.monotonic() - t0:.1f} s")
    assert not vm.commands.run("true").oom_killed  # counted per command, not "ever"
    # a pipeline's exit status is its last command's: the guest's counter still tells
    r = vm.commands.run("python3 -c \"x = [b'a' * (128 << 20) for _ in range(3)]\" | cat; echo done", timeout=120)
    assert r.exit_code == 0 and r.stdout == "done\n" and r.oom_killed
    r = vm.run_code("blob = [b'a' * (128 << 20) for _ in range(3)]", timeout=120)  # the context process itself
    assert r.oom_killed and r.error is not None
    assert vm.run_code("2 + 2").text == "4" and not vm.commands.run("kill -9 $$").oom_killed
    assert vm.commands.run("cat /sys/fs/cgroup/sandbox/memory.max /sys/fs/cgroup/sandbox/pids.max").stdout.split() == [
        str(256 << 20),
        "64",
    ]
    r = vm.commands.run(
        [
            "python3",
            "-c",
            "import subprocess\nps = []\ntry:\n for i in range(200):\n"
            "  ps.append(subprocess.Popen(['sleep', '30']))\n"
            "except OSError as e:\n print('stopped at', len(ps))\n"
            "for p in ps: p.kill()",
        ],
        timeout=60,
    )
    assert r.stdout.startswith("stopped at"), r
    assert int(r.stdout.split()[-1]) < 64
    assert vm.commands.run("echo alive").stdout == "alive\n"  # the agent survived both


@pytest.mark.sandbox
def test_two_clients_share_one_vm_at_once(engine, vm):
    """The relay multiplexes: a second connection works while the first streams a command."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(vm.commands.run("sleep 2; echo slow")))
    t.start()
    time.sleep(0.5)
    _, handle = engine.info(vm.sandbox_id)

    async def second() -> bytes:
        client = await GuestClient.connect(handle.socket_path, vm.sandbox_id)
        out = b""
        try:
            async with client.request(
                lambda i: p.Exec(
                    i, argv=["/bin/echo", "fast"], env={}, cwd="", timeout_s=10, max_output=1000, stdin=False
                ),
                timeout=20,
            ) as stream:
                while True:
                    msg = await stream.next(p.Started, p.Stdout, p.Stderr, p.Exited)
                    if isinstance(msg, p.Stdout):
                        out += msg.data
                    if isinstance(msg, (p.Exited, p.Failure)):
                        return out
        finally:
            await client.close()

    t0 = time.monotonic()
    assert asyncio.run(second()) == b"fast\n"
    assert time.monotonic() - t0 < 1.5  # not queued behind the first client's command
    t.join(30)
    assert out and out[0].stdout == "slow\n"


@pytest.mark.sandbox
def test_pause_resume_and_fork_continue_memory_and_disk(engine):
    sb = Sandbox.create(tier="microvm", timeout=120, limits=LIMITS)
    sb.run_code("counter = 41")
    sb.files.write("/workspace/kept.txt", "disk state")
    sb.commands.run(
        "(i=0; while true; do i=$((i+1)); echo $i > /tmp/bg.new; mv /tmp/bg.new /tmp/bg; "  # never empty
        "sleep 0.1; done) >/dev/null 2>&1 &"
    )
    time.sleep(1)
    up = float(sb.commands.run("cut -d' ' -f1 /proc/uptime").stdout)
    ref = sb.pause(memory=True)
    assert ref.memory and ref.tier == "microvm" and ref.size_bytes > 0
    assert engine.info(sb.sandbox_id)[0].state is State.PAUSED
    assert not (engine.runtime / "sandboxes" / sb.sandbox_id).exists()
    assert not [
        p for p in _qemu_pids(engine.runtime) if str(sb.sandbox_id).encode() in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    with Sandbox.resume(sb.sandbox_id, timeout=120) as back:
        assert back.run_code("counter + 1").text == "42"
        assert back.files.read("/workspace/kept.txt") == "disk state"
        assert float(back.commands.run("cut -d' ' -f1 /proc/uptime").stdout) >= up  # the same kernel, going on
        # ...but its wall clock is the host's, not the one frozen in the memory image
        assert abs(float(back.commands.run("date +%s.%N").stdout) - time.time()) < 1.0
        first = int(back.commands.run("cat /tmp/bg").stdout)
        time.sleep(1)
        assert int(back.commands.run("cat /tmp/bg").stdout) > first
        back.files.write("/workspace/only-in-back.txt", "x")
        snap = back.pause(memory=True)
    time.sleep(2)  # the fork's clock must not be the snapshot's
    with Sandbox.create(from_snapshot=snap, timeout=60) as fork:
        assert fork.tier == "microvm"
        assert abs(float(fork.commands.run("date +%s.%N").stdout) - time.time()) < 1.0
        assert fork.run_code("counter").text == "41"
        assert fork.files.read("/workspace/only-in-back.txt") == "x"
        fork.files.write("/workspace/fork.txt", "fork")
    with Sandbox.create(from_snapshot=snap, timeout=60) as sibling:  # with the module's VM: two at once, no more
        assert not sibling.files.exists("/workspace/fork.txt")
        assert sibling.files.read("/workspace/kept.txt") == "disk state"
    assert engine.info(back.sandbox_id)[0].state is State.PAUSED
    asyncio.run(teardown.destroy(engine, back.sandbox_id, "test done"))  # a paused sandbox is destroyed without a VM


@pytest.mark.sandbox
def test_the_image_root_is_readable_by_root_alone(vm):
    # a root holds a template's whole filesystem (a tenant's COPY'd files): no other host user reads it
    from warmbox.backends import microvm_image

    ident = vm.get_info().image_id.removeprefix("sha256:")[:32]
    roots = list((microvm_image.cache_dir() / microvm_image.ROOTS).glob(f"{ident}-{microvm_image.agent_hash()}.ext4"))
    assert len(roots) == 1, roots
    st = roots[0].stat()
    assert st.st_uid == 0 and st.st_mode & 0o077 == 0, oct(st.st_mode)
    r = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "head", "-c", "1", str(roots[0])],
        capture_output=True,
    )
    assert r.returncode != 0 and b"Permission denied" in r.stderr, r


@pytest.mark.sandbox
def test_a_files_only_pause_resumes_with_the_files(engine):
    # the guest's workspace disk has mkfs's lost+found (root's, 0700): the user's find cannot read it
    sb = Sandbox.create(tier="microvm", timeout=120, limits=LIMITS)
    sb.files.write("/workspace/kept.txt", "files only")
    sb.run_code("counter = 7")
    ref = sb.pause(memory=False)
    assert not ref.memory and ref.tier == "microvm"
    with Sandbox.resume(sb.sandbox_id, timeout=120) as back:
        assert back.files.read("/workspace/kept.txt") == "files only"
        assert back.run_code("counter").text == "7"  # the context's variables, saved with the files


@pytest.mark.sandbox
def test_kill_leaves_no_vm_socket_or_disk(engine):
    sb = Sandbox.create(tier="microvm", timeout=60, limits=LIMITS)
    state = engine.runtime / "sandboxes" / sb.sandbox_id
    assert (state / "workspace" / "disk.qcow2").is_file()
    pids = [p for p in _qemu_pids(engine.runtime) if sb.sandbox_id.encode() in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(pids) == 2  # QEMU + its relay
    cgroups = HostCgroup(sb.sandbox_id).dirs()
    assert all(d.is_dir() for d in cgroups)
    ns = microvm_net.netns_path(state)
    assert ns.exists()
    sb.kill()
    assert engine.info(sb.sandbox_id)[0].state is State.DESTROYED
    assert not state.exists() and not ns.exists()
    assert not [d for d in cgroups if d.exists()]
    assert not [
        p
        for p in pids
        if Path(f"/proc/{p}").exists() and b"Z" not in Path(f"/proc/{p}/stat").read_bytes().split(b")")[-1][:3]
    ]


@pytest.mark.sandbox
def test_doctor_reports_the_accelerator_and_config_can_force_it(engine, home):
    from tests.conftest import cli

    r = cli("doctor")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("microvm"))
    if Path("/sys/module/kvm_pvm").is_dir():  # this project's host: PVM runs only PVM-built kernels
        assert "accelerator tcg" in line and "PVM" in line
    else:
        assert "accelerator kvm" in line or "accelerator tcg" in line
    r = cli("doctor", env={"WARMBOX_MICROVM_ACCEL": "warp"})
    assert r.returncode == 125 and "WARMBOX_MICROVM_ACCEL" in r.stderr and "Traceback" not in r.stderr
    (home / "warmbox.toml").write_text((home / "warmbox.toml").read_text() + '\n[microvm]\naccel = "warp"\n')
    try:
        r = cli("doctor")
        assert r.returncode != 0 and "microvm.accel" in (r.stdout + r.stderr) and "Traceback" not in r.stderr
    finally:
        from tests.conftest import set_config

        set_config(home)


@contextlib.contextmanager
def _relay_without_vm(tmp_path: Path, *args: str, stderr=None):
    """vmrelay on a fake QEMU agent chardev: (the relay process, the guest's end, its listen path)."""
    import sys

    from warmbox.backends import vmrelay

    guest_path, listen = tmp_path / "vm.sock", tmp_path / "agent.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(guest_path))
    srv.listen(1)
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", vmrelay.__file__, str(guest_path), str(listen), *args], stderr=stderr
    )
    try:
        guest, _ = srv.accept()
        yield proc, guest, listen
    finally:
        proc.kill()
        proc.wait()
        srv.close()


def _client(listen: Path) -> socket.socket:
    c = socket.socket(socket.AF_UNIX)
    for _ in range(200):
        try:
            c.connect(str(listen))
            return c
        except OSError:
            time.sleep(0.01)
    raise AssertionError(f"{listen} never accepted")


def test_relay_rejects_a_hostile_guest_and_maps_ids(tmp_path):
    """vmrelay without a VM: two clients' ids never collide; a malformed guest frame ends it."""
    with _relay_without_vm(tmp_path, stderr=subprocess.PIPE) as (proc, guest, listen):
        clients = [_client(listen) for _ in range(2)]
        for c in clients:
            c.sendall(p.encode(p.Ping(1)))  # both use id 1
        seen = [p.recv_message(guest, p.HOST_TO_GUEST) for _ in range(2)]
        gids = [m.id for m in seen]
        assert len(set(gids)) == 2 and 1 not in gids
        guest.sendall(p.encode(p.Pong(gids[1], version=2, pid=1)))
        guest.sendall(p.encode(p.Pong(gids[0], version=2, pid=1)))
        guest.sendall(p.encode(p.Pong(999, version=2, pid=1)))  # unknown id: dropped
        for c in clients:
            c.settimeout(5)
            m = p.recv_message(c, p.GUEST_TO_HOST)
            assert isinstance(m, p.Pong) and m.id == 1
        guest.sendall(b"\x00\x00\x00\x05\x00\x00\x00\x00{bad}")
        assert proc.wait(10) == 0
        assert b"violated the protocol" in proc.stderr.read()
        for c in clients:
            assert c.recv(1) == b""


@pytest.mark.sandbox
def test_qemu_and_relay_run_confined(engine, vm):
    """QEMU drops to the sandbox's own uid, chroots into an empty dir and is seccomp-filtered;
    the relay parses guest bytes as that uid too."""
    _, handle = engine.info(vm.sandbox_id)
    state = Path(handle.state_dir)
    qemu = int((state / "qemu.pid").read_text())
    relay = int((state / "relay.pid").read_text())
    for pid in (qemu, relay):
        status = dict(ln.split(":\t", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in ln)
        assert status["Uid"].split()[:2] == [str(handle.uid_base)] * 2
        assert status["CapEff"].strip() == "0000000000000000"
    # both run inside the VM's host cgroup, which bounds QEMU's memory (guest RAM + TCG cache + its
    # own), its CPU (limits.cpus) and threads, and is what the meter reads
    cg = HostCgroup(vm.sandbox_id)
    for d in cg.dirs():
        assert {qemu, relay} <= {int(x) for x in (d / "cgroup.procs").read_text().split()}, d
    limit = (cg.root / "memory" / cg.rel / "memory.limit_in_bytes") if not cg.v2 else (cg.root / cg.rel / "memory.max")
    tcg = TCG_CACHE_MB if engine.backend("microvm").accel()[0] == "tcg" else 0
    assert int(limit.read_text()) == (LIMITS.memory_mb + GUEST_OVERHEAD_MB + tcg + HOST_OVERHEAD_MB) << 20
    quota = (cg.root / "cpu" / cg.rel / "cpu.cfs_quota_us") if not cg.v2 else (cg.root / cg.rel / "cpu.max")
    assert quota.read_text().split()[0] == str(int((LIMITS.cpus + HOST_CPU_HEADROOM) * 100_000))
    anon, cpu_ns = cg.usage()  # what the meter reads: the VM's resident memory and CPU
    assert anon > LIMITS.memory_mb << 18 and cpu_ns > 0
    m = vm.metrics()
    assert m.memory_bytes > LIMITS.memory_mb << 18 and m.cpu_s > 0
    q = dict(ln.split(":\t", 1) for ln in Path(f"/proc/{qemu}/status").read_text().splitlines() if ":\t" in ln)
    assert q["Seccomp"].strip() == "2"
    assert os.readlink(f"/proc/{qemu}/root") == str(state / "empty") and not os.listdir(state / "empty")
    # in the VM's own network namespace (its NIC's tap is there), not the host's
    own = os.stat(microvm_net.netns_path(state))
    assert (os.stat(f"/proc/{qemu}/ns/net").st_ino, os.stat(f"/proc/{qemu}/ns/net").st_dev) == (own.st_ino, own.st_dev)
    assert os.stat(f"/proc/{qemu}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino


def test_a_workspace_disk_naming_other_files_is_refused(tmp_path):
    """QEMU opens the backing/data files a qcow2 header names, as root: only warmbox's own pass."""
    from warmbox.backends.microvm import check_workspace_disk
    from warmbox.backends.microvm_image import WORKSPACE_MB
    from warmbox.errors import SandboxStartError

    base, other = tmp_path / "workspace.raw", tmp_path / "host-secret"
    with open(base, "wb") as f:
        f.truncate(WORKSPACE_MB << 20)  # the image's own workspace disk (its size is the quota)
    small = tmp_path / "workspace-64M.raw"  # the disk of a sandbox with limits.disk_mb = 64
    with open(small, "wb") as f:
        f.truncate(64 << 20)
    (tmp_path / "workspace-65M.raw").write_bytes(b"")
    other.write_bytes(b"secret" * 100)

    def qcow2(name: str, *opts: str) -> Path:
        disk = tmp_path / name
        size = ["1M"] if "-b" not in opts or "-u" in opts else []
        subprocess.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", *opts, str(disk), *size], check=True, capture_output=True
        )
        return disk

    assert check_workspace_disk(qcow2("ok.qcow2", "-b", str(base), "-F", "raw"), tmp_path) == WORKSPACE_MB
    assert check_workspace_disk(qcow2("ok64.qcow2", "-b", str(small), "-F", "raw"), tmp_path) == 64
    cases = {
        "backing": qcow2("other.qcow2", "-b", str(other), "-F", "raw"),
        "raw": qcow2("fmt.qcow2", "-b", str(base), "-F", "qcow2", "-u"),
        "data": qcow2("data.qcow2", "-b", str(base), "-F", "raw", "-o", f"data_file={tmp_path / 'data.raw'}"),
        "none": qcow2("none.qcow2"),
    }
    for name, backing, size in (
        ("bigger", small, "128M"),  # a disk past its quota
        ("sizename", tmp_path / "workspace-65M.raw", "64M"),
    ):  # a size the name does not say
        subprocess.run(
            [
                "qemu-img",
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                str(backing),
                "-F",
                "raw",
                "-u",
                str(tmp_path / f"{name}.qcow2"),
                size,
            ],
            check=True,
            capture_output=True,
        )
        cases[name] = tmp_path / f"{name}.qcow2"
    (tmp_path / "junk.qcow2").write_bytes(b"not a disk at all")
    cases["junk"] = tmp_path / "junk.qcow2"
    cases["v2"] = qcow2("v2.qcow2", "-b", str(base), "-F", "raw", "-o", "compat=0.10")
    bitmap = qcow2("bm.qcow2", "-b", str(base), "-F", "raw")
    subprocess.run(["qemu-img", "bitmap", "--add", str(bitmap), "b0"], check=True, capture_output=True)
    cases["bitmap"] = bitmap
    subprocess.run(
        ["qemu-img", "snapshot", "-c", "s1", str(snap := qcow2("sn.qcow2", "-b", str(base), "-F", "raw"))],
        check=True,
        capture_output=True,
    )
    cases["snapshot"] = snap
    (tmp_path / "link.qcow2").symlink_to(tmp_path / "ok.qcow2")
    cases["symlink"] = tmp_path / "link.qcow2"
    why = {
        "backing": "backing file is not",
        "raw": "not raw",
        "data": "external data file",
        "none": "backing file is not",
        "bigger": "virtual size",
        "sizename": "virtual size",
        "junk": "not a qcow2",
        "v2": "v3",
        "bitmap": "header extension",
        "snapshot": "internal snapshots",
        "symlink": "links",
    }
    for what, disk in cases.items():
        with pytest.raises(SandboxStartError, match=why[what]):
            check_workspace_disk(disk, tmp_path)


def test_the_relay_serves_nobody_until_the_guest_took_entropy_and_clock(tmp_path):
    """vmrelay's restore handshake against a fake guest helper: entropy, 'R', a fresh clock, 'K',
    the volumes to mount, one answer per slot."""
    import struct

    from warmbox.backends import vmrelay

    block = vmrelay.MOUNT_SLOTS * vmrelay.MOUNT_RECORD

    def helper(answers: bytes) -> tuple[socket.socket, list[bytes]]:
        a, b = socket.socketpair()
        got: list[bytes] = []

        def run():
            got.append(b.recv(64, socket.MSG_WAITALL))
            b.sendall(answers[:1])
            if answers[:1] == b"R":
                got.append(b.recv(16, socket.MSG_WAITALL))
                b.sendall(answers[1:2])
                if answers[1:2] == b"K":
                    got.append(b.recv(block, socket.MSG_WAITALL))
                    b.sendall(answers[2:])
            b.close() if answers == b"" else None

        threading.Thread(target=run, daemon=True).start()
        return a, got

    sock, got = helper(b"RK----")
    t0 = time.time()
    assert vmrelay.after_restore(sock, timeout=5) == ""
    assert len(got[0]) == 64 and abs(struct.unpack("<qq", got[1])[0] - t0) < 5
    assert got[2] == bytes(block)  # nothing to mount
    mounts = bytearray(block)
    mounts[0], mounts[1:6] = 1, b"/data"
    sock, got = helper(b"RKP---")
    assert "volume at /data: its mount point" in vmrelay.after_restore(sock, timeout=5, mounts=bytes(mounts))
    assert got[2] == bytes(mounts)
    sock, _ = helper(b"RKM---")
    assert vmrelay.after_restore(sock, timeout=5, mounts=bytes(mounts)) == ""
    sock, _ = helper(b"E")
    assert "answered b'E' to the entropy" in vmrelay.after_restore(sock, timeout=5)
    sock, _ = helper(b"RE")
    assert "to the clock" in vmrelay.after_restore(sock, timeout=5)
    sock, _ = helper(b"")  # the helper goes away
    assert vmrelay.after_restore(sock, timeout=5) != ""
    a, b = socket.socketpair()  # never answers
    t0 = time.monotonic()
    assert "no answer" in vmrelay.after_restore(a, timeout=0.5) and time.monotonic() - t0 < 3
    b.close()

    # the whole relay: a client's Ping is not forwarded before the helper answered
    restore_path = tmp_path / "restore.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(restore_path))
    srv.listen(1)
    try:
        with _relay_without_vm(tmp_path, str(os.getuid()), "0", str(restore_path)) as (_proc, guest, listen):
            restore, _ = srv.accept()
            c = _client(listen)
            c.sendall(p.encode(p.Ping(1)))
            guest.settimeout(0.5)
            with pytest.raises(socket.timeout):
                guest.recv(1)  # nothing reaches the guest's agent before the restore helper answered
            assert len(restore.recv(64, socket.MSG_WAITALL)) == 64
            restore.sendall(b"R")
            assert len(restore.recv(16, socket.MSG_WAITALL)) == 16
            restore.sendall(b"K")
            assert restore.recv(block, socket.MSG_WAITALL) == bytes(block)
            with pytest.raises(socket.timeout):
                guest.recv(1)  # nor before the volumes were mounted
            restore.sendall(b"----")
            guest.settimeout(5)
            assert isinstance(p.recv_message(guest, p.HOST_TO_GUEST), p.Ping)
    finally:
        srv.close()


def test_building_an_image_prunes_dead_builds_and_old_debian_trees_only(tmp_path):
    from warmbox.backends import microvm_image as images

    keep = tmp_path / "microvm-new"
    for name in ("microvm-new", "microvm-old", "microvm-broken", "debian-old", ".tmp-microvm-1-2"):
        (tmp_path / name).mkdir()
    for name in ("microvm-new", "microvm-old"):
        (tmp_path / name / "meta.json").write_text("{}")
    long_ago = time.time() - 2 * images.PRUNE_AFTER_S
    for name in ("microvm-old", "microvm-old/meta.json", "microvm-broken", "debian-old", ".tmp-microvm-1-2"):
        os.utime(tmp_path / name, (long_ago, long_ago))
    gone = images.prune(tmp_path, keep=keep)
    # an old finished image stays: paused sandboxes and templates of any home may still need it
    assert sorted(gone) == [".tmp-microvm-1-2", "debian-old", "microvm-broken"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["microvm-new", "microvm-old"]


@pytest.mark.sandbox
def test_a_disk_of_another_image_build_is_never_restored(engine, tmp_path):
    """Rebuilt from the same sources an image differs (mkfs UUIDs): a snapshot's disk and memory
    name the build they belong to, and a restore into another build is refused before QEMU runs."""
    from warmbox.backends.base import BackendHandle
    from warmbox.backends.microvm import IMAGE_ID_FILE
    from warmbox.errors import SandboxStartError

    backend = engine.backend("microvm")
    state = tmp_path / "sb-000000000000"
    (state / "workspace").mkdir(parents=True)
    (state / "run").mkdir()
    subprocess.run(
        [
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            str(backend.image() / "workspace.raw"),
            "-F",
            "raw",
            str(state / "workspace" / "disk.qcow2"),
        ],
        check=True,
    )
    (state / "workspace" / IMAGE_ID_FILE).write_text("0123456789abcdef")
    handle = BackendHandle(
        sandbox_id=state.name,
        tier="microvm",
        runtime_id=state.name,
        state_dir=str(state),
        socket_path=str(state / "run" / "agent.sock"),
        uid_base=0x7FFD0000,
    )
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "checkpoint.img").write_bytes(b"")

    async def ready():
        raise AssertionError("no VM may start")

    with pytest.raises(SandboxStartError, match="guest image build 0123456789abcdef"):
        asyncio.run(backend.restore(handle, tmp_path / "mem", ready))
    assert not HostCgroup(state.name).dirs()[0].exists() and not (state / "qemu.pid").exists()


@pytest.mark.sandbox
def test_the_kvm_probe_boots_a_guest_under_kvm_or_reports_why_not(engine, tmp_path, monkeypatch):
    """The probe itself (doctor skips it on a PVM host, whose verdict is known): a guest of the
    real image under -accel kvm, its console watched within a bound, stopped by its pidfile."""
    from warmbox.backends import microvm

    if not os.path.exists("/dev/kvm"):
        pytest.skip("no /dev/kvm on this host")
    monkeypatch.setattr(microvm, "PROBE_TIMEOUT_S", 8.0)
    t0 = time.monotonic()
    accel, why = microvm._probe_kvm(tmp_path)
    assert accel in ("kvm", "tcg") and why
    if Path("/sys/module/kvm_pvm").is_dir():  # measured: Debian's kernel never reaches init under PVM
        assert accel == "tcg" and "did not boot under KVM within 8 s" in why
        assert time.monotonic() - t0 < 30
    assert not list(tmp_path.iterdir())  # the probe's directory is gone...
    assert not list(_qemu_pids(tmp_path))  # ...and so is its QEMU


def test_a_client_that_stops_reading_delays_no_other_client(tmp_path):
    """vmrelay without a VM: megabytes of output for a client that reads nothing are queued for it
    while another client's answer goes straight through."""
    with _relay_without_vm(tmp_path) as (_, guest, listen):
        slow, fast = _client(listen), _client(listen)
        slow.sendall(p.encode(p.Ping(1)))
        slow_id = p.recv_message(guest, p.HOST_TO_GUEST).id
        fast.sendall(p.encode(p.Ping(1)))
        fast_id = p.recv_message(guest, p.HOST_TO_GUEST).id
        chunk = p.encode(p.Stdout(slow_id, data=b"x" * (256 << 10)))
        guest.settimeout(10)  # a relay that stopped reading the guest fails here, not at pytest's timeout
        for _ in range(32):  # 8 MiB for the client that reads nothing: far beyond socket buffers
            guest.sendall(chunk)
        guest.sendall(p.encode(p.Pong(fast_id, version=p.PROTOCOL_VERSION, pid=1)))
        fast.settimeout(5)
        assert isinstance(p.recv_message(fast, p.GUEST_TO_HOST), p.Pong)  # not stuck behind the 8 MiB
        slow.settimeout(10)
        got = sum(len(p.recv_message(slow, p.GUEST_TO_HOST).data) for _ in range(32))
        assert got == 32 * (256 << 10)  # and the slow client still gets all of its output, in order
