// @ts-check
// conversation.js — owns the open conversation's view: committed turns and blocks (tool calls
// linked to their results and back; a result the gateway's history repair made says so), the
// repairs on record (who, when, what changed), the open conversation's live preview (labelled
// as preview in text and to assistive technology, never styled as history), and its outcome
// (waiting, rejected, paused, error) in words.

import { el } from "./dom.js";

/**
 * @typedef {{ kind: string, text?: string }} Part
 * @typedef {{ id: string, kind: string, text?: string, trust?: string, call_id?: string, tool?: string,
 *             arguments?: unknown, status?: string, content?: Part[] }} Block
 * @typedef {{ id: string, role: string, revision: number, generation?: number, blocks: Block[] }} Turn
 * @typedef {{ op: string, cause: string, call_id?: string, block?: string | null, turn?: string | null }} RepairAction
 * @typedef {{ revision: number, plan_digest: string, tenant: string | null, actor: string | null, repaired_at: number,
 *             plan: { actions: RepairAction[] } }} RepairRecord
 * @typedef {{ conversation_id: string, revision: number, turns: Turn[], repairs?: RepairRecord[] }} ConversationDocument
 * @typedef {import("./dispatch.js").Session} Session
 */

/** @param {string} callId */
const callAnchor = (callId) => "call-" + callId;
/** @param {string} callId */
const resultAnchor = (callId) => "result-" + callId;

/**
 * A button that moves focus to another block of the view.
 * @param {string} label
 * @param {string} target element id
 */
function jump(label, target) {
  return el("button", { type: "button", class: "link", onclick: () => {
    const node = document.getElementById(target);
    if (node) { node.scrollIntoView({ block: "center" }); node.focus(); }
  } }, label);
}

/** @param {unknown} value */
function argumentsText(value) {
  return typeof value === "string" ? value : JSON.stringify(value);
}

/**
 * @param {Block} block
 * @param {Map<string, Block>} results
 * @param {Map<string, Block>} calls
 */
function blockView(block, results, calls) {
  switch (block.kind) {
    case "text":
      return el("div", { class: "block-text" }, block.text || "");
    case "context":
      return el("div", { class: "block-text" }, el("span", { class: "badge" }, `context · ${block.trust}`), " ", block.text || "");
    case "tool_call": {
      const callId = block.call_id || "";
      const result = results.get(callId);
      return el("div", { class: "edge", id: callAnchor(callId), tabindex: "-1" },
        el("span", { class: "badge" }, "tool call"), " ",
        el("code", {}, `${block.tool}(${argumentsText(block.arguments)})`), " · ",
        result ? jump(`result: ${result.status} (${result.id})`, resultAnchor(callId))
               : el("span", { class: "pending" }, "awaiting a result"));
    }
    case "tool_result": {
      const callId = block.call_id || "";
      const call = calls.get(callId);
      const content = (block.content || []).map((part) => part.text ?? `[${part.kind}]`).join(" ");
      // A result whose id is the repair's prefix was made by the gateway, not by a tool.
      const byRepair = block.id.startsWith("repair-") ? " · by the gateway's history repair" : "";
      return el("div", { class: "edge", id: resultAnchor(callId), tabindex: "-1" },
        el("span", { class: "badge" }, `result · ${block.status}${byRepair}`), " ",
        call ? jump(`for call ${call.tool} (${callId})`, callAnchor(callId)) : `for call ${callId}`, " ",
        el("span", { class: "block-text" }, content));
    }
    default:
      return el("div", { class: "meta" }, `[${block.kind}]`);
  }
}

/**
 * The committed history.
 * @param {ConversationDocument} doc
 */
