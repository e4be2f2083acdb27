"""The engine: the host context every part of the lifecycle works in (home, settings, backends,
registry, command log, this node), and the lookups and checks they share.

One Engine per WARMBOX_HOME per process; all durable state is in the registry so sandboxes
outlive the process that created them, and any process may reap expired ones. What happens to a
sandbox lives beside it: resolve (templates, images), meters, teardown, duties (timeouts, idle
pauses, the reaper), egress, provision and snapshot.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import re
import time
from pathlib import Path
from typing import ClassVar

from warmbox import backends, config
from warmbox.backends.base import (
    Backend,
    Configurable,
    Diagnosable,
    HostUids,
    SharedHost,
    TemplateCapable,
)
from warmbox.config import PoolConfig, Settings, Template
from warmbox.engine import egress, guard, provision, resolve, teardown
from warmbox.engine import volumes as volumes_mod
from warmbox.engine.commandlog import CommandLog
from warmbox.engine.idempotency import Keys
from warmbox.engine.provision import Launched
from warmbox.errors import (
    BackendUnavailable,
    ConfigError,
    InvalidArgument,
    SandboxNotFound,
    SandboxPaused,
    SandboxStateError,
    WarmboxError,
)
from warmbox.lifecycle import Operation, check
from warmbox.models import (
    BackendHandle,
    ImageRef,
    Limits,
    ResourceUsage,
    SandboxInfo,
    SandboxQuery,
    StageTiming,
    State,
    Tenant,
    TierStatus,
    VolumeMount,
    validate_envs,
    validate_timeout,
)
from warmbox.paths import default_home, host_roots, owner_tag, redact, runtime_dir
from warmbox.storage import uidslots
from warmbox.storage.registry import Registry, open_registry

log = logging.getLogger("warmbox.config")


class LedgerSlots:
    """The host-wide uid ledger for a tier's own host processes (``backends.base.UidSlots``),
    recorded under this home's registry."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def claim(self, holder: str) -> int:
        return uidslots.uid_base(self.registry.claim_host_slot(holder))

    def release(self, holder: str, uid_base: int) -> None:
        slot = uidslots.slot_of_uid(uid_base)
        if slot is not None:
            self.registry.release_host_slot(holder, slot)

    def forget_gone(self, holder: str) -> bool:
        with self.registry.ledger.locked() as ledger:
            return ledger.forget_gone(holder)


def _cluster(home: Path) -> config.ClusterSettings:
    """This home's ``[cluster]`` (none: one host, also when the config cannot be read: the
    operations that need it load the config again and report what is wrong)."""
    try:
        return config.load(home).cluster
    except WarmboxError:
        return config.ClusterSettings()


