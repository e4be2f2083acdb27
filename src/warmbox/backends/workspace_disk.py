"""The /workspace quota of the container and gVisor tiers: one sparse ext4 image per sandbox.

Without it /workspace is a directory on the host's disk and a sandbox can fill that disk. With
it, ``<state>/workspace.img`` (root's, 0600, in the root-owned state dir) is an ext4 of exactly
``limits.disk_mb`` MiB, loop-mounted (``nosuid,nodev``) at ``<state>/workspace`` before the
runtime starts: a writer inside gets ENOSPC when it is full, and the host gives the sandbox at
most ``disk_mb`` of its disk, only as it is written (the image is sparse). runc bind-mounts the
directory as today, gVisor's gofer serves it as today; tar (snapshots) sees an ordinary tree.

Measured on this project's host (ext4 on virtio, kernel 6.18), per sandbox:
- the blank filesystem is made once per size (``mkfs.ext4 -E assume_storage_prezeroed=1`` on a
  fresh sparse file: no inode table or journal is written, 10 GiB allocates ~0.2 MiB; ~20-150 ms)
  and cached under ``<runtime>/images/disks``; a sandbox's image is a copy of its allocated
  extents (SEEK_DATA + copy_file_range): ~0.4 ms. A mkfs per sandbox would cost 20-150 ms.
- the loop device is configured in one ioctl (LOOP_CONFIGURE, kernel >= 5.8) with
  ``LO_FLAGS_AUTOCLEAR`` (the device goes with its last user: a process killed before it mounted
  leaves none; unmounting detaches it) and ``LO_FLAGS_DIRECT_IO`` (no second page-cache copy of
  what the sandbox writes: 512 MiB + fsync took 0.4-0.6 s instead of 2-3 s); mount(2) directly
  (no mount(8) process): copy + attach + mount ≈ 2.5-3.5 ms on an idle host (the sandbox's
  ``filesystem`` stage: ~2 -> ~5 ms), each of attach, mount and unmount up to ~5-20 ms while
  other writers keep the host's disk busy; unmount ≈ 1-3 ms.
- no journal: the image never outlives its sandbox (a host crash ends the sandbox, and its disk
  is discarded by the teardown, never mounted again), so crash consistency buys nothing and
  costs a second write of every metadata change. No lost+found (an unreadable root-owned
  directory in the guest's /workspace would break its snapshots); the root directory is given to
  the sandbox's uid (fchown of the mounted root's fd) before the sandbox exists.
- the host kernel only ever mounts images warmbox made, once: the sandbox writes through the
  filesystem, never the image's bytes (root's 0600 file in the root-owned state dir), and an
  image is never mounted again after its sandbox (no fsck, no remount of what a guest shaped).
- the sandboxes' images are sparse, so their disk_mb together may exceed the host's free space
  (overcommit): each is refused when it alone could not fit what is free (config.check_disk_free).

Teardown (:func:`release`) is idempotent and finds leftovers: every mount stacked on the
directory is unmounted (UMOUNT_NOFOLLOW), and a loop device still backed by the image (a process
killed between configure and mount does not leave one) is reported. A directory still mounted is
never removed: release raises, and the caller's teardown is retried.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import struct
import subprocess
import time
from pathlib import Path

from warmbox.errors import SandboxStartError

IMAGE = "workspace.img"
MOUNT_POINT = "workspace"
FORMAT = "ext4-v1"  # part of a cached blank's name: change it when the mkfs options change
MKFS_OPTIONS = (
    "-q",
    "-F",
    "-t",
    "ext4",
    "-b",
    "4096",
    "-m",
    "0",
    "-L",
    "workspace",
    "-O",
    "^has_journal,^resize_inode",
    "-E",
    "assume_storage_prezeroed=1,nodiscard,root_owner=0:0",
)

_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LO_FLAGS_AUTOCLEAR = 4
_LO_FLAGS_DIRECT_IO = 16
_LOOP_CONFIG_SIZE = 304  # struct loop_config: fd, block_size, struct loop_info64 (232), reserved[8]
_LO_FLAGS_OFFSET = 8 + 52  # loop_config.info.lo_flags
_MS_NOSUID, _MS_NODEV = 2, 4
_UMOUNT_NOFOLLOW = 8
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _os_error(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


# --------------------------------------------------------------------------- blank images


def _blank_path(cache: Path, size_mb: int) -> Path:
    return cache / f"{FORMAT}-{size_mb}M.img"


def make_ext4(path: Path, size_mb: int, options: tuple[str, ...]) -> str:
    """Make ``path`` (a new file) a sparse ext4 of ``size_mb`` MiB with ``options`` and without
    lost+found (an unreadable root-owned directory in the user's filesystem): "" when done, else
    what failed. FileNotFoundError when e2fsprogs (mkfs.ext4, debugfs) is missing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size_mb << 20)  # sparse, so all zeros: what assume_storage_prezeroed means
    finally:
        os.close(fd)
    for argv in (["mkfs.ext4", *options, str(path)], ["debugfs", "-w", "-R", "rmdir lost+found", str(path)]):
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, check=False)
        if r.returncode != 0:
            return f"{argv[0]} exited {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}"
    return ""


