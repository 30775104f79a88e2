// @ts-check
// list.js — owns the conversation list: search (a substring of the id), filters (the last
// dispatch's state and provider, calls awaiting a result), paging by cursor, and refreshing
// itself when the change feed says something changed (never on a timer).

import { describe, json } from "./api.js";
import { byId, el, renderIfChanged, typed, when } from "./dom.js";

/**
 * @typedef {{ operation_id: string, state: string, provider: string }} LastDispatch
 * @typedef {{ conversation_id: string, revision: number, updated_at: number,
 *             last_dispatch: LastDispatch | null, pending_calls: number }} Listed
 */

/** Page size of the list. */
const PAGE = 50;
/** Most rows the list holds (the API's page maximum). */
const ROWS_MAX = 500;

export class ConversationList {
  /** @param {{ open: (id: string) => void }} options */
  constructor(options) {
    this.open = options.open;
    /** @type {Listed[]} */
    this.items = [];
    /** @type {string | null} */
    this.next = null;
    /** @type {string | null} */
    this.selected = null;
    this.generation = 0;
    /** @type {number | undefined} */
    this.refreshTimer = undefined;
    const form = typed("list-form", HTMLFormElement);
    form.addEventListener("submit", (event) => { event.preventDefault(); this.reload(); });
    for (const id of ["list-state", "list-pending"]) byId(id).addEventListener("change", () => this.reload());
    byId("list-more").addEventListener("click", () => this.more());
  }

  /** The query of the current search and filters. */
  query() {
    const params = new URLSearchParams();
    const q = typed("list-q", HTMLInputElement).value.trim();
    const state = typed("list-state", HTMLSelectElement).value;
    const provider = typed("list-provider", HTMLInputElement).value.trim();
    const pending = typed("list-pending", HTMLSelectElement).value;
    if (q) params.set("q", q);
    if (state) params.set("state", state);
    if (provider) params.set("provider", provider);
    if (pending) params.set("pending", pending);
    return params;
  }

  /** Re-read from the first page, keeping as many rows as are shown (within the maximum). */
  async reload() {
    const generation = ++this.generation;
    const params = this.query();
    params.set("limit", String(Math.min(ROWS_MAX, Math.max(PAGE, this.items.length))));
    try {
      const page = await json("/v1/conversations?" + params);
      if (generation !== this.generation) return;
      this.items = page.conversations;
      this.next = page.next;
      this.render();
    } catch (error) {
      if (generation !== this.generation) return;
      this.problem(describe(error));
    }
  }

  async more() {
    if (!this.next) return;
    const generation = ++this.generation;
    const params = this.query();
    params.set("limit", String(PAGE));
    params.set("after", this.next);
    try {
      const page = await json("/v1/conversations?" + params);
      if (generation !== this.generation) return;
      this.items = this.items.concat(page.conversations).slice(0, ROWS_MAX);
      this.next = this.items.length >= ROWS_MAX ? null : page.next;
      this.render();
    } catch (error) {
      this.problem(describe(error));
    }
  }

  /** Something changed: re-read soon, once for a burst of changes. */
  changed() {
    clearTimeout(this.refreshTimer);
    this.refreshTimer = window.setTimeout(() => this.reload(), 250);
  }

  /** @param {string | null} id */
  select(id) {
    this.selected = id;
    for (const link of byId("list").querySelectorAll("a[data-conversation]")) {
      if (link instanceof HTMLElement) {
        if (link.dataset.conversation === id) link.setAttribute("aria-current", "page");
        else link.removeAttribute("aria-current");
      }
    }
  }

  /** @param {string} message */
  problem(message) {
    const list = byId("list");
    delete list.dataset.key;
    list.replaceChildren(el("p", { class: "problem", role: "alert" }, message));
  }

  render() {
    const list = byId("list");
    byId("list-count").textContent = `${this.items.length}${this.next ? "+" : ""} shown`;
    typed("list-more", HTMLButtonElement).hidden = !this.next;
    renderIfChanged(list, JSON.stringify([this.items, this.selected]), () => {
      if (this.items.length === 0) return [el("p", { class: "meta" }, "No conversation matches.")];
      return [el("ul", { class: "rows" }, this.items.map((item) => {
        const last = item.last_dispatch;
        return el("li", {},
          el("a", { href: "#/c/" + encodeURIComponent(item.conversation_id), "data-conversation": item.conversation_id,
                    "aria-current": item.conversation_id === this.selected ? "page" : null },
            el("span", { class: "row-title" }, item.conversation_id),
            el("span", { class: "meta" },
              `revision ${item.revision}`,
              last ? ` · ${last.state} on ${last.provider}` : " · never dispatched",
              item.pending_calls ? ` · ${item.pending_calls} call${item.pending_calls === 1 ? "" : "s"} awaiting a result` : "",
              ` · ${when(item.updated_at)}`)));
      }))];
    });
  }
}
