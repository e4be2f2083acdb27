"""The console's pictures: the SVG stage waterfall and the uPlot chart data (pure; no server)."""

from __future__ import annotations

import hashlib
import math
import re
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from warmbox.errors import InvalidArgument
from warmbox.models import PoolEvent, PoolStatus, StageTiming, UsageBucket
from warmbox.server.console import charts
from warmbox.storage.registry import Registry
from warmbox.storage.uidslots import MAX_SLOTS, UidLedger

SVG = "{http://www.w3.org/2000/svg}"
STATIC = Path(charts.__file__).parent / "static"


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)  # raises on anything that is not well-formed XML (an unescaped name)


def bars(root: ET.Element) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if "stage" in (g.get("class") or "").split()]


def rect(g: ET.Element) -> tuple[float, float]:
    r = g.find(f"{SVG}rect")
    assert r is not None
    return float(r.get("x", "nan")), float(r.get("width", "nan"))


def texts(g: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in g.iter(f"{SVG}text")]


COLD = [
    StageTiming("sb1", "allocation", 1.25),
    StageTiming("sb1", "filesystem", 48.5),
    StageTiming("sb1", "runtime", 301.0),
    StageTiming("sb1", "dependencies", 1200.75),
    StageTiming("sb1", "network", 3.5),
    StageTiming("sb1", "first_command", 22.0),
]


def test_cold_waterfall_draws_each_stage_in_order_with_its_recorded_duration() -> None:
    later = [StageTiming("sb1", "pause", 80.0), StageTiming("sb1", "resume", 40.0)]  # not the start's
    root = parse(charts.waterfall_svg([*later, *reversed(COLD)]))  # the registry's order is not start order
    assert root.tag == f"{SVG}svg" and root.get("id") == "waterfall"
    assert root.get("data-start") == "cold"
    gs = bars(root)
    assert [g.get("data-stage") for g in gs] == [t.stage for t in COLD]
    assert [float(g.get("data-ms", "nan")) for g in gs] == [t.duration_ms for t in COLD]
    assert all(g.get("data-on-path") == "true" and "on-path" in (g.get("class") or "") for g in gs)
    assert float(root.get("data-on-path-ms", "nan")) == pytest.approx(sum(t.duration_ms for t in COLD))
    assert float(root.get("data-off-path-ms", "nan")) == 0
    # a waterfall: each bar starts where the one before it ended, widths proportional to durations
    spans = [rect(g) for g in gs]
    for (x, w), (nx, _), t in zip(spans, spans[1:], COLD, strict=False):
        if t.duration_ms * (spans[3][1] / COLD[3].duration_ms) >= 2:  # bars under 2 px are widened
            assert nx == pytest.approx(x + w, abs=0.2)
    assert spans[3][1] / spans[2][1] == pytest.approx(1200.75 / 301.0, rel=0.01)
    # each row names its stage and its duration in ms
    assert texts(gs[3])[:2] == ["dependencies", "1,201 ms"]
    assert texts(gs[0])[:2] == ["allocation", "1.25 ms"]
    assert "cold start" in "".join(root.itertext())


