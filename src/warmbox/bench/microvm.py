"""Benchmarks of the microVM tier against raw QEMU on the same images, in the same run.

"Raw" is the floor warmbox stands on: the same QEMU command line (:func:`qemu_argv`), the same
kernel, initramfs, root image and memory file, but no engine, registry, relay or SDK — a
blocking client speaks the wire protocol straight to QEMU's chardev socket and times the
first command (``true``) from the moment QEMU is spawned.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from warmbox import protocol as p
from warmbox.backends import microvm as vm
from warmbox.backends import microvm_net as vmnet
from warmbox.errors import WarmboxError
from warmbox.models import MAX_VOLUME_MB, Limits

FIRST = ["/bin/true"]
RAW_UID = 0x7FFE0000  # raw VMs are confined like warmbox's, to an id no sandbox range reaches


def _stats(v: list[float]) -> dict[str, float]:
    from warmbox.bench.common import _stats as stats

    return stats(v)


def _send(sock: socket.socket, msg: p.Message) -> None:
    sock.sendall(p.encode(msg))


def _recv(sock: socket.socket) -> p.Message:
    msg = p.recv_message(sock, p.GUEST_TO_HOST)
    if msg is None:
        raise WarmboxError("raw QEMU: the agent port closed")
    return msg


def _raw_first_command(chardev: Path, deadline: float, code: str | None = None) -> None:
    """Connect to QEMU's agent chardev and run ``true`` (or ``code`` in the agent's default code
    context, the one a template's warm-up ran in); returns when it is done."""
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(chardev))
            break
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise WarmboxError("raw QEMU: the chardev never accepted") from None
            time.sleep(0.001)
    s.settimeout(max(1.0, deadline - time.monotonic()))
    try:
        if code is not None:
            _send(s, p.ContextRun(7, context="default", code=code, timeout_s=60, max_output=1 << 16))
        else:
            _send(s, p.Exec(7, argv=FIRST, env={}, cwd="", timeout_s=30, max_output=1 << 16, stdin=False))
        while True:
            msg = _recv(s)
            if msg.id == 7 and isinstance(msg, (p.Exited, p.CodeDone, p.Failure)):
                if isinstance(msg, p.Failure) or getattr(msg, "exit_code", 0) != 0 or getattr(msg, "error_name", ""):
                    raise WarmboxError(f"raw QEMU: first command answered {msg!r}")
                return
    finally:
        s.close()


class RawQemu:
    """One VM at a time from the backend's own argv (the built-in image's root disk and the empty
    volume slots a sandbox's VM has: a memory image restores only into the devices it was saved
    with); stopped by its pidfile's PID."""

    def __init__(self, backend: vm.MicroVMBackend, work: Path, root: Path) -> None:
        self.backend = backend
        self.work = work
        self.root = root
        self.live: set[Path] = set()

    def close(self) -> None:
        """Stop every VM still running (a failed run must not leave one behind)."""
        for d in list(self.live):
            self.stop(d)

    def start(self, memory: Path | None = None, code: str | None = None) -> tuple[Path, float]:
        """A running VM (cold boot, or restored from ``memory`` + its ``.qcow2`` disk) whose
        agent has answered a first ``true``: (its dir, ms from spawn to that answer)."""
        d = Path(tempfile.mkdtemp(prefix="raw-", dir=self.work))
        self.live.add(d)
        (d / "run").mkdir()
        (d / "workspace").mkdir()
        disk = d / "workspace" / "disk.qcow2"
        try:
            if memory is None:
                subprocess.run(
                    [
                        "qemu-img",
                        "create",
                        "-q",
                        "-f",
                        "qcow2",
                        "-b",
                        str(self.backend.image() / "workspace.raw"),
                        "-F",
                        "raw",
                        str(disk),
                    ],
                    check=True,
                    timeout=60,
                )
            else:
                shutil.copy(memory.with_suffix(".qcow2"), disk)
            (d / "empty").mkdir(mode=0o555)
            placeholder = d / vm.SLOT_PLACEHOLDER  # sparse, as a sandbox's empty slots
            with open(placeholder, "wb") as f:
                f.truncate(MAX_VOLUME_MB << 20)
            slots = [(placeholder, memory is None)] * vm.VOLUME_SLOTS  # writable on a cold boot only
            argv = vm.qemu_argv(
                self.backend.image(),
                d,
                Limits(),
                self.backend.accel()[0],
                incoming=vm.INCOMING_FD if memory else None,
                confine=RAW_UID,
                root=self.root,
                volume_slots=[not writable for _, writable in slots],
            )
            # the same host cgroup bounds as warmbox's VMs (CPU quota, memory charging): the ratios
            # then measure warmbox's own work, not the limits
            procs = self._cgroup(d).create_for(Limits(), self.backend.accel()[0])
            vmnet.prepare(d)  # the NIC's tap (a memory image restores only with it): not raw QEMU's work
            t0 = time.perf_counter()
            vm._spawn(vmnet.enter(d) + argv, d / "qemu.log", vm.vm_files(d, memory, slots), procs)
            _raw_first_command(d / "run" / "vm.sock", time.monotonic() + 120, code)
            return d, (time.perf_counter() - t0) * 1e3
        except BaseException:
            self.stop(d)
            raise

    def save(self, d: Path, out: Path) -> float:
        """stop + migrate to ``out`` (+ the disk beside it as ``.qcow2``), then quit: ms."""
        self._cgroup(d).add_memory(Limits().memory_mb + vm.GUEST_OVERHEAD_MB)  # as warmbox's checkpoint does
        t0 = time.perf_counter()
        vm.save_memory(d / "run" / "qmp.sock", out)
        pid = vm._pidfile(d / "qemu.pid")
        while pid and vm._running(pid):
            time.sleep(0.002)
        ms = (time.perf_counter() - t0) * 1e3
        shutil.copy(d / "workspace" / "disk.qcow2", out.with_suffix(".qcow2"))
        return ms

    @staticmethod
    def _cgroup(d: Path) -> vm.HostCgroup:
        return vm.HostCgroup(f"bench-{d.name}")

    def stop(self, d: Path) -> None:
        self.live.discard(d)
        pid = vm._pidfile(d / "qemu.pid")
        if pid and vm._ours(pid, d):
            vm._kill(pid)
            deadline = time.monotonic() + 10
            while vm._running(pid) and time.monotonic() < deadline:
                time.sleep(0.005)
        self._cgroup(d).remove()
        vmnet.remove(d)
        shutil.rmtree(d, ignore_errors=True)

    def once(self, memory: Path | None = None, code: str | None = None) -> float:
        d, ms = self.start(memory, code)
        self.stop(d)
        return ms


