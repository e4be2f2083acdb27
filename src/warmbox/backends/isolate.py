"""Tier 1: a V8 isolate per sandbox (isolated-vm), held by one jailed Node.js host process per runtime dir.

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

Layout: the host (``isolate_host/host.js``) runs in a runc container of its own -- user, pid, mount,
net, ipc, uts and cgroup namespaces, the container tier's seccomp filter, no capabilities,
no_new_privs, a read-only root with only /usr, the engine and the host script, and its own cgroup
with a memory bound -- so a V8 escape lands in a jail with no network and no host files. One host
per runtime dir (not per tenant: the isolate is the tenant boundary, the jail the second wall; a
host per tenant would cost ~45 MiB of Node.js each). The backend hands each sandbox's listening
socket (bound in the sandbox's root-only state dir) to the host over its control socket
(SCM_RIGHTS), and the engine's GuestSession then speaks the ordinary guest protocol to it: no
special path in the engine.

WebAssembly: ``run_code(module, language="wasm")``, the module as its text format or base64 of its
binary, each run in a fresh wasmtime store (``isolate_host/wasm_worker.py``, one Python worker the
host starts inside the same jail; wasmtime bind-mounted read-only): a WASI command's ``_start``
with its stdout/stderr as the run's, or a ``main()`` whose results are the text; epoch + fuel
limits (timeout), memories capped at the sandbox's memory_mb, WASI with no preopened directory
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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar, TypeVar

from warmbox import protocol
from warmbox.backends import _host as host
from warmbox.backends import seccomp
from warmbox.backends.base import Availability, BackendHandle, Capabilities, ResourceUsage, SandboxSpec
from warmbox.backends.runc import MASKED_PATHS, READONLY_PATHS
from warmbox.errors import GuestConnectionError, SandboxError, SandboxStartError, Unsupported
from warmbox.models import ISOLATE_UID_BASE, ISOLATE_UID_RANGE

T = TypeVar("T")

IVM_VERSION = "5.0.4"
# isolated-vm, built once per host by ``install`` (scripts/bootstrap install): root-owned, read-only
ENGINE_DIR = Path("/var/lib/warmbox") / f"isolated-vm-{IVM_VERSION}"
HOST_SOURCES = Path(__file__).resolve().parent / "isolate_host"
HOST_UID = 1000  # the host process's uid inside its user namespace (host uid: ISOLATE_UID_BASE + this)
HOST_MEMORY_MB = 4096  # the host process's cgroup: every isolate's heap together, plus Node.js (~45 MiB)
HOST_PIDS = 256  # Node.js and isolated-vm's threads
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


class IsolateBackend:
    """Tier 1 (``isolate``): a V8 isolate per sandbox in a jailed host process."""

    tier: ClassVar[str] = "isolate"
    runtime_logs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, runtime: Path, engine_dir: Path = ENGINE_DIR) -> None:
        self.runtime = runtime
        self.engine_dir = engine_dir
        self.dir = runtime / "isolate"
        self.control_path = self.dir / "ctl" / "control.sock"  # in a root-only directory
        self.runc_root = self.dir / "runc"
        # one host per runtime dir: its container and cgroup are named after it
        self.host_id = "isolate-" + hashlib.sha256(str(runtime.resolve()).encode()).hexdigest()[:12]

    # ---- description

    def capabilities(self) -> Capabilities:
        return Capabilities(
            tier=self.tier,
            isolation="a V8 isolate (isolated-vm) per sandbox, WebAssembly in wasmtime stores, in one host "
            "process jailed by Linux namespaces (user, pid, mount, net, ipc, uts, cgroup) + seccomp + cgroup, "
            "no capabilities",
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

    def host_config(self, root: Path, lib: Path) -> dict:
        """The OCI config of the host process's jail."""
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
                "uidMappings": [{"containerID": 0, "hostID": ISOLATE_UID_BASE, "size": ISOLATE_UID_RANGE}],
                "gidMappings": [{"containerID": 0, "hostID": ISOLATE_UID_BASE, "size": ISOLATE_UID_RANGE}],
                "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "cgroup", "user")],
                "cgroupsPath": host.SandboxCgroup(self.host_id).path,
                "resources": {
                    "devices": [{"allow": False, "access": "rwm"}],
                    "memory": {"limit": HOST_MEMORY_MB * mib, "swap": HOST_MEMORY_MB * mib},
                    "pids": {"limit": HOST_PIDS},
                },
                "maskedPaths": MASKED_PATHS,
                "readonlyPaths": READONLY_PATHS,
                "seccomp": seccomp.profile(),
            },
        }

    def _control(self, request: dict, fd: int | None = None, timeout: float = CONTROL_TIMEOUT_S) -> dict:
        """One control exchange with the host (OSError if it does not answer)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(self.control_path))
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

    def host_pid(self) -> int | None:
        """The host process's pid (None if it does not run)."""
        try:
            state = json.loads((self.runc_root / self.host_id / "state.json").read_text())
            pid = int(state["init_process_pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return pid if host.running(pid) else None

    def host_stats(self) -> dict | None:
        """{"sandboxes": n, "rss": bytes, "pid": its pid inside} of a running host; None without one."""
        try:
            reply = self._control({"op": "stats"}, timeout=2.0)
        except OSError:
            return None
        return reply if reply.get("ok") else None

    def ensure_host(self) -> None:
        """Start the host process unless it runs (under a lock: one per runtime dir)."""
        if self.host_stats() is not None:
            return
        self.dir.mkdir(mode=0o711, parents=True, exist_ok=True)  # the jail's root and lib are below
        self.control_path.parent.mkdir(mode=0o700, exist_ok=True)
        with open(self.dir / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.host_stats() is not None:
                return
            self._stop_container()
            lib = self._lib()
            root = self._root()
            bundle = self.dir / "bundle"
            bundle.mkdir(mode=0o700, exist_ok=True)
            (bundle / "config.json").write_text(json.dumps(self.host_config(root, lib)))
            with contextlib.suppress(FileNotFoundError):
                self.control_path.unlink()
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(str(self.control_path))
                os.chmod(self.control_path, 0o600)
                listener.listen(512)
                argv = [
                    shutil.which("runc") or "runc",
                    "--root",
                    str(self.runc_root),
                    "run",
                    "--detach",
                    "--preserve-fds",
                    "1",
                    "--bundle",
                    str(bundle),
                    self.host_id,
                ]
                pid = host.spawn(argv, self.dir / "host.log", [listener.fileno()])
            finally:
                listener.close()
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                raise SandboxStartError(f"runc failed to start the isolate host: {host.tail(self.dir / 'host.log')}")
            deadline = time.monotonic() + START_TIMEOUT_S
            while self.host_stats() is None:
                if time.monotonic() > deadline or self.host_pid() is None:
                    self._stop_container()
                    raise SandboxStartError(f"the isolate host did not come up: {host.tail(self.dir / 'host.log')}")
                time.sleep(0.005)

    def _stop_container(self) -> None:
        """Kill and delete the host's container and cgroup, whatever state they are in."""
        if (self.runc_root / self.host_id).exists():
            subprocess.run(
                [shutil.which("runc") or "runc", "--root", str(self.runc_root), "delete", "--force", self.host_id],
                capture_output=True,
                timeout=30,
                check=False,
            )
        cgroup = host.SandboxCgroup(self.host_id)
        if not cgroup.try_remove():
            cgroup.remove()

    def stop_host(self) -> None:
        """Stop the host process (every isolate sandbox in it ends) and remove its container and cgroup."""
        with contextlib.suppress(FileNotFoundError):
            self.control_path.unlink()
        self._stop_container()

    # ---- sandboxes

    async def create(self, spec: SandboxSpec) -> BackendHandle:
        if spec.build_upper or spec.volumes:
            raise Unsupported(
                "the isolate tier has no filesystem (no template builds, no volumes)",
                self.tier,
                "an isolate runs JavaScript with no file, network or process APIs",
            )
        state = Path(spec.state_dir)
        (state / "run").mkdir(mode=0o700, parents=True, exist_ok=True)  # the sandbox's socket: root only
        (state / "limits.json").write_text(json.dumps({"memory_mb": spec.limits.memory_mb}))
        return BackendHandle(
            sandbox_id=spec.sandbox_id,
            tier=self.tier,
            runtime_id=spec.sandbox_id,
            state_dir=str(state),
            socket_path=str(state / "run" / "agent.sock"),
            uid_base=spec.uid_base,
        )

    async def start(self, handle: BackendHandle, ready: Callable[[], Awaitable[T]]) -> T:
        """Make the sandbox's isolate in the host (started first if it does not run: in a thread)."""
        if self.host_stats() is None:
            await asyncio.to_thread(self.ensure_host)
        try:
            memory_mb = int(json.loads((Path(handle.state_dir) / "limits.json").read_text())["memory_mb"])
        except (OSError, ValueError, KeyError, TypeError):
            raise SandboxStartError("the sandbox's limits are gone", handle.sandbox_id) from None
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(handle.socket_path)
            listener.bind(handle.socket_path)
            os.chmod(handle.socket_path, 0o600)
            listener.listen(128)
            try:
                reply = self._control(
                    {"op": "add", "sandbox": handle.sandbox_id, "memory_mb": memory_mb}, listener.fileno()
                )
            except OSError as e:
                raise SandboxStartError(f"the isolate host did not answer: {e}", handle.sandbox_id) from None
        finally:
            listener.close()  # the host holds it now
        if not reply.get("ok"):
            raise SandboxStartError(f"the isolate host refused the sandbox: {reply.get('error')}", handle.sandbox_id)
        try:
            return await ready()
        except GuestConnectionError:
            raise SandboxStartError(
                "the isolate host did not answer on the sandbox's socket", handle.sandbox_id
            ) from None

    async def alive(self, handle: BackendHandle) -> bool:
        try:
            return bool(self._control({"op": "has", "sandbox": handle.sandbox_id}).get("has"))
        except OSError:
            return False

    def netns_path(self, handle: BackendHandle) -> str:
        raise Unsupported(
            "an isolate has no network namespace (network='none' only)", self.tier, "no network APIs in an isolate"
        )

    async def usage(self, handle: BackendHandle) -> ResourceUsage:
        try:
            r = self._control({"op": "usage", "sandbox": handle.sandbox_id})
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
        if self.control_path.exists():
            try:
                reply = self._control({"op": "remove", "sandbox": handle.sandbox_id})
            except OSError:
                reply = {"ok": self.host_pid() is None}  # no host: nothing of the sandbox runs
            if not reply.get("ok"):
                raise SandboxError(f"the isolate host did not remove the sandbox: {reply}", handle.sandbox_id)
        shutil.rmtree(handle.state_dir, ignore_errors=True)

    def sandbox_pids(self, sandbox_id: str) -> list[int]:
        """No process of its own: an isolate is a thread's work in the shared host."""
        return []


if __name__ == "__main__":  # scripts/bootstrap install
    print(install())
