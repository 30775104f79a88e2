//! The render of a kept conversation resumes from the state kept at the last segment start of
//! the render before (`render.rs`, "resume"), and that changes nothing:
//!
//! - Property: random legal conversations (the `render_props` generator, with cache marks on
//!   random blocks, system turns after the first, call ids the APIs rewrite, turns taken back
//!   and pushed again, detours of one or two turns pushed and taken back, and the output cap changed between
//!   steps) are pushed turn by turn into a `KeptConversation` and prepared after every push
//!   with every adapter and one shared cache. Each outcome (body, manifest, policy, tokens, or
//!   the pauses) equals a cold prepare of the same turns with a fresh cache.
//! - A long agent loop renders, at every step, only the blocks of the last old segment and the
//!   new turn (fragment lookups counted), for every adapter; red when the render does not
//!   resume.

use crate::render_props::{Gen, conversation, run_seed, runner};
use crate::render_support::model_for;
use serde_json::{Value, json};
use turnstile_adapters::render::{Graph, RenderCache};
use turnstile_adapters::{AdapterId, Catalog, PrepareOutcome, PrepareRequest, prepare};
use turnstile_core::conversation::Conversation;
use turnstile_core::{KeptConversation, MessageSequence, Revision, Validated};

fn request(adapter: AdapterId, max_output_tokens: u64) -> PrepareRequest {
    PrepareRequest {
        operation_id: "op-resume".into(),
        adapter,
        provider: None,
        model: model_for(adapter).into(),
        max_output_tokens: Some(max_output_tokens),
        stream: true,
        background: false,
        text_content: Default::default(),
    }
}

/// A cold prepare of the whole conversation with a fresh cache, as text to compare.
fn cold(conversation: &Conversation, request: &PrepareRequest) -> String {
    let Ok(validated) = Validated::new(conversation) else {
        return "rejected".into();
    };
    let sequence = MessageSequence::build(validated);
    match Graph::new(validated, &sequence) {
        Ok(graph) => outcome(prepare(
            graph,
            request,
            &Catalog::builtin(),
            &mut RenderCache::new(),
        )),
        Err(error) => format!("not renderable: {error}"),
    }
}

/// A prepare of the kept conversation with the shared cache, as text to compare.
fn kept(kept: &KeptConversation, request: &PrepareRequest, cache: &mut RenderCache) -> String {
    match Graph::kept(kept) {
        None => "rejected".into(),
        Some(Ok(graph)) => outcome(prepare(graph, request, &Catalog::builtin(), cache)),
        Some(Err(error)) => format!("not renderable: {error}"),
    }
}

fn outcome(outcome: PrepareOutcome) -> String {
    match outcome {
        PrepareOutcome::Prepared(prepared) => format!(
            "prepared {} tokens, manifest {}, policy {}\n{}",
            prepared.rendered.prompt_tokens,
            prepared.manifest.manifest_digest,
            serde_json::to_string(&prepared.rendered.policy).unwrap(),
            String::from_utf8_lossy(&prepared.rendered.body)
        ),
        other => format!("{other:?}"),
    }
}

/// The generator's conversation, varied: cache marks on random blocks (a few with a one-hour
/// TTL, which the OpenAI APIs pause on), a system turn before a random user turn, and the
/// turns numbered again.
fn varied(case: u64, documents: bool) -> Value {
    let mut document = conversation(case, documents);
    let mut g = Gen::new(case ^ 0x5eed);
    let turns = document["turns"].as_array_mut().unwrap();
    let marks = g.below(4);
    for _ in 0..marks {
        let turn = g.below(turns.len() as u64) as usize;
        let blocks = turns[turn]["blocks"].as_array_mut().unwrap();
        let block = g.below(blocks.len() as u64) as usize;
        blocks[block]["cache"] = if g.chance(15) {
            json!({"ttl": "1h"})
        } else {
            json!({})
        };
    }
    if g.chance(40) {
        let users: Vec<usize> = (1..turns.len())
            .filter(|&index| turns[index]["role"] == "user")
            .collect();
        if !users.is_empty() {
            let at = users[g.below(users.len() as u64) as usize];
            turns.insert(
                at,
                json!({"role": "system", "blocks": [{"id": format!("s-late-{case}"), "kind": "text", "text": "Answer in French from now on."}]}),
            );
        }
    }
    let count = turns.len();
    for (index, turn) in turns.iter_mut().enumerate() {
        turn["id"] = json!(format!("t-{}", index + 1));
        turn["revision"] = json!(index + 1);
    }
    document["revision"] = json!(count);
    document
}

