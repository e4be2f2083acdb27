"""The registry's schema: every table and index, and the columns added since version 1 (one schema:
migrations are per database, not per store)."""

from __future__ import annotations

import builtins

SCHEMA_VERSION = 21
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
CREATE TABLE IF NOT EXISTS metric_samples (
    sandbox_id   TEXT NOT NULL,
    at           REAL NOT NULL,
    cpu_ns       INTEGER NOT NULL,
    cpu_pct      REAL NOT NULL,
    memory_bytes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS metric_samples_sandbox ON metric_samples(sandbox_id, at);
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
    # version 21: metric_samples (a new table, made by SCHEMA): each live sandbox's metrics history,
    # a bounded ring (METRIC_SAMPLE_EVERY_S, METRIC_SAMPLES_KEPT)
)

_NET_LINK_COLUMNS = "sandbox_id, address, ifname, policy, updated_at, node"


def schema_statements() -> builtins.list[str]:
    """The registry's DDL in the order a migration runs it: the columns added since version 1
    (each where missing), then every table and index (where missing)."""
    return [*_ADDED_COLUMNS, *(stmt.strip() for stmt in SCHEMA.split(";") if stmt.strip())]
