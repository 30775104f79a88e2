// @ts-check
// feed.js — owns the subscription to `GET /v1/events` (the tenant's change feed): reconnects
// with a bounded backoff, and after any gap (reconnect, `resync`) tells the page to re-read
// what it shows, since changes in the gap were not seen.

import { ApiFailure, readEvents, request } from "./api.js";

/**
 * @typedef {{ conversation_id: string, revision: number }} ConversationChange
 * @typedef {{ operation_id: string, conversation_id: string, state: string }} DispatchChange
 * @typedef {{
 *   conversation: (change: ConversationChange) => void,
 *   dispatch: (change: DispatchChange) => void,
 *   proxy: (kind: string) => void,
 *   resync: () => void,
 *   status: (status: "live" | "connecting" | "unauthorized" | "unreachable") => void,
 * }} FeedHandlers
 */

/** Longest wait between reconnects. */
const BACKOFF_MS_MAX = 10_000;

export class Feed {
  /** @param {FeedHandlers} handlers */
  constructor(handlers) {
    this.handlers = handlers;
    /** @type {AbortController | null} */
    this.controller = null;
    this.backoff = 500;
    /** @type {number | undefined} */
    this.timer = undefined;
  }

  /** (Re)subscribe now, e.g. after the token changed. */
  restart() {
    this.controller?.abort();
    clearTimeout(this.timer);
    this.backoff = 500;
    this.connect();
  }

  async connect() {
    const controller = new AbortController();
    this.controller = controller;
    this.handlers.status("connecting");
    try {
      const response = await request("/v1/events", { signal: controller.signal });
      await readEvents(response, (name, data) => {
        if (name === "ready") {
          this.backoff = 500;
          this.handlers.status("live");
          this.handlers.resync();
        } else if (name === "conversation") this.handlers.conversation(data);
        else if (name === "dispatch") this.handlers.dispatch(data);
        else if (name === "proxy") this.handlers.proxy(data.kind);
        else if (name === "resync") this.handlers.resync();
      }, controller.signal);
    } catch (error) {
      if (controller.signal.aborted) return;
      if (error instanceof ApiFailure && error.failure.kind === "unauthorized") {
        this.handlers.status("unauthorized");
        return;
      }
      this.handlers.status("unreachable");
    }
    if (controller.signal.aborted) return;
    this.handlers.status("connecting");
    this.timer = window.setTimeout(() => this.connect(), this.backoff);
    this.backoff = Math.min(BACKOFF_MS_MAX, this.backoff * 2);
  }
}
