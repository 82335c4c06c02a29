"use strict";
// The agentdispatch dashboard: vanilla JS over the gateway's JSON API.
// Every value is inserted with textContent, never innerHTML, so job data cannot inject markup.

const STATUSES = ["submitted", "ready", "leased", "running", "succeeded", "failed", "cancelled", "dead_letter"];
const TERMINAL = ["succeeded", "failed", "cancelled", "dead_letter"];
const PAGE = 25;
const KEY = "agentdispatch.token";
// The chart reads the whole last hour from the store: every fifth refresh is live enough.
const CHART_EVERY = 5;
const state = { offset: 0, status: "", search: "", open: null, timer: null, noticeTimer: null, tick: 0, selected: new Set(), activity: null };

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-") || k.startsWith("aria-")) node.setAttribute(k, v);
    else if (k === "onclick") node.addEventListener("click", v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return node;
}

function ago(ts) {
  if (!ts) return "";
  const s = Math.max(0, Date.now() / 1000 - ts);
  if (s < 60) return `${Math.round(s)}s ago`;
  if (s < 3600) return `${Math.round(s / 60)}m ago`;
  if (s < 86400) return `${Math.round(s / 3600)}h ago`;
  return stamp(ts);
}

const pad = (n, w = 2) => String(n).padStart(w, "0");

// An absolute local time to the millisecond, e.g. 2026-05-01 09:30:12.345.
function stamp(ts) {
  if (!ts) return "\u2013";
  const d = new Date(ts * 1000);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
}

function duration(s) {
  if (s == null || !isFinite(s)) return "";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}

function badge(status) {
  return el("span", { class: `badge s-${status}`, "data-status": status }, status.replace("_", " "));
}

function notice(text, kind) {
  const n = $("notice");
  n.hidden = !text;
  n.textContent = text || "";
  n.className = `notice ${kind || ""}`;
  clearTimeout(state.noticeTimer);
  if (kind === "ok") state.noticeTimer = setTimeout(() => notice(""), 8000);
}

// Resolves true only when the person confirms in the modal dialog.
function confirmAction(title, text, verb, destructive = true) {
  const dlg = $("confirm");
  $("c-title").textContent = title;
  $("c-text").textContent = text;
  $("c-yes").textContent = verb;
  $("c-yes").className = destructive ? "danger" : "";
  dlg.returnValue = "";
  dlg.showModal();
  $("c-no").focus();
  return new Promise((resolve) => dlg.addEventListener("close", () => resolve(dlg.returnValue === "yes"), { once: true }));
}

