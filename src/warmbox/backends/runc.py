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
import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar, TypeVar

from warmbox.backends import _host as host
from warmbox.backends import hostfs, rootfs, seccomp, volume_disk, workspace_disk
from warmbox.backends._host import (
    EGRESS_GATEWAY,
    GITCONFIG,
    GUEST_GID,
    GUEST_UID,
    build_spawn_helpers,
    tmpfs_sizes,
)
from warmbox.backends.base import Availability, BackendHandle, Capabilities, ResourceUsage, SandboxSpec
from warmbox.errors import GuestConnectionError, SandboxError, SandboxStartError, SandboxTimeout, Unsupported
from warmbox.models import LAYER_UID_BASE, ImageRef

T = TypeVar("T")
SANDBOX_ID = re.compile(r"sb-[0-9a-f]{12}")  # a sandbox id (runtime ids are sandbox ids)
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
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
]
# A build sandbox trusts what the host trusts for TLS (pip, npm, curl, git through an upstream that
# intercepts TLS, as some hosts' egress does): the host's CA bundle, bind-mounted read-only below the
# build's /run tmpfs (not into the image's own path: nothing of it enters the layer), named by the
# variables the common clients read.
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
BUILD_CA_PATH = "/run/warmbox/ca-certificates.crt"
BUILD_CA_ENV = (
    "SSL_CERT_FILE",
    "PIP_CERT",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
    "NODE_EXTRA_CA_CERTS",
)
# a build sandbox's root (of its user namespace) gets Docker's default capability set: apt-get, dpkg,
# useradd, chown and pip work as root, and nothing that could rearrange mounts or load anything
BUILD_CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]

_ETC_COPY = [
    "alternatives",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "os-release",
    "debian_version",
    "bash.bashrc",
    "inputrc",
    "profile",
    "protocols",
    "services",
    "host.conf",
    "gai.conf",
    "mime.types",
    "python3",
    "python3.11",
    "ssl/certs/ca-certificates.crt",
    "ssl/openssl.cnf",
    "fonts",
]
# the files of warmbox that run inside a sandbox (every tier's image holds them): every module of
# guest/ (the agent's parts, the kernels), found here so that a new part cannot be left out
GUEST_SOURCES = (
    "protocol.py",
    "safetar.py",
    *sorted(f"guest/{p.name}" for p in (Path(__file__).resolve().parent.parent / "guest").glob("*.py")),
    "guest/kernel.js",
    "guest/spawn.c",
    "guest/init.c",
)
CGROUP_FD = 4  # the agent's fd of the sandbox's cgroup v2 directory (its commands' cgroups go below)
# matplotlib (the host's /usr) draws to PNG with no display; code contexts switch to their inline
# backend (warmbox.guest.mpl_inline) so charts become results
MATPLOTLIBRC = "backend: Agg\n"
RUNTIME_TIMEOUT_S = 30.0  # a runtime command of a teardown (seconds, wall clock): runc delete takes ~15 ms


def agent_command(args: list[str] | None = None) -> list[str]:
    """The guest agent's command line inside the image, ``args`` passed to its ``main``."""
    call = f"main({args!r})" if args else "main()"
    return [
        GUEST_PYTHON,
        "-I",
        "-S",
        "-c",
        f"import sys; sys.path.insert(0, {GUEST_LIB!r}); from warmbox.guest.agent import main; {call}",
    ]


def build_font_cache(python: str, out: Path, rc: Path) -> None:
    """matplotlib's font list, made once here: code contexts copy it into the user's cache (its
    first import would scan every font). Nothing when the interpreter has no matplotlib."""
    home = out.with_name(out.name + ".home")
    home.mkdir()
    try:
        subprocess.run(
            [python, "-I", "-c", "import matplotlib.font_manager"],
            env={"PATH": BASE_ENV["PATH"], "HOME": str(home), "MPLCONFIGDIR": str(out), "MATPLOTLIBRC": str(rc)},
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)
    keep_only_font_list(out)


def keep_only_font_list(out: Path) -> None:
    """Of a build-time matplotlib config directory, only the font list, readable by everyone."""
    if not out.is_dir():
        return
    out.chmod(0o755)
    for extra in out.glob("*"):  # only the font list: nothing else of a build-time config
        if extra.name.startswith("fontlist-") and extra.suffix == ".json" and extra.is_file():
            extra.chmod(0o644)
        elif extra.is_dir():
            shutil.rmtree(extra)
        else:
            extra.unlink()


