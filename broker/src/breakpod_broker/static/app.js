// breakpod dashboard: jobs and their ranks, live over the broker's SSE event stream.
// Plain JS, no dependencies. Everything from the API is put in the page as text
// (textContent, setAttribute): agents choose pod names, reasons and fields.
//
// The page stays put while data flows: each job card is redrawn only when what it
// shows changed (and the focused control is focused again), cards are moved rather
// than rebuilt, the open panel redraws only the parts whose data changed (detail.js),
// and relative times tick in place. The URL names what is open (#/job/NAME/rank/N,
// #/session/ID), so a reload or a shared link opens it again.
"use strict";

const CONFIG_PATH = "/v1/dashboard";
const LOGIN_PATH = "/v1/login"; // a token in, an HttpOnly cookie and a CSRF token out
const LOGOUT_PATH = "/v1/logout";
const CSRF_HEADER = "X-CSRF-Token";
const RELOAD_DEBOUNCE_MS = 250; // events in a burst cost one re-read of the sessions
const REFRESH_MS = 5000; // new sessions and heartbeat-only changes carry no event
const RETRY_MS = [1000, 2000, 5000, 10000];

const app = {
  csrf: null, // the login's CSRF token, in memory only (the cookie is HttpOnly)
  config: null,
  sessions: new Map(),
  selected: null,
  timeline: [],
  cursor: null, // the last event seen: the stream resumes after it
  reloadTimer: null,
  confirming: null, // {session, command} or {job, command} while an admin confirms
  renderQueued: false,
  abort: null,
  cards: new Map(), // job key -> {node, sig}
  stats: { renders: 0, cards: 0, panel: 0 }, // redraw counts (tests read them)
  offlineSince: null, // when the broker stopped answering (the data is dimmed)
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

function duration(s) {
  s = Math.max(0, Math.floor(s));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d`;
}

function age(seconds) {
  return duration(Date.now() / 1000 - seconds);
}

// A relative time that ticks: "for 1m05s" since a moment, "4m12s" left until one.
function since(seconds) {
  return el("span", { class: "tick", "data-since": seconds, text: age(seconds) });
}

// A session's heartbeat age: it ticks, and each re-read of the list moves it in place
// (a beat changes no card: none is redrawn for it).
function beatAge(s) {
  const node = since(s.last_seen);
  node.dataset.beat = s.id;
  return node;
}

function moveBeats() {
  for (const node of document.querySelectorAll("[data-beat]")) {
    const s = app.sessions.get(node.dataset.beat);
    if (s && String(s.last_seen) !== node.dataset.since) {
      node.dataset.since = s.last_seen;
      node.textContent = age(s.last_seen);
    }
  }
}

function until(seconds) {
  return el("span", { class: "tick", "data-until": seconds, text: duration(seconds - Date.now() / 1000) });
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
  app.cards.clear();
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
  followRoute();
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

async function reload() {
  try {
    await loadSessions();
    setOnline(true);
    renderSoon();
  } catch (error) {
    if (error instanceof Unauthorized) showLogin(`login refused (${error.message})`);
    else setOnline(false);
  }
}

function scheduleReload() {
  clearTimeout(app.reloadTimer);
  app.reloadTimer = setTimeout(reload, RELOAD_DEBOUNCE_MS);
}

// An event moves its session's state at once (the protocol's table); the
// broker's full record follows in one debounced re-read.
function onEvent(event) {
  app.cursor = event.cursor || app.cursor;
  noteCommandEvent(event);
  const session = app.sessions.get(event.session);
  const next = app.config.state_of_kind[event.kind];
  if (session && next && !isFinal(session.state)) {
    session.state = finalState(event) || next;
    const reason = event.fields && (event.fields.reason || event.fields.why);
    if (reason) session.reason = String(reason);
    session.updated = event.received || session.updated;
  }
  if (app.selected === event.session) {
    app.timeline.push(event);
    if (app.config.listener_kinds.includes(event.kind)) refreshAttach(event.session);
  }
  if (!session || next) scheduleReload();
  renderSoon();
}

// -- the live stream (fetch: it resumes with a Last-Event-ID header) ------------

function setLive(value, text) {
  $("live").dataset.live = value;
  $("live").textContent = text;
}

// While the broker does not answer, what the page shows is dimmed and says since when.
function setOnline(online) {
  if (online === (app.offlineSince === null)) return;
  app.offlineSince = online ? null : Date.now() / 1000;
  $("main").classList.toggle("stale", !online);
  const banner = $("stale");
  banner.hidden = online;
  if (!online) banner.replaceChildren("the broker does not answer: what is shown may be out of date (for ", since(app.offlineSince), ")");
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
      setOnline(true);
      await readEvents(response.body, onEvent);
    } catch (error) {
      if (controller.signal.aborted) return;
    }
    setLive("retry", "reconnecting");
    setOnline(false);
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
  const names = [...new Set([...app.sessions.values()].map((s) => s.namespace || ""))].filter(Boolean).sort();
  const key = names.join("\n");
  if (select.dataset.names === key) return; // unchanged: an open menu stays open
  select.dataset.names = key;
  const chosen = select.value;
  select.replaceChildren(el("option", { value: "", text: "all" }), ...names.map((n) => el("option", { value: n, text: n })));
  select.value = names.includes(chosen) ? chosen : "";
}

// -- jobs ---------------------------------------------------------------------

function jobKey(s) {
  return JSON.stringify([s.namespace || "", s.job || s.id]);
}

function groupJobs() {
  const jobs = new Map();
  for (const s of app.sessions.values()) {
    const key = jobKey(s);
    if (!jobs.has(key)) jobs.set(key, { key, job: s.job || s.id, named: Boolean(s.job), namespace: s.namespace || "", ranks: [] });
    jobs.get(key).ranks.push(s);
  }
  for (const job of jobs.values()) {
    job.ranks.sort((a, b) => (a.rank ?? 1e9) - (b.rank ?? 1e9) || a.id.localeCompare(b.id));
    job.urgency = Math.min(...job.ranks.map(urgency));
    job.updated = Math.max(...job.ranks.map((r) => r.updated || 0));
  }
  return [...jobs.values()].sort((a, b) => a.urgency - b.urgency || b.updated - a.updated || a.key.localeCompare(b.key));
}

// 0.. for the urgent states in the config's order, then everything else alike
function urgency(session) {
  const i = app.config.urgent.indexOf(session.state);
  return i >= 0 ? i : app.config.urgent.length;
}

// How a final event ends its session, as the broker reads it (protocol.final_state).
function finalState(event) {
  const f = event.fields || {};
  if (event.kind === "killed" || Number.isInteger(f.signal)) return "killed";
  if (event.kind === "finished" && Number.isInteger(f.exit) && f.exit !== 0) return "failed";
  return null;
}

function isFinal(state) {
  return app.config.final_states.includes(state);
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

// -- what a session's incident is, in one line ----------------------------------

// Parts of a line: text and ticking times. The same words as `breakpod sessions`.
function incident(s) {
  const parts = [];
  const state = s.state;
  if (state === "stalled") {
    parts.push(s.culprit ? `culprit ${s.culprit}` : s.reason || "no progress");
    parts.push(" · stalled for ", since(s.since || s.updated));
  } else if (state === "parked") {
    if (s.reason) parts.push(s.reason);
    if (s.hold_until) parts.push(" · holds ", until(s.hold_until), " more");
    else parts.push(" · holds until someone attaches");
  } else if (state === "attached") {
    if (s.reason) parts.push(s.reason);
    parts.push(` · attached${s.attached_by ? `: ${s.attached_by}` : ""}`);
  } else if (state === "lost") {
    parts.push(s.reason || "no heartbeat", " · silent for ", since(s.last_seen));
  } else if (s.reason) {
    parts.push(s.reason);
  }
  return parts;
}

function rankName(s) {
  return s.rank !== null && s.rank !== undefined ? `rank ${s.rank}` : s.id;
}

// What needs attention first, for the job's most urgent ranks. Of ranks that died,
// the first to end is the likely cause (a launcher sends the others SIGTERM after it).
function headline(job) {
  const worst = job.ranks.filter((r) => urgency(r) === job.urgency && app.config.urgent.includes(r.state));
  if (!worst.length) return null;
  const dead = job.ranks.filter((r) => (isFinal(r.state) && r.state !== "finished") || r.state === "lost");
  if (dead.includes(worst[0])) {
    dead.sort((a, b) => (a.since || a.last_seen) - (b.since || b.last_seen));
    const first = dead[0];
    const more = dead.length > 1 ? ` (the first of ${dead.length} ranks to end)` : "";
    return el("p", { class: "incident", "data-state": first.state }, el("strong", { text: `${rankName(first)} ${first.state}` }), ": ", ...incident(first), more);
  }
  const first = worst[0];
  const who = worst.length === 1 ? rankName(first) : `${worst.length} ranks`;
  return el("p", { class: "incident", "data-state": first.state }, el("strong", { text: `${who} ${first.state}` }), ": ", ...incident(first));
}

// A card's signature: what it shows, but for the times that tick in place.
function cardSignature(job) {
  const ranks = job.ranks.map((s) => [s.id, s.state, s.reason, s.culprit, s.hold_until, s.attached_by, s.since, s.pod, s.host, s.rank, s.state === "lost" ? s.last_seen : 0]);
  const confirming = app.confirming && app.confirming.job === job.key ? app.confirming.command : "";
  const flights = jobFlights.get(job.key);
  return JSON.stringify([ranks, app.selected, confirming, jobSent.get(job.key) || null, job.urgency, flights ? flights.at || "loading" : null]);
}

function render() {
  if (!app.config) return;
  app.stats.renders += 1;
  syncNamespaces();
  const jobs = visibleJobs();
  const focus = focusKey();
  const container = $("jobs");
  const wanted = new Set(jobs.map((j) => j.key));
  for (const [key, card] of app.cards) {
    if (!wanted.has(key)) {
      card.node.remove();
      app.cards.delete(key);
    }
  }
  jobs.forEach((job, i) => {
    const sig = cardSignature(job);
    let card = app.cards.get(job.key);
    if (!card || card.sig !== sig) {
      const node = jobCard(job);
      if (card) card.node.replaceWith(node);
      card = { node, sig };
      app.cards.set(job.key, card);
      app.stats.cards += 1;
    }
    if (container.children[i] !== card.node) container.insertBefore(card.node, container.children[i] || null);
  });
  let empty = container.querySelector("p.empty");
  if (!jobs.length && !empty) container.append(el("p", { class: "empty", text: "no jobs match" }));
  else if (jobs.length && empty) empty.remove();
  $("counts").textContent = countsText();
  renderDetail();
  moveBeats();
  moveSteps(jobs);
  refocus(focus);
}

// Each live rank's last step (its heartbeat carries it) against the job's furthest:
// the ranks behind, most behind first, so a straggler shows before it stalls. Moved
// in place with each re-read of the list, as heartbeat ages are (no card redraws).
const LAGGERS_SHOWN = 8;

function stepsText(job) {
  const live = job.ranks.filter((s) => typeof s.step === "number" && !isFinal(s.state));
  if (!live.length) return "";
  const top = Math.max(...live.map((s) => s.step));
  const behind = live.filter((s) => s.step < top).sort((a, b) => a.step - b.step);
  if (!behind.length) return `step ${top}: ${live.length === 1 ? rankName(live[0]) : `all ${live.length} ranks`}`;
  const shown = behind.slice(0, LAGGERS_SHOWN).map((s) => `${rankName(s)} at ${s.step}, ${top - s.step} behind`);
  const more = behind.length > LAGGERS_SHOWN ? ` · ${behind.length - LAGGERS_SHOWN} more behind` : "";
  return `furthest step ${top} · ${shown.join(" · ")}${more}`;
}

function moveSteps(jobs) {
  for (const job of jobs) {
    const card = app.cards.get(job.key);
    const node = card && card.node.querySelector("p.steps");
    if (!node) continue;
    const text = stepsText(job);
    if (node.textContent !== text) node.textContent = text;
    node.hidden = !text;
    node.dataset.lagging = text.includes("behind") ? "true" : "false";
  }
}

// The focused control, by a key that survives its card's redraw.
function focusKey() {
  const active = document.activeElement;
  return active && active.dataset && active.dataset.focus ? active.dataset.focus : null;
}

function refocus(key) {
  if (!key || (document.activeElement && document.activeElement.dataset.focus === key)) return;
  const again = [...document.querySelectorAll("[data-focus]")].find((n) => n.dataset.focus === key);
  if (again) again.focus({ preventScroll: true });
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
    { class: "job", "data-job": job.job, "data-namespace": job.namespace, "data-state": worst.state, "data-key": job.key },
    el(
      "h2",
      {},
      el("a", { class: "job-name", href: job.named ? `#/job/${encodeURIComponent(job.job)}` : `#/session/${encodeURIComponent(job.job)}`, text: job.job }),
      job.namespace ? el("span", { class: "ns", text: job.namespace }) : null,
      el("span", { class: "meta" }, `${job.ranks.length} rank(s) · updated `, since(job.updated), " ago"),
    ),
    headline(job),
    el("p", { class: "steps", "data-steps": job.key, hidden: true }),
    el("div", { class: "grid", role: "group", "aria-label": `ranks of ${job.job}` }, ...job.ranks.map(rankCell)),
    notable.length ? rankTable(notable) : null,
    jobActions(job),
    flightsControl(job),
    flightsSection(job),
  );
}