async def _first_command(sb) -> None:
    r = await sb.commands.run(FIRST)
    if r.exit_code != 0:
        raise WarmboxError(f"first command exited {r.exit_code}: {r.stderr[-200:]}")


async def _warmbox_cold(engine, limits: Limits) -> tuple[float, dict[str, float]]:
    """A cold boot through the engine (what a template costs), to the first command."""
    from warmbox.engine import provision, teardown
    from warmbox.engine.start import StartRecord

    settings = engine.settings()
    tmpl = settings.template("shell")  # no warm-up: the boot itself, as raw QEMU does it
    t0 = time.perf_counter()
    got = await provision.launch(
        engine, provision.LaunchSpec(StartRecord.internal("microvm", tmpl.name, 120.0, limits)), provision.Cold(tmpl)
    )
    try:
        await got.session.exec(list(FIRST), timeout_s=30, max_output=1 << 16)
        ms = (time.perf_counter() - t0) * 1e3
    finally:
        await got.session.close()
        await teardown.destroy(engine, got.sandbox_id, "bench")
    return ms, {t.stage: t.duration_ms for t in got.timings}


def _builtin_root(engine: Any) -> Path:
    """The built-in image's microVM root disk (what ``base``, ``pydata`` and ``shell`` run)."""
    from warmbox.backends import microvm_image
    from warmbox.engine import resolve

    return microvm_image.image_root(microvm_image.cache_dir(), resolve.image_for(engine, "base"))


def _microvm(engine: Any) -> vm.MicroVMBackend:
    """The microVM backend itself: the raw baselines drive its QEMU with the same images and argv."""
    backend = engine.backend("microvm")
    assert isinstance(backend, vm.MicroVMBackend)
    return backend


def _template_files(engine, limits: Limits, work: Path, template: str = "base") -> Path:
    """warmbox's template memory image and workspace disk as ``work/<template>.{mem,qcow2}``."""
    import tarfile

    from warmbox import config
    from warmbox.engine import resolve, snapstore
    from warmbox.storage import snapshots as snaps

    image = resolve.image_for(engine, template)
    shape = config.shape_key("microvm", engine.settings().template(template), limits, image.image_id)
    sid = engine.registry.meta.meta_text(snapstore.template_key(engine, "microvm", shape, image))
    m = snaps.load_manifest(snapstore.store_for(engine), sid, snapstore.workdir(engine))
    cached = snapstore.cached_memory(engine, m, snapstore.workdir(engine))
    mem = work / f"{template}.mem"
    os.link(cached / "checkpoint.img", mem)
    tar_path = work / "workspace.tar"
    snaps.get_blob(
        snapstore.store_for(engine),
        m.filesystem_sha256,
        m.filesystem_bytes,
        m.filesystem_raw_bytes,
        tar_path,
        snapstore.workdir(engine),
    )
    with tarfile.open(tar_path) as tar:
        member = tar.extractfile("./disk.qcow2") or tar.extractfile("disk.qcow2")
        if member is None:
            raise WarmboxError(f"template snapshot {sid} holds no disk.qcow2")
        mem.with_suffix(".qcow2").write_bytes(member.read())
    tar_path.unlink()
    return mem


