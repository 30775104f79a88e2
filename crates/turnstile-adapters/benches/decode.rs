//! Decode + assemble throughput per provider API on one large stream (≥ 10 MB, ≥ 100k SSE
//! events, text and parallel tool calls), beside two floors measured on the same bytes in the
//! same run: memchr line splitting, and serde_json parsing of every event payload into a
//! `Value`. Also SSE framing alone, ours against `eventsource-stream` 0.2.3.
//!
//! Run: `cargo bench -p turnstile-adapters --bench decode` (figures in docs/benchmarks-log.md).
//! The streams are generated here, deterministically, in each API's documented wire format.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use serde_json::{Value, json};
use std::hint::black_box;
use std::sync::Arc;
use turnstile_adapters::decode::StreamApi;
use turnstile_adapters::sse::SseParser;
use turnstile_core::Generation;
use turnstile_core::assemble::{Assembler, AssemblerConfig, Output, Toolset};

/// Bytes per network read fed to the decoders (a typical TLS record is 16 KiB).
const READ_BYTES: usize = 16 * 1024;

struct Stream {
    api: StreamApi,
    bytes: Vec<u8>,
    payloads: Vec<String>,
}

struct Writer {
    bytes: String,
    payloads: Vec<String>,
}

impl Writer {
    fn new() -> Writer {
        Writer {
            bytes: String::new(),
            payloads: Vec::new(),
        }
    }
    fn event(&mut self, name: Option<&str>, payload: Value) {
        let payload = payload.to_string();
        if let Some(name) = name {
            self.bytes.push_str("event: ");
            self.bytes.push_str(name);
            self.bytes.push('\n');
        }
        self.bytes.push_str("data: ");
        self.bytes.push_str(&payload);
        self.bytes.push_str("\n\n");
        self.payloads.push(payload);
    }
    fn done(mut self, api: StreamApi, raw_tail: Option<&str>) -> Stream {
        if let Some(tail) = raw_tail {
            self.bytes.push_str(tail);
        }
        Stream {
            api,
            bytes: self.bytes.into_bytes(),
            payloads: self.payloads,
        }
    }
}

const WORDS: [&str; 8] = [" the", " weather", " in", " Paris", " is", " mild", " today", ","];
const CITIES: [&str; 4] = ["Paris", "Tokyo", "Lagos", "Lima"];

/// 120 segments, each: text deltas, then 4 parallel tool calls whose arguments stream in
/// fragments (interleaved across the 4 calls).
const SEGMENTS: usize = 120;
const TEXT_DELTAS: usize = 640;
const CALLS: usize = 4;
const ARG_FRAGMENTS: usize = 60;

fn arg_fragments(segment: usize, call: usize) -> Vec<String> {
    let city = CITIES[(segment + call) % CITIES.len()];
    let note = "x".repeat(ARG_FRAGMENTS * 2);
    let text = json!({"city": city, "note": note}).to_string();
    let step = text.len().div_ceil(ARG_FRAGMENTS);
    text.as_bytes()
        .chunks(step)
        .map(|chunk| String::from_utf8(chunk.to_vec()).unwrap())
        .collect()
}

