"""Taking snapshots: files (a tar streamed by the guest itself), memory (the tier's checkpoint),
and pause, which takes one and releases the sandbox; ``recover`` finishes or undoes what a killed
process left (artifact format: storage/snapshots.py; where they are kept: snapstore.py).

What a snapshot holds depends on the tier's capabilities. A tier without memory snapshots
(the runc tier on this host: CRIU cannot run on its kernel) snapshots its files — /workspace,
/tmp and /home/user, streamed as a tar by the guest itself, so the same code serves every
tier — plus the default code context's picklable globals (modules are re-imported by name);
the manifest says ``memory: false`` and restore starts fresh processes on the restored files.

Order of a pause, so that a crash at any point loses nothing: write the blob, write the
manifest (from here the snapshot exists), record it, and only then release the sandbox.
Each operation keeps its temp artifacts in one directory it holds locked (``snapstore.Op``); a
pause records itself there before it quiesces the agent. A process killed at any point leaves
that directory unlocked, and ``recover`` (run by the daemon's reaper and ``snapshots gc``)
removes it — after finishing a pause whose checkpoint had already stopped the runtime, or
telling a still-running sandbox's agent to listen again.
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from warmbox.backends import hostfs, volume_disk
from warmbox.backends.base import SnapshotCapable
from warmbox.engine import egress, meters, snapstore, teardown
from warmbox.engine import volumes as volumes_mod
from warmbox.engine.session import AGENT_TIMEOUT_S, GuestSession
from warmbox.errors import (
    InvalidArgument,
    SandboxError,
    SandboxNotFound,
    SandboxStartError,
    SnapshotUnsupported,
    StorageError,
    WarmboxError,
)
from warmbox.lifecycle import Operation
from warmbox.models import BackendHandle, Execution, SandboxInfo, StageTiming, State
from warmbox.storage import snapshots as snaps

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine


STATE_FILE = "/tmp/.warmbox-context.pkl"
MAX_SNAPSHOT_BYTES = int(os.environ.get("WARMBOX_SNAPSHOT_MAX_BYTES", str(16 << 30)))  # raw tar, per snapshot
TAR_PATHS = ("workspace", "tmp", "home/user")
_TIMEOUT_S = 600.0
_RUNTIME_EXIT_S = 60.0  # a checkpointed runtime's exit, waited for by recovery


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


LOAD = r"""
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


async def run_code(session: GuestSession, code: str, sid: str) -> tuple[str, Execution]:
    """Run ``code`` in the default context: (its stdout, the execution); a guest failure raises."""
    try:
        ex = await session.run_code(code, timeout_s=_TIMEOUT_S, max_output=1 << 20)
    except InvalidArgument as e:  # the guest refused the request
        raise SandboxError(f"code context: {e}", sid) from None
    return ex.stdout, ex


