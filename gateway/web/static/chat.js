// The chat box: streams /v1/chat/completions into the page; Stop aborts the fetch, and the gateway
// ends the generation when its client disconnects.

import { $, AuthError, errorText, h, headers, ms } from "./api.js";

const history = [];
let controller = null;
let seeing = new Set();  // models that take images

// The attached image as a data: URL (read by the browser), or null.
function attached() {
  const file = $("#image").files?.[0];
  if (!file) return Promise.resolve(null);
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(`could not read ${file.name}`));
    reader.readAsDataURL(file);
  });
}

// The image control follows the model picked: enabled for a model that takes images.
function syncImage() {
  const input = $("#image");
  const ok = seeing.has($("#model").value);
  input.disabled = !ok;
  if (!ok) input.value = "";
  $("#image-note").textContent = ok ? "" : "this model takes no images";
}

function setBusy(busy) {
  $("#send").disabled = busy;
  $("#stop").disabled = !busy;
  $("#log").setAttribute("aria-busy", String(busy));
}

// Yields each SSE `data:` payload of a fetch Response.
async function* events(res) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl).replace(/\r$/, "");
      buf = buf.slice(nl + 1);
      if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

async function send(onAuth) {
  const prompt = $("#prompt");
  const text = prompt.value.trim();
  if (!text || controller) return;
  const model = $("#model").value;
  let image = null;
  try {
    image = await attached();
  } catch (err) {
    $("#chat-msg").textContent = err.message;
    return;
  }
  // With an image, the turn is OpenAI's content parts; the history keeps it, so a follow-up is about it.
  history.push({ role: "user", content: image ? [{ type: "text", text }, { type: "image_url", image_url: { url: image } }] : text });
  prompt.value = "";
  $("#image").value = "";
  const log = $("#log");
  const shown = image ? [h("img", { class: "attached", src: image, alt: "the attached image" })] : [];
  log.append(h("div", { class: "msg user" }, h("span", { class: "who" }, "You"), h("p", {}, text), ...shown));
  const body = h("p", { class: "reply" });
  const stats = h("p", { class: "stats", role: "status" }, "waiting for the first token…");
  log.append(h("div", { class: "msg assistant" }, h("span", { class: "who" }, model), body, stats));
  log.scrollTop = log.scrollHeight;

  controller = new AbortController();
  setBusy(true);
  const t0 = performance.now();
  let first = null, last = null, chunks = 0, usage = null, served = "", reply = "", ending = "";
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      signal: controller.signal,
      body: JSON.stringify({
        model, messages: history, stream: true, stream_options: { include_usage: true },
        temperature: Number($("#temperature").value), max_tokens: Number($("#max-tokens").value),
      }),
    });
    if (res.status === 401) throw new AuthError(await errorText(res));
    if (!res.ok) throw new Error(await errorText(res));
    // Sent with the first token: which engine and device serve this reply.
    served = `${res.headers.get("X-Engine") || "?"} on ${res.headers.get("X-Device") || "?"}`;
    const fallback = res.headers.get("X-Fallback-Reason");
    if (fallback) served += ` (fallback: ${fallback})`;
    for await (const data of events(res)) {
      if (data === "[DONE]") break;
      const frame = JSON.parse(data);
      if (frame.error) throw new Error(frame.error.message);
      if (frame.usage) usage = frame.usage;
      const choice = frame.choices?.[0];
      if (choice?.finish_reason) ending = choice.finish_reason;
      const delta = choice?.delta?.content;
      if (delta) {
        const now = performance.now();
        first ??= now;
        last = now;
        chunks += 1;
        reply += delta;
        body.textContent = reply;
        log.scrollTop = log.scrollHeight;
        stats.textContent = `streaming… ${chunks} tokens · ${served}`;
      }
    }
  } catch (err) {
    if (err.name === "AbortError") ending = "stopped";
    else {
      ending = "error";
      body.append(h("span", { class: "error" }, reply ? ` [${err.message}]` : err.message));
      if (err instanceof AuthError) onAuth(err.message);
    }
  } finally {
    controller = null;
    setBusy(false);
  }
  if (reply) history.push({ role: "assistant", content: reply });
  else history.pop();  // nothing came back: the turn is not part of the conversation
  const tokens = usage ? usage.completion_tokens : chunks;
  const rate = first !== null && tokens > 1 && last > first ? (tokens - 1) / ((last - first) / 1000) : null;
  const parts = [
    `TTFT ${first === null ? "–" : ms((first - t0) / 1000)}`,
    `${rate === null ? "–" : rate.toFixed(1)} tok/s`,
    `${tokens} tokens`,
    served || "no engine answered",
    ending && `ended: ${ending}`,
  ];
  stats.textContent = parts.filter(Boolean).join(" · ");
  stats.dataset.ending = ending;
  $("#chat-msg").textContent = ending === "stopped" ? "Generation stopped." : "";
  prompt.focus();
}

export function initChat(onAuth) {
  const form = $("#chat-form");
  form.addEventListener("submit", (ev) => { ev.preventDefault(); send(onAuth); });
  $("#prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      form.requestSubmit();
    }
  });
  $("#stop").addEventListener("click", () => controller?.abort());
  $("#model").addEventListener("change", syncImage);
  $("#clear").addEventListener("click", () => {
    controller?.abort();
    history.length = 0;
    $("#log").replaceChildren();
  });
}

// Chat-capable models in the picker, the default one selected.
export function setModels(models, preferred) {
  const select = $("#model");
  const keep = select.value || preferred;
  const ids = models.filter((m) => m.endpoints.includes("chat.completions")).map((m) => m.id);
  seeing = new Set(models.filter((m) => m.images).map((m) => m.id));
  if (ids.join("\n") !== [...select.options].map((o) => o.value).join("\n")) {
    select.replaceChildren(...ids.map((id) => h("option", { value: id, selected: id === keep }, id)));
  }
  syncImage();
}
