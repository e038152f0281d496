// breakpod dashboard: per-step plots drawn as SVG by hand (no library, nothing fetched).
// A NaN or infinite value is never dropped: it is drawn as a marked point on the
// plot's top edge (NaN, +inf) or bottom edge (-inf), titled with its step and value.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg"; // an XML namespace name: nothing is fetched from it
const PLOT = { width: 480, height: 150, left: 56, right: 10, top: 14, bottom: 22 };
// The series plotted, and the event fields each one is read from (with the event's "step").
const SERIES = { loss: ["loss"], grad_norm: ["grad_norm", "grad_total_norm"] };
const ANOMALY_SERIES = { loss_spike: "loss", grad_norm: "grad_norm" }; // an anomaly's value, by check

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  for (const child of children) if (child) node.append(child);
  return node;
}

// A number, or the strings the protocol writes for non-finite floats ("nan", "inf", "-inf").
function metricValue(value) {
  if (typeof value === "number") return value;
  if (typeof value !== "string") return null;
  const text = value.trim().toLowerCase();
  if (text === "nan") return NaN;
  if (["inf", "+inf", "infinity", "+infinity"].includes(text)) return Infinity;
  if (["-inf", "-infinity"].includes(text)) return -Infinity;
  return null;
}

function stepOf(fields) {
  const step = fields.step;
  return typeof step === "number" && Number.isFinite(step) ? step : null;
}

// {name: [{step, value, anomaly}]} from what the events carry: fields named as in
// SERIES next to a "step", a "history" field ({name: [[step, value], ...]}), and
// each anomaly's own value (a loss spike's loss, a gradient norm rule's norm).
function metricSeries(events) {
  // Maps, not objects: a metric an agent names "constructor" or "__proto__" is a name
  const found = new Map();
  const add = (name, step, raw, anomaly = false) => {
    const value = metricValue(raw);
    if (step === null || value === null) return;
    if (!found.has(name)) found.set(name, new Map());
    const points = found.get(name);
    const before = points.get(step);
    points.set(step, { step, value, anomaly: anomaly || Boolean(before && before.anomaly) });
  };
  for (const event of events) {
    const fields = event.fields || {};
    const step = stepOf(fields);
    for (const [name, keys] of Object.entries(SERIES)) for (const key of keys) add(name, step, fields[key]);
    for (const [name, points] of Object.entries(historyOf(fields))) {
      if (!Array.isArray(points)) continue;
      for (const point of points) if (Array.isArray(point)) add(name, metricValue(point[0]), point[1]);
    }
    if (event.kind === "anomaly") addAnomaly(add, fields, step);
  }
  const series = Object.create(null);
  for (const [name, points] of found) series[name] = [...points.values()].sort((a, b) => a.step - b.step);
  return series;
}

function historyOf(fields) {
  const history = fields.history;
  return history && typeof history === "object" && !Array.isArray(history) ? history : {};
}

function addAnomaly(add, fields, step) {
  const name = fields.phase === "loss" ? "loss" : Object.hasOwn(ANOMALY_SERIES, fields.check) && ANOMALY_SERIES[fields.check];
  if (name) add(name, step, fields.value, true);
}

function anomalySteps(events) {
  return events.filter((e) => e.kind === "anomaly").map((e) => stepOf(e.fields || {})).filter((s) => s !== null);
}

// -- drawing -------------------------------------------------------------------

function linePlot(name, points, marks) {
  const finite = points.filter((p) => Number.isFinite(p.value));
  const x = scale(points.map((p) => p.step), PLOT.left, PLOT.width - PLOT.right);
  const y = scale(finite.map((p) => p.value), PLOT.height - PLOT.bottom, PLOT.top + 6);
  const plot = svg(
    "svg",
    { class: "plot", "data-series": name, viewBox: `0 0 ${PLOT.width} ${PLOT.height}`, role: "img", "aria-label": `${name} by step` },
    axes(points, finite),
    ...marks.map((step) => svg("line", { class: "anomaly-step", x1: x(step), x2: x(step), y1: PLOT.top, y2: PLOT.height - PLOT.bottom })),
    ...segments(points).map((run) => svg("polyline", { class: "line", points: run.map((p) => `${x(p.step)},${y(p.value)}`).join(" ") })),
    ...points.map((p) => marker(p, x, y)),
  );
  return plot;
}

