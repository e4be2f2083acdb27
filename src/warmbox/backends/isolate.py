"""Tier 1: a V8 isolate per sandbox (isolated-vm), held by a jailed Node.js host process per tenant.

Why isolated-vm: measured on this 2-core host against the other candidates (same run, 200 live
isolates each; numbers in NOTES.md and the report of issue 18):

=================  ==================  =====================  ==================  ==========================
engine             create+first call   idle RSS / isolate     snippets/s (raw)    memory limit
=================  ==================  =====================  ==================  ==========================
isolated-vm 5.0.4  1.3-1.9 ms          1.03 MiB               85-110 k (sync),    heap *and* ArrayBuffers:
                                                              23-55 k (async)     a 1 GB Uint8Array is refused
mini-racer 0.14.1  1.2 ms              0.67 MiB (+2 threads)  9-11 k              heap only: a 1 GB ArrayBuffer
                                                                                  passed a 64 MiB limit (the
                                                                                  host would be OOM-killed)
workerd 2026-11    (static config)     1.5 MiB                -                   eval() is refused in
                                                                                  Workers: no stateful REPL
=================  ==================  =====================  ==================  ==========================

A memory limit that ArrayBuffers escape lets one sandbox take the whole host process (and every
other isolate in it) down through the kernel's OOM killer; a V8 without ``eval`` cannot keep a code
context's globals between runs. isolated-vm's cost is a native build (node-gyp, ~1 min, ``install``).

Layout: each tenant's isolates live in a host process of their own (``isolate_host/host.js``; the
in-process SDK, which has no tenant, is one tenant of its own), started at the tenant's first
isolate and ended once it held none for HOST_IDLE_S (and at ``warmbox down`` / the daemon's idle
exit), so a fault in one tenant's code -- an OOM of its host, a crash, a spin -- stays in that
tenant. Each host runs in a runc container of its own -- user, pid, mount, net, ipc, uts and
cgroup namespaces, the container tier's seccomp filter, no capabilities, no_new_privs, a read-only
root with only /usr, the engine and the host script -- with its own cgroup (HOST_MEMORY_MB of
memory, HOST_CPUS of CPU) and its own range of host uids, a slot of the host-wide uid ledger (two
homes, two tenants never share a host uid), so a V8 escape lands in a jail with no network, no
host files and no other tenant. A host costs ~45 MiB of Node.js.

Memory: a host's isolates' memory_mb (+2 MiB each) together stay within HOST_BUDGET_MB (its
cgroup less Node.js's own heap and its Wasm workers); the isolates of every tenant of a home
together within MACHINE_SHARE of the machine's memory. A create past either gets LimitTooHigh
(limit "memory_mb", maximum: what is left) before anything is made, never an OOM of a host.
Each isolate has its own heap limit (isolated-vm's memoryLimit, ArrayBuffers included).

The backend hands each sandbox's listening socket (bound in the sandbox's root-only state dir) to
its tenant's host over the host's control socket (SCM_RIGHTS), and the engine's GuestSession then
speaks the ordinary guest protocol to it: no special path in the engine. A host that ends (killed,
OOM) takes only its tenant's isolates with it, and the engine marks them ``lost`` (``tend_hosts``,
run by the reaper every tick, and on the first call that finds the host gone).

WebAssembly: ``run_code(module, language="wasm")``, the module as its text format or base64 of its
binary, each run in a fresh wasmtime store (``isolate_host/wasm_worker.py``, Python workers the
host starts inside the same jail, one job each, up to WASM_WORKERS, SIGKILLed if a job outlives its
timeout; wasmtime bind-mounted read-only): a WASI command's ``_start`` with its stdout/stderr as
the run's, or a ``main()`` whose results are the text; epoch + fuel limits (timeout), memories
capped at the sandbox's memory_mb less its isolate's heap, WASI with no preopened directory
(the tier has no filesystem to give one). Wasm runs keep no state between runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import resource
import shutil
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import ClassVar, TypeVar

from warmbox import protocol
from warmbox.backends import _host as host
from warmbox.backends import seccomp
from warmbox.backends.base import (
    Availability,
    BackendHandle,
    Capabilities,
    ResourceUsage,
    SandboxSpec,
    UidSlots,
)
from warmbox.backends.runc import MASKED_PATHS, READONLY_PATHS
from warmbox.errors import GuestConnectionError, LimitTooHigh, SandboxError, SandboxStartError, Unsupported
from warmbox.models import ISOLATE_UID_RANGE

T = TypeVar("T")

IVM_VERSION = "5.0.4"
# isolated-vm, built once per host by ``install`` (scripts/bootstrap install): root-owned, read-only
ENGINE_DIR = Path("/var/lib/warmbox") / f"isolated-vm-{IVM_VERSION}"
HOST_SOURCES = Path(__file__).resolve().parent / "isolate_host"
HOST_UID = 1000  # the host process's uid inside its user namespace (host uid: its ledger slot's base + this)
HOST_MEMORY_MB = 4096  # one tenant's host: its cgroup's memory (no swap)
HOST_RESERVE_MB = 512  # of that, for Node.js itself (its heap: 256) and the Wasm workers (~40 each)
HOST_BUDGET_MB = HOST_MEMORY_MB - HOST_RESERVE_MB  # its isolates' memory_mb (+ISOLATE_OVERHEAD_MB each) together
ISOLATE_OVERHEAD_MB = 2  # an isolate's own structures beside its heap limit (host.js counts the same)
MACHINE_SHARE = 0.75  # the isolates of every tenant together: at most this share of the machine's memory
HOST_CPUS = max(1, (os.cpu_count() or 1) - 1)  # one tenant's host: a CPU quota leaving a core to the others
HOST_PIDS = 256  # Node.js, isolated-vm's threads and the Wasm workers
WASM_WORKERS = 4  # Wasm jobs of one tenant run at once (each in its own worker process)
HOST_IDLE_S = 60.0  # a host that held no isolate this long is ended
# where each running host is recorded host-wide (its runtime dir): a host whose home is gone is
# swept by the next host start of any home
HOSTS_RECORD = Path("/var/lib/warmbox") / "isolate-hosts"
# two sockets per sandbox and connection, at least (its listener and each session): bounded by the
# host's own hard limit, which runc cannot raise
HOST_FILES = min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
CONTROL_TIMEOUT_S = 10.0
START_TIMEOUT_S = 30.0
NODE = "/usr/bin/node"


def install(dest: Path = ENGINE_DIR) -> Path:
    """Build isolated-vm into ``dest`` (npm from the registry, then node-gyp against the host's Node.js
    headers: needs g++, make, python3 and /usr/include/node). Idempotent; ~1 min of 2 cores."""
    if (dest / "out" / "isolated_vm.node").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.parent / f".tmp-ivm-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        subprocess.run(
            ["npm", "install", "--ignore-scripts", "--no-audit", "--no-fund", f"isolated-vm@{IVM_VERSION}"],
            cwd=work,
            check=True,
            timeout=600,
            stdout=subprocess.DEVNULL,
        )
        pkg = work / "node_modules" / "isolated-vm"
        gyp = shutil.which("node-gyp") or "/usr/lib/node_modules/npm/node_modules/node-gyp/bin/node-gyp.js"
        cmd = [gyp] if gyp.endswith("node-gyp") else [NODE, gyp]
        subprocess.run(
            [*cmd, "rebuild", "--release", "-j", "2", "--nodedir=/usr"],
            cwd=pkg,
            check=True,
            timeout=1800,
            stdout=subprocess.DEVNULL,
        )
        # out/isolated_vm.node is what loads (a link into build/ after node-gyp): the file alone is kept
        out = pkg / "out"
        if out.is_symlink() or out.is_file():
            out.unlink()
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        shutil.copy2(pkg / "build" / "Release" / "isolated_vm.node", out / "isolated_vm.node")
        shutil.rmtree(pkg / "build", ignore_errors=True)
        os.chmod(pkg, 0o755)
        try:
            os.rename(pkg, dest)
        except OSError:  # another install won
            if not (dest / "out" / "isolated_vm.node").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def wasmtime_dir() -> Path:
    """The installed wasmtime package (a dependency): bind-mounted read-only into the jail."""
    spec = importlib.util.find_spec("wasmtime")
    if spec is None or spec.origin is None:
        raise SandboxStartError("the wasmtime package is not installed (pip install wasmtime)")
    return Path(spec.origin).parent


def machine_memory_mb() -> int:
    """The machine's memory (MiB), from /proc/meminfo."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) >> 10
    except (OSError, ValueError, IndexError):
        pass
    return 4096


