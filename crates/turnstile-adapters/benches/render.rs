//! Render + admission + manifest (`turnstile_adapters::prepare`) for 200- and 2,000-block
//! conversations per adapter: cold (empty fragment cache) and incremental (a cached history
//! plus one new turn whose fragments are not cached), beside the floor measured in the same
//! run: serde_json serialisation of the same body (as a `serde_json::Value`) + SHA-256 of it.
//!
//! Run: `cargo bench -p turnstile-adapters --bench render`. Figures: docs/benchmarks-log.md.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use serde_json::{Value, json};
use std::hint::black_box;
use std::time::Duration;
use turnstile_adapters::render::{Graph, RenderCache};
use turnstile_adapters::{AdapterId, Catalog, PrepareOutcome, PrepareRequest, prepare};
use turnstile_core::conversation::Conversation;
use turnstile_core::{Digest, MessageSequence, Validated, parse};

const PARAGRAPH: &str = "The committed history is replayed to the provider on every turn, so the \
adapter renders the same blocks again and again; only the newest turn is new work. Numbers 1, 2, 3.";

/// A ready conversation of about `blocks` blocks: rounds of user (text + context), assistant
/// (text + two calls) and tool (two results), closed by a user turn.
fn conversation(blocks: usize, extra_turn: bool) -> Conversation {
    let mut turns =
        vec![json!({"role": "system", "blocks": [{"kind": "text", "text": "You are a careful assistant."}]})];
    let mut count = 1;
    let mut round = 0;
    while count + 8 <= blocks {
        turns.push(json!({"role": "user", "blocks": [
            {"kind": "text", "text": format!("Question {round}: {PARAGRAPH}")},
            {"kind": "context", "source": "retrieval", "trust": "untrusted", "text": format!("Snippet {round}. assistant: {PARAGRAPH}")}]}));
        turns.push(json!({"role": "assistant", "generation": round + 1, "blocks": [
            {"kind": "text", "text": format!("Looking up {round}.")},
            {"kind": "tool_call", "call_id": format!("call_{round}_a"), "tool": "get_weather", "arguments": format!("{{\"city\":\"City {round}\"}}")},
            {"kind": "tool_call", "call_id": format!("call_{round}_b"), "tool": "get_weather", "arguments": {"city": format!("Town {round}")}}]}));
        // Results carry the call's tool, args digest and generation (spec §1).
        let digest_a = Digest::of_canonical(&json!({"city": format!("City {round}")}));
        let digest_b = Digest::of_canonical(&json!({"city": format!("Town {round}")}));
        turns.push(json!({"role": "tool", "blocks": [
            {"kind": "tool_result", "call_id": format!("call_{round}_b"), "tool": "get_weather", "args_digest": digest_b, "generation": round + 1, "status": "success", "content": [{"kind": "text", "text": format!("{round}C, {PARAGRAPH}")}]},
            {"kind": "tool_result", "call_id": format!("call_{round}_a"), "tool": "get_weather", "args_digest": digest_a, "generation": round + 1, "status": "error", "content": [{"kind": "text", "text": "timeout"}]}]}));
        count += 7;
        round += 1;
    }
    turns.push(json!({"role": "user", "blocks": [{"kind": "text", "text": "Summarise."}]}));
    if extra_turn {
        turns.push(json!({"role": "user", "blocks": [
            {"kind": "text", "text": "One more question about the last city."},
            {"kind": "context", "source": "retrieval", "text": "A fresh snippet for the new turn."}]}));
    }
    let mut block = 0;
    let total = turns.len();
    for (index, turn) in turns.iter_mut().enumerate() {
        turn["id"] = json!(format!("t-{index}"));
        turn["revision"] = json!(index + 1);
        for item in turn["blocks"].as_array_mut().unwrap() {
            block += 1;
            item["id"] = json!(format!("b-{block}"));
        }
    }
    let value = json!({
        "format": "turnstile.conversation.v1", "conversation_id": "bench", "revision": total,
        "tools": [{"name": "get_weather", "description": "Weather.", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "turns": turns,
    });
    parse::conversation_from_slice(&serde_json::to_vec(&value).unwrap()).unwrap()
}

fn model_for(adapter: AdapterId) -> &'static str {
    match adapter.provider() {
        "openai" => "gpt-4o",
        "anthropic" => "claude-sonnet-4-5",
        _ => "gemini-2.5-pro",
    }
}

fn request(adapter: AdapterId) -> PrepareRequest {
    PrepareRequest {
        operation_id: "bench".into(),
        adapter,
        provider: None,
        model: model_for(adapter).into(),
        max_output_tokens: Some(1024),
        stream: true,
        background: false,
        text_content: Default::default(),
    }
}

fn run(graph: Graph<'_>, request: &PrepareRequest, catalog: &Catalog, cache: &mut RenderCache) -> Vec<u8> {
    match prepare(graph, request, catalog, cache) {
        PrepareOutcome::Prepared(prepared) => prepared.rendered.body,
        other => panic!("bench conversations prepare: {other:?}"),
    }
}

fn bench(c: &mut Criterion) {
    let catalog = Catalog::builtin();
    for blocks in [200usize, 2_000] {
        let history = conversation(blocks, false);
        let extended = conversation(blocks, true);
        let history_validated = Validated::new(&history).unwrap();
        let history_sequence = MessageSequence::build(history_validated);
        let history_graph = Graph::new(history_validated, &history_sequence).unwrap();
        let validated = Validated::new(&extended).unwrap();
        let sequence = MessageSequence::build(validated);
        let graph = Graph::new(validated, &sequence).unwrap();
        let new_turn: Vec<Digest> = extended
            .turns
            .last()
            .unwrap()
            .blocks
            .iter()
            .map(|block| block.digest.clone())
            .collect();
        let mut group = c.benchmark_group(format!("prepare/{blocks}_blocks"));
        group
            .sample_size(20)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for adapter in AdapterId::ALL {
            let request = request(adapter);
            // Load the tokenizer and adapter digest once, outside every measurement.
            let body = run(graph, &request, &catalog, &mut RenderCache::new());
            group.bench_function(BenchmarkId::new("cold", adapter.as_str()), |b| {
                b.iter(|| black_box(run(graph, &request, &catalog, &mut RenderCache::new())))
            });
            let mut cache = RenderCache::new();
            let _ = run(history_graph, &request, &catalog, &mut cache);
            group.bench_function(BenchmarkId::new("incremental", adapter.as_str()), |b| {
                b.iter(|| {
                    let body = run(graph, &request, &catalog, &mut cache);
                    for digest in &new_turn {
                        cache.forget(digest);
                    }
                    black_box(body)
                })
            });
            let value: Value = serde_json::from_slice(&body).unwrap();
            group.bench_function(
                BenchmarkId::new("floor_serde_json_sha256", adapter.as_str()),
                |b| {
                    b.iter(|| {
                        let bytes = serde_json::to_vec(black_box(&value)).unwrap();
                        black_box(Digest::of_bytes(&bytes))
                    })
                },
            );
            eprintln!("{blocks} blocks × {adapter}: body {} bytes", body.len());
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
