"""The microVM tier's guest: Debian's kernel, an initramfs that mounts a Debian root image.

Built once per content hash into ``<runtime>/images/microvm-<hash>/`` (temp dir + rename), from
Debian packages only:

- ``vmlinux``: the uncompressed kernel, unpacked from the ``linux-image-*`` package (apt-get
  download + dpkg-deb; never installed on the host). Under TCG the compressed bzImage costs
  ≈ 4.5 s of decompression at every cold boot, so the xz payload is decompressed here.
- ``initrd.cpio``: busybox (static, from ``busybox-static``), the few kernel modules the guest
  needs (virtio-mmio, virtio-blk, virtio-console, virtio-net, ext4 and their dependencies, read from each
  module's own ``depends=``), and ``/init`` (:data:`INIT`).
- ``rootfs.ext4``: the built-in image's Debian tree (``warmbox.images``) with Python (+ NumPy, pandas),
  Node.js, gcc, git, bash, coreutils, procps, util-linux and the guest agent under /opt/warmbox;
  attached read-only to every VM (≈ 600 MB; a VM reads only what it uses).
- ``workspace.raw``: an empty ext4 (owner 1000) that each sandbox's /workspace overlays
  (qcow2 with this as backing file: a new sandbox's disk costs nothing until it writes).
  It is ``WORKSPACE_MB`` large; a sandbox with another ``limits.disk_mb`` overlays
  ``workspace-<N>M.raw`` (:func:`workspace_backing`), made beside it on first use. The disk's
  size is the sandbox's /workspace quota: the guest's ext4 ends there, and the qcow2 on the host
  never grows past it (plus its own metadata).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from warmbox.backends import microvm_net as vmnet
from warmbox.backends import rootfs
from warmbox.backends._host import EGRESS_GATEWAY, GITCONFIG, GUEST_GID, GUEST_UID, build_spawn_helpers
from warmbox.backends.runc import GUEST_SOURCES, MATPLOTLIBRC, guest_sources, install_guest, keep_only_font_list
from warmbox.errors import SandboxStartError
from warmbox.images import BUILTIN_EXCLUDES, BUILTIN_PACKAGES, debian_key, suite
from warmbox.models import LAYER_UID_BASE, ImageRef
from warmbox.paths import image_cache_dir

BUILD_VERSION = "microvm-image-v4"
# the built-in image's packages (warmbox.images: one list, the same tree on every tier). pip and
# npm reach an index only through the egress proxy, under a network policy (guest/userenv.py).
GUEST_PACKAGES = BUILTIN_PACKAGES
WORKSPACE_MB = 1024
MODULES = ("virtio_mmio", "virtio_blk", "virtio_console", "virtio_net", "crc32c_generic", "ext4")
AGENT_PORT = "warmbox.agent"
RESTORE_PORT = "warmbox.restore"  # host entropy and clock for the guest kernel at each start (wb-restore)
_RESTORE_SRC = Path(__file__).with_name("microvm_restore.c")
_EXCLUDES = BUILTIN_EXCLUDES

# PID 1 of the initramfs: mounts the root image read-only, /workspace from its disk, tmpfs for
# the writable places, puts everything that follows in a cgroup with the sandbox's limits (handed to
# the agent by fd 4 for its commands' own cgroups; /sys/fs/cgroup is read-only), then
# becomes the guest agent as uid 1000 with no capabilities (switch_root + setpriv).
# Parameters come from the kernel command line (wb.mem_mb, wb.pids, wb.tmp_mb, wb.cpu_quota).
# Two lines are over 120 characters (the noqa below): INIT is hashed into the image id, so rewrapping
# it would rebuild every image.
INIT = r"""#!/bin/busybox sh
B=/bin/busybox
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
case " $($B cat /proc/cmdline) " in *" wb.probe=1 "*) echo WARMBOX-PROBE-OK > /dev/ttyS0; $B poweroff -f ;; esac
for m in $($B cat /modules.order); do $B insmod /lib/modules/$m.ko || echo "init: insmod $m failed"; done
mem=256; pids=512; tmp=256; quota=max; nofile=1024; fsize=1024
for kv in $($B cat /proc/cmdline); do
  case "$kv" in
    wb.mem_mb=*) mem=${kv#*=} ;; wb.pids=*) pids=${kv#*=} ;; wb.tmp_mb=*) tmp=${kv#*=} ;;
    wb.cpu_quota=*) quota=${kv#*=} ;; wb.nofile=*) nofile=${kv#*=} ;; wb.fsize_mb=*) fsize=${kv#*=} ;;
  esac
done
i=0; while [ ! -b /dev/vdb ] && [ $i -lt 500 ]; do $B usleep 10000; i=$((i+1)); done
$B mkdir -p /newroot
$B mount -t ext4 -o ro,noatime /dev/vda /newroot || { echo "init: no root image"; $B poweroff -f; }
$B mount -t ext4 -o rw,noatime,nosuid,nodev /dev/vdb /newroot/workspace || { echo "init: no workspace"; $B poweroff -f; }
$B mount -t tmpfs -o nosuid,nodev,mode=1777,size=${tmp}m tmpfs /newroot/tmp
$B mount -t tmpfs -o nosuid,nodev,mode=755,uid=1000,gid=1000,size=${tmp}m tmpfs /newroot/home/user
$B mount -t tmpfs -o nosuid,nodev,mode=755,size=16m tmpfs /newroot/run
$B mount --move /dev /newroot/dev
$B mkdir -p /newroot/dev/pts /newroot/dev/shm
$B mount -t devpts -o nosuid,noexec,newinstance,ptmxmode=0666,mode=0620 devpts /newroot/dev/pts
$B mount -t tmpfs -o nosuid,nodev,mode=1777,size=64m shm /newroot/dev/shm
echo 1 > /proc/sys/kernel/printk  # only emergencies reach the console file on the host
$B mount --move /proc /newroot/proc
$B mount --move /sys /newroot/sys
port=; restore=
for d in /newroot/sys/class/virtio-ports/*; do
  case "$($B cat $d/name 2>/dev/null)" in
    "%(port)s") port=/dev/$($B basename $d) ;; "%(restore)s") restore=/dev/$($B basename $d) ;;
  esac
done
[ -n "$port" ] && [ -n "$restore" ] || { echo "init: no agent or restore port"; $B poweroff -f; }
# the root helper that reseeds the kernel's generator and sets the clock after every restore
# (outside the sandbox's cgroup, never chosen by the OOM killer; uid 1000 cannot signal it)
$B chmod 600 /newroot$restore
/bin/wb-restore /newroot$restore /newroot/dev/urandom /newroot &
echo -1000 > /newroot/proc/$!/oom_score_adj
C=/newroot/run/wb-cgroup
$B mkdir -m 700 $C
$B mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 $C
echo "+memory +pids +cpu" > $C/cgroup.subtree_control
$B mkdir $C/sandbox
echo $((mem * 1048576)) > $C/sandbox/memory.max
echo 0 > $C/sandbox/memory.swap.max 2>/dev/null
echo $pids > $C/sandbox/pids.max
echo "$quota 100000" > $C/sandbox/cpu.max
echo $$ > $C/sandbox/cgroup.procs
# the agent puts each command in a cgroup below sandbox (a timeout kills it whole), through fd 4
# only: this writable mount is detached, the one at /sys/fs/cgroup is read-only, so a command
# cannot move itself out of its cgroup
$B chown 1000:1000 $C/sandbox $C/sandbox/cgroup.procs
exec 4< $C/sandbox
$B umount -l $C
$B rmdir $C
$B mount -t cgroup2 -o ro,nosuid,nodev,noexec cgroup2 /newroot/sys/fs/cgroup
$B chown 1000:1000 /newroot$port
$B chmod 600 /newroot$port
$B hostname sandbox
$B ip link set lo up
# the NIC (backends/microvm_net.py): the same address in every VM, every route through the host's end
# of the tap; the host side makes it this sandbox's link to the egress gateway (which refuses and logs
# anything but its proxy and DNS), or a dead end
V6=/newroot/proc/sys/net/ipv6/conf/eth0/disable_ipv6; [ -e $V6 ] && echo 1 > $V6
$B ip link set eth0 up && $B ip addr add %(guest)s dev eth0 && $B ip route add default via %(host)s dev eth0 \
  || echo "init: no network device"
cd /newroot
exec $B switch_root /newroot /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME=/home/user LANG=C.UTF-8 /usr/bin/prlimit --nofile=$nofile:$nofile --fsize=$((fsize * 1048576)) --core=0 \
  /usr/bin/setpriv --reuid=1000 --regid=1000 --clear-groups --inh-caps=-all \
  --bounding-set=-all --no-new-privs /usr/bin/python3 -I -S -c \
  "import sys; sys.path.insert(0, '/opt/warmbox'); from warmbox.guest.agent import main; main(['--cgroup-fd', '4', '--serial', '$port'])"
""".replace("%(port)s", AGENT_PORT).replace("%(restore)s", RESTORE_PORT)  # noqa: E501
INIT = INIT.replace("%(guest)s", f"{vmnet.GUEST_ADDR}/{vmnet.PREFIX}").replace("%(host)s", vmnet.HOST_ADDR)

_ETC = {
    "passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\nuser:x:1000:1000:user:/home/user:/bin/bash\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\ntty:x:5:\nuser:x:1000:\nnogroup:x:65534:\n",
    "hostname": "sandbox\n",
    "hosts": "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n",
    # the egress resolver, as on the other tiers (unreachable without a network policy)
    "resolv.conf": f"nameserver {EGRESS_GATEWAY}\noptions timeout:1 attempts:2\n",
}
_ETC["gitconfig"] = GITCONFIG
_ETC["matplotlibrc"] = MATPLOTLIBRC  # as the other tiers': Debian's says TkAgg


def _fail(what: str, r: subprocess.CompletedProcess | None = None) -> SandboxStartError:
    tail = ""
    if r is not None:
        tail = ": " + (r.stderr or r.stdout or "").strip().replace("\n", " | ")[-400:]
    return SandboxStartError(f"building the microVM image: {what}{tail}")


def _run(
    argv: list[str],
    what: str,
    timeout: float = 600,
    *,
    fetch_tries: int = 1,
    before_retry: Callable[[], object] | None = None,
    **kw,
) -> subprocess.CompletedProcess:
    """``argv``; fetch_tries: runs again (up to that many in all) while it fails because apt could
        not fetch a file (the apt proxy here answers a few of many with "403 Forbidden", fine when asked
        again; apt itself does not retry an HTTP error); ``before_retry`` runs before each new try (e.g.
    removing a half-made target). Each failure is a SandboxStartError naming ``what``."""
    for attempt in range(1, fetch_tries + 1):
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
        except FileNotFoundError:
            raise _fail(f"{argv[0]} is not installed (scripts/bootstrap installs it)") from None
        except subprocess.TimeoutExpired:
            raise _fail(f"{what} took longer than {timeout:.0f} s") from None
        if r.returncode == 0:
            return r
        if attempt == fetch_tries or "Failed to fetch" not in r.stdout + r.stderr:
            break
        time.sleep(2 * attempt)
        if before_retry is not None:
            before_retry()
    raise _fail(what, r)


def content_hash() -> str:
    pkg = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(
        BUILD_VERSION.encode()
        + INIT.encode()
        + _RESTORE_SRC.read_bytes()
        + repr((GUEST_PACKAGES, MODULES, WORKSPACE_MB, _EXCLUDES, _ETC)).encode()
    )
    for rel in GUEST_SOURCES:
        h.update(rel.encode() + b"\0" + (pkg / rel).read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Shared by every warmbox home on the host: the images are immutable and content-named.
    ``WARMBOX_IMAGE_CACHE`` overrides."""
    return image_cache_dir()


def image_dir(images: Path) -> Path:
    return images / f"microvm-{content_hash()}"


PRUNE_AFTER_S = 86400.0  # a Debian tree unused this long goes when an image is built


def build(images: Path) -> Path:
    """The image directory, built if missing (minutes, once per content hash). Building one
    prunes Debian trees unused for a day and half-finished builds. Images themselves are never
    removed automatically: paused sandboxes and template snapshots of any warmbox home on this
    host may still need theirs (remove old ``microvm-*`` directories by hand)."""
    final = image_dir(images)
    if (final / "meta.json").is_file():
        return final
    images.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(images / ".microvm-build.lock", "w") as lock:  # one builder; the others wait for it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "meta.json").is_file():
            return final
        tmp = images / f".tmp-microvm-{os.getpid()}-{time.monotonic_ns()}"
        tmp.mkdir()
        try:
            meta = _build_into(tmp)
            # rebuilt from the same sources an image differs (mkfs UUIDs, package versions): memory
            # snapshots and workspace disks name this id, and only restore into the same build
            meta["build_id"] = os.urandom(8).hex()
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        prune(images, keep=final)
    return final


def build_id(image: Path) -> str:
    try:
        return str(json.loads((image / "meta.json").read_text()).get("build_id", "unversioned"))
    except (OSError, ValueError):
        return "unreadable"


def prune(images: Path, keep: Path, older_than_s: float = PRUNE_AFTER_S) -> list[str]:
    """Remove Debian trees unused for ``older_than_s`` other than the current one (only builds use
    them, under the build lock the caller holds) and builds that died half-way (hidden temp dirs
    older than an hour, or an image directory without meta.json). Returns the names removed."""
    now, gone = time.time(), []
    for d in images.iterdir():
        try:
            if d == keep or not d.is_dir():
                continue
            if d.name.startswith(".tmp-"):
                stale = now - d.stat().st_mtime > 3600
            elif d.name.startswith("microvm-"):
                stale = not (d / "meta.json").exists() and now - d.stat().st_mtime > 3600
            elif d.name.startswith("debian-"):
                stale = now - d.stat().st_mtime > older_than_s and d.name != _debian_key_name()
            else:
                continue
        except OSError:
            continue
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d.name)
    return gone


def _build_into(out: Path) -> dict:
    t0 = time.monotonic()
    work = out / "work"
    work.mkdir()
    try:
        version = _kernel(out, work)
        t1 = time.monotonic()
        _rootfs(out, work)
        t2 = time.monotonic()
        _workspace(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "kernel": version,
        "packages": list(GUEST_PACKAGES),
        "built_at": time.time(),
        "kernel_s": round(t1 - t0, 1),
        "rootfs_s": round(t2 - t1, 1),
    }


# --------------------------------------------------------------------------- kernel


def _kernel_package() -> str:
    r = _run(["apt-cache", "depends", "linux-image-amd64"], "resolving Debian's kernel package")
    m = re.search(r"Depends:\s*(linux-image-[0-9][^\s]*-amd64)", r.stdout)
    if not m:
        raise _fail(f"apt-cache names no versioned kernel for linux-image-amd64: {r.stdout.strip()[:200]}")
    return m.group(1)


def extract_vmlinux(vmlinuz: bytes) -> bytes:
    """The ELF kernel inside a bzImage (its xz, zstd or gzip payload, found by magic)."""
    import gzip
    import zlib

    candidates: list[tuple[int, str]] = []
    for magic, kind in ((b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\x1f\x8b\x08\x00", "gzip")):
        at = vmlinuz.find(magic)
        while at != -1 and len(candidates) < 16:
            candidates.append((at, kind))
            at = vmlinuz.find(magic, at + 1)
    for at, kind in sorted(candidates):
        data = vmlinuz[at:]
        try:
            if kind == "xz":
                out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data)
            elif kind == "zstd":
                import zstandard

                out = zstandard.ZstdDecompressor().decompressobj().decompress(data)
            else:
                out = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)
                del gzip
        except Exception:
            continue
        if out[:4] == b"\x7fELF":
            return out
    raise _fail("no compressed ELF kernel found inside vmlinuz")


def _modinfo_depends(ko: bytes) -> list[str]:
    m = re.search(rb"\x00depends=([^\x00]*)\x00", ko)
    return [d.decode() for d in m.group(1).split(b",") if d] if m else []


def _kernel(out: Path, work: Path) -> str:
    pkg = _kernel_package()
    _run(
        ["apt-get", "download", "-q", "-o", "Acquire::Retries=3", "-o", "APT::Sandbox::User=root", pkg],
        f"apt-get download {pkg}",
        cwd=work,
        fetch_tries=4,
    )
    debs = list(work.glob(f"{pkg}_*.deb"))
    if not debs:
        raise _fail(f"apt-get download left no {pkg} package")
    tree = work / "kernel"
    _run(["dpkg-deb", "-x", str(debs[0]), str(tree)], f"unpacking {debs[0].name}")
    vmlinuz = sorted((tree / "boot").glob("vmlinuz-*"))
    if not vmlinuz:
        raise _fail(f"{pkg} holds no /boot/vmlinuz")
    version = vmlinuz[0].name[len("vmlinuz-") :]
    (out / "vmlinux").write_bytes(extract_vmlinux(vmlinuz[0].read_bytes()))
    mods = {p.name[:-3].replace("-", "_"): p for p in (tree / "lib/modules" / version).rglob("*.ko")}
    order: list[str] = []

    def need(name: str) -> None:
        if name in order:
            return
        ko = mods.get(name)
        if ko is None:
            return  # built in
        for dep in _modinfo_depends(ko.read_bytes()):
            need(dep.replace("-", "_"))
        order.append(name)

    for name in MODULES:
        need(name)
    busybox = shutil.which("busybox")
    if not busybox:
        raise _fail("busybox is not installed (apt-get install busybox-static)")
    if b"ld-linux" in Path(busybox).read_bytes()[:4096]:
        raise _fail(f"{busybox} is dynamically linked; the initramfs needs busybox-static")
    files: list[tuple[str, int, bytes]] = [
        ("bin", 0o040755, b""),
        ("dev", 0o040755, b""),
        ("proc", 0o040755, b""),
        ("sys", 0o040755, b""),
        ("lib", 0o040755, b""),
        ("lib/modules", 0o040755, b""),
        ("bin/busybox", 0o100755, Path(busybox).read_bytes()),
        ("bin/wb-restore", 0o100755, _restore_helper(work)),
        ("init", 0o100755, INIT.encode()),
        ("modules.order", 0o100644, ("\n".join(order) + "\n").encode()),
    ]
    files += [(f"lib/modules/{n}.ko", 0o100644, mods[n].read_bytes()) for n in order]
    (out / "initrd.cpio").write_bytes(cpio_newc(files))
    return version


def _restore_helper(work: Path) -> bytes:
    """wb-restore (microvm_restore.c), compiled static for the initramfs."""
    out = work / "wb-restore"
    _run(
        ["gcc", "-static", "-Os", "-s", "-Wall", "-Werror", "-o", str(out), str(_RESTORE_SRC)],
        "compiling the guest's restore helper (gcc, libc6-dev)",
    )
    return out.read_bytes()


def cpio_newc(files: list[tuple[str, int, bytes]]) -> bytes:
    """An uncompressed "newc" cpio archive (the initramfs format) of (path, mode, data)."""
    parts = []
    for ino, (name, mode, data) in enumerate([*files, ("TRAILER!!!", 0, b"")], start=1):
        raw = name.encode() + b"\0"
        nlink = 2 if mode & 0o040000 else 1
        fields = (ino if name != "TRAILER!!!" else 0, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(raw), 0)
        head = b"070701" + b"".join(b"%08X" % f for f in fields)
        parts.append(head + raw + b"\0" * ((4 - (len(head) + len(raw)) % 4) % 4))
        parts.append(data + b"\0" * ((4 - len(data) % 4) % 4))
    return b"".join(parts)


# --------------------------------------------------------------------------- root filesystem


def _suite() -> str:
    return suite()


def _debian_key_name() -> str:
    return debian_key()


def debian_tree(images: Path) -> Path:
    """The mmdebstrap tree of the built-in packages (warmbox.images), kept beside the images: the
    built-in image's bottom layer and this tier's root are made from it (rebuilding either after
    a warmbox change then takes seconds, not a Debian bootstrap). One maker at a time, host-wide."""
    final = images / _debian_key_name()
    if final.is_dir():
        os.utime(final)
        return final
    images.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(images / ".debian-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_dir():
            return final
        tmp = images / f".tmp-debian-{os.getpid()}-{time.monotonic_ns()}"
        argv = ["mmdebstrap", "--variant=minbase", "--quiet", "--aptopt=Acquire::Retries 5"]
        argv += ["--include=" + ",".join(GUEST_PACKAGES)]
        argv += [f"--dpkgopt=path-exclude={x}" for x in _EXCLUDES]
        argv += ["--dpkgopt=path-include=/usr/share/doc/*/copyright", _suite(), str(tmp)]
        try:
            _run(
                argv,
                "mmdebstrap of the guest root",
                timeout=900,
                fetch_tries=3,
                before_retry=lambda: shutil.rmtree(tmp, ignore_errors=True),
            )
            for junk in ("var/cache/apt", "var/lib/apt/lists"):
                shutil.rmtree(tmp / junk, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _rootfs(out: Path, work: Path) -> None:
    root = work / "root"
    _run(["cp", "-a", str(debian_tree(out.parent)), str(root)], "copying the Debian tree")
    for d in ("workspace", "home/user", "run", "tmp", "opt/warmbox/warmbox/guest", "dev", "proc", "sys"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chown(root / "home/user", GUEST_UID, GUEST_GID)
    os.chmod(root / "tmp", 0o1777)
    for name, text in _ETC.items():
        path = root / "etc" / name
        path.unlink(missing_ok=True)
        path.write_text(text)
    pkg = Path(__file__).resolve().parent.parent
    lib = root / "opt/warmbox/warmbox"
    (lib / "__init__.py").write_text('"""Guest-side copy: protocol + agent only."""\n')
    for rel in GUEST_SOURCES:
        shutil.copy2(pkg / rel, lib / rel)
    build_spawn_helpers(pkg / "guest", lib / "guest")  # the guest's glibc is Debian's, as the host's
    _font_list(root)
    guest_py = sorted((root / "usr/bin").glob("python3.[0-9]*"))
    host_py = Path("/usr/bin") / guest_py[0].name if guest_py else None
    if host_py is not None and host_py.exists():  # same Debian interpreter: its bytecode fits the guest's
        subprocess.run(
            [str(host_py), "-I", "-m", "compileall", "-q", str(lib)],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
        )
    size_mb = int(_du_mb(root) * 1.25) + 64
    _run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            "wbroot",
            "-O",
            "^has_journal",
            "-m",
            "0",
            "-d",
            str(root),
            str(out / "rootfs.ext4"),
            f"{size_mb}M",
        ],
        "mkfs.ext4 of the guest root",
    )


def _font_list(root: Path) -> None:
    """matplotlib's font list made by the guest's own Python (chroot): code contexts copy it into
    the user's cache, which saves its first import a font scan (~2.4 s under TCG)."""
    seed = "/opt/warmbox/matplotlib"
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    if not os.path.exists(chroot):
        return
    subprocess.run(
        [chroot, str(root), "/usr/bin/python3", "-I", "-c", "import matplotlib.font_manager"],
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": "/nonexistent",
            "MPLCONFIGDIR": seed,
            "MATPLOTLIBRC": "/etc/matplotlibrc",
        },
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=600,
    )
    keep_only_font_list(root / seed.lstrip("/"))


