// The page: host and engines (/api/devices), models and live numbers (/api/status, polled), chat.

import { $, apiKey, AuthError, errorText, getJSON, gib, h, headers, ms } from "./api.js";
import { lineChart } from "./chart.js";
import { initChat, setModels } from "./chat.js";

const POLL_MS = 2000;
const points = [];  // the live series, oldest first, as /api/status sends it
let last = null;    // the newest status
let timer = null;
let waitingForKey = false;

function askForKey(message) {
  waitingForKey = true;
  $("#key-form").hidden = false;
  $("#key-msg").textContent = apiKey.get() ? `The key was refused: ${message}` : "";
  $("#summary").textContent = "Enter the API key to see this gateway.";
  $("#key").focus();
}

// --- host and engines -------------------------------------------------------------------------

function renderDevices(d) {
  const host = d.host, cpu = host.cpu, vk = host.vulkan, cu = host.cuda;
  const facts = [
    `Host: ${host.os}, ${cpu.arch}`,
    `CPU: ${cpu.model || "?"}, ${cpu.physical_cores} cores (${cpu.logical_cores} threads), ${gib(cpu.memory_bytes)}, SIMD ${cpu.simd.join(" ") || "–"}`,
    vk.loader ? `Vulkan: loader ${vk.loader} (API ${vk.loader_api_version || "?"})` : "Vulkan: no loader",
    ...vk.drivers.filter((x) => !x.ok).map((x) => `Vulkan driver ${x.library || x.manifest}: ${x.error}${x.remedy ? ` (fix: ${x.remedy})` : ""}`),
    cu.devices.length ? `CUDA: driver ${cu.driver_version || "?"}, CUDA ${cu.cuda_version || "?"}` : `CUDA: ${cu.error || "no device"}`,
    `Metal: ${host.metal.available ? `available: ${host.metal.detail}` : host.metal.reason}`,
    // Each runtime's own lines of `gateway devices` (its details, indented there, stay in the text below).
    ...Object.values(d.runtimes).flat().filter((line) => !/^\s/.test(line)).map((line) => line.replace(/\s{2,}/g, " ")),
  ];
  $("#host").replaceChildren(...facts.map((f) => h("li", {}, f)));

  const rows = [
    ...vk.devices.map((v) => ["Vulkan", v.index, v.name, v.type, gib(v.device_local_bytes),
      `${v.driver_name} ${v.driver_info}`.trim(), `API ${v.api_version}, ${v.vendor}, subgroup ${v.subgroup_size || "–"}, ` +
      `workgroup ${v.max_compute_workgroup_invocations}, shared ${Math.round(v.max_compute_shared_memory_bytes / 1024)} KiB`]),
    ...cu.devices.map((c) => ["CUDA", c.index, c.name, "gpu", gib(c.memory_bytes), cu.driver_version || "", `compute ${c.compute_capability}`]),
    ["CPU", "–", cpu.model || "?", "cpu", gib(cpu.memory_bytes), "", `${cpu.physical_cores} cores, ${cpu.logical_cores} threads`],
  ];
  $("#devices tbody").replaceChildren(...rows.map((r) => h("tr", {}, ...r.map((c) => h("td", {}, c)))));

  $("#plans").replaceChildren(...Object.entries(d.plans).map(([model, p]) => h("div", { class: "plan" },
    h("h3", {}, `Plan for ${model}`),
    p.error ? h("p", { class: "error" }, `none: ${p.error}`) : null,
    h("ol", {}, ...p.candidates.map((c) => h("li", { class: c.serving ? "serving" : "" },
      h("strong", {}, `${c.runtime}/${c.engine}`),
      ` on ${c.device}${c.device_key ? ` [${c.device_key}]` : ""}${c.build ? ` (build ${c.build})` : ""}: `,
      !c.check ? "not checked yet" : c.check.ok ? `check ok${c.check.tok_s ? `, ${Math.round(c.check.tok_s)} tok/s measured` : ""}`
        : h("span", { class: "error" }, `check failed: ${c.check.reason}`),
      c.serving ? h("span", { class: "badge" }, "serving") : null))),
    p.placement ? h("p", { class: "placement" }, `Placement: ${p.placement}`) : null,
    skips(p.skipped.filter((s) => s.kind === "unusable"), "fallback"),
    // Engines this host simply lacks are not news: folded away.
    p.skipped.some((s) => s.kind !== "unusable") ? h("details", {},
      h("summary", {}, `${p.skipped.filter((s) => s.kind !== "unusable").length} engines not available on this host`),
      skips(p.skipped.filter((s) => s.kind !== "unusable"))) : null,
  )));
  $("#devices-text").textContent = d.text;
}

function skips(list, badge) {
  return list.length ? h("ul", { class: "skipped" }, ...list.map((s) =>
    h("li", {}, `${s.what}: ${s.why}`, badge ? h("span", { class: "badge warn" }, badge) : null))) : null;
}

