// The dashboard: polls /stats while its view is open, shows the numbers, charts them
// and lists the engine's configuration.
import {getJSON} from "./api.js";
import {LineChart, number} from "./chart.js";

const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);

let polling = null;  // the running poll loop's token; null: not polling
let previous = null;  // the last poll's stats: counters become rates between two polls
let charts = null;
let shownConfig = "";

const ms = (s) => (s == null ? "-" : s < 0.01 ? `${(s * 1000).toFixed(2)} ms`
                                    : `${(s * 1000).toFixed(0)} ms`);
const rate = (v) => (v == null ? "-" : v < 10 ? v.toFixed(1) : v.toFixed(0));

function makeCharts() {
  const css = getComputedStyle(document.documentElement);
  const color = (n) => css.getPropertyValue(`--series-${n}`).trim();
  const msAxis = (v) => `${number(v * 1000)} ms`;
  return {
    requests: new LineChart($("chart-requests"),
      [{label: "running", color: color(1)}, {label: "waiting", color: color(2)}]),
    kv: new LineChart($("chart-kv"), [{label: "used", color: color(1)}],
      {max: 100, format: (v) => `${v.toFixed(0)} %`}),
    throughput: new LineChart($("chart-throughput"),
      [{label: "prompt", color: color(2)}, {label: "generation", color: color(1)}]),
    latency: new LineChart($("chart-latency"),
      [{label: "TTFT p50", color: color(1)}, {label: "TTFT p99", color: color(2)},
       {label: "ITL p50", color: color(3)}, {label: "ITL p99", color: color(4)}],
      {format: msAxis}),
  };
}

function show(stats) {
  const {requests, kv_cache: kv, latency, config} = stats;
  let promptRate = null, genRate = null;
  if (previous && stats.uptime_s > previous.uptime_s) {
    const dt = stats.uptime_s - previous.uptime_s;
    promptRate = (stats.tokens.prompt_total - previous.tokens.prompt_total) / dt;
    genRate = (stats.tokens.generation_total - previous.tokens.generation_total) / dt;
  }
  previous = stats;
  const blocks = config.num_kv_blocks ? ` (${kv.used_blocks} of ${config.num_kv_blocks} blocks)` : "";
  $("v-running").textContent = requests.running;
  $("v-waiting").textContent = requests.waiting;
  $("v-kv").textContent = `${(kv.usage * 100).toFixed(1)} %${blocks}`;
  $("v-prompt-tps").textContent = rate(promptRate);
  $("v-gen-tps").textContent = rate(genRate);
  const pcts = (l) => (l.count ? `${ms(l.p50)} / ${ms(l.p90)} / ${ms(l.p99)}` : "-");
  $("v-ttft").textContent = pcts(latency.ttft);
  $("v-itl").textContent = pcts(latency.itl);
  $("v-done").textContent = `${requests.finished_total} / ${requests.aborted_total}`;

  const t = stats.uptime_s;
  charts.requests.push(t, [requests.running, requests.waiting]);
  charts.kv.push(t, [kv.usage * 100]);
  charts.throughput.push(t, [promptRate, genRate]);
  charts.latency.push(t, [latency.ttft.p50, latency.ttft.p99, latency.itl.p50, latency.itl.p99]);
  showConfig(config);
}

const onOff = (v) => (v ? "on" : "off");

function showConfig(config) {
  const key = JSON.stringify(config);
  if (key === shownConfig) return;
  shownConfig = key;
  const spec = config.speculative;
  const rows = [
    ["Model", config.model],
    ["Path", config.model_path],
    ["dtype", config.dtype],
    ["Device", config.device],
    ["Kernels", config.kernels],
    ["Max model length", config.max_model_len],
    ["Block size", config.block_size],
    ["KV blocks", config.num_kv_blocks],
    ["max_num_seqs", config.max_num_seqs],
    ["max_num_batched_tokens", config.max_num_batched_tokens],
    ["Chunked prefill", config.chunked_prefill === undefined ? undefined : onOff(config.chunked_prefill)],
    ["Prefix caching", config.prefix_caching === undefined ? undefined : onOff(config.prefix_caching)],
    ["Speculation", spec ? `${spec.method}, ${spec.num_speculative_tokens} tokens per step` +
                          (spec.model ? `, drafter ${spec.model}` : "") : spec === null ? "off" : undefined],
    ["External KV stores", config.kv_stores ? config.kv_stores.join(", ") : undefined],
    ["Async scheduling", config.async_scheduling === undefined ? undefined : onOff(config.async_scheduling)],
  ];
  const dl = $("config");
  dl.replaceChildren();
  for (const [name, value] of rows) {
    if (value === undefined || value === null) continue;
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = name;
    dd.textContent = String(value);
    dl.append(dt, dd);
  }
}

async function poll() {
  try {
    const stats = await getJSON("stats");
    $("stats-error").hidden = true;
    show(stats);
  } catch (e) {
    $("stats-error").textContent = `Could not read the server's stats: ${e.message}`;
    $("stats-error").hidden = false;
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function pollLoop(run) {
  while (run === polling) {  // a later start or a stop ends this loop
    await poll();
    await sleep(POLL_MS);
  }
}

export function startDashboard() {
  if (polling) return;
  charts = charts || makeCharts();
  previous = null;  // a rate across a pause in polling would be an average: start afresh
  polling = {};
  pollLoop(polling);
}

export function stopDashboard() {
  polling = null;
}

window.addEventListener("resize", () => {
  if (charts) Object.values(charts).forEach((chart) => chart.draw());
});
