"""The registry: every sandbox, its transitions and stage timings, and the tenants, their quotas
and API keys (hashes only). An embedded SQLite file in the home by default; a PostgreSQL database
shared by the nodes of a cluster when ``[cluster] registry`` names one (storage/sql.py: the dialect).

It is the source of truth shared by every warmbox process on the host (CLI, SDK, reaper) or, on
PostgreSQL, in the cluster.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import math
import os
import random
import re
import secrets
import sqlite3
import threading
import time
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

from warmbox.config import ClusterSettings
from warmbox.errors import (
    ApprovalClosed,
    ApprovalNotFound,
    InvalidArgument,
    NoCapacity,
    NodeFenced,
    QuotaExceeded,
    RegistryBusy,
    RegistryError,
    RegistrySchemaError,
    SandboxNotFound,
    SandboxStateError,
    TemplateNotFound,
    VolumeError,
    VolumeInUse,
    VolumeNotFound,
)
from warmbox.lifecycle import LIVE, LOSABLE, RESUMING, check_transition
from warmbox.models import (
    APPROVAL_KINDS,
    COMMAND_KINDS,
    COST_DECISIONS,
    MAX_COMMAND_TEXT,
    NETWORK_DECISIONS,
    NODE_STATES,
    Approval,
    BackendHandle,
    BudgetStatus,
    CommandRecord,
    KeyInfo,
    Lifecycle,
    Limits,
    NetEvent,
    NodeInfo,
    NodeUsage,
    PoolEvent,
    Requirements,
    SandboxInfo,
    SnapshotRecord,
    StageTiming,
    State,
    TemplateInfo,
    Tenant,
    TierChoice,
    Transition,
    UsageBucket,
)
from warmbox.paths import owner_alive
from warmbox.storage.sql import (
    DEFAULT_BOUNDS,
    PG_XACT_HORIZON,
    Bounds,
    Conn,
    PostgresDialect,
    SqliteDialect,
    dialect_for,
    is_url,
)
from warmbox.storage.uidslots import (  # noqa: F401 - MAX_SLOTS is re-exported for cli/bench
    HOLDING_STATES,
    MAX_SLOTS,
    UID_BASE,
    UID_RANGE,
    UidLedger,
    registry_holds,
    row_holds,
)
from warmbox.tiers import canonical_tier

if typing.TYPE_CHECKING:
    from warmbox.config import Settings

COMMANDS_HEAD = 5_000  # command records a sandbox keeps from its start (its setup) ...
COMMANDS_TAIL = 5_000  # ... and from its latest (at most 10,000 rows, 40 MiB of text, per sandbox)
SCHEMA_VERSION = 20
SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id  TEXT PRIMARY KEY,
    tier        TEXT NOT NULL,
    template    TEXT NOT NULL,
    state       TEXT NOT NULL,
    created_at  REAL NOT NULL,
    expires_at  REAL NOT NULL,
    memory_mb   INTEGER NOT NULL,
    cpus        REAL NOT NULL,
    pids        INTEGER NOT NULL,
    uid_slot    INTEGER NOT NULL,
    runtime_id  TEXT NOT NULL,
    state_dir   TEXT NOT NULL,
    socket_path TEXT NOT NULL,
    pool        TEXT NOT NULL DEFAULT '',
    claimed_at  REAL NOT NULL DEFAULT 0,
    owner       TEXT NOT NULL DEFAULT '',
    ended_at    REAL NOT NULL DEFAULT 0,
    shape       TEXT NOT NULL DEFAULT '',
    file_size_mb INTEGER NOT NULL DEFAULT 1024,
    open_files  INTEGER NOT NULL DEFAULT 1024,
    tmp_mb      INTEGER NOT NULL DEFAULT 256,
    parent_snapshot TEXT NOT NULL DEFAULT '',
    disk_mb     INTEGER NOT NULL DEFAULT 10240,
    tenant      TEXT NOT NULL DEFAULT '',
    timeout_s   REAL NOT NULL DEFAULT 0,
    metadata    TEXT NOT NULL DEFAULT '{}',
    on_timeout  TEXT NOT NULL DEFAULT 'kill',
    idle_pause_after REAL NOT NULL DEFAULT 0,
    auto_resume INTEGER NOT NULL DEFAULT 0,
    last_used   REAL NOT NULL DEFAULT 0,
    egress      TEXT NOT NULL DEFAULT '',
    template_version INTEGER NOT NULL DEFAULT 0,
    image_id    TEXT NOT NULL DEFAULT '',
    requirements TEXT NOT NULL DEFAULT '',
    tier_reasons TEXT NOT NULL DEFAULT '[]',
    tier_rejected TEXT NOT NULL DEFAULT '{}',
    node        TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS snapshots (
    snapshot_id TEXT PRIMARY KEY,
    sandbox_id  TEXT NOT NULL,
    created_at  REAL NOT NULL,
    size_bytes  INTEGER NOT NULL,
    tenant      TEXT NOT NULL DEFAULT '',
    auto        INTEGER NOT NULL DEFAULT 0,
    image_id    TEXT NOT NULL DEFAULT '',
    runtime     TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS snapshots_sandbox ON snapshots(sandbox_id, created_at);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE INDEX IF NOT EXISTS sandboxes_tenant ON sandboxes(tenant, state);
CREATE INDEX IF NOT EXISTS sandboxes_node ON sandboxes(node, state);
CREATE TABLE IF NOT EXISTS nodes (
    name         TEXT PRIMARY KEY,
    address      TEXT NOT NULL DEFAULT '',
    ray_node_id  TEXT NOT NULL DEFAULT '',
    epoch        INTEGER NOT NULL DEFAULT 0,
    state        TEXT NOT NULL DEFAULT 'up',
    slots        INTEGER NOT NULL DEFAULT 0,
    memory_mb    INTEGER NOT NULL DEFAULT 0,
    tiers        TEXT NOT NULL DEFAULT '',
    joined_at    REAL NOT NULL DEFAULT 0,
    heartbeat_at REAL NOT NULL DEFAULT 0,
    pooled       INTEGER NOT NULL DEFAULT 0,
    live         INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS tenants (
    name          TEXT PRIMARY KEY,
    created_at    REAL NOT NULL,
    max_sandboxes INTEGER NOT NULL DEFAULT 0,
    max_memory_mb INTEGER NOT NULL DEFAULT 0,
    max_cpus      REAL NOT NULL DEFAULT 0,
    tiers         TEXT NOT NULL DEFAULT '',
    rate_per_s    REAL NOT NULL DEFAULT 0,
    budget_cpu_h  REAL NOT NULL DEFAULT 0,
    budget_gib_h  REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id        TEXT PRIMARY KEY,
    tenant        TEXT NOT NULL REFERENCES tenants(name),
    secret_sha256 TEXT NOT NULL UNIQUE,
    created_at    REAL NOT NULL,
    revoked_at    REAL NOT NULL DEFAULT 0,
    admin         INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS transitions (
    sandbox_id TEXT NOT NULL,
    at         REAL NOT NULL,
    from_state TEXT NOT NULL,
    to_state   TEXT NOT NULL,
    reason     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS transitions_sandbox ON transitions(sandbox_id);
CREATE TABLE IF NOT EXISTS timings (
    sandbox_id  TEXT NOT NULL,
    stage       TEXT NOT NULL,
    duration_ms REAL NOT NULL,
    on_path     INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (sandbox_id, stage)
);
CREATE TABLE IF NOT EXISTS meters (
    sandbox_id    TEXT PRIMARY KEY,
    sampled_at    REAL NOT NULL,
    memory_bytes  INTEGER NOT NULL DEFAULT 0,
    peak_bytes    INTEGER NOT NULL DEFAULT 0,
    gib_s         REAL NOT NULL DEFAULT 0,
    cpu_ns        INTEGER NOT NULL DEFAULT 0,
    busy_ms       REAL NOT NULL DEFAULT 0,
    commands      INTEGER NOT NULL DEFAULT 0,
    base_cpu_ns   INTEGER NOT NULL DEFAULT 0,
    base_gib_s    REAL NOT NULL DEFAULT 0,
    base_busy_ms  REAL NOT NULL DEFAULT 0,
    base_commands INTEGER NOT NULL DEFAULT 0,
    final         INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS pool_state (
    name         TEXT PRIMARY KEY,
    target       INTEGER NOT NULL,
    min_override INTEGER,
    max_override INTEGER,
    last_error   TEXT NOT NULL DEFAULT '',
    last_error_at REAL NOT NULL DEFAULT 0,
    last_demand_at REAL NOT NULL DEFAULT 0,
    events_seen  INTEGER NOT NULL DEFAULT 0,
    config_target INTEGER
);
CREATE TABLE IF NOT EXISTS pool_events (
    pool       TEXT NOT NULL,
    at         REAL NOT NULL,
    kind       TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    detail     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS pool_events_pool ON pool_events(pool, at);
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS meta_text (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS net_links (
    sandbox_id  TEXT PRIMARY KEY,
    address     TEXT NOT NULL,
    ifname      TEXT NOT NULL,
    policy      TEXT NOT NULL,
    updated_at  REAL NOT NULL,
    node        TEXT NOT NULL DEFAULT '',
    UNIQUE (node, address)
);
CREATE TABLE IF NOT EXISTS net_events (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id  TEXT NOT NULL,
    at          REAL NOT NULL,
    kind        TEXT NOT NULL,
    host        TEXT NOT NULL,
    address     TEXT NOT NULL,
    port        INTEGER NOT NULL,
    decision    TEXT NOT NULL,
    rule        TEXT NOT NULL,
    bytes_up    INTEGER NOT NULL DEFAULT 0,
    bytes_down  INTEGER NOT NULL DEFAULT 0,
    detail      TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS net_events_sandbox ON net_events(sandbox_id, id);
CREATE TABLE IF NOT EXISTS templates (
    tenant      TEXT NOT NULL,
    name        TEXT NOT NULL,
    version     INTEGER NOT NULL,
    image_id    TEXT NOT NULL,
    layers      TEXT NOT NULL,
    env         TEXT NOT NULL,
    workdir     TEXT NOT NULL,
    "user"      TEXT NOT NULL,
    warmup_code TEXT,
    warmup_commands TEXT NOT NULL,
    source      TEXT NOT NULL,
    spec_hash   TEXT NOT NULL,
    size_bytes  INTEGER NOT NULL,
    created_at  REAL NOT NULL,
    build_log   TEXT NOT NULL,
    description TEXT NOT NULL,
    PRIMARY KEY (tenant, name, version)
);
CREATE TABLE IF NOT EXISTS template_versions (
    tenant      TEXT NOT NULL,
    name        TEXT NOT NULL,
    last        INTEGER NOT NULL,
    PRIMARY KEY (tenant, name)
);
CREATE TABLE IF NOT EXISTS build_steps (
    tenant      TEXT NOT NULL,
    step_key    TEXT NOT NULL,
    digest      TEXT NOT NULL,
    created_at  REAL NOT NULL,
    PRIMARY KEY (tenant, step_key)
);
CREATE TABLE IF NOT EXISTS volumes (
    tenant      TEXT NOT NULL,
    name        TEXT NOT NULL,
    volume_id   TEXT NOT NULL UNIQUE,
    size_mb     INTEGER NOT NULL,
    created_at  REAL NOT NULL,
    node        TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (tenant, name)
);
CREATE TABLE IF NOT EXISTS sandbox_volumes (
    sandbox_id  TEXT NOT NULL,
    volume_id   TEXT NOT NULL,
    path        TEXT NOT NULL,
    read_only   INTEGER NOT NULL,
    exclusive   INTEGER NOT NULL,
    PRIMARY KEY (sandbox_id, volume_id)
);
CREATE INDEX IF NOT EXISTS sandbox_volumes_volume ON sandbox_volumes(volume_id);
CREATE TABLE IF NOT EXISTS commands (
    sandbox_id     TEXT NOT NULL,
    seq            INTEGER NOT NULL,
    kind           TEXT NOT NULL,
    text           TEXT NOT NULL,
    text_truncated INTEGER NOT NULL,
    language       TEXT NOT NULL,
    started_at     REAL NOT NULL,
    duration_ms    REAL NOT NULL,
    exit_code      INTEGER,
    error          TEXT NOT NULL,
    timed_out      INTEGER NOT NULL,
    truncated      INTEGER NOT NULL,
    oom_killed     INTEGER NOT NULL,
    stdout_bytes   INTEGER NOT NULL,
    stderr_bytes   INTEGER NOT NULL,
    PRIMARY KEY (sandbox_id, seq)
);
CREATE TABLE IF NOT EXISTS pool_costs (
    pool       TEXT NOT NULL,
    sandbox_id TEXT PRIMARY KEY,
    cpu_s      REAL NOT NULL,
    gib_s      REAL NOT NULL,
    wall_s     REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS usage (
    tenant     TEXT NOT NULL,
    hour       REAL NOT NULL,
    cpu_s      REAL NOT NULL DEFAULT 0,
    gib_s      REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, hour)
);
CREATE INDEX IF NOT EXISTS usage_hour ON usage(hour);
CREATE TABLE IF NOT EXISTS approvals (
    approval_id TEXT PRIMARY KEY,
    tenant      TEXT NOT NULL,
    sandbox_id  TEXT NOT NULL,
    kind        TEXT NOT NULL,
    subject     TEXT NOT NULL,
    reason      TEXT NOT NULL,
    created_at  REAL NOT NULL,
    deadline    REAL NOT NULL,
    state       TEXT NOT NULL,
    decision    TEXT NOT NULL DEFAULT '',
    answered_by TEXT NOT NULL DEFAULT '',
    answered_at REAL NOT NULL DEFAULT 0,
    waiter      TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS approvals_tenant ON approvals(tenant, created_at);
CREATE INDEX IF NOT EXISTS approvals_state ON approvals(state, created_at);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    tenant      TEXT NOT NULL,
    scope       TEXT NOT NULL,
    idem_key    TEXT NOT NULL,
    op          TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    state       TEXT NOT NULL,
    holder      TEXT NOT NULL,
    created_at  REAL NOT NULL,
    expires_at  REAL NOT NULL,
    deadline    REAL NOT NULL,
    sandbox_id  TEXT NOT NULL DEFAULT '',
    result      TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (tenant, scope, idem_key)
);
CREATE INDEX IF NOT EXISTS idempotency_keys_expiry ON idempotency_keys(expires_at);
"""
_ADDED_COLUMNS = (  # columns added after version 1; each is added where missing
    "ALTER TABLE sandboxes ADD COLUMN pool TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE sandboxes ADD COLUMN claimed_at REAL NOT NULL DEFAULT 0",
    "ALTER TABLE sandboxes ADD COLUMN owner TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE sandboxes ADD COLUMN ended_at REAL NOT NULL DEFAULT 0",
    "ALTER TABLE sandboxes ADD COLUMN shape TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE sandboxes ADD COLUMN file_size_mb INTEGER NOT NULL DEFAULT 1024",
    "ALTER TABLE sandboxes ADD COLUMN open_files INTEGER NOT NULL DEFAULT 1024",
    "ALTER TABLE sandboxes ADD COLUMN tmp_mb INTEGER NOT NULL DEFAULT 256",
    "ALTER TABLE sandboxes ADD COLUMN parent_snapshot TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE sandboxes ADD COLUMN disk_mb INTEGER NOT NULL DEFAULT 10240",
    "ALTER TABLE timings ADD COLUMN on_path INTEGER NOT NULL DEFAULT 1",
    "ALTER TABLE sandboxes ADD COLUMN tenant TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE snapshots ADD COLUMN tenant TEXT NOT NULL DEFAULT ''",
    # version 7: one id for a sandbox's life (its timeout policy and egress kept across a pause),
    # metadata, and the lifecycle policy (auto-pause)
    "ALTER TABLE sandboxes ADD COLUMN timeout_s REAL NOT NULL DEFAULT 0",
    "ALTER TABLE sandboxes ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}'",
    "ALTER TABLE sandboxes ADD COLUMN on_timeout TEXT NOT NULL DEFAULT 'kill'",
    "ALTER TABLE sandboxes ADD COLUMN idle_pause_after REAL NOT NULL DEFAULT 0",
    "ALTER TABLE sandboxes ADD COLUMN auto_resume INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE sandboxes ADD COLUMN last_used REAL NOT NULL DEFAULT 0",
    "ALTER TABLE sandboxes ADD COLUMN egress TEXT NOT NULL DEFAULT ''",
    # version 8: the snapshots automatic pauses made (pruned as the sandbox moves on)
    "ALTER TABLE snapshots ADD COLUMN auto INTEGER NOT NULL DEFAULT 0",
    # version 9: templates and template_versions (new tables, made by SCHEMA)
    # version 11: the template version and image a sandbox runs, and the image of each snapshot
    "ALTER TABLE sandboxes ADD COLUMN template_version INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE sandboxes ADD COLUMN image_id TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE snapshots ADD COLUMN image_id TEXT NOT NULL DEFAULT ''",
    # version 12: what tier="auto" was asked (Requirements as JSON) and why it chose the tier it did
    "ALTER TABLE sandboxes ADD COLUMN requirements TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE sandboxes ADD COLUMN tier_reasons TEXT NOT NULL DEFAULT '[]'",
    "ALTER TABLE sandboxes ADD COLUMN tier_rejected TEXT NOT NULL DEFAULT '{}'",
    # version 13: commands (a new table, made by SCHEMA): every command and code run, its outcome
    # version 14: a tenant's daily budget (CPU-hours, GiB-hours); usage and approvals (new tables)
    "ALTER TABLE tenants ADD COLUMN budget_cpu_h REAL NOT NULL DEFAULT 0",
    "ALTER TABLE tenants ADD COLUMN budget_gib_h REAL NOT NULL DEFAULT 0",
    # version 15: the node owning each sandbox ("" = one host), and nodes (a new table, made by
    # SCHEMA); net_links' address is unique per node (rebuilt by _migrate)
    "ALTER TABLE sandboxes ADD COLUMN node TEXT NOT NULL DEFAULT ''",
    # version 16: the node holding each volume's disk ("" = one host)
    "ALTER TABLE volumes ADD COLUMN node TEXT NOT NULL DEFAULT ''",
    # version 17: build_steps (a new table, made by SCHEMA): a tenant's template build step cache,
    # keyed by tenant; the host-wide step cache of earlier versions is never read for a tenant
    # version 18 (PostgreSQL only, storage/sql.py): pool_events.xid, the transaction of each event
    # version 19: the runtime and version that made each memory snapshot ("runsc 0.0~20240729.0";
    # "": files only, or made before it was recorded: a gVisor one then counts as runsc 2022's)
    "ALTER TABLE snapshots ADD COLUMN runtime TEXT NOT NULL DEFAULT ''",
    # version 20: idempotency_keys (a new table, made by SCHEMA): each keyed create, command and code
    # run, recorded before it starts, then its result
)
_NET_LINK_COLUMNS = "sandbox_id, address, ifname, policy, updated_at, node"
_NODE_COLUMNS = (
    "name, address, ray_node_id, epoch, state, slots, memory_mb, tiers, joined_at, heartbeat_at, pooled, live"
)
_COLUMNS = (
    "sandbox_id, tier, template, state, created_at, expires_at, memory_mb, cpus, pids, uid_slot, "
    "runtime_id, state_dir, socket_path, pool, claimed_at, parent_snapshot, metadata, "
    "on_timeout, idle_pause_after, auto_resume, template_version, image_id, requirements, tier_reasons, tier_rejected, "
    "tenant, node"
)

