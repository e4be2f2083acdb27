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

from warmbox import protocol as p
from warmbox.backends import microvm as vm
from warmbox.errors import WarmboxError
from warmbox.models import Limits

FIRST = ["/bin/true"]


def _stats(v: list[float]) -> dict[str, float]:
    s = sorted(v)
    return {"n": len(s), "p50_ms": statistics.median(s), "min_ms": s[0], "max_ms": s[-1]}


def _send(sock: socket.socket, msg: p.Message) -> None:
    sock.sendall(p.encode(msg))


def _recv(sock: socket.socket) -> p.Message:
    msg = p.recv_message(sock, p.GUEST_TO_HOST)
    if msg is None:
        raise WarmboxError("raw QEMU: the agent port closed")
    return msg


def _raw_first_command(chardev: Path, deadline: float) -> None:
    """Connect to QEMU's agent chardev and run ``true``; returns when it exited."""
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
        _send(s, p.Exec(7, argv=FIRST, env={}, cwd="", timeout_s=30, max_output=1 << 16, stdin=False))
        while True:
            msg = _recv(s)
            if msg.id == 7 and isinstance(msg, (p.Exited, p.Failure)):
                if not isinstance(msg, p.Exited) or msg.exit_code != 0:
                    raise WarmboxError(f"raw QEMU: first command answered {msg!r}")
                return
    finally:
        s.close()


class RawQemu:
    """One VM at a time from the backend's own argv; stopped by its pidfile's PID."""

    def __init__(self, backend: vm.MicroVMBackend, work: Path) -> None:
        self.backend = backend
        self.work = work

    def _dir(self) -> Path:
        d = Path(tempfile.mkdtemp(prefix="raw-", dir=self.work))
        (d / "run").mkdir()
        (d / "workspace").mkdir()
        return d

    def _stop(self, d: Path) -> None:
        pid = vm._pidfile(d / "qemu.pid")
        if pid and vm._ours(pid, d):
            vm._kill(pid)
            deadline = time.monotonic() + 10
            while vm._running(pid) and time.monotonic() < deadline:
                time.sleep(0.005)
        shutil.rmtree(d, ignore_errors=True)

    def _run(self, d: Path, memory: Path | None) -> float:
        argv = vm.qemu_argv(self.backend.image(), d, Limits(), self.backend.accel()[0],
                            incoming=vm.INCOMING_FD if memory else None)
        t0 = time.perf_counter()
        vm._spawn(argv, d / "qemu.log", fd3=memory)
        _raw_first_command(d / "run" / "vm.sock", time.monotonic() + 120)
        return (time.perf_counter() - t0) * 1e3

    def boot(self) -> float:
        d = self._dir()
        try:
            subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b",
                            str(self.backend.image() / "workspace.raw"), "-F", "raw",
                            str(d / "workspace" / "disk.qcow2")], check=True, timeout=60)
            return self._run(d, None)
        finally:
            self._stop(d)

    def save(self, out: Path) -> tuple[float, float]:
        """Boot, then stop + migrate to ``out`` (the raw template): (boot ms, save ms)."""
        d = self._dir()
        try:
            subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b",
                            str(self.backend.image() / "workspace.raw"), "-F", "raw",
                            str(d / "workspace" / "disk.qcow2")], check=True, timeout=60)
            boot = self._run(d, None)
            t0 = time.perf_counter()
            asyncio.run(self._migrate(d, out))
            save = (time.perf_counter() - t0) * 1e3
            shutil.copy(d / "workspace" / "disk.qcow2", out.with_suffix(".qcow2"))
            return boot, save
        finally:
            self._stop(d)

    @staticmethod
    async def _migrate(d: Path, out: Path) -> None:
        qmp = await vm.QMP.connect(d / "run" / "qmp.sock")
        try:
            await qmp.execute("stop")
            await qmp.execute("migrate", uri=f"exec:cat > {vm._shell_quote(str(out))}")
            while (await qmp.execute("query-migrate") or {}).get("status") != "completed":
                await asyncio.sleep(0.01)
            await qmp.execute("quit")
        finally:
            await qmp.close()

    def restore(self, memory: Path) -> float:
        d = self._dir()
        try:
            shutil.copy(memory.with_suffix(".qcow2"), d / "workspace" / "disk.qcow2")
            return self._run(d, memory)
        finally:
            self._stop(d)
