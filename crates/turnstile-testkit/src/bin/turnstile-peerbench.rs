//! `turnstile-peerbench`: the Turnstile side of the side-by-side peer benchmarks
//! (`bench/peers/run`, figures in docs/benchmarks.md "Side by side with the peers").
//!
//! - `gen --out DIR`: writes the shared inputs, deterministically: conversations of 20, 200 and
//!   2,000 blocks with parallel tool calls, each exported in every system's own input format
//!   (`turnstile.conversation.v1`, OpenAI chat messages for LiteLLM, Vercel `ModelMessage[]`,
//!   TensorZero input), provider streams of ~1k and ~100k SSE events per API (real wire bytes
//!   from `turnstile_adapters::simulate::wire`, the simulator's own encoder), and the six bad
//!   inputs of the correctness probe in every format.
//! - `micro --inputs DIR --runs N`: times, in this process, the prepare path (parse v1 bytes +
//!   validate + MessageSequence + render `anthropic-messages@1` + token admission + manifest,
//!   cold render cache) and decode + assemble of each stream file, each beside its floor in the
//!   same run (serde_json parse + SHA-256 of the same bytes), and the agent step (`step/N`:
//!   the conversation kept in memory with the render cache of its previous prepare, one user
//!   turn pushed, the next request prepared). One JSON line per measurement.
//! - `load --target turnstile|chat --base URL ...`: a closed-loop HTTP load generator (fixed
//!   concurrency), the same client for `turnstile serve`, the LiteLLM proxy and the simulator.
//! - `relay --listen ADDR --upstream URL`: the ceiling of a gateway built on Turnstile's HTTP
//!   stack. It serves `POST /v1/chat/completions` on the gateway's own listener
//!   (`turnstile_gateway::serve::listener`, axum, the same limits and runtime) and forwards the
//!   body unread to `URL` with a reqwest client built as the gateway builds its own, then
//!   answers with the provider's status and bytes: no parse, no store, no render. What it
//!   reaches is the most any gateway on this stack could do between this client and this
//!   simulator (docs/benchmarks-log.md, "The relay ceiling").
//!
//! Timing rule shared with the Python and Node peers' harnesses: one warm-up call, then each
//! run repeats the operation enough times to last at least `--min-run-ms`; a run's figure is
//! its elapsed time / repetitions. Medians and min–max are over runs.

use serde_json::{Value, json};

/// The allocator the gateway binary uses (`turnstile-gateway/src/main.rs`), so the in-process
/// rows (prepare, step, stream decode, and their floors) measure Turnstile's code as it runs
/// in the gateway. Before 2026-12-02 (run 8 and earlier) this harness used the system
/// allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use turnstile_adapters::decode::StreamApi;
use turnstile_adapters::simulate::script::{Faults, Reply, ScriptedCall};
use turnstile_adapters::simulate::wire::{self, Api};
use turnstile_adapters::{AdapterId, Catalog, Graph, PrepareOutcome, PrepareRequest, RenderCache, prepare};
use turnstile_core::assemble::{Assembler, AssemblerConfig, Output, Toolset};
use turnstile_core::{Digest, Generation, MessageSequence, Validated, parse};

fn usage() -> ! {
    eprintln!(
        "usage: turnstile-peerbench gen --out DIR\n\
         \x20      turnstile-peerbench micro --inputs DIR [--runs N] [--min-run-ms MS] [--only PREFIX] [--skip-large] [--whole-only] [--stages] [--clock wall|cpu]\n\
         \x20      turnstile-peerbench load --target turnstile|chat --base URL --model M \
         [--requests N] [--concurrency C] [--runs R] [--label L] [--fresh-connections] [--stream] [--rate REQ_PER_S]\n\
         \x20      turnstile-peerbench step --base URL --inputs DIR [--steps K] [--runs R] [--model M] [--sizes 20,200,2000]\n\
         \x20      turnstile-peerbench fsync --dir DIR [--count N] [--label L]\n\
         \x20      turnstile-peerbench relay --listen ADDR --upstream URL"
    );
    std::process::exit(2)
}

struct Args(Vec<String>);

impl Args {
    fn value(&self, name: &str) -> Option<String> {
        self.0
            .iter()
            .position(|arg| arg == name)
            .and_then(|index| self.0.get(index + 1).cloned())
    }
    fn number(&self, name: &str, default: u64) -> u64 {
        self.value(name)
            .map(|value| value.parse().unwrap_or_else(|_| usage()))
            .unwrap_or(default)
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let Some(command) = argv.first().cloned() else {
        usage()
    };
    let args = Args(argv);
    match command.as_str() {
        "gen" => generate(Path::new(&args.value("--out").unwrap_or_else(|| usage()))),
        "micro" => micro(&args),
        "load" => load(&args),
        "step" => http_step(&args),
        "fsync" => fsync_probe(&args),
        "relay" => relay(&args),
        _ => usage(),
    }
}

// ---------------------------------------------------------------------------------------------
// Inputs
// ---------------------------------------------------------------------------------------------

const TOOL_NAME: &str = "get_weather";
const PARAGRAPH: &str = "The committed history is replayed to the provider on every turn, so the \
adapter renders the same blocks again and again; only the newest turn is new work. Numbers 1, 2, 3.";
const CITIES: [&str; 6] = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Hanoi"];

fn tool_schema() -> Value {
    json!({"type": "object", "properties": {"city": {"type": "string"}, "note": {"type": "string"}},
           "required": ["city"], "additionalProperties": false})
}

/// One part of a message, independent of any format.
#[derive(Clone)]
enum Part {
    Text(String),
    Call { id: String, args: Value },
    Result { id: String, text: String, error: bool },
    Unknown,
}

#[derive(Clone)]
struct Msg {
    role: &'static str,
    parts: Vec<Part>,
}

fn msg(role: &'static str, parts: Vec<Part>) -> Msg {
    Msg { role, parts }
}

fn text(value: impl Into<String>) -> Part {
    Part::Text(value.into())
}

/// A ready conversation of exactly `blocks` blocks (20, 200, 2,000): a system block, rounds of
/// user (text) → assistant (text + two parallel calls) → tool (two results, out of order, one
/// an error), then a closing user question.
fn conversation(blocks: usize) -> Vec<Msg> {
    assert!(blocks >= 8 && (blocks - 2).is_multiple_of(6), "blocks = 2 + 6k");
    let mut messages = vec![msg("system", vec![text("You are a careful assistant.")])];
    for round in 0..(blocks - 2) / 6 {
        let a = format!("call_{round}_a");
        let b = format!("call_{round}_b");
        messages.push(msg("user", vec![text(format!("Question {round}: {PARAGRAPH}"))]));
        messages.push(msg(
            "assistant",
            vec![
                text(format!("Looking up round {round}.")),
                Part::Call {
                    id: a.clone(),
                    args: json!({"city": CITIES[round % CITIES.len()]}),
                },
                Part::Call {
                    id: b.clone(),
                    args: json!({"city": CITIES[(round + 1) % CITIES.len()], "note": "metric"}),
                },
            ],
        ));
        messages.push(msg(
            "tool",
            vec![
                Part::Result {
                    id: b,
                    text: format!("{round}C, {PARAGRAPH}"),
                    error: false,
                },
                Part::Result {
                    id: a,
                    text: "upstream timeout".into(),
                    error: true,
                },
            ],
        ));
    }
    messages.push(msg("user", vec![text("Summarise the weather so far.")]));
    messages
}

fn call_name(_id: &str) -> &'static str {
    TOOL_NAME
}

