"""Tier 2: an OCI container run by ``runc`` — namespaces (user ns included), cgroups, seccomp.

The rootfs is a shared read-only image (minimal /etc, the guest agent under /opt/warmbox,
mount points) with the host's /usr bind-mounted read-only; each sandbox adds its own
/workspace (an ext4 of limits.disk_mb in a sparse image, loop-mounted: :mod:`workspace_disk`),
tmpfs /tmp and /home/user, and a private 65536-id user-namespace range. The guest
agent's listening socket is created on the host and handed to the container as fd 3, so the
sandbox shares no writable host directory with the host.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import hashlib
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Awaitable, Callable, ClassVar, TypeVar

from warmbox.backends import hostfs, seccomp, workspace_disk
from warmbox.backends.base import Availability, BackendHandle, Capabilities, ResourceUsage, SandboxSpec
from warmbox.errors import SandboxStartError

T = TypeVar("T")
GUEST_UID = 1000
GUEST_GID = 1000
ID_RANGE = 65536
HOSTNAME = "sandbox"
GUEST_LIB = "/opt/warmbox"
GUEST_PYTHON = "/usr/bin/python3"  # the host's /usr is the sandbox's /usr
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/home/user",
    "LANG": "C.UTF-8",
}
MASKED_PATHS = [
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
    "/sys/devices/virtual/powercap",
]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
from warmbox.network.netns import GATEWAY  # noqa: E402 - the egress resolver's address

_ETC_COPY = [
    "alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "os-release", "debian_version",
    "bash.bashrc", "inputrc", "profile", "protocols", "services", "host.conf", "gai.conf",
    "mime.types", "python3", "python3.11", "ssl/certs/ca-certificates.crt", "ssl/openssl.cnf",
]
_GUEST_SOURCES = ("protocol.py", "guest/__init__.py", "guest/agent.py", "guest/kernel.py", "guest/spawn.c",
                  "guest/init.c")
_AGENT_BOOT = ("import sys; sys.path.insert(0, %r); from warmbox.guest.agent import main; main()" % GUEST_LIB)
CGROUP_FD = 4  # the agent's fd of the sandbox's cgroup v2 directory (its commands' cgroups go below)


def build_spawn_helpers(sources: Path, out: Path) -> None:
    """The guest agent's spawn.so and wb-init (guest/spawn.c, guest/init.c: how a command gets its
    own cgroup or PID namespace) from ``sources`` into ``out``."""
    for cmd in (["-shared", "-fPIC", "-o", str(out / "spawn.so"), str(sources / "spawn.c")],
                ["-static", "-s", "-o", str(out / "wb-init"), str(sources / "init.c")]):
        r = subprocess.run(["gcc", "-O2", "-Wall", "-Werror", *cmd], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise SandboxStartError(f"building the guest agent's spawn helpers failed (gcc, libc6-dev): "
                                    f"{r.stderr.strip()[-300:]}")


def build_image(images_dir: Path, variant: str = "base", customize=None) -> Path:
    """The shared read-only rootfs, built once per content hash (atomic: temp dir + rename).

    variant/customize: a tier's own flavour of the image (``customize(tmp_root)`` runs last;
    the variant name and its inputs must be part of ``variant``'s spelling for the hash).
    """
    pkg = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(b"warmbox-rootfs-v4" + variant.encode())
    for rel in _GUEST_SOURCES:
        h.update(rel.encode() + b"\0" + (pkg / rel).read_bytes())
    final = images_dir / f"{variant.split(':')[0]}-{h.hexdigest()[:16]}"
    if final.is_dir():
        return final
    images_dir.mkdir(parents=True, exist_ok=True)
    tmp = images_dir / f".tmp-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir(mode=0o755)
    for d in ("usr", "proc", "dev", "sys", "tmp", "workspace", "home/user", "run", "opt", "var", "mnt"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    # runc gives a tmpfs the mode of its mount point, so the mount point carries the final mode
    os.chmod(tmp / "tmp", 0o1777)
    (tmp / "root").mkdir(mode=0o700)
    for link in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / link
        if host.is_symlink():
            os.symlink(os.readlink(host), tmp / link)
    os.symlink("/tmp", tmp / "var/tmp")
    etc = tmp / "etc"
    etc.mkdir()
    files = {
        "passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\nuser:x:1000:1000:user:/home/user:/bin/bash\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": "root:x:0:\ntty:x:5:\nuser:x:1000:\nnogroup:x:65534:\n",
        "hostname": HOSTNAME + "\n",
        "hosts": f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost ip6-localhost\n",
        # the egress resolver; unreachable (no link) unless the sandbox has a network policy
        "resolv.conf": f"nameserver {GATEWAY}\noptions timeout:1 attempts:2\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n",
        "shells": "/bin/sh\n/bin/bash\n",
        "timezone": "Etc/UTC\n",
    }
    for name, text in files.items():
        (etc / name).write_text(text)
    os.symlink("/usr/share/zoneinfo/Etc/UTC", etc / "localtime")
    for rel in _ETC_COPY:
        src = Path("/etc") / rel
        if not src.exists():
            continue
        dst = etc / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=True)
        else:
            shutil.copy2(src.resolve(), dst)
    lib = tmp / GUEST_LIB.lstrip("/") / "warmbox"
    (lib / "guest").mkdir(parents=True)
    (lib / "__init__.py").write_text('"""Guest-side copy: protocol + agent only."""\n')
    for rel in _GUEST_SOURCES:
        shutil.copy2(pkg / rel, lib / rel)
    build_spawn_helpers(pkg / "guest", lib / "guest")
    # The rootfs is read-only inside, so Python could never cache bytecode there: compile it now,
    # with the very interpreter the sandbox runs (~10 ms off every cold start).
    if os.path.exists(GUEST_PYTHON):
        subprocess.run([GUEST_PYTHON, "-I", "-m", "compileall", "-q", str(lib)], check=True,
                       stdout=subprocess.DEVNULL, timeout=60)
    if customize is not None:
        customize(tmp)
    try:
        os.rename(tmp, final)
    except OSError:  # another process won the race; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def tmpfs_sizes(lim, shm_mb: int | None = None) -> tuple[int, int]:
    """(size of /tmp and of /home/user, size of /dev/shm) in MiB.

    tmpfs pages are charged to the sandbox's memory limit, so full tmpfs mounts must leave room
    for the processes: together they get at most memory_mb minus a quarter of it (≥ 96 MiB,
    for the guest agent, the code contexts and gVisor's own kernel). A writer that fills
    them gets ENOSPC; without this, filling /tmp and /home/user OOM-killed the guest agent.
    """
    shm = max(1, min(64, lim.memory_mb // 8)) if shm_mb is None else shm_mb
    budget = lim.memory_mb - max(96, lim.memory_mb // 4) - shm
    return max(1, min(lim.tmp_mb, budget // 2)), shm


@functools.lru_cache(maxsize=1)
def _cgroup_v2() -> bool:  # read on every command's OOM check: the layout never changes
    return Path("/sys/fs/cgroup/cgroup.controllers").exists()


@functools.lru_cache(maxsize=1)
def _unified_root() -> Path | None:
    """The host's cgroup v2 hierarchy: /sys/fs/cgroup, or /sys/fs/cgroup/unified in the hybrid
    layout (no controllers there, but cgroup.kill works); None on a pure v1 host."""
    if _cgroup_v2():
        return Path("/sys/fs/cgroup")
    hybrid = Path("/sys/fs/cgroup/unified")
    return hybrid if (hybrid / "cgroup.procs").exists() else None


class RuncBackend:
    """Tier 2 (``container``): runc with user namespace, seccomp, cgroups, own network ns."""

    tier: ClassVar[str] = "container"
    runtime_logs: ClassVar[tuple[str, ...]] = ("agent.log", "panic.log")  # runc/runsc + the agent's stdio

    def __init__(self, runtime: Path, runc: str | None = None) -> None:
        """runtime: a root-owned directory every ancestor of which the sandbox uid can traverse."""
        self.runtime = runtime
        self.runc = runc or shutil.which("runc") or "runc"
        self.root = runtime / "runc"
        self._image: Path | None = None
        self._oom_paths: dict[str, str] = {}

    # ---- description

    def capabilities(self) -> Capabilities:
        return Capabilities(
            tier=self.tier,
            isolation="Linux namespaces (user, pid, mount, net, ipc, uts, cgroup) + seccomp + cgroups; shared host kernel",
            memory_snapshot=False, filesystem_snapshot=True, custom_kernel=False,
            network_modes=("none", "allowlist", "internet"), languages=("python", "node", "shell", "c", "git"),
            start_class="10-100ms",
        )

    def probe(self) -> Availability:
        path = shutil.which(self.runc) if not os.path.isabs(self.runc) else self.runc
        if not path or not os.access(path, os.X_OK):
            return Availability(False, "runc is not installed (apt-get install runc)")
        if os.geteuid() != 0:
            return Availability(False, "needs root (runc with user namespaces and cgroups)")
        try:
            if int(Path("/proc/sys/user/max_user_namespaces").read_text()) <= 0:
                return Availability(False, "user namespaces are disabled (user.max_user_namespaces=0)")
        except (OSError, ValueError):
            pass
        if not _cgroup_v2() and not Path("/sys/fs/cgroup/memory").is_dir():
            return Availability(False, "no memory cgroup controller mounted")
        if not shutil.which("gcc") and not any((self.runtime / "images").glob("base-*")):
            return Availability(False, "needs gcc once, to build the guest agent's spawn helpers")
        return Availability(True, f"runc at {path}, cgroup {'v2' if _cgroup_v2() else 'v1'}, user namespaces")

    # ---- lifecycle

    def image(self) -> Path:
        if self._image is None:
            self._image = build_image(self.runtime / "images")
        return self._image

    def config(self, spec: SandboxSpec, rootfs: Path, workspace: Path) -> dict:
        """The OCI runtime config of one sandbox."""
        lim = spec.limits
        env = dict(BASE_ENV)
        env.update(dict(spec.envs))
        mib = 1 << 20
        tmp_mb, shm_mb = tmpfs_sizes(lim)
        ns = [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "cgroup", "user")]
        nosuid = ["nosuid", "nodev"]
        mounts = [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={shm_mb}m"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["bind", "ro", *nosuid]},
            {"destination": "/workspace", "type": "bind", "source": str(workspace), "options": ["bind", "rw", *nosuid]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": [*nosuid, "mode=1777", f"size={tmp_mb}m"]},
            {"destination": "/home/user", "type": "tmpfs", "source": "tmpfs",
             "options": [*nosuid, "mode=755", f"uid={GUEST_UID}", f"gid={GUEST_GID}", f"size={tmp_mb}m"]},
        ]
        period = 100_000
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": GUEST_UID, "gid": GUEST_GID, "additionalGids": []},
                "args": [GUEST_PYTHON, "-I", "-S", "-c", _AGENT_BOOT if _unified_root() is None else
                         _AGENT_BOOT.replace("main()", f"main(['--cgroup-fd', '{CGROUP_FD}'])")],
                "env": [f"{k}={v}" for k, v in env.items()],
                "cwd": "/workspace",
                "capabilities": {k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")},
                "rlimits": [
                    {"type": "RLIMIT_NOFILE", "hard": lim.open_files, "soft": lim.open_files},
                    {"type": "RLIMIT_FSIZE", "hard": lim.file_size_mb * mib, "soft": lim.file_size_mb * mib},
                    {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
                ],
                "noNewPrivileges": True,
            },
            "root": {"path": str(rootfs), "readonly": True},
            "hostname": HOSTNAME,
            "mounts": mounts,
            "linux": {
                "uidMappings": [{"containerID": 0, "hostID": spec.uid_base, "size": ID_RANGE}],
                "gidMappings": [{"containerID": 0, "hostID": spec.uid_base, "size": ID_RANGE}],
                "namespaces": ns,
                "cgroupsPath": self.cgroup_path(spec.sandbox_id),
                "resources": {
                    "devices": [{"allow": False, "access": "rwm"}],
                    "memory": {"limit": lim.memory_mb * mib, "swap": lim.memory_mb * mib},
                    "cpu": {"quota": max(1000, int(lim.cpus * period)), "period": period},
                    "pids": {"limit": lim.pids},
                },
                "maskedPaths": MASKED_PATHS,
                "readonlyPaths": READONLY_PATHS,
                "seccomp": seccomp.profile(),
            },
        }

    def disk_cache(self) -> Path:
        """Where the blank /workspace filesystems (one per size) are kept."""
        return self.runtime / "images" / "disks"

    @staticmethod
    def cgroup_path(sandbox_id: str) -> str:
        return f"/warmbox/{sandbox_id}"

    async def create(self, spec: SandboxSpec) -> BackendHandle:
        state = Path(spec.state_dir)
        bundle = state / "bundle"
        workspace = state / "workspace"
        bundle.mkdir(parents=True, exist_ok=True)
        (state / "run").mkdir(mode=0o700, exist_ok=True)  # the agent socket: root only
        # /workspace is its own filesystem of limits.disk_mb (workspace_disk), owned by the sandbox user:
        # ~3 ms of copy + loop + mount, run in place (a thread hop cost ~2 ms more); a first use of
        # the size makes its blank filesystem (mkfs) in a thread
        args = (state, self.disk_cache(), spec.limits.disk_mb, spec.uid_base + GUEST_UID, spec.uid_base + GUEST_GID)
        try:
            if workspace_disk.cached(self.disk_cache(), spec.limits.disk_mb):
                workspace_disk.attach(*args)
            else:
                await asyncio.to_thread(workspace_disk.attach, *args)
        except OSError as e:
            raise SandboxStartError(f"the workspace disk: {e.strerror or e}", spec.sandbox_id) from None
        config = self.config(spec, self.image(), workspace)
        tmp = bundle / "config.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the sandbox's env
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
        os.rename(tmp, bundle / "config.json")
        return BackendHandle(sandbox_id=spec.sandbox_id, tier=self.tier, runtime_id=spec.sandbox_id,
                             state_dir=str(state), socket_path=str(state / "run" / "agent.sock"),
                             uid_base=spec.uid_base)

    async def start(self, handle: BackendHandle, ready: Callable[[], Awaitable[T]]) -> T:
        state = Path(handle.state_dir)
        sock_path = handle.socket_path
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                os.unlink(sock_path)
            except FileNotFoundError:
                pass
            listener.bind(sock_path)
            os.chmod(sock_path, 0o600)
            listener.listen(128)
            cgroup = self._delegate_cgroup(handle)
            argv = [self.runc, "--root", str(self.root), "run", "--detach", "--preserve-fds",
                    "1" if cgroup is None else "2", "--bundle", str(state / "bundle"), handle.runtime_id]
            pid = _spawn(argv, fd3=listener.fileno(), log=state / "agent.log", fd4=cgroup)
        finally:
            listener.close()  # runc (then the agent) holds the listening socket now
            if cgroup is not None:
                os.close(cgroup)
        # The socket already listens, so ready() (connect + ping) runs while runc is still
        # finishing: its connection waits in the backlog until the agent accepts it.
        runc_done = asyncio.ensure_future(_wait_pid(pid))
        ready_task = asyncio.ensure_future(ready())
        try:
            await asyncio.wait({runc_done, ready_task}, return_when=asyncio.FIRST_COMPLETED)
            rc = await runc_done
            if rc != 0:
                tail = _tail(state / "agent.log")
                raise SandboxStartError(f"runc failed to start the sandbox (exit {rc}): {tail}", handle.sandbox_id)
            return await ready_task
        finally:
            for task in (ready_task, runc_done):
                if not task.done():
                    task.cancel()
                    task.add_done_callback(lambda t: t.cancelled() or t.exception())
                elif not task.cancelled():
                    task.exception()  # retrieved: a runc failure supersedes ready()'s error

    def _delegate_cgroup(self, handle: BackendHandle) -> int | None:
        """The sandbox's cgroup v2 directory, made before runc (which then uses it) and given to
        the sandbox user, opened for the agent (fd 4): each command gets a child cgroup and a
        timeout kills it whole (cgroup.kill). It is mounted nowhere inside, so no process there
        can reach it or move itself out. None on a host without cgroup v2."""
        root = _unified_root()
        if root is None:
            return None
        d = root / self.cgroup_path(handle.sandbox_id).lstrip("/")
        try:
            d.mkdir(parents=True, exist_ok=True)
            for target in (d, d / "cgroup.procs"):  # procs: moving a process needs the common ancestor's
                os.chown(target, handle.uid_base + GUEST_UID, handle.uid_base + GUEST_GID)
            return os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise SandboxStartError(f"cannot delegate the sandbox's cgroup {d}: {e.strerror or e}",
                                    handle.sandbox_id) from None

    async def alive(self, handle: BackendHandle) -> bool:
        pid = self._init_pid(handle)
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def netns_path(self, handle: BackendHandle) -> str:
        """The sandbox's network namespace, to attach an egress link to while it runs."""
        pid = self._init_pid(handle)
        if pid is None:
            from warmbox.errors import SandboxNotFound

            raise SandboxNotFound(f"sandbox {handle.sandbox_id} is not running", handle.sandbox_id)
        return f"/proc/{pid}/ns/net"

    def _init_pid(self, handle: BackendHandle) -> int | None:
        try:
            state = json.loads((self.root / handle.runtime_id / "state.json").read_text())
            return int(state["init_process_pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _cgroup_file(self, controller: str, sandbox_id: str, name: str) -> Path:
        rel = self.cgroup_path(sandbox_id).lstrip("/")
        if _cgroup_v2():
            return Path("/sys/fs/cgroup") / rel / name
        return Path("/sys/fs/cgroup") / controller / rel / name

    def cgroup_dirs(self, sandbox_id: str) -> list[Path]:
        """Every cgroup directory this sandbox may own (for leak checks)."""
        rel = self.cgroup_path(sandbox_id).lstrip("/")
        if _cgroup_v2():
            return [Path("/sys/fs/cgroup") / rel]
        return [d / rel for d in Path("/sys/fs/cgroup").iterdir() if d.is_dir() and not d.is_symlink()]

    async def oom_kills(self, handle: BackendHandle) -> int:
        """The cgroup's OOM-kill counter; read around every command, so kept to one syscall trio."""
        path = self._oom_paths.get(handle.sandbox_id)
        if path is None:
            name = "memory.events" if _cgroup_v2() else "memory.oom_control"
            path = self._oom_paths[handle.sandbox_id] = str(self._cgroup_file("memory", handle.sandbox_id, name))
            if len(self._oom_paths) > 4096:
                self._oom_paths.clear()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.read(fd, 4096)
            finally:
                os.close(fd)
        except OSError:
            return 0
        i = data.find(b"oom_kill ")
        if i < 0:
            return 0
        j = data.find(b"\n", i)
        try:
            return int(data[i + 9:j if j >= 0 else None])
        except ValueError:
            return 0

    async def usage(self, handle: BackendHandle) -> ResourceUsage:
        sid = handle.sandbox_id
        oom = mem = cpu = 0
        try:
            if _cgroup_v2():
                for line in self._cgroup_file("", sid, "memory.events").read_text().splitlines():
                    if line.startswith("oom_kill "):
                        oom = int(line.split()[1])
                mem = int(self._cgroup_file("", sid, "memory.current").read_text())
                for line in self._cgroup_file("", sid, "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec "):
                        cpu = int(line.split()[1]) * 1000
            else:
                for line in self._cgroup_file("memory", sid, "memory.oom_control").read_text().splitlines():
                    if line.startswith("oom_kill "):
                        oom = int(line.split()[1])
                mem = int(self._cgroup_file("memory", sid, "memory.usage_in_bytes").read_text())
                cpu = int(self._cgroup_file("cpuacct", sid, "cpuacct.usage").read_text())
        except (OSError, ValueError):
            pass
        return ResourceUsage(oom_kills=oom, memory_bytes=mem, cpu_ns=cpu)

    def _pids(self, sandbox_id: str) -> list[int]:
        f = self._cgroup_file("pids", sandbox_id, "cgroup.procs")
        try:
            return [int(x) for x in f.read_text().split()]
        except (OSError, ValueError):
            return []

    def _freeze_and_kill(self, sandbox_id: str, pids: list[int]) -> None:
        """SIGKILL every process of the sandbox's cgroup (frozen first, so nothing forks meanwhile)."""
        freezer = None if _cgroup_v2() else self._cgroup_file("freezer", sandbox_id, "freezer.state")
        try:
            if freezer is not None and freezer.exists():
                freezer.write_text("FROZEN")
        except OSError:
            freezer = None
        for pid in set(pids) | set(self._pids(sandbox_id)):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        try:
            if freezer is not None:
                freezer.write_text("THAWED")  # SIGKILL is delivered on thaw
        except OSError:
            pass

    async def destroy(self, handle: BackendHandle) -> None:
        pids = self._pids(handle.sandbox_id)
        if (self.root / handle.runtime_id).exists():
            proc = await asyncio.create_subprocess_exec(
                self.runc, "--root", str(self.root), "delete", "--force", handle.runtime_id,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
            _, err = await proc.communicate()
            if proc.returncode != 0 and (self.root / handle.runtime_id).exists():
                raise SandboxStartError(f"runc delete failed: {err.decode(errors='replace').strip()}",
                                        handle.sandbox_id)
        await self._wait_gone(handle, pids)

    async def _wait_gone(self, handle: BackendHandle, pids: list[int]) -> None:
        """After the runtime's delete: no process left, cgroups and the state dir removed."""
        # runc returns once init is dead; wait (bounded) until every process has fully exited.
        # Whatever is still in the cgroup then (runc's state was lost, or it failed) is killed
        # here: a sandbox is never reported destroyed while one of its processes runs.
        deadline = time.monotonic() + 5
        killed = False
        while True:
            pids = [pid for pid in set(pids) | set(self._pids(handle.sandbox_id)) if _running(pid)]
            if not pids:
                break
            if time.monotonic() > deadline and killed:
                raise SandboxStartError(f"processes {sorted(pids)[:8]} of the sandbox did not exit", handle.sandbox_id)
            if time.monotonic() > deadline - 4.5 and not killed:
                self._freeze_and_kill(handle.sandbox_id, pids)
                killed = True
                deadline = time.monotonic() + 5
            await asyncio.sleep(0.01)
        for d in self.cgroup_dirs(handle.sandbox_id):  # runc removes them; be sure
            if d.is_dir():
                # the agent's per-command cgroups (cgroup v2) first: a cgroup with children stays
                for sub in sorted((x for x in d.rglob("*") if x.is_dir()), key=lambda x: -len(x.parts)):
                    try:
                        sub.rmdir()
                    except OSError:
                        pass
                try:
                    d.rmdir()
                except OSError:
                    pass
        try:  # never remove a tree that is still mounted: the teardown fails and is retried
            await asyncio.to_thread(workspace_disk.release, handle.state_dir)
        except OSError as e:
            raise SandboxStartError(f"the workspace disk: {e.strerror or e}", handle.sandbox_id) from None
        hostfs.keep_logs(handle.state_dir, self.runtime_logs, self.runtime / "logs", handle.sandbox_id)
        shutil.rmtree(handle.state_dir, ignore_errors=True)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie. A sandbox's init is reparented to the host's init
    when runc exits, and on some hosts that reaps only every second or two: a zombie holds no
    memory, CPU or open files, so it does not keep a destroy waiting."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")


def _tail(path: Path, limit: int = 600) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return "(no log)"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-4:])[-limit:] or "(empty log)"


def _spawn(argv: list[str], fd3: int, log: Path, fd4: int | None = None) -> int:
    """posix_spawn ``argv`` with ``fd3`` as its fd 3 (and ``fd4`` as 4), stdio to /dev/null +
    ``log``; returns the pid."""
    high = fcntl.fcntl(fd3, fcntl.F_DUPFD_CLOEXEC, 10)  # never 3 itself: dup2(3, 3) keeps CLOEXEC
    high4 = fcntl.fcntl(fd4, fcntl.F_DUPFD_CLOEXEC, 10) if fd4 is not None else None
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        actions = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, out, 1),
                   (os.POSIX_SPAWN_DUP2, out, 2), (os.POSIX_SPAWN_DUP2, high, 3)]
        if high4 is not None:
            actions.append((os.POSIX_SPAWN_DUP2, high4, 4))
        pid = os.posix_spawn(argv[0] if os.path.isabs(argv[0]) else shutil.which(argv[0]) or argv[0], argv,
                             dict(os.environ), file_actions=actions)
    finally:
        for fd in (high, high4, null, out):
            if fd is not None:
                os.close(fd)
    return pid


async def _wait_pid(pid: int) -> int:
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)