fn openai_chat() -> Stream {
    let mut w = Writer::new();
    let chunk = |delta: Value, finish: Value| {
        json!({"id": "chatcmpl-BENCH", "object": "chat.completion.chunk", "created": 1, "model": "gpt-bench",
               "system_fingerprint": "fp_bench", "choices": [{"index": 0, "delta": delta, "logprobs": null,
               "finish_reason": finish}], "usage": null})
    };
    // Chat has one text block per response; tool call `index` keys grow across segments.
    for segment in 0..SEGMENTS {
        for delta in 0..TEXT_DELTAS {
            w.event(
                None,
                chunk(json!({"content": WORDS[delta % WORDS.len()]}), Value::Null),
            );
        }
        let fragments: Vec<Vec<String>> = (0..CALLS).map(|call| arg_fragments(segment, call)).collect();
        for call in 0..CALLS {
            let index = segment * CALLS + call;
            w.event(
                None,
                chunk(
                    json!({"tool_calls": [{"index": index, "id": format!("call_{index}"), "type": "function",
                                           "function": {"name": "get_weather", "arguments": ""}}]}),
                    Value::Null,
                ),
            );
        }
        for fragment in 0..ARG_FRAGMENTS {
            for (call, parts) in fragments.iter().enumerate() {
                if let Some(part) = parts.get(fragment) {
                    let index = segment * CALLS + call;
                    w.event(
                        None,
                        chunk(
                            json!({"tool_calls": [{"index": index, "function": {"arguments": part}}]}),
                            Value::Null,
                        ),
                    );
                }
            }
        }
    }
    w.event(None, chunk(json!({}), json!("tool_calls")));
    w.event(
        None,
        json!({"id": "chatcmpl-BENCH", "object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": 10, "completion_tokens": 100000, "total_tokens": 100010}}),
    );
    w.done(StreamApi::OpenAiChat, Some("data: [DONE]\n\n"))
}

fn anthropic() -> Stream {
    let mut w = Writer::new();
    w.event(
        Some("message_start"),
        json!({"type": "message_start", "message": {"id": "msg_BENCH", "type": "message", "role": "assistant",
               "model": "claude-bench", "content": [], "stop_reason": null, "usage": {"input_tokens": 10, "output_tokens": 1}}}),
    );
    let mut index = 0;
    for segment in 0..SEGMENTS {
        w.event(
            Some("content_block_start"),
            json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}),
        );
        for delta in 0..TEXT_DELTAS {
            w.event(
                Some("content_block_delta"),
                json!({"type": "content_block_delta", "index": index,
                       "delta": {"type": "text_delta", "text": WORDS[delta % WORDS.len()]}}),
            );
        }
        w.event(
            Some("content_block_stop"),
            json!({"type": "content_block_stop", "index": index}),
        );
        index += 1;
        // Anthropic streams one block at a time: the 4 calls follow each other.
        for call in 0..CALLS {
            w.event(
                Some("content_block_start"),
                json!({"type": "content_block_start", "index": index, "content_block": {"type": "tool_use",
                       "id": format!("toolu_{segment}_{call}"), "name": "get_weather", "input": {}}}),
            );
            for part in arg_fragments(segment, call) {
                w.event(
                    Some("content_block_delta"),
                    json!({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": part}}),
                );
            }
            w.event(
                Some("content_block_stop"),
                json!({"type": "content_block_stop", "index": index}),
            );
            index += 1;
        }
    }
    w.event(
        Some("message_delta"),
        json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
               "usage": {"output_tokens": 100000}}),
    );
    w.event(Some("message_stop"), json!({"type": "message_stop"}));
    w.done(StreamApi::AnthropicMessages, None)
}

