"""Settings: ``warmbox.toml`` plus ``WARMBOX_*`` environment overrides, validated into one typed object.

Where the file is: ``$WARMBOX_CONFIG`` if set, else ``$WARMBOX_HOME/warmbox.toml``; a missing
file means the built-in defaults below. Environment overrides use ``__`` as the path separator,
e.g. ``WARMBOX_DEFAULTS__TIMEOUT=60`` or ``WARMBOX_POOLS__DEFAULT__TARGET=4``; values are parsed
as TOML scalars (``4``, ``0.5``, ``true``, ``"text"``) and fall back to a plain string.

An operator sees everything in one file::

    [defaults]
    tier = "container"
    template = "base"
    timeout = 300

    [templates]
    registry_mirror = "https://mirror.example"  # Docker Hub images (FROM python:3.11-slim) come from
                                        # it; [https://|http://]host[:port][/prefix]; "" = docker.io

    [templates.pydata]                  # a template = an image + a warm-up
    warmup_code = "import numpy, pandas"
    warmup_commands = []

    [pools.pydata]                      # a pool keeps ready sandboxes of one shape
    template = "pydata"
    tier = "container"
    min = 0                             # never below (autoscaling floor)
    max = 8                             # never above (autoscaling ceiling)
    target = 2                          # size at start; follows demand between min and max
    max_age = 3600                      # a pooled sandbox older than this is replaced
    idle_shrink = 120                   # halve the target after this long without a request
    limits = { memory_mb = 512, cpus = 1.0 }

    [limits]                            # the most one sandbox may ask for (LimitTooHigh above)
    max_memory_mb = 8192                # default: host MemTotal minus a reserve (up to MemTotal)
    max_cpus = 4                        # default: the CPUs this process may run on (the most)
    max_pids = 4096                     # default: a quarter of the host's pids (up to all of them)
    max_tmp_mb = 1024                   # default: max_memory_mb; a sandbox's tmp_mb <= its memory_mb
    max_file_size_mb = 10240            # default: the size of the disk holding /var/lib/warmbox
    max_open_files = 65536              # default: 65536 (up to fs.nr_open)
    max_disk_mb = 20480                 # default: the size of the disk holding /var/lib/warmbox; a
                                        # sandbox also needs its disk_mb free there (less a reserve)

    [cost]                              # prices: the console shows money beside cpu-s and GiB-s
    cpu_hour = 0.05                     # per CPU-hour of a sandbox's processes (0: no money shown)
    gib_hour = 0.01                     # per GiB-hour of memory in use
    currency = "USD"

    [server]                            # warmbox serve
    host = "127.0.0.1"                  # a non-loopback address needs tls_cert/tls_key (keys always)
    port = 7420
    socket = "/run/warmbox/api.sock"    # also listen here; "" = no unix socket
    tls_cert = ""                       # PEM files; both or neither
    tls_key = ""
    tls_client_ca = ""                  # PEM CA: TCP clients must present a certificate it signed
    peers = { 1000 = "alice" }          # unix-socket callers without a key: uid -> tenant (root = admin)
    max_body_mb = 512                   # largest upload (files are written whole, never partially)
    body_timeout = 300                  # seconds a request body (and, up to 30, its head) may take to arrive
    metrics = true                      # GET /metrics (Prometheus text; root, admin keys; a tenant key: its own)
    log_format = "text"                 # "json": one JSON object per line (ts, level, msg, request_id, ...)

Bad settings raise :class:`~warmbox.errors.ConfigError` naming the file and key.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from warmbox.errors import ConfigError, InvalidArgument, LimitTooHigh
from warmbox.models import Limits
from warmbox.network.policy import PRESETS, Rule
from warmbox.templates import spec as template_spec
from warmbox.templates import toml as template_toml
from warmbox.templates.spec import Template as ImageSpec
from warmbox.tiers import canonical_tier

# Built-in templates that run the built-in image (warmbox.images; the table of every built-in
# template, these and the ones built on top of them, is warmbox.templates.builtins). ``base``'s
# warm-up starts the Python code context (so a pooled sandbox's first run_code does not pay an
# interpreter start); ``pydata`` also imports the data stack.
BUILTIN_TEMPLATES: dict[str, dict[str, Any]] = {
    "base": {
        "warmup_code": "",
        "description": "Python 3 (pip, venv, pytest, build), Node.js + npm, git, gcc/make, curl, jq, rg; "
        "code context on first use",
    },
    "pydata": {
        "warmup_code": "import numpy, pandas\ntry:\n    import requests\nexcept ImportError:\n    pass\n"
        "try:\n    import matplotlib.pyplot\nexcept ImportError:\n    pass",
        "description": "base + numpy, pandas, scipy and matplotlib (and requests) imported",
    },
    "shell": {"warmup_code": None, "description": "no code context started (smallest idle footprint)"},
}
# Built-in pool, used while the settings declare no [pools] (an empty [pools] table: no pool):
# empty until there is demand; grows on misses, shrinks back to 0 when idle.
BUILTIN_POOLS: dict[str, dict[str, Any]] = {
    "default": {"template": "base", "tier": "container", "min": 0, "max": 4, "target": 0},
}


@dataclasses.dataclass(frozen=True)
class Template:
    """An image plus what to run before the sandbox is handed out.

    warmup_code: Python run in the default code context (None or "": no context is started
        before the sandbox is handed out; the first run_code starts it).
    warmup_commands: shell commands run in order; each must exit 0.
    """

    name: str
    warmup_code: str | None = ""
    warmup_commands: tuple[str, ...] = ()
    description: str = ""
    build: ImageSpec | None = None  # its image's build spec (warmbox template build NAME), if any


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """One pool: ready sandboxes of one (tier, template, limits) shape."""

    name: str
    template: str = "base"
    tier: str = "container"
    min: int = 0
    max: int = 4
    target: int = 0
    max_age_s: float = 3600.0
    idle_shrink_s: float = 120.0
    refill_concurrency: int = 2
    limits: Limits = dataclasses.field(default_factory=Limits)

    def shape(self) -> tuple[str, str, Limits]:
        return (self.tier, self.template, self.limits)


@dataclasses.dataclass(frozen=True)
class Defaults:
    tier: str = "container"
    template: str = "base"
    timeout_s: float = 300.0


@dataclasses.dataclass(frozen=True)
class NetworkSettings:
    """Where the egress proxy gets out, and how it asks about unknown destinations."""

    upstream_netns: str = ""  # netns name (/run/netns/NAME) or path the proxy connects from; "" = host's
    upstream_dns: tuple[str, ...] = ()  # resolvers the proxy asks; () = nameservers of /etc/resolv.conf
    upstream_ca: str = ""  # CA bundle for upstream TLS of intercepted hosts; "" = system store
    # PEM bundle every linked sandbox trusts beside the host's system CAs (a TLS-intercepting
    # upstream's CA): written into the sandbox with SSL_CERT_FILE, PIP_CERT, ... pointing at it
    extra_ca: str = ""
    presets: tuple[tuple[str, tuple[str, ...]], ...] = ()  # [network.presets]: name -> hosts, over policy.PRESETS
    pip_index_url: str = ""  # the host's PyPI mirror: PIP_INDEX_URL in every linked sandbox, its host allowed
    npm_registry: str = ""  # the host's npm mirror: npm_config_registry in every linked sandbox, its host allowed
    approval_webhook: str = ""  # POSTed {approval_id, sandbox_id, host, port, kind}; may answer {"decision": ...}
    approval_timeout_s: float = 30.0  # an egress attempt waits this long for an answer (callback or queue), then: deny

    def preset_map(self) -> dict[str, tuple[str, ...]]:
        """The presets an allow or deny entry may name: the built-in ones, then warmbox.toml's."""
        return {**PRESETS, **dict(self.presets)}

    def mirror_hosts(self) -> tuple[str, ...]:
        """The hosts of the configured package mirrors (allowed to every sandbox with a network)."""
        return tuple(dict.fromkeys(h for u in (self.pip_index_url, self.npm_registry) if (h := urlsplit(u).hostname)))

    def mirror_env(self) -> dict[str, str]:
        """The environment that points a sandbox's pip and npm at the configured mirrors."""
        env = {}
        if self.pip_index_url:
            env["PIP_INDEX_URL"] = self.pip_index_url
            u = urlsplit(self.pip_index_url)
            if u.scheme == "http":  # pip ignores a plain-HTTP index unless its host is trusted
                env["PIP_TRUSTED_HOST"] = u.netloc
        if self.npm_registry:
            env["npm_config_registry"] = self.npm_registry
        return env

    def resolvers(self) -> list[str]:
        if self.upstream_dns:
            return list(self.upstream_dns)
        out = []
        try:
            for line in Path("/etc/resolv.conf").read_text().splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    out.append(parts[1])
        except OSError:
            pass
        return out