async def guest_exec(
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
    store = snapstore.store_for(engine)
    op = snapstore.Op(engine, "snapshot")
    work = op.path
    own = session is None
    blob: snaps.BlobWriter | None = None
    pickle_left = True  # the context's pickle in the guest's /tmp: removed by the tar command itself
    try:
        if session is None:
            session = await engine.connect(handle)
        blob = snaps.BlobWriter(work)
    except BaseException as e:
        op.close()
        if own and session is not None:
            await session.close()
        if isinstance(e, OSError):
            raise snapstore.storage_error(e, f"snapshot of {sandbox_id}") from None
        raise
    try:
        text, done = await run_code(session, _SAVE, sandbox_id)
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
            raise snapstore.storage_error(e, f"snapshot of {sandbox_id}") from None
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
            raise snapstore.storage_error(e, f"snapshot of {sandbox_id}") from None
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
                await guest_exec(session, ["/bin/rm", "-f", STATE_FILE], sandbox_id)
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
        runtime=snapstore.runtime_of(engine, info.tier) if memory is not None else "",
    )


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
    code, err = await guest_exec(
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
        raise snapstore.storage_error(first, f"snapshot of {sandbox_id}")
    return code, err


_pausing: dict[str, bool] = {}
_stored_ops: dict[str, snapstore.Op] = {}  # memory pauses stored, not yet recorded paused (see _memory_snapshot)
releasing: set[str] = set()  # paused sandboxes this process is releasing right now


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
    own = snapstore.own_pause.set(sandbox_id)
    try:
        try:
            m = await snapshot(engine, sandbox_id, session, memory=memory, parent=parent, env_names=env_names)
        finally:
            _pausing.pop(sandbox_id, None)
        if session is not None:
            await session.close()
        await _release_paused(engine, sandbox_id, m, why)
    finally:
        snapstore.own_pause.reset(own)
        held = _stored_ops.pop(sandbox_id, None)
        if held is not None:
            held.close()
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
    await meters.read(engine, info, handle, None)
    reason = f"paused to {m.snapshot_id}" + (f" ({why})" if why else "")
    releasing.add(sandbox_id)
    try:
        engine.registry.sandboxes.set_state(sandbox_id, State.PAUSED, reason, owner=engine.owner)
        engine.registry.usage.finalize(sandbox_id)
        await engine.backend(info.tier).destroy(handle)
        await egress.suspend(engine, sandbox_id)  # its policy waits for its resume (the secrets' values go)
        engine.registry.sandboxes.released(sandbox_id, engine.owner)  # from here a resume may start it again
    finally:
        releasing.discard(sandbox_id)


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
        session = await engine.connect(handle)
    try:
        if not backend.capabilities().checkpoint_saves_workspace_sockets:
            await _refuse_workspace_sockets(engine, handle)
        if not backend.capabilities().checkpoint_saves_connections:
            await _refuse_open_connections(session, sid)
        op = snapstore.Op(engine, "pause")
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
    checkpointed = stored = False
    try:
        await backend.checkpoint(handle, image_dir)
        checkpointed = True
        (op.path / "checkpointed").touch()  # the runtime has stopped: only forward from here
        m = await _store_checkpoint(engine, info, handle, op.path, parent, env_names)
        stored = True
        return m
    except BaseException as e:
        if not checkpointed:  # still running: let the agent listen again
            try:
                await backend.resume_listening(handle)
            except (OSError, WarmboxError):
                pass
            if isinstance(e, WarmboxError) and not await backend.alive(handle):
                # the failed checkpoint took the runtime with it: say so, and release the rest
                try:
                    await teardown.destroy(engine, sid, f"lost in a failed memory checkpoint: {e}")
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
        if stored and _pausing.get(sid):
            # held (locked) until pause() has recorded the sandbox paused: a caller that finds the
            # runtime gone meanwhile waits for the pause (pause_running) instead of taking the
            # sandbox for dead; a pauser killed here leaves it for recovery to finish
            _stored_ops[sid] = op
        else:
            op.close()


async def _revive(engine: Engine, backend: SnapshotCapable, handle: BackendHandle, image_dir: Path) -> None:
    """Continue a checkpointed sandbox in place from ``image_dir`` (same id, state dir, files)."""

    async def ready() -> GuestSession:
        session = await GuestSession.connect(handle.socket_path, handle.sandbox_id)
        try:
            await asyncio.wait_for(session.ping("the continued agent"), AGENT_TIMEOUT_S)
        except BaseException:
            await session.close()
            raise
        return session

    await egress.renew_prepared(engine, handle.sandbox_id)  # a link made before the start: again
    session = await backend.restore(handle, image_dir, ready)
    await session.close()


async def _store_checkpoint(
    engine: Engine, info, handle, work: Path, parent: str, env_names: tuple[str, ...]
) -> snaps.SnapshotManifest:
    """Archive /workspace beside the checkpoint image in ``work``/image, store both, write the
    manifest and record the snapshot (the runtime has stopped: nothing changes under the tar)."""
    store = snapstore.store_for(engine)
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
            raise snapstore.storage_error(r, f"snapshot of {sid}") from None
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
    snapstore.keep_memory(engine, m.snapshot_id, image)
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


def orphaned_ops(engine: Engine) -> list[Path]:
    """Op directories whose operation's process is gone (their lock is free)."""
    out = []
    for d in snapstore.workdir(engine).glob(snapstore.OP_PREFIX + "*"):
        try:
            if time.time() - d.lstat().st_mtime < snapstore.OP_MIN_AGE_S or not d.is_dir() or d.is_symlink():
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
        op = snapstore.Op.adopt(d)
        if op is None:
            continue
        try:
            done.append(await _recover_one(engine, op))
        except WarmboxError as e:
            done.append(f"{d.name}: {e}")
        finally:
            op.close()
    for f in snapstore.workdir(engine).glob(".*"):  # strays of older versions and of manifest reads
        try:
            if f.name.startswith(snapstore.OP_PREFIX) or time.time() - f.lstat().st_mtime < 3600:
                continue
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)
        except OSError:
            pass
    cache = snapstore.memory_cache(engine)  # half-copied memory images of a killed process (.tmp-<snap>-<pid>-<ns>)
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


async def _recover_one(engine: Engine, op: snapstore.Op) -> str:
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
    own = snapstore.own_pause.set(sid)  # this task finishes that pause now: it never waits for itself
    try:
        m = await _store_checkpoint(engine, info, handle, op.path, parent, env_names)
        await _release_paused(engine, sid, m)
    finally:
        snapstore.own_pause.reset(own)
    return f"{sid}: pause finished by recovery as {m.snapshot_id}"
