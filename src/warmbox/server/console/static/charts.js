// The console's charts: uPlot plots of the JSON that warmbox/server/console/charts.py builds.
//
// Every element with data-charts-src="<same-origin URL>" is loaded (with the console's cookie);
// the answer's charts ({"charts": [...]}, and each {"pools": [{"charts": [...]}]}) fill the
// elements inside it with data-chart-id="<chart id>". data-interval="<ms>" reloads it that often.
// When a chart is drawn its element gets data-rendered="true", data-points="<x count>" and
// data-series='["label", ...]' (for tests and scripts); a failed load sets data-error.
// Labels are written by uPlot with textContent, never as HTML: names here are tenants' and pools'.
// No inline script anywhere: the console's CSP forbids it; this file is loaded with <script src>.
"use strict";
(function () {
  const PALETTE = ["#2f6fd0", "#e07b39", "#3aa876", "#9b59b6", "#16a085", "#7f8c8d", "#2c3e50", "#e84393",
    "#8e6c3a", "#1abc9c"];
  const MARKER_COLORS = ["#c0392b", "#d4a017", "#7f8c8d"]; // a budget (red), its warning share (amber)
  const plots = new Map(); // chart id -> {plot, shape}

  function alpha(hex, a) {
    const n = parseInt(hex.slice(1), 16);
    return "rgba(" + (n >> 16) + "," + ((n >> 8) & 255) + "," + (n & 255) + "," + a + ")";
  }

  function fmt(v, unit) {
    if (v == null || !isFinite(v)) return "–";
    const abs = Math.abs(v);
    const s = abs >= 100 || Number.isInteger(v) ? v.toFixed(0) : abs >= 10 ? v.toFixed(1) : abs >= 0.01 ? v.toFixed(2) : v.toPrecision(2);
    return unit === "%" ? s + " %" : unit ? s + " " + unit : s;
  }

  // x ticks in UTC (a budget's day is a UTC day): "HH:MM", the date where a day starts or the
  // ticks are a day apart or more
  function timeTicks(u, ticks) {
    const daily = ticks.length > 1 && ticks[1] - ticks[0] >= 86400;
    return ticks.map((t, i) => {
      const iso = new Date(t * 1000).toISOString();
      const day = iso.slice(5, 10), hm = iso.slice(11, 16);
      return daily ? day : i === 0 || hm === "00:00" ? hm + "\n" + day : hm;
    });
  }

  // y ticks with as many decimals as their step needs (0.00005 apart: 5 decimals), never an exponent
  function tickLabels(u, ticks) {
    const step = ticks.length > 1 ? Math.abs(ticks[1] - ticks[0]) : 1;
    const digits = step > 0 ? Math.min(8, Math.max(0, -Math.floor(Math.log10(step)))) : 0;
    return ticks.map((t) => t.toFixed(digits));
  }

  // room for the longest tick label plus the axis title (so the title never covers the labels)
  function axisSize(u, values) {
    const longest = (values || []).reduce((n, v) => Math.max(n, String(v).length), 1);
    return Math.ceil(longest * 7 + 30);
  }

  function seriesOpts(s, i, units) {
    const color = /^#[0-9a-f]{6}$/.test(s.color || "") ? s.color : PALETTE[i % PALETTE.length];
    const o = {
      label: s.label,
      scale: s.unit || "y",
      stroke: color,
      width: 2,
      spanGaps: false,
      value: (u, v) => fmt(v, s.unit),
    };
    const paths = uPlot.paths;
    if (s.draw === "step") {
      o.paths = paths.stepped({ align: 1 });
      o.dash = [6, 3];
    } else if (s.draw === "area-step") {
      o.paths = paths.stepped({ align: 1 });
      o.fill = alpha(color, 0.18);
    } else if (s.draw === "points") { // a rate per bucket: dots, no line across empty buckets
      o.paths = () => null;
      o.points = { show: true, size: 7, fill: color };
    } else if (s.draw === "bars" || s.draw === "bars-left" || s.draw === "bars-right") {
      const align = s.draw === "bars-left" ? -1 : s.draw === "bars-right" ? 1 : 0;
      o.paths = paths.bars({ size: [align ? 0.35 : 0.7, 48], align: align });
      o.fill = alpha(color, 0.55);
      o.width = 1;
      o.points = { show: false };
    }
    return o;
  }

  function build(el, chart) {
    const units = [];
    for (const s of chart.series) if (!units.includes(s.unit || "y")) units.push(s.unit || "y");
    const scales = { x: { time: true } };
    const x = chart.x;
    if (x.length > 1 && chart.series.some((s) => (s.draw || "").startsWith("bars"))) {
      const half = (x[1] - x[0]) / 2; // room for the first and last bucket's bar
      scales.x.range = () => [x[0] - half, x[x.length - 1] + half];
    }
    const axes = [{ values: timeTicks }];
    units.forEach((u, i) => {
      scales[u] = u === "%" ? { range: [0, 100] } : { range: (p, lo, hi) => [0, hi > 0 ? hi * 1.15 : 1] };
      axes.push({ scale: u, side: i === 0 ? 3 : 1, label: u === "y" ? "" : u, grid: { show: i === 0 },
        size: axisSize, values: tickLabels });
    });
    const series = [{ value: (u, v) => (v == null ? "–" : new Date(v * 1000).toISOString().slice(0, 16).replace("T", " ") + " UTC") }];
    chart.series.forEach((s, i) => series.push(seriesOpts(s, i, units)));
    chart.markers.forEach((m, i) => series.push({
      label: m.label, scale: units[0], stroke: MARKER_COLORS[i % MARKER_COLORS.length], width: 1.5,
      dash: [8, 4], points: { show: false }, value: () => fmt(m.y, chart.series[0] ? chart.series[0].unit : ""),
    }));
    return {
      title: chart.title,
      width: Math.max(280, el.clientWidth || 600),
      height: parseInt(el.dataset.height || "220", 10),
      tzDate: (ts) => uPlot.tzDate(new Date(ts * 1000), "Etc/UTC"),
      scales: scales,
      axes: axes,
      series: series,
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
    };
  }

  function columns(chart) {
    const data = [chart.x];
    for (const s of chart.series) data.push(s.values);
    for (const m of chart.markers) data.push(chart.x.map(() => m.y));
    return data;
  }

  function draw(el, chart) {
    const shape = JSON.stringify([chart.title, chart.series.map((s) => [s.label, s.unit, s.draw]), chart.markers]);
    const old = plots.get(chart.id);
    if (old && old.shape === shape && old.el === el) {
      old.plot.setData(columns(chart));
    } else {
      if (old) old.plot.destroy();
      el.textContent = "";
      plots.set(chart.id, { plot: new uPlot(build(el, chart), columns(chart), el), shape: shape, el: el });
    }
    el.dataset.rendered = "true";
    el.dataset.points = String(chart.x.length);
    el.dataset.series = JSON.stringify(chart.series.map((s) => s.label));
    delete el.dataset.error;
  }

  // a pool card's numbers follow each reload: pools[].fields -> #pool-<id>-<field> (text and data-value)
  function updateFields(j) {
    for (const p of j.pools || []) {
      for (const [k, v] of Object.entries(p.fields || {})) {
        const el = document.getElementById("pool-" + p.id + "-" + k);
        if (!el) continue;
        if (k === "hit-rate") {
          el.dataset.value = v == null ? "" : v.toFixed(1);
          el.textContent = v == null ? "–" : v.toFixed(1) + " %";
        } else {
          el.dataset.value = String(v);
          el.textContent = String(v);
        }
      }
      const meter = document.getElementById("pool-" + p.id + "-fill");
      if (meter && p.fields) {
        meter.max = Math.max(p.fields.target, p.fields.ready, 1);
        meter.value = p.fields.ready;
      }
    }
  }

  function chartsOf(j) {
    const out = [].concat(j.charts || []);
    for (const p of j.pools || []) out.push(...(p.charts || []));
    return out;
  }

  async function load(root) {
    const src = root.dataset.chartsSrc;
    try {
      const r = await fetch(src, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (!r.ok) throw new Error("HTTP " + r.status);
      const j = await r.json();
      updateFields(j);
      for (const c of chartsOf(j)) {
        for (const el of root.querySelectorAll("[data-chart-id]")) {
          if (el.dataset.chartId === c.id) draw(el, c);
        }
      }
      root.dataset.loaded = "true";
    } catch (e) {
      for (const el of root.querySelectorAll("[data-chart-id]")) {
        if (el.dataset.rendered !== "true") {
          el.dataset.error = String(e.message || e);
          el.textContent = "chart unavailable: " + el.dataset.error;
        }
      }
    }
  }

  function start() {
    for (const root of document.querySelectorAll("[data-charts-src]")) {
      load(root);
      const every = parseInt(root.dataset.interval || "0", 10);
      if (every >= 1000) setInterval(() => { if (!document.hidden) load(root); }, every);
    }
    // a <select data-autosubmit> sends its (GET) form when it changes: no button press needed
    for (const sel of document.querySelectorAll("select[data-autosubmit]")) {
      sel.addEventListener("change", () => sel.form && sel.form.submit());
    }
    let pending = 0;
    window.addEventListener("resize", () => {
      clearTimeout(pending);
      pending = setTimeout(() => {
        for (const { plot, el } of plots.values()) plot.setSize({ width: Math.max(280, el.clientWidth || 600), height: plot.height });
      }, 150);
    });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
