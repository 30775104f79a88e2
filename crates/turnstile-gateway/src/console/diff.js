// @ts-check
// diff.js — owns the side-by-side comparison of two JSON request bodies: each is re-indented
// token by token (never parsed into numbers, so a 19-digit seed stays exactly as sent), then
// compared line by line (longest common subsequence, bounded).

/** Most lines per side the diff compares (LCS is lines × lines). */
export const DIFF_LINES_MAX = 3000;

/**
 * JSON text laid out one value per line, by a tokenizer that copies every token's characters
 * as they are (text that is not JSON is returned line by line as it is).
 * @param {string} text
 * @returns {string[]}
 */
export function reindent(text) {
  /** @type {string[]} */
  const lines = [];
  let line = "", depth = 0, inString = false, escaped = false;
  const indent = () => "  ".repeat(depth);
  const flush = () => { if (line.trim()) lines.push(line); line = indent(); };
  for (const char of text) {
    if (inString) {
      line += char;
      if (escaped) escaped = false;
      else if (char === "\\") escaped = true;
      else if (char === '"') inString = false;
      continue;
    }
    if (char === '"') { inString = true; line += char; }
    else if (char === "{" || char === "[") { line += char; depth++; flush(); }
    else if (char === "}" || char === "]") { depth = Math.max(0, depth - 1); flush(); line += char; }
    else if (char === ",") { line += char; flush(); }
    else if (char === ":") line += ": ";
    else if (char === "\n" || char === "\r" || char === " " || char === "\t") continue;
    else line += char;
  }
  if (line.trim()) lines.push(line);
  return lines;
}

/**
 * @typedef {{ kind: "same" | "removed" | "added", left: string | null, right: string | null }} Row
 */

/**
 * Line diff of `left` against `right` (at most {@link DIFF_LINES_MAX} lines each).
 * @param {string[]} left
 * @param {string[]} right
 * @returns {Row[]}
 */
export function lineDiff(left, right) {
  const a = left.slice(0, DIFF_LINES_MAX), b = right.slice(0, DIFF_LINES_MAX);
  const width = b.length + 1;
  const table = new Uint32Array((a.length + 1) * width);
  for (let i = a.length - 1; i >= 0; i--) {
    for (let j = b.length - 1; j >= 0; j--) {
      table[i * width + j] = a[i] === b[j] ? table[(i + 1) * width + j + 1] + 1
        : Math.max(table[(i + 1) * width + j], table[i * width + j + 1]);
    }
  }
  /** @type {Row[]} */
  const rows = [];
  let i = 0, j = 0;
  while (i < a.length || j < b.length) {
    if (i < a.length && j < b.length && a[i] === b[j]) { rows.push({ kind: "same", left: a[i], right: b[j] }); i++; j++; }
    else if (j < b.length && (i === a.length || table[i * width + j + 1] >= table[(i + 1) * width + j])) { rows.push({ kind: "added", left: null, right: b[j] }); j++; }
    else { rows.push({ kind: "removed", left: a[i], right: null }); i++; }
  }
  return rows;
}
