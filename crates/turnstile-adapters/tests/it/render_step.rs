//! The agent step: a conversation kept in memory (`KeptConversation`) and prepared after each
//! new turn with one shared render cache gives, at every step and for every adapter, exactly
//! the body and manifest a cold prepare of the whole file gives; the render resumes from the
//! state kept at the last segment start of the render before (so a step renders its new
//! turns, not the history); the request digest resumes from the last body's midstate (fewer
//! bytes hashed than the body holds) and always equals SHA-256 of the body.

use crate::render_support::{SCENARIOS, data_dir, model_for};
use proptest::prelude::*;
use serde_json::Value;
use turnstile_adapters::render::{Graph, RenderCache};
use turnstile_adapters::{AdapterId, Catalog, PrepareOutcome, PrepareRequest, prepare};
use turnstile_core::conversation::Conversation;
use turnstile_core::{Digest, KeptConversation, MessageSequence, Revision, Validated};

fn request(adapter: AdapterId) -> PrepareRequest {
    PrepareRequest {
        operation_id: "op-step".into(),
        adapter,
        provider: None,
        model: model_for(adapter).into(),
        max_output_tokens: Some(512),
        stream: true,
        background: false,
        text_content: Default::default(),
    }
}

/// A cold prepare of the whole conversation: (body, manifest digest), or None when it is not
/// prepared (waiting, rejected, paused, over budget).
fn cold(conversation: &Conversation, adapter: AdapterId) -> Option<(Vec<u8>, Digest)> {
    let validated = Validated::new(conversation).ok()?;
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).ok()?;
    match prepare(
        graph,
        &request(adapter),
        &Catalog::builtin(),
        &mut RenderCache::new(),
    ) {
        PrepareOutcome::Prepared(prepared) => {
            Some((prepared.rendered.body, prepared.manifest.manifest_digest))
        }
        _ => None,
    }
}

fn kept(kept: &KeptConversation, adapter: AdapterId, cache: &mut RenderCache) -> Option<(Vec<u8>, Digest)> {
    let graph = Graph::kept(kept)?.ok()?;
    match prepare(graph, &request(adapter), &Catalog::builtin(), cache) {
        PrepareOutcome::Prepared(prepared) => {
            assert_eq!(
                prepared.manifest.body.request_digest,
                Digest::of_bytes(&prepared.rendered.body),
                "the request digest is SHA-256 of the body"
            );
            Some((prepared.rendered.body, prepared.manifest.manifest_digest))
        }
        _ => None,
    }
}

#[test]
fn every_step_of_every_scenario_prepares_what_a_cold_prepare_of_the_file_does() {
    let mut steps = 0;
    let mut resumed = 0;
    for name in SCENARIOS {
        let bytes = std::fs::read(data_dir().join(format!("{name}.json"))).unwrap();
        let document: Value = serde_json::from_slice(&bytes).unwrap();
        let turns = document["turns"].as_array().unwrap().clone();
        let revision = Revision(document["revision"].as_u64().unwrap());
        for adapter in AdapterId::ALL {
            let mut first = document.clone();
            first["turns"] = Value::Array(turns[..1].to_vec());
            let mut state = KeptConversation::new(Conversation::from_value(first).unwrap());
            let mut cache = RenderCache::new();
            for (index, turn) in turns.iter().enumerate().skip(1) {
                let _ = state.push_turn(turn.clone(), revision).unwrap();
                let mut whole = document.clone();
                whole["turns"] = Value::Array(turns[..=index].to_vec());
                let expected = cold(&Conversation::from_value(whole).unwrap(), adapter);
                let got = kept(&state, adapter, &mut cache);
                assert_eq!(
                    got.as_ref()
                        .map(|(body, digest)| (String::from_utf8_lossy(body), digest)),
                    expected
                        .as_ref()
                        .map(|(body, digest)| (String::from_utf8_lossy(body), digest)),
                    "{name}, {adapter}, after turn {index}"
                );
                steps += usize::from(got.is_some());
            }
            resumed += cache.resumed().0;
        }
    }
    assert!(steps >= 60, "only {steps} steps prepared");
    assert!(resumed >= 40, "only {resumed} of {steps} renders resumed");
}

