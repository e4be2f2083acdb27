"""The microVM tier (``microvm``): a QEMU ``microvm`` machine with its own Debian kernel.

Agent → guest Linux kernel → virtual-machine boundary → host kernel. Decisions, each measured
on this project's host (QEMU 7.2, ``/dev/kvm`` = PVM):

- Accelerator by probing (:func:`accelerator`): KVM only when a probe guest boots under it
  within a short bound; PVM's ``/dev/kvm`` (``kvm_pvm``) runs only PVM-built kernels, so
  there TCG is chosen without trying. ``[microvm] accel`` in config.toml or
  ``WARMBOX_MICROVM_ACCEL`` overrides. Under TCG a cold boot is ≈ 4-5 s.
- Every sandbox therefore starts from a memory snapshot (``snapshot_start``): a template VM
  is booted once per shape, brought to "agent ready" (+ warm-up), saved with QEMU migration
  (``stop`` + ``migrate``), and each new sandbox is a new QEMU with ``-incoming`` from that
  file: ≈ 0.2 s instead of a boot. The migration stream is read into each VM's own memory
  (QEMU 7.2 cannot map a migration file copy-on-write), so guest RAM is per-sandbox.
- Agent channel: virtio-serial (``virtserialport`` on a chardev unix socket). vsock would need
  ``/dev/vhost-vsock``, which this host lacks. A serial port is one stream served to one
  connection at a time, so a small relay process per VM (:mod:`vmrelay`) multiplexes host
  clients onto it behind the usual ``agent.sock``.
- Disks: the root image is shared read-only (``readonly=on``); /workspace is a per-sandbox
  qcow2 overlay of an empty ext4 of limits.disk_mb (``workspace/disk.qcow2``; its size is the
  quota: ENOSPC in the guest, and the host file never grows past it), so it survives
  pause/resume and travels in snapshots beside the memory file. /tmp and /home/user are guest
  tmpfs (memory).
- Network: a virtio-net NIC on a tap in the VM's own network namespace, where QEMU runs
  (``microvm_net``); the sandbox's egress link attaches there like a container's, and the
  guest's only route is to the egress gateway (proxy + DNS). Without a policy (network mode
  "none") that namespace has no link: nothing leaves. Nothing of the host's filesystem is
  shared into the guest.
- Named volumes: their ext4 images are extra virtio-blk disks (VOLUME_SLOTS of them, always
  there: see ``volume_files``), mounted by the guest's root helper after a restore; a read-only
  one is read-only to QEMU itself (its fds and drive). ext4 is not a shared filesystem, so a
  read-write volume is this VM's alone (the registry refuses any other mount meanwhile).
- Limits: ``-m`` = limits.memory_mb + guest overhead; the guest's init puts the agent and all
  it runs into a cgroup with memory.max / pids.max / cpu.max from the kernel command line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import ClassVar, TypeVar

from warmbox.backends import _host as host
from warmbox.backends import hostfs
from warmbox.backends import microvm_image as images
from warmbox.backends import microvm_net as vmnet
from warmbox.backends._host import tmpfs_sizes
from warmbox.backends.base import Availability, BackendHandle, Capabilities, ResourceUsage, SandboxSpec
from warmbox.errors import ConfigError, NoSpace, SandboxStartError, Unsupported
from warmbox.models import MAX_VOLUME_MB, ImageRef

T = TypeVar("T")
QEMU = "qemu-system-x86_64"
GUEST_OVERHEAD_MB = 96  # guest kernel + page cache + agent beyond the sandbox's memory limit
TCG_CACHE_MB = 128  # TCG's translated-code cache (QEMU's default is 1 GiB, which a guest could fill)
HOST_OVERHEAD_MB = 256  # QEMU itself, its page tables and I/O buffers, and the relay, on the host
HOST_PIDS = 256  # QEMU's vCPU, I/O and worker threads plus the relay's, per VM
HOST_CPU_HEADROOM = 0.5  # CPUs beyond limits.cpus for QEMU's device and I/O threads (a cold boot runs
# them beside the vCPU: 1.24x raw QEMU's boot time at exactly limits.cpus)
START_TIMEOUT_S = 90.0
PROBE_TIMEOUT_S = 15.0
_RELAY = Path(__file__).with_name("vmrelay.py")


@functools.lru_cache(maxsize=1)
def _tsc_khz() -> int | None:
    """The host's TSC rate (a TCG guest's TSC runs at it), when /proc/cpuinfo's "cpu MHz" is that
    rate: a constant TSC and no APERF/MPERF (with those, "cpu MHz" is the current, scaling clock
    — then None, and the guest calibrates: ≈ 1.3 s more for a cold boot, i.e. a template)."""
    try:
        mhz, flags = None, None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz") and mhz is None:
                mhz = float(line.split(":")[1])
            elif line.startswith("flags") and flags is None:
                flags = set(line.split(":", 1)[1].split())
            if mhz is not None and flags is not None:
                break
    except (OSError, ValueError, IndexError):
        return None
    if mhz is None or not flags or "constant_tsc" not in flags or "aperfmperf" in flags:
        return None
    return int(mhz * 1000)


@functools.lru_cache(maxsize=1)
def qemu_version() -> str:
    """``qemu-system-x86_64 --version``'s first line: a memory image loads only into the QEMU
    (and machine) that saved it, so it is part of a template's fingerprint."""
    try:
        r = subprocess.run([QEMU, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (r.stdout.splitlines() or ["unknown"])[0].strip()


def kernel_cmdline(limits, extra: str = "") -> str:
    """Quiet, no timer calibration (≈ 1.3 s under TCG), panic -> exit, the sandbox's limits."""
    parts = [
        "console=ttyS0",
        "rdinit=/init",
        "panic=-1",
        "quiet",
        "loglevel=1",
        "mitigations=off",
        "nokaslr",
        "pci=off",
        "init_on_free=1",
        "random.trust_cpu=on",
        "i8042.noaux",
        "i8042.nokbd",
        "8250.nr_uarts=1",
    ]
    khz = _tsc_khz()
    if khz:
        parts += [f"tsc_early_khz={khz}", f"lpj={khz * 1000 // 250}", "tsc=reliable"]
    quota = "max" if limits.cpus >= math.ceil(limits.cpus) else str(max(1000, int(limits.cpus * 100_000)))
    # full tmpfs mounts (the guest image's /dev/shm is 64 MiB) must leave memory to the processes
    tmp_mb = tmpfs_sizes(limits, shm_mb=64)[0]
    parts += [
        f"wb.mem_mb={limits.memory_mb}",
        f"wb.pids={limits.pids}",
        f"wb.tmp_mb={tmp_mb}",
        f"wb.cpu_quota={quota}",
        f"wb.nofile={limits.open_files}",
        f"wb.fsize_mb={limits.file_size_mb}",
    ]
    return " ".join(parts + ([extra] if extra else []))


def vcpus(limits) -> int:
    return max(1, min(os.cpu_count() or 1, math.ceil(limits.cpus)))


def qemu_argv(
    image: Path,
    state: Path,
    limits,
    accel: str,
    *,
    incoming: str | None = None,
    extra_cmdline: str = "",
    confine: int | None = None,
    root: Path | None = None,
    volume_slots: Sequence[bool] | None = None,
    nic: bool = True,
) -> list[str]:
    """The one QEMU command line of a sandbox VM (cold boot, or ``incoming`` = restore).

    nic: the VM's virtio-net NIC on the tap of the namespace QEMU runs in (``microvm_net``:
    every sandbox VM has it, as its volume slots); False only for the accelerator probe.

    volume_slots: one flag per named-volume disk slot (VOLUME_SLOTS of them: a memory image
    restores only into the devices it was saved with, so every sandbox VM has them all), True
    for a read-only one; None: no slots (the benchmark's raw QEMU). See ``volume_files``.

    confine: a host uid (and gid) of the sandbox's own unused id range. QEMU opens its files,
    sockets and disks as root, then — before the guest runs — drops to that uid, chroots into
    an empty directory and turns on its seccomp filter (no exec, no obsolete or
    resource-control syscalls): a guest that broke out of the device models would be an
    unprivileged process that sees no files and can start no programs.
    root: the root disk (a template image's, ``microvm_image.image_root``); None: the built-in image's.
    """
    mem = limits.memory_mb + GUEST_OVERHEAD_MB
    argv = [
        QEMU,
        "-name",
        f"warmbox,process=wb-{state.name}",
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-M",
        "microvm,x-option-roms=off,isa-serial=on,rtc=on",
        "-accel",
        f"tcg,tb-size={TCG_CACHE_MB}" if accel == "tcg" else accel,
        "-cpu",
        "max" if accel == "tcg" else "host",
        "-smp",
        str(vcpus(limits)),
        "-m",
        f"{mem}M",
        "-no-reboot",
        "-kernel",
        str(image / "vmlinux"),
        "-initrd",
        str(image / "initrd.cpio"),
        "-append",
        kernel_cmdline(limits, extra_cmdline),
        "-chardev",
        f"file,id=con,path={state / 'console.log'}",
        "-serial",
        "chardev:con",
        "-drive",
        f"id=root,file={root or image / 'rootfs.ext4'},format=raw,if=none,readonly=on,cache=unsafe,file.locking=off",
        "-device",
        "virtio-blk-device,drive=root",
        # the workspace disk comes as fds 3 (read-write) and 4 (read-only) in one fdset: QEMU
        # reopens it read-only when a migration completes, which a confined QEMU could not
        "-add-fd",
        "fd=3,set=1,opaque=rw",
        "-add-fd",
        "fd=4,set=1,opaque=ro",
        "-drive",
        "id=ws,file=/dev/fdset/1,format=qcow2,if=none,cache=writeback,file.locking=off,discard=unmap",
        "-device",
        "virtio-blk-device,drive=ws",
        "-device",
        "virtio-serial-device,max_ports=3",
        "-chardev",
        f"socket,id=agent,path={state / 'run' / 'vm.sock'},server=on,wait=off",
        "-device",
        f"virtserialport,chardev=agent,name={images.AGENT_PORT}",
        "-chardev",
        f"socket,id=restore,path={state / 'run' / 'restore.sock'},server=on,wait=off",
        "-device",
        f"virtserialport,chardev=restore,name={images.RESTORE_PORT}",
        "-qmp",
        f"unix:{state / 'run' / 'qmp.sock'},server=on,wait=off",
        "-pidfile",
        str(state / "qemu.pid"),
        "-global",
        "migration.store-global-state=off",
    ]
    for i, read_only in enumerate(volume_slots or ()):
        # as the workspace: a read-write and a read-only fd in one set (fds 6.. : see vm_files)
        fd, fdset = 6 + 2 * i, 2 + i
        argv += [
            "-add-fd",
            f"fd={fd},set={fdset},opaque=rw",
            "-add-fd",
            f"fd={fd + 1},set={fdset},opaque=ro",
            "-drive",
            f"id=vol{i},file=/dev/fdset/{fdset},format=raw,if=none,cache=writeback,file.locking=off"
            + (",readonly=on" if read_only else ""),
            "-device",
            f"virtio-blk-device,drive=vol{i},serial=wbvol{i}",
        ]
    if nic:
        argv += vmnet.qemu_args()
    if confine is not None:
        argv += [
            "-runas",
            f"{confine}:{confine}",
            "-chroot",
            str(state / "empty"),
            "-sandbox",
            "on,obsolete=deny,spawn=deny,resourcecontrol=deny",
        ]
    if incoming:
        argv += ["-incoming", incoming]
    return argv


# --------------------------------------------------------------------------- QMP


class QMP:
    """A minimal QEMU Machine Protocol client (one command at a time)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, path: Path, timeout: float = 10.0) -> QMP:
        deadline = time.monotonic() + timeout
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 20)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SandboxStartError(f"QEMU's monitor socket {path.name} never accepted") from None
                await asyncio.sleep(0.01)
        q = cls(reader, writer)
        await q._read()  # greeting
        await q.execute("qmp_capabilities")
        return q

    async def _read(self) -> dict:
        while True:
            line = await self.reader.readline()
            if not line:
                raise SandboxStartError("QEMU closed its monitor")
            msg = json.loads(line)
            if "event" not in msg:
                return msg

    async def execute(self, cmd: str, **args: object) -> object:
        self.writer.write(
            json.dumps({"execute": cmd, "arguments": args} if args else {"execute": cmd}).encode() + b"\n"
        )
        await self.writer.drain()
        reply = await self._read()
        if "error" in reply:
            raise SandboxStartError(f"QEMU {cmd}: {reply['error'].get('desc', reply['error'])}")
        return reply.get("return")

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:
            pass


def save_memory(qmp_path: Path, image: Path, timeout: float = 300.0) -> None:
    """stop + migrate to ``image`` + quit, over a blocking QMP connection. The file is opened
    here and handed to QEMU with ``getfd`` (SCM_RIGHTS): a confined QEMU can neither open
    files nor spawn ``cat``. On failure the VM is let run again and the error raised."""
    import socket as _socket

    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(qmp_path))
    f = s.makefile("rb")

    def call(cmd: str, fds: list[int] | None = None, **args: object) -> object:
        data = json.dumps({"execute": cmd, "arguments": args} if args else {"execute": cmd}).encode() + b"\n"
        if fds:
            _socket.send_fds(s, [data], fds)
        else:
            s.sendall(data)
        while True:
            line = f.readline(1 << 20)
            if not line:
                raise SandboxStartError("QEMU closed its monitor")
            try:
                msg = json.loads(line)
            except ValueError:
                raise SandboxStartError("QEMU's monitor sent a malformed line") from None
            if "error" in msg:
                raise SandboxStartError(f"QEMU {cmd}: {msg['error'].get('desc', msg['error'])}")
            if "return" in msg:
                return msg["return"]

    try:
        f.readline()  # greeting
        call("qmp_capabilities")
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            call("getfd", [fd], fdname="wbsnap")
        finally:
            os.close(fd)
        call("stop")
        try:
            call("migrate", uri="fd:wbsnap")
            deadline = time.monotonic() + timeout
            while True:
                got = call("query-migrate")
                info = got if isinstance(got, dict) else {}
                status = info.get("status")
                if status == "completed":
                    break
                if status in ("failed", "cancelled") or time.monotonic() > deadline:
                    raise SandboxStartError(
                        f"QEMU migration to a file {status or 'timed out'}: {info.get('error-desc', '')}"
                    )
                time.sleep(0.01)
        except BaseException:
            try:
                call("migrate_cancel")
                call("cont")
            except (OSError, SandboxStartError):
                pass
            raise
        try:
            call("quit")
        except (OSError, SandboxStartError):
            pass  # it quits as it answers
    finally:
        f.close()
        s.close()


# --------------------------------------------------------------------------- workspace disk

_QCOW2_BACKING_FORMAT, _QCOW2_FEATURE_NAMES = 0xE2792ACA, 0x6803F857


def check_workspace_disk(disk: Path, image: Path) -> int:
    """Refuse a workspace qcow2 whose header names anything but one of the image's own empty
    workspace disks (``workspace.raw``, ``workspace-<N>M.raw``, as raw) as its backing file, a
    virtual size other than that disk's, an external data file, encryption, internal
    snapshots, any incompatible feature (qemu-img's defaults set none) or an unknown header
    extension. QEMU opens a disk's backing and data files by the names in its
    header, as root, before it confines itself — and that header is writable by whatever ran
    as the sandbox's uid (a guest that escaped QEMU's device models). Checked before every
    launch, when no process of the sandbox runs. Returns the disk's size in MiB."""
    import struct

    def bad(why: str) -> SandboxStartError:
        return SandboxStartError(f"the workspace disk {disk.name} is not one warmbox made: {why}")

    try:
        fd = os.open(disk, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            head = f.read(1 << 16)
    except OSError as e:
        raise bad(e.strerror or str(e)) from None
    if len(head) < 104 or head[:4] != b"QFI\xfb":
        raise bad("not a qcow2 image")
    version, bf_off, bf_size = struct.unpack(">IQI", head[4:20])
    if version != 3 or struct.unpack(">I", head[32:36])[0] != 0:
        raise bad("not an unencrypted qcow2 v3 image")
    named = head[bf_off : bf_off + bf_size].decode("utf-8", "replace")
    size_mb = images.workspace_size(image, named) if 0 < bf_size <= 1023 and bf_off + bf_size <= len(head) else None
    if size_mb is None:
        raise bad(f"its backing file is not a workspace disk of {image} (a snapshot of another guest image?)")
    if struct.unpack(">I", head[60:64])[0] != 0:
        raise bad("it holds internal snapshots")
    incompatible, _, _, _, header_len = struct.unpack(">QQQII", head[72:104])
    if incompatible:
        raise bad(f"incompatible features {incompatible:#x} (an external data file, a dirty or corrupt image)")
    off, backing_format = header_len, b""
    while True:
        if off + 8 > len(head):
            raise bad("its header extensions run past the first 64 KiB")
        kind, length = struct.unpack(">II", head[off : off + 8])
        if kind == 0:
            break
        data = head[off + 8 : off + 8 + length]
        if kind == _QCOW2_BACKING_FORMAT:
            backing_format = data
        elif kind != _QCOW2_FEATURE_NAMES:
            raise bad(f"unexpected header extension {kind:#x}")
        off += 8 + (length + 7) // 8 * 8
    if backing_format != b"raw":
        raise bad(f"its backing format is {backing_format.decode('ascii', 'replace') or 'unset'}, not raw")
    if struct.unpack(">Q", head[24:32])[0] != size_mb << 20:
        raise bad(f"its virtual size is not that of its backing file ({size_mb} MiB)")
    return size_mb


# --------------------------------------------------------------------------- accelerator


def accelerator(runtime: Path, forced: str | None = None) -> tuple[str, str]:
    """(accel, why). ``forced`` (config/env) wins; else cached probe result; else probe."""
    env = os.environ.get("WARMBOX_MICROVM_ACCEL", "").strip()
    if env and env not in ("auto", "kvm", "tcg"):
        raise ConfigError(f'WARMBOX_MICROVM_ACCEL must be "auto", "kvm" or "tcg", got {env!r}')
    if env and env != "auto":
        return env, "set by WARMBOX_MICROVM_ACCEL"
    if forced and forced != "auto":
        return forced, "set in config ([microvm] accel)"
    if not os.path.exists("/dev/kvm"):
        return "tcg", "no /dev/kvm: software emulation (TCG)"
    if os.path.isdir("/sys/module/kvm_pvm"):
        return "tcg", "/dev/kvm is PVM (kvm_pvm): only PVM-built guest kernels run on it, so TCG"
    cache = runtime / "microvm-accel.json"
    try:
        got = json.loads(cache.read_text())
        return got["accel"], got["why"]
    except (OSError, ValueError, KeyError):
        pass
    accel, why = _probe_kvm(runtime)
    try:
        cache.write_text(json.dumps({"accel": accel, "why": why}))
    except OSError:
        pass
    return accel, why


def _probe_kvm(runtime: Path) -> tuple[str, str]:
    """Boot the guest kernel under KVM to its init and straight off again, within a bound."""
    try:
        image = images.build(images.cache_dir())
    except SandboxStartError as e:
        return "tcg", f"KVM not probed ({e})"
    from warmbox.models import Limits

    probe_dir = runtime / f".kvm-probe-{os.getpid()}"
    (probe_dir / "run").mkdir(parents=True, exist_ok=True)
    (probe_dir / "workspace").mkdir(exist_ok=True)
    argv = qemu_argv(image, probe_dir, Limits(), "kvm", extra_cmdline="wb.probe=1", nic=False)
    t0 = time.monotonic()
    booted = False
    try:
        subprocess.run(
            [
                "qemu-img",
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                str(image / "workspace.raw"),
                "-F",
                "raw",
                str(probe_dir / "workspace" / "disk.qcow2"),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        pid = _spawn(argv, probe_dir / "qemu.log", vm_files(probe_dir))
        while time.monotonic() - t0 < PROBE_TIMEOUT_S and host.running(pid):
            console = probe_dir / "console.log"
            if console.exists() and "WARMBOX-PROBE-OK" in console.read_text(errors="replace"):
                booted = True
                break
            time.sleep(0.1)
    except (subprocess.SubprocessError, OSError, SandboxStartError):
        booted = False
    finally:
        left = _pidfile(probe_dir / "qemu.pid")
        if left and _ours(left, probe_dir):
            host.kill(left)
            deadline = time.monotonic() + 10
            while host.running(left) and time.monotonic() < deadline:
                time.sleep(0.005)
        shutil.rmtree(probe_dir, ignore_errors=True)
    if booted:
        return "kvm", f"a probe guest booted under KVM in {time.monotonic() - t0:.1f} s"
    return "tcg", f"a probe guest did not boot under KVM within {PROBE_TIMEOUT_S:.0f} s: TCG"


# --------------------------------------------------------------------------- host cgroup


class HostCgroup(host.SandboxCgroup):
    """The host cgroup around one VM's QEMU and relay: a memory bound (guest RAM + TCG cache +
    QEMU's own), a CPU quota (``limits.cpus`` + headroom for QEMU's device threads; the guest's own
    cgroup holds its processes to ``limits.cpus``), a pids bound; the meter reads
    it. Both processes start inside it (the spawner joins it before exec), so every page they
    touch is charged here. ``/sys/fs/cgroup/[controller/]warmbox/<sandbox id>`` like the container tier's."""

    def create_for(self, limits, accel: str) -> list[str]:
        """``create`` sized for a VM of these limits under this accelerator."""
        tcg = TCG_CACHE_MB if accel == "tcg" else 0
        return self.create(
            limits.memory_mb + GUEST_OVERHEAD_MB + tcg + HOST_OVERHEAD_MB, limits.cpus + HOST_CPU_HEADROOM, HOST_PIDS
        )

    def usage(self) -> tuple[int, int] | None:
        """(anonymous memory bytes, CPU ns) of everything in it; None once it is gone."""
        try:
            return self.anon_bytes(), self.cpu_ns()
        except (OSError, ValueError):
            return None


# --------------------------------------------------------------------------- processes


def _pidfile(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 else None


def _ours(pid: int, state: Path) -> bool:
    """The pid is still the process we started for this sandbox (pids are reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(state).encode() in cmdline


# cli/bench_microvm.py (its raw-QEMU baseline) still reaches these by their old names here
_running, _kill = host.running, host.kill


def vm_files(
    state: Path, memory: Path | None = None, volumes: Sequence[tuple[Path, bool]] | None = None
) -> list[tuple[Path, int]]:
    """The files a VM gets as fds 3, 4 (its workspace disk, rw + ro), 5 (a memory image) and, with
    ``volumes`` (one (image, writable) per slot), 6.. (each slot's rw + ro fds; a read-only slot's
    both read-only: QEMU itself cannot write it)."""
    disk = state / "workspace" / "disk.qcow2"
    files = [(disk, os.O_RDWR | os.O_NOFOLLOW), (disk, os.O_RDONLY | os.O_NOFOLLOW)]
    if memory is not None:
        files.append((memory, os.O_RDONLY))
    if volumes is not None:
        if memory is None:
            files.append((Path(os.devnull), os.O_RDONLY))  # fd 5: no memory image on a cold boot
        for path, writable in volumes:
            files += [
                (path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW),
                (path, os.O_RDONLY | os.O_NOFOLLOW),
            ]
    return files


def _spawn(argv: list[str], log: Path, files: Sequence[tuple[Path, int]] = (), cgroup_procs: Sequence[str] = ()) -> int:
    """Start a VM's process detached (``host.spawn``): ``files`` opened with their flags as its
    fds 3, 4, ..., inside the cgroups whose ``cgroup.procs`` files are given."""
    fds: list[int] = []
    try:
        try:
            for path, flags in files:
                fds.append(os.open(path, flags | os.O_CLOEXEC))
        except OSError as e:
            raise SandboxStartError(f"cannot open {e.filename}: {e.strerror}") from None
        return host.spawn(argv, log, fds, detach=True, cgroup_procs=cgroup_procs)
    finally:
        for fd in fds:
            os.close(fd)


class MicroVMBackend:
    """The ``microvm`` tier: QEMU microvm + Debian kernel; starts from memory snapshots."""

    tier: ClassVar[str] = "microvm"
    runtime_logs: ClassVar[tuple[str, ...]] = ("qemu.log", "console.log", "relay.log")
    # run in the template VM before its memory is saved: these programs' files are then in the
    # guest page cache of every restored sandbox (a first command otherwise reads them from disk)
    template_warmup: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("/bin/true",),
        ("/bin/bash", "-c", "ls / > /dev/null; cat /dev/null"),
    )

    def __init__(self, runtime: Path) -> None:
        self.runtime = runtime
        self.forced_accel: str | None = None
        self._image: Path | None = None
        self._build_id: str | None = None
        self._accel: tuple[str, str] | None = None

    def configure(self, settings) -> None:
        self.forced_accel = getattr(getattr(settings, "microvm", None), "accel", None)

    def capabilities(self) -> Capabilities:
        return Capabilities(
            tier=self.tier,
            isolation="own Linux kernel in a QEMU microvm (virtual-machine boundary); "
            f"accelerator {self.accel()[0]}; no host files; a NIC whose only route is the egress proxy",
            memory_snapshot=True,
            filesystem_snapshot=True,
            custom_kernel=True,
            network_modes=("none", "allowlist", "internet"),
            languages=("python", "node", "shell", "c", "git"),
            start_class="100ms-1s (from snapshot)",
            snapshot_start=True,
            oom_counted_in_guest=True,
            root_user=True,
            volume_own_disk=True,
            isolation_rank=3,
            # TCG measured on a 2-core host: a CPU loop 21x, fork 7x, files 5x, socket 11x
            cpu_slowdown=20.0 if self.accel()[0] == "tcg" else 1.05,
            syscall_slowdown=8.0 if self.accel()[0] == "tcg" else 1.3,
            cost_note=f"accelerator {self.accel()[0]}"
            + (": the guest's CPU is emulated in software" if self.accel()[0] == "tcg" else ""),
            start_ms=400.0,
        )

    def accel(self) -> tuple[str, str]:
        if self._accel is None:
            self._accel = accelerator(self.runtime, self.forced_accel)
        return self._accel

    def probe(self) -> Availability:
        qemu = shutil.which(QEMU)
        if not qemu:
            return Availability(False, "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)")
        if not shutil.which("qemu-img"):
            return Availability(False, "qemu-img is not installed (apt-get install qemu-utils)")
        if os.geteuid() != 0:
            return Availability(False, "needs root (QEMU's accelerator devices and the sandbox images)")
        built = (images.image_dir(images.cache_dir()) / "meta.json").is_file()
        if not built:
            for tool, pkg in (
                ("mmdebstrap", "mmdebstrap"),
                ("busybox", "busybox-static"),
                ("mkfs.ext4", "e2fsprogs"),
                ("dpkg-deb", "dpkg"),
                ("apt-get", "apt"),
            ):
                if not shutil.which(tool):
                    return Availability(False, f"building the guest image needs {tool} (apt-get install {pkg})")
        accel, why = self.accel()
        return Availability(
            True,
            f"QEMU at {qemu}, accelerator {accel} ({why}); guest image "
            f"{'built' if built else 'built on first use (~1 min)'}",
        )

    def image(self) -> Path:
        if self._image is None:
            self._image = images.build(images.cache_dir())
        return self._image

    def template_fingerprint(self, image: ImageRef | None = None) -> str:
        """What a memory snapshot must match to restore: image (and the root disk of ``image``,
        named by its image id and the guest agent), accelerator, machine, argv."""
        import hashlib

        from warmbox.models import Limits

        root = None if image is None else images.image_root_path(images.cache_dir(), image)
        argv = qemu_argv(
            self.image(),
            Path("/state"),
            Limits(),
            self.accel()[0],
            incoming=INCOMING_FD,
            confine=0,
            root=root,
            volume_slots=(False,) * VOLUME_SLOTS,
        )
        return hashlib.sha256(
            json.dumps([argv, self.template_warmup, qemu_version(), self.build_id()]).encode()
        ).hexdigest()[:12]

    def build_id(self) -> str:
        """The guest image build this backend starts VMs from (meta.json, read once)."""
        if self._build_id is None:
            self._build_id = images.build_id(self.image())
        return self._build_id

    def kernel_version(self) -> str:
        return json.loads((self.image() / "meta.json").read_text())["kernel"]

    # ---- lifecycle

    async def create(self, spec: SandboxSpec) -> BackendHandle:
        if spec.build_upper:
            raise Unsupported(
                "a template build sandbox runs on the container tier", self.tier, "builds need an overlay root"
            )
        if len(spec.volumes) > VOLUME_SLOTS:
            raise Unsupported(
                f"a microVM mounts at most {VOLUME_SLOTS} volumes, got {len(spec.volumes)}",
                self.tier,
                f"{VOLUME_SLOTS} volume disk slots",
            )
        state = Path(spec.state_dir)
        await asyncio.to_thread(self.image)
        if spec.image is not None:  # the image's own root disk, made once per image (minutes, the first time)
            root = await asyncio.to_thread(images.image_root, images.cache_dir(), spec.image)
            (state / ROOT_FILE).write_text(str(root))
        (state / "run").mkdir(mode=0o700, exist_ok=True)
        (state / "workspace").mkdir(mode=0o700, exist_ok=True)
        (state / "empty").mkdir(mode=0o555, exist_ok=True)  # QEMU's chroot: nothing in it
        (state / "limits.json").write_text(json.dumps(dataclasses.asdict(spec.limits)))
        (state / VOLUMES_FILE).write_text(json.dumps([[v.path, v.read_only, v.disk] for v in spec.volumes]))
        fd = os.open(state / SLOT_PLACEHOLDER, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:  # an empty slot's disk: sparse, as large as the largest volume (see volume_files)
            os.ftruncate(fd, MAX_VOLUME_MB << 20)
        finally:
            os.close(fd)
        return BackendHandle(
            sandbox_id=spec.sandbox_id,
            tier=self.tier,
            runtime_id=spec.sandbox_id,
            state_dir=str(state),
            socket_path=str(state / "run" / "agent.sock"),
            uid_base=spec.uid_base,
        )

    def _limits(self, handle: BackendHandle):
        from warmbox.models import Limits

        try:
            raw = json.loads((Path(handle.state_dir) / "limits.json").read_text())
            return Limits(**raw)
        except (OSError, ValueError, TypeError):
            return Limits()

    async def start(self, handle: BackendHandle, ready: Callable[[], Awaitable[T]]) -> T:
        """Cold boot (a template's): a fresh /workspace disk of limits.disk_mb over the image's
        empty ext4 of that size (the quota: the guest's filesystem ends there)."""
        disk = Path(handle.state_dir) / "workspace" / "disk.qcow2"
        backing = await asyncio.to_thread(images.workspace_backing, self.image(), self._limits(handle).disk_mb)
        await _qemu_img(["create", "-q", "-f", "qcow2", "-b", str(backing), "-F", "raw", str(disk)], handle.sandbox_id)
        # travel with the disk into snapshots: a restore needs this very build of the image, and root disk
        (disk.parent / IMAGE_ID_FILE).write_text(self.build_id())
        (disk.parent / ROOT_ID_FILE).write_text(self._root_name(handle))
        return await self._launch(handle, ready, incoming=None)

    async def restore(self, handle: BackendHandle, image_dir: Path, ready: Callable[[], Awaitable[T]]) -> T:
        """A new VM continuing the memory image (``checkpoint.img`` in image_dir)."""
        mem = image_dir / "checkpoint.img"
        if not (Path(handle.state_dir) / "workspace" / "disk.qcow2").is_file():
            raise SandboxStartError("the snapshot holds no workspace disk", handle.sandbox_id)
        return await self._launch(handle, ready, incoming=INCOMING_FD, memory=mem)

    async def _launch(
        self, handle: BackendHandle, ready: Callable[[], Awaitable[T]], incoming: str | None, memory: Path | None = None
    ) -> T:
        state = Path(handle.state_dir)
        image = self.image()
        root = self._root(handle)
        slots, mounts = volume_files(state, cold=incoming is None, sandbox_id=handle.sandbox_id)
        argv = qemu_argv(
            image,
            state,
            self._limits(handle),
            self.accel()[0],
            incoming=incoming,
            confine=handle.uid_base,
            root=root,
            volume_slots=[not writable for _, writable in slots],
        )
        try:
            size_mb = check_workspace_disk(state / "workspace" / "disk.qcow2", image)
        except SandboxStartError as e:
            raise SandboxStartError(str(e), handle.sandbox_id) from None
        if size_mb > self._limits(handle).disk_mb:  # a snapshot's disk is the sandbox's: it cannot shrink
            raise NoSpace(
                f"the snapshot's /workspace disk is {size_mb} MiB, more than this sandbox's "
                f"limits.disk_mb = {self._limits(handle).disk_mb}",
                handle.sandbox_id,
            )
        # a snapshot's disk from another host: its (deterministic) empty backing disk, made here too
        await asyncio.to_thread(images.workspace_backing, image, size_mb)
        try:
            made_with = (state / "workspace" / IMAGE_ID_FILE).read_text().strip()
        except OSError:
            made_with = "unknown"
        try:
            root_with = (state / "workspace" / ROOT_ID_FILE).read_text().strip()
        except OSError:
            root_with = BUILTIN_ROOT  # a disk from before template images: the built-in root
        if root_with != self._root_name(handle):
            raise SandboxStartError(
                f"this sandbox's disk and memory were made with the root disk {root_with}, not "
                f"{self._root_name(handle)}: they cannot be restored onto it",
                handle.sandbox_id,
            )
        if made_with != self.build_id():
            raise SandboxStartError(
                f"this sandbox's disk and memory were made with guest image build {made_with}, "
                f"this host has {self.build_id()} ({image.name}): they cannot be restored "
                "into it",
                handle.sandbox_id,
            )
        (state / "qemu.argv").write_text(json.dumps(argv))
        procs = HostCgroup(handle.sandbox_id).create_for(self._limits(handle), self.accel()[0])
        (state / "volumes.bin").write_bytes(mounts)
        await asyncio.to_thread(vmnet.prepare, state)
        qemu = _spawn(vmnet.enter(state) + argv, state / "qemu.log", vm_files(state, memory, slots), procs)
        relay = _spawn(
            [
                sys.executable,
                "-I",
                "-S",
                str(_RELAY),
                str(state / "run" / "vm.sock"),
                handle.socket_path,
                str(handle.uid_base),
                str(qemu),
                str(state / "run" / "restore.sock"),
                str(state / "volumes.bin"),
            ],
            state / "relay.log",
            (),
            procs,
        )
        (state / "relay.pid").write_text(str(relay))
        sock = Path(handle.socket_path)

        async def stopped() -> bool:  # the relay ends when QEMU does, or on a guest's protocol violation
            return not (host.running(qemu) and host.running(relay))

        got = await host.wait_for_agent(
            ready,
            sock.exists,
            stopped,
            lambda: self._why(state),
            where="the microVM",
            sandbox_id=handle.sandbox_id,
            timeout=START_TIMEOUT_S,
            poll=0.002,
        )
        if any(mounts):  # the guest has them now: its memory (a pause, a snapshot) holds them mounted
            (state / "workspace" / VOLUMES_MOUNTED).write_text((state / VOLUMES_FILE).read_text())
        return got

    def _root(self, handle: BackendHandle) -> Path | None:
        """The sandbox's root disk when it runs a template image (``create`` names it), else None."""
        try:
            named = (Path(handle.state_dir) / ROOT_FILE).read_text().strip()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SandboxStartError(f"the sandbox's root disk: {e.strerror or e}", handle.sandbox_id) from None
        path = Path(named)
        if path.parent != images.cache_dir() / images.ROOTS or path.suffix != ".ext4" or not path.is_file():
            raise SandboxStartError(f"the sandbox's root disk {named} is not a template root", handle.sandbox_id)
        return path

    def _root_name(self, handle: BackendHandle) -> str:
        root = self._root(handle)
        return BUILTIN_ROOT if root is None else root.name

    @staticmethod
    def _why(state: Path) -> str:
        parts = []
        for name in ("qemu.log", "console.log", "relay.log"):
            t = host.tail(state / name, 300)
            if t not in ("(no log)", "(empty log)"):
                parts.append(f"{name}: {t}")
        return "; ".join(parts) or "no output"

    # ---- snapshots

    async def checkpoint(self, handle: BackendHandle, image_dir: Path) -> Path:
        """Stop the VM, write its memory + device state to ``image_dir/checkpoint.img`` (QEMU
        migration), then end QEMU; the workspace disk is complete once QEMU has exited."""
        state = Path(handle.state_dir)
        image = image_dir / "checkpoint.img"
        # QEMU writes the whole guest RAM through the page cache, charged to its cgroup, before it exits
        HostCgroup(handle.sandbox_id).add_memory(self._limits(handle).memory_mb + GUEST_OVERHEAD_MB)
        try:
            await asyncio.to_thread(save_memory, state / "run" / "qmp.sock", image)
        except OSError as e:
            raise SandboxStartError(f"QEMU's monitor: {e}", handle.sandbox_id) from None
        pid = _pidfile(state / "qemu.pid")
        if pid:
            await host.wait_gone(pid, 20, poll=0.01)
        return image

    async def resume_listening(self, handle: BackendHandle) -> None:
        """A failed checkpoint leaves the VM stopped: let it run again."""
        try:
            qmp = await QMP.connect(Path(handle.state_dir) / "run" / "qmp.sock", timeout=2)
        except SandboxStartError:
            return
        try:
            await qmp.execute("cont")
        finally:
            await qmp.close()

    # ---- observation

    def _qemu_pid(self, handle: BackendHandle) -> int | None:
        state = Path(handle.state_dir)
        pid = _pidfile(state / "qemu.pid")
        return pid if pid and _ours(pid, state) else None

    async def usage(self, handle: BackendHandle) -> ResourceUsage:
        """The VM as the host sees it: anonymous memory (guest RAM in use, TCG cache, QEMU's heap)
        and CPU time of QEMU and its relay, from their host cgroup (QEMU's own counters when
        that is gone)."""
        cgroup = HostCgroup(handle.sandbox_id)
        got = cgroup.usage()
        if got is not None:
            return ResourceUsage(oom_kills=cgroup.oom_kills(), memory_bytes=got[0], cpu_ns=got[1])
        pid = self._qemu_pid(handle)
        if pid is None:
            return ResourceUsage(oom_kills=0, memory_bytes=0, cpu_ns=0)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            ticks = os.sysconf("SC_CLK_TCK")
            cpu_ns = (int(fields[11]) + int(fields[12])) * 1_000_000_000 // ticks
            rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return ResourceUsage(oom_kills=0, memory_bytes=0, cpu_ns=0)
        return ResourceUsage(oom_kills=0, memory_bytes=rss, cpu_ns=cpu_ns)

    async def oom_kills(self, handle: BackendHandle) -> int:
        """OOM kills of the VM's host cgroup (QEMU or its relay over their host bound). Kills
        inside the guest are the guest kernel's: the agent reports them per call
        (``oom_counted_in_guest``)."""
        return HostCgroup(handle.sandbox_id).oom_kills()

    async def alive(self, handle: BackendHandle) -> bool:
        """QEMU and its relay both run: a VM whose relay ended (e.g. on a guest's protocol
        violation) can never be reached again, so it counts as dead and is reaped."""
        state = Path(handle.state_dir)
        for name in ("qemu.pid", "relay.pid"):
            pid = _pidfile(state / name)
            if not (pid and _ours(pid, state) and host.running(pid)):
                return False
        return True

    def netns_path(self, handle: BackendHandle) -> str:
        """The VM's own network namespace (``microvm_net``): the egress link attaches there."""
        path = vmnet.netns_path(Path(handle.state_dir))
        if not path.exists():
            from warmbox.errors import SandboxNotFound

            raise SandboxNotFound(f"sandbox {handle.sandbox_id} is not running", handle.sandbox_id)
        return str(path)

    async def destroy(self, handle: BackendHandle) -> None:
        state = Path(handle.state_dir)
        for name in ("qemu.pid", "relay.pid"):
            pid = _pidfile(state / name)
            if pid and _ours(pid, state):
                host.kill(pid, signal.SIGKILL)
                await host.wait_gone(pid, 10)
        await asyncio.to_thread(HostCgroup(handle.sandbox_id).remove)
        await asyncio.to_thread(vmnet.remove, state)
        hostfs.keep_logs(state, self.runtime_logs, self.runtime / "logs", handle.sandbox_id)
        shutil.rmtree(state, ignore_errors=True)


IMAGE_ID_FILE = "image.id"  # beside disk.qcow2: the guest image build the disk and memory belong to
ROOT_ID_FILE = "root.id"  # beside it: the root disk they belong to (a template root's name, or BUILTIN_ROOT)
BUILTIN_ROOT = "builtin"
ROOT_FILE = "root.path"  # in the state dir: the template root disk a sandbox runs (absent: the built-in)

# Named volumes. Every sandbox VM has VOLUME_SLOTS virtio-blk disks (serial wbvol<n>): a memory
# image restores only into the devices it was saved with, and a template VM is saved before
# anyone asked for a volume. An empty slot is a sparse file of MAX_VOLUME_MB (SLOT_PLACEHOLDER, in
# the state dir): the guest kernel reads a disk's size once, at boot, so every slot is as large as
# any volume can be, and a volume attached at a restore is never past the end of its disk. After
# a restore from a template the guest's root helper mounts them (vmrelay sends what to mount,
# wb-restore flushes the slot's stale block cache and mounts it); a VM restored from its own
# memory (a resume, a fork) has them mounted already (VOLUMES_MOUNTED travels with its disk).
VOLUME_SLOTS = 4
VOLUMES_FILE = "volumes.json"  # [[path, read_only, image], ...] of this sandbox, slot order
VOLUMES_MOUNTED = "volumes.mounted"  # beside disk.qcow2: what the guest in this memory has mounted
SLOT_PLACEHOLDER = "volume-slot.img"
SLOT_RECORD = 256  # per slot in the block sent to wb-restore: flag byte + mount path, NUL-padded


def volume_files(state: Path, *, cold: bool, sandbox_id: str) -> tuple[list[tuple[Path, bool]], bytes]:
    """Each slot's (disk image, writable), and the block telling the guest what to mount.

    A cold boot (a template's) has every slot writable (the features the guest then negotiates
    allow any volume later); an empty slot after that is read-only. The block is empty (zeros)
    when the memory restored has the volumes mounted already or there are none."""
    try:
        volumes = [(str(p), bool(ro), str(d)) for p, ro, d in json.loads((state / VOLUMES_FILE).read_text())]
    except (OSError, ValueError, TypeError):
        volumes = []
    placeholder = state / SLOT_PLACEHOLDER
    slots = [(Path(d), not ro) for _, ro, d in volumes]
    slots += [(placeholder, cold)] * (VOLUME_SLOTS - len(slots))
    try:
        mounted = [(str(p), bool(ro)) for p, ro, _ in json.loads((state / "workspace" / VOLUMES_MOUNTED).read_text())]
    except (OSError, ValueError, TypeError):
        mounted = None
    if mounted is not None:
        if mounted != [(p, ro) for p, ro, _ in volumes]:
            raise SandboxStartError(
                f"this VM's memory has volumes mounted at {mounted}, not the sandbox's ({volumes})", sandbox_id
            )
        return slots, bytes(SLOT_RECORD * VOLUME_SLOTS)
    block = bytearray(SLOT_RECORD * VOLUME_SLOTS)
    for i, (path, ro, _) in enumerate(volumes):
        raw = path.encode()
        if len(raw) >= SLOT_RECORD - 1:
            raise SandboxStartError(f"a volume path longer than {SLOT_RECORD - 2} bytes: {path[:60]}...", sandbox_id)
        block[i * SLOT_RECORD] = 2 if ro else 1
        block[i * SLOT_RECORD + 1 : i * SLOT_RECORD + 1 + len(raw)] = raw
    return slots, bytes(block)


# The saved migration stream is handed to QEMU as its fd 5 (see vm_files): ~60-100 ms faster than
# ``exec:cat FILE`` (no shell, no cat, no pipe copy of the whole stream).
INCOMING_FD = "fd:5"


async def _qemu_img(args: list[str], sandbox_id: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "qemu-img", *args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxStartError(f"qemu-img {args[0]} failed: {err.decode(errors='replace').strip()[-300:]}", sandbox_id)
