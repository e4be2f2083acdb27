"""Tier 3: the container tier's OCI bundle run by gVisor's ``runsc`` — a user-space kernel.

Same image, namespaces, cgroups, mounts and guest agent as Tier 2; the syscalls of the code
inside are served by gVisor's Sentry, not the host kernel (``uname`` says 4.4.0, ``dmesg``
"Starting gVisor..."). Decisions, each forced by this host's runsc (Debian 0.0~20221219; Debian
13's 0.0~20240729, which scripts/bootstrap installs, runs with ``WARMBOX_RUNSC``: see ``find_runsc``):
- Platform by probing (``_platform_choice``): kvm on hardware KVM (the kvm platform hangs under this
  host's PVM ``/dev/kvm``), else systrap where ``runsc do`` runs on it (runsc 2024; 2022's has none),
  else ptrace; ``WARMBOX_RUNSC_PLATFORM`` overrides. ``warmbox doctor`` shows the version, the
  platform and why.
- What runsc 2024 changes, examined: coreutils' statx works without the shim (``stat /`` under
  ``runsc do``), it has ``--pass-fd`` (not ``--preserve-fds``) and ``--oci-seccomp``; the shim, the
  socket directory and the missing OCI profile are kept while runsc 2022 is the default.
- No ``--preserve-fds`` in this runsc, so the agent cannot inherit a host listener as on
  Tier 2. It listens on ``/run/agent.sock`` inside a per-sandbox bind-mounted directory
  (``--host-uds=create`` makes that a real host socket). The directory belongs to the sandbox
  user, so the host opens the socket with O_PATH|O_NOFOLLOW and checks it *is* a socket before
  connecting (a guest-planted symlink cannot redirect the host's connection).
- This runsc rejects ``AT_NO_AUTOMOUNT`` in statx with EINVAL, which glibc 2.36's coreutils
  always pass (``ls``/``stat``/``cp`` fail). The image preloads a 10-line shim
  (gvisor_statx.c, built with the host's gcc) that drops the flag; there are no automounts
  inside the sandbox, so nothing changes but that the call works.
- The OCI seccomp profile is not applied (``--oci-seccomp`` in this version cannot express
  Tier 2's profile): the Sentry itself is the syscall boundary and is seccomp-confined on the
  host by runsc.
- Network: ``--network=none`` (loopback only, in the Sentry) unless the engine prepared the
  sandbox's namespace with its egress link (``SandboxSpec.netns``, ``link_before_start``): then
  ``--network=sandbox`` with that namespace in the OCI spec. runsc reads eth0's address and routes
  into its own netstack once, at ``run``/``restore`` (and takes the address off the host's eth0),
  so the Sentry's packets leave through that veth to the same egress proxy as Tier 2's; a restore
  reads its (new) namespace again, so a resumed or forked sandbox takes its new address. This
  runsc decides "am I in the host's namespace?" by whether /proc/sys/net/core/rmem_default exists,
  which kernels since 6.x have in every namespace; ``run``/``restore`` therefore run in a mount
  namespace of their own with an empty tmpfs over that directory of the sandbox's namespace
  (``_in_netns``). Nothing else reads it; every other runsc command is unaffected.
- ``limits.pids`` is enforced by the Sentry's own pids controller, not by the host cgroup: the
  first process is ``wb-init --confine`` (root of the Sentry with five capabilities there, none on
  the host), which mounts that controller at /sys/fs/cgroup, joins a cgroup of ``limits.pids``,
  becomes the sandbox user and execs the agent. A fork or clone past the limit gets EAGAIN inside,
  as on Tier 2. The host cgroup bounds the Sentry's own host threads, the gofer and the platform's
  stubs (``host_pids``): counted against ``limits.pids``, a pipeline at 128 made the Go runtime or
  the ptrace platform fail to start a thread, which ends the whole sandbox.
- Teardown kills the Sentry, gofer and stubs through their cgroup and removes runsc's record of the
  stopped sandbox itself (``delete_container``): ``runsc delete`` waits until the host's init has
  reaped them, which took 1.2-1.7 s here.
Memory snapshots: ``runsc checkpoint`` (the sandbox exits; processes, memory, /tmp and
/home/user are in its image) after the agent dropped its host sockets (Quiesce), and ``runsc
restore`` into a new bundle; /workspace (a host directory) travels beside the image. A TCP
connection over the sandbox's link (loopback ones are saved) fails runsc 2022's save, which ends
the sandbox: the engine looks in the guest's /proc/net/tcp first and refuses the pause, typed, with
the sandbox running (``Capabilities.checkpoint_saves_connections``). runsc 2024 runs with
``--net-disconnect-ok``: its save resets such connections, and the pause ends paused.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import glob
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar, TypeVar

from warmbox.backends import _host as host
from warmbox.backends import hostfs
from warmbox.backends._host import GUEST_GID, GUEST_UID
from warmbox.backends.base import Availability, BackendHandle, Capabilities, SandboxSpec
from warmbox.backends.runc import GUEST_LIB, SANDBOX_ID, RuncBackend, agent_command, build_image
from warmbox.errors import SandboxError, SandboxStartError, SandboxTimeout
from warmbox.models import ImageRef

T = TypeVar("T")
SOCKET_DIR = "/run"
SHIM = "/opt/warmbox/statx_shim.so"
_SHIM_SOURCE = Path(__file__).with_name("gvisor_statx.c")
START_TIMEOUT_S = 60.0
PROBE_FILE = "runsc-platform.json"  # the probe's result, in the runtime dir (GvisorBackend.platform)
PROBE_TIMEOUT_S = 30.0  # the systrap probe (one ``runsc do``: 0.3 s on this host, idle)
# where scripts/bootstrap installs Debian 13's runsc (0.0~20240729: systrap; Debian 12's has ptrace only)
RUNSC_LOCAL = "/usr/local/lib/warmbox/runsc"
LEGACY_RUNSC_VERSION = "0.0~20221219.0"  # Debian 12's: what made memory snapshots recorded without one
DISCONNECT_OK = "net-disconnect-ok"  # runsc 2024: a checkpoint resets open connections, not fails on them
CHECKPOINT_TIMEOUT_S = 180.0  # ``runsc checkpoint`` of a sandbox at its memory limit: seconds, never this
SIGNAL_TIMEOUT_S = 30.0  # ``runsc kill``
CHECKPOINT_ERR_MAX = 64 * 1024  # bytes of a failed ``runsc checkpoint``'s stderr kept (in agent.log)
INIT = GUEST_LIB + "/warmbox/guest/wb-init"  # its --confine mode starts the agent (guest/init.c)
# what the first process holds, in the Sentry only, until it has confined itself and become the
# sandbox user (wb-init --confine); the host sees none of them
CONFINE_CAPABILITIES = ["CAP_SYS_ADMIN", "CAP_DAC_OVERRIDE", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"]


# The host pids cgroup's bound (host_pids). Measured on this host (runsc 2022, ptrace, 2 cores): an
# idle sandbox is 70 host tasks, 125 after a pipeline and 216 Python threads; each process the
# sandbox starts costs 8-10 (its stub process, stub threads, a Sentry thread). A Python fork bomb
# reached limits.pids = 128 after 5.4 s with 2206 host tasks, 256 after 6 s with 2647, and held
# there by the Sentry's pids cgroup it still adds 300-550 host tasks a second: ptrace gives every
# address space a stub thread per Sentry thread that ever ran it, and keeps released stubs with
# their threads for reuse. A bomb that runs on crosses any bound (a shell bomb at 256: after ~30 s), and
# the sandbox is lost; nothing else is.
SENTRY_PIDS = 512
PIDS_PER_TASK = 32
HOST_SHARE = 4  # at most a quarter of the host's pids (the default [limits] max_pids of one sandbox)

# what a syscall loop costs against the host per runsc platform (declared; a measured profile wins).
# `warmbox bench profile` (geometric mean of fork, files, socket; against the host in the same run) on
# this 2-core PVM host at load 4-6: runsc 2024 systrap 27-31x (once 15x; fork 50-75x, files 22x,
# socket 19-23x), runsc 2024 ptrace 24x (fork 25x), runsc 2022 ptrace 29x. An os.stat loop in `runsc
# do` at the same load: systrap 2.8-3.3 s, ptrace 3.2-3.5 s, host 0.17-0.24 s per 100,000 (at a
# quieter moment systrap was 0.91 s): systrap's stub hand-off needs the Sentry scheduled at once,
# which a loaded 2-CPU nested host does not give. kvm: not measurable here (no hardware KVM).
# Again at load 11-12 (two runs each): runsc 2022 ptrace 31-32x (fork 34-40x, files 34-35x, socket
# 24-25x), runsc 2024 ptrace 31x, systrap 33-39x (fork 81-112x). ptrace is declared as Debian 12's
# runsc, the default (find_runsc), measures it: 29-32x; systrap (runsc 2024) across both loads: 27-39x,
# no cheaper than ptrace on this host.
_SYSCALL_SLOWDOWN = {"ptrace": 30.0, "systrap": 33.0, "kvm": 3.0}


def host_pids(pids: int) -> int:
    """The host pids cgroup's bound for a sandbox whose ``limits.pids`` is ``pids``.

    ``limits.pids`` is enforced inside, by the Sentry's own pids controller (``wb-init --confine``):
    the sandbox's processes get EAGAIN there. The host cgroup holds what serves them: the Sentry's
    threads, the gofer and the platform's stub processes and threads, none of which may ever fail to
    start (the Go runtime or the platform then panics and the sandbox is lost). It is bounded all
    the same, so that one sandbox cannot take the host's pids: by a quarter of them, unless
    ``limits.pids`` itself is above that (an admin's ``[limits] max_pids``)."""
    return max(pids + SENTRY_PIDS, min(SENTRY_PIDS + PIDS_PER_TASK * pids, host.host_pids() // HOST_SHARE))


def find_runsc() -> str:
    """The runsc the tier runs: ``WARMBOX_RUNSC`` if set (``RUNSC_LOCAL``: Debian 13's, which
    scripts/bootstrap installs), else the one on ``PATH`` (Debian 12's).

    Debian 13's runsc (0.0~20240729) is not the default: its Sentry cannot hold ``limits.pids``.
    Every task there is in seven cgroup hierarchies (runsc mounts one per controller at boot), and a
    fork charges only the first of its parent's cgroups that Go's randomised map iteration yields
    (``Task.chargeLocked``): about one fork in eight reaches the pids controller, the rest start
    uncharged (measured: 267 of 300 forks past a pids.max of 20; upstream unchanged as of 2026-08).
    Nor can the host's pids cgroup stand in: on systrap a stub the Sentry cannot clone at that bound
    panics it ("unable to activate mm: createStub"), and the sandbox is lost at its limit.
    tests/backends/test_gvisor.py keeps a test that shows both."""
    forced = os.environ.get("WARMBOX_RUNSC")
    if forced:
        return forced
    return shutil.which("runsc") or "runsc"


@functools.cache
def runsc_version(runsc: str) -> str:
    """``runsc --version``'s version (``0.0~20240729.0``), "" if it does not answer (cached per path)."""
    try:
        out = subprocess.run([runsc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    for line in out.splitlines():
        if line.startswith("runsc version "):
            return line.removeprefix("runsc version ").strip()
    return ""


@functools.cache
def runsc_flags(runsc: str) -> frozenset[str]:
    """The global flags ``runsc flags`` lists (``net-disconnect-ok``), none if it does not answer
    (cached per path)."""
    try:
        r = subprocess.run([runsc, "flags"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    out = r.stdout + r.stderr  # runsc prints them on stderr
    return frozenset(line.split()[0][1:] for line in out.splitlines() if line.startswith("  -") and line.split())


@functools.cache
def _systrap_probe(runsc: str) -> tuple[bool, str]:
    """Whether ``runsc --platform=systrap do /bin/true`` succeeds on this host (once per process and
    runsc): systrap needs seccomp's user-notify return and a runsc that has it (2022's has not)."""
    with tempfile.TemporaryDirectory(prefix="wb-runsc-probe-") as d:
        try:
            r = subprocess.run(
                [runsc, "--root", d, "--platform=systrap", "--network=none", "do", "/bin/true"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return False, f"systrap probe timed out after {PROBE_TIMEOUT_S:.0f} s"
        except OSError as e:
            return False, f"systrap probe could not run runsc: {e.strerror or e}"
    if r.returncode == 0:
        return True, "systrap probe (runsc do /bin/true) succeeded"
    tail = (r.stderr.strip().splitlines() or ["no output"])[-1][-160:]
    return False, f"systrap probe failed (exit {r.returncode}: {tail})"


def _platform_choice(runsc: str) -> tuple[str, str]:
    """(platform, why): ``WARMBOX_RUNSC_PLATFORM`` if set; kvm on real hardware KVM; else systrap if
    the probe runs it, ptrace otherwise.

    kvm is decided by looking, not by trying: under PVM (``kvm_pvm``, paravirtual nested KVM, as on
    this host) or without /dev/kvm, runsc's kvm platform hangs instead of failing.
    """
    forced = os.environ.get("WARMBOX_RUNSC_PLATFORM")
    if forced:
        return forced, "WARMBOX_RUNSC_PLATFORM"
    if os.path.exists("/dev/kvm") and not os.path.isdir("/sys/module/kvm_pvm"):
        try:
            flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            flags = ""
        if " vmx" in flags or " svm" in flags:
            return "kvm", "hardware KVM"
    ok, why = _systrap_probe(runsc)
    return ("systrap" if ok else "ptrace"), f"no hardware KVM; {why}"


def _platform(runsc: str | None = None) -> str:
    return _platform_choice(runsc or find_runsc())[0]


class GvisorBackend(RuncBackend):
    """Tier 3 (``gvisor``): runsc, ptrace platform, the Tier 2 bundle minus host-kernel syscalls."""

    tier: ClassVar[str] = "gvisor"
    legacy_runtime: ClassVar[str] = "runsc " + LEGACY_RUNSC_VERSION
    template_warmup: ClassVar[tuple[tuple[str, ...], ...]] = ()  # the template's own warm-up is enough

    def __init__(self, runtime: Path, runsc: str | None = None) -> None:
        super().__init__(runtime)
        self.runsc = runsc or find_runsc()
        self.root = runtime / "runsc"

    def platform(self) -> tuple[str, str]:
        """(runsc platform, why it was chosen), probed once per runsc binary and kernel; the result
        is kept in the runtime dir for ``known_platform`` (no runsc is started there)."""
        key = self._probe_key()
        known = self._read_probe(key)
        if known is not None:
            return known
        got = _platform_choice(self.runsc)
        if not os.environ.get("WARMBOX_RUNSC_PLATFORM"):
            self._write_probe(key, got)
        return got

    def known_platform(self) -> tuple[str, str]:
        """The platform without starting runsc (``capabilities``: the tier selector asks it often):
        the override, hardware KVM, or the probe's kept result; ptrace before any probe ran here
        (the slowest, so no cost is understated)."""
        forced = os.environ.get("WARMBOX_RUNSC_PLATFORM")
        if forced:
            return forced, "WARMBOX_RUNSC_PLATFORM"
        return self._read_probe(self._probe_key()) or ("ptrace", "platform not probed yet (warmbox doctor probes it)")

    def _probe_key(self) -> str:
        """What the probe's result depends on: the runsc binary (path, size, mtime) and the kernel."""
        path = shutil.which(self.runsc) or self.runsc
        try:
            st = os.stat(path)
        except OSError:
            return ""
        return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{os.uname().release}"

    def _read_probe(self, key: str) -> tuple[str, str] | None:
        forced = os.environ.get("WARMBOX_RUNSC_PLATFORM")
        if forced:
            return forced, "WARMBOX_RUNSC_PLATFORM"
        try:
            data = json.loads((self.runtime / PROBE_FILE).read_bytes())
            if (
                key
                and data["key"] == key
                and data["platform"] in ("systrap", "ptrace", "kvm")
                and DISCONNECT_OK in data
            ):
                return str(data["platform"]), str(data["why"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def _write_probe(self, key: str, got: tuple[str, str]) -> None:
        if not key:
            return
        try:
            self.runtime.mkdir(parents=True, exist_ok=True)
            tmp = self.runtime / f".{PROBE_FILE}.{os.getpid()}"
            flag = DISCONNECT_OK in runsc_flags(self.runsc)
            tmp.write_text(json.dumps({"key": key, "platform": got[0], "why": got[1], DISCONNECT_OK: flag}))
            os.replace(tmp, self.runtime / PROBE_FILE)
        except OSError:
            pass

    def version(self) -> str:
        """This runsc's version ("" if it does not answer)."""
        return runsc_version(self.runsc)

    def runtime_version(self) -> str:
        """What a memory snapshot records: a runsc image loads only into the runsc that made it."""
        return f"runsc {self.version() or 'unknown'}"

    def disconnects_on_save(self) -> bool:
        """Whether this runsc resets the sandbox's TCP connections over its link when it checkpoints
        (``--net-disconnect-ok``, runsc 2024), where runsc 2022 fails the save and the sandbox with it
        (the engine then refuses such a pause up front: Capabilities.checkpoint_saves_connections).
        Read from what the probe kept, so capabilities start no runsc; False before it ran here (or
        with WARMBOX_RUNSC_PLATFORM): the pause then looks for open connections first, never wrong."""
        try:
            data = json.loads((self.runtime / PROBE_FILE).read_bytes())
            return bool(data["key"] == self._probe_key() and data.get(DISCONNECT_OK) is True)
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def capabilities(self) -> Capabilities:
        platform = self.known_platform()[0]
        return Capabilities(
            tier=self.tier,
            isolation=f"gVisor user-space kernel (Sentry, {platform} platform) + gofer for files; Linux namespaces "
            "and cgroups around it; the host kernel sees only the Sentry's syscalls; limits.pids is the Sentry's own "
            "pids cgroup (EAGAIN past it), the host's bounds the Sentry's threads and stubs",
            memory_snapshot=True,
            filesystem_snapshot=True,
            custom_kernel=False,
            network_modes=("none", "allowlist", "internet"),
            languages=("python", "node", "shell", "c", "git"),
            start_class="100ms-1s",
            checkpoint_saves_workspace_sockets=False,
            checkpoint_saves_connections=self.disconnects_on_save(),
            quiesce_drops_connection=True,
            root_user=True,
            isolation_rank=2,
            syscall_slowdown=_SYSCALL_SLOWDOWN.get(platform, 20.0),
            cost_note=f"platform {platform}: the Sentry serves every syscall"
            + (", each after two ptrace stops" if platform == "ptrace" else ""),
            start_ms=1000.0,
            link_before_start=True,  # runsc reads the sandbox's interfaces once, when it starts
        )

    def probe(self) -> Availability:
        path = shutil.which(self.runsc) if not os.path.isabs(self.runsc) else self.runsc
        if not path or not os.access(path, os.X_OK):
            return Availability(False, "runsc is not installed (apt-get install runsc)")
        if os.geteuid() != 0:
            return Availability(False, "needs root (runsc creates namespaces and cgroups)")
        if not shutil.which("gcc") and not self._shim_built():
            return Availability(False, "needs gcc once, to build the statx shim this runsc requires")
        platform, why = self.known_platform()
        return Availability(True, f"runsc at {path}, platform {platform} ({why})")

    def diagnose(self) -> Availability:
        """``probe`` plus what starts runsc (``warmbox doctor``): its version, and the platform the
        probe chose and why (the probe runs here if it has not on this host yet)."""
        avail = self.probe()
        if not avail.available:
            return avail
        platform, why = self.platform()
        path = shutil.which(self.runsc) or self.runsc
        return Availability(
            True, f"runsc {self.version() or '(unknown version)'} at {path}, platform {platform} ({why})"
        )

    # ---- image

    def _shim_built(self) -> bool:
        return any((d / SHIM.lstrip("/")).exists() for d in (self.runtime / "images").glob("gvisor-*"))

    def flavour(self) -> tuple[str, bytes, Callable[[Path], None] | None]:
        """An image sandbox's agent layer gets the statx shim too (this runsc needs it whatever the image)."""
        return "gvisor", _SHIM_SOURCE.read_bytes(), self._add_shim

    def build_rootfs(self) -> Path:
        variant = "gvisor:" + hashlib.sha256(_SHIM_SOURCE.read_bytes()).hexdigest()[:12]
        return build_image(self.runtime / "images", variant, self._add_shim)

    @staticmethod
    def _add_shim(root: Path) -> None:
        out = root / SHIM.lstrip("/")
        out.parent.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["gcc", "-O2", "-shared", "-fPIC", "-Wall", "-o", str(out), str(_SHIM_SOURCE)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if r.returncode != 0:
            raise SandboxStartError(f"building the statx shim failed: {r.stderr.strip()[-300:]}")
        os.chmod(out, 0o755)
        (root / "etc" / "ld.so.preload").write_text(SHIM + "\n")

    def template_fingerprint(self, image: ImageRef | None = None) -> str:
        """A template's memory image holds a running guest agent: it restores only into the same
        root (the built-in image's name is the hash of the agent's sources and the shim; an
        image's root is its layers under this tier's agent layer), by the same runsc version."""
        root = self.image().name if image is None else self.image_fingerprint(image)
        return f"{root}:runsc-{self.version()}"

    # ---- lifecycle

    def agent_argv(self) -> list[str]:
        """The agent binds its own socket (this runsc has no ``--preserve-fds``)."""
        return agent_command([SOCKET_DIR + "/agent.sock"])

    def config(self, spec: SandboxSpec, rootfs: Path, workspace: Path) -> dict:
        cfg = super().config(spec, rootfs, workspace)
        cfg["mounts"].append(
            {
                "destination": SOCKET_DIR,
                "type": "bind",
                "source": str(Path(spec.state_dir) / "run"),
                "options": ["bind", "rw"],
            }
        )
        cfg["linux"].pop("seccomp", None)
        cfg["linux"]["resources"]["pids"]["limit"] = host_pids(spec.limits.pids)
        # the first process confines the sandbox to limits.pids inside, then becomes the sandbox
        # user and execs the agent (the spec's user: what it becomes; gVisor-only capabilities)
        process = cfg["process"]
        uid, gid = process["user"]["uid"], process["user"]["gid"]
        process["args"] = [INIT, "--confine", str(spec.limits.pids), str(uid), str(gid), *process["args"]]
        process["user"] = {"uid": 0, "gid": 0, "additionalGids": []}
        process["capabilities"] = {
            k: (CONFINE_CAPABILITIES if k in ("bounding", "effective", "permitted") else [])
            for k in ("bounding", "effective", "inheritable", "permitted", "ambient")
        }
        return cfg

    def _global(self, network: str = "none") -> list[str]:
        """runsc's global flags (``network`` matters to ``run`` and ``restore`` only)."""
        return [
            self.runsc,
            "--root",
            str(self.root),
            f"--platform={self.platform()[0]}",
            f"--network={network}",
            "--host-uds=create",
            *([f"--{DISCONNECT_OK}"] if DISCONNECT_OK in runsc_flags(self.runsc) else []),
        ]

    async def create(self, spec: SandboxSpec) -> BackendHandle:
        handle = await super().create(spec)
        run = Path(spec.state_dir) / "run"
        # the agent (sandbox uid 1000) creates its socket here; no one else may enter
        os.chown(run, spec.uid_base + GUEST_UID, spec.uid_base + GUEST_GID)
        os.chmod(run, 0o700)
        return BackendHandle(
            sandbox_id=handle.sandbox_id,
            tier=self.tier,
            runtime_id=handle.runtime_id,
            state_dir=handle.state_dir,
            socket_path=handle.socket_path,
            uid_base=handle.uid_base,
        )

    async def start(self, handle: BackendHandle, ready: Callable[[], Awaitable[T]]) -> T:
        state = Path(handle.state_dir)
        await self._detached(handle, "run", ["run", "--detach", "--bundle", str(state / "bundle"), handle.runtime_id])
        return await self._await_agent(handle, ready)

    def netns_path(self, handle: BackendHandle) -> str:
        """The namespace the engine prepared for the sandbox (the path in its OCI spec)."""
        ns = self._prepared_netns(handle)
        if not ns:
            raise SandboxError(f"sandbox {handle.sandbox_id} was started without a network link", handle.sandbox_id)
        return ns

    @staticmethod
    def _prepared_netns(handle: BackendHandle) -> str:
        """The network namespace path in the sandbox's bundle ("" : runsc's own, ``--network=none``)."""
        try:
            cfg = json.loads((Path(handle.state_dir) / "bundle" / "config.json").read_bytes())
            for ns in cfg["linux"]["namespaces"]:
                if ns.get("type") == "network":
                    path = ns.get("path", "")
                    return path if isinstance(path, str) else ""
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return ""

    def _in_netns(self, netns: str, argv: list[str]) -> list[str]:
        """``argv`` (a ``runsc --network=sandbox run|restore``) in a mount namespace of its own
        where the sandbox namespace's /proc/sys/net/core is an empty tmpfs: this runsc's root-
        namespace test (``access("/proc/sys/net/core/rmem_default")``) then sees what it expects
        of a non-root namespace. /proc/sys/net is looked up per network namespace, so the tmpfs is
        mounted from inside ``netns``. That mount makes /proc not "fully visible", and the Sentry,
        in the sandbox's user namespace, may mount a procfs only where one is: a second, untouched
        procfs is mounted beside it (runsc-proc/, in that mount namespace only). Host mounts still
        propagate in (slave)."""
        proc = self.runtime / "runsc-proc"
        proc.mkdir(mode=0o700, exist_ok=True)
        script = (
            'mount -t proc -o nosuid,nodev,noexec proc "$1"\n'
            'nsenter --net="$0" mount -t tmpfs -o size=4k,mode=0555 warmbox-nocore /proc/sys/net/core\n'
            "shift\n"
            'exec "$@"'
        )
        return ["unshare", "--mount", "--propagation", "slave", "--", "sh", "-ec", script, netns, str(proc), *argv]

    async def _detached(self, handle: BackendHandle, what: str, args: list[str]) -> None:
        """``runsc run|restore --detach``; stdio to the sandbox's log file (with pipes, the
        detached sandbox would hold them open forever). In the prepared network namespace, if any."""
        state = Path(handle.state_dir)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        netns = self._prepared_netns(handle)
        argv = [*self._global("sandbox" if netns else "none"), f"--panic-log={state / 'panic.log'}", *args]
        if netns:
            argv = self._in_netns(netns, argv)
        log = os.open(state / "agent.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            # a Sentry panic goes to panic.log, kept with agent.log after the sandbox is gone
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        finally:
            os.close(log)
        rc = await asyncio.wait_for(proc.wait(), START_TIMEOUT_S)
        if rc != 0:
            raise SandboxStartError(
                f"runsc {what} failed (exit {rc}): {host.tail(state / 'agent.log')}", handle.sandbox_id
            )

    async def _await_agent(self, handle: BackendHandle, ready: Callable[[], Awaitable[T]]) -> T:
        sock = Path(handle.socket_path)

        async def stopped() -> bool:
            return not await self.alive(handle)  # ``runsc state``: a process, so asked every 100 polls

        # run/ is the guest's: look at the socket itself, never through a planted symlink
        return await host.wait_for_agent(
            ready,
            lambda: hostfs.is_socket(sock.parent, sock.name),
            stopped,
            lambda: host.tail(Path(handle.state_dir) / "agent.log"),
            where="gVisor",
            sandbox_id=handle.sandbox_id,
            timeout=START_TIMEOUT_S,
            check_every=100,
        )

    async def checkpoint(self, handle: BackendHandle, image_dir: Path) -> Path:
        """Save the sandbox's processes and memory to ``image_dir``; the sandbox exits."""
        proc = await asyncio.create_subprocess_exec(
            *self._global(),
            "checkpoint",
            f"--image-path={image_dir}",
            handle.runtime_id,
            stdin=subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        err = await host.communicate(proc, CHECKPOINT_TIMEOUT_S)
        if err is None:
            raise SandboxTimeout(f"runsc checkpoint did not end within {CHECKPOINT_TIMEOUT_S:g} s", handle.sandbox_id)
        image = image_dir / "checkpoint.img"
        if proc.returncode != 0 or not image.is_file():
            text = err[:CHECKPOINT_ERR_MAX].decode(errors="replace")
            self._log_failure(handle, "checkpoint", text)
            raise SandboxStartError(f"runsc checkpoint failed: {host.failure_excerpt(text)}", handle.sandbox_id)
        return image

    @staticmethod
    def _log_failure(handle: BackendHandle, what: str, text: str) -> None:
        """Append runsc's whole (bounded) failure output to the sandbox's agent.log, which is kept
        after the sandbox is gone (``runtime_logs``): a Go panic's full stack, beyond the excerpt
        in the error. agent.log is host-only (state/, not run/); opened without following links."""
        clean = "".join(c if c.isprintable() or c in "\n\t" else "?" for c in text)
        try:
            fd = os.open(Path(handle.state_dir) / "agent.log", os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        try:
            os.write(fd, f"\n--- runsc {what} failed ---\n{clean}\n".encode(errors="replace"))
        except OSError:
            pass
        finally:
            os.close(fd)

    async def resume_listening(self, handle: BackendHandle) -> None:
        """Tell a quiesced agent to listen again: a new, empty ``resume`` file next to its socket.

        run/ is writable by the sandbox (it is the guest's /run), so the file is created as a new
        inode relative to the directory's fd (O_CREAT|O_EXCL|O_NOFOLLOW) and given to the sandbox
        user with fchown on that fd (gVisor lets the agent remove only its own files there); a
        name the guest planted there (a symlink to a host file, say) is unlinked, never opened.
        """
        # the agent waits (quiesced) until told: its old socket's host file can go first
        self._clear_socket(handle)
        await self._trigger(handle)

    def _clear_socket(self, handle: BackendHandle) -> None:
        """Remove the quiesced agent's old socket and any old ``resume`` file from run/ (the entries
        themselves, by the directory's fd). The old socket's host file outlives the agent's unlink
        through the gofer and would make its new bind fail; an old trigger would make the next
        quiesced agent listen again at once. Only while the agent waits for its trigger (or is not
        running): a socket it has bound again must never be removed (the host would not see it)."""
        run = Path(handle.state_dir) / "run"
        try:
            for name in (Path(handle.socket_path).name, "resume"):
                hostfs.remove_entry(run, name)
        except OSError as e:
            raise SandboxStartError(
                f"cannot tell the agent to listen again: {e.strerror or e}", handle.sandbox_id
            ) from None

    async def _trigger(self, handle: BackendHandle) -> None:
        """The ``resume`` file and SIGUSR1 (see resume_listening)."""
        run = Path(handle.state_dir) / "run"
        try:
            hostfs.create_marker(run, "resume", handle.uid_base + GUEST_UID, handle.uid_base + GUEST_GID)
        except OSError as e:
            raise SandboxStartError(
                f"cannot tell the agent to listen again: {e.strerror or e}", handle.sandbox_id
            ) from None
        # and a signal: gVisor may have cached run/ without the file (a negative dentry)
        proc = await asyncio.create_subprocess_exec(
            *self._global(),
            "kill",
            handle.runtime_id,
            "USR1",
            stdin=subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        err = await host.communicate(proc, SIGNAL_TIMEOUT_S)
        if err is None:
            raise SandboxStartError(
                f"cannot signal the agent to listen again: runsc kill took over {SIGNAL_TIMEOUT_S:g} s",
                handle.sandbox_id,
            )
        if proc.returncode != 0:
            raise SandboxStartError(
                f"cannot signal the agent to listen again: {err.decode(errors='replace').strip()[-300:]}",
                handle.sandbox_id,
            )

    async def restore(self, handle: BackendHandle, image_dir: Path, ready: Callable[[], Awaitable[T]]) -> T:
        """Continue a checkpointed sandbox in this bundle (freshly created, or its own after a
        pause that could not be stored: the stopped container is deleted first)."""
        state = Path(handle.state_dir)
        if self._recorded(handle):  # what the pause left: a stopped sandbox, its cgroups
            cgroup = host.SandboxCgroup(handle.sandbox_id)
            await cgroup.kill_and_wait()
            await self.delete_container(handle)
            if not cgroup.try_remove():
                await asyncio.to_thread(cgroup.remove)
        # before the restore: once restored, the agent may bind its socket again before it is told
        # to (an image of an older agent, woken by a SIGUSR1 of an earlier resume), and removing the
        # socket then would leave it listening where the host never looks (seen: 1 resume in ~10)
        self._clear_socket(handle)
        await self._detached(
            handle,
            "restore",
            ["restore", "--detach", f"--image-path={image_dir}", "--bundle", str(state / "bundle"), handle.runtime_id],
        )
        await self._trigger(handle)
        return await self._await_agent(handle, ready)

    def _state(self, handle: BackendHandle) -> dict | None:
        try:
            out = subprocess.run(
                [*self._global(), "state", handle.runtime_id], capture_output=True, text=True, timeout=10
            )
            return json.loads(out.stdout) if out.returncode == 0 else None
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None

    async def alive(self, handle: BackendHandle) -> bool:
        st = await asyncio.to_thread(self._state, handle)
        pid = (st or {}).get("pid")
        if not isinstance(pid, int) or pid <= 0 or (st or {}).get("status") == "stopped":
            return False
        return host.running(pid)

    def runtime_argv(self) -> list[str]:
        return self._global()

    def _state_files(self, handle: BackendHandle) -> tuple[Path, Path]:
        """runsc's record of the sandbox: ``<container>_sandbox:<sandbox>.state`` and its ``.lock``
        (runsc/container/state_file.go); the one container is the sandbox's root, of the same id."""
        stem = f"{handle.runtime_id}_sandbox:{handle.runtime_id}"
        return self.root / f"{stem}.state", self.root / f"{stem}.lock"

    def held(self) -> set[str]:
        """Ids of the sandboxes runsc has a record of (``Inventory``): ``<id>_sandbox:<id>.state``."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return set()
        return {n.partition("_")[0] for n in names if SANDBOX_ID.fullmatch(n.partition("_")[0])}

    def _recorded(self, handle: BackendHandle) -> set[Path]:
        return set(self.root.glob(glob.escape(handle.runtime_id) + "*")) if self.root.is_dir() else set()

    async def delete_container(self, handle: BackendHandle) -> None:
        """Forget the sandbox whose processes are gone (``destroy`` killed and waited for them):
        runsc's state and lock files, removed under runsc's own lock, which is all ``runsc delete``
        does for a sandbox without hooks once its Sentry and gofer have exited. runsc itself first
        waits, in 100 ms steps, until the host's init has reaped them (it asks kill(pid, 0), which a
        zombie answers): 1.2-1.7 s on this host, whose init reaps every ~2 s. Anything unexpected
        (the lock held, another file of the sandbox, a hook, a Sentry or gofer still running, an
        unreadable record) goes to ``runsc delete --force``."""
        if not self._recorded(handle) or self._forget(handle):
            return
        rc, err = await self.runtime_cmd(handle, "delete", "--force", handle.runtime_id)
        if rc != 0 and self._recorded(handle):
            raise SandboxError(f"runsc delete failed: {err[-300:]}", handle.sandbox_id)

    def _forget(self, handle: BackendHandle) -> bool:
        """``runsc delete`` of a stopped sandbox without its wait for init; False (nothing changed) when
        the sandbox is not exactly that."""
        state, lock = self._state_files(handle)
        if self._recorded(handle) != {state, lock}:
            return False
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # runsc holds it while it works on the sandbox
            record = json.loads(state.read_bytes())
            pids = (record["sandbox"]["pid"], record["goferPid"])
            if (
                record["spec"].get("hooks")
                or not all(isinstance(p, int) for p in pids)
                or any(p > 0 and host.running(p) for p in pids)
            ):
                return False
            state.unlink()
            lock.unlink()  # as runsc does: the lock file goes last, while held
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        finally:
            os.close(fd)
        return True
