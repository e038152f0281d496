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

const hasFlight = (e) => e.fields && e.fields.flight && typeof e.fields.flight === "object";

// The newest dump any event carried (anomaly, stall, or a dump-flight answer).
function flightSection(events) {
  const event = latest(events, null, hasFlight);
  if (!event) return null;
  return el("section", { class: "flight" }, el("h3", { text: "flight recorder" }), ...flightBody(event));
}

// A dump's summary line and its table of first bad steps (``mark``: see flightTable).
function flightBody(event, mark = false) {
  const f = event.fields.flight;
  const steps = Array.isArray(f.steps) && f.steps.length === 2 ? `steps ${shown(f.steps[0])}-${shown(f.steps[1])}` : "no step yet";
  const head = f.unavailable ? shown(f.unavailable) : `${steps} (${shown(f.kept)} kept), ${shown(f.watched)} watched tensors; from its ${event.kind} event`;
  const rows = firstBad(event);
  return [
    el("p", { class: "summary", text: head }),
    rows.length ? flightTable(rows, f.more, mark) : f.unavailable ? null : el("p", { text: "every watched tensor stayed finite and in range" }),
  ];
}

function firstBad(event) {
  const rows = event && event.fields.flight.first_bad;
  return Array.isArray(rows) ? rows : [];
}

// ``mark``: the first row (this rank's first bad step) is marked, and named the job's
// earliest when no rank went bad sooner (mark is then that step).
function flightTable(rows, more, mark = false) {
  const trend = (values) => (Array.isArray(values) ? values.map((v) => (typeof v === "number" ? v.toPrecision(3) : shown(v))).join(" ") : "");
  const marked = (r, i) => (mark === false || i > 0 ? {} : { class: "first-bad", "data-earliest": r.step === mark ? "true" : "false", title: r.step === mark ? "the job's earliest first bad step" : "this rank's first bad step" });
  return el(
    "table",
    { class: "flight-first-bad" },
    el("caption", { text: more ? `first bad step per module, earliest first (${more} more not shown)` : "first bad step per module, earliest first" }),
    el("tr", {}, ...["module", "phase", "step", "why", "rms (loss) up to it"].map((h) => el("th", { text: h }))),
    ...rows.map((r, i) =>
      el("tr", marked(r, i), ...[shown(r.module) || "<model>", shown(r.phase), shown(r.step), shown(r.why), trend(r.rms)].map((t) => el("td", { text: t }))),
    ),
  );
}

// -- the flight tables of every rank, side by side (stacked on a narrow screen) -----

const FLIGHT_RANKS = 32; // ranks read at most, lowest first: one events read each
const jobFlights = new Map(); // job key -> {loading: true} | {ranks: [{session, event, error}], at}

function flightsControl(job) {
  if (job.ranks.length < 2) return null;
  const got = jobFlights.get(job.key);
  return el(
    "div",
    { class: "flights-control" },
    el("button", {
      type: "button",
      class: "load-flights",
      "data-focus": `flights:${job.key}`,
      disabled: got && got.loading ? "disabled" : null,
      title: "each rank's newest flight recorder dump (an anomaly's, a stall's or a dump-flight answer)",
      text: got && got.loading ? "reading flight tables..." : got ? "read the flight tables again" : "flight tables of every rank",
      onclick: () => loadFlights(job),
    }),
    got && got.ranks ? el("button", { type: "button", class: "hide-flights", text: "hide", onclick: () => { jobFlights.delete(job.key); render(); } }) : null,
  );
}

async function loadFlights(job) {
  jobFlights.set(job.key, { loading: true });
  render();
  const ranks = [...job.ranks].sort((a, b) => (a.rank ?? 0) - (b.rank ?? 0)).slice(0, FLIGHT_RANKS);
  const read = await Promise.all(
    ranks.map(async (s) => {
      try {
        const page = await api(`${app.config.paths.events}?session=${encodeURIComponent(s.id)}&limit=1000`);
        return { session: s, event: latest(page.events || [], null, hasFlight) };
      } catch (e) {
        return { session: s, error: String((e && e.message) || e) };
      }
    }),
  );
  jobFlights.set(job.key, { ranks: read, more: job.ranks.length - ranks.length, at: Date.now() });
  render();
}

