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
