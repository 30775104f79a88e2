// @ts-check
// app.js — owns wiring and routing. Module map (one owner each):
//   api.js (HTTP, token, typed failures, SSE reading) · feed.js (change feed subscription) ·
//   list.js (conversation list) · conversation.js (turns, preview, outcome) · dispatch.js
//   (dispatch sessions) · inspect.js (manifest, attempts, exact bytes) · ops.js (side panels)
//   · diff.js (JSON re-indent and line diff) · dom.js (building nodes).
// Routes (deep links): #/c/<conversation>, #/c/<conversation>/d/<operation>, #/d/<operation>.

import { ApiFailure, describe, json, setToken, token } from "./api.js";
import { outcomeView, previewView, repairsView, turnsView } from "./conversation.js";
import { Dispatches, TERMINAL } from "./dispatch.js";
import { byId, el, renderIfChanged, typed } from "./dom.js";
import { Feed } from "./feed.js";
import { dispatchView } from "./inspect.js";
import { ConversationList } from "./list.js";
import { refreshPanels, startMetrics } from "./ops.js";

/** @typedef {import("./dispatch.js").Session} Session */

/** What the page shows. */
const view = {
  /** @type {string | null} */
  conversation: null,
  /** @type {string | null} */
  operation: null,
  /** @type {number | null} */
  revision: null,
  /** Bumped per navigation, so a late answer for an older view is dropped. */
  navigation: 0,
};

const list = new ConversationList({ open: (id) => { location.hash = "#/c/" + encodeURIComponent(id); } });
const dispatches = new Dispatches({ changed: sessionChanged });

/** @param {string} message @param {"problem" | "info"} [kind] */
function banner(message, kind = "problem") {
  const box = byId("banner");
  box.hidden = !message;
  box.className = kind;
  box.textContent = message;
}

/** @returns {{ conversation: string | null, operation: string | null }} */
function route() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").map((part) => decodeURIComponent(part));
  if (parts[0] === "c" && parts[1]) return { conversation: parts[1], operation: parts[2] === "d" && parts[3] ? parts[3] : null };
  if (parts[0] === "d" && parts[1]) return { conversation: null, operation: parts[1] };
  return { conversation: null, operation: null };
}

async function navigate() {
  const target = route();
  const navigation = ++view.navigation;
  const conversationChanged = target.conversation !== view.conversation;
  view.conversation = target.conversation;
  view.operation = target.operation;
  list.select(view.conversation);
  byId("conversation-section").hidden = !view.conversation;
  if (conversationChanged) {
    view.revision = null;
    delete byId("turns").dataset.key;
    byId("turns").replaceChildren();
    renderSession();
  }
  if (view.conversation) {
    byId("conversation-title").textContent = view.conversation;
    await loadConversation();
    if (navigation !== view.navigation) return;
    await reattach(view.conversation, view.operation);
  }
  await showInspector();
}

/** Re-read the open conversation's committed history. */
async function loadConversation() {
  const id = view.conversation;
  if (!id) return;
  const navigation = view.navigation;
  try {
    const doc = await json("/v1/conversations/" + encodeURIComponent(id));
    if (navigation !== view.navigation) return;
    view.revision = doc.revision;
    byId("conversation-revision").textContent = `revision ${doc.revision}`;
    renderIfChanged(byId("turns"), `${id}@${doc.revision}`, () => [...turnsView(doc), ...repairsView(doc)]);
    byId("conversation-problem").replaceChildren();
  } catch (error) {
    if (navigation !== view.navigation) return;
    byId("conversation-problem").replaceChildren(el("p", { class: "problem", role: "alert" }, `Conversation ${id}: ${describe(error)}`));
    authProblem(error);
  }
}

/**
 * Attach to the conversation's dispatch in flight, if any (after a reload, or one started by
 * another client), so its preview and commit appear here.
 * @param {string} conversationId
 * @param {string | null} operationId
 */
async function reattach(conversationId, operationId) {
  if (dispatches.running(conversationId)) return;
  try {
    let candidate = operationId;
    let state = null;
    if (candidate) {
      state = (await json("/v1/dispatches/" + encodeURIComponent(candidate))).state;
    } else {
      const page = await json("/v1/conversations?limit=500&q=" + encodeURIComponent(conversationId));
      const entry = page.conversations.find((/** @type {any} */ c) => c.conversation_id === conversationId);
      candidate = entry?.last_dispatch?.operation_id || null;
      state = entry?.last_dispatch?.state || null;
    }
    if (candidate && state && !TERMINAL.has(state) && view.conversation === conversationId) {
      await dispatches.attach(conversationId, candidate);
    }
  } catch { /* the conversation view already says what is wrong */ }
}

async function showInspector() {
  const box = byId("inspector");
  const operation = view.operation || dispatches.of(view.conversation || "")?.operationId || null;
  if (box.dataset.operation !== operation) {
    // Never show one dispatch's details under another's name, even for a moment.
    box.replaceChildren();
    byId("inspector-section").hidden = true;
    if (operation) box.dataset.operation = operation; else delete box.dataset.operation;
  }
  if (!operation) return;
  const navigation = view.navigation;
  const nodes = await dispatchView(operation);
  if (navigation !== view.navigation || box.dataset.operation !== operation) return;
  box.replaceChildren(...nodes);
  byId("inspector-section").hidden = false;
}