_KEY_TENANT = (
    "SELECT k.secret_sha256, k.revoked_at, k.key_id, k.admin, t.name, t.max_sandboxes, t.max_memory_mb, "
    "t.max_cpus, t.tiers, t.rate_per_s, t.budget_cpu_h, t.budget_gib_h FROM api_keys k "
    "JOIN tenants t ON t.name=k.tenant "
)


def _build_step_tenant(tenant: str) -> None:
    # the host's own steps (no tenant) live in the host-wide layer store, never here
    if not isinstance(tenant, str) or not tenant:
        raise InvalidArgument("a build step recorded in the registry belongs to a tenant (a non-empty name)")


def _key_tenant(row: tuple) -> Tenant:
    """A key row (see _KEY_TENANT) as the Tenant a request with that key acts as."""
    return Tenant(
        name=row[4],
        admin=bool(row[3]),
        max_sandboxes=row[5],
        max_memory_mb=row[6],
        max_cpus=row[7],
        tiers=_split(row[8]),
        rate_per_s=row[9],
        key_id=row[2],
        budget_cpu_h=row[10],
        budget_gib_h=row[11],
    )


GIB = float(1 << 30)
HOUR = 3600.0
DAY = 86400.0
_MAX_APPROVAL_TEXT = 500

_LIVE = tuple(s.value for s in LIVE)
_HOLDING = (*_LIVE, State.FAILED.value)  # states whose uid range is still in use
_SPARE = (State.POOLED.value, State.RETIRING.value)  # a pool's warm spares (they yield a slot to a user's sandbox)
# what `warmbox ls` shows: the caller's sandboxes, running or paused (not the pools')
_USER = (*(s.value for s in LIVE if s not in (State.POOLED, State.RETIRING)), State.PAUSED.value)
assert set(_HOLDING) == set(HOLDING_STATES), "the uid ledger and the registry must agree on what holds a slot"
# what counts against a tenant's quotas: sandboxes holding (or about to hold) memory and CPU. A
# paused one has released its runtime (it is a snapshot until resumed, and the resume counts).
# a paused sandbox this node looks after (its retention): its own, and those of nodes marked down
_PAUSED_HERE = "(node=? OR node IN (SELECT name FROM nodes WHERE state='down'))"
_LOSABLE = tuple(s.value for s in LOSABLE)
_QUOTA = (State.CREATING.value, State.READY.value, State.RUNNING.value)
# a volume mounted by a sandbox in one of these states is in use (paused: it is mounted again on
# resume; failed: its teardown, which unmounts it, is still owed)
_MOUNTING = (*_HOLDING, State.PAUSED.value)
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
SECRET_PREFIX = "wbx_"
_MAX_SECRET = 256


def unknown_sandbox(sandbox_id: str) -> SandboxNotFound:
    """The error for an id the registry has no row for (and, to a tenant, for another tenant's)."""
    return SandboxNotFound(f"no sandbox {sandbox_id}", sandbox_id)


def _secret_hash(secret: str) -> str:
    # the secret is 256 random bits: a plain hash is enough (nothing to brute-force), and it is fast
    return hashlib.sha256(secret.encode()).hexdigest()


