"""Directory trees as tar streams, written and extracted without ever following a symlink.

Stdlib-only, like :mod:`warmbox.protocol`: the guest agent imports it inside the sandbox (to pack
and unpack ``files.download_dir`` / ``files.upload_dir``) and the SDK on the caller's side, so an
archive coming from the other side is held to one rule on both: every member lands inside the
target directory. Extraction walks the target with directory fds, one component at a time, each
lstat'ed and its fd checked to be that inode (O_NOFOLLOW alone is not enough: gVisor ignores it
with O_DIRECTORY), so neither a member nor a symlink the archive (or anyone else) planted earlier
can redirect a write; a member with an absolute name, a ``..`` component, a symlink or hardlink
pointing out of the target, or a device or FIFO raises :class:`UnsafeArchive` naming it.
Packing walks the same way: symlinks are stored as symlinks, never followed; FIFOs, devices and
sockets are skipped (never opened).

A container image layer (host side, as root) is extracted under :class:`LayerRules`: the same walk,
plus what a root filesystem needs and a layer may hold: owners shifted into a uid range, full
modes (setuid, sticky), symlinks to anywhere (stored, never followed: they only ever resolve inside
a sandbox's root), OCI whiteouts turned into overlay ones, and a bound on the bytes written.
"""

from __future__ import annotations

import os
import stat

TYPE_CHECKING = False
if TYPE_CHECKING:
    import tarfile
    from typing import BinaryIO

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_COPY = 256 << 10
MAX_NAME = 4096
MAX_COMPONENT = 255  # NAME_MAX: a longer one is no file's name (an OSError, untyped, otherwise)
MAX_DEPTH = 200  # directories packed below the root (deeper ones are stored empty)
MAX_HEADER = 1 << 20  # bytes of one extended header (pax, GNU long name): tarfile holds it whole
MAX_LINKABLE = 1 << 16  # files an archive wrote that a later hardlink may name (their names' digests)


class UnsafeArchive(Exception):
    """A member that would land outside the target or is not a file, directory or link."""

    def __init__(self, member: str, reason: str) -> None:
        super().__init__(f"archive member {member[:200]!r}: {reason}")
        self.member = member