/** Draw the open conversation's session: preview, outcome, the dispatch button, the log. */
function renderSession() {
  const session = view.conversation ? dispatches.of(view.conversation) : null;
  byId("live").replaceChildren(...previewView(session));
  byId("outcome").replaceChildren(...outcomeView(session));
  const running = Boolean(session && session.running);
  const button = typed("dispatch-button", HTMLButtonElement);
  button.disabled = running;
  button.textContent = running ? "Dispatching…" : "Dispatch";
  byId("dispatch-status").textContent = session
    ? `Operation ${session.operationId}: ${session.state}${session.running ? " (streaming here)" : ""}` : "No dispatch in this page yet.";
  byId("events").replaceChildren(...(session ? session.log.slice(0, 50).map((line) => el("li", {}, line.text)) : []));
}

/**
 * @param {Session} session
 * @param {string} event
 */
function sessionChanged(session, event) {
  if (session.conversationId !== view.conversation) return;
  renderSession();
  if (event === "committed") loadConversation();
  if (event === "end" || event === "committed") {
    if (!view.operation || view.operation === session.operationId) {
      history.replaceState(null, "", `#/c/${encodeURIComponent(session.conversationId)}/d/${encodeURIComponent(session.operationId)}`);
      view.operation = session.operationId;
      showInspector();
    }
  }
}

/** @param {unknown} error */
function authProblem(error) {
  if (error instanceof ApiFailure && (error.failure.kind === "unauthorized" || error.failure.kind === "unreachable")) banner(describe(error));
}

/**
 * The dispatch request body as text: the seed is spliced in as the digits typed, so a seed
 * beyond 2^53 reaches the gateway exactly (JSON.stringify of a Number would round it).
 * @param {string} operationId
 */
function dispatchBody(operationId) {
  const value = (/** @type {string} */ id) => typed(id, HTMLInputElement).value.trim();
  /** @type {Record<string, unknown>} */
  const body = { operation_id: operationId, stream: true,
    target: { provider: value("d-provider") || "sim", model: value("d-model"), adapter: typed("d-adapter", HTMLSelectElement).value } };
  if (value("d-max")) body.max_output_tokens = Number(value("d-max"));
  if (view.revision !== null) body.expected_revision = view.revision;
  const text = JSON.stringify(body);
  const seed = value("d-seed");
  if (!seed) return text;
  if (!/^-?\d{1,20}$/.test(seed)) throw new Error("the seed must be an integer");
  return text.slice(0, -1) + `,"sampling":{"seed":${seed}}}`;
}

function startDispatch() {
  const conversationId = view.conversation;
  if (!conversationId) return;
  if (dispatches.running(conversationId)) return;
  const operationInput = typed("d-operation", HTMLInputElement);
  const operationId = operationInput.value.trim() || `op-${Date.now().toString(36)}`;
  let body;
  try { body = dispatchBody(operationId); }
  catch (error) { byId("outcome").replaceChildren(el("p", { class: "problem", role: "alert" }, describe(error))); return; }
  operationInput.value = "";
  view.operation = null;
  dispatches.start(conversationId, operationId, body);
}

function wire() {
  typed("token-input", HTMLInputElement).value = token();
  typed("token-form", HTMLFormElement).addEventListener("submit", (event) => {
    event.preventDefault();
    setToken(typed("token-input", HTMLInputElement).value.trim());
    banner("");
    dispatches.closeAll();
    feed.restart();
    navigate();
  });
  typed("dispatch-form", HTMLFormElement).addEventListener("submit", (event) => { event.preventDefault(); startDispatch(); });
  typed("open-form", HTMLFormElement).addEventListener("submit", (event) => {
    event.preventDefault();
    const id = typed("open-id", HTMLInputElement).value.trim();
    if (id) location.hash = "#/c/" + encodeURIComponent(id);
  });
  window.addEventListener("hashchange", () => { navigate(); });
}

const feed = new Feed({
  conversation(change) {
    list.changed();
    refreshPanels();
    if (change.conversation_id === view.conversation && change.revision !== view.revision) loadConversation();
  },
  dispatch(change) {
    list.changed();
    dispatches.observed(change.operation_id, change.state);
    if (change.conversation_id === view.conversation) {
      if (!TERMINAL.has(change.state) && !dispatches.running(change.conversation_id)) dispatches.attach(change.conversation_id, change.operation_id);
      if (view.operation === change.operation_id) showInspector();
    }
  },
  proxy() {
    refreshPanels();
  },
  resync() {
    list.reload();
    refreshPanels();
    loadConversation();
  },
  status(status) {
    const words = { live: "Live updates on", connecting: "Connecting to live updates…", unauthorized: "Live updates off: a token is needed",
      unreachable: "Gateway unreachable; retrying" };
    byId("feed-status").textContent = words[status];
    if (status === "unauthorized") banner("This gateway needs a tenant token: enter yours under “Token” above.");
    else if (status === "unreachable") banner(`The gateway cannot be reached (${location.origin}); retrying.`);
    else if (status === "live") banner("");
  },
});

wire();
startMetrics();
feed.restart();
navigate();
