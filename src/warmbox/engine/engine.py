"""The engine: creates, tracks and destroys sandboxes on any backend, recording every stage.

One Engine per WARMBOX_HOME per process; all durable state is in the registry so sandboxes
outlive the process that created them, and any process may reap expired ones.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import secrets
import time
from pathlib import Path

from warmbox import backends, config, protocol as p
from warmbox.backends.base import Backend
from warmbox.engine.guest_client import GuestClient
from warmbox.lifecycle import LIVE, Operation, check
from warmbox.config import PoolConfig, Settings, Template
from warmbox.errors import (BackendUnavailable, GuestConnectionError, GuestProtocolError, InvalidArgument,
                            SandboxNotFound, SandboxStartError, WarmboxError)
from warmbox.models import BackendHandle, Limits, NetEvent, ResourceUsage, SandboxSpec, SandboxInfo, SandboxMetrics, StageTiming, State, TierStatus
from warmbox.engine import egress
from warmbox.network.policy import Policy
from warmbox.paths import default_home, owner_alive, owner_tag, runtime_dir  # noqa: F401 - re-exported
from warmbox.storage.registry import Registry

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 24 * 3600.0
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_SOCKET_PATH = 107


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


WARMUP_TIMEOUT_S = 600.0
CREATE_DEADLINE_S = WARMUP_TIMEOUT_S + 300.0
TEMPLATE_VMS_KEY = "template-vms"  # see Engine.mark_template_vm


async def _warm_up(client: GuestClient, tmpl: Template, sandbox_id: str) -> None:
    """Run a template's warm-up; any failure raises SandboxStartError naming what failed."""
    for cmd in tmpl.warmup_commands:
        tail = bytearray()
        async with client.request(lambda i: p.Exec(i, argv=["/bin/bash", "-c", cmd], env={}, cwd="",
                                                   timeout_s=WARMUP_TIMEOUT_S, max_output=1 << 20, stdin=False),
                                  timeout=WARMUP_TIMEOUT_S + 15) as stream:
            while True:
                msg = await stream.next(p.Started, p.Stdout, p.Stderr, p.Exited)
                if isinstance(msg, p.Failure):
                    raise SandboxStartError(f"template {tmpl.name} warm-up command {cmd!r}: {msg.message}", sandbox_id)
                if isinstance(msg, (p.Stdout, p.Stderr)):
                    tail = (tail + msg.data)[-400:]
                elif isinstance(msg, p.Exited):
                    break
        if msg.oom_kills > 0:
            raise SandboxStartError(f"template {tmpl.name} warm-up command {cmd!r} hit the memory limit: "
                                    "OOM kill", sandbox_id)
        if msg.exit_code != 0 or msg.timed_out:
            raise SandboxStartError(f"template {tmpl.name} warm-up command {cmd!r} exited {msg.exit_code}"
                                    f"{' (timed out)' if msg.timed_out else ''}: "
                                    f"{tail.decode('utf-8', 'replace').strip()}", sandbox_id)
    if tmpl.warmup_code is not None:
        await _warm_up_code(client, tmpl, sandbox_id)
    if tmpl.warmup_code is not None or tmpl.warmup_commands:
        # the caller's first cell is cell 1, and its busy/idle counters start at zero
        reply = await client.call(lambda i: p.Configure(i, env={}, reset_counts=True), p.UsageReport)
        if isinstance(reply, p.Failure):
            raise SandboxStartError(f"template {tmpl.name} warm-up: {reply.message}", sandbox_id)


async def _warm_up_code(client: GuestClient, tmpl: Template, sandbox_id: str) -> None:
    async with client.request(lambda i: p.ContextRun(i, context="default", code=tmpl.warmup_code,
                                                     timeout_s=WARMUP_TIMEOUT_S, max_output=1 << 20),
                              timeout=WARMUP_TIMEOUT_S + 15) as stream:
        while True:
            msg = await stream.next(p.Stdout, p.Stderr, p.Display, p.CodeDone)
            if isinstance(msg, p.Failure):
                raise SandboxStartError(f"template {tmpl.name} warm-up: {msg.message}", sandbox_id)
            if isinstance(msg, p.CodeDone):
                break
    if msg.oom_kills > 0:
        raise SandboxStartError(f"template {tmpl.name} warm-up hit the memory limit: OOM kill", sandbox_id)
    if msg.error_name or msg.timed_out:
        raise SandboxStartError(f"template {tmpl.name} warm-up failed: {msg.error_name}: {msg.error_value}"[:800],
                                sandbox_id)


