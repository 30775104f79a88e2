// @ts-check
// dispatch.js — owns dispatch sessions: one per operation, holding its state, its revocable
// preview and its outcome. A conversation has at most one running session in the page: a
// second Dispatch while one runs attaches to it instead of opening a second stream, and a
// session's events only ever touch its own conversation's state (the views render the open
// conversation's session and nothing else).

import { ApiFailure, describe, json, readEvents, request } from "./api.js";

/**
 * @typedef {{ provider: string, model: string, adapter: string }} Target
 * @typedef {{ kind: "committed", revision: number }
 *   | { kind: "waiting", pending: string[] }
 *   | { kind: "rejected", violations: { code: string, turn?: string, block?: string, message: string }[] }
 *   | { kind: "paused", reason: unknown }
 *   | { kind: "error", code: string, message: string }} Outcome
 * @typedef {{ at: number, text: string }} LogLine
 */

/** States after which a dispatch changes no more. */
export const TERMINAL = new Set(["COMMITTED", "FAILED", "ABANDONED"]);
/** Most log lines a session keeps. */
const LOG_LINES_MAX = 200;
/** Most preview characters a session keeps per block (the rest is summarised). */
const PREVIEW_CHARS_MAX = 200_000;

export class Session {
  /**
   * @param {string} conversationId
   * @param {string} operationId
   */
  constructor(conversationId, operationId) {
    this.conversationId = conversationId;
    this.operationId = operationId;
    /** @type {string} */
    this.state = "PREPARED";
    /** @type {number | null} */
    this.generation = null;
    /** Preview text by "generation:block". @type {Map<string, { generation: number, block: number, text: string }>} */
    this.previews = new Map();
    /** @type {Outcome | null} */
    this.outcome = null;
    /** @type {LogLine[]} */
    this.log = [];
    this.running = true;
    this.controller = new AbortController();
  }

  /** @param {string} text */
  note(text) {
    this.log.unshift({ at: Date.now(), text });
    this.log.length = Math.min(this.log.length, LOG_LINES_MAX);
  }

  /**
   * One client event of the dispatch stream.
   * @param {string} name
   * @param {any} data
   */
  handle(name, data) {
    switch (name) {
      case "state":
        this.state = data.state;
        this.generation = data.generation ?? this.generation;
        this.note(`state ${data.state}${data.generation ? ` (generation ${data.generation})` : ""}`);
        break;
      case "preview": {
        const key = `${data.generation}:${data.block_index}`;
        const box = this.previews.get(key) || { generation: data.generation, block: data.block_index, text: "" };
        if (box.text.length < PREVIEW_CHARS_MAX) box.text += data.delta;
        this.previews.set(key, box);
        break;
      }
      case "retract":
        for (const [key, box] of this.previews) if (box.generation === data.generation) this.previews.delete(key);
        this.note(`preview of generation ${data.generation} retracted: ${data.reason}`);
        break;
      case "committed":
        this.previews.clear();
        this.state = "COMMITTED";
        this.outcome = { kind: "committed", revision: data.revision };
        this.note(`committed revision ${data.revision}`);
        break;
      case "waiting":
        this.outcome = { kind: "waiting", pending: data.pending };
        break;
      case "rejected":
        this.outcome = { kind: "rejected", violations: data.violations };
        break;
      case "paused":
        this.outcome = { kind: "paused", reason: data.reason };
        break;
      case "error":
        this.outcome = { kind: "error", code: data.code, message: data.message };
        this.note(`error ${data.code}: ${data.message}`);
        break;
    }
  }
}

export class Dispatches {
  /** @param {{ changed: (session: Session, event: string) => void }} options */
  constructor(options) {
    this.changed = options.changed;
    /** @type {Map<string, Session>} */
    this.sessions = new Map();
    /** The newest session of each conversation. @type {Map<string, Session>} */
    this.latest = new Map();
  }

  /** @param {string} conversationId */
  of(conversationId) {
    return this.latest.get(conversationId) || null;
  }

  /** @param {string} conversationId */
  running(conversationId) {
    const session = this.latest.get(conversationId);
    return session && session.running ? session : null;
  }

  /**
   * Start a dispatch, or — while one of this conversation runs — answer that one. Registered
   * before the first await, so a double click cannot open two streams.
   * @param {string} conversationId
   * @param {string} operationId
   * @param {string} body the request body as text (big integers stay digits)
   */
  start(conversationId, operationId, body) {
    const current = this.running(conversationId);
    if (current) return current;
    return this.open(conversationId, operationId, body);
  }

  /**
   * Attach to an existing operation (re-attach on load, a dispatch seen on the feed): the
   * gateway answers its backlog (the preview so far) and what follows.
   * @param {string} conversationId
   * @param {string} operationId
   */
  async attach(conversationId, operationId) {
    const known = this.sessions.get(operationId);
    if (known && known.running) return known;
    const current = this.running(conversationId);
    if (current) return current;
    const session = this.register(conversationId, operationId);
    try {
      const record = await json("/v1/dispatches/" + encodeURIComponent(operationId), { signal: session.controller.signal });
      /** @type {Target} */
      const target = { provider: record.manifest.provider, model: record.manifest.model, adapter: record.manifest.adapter };
      this.stream(session, JSON.stringify({ operation_id: operationId, target, stream: true }));
    } catch (error) {
      this.fail(session, error);
    }
    return session;
  }

  /**
   * @param {string} conversationId
   * @param {string} operationId
   */
  register(conversationId, operationId) {
    const session = new Session(conversationId, operationId);
    this.sessions.set(operationId, session);
    this.latest.set(conversationId, session);
    this.changed(session, "start");
    return session;
  }

  /**
   * @param {string} conversationId
   * @param {string} operationId
   * @param {string} body
   */
  open(conversationId, operationId, body) {
    const session = this.register(conversationId, operationId);
    this.stream(session, body);
    return session;
  }

  /**
   * @param {Session} session
   * @param {string} body
   */
  async stream(session, body) {
    try {
      const response = await request(`/v1/conversations/${encodeURIComponent(session.conversationId)}/dispatch`,
        { method: "POST", body, signal: session.controller.signal });
      await readEvents(response, (name, data) => {
        session.handle(name, data);
        this.changed(session, name);
      }, session.controller.signal);
      session.running = false;
      this.changed(session, "end");
    } catch (error) {
      this.fail(session, error);
    }
  }

  /**
   * @param {Session} session
   * @param {unknown} error
   */
  fail(session, error) {
    if (error instanceof DOMException && error.name === "AbortError") return;
    session.running = false;
    const code = error instanceof ApiFailure ? error.failure.code : "console";
    session.outcome = { kind: "error", code, message: describe(error) };
    session.note(`error ${code}: ${describe(error)}`);
    this.changed(session, "end");
  }

  /**
   * The feed says an operation changed state: a session not running in this page (another
   * client's dispatch, or one that ended while the stream was lost) follows it.
   * @param {string} operationId
   * @param {string} state
   */
  observed(operationId, state) {
    const session = this.sessions.get(operationId);
    if (!session || session.running) return;
    if (session.state !== state) {
      session.state = state;
      session.note(`state ${state} (from the change feed)`);
      this.changed(session, "state");
    }
  }

  /** Stop every stream (the token changed). */
  closeAll() {
    for (const session of this.sessions.values()) session.controller.abort();
    this.sessions.clear();
    this.latest.clear();
  }
}