fn openai_responses() -> Stream {
    let mut w = Writer::new();
    let mut seq = 0u64;
    let mut event = |w: &mut Writer, kind: &str, mut payload: Value| {
        payload["type"] = json!(kind);
        payload["sequence_number"] = json!(seq);
        seq += 1;
        w.event(Some(kind), payload);
    };
    event(
        &mut w,
        "response.created",
        json!({"response": {"id": "resp_BENCH", "status": "in_progress", "output": []}}),
    );
    let mut output_index = 0;
    for segment in 0..SEGMENTS {
        let item_id = format!("msg_{segment}");
        event(
            &mut w,
            "response.output_item.added",
            json!({"output_index": output_index, "item": {"id": item_id, "type": "message", "role": "assistant", "content": []}}),
        );
        event(
            &mut w,
            "response.content_part.added",
            json!({"item_id": item_id, "output_index": output_index, "content_index": 0,
                   "part": {"type": "output_text", "annotations": [], "text": ""}}),
        );
        for delta in 0..TEXT_DELTAS {
            event(
                &mut w,
                "response.output_text.delta",
                json!({"item_id": item_id, "output_index": output_index, "content_index": 0,
                       "delta": WORDS[delta % WORDS.len()], "logprobs": [], "obfuscation": "AbCdEf"}),
            );
        }
        event(
            &mut w,
            "response.content_part.done",
            json!({"item_id": item_id, "output_index": output_index, "content_index": 0,
                   "part": {"type": "output_text", "annotations": [], "text": ""}}),
        );
        output_index += 1;
        let fragments: Vec<Vec<String>> = (0..CALLS).map(|call| arg_fragments(segment, call)).collect();
        for call in 0..CALLS {
            event(
                &mut w,
                "response.output_item.added",
                json!({"output_index": output_index + call, "item": {"id": format!("fc_{segment}_{call}"),
                       "type": "function_call", "status": "in_progress", "arguments": "",
                       "call_id": format!("call_{segment}_{call}"), "name": "get_weather"}}),
            );
        }
        for fragment in 0..ARG_FRAGMENTS {
            for (call, parts) in fragments.iter().enumerate() {
                if let Some(part) = parts.get(fragment) {
                    event(
                        &mut w,
                        "response.function_call_arguments.delta",
                        json!({"item_id": format!("fc_{segment}_{call}"), "output_index": output_index + call,
                               "delta": part, "obfuscation": "AbCdEf"}),
                    );
                }
            }
        }
        for (call, parts) in fragments.iter().enumerate() {
            event(
                &mut w,
                "response.function_call_arguments.done",
                json!({"item_id": format!("fc_{segment}_{call}"), "output_index": output_index + call,
                       "arguments": parts.concat()}),
            );
        }
        output_index += CALLS;
    }
    event(
        &mut w,
        "response.completed",
        json!({"response": {"id": "resp_BENCH", "status": "completed",
               "usage": {"input_tokens": 10, "output_tokens": 100000, "total_tokens": 100010}}}),
    );
    w.done(StreamApi::OpenAiResponses, None)
}

fn gemini() -> Stream {
    let mut w = Writer::new();
    let chunk = |parts: Value, finish: Option<&str>| {
        let mut candidate = json!({"content": {"parts": parts, "role": "model"}, "index": 0});
        if let Some(reason) = finish {
            candidate["finishReason"] = json!(reason);
        }
        json!({"candidates": [candidate], "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 5,
               "totalTokenCount": 15}, "modelVersion": "gemini-bench", "responseId": "rBENCH"})
    };
    // Gemini API calls arrive whole (args as an object), several in one chunk; to keep ≥ 100k
    // events the text runs longer per segment.
    for segment in 0..SEGMENTS {
        for delta in 0..TEXT_DELTAS + CALLS * ARG_FRAGMENTS {
            w.event(None, chunk(json!([{"text": WORDS[delta % WORDS.len()]}]), None));
        }
        let calls: Vec<Value> = (0..CALLS)
            .map(|call| {
                let args: Value = serde_json::from_str(&arg_fragments(segment, call).concat()).unwrap();
                json!({"functionCall": {"name": "get_weather", "args": args}})
            })
            .collect();
        w.event(None, chunk(Value::Array(calls), None));
    }
    w.event(None, chunk(json!([{"text": ""}]), Some("STOP")));
    w.done(StreamApi::Gemini, None)
}

fn toolset() -> Arc<Toolset> {
    let tools = json!([{"name": "get_weather", "input_schema": {"type": "object",
        "properties": {"city": {"type": "string"}, "note": {"type": "string"}},
        "required": ["city"], "additionalProperties": false}}]);
    Arc::new(Toolset::from_json(&tools).unwrap())
}

/// Decode + assemble the whole stream in network-sized reads; returns the committed block count.
fn decode_and_assemble(stream: &Stream, toolset: &Arc<Toolset>) -> usize {
    let mut decoder = stream.api.decoder();
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
    for read in stream.bytes.chunks(READ_BYTES) {
        decoder.handle_bytes(read);
        while let Some(event) = decoder.poll_event() {
            let _ = assembler.handle_event(Generation(1), event);
        }
        drain(&mut assembler, &mut blocks);
    }
    decoder.handle_end_of_input();
    assembler.handle_end_of_input();
    drain(&mut assembler, &mut blocks);
    blocks
}

