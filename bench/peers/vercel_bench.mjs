// Vercel AI SDK side of bench/peers (run by bench/peers/run with NODE_PATH pointing at
// target/peers/node/node_modules; versions pinned there by the harness).
//
// Workloads, on the inputs written by `turnstile-peerbench gen`:
// - prepare/N, "vercel_provider": the ModelMessage[] file's bytes → Anthropic request body bytes
//   through the provider-level conversion alone: JSON.parse → `model.getArgs({prompt, tools,
//   maxOutputTokens, ...})` of @ai-sdk/anthropic's language model (the hook below generateText,
//   see ../shared/reference/peers.md §5 "Exact entry points" A; `getArgs` in
//   node_modules/@ai-sdk/anthropic/dist/index.mjs) → JSON.stringify. Skips ai-core validation.
// - prepare/N, "vercel_generateText": the whole `generateText({model, messages, tools})` with a
//   capturing `fetch` that answers a canned Anthropic JSON reply (zod validation of the prompt,
//   conversion, the HTTP body, response parsing): ai-sdk.dev docs "generateText", provider
//   setting `fetch` ("Custom fetch implementation ... for testing").
// - step/N, "vercel_step": the agent step — history held parsed, one user message appended,
//   the whole history converted again (standardizePrompt + convertToLanguageModelPrompt from
//   `ai/internal`, then getArgs + JSON.stringify), as every generateText call of a loop does.
// - stream/<api>/<size>: raw SSE bytes → parsed + assembled stream parts via the provider's
//   `model.doStream({prompt, tools})` (LanguageModelV3; @ai-sdk/provider-utils
//   `parseJsonEventStream` + the provider's tool-input assembly), with a `fetch` that serves the
//   bytes as a ReadableStream in 16 KiB chunks; the consumer concatenates text deltas and
//   collects `tool-call` parts.
// - probe: the six bad inputs through generateText (histories; the body a capturing fetch saw,
//   or the error) and streamText (cut stream: the parts and finish reason), raw observations
//   for bench/peers/report.py.
//
// Timing rule as in bench/peers/common.py: one or two warm-up calls, then runs of ≥ min-run
// seconds each, figure = elapsed / repetitions; Node start-up and imports outside the timings.

import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { createRequire } from 'node:module';
import { generateText, streamText, jsonSchema, tool } from 'ai';
import { createAnthropic } from '@ai-sdk/anthropic';
import { createOpenAI } from '@ai-sdk/openai';

const require = createRequire(import.meta.url);

function arg(name, fallback) {
  const index = process.argv.indexOf(name);
  return index >= 0 ? process.argv[index + 1] : fallback;
}
const inputs = arg('--inputs');
const runs = Number(arg('--runs', '5'));
const minRun = Number(arg('--min-run', '0.3'));
const only = arg('--only', '');
const mode = arg('--mode', 'all');
const skipLarge = process.argv.includes('--skip-large');
const wanted = (workload) => workload.startsWith(only) && !(skipLarge && (workload.endsWith('/2000') || workload.endsWith('/100k')));
const meta = JSON.parse(readFileSync(join(inputs, 'meta.json'), 'utf8'));
const versions = Object.fromEntries(
  ['ai', '@ai-sdk/anthropic', '@ai-sdk/openai', '@ai-sdk/provider-utils'].map((name) => {
    try {
      return [name, require(`${name}/package.json`).version];
    } catch {
      return [name, null];
    }
  }),
);

async function measure(op) {
  let started = process.hrtime.bigint();
  await op();
  let once = Number(process.hrtime.bigint() - started) / 1e9;
  if (once < minRun) {
    started = process.hrtime.bigint();
    await op();
    once = Math.min(once, Number(process.hrtime.bigint() - started) / 1e9);
  }
  const iterations = Math.max(1, Math.ceil(minRun / Math.max(once, 1e-7)));
  const samples = [];
  for (let run = 0; run < runs; run++) {
    started = process.hrtime.bigint();
    for (let i = 0; i < iterations; i++) await op();
    samples.push(Number(process.hrtime.bigint() - started) / 1e9 / iterations);
  }
  return { samples, iterations };
}

function emit(system, workload, { samples, iterations }, extra = {}) {
  console.log(JSON.stringify({ system, workload, unit: 's/op', samples, iterations_per_run: iterations, extra: { ...extra, versions } }));
}
function unavailable(system, workload, reason) {
  console.log(JSON.stringify({ system, workload, unavailable: reason }));
  console.error(`${system} ${workload}: not measured: ${reason}`);
}
function probeLine(system, probe, observation) {
  console.log(JSON.stringify({ probe, system, observation }));
}

const MODEL = 'claude-sonnet-4-5';
const cannedAnthropic = JSON.stringify({
  id: 'msg_canned', type: 'message', role: 'assistant', model: MODEL,
  content: [{ type: 'text', text: 'ok' }], stop_reason: 'end_turn', stop_sequence: null,
  usage: { input_tokens: 10, output_tokens: 1 },
});

