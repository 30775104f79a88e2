//! MessageSequence (format v2): digests are pinned (equal across runs and machines), the graph keeps
//! every block with its boundaries, and only legal history can become a graph.

use serde_json::json;
use std::path::Path;
use turnstile_core::conversation::ArgState;
use turnstile_core::sequence::TrustLabel;
use turnstile_core::{MessageSequence, Validated, parse};

/// The definition of `sequence_digest`, through the generic canonicaliser: the sequence's
/// canonical JSON with `blocks` and `edges` each replaced by its own canonical digest.
fn generic_digest(sequence: &MessageSequence) -> turnstile_core::Digest {
    let mut form = serde_json::to_value(sequence).unwrap();
    for array in ["blocks", "edges"] {
        let digest = turnstile_core::Digest::of_value(&form[array]);
        form[array] = serde_json::Value::String(digest.as_str().to_owned());
    }
    turnstile_core::Digest::of_value(&form)
}

fn sequence_of(relative: &str) -> MessageSequence {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(relative);
    let conversation = parse::conversation_from_slice(&std::fs::read(path).unwrap()).unwrap();
    MessageSequence::build(Validated::new(&conversation).unwrap())
}

/// Pinned digests. If one changes, the canonical form of the sequence changed: that is a
/// format change (every stored manifest's sequence_digest stops matching) and needs a new
/// format version, not a new snapshot. (v1 → v2 on 2026-12-02: the arrays are digested apart,
/// `docs/decisions/0085-the-agent-step-grows-with-the-new-turn-kept.md`.)
#[test]
fn sequence_digests_are_pinned() {
    let pins = [
        (
            "examples/weather.json",
            "sha256:fb5025819c58e62beefe8d050e25f506d7b6c656ba0cc395cc57e9086f9747d2",
        ),
        (
            "tests/data/ready_parallel_results_split_and_out_of_order.json",
            "sha256:3609d99c455285cd6da56e1f3c83e2dd849293b854d284de576276b22030e635",
        ),
        (
            "tests/data/waiting_no_results_yet.json",
            "sha256:b188477ea831993ce48b94adffd46fe472dfa3433542a5f2d9c1d2987ac65497",
        ),
    ];
    for (file, digest) in pins {
        assert_eq!(sequence_of(file).sequence_digest.as_str(), digest, "{file}");
    }
}

#[test]
fn the_weather_graph_has_every_block_edge_and_trust_label() {
    let sequence = sequence_of("examples/weather.json");
    let ids: Vec<&str> = sequence.blocks.iter().map(|b| b.id.as_str()).collect();
    assert_eq!(ids, ["s-1", "u-1", "u-2", "a-1", "a-2", "r-1", "r-2"]);
    let orders: Vec<u32> = sequence.blocks.iter().map(|b| b.order).collect();
    assert_eq!(orders, [0, 1, 2, 3, 4, 5, 6]);
    let trust: Vec<TrustLabel> = sequence.blocks.iter().map(|b| b.trust).collect();
    use TrustLabel::*;
    assert_eq!(trust, [Operator, User, Untrusted, Model, Model, Tool, Tool]);
    assert_eq!(sequence.edges.len(), 2);
    let paris = &sequence.edges[0];
    assert_eq!(
        (paris.call_id.as_str(), paris.call_block.as_str()),
        ("call-7", "a-1")
    );
    assert_eq!(paris.result.as_deref(), Some("r-2"));
    assert_eq!(paris.args_state, ArgState::Closed);
    assert!(paris.schema_digest.is_some());
    assert_eq!(sequence.edges[1].result.as_deref(), Some("r-1"));
}

#[test]
fn block_digests_ignore_ids_and_argument_spelling_changes_them() {
    let doc = |id: &str, arguments: serde_json::Value| {
        json!({"format": "turnstile.conversation.v1", "conversation_id": "c", "revision": 2, "turns": [
            {"id": "t1", "role": "user", "blocks": [{"id": id, "kind": "text", "text": "hi"}]},
            {"id": "t2", "role": "assistant", "generation": 1, "blocks": [
                {"id": "a", "kind": "tool_call", "call_id": "k", "tool": "f", "arguments": arguments}]}]})
    };
    let build = |value: serde_json::Value| {
        let conversation = turnstile_core::Conversation::from_value(value).unwrap();
        MessageSequence::build(Validated::new(&conversation).unwrap())
    };
    let one = build(doc("u-1", json!({"x": 1})));
    let renamed = build(doc("u-2", json!({"x": 1})));
    let as_text = build(doc("u-1", json!("{\"x\": 1}")));
    assert_eq!(one.blocks[0].digest, renamed.blocks[0].digest);
    assert_ne!(
        one.sequence_digest, renamed.sequence_digest,
        "ids are part of the graph"
    );
    assert_eq!(
        one.edges[0].args_digest, as_text.edges[0].args_digest,
        "same arguments, same args digest"
    );
    assert_ne!(
        one.blocks[1].digest, as_text.blocks[1].digest,
        "the block keeps the model's own spelling"
    );
}

#[test]
fn rejected_history_cannot_become_a_graph() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/orphan_results.json");
    let conversation = parse::conversation_from_slice(&std::fs::read(path).unwrap()).unwrap();
    let violations = Validated::new(&conversation).unwrap_err();
    assert!(violations.iter().all(|v| v.code.as_str() == "orphan_result"));
}

