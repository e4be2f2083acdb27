"""The operator's console in a real browser (headless Debian chromium, Playwright) against a real
`warmbox serve` with real container sandboxes: login, the live list, tenant scoping, the stage
waterfall (cold and pooled), the pools page. Each page's screenshot goes to bench-results/console/."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.console.conftest import SHOTS, UI_TIMEOUT_MS, Console
from warmbox import Limits, Sandbox
from warmbox.engine.engine import Engine
from warmbox.models import STAGES

pytestmark = [pytest.mark.sandbox, pytest.mark.console]

LIST_BOUND_S = 2.0  # the bound: a created sandbox is in the open list page within 2 s


def login(browser, console: Console, who: str):
    """A fresh browser context logged in as ``who`` through the login form; its page, on the list."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    ctx.set_default_timeout(UI_TIMEOUT_MS)
    page = ctx.new_page()
    page.goto(console.url + "/ui/")
    assert "/ui/login" in page.url, f"not logged in, the list must send to the login page: {page.url}"
    page.fill("#login-key", console.keys[who].secret)
    page.click("#login-submit")
    page.wait_for_url(console.url + "/ui/")
    return page


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def row(page, sandbox_id: str):
    return page.locator(f'[data-sandbox-id="{sandbox_id}"]')


def test_login_refuses_a_wrong_key(browser, console: Console):
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        page.goto(console.url + "/ui/login")
        page.fill("#login-key", "wb-not-a-key")
        page.click("#login-submit")
        assert "/ui/login" in page.url
        assert page.locator("#login-error").is_visible()
        shot(page, "login-refused")
        # without a session cookie, the list's data is refused too (its fragment, fetched directly)
        r = page.request.get(console.url + "/ui/frag/sandboxes", max_redirects=0)
        assert r.status in (303, 401), r.status
    finally:
        ctx.close()


def test_list_shows_a_new_sandbox_live(browser, console: Console):
    page = login(browser, console, "acme")
    try:
        with Sandbox.create(tier="container", timeout=120, metadata={"who": "list-test"}, **console.sdk("acme")) as sb:
            created = time.monotonic()
            # the page stays open: its own refresh must bring the row (no reload)
            r = page.locator(f'tr[data-sandbox-id="{sb.sandbox_id}"][data-state="ready"]')
            r.wait_for(state="visible", timeout=LIST_BOUND_S * 1000)
            seen_s = time.monotonic() - created
            assert r.get_attribute("data-tier") == "container"
            assert r.locator('[data-field="state"]').inner_text() == "ready"
            shot(page, "list")
            print(f"list: sandbox visible {seen_s * 1000:.0f} ms after create() returned")
    finally:
        page.context.close()


@pytest.fixture(scope="module")
def acme_box(console: Console):
    with Sandbox.create(tier="container", timeout=300, **console.sdk("acme")) as sb:
        sb.commands.run(["true"])
        yield sb


@pytest.fixture(scope="module")
def umbrella_box(console: Console):
    with Sandbox.create(tier="container", timeout=300, **console.sdk("umbrella")) as sb:
        yield sb


def test_other_tenants_sandboxes_are_invisible(browser, console: Console, acme_box, umbrella_box):
    page = login(browser, console, "umbrella")
    try:
        row(page, umbrella_box.sandbox_id).wait_for(state="visible")
        assert row(page, acme_box.sandbox_id).count() == 0
        assert acme_box.sandbox_id not in page.content()
        shot(page, "list-umbrella")
        # nor by its address: the sandbox page of another tenant's id is a 404, as in the API
        r = page.goto(f"{console.url}/ui/sandboxes/{acme_box.sandbox_id}")
        assert r is not None and r.status == 404, r and r.status
        assert page.locator("#error").get_attribute("data-error-code") == "sandbox_not_found"
        assert page.locator("#sandbox").count() == 0
    finally:
        page.context.close()
    admin = login(browser, console, "ops")
    try:
        row(admin, acme_box.sandbox_id).wait_for(state="visible")
        row(admin, umbrella_box.sandbox_id).wait_for(state="visible")
        assert row(admin, acme_box.sandbox_id).get_attribute("data-tenant") == "acme"
        assert row(admin, umbrella_box.sandbox_id).get_attribute("data-tenant") == "umbrella"
        assert row(admin, acme_box.sandbox_id).locator("td.tenant").inner_text() == "acme"
        shot(admin, "list-admin")
    finally:
        admin.context.close()


