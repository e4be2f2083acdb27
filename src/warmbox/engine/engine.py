"""The engine: creates, tracks and destroys sandboxes on any backend, recording every stage.

One Engine per WARMBOX_HOME per process; all durable state is in the registry so sandboxes
outlive the process that created them, and any process may reap expired ones.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import math
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
    Inventory,
    SharedHost,
    TemplateCapable,
)
from warmbox.config import PoolConfig, Settings, Template
from warmbox.engine import egress, provision
from warmbox.engine import snapshot as snapshots
from warmbox.engine import volumes as volumes_mod
from warmbox.engine.commandlog import CommandLog
from warmbox.engine.idempotency import Keys
from warmbox.engine.provision import Launched
from warmbox.engine.session import GuestSession
from warmbox.errors import (
    BackendUnavailable,
    ConfigError,
    GuestConnectionError,
    InvalidArgument,
    SandboxNotFound,
    SandboxPaused,
    SandboxStateError,
    SnapshotUnsupported,
    WarmboxError,
)
from warmbox.lifecycle import EXPIRED, LIVE, RESUMING, RETENTION_EXPIRED, Operation, check, gone
from warmbox.models import (
    BackendHandle,
    ImageRef,
    Limits,
    NetEvent,
    ResourceUsage,
    SandboxInfo,
    SandboxMetrics,
    SandboxQuery,
    StageTiming,
    State,
    Tenant,
    TierStatus,
    VolumeMount,
)
from warmbox.network.policy import Policy
from warmbox.paths import default_home, host_roots, owner_alive, owner_tag, redact, runtime_dir
from warmbox.storage import uidslots
from warmbox.storage.registry import Registry, open_registry

log = logging.getLogger("warmbox.config")

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 24 * 3600.0
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SANDBOX_ID = re.compile(r"sb-[0-9a-f]{12}")


class LedgerSlots:
    """The host-wide uid ledger for a tier's own host processes (``backends.base.UidSlots``),
    recorded under this home's registry."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def claim(self, holder: str) -> int:
        return uidslots.uid_base(self.registry.sandboxes.claim_host_slot(holder))

    def release(self, holder: str, uid_base: int) -> None:
        slot = uidslots.slot_of_uid(uid_base)
        if slot is not None:
            self.registry.sandboxes.release_host_slot(holder, slot)

    def forget_gone(self, holder: str) -> bool:
        with self.registry.ledger.locked() as ledger:
            return ledger.forget_gone(holder)


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


CREATE_DEADLINE_S = provision.WARMUP_TIMEOUT_S + 300.0


def _cluster(home: Path) -> config.ClusterSettings:
    """This home's ``[cluster]`` (none: one host, also when the config cannot be read: the
    operations that need it load the config again and report what is wrong)."""
    try:
        return config.load(home).cluster
    except WarmboxError:
        return config.ClusterSettings()