def test_pooled_waterfall_puts_the_pools_stages_before_the_request_and_marks_them() -> None:
    pooled = [
        StageTiming("sb2", "filesystem", 800.0, False),
        StageTiming("sb2", "runtime", 1500.0, False),
        StageTiming("sb2", "dependencies", 400.0, False),
        StageTiming("sb2", "network", 4.0, True),
        StageTiming("sb2", "allocation", 0.8, True),  # the claim, recorded last
        StageTiming("sb2", "first_command", 20.0, True),
    ]
    root = parse(charts.waterfall_svg(pooled))
    assert root.get("data-start") == "pooled"
    gs = {g.get("data-stage"): g for g in bars(root)}
    assert list(gs) == ["allocation", "filesystem", "runtime", "dependencies", "network", "first_command"]
    off = [s for s, g in gs.items() if g.get("data-on-path") == "false"]
    assert off == ["filesystem", "runtime", "dependencies"]
    assert all("off-path" in (gs[s].get("class") or "") for s in off)
    # drawn differently: another fill and a dashed outline
    fills = {s: gs[s].find(f"{SVG}rect").get("fill") for s in gs}  # type: ignore[union-attr]
    assert fills["runtime"] != fills["allocation"]
    assert gs["runtime"].find(f"{SVG}rect").get("stroke-dasharray")  # type: ignore[union-attr]
    line = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "request-line").find(f"{SVG}line")
    zero = float(line.get("x1", "nan"))  # type: ignore[union-attr]
    for s in off:  # everything the pool did ends by the request line
        x, w = rect(gs[s])
        assert x + w <= zero + 0.2
    for s in ("allocation", "network", "first_command"):
        assert rect(gs[s])[0] >= zero - 0.2
    assert float(root.get("data-on-path-ms", "nan")) == pytest.approx(24.8)
    assert float(root.get("data-off-path-ms", "nan")) == pytest.approx(2700.0)
    assert "pooled start" in "".join(root.itertext())


@pytest.mark.parametrize(("off_ms", "on_ms"), [(10.0, 100.0), (30.0, 100.0), (400.0, 10.0), (1e6, 10.0)])
def test_the_request_label_is_clear_of_the_legend(off_ms: float, on_ms: float) -> None:
    """Issue 34: the "request" label sat on the legend's line (t=0 often falls under the legend's
    "done beforehand by a pool"); text boxes are estimated from their font size (an em high,
    0.6 em a character wide), which holds for the sans-serif the SVG names."""
    pooled = [StageTiming("sb3", "runtime", off_ms, False), StageTiming("sb3", "allocation", on_ms, True)]
    root = parse(charts.waterfall_svg(pooled))

    def box(t: ET.Element, size: float) -> tuple[float, float, float, float]:
        x, y, n = float(t.get("x", "nan")), float(t.get("y", "nan")), len("".join(t.itertext()))
        w = 0.6 * size * n
        x = x - w if t.get("text-anchor") == "end" else x
        return x, y - size, x + w, y + 0.25 * size

    legend = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "legend")
    request = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "request-line").find(f"{SVG}text")
    assert request is not None and "".join(request.itertext()) == "request"
    rx0, ry0, rx1, ry1 = box(request, 10)
    assert 0 <= rx0 and rx1 <= float(root.get("width", "nan"))  # inside the picture
    for t in legend.iter(f"{SVG}text"):
        lx0, ly0, lx1, ly1 = box(t, 10)
        assert rx1 <= lx0 or lx1 <= rx0 or ry1 <= ly0 or ly1 <= ry0, ("overlap", "".join(t.itertext()))
    first_bar = min(float(r.get("y", "nan")) for r in root.iter(f"{SVG}rect") if r.get("height") == str(charts._BAR_H))
    assert ry1 <= first_bar  # and above the bars


def test_waterfall_escapes_names_and_survives_corrupt_durations() -> None:
    evil = "<script>alert(1)</script>\"&'"
    timings = [
        StageTiming("x", "allocation", float("nan")),
        StageTiming("x", evil, -5.0),
        StageTiming("x", "runtime", float("inf")),
        StageTiming("x", "runtime", 7.0),  # recorded again: the newest wins, as in the registry
    ]
    svg = charts.waterfall_svg(timings, title=f"sandbox {evil}")
    assert "<script" not in svg
    root = parse(svg)
    assert not list(root.iter("script")) and not list(root.iter(f"{SVG}script"))
    gs = bars(root)
    assert [g.get("data-stage") for g in gs] == ["allocation", "runtime", evil]  # unknown stages last
    assert gs[1].get("data-ms") == "7.0"
    assert evil in texts(gs[2])
    assert any(evil in t for t in (root.findtext(f"{SVG}title") or "",))
    for g in gs:
        x, w = rect(g)
        assert math.isfinite(x) and math.isfinite(w) and w >= 2
    for r in root.iter(f"{SVG}rect"):  # no NaN/inf leaked into the geometry
        assert all(math.isfinite(float(r.get(a, "0"))) for a in ("x", "y", "width", "height"))