#[test]
fn a_long_agent_loop_hashes_only_the_tail_of_each_new_body() {
    let document: Value =
        serde_json::from_slice(&std::fs::read(data_dir().join("multi_round.json")).unwrap()).unwrap();
    let mut state = KeptConversation::new(Conversation::from_value(document.clone()).unwrap());
    let mut cache = RenderCache::new();
    let adapter = AdapterId::AnthropicMessagesV1;
    let mut revision = document["revision"].as_u64().unwrap();
    let mut whole = document.clone();
    let mut last_body: Vec<u8> = Vec::new();
    for step in 0..120 {
        revision += 1;
        let role = if step % 2 == 0 { "user" } else { "assistant" };
        let turn = serde_json::json!({"id": format!("t-step-{step}"), "revision": revision, "role": role,
            "blocks": [{"id": format!("b-step-{step}"), "kind": "text",
                        "text": format!("step {step}: {}", "words of a longer message ".repeat(8))}]});
        let _ = state.push_turn(turn.clone(), Revision(revision)).unwrap();
        whole["revision"] = revision.into();
        whole["turns"].as_array_mut().unwrap().push(turn);
        if role == "assistant" {
            continue;
        }
        let (body, digest) = kept(&state, adapter, &mut cache).expect("the loop prepares");
        let expected = cold(&Conversation::from_value(whole.clone()).unwrap(), adapter).unwrap();
        assert_eq!((&body, &digest), (&expected.0, &expected.1), "step {step}");
        // Hashed: from the start of the 4 KiB chunk where this body parts from the last one
        // (the tool list after the messages, here), never the unchanged chunks before it.
        if !last_body.is_empty() {
            let at = last_body.iter().zip(&body).take_while(|(a, b)| a == b).count();
            assert_eq!(
                cache.body_bytes_hashed(),
                body.len() - at / 4096 * 4096,
                "step {step}: the bodies part at {at}"
            );
            if body.len() > 16 * 1024 {
                assert!(cache.body_bytes_hashed() * 2 < body.len(), "step {step}");
            }
        }
        last_body = body;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Any sequence of bodies (each an edit of the last: a cut, a tail appended, a byte
    /// changed), of one or two conversations: the digest is SHA-256 of the bytes.
    #[test]
    fn the_body_digest_is_sha256_of_the_body_whatever_came_before(
        edits in proptest::collection::vec((0usize..20_000, proptest::collection::vec(any::<u8>(), 0..9_000), any::<u8>(), 0u8..3), 1..12)
    ) {
        let mut cache = RenderCache::new();
        let mut body: Vec<u8> = Vec::new();
        for (cut, tail, flip, other) in edits {
            body.truncate(cut.min(body.len()));
            body.extend_from_slice(&tail);
            if let Some(byte) = body.get_mut(cut / 3) {
                *byte ^= flip;
            }
            // Two conversations and two adapters share the cache.
            let (adapter, conversation) = match other {
                0 => (AdapterId::AnthropicMessagesV1, "c-one"),
                1 => (AdapterId::AnthropicMessagesV1, "c-other"),
                _ => (AdapterId::OpenaiChatV1, "c-one"),
            };
            prop_assert_eq!(cache.body_digest(adapter, "m", conversation, &body), Digest::of_bytes(&body));
        }
    }
}

/// The memos stay within their byte bound (allocated bytes, midstates included) however many
/// conversations and however large their bodies: with 8 MiB bodies and a 64 MiB bound, at most
/// 8 are kept, and the count of bytes is at least what they hold. A body that shrinks gives its
/// buffer back.
#[test]
fn the_body_memos_keep_to_their_byte_bound() {
    let mut cache = RenderCache::new();
    let big = vec![b'x'; 8 * 1024 * 1024];
    for index in 0..20 {
        let body = &big[..big.len() - index];
        assert_eq!(
            cache.body_digest(AdapterId::AnthropicMessagesV1, "m", &format!("c-{index}"), body),
            Digest::of_bytes(body)
        );
        let (kept, bytes) = cache.body_memos();
        assert!(kept <= 8, "{kept} bodies of 8 MiB kept under a 64 MiB bound");
        assert!(
            bytes >= kept * body.len(),
            "{bytes} bytes counted for {kept} bodies"
        );
        assert!(bytes <= 64 * 1024 * 1024, "{bytes}");
    }
    let (_, held) = cache.body_memos();
    let _ = cache.body_digest(AdapterId::AnthropicMessagesV1, "m", "c-19", b"short");
    let (_, after) = cache.body_memos();
    assert!(after + 4 * 1024 * 1024 < held, "a shrunk body keeps its buffer");
}

/// A cache that is one of several (`RenderCache::one_of`, a gateway's shards) keeps that share
/// of every bound: of the fragments and their bytes, and of the kept bodies by count and by
/// bytes. Its digests are still exact.
#[test]
fn a_cache_that_is_one_of_several_keeps_that_share_of_every_bound() {
    let whole = RenderCache::new();
    let quarter = RenderCache::one_of(4);
    let (fragments, bytes) = whole.bounds();
    assert_eq!(quarter.bounds(), (fragments / 4, bytes / 4));
    assert_eq!(
        RenderCache::one_of(0).bounds(),
        whole.bounds(),
        "no shares is one"
    );
    // 256 bodies in all: a cache that is one of 64 keeps 4.
    let mut sixty_fourth = RenderCache::one_of(64);
    for index in 0..10 {
        let body = format!("body {index}").into_bytes();
        assert_eq!(
            sixty_fourth.body_digest(AdapterId::AnthropicMessagesV1, "m", &format!("c-{index}"), &body),
            Digest::of_bytes(&body)
        );
    }
    assert_eq!(sixty_fourth.body_memos().0, 4);
    // 64 MiB of bodies in all: one of 16 would keep 4 MiB, but its floor is 8 MiB: it keeps
    // two 3 MiB bodies, not three.
    let mut sixteenth = RenderCache::one_of(16);
    let big = vec![b'x'; 3 * 1024 * 1024];
    for index in 0..3 {
        let body = &big[..big.len() - index];
        assert_eq!(
            sixteenth.body_digest(AdapterId::AnthropicMessagesV1, "m", &format!("c-{index}"), body),
            Digest::of_bytes(body)
        );
        let (kept, bytes) = sixteenth.body_memos();
        assert!(
            kept <= 2 && bytes <= 8 * 1024 * 1024,
            "{kept} bodies, {bytes} bytes"
        );
    }
    assert_eq!(sixteenth.body_memos().0, 2);
}

/// A user turn that ends a conversation at `revision`, appended to `state` and `whole`.
fn push_user(state: &mut KeptConversation, whole: &mut Value, step: usize, text: &str) {
    let revision = whole["revision"].as_u64().unwrap() + 1;
    let turn = serde_json::json!({"id": format!("t-share-{step}"), "revision": revision, "role": "user",
        "blocks": [{"id": format!("b-share-{step}"), "kind": "text", "text": text}]});
    let _ = state.push_turn(turn.clone(), Revision(revision)).unwrap();
    whole["revision"] = revision.into();
    whole["turns"].as_array_mut().unwrap().push(turn);
}

/// The render states a share keeps: that share of the count (one of 32 keeps 8 of 256, not all
/// 10 conversations'), and never fewer bytes than the floor, so that one large conversation
/// still resumes in a cache that is one of 64 (whose plain share, 1 MiB, would drop its 2 MiB
/// state and its 2 MiB body after every render). Every body is still a cold prepare's.
#[test]
fn a_share_keeps_its_share_of_render_states_and_still_resumes_one_large_conversation() {
    let document: Value =
        serde_json::from_slice(&std::fs::read(data_dir().join("multi_round.json")).unwrap()).unwrap();
    let adapter = AdapterId::AnthropicMessagesV1;
    let mut thirty_second = RenderCache::one_of(32);
    for index in 0..10 {
        let mut whole = document.clone();
        whole["conversation_id"] = format!("c-share-{index}").into();
        let mut state = KeptConversation::new(Conversation::from_value(whole.clone()).unwrap());
        push_user(&mut state, &mut whole, 0, "one more question");
        let (body, digest) = kept(&state, adapter, &mut thirty_second).expect("prepares");
        let expected = cold(&Conversation::from_value(whole).unwrap(), adapter).unwrap();
        assert_eq!((body, digest), expected, "conversation {index}");
        assert!(
            thirty_second.resume_memos().0 <= 8,
            "{:?}",
            thirty_second.resume_memos()
        );
    }
    assert_eq!(thirty_second.resume_memos().0, 8);

    // Gemini: its window takes a 2 MiB turn.
    let large = AdapterId::GeminiV1;
    let mut sixty_fourth = RenderCache::one_of(64);
    let mut whole = document.clone();
    whole["conversation_id"] = "c-share-large".into();
    let mut state = KeptConversation::new(Conversation::from_value(whole.clone()).unwrap());
    push_user(&mut state, &mut whole, 0, &" the".repeat(560_000));
    for step in 1..4 {
        let resumed_before = sixty_fourth.resumed().0;
        push_user(&mut state, &mut whole, step, "and one more question");
        // A user turn after a user turn is legal: the renderers merge or separate them alike.
        let (body, digest) = kept(&state, large, &mut sixty_fourth).expect("prepares");
        let expected = cold(&Conversation::from_value(whole.clone()).unwrap(), large).unwrap();
        assert!(body.len() > 2 * 1024 * 1024, "{}", body.len());
        assert_eq!((&body, &digest), (&expected.0, &expected.1), "step {step}");
        if step > 1 {
            assert_eq!(
                sixty_fourth.resumed().0,
                resumed_before + 1,
                "step {step} resumed from the kept state"
            );
            assert!(
                sixty_fourth.body_bytes_hashed() * 4 < body.len(),
                "step {step} hashed {} of {} bytes",
                sixty_fourth.body_bytes_hashed(),
                body.len()
            );
        }
    }
}

/// A share's fragment bound clears its share: one of 250,000 keeps at most 4 fragments, so a
/// second render of one conversation misses again (a whole cache hits every fragment), and
/// both renders are still a cold prepare's bytes.
#[test]
fn a_share_clears_its_fragments_at_its_share_of_the_bound() {
    let document: Value =
        serde_json::from_slice(&std::fs::read(data_dir().join("multi_round.json")).unwrap()).unwrap();
    let adapter = AdapterId::AnthropicMessagesV1;
    let expected = cold(&Conversation::from_value(document.clone()).unwrap(), adapter).unwrap();
    let mut whole = RenderCache::new();
    let mut tiny = RenderCache::one_of(250_000);
    assert_eq!(tiny.bounds().0, 4);
    for cache in [&mut whole, &mut tiny] {
        for _ in 0..2 {
            // A fresh kept conversation each time: no render state to resume, every block a
            // fragment lookup.
            let state = KeptConversation::new(Conversation::from_value(document.clone()).unwrap());
            assert_eq!(kept(&state, adapter, cache).unwrap(), expected);
        }
    }
    let (hits, misses) = whole.stats();
    assert!(
        misses > 4 && hits >= misses,
        "whole: {hits} hits, {misses} misses"
    );
    let (_, tiny_misses) = tiny.stats();
    assert!(tiny.len() <= 4, "{} fragments kept", tiny.len());
    assert!(
        tiny_misses >= 2 * misses - 4,
        "tiny: {tiny_misses} misses, whole {misses}"
    );
}