TEMPLATE_VMS_KEY = "template-vms"  # see Engine.mark_template_vm


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
        live = {i.tier for i, _ in self.registry.sandboxes.list(include_pooled=True, local=True)}
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

    # ---- templates and images

    def template(self, name: str, tenant: Tenant | None = None) -> Template:
        """The template ``name`` as a warm-up: one of warmbox.toml's (built-in ones included) or a
        built template's (its recorded warm-up). InvalidArgument naming the known ones if neither."""
        settings = self.settings()
        if name in settings.templates:
            return settings.template(name)
        info = self._built_template(name, None, tenant)
        if info is None:
            from warmbox.errors import TemplateNotFound
            from warmbox.templates.builtins import builtin

            b = builtin(name)
            if b is not None and b.spec is not None:  # a built-in built on top of base (browser)
                raise TemplateNotFound(
                    f"the built-in template {name!r} is not built in this home yet: warmbox template build "
                    f"{name} (its layers stay in the host's cache: seconds after scripts/bootstrap install)",
                    template=name,
                )
            return settings.template(name)  # InvalidArgument: unknown template
        return Template(
            name=info.name,
            warmup_code=info.warmup_code,
            warmup_commands=info.warmup_commands,
            description=info.description,
        )

    def _built_template(self, name: str, version: int | None, tenant: Tenant | None):
        """The registry's record of a built template (latest, or ``version``), the tenant's own
        first, then the host's; None if there is none."""
        from warmbox.errors import TemplateNotFound

        for owner in dict.fromkeys([tenant.name if tenant is not None else "", ""]):
            try:
                return self.registry.templates.template_get(name, version, tenant=owner)
            except TemplateNotFound:
                continue
        return None

    def image_for(self, template: str, tenant: Tenant | None = None, *, build: bool = True) -> ImageRef:
        """The image a new sandbox of ``template`` runs: a built template's latest version, else (a
        built-in template, or a warm-up-only one of warmbox.toml) the built-in image, built first
        if this host has none yet (minutes, once: scripts/bootstrap install does it ahead; ``build``
        False: TemplateNotFound instead)."""
        from warmbox.engine import images
        from warmbox.errors import TemplateNotFound
        from warmbox.templates.builtins import builtin

        info = self._built_template(template, None, tenant)
        if info is not None:
            return images.image_ref(info, self.settings().cluster.object_store)
        spec = builtin(template)
        if (spec is not None and spec.spec is not None) or (
            template in self.settings().templates and self.settings().template(template).build is not None
        ):  # a template with a build of its own runs only once built, never the built-in image instead
            raise TemplateNotFound(
                f"template {template!r} is not built yet: warmbox template build {template}", template=template
            )
        self.template(template, tenant)  # InvalidArgument for an unknown name
        return images.builtin_image(template, build=build)

    def image_id_for(self, template: str, tenant: Tenant | None = None) -> str | None:
        """The id of the image a new sandbox of ``template`` runs (what image_for's ImageRef would
        carry), from its record alone: no layer is looked up. None while the built-in image is not
        built (image_for builds it)."""
        from warmbox.engine import images

        info = self._built_template(template, None, tenant)
        if info is not None:
            return info.image_id
        return images.builtin_image_id()

    def recorded_image(self, template: str, version: int, image_id: str, tenant: Tenant | None = None) -> ImageRef:
        """The image a snapshot recorded (restore, resume, fork): that very image, never the
        template's latest. TemplateMismatch when it is gone (its template version removed, or its
        layers collected); CorruptLayer when a layer fails its digest. A snapshot from before
        images were recorded (``image_id`` "") gets the template's current image."""
        from warmbox import images as builtin
        from warmbox.engine import images
        from warmbox.errors import TemplateMismatch

        if not image_id:
            return self.image_for(template, tenant)
        if version == builtin.BUILTIN_VERSION:
            current = images.builtin_image(template)
            return current if current.image_id == image_id else images.builtin_by_id(template, image_id)
        info = self._built_template(template, version, tenant)
        if info is None or info.image_id != image_id:
            raise TemplateMismatch(
                f"this snapshot ran template {template!r} version {version} (image {image_id}), which "
                + ("no longer exists" if info is None else f"now names another image ({info.image_id})"),
                template=template,
            )
        return images.image_ref(info, self.settings().cluster.object_store)

    def layers_in_use(self) -> set[str]:
        """Layer digests a layer gc must keep for this home: every template version's (of any
        tenant) and every built-in image build's recorded on this host (snapshots of an older
        built-in image restore on it). Other homes share the store: a host-wide gc unions theirs."""
        from warmbox.engine import images

        return self.registry.templates.template_layers() | {d for r in images.builtin_records() for d in r.layers}

    def pool_shape(self, pc: PoolConfig, *, build: bool = True) -> str:
        """The shape key of pool ``pc``'s sandboxes: tier, template, limits and the image its
        template has now (a rebuilt template: a new shape, the old sandboxes retire)."""
        tier = backends.canonical_tier(pc.tier)
        # a tier without images (Capabilities.images): its shape names none, as create_pooled makes it
        image_id = self.image_for(pc.template, build=build).image_id if self.backend(tier).capabilities().images else ""
        return config.shape_key(tier, self.template(pc.template), pc.limits, image_id)

    def template_users(self, name: str, version: int | None = None, tenant: Tenant | None = None) -> builtins.list[str]:
        """What uses template ``name`` (``version``, or any): ids of its sandboxes that are not
        destroyed (paused ones too), names of pools keeping its sandboxes or configured with it
        (when ``version`` is its latest or None), and ids of snapshots taken of its sandboxes.
        A template with users cannot be removed (TemplateInUse)."""
        owner = tenant.name if tenant is not None else ""
        sandboxes, pools, snaps = self.registry.templates.template_users(name, version, owner)
        latest = self._built_template(name, None, tenant)
        if not owner and (version is None or (latest is not None and latest.version == version)):
            pools = sorted({*pools, *(p.name for p in self.settings().pools.values() if p.template == name)})
        return [*sandboxes, *pools, *snaps]

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
            self.registry.tenants.check_quota(tenant, tier, limits)
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
        made = not self.registry.meta.meta_text(
            await asyncio.to_thread(snapshots.template_key, self, tier, shape, image)
        )
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
            self.registry.sandboxes.add_timings([tt])
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
            self.registry.sandboxes.set_state(
                sandbox_id, State.FAILED, f"start failed: {type(why).__name__}; teardown failed"
            )
            return
        if resumed:
            self.registry.sandboxes.set_state(
                sandbox_id, State.PAUSED, f"resume failed: {type(why).__name__}; still paused"
            )
        else:
            self.registry.sandboxes.set_state(
                sandbox_id, State.DESTROYED, f"start failed: {type(why).__name__}; cleaned up"
            )
        self.registry.usage.finalize(sandbox_id)

    # ---- lookup

    def info(self, sandbox_id: str) -> tuple[SandboxInfo, BackendHandle]:
        if not isinstance(sandbox_id, str) or not re.fullmatch(r"sb-[0-9a-f]{12}", sandbox_id):
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} (ids look like sb-0123456789ab)", str(sandbox_id))
        return self.registry.sandboxes.get(sandbox_id)

    def check(self, op: Operation, info: SandboxInfo, handle: BackendHandle | None = None) -> None:
        """A typed error if ``op`` is illegal in the sandbox's state (a destroyed one that ran
        out of time: SandboxNotFound saying it expired; a lost one: SandboxLost naming its node).
        handle: given, a live sandbox of another node is refused (SandboxStateError): its
        processes and directories are that node's, never judged or touched from here."""
        lost = info.state in (State.DESTROYED, State.LOST)
        ended = self.registry.sandboxes.ended_reason(info.sandbox_id) if lost else ""
        node = self.registry.nodes.node_of(info.sandbox_id) if info.state is State.LOST else ""
        check(op, info.state, info.sandbox_id, ended, node)
        if handle is not None and handle.node != self.node and info.state is not State.PAUSED:
            raise SandboxStateError(
                f"sandbox {info.sandbox_id} runs on node {handle.node or '(none)'!r}, not on this one "
                f"({self.node or '(none)'!r})",
                info.sandbox_id,
            )

    def paused_error(self, sandbox_id: str) -> SandboxPaused:
        """The error for an operation on a paused sandbox that does not resume by itself."""
        why = self.registry.sandboxes.ended_reason(sandbox_id)
        return SandboxPaused(
            f"sandbox {sandbox_id} is paused ({why or 'paused'}); Sandbox.connect(id) or resume(id) runs it "
            "again (or create it with lifecycle=Lifecycle(auto_resume=True))",
            sandbox_id,
        )

    async def expire(self, info: SandboxInfo) -> None:
        """A usable sandbox whose timeout ran out: paused (``Lifecycle(on_timeout="pause")``, if the
        pause works) or destroyed. Always raises: SandboxPaused, or SandboxNotFound saying it expired."""
        if info.lifecycle.on_timeout == "pause":
            try:
                await self.auto_pause(info.sandbox_id, "its timeout ran out")
            except WarmboxError:
                pass  # the timeout is a hard limit: destroyed below
            else:
                raise self.paused_error(info.sandbox_id)
        try:
            await self.destroy(info.sandbox_id, EXPIRED)
        except SandboxNotFound:
            pass
        raise gone(info.sandbox_id, EXPIRED)

    async def auto_pause(self, sandbox_id: str, why: str) -> None:
        """Pause a sandbox no caller asked to pause (idle, or its timeout ran out): with its memory
        where the tier can, else (or if that is refused, e.g. sockets in /workspace) its files."""
        from warmbox.engine import snapshot

        info, _ = self.info(sandbox_id)
        parent = self.registry.sandboxes.parent(sandbox_id)
        m = None
        if self.backend(info.tier).capabilities().memory_snapshot:
            try:
                m = await snapshot.pause(self, sandbox_id, None, memory=True, parent=parent, why=why)
            except SnapshotUnsupported:
                pass
        if m is None:
            m = await snapshot.pause(self, sandbox_id, None, memory=False, parent=parent, why=why)
        # the sandbox resumes from this one: the earlier automatic ones are nobody's (their blobs
        # go at the next gc); snapshots the caller took or paused to are never touched
        self.registry.snapshots.mark_auto(m.snapshot_id)
        for old in self.registry.snapshots.auto_snapshots_of(sandbox_id):
            if old != m.snapshot_id:
                try:
                    snapshot.delete(self, old)
                except WarmboxError:
                    pass

    async def open(self, sandbox_id: str) -> Launched:
        """Connect to a live sandbox by id (from any process)."""
        info, handle = self.info(sandbox_id)
        if info.state is State.PAUSED:
            raise self.paused_error(sandbox_id)
        self.check(Operation.EXEC, info, handle)
        if info.expires_at <= time.time():
            await self.expire(info)
        self.ensure_daemon()  # a live sandbox has a reaper (one flock probe when it runs)
        try:
            session = await provision.connect(self.backend(info.tier), handle)
        except GuestConnectionError:
            # being paused by another process (the daemon's idle pause), or paused just now: its
            # runtime is gone because its state is in a snapshot, not because it died
            await snapshots.wait_pause(self, sandbox_id)
            if self.info(sandbox_id)[0].state is State.PAUSED:
                raise self.paused_error(sandbox_id) from None
            if isinstance(self.backend(info.tier), SharedHost):
                await self.lost_hosts()  # its host process ended: lost (here, or by the reaper meanwhile)
                self.check(Operation.EXEC, self.info(sandbox_id)[0])  # SandboxLost if so
            if not await self.backend(info.tier).alive(handle):
                await self.destroy(sandbox_id, "found dead")
                raise SandboxNotFound(f"sandbox {sandbox_id} is no longer running", sandbox_id) from None
            raise
        return Launched(info, handle, session, self.registry.sandboxes.timings(sandbox_id))

    def holding(self) -> builtins.list[SandboxInfo]:
        """Live (also pooled) sandboxes plus failed ones whose teardown is still owed."""
        return [info for info, _ in self.registry.sandboxes.holding()]

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
        rows = self.registry.sandboxes.list(
            include_dead, include_pooled=include_pooled, tenant=tenant, states=q.state, metadata=q.metadata
        )
        return [info for info, _ in rows]

    def timings(self, sandbox_id: str) -> dict[str, float]:
        return {t.stage: t.duration_ms for t in self.registry.sandboxes.timings(sandbox_id)}

    async def usage(self, handle: BackendHandle) -> ResourceUsage:
        return await self.backend(handle.tier).usage(handle)

    def set_timeout(self, sandbox_id: str, timeout: float) -> float:
        timeout = validate_timeout(timeout)
        info, _ = self.info(sandbox_id)
        self.check(Operation.SET_TIMEOUT, info)
        expires = time.time() + timeout
        self.registry.sandboxes.set_expiry(sandbox_id, expires, timeout)  # its lifetime now: a resume renews this one
        self.ensure_daemon()  # someone must enforce the new deadline
        return expires

    # ---- network

    async def set_network(self, sandbox_id: str, network: object, session: GuestSession | None = None) -> Policy:
        """Replace a running sandbox's egress policy; new connections and lookups obey it at once.

        Legal while ready/running. A sandbox without a link gets one (and its proxy env) first.
        """
        policy = egress.policy_of(self.settings().network, network)
        info, handle = self.info(sandbox_id)
        self.check(Operation.EXEC, info, handle)
        egress.check_tier(self, info.tier, policy)
        if self.registry.egress.link(sandbox_id) is not None:
            self.registry.egress.set_policy(sandbox_id, policy.to_json())
        elif policy.enabled:
            own = session is None
            if session is None:
                session = (await self.open(sandbox_id)).session
            try:
                await egress.attach(self, handle, session, policy, {})
            finally:
                if own:
                    await session.close()
        return policy

    def network_policy(self, sandbox_id: str) -> Policy:
        self.info(sandbox_id)
        return egress.current_policy(self, sandbox_id)

    def network_log(self, sandbox_id: str) -> builtins.list[NetEvent]:
        """Every egress attempt of the sandbox (kept after it is destroyed), oldest first."""
        self.info(sandbox_id)
        return self.registry.egress.net_events(sandbox_id)

    # ---- metering

    async def sample(self) -> None:
        """One memory/cpu reading of every live sandbox, folded into its meter (the daemon's job)."""
        readings = []
        for info, handle in self.registry.sandboxes.list(include_pooled=True, local=True):
            if info.state is State.CREATING:
                continue
            try:
                u = await self.backend(info.tier).usage(handle)
            except (WarmboxError, OSError):
                continue
            readings.append((info.sandbox_id, u.memory_bytes, u.cpu_ns))
        if readings:
            self.registry.usage.sample(readings)

    async def metrics(self, sandbox_id: str, session: GuestSession | None = None) -> SandboxMetrics:
        """The user's cost of a sandbox so far (or final, once it ended)."""
        info, handle = self.info(sandbox_id)
        if info.state not in (State.DESTROYED, State.PAUSED):  # a paused one's stand still: as recorded
            self.check(Operation.METRICS, info, handle)
            await self._read_meters(info, handle, session)
        return self._metrics(info)

    def metered(self, sandbox_id: str) -> SandboxMetrics:
        """The cost of a sandbox as its meters last recorded it (no reading of the sandbox)."""
        return self._metrics(self.info(sandbox_id)[0])

    async def _read_meters(self, info: SandboxInfo, handle: BackendHandle, session: GuestSession | None) -> None:
        try:
            u = await self.backend(info.tier).usage(handle)
            self.registry.usage.sample([(info.sandbox_id, u.memory_bytes, u.cpu_ns)])
        except (WarmboxError, OSError):
            pass
        if info.state not in (State.READY, State.RUNNING):
            return
        own = session is None
        try:
            if session is None:
                session = await asyncio.wait_for(GuestSession.connect(handle.socket_path, info.sandbox_id), 1)
            r = await asyncio.wait_for(session.usage(), 2)
            if r is not None:
                self.registry.usage.set_busy(info.sandbox_id, *r)
        except (TimeoutError, WarmboxError, OSError):
            pass  # the last known counters stand
        finally:
            if own and session is not None:
                await session.close()

    def recorded_metrics(self, info: SandboxInfo) -> SandboxMetrics:
        """The user's cost of a sandbox in any state as last recorded, without reading it."""
        return self._metrics(info)

    def _metrics(self, info: SandboxInfo) -> SandboxMetrics:
        m = self.registry.usage.meter(info.sandbox_id)
        start = info.claimed_at or info.created_at
        end = self.registry.usage.ended_at(info.sandbox_id) or time.time()
        wall = max(0.0, end - start)
        # the commands recorded (what commands() lists), not the agent's count: that one is the
        # guest's word, counts a pool's warm-up, and starts again at 0 in a resumed runtime
        commands = self.registry.commands.command_count(info.sandbox_id)
        if m is None:
            dead = info.state is State.DESTROYED
            return SandboxMetrics(info.sandbox_id, 0.0, 0.0, wall, 0.0, wall, 0, 0, commands, dead)
        busy = min(wall, m.busy_ms / 1e3)
        return SandboxMetrics(
            sandbox_id=info.sandbox_id,
            cpu_s=max(0, m.cpu_ns - m.base_cpu_ns) / 1e9,
            memory_gib_s=max(0.0, m.gib_s - m.base_gib_s),
            wall_s=wall,
            busy_s=busy,
            idle_s=wall - busy,
            memory_bytes=m.memory_bytes,
            memory_peak_bytes=m.peak_bytes,
            commands=commands,
            final=m.final,
        )

    # ---- destroy

    async def destroy(self, sandbox_id: str, reason: str = "killed") -> bool:
        """Destroy a sandbox; False if it was already gone. Leaves no process, mount, cgroup or dir."""
        info, handle = self.info(sandbox_id)
        if info.state is State.DESTROYED:
            return False
        self.check(Operation.DESTROY, info, None if info.state is State.LOST else handle)
        self.command_log.flush()  # its records are written before it is seen to end
        if info.state is State.LOST or handle.node != self.node:
            # lost: its runtime died with its node; another node's paused one: what its pause
            # left is on that node. Only its records end here; that node's reconcile removes the
            # rest (its link record stays for it: the link's address and name are that node's).
            # One lost here with its host process (SharedHost.tend_hosts) on this very node: what
            # is left of it here (its state dir) goes now, if marking it lost could not remove it.
            if info.state is State.LOST and handle.node == self.node and Path(handle.state_dir).exists():
                backend = self.backend(info.tier)
                if isinstance(backend, SharedHost):
                    try:
                        await backend.destroy(handle)
                    except WarmboxError:
                        pass  # best effort: its records end either way
            self.registry.sandboxes.set_state(sandbox_id, State.DESTROYED, reason)
            self.registry.usage.finalize(sandbox_id)
            if info.state is State.PAUSED:
                self.registry.egress.set_egress(sandbox_id, "")  # the kept record of a paused one
            self._forget_auto_snapshots(info)
            return True
        if info.state is not State.PAUSED:
            await self._read_meters(info, handle, None)  # last readings before the cgroup goes
        if info.state is not State.PAUSED or Path(handle.state_dir).exists():  # paused: leftovers only
            await self.backend(info.tier).destroy(handle)
        await egress.release(self, sandbox_id)
        self.registry.sandboxes.set_state(sandbox_id, State.DESTROYED, reason)
        self.registry.usage.finalize(sandbox_id)
        self._forget_auto_snapshots(info)
        return True

    def _forget_auto_snapshots(self, info: SandboxInfo) -> None:
        if info.lifecycle.pauses:  # what automatic pauses saved of it ends with it
            from warmbox.engine import snapshot

            for snap in self.registry.snapshots.auto_snapshots_of(info.sandbox_id):
                try:
                    snapshot.delete(self, snap)
                except WarmboxError:
                    pass

    async def reap(self) -> builtins.list[str]:
        """Destroy expired sandboxes, failed teardowns and creations whose creator died; first
        finish or undo snapshot operations whose process died (a pause after its checkpoint)."""
        from warmbox.engine import snapshot

        await snapshot.recover(self)
        reaped = await self.lifecycle_duties()
        now = time.time()
        reaped += await self._reap_template_vms()
        orphans = {
            sid
            for sid, owner in self.registry.sandboxes.creating_with_owner()
            if owner and not owner_alive(owner, self.node)
        }
        for info, _ in self.registry.sandboxes.list(include_pooled=True, local=True):
            if info.state in (State.CREATING, State.RETIRING) and info.sandbox_id not in orphans:
                # its creator lives and will finish or clean up; only a start stuck far beyond
                # any real one is taken away from it
                expired = now - info.created_at > CREATE_DEADLINE_S
            else:
                expired = info.state in LIVE and info.expires_at <= now
            if (
                expired
                and info.state in (State.READY, State.RUNNING)
                and info.lifecycle.on_timeout == "pause"
                and info.sandbox_id not in orphans
            ):
                try:
                    await self.expire(info)  # paused (or, if that fails, destroyed): it always raises
                except (SandboxPaused, SandboxNotFound):  # paused, or (its pause failed) destroyed
                    reaped.append(info.sandbox_id)
                except Exception:
                    pass
                continue
            if info.sandbox_id in orphans and self.registry.sandboxes.ended_reason(info.sandbox_id) == RESUMING:
                try:  # a resume whose process died: paused again (its snapshot is untouched), not lost
                    await self._unresume(info.sandbox_id)
                    reaped.append(info.sandbox_id)
                except Exception:
                    pass
                continue
            if expired or info.state is State.FAILED or info.sandbox_id in orphans:
                why = (
                    ("retirer process died" if info.state is State.RETIRING else "creator process died")
                    if info.sandbox_id in orphans
                    else "pool max_age reached"
                    if info.state is State.POOLED
                    else EXPIRED
                )
                try:
                    if await self.destroy(info.sandbox_id, why):
                        reaped.append(info.sandbox_id)
                except Exception:  # one bad sandbox must not stop the reaper; retried next round
                    continue
        for sid, owner in self.registry.sandboxes.paused_with_owner():  # a pause killed while releasing
            if owner and not owner_alive(owner, self.node):
                info, handle = self.registry.sandboxes.get(sid)
                try:
                    if Path(handle.state_dir).exists():
                        await self.backend(info.tier).destroy(handle)
                        reaped.append(sid)
                    await egress.suspend(self, sid)  # its link too (its policy kept for the resume)
                    self.registry.sandboxes.released(sid, owner)
                except Exception:
                    continue
        for info, _ in self.registry.sandboxes.holding():
            if info.state is State.FAILED and info.sandbox_id not in reaped:
                try:
                    if await self.destroy(info.sandbox_id, "teardown retried"):
                        reaped.append(info.sandbox_id)
                except Exception:
                    continue
        await self.lost_hosts()
        return reaped

    async def lost_hosts(self) -> builtins.list[str]:
        """Mark ``lost``, at once, the sandboxes whose host process ended under them (a tier with
        shared host processes: ``SharedHost.tend_hosts``, which also ends hosts idle for a while),
        and remove what is left of them here; returns their ids. Every reap runs it (the daemon:
        each tick), and so does a call that finds its sandbox's connection gone."""
        live: dict[str, builtins.list[BackendHandle]] = {}
        for info, handle in self.registry.sandboxes.list(include_pooled=True, local=True):
            if info.state in (State.READY, State.RUNNING, State.POOLED):
                live.setdefault(info.tier, []).append(handle)
        lost: builtins.list[str] = []
        for tier in backends.TIERS:
            try:
                b = self.backend(tier)
            except WarmboxError:
                continue
            if not isinstance(b, SharedHost):
                continue
            handles = live.get(tier, [])
            dead = await asyncio.to_thread(b.tend_hosts, handles)
            if not dead:
                continue
            changed = self.registry.nodes.mark_lost(dead, f"the {tier} tier's host process that held it ended")
            for handle in handles:
                if handle.sandbox_id in changed:
                    try:
                        await b.destroy(handle)  # its state dir; nothing of it runs any more
                    except WarmboxError:
                        pass
            lost += changed
        return lost

    # ---- cluster node

    async def reconcile_node(self) -> builtins.list[str]:
        """End what this home's runtime still holds that the registry does not give this node to
        run: a sandbox lost when the node was marked down, destroyed meanwhile, or handed to
        another node (a paused one resumed elsewhere); also the leftovers of a pause of this
        node's that its dead process did not release. Only local things go (processes, runtime
        records, state directory, network); the registry rows are left as they are. Called at a
        node's start, and when a heartbeat finds it fenced. Returns the ids ended."""
        sandboxes = self.runtime / "sandboxes"
        found: dict[str, str] = {}  # sandbox id -> tier, "" until the row or a runtime says
        try:
            names = os.listdir(sandboxes)
        except FileNotFoundError:
            names = []
        for name in names:
            if _SANDBOX_ID.fullmatch(name):
                found.setdefault(name, "")
        for tier in backends.TIERS:
            try:
                b = self.backend(tier)
            except WarmboxError:
                continue
            if isinstance(b, Inventory):
                for sid in b.held():
                    found[sid] = tier
        ended: builtins.list[str] = []
        for sid, tier in sorted(found.items()):
            state_dir = sandboxes / sid
            uid_base = 0
            try:
                info, handle = self.registry.sandboxes.get(sid)
            except SandboxNotFound:
                pass  # no row: this node's runtime alone knows it, and nobody can use it
            else:
                if not self._reconcile_ends(info, handle, state_dir):
                    continue
                tier, uid_base = info.tier, handle.uid_base
            if not tier:
                continue  # a bare directory without a row: nothing says which tier removes it
            local = BackendHandle(
                sid, tier, sid, str(state_dir), str(state_dir / "run" / "agent.sock"), uid_base, self.node
            )
            try:
                await self.backend(tier).destroy(local)
                await egress.discard(self, sid)
            except (WarmboxError, OSError):
                continue  # tried again at the next reconcile
            ended.append(sid)
        return ended

    def _reconcile_ends(self, info: SandboxInfo, handle: BackendHandle, state_dir: Path) -> bool:
        """Whether the reconcile ends this home's copy of a sandbox whose row is ``info``."""
        if handle.node == self.node:
            if info.state in LIVE or info.state is State.FAILED:
                return False  # this node's: its own duties (the reaper) look after it
            if info.state is State.PAUSED:
                return not self.registry.sandboxes.owner_of(info.sandbox_id)  # a pauser still releasing it: its job
            return True  # lost or destroyed
        if info.state in LIVE or info.state is State.FAILED or info.state is State.PAUSED:
            # Another node's now. Cgroups and named network namespaces are named by sandbox id
            # host-wide: when that node runs on this same host (its state directory is here, and is
            # not ours), ending our copy would end its sandbox too; its resume removes what it must.
            theirs = Path(handle.state_dir)
            if theirs != state_dir and theirs.exists():
                return False
        return True

    async def node_heartbeat(self, epoch: int) -> bool:
        """One heartbeat of this node (``[cluster] node``), joined under ``epoch``: its live and
        pooled counts go to the registry. False: the node is fenced (marked down, or joined again
        under a newer epoch): what it ran is no longer its own, so it is ended here at once
        (``reconcile_node``) and the node process must stop serving and exit."""
        live, pooled = self.registry.nodes.local_counts()
        if self.registry.nodes.heartbeat(self.node, epoch, live, pooled):
            return True
        await self.reconcile_node()
        return False

    async def _unresume(self, sandbox_id: str) -> None:
        """Take back a resume whose process died: its runtime (if any) torn down, paused again."""
        info, handle = self.info(sandbox_id)
        if Path(handle.state_dir).exists():
            await self.backend(info.tier).destroy(handle)
        await egress.suspend(self, sandbox_id)
        self.registry.sandboxes.set_state(
            sandbox_id, State.PAUSED, "resumer process died; still paused", expected=State.CREATING
        )
        self.registry.usage.finalize(sandbox_id)

    def _retention(self) -> float:
        try:
            return self.settings().paused_retention_s
        except WarmboxError:  # a broken config must not stop the duties
            return config.PAUSED_RETENTION_S

    async def _runs_processes(self, sandbox_id: str) -> bool:
        """Whether background processes (commands.run(background=True), terminals) still run in
        the sandbox: they count as use, so an idle pause never ends a server or a shell."""
        try:
            got = await self.open(sandbox_id)
        except WarmboxError:
            return False
        try:
            return bool(await got.session.processes())
        except WarmboxError:
            return False
        finally:
            await got.session.close()

    async def lifecycle_duties(self) -> builtins.list[str]:
        """Pause the sandboxes idle past their ``idle_pause_after``; delete the sandboxes paused
        longer than ``[lifecycle] paused_retention``, with their snapshots (a timeout with
        ``on_timeout="pause"`` is the reaper's: see ``expire``). Returns the ids acted on."""
        from warmbox.engine import snapshot

        idle, expired = self.registry.sandboxes.lifecycle_due(time.time(), self._retention())
        done = []
        for sid in idle:
            try:
                if await self._runs_processes(sid):  # a background process or terminal is use
                    self.registry.sandboxes.touch(sid, time.time())
                    continue
                await self.auto_pause(sid, "idle")
                done.append(sid)
            except Exception:  # tried again after another idle period
                try:
                    self.registry.sandboxes.touch(sid, time.time())
                except WarmboxError:
                    pass
        for sid in expired:
            try:
                for snap in self.registry.snapshots.snapshots_of(sid):
                    snapshot.delete(self, snap)
                if await self.destroy(sid, RETENTION_EXPIRED):
                    done.append(sid)
            except Exception:  # retried next round
                continue
        if expired:
            try:
                await snapshot.gc(self)  # their blobs, unless another snapshot shares them
            except Exception:
                pass
        return done

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
                marks = json.loads(self.registry.meta.meta_text(TEMPLATE_VMS_KEY) or "{}")
            except ValueError:
                marks = {}
            if not isinstance(marks, dict):
                marks = {}
            if change is not None:
                change(marks)
                self.registry.meta.set_meta_text(TEMPLATE_VMS_KEY, json.dumps(marks))
            return marks
        finally:
            os.close(fd)

    def mark_template_vm(self, sandbox_id: str, key: str) -> None:
        """This process makes ``sandbox_id`` into the template ``key``: if it dies first, the
        reaper destroys the sandbox."""
        self._template_marks(lambda m: m.__setitem__(sandbox_id, {"owner": self.owner, "key": key}))

    def unmark_template_vm(self, sandbox_id: str) -> None:
        self._template_marks(lambda m: m.pop(sandbox_id, None))

    async def _reap_template_vms(self) -> builtins.list[str]:
        if not self.registry.meta.meta_text(TEMPLATE_VMS_KEY).strip("{} "):
            return []  # nothing marked: no lock taken (the daemon looks every tick)
        reaped = []
        for sid, mark in self._template_marks().items():
            owner = mark.get("owner") if isinstance(mark, dict) else None
            if isinstance(owner, str) and owner and owner_alive(owner, self.node):
                continue  # its creator is still at it
            try:
                info, handle = self.registry.sandboxes.get(sid)
            except SandboxNotFound:
                self.unmark_template_vm(sid)
                continue
            if (
                info.state in (State.READY, State.RUNNING)
                and self._pause_pending(sid)
                and not await self.backend(info.tier).alive(handle)
            ):
                continue  # its memory is saved (nothing runs): recovery finishes the pause, then below
            why = "template creator died"
            if info.state is State.PAUSED:  # paused (by its creator, or by recovery) but not recorded
                key = mark.get("key")
                taken = self.registry.snapshots.snapshots_of(sid)
                if taken and isinstance(key, str) and key.startswith("template:"):
                    if not self.registry.meta.meta_text(key):
                        self.registry.meta.set_meta_text(key, taken[-1])
                    if self.registry.meta.meta_text(key) == taken[-1]:
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
        """The next moment the daemon has work: a timeout, an idle pause, a paused sandbox's end."""
        found = [i.expires_at for i in self.holding()]
        duty = self.registry.sandboxes.next_lifecycle_deadline(self._retention())
        if duty is not None:
            found.append(duty)
        return min(found) if found else None

    def ensure_daemon(self) -> None:
        """Start this home's daemon (reaper, pools, meters) unless one runs (it holds an flock).

        Started through its guard, which restarts it whenever it dies without meaning to (and
        which it restarts in turn): see engine/daemon.py for what that guarantees."""
        from warmbox.engine import daemon

        daemon.ensure(self.home)