def tenant_key(tenant: str) -> str:
    """The host key of a tenant's isolates ("" -- the in-process SDK's -- is a tenant of its own)."""
    return hashlib.sha256(b"tenant\0" + tenant.encode("utf-8", "surrogatepass")).hexdigest()[
        :16
    ]  # 64 bits: no two tenants share


class TenantHost:
    """One tenant's host process: its directory under the runtime dir and what is kept there."""

    def __init__(self, base: Path, home_tag: str, key: str) -> None:
        self.key = key
        self.dir = base / f"h-{key}"
        self.control_path = self.dir / "ctl" / "control.sock"  # in a root-only directory
        self.id = f"iso-{home_tag}-{key}"  # its container and cgroup: unique on the host
        self.holder = f"isolate-host:{self.id}"  # its entry in the host-wide uid ledger
        self.generation = self.dir / "generation"  # one per start: a sandbox names the one it lives in
        self.slot = self.dir / "uid_base"
        self.reserved = self.dir / "reserved_mb"  # its isolates' memory (for the machine's budget)
        self.idle = self.dir / "idle_since"
        self.log = self.dir / "host.log"
        self.lock = self.dir / ".lock"

    def read(self, path: Path) -> str:
        try:
            return path.read_text().strip()
        except OSError:
            return ""