export function turnsView(doc) {
  /** @type {Map<string, Block>} */
  const results = new Map();
  /** @type {Map<string, Block>} */
  const calls = new Map();
  for (const turn of doc.turns) for (const block of turn.blocks) {
    if (block.kind === "tool_result" && block.call_id) results.set(block.call_id, block);
    if (block.kind === "tool_call" && block.call_id) calls.set(block.call_id, block);
  }
  if (doc.turns.length === 0) return [el("p", { class: "meta" }, "No turns yet.")];
  return doc.turns.map((turn) => el("article", { class: "turn", "data-role": turn.role, "aria-label": `${turn.role} turn, revision ${turn.revision}` },
    el("div", { class: "meta" }, `${turn.role} · ${turn.id} · revision ${turn.revision}`, turn.generation ? ` · generation ${turn.generation}` : ""),
    turn.blocks.map((block) => blockView(block, results, calls))));
}

/** @param {RepairAction} action */
function repairActionText(action) {
  switch (action.op) {
    case "cancel": return `cancelled call ${action.call_id} in the gateway's name (${action.cause})`;
    case "take_out": return `took out block ${action.block ?? "–"} of turn ${action.turn ?? "–"}, kept in the plan (${action.cause})`;
    case "drop_turn": return `dropped turn ${action.turn ?? "–"}, left with no block`;
    default: return `${action.op} (${action.cause})`;
  }
}

/**
 * The history repairs on record (`repairs` of the conversation document), oldest first.
 * @param {ConversationDocument} doc
 */
export function repairsView(doc) {
  const repairs = doc.repairs || [];
  if (repairs.length === 0) return [];
  return [el("section", { class: "repairs", "aria-label": "History repairs" },
    el("h3", {}, "History repairs"),
    repairs.map((repair) => el("article", { class: "turn", "aria-label": `History repair at revision ${repair.revision}` },
      el("div", { class: "meta" }, `Repaired at revision ${repair.revision} · ${new Date(repair.repaired_at).toISOString()}`,
        ` · by ${repair.actor ?? "(unnamed)"}${repair.tenant ? ` (tenant ${repair.tenant})` : ""}`),
      el("div", { class: "block-text" }, `plan ${repair.plan_digest}`),
      el("ul", {}, (repair.plan.actions || []).map((action) => el("li", {}, repairActionText(action)))))))];
}

/**
 * The open conversation's live preview (revocable; never history).
 * @param {Session | null} session
 */
export function previewView(session) {
  if (!session || session.previews.size === 0) return [];
  return [...session.previews.values()].map((box) => el("section", { class: "preview", "aria-label": `Preview of generation ${box.generation}, not committed` },
    el("div", { class: "preview-label" }, `Preview — not history yet · generation ${box.generation}`),
    el("div", { class: "block-text" }, box.text)));
}

/**
 * A reason (a pause's, say) as words: each field as "name: value".
 * @param {unknown} value
 * @returns {string}
 */
export function readable(value) {
  if (value === null || value === undefined) return "";
  if (Array.isArray(value)) return value.map(readable).join("; ");
  if (typeof value === "object") {
    return Object.entries(/** @type {Record<string, unknown>} */ (value))
      .map(([key, inner]) => `${key.replaceAll("_", " ")}: ${typeof inner === "object" ? readable(inner) : String(inner)}`).join(", ");
  }
  return String(value);
}

/**
 * The session's outcome in words.
 * @param {Session | null} session
 */
export function outcomeView(session) {
  const outcome = session?.outcome;
  if (!outcome || outcome.kind === "committed") return [];
  switch (outcome.kind) {
    case "waiting":
      return [el("p", { role: "status" }, "Waiting for tool results: ", outcome.pending.join(", "), ". Nothing was sent.")];
    case "rejected":
      return [el("div", { class: "problem", role: "alert" }, el("p", {}, "Rejected: the history is not legal, nothing was sent."),
        el("ul", {}, outcome.violations.map((v) => el("li", {}, `${v.code} — turn ${v.turn ?? "–"}, block ${v.block ?? "–"}: ${v.message}`))))];
    case "paused":
      return [el("div", { class: "problem", role: "alert" }, el("p", {}, "Paused: the adapter cannot represent this conversation, so nothing was sent (it is never degraded)."),
        el("p", {}, readable(outcome.reason)))];
    case "error":
      return [el("p", { class: "problem", role: "alert" }, `Dispatch error ${outcome.code}: ${outcome.message}`)];
  }
}
