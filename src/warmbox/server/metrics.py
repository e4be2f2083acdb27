"""``/metrics``: Prometheus families for the server (prometheus-client's registry and exposition).

Two sources. The domain families (sandboxes, creates, stage timings, commands, pools, snapshots,
egress, cost) are derived from the registry at scrape time by :class:`RegistryCollector`: the CLI,
the SDK in process and the pool daemon change the registry from other processes, so only the
registry knows them all, and a restarted server reports the same totals. The HTTP layer's own
request count and latency are counted in this process (:class:`HttpMetrics`).

Who sees what: root on the unix socket and admin keys get every family; any other tenant's key
gets only the registry families filtered to its own tenant (no host-wide pool, process or HTTP
families). The registry's tenant "" (the host's own sandboxes) is labelled ``_host`` (a tenant
name cannot start with "_").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from warmbox.engine.stats import (
    APPROVAL_BUCKETS_S,
    COMMAND_BUCKETS_S,
    LABELS,
    PAUSE_BUCKETS_S,
    STAGE_BUCKETS_S,
    Buckets,
    RegistryStats,
    RegistryTotals,
    Value,
)
from warmbox.errors import RegistryError
from warmbox.models import Tenant

HOST_TENANT = "_host"  # the label of the registry's tenant "" (root's and the CLI's own sandboxes)
HTTP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
WARN_RATIO = 0.8  # a budget's warning ratio when the server passes none ([approvals] warn_ratio)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _tenant_label(name: str) -> str:
    return name or HOST_TENANT


def _labels(family: str, values: tuple[str, ...]) -> list[str]:
    names = LABELS[family]
    return [_tenant_label(v) if n == "tenant" else v for n, v in zip(names, values, strict=True)]


def _gauge(name: str, doc: str, family: str, rows: tuple[Value, ...]) -> GaugeMetricFamily:
    m = GaugeMetricFamily(name, doc, labels=LABELS[family])
    for v in rows:
        m.add_metric(_labels(family, v.labels), v.value)
    return m


def _counter(name: str, doc: str, family: str, rows: tuple[Value, ...]) -> CounterMetricFamily:
    m = CounterMetricFamily(name, doc, labels=LABELS[family])
    for v in rows:
        m.add_metric(_labels(family, v.labels), v.value)
    return m


def _le(bound: float) -> str:
    return repr(float(bound))


def _histogram(
    name: str, doc: str, family: str, rows: tuple[Buckets, ...], bounds: tuple[float, ...]
) -> HistogramMetricFamily:
    m = HistogramMetricFamily(name, doc, labels=LABELS[family])
    for b in rows:
        buckets = [(_le(le), float(c)) for le, c in zip(bounds, b.cumulative, strict=True)]
        m.add_metric(_labels(family, b.labels), [*buckets, ("+Inf", float(b.count))], b.sum)
    return m


def families(t: RegistryTotals) -> Iterator[Metric]:
    """The registry's totals as metric families. Their names and labels are what docs/monitoring's
    dashboard and alert rules query (tests/server/test_metrics.py checks them against each other)."""
    yield _gauge("warmbox_sandboxes", "Sandboxes by state (destroyed ones not counted)", "sandboxes", t.sandboxes)
    yield _counter(
        "warmbox_sandbox_creates",
        "Sandbox creates: started cold (source=cold, forks too; failed starts included) "
        "or claimed from a pool (source=pool)",
        "creates",
        t.creates,
    )
    yield _counter(
        "warmbox_sandbox_create_failures",
        "Creates whose start failed (creating -> failed; a pool's warm-ups: warmbox_pool_warmup_failures_total)",
        "create_failures",
        t.create_failures,
    )
    yield _counter("warmbox_sandbox_pauses", "Pauses (running/ready -> paused)", "pauses", t.pauses)
    yield _counter("warmbox_sandbox_resumes", "Resumes started (paused -> creating)", "resumes", t.resumes)
    yield _counter(
        "warmbox_sandbox_resume_failures",
        "Resumes that failed (creating -> paused again)",
        "resume_failures",
        t.resume_failures,
    )
    yield _histogram(
        "warmbox_stage_duration_seconds",
        "Stage timings of sandbox starts (allocation, filesystem, runtime, dependencies, network, first_command; "
        "request_path=false: done by a pool before anyone asked)",
        "stages",
        t.stages,
        STAGE_BUCKETS_S,
    )
    yield _histogram(
        "warmbox_pause_duration_seconds",
        "Pause durations (snapshot and release; each sandbox's latest pause)",
        "pause_seconds",
        t.pause_seconds,
        PAUSE_BUCKETS_S,
    )
    yield _histogram(
        "warmbox_resume_duration_seconds",
        "Resume durations (each sandbox's latest resume)",
        "resume_seconds",
        t.resume_seconds,
        PAUSE_BUCKETS_S,
    )
    yield _histogram(
        "warmbox_command_duration_seconds",
        "Durations of commands (kind=command), code runs (kind=code) and processes (kind=process)",
        "commands",
        t.commands,
        COMMAND_BUCKETS_S,
    )
    yield _counter(
        "warmbox_command_outcomes",
        "Commands and code runs that timed out, were OOM-killed, had their output truncated, failed, "
        "or exited non-zero",
        "command_outcomes",
        t.command_outcomes,
    )
    yield _gauge("warmbox_pool_target", "Warm pool target size", "pool_target", t.pool_target)
    yield _gauge("warmbox_pool_ready", "Warm sandboxes ready to hand out", "pool_ready", t.pool_ready)
    yield _gauge("warmbox_pool_warming", "Pool sandboxes being created", "pool_warming", t.pool_warming)
    for kind, name, doc in (
        ("hit", "warmbox_pool_hits", "Creates served from the pool"),
        ("miss", "warmbox_pool_misses", "Creates the pool could not serve (started cold)"),
        ("warmed", "warmbox_pool_warmups", "Sandboxes warmed up for the pool"),
        ("warmup_failed", "warmbox_pool_warmup_failures", "Pool warm-ups that failed"),
    ):
        m = CounterMetricFamily(name, doc, labels=["pool"])
        for v in t.pool_events:
            if v.labels[1] == kind:
                m.add_metric([v.labels[0]], v.value)
        yield m
    yield _counter(
        "warmbox_pool_cpu_seconds",
        "CPU seconds of pool sandboxes that ended unclaimed",
        "pool_cpu_seconds",
        t.pool_cpu_seconds,
    )
    yield _counter(
        "warmbox_pool_memory_gib_seconds",
        "Memory GiB-seconds of pool sandboxes that ended unclaimed",
        "pool_gib_seconds",
        t.pool_gib_seconds,
    )
    yield _gauge("warmbox_snapshots", "Stored snapshots (a paused sandbox's among them)", "snapshots", t.snapshots)
    yield _gauge("warmbox_snapshot_bytes", "Bytes of the stored snapshots", "snapshot_bytes", t.snapshot_bytes)
    yield _gauge(
        "warmbox_snapshot_max_bytes", "The largest stored snapshot", "snapshot_max_bytes", t.snapshot_max_bytes
    )
    yield _counter(
        "warmbox_egress_decisions",
        "Egress attempts by kind (http, connect, dns, tcp, ...), decision (allow, deny) and rule class",
        "egress",
        t.egress,
    )
    yield _counter(
        "warmbox_egress_bytes",
        "Bytes through the egress proxy (up: sandbox -> destination)",
        "egress_bytes",
        t.egress_bytes,
    )
    yield _counter(
        "warmbox_tenant_cpu_seconds",
        "CPU seconds used by a tenant's sandboxes (from their claim on)",
        "cpu_seconds",
        t.cpu_seconds,
    )
    yield _counter(
        "warmbox_tenant_memory_gib_seconds",
        "Memory GiB-seconds of a tenant's sandboxes (from their claim on)",
        "gib_seconds",
        t.gib_seconds,
    )


def budget_families(t: RegistryTotals, warn_ratio: float) -> Iterator[Metric]:
    """Today's use of the tenants with a daily budget (UTC day), and whether it warns."""
    yield _gauge(
        "warmbox_budget_used_hours",
        "Use since UTC midnight: cpu-hours (resource=cpu), GiB-hours (resource=memory)",
        "budget_used_hours",
        t.budget_used_hours,
    )
    yield _gauge("warmbox_budget_limit_hours", "Daily budget (0: none)", "budget_limit_hours", t.budget_limit_hours)
    yield _gauge("warmbox_budget_usage_ratio", "Use today / daily budget", "budget_ratio", t.budget_ratio)
    warn = GaugeMetricFamily(
        "warmbox_budget_warning",
        f"1 when a tenant's use today reached {warn_ratio:g} of a budget ([approvals] warn_ratio)",
        labels=["tenant"],
    )
    top: dict[str, float] = {}
    for v in t.budget_ratio:
        top[v.labels[0]] = max(top.get(v.labels[0], 0.0), v.value)
    for name, ratio in sorted(top.items()):
        warn.add_metric([_tenant_label(name)], 1.0 if ratio >= warn_ratio else 0.0)
    yield warn