def cached(cache: Path, size_mb: int) -> bool:
    """The blank of this size exists: :func:`attach` only copies and mounts (a few ms, no mkfs)."""
    return _blank_path(cache, size_mb).is_file()


def blank(cache: Path, size_mb: int) -> Path:
    """The cached empty filesystem of ``size_mb`` MiB (made on first use; atomic: temp + rename)."""
    final = _blank_path(cache, size_mb)
    if final.is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = cache / f".tmp-{os.getpid()}-{time.monotonic_ns()}.img"
    try:
        failed = make_ext4(tmp, size_mb, MKFS_OPTIONS)
        if failed:
            raise SandboxStartError(f"making the {size_mb} MiB workspace filesystem: {failed}")
        os.rename(tmp, final)  # a concurrent maker's identical image may be replaced: fine
    except FileNotFoundError as e:
        raise SandboxStartError(f"making the workspace filesystem needs e2fsprogs (mkfs.ext4, debugfs): {e}") from None
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    return final


def _sparse_copy(src: Path, dst_dir_fd: int, name: str) -> None:
    """Copy ``src`` into a new file ``name`` of the directory, keeping its holes holes."""
    s = os.open(src, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        d = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=dst_dir_fd)
        try:
            size = os.fstat(s).st_size
            os.ftruncate(d, size)
            pos = 0
            while pos < size:
                try:
                    data = os.lseek(s, pos, os.SEEK_DATA)
                except OSError as e:
                    if e.errno == errno.ENXIO:  # only a hole is left
                        break
                    raise
                end = os.lseek(s, data, os.SEEK_HOLE)
                while data < end:
                    n = os.copy_file_range(s, d, end - data, data, data)
                    if n <= 0:
                        raise OSError(errno.EIO, f"short copy of {src.name}")
                    data += n
                pos = end
        finally:
            os.close(d)
    finally:
        os.close(s)


# --------------------------------------------------------------------------- loop + mount


def _configure_loop(image_fd: int) -> tuple[int, int]:
    """A free loop device backed by ``image_fd``: (its number, an open fd of it)."""
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        flags = _LO_FLAGS_AUTOCLEAR | _LO_FLAGS_DIRECT_IO
        for _ in range(64):  # another process may take the free device first: EBUSY, try the next
            n = fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)
            lfd = os.open(f"/dev/loop{n}", os.O_RDWR | os.O_CLOEXEC)
            cfg = bytearray(_LOOP_CONFIG_SIZE)
            struct.pack_into("=II", cfg, 0, image_fd, 4096)
            struct.pack_into("=I", cfg, _LO_FLAGS_OFFSET, flags)
            try:
                fcntl.ioctl(lfd, _LOOP_CONFIGURE, bytes(cfg))
                return n, lfd
            except OSError as e:
                os.close(lfd)
                if e.errno == errno.EINVAL and flags & _LO_FLAGS_DIRECT_IO:
                    flags &= ~_LO_FLAGS_DIRECT_IO  # a backing filesystem without O_DIRECT: buffered
                    continue
                if e.errno != errno.EBUSY:
                    raise
        raise OSError(errno.EBUSY, "no free loop device")
    finally:
        os.close(ctl)


