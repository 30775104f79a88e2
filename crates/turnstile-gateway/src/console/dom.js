// @ts-check
// dom.js — owns building DOM nodes. Every text goes in as a text node (never innerHTML), so
// nothing a conversation holds can become markup.

/**
 * @typedef {Node | string | number | null | undefined | false} Child
 */

/**
 * An element with attributes and children. `class` sets the class name; `on<event>` keys
 * attach listeners; other keys are attributes (`false`/`null` leaves one out).
 * @template {keyof HTMLElementTagNameMap} K
 * @param {K} tag
 * @param {Record<string, string | number | boolean | null | undefined | EventListener>} [attributes]
 * @param {...(Child | Child[])} children
 * @returns {HTMLElementTagNameMap[K]}
 */
export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (value === false || value === null || value === undefined) continue;
    if (typeof value === "function") node.addEventListener(key.slice(2), value);
    else if (key === "class") node.className = String(value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  append(node, children);
  return node;
}

/**
 * @param {Element} node
 * @param {(Child | Child[])[]} children
 */
function append(node, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/**
 * The element with this id (a missing one is a bug of the page, reported loudly).
 * @param {string} id
 * @returns {HTMLElement}
 */
export function byId(id) {
  const node = document.getElementById(id);
  if (!node) throw new Error(`the page has no #${id}`);
  return node;
}

/**
 * @template {HTMLElement} T
 * @param {string} id
 * @param {new () => T} type
 * @returns {T}
 */
export function typed(id, type) {
  const node = byId(id);
  if (!(node instanceof type)) throw new Error(`#${id} is not a ${type.name}`);
  return node;
}

/**
 * Replace a container's children only when what it would show changed (a key of the data), so
 * a refresh with the same data keeps the reader's selection, focus and scroll position.
 * @param {HTMLElement} container
 * @param {string} key
 * @param {() => (Child | Child[])[]} build
 */
export function renderIfChanged(container, key, build) {
  if (container.dataset.key === key) return;
  container.dataset.key = key;
  container.replaceChildren();
  append(container, build());
}

/**
 * A time as the reader's local clock shows it, with milliseconds.
 * @param {number} ms
 */
export function clock(ms) {
  const date = new Date(ms);
  const pad = (/** @type {number} */ n, /** @type {number} */ width = 2) => String(n).padStart(width, "0");
  return `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}.${pad(date.getMilliseconds(), 3)}`;
}

/**
 * A date and time, for lists.
 * @param {number} ms
 */
export function when(ms) {
  const date = new Date(ms);
  return `${date.toISOString().slice(0, 10)} ${clock(ms)}`;
}