fn bench(c: &mut Criterion) {
    let toolset = toolset();
    for stream in [openai_chat(), openai_responses(), anthropic(), gemini()] {
        let name = format!("{:?}", stream.api);
        let blocks = decode_and_assemble(&stream, &toolset);
        println!(
            "{name}: {} bytes, {} SSE events, {} committed blocks",
            stream.bytes.len(),
            stream.payloads.len(),
            blocks
        );
        assert!(stream.bytes.len() >= 10_000_000 && stream.payloads.len() >= 100_000);
        let mut group = c.benchmark_group(format!("decode/{name}"));
        group.sample_size(10);
        group.warm_up_time(std::time::Duration::from_secs(1));
        group.measurement_time(std::time::Duration::from_secs(4));
        group.throughput(Throughput::Bytes(stream.bytes.len() as u64));
        group.bench_function("decode+assemble", |b| {
            b.iter(|| black_box(decode_and_assemble(&stream, &toolset)))
        });
        group.bench_function("decode only", |b| {
            b.iter(|| {
                let mut decoder = stream.api.decoder();
                let mut events = 0usize;
                for read in stream.bytes.chunks(READ_BYTES) {
                    decoder.handle_bytes(read);
                    while let Some(event) = decoder.poll_event() {
                        black_box(&event);
                        events += 1;
                    }
                }
                events
            })
        });
        group.bench_function("floor: memchr lines", |b| {
            b.iter(|| black_box(memchr::memchr_iter(b'\n', black_box(&stream.bytes)).count()))
        });
        group.bench_function("floor: serde_json payloads", |b| {
            b.iter(|| {
                for payload in &stream.payloads {
                    black_box(serde_json::from_str::<Value>(black_box(payload)).unwrap());
                }
            })
        });
        group.bench_function("sse framing: ours", |b| {
            b.iter(|| {
                let mut parser = SseParser::new();
                let mut events = 0;
                for read in stream.bytes.chunks(READ_BYTES) {
                    parser.handle_bytes(read).unwrap();
                    while let Some(event) = parser.poll_event() {
                        black_box(&event);
                        events += 1;
                    }
                }
                events
            })
        });
        group.bench_function("sse framing: eventsource-stream", |b| {
            use eventsource_stream::Eventsource;
            use futures_util::StreamExt;
            b.iter_batched(
                || {
                    stream
                        .bytes
                        .chunks(READ_BYTES)
                        .map(|read| Ok::<_, std::convert::Infallible>(read.to_vec()))
                        .collect::<Vec<_>>()
                },
                |reads| {
                    let events = futures_util::stream::iter(reads).eventsource();
                    futures_executor::block_on(events.fold(0usize, |count, event| {
                        black_box(event.unwrap());
                        async move { count + 1 }
                    }))
                },
                BatchSize::LargeInput,
            )
        });
        group.finish();
    }

    // One large read: eventsource-stream copies the rest of its buffer after every line.
    let stream = anthropic();
    let sample = &stream.bytes[..1 << 20];
    let mut group = c.benchmark_group("sse framing, one 1 MiB read");
    group.sample_size(10);
    group.warm_up_time(std::time::Duration::from_secs(1));
    group.measurement_time(std::time::Duration::from_secs(4));
    group.throughput(Throughput::Bytes(sample.len() as u64));
    group.bench_function("ours", |b| {
        b.iter(|| {
            let mut parser = SseParser::new();
            parser.handle_bytes(sample).unwrap();
            std::iter::from_fn(|| parser.poll_event()).count()
        })
    });
    group.bench_function("eventsource-stream", |b| {
        use eventsource_stream::Eventsource;
        use futures_util::StreamExt;
        b.iter(|| {
            let events = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(sample.to_vec())])
                .eventsource();
            futures_executor::block_on(events.count())
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
