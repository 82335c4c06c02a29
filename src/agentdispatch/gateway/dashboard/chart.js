"use strict";
// The activity chart: finished turns per bucket as stacked bars, open turns
// (accepted, not finished) as a line on its own scale. Plain SVG, no library:
// the page loads nothing from outside its gateway.

const SVG_NS = "http://www.w3.org/2000/svg";
const CHART = { h: 190, left: 34, right: 38, top: 10, bottom: 22 };
const STACK = [["succeeded", "b-succeeded"], ["failed", "b-failed"], ["dead_letter", "b-failed"], ["cancelled", "b-cancelled"]];

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text != null) node.textContent = String(text);
  return node;
}

// A round axis maximum at or above `n` (1, 2, 5 times a power of ten).
function niceMax(n) {
  if (n <= 4) return 4;
  const p = 10 ** Math.floor(Math.log10(n));
  for (const m of [1, 2, 5, 10]) if (m * p >= n) return m * p;
  return 10 * p;
}

function hhmm(ts) {
  const d = new Date(ts * 1000);
  return `${String(d.getHours()).padStart(2, "0")}:${String(d.getMinutes()).padStart(2, "0")}`;
}

// Draw `points` (the /api/activity answer) into `box`, replacing what was there.
function drawActivity(box, points, bucketS) {
  const { h, left, right, top, bottom } = CHART;
  // Drawn at the box's own width, so its text keeps its size on a phone.
  const w = Math.max(280, Math.round(box.clientWidth || 640));
  const plotW = w - left - right;
  const plotH = h - top - bottom;
  const root = svg("svg", { viewBox: `0 0 ${w} ${h}`, role: "img", class: "activity", "data-points": points.length });
  const finished = points.map((p) => p.finished);
  const open = points.map((p) => p.open);
  const maxBar = niceMax(Math.max(0, ...finished));
  const maxOpen = niceMax(Math.max(0, ...open));
  const step = plotW / Math.max(1, points.length);
  const y = (v, max) => top + plotH - (plotH * v) / max;

  for (const frac of [0, 0.5, 1]) {
    const gy = top + plotH * (1 - frac);
    root.append(svg("line", { x1: left, x2: w - right, y1: gy, y2: gy, class: "grid-line" }));
    root.append(svg("text", { x: left - 4, y: gy + 4, class: "axis bars-axis", "text-anchor": "end" }, Math.round(maxBar * frac)));
    root.append(svg("text", { x: w - right + 4, y: gy + 4, class: "axis open-axis" }, Math.round(maxOpen * frac)));
  }
  points.forEach((p, i) => {
    let base = 0;
    const x = left + i * step;
    for (const [key, cls] of STACK) {
      const v = p[key] || 0;
      if (!v) continue;
      const y0 = y(base, maxBar);
      const y1 = y(base + v, maxBar);
      root.append(svg("rect", { x: x + step * 0.1, y: y1, width: Math.max(1, step * 0.8), height: Math.max(1, y0 - y1), class: `cbar ${cls}` }));
      base += v;
    }
    const tip = `${hhmm(p.t)}: ${p.accepted} accepted, ${p.finished} finished (${p.succeeded} ok, ${p.failed + p.dead_letter} failed, ${p.cancelled} cancelled), ${p.open} open`;
    const hit = svg("rect", { x, y: top, width: step, height: plotH, class: "hit" });
    hit.append(svg("title", {}, tip));
    root.append(hit);
    if (i % Math.max(1, Math.round((w < 480 ? 1200 : 900) / bucketS)) === 0) {
      root.append(svg("text", { x: x + step / 2, y: h - 6, class: "axis", "text-anchor": "middle" }, hhmm(p.t)));
    }
  });
  const line = points.map((p, i) => `${(left + (i + 0.5) * step).toFixed(1)},${y(p.open, maxOpen).toFixed(1)}`).join(" ");
  root.append(svg("polyline", { points: line, class: "open-line" }));
  box.replaceChildren(root);
}

window.drawActivity = drawActivity;