def member_parts(name: str) -> list[str]:
    """The components of a member's name, or UnsafeArchive (absolute, '..', empty, NUL)."""
    if not name or "\0" in name or len(name) > MAX_NAME:
        raise UnsafeArchive(name, "empty, too long or contains a NUL byte")
    if name.startswith("/"):
        raise UnsafeArchive(name, "absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(name, "contains a '..' component")
    if any(len(p.encode("utf-8", "surrogateescape")) > MAX_COMPONENT for p in parts):
        raise UnsafeArchive(name, f"a name component over {MAX_COMPONENT} bytes")
    return parts


def _link_inside(parts: list[str], target: str) -> bool:
    """Whether a symlink at ``parts`` pointing to ``target`` resolves inside the root: relative,
    its '..' components all leading (they climb real directories: the link's own parents, made by
    this extraction) and no higher than the root. A '..' after a name is refused: the name may be
    a symlink (``l -> ../..`` then ``x -> a/b/l/../victim`` looks inside by text but is not)."""
    if not target or target.startswith("/") or "\0" in target:
        return False
    depth = len(parts) - 1  # the link's directory, below the root
    named = False
    for comp in target.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            depth -= 1
            if depth < 0 or named:
                return False
        else:
            named = True
    return True


def open_dir(name: str, dir_fd: int, member: str, shown: str, *, create: bool, owner: int = -1) -> int:
    """An fd of the directory ``name`` in ``dir_fd`` (made if missing and ``create``; a directory
    made gets uid and gid ``owner`` if that is >= 0), never through a symlink: the entry is
    lstat'ed, opened, and the fd must be that very inode. (Not O_NOFOLLOW alone: gVisor follows a
    symlink opened with O_NOFOLLOW|O_DIRECTORY.)"""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        if not create:
            raise
        os.mkdir(name, 0o755, dir_fd=dir_fd)
        if owner >= 0:
            os.chown(name, owner, owner, dir_fd=dir_fd, follow_symlinks=False)
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeArchive(member, f"{shown} is not a directory (a symlink is never followed)")
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    fst = os.fstat(fd)
    if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise UnsafeArchive(member, f"{shown} was swapped while it was opened")
    return fd


class _Dirs:
    """Directory fds below the root, opened (and made) one component at a time, never through a link."""

    def __init__(self, root_fd: int, owner: int = -1) -> None:
        self.root = root_fd
        self.owner = owner  # of the directories made (a layer's: its uid base)
        self._open: dict[tuple[str, ...], int] = {}

    def trim(self) -> None:
        """Bound the fds held (between members only: a member's fds stay open while it is written)."""
        if len(self._open) > 256:
            self.close()

    def get(self, parts: list[str], member: str) -> int:
        fd = self.root
        for i, comp in enumerate(parts):
            key = tuple(parts[: i + 1])
            child = self._open.get(key)
            if child is None:
                child = open_dir(comp, fd, member, "/".join(key), create=True, owner=self.owner)
                self._open[key] = child
            fd = child
        return fd

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()


def _replace(name: str, dir_fd: int, member: str) -> None:
    """Make room for a new file or link at ``name``: an old file or link goes, a directory stays (refused)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise UnsafeArchive(member, "a directory is in its place")
    os.unlink(name, dir_fd=dir_fd)


def _bounded_info() -> type[tarfile.TarInfo]:
    """A TarInfo that refuses what would make tarfile hold an unbounded part of the stream in
    memory: an extended header (pax, GNU long name or link) beyond MAX_HEADER bytes (tarfile reads
    one whole, whatever size it claims) and sparse members (their maps are read whole too)."""
    import tarfile

    long_headers: tuple[bytes, ...] = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
    long_headers += (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)

    class Bounded(tarfile.TarInfo):
        def _proc_member(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:
            if self.type in long_headers and self.size > MAX_HEADER:
                raise UnsafeArchive(self.name, f"an extended header of {self.size} bytes (at most {MAX_HEADER})")
            if self.type == b"S":
                raise UnsafeArchive(self.name, "a sparse file")
            return super()._proc_member(tarfile)  # type: ignore[misc]

        def _proc_gnusparse_10(self, *args: object) -> None:
            raise UnsafeArchive(self.name, "a sparse file")

    return Bounded


class LayerRules:
    """How :func:`extract` unpacks a container image layer (host side, as root).

    uid_base: an entry's uid/gid u becomes host uid/gid ``uid_base + u``; one at or above 65536 is
    nobody's (65534). max_bytes: the most regular-file bytes (and max_members the most members)
    the layer may hold; beyond, UnsafeArchive. Modes are kept whole (setuid, setgid, sticky);
    symlinks may point anywhere (made, never followed: nothing on the host resolves them, writes
    through them are refused like any); OCI whiteouts become overlay ones (``.wh.NAME``: a 0/0
    character device NAME; ``.wh..wh..opq``: the ``trusted.overlay.opaque=y`` xattr on the
    directory; other ``.wh..wh.`` names are skipped); devices and FIFOs are refused; extended
    attributes in the archive are ignored.
    """

    WHITEOUT = ".wh."
    OPAQUE = ".wh..wh..opq"
    OPAQUE_XATTR = "trusted.overlay.opaque"

    def __init__(self, uid_base: int, *, max_bytes: int, max_members: int = 4_000_000) -> None:
        self.uid_base = uid_base
        self.max_bytes = max_bytes
        self.max_members = max_members
        self.written = 0  # regular-file bytes so far
        self.members = 0

    def owner(self, ident: int) -> int:
        return self.uid_base + (ident if 0 <= ident < 65536 else 65534)


def _key(parts: list[str]) -> bytes:
    import hashlib

    return hashlib.blake2b("/".join(parts).encode("utf-8", "surrogateescape"), digest_size=16).digest()


def extract(fileobj: BinaryIO, root_fd: int, *, layer: LayerRules | None = None) -> int:
    """Unpack a tar stream (read once, front to back) into the directory ``root_fd``; the number of
    members. UnsafeArchive for a member that breaks the rules (what came before it stays);
    tarfile.TarError for a stream that is not a tar archive. Memory stays bounded whatever the
    stream holds (members are not kept; extended headers are bounded). ``layer``: unpack an image
    layer under those rules instead (see LayerRules)."""
    import tarfile

    dirs = _Dirs(root_fd, layer.owner(0) if layer is not None else -1)
    files: set[bytes] = set()  # regular files this archive wrote: what a hardlink may name
    count = 0
    try:
        with tarfile.open(fileobj=fileobj, mode="r|", tarinfo=_bounded_info()) as tar:
            for m in tar:
                tar.members.clear()  # type: ignore[attr-defined]  # a stream's TarFile keeps every member it read
                dirs.trim()
                if layer is not None:
                    _layer_one(tar, m, dirs, files, layer)
                else:
                    _one(tar, m, dirs, files)
                count += 1
    finally:
        dirs.close()
    return count


def _one(tar: tarfile.TarFile, m: tarfile.TarInfo, dirs: _Dirs, files: set[bytes]) -> None:
    parts = member_parts(m.name)
    if not parts:
        if m.isdir():
            return  # "./": the root itself
        raise UnsafeArchive(m.name, "names the target directory itself")
    mode = m.mode & 0o777
    files.discard(_key(parts))  # whatever was there is replaced (or the member is refused)
    if m.isdir():
        fd = dirs.get(parts, m.name)
        os.chmod(fd, mode | 0o700)  # the owner keeps rwx: later members go inside
        return
    parent = dirs.get(parts[:-1], m.name)
    name = parts[-1]
    if m.isreg():
        _replace(name, parent, m.name)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
        try:
            src = tar.extractfile(m)
            assert src is not None
            while chunk := src.read(_COPY):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
            try:
                os.utime(fd, (m.mtime, m.mtime))
            except (OverflowError, ValueError):  # a time no file can have (NaN, 1e400): left as now
                pass
        finally:
            os.close(fd)
        if len(files) < MAX_LINKABLE:
            files.add(_key(parts))
    elif m.issym():
        if len(m.linkname.encode("utf-8", "surrogateescape")) >= MAX_NAME:
            raise UnsafeArchive(m.name, f"a symlink target of {len(m.linkname)} characters")
        if not _link_inside(parts, m.linkname):
            raise UnsafeArchive(m.name, f"a symlink out of the target ({m.linkname[:200]!r})")
        _replace(name, parent, m.name)
        os.symlink(m.linkname, name, dir_fd=parent)
    elif m.islnk():
        target = member_parts(m.linkname)
        if _key(target) not in files:
            why = f"not a file this archive wrote (or beyond its first {MAX_LINKABLE})"
            raise UnsafeArchive(m.name, f"a hardlink to {m.linkname[:200]!r}, {why}")
        src_dir = dirs.get(target[:-1], m.name)
        _replace(name, parent, m.name)
        os.link(target[-1], name, src_dir_fd=src_dir, dst_dir_fd=parent, follow_symlinks=False)
        if len(files) < MAX_LINKABLE:
            files.add(_key(parts))
    else:
        raise UnsafeArchive(m.name, "a device, FIFO or other special file")


def _layer_one(tar: tarfile.TarFile, m: tarfile.TarInfo, dirs: _Dirs, files: set[bytes], rules: LayerRules) -> None:
    rules.members += 1
    if rules.members > rules.max_members:
        raise UnsafeArchive(m.name, f"more than {rules.max_members} members in one layer")
    parts = member_parts(m.name)
    mode = m.mode & 0o7777
    uid, gid = rules.owner(m.uid), rules.owner(m.gid)
    if not parts:
        if not m.isdir():
            raise UnsafeArchive(m.name, "names the target directory itself")
        os.fchown(dirs.root, uid, gid)
        os.fchmod(dirs.root, mode)
        return
    name = parts[-1]
    files.discard(_key(parts))
    if name.startswith(LayerRules.WHITEOUT):
        parent = dirs.get(parts[:-1], m.name)
        if name == LayerRules.OPAQUE:
            os.setxattr(parent, LayerRules.OPAQUE_XATTR, b"y")
        elif not name.startswith(LayerRules.OPAQUE[:8]):  # ".wh..wh.": aufs bookkeeping, not content
            gone = name[len(LayerRules.WHITEOUT) :]
            if gone in ("", ".", ".."):
                raise UnsafeArchive(m.name, "a whiteout of no name")
            _replace(gone, parent, m.name)
            os.mknod(gone, stat.S_IFCHR | 0o600, os.makedev(0, 0), dir_fd=parent)
        return
    if m.isdir():
        fd = dirs.get(parts, m.name)
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
        return
    parent = dirs.get(parts[:-1], m.name)
    if m.isreg():
        rules.written += m.size
        if rules.written > rules.max_bytes:
            raise UnsafeArchive(m.name, f"the layer holds more than {rules.max_bytes} bytes")
        _replace(name, parent, m.name)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
        try:
            src = tar.extractfile(m)
            assert src is not None
            while chunk := src.read(_COPY):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)  # after the chown, which clears setuid/setgid
            try:
                os.utime(fd, (m.mtime, m.mtime))
            except (OverflowError, ValueError):
                pass
        finally:
            os.close(fd)
        if len(files) < MAX_LINKABLE:
            files.add(_key(parts))
    elif m.issym():
        if not m.linkname or "\0" in m.linkname or len(m.linkname.encode("utf-8", "surrogateescape")) >= MAX_NAME:
            raise UnsafeArchive(m.name, f"a symlink target that is empty or of {len(m.linkname)} characters")
        _replace(name, parent, m.name)
        os.symlink(m.linkname, name, dir_fd=parent)
        os.chown(name, uid, gid, dir_fd=parent, follow_symlinks=False)
        try:
            os.utime(name, (m.mtime, m.mtime), dir_fd=parent, follow_symlinks=False)
        except (OverflowError, ValueError):
            pass
    elif m.islnk():
        target = member_parts(m.linkname)
        if not target or _key(target) not in files:
            why = f"not a file this layer wrote (or beyond its first {MAX_LINKABLE})"
            raise UnsafeArchive(m.name, f"a hardlink to {m.linkname[:200]!r}, {why}")
        src_dir = dirs.get(target[:-1], m.name)
        _replace(name, parent, m.name)
        os.link(target[-1], name, src_dir_fd=src_dir, dst_dir_fd=parent, follow_symlinks=False)
        if len(files) < MAX_LINKABLE:
            files.add(_key(parts))
    else:
        raise UnsafeArchive(m.name, "a device, FIFO or other special file")


class _Exact:
    """A regular file's bytes as tar records them: exactly ``size`` (zeros if it shrank meanwhile)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.left = size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        if n <= 0:
            return b""
        data = os.read(self.fd, n) or bytes(n)
        self.left -= len(data)
        return data


def pack(root_fd: int, out: BinaryIO) -> None:
    """Write the tree below the directory ``root_fd`` as a tar stream (names relative to it).
    Nothing is followed: a symlink is stored as one, a FIFO, device or socket
    is skipped, and a name swapped for something else while it is packed is skipped too."""
    import tarfile

    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        _pack_dir(tar, root_fd, "", 0)


def _pack_dir(tar: tarfile.TarFile, fd: int, prefix: str, depth: int) -> None:
    """Depth first: the fds held are the current path's directories (at most MAX_DEPTH)."""
    for name in sorted(os.listdir(fd)):
        sub = _pack_one(tar, fd, name, prefix + name)
        if sub is None:
            continue
        try:
            if depth < MAX_DEPTH:
                _pack_dir(tar, sub, prefix + name + "/", depth + 1)
        finally:
            os.close(sub)


def _pack_one(tar: tarfile.TarFile, dir_fd: int, name: str, arcname: str) -> int | None:
    """Add one entry; a directory's fd (for its contents) is returned."""
    import tarfile

    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    info = tarfile.TarInfo(arcname)
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = int(st.st_mtime)
    if stat.S_ISLNK(st.st_mode):
        info.type = tarfile.SYMTYPE
        info.linkname = os.readlink(name, dir_fd=dir_fd)
        tar.addfile(info)
        return None
    if stat.S_ISDIR(st.st_mode):
        try:
            fd = open_dir(name, dir_fd, arcname, arcname, create=False)
        except (OSError, UnsafeArchive):
            return None  # swapped for a link or gone
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        return fd
    if not stat.S_ISREG(st.st_mode):
        return None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):  # swapped (a link, FIFO, device) since the stat
            return None
        info.size = fst.st_size
        tar.addfile(info, _Exact(fd, fst.st_size))  # type: ignore[arg-type]
    finally:
        os.close(fd)
    return None
