// compat-serve dashboard: polls /v1/dashboard and /v1/logs and draws its own charts on
// canvases; chat.js streams its chat. Same origin only; no libraries.
"use strict";

const KEY_STORAGE = "compat-serve-api-key";
const params = new URLSearchParams(location.search);
const POLL_MS = Math.max(200, Number(params.get("interval")) || 1000);
const RATE_POINTS = 120; // samples kept for the tok/s chart

const $ = (id) => document.getElementById(id);
const app = {
  key: sessionStorage.getItem(KEY_STORAGE) || "",
  keyRequired: document.body.dataset.keyRequired === "true",
  timer: null,
  logAfter: 0,
  model: null,
  rates: [], // [{t, v}] generated tokens per second
  lastTotals: null,
  chat: [],
  chatAbort: null,
};

class AuthError extends Error {}

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  if (app.key) headers["x-api-key"] = app.key;
  return headers;
}

async function getJSON(path) {
  const response = await fetch(path, { headers: authHeaders(), cache: "no-store" });
  if (response.status === 401) throw new AuthError(await errorMessage(response));
  if (!response.ok) throw new Error(await errorMessage(response));
  return response.json();
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    const error = body.error || body;
    return (error && error.message) || `HTTP ${response.status}`;
  } catch (_) {
    return `HTTP ${response.status}`;
  }
}

// ---- formatting --------------------------------------------------------------------