async function api(path, opts) {
  const headers = { Accept: "application/json" };
  const token = sessionStorage.getItem(KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  if (opts && opts.body) headers["Content-Type"] = "application/json";
  const res = await fetch(path, { ...(opts || {}), headers });
  let body = null;
  try { body = await res.json(); } catch (_) { body = null; }
  if (res.status === 401) {
    $("who").textContent = "not connected";
    throw new Error("Enter a bearer token to connect (agentdispatch token create --tenant T).");
  }
  if (!res.ok) {
    const msg = body && (body.message || body.error) ? (body.message || body.error) : `HTTP ${res.status}`;
    const err = new Error(msg);
    err.status = res.status;
    throw err;
  }
  return body;
}

const post = (path, body) => api(path, { method: "POST", body: JSON.stringify(body || {}) });

function renderOverview(o) {
  $("who").textContent = o.tenant ? `tenant ${o.tenant}` : "operator (all tenants)";
  $("depth-scope").textContent = o.tenant ? "your tenant" : "all tenants";
  $("backend").textContent = o.backend;
  $("depth-backend").textContent = o.depth.backend.toLocaleString();
  $("depth-tenant").textContent = o.depth.tenant.toLocaleString();
  $("max-depth").textContent = o.depth.max_depth.toLocaleString();
  $("depth-meter").style.width = `${Math.min(100, (100 * o.depth.backend) / o.depth.max_depth)}%`;
  $("workers-live").textContent = o.workers.live;
  $("capacity").textContent = o.workers.capacity;
  const chips = $("status-chips");
  chips.replaceChildren(
    ...STATUSES.map((s) =>
      el(
        "button",
        { class: `chip s-${s}${state.status === s ? " on" : ""}`, "data-status": s, onclick: () => setStatus(state.status === s ? "" : s) },
        el("span", { class: "n" }, o.counts[s] || 0),
        s.replace("_", " "),
      ),
    ),
  );
  $("dlq-count").textContent = o.counts.dead_letter || 0;
}

function bars(list, counts) {
  const entries = Object.entries(counts).sort((a, b) => b[1] - a[1]);
  const max = Math.max(1, ...entries.map((e) => e[1]));
  list.replaceChildren(
    ...(entries.length
      ? entries.map(([name, n]) => {
          const fill = el("span", { class: "fill" });
          fill.style.width = `${(100 * n) / max}%`;
          return el("li", { "data-name": name }, el("span", { class: "name mono" }, name), el("span", { class: "track" }, fill), el("b", { class: "n" }, n));
        })
      : [el("li", { class: "empty" }, "nothing waiting")]),
  );
}

async function loadDepth() {
  const d = await api("/api/depth");
  bars($("depth-tenants"), d.by_tenant);
  bars($("depth-kinds"), d.by_kind);
}

async function loadActivity() {
  const a = await api("/api/activity?window_s=3600&bucket_s=60");
  state.activity = a;
  window.drawActivity($("chart"), a.points, a.bucket_s);
  const sum = (k) => a.points.reduce((n, p) => n + p[k], 0);
  const last = a.points.length ? a.points[a.points.length - 1].open : 0;
  $("activity-sum").textContent = `${sum("accepted")} accepted, ${sum("finished")} finished, ${last} open now`;
}

// A delayed turn shows when it starts instead of when it was last touched.
function startsOrAgo(job) {
  const wait = job.ready_at - Date.now() / 1000;
  if (job.status !== "ready" || wait <= 1) return ago(job.updated_at);
  return wait < 3600 ? `starts in ${Math.round(wait / 60) || 1}m` : `starts ${stamp(job.ready_at)}`;
}

// Every word is a filter the store applies, so each page holds only matches:
// "kind:K", "session:S", "agent:A", "id:TEXT"; a bare word searches job ids.
const SERVER_FILTERS = { kind: "kind", session: "session_id", agent: "agent_name", id: "q" };

function searchParams(q, params) {
  for (const word of q.split(/\s+/).filter(Boolean)) {
    const m = /^(kind|session|agent|id):(.+)$/.exec(word);
    if (m) params.set(SERVER_FILTERS[m[1]], m[2]);
    else params.set("q", word);
  }
}

async function loadJobs() {
  const params = new URLSearchParams({ limit: PAGE, offset: state.offset });
  if (state.status) params.set("status", state.status);
  searchParams(state.search, params);
  const page = await api(`/v1/jobs?${params}`);
  const rows = page.jobs.map((j) =>
    el(
      "tr",
      { class: "row", "data-job": j.job_id, onclick: () => openJob(j.job_id) },
      el("td", { class: "mono id", title: j.job_id }, j.job_id),
      el("td", {}, j.kind),
      el("td", {}, badge(j.status)),
      el("td", { class: "opt" }, `${j.attempt}/${j.max_attempts}`),
      el("td", { class: "mono dim opt" }, j.session_id),
      el("td", { class: "dim opt", title: stamp(j.updated_at) }, startsOrAgo(j)),
    ),
  );
  $("jobs").replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { class: "empty", colSpan: 6 }, state.search ? "no job matches" : "no jobs"))]));
  $("page-info").textContent = page.page.returned ? `${state.offset + 1}\u2013${state.offset + page.page.returned}` : "";
  $("prev").disabled = state.offset === 0;
  $("next").disabled = !page.page.more;
}

async function afterAction(jobId) {
  await refresh();
  if (jobId && state.open === jobId) await openJob(jobId, true);
}

async function replay(jobId) {
  try {
    const r = await post(`/v1/jobs/${encodeURIComponent(jobId)}/replay`);
    const effects = r.side_effects.length ? ` (${r.side_effects.length} recorded side effect(s) kept)` : "";
    notice(`Replayed ${jobId}: now ${r.job.status}${effects}`, "ok");
  } catch (e) {
    notice(`Replay failed: ${e.message}`, "bad");
  }
  await afterAction(jobId);
}

async function cancel(jobId) {
  if (!(await confirmAction("Cancel this job?", `${jobId} stops; a running worker is fenced out and its result discarded.`, "Cancel job"))) return;
  try {
    const v = await post(`/v1/jobs/${encodeURIComponent(jobId)}/cancel`, { reason: "cancelled from the dashboard" });
    notice(`Cancelled ${jobId}: now ${v.status}`, "ok");
  } catch (e) {
    notice(`Cancel failed: ${e.message}`, "bad");
  }
  await afterAction(jobId);
}

async function bulk(action) {
  const ids = [...state.selected];
  if (!ids.length) return;
  const n = `${ids.length} dead-lettered job${ids.length === 1 ? "" : "s"}`;
  const ask = action === "purge"
    ? confirmAction(`Purge ${n}?`, "They are deleted with their history and cannot be replayed. The side-effect ledger is kept.", "Purge")
    : confirmAction(`Replay ${n}?`, "Each goes back to ready as a new attempt; recorded side effects are not run again.", "Replay", false);
  if (!(await ask)) return;
  try {
    const r = await post(`/v1/dlq/${action}`, { job_ids: ids });
    const done = action === "purge" ? r.purged.length : r.jobs.length;
    notice(`${action === "purge" ? "Purged" : "Replayed"} ${done} job${done === 1 ? "" : "s"}`, "ok");
    state.selected.clear();
  } catch (e) {
    notice(`${action === "purge" ? "Purge" : "Replay"} failed: ${e.message}`, "bad");
  }
  await refresh();
}