fn export_v1(messages: &[Msg], conversation_id: &str) -> Value {
    let mut turns = Vec::new();
    let mut block = 0;
    // A result carries its call's tool, arguments digest and generation (the validator's rule).
    let mut call_digests = std::collections::HashMap::new();
    for message in messages {
        for part in &message.parts {
            if let Part::Call { id, args } = part {
                let arguments = match args {
                    Value::Object(map) => {
                        Some(turnstile_core::conversation::Arguments::from_object(map.clone()))
                    }
                    Value::String(text) => {
                        Some(turnstile_core::conversation::Arguments::from_text(text.clone()))
                    }
                    _ => None,
                };
                if let Some(digest) = arguments.as_ref().and_then(|a| a.digest()) {
                    call_digests.insert(id.clone(), digest.as_str().to_owned());
                }
            }
        }
    }
    for (index, message) in messages.iter().enumerate() {
        let blocks: Vec<Value> = message
            .parts
            .iter()
            .map(|part| {
                block += 1;
                let id = format!("b-{block}");
                match part {
                    Part::Text(text) => json!({"id": id, "kind": "text", "text": text}),
                    Part::Call { id: call, args } => {
                        json!({"id": id, "kind": "tool_call", "call_id": call, "tool": call_name(call), "arguments": args})
                    }
                    Part::Result { id: call, text, error } => json!({"id": id, "kind": "tool_result", "call_id": call,
                        "tool": call_name(call), "args_digest": call_digests.get(call), "generation": 1,
                        "status": if *error { "error" } else { "success" },
                        "content": [{"kind": "text", "text": text}]}),
                    Part::Unknown => json!({"id": id, "kind": "hologram", "data": "3d"}),
                }
            })
            .collect();
        let mut turn = json!({"id": format!("t-{}", index + 1), "revision": index + 1, "role": message.role, "blocks": blocks});
        if message.role == "assistant" {
            turn["generation"] = json!(1);
        }
        turns.push(turn);
    }
    json!({"format": "turnstile.conversation.v1", "conversation_id": conversation_id, "revision": messages.len(),
           "tools": [{"name": TOOL_NAME, "description": "Current weather for a city", "input_schema": tool_schema()}],
           "turns": turns})
}

/// OpenAI Chat Completions `messages` + `tools` (LiteLLM's input format).
fn export_openai(messages: &[Msg]) -> Value {
    let mut out = Vec::new();
    for message in messages {
        match message.role {
            "tool" => {
                for part in &message.parts {
                    if let Part::Result { id, text, .. } = part {
                        out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
                    }
                }
            }
            "assistant" => {
                let text: Vec<&str> = message
                    .parts
                    .iter()
                    .filter_map(|p| {
                        if let Part::Text(t) = p {
                            Some(t.as_str())
                        } else {
                            None
                        }
                    })
                    .collect();
                let calls: Vec<Value> = message
                    .parts
                    .iter()
                    .filter_map(|p| match p {
                        Part::Call { id, args } => Some(json!({"id": id, "type": "function",
                            "function": {"name": call_name(id), "arguments": args.to_string()}})),
                        _ => None,
                    })
                    .collect();
                let mut value = json!({"role": "assistant", "content": if text.is_empty() { Value::Null } else { json!(text.concat()) }});
                if !calls.is_empty() {
                    value["tool_calls"] = json!(calls);
                }
                out.push(value);
            }
            role => {
                let only_text = message.parts.len() == 1 && matches!(message.parts[0], Part::Text(_));
                let content = if only_text {
                    let Part::Text(text) = &message.parts[0] else {
                        unreachable!()
                    };
                    json!(text)
                } else {
                    json!(
                        message
                            .parts
                            .iter()
                            .map(|p| match p {
                                Part::Text(t) => json!({"type": "text", "text": t}),
                                _ => json!({"type": "hologram", "hologram": {"data": "3d"}}),
                            })
                            .collect::<Vec<_>>()
                    )
                };
                out.push(json!({"role": role, "content": content}));
            }
        }
    }
    json!({"messages": out, "tools": [{"type": "function", "function": {"name": TOOL_NAME,
           "description": "Current weather for a city", "parameters": tool_schema()}}]})
}

/// Vercel AI SDK `ModelMessage[]` (also a valid `LanguageModelV3Prompt` for the provider-level
/// conversion) + tools as `{name, description, inputSchema}`.
fn export_vercel(messages: &[Msg]) -> Value {
    let out: Vec<Value> = messages
        .iter()
        .map(|message| {
            if message.role == "system" {
                let text: String = message
                    .parts
                    .iter()
                    .filter_map(|p| if let Part::Text(t) = p { Some(t.as_str()) } else { None })
                    .collect();
                return json!({"role": "system", "content": text});
            }
            let parts: Vec<Value> = message
                .parts
                .iter()
                .map(|part| match part {
                    Part::Text(t) => json!({"type": "text", "text": t}),
                    Part::Call { id, args } => {
                        json!({"type": "tool-call", "toolCallId": id, "toolName": call_name(id), "input": args})
                    }
                    Part::Result { id, text, error } => json!({"type": "tool-result", "toolCallId": id,
                        "toolName": call_name(id), "output": {"type": if *error { "error-text" } else { "text" }, "value": text}}),
                    Part::Unknown => json!({"type": "hologram", "data": "3d"}),
                })
                .collect();
            json!({"role": message.role, "content": parts})
        })
        .collect();
    json!({"messages": out, "tools": [{"name": TOOL_NAME, "description": "Current weather for a city", "inputSchema": tool_schema()}]})
}

/// TensorZero embedded-client `input` (`system` + user/assistant messages with `text`,
/// `tool_call`, `tool_result` blocks); tool results travel in a user message. A system message
/// after the first goes in as a message of role `system` (TensorZero has no such role: the
/// probe shows what the client does with it).
fn export_tensorzero(messages: &[Msg]) -> Value {
    let mut system = Value::Null;
    let mut out = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        let parts: Vec<Value> = message
            .parts
            .iter()
            .map(|part| match part {
                Part::Text(t) => json!({"type": "text", "text": t}),
                Part::Call { id, args } => json!({"type": "tool_call", "id": id, "name": call_name(id), "arguments": args.to_string()}),
                Part::Result { id, text, .. } => json!({"type": "tool_result", "id": id, "name": call_name(id), "result": text}),
                Part::Unknown => json!({"type": "hologram", "data": "3d"}),
            })
            .collect();
        match message.role {
            "system" if index == 0 => {
                if let Some(Part::Text(t)) = message.parts.first() {
                    system = json!(t);
                }
            }
            "tool" => out.push(json!({"role": "user", "content": parts})),
            role => out.push(json!({"role": role, "content": parts})),
        }
    }
    json!({"system": system, "messages": out})
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
}

fn write_json(path: &Path, value: &Value) {
    write(path, &serde_json::to_vec(value).unwrap());
}

/// Stream sizes: (label, text words, parallel calls, argument bytes per call).
const STREAMS: [(&str, usize, usize, usize); 2] = [("1k", 600, 4, 760), ("100k", 60_000, 40, 8_000)];

fn stream_reply(words: usize, calls: usize, arg_bytes: usize) -> Reply {
    const WORDS: [&str; 7] = ["the", "weather", "in", "Paris", "is", "mild", "today,"];
    let text: Vec<&str> = (0..words).map(|i| WORDS[i % 7]).collect();
    let tool_calls = (0..calls)
        .map(|call| {
            let city = CITIES[call % CITIES.len()];
            let skeleton = json!({"city": city, "note": ""}).to_string().len();
            let note: String = "metric units please "
                .chars()
                .cycle()
                .take(arg_bytes.saturating_sub(skeleton))
                .collect();
            ScriptedCall {
                id: Some(format!("toolu_{call:03}")),
                name: TOOL_NAME.into(),
                arguments: json!({"city": city, "note": note}),
            }
        })
        .collect();
    Reply {
        text: text.join(" "),
        tool_calls,
        faults: Faults::default(),
    }
}

