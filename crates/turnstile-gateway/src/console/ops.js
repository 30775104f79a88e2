// @ts-check
// ops.js — owns the operations panels: metrics, the tool-call ledger, the quarantine (newest
// first, paged), proxy refusals (offending block marked) and shadow comparisons (with a
// side-by-side diff). Panels re-read when the change feed says something changed, and
// redraw only when what they show changed, so a reader's selection survives a refresh.

import { describe, json, request } from "./api.js";
import { byId, el, renderIfChanged, when } from "./dom.js";
import { lineDiff, reindent } from "./diff.js";

const KEY_METRICS = ["turnstile_illegal_sends_total", "turnstile_partial_tool_dispatch_total", "turnstile_preview_retractions_total",
  "turnstile_late_blocks_total", "turnstile_canonical_cas_conflicts_total", "turnstile_dispatch_unknown_age_seconds"];
/** Entries per page of the quarantine and refusal panels. */
const PANEL_PAGE = 20;
/** Characters of one quarantined block shown (the rest behind "…"). */
const CONTENT_CHARS_MAX = 2000;

/**
 * @param {string} id
 * @param {unknown} error
 */
function panelProblem(id, error) {
  const box = byId(id);
  renderIfChanged(box, "error:" + describe(error), () => [el("p", { class: "problem", role: "alert" }, describe(error))]);
}

/** @param {string} text */
function cut(text) {
  return text.length > CONTENT_CHARS_MAX ? text.slice(0, CONTENT_CHARS_MAX) + "…" : text;
}

async function metrics() {
  try {
    const text = await (await request("/metrics")).text();
    const rows = KEY_METRICS.map((name) => {
      const line = text.split("\n").find((l) => l.startsWith(name + " ") || l.startsWith(name + "{"));
      return [name.replace("turnstile_", "").replaceAll("_", " "), line ? line.split(" ").pop() || "" : "–"];
    });
    renderIfChanged(byId("metrics"), JSON.stringify(rows), () => [el("table", {}, el("tbody", {},
      rows.map(([name, value]) => el("tr", {}, el("th", { scope: "row" }, name), el("td", {}, value)))))]);
  } catch (error) { panelProblem("metrics", error); }
}

async function toolCalls() {
  try {
    const calls = (await json("/v1/tool-calls")).tool_calls;
    renderIfChanged(byId("tool-calls"), JSON.stringify(calls), () => calls.length === 0 ? [el("p", { class: "meta" }, "No calls in the ledger.")]
      : [el("div", { class: "scroll" }, el("table", {}, el("thead", {}, el("tr", {}, ["call", "tool", "state", "claims"].map((h) => el("th", { scope: "col" }, h)))),
        el("tbody", {}, calls.map((/** @type {any} */ c) => el("tr", {},
          el("td", {}, el("a", { href: "#/c/" + encodeURIComponent(c.conversation_id) }, `${c.conversation_id}/${c.call_id}`)),
          el("td", {}, c.tool), el("td", {}, c.state), el("td", {}, c.claims ?? ""))))))]);
  } catch (error) { panelProblem("tool-calls", error); }
}

/** The quarantine panel's page (null: newest). @type {number | null} */
let quarantineBefore = null;

async function quarantine() {
  try {
    const page = await json(`/v1/quarantine?limit=${PANEL_PAGE}` + (quarantineBefore ? `&before=${quarantineBefore}` : ""));
    renderIfChanged(byId("quarantine"), JSON.stringify([page, quarantineBefore]), () => [
      page.quarantine.length === 0 ? el("p", { class: "meta" }, "Nothing quarantined.") :
        el("ul", { class: "rows" }, page.quarantine.map((/** @type {any} */ q) => el("li", {},
          el("div", {}, `${when(q.at)} · `, el("a", { href: `#/d/${encodeURIComponent(q.operation_id)}` }, q.operation_id), ` · generation ${q.generation} · ${q.reason}`),
          el("pre", { class: "raw small", tabindex: "0" }, cut(JSON.stringify(q.content)))))),
      el("div", { class: "toolbar" },
        quarantineBefore ? el("button", { type: "button", onclick: () => { quarantineBefore = null; quarantine(); } }, "Newest") : null,
        page.next ? el("button", { type: "button", onclick: () => { quarantineBefore = page.next; quarantine(); } }, "Older") : null),
    ]);
  } catch (error) { panelProblem("quarantine", error); }
}

/**
 * A refusal: its codes, and the turns with the offending blocks marked in text.
 * @param {any} refusal
 */
