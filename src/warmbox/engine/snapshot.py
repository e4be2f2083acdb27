"""Snapshot, pause, resume and fork — the engine's side (artifact format: storage/snapshots.py).

What a snapshot holds depends on the tier's capabilities. A tier without memory snapshots
(the runc tier on this host: CRIU cannot run on its kernel) snapshots its files — /workspace,
/tmp and /home/user, streamed as a tar by the guest itself, so the same code serves every
tier — plus the default code context's picklable globals (modules are re-imported by name);
the manifest says ``memory: false`` and restore starts fresh processes on the restored files.

Order of a pause, so that a crash at any point loses nothing: write the blob, write the
manifest (from here the snapshot exists), record it, and only then release the sandbox.
Each operation keeps its temp artifacts in one directory it holds locked (``_Op``); a pause
records itself there before it quiesces the agent. A process killed at any point leaves
that directory unlocked, and ``recover`` (run by the daemon's reaper and ``snapshots gc``)
removes it — after finishing a pause whose checkpoint had already stopped the runtime, or
telling a still-running sandbox's agent to listen again.
"""

from __future__ import annotations

import asyncio
import contextvars
import fcntl
import ipaddress
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from warmbox.backends import hostfs
from warmbox.backends.base import RuntimeVersioned, SnapshotCapable, TemplateCapable
from warmbox.engine import provision
from warmbox.engine.provision import Launched
from warmbox.engine.session import GuestSession
from warmbox.errors import (
    InvalidArgument,
    NoSpace,
    SandboxError,
    SandboxNotFound,
    SandboxStartError,
    SnapshotRuntimeMismatch,
    SnapshotUnsupported,
    StorageError,
    StorageFull,
    TemplateMismatch,
    WarmboxError,
)
from warmbox.lifecycle import Operation
from warmbox.models import (
    BackendHandle,
    Execution,
    ImageRef,
    Limits,
    SandboxInfo,
    StageTiming,
    State,
    Tenant,
    VolumeMount,
)
from warmbox.storage import snapshots as snaps
from warmbox.storage.objects import LocalObjectStore, ObjectStore

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine

STATE_FILE = "/tmp/.warmbox-context.pkl"
MAX_SNAPSHOT_BYTES = int(os.environ.get("WARMBOX_SNAPSHOT_MAX_BYTES", str(16 << 30)))  # raw tar, per snapshot
TAR_PATHS = ("workspace", "tmp", "home/user")
_TIMEOUT_S = 600.0

# Run in the user's default context. Defines nothing that outlives the cell.
_SAVE = r"""
def __warmbox_save():
    import json, pickle, types
    g = globals()
    mods, state, skipped = {}, {}, []
    for k, v in list(g.items()):
        if k.startswith("__") or k in ("display", "_"):
            continue
        if isinstance(v, types.ModuleType):
            mods[k] = v.__name__
            continue
        try:
            state[k] = pickle.dumps(v, protocol=5)
        except Exception:
            skipped.append(k)
    with open(__STATE_FILE__, "wb") as f:
        pickle.dump({"modules": mods, "state": state}, f, protocol=5)
    print(json.dumps(sorted(skipped)))
__warmbox_save()
del __warmbox_save
""".replace("__STATE_FILE__", repr(STATE_FILE))

_LOAD = r"""
def __warmbox_load():
    import importlib, json, os, pickle
    g = globals()
    with open(__STATE_FILE__, "rb") as f:
        saved = pickle.load(f)
    failed = []
    for k, name in saved["modules"].items():
        try:
            g[k] = importlib.import_module(name)
        except Exception:
            failed.append(k)
    for k, blob in saved["state"].items():
        try:
            g[k] = pickle.loads(blob)
        except Exception:
            failed.append(k)
    os.unlink(__STATE_FILE__)
    print(json.dumps(sorted(failed)))
__warmbox_load()
del __warmbox_load
""".replace("__STATE_FILE__", repr(STATE_FILE))


def store_for(engine: Engine) -> ObjectStore:
    """The configured object store: ``[cluster] object_store`` (the one every node shares), else
    WARMBOX_OBJECT_STORE, else a local directory under WARMBOX_HOME."""
    url = engine.settings().cluster.object_store or os.environ.get("WARMBOX_OBJECT_STORE", "")
    if url.startswith("s3://"):
        from warmbox.storage.objects import S3ObjectStore

        bucket, _, prefix = url[5:].partition("/")
        return S3ObjectStore(bucket, prefix, endpoint_url=os.environ.get("WARMBOX_S3_ENDPOINT") or None)
    if url:
        return LocalObjectStore(Path(url))
    return LocalObjectStore(engine.home / "objects")


def _workdir(engine: Engine) -> Path:
    d = engine.home / "tmp"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


OP_PREFIX = ".op-"
_OP_MIN_AGE_S = 5.0  # an op dir younger than this may not be locked by its creator yet
_RUNTIME_EXIT_S = 60.0  # a checkpointed runtime's exit, waited for by recovery


# the sandbox whose memory pause the current task runs (its sub-tasks inherit it): a wait for
# "the pause under way" from inside that pause would wait for itself
_own_pause: contextvars.ContextVar[str] = contextvars.ContextVar("warmbox_own_pause", default="")