async function loadDevices() {
  try {
    renderDevices(await getJSON("/api/devices"));
  } catch (err) {
    if (err instanceof AuthError) askForKey(err.message);
    else $("#plans").textContent = `Could not read /api/devices: ${err.message}`;
  }
}

// --- models -----------------------------------------------------------------------------------

async function modelAction(id, action, button) {
  button.disabled = true;
  $("#models-msg").textContent = `${action === "load" ? "Loading" : "Unloading"} ${id}…`;
  try {
    const m = await getJSON(`/api/models/${encodeURIComponent(id)}/${action}`, { method: "POST" });
    $("#models-msg").textContent = `${id}: ${m.state.replace("_", " ")}${m.engine ? ` on ${m.engine} (${m.device})` : ""}`;
  } catch (err) {
    if (err instanceof AuthError) askForKey(err.message);
    $("#models-msg").textContent = `${id}: ${err.message}`;
  }
  await poll();
  loadDevices();
}

function parityText(m, s) {
  const excluded = Object.entries(m.excluded).map(([e, why]) => `${e} excluded: ${why}`);
  const drift = m.parity.map((p) => p.drifted ? `${p.engine} drifts: ${p.reason}` : `${p.engine} ok (${p.scored} scored)`);
  const all = [...excluded, ...drift];
  return all.length ? all.join("; ") : (s.parity_reference ? "no samples yet" : "off");
}

let shownModels = "";

function renderModels(s) {
  const key = JSON.stringify([s.models, s.default_model, s.parity_reference]);
  if (key !== shownModels) {
    shownModels = key;
    // Rebuilt only when something changed, keeping keyboard focus on the same row's button.
    const focused = document.activeElement?.closest("#models tr")?.dataset.model;
    $("#models tbody").replaceChildren(...s.models.map((m) => modelRow(m, s)));
    if (focused) document.querySelector(`#models tr[data-model="${CSS.escape(focused)}"] button`)?.focus();
  }
  setModels(s.models, s.default_model);
  const def = s.models.find((m) => m.id === s.default_model);
  $("#summary").textContent = (s.draining ? "Draining: finishing running requests. " : "") + (def?.engine
    ? `${def.id} is served by ${def.engine} on ${def.device}${def.fallback_reason ? " (fell back)" : ""}.`
    : `${s.default_model}: ${def ? def.state.replace("_", " ") : "unknown"}.`) + ` Up ${Math.round(s.uptime_s)} s.`;
}

const mib = (bytes) => `${Math.round(bytes / 1048576)} MiB`;

function renderMemory(s) {
  const parts = Object.entries(s.memory).map(([dev, m]) =>
    `${dev === "cpu" ? "RAM" : dev}: ${mib(m.used_bytes)} of ${mib(m.budget_bytes)} budget`);
  $("#memory-budget").textContent = parts.length ? `Memory held by models: ${parts.join("; ")}.` : "";
  $("#pulls").replaceChildren(...s.pulls.map((p) => {
    const pct = p.total ? Math.floor((100 * p.completed) / p.total) : 0;
    const what = p.status === "failed" ? `failed: ${p.error}` : p.status === "done" ? `done: ${p.model}`
      : `${p.status} ${p.file || ""}`;
    return h("li", { "data-pull": p.name }, `${p.name}: ${what} `,
      p.total ? h("progress", { max: 100, value: pct, "aria-label": `${p.name} ${pct}%` }) : null,
      p.total ? ` ${mib(p.completed)} / ${mib(p.total)}` : "");
  }));
}

async function startPull(ev) {
  ev.preventDefault();
  const name = $("#pull-name").value.trim();
  if (!name) return;
  $("#models-msg").textContent = `Pulling ${name}…`;
  try {
    // Ollama's pull, not streamed: the progress shows in the list below (polled with the status).
    const res = fetch("/api/pull", { method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ model: name, stream: false }) });
    await poll();
    const done = await res;
    $("#models-msg").textContent = done.ok ? `${name}: pulled` : `${name}: ${await errorText(done)}`;
  } catch (err) {
    $("#models-msg").textContent = `${name}: ${err.message}`;
  }
  await poll();
}

// Its family's format, and what its last `gateway check` found (the probes not ok in the title).
function formatLine(m) {
  const parts = [];
  if (m.tool_format) parts.push(`format ${m.tool_format}`);
  if (m.check) parts.push(`check ${m.check}`);
  if (!parts.length) return null;
  return h("div", { class: "small model-format", title: m.check_failed.join("\n") }, parts.join(" · "));
}