def _du_mb(path: Path) -> float:
    total = 0
    for dirpath, _, files in os.walk(path):
        for n in files:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total / (1 << 20)


_WORKSPACE_NAME = re.compile(r"workspace(?:-([1-9][0-9]{0,8})M)?\.raw")


def workspace_backing(image: Path, size_mb: int) -> Path:
    """The empty ext4 of ``size_mb`` MiB a sandbox's workspace qcow2 overlays: the image's own
    ``workspace.raw`` at WORKSPACE_MB, else ``workspace-<N>M.raw`` beside it, made on first use
    (atomic). Its bytes follow from the image build and the size alone (fixed UUID, hash seed
    and time), so every host with this image build makes the same file: a snapshot's disk, whose
    unwritten blocks are read from it, restores on any of them."""
    if size_mb == WORKSPACE_MB:
        return image / "workspace.raw"
    final = image / f"workspace-{size_mb}M.raw"
    if final.is_file():
        return final
    import uuid

    seed = hashlib.sha256(f"{build_id(image)}:{size_mb}".encode()).digest()
    tmp = image / f".tmp-workspace-{size_mb}M-{os.getpid()}-{time.monotonic_ns()}.raw"
    try:
        with open(tmp, "xb") as f:
            f.truncate(size_mb << 20)  # sparse, all zeros: assume_storage_prezeroed writes no inode tables
        _run(
            [
                "mkfs.ext4",
                "-q",
                "-F",
                "-L",
                "workspace",
                "-m",
                "0",
                "-U",
                str(uuid.UUID(bytes=seed[:16], version=4)),
                "-E",
                f"root_owner=1000:1000,assume_storage_prezeroed=1,nodiscard,"
                f"hash_seed={uuid.UUID(bytes=seed[16:], version=4)}",
                str(tmp),
            ],
            f"mkfs.ext4 of a {size_mb} MiB workspace disk",
            env={**os.environ, "E2FSPROGS_FAKE_TIME": "1"},
        )
        os.chmod(tmp, 0o644)
        os.rename(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def workspace_size(image: Path, backing: str) -> int | None:
    """The size in MiB of ``backing`` if it names one of the image's workspace disks, else None."""
    parent, _, name = backing.rpartition("/")
    m = _WORKSPACE_NAME.fullmatch(name)
    if parent != str(image) or m is None:
        return None
    size = int(m.group(1)) if m.group(1) else WORKSPACE_MB
    return (
        size
        if (image / name) == (image / "workspace.raw" if size == WORKSPACE_MB else image / f"workspace-{size}M.raw")
        else None
    )


def _workspace(out: Path) -> None:
    _run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            "workspace",
            "-m",
            "0",
            "-E",
            "root_owner=1000:1000,lazy_itable_init=0,lazy_journal_init=0",
            str(out / "workspace.raw"),
            f"{WORKSPACE_MB}M",
        ],
        "mkfs.ext4 of the workspace disk",
    )