def pause_running(engine: Engine, sandbox_id: str) -> bool:
    """Whether a memory pause of ``sandbox_id`` is under way in any process (the daemon's idle
    pause among them): its op directory records the sandbox and its creator holds the lock. Never
    the pause the calling task itself is part of."""
    if _own_pause.get() == sandbox_id:
        return False
    for path in _workdir(engine).glob(f"{OP_PREFIX}pause-*"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # ended meanwhile
        try:
            rec = os.open("op.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                fields = json.loads(os.read(rec, 1 << 16))
            finally:
                os.close(rec)
            if not isinstance(fields, dict) or fields.get("sandbox_id") != sandbox_id:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True  # its pauser holds it
        except (OSError, ValueError):
            continue  # not recorded yet, or ended meanwhile
        finally:
            os.close(fd)
    return False


async def wait_pause(engine: Engine, sandbox_id: str, timeout_s: float = 300.0) -> None:
    """Until no pause of ``sandbox_id`` is under way (or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while pause_running(engine, sandbox_id) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


class _Op:
    """The temp directory of one snapshot/restore operation, locked (flock) while it runs.

    Every temp artifact of the operation lives in it, so a killed process leaves one directory
    whose lock is free: ``recover`` (the daemon, ``snapshots gc``) removes it, whatever its age,
    or finishes what it recorded (a pause killed after its checkpoint).
    """

    def __init__(self, engine: Engine, kind: str) -> None:
        try:
            self.path = Path(tempfile.mkdtemp(prefix=f"{OP_PREFIX}{kind}-", dir=_workdir(engine)))
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise _storage_error(e, f"{kind}: temp space") from None
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    @classmethod
    def adopt(cls, path: Path) -> _Op | None:
        """Take over an orphaned op directory (None if someone else just did)."""
        op = cls.__new__(cls)
        op.path = path
        try:
            op.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(op.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(op.fd)
            return None
        return op

    def record(self, **fields) -> None:
        """What a recoverer needs to finish or undo the operation (written atomically)."""
        tmp = self.path / "op.json.tmp"
        tmp.write_text(json.dumps(fields))
        os.rename(tmp, self.path / "op.json")

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self.fd)

    def __enter__(self) -> _Op:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _run_code(session: GuestSession, code: str, sid: str) -> tuple[str, Execution]:
    """Run ``code`` in the default context: (its stdout, the execution); a guest failure raises."""
    try:
        ex = await session.run_code(code, timeout_s=_TIMEOUT_S, max_output=1 << 20)
    except InvalidArgument as e:  # the guest refused the request
        raise SandboxError(f"code context: {e}", sid) from None
    return ex.stdout, ex


async def _exec(
    session: GuestSession,
    argv: list[str],
    sid: str,
    *,
    sink: Callable[[bytes], object] | None = None,
    source: Path | None = None,
    max_output: int = 1 << 20,
) -> tuple[int, str]:
    """Run argv in the guest: stdout to ``sink(bytes)``, stdin from ``source``; (exit code, stderr tail)."""
    r = await session.exec(
        argv,
        timeout_s=_TIMEOUT_S,
        max_output=max_output,
        stdin=source,
        stdout_sink=sink if sink is not None else (lambda data: None),
        what=argv[0],
    )
    return r.exit_code, r.stderr[-2000:].strip()


async def snapshot(
    engine: Engine,
    sandbox_id: str,
    session: GuestSession | None,
    *,
    memory: bool = False,
    parent: str = "",
    env_names: tuple[str, ...] = (),
) -> snaps.SnapshotManifest:
    """Write a snapshot of a running sandbox (it keeps running)."""
    info, handle = engine.info(sandbox_id)
    engine.check(Operation.SNAPSHOT, info, handle)
    caps = engine.backend(info.tier).capabilities()
    if not caps.filesystem_snapshot:
        raise SnapshotUnsupported(f"tier {info.tier!r} cannot take snapshots")
    if memory and not caps.memory_snapshot:
        raise SnapshotUnsupported(
            f"tier {info.tier!r} cannot snapshot memory on this host "
            f"(filesystem and code-context state only: memory=False)"
        )
    if memory and not _pausing.get(sandbox_id):
        raise SnapshotUnsupported(
            "a memory snapshot stops the sandbox's runtime: use pause(memory=True), "
            "then resume() or create(from_snapshot=) to continue or fork it"
        )
    if memory:
        return await _memory_snapshot(engine, info, handle, session, parent=parent, env_names=env_names)
    store = store_for(engine)
    op = _Op(engine, "snapshot")
    work = op.path
    own = session is None
    blob: snaps.BlobWriter | None = None
    pickle_left = True  # the context's pickle in the guest's /tmp: removed by the tar command itself
    try:
        if session is None:
            session = await provision.connect(engine.backend(info.tier), handle)
        blob = snaps.BlobWriter(work)
    except BaseException as e:
        op.close()
        if own and session is not None:
            await session.close()
        if isinstance(e, OSError):
            raise _storage_error(e, f"snapshot of {sandbox_id}") from None
        raise
    try:
        text, done = await _run_code(session, _SAVE, sandbox_id)
        context_saved = done.error is None
        skipped: tuple[str, ...] = ()
        if context_saved:
            names = _names(text)
            context_saved = names is not None
            skipped = names or ()
        for last in (False, True):
            # compressed and hashed as it streams: the archive never lands on disk uncompressed
            code, err = await _stream_tar(session, blob, sandbox_id, last=last)
            pickle_left = code == 1 and not last
            if not pickle_left:
                break
            blob.discard()  # 1: a file changed while it was read: once more, then give up
            blob = snaps.BlobWriter(work)
        if code != 0:
            raise SandboxError(
                f"snapshot: tar exited {code}"
                + (" (files kept changing while they were read; stop writers and retry)" if code == 1 else "")
                + f": {err[-300:]}",
                sandbox_id,
            )
        try:
            sha, size, raw_size = blob.store(store)
        except OSError as e:
            raise _storage_error(e, f"snapshot of {sandbox_id}") from None
        m = _manifest(
            engine,
            info,
            parent,
            env_names,
            (sha, size, raw_size),
            memory=None,
            context_saved=context_saved,
            context_skipped=skipped,
        )
        try:
            snaps.save_manifest(store, m, work)
        except OSError as e:
            raise _storage_error(e, f"snapshot of {sandbox_id}") from None
        if not store.exists(snaps.blob_key(sha)):  # a gc raced the write: do not claim a snapshot exists
            store.delete(snaps.manifest_key(m.snapshot_id))
            raise StorageError(f"snapshot of {sandbox_id}: its blob vanished while it was written (a concurrent gc?)")
        engine.registry.snapshots.add_snapshot(m.snapshot_id, sandbox_id, m.created_at, size)
        return m
    finally:
        if blob is not None:
            blob.discard()
        op.close()
        if pickle_left:  # the tar command did not run to its end: never leave the pickle behind
            try:
                await _exec(session, ["/bin/rm", "-f", STATE_FILE], sandbox_id)
            except WarmboxError:
                pass
        if own:
            await session.close()


def _manifest(
    engine: Engine,
    info,
    parent: str,
    env_names: tuple[str, ...],
    files: tuple[str, int, int],
    *,
    memory: tuple[str, int, int] | None,
    context_saved: bool,
    context_skipped: tuple[str, ...],
) -> snaps.SnapshotManifest:
    """The manifest of a snapshot of ``info``: its shape, the blobs (sha256, stored, raw sizes)."""
    from warmbox.engine import egress

    lim = engine.registry.sandboxes.limits(info.sandbox_id)
    mem_sha, mem_size, mem_raw = memory or ("", 0, 0)
    record = egress.record_of(engine, info.sandbox_id)
    return snaps.SnapshotManifest(
        snapshot_id=snaps.new_snapshot_id(),
        sandbox_id=info.sandbox_id,
        parent=parent,
        created_at=time.time(),
        tier=info.tier,
        template=info.template,
        memory_mb=lim.memory_mb,
        cpus=lim.cpus,
        pids=lim.pids,
        file_size_mb=lim.file_size_mb,
        open_files=lim.open_files,
        tmp_mb=lim.tmp_mb,
        disk_mb=lim.disk_mb,
        memory=memory is not None,
        filesystem_sha256=files[0],
        filesystem_bytes=files[1],
        filesystem_raw_bytes=files[2],
        context_saved=context_saved,
        context_skipped=context_skipped,
        env_names=tuple(sorted(env_names)),
        memory_sha256=mem_sha,
        memory_bytes=mem_size,
        memory_raw_bytes=mem_raw,
        image_id=info.image_id,
        template_version=info.template_version,
        network=record.to_json() if record is not None else "",
        runtime=runtime_of(engine, info.tier) if memory is not None else "",
    )


def runtime_of(engine: Engine, tier: str) -> str:
    """What makes a memory image on this host for ``tier`` ("runsc 0.0~20240729.0"; "" : a tier
    whose images are not tied to a runtime version)."""
    backend = engine.backend(tier)
    return backend.runtime_version() if isinstance(backend, RuntimeVersioned) else ""


def check_runtime(engine: Engine, m: snaps.SnapshotManifest) -> None:
    """SnapshotRuntimeMismatch unless this host's runtime made ``m``'s memory image (a snapshot
    recorded without one was made by the tier's ``legacy_runtime``). Files-only snapshots pass."""
    if not m.memory:
        return
    backend = engine.backend(m.tier)
    if not isinstance(backend, RuntimeVersioned):
        return
    recorded, here = m.runtime or backend.legacy_runtime, backend.runtime_version()
    if recorded != here:
        raise SnapshotRuntimeMismatch(
            f"snapshot {m.snapshot_id} holds memory made by {recorded}, and this host runs {here}, which cannot "
            "load it: restore its files instead (a new sandbox from a files-only snapshot) or resume it on a "
            f"host with {recorded}",
            recorded=recorded,
            runtime=here,
        )


def _storage_error(e: OSError, what: str) -> StorageError:
    if e.errno in (28, 122):  # ENOSPC, EDQUOT
        return StorageFull(f"{what}: no space left for the artifact ({e.strerror})")
    return StorageError(f"{what}: {e.strerror or e}")


def _names(text: str) -> tuple[str, ...] | None:
    """The skipped-names line the save snippet printed (user code could have changed print)."""
    try:
        v = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    if not isinstance(v, list) or len(v) > 10000 or not all(isinstance(x, str) and len(x) < 256 for x in v):
        return None
    return tuple(v)


async def _stream_tar(session: GuestSession, blob: snaps.BlobWriter, sandbox_id: str, *, last: bool) -> tuple[int, str]:
    """tar the snapshot paths in the guest into ``blob``, bounded by MAX_SNAPSHOT_BYTES; (tar's exit
    code, its stderr's tail). The same command then removes the context's pickle, unless tar's
    1 (a file changed while read) is to be retried (``last`` False): one process, one round trip."""
    failed: list[OSError] = []
    written = 0

    def sink(data: bytes) -> None:
        nonlocal written
        if failed:
            return
        written += len(data)
        if written > MAX_SNAPSHOT_BYTES:
            failed.append(OSError(27, "snapshot larger than WARMBOX_SNAPSHOT_MAX_BYTES"))
            return
        try:
            blob.write(data)
        except OSError as e:
            failed.append(e)

    listing = " ".join(TAR_PATHS)
    keep = "" if last else "[ $rc -eq 1 ] || "
    # the contents of each path, not the mount points themselves (their owner/mode is the tier's);
    # -xdev: a named volume mounted below one is external state, not part of the snapshot;
    # a workspace disk's lost+found (mkfs's, root's alone: the microVM's has one) is not the user's
    code, err = await _exec(
        session,
        [
            "/bin/bash",
            "-c",
            f"cd / && find {listing} -xdev -mindepth 1 -path workspace/lost+found -prune -o -print0 "
            "| /bin/tar --null "
            "--no-recursion -T - --sparse --numeric-owner "
            "--warning=no-file-ignored -cpf -; "
            f"rc=$?; {keep}/bin/rm -f {STATE_FILE}; exit $rc",
        ],
        sandbox_id,
        sink=sink,
        max_output=MAX_SNAPSHOT_BYTES + 1,
    )
    if failed:
        first = failed[0]
        if first.errno == 27:
            raise StorageError(
                f"snapshot of {sandbox_id}: more than {MAX_SNAPSHOT_BYTES} bytes of files (WARMBOX_SNAPSHOT_MAX_BYTES)"
            )
        raise _storage_error(first, f"snapshot of {sandbox_id}")
    return code, err


_pausing: dict[str, bool] = {}
_releasing: set[str] = set()  # paused sandboxes this process is releasing right now


async def pause(
    engine: Engine,
    sandbox_id: str,
    session: GuestSession | None,
    *,
    memory: bool = False,
    parent: str = "",
    env_names: tuple[str, ...] = (),
    why: str = "",
) -> snaps.SnapshotManifest:
    """Snapshot, then release every resource; the sandbox is ``paused`` until resumed.
    why: recorded with the transition (an automatic pause says what caused it). Its duration is
    recorded as the sandbox's "pause" timing (the latest pause's, like "resume")."""
    t0 = time.perf_counter()
    _pausing[sandbox_id] = True
    own = _own_pause.set(sandbox_id)
    try:
        try:
            m = await snapshot(engine, sandbox_id, session, memory=memory, parent=parent, env_names=env_names)
        finally:
            _pausing.pop(sandbox_id, None)
        if session is not None:
            await session.close()
        await _release_paused(engine, sandbox_id, m, why)
    finally:
        _own_pause.reset(own)
    try:
        engine.registry.sandboxes.add_timings(
            [StageTiming(sandbox_id, "pause", (time.perf_counter() - t0) * 1e3, True)]
        )
    except WarmboxError:
        pass  # the pause is done and recorded; a busy registry only loses its duration
    return m


async def _release_paused(engine: Engine, sandbox_id: str, m: snaps.SnapshotManifest, why: str = "") -> None:
    """The snapshot is complete: record the pause first, then release. A process killed in
    between leaves a paused sandbox whose leftovers the daemon releases (its pauser is dead)."""
    info, handle = engine.info(sandbox_id)
    await engine._read_meters(info, handle, None)
    reason = f"paused to {m.snapshot_id}" + (f" ({why})" if why else "")
    _releasing.add(sandbox_id)
    try:
        engine.registry.sandboxes.set_state(sandbox_id, State.PAUSED, reason, owner=engine.owner)
        engine.registry.usage.finalize(sandbox_id)
        await engine.backend(info.tier).destroy(handle)
        from warmbox.engine import egress

        await egress.suspend(engine, sandbox_id)  # its policy waits for its resume (the secrets' values go)
        engine.registry.sandboxes.released(sandbox_id, engine.owner)  # from here a resume may start it again
    finally:
        _releasing.discard(sandbox_id)


async def _memory_snapshot(
    engine: Engine,
    info: SandboxInfo,
    handle: BackendHandle,
    session: GuestSession | None,
    *,
    parent: str,
    env_names: tuple[str, ...],
) -> snaps.SnapshotManifest:
    """Checkpoint processes + memory (the runtime's image) and /workspace beside it.

    The sandbox's runtime exits with the checkpoint; pause() then releases the rest. If the
    checkpoint fails, the agent is told to listen again and the sandbox keeps running.
    """
    backend = engine.backend(info.tier)
    if not isinstance(backend, SnapshotCapable):
        raise SnapshotUnsupported(f"tier {info.tier!r} cannot snapshot memory")
    sid = info.sandbox_id
    if session is None:
        session = await provision.connect(backend, handle)
    try:
        if not backend.capabilities().checkpoint_saves_workspace_sockets:
            await _refuse_workspace_sockets(engine, handle)
        if not backend.capabilities().checkpoint_saves_connections:
            await _refuse_open_connections(session, sid)
        op = _Op(engine, "pause")
        try:
            # from here on a killed pauser's work is finished or undone by ``recover``
            op.record(kind="pause", sandbox_id=sid, parent=parent, env_names=list(env_names))
            await session.quiesce(wait_closed=backend.capabilities().quiesce_drops_connection)
        except BaseException:
            op.close()
            raise
    finally:
        await session.close()
    image_dir = op.path / "image"
    image_dir.mkdir()
    checkpointed = False
    try:
        await backend.checkpoint(handle, image_dir)
        checkpointed = True
        (op.path / "checkpointed").touch()  # the runtime has stopped: only forward from here
        return await _store_checkpoint(engine, info, handle, op.path, parent, env_names)
    except BaseException as e:
        if not checkpointed:  # still running: let the agent listen again
            try:
                await backend.resume_listening(handle)
            except (OSError, WarmboxError):
                pass
            if isinstance(e, WarmboxError) and not await backend.alive(handle):
                # the failed checkpoint took the runtime with it: say so, and release the rest
                try:
                    await engine.destroy(sid, f"lost in a failed memory checkpoint: {e}")
                except WarmboxError:
                    pass
                raise SandboxError(
                    f"sandbox {sid} died in a failed memory checkpoint and was destroyed "
                    f"(its files are gone with it; the runtime's output is in its kept logs): {str(e)[:1400]}",
                    sid,
                ) from None
        elif isinstance(e, Exception) and (image_dir / "checkpoint.img").is_file():
            # storing failed (too big, disk full, ...) after the checkpoint stopped the runtime:
            # continue the sandbox from its own image, as if the pause had never been asked for
            try:
                await _revive(engine, backend, handle, image_dir)
            except WarmboxError as again:
                raise SandboxError(
                    f"pause of {sid} failed after its checkpoint ({str(e)[:200]}), and continuing "
                    f"the sandbox failed too ({str(again)[:200]}); recovery will finish or "
                    "release it",
                    sid,
                ) from None
        raise
    finally:
        op.close()


async def _revive(engine: Engine, backend: SnapshotCapable, handle: BackendHandle, image_dir: Path) -> None:
    """Continue a checkpointed sandbox in place from ``image_dir`` (same id, state dir, files)."""

    async def ready() -> GuestSession:
        session = await GuestSession.connect(handle.socket_path, handle.sandbox_id)
        try:
            await asyncio.wait_for(session.ping("the continued agent"), provision.AGENT_TIMEOUT_S)
        except BaseException:
            await session.close()
            raise
        return session

    from warmbox.engine import egress

    await egress.renew_prepared(engine, handle.sandbox_id)  # a link made before the start: again
    session = await backend.restore(handle, image_dir, ready)
    await session.close()


async def _store_checkpoint(
    engine: Engine, info, handle, work: Path, parent: str, env_names: tuple[str, ...]
) -> snaps.SnapshotManifest:
    """Archive /workspace beside the checkpoint image in ``work``/image, store both, write the
    manifest and record the snapshot (the runtime has stopped: nothing changes under the tar)."""
    store = store_for(engine)
    sid = info.sandbox_id
    image = work / "image" / "checkpoint.img"
    if not image.is_file():
        raise SandboxStartError("the checkpoint left no image", sid)
    raw = work / "workspace.tar"

    async def workspace() -> tuple[str, int, int]:
        # the tree is the guest's, so tar runs as its owner (hostfs): symlinks kept, sparse files sparse
        try:
            with open(raw, "wb") as out:

                def write(data: bytes) -> None:
                    out.write(data)

                await hostfs.tar_create(
                    Path(handle.state_dir) / "workspace", write, max_bytes=MAX_SNAPSHOT_BYTES, timeout=_TIMEOUT_S
                )
        except StorageError as e:
            raise StorageError(f"snapshot of {sid}: {e}") from None
        return await asyncio.to_thread(snaps.put_blob, store, raw, work)

    # the image is stored in a thread while tar reads /workspace: the two touch different files
    # (gVisor's image is compressed by runsc already: zstd at level 1 is little more than a copy)
    got = await asyncio.gather(
        workspace(), asyncio.to_thread(snaps.put_blob, store, image, work, 1), return_exceptions=True
    )
    for r in got:
        if isinstance(r, OSError):
            raise _storage_error(r, f"snapshot of {sid}") from None
        if isinstance(r, BaseException):
            raise r
    (fs_sha, fs_size, fs_raw), (mem_sha, mem_size, mem_raw) = got  # type: ignore[misc]
    m = _manifest(
        engine,
        info,
        parent,
        env_names,
        (fs_sha, fs_size, fs_raw),
        memory=(mem_sha, mem_size, mem_raw),
        context_saved=True,
        context_skipped=(),
    )
    snaps.save_manifest(store, m, work)
    engine.registry.snapshots.add_snapshot(m.snapshot_id, sid, m.created_at, m.size_bytes, m.runtime)
    # kept unpacked, once stored (until then a failure continues the sandbox from it): a tier that
    # starts every sandbox from a template reads it in place on each restore; another tier's
    # resume of this pause takes it (and drops it) instead of unpacking the blob
    _keep_memory(engine, m.snapshot_id, image)
    return m


# /proc/net/tcp states a checkpoint cannot save over a real link: every connected and handshake
# state (ESTABLISHED, SYN_SENT, SYN_RECV, FIN_WAIT1/2, TIME_WAIT, CLOSE_WAIT, LAST_ACK, CLOSING)
_UNSAVED_TCP_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0B": "CLOSING",
}
_NET_TABLE_MAX = 1 << 20  # bytes of each /proc/net/tcp{,6} read from the guest


def open_connections(table: bytes, v6: bool) -> list[str]:
    """The connections of a guest's /proc/net/tcp (``v6``: tcp6) that a checkpoint cannot save:
    "local -> remote (STATE)" for each one in a connected or handshake state whose local address
    is not loopback. The text is the guest's: a line that does not parse is skipped (a lying guest
    loses only its own sandbox to the failed checkpoint)."""
    found = []
    for line in table.decode("ascii", "replace").splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or fields[3].upper() not in _UNSAVED_TCP_STATES:
            continue
        try:
            local, remote = _endpoint(fields[1], v6), _endpoint(fields[2], v6)
        except ValueError:
            continue
        if local[0].is_loopback or (isinstance(local[0], ipaddress.IPv6Address) and _mapped_loopback(local[0])):
            continue
        found.append(f"{_show(local)} -> {_show(remote)} ({_UNSAVED_TCP_STATES[fields[3].upper()]})")
    return found


def _endpoint(text: str, v6: bool) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``ADDR:PORT`` of /proc/net/tcp: the address in hex of 32-bit words in host (little-endian)
    order, the port in hex."""
    addr, _, port = text.partition(":")
    raw = bytes.fromhex(addr)
    if len(raw) != (16 if v6 else 4):
        raise ValueError(text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.IPv6Address(words) if v6 else ipaddress.IPv4Address(words)
    return ip, int(port, 16)


def _mapped_loopback(ip: ipaddress.IPv6Address) -> bool:
    return ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback


def _show(endpoint: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]) -> str:
    ip, port = endpoint
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


async def _refuse_open_connections(session: GuestSession, sid: str) -> None:
    """SnapshotUnsupported if a process in the sandbox holds a TCP connection over its network link,
    which this tier's checkpoint cannot save (runsc 2022: the save fails and takes the sandbox with
    it). Read from the guest's /proc/net/tcp and tcp6 by the agent (no process is started), before
    anything stops, so the sandbox keeps running. A connection opened after this look and before
    the checkpoint still fails it."""
    found: list[str] = []
    for name, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            table = await session.read(name, max_bytes=_NET_TABLE_MAX, timeout=30.0)
        except (OSError, WarmboxError):
            continue  # not there: nothing of it to save
        found += open_connections(table, v6)
    if found:
        raise SnapshotUnsupported(
            f"cannot pause {sid} with memory: {len(found)} TCP connection(s) are open over its network "
            f"({', '.join(found[:5])}{', …' if len(found) > 5 else ''}); this tier's checkpoint cannot "
            "save them. Close them (or pause without memory), then retry; the sandbox keeps running."
        )


async def _refuse_workspace_sockets(engine: Engine, handle: BackendHandle) -> None:
    """SnapshotUnsupported if unix sockets are bound in /workspace or a writable volume: host
    directories, so a socket bound there is a host one, which this tier's checkpoint cannot save.
    Looked for on the host by ``find`` as each directory's owner (hostfs: a guest-planted link is
    never followed), before anything stops, so the sandbox keeps running; a few ms, where a
    process in the guest costs ~50 ms of gVisor's exec alone."""
    from warmbox.backends import volume_disk
    from warmbox.engine import volumes as volumes_mod

    sid = handle.sandbox_id
    dirs = [("/workspace", Path(handle.state_dir) / "workspace")]
    for i, v in enumerate(volumes_mod.of_sandbox(engine, sid)):
        if not v.read_only:
            dirs.append((v.path, volume_disk.mount_point(handle.state_dir, i)))
    names: list[str] = []
    for where, d in dirs:
        if len(names) > 5:
            break
        try:
            found = await hostfs.find_sockets(d, limit=6, timeout=_TIMEOUT_S)
        except OSError:
            continue  # not there (a volume not mounted): nothing of it to save
        names += [f"{where.rstrip('/')}/{n}" for n in found]
    if names:
        raise SnapshotUnsupported(
            f"cannot pause {sid} with memory: unix sockets are bound in /workspace or a volume "
            f"({', '.join(names[:5])}{', …' if len(names) > 5 else ''}); this tier's "
            "checkpoint cannot save them. Close them or bind them under /tmp, then retry."
        )


