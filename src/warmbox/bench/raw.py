"""The raw baselines every benchmark runs beside warmbox's sandboxes: ``runc run`` and ``runsc`` of the
very OCI bundle warmbox generates, ``bwrap``, a unix-socket round trip between two processes, a
blocking client of the guest agent, and a host-side tar + zstd of a sandbox's files."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from warmbox.errors import WarmboxError


def _bwrap_argv(cmd: list[str]) -> list[str]:
    argv = [
        "bwrap",
        "--unshare-all",
        "--die-with-parent",
        "--ro-bind",
        "/usr",
        "/usr",
        "--ro-bind",
        "/etc/alternatives",
        "/etc/alternatives",
        "--ro-bind",
        "/etc/ld.so.cache",
        "/etc/ld.so.cache",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
        "--dir",
        "/workspace",
        "--chdir",
        "/workspace",
    ]
    for link in ("bin", "sbin", "lib", "lib64"):
        if os.path.islink("/" + link):
            argv += ["--symlink", os.readlink("/" + link), "/" + link]
    return [*argv, "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", *cmd]


def _raw_bundle(backend, d: Path, uid_base: int, cmd: list[str], seed: Path | None = None) -> None:
    """An OCI bundle in ``d`` with the backend's own config for a sandbox, ``cmd`` as its process;
    ``seed``: a host directory whose contents are copied into its workspace first."""
    from warmbox.backends.base import SandboxSpec
    from warmbox.backends.runc import GUEST_GID, GUEST_UID
    from warmbox.models import Limits

    ws = d / "workspace"
    ws.mkdir(parents=True)
    if seed is not None:  # before the container exists: nothing in ws is the guest's yet
        shutil.copytree(seed, ws, symlinks=True, dirs_exist_ok=True)
        for root, dirs, files in os.walk(ws):
            for name in dirs + files:
                os.chown(os.path.join(root, name), uid_base + GUEST_UID, uid_base + GUEST_GID, follow_symlinks=False)
    os.chown(ws, uid_base + GUEST_UID, uid_base + GUEST_GID)
    spec = SandboxSpec(sandbox_id=d.name, state_dir=str(d), uid_base=uid_base, envs=(), limits=Limits())
    config = backend.config(spec, backend.image(), ws)
    config["process"]["args"] = cmd
    (d / "config.json").write_text(json.dumps(config))


class _RawRunc:
    """The same OCI config as warmbox's, run in the foreground by runc with ``cmd`` as PID 1."""

    def __init__(self, runtime: Path) -> None:
        from warmbox.backends.runc import RuncBackend
        from warmbox.storage.registry import MAX_SLOTS, UID_BASE, UID_RANGE

        self.backend = RuncBackend(runtime)
        self.dir = runtime / "bench-raw"
        self.uid_base = UID_BASE + MAX_SLOTS * UID_RANGE  # last slot: never handed to a sandbox
        self.n = 0

    def run(self, cmd: list[str], seed: Path | None = None, check: bool = True) -> tuple[float, str]:
        """(ms, stdout) of ``runc run`` of ``cmd`` in a fresh bundle (``seed`` copied into its
        workspace, timed too); check: a nonzero exit is a WarmboxError."""
        self.n += 1
        cid = f"wbbench-{os.getpid()}-{self.n}"
        d = self.dir / cid
        t0 = time.perf_counter()
        _raw_bundle(self.backend, d, self.uid_base, cmd, seed)
        try:
            out = subprocess.run(
                [self.backend.runc, "--root", str(self.backend.root), "run", "--bundle", str(d), cid],
                capture_output=True,
                text=True,
                timeout=120,
            )
            ms = (time.perf_counter() - t0) * 1e3
        finally:
            subprocess.run(
                [self.backend.runc, "--root", str(self.backend.root), "delete", "--force", cid], capture_output=True
            )
            shutil.rmtree(d, ignore_errors=True)
        if check and out.returncode != 0:
            raise WarmboxError(f"raw runc failed: {out.stderr.strip()[-300:]}")
        return ms, out.stdout

    def start(self, cmd: list[str]) -> str:
        """``cmd`` as PID 1 of a container left running (``runc run --detach``, stdio /dev/null);
        its id, for ``sandbox_cgroup`` and ``delete``."""
        self.n += 1
        cid = f"wbbench-{os.getpid()}-{self.n}"
        d = self.dir / cid
        _raw_bundle(self.backend, d, self.uid_base, cmd)
        log = d / "runc.log"  # not a pipe: the container keeps its stdio open, a pipe never ends
        try:
            with open(log, "wb") as err:
                rc = subprocess.run(
                    [self.backend.runc, "--root", str(self.backend.root), "run", "--detach", "--bundle", str(d), cid],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    timeout=120,
                ).returncode
            if rc != 0:
                raise WarmboxError(f"raw runc failed: {log.read_text(errors='replace').strip()[-300:]}")
        except BaseException:
            self.delete(cid)
            raise
        return cid

    def delete(self, cid: str) -> None:
        """The container of ``start`` gone: its processes, runc's record, its cgroups, its bundle."""
        from warmbox.backends import _host as host

        subprocess.run(
            [self.backend.runc, "--root", str(self.backend.root), "delete", "--force", cid],
            capture_output=True,
            timeout=120,
        )
        host.SandboxCgroup(cid).remove()  # (kills what is left) a half-started one has no runc record
        shutil.rmtree(self.dir / cid, ignore_errors=True)


