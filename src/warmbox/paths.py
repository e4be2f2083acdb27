"""Where a warmbox home keeps its state, and how a process is named across pid reuse."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

from warmbox.errors import ClusterError

DEFAULT_HOME = "~/.local/share/warmbox"
DEFAULT_RUNTIME_ROOT = "/var/lib/warmbox"


def default_home() -> Path:
    """``WARMBOX_HOME``, else ``~/.local/share/warmbox``: the registry, objects and settings."""
    env = os.environ.get("WARMBOX_HOME")
    if env:
        return Path(env).expanduser().resolve()
    return Path(DEFAULT_HOME).expanduser()


def resolve_home(home: Path | str | None) -> Path:
    """An explicit home (made absolute), or the default one."""
    return Path(home).expanduser().resolve() if home is not None else default_home()


def runtime_dir(home: Path) -> Path:
    """Where sandboxes' filesystems and runtime state live (WARMBOX_RUNTIME_DIR overrides).

    Separate from WARMBOX_HOME because every ancestor of a rootfs or bind-mount source must be
    traversable by the sandbox's unprivileged host uid, and a home such as /root is not.
    """
    env = os.environ.get("WARMBOX_RUNTIME_DIR")
    if env:
        return Path(env).expanduser().resolve()
    return Path(DEFAULT_RUNTIME_ROOT) / hashlib.sha256(str(home).encode()).hexdigest()[:12]


def image_cache_dir() -> Path:
    """The host-wide image and layer cache (``WARMBOX_IMAGE_CACHE`` overrides): content-named,
    shared by every warmbox home on the host."""
    return Path(os.environ.get("WARMBOX_IMAGE_CACHE") or f"{DEFAULT_RUNTIME_ROOT}/images")


def host_roots(home: Path) -> tuple[tuple[str, str], ...]:
    """The host directories a caller is never told, each with the word that stands for it in text
    a caller reads (a runtime log, an error's message), most specific first."""
    roots = {
        str(runtime_dir(home)): "<runtime>",
        str(home): "<home>",
        str(image_cache_dir()): "<images>",
        DEFAULT_RUNTIME_ROOT: "<warmbox>",
    }
    return tuple(sorted(((r, w) for r, w in roots.items() if r.strip("/")), key=lambda rw: -len(rw[0])))


def redact(text: str, roots: tuple[tuple[str, str], ...]) -> str:
    """``text`` with each of ``roots`` (see :func:`host_roots`) replaced by its word: what is below
    a root stays readable (``<runtime>/sandboxes/sb-…/config.json``), where it is on the host does not."""
    for root, word in roots:
        if root in text:
            text = text.replace(root, word)
    return text


_HOST_PATH = re.compile(
    r"(?<![\w/.<>-])/(?:usr|bin|sbin|lib|lib64|etc|var|opt|dev|sys|proc|root|home|srv|run|tmp|mnt|nix|snap)"
    r"(?:/[\w.+@:-]+)+"
)


def hide_host_paths(text: str) -> str:
    """``text`` about the host itself (which tiers it runs and why) as a tenant reads it: every
    absolute path under a system directory (``/usr/sbin/runc``, ``/dev/kvm``) becomes
    ``<host path>``. Not for text about a sandbox, whose own /usr and /tmp are its business."""
    return _HOST_PATH.sub("<host path>", text)


def owner_tag(pid: int, node: str = "") -> str:
    """``pid:starttime`` — names a process uniquely across pid reuse ("" if gone or a zombie);
    ``node/pid:starttime`` for a process of cluster node ``node`` (the registry is shared: other
    hosts read the tag)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):
            return ""
        tag = f"{pid}:{int(fields[19])}"
    except (OSError, ValueError, IndexError):
        return ""
    return f"{node}/{tag}" if node else tag


def owner_alive(owner: str, node: str = "") -> bool:
    """Whether the process an :func:`owner_tag` named still runs (the same one, not a reused pid).
    node: the cluster node asking. A tag of another node's process cannot be judged from this
    host's /proc: it counts as alive (that node's own duties, or its mark-down, settle it)."""
    where, _, tag = owner.rpartition("/")
    if where and where != node:
        return True
    pid, _, _ = tag.partition(":")
    return pid.isdigit() and owner_tag(int(pid), where) == owner


def cache_dir(home: Path) -> Path:
    """What a home keeps that can be measured again (the tier profile of ``warmbox bench profile``)."""
    return home / "cache"


def read_member_file(path: Path, what: str, max_bytes: int, *, private: bool) -> bytes:
    """A cluster member's file (its token, a certificate, a key), never through a symlink: a
    regular file of at most ``max_bytes``; a ``private`` one must be this process's user's and
    readable by no one else (whoever owns it chose it: a file planted where a secret was expected
    would let them act as any tenant), any other one writable by no one else. ``what`` names the
    file in the ClusterError raised otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ClusterError(f"cannot read {what}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ClusterError(f"{what} is not a regular file")
        if private and st.st_uid != os.geteuid():
            raise ClusterError(f"{what} is owned by uid {st.st_uid}, not by this process's user")
        if private and st.st_mode & 0o077:
            raise ClusterError(f"{what} is readable by others (mode {st.st_mode & 0o777:o}): chmod 600 it")
        if not private and st.st_mode & 0o022:
            raise ClusterError(f"{what} is writable by others (mode {st.st_mode & 0o777:o})")
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ClusterError(f"{what} is larger than {max_bytes} bytes")
    return data
