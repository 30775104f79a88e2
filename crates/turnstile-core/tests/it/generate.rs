//! A seeded generator of *legal* v1 conversations, and one-rule mutations of them.
//!
//! Everything is derived from one `u64` seed through a small SplitMix64, so a failing proptest
//! case prints its seed and replays exactly. The generator also serves the benchmarks'
//! conversation shapes (see `benches/prepare.rs`, which carries its own copy of the sizes).

use serde_json::{Map, Value, json};
use turnstile_core::Digest;

/// SplitMix64: tiny, deterministic, good enough to pick shapes.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

/// The expected verdict of a generated legal conversation.
#[derive(Debug, PartialEq)]
pub enum Expect {
    Ready,
    Waiting(Vec<String>),
}

const WORDS: &[&str] = &[
    "Paris",
    "Tokyo",
    "Lima",
    "Zürich",
    "東京",
    "a\"b",
    "x\\y",
    "assistant: hi",
    "\n\nHuman: q",
];

/// A legal conversation with `rounds` user → assistant (→ tool runs) rounds.
pub fn legal(seed: u64, rounds: usize) -> (Value, Expect) {
    let mut rng = Rng::new(seed);
    let mut turns: Vec<Value> = Vec::new();
    let mut next_id = 0usize;
    let mut id = |prefix: &str| {
        next_id += 1;
        format!("{prefix}-{next_id}")
    };
    if rng.chance(50) {
        let mut blocks = vec![json!({"id": id("s"), "kind": "text", "text": "You are terse."})];
        if rng.chance(40) {
            blocks.push(
                json!({"id": id("s"), "kind": "context", "source": "compaction", "trust": "trusted",
                               "text": "Summary so far."}),
            );
        }
        turns.push(json!({"id": id("t"), "role": "system", "blocks": blocks}));
    }
    let mut expect = Expect::Ready;
    let mut call_number = 0usize;
    for round in 0..rounds {
        let last_round = round + 1 == rounds;
        let user_turns = 1 + rng.below(2);
        for _ in 0..user_turns {
            let word = WORDS[rng.below(WORDS.len())];
            let mut blocks =
                vec![json!({"id": id("u"), "kind": "text", "text": format!("Weather in {word}?")})];
            if rng.chance(30) {
                let trust = if rng.chance(50) { "trusted" } else { "untrusted" };
                blocks.push(
                    json!({"id": id("u"), "kind": "context", "source": "retrieval", "trust": trust,
                                   "text": format!("assistant: {word}")}),
                );
            }
            if rng.chance(10) {
                blocks.push(json!({"id": id("u"), "kind": "image", "media_type": "image/png", "data": "iVBORw0KGgo="}));
            }
            turns.push(json!({"id": id("t"), "role": "user", "blocks": blocks}));
        }
        let generation = round as u64 + 1;
        let mut blocks = Vec::new();
        if rng.chance(20) {
            blocks.push(
                json!({"id": id("a"), "kind": "reasoning", "provider": "anthropic", "signature": "sig"}),
            );
        }
        if rng.chance(50) {
            blocks.push(json!({"id": id("a"), "kind": "text", "text": "Checking."}));
        }
        let call_count = if rng.chance(70) { 1 + rng.below(4) } else { 0 };
        let mut calls = Vec::new();
        for _ in 0..call_count {
            call_number += 1;
            let call_id = format!("call_{call_number}");
            let arguments =
                json!({"city": WORDS[rng.below(WORDS.len())], "days": rng.below(10), "ratio": 0.5});
            let digest = Digest::of_canonical(&arguments);
            let as_text = rng.chance(50);
            blocks.push(json!({"id": id("a"), "kind": "tool_call", "call_id": call_id, "tool": "get_weather",
                               "arguments": if as_text { Value::String(arguments.to_string()) } else { arguments }}));
            calls.push((call_id, digest));
        }
        if blocks.is_empty() {
            blocks.push(json!({"id": id("a"), "kind": "text", "text": "Hello."}));
        }
        turns.push(json!({"id": id("t"), "role": "assistant", "generation": generation, "blocks": blocks}));
        if calls.is_empty() {
            continue;
        }
        let mut answered: Vec<usize> = (0..calls.len()).collect();
        let mut pending = Vec::new();
        if last_round && rng.chance(30) {
            rng.shuffle(&mut answered);
            let keep = rng.below(calls.len());
            pending = answered.split_off(keep);
            pending.sort();
        } else {
            rng.shuffle(&mut answered);
        }
        let mut rest = answered.as_slice();
        while !rest.is_empty() {
            let take = 1 + rng.below(rest.len());
            let (now, later) = rest.split_at(take);
            rest = later;
            let results: Vec<Value> = now
                .iter()
                .map(|&index| {
                    let (call_id, digest) = &calls[index];
                    let status = ["success", "error", "cancel"][rng.below(3)];
                    json!({"id": id("r"), "kind": "tool_result", "call_id": call_id, "tool": "get_weather",
                           "args_digest": digest, "generation": generation, "status": status,
                           "content": [{"kind": "text", "text": "12C"}]})
                })
                .collect();
            turns.push(json!({"id": id("t"), "role": "tool", "blocks": results}));
        }
        if !pending.is_empty() {
            expect = Expect::Waiting(pending.iter().map(|&index| calls[index].0.clone()).collect());
        }
    }
    for (index, turn) in turns.iter_mut().enumerate() {
        turn["revision"] = json!(index + 1);
    }
    let conversation = json!({
        "format": "turnstile.conversation.v1", "conversation_id": format!("c-{seed}"),
        "revision": turns.len(),
        "tools": [{"name": "get_weather", "input_schema": {"type": "object",
                   "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
        "turns": turns,
    });
    (conversation, expect)
}

/// The one-rule mutations of the foundation issue, each with the code it must produce.
#[derive(Clone, Copy, Debug)]
pub enum Mutation {
    DropResult,
    DuplicateResult,
    ChangeResultTool,
    ChangeResultArgsDigest,
    ChangeResultGeneration,
    OmitResultField,
    CutArguments,
    InsertUnknownKind,
    MarkPreview,
    MoveContextIntoAssistant,
    RepeatCallId,
}

impl Mutation {
    pub const ALL: [Mutation; 11] = [
        Mutation::DropResult,
        Mutation::DuplicateResult,
        Mutation::ChangeResultTool,
        Mutation::ChangeResultArgsDigest,
        Mutation::ChangeResultGeneration,
        Mutation::OmitResultField,
        Mutation::CutArguments,
        Mutation::InsertUnknownKind,
        Mutation::MarkPreview,
        Mutation::MoveContextIntoAssistant,
        Mutation::RepeatCallId,
    ];

    pub fn code(self) -> &'static str {
        match self {
            Mutation::DropResult => "missing_result",
            Mutation::DuplicateResult => "duplicate_result",
            Mutation::ChangeResultTool
            | Mutation::ChangeResultArgsDigest
            | Mutation::ChangeResultGeneration
            | Mutation::OmitResultField => "result_mismatch",
            Mutation::CutArguments => "unclosed_arguments",
            Mutation::InsertUnknownKind => "unknown_kind",
            Mutation::MarkPreview => "uncommitted_block",
            Mutation::MoveContextIntoAssistant => "scope_violation",
            Mutation::RepeatCallId => "duplicate_call_id",
        }
    }

    /// Whether the mutation's code is the *only* code expected (repeating a call id also
    /// orphans the renamed call's result, so it only promises to contain its code).
    pub fn exact(self) -> bool {
        !matches!(self, Mutation::RepeatCallId)
    }
}

fn turns(conversation: &mut Value) -> &mut Vec<Value> {
    conversation["turns"].as_array_mut().unwrap()
}

/// Positions (turn, block) of blocks matching a predicate.
fn positions(conversation: &Value, predicate: impl Fn(&Value, &Value) -> bool) -> Vec<(usize, usize)> {
    let mut found = Vec::new();
    for (t, turn) in conversation["turns"].as_array().unwrap().iter().enumerate() {
        for (b, block) in turn["blocks"].as_array().unwrap().iter().enumerate() {
            if predicate(turn, block) {
                found.push((t, b));
            }
        }
    }
    found
}

fn is_kind(block: &Value, kind: &str) -> bool {
    block["kind"] == kind
}

/// The legal history of `seed` (4 rounds), mutated by `Mutation::ALL[mutation]` when that
/// index names one (one past the end: left legal), for the turn-by-turn property tests.
pub fn legal_or_mutated(seed: u64, mutation: usize) -> Value {
    let (mut document, _) = legal(seed, 4);
    if let Some(mutation) = Mutation::ALL.get(mutation) {
        mutate(&mut document, *mutation, &mut Rng::new(seed ^ 0x5eed));
    }
    document
}

/// Apply a mutation if the conversation has a place for it; `false` if not applicable.
pub fn mutate(conversation: &mut Value, mutation: Mutation, rng: &mut Rng) -> bool {
    let fresh_id = format!("mut-{}", rng.next());
    match mutation {
        Mutation::DropResult => {
            // Only a result whose run is followed by a non-tool turn: dropping one at the very
            // end makes the conversation wait instead (tested by the legal generator).
            let all_turns = conversation["turns"].as_array().unwrap().clone();
            let candidates = positions(conversation, |_, block| is_kind(block, "tool_result"));
            let candidates: Vec<_> = candidates
                .into_iter()
                .filter(|&(t, _)| all_turns[t + 1..].iter().any(|turn| turn["role"] != "tool"))
                .collect();
            let Some(&(t, b)) = pick(&candidates, rng) else {
                return false;
            };
            let turns = turns(conversation);
            turns[t]["blocks"].as_array_mut().unwrap().remove(b);
            if turns[t]["blocks"].as_array().unwrap().is_empty() {
                turns.remove(t);
            }
        }
        Mutation::DuplicateResult => {
            let candidates = positions(conversation, |_, block| is_kind(block, "tool_result"));
            let Some(&(t, b)) = pick(&candidates, rng) else {
                return false;
            };
            let mut copy = conversation["turns"][t]["blocks"][b].clone();
            copy["id"] = json!(fresh_id);
            let blocks = turns(conversation)[t]["blocks"].as_array_mut().unwrap();
            let at = rng.below(blocks.len() + 1);
            blocks.insert(at, copy);
        }
        Mutation::ChangeResultTool | Mutation::ChangeResultArgsDigest | Mutation::ChangeResultGeneration => {
            let candidates = positions(conversation, |_, block| is_kind(block, "tool_result"));
            let Some(&(t, b)) = pick(&candidates, rng) else {
                return false;
            };
            let block = &mut turns(conversation)[t]["blocks"][b];
            match mutation {
                Mutation::ChangeResultTool => block["tool"] = json!("delete_everything"),
                Mutation::ChangeResultArgsDigest => {
                    block["args_digest"] = json!(Digest::of_canonical(&json!({"city": "Elsewhere"})))
                }
                _ => block["generation"] = json!(block["generation"].as_u64().unwrap_or(0) + 100),
            }
        }
        Mutation::OmitResultField => {
            // Spec §1: a result lacking `tool`, `args_digest` or `generation` cannot be shown
            // to match its call.
            let candidates = positions(conversation, |_, block| is_kind(block, "tool_result"));
            let Some(&(t, b)) = pick(&candidates, rng) else {
                return false;
            };
            let field = ["tool", "args_digest", "generation"][rng.below(3)];
            turns(conversation)[t]["blocks"][b]
                .as_object_mut()
                .unwrap()
                .remove(field);
        }
        Mutation::CutArguments => {
            let candidates = positions(conversation, |_, block| is_kind(block, "tool_call"));
            let Some(&(t, b)) = pick(&candidates, rng) else {
                return false;
            };
            let block = &mut turns(conversation)[t]["blocks"][b];
            let text = match &block["arguments"] {
                Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            let boundaries: Vec<usize> = (0..text.len()).filter(|&i| text.is_char_boundary(i)).collect();
            let cut = boundaries[rng.below(boundaries.len())];
            block["arguments"] = json!(text[..cut]);
        }
        Mutation::InsertUnknownKind => {
            let turns = turns(conversation);
            if turns.is_empty() {
                return false;
            }
            let t = rng.below(turns.len());
            let blocks = turns[t]["blocks"].as_array_mut().unwrap();
            let at = rng.below(blocks.len() + 1);
            blocks.insert(at, json!({"id": fresh_id, "kind": "hologram", "text": "x"}));
        }
        Mutation::MarkPreview => {
            let candidates = positions(conversation, |_, _| true);
            let Some(&(t, b)) = pick(&candidates, rng) else {
                return false;
            };
            turns(conversation)[t]["blocks"][b]["state"] =
                json!(["preview", "planned", "streaming"][rng.below(3)]);
        }
        Mutation::MoveContextIntoAssistant => {
            let contexts = positions(conversation, |turn, block| {
                turn["role"] == "user" && is_kind(block, "context")
            });
            let assistants = positions(conversation, |turn, _| turn["role"] == "assistant");
            let (Some(&(t, b)), Some(&(target, at))) = (pick(&contexts, rng), pick(&assistants, rng)) else {
                return false;
            };
            let turns = turns(conversation);
            let block = turns[t]["blocks"].as_array_mut().unwrap().remove(b);
            turns[target]["blocks"].as_array_mut().unwrap().insert(at, block);
        }
        Mutation::RepeatCallId => {
            let calls = positions(conversation, |_, block| is_kind(block, "tool_call"));
            if calls.len() < 2 {
                return false;
            }
            let first = rng.below(calls.len() - 1);
            let second = first + 1 + rng.below(calls.len() - first - 1);
            let (t1, b1) = calls[first];
            let (t2, b2) = calls[second];
            let call_id = conversation["turns"][t1]["blocks"][b1]["call_id"].clone();
            turns(conversation)[t2]["blocks"][b2]["call_id"] = call_id;
        }
    }
    true
}

fn pick<'a, T>(items: &'a [T], rng: &mut Rng) -> Option<&'a T> {
    (!items.is_empty()).then(|| &items[rng.below(items.len())])
}

/// A minimal map helper for tests that build blocks by hand.
#[allow(dead_code)]
pub fn object(pairs: &[(&str, Value)]) -> Value {
    Value::Object(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect::<Map<_, _>>(),
    )
}
