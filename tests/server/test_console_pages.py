"""The console's pools and cost pages in process (Starlette's test client, a temp registry, no sandbox)."""

from __future__ import annotations

import re
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
    _, secret = engine.registry.create_key(tenant, admin=admin)
    return {"Authorization": f"Bearer {secret}"}


def value(html: str, element_id: str) -> str:
    m = re.search(rf'id="{re.escape(element_id)}"[^>]*data-value="([^"]*)"', html)
    assert m, element_id
    return m.group(1)


def test_pools_page_shows_each_pool_with_its_counts_and_chart_slots(client, engine):
    reg = engine.registry
    reg.ensure_pool("py-small", 3)
    reg.pool_event("py-small", "warmed", "sb-a")
    reg.pool_event("py-small", "hit", "sb-a")
    reg.pool_event("py-small", "miss")
    reg.pool_event("py-small", "miss")
    reg.pool_event("py-small", "miss")
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
    reg.ensure_pool("py-small", 3)
    t0 = time.time()
    reg.pool_event("py-small", "warmed", "sb-a")
    reg.pool_event("py-small", "hit", "sb-a")
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
    assert all(t0 - 1 <= x <= t0 + 60 for x in fill["x"][1:])
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