def approval_families(t: RegistryTotals) -> Iterator[Metric]:
    """The approval queue: questions waiting, opened, closed (approved, denied, timed_out) and how long they waited."""
    yield _gauge(
        "warmbox_approvals_pending",
        "Approval questions waiting for an answer",
        "approvals_pending",
        t.approvals_pending,
    )
    yield _counter("warmbox_approvals_opened", "Approval questions asked", "approvals_opened", t.approvals_opened)
    yield _counter(
        "warmbox_approvals_closed",
        "Approval questions closed: approved, denied or timed_out (a pending one past its deadline counts)",
        "approvals_closed",
        t.approvals_closed,
    )
    yield _histogram(
        "warmbox_approval_wait_seconds",
        "How long a closed question waited (until its answer, or its deadline)",
        "approval_wait",
        t.approval_wait,
        APPROVAL_BUCKETS_S,
    )


class RegistryCollector:
    """A prometheus-client collector of the registry's aggregates, read at each scrape.
    tenant: only that tenant's series (None: every tenant's, and the pools)."""

    def __init__(
        self, stats: RegistryStats, tenant: str | None = None, warn_ratio: Callable[[], float] = lambda: WARN_RATIO
    ) -> None:
        self.stats = stats
        self.tenant = tenant
        self.warn_ratio = warn_ratio

    def collect(self) -> Iterator[Metric]:
        try:
            totals = self.stats.read(self.tenant)
        except RegistryError:
            yield GaugeMetricFamily("warmbox_registry_up", "Whether the registry could be read", value=0)
            return
        yield GaugeMetricFamily("warmbox_registry_up", "Whether the registry could be read", value=1)
        yield GaugeMetricFamily(
            "warmbox_registry_read_seconds",
            "How long this scrape's registry aggregates took",
            value=totals.read_seconds,
        )
        yield GaugeMetricFamily(
            "warmbox_registry_sandboxes_read",
            "Sandboxes whose rows this scrape aggregated (live or recently ended; settled ones are kept in memory)",
            value=totals.sandboxes_read,
        )
        # a family without series is left out (a tenant's view has no pool families at all)
        yield from (m for m in families(totals) if m.samples)
        yield from (m for m in budget_families(totals, self.warn_ratio()) if m.samples)
        yield from (m for m in approval_families(totals) if m.samples)