#[test]
fn a_resumed_render_prepares_what_a_cold_prepare_of_the_same_turns_does() {
    let seed = run_seed("render_resume");
    let mut runner = runner(seed, 48);
    let resumed_total = std::cell::Cell::new(0u64);
    let prepared_total = std::cell::Cell::new(0u64);
    let result = runner.run(
        &(proptest::num::u64::ANY, proptest::bool::ANY),
        |(case, documents)| {
            let document = varied(case, documents);
            let turns = document["turns"].as_array().unwrap().clone();
            let revision = Revision(document["revision"].as_u64().unwrap());
            let mut g = Gen::new(case);
            let mut first = document.clone();
            first["turns"] = Value::Array(turns[..1].to_vec());
            let mut state = KeptConversation::new(Conversation::from_value(first).unwrap());
            let mut cache = RenderCache::new();
            let mut max_output_tokens = 512;
            let check = |state: &KeptConversation, upto: &[Value], cache: &mut RenderCache, max: u64, what: &str| {
                let mut whole = document.clone();
                whole["turns"] = Value::Array(upto.to_vec());
                let whole = Conversation::from_value(whole).unwrap();
                let mut prepared = 0u64;
                for adapter in AdapterId::ALL {
                    let request = request(adapter, max);
                    let expected = cold(&whole, &request);
                    let got = kept(state, &request, cache);
                    prepared += u64::from(expected.starts_with("prepared"));
                    proptest::prop_assert_eq!(got, expected, "case {} × {}, {}", case, adapter, what);
                }
                Ok(prepared)
            };
            prepared_total.set(prepared_total.get() + check(&state, &turns[..1], &mut cache, max_output_tokens, "first turn")?);
            for index in 1..turns.len() {
                if g.chance(20) {
                    // A detour: one or two turns pushed, prepared, and taken back (two move the
                    // kept state past the first, so only its stamp tells it is gone).
                    let mut upto = turns[..index].to_vec();
                    let mut pushes = Vec::new();
                    for detour in 0..1 + g.below(2) {
                        let turn = json!({"id": format!("t-detour-{index}-{detour}"), "role": "user",
                            "blocks": [{"id": format!("b-detour-{index}-{detour}"), "kind": "text", "text": format!("a detour {detour}")}]});
                        pushes.push(state.push_turn(turn.clone(), revision).unwrap());
                        upto.push(turn);
                        prepared_total.set(prepared_total.get() + check(&state, &upto, &mut cache, max_output_tokens, "detour")?);
                    }
                    while let Some(pushed) = pushes.pop() {
                        state.pop_turn(pushed).unwrap();
                    }
                }
                let pushed = state.push_turn(turns[index].clone(), revision).unwrap();
                if g.chance(20) {
                    // Taken back and pushed again: the same turn under a new stamp.
                    state.pop_turn(pushed).unwrap();
                    prepared_total.set(prepared_total.get() + check(&state, &turns[..index], &mut cache, max_output_tokens, "taken back")?);
                    let _ = state.push_turn(turns[index].clone(), revision).unwrap();
                }
                if g.chance(10) {
                    max_output_tokens = if max_output_tokens == 512 { 1024 } else { 512 };
                }
                prepared_total.set(prepared_total.get() + check(&state, &turns[..=index], &mut cache, max_output_tokens, &format!("turn {index}"))?);
            }
            resumed_total.set(resumed_total.get() + cache.resumed().0);
            // One kept state per adapter at most (one conversation).
            let (memos, _) = cache.resume_memos();
            proptest::prop_assert!(memos <= AdapterId::ALL.len(), "{} memos", memos);
            Ok(())
        },
    );
    if let Err(error) = result {
        panic!("seed {seed}: {error}");
    }
    // The property is only worth something if the renders did resume, and prepared.
    let (prepared, resumed) = (prepared_total.get(), resumed_total.get());
    assert!(prepared >= 500, "only {prepared} prepared");
    assert!(
        resumed * 3 >= prepared,
        "only {resumed} of {prepared} renders resumed"
    );
}

/// What an agent loop adds between two requests: the model's call, its result, the model's
/// answer, and the next user turn.
fn agent_turns(step: usize) -> Vec<Value> {
    vec![
        json!({"role": "assistant", "generation": step + 1, "blocks": [
            {"id": format!("a-{step}"), "kind": "text", "text": format!("looking {step}")},
            {"id": format!("c-{step}"), "kind": "tool_call", "call_id": format!("call_{step}"), "tool": "search", "arguments": "{\"q\": \"x\"}"}]}),
        json!({"role": "tool", "blocks": [{"id": format!("r-{step}"), "kind": "tool_result", "call_id": format!("call_{step}"), "tool": "search",
            "args_digest": turnstile_core::Digest::of_canonical(&json!({"q": "x"})), "generation": step + 1, "status": "success",
            "content": [{"kind": "text", "text": format!("found {step}")}]}]}),
        json!({"role": "assistant", "generation": step + 1, "blocks": [{"id": format!("f-{step}"), "kind": "text", "text": format!("answer {step}")}]}),
        json!({"role": "user", "blocks": [{"id": format!("u-{step}"), "kind": "text", "text": format!("question {step}")}]}),
    ]
}

