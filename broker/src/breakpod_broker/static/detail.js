// breakpod dashboard: the parts of a session's view that read its events: the
// anomaly (rule, module, step, tensor summary), the stall report (culprit rank,
// per-rank lines, stacks folded), the flight recorder's first bad step per
// module (from the latest event that carried a dump) and, for admin tokens, the command buttons with
// each command's acknowledgement as it arrives. Agent text goes in as text only.
"use strict";

// The buttons are the config's "commands", in its order; what each one does:
const ACTION_HELP = {
  break: "park this rank at its next step boundary (its job too, in debug mode)",
  resume: "stop waiting for a debugger (or hang up on it); the program continues",
  "dump-stacks": "send every thread's stack back",
  "dump-flight": "send the flight recorder's last steps back (shown below)",
};

// The newest event of ``kind`` (any kind when null) that passes ``test``.
function latest(events, kind, test = () => true) {
  for (let i = events.length - 1; i >= 0; i -= 1) if ((kind === null || events[i].kind === kind) && test(events[i])) return events[i];
  return null;
}

function shown(value) {
  if (value === null || value === undefined) return "";
  return typeof value === "object" ? JSON.stringify(value) : String(value);
}

function factList(pairs, cls = "facts") {
  const kept = pairs.filter(([, v]) => v !== null && v !== undefined && v !== "");
  return el("dl", { class: cls }, ...kept.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { "data-fact": k, text: shown(v) })]));
}

function folded(summary, text, open = false) {
  return el("details", open ? { open: "" } : {}, el("summary", { text: summary }), el("pre", { text: shown(text) }));
}

// -- anomaly -------------------------------------------------------------------

function anomalySection(events) {
  const event = latest(events, "anomaly");
  if (!event) return null;
  const f = event.fields || {};
  const rules = [f.rule, ...(Array.isArray(f.also) ? f.also : [])].filter(Boolean).map(shown).join(", ");
  const count = events.filter((e) => e.kind === "anomaly").length;
  return el(
    "section",
    { class: "anomaly" },
    el("h3", { text: count > 1 ? `anomaly (latest of ${count})` : "anomaly" }),
    el("p", { class: "summary", text: shown(f.summary) || "(no summary)" }),
    factList([
      ["rule", rules], ["check", f.check], ["module", f.module === "" ? "<model>" : f.module],
      ["step", f.step], ["phase", f.phase], ["value", f.value],
      ["update", f.skipped ? "skipped (this step's update was dropped)" : null],
      ["held", f.held ? "a debugger park held the job" : null],
    ]),
    detailsTable(f.details),
    nonfiniteByModule(events),
  );
}

// the rule's details ({"nan": 3, "inf": 1}, {"param": "fc.weight"}, ...) as rows
function detailsTable(details) {
  if (!details || typeof details !== "object" || !Object.keys(details).length) return null;
  return el(
    "table",
    { class: "details" },
    ...Object.entries(details).map(([k, v]) => el("tr", {}, el("th", { text: k }), el("td", { text: shown(v) }))),
  );
}

// Non-finite counts of every anomaly that carries them, summed per module.
const NONFINITE_KINDS = ["nan", "+inf", "-inf", "inf"];
function nonfiniteByModule(events) {
  const rows = new Map();
  for (const e of events) {
    const f = e.fields || {};
    if (e.kind !== "anomaly" || !f.details || typeof f.details !== "object") continue;
    // exact counts ({"nan": 3, "+inf": 0, "-inf": 1}), or "yes" when the tensor was not kept
    const counts = Object.entries(f.details).filter(([k]) => NONFINITE_KINDS.includes(k));
    if (!counts.length) continue;
    const module = shown(f.module) || "<model>";
    const row = rows.get(module) || { steps: new Set(), counts: {} };
    row.steps.add(f.step);
    for (const [k, v] of counts) row.counts[k] = typeof v === "number" ? (Number(row.counts[k]) || 0) + v : row.counts[k] ?? shown(v);
    rows.set(module, row);
  }
  if (!rows.size) return null;
  return el(
    "table",
    { class: "nonfinite-modules" },
    el("caption", { text: "non-finite values by module" }),
    el("tr", {}, ...["module", "steps", "counts"].map((h) => el("th", { text: h }))),
    ...[...rows].map(([module, row]) =>
      el("tr", {}, el("td", { text: module }), el("td", { text: [...row.steps].join(", ") }), el("td", { text: Object.entries(row.counts).filter(([, v]) => v !== 0).map(([k, v]) => `${k}=${v}`).join(" ") || "none" })),
    ),
  );
}

