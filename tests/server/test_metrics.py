"""/metrics without a sandbox: the registry's aggregates as parsed Prometheus families over a temp
registry with known rows, who may scrape what, the settings, and the JSON request logs."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from warmbox.config import ServerSettings, load
from warmbox.engine.engine import Engine
from warmbox.engine.stats import STAGE_BUCKETS_S, RegistryStats
from warmbox.errors import ConfigError
from warmbox.models import CommandRecord, Limits, NetEvent, StageTiming, State, Tenant
from warmbox.server import logs
from warmbox.server.app import build_app
from warmbox.server.metrics import Exposition
from warmbox.storage.registry import Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger


def _registry(at, tmp) -> Registry:
    # its own uid ledger: these rows never run, so they must not hold real ranges of the host
    return Registry(at, ledger=UidLedger(tmp / "uids", slots=16, first=MAX_SLOTS - 60))


def _sandbox(reg: Registry, sid: str, tenant: str, tier: str = "container", *, pool: str = "") -> None:
    reg.sandboxes.allocate(
        sid,
        tier,
        "base",
        600,
        Limits(),
        "/nonexistent",
        "/nonexistent",
        pool=pool,
        tenant=Tenant(tenant) if tenant else None,
    )


def _command(
    sid: str, kind: str, ms: float, *, exit_code: int | None = None, timed_out: bool = False, error: str = ""
) -> CommandRecord:
    return CommandRecord(
        sid, 0, kind, "echo secret-text", False, "", time.time(), ms, exit_code, error, timed_out, False, False, 3, 0
    )


def _known_rows(reg: Registry) -> None:
    """acme: a1 running with timings, egress and a command count; a2 failed at start. beta: b1
    paused with a 5 MiB snapshot. The host (tenant ""): a pool of 2 with a hit and a miss."""
    _sandbox(reg, "sb-0000000000a1", "acme")
    reg.sandboxes.set_state("sb-0000000000a1", State.READY, "started")
    reg.sandboxes.set_state("sb-0000000000a1", State.RUNNING, "exec")
    reg.sandboxes.add_timings(
        [
            StageTiming("sb-0000000000a1", "allocation", 0.8),
            StageTiming("sb-0000000000a1", "filesystem", 30.0),
            StageTiming("sb-0000000000a1", "runtime", 400.0),
            StageTiming("sb-0000000000a1", "first_command", 7.0),
            StageTiming("sb-0000000000a1", "resume", 300.0),
        ]
    )
    reg.egress.add_net_events(
        [
            NetEvent(
                "sb-0000000000a1", 1.0, "connect", "pypi.org", "1.2.3.4", 443, "allow", "allow:pypi.org", 100, 2000
            ),
            NetEvent(
                "sb-0000000000a1", 2.0, "connect", "files.pypi.org", "1.2.3.5", 443, "allow", "allow:*.pypi.org", 10, 20
            ),
            NetEvent("sb-0000000000a1", 3.0, "dns", "evil.example", "", 53, "deny", "default-deny"),
            NetEvent("sb-0000000000a1", 4.0, "connect", "x", "", 443, "deny", "Weird Rule!"),
        ]
    )
    now = time.time()
    reg.commands.add_commands(
        [
            _command("sb-0000000000a1", "command", 40.0, exit_code=0),
            _command("sb-0000000000a1", "command", 3000.0, exit_code=1),
            _command("sb-0000000000a1", "code", 70000.0, timed_out=True, error="SandboxTimeout"),
        ]
    )
    reg.usage.sample([("sb-0000000000a1", 1 << 30, 0)], now=now)
    reg.usage.sample([("sb-0000000000a1", 1 << 30, 3_000_000_000)], now=now + 2)  # 3 cpu-s, 2 GiB-s
    reg.tenants.create_key("acme")
    reg.usage.set_budget("acme", cpu_h=0.001, gib_h=1.0)  # 3 cpu-s of 3.6 a day: 83 %, over the 80 % warning
    # the approval queue: acme's create approved after 10 s, its network question open; beta's
    # resume question past its deadline (it reads as timed out)
    asked = reg.approvals.open_approval("acme", "create", "container, 8 GiB", "over budget", 300, now=now - 100)
    reg.approvals.answer_approval(asked.approval_id, "approve", "ops", now=now - 90)
    reg.approvals.open_approval("acme", "network", "api.test:443", "egress outside the allowlist", 3600)
    reg.approvals.open_approval("beta", "resume", "sb-0000000000b1", "over budget", 5, now=now - 60)
    _sandbox(reg, "sb-0000000000a2", "acme")
    reg.sandboxes.set_state("sb-0000000000a2", State.FAILED, "start failed")
    _sandbox(reg, "sb-0000000000b1", "beta", "gvisor")
    reg.sandboxes.set_state("sb-0000000000b1", State.READY, "started")
    reg.sandboxes.add_timings(
        [StageTiming("sb-0000000000b1", "allocation", 2.0), StageTiming("sb-0000000000b1", "pause", 700.0)]
    )
    reg.snapshots.add_snapshot("snap-b1", "sb-0000000000b1", now, 5 << 20)
    reg.sandboxes.set_state("sb-0000000000b1", State.PAUSED, "paused to snap-b1")
    reg.pools.ensure_pool("default", 2)
    _sandbox(reg, "sb-0000000000p1", "", pool="default")
    reg.sandboxes.set_state("sb-0000000000p1", State.POOLED, "warm")
    reg.pools.pool_event("default", "warmed", "sb-0000000000p1")
    _sandbox(reg, "sb-0000000000p2", "", pool="default")  # a warm-up that failed: the pool's, not a create's
    reg.sandboxes.set_state("sb-0000000000p2", State.FAILED, "warm-up failed")
    reg.pools.pool_event("default", "hit", "sb-x")
    reg.pools.pool_event("default", "miss")


def _parse(text: str) -> dict[str, list]:
    """name -> samples [(sample name, labels, value)] of each family."""
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def _value(fams: dict, family: str, sample: str, **labels: str) -> float | None:
    for name, lab, value in fams.get(family, []):
        if name == sample and all(lab.get(k) == v for k, v in labels.items()):
            return value
    return None


def _check_histograms(text: str) -> int:
    """Every histogram series is cumulative, its +Inf bucket is its _count; returns how many series."""
    n = 0
    for f in text_string_to_metric_families(text):
        if f.type != "histogram":
            continue
        series: dict[tuple, dict] = {}
        for s in f.samples:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            entry = series.setdefault(key, {"buckets": []})
            if s.name.endswith("_bucket"):
                entry["buckets"].append((float(s.labels["le"]), s.value))
            else:
                entry[s.name.rsplit("_", 1)[1]] = s.value
        for key, e in series.items():
            counts = [c for _, c in sorted(e["buckets"])]
            assert counts == sorted(counts), (f.name, key, e)
            assert counts[-1] == e["count"], (f.name, key, e)
            n += 1
    return n


@pytest.fixture
def reg(tmp_path, registry_at):
    """The known rows, in a SQLite registry and in a PostgreSQL one (the same families from both)."""
    r = _registry(registry_at, tmp_path)
    _known_rows(r)
    yield r
    r.close()


def test_the_registrys_rows_become_parsed_families(reg):
    exposition = Exposition(RegistryStats(reg.location))
    try:
        body, content_type = exposition.render(None, "")
    finally:
        exposition.close()
    assert content_type.startswith("text/plain")
    text = body.decode()
    fams = _parse(text)
    v = lambda *a, **k: _value(fams, *a, **k)  # noqa: E731
    assert v("warmbox_sandboxes", "warmbox_sandboxes", state="running", tier="container", tenant="acme") == 1
    assert v("warmbox_sandboxes", "warmbox_sandboxes", state="failed", tenant="acme") == 1
    assert v("warmbox_sandboxes", "warmbox_sandboxes", state="paused", tier="gvisor", tenant="beta") == 1
    assert v("warmbox_sandboxes", "warmbox_sandboxes", state="pooled", tenant="_host") == 1
    # creates: both of acme's (the failed one too), beta's; the unclaimed pool warm-up is the pool's
    assert v("warmbox_sandbox_creates", "warmbox_sandbox_creates_total", tenant="acme", source="cold") == 2
    assert v("warmbox_sandbox_creates", "warmbox_sandbox_creates_total", tenant="_host") is None
    assert v("warmbox_sandbox_create_failures", "warmbox_sandbox_create_failures_total", tenant="acme") == 1
    assert v("warmbox_sandbox_create_failures", "warmbox_sandbox_create_failures_total", tenant="_host") == 0
    assert v("warmbox_sandbox_pauses", "warmbox_sandbox_pauses_total", tenant="beta", tier="gvisor") == 1
    # stage histogram: 400 ms runtime is in the 0.5 s bucket, not the 0.25 s one
    stage = {"stage": "runtime", "tier": "container", "request_path": "true"}
    assert v("warmbox_stage_duration_seconds", "warmbox_stage_duration_seconds_bucket", le="0.25", **stage) == 0
    assert v("warmbox_stage_duration_seconds", "warmbox_stage_duration_seconds_bucket", le="0.5", **stage) == 1
    assert v("warmbox_stage_duration_seconds", "warmbox_stage_duration_seconds_count", **stage) == 1
    assert v("warmbox_stage_duration_seconds", "warmbox_stage_duration_seconds_sum", **stage) == pytest.approx(0.4)
    alloc = [
        s for s in fams["warmbox_stage_duration_seconds"] if s[0].endswith("_count") and s[1]["stage"] == "allocation"
    ]
    assert sorted(s[1]["tier"] for s in alloc) == ["container", "gvisor"]
    les = {s[1]["le"] for s in fams["warmbox_stage_duration_seconds"] if s[0].endswith("_bucket")}
    assert len(les) == len(STAGE_BUCKETS_S) + 1
    # the pause is its own family, not a stage of a start
    assert v("warmbox_stage_duration_seconds", "warmbox_stage_duration_seconds_count", stage="pause") is None
    assert v("warmbox_pause_duration_seconds", "warmbox_pause_duration_seconds_count", tier="gvisor") == 1
    assert v("warmbox_pause_duration_seconds", "warmbox_pause_duration_seconds_sum", tier="gvisor") == pytest.approx(
        0.7
    )
    # egress: host patterns cut to their rule class, an unexpected rule text bounded to "other"
    egress = {"tenant": "acme", "kind": "connect", "decision": "allow", "rule": "allow"}
    assert v("warmbox_egress_decisions", "warmbox_egress_decisions_total", **egress) == 2
    assert v("warmbox_egress_decisions", "warmbox_egress_decisions_total", kind="dns", rule="default-deny") == 1
    assert v("warmbox_egress_decisions", "warmbox_egress_decisions_total", decision="deny", rule="other") == 1
    assert "pypi.org" not in text and "Weird" not in text
    assert v("warmbox_egress_bytes", "warmbox_egress_bytes_total", tenant="acme", direction="down") == 2020
    assert v("warmbox_tenant_cpu_seconds", "warmbox_tenant_cpu_seconds_total", tenant="acme") == pytest.approx(3.0)
    assert v("warmbox_tenant_memory_gib_seconds", "warmbox_tenant_memory_gib_seconds_total", tenant="acme") == (
        pytest.approx(2.0, abs=0.1)  # and the first reading's trapezoid from the allocation on
    )
    assert v("warmbox_snapshots", "warmbox_snapshots", tenant="beta") == 1
    assert v("warmbox_snapshot_bytes", "warmbox_snapshot_bytes", tenant="beta") == 5 << 20
    assert v("warmbox_pool_target", "warmbox_pool_target", pool="default") == 2
    assert v("warmbox_pool_ready", "warmbox_pool_ready", pool="default") == 1
    assert v("warmbox_pool_hits", "warmbox_pool_hits_total", pool="default") == 1
    assert v("warmbox_pool_misses", "warmbox_pool_misses_total", pool="default") == 1
    cmd = {"kind": "command", "tier": "container"}
    assert v("warmbox_command_duration_seconds", "warmbox_command_duration_seconds_count", **cmd) == 2
    assert v("warmbox_command_duration_seconds", "warmbox_command_duration_seconds_bucket", le="0.05", **cmd) == 1
    assert v("warmbox_command_duration_seconds", "warmbox_command_duration_seconds_bucket", le="5.0", **cmd) == 2
    assert v("warmbox_command_outcomes", "warmbox_command_outcomes_total", outcome="nonzero_exit", **cmd) == 1
    code = {"kind": "code", "tier": "container"}
    assert v("warmbox_command_duration_seconds", "warmbox_command_duration_seconds_bucket", le="60.0", **code) == 0
    assert v("warmbox_command_outcomes", "warmbox_command_outcomes_total", outcome="timed_out", **code) == 1
    assert v("warmbox_command_outcomes", "warmbox_command_outcomes_total", outcome="error", **code) == 1
    assert "secret-text" not in text
    status = reg.usage.budget_status("acme")  # the approvals part's own reading: the gauges must agree with it
    budget = {"tenant": "acme"}
    assert v("warmbox_budget_usage_ratio", "warmbox_budget_usage_ratio", resource="cpu", **budget) == (
        pytest.approx(status.cpu_ratio, rel=1e-6)
    )
    assert status.cpu_ratio == pytest.approx(0.833, abs=0.01)
    assert v("warmbox_budget_usage_ratio", "warmbox_budget_usage_ratio", resource="memory", **budget) == (
        pytest.approx(status.gib_ratio, rel=1e-6)
    )
    assert v("warmbox_budget_limit_hours", "warmbox_budget_limit_hours", resource="cpu", **budget) == 0.001
    assert v("warmbox_budget_used_hours", "warmbox_budget_used_hours", resource="cpu", **budget) == (
        pytest.approx(status.cpu_used_h, rel=1e-6)
    )
    assert v("warmbox_budget_warning", "warmbox_budget_warning", **budget) == 1
    assert v("warmbox_budget_warning", "warmbox_budget_warning", tenant="beta") is None  # no budget, no series
    assert v("warmbox_approvals_pending", "warmbox_approvals_pending", tenant="acme", kind="network") == 1
    assert v("warmbox_approvals_pending", "warmbox_approvals_pending", tenant="beta") is None
    assert v("warmbox_approvals_opened", "warmbox_approvals_opened_total", tenant="acme", kind="create") == 1
    closed = "warmbox_approvals_closed_total"
    assert v("warmbox_approvals_closed", closed, tenant="acme", kind="create", state="approved") == 1
    assert v("warmbox_approvals_closed", closed, tenant="beta", kind="resume", state="timed_out") == 1
    waited = {"kind": "create", "state": "approved"}
    assert v("warmbox_approval_wait_seconds", "warmbox_approval_wait_seconds_bucket", le="5.0", **waited) == 0
    assert v("warmbox_approval_wait_seconds", "warmbox_approval_wait_seconds_bucket", le="15.0", **waited) == 1
    assert v("warmbox_approval_wait_seconds", "warmbox_approval_wait_seconds_sum", **waited) == pytest.approx(10)
    assert "api.test" not in text and "over budget" not in text
    assert v("warmbox_registry_up", "warmbox_registry_up") == 1
    assert _check_histograms(text) >= 5
    assert "sb-0000000000" not in text  # no sandbox id is ever a label


def test_a_tenants_view_has_only_its_own_series(reg):
    exposition = Exposition(RegistryStats(reg.location))
    try:
        text = exposition.render(Tenant("beta"), "")[0].decode()
        admin = exposition.render(Tenant("ops", admin=True), "")[0].decode()
    finally:
        exposition.close()
    fams = _parse(text)
    tenants = {lab["tenant"] for samples in fams.values() for _, lab, _ in samples if "tenant" in lab}
    assert tenants == {"beta"}
    assert _value(fams, "warmbox_sandboxes", "warmbox_sandboxes", state="paused") == 1
    assert (
        _value(fams, "warmbox_stage_duration_seconds", "warmbox_stage_duration_seconds_count", tier="container") is None
    )
    for host_wide in ("warmbox_pool_ready", "warmbox_http_requests", "process_cpu_seconds"):
        assert not fams.get(host_wide), host_wide
    assert "acme" not in text and "acme" in admin and "warmbox_http_requests" in admin


@pytest.fixture
def engine(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMBOX_RUNTIME_DIR", str(tmp_path / "rt"))
    e = Engine.for_home(tmp_path / "home")
    r = _registry(e.registry.location, tmp_path)  # the same file, with a private uid ledger for the fake rows
    _known_rows(r)
    r.close()
    return e


def _client(engine: Engine, **settings) -> TestClient:
    return TestClient(build_app(engine, ServerSettings(**settings), mcp=False), raise_server_exceptions=False)


def test_who_may_scrape(engine):
    _, acme = engine.registry.tenants.create_key("acme")
    _, ops = engine.registry.tenants.create_key("ops", admin=True)
    with _client(engine) as c:
        r = c.get("/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
        r = c.get("/metrics", headers={"Authorization": "Bearer wbx_not-a-key"})
        assert r.status_code == 401
        c.get("/v1/sandboxes", headers={"Authorization": f"Bearer {acme}"})
        r = c.get("/metrics", headers={"Authorization": f"Bearer {acme}"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        fams = _parse(r.text)
        assert {lab["tenant"] for s in fams.values() for _, lab, _ in s if "tenant" in lab} == {"acme"}
        r = c.get("/metrics", headers={"Authorization": f"Bearer {ops}"})
        fams = _parse(r.text)
        # the HTTP layer's own counters, by route template (never the raw path) and status
        assert (
            _value(
                fams,
                "warmbox_http_requests",
                "warmbox_http_requests_total",
                route="/v1/sandboxes",
                method="GET",
                status="200",
            )
            == 1
        )
        assert _value(fams, "warmbox_http_requests", "warmbox_http_requests_total", route="/metrics", status="401") == 2
        assert _value(fams, "warmbox_sandboxes", "warmbox_sandboxes", tenant="beta", state="paused") == 1
        _check_histograms(r.text)
        r = c.get("/metrics", headers={"Authorization": f"Bearer {ops}", "Accept": "application/openmetrics-text"})
        assert r.headers["content-type"].startswith("application/openmetrics-text") and r.text.endswith("# EOF\n")
    with _client(engine, metrics=False) as c:
        assert c.get("/metrics", headers={"Authorization": f"Bearer {ops}"}).status_code == 404


def test_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("WARMBOX_CONFIG", raising=False)
    home = tmp_path / "h"
    home.mkdir()
    assert load(home).server.metrics is True and load(home).server.log_format == "text"
    (home / "warmbox.toml").write_text('[server]\nmetrics = false\nlog_format = "json"\n')
    assert load(home).server.metrics is False and load(home).server.log_format == "json"
    for bad in ('metrics = "yes"', 'log_format = "xml"'):
        (home / "warmbox.toml").write_text(f"[server]\n{bad}\n")
        with pytest.raises(ConfigError, match="server\\."):
            load(home)


def test_json_request_logs_carry_the_request_id_and_never_a_key(engine):
    _, acme = engine.registry.tenants.create_key("acme")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter())
    access = logging.getLogger("warmbox.server.access")
    access.addHandler(handler)
    old = access.level
    access.setLevel(logging.INFO)
    try:
        with _client(engine) as c:
            r = c.get("/v1/sandboxes/sb-0000000000a1", headers={"Authorization": f"Bearer {acme}"})
            r2 = c.get("/v1/nowhere", headers={"Authorization": f"Bearer {acme}"})
            c.get("/v1/sandboxes/x%0a%22y", headers={"Authorization": f"Bearer {acme}"})
            c.get("/ui/static/console.css")
    finally:
        access.removeHandler(handler)
        access.setLevel(old)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 4
    first, second, bad_id, static = lines
    assert first["request_id"] == r.headers["x-request-id"] and len(first["request_id"]) == 16
    assert second["request_id"] == r2.headers["x-request-id"] != first["request_id"]
    assert first["tenant"] == "acme" and first["sandbox_id"] == "sb-0000000000a1"
    assert first["route"] == "/v1/sandboxes/{sandbox_id}" and first["status"] == 200 and first["method"] == "GET"
    assert first["level"] == "info" and isinstance(first["duration_ms"], float) and first["ts"].endswith("+00:00")
    assert second["route"] == "unmatched" and second["status"] == 404
    # a path parameter that is no id is not logged as one; a mounted app's template is its mount
    assert bad_id["sandbox_id"] == "(invalid)" and bad_id["route"] == "/v1/sandboxes/{sandbox_id}"
    assert static["route"] == "/ui/static" and "tenant" not in static
    assert acme not in out.getvalue() and acme.split("_", 1)[1] not in out.getvalue()


def test_scrub_and_unhandled_errors_logged_with_their_request():
    assert logs.scrub("key wbx_AbC-123_x refused; Authorization: Bearer s3cr3t.tok") == (
        "key wbx_[redacted] refused; Authorization: Bearer [redacted]"
    )
    fmt = logs.JsonFormatter()
    rec = logging.LogRecord("warmbox.server", logging.ERROR, __file__, 1, "boom %s", ("wbx_secret",), None)
    assert json.loads(fmt.format(rec))["msg"] == "boom wbx_[redacted]"


def _comparable(t) -> dict:
    d = dataclasses.asdict(t)
    d.pop("read_seconds"), d.pop("sandboxes_read")
    return d


def test_settled_sandboxes_are_read_once_and_the_totals_stay_exact(reg):
    """A scrape reads only sandboxes not settled (live, paused, recently ended); the settled ones'
    aggregates are kept: after more rows, the kept + fresh totals equal a new reader's full read."""
    kept = RegistryStats(reg.location, settle_s=0)  # a destroyed sandbox settles at once
    try:
        first = kept.read()
        assert first.sandboxes_read == 5  # every row of the fixture: nothing settled yet, none destroyed
        _sandbox(reg, "sb-0000000000a3", "acme")
        reg.sandboxes.set_state("sb-0000000000a3", State.READY, "started")
        reg.sandboxes.add_timings([StageTiming("sb-0000000000a3", "allocation", 1.5)])
        reg.egress.add_net_events([NetEvent("sb-0000000000a3", 5.0, "http", "h", "", 80, "allow", "internet", 1, 2)])
        reg.sandboxes.set_state("sb-0000000000a3", State.DESTROYED, "killed")
        reg.sandboxes.set_state("sb-0000000000a1", State.DESTROYED, "killed")
        reg.pools.pool_event("default", "hit", "sb-y")
        for tenant in (None, "acme", "beta"):
            fresh = RegistryStats(reg.location)  # no memory: reads every row
            try:
                assert _comparable(kept.read(tenant)) == _comparable(fresh.read(tenant)), tenant
            finally:
                fresh.close()
        again = kept.read()
        assert again.sandboxes_read == 4  # a2, p2 (failed), b1 (paused), p1 (pooled): the destroyed ones are kept
        hits = {v.labels: v.value for v in again.pool_events}
        assert hits[("default", "hit")] == 2
        acme = {v.labels: v.value for v in again.creates}
        assert acme[("acme", "container", "cold")] == 3
    finally:
        kept.close()