fn api_name(api: Api) -> &'static str {
    match api {
        Api::Anthropic => "anthropic",
        Api::OpenAiChat => "openai-chat",
        Api::OpenAiResponses => "openai-responses",
        Api::Gemini => "gemini",
    }
}

const STREAM_APIS: [Api; 4] = [Api::Anthropic, Api::OpenAiChat, Api::OpenAiResponses, Api::Gemini];

fn encode(api: Api, reply: &Reply) -> (Vec<u8>, usize) {
    let ids = wire::call_ids(api, reply, 1);
    let frames = wire::frames(api, reply, "msg_bench_0001", "bench-model", &ids, 4096);
    let count = frames.len();
    (frames.into_iter().flat_map(|frame| frame.bytes).collect(), count)
}

fn generate(out: &Path) {
    std::fs::create_dir_all(out.join("probe")).unwrap();
    let mut meta = json!({"conversations": {}, "streams": {}, "probe": {}});
    for blocks in [20usize, 200, 2_000] {
        let messages = conversation(blocks);
        write_json(
            &out.join(format!("conv-{blocks}.v1.json")),
            &export_v1(&messages, &format!("bench-{blocks}")),
        );
        write_json(
            &out.join(format!("conv-{blocks}.openai.json")),
            &export_openai(&messages),
        );
        write_json(
            &out.join(format!("conv-{blocks}.vercel.json")),
            &export_vercel(&messages),
        );
        write_json(
            &out.join(format!("conv-{blocks}.tensorzero.json")),
            &export_tensorzero(&messages),
        );
        meta["conversations"][blocks.to_string()] = json!({"messages": messages.len(), "blocks": blocks});
    }
    write_json(
        &out.join("tools.json"),
        &json!([{"name": TOOL_NAME, "description": "Current weather for a city", "input_schema": tool_schema()}]),
    );
    for (label, words, calls, arg_bytes) in STREAMS {
        let reply = stream_reply(words, calls, arg_bytes);
        for api in STREAM_APIS {
            let (bytes, events) = encode(api, &reply);
            let name = format!("stream-{}-{label}.sse", api_name(api));
            write(&out.join(&name), &bytes);
            meta["streams"][format!("{}/{label}", api_name(api))] = json!({"file": name, "events": events,
                "bytes": bytes.len(), "text_words": words, "calls": calls, "arg_bytes": arg_bytes});
        }
    }
    generate_probe(&out.join("probe"), &mut meta);
    write_json(&out.join("meta.json"), &meta);
    println!("inputs written to {}", out.display());
}

/// The six bad inputs of the correctness probe (five histories and a cut stream).
fn generate_probe(dir: &Path, meta: &mut Value) {
    let call = |id: &str, city: &str| Part::Call {
        id: id.into(),
        args: json!({"city": city}),
    };
    let result = |id: &str, text: &str| Part::Result {
        id: id.into(),
        text: text.into(),
        error: false,
    };
    let head = vec![
        msg("system", vec![text("You are terse.")]),
        msg("user", vec![text("Weather in Paris and Tokyo?")]),
        msg(
            "assistant",
            vec![text("Checking both."), call("c1", "Paris"), call("c2", "Tokyo")],
        ),
    ];
    let closing = msg("user", vec![text("Thanks. And tomorrow?")]);
    let good_results = msg("tool", vec![result("c2", "18C"), result("c1", "12C")]);
    let cases: Vec<(&str, Vec<Msg>)> = vec![
        (
            "missing_result",
            vec![msg("tool", vec![result("c1", "12C")]), closing.clone()],
        ),
        (
            "orphan_result",
            vec![
                msg(
                    "tool",
                    vec![
                        result("c1", "12C"),
                        result("c2", "18C"),
                        result("c9", "from nowhere"),
                    ],
                ),
                closing.clone(),
            ],
        ),
        (
            "duplicate_result",
            vec![
                msg(
                    "tool",
                    vec![
                        result("c1", "12C"),
                        result("c1", "13C (again)"),
                        result("c2", "18C"),
                    ],
                ),
                closing.clone(),
            ],
        ),
        (
            "unknown_part",
            vec![
                good_results.clone(),
                msg("user", vec![text("Thanks. And tomorrow?"), Part::Unknown]),
            ],
        ),
        (
            "mid_system",
            vec![
                good_results.clone(),
                msg("system", vec![text("Reminder: answer in French.")]),
                closing.clone(),
            ],
        ),
    ];
    for (name, tail) in cases {
        let mut messages = head.clone();
        messages.extend(tail);
        write_json(&dir.join(format!("{name}.v1.json")), &export_v1(&messages, name));
        write_json(
            &dir.join(format!("{name}.openai.json")),
            &export_openai(&messages),
        );
        write_json(
            &dir.join(format!("{name}.vercel.json")),
            &export_vercel(&messages),
        );
        write_json(
            &dir.join(format!("{name}.tensorzero.json")),
            &export_tensorzero(&messages),
        );
    }
    // Stream cut inside tool arguments: two parallel calls; the connection ends after the
    // event that carries the second call's first argument fragment (`{"city":"`), so the
    // arguments are an unclosed JSON prefix and no stop event arrives.
    let reply = Reply {
        text: "Checking both.".into(),
        tool_calls: vec![
            ScriptedCall {
                id: Some("c1".into()),
                name: TOOL_NAME.into(),
                arguments: json!({"city": "Paris"}),
            },
            ScriptedCall {
                id: Some("c2".into()),
                name: TOOL_NAME.into(),
                arguments: json!({"city": "Tokyo"}),
            },
        ],
        faults: Faults::default(),
    };
    for api in [Api::Anthropic, Api::OpenAiChat] {
        let ids = wire::call_ids(api, &reply, 1);
        let frames = wire::frames(api, &reply, "msg_probe_0001", "bench-model", &ids, 64);
        // The second frame that opens a call's arguments (`{"city` as an escaped JSON string):
        // the first argument fragment of call c2.
        let needle: &[u8] = b"{\\\"city";
        let position = frames
            .iter()
            .enumerate()
            .filter(|(_, frame)| frame.bytes.windows(needle.len()).any(|w| w == needle))
            .map(|(index, _)| index)
            .nth(1)
            .unwrap_or_else(|| panic!("{api:?}: no argument fragment of the second call"));
        let kept = position + 1;
        let bytes: Vec<u8> = frames[..kept].iter().flat_map(|f| f.bytes.clone()).collect();
        let name = format!("cut_stream.{}.sse", api_name(api));
        write(&dir.join(&name), &bytes);
        meta["probe"][format!("cut_stream/{}", api_name(api))] =
            json!({"file": name, "events_kept": kept, "events_whole": frames.len()});
    }
    meta["probe"]["cut_stream_reply"] = json!({"text": reply.text, "tool_calls": [
        {"id": "c1", "name": TOOL_NAME, "arguments": {"city": "Paris"}},
        {"id": "c2", "name": TOOL_NAME, "arguments": {"city": "Tokyo"}}]});
}

// ---------------------------------------------------------------------------------------------
// In-process timings
// ---------------------------------------------------------------------------------------------

struct Timing {
    samples: Vec<f64>,
    iterations: u64,
}

/// `micro --clock cpu`: runs are timed in this thread's on-CPU time instead of wall time.
static CPU_CLOCK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// This thread's on-CPU time (`/proc/thread-self/schedstat`, first field, in ns). On a machine
/// shared with other jobs it leaves out the time they held the core, which wall time counts;
/// the kernel updates it at least every scheduler tick, so runs of ≥ 0.3 s are off by < 2 %.
fn cpu_now() -> Duration {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").expect("/proc/thread-self/schedstat");
    let nanos = text
        .split_whitespace()
        .next()
        .and_then(|field| field.parse().ok())
        .expect("schedstat starts with the on-CPU nanoseconds");
    Duration::from_nanos(nanos)
}

