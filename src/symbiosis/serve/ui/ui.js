// The tenant's page: logs in with the tenant's API key (kept in this tab's sessionStorage only), reads
// /v1/dashboard every 2 s and draws SVG plots. Every value from the server is set as text, never as markup.
"use strict";
const COLOURS = ["#3366cc", "#dc3912", "#ff9900", "#109618", "#990099"];
const SVG = "http://www.w3.org/2000/svg";
const history = [];  // successive readings of the engine and executor counters (the last 150: 5 minutes)
let timer = null;

function el(tag, attributes, parent) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attributes)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function legend(container, names) {
  const box = document.createElement("div");
  box.className = "legend";
  names.forEach((name, i) => {
    const item = document.createElement("span");
    item.style.setProperty("--colour", COLOURS[i % COLOURS.length]);
    item.textContent = name;
    box.appendChild(item);
  });
  container.appendChild(box);
}

// lines: [{name, values: [number | null]}], drawn over the same x range, one SVG unit per pixel
function lineChart(container, lines) {
  container.replaceChildren();
  const width = Math.max(300, container.clientWidth || 600), height = 160, pad = 36;
  const svg = el("svg", {viewBox: `0 0 ${width} ${height}`, role: "img"}, container);
  const all = lines.flatMap(l => l.values.filter(v => v !== null));
  const top = (Math.max(0, ...all) || 1) * 1.1;
  el("line", {x1: pad, y1: height - 12, x2: width, y2: height - 12, stroke: "#999"}, svg);
  el("text", {x: 2, y: 12, "font-size": 10, fill: "#667"}, svg).textContent = top.toPrecision(2);
  el("text", {x: 2, y: height - 12, "font-size": 10, fill: "#667"}, svg).textContent = "0";
  lines.forEach((line, i) => {
    const n = line.values.length, points = [], colour = COLOURS[i % COLOURS.length];
    line.values.forEach((v, j) => {
      if (v === null) return;
      const x = pad + (width - pad - 4) * (n > 1 ? j / (n - 1) : 1), y = height - 12 - (height - 24) * v / top;
      points.push(`${x.toFixed(1)},${y.toFixed(1)}`);
      if (v > 0) el("circle", {cx: x.toFixed(1), cy: y.toFixed(1), r: 2.5, fill: colour}, svg);
    });
    el("polyline", {points: points.join(" "), fill: "none", stroke: colour, "stroke-width": 2,
                    "data-series": line.name}, svg);
  });
  legend(container, lines.map(l => l.name));
}

// bars: [{name, value, tokens}] as rows of HTML (a label, a bar as long as the value, the figures)
function barChart(container, bars) {
  container.replaceChildren();
  const top = Math.max(1, ...bars.map(b => b.value));
  bars.forEach((bar, i) => {
    const row = document.createElement("div"), label = document.createElement("span");
    const fill = document.createElement("span"), figures = document.createElement("span");
    row.className = "bar";
    label.textContent = bar.name;
    fill.className = "fill";
    fill.dataset.model = bar.name;
    fill.style.width = `${Math.max(0.5, 60 * bar.value / top)}%`;
    fill.style.background = COLOURS[i % COLOURS.length];
    figures.textContent = `${bar.value} requests, ${bar.tokens} tokens`;
    row.append(label, fill, figures);
    container.appendChild(row);
  });
}

async function refresh() {
  const key = sessionStorage.getItem("symbiosis-key");
  const response = await fetch("/v1/dashboard", {headers: {Authorization: `Bearer ${key}`}});
  if (response.status === 401) { logout("That key is not valid."); return; }
  if (!response.ok) { document.getElementById("status").textContent = `The server answered ${response.status}.`; return; }
  const data = await response.json();
  document.getElementById("who").textContent = `tenant ${data.tenant}`;
  const models = [{name: `${data.base.name} (base)`, value: data.base.requests, tokens: data.base.completion_tokens}]
    .concat(data.adapters.map(a => ({name: a.name, value: a.requests, tokens: a.completion_tokens})));
  barChart(document.getElementById("models"), models);
  const s = data.series, per = v => v / s.bucket_s;
  lineChart(document.getElementById("rate"), [{name: "requests/s", values: s.requests.map(per)}]);
  lineChart(document.getElementById("tokens"), [{name: "tokens/s", values: s.tokens.map(per)}]);
  lineChart(document.getElementById("latency"), [{name: "first token", values: s.ttft_p50_s},
                                                 {name: "whole request", values: s.e2e_p50_s}]);
  history.push({time: data.time, engine: data.engine, executor: data.executor});
  if (history.length > 150) history.shift();
  lineChart(document.getElementById("engine"), [
    {name: "running", values: history.map(h => h.engine.running)},
    {name: "waiting", values: history.map(h => h.engine.waiting)},
    {name: "KV cache %", values: history.map(h => 100 * h.engine.kv_cache_usage)}]);
  const rates = history.slice(1).map((h, i) => {
    const before = history[i], dt = Math.max(1e-3, h.time - before.time);
    const batches = h.executor.batches - before.executor.batches, calls = h.executor.calls - before.executor.calls;
    return {batches: batches / dt, size: batches > 0 ? calls / batches : null,
            steps: (h.engine.steps - before.engine.steps) / dt};
  });
  lineChart(document.getElementById("executor"), [{name: "executor batches/s", values: rates.map(r => r.batches)},
                                                  {name: "calls per batch", values: rates.map(r => r.size)},
                                                  {name: "engine steps/s", values: rates.map(r => r.steps)}]);
  await refreshJobs();
  document.getElementById("status").textContent = `updated ${new Date(data.time * 1000).toLocaleTimeString()}`;
}

