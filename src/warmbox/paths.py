"""Where a warmbox home keeps its state, and how a process is named across pid reuse."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

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