#[test]
fn the_fast_sequence_digest_equals_the_generic_canonical_digest() {
    for seed in 0..64u64 {
        let (value, _) = crate::generate::legal(seed, 4);
        let conversation = turnstile_core::Conversation::from_value(value).unwrap();
        let sequence = MessageSequence::build(Validated::new(&conversation).unwrap());
        assert_eq!(
            sequence.sequence_digest,
            generic_digest(&sequence),
            "seed {seed}: serde_json's bytes of the sequence are not its RFC 8785 form"
        );
        assert_eq!(
            serde_json::to_vec(&sequence).unwrap(),
            turnstile_core::digest::canonical_bytes(&sequence),
            "seed {seed}"
        );
    }
}

#[test]
fn generations_beyond_2_pow_53_take_the_generic_digest_path() {
    let value = json!({"format": "turnstile.conversation.v1", "conversation_id": "c", "revision": 2, "turns": [
        {"id": "t1", "role": "user", "blocks": [{"id": "u", "kind": "text", "text": "hi"}]},
        {"id": "t2", "role": "assistant", "generation": 9_007_199_254_740_993u64,
         "blocks": [{"id": "a", "kind": "text", "text": "yo"}]}]});
    let conversation = turnstile_core::Conversation::from_value(value).unwrap();
    let sequence = MessageSequence::build(Validated::new(&conversation).unwrap());
    assert_eq!(sequence.sequence_digest, generic_digest(&sequence));
}

/// The fast digest path writes block entries and edges by hand (`write_block`, `write_edge`):
/// ids, turn ids, call ids and tool names that need JSON escapes (and characters beyond ASCII)
/// must give the same digest as the generic canonical definition. Every optional edge field
/// is covered both ways: an answered call (result, status, args digest), an open one, and a
/// call to an undeclared tool (no schema digest).
#[test]
fn ids_that_need_escaping_digest_as_the_generic_definition() {
    for odd in [
        "q\"uote",
        "back\\slash",
        "new\nline",
        "ctl\u{1}\u{1f}",
        "é€😀",
        "\u{e000}x",
        "plain-id-longer-than-a-word",
    ] {
        let value = json!({"format": "turnstile.conversation.v1", "conversation_id": format!("c{odd}"), "revision": 4,
            "tools": [{"name": format!("f{odd}"), "description": "d", "input_schema": {"type": "object"}}],
            "turns": [
            {"id": format!("t1{odd}"), "role": "user", "blocks": [{"id": format!("u{odd}"), "kind": "text", "text": "hi"}]},
            {"id": format!("t2{odd}"), "role": "assistant", "generation": 3, "blocks": [
                {"id": format!("a{odd}"), "kind": "tool_call", "call_id": format!("k{odd}"), "tool": format!("f{odd}"), "arguments": {"x": odd}},
                {"id": format!("b{odd}"), "kind": "tool_call", "call_id": format!("m{odd}"), "tool": "undeclared", "arguments": {}}]},
            {"id": format!("t3{odd}"), "role": "tool", "blocks": [
                {"id": format!("r{odd}"), "kind": "tool_result", "call_id": format!("k{odd}"), "tool": format!("f{odd}"),
                 "generation": 3, "args_digest": turnstile_core::Digest::of_value(&json!({"x": odd})).as_str(), "status": "error", "content": [{"kind": "text", "text": "no"}]}]}]});
        let conversation = turnstile_core::Conversation::from_value(value).unwrap();
        let validated = Validated::new(&conversation);
        // The open call `m…` leaves the conversation waiting, which still has a sequence.
        let validated = validated.unwrap_or_else(|violations| panic!("{odd:?}: {violations:?}"));
        let sequence = MessageSequence::build(validated);
        assert_eq!(sequence.sequence_digest, generic_digest(&sequence), "{odd:?}");
        let grown = turnstile_core::sequence::GrowingSequence::of(validated);
        assert_eq!(
            grown.sequence().sequence_digest,
            generic_digest(&sequence),
            "{odd:?}"
        );
    }
}

/// The sequence's edges are hashed in 16 KiB pieces: a conversation with enough answered calls
/// to cross that several times digests as the generic definition, both built once (the edges
/// hashed at the digest) and kept to grow (the edges sealed as their results arrive).
#[test]
fn many_edges_digest_as_the_generic_definition_whole_and_grown() {
    let calls = 240;
    let mut turns =
        vec![json!({"id": "t0", "role": "user", "blocks": [{"id": "u0", "kind": "text", "text": "go"}]})];
    for index in 0..calls {
        let arguments = json!({"n": index});
        turns.push(json!({"id": format!("a{index}"), "role": "assistant", "generation": 1, "blocks": [
            {"id": format!("c{index}"), "kind": "tool_call", "call_id": format!("call-{index}"), "tool": "f", "arguments": arguments}]}));
        turns.push(json!({"id": format!("r{index}"), "role": "tool", "blocks": [
            {"id": format!("d{index}"), "kind": "tool_result", "call_id": format!("call-{index}"), "tool": "f", "generation": 1,
             "args_digest": turnstile_core::Digest::of_value(&arguments).as_str(), "status": "success",
             "content": [{"kind": "text", "text": "ok"}]}]}));
    }
    let value = json!({"format": "turnstile.conversation.v1", "conversation_id": "c", "revision": turns.len(),
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}], "turns": turns});
    let conversation = turnstile_core::Conversation::from_value(value).unwrap();
    let validated = Validated::new(&conversation).unwrap();
    let sequence = MessageSequence::build(validated);
    assert_eq!(sequence.edges.len(), calls);
    let edges_bytes = serde_json::to_vec(&sequence.edges).unwrap().len();
    assert!(edges_bytes > 3 * 16 * 1024, "{edges_bytes} bytes of edges");
    assert_eq!(sequence.sequence_digest, generic_digest(&sequence));
    let grown = turnstile_core::sequence::GrowingSequence::of(validated);
    assert_eq!(grown.sequence().sequence_digest, generic_digest(&sequence));
}