/// Push the turns of agent step `step` into `state`, each under the next revision after
/// `revision` (which it advances); returns them as pushed.
fn push_agent_step(state: &mut KeptConversation, step: usize, revision: &mut u64) -> Vec<Value> {
    agent_turns(step)
        .into_iter()
        .map(|mut turn| {
            *revision += 1;
            turn["id"] = json!(format!("t-{revision}"));
            turn["revision"] = json!(*revision);
            let _ = state.push_turn(turn.clone(), Revision(*revision)).unwrap();
            turn
        })
        .collect()
}

#[test]
fn each_step_of_a_long_agent_loop_renders_only_its_new_turns() {
    let start = json!({
        "format": "turnstile.conversation.v1",
        "conversation_id": "c-resume-loop",
        "revision": 2,
        "tools": [{"name": "search", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}],
        "turns": [
            {"id": "t-0", "revision": 1, "role": "system", "blocks": [{"id": "s-0", "kind": "text", "text": "Be brief."}]},
            {"id": "t-1", "revision": 2, "role": "user", "blocks": [{"id": "u-first", "kind": "text", "text": "Begin."}]}],
    });
    for adapter in AdapterId::ALL {
        let mut state = KeptConversation::new(Conversation::from_value(start.clone()).unwrap());
        let mut cache = RenderCache::new();
        let text = kept(&state, &request(adapter, 512), &mut cache);
        assert!(text.starts_with("prepared"), "{adapter}: {text}");
        let mut revision = 2;
        let mut first_lookups = None;
        for step in 0..60 {
            push_agent_step(&mut state, step, &mut revision);
            let (hits, misses) = cache.stats();
            let text = kept(&state, &request(adapter, 512), &mut cache);
            assert!(text.starts_with("prepared"), "{adapter}, step {step}: {text}");
            let (hits_after, misses_after) = cache.stats();
            let lookups = hits_after + misses_after - hits - misses;
            // The render went on from the last old segment (the user turn before the new
            // turns), so it looked up the blocks of that turn and the new ones, the tools, and
            // (Gemini, in the tail) the system block: the same count at every step, where a
            // whole render looks up every block of the history.
            let (resumed, from) = cache.resumed();
            let turns = state.conversation().turns.len();
            assert_eq!(
                resumed,
                step as u64 + 1,
                "{adapter}, step {step}: renders resumed"
            );
            assert_eq!(
                from,
                turns - 5,
                "{adapter}, step {step}: resumed at turn {from} of {turns}"
            );
            assert!(
                lookups <= 8,
                "{adapter}, step {step}: {lookups} fragment lookups for {turns} turns"
            );
            assert_eq!(
                *first_lookups.get_or_insert(lookups),
                lookups,
                "{adapter}, step {step}"
            );
        }
    }
}

/// Two models on one adapter (a failover pair, or a client switching models) each keep their
/// own state: the renders of both resume at every step, and each body equals a cold prepare of
/// the same turns. Red when the kept states are keyed by (adapter, conversation) alone: each
/// model's render then replaces the other's state, and none resumes.
#[test]
fn two_models_on_one_adapter_each_resume_their_own_render() {
    let start = json!({
        "format": "turnstile.conversation.v1",
        "conversation_id": "c-resume-two-models",
        "revision": 1,
        "tools": [{"name": "search", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}],
        "turns": [{"id": "t-1", "revision": 1, "role": "user", "blocks": [{"id": "u-first", "kind": "text", "text": "Begin."}]}],
    });
    for adapter in AdapterId::ALL {
        let first = request(adapter, 512);
        let mut second = request(adapter, 512);
        second.model = format!("{}-20260101", first.model);
        let mut state = KeptConversation::new(Conversation::from_value(start.clone()).unwrap());
        let mut document = start.clone();
        let mut cache = RenderCache::new();
        let mut revision = 1;
        for step in 0..12 {
            let pushed = push_agent_step(&mut state, step, &mut revision);
            document["turns"].as_array_mut().unwrap().extend(pushed);
            document["revision"] = json!(revision);
            let whole = Conversation::from_value(document.clone()).unwrap();
            for request in [&first, &second] {
                let got = kept(&state, request, &mut cache);
                assert!(got.starts_with("prepared"), "{adapter} {}: {got}", request.model);
                assert_eq!(
                    got,
                    cold(&whole, request),
                    "{adapter} {}, step {step}",
                    request.model
                );
            }
            // The first step renders both whole; every later one resumes both.
            assert_eq!(cache.resumed().0, 2 * step as u64, "{adapter}, step {step}");
        }
        assert_eq!(cache.resume_memos().0, 2, "{adapter}: one state per model");
    }
}
