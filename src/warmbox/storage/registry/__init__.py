"""The registry: every sandbox, its transitions and stage timings, and the tenants, their quotas
and API keys (hashes only). An embedded SQLite file in the home by default; a PostgreSQL database
shared by the nodes of a cluster when ``[cluster] registry`` names one (storage/sql.py: the dialect).

It is the source of truth shared by every warmbox process on the host (CLI, SDK, reaper) or, on
PostgreSQL, in the cluster. One store per data area (``registry.sandboxes``, ``registry.pools``, ...)
over one database layer (db.py: connections, transactions, retries; schema.py: the tables).
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from pathlib import Path

from warmbox.config import ClusterSettings
from warmbox.models import Limits
from warmbox.storage.registry.approvals import ApprovalStore
from warmbox.storage.registry.commands import COMMANDS_HEAD, COMMANDS_TAIL, MAX_COMMAND_ERROR, CommandStore
from warmbox.storage.registry.common import _add_usage, unknown_sandbox
from warmbox.storage.registry.db import PG_KEY_PREFIX, Database, bounds_of, migrate, redacted, schema_version
from warmbox.storage.registry.idempotency import KeyClaim, KeyRecord, KeyStore
from warmbox.storage.registry.meta import MetaStore
from warmbox.storage.registry.network import EgressStore
from warmbox.storage.registry.nodes import NodeStore
from warmbox.storage.registry.pools import PoolRow, PoolStore
from warmbox.storage.registry.sandboxes import SandboxStore
from warmbox.storage.registry.schema import SCHEMA, SCHEMA_VERSION, schema_statements
from warmbox.storage.registry.snapshots import SnapshotStore
from warmbox.storage.registry.templates import TemplateStore
from warmbox.storage.registry.tenants import SECRET_PREFIX, TenantStore
from warmbox.storage.registry.usage import METRIC_SAMPLE_EVERY_S, METRIC_SAMPLES_KEPT, Meter, UsageStore
from warmbox.storage.registry.volumes import VolumeStore
from warmbox.storage.sql import DEFAULT_BOUNDS, Bounds, PostgresDialect, SqliteDialect
from warmbox.storage.uidslots import MAX_SLOTS, UID_BASE, UID_RANGE, UidLedger

if typing.TYPE_CHECKING:
    from warmbox.config import Settings

__all__ = [
    "Registry",
    "open_registry",
    "unknown_sandbox",
    "ApprovalStore",
    "CommandStore",
    "EgressStore",
    "KeyStore",
    "MetaStore",
    "NodeStore",
    "PoolStore",
    "SandboxStore",
    "SnapshotStore",
    "TemplateStore",
    "TenantStore",
    "UsageStore",
    "VolumeStore",
    "KeyClaim",
    "KeyRecord",
    "PoolRow",
    "Meter",
    "COMMANDS_HEAD",
    "COMMANDS_TAIL",
    "MAX_COMMAND_ERROR",
    "MAX_SLOTS",
    "METRIC_SAMPLE_EVERY_S",
    "METRIC_SAMPLES_KEPT",
    "PG_KEY_PREFIX",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SECRET_PREFIX",
    "UID_BASE",
    "UID_RANGE",
    "_add_usage",
    "bounds_of",
    "migrate",
    "redacted",
    "schema_statements",
    "schema_version",
]


class Registry:
    """location: a SQLite file path, or a ``postgresql://`` URL (a registry shared by a cluster).
    node: the cluster node this process is ("" = one host): the sandboxes it creates are its,
    and the queries about what runs here (uid slots in use, network links, pool claims and
    retirements, the reaper's views) see only its rows: a row of another node is never judged
    by this host's processes or directories.
    ledger: where uid slots are claimed (the host-wide one unless a test gives its own).
    check_limits: called with a sandbox's Limits before any row is written (raises to refuse).
    bounds: how long it waits for a lock or a statement, and retries a write that timed out.

    Its data lives in stores, one per area, all over the one Database: ``registry.sandboxes.get(id)``.
    The Database itself is ``registry.db`` (a test that looks at rows: ``registry.db.read(sql)``).
    """

    def __init__(
        self,
        location: Path | str,
        node: str = "",
        *,
        ledger: UidLedger | None = None,
        check_limits: Callable[[Limits], None] | None = None,
        bounds: Bounds = DEFAULT_BOUNDS,
    ) -> None:
        self.db = Database(location, node, ledger=ledger, check_limits=check_limits, bounds=bounds)
        self.tenants = TenantStore(self.db)
        self.volumes = VolumeStore(self.db)
        self.sandboxes = SandboxStore(self.db, self.tenants, self.volumes)
        self.pools = PoolStore(self.db, self.tenants)
        self.snapshots = SnapshotStore(self.db)
        self.templates = TemplateStore(self.db)
        self.usage = UsageStore(self.db)
        self.approvals = ApprovalStore(self.db)
        self.egress = EgressStore(self.db)
        self.idempotency = KeyStore(self.db)
        self.commands = CommandStore(self.db)
        self.nodes = NodeStore(self.db)
        self.meta = MetaStore(self.db)

    @property
    def node(self) -> str:
        return self.db.node

    @property
    def location(self) -> Path | str:
        """What it was opened with (RegistryStats opens its own connection there)."""
        return self.db.location

    @property
    def path(self) -> Path | None:
        """The file (None for PostgreSQL: there is no file, and its URL may hold a password)."""
        return self.db.path

    @property
    def bounds(self) -> Bounds:
        return self.db.bounds

    @property
    def ledger(self) -> UidLedger:
        return self.db.ledger

    @property
    def key(self) -> str:
        """How the host's uid ledger and layer pins name this registry (never its URL)."""
        return self.db.key

    @property
    def shared(self) -> bool:
        """Whether the registry is a PostgreSQL database (shared by a cluster's nodes)."""
        return self.db.shared

    @property
    def dialect(self) -> SqliteDialect | PostgresDialect:
        return self.db.dialect

    def close(self) -> None:
        self.db.close()


def open_registry(
    home: Path, settings: Settings | ClusterSettings, *, check_limits: Callable[[Limits], None] | None = None
) -> Registry:
    """The registry of a home: ``[cluster] registry`` (a PostgreSQL URL shared by a cluster), else
    the SQLite file in the home; as ``[cluster] node``. Every part of warmbox opens it here
    (engine, proxy, approvals). settings: the home's Settings, or just their ``cluster``."""
    cluster = settings if isinstance(settings, ClusterSettings) else settings.cluster
    return Registry(
        cluster.registry or home / "registry.db", cluster.node, check_limits=check_limits, bounds=bounds_of(cluster)
    )