function fmtInt(n) {
  return n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US");
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i === 0 || n >= 100 ? 0 : 1)} ${units[i]}`;
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

function fmtRatio(r) {
  return r === null || r === undefined || Number.isNaN(r) ? "–" : `${(r * 100).toFixed(1)}%`;
}

function fmtRate(r) {
  return r === null || r === undefined ? "–" : r.toFixed(1);
}

function setText(id, text) {
  const el = $(id);
  if (el.textContent !== text) el.textContent = text;
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function fillRows(tbodyId, rows, toCells) {
  const tbody = $(tbodyId);
  const trs = rows.map((row) => {
    const tr = document.createElement("tr");
    for (const td of toCells(row)) tr.appendChild(td);
    return tr;
  });
  tbody.replaceChildren(...trs);
}

// ---- charts (canvas, drawn by hand) ------------------------------------------------

function prepareCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const style = getComputedStyle(document.documentElement);
  const colors = {
    text: style.getPropertyValue("--muted").trim(),
    line: style.getPropertyValue("--line").trim(),
    accent: style.getPropertyValue("--accent").trim(),
    accent2: style.getPropertyValue("--accent2").trim(),
    warn: style.getPropertyValue("--warn").trim(),
  };
  return { ctx, width, height, colors };
}

// Axes with gridlines at 0, half and max; returns the plot area.
function drawAxes(c, max, label) {
  const { ctx, width, height, colors } = c;
  const area = { left: 44, right: width - 8, top: 8, bottom: height - 18 };
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = colors.text;
  ctx.strokeStyle = colors.line;
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const share of [0, 0.5, 1]) {
    const y = area.bottom - share * (area.bottom - area.top);
    ctx.beginPath();
    ctx.moveTo(area.left, Math.round(y) + 0.5);
    ctx.lineTo(area.right, Math.round(y) + 0.5);
    ctx.stroke();
    ctx.fillText(label(share * max), area.left - 5, y);
  }
  return area;
}

function drawRateChart() {
  const c = prepareCanvas($("rate-chart"));
  const points = app.rates;
  const max = Math.max(10, ...points.map((p) => p.v)) * 1.1;
  const area = drawAxes(c, max, (v) => v.toFixed(0));
  const { ctx, colors } = c;
  ctx.textAlign = "left";
  ctx.textBaseline = "alphabetic";
  ctx.fillText(`last ${Math.round((RATE_POINTS * POLL_MS) / 1000)} s`, area.left, c.height - 4);
  if (points.length < 2) return;
  const t1 = points[points.length - 1].t;
  const span = (RATE_POINTS * POLL_MS) / 1000;
  const x = (t) => area.right - ((t1 - t) / span) * (area.right - area.left);
  const y = (v) => area.bottom - (v / max) * (area.bottom - area.top);
  ctx.beginPath();
  points.forEach((p, i) => (i ? ctx.lineTo(x(p.t), y(p.v)) : ctx.moveTo(x(p.t), y(p.v))));
  ctx.strokeStyle = colors.accent;
  ctx.lineWidth = 2;
  ctx.stroke();
  ctx.lineTo(x(t1), area.bottom);
  ctx.lineTo(x(points[0].t), area.bottom);
  ctx.closePath();
  ctx.globalAlpha = 0.15;
  ctx.fillStyle = colors.accent;
  ctx.fill();
  ctx.globalAlpha = 1;
}

// One bar per finished request (share of its prompt read from the cache), and the
// running ratio since start as a line.
function drawHitChart(recent) {
  const c = prepareCanvas($("hit-chart"));
  const area = drawAxes(c, 1, (v) => `${Math.round(v * 100)}%`);
  const { ctx, colors } = c;
  const rows = recent.filter((r) => r.prompt_tokens > 0);
  ctx.textAlign = "left";
  ctx.textBaseline = "alphabetic";
  ctx.fillText(`last ${rows.length} requests`, area.left, c.height - 4);
  if (!rows.length) return;
  const slot = (area.right - area.left) / Math.max(rows.length, 20);
  const height = area.bottom - area.top;
  let prompt = 0;
  let cached = 0;
  const line = [];
  rows.forEach((r, i) => {
    const share = r.cached_tokens / r.prompt_tokens;
    const x = area.left + i * slot;
    ctx.fillStyle = share >= 0.5 ? colors.accent2 : colors.warn;
    ctx.fillRect(x + 1, area.bottom - share * height, Math.max(slot - 2, 1), share * height);
    prompt += r.prompt_tokens;
    cached += r.cached_tokens;
    line.push([x + slot / 2, area.bottom - (cached / prompt) * height]);
  });
  ctx.beginPath();
  line.forEach(([x, y], i) => (i ? ctx.lineTo(x, y) : ctx.moveTo(x, y)));
  ctx.strokeStyle = colors.accent;
  ctx.lineWidth = 2;
  ctx.stroke();
}

// ---- rendering the snapshot ----------------------------------------------------------

function renderHeader(snap) {
  const model = snap.models[0];
  setText("model-id", model.id);
  const pill = $("server-state");
  pill.hidden = false;
  setText("server-state", snap.server.state);
  pill.classList.toggle("bad", snap.server.state !== "serving");
  setText(
    "server-meta",
    `v${snap.server.version} · up ${fmtSeconds(snap.server.uptime_s)} · window ${fmtInt(
      model.context_window,
    )} tokens`,
  );
  document.title = `${model.id} · compat-serve`;
}

function renderRequests(snap) {
  const req = snap.requests;
  setText("live-count", String(req.live.length));
  setText("queued", String(req.queued));
  setText("prefilling", String(req.prefilling));
  setText("decoding", String(req.decoding));
  setText("finished", fmtInt(req.finished_total));
  setText("ttft-mean", fmtSeconds(req.ttft_mean_s));
  const last = req.recent.filter((r) => r.ttft_s !== null).pop();
  setText("ttft-last", last ? fmtSeconds(last.ttft_s) : "–");

  const now = snap.server.uptime_s;
  const totals = { t: now, generated: req.generated_tokens_total };
  if (app.lastTotals && now > app.lastTotals.t) {
    const rate = (totals.generated - app.lastTotals.generated) / (now - app.lastTotals.t);
    app.rates.push({ t: now, v: Math.max(rate, 0) });
    if (app.rates.length > RATE_POINTS) app.rates.shift();
    setText("tok-rate", rate.toFixed(1));
  }
  app.lastTotals = totals;
  drawRateChart();

  fillRows("live-rows", req.live, (r) => [
    cell(r.request_id, "id"),
    cell(r.client || "–"),
    cell(r.phase),
    cell(fmtInt(r.prompt_tokens)),
    cell(fmtInt(r.cached_tokens)),
    cell(fmtInt(r.computed_tokens)),
    cell(fmtInt(r.generated_tokens)),
    cell(fmtRate(r.decode_tokens_per_s)),
    cell(fmtSeconds(r.ttft_s)),
    cell(fmtSeconds(r.age_s)),
  ]);
  fillRows("recent-rows", req.recent.slice(-8).reverse(), (r) => [
    cell(r.request_id, "id"),
    cell(r.client || "–"),
    cell(r.outcome),
    cell(fmtInt(r.prompt_tokens)),
    cell(fmtInt(r.cached_tokens)),
    cell(fmtInt(r.generated_tokens)),
    cell(fmtRate(r.decode_tokens_per_s)),
    cell(fmtSeconds(r.ttft_s)),
    cell(fmtSeconds(r.duration_s)),
  ]);
}

function renderCache(snap) {
  const cache = snap.cache;
  if (!cache.enabled) {
    setText("hit-ratio", "off");
    setText("cache-blocks", "–");
    setText("cache-disk", "–");
    setText("cache-evictions", "–");
  } else {
    setText("hit-ratio", fmtRatio(cache.query_tokens ? cache.hit_ratio : null));
    setText("cache-blocks", `${fmtInt(cache.blocks)} / ${fmtInt(cache.capacity_blocks)}`);
    setText(
      "cache-disk",
      cache.disk_enabled ? `${fmtInt(cache.disk_files)} files, ${fmtBytes(cache.disk_bytes)}` : "off",
    );
    setText("cache-evictions", fmtInt(cache.evictions));
  }
  drawHitChart(snap.requests.recent);
  fillRows("client-rows", cache.clients, (r) => [
    cell(r.client),
    cell(fmtInt(r.requests)),
    cell(fmtInt(r.prompt_tokens)),
    cell(fmtInt(r.cached_tokens)),
    cell(fmtRatio(r.prompt_tokens ? r.cached_tokens / r.prompt_tokens : null)),
  ]);
  fillRows("pin-rows", cache.pins || [], (p) => [
    cell(p.prefix_hash.slice(0, 12)),
    cell(fmtInt(p.tokens)),
    cell(p.ttl),
    cell(`${Math.round(p.expires_in_s)} s`),
  ]);
}

function renderMemory(snap) {
  const m = snap.memory;
  const rows = [
    ["Weights", m.weights_bytes, m.physical_bytes, "of RAM"],
    ["KV of running requests", m.kv_in_use_bytes, m.kv_budget_bytes, "budget (--kv-memory)"],
    ["Prefix cache in RAM", m.cache_bytes, m.cache_budget_bytes, "budget (--cache-memory)"],
    ["Prefix cache on disk", m.cache_disk_bytes, m.cache_disk_budget_bytes, "cap"],
    ["MLX active", m.mlx_active_bytes, m.physical_bytes, "of RAM"],
    ["Process resident", m.process_rss_bytes, m.physical_bytes, "of RAM"],
  ].filter((r) => r[1] !== null && r[1] !== undefined && r[2]);
  const bars = rows.map(([label, value, budget, what]) => {
    const row = document.createElement("div");
    const text = document.createElement("div");
    text.className = "bar-label";
    const name = document.createElement("span");
    name.textContent = label;
    const amount = document.createElement("span");
    amount.textContent = `${fmtBytes(value)} / ${fmtBytes(budget)} ${what}`;
    text.append(name, amount);
    const bar = document.createElement("div");
    bar.className = "bar";
    const fill = document.createElement("div");
    const share = Math.min(value / budget, 1);
    fill.style.width = `${(share * 100).toFixed(1)}%`;
    if (share > 0.85) fill.className = "high";
    bar.appendChild(fill);
    row.append(text, bar);
    return row;
  });
  $("memory-bars").replaceChildren(...bars);
}

// "stock mlx-lm (asked: quantized)" or "CPU fast paths: row-major, ..." (/v1/status weights).
function weightPlan(weights) {
  if (!weights) return "–";
  const paths = Object.values(weights.fast_paths || {});
  const modules = paths.length ? `${weights.modules}: ${paths.join("; ")}` : weights.modules;
  return `${modules} (--dtype ${weights.requested})`;
}

function kvFormat(model) {
  const kv = model.kv_format || {};
  const layers = Object.entries(kv.layers || {}).map(([kind, n]) => `${n} ${kind}`);
  const stored = model.kv_cache || {};
  const quantized = stored.bits ? `${stored.bits}-bit, group ${stored.group_size}` : null;
  const parts = [
    layers.join(", "),
    quantized || kv.dtype,
    kv.bits ? `${kv.bits.join("/")}-bit` : null,
  ];
  const text = parts.filter(Boolean).join(", ");
  return `${text || "–"} (${fmtBytes(model.kv_bytes_per_token)} per token)`;
}

// Draft depth, acceptance per draft position and measured step costs (speculation).
function speculationFacts(spec) {
  if (!spec.mode || spec.mode === "off") return [];
  const depth = spec.draft_depth || {};
  const mean = depth.mean === null || depth.mean === undefined ? "–" : depth.mean;
  const positions = (spec.positions || [])
    .map((p) => {
      const rate = p.acceptance_rate === null ? "–" : `${Math.round(p.acceptance_rate * 100)}%`;
      return `${p.position}: ${rate} of ${fmtInt(p.draft_tokens)}`;
    })
    .join(", ");
  const costs = (spec.step_costs || [])
    .map((c) => {
      const relative = c.width > 1 && c.vs_plain ? ` (${c.vs_plain}x plain)` : "";
      return `${c.rows}x${c.width} ${c.ms} ms${relative}`;
    })
    .join(", ");
  return [
    [
      "draft depth",
      `max ${depth.max}${depth.auto ? " (auto)" : ""}, last ${depth.last}, mean ${mean}`,
    ],
    ["acceptance by position", positions || "–"],
    ["step costs", costs || "–"],
  ];
}

function renderModel(snap) {
  const model = snap.models[0];
  app.model = model.id;
  const spec = model.speculation || {};
  const sampling = Object.entries(model.sampling_defaults || {})
    .filter(([, v]) => v !== null && typeof v !== "object")
    .map(([k, v]) => `${k}=${v}`)
    .join(" ");
  const facts = [
    ["id", model.id],
    ["state", model.state],
    ["source", model.source],
    ["architecture", `${model.architecture}, ${model.dtype}`],
    ["weights", weightPlan(model.weights)],
    ["served window", `${fmtInt(model.context_window)} tokens`],
    ["longest prompt", `${fmtInt(model.max_prompt_tokens)} tokens`],
    ["KV format", kvFormat(model)],
    ["KV room", `${fmtInt(snap.memory.kv_tokens_capacity)} tokens`],
    ["capabilities", model.capabilities.join(", ")],
    ["LoRA adapters", (model.adapters || []).map((a) => a.name).join(", ") || "none"],
    ["tool calls", model.output_parsing.tool_calls],
    ["reasoning", model.output_parsing.reasoning],
    ["speculation", spec.mode || "off"],
    ...speculationFacts(spec),
    ["sampling defaults", sampling || "–"],
  ];
  const nodes = [];
  for (const [term, value] of facts) {
    const dt = document.createElement("dt");
    dt.textContent = term;
    const dd = document.createElement("dd");
    dd.textContent = value;
    nodes.push(dt, dd);
  }
  $("model-facts").replaceChildren(...nodes);
}

function render(snap) {
  renderHeader(snap);
  renderRequests(snap);
  renderCache(snap);
  renderMemory(snap);
  renderModel(snap);
}

function appendLogs(lines) {
  const pre = $("log-lines");
  const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  for (const line of lines) {
    const span = document.createElement("span");
    span.className = line.level;
    const time = new Date(line.time * 1000).toTimeString().slice(0, 8);
    span.textContent = `${time} ${line.level.padEnd(7)} ${line.logger}: ${line.message}\n`;
    pre.appendChild(span);
  }
  while (pre.childNodes.length > 300) pre.removeChild(pre.firstChild);
  if (atBottom) pre.scrollTop = pre.scrollHeight;
}

// ---- polling and the key -----------------------------------------------------------

async function refresh() {
  const [snap, logs] = await Promise.all([
    getJSON("/v1/dashboard"),
    getJSON(`/v1/logs?after=${app.logAfter}`),
  ]);
  render(snap);
  appendLogs(logs.lines);
  app.logAfter = logs.last;
}

async function poll() {
  try {
    await refresh();
    $("load-error").hidden = true;
  } catch (error) {
    if (error instanceof AuthError) {
      askForKey(error.message);
      return;
    }
    $("load-error").hidden = false;
    setText("load-error", `cannot reach the server: ${error.message}`);
  }
  app.timer = setTimeout(poll, POLL_MS);
}

function askForKey(message) {
  clearTimeout(app.timer);
  app.key = "";
  sessionStorage.removeItem(KEY_STORAGE);
  $("main").hidden = true;
  $("key-form").hidden = false;
  setText("key-error", message || "");
  $("key-input").focus();
}

async function openDashboard() {
  try {
    await refresh();
  } catch (error) {
    if (error instanceof AuthError) {
      askForKey(error.message);
      return;
    }
    $("load-error").hidden = false;
    setText("load-error", `cannot reach the server: ${error.message}`);
    app.timer = setTimeout(openDashboard, POLL_MS);
    return;
  }
  $("load-error").hidden = true;
  $("key-form").hidden = true;
  $("main").hidden = false;
  drawRateChart();
  app.timer = setTimeout(poll, POLL_MS);
}

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  app.key = $("key-input").value.trim();
  if (!app.key) return;
  sessionStorage.setItem(KEY_STORAGE, app.key);
  await openDashboard();
});

window.addEventListener("resize", () => drawRateChart());

// Start: with a key required and none given yet, fetch nothing until it is.
if (app.keyRequired && !app.key) askForKey("");
else openDashboard();