/** A fetch that records the request body and answers `reply()`. */
function capturingFetch(reply) {
  const seen = { body: null };
  const fetch = async (url, init) => {
    seen.body = init && init.body;
    return reply();
  };
  return { fetch, seen };
}

function providerTools(tools) {
  return tools.map((t) => ({ type: 'function', name: t.name, description: t.description, inputSchema: t.inputSchema }));
}
function appTools(tools) {
  return Object.fromEntries(tools.map((t) => [t.name, tool({ description: t.description, inputSchema: jsonSchema(t.inputSchema) })]));
}

async function providerConvert(model, raw) {
  const data = JSON.parse(raw);
  const { args } = await model.getArgs({
    prompt: data.messages, maxOutputTokens: 1024, tools: providerTools(data.tools),
    providerOptions: {}, userSuppliedBetas: new Set(), stream: false,
  });
  return JSON.stringify(args);
}

async function generate(raw) {
  const { fetch, seen } = capturingFetch(() => new Response(cannedAnthropic, { headers: { 'content-type': 'application/json' } }));
  const data = JSON.parse(raw);
  const model = createAnthropic({ apiKey: 'sk-bench', fetch })(MODEL);
  // The idiomatic call: a leading system message goes in `system`; any later one stays in
  // `messages` (the probe's mid-conversation system message).
  let messages = data.messages;
  let system;
  if (messages.length && messages[0].role === 'system') {
    system = messages[0].content;
    messages = messages.slice(1);
  }
  await generateText({ model, system, messages, tools: appTools(data.tools), maxOutputTokens: 1024, maxRetries: 0 });
  return seen.body;
}

// The agent step (step/N): what an agent loop built on the AI SDK pays per step. The history
// is held parsed in memory (as the loop holds it); each step appends the new user message and
// converts the whole history again, as generateText does before every call:
// standardizePrompt + convertToLanguageModelPrompt (exported from `ai/internal`), then the
// provider's getArgs and JSON.stringify. The message is popped afterwards so every repetition
// converts the same history plus one message.
let internal = null;
let internalError = null;
try {
  internal = await import('ai/internal');
} catch (error) {
  internalError = String(error && error.message || error);
}
const stepMessage = { role: 'user', content: [{ type: 'text', text: 'And the next question: ' +
  'The committed history is replayed to the provider on every turn, so the adapter renders the same blocks again ' +
  'and again; only the newest turn is new work. Numbers 1, 2, 3.' }] };

/** The history as a loop holds it: the leading system message as `system` (as `generate` passes it). */
function heldHistory(raw) {
  const data = JSON.parse(raw);
  let messages = data.messages;
  let system;
  if (messages.length && messages[0].role === 'system') {
    system = messages[0].content;
    messages = messages.slice(1);
  }
  return { system, messages, tools: data.tools };
}

async function agentStep(model, history) {
  history.messages.push(stepMessage);
  try {
    const standardized = await internal.standardizePrompt({ system: history.system, messages: history.messages });
    const prompt = await internal.convertToLanguageModelPrompt({ prompt: standardized, supportedUrls: {}, download: undefined });
    const { args } = await model.getArgs({
      prompt, maxOutputTokens: 1024, tools: providerTools(history.tools),
      providerOptions: {}, userSuppliedBetas: new Set(), stream: false,
    });
    return JSON.stringify(args);
  } finally {
    history.messages.pop();
  }
}

const READ = 16 * 1024;
function sseResponse(bytes) {
  let offset = 0;
  const body = new ReadableStream({
    pull(controller) {
      if (offset >= bytes.length) return controller.close();
      controller.enqueue(bytes.subarray(offset, offset + READ));
      offset += READ;
    },
  });
  return new Response(body, { headers: { 'content-type': 'text/event-stream' } });
}

function streamModel(api, bytes) {
  const fetch = async () => sseResponse(bytes);
  if (api === 'anthropic') return createAnthropic({ apiKey: 'sk-bench', fetch })(MODEL);
  if (api === 'openai-chat') return createOpenAI({ apiKey: 'sk-bench', fetch }).chat('gpt-4o');
  return null;
}

const streamTools = (tools) => providerTools(tools);
const userPrompt = [{ role: 'user', content: [{ type: 'text', text: 'Weather?' }] }];

async function doStreamAll(api, bytes, tools) {
  const model = streamModel(api, bytes);
  const { stream } = await model.doStream({ prompt: userPrompt, tools: streamTools(tools), maxOutputTokens: 1024, providerOptions: {} });
  let text = '';
  const calls = [];
  let finish = null;
  const errors = [];
  const reader = stream.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    if (value.type === 'text-delta') text += value.delta;
    else if (value.type === 'tool-call') calls.push({ id: value.toolCallId, name: value.toolName, input: value.input });
    else if (value.type === 'finish') finish = value.finishReason;
    else if (value.type === 'error') errors.push(String(value.error && value.error.message || value.error));
  }
  return { textChars: text.length, calls, finish, errors };
}