function syncSelection(shown) {
  for (const id of [...state.selected]) if (!shown.includes(id)) state.selected.delete(id);
  $("dlq-replay").disabled = $("dlq-purge").disabled = state.selected.size === 0;
  $("dlq-all").checked = shown.length > 0 && state.selected.size === shown.length;
  for (const box of document.querySelectorAll("#dlq input[type=checkbox]")) box.checked = state.selected.has(box.dataset.job);
}

async function loadDlq() {
  const page = await api(`/v1/jobs?status=dead_letter&limit=50`);
  const pick = (id, on) => { if (on) state.selected.add(id); else state.selected.delete(id); syncSelection(page.jobs.map((j) => j.job_id)); };
  const rows = page.jobs.map((j) => {
    const box = el("input", { type: "checkbox", "data-job": j.job_id, "aria-label": `select ${j.job_id}` });
    box.addEventListener("change", () => pick(j.job_id, box.checked));
    return el(
      "tr",
      { "data-job": j.job_id },
      el("td", {}, box),
      el("td", { class: "mono link id", title: j.job_id, onclick: () => openJob(j.job_id) }, j.job_id),
      el("td", {}, j.kind),
      el("td", { class: "dim opt" }, j.reason || ""),
      el("td", { class: "opt" }, j.attempt),
      el("td", {}, el("button", { class: "small", "data-action": "replay", "data-job": j.job_id, onclick: () => replay(j.job_id) }, "Replay")),
    );
  });
  $("dlq").replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { class: "empty", colSpan: 6 }, "nothing dead-lettered"))]));
  $("dlq-all").onchange = (e) => {
    for (const j of page.jobs) if (e.target.checked) state.selected.add(j.job_id); else state.selected.delete(j.job_id);
    syncSelection(page.jobs.map((j) => j.job_id));
  };
  syncSelection(page.jobs.map((j) => j.job_id));
}

async function loadFleet() {
  const t = await api(`/api/fleet/topology?limit=100`);
  $("sessions").textContent = t.totals.sessions;
  const rows = t.dispatch_workers.map((w) =>
    el(
      "tr",
      {},
      el("td", { class: "mono id", title: w.worker_id }, w.worker_id),
      el("td", { class: "opt" }, w.queue_backend),
      el("td", {}, w.capacity),
      el("td", { class: "mono dim" }, w.active_sessions.join(", ") || "idle"),
      el("td", { class: "dim opt", title: stamp(w.last_heartbeat) }, ago(w.last_heartbeat)),
    ),
  );
  $("workers").replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { class: "empty", colSpan: 5 }, "no live workers"))]));
}

function setStatus(s) {
  state.status = s;
  state.offset = 0;
  $("status-filter").value = s;
  refresh();
}

async function refresh() {
  try {
    const o = await api("/api/overview");
    renderOverview(o);
    const work = [loadJobs(), loadDlq(), loadFleet(), loadDepth()];
    if (state.tick++ % CHART_EVERY === 0) work.push(loadActivity());
    // The open drawer follows the job (a worker may finish or retry it meanwhile).
    if (state.open && !$("drawer").hidden) work.push(openJob(state.open, true));
    await Promise.all(work);
    if ($("notice").classList.contains("bad")) notice("");
  } catch (e) {
    notice(e.message, "bad");
  }
}

function schedule() {
  clearInterval(state.timer);
  if ($("auto").checked) state.timer = setInterval(refresh, 3000);
}

function init() {
  const sel = $("status-filter");
  for (const s of STATUSES) sel.append(el("option", { value: s }, s.replace("_", " ")));
  sel.addEventListener("change", () => setStatus(sel.value));
  let typing = null;
  $("search").addEventListener("input", (e) => {
    clearTimeout(typing);
    typing = setTimeout(() => { state.search = e.target.value.trim(); state.offset = 0; loadJobs().catch((err) => notice(err.message, "bad")); }, 200);
  });
  $("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE); loadJobs(); });
  $("next").addEventListener("click", () => { state.offset += PAGE; loadJobs(); });
  $("d-close").addEventListener("click", () => { $("drawer").hidden = true; state.open = null; });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && !$("confirm").open) $("d-close").click(); });
  $("dlq-replay").addEventListener("click", () => bulk("replay"));
  $("dlq-purge").addEventListener("click", () => bulk("purge"));
  $("auto").addEventListener("change", schedule);
  window.addEventListener("resize", () => { if (state.activity) window.drawActivity($("chart"), state.activity.points, state.activity.bucket_s); });
  $("login").addEventListener("submit", (e) => {
    e.preventDefault();
    const t = $("token").value.trim();
    if (t) sessionStorage.setItem(KEY, t);
    $("token").value = "";
    notice("");
    state.tick = 0;
    refresh();
  });
  $("logout").addEventListener("click", () => { sessionStorage.removeItem(KEY); $("who").textContent = "not connected"; refresh(); });
  refresh();
  schedule();
}

document.addEventListener("DOMContentLoaded", init);