@dataclasses.dataclass(frozen=True)
class ApprovalSettings:
    """``[approvals]``: which steps wait for a human's answer in the approval queue, and for how long.

    A start (create, fork, resume) waits when it would take its tenant past the daily budget;
    a create also when it asks for more than ``memory_above_mb`` or runs on one of ``tiers``; a
    pool resize when its target is above ``pool_target_above``. Unanswered after ``timeout_s``:
    refused (ApprovalDenied)."""

    timeout_s: float = 300.0  # how long a step waits for an answer (then: ApprovalDenied, state timed_out)
    webhook: str = ""  # http(s) URL POSTed each new question (an Approval as JSON); may answer {"decision": ...}
    webhook_timeout_s: float = 5.0  # how long the webhook's answer is waited for (none: the queue decides)
    memory_above_mb: int = 0  # a create asking for more memory than this needs approval (0: never)
    tiers: tuple[str, ...] = ()  # a create on one of these tiers needs approval
    pool_target_above: int = 0  # a pool resize to a target above this needs approval (0: never)
    budget_lookahead_s: float = 60.0  # a start counts this long of its full CPUs and memory against the budget
    warn_ratio: float = 0.8  # the budget ratio from which a tenant's status warns (metrics, dashboard)


@dataclasses.dataclass(frozen=True)
class MicroVMSettings:
    """The microVM tier. accel: "auto" (probe: KVM when a guest boots under it, else TCG), "kvm" or "tcg"."""

    accel: str = "auto"


LOG_FORMATS = ("text", "json")