class Engine:
    _instances: ClassVar[dict[Path, Engine]] = {}

    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.runtime = runtime_dir(home)  # made when a backend first needs it
        self._roots = host_roots(home)  # what redact() hides
        # every allocation (create, pool refill, restore of a snapshot) checks its limits first;
        # the rows it creates are this node's ([cluster] node, "" on one host); [cluster]
        # registry: the cluster's shared PostgreSQL registry instead of the home's file
        self.registry = open_registry(home, _cluster(home), check_limits=self.check_limits)
        self.node = self.registry.node
        self.command_log = CommandLog(self.registry)  # the fronts' command records, written in batches
        # keyed creates, commands and code runs (engine/idempotency.py): the ttl as last read
        self.keys = Keys(self.registry, lambda: (self._good or self.settings()).idempotency_ttl_s)
        self._backends: dict[str, Backend] = {}
        self.owner = owner_tag(os.getpid(), self.node)  # node/pid:start on a cluster node
        self._good: Settings | None = None  # the last settings read without error
        self._config_error = ""  # why the current warmbox.toml is not in use ("": it is)

    @classmethod
    def for_home(cls, home: Path | str | None = None) -> Engine:
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
            if isinstance(b, Configurable):
                b.configure(self.settings())
            if isinstance(b, HostUids):
                b.use_home(self.home, LedgerSlots(self.registry))
        return b

    def stop_shared_hosts(self) -> None:
        """Stop the host process of each tier that has one (``SharedHost``) and no live or pooled
        sandbox left."""
        live = {i.tier for i, _ in self.registry.list(include_pooled=True, local=True)}
        for tier in backends.TIERS:
            if tier in live:
                continue
            try:
                b = self.backend(tier)
            except WarmboxError:
                continue
            if isinstance(b, SharedHost):
                b.stop_host()

    def doctor(self) -> builtins.list[TierStatus]:
        """Each tier: whether this host runs it and why (not); an available one also says
        whether the built-in image every tier runs is built."""
        from warmbox.engine import images

        rec = images.builtin_record()
        image = (
            f"built-in image {rec.key} built ({rec.image_id[:19]}, {len(rec.layers)} layers)"
            if rec is not None
            else "built-in image not built yet: scripts/bootstrap install builds it (else the first sandbox "
            "waits minutes for it)"
        )
        out = []
        for tier in backends.TIERS:
            try:
                b = self.backend(tier)
                avail = b.diagnose() if isinstance(b, Diagnosable) else b.probe()
                reason = f"{avail.reason}; {image}" if avail.available else avail.reason
                out.append(TierStatus(tier, avail.available, reason))
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
        return self.redact(data.decode("utf-8", "replace"))  # the runtimes name host paths: never shown

    def redact(self, text: str) -> str:
        """``text`` (a runtime log, an error's message) as a caller may read it: the host
        directories of this engine (its home, runtime dir, the image cache) replaced by words."""
        return redact(text, self._roots)

    def redact_error(self, e: WarmboxError) -> WarmboxError:
        """``e`` with its message and string attributes redacted (in place: its class, traceback
        and attributes stay); the same object."""
        if e.args and isinstance(e.args[0], str):
            e.args = (self.redact(e.args[0]), *e.args[1:])
        for name, v in vars(e).items():
            if isinstance(v, str):
                setattr(e, name, self.redact(v))
            elif isinstance(v, tuple) and all(isinstance(x, str) for x in v):
                setattr(e, name, tuple(self.redact(x) for x in v))
        return e

    def settings(self) -> Settings:
        """warmbox.toml's settings, read again when it changes. A file broken after a good one
        was read keeps the good one in use (a running server or daemon goes on serving) and is
        reported: logged once, and :meth:`config_error`; ConfigError if none was ever good."""
        try:
            s = config.load(self.home)
        except ConfigError as e:
            if self._good is None:
                raise
            if str(e) != self._config_error:
                log.warning("%s: keeping the last good settings", e)
                self._config_error = str(e)
            return self._good
        self._good, self._config_error = s, ""
        return s

    def config_error(self) -> str:
        """Why warmbox.toml (or a WARMBOX_* override) is not in use, "" when it is: the settings in
        use are then the last good ones (ConfigError if there were none)."""
        self.settings()
        return self._config_error

    def check_limits(self, limits: Limits) -> None:
        """LimitTooHigh if ``limits`` ask for more than this host has or ``[limits]`` allows, or
        for a disk larger than what is free where the sandboxes live (every allocation)."""
        self.settings().limits.check(limits)
        config.check_disk_free(limits, self.runtime)

    # ---- create

    async def create(
        self,
        *,
        tier: str | None = None,
        timeout: float | None = None,
        envs: dict[str, str] | None = None,
        limits: Limits | None = None,
        template: str | None = None,
        pool: bool = True,
        network: object = None,
        secrets: dict | None = None,
        tenant: Tenant | None = None,
        resume_of: str = "",
        volumes: object = None,
        mounts: tuple[VolumeMount, ...] = (),
        image: ImageRef | None = None,
        egress_link: bool = False,
    ) -> Launched:
        """A ready sandbox with a connected session and its stage timings.

        Taken from a pool of the same (tier, template, limits) when one has a ready sandbox
        (``pool=False``: never), otherwise created cold, with the template's warm-up run.
        A network policy other than "none" links it to the egress proxy (stage ``network``).
        tenant: whose it is (None: the host's); QuotaExceeded before anything is claimed or made.
        resume_of: start this paused sandbox again under its id (never from a pool), with the
        volumes it mounted.
        volumes: warmbox.Volume mounts (the tenant's volumes; never from a pool). mounts: volumes
        resolved already (a fork of a snapshot mounts its origin's).
        image: run this image (a snapshot's recorded one) instead of the template's latest.
        egress_link: the caller links it after the start (a fork's recorded policy): on a tier
        whose interfaces are fixed at start, its link is prepared before (never from a pool).
        """
        t0 = time.perf_counter()
        settings = self.settings()
        tier = backends.canonical_tier(settings.defaults.tier if tier is None else tier)
        if template is not None and image is None and not self.backend(tier).capabilities().images:
            raise InvalidArgument(
                f"tier {tier!r} runs no image, so it takes no template (asked: {template!r}); "
                "leave template unset, or choose a tier with images (warmbox doctor)"
            )
        policy = egress.policy_of(settings.network, network)
        secret_map = egress.validate_secrets(secrets)
        if secret_map and not policy.enabled:
            raise InvalidArgument("secrets are only usable with a network policy that allows their hosts")
        egress.check_tier(self, tier, policy)
        if resume_of:
            mounts = volumes_mod.of_sandbox(self, resume_of)
        elif not mounts:
            mounts = volumes_mod.resolve(self, "" if tenant is None else tenant.name, volumes)
        # a tier whose interfaces are fixed at start gets its link before it starts: never a pooled one
        linked_at_start = (policy.enabled or egress_link) and self.backend(tier).capabilities().link_before_start
        got = await self._create(
            tier,
            timeout,
            envs,
            limits,
            template,
            pool and not resume_of and not mounts and not linked_at_start,
            t0,
            settings,
            tenant,
            resume_of,
            mounts,
            image,
            network=policy.enabled or egress_link,
        )
        if policy.enabled:
            try:
                prepared = sum(t.duration_ms for t in got.timings if t.stage == "network")  # before start
                timing = await egress.attach(self, got.handle, got.session, policy, secret_map, prepared_ms=prepared)
                got.timings = [t for t in got.timings if t.stage != "network"] + [timing]
            except BaseException:
                await got.session.close()
                await self.destroy(got.sandbox_id, "network setup failed")
                raise
        return got

    async def _create(
        self,
        tier: str,
        timeout: float | None,
        envs: dict[str, str] | None,
        limits: Limits | None,
        template: str | None,
        pool: bool,
        t0: float,
        settings: Settings,
        tenant: Tenant | None = None,
        resume_of: str = "",
        mounts: tuple[VolumeMount, ...] = (),
        image: ImageRef | None = None,
        *,
        network: bool = False,
    ) -> Launched:
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
        tmpl = self.template(template, tenant)
        if tenant is not None:  # early, before any work; the claim or insert checks again, atomically
            self.registry.check_quota(tenant, tier, limits)
        pc = settings.pool_for(tier, template, limits) if pool else None
        images = self.backend(tier).capabilities().images
        if pc is not None and image is None:
            # a claim hands out a running sandbox, its layers mounted: the image id its shape needs is
            # read from the template's record, without looking each layer up in the store (a flock
            # and a utime per layer, 0.1 ms each, on the warm path); a tier without images: none
            image_id = self.image_id_for(template, tenant) if images else ""
            if image_id is not None:
                shape = config.shape_key(tier, tmpl, limits, image_id)
                got = await provision.claim(self, pc, shape, timeout, env_pairs, t0, tenant)
                if got is not None:
                    return got
                pc = None  # a miss: the cold start below
        if image is None and images:  # off the event loop: the first sandbox on a fresh host builds the built-in image
            image = await asyncio.to_thread(self.image_for, template, tenant)
        if pc is not None:
            shape = config.shape_key(tier, tmpl, limits, image.image_id if image is not None else "")
            got = await provision.claim(self, pc, shape, timeout, env_pairs, t0, tenant)
            if got is not None:
                return got
        if self.backend(tier).capabilities().snapshot_start:
            return await self._start_from_template(
                tier, tmpl, timeout, env_pairs, limits, t0, tenant, resume_of, mounts, image, network=network
            )
        return await provision.launch(
            self,
            provision.LaunchSpec(
                tier,
                tmpl.name,
                timeout,
                limits,
                env_pairs,
                tenant=tenant,
                resume_of=resume_of,
                volumes=mounts,
                image=image,
                network=network,
            ),
            provision.Cold(tmpl),
        )

    async def _start_from_template(
        self,
        tier: str,
        tmpl: Template,
        timeout: float,
        env_pairs: tuple[tuple[str, str], ...],
        limits: Limits,
        t0: float,
        tenant: Tenant | None = None,
        resume_of: str = "",
        mounts: tuple[VolumeMount, ...] = (),
        image: ImageRef | None = None,
        *,
        network: bool = False,
    ) -> Launched:
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
        if image is None:
            image = await asyncio.to_thread(self.image_for, tmpl.name, tenant)
        shape = config.shape_key(tier, tmpl, limits, image.image_id)
        made = not self.registry.meta_text(await asyncio.to_thread(snapshots.template_key, self, tier, shape, image))
        m = await snapshots.template_snapshot(self, tier, tmpl, limits, shape, image)
        t1 = time.perf_counter()
        got = await snapshots.restore_memory(
            self, m, timeout=timeout, tenant=tenant, resume_of=resume_of, volumes=mounts, network=network
        )
        try:
            if env_pairs:
                await asyncio.wait_for(got.session.configure(dict(env_pairs), reset_counts=True), 30)
        except BaseException:
            await got.session.close()
            await self.destroy(got.sandbox_id, "configuration after restore failed")
            raise
        if made and not resume_of:
            tt = StageTiming(got.sandbox_id, "template", (t1 - t0) * 1e3, True)
            self.registry.add_timings([tt])
            got.timings.insert(0, tt)
        return got

    async def create_pooled(self, pc: PoolConfig) -> str:
        """Create and warm one sandbox for a pool (off any request path); returns its id."""
        tier, tmpl = backends.canonical_tier(pc.tier), self.template(pc.template)
        backend = self.backend(tier)
        image = await asyncio.to_thread(self.image_for, pc.template) if backend.capabilities().images else None
        shape = config.shape_key(tier, tmpl, pc.limits, image.image_id if image is not None else "")
        if backend.capabilities().memory_snapshot:
            # restore a checkpoint of the warmed template instead of booting and warming again
            from warmbox.engine import snapshot as snapshots

            m = await snapshots.template_snapshot(self, tier, tmpl, pc.limits, shape, image)
            got = await snapshots.restore_memory(self, m, timeout=pc.max_age_s, pool=pc.name, shape=shape)
            try:
                # off any request path: under TCG a restored VM re-translates the code of its
                # first commands; running them now makes a claimed sandbox's first command fast
                if isinstance(backend, TemplateCapable):
                    for argv in backend.template_warmup:
                        await got.session.exec(list(argv), timeout_s=600.0)
            except BaseException:
                await got.session.close()
                await self.destroy(got.sandbox_id, "pool warm-up after restore failed")
                raise
        else:
            got = await provision.launch(
                self,
                provision.LaunchSpec(tier, tmpl.name, pc.max_age_s, pc.limits, (), pc.name, shape, image=image),
                provision.Cold(tmpl),
            )
        await got.session.close()
        return got.sandbox_id

    async def cleanup_failed(
        self, sandbox_id: str, handle: BackendHandle, backend: Backend, why: BaseException, *, resumed: bool = False
    ) -> None:
        """Tear down a start that failed (provision.launch): the row stays ``creating`` (ours)
        meanwhile, so no reaper destroys it concurrently. A failed resume leaves the sandbox
        paused (its snapshot is untouched), to be resumed again."""
        try:
            await backend.destroy(handle)
        except Exception:
            # FAILED keeps its uid range, and the reaper retries the teardown
            self.registry.set_state(sandbox_id, State.FAILED, f"start failed: {type(why).__name__}; teardown failed")
            return
        if resumed:
            self.registry.set_state(sandbox_id, State.PAUSED, f"resume failed: {type(why).__name__}; still paused")
        else:
            self.registry.set_state(sandbox_id, State.DESTROYED, f"start failed: {type(why).__name__}; cleaned up")
        self.registry.finalize(sandbox_id)

    # ---- lookup

    def info(self, sandbox_id: str) -> tuple[SandboxInfo, BackendHandle]:
        if not isinstance(sandbox_id, str) or not re.fullmatch(r"sb-[0-9a-f]{12}", sandbox_id):
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} (ids look like sb-0123456789ab)", str(sandbox_id))
        return self.registry.get(sandbox_id)

    def check(self, op: Operation, info: SandboxInfo, handle: BackendHandle | None = None) -> None:
        """A typed error if ``op`` is illegal in the sandbox's state (a destroyed one that ran
        out of time: SandboxNotFound saying it expired; a lost one: SandboxLost naming its node).
        handle: given, a live sandbox of another node is refused (SandboxStateError): its
        processes and directories are that node's, never judged or touched from here."""
        lost = info.state in (State.DESTROYED, State.LOST)
        ended = self.registry.ended_reason(info.sandbox_id) if lost else ""
        node = self.registry.node_of(info.sandbox_id) if info.state is State.LOST else ""
        check(op, info.state, info.sandbox_id, ended, node)
        if handle is not None and handle.node != self.node and info.state is not State.PAUSED:
            raise SandboxStateError(
                f"sandbox {info.sandbox_id} runs on node {handle.node or '(none)'!r}, not on this one "
                f"({self.node or '(none)'!r})",
                info.sandbox_id,
            )

    def paused_error(self, sandbox_id: str) -> SandboxPaused:
        """The error for an operation on a paused sandbox that does not resume by itself."""
        why = self.registry.ended_reason(sandbox_id)
        return SandboxPaused(
            f"sandbox {sandbox_id} is paused ({why or 'paused'}); Sandbox.connect(id) or resume(id) runs it "
            "again (or create it with lifecycle=Lifecycle(auto_resume=True))",
            sandbox_id,
        )

    def holding(self) -> builtins.list[SandboxInfo]:
        """Live (also pooled) sandboxes plus failed ones whose teardown is still owed."""
        return [info for info, _ in self.registry.holding()]

    def list(
        self,
        include_dead: bool = False,
        *,
        include_pooled: bool = False,
        tenant: str | None = None,
        query: SandboxQuery | None = None,
    ) -> builtins.list[SandboxInfo]:
        """tenant: only that tenant's sandboxes (None: everyone's); query: see SandboxQuery."""
        q = query or SandboxQuery()
        rows = self.registry.list(
            include_dead, include_pooled=include_pooled, tenant=tenant, states=q.state, metadata=q.metadata
        )
        return [info for info, _ in rows]

    def timings(self, sandbox_id: str) -> dict[str, float]:
        return {t.stage: t.duration_ms for t in self.registry.timings(sandbox_id)}

    async def usage(self, handle: BackendHandle) -> ResourceUsage:
        return await self.backend(handle.tier).usage(handle)

    def set_timeout(self, sandbox_id: str, timeout: float) -> float:
        timeout = validate_timeout(timeout)
        info, _ = self.info(sandbox_id)
        self.check(Operation.SET_TIMEOUT, info)
        expires = time.time() + timeout
        self.registry.set_expiry(sandbox_id, expires, timeout)  # its lifetime now: a resume renews this one
        self.ensure_daemon()  # someone must enforce the new deadline
        return expires

    def ensure_daemon(self) -> None:
        """Start this home's daemon (reaper, pools, meters) unless one runs (it holds an flock).

        Started through its guard, which restarts it whenever it dies without meaning to (and
        which it restarts in turn): see engine/guard.py for what that guarantees."""
        guard.ensure(self.home)

    # ---- create path bridge (issue 35): the create path above (create, _create,
    # _start_from_template, create_pooled) still calls these four as methods; it moves to
    # provision.py, where /work/brief/rewrite_hostctx.py turns its calls into teardown.destroy and
    # resolve.X. Then this block goes (the script removes it when nothing in this file calls them).

    async def destroy(self, sandbox_id: str, reason: str = "killed") -> bool:
        return await teardown.destroy(self, sandbox_id, reason)

    def template(self, name: str, tenant: Tenant | None = None) -> Template:
        return resolve.template(self, name, tenant)

    def image_for(self, template: str, tenant: Tenant | None = None, *, build: bool = True) -> ImageRef:
        return resolve.image_for(self, template, tenant, build=build)

    def image_id_for(self, template: str, tenant: Tenant | None = None) -> str | None:
        return resolve.image_id_for(self, template, tenant)

    # ---- end of the create path bridge