async function micro() {
  const anthropicModel = createAnthropic({ apiKey: 'sk-bench' })(MODEL);
  for (const blocks of ['20', '200', '2000']) {
    const workload = `prepare/${blocks}`;
    if (!wanted(workload)) continue;
    const raw = readFileSync(join(inputs, `conv-${blocks}.vercel.json`), 'utf8');
    try {
      const body = await providerConvert(anthropicModel, raw);
      emit('vercel_provider', workload, await measure(() => providerConvert(anthropicModel, raw)),
        { input_bytes: raw.length, body_bytes: body.length, what: 'JSON.parse + @ai-sdk/anthropic model.getArgs (provider conversion) + JSON.stringify' });
    } catch (error) {
      unavailable('vercel_provider', workload, String(error && error.message || error));
    }
    try {
      const body = await generate(raw);
      emit('vercel_generateText', workload, await measure(() => generate(raw)),
        { body_bytes: body.length, what: 'JSON.parse + generateText (validation, conversion, body, canned reply parsed) with a capturing fetch' });
    } catch (error) {
      unavailable('vercel_generateText', workload, String(error && error.message || error));
    }
  }
  for (const blocks of ['20', '200', '2000']) {
    const workload = `step/${blocks}`;
    if (!wanted(workload)) continue;
    const raw = readFileSync(join(inputs, `conv-${blocks}.vercel.json`), 'utf8');
    try {
      if (!internal) throw new Error(`ai/internal is not importable: ${internalError}`);
      const history = heldHistory(raw);
      const body = await agentStep(anthropicModel, history);
      emit('vercel_step', workload, await measure(() => agentStep(anthropicModel, history)),
        { body_bytes: body.length, what: 'history held parsed in memory: push one user message + standardizePrompt + convertToLanguageModelPrompt (ai/internal) + @ai-sdk/anthropic getArgs + JSON.stringify' });
    } catch (error) {
      unavailable('vercel_step', workload, String(error && error.message || error));
    }
  }
  const tools = JSON.parse(readFileSync(join(inputs, 'conv-20.vercel.json'), 'utf8')).tools;
  for (const [key, info] of Object.entries(meta.streams).sort()) {
    const api = key.split('/')[0];
    const workload = `stream/${key}`;
    if (!wanted(workload) || !['anthropic', 'openai-chat'].includes(api)) continue;
    const bytes = new Uint8Array(readFileSync(join(inputs, info.file)));
    try {
      const check = await doStreamAll(api, bytes, tools);
      if (check.errors.length) throw new Error(check.errors[0]);
      emit('vercel', workload, await measure(() => doStreamAll(api, bytes, tools)),
        { bytes: bytes.length, events: info.events, tool_calls: check.calls.length, finish_reason: check.finish,
          what: 'provider model.doStream over a 16 KiB-chunked ReadableStream: SSE parse, zod chunk validation, tool-input assembly; consumer joins text' });
    } catch (error) {
      unavailable('vercel', workload, String(error && error.message || error));
    }
  }
}

async function probe() {
  const dir = join(inputs, 'probe');
  for (const name of ['missing_result', 'orphan_result', 'duplicate_result', 'unknown_part', 'mid_system']) {
    const raw = readFileSync(join(dir, `${name}.vercel.json`), 'utf8');
    const warnings = [];
    const originalWarn = console.warn;
    console.warn = (...args) => warnings.push(args.map(String).join(' ').slice(0, 300));
    try {
      const body = await generate(raw);
      probeLine('vercel', name, { outcome: 'body', format: 'anthropic', body: JSON.parse(body), warnings });
    } catch (error) {
      probeLine('vercel', name, { outcome: 'exception', error: `${error && error.name}: ${String(error && error.message).slice(0, 300)}`, warnings });
    } finally {
      console.warn = originalWarn;
    }
  }
  const tools = JSON.parse(readFileSync(join(inputs, 'conv-20.vercel.json'), 'utf8')).tools;
  for (const api of ['anthropic', 'openai-chat']) {
    const bytes = new Uint8Array(readFileSync(join(dir, `cut_stream.${api}.sse`)));
    try {
      const result = streamText({ model: streamModel(api, bytes), messages: userPrompt, tools: appTools(tools), maxRetries: 0 });
      const calls = [];
      const errors = [];
      let finish = null;
      for await (const part of result.fullStream) {
        if (part.type === 'tool-call') calls.push({ id: part.toolCallId, name: part.toolName, input: part.input });
        else if (part.type === 'finish') finish = part.finishReason;
        else if (part.type === 'error') errors.push(String(part.error && part.error.message || part.error).slice(0, 200));
      }
      probeLine('vercel', `cut_stream/${api}`, { outcome: 'stream', tool_calls: calls, finish_reason: finish, errors });
    } catch (error) {
      probeLine('vercel', `cut_stream/${api}`, { outcome: 'exception', error: String(error && error.message || error).slice(0, 300) });
    }
  }
}

if (mode === 'micro' || mode === 'all') await micro();
if (mode === 'probe' || mode === 'all') await probe();