async def restore_memory(
    engine: Engine,
    m: snaps.SnapshotManifest,
    *,
    timeout: float | None,
    pool: str = "",
    shape: str = "",
    tenant: Tenant | None = None,
    resume_of: str = "",
    volumes: tuple[VolumeMount, ...] | None = None,
    network: bool = False,
) -> Launched:
    """A new sandbox continuing a memory snapshot: same processes, memory, /tmp; /workspace restored.

    pool/shape: restore it into a warm pool (state ``pooled``) — a template snapshot's copy.
    tenant: whose the new sandbox is (quotas checked before anything is fetched, and at its insert).
    resume_of: the paused sandbox continued under its own id (instead of a new one).
    volumes: what it mounts (None: what the snapshot's sandbox mounted, as its processes expect).
    network: it gets an egress link (provision.LaunchSpec.network).
    """
    from warmbox.engine import volumes as volumes_mod
    from warmbox.engine.engine import validate_timeout

    if volumes is None:
        volumes = volumes_mod.of_sandbox(engine, resume_of or m.sandbox_id)

    timeout_s = validate_timeout(engine.settings().defaults.timeout_s if timeout is None else timeout)
    with _Op(engine, "restore") as op:
        work = op.path
        ws_tar = work / "workspace.tar"
        limits = _limits_of(m)
        _check_fits(m, limits.disk_mb << 20)  # before anything is fetched
        check_runtime(engine, m)
        if tenant is not None:
            engine.registry.tenants.check_quota(tenant, m.tier, limits)
        image = await asyncio.to_thread(image_of, engine, m, tenant)  # gone: refused before the fetch
        store = store_for(engine)
        snaps.get_blob(store, m.filesystem_sha256, m.filesystem_bytes, m.filesystem_raw_bytes, ws_tar, work)
        memory_dir = work
        snapshot_start = engine.backend(m.tier).capabilities().snapshot_start
        if snapshot_start:
            memory_dir = _cached_memory(engine, m, work)
        elif not _link_cached_memory(engine, m.snapshot_id, work / "checkpoint.img"):
            snaps.get_blob(store, m.memory_sha256, m.memory_bytes, m.memory_raw_bytes, work / "checkpoint.img", work)
        spec = provision.LaunchSpec(
            m.tier,
            m.template,
            timeout_s,
            limits,
            (),
            pool,
            shape,
            tenant,
            resume_of,
            volumes=volumes,
            image=image,
            network=network,
        )
        got = await provision.launch(engine, spec, provision.Restore(m.snapshot_id, memory_dir, ws_tar))
        if resume_of and not snapshot_start:  # the paused sandbox runs again: its pause's image is not needed here
            import shutil

            shutil.rmtree(_memory_cache(engine) / m.snapshot_id, ignore_errors=True)
        return got