DOCS = Path(__file__).resolve().parents[2] / "docs" / "monitoring"
_NAME = re.compile(r"\b(warmbox_[a-z_]+)(\{[^}]*\})?")
_MATCHER = re.compile(r"([a-z_]+)\s*(?:=~|!~|!=|=)")
_BY = re.compile(r"\bby \(([^)]*)\)")


def _queries() -> list[str]:
    dash = json.loads((DOCS / "warmbox-dashboard.json").read_text())
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    rules = yaml.safe_load((DOCS / "warmbox-rules.yml").read_text())
    out += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    return out


def test_the_dashboard_and_alert_rules_name_only_exported_series(engine):
    """docs/monitoring (a Grafana dashboard, Prometheus alert rules) query only sample names and
    labels an admin scrape of the known rows has: a renamed metric fails here, not in Grafana."""
    _, ops = engine.registry.tenants.create_key("ops", admin=True)
    with _client(engine) as c:
        c.get("/v1/sandboxes", headers={"Authorization": f"Bearer {ops}"})
        text = c.get("/metrics", headers={"Authorization": f"Bearer {ops}"}).text
    labels: dict[str, set[str]] = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    queries = _queries()
    assert len(queries) >= 20
    for q in queries:
        names = _NAME.findall(q)
        assert names, q
        grouped = set()
        for name, selector in names:
            assert name in labels, (name, q)
            used = set(_MATCHER.findall(selector))
            assert used <= labels[name], (name, used - labels[name], q)
            grouped |= labels[name]
        for by in _BY.findall(q):
            wanted = {x.strip() for x in by.split(",")} - {"le"}
            assert wanted <= grouped, (wanted - grouped, q)