def _quota(name: str, value: object, *, integer: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        ok = False
    else:
        assert isinstance(value, (int, float))
        ok = math.isfinite(value) and value >= 0
    if not ok:
        kind = "an integer" if integer else "a number"
        raise InvalidArgument(f"{name} must be {kind} >= 0 (0: unlimited), got {value!r}")


def _tiers(tiers: object) -> str:
    if isinstance(tiers, str) or not isinstance(tiers, (list, tuple)):
        raise InvalidArgument(f"tiers must be a list of tier names, got {tiers!r}")
    out: builtins.list[str] = []
    for t in tiers:
        c = canonical_tier(t)
        if c not in out:
            out.append(c)
    return ",".join(out)


def _in(values: tuple[str, ...]) -> str:
    return "(" + ",".join("?" * len(values)) + ")"


@dataclasses.dataclass(frozen=True)
class Meter:
    """Raw cumulative counters of one sandbox and the baseline taken when it left its pool."""

    sandbox_id: str
    sampled_at: float
    memory_bytes: int
    peak_bytes: int
    gib_s: float
    cpu_ns: int
    busy_ms: float
    commands: int
    base_cpu_ns: int
    base_gib_s: float
    base_busy_ms: float
    base_commands: int
    final: bool


# A meters row as Registry.meter selects it: Meter's fields in order, ``final`` still SQLite's 0/1.
_MeterRow = tuple[str, float, int, int, float, int, float, int, int, float, float, int, int]


@dataclasses.dataclass(frozen=True)
class PoolRow:
    name: str
    target: int
    min_override: int | None
    max_override: int | None
    last_error: str
    last_error_at: float
    last_demand_at: float
    events_seen: int
    config_target: int | None


_NET_EVENT_INSERT = (
    "INSERT INTO net_events (sandbox_id, at, kind, host, address, port, decision, rule,"
    " bytes_up, bytes_down, detail) VALUES (?,?,?,?,?,?,?,?,?,?,?)"
)


_COMMAND_COLUMNS = (
    "sandbox_id, seq, kind, text, text_truncated, language, started_at, duration_ms, exit_code, error, "
    "timed_out, truncated, oom_killed, stdout_bytes, stderr_bytes"
)
MAX_COMMAND_ERROR = 200  # characters of a CommandRecord's error name kept


IDEM_PURGE_EVERY = 256  # claims between two purges of expired idempotency keys
_IDEM_CLAIM_COLUMNS = (
    "tenant",
    "scope",
    "idem_key",
    "op",
    "fingerprint",
    "state",
    "holder",
    "created_at",
    "expires_at",
    "deadline",
)
_IDEM_COLUMNS = ", ".join((*_IDEM_CLAIM_COLUMNS, "sandbox_id", "result"))
# a claim: inserted, or replacing an expired record; RETURNING says whether it was (SQLite >= 3.35)
_IDEM_CLAIM = (
    f"INSERT INTO idempotency_keys ({', '.join(_IDEM_CLAIM_COLUMNS)}) VALUES ({','.join('?' * 10)}) "
    "ON CONFLICT (tenant, scope, idem_key) DO UPDATE SET "
    + ", ".join(f"{c}=excluded.{c}" for c in _IDEM_CLAIM_COLUMNS[3:])
    + ", sandbox_id='', result='' WHERE idempotency_keys.expires_at <= excluded.created_at RETURNING holder"
)


def _claim_row(c: KeyClaim) -> tuple[str, str, str, str, str, str, str, float, float, float]:
    """A claim as _IDEM_CLAIM inserts it (state "started"); not dataclasses.astuple: it deep-copies."""
    return (c.tenant, c.scope, c.key, c.op, c.fingerprint, "started", c.holder, c.created_at, c.expires_at, c.deadline)


@dataclasses.dataclass(frozen=True)
class KeyClaim:
    """A keyed call, as recorded before it starts. tenant: "" for the host's root; scope: the
    sandbox of a command or code run, "" for a create; holder: the claiming process and a nonce
    (engine/idempotency.py); deadline: when a started call must have ended (0: unknown)."""

    tenant: str
    scope: str
    key: str
    op: str
    fingerprint: str
    holder: str
    created_at: float
    expires_at: float
    deadline: float


@dataclasses.dataclass(frozen=True)
class KeyRecord:
    """A key's record: its claim, its state ("started", "done", "failed"), the sandbox a create
    made, and the result (or typed error) as JSON once it ended."""

    claim: KeyClaim
    state: str
    sandbox_id: str
    result: str


def _key_record(r: tuple) -> KeyRecord:
    claim = KeyClaim(
        tenant=r[0],
        scope=r[1],
        key=r[2],
        op=r[3],
        fingerprint=r[4],
        holder=r[6],
        created_at=r[7],
        expires_at=r[8],
        deadline=r[9],
    )
    return KeyRecord(claim=claim, state=r[5], sandbox_id=r[10], result=r[11])


_NOT_A_NAME = re.compile(r"[^A-Za-z0-9_.:-]")
_INT64 = (1 << 63) - 1


def _finite(v: object) -> float:
    """A number a SQLite REAL column keeps (a NaN would be stored as NULL): else 0."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0


def _count(v: object) -> int:
    return min(max(v, 0), _INT64) if isinstance(v, int) and not isinstance(v, bool) else 0


def _command_row(c: CommandRecord, seq: int) -> tuple:
    """One CommandRecord as its commands row. Every field is bounded and typed here again, the
    registry's own rule: durations, exit codes and error names come from the guest (hostile), and
    one row SQLite refuses (a NaN, an integer past 64 bits) would fail every record of its batch."""
    text, cut = c.text, c.text_truncated
    if len(text) > MAX_COMMAND_TEXT // 4:  # only then can it be over MAX_COMMAND_TEXT bytes
        raw = text.encode("utf-8", "replace")
        if len(raw) > MAX_COMMAND_TEXT:
            text, cut = raw[:MAX_COMMAND_TEXT].decode("utf-8", "ignore"), True
    code = c.exit_code
    if isinstance(code, bool) or not isinstance(code, int) or not -_INT64 <= code <= _INT64:
        code = None
    return (
        c.sandbox_id,
        seq,
        c.kind if c.kind in COMMAND_KINDS else "command",
        text.encode("utf-8", "replace").decode() if not text.isascii() else text,  # lone surrogates: SQLite refuses
        int(bool(cut)),
        _NOT_A_NAME.sub("?", c.language[:32]),
        _finite(c.started_at),
        max(0.0, _finite(c.duration_ms)),
        code,
        _NOT_A_NAME.sub("?", c.error[:MAX_COMMAND_ERROR]),  # an exception's name: a guest may choose any
        int(bool(c.timed_out)),
        int(bool(c.truncated)),
        int(bool(c.oom_killed)),
        _count(c.stdout_bytes),
        _count(c.stderr_bytes),
    )


def _command(r: tuple) -> CommandRecord:
    return CommandRecord(
        sandbox_id=r[0],
        seq=r[1],
        kind=r[2],
        text=r[3],
        text_truncated=bool(r[4]),
        language=r[5],
        started_at=r[6],
        duration_ms=r[7],
        exit_code=r[8],
        error=r[9],
        timed_out=bool(r[10]),
        truncated=bool(r[11]),
        oom_killed=bool(r[12]),
        stdout_bytes=r[13],
        stderr_bytes=r[14],
    )


def _net_event_row(e: NetEvent) -> tuple:
    """One audit record as add_net_event(s) insert it (its detail bounded)."""
    return (
        e.sandbox_id,
        e.at,
        e.kind,
        e.host,
        e.address,
        e.port,
        e.decision,
        e.rule,
        e.bytes_up,
        e.bytes_down,
        e.detail[:500],
    )


_F = typing.TypeVar("_F", bound=Callable[..., typing.Any])
_retrying = threading.local()  # .active: this thread is inside a retried write (inner writes do not retry)


def _retried(method: _F) -> _F:
    """A registry write whose transaction timed out (RegistryBusy: a lock or statement past its
    bound, the transaction rolled back, nothing of it written) runs again after a growing, jittered
    pause, until the registry's retry budget; then the last RegistryBusy, saying how long it waited.
    Each method so marked writes in exactly one transaction (running it again repeats nothing)."""

    @functools.wraps(method)
    def run(self: Registry, *args: typing.Any, **kwargs: typing.Any) -> typing.Any:
        if getattr(_retrying, "active", False):
            return method(self, *args, **kwargs)
        _retrying.active = True
        try:
            start = time.monotonic()
            pause, tries = 0.05, 0
            while True:
                tries += 1
                try:
                    return method(self, *args, **kwargs)
                except RegistryBusy as e:
                    waited = time.monotonic() - start
                    if waited + pause > self.bounds.retry_budget_s:
                        raise RegistryBusy(
                            f"{e} (tried {tries} times in {waited:.1f} s; nothing was changed: retry later)",
                            waited_s=waited,
                        ) from None
                    time.sleep(pause * (0.5 + random.random()))
                    pause = min(pause * 2, 1.0)
        finally:
            _retrying.active = False

    return typing.cast(_F, run)


class Registry:
    """location: a SQLite file path, or a ``postgresql://`` URL (a registry shared by a cluster).
    node: the cluster node this process is ("" = one host): the sandboxes it creates are its,
    and the queries about what runs here (uid slots in use, network links, pool claims and
    retirements, the reaper's views) see only its rows: a row of another node is never judged
    by this host's processes or directories.
    ledger: where uid slots are claimed (the host-wide one unless a test gives its own).
    check_limits: called with a sandbox's Limits before any row is written (raises to refuse).
    bounds: how long it waits for a lock or a statement, and retries a write that timed out.
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
        url = is_url(location)
        self.bounds = bounds
        self.location = location  # what it was opened with (RegistryStats opens its own connection there)
        # the file (None for PostgreSQL: there is no file, and its URL may hold a password)
        self.path: Path | None = None if url else Path(location)
        self.node = node
        self.epoch: int | None = None  # this node's, from this object's join_node (None: not joined here)
        self.slots = 0  # the sandboxes this node offers, from this object's join_node (0: no bound here)
        self.ledger = ledger if ledger is not None else UidLedger()
        self.check_limits = check_limits
        self._adopted = False
        self._lease: int | None = None  # this PostgreSQL registry's lease in the uid ledger (an fd)
        # waiters of this process on approval questions: an answer given through this object wakes
        # them at once (others' answers are seen by polling). approval_id -> wake-ups.
        self._approval_waiters: dict[str, builtins.list[Callable[[], object]]] = {}
        self._claims = 0  # idempotency keys claimed through this object (their purge's cadence)
        where = redacted(str(location)) if url else str(location)
        try:
            self._sql = dialect_for(location, bounds)
            self._errors: tuple[type[Exception], ...] = self._sql.errors
            self._db: Conn = self._sql.reader()
            self._migrate()
        except (sqlite3.Error, OSError) as e:
            raise RegistryError(f"cannot open the registry at {where}: {e}") from None
        except RegistryError as e:
            if isinstance(e, RegistrySchemaError):
                raise
            raise RegistryError(f"cannot open the registry at {where}: {e}") from None
        self._cluster = ""
        if self.path is not None:
            self._key = str(self.path.resolve())  # how the ledger names this registry
        else:
            # never the URL: the cluster's own id (made by its first migration) and this node
            self._cluster = self.meta_text("cluster_id")
            self._key = f"{PG_KEY_PREFIX}{self._cluster}/{node}"
        retried: tuple[type[BaseException], ...] = (*self._errors, OSError, RegistryError)
        try:
            self._adopt()
        except retried:
            pass  # retried at the first allocate

    @property
    def key(self) -> str:
        """How the host's uid ledger and layer pins name this registry: its file's resolved path,
        or ``pg:<cluster id>/<node>`` for a PostgreSQL one (never its URL)."""
        return self._key

    @property
    def shared(self) -> bool:
        """Whether the registry is a PostgreSQL database (shared by a cluster's nodes)."""
        return isinstance(self._sql, PostgresDialect)

    @property
    def dialect(self) -> SqliteDialect | PostgresDialect:
        assert isinstance(self._sql, (SqliteDialect, PostgresDialect))
        return self._sql

    def _adopt(self) -> None:
        """Record in the host ledger the slots this home's sandboxes from before it hold."""
        rows = self._db.execute(
            f"SELECT sandbox_id, uid_slot FROM sandboxes WHERE state IN {_in(_HOLDING)} AND node=?",
            (*_HOLDING, self.node),
        ).fetchall()
        if any(self.ledger.holder(slot) is None for _, slot in rows):
            with self.ledger.locked() as ledger:
                for sid, slot in rows:
                    row = self._db.execute(
                        "SELECT state, uid_slot, state_dir FROM sandboxes WHERE sandbox_id=?", (sid,)
                    ).fetchone()
                    if row_holds(row, slot):  # still (a destroy may have released it meanwhile)
                        ledger.adopt(slot, self._key, sid, row[2])
        self._adopted = True

    def _holds(self, registry: str, sandbox_id: str, slot: int, db: Conn | None = None) -> bool | None:
        """Whether the registry ``registry`` (a ledger key) still counts ``slot`` as held by
        ``sandbox_id``; db: the caller's transaction, if any. Another node of this cluster (same
        host, same ledger) is answered from this same shared database."""
        if registry != self._key and not (self._cluster and registry.startswith(f"{PG_KEY_PREFIX}{self._cluster}/")):
            return registry_holds(registry, sandbox_id, slot)
        row = (
            (db or self._db)
            .execute("SELECT state, uid_slot, state_dir FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
            .fetchone()
        )
        return row_holds(row, slot)

    def _migrate(self) -> None:
        if isinstance(self._sql, PostgresDialect):
            self._sql.check_schema(schema_statements(), SCHEMA_VERSION, now=time.time())
            return
        assert isinstance(self._sql, SqliteDialect)
        db = self._sql.conn
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version >= SCHEMA_VERSION:
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            for stmt in _ADDED_COLUMNS:  # "ALTER TABLE t ADD COLUMN c ..."
                table, column = stmt.split()[2], stmt.split()[5]
                cols = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                if cols and column not in cols:
                    db.execute(stmt)
            for table, column, ddl in (
                ("pool_state", "events_seen", "INTEGER NOT NULL DEFAULT 0"),
                ("pool_state", "config_target", "INTEGER"),
            ):
                cols = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                if cols and column not in cols:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {ddl}")
            link_cols = {r[1] for r in db.execute("PRAGMA table_info(net_links)")}
            if link_cols and "node" not in link_cols:  # version 15: address unique per node, not globally
                db.execute("ALTER TABLE net_links RENAME TO net_links_old")
            for stmt in SCHEMA.split(";"):
                if stmt.strip():
                    db.execute(stmt)
            if link_cols and "node" not in link_cols:
                db.execute(
                    f"INSERT INTO net_links ({_NET_LINK_COLUMNS}) "
                    "SELECT sandbox_id, address, ifname, policy, updated_at, '' FROM net_links_old"
                )
                db.execute("DROP TABLE net_links_old")
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._sql.close()
        lease, self._lease = self._lease, None
        if lease is not None:
            os.close(lease)

    def _read(self, sql: str, args: tuple = (), *, many: bool = False) -> typing.Any:
        try:
            cur = self._db.execute(sql, args)
            return cur.fetchall() if many else cur.fetchone()
        except self._errors as e:
            raise RegistryError(f"registry read failed: {e}") from None

    def _tx(self, *locks: str) -> contextlib.AbstractContextManager[Conn]:
        """A write transaction; ``locks``: names of advisory locks it holds (PostgreSQL; SQLite's
        BEGIN IMMEDIATE already serializes every writer): "tenant:<name>" around a quota's check
        and the write it allows."""
        return self._sql.transaction(locks)

    def _pool_event(self, db: Conn, row: tuple[str, float, str, str, str]) -> None:
        """Append a pool event in the transaction ``db``. Its readers follow events by cursor: on
        SQLite by rowid (the one writer lock commits them in rowid order); on PostgreSQL by the
        transaction that wrote each (its ``xid`` column's default), up to the oldest one still
        running, so events need no cluster-wide lock (a row committed late under a lower rowid is
        still read, once)."""
        db.execute("INSERT INTO pool_events VALUES (?,?,?,?,?)", row)

    @contextlib.contextmanager
    def _claiming(self, *locks: str) -> Iterator[tuple[UidLedger, Conn]]:
        """The host-wide uid ledger's lock and a transaction for claiming a slot: the lock is held
        until the row is committed (whoever looks at the slot to reclaim it then sees the sandbox
        holding it); a ledger or database failure is a RegistryError."""
        try:
            if not self._adopted:
                self._adopt()
            with self.ledger.locked() as ledger, self._tx(*locks) as db:
                if self._lease is None and self.shared:  # held to close(): no claim of ours is judged gone
                    self._lease = ledger.lease(self._key)
                self._check_fence(db)
                yield ledger, db
        except OSError as e:
            raise RegistryError(f"cannot claim a uid range in {self.ledger.dir}: {e}") from None
        except self._errors as e:
            raise RegistryError(f"registry error: {e}") from None

    def _check_fence(self, db: Conn) -> None:
        """NodeFenced if this node may start no sandbox: its row says down, or another process
        joined under its name since this object's join_node. Read in the transaction that would
        write the sandbox (PostgreSQL: a share lock, so mark_node_down waits for it and then
        sees the row it wrote). One host (node ""), or a node that never joined: nothing to check."""
        if not self.node:
            return
        row = db.execute(
            "SELECT state, epoch FROM nodes WHERE name=?" + (" FOR SHARE" if self.shared else ""), (self.node,)
        ).fetchone()
        if row is None:
            return
        if row[0] == "down" or (self.epoch is not None and row[1] != self.epoch):
            why = "marked down" if row[0] == "down" else f"joined again (epoch {row[1]}, this process has {self.epoch})"
            raise NodeFenced(f"node {self.node!r} was {why}: it starts no sandbox", self.node)

    def _check_slots(self, states: builtins.list[str], spare: bool) -> None:
        """NoCapacity if this node has no slot for one more sandbox (its own bound, whoever placed
        the create: the router, or a caller with direct access). ``states``: those of the sandboxes
        holding a uid range here. A warm spare (``spare``) counts every one of them; a user's
        sandbox (a create or a resume) counts all but the pool's spares: the pool shrinks to make
        room, as the router's placement assumes. One host, or a node that never joined: no bound."""
        if not self.node or self.slots <= 0:
            return
        held = len(states) if spare else sum(1 for s in states if s not in _SPARE)
        if held >= self.slots:
            what = "sandboxes" if spare else "sandboxes besides its warm spares"
            raise NoCapacity(
                f"node {self.node!r} has no free slot: {held} {what} hold its {self.slots} (nothing was created)",
                (f"{self.node}: {held} of {self.slots} slots taken",),
            )

    # ---- sandboxes

    @_retried
    def allocate(
        self,
        sandbox_id: str,
        tier: str,
        template: str,
        timeout_s: float,
        limits: Limits,
        state_dir: str,
        socket_path: str,
        *,
        pool: str = "",
        owner: str = "",
        shape: str = "",
        tenant: Tenant | None = None,
        template_version: int = 0,
        image_id: str = "",
    ) -> int:
        """Insert a sandbox in state ``creating`` with a uid slot free on the whole host; returns the slot.

        The slot is claimed in the host-wide ledger (no other home's sandbox can have it) and
        released when the sandbox is destroyed. Limits are checked (check_limits) first.
        tenant: whose it is; its quotas are checked in the transaction that inserts the row
        (QuotaExceeded: no row, no slot).
        """
        if self.check_limits is not None:
            self.check_limits(limits)
        now = time.time()
        with self._claiming(*_tenant_lock(tenant)) as (ledger, db):
            if tenant is not None:
                self._check_quota(db, tenant, tier, limits.memory_mb, limits.cpus)
            held = db.execute(
                f"SELECT uid_slot, state FROM sandboxes WHERE state IN {_in(_HOLDING)} AND node=?",
                (*_HOLDING, self.node),
            ).fetchall()
            self._check_slots([r[1] for r in held], spare=bool(pool))
            used = {r[0] for r in held}
            slot = ledger.claim(
                self._key, sandbox_id, skip=used, check=functools.partial(self._holds, db=db), state_dir=state_dir
            )
            try:
                db.execute(
                    "INSERT INTO sandboxes (sandbox_id, tier, template, state, created_at, expires_at, "
                    "memory_mb, cpus, pids, uid_slot, runtime_id, state_dir, socket_path, pool, owner, shape, "
                    "file_size_mb, open_files, tmp_mb, disk_mb, tenant, timeout_s, last_used, template_version, "
                    "image_id, node) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        sandbox_id,
                        tier,
                        template,
                        State.CREATING.value,
                        now,
                        now + timeout_s,
                        limits.memory_mb,
                        limits.cpus,
                        limits.pids,
                        slot,
                        sandbox_id,
                        state_dir,
                        socket_path,
                        pool,
                        owner,
                        shape,
                        limits.file_size_mb,
                        limits.open_files,
                        limits.tmp_mb,
                        limits.disk_mb,
                        tenant.name if tenant is not None else "",
                        timeout_s,
                        now,
                        template_version,
                        image_id,
                        self.node,
                    ),
                )
                db.execute(
                    "INSERT INTO transitions VALUES (?,?,?,?,?)",
                    (sandbox_id, now, "", State.CREATING.value, "create" + (f" for pool {pool}" if pool else "")),
                )
                db.execute("INSERT INTO meters (sandbox_id, sampled_at) VALUES (?,?)", (sandbox_id, now))
            except BaseException:
                ledger.release(slot, self._key, sandbox_id)
                raise
        return slot

    @_retried
    def reallocate(
        self,
        sandbox_id: str,
        timeout_s: float,
        limits: Limits,
        *,
        owner: str = "",
        tenant: Tenant | None = None,
        state_dir: str | None = None,
        socket_path: str | None = None,
    ) -> int:
        """Take a paused sandbox back to ``creating`` under its own id (a resume): a uid slot free
        on the whole host, a new deadline, its meters open again; returns the slot. It becomes
        this registry's node's (a sandbox paused on one node resumes on any), with the state
        directory and agent socket given (the resuming node's; None: the ones it had).

        Exactly one caller wins (SandboxStateError for the others: it is no longer paused).
        limits: the snapshot's, checked (check_limits) first, as at an allocate: maxima lowered
        since the pause refuse it. tenant: the resumer's; quotas are checked in the same
        transaction (a paused sandbox holds nothing, the resumed one counts).
        """
        if self.check_limits is not None:
            self.check_limits(limits)
        now = time.time()
        with self._claiming(*_tenant_lock(tenant)) as (ledger, db):
            row = db.execute(
                "SELECT state, tier, memory_mb, cpus, uid_slot, state_dir FROM sandboxes WHERE sandbox_id=?"
                + self._sql.for_update(),
                (sandbox_id,),
            ).fetchone()
            if row is None:
                raise unknown_sandbox(sandbox_id)
            if row[0] != State.PAUSED.value:
                raise SandboxStateError(f"sandbox {sandbox_id} is {row[0]}, not paused", sandbox_id)
            if tenant is not None:
                self._check_quota(db, tenant, row[1], row[2], row[3])
            ledger.release(row[4], self._key, sandbox_id)  # its old range (released by its pause)
            held = db.execute(
                f"SELECT uid_slot, state FROM sandboxes WHERE state IN {_in(_HOLDING)} AND node=?",
                (*_HOLDING, self.node),
            ).fetchall()
            self._check_slots([r[1] for r in held], spare=False)
            used = {r[0] for r in held}
            slot = ledger.claim(
                self._key,
                sandbox_id,
                skip=used,
                check=functools.partial(self._holds, db=db),
                state_dir=row[5] if state_dir is None else state_dir,
            )
            try:
                db.execute(
                    "UPDATE sandboxes SET state=?, uid_slot=?, expires_at=?, owner=?, ended_at=0, "
                    "timeout_s=?, last_used=?, node=? WHERE sandbox_id=?",
                    (State.CREATING.value, slot, now + timeout_s, owner, timeout_s, now, self.node, sandbox_id),
                )
                if state_dir is not None or socket_path is not None:
                    db.execute(
                        "UPDATE sandboxes SET state_dir=COALESCE(?, state_dir), socket_path=COALESCE(?, socket_path) "
                        "WHERE sandbox_id=?",
                        (state_dir, socket_path, sandbox_id),
                    )
                db.execute(
                    "INSERT INTO transitions VALUES (?,?,?,?,?)",
                    (sandbox_id, now, State.PAUSED.value, State.CREATING.value, RESUMING),
                )
                # the meters go on: a new runtime's CPU counter starts at 0 again
                db.execute(
                    "UPDATE meters SET final=0, memory_bytes=0, sampled_at=?, "
                    "base_cpu_ns=base_cpu_ns-cpu_ns, cpu_ns=0 WHERE sandbox_id=?",
                    (now, sandbox_id),
                )
            except BaseException:
                ledger.release(slot, self._key, sandbox_id)
                raise
        return slot

    @_retried
    def set_metadata(self, sandbox_id: str, metadata: dict[str, str]) -> None:
        """A sandbox's metadata (checked by the engine: string keys and values, bounded)."""
        with self._tx() as db:
            db.execute(
                "UPDATE sandboxes SET metadata=? WHERE sandbox_id=?",
                (json.dumps(metadata, sort_keys=True, ensure_ascii=False), sandbox_id),
            )

    @_retried
    def set_tier_choice(self, sandbox_id: str, requirements: Requirements, choice: TierChoice) -> None:
        """What a tier="auto" create asked and why its tier was chosen (shown by get_info)."""
        with self._tx() as db:
            db.execute(
                "UPDATE sandboxes SET requirements=?, tier_reasons=?, tier_rejected=? WHERE sandbox_id=?",
                (
                    json.dumps(dataclasses.asdict(requirements), sort_keys=True),
                    json.dumps(list(choice.reasons), ensure_ascii=False),
                    json.dumps(choice.rejected, sort_keys=True, ensure_ascii=False),
                    sandbox_id,
                ),
            )

    @_retried
    def set_lifecycle(self, sandbox_id: str, lifecycle: Lifecycle) -> None:
        """A sandbox's lifecycle policy (checked by the engine: models.validate_lifecycle)."""
        with self._tx() as db:
            db.execute(
                "UPDATE sandboxes SET on_timeout=?, idle_pause_after=?, auto_resume=?, last_used=? WHERE sandbox_id=?",
                (
                    lifecycle.on_timeout,
                    lifecycle.idle_pause_after or 0.0,
                    int(lifecycle.auto_resume),
                    time.time(),
                    sandbox_id,
                ),
            )

    @_retried
    def touch(self, sandbox_id: str, until: float) -> None:
        """The sandbox is used until ``until`` (unix seconds): its idle time counts from then."""
        with self._tx() as db:
            db.execute("UPDATE sandboxes SET last_used=? WHERE sandbox_id=?", (until, sandbox_id))

    def lifecycle_due(self, now: float, retention_s: float) -> tuple[builtins.list[str], builtins.list[str]]:
        """What the lifecycle duties owe now: ([sandbox_id] idle past their idle_pause_after, to
        pause; [sandbox_id] paused longer than ``retention_s``, to delete). Timeouts are the reaper's."""
        usable = (State.READY.value, State.RUNNING.value)
        rows = self._read(
            f"SELECT sandbox_id FROM sandboxes WHERE state IN {_in(usable)} AND idle_pause_after>0 "
            "AND last_used+idle_pause_after<=? AND expires_at>? AND node=? ORDER BY created_at",
            (*usable, now, now, self.node),
            many=True,
        )
        old = self._read(
            f"SELECT sandbox_id FROM sandboxes WHERE state=? AND ended_at>0 AND ended_at+?<=? AND {_PAUSED_HERE} "
            "ORDER BY ended_at",
            (State.PAUSED.value, retention_s, now, self.node),
            many=True,
        )
        return [r[0] for r in rows], [r[0] for r in old]

    def next_lifecycle_deadline(self, retention_s: float) -> float | None:
        """The earliest moment a lifecycle duty falls due (an idle pause, a paused sandbox's end)."""
        usable = (State.READY.value, State.RUNNING.value)
        idle = self._read(
            "SELECT MIN(last_used+idle_pause_after) FROM sandboxes "
            f"WHERE state IN {_in(usable)} AND idle_pause_after>0 AND node=?",
            (*usable, self.node),
        )
        paused = self._read(
            f"SELECT MIN(ended_at+?) FROM sandboxes WHERE state=? AND ended_at>0 AND {_PAUSED_HERE}",
            (retention_s, State.PAUSED.value, self.node),
        )
        found = [v for v in (idle[0] if idle else None, paused[0] if paused else None) if v is not None]
        return min(found) if found else None

    def owner_of(self, sandbox_id: str) -> str:
        """The tag of the process working on a sandbox ("" when none: a paused one is released)."""
        row = self._read("SELECT owner FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
        return row[0] if row else ""

    @_retried
    def released(self, sandbox_id: str, owner: str) -> None:
        """The pause ``owner`` recorded has released everything: a resume may begin."""
        with self._tx() as db:
            db.execute(
                "UPDATE sandboxes SET owner='' WHERE sandbox_id=? AND state=? AND owner=?",
                (sandbox_id, State.PAUSED.value, owner),
            )

    def timeout_of(self, sandbox_id: str) -> float:
        """The lifetime a sandbox was last given (at its start, its claim from a pool, a set_timeout or
        a resume given one); 0: unknown, a row from before version 7."""
        row = self._read("SELECT timeout_s FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
        return float(row[0]) if row else 0.0

    def ended_reason(self, sandbox_id: str) -> str:
        """The reason of a sandbox's last transition (why a destroyed one ended)."""
        row = self._read("SELECT reason FROM transitions WHERE sandbox_id=? ORDER BY rowid DESC LIMIT 1", (sandbox_id,))
        return row[0] if row else ""

    def egress_of(self, sandbox_id: str) -> str:
        """A paused sandbox's egress, kept for its resume (JSON: policy and secret placeholders)."""
        row = self._read("SELECT egress FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
        return row[0] if row else ""

    @_retried
    def set_egress(self, sandbox_id: str, egress: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE sandboxes SET egress=? WHERE sandbox_id=?", (egress, sandbox_id))

    def _release(self, sandbox_id: str, slot: int) -> None:
        try:
            with self.ledger.locked() as ledger:
                ledger.release(slot, self._key, sandbox_id)
        except OSError:
            pass  # left for a reclaim: the registry says it no longer holds the slot

    @_retried
    def set_state(
        self, sandbox_id: str, new: State, reason: str, *, expected: State | None = None, owner: str | None = None
    ) -> State:
        """Record a transition; returns the previous state. Illegal transitions raise.

        expected: only move if the current state is this one (else SandboxStateError).
        """
        with self._tx() as db:
            row = db.execute(
                "SELECT state, uid_slot FROM sandboxes WHERE sandbox_id=?" + self._sql.for_update(), (sandbox_id,)
            ).fetchone()
            if row is None:
                raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox_id)
            old = State(row[0])
            if expected is not None and old is not expected:
                raise SandboxStateError(f"sandbox {sandbox_id} is {old.value}, not {expected.value}", sandbox_id)
            if old is new:
                return old
            check_transition(old, new, sandbox_id)
            now = time.time()
            db.execute(
                "UPDATE sandboxes SET state=?, ended_at=? WHERE sandbox_id=?",
                (new.value, now if new in (State.DESTROYED, State.PAUSED) else 0, sandbox_id),
            )
            if owner is not None:
                db.execute("UPDATE sandboxes SET owner=? WHERE sandbox_id=?", (owner, sandbox_id))
            db.execute("INSERT INTO transitions VALUES (?,?,?,?,?)", (sandbox_id, now, old.value, new.value, reason))
            if new in (State.DESTROYED, State.FAILED):  # a sandbox's command keys end with it (a create's stay)
                db.execute("DELETE FROM idempotency_keys WHERE scope=?", (sandbox_id,))
        if new is State.DESTROYED:  # committed: its uid range is free for any home
            self._release(sandbox_id, row[1])
        return old

    @_retried
    def set_expiry(self, sandbox_id: str, expires_at: float, timeout_s: float | None = None) -> None:
        """A new deadline; ``timeout_s``: also the lifetime a resume gives it from now on."""
        with self._tx() as db:
            if timeout_s is None:
                db.execute("UPDATE sandboxes SET expires_at=? WHERE sandbox_id=?", (expires_at, sandbox_id))
            else:
                db.execute(
                    "UPDATE sandboxes SET expires_at=?, timeout_s=? WHERE sandbox_id=?",
                    (expires_at, timeout_s, sandbox_id),
                )

    @_retried
    def claim(
        self,
        pool: str,
        shape: str,
        timeout_s: float,
        owner: str,
        tenant: Tenant | None = None,
    ) -> tuple[SandboxInfo, BackendHandle] | None:
        """Atomically hand the oldest pooled sandbox of ``pool`` built to ``shape`` to one caller.

        None (and a recorded miss) if there is none. This transaction is the only way from the
        pool to a caller, so two callers can never receive the same sandbox. tenant: the caller's;
        the claim stamps it, after its quotas are checked in the same transaction (QuotaExceeded:
        the sandbox stays in the pool).
        """
        now = time.time()
        with self._tx(*_tenant_lock(tenant)) as db:
            self._check_fence(db)
            # SKIP LOCKED (PostgreSQL): concurrent claims take different rows instead of queueing
            row = db.execute(
                "SELECT sandbox_id FROM sandboxes WHERE pool=? AND shape=? AND state=? AND expires_at>? AND node=? "
                "ORDER BY created_at LIMIT 1" + self._sql.for_update(skip_locked=True),
                (pool, shape, State.POOLED.value, now + 1, self.node),
            ).fetchone()
            db.execute("UPDATE pool_state SET last_demand_at=? WHERE name=?", (now, pool))
            if row is None:
                self._pool_event(db, (pool, now, "miss", "", ""))
                return None
            sid = row[0]
            if tenant is not None:
                tier, mem, cpus = db.execute(
                    "SELECT tier, memory_mb, cpus FROM sandboxes WHERE sandbox_id=?", (sid,)
                ).fetchone()
                self._check_quota(db, tenant, tier, mem, cpus)
            db.execute(
                # its timeout becomes the caller's (it had the pool's max_age): a resume renews that one
                "UPDATE sandboxes SET state=?, claimed_at=?, expires_at=?, timeout_s=?, owner=?, tenant=? "
                "WHERE sandbox_id=?",
                (State.READY.value, now, now + timeout_s, timeout_s, owner, tenant.name if tenant else "", sid),
            )
            db.execute(
                "INSERT INTO transitions VALUES (?,?,?,?,?)",
                (sid, now, State.POOLED.value, State.READY.value, f"claimed from pool {pool}"),
            )
            # What it cost so far is the pool's: the meter, brought up to now from its last
            # reading (an idle pooled sandbox's memory is flat, its CPU ~0), becomes the
            # user's zero, and the pool is billed for it.
            m = db.execute(
                "SELECT cpu_ns, gib_s, busy_ms, commands, memory_bytes, sampled_at FROM meters WHERE sandbox_id=?",
                (sid,),
            ).fetchone()
            if m is not None:
                gib_s = m[1] + m[4] / GIB * max(0.0, now - m[5])
                # the meters row before the usage row, as sample() takes them (no lock-order cycle)
                db.execute(
                    "UPDATE meters SET base_cpu_ns=?, base_gib_s=?, base_busy_ms=?, base_commands=?, "
                    "busy_ms=0, commands=0, gib_s=?, sampled_at=? WHERE sandbox_id=?",
                    (m[0], gib_s, m[2], m[3], gib_s, now, sid),
                )
                _add_usage(db, "", now, 0.0, gib_s - m[1])  # the pool's, as a reading now would have
                created = db.execute("SELECT created_at FROM sandboxes WHERE sandbox_id=?", (sid,)).fetchone()[0]
                db.execute(
                    self._sql.upsert("pool_costs", _POOL_COST_COLUMNS, ("sandbox_id",)),
                    (pool, sid, m[0] / 1e9, gib_s, max(0.0, now - created)),
                )
            r = db.execute(f"SELECT {_COLUMNS} FROM sandboxes WHERE sandbox_id=?", (sid,)).fetchone()
            self._pool_event(db, (pool, now, "hit", sid, ""))
        return self._row(r)

    @_retried
    def retire(self, pool: str, owner: str, *, keep_shape: str | None = None, limit: int | None = None) -> list[str]:
        """Atomically move pooled sandboxes of ``pool`` to ``retiring`` (never connectable again).

        keep_shape: only those built to another shape (stale after a config change).
        limit: at most this many, oldest first. Returns their ids; the caller destroys them.
        """
        now = time.time()
        probe = "SELECT 1 FROM sandboxes WHERE pool=? AND state=? AND node=?" + (
            " AND shape<>?" if keep_shape is not None else ""
        )
        if (
            self._db.execute(
                probe, (pool, State.POOLED.value, self.node, *(() if keep_shape is None else (keep_shape,)))
            ).fetchone()
            is None
        ):
            return []  # the common case, without a write transaction
        with self._tx() as db:
            q = "SELECT sandbox_id FROM sandboxes WHERE pool=? AND state=? AND node=?"
            args: list = [pool, State.POOLED.value, self.node]
            if keep_shape is not None:
                q += " AND shape<>?"
                args.append(keep_shape)
            q += " ORDER BY created_at"
            if limit is not None:
                q += " LIMIT ?"
                args.append(limit)
            # SKIP LOCKED (PostgreSQL): a row a claim holds right now is not retired (it is leaving)
            ids = [r[0] for r in db.execute(q + self._sql.for_update(skip_locked=True), args).fetchall()]
            for sid in ids:
                db.execute(
                    "UPDATE sandboxes SET state=?, owner=? WHERE sandbox_id=?", (State.RETIRING.value, owner, sid)
                )
                db.execute(
                    "INSERT INTO transitions VALUES (?,?,?,?,?)",
                    (sid, now, State.POOLED.value, State.RETIRING.value, f"retired from pool {pool}"),
                )
            for sid in ids:
                self._pool_event(db, (pool, now, "retired", sid, ""))
        return ids

    def get(self, sandbox_id: str) -> tuple[SandboxInfo, BackendHandle]:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM sandboxes WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        if row is None:
            raise unknown_sandbox(sandbox_id)
        return self._row(row)

    def sandbox_tenant(self, sandbox_id: str) -> str | None:
        """The tenant a sandbox belongs to ("": the host's, or a pool's until claimed); None if unknown."""
        row = self._read("SELECT tenant FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
        return None if row is None else row[0]

    # From here on `list` in the class body is this method: later signatures spell builtins.list.
    def list(
        self,
        include_dead: bool = False,
        *,
        include_pooled: bool = False,
        tenant: str | None = None,
        states: tuple[State, ...] | None = None,
        metadata: dict[str, str] | None = None,
        local: bool = False,
    ) -> list[tuple[SandboxInfo, BackendHandle]]:
        """tenant: only that tenant's sandboxes (None: everyone's). states: only these (instead of
        the live ones, or all with include_dead). metadata: only those whose metadata holds every
        one of these pairs. local: only this node's (else every node's)."""
        where: builtins.list[str] = []
        args: builtins.list[object] = []
        if local:
            where.append("node=?")
            args.append(self.node)
        if states is not None:
            values = tuple(s.value for s in states)
            where.append(f"state IN {_in(values)}" if values else "1=0")
            args.extend(values)
        elif not include_dead:
            live = _LIVE if include_pooled else _USER
            where.append(f"state IN {_in(live)}")
            args.extend(live)
        if tenant is not None:
            where.append("tenant=?")
            args.append(tenant)
        q = f"SELECT {_COLUMNS} FROM sandboxes" + (" WHERE " + " AND ".join(where) if where else "")
        rows = self._db.execute(q + " ORDER BY created_at", args).fetchall()
        out = [self._row(r) for r in rows]
        if metadata:
            want = metadata.items()
            out = [(i, h) for i, h in out if want <= i.metadata.items()]
        return out

    def holding(self) -> builtins.list[tuple[SandboxInfo, BackendHandle]]:
        """This node's live sandboxes (pooled too) plus failed ones whose teardown is still owed."""
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM sandboxes WHERE state IN {_in(_HOLDING)} AND node=? ORDER BY created_at",
            (*_HOLDING, self.node),
        ).fetchall()
        return [self._row(r) for r in rows]

    def paused_with_owner(self) -> builtins.list[tuple[str, str]]:
        """This node's paused sandboxes, with the tag of the process still releasing each ("": none)."""
        rows = self._read(
            "SELECT sandbox_id, owner FROM sandboxes WHERE state=? AND node=?",
            (State.PAUSED.value, self.node),
            many=True,
        )
        return [(r[0], r[1]) for r in rows]

    def creating_with_owner(self) -> builtins.list[tuple[str, str]]:
        """This node's sandboxes some process is creating or retiring right now, with that process's tag."""
        rows = self._db.execute(
            "SELECT sandbox_id, owner FROM sandboxes WHERE state IN (?,?) AND node=?",
            (State.CREATING.value, State.RETIRING.value, self.node),
        ).fetchall()
        return [(r[0], r[1]) for r in rows]

    @staticmethod
    def _row(r: tuple) -> tuple[SandboxInfo, BackendHandle]:
        (
            sid,
            tier,
            template,
            state,
            created,
            expires,
            mem,
            cpus,
            pids,
            slot,
            runtime_id,
            state_dir,
            socket_path,
            pool,
            claimed_at,
            parent,
            metadata,
            on_timeout,
            idle_pause_after,
            auto_resume,
            template_version,
            image_id,
            requirements,
            tier_reasons,
            tier_rejected,
            tenant,
            node,
        ) = r
        info = SandboxInfo(
            sandbox_id=sid,
            tier=tier,
            state=State(state),
            created_at=created,
            expires_at=expires,
            memory_mb=mem,
            cpus=cpus,
            pids=pids,
            template=template,
            pool=pool,
            claimed_at=claimed_at,
            parent_snapshot=parent or "",
            metadata=_metadata(metadata),
            lifecycle=Lifecycle(
                on_timeout="pause" if on_timeout == "pause" else "kill",
                idle_pause_after=idle_pause_after if idle_pause_after and idle_pause_after > 0 else None,
                auto_resume=bool(auto_resume),
            ),
            template_version=template_version or 0,
            image_id=image_id or "",
            requirements=_requirements(requirements),
            tier_reasons=_strings(tier_reasons),
            tier_rejected=_metadata(tier_rejected),
            tenant=tenant or "",
        )
        handle = BackendHandle(
            sandbox_id=sid,
            tier=tier,
            runtime_id=runtime_id,
            state_dir=state_dir,
            socket_path=socket_path,
            uid_base=UID_BASE + slot * UID_RANGE,
            node=node,
        )
        return info, handle

    def limits(self, sandbox_id: str) -> Limits:
        row = self._read(
            "SELECT memory_mb, cpus, pids, file_size_mb, open_files, tmp_mb, disk_mb FROM sandboxes WHERE sandbox_id=?",
            (sandbox_id,),
        )
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox_id)
        return Limits(*row)

    def meta_text(self, key: str) -> str:
        row = self._read("SELECT value FROM meta_text WHERE key=?", (key,))
        return row[0] if row else ""

    @_retried
    def set_meta_text(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute(self._sql.upsert("meta_text", ("key", "value"), ("key",)), (key, value))

    @_retried
    def add_meta_text(self, key: str, value: str) -> None:
        """Set ``key`` only if it has no value yet (two processes racing keep the first's)."""
        with self._tx() as db:
            db.execute(self._sql.upsert("meta_text", ("key", "value"), ("key",), update=()), (key, value))

    # ---- nodes (a cluster: every node and the API tier share this registry)

    @_retried
    def join_node(self, info: NodeInfo) -> int:
        """Record ``info.name`` as up with what it offers (its epoch, joined_at, heartbeat_at,
        pooled and live as given are ignored); returns its new epoch, one past any it had: a
        process of its previous life heartbeating with the old epoch is fenced."""
        _node_name(info.name)
        now = time.time()
        with self._tx(f"node:{info.name}") as db:  # two joins of one name: two epochs
            row = db.execute("SELECT epoch FROM nodes WHERE name=?", (info.name,)).fetchone()
            epoch = (row[0] if row else 0) + 1
            db.execute(
                f"INSERT INTO nodes ({_NODE_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,0,0) ON CONFLICT (name) DO UPDATE "
                "SET address=excluded.address, ray_node_id=excluded.ray_node_id, epoch=excluded.epoch, "
                "state=excluded.state, slots=excluded.slots, memory_mb=excluded.memory_mb, tiers=excluded.tiers, "
                "joined_at=excluded.joined_at, heartbeat_at=excluded.heartbeat_at, pooled=0, live=0",
                (
                    info.name,
                    info.address,
                    info.ray_node_id,
                    epoch,
                    "up",
                    max(0, int(info.slots)),
                    max(0, int(info.memory_mb)),
                    ",".join(info.tiers),
                    now,
                    now,
                ),
            )
        if info.name == self.node:
            self.epoch = epoch  # what this process's starts are checked against (_check_fence)
            self.slots = max(0, int(info.slots))  # and the bound they are held to (_check_slots)
        return epoch

    @_retried
    def heartbeat(self, name: str, epoch: int, live: int, pooled: int) -> bool:
        """A node says it is alive, with its live and pooled sandbox counts. False: it is fenced
        (marked down, or rejoined under a newer epoch): that process must stop serving and exit."""
        with self._tx() as db:
            n = db.execute(
                "UPDATE nodes SET heartbeat_at=?, live=?, pooled=? WHERE name=? AND epoch=? AND state<>'down'",
                (time.time(), max(0, int(live)), max(0, int(pooled)), name, epoch),
            ).rowcount
        return n == 1

    def nodes(self) -> builtins.list[NodeInfo]:
        """Every node that ever joined (down ones too), by name."""
        rows = self._read(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY name", many=True)
        return [
            NodeInfo(r[0], r[1], r[2], r[3], r[4], r[5], r[6], _split(r[7]), r[8], r[9], r[10], r[11]) for r in rows
        ]

    def local_counts(self) -> tuple[int, int]:
        """This node's (live sandboxes: creating, retiring, ready, running; pooled ones)."""
        busy = (State.CREATING.value, State.RETIRING.value, State.READY.value, State.RUNNING.value)
        live = self._read(f"SELECT COUNT(*) FROM sandboxes WHERE node=? AND state IN {_in(busy)}", (self.node, *busy))
        pooled = self._read("SELECT COUNT(*) FROM sandboxes WHERE node=? AND state=?", (self.node, State.POOLED.value))
        return int(live[0]), int(pooled[0])

    def node_usage(self) -> builtins.list[NodeUsage]:
        """Per node with any: its live sandboxes, their memory, its pooled ones by pool (by name)."""
        busy = (State.CREATING.value, State.RETIRING.value, State.READY.value, State.RUNNING.value)
        rows = self._read(
            f"SELECT node, COUNT(*), COALESCE(SUM(memory_mb),0) FROM sandboxes WHERE state IN {_in(busy)} "
            "GROUP BY node",
            busy,
            many=True,
        )
        pools = self._read(
            "SELECT node, pool, COUNT(*), COALESCE(SUM(memory_mb),0) FROM sandboxes WHERE state=? "
            "GROUP BY node, pool ORDER BY node, pool",
            (State.POOLED.value,),
            many=True,
        )
        live = {r[0]: (int(r[1]), int(r[2])) for r in rows}
        pooled: dict[str, builtins.list[tuple[str, int]]] = {}
        pooled_mb: dict[str, int] = {}
        for node, pool, n, mb in pools:
            pooled.setdefault(node, []).append((pool, int(n)))
            pooled_mb[node] = pooled_mb.get(node, 0) + int(mb)
        return [
            NodeUsage(node, *live.get(node, (0, 0)), tuple(pooled.get(node, ())), pooled_mb.get(node, 0))
            for node in sorted(set(live) | set(pooled))
        ]

    def pool_shapes(self) -> builtins.list[tuple[str, str, str, Limits]]:
        """(pool, tier, template, limits) of each pool some node holds a ready sandbox of: what a
        cluster's router knows of the nodes' pools (it has no ``[pools]`` of its own)."""
        rows = self._read(
            "SELECT DISTINCT pool, tier, template, memory_mb, cpus, pids, file_size_mb, open_files, tmp_mb, disk_mb "
            "FROM sandboxes WHERE state=? AND pool<>''",
            (State.POOLED.value,),
            many=True,
        )
        return [
            (r[0], r[1], r[2], Limits(int(r[3]), float(r[4]), int(r[5]), int(r[6]), int(r[7]), int(r[8]), int(r[9])))
            for r in rows
        ]

    def node_of(self, sandbox_id: str) -> str:
        """The node that owns a sandbox ("" = one host); SandboxNotFound if there is no such row."""
        row = self._read("SELECT node FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
        if row is None:
            raise unknown_sandbox(sandbox_id)
        return row[0]

    @_retried
    def set_node_state(self, name: str, state: str) -> None:
        """Set a node up or draining (a draining node takes no new sandboxes). "down" is
        :meth:`mark_node_down`: no live sandbox stays on a node that is down."""
        if state not in NODE_STATES:
            raise InvalidArgument(f"a node state is one of {', '.join(NODE_STATES)}, got {state!r}")
        if state == "down":
            self.mark_node_down(name, "set down")
            return
        with self._tx() as db:
            if db.execute("UPDATE nodes SET state=? WHERE name=?", (state, name)).rowcount != 1:
                raise InvalidArgument(f"no node {name!r}")

    @_retried
    def mark_node_down(self, name: str, reason: str, *, epoch: int | None = None) -> builtins.list[str]:
        """Node ``name`` is gone (Ray lost it, its heartbeat stopped, it left): its epoch is bumped
        (its process, if it still runs, is fenced: it starts no sandbox, and its next heartbeat
        says so), its creating, pooled, retiring, ready and running sandboxes become ``lost`` with
        ``reason``; returns their ids. Its paused sandboxes stay paused (their snapshots are in
        the shared store): any node resumes them. A node that never joined gets a row, down.
        epoch: the epoch the caller judged dead: if the node is down already or has joined again
        since (another epoch), nothing changes and [] is returned (a stale verdict, or a second
        monitor marking the same death)."""
        _node_name(name)
        reason = f"node {name} down: {reason}"[:_MAX_APPROVAL_TEXT]
        now = time.time()
        with self._tx() as db:
            if epoch is not None:
                row = db.execute(
                    "SELECT state, epoch FROM nodes WHERE name=?" + self._sql.for_update(), (name,)
                ).fetchone()
                if row is None or row[0] == "down" or row[1] != epoch:
                    return []
            db.execute(
                "INSERT INTO nodes (name, epoch, state) VALUES (?,1,'down') ON CONFLICT (name) DO UPDATE "
                "SET epoch=nodes.epoch+1, state='down'",
                (name,),
            )
            rows = db.execute(
                f"SELECT sandbox_id, state FROM sandboxes WHERE node=? AND state IN {_in(_LOSABLE)} "
                "ORDER BY created_at" + self._sql.for_update(),  # no state change slips in meanwhile
                (name, *_LOSABLE),
            ).fetchall()
            for sid, old in rows:
                db.execute(
                    "UPDATE sandboxes SET state=?, ended_at=?, owner='' WHERE sandbox_id=?",
                    (State.LOST.value, now, sid),
                )
                db.execute("INSERT INTO transitions VALUES (?,?,?,?,?)", (sid, now, old, State.LOST.value, reason))
            # a pause its process did not finish releasing: that process is gone with the node
            db.execute(
                "UPDATE sandboxes SET owner='' WHERE node=? AND state=?",
                (name, State.PAUSED.value),
            )
        return [r[0] for r in rows]

    @_retried
    def mark_lost(self, sandbox_ids: builtins.list[str], reason: str) -> builtins.list[str]:
        """These sandboxes' runtime ended under them (on this host: the isolate host process that
        held them died): each still creating, pooled, retiring, ready or running becomes ``lost``
        with ``reason`` (every operation but kill then raises SandboxLost). Returns those changed."""
        reason = reason[:_MAX_APPROVAL_TEXT]
        now = time.time()
        changed = []
        with self._tx() as db:
            for sid in sandbox_ids:
                row = db.execute(
                    "SELECT state FROM sandboxes WHERE sandbox_id=?" + self._sql.for_update(), (sid,)
                ).fetchone()
                if row is None or row[0] not in _LOSABLE:
                    continue
                db.execute(
                    "UPDATE sandboxes SET state=?, ended_at=?, owner='' WHERE sandbox_id=?",
                    (State.LOST.value, now, sid),
                )
                db.execute("INSERT INTO transitions VALUES (?,?,?,?,?)", (sid, now, row[0], State.LOST.value, reason))
                changed.append(sid)
        return changed

    @_retried
    def claim_host_slot(self, holder: str) -> int:
        """A uid slot of the host-wide ledger for a process of this home that is no sandbox (the
        isolate tier's host of one tenant), recorded as ``holder``'s; returns the slot. While its
        process runs no one reclaims it (a process in its range); released by release_host_slot."""
        with self._claiming() as (ledger, db):
            used = {
                r[0]
                for r in db.execute(
                    f"SELECT uid_slot FROM sandboxes WHERE state IN {_in(_HOLDING)} AND node=?", (*_HOLDING, self.node)
                )
            }
            return ledger.claim(self._key, holder, skip=used, check=functools.partial(self._holds, db=db))

    def release_host_slot(self, holder: str, slot: int) -> None:
        """Give back a slot claim_host_slot took, if the ledger still records it as ``holder``'s."""
        try:
            with self.ledger.locked() as ledger:
                ledger.release(slot, self._key, holder)
        except OSError as e:
            raise RegistryError(f"cannot release a uid range in {self.ledger.dir}: {e}") from None

    @_retried
    def move(self, sandbox_id: str, node: str) -> None:
        """Give a paused sandbox to ``node`` (the one resuming it). SandboxStateError if it is
        not paused: a running sandbox's processes cannot move."""
        _node_name(node, empty=True)
        with self._tx() as db:
            row = db.execute(
                "SELECT state FROM sandboxes WHERE sandbox_id=?" + self._sql.for_update(), (sandbox_id,)
            ).fetchone()
            if row is None:
                raise unknown_sandbox(sandbox_id)
            if row[0] != State.PAUSED.value:
                raise SandboxStateError(f"sandbox {sandbox_id} is {row[0]}, not paused: it cannot move", sandbox_id)
            db.execute("UPDATE sandboxes SET node=? WHERE sandbox_id=?", (node, sandbox_id))

    # ---- snapshots

    @_retried
    def add_snapshot(self, snapshot_id: str, sandbox_id: str, created_at: float, size: int, runtime: str = "") -> None:
        """Record a snapshot; it belongs to its sandbox's tenant. runtime: what made its memory image
        ("runsc 0.0~20240729.0"; "" for a files-only snapshot)."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO snapshots (snapshot_id, sandbox_id, created_at, size_bytes, tenant, image_id, runtime) "
                "VALUES (?,?,?,?, COALESCE((SELECT tenant FROM sandboxes WHERE sandbox_id=?), ''), "
                "COALESCE((SELECT image_id FROM sandboxes WHERE sandbox_id=?), ''), ?)",
                (snapshot_id, sandbox_id, created_at, size, sandbox_id, sandbox_id, runtime),
            )

    def snapshot_runtime(self, snapshot_id: str) -> str | None:
        """The runtime recorded for a snapshot ("" : files only or recorded before version 19);
        None if the registry has no such snapshot."""
        row = self._read("SELECT runtime FROM snapshots WHERE snapshot_id=?", (snapshot_id,))
        return None if row is None else str(row[0])

    def template_users(
        self, template: str, version: int | None = None, tenant: str = ""
    ) -> tuple[builtins.list[str], builtins.list[str], builtins.list[str]]:
        """What uses ``template`` (of ``version``, or any): (ids of sandboxes not destroyed, names of
        pools holding some, ids of snapshots taken of its sandboxes), of one tenant ("": the host's)."""
        where = "s.template=? AND s.tenant=?"
        args: builtins.list[object] = [template, tenant]
        if version is not None:
            where += " AND s.template_version=?"
            args.append(version)
        live = self._read(
            f"SELECT s.sandbox_id, s.pool, s.state FROM sandboxes s WHERE {where} AND s.state<>? ORDER BY s.created_at",
            (*args, State.DESTROYED.value),
            many=True,
        )
        snaps = self._read(
            f"SELECT n.snapshot_id FROM snapshots n JOIN sandboxes s ON s.sandbox_id=n.sandbox_id WHERE {where} "
            "ORDER BY n.created_at",
            tuple(args),
            many=True,
        )
        pools = sorted({r[1] for r in live if r[1] and r[2] == State.POOLED.value})
        return [r[0] for r in live], pools, [r[0] for r in snaps]

    @_retried
    def mark_auto(self, snapshot_id: str) -> None:
        """The snapshot was made by an automatic pause (idle, timeout): internal to its sandbox."""
        with self._tx() as db:
            db.execute("UPDATE snapshots SET auto=1 WHERE snapshot_id=?", (snapshot_id,))

    def auto_snapshots_of(self, sandbox_id: str) -> builtins.list[str]:
        """The snapshots automatic pauses made of ``sandbox_id``, oldest first."""
        rows = self._read(
            "SELECT snapshot_id FROM snapshots WHERE sandbox_id=? AND auto=1 ORDER BY created_at",
            (sandbox_id,),
            many=True,
        )
        return [r[0] for r in rows]

    def snapshot_tenant(self, snapshot_id: str) -> str | None:
        """The tenant a snapshot belongs to; None if the registry has no such snapshot."""
        row = self._read("SELECT tenant FROM snapshots WHERE snapshot_id=?", (snapshot_id,))
        return None if row is None else row[0]

    def snapshot_sandbox(self, snapshot_id: str) -> str | None:
        """The sandbox a snapshot was taken of; None if the registry has no such snapshot (one
        read by the primary key: a router resolves a create's snapshot with it)."""
        row = self._read("SELECT sandbox_id FROM snapshots WHERE snapshot_id=?", (snapshot_id,))
        return None if row is None else row[0]

    def snapshot_records(self, sandbox_id: str) -> builtins.list[SnapshotRecord]:
        """The snapshots of ``sandbox_id`` the registry still holds, oldest first."""
        rows = self._read(
            "SELECT snapshot_id, sandbox_id, created_at, size_bytes, auto FROM snapshots WHERE sandbox_id=? "
            "ORDER BY created_at",
            (sandbox_id,),
            many=True,
        )
        return [SnapshotRecord(r[0], r[1], r[2], r[3], bool(r[4])) for r in rows]

    def snapshots_of(self, sandbox_id: str) -> builtins.list[str]:
        rows = self._read(
            "SELECT snapshot_id FROM snapshots WHERE sandbox_id=? ORDER BY created_at", (sandbox_id,), many=True
        )
        return [r[0] for r in rows]

    def all_snapshots(self, tenant: str | None = None) -> builtins.list[tuple[str, str, float, int]]:
        """(snapshot_id, sandbox_id, created_at, size_bytes), oldest first; tenant: only that tenant's."""
        q = "SELECT snapshot_id, sandbox_id, created_at, size_bytes FROM snapshots"
        rows = self._read(
            q + (" WHERE tenant=?" if tenant is not None else "") + " ORDER BY created_at",
            (tenant,) if tenant is not None else (),
            many=True,
        )
        return [tuple(r) for r in rows]

    @_retried
    def remove_snapshot(self, snapshot_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM snapshots WHERE snapshot_id=?", (snapshot_id,))

    @_retried
    def set_parent(self, sandbox_id: str, snapshot_id: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE sandboxes SET parent_snapshot=? WHERE sandbox_id=?", (snapshot_id, sandbox_id))

    def parent(self, sandbox_id: str) -> str:
        row = self._db.execute("SELECT parent_snapshot FROM sandboxes WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        return row[0] if row else ""

    # ---- templates

    @_retried
    def template_add(self, info: TemplateInfo) -> TemplateInfo:
        """Record a built template as the next version of its (tenant, name): the record returned
        has ``version`` = the last version ever given + 1 (``info.version`` is ignored; numbers are
        never reused, even after a removal). If the latest version has the same spec_hash and
        image_id, nothing is added and that version is returned."""
        _template_name(info.name)
        with self._tx(f"template:{info.tenant}/{info.name}") as db:  # two builds of one name: one version each
            row = db.execute(
                f"SELECT {_TEMPLATE_COLUMNS} FROM templates WHERE tenant=? AND name=? ORDER BY version DESC LIMIT 1",
                (info.tenant, info.name),
            ).fetchone()
            if row is not None:
                latest = _template(row)
                if latest.spec_hash == info.spec_hash and latest.image_id == info.image_id:
                    return latest
            last = db.execute(
                "SELECT last FROM template_versions WHERE tenant=? AND name=?", (info.tenant, info.name)
            ).fetchone()
            version = max(last[0] if last else 0, _template(row).version if row else 0) + 1
            out = dataclasses.replace(info, version=version)
            db.execute(f"INSERT INTO templates ({_TEMPLATE_COLUMNS}) VALUES ({','.join('?' * 16)})", _template_row(out))
            db.execute(
                self._sql.upsert("template_versions", ("tenant", "name", "last"), ("tenant", "name")),
                (info.tenant, info.name, version),
            )
        return out

    def template_get(self, name: str, version: int | None = None, tenant: str = "") -> TemplateInfo:
        """A template version (None: the latest) of the tenant's; TemplateNotFound if none."""
        if version is None:
            row = self._read(
                f"SELECT {_TEMPLATE_COLUMNS} FROM templates WHERE tenant=? AND name=? ORDER BY version DESC LIMIT 1",
                (tenant, name),
            )
        else:
            row = self._read(
                f"SELECT {_TEMPLATE_COLUMNS} FROM templates WHERE tenant=? AND name=? AND version=?",
                (tenant, name, version),
            )
        if row is None:
            which = f"{name!r}" if version is None else f"{name!r} version {version}"
            raise TemplateNotFound(f"no template {which}", template=name)
        return _template(row)

    def template_list(self, tenant: str | None = None) -> builtins.list[TemplateInfo]:
        """Every template version (tenant: only that tenant's), by tenant, name, then version."""
        q = f"SELECT {_TEMPLATE_COLUMNS} FROM templates"
        rows = self._read(
            q + (" WHERE tenant=?" if tenant is not None else "") + " ORDER BY tenant, name, version",
            (tenant,) if tenant is not None else (),
            many=True,
        )
        return [_template(r) for r in rows]

    @_retried
    def template_delete(self, name: str, version: int | None = None, tenant: str = "") -> builtins.list[TemplateInfo]:
        """Remove one version (None: every version) of a template; the records removed.
        TemplateNotFound if there was none. Whether something still uses it is the caller's check."""
        with self._tx() as db:
            where = "tenant=? AND name=?" + ("" if version is None else " AND version=?")
            args: tuple = (tenant, name) if version is None else (tenant, name, version)
            rows = db.execute(f"SELECT {_TEMPLATE_COLUMNS} FROM templates WHERE {where}", args).fetchall()
            db.execute(f"DELETE FROM templates WHERE {where}", args)
        if not rows:
            which = f"{name!r}" if version is None else f"{name!r} version {version}"
            raise TemplateNotFound(f"no template {which}", template=name)
        return [_template(r) for r in rows]

    def recorded_image_ids(self) -> set[str]:
        """Image ids sandboxes that are not destroyed (paused ones too) and snapshots recorded."""
        rows = self._read(
            "SELECT image_id FROM sandboxes WHERE state<>? UNION SELECT image_id FROM snapshots",
            (State.DESTROYED.value,),
            many=True,
        )
        return {r[0] for r in rows if r[0]}

    def build_step(self, tenant: str, key: str) -> str | None:
        """The layer digest ``tenant``'s build step ``key`` made (engine/builder.py), or None. Only
        that tenant's own rows are read: another tenant's step is never found."""
        _build_step_tenant(tenant)
        row = self._read("SELECT digest FROM build_steps WHERE tenant=? AND step_key=?", (tenant, key))
        return row[0] if row else None

    @_retried
    def record_build_step(self, tenant: str, key: str, digest: str) -> None:
        """Record that ``tenant``'s build step ``key`` made the layer ``digest`` (replacing any earlier)."""
        _build_step_tenant(tenant)
        if not isinstance(key, str) or not re.fullmatch(r"[0-9a-f]{64}", key):
            raise InvalidArgument(f"a build step key is 64 hex digits, got {str(key)[:80]!r}")
        if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise InvalidArgument(f"not a layer digest (sha256:<64 hex>): {str(digest)[:80]!r}")
        cols = ("tenant", "step_key", "digest", "created_at")
        try:
            with self._tx() as db:
                db.execute(
                    self._sql.upsert("build_steps", cols, ("tenant", "step_key")), (tenant, key, digest, time.time())
                )
        except self._errors as e:
            raise RegistryError(f"registry error: {e}") from None

    def template_layers(self) -> set[str]:
        """Every layer digest some template version (of any tenant) records: what layer gc keeps."""
        rows = self._read("SELECT layers FROM templates", many=True)
        out: set[str] = set()
        for (text,) in rows:
            out.update(_strings(text))
        return out

    # ---- tenants and API keys

    @_retried
    def create_key(
        self,
        tenant: str,
        *,
        admin: bool = False,
        max_sandboxes: int | None = None,
        max_memory_mb: int | None = None,
        max_cpus: float | None = None,
        tiers: tuple[str, ...] | builtins.list[str] | None = None,
        rate_per_s: float | None = None,
        budget_cpu_h: float | None = None,
        budget_gib_h: float | None = None,
    ) -> tuple[str, str]:
        """A new API key of ``tenant`` (made if new); returns (key_id, secret). Only the secret's
        SHA-256 is stored: the secret is shown to the caller once and never again. Quotas and
        budgets given (not None) replace the tenant's; the others stay (a new tenant: 0 =
        unlimited, every tier, no budget). budget_*: per UTC day, CPU-hours and GiB-hours."""
        if not isinstance(tenant, str) or not _TENANT_NAME.match(tenant):
            raise InvalidArgument(
                f"tenant must be 1-64 characters (letters, digits, '_', '.', '@', '-'; not starting with "
                f"a symbol), got {tenant!r}"
            )
        if not isinstance(admin, bool):
            raise InvalidArgument(f"admin must be True or False, got {admin!r}")
        updates: builtins.list[tuple[str, object]] = []
        quotas: tuple[tuple[str, object, bool], ...] = (
            ("max_sandboxes", max_sandboxes, True),
            ("max_memory_mb", max_memory_mb, True),
            ("max_cpus", max_cpus, False),
            ("rate_per_s", rate_per_s, False),
            ("budget_cpu_h", budget_cpu_h, False),
            ("budget_gib_h", budget_gib_h, False),
        )
        for col, value, integer in quotas:
            if value is not None:
                _quota(col, value, integer=integer)
                updates.append((col, value))
        if tiers is not None:
            updates.append(("tiers", _tiers(tiers)))
        key_id = "key-" + secrets.token_hex(6)
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        with self._tx() as db:
            db.execute(self._sql.upsert("tenants", ("name", "created_at"), ("name",), ()), (tenant, now))
            for col, value in updates:  # col: one of the fixed names above
                db.execute(f"UPDATE tenants SET {col}=? WHERE name=?", (value, tenant))
            db.execute(
                "INSERT INTO api_keys (key_id, tenant, secret_sha256, created_at, admin) VALUES (?,?,?,?,?)",
                (key_id, tenant, _secret_hash(secret), now, int(admin)),
            )
        return key_id, secret

    def list_keys(self) -> builtins.list[KeyInfo]:
        """Every key, revoked ones too, oldest first (never a secret: the registry has none)."""
        rows = self._read(
            "SELECT k.key_id, k.tenant, k.created_at, k.revoked_at, k.admin, t.max_sandboxes, t.max_memory_mb, "
            "t.max_cpus, t.tiers, t.rate_per_s, t.budget_cpu_h, t.budget_gib_h FROM api_keys k "
            "JOIN tenants t ON t.name=k.tenant ORDER BY k.created_at, k.key_id",
            many=True,
        )
        return [
            KeyInfo(r[0], r[1], r[2], r[3], bool(r[4]), r[5], r[6], r[7], _split(r[8]), r[9], r[10], r[11])
            for r in rows
        ]

    @_retried
    def revoke_key(self, key_id: str) -> bool:
        """Revoke a key at once (the next request with it is refused); False if unknown or already revoked."""
        if not isinstance(key_id, str):
            return False
        with self._tx() as db:
            n = db.execute(
                "UPDATE api_keys SET revoked_at=? WHERE key_id=? AND revoked_at=0", (time.time(), key_id)
            ).rowcount
        return n == 1

    def authenticate(self, secret: str) -> Tenant | None:
        """The tenant (with its current quotas, and the key's admin flag and id) of a live key's
        secret; None for anything else. One indexed read: it runs on every request."""
        if not isinstance(secret, str) or not secret.startswith(SECRET_PREFIX) or len(secret) > _MAX_SECRET:
            return None
        digest = _secret_hash(secret)
        row = self._read(_KEY_TENANT + "WHERE k.secret_sha256=?", (digest,))
        if row is None or not hmac.compare_digest(row[0], digest) or row[1]:
            return None
        return _key_tenant(row)

    def key_tenant(self, key_id: str) -> Tenant | None:
        """What :meth:`authenticate` answers for the key with this id (the console's sessions hold
        the id, never the secret): None if the key is unknown or revoked. One indexed read."""
        if not isinstance(key_id, str):
            return None
        row = self._read(_KEY_TENANT + "WHERE k.key_id=?", (key_id,))
        if row is None or row[1]:
            return None
        return _key_tenant(row)

    def tenant(self, name: str) -> Tenant:
        """A tenant's quotas (admin False, no key); InvalidArgument if there is no such tenant."""
        row = self._read(
            "SELECT name, max_sandboxes, max_memory_mb, max_cpus, tiers, rate_per_s, budget_cpu_h, budget_gib_h "
            "FROM tenants WHERE name=?",
            (name,),
        )
        if row is None:
            raise InvalidArgument(f"no tenant {name!r}")
        return Tenant(
            name=row[0],
            max_sandboxes=row[1],
            max_memory_mb=row[2],
            max_cpus=row[3],
            tiers=_split(row[4]),
            rate_per_s=row[5],
            budget_cpu_h=row[6],
            budget_gib_h=row[7],
        )

    def check_quota(self, tenant: Tenant, tier: str, limits: Limits) -> None:
        """QuotaExceeded if one more sandbox of ``tier`` with ``limits`` would take ``tenant`` past
        its quotas now. An early refusal only: the insert or claim checks again, atomically."""
        try:
            self._check_quota(self._db, tenant, tier, limits.memory_mb, limits.cpus)
        except self._errors as e:
            raise RegistryError(f"registry read failed: {e}") from None

    def _check_quota(self, db: Conn, tenant: Tenant, tier: str, memory_mb: int, cpus: float) -> None:
        """In the caller's transaction. The tenants table's quotas win over the Tenant record's (a
        quota changed by ``keys create`` applies to the next start); a tenant with no row (made in
        code, not by a key) is held to the record's. On PostgreSQL the caller's transaction holds
        the tenant's advisory lock (_tenant_lock): its count and the write it allows are one step."""
        row = db.execute(
            "SELECT max_sandboxes, max_memory_mb, max_cpus, tiers FROM tenants WHERE name=?", (tenant.name,)
        ).fetchone()
        if row is not None:
            max_n, max_mem, max_cpus, allowed = row[0], row[1], row[2], _split(row[3])
        else:
            max_n, max_mem, max_cpus, allowed = (
                tenant.max_sandboxes,
                tenant.max_memory_mb,
                tenant.max_cpus,
                tenant.tiers,
            )
        who = f"tenant {tenant.name!r}"
        if allowed and tier not in allowed:
            raise QuotaExceeded(
                f"{who} may not use tier {tier!r} (allowed: {', '.join(allowed)})",
                limit="tier",
                value=tier,
                maximum=",".join(allowed),
            )
        if not (max_n or max_mem or max_cpus):
            return
        n, used_mem, used_cpus = db.execute(
            f"SELECT COUNT(*), COALESCE(SUM(memory_mb), 0), COALESCE(SUM(cpus), 0) FROM sandboxes "
            f"WHERE tenant=? AND state IN {_in(_QUOTA)}",
            (tenant.name, *_QUOTA),
        ).fetchone()
        if max_n and n + 1 > max_n:
            raise QuotaExceeded(
                f"{who} may run at most {max_n} sandboxes at once and has {n}: kill or pause one first",
                limit="sandboxes",
                value=n + 1,
                maximum=max_n,
            )
        if max_mem and used_mem + memory_mb > max_mem:
            raise QuotaExceeded(
                f"{who} may use at most {max_mem} MiB of sandbox memory: {used_mem} MiB in use "
                f"+ {memory_mb} MiB asked for",
                limit="memory_mb",
                value=used_mem + memory_mb,
                maximum=max_mem,
            )
        if max_cpus and used_cpus + cpus > max_cpus + 1e-9:
            raise QuotaExceeded(
                f"{who} may use at most {max_cpus:g} CPUs: {used_cpus:g} in use + {cpus:g} asked for",
                limit="cpus",
                value=used_cpus + cpus,
                maximum=max_cpus,
            )

    # ---- history

    def transitions(self, sandbox_id: str) -> builtins.list[Transition]:
        rows = self._db.execute(
            "SELECT sandbox_id, at, from_state, to_state, reason FROM transitions WHERE sandbox_id=? ORDER BY rowid",
            (sandbox_id,),
        ).fetchall()
        return [Transition(*r) for r in rows]

    @_retried
    def add_timing(self, sandbox_id: str, stage: str, duration_ms: float) -> None:
        with self._tx() as db:
            db.execute(
                self._sql.upsert("timings", _TIMING_COLUMNS, ("sandbox_id", "stage"), ()),
                (sandbox_id, stage, duration_ms, 1),
            )

    @_retried
    def add_timings(self, timings: builtins.list[StageTiming]) -> None:
        with self._tx() as db:
            db.executemany(
                self._sql.upsert("timings", _TIMING_COLUMNS, ("sandbox_id", "stage")),
                [(t.sandbox_id, t.stage, t.duration_ms, int(t.on_request_path)) for t in timings],
            )

    def timings(self, sandbox_id: str) -> builtins.list[StageTiming]:
        rows = self._db.execute(
            "SELECT sandbox_id, stage, duration_ms, on_path FROM timings WHERE sandbox_id=? ORDER BY rowid",
            (sandbox_id,),
        ).fetchall()
        return [StageTiming(r[0], r[1], r[2], bool(r[3])) for r in rows]

    # ---- metering

    @_retried
    def sample(self, samples: builtins.list[tuple[str, int, int]], now: float | None = None) -> None:
        """Fold (sandbox_id, memory_bytes, cpu_ns) readings into the meters (memory x time)."""
        now = time.time() if now is None else now
        used: dict[str, builtins.list[float]] = {}  # tenant -> [cpu_s, gib_s] of this round
        with self._tx() as db:
            for sid, mem, cpu in samples:
                row = db.execute(
                    "SELECT m.sampled_at, m.memory_bytes, m.final, m.cpu_ns, s.tenant FROM meters m "
                    "JOIN sandboxes s USING (sandbox_id) WHERE sandbox_id=?",
                    (sid,),
                ).fetchone()
                if row is None or row[2]:
                    continue
                dt = max(0.0, now - row[0])
                # trapezoid between the last reading and this one
                add = (row[1] + mem) / 2 / GIB * dt
                top = self._sql.greatest
                db.execute(
                    f"UPDATE meters SET sampled_at=?, memory_bytes=?, peak_bytes={top}(peak_bytes, ?), "
                    f"gib_s=gib_s+?, cpu_ns={top}(cpu_ns, ?) WHERE sandbox_id=?",
                    (now, mem, mem, add, cpu, sid),
                )
                u = used.setdefault(row[4], [0.0, 0.0])
                u[0] += max(0, cpu - row[3]) / 1e9
                u[1] += add
            for tenant, (cpu_s, gib_s) in sorted(used.items()):  # one row order for every writer
                _add_usage(db, tenant, now, cpu_s, gib_s)

    @_retried
    def set_busy(self, sandbox_id: str, busy_ms: float, commands: int) -> None:
        with self._tx() as db:
            top = self._sql.greatest
            db.execute(
                f"UPDATE meters SET busy_ms={top}(busy_ms, ?), commands={top}(commands, ?) "
                "WHERE sandbox_id=? AND final=0",
                (busy_ms, commands, sandbox_id),
            )

    @_retried
    def finalize(self, sandbox_id: str) -> None:
        """Freeze the meters of an ended sandbox; an unclaimed pooled one is all the pool's cost."""
        with self._tx() as db:
            db.execute("UPDATE meters SET final=1, memory_bytes=0 WHERE sandbox_id=?", (sandbox_id,))
            row = db.execute(
                "SELECT s.pool, s.claimed_at, s.created_at, s.ended_at, m.cpu_ns, m.gib_s "
                "FROM sandboxes s JOIN meters m USING (sandbox_id) WHERE sandbox_id=?",
                (sandbox_id,),
            ).fetchone()
            if row and row[0] and not row[1]:
                end = row[3] or time.time()
                db.execute(
                    self._sql.upsert("pool_costs", _POOL_COST_COLUMNS, ("sandbox_id",)),
                    (row[0], sandbox_id, row[4] / 1e9, row[5], max(0.0, end - row[2])),
                )

    def meter(self, sandbox_id: str) -> Meter | None:
        row: _MeterRow | None = self._db.execute(
            "SELECT sandbox_id, sampled_at, memory_bytes, peak_bytes, gib_s, cpu_ns, busy_ms, commands, "
            "base_cpu_ns, base_gib_s, base_busy_ms, base_commands, final FROM meters WHERE sandbox_id=?",
            (sandbox_id,),
        ).fetchone()
        return None if row is None else Meter(*row[:-1], bool(row[-1]))

    def ended_at(self, sandbox_id: str) -> float:
        row = self._db.execute("SELECT ended_at FROM sandboxes WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        return row[0] if row else 0.0

    # ---- usage and budgets

    def usage(self, tenant: str | None, since: float, until: float | None = None) -> builtins.list[UsageBucket]:
        """The hourly use of ``tenant``'s sandboxes (None: every tenant's) in the hours that start
        in [since rounded down to its hour, until), oldest first. A reading is counted in the hour
        it was taken (the daemon reads every second: an hour's edge moves at most that much)."""
        lo = math.floor(since / HOUR) * HOUR
        hi = math.inf if until is None else until
        sql = "SELECT tenant, hour, cpu_s, gib_s FROM usage WHERE hour>=? AND hour<?"
        args: tuple = (lo, hi)
        if tenant is not None:
            sql, args = sql + " AND tenant=?", (*args, tenant)
        rows = self._read(sql + " ORDER BY hour, tenant", args, many=True)
        return [UsageBucket(*r) for r in rows]

    @_retried
    def set_budget(self, tenant: str, *, cpu_h: float | None = None, gib_h: float | None = None) -> None:
        """A tenant's daily budget (CPU-hours, GiB-hours per UTC day; 0: none; None: keep);
        InvalidArgument if there is no such tenant or a value is not a number >= 0."""
        for name, v in (("budget cpu_h", cpu_h), ("budget gib_h", gib_h)):
            if v is not None:
                _quota(name, v, integer=False)
        with self._tx() as db:
            if db.execute("SELECT 1 FROM tenants WHERE name=?", (tenant,)).fetchone() is None:
                raise InvalidArgument(f"no tenant {tenant!r}")
            if cpu_h is not None:
                db.execute("UPDATE tenants SET budget_cpu_h=? WHERE name=?", (cpu_h, tenant))
            if gib_h is not None:
                db.execute("UPDATE tenants SET budget_gib_h=? WHERE name=?", (gib_h, tenant))

    def budget_status(self, tenant: str, now: float | None = None, *, warn_ratio: float = 0.8) -> BudgetStatus:
        """``tenant``'s use since UTC midnight against its daily budget (a tenant with no row or
        no budget: limits 0, ratios 0). warn_ratio: the ratio from which ``warning`` is set."""
        now = time.time() if now is None else now
        day = math.floor(now / DAY) * DAY
        budget = self._read("SELECT budget_cpu_h, budget_gib_h FROM tenants WHERE name=?", (tenant,))
        cpu_limit, gib_limit = budget if budget is not None else (0.0, 0.0)
        cpu_s, gib_s = self._read(
            "SELECT COALESCE(SUM(cpu_s), 0), COALESCE(SUM(gib_s), 0) FROM usage WHERE tenant=? AND hour>=?",
            (tenant, day),
        )
        return _budget(tenant, day, cpu_s, gib_s, cpu_limit, gib_limit, warn_ratio)

    def live_footprint(self, tenant: str) -> tuple[int, float]:
        """The memory (MiB) and CPUs of ``tenant``'s live sandboxes (creating, ready, running: the
        ones its quotas count)."""
        mb, cpus = self._read(
            f"SELECT COALESCE(SUM(memory_mb), 0), COALESCE(SUM(cpus), 0) FROM sandboxes "
            f"WHERE tenant=? AND state IN {_in(_QUOTA)}",
            (tenant, *_QUOTA),
        )
        return int(mb), float(cpus)

    def budgets(self, now: float | None = None, *, warn_ratio: float = 0.8) -> builtins.list[BudgetStatus]:
        """:meth:`budget_status` of every tenant that has a budget, by name (two reads in all: for
        a scrape or a dashboard page)."""
        now = time.time() if now is None else now
        day = math.floor(now / DAY) * DAY
        limits = self._read(
            "SELECT name, budget_cpu_h, budget_gib_h FROM tenants WHERE budget_cpu_h>0 OR budget_gib_h>0 ORDER BY name",
            many=True,
        )
        used = {
            r[0]: (r[1], r[2])
            for r in self._read(
                "SELECT tenant, SUM(cpu_s), SUM(gib_s) FROM usage WHERE hour>=? GROUP BY tenant", (day,), many=True
            )
        }
        return [_budget(name, day, *used.get(name, (0.0, 0.0)), cpu, gib, warn_ratio) for name, cpu, gib in limits]

    # ---- the approval queue

    @_retried
    def open_approval(
        self,
        tenant: str,
        kind: str,
        subject: str,
        reason: str,
        timeout_s: float,
        *,
        sandbox_id: str = "",
        waiter: str = "",
        now: float | None = None,
    ) -> Approval:
        """A new pending question, answerable until ``timeout_s`` from now. waiter: the owner tag
        (paths.owner_tag) of the process that waits for it: if that process dies, the question
        reads as timed out (nobody would act on an answer). Texts are bounded (500 characters)."""
        if kind not in APPROVAL_KINDS:
            raise InvalidArgument(f"kind must be one of {list(APPROVAL_KINDS)}, got {kind!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise InvalidArgument(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        now = time.time() if now is None else now
        a = Approval(
            "ap-" + secrets.token_hex(8),
            tenant,
            sandbox_id,
            kind,
            subject[:_MAX_APPROVAL_TEXT],
            reason[:_MAX_APPROVAL_TEXT],
            now,
            now + timeout_s,
        )
        with self._tx() as db:
            db.execute(
                "INSERT INTO approvals (approval_id, tenant, sandbox_id, kind, subject, reason, created_at, deadline, "
                "state, waiter) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (a.approval_id, a.tenant, a.sandbox_id, a.kind, a.subject, a.reason, now, a.deadline, a.state, waiter),
            )
        return a

    def approval(self, approval_id: str, *, tenant: str | None = None, now: float | None = None) -> Approval:
        """One question as it stands (ApprovalNotFound if unknown, or not ``tenant``'s when given)."""
        row = self._read(f"SELECT {_APPROVAL_COLUMNS} FROM approvals WHERE approval_id=?", (approval_id,))
        if row is None or (tenant is not None and row[1] != tenant):
            raise ApprovalNotFound(f"no approval {approval_id}", approval_id=str(approval_id)[:80])
        return _approval(row, time.time() if now is None else now, self.node)

    def approvals(
        self, tenant: str | None, *, pending_only: bool = False, limit: int = 200, now: float | None = None
    ) -> builtins.list[Approval]:
        """The questions of ``tenant`` (None: every tenant's), newest first; pending_only: only
        those still open. A pending one past its deadline, or whose waiter died, reads as timed_out."""
        now = time.time() if now is None else now
        sql = f"SELECT {_APPROVAL_COLUMNS} FROM approvals"
        where: builtins.list[str] = []
        args: builtins.list[object] = []
        if tenant is not None:
            where.append("tenant=?")
            args.append(tenant)
        if pending_only:
            where += ["state='pending'", "deadline>?"]
            args.append(now)
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self._read(sql + " ORDER BY created_at DESC LIMIT ?", (*args, max(1, int(limit))), many=True)
        out = [_approval(r, now, self.node) for r in rows]
        return [a for a in out if a.state == "pending"] if pending_only else out

    @_retried
    def answer_approval(
        self, approval_id: str, decision: str, answered_by: str, *, tenant: str | None = None, now: float | None = None
    ) -> Approval:
        """Answer an open question, exactly once: a second answer (or one after its deadline, or
        after its waiter died) is ApprovalClosed; an unknown id, or another tenant's when
        ``tenant`` is given, ApprovalNotFound; a decision not of its kind, InvalidArgument."""
        now = time.time() if now is None else now
        with self._tx() as db:
            row = db.execute(
                f"SELECT {_APPROVAL_COLUMNS} FROM approvals WHERE approval_id=?" + self._sql.for_update(),
                (approval_id,),
            ).fetchone()
            if row is None or (tenant is not None and row[1] != tenant):
                raise ApprovalNotFound(f"no approval {approval_id}", approval_id=str(approval_id)[:80])
            a = _approval(row, now, self.node)
            allowed = NETWORK_DECISIONS if a.kind == "network" else COST_DECISIONS
            if decision not in allowed:
                raise InvalidArgument(f"a {a.kind} question is answered with one of {list(allowed)}, got {decision!r}")
            if a.state != "pending":
                raise ApprovalClosed(
                    f"approval {approval_id} is {a.state}"
                    + (f" ({a.decision} by {a.answered_by})" if a.decision else "")
                    + ": each question is answered once",
                    approval_id=approval_id,
                    state=a.state,
                )
            state = "denied" if decision == "deny" else "approved"
            db.execute(
                "UPDATE approvals SET state=?, decision=?, answered_by=?, answered_at=? "
                "WHERE approval_id=? AND state='pending'",
                (state, decision, answered_by[:200], now, approval_id),
            )
        for wake in self._approval_waiters.get(approval_id, ()):
            wake()
        return dataclasses.replace(a, state=state, decision=decision, answered_by=answered_by[:200], answered_at=now)

    @_retried
    def _expire_approval(self, approval_id: str, now: float) -> None:
        """Close a question whose deadline passed (timed_out), unless an answer came first."""
        with self._tx() as db:
            db.execute(
                "UPDATE approvals SET state='timed_out', answered_at=? WHERE approval_id=? AND state='pending'",
                (now, approval_id),
            )

    @_retried
    def withdraw_approval(self, approval_id: str) -> None:
        """The waiter gave up (cancelled, or failed): close the question as timed_out, answered_by
        "withdrawn", unless it was answered (nobody would act on a later answer)."""
        with self._tx() as db:
            db.execute(
                "UPDATE approvals SET state='timed_out', answered_by='withdrawn', answered_at=? "
                "WHERE approval_id=? AND state='pending'",
                (time.time(), approval_id),
            )

    async def wait_approval(self, approval_id: str, *, poll_s: float = 0.2, first_poll_s: float = 0.05) -> Approval:
        """Wait for a question's answer (from any process: the row is the truth) until its
        deadline; returns it answered, or timed_out (then recorded so: a late answer is refused).
        Reads the row every ``first_poll_s`` at first, backing off to ``poll_s`` (one indexed read, ~20 µs, each);
        an answer given through this Registry object (this process's server, say) wakes it at once."""
        import asyncio

        loop = asyncio.get_running_loop()
        answered = asyncio.Event()

        def wake() -> None:  # answer_approval may run on another thread: hand the wake-up to our loop
            loop.call_soon_threadsafe(answered.set)

        waiters = self._approval_waiters.setdefault(approval_id, [])
        waiters.append(wake)
        delay = first_poll_s
        try:
            while True:
                now = time.time()
                a = self.approval(approval_id, now=now)
                if a.state == "timed_out":  # its deadline passed: recorded, unless an answer won the race
                    self._expire_approval(approval_id, now)
                    return self.approval(approval_id, now=now)
                if a.state != "pending":
                    return a
                try:
                    await asyncio.wait_for(answered.wait(), min(delay, max(0.0, a.deadline - now)))
                except TimeoutError:
                    pass
                delay = min(poll_s, delay * 1.5)
        finally:
            waiters.remove(wake)
            if not waiters:
                self._approval_waiters.pop(approval_id, None)

    # ---- pools

    def pool_rows(self) -> dict[str, PoolRow]:
        rows = self._db.execute(
            "SELECT name, target, min_override, max_override, last_error, last_error_at, "
            "last_demand_at, events_seen, config_target FROM pool_state"
        ).fetchall()
        return {r[0]: PoolRow(*r) for r in rows}

    @_retried
    def ensure_pool(self, name: str, target: int) -> None:
        """Create the pool's row, or reset its target when the configured target changed."""
        with self._tx() as db:
            db.execute(
                self._sql.upsert("pool_state", ("name", "target", "last_demand_at", "config_target"), ("name",), ()),
                (name, target, time.time(), target),
            )
            db.execute(
                "UPDATE pool_state SET target=?, config_target=? WHERE name=? AND "
                "(config_target IS NULL OR config_target<>?)",
                (target, target, name, target),
            )

    @_retried
    def set_pool(
        self,
        name: str,
        *,
        target: int | None = None,
        min_override: int | bool | None = False,
        max_override: int | bool | None = False,
        error: str | None = None,
        kind: str = "",
        detail: str = "",
        demand: bool = False,
    ) -> None:
        """Update a pool's row (False = leave that override unchanged) and log an event if ``kind``;
        demand: count it as demand (an idle period starts now)."""
        now = time.time()
        with self._tx() as db:
            db.execute(
                self._sql.upsert("pool_state", ("name", "target", "last_demand_at"), ("name",), ()),
                (name, target or 0, now),
            )
            if target is not None:
                db.execute("UPDATE pool_state SET target=? WHERE name=?", (target, name))
            if min_override is not False:
                db.execute("UPDATE pool_state SET min_override=? WHERE name=?", (min_override, name))
            if max_override is not False:
                db.execute("UPDATE pool_state SET max_override=? WHERE name=?", (max_override, name))
            if error is not None:
                db.execute("UPDATE pool_state SET last_error=?, last_error_at=? WHERE name=?", (error, now, name))
            if demand:
                db.execute("UPDATE pool_state SET last_demand_at=? WHERE name=?", (now, name))
            if kind:
                self._pool_event(db, (name, now, kind, "", detail))

    @_retried
    def pool_event(self, pool: str, kind: str, sandbox_id: str = "", detail: str = "") -> None:
        with self._tx() as db:
            self._pool_event(db, (pool, time.time(), kind, sandbox_id, detail))

    def pool_events(self, pool: str, since: float = 0.0) -> builtins.list[PoolEvent]:
        rows = self._db.execute(
            "SELECT pool, at, kind, sandbox_id, detail FROM pool_events WHERE pool=? AND at>=? ORDER BY rowid",
            (pool, since),
        ).fetchall()
        return [PoolEvent(*r) for r in rows]

    def pool_first_event(self, pool: str) -> float | None:
        """When the pool's first recorded event happened (unix s; None: none yet): where its charts start."""
        row = self._read("SELECT MIN(at) FROM pool_events WHERE pool=?", (pool,))  # index pool_events(pool, at)
        return None if row is None or row[0] is None else float(row[0])

    def unseen_misses(self, pool: str, seen: int) -> tuple[int, int]:
        """(misses recorded past the cursor ``seen``, the new cursor) — for the autoscaler. The
        cursor: SQLite, the newest event's rowid; PostgreSQL, the oldest transaction still running
        (every event of a transaction below it is committed or never will be)."""
        if self.shared:
            count, horizon = self._db.execute(
                f"SELECT (SELECT COUNT(*) FROM pool_events WHERE pool=? AND kind='miss' AND xid>=? AND xid<h.x), "
                f"h.x FROM (SELECT {PG_XACT_HORIZON} AS x) h",
                (pool, seen),
            ).fetchone()
            return count, max(horizon, seen)
        row = self._db.execute(
            "SELECT COUNT(*), MAX(rowid) FROM pool_events WHERE pool=? AND rowid>? AND kind='miss'", (pool, seen)
        ).fetchone()
        newest = self._db.execute("SELECT COALESCE(MAX(rowid), 0) FROM pool_events").fetchone()[0]
        return row[0], max(newest, seen)

    @_retried
    def set_events_seen(self, pool: str, seen: int) -> None:
        with self._tx() as db:
            db.execute("UPDATE pool_state SET events_seen=? WHERE name=?", (seen, pool))

    def pool_counts(self, pool: str, shape: str | None = None) -> tuple[int, int]:
        """This node's (pooled, of ``shape`` if given, and not expiring within a second; being created)."""
        now = time.time()
        q = "SELECT COUNT(*) FROM sandboxes WHERE pool=? AND state=? AND expires_at>? AND node=?"
        args: list = [pool, State.POOLED.value, now + 1, self.node]
        if shape is not None:
            q += " AND shape=?"
            args.append(shape)
        ready = self._db.execute(q, args).fetchone()[0]
        warming = self._db.execute(
            "SELECT COUNT(*) FROM sandboxes WHERE pool=? AND state=? AND node=?",
            (pool, State.CREATING.value, self.node),
        ).fetchone()[0]
        return ready, warming

    def pooled(self, pool: str) -> builtins.list[str]:
        rows = self._db.execute(
            "SELECT sandbox_id FROM sandboxes WHERE pool=? AND state=? AND node=? ORDER BY created_at",
            (pool, State.POOLED.value, self.node),
        ).fetchall()
        return [r[0] for r in rows]

    def pool_totals(self, pool: str) -> tuple[int, int, int, float, float, float]:
        """(hits, misses, warm-up failures, cpu_s, GiB-s, wall_s) of a pool so far."""
        counts = dict(
            self._db.execute("SELECT kind, COUNT(*) FROM pool_events WHERE pool=? GROUP BY kind", (pool,)).fetchall()
        )
        cost = self._db.execute(
            "SELECT COALESCE(SUM(cpu_s),0), COALESCE(SUM(gib_s),0), COALESCE(SUM(wall_s),0) "
            "FROM pool_costs WHERE pool=?",
            (pool,),
        ).fetchone()
        hits = counts.get("hit", 0) - counts.get("claim_failed", 0)  # a failed claim check took the next one
        return (hits, counts.get("miss", 0), counts.get("warmup_failed", 0), *cost)

    # ---- network (the proxy reads policies and appends audit records; the engine owns links)

    @_retried
    def set_link(self, sandbox_id: str, address: str, ifname: str, policy: str) -> None:
        with self._tx() as db:
            # what SQLite's REPLACE did for the UNIQUE (node, address) too (PostgreSQL's upsert would not)
            db.execute(
                "DELETE FROM net_links WHERE node=? AND address=? AND sandbox_id<>?", (self.node, address, sandbox_id)
            )
            db.execute(
                self._sql.upsert("net_links", tuple(_NET_LINK_COLUMNS.split(", ")), ("sandbox_id",)),
                (sandbox_id, address, ifname, policy, time.time(), self.node),
            )

    @_retried
    def set_policy(self, sandbox_id: str, policy: str) -> bool:
        with self._tx() as db:
            return (
                db.execute(
                    "UPDATE net_links SET policy=?, updated_at=? WHERE sandbox_id=?", (policy, time.time(), sandbox_id)
                ).rowcount
                == 1
            )

    def link(self, sandbox_id: str) -> tuple[str, str, str] | None:
        """(address, ifname, policy json) of a sandbox's network link, if it has one."""
        return self._read("SELECT address, ifname, policy FROM net_links WHERE sandbox_id=?", (sandbox_id,))

    def link_by_address(self, address: str) -> tuple[str, str] | None:
        """(sandbox_id, policy json) of this node's live sandbox holding ``address``."""
        return self._read(
            "SELECT l.sandbox_id, l.policy FROM net_links l JOIN sandboxes s USING (sandbox_id) "
            "WHERE l.address=? AND l.node=? AND s.state NOT IN ('destroyed','failed','lost')",
            (address, self.node),
        )

    def link_node(self, sandbox_id: str) -> str | None:
        """The node whose link a sandbox's link record is (None: it has none)."""
        row = self._read("SELECT node FROM net_links WHERE sandbox_id=?", (sandbox_id,))
        return None if row is None else row[0]

    @_retried
    def drop_link(self, sandbox_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM net_links WHERE sandbox_id=?", (sandbox_id,))

    def live_links(self) -> int:
        """How many of this node's sandboxes have a network link (the egress proxy runs for them)."""
        return self._read(
            "SELECT COUNT(*) FROM net_links l JOIN sandboxes s USING (sandbox_id) "
            "WHERE l.node=? AND s.state NOT IN ('destroyed','failed','lost')",
            (self.node,),
        )[0]

    @_retried
    def add_net_event(self, e: NetEvent) -> int:
        with self._tx() as db:
            return int(db.execute(_NET_EVENT_INSERT + " RETURNING id", _net_event_row(e)).fetchone()[0])

    @_retried
    def add_net_events(self, events: builtins.list[NetEvent]) -> None:
        """Append several audit records in one transaction."""
        with self._tx() as db:
            db.executemany(_NET_EVENT_INSERT, [_net_event_row(e) for e in events])

    @_retried
    def finish_net_event(self, event_id: int, bytes_up: int, bytes_down: int, detail: str = "") -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE net_events SET bytes_up=?, bytes_down=?, detail=CASE WHEN ?='' THEN detail ELSE ? END"
                " WHERE id=?",
                (bytes_up, bytes_down, detail, detail[:500], event_id),
            )

    @_retried
    def deny_net_event(self, event_id: int, rule: str, detail: str) -> None:
        """Turn an attempt first allowed by name into a denial (e.g. its TLS SNI did not match)."""
        with self._tx() as db:
            db.execute(
                "UPDATE net_events SET decision='deny', rule=?, detail=? WHERE id=?", (rule, detail[:500], event_id)
            )

    def net_events(self, sandbox_id: str, limit: int = 10000) -> builtins.list[NetEvent]:
        rows = self._read(
            "SELECT sandbox_id, at, kind, host, address, port, decision, rule, bytes_up, bytes_down,"
            " detail FROM net_events WHERE sandbox_id=? ORDER BY id LIMIT ?",
            (sandbox_id, limit),
            many=True,
        )
        return [NetEvent(*r) for r in rows]

    # ---- idempotency keys (engine/idempotency.py)

    @_retried
    def claim_key(self, claim: KeyClaim) -> KeyRecord | None:
        """Record ``claim`` (state "started") and commit it, unless the tenant's key is taken in its
        scope: None if this claim won, else the record that holds the key. An expired record is
        replaced. One statement on the fast path (its cost is on every keyed call: ``warmbox bench
        exec``); every IDEM_PURGE_EVERY claims, the expired records of every tenant go too."""
        self._claims += 1
        with self._tx() as db:
            if self._claims % IDEM_PURGE_EVERY == 0:
                db.execute("DELETE FROM idempotency_keys WHERE expires_at<=?", (claim.created_at,))
            won = db.execute(_IDEM_CLAIM, _claim_row(claim)).fetchall()
            if won:
                return None
            row = db.execute(
                f"SELECT {_IDEM_COLUMNS} FROM idempotency_keys WHERE tenant=? AND scope=? AND idem_key=?",
                (claim.tenant, claim.scope, claim.key),
            ).fetchone()
        return None if row is None else _key_record(row)

    @_retried
    def release_key(self, claim: KeyClaim) -> None:
        """Forget a claim whose call did nothing (refused before it started): its key is free again."""
        with self._tx() as db:
            db.execute(
                "DELETE FROM idempotency_keys "
                "WHERE tenant=? AND scope=? AND idem_key=? AND holder=? AND state='started'",
                (claim.tenant, claim.scope, claim.key, claim.holder),
            )

    @_retried
    def finish_keys(self, outcomes: builtins.list[tuple[KeyClaim, str, str, str]]) -> None:
        """Record the outcomes of started calls, in one transaction: (claim, state "done" with
        its result as JSON or "failed" with its typed error as JSON, that JSON, the sandbox a
        create made or ""); each only while the record is still that claim's."""
        if not outcomes:
            return
        with self._tx() as db:
            db.executemany(
                "UPDATE idempotency_keys SET state=?, result=?, sandbox_id=? "
                "WHERE tenant=? AND scope=? AND idem_key=? AND holder=? AND state='started'",
                [(state, result, sid, c.tenant, c.scope, c.key, c.holder) for c, state, result, sid in outcomes],
            )

    def key_record(self, tenant: str, scope: str, key: str) -> KeyRecord | None:
        """The record of a tenant's key in a scope (None: none, or expired)."""
        row = self._read(
            f"SELECT {_IDEM_COLUMNS} FROM idempotency_keys WHERE tenant=? AND scope=? AND idem_key=? AND expires_at>?",
            (tenant, scope, key, time.time()),
        )
        return None if row is None else _key_record(row)

    # ---- commands and code runs (written in batches by the engine's CommandLog)

    @_retried
    def add_commands(self, records: builtins.list[CommandRecord]) -> None:
        """Append command records in one transaction; each gets the next ``seq`` of its sandbox
        (the records' own seq is ignored), in the order given. A sandbox keeps its first
        COMMANDS_HEAD and its latest COMMANDS_TAIL records: the ones between are deleted (the gap in
        ``seq`` shows it), so a sandbox running commands at full speed cannot grow the registry
        without bound (about 900 calls/s with 4 KiB of text each was 12 GB an hour)."""
        if not records:
            return
        with self._tx(*{f"commands:{c.sandbox_id}" for c in records}) as db:  # the next seq, one writer each
            last: dict[str, int] = {}
            rows = []
            for c in records:
                n = last.get(c.sandbox_id)
                if n is None:
                    n = db.execute(
                        "SELECT COALESCE(MAX(seq), 0) FROM commands WHERE sandbox_id=?", (c.sandbox_id,)
                    ).fetchone()[0]
                last[c.sandbox_id] = n = n + 1
                rows.append(_command_row(c, n))
            db.executemany(f"INSERT INTO commands ({_COMMAND_COLUMNS}) VALUES ({','.join('?' * 15)})", rows)
            for sid, n in last.items():  # a sandbox keeps its first and its latest records, not all
                if n > COMMANDS_HEAD + COMMANDS_TAIL:
                    db.execute(
                        "DELETE FROM commands WHERE sandbox_id=? AND seq>? AND seq<=?",
                        (sid, COMMANDS_HEAD, n - COMMANDS_TAIL),
                    )

    def command_count(self, sandbox_id: str) -> int:
        """How many commands and code runs were recorded for the sandbox (the highest ``seq``: the
        records between its first and latest ones that were not kept count too)."""
        row = self._db.execute(
            "SELECT COALESCE(MAX(seq), 0) FROM commands WHERE sandbox_id=?", (sandbox_id,)
        ).fetchone()
        return int(row[0]) if row else 0

    def commands(
        self, sandbox_id: str, limit: int = 1000, *, after_seq: int = 0, newest_first: bool = False
    ) -> builtins.list[CommandRecord]:
        """A sandbox's command records with seq > ``after_seq``, at most ``limit``: the oldest of
        them in seq order, or (newest_first) the newest, newest first. Kept after the sandbox ended."""
        for name, value in (("limit", limit), ("after_seq", after_seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"{name} must be an integer >= 0, got {value!r}")
        rows = self._read(
            f"SELECT {_COMMAND_COLUMNS} FROM commands WHERE sandbox_id=? AND seq>? "
            f"ORDER BY seq {'DESC' if newest_first else 'ASC'} LIMIT ?",
            (sandbox_id, after_seq, limit),
            many=True,
        )
        return [_command(r) for r in rows]

    # ---- named volumes (the tenant "" is the host's)

    @_retried
    def add_volume(self, tenant: str, name: str, volume_id: str, size_mb: int, created_at: float) -> None:
        """Record a new volume; VolumeError if the tenant has one of that name."""
        try:
            with self._tx(f"volume:{tenant}/{name}") as db:
                if db.execute("SELECT 1 FROM volumes WHERE tenant=? AND name=?", (tenant, name)).fetchone():
                    raise VolumeError(f"a volume named {name!r} exists already", volume=name)
                db.execute(
                    "INSERT INTO volumes (tenant, name, volume_id, size_mb, created_at, node) VALUES (?,?,?,?,?,?)",
                    (tenant, name, volume_id, size_mb, created_at, self.node),
                )
        except self._errors as e:
            raise RegistryError(f"registry error: {e}") from None

    def volume(self, tenant: str, name: str) -> tuple[str, int, float]:
        """(volume_id, size_mb, created_at) of the tenant's volume; VolumeNotFound if it has none of that name."""
        row = self._read("SELECT volume_id, size_mb, created_at FROM volumes WHERE tenant=? AND name=?", (tenant, name))
        if row is None:
            raise VolumeNotFound(f"no volume named {name!r}", volume=name)
        return row[0], row[1], row[2]

    def volumes(self, tenant: str | None) -> builtins.list[tuple[str, str, str, int, float]]:
        """(tenant, name, volume_id, size_mb, created_at) of a tenant's volumes (None: everyone's), by name."""
        if tenant is None:
            return self._read(
                "SELECT tenant, name, volume_id, size_mb, created_at FROM volumes ORDER BY name", many=True
            )
        return self._read(
            "SELECT tenant, name, volume_id, size_mb, created_at FROM volumes WHERE tenant=? ORDER BY name",
            (tenant,),
            many=True,
        )

    def volume_users(self, volume_id: str) -> builtins.list[str]:
        """The sandboxes that mount the volume and are live, paused or owe their teardown."""
        rows = self._read(
            "SELECT m.sandbox_id FROM sandbox_volumes m JOIN sandboxes s ON s.sandbox_id = m.sandbox_id "
            f"WHERE m.volume_id=? AND s.state IN {_in(_MOUNTING)} ORDER BY s.created_at",
            (volume_id, *_MOUNTING),
            many=True,
        )
        return [r[0] for r in rows]

    @_retried
    def remove_volume(self, tenant: str, name: str) -> str:
        """Forget a volume; its volume_id (whose image the caller deletes). VolumeNotFound, or
        VolumeInUse while a sandbox mounts it (checked in the transaction that removes the row,
        against the one that records a mount: neither can slip between the other's check and write)."""
        try:
            with self._tx() as db:
                row = db.execute(
                    "SELECT volume_id FROM volumes WHERE tenant=? AND name=?" + self._sql.for_update(), (tenant, name)
                ).fetchone()
                if row is None:
                    raise VolumeNotFound(f"no volume named {name!r}", volume=name)
                users = db.execute(
                    "SELECT m.sandbox_id FROM sandbox_volumes m JOIN sandboxes s ON s.sandbox_id = m.sandbox_id "
                    f"WHERE m.volume_id=? AND s.state IN {_in(_MOUNTING)}",
                    (row[0], *_MOUNTING),
                ).fetchall()
                if users:
                    raise VolumeInUse(
                        f"volume {name!r} is mounted by {', '.join(sorted(u[0] for u in users))} (live or paused)",
                        volume=name,
                    )
                db.execute("DELETE FROM volumes WHERE volume_id=?", (row[0],))
                return str(row[0])
        except self._errors as e:
            raise RegistryError(f"registry error: {e}") from None

    @_retried
    def mount_volumes(
        self, sandbox_id: str, mounts: builtins.list[tuple[str, str, str, bool]], *, exclusive: bool
    ) -> None:
        """Record that the sandbox mounts the volumes ``(volume_id, name, path, read_only)`` (ids
        the caller resolved in the tenant's names). A resume (the same sandbox id) replaces its
        earlier record.

        VolumeNotFound for a volume deleted meanwhile. exclusive: the tier mounts the volume's
        image as a disk of its own kernel (a microVM), not through the host's one shared mount:
        then a read-write mount must be the volume's only one, and a read-only one refuses a volume
        mounted read-write anywhere (ext4 is not a shared filesystem: two kernels writing one image
        corrupt it, and a guest reading it while the host writes reads garbage). Conversely a host
        mount refuses a volume a microVM mounts read-write. VolumeInUse then. Checked in the
        transaction that writes the record, against remove_volume's.
        """
        try:
            with self._tx() as db:
                if mounts and self._sql.for_update():  # PostgreSQL: against remove_volume and other mounts
                    ids = sorted({m[0] for m in mounts})  # one lock order
                    db.execute(
                        f"SELECT volume_id FROM volumes WHERE volume_id IN {_in(tuple(ids))} ORDER BY volume_id"
                        + self._sql.for_update(),
                        ids,
                    ).fetchall()
                for volume_id, name, _, read_only in mounts:
                    if not db.execute("SELECT 1 FROM volumes WHERE volume_id=?", (volume_id,)).fetchone():
                        raise VolumeNotFound(f"no volume named {name!r} (deleted)", volume=name)
                    others = db.execute(
                        "SELECT m.sandbox_id, m.read_only, m.exclusive FROM sandbox_volumes m JOIN sandboxes s "
                        f"ON s.sandbox_id = m.sandbox_id WHERE m.volume_id=? AND m.sandbox_id<>? AND s.state IN "
                        f"{_in(_MOUNTING)}",
                        (volume_id, sandbox_id, *_MOUNTING),
                    ).fetchall()
                    for other, other_ro, other_exclusive in others:
                        if (exclusive or other_exclusive) and not (read_only and other_ro):
                            raise VolumeInUse(
                                f"volume {name!r} is mounted {'read-only' if other_ro else 'read-write'} by {other}; "
                                "a microVM mounts a volume as a disk of its own kernel, so it shares one only "
                                "read-only with read-only mounts",
                                volume=name,
                            )
                db.execute("DELETE FROM sandbox_volumes WHERE sandbox_id=?", (sandbox_id,))
                for volume_id, _, path, read_only in mounts:
                    db.execute(
                        "INSERT INTO sandbox_volumes (sandbox_id, volume_id, path, read_only, exclusive) "
                        "VALUES (?,?,?,?,?)",
                        (sandbox_id, volume_id, path, int(read_only), int(exclusive)),
                    )
        except self._errors as e:
            raise RegistryError(f"registry error: {e}") from None

    def volumes_of(self, sandbox_id: str) -> builtins.list[tuple[str, str, str, bool]]:
        """(volume name, volume_id, path, read_only) of what a sandbox mounts (its volume may be gone: name "")."""
        rows = self._read(
            "SELECT COALESCE(v.name, ''), m.volume_id, m.path, m.read_only FROM sandbox_volumes m "
            "LEFT JOIN volumes v ON v.volume_id = m.volume_id WHERE m.sandbox_id=? ORDER BY m.rowid",
            (sandbox_id,),
            many=True,
        )
        return [(r[0], r[1], r[2], bool(r[3])) for r in rows]

    # ---- where a volume's disk is: the node that made it (add_volume records self.node)

    def volume_node(self, volume_id: str) -> str:
        """The node holding the volume's disk ("": a single host's); VolumeNotFound if no such volume."""
        row = self._read("SELECT node FROM volumes WHERE volume_id=?", (volume_id,))
        if row is None:
            raise VolumeNotFound(f"no volume {volume_id!r}", volume=volume_id)
        return str(row[0])

    def volume_nodes(self) -> dict[str, str]:
        """volume_id -> the node holding its disk, of every volume."""
        return {r[0]: r[1] for r in self._read("SELECT volume_id, node FROM volumes", many=True)}


def _requirements(text: str) -> Requirements | None:
    """A row's Requirements (JSON written by set_tier_choice; "" or anything unreadable: None)."""
    try:
        v = json.loads(text) if text else None
        return Requirements(**v) if isinstance(v, dict) else None
    except (ValueError, TypeError, InvalidArgument):
        return None


def _metadata(text: str) -> dict[str, str]:
    """A row's metadata (JSON written by set_metadata; anything else reads as none)."""
    try:
        v = json.loads(text or "{}")
    except ValueError:
        return {}
    if not isinstance(v, dict):
        return {}
    return {k: x for k, x in v.items() if isinstance(k, str) and isinstance(x, str)}


_TEMPLATE_COLUMNS = (
    'name, version, image_id, layers, env, workdir, "user", warmup_code, warmup_commands, source, '
    "spec_hash, size_bytes, created_at, build_log, tenant, description"
)
_TEMPLATE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _template_name(name: object) -> None:
    if not isinstance(name, str) or not _TEMPLATE_NAME.match(name):
        raise InvalidArgument(f"a template name is 1-128 letters, digits, '_', '.', '-' (not first), got {name!r}")


def _template_row(t: TemplateInfo) -> tuple:
    """A TemplateInfo as its templates row (in _TEMPLATE_COLUMNS order; tuples as JSON lists)."""
    return (
        t.name,
        t.version,
        t.image_id,
        json.dumps(list(t.layers)),
        json.dumps([[k, v] for k, v in t.env]),
        t.workdir,
        t.user,
        t.warmup_code,
        json.dumps(list(t.warmup_commands)),
        t.source,
        t.spec_hash,
        t.size_bytes,
        t.created_at,
        t.build_log,
        t.tenant,
        t.description,
    )


def _strings(text: str) -> tuple[str, ...]:
    try:
        v = json.loads(text)
    except ValueError:
        return ()
    return tuple(x for x in v if isinstance(x, str)) if isinstance(v, list) else ()


def _pairs(text: str) -> tuple[tuple[str, str], ...]:
    try:
        v = json.loads(text)
    except ValueError:
        return ()
    if not isinstance(v, list):
        return ()
    return tuple((p[0], p[1]) for p in v if isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p))


def _template(r: tuple) -> TemplateInfo:
    return TemplateInfo(
        name=r[0],
        version=r[1],
        image_id=r[2],
        layers=_strings(r[3]),
        env=_pairs(r[4]),
        workdir=r[5],
        user=r[6],
        warmup_code=r[7],
        warmup_commands=_strings(r[8]),
        source=r[9],
        spec_hash=r[10],
        size_bytes=r[11],
        created_at=r[12],
        build_log=Path(r[13]).name,  # rows before names were recorded hold the log's host path
        tenant=r[14],
        description=r[15],
    )


def _add_usage(db: Conn, tenant: str, at: float, cpu_s: float, gib_s: float) -> None:
    """Count use in ``tenant``'s bucket of the UTC hour of ``at`` (in the caller's transaction)."""
    if cpu_s <= 0 and gib_s <= 0:
        return
    db.execute(
        "INSERT INTO usage (tenant, hour, cpu_s, gib_s) VALUES (?,?,?,?) ON CONFLICT (tenant, hour) "
        "DO UPDATE SET cpu_s=usage.cpu_s+excluded.cpu_s, gib_s=usage.gib_s+excluded.gib_s",
        (tenant, math.floor(at / HOUR) * HOUR, max(0.0, cpu_s), max(0.0, gib_s)),
    )


def _budget(
    tenant: str, day: float, cpu_s: float, gib_s: float, cpu_limit: float, gib_limit: float, warn_ratio: float
) -> BudgetStatus:
    cpu_h, gib_h = cpu_s / HOUR, gib_s / HOUR
    cpu_ratio = cpu_h / cpu_limit if cpu_limit else 0.0
    gib_ratio = gib_h / gib_limit if gib_limit else 0.0
    top = max(cpu_ratio, gib_ratio)
    return BudgetStatus(
        tenant, day, cpu_h, cpu_limit, cpu_ratio, gib_h, gib_limit, gib_ratio, top >= warn_ratio, top >= 1.0
    )


_APPROVAL_COLUMNS = (
    "approval_id, tenant, sandbox_id, kind, subject, reason, created_at, deadline, state, decision, "
    "answered_by, answered_at, waiter"
)


def _approval(r: tuple, now: float, node: str = "") -> Approval:
    """A row as the record callers see: a pending question past its deadline, or whose waiting
    process is gone, is timed_out (nobody acts on it any more). node: the reader's (a waiter on
    another node is judged alive: this host's /proc cannot tell)."""
    state = r[8]
    if state == "pending" and (r[7] <= now or (r[12] and not owner_alive(r[12], node))):
        state = "timed_out"
    return Approval(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], state, r[9], r[10], r[11])


_NODE_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")  # as config's [cluster] node


def _node_name(name: object, *, empty: bool = False) -> None:
    if isinstance(name, str) and ((empty and name == "") or _NODE_NAME.match(name)):
        return
    raise InvalidArgument(
        f"a node name is 1-63 lower-case letters, digits and '-' (not starting with '-'), got {name!r}"
    )


def _split(tiers: str) -> tuple[str, ...]:
    return tuple(t for t in tiers.split(",") if t)


PG_KEY_PREFIX = "pg:"
_TIMING_COLUMNS = ("sandbox_id", "stage", "duration_ms", "on_path")
_POOL_COST_COLUMNS = ("pool", "sandbox_id", "cpu_s", "gib_s", "wall_s")


def _tenant_lock(tenant: Tenant | None) -> tuple[str, ...]:
    """The advisory lock around a tenant's quota check and the write it allows (PostgreSQL)."""
    return () if tenant is None else (f"tenant:{tenant.name}",)


def redacted(url: str) -> str:
    """A PostgreSQL URL as an error may show it: no password."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


def schema_statements() -> builtins.list[str]:
    """The registry's DDL in the order a migration runs it: the columns added since version 1
    (each where missing), then every table and index (where missing)."""
    return [*_ADDED_COLUMNS, *(stmt.strip() for stmt in SCHEMA.split(";") if stmt.strip())]


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


def bounds_of(cluster: ClusterSettings) -> Bounds:
    """The registry's waits as ``[cluster]`` sets them (SQLite keeps its own busy timeout)."""
    return Bounds(
        lock_s=cluster.lock_timeout,
        statement_s=cluster.statement_timeout,
        idle_s=cluster.idle_timeout,
        retry_budget_s=cluster.retry_budget,
    )


def schema_version(location: Path | str) -> int | None:
    """A registry's schema version without opening (or migrating) it; None: no registry there yet."""
    if is_url(location):
        d = PostgresDialect(str(location))
        try:
            return d.schema_version()
        finally:
            d.close()
    path = Path(location)
    if not path.exists():
        return None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            return int(db.execute("PRAGMA user_version").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error as e:
        raise RegistryError(f"cannot read the registry at {path}: {e}") from None


def migrate(location: Path | str) -> tuple[int, int]:
    """Bring a registry's schema to this warmbox's (``warmbox db migrate``): (version before, after).
    PostgreSQL: one transaction under an advisory lock (nodes starting together migrate once);
    SQLite migrates itself at every open already."""
    if is_url(location):
        d = PostgresDialect(str(location))
        try:
            return d.migrate(schema_statements(), SCHEMA_VERSION, now=time.time())
        finally:
            d.close()
    path = Path(location)
    before = schema_version(path) or 0
    Registry(path).close()  # a SQLite registry migrates itself at its open
    return before, SCHEMA_VERSION