class HttpMetrics:
    """The server's own requests: count by method, route template and status; latency by method and route."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "warmbox_http_requests",
            "HTTP requests by method, route template and status",
            ["method", "route", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "warmbox_http_request_duration_seconds",
            "HTTP request durations until the response ended (streams included)",
            ["method", "route"],
            buckets=HTTP_BUCKETS_S,
            registry=registry,
        )
        self.in_progress = Gauge("warmbox_http_requests_in_progress", "HTTP requests being served", registry=registry)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        m = method if method in METHODS else "other"
        self.requests.labels(m, route, str(status)).inc()
        self.duration.labels(m, route).observe(seconds)


class Exposition:
    """What /metrics serves: a collector registry of its own (not the library's global one)."""

    def __init__(self, stats: RegistryStats, warn_ratio: Callable[[], float] = lambda: WARN_RATIO) -> None:
        self.stats = stats
        self.warn_ratio = warn_ratio
        self.registry = CollectorRegistry()
        self.http = HttpMetrics(self.registry)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.registry.register(RegistryCollector(stats, warn_ratio=warn_ratio))

    def render(self, tenant: Tenant | None, accept: str) -> tuple[bytes, str]:
        """The exposition for a caller (None: root), in the format its Accept header asks for
        (OpenMetrics or Prometheus text); (body, content type). Runs the registry's SQL: call it
        off the event loop."""
        encode, content_type = choose_encoder(accept)
        if tenant is None or tenant.admin:
            return encode(self.registry), content_type
        own = CollectorRegistry()
        own.register(RegistryCollector(self.stats, tenant.name, self.warn_ratio))
        return encode(own), content_type

    def close(self) -> None:
        self.stats.close()


__all__ = ["HOST_TENANT", "Exposition", "HttpMetrics", "RegistryCollector", "families"]
