// @ts-check
// api.js — owns talking to the gateway: the bearer token, JSON requests, typed failures (so
// every view can say *why* it is empty) and reading an SSE response body as events.

/** The sessionStorage key of the token (per tab, gone when the tab closes). */
const TOKEN_KEY = "turnstile-token";

/**
 * Why a request failed: no valid token, the gateway cannot be reached, or an API error.
 * @typedef {{ kind: "unauthorized" | "unreachable" | "http", status: number, code: string, message: string }} Failure
 */

export class ApiFailure extends Error {
  /** @param {Failure} failure */
  constructor(failure) {
    super(failure.message);
    /** @type {Failure} */
    this.failure = failure;
  }
}

/** @returns {string} */
export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

/** @param {string} value */
export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

/** @returns {Record<string, string>} */
function headers() {
  /** @type {Record<string, string>} */
  const out = { "content-type": "application/json" };
  const value = token();
  if (value) out.authorization = "Bearer " + value;
  return out;
}

/**
 * A request with the token; a failure of any kind becomes an {@link ApiFailure}.
 * @param {string} path
 * @param {{ method?: string, body?: string, signal?: AbortSignal }} [options]
 * @returns {Promise<Response>}
 */
export async function request(path, options = {}) {
  let response;
  try {
    response = await fetch(path, { method: options.method || "GET", body: options.body, signal: options.signal, headers: headers() });
  } catch (error) {
    if (error instanceof DOMException && error.name === "AbortError") throw error;
    throw new ApiFailure({ kind: "unreachable", status: 0, code: "unreachable", message: `cannot reach the gateway at ${location.origin}` });
  }
  if (!response.ok) {
    const text = await response.text();
    /** @type {{ error?: { code?: string, message?: string } }} */
    let body = {};
    try { body = JSON.parse(text); } catch { /* not JSON: keep the status line */ }
    const code = body.error?.code || "http_" + response.status;
    throw new ApiFailure({
      kind: response.status === 401 ? "unauthorized" : "http",
      status: response.status,
      code,
      message: body.error?.message || response.statusText || code,
    });
  }
  return response;
}

/**
 * GET (or POST) JSON.
 * @param {string} path
 * @param {{ method?: string, body?: string, signal?: AbortSignal }} [options]
 * @returns {Promise<any>}
 */
export async function json(path, options = {}) {
  const response = await request(path, options);
  return response.json();
}

/**
 * GET text exactly as sent (no JSON parse: big integers stay digits).
 * @param {string} path
 * @returns {Promise<string>}
 */
export async function text(path) {
  return (await request(path)).text();
}

/** Longest SSE frame accepted (a dispatch event carries at most one committed turn). */
const FRAME_CHARS_MAX = 8 * 1024 * 1024;

/**
 * Read an SSE body, calling `onEvent(name, data)` per frame, until it ends or `signal` aborts.
 * @param {Response} response
 * @param {(name: string, data: any) => void} onEvent
 * @param {AbortSignal} [signal]
 */
export async function readEvents(response, onEvent, signal) {
  if (!response.body) return;
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const stop = () => { reader.cancel().catch(() => {}); };
  signal?.addEventListener("abort", stop, { once: true });
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done || signal?.aborted) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let name = "message", data = "";
        for (const line of frame.split("\n")) {
          if (line.startsWith("event: ")) name = line.slice(7);
          else if (line.startsWith("data: ")) data += line.slice(6);
        }
        if (data) onEvent(name, JSON.parse(data));
      }
      if (buffer.length > FRAME_CHARS_MAX) throw new Error("an event is larger than the console accepts");
    }
  } finally {
    signal?.removeEventListener("abort", stop);
  }
}

/**
 * A failure in words a person can act on.
 * @param {unknown} error
 * @returns {string}
 */
export function describe(error) {
  if (error instanceof ApiFailure) {
    const failure = error.failure;
    if (failure.kind === "unauthorized") return "This gateway needs a tenant token: enter yours under “Token” above.";
    if (failure.kind === "unreachable") return `The gateway cannot be reached (${location.origin}); it will be retried.`;
    return `${failure.message} (${failure.code}, HTTP ${failure.status})`;
  }
  return error instanceof Error ? error.message : String(error);
}