class Engine:
    _instances: dict[Path, "Engine"] = {}

    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.runtime = runtime_dir(home)  # made when a backend first needs it
        # every allocation (create, pool refill, restore of a snapshot) checks its limits first
        self.registry = Registry(home / "registry.db", check_limits=self.check_limits)
        self._backends: dict[str, Backend] = {}
        self.owner = owner_tag(os.getpid())

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
            self.runtime.mkdir(parents=True, exist_ok=True, mode=0o711)
            os.chmod(self.runtime, 0o711)  # traversable, not listable
            b = self._backends[tier] = backends.load(tier, self.runtime)
            configure = getattr(b, "configure", None)
            if configure is not None:
                configure(self.settings())
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

    def logs(self, sandbox_id: str) -> str:
        """The tails of a sandbox's runtime logs (runtime, agent, a gVisor Sentry panic, QEMU),
        live while it runs, kept after it ended (the last 500 ended sandboxes)."""
        from warmbox.backends import hostfs

        info, handle = self.info(sandbox_id)
        data = b""
        if Path(handle.state_dir).is_dir():
            data = hostfs.log_tails(handle.state_dir, self.backend(info.tier).runtime_logs)
        if not data:
            try:
                with open(self.runtime / "logs" / f"{sandbox_id}.log", "rb") as f:
                    data = f.read(1 << 20)
            except OSError:
                pass
        return data.decode("utf-8", "replace")

    def settings(self) -> Settings:
        return config.load(self.home)

    def check_limits(self, limits: Limits) -> None:
        """LimitTooHigh if ``limits`` ask for more than this host has or ``[limits]`` allows, or
        for a disk larger than what is free where the sandboxes live (every allocation)."""
        self.settings().limits.check(limits)
        config.check_disk_free(limits, self.runtime)

    # ---- create

    async def create(self, *, tier: str | None = None, timeout: float | None = None,
                     envs: dict[str, str] | None = None, limits: Limits | None = None,
                     template: str | None = None, pool: bool = True, network: object = None,
                     secrets: dict | None = None,
                     ) -> tuple[SandboxInfo, BackendHandle, GuestClient, list[StageTiming]]:
        """A ready sandbox with a connected guest client and its stage timings.

        Taken from a pool of the same (tier, template, limits) when one has a ready sandbox
        (``pool=False``: never), otherwise created cold, with the template's warm-up run.
        A network policy other than "none" links it to the egress proxy (stage ``network``).
        """
        t0 = time.perf_counter()
        settings = self.settings()
        tier = backends.canonical_tier(settings.defaults.tier if tier is None else tier)
        policy = Policy.of(network)
        secret_map = egress.validate_secrets(secrets)
        if secret_map and not policy.enabled:
            raise InvalidArgument("secrets are only usable with a network policy that allows their hosts")
        egress.check_tier(self, tier, policy)
        got = await self._create(tier, timeout, envs, limits, template, pool, t0, settings)
        if policy.enabled:
            info, handle, client, timings = got
            try:
                timings.append(await egress.attach(self, handle, client, policy, secret_map))
            except BaseException:
                await client.close()
                await self.destroy(info.sandbox_id, "network setup failed")
                raise
        return got

    async def _create(self, tier: str, timeout: float | None, envs: dict[str, str] | None, limits: Limits | None,
                      template: str | None, pool: bool, t0: float, settings: Settings,
                      ) -> tuple[SandboxInfo, BackendHandle, GuestClient, list[StageTiming]]:
        timeout = validate_timeout(settings.defaults.timeout_s if timeout is None else timeout)
        env_pairs = validate_envs(envs)
        if limits is None:
            limits = Limits()
        elif not isinstance(limits, Limits):
            raise InvalidArgument(f"limits must be a warmbox.Limits, got {type(limits).__name__}")
        settings.limits.check(limits)  # before any pool claim, row or directory
        if template is None:
            template = settings.defaults.template
        if not isinstance(template, str):
            raise InvalidArgument(f"template must be a string, got {type(template).__name__}")
        tmpl = settings.template(template)
        if pool:
            pc = settings.pool_for(tier, template, limits)
            if pc is not None:
                got = await self._claim(pc, config.shape_key(tier, tmpl, limits), timeout, env_pairs, t0)
                if got is not None:
                    return got
        if self.backend(tier).capabilities().snapshot_start:
            return await self._start_from_template(tier, tmpl, timeout, env_pairs, limits, t0)
        info, handle, client, timings = await self._start(tier, tmpl, timeout, env_pairs, limits, "", "", t0)
        return info, handle, client, timings

    async def _start_from_template(self, tier: str, tmpl: Template, timeout: float,
                                   env_pairs: tuple[tuple[str, str], ...], limits: Limits, t0: float,
                                   ) -> tuple[SandboxInfo, BackendHandle, GuestClient, list[StageTiming]]:
        """A tier whose cold start is too slow (microvm under TCG) restores every sandbox from
        its shape's template memory snapshot; the first create of a shape boots and saves it
        (stage ``template``, on that one create's path)."""
        from warmbox.engine import snapshot as snapshots

        backend = self.backend(tier)
        # off the event loop: the first probe may boot a probe guest, the first template key
        # builds the tier's image (a minute, once per host)
        avail = await asyncio.to_thread(backend.probe)
        if not avail.available:
            raise BackendUnavailable(tier, avail.reason)
        shape = config.shape_key(tier, tmpl, limits)
        made = not self.registry.meta_text(await asyncio.to_thread(snapshots.template_key, self, tier, shape))
        m = await snapshots.template_snapshot(self, tier, tmpl, limits, shape)
        t1 = time.perf_counter()
        info, handle, client, timings = await snapshots._restore_memory(self, m, timeout=timeout)
        sid = info.sandbox_id
        try:
            if env_pairs:
                report = await asyncio.wait_for(client.call(
                    lambda i: p.Configure(i, env=dict(env_pairs), reset_counts=True), p.UsageReport), 30)
                if not isinstance(report, p.UsageReport):
                    raise SandboxStartError(f"restored sandbox refused its configuration: {report!r}", sid)
        except BaseException:
            await client.close()
            await self.destroy(sid, "configuration after restore failed")
            raise
        if made:
            tt = StageTiming(sid, "template", (t1 - t0) * 1e3, True)
            self.registry.add_timings([tt])
            timings = [tt, *timings]
        return info, handle, client, timings

    async def _claim(self, pc: PoolConfig, shape: str, timeout: float, env_pairs: tuple[tuple[str, str], ...],
                     t0: float) -> tuple[SandboxInfo, BackendHandle, GuestClient, list[StageTiming]] | None:
        while True:
            got = self.registry.claim(pc.name, shape, timeout, self.owner)
            if got is None:
                return None
            info, handle = got
            sid = info.sandbox_id
            client = None
            try:
                # connecting proves the agent lives (its listening socket dies with it); the
                # warm-up already reset its counters, so only a caller's env needs a round trip
                client = await GuestClient.connect(handle.socket_path, sid)
                if env_pairs:
                    report = await asyncio.wait_for(client.call(
                        lambda i: p.Configure(i, env=dict(env_pairs), reset_counts=True), p.UsageReport), 10)
                    if not isinstance(report, p.UsageReport):
                        raise GuestProtocolError(f"pooled sandbox refused its configuration: {report!r}", sid)
            except (WarmboxError, OSError, asyncio.TimeoutError) as e:
                # it died or misbehaves while pooled: never hand it out; take the next one
                if client is not None:
                    await client.close()
                self.registry.pool_event(pc.name, "claim_failed", sid, f"{type(e).__name__}: {e}"[:500])
                try:
                    await self.destroy(sid, "pooled sandbox failed its claim check")
                except WarmboxError:
                    pass
                continue
            except BaseException:
                if client is not None:
                    await client.close()
                await self.destroy(sid, "claim interrupted")
                raise
            alloc = StageTiming(sid, "allocation", (time.perf_counter() - t0) * 1e3, True)
            self.registry.add_timings([alloc])
            self.ensure_daemon()
            timings = [t for t in self.registry.timings(sid) if t.stage != "allocation"]
            return info, handle, client, [alloc, *timings]

    async def create_pooled(self, pc: PoolConfig) -> str:
        """Create and warm one sandbox for a pool (off any request path); returns its id."""
        settings = self.settings()
        tier, tmpl = backends.canonical_tier(pc.tier), settings.template(pc.template)
        shape = config.shape_key(tier, tmpl, pc.limits)
        if self.backend(tier).capabilities().memory_snapshot:
            # restore a checkpoint of the warmed template instead of booting and warming again
            from warmbox.engine import snapshot as snapshots

            m = await snapshots.template_snapshot(self, tier, tmpl, pc.limits, shape)
            info, _, client, _ = await snapshots._restore_memory(self, m, timeout=pc.max_age_s, pool=pc.name,
                                                                 shape=shape)
            try:
                # off any request path: under TCG a restored VM re-translates the code of its
                # first commands; running them now makes a claimed sandbox's first command fast
                for argv in getattr(self.backend(tier), "template_warmup", ()):
                    await snapshots._exec(client, list(argv), info.sandbox_id)
            except BaseException:
                await client.close()
                await self.destroy(info.sandbox_id, "pool warm-up after restore failed")
                raise
        else:
            info, _, client, _ = await self._start(tier, tmpl, pc.max_age_s, (), pc.limits, pc.name, shape,
                                                   time.perf_counter())
        await client.close()
        return info.sandbox_id

    async def _start(self, tier: str, tmpl: Template, timeout: float, env_pairs: tuple[tuple[str, str], ...],
                     limits: Limits, pool: str, shape: str, t0: float,
                     ) -> tuple[SandboxInfo, BackendHandle, GuestClient, list[StageTiming]]:
        backend = self.backend(tier)
        avail = backend.probe()
        if not avail.available:
            raise BackendUnavailable(tier, avail.reason)
        sandbox_id = "sb-" + secrets.token_hex(6)
        state_dir = self.runtime / "sandboxes" / sandbox_id
        socket_path = str(state_dir / "run" / "agent.sock")
        if len(socket_path) > _MAX_SOCKET_PATH:
            raise InvalidArgument(f"runtime dir {self.runtime} is too long for a unix socket path")
        self.registry.allocate(sandbox_id, tier, tmpl.name, timeout, limits.memory_mb, limits.cpus,
                               limits.pids, str(state_dir), socket_path, pool=pool, owner=self.owner,
                               shape=shape, file_size_mb=limits.file_size_mb, open_files=limits.open_files,
                               tmp_mb=limits.tmp_mb, disk_mb=limits.disk_mb)
        if not pool:
            self.ensure_daemon()  # from here on, a crash of this process is cleaned up by the daemon
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
            await _warm_up(client, tmpl, sandbox_id)
            t4 = time.perf_counter()
            if pool:  # the pool pays for the warm-up: take a reading before anyone can claim it
                u = await backend.usage(handle)
                if u.oom_kills:
                    raise SandboxStartError(f"template {tmpl.name} warm-up hit the memory limit "
                                            f"({limits.memory_mb} MiB): OOM kill", sandbox_id)
                self.registry.sample([(sandbox_id, u.memory_bytes, u.cpu_ns)])
        except BaseException as e:
            if client is not None:
                await client.close()
            await self._cleanup_failed(sandbox_id, handle, backend, e)
            if isinstance(e, (WarmboxError, asyncio.CancelledError, KeyboardInterrupt)):
                raise
            if isinstance(e, asyncio.TimeoutError):
                raise SandboxStartError("guest agent did not answer within 30 s", sandbox_id) from None
            raise SandboxStartError(f"sandbox start failed: {type(e).__name__}: {e}", sandbox_id) from None
        on_path = not pool
        timings = [StageTiming(sandbox_id, "allocation", (t1 - t0) * 1e3, on_path),
                   StageTiming(sandbox_id, "filesystem", (t2 - t1) * 1e3, on_path),
                   StageTiming(sandbox_id, "runtime", (t3 - t2) * 1e3, on_path)]
        if tmpl.warmup_code is not None or tmpl.warmup_commands:
            timings.append(StageTiming(sandbox_id, "dependencies", (t4 - t3) * 1e3, on_path))
        try:
            self.registry.add_timings(timings)
            # the lifetime starts now that it is usable, not when its start began
            self.registry.set_expiry(sandbox_id, time.time() + timeout)
            if pool:
                self.registry.set_state(sandbox_id, State.POOLED, "warmed up for pool " + pool,
                                        expected=State.CREATING)
            else:
                self.registry.set_state(sandbox_id, State.READY, "guest agent answered", expected=State.CREATING)
        except BaseException:
            await client.close()
            raise
        info, _ = self.registry.get(sandbox_id)
        return info, handle, client, timings

    async def _cleanup_failed(self, sandbox_id: str, handle: BackendHandle, backend: Backend, why: BaseException) -> None:
        # still ``creating`` (and ours) while we tear down, so no reaper destroys it concurrently
        try:
            await backend.destroy(handle)
        except Exception:
            # FAILED keeps its uid range, and the reaper retries the teardown
            self.registry.set_state(sandbox_id, State.FAILED, f"start failed: {type(why).__name__}; teardown failed")
            return
        self.registry.set_state(sandbox_id, State.DESTROYED, f"start failed: {type(why).__name__}; cleaned up")
        self.registry.finalize(sandbox_id)

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
        self.ensure_daemon()  # a live sandbox has a reaper (one flock probe when it runs)
        try:
            client = await GuestClient.connect(handle.socket_path, sandbox_id)
        except GuestConnectionError:
            if not await self.backend(info.tier).alive(handle):
                await self.destroy(sandbox_id, "found dead")
                raise SandboxNotFound(f"sandbox {sandbox_id} is no longer running", sandbox_id) from None
            raise
        return info, handle, client

    def holding(self) -> list[SandboxInfo]:
        """Live (also pooled) sandboxes plus failed ones whose teardown is still owed."""
        return [info for info, _ in self.registry.holding()]

    def list(self, include_dead: bool = False, *, include_pooled: bool = False) -> list[SandboxInfo]:
        return [info for info, _ in self.registry.list(include_dead, include_pooled=include_pooled)]

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
        self.ensure_daemon()  # someone must enforce the new deadline
        return expires

    # ---- network

    async def set_network(self, sandbox_id: str, network: object, client: GuestClient | None = None) -> Policy:
        """Replace a running sandbox's egress policy; new connections and lookups obey it at once.

        Legal while ready/running. A sandbox without a link gets one (and its proxy env) first.
        """
        policy = Policy.of(network)
        info, handle = self.info(sandbox_id)
        check(Operation.EXEC, info.state, sandbox_id)
        egress.check_tier(self, info.tier, policy)
        if self.registry.link(sandbox_id) is not None:
            self.registry.set_policy(sandbox_id, policy.to_json())
        elif policy.enabled:
            own = client is None
            if own:
                _, handle, client = await self.open(sandbox_id)
            try:
                await egress.attach(self, handle, client, policy, {})
            finally:
                if own:
                    await client.close()
        return policy

    def network_policy(self, sandbox_id: str) -> Policy:
        self.info(sandbox_id)
        return egress.current_policy(self, sandbox_id)

    def network_log(self, sandbox_id: str) -> list["NetEvent"]:
        """Every egress attempt of the sandbox (kept after it is destroyed), oldest first."""
        self.info(sandbox_id)
        return self.registry.net_events(sandbox_id)

    # ---- metering

    async def sample(self) -> None:
        """One memory/cpu reading of every live sandbox, folded into its meter (the daemon's job)."""
        readings = []
        for info, handle in self.registry.list(include_pooled=True):
            if info.state is State.CREATING:
                continue
            try:
                u = await self.backend(info.tier).usage(handle)
            except (WarmboxError, OSError):
                continue
            readings.append((info.sandbox_id, u.memory_bytes, u.cpu_ns))
        if readings:
            self.registry.sample(readings)

    async def metrics(self, sandbox_id: str, client: GuestClient | None = None) -> SandboxMetrics:
        """The user's cost of a sandbox so far (or final, once it ended)."""
        info, handle = self.info(sandbox_id)
        if info.state is not State.DESTROYED:
            check(Operation.METRICS, info.state, sandbox_id)
            await self._read_meters(info, handle, client)
        return self._metrics(info)

    async def _read_meters(self, info: SandboxInfo, handle: BackendHandle, client: GuestClient | None) -> None:
        try:
            u = await self.backend(info.tier).usage(handle)
            self.registry.sample([(info.sandbox_id, u.memory_bytes, u.cpu_ns)])
        except (WarmboxError, OSError):
            pass
        if info.state not in (State.READY, State.RUNNING):
            return
        own = client is None
        try:
            if own:
                client = await asyncio.wait_for(GuestClient.connect(handle.socket_path, info.sandbox_id), 1)
            r = await asyncio.wait_for(client.call(lambda i: p.GetUsage(i), p.UsageReport), 2)
            if isinstance(r, p.UsageReport) and math.isfinite(r.busy_ms) and r.busy_ms >= 0 and r.runs >= 0:
                self.registry.set_busy(info.sandbox_id, r.busy_ms, r.runs)
        except (WarmboxError, OSError, asyncio.TimeoutError):
            pass  # the last known counters stand
        finally:
            if own and client is not None:
                await client.close()

    def _metrics(self, info: SandboxInfo) -> SandboxMetrics:
        m = self.registry.meter(info.sandbox_id)
        start = info.claimed_at or info.created_at
        end = self.registry.ended_at(info.sandbox_id) or time.time()
        wall = max(0.0, end - start)
        if m is None:
            return SandboxMetrics(info.sandbox_id, 0.0, 0.0, wall, 0.0, wall, 0, 0, 0, info.state is State.DESTROYED)
        busy = min(wall, m.busy_ms / 1e3)
        return SandboxMetrics(
            sandbox_id=info.sandbox_id, cpu_s=max(0, m.cpu_ns - m.base_cpu_ns) / 1e9,
            memory_gib_s=max(0.0, m.gib_s - m.base_gib_s), wall_s=wall, busy_s=busy, idle_s=wall - busy,
            memory_bytes=m.memory_bytes, memory_peak_bytes=m.peak_bytes, commands=m.commands, final=m.final)

    # ---- destroy

    async def destroy(self, sandbox_id: str, reason: str = "killed") -> bool:
        """Destroy a sandbox; False if it was already gone. Leaves no process, mount, cgroup or dir."""
        info, handle = self.info(sandbox_id)
        if info.state is State.DESTROYED:
            return False
        check(Operation.DESTROY, info.state, sandbox_id)
        if info.state is not State.PAUSED:
            await self._read_meters(info, handle, None)  # last readings before the cgroup goes
        if info.state is not State.PAUSED or Path(handle.state_dir).exists():  # paused: leftovers only
            await self.backend(info.tier).destroy(handle)
        await egress.release(self, sandbox_id)
        self.registry.set_state(sandbox_id, State.DESTROYED, reason)
        self.registry.finalize(sandbox_id)
        return True

    async def reap(self) -> list[str]:
        """Destroy expired sandboxes, failed teardowns and creations whose creator died; first
        finish or undo snapshot operations whose process died (a pause after its checkpoint)."""
        from warmbox.engine import snapshot

        await snapshot.recover(self)
        now = time.time()
        reaped = await self._reap_template_vms()
        orphans = {sid for sid, owner in self.registry.creating_with_owner() if owner and not owner_alive(owner)}
        for info, _ in self.registry.list(include_pooled=True):
            if info.state in (State.CREATING, State.RETIRING) and info.sandbox_id not in orphans:
                # its creator lives and will finish or clean up; only a start stuck far beyond
                # any real one is taken away from it
                expired = now - info.created_at > CREATE_DEADLINE_S
            else:
                expired = info.state in LIVE and info.expires_at <= now
            if expired or info.state is State.FAILED or info.sandbox_id in orphans:
                why = (("retirer process died" if info.state is State.RETIRING else "creator process died")
                       if info.sandbox_id in orphans else
                       "pool max_age reached" if info.state is State.POOLED else "timeout expired")
                try:
                    if await self.destroy(info.sandbox_id, why):
                        reaped.append(info.sandbox_id)
                except Exception:  # one bad sandbox must not stop the reaper; retried next round
                    continue
        for sid, owner in self.registry.paused_with_owner():  # a pause killed while releasing
            if owner and not owner_alive(owner):
                info, handle = self.registry.get(sid)
                if Path(handle.state_dir).exists():
                    try:
                        await self.backend(info.tier).destroy(handle)
                        reaped.append(sid)
                    except Exception:
                        continue
        for info, _ in self.registry.holding():
            if info.state is State.FAILED and info.sandbox_id not in reaped:
                try:
                    if await self.destroy(info.sandbox_id, "teardown retried"):
                        reaped.append(info.sandbox_id)
                except Exception:
                    continue
        return reaped

    # ---- template VMs in the making (snapshot.template_snapshot)
    #
    # A shape's template sandbox is no caller's: from the end of its start until it is paused
    # into the template snapshot it is READY with a 1 h timeout, so neither the creating-orphan
    # rule nor its timeout would end it soon if its creator died. Its creator marks it (meta
    # ``template-vms``: {sandbox id: {"owner": creator's tag, "key": template key}}) and the
    # reaper ends a marked sandbox whose creator is gone, adopting its snapshot as the shape's
    # template if the pause got that far.

    def _template_marks(self, change=None) -> dict[str, dict]:
        import fcntl
        import json

        fd = os.open(self.home / "template-vms.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for one read-modify-write of one row
            try:
                marks = json.loads(self.registry.meta_text(TEMPLATE_VMS_KEY) or "{}")
            except ValueError:
                marks = {}
            if not isinstance(marks, dict):
                marks = {}
            if change is not None:
                change(marks)
                self.registry.set_meta_text(TEMPLATE_VMS_KEY, json.dumps(marks))
            return marks
        finally:
            os.close(fd)

    def mark_template_vm(self, sandbox_id: str, key: str) -> None:
        """This process makes ``sandbox_id`` into the template ``key``: if it dies first, the
        reaper destroys the sandbox."""
        self._template_marks(lambda m: m.__setitem__(sandbox_id, {"owner": self.owner, "key": key}))

    def unmark_template_vm(self, sandbox_id: str) -> None:
        self._template_marks(lambda m: m.pop(sandbox_id, None))

    async def _reap_template_vms(self) -> list[str]:
        if not self.registry.meta_text(TEMPLATE_VMS_KEY).strip("{} "):
            return []  # nothing marked: no lock taken (the daemon looks every tick)
        reaped = []
        for sid, mark in self._template_marks().items():
            owner = mark.get("owner") if isinstance(mark, dict) else None
            if isinstance(owner, str) and owner and owner_alive(owner):
                continue  # its creator is still at it
            try:
                info, handle = self.registry.get(sid)
            except SandboxNotFound:
                self.unmark_template_vm(sid)
                continue
            if (info.state in (State.READY, State.RUNNING) and self._pause_pending(sid)
                    and not await self.backend(info.tier).alive(handle)):
                continue  # its memory is saved (nothing runs): recovery finishes the pause, then below
            why = "template creator died"
            if info.state is State.PAUSED:  # paused (by its creator, or by recovery) but not recorded
                key = mark.get("key")
                taken = self.registry.snapshots_of(sid)
                if taken and isinstance(key, str) and key.startswith("template:"):
                    if not self.registry.meta_text(key):
                        self.registry.set_meta_text(key, taken[-1])
                    if self.registry.meta_text(key) == taken[-1]:
                        why = f"became template snapshot {taken[-1]} (recorded after its creator died)"
            try:
                if await self.destroy(sid, why):
                    reaped.append(sid)
            except Exception:  # retried next round
                continue
            self.unmark_template_vm(sid)
        return reaped

    def _pause_pending(self, sandbox_id: str) -> bool:
        """A pause of ``sandbox_id`` left its operation directory (snapshot.recover finishes it)."""
        import json

        from warmbox.engine import snapshot

        for op in (self.home / "tmp").glob(snapshot.OP_PREFIX + "pause-*"):
            try:
                rec = json.loads((op / "op.json").read_text())
            except (OSError, ValueError):
                continue
            if isinstance(rec, dict) and rec.get("sandbox_id") == sandbox_id:
                return True
        return False

    def next_expiry(self) -> float | None:
        live = [i.expires_at for i in self.holding()]
        return min(live) if live else None

    def ensure_daemon(self) -> None:
        """Start this home's daemon (reaper, pools, meters) unless one runs (it holds an flock).

        Started through its guard, which restarts it whenever it dies without meaning to (and
        which it restarts in turn): see engine/daemon.py for what that guarantees."""
        from warmbox.engine import daemon

        daemon.ensure(self.home)