class IsolateBackend:
    """Tier 1 (``isolate``): a V8 isolate per sandbox in its tenant's jailed host process."""

    tier: ClassVar[str] = "isolate"
    runtime_logs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, runtime: Path, engine_dir: Path = ENGINE_DIR) -> None:
        self.runtime = runtime
        self.engine_dir = engine_dir
        self.dir = runtime / "isolate"
        self.runc_root = self.dir / "runc"
        self.home_tag = hashlib.sha256(str(runtime.resolve()).encode()).hexdigest()[:12]
        self.uid_slots: UidSlots | None = None
        self.home: Path | None = None

    def use_home(self, home: Path, slots: UidSlots) -> None:
        """The home the hosts end with, and the host-wide uid ledger each tenant host takes its
        uid range from (the engine's)."""
        self.home = home
        self.uid_slots = slots

    def host(self, tenant: str) -> TenantHost:
        """The host of ``tenant``'s isolates ("" : the in-process SDK's)."""
        return TenantHost(self.dir, self.home_tag, tenant_key(tenant))

    def hosts(self) -> list[TenantHost]:
        """Every tenant host this runtime dir has a directory for (running or not)."""
        try:
            names = sorted(n for n in os.listdir(self.dir) if n.startswith("h-"))
        except OSError:
            return []
        return [TenantHost(self.dir, self.home_tag, n[2:]) for n in names]

    # ---- description

    def capabilities(self) -> Capabilities:
        return Capabilities(
            tier=self.tier,
            isolation="a V8 isolate (isolated-vm) per sandbox, WebAssembly in wasmtime stores, in a host "
            "process per tenant jailed by Linux namespaces (user, pid, mount, net, ipc, uts, cgroup) + seccomp "
            "+ cgroup, no capabilities",
            memory_snapshot=False,
            filesystem_snapshot=False,
            custom_kernel=False,
            network_modes=("none",),
            languages=("javascript", "wasm"),
            start_class="~1ms",
            oom_counted_in_guest=True,
            context_languages=("javascript", "wasm"),
            isolation_rank=2,  # an engine of its own between the code and the kernel, on an OS jail
            start_ms=1.0,
            cost_note="V8 JIT: compute near native; no syscalls at all",
            commands=False,
            files=False,
            ports=False,
            images=False,
            root_user_reason="an isolate has no processes or users",
        )

    def probe(self) -> Availability:
        if not os.access(NODE, os.X_OK):
            return Availability(False, "Node.js is not installed (apt-get install nodejs)")
        if not (self.engine_dir / "out" / "isolated_vm.node").is_file():
            return Availability(False, f"isolated-vm is not built at {self.engine_dir} (scripts/bootstrap install)")
        runc_bin = shutil.which("runc")
        if runc_bin is None:
            return Availability(False, "runc is not installed (the isolate host's jail; apt-get install runc)")
        if os.geteuid() != 0:
            return Availability(False, "needs root (the isolate host's jail: runc with user namespaces and cgroups)")
        if not shutil.which("gcc") and not any(self.dir.glob("lib-*/fdpass.node")):
            return Availability(False, "needs gcc once, to build the isolate host's fd helper")
        return Availability(True, f"isolated-vm {IVM_VERSION} on Node.js, jailed by {runc_bin}")

    # ---- the host process

    def _lib(self) -> Path:
        """host.js and fdpass.node, once per content (built with gcc against Node.js's headers)."""
        h = hashlib.sha256()
        for name in ("host.js", "fdpass.c", "wasm_worker.py"):
            h.update(name.encode() + b"\0" + (HOST_SOURCES / name).read_bytes())
        final = self.dir / f"lib-{h.hexdigest()[:16]}"
        if (final / "fdpass.node").is_file():
            return final
        tmp = self.dir / f".tmp-lib-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o755)
        for name in ("host.js", "wasm_worker.py"):
            shutil.copy2(HOST_SOURCES / name, tmp / name)
        r = subprocess.run(
            [
                "gcc",
                "-O2",
                "-Wall",
                "-Werror",
                "-shared",
                "-fPIC",
                "-I/usr/include/node",
                "-DNODE_GYP_MODULE_NAME=fdpass",
                "-o",
                str(tmp / "fdpass.node"),
                str(HOST_SOURCES / "fdpass.c"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SandboxStartError(f"building the isolate host's fd helper failed: {r.stderr.strip()[-300:]}")
        for p in (tmp / "host.js", tmp / "wasm_worker.py", tmp / "fdpass.node"):
            p.chmod(0o644)
        try:
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def _root(self) -> Path:
        """The jail's read-only root: mount points, the host's loader cache and the /usr symlinks."""
        root = self.dir / "root-v2"
        if root.is_dir():
            return root
        tmp = self.dir / f".tmp-root-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o755)
        for d in ("usr", "proc", "dev", "tmp", "etc", "opt/isolated-vm", "opt/isolate-host", "opt/wasmtime/wasmtime"):
            (tmp / d).mkdir(parents=True, exist_ok=True)
        for link in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            on_host = Path("/") / link
            if on_host.is_symlink():
                os.symlink(os.readlink(on_host), tmp / link)
        if os.path.isfile("/etc/ld.so.cache"):  # Node.js's libraries are found through it
            shutil.copy2("/etc/ld.so.cache", tmp / "etc" / "ld.so.cache")
        (tmp / "etc" / "passwd").write_text(f"host:x:{HOST_UID}:{HOST_UID}::/:/usr/sbin/nologin\n")
        (tmp / "etc" / "group").write_text(f"host:x:{HOST_UID}:\n")
        try:
            os.rename(tmp, root)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
        return root

    def host_config(self, root: Path, lib: Path, h: TenantHost | None = None, uid_base: int = 0) -> dict:
        """The OCI config of a tenant host's jail (``uid_base``: the first host uid of its ledger slot)."""
        h = h or self.host("")
        nosuid = ["nosuid", "nodev"]
        mib = 1 << 20
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": HOST_UID, "gid": HOST_UID, "additionalGids": []},
                "args": [
                    NODE,
                    "--max-old-space-size=256",  # the host's own heap; each isolate has its own limit
                    "/opt/isolate-host/host.js",
                ],
                "env": [
                    "PATH=/usr/bin",
                    "WB_IVM=/opt/isolated-vm",
                    "WB_FDPASS=/opt/isolate-host/fdpass.node",
                    "WB_WASMTIME=/opt/wasmtime",
                    f"WB_PROTOCOL_VERSION={protocol.PROTOCOL_VERSION}",
                    f"WB_BUDGET_MB={HOST_BUDGET_MB}",
                    f"WB_WASM_WORKERS={WASM_WORKERS}",
                ],
                "cwd": "/",
                "capabilities": {k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")},
                "rlimits": [
                    {"type": "RLIMIT_NOFILE", "hard": HOST_FILES, "soft": HOST_FILES},
                    {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
                ],
                "noNewPrivileges": True,
            },
            "root": {"path": str(root), "readonly": True},
            "hostname": "isolate-host",
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
                {
                    "destination": "/dev",
                    "type": "tmpfs",
                    "source": "tmpfs",
                    "options": ["nosuid", "strictatime", "mode=755", "size=64k"],
                },
                {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["bind", "ro", *nosuid]},
                {
                    "destination": "/opt/isolated-vm",
                    "type": "bind",
                    "source": str(self.engine_dir),
                    "options": ["bind", "ro", *nosuid],
                },
                {
                    "destination": "/opt/isolate-host",
                    "type": "bind",
                    "source": str(lib),
                    "options": ["bind", "ro", *nosuid],
                },
                {
                    "destination": "/opt/wasmtime/wasmtime",
                    "type": "bind",
                    "source": str(wasmtime_dir()),
                    "options": ["bind", "ro", *nosuid],
                },
                {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": [*nosuid, "size=1m"]},
            ],
            "linux": {
                # runc needs its root mapped; the process runs as HOST_UID of the range, owning nothing
                "uidMappings": [{"containerID": 0, "hostID": uid_base, "size": ISOLATE_UID_RANGE}],
                "gidMappings": [{"containerID": 0, "hostID": uid_base, "size": ISOLATE_UID_RANGE}],
                "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "cgroup", "user")],
                "cgroupsPath": host.SandboxCgroup(h.id).path,
                "resources": {
                    "devices": [{"allow": False, "access": "rwm"}],
                    "memory": {"limit": HOST_MEMORY_MB * mib, "swap": HOST_MEMORY_MB * mib},
                    "cpu": {"quota": HOST_CPUS * 100_000, "period": 100_000},
                    "pids": {"limit": HOST_PIDS},
                },
                "maskedPaths": MASKED_PATHS,
                "readonlyPaths": READONLY_PATHS,
                "seccomp": seccomp.profile(),
            },
        }

    def _control(self, h: TenantHost, request: dict, fd: int | None = None, timeout: float = CONTROL_TIMEOUT_S) -> dict:
        """One control exchange with a tenant's host (OSError if it does not answer)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(h.control_path))
            socket.send_fds(s, [json.dumps(request).encode()], [fd] if fd is not None else [])
            data = b""
            while not data.endswith(b"\n") and len(data) < 65536:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        try:
            reply = json.loads(data)
        except ValueError:
            raise OSError(f"the isolate host answered {data[:200]!r}") from None
        if not isinstance(reply, dict):
            raise OSError(f"the isolate host answered {reply!r}")
        return reply

    def host_pid(self, tenant: str = "") -> int | None:
        """The pid of ``tenant``'s host process (None if it does not run)."""
        return self._pid(self.host(tenant))

    def _pid(self, h: TenantHost) -> int | None:
        try:
            state = json.loads((self.runc_root / h.id / "state.json").read_text())
            pid = int(state["init_process_pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return pid if host.running(pid) else None

    def host_stats(self, tenant: str = "") -> dict | None:
        """{"sandboxes": n, "rss": bytes, "pid", "reserved_mb", "budget_mb"} of ``tenant``'s running
        host; None without one."""
        try:
            reply = self._control(self.host(tenant), {"op": "stats"}, timeout=2.0)
        except OSError:
            return None
        return reply if reply.get("ok") else None

    @contextlib.contextmanager
    def _locked(self, h: TenantHost, how: int = fcntl.LOCK_EX) -> Iterator[bool]:
        """A host's lock: exclusive to start or stop it, shared around an add (so a stop never
        ends a host an add is putting an isolate in). Yields False if LOCK_NB was asked and it is taken."""
        h.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(h.lock, "a") as f:
            try:
                fcntl.flock(f, how)
            except BlockingIOError:
                yield False
                return
            yield True

    def ensure_host(self, tenant: str = "") -> TenantHost:
        """Start ``tenant``'s host process unless it runs (under its lock). A host whose process
        runs is never replaced, however slowly it answers: only a host whose process is gone is."""
        h = self.host(tenant)
        if self._pid(h) is not None and h.control_path.exists():
            return h
        self.dir.mkdir(mode=0o711, parents=True, exist_ok=True)  # the jail's root and lib are below
        with self._locked(h):
            if self._pid(h) is not None and h.control_path.exists():
                return h
            self._stop_container(h)
            self.sweep_orphans()
            if self.uid_slots is None or self.home is None:
                raise SandboxStartError("the isolate tier has no home and uid ledger to run its hosts with")
            # an empty root-only file in the home, held open by the host: deleted with the home,
            # its link count drops to 0 and the host ends
            marks = self.home / "isolate-hosts"
            marks.mkdir(mode=0o700, exist_ok=True)
            alive_path = marks / f"{h.id}.alive"
            lib = self._lib()
            root = self._root()
            uid_base = self.uid_slots.claim(h.holder)
            try:
                h.slot.write_text(str(uid_base))
                h.control_path.parent.mkdir(mode=0o700, exist_ok=True)
                bundle = h.dir / "bundle"
                bundle.mkdir(mode=0o700, exist_ok=True)
                (bundle / "config.json").write_text(json.dumps(self.host_config(root, lib, h, uid_base)))
                h.reserved.write_text("0")
                h.generation.write_text(os.urandom(8).hex())
                with contextlib.suppress(FileNotFoundError):
                    h.control_path.unlink()
                with contextlib.suppress(FileNotFoundError):
                    alive_path.unlink()
                alive = os.open(alive_path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o400)
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    listener.bind(str(h.control_path))
                    os.chmod(h.control_path, 0o600)
                    listener.listen(512)
                    argv = [
                        shutil.which("runc") or "runc",
                        "--root",
                        str(self.runc_root),
                        "run",
                        "--detach",
                        "--preserve-fds",
                        "2",
                        "--bundle",
                        str(bundle),
                        h.id,
                    ]
                    pid = host.spawn(argv, h.log, [listener.fileno(), alive])
                finally:
                    listener.close()
                    os.close(alive)
                _, status = os.waitpid(pid, 0)
                if os.waitstatus_to_exitcode(status) != 0:
                    raise SandboxStartError(f"runc failed to start the isolate host: {host.tail(h.log)}")
                HOSTS_RECORD.mkdir(mode=0o700, parents=True, exist_ok=True)
                (HOSTS_RECORD / h.id).write_text(str(alive_path.resolve()))
                deadline = time.monotonic() + START_TIMEOUT_S
                while self.host_stats(tenant) is None:
                    if time.monotonic() > deadline or self._pid(h) is None:
                        raise SandboxStartError(f"the isolate host did not come up: {host.tail(h.log)}")
                    time.sleep(0.005)
            except BaseException:
                self._stop_container(h)
                raise
        return h

    def _stop_container(self, h: TenantHost) -> None:
        """Kill and delete a host's container and cgroup, whatever state they are in; give its uid
        range back to the ledger."""
        if (self.runc_root / h.id).exists():
            subprocess.run(
                [shutil.which("runc") or "runc", "--root", str(self.runc_root), "delete", "--force", h.id],
                capture_output=True,
                timeout=30,
                check=False,
            )
        cgroup = host.SandboxCgroup(h.id)
        if not cgroup.try_remove():
            cgroup.remove()
        with contextlib.suppress(FileNotFoundError):
            (HOSTS_RECORD / h.id).unlink()
        if self.home is not None:
            with contextlib.suppress(FileNotFoundError):
                (self.home / "isolate-hosts" / f"{h.id}.alive").unlink()
        uid_base = h.read(h.slot)
        if uid_base.isdigit() and self.uid_slots is not None:
            self.uid_slots.release(h.holder, int(uid_base))  # only if the ledger still says it is this host's
        for f in (h.slot, h.generation, h.reserved, h.idle):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()

    def stop_host(self) -> None:
        """Stop every tenant's host process (every isolate sandbox in them ends) and remove their
        containers and cgroups."""
        for h in self.hosts():
            self.end_host_of(h)

    def end_host(self, tenant: str) -> None:
        """Stop ``tenant``'s host process (its isolates end with it) and remove its container and cgroup."""
        self.end_host_of(self.host(tenant))

    def end_host_of(self, h: TenantHost) -> None:
        with self._locked(h):
            with contextlib.suppress(FileNotFoundError):
                h.control_path.unlink()
            self._stop_container(h)

    def sweep_orphans(self) -> list[str]:
        """End the hosts (of any home on this machine) whose home is gone (the file each holds
        open there): their processes, if one outlived its home, their cgroups and their uid
        ranges in the ledger. Returns their ids."""
        swept = []
        try:
            names = os.listdir(HOSTS_RECORD)
        except OSError:
            return []
        for name in names:
            try:
                mark = (HOSTS_RECORD / name).read_text()
            except OSError:
                continue
            if not mark.startswith("/") or os.path.exists(mark) or not name.startswith("iso-"):
                continue
            cgroup = host.SandboxCgroup(name)
            cgroup.kill_all()
            try:
                cgroup.remove()
            except SandboxError:
                continue  # retried at the next sweep
            # its range, once nothing runs in it (its init may still be an unreaped zombie: then
            # the record stays for the next sweep)
            if self.uid_slots is not None and not self.uid_slots.forget_gone(f"isolate-host:{name}"):
                continue
            with contextlib.suppress(FileNotFoundError):
                (HOSTS_RECORD / name).unlink()
            swept.append(name)
        return swept

    def tend_hosts(self, handles: Sequence[BackendHandle]) -> list[str]:
        """Given this runtime dir's live isolate sandboxes: the ids of those whose host process has
        ended (or was started again since: it holds none of them), and the hosts that held none of
        them for HOST_IDLE_S are ended (under their lock, once they say they hold nothing)."""
        live: dict[str, str | None] = {}  # host key -> its generation if its process runs
        used: set[str] = set()
        dead = []
        for handle in handles:
            where = self._where(handle)
            if where is None:
                continue  # not added to a host yet (a start in progress)
            key, generation = where
            used.add(key)
            if key not in live:
                h = TenantHost(self.dir, self.home_tag, key)
                live[key] = h.read(h.generation) if self._pid(h) is not None else None
            if live[key] != generation:
                dead.append(handle.sandbox_id)
        now = time.time()
        for h in self.hosts():
            if h.key in used or self._pid(h) is None:
                with contextlib.suppress(FileNotFoundError):
                    h.idle.unlink()
                continue
            since = h.read(h.idle)
            if not since:
                h.idle.write_text(str(now))
                continue
            try:
                if now - float(since) < HOST_IDLE_S:
                    continue
            except ValueError:
                pass
            with self._locked(h, fcntl.LOCK_EX | fcntl.LOCK_NB) as got:
                if not got:
                    continue
                try:
                    held = self._control(h, {"op": "stats"}, timeout=2.0).get("sandboxes")
                except OSError:
                    held = 0
                if held == 0:
                    with contextlib.suppress(FileNotFoundError):
                        h.control_path.unlink()
                    self._stop_container(h)
        return dead

    # ---- sandboxes

    def _where(self, handle: BackendHandle) -> tuple[str, str] | None:
        """(host key, host generation) of the host a sandbox was added to; None before its start."""
        try:
            where = json.loads((Path(handle.state_dir) / "host.json").read_text())
            return str(where["host"]), str(where["generation"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _host_of(self, handle: BackendHandle) -> TenantHost | None:
        where = self._where(handle)
        return TenantHost(self.dir, self.home_tag, where[0]) if where is not None else None

    def _admit(self, memory_mb: int, h: TenantHost) -> None:
        """LimitTooHigh if ``memory_mb`` does not fit one host's budget, or the machine's share
        left by every host of this home (their isolates' reservations, as they last answered)."""
        cost = memory_mb + ISOLATE_OVERHEAD_MB
        if cost > HOST_BUDGET_MB:
            raise LimitTooHigh(
                f"limits.memory_mb = {memory_mb} is more than one tenant's isolate host holds "
                f"({HOST_BUDGET_MB - ISOLATE_OVERHEAD_MB} MiB of its {HOST_MEMORY_MB} MiB)",
                limit="memory_mb",
                value=memory_mb,
                maximum=HOST_BUDGET_MB - ISOLATE_OVERHEAD_MB,
                source="the isolate tier's host per tenant",
            )
        share = int(machine_memory_mb() * MACHINE_SHARE)
        taken = 0
        for other in self.hosts():
            if self._pid(other) is not None:
                with contextlib.suppress(ValueError):
                    taken += int(other.read(other.reserved) or 0)
        if taken + cost > share:
            raise LimitTooHigh(
                f"limits.memory_mb = {memory_mb}: the isolates of this host's tenants hold {taken} of the "
                f"{share} MiB they may have ({MACHINE_SHARE:.0%} of the machine's memory)",
                limit="memory_mb",
                value=memory_mb,
                maximum=max(0, share - taken - ISOLATE_OVERHEAD_MB),
                source="the isolate tier's share of this machine's memory",
            )

    async def create(self, spec: SandboxSpec) -> BackendHandle:
        if spec.build_upper or spec.volumes:
            raise Unsupported(
                "the isolate tier has no filesystem (no template builds, no volumes)",
                self.tier,
                "an isolate runs JavaScript with no file, network or process APIs",
            )
        self._admit(spec.limits.memory_mb, self.host(spec.tenant))
        state = Path(spec.state_dir)
        (state / "run").mkdir(mode=0o700, parents=True, exist_ok=True)  # the sandbox's socket: root only
        (state / "limits.json").write_text(json.dumps({"memory_mb": spec.limits.memory_mb, "tenant": spec.tenant}))
        return BackendHandle(
            sandbox_id=spec.sandbox_id,
            tier=self.tier,
            runtime_id=spec.sandbox_id,
            state_dir=str(state),
            socket_path=str(state / "run" / "agent.sock"),
            uid_base=spec.uid_base,
        )

    async def start(self, handle: BackendHandle, ready: Callable[[], Awaitable[T]]) -> T:
        """Make the sandbox's isolate in its tenant's host (started first if it does not run: in a thread)."""
        try:
            limits = json.loads((Path(handle.state_dir) / "limits.json").read_text())
            memory_mb, tenant = int(limits["memory_mb"]), str(limits["tenant"])
        except (OSError, ValueError, KeyError, TypeError):
            raise SandboxStartError("the sandbox's limits are gone", handle.sandbox_id) from None
        h = self.host(tenant)
        reply: dict = {"ended": True}
        for _ in range(3):  # a host ended as idle between its start check and the add: start it again
            if self._pid(h) is None or not h.control_path.exists():
                await asyncio.to_thread(self.ensure_host, tenant)
            reply = await asyncio.to_thread(self._add, h, handle, memory_mb)
            if not reply.get("ended"):
                break
        if not reply.get("ok"):
            if reply.get("code") == "memory":
                most = int(reply.get("maximum", 0))
                raise LimitTooHigh(
                    f"limits.memory_mb = {memory_mb}: this tenant's isolates hold {reply.get('reserved_mb')} of "
                    f"their {reply.get('budget_mb')} MiB (one isolate host per tenant)",
                    limit="memory_mb",
                    value=memory_mb,
                    maximum=most,
                    source="the isolate tier's host per tenant",
                )
            raise SandboxStartError(f"the isolate host refused the sandbox: {reply.get('error')}", handle.sandbox_id)
        try:
            return await ready()
        except GuestConnectionError:
            raise SandboxStartError(
                "the isolate host did not answer on the sandbox's socket", handle.sandbox_id
            ) from None

    def _add(self, h: TenantHost, handle: BackendHandle, memory_mb: int) -> dict:
        """Hand the sandbox's listening socket to its host (under the host's shared lock: no idle
        stop meanwhile); record which host (and which start of it) holds the sandbox."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with self._locked(h, fcntl.LOCK_SH):
            if self._pid(h) is None or not h.control_path.exists():
                listener.close()
                return {"ok": False, "ended": True, "error": "the host ended before the sandbox was added"}
            with contextlib.suppress(FileNotFoundError):
                h.idle.unlink()  # in use again: its idle time starts over
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(handle.socket_path)
                listener.bind(handle.socket_path)
                os.chmod(handle.socket_path, 0o600)
                listener.listen(128)
                generation = h.read(h.generation)
                (Path(handle.state_dir) / "host.json").write_text(json.dumps({"host": h.key, "generation": generation}))
                try:
                    reply = self._control(
                        h, {"op": "add", "sandbox": handle.sandbox_id, "memory_mb": memory_mb}, listener.fileno()
                    )
                except OSError as e:
                    raise SandboxStartError(f"the isolate host did not answer: {e}", handle.sandbox_id) from None
            finally:
                listener.close()  # the host holds it now
            if "reserved_mb" in reply:
                h.reserved.write_text(str(int(reply["reserved_mb"])))
            return reply

    async def alive(self, handle: BackendHandle) -> bool:
        h = self._host_of(handle)
        if h is None:
            return False
        try:
            return bool(self._control(h, {"op": "has", "sandbox": handle.sandbox_id}).get("has"))
        except OSError:
            return False

    def netns_path(self, handle: BackendHandle) -> str:
        raise Unsupported(
            "an isolate has no network namespace (network='none' only)", self.tier, "no network APIs in an isolate"
        )

    async def usage(self, handle: BackendHandle) -> ResourceUsage:
        h = self._host_of(handle)
        try:
            r = self._control(h, {"op": "usage", "sandbox": handle.sandbox_id}) if h is not None else {}
        except OSError:
            r = {}
        if not r.get("ok"):
            return ResourceUsage(oom_kills=0, memory_bytes=0, cpu_ns=0)
        return ResourceUsage(
            oom_kills=int(r.get("oom_kills", 0)),
            memory_bytes=int(r.get("memory_bytes", 0)),
            cpu_ns=int(r.get("cpu_ns", 0)),
        )

    async def oom_kills(self, handle: BackendHandle) -> int:
        return (await self.usage(handle)).oom_kills

    async def destroy(self, handle: BackendHandle) -> None:
        """Dispose the sandbox's isolate (closing its socket and connections) and remove its state dir."""
        h = self._host_of(handle)
        if h is not None and h.control_path.exists():
            try:
                reply = self._control(h, {"op": "remove", "sandbox": handle.sandbox_id})
            except OSError:
                reply = {"ok": self._pid(h) is None}  # no host: nothing of the sandbox runs
            if not reply.get("ok"):
                raise SandboxError(f"the isolate host did not remove the sandbox: {reply}", handle.sandbox_id)
            if "reserved_mb" in reply:
                with contextlib.suppress(OSError):
                    h.reserved.write_text(str(int(reply["reserved_mb"])))
        shutil.rmtree(handle.state_dir, ignore_errors=True)

    def sandbox_pids(self, sandbox_id: str) -> list[int]:
        """No process of its own: an isolate is a thread's work in its tenant's host."""
        return []


if __name__ == "__main__":  # scripts/bootstrap install
    print(install())
