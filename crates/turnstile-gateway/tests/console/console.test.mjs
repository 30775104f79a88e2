// Browser test of the console (run by tests/it/console.rs, never directly in CI): Debian's
// Chromium drives the page against a gateway with tenants, a shadow route and a catch-all
// proxy route, and a simulator. Assertions are by visible text and accessible names (never by
// colour or CSS class); every wait is a bounded wait for an observable state.
// Env: GATEWAY, SIM, CHROMIUM, PLAYWRIGHT_CORE, TOKEN (the tenant's bearer token),
// SCREENSHOT_DIR (where console-desktop.png and console-narrow.png go).
import { createRequire } from "node:module";
import assert from "node:assert/strict";

const require = createRequire(import.meta.url);
const { chromium } = require(process.env.PLAYWRIGHT_CORE);
const base = process.env.GATEWAY;
const sim = process.env.SIM;
const auth = { authorization: "Bearer " + process.env.TOKEN, "content-type": "application/json" };
const WAIT = { timeout: 30000 };

const call = async (method, path, body, at = base) => {
  const response = await fetch(at + path, { method, headers: auth, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await response.text();
  return { status: response.status, text, json: text ? JSON.parse(text) : null };
};
const post = async (path, body, at = base) => {
  const answer = await call("POST", path, body, at);
  assert.ok(answer.status < 300, `${path}: ${answer.status} ${answer.text}`);
  return answer.json;
};
const userTurn = (id, text, extra = []) => ({ id, role: "user", blocks: [{ id: id + "-b", kind: "text", text }, ...extra] });
const conversation = async (id, text) => {
  await post("/v1/conversations", { conversation_id: id });
  await post(`/v1/conversations/${id}/turns`, { expected_revision: 0, turn: userTurn("t1", text) });
};
const script = (model, replies) => post("/sim/script", { model, replies }, sim);
/** Poll an observable state: at most 600 looks, 50 ms apart (pacing only, never ordering). */
const until = async (what, check, attempts = 600) => {
  for (let i = 0; i < attempts; i++) {
    if (await check()) return;
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  throw new Error("never: " + what);
};

// 200 conversations to search among, and the ones the scenarios use.
for (let i = 0; i < 200; i++) await post("/v1/conversations", { conversation_id: `bulk-${String(i).padStart(3, "0")}` });
const longUrl = "https://example.com/" + "a-very-long-path-segment/".repeat(24);
await conversation("c-console", "Weather in Paris? See " + longUrl);
await conversation("c-alpha", "Tell me a long story");
await conversation("c-seed", "Pick a number");
await conversation("c-reload", "Talk slowly");
await post("/v1/conversations", { conversation_id: "c-paused" });
await post("/v1/conversations/c-paused/turns", { expected_revision: 0, turn: userTurn("t1", "Summarise the file",
  [{ id: "t1-doc", kind: "document", media_type: "text/plain", data: Buffer.from("hello").toString("base64"), title: "notes.txt" }]) });

const browser = await chromium.launch({ executablePath: process.env.CHROMIUM, headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"] });
const errors = [];
let failedPage = null;
try {
  const context = await browser.newContext({ viewport: { width: 1440, height: 900 } });
  await context.grantPermissions(["clipboard-read", "clipboard-write"], { origin: base });
  const page = await context.newPage();
  failedPage = page;
  page.on("pageerror", (error) => errors.push(String(error)));
  const noOverflow = async (label) => {
    const { scroll, client, wide } = await page.evaluate(() => {
      const client = document.documentElement.clientWidth;
      const wide = [...document.querySelectorAll("body *")].filter((node) => node.getBoundingClientRect().right > client + 1
          || (node.scrollWidth > client + 1 && getComputedStyle(node).overflowX === "visible"))
        .slice(-5).map((node) => `${node.tagName.toLowerCase()}#${node.id}.${node.className} ${node.getBoundingClientRect().right}/${node.scrollWidth}`);
      return { scroll: document.documentElement.scrollWidth, client, wide };
    });
    assert.ok(scroll <= client, `${label}: the page is ${scroll} px wide in a ${client} px viewport; widest: ${wide.join(", ")}`);
  };
  const bodyText = () => page.evaluate(() => document.body.innerText);
  const dispatchButton = page.getByRole("button", { name: /^Dispatch/ });

  // 1. Missing token: said in words; Enter in the token field submits it.
  await page.goto(base + "/");
  await page.getByRole("alert").filter({ hasText: "needs a tenant token" }).waitFor(WAIT);
  await page.getByLabel("Token", { exact: true }).fill(process.env.TOKEN);
  await page.getByLabel("Token", { exact: true }).press("Enter");
  await page.getByText("Live updates on").waitFor(WAIT);

  // 2. Search finds one conversation among 200 (Enter submits the search).
  await page.getByRole("link", { name: /bulk-199/ }).waitFor(WAIT);
  await page.getByRole("searchbox", { name: "Search" }).fill("bulk-137");
  await page.getByRole("searchbox", { name: "Search" }).press("Enter");
  await page.getByRole("link", { name: /bulk-137/ }).waitFor(WAIT);
  await until("the list shows only bulk-137", async () =>
    (await page.getByRole("navigation", { name: "Conversations" }).getByRole("link", { name: /^bulk-/ }).count()) === 1);
  await page.getByRole("searchbox", { name: "Search" }).fill("");
  await page.getByRole("searchbox", { name: "Search" }).press("Enter");

  // 3. Deep link to a conversation; preview → retract → commit; a double click streams once.
  await script("console", [
    { text: "This first answer is cut off before it ends and never becomes history", faults: { cut_at_byte: 900, delay_ms: 120 } },
    { text: "Paris is 12C and rainy." }]);
  await page.goto(base + "/#/c/c-console");
  await page.getByRole("heading", { name: /Conversation c-console/ }).waitFor(WAIT);
  await page.getByLabel("Model", { exact: true }).fill("console");
  await page.getByLabel("Operation", { exact: true }).fill("op-console");
  await dispatchButton.dblclick();
  // The preview lives only until the cut: read it in the page the moment it shows (its label
  // in text and as the region's accessible name, the Dispatch button's state, its contrast).
  const seen = await (await page.waitForFunction(() => {
    const region = [...document.querySelectorAll("section[aria-label]")]
      .find((node) => node.getAttribute("aria-label") === "Preview of generation 1, not committed");
    if (!region) return null;
    const rgb = (text) => text.match(/\d+(\.\d+)?/g).slice(0, 3).map(Number);
    const lum = ([r, g, b]) => { const f = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
      return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b); };
    const [a, b] = [lum(rgb(getComputedStyle(region.lastElementChild || region).color)), lum(rgb(getComputedStyle(region).backgroundColor))]
      .sort((x, y) => y - x);
    const button = [...document.querySelectorAll("button")].find((node) => /^Dispatch/.test(node.innerText));
    return { text: region.innerText, ratio: (a + 0.05) / (b + 0.05), button: button?.innerText, disabled: button?.disabled };
  }, null, WAIT)).jsonValue();
  assert.match(seen.text, /Preview — not history yet/);
  assert.deepEqual([seen.button, seen.disabled], ["Dispatching…", true], "no second Dispatch while one runs");
  assert.ok(seen.ratio >= 4.5, `preview contrast ${seen.ratio.toFixed(2)}:1 is below 4.5:1`);
  await page.getByText(/preview of generation 1 retracted/).first().waitFor({ state: "attached", ...WAIT });
  await page.getByRole("region", { name: "Preview of generation 1, not committed" }).waitFor({ state: "detached", ...WAIT });
  await page.getByRole("article", { name: /assistant turn, revision 2/ }).waitFor(WAIT);
  const text = await bodyText();
  assert.equal(text.split("Paris is 12C and rainy.").length - 1, 1, "the committed text is shown exactly once");
  assert.doesNotMatch(await page.getByLabel("Committed history").innerText(), /cut off/);
  const consoleRequests = (await (await fetch(sim + "/sim/requests")).json()).filter((r) => JSON.parse(r.body).model === "console");
  assert.equal(consoleRequests.length, 2, "one cut attempt and one retry: the double click opened one dispatch");
  // The dispatch view: both attempts, each with its states.
  await page.getByRole("heading", { name: "Attempts" }).waitFor(WAIT);
  await page.getByRole("list", { name: "states of generation 2" }).waitFor(WAIT);
  await noOverflow("1440 px, long URL, dispatch view open");

  // 4. A turn committed by another client appears by itself.
  const document = await (await call("GET", "/v1/conversations/c-console")).json;
  await post("/v1/conversations/c-console/turns", { expected_revision: document.revision, turn: userTurn("t-other", "Sent by another client") });
  await page.getByText("Sent by another client").waitFor({ timeout: 10000 });

  // 5. Preview of A is never shown in B, and A's commit is shown when A is opened again.
  await script("alpha", [{ text: "ALPHA-PREVIEW " + "word ".repeat(40), faults: { delay_ms: 60 } }]);
  await page.goto(base + "/#/c/c-alpha");
  await page.getByLabel("Model", { exact: true }).fill("alpha");
  await page.getByLabel("Operation", { exact: true }).fill("op-alpha");
  await dispatchButton.click();
  await page.getByRole("region", { name: /Preview of generation 1/ }).waitFor(WAIT);
  await page.getByRole("link", { name: /c-console/ }).click();
  await page.getByRole("heading", { name: /Conversation c-console/ }).waitFor(WAIT);
  await page.evaluate(() => {
    window.__alphaInB = false;
    new MutationObserver(() => { if (document.body.innerText.includes("ALPHA-PREVIEW")) window.__alphaInB = true; })
      .observe(document.body, { subtree: true, childList: true, characterData: true });
  });
  await until("op-alpha commits", async () => (await call("GET", "/v1/dispatches/op-alpha")).json.state === "COMMITTED");
  assert.equal(await page.evaluate(() => window.__alphaInB || document.body.innerText.includes("ALPHA-PREVIEW")), false,
    "A's preview or text appeared under B");
  await page.getByRole("link", { name: /c-alpha/ }).click();
  await page.getByRole("article", { name: /assistant turn, revision 2/ }).filter({ hasText: "ALPHA-PREVIEW" }).waitFor(WAIT);

  // 6. The exact request bytes: a 19-digit seed shown exactly, SHA-256 checked, copy works.
  await script("seeded", [{ text: "Seven." }]);
  await page.goto(base + "/#/c/c-seed");
  await page.getByLabel("Model", { exact: true }).fill("seeded");
  await page.getByLabel("Seed", { exact: true }).fill("1234567890123456789");
  await page.getByLabel("Seed", { exact: true }).press("Enter");
  await page.getByRole("heading", { name: "Operation" }).or(page.getByText(/^Operation op-/)).first().waitFor(WAIT);
  const body = page.getByLabel("request body exactly as sent");
  await body.filter({ hasText: '"model":"seeded"' }).waitFor(WAIT);
  const shown = await body.innerText();
  assert.ok(shown.includes('"seed":1234567890123456789'), shown);
  await page.getByText("✓ SHA-256 of these bytes matches the manifest's request_digest").waitFor(WAIT);
  await page.getByRole("button", { name: "Copy request body" }).click();
  await page.getByText("copied", { exact: true }).waitFor(WAIT);
  assert.equal(await page.evaluate(() => navigator.clipboard.readText()), shown);

  // 7. A reload mid-stream re-attaches: the preview comes back and the commit is shown.
  await script("slow", [{ text: "RELOAD-PREVIEW " + "slowly ".repeat(40), faults: { delay_ms: 80 } }]);
  await page.goto(base + "/#/c/c-reload");
  await page.getByLabel("Model", { exact: true }).fill("slow");
  await page.getByLabel("Operation", { exact: true }).fill("op-reload");
  await dispatchButton.click();
  await page.getByRole("region", { name: /Preview of generation 1/ }).filter({ hasText: "RELOAD-PREVIEW" }).waitFor(WAIT);
  await page.reload();
  await page.getByRole("region", { name: /Preview of generation 1/ }).filter({ hasText: "RELOAD-PREVIEW" }).waitFor(WAIT);
  await page.getByRole("article", { name: /assistant turn, revision 2/ }).filter({ hasText: "RELOAD-PREVIEW" }).waitFor(WAIT);

  // 8. Paused, in words.
  await page.goto(base + "/#/c/c-paused");
  await page.getByLabel("Model", { exact: true }).fill("paused");
  await page.getByLabel("Adapter", { exact: true }).selectOption("openai-chat@1");
  await dispatchButton.click();
  await page.getByRole("alert").filter({ hasText: "Paused: the adapter cannot represent this conversation" }).waitFor(WAIT);

  // 9. A proxy refusal with its offending block marked; a shadow comparison side by side.
  const refused = await fetch(base + "/v1/chat/completions", { method: "POST", headers: auth, body: JSON.stringify({ model: "any", messages: [
    { role: "user", content: "hi" }, { role: "tool", tool_call_id: "call_nobody", content: "ORPHAN-CONTENT" }] }) });
  assert.equal(refused.status, 400);
  const refusal = page.getByRole("complementary", { name: "Operations" }).getByText(/orphan_result/).first();
  await refusal.waitFor(WAIT);
  await refusal.click();
  await page.getByText(/⚠ offending block: orphan_result/).waitFor(WAIT);
  assert.match(await page.getByLabel("offending block").first().innerText(), /ORPHAN-CONTENT/);
  await script("shadow-console", [{ text: "forwarded" }]);
  const shadowed = await fetch(base + "/v1/chat/completions", { method: "POST", headers: auth, body: JSON.stringify({ model: "shadow-console",
    messages: [{ role: "user", content: "compare me" }] }) });
  assert.equal(shadowed.status, 200);
  await page.getByRole("button", { name: "Compare side by side" }).first().click();
  await page.getByRole("columnheader", { name: "client's request (openai-chat)" }).waitFor(WAIT);
  await page.getByRole("columnheader", { name: "ours (openai-chat@2)" }).waitFor(WAIT);
  assert.match(await page.locator("table.diff").innerText(), /compare me/);

  // 10. Layout from wide to narrow with long content and the dispatch view open.
  // A retry's reason is durable: after a reload (deep link to the dispatch) it is still shown.
  await page.goto(base + "/#/c/c-console/d/op-console");
  await page.reload();
  await page.getByRole("heading", { name: "Attempts" }).waitFor(WAIT);
  const first = page.getByRole("listitem").filter({ hasText: /^Generation 1/ });
  await first.getByText(/^Ended: the provider's stream was cut \(cut_stream\)$/).waitFor(WAIT);
  await page.getByRole("listitem").filter({ hasText: /^Generation 2/ }).getByText(/^Ended: .*\(committed\)$/).waitFor(WAIT);
  await noOverflow("1440 px");
  await page.screenshot({ path: process.env.SCREENSHOT_DIR + "/console-desktop.png" });
  for (const width of [390, 360]) {
    await page.setViewportSize({ width, height: 844 });
    await page.getByText("Paris is 12C and rainy.").waitFor(WAIT);
    await noOverflow(`${width} px`);
  }
  await page.setViewportSize({ width: 390, height: 844 });
  await page.getByRole("heading", { name: /Conversation c-console/ }).scrollIntoViewIfNeeded();
  await page.screenshot({ path: process.env.SCREENSHOT_DIR + "/console-narrow.png" });

  // 11. The gateway unreachable: said in words.
  await page.setViewportSize({ width: 1440, height: 900 });
  await page.route("**/v1/**", (route) => route.abort());
  await page.reload();
  await page.getByRole("alert").filter({ hasText: "cannot be reached" }).first().waitFor(WAIT);
  await page.unroute("**/v1/**");

  // 12. A history repair on record: who, when, what changed; the gateway's cancel says whose it is.
  await post("/v1/conversations", { conversation_id: "c-repair", tools: [{ name: "get_weather", input_schema: { type: "object" } }] });
  await post("/v1/conversations/c-repair/turns", { expected_revision: 0, turn: userTurn("t1", "Weather in Oslo?") });
  await post("/v1/conversations/c-repair/turns", { expected_revision: 1, turn: { id: "t2", role: "assistant", generation: 1,
    blocks: [{ id: "a1", kind: "tool_call", call_id: "call-oslo", tool: "get_weather", arguments: { city: "Oslo" } }] } });
  await post("/v1/conversations/c-repair/repair", { expected_revision: 2, actor: "console-test" });
  await page.goto(base + "/#/c/c-repair");
  const repairs = page.getByRole("region", { name: "History repairs" });
  await repairs.getByText(/^Repaired at revision 3 .* by console-test \(tenant ops\)$/).waitFor(WAIT);
  await repairs.getByText("cancelled call call-oslo in the gateway's name (pending_call)").waitFor(WAIT);
  await page.getByText("result · cancel · by the gateway's history repair").waitFor(WAIT);

  assert.deepEqual(errors, [], "no uncaught error in the page");
  console.log("console test passed; screenshots in " + process.env.SCREENSHOT_DIR);
  failedPage = null;
} finally {
  // On a failure, what the page said (the assertion's own message follows).
  if (failedPage) console.error("page text at the failure:\n" + await failedPage.evaluate(() => document.body.innerText).catch(() => "(unreadable)"));
  await browser.close();
}