@dataclasses.dataclass(frozen=True)
class CostSettings:
    """[cost]: prices that turn metered use into money (the console shows it; 0: not shown).

    cpu_hour: per CPU-hour (3600 cpu-seconds of the sandbox's processes); gib_hour: per GiB-hour of
    memory in use (3600 GiB-seconds); currency: a label (a code such as "USD", or a symbol)."""

    cpu_hour: float = 0.0  # price of a CPU-hour of a sandbox's processes (0 and gib_hour 0: no money shown)
    gib_hour: float = 0.0  # price of a GiB-hour of memory in use
    currency: str = "USD"  # the label after an amount (a code such as USD, or a symbol; at most 8 characters)

    @property
    def priced(self) -> bool:
        return self.cpu_hour > 0 or self.gib_hour > 0

    def money(self, cpu_s: float, gib_s: float) -> float:
        """What ``cpu_s`` cpu-seconds and ``gib_s`` GiB-seconds cost at these prices."""
        return cpu_s / 3600 * self.cpu_hour + gib_s / 3600 * self.gib_hour


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """``[server]``: where ``warmbox serve`` listens and how it bounds requests."""

    host: str = "127.0.0.1"
    port: int = 7420
    socket: str = ""  # "" = the home's run/api.sock
    tls_cert: str = ""
    tls_key: str = ""
    # with tls_cert: TCP clients must present a certificate signed by this CA (PEM file; "" = none
    # asked). tls_client_optional: one is checked when presented, not required (a cluster node
    # with [cluster] direct_access)
    tls_client_ca: str = ""
    tls_client_optional: bool = False
    peers: tuple[tuple[int, str], ...] = ()  # unix-socket uid -> tenant
    max_body_mb: int = 512
    body_timeout_s: float = 300.0
    # registries (``host[:port]``) a tenant's template may be pulled from; admin keys may pull from
    # any. The pull runs on the server's host, outside every sandbox's network policy: without this
    # list a tenant could make the host connect to anything it reaches (loopback, internal services).
    template_registries: tuple[str, ...] = ()
    metrics: bool = True  # serve GET /metrics (Prometheus; root, admin keys, or a tenant key for its own series)
    log_format: str = "text"  # "json": one JSON object per log line (request ids, tenant, route, status)


@dataclasses.dataclass(frozen=True)
class HostCapacity:
    """What this host has, as far as one sandbox's limits go."""

    memory_mb: int  # MemTotal
    cpus: int  # CPUs this process (and so the sandboxes it starts) may run on
    pids: int  # min(kernel.pid_max, kernel.threads-max)
    open_files: int  # fs.nr_open: the largest RLIMIT_NOFILE the kernel accepts
    disk_mb: int  # size of the filesystem holding the sandboxes' state


def _read_int(path: str, default: int) -> int:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def host_capacity() -> HostCapacity:
    mem_kb = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    # the sandboxes' state lives under WARMBOX_RUNTIME_DIR or /var/lib/warmbox: the nearest that exists
    where = Path(os.environ.get("WARMBOX_RUNTIME_DIR") or "/var/lib/warmbox").expanduser()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
        disk_mb = st.f_blocks * st.f_frsize >> 20
    except OSError:
        disk_mb = 1 << 20
    return HostCapacity(
        memory_mb=mem_kb >> 10 or 1024,
        cpus=max(1, cpus),
        pids=min(_read_int("/proc/sys/kernel/pid_max", 32768), _read_int("/proc/sys/kernel/threads-max", 32768)),
        open_files=_read_int("/proc/sys/fs/nr_open", 1 << 20),
        disk_mb=max(1, disk_mb),
    )


# [limits] key -> (the Limits field it bounds, unit shown in messages)
LIMIT_KEYS = {
    "max_memory_mb": ("memory_mb", "MiB"),
    "max_cpus": ("cpus", "CPUs"),
    "max_pids": ("pids", "pids"),
    "max_tmp_mb": ("tmp_mb", "MiB"),
    "max_file_size_mb": ("file_size_mb", "MiB"),
    "max_open_files": ("open_files", "files"),
    "max_disk_mb": ("disk_mb", "MiB"),
}
DEFAULT_MAX_OPEN_FILES = 65536