// -- flight recorder -----------------------------------------------------------

// The newest dump any event carried (anomaly, stall, or a dump-flight answer).
function flightSection(events) {
  const event = latest(events, null, (e) => e.fields && e.fields.flight && typeof e.fields.flight === "object");
  if (!event) return null;
  const f = event.fields.flight;
  const steps = Array.isArray(f.steps) && f.steps.length === 2 ? `steps ${shown(f.steps[0])}-${shown(f.steps[1])}` : "no step yet";
  const head = f.unavailable ? shown(f.unavailable) : `${steps} (${shown(f.kept)} kept), ${shown(f.watched)} watched tensors; from its ${event.kind} event`;
  const rows = Array.isArray(f.first_bad) ? f.first_bad : [];
  return el(
    "section",
    { class: "flight" },
    el("h3", { text: "flight recorder" }),
    el("p", { class: "summary", text: head }),
    rows.length ? flightTable(rows, f.more) : f.unavailable ? null : el("p", { text: "every watched tensor stayed finite and in range" }),
  );
}

function flightTable(rows, more) {
  const trend = (values) => (Array.isArray(values) ? values.map((v) => (typeof v === "number" ? v.toPrecision(3) : shown(v))).join(" ") : "");
  return el(
    "table",
    { class: "flight-first-bad" },
    el("caption", { text: more ? `first bad step per module, earliest first (${more} more not shown)` : "first bad step per module, earliest first" }),
    el("tr", {}, ...["module", "phase", "step", "why", "rms (loss) up to it"].map((h) => el("th", { text: h }))),
    ...rows.map((r) =>
      el("tr", {}, ...[shown(r.module) || "<model>", shown(r.phase), shown(r.step), shown(r.why), trend(r.rms)].map((t) => el("td", { text: t }))),
    ),
  );
}

// -- stall ---------------------------------------------------------------------

// The job-wide report (rank 0 sends it) when there is one, else this rank's own.
function stallSection(events) {
  const event = latest(events, "stall");
  if (!event) return null;
  const f = event.fields || {};
  const job = f.scope === "job" && Array.isArray(f.ranks);
  return el(
    "section",
    { class: "stall", "data-scope": job ? "job" : "rank" },
    el("h3", { text: job ? "stall: the job's report" : "stall" }),
    job ? jobStall(f) : rankStall(f),
  );
}

function culpritsOf(f) {
  return (Array.isArray(f.culprits) ? f.culprits : []).map(String);
}

function jobStall(f) {
  const culprits = culpritsOf(f);
  const stacks = f.culprit_stacks && typeof f.culprit_stacks === "object" ? f.culprit_stacks : {};
  return el(
    "div",
    {},
    el("p", { class: "culprit", text: culprits.length ? `culprit rank ${culprits.join(", ")} · no progress for ${shown(f.seconds)}s` : `no culprit named · no progress for ${shown(f.seconds)}s` }),
    rankLines(f.ranks, culprits),
    ...Object.entries(stacks).map(([rank, text]) => folded(`stacks of rank ${rank}`, text || "(none sent)")),
    f.report ? folded("the report as printed", f.report) : null,
  );
}

function rankLines(ranks, culprits) {
  const columns = ["rank", "state", "step", "op", "entered", "completed", "silent", "frame"];
  const sorted = [...ranks].filter((r) => r && typeof r === "object").sort((a, b) => Number(a.rank) - Number(b.rank));
  return el(
    "table",
    { class: "stall-ranks" },
    el("tr", {}, ...columns.map((c) => el("th", { text: c }))),
    ...sorted.map((r) =>
      el(
        "tr",
        { "data-rank": shown(r.rank), class: culprits.includes(String(r.rank)) ? "culprit" : null },
        ...columns.map((c) => el("td", { text: c === "silent" && r[c] !== undefined ? `${shown(r[c])}s` : shown(r[c]) })),
      ),
    ),
  );
}