function rankCell(s) {
  const label = s.rank ?? "·";
  const title = `${rankName(s)} · ${s.state}${s.reason ? ` · ${s.reason}` : ""} · ${where(s)}`;
  return el("button", {
    type: "button",
    class: "rank",
    "data-session": s.id,
    "data-state": s.state,
    "data-focus": `rank:${s.id}`,
    "aria-pressed": app.selected === s.id ? "true" : "false",
    "aria-label": `${rankName(s)}: ${s.state}`,
    title,
    text: label,
    onclick: () => openSession(s.id),
  });
}

// Each rank that needs a look: its incident, where it runs, and how long since it beat.
function rankTable(ranks) {
  return el(
    "table",
    { class: "ranks" },
    el("tr", {}, ...["rank", "state", "reason", "pod / host", "heartbeat"].map((h) => el("th", { text: h }))),
    ...ranks.map((s) =>
      el(
        "tr",
        { "data-session": s.id, onclick: () => openSession(s.id) },
        el("td", { text: s.rank ?? "-" }),
        el("td", {}, el("span", { class: "chip", "data-state": s.state, text: s.state })),
        el("td", { class: "reason" }, ...incident(s)),
        el("td", { text: where(s) }),
        el("td", { class: "age" }, isFinal(s.state) ? "-" : beatAge(s), isFinal(s.state) ? null : " ago"),
      ),
    ),
  );
}

