# ruff: noqa: E501  (the page is HTML and JavaScript, not Python)
"""The inspector's page (`arrowbuf.observe.ui`): one HTML document, styles and script inline, no external assets."""

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>arrowbuf inspector</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f5f6f8;color:#1d2330}
header{background:#1d2330;color:#fff;padding:10px 18px;display:flex;gap:16px;align-items:center}
header h1{font-size:17px;margin:0}header .sub{opacity:.75}
main{display:grid;grid-template-columns:minmax(420px,1fr) minmax(420px,1.4fr);align-items:start;gap:14px;padding:14px}
.stack{display:flex;flex-direction:column;gap:14px;min-width:0}
@media (max-width:920px){main{grid-template-columns:minmax(0,1fr)}}
section{background:#fff;border-radius:8px;padding:12px 14px;box-shadow:0 1px 2px #0002;min-width:0;overflow-x:auto}
h2{font-size:14px;margin:0 0 8px;color:#3b4760;text-transform:uppercase;letter-spacing:.04em}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{min-width:90px}.card b{display:block;font-size:20px}
.card span{color:#667}table{border-collapse:collapse;width:100%;font-size:13px}
td,th{padding:3px 6px;border-bottom:1px solid #e4e6eb;text-align:right}td:first-child,th:first-child{text-align:left}
.bar{height:8px;background:#e4e6eb;border-radius:4px;overflow:hidden;min-width:80px}.bar i{display:block;height:8px;background:#3a7bd5}
textarea{width:100%;box-sizing:border-box;font:13px monospace;height:70px}
button{margin-top:6px;padding:4px 12px}.err{color:#b00020;white-space:pre-wrap;font-size:13px}
.scroll{max-height:260px;overflow:auto}svg{width:100%;height:90px;background:#fafbfc}
.wide{grid-column:1/-1}
td.none{text-align:left;color:#667;font-style:italic}
#auth{display:none;background:#fff3cd;padding:8px 18px}
</style></head><body>
<header><h1>arrowbuf inspector</h1><span class="sub" id="title">connecting...</span>
<span class="sub" id="updated"></span></header>
<div id="auth">This inspector needs the store's token: <input id="token-input" type="password" size="30">
<button id="token-save">use token</button> <span class="err" id="auth-error"></span></div>
<main>
<section id="overview"><h2>Overview</h2><div class="cards">
<div class="card"><b id="size">-</b><span>rows</span></div>
<div class="card"><b id="capacity">-</b><span>capacity</span></div>
<div class="card"><b id="fill">-</b><span>fill</span></div>
<div class="card"><b id="inserts">-</b><span>inserted</span></div>
<div class="card"><b id="samples">-</b><span>sampled</span></div>
<div class="card"><b id="policy-version">-</b><span>policy version</span></div>
<div class="card"><b id="chunks">-</b><span>chunks (sealed)</span></div>
<div class="card"><b id="lineage-bytes">-</b><span>lineage bytes</span></div>
<div class="card" title="what the live rows' values take"><b id="rows-bytes">-</b><span>rows' bytes</span></div>
<div class="card" title="what the store's memory holds for its capacity, rows or not"><b id="reserved-bytes">-</b><span>reserved bytes</span></div></div>
<h2 style="margin-top:12px">Size per column</h2>
<div class="scroll"><table id="columns"><thead><tr><th>column</th><th>rows' bytes</th><th>reserved bytes</th></tr></thead><tbody></tbody></table></div>
<h2 style="margin-top:12px">Tiers and placement (reserved bytes)</h2><table id="tiers"><thead><tr><th>tier</th><th>reserved bytes</th></tr></thead><tbody></tbody></table>
<div class="scroll"><table id="placement"><thead><tr><th>column</th><th>tier</th><th>chunks</th><th>reserved bytes</th></tr></thead><tbody></tbody></table></div>
</section>
<div class="stack"><section><h2>Rates (rows/s, last minutes)</h2>
<div>ingest <b id="rate-ingest">-</b> &middot; sample <b id="rate-sample">-</b> &middot; consume <b id="rate-consume">-</b></div>
<svg id="rates-chart" viewBox="0 0 400 90" preserveAspectRatio="none"></svg></section>
<section><h2>Tasks</h2><table id="tasks"><thead><tr><th>task</th><th>ready</th><th>waiting</th><th>consumed</th>
<th>in flight</th><th>delivered</th><th>stale</th><th>staleness</th><th>progress</th></tr></thead><tbody></tbody></table></section>
<section><h2 id="returns-kind">Returns</h2><svg id="returns-chart" viewBox="0 0 400 90" preserveAspectRatio="none"></svg>
<div id="returns-summary"></div></section>
<section><h2>Chunks (newest 64)</h2>
<div class="scroll"><table id="chunk-table"><thead><tr><th>slot</th><th>first seq</th><th>rows</th><th>sealed</th><th>columns per tier</th></tr></thead><tbody></tbody></table></div></section>
</div>
<section class="wide"><h2>SQL (read-only, sandboxed)</h2>
<textarea id="sql-query">SELECT task, count(consumed_at) AS consumed, avg(staleness) AS staleness FROM lineage GROUP BY 1</textarea>
<button id="sql-run">run</button> <span id="sql-info"></span><div class="err" id="sql-error"></div>
<div class="scroll"><table id="sql-result"></table></div></section>
<section class="wide"><h2>Lineage of a row</h2><input id="lineage-seq" type="number" placeholder="seq" min="0">
<button id="lineage-run">show</button><div class="err" id="lineage-error"></div>
<div class="scroll"><table id="lineage-result"></table></div></section>
</main>
<script>
"use strict";
let token = sessionStorage.getItem("arrowbuf-token") || "";
const h = location.hash.match(/token=([^&]+)/);
if (h) { token = decodeURIComponent(h[1]); sessionStorage.setItem("arrowbuf-token", token); history.replaceState(null, "", location.pathname + location.search); }
const refresh = Number(new URLSearchParams(location.search).get("refresh") || 1000);
const $ = (id) => document.getElementById(id);
const fmt = (v) => v === null || v === undefined ? "-" : (typeof v === "number" ? (Number.isInteger(v) ? v.toLocaleString("en-US") : v.toFixed(2)) : String(v));
function bytes(n) { if (n == null) return "-"; const u = ["B","KiB","MiB","GiB","TiB"]; let i = 0; while (n >= 1024 && i < 4) { n /= 1024; i++; } return n.toFixed(i ? 1 : 0) + " " + u[i]; }
async function api(path, opts) {
  opts = opts || {}; opts.headers = Object.assign({"Content-Type": "application/json"}, opts.headers || {});
  if (token) opts.headers["Authorization"] = "Bearer " + token;
  const r = await fetch(path, opts); const body = await r.json();
  if (r.status === 401) { $("auth").style.display = "block"; $("auth-error").textContent = body.message; throw new Error(body.message); }
  if (!r.ok) throw new Error(body.error + ": " + body.message);
  $("auth").style.display = "none"; $("auth-error").textContent = ""; return body;
}
function rows(tbody, data, cells) { tbody.replaceChildren(...data.map((d) => { const tr = document.createElement("tr"); for (const [cls, v] of cells(d)) { const td = document.createElement("td"); td.className = cls; if (v instanceof Node) td.appendChild(v); else td.textContent = v; tr.appendChild(td); } return tr; })); }
function none(table, text) { const tr = document.createElement("tr"), td = document.createElement("td"); td.className = "none"; td.colSpan = table.tHead.rows[0].cells.length; td.textContent = text; tr.appendChild(td); table.tBodies[0].replaceChildren(tr); }
function chart(svg, series, colors) {
  const all = series.flat(); const max = Math.max(1e-9, ...all); const n = Math.max(2, ...series.map((s) => s.length));
  svg.replaceChildren(...series.map((s, k) => { const p = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    p.setAttribute("points", s.map((v, i) => (i * 400 / (n - 1)).toFixed(1) + "," + (88 - v / max * 84).toFixed(1)).join(" "));
    p.setAttribute("fill", "none"); p.setAttribute("stroke", colors[k % colors.length]); p.setAttribute("stroke-width", "1.5"); return p; }));
}
function bars(svg, values) {
  if (!values.length) { svg.replaceChildren(); return; }
  const lo = Math.min(...values), hi = Math.max(...values), k = 20, counts = new Array(k).fill(0);
  for (const v of values) counts[Math.min(k - 1, Math.floor((v - lo) / ((hi - lo) || 1) * k))]++;
  const m = Math.max(...counts);
  svg.replaceChildren(...counts.map((c, i) => { const r = document.createElementNS("http://www.w3.org/2000/svg", "rect");
    r.setAttribute("x", i * 20 + 1); r.setAttribute("width", 18); r.setAttribute("y", 88 - c / m * 84); r.setAttribute("height", c / m * 84); r.setAttribute("fill", "#3a7bd5"); return r; }));
}
async function update() {
  const o = await api("/api/overview"); const s = o.stats;
  $("title").textContent = s.name + " (schema " + s.schema + ", sampler " + fmt(s.sampler) + ")";
  $("size").textContent = fmt(s.size); $("capacity").textContent = fmt(s.capacity);
  $("fill").textContent = s.capacity ? (100 * s.size / s.capacity).toFixed(1) + "%" : "-";
  $("inserts").textContent = fmt(s.inserts); $("samples").textContent = fmt(s.samples);
  $("policy-version").textContent = fmt(s.policy_version); $("chunks").textContent = fmt(s.chunks) + " (" + fmt(s.sealed_chunks) + ")";
  $("lineage-bytes").textContent = o.lineage_bytes == null ? "-" : bytes(o.lineage_bytes);
  $("rows-bytes").textContent = bytes(s.rows_bytes); $("reserved-bytes").textContent = bytes(s.reserved_bytes);
  rows($("columns").tBodies[0], Object.entries(s.columns || {}), ([c, z]) => [["column", c], ["rows-bytes", bytes(z.rows_bytes)], ["reserved-bytes", bytes(z.reserved_bytes)]]);
  rows($("tiers").tBodies[0], Object.entries(s.bytes || {}), ([t, b]) => [["tier", t], ["bytes", bytes(b)]]);
  rows($("placement").tBodies[0], o.placement, (p) => [["column", p.column], ["tier", p.tier], ["chunks", fmt(p.chunks)], ["bytes", bytes(p.bytes)]]);
  rows($("chunk-table").tBodies[0], (o.chunks || []).slice().reverse(), (c) => [["slot", fmt(c.slot)], ["first-seq", fmt(c.first_seq)], ["rows", fmt(c.rows)], ["sealed", c.sealed ? "yes" : "open"],
    ["tiers", Object.entries(c.tiers).map(([t, cols]) => t + ": " + cols.length + " col" + (cols.length > 1 ? "s" : "")).join(", ")]]);
  const live = o.live || s.size || 0;
  rows($("tasks").tBodies[0], Object.entries(o.tasks), ([t, p]) => { const bar = document.createElement("div"); bar.className = "bar";
    const i = document.createElement("i"); i.style.width = (live ? 100 * (p.consumed || 0) / live : 0) + "%"; bar.appendChild(i);
    return [["task", t], ["ready", fmt(p.ready)], ["waiting", fmt(p.waiting)], ["consumed", fmt(p.consumed)], ["in-flight", fmt(p.in_flight)],
            ["delivered", fmt(p.delivered)], ["stale", fmt(p.stale)], ["staleness", fmt(p.mean_staleness)], ["progress", bar]]; });
  for (const tr of $("tasks").tBodies[0].rows) tr.dataset.task = tr.cells[0].textContent;
  if (!Object.keys(o.tasks).length) none($("tasks"), "no tasks (a store declares them with tasks=[...] or store.add_task(name))");
  const r = o.rates, last = r.length ? r[r.length - 1] : null;
  $("rate-ingest").textContent = last ? fmt(last.ingest) : "-"; $("rate-sample").textContent = last ? fmt(last.sample) : "-";
  $("rate-consume").textContent = last ? Object.entries(last.consume).map(([t, v]) => t + " " + fmt(v)).join(", ") || "-" : "-";
  const tasks = last ? Object.keys(last.consume) : [];
  chart($("rates-chart"), [r.map((x) => x.ingest), ...tasks.map((t) => r.map((x) => x.consume[t] || 0))], ["#3a7bd5", "#e07b39", "#2e9e5b", "#9b59b6"]);
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();
}
async function updateReturns() {
  const r = await api("/api/returns"); $("returns-kind").textContent = r.kind; bars($("returns-chart"), r.values);
  const n = r.values.length, mean = n ? r.values.reduce((a, b) => a + b, 0) / n : null;
  $("returns-summary").textContent = n ? n + " values, mean " + fmt(mean) : "none yet";
}
function showTable(table, res) {
  const head = document.createElement("tr"); for (const c of res.columns) { const th = document.createElement("th"); th.textContent = c; head.appendChild(th); }
  table.replaceChildren(head, ...res.rows.map((row) => { const tr = document.createElement("tr"); for (const v of row) { const td = document.createElement("td"); td.textContent = v === null ? "NULL" : fmt(v); tr.appendChild(td); } return tr; }));
}
$("sql-run").onclick = async () => { $("sql-error").textContent = ""; $("sql-info").textContent = "running...";
  try { const res = await api("/api/sql", {method: "POST", body: JSON.stringify({query: $("sql-query").value})});
        showTable($("sql-result"), res); $("sql-info").textContent = res.total_rows + " rows" + (res.truncated ? " (first " + res.rows.length + " shown)" : ""); }
  catch (e) { $("sql-result").replaceChildren(); $("sql-info").textContent = ""; $("sql-error").textContent = e.message; } };
$("lineage-run").onclick = async () => { $("lineage-error").textContent = "";
  try { showTable($("lineage-result"), await api("/api/lineage?seq=" + encodeURIComponent($("lineage-seq").value))); }
  catch (e) { $("lineage-result").replaceChildren(); $("lineage-error").textContent = e.message; } };
$("token-save").onclick = () => { token = $("token-input").value; sessionStorage.setItem("arrowbuf-token", token); tick(); };
async function tick() { try { await update(); } catch (e) { console.log(e); } }
async function slow() { try { await updateReturns(); } catch (e) { console.log(e); } }
tick(); slow(); setInterval(tick, refresh); setInterval(slow, Math.max(5000, refresh * 5));
</script></body></html>
"""
