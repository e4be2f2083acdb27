"""The console's pictures: a server-rendered SVG stage waterfall and the data behind its uPlot charts.

Pure functions of registry records (no I/O, no clock: callers pass ``now``), so each is unit
tested with plain records. Everything a sandbox or a tenant can name (a stage, a pool, a tenant)
is escaped into the SVG; the chart data is JSON that the page's scripts hand to uPlot, which
writes labels with ``textContent`` (never HTML).

Time on every chart is unix seconds (uPlot's x unit); cost is cpu-hours and GiB-hours.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import math
import re
from collections.abc import Iterable, Sequence

from warmbox.errors import InvalidArgument
from warmbox.models import STAGES, PoolEvent, PoolStatus, StageTiming, UsageBucket

# the order a start's stages happen in: ``template`` (a template built on the way) first; an
# unknown stage after the known ones, in its given order. ``pause`` and ``resume`` are timed too
# but are not part of the start (each is the sandbox's latest): the waterfall leaves them out.
ORDER = ("template", *STAGES)
NOT_START = frozenset({"pause", "resume"})

# ---- the stage waterfall (SVG)

ON_PATH_FILL = "#2f6fd0"  # what the caller waited for
OFF_PATH_FILL = "#b9c3d0"  # what a pool did before anyone asked
_ROW_H = 22
_BAR_H = 14
_LABEL_W = 118
_MS_W = 86
_LEGEND_BOTTOM = 36  # the legend's row ends here (its text's baseline at 34)
_REQUEST_Y = 50  # the "request" label's baseline: a row of its own under the legend
_HEAD_H = 58
_AXIS_H = 22


def _esc(s: str) -> str:
    return html.escape(s, quote=True)


def _ms(v: float) -> float:
    """A duration fit to draw: a negative, NaN or infinite one (a corrupt row) draws as 0."""
    return v if math.isfinite(v) and v > 0 else 0.0


def fmt_ms(v: float) -> str:
    """A duration for a label: 0.42 ms, 12.3 ms, 1,234 ms."""
    v = _ms(v)
    if v < 10:
        return f"{v:.2f} ms"
    if v < 100:
        return f"{v:.1f} ms"
    return f"{v:,.0f} ms"


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = span / max(1, ticks)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def ordered(timings: Iterable[StageTiming]) -> list[StageTiming]:
    """The start's timings, one per stage (the last recorded wins, as in the registry), in start order."""
    last: dict[str, StageTiming] = {}
    for t in timings:
        if t.stage in NOT_START:
            continue
        last.pop(t.stage, None)  # a re-recorded stage keeps its newest value
        last[t.stage] = t
    known = [last[s] for s in ORDER if s in last]
    return known + [t for s, t in last.items() if s not in ORDER]