/// A run's elapsed time on the chosen clock.
struct Stopwatch(Instant, Duration);

impl Stopwatch {
    fn start() -> Stopwatch {
        let cpu = if CPU_CLOCK.load(std::sync::atomic::Ordering::Relaxed) {
            cpu_now()
        } else {
            Duration::ZERO
        };
        Stopwatch(Instant::now(), cpu)
    }
    fn elapsed(&self) -> Duration {
        if CPU_CLOCK.load(std::sync::atomic::Ordering::Relaxed) {
            cpu_now().saturating_sub(self.1)
        } else {
            self.0.elapsed()
        }
    }
}

/// One warm-up call, calibration, then `runs` runs of at least `min_run` each.
fn measure<R>(runs: u64, min_run: Duration, mut op: impl FnMut() -> R) -> Timing {
    let started = Instant::now();
    black_box(op());
    let mut once = started.elapsed().max(Duration::from_nanos(50));
    // A second warm-up call measures a warm cache (skipped when one call already lasts a run).
    if once < min_run {
        let started = Instant::now();
        black_box(op());
        once = once.min(started.elapsed().max(Duration::from_nanos(50)));
    }
    let iterations = (min_run.as_secs_f64() / once.as_secs_f64()).ceil().max(1.0) as u64;
    let samples = (0..runs)
        .map(|_| {
            let started = Stopwatch::start();
            for _ in 0..iterations {
                black_box(op());
            }
            started.elapsed().as_secs_f64() / iterations as f64
        })
        .collect();
    Timing { samples, iterations }
}

fn emit(system: &str, workload: &str, timing: &Timing, extra: Value) {
    let clock = if CPU_CLOCK.load(std::sync::atomic::Ordering::Relaxed) {
        "cpu"
    } else {
        "wall"
    };
    println!(
        "{}",
        json!({"system": system, "workload": workload, "unit": "s/op", "samples": timing.samples,
               "iterations_per_run": timing.iterations, "clock": clock, "extra": extra})
    );
}

/// The whole prepare path from the file's bytes to the request body and sealed manifest.
fn prepare_from_bytes(bytes: &[u8], catalog: &Catalog, request: &PrepareRequest) -> (Vec<u8>, Digest) {
    let conversation = parse::conversation_from_slice(bytes).expect("bench conversation parses");
    let validated = Validated::new(&conversation).expect("bench conversation is legal");
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).expect("bench conversation is ready");
    match prepare(graph, request, catalog, &mut RenderCache::new()) {
        PrepareOutcome::Prepared(prepared) => {
            (prepared.rendered.body, prepared.manifest.manifest_digest.clone())
        }
        other => panic!("bench conversation prepares: {other:?}"),
    }
}

/// The agent step: what an agent loop pays per step when the gateway keeps the conversation
/// in memory between dispatches (`KeptConversation`: the decoded conversation, the
/// validator's state and the message sequence with its digest midstate) with the render cache
/// of its last prepare (fragments, the render state kept at the last segment start, and the
/// last body's hash midstates). Each call pushes the same new user turn, prepares, then pops
/// the turn and forgets its fragment, so every repetition pays for one new block against the
/// same history (the kept render state is at the start of the pushed turn's segment, and the
/// pop leaves the turns before it, so the next step resumes there too).
struct AgentStep<'a> {
    steps: u64,
    /// Bytes from the end of `turn_bytes` to the first digit of the step counter.
    counter_at: usize,
    kept: turnstile_core::KeptConversation,
    cache: RenderCache,
    catalog: &'a Catalog,
    request: &'a PrepareRequest,
    turn_bytes: Vec<u8>,
    revision: turnstile_core::Revision,
}

impl<'a> AgentStep<'a> {
    fn new(bytes: &[u8], catalog: &'a Catalog, request: &'a PrepareRequest) -> AgentStep<'a> {
        let conversation = parse::conversation_from_slice(bytes).expect("bench conversation parses");
        let revision = turnstile_core::Revision(conversation.revision.0 + 1);
        let kept = turnstile_core::KeptConversation::new(conversation);
        let mut cache = RenderCache::new();
        {
            let graph = Graph::kept(&kept)
                .expect("bench conversation is legal")
                .expect("bench conversation is ready");
            assert!(matches!(
                prepare(graph, request, catalog, &mut cache),
                PrepareOutcome::Prepared(_)
            ));
        }
        let turn_bytes = serde_json::to_vec(&json!({"id": "t-step", "revision": revision.0, "role": "user",
            "blocks": [{"id": "b-step", "kind": "text", "text": format!("And the next question: {PARAGRAPH} #00000000")}]}))
        .unwrap();
        // Where the eight-digit counter sits, from the end (the text is the last member).
        let counter_at = turn_bytes.len()
            - turn_bytes
                .windows(9)
                .rposition(|window| window == b"#00000000")
                .expect("the counter is in the turn")
            - 1;
        AgentStep {
            steps: 0,
            counter_at,
            kept,
            cache,
            catalog,
            request,
            turn_bytes,
            revision,
        }
    }

    fn step(&mut self) -> Vec<u8> {
        // Each step's turn differs from the last one's (a counter in its text), so the body
        // parts from the last body at the new turn, as in an agent loop, and its digest hashes
        // from there (a repeated turn would find the whole body in the midstates).
        self.steps += 1;
        let counter = format!("{:08}", self.steps % 100_000_000);
        let at = self.turn_bytes.len() - self.counter_at;
        self.turn_bytes[at..at + 8].copy_from_slice(counter.as_bytes());
        let turn: Value = serde_json::from_slice(&self.turn_bytes).expect("the step turn parses");
        let pushed = self
            .kept
            .push_turn(turn, self.revision)
            .expect("the step turn is within limits");
        let body = {
            let graph = Graph::kept(&self.kept)
                .expect("the step keeps the conversation legal")
                .expect("the step conversation is ready");
            match prepare(graph, self.request, self.catalog, &mut self.cache) {
                PrepareOutcome::Prepared(prepared) => prepared.rendered.body,
                other => panic!("the step prepares: {other:?}"),
            }
        };
        let turn = self.kept.pop_turn(pushed).expect("the pushed turn");
        for block in &turn.blocks {
            self.cache.forget(&block.digest);
        }
        body
    }
}

fn floor_json_sha256(bytes: &[u8]) -> Digest {
    black_box(serde_json::from_slice::<Value>(bytes).unwrap());
    Digest::of_bytes(bytes)
}

/// Bytes per network read fed to the decoders (a TLS record).
const READ_BYTES: usize = 16 * 1024;

fn decode_and_assemble(api: StreamApi, bytes: &[u8], toolset: &Arc<Toolset>) -> usize {
    let mut decoder = api.decoder();
    let mut config = AssemblerConfig::new(Generation(1), "t-bench");
    config.toolset = Some(Arc::clone(toolset));
    let mut assembler = Assembler::new(config);
    let mut blocks = 0;
    let drain = |assembler: &mut Assembler, blocks: &mut usize| {
        while let Some(output) = assembler.poll_output() {
            match output {
                Output::Preview { delta, .. } => {
                    black_box(delta);
                }
                Output::Commit(offer) => *blocks = offer.turn["blocks"].as_array().map_or(0, Vec::len),
                Output::Retract { reason, .. } => panic!("the bench stream retracted: {reason}"),
            }
        }
    };
    for read in bytes.chunks(READ_BYTES) {
        decoder.handle_bytes(read);
        while let Some(event) = decoder.poll_event() {
            let _ = assembler.handle_event(Generation(1), event);
        }
        drain(&mut assembler, &mut blocks);
    }
    decoder.handle_end_of_input();
    while let Some(event) = decoder.poll_event() {
        let _ = assembler.handle_event(Generation(1), event);
    }
    assembler.handle_end_of_input();
    drain(&mut assembler, &mut blocks);
    blocks
}