// Fine-tuning jobs: a row each (click: its loss curves, events and checkpoints); a cancel button while it is active
let selectedJob = null;
const ACTIVE = ["validating_files", "queued", "running", "paused"];

async function api(path, options) {
  const key = sessionStorage.getItem("symbiosis-key");
  return fetch(path, Object.assign({headers: {Authorization: `Bearer ${key}`}}, options || {}));
}

async function refreshJobs() {
  const response = await api("/v1/fine_tuning/jobs?limit=20");
  const section = document.getElementById("jobs-section");
  if (!response.ok) { section.hidden = true; return; }  // a service without fine-tuning
  section.hidden = false;
  const jobs = (await response.json()).data, body = document.querySelector("#jobs tbody");
  body.replaceChildren();
  for (const job of jobs) {
    const row = document.createElement("tr");
    row.className = "job" + (job.id === selectedJob ? " selected" : "");
    row.dataset.job = job.id;
    for (const text of [job.id, job.status, `${job.last_step || 0}/${job.total_steps || "?"}`, job.fine_tuned_model || ""]) {
      const cell = document.createElement("td");
      cell.textContent = text;
      row.appendChild(cell);
    }
    const cell = document.createElement("td");
    if (ACTIVE.includes(job.status)) {
      const cancel = document.createElement("button");
      cancel.textContent = "cancel";
      cancel.className = "cancel";
      cancel.addEventListener("click", async event => {
        event.stopPropagation();
        await api(`/v1/fine_tuning/jobs/${encodeURIComponent(job.id)}/cancel`, {method: "POST"});
        refreshJobs();
      });
      cell.appendChild(cancel);
    }
    row.appendChild(cell);
    row.addEventListener("click", () => { selectedJob = job.id; refreshJobs(); });
    body.appendChild(row);
  }
  if (selectedJob) await showJob(selectedJob);
}

async function showJob(id) {
  const [events, checkpoints] = await Promise.all([
    api(`/v1/fine_tuning/jobs/${encodeURIComponent(id)}/events?limit=100`).then(r => r.json()),
    api(`/v1/fine_tuning/jobs/${encodeURIComponent(id)}/checkpoints?limit=100`).then(r => r.json())]);
  document.getElementById("job").hidden = false;
  document.getElementById("job-title").textContent = `${id}: loss per step (training; validation at checkpoints)`;
  const steps = events.data.filter(e => e.type === "metrics" && e.data && e.data.total_steps).reverse();
  const last = steps.length ? steps[steps.length - 1].data.step : 0;
  const train = Array(last).fill(null), valid = Array(last).fill(null);
  for (const e of steps) train[e.data.step - 1] = e.data.train_loss;
  for (const c of checkpoints.data) if (c.metrics.valid_loss !== undefined && c.step_number <= last) valid[c.step_number - 1] = c.metrics.valid_loss;
  lineChart(document.getElementById("losses"), [{name: "training loss", values: train},
                                                {name: "validation loss", values: valid}]);
  const list = (id, items) => {
    const node = document.getElementById(id);
    node.replaceChildren(...items.map(text => { const li = document.createElement("li"); li.textContent = text; return li; }));
  };
  list("events", events.data.map(e => `${new Date(e.created_at * 1000).toLocaleTimeString()} ${e.message}`));
  list("checkpoints", checkpoints.data.map(c => `step ${c.step_number}: ${c.fine_tuned_model_checkpoint}`));
}

function show(loggedIn) {
  document.getElementById("login").hidden = loggedIn;
  document.getElementById("board").hidden = !loggedIn;
  document.getElementById("logout").hidden = !loggedIn;
}

function logout(message) {
  sessionStorage.removeItem("symbiosis-key");
  clearInterval(timer);
  history.length = 0;
  selectedJob = null;
  document.getElementById("job").hidden = true;
  document.getElementById("who").textContent = "";
  document.getElementById("login-error").textContent = message || "";
  show(false);
}

function start() {
  show(true);
  refresh();
  timer = setInterval(refresh, 2000);
}

document.getElementById("login").addEventListener("submit", event => {
  event.preventDefault();
  sessionStorage.setItem("symbiosis-key", document.getElementById("key").value.trim());
  document.getElementById("key").value = "";
  start();
});
document.getElementById("logout").addEventListener("click", () => logout(""));
if (sessionStorage.getItem("symbiosis-key")) start();
