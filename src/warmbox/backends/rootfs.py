"""A sandbox's root from a template image (container and gVisor tiers): one overlay per sandbox.

``<state>/rootfs`` is an overlay mounted by the host when the sandbox is created: its lowerdirs are
the tier's small *agent layer* (:func:`agent_layer`: the guest agent under /opt/warmbox, warmbox's
/etc files, mount points) on top of the image's layers (``ImageRef.layers``, bottom first, shared
read-only by every sandbox of the image); its upper layer is the sandbox's own:

- an ordinary sandbox writes into ``<state>/rw``, a tmpfs of the sandbox's ``tmp_mb`` (its pages
  are charged to the sandbox's memory cgroup, like /tmp's): a writer gets ENOSPC at the bound, the
  host's disk is never touched, and the layer vanishes with the sandbox;
- a build sandbox (``SandboxSpec.build_upper``) writes into that host directory, which becomes the
  step's new layer; the overlay's workdir is ``<build_upper>.work`` beside it (same filesystem,
  outside everything the sandbox sees), removed at release.

The overlay is mounted ``nosuid,nodev`` with ``redirect_dir=off,metacopy=off,index=off`` so that an
upper layer holds only whole files, ordinary directories, whiteouts (0/0 character devices) and
``trusted.overlay.opaque`` directories: what a layer store can read without overlay's private
redirects. Teardown (:func:`release`) unmounts both (idempotent; a tree still mounted is never
removed) and is what the daemon's recovery runs too (``destroy`` of a sandbox whose process died).

Layers may be the output of earlier builds (untrusted RUN steps): the host never resolves a path
through them, except through the agent layer's own directories (it is the top lowerdir, and its
directories hide whatever a lower layer has at the same path). :func:`has_file` walks the layers
with ``O_NOFOLLOW`` directory fds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

from warmbox.errors import SandboxStartError
from warmbox.models import LAYER_UID_BASE, ImageRef

ROOT = "rootfs"  # the overlay's mount point in the state dir
RW = "rw"  # an ordinary sandbox's tmpfs holding upper/ and work/
META = "rootfs.json"  # what release needs: the build workdir (written before anything is mounted)
FORMAT = "agent-layer-v1"
# a mount's option string is one page: the lowerdirs' paths must fit in it
MAX_OPTIONS = 4000
_MS_NOSUID, _MS_NODEV, _MS_RDONLY = 2, 4, 1
_UMOUNT_NOFOLLOW = 8
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
OVERLAY_OPTIONS = "redirect_dir=off,metacopy=off,index=off,xino=off"
# the image's programs the guest agent needs (its interpreter; the tier adds its own)
AGENT_NEEDS = ("usr/bin/python3",)


def _os_error(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


# --------------------------------------------------------------------------- the agent layer


def agent_layer(
    images_dir: Path,
    variant: str,
    fill: Callable[[Path], None],
    sources: tuple[bytes, ...],
    owner: int = 0,
) -> Path:
    """The tier's agent layer ``<images_dir>/layer-<variant>-<hash>``, built once (temp dir +
    rename): ``fill(tmp)`` writes it, then every entry is given to ``owner`` (uid and gid; 0 for
    ordinary sandboxes, which read it as nobody like the image; LAYER_UID_BASE for build
    sandboxes, whose root owns it). ``sources``: the bytes its content follows from (hashed)."""
    h = hashlib.sha256(f"{FORMAT}:{variant}:{owner}".encode())
    for blob in sources:
        h.update(hashlib.sha256(blob).digest())
    final = images_dir / f"layer-{variant}-{h.hexdigest()[:16]}"
    if final.is_dir():
        return final
    images_dir.mkdir(parents=True, exist_ok=True)
    tmp = images_dir / f".tmp-layer-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir(mode=0o755)
    try:
        fill(tmp)
        if owner:
            for parent, dirs, files in os.walk(tmp):
                for name in (*dirs, *files):
                    os.lchown(os.path.join(parent, name), owner, owner)
            os.chown(tmp, owner, owner)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; theirs is identical
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------- checks of an image


def _entry(layer: str, rel: str) -> os.stat_result | bool | None:
    """lstat of ``rel`` in one layer, walked by directory fds that never follow a link: None if
    absent, False if a component is not a directory there (the layer hides what lies below)."""
    parts = [p for p in rel.split("/") if p]
    try:
        fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for name in parts[:-1]:
            try:
                nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                return None
            except OSError:  # a symlink, a file or a whiteout in the way
                return False
            os.close(fd)
            fd = nxt
        try:
            return os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
    finally:
        os.close(fd)


def has_file(layers: list[str], rel: str) -> bool:
    """The merged view of ``layers`` (top first) has ``rel`` (a file or a link to one: what a link
    points to is not looked at) — the topmost layer that says anything decides."""
    for layer in layers:
        st = _entry(layer, rel)
        if st is None:
            continue
        if st is False:
            return False
        assert isinstance(st, os.stat_result)
        whiteout = stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
        return not whiteout and not stat.S_ISDIR(st.st_mode)
    return False


def read_file(image: ImageRef, rel: str, limit: int = 1 << 20) -> bytes | None:
    """The bytes of the regular file ``rel`` in the merged view of the image's layers (the topmost
    layer that says anything decides): None when absent, whited out, not a regular file (a link is
    never followed) or larger than ``limit``."""
    parts = [p for p in rel.split("/") if p]
    for layer in reversed(image.layers):
        st = _entry(layer, rel)
        if st is None:
            continue
        if st is False or not stat.S_ISREG(st.st_mode) or st.st_size > limit:  # type: ignore[union-attr]
            return None
        try:
            fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            for name in parts[:-1]:
                nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = nxt
            ffd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
            try:
                if not stat.S_ISREG(os.fstat(ffd).st_mode):
                    return None
                data = os.read(ffd, limit + 1)
            finally:
                os.close(ffd)
        except OSError:
            return None
        finally:
            os.close(fd)
        return data if len(data) <= limit else None
    return None


def with_sandbox_user(image_file: bytes | None, ours: str) -> str:
    """An image's /etc/passwd or /etc/group with warmbox's entries (``ours``: the sandbox user
    1000 "user", root, nobody...) in place of the image's of the same name or id; the image's
    own (users a Dockerfile added, say) stay."""
    mine = [line.split(":") for line in ours.splitlines() if line]
    names = {f[0] for f in mine}
    ids = {f[2] for f in mine if len(f) > 2}
    kept = []
    for line in (image_file or b"").decode("utf-8", "replace").splitlines():
        f = line.split(":")
        if len(f) < 3 or f[0] in names or f[2] in ids:
            continue
        kept.append(line)
    return "\n".join([*ours.splitlines(), *kept]) + "\n"


def check_image(image: ImageRef, needs: tuple[str, ...], sandbox_id: str = "") -> None:
    """SandboxStartError naming what the image lacks of ``needs`` (paths relative to /), or a layer
    that is not a directory."""
    for layer in image.layers:
        if not os.path.isdir(layer) or os.path.islink(layer):
            raise SandboxStartError(
                f"template {image.template}:{image.version}: its layer {layer} is not a directory", sandbox_id
            )
    top_first = list(reversed(image.layers))
    missing = ["/" + rel for rel in needs if not has_file(top_first, rel)]
    if missing:
        raise SandboxStartError(
            f"template {image.template}:{image.version} cannot run the guest agent: it has no "
            f"{', '.join(missing)} (install Python 3 in the image)",
            sandbox_id,
        )


def stack(image: ImageRef) -> list[str]:
    """The image's layer dirs top first, each once: two steps that change nothing (or the same)
    make the same layer twice, and overlay refuses a lowerdir listed twice ("conflicting lowerdir
    path"). Dropping the lower copy changes nothing: every path it has, the upper copy has too,
    and the topmost layer that has a path decides it."""
    out: list[str] = []
    for layer in reversed(image.layers):
        if layer not in out:
            out.append(layer)
    return out


def lowerdir(agent: Path, image: ImageRef, sandbox_id: str = "") -> str:
    """The overlay's ``lowerdir=`` value: the agent layer, then the image's layers top first."""
    dirs = [str(agent), *stack(image)]
    for d in dirs:
        if any(c in d for c in ",:\\\n"):
            raise SandboxStartError(f"a layer path holds a character overlay cannot take: {d!r}", sandbox_id)
    value = ":".join(dirs)
    if len(value) > MAX_OPTIONS - 200:
        raise SandboxStartError(
            f"template {image.template}:{image.version} has too many layers ({len(image.layers)}) for one "
            "overlay mount: squash it",
            sandbox_id,
        )
    return value


# --------------------------------------------------------------------------- mount and release


def _mount(source: str, target: Path, fstype: str, flags: int, data: str) -> None:
    if _libc.mount(source.encode(), str(target).encode(), fstype.encode(), flags, data.encode()) != 0:
        raise _os_error(f"mounting {fstype} at {target}")


def mount(
    state_dir: str | Path,
    agent: Path,
    image: ImageRef,
    *,
    upper_mb: int = 0,
    build_upper: str = "",
    sandbox_id: str = "",
) -> Path:
    """Mount the sandbox's root at ``<state>/rootfs`` and return it. An ordinary sandbox's upper
    layer is a tmpfs of ``upper_mb`` MiB; a build sandbox's is ``build_upper`` (an empty directory,
    given to the image's root). On failure everything mounted here is released again."""
    state = Path(state_dir)
    lower = lowerdir(agent, image, sandbox_id)
    root = state / ROOT
    meta: dict[str, str] = {}
    if build_upper:
        upper = Path(build_upper)
        work = upper.with_name(upper.name + ".work")
        meta["workdir"] = str(work)
    _write_meta(state, meta)  # before any mount: a teardown of a half-made root finds the workdir
    try:
        root.mkdir(mode=0o755, exist_ok=True)
        if build_upper:
            fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                if os.listdir(fd):
                    raise SandboxStartError(f"the build's upper layer {upper} is not empty", sandbox_id)
                # the merged root's owner and mode are the upper's: the image's root, 0755
                os.fchown(fd, LAYER_UID_BASE, LAYER_UID_BASE)
                os.fchmod(fd, 0o755)
            finally:
                os.close(fd)
            work.mkdir(mode=0o700)
        else:
            rw = state / RW
            rw.mkdir(mode=0o700, exist_ok=True)
            _mount("tmpfs", rw, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={max(1, upper_mb)}m,mode=0700")
            upper, work = rw / "upper", rw / "work"
            upper.mkdir(mode=0o755)
            work.mkdir(mode=0o700)
        _mount(
            "overlay",
            root,
            "overlay",
            _MS_NOSUID | _MS_NODEV,
            f"lowerdir={lower},upperdir={upper},workdir={work},{OVERLAY_OPTIONS}",
        )
    except OSError as e:
        try:
            release(state)
        except OSError:
            pass  # the engine's teardown tries again
        raise SandboxStartError(f"the sandbox's root overlay: {e.strerror or e}", sandbox_id) from None
    except BaseException:
        try:
            release(state)
        except OSError:
            pass
        raise
    return root


def mount_readonly(target: Path, lowers: list[str]) -> None:
    """A read-only overlay of ``lowers`` (top first) at ``target`` (the microVM image build)."""
    _mount("overlay", target, "overlay", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, f"lowerdir={':'.join(lowers)}")


def _write_meta(state: Path, meta: dict[str, str]) -> None:
    tmp = state / (META + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f)
    os.rename(tmp, state / META)


def _mountinfo_targets() -> list[str]:
    from warmbox.backends.workspace_disk import _unescape

    with open("/proc/self/mountinfo") as f:
        return [_unescape(line.split(" ", 5)[4]) for line in f]


def unmount(path: Path, timeout: float = 5.0) -> None:
    """Unmount every mount stacked at ``path`` (UMOUNT_NOFOLLOW); OSError if one stays (busy
    past ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while str(path) in _mountinfo_targets():
        if _libc.umount2(str(path).encode(), _UMOUNT_NOFOLLOW) == 0:
            continue
        e = ctypes.get_errno()
        if e in (errno.EINVAL, errno.ENOENT) and str(path) not in _mountinfo_targets():
            break
        if e != errno.EBUSY or time.monotonic() > deadline:
            raise OSError(e, f"unmounting {path}: {os.strerror(e)}")
        time.sleep(0.02)


def release(state_dir: str | Path) -> None:
    """Unmount the root overlay and its tmpfs, remove a build's workdir. Idempotent; OSError when
    something stays mounted (then nothing is removed, and the teardown is retried)."""
    state = Path(state_dir)
    unmount(state / ROOT)
    unmount(state / RW)
    try:
        meta = json.loads((state / META).read_text())
    except (OSError, ValueError):
        meta = {}
    work = meta.get("workdir") if isinstance(meta, dict) else None
    if isinstance(work, str) and work.endswith(".work") and os.path.isabs(work):
        # the kernel's own scratch directory of a build's overlay (root's, never the sandbox's)
        shutil.rmtree(work, ignore_errors=True)
    for name in (ROOT, RW):
        try:
            os.rmdir(state / name)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno != errno.ENOTEMPTY:
                raise
    (state / META).unlink(missing_ok=True)