function refusalView(refusal) {
  const codes = (refusal.violations || []).map((/** @type {any} */ v) => v.code);
  /** @type {Map<string, any>} */
  const offending = new Map((refusal.offending || []).map((/** @type {any} */ o) => [`${o.turn}/${o.block ?? ""}`, o]));
  const turns = refusal.outline?.turns || [];
  return el("li", {}, el("details", {},
    el("summary", {}, `${when(refusal.at)} · ${refusal.api} ${refusal.model || ""} · ${refusal.code}`, codes.length ? ` · ${codes.join(", ")}` : ""),
    refusal.path ? el("p", {}, `at ${refusal.path}`) : null,
    refusal.pending ? el("p", {}, `calls without results: ${refusal.pending.join(", ")}`) : null,
    turns.length ? el("ol", { class: "outline", "aria-label": "turns of the refused request" }, turns.map((/** @type {any} */ turn) => el("li", {},
      `${turn.role} turn ${turn.id}`,
      offending.has(`${turn.id}/`) ? el("mark", {}, ` ⚠ offending turn (${offending.get(`${turn.id}/`).code})`) : null,
      el("ul", {}, turn.blocks.map((/** @type {any} */ block) => {
        const bad = offending.get(`${turn.id}/${block.id}`);
        return el("li", bad ? { class: "offending" } : {}, `${block.kind} block ${block.id}`,
          bad ? [el("mark", {}, ` ⚠ offending block: ${bad.code}`), el("pre", { class: "raw small", tabindex: "0", "aria-label": "offending block" }, bad.json + (bad.truncated ? " …(cut)" : ""))] : null);
      }))))) : null));
}

async function refusals() {
  try {
    const page = await json(`/v1/proxy/refusals?limit=${PANEL_PAGE}`);
    renderIfChanged(byId("refusals"), JSON.stringify(page), () => page.refusals.length === 0
      ? [el("p", { class: "meta" }, "No proxy request was refused.")]
      : [el("ul", { class: "rows" }, page.refusals.map(refusalView))]);
  } catch (error) { panelProblem("refusals", error); }
}

/**
 * Side by side: the client's request and ours, re-indented, changed lines marked in text.
 * @param {any} record
 */
export function shadowDiffView(record) {
  const bodies = record.bodies || {};
  if (typeof bodies.ours !== "string") {
    return [el("p", {}, `No request of ours to compare: ${record.manifest_reason || "none was made"}.`),
      el("pre", { class: "raw", tabindex: "0", "aria-label": "the client's request" }, bodies.original || "")];
  }
  const rows = lineDiff(reindent(bodies.original), reindent(bodies.ours));
  const changed = rows.filter((row) => row.kind !== "same").length;
  const cell = (/** @type {string | null} */ text, /** @type {string} */ mark) => el("td", { class: text === null ? "gap" : mark ? "changed" : "" },
    text === null ? "" : (mark ? mark + " " : "  ") + text);
  return [
    el("p", { role: "status" }, changed ? `${changed} line${changed === 1 ? "" : "s"} differ` : "The two requests are the same line for line",
      bodies.original_truncated || bodies.ours_truncated ? " (bodies cut to the configured size)" : ""),
    el("div", { class: "scroll" }, el("table", { class: "diff" },
      el("thead", {}, el("tr", {}, el("th", { scope: "col" }, `client's request (${record.api})`), el("th", { scope: "col" }, `ours (${record.adapter})`))),
      el("tbody", {}, rows.map((row) => el("tr", {},
        cell(row.left, row.kind === "removed" ? "−" : ""), cell(row.right, row.kind === "added" ? "+" : "")))))),
  ];
}

async function shadow() {
  try {
    const diffs = (await json("/v1/shadow/diffs?limit=20")).diffs;
    renderIfChanged(byId("shadow"), JSON.stringify(diffs), () => diffs.length === 0 ? [el("p", { class: "meta" }, "No shadow comparisons yet.")]
      : [el("ul", { class: "rows" }, diffs.map((/** @type {any} */ d) => el("li", {},
        `${when(d.at)} · ${d.api} ${d.model || ""} · `,
        d.verdict || (d.import_error ? d.import_error.code : ""),
        d.bytes ? (d.bytes.identical ? " · bytes identical" : ` · bytes differ at ${d.bytes.first_difference_at}`) : "",
        d.violations ? " · " + d.violations.map((/** @type {any} */ v) => v.code).join(", ") : "",
        (d.semantic || []).length ? " · meaning differs: " + d.semantic.join("; ") : "",
        " ", el("button", { type: "button", onclick: () => { byId("shadow-compare").replaceChildren(...shadowDiffView(d)); } }, "Compare side by side"))))]);
  } catch (error) { panelProblem("shadow", error); }
}

/** Re-read every panel (after a change or a gap in the feed). */
export function refreshPanels() {
  toolCalls(); quarantine(); refusals(); shadow(); metrics();
}

/** Metrics change without feed events; they alone are read on a slow timer. */
export function startMetrics() {
  metrics();
  window.setInterval(metrics, 10_000);
}
