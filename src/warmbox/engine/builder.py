"""Template builds: a :class:`~warmbox.templates.Template` spec becomes layers in the host's layer
store and a version in the registry.

The source resolves to layers (a built template's, an OCI archive's or registry image's, a Debian
tree). Then each step, in order: its cache key is sha256(previous key, the step, the content hash
of what it copies), and for a step that runs code also its owner and the build network
(:mod:`warmbox.templates.keys`). The step cache is the owner's own: a tenant's rows in the
registry (``build_steps``), the host's (no tenant: the in-process SDK, root on the unix socket)
in the host-wide layer store, so the operator's builds (the built-in ``browser``) are found by every
home of the host. A key the owner's cache knows reuses its layer (no sandbox; reported
``cached``). A COPY is pure content: one another owner made from the same files (bytes, modes and
mtimes: all a COPY layer takes from them) over the same image is reused too, but reported
``done`` (progress never tells a tenant what another built).
Otherwise

- RUN / apt / pip / npm run as root (or the spec's USER) in a *build sandbox*: a container-tier
  sandbox over the layers so far whose writable upper layer is a fresh host directory
  (``LaunchSpec.build_upper``), with the template's build network (default: none). The sandbox is
  destroyed, then the upper directory — written by untrusted code, walked by the layer store
  with directory fds, nothing followed — becomes the step's layer;
- COPY is done on the host: the files (from the build context the client sent as a tar,
  unpacked with :mod:`warmbox.safetar`) are laid out in a temporary tree owned by root (or
  ``chown``), their parent directories copying the image's owners and modes, and stored;
- ENV / WORKDIR / USER change the image's config only.

One build runs on a host at a time (a flock under the image cache: build sandboxes share the
layer uid range). A failing step raises TemplateBuildError naming it, with the end of its output
and the build log's path; nothing is recorded for the template then (the layers of the steps that
succeeded stay cached). At the end the image must have ``/usr/bin/python3`` (the guest agent runs
on it). Build logs stay under ``<home>/templates/logs/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import inspect
import io
import os
import shlex
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from warmbox.backends import workspace_disk
from warmbox.config import Template as WarmupTemplate
from warmbox.engine import egress, provision, resolve, teardown
from warmbox.engine.start import StartRecord
from warmbox.errors import (
    ImageRegistryUnreachable,
    StorageError,
    TemplateBuildError,
    TemplateError,
    TemplateNotFound,
    WarmboxError,
)
from warmbox.models import ImageRef, Limits, TemplateBuildEvent, TemplateInfo, Tenant
from warmbox.storage import layers as layer_store
from warmbox.storage import templates as storage_templates
from warmbox.storage.objects import open_store
from warmbox.storage.uidslots import LAYER_UID_BASE
from warmbox.templates import keys
from warmbox.templates import spec as ts
from warmbox.templates.context import unpack_context

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine

ProgressSink = Callable[[TemplateBuildEvent], object]  # may return an awaitable: awaited
STEP_TIMEOUT_S = 1800.0  # one RUN step, wall clock
BUILD_DISK_MB = 16 << 10  # what one RUN step may write (a sparse filesystem: the host pays what is written)
BUILD_LIMITS = Limits(memory_mb=1024, cpus=1.0, pids=1024, file_size_mb=4096, open_files=4096)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LOG_TAIL = 2000  # characters of a failed step's output in its error
_BUILD_WARMUP = WarmupTemplate(name="template-build", warmup_code=None)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# namespaces of the host-wide step cache (LayerStore.cached_step): the host owner's own steps, and
# COPY layers by content (any owner's). The bare keys of earlier versions are never read again.
_HOST_STEPS = keys.HOST_OWNER + "\n"
_CONTENT_STEPS = "content\n"


@dataclasses.dataclass
class _Image:
    """The image so far: layer digests (bottom first) and config."""

    layers: list[str]
    env: dict[str, str]
    workdir: str
    user: str


def _after(step: ts.Step, image: _Image) -> None:
    """What a layer step changes in the config: pip_install (and a RUN, whose ``pip`` is the
    venv's) puts the venv's commands on PATH."""
    if isinstance(step, (ts.PipInstall, ts.Run)):
        path = image.env.get("PATH", DEFAULT_PATH)
        if f"{ts.VENV}/bin" not in path.split(":"):
            image.env["PATH"] = f"{ts.VENV}/bin:{path}"


# ---- step commands (run by bash -c in the build sandbox)

# The install is retried: a mirror or caching proxy that answers a few files of many with an error
# (seen here: "403 Forbidden" from the apt proxy for 2-3 of ~130 packages, fine when asked again;
# apt's own Acquire::Retries does not retry an HTTP error) must not fail the build. What was
# fetched stays in apt's archive cache, so a retry downloads only what is missing.
_APT = """set -eo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -q -o Acquire::Retries=3
for try in 1 2 3 4 5; do
  if apt-get install -y -q -o Acquire::Retries=3 --no-install-recommends {packages} 2>&1 | tee /tmp/.wb-apt.log; then
    break
  fi
  if [ "$try" -eq 5 ] || ! grep -q "^E: Failed to fetch" /tmp/.wb-apt.log; then exit 100; fi
  echo "warmbox: some packages could not be fetched (try $try of 5), again in $((try * 2)) s" >&2
  sleep $((try * 2))
done
rm -f /tmp/.wb-apt.log
apt-get clean
rm -rf /var/lib/apt/lists/*
"""
# pip: a root-owned venv over the system's packages, run by Debian's pip (pip refuses nothing in a
# venv); a .pth in the system's site directory names the venv's site-packages, so the system's
# python3 and a sandbox's own venv (/home/user/.venv, system site packages) import them too
_PIP = """set -e
V={venv}
if [ ! -x "$V/bin/python3" ]; then python3 -m venv --system-site-packages --without-pip "$V"; fi
if ! "$V/bin/python3" -c 'import pip' 2>/dev/null; then
  echo "warmbox: pip_install needs pip in the image: apt_install(['python3-pip']) first" >&2; exit 1
fi
SITE=$("$V/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
DIST=$(python3 -c 'import sys; print("/usr/local/lib/python%d.%d/dist-packages" % sys.version_info[:2])')
mkdir -p "$DIST"
echo "$SITE" > "$DIST/warmbox-template-venv.pth"
PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \\
  "$V/bin/python3" -m pip install --no-input {options}{packages}
"""
# a RUN (a Dockerfile's, or .run()) runs with the same venv active, made first if the image has
# pip: `RUN pip install x` and `RUN python3 -m pip install x` install where pip_install does
# (Debian's python3 is externally managed: pip refuses to install into it), and the console
# scripts land on the image's PATH (_after)
_RUN = """V={venv}
if [ ! -e "$V/bin/pip" ] && command -v python3 >/dev/null && python3 -c 'import pip' 2>/dev/null \\
  && mkdir -p "$V" 2>/dev/null && [ -w "$V" ]; then
  [ -x "$V/bin/python3" ] || python3 -m venv --system-site-packages --without-pip "$V"
  SITE=$("$V/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  DIST=$(python3 -c 'import sys; print("/usr/local/lib/python%d.%d/dist-packages" % sys.version_info[:2])')
  mkdir -p "$DIST" && echo "$SITE" > "$DIST/warmbox-template-venv.pth"
  printf '#!/bin/sh\\nexec "%s/bin/python3" -m pip "$@"\\n' "$V" > "$V/bin/pip"
  chmod 755 "$V/bin/pip" && ln -sf pip "$V/bin/pip3"
fi
if [ -x "$V/bin/pip" ]; then export VIRTUAL_ENV="$V" PATH="$V/bin:$PATH"; fi
exec "$@"
"""
_NPM = """set -e
if ! command -v npm >/dev/null; then
  echo "warmbox: npm_install needs npm in the image: apt_install(['npm']) first" >&2; exit 1
fi
npm install --no-audit --no-fund {options}{packages}
npm cache clean --force >/dev/null 2>&1 || true
"""


def step_argv(step: ts.Step) -> list[str]:
    """The command a layer step runs (before the workdir/user wrapper)."""
    if isinstance(step, ts.AptInstall):
        return ["/bin/bash", "-c", _APT.format(packages=shlex.join(step.packages))]
    if isinstance(step, ts.PipInstall):
        opts = ""
        if step.index_url:
            opts += f"--index-url {shlex.quote(step.index_url)} "
        if step.find_links:
            opts += f"--find-links {shlex.quote(step.find_links)} "
        return ["/bin/bash", "-c", _PIP.format(venv=ts.VENV, options=opts, packages=shlex.join(step.packages))]
    if isinstance(step, ts.NpmInstall):
        opts = "-g " if step.global_ else ""
        return ["/bin/bash", "-c", _NPM.format(options=opts, packages=shlex.join(step.packages))]
    assert isinstance(step, ts.Run)
    inner = ["/bin/bash", "-c", step.shell] if step.shell else list(step.argv)
    return ["/bin/sh", "-c", _RUN.format(venv=ts.VENV), "sh", *inner]


def wrapped_argv(step: ts.Step, workdir: str, user: str) -> list[str]:
    """The step's command in the image's working directory (made if missing), as ``user``."""
    inner = step_argv(step)
    if user and user not in ("root", "0", "0:0"):
        name, _, group = user.partition(":")
        if name.isdigit():
            inner = ["setpriv", f"--reuid={name}", f"--regid={group or name}", "--clear-groups", "--", *inner]
        else:
            inner = ["runuser", "-u", name, *(["-g", group] if group else []), "--", *inner]
    return ["/bin/sh", "-c", 'mkdir -p "$1" && cd "$1" && shift && exec "$@"', "sh", workdir or "/", *inner]


# ---- the host-side walk of layers (never following a link)


def _lookup(layer_dirs: list[str], rel: str) -> os.stat_result | Literal[False] | None:
    """lstat of ``rel`` in the merged view of ``layer_dirs`` (top first): None if absent (or
    whited out), False if a component on the way is not a directory (a symlink: /bin -> usr/bin)."""
    parts = [p for p in rel.split("/") if p]
    for layer in layer_dirs:
        try:
            fd = os.open(layer, _DIR_FLAGS)
        except OSError:
            continue
        try:
            found: os.stat_result | Literal[False] | None = None
            for i, part in enumerate(parts):
                try:
                    st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    break
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # an overlay whiteout: deleted here
                    return None
                if i == len(parts) - 1:
                    found = st
                    break
                if not stat.S_ISDIR(st.st_mode):
                    return False
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nfd
            if found is not None:
                return found
        finally:
            os.close(fd)
    return None


def has_python(layer_dirs: list[str]) -> bool:
    st = _lookup(layer_dirs, "usr/bin/python3")
    return bool(st) and isinstance(st, os.stat_result) and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode))


def _image_owner(st: os.stat_result) -> tuple[int, int]:
    """An image file's owner as the image sees it (layers hold LAYER_UID_BASE + u)."""
    uid, gid = st.st_uid - LAYER_UID_BASE, st.st_gid - LAYER_UID_BASE
    return (uid if 0 <= uid < 65536 else 0, gid if 0 <= gid < 65536 else 0)


def _specials(directory: str, names: list[str]) -> list[str]:
    """What COPY leaves out: anything but files, directories and symlinks (never opened)."""
    out = []
    for n in names:
        mode = os.lstat(os.path.join(directory, n)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            out.append(n)
    return out


def copy_layer(out: Path, context: Path, step: ts.Copy, index: int, layer_dirs: list[str]) -> None:
    """Lay out a COPY step's files under ``out`` (a new empty directory of ours): its sources from
    ``context/<index>/<j>/`` (``f/<name>``: a file; ``d/``: a directory's contents), the
    destination's parents as the image has them (owner, mode) or root 0755."""
    uid, _, gid = (step.chown or "0:0").partition(":")
    owner = (int(uid), int(gid or uid))
    dest = step.dest
    dir_dest = dest.endswith("/") or len(step.sources) > 1
    plan: list[tuple[Path, str, bool]] = []  # (source in the context, destination path, is a dir)
    for j in range(len(step.sources)):
        base = context / str(index) / str(j)
        if (base / "d").is_dir():
            plan.append((base / "d", dest.rstrip("/") or "/", True))
            continue
        files = os.listdir(base / "f") if (base / "f").is_dir() else []
        if len(files) != 1:
            raise TemplateBuildError(
                f"COPY {step.sources[j]}: its files are missing from the build context (build with the SDK or CLI)"
            )
        target = (dest.rstrip("/") + "/" + files[0]) if dir_dest else dest
        plan.append((base / "f" / files[0], target, False))
    os.chmod(out, 0o755)
    for src, target, is_dir in plan:
        parts = [p for p in target.split("/") if p]
        parents = parts if is_dir else parts[:-1]
        here = out
        for k, part in enumerate(parents):
            rel = "/".join(parents[: k + 1])
            st = _lookup(layer_dirs, rel)
            if st is False or (st is not None and not stat.S_ISDIR(st.st_mode)):
                raise TemplateBuildError(
                    f"COPY to {target}: /{rel} (or a directory above it) is not a directory in the image "
                    "(a symlink such as /bin -> usr/bin?): copy to the real path"
                )
            here = here / part
            if not here.exists():
                here.mkdir()
                if st is None:  # new: the step's owner
                    os.chown(here, *owner)
                    os.chmod(here, 0o755)
                else:
                    os.chown(here, *_image_owner(st))
                    os.chmod(here, stat.S_IMODE(st.st_mode))
        if is_dir:
            shutil.copytree(src, here, symlinks=True, dirs_exist_ok=True, ignore=_specials)
            # what was copied gets the step's owner (lchown: never through a link)
            for root, dirs, files in os.walk(here):
                for name in dirs + files:
                    os.lchown(os.path.join(root, name), *owner)
        else:
            final = out / "/".join(parts)
            if os.path.lexists(final):
                raise TemplateBuildError(f"COPY: two sources land on {target}")
            if os.path.islink(src):
                os.symlink(os.readlink(src), final)
                st = os.lstat(src)  # the link's own mtime, as copy2 keeps a file's: the layer is the tree's
                os.utime(final, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
            else:
                shutil.copy2(src, final)
            os.lchown(final, *owner)


# ---- the build


def _release_disk(disk: Path) -> None:
    """Unmount a step's build disk and remove it (the upper layer in it was stored already)."""
    workspace_disk.release(disk)
    shutil.rmtree(disk)


def sweep(builds: Path) -> None:
    """Remove every build's work directory under ``builds`` (only under the host's build lock:
    then no build is running), unmounting the build disks a killed build left mounted."""
    if not builds.is_dir():
        return
    for entry in os.listdir(builds):
        work = builds / entry
        for disk in work.glob("step-*") if work.is_dir() else ():
            with contextlib.suppress(OSError):
                workspace_disk.release(disk)
        if not workspace_disk.mounts_under(work):  # never rmtree through a mount
            shutil.rmtree(work, ignore_errors=True)


def log_dir(engine: Engine) -> Path:
    """Where build logs are: TemplateInfo.build_log and TemplateBuildError.log name a file here."""
    return engine.home / "templates" / "logs"


def image_cache() -> Path:
    from warmbox.backends import microvm_image

    return microvm_image.cache_dir()


async def _host_lock(path: Path, waiting: Callable[[], Any]) -> int:
    """The host's build lock (an fd to close to let go); ``waiting`` is awaited once if another
    build holds it. Polled, so a cancelled wait leaves nothing locked."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    told = False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if not told:
                    told = True
                    await waiting()
                await asyncio.sleep(0.5)
    except BaseException:
        os.close(fd)
        raise


class Build:
    """One build (see the module docstring): ``await Build(...).run()``."""

    def __init__(
        self,
        engine: Engine,
        name: str,
        template: ts.Template,
        *,
        context: bytes | None = None,
        on_progress: ProgressSink | None = None,
        tenant: Tenant | None = None,
        description: str = "",
        disk_mb: int = BUILD_DISK_MB,
    ) -> None:
        self.engine = engine
        self.name = ts.check_name(name)
        self.template = ts.check_template(template)
        self.context_data = context
        self.on_progress = on_progress
        self.tenant = tenant
        self.owner = keys.owner(tenant.name if tenant is not None else None)
        self.description = description
        self.disk_mb = disk_mb
        self.store = layer_store.LayerStore(image_cache())
        self.total = len(template.steps)
        self.launched = 0  # build sandboxes started (0 on an all-cached rebuild)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_path = log_dir(engine) / f"{self.name}-{stamp}-{os.getpid()}.log"
        self._log: io.TextIOWrapper | None = None
        self._tail = ""

    # -- progress and log

    async def _event(self, step: int, text: str, status: str, elapsed: float = 0.0, detail: str = "") -> None:
        ev = TemplateBuildEvent(step, self.total, text, status, round(elapsed, 3), detail)  # type: ignore[arg-type]
        self._write(f"[{step}/{self.total}] {status:7} {text}" + (f" ({elapsed:.1f} s)" if elapsed else "") + "\n")
        if self.on_progress is not None:
            r = self.on_progress(ev)
            if inspect.isawaitable(r):
                await r

    def _write(self, text: str) -> None:
        if self._log is not None:
            self._log.write(text)
            self._log.flush()

    def _output(self, text: str) -> None:
        self._write(text)
        self._tail = (self._tail + text)[-LOG_TAIL:]

    # -- the steps

    async def run(self) -> TemplateInfo:
        log_dir(self.engine).mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.log_path, "w", encoding="utf-8", errors="replace") as log:
            self._log = log
            self._write(f"# warmbox template build {self.name}\n" + "\n".join(self.template.describe()) + "\n\n")
            for note in self.template.notes:
                self._write(f"# note: {note}\n")
            cache = image_cache()
            work = cache / "builds" / f"{os.getpid()}-{time.monotonic_ns()}"
            lock = cache / "build.lock"
            source = "FROM " + ts.describe_source(self.template.source)
            lock_fd = await _host_lock(lock, lambda: self._event(0, source, "running", 0, "waiting for another build"))
            try:
                await asyncio.to_thread(sweep, cache / "builds")  # what a killed build left (we hold the lock)
                work.mkdir(parents=True, mode=0o700)
                return await self._build(work)
            except TemplateBuildError as e:
                self._write(f"\n# FAILED: {e}\n")
                if not e.log:
                    e.log = self.log_path.name
                if not e.template:
                    e.template = self.name
                raise
            except WarmboxError as e:
                self._write(f"\n# FAILED: {type(e).__name__}: {e}\n")
                raise
            finally:
                self._log = None
                try:
                    await asyncio.to_thread(sweep, cache / "builds")
                finally:
                    os.close(lock_fd)

    async def _build(self, work: Path) -> TemplateInfo:
        t = self.template
        context: Path | None = None
        if self.context_data is not None:
            context = work / "context"
            await asyncio.to_thread(unpack_context, self.context_data, context)
        t0 = time.monotonic()
        await self._event(0, "FROM " + ts.describe_source(t.source), "running")
        image, resolved = await self._source()
        await self._event(0, "FROM " + ts.describe_source(t.source), "done", time.monotonic() - t0, resolved[:80])
        key = keys.source_key(t.source, resolved)
        for i, step in enumerate(t.steps):
            n = i + 1
            text = ts.describe(step)
            label = f"{n}: {text}"
            t1 = time.monotonic()
            if isinstance(step, ts.SetEnv):
                image.env.update(dict(step.pairs))
            elif isinstance(step, ts.SetWorkdir):
                image.workdir = step.path
            elif isinstance(step, ts.SetUser):
                image.user = step.name
            if not isinstance(step, ts.LAYER_STEPS):
                key = keys.step_key(key, step)
                await self._event(n, text, "config")
                continue
            # ENV/WORKDIR/USER before it are in the chain
            shared_key = ""  # a COPY's key in the content cache (every owner's)
            if isinstance(step, ts.Copy):
                if context is None or not (context / str(i)).is_dir():
                    raise TemplateBuildError(
                        f"{label}: its files are missing from the build context (build with the SDK or CLI)",
                        step=label,
                    )
                content, timed = await asyncio.to_thread(keys.tree_hashes, str(context / str(i)))
                shared_key = _CONTENT_STEPS + keys.step_key(key, step, timed)
                key = keys.step_key(key, step, content)
            else:
                key = keys.run_key(key, step, self.owner, t.build_network, step_argv(step))
            cached = await asyncio.to_thread(self._own_step, key)
            if cached is not None:
                image.layers.append(cached)
                _after(step, image)
                await self._event(n, text, "cached", time.monotonic() - t1, cached)
                continue
            await self._event(n, text, "running")
            shared = self.store.cached_step(shared_key) if shared_key else None
            if shared is not None:  # the same files (mtimes too) over the same image, copied by another owner
                await asyncio.to_thread(self._remember, key, shared)
                image.layers.append(shared)
                _after(step, image)
                await self._event(n, text, "done", time.monotonic() - t1, shared)
                continue
            self._write(f"\n## step {label}\n")
            try:
                if isinstance(step, ts.Copy):
                    assert context is not None
                    digest = await self._copy(work, context, step, i, image)
                else:
                    digest = await self._run_step(work, label, step, image)
            except TemplateBuildError as e:
                if not e.step:
                    e.step = label
                await self._event(n, text, "failed", time.monotonic() - t1, str(e)[:300])
                raise
            except WarmboxError as e:
                await self._event(n, text, "failed", time.monotonic() - t1, str(e)[:300])
                raise TemplateBuildError(
                    f"step {label} failed: {type(e).__name__}: {e}", template=self.name, step=label
                ) from None
            if shared_key:
                self.store.cache_step(shared_key, digest)
            await asyncio.to_thread(self._remember, key, digest)
            image.layers.append(digest)
            _after(step, image)
            await self._event(n, text, "done", time.monotonic() - t1, digest)
        return await self._record(image)

    # -- the owner's step cache

    def _own_step(self, key: str) -> str | None:
        """The layer this build's owner made for step ``key`` before, if its blob is here (or, in a
        cluster, fetched from the shared object store); None otherwise. Never another owner's."""
        if self.tenant is None:
            return self.store.cached_step(_HOST_STEPS + key)  # None if its blob is gone
        digest = self.engine.registry.templates.build_step(self.tenant.name, key)
        if digest is None or self.store.has(digest):
            return digest
        url = self.engine.settings().cluster.object_store
        if not url:
            return None  # collected since: the step runs again
        try:  # another node of the cluster made it (blobs travel content-addressed)
            storage_templates.fetch_layer(open_store(url), self.store, digest)
        except (StorageError, TemplateError):  # CorruptLayer included: refused, nothing kept
            return None
        return digest

    def _remember(self, key: str, digest: str) -> None:
        if self.tenant is None:
            self.store.cache_step(_HOST_STEPS + key, digest)
        else:
            self.engine.registry.templates.record_build_step(self.tenant.name, key, digest)

    async def _source(self) -> tuple[_Image, str]:
        """The source's layers and config, and what it resolved to (for the first cache key)."""
        src = self.template.source
        try:
            if isinstance(src, ts.BuiltSource):
                try:
                    ref = resolve.image_for(self.engine, src.name, self.tenant)
                except TemplateNotFound as e:
                    raise TemplateNotFound(
                        f"{e} (a FROM name without a tag or '/' is a template built here; "
                        f"for Docker Hub's image write {src.name}:latest)",
                        template=e.template,
                        step=e.step,
                    ) from None
                digests = [self._digest_of(d) for d in ref.layers]
                img = _Image(digests, dict(ref.env), ref.workdir, ref.user)
                return img, ref.image_id
            if isinstance(src, ts.DebianSource):
                # python3 always: the guest agent runs on it
                packages = sorted({*src.packages, "python3"})
                info = await asyncio.to_thread(layer_store.debian_layer, self.store, src.suite, packages)
                return _Image([info.digest], {"PATH": DEFAULT_PATH}, "", ""), info.digest
            from warmbox.storage import oci

            if isinstance(src, ts.OciSource):
                got = await asyncio.to_thread(oci.import_oci, self.store, Path(src.path))
            else:
                mirror = self.engine.settings().registry_mirror
                pulled, tls = ts.through_mirror(src.ref, src.tls_verify, mirror)
                try:
                    got = await asyncio.to_thread(oci.pull, self.store, pulled, tls_verify=tls)
                except ImageRegistryUnreachable as e:
                    via = (
                        f" (Docker Hub's mirror: [templates] registry_mirror = {mirror!r})" if pulled != src.ref else ""
                    )
                    raise ImageRegistryUnreachable(
                        f"{e}{via}", registry=e.registry, template=self.name, step="0: FROM " + src.ref
                    ) from None
        except (TemplateNotFound, ImageRegistryUnreachable):
            raise
        except TemplateBuildError as e:
            e.step = e.step or "0: FROM " + ts.describe_source(src)
            raise
        digests = [layer.digest for layer in got.layers]
        img = _Image(digests, dict(got.env), got.workdir, got.user)
        return img, ",".join(digests) + "|" + keys.canonical(ts.SetEnv(got.env)) + got.workdir + "|" + got.user

    def _digest_of(self, layer_dir: str) -> str:
        p = Path(layer_dir)
        if p.parent != self.store.dirs:
            raise TemplateError(f"layer {layer_dir} is not in the layer store {self.store.dirs}", template=self.name)
        return "sha256:" + layer_store.hex_of("sha256:" + p.name)

    def _ref(self, image: _Image) -> ImageRef:
        dirs = tuple(self.store.get(d).path for d in image.layers)
        env = tuple(image.env.items())
        iid = layer_store.image_id_of(image.layers, env, image.workdir, image.user)
        return ImageRef(self.name, 0, iid, dirs, env, image.workdir, image.user)

    async def _copy(self, work: Path, context: Path, step: ts.Copy, index: int, image: _Image) -> str:
        out = work / f"copy-{index}"
        out.mkdir(mode=0o755)
        dirs = [self.store.get(d).path for d in reversed(image.layers)]
        await asyncio.to_thread(copy_layer, out, context, step, index, dirs)
        info = await asyncio.to_thread(self.store.add_tree, out, owner_base=0)
        await asyncio.to_thread(shutil.rmtree, out, True)
        return info.digest

    async def _run_step(self, work: Path, label: str, step: ts.Step, image: _Image) -> str:

        # the step's writes go to a filesystem of BUILD_DISK_MB of its own (a sparse ext4, as a
        # sandbox's /workspace): a step filling it gets ENOSPC, never the host's disk full
        disk = work / f"step-{label.split(':')[0]}"
        disk.mkdir(mode=0o700)
        try:
            await asyncio.to_thread(
                workspace_disk.attach, disk, image_cache() / "disks", self.disk_mb, LAYER_UID_BASE, LAYER_UID_BASE
            )
        except OSError as e:
            raise TemplateBuildError(f"step {label}: its build disk: {e.strerror or e}", step=label) from None
        try:
            return await self._run_on(disk / workspace_disk.MOUNT_POINT / "upper", label, step, image)
        finally:
            await asyncio.to_thread(_release_disk, disk)

    async def _run_on(self, upper: Path, label: str, step: ts.Step, image: _Image) -> str:
        upper.mkdir(mode=0o755)
        ref = await asyncio.to_thread(self._ref, image)
        spec = provision.LaunchSpec(
            StartRecord.internal("container", self.name, STEP_TIMEOUT_S + 300, BUILD_LIMITS, self.tenant),
            image=ref,
            build_upper=str(upper),
        )
        argv = wrapped_argv(step, image.workdir, image.user)
        env = {**image.env, "DEBIAN_FRONTEND": "noninteractive"}
        self._tail = ""
        self.launched += 1
        got = await provision.launch(self.engine, spec, provision.Cold(_BUILD_WARMUP))
        sid = got.sandbox_id
        self._write(f"# build sandbox {sid}\n")
        try:
            net = self.template.build_network
            if net.mode != "none":
                from warmbox.network.policy import Network

                await egress.update(
                    self.engine, sid, "internet" if net.mode == "internet" else Network(allow=net.allow), got.session
                )
            r = await got.session.exec(
                argv,
                env=env,
                timeout_s=STEP_TIMEOUT_S,
                max_output=1 << 20,
                on_stdout=self._output,
                on_stderr=self._output,
                what="template build",
            )
        finally:
            await got.session.close()
            with contextlib.suppress(WarmboxError):
                await teardown.destroy(self.engine, sid, "template build step done")
        if r.exit_code != 0 or r.timed_out or r.oom_killed:
            why = (
                f"timed out after {STEP_TIMEOUT_S:g} s"
                if r.timed_out
                else "hit the memory limit (OOM kill)"
                if r.oom_killed
                else f"exited {r.exit_code}"
            )
            raise TemplateBuildError(
                f"step {label} {why}; the end of its output:\n{self._tail.strip()}\n(build log: {self.log_path.name})",
                template=self.name,
                step=label,
                log=self.log_path.name,
            )
        info = await asyncio.to_thread(self.store.add_tree, upper, owner_base=LAYER_UID_BASE)
        return info.digest

    async def _record(self, image: _Image) -> TemplateInfo:
        dirs = await asyncio.to_thread(lambda: [self.store.get(d).path for d in reversed(image.layers)])
        if not await asyncio.to_thread(has_python, dirs):
            raise TemplateBuildError(
                "the image has no /usr/bin/python3: the guest agent needs it (install python3, "
                "e.g. apt_install(['python3']) or FROM base)",
                template=self.name,
                step=f"{self.total}: end",
            )
        env = tuple(image.env.items())
        t = self.template
        size = sum(self.store.get(d).size_bytes for d in image.layers)
        info = TemplateInfo(
            name=self.name,
            version=0,
            image_id=layer_store.image_id_of(image.layers, env, image.workdir, image.user),
            layers=tuple(image.layers),
            env=env,
            workdir=image.workdir,
            user=image.user,
            warmup_code=t.warmup_code,
            warmup_commands=t.warmup_commands,
            source=ts.describe_source(t.source),
            spec_hash=keys.spec_hash(t),
            size_bytes=size,
            created_at=time.time(),
            build_log=self.log_path.name,  # a name in log_dir(): no host path reaches a caller
            tenant=self.tenant.name if self.tenant is not None else "",
            description=self.description,
        )
        url = self.engine.settings().cluster.object_store
        if url:  # a cluster: the blobs go first, so no node sees a version it cannot fetch
            await asyncio.to_thread(storage_templates.share_layers, open_store(url), self.store, info.layers)
        recorded = storage_templates.add_template(self.engine.registry, self.store, info)  # its layers pinned
        self._write(f"\n# recorded {recorded.name} version {recorded.version} ({recorded.image_id})\n")
        return recorded


async def build(
    engine: Engine,
    name: str,
    template: ts.Template,
    *,
    context: bytes | None = None,
    on_progress: ProgressSink | None = None,
    tenant: Tenant | None = None,
    disk_mb: int = BUILD_DISK_MB,
) -> TemplateInfo:
    """Build ``template`` as the next version of ``name`` (see the module docstring). disk_mb: the
    most one RUN step may write, MiB."""
    b = Build(engine, name, template, context=context, on_progress=on_progress, tenant=tenant, disk_mb=disk_mb)
    return await b.run()