async def bench_start(home: Path, runs: int, variant: str = "both") -> dict:
    """empty: create -> ``/bin/true`` (warmbox restore, raw QEMU restore of the same memory image,
    both cold boots). agent: create from the ``pydata`` template (numpy + pandas imported in its
    code context before the snapshot) -> the real-agent cell (CSV write + describe), against raw
    QEMU restoring that same image and running that same cell on the agent's chardev."""
    from warmbox.bench.common import AGENT_CODE
    from warmbox.engine.engine import Engine
    from warmbox.sdk.sandbox import AsyncSandbox

    engine = Engine.for_home(home)
    backend = _microvm(engine)
    avail = backend.probe()
    if not avail.available:
        raise WarmboxError(f"microvm tier unavailable: {avail.reason}")
    work = Path(tempfile.mkdtemp(prefix="raw-qemu-", dir=engine.runtime))
    raw = RawQemu(backend, work, await asyncio.to_thread(_builtin_root, engine))
    methods = []
    if variant in ("empty", "both"):
        methods += ["warmbox_restore_first", "raw_qemu_restore_first", "warmbox_cold_boot_first", "raw_qemu_boot_first"]
    if variant in ("agent", "both"):
        methods += ["warmbox_restore_agent", "raw_qemu_restore_agent"]
    rows: dict[str, list[float]] = {k: [] for k in methods}
    stages: dict[str, list[float]] = {}
    limits = Limits()
    templates = {"first": "base", "agent": "pydata"}
    mems: dict[str, Path] = {}
    try:
        # untimed: warmbox's template snapshots; raw QEMU restores those very memory files and disks
        for kind in {m.rsplit("_", 1)[1] for m in methods}:
            sb = await AsyncSandbox.create(
                tier="microvm", template=templates[kind], timeout=300, pool=False, limits=limits, home=home
            )
            try:
                await _first_command(sb)
            finally:
                await sb.kill()
            mems[kind] = _template_files(engine, limits, work, templates[kind])
        for i in range(runs):
            order = methods[i % len(methods) :] + methods[: i % len(methods)]
            for m in order:
                if m.startswith("warmbox_restore"):
                    agent = m.endswith("_agent")
                    t0 = time.perf_counter()
                    sb = await AsyncSandbox.create(
                        tier="microvm",
                        template=templates["agent" if agent else "first"],
                        timeout=120,
                        pool=False,
                        limits=limits,
                        home=home,
                    )
                    try:
                        if agent:
                            r = await sb.run_code(AGENT_CODE, timeout=60)
                            if r.error is not None:
                                raise WarmboxError(f"the real-agent cell failed: {r.error.name}: {r.error.value}")
                        else:
                            await _first_command(sb)
                        rows[m].append((time.perf_counter() - t0) * 1e3)
                        if not agent:
                            for t in sb.stage_timings:
                                if t.on_request_path:
                                    stages.setdefault(t.stage, []).append(t.duration_ms)
                    finally:
                        await sb.kill()
                elif m == "raw_qemu_restore_first":
                    rows[m].append(await asyncio.to_thread(raw.once, mems["first"]))
                elif m == "raw_qemu_restore_agent":
                    rows[m].append(await asyncio.to_thread(raw.once, mems["agent"], AGENT_CODE))
                elif m == "warmbox_cold_boot_first":
                    rows[m].append((await _warmbox_cold(engine, limits))[0])
                else:
                    rows[m].append(await asyncio.to_thread(raw.once, None))
    finally:
        raw.close()
        shutil.rmtree(work, ignore_errors=True)
    stats = {k: _stats(v) for k, v in rows.items()}
    ratio = lambda a, b: stats[a]["p50_ms"] / stats[b]["p50_ms"]  # noqa: E731
    pairs = [
        ("warmbox_restore_first", "raw_qemu_restore_first"),
        ("warmbox_cold_boot_first", "raw_qemu_boot_first"),
        ("warmbox_cold_boot_first", "warmbox_restore_first"),
        ("warmbox_restore_agent", "raw_qemu_restore_agent"),
    ]
    return {
        "bench": "start",
        "tier": "microvm",
        "accelerator": backend.accel()[0],
        "accelerator_why": backend.accel()[1],
        "runs": runs,
        "variant": variant,
        "stats": stats,
        "ratios_p50": {f"{a}/{b}": ratio(a, b) for a, b in pairs if a in stats and b in stats},
        "restore_stages_p50_ms": {k: statistics.median(v) for k, v in stages.items()},
        "goals": _goals(stats, ratio) if "warmbox_restore_first" in stats else {},
        "kernel": backend.kernel_version(),
        "note": "first = /bin/true through the guest agent; agent = the numpy+pandas CSV cell in the pydata "
        "template's warmed code context; raw = the same QEMU argv, kernel, initramfs, root image and "
        "warmbox's own template memory file and disk, spoken to directly on QEMU's chardev (no engine, "
        "relay, reseed, registry or SDK); raw boot uses a fresh disk",
    }


