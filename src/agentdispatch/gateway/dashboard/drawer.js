"use strict";
// The job drawer: everything an on-call person asks of one job (its payload,
// error and traceback, a timeline with absolute times and the time between
// events, its side effects), re-read on every refresh while it is open.
// Uses the helpers of app.js (classic scripts share one global scope).

// A claim starts the handler in the same transaction: one event, both moments.
const EVENT_LABELS = { claimed: "claimed and started", lease_expired: "lease expired" };

const json = (v) => (v === undefined ? "null" : JSON.stringify(v, null, 2));

// A failed attempt's committed event reads "owner: error" then the traceback.
function tracebackOf(events) {
  for (let i = events.length - 1; i >= 0; i--) {
    const d = events[i].detail || "";
    const at = d.indexOf("\nTraceback");
    if (events[i].event === "committed" && at >= 0) return { text: d.slice(at + 1), attempt: events[i].attempt };
  }
  return null;
}

function renderTimeline(events, job) {
  const items = events.map((e, i) => {
    const prev = i ? events[i - 1].at : null;
    const detail = (e.detail || "").split("\nTraceback")[0];
    return el(
      "li",
      { "data-event": e.event },
      el("div", {}, el("span", { class: "ev" }, EVENT_LABELS[e.event] || e.event.replace("_", " ")), badge(e.status), el("span", { class: "dim small" }, ` attempt ${e.attempt} \u00b7 epoch ${e.epoch}`)),
      el("div", { class: "when" }, el("time", { class: "mono", title: new Date(e.at * 1000).toISOString() }, stamp(e.at)), prev == null ? "" : el("span", { class: "dur" }, ` +${duration(e.at - prev)}`)),
      detail ? el("div", { class: "dim mono small" }, detail) : "",
    );
  });
  $("d-events").replaceChildren(...(items.length ? items : [el("li", { class: "empty" }, "no events")]));
  const claimed = events.filter((e) => e.event === "claimed");
  const parts = [];
  if (claimed.length) parts.push(`waited ${duration(claimed[0].at - job.created_at)} for a worker`);
  const lastClaim = claimed.length ? claimed[claimed.length - 1].at : null;
  const ended = events.length ? events[events.length - 1] : null;
  if (lastClaim && ended && ended.event === "committed") parts.push(`last attempt ran ${duration(ended.at - lastClaim)}`);
  if (job.completed_at) parts.push(`${duration(job.completed_at - job.created_at)} end to end`);
  $("d-durations").textContent = parts.join(" \u00b7 ");
}

async function openJob(jobId, quiet) {
  state.open = jobId;
  let h;
  try {
    h = await api(`/v1/jobs/${encodeURIComponent(jobId)}/history`);
  } catch (e) {
    if (!quiet) notice(`Cannot open ${jobId}: ${e.message}`, "bad");
    if (e.status === 404 && state.open === jobId) $("d-fresh").textContent = "no longer exists";
    return;
  }
  if (state.open !== jobId) return; // another job was opened meanwhile
  const j = h.job;
  $("d-title").replaceChildren(el("span", { class: "mono" }, j.job_id), " ", badge(j.status));
  $("d-fresh").textContent = `as of ${stamp(Date.now() / 1000).slice(11, 19)}`;
  const rows = [
    ["kind", j.kind], ["tenant", j.tenant], ["session", j.session_id], ["agent", j.agent_name], ["priority", j.priority],
    ["attempt", `${j.attempt} of ${j.max_attempts}`], ["reason", j.reason], ["created", stamp(j.created_at)],
    ["ready at", stamp(j.ready_at)], ["finished", j.completed_at ? stamp(j.completed_at) : null],
    ["deadline", j.deadline_unix ? stamp(j.deadline_unix) : null], ["depends on", (j.dependencies || []).join(", ")],
  ];
  $("d-job").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", { class: "mono" }, v == null || v === "" ? "\u2013" : v)]));
  const actions = [];
  if (j.status === "dead_letter") actions.push(el("button", { "data-action": "replay", onclick: () => replay(j.job_id) }, "Replay"));
  if (!TERMINAL.includes(j.status)) actions.push(el("button", { class: "danger", "data-action": "cancel", onclick: () => cancel(j.job_id) }, "Cancel"));
  $("d-actions").replaceChildren(...actions);
  $("d-payload").textContent = json(h.payload);
  const tb = tracebackOf(h.events);
  $("d-error-box").hidden = !j.error && !tb;
  $("d-error").textContent = j.error || "";
  $("d-traceback").textContent = tb ? tb.text : "no traceback recorded";
  $("d-tb-attempt").textContent = tb ? `attempt ${tb.attempt}` : "";
  $("d-result-box").hidden = j.status !== "succeeded";
  $("d-result").textContent = json(j.result);
  renderTimeline(h.events, j);
  $("d-effects").replaceChildren(
    ...(h.side_effects.length
      ? h.side_effects.map((f) => el("tr", {}, el("td", { class: "mono" }, f.key), el("td", {}, el("span", { class: `badge e-${f.state}` }, f.state)), el("td", {}, f.epoch), el("td", { class: "mono dim" }, JSON.stringify(f.result))))
      : [el("tr", {}, el("td", { class: "empty", colSpan: 4 }, "no side effects recorded"))]),
  );
  $("drawer").hidden = false;
}
