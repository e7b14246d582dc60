// kvplane master dashboard: polls /status?history=1 with the token, draws cards, SVG charts, a table.
"use strict";
const KEY = "kvplane-token";
const COLORS = { put: "#3a6fd8", get: "#117a3d", remove: "#b42318", exist: "#8a5cd0" };
let refreshes = 0;

function takeToken() {
  const url = new URL(window.location.href);
  const given = url.searchParams.get("token");
  if (given) {
    sessionStorage.setItem(KEY, given);
    url.searchParams.delete("token");
    history.replaceState(null, "", url.pathname + url.search);  // not in the address bar or history
  }
  return sessionStorage.getItem(KEY) || "";
}

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function svgEl(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

// series: [{name, color, points: [[t, y], ...]}], t in epoch seconds
function lineChart(svg, series, fmt) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 400, H = 140, L = 44, R = 6, T = 8, B = 18;
  const pts = series.flatMap(s => s.points);
  if (pts.length < 2) {
    svg.appendChild(svgEl("text", { x: L, y: H / 2 })).textContent = "collecting samples…";
    return;
  }
  const t0 = Math.min(...pts.map(p => p[0])), t1 = Math.max(...pts.map(p => p[0]));
  const ymax = Math.max(1e-9, ...pts.map(p => p[1]));
  const x = t => L + (W - L - R) * (t1 > t0 ? (t - t0) / (t1 - t0) : 1);
  const y = v => H - B - (H - T - B) * (v / ymax);
  svg.appendChild(svgEl("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }));
  svg.appendChild(svgEl("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
  svg.appendChild(svgEl("text", { x: 2, y: T + 8 })).textContent = fmt(ymax);
  svg.appendChild(svgEl("text", { x: 2, y: H - B })).textContent = fmt(0);
  const span = Math.round(t1 - t0);
  svg.appendChild(svgEl("text", { x: L, y: H - 4 })).textContent = "-" + span + " s";
  svg.appendChild(svgEl("text", { x: W - R - 20, y: H - 4 })).textContent = "now";
  for (const s of series) {
    if (!s.points.length) continue;
    const d = s.points.map((p, i) => (i ? "L" : "M") + x(p[0]).toFixed(1) + " " + y(p[1]).toFixed(1)).join(" ");
    svg.appendChild(svgEl("path", { d: d, stroke: s.color, "data-series": s.name }));
  }
}

function rates(hist, pick) {  // per-second differences of a cumulative counter between samples
  const out = [];
  for (let i = 1; i < hist.length; i++) {
    const dt = hist[i].wall - hist[i - 1].wall;
    if (dt > 0) out.push([hist[i].wall, Math.max(0, (pick(hist[i]) - pick(hist[i - 1])) / dt)]);
  }
  return out;
}

function renderCards(doc) {
  const box = document.getElementById("cards");
  box.replaceChildren();
  const o = doc.objects, per = doc.ops.per_s;
  const cards = [
    ["objects", o.objects], ["replicas", o.replicas], ["pending puts", o.pending_puts],
    ["under-replicated", o.under_replicated], ["used", bytes(doc.used_bytes) + " / " + bytes(doc.capacity_bytes)],
    ["segments", doc.segments.length], ["clients", doc.clients],
    ["evictions", doc.evictions.total], ["evictions/s", per.evictions],
    ["puts/s", per.put], ["gets/s", per.get], ["removes/s", per.remove],
  ];
  for (const [name, value] of cards) {
    const card = el("div", { class: "card", id: "card-" + name.replace(/[^a-z]+/g, "-") });
    card.appendChild(el("b", {}, String(value)));
    card.appendChild(el("span", { class: "muted" }, name));
    box.appendChild(card);
  }
}

function renderSegments(doc) {
  const body = document.querySelector("#segments tbody");
  body.replaceChildren();
  for (const s of doc.segments) {
    const tr = el("tr", { "data-segment": s.name });
    tr.appendChild(el("td", {}, s.name));
    tr.appendChild(el("td", { class: "status-" + s.status }, s.status));
    tr.appendChild(el("td", {}, s.endpoint));
    tr.appendChild(el("td", { class: "num" }, bytes(s.used_bytes)));
    tr.appendChild(el("td", { class: "num" }, bytes(s.capacity_bytes)));
    const usage = el("td", {});
    const bar = el("span", { class: "bar" });
    bar.appendChild(el("i", { style: "width:" + Math.min(100, s.usage_percent) + "%" }));
    usage.append(bar, " " + s.usage_percent.toFixed(1) + " %");
    tr.appendChild(usage);
    tr.appendChild(el("td", { class: "num" }, String(s.replicas)));
    tr.appendChild(el("td", { class: "num" }, s.heartbeat_age_s === null ? "–" : s.heartbeat_age_s.toFixed(1) + " s ago"));
    body.appendChild(tr);
  }
}

function renderCharts(doc) {
  const hist = doc.history || [];
  const pct = hist.map(h => [h.wall, h.capacity_bytes ? 100 * h.used_bytes / h.capacity_bytes : 0]);
  lineChart(document.getElementById("chart-used"), [{ name: "used", color: "#3a6fd8", points: pct }], v => v.toFixed(0) + "%");
  lineChart(document.getElementById("chart-objects"), [{ name: "objects", color: "#117a3d", points: hist.map(h => [h.wall, h.objects]) }], v => v.toFixed(0));
  const ops = Object.keys(COLORS).map(k => ({ name: k, color: COLORS[k], points: rates(hist, h => h.ops[k] || 0) }));
  lineChart(document.getElementById("chart-ops"), ops, v => v.toFixed(v < 10 ? 1 : 0));
  const legend = document.querySelector("#charts .legend");
  legend.replaceChildren(...Object.keys(COLORS).map(k => { const s = el("span", { style: "color:" + COLORS[k] }, "■ " + k); return s; }));
  lineChart(document.getElementById("chart-evictions"), [{ name: "evictions", color: "#b42318", points: rates(hist, h => h.evicted) }], v => v.toFixed(v < 10 ? 1 : 0));
}

function render(doc) {
  const m = doc.master;
  document.getElementById("master").textContent = m.address + " · epoch " + m.epoch + " · up " + Math.round(m.uptime_s) + " s";
  const state = document.getElementById("state");
  state.textContent = "updated " + new Date().toLocaleTimeString();
  state.className = "muted";
  renderCards(doc);
  renderSegments(doc);
  renderCharts(doc);
  refreshes += 1;
  document.getElementById("refreshes").textContent = String(refreshes);
  document.body.dataset.refreshes = String(refreshes);
}

function showLogin(message) {
  const state = document.getElementById("state");
  state.textContent = message;
  state.className = "bad";
  document.getElementById("login").hidden = false;
}

let token = takeToken();

async function poll() {
  if (!token) { showLogin("no token"); return; }
  try {
    const r = await fetch("/status?history=1", { headers: { Authorization: "Bearer " + token }, cache: "no-store" });
    if (r.status === 401 || r.status === 403) { showLogin("the master refused this token (" + r.status + ")"); return; }
    if (!r.ok) throw new Error("HTTP " + r.status);
    document.getElementById("login").hidden = true;
    render(await r.json());
  } catch (err) {
    const state = document.getElementById("state");
    state.textContent = "master unreachable: " + err.message;
    state.className = "bad";
  }
}

document.getElementById("login").addEventListener("submit", ev => {
  ev.preventDefault();
  token = document.getElementById("token").value.trim();
  sessionStorage.setItem(KEY, token);
  poll();
});

poll();
setInterval(poll, 2000);
