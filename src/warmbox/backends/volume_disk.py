"""Named volumes on the host: the ext4 image of each, and its mounts into container and gVisor sandboxes.

A volume is one sparse ext4 image of its size (``<home>/volumes/<id>.img``, root's 0600): the
size is the limit (a writer inside gets ENOSPC), and the host's disk pays only for what is
written. Its root directory belongs to uid 1000 on disk, the sandbox user of every tier. It has a
journal (unlike a workspace disk, a volume outlives its sandboxes and a host crash).

Container and gVisor tiers (:func:`attach`): the host mounts the image once — one loop device
and one ext4 superblock per volume, however many sandboxes mount it (two superblocks over one
image would corrupt it) — and gives each sandbox its own *idmapped* copy of that mount at
``<state>/volumes/<n>``, which the runtime bind-mounts at the volume's path:
- the loop device is found (``/sys/block/loop*/loop/backing_file``, then checked on the open
  device against the image's inode: a device cleared and reused meanwhile is not taken) or
  configured (LOOP_CONFIGURE, autoclear: it goes with its last mount), under an flock per volume;
- the filesystem is mounted detached (fsopen/fsconfig/fsmount: the same superblock when the
  device is mounted already), idmapped to the sandbox's uid range (``mount_setattr``
  MOUNT_ATTR_IDMAP with a user namespace mapping ``0 uid_base 65536``: on-disk uid 1000 is the
  sandbox's user in every sandbox, whatever its host uid range), read-only where asked
  (MOUNT_ATTR_RDONLY on that mount: the superblock stays read-write for the others), nosuid and
  nodev, and attached with ``move_mount``. The user namespace comes from a short-lived child
  that unshares one; the mount keeps a reference to it.
- the host never resolves a path inside a volume: it opens the image, the loop device and the
  per-sandbox mount point (in the root-owned state directory), nothing below a volume's root.

:func:`release` unmounts every volume of a sandbox (idempotent, also what a crash left); the
last unmount of a volume releases its superblock and, autoclear, its loop device. A mount that
stays is an error (the caller's teardown is retried), so the state directory is never removed
with a volume still mounted in it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path

from warmbox.backends import workspace_disk
from warmbox.backends.workspace_disk import _configure_loop, _libc, _os_error, make_ext4, mounts_under
from warmbox.errors import SandboxStartError, VolumeError
from warmbox.models import VolumeMount

MOUNTS = "volumes"  # <state>/volumes/<n>: the sandbox's idmapped copy of volume n
GUEST_UID = 1000  # the sandbox user on every tier: owner of a new volume's root directory
ID_RANGE = 65536
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
    "warmbox-volume",
    "-E",
    f"assume_storage_prezeroed=1,nodiscard,root_owner={GUEST_UID}:{GUEST_UID}",
)

# x86_64 and aarch64 share these numbers (the new mount API came after the tables converged)
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = 428, 429, 430, 431, 432
_SYS_MOUNT_SETATTR = 442
_FSOPEN_CLOEXEC = 0x1
_FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 1, 6
_FSMOUNT_CLOEXEC = 0x1
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_MOUNT_ATTR_IDMAP = 0x100000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_AT_EMPTY_PATH = 0x1000
_AT_FDCWD = -100
_LOOP_GET_STATUS64 = 0x4C05
_UNSHARE = "/usr/bin/unshare"  # util-linux
_UMOUNT_NOFOLLOW = 8


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _syscall(nr: int, *args: object) -> int:
    ret = _libc.syscall(ctypes.c_long(nr), *args)
    if ret < 0:
        raise _os_error(f"syscall {nr}")
    return int(ret)


# --------------------------------------------------------------------------- the image


def make_image(path: Path, size_mb: int) -> None:
    """Write a new volume image of ``size_mb`` MiB at ``path`` (atomic: a temp file renamed into
    place; sparse: mkfs writes ~1-2 MiB of metadata and journal). VolumeError if mkfs fails."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{time.monotonic_ns()}.img")
    try:
        failed = make_ext4(tmp, size_mb, MKFS_OPTIONS)
        if failed:
            raise VolumeError(f"making the {size_mb} MiB volume: {failed}")
        os.rename(tmp, path)
    except FileNotFoundError as e:
        raise VolumeError(f"making a volume needs e2fsprogs (mkfs.ext4, debugfs): {e}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def lock_path(disk: str | Path) -> Path:
    """The flock serialising the first mount of a volume's image (one loop device, one superblock)."""
    return Path(str(disk) + ".lock")


@contextlib.contextmanager
def _locked(disk: str) -> Iterator[None]:
    fd = os.open(lock_path(disk), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- loop device


def _loop_of(image_fd: int, disk: str) -> tuple[int, int] | None:
    """The loop device (number, open fd) backed by this image now, if any: the candidate named by
    sysfs is opened and its backing inode checked, so a device cleared (autoclear) and reused for
    another file between the look and the open is never taken."""
    st = os.fstat(image_fd)
    for n, backing in workspace_disk.loops_backed_by(os.path.dirname(disk)).items():
        if backing != disk:
            continue
        try:
            lfd = os.open(f"/dev/loop{n}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            info = fcntl.ioctl(lfd, _LOOP_GET_STATUS64, bytes(232))
            lo_device, lo_inode = struct.unpack_from("=QQ", info, 0)
            if lo_device == st.st_dev and lo_inode == st.st_ino:
                return n, lfd
        except OSError:
            pass  # cleared meanwhile (ENXIO)
        os.close(lfd)
    return None


# --------------------------------------------------------------------------- user namespace


def userns_fd(uid_base: int) -> int:
    """An fd of a new user namespace mapping ids 0..65535 to ``uid_base``.. (uid and gid).

    A child (``unshare --user``, spawned: a fork of the engine's large process cost 7-20 ms, the
    spawn ~4 ms) enters a new namespace and says so on a pipe; its maps are written from here
    (root in the parent namespace may map any range), its namespace opened, and it is killed."""
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    # the child's ends at high numbers: dup2 onto its own number would keep CLOEXEC
    child = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 32) for fd in (hold_r, ready_w)]
    try:
        pid = os.posix_spawn(
            _UNSHARE,
            [_UNSHARE, "--user", "--", "/bin/sh", "-c", "echo >&3; read x"],
            {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            file_actions=[(os.POSIX_SPAWN_DUP2, child[0], 0), (os.POSIX_SPAWN_DUP2, child[1], 3)],
        )
    except OSError:
        for fd in (ready_r, ready_w, hold_r, hold_w):
            os.close(fd)
        raise
    finally:
        for fd in child:
            os.close(fd)
    os.close(ready_w)
    os.close(hold_r)
    try:
        if os.read(ready_r, 1) != b"\n":
            raise OSError(errno.EPERM, "cannot create a user namespace for the volume's idmapped mount")
        for kind in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{kind}", "w") as f:
                f.write(f"0 {uid_base} {ID_RANGE}\n")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_r)
        os.close(hold_w)  # its read returns: it exits
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
        os.waitpid(pid, 0)


# --------------------------------------------------------------------------- mounts


def mount_point(state_dir: str | Path, index: int) -> Path:
    return Path(state_dir) / MOUNTS / str(index)


def _fs_mount(device: int) -> int:
    """A detached mount of the ext4 on /dev/loop<device> (its existing superblock if mounted)."""
    fsfd = _syscall(_SYS_FSOPEN, b"ext4", _FSOPEN_CLOEXEC)
    try:
        _syscall(_SYS_FSCONFIG, fsfd, _FSCONFIG_SET_STRING, b"source", f"/dev/loop{device}".encode(), 0)
        _syscall(_SYS_FSCONFIG, fsfd, _FSCONFIG_CMD_CREATE, None, None, 0)
        return _syscall(_SYS_FSMOUNT, fsfd, _FSMOUNT_CLOEXEC, _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV)
    finally:
        os.close(fsfd)


def _attach_one(volume: VolumeMount, target: Path, uid_base: int) -> None:
    ns = userns_fd(uid_base)
    try:
        with _locked(volume.disk):
            ifd = os.open(volume.disk, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                got = _loop_of(ifd, volume.disk)
                n, lfd = got if got is not None else _configure_loop(ifd)
            finally:
                os.close(ifd)
            try:
                mfd = _fs_mount(n)
            finally:
                os.close(lfd)  # from here the mount holds the device (autoclear: it goes with the last one)
        try:
            attr = _MountAttr(_MOUNT_ATTR_IDMAP | (_MOUNT_ATTR_RDONLY if volume.read_only else 0), 0, 0, ns)
            _syscall(_SYS_MOUNT_SETATTR, mfd, b"", _AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr))
            _syscall(_SYS_MOVE_MOUNT, mfd, b"", _AT_FDCWD, str(target).encode(), _MOVE_MOUNT_F_EMPTY_PATH)
        finally:
            os.close(mfd)  # a detached mount not moved anywhere goes with its fd
    finally:
        os.close(ns)


def attach(state_dir: str | Path, volumes: tuple[VolumeMount, ...], uid_base: int) -> list[Path]:
    """Mount each volume, idmapped to the sandbox's uid range, at ``<state>/volumes/<n>``; their
    mount points, in order. SandboxStartError (the caller tears down what was mounted)."""
    out: list[Path] = []
    if not volumes:
        return out
    base = Path(state_dir) / MOUNTS
    base.mkdir(mode=0o711, exist_ok=True)  # traversable: the runtime (gVisor's gofer) reaches the mounts
    for i, v in enumerate(volumes):
        target = mount_point(state_dir, i)
        target.mkdir(mode=0o700, exist_ok=True)
        if not _mounted_at(target):
            try:
                _attach_one(v, target, uid_base)
            except OSError as e:
                raise SandboxStartError(f"mounting volume {v.name!r}: {e.strerror or e}") from None
        out.append(target)
    return out


def make_mount_points(root: str | Path, paths: list[str]) -> None:
    """Make the directories ``paths`` (absolute, normalised) under the root filesystem directory
    ``root`` where missing (root's, 0755), so the runtime (a user namespace's root, which may not
    write the host's image) finds its mount points. Walked one component at a time from a
    directory fd with O_NOFOLLOW: a symlink (or anything not a directory) on the way is an error,
    never followed, so an image's link cannot make the host create a directory elsewhere."""
    for path in paths:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in path.strip("/").split("/"):
                try:
                    nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except FileNotFoundError:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                    nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise SandboxStartError(
                            f"cannot mount a volume at {path}: {part!r} in the image is not a directory"
                        ) from None
                    raise
                os.close(fd)
                fd = nxt
        finally:
            os.close(fd)


def _mounted_at(path: Path) -> int:
    return sum(1 for t in mounts_under(path) if t == str(path))


def release(state_dir: str | Path, timeout: float = 5.0) -> None:
    """Unmount every volume of a sandbox (``<state>/volumes/*``). Idempotent; OSError if one stays
    mounted past ``timeout`` (busy), so that nothing is removed under a live mount."""
    base = Path(state_dir) / MOUNTS
    deadline = time.monotonic() + timeout
    while True:
        left = sorted(mounts_under(base), key=len, reverse=True)  # deepest first
        if not left:
            return
        for target in left:
            if _libc.umount2(target.encode(), _UMOUNT_NOFOLLOW) == 0:
                continue
            e = ctypes.get_errno()
            if e in (errno.EINVAL, errno.ENOENT):
                continue  # gone meanwhile
            if e != errno.EBUSY or time.monotonic() > deadline:
                raise OSError(e, f"unmounting {target}: {os.strerror(e)}")
        if mounts_under(base):
            time.sleep(0.02)  # a last process of the sandbox still closing its files