// -- routes: #/job/NAME, #/job/NAME/rank/N, #/session/ID ---------------------------

function routeOf(id) {
  const s = app.sessions.get(id);
  if (!s) return "";
  if (s.job && s.rank !== null && s.rank !== undefined) return `#/job/${encodeURIComponent(s.job)}/rank/${s.rank}`;
  return `#/session/${encodeURIComponent(id)}`;
}

function sessionOfRoute(hash) {
  const parts = hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  if (parts[0] === "session" && parts[1]) return { session: parts[1] };
  if (parts[0] !== "job" || !parts[1]) return {};
  const ranks = [...app.sessions.values()].filter((s) => s.job === parts[1]);
  if (parts[2] === "rank" && parts[3] !== undefined) {
    const hit = ranks.find((s) => String(s.rank) === parts[3]);
    return { job: parts[1], session: hit ? hit.id : null };
  }
  return { job: parts[1] };
}

function followRoute() {
  const route = sessionOfRoute(location.hash);
  if (route.session && route.session !== app.selected && app.sessions.has(route.session)) select(route.session);
  else if (!route.session && app.selected) closePanel(false);
  if (route.job) {
    const card = [...app.cards.values()].find((c) => c.node.dataset.job === route.job);
    if (card) card.node.scrollIntoView({ block: "nearest" });
  }
}

