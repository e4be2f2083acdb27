"""Host-side file operations on directories a sandbox can write — the only ones warmbox does.

Rule (see design.md): no operation as root resolves a path *inside* a directory the sandbox
can write. Such a directory's own name lives in a root-owned state dir, so opening it is safe;
everything below it is the guest's and may be a symlink, hardlink, FIFO or device by the time
the host looks. So:

- single entries are reached relative to a directory fd, never followed (``O_NOFOLLOW``,
  ``AT_SYMLINK_NOFOLLOW``), created only with ``O_CREAT|O_EXCL``, never chowned by path;
- whole trees (a memory snapshot's /workspace) are archived and unpacked by GNU tar running
  as the directory's *owner* (the sandbox's host uid, no supplementary groups): the kernel
  then allows it exactly what the sandbox itself could do, whatever the tree holds. tar keeps
  symlinks as data (absolute ones too), keeps sparse files sparse, and its output is bounded.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

from warmbox.errors import NoSpace, StorageError

TAR = "/bin/tar"
_CHUNK = 1 << 20


def open_dir(path: str | Path) -> int:
    """An fd of the directory ``path`` (its last component is not followed if a symlink)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def create_marker(directory: str | Path, name: str, uid: int, gid: int, mode: int = 0o644) -> None:
    """Create the empty file ``directory/name`` as a new inode owned by ``uid:gid`` (``fchown``
    of the fd just created, never a chown by path); never follows or reuses what is there.
    Whatever already has the name (a guest-planted symlink, say) is unlinked — the link
    itself, never its target — and the file made anew."""
    dfd = open_dir(directory)
    try:
        for _ in range(8):  # the guest may keep planting the name: bounded
            try:
                fd = os.open(
                    name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd
                )
            except FileExistsError:
                try:
                    os.unlink(name, dir_fd=dfd)
                except IsADirectoryError:
                    os.rmdir(name, dir_fd=dfd)  # empty only; a full one fails (the guest's doing)
                except FileNotFoundError:
                    pass
                continue
            try:
                os.fchown(fd, uid, gid)
            finally:
                os.close(fd)
            return
        raise FileExistsError(17, f"{name} keeps being recreated in {directory}")
    finally:
        os.close(dfd)


def remove_entry(directory: str | Path, name: str) -> None:
    """Unlink ``directory/name`` itself (a symlink is removed, not followed); gone already is fine."""
    dfd = open_dir(directory)
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass
    finally:
        os.close(dfd)


def is_socket(directory: str | Path, name: str) -> bool:
    """``directory/name`` exists and is a unix socket itself (not a symlink to one)."""
    try:
        dfd = open_dir(directory)
    except OSError:
        return False
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return False
    finally:
        os.close(dfd)
    return stat.S_ISSOCK(st.st_mode)


def owner(directory: str | Path) -> tuple[int, int]:
    """(uid, gid) of the directory itself."""
    dfd = open_dir(directory)
    try:
        st = os.fstat(dfd)
    finally:
        os.close(dfd)
    return st.st_uid, st.st_gid


def _as_owner(directory: str | Path) -> dict:
    """subprocess arguments that run a child as the directory's owner, in it, with no groups."""
    uid, gid = owner(directory)
    kw: dict = {"cwd": str(directory), "umask": 0o077}
    if uid != os.geteuid():
        kw.update(user=uid, group=gid, extra_groups=[])
    return kw


async def _tail(stream: asyncio.StreamReader, keep: int = 4096) -> bytes:
    """Read a stream to its end, keeping its last ``keep`` bytes."""
    out = b""
    while chunk := await stream.read(65536):
        out = (out + chunk)[-keep:]
    return out


async def tar_create(directory: str | Path, sink: Callable[[bytes], object], *, max_bytes: int, timeout: float) -> int:
    """Archive the contents of ``directory`` (as its owner) into ``sink`` (its return value is
    ignored: a file's write fits); returns the bytes written. StorageError past ``max_bytes``
    (tar is killed), on a tar failure or a timeout."""
    proc = await asyncio.create_subprocess_exec(
        TAR,
        "--sparse",
        "--numeric-owner",
        "--one-file-system",
        "--warning=no-file-ignored",
        "-cpf",
        "-",
        ".",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **_as_owner(directory),
    )
    assert proc.stdout is not None and proc.stderr is not None
    stdout = proc.stdout  # (pump is a closure: the narrowing above does not reach into it)
    written = 0
    too_big = False

    async def pump() -> None:
        nonlocal written, too_big
        while chunk := await stdout.read(_CHUNK):
            written += len(chunk)
            if written > max_bytes:
                too_big = True
                proc.kill()
                return
            sink(chunk)

    err = b""
    try:
        _, err = await asyncio.wait_for(asyncio.gather(pump(), _tail(proc.stderr)), timeout)
        rc = await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        raise StorageError(f"archiving {Path(directory).name}: tar took longer than {timeout:.0f} s") from None
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if too_big:
        raise StorageError(
            f"archiving {Path(directory).name}: more than {max_bytes} bytes (WARMBOX_SNAPSHOT_MAX_BYTES)"
        )
    if rc != 0:
        raise StorageError(
            f"archiving {Path(directory).name}: tar exited {rc}: {err.decode(errors='replace').strip()[-300:]}"
        )
    return written


