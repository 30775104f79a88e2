// @ts-check
// inspect.js — owns the dispatch inspector: the manifest, the attempts as a timeline with the
// reason each attempt ended, and the exact request bytes as sent (raw text, a copy button, and
// their SHA-256 computed in the browser and checked against the manifest's request_digest).

import { describe, json } from "./api.js";
import { clock, el } from "./dom.js";

/**
 * @typedef {{ state: string, at: number }} Step
 * @typedef {{ generation: number, state: string, handle: string | null, history: Step[], end_reason?: string | null,
 *             provider?: string, model?: string, adapter?: string, target?: number, manifest_digest?: string }} Attempt
 * @typedef {{ position: number, provider: string, model: string, adapter: string, manifest_digest: string,
 *             request_digest: string, request_body?: string }} Target
 * @typedef {{ operation_id: string, state: string, manifest: Record<string, any>, request_digest: string,
 *             request_body: string, attempts: Attempt[], targets?: Target[] }} DispatchDocument
 */

/** Why an attempt ended, in words (the code is shown beside it). */
const END_REASONS = /** @type {Record<string, string>} */ ({
  committed: "its turn was committed",
  stream_cut: "the provider's stream was cut",
  cut_stream: "the provider's stream was cut",
  ended_without_stop: "the stream ended without a stop event",
  provider_unreachable: "the provider could not be reached",
  provider_status_408: "the provider timed the request out (408)",
  provider_status_429: "the provider was rate limiting (429)",
  provider_status_503: "the provider was unavailable (503)",
  lease_expired: "its lease ran out",
  resume_refused: "the provider refused to resume it",
  provider_status: "the provider answered an error status",
  head_timeout: "no response head arrived in time",
  idle_timeout: "the stream went idle too long",
  attempt_timeout: "the attempt ran out of time",
  cancelled: "it was cancelled",
  revision_lost: "another turn took the revision",
  malformed_stream: "the stream was malformed",
});

/** @param {string} reason */
export function endReasonText(reason) {
  return `${END_REASONS[reason] || reason.replaceAll("_", " ")} (${reason})`;
}

/**
 * `sha256:<hex>` of the UTF-8 bytes of `text`, or null where the browser has no SubtleCrypto
 * (plain http on a host other than localhost).
 * @param {string} text
 * @returns {Promise<string | null>}
 */
export async function sha256(text) {
  if (!globalThis.crypto?.subtle) return null;
  const digest = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(text));
  return "sha256:" + [...new Uint8Array(digest)].map((byte) => byte.toString(16).padStart(2, "0")).join("");
}

/**
 * The failover order, when the dispatch has more than its own target.
 * @param {Target[]} targets
 * @returns {HTMLElement[]}
 */
function targetsView(targets) {
  if (targets.length < 2) return [];
  return [
    el("h3", {}, "Targets (failover order)"),
    el("ol", { class: "targets", start: "0" }, targets.map((target) =>
      el("li", { class: "wrap" }, `${target.provider} ${target.model} · ${target.adapter} · manifest ${target.manifest_digest}`))),
  ];
}

/** @param {Attempt} attempt */
function attemptView(attempt) {
  const steps = attempt.history.map((step) => el("li", {}, `${step.state} at ${clock(step.at)}`));
  return el("li", { class: "attempt" },
    el("div", {}, el("strong", {}, `Generation ${attempt.generation}`), ` · ${attempt.state}`,
      attempt.target ? ` · fallback ${attempt.target}` : "",
      attempt.provider ? ` · ${attempt.provider} ${attempt.model || ""}` : "",
      attempt.adapter ? ` · ${attempt.adapter}` : "",
      attempt.handle ? ` · handle ${attempt.handle}` : ""),
    attempt.end_reason ? el("div", { class: "reason" }, "Ended: ", endReasonText(attempt.end_reason)) : null,
    el("ol", { class: "steps", "aria-label": `states of generation ${attempt.generation}` }, steps));
}

/**
 * @param {HTMLElement} box where the verdict goes
 * @param {string} body
 * @param {string} expected
 */
async function checkDigest(box, body, expected) {
  const actual = await sha256(body);
  if (actual === null) {
    box.replaceChildren("SHA-256 cannot be checked here: browsers compute it only on https or localhost pages.");
  } else if (actual === expected) {
    box.replaceChildren(el("span", { class: "ok" }, "✓ SHA-256 of these bytes matches the manifest's request_digest"), ` (${actual})`);
  } else {
    box.replaceChildren(el("span", { class: "problem" }, "✗ SHA-256 of these bytes does not match the manifest"), ` (${actual}, manifest ${expected})`);
  }
}

/**
 * The inspector of one dispatch.
 * @param {string} operationId
 * @returns {Promise<HTMLElement[]>}
 */
export async function dispatchView(operationId) {
  /** @type {DispatchDocument} */
  let doc;
  try {
    doc = await json("/v1/dispatches/" + encodeURIComponent(operationId));
  } catch (error) {
    return [el("p", { class: "problem", role: "alert" }, `Dispatch ${operationId}: ${describe(error)}`)];
  }
  const m = doc.manifest;
  const verdict = el("p", { class: "digest", role: "status" }, "checking SHA-256…");
  const body = el("pre", { class: "raw", tabindex: "0", "aria-label": "request body exactly as sent" }, doc.request_body);
  const copied = el("span", { class: "meta", role: "status" });
  const copy = el("button", { type: "button", onclick: async () => {
    try { await navigator.clipboard.writeText(doc.request_body); copied.textContent = "copied"; }
    catch { getSelection()?.selectAllChildren(body); copied.textContent = "selected: press Ctrl+C to copy"; }
  } }, "Copy request body");
  checkDigest(verdict, doc.request_body, m.request_digest || doc.request_digest);
  return [
    el("p", {}, el("strong", {}, `Operation ${doc.operation_id}`), ` · ${doc.state} · ${m.adapter} → ${m.provider} ${m.model} · prompt tokens ${m.prompt_tokens} · output cap ${m.max_output_tokens}`),
    el("p", { class: "meta wrap" }, `manifest ${m.manifest_digest} · sequence ${m.sequence_digest} · revision ${m.conversation_revision}`),
    ...targetsView(doc.targets || []),
    el("h3", {}, "Attempts"),
    el("ol", { class: "timeline" }, doc.attempts.map(attemptView)),
    el("h3", {}, "Request body as sent"),
    el("div", { class: "toolbar" }, copy, " ", copied),
    verdict,
    body,
  ];
}
