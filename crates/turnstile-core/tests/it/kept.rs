//! `KeptConversation` against a whole walk: a conversation kept in memory and given one more
//! turn at a time has the verdict, the validation proof and the message sequence (digest
//! included) that decoding, validating and building the grown file whole gives, at every split
//! of every generated history (legal and mutated) and of every file in `tests/data`; popping
//! the turns back gives the kept state of each shorter history again.

use crate::generate::{Mutation, legal_or_mutated};
use crate::validator_data::{data_documents, splits};
use proptest::prelude::*;
use serde_json::Value;
use turnstile_core::validate::Validated;
use turnstile_core::{Conversation, KeptConversation, MessageSequence, Revision, Verdict, validate};

/// The verdict with violations in a fixed order (see `history.rs`: after a history with
/// findings, later decode findings come after earlier walk findings).
fn sorted(verdict: Verdict) -> Verdict {
    match verdict {
        Verdict::Rejected(mut violations) => {
            violations.sort_by_key(|violation| format!("{violation:?}"));
            Verdict::Rejected(violations)
        }
        other => other,
    }
}

/// What a whole walk of `conversation` gives: the verdict, whether it is waiting (for a legal
/// one) and the sequence.
fn whole(conversation: &Conversation) -> (Verdict, Option<(bool, MessageSequence)>) {
    let verdict = validate(conversation);
    let graph = Validated::new(conversation)
        .ok()
        .map(|validated| (validated.is_waiting(), MessageSequence::build(validated)));
    (verdict, graph)
}

fn kept_state(kept: &KeptConversation) -> (Verdict, Option<(bool, MessageSequence)>) {
    let graph = kept
        .graph_parts()
        .map(|(validated, sequence)| (validated.is_waiting(), sequence.clone()));
    assert_eq!(
        kept.validated().is_some(),
        kept.sequence().is_some(),
        "a kept conversation has a sequence exactly when it is legal"
    );
    (kept.verdict(), graph)
}

fn assert_same(kept: &KeptConversation, what: &str) {
    let (verdict, graph) = kept_state(kept);
    let (expected_verdict, expected_graph) = whole(kept.conversation());
    assert_eq!(sorted(verdict), sorted(expected_verdict), "{what}: verdict");
    assert_eq!(graph, expected_graph, "{what}: validation proof and sequence");
}

/// For every split of `document`'s turns: keep the prefix, push the rest one turn at a time
/// (comparing with a whole walk after each), then pop them back (comparing again). Returns how
/// many pushes were compared.
fn check(document: &Value) -> usize {
    let mut compared = 0;
    for (split, prefix, rest, revision) in splits(document) {
        let mut kept = KeptConversation::new(prefix);
        assert_same(&kept, &format!("kept at {split}"));
        let mut pushes = Vec::new();
        for (index, turn) in rest.into_iter().enumerate() {
            let Ok(pushed) = kept.push_turn(turn, Revision(revision)) else {
                break;
            };
            pushes.push(pushed);
            assert_same(&kept, &format!("split {split}, pushed {}", index + 1));
            compared += 1;
        }
        while let Some(pushed) = pushes.pop() {
            assert!(kept.pop_turn(pushed).is_some(), "a pushed turn pops");
            assert_same(
                &kept,
                &format!("split {split}, popped back to {}", split + pushes.len()),
            );
        }
    }
    compared
}

#[test]
fn every_data_file_kept_turn_by_turn_is_the_file_walked_whole() {
    let compared: usize = data_documents().iter().map(check).sum();
    assert!(compared >= 24, "only {compared} pushes compared");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn a_conversation_kept_turn_by_turn_is_the_file_walked_whole(seed in any::<u64>(), mutation in 0..=Mutation::ALL.len()) {
        check(&legal_or_mutated(seed, mutation));
    }
}

/// Turn stamps (what a kept render state is checked against): one per turn, unique, kept by the
/// turns that stay, never given again. A pop and a push of the same turn gives it a new stamp;
/// a clone has the same stamps, and what each adds after gets its own; a conversation kept
/// anew from the same file gets new ones.
#[test]
fn turn_stamps_name_the_turns_they_were_given_to() {
    let document = serde_json::json!({
        "format": "turnstile.conversation.v1", "conversation_id": "c-stamps", "revision": 1, "tools": [],
        "turns": [{"id": "t-1", "revision": 1, "role": "user", "blocks": [{"id": "b-1", "kind": "text", "text": "hi"}]}]});
    let turn = |index: u64| {
        serde_json::json!({"id": format!("t-{index}"), "revision": index, "role": if index % 2 == 0 { "assistant" } else { "user" },
                           "generation": index, "blocks": [{"id": format!("b-{index}"), "kind": "text", "text": "more"}]})
    };
    let mut kept = KeptConversation::new(Conversation::from_value(document.clone()).unwrap());
    assert_eq!(kept.turn_stamps().len(), 1);
    let first = kept.turn_stamps().to_vec();
    let pushed = kept.push_turn(turn(2), Revision(2)).unwrap();
    assert_eq!(kept.turn_stamps().len(), 2);
    assert_eq!(
        kept.turn_stamps()[..1],
        first[..],
        "a push keeps the stamps before it"
    );
    let second = kept.turn_stamps()[1];
    assert_ne!(second, first[0]);
    kept.pop_turn(pushed).unwrap();
    assert_eq!(kept.turn_stamps(), &first[..], "a pop takes its stamp back");
    let _ = kept.push_turn(turn(2), Revision(2)).unwrap();
    let again = kept.turn_stamps()[1];
    assert_ne!(
        again, second,
        "the same turn pushed again is not the turn that was popped"
    );
    let mut clone = kept.clone();
    assert_eq!(
        clone.turn_stamps(),
        kept.turn_stamps(),
        "a clone has the same turns"
    );
    let _ = clone.push_turn(turn(3), Revision(3)).unwrap();
    let _ = kept.push_turn(turn(3), Revision(3)).unwrap();
    assert_ne!(
        clone.turn_stamps()[2],
        kept.turn_stamps()[2],
        "what each adds after is its own"
    );
    let anew = KeptConversation::new(Conversation::from_value(document).unwrap());
    assert_ne!(
        anew.turn_stamps()[0],
        first[0],
        "a conversation kept anew has new stamps"
    );
    let mut all: Vec<u64> = [kept.turn_stamps(), clone.turn_stamps(), anew.turn_stamps()].concat();
    all.sort_unstable();
    all.dedup();
    assert_eq!(
        all.len(),
        3 + 1 + 1,
        "stamps are shared only by the turns a clone shares"
    );
}
