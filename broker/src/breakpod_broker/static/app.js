// breakpod dashboard: jobs and their ranks, live over the broker's SSE event stream.
// Plain JS, no dependencies. Everything from the API is put in the page as text
// (textContent, setAttribute): agents choose pod names, reasons and fields.
"use strict";

const CONFIG_PATH = "/v1/dashboard";
const LOGIN_PATH = "/v1/login"; // a token in, an HttpOnly cookie and a CSRF token out
const LOGOUT_PATH = "/v1/logout";
const CSRF_HEADER = "X-CSRF-Token";
const RELOAD_DEBOUNCE_MS = 250; // events in a burst cost one re-read of the sessions
const RETRY_MS = [1000, 2000, 5000, 10000];

const app = {
  csrf: null, // the login's CSRF token, in memory only (the cookie is HttpOnly)
  config: null,
  sessions: new Map(),
  selected: null,
  timeline: [],
  cursor: null, // the last event seen: the stream resumes after it
  reloadTimer: null,
  confirming: null, // {session, command} while an admin confirms a command
  renderQueued: false,
  abort: null,
};

const $ = (id) => document.getElementById(id);

// -- helpers ------------------------------------------------------------------

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") node.textContent = String(value);
    else if (key === "onclick") node.addEventListener("click", value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function age(seconds) {
  const s = Math.max(0, Math.floor(Date.now() / 1000 - seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d`;
}

function where(s) {
  return [s.pod, s.host && s.host !== s.pod ? s.host : null].filter(Boolean).join(" @ ") || "-";
}

class Unauthorized extends Error {}

async function api(path) {
  const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (response.status === 401 || response.status === 403) {
    throw new Unauthorized(`${response.status}: ${(await response.json()).detail}`);
  }
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

// A state-changing call: {ok, status, body}; the caller shows a refusal as it came.
async function post(path, body) {
  try {
    const response = await fetch(path, {
      method: "POST",
      headers: { [CSRF_HEADER]: app.csrf || "", "Content-Type": "application/json" },
      body: JSON.stringify(body),
      credentials: "same-origin",
      cache: "no-store",
    });
    const answer = await response.json().catch(() => ({}));
    return { ok: response.ok, status: response.status, body: answer };
  } catch (error) {
    return { ok: false, status: 0, body: { detail: `the broker did not answer (${error})` } };
  }
}

// -- login --------------------------------------------------------------------

function showLogin(message) {
  if (app.abort) app.abort.abort();
  app.csrf = null;
  app.sessions.clear();
  $("jobs").replaceChildren();
  $("main").hidden = true;
  $("logout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  setLive("off", "offline");
  $("token").focus();
}

// The token goes to the broker once and is forgotten: the cookie stands for it.
async function onLogin(event) {
  event.preventDefault();
  const token = $("token").value.trim();
  $("token").value = "";
  if (!token) return;
  const answer = await post(LOGIN_PATH, { token });
  if (!answer.ok) {
    showLogin(`token refused (${answer.status}: ${answer.body.detail || "no answer"})`);
    return;
  }
  start(answer.body.csrf);
}

async function logout() {
  await post(LOGOUT_PATH, {});
  showLogin("logged out");
}

// A reloaded page: the cookie may still hold a login; ask for its CSRF token.
async function resume() {
  try {
    const response = await fetch(LOGIN_PATH, { credentials: "same-origin", cache: "no-store" });
    if (response.ok) return start((await response.json()).csrf);
  } catch (error) {
    return showLogin(`the broker did not answer (${error})`);
  }
  showLogin();
}

async function start(csrf) {
  app.csrf = csrf;
  try {
    app.config = await api(CONFIG_PATH);
    await loadSessions();
  } catch (error) {
    showLogin(error instanceof Unauthorized ? `login refused (${error.message})` : String(error));
    return;
  }
  $("login").hidden = true;
  $("main").hidden = false;
  $("logout").hidden = false;
  setupFilters();
  render();
  document.documentElement.dataset.firstDataMs = String(Math.round(performance.now()));
  stream();
}

// -- data ---------------------------------------------------------------------

async function loadSessions() {
  // page through the listing: the broker sends at most 1000 sessions a page
  const found = new Map();
  let cursor = null;
  do {
    const query = cursor ? `?limit=1000&cursor=${encodeURIComponent(cursor)}` : "?limit=1000";
    const page = await api(app.config.paths.sessions + query);
    for (const s of page.sessions) found.set(s.id, s);
    cursor = page.next || null;
  } while (cursor);
  app.sessions = found;
}

function scheduleReload() {
  clearTimeout(app.reloadTimer);
  app.reloadTimer = setTimeout(async () => {
    try {
      await loadSessions();
      renderSoon();
    } catch (error) {
      if (error instanceof Unauthorized) showLogin(`login refused (${error.message})`);
    }
  }, RELOAD_DEBOUNCE_MS);
}

// An event moves its session's state at once (the protocol's table); the
// broker's full record follows in one debounced re-read.
function onEvent(event) {
  app.cursor = event.cursor || app.cursor;
  noteCommandEvent(event);
  const session = app.sessions.get(event.session);
  const next = app.config.state_of_kind[event.kind];
  if (session && next) {
    session.state = next;
    const reason = event.fields && (event.fields.reason || event.fields.why);
    if (reason) session.reason = String(reason);
    session.updated = event.received || session.updated;
  }
  if (app.selected === event.session) {
    app.timeline.push(event);
    if (app.config.listener_kinds.includes(event.kind)) refreshAttach(event.session);
    renderDetail();
  }
  if (!session || next) scheduleReload();
  renderSoon();
}

// -- the live stream (fetch: it resumes with a Last-Event-ID header) ------------

function setLive(value, text) {
  $("live").dataset.live = value;
  $("live").textContent = text;
}

async function stream() {
  let attempt = 0;
  const controller = new AbortController();
  app.abort = controller;
  while (!controller.signal.aborted) {
    try {
      const headers = { Accept: "text/event-stream" };
      if (app.cursor) headers["Last-Event-ID"] = app.cursor;
      const options = { headers, signal: controller.signal, credentials: "same-origin" };
      const response = await fetch(app.config.paths.stream, options);
      if (response.status === 401 || response.status === 403) {
        showLogin("the login has ended (the event stream refused it)");
        return;
      }
      if (!response.ok || !response.body) throw new Error(`HTTP ${response.status}`);
      if (attempt > 0) scheduleReload(); // what changed while the stream was down
      attempt = 0;
      setLive("on", "live");
      await readEvents(response.body, onEvent);
    } catch (error) {
      if (controller.signal.aborted) return;
    }
    setLive("retry", "reconnecting");
    await new Promise((done) => setTimeout(done, RETRY_MS[Math.min(attempt, RETRY_MS.length - 1)]));
    attempt += 1;
  }
}

// Server-Sent Events framing: blocks end with a blank line; "data:" lines join.
async function readEvents(body, handle) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue; // a comment (keepalive) or retry:
      try {
        handle(JSON.parse(data));
      } catch (error) {
        console.warn("breakpod: bad event skipped", error);
      }
    }
  }
}

// -- filters ------------------------------------------------------------------

function setupFilters() {
  const states = $("f-state");
  states.replaceChildren(el("option", { value: "", text: "all" }));
  for (const s of app.config.states) states.append(el("option", { value: s, text: s }));
  $("legend").replaceChildren(
    ...app.config.states.map((s) => el("span", { class: "chip", "data-state": s, text: s })),
  );
}

function filters() {
  return {
    namespace: $("f-namespace").value,
    job: $("f-job").value.trim().toLowerCase(),
    state: $("f-state").value,
  };
}

function syncNamespaces() {
  const select = $("f-namespace");
  const chosen = select.value;
  const names = [...new Set([...app.sessions.values()].map((s) => s.namespace || ""))].sort();
  select.replaceChildren(el("option", { value: "", text: "all" }));
  for (const n of names) if (n) select.append(el("option", { value: n, text: n }));
  select.value = names.includes(chosen) ? chosen : "";
}

// -- jobs view ----------------------------------------------------------------

function jobKey(s) {
  return JSON.stringify([s.namespace || "", s.job || s.id]);
}

function groupJobs() {
  const jobs = new Map();
  for (const s of app.sessions.values()) {
    const key = jobKey(s);
    if (!jobs.has(key)) jobs.set(key, { key, job: s.job || s.id, namespace: s.namespace || "", ranks: [] });
    jobs.get(key).ranks.push(s);
  }
  for (const job of jobs.values()) {
    job.ranks.sort((a, b) => (a.rank ?? 1e9) - (b.rank ?? 1e9) || a.id.localeCompare(b.id));
    job.urgency = Math.min(...job.ranks.map(urgency));
    job.updated = Math.max(...job.ranks.map((r) => r.updated || 0));
  }
  return [...jobs.values()].sort((a, b) => a.urgency - b.urgency || b.updated - a.updated);
}

// 0.. for the urgent states in the config's order, then everything else alike
function urgency(session) {
  const i = app.config.urgent.indexOf(session.state);
  return i >= 0 ? i : app.config.urgent.length;
}

function visibleJobs() {
  const f = filters();
  return groupJobs().filter(
    (job) =>
      (!f.namespace || job.namespace === f.namespace) &&
      (!f.job || job.job.toLowerCase().includes(f.job)) &&
      (!f.state || job.ranks.some((r) => r.state === f.state)),
  );
}

function renderSoon() {
  if (app.renderQueued) return;
  app.renderQueued = true;
  requestAnimationFrame(() => {
    app.renderQueued = false;
    render();
  });
}

function render() {
  if (!app.config) return;
  syncNamespaces();
  const jobs = visibleJobs();
  $("jobs").replaceChildren(
    ...(jobs.length ? jobs.map(jobCard) : [el("p", { class: "empty", text: "no jobs match" })]),
  );
  $("counts").textContent = countsText();
  if (app.selected) renderDetail();
}

function countsText() {
  const counts = {};
  for (const s of app.sessions.values()) counts[s.state] = (counts[s.state] || 0) + 1;
  return Object.entries(counts)
    .map(([state, n]) => `${n} ${state}`)
    .join(" · ");
}

function jobCard(job) {
  const worst = job.ranks.reduce((a, b) => (urgency(b) < urgency(a) ? b : a));
  const notable = job.ranks.filter((r) => app.config.urgent.includes(r.state) || r.reason);
  return el(
    "article",
    { class: "job", "data-job": job.job, "data-namespace": job.namespace, "data-state": worst.state },
    el(
      "h2",
      {},
      el("span", { class: "job-name", text: job.job }),
      job.namespace ? el("span", { class: "ns", text: job.namespace }) : null,
      el("span", { class: "meta", text: `${job.ranks.length} rank(s) · updated ${age(job.updated)} ago` }),
    ),
    el("div", { class: "grid" }, ...job.ranks.map(rankCell)),
    notable.length ? rankTable(notable) : null,
  );
}

function rankCell(s) {
  const label = s.rank ?? "·";
  const title = `rank ${s.rank ?? "?"} · ${s.state}${s.reason ? ` · ${s.reason}` : ""} · ${where(s)}`;
  return el("button", {
    type: "button",
    class: "rank",
    "data-session": s.id,
    "data-state": s.state,
    "aria-pressed": app.selected === s.id ? "true" : "false",
    title,
    text: label,
    onclick: () => select(s.id),
  });
}

function rankTable(ranks) {
  return el(
    "table",
    { class: "ranks" },
    el("tr", {}, ...["rank", "state", "reason", "pod / host", "age"].map((h) => el("th", { text: h }))),
    ...ranks.map((s) =>
      el(
        "tr",
        { "data-session": s.id, onclick: () => select(s.id) },
        el("td", { text: s.rank ?? "-" }),
        el("td", {}, el("span", { class: "chip", "data-state": s.state, text: s.state })),
        el("td", { class: "reason", text: s.reason || "" }),
        el("td", { text: where(s) }),
        el("td", { class: "age", "data-since": s.updated, text: age(s.updated) }),
      ),
    ),
  );
}

// -- one session --------------------------------------------------------------

async function select(id) {
  app.selected = id;
  app.timeline = [];
  app.attach = null;
  app.confirming = null;
  renderSoon();
  try {
    // the latest 1000: the plots want the history, the timeline shows the last 200
    const path = `${app.config.paths.events}?session=${encodeURIComponent(id)}&limit=1000`;
    const [page, attach] = await Promise.all([api(path), attachInfo(id)]);
    if (app.selected !== id) return;
    const read = new Set(page.events.map((e) => e.cursor));
    app.timeline = [...page.events, ...app.timeline.filter((e) => !read.has(e.cursor))]; // + what streamed in meanwhile
    app.attach = attach;
    renderDetail();
  } catch (error) {
    if (error instanceof Unauthorized) showLogin(`login refused (${error.message})`);
  }
}

async function refreshAttach(id) {
  try {
    const attach = await attachInfo(id);
    if (app.selected === id) app.attach = attach;
    renderSoon();
  } catch (error) {
    showLogin(`login refused (${error.message})`);
  }
}

async function attachInfo(id) {
  try {
    return await api(app.config.paths.attach.replace("{id}", encodeURIComponent(id)));
  } catch (error) {
    if (error instanceof Unauthorized) throw error;
    return null; // no listener yet: nothing to attach to
  }
}

function renderDetail() {
  const panel = $("detail");
  const s = app.sessions.get(app.selected);
  if (!s) {
    panel.hidden = true;
    return;
  }
  panel.hidden = false;
  const facts = [
    ["session", s.id], ["state", s.state], ["reason", s.reason], ["job", s.job],
    ["namespace", s.namespace], ["pod", s.pod], ["node", s.node], ["host", s.host],
    ["pid", s.pid], ["rank", s.rank !== undefined && s.rank !== null ? `${s.rank} / ${s.world_size ?? "?"}` : null],
    ["runtime", s.runtime], ["listener", s.listener], ["address", s.address],
    ["created", `${age(s.created)} ago`], ["last seen", `${age(s.last_seen)} ago`],
  ].filter(([, v]) => v !== null && v !== undefined && v !== "");
  const open = openFolds(panel);
  const parts = [
    el("h2", {}, el("span", { text: s.job || s.id }), el("button", { type: "button", class: "close", text: "×", onclick: () => { app.selected = null; panel.hidden = true; renderSoon(); } })),
    el("dl", { class: "facts" }, ...facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })])),
    actionsSection(s),
    anomalySection(app.timeline),
    stallSection(app.timeline),
    flightSection(app.timeline),
    plotsSection(app.timeline),
    attachBlock(app.attach),
    el("h3", { text: "timeline" }),
    el("ol", { class: "timeline" }, ...app.timeline.slice(-200).reverse().map(eventItem)),
  ];
  panel.replaceChildren(...parts.filter(Boolean)); // (replaceChildren would write a null as "null")
  reopenFolds(panel, open);
}

// A live re-render keeps the folds the reader opened (stacks, long fields) open.
function openFolds(panel) {
  return new Set([...panel.querySelectorAll("details[open] > summary")].map(foldKey));
}

function reopenFolds(panel, open) {
  for (const summary of panel.querySelectorAll("details > summary")) {
    if (open.has(foldKey(summary))) summary.parentElement.open = true;
  }
}

function foldKey(summary) {
  const section = summary.closest("section, li");
  return `${section ? section.className : ""}/${summary.textContent}`;
}

function copyable(label, text) {
  const button = el("button", { type: "button", class: "copy", text: "copy" });
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

function attachBlock(info) {
  if (!info) return el("p", { class: "muted", text: "no listener yet: nothing to attach to" });
  return el(
    "section",
    { class: "attach" },
    el("h3", { text: "attach" }),
    info.port_forward ? copyable("1. forward the port", info.port_forward) : null,
    copyable(info.port_forward ? "2. attach" : "attach", info.attach_command),
    copyable("or directly", info.direct_command),
    info.vscode_launch ? copyable("VS Code launch.json", JSON.stringify(info.vscode_launch, null, 2)) : null,
  );
}

// the first few fields of an event in one line; long text (stack dumps) folded
function eventItem(event) {
  const fields = event.fields || {};
  const long = Object.entries(fields).filter(([, v]) => typeof v === "string" && v.includes("\n"));
  const short = Object.entries(fields).filter(([k]) => !long.some(([l]) => l === k));
  const summary = short
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`)
    .join("  ");
  return el(
    "li",
    { "data-kind": event.kind },
    el("time", { text: new Date(event.time * 1000).toLocaleTimeString() }),
    el("span", { class: "chip", "data-kind": event.kind, text: event.kind }),
    el("span", { class: "fields", text: summary }),
    ...long.map(([k, v]) => el("details", {}, el("summary", { text: k }), el("pre", { text: v }))),
  );
}

// -- ages tick without touching the network ---------------------------------------

function tickAges() {
  for (const cell of document.querySelectorAll("td.age[data-since]")) {
    cell.textContent = age(Number(cell.dataset.since));
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", onLogin);
  $("logout").addEventListener("click", logout);
  for (const id of ["f-namespace", "f-state"]) $(id).addEventListener("change", render);
  $("f-job").addEventListener("input", render);
  setInterval(tickAges, 1000);
  resume();
});
