"use strict";
// The agentdispatch dashboard: vanilla JS over the gateway's JSON API.
// Every value is inserted with textContent, never innerHTML, so job data cannot inject markup.

const STATUSES = ["submitted", "ready", "leased", "running", "succeeded", "failed", "cancelled", "dead_letter"];
const PAGE = 25;
const KEY = "agentdispatch.token";
const state = { offset: 0, status: "", search: "", open: null, timer: null, noticeTimer: null };

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
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
  return new Date(ts * 1000).toLocaleString();
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
  if (kind === "ok") state.noticeTimer = setTimeout(() => notice(""), 6000);
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

function renderOverview(o) {
  $("who").textContent = o.tenant ? `tenant ${o.tenant}` : "operator (all tenants)";
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

// A delayed turn shows when it starts instead of when it was last touched.
function startsOrAgo(job) {
  const wait = job.ready_at - Date.now() / 1000;
  if (job.status !== "ready" || wait <= 1) return ago(job.updated_at);
  return wait < 3600 ? `starts in ${Math.round(wait / 60) || 1}m` : `starts ${new Date(job.ready_at * 1000).toLocaleString()}`;
}

function matches(job, q) {
  if (!q) return true;
  q = q.toLowerCase();
  return [job.job_id, job.kind, job.session_id, job.agent_name, job.reason].some((v) => v && String(v).toLowerCase().includes(q));
}

// "kind:K", "session:S", "agent:A" and "id:TEXT" filter in the store (every
// page holds only matches); other words narrow the page shown.
const SERVER_FILTERS = { kind: "kind", session: "session_id", agent: "agent_name", id: "q" };

function splitSearch(q, params) {
  const rest = [];
  for (const word of q.split(/\s+/).filter(Boolean)) {
    const m = /^(kind|session|agent|id):(.+)$/.exec(word);
    if (m) params.set(SERVER_FILTERS[m[1]], m[2]);
    else rest.push(word);
  }
  return rest.join(" ");
}

async function loadJobs() {
  const params = new URLSearchParams({ limit: PAGE, offset: state.offset });
  if (state.status) params.set("status", state.status);
  const text = splitSearch(state.search, params);
  const page = await api(`/v1/jobs?${params}`);
  let jobs = page.jobs.filter((j) => matches(j, text));
  // A full job id that is not on this page is fetched directly.
  if (text && !jobs.length && /^[A-Za-z0-9_.:@/+=-]{8,200}$/.test(text)) {
    try { jobs = [await api(`/v1/jobs/${encodeURIComponent(text)}`)]; } catch (_) { jobs = []; }
  }
  const rows = jobs.map((j) =>
    el(
      "tr",
      { class: "row", "data-job": j.job_id, onclick: () => openJob(j.job_id) },
      el("td", { class: "mono" }, j.job_id),
      el("td", {}, j.kind),
      el("td", {}, badge(j.status)),
      el("td", {}, `${j.attempt}/${j.max_attempts}`),
      el("td", { class: "mono dim" }, j.session_id),
      el("td", { class: "dim" }, startsOrAgo(j)),
    ),
  );
  $("jobs").replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { class: "empty", colSpan: 6 }, "no jobs"))]));
  $("page-info").textContent = `${state.offset + 1}\u2013${state.offset + page.page.returned}`;
  $("prev").disabled = state.offset === 0;
  $("next").disabled = !page.page.more;
}

async function replay(jobId) {
  try {
    const r = await api(`/v1/jobs/${encodeURIComponent(jobId)}/replay`, { method: "POST", body: "{}" });
    const effects = r.side_effects.length ? ` (${r.side_effects.length} recorded side effect(s) kept)` : "";
    notice(`Replayed ${jobId}: now ${r.job.status}${effects}`, "ok");
  } catch (e) {
    notice(`Replay failed: ${e.message}`, "bad");
  }
  await refresh();
  if (state.open === jobId) await openJob(jobId);
}

async function cancel(jobId) {
  try {
    const v = await api(`/v1/jobs/${encodeURIComponent(jobId)}/cancel`, { method: "POST", body: "{}" });
    notice(`Cancelled ${jobId}: now ${v.status}`, "ok");
  } catch (e) {
    notice(`Cancel failed: ${e.message}`, "bad");
  }
  await refresh();
  if (state.open === jobId) await openJob(jobId);
}