def warmbox_etc() -> dict[str, str]:
    """warmbox's /etc files of a sandbox (the built-in image's, and an image's agent layer's)."""
    return {
        "passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\nuser:x:1000:1000:user:/home/user:/bin/bash\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": "root:x:0:\ntty:x:5:\nuser:x:1000:\nnogroup:x:65534:\n",
        "hostname": HOSTNAME + "\n",
        "hosts": f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost ip6-localhost\n",
        # the egress resolver; unreachable (no link) unless the sandbox has a network policy
        "resolv.conf": f"nameserver {EGRESS_GATEWAY}\noptions timeout:1 attempts:2\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n",
        "shells": "/bin/sh\n/bin/bash\n",
        "timezone": "Etc/UTC\n",
        "matplotlibrc": MATPLOTLIBRC,
        "gitconfig": GITCONFIG,
    }


def install_guest(root: Path) -> None:
    """The guest agent under ``root``/opt/warmbox: its sources, its spawn helpers (gcc) and their
    bytecode. The root is read-only for the agent, so Python could never cache bytecode there:
    compiled now by the host's interpreter (~10 ms off every cold start). Its files are named for
    that interpreter's version (``__pycache__/*.cpython-311.pyc``): an image with another Python
    ignores them and compiles in memory."""
    pkg = Path(__file__).resolve().parent.parent
    lib = root / GUEST_LIB.lstrip("/") / "warmbox"
    (lib / "guest").mkdir(parents=True)
    (lib / "__init__.py").write_text('"""Guest-side copy: protocol + agent only."""\n')
    for rel in GUEST_SOURCES:
        shutil.copy2(pkg / rel, lib / rel)
    build_spawn_helpers(pkg / "guest", lib / "guest")
    if os.path.exists(GUEST_PYTHON):
        subprocess.run(
            [GUEST_PYTHON, "-I", "-m", "compileall", "-q", str(lib)], check=True, stdout=subprocess.DEVNULL, timeout=60
        )


def guest_sources() -> tuple[bytes, ...]:
    """What the guest files installed by ``install_guest`` follow from (for content hashes)."""
    pkg = Path(__file__).resolve().parent.parent
    return tuple(rel.encode() + b"\0" + (pkg / rel).read_bytes() for rel in GUEST_SOURCES)


# the mount points of an image sandbox's agent layer (its runtime mounts these; none is left to runc
# to create in the sandbox's own upper layer)
AGENT_LAYER_DIRS = ("proc", "dev", "sys", "tmp", "workspace", "home/user", "run", "opt", "mnt")
BUILD_LAYER_DIRS = ("proc", "dev", "sys", "workspace", "opt", "tmp", "run")
# a build sandbox's /etc files of warmbox, bind-mounted read-only from its state dir over empty files of
# its agent layer (as Docker does): a RUN step's writes never put them into the step's layer
BUILD_ETC = ("hosts", "hostname", "resolv.conf")
# an ordinary image sandbox's: the image's own with warmbox's users in (rootfs.with_sandbox_user), made
# at create and bind-mounted read-only over the agent layer's
MERGED_ETC = ("passwd", "group")


def fill_agent_layer(root: Path, build: bool, customize: Callable[[Path], None] | None = None) -> None:
    """An image sandbox's agent layer: the guest agent, mount points and (ordinary sandboxes)
    warmbox's /etc files over the image's; a build sandbox keeps the image's /etc, except the
    network files bind-mounted over (``BUILD_ETC``). ``customize`` (a tier's own) runs last."""
    for d in BUILD_LAYER_DIRS if build else AGENT_LAYER_DIRS:
        (root / d).mkdir(parents=True, exist_ok=True)
    etc = root / "etc"
    etc.mkdir()
    os.chmod(root / "tmp", 0o1777)  # runc gives a tmpfs the mode of its mount point
    if build:
        for name in BUILD_ETC:
            (etc / name).write_text("")
    else:
        for name, text in warmbox_etc().items():
            if name not in ("shells", "timezone"):  # the image's own
                (etc / name).write_text(text)
    install_guest(root)
    if customize is not None:
        customize(root)


