"""The engine: creates, tracks and destroys sandboxes on any backend, recording every stage.

One Engine per WARMBOX_HOME per process; all durable state is in the registry so sandboxes
outlive the process that created them, and any process may reap expired ones.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

from warmbox import backends, protocol as p
from warmbox.backends.base import Backend, BackendHandle, ResourceUsage, SandboxSpec
from warmbox.engine.guest_client import GuestClient
from warmbox.engine.lifecycle import LIVE, Operation, check
from warmbox.errors import (BackendUnavailable, GuestConnectionError, InvalidArgument, SandboxNotFound,
                            SandboxStartError, WarmboxError)
from warmbox.models import Limits, SandboxInfo, StageTiming, State, TierStatus
from warmbox.storage.registry import Registry

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 24 * 3600.0
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_SOCKET_PATH = 107


def default_home() -> Path:
    env = os.environ.get("WARMBOX_HOME")
    if env:
        return Path(env).expanduser().resolve()
    return Path("~/.local/share/warmbox").expanduser()


def runtime_dir(home: Path) -> Path:
    """Where sandboxes' filesystems and runtime state live (WARMBOX_RUNTIME_DIR overrides).

    Separate from WARMBOX_HOME because every ancestor of a rootfs or bind-mount source must be
    traversable by the sandbox's unprivileged host uid, and a home such as /root is not.
    """
    env = os.environ.get("WARMBOX_RUNTIME_DIR")
    if env:
        return Path(env).expanduser().resolve()
    return Path("/var/lib/warmbox") / hashlib.sha256(str(home).encode()).hexdigest()[:12]


def validate_timeout(timeout: object, name: str = "timeout") -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout):
        raise InvalidArgument(f"{name} must be a number of seconds, got {timeout!r}")
    if timeout <= 0 or timeout > MAX_TIMEOUT_S:
        raise InvalidArgument(f"{name} must be > 0 and <= {MAX_TIMEOUT_S:.0f} seconds, got {timeout!r}")
    return float(timeout)


def validate_envs(envs: object) -> tuple[tuple[str, str], ...]:
    if envs is None:
        return ()
    if not isinstance(envs, dict):
        raise InvalidArgument(f"envs must be a dict of str to str, got {type(envs).__name__}")
    out = []
    for k, v in envs.items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise InvalidArgument(f"environment variable name {k!r} is not valid")
        if not isinstance(v, str) or "\0" in v:
            raise InvalidArgument(f"environment variable {k} must be a string without NUL bytes")
        out.append((k, v))
    return tuple(out)


class Engine:
    _instances: dict[Path, "Engine"] = {}

    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.runtime = runtime_dir(home)
        self.runtime.mkdir(parents=True, exist_ok=True, mode=0o711)
        os.chmod(self.runtime, 0o711)  # traversable, not listable
        self.registry = Registry(home / "registry.db")
        self._backends: dict[str, Backend] = {}

    @classmethod
    def for_home(cls, home: Path | str | None = None) -> "Engine":
        path = Path(home).expanduser().resolve() if home is not None else default_home()
        engine = cls._instances.get(path)
        if engine is None:
            engine = cls._instances[path] = cls(path)
        return engine

    def backend(self, tier: str) -> Backend:
        tier = backends.canonical_tier(tier)
        b = self._backends.get(tier)
        if b is None:
            b = self._backends[tier] = backends.load(tier, self.runtime)
        return b

    def doctor(self) -> list[TierStatus]:
        out = []
        for tier in backends.TIERS:
            try:
                avail = self.backend(tier).probe()
                out.append(TierStatus(tier, avail.available, avail.reason))
            except BackendUnavailable as e:
                out.append(TierStatus(tier, False, e.reason))
        return out

    # ---- create

    async def create(self, *, tier: str = "container", timeout: float = DEFAULT_TIMEOUT_S,
                     envs: dict[str, str] | None = None, limits: Limits | None = None,
                     template: str = "base") -> tuple[SandboxInfo, BackendHandle, GuestClient, list[StageTiming]]:
        """Create and start a sandbox; returns it with a connected guest client and its stage timings."""
        t0 = time.perf_counter()
        tier = backends.canonical_tier(tier)
        timeout = validate_timeout(timeout)
        env_pairs = validate_envs(envs)
        if limits is None:
            limits = Limits()
        elif not isinstance(limits, Limits):
            raise InvalidArgument(f"limits must be a warmbox.Limits, got {type(limits).__name__}")
        if template != "base":
            raise InvalidArgument(f"unknown template {template!r} (available: base)")
        backend = self.backend(tier)
        avail = backend.probe()
        if not avail.available:
            raise BackendUnavailable(tier, avail.reason)
        sandbox_id = "sb-" + secrets.token_hex(6)
        state_dir = self.runtime / "sandboxes" / sandbox_id
        socket_path = str(state_dir / "run" / "agent.sock")
        if len(socket_path) > _MAX_SOCKET_PATH:
            raise InvalidArgument(f"runtime dir {self.runtime} is too long for a unix socket path")
        self.registry.allocate(sandbox_id, tier, template, timeout, limits.memory_mb, limits.cpus,
                                      limits.pids, str(state_dir), socket_path)
        info, handle = self.registry.get(sandbox_id)
        state_dir.parent.mkdir(mode=0o711, exist_ok=True)
        state_dir.mkdir(mode=0o711)
        t1 = time.perf_counter()
        client = None
        try:
            handle = await backend.create(SandboxSpec(
                sandbox_id=sandbox_id, state_dir=str(state_dir), uid_base=handle.uid_base,
                envs=env_pairs, limits=limits))
            t2 = time.perf_counter()
            async def ready() -> GuestClient:
                nonlocal client
                client = await GuestClient.connect(handle.socket_path, sandbox_id)
                pong = await asyncio.wait_for(client.call(lambda i: p.Ping(i), p.Pong), 30)
                if not isinstance(pong, p.Pong) or pong.version != p.PROTOCOL_VERSION:
                    raise SandboxStartError(f"guest agent speaks an unexpected protocol: {pong!r}", sandbox_id)
                return client

            client = await backend.start(handle, ready)
            t3 = time.perf_counter()
        except BaseException as e:
            if client is not None:
                await client.close()
            await self._cleanup_failed(sandbox_id, handle, backend, e)
            if isinstance(e, (WarmboxError, asyncio.CancelledError, KeyboardInterrupt)):
                raise
            if isinstance(e, asyncio.TimeoutError):
                raise SandboxStartError("guest agent did not answer within 30 s", sandbox_id) from None
            raise SandboxStartError(f"sandbox start failed: {type(e).__name__}: {e}", sandbox_id) from None
        timings = [StageTiming(sandbox_id, "allocate", (t1 - t0) * 1e3),
                   StageTiming(sandbox_id, "filesystem", (t2 - t1) * 1e3),
                   StageTiming(sandbox_id, "runtime", (t3 - t2) * 1e3)]
        self.registry.add_timings(timings)
        self.registry.set_state(sandbox_id, State.READY, "guest agent answered")
        self.ensure_reaper()
        info, _ = self.registry.get(sandbox_id)
        return info, handle, client, timings

    async def _cleanup_failed(self, sandbox_id: str, handle: BackendHandle, backend: Backend, why: BaseException) -> None:
        self.registry.set_state(sandbox_id, State.FAILED, f"start failed: {type(why).__name__}")
        try:
            await backend.destroy(handle)
        except Exception:
            return  # stays FAILED: keeps its uid range, and the reaper retries the teardown
        self.registry.set_state(sandbox_id, State.DESTROYED, "cleaned up after failed start")

    # ---- lookup

    def info(self, sandbox_id: str) -> tuple[SandboxInfo, BackendHandle]:
        if not isinstance(sandbox_id, str) or not re.fullmatch(r"sb-[0-9a-f]{12}", sandbox_id):
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} (ids look like sb-0123456789ab)", str(sandbox_id))
        return self.registry.get(sandbox_id)

    async def open(self, sandbox_id: str) -> tuple[SandboxInfo, BackendHandle, GuestClient]:
        """Connect to a live sandbox by id (from any process)."""
        info, handle = self.info(sandbox_id)
        check(Operation.EXEC, info.state, sandbox_id)
        if info.expires_at <= time.time():
            await self.destroy(sandbox_id, "timeout expired")
            raise SandboxNotFound(f"sandbox {sandbox_id} expired and was destroyed", sandbox_id)
        try:
            client = await GuestClient.connect(handle.socket_path, sandbox_id)
        except GuestConnectionError:
            if not await self.backend(info.tier).alive(handle):
                await self.destroy(sandbox_id, "found dead")
                raise SandboxNotFound(f"sandbox {sandbox_id} is no longer running", sandbox_id) from None
            raise
        return info, handle, client

    def holding(self) -> list[SandboxInfo]:
        """Live sandboxes plus failed ones whose teardown is still owed."""
        return [i for i in self.list(include_dead=True) if i.state in LIVE or i.state is State.FAILED]

    def list(self, include_dead: bool = False) -> list[SandboxInfo]:
        return [info for info, _ in self.registry.list(include_dead)]

    def timings(self, sandbox_id: str) -> dict[str, float]:
        return {t.stage: t.duration_ms for t in self.registry.timings(sandbox_id)}

    async def usage(self, handle: BackendHandle) -> ResourceUsage:
        return await self.backend(handle.tier).usage(handle)

    def set_timeout(self, sandbox_id: str, timeout: float) -> float:
        timeout = validate_timeout(timeout)
        info, _ = self.info(sandbox_id)
        check(Operation.SET_TIMEOUT, info.state, sandbox_id)
        expires = time.time() + timeout
        self.registry.set_expiry(sandbox_id, expires)
        return expires

    # ---- destroy

    async def destroy(self, sandbox_id: str, reason: str = "killed") -> bool:
        """Destroy a sandbox; False if it was already gone. Leaves no process, mount, cgroup or dir."""
        info, handle = self.info(sandbox_id)
        if info.state is State.DESTROYED:
            return False
        check(Operation.DESTROY, info.state, sandbox_id)
        await self.backend(info.tier).destroy(handle)
        self.registry.set_state(sandbox_id, State.DESTROYED, reason)
        return True

    async def reap(self) -> list[str]:
        """Destroy every live sandbox whose timeout expired; returns their ids."""
        now = time.time()
        reaped = []
        for info, _ in self.registry.list():
            if (info.state in LIVE and info.expires_at <= now) or info.state is State.FAILED:
                try:
                    if await self.destroy(info.sandbox_id, "timeout expired"):
                        reaped.append(info.sandbox_id)
                except Exception:  # one bad sandbox must not stop the reaper; retried next round
                    continue
        return reaped

    def next_expiry(self) -> float | None:
        live = [i.expires_at for i in self.holding()]
        return min(live) if live else None

    def ensure_reaper(self) -> None:
        """Start the background reaper for this home unless one runs (it holds an flock)."""
        lock = self.home / "reaper.lock"
        import fcntl

        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return  # a reaper holds it
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        with open(self.home / "reaper.log", "ab") as log:
            subprocess.Popen(
                [sys.executable, "-m", "warmbox.engine.reaper", str(self.home)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                start_new_session=True, close_fds=True,
            )