def check_waterfall(page, console: Console, who: str, sandbox_id: str, start: str) -> None:
    """The sandbox page's SVG waterfall against the Timings op: one bar per recorded start stage with
    its recorded duration, on or off the request path as recorded, and drawn to scale: on-path bars
    end to end from the request line in stage order, each as wide as its share of the time."""
    timings = console.api(who, "GET", f"/v1/sandboxes/{sandbox_id}/timings")
    assert isinstance(timings, list)
    # in start order (a pooled sandbox records its claim's allocation last); pause/resume are no start stages
    recorded = sorted((t for t in timings if t["stage"] in STAGES), key=lambda t: STAGES.index(t["stage"]))
    assert recorded
    page.goto(f"{console.url}/ui/sandboxes/{sandbox_id}")
    svg = page.locator("svg#waterfall")
    svg.wait_for(state="visible")
    assert svg.get_attribute("data-start") == start
    bars = page.locator("svg#waterfall g.stage")
    drawn = []
    for i in range(bars.count()):
        g = bars.nth(i)
        box = g.locator("rect").bounding_box()
        assert box is not None and box["height"] > 0
        drawn.append(
            (
                g.get_attribute("data-stage"),
                float(g.get_attribute("data-ms") or "nan"),
                g.get_attribute("data-on-path"),
                box,
            )
        )
    want = [(t["stage"], t["duration_ms"], "true" if t["on_request_path"] else "false") for t in recorded]
    assert [d[:3] for d in drawn] == want
    table = page.locator("#timings tbody tr td:first-child").all_inner_texts()
    assert table[: len(want)] == [w[0] for w in want], table  # the table lists them in the waterfall's order
    on = [(ms, box) for _s, ms, flag, box in drawn if flag == "true"]
    total_ms, total_px = sum(ms for ms, _ in on), sum(box["width"] for _, box in on)
    for (_, box), (_, nxt) in itertools.pairwise(on):
        assert abs(box["x"] + box["width"] - nxt["x"]) < 2.5, "on-path bars must run end to end"
    for ms, box in on:
        if box["width"] > 3:  # (a tiny stage is drawn 2 px wide to stay visible)
            assert abs(box["width"] / total_px - ms / total_ms) < 0.02, (ms, box, total_ms, total_px)
    off = [box for _s, _ms, flag, box in drawn if flag == "false"]
    if on and off:  # what the pool did is drawn left of the request line
        assert max(b["x"] + b["width"] for b in off) <= on[0][1]["x"] + 2.5


def test_waterfall_of_a_cold_start(browser, console: Console, acme_box):
    page = login(browser, console, "acme")
    try:
        check_waterfall(page, console, "acme", acme_box.sandbox_id, "cold")
        shot(page, "sandbox")
    finally:
        page.context.close()


def test_export_button_downloads_the_transcript(browser, console: Console, acme_box):
    page = login(browser, console, "acme")
    try:
        page.goto(f"{console.url}/ui/sandboxes/{acme_box.sandbox_id}")
        with page.expect_download() as got:
            page.click("#export-button")
        download = got.value
        assert download.suggested_filename == f"{acme_box.sandbox_id}.ndjson"
        lines = [json.loads(line) for line in Path(download.path()).read_text().splitlines()]
        assert lines[0]["type"] == "export" and lines[0]["sandbox_id"] == acme_box.sandbox_id
        kinds = {line["type"] for line in lines}
        assert {"sandbox", "timing", "command"} <= kinds, kinds
        commands = [line for line in lines if line["type"] == "command"]
        assert any(c["text"] == "true" and c["exit_code"] == 0 for c in commands), commands
    finally:
        page.context.close()