def memory_reserve_mb(total_mb: int) -> int:
    """What the host keeps for itself by default: a tenth of its memory, at least 256 MiB."""
    return max(256, total_mb // 10)


def disk_reserve_mb(total_mb: int) -> int:
    """What a new sandbox's disk must leave free on the disk holding the sandboxes: a fiftieth of
    it, at least 1 GiB (snapshots, logs and the registry are written there too)."""
    return max(1024, total_mb // 50)


def check_disk_free(limits: Limits, runtime: Path) -> None:
    """LimitTooHigh if the disk holding ``runtime`` (the sandboxes' state) has less than
    ``limits.disk_mb`` free beyond its reserve: that sandbox alone could fill it. Read at each
    allocation, as the free space moves (a statvfs)."""
    where = runtime
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError:
        return  # no disk to measure: the image's own creation fails if there is no room
    total, free = st.f_blocks * st.f_frsize >> 20, st.f_bavail * st.f_frsize >> 20
    reserve = disk_reserve_mb(total)
    most = max(0, free - reserve)
    if limits.disk_mb > most:
        _too_high(
            "disk_mb",
            limits.disk_mb,
            "the free space of the disk holding the sandboxes",  # never its host path: tenants read this
            most,
            "MiB",
            f"{free} MiB free of {total} MiB, less a reserve of {reserve} MiB: a sandbox's disk must fit "
            "in what is free",
        )


@dataclasses.dataclass(frozen=True)
class LimitSettings:
    """The most one sandbox may ask for: ``[limits]`` of warmbox.toml, bounded by the host.

    sources: for each max_* key, where its value comes from (the host, a built-in default,
    the file, or a WARMBOX_LIMITS__* variable).
    """

    max_memory_mb: int
    max_cpus: float
    max_pids: int
    max_tmp_mb: int
    max_file_size_mb: int
    max_open_files: int
    max_disk_mb: int
    sources: dict[str, str] = dataclasses.field(default_factory=dict)

    def check(self, limits: Limits) -> None:
        """Raise LimitTooHigh naming the first limit above its maximum (and where that comes from)."""
        for key, (field, unit) in LIMIT_KEYS.items():
            value, most = getattr(limits, field), getattr(self, key)
            if value > most:
                _too_high(field, value, f"[limits] {key}", most, unit, self.sources.get(key, ""))
        if limits.tmp_mb > limits.memory_mb:
            _too_high(
                "tmp_mb",
                limits.tmp_mb,
                "its limits.memory_mb",
                limits.memory_mb,
                "MiB",
                "tmpfs pages are charged to the sandbox's memory",
            )


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v}"


def _too_high(field: str, value: float, key: str, most: float, unit: str, source: str) -> None:
    raise LimitTooHigh(
        f"limits.{field} = {value!r} is above {key} = {_fmt(most)} {unit} ({source})",
        limit=field,
        value=value,
        maximum=most,
        source=source,
    )


def _limits(t: dict, source: str, env_keys: frozenset[str], host: HostCapacity | None = None) -> LimitSettings:
    """[limits]: each maximum is the admin's value if set, else a default; never above the host."""
    for k in t:
        if f"max_{k}" in LIMIT_KEYS:  # a sandbox's limit where the most one may ask for goes
            raise ConfigError(
                f"{source}: unknown key limits.{k}: [limits] holds the most one sandbox may ask for "
                f"(max_{k} = ...); a sandbox's own limits are given at create, a pool's in its limits table"
            )
    _only(t, set(LIMIT_KEYS), "limits", source)
    host = host_capacity() if host is None else host
    reserve = memory_reserve_mb(host.memory_mb)
    mem = f"host MemTotal {host.memory_mb} MiB"
    cpus = f"the {host.cpus} CPUs warmbox may run on"
    disk = f"the size of the disk holding the sandboxes, {host.disk_mb} MiB"
    # key -> (default, where it comes from, hard host bound, what that bound is)
    table: dict[str, tuple[float, str, float, str]] = {
        "max_memory_mb": (
            max(16, host.memory_mb - reserve),
            f"the default: {mem} minus a {reserve} MiB reserve",
            host.memory_mb,
            mem,
        ),
        "max_cpus": (host.cpus, f"the default: {cpus}", host.cpus, cpus),
        "max_pids": (
            max(8, host.pids // 4),
            f"the default: a quarter of the host's {host.pids} pids",
            host.pids,
            f"the host's kernel.pid_max/threads-max, {host.pids}",
        ),
        "max_file_size_mb": (host.disk_mb, f"the default: {disk}", host.disk_mb, disk),
        "max_open_files": (
            min(DEFAULT_MAX_OPEN_FILES, host.open_files),
            "the default",
            host.open_files,
            f"the host's fs.nr_open, {host.open_files}",
        ),
        "max_disk_mb": (host.disk_mb, f"the default: {disk}", host.disk_mb, disk),
    }
    values: dict[str, float] = {}
    sources: dict[str, str] = {}

    def given(key: str) -> str:
        return f"WARMBOX_LIMITS__{key.upper()}" if key in env_keys else f"{source} [limits] {key}"

    for key, (default, why, bound, bound_why) in table.items():
        if key not in t:
            values[key], sources[key] = default, why
            continue
        where = f"limits.{key}" + (f" ({given(key)})" if key in env_keys else "")
        if key == "max_cpus":
            v = _num(t[key], where, source, 0.01, 1e6)
        else:
            v = _int(t[key], where, source, 1, 1 << 40)
        values[key], sources[key] = (
            (v, given(key)) if v <= bound else (bound, f"{bound_why}; {given(key)} asks for {_fmt(v)}")
        )
    key = "max_tmp_mb"
    if key in t:
        v = _int(t[key], f"limits.{key}" + (f" ({given(key)})" if key in env_keys else ""), source, 1, 1 << 40)
        values[key], sources[key] = (
            (v, given(key))
            if v <= values["max_memory_mb"]
            else (values["max_memory_mb"], f"max_memory_mb; {given(key)} asks for {v}")
        )
    else:
        values[key], sources[key] = values["max_memory_mb"], "the default: max_memory_mb"
    return LimitSettings(
        max_memory_mb=int(values["max_memory_mb"]),
        max_cpus=float(values["max_cpus"]),
        max_pids=int(values["max_pids"]),
        max_tmp_mb=int(values["max_tmp_mb"]),
        max_file_size_mb=int(values["max_file_size_mb"]),
        max_open_files=int(values["max_open_files"]),
        max_disk_mb=int(values["max_disk_mb"]),
        sources={k: sources[k] for k in LIMIT_KEYS},
    )


PAUSED_RETENTION_S = 7 * 24 * 3600.0
IDEMPOTENCY_TTL_S = 24 * 3600.0  # [lifecycle] idempotency_ttl: how long a key's record is kept


@dataclasses.dataclass(frozen=True)
class ClusterSettings:
    """``[cluster]``: this home as one node of a warmbox cluster (Ray for membership and liveness,
    PostgreSQL for the registry, S3 for snapshots). Every field empty: one host, embedded defaults."""

    registry: str = ""  # "" = SQLite in the home; "postgresql://…" = the cluster's shared registry
    ray: str = ""  # the Ray head's GCS address, HOST:PORT ("ray://HOST:PORT" accepted)
    node: str = ""  # this node's name in the cluster ("" = not a cluster node)
    object_store: str = ""  # "s3://bucket/prefix" shared by every node ("" = WARMBOX_OBJECT_STORE or local)
    token_file: str = ""  # the file holding the secret the API tier and the nodes share (peer auth)
    slots: int = 0  # sandboxes this node offers (0 = from the host's capacity)
    # the cluster's certificates (docs/cluster.md): ca.crt (every member), ca.key (the head's host
    # only), and each member's own <member>.crt/.key ("" = the token file's directory)
    tls_dir: str = ""
    # a node's API takes tenant keys too (not only the router's peer requests and admin keys), and
    # TCP callers without a cluster certificate; it still holds every create to its slots
    direct_access: bool = False
    # every wait on the registry is bounded (seconds, wall clock; PostgreSQL's session settings of
    # each registry connection): a lock (lock_timeout), a statement (statement_timeout), and a
    # transaction left open between statements (idle_in_transaction_session_timeout: the server
    # ends the session of a stopped or vanished node, so its locks go). A transaction that timed out
    # is retried until retry_budget, then fails RegistryBusy (HTTP 503). SQLite: busy timeout =
    # lock_timeout, retried the same way.
    lock_timeout: float = 5.0
    statement_timeout: float = 30.0
    idle_timeout: float = 10.0
    retry_budget: float = 30.0


@dataclasses.dataclass(frozen=True)
class Settings:
    source: str  # the file read, or "built-in defaults"
    defaults: Defaults
    templates: dict[str, Template]
    pools: dict[str, PoolConfig]
    daemon_idle_exit_s: float = 10.0
    paused_retention_s: float = PAUSED_RETENTION_S  # [lifecycle] paused_retention: then deleted
    idempotency_ttl_s: float = IDEMPOTENCY_TTL_S  # [lifecycle] idempotency_ttl: a key's record, then forgotten
    network: NetworkSettings = NetworkSettings()
    microvm: MicroVMSettings = MicroVMSettings()
    limits: LimitSettings = None  # type: ignore[assignment]  # None: [limits] defaults of this host
    server: ServerSettings = ServerSettings()
    approvals: ApprovalSettings = ApprovalSettings()
    cluster: ClusterSettings = ClusterSettings()
    registry_mirror: str = ""  # [templates] registry_mirror: Docker Hub images are pulled from it
    cost: CostSettings = CostSettings()

    def __post_init__(self) -> None:
        if self.limits is None:
            object.__setattr__(self, "limits", _limits({}, self.source, frozenset()))

    def template(self, name: str) -> Template:
        t = self.templates.get(name)
        if t is None:
            raise InvalidArgument(f"unknown template {name!r} (available: {', '.join(sorted(self.templates))})")
        return t

    def pool_for(self, tier: str, template: str, limits: Limits) -> PoolConfig | None:
        for pool in self.pools.values():
            if pool.shape() == (tier, template, limits):
                return pool
        return None


def shape_key(tier: str, template: Template, limits: Limits, image_id: str = "") -> str:
    """What a pooled sandbox was built to: a claim only takes one of the caller's exact shape.
    image_id: the image it runs (a rebuilt template makes a new shape: the old pool's sandboxes
    retire and the pool refills with the new image)."""
    import hashlib

    raw = repr(
        (tier, template.name, template.warmup_code, template.warmup_commands, dataclasses.astuple(limits), image_id)
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def config_path(home: Path) -> Path:
    env = os.environ.get("WARMBOX_CONFIG")
    return Path(env).expanduser() if env else home / "warmbox.toml"


_cache: dict[Path, tuple[tuple[float, int, str], Settings]] = {}


def load(home: Path) -> Settings:
    """The settings for ``home``; re-read when the file or the environment changes."""
    path = config_path(home)
    try:
        st = path.stat()
        stamp = (st.st_mtime, st.st_size)
    except FileNotFoundError:
        stamp = (0.0, -1)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    env = "\0".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("WARMBOX_"))
    key = (stamp[0], stamp[1], env)
    hit = _cache.get(path)
    if hit is not None and hit[0] == key:
        return hit[1]
    raw: dict[str, Any] = {}
    source = "built-in defaults"
    if stamp[1] >= 0:
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        source = str(path)
    env_keys = _apply_env(raw, os.environ)
    settings = parse(raw, source, env_keys=env_keys)
    _cache[path] = (key, settings)
    return settings


def _apply_env(raw: dict[str, Any], environ: os._Environ | dict[str, str]) -> frozenset[str]:
    """Merge WARMBOX_A__B=v into raw; returns the [limits] keys set this way (sources name them)."""
    limit_keys = set()
    for name, value in environ.items():
        if not name.startswith("WARMBOX_") or "__" not in name:
            continue
        parts = [s.lower() for s in name[len("WARMBOX_") :].split("__")]
        if any(not s for s in parts):
            continue
        node = raw
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"environment {name}: {'.'.join(parts[:-1])} is not a table")
            node = nxt
        try:
            node[parts[-1]] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            node[parts[-1]] = value
        if len(parts) == 2 and parts[0] == "limits":
            limit_keys.add(parts[1])
    return frozenset(limit_keys)


def parse(
    raw: dict[str, Any],
    source: str = "<settings>",
    *,
    env_keys: frozenset[str] = frozenset(),
    host: HostCapacity | None = None,
) -> Settings:
    """env_keys: [limits] keys that came from WARMBOX_LIMITS__*; host: capacity to bound limits by
    (default: this host's)."""
    known = {
        "defaults",
        "templates",
        "pools",
        "daemon",
        "network",
        "microvm",
        "limits",
        "server",
        "lifecycle",
        "approvals",
        "cluster",
        "cost",
    }
    for k in raw:
        if k not in known:
            raise ConfigError(f"{source}: unknown section [{k}] (known: {', '.join(sorted(known))})")
    d = _table(raw, "defaults", source)
    _only(d, {"tier", "template", "timeout"}, "defaults", source)
    defaults = Defaults(
        tier=_tier(d.get("tier", "container"), "defaults.tier", source),
        template=_str(d.get("template", "base"), "defaults.template", source),
        timeout_s=_num(d.get("timeout", 300.0), "defaults.timeout", source, 1, 86400),
    )
    templates = {n: Template(name=n, **t) for n, t in BUILTIN_TEMPLATES.items()}
    templates_raw = dict(_table(raw, "templates", source))
    mirror = templates_raw.pop("registry_mirror", "")
    if mirror:
        try:
            template_spec.check_mirror(mirror)
        except InvalidArgument as e:
            raise ConfigError(f"{source}: templates.registry_mirror: {e}") from None
    for name, t in templates_raw.items():
        where = f"templates.{name}"
        t = _as_table(t, where, source)
        _only(t, {"warmup_code", "warmup_commands", "description", *template_toml.BUILD_KEYS}, where, source)
        try:
            build = template_toml.spec_from_table(t, os.path.dirname(os.path.abspath(source)))
        except InvalidArgument as e:
            raise ConfigError(f"{source}: {where}: {e}") from None
        base = BUILTIN_TEMPLATES.get(name, {})
        code = t.get("warmup_code", base.get("warmup_code", ""))
        if code is not None and not isinstance(code, str):
            raise ConfigError(f"{source}: {where}.warmup_code must be a string")
        cmds = t.get("warmup_commands", [])
        if not isinstance(cmds, list) or not all(isinstance(c, str) and c.strip() for c in cmds):
            raise ConfigError(f"{source}: {where}.warmup_commands must be a list of non-empty strings")
        templates[name] = Template(
            name=name,
            warmup_code=code,
            warmup_commands=tuple(cmds),
            description=_str(t.get("description", base.get("description", "")), f"{where}.description", source),
            build=build,
        )
    if defaults.template not in templates:
        raise ConfigError(f"{source}: defaults.template {defaults.template!r} is not a template")
    maxima = _limits(_table(raw, "limits", source), source, env_keys, host)
    # the built-in pool exists only while the settings declare no [pools] at all
    pools_raw = dict(BUILTIN_POOLS) if "pools" not in raw else {}
    for name, body in _table(raw, "pools", source).items():
        pools_raw[name] = dict(_as_table(body, f"pools.{name}", source))
    pools = {}
    for name, body in pools_raw.items():
        where = f"pools.{name}"
        if not name.replace("-", "").replace("_", "").isalnum() or len(name) > 40:
            raise ConfigError(f"{source}: pool name {name!r} must be letters, digits, '-' or '_'")
        _only(
            body,
            {"template", "tier", "min", "max", "target", "max_age", "idle_shrink", "refill_concurrency", "limits"},
            where,
            source,
        )
        template = _str(body.get("template", "base"), f"{where}.template", source)
        if template not in templates:
            raise ConfigError(f"{source}: {where}.template {template!r} is not a template")
        lo = _int(body.get("min", 0), f"{where}.min", source, 0, 1000)
        hi = _int(body.get("max", max(lo, 4)), f"{where}.max", source, 0, 1000)
        if hi < lo:
            raise ConfigError(f"{source}: {where}: max ({hi}) is below min ({lo})")
        target = _int(body.get("target", lo), f"{where}.target", source, 0, 1000)
        limits_raw = _as_table(body.get("limits", {}), f"{where}.limits", source)
        _only(limits_raw, {f.name for f in dataclasses.fields(Limits)}, f"{where}.limits", source)
        try:
            limits = Limits(**limits_raw)
        except TypeError as e:
            raise ConfigError(f"{source}: {where}.limits: {e}") from None
        except InvalidArgument as e:
            raise ConfigError(f"{source}: {where}.{e}") from None
        try:
            maxima.check(limits)
        except LimitTooHigh as e:
            if "pools" not in raw:  # the built-in pool, beyond what [limits] allows: not kept
                continue
            raise ConfigError(f"{source}: {where}.{e}") from None
        pools[name] = PoolConfig(
            name=name,
            template=template,
            tier=_tier(body.get("tier", "container"), f"{where}.tier", source),
            min=lo,
            max=hi,
            target=min(max(target, lo), hi),
            max_age_s=_num(body.get("max_age", 3600.0), f"{where}.max_age", source, 60, 7 * 86400),
            idle_shrink_s=_num(body.get("idle_shrink", 120.0), f"{where}.idle_shrink", source, 1, 7 * 86400),
            refill_concurrency=_int(body.get("refill_concurrency", 2), f"{where}.refill_concurrency", source, 1, 64),
            limits=limits,
        )
    shapes: dict[tuple, str] = {}
    for pool in pools.values():
        other = shapes.setdefault(pool.shape(), pool.name)
        if other != pool.name:
            raise ConfigError(f"{source}: pools {other} and {pool.name} have the same tier, template and limits")
    dm = _table(raw, "daemon", source)
    _only(dm, {"idle_exit"}, "daemon", source)
    lc = _table(raw, "lifecycle", source)
    _only(lc, {"paused_retention", "idempotency_ttl"}, "lifecycle", source)
    return Settings(
        source=source,
        defaults=defaults,
        templates=templates,
        pools=pools,
        daemon_idle_exit_s=_num(dm.get("idle_exit", 10.0), "daemon.idle_exit", source, 0.1, 86400),
        paused_retention_s=_num(
            lc.get("paused_retention", PAUSED_RETENTION_S), "lifecycle.paused_retention", source, 1.0, 365 * 86400.0
        ),
        idempotency_ttl_s=_num(
            lc.get("idempotency_ttl", IDEMPOTENCY_TTL_S), "lifecycle.idempotency_ttl", source, 1.0, 365 * 86400.0
        ),
        network=_network(_table(raw, "network", source), source),
        microvm=_microvm(_table(raw, "microvm", source), source),
        limits=maxima,
        server=_server(_table(raw, "server", source), source),
        approvals=_approvals(_table(raw, "approvals", source), source),
        cluster=_cluster(_table(raw, "cluster", source), source),
        registry_mirror=mirror,
        cost=_cost(_table(raw, "cost", source), source),
    )


def _cost(t: dict, source: str) -> CostSettings:
    _only(t, {"cpu_hour", "gib_hour", "currency"}, "cost", source)
    currency = _str(t.get("currency", "USD"), "cost.currency", source)
    if not currency or len(currency) > 8 or any(c.isspace() or c in "<>&\"'" for c in currency):
        raise ConfigError(f"{source}: cost.currency is a short label such as USD or €, got {currency[:20]!r}")
    return CostSettings(
        cpu_hour=_num(t.get("cpu_hour", 0.0), "cost.cpu_hour", source, 0, 1e6),
        gib_hour=_num(t.get("gib_hour", 0.0), "cost.gib_hour", source, 0, 1e6),
        currency=currency,
    )


_NODE_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def _cluster(t: dict, source: str) -> ClusterSettings:
    _only(t, {f.name for f in dataclasses.fields(ClusterSettings)}, "cluster", source)
    registry = _str(t.get("registry", ""), "cluster.registry", source)
    if registry and not registry.startswith(("postgresql://", "postgres://")):
        raise ConfigError(f"{source}: cluster.registry must be a postgresql:// URL (or empty for SQLite in the home)")
    ray = _str(t.get("ray", ""), "cluster.ray", source).removeprefix("ray://")
    node = _str(t.get("node", ""), "cluster.node", source)
    if node and not _NODE_NAME.match(node):
        raise ConfigError(f"{source}: cluster.node {node!r}: lower-case letters, digits and '-', at most 63")
    store = _str(t.get("object_store", ""), "cluster.object_store", source)
    if store and not store.startswith("s3://"):
        raise ConfigError(f"{source}: cluster.object_store must be an s3:// URL")
    return ClusterSettings(
        registry=registry,
        ray=ray,
        node=node,
        object_store=store,
        token_file=_str(t.get("token_file", ""), "cluster.token_file", source),
        slots=_int(t.get("slots", 0), "cluster.slots", source, 0, 100000),
        tls_dir=_str(t.get("tls_dir", ""), "cluster.tls_dir", source),
        direct_access=_bool(t.get("direct_access", False), "cluster.direct_access", source),
        lock_timeout=_num(t.get("lock_timeout", 5.0), "cluster.lock_timeout", source, 0.1, 600),
        statement_timeout=_num(t.get("statement_timeout", 30.0), "cluster.statement_timeout", source, 1, 3600),
        idle_timeout=_num(t.get("idle_timeout", 10.0), "cluster.idle_timeout", source, 1, 3600),
        retry_budget=_num(t.get("retry_budget", 30.0), "cluster.retry_budget", source, 0, 3600),
    )


def _approvals(t: dict, source: str) -> ApprovalSettings:
    _only(
        t,
        {
            "timeout",
            "webhook",
            "webhook_timeout",
            "memory_above_mb",
            "tiers",
            "pool_target_above",
            "budget_lookahead",
            "warn_ratio",
        },
        "approvals",
        source,
    )
    hook = _str(t.get("webhook", ""), "approvals.webhook", source)
    if hook and not hook.startswith(("http://", "https://")):
        raise ConfigError(f"{source}: approvals.webhook must be an http(s) URL, got {hook!r}")
    tiers = t.get("tiers", [])
    if not isinstance(tiers, list):
        raise ConfigError(f"{source}: approvals.tiers must be a list of tier names, got {tiers!r}")
    return ApprovalSettings(
        timeout_s=_num(t.get("timeout", 300.0), "approvals.timeout", source, 0.1, 600),
        webhook=hook,
        webhook_timeout_s=_num(t.get("webhook_timeout", 5.0), "approvals.webhook_timeout", source, 0.1, 60),
        memory_above_mb=_int(t.get("memory_above_mb", 0), "approvals.memory_above_mb", source, 0, 1 << 30),
        tiers=tuple(dict.fromkeys(_tier(x, "approvals.tiers", source) for x in tiers)),
        pool_target_above=_int(t.get("pool_target_above", 0), "approvals.pool_target_above", source, 0, 1 << 20),
        budget_lookahead_s=_num(t.get("budget_lookahead", 60.0), "approvals.budget_lookahead", source, 0, 86400),
        warn_ratio=_num(t.get("warn_ratio", 0.8), "approvals.warn_ratio", source, 0.01, 1.0),
    )


def _server(t: dict, source: str) -> ServerSettings:
    _only(
        t,
        {
            "host",
            "port",
            "socket",
            "tls_cert",
            "tls_key",
            "tls_client_ca",
            "peers",
            "max_body_mb",
            "body_timeout",
            "template_registries",
            "metrics",
            "log_format",
        },
        "server",
        source,
    )
    registries = t.get("template_registries", [])
    if not isinstance(registries, list) or not all(
        isinstance(r, str) and r and "/" not in r and not any(c.isspace() for c in r) for r in registries
    ):
        raise ConfigError(f"{source}: server.template_registries is a list of 'host[:port]' strings")
    cert = _str(t.get("tls_cert", ""), "server.tls_cert", source)
    key = _str(t.get("tls_key", ""), "server.tls_key", source)
    if bool(cert) != bool(key):
        raise ConfigError(f"{source}: server.tls_cert and server.tls_key go together (both or neither)")
    client_ca = _str(t.get("tls_client_ca", ""), "server.tls_client_ca", source)
    if client_ca and not cert:
        raise ConfigError(
            f"{source}: server.tls_client_ca asks TCP clients for a certificate: it needs tls_cert/tls_key"
        )
    metrics = t.get("metrics", True)
    if not isinstance(metrics, bool):
        raise ConfigError(f"{source}: server.metrics is true or false, got {metrics!r}")
    log_format = t.get("log_format", "text")
    if log_format not in LOG_FORMATS:
        raise ConfigError(f"{source}: server.log_format must be one of {list(LOG_FORMATS)}, got {log_format!r}")
    peers = []
    for uid, tenant in _as_table(t.get("peers", {}), "server.peers", source).items():
        if not str(uid).isdigit() or not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"{source}: server.peers maps a numeric uid to a tenant name, got {uid!r} = {tenant!r}")
        peers.append((int(uid), tenant))
    return ServerSettings(
        host=_str(t.get("host", "127.0.0.1"), "server.host", source),
        port=_int(t.get("port", 7420), "server.port", source, 0, 65535),
        socket=_str(t.get("socket", ""), "server.socket", source),
        tls_cert=cert,
        tls_key=key,
        tls_client_ca=client_ca,
        template_registries=tuple(r.lower() for r in registries),
        peers=tuple(peers),
        max_body_mb=_int(t.get("max_body_mb", 512), "server.max_body_mb", source, 1, 1 << 20),
        body_timeout_s=_num(t.get("body_timeout", 300.0), "server.body_timeout", source, 1, 86400),
        metrics=metrics,
        log_format=log_format,
    )