def build_image(images_dir: Path, variant: str = "base", customize=None) -> Path:
    """The shared read-only rootfs, built once per content hash (atomic: temp dir + rename).

    variant/customize: a tier's own flavour of the image (``customize(tmp_root)`` runs last;
    the variant name and its inputs must be part of ``variant``'s spelling for the hash).
    """
    pkg = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(b"warmbox-rootfs-v6" + variant.encode())
    for rel in GUEST_SOURCES:
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
        on_host = Path("/") / link
        if on_host.is_symlink():
            os.symlink(os.readlink(on_host), tmp / link)
    os.symlink("/tmp", tmp / "var/tmp")
    etc = tmp / "etc"
    etc.mkdir()
    files = warmbox_etc()
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
    install_guest(tmp)
    if os.path.exists(GUEST_PYTHON):
        build_font_cache(GUEST_PYTHON, tmp / GUEST_LIB.lstrip("/") / "matplotlib", etc / "matplotlibrc")
    if customize is not None:
        customize(tmp)
    try:
        os.rename(tmp, final)
    except OSError:  # another process won the race; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _on_writable_mount(path: str) -> bool:
    """Below a mount the sandbox owns (the runtime makes a volume's mount point there itself)."""
    return any(path.startswith(m + "/") for m in ("/workspace", "/tmp", "/home/user"))


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
        self._layers: dict[bool, Path] = {}
        self._oom_paths: dict[str, str] = {}

    # ---- description

    def capabilities(self) -> Capabilities:
        return Capabilities(
            tier=self.tier,
            isolation="Linux namespaces (user, pid, mount, net, ipc, uts, cgroup) + seccomp + cgroups; "
            "shared host kernel",
            memory_snapshot=False,
            filesystem_snapshot=True,
            custom_kernel=False,
            network_modes=("none", "allowlist", "internet"),
            languages=("python", "node", "shell", "c", "git"),
            start_class="10-100ms",
            root_user=False,
            root_user_reason="the container's seccomp filter refuses user namespaces inside it, and a root "
            "of the container's own user namespace could rearrange its mounts",
            isolation_rank=1,
            cost_note="the host kernel serves every syscall",
            start_ms=100.0,
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
        if not host.cgroup_v2() and not (host.CGROUP_ROOT / "memory").is_dir():
            return Availability(False, "no memory cgroup controller mounted")
        if not shutil.which("gcc") and not any((self.runtime / "images").glob("base-*")):
            return Availability(False, "needs gcc once, to build the guest agent's spawn helpers")
        return Availability(True, f"runc at {path}, cgroup {'v2' if host.cgroup_v2() else 'v1'}, user namespaces")

    # ---- lifecycle

    def image(self) -> Path:
        """The tier's shared read-only rootfs (``build_rootfs``, once per backend)."""
        if self._image is None:
            self._image = self.build_rootfs()
        return self._image

    def build_rootfs(self) -> Path:
        """Find or build this tier's image (a tier running the same bundle adds its flavour here)."""
        return build_image(self.runtime / "images")

    def flavour(self) -> tuple[str, bytes, Callable[[Path], None] | None]:
        """(name, the bytes it follows from, what it adds to an agent layer): the tier's own files."""
        return "container", b"", None

    def agent_layer(self, build: bool = False) -> Path:
        """The agent layer over an image's layers (``rootfs``): built once per content hash,
        owned by host root (ordinary sandboxes) or by the image's root (build sandboxes)."""
        if build not in self._layers:
            name, extra, customize = self.flavour()
            self._layers[build] = rootfs.agent_layer(
                self.runtime / "images",
                name + ("-build" if build else ""),
                lambda root: fill_agent_layer(root, build, customize),
                (
                    *guest_sources(),
                    extra,
                    repr((AGENT_LAYER_DIRS, BUILD_LAYER_DIRS, BUILD_ETC)).encode(),
                    json.dumps(warmbox_etc()).encode(),
                ),
                owner=LAYER_UID_BASE if build else 0,
            )
        return self._layers[build]

    def image_fingerprint(self, image: ImageRef) -> str:
        """What a running image sandbox depends on: the image and this tier's agent layer."""
        return f"{image.image_id.removeprefix('sha256:')[:16]}-{self.agent_layer().name}"

    def _mount_root(self, spec: SandboxSpec) -> Path:
        """Check the image, then mount the sandbox's overlay root (``rootfs.mount``); a thread's work."""
        assert spec.image is not None
        rootfs.check_image(spec.image, rootfs.AGENT_NEEDS, spec.sandbox_id)
        layer = self.agent_layer(bool(spec.build_upper))
        return rootfs.mount(
            spec.state_dir,
            layer,
            spec.image,
            upper_mb=tmpfs_sizes(spec.limits)[0],
            build_upper=spec.build_upper,
            sandbox_id=spec.sandbox_id,
        )

    def agent_argv(self) -> list[str]:
        """The guest agent's command line: its listener is fd 3, its cgroup (if any) fd 4."""
        return agent_command(None if host.unified_root() is None else ["--cgroup-fd", str(CGROUP_FD)])

    def config(self, spec: SandboxSpec, root: Path, workspace: Path) -> dict:
        """The OCI runtime config of one sandbox (``root``: its root filesystem)."""
        lim = spec.limits
        build = bool(spec.build_upper)
        env = dict(BASE_ENV)
        if spec.image is not None:  # the image's config (Dockerfile ENV), under the sandbox's own
            env.update(dict(spec.image.env))
            env["HOME"] = "/root" if build else BASE_ENV["HOME"]
        if build and os.path.isfile(HOST_CA_BUNDLE):
            env.update(dict.fromkeys(BUILD_CA_ENV, BUILD_CA_PATH))
        env.update(dict(spec.envs))
        mib = 1 << 20
        tmp_mb, shm_mb = tmpfs_sizes(lim)
        ns = [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "cgroup", "user")]
        if spec.netns:  # the namespace the engine prepared with the sandbox's link in it
            ns[1]["path"] = spec.netns
        nosuid = ["nosuid", "nodev"]
        mounts = [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
            },
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={shm_mb}m"],
            },
            {
                "destination": "/dev/mqueue",
                "type": "mqueue",
                "source": "mqueue",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            *(
                []
                if spec.image is not None  # the image has its own /usr
                else [{"destination": "/usr", "type": "bind", "source": "/usr", "options": ["bind", "ro", *nosuid]}]
            ),
            {"destination": "/workspace", "type": "bind", "source": str(workspace), "options": ["bind", "rw", *nosuid]},
            {
                "destination": "/tmp",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": [*nosuid, "mode=1777", f"size={tmp_mb}m"],
            },
            {
                "destination": "/home/user",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": [*nosuid, "mode=755", f"uid={GUEST_UID}", f"gid={GUEST_GID}", f"size={tmp_mb}m"],
            },
        ]
        if build:  # the root is the build's layer; /home/user is part of it, /tmp and /run are not
            mounts = [m for m in mounts if m["destination"] != "/home/user"]
            mounts.append(
                {
                    "destination": "/run",
                    "type": "tmpfs",
                    "source": "tmpfs",
                    "options": [*nosuid, "mode=755", f"size={tmp_mb}m"],
                }
            )
            if os.path.isfile(HOST_CA_BUNDLE):  # in the /run tmpfs: never part of the layer
                mounts.append(
                    {
                        "destination": BUILD_CA_PATH,
                        "type": "bind",
                        "source": HOST_CA_BUNDLE,
                        "options": ["bind", "ro", "noexec", *nosuid],
                    }
                )
        if spec.image is not None:
            mounts += [
                {
                    "destination": f"/etc/{name}",
                    "type": "bind",
                    "source": str(Path(spec.state_dir) / "etc" / name),
                    "options": ["bind", "ro", *nosuid],
                }
                for name in (BUILD_ETC if build else MERGED_ETC)
            ]
        caps = BUILD_CAPABILITIES if build else []
        uid = 0 if build else GUEST_UID
        cwd = (spec.image.workdir if spec.image is not None else "") or ("/" if build else "/workspace")
        for i, v in enumerate(spec.volumes):  # last: a volume may be mounted below /tmp, /home/user, /workspace
            mounts.append(
                {
                    "destination": v.path,
                    "type": "bind",
                    "source": str(volume_disk.mount_point(spec.state_dir, i)),
                    "options": ["bind", "ro" if v.read_only else "rw", *nosuid],
                }
            )
        period = 100_000
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": uid, "gid": uid, "additionalGids": []},
                "args": self.agent_argv(),
                "env": [f"{k}={v}" for k, v in env.items()],
                "cwd": cwd,
                "capabilities": {
                    k: (caps if k in ("bounding", "effective", "permitted") else [])
                    for k in ("bounding", "effective", "inheritable", "permitted", "ambient")
                },
                "rlimits": [
                    {"type": "RLIMIT_NOFILE", "hard": lim.open_files, "soft": lim.open_files},
                    {"type": "RLIMIT_FSIZE", "hard": lim.file_size_mb * mib, "soft": lim.file_size_mb * mib},
                    {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
                ],
                "noNewPrivileges": True,
            },
            # an image's root is an overlay with the sandbox's own upper layer (bounded: rootfs.py)
            "root": {"path": str(root), "readonly": spec.image is None},
            "hostname": HOSTNAME,
            "mounts": mounts,
            "linux": {
                "uidMappings": [{"containerID": 0, "hostID": spec.uid_base, "size": ID_RANGE}],
                "gidMappings": [{"containerID": 0, "hostID": spec.uid_base, "size": ID_RANGE}],
                "namespaces": ns,
                "cgroupsPath": host.SandboxCgroup(spec.sandbox_id).path,
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

    async def create(self, spec: SandboxSpec) -> BackendHandle:
        """The sandbox's state dir: its workspace disk, its root (the built-in image, or an overlay
        of ``spec.image`` mounted here: ``rootfs``) and its OCI bundle. A build sandbox
        (``spec.build_upper``) runs as root of a user namespace at LAYER_UID_BASE (the layers'
        owners), with Docker's default capabilities, its root writable into ``build_upper``."""
        if spec.build_upper:
            if self.tier != "container" or spec.image is None:
                raise Unsupported(
                    "a template build sandbox runs on the container tier, over an image",
                    self.tier,
                    "builds need a writable overlay root owned by the image's uids",
                )
            spec = dataclasses.replace(spec, uid_base=LAYER_UID_BASE)
        owner = spec.uid_base + (0 if spec.build_upper else GUEST_UID)
        state = Path(spec.state_dir)
        bundle = state / "bundle"
        workspace = state / "workspace"
        bundle.mkdir(parents=True, exist_ok=True)
        (state / "run").mkdir(mode=0o700, exist_ok=True)  # the agent socket: root only
        if spec.image is not None:  # the /etc files bind-mounted over the image's (config)
            etc = state / "etc"
            etc.mkdir(mode=0o755, exist_ok=True)
            ours = warmbox_etc()
            for name in BUILD_ETC if spec.build_upper else MERGED_ETC:
                text = ours[name]
                if not spec.build_upper:
                    text = rootfs.with_sandbox_user(rootfs.read_file(spec.image, f"etc/{name}"), text)
                (etc / name).write_text(text)
        # /workspace is its own filesystem of limits.disk_mb (workspace_disk), owned by the sandbox user:
        # ~3 ms of copy + loop + mount, run in place (a thread hop cost ~2 ms more); a first use of
        # the size makes its blank filesystem (mkfs) in a thread
        args = (state, self.disk_cache(), spec.limits.disk_mb, owner, owner)
        try:
            if workspace_disk.cached(self.disk_cache(), spec.limits.disk_mb):
                workspace_disk.attach(*args)
            else:
                await asyncio.to_thread(workspace_disk.attach, *args)
        except OSError as e:
            raise SandboxStartError(f"the workspace disk: {e.strerror or e}", spec.sandbox_id) from None
        if spec.image is None:
            root = self.image()
        else:
            root = await asyncio.to_thread(self._mount_root, spec)
        if spec.volumes:  # each an idmapped mount of the volume's one host mount (volume_disk), ~10 ms
            # mount points the runtime cannot make (it may write only below /workspace, /tmp,
            # /home/user): made through the root before anything runs in it (a fresh overlay's
            # upper layer, walked without following a link of the image's layers)
            outside = [v.path for v in spec.volumes if not _on_writable_mount(v.path)]
            if outside:
                await asyncio.to_thread(volume_disk.make_mount_points, root, outside)
            await asyncio.to_thread(volume_disk.attach, state, spec.volumes, spec.uid_base)
        config = self.config(spec, root, workspace)
        tmp = bundle / "config.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the sandbox's env
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
        os.rename(tmp, bundle / "config.json")
        return BackendHandle(
            sandbox_id=spec.sandbox_id,
            tier=self.tier,
            runtime_id=spec.sandbox_id,
            state_dir=str(state),
            socket_path=str(state / "run" / "agent.sock"),
            uid_base=spec.uid_base,
        )

    async def start(self, handle: BackendHandle, ready: Callable[[], Awaitable[T]]) -> T:
        state = Path(handle.state_dir)
        sock_path = handle.socket_path
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        cgroup = None
        try:
            try:
                os.unlink(sock_path)
            except FileNotFoundError:
                pass
            listener.bind(sock_path)
            os.chmod(sock_path, 0o600)
            listener.listen(128)
            # the sandbox's cgroup v2 directory, made before runc (which then uses it), given to the
            # sandbox user and opened for the agent (fd 4): each command gets a child cgroup and a
            # timeout kills it whole (cgroup.kill). It is mounted nowhere inside, so no process there
            # can reach it or move itself out.
            agent_uid = handle.uid_base + (0 if handle.uid_base == LAYER_UID_BASE else GUEST_UID)  # a build: root
            cgroup = host.SandboxCgroup(handle.sandbox_id).delegate(agent_uid, agent_uid)
            argv = [
                self.runc,
                "--root",
                str(self.root),
                "run",
                "--detach",
                "--preserve-fds",
                "1" if cgroup is None else "2",
                "--bundle",
                str(state / "bundle"),
                handle.runtime_id,
            ]
            pid = host.spawn(argv, state / "agent.log", [listener.fileno()] + ([] if cgroup is None else [cgroup]))
        finally:
            listener.close()  # runc (then the agent) holds the listening socket now
            if cgroup is not None:
                os.close(cgroup)
        # The socket already listens, so ready() (connect + ping) runs while runc is still
        # finishing: its connection waits in the backlog until the agent accepts it.
        runc_done = asyncio.ensure_future(host.wait_exit(pid))
        ready_task = asyncio.ensure_future(ready())
        try:
            await asyncio.wait({runc_done, ready_task}, return_when=asyncio.FIRST_COMPLETED)
            rc = await runc_done
            if rc != 0:
                tail = host.tail(state / "agent.log")
                raise SandboxStartError(f"runc failed to start the sandbox (exit {rc}): {tail}", handle.sandbox_id)
            try:
                return await ready_task
            except GuestConnectionError:  # it started and ended at once (an image whose Python cannot run it)
                tail = host.tail(state / "agent.log")
                raise SandboxStartError(f"the guest agent did not come up: {tail}", handle.sandbox_id) from None
        finally:
            for task in (ready_task, runc_done):
                if not task.done():
                    task.cancel()
                    task.add_done_callback(lambda t: t.cancelled() or t.exception())
                elif not task.cancelled():
                    task.exception()  # retrieved: a runc failure supersedes ready()'s error

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

    def cgroup_dirs(self, sandbox_id: str) -> list[Path]:
        """Every cgroup directory this sandbox may own (for leak checks)."""
        return host.SandboxCgroup(sandbox_id).every_dir()

    async def oom_kills(self, handle: BackendHandle) -> int:
        """The cgroup's OOM-kill counter; read around every command, so kept to one syscall trio."""
        path = self._oom_paths.get(handle.sandbox_id)
        if path is None:
            path = self._oom_paths[handle.sandbox_id] = str(host.SandboxCgroup(handle.sandbox_id).oom_file())
            if len(self._oom_paths) > 4096:
                self._oom_paths.clear()
        return host.read_oom_kills(path)

    async def usage(self, handle: BackendHandle) -> ResourceUsage:
        cgroup = host.SandboxCgroup(handle.sandbox_id)
        mem = cpu = 0
        try:
            mem = cgroup.memory_bytes()
            cpu = cgroup.cpu_ns()
        except (OSError, ValueError):
            pass
        return ResourceUsage(oom_kills=cgroup.oom_kills(), memory_bytes=mem, cpu_ns=cpu)

    def sandbox_pids(self, sandbox_id: str) -> list[int]:
        """Every process in the sandbox's cgroups (host pids)."""
        return self._pids(sandbox_id)

    def _pids(self, sandbox_id: str) -> list[int]:
        return host.SandboxCgroup(sandbox_id).procs()

    async def destroy(self, handle: BackendHandle) -> None:
        """Tear the sandbox down, leaving no process, cgroup, runtime state, mount, loop device or
        directory: its processes killed at once through the cgroup and waited for on pidfds, then
        the runtime's record of the stopped container deleted while a thread unmounts the workspace
        disk and removes the state directory (they touch different things), then the cgroups.
        Idempotent, and a half-created sandbox goes the same way. Every wait is bounded; a step that
        fails raises SandboxError (SandboxTimeout when stuck) and the engine retries the teardown."""
        self._oom_paths.pop(handle.sandbox_id, None)
        cgroup = host.SandboxCgroup(handle.sandbox_id)
        await cgroup.kill_and_wait()
        results = await asyncio.gather(
            self.delete_container(handle), asyncio.to_thread(self._remove_files, handle), return_exceptions=True
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r
        if not cgroup.try_remove():  # runc and runsc remove their cgroups: this finds none, unless one failed
            await asyncio.to_thread(cgroup.remove)

    def held(self) -> set[str]:
        """Ids of the containers the runtime has a record of (``Inventory``)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return set()
        return {n for n in names if SANDBOX_ID.fullmatch(n)}

    async def delete_container(self, handle: BackendHandle) -> None:
        """Delete the runtime's record of a container whose processes are gone (``destroy`` killed
        them): plain ``runc delete``, ~15 ms. ``--force`` (this runc: 1.1.5) SIGKILLs and then sleeps a
        fixed 100 ms before it looks again, so only a container runc still sees running gets it."""
        if not (self.root / handle.runtime_id).exists():
            return
        rc, err = await self.runtime_cmd(handle, "delete", handle.runtime_id)
        if rc != 0 and (self.root / handle.runtime_id).exists():
            rc, err = await self.runtime_cmd(handle, "delete", "--force", handle.runtime_id)
            if rc != 0 and (self.root / handle.runtime_id).exists():
                raise SandboxError(f"runc delete failed: {err}", handle.sandbox_id)

    def runtime_argv(self) -> list[str]:
        """The runtime's command line up to its subcommand."""
        return [self.runc, "--root", str(self.root)]

    async def runtime_cmd(
        self, handle: BackendHandle, *args: str, timeout: float = RUNTIME_TIMEOUT_S
    ) -> tuple[int, str]:
        """Run the runtime's subcommand ``args`` for at most ``timeout`` seconds (wall clock; then it
        is killed and SandboxTimeout raised); returns its exit code and the tail of its stderr."""
        argv = self.runtime_argv()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as e:
            raise SandboxError(f"cannot run {argv[0]}: {e.strerror or e}", handle.sandbox_id) from None
        err = await host.communicate(proc, timeout)
        if err is None:
            raise SandboxTimeout(
                f"{os.path.basename(argv[0])} {args[0]} did not finish within {timeout:g} s", handle.sandbox_id
            )
        return proc.returncode or 0, err.decode(errors="replace").strip()[-400:]

    def _remove_files(self, handle: BackendHandle) -> None:
        """In a thread (unmounting waits on the kernel): the volumes, the workspace disk, then the runtime logs
        kept for ``warmbox logs``, then the state directory. A tree still mounted is never removed:
        the teardown fails, and is retried."""
        try:
            volume_disk.release(handle.state_dir)
        except OSError as e:
            raise SandboxError(f"a volume: {e.strerror or e}", handle.sandbox_id) from None
        try:
            rootfs.release(handle.state_dir)
        except OSError as e:
            raise SandboxError(f"the root overlay: {e.strerror or e}", handle.sandbox_id) from None
        try:
            workspace_disk.release(handle.state_dir)
        except OSError as e:
            raise SandboxError(f"the workspace disk: {e.strerror or e}", handle.sandbox_id) from None
        hostfs.keep_logs(handle.state_dir, self.runtime_logs, self.runtime / "logs", handle.sandbox_id)
        shutil.rmtree(handle.state_dir, ignore_errors=True)