def image_of(engine: Engine, m: snaps.SnapshotManifest, tenant: Tenant | None = None) -> ImageRef:
    """The image ``m`` was taken on, which its restore runs again (Engine.recorded_image:
    TemplateMismatch if it is gone, CorruptLayer if a layer fails its digest). A memory snapshot
    holds processes that mapped that image's files: one from before images were recorded is
    refused rather than continued on another image."""
    if m.memory and not m.image_id:
        raise TemplateMismatch(
            f"snapshot {m.snapshot_id} holds memory taken before sandbox images were recorded: it "
            "cannot be continued on an image it may not have run (restore its files with a newer snapshot)",
            template=m.template,
        )
    return engine.recorded_image(m.template, m.template_version, m.image_id, tenant)


def template_key(engine: Engine, tier: str, shape: str, image: ImageRef | None = None) -> str:
    """Registry key of a shape's template snapshot. A tier whose snapshots only restore into
    the same machine (microvm: same image and QEMU command line) adds that fingerprint, so a
    changed image or machine makes a new template instead of a failing restore."""
    backend = engine.backend(tier)
    return f"template:{shape}" + (
        f":{backend.template_fingerprint(image)}" if isinstance(backend, TemplateCapable) else ""
    )


def _memory_cache(engine: Engine) -> Path:
    return engine.runtime / "memory-cache"