function openSession(id) {
  const route = routeOf(id);
  if (route && location.hash !== route) location.hash = route; // hashchange selects it
  else select(id);
}

function closePanel(updateUrl = true) {
  const was = app.selected;
  app.selected = null;
  app.confirming = null;
  if (updateUrl && location.hash) history.pushState(null, "", location.pathname + location.search);
  renderSoon();
  if (was) requestAnimationFrame(() => refocus(`rank:${was}`));
}

// -- one session --------------------------------------------------------------

async function select(id) {
  app.selected = id;
  app.timeline = [];
  app.attach = null;
  app.confirming = null;
  render();
  const heading = document.querySelector("#detail h2 [tabindex]");
  if (heading) heading.focus({ preventScroll: true });
  try {
    // the latest 1000: the plots want the history, the timeline shows the last 200
    const path = `${app.config.paths.events}?session=${encodeURIComponent(id)}&limit=1000`;
    const [page, attach] = await Promise.all([api(path), attachInfo(id)]);
    if (app.selected !== id) return;
    const read = new Set(page.events.map((e) => e.cursor));
    app.timeline = [...page.events, ...app.timeline.filter((e) => !read.has(e.cursor))]; // + what streamed in meanwhile
    app.attach = attach;
    renderSoon();
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

// -- relative times tick without touching the network ------------------------------

function tick() {
  const now = Date.now() / 1000;
  for (const node of document.querySelectorAll("[data-since]")) node.textContent = duration(now - Number(node.dataset.since));
  for (const node of document.querySelectorAll("[data-until]")) node.textContent = duration(Number(node.dataset.until) - now);
}

function onKey(event) {
  if (event.key !== "Escape") return;
  if (app.confirming) {
    app.confirming = null;
    renderSoon();
  } else if (app.selected) {
    closePanel();
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", onLogin);
  $("logout").addEventListener("click", logout);
  for (const id of ["f-namespace", "f-state"]) $(id).addEventListener("change", render);
  $("f-job").addEventListener("input", render);
  document.addEventListener("keydown", onKey);
  window.addEventListener("hashchange", followRoute);
  window.addEventListener("popstate", followRoute);
  setInterval(tick, 1000);
  setInterval(() => {
    if (app.config && !$("main").hidden) reload();
  }, REFRESH_MS);
  resume();
});