/// Floor for a stream: split lines (memchr), parse every `data:` payload with serde_json
/// (`[DONE]` excepted), SHA-256 of the bytes.
fn floor_stream(bytes: &[u8]) -> (usize, Digest) {
    let mut parsed = 0;
    let mut start = 0;
    for end in memchr::memchr_iter(b'\n', bytes) {
        let line = &bytes[start..end];
        start = end + 1;
        if let Some(payload) = line.strip_prefix(b"data: ")
            && payload != b"[DONE]"
        {
            black_box(serde_json::from_slice::<Value>(payload).unwrap());
            parsed += 1;
        }
    }
    (parsed, Digest::of_bytes(bytes))
}

fn stream_api(name: &str) -> StreamApi {
    match name {
        "anthropic" => StreamApi::AnthropicMessages,
        "openai-chat" => StreamApi::OpenAiChat,
        "openai-responses" => StreamApi::OpenAiResponses,
        "gemini" => StreamApi::Gemini,
        other => panic!("unknown stream api {other}"),
    }
}

fn micro(args: &Args) {
    let inputs = PathBuf::from(args.value("--inputs").unwrap_or_else(|| usage()));
    let runs = args.number("--runs", 5);
    let min_run = Duration::from_millis(args.number("--min-run-ms", 300));
    let only = args.value("--only").unwrap_or_default();
    // `--skip-large` (the harness's --smoke): no 2,000-block conversation, no 100k-event stream.
    let skip_large = args.0.iter().any(|arg| arg == "--skip-large");
    // `--whole-only`: the whole prepare path alone, no halves and no floor (for `perf record`).
    let whole_only = args.0.iter().any(|arg| arg == "--whole-only");
    // `--stages`: also the first half cumulatively by stage (`stage_*` lines; not in reports).
    let stages = args.0.iter().any(|arg| arg == "--stages");
    // `--clock cpu`: on-CPU time instead of wall time (see `cpu_now`); the harness uses wall time.
    match args.value("--clock").as_deref() {
        None | Some("wall") => {}
        Some("cpu") => CPU_CLOCK.store(true, std::sync::atomic::Ordering::Relaxed),
        Some(_) => usage(),
    }
    let wanted = |workload: &str| {
        workload.starts_with(&only)
            && !(skip_large && (workload.ends_with("/2000") || workload.ends_with("/100k")))
    };
    let meta: Value = serde_json::from_slice(&std::fs::read(inputs.join("meta.json")).unwrap()).unwrap();

    let catalog = Catalog::builtin();
    let request = PrepareRequest {
        operation_id: "peerbench".into(),
        adapter: AdapterId::ALL
            .into_iter()
            .find(|adapter| adapter.as_str() == "anthropic-messages@1")
            .unwrap(),
        provider: None,
        model: "claude-sonnet-4-5".into(),
        max_output_tokens: Some(1024),
        stream: false,
        background: false,
        text_content: Default::default(),
    };
    for blocks in ["20", "200", "2000"] {
        let workload = format!("prepare/{blocks}");
        if !wanted(&workload) {
            continue;
        }
        let bytes = std::fs::read(inputs.join(format!("conv-{blocks}.v1.json"))).unwrap();
        let (body, _) = prepare_from_bytes(&bytes, &catalog, &request);
        let timing = measure(runs, min_run, || prepare_from_bytes(&bytes, &catalog, &request));
        emit(
            "turnstile",
            &workload,
            &timing,
            json!({"input_bytes": bytes.len(), "body_bytes": body.len(),
            "what": "parse v1 + validate + MessageSequence + render anthropic-messages@1 (cold cache) + token count + admission + manifest"}),
        );
        if whole_only {
            continue;
        }
        if stages {
            // The first half again, cumulatively: parse, + validate, + MessageSequence.
            let timing = measure(runs, min_run, || {
                parse::conversation_from_slice(&bytes).unwrap().turns.len()
            });
            emit("stage_parse", &workload, &timing, json!({}));
            let timing = measure(runs, min_run, || {
                let conversation = parse::conversation_from_slice(&bytes).unwrap();
                Validated::new(&conversation).is_ok()
            });
            emit("stage_parse_validate", &workload, &timing, json!({}));
            let timing = measure(runs, min_run, || {
                let conversation = parse::conversation_from_slice(&bytes).unwrap();
                let validated = Validated::new(&conversation).unwrap();
                MessageSequence::build(validated).blocks.len()
            });
            emit("stage_parse_validate_seq", &workload, &timing, json!({}));
        }
        // Where the time goes: the same path in two halves.
        let timing = measure(runs, min_run, || {
            let conversation = parse::conversation_from_slice(&bytes).unwrap();
            let validated = Validated::new(&conversation).unwrap();
            let sequence = MessageSequence::build(validated);
            Graph::new(validated, &sequence).is_ok()
        });
        emit(
            "turnstile_part_validate",
            &workload,
            &timing,
            json!({"what": "parse v1 + validate + MessageSequence + graph"}),
        );
        let conversation = parse::conversation_from_slice(&bytes).unwrap();
        let validated = Validated::new(&conversation).unwrap();
        let sequence = MessageSequence::build(validated);
        let graph = Graph::new(validated, &sequence).unwrap();
        let timing = measure(runs, min_run, || {
            matches!(
                prepare(graph, &request, &catalog, &mut RenderCache::new()),
                PrepareOutcome::Prepared(_)
            )
        });
        emit(
            "turnstile_part_render",
            &workload,
            &timing,
            json!({"what": "render (cold cache) + token count + admission + manifest"}),
        );
        let timing = measure(runs, min_run, || floor_json_sha256(&bytes));
        emit(
            "floor",
            &workload,
            &timing,
            json!({"input_bytes": bytes.len(), "what": "serde_json::from_slice::<Value> + SHA-256 of the v1 file"}),
        );
    }

    for blocks in ["20", "200", "2000"] {
        let workload = format!("step/{blocks}");
        if !wanted(&workload) {
            continue;
        }
        let bytes = std::fs::read(inputs.join(format!("conv-{blocks}.v1.json"))).unwrap();
        let mut step = AgentStep::new(&bytes, &catalog, &request);
        let body_bytes = step.step().len();
        let timing = measure(runs, min_run, || step.step().len());
        emit(
            "turnstile",
            &workload,
            &timing,
            json!({"input_bytes": bytes.len(), "body_bytes": body_bytes,
            "what": "conversation kept in memory + render cache warm from the previous prepare: push one user turn (parsed from its JSON bytes) into a KeptConversation (validator state and sequence grow by the turn) + render anthropic-messages@1 (only the new block renders) + token count + admission + manifest"}),
        );
    }

    let tools: Value = serde_json::from_slice(&std::fs::read(inputs.join("tools.json")).unwrap()).unwrap();
    let toolset = Arc::new(Toolset::from_json(&tools).unwrap());
    let streams = meta["streams"].as_object().unwrap();
    let mut keys: Vec<&String> = streams.keys().collect();
    keys.sort();
    for key in keys {
        let workload = format!("stream/{key}");
        if !wanted(&workload) {
            continue;
        }
        let info = &streams[key];
        let bytes = std::fs::read(inputs.join(info["file"].as_str().unwrap())).unwrap();
        let api = stream_api(key.split('/').next().unwrap());
        let blocks = decode_and_assemble(api, &bytes, &toolset);
        let timing = measure(runs, min_run, || decode_and_assemble(api, &bytes, &toolset));
        emit(
            "turnstile",
            &workload,
            &timing,
            json!({"bytes": bytes.len(), "events": info["events"], "committed_blocks": blocks,
            "what": "decoder + assembler (schema-checked tool arguments) in 16 KiB reads, to the commit offer"}),
        );
        let timing = measure(runs, min_run, || floor_stream(&bytes));
        emit(
            "floor",
            &workload,
            &timing,
            json!({"bytes": bytes.len(), "events": info["events"],
            "what": "memchr lines + serde_json::from_slice::<Value> of every data payload + SHA-256 of the bytes"}),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP load
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Target {
    /// `turnstile serve`: create conversation + user turn (untimed), then a non-streaming
    /// dispatch (timed).
    Turnstile,
    /// An OpenAI-compatible `POST /v1/chat/completions` (LiteLLM proxy, or the simulator itself).
    Chat,
    /// The same with `"stream": true`, read to the end (`[DONE]`).
    ChatStream,
}

fn load(args: &Args) {
    let target = match args.value("--target").as_deref() {
        Some("turnstile") => Target::Turnstile,
        Some("chat") => Target::Chat,
        _ => usage(),
    };
    let base = args.value("--base").unwrap_or_else(|| usage());
    let model = args.value("--model").unwrap_or_else(|| "bench".into());
    let requests = args.number("--requests", 1000) as usize;
    let concurrency = args.number("--concurrency", 16) as usize;
    let runs = args.number("--runs", 5);
    let label = args.value("--label").unwrap_or_else(|| "load".into());
    let fresh = args.0.iter().any(|arg| arg == "--fresh-connections");
    // `--stream` (chat targets): ask for a streamed reply and read it to the end.
    let stream = args.0.iter().any(|arg| arg == "--stream");
    let target = if target == Target::Chat && stream {
        Target::ChatStream
    } else {
        target
    };
    // `--rate R`: open loop instead, R requests per second whatever the answers (the added
    // latency at a fixed load, `rate_load`).
    if let Some(rate) = args.value("--rate") {
        let rate: f64 = rate.parse().unwrap_or_else(|_| usage());
        if !(rate.is_finite() && rate > 0.0) || requests == 0 {
            usage()
        }
        return rate_load(target, &base, &model, requests, runs, &label, rate);
    }
    let runtime = client_runtime();
    runtime.block_on(async move {
        // `--fresh-connections`: no keep-alive (a new TCP connection per request), to tell a
        // delayed-ACK stall on a reused connection from work.
        let idle = if fresh { 0 } else { concurrency * 2 };
        let client = http_client(idle);
        let stamp = unix_ms();
        warm_up(&client, target, &base, &model, &format!("{label}-{stamp}-warm")).await;
        let mut samples = Vec::new();
        let mut p50 = Vec::new();
        let mut p99 = Vec::new();
        let mut errors = 0usize;
        for run in 0..runs {
            let phase = format!("{label}-{stamp}-{run}");
            if target == Target::Turnstile {
                create_conversations(&client, &base, &phase, requests).await;
            }
            let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let cpu_before = watched_cpu();
            let started = Instant::now();
            let mut workers = Vec::new();
            for _ in 0..concurrency {
                let (client, base, model, phase, next, label) = (
                    client.clone(),
                    base.clone(),
                    model.clone(),
                    phase.clone(),
                    next.clone(),
                    label.clone(),
                );
                workers.push(tokio::spawn(async move {
                    let mut latencies = Vec::new();
                    let mut errors = 0usize;
                    loop {
                        let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if index >= requests {
                            return (latencies, errors);
                        }
                        let begun = Instant::now();
                        match one(&client, target, &base, &model, &phase, index).await {
                            Ok(()) => latencies.push(begun.elapsed()),
                            Err(error) => {
                                if errors == 0 {
                                    eprintln!("{label}: request failed: {error}");
                                }
                                errors += 1;
                            }
                        }
                    }
                }));
            }
            let mut latencies = Vec::new();
            for worker in workers {
                let (mut part, failed) = worker.await.unwrap();
                latencies.append(&mut part);
                errors += failed;
            }
            let elapsed = started.elapsed().as_secs_f64();
            let cpu_after = watched_cpu();
            latencies.sort();
            let ok = latencies.len();
            for ((pid, before), (_, after)) in cpu_before.iter().zip(&cpu_after) {
                eprintln!(
                    "{label} run {}: pid {pid}: {:.1} µs CPU per request ({:.2} cores)",
                    run + 1,
                    (after - before) * 1e6 / ok.max(1) as f64,
                    (after - before) / elapsed
                );
            }
            // Seconds per request at this concurrency (the inverse of throughput), so every
            // workload in the report compares times.
            samples.push(elapsed / ok.max(1) as f64);
            let pick = |p: f64| percentile(&latencies, p).map_or(0.0, |d| d.as_secs_f64());
            p50.push(pick(0.50));
            p99.push(pick(0.99));
            eprintln!(
                "{label} run {}: {:.0} req/s, p50 {:.2} ms, p99 {:.2} ms, {} errors",
                run + 1,
                ok as f64 / elapsed,
                pick(0.5) * 1e3,
                pick(0.99) * 1e3,
                requests - ok
            );
        }
        println!(
            "{}",
            json!({"system": label, "workload": "gateway", "unit": "s/request", "samples": samples,
                   "iterations_per_run": requests, "extra": {"concurrency": concurrency, "p50_s": p50, "p99_s": p99,
                   "errors": errors, "fresh_connections": fresh,
                   "client": "turnstile-peerbench load (reqwest, closed loop)"}})
        );
    });
}

/// `PEERBENCH_CPU_PIDS=PID[,PID…]`: the CPU seconds (user + system, from `/proc/PID/stat`)
/// each named process has used so far, to report CPU per request of the timed phase only (the
/// gateway's own cost, steadier on a shared VM than its throughput).
fn watched_cpu() -> Vec<(u32, f64)> {
    let Ok(pids) = std::env::var("PEERBENCH_CPU_PIDS") else {
        return Vec::new();
    };
    let ticks = 100.0; // USER_HZ on Linux
    pids.split(',')
        .filter_map(|pid| pid.trim().parse::<u32>().ok())
        .map(|pid| {
            let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
            let after = text.rsplit_once(')').map_or("", |(_, rest)| rest);
            let fields: Vec<&str> = after.split_whitespace().collect();
            let field = |index: usize| {
                fields
                    .get(index)
                    .and_then(|f| f.parse::<f64>().ok())
                    .unwrap_or(0.0)
            };
            (pid, (field(11) + field(12)) / ticks)
        })
        .collect()
}

/// Open-loop load: request `i` of a run is started at `start + i / rate` on its own task, by a
/// pacing thread, and its latency is measured from that scheduled time (a late send counts
/// against the system, so a stall cannot hide the requests it delayed). One JSON line per
/// label: p50 and p99 per run.
fn rate_load(target: Target, base: &str, model: &str, requests: usize, runs: u64, label: &str, rate: f64) {
    let runtime = client_runtime();
    runtime.block_on(async move {
        let client = http_client(256);
        let stamp = unix_ms();
        warm_up(&client, target, base, model, &format!("{label}-{stamp}-warm")).await;
        let (mut p50, mut p99, mut samples) = (Vec::new(), Vec::new(), Vec::new());
        let mut errors = 0usize;
        for run in 0..runs {
            let phase = format!("{label}-{stamp}-{run}");
            if target == Target::Turnstile {
                create_conversations(&client, base, &phase, requests).await;
            }
            // The sends are paced by a thread of their own sleeping on the OS clock: a tokio
            // timer fires on the next whole millisecond after its deadline, which put ~1–2 ms of
            // the generator's own lateness into every latency, the floor's included (the
            // simulator directly: p50 0.19 ms back to back, 2.08 ms at 200 req/s). Each request
            // still runs on the runtime and still counts from its scheduled time.
            let start = std::time::Instant::now() + Duration::from_millis(20);
            let runtime = tokio::runtime::Handle::current();
            let (client_, base_, model_, phase_) = (client.clone(), base.to_owned(), model.to_owned(), phase.clone());
            let pacer = std::thread::spawn(move || {
                let mut tasks = Vec::with_capacity(requests);
                for index in 0..requests {
                    let at = start + Duration::from_secs_f64(index as f64 / rate);
                    if let Some(wait) = at.checked_duration_since(std::time::Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let (client, base, model, phase) =
                        (client_.clone(), base_.clone(), model_.clone(), phase_.clone());
                    tasks.push(runtime.spawn(async move {
                        let result = one(&client, target, &base, &model, &phase, index).await;
                        (result, at.elapsed())
                    }));
                }
                tasks
            });
            let tasks = tokio::task::spawn_blocking(move || pacer.join().unwrap()).await.unwrap();
            let mut latencies = Vec::with_capacity(requests);
            // `PEERBENCH_TRACE=FILE`: every request's (index, latency µs), to see when the slow
            // ones happen.
            let mut trace = std::env::var("PEERBENCH_TRACE").ok().map(|path| {
                std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap()
            });
            for (index, task) in tasks.into_iter().enumerate() {
                let outcome = task.await.unwrap();
                if let Some(file) = trace.as_mut() {
                    use std::io::Write as _;
                    let _ = writeln!(file, "{run} {index} {}", outcome.1.as_micros());
                }
                match outcome {
                    (Ok(()), latency) => latencies.push(latency),
                    (Err(error), _) => {
                        if errors == 0 {
                            eprintln!("{label}: request failed: {error}");
                        }
                        errors += 1;
                    }
                }
            }
            latencies.sort();
            let ok = latencies.len();
            let pick = |p: f64| percentile(&latencies, p).map_or(0.0, |d| d.as_secs_f64());
            p50.push(pick(0.50));
            p99.push(pick(0.99));
            samples.push(pick(0.99));
            eprintln!(
                "{label} run {} at {rate} req/s: p50 {:.2} ms, p99 {:.2} ms, {} errors",
                run + 1,
                pick(0.5) * 1e3,
                pick(0.99) * 1e3,
                requests - ok
            );
        }
        println!(
            "{}",
            json!({"system": label, "workload": format!("rate/{rate}"), "unit": "s (p99 latency)", "samples": samples,
                   "iterations_per_run": requests, "extra": {"rate_per_s": rate, "p50_s": p50, "p99_s": p99,
                   "errors": errors, "client": "turnstile-peerbench load --rate (reqwest, open loop paced by an OS thread, latency from the scheduled send)"}})
        );
    });
}

/// `fsync --dir D`: the time of one durable write on that file system (4 KiB written and
/// `fdatasync`ed, `--count` times): the floor the added-latency target is stated against.
fn relay(args: &Args) {
    use axum::body::Bytes;
    use axum::http::{StatusCode, header};
    let listen = args.value("--listen").unwrap_or_else(|| usage());
    let upstream = args.value("--upstream").unwrap_or_else(|| usage());
    let url = format!("{}/v1/chat/completions", upstream.trim_end_matches('/'));
    // As `turnstile serve` builds its runtime and its provider client (`cli/serve.rs`,
    // `serve/mod.rs`).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async move {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(
                turnstile_gateway::serve::config::PROVIDER_CONNECT_TIMEOUT_MS_DEFAULT,
            ))
            .build()
            .expect("an HTTP client");
        let forward = move |headers: axum::http::HeaderMap, body: Bytes| {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let mut request = client.post(&url).body(body);
                if let Some(auth) = headers.get(header::AUTHORIZATION) {
                    request = request.header(header::AUTHORIZATION, auth);
                }
                let answered = async {
                    let response = request
                        .header(header::CONTENT_TYPE, "application/json")
                        .send()
                        .await?;
                    let status = response.status().as_u16();
                    Ok::<_, reqwest::Error>((status, response.bytes().await?))
                };
                match answered.await {
                    Ok((status, bytes)) => (
                        StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
                        [(header::CONTENT_TYPE, "application/json")],
                        bytes,
                    ),
                    Err(error) => (
                        StatusCode::BAD_GATEWAY,
                        [(header::CONTENT_TYPE, "application/json")],
                        Bytes::from(json!({"error": error.to_string()}).to_string()),
                    ),
                }
            }
        };
        let app = axum::Router::new().route("/v1/chat/completions", axum::routing::post(forward));
        let listener = tokio::net::TcpListener::bind(&listen)
            .await
            .unwrap_or_else(|error| panic!("cannot listen on {listen}: {error}"));
        let bound = listener.local_addr().expect("a bound address");
        eprintln!("turnstile-peerbench relay listening on http://{bound}, forwarding to {upstream}");
        let limits = turnstile_gateway::serve::listener::Limits {
            header_read_timeout_ms: turnstile_gateway::serve::config::HEADER_READ_TIMEOUT_MS_DEFAULT,
            connections_max: turnstile_gateway::serve::config::CONNECTIONS_MAX_DEFAULT,
            requests_per_connection_max:
                turnstile_gateway::serve::config::REQUESTS_PER_CONNECTION_MAX_DEFAULT,
            client_write_timeout_ms: turnstile_gateway::serve::config::CLIENT_WRITE_TIMEOUT_MS_DEFAULT,
            body_read_timeout_ms: turnstile_gateway::serve::config::BODY_READ_TIMEOUT_MS_DEFAULT,
        };
        turnstile_gateway::serve::listener::serve(
            listener,
            app,
            limits,
            std::sync::Arc::new(turnstile_gateway::serve::drain::Drain::new()),
            std::future::pending(),
        )
        .await
        .expect("the relay serves");
    });
}