function flightsSection(job) {
  const got = jobFlights.get(job.key);
  if (!got || !got.ranks) return null;
  const starts = got.ranks.map((r) => firstBad(r.event)[0]).filter((row) => row && typeof row.step === "number");
  const earliest = starts.length ? Math.min(...starts.map((row) => row.step)) : null;
  return el(
    "section",
    { class: "flights", "aria-label": `flight tables of every rank of ${job.job}` },
    ...got.ranks.map((r) => rankFlight(r, earliest)),
    got.more > 0 ? el("p", { class: "muted", text: `${got.more} more rank(s) not read: breakpod flight ${job.job} prints every rank` }) : null,
  );
}

function rankFlight(r, earliest) {
  const s = r.session;
  const body = r.error ? [el("p", { class: "summary", text: `could not read its events: ${r.error}` })] : r.event ? flightBody(r.event, earliest) : [el("p", { class: "summary", text: "no flight recorder dump: none of its events carried one" })];
  return el("div", { class: "flight-rank", "data-session": s.id }, el("h3", { text: `${rankName(s)} · ${s.state}` }), ...body);
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

// The commands that make sense in each state (a parked rank is not broken again; a
// running one has nothing to resume); a session that ended or is lost takes none.
const COMMANDS_FOR = {
  running: ["break", "dump-stacks", "dump-flight"],
  stalled: ["dump-stacks", "dump-flight", "break"],
  waiting: ["dump-stacks", "dump-flight", "resume"],
  parked: ["resume", "dump-stacks", "dump-flight"],
  attached: ["resume", "dump-stacks", "dump-flight"],
};

function commandsFor(state) {
  const fitting = COMMANDS_FOR[state];
  if (!fitting) return app.config.final_states.includes(state) || state === "lost" ? [] : app.config.commands;
  return fitting.filter((name) => app.config.commands.includes(name));
}

// Buttons, but no more for a session that ended; the acknowledgements stay.
function actionsSection(session) {
  if (!app.config || app.config.role !== "admin") return null;
  const mine = [...sent.entries()].filter(([, c]) => c.session === session.id);
  const names = commandsFor(session.state);
  const why = session.state === "lost" ? "lost: nothing answers commands" : `${session.state}: it takes no more commands`;
  return el(
    "section",
    { class: "actions" },
    el("h3", { text: "commands (admin)" }),
    names.length ? el("div", { class: "buttons" }, ...names.map((name) => actionButton(session, name))) : el("p", { class: "muted", text: why }),
    names.length && app.confirming && app.confirming.session === session.id ? confirmation(session, app.confirming.command) : null,
    ...mine.reverse().map(([id, c]) => ackLine(id, c)),
  );
}

function actionButton(session, name) {
  return el("button", {
    type: "button",
    class: "action",
    "data-command": name,
    "data-focus": `action:${session.id}:${name}`,
    title: ACTION_HELP[name] || name,
    text: name,
    onclick: () => {
      app.confirming = { session: session.id, command: name };
      renderDetail();
      focusFirst("#detail .confirm .yes");
    },
  });
}

function focusFirst(selector) {
  const node = document.querySelector(selector);
  if (node) node.focus();
}

function confirmation(session, name) {
  const who = session.rank !== null && session.rank !== undefined ? `rank ${session.rank} of ${session.job || session.id}` : session.id;
  return el(
    "div",
    { class: "confirm", role: "alertdialog", "aria-label": `confirm ${name}`, "data-command": name },
    el("span", { text: `send ${name} to ${who}? ${ACTION_HELP[name] || ""}` }),
    el("button", { type: "button", class: "yes", "data-focus": `yes:${session.id}`, text: `send ${name}`, onclick: () => sendCommand(session.id, name) }),
    el("button", { type: "button", class: "no", text: "cancel", onclick: () => { app.confirming = null; renderDetail(); } }),
  );
}

// -- job-wide commands: one command for every rank of the job ----------------------

const JOB_HELP = {
  break: "park every rank at its next step boundary",
  resume: "let every parked or waiting rank go on",
  "dump-stacks": "every rank sends every thread's stack back",
  "dump-flight": "every rank sends its flight recorder back",
};
const jobSent = new Map(); // job key -> [command, state, detail]

function jobActions(job) {
  if (!app.config || app.config.role !== "admin" || !job.named) return null;
  const live = job.ranks.filter((r) => !app.config.final_states.includes(r.state) && r.state !== "lost");
  if (!live.length) return null;
  const states = new Set(live.map((r) => r.state));
  const names = app.config.commands.filter((name) => (name === "break" ? states.has("running") || states.has("stalled") : name === "resume" ? states.has("parked") || states.has("attached") || states.has("waiting") : true));
  const asked = app.confirming && app.confirming.job === job.key ? app.confirming.command : null;
  const said = jobSent.get(job.key);
  return el(
    "div",
    { class: "job-actions", role: "group", "aria-label": `commands for every rank of ${job.job}` },
    el("span", { class: "muted", text: "every rank:" }),
    ...names.map((name) =>
      el("button", {
        type: "button",
        class: "job-action",
        "data-command": name,
        "data-focus": `job:${job.key}:${name}`,
        title: JOB_HELP[name] || name,
        text: name,
        onclick: () => {
          app.confirming = { job: job.key, command: name };
          render();
          focusFirst(`article.job[data-key='${CSS.escape(job.key)}'] .confirm .yes`);
        },
      }),
    ),
    asked
      ? el(
          "span",
          { class: "confirm", role: "alertdialog", "aria-label": `confirm ${asked} for every rank`, "data-command": asked },
          el("span", { text: `send ${asked} to all ${live.length} live rank(s) of ${job.job}? ${JOB_HELP[asked] || ""}` }),
          el("button", { type: "button", class: "yes", "data-focus": `jobyes:${job.key}`, text: `send ${asked}`, onclick: () => sendJobCommand(job, asked) }),
          el("button", { type: "button", class: "no", text: "cancel", onclick: () => { app.confirming = null; render(); } }),
        )
      : null,
    said ? el("span", { class: "ack", "data-state": said[1], text: `${said[0]}: ${said[1]}${said[2] ? ` (${said[2]})` : ""}` }) : null,
  );
}

async function sendJobCommand(job, name) {
  app.confirming = null;
  jobSent.set(job.key, [name, "sending", null]);
  render();
  const path = app.config.paths.job_commands.replace("{job}", encodeURIComponent(job.job));
  const body = { command: name, reason: "from the dashboard", namespace: job.namespace || null };
  const response = await post(path, body);
  jobSent.set(job.key, response.ok ? [name, "queued for every rank", null] : [name, "refused", `${response.status}: ${response.body.detail || "no reason given"}`]);
  render();
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

// -- the panel: redrawn part by part, each only when its own data changed ---------------

// The panel's parts in order: [name, signature(session), build(session)]. A part whose
// signature is unchanged keeps its nodes (a selection in the attach command, an open
// fold, the focused button all stay); a new session draws them all.
const PANEL_PARTS = [
  ["head", (s) => [s.id, s.job], headPart],
  ["incident", (s) => [s.state, s.reason, s.culprit, s.hold_until, s.attached_by, s.since, s.state === "lost" ? s.last_seen : 0], incidentPart],
  ["facts", (s) => [s.id, s.state, s.reason, s.job, s.namespace, s.pod, s.node, s.host, s.pid, s.rank, s.world_size, s.runtime, s.listener, s.address, s.created], factsPart],
  ["actions", (s) => [s.state, app.config.role, app.confirming, [...sent.entries()].filter(([, c]) => c.session === s.id)], actionsSection],
  ["anomaly", () => eventsSeen("anomaly"), () => anomalySection(app.timeline)],
  ["stall", () => eventsSeen("stall"), () => stallSection(app.timeline)],
  ["flight", () => eventsSeen(null), () => flightSection(app.timeline)],
  ["plots", () => eventsSeen(null), () => plotsSection(app.timeline)],
  ["attach", (s) => [s.state, app.attach, s.attached_by], attachPart],
  ["timeline", () => [app.timeline.length ? app.timeline[0].cursor : null], timelinePart],
];
const panel = { session: null, parts: new Map() }; // name -> {sig, node}

// A signature of the events a part reads: their count and the newest one's cursor.
function eventsSeen(kind) {
  const events = kind ? app.timeline.filter((e) => e.kind === kind) : app.timeline;
  return [events.length, events.length ? events[events.length - 1].cursor : null];
}

function renderDetail() {
  const aside = $("detail");
  const s = app.sessions.get(app.selected);
  if (!s) {
    aside.hidden = true;
    panel.session = null;
    return;
  }
  aside.hidden = false;
  if (panel.session !== s.id) {
    panel.session = s.id;
    panel.parts.clear();
    aside.replaceChildren();
  }
  let drawn = false;
  let previous = null;
  for (const [name, signature, build] of PANEL_PARTS) {
    const sig = JSON.stringify(signature(s));
    let part = panel.parts.get(name);
    if (!part || part.sig !== sig) {
      const node = build(s) || el("div", { hidden: "", "data-part": name });
      node.dataset.part = name;
      if (part) {
        keepFolds(part.node, node);
        part.node.replaceWith(node);
      }
      part = { sig, node };
      panel.parts.set(name, part);
      drawn = true;
    }
    if (name === "timeline") appendEvents(part.node);
    if (part.node.parentNode !== aside || part.node.previousSibling !== previous) aside.insertBefore(part.node, previous ? previous.nextSibling : aside.firstChild);
    previous = part.node;
  }
  if (drawn) app.stats.panel += 1;
}

// A redrawn part keeps the folds the reader opened (stacks, long fields) open.
function keepFolds(before, after) {
  const open = new Set([...before.querySelectorAll("details[open] > summary")].map((n) => n.textContent));
  for (const summary of after.querySelectorAll("details > summary")) if (open.has(summary.textContent)) summary.parentElement.open = true;
}

function headPart(s) {
  return el(
    "h2",
    {},
    el("span", { tabindex: "-1", text: s.job ? `${s.job} · ${rankName(s)}` : s.id }),
    el("button", { type: "button", class: "close", "aria-label": "close (Escape)", title: "close (Escape)", text: "×", onclick: () => closePanel() }),
  );
}

function incidentPart(s) {
  const parts = incident(s);
  return el("p", { class: "incident", "data-state": s.state }, el("span", { class: "chip", "data-state": s.state, text: s.state }), " ", ...(parts.length ? parts : ["nothing to report"]));
}

function factsPart(s) {
  const facts = [
    ["session", s.id], ["reason", s.reason], ["job", s.job], ["namespace", s.namespace],
    ["pod", s.pod], ["node", s.node], ["host", s.host], ["pid", s.pid],
    ["rank", s.rank !== undefined && s.rank !== null ? `${s.rank} / ${s.world_size ?? "?"}` : null],
    ["runtime", s.runtime], ["listener", s.listener], ["address", s.address],
  ].filter(([, v]) => v !== null && v !== undefined && v !== "");
  return el(
    "dl",
    { class: "facts" },
    ...facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { "data-fact": k, text: v })]),
    el("dt", { text: "created" }), el("dd", {}, since(s.created), " ago"),
    el("dt", { text: "last heartbeat" }), el("dd", { "data-fact": "last heartbeat" }, beatAge(s), " ago"),
  );
}