function rankStall(f) {
  return el(
    "div",
    {},
    factList([["rank", f.rank], ["no heartbeat for", f.seconds !== undefined ? `${shown(f.seconds)}s` : null], ["step", f.step], ["state", f.state], ["frame", f.frame]]),
    f.stacks ? folded("stacks", f.stacks) : null,
  );
}

// -- admin actions -------------------------------------------------------------

// Commands this tab sent: id -> {command, states: [[state, detail]]}; the broker's
// "command" events (queued, delivered, done / failed) fill the states in live.
const sent = new Map();

function noteCommandEvent(event) {
  const f = event.fields || {};
  const entry = sent.get(f.command_id);
  if (event.kind !== "command" || !entry) return;
  if (!entry.states.some(([state]) => state === f.state)) entry.states.push([shown(f.state), f.detail]);
}

// A finished session takes no more commands: no buttons, but the acknowledgements stay.
function actionsSection(session) {
  if (!app.config || app.config.role !== "admin") return null;
  const mine = [...sent.entries()].filter(([, c]) => c.session === session.id);
  const open = session.state !== "finished";
  return el(
    "section",
    { class: "actions" },
    el("h3", { text: "commands (admin)" }),
    open ? el("div", { class: "buttons" }, ...app.config.commands.map((name) => actionButton(session, name))) : el("p", { class: "muted", text: "finished: it takes no more commands" }),
    open && app.confirming && app.confirming.session === session.id ? confirmation(session, app.confirming.command) : null,
    ...mine.reverse().map(([id, c]) => ackLine(id, c)),
  );
}

function actionButton(session, name) {
  return el("button", {
    type: "button",
    class: "action",
    "data-command": name,
    title: ACTION_HELP[name] || name,
    text: name,
    onclick: () => {
      app.confirming = { session: session.id, command: name };
      renderDetail();
    },
  });
}

function confirmation(session, name) {
  const who = session.rank !== null && session.rank !== undefined ? `rank ${session.rank} of ${session.job || session.id}` : session.id;
  return el(
    "div",
    { class: "confirm", role: "alertdialog", "data-command": name },
    el("span", { text: `send ${name} to ${who}? ${ACTION_HELP[name] || ""}` }),
    el("button", { type: "button", class: "yes", text: `send ${name}`, onclick: () => sendCommand(session.id, name) }),
    el("button", { type: "button", class: "no", text: "cancel", onclick: () => { app.confirming = null; renderDetail(); } }),
  );
}

async function sendCommand(id, name) {
  app.confirming = null;
  const path = app.config.paths.commands.replace("{id}", encodeURIComponent(id));
  const key = `local-${Date.now()}`;
  sent.set(key, { session: id, command: name, states: [["sending", null]] });
  renderDetail();
  const response = await post(path, { command: name, reason: "from the dashboard" });
  const entry = sent.get(key);
  sent.delete(key);
  if (response.ok) {
    entry.states = [["queued", null]];
    sent.set(response.body.id, entry);
    // events that arrived before the answer did
    for (const event of app.timeline) noteCommandEvent(event);
  } else {
    entry.states = [["refused", `${response.status}: ${response.body.detail || "no reason given"}`]];
    sent.set(key, entry);
  }
  renderDetail();
}

function ackLine(id, c) {
  const last = c.states[c.states.length - 1];
  const detail = c.states.map(([, d]) => d).filter((d) => d !== null && d !== undefined && d !== "").pop();
  const long = typeof detail === "string" && detail.includes("\n");
  return el(
    "div",
    { class: "ack", "data-command-id": id, "data-command": c.command, "data-state": last[0] },
    el("span", { class: "chip", "data-kind": "command", text: c.command }),
    el("span", { class: "states", text: c.states.map(([s]) => s).join(" → ") }),
    detail && !long ? el("span", { class: "ack-detail", text: shown(detail) }) : null,
    long ? folded("detail", detail) : null,
  );
}
