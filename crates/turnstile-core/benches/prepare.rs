//! Build graph + validate + digest for generated conversations of 20, 200 and 2,000 blocks,
//! beside the floor measured in the same run: serde_json parse of the same bytes into a
//! `Value` plus one SHA-256 over them. Throughput is per block.
//!
//! Run: `cargo bench -p turnstile-core --bench prepare`

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use std::hint::black_box;
use turnstile_core::{Digest, MessageSequence, Validated, parse};

/// A legal conversation of `blocks_target` blocks or a few more: rounds of a user question,
/// an assistant turn with two parallel calls, their results split over two tool turns in
/// reverse order, and an assistant answer.
fn conversation(blocks_target: usize) -> (Vec<u8>, usize) {
    let mut turns = Vec::new();
    let mut blocks = 0;
    let mut round = 0;
    let text = "The weather in the city is mild with a chance of rain later in the afternoon. ";
    while blocks < blocks_target {
        round += 1;
        let paris = json!({"city": "Paris", "days": round});
        let tokyo = json!({"city": "Tokyo", "days": round});
        turns.push(json!({"id": format!("u{round}"), "role": "user",
            "blocks": [{"id": format!("u{round}-1"), "kind": "text", "text": format!("{text}Question {round}?")}]}));
        turns.push(json!({"id": format!("a{round}"), "role": "assistant", "generation": round, "blocks": [
            {"id": format!("a{round}-1"), "kind": "tool_call", "call_id": format!("call_{round}_a"), "tool": "get_weather",
             "arguments": paris.to_string()},
            {"id": format!("a{round}-2"), "kind": "tool_call", "call_id": format!("call_{round}_b"), "tool": "get_weather",
             "arguments": tokyo}]}));
        for (turn, (call, args)) in [("b", &tokyo), ("a", &paris)].into_iter().enumerate() {
            turns.push(json!({"id": format!("r{round}-{turn}"), "role": "tool", "blocks": [
                {"id": format!("r{round}-{call}"), "kind": "tool_result", "call_id": format!("call_{round}_{call}"),
                 "tool": "get_weather", "args_digest": Digest::of_canonical(args), "generation": round,
                 "status": "success", "content": [{"kind": "text", "text": text}]}]}));
        }
        turns.push(
            json!({"id": format!("f{round}"), "role": "assistant", "generation": round,
            "blocks": [{"id": format!("f{round}-1"), "kind": "text", "text": text}]}),
        );
        blocks += 6;
    }
    for (index, turn) in turns.iter_mut().enumerate() {
        turn["revision"] = json!(index + 1);
    }
    let document = json!({"format": "turnstile.conversation.v1", "conversation_id": "bench", "revision": turns.len(),
        "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "turns": turns});
    (serde_json::to_vec(&document).unwrap(), blocks)
}

fn prepare(c: &mut Criterion) {
    let mut group = c.benchmark_group("prepare");
    for target in [20usize, 200, 2_000] {
        let (bytes, blocks) = conversation(target);
        group.throughput(Throughput::Elements(blocks as u64));
        group.bench_with_input(
            BenchmarkId::new("floor_serde_json_parse_plus_sha256", target),
            &bytes,
            |b, bytes| {
                b.iter(|| {
                    let value: Value = serde_json::from_slice(black_box(bytes)).unwrap();
                    let hash = Sha256::digest(black_box(bytes));
                    black_box((value, hash))
                })
            },
        );
        group.bench_with_input(BenchmarkId::new("depth_prescan", target), &bytes, |b, bytes| {
            b.iter(|| parse::depth_exceeds(black_box(bytes), turnstile_core::limits::JSON_DEPTH_MAX))
        });
        group.bench_with_input(
            BenchmarkId::new("turnstile_parse_validate_graph_digest", target),
            &bytes,
            |b, bytes| {
                b.iter(|| {
                    let conversation = parse::conversation_from_slice(black_box(bytes)).unwrap();
                    let validated = Validated::new(&conversation).unwrap();
                    assert!(!validated.is_waiting());
                    let sequence = MessageSequence::build(validated);
                    black_box(sequence.sequence_digest)
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, prepare);
criterion_main!(benches);