def test_waterfall_without_timings_says_so() -> None:
    root = parse(charts.waterfall_svg([]))
    assert root.get("data-start") == "none" and not bars(root)
    assert "no start timings" in "".join(root.itertext())


# ---- pools


def status(name: str = "py", *, ready: int, target: int, hits: int = 0, misses: int = 0) -> PoolStatus:
    return PoolStatus(name, "container", "base", 0, 10, target, ready, 0, hits, misses, 0, "", 0.0, 0.0, 0.0)


def ev(at: float, kind: str, detail: str = "", pool: str = "py") -> PoolEvent:
    return PoolEvent(pool, at, kind, "", detail)


def test_pool_fill_rebuilds_ready_backwards_from_now_and_follows_the_target() -> None:
    events = [
        ev(110, "warmed"),
        ev(120, "warmed"),
        ev(130, "hit"),
        ev(135, "claim_failed"),  # follows its hit: no change of its own
        ev(140, "resized", "target=4 min=0 max=10"),
        ev(150, "warmed"),
        ev(160, "scaled", "3 misses: target 4->6"),
        ev(165, "miss"),
        ev(170, "retired"),
        ev(99, "warmed"),  # before the window
        ev(150, "warmed", pool="other"),  # another pool's
    ]
    c = charts.pool_fill(status(ready=2, target=6), events, since=100, now=200)
    assert c.chart_id == "pool-fill-py"
    ready, target = c.series
    assert (ready.label, target.label) == ("ready", "target")
    assert (ready.draw, target.draw) == ("area-step", "step")
    assert c.x == (100, 110, 120, 130, 135, 140, 150, 160, 165, 170, 200)
    assert ready.values == (1, 2, 3, 2, 2, 2, 3, 3, 3, 2, 2)
    assert target.values == (4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6)
    assert len(c.x) == len(ready.values) == len(target.values)
    j = c.to_json()
    assert j["x"][0] == 100 and j["series"][0]["values"][-1] == 2


def test_pool_fill_never_goes_below_zero_and_without_events_is_flat() -> None:
    c = charts.pool_fill(status(ready=0, target=1), [ev(150, "warmed")], since=100, now=200)
    assert min(v for v in c.series[0].values if v is not None) == 0
    flat = charts.pool_fill(status(ready=3, target=3), [], since=100, now=200)
    assert flat.x == (100, 200) and flat.series[0].values == (3, 3) and flat.series[1].values == (3, 3)


def test_pool_fill_of_a_busy_pool_is_thinned_to_the_level_each_slice_ended_at() -> None:
    events = [ev(100 + i * 0.01, "warmed" if i % 2 == 0 else "hit") for i in range(10_000)]  # 100 s, 1/10 ms
    c = charts.pool_fill(status(ready=0, target=1), events, since=100, now=200, max_points=50)
    assert len(c.x) <= 52 and c.x[0] == 100 and c.x[-1] == 200
    assert list(c.x) == sorted(c.x)
    assert set(c.series[0].values) <= {0.0, 1.0} and c.series[0].values[-1] == 0


def test_pool_hit_rate_per_bucket_counts_failed_claims_as_misses_of_the_pool() -> None:
    events = [ev(0, "hit"), ev(10, "hit"), ev(20, "miss"), ev(30, "hit"), ev(31, "claim_failed")]
    events += [ev(70, "miss"), ev(130, "warmed")]
    c = charts.pool_hit_rate(status(ready=1, target=1), events, since=0, now=180, bucket_s=60)
    assert c.x == (0, 60, 120)
    rate, hits, misses = c.series
    assert hits.values == (2, 0, 0) and misses.values == (1, 1, 0)
    assert rate.values[0] == pytest.approx(200 / 3) and rate.values[1] == 0 and rate.values[2] is None
    assert charts.hit_rate(status(ready=0, target=0, hits=3, misses=1)) == 75
    assert charts.hit_rate(status(ready=0, target=0)) is None