def _microvm(m: dict, source: str) -> MicroVMSettings:
    _only(m, {"accel"}, "microvm", source)
    accel = _str(m.get("accel", "auto"), "microvm.accel", source)
    if accel not in ("auto", "kvm", "tcg"):
        raise ConfigError(f'{source}: microvm.accel must be "auto", "kvm" or "tcg", got {accel!r}')
    return MicroVMSettings(accel=accel)


def _network(n: dict, source: str) -> NetworkSettings:
    import ipaddress

    _only(
        n,
        {
            "upstream_netns",
            "upstream_dns",
            "upstream_ca",
            "extra_ca",
            "presets",
            "pip_index_url",
            "npm_registry",
            "approval_webhook",
            "approval_timeout",
        },
        "network",
        source,
    )
    dns = n.get("upstream_dns", [])
    if isinstance(dns, str):
        dns = [dns]
    if not isinstance(dns, list):
        raise ConfigError(f"{source}: network.upstream_dns must be a list of IP addresses")
    for a in dns:
        try:
            ipaddress.ip_address(a)
        except (ValueError, TypeError):
            raise ConfigError(f"{source}: network.upstream_dns entry {a!r} is not an IP address") from None
    hook = _str(n.get("approval_webhook", ""), "network.approval_webhook", source)
    if hook and not hook.startswith(("http://", "https://")):
        raise ConfigError(f"{source}: network.approval_webhook must be an http(s) URL, got {hook!r}")
    ca = _str(n.get("upstream_ca", ""), "network.upstream_ca", source)
    if ca and not Path(ca).is_file():
        raise ConfigError(f"{source}: network.upstream_ca {ca!r} is not a file")
    extra = _str(n.get("extra_ca", ""), "network.extra_ca", source)
    if extra:
        _check_pem_bundle(extra, "network.extra_ca", source)
    presets = []
    for name, hosts in _as_table(n.get("presets", {}), "network.presets", source).items():
        if not isinstance(hosts, list) or not hosts:
            raise ConfigError(f"{source}: network.presets.{name} must be a non-empty list of host names")
        try:
            presets.append((name, tuple(Rule.parse(h, f"network.presets.{name}").pattern for h in hosts)))
        except InvalidArgument as e:
            raise ConfigError(f"{source}: {e}") from None
    mirrors = {}
    for key in ("pip_index_url", "npm_registry"):
        url = _str(n.get(key, ""), f"network.{key}", source)
        if url:
            u = urlsplit(url)
            if u.scheme not in ("http", "https") or not u.hostname or any(c in url for c in " \r\n\t\0"):
                raise ConfigError(f"{source}: network.{key} must be an http(s) URL, got {url!r}")
            if u.username or u.password:
                raise ConfigError(f"{source}: network.{key}: no credentials in the URL (it enters every sandbox)")
        mirrors[key] = url
    return NetworkSettings(
        upstream_netns=_str(n.get("upstream_netns", ""), "network.upstream_netns", source),
        upstream_dns=tuple(dns),
        upstream_ca=ca,
        extra_ca=extra,
        presets=tuple(presets),
        pip_index_url=mirrors["pip_index_url"],
        npm_registry=mirrors["npm_registry"],
        approval_webhook=hook,
        approval_timeout_s=_num(n.get("approval_timeout", 30.0), "network.approval_timeout", source, 0.1, 600),
    )


