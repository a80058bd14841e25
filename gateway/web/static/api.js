// Requests to the gateway with the API key, when one is needed, and small DOM helpers.

const KEY = "llm-gateway-api-key";

export class AuthError extends Error {}

export const apiKey = {
  get: () => sessionStorage.getItem(KEY) || "",
  set: (key) => sessionStorage.setItem(KEY, key),
  clear: () => sessionStorage.removeItem(KEY),
};

export function headers(extra = {}) {
  const key = apiKey.get();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// The OpenAI envelope's message, or the status line.
export async function errorText(res) {
  try {
    const body = await res.json();
    // OpenAI's envelope has error.message; Ollama's routes (/api/pull) answer {"error": "..."}.
    return body?.error?.message || (typeof body?.error === "string" ? body.error : "") || `HTTP ${res.status}`;
  } catch {
    return `HTTP ${res.status}`;
  }
}

// fetch() of JSON; a 401 throws AuthError (the page then asks for the key), other errors Error.
export async function getJSON(path, init = {}) {
  const res = await fetch(path, { ...init, headers: headers(init.headers) });
  if (res.status === 401) throw new AuthError(await errorText(res));
  if (!res.ok) throw new Error(await errorText(res));
  return res.json();
}

// h("td", {class: "x"}, "text", child): elements built with textContent only, never innerHTML.
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === false || v === null || v === undefined) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export const $ = (sel) => document.querySelector(sel);

export function ms(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds === 0) return "0";
  return seconds < 1 ? `${(seconds * 1000).toFixed(seconds < 0.01 ? 1 : 0)} ms` : `${seconds.toFixed(2)} s`;
}

export function gib(bytes) {
  return bytes ? `${(bytes / 2 ** 30).toFixed(1)} GiB` : "–";
}
