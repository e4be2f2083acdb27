"""The start record: what a caller's create asks, checked once at the front and carried to the registry.

``StartRecord.build`` turns an ``ops.Create`` into one frozen record, every option checked, before
anything is asked, claimed or made; ``StartRecord.checked`` is the same check for the engine's own
starts of a caller's sandbox (a fork's or a resume's shape, provision.create). The provisioning
pipeline carries it to the transaction that makes the sandbox count (registry ``allocate``, or a
pool ``claim``), which writes its metadata, lifecycle and tier choice and its volume mounts in the
same row and transaction (storage.registry.sandboxes.NewSandbox): a refused or failed start leaves
none of it. Secret values stay in the record (repr=False) and never reach the registry. Adding a
create option touches ``ops.Create``, this record and the code that uses it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from warmbox import backends
from warmbox import operations as ops
from warmbox.engine import egress, tierprofile
from warmbox.engine import volumes as volumes_mod
from warmbox.errors import InvalidArgument
from warmbox.models import (
    Lifecycle,
    Limits,
    Requirements,
    Tenant,
    TierChoice,
    VolumeMount,
    validate_envs,
    validate_lifecycle,
    validate_metadata,
    validate_timeout,
)
from warmbox.network.policy import Policy, Secret

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine

AUTO = "auto"  # Create(tier=AUTO): the tier the four questions choose (ChooseTier)


@dataclasses.dataclass(frozen=True)
class StartRecord:
    """Everything a start needs, checked once (``build`` at the front, ``checked`` in provision)."""

    tier: str  # canonical; "auto" already chosen ("": a fork's, whose shape is its snapshot's)
    template: str  # settings.defaults.template when not given
    timeout_s: float  # models.validate_timeout; from the moment it is usable
    limits: Limits  # type-checked and settings.limits.check
    envs: tuple[tuple[str, str], ...] = ()  # models.validate_envs
    tenant: Tenant | None = None
    pool: bool = True  # may come from a pool (the pipeline says no for volumes and link_before_start)
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)  # models.validate_metadata
    lifecycle: Lifecycle = dataclasses.field(default_factory=Lifecycle)  # models.validate_lifecycle
    requirements: Requirements | None = None  # tier="auto": what was asked ...
    choice: TierChoice | None = None  # ... and why this tier
    network: Policy = dataclasses.field(default_factory=lambda: Policy.of("none"))  # egress.policy_of
    secrets: Mapping[str, Secret] = dataclasses.field(default_factory=dict, repr=False)  # values: NEVER stored
    volumes: tuple[VolumeMount, ...] = ()  # the tenant's names resolved to disks (volumes.resolve)

    @classmethod
    async def build(cls, engine: Engine, r: ops.Create, tenant: Tenant | None) -> StartRecord:
        """The record of ``r`` for ``tenant``; a typed error before any work (before an approval
        question too). tier="auto" (or requirements without a tier) is chosen here, off the
        event loop (tierprofile.choose). A fork (``from_snapshot``) records its metadata and
        lifecycle here; its shape is its snapshot's (snapshot.fork checks its timeout and envs)."""
        metadata = validate_metadata(r.metadata)
        lifecycle = validate_lifecycle(r.lifecycle)
        auto = r.tier == AUTO or (r.tier is None and r.requirements is not None)
        if r.requirements is not None and not isinstance(r.requirements, Requirements):
            raise InvalidArgument(f"requirements must be a warmbox.Requirements, got {type(r.requirements).__name__}")
        if r.requirements is not None and not auto:
            raise InvalidArgument(f'requirements choose the tier: pass tier="auto" (or none), not tier={r.tier!r}')
        if r.from_snapshot is not None:
            if auto:
                raise InvalidArgument("from_snapshot takes its tier from the snapshot's sandbox: not tier='auto'")
            return cls("", "", 0.0, Limits(), tenant=tenant, metadata=metadata, lifecycle=lifecycle)
        tier, req, choice = r.tier, None, None
        if auto:
            req = r.requirements or Requirements()
            choice = await asyncio.to_thread(
                functools.partial(
                    tierprofile.choose,
                    engine,
                    req,
                    tenant,
                    egress=Policy.of(r.network).enabled,  # tiers without egress, images or files cannot take
                    template=r.template if isinstance(r.template, str) else "",  # what the create asks besides
                    volumes=bool(r.volumes),
                )
            )
            tier = choice.tier
        rec = cls.checked(
            engine,
            tier=tier,
            template=r.template,
            timeout=r.timeout,
            envs=r.envs,
            limits=r.limits,
            tenant=tenant,
            pool=r.pool,
            network=r.network,
            secrets=r.secrets,
            volumes=r.volumes,
        )
        return dataclasses.replace(rec, metadata=metadata, lifecycle=lifecycle, requirements=req, choice=choice)

    @classmethod
    def checked(
        cls,
        engine: Engine,
        *,
        tier: str | None = None,
        template: object = None,
        timeout: float | None = None,
        envs: object = None,
        limits: object = None,
        tenant: Tenant | None = None,
        pool: bool = True,
        network: object = None,
        secrets: object = None,
        volumes: object = None,
        mounts: tuple[VolumeMount, ...] | None = None,
        image_given: bool = False,
    ) -> StartRecord:
        """A start's options checked, in this order: tier, template on a tier without images,
        network, secrets, the tier's egress, volumes (the tenant's names; ``mounts``: resolved
        already, a resume's or a fork's), timeout, envs, limits, template. None: the host's
        defaults (warmbox.toml). image_given: the start runs a recorded image (any tier)."""
        settings = engine.settings()
        tier = backends.canonical_tier(settings.defaults.tier if tier is None else tier)
        if template is not None and not image_given and not engine.backend(tier).capabilities().images:
            raise InvalidArgument(
                f"tier {tier!r} runs no image, so it takes no template (asked: {template!r}); "
                "leave template unset, or choose a tier with images (warmbox doctor)"
            )
        policy = egress.policy_of(settings.network, network)
        secret_map = egress.validate_secrets(secrets)
        if secret_map and not policy.enabled:
            raise InvalidArgument("secrets are only usable with a network policy that allows their hosts")
        egress.check_tier(engine, tier, policy)
        if mounts is None:
            mounts = volumes_mod.resolve(engine, "" if tenant is None else tenant.name, volumes)
        timeout_s = validate_timeout(settings.defaults.timeout_s if timeout is None else timeout)
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
        return cls(
            tier,
            template,
            timeout_s,
            limits,
            env_pairs,
            tenant=tenant,
            pool=pool,
            network=policy,
            secrets=secret_map,
            volumes=mounts,
        )

    def recording(self, caller: StartRecord | None) -> StartRecord:
        """This start with what ``caller``'s record says of the sandbox (a fork's metadata and
        lifecycle: its shape is its snapshot's); None: this one as it is."""
        if caller is None:
            return self
        return dataclasses.replace(
            self,
            metadata=caller.metadata,
            lifecycle=caller.lifecycle,
            requirements=caller.requirements,
            choice=caller.choice,
        )

    @classmethod
    def internal(
        cls, tier: str, template: str, timeout_s: float, limits: Limits, tenant: Tenant | None = None
    ) -> StartRecord:
        """An engine's own start (a pool's sandbox, a template VM, a build, a benchmark's): no
        metadata, no network, no caller's options; its arguments are the engine's, trusted."""
        return cls(backends.canonical_tier(tier), template, timeout_s, limits, tenant=tenant, pool=False)


__all__ = ["AUTO", "StartRecord"]