function copyable(label, text) {
  const button = el("button", { type: "button", class: "copy", text: "copy", "aria-label": `copy: ${label}` });
  button.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(text);
      button.textContent = "copied";
    } catch {
      button.textContent = "select and copy";
    }
  });
  return el("div", { class: "command" }, el("span", { class: "label", text: label }), el("pre", { text }), button);
}

// The commands that work for this runtime, and what they need. Hidden where nothing
// listens: an ended or lost session, or one with no listener yet.
function attachPart(s) {
  if (app.config.final_states.includes(s.state) || s.state === "lost") return null;
  const info = app.attach;
  if (!info) return el("p", { class: "muted attach-none", text: "no listener yet: nothing to attach to" });
  const kube = info.runtime === "kubernetes";
  const env = `export BREAKPOD_BROKER_URL=${location.origin}\nexport BREAKPOD_BROKER_TOKEN=<your viewer or admin token>`;
  const busy = s.state === "attached" ? el("p", { class: "muted", text: `a debugger is attached${s.attached_by ? ` (${s.attached_by})` : ""}: the listener takes one client at a time` }) : null;
  return el(
    "section",
    { class: "attach", "data-runtime": info.runtime },
    el("h3", { text: "attach" }),
    busy,
    copyable("1. once, in your shell: the broker and a token (the CLI finds the session through them)", env),
    copyable(kube ? "2. attach (it runs kubectl port-forward itself)" : "2. attach", info.attach_command),
    kube && info.port_forward
      ? copyable("or, with kubectl and no broker: forward the port (leave it running), then attach", `${info.port_forward}\n${info.direct_command}`)
      : copyable(info.runtime === "local" ? "or, on the same machine, without the broker" : "or, on the host, through its published port", info.direct_command),
    info.vscode_launch ? copyable("VS Code launch.json", JSON.stringify(info.vscode_launch, null, 2)) : null,
  );
}