function modelRow(m, s) {
  const busy = m.state === "loading";
  const action = m.state === "loaded" ? "unload" : "load";
  const why = m.fallback_reason || m.error;
  return h("tr", { "data-model": m.id, "data-state": m.state },
    h("th", { scope: "row", title: m.description }, m.id, m.id === s.default_model ? h("span", { class: "badge" }, "default") : null,
      formatLine(m)),
    h("td", {}, m.available ? "present" : "not downloaded"),
    h("td", {}, m.state.replace("_", " "), why ? h("div", { class: m.error ? "error small" : "warn small" }, why) : null),
    h("td", { class: "engine" }, m.engine || "–"),
    h("td", {}, m.device ? `${m.device}${m.placement ? ` (${m.placement})` : ""}` : "–"),
    h("td", { class: "num", title: m.memory_detail || "" }, m.memory_bytes != null ? mib(m.memory_bytes) : "–",
      m.expires_in_s != null ? h("div", { class: "small" }, `unloads in ${Math.round(m.expires_in_s)} s idle`) : null),
    h("td", { class: "num" }, m.running),
    h("td", { class: "num" }, m.waiting),
    h("td", { class: "small" }, parityText(m, s)),
    h("td", {}, h("button", { type: "button", disabled: busy, "aria-label": `${action} ${m.id}`,
      onclick: (ev) => modelAction(m.id, action, ev.currentTarget) }, action === "load" ? "Load" : "Unload")));
}

// --- live performance -------------------------------------------------------------------------

function renderLive(s) {
  const live = s.live, p = points.at(-1), slo = live.slo;
  $("#live-note").textContent = `All models together: percentiles over the last ${live.window_s} s, tokens/s over ` +
    `${live.rate_window_s} s; dashed lines are the SLOs (TTFT p95 ${ms(slo.ttft_s)}, ${ms(slo.tpot_s)} per token).`;
  const cards = [
    ["TTFT p50 / p95", `${ms(p.ttft_p50_s)} / ${ms(p.ttft_p95_s)}`],
    ["Inter-token p50 / p95", `${ms(p.itl_p50_s)} / ${ms(p.itl_p95_s)}`],
    ["Tokens/s", p.tokens_per_s.toFixed(1)],
    ["Running / waiting", `${p.running} / ${p.waiting}`],
    [`429s (last ${live.window_s} s / total)`, `${p.rejected_429} / ${live.totals.rejected_429}`],
    ["Requests / tokens (total)", `${live.totals.requests} / ${live.totals.generation_tokens}`],
  ];
  $("#cards").replaceChildren(...cards.map(([k, v]) => h("div", {}, h("dt", {}, k), h("dd", {}, v))));

  const span = Number($("#span").value);
  const now = s.time;
  const series = (key) => points.map((q) => [q.t, q[key]]);
  lineChart($("#chart-ttft"), { now, span, format: ms, threshold: { value: slo.ttft_s, label: `SLO p95 ${ms(slo.ttft_s)}` },
    series: [{ name: "p50", cls: "s1", points: series("ttft_p50_s") }, { name: "p95", cls: "s2", points: series("ttft_p95_s") }] });
  lineChart($("#chart-itl"), { now, span, format: ms, threshold: { value: slo.tpot_s, label: `SLO ${ms(slo.tpot_s)}/token` },
    series: [{ name: "p50", cls: "s1", points: series("itl_p50_s") }, { name: "p95", cls: "s2", points: series("itl_p95_s") }] });
  lineChart($("#chart-tps"), { now, span, format: (v) => v.toFixed(v < 10 ? 1 : 0), threshold: null, floor: 10,
    series: [{ name: "tokens/s", cls: "s1", points: series("tokens_per_s") }] });
  lineChart($("#chart-queue"), { now, span, format: (v) => v.toFixed(v < 10 && v % 1 ? 1 : 0), threshold: null, floor: 2,
    series: [{ name: "running", cls: "s1", points: series("running") }, { name: "waiting", cls: "s2", points: series("waiting") },
             { name: "429s", cls: "s3", points: series("rejected_429") }] });
}

// --- polling ----------------------------------------------------------------------------------

async function poll() {
  if (waitingForKey) return;
  try {
    const since = points.length ? `?since=${points.at(-1).t}` : "";
    const s = await getJSON(`/api/status${since}`);
    last = s;
    points.push(...s.live.points);
    while (points.length && points[0].t < s.time - s.live.history_s) points.shift();
    renderModels(s);
    renderMemory(s);
    if (points.length) renderLive(s);
  } catch (err) {
    if (err instanceof AuthError) askForKey(err.message);
    else $("#summary").textContent = `The gateway does not answer: ${err.message}`;
  }
}

function schedule() {
  clearInterval(timer);
  timer = null;
  // A hidden tab does not poll.
  if (document.visibilityState === "visible") timer = setInterval(poll, POLL_MS);
}

function start() {
  waitingForKey = false;
  $("#forget-key").hidden = !apiKey.get();
  poll();
  loadDevices();
  schedule();
}

$("#key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  apiKey.set($("#key").value.trim());
  $("#key").value = "";
  $("#key-form").hidden = true;
  start();
});
$("#forget-key").addEventListener("click", () => { apiKey.clear(); location.reload(); });
$("#refresh-devices").addEventListener("click", loadDevices);
$("#pull-form").addEventListener("submit", startPull);
$("#span").addEventListener("change", () => { if (last && points.length) renderLive(last); });
document.addEventListener("visibilitychange", () => { if (document.visibilityState === "visible") poll(); schedule(); });
initChat(askForKey);
start();
