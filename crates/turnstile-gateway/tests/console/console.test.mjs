// Browser test of the console (run by tests/it/console.rs, never directly in CI):
// a cut stream's preview appears greyed and marked "preview", is retracted, and the committed
// turn replaces it; a shadowed proxy request appears in the rollout view. Env: GATEWAY (base URL), SIM (simulator URL), CHROMIUM (executable), PLAYWRIGHT_CORE (module
// path), SCREENSHOT (output PNG).
import { createRequire } from "node:module";
import assert from "node:assert/strict";

const require = createRequire(import.meta.url);
const { chromium } = require(process.env.PLAYWRIGHT_CORE);
const base = process.env.GATEWAY;
const post = async (path, body, at = base) => {
  const response = await fetch(at + path, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) });
  assert.ok(response.ok, `${path}: ${response.status} ${await response.text()}`);
};

await post("/v1/conversations", { conversation_id: "c-console" });
await post("/v1/conversations/c-console/turns", { expected_revision: 0, turn: { id: "t1", role: "user",
  blocks: [{ id: "u1", kind: "text", text: "Weather in Paris?" }] } });
await post("/sim/script", { model: "console", replies: [
  { text: "This first answer is cut off before it ends and never becomes history", faults: { cut_at_byte: 900, delay_ms: 120 } },
  { text: "Paris is 12C and rainy." }] }, process.env.SIM);

const browser = await chromium.launch({ executablePath: process.env.CHROMIUM, headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"] });
try {
  const page = await browser.newPage();
  await page.goto(base + "/");
  await page.fill("#conversation", "c-console");
  await page.click("#open");
  await page.waitForSelector('[data-testid=turn][data-role=user]');
  await page.fill("#model", "console");
  await page.fill("#operation", "op-console");
  await page.click("#dispatch");

  // 1. Preview appears, visibly distinct from committed text and labelled.
  const preview = await page.waitForSelector('[data-testid=preview][data-generation="1"]', { timeout: 20000 });
  assert.match(await preview.innerText(), /preview/);
  const previewColor = await preview.evaluate((node) => getComputedStyle(node).color);
  const committedColor = await page.$eval('[data-testid=turn] [data-testid=block]', (node) => getComputedStyle(node).color);
  assert.notEqual(previewColor, committedColor, "preview must look different from history");

  // 2. It is retracted: gone from the page, and the retraction is shown.
  await page.waitForSelector('[data-testid=retraction]', { timeout: 20000 });
  await page.waitForSelector('[data-testid=preview][data-generation="1"]', { state: "detached", timeout: 20000 });

  // 3. The committed turn replaces it; nothing of the cut answer is history.
  await page.waitForSelector('[data-testid=turn][data-role=assistant]', { timeout: 30000 });
  const assistant = await page.$eval('[data-testid=turn][data-role=assistant]', (node) => node.innerText);
  assert.match(assistant, /Paris is 12C and rainy\./);
  assert.doesNotMatch(await page.$eval("#turns", (node) => node.innerText), /cut off/);
  assert.equal(await page.$$eval("[data-testid=preview]", (nodes) => nodes.length), 0);

  // 4. The dispatch view shows both attempts with their timelines.
  await page.waitForFunction(() => document.querySelectorAll("[data-testid=attempt]").length === 2, null, { timeout: 20000 });

  // 5. A shadowed proxy request (route `shadow-*`, see console.rs) shows up in the rollout view
  // with what the validator would have done: an orphan tool result is "rejected".
  await post("/sim/script", { model: "shadow-console", replies: [{ text: "forwarded" }] }, process.env.SIM);
  await post("/v1/chat/completions", { model: "shadow-console", messages: [
    { role: "user", content: "hi" }, { role: "tool", tool_call_id: "call_nobody", content: "x" }] });
  const row = await page.waitForSelector('[data-testid=shadow-diff][data-verdict=rejected]', { timeout: 20000 });
  assert.match(await row.innerText(), /shadow-console/);
  assert.match(await row.innerText(), /orphan_result/);
  await page.waitForFunction(() => /1 compared/.test(document.querySelector("[data-testid=shadow-summary]").innerText),
    null, { timeout: 20000 });
  await page.screenshot({ path: process.env.SCREENSHOT, fullPage: true });
  console.log("console test passed; screenshot at " + process.env.SCREENSHOT);
} finally {
  await browser.close();
}