def attach(state_dir: str | Path, cache: Path, size_mb: int, uid: int, gid: int) -> None:
    """Give ``<state>/workspace`` its own ``size_mb`` MiB filesystem, its root owned by uid:gid
    (mode 0700). Already mounted (a repeated create): nothing to do."""
    state = Path(state_dir)
    mnt = state / MOUNT_POINT
    mnt.mkdir(mode=0o700, exist_ok=True)
    if os.lstat(mnt).st_dev != os.lstat(state).st_dev:  # a mount point: mounted already
        return
    src = blank(cache, size_mb)
    sfd = os.open(state, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            os.unlink(IMAGE, dir_fd=sfd)  # a half-made one of an earlier attempt
        except FileNotFoundError:
            pass
        _sparse_copy(src, sfd, IMAGE)
        ifd = os.open(IMAGE, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=sfd)
    finally:
        os.close(sfd)
    try:
        n, lfd = _configure_loop(ifd)
    finally:
        os.close(ifd)
    try:
        if _libc.mount(f"/dev/loop{n}".encode(), str(mnt).encode(), b"ext4", _MS_NOSUID | _MS_NODEV, None) != 0:
            raise _os_error(f"mounting the workspace disk on {mnt}")
    finally:
        os.close(lfd)  # from here the mount holds the device; unmounting it detaches it (autoclear)
    # the fresh filesystem's root, reached through the mount just made (nothing else has seen it)
    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _unescape(field: str) -> str:
    """A /proc/self/mountinfo path field (space, tab, newline and backslash are octal escapes)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and all(c in "01234567" for c in code):
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_under(root: str | Path) -> list[str]:
    """Mount points at or below ``root`` in this process's mount namespace (leak checks)."""
    root = str(root).rstrip("/")
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = _unescape(line.split(" ", 5)[4])
            if target == root or target.startswith(root + "/"):
                out.append(target)
    return out


def _mounts_at(path: Path) -> int:
    return sum(1 for t in mounts_under(path) if t == str(path))


def loops_backed_by(root: str | Path) -> dict[int, str]:
    """Loop devices whose backing file is at or below ``root``: {number: backing file}."""
    root = str(root).rstrip("/")
    out: dict[int, str] = {}
    try:
        names = os.listdir("/sys/block")
    except OSError:
        return out
    for name in names:
        if not name.startswith("loop"):
            continue
        try:
            with open(f"/sys/block/{name}/loop/backing_file") as f:
                backing = f.read().rstrip("\n")
        except OSError:
            continue  # not configured
        path = backing.removesuffix(" (deleted)")  # the image is unlinked already
        if path == root or path.startswith(root + "/"):
            out[int(name[4:])] = path
    return out


def release(state_dir: str | Path, timeout: float = 5.0) -> list[int]:
    """Unmount ``<state>/workspace`` (every mount stacked there). Idempotent; OSError if it stays
    mounted (busy past ``timeout``), so that nothing is removed under a live mount.

    Returns the loop devices still backed by the image once unmounted: none, unless another
    mount namespace copied the mount (they go by themselves, autoclear, when it lets go of it)."""
    state = Path(state_dir)
    mnt = state / MOUNT_POINT
    deadline = time.monotonic() + timeout
    while _mounts_at(mnt):
        if _libc.umount2(str(mnt).encode(), _UMOUNT_NOFOLLOW) == 0:
            continue
        e = ctypes.get_errno()
        if e in (errno.EINVAL, errno.ENOENT) and not _mounts_at(mnt):
            break
        if e != errno.EBUSY or time.monotonic() > deadline:
            raise OSError(e, f"unmounting {mnt}: {os.strerror(e)}")
        time.sleep(0.02)  # a last process of the sandbox still closing its files
    image = str(state / IMAGE)
    settle = time.monotonic() + 1.0
    while True:
        left = sorted(n for n, path in loops_backed_by(state).items() if path == image)
        if not left or time.monotonic() > settle:
            return left
        time.sleep(0.01)