async def find_sockets(directory: str | Path, *, limit: int, timeout: float) -> list[str]:
    """Up to ``limit`` unix sockets below ``directory`` (paths relative to it, without ``./``), found
    by ``find`` running as the directory's owner; its own filesystem only (a mount below it is not
    its tree). StorageError when find takes longer than ``timeout`` seconds (wall clock)."""
    proc = await asyncio.create_subprocess_exec(
        "/usr/bin/find",
        ".",
        "-xdev",
        "-mindepth",
        "1",
        "-type",
        "s",
        "-print0",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **_as_owner(directory),
    )
    assert proc.stdout is not None and proc.stderr is not None
    stdout = proc.stdout
    names: list[str] = []

    async def collect() -> None:
        buf = b""
        while len(names) < limit and (chunk := await stdout.read(65536)):
            buf += chunk
            *done, buf = buf.split(b"\0")
            names.extend(n.removeprefix(b"./").decode("utf-8", "replace") for n in done)
            buf = buf[-4096:]  # a name is at most PATH_MAX
        if len(names) >= limit:
            proc.kill()

    # find's exit status is not looked at: it fails only on directories their owner made
    # unreadable, which the sandbox could read no better (as the guest's own walk skipped them)
    try:
        await asyncio.wait_for(asyncio.gather(collect(), _tail(proc.stderr)), timeout)
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        raise StorageError(
            f"looking for sockets in {Path(directory).name}: find took longer than {timeout:.0f} s"
        ) from None
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return names[:limit]


async def tar_extract(directory: str | Path, archive: str | Path, *, timeout: float) -> None:
    """Unpack ``archive`` (a host file, read by the host) into ``directory`` as its owner."""
    fd = os.open(archive, os.O_RDONLY | os.O_CLOEXEC)
    try:
        proc = await asyncio.create_subprocess_exec(
            TAR,
            "--numeric-owner",
            "--no-overwrite-dir",
            "-xpf",
            "-",
            stdin=fd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            **_as_owner(directory),
        )
    finally:
        os.close(fd)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise StorageError(f"unpacking into {Path(directory).name}: tar took longer than {timeout:.0f} s") from None
    if proc.returncode != 0:
        # NoSpace: the directory's filesystem (a sandbox's /workspace disk) is full (ENOSPC, or
        # the short write a full filesystem gives tar)
        full = b"No space left on device" in err or b": Wrote only " in err
        raise (NoSpace if full else StorageError)(
            f"unpacking into {Path(directory).name}: tar exited {proc.returncode}: "
            f"{err.decode(errors='replace').strip()[-300:]}"
        )


LOG_TAIL = 64 << 10  # bytes kept of each runtime log of an ended sandbox
LOGS_KEPT = 500  # ended sandboxes whose logs are kept (oldest dropped first)


def log_tails(state_dir: str | Path, names: tuple[str, ...]) -> bytes:
    """The tails of a sandbox's runtime logs (runc/runsc/QEMU stderr, the agent's output, a
    Sentry panic), each under a ``==> name <==`` line. The logs sit in the root-owned state dir
    but their contents are the guest's: each is opened without following links, must be a
    regular file, and only its last LOG_TAIL bytes are read."""
    parts = []
    try:
        sfd = open_dir(state_dir)
    except OSError:
        return b""
    try:
        for name in names:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sfd)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    continue
                os.lseek(fd, max(0, st.st_size - LOG_TAIL), os.SEEK_SET)
                data = os.read(fd, LOG_TAIL)
            finally:
                os.close(fd)
            cut = " (tail)" if st.st_size > LOG_TAIL else " (empty)" if not data else ""
            parts.append(f"==> {name}{cut} <==\n".encode() + data + (b"" if data.endswith(b"\n") else b"\n"))
    finally:
        os.close(sfd)
    return b"".join(parts)


def keep_logs(state_dir: str | Path, names: tuple[str, ...], logs_dir: Path, sandbox_id: str) -> None:
    """Keep ``log_tails`` of an ending sandbox in ``logs_dir/<sandbox_id>.log`` (``warmbox logs``)."""
    data = log_tails(state_dir, names)
    if not data:
        return
    try:
        logs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = logs_dir / f".{sandbox_id}.tmp"
        tmp.write_bytes(data)
        os.rename(tmp, logs_dir / f"{sandbox_id}.log")
        kept = sorted(logs_dir.glob("sb-*.log"), key=lambda f: f.stat().st_mtime)
        for old in kept[:-LOGS_KEPT]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # only a convenience: never fail a destroy over it