def _goals(stats: dict, ratio) -> dict[str, dict]:
    """The issue's goals for this tier under TCG, each with the measured p50 and whether it is met."""
    got = {
        "restore_first_p50_ms<=400": stats["warmbox_restore_first"]["p50_ms"],
        "restore_first/raw_qemu_restore<=1.3": ratio("warmbox_restore_first", "raw_qemu_restore_first"),
        "cold_boot_first/raw_qemu_boot<=1.2": ratio("warmbox_cold_boot_first", "raw_qemu_boot_first"),
    }
    return {k: {"measured": round(v, 3), "met": v <= float(k.rsplit("<=", 1)[1])} for k, v in got.items()}


async def bench_snapshot(home: Path, runs: int) -> dict:
    from warmbox.engine.engine import Engine
    from warmbox.sdk.sandbox import AsyncSandbox

    engine = Engine.for_home(home)
    backend = _microvm(engine)
    work = Path(tempfile.mkdtemp(prefix="raw-qemu-", dir=engine.runtime))
    raw = RawQemu(backend, work, await asyncio.to_thread(_builtin_root, engine))
    rows: dict[str, list[float]] = {
        k: [] for k in ("pause_ms", "resume_first_ms", "raw_save_ms", "raw_restore_first_ms")
    }
    sizes: dict[str, int] = {}
    limits = Limits()
    try:
        d, _ = await asyncio.to_thread(raw.start)
        base = work / "template.mem"
        await asyncio.to_thread(raw.save, d, base)
        raw.stop(d)
        for i in range(runs):
            sb = await AsyncSandbox.create(tier="microvm", timeout=120, pool=False, limits=limits, home=home)
            try:
                await sb.files.write("/workspace/state.txt", "kept")
                await sb.run_code("kept = 41")
                t0 = time.perf_counter()
                ref = await sb.pause(memory=True)
                rows["pause_ms"].append((time.perf_counter() - t0) * 1e3)
            except BaseException:
                await sb.kill()
                raise
            t0 = time.perf_counter()
            back = await AsyncSandbox.resume(ref, home=home, timeout=120)
            try:
                await _first_command(back)
                rows["resume_first_ms"].append((time.perf_counter() - t0) * 1e3)
                if (await back.run_code("kept + 1")).text != "42" or await back.files.read(
                    "/workspace/state.txt"
                ) != "kept":
                    raise WarmboxError("the resumed microVM lost its state")
            finally:
                await back.kill()
            sizes = {"artifact_bytes": ref.size_bytes}
            d, _ = await asyncio.to_thread(raw.start, base)
            out = work / f"run{i}.mem"
            rows["raw_save_ms"].append(await asyncio.to_thread(raw.save, d, out))
            raw.stop(d)
            sizes["raw_memory_file_bytes"] = out.stat().st_size
            rows["raw_restore_first_ms"].append(await asyncio.to_thread(raw.once, out))
            out.unlink()
            out.with_suffix(".qcow2").unlink()
    finally:
        raw.close()
        shutil.rmtree(work, ignore_errors=True)
    stats = {k: _stats(v) for k, v in rows.items()}
    ratio = lambda a, b: stats[a]["p50_ms"] / stats[b]["p50_ms"]  # noqa: E731
    return {
        "bench": "snapshot",
        "tier": "microvm",
        "memory_snapshot": True,
        "runs": runs,
        "sizes": sizes,
        "accelerator": backend.accel()[0],
        "stats": stats,
        "ratios_p50": {
            "pause/raw_save": ratio("pause_ms", "raw_save_ms"),
            "resume_first/raw_restore_first": ratio("resume_first_ms", "raw_restore_first_ms"),
        },
        "note": "pause = QEMU stop + migrate to a file + quit + workspace disk + compress/store + destroy; "
        "raw = stop + migrate + quit of a raw VM of the same images; first command = /bin/true",
    }