fn fsync_probe(args: &Args) {
    use std::io::Write as _;
    let dir = PathBuf::from(args.value("--dir").unwrap_or_else(|| usage()));
    let count = (args.number("--count", 200) as usize).max(1);
    let path = dir.join(format!("peerbench-fsync-{}.tmp", std::process::id()));
    let mut file = std::fs::File::create(&path).unwrap();
    let page = [0x5au8; 4096];
    let mut times = Vec::with_capacity(count);
    for _ in 0..count {
        let started = Instant::now();
        file.write_all(&page).unwrap();
        file.sync_data().unwrap();
        times.push(started.elapsed().as_secs_f64());
    }
    drop(file);
    let _ = std::fs::remove_file(&path);
    times.sort_by(f64::total_cmp);
    let pick = |p: f64| percentile(&times, p).unwrap_or(0.0);
    println!(
        "{}",
        json!({"system": args.value("--label").unwrap_or_else(|| "fsync".into()), "workload": "fsync", "unit": "s/fdatasync", "samples": [pick(0.5)],
               "iterations_per_run": count, "extra": {"dir": dir.display().to_string(), "p50_s": pick(0.5), "p99_s": pick(0.99)}})
    );
}

/// `step`: the agent step over HTTP, against `turnstile serve`. Each conversation of 20 / 200 /
/// 2,000 blocks is stored turn by turn (untimed), then each timed step appends one user turn
/// (`POST /turns`) and dispatches (`POST /dispatch`, not streamed, the simulator answering a
/// short text that commits). The history grows by two blocks a step. One JSON line per size:
/// seconds per step (append + dispatch) per run, and the dispatch alone beside it.
fn http_step(args: &Args) {
    let base = args.value("--base").unwrap_or_else(|| usage());
    let inputs = PathBuf::from(args.value("--inputs").unwrap_or_else(|| usage()));
    let steps = (args.number("--steps", 20) as usize).max(1);
    let runs = args.number("--runs", 3);
    let model = args.value("--model").unwrap_or_else(|| "bench".into());
    // `--sizes 20,2000`: only those conversation sizes.
    let sizes: Vec<usize> = args
        .value("--sizes")
        .unwrap_or_else(|| "20,200,2000".into())
        .split(',')
        .map(|size| size.parse().unwrap_or_else(|_| usage()))
        .collect();
    let runtime = client_runtime();
    runtime.block_on(async move {
        let client = http_client(usize::MAX);
        let stamp = unix_ms();
        for blocks in sizes {
            let document: Value =
                serde_json::from_slice(&std::fs::read(inputs.join(format!("conv-{blocks}.v1.json"))).unwrap()).unwrap();
            let (mut samples, mut dispatches) = (Vec::new(), Vec::new());
            for run in 0..runs {
                let id = format!("c-step-{stamp}-{blocks}-{run}");
                let created = client
                    .post(format!("{base}/v1/conversations"))
                    .json(&json!({"conversation_id": id, "tools": document["tools"]}))
                    .send()
                    .await
                    .unwrap();
                assert!(created.status().is_success(), "create: {}", created.status());
                let mut revision = 0u64;
                for turn in document["turns"].as_array().unwrap() {
                    let mut turn = turn.clone();
                    turn.as_object_mut().unwrap().remove("revision");
                    append(&client, &base, &id, revision, turn).await;
                    revision += 1;
                }
                // One untimed step first: the gateway reads the whole history once.
                let mut step_times = Vec::new();
                let mut dispatch_times = Vec::new();
                for step in 0..=steps {
                    let turn = json!({"id": format!("t-step-{step}"), "role": "user",
                        "blocks": [{"id": format!("b-step-{step}"), "kind": "text", "text": format!("And the next question: {PARAGRAPH}")}]});
                    let begun = Instant::now();
                    append(&client, &base, &id, revision, turn).await;
                    let dispatched = Instant::now();
                    let body = json!({"operation_id": format!("op-{id}-{step}"), "stream": false, "max_output_tokens": 256,
                                      "target": {"provider": "sim", "model": model, "adapter": "anthropic-messages@1"}});
                    let answer: Value = client
                        .post(format!("{base}/v1/conversations/{id}/dispatch"))
                        .json(&body)
                        .send()
                        .await
                        .unwrap()
                        .json()
                        .await
                        .unwrap();
                    assert_eq!(answer["state"], "COMMITTED", "step {step}: {answer}");
                    if step > 0 {
                        step_times.push(begun.elapsed().as_secs_f64());
                        dispatch_times.push(dispatched.elapsed().as_secs_f64());
                    }
                    revision += 2;
                }
                step_times.sort_by(f64::total_cmp);
                dispatch_times.sort_by(f64::total_cmp);
                samples.push(step_times[step_times.len() / 2]);
                dispatches.push(dispatch_times[dispatch_times.len() / 2]);
            }
            println!(
                "{}",
                json!({"system": "turnstile_serve", "workload": format!("http_step/{blocks}"), "unit": "s/step",
                       "samples": samples, "iterations_per_run": steps,
                       "extra": {"dispatch_s": dispatches, "what": "append one user turn (POST /turns) + dispatch (POST /dispatch, not streamed, anthropic-messages@1, committed) of a stored conversation; median step of each run; the history grows by 2 blocks per step"}})
            );
        }
    });
}