def waterfall_svg(timings: Sequence[StageTiming], *, width: int = 720, title: str = "") -> str:
    """A picture of where a sandbox's start time went, as one ``<svg>`` element (escaped, inline-safe).

    One row per stage in start order. The request path runs right from t=0 (the vertical line):
    each on-path stage starts where the previous one ended. Stages a pool did beforehand
    (``on_request_path`` False) are drawn to the left of t=0, pale with a dashed outline, so a
    pooled start shows its saved time and a cold start has nothing left of the line.

    For tests and scripts: the root has ``id="waterfall"``, ``data-start`` ("cold" | "pooled" |
    "none"), ``data-on-path-ms`` and ``data-off-path-ms`` (sums); each bar is a ``<g
    class="stage on-path|off-path">`` with ``data-stage``, ``data-ms`` (the recorded duration,
    ``repr`` of the float) and ``data-on-path`` ("true" | "false").
    width: pixels of the drawing (it scales with its container through ``viewBox``).
    """
    rows = ordered(timings)
    on = [t for t in rows if t.on_request_path]
    off = [t for t in rows if not t.on_request_path]
    on_ms = sum(_ms(t.duration_ms) for t in on)
    off_ms = sum(_ms(t.duration_ms) for t in off)
    kind = "none" if not rows else ("pooled" if off else "cold")
    width = max(320, min(int(width), 4000))
    height = _HEAD_H + max(1, len(rows)) * _ROW_H + _AXIS_H
    x0, x1 = _LABEL_W, width - _MS_W  # the bar area
    span = on_ms + off_ms
    scale = (x1 - x0) / span if span > 0 else 0.0
    zero = x0 + off_ms * scale  # t=0: the request

    if kind == "pooled":
        head = f"pooled start: {fmt_ms(on_ms)} on the request path ({fmt_ms(off_ms)} done beforehand by the pool)"
    elif kind == "cold":
        head = f"cold start: {fmt_ms(on_ms)} on the request path"
    else:
        head = "no start timings recorded"
    if title:
        head = f"{title} — {head}"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" id="waterfall" class="waterfall {kind}" role="img" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" data-start="{kind}" '
        f'data-on-path-ms="{on_ms!r}" data-off-path-ms="{off_ms!r}" font-family="sans-serif" font-size="12">',
        f"<title>{_esc(head)}</title>",
        f'<text class="waterfall-head" x="4" y="18" font-size="13" font-weight="bold">{_esc(head)}</text>',
    ]
    if kind != "none":  # the legend, under the heading
        lx = 4
        out.append(
            f'<g class="legend" font-size="10"><rect x="{lx}" y="26" width="10" height="8" fill="{ON_PATH_FILL}"/>'
            f'<text x="{lx + 14}" y="34">request path</text>'
            f'<rect x="{lx + 100}" y="26" width="10" height="8" fill="{OFF_PATH_FILL}" stroke="#5a6b80" '
            f'stroke-dasharray="3 2"/><text x="{lx + 114}" y="34">done beforehand by a pool</text></g>'
        )
    # the time axis: ticks every nice step either side of t=0
    axis_y = _HEAD_H + max(1, len(rows)) * _ROW_H
    out.append('<g class="axis" stroke="#999" fill="#555">')
    out.append(f'<line x1="{x0}" y1="{axis_y}" x2="{x1}" y2="{axis_y}"/>')
    if scale > 0:
        step = _nice_step(span)
        k = -math.floor(off_ms / step)
        while k * step <= on_ms + 1e-9:
            x = zero + k * step * scale
            if x0 - 0.5 <= x <= x1 + 0.5:
                out.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}"/>')
                out.append(
                    f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle" stroke="none">{k * step:g}</text>'
                )
            k += 1
        out.append(f'<text x="{x1 + 4}" y="{axis_y + 16}" stroke="none">ms</text>')
    out.append("</g>")

    t_on = t_off = 0.0  # where the next bar of each path starts, in ms from its own origin
    for i, t in enumerate(rows):
        ms = _ms(t.duration_ms)
        y = _HEAD_H + i * _ROW_H
        if t.on_request_path:
            bx = zero + t_on * scale
            t_on += ms
            cls, fill, extra = "on-path", ON_PATH_FILL, ""
            where = "on the request path"
        else:
            bx = x0 + t_off * scale
            t_off += ms
            cls, fill, extra = "off-path", OFF_PATH_FILL, ' stroke="#5a6b80" stroke-dasharray="3 2"'
            where = "done beforehand by the pool (off the request path)"
        bw = max(2.0, ms * scale)  # a 0.1 ms stage still shows
        if not t.on_request_path:  # ... and a tiny stage the pool did last still ends left of t=0
            bx = max(x0, min(bx, zero - bw))
        stage = _esc(t.stage)
        out.append(
            f'<g class="stage {cls}" data-stage="{stage}" data-ms="{t.duration_ms!r}" '
            f'data-on-path="{"true" if t.on_request_path else "false"}">'
        )
        out.append(f"<title>{stage}: {_esc(fmt_ms(ms))}, {where}</title>")
        out.append(f'<text class="stage-name" x="4" y="{y + 15}">{stage}</text>')
        out.append(
            f'<rect x="{bx:.1f}" y="{y + (_ROW_H - _BAR_H) / 2:.1f}" width="{bw:.1f}" height="{_BAR_H}" '
            f'fill="{fill}"{extra}/>'
        )
        out.append(f'<text class="stage-ms" x="{width - 4}" y="{y + 15}" text-anchor="end">{_esc(fmt_ms(ms))}</text>')
        out.append("</g>")
    if scale > 0 and off:
        out.append(
            f'<g class="request-line"><line x1="{zero:.1f}" y1="{_REQUEST_Y - 10}" x2="{zero:.1f}" y2="{axis_y}" '
            f'stroke="#d04a2f" stroke-width="1.5"/>'
            # its own row, under the legend (they overlapped when t=0 fell under the legend's text);
            # right of the line, or left of it near the right edge
            + (
                f'<text x="{zero + 3:.1f}" y="{_REQUEST_Y}" fill="#d04a2f" font-size="10">request</text></g>'
                if zero + 50 < width
                else f'<text x="{zero - 3:.1f}" y="{_REQUEST_Y}" fill="#d04a2f" font-size="10" '
                f'text-anchor="end">request</text></g>'
            )
        )
    out.append("</svg>")
    return "".join(out)