async function loadDlq() {
  const page = await api(`/v1/jobs?status=dead_letter&limit=50`);
  const rows = page.jobs.map((j) =>
    el(
      "tr",
      { "data-job": j.job_id },
      el("td", { class: "mono link", onclick: () => openJob(j.job_id) }, j.job_id),
      el("td", {}, j.kind),
      el("td", { class: "dim" }, j.reason || j.error || ""),
      el("td", {}, j.attempt),
      el("td", {}, el("button", { class: "small", "data-action": "replay", "data-job": j.job_id, onclick: () => replay(j.job_id) }, "Replay")),
    ),
  );
  $("dlq").replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { class: "empty", colSpan: 5 }, "nothing dead-lettered"))]));
}

async function loadFleet() {
  const t = await api(`/api/fleet/topology?limit=100`);
  $("sessions").textContent = t.totals.sessions;
  const rows = t.dispatch_workers.map((w) =>
    el(
      "tr",
      {},
      el("td", { class: "mono" }, w.worker_id),
      el("td", {}, w.queue_backend),
      el("td", {}, w.capacity),
      el("td", { class: "mono dim" }, w.active_sessions.join(", ") || "idle"),
      el("td", { class: "dim" }, ago(w.last_heartbeat)),
    ),
  );
  $("workers").replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { class: "empty", colSpan: 5 }, "no live workers"))]));
}

async function openJob(jobId) {
  state.open = jobId;
  const h = await api(`/v1/jobs/${encodeURIComponent(jobId)}/history`);
  const j = h.job;
  $("d-title").replaceChildren(el("span", { class: "mono" }, j.job_id), " ", badge(j.status));
  const keys = ["kind", "tenant", "session_id", "agent_name", "priority", "attempt", "max_attempts", "reason", "payload_ref", "result_ref"];
  $("d-job").replaceChildren(...keys.flatMap((k) => [el("dt", {}, k), el("dd", { class: "mono" }, j[k] == null || j[k] === "" ? "\u2013" : j[k])]));
  const actions = [];
  if (j.status === "dead_letter") actions.push(el("button", { "data-action": "replay", onclick: () => replay(j.job_id) }, "Replay"));
  if (!["succeeded", "failed", "cancelled", "dead_letter"].includes(j.status)) actions.push(el("button", { class: "danger", onclick: () => cancel(j.job_id) }, "Cancel"));
  $("d-actions").replaceChildren(...actions);
  $("d-outcome").textContent = JSON.stringify(j.error ? { error: j.error } : j.result, null, 2) ?? "null";
  $("d-events").replaceChildren(
    ...h.events.map((e) =>
      el("li", {}, el("span", { class: "ev" }, e.event), badge(e.status), el("span", { class: "dim" }, ` attempt ${e.attempt}, epoch ${e.epoch} \u00b7 ${ago(e.at)}`), e.detail ? el("div", { class: "dim" }, e.detail) : ""),
    ),
  );
  $("d-effects").replaceChildren(
    ...(h.side_effects.length
      ? h.side_effects.map((f) => el("tr", {}, el("td", { class: "mono" }, f.key), el("td", {}, el("span", { class: `badge e-${f.state}` }, f.state)), el("td", {}, f.epoch), el("td", { class: "mono dim" }, JSON.stringify(f.result))))
      : [el("tr", {}, el("td", { class: "empty", colSpan: 4 }, "no side effects recorded"))]),
  );
  $("drawer").hidden = false;
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
    await Promise.all([loadJobs(), loadDlq(), loadFleet()]);
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
  $("search").addEventListener("input", (e) => { state.search = e.target.value.trim(); state.offset = 0; loadJobs().catch((err) => notice(err.message, "bad")); });
  $("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE); loadJobs(); });
  $("next").addEventListener("click", () => { state.offset += PAGE; loadJobs(); });
  $("d-close").addEventListener("click", () => { $("drawer").hidden = true; state.open = null; });
  $("auto").addEventListener("change", schedule);
  $("login").addEventListener("submit", (e) => {
    e.preventDefault();
    const t = $("token").value.trim();
    if (t) sessionStorage.setItem(KEY, t);
    $("token").value = "";
    notice("");
    refresh();
  });
  $("logout").addEventListener("click", () => { sessionStorage.removeItem(KEY); $("who").textContent = "not connected"; refresh(); });
  refresh();
  schedule();
}

document.addEventListener("DOMContentLoaded", init);