def test_pool_charts_from_a_real_registry(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.db", ledger=UidLedger(tmp_path / "uids", slots=8, first=MAX_SLOTS - 50))
    t0 = time.time()
    reg.pools.set_pool("py", target=2, kind="resized", detail="target=2 min=0 max=4")
    reg.pools.pool_event("py", "warmed", "sb-a")
    reg.pools.pool_event("py", "warmed", "sb-b")
    reg.pools.pool_event("py", "hit", "sb-a")
    reg.pools.pool_event("py", "miss")
    now = time.time() + 1
    events = reg.pools.pool_events("py", since=t0 - 1)
    hits, misses, *_ = reg.pools.pool_totals("py")
    st = status(ready=1, target=2, hits=hits, misses=misses)
    fill = charts.pool_fill(st, events, since=t0 - 60, now=now)
    assert fill.series[0].values == (0, 0, 1, 2, 1, 1, 1)
    assert fill.series[1].values[-1] == 2
    rate = charts.pool_hit_rate(st, events, since=t0 - 60, now=now)
    assert sum(v for v in rate.series[1].values if v) == 1 and sum(v for v in rate.series[2].values if v) == 1
    assert charts.hit_rate(st) == 50


def test_names_become_safe_distinct_element_ids() -> None:
    assert charts.dom_id("py-3_x") == "py-3_x"
    a, b = charts.dom_id("a.b"), charts.dom_id("a_b")
    assert a != b and re.fullmatch(r"[A-Za-z0-9_-]+", a)
    assert re.fullmatch(r"[A-Za-z0-9_-]+", charts.dom_id('"><img src=x onerror=alert(1)>'))
    assert re.fullmatch(r"[A-Za-z0-9_-]+", charts.dom_id(""))


# ---- cost


DAY = 86400


def test_cost_per_hour_per_tenant_with_budget_and_running_day_total() -> None:
    base = 10 * DAY  # midnight UTC
    usage = [
        UsageBucket("acme", base + 22 * 3600, 3600.0, 7200.0),  # 1 cpu-h, 2 GiB-h
        UsageBucket("acme", base + 23 * 3600, 1800.0, 0.0),
        UsageBucket("acme", base + DAY, 7200.0, 3600.0),  # the next day starts the running total over
        UsageBucket("other", base + 23 * 3600, 99999.0, 99999.0),  # not asked for
    ]
    cpu, gib = charts.cost_charts(
        usage,
        tenants=["acme"],
        since=base + 22 * 3600,
        now=base + DAY + 3600,
        budget=charts.Budget(cpu_hours=2.0, gib_hours=10.0),
    )
    assert cpu.x == (base + 22 * 3600, base + 23 * 3600, base + DAY)
    assert cpu.series[0].label == "acme" and cpu.series[0].values == (1.0, 0.5, 2.0)
    assert cpu.series[0].draw == "bars" and all(s.draw in charts.DRAWS for s in cpu.series)
    assert gib.series[0].values == (2.0, 0.0, 1.0)
    assert cpu.series[1].label == "today so far" and cpu.series[1].values == (1.0, 1.5, 2.0)
    assert cpu.markers == (("budget per day", 2.0), ("80% of budget", 1.6))
    assert gib.markers[0] == ("budget per day", 10.0)


def test_cost_per_day_for_every_tenant_has_no_budget_lines() -> None:
    base = 20 * DAY
    usage = [
        UsageBucket("a", base + 3600, 3600.0, 0.0),
        UsageBucket("a", base + 7200, 3600.0, 0.0),
        UsageBucket("b", base, 0.0, 36.0),
    ]
    usage.append(UsageBucket("", base, 360.0, 0.0))  # the host's own and the pools' before a claim
    cpu, gib = charts.cost_charts(
        usage, tenants=["a", "b", "c", ""], since=base, now=base + 2 * DAY, bucket_s=DAY, budget=charts.Budget(1, 1)
    )
    assert cpu.x == (base, base + DAY)
    assert [s.label for s in cpu.series] == ["a", "b", "c", "(host)"]
    assert cpu.series[3].values == (0.1, 0.0)
    assert cpu.series[0].values == (2.0, 0.0) and cpu.series[2].values == (0.0, 0.0)
    assert gib.series[1].values == (36.0, 0.0) and gib.series[1].unit == "GiB-seconds"  # peak 0.01 h: in seconds
    assert cpu.markers == ()  # a budget is one tenant's
    assert {s.draw for s in cpu.series} == {"line"}  # several tenants' bars would hide each other
    assert charts.top_tenants(usage, 1) == (["a"], 3)
    assert charts.top_tenants(usage) == (["a", "", "b"], 3)
    with pytest.raises(InvalidArgument):
        charts.cost_charts(usage, tenants=["a"], since=base, now=base + DAY, bucket_s=600)


# ---- the vendored library


def test_vendored_uplot_matches_its_readme_and_is_self_contained() -> None:
    vendor = STATIC / "vendor" / "uplot"
    readme = (vendor / "README.md").read_text()
    assert "npm pack uplot@1.6.32" in readme
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        digest = hashlib.sha256((vendor / name).read_bytes()).hexdigest()
        assert f"| {name} | {digest} |" in readme, name
    assert "MIT" in (vendor / "LICENSE").read_text()
    js = (vendor / "uPlot.iife.min.js").read_text()
    assert "eval(" not in js and "new Function" not in js  # runs under a CSP without 'unsafe-eval'


def test_a_small_tenants_cost_is_drawn_in_seconds_and_amounts_never_read_zero() -> None:
    base = 30 * DAY
    usage = [UsageBucket("tiny", base, 0.54, 9.0)]  # 0.00015 cpu-hours, 0.0025 GiB-hours
    cpu, gib = charts.cost_charts(
        usage, tenants=["tiny"], since=base, now=base + 3600, budget=charts.Budget(cpu_hours=0.001, gib_hours=5.0)
    )
    assert cpu.series[0].unit == "cpu-seconds" and cpu.series[0].values == (pytest.approx(0.54),)
    assert cpu.markers == (("budget per day", pytest.approx(3.6)), ("80% of budget", pytest.approx(2.88)))
    assert gib.series[0].unit == "GiB-hours"  # its budget (5 GiB-h) is on the same axis: hours stay
    assert [charts.fmt_amount(v) for v in (0, 0.00015, 0.0000004, 42.748, 0.5, 123456.7, float("nan"))] == [
        "0",
        "0.00015",
        "< 0.0001",
        "42.7",
        "0.5",
        "123,457",
        "?",
    ]


def test_a_tiny_last_pool_stage_still_ends_left_of_the_request_line():
    """A stage drawn wider than its time (2 px at least, to stay visible) must not cross t=0: the
    pool's last stage before a claim can be ~0 ms (a template whose code context starts later)."""
    import re

    from warmbox.models import StageTiming
    from warmbox.server.console.charts import waterfall_svg

    svg = waterfall_svg(
        [
            StageTiming("sb-1", "filesystem", 40.0, False),
            StageTiming("sb-1", "runtime", 60.0, False),
            StageTiming("sb-1", "dependencies", 0.01, False),
            StageTiming("sb-1", "allocation", 1.0, True),
            StageTiming("sb-1", "first_command", 5.0, True),
        ]
    )
    rects = [
        (cls, float(x), float(w))
        for cls, x, w in re.findall(
            r'class="stage (on-path|off-path)".*?<rect x="([\d.]+)" y="[\d.]+" width="([\d.]+)"', svg, re.S
        )
    ]
    first_on = min(x for cls, x, _ in rects if cls == "on-path")
    assert max(x + w for cls, x, w in rects if cls == "off-path") <= first_on + 0.05