# ---- chart data (uPlot's columnar format: one x column, then one column per series; None = gap)


DRAWS = ("line", "step", "area-step", "points", "bars", "bars-left", "bars-right")


@dataclasses.dataclass(frozen=True)
class Series:
    """One line or bar set of a chart; ``values`` line up with the chart's ``x`` (None: a gap).

    unit: its axis (a chart's first unit is the left axis, a second one the right axis).
    draw: how static/charts.js draws it, one of DRAWS ("bars-left"/"bars-right": two bar sets
    side by side in one bucket). color: "#rrggbb" where the meaning asks for one (a miss is
    red), "" for the palette's next.
    """

    label: str
    values: tuple[float | None, ...]
    unit: str = ""
    draw: str = "line"
    color: str = ""


@dataclasses.dataclass(frozen=True)
class Chart:
    """The data of one uPlot chart: ``x`` in unix seconds, ascending, and its series.

    chart_id: the page element that shows it is ``[data-chart-id=<chart_id>]``.
    markers: horizontal lines (a budget, its warning share) as (label, y) in the first unit.
    """

    chart_id: str
    title: str
    x: tuple[float, ...]
    series: tuple[Series, ...]
    markers: tuple[tuple[str, float], ...] = ()

    def to_json(self) -> dict[str, object]:
        """The wire form static/charts.js reads."""
        return {
            "id": self.chart_id,
            "title": self.title,
            "x": list(self.x),
            "series": [
                {"label": s.label, "unit": s.unit, "draw": s.draw, "color": s.color, "values": list(s.values)}
                for s in self.series
            ],
            "markers": [{"label": label, "y": y} for label, y in self.markers],
        }


NICE_BUCKETS_S = (60, 300, 600, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400)


def bucket_for(window_s: float, buckets: int = 48) -> int:
    """The smallest round bucket (1 min … 1 day) that cuts ``window_s`` into at most ``buckets``."""
    for b in NICE_BUCKETS_S:
        if window_s / b <= buckets:
            return b
    return NICE_BUCKETS_S[-1]


# ---- pools: fill level (ready vs target) and hit rate over time

HIT_COLOR, MISS_COLOR, TARGET_COLOR = "#3aa876", "#c0392b", "#555555"

# how each event moves the count of ready sandboxes (a claim_failed follows the hit that took it)
_READY_DELTA = {"warmed": 1, "hit": -1, "retired": -1}
_TARGET_CHANGE = re.compile(r"target (\d+)->(\d+)")
_TARGET_SET = re.compile(r"target=(\d+)")


def dom_id(name: str) -> str:
    """The element-id fragment the pages use for a pool or tenant: ASCII letters, digits, - and _.

    A name that had to be changed gets a short hash of itself, so two names never share an id.
    """
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:48]
    if safe == name and safe:
        return safe
    return f"{safe}-{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


