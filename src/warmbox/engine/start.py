"""The start record: what a caller's create asks, checked once at the front and carried to the registry.

``StartRecord.build`` turns an ``ops.Create`` into one frozen record before anything is claimed or
made (metadata, lifecycle, the tier="auto" choice). The provisioning pipeline carries it to the
transaction that makes the sandbox count (registry ``allocate``, or a pool ``claim``), which writes
its metadata, lifecycle and tier choice in the same row (storage.registry.sandboxes.NewSandbox):
a refused or failed start leaves none of it, and no start is left half recorded.
Adding a create option touches ``ops.Create``, this record and the code that uses it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from warmbox import operations as ops
from warmbox.engine import tierprofile
from warmbox.errors import InvalidArgument
from warmbox.models import Lifecycle, Limits, Requirements, Tenant, TierChoice, validate_lifecycle, validate_metadata
from warmbox.network.policy import Policy

if TYPE_CHECKING:
    from warmbox.engine.engine import Engine

AUTO = "auto"  # Create(tier=AUTO): the tier the four questions choose (ChooseTier)


@dataclasses.dataclass(frozen=True)
class StartRecord:
    """One caller's start, its record fields checked (``build``); the rest is checked by provision.create
    as before (tier, template, timeout, envs, limits, network, secrets, volumes)."""

    tier: str | None  # chosen already for tier="auto"; None: settings.defaults.tier
    template: str | None = None
    timeout: float | None = None
    envs: dict[str, str] | None = None
    limits: Limits | None = None
    tenant: Tenant | None = None
    pool: bool = True  # may come from a pool
    network: object = None
    volumes: object = None
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)  # models.validate_metadata
    lifecycle: Lifecycle = dataclasses.field(default_factory=Lifecycle)  # models.validate_lifecycle
    requirements: Requirements | None = None  # tier="auto": what was asked ...
    choice: TierChoice | None = None  # ... and why this tier
    secrets: dict[str, object] | None = dataclasses.field(default=None, repr=False)  # values: NEVER stored

    @classmethod
    async def build(cls, engine: Engine, r: ops.Create, tenant: Tenant | None) -> StartRecord:
        """The record of ``r`` for ``tenant``; InvalidArgument before any work. tier="auto" (or
        requirements without a tier) is chosen here, off the event loop (tierprofile.choose)."""
        metadata = validate_metadata(r.metadata)
        lifecycle = validate_lifecycle(r.lifecycle)
        auto = r.tier == AUTO or (r.tier is None and r.requirements is not None)
        if r.requirements is not None and not isinstance(r.requirements, Requirements):
            raise InvalidArgument(f"requirements must be a warmbox.Requirements, got {type(r.requirements).__name__}")
        if r.requirements is not None and not auto:
            raise InvalidArgument(f'requirements choose the tier: pass tier="auto" (or none), not tier={r.tier!r}')
        tier, req, choice = r.tier, None, None
        if auto:
            if r.from_snapshot is not None:
                raise InvalidArgument("from_snapshot takes its tier from the snapshot's sandbox: not tier='auto'")
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
        return cls(
            tier=tier,
            template=r.template,
            timeout=r.timeout,
            envs=r.envs,
            limits=r.limits,
            tenant=tenant,
            pool=r.pool,
            network=r.network,
            volumes=r.volumes,
            metadata=metadata,
            lifecycle=lifecycle,
            requirements=req,
            choice=choice,
            secrets=r.secrets,
        )


__all__ = ["AUTO", "StartRecord"]