// min..max onto the pixel range [from, to]; one value sits in the middle
function scale(values, from, to) {
  const lo = values.length ? Math.min(...values) : 0;
  const hi = values.length ? Math.max(...values) : 1;
  if (hi === lo) return () => (from + to) / 2;
  return (v) => from + ((v - lo) / (hi - lo)) * (to - from);
}

// runs of consecutive finite points: a non-finite one breaks the line
function segments(points) {
  const runs = [[]];
  for (const p of points) {
    if (Number.isFinite(p.value)) runs[runs.length - 1].push(p);
    else if (runs[runs.length - 1].length) runs.push([]);
  }
  return runs.filter((run) => run.length > 1);
}

function marker(p, x, y) {
  const label = `step ${p.step}: ${formatValue(p.value)}${p.anomaly ? " (anomaly)" : ""}`;
  const common = { "data-step": p.step, "data-value": formatValue(p.value) };
  if (Number.isFinite(p.value)) {
    const cls = p.anomaly ? "point anomaly" : "point";
    return svg("circle", { ...common, class: cls, cx: x(p.step), cy: y(p.value), r: 2.5 }, svg("title", {}, document.createTextNode(label)));
  }
  const top = p.value !== -Infinity;
  const cx = x(p.step);
  const cy = top ? PLOT.top : PLOT.height - PLOT.bottom;
  const tip = top ? `${cx - 5},${cy - 6} ${cx + 5},${cy - 6} ${cx},${cy + 3}` : `${cx - 5},${cy + 6} ${cx + 5},${cy + 6} ${cx},${cy - 3}`;
  return svg("polygon", { ...common, class: "point nonfinite", points: tip }, svg("title", {}, document.createTextNode(label)));
}

function formatValue(value) {
  if (Number.isNaN(value)) return "nan";
  if (value === Infinity) return "inf";
  if (value === -Infinity) return "-inf";
  return Math.abs(value) >= 1e4 || (value !== 0 && Math.abs(value) < 1e-3) ? value.toExponential(3) : String(+value.toPrecision(4));
}

function axes(points, finite) {
  const bottom = PLOT.height - PLOT.bottom;
  const text = (x, y, anchor, words) => svg("text", { x, y, "text-anchor": anchor }, document.createTextNode(words));
  const values = finite.map((p) => p.value);
  const group = svg(
    "g",
    { class: "axes" },
    svg("line", { x1: PLOT.left, x2: PLOT.left, y1: PLOT.top, y2: bottom }),
    svg("line", { x1: PLOT.left, x2: PLOT.width - PLOT.right, y1: bottom, y2: bottom }),
    text(PLOT.left, PLOT.height - 6, "start", `step ${points[0].step}`),
    text(PLOT.width - PLOT.right, PLOT.height - 6, "end", `${points[points.length - 1].step}`),
  );
  if (values.length) {
    group.append(text(PLOT.left - 4, PLOT.top + 10, "end", formatValue(Math.max(...values))));
    group.append(text(PLOT.left - 4, bottom, "end", formatValue(Math.min(...values))));
  }
  return group;
}

// The plots section for a session's events, or a line saying what is missing.
function plotsSection(events) {
  const series = metricSeries(events);
  const names = Object.keys(series);
  const marks = anomalySteps(events);
  const section = el("section", { class: "plots" }, el("h3", { text: "per-step history" }));
  if (!names.length) {
    section.append(el("p", { class: "muted", text: 'no per-step values in these events: send them with breakpod.emit("log", step=s, loss=..., grad_norm=...)' }));
    return section;
  }
  for (const name of names) {
    const points = series[name];
    const bad = points.filter((p) => !Number.isFinite(p.value)).length;
    const caption = `${name}: ${points.length} step(s)${bad ? `, ${bad} non-finite, marked on the top edge (nan, inf) or the bottom (-inf)` : ""}`;
    section.append(el("figure", {}, linePlot(name, points, marks), el("figcaption", { text: caption })));
  }
  return section;
}
