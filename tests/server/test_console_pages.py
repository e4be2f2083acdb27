"""The console's pools and cost pages in process (Starlette's test client, a temp registry, no sandbox)."""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from warmbox.config import ServerSettings
from warmbox.engine.engine import Engine
from warmbox.server.app import build_app
from warmbox.server.console import charts

BASE = "http://127.0.0.1:7420"
POOLS = """
[pools.py-small]
template = "base"
min = 0
max = 4
target = 3
"""


@pytest.fixture
def engine(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMBOX_RUNTIME_DIR", str(tmp_path / "rt"))
    home = tmp_path / "home"
    home.mkdir()
    (home / "warmbox.toml").write_text(POOLS)
    return Engine.for_home(home)


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, ServerSettings(), mcp=False), base_url=BASE) as c:
        yield c


def bearer(engine: Engine, tenant: str, admin: bool = False) -> dict[str, str]:
    _, secret = engine.registry.tenants.create_key(tenant, admin=admin)
    return {"Authorization": f"Bearer {secret}"}


def value(html: str, element_id: str) -> str:
    m = re.search(rf'id="{re.escape(element_id)}"[^>]*data-value="([^"]*)"', html)
    assert m, element_id
    return m.group(1)


def test_pools_page_shows_each_pool_with_its_counts_and_chart_slots(client, engine):
    reg = engine.registry
    reg.pools.ensure_pool("py-small", 3)
    reg.pools.pool_event("py-small", "warmed", "sb-a")
    reg.pools.pool_event("py-small", "hit", "sb-a")
    reg.pools.pool_event("py-small", "miss")
    reg.pools.pool_event("py-small", "miss")
    reg.pools.pool_event("py-small", "miss")
    auth = bearer(engine, "acme")  # any key may list the pools (as ops.PoolsList)
    r = client.get("/ui/pools", headers=auth)
    assert r.status_code == 200, r.text
    assert "script-src 'self'" in r.headers["content-security-policy"]
    html = r.text
    assert 'id="pool-py-small"' in html and 'data-pool="py-small"' in html
    assert value(html, "pool-py-small-target") == "3"
    assert value(html, "pool-py-small-ready") == "0"
    assert value(html, "pool-py-small-hits") == "1" and value(html, "pool-py-small-misses") == "3"
    assert value(html, "pool-py-small-hit-rate") == "25.0"
    assert 'data-chart-id="pool-fill-py-small"' in html and 'data-chart-id="pool-hits-py-small"' in html
    assert 'data-charts-src="/ui/pools.json?range=6h"' in html
    for src in ("/ui/static/vendor/uplot/uPlot.iife.min.js", "/ui/static/charts.js"):
        assert f'<script src="{src}"></script>' in html
    assert "<script>" not in html  # no inline script (the CSP would block it)
    assert 'data-nav="pools"' in html


def test_pools_json_holds_the_charts_over_the_range(client, engine):
    reg = engine.registry
    reg.pools.ensure_pool("py-small", 3)
    t0 = time.time()
    reg.pools.pool_event("py-small", "warmed", "sb-a")
    reg.pools.pool_event("py-small", "hit", "sb-a")
    auth = bearer(engine, "acme")
    r = client.get("/ui/pools.json?range=1h", headers=auth)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    j = r.json()
    assert j["range"] == "1h" and j["now"] - j["since"] == pytest.approx(3600)
    (pool,) = j["pools"]
    assert pool["name"] == "py-small" and pool["hits"] == 1 and pool["target"] == 3
    fill, hits = pool["charts"]
    assert fill["id"] == "pool-fill-py-small" and [s["label"] for s in fill["series"]] == ["ready", "target"]
    assert fill["series"][0]["values"] == [0, 1, 0, 0]  # since, warmed, hit, now
    # the pool is younger than the hour asked for: its chart starts at its first event, not 1 h of "0 ready"
    assert all(t0 - 1 <= x <= t0 + 60 for x in fill["x"])
    assert pool["fields"] == {
        "ready": 0,
        "target": 3,
        "warming": 0,
        "hits": 1,
        "misses": 0,
        "hit-rate": 100.0,
        "failures": 0,
    }  # what charts.js writes into the card at each reload
    assert hits["id"] == "pool-hits-py-small" and sum(v or 0 for v in hits["series"][1]["values"]) == 1
    assert "sb-a" not in r.text  # a claimed sandbox's id is its tenant's, not every key's