def test_pools_page_charts_fill_and_hits(browser, console: Console):
    engine = Engine.for_home(console.home)
    engine.ensure_daemon()  # the daemon keeps pools warm; `warmbox serve` starts it at its first sandbox
    wait_for(lambda: engine.registry.pools.pool_counts("console")[0] >= 1, 120, "the console pool to fill")
    page = login(browser, console, "ops")
    try:
        page.goto(console.url + "/ui/pools")
        page.locator('section.pool-card[data-pool="console"]').wait_for(state="visible")
        assert page.locator("#pool-console-ready").get_attribute("data-value") == "1"
        hits = int(page.locator("#pool-console-hits").get_attribute("data-value") or "-1")
        with Sandbox.create(tier="container", limits=Limits(memory_mb=256), timeout=60, **console.sdk("acme")) as sb:
            assert sb.from_pool, "the console pool had a ready sandbox but create() did not take it"
            check_waterfall(page, console, "acme", sb.sandbox_id, "pooled")
            shot(page, "sandbox-pooled")
        page.goto(console.url + "/ui/pools")
        page.locator(f'#pool-console-hits[data-value="{hits + 1}"]').wait_for(state="attached")
        for chart in ("pool-fill-console", "pool-hits-console"):
            div = page.locator(f'div[data-chart-id="{chart}"][data-rendered="true"]')
            div.wait_for(state="visible")
            assert int(div.get_attribute("data-points") or "0") > 0, f"{chart} drew no data"
            canvas = div.locator("canvas").first
            box = canvas.bounding_box()
            assert box is not None and box["width"] > 100 and box["height"] > 50, box
        assert page.locator("[data-chart-id][data-error]").count() == 0
        shot(page, "pools")
    finally:
        page.context.close()


def _cpu_s(engine: Engine, tenant: str) -> float:
    return sum(b.cpu_s for b in engine.registry.usage.usage(tenant, time.time() - 86400))


BURN = "import time\nwhile time.process_time() < 0.5: pass"  # 0.5 s of CPU, however loaded the host


def test_cost_page_charts_a_tenants_use(browser, console: Console):
    engine = Engine.for_home(console.home)
    before = _cpu_s(engine, "acme")
    with Sandbox.create(tier="container", timeout=120, **console.sdk("acme")) as sb:
        assert sb.commands.run(["python3", "-c", BURN], timeout=60).exit_code == 0
        # the daemon's meter readings (every second) fill the hourly usage the page charts
        wait_for(lambda: _cpu_s(engine, "acme") >= before + 0.4, 30, "acme's CPU use to be metered")
    page = login(browser, console, "ops")
    try:
        page.goto(console.url + "/ui/cost")
        page.select_option("select#cost-tenant", "acme")  # sends its form: the page of one tenant
        page.wait_for_url("**/ui/cost?*tenant=acme*")
        assert page.locator("#cost-tenant-name").inner_text() == "acme"
        total = page.locator('table#cost-totals tr[data-tenant="acme"] td.cpu-h')
        assert float(total.get_attribute("data-value") or "0") * 3600 >= before + 0.4
        for chart in ("cost-cpu", "cost-gib"):
            div = page.locator(f'div[data-chart-id="{chart}"][data-rendered="true"]')
            div.wait_for(state="visible")
            assert int(div.get_attribute("data-points") or "0") > 0, f"{chart} drew no data"
            box = div.locator("canvas").first.bounding_box()
            assert box is not None and box["width"] > 100 and box["height"] > 50, box
        assert page.locator("[data-chart-id][data-error]").count() == 0
        shot(page, "cost")
        # a budgeted tenant's page shows today's use against its budget (spender: 0.001 CPU-hours a day)
        page.select_option("select#cost-tenant", "spender")
        page.wait_for_url("**/ui/cost?*tenant=spender*")
        assert float(page.locator("#cost-budget").get_attribute("data-cpu-limit-h") or "0") == 0.001
        shot(page, "cost-budget")
    finally:
        page.context.close()