def pool_fill(
    status: PoolStatus, events: Sequence[PoolEvent], *, since: float, now: float, max_points: int = 1500
) -> Chart:
    """Ready sandboxes and the target over [since, now], as step lines.

    max_points: a busy pool's week has a point per claim; beyond this many, each of
    ``max_points`` equal time slices keeps its last point (the level it ended at), so the
    answer stays small whatever the traffic (the first and last points are always kept).

    The ready count is rebuilt from the events (warmed +1, hit -1, retired -1) backwards from
    ``status.ready``, so its right end is exact and an event lost before ``since`` cannot shift
    it; a pooled sandbox that expired unclaimed leaves no event, so older points can read high
    (never below 0). The target follows ``resized`` and ``scaled`` events, ending at
    ``status.target``. events: the pool's, ascending by time (``PoolStore.pool_events``).
    """
    evs = [e for e in events if since <= e.at <= now and e.pool == status.name]
    evs.sort(key=lambda e: e.at)
    ready = status.ready
    after: list[int] = []  # ready count just after each event, filled backwards
    for e in reversed(evs):
        after.append(max(0, ready))
        ready -= _READY_DELTA.get(e.kind, 0)
    after.reverse()
    start_ready = max(0, ready)

    targets: list[int | None] = []  # target just after each event (None: unchanged)
    start_target: int | None = None  # before the window's first change: its "from", else its value
    for e in evs:
        new: int | None = None
        if e.kind in ("resized", "scaled"):
            if m := _TARGET_CHANGE.search(e.detail):
                new = int(m.group(2))
                start_target = int(m.group(1)) if start_target is None else start_target
            elif m := _TARGET_SET.search(e.detail):
                new = int(m.group(1))
                start_target = new if start_target is None else start_target
        targets.append(new)
    if start_target is None:  # no change in the window: today's
        start_target = status.target

    xs: list[float] = [since]
    rs: list[float | None] = [float(start_ready)]
    ts: list[float | None] = [float(start_target)]
    cur = start_target
    for e, r, t in zip(evs, after, targets, strict=True):
        cur = t if t is not None else cur
        xs.append(e.at)
        rs.append(float(r))
        ts.append(float(cur))
    xs.append(now)
    rs.append(float(status.ready))
    ts.append(float(status.target))
    keep = _thin(xs, max(2, max_points))
    return Chart(
        chart_id=f"pool-fill-{dom_id(status.name)}",
        title=f"{status.name}: ready vs target",
        x=tuple(xs[i] for i in keep),
        series=(
            Series("ready", tuple(rs[i] for i in keep), "sandboxes", "area-step", ON_PATH_FILL),
            Series("target", tuple(ts[i] for i in keep), "sandboxes", "step", TARGET_COLOR),
        ),
    )


def _thin(xs: Sequence[float], max_points: int) -> list[int]:
    """Indices of ``xs`` (ascending) to keep: all if few, else the last in each of max_points slices."""
    if len(xs) <= max_points:
        return list(range(len(xs)))
    lo, width = xs[0], (xs[-1] - xs[0]) / max_points or 1.0
    keep = [0]
    for i in range(1, len(xs) - 1):
        if int((xs[i + 1] - lo) / width) != int((xs[i] - lo) / width):  # the last point of its slice
            keep.append(i)
    keep.append(len(xs) - 1)
    return keep