def _bwrap(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(_bwrap_argv(cmd), capture_output=True, text=True, timeout=120)
    ms = (time.perf_counter() - t0) * 1e3
    if out.returncode != 0:
        raise WarmboxError(f"bwrap failed: {out.stderr.strip()[-300:]}")
    return ms, out.stdout


def _echo_server(sock: socket.socket) -> None:
    while True:
        data = sock.recv(64)
        if not data:
            return
        sock.sendall(data)


def _raw_rtt(n: int) -> list[float]:
    """Round trip of 16 bytes over a unix socket to another process: the physical floor."""
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        a.close()
        try:
            _echo_server(b)
        finally:
            os._exit(0)
    b.close()
    out = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            a.sendall(b"x" * 16)
            a.recv(64)
            out.append((time.perf_counter() - t) * 1e6)
    finally:
        a.close()
        os.waitpid(pid, 0)
    return out


def _blocking_ping_rtt(socket_path: str, n: int) -> list[float]:
    """Empty request to the guest agent with a plain blocking client (no asyncio on the host)."""
    from warmbox import protocol as p

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(socket_path)
    out = []
    try:
        for i in range(n):
            t = time.perf_counter()
            s.sendall(p.encode(p.Ping(id=i + 1)))
            msg = p.recv_message(s, (p.Pong,))
            out.append((time.perf_counter() - t) * 1e6)
            if not isinstance(msg, p.Pong):
                raise WarmboxError(f"unexpected reply {msg!r}")
    finally:
        s.close()
    return out


def _raw_fs_snapshot(workspace: Path, work: Path) -> tuple[float, float, int]:
    """The floor for a files snapshot: host-side tar + zstd of the same directory, and its untar.

    The directory is the sandbox's: tar reads it as its owner (hostfs), never root walking it."""
    import tarfile

    import zstandard

    from warmbox.backends import hostfs

    out = work / "raw.tar.zst"
    t0 = time.perf_counter()
    with open(out, "wb") as f:
        with zstandard.ZstdCompressor(level=3, threads=-1).stream_writer(f) as z:

            def write(data: bytes) -> None:
                z.write(data)

            asyncio.run(hostfs.tar_create(workspace, write, max_bytes=1 << 40, timeout=600))
    save_ms = (time.perf_counter() - t0) * 1e3
    size = out.stat().st_size
    dest = work / "raw-restore"
    dest.mkdir()
    t0 = time.perf_counter()
    with open(out, "rb") as src:
        with zstandard.ZstdDecompressor().stream_reader(src) as unz:
            with tarfile.open(fileobj=unz, mode="r|") as tar:
                tar.extractall(dest, filter="tar")
    restore_ms = (time.perf_counter() - t0) * 1e3
    shutil.rmtree(dest)
    out.unlink()
    return save_ms, restore_ms, size


class _RawRunsc:
    """The gVisor tier's bundle run by runsc directly: the command as the container's process."""

    def __init__(self, runtime: Path) -> None:
        from warmbox.backends.gvisor import GvisorBackend
        from warmbox.storage.registry import MAX_SLOTS, UID_BASE, UID_RANGE

        self.backend = GvisorBackend(runtime)
        self.dir = runtime / "bench-raw-runsc"
        self.uid_base = UID_BASE + MAX_SLOTS * UID_RANGE
        self.n = 0

    def _bundle(self, cmd: list[str]) -> tuple[str, Path]:
        self.n += 1
        cid = f"wbbench-gv-{os.getpid()}-{self.n}"
        d = self.dir / cid
        _raw_bundle(self.backend, d, self.uid_base, cmd)
        (d / "run").mkdir()
        return cid, d

    def _run(self, args: list[str], log: Path, timeout: float = 120) -> int:
        with open(log, "ab") as f:
            return subprocess.run(
                self.backend._global() + args, stdin=subprocess.DEVNULL, stdout=f, stderr=f, timeout=timeout
            ).returncode

    def run(self, cmd: list[str]) -> tuple[float, str]:
        cid, d = self._bundle(cmd)
        t0 = time.perf_counter()
        try:
            out = subprocess.run(
                [*self.backend._global(), "run", "--bundle", str(d), cid],
                capture_output=True,
                text=True,
                timeout=120,
                stdin=subprocess.DEVNULL,
            )
            ms = (time.perf_counter() - t0) * 1e3
        finally:
            self._run(["delete", "--force", cid], d / "log")
            shutil.rmtree(d, ignore_errors=True)
        if out.returncode != 0:
            raise WarmboxError(f"raw runsc failed: {out.stderr.strip()[-300:]}")
        return ms, out.stdout

    def checkpoint_restore(self, code: str) -> tuple[float, float, int]:
        """A python process that imported pandas: raw checkpoint time, raw restore time, image size."""
        cid, d = self._bundle(["python3", "-c", code])
        img = d / "img"
        img.mkdir()
        try:
            if self._run(["run", "--detach", "--bundle", str(d), cid], d / "log") != 0:
                raise WarmboxError(f"raw runsc run failed: {_tail_log(d / 'log')}")
            deadline = time.monotonic() + 60
            while not (d / "workspace" / "ready").exists():
                if time.monotonic() > deadline:
                    raise WarmboxError("raw runsc: the process did not get ready")
                time.sleep(0.02)
            t0 = time.perf_counter()
            if self._run(["checkpoint", f"--image-path={img}", cid], d / "log") != 0:
                raise WarmboxError(f"raw runsc checkpoint failed: {_tail_log(d / 'log')}")
            ckpt_ms = (time.perf_counter() - t0) * 1e3
            size = (img / "checkpoint.img").stat().st_size
            self._run(["delete", "--force", cid], d / "log")
            (d / "workspace" / "ready").unlink()
            t0 = time.perf_counter()
            if self._run(["restore", "--detach", f"--image-path={img}", "--bundle", str(d), cid], d / "log") != 0:
                raise WarmboxError(f"raw runsc restore failed: {_tail_log(d / 'log')}")
            while not (d / "workspace" / "ready").exists():  # the restored loop writes it again
                if time.monotonic() > deadline + 60:
                    raise WarmboxError("raw runsc: the restored process did not continue")
                time.sleep(0.005)
            restore_ms = (time.perf_counter() - t0) * 1e3
        finally:
            self._run(["delete", "--force", cid], d / "log")
            shutil.rmtree(d, ignore_errors=True)
        return ckpt_ms, restore_ms, size


def _tail_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()[-300:]
    except OSError:
        return "(no log)"


def raw_template_loop(template: str) -> str:
    """The raw process of the gVisor snapshot rows: a python that ran ``template``'s warm-up (the
    same imports as warmbox's sandbox: the same application state for runsc to save and load), then
    writes /workspace/ready whenever it is missing."""
    from warmbox.config import BUILTIN_TEMPLATES

    warmup = BUILTIN_TEMPLATES[template]["warmup_code"] or ""
    return (
        "import os, time\n" + warmup + "\n"
        "while True:\n"
        "    if not os.path.exists('/workspace/ready'):\n"
        "        open('/workspace/ready', 'w').close()\n"
        "    time.sleep(0.005)"
    )