async fn append(client: &reqwest::Client, base: &str, id: &str, expected: u64, turn: Value) {
    let response = client
        .post(format!("{base}/v1/conversations/{id}/turns"))
        .json(&json!({"expected_revision": expected, "turn": turn}))
        .send()
        .await
        .unwrap();
    let status = response.status();
    assert!(
        status.is_success(),
        "append at {expected}: {status} {}",
        response.text().await.unwrap_or_default()
    );
}

/// The load generators' runtime: two workers, as many as the machine has cores.
fn client_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The load generators' HTTP client, keeping at most `idle` connections per host.
fn http_client(idle: usize) -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(idle)
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

/// Milliseconds since the Unix epoch: a run's ids differ from every earlier run's.
fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// A few requests through the whole path before timing (connections, lazy imports).
async fn warm_up(client: &reqwest::Client, target: Target, base: &str, model: &str, phase: &str) {
    if target == Target::Turnstile {
        create_conversations(client, base, phase, 8).await;
    }
    for index in 0..8 {
        one(client, target, base, model, phase, index).await.unwrap();
    }
}

/// The `p` quantile of sorted values (the last one for p = 1), None when there are none.
fn percentile<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    let index = ((sorted.len() as f64 * p) as usize).min(sorted.len().checked_sub(1)?);
    sorted.get(index).copied()
}