# --------------------------------------------------------------------------- a template image's root

ROOTS = "microvm-roots"  # <cache>/microvm-roots/<image id>-<agent hash>.ext4: one per image
ROOT_FORMAT = "microvm-root-v1"
# what the initramfs's /init and the guest agent run from the image (INIT: switch_root, env, prlimit,
# setpriv, python3)
ROOT_NEEDS = ("usr/bin/python3", "usr/bin/env", "usr/bin/prlimit", "usr/bin/setpriv")
_ROOT_DIRS = ("workspace", "home/user", "run", "tmp", "dev", "proc", "sys", "opt")
_CLONE_NEWUSER = 0x10000000
# Runs mkfs.ext4 as root of a new user namespace whose ids 0..65535 are the layers' host ids
# LAYER_UID_BASE.. (the parent writes the maps between the two bytes): the ext4 holds the image's
# own owners. A process of its own (no fork of the engine's threads); only the stdlib.
_MAPPED_EXEC = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(CLONE_NEWUSER) != 0:
    sys.stderr.write("unshare of a user namespace: " + os.strerror(ctypes.get_errno()) + "\n")
    sys.exit(126)
ready, go = int(sys.argv[1]), int(sys.argv[2])
os.write(ready, b"u")
if os.read(go, 1) != b"m":
    sys.exit(125)