def pool_hit_rate(
    status: PoolStatus, events: Sequence[PoolEvent], *, since: float, now: float, bucket_s: int | None = None
) -> Chart:
    """Hits, misses and the hit rate (%) per bucket over [since, now); a bucket without claims has no rate.

    A hit whose sandbox then failed its claim check (``claim_failed``) is not a hit: the caller
    got the next one (as ``PoolStore.pool_totals`` counts). bucket_s: None picks one (``bucket_for``).
    """
    step = bucket_s or bucket_for(now - since)
    first = math.floor(since / step) * step
    n = max(1, math.ceil((now - first) / step))
    hits = [0] * n
    misses = [0] * n
    for e in events:
        if e.pool != status.name or not since <= e.at <= now:
            continue
        i = min(n - 1, int((e.at - first) // step))
        if e.kind == "hit":
            hits[i] += 1
        elif e.kind == "claim_failed":
            hits[i] -= 1
        elif e.kind == "miss":
            misses[i] += 1
    hits = [max(0, h) for h in hits]
    rate = tuple(None if h + m == 0 else 100.0 * h / (h + m) for h, m in zip(hits, misses, strict=True))
    return Chart(
        chart_id=f"pool-hits-{dom_id(status.name)}",
        title=f"{status.name}: hit rate per {_span(step)}",
        x=tuple(float(first + i * step) for i in range(n)),
        series=(
            Series("hit rate", rate, "%", "points"),
            Series("hits", tuple(float(h) for h in hits), "claims", "bars-left", HIT_COLOR),
            Series("misses", tuple(float(m) for m in misses), "claims", "bars-right", MISS_COLOR),
        ),
    )


def hit_rate(status: PoolStatus) -> float | None:
    """The pool's hit rate so far in % (None before its first claim)."""
    total = status.hits + status.misses
    return None if total == 0 else 100.0 * status.hits / total


def _span(s: int) -> str:
    if s % 86400 == 0:
        return "day" if s == 86400 else f"{s // 86400} days"
    if s % 3600 == 0:
        return "hour" if s == 3600 else f"{s // 3600} h"
    return f"{s // 60} min"


# ---- cost per tenant over time


@dataclasses.dataclass(frozen=True)
class Budget:
    """A tenant's budget per UTC day (0: none) in cpu-hours and GiB-hours, and the share that warns."""

    cpu_hours: float = 0.0
    gib_hours: float = 0.0
    warn_ratio: float = 0.8


def cost_charts(
    usage: Sequence[UsageBucket],
    *,
    tenants: Sequence[str],
    since: float,
    now: float,
    bucket_s: int = 3600,
    budget: Budget | None = None,
) -> tuple[Chart, Chart]:
    """(cpu-hours, GiB-hours) per bucket over [since, now), one series per tenant in ``tenants``.

    bucket_s: 3600 (per hour) or 86400 (per day); buckets are aligned to UTC. A tenant
    without use in a bucket reads 0 there (it used nothing), not a gap.
    budget: with one tenant, its daily budget: per-day charts get the budget and its 80 %
    line as markers; per-hour ones also get a "today so far" series (running sum that restarts
    at 00:00 UTC), which is what the budget is checked against.
    """
    if bucket_s not in (3600, 86400):
        raise InvalidArgument(f"bucket_s must be 3600 or 86400, got {bucket_s}")
    first = math.floor(since / bucket_s) * bucket_s
    n = max(1, math.ceil((now - first) / bucket_s))
    index = {t: i for i, t in enumerate(tenants)}
    cpu = [[0.0] * n for _ in tenants]
    gib = [[0.0] * n for _ in tenants]
    for u in usage:
        i = index.get(u.tenant)
        if i is None or not first <= u.hour < first + n * bucket_s:
            continue
        b = int((u.hour - first) // bucket_s)
        cpu[i][b] += u.cpu_s / 3600
        gib[i][b] += u.gib_s / 3600
    xs = tuple(float(first + b * bucket_s) for b in range(n))
    per = _span(bucket_s)
    charts = []
    for what, cols, unit, limit in (
        ("cpu", cpu, "cpu-hours", budget.cpu_hours if budget else 0.0),
        ("gib", gib, "GiB-hours", budget.gib_hours if budget else 0.0),
    ):
        # a small tenant's hours read as 0.000…: below 0.1 h everything (its budget too) is in seconds
        peak = max([v for c in cols for v in c] + [limit if budget is not None and len(tenants) == 1 else 0.0])
        if 0 < peak < 0.1:
            cols = [[v * 3600 for v in c] for c in cols]
            limit *= 3600
            unit = unit.replace("-hours", "-seconds")
        draw = "bars" if len(tenants) == 1 else "line"  # several tenants' bars would hide each other
        # tenant "": the host's own sandboxes and the pools' before a claim
        series = [Series(t or "(host)", tuple(c), unit, draw) for t, c in zip(tenants, cols, strict=True)]
        markers: tuple[tuple[str, float], ...] = ()
        if budget is not None and len(tenants) == 1 and limit > 0:
            markers = (("budget per day", limit), (f"{budget.warn_ratio:.0%} of budget", budget.warn_ratio * limit))
            if bucket_s == 3600:
                series.append(Series("today so far", _per_day_running(xs, cols[0]), unit, "step", TARGET_COLOR))
        charts.append(
            Chart(
                chart_id=f"cost-{what}",
                title=f"{unit} per {per}",
                x=xs,
                series=tuple(series),
                markers=markers,
            )
        )
    return charts[0], charts[1]


def _per_day_running(xs: Sequence[float], values: Sequence[float]) -> tuple[float | None, ...]:
    out: list[float | None] = []
    day, total = None, 0.0
    for x, v in zip(xs, values, strict=True):
        d = math.floor(x / 86400)
        if d != day:
            day, total = d, 0.0
        total += v
        out.append(total)
    return tuple(out)


def fmt_amount(v: float) -> str:
    """An amount for a table or a label: 3 significant digits, thousands separated, no exponent."""
    if not math.isfinite(v):
        return "?"
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) < 0.0001:
        return "< 0.0001" if v > 0 else "> -0.0001"
    return f"{v:.3g}"  # 0.0001 .. 999: never an exponent


def top_tenants(usage: Iterable[UsageBucket], n: int = 10) -> tuple[list[str], int]:
    """(the ``n`` tenants that used the most cpu, then memory, in ``usage``, by name on ties; how many used any)."""
    totals: dict[str, tuple[float, float]] = {}
    for u in usage:
        c, g = totals.get(u.tenant, (0.0, 0.0))
        totals[u.tenant] = (c + u.cpu_s, g + u.gib_s)
    ranked = sorted(totals, key=lambda t: (-totals[t][0], -totals[t][1], t))
    return ranked[:n], len(ranked)