/// The bearer token sent to chat targets (`PEERBENCH_AUTH`, default `sk-bench`): the LiteLLM
/// proxy's master key.
fn auth() -> String {
    std::env::var("PEERBENCH_AUTH").unwrap_or_else(|_| "sk-bench".into())
}

async fn create_conversations(client: &reqwest::Client, base: &str, phase: &str, count: usize) {
    let mut tasks = Vec::new();
    let per = count.div_ceil(8);
    for lane in 0..8 {
        let (client, base, phase) = (client.clone(), base.to_owned(), phase.to_owned());
        tasks.push(tokio::spawn(async move {
            for index in lane * per..((lane + 1) * per).min(count) {
                let id = format!("c-{phase}-{index}");
                let created = client
                    .post(format!("{base}/v1/conversations"))
                    .json(&json!({"conversation_id": id}))
                    .send()
                    .await
                    .unwrap();
                assert!(created.status().is_success(), "create: {}", created.status());
                let turn = json!({"id": "t1", "role": "user",
                                  "blocks": [{"id": "u1", "kind": "text", "text": "Hello?"}]});
                append(&client, &base, &id, 0, turn).await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

async fn one(
    client: &reqwest::Client,
    target: Target,
    base: &str,
    model: &str,
    phase: &str,
    index: usize,
) -> Result<(), String> {
    match target {
        Target::Turnstile => {
            let body = json!({"operation_id": format!("op-{phase}-{index}"), "stream": false, "max_output_tokens": 256,
                              "target": {"provider": "sim", "model": model, "adapter": "openai-chat@1"}});
            let response = client
                .post(format!("{base}/v1/conversations/c-{phase}-{index}/dispatch"))
                .json(&body)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            let answer: Value = response.json().await.map_err(|e| e.to_string())?;
            if answer["state"] != "COMMITTED" {
                return Err(format!("not committed: {answer}"));
            }
        }
        Target::Chat | Target::ChatStream => {
            let streamed = target == Target::ChatStream;
            let body = json!({"model": model, "max_tokens": 256, "stream": streamed,
                              "messages": [{"role": "user", "content": "Hello?"}]});
            let response = client
                .post(format!("{base}/v1/chat/completions"))
                .header("authorization", format!("Bearer {}", auth()))
                .json(&body)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            let status = response.status();
            if streamed {
                let bytes = response.bytes().await.map_err(|e| e.to_string())?;
                if !status.is_success() || !bytes.ends_with(b"data: [DONE]\n\n") {
                    return Err(format!("{status}: stream without [DONE]"));
                }
            } else {
                let answer: Value = response.json().await.map_err(|e| e.to_string())?;
                if !status.is_success() || answer["choices"][0]["message"]["content"].as_str().is_none() {
                    return Err(format!("{status}: {answer}"));
                }
            }
        }
    }
    Ok(())
}