os.close(ready)
os.close(go)
os.setgroups([])
os.setresgid(0, 0, 0)
os.setresuid(0, 0, 0)
os.execv(sys.argv[3], sys.argv[3:])  # (no import from here on: the interpreter's files may be root's alone)
""".replace("CLONE_NEWUSER", str(_CLONE_NEWUSER))


def agent_hash() -> str:
    """What a template image's microVM root takes from warmbox (not from the image): the guest agent,
    the /etc files and mount points (the kernel and initramfs are the built-in image's)."""
    h = hashlib.sha256(ROOT_FORMAT.encode() + repr((sorted(_ETC.items()), _ROOT_DIRS, ROOT_NEEDS)).encode())
    for blob in guest_sources():
        h.update(hashlib.sha256(blob).digest())
    return h.hexdigest()[:16]


def image_root_path(cache: Path, image: ImageRef) -> Path:
    """Where the microVM root of ``image`` is (or will be) made: named by the image and the agent."""
    ident = image.image_id.removeprefix("sha256:")
    if not re.fullmatch(r"[0-9a-f]{16,64}", ident):
        raise SandboxStartError(f"template {image.template}:{image.version} has a malformed image id")
    return cache / ROOTS / f"{ident[:32]}-{agent_hash()}.ext4"


def image_root(cache: Path, image: ImageRef) -> Path:
    """The read-only ext4 root of a microVM running ``image``: its layers (an overlay mount on the
    host) under the guest agent, warmbox's /etc files and the init's mount points, written by
    ``mkfs.ext4 -d`` inside a user namespace mapping the layer range back to 0..65535 (the image's
    owners). Built once per (image, agent), atomically (temp file + rename), under a lock, with a
    UUID and hash seed that follow from its name."""
    final = image_root_path(cache, image)
    if final.is_file():
        _private(final)
        return final
    rootfs.check_image(image, ROOT_NEEDS)
    roots = final.parent
    roots.mkdir(parents=True, exist_ok=True)
    os.chmod(roots, 0o755)  # the mapped mkfs traverses it
    import fcntl

    with open(roots / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_file():
            _private(final)
            return final
        for old in roots.glob(".tmp-*"):  # a build that died half-way (under the lock: not a live one)
            _release_build(old)
        work = roots / f".tmp-{os.getpid()}-{time.monotonic_ns()}"
        work.mkdir(mode=0o755)
        try:
            _build_root(image, work, final)
        finally:
            _release_build(work)
    return final


def _private(root: Path) -> None:
    """A root holds a template's whole filesystem (a tenant's COPY'd files): root's alone (QEMU
    opens it as root before it drops its rights). Roots made before this were 0644."""
    st = root.stat()
    if st.st_mode & 0o077 or st.st_uid != 0:
        os.chown(root, 0, 0)
        os.chmod(root, 0o600)


def _release_build(work: Path) -> None:
    try:
        rootfs.unmount(work / "merged")
    except OSError:
        return  # still mounted: never removed (the next build retries)
    shutil.rmtree(work, ignore_errors=True)


def _agent_tree(image: ImageRef, top: Path) -> None:
    """The microVM agent layer of ``image`` (owners in the layer range: root, and 1000 for /home/user)."""
    for d in _ROOT_DIRS:
        (top / d).mkdir(parents=True, exist_ok=True)
    os.chmod(top / "tmp", 0o1777)
    etc = top / "etc"
    etc.mkdir()
    for name, text in _ETC.items():
        if name in ("passwd", "group"):  # the image's users stay (a Dockerfile's useradd), with warmbox's
            text = rootfs.with_sandbox_user(rootfs.read_file(image, f"etc/{name}"), text)
        (etc / name).write_text(text)
    install_guest(top)
    for parent, dirs, files in os.walk(top):
        for name in (*dirs, *files):
            os.lchown(os.path.join(parent, name), LAYER_UID_BASE, LAYER_UID_BASE)
    os.chown(top, LAYER_UID_BASE, LAYER_UID_BASE)
    os.chown(top / "home/user", LAYER_UID_BASE + GUEST_UID, LAYER_UID_BASE + GUEST_GID)


def _build_root(image: ImageRef, work: Path, final: Path) -> None:
    top, merged = work / "agent", work / "merged"
    top.mkdir(mode=0o755)
    merged.mkdir(mode=0o755)
    _agent_tree(image, top)
    size_mb = int(sum(_du_mb(Path(d)) for d in (str(top), *image.layers)) * 1.25) + 64
    tmp = work / "root.ext4"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb") as f:
        f.truncate(size_mb << 20)
    os.chown(tmp, LAYER_UID_BASE, LAYER_UID_BASE)  # the mapped mkfs (the image's root) writes it
    rootfs.mount_readonly(merged, [str(top), *rootfs.stack(image)])
    import uuid

    seed = hashlib.sha256(final.name.encode()).digest()
    argv = [
        "mkfs.ext4",
        "-q",
        "-F",
        "-L",
        "wbroot",
        "-O",
        "^has_journal",
        "-m",
        "0",
        "-U",
        str(uuid.UUID(bytes=seed[:16], version=4)),
        "-E",
        f"hash_seed={uuid.UUID(bytes=seed[16:], version=4)},nodiscard",
        "-d",
        str(merged),
        str(tmp),
    ]
    _run_mapped(argv, f"mkfs.ext4 of template {image.template}:{image.version}'s microVM root")
    rootfs.unmount(merged)
    os.chown(tmp, 0, 0)
    os.chmod(tmp, 0o600)
    os.rename(tmp, final)


def _run_mapped(argv: list[str], what: str, timeout: float = 1800) -> None:
    """``argv`` as root of a new user namespace mapping 0..65535 to the layer range (_MAPPED_EXEC)."""
    import subprocess as sp
    import sys

    exe = shutil.which(argv[0])
    if exe is None:
        raise _fail(f"{what}: {argv[0]} is not installed")
    argv = [exe, *argv[1:]]
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    try:
        proc = sp.Popen(
            [sys.executable, "-I", "-S", "-c", _MAPPED_EXEC, str(ready_w), str(go_r), *argv],
            pass_fds=(ready_w, go_r),
            stdin=sp.DEVNULL,
            stdout=sp.PIPE,
            stderr=sp.PIPE,
            text=True,
        )
    except OSError as e:
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)
        raise _fail(f"{what}: {e.strerror or e}") from None
    os.close(ready_w)
    os.close(go_r)
    try:
        if os.read(ready_r, 1) == b"u":
            mapping = f"0 {LAYER_UID_BASE} 65536\n"
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{proc.pid}/{name}", "w") as f:
                    f.write(mapping)
            os.write(go_w, b"m")
        out, err = proc.communicate(timeout=timeout)
    except sp.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise _fail(f"{what} took longer than {timeout:.0f} s") from None
    except OSError as e:
        proc.kill()
        proc.communicate()
        raise _fail(f"{what}: {e.strerror or e}") from None
    finally:
        os.close(ready_r)
        os.close(go_w)
    if proc.returncode != 0:
        raise _fail(f"{what} (exit {proc.returncode})", sp.CompletedProcess(argv, proc.returncode, out, err))