def _check_pem_bundle(path: str, where: str, source: str) -> None:
    """``path`` is a readable file of one or more PEM certificates (ConfigError otherwise)."""
    from cryptography import x509

    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{source}: {where} {path!r} cannot be read: {e.strerror}") from None
    try:
        x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ConfigError(f"{source}: {where} {path!r} is not a bundle of PEM certificates") from None


def _table(raw: dict, key: str, source: str) -> dict:
    return _as_table(raw.get(key, {}), key, source)


def _as_table(v: object, where: str, source: str) -> dict:
    if not isinstance(v, dict):
        raise ConfigError(f"{source}: {where} must be a table")
    return v


def _only(t: dict, allowed: set[str], where: str, source: str) -> None:
    for k in t:
        if k not in allowed:
            raise ConfigError(f"{source}: unknown key {where}.{k} (known: {', '.join(sorted(allowed))})")


def _str(v: object, where: str, source: str) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{source}: {where} must be a string, got {v!r}")
    return v


def _bool(v: object, where: str, source: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{source}: {where} must be true or false, got {v!r}")
    return v


def _tier(v: object, where: str, source: str) -> str:
    try:
        return canonical_tier(_str(v, where, source))
    except InvalidArgument as e:
        raise ConfigError(f"{source}: {where}: {e}") from None


def _num(v: object, where: str, source: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise ConfigError(f"{source}: {where} must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def _int(v: object, where: str, source: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(f"{source}: {where} must be an integer in [{lo}, {hi}], got {v!r}")
    return v