def test_the_budget_warning_follows_the_configured_ratio(engine, tmp_path):
    """warmbox_budget_warning uses [approvals] warn_ratio, read at each scrape (acme is at 83 %)."""
    _, ops = engine.registry.tenants.create_key("ops", admin=True)
    auth = {"Authorization": f"Bearer {ops}"}
    with _client(engine) as c:
        fams = _parse(c.get("/metrics", headers=auth).text)
        assert _value(fams, "warmbox_budget_warning", "warmbox_budget_warning", tenant="acme") == 1
        (tmp_path / "home" / "warmbox.toml").write_text("[approvals]\nwarn_ratio = 0.9\n")
        fams = _parse(c.get("/metrics", headers=auth).text)
        assert _value(fams, "warmbox_budget_warning", "warmbox_budget_warning", tenant="acme") == 0


def test_records_made_while_serving_carry_the_request_and_an_error_is_a_500_with_its_id():
    """A record logged inside a handler has the request's id, route and sandbox id; an unhandled
    error is logged with them (and its traceback) and answered with a JSON 500 carrying X-Request-Id."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    inner = logging.getLogger("warmbox.test.handler")

    async def boom(request):
        inner.warning("about to fail for %s", "wbx_abc")
        raise RuntimeError("boom")

    app = Starlette(routes=[Route("/v1/sandboxes/{sandbox_id}/boom", boom)], middleware=[Middleware(logs.RequestLog)])
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    old = root.level
    root.setLevel(logging.INFO)
    try:
        with TestClient(app, raise_server_exceptions=False) as c:
            r = c.get("/v1/sandboxes/sb-0000000000a1/boom")
    finally:
        root.removeHandler(handler)
        root.setLevel(old)
    assert r.status_code == 500 and r.json()["error"]["code"] == "warmbox_error"
    rid = r.headers["x-request-id"]
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    records = [r for r in records if r["logger"].startswith("warmbox.")]  # not the test client's own
    warned, failed, access = records
    assert warned["msg"] == "about to fail for wbx_[redacted]" and warned["level"] == "warning"
    for rec in records:
        assert rec["request_id"] == rid and rec["sandbox_id"] == "sb-0000000000a1"
        assert rec["route"] == "/v1/sandboxes/{sandbox_id}/boom"
    assert failed["level"] == "error" and "RuntimeError: boom" in failed["exc"]
    assert access["status"] == 500 and access["level"] == "error"