// The timeline: newest first, log lines folded away unless asked for (they bury
// the events that matter); new events are added at the top, nothing is redrawn.
function timelinePart() {
  const box = el("input", { type: "checkbox", class: "show-logs" });
  box.addEventListener("change", () => part.classList.toggle("with-logs", box.checked));
  const part = el(
    "section",
    { class: "timeline-part" },
    el("h3", {}, "timeline ", el("label", { class: "muted" }, box, " log lines")),
    el("ol", { class: "timeline" }),
  );
  part.dataset.shown = "0";
  return part;
}

function appendEvents(part) {
  const list = part.querySelector("ol.timeline");
  const shown = Number(part.dataset.shown || 0);
  if (!list || app.timeline.length <= shown) return;
  const fresh = app.timeline.slice(Math.max(shown, app.timeline.length - 200));
  for (const event of fresh) list.prepend(eventItem(event));
  while (list.children.length > 200) list.lastChild.remove();
  part.dataset.shown = String(app.timeline.length);
}

// the first few fields of an event in one line; long text (stack dumps) folded
function eventItem(event) {
  const fields = event.fields || {};
  const long = Object.entries(fields).filter(([, v]) => typeof v === "string" && v.includes("\n"));
  const short = Object.entries(fields).filter(([k]) => !long.some(([l]) => l === k));
  const summary = short
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`)
    .join("  ");
  const at = new Date(event.time * 1000);
  return el(
    "li",
    { "data-kind": event.kind },
    el("time", { datetime: at.toISOString(), title: at.toISOString(), text: at.toLocaleString(undefined, { dateStyle: "short", timeStyle: "medium" }) }),
    el("span", { class: "chip", "data-kind": event.kind, text: event.kind }),
    el("span", { class: "fields", text: summary }),
    ...long.map(([k, v]) => el("details", {}, el("summary", { text: k }), el("pre", { text: v }))),
  );
}