def _keep_memory(engine: Engine, snapshot_id: str, image: Path) -> None:
    """Move a fresh memory image into the cache, so its first restore needs no unpacking."""
    import shutil

    cache = _memory_cache(engine) / snapshot_id
    tmp = cache.parent / f".tmp-{snapshot_id}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        cache.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp.mkdir()
        shutil.move(str(image), tmp / "checkpoint.img")
        os.rename(tmp, cache)
    except OSError:
        pass  # only a cache: a restore unpacks the blob instead
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _link_cached_memory(engine: Engine, snapshot_id: str, dest: Path) -> bool:
    """Hard-link the snapshot's kept memory image (``_keep_memory``) to ``dest``; False if there is
    none (or it is on another filesystem): then the blob is unpacked. A link, not the cache's path,
    so that a concurrent resume dropping the cache cannot take the file from under this restore."""
    try:
        os.link(_memory_cache(engine) / snapshot_id / "checkpoint.img", dest, follow_symlinks=False)
    except OSError:
        return False
    return True


def _cached_memory(engine: Engine, m: snaps.SnapshotManifest, work: Path) -> Path:
    """The snapshot's memory image, unpacked and verified once, then read in place by every
    restore (tiers that start each sandbox from a template: no decompression on their path)."""
    cache = _memory_cache(engine) / m.snapshot_id
    if (cache / "checkpoint.img").is_file():
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = cache.parent / f".tmp-{m.snapshot_id}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        snaps.get_blob(
            store_for(engine), m.memory_sha256, m.memory_bytes, m.memory_raw_bytes, tmp / "checkpoint.img", work
        )
        try:
            os.rename(tmp, cache)
        except OSError:  # another restore unpacked it first
            pass
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return cache