def test_pools_refuse_bad_input_and_strangers(client, engine):
    auth = bearer(engine, "acme")
    r = client.get("/ui/pools.json?range=1y", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument"
    r = client.get("/ui/pools?range=<script>", headers=auth)
    assert r.status_code == 400 and "<script>" not in r.text
    r = client.get("/ui/pools.json")
    assert r.status_code == 401
    r = client.get("/ui/pools", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"


def test_the_vendored_library_and_scripts_are_served_offline(client):
    for path, kind in (
        ("/ui/static/vendor/uplot/uPlot.iife.min.js", "javascript"),
        ("/ui/static/vendor/uplot/uPlot.min.css", "css"),
        ("/ui/static/charts.js", "javascript"),
        ("/ui/static/charts.css", "css"),
    ):
        r = client.get(path)
        assert r.status_code == 200 and kind in r.headers["content-type"], path
    served = client.get("/ui/static/vendor/uplot/uPlot.iife.min.js").content
    assert served == (Path(charts.__file__).parent / "static/vendor/uplot/uPlot.iife.min.js").read_bytes()


# ---- cost


def use(engine: Engine, tenant: str, hours_ago: int, cpu_s: float, gib_s: float) -> float:
    """A usage bucket ``hours_ago`` hours before this one (the daemon's readings make them)."""
    hour = (int(time.time()) // 3600 - hours_ago) * 3600.0
    with sqlite3.connect(engine.registry.path) as db:
        db.execute("INSERT INTO usage (tenant, hour, cpu_s, gib_s) VALUES (?,?,?,?)", (tenant, hour, cpu_s, gib_s))
    return hour


def test_a_tenant_sees_its_own_cost_only_with_its_budget(client, engine):
    auth = bearer(engine, "acme")
    bearer(engine, "beta")
    engine.registry.usage.set_budget("acme", cpu_h=2.0, gib_h=100.0)
    h1 = use(engine, "acme", 0, 3600 * 1.7, 3600 * 4)  # 1.7 of 2 cpu-hours today: 85 % (warns at 80 %)
    use(engine, "acme", 30, 3600, 0)  # yesterday: outside 24 h
    use(engine, "beta", 0, 3600 * 9, 3600 * 9)
    for q in ("", "?tenant=beta"):  # a tenant key's ?tenant= is ignored: its own, always
        r = client.get(f"/ui/cost.json{q}", headers=auth)
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["tenant"] == "acme" and j["tenants"] == ["acme"] and "beta" not in r.text
        cpu, gib = j["charts"]
        assert cpu["id"] == "cost-cpu" and gib["id"] == "cost-gib"
        assert [s["label"] for s in cpu["series"]] == ["acme", "today so far"]
        assert cpu["x"][-1] == h1 and cpu["series"][0]["values"][-1] == pytest.approx(1.7)
        assert gib["series"][0]["values"][-1] == pytest.approx(4.0)
        assert [m["label"] for m in cpu["markers"]] == ["budget per day", "80% of budget"]
        assert cpu["markers"][0]["y"] == 2.0 and cpu["markers"][1]["y"] == pytest.approx(1.6)
        assert j["budget"]["warning"] is True and j["budget"]["exceeded"] is False
    html = client.get("/ui/cost?tenant=beta", headers=auth).text
    assert 'id="cost-tenant"' not in html  # no selector for a tenant key
    assert 'id="cost-budget-warning"' in html and 'data-warning="true"' in html
    assert 'data-chart-id="cost-cpu"' in html and 'data-chart-id="cost-gib"' in html
    assert 'data-tenant="beta"' not in html and 'data-tenant="acme"' in html
    assert re.search(r'class="budget-today warn" data-value="0.85[0-9]*"\s+data-warning="true"', html)
    assert 'data-charts-src="/ui/cost.json?range=24h"' in html


def test_an_admin_sees_every_tenant_and_picks_one(client, engine):
    auth = bearer(engine, "ops", admin=True)
    bearer(engine, "acme")
    bearer(engine, "x.y@z")
    use(engine, "acme", 1, 7200, 3600)
    use(engine, "x.y@z", 2, 3600, 0)
    r = client.get("/ui/cost.json?range=7d", headers=auth)
    j = r.json()
    assert j["tenant"] is None and j["tenants"] == ["acme", "x.y@z"] and j["tenant_count"] == 2
    cpu, _ = j["charts"]
    assert [s["draw"] for s in cpu["series"]] == ["line", "line"] and cpu["markers"] == []
    assert sum(v for v in cpu["series"][0]["values"] if v) == pytest.approx(2.0)
    html = client.get("/ui/cost", headers=auth).text
    assert 'id="cost-tenant"' in html and '<option value="acme">acme</option>' in html
    assert f'id="cost-total-{charts.dom_id("x.y@z")}" data-tenant="x.y@z"' in html
    assert re.search(r'id="cost-total-acme".*?class="budget-today"[^>]*data-warning="false"', html, re.S)
    one = client.get("/ui/cost.json?tenant=acme&range=30d", headers=auth).json()
    assert one["tenant"] == "acme" and one["tenants"] == ["acme"] and one["bucket_s"] == 86400
    html = client.get("/ui/cost?tenant=acme", headers=auth).text
    assert 'data-charts-src="/ui/cost.json?range=24h&amp;tenant=acme"' in html
    hostile = '"><img src=x onerror=alert(1)>'
    r = client.get("/ui/cost", params={"tenant": hostile}, headers=auth)  # the filter is free text
    assert r.status_code == 200 and "<img" not in r.text and "&#34;&gt;&lt;img" in r.text
    r = client.get("/ui/cost.json?range=1y", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument"
