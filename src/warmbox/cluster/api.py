"""``warmbox serve --cluster HEAD``: the server's fronts for a cluster (router, monitor, readiness)."""

from __future__ import annotations

import asyncio
import logging

from warmbox.cluster import tls
from warmbox.cluster.monitor import Monitor, ray_alive
from warmbox.cluster.router import Cluster, ClusterFront
from warmbox.engine.engine import Engine
from warmbox.errors import ConfigError, WarmboxError
from warmbox.models import Tenant
from warmbox.server import peer
from warmbox.server.app import Fronts

log = logging.getLogger("warmbox.cluster")


async def cluster_fronts(engine: Engine, ray_address: str) -> Fronts:
    """The fronts of a cluster's API tier on ``engine``'s registry (the cluster's shared one, from
    ``[cluster] registry``), watching the Ray cluster at ``ray_address`` (HOST:PORT)."""
    settings = engine.settings()
    if not settings.cluster.registry:
        raise ConfigError(
            "a cluster's router needs the cluster's registry: [cluster] registry = \"postgresql://…\" "
            "(or WARMBOX_CLUSTER__REGISTRY)"
        )
    if not ray_address:
        raise ConfigError("--cluster needs the Ray head's address, HOST:PORT")
    if not settings.cluster.token_file:
        raise ConfigError("[cluster] token_file is required: the secret the router and the nodes share")
    token = peer.read_token(settings.cluster.token_file)
    # the router's certificate (`warmbox cluster cert --router`): presented to every node's API and
    # to Ray's GCS; the nodes' certificates are checked against the cluster's CA
    member = tls.member(tls.directory(settings.cluster.tls_dir, settings.cluster.token_file), tls.ROUTER)
    alive = await asyncio.to_thread(ray_alive, ray_address, settings.cluster.token_file, member)
    cluster = Cluster(engine.registry, token, engine.settings, member.client_context())
    monitor = Monitor(cluster, alive)

    def make(tenant: Tenant | None) -> ClusterFront:
        return ClusterFront(cluster, tenant)

    async def start() -> None:
        try:
            await monitor.tick()  # the first view before the first request
        except WarmboxError as e:  # the registry is not there yet: /readyz says so until it is
            log.warning("cluster router: first look at the nodes failed: %s", e)
        monitor.start()

    async def stop() -> None:
        await monitor.stop()
        await cluster.close()

    return Fronts(make=make, ready=cluster.ready, start=start, stop=stop)


__all__ = ["cluster_fronts"]