async def template_snapshot(
    engine: Engine, tier: str, tmpl, limits: Limits, shape: str, image: ImageRef | None = None
) -> snaps.SnapshotManifest:
    """The memory snapshot of a warmed-up template sandbox (made once per shape, then reused).

    Pools of a tier with memory snapshots restore their sandboxes from it instead of booting
    and warming each one (under gVisor a cold Python + pandas start costs seconds). One maker
    per shape and home, across processes (an flock: a killed maker holds it no longer); the
    template sandbox of a maker that died is destroyed by the reaper (Engine.mark_template_vm).
    """
    import asyncio

    lock = _template_locks.setdefault(shape, asyncio.Lock())
    async with lock:  # concurrent refills make one template, not one each
        fd = await _template_flock(engine, shape)
        try:
            return await _template_snapshot(engine, tier, tmpl, limits, shape, image)
        finally:
            os.close(fd)


_template_locks: dict = {}


async def _template_flock(engine: Engine, shape: str) -> int:
    """The shape's template lock (``templates/<hash>.lock`` in the home), waited for without
    blocking the event loop: another process may be making the same template."""
    import asyncio
    import hashlib

    d = engine.home / "templates"
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(
            d / f"{hashlib.sha256(shape.encode()).hexdigest()[:16]}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
    except OSError as e:
        raise _storage_error(e, "template lock") from None
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                await asyncio.sleep(0.1)
    except BaseException:
        os.close(fd)
        raise


async def _template_snapshot(
    engine: Engine, tier: str, tmpl, limits: Limits, shape: str, image: ImageRef | None
) -> snaps.SnapshotManifest:
    store = store_for(engine)
    if image is None:
        image = engine.image_for(tmpl.name)
    key = template_key(engine, tier, shape, image)
    sid = engine.registry.meta.meta_text(key)
    if sid:
        try:
            return snaps.load_manifest(store, sid, _workdir(engine))
        except StorageError:
            pass  # gone or damaged: make a new one
    got = await provision.launch(
        engine, provision.LaunchSpec(tier, tmpl.name, 3600.0, limits, image=image), provision.Cold(tmpl)
    )
    info, session = got.info, got.session
    try:
        # from here until it is recorded as the template, a death of this process leaves a
        # READY sandbox nobody would end for an hour: marked, the reaper ends it at once
        engine.mark_template_vm(info.sandbox_id, key)
        # a tier's own warm-up before the image is taken (microvm: the files of the commands a
        # sandbox runs first are then in the guest's page cache, not read from its disk each time)
        backend = engine.backend(tier)
        for argv in backend.template_warmup if isinstance(backend, TemplateCapable) else ():
            code, err = await _exec(session, list(argv), info.sandbox_id)
            if code != 0:
                raise SandboxError(f"template warm-up {argv[0]} exited {code}: {err[-200:]}", info.sandbox_id)
        m = await pause(engine, info.sandbox_id, session, memory=True)
        engine.registry.meta.set_meta_text(key, m.snapshot_id)  # first: a death after it loses nothing
        engine.registry.sandboxes.set_state(
            info.sandbox_id, State.DESTROYED, f"became template snapshot {m.snapshot_id}"
        )
    except BaseException:
        await session.close()
        try:
            await engine.destroy(info.sandbox_id, "template snapshot failed")
        except WarmboxError:
            pass
        raise
    finally:
        try:
            engine.unmark_template_vm(info.sandbox_id)
        except (WarmboxError, OSError):
            pass  # the reaper unmarks it once it sees this process gone
    return m


def resolve(engine: Engine, ref: str) -> snaps.SnapshotManifest:
    """A snapshot id, or a paused sandbox's id (its latest snapshot) -> its verified manifest."""
    if not isinstance(ref, str) or not ref:
        raise InvalidArgument(f"expected a snapshot id or sandbox id, got {ref!r}")
    if ref.startswith("sb-"):
        ids = engine.registry.snapshots.snapshots_of(ref)
        if not ids:
            raise SandboxNotFound(f"sandbox {ref} has no snapshot", ref)
        ref = ids[-1]
    if not ref.startswith("snap-") or "/" in ref:
        raise InvalidArgument(f"{ref!r} is not a snapshot id (snap-…) or sandbox id (sb-…)")
    return snaps.load_manifest(store_for(engine), ref, _workdir(engine))


async def restore(
    engine: Engine,
    m: snaps.SnapshotManifest,
    *,
    timeout: float | None,
    envs: dict[str, str] | None,
    pool: bool = True,
    tenant: Tenant | None = None,
    resume_of: str = "",
    network: bool = False,
) -> Launched:
    """A new running sandbox with the snapshot's files and context state.

    The artifact is fetched and verified first: a corrupt one raises before any sandbox exists.
    tenant: whose the new sandbox is (QuotaExceeded before anything is fetched or made).
    resume_of: a paused sandbox started again under its own id instead of a new sandbox (a
    failure leaves it paused).
    network: the caller links it after the start (provision.LaunchSpec.network).
    """
    if m.memory:
        if envs:
            raise InvalidArgument("a memory snapshot continues its processes as they were: envs cannot change")
        return await restore_memory(engine, m, timeout=timeout, tenant=tenant, resume_of=resume_of, network=network)
    from warmbox.engine import volumes as volumes_mod

    op = _Op(engine, "restore")
    work = op.path
    raw = work / "files.tar"
    try:
        limits = _limits_of(m)
        _check_fits(m, (limits.disk_mb + 2 * limits.tmp_mb) << 20)  # /workspace, /tmp and /home/user
        if tenant is not None:
            engine.registry.tenants.check_quota(tenant, m.tier, limits)
        image = await asyncio.to_thread(image_of, engine, m, tenant)  # gone: refused before the fetch
        snaps.get_blob(store_for(engine), m.filesystem_sha256, m.filesystem_bytes, m.filesystem_raw_bytes, raw, work)
        got = await engine.create(
            tier=m.tier,
            timeout=timeout,
            envs=envs,
            limits=limits,
            template=m.template,
            pool=pool,
            tenant=tenant,
            resume_of=resume_of,
            mounts=() if resume_of else volumes_mod.of_sandbox(engine, m.sandbox_id),  # a resume: its own
            image=image,
            egress_link=network,
        )
        info, session = got.info, got.session
        try:
            code, err = await _exec(
                session,
                ["/bin/tar", "-C", "/", "--numeric-owner", "--no-overwrite-dir", "-xpf", "-"],
                info.sandbox_id,
                source=raw,
            )
            if code != 0 and _disk_full(err):
                raise _too_big(m, limits, err[-300:], info.sandbox_id)
            if code != 0:
                raise SandboxError(f"restoring files: tar exited {code}: {err[-300:]}", info.sandbox_id)
            if m.context_saved:
                _, done = await _run_code(session, _LOAD, info.sandbox_id)
                if done.error is not None:
                    raise SandboxError(
                        f"restoring the code context: {done.error.name}: {done.error.value}", info.sandbox_id
                    )
            engine.registry.sandboxes.set_parent(info.sandbox_id, m.snapshot_id)
        except BaseException:
            await session.close()
            try:
                await _undo_start(engine, got, "restore failed", resumed=bool(resume_of))
            except WarmboxError:
                pass
            raise
        got.info, _ = engine.info(info.sandbox_id)
        return got
    finally:
        op.close()


async def _undo_start(engine: Engine, got: Launched, why: str, *, resumed: bool) -> None:
    """End a sandbox whose start went wrong after its launch: destroyed, or (a resume) its
    runtime torn down and the sandbox paused again, its snapshot untouched."""
    if not resumed:
        await engine.destroy(got.sandbox_id, why)
        return
    from warmbox.engine import egress

    await engine.backend(got.info.tier).destroy(got.handle)
    await egress.suspend(engine, got.sandbox_id)
    engine.registry.sandboxes.set_state(got.sandbox_id, State.PAUSED, f"{why}; still paused")
    engine.registry.usage.finalize(got.sandbox_id)


def _limits_of(m: snaps.SnapshotManifest) -> Limits:
    """The limits a snapshot comes back with: its sandbox's (a manifest from before disk quotas
    gets the default disk)."""
    return Limits(
        memory_mb=m.memory_mb,
        cpus=m.cpus,
        pids=m.pids,
        file_size_mb=m.file_size_mb,
        open_files=m.open_files,
        tmp_mb=m.tmp_mb,
        **({"disk_mb": m.disk_mb} if m.disk_mb else {}),
    )


def _check_fits(m: snaps.SnapshotManifest, room: int) -> None:
    """NoSpace up front when the snapshot's files are clearly larger than the sandbox's filesystems
    (a margin for archive headers and disk-image metadata; a closer miss is the unpacking's NoSpace)."""
    if m.filesystem_raw_bytes > room + room // 32 + (16 << 20):
        raise NoSpace(
            f"snapshot {m.snapshot_id} holds {m.filesystem_raw_bytes >> 20} MiB of files: more than "
            f"the {room >> 20} MiB its sandbox's disk{' and tmpfs mounts' if not m.memory else ''} can hold "
            f"(limits.disk_mb = {_limits_of(m).disk_mb})",
            m.sandbox_id,
        )


def _disk_full(tar_stderr: str) -> bool:
    """GNU tar ran out of room: ENOSPC, or the short write a full filesystem gives it."""
    return "No space left on device" in tar_stderr or ": Wrote only " in tar_stderr


def _too_big(m: snaps.SnapshotManifest, limits: Limits, detail: str, sandbox_id: str) -> NoSpace:
    return NoSpace(
        f"snapshot {m.snapshot_id} does not fit the disk of its new sandbox (limits.disk_mb = "
        f"{limits.disk_mb}): {detail.strip()[-200:]}",
        sandbox_id,
    )


async def resume(
    engine: Engine,
    ref: str,
    *,
    timeout: float | None,
    envs: dict[str, str] | None,
    tenant: Tenant | None = None,
    secrets: object = None,
) -> Launched:
    """A paused sandbox (its id) running again under the same id, or a fork of a snapshot (its
    id) as a new sandbox (:func:`fork`). tenant: whose the running sandbox is (a paused sandbox
    holds nothing: the resumed one is what counts against quotas).

    A resumed sandbox keeps the lifetime it was created with (``timeout`` None) and its egress
    policy (a link of its own again); ``secrets`` gives the values of the secrets it had (env
    name -> str or warmbox.Secret: never stored), SecretsRequired naming those missing before
    anything is done. Its stage timings gain ``resume`` (ms, the whole resume).
    """
    from warmbox.engine import egress

    if not (isinstance(ref, str) and ref.startswith("sb-")):
        m = resolve(engine, ref)
        if not _pause_of_paused(engine, m):
            return await fork(engine, m, timeout=timeout, envs=envs, tenant=tenant, secrets=secrets)
        ref = m.sandbox_id  # the snapshot pause() handed out: continue that sandbox, under its id
    t0 = time.perf_counter()
    info, _ = engine.info(ref)
    if info.state is not State.PAUSED:
        engine.check(Operation.RESUME, info)
    record = egress.paused_record(engine, ref)
    secret_map = egress.secrets_for(record, secrets, ref, f"sandbox {ref}")
    m = resolve(engine, ref)
    if timeout is None:
        timeout = engine.registry.sandboxes.timeout_of(ref) or None
    await _released(engine, ref)
    got = await restore(engine, m, timeout=timeout, envs=envs, tenant=tenant, resume_of=ref)
    try:
        if record is not None:
            await egress.reestablish(engine, got.handle, got.session, record, secret_map)
    except BaseException:
        await got.session.close()
        try:
            await _undo_start(engine, got, "network setup after resume failed", resumed=True)
        except WarmboxError:
            pass
        raise
    engine.registry.sandboxes.add_timings([StageTiming(ref, "resume", (time.perf_counter() - t0) * 1e3, True)])
    got.timings = engine.registry.sandboxes.timings(ref)
    got.info, _ = engine.info(ref)
    return got


async def fork(
    engine: Engine,
    m: snaps.SnapshotManifest,
    *,
    timeout: float | None,
    envs: dict[str, str] | None,
    pool: bool = True,
    tenant: Tenant | None = None,
    secrets: object = None,
) -> Launched:
    """A new sandbox from snapshot ``m`` (:func:`restore`) with the snapshot's egress policy on a
    link, address and audit log of its own; its secrets keep their placeholders and get the
    values in ``secrets`` (SecretsRequired naming those missing, before anything is made) and a
    new CA. The origin is untouched."""
    from warmbox.engine import egress

    record = egress.EgressRecord.from_json(m.network)
    secret_map = egress.secrets_for(record, secrets, m.sandbox_id, f"snapshot {m.snapshot_id}")
    if record is not None:
        egress.check_tier(engine, m.tier, record.policy_of())
    got = await restore(engine, m, timeout=timeout, envs=envs, pool=pool, tenant=tenant, network=record is not None)
    if record is not None:
        try:
            got.timings.append(await egress.reestablish(engine, got.handle, got.session, record, secret_map))
        except BaseException:
            await got.session.close()
            await engine.destroy(got.sandbox_id, "network setup of the fork failed")
            raise
    return got


def start_of(engine: Engine, ref: str) -> tuple[str, str, str, Limits]:
    """What ``resume(ref)`` would start, before it does: ("resume", sandbox_id, tier, limits) for a
    paused sandbox continued under its id, ("create", snapshot_id, tier, limits) for a fork."""
    if isinstance(ref, str) and ref.startswith("sb-"):
        info, _ = engine.info(ref)
        return "resume", ref, info.tier, engine.registry.sandboxes.limits(ref)
    m = resolve(engine, ref)
    if _pause_of_paused(engine, m):
        return "resume", m.sandbox_id, m.tier, _limits_of(m)
    return "create", m.snapshot_id, m.tier, _limits_of(m)


def _pause_of_paused(engine: Engine, m: snaps.SnapshotManifest) -> bool:
    """Whether ``m`` is the latest snapshot of a sandbox that is paused: the one its pause made,
    so resuming it continues that sandbox (a fork would leave it paused until its retention)."""
    try:
        info, _ = engine.info(m.sandbox_id)
    except WarmboxError:
        return False
    return info.state is State.PAUSED and engine.registry.snapshots.snapshots_of(m.sandbox_id)[-1:] == [m.snapshot_id]


RELEASE_WAIT_S = 60.0


async def _released(engine: Engine, sandbox_id: str) -> None:
    """Wait until the pause of ``sandbox_id`` has released everything (it records ``paused``
    first, then tears the runtime and its link down: a resume must not start under it). A pauser
    that died meanwhile, or one slower than RELEASE_WAIT_S, leaves leftovers the resume removes."""
    from warmbox.paths import owner_alive

    deadline = time.monotonic() + RELEASE_WAIT_S
    while time.monotonic() < deadline:
        owner = engine.registry.sandboxes.owner_of(sandbox_id)
        if not owner or not owner_alive(owner, engine.node) or (owner == engine.owner and sandbox_id not in _releasing):
            return  # released, its pauser is gone, or this process's release ended (a failed one)
        if engine.info(sandbox_id)[0].state is not State.PAUSED:
            return  # resumed or ended meanwhile: the resume's own checks say so
        await asyncio.sleep(0.02)


def delete(engine: Engine, snapshot_id: str) -> None:
    """Forget a snapshot (its blob goes at the next gc). Works on an unreadable manifest too."""
    if not isinstance(snapshot_id, str) or not snapshot_id.startswith("snap-") or "/" in snapshot_id:
        raise InvalidArgument(f"{snapshot_id!r} is not a snapshot id")
    store = store_for(engine)
    store.delete(snaps.manifest_key(snapshot_id))
    engine.registry.snapshots.remove_snapshot(snapshot_id)
    import shutil

    shutil.rmtree(_memory_cache(engine) / snapshot_id, ignore_errors=True)


def orphaned_ops(engine: Engine) -> list[Path]:
    """Op directories whose operation's process is gone (their lock is free)."""
    out = []
    for d in _workdir(engine).glob(OP_PREFIX + "*"):
        try:
            if time.time() - d.lstat().st_mtime < _OP_MIN_AGE_S or not d.is_dir() or d.is_symlink():
                continue
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its operation still runs
        finally:
            os.close(fd)
        out.append(d)
    return out


async def recover(engine: Engine) -> list[str]:
    """Finish or undo the operations whose process died; returns what was done, one line each.

    A pause killed after its checkpoint (the runtime has stopped, its image is complete) is
    finished: workspace and image are stored and the sandbox becomes ``paused``. One killed
    before it leaves a running, quiesced sandbox: its agent is told to listen again. Any other
    operation's temp files are removed.
    """
    import shutil

    done = []
    for d in orphaned_ops(engine):
        op = _Op.adopt(d)
        if op is None:
            continue
        try:
            done.append(await _recover_one(engine, op))
        except WarmboxError as e:
            done.append(f"{d.name}: {e}")
        finally:
            op.close()
    for f in _workdir(engine).glob(".*"):  # strays of older versions and of manifest reads
        try:
            if f.name.startswith(OP_PREFIX) or time.time() - f.lstat().st_mtime < 3600:
                continue
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)
        except OSError:
            pass
    cache = _memory_cache(engine)  # half-copied memory images of a killed process (.tmp-<snap>-<pid>-<ns>)
    for d in cache.glob(".tmp-*") if cache.is_dir() else ():
        try:
            pid = int(d.name.rsplit("-", 2)[-2])
        except (ValueError, IndexError):
            pid = 0
        try:
            if pid != os.getpid() and (not _pid_alive(pid) or time.time() - d.lstat().st_mtime > 3600):
                shutil.rmtree(d, ignore_errors=True)
                done.append(f"{d.name}: removed (its process is gone)")
        except OSError:
            pass
    return done


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _recover_one(engine: Engine, op: _Op) -> str:
    try:
        rec = json.loads((op.path / "op.json").read_text())
        sid, parent, env_names = rec["sandbox_id"], str(rec["parent"]), tuple(rec["env_names"])
        if rec.get("kind") != "pause":
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError):
        return f"{op.path.name}: removed"
    try:
        info, handle = engine.info(sid)
    except SandboxNotFound:
        return f"{op.path.name}: removed ({sid} is gone)"
    if info.state not in (State.READY, State.RUNNING):
        return f"{op.path.name}: removed ({sid} is {info.state.value})"
    backend = engine.backend(info.tier)
    if not isinstance(backend, SnapshotCapable):
        return f"{op.path.name}: removed (tier {info.tier} has no memory snapshots)"
    image = op.path / "image" / "checkpoint.img"
    if (op.path / "checkpointed").exists() and image.is_file():
        # the checkpoint ended, so its runtime is ending: on a loaded host its Sentry can still be
        # exiting for a while, which is not "killed before the checkpoint" (that would resume a
        # sandbox whose processes are gone and drop the image that holds them)
        deadline = time.monotonic() + _RUNTIME_EXIT_S
        while await backend.alive(handle) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    if await backend.alive(handle):  # killed before the checkpoint stopped it: let it run on
        try:
            await backend.resume_listening(handle)
        except (OSError, WarmboxError):
            pass
        return f"{sid}: its pauser died before the checkpoint; it runs on"
    if not image.is_file():
        return f"{op.path.name}: removed ({sid} died without a checkpoint)"
    # The checkpoint ran (its runtime exited with it): finish the pause the dead process began.
    # An image without the "checkpointed" mark was written by a runsc that outlived its caller.
    own = _own_pause.set(sid)  # this task finishes that pause now: it never waits for itself
    try:
        m = await _store_checkpoint(engine, info, handle, op.path, parent, env_names)
        await _release_paused(engine, sid, m)
    finally:
        _own_pause.reset(own)
    return f"{sid}: pause finished by recovery as {m.snapshot_id}"


async def gc(engine: Engine, grace_s: float | None = None) -> tuple[int, list[str]]:
    """Recover dead operations (see ``recover``), then delete unreferenced blobs and caches."""
    store = store_for(engine)
    if isinstance(store, LocalObjectStore):
        store.clean_partial()
    await recover(engine)
    got = snaps.gc(store, _workdir(engine), snaps.GC_GRACE_S if grace_s is None else grace_s)
    import shutil

    cache = _memory_cache(engine)
    if cache.is_dir():  # unpacked memory images of snapshots that no longer exist
        for d in cache.iterdir():
            if d.name.startswith("snap-") and not store.exists(snaps.manifest_key(d.name)):
                shutil.rmtree(d, ignore_errors=True)
    return got


__all__ = ["snapshot", "pause", "resume", "restore", "resolve", "delete", "gc", "store_for"]
