//! `validate::History` against `validate`: the validator's state after a history, given one
//! more decoded turn at a time, finds exactly what validating the whole file finds (the same
//! violations in the same order, the same pending calls), at every split point of every
//! generated history (legal and mutated) and of every file in `tests/data`.

use crate::generate::{Mutation, legal_or_mutated};
use crate::validator_data::{data_documents, splits};
use proptest::prelude::*;
use serde_json::Value;
use turnstile_core::validate::History;
use turnstile_core::{Conversation, Verdict, validate};

/// A verdict with its violations in a fixed order (a walk that starts from a history with
/// findings reports the later turns' decode findings after the earlier turns' walk findings).
fn sorted(verdict: Verdict) -> Verdict {
    match verdict {
        Verdict::Rejected(mut violations) => {
            violations.sort_by_key(|violation| format!("{violation:?}"));
            Verdict::Rejected(violations)
        }
        other => other,
    }
}

/// For every split of `document`'s turns: the prefix walked whole, the rest pushed one turn
/// at a time, against `validate` of the whole: exactly, in order, for one turn after a legal
/// prefix (as the store uses it); as a multiset otherwise (the whole file reports every turn's
/// decode findings before the walk's). Returns how many splits were compared.
fn check(document: &Value) -> usize {
    let Ok(whole) = Conversation::from_value(document.clone()) else {
        return 0;
    };
    let expected = validate(&whole);
    assert_eq!(History::of(&whole).verdict(), expected, "History::of is validate");
    let total = document["turns"].as_array().map_or(0, Vec::len);
    let mut compared = 0;
    for (split, prefix, rest, _) in splits(document) {
        let mut history = History::of(&prefix);
        let legal_prefix = history.is_legal();
        for turn in rest {
            let (turn, findings) = Conversation::decode_turn(turn).expect("within limits");
            history.push(&turn, findings);
        }
        compared += 1;
        if legal_prefix && split + 1 == total {
            // As the store uses it: one turn after a legal history.
            assert_eq!(history.verdict(), expected, "split at {split} of {total}");
        } else {
            assert_eq!(
                sorted(history.verdict()),
                sorted(expected.clone()),
                "split at {split} of {total}"
            );
        }
    }
    compared
}

#[test]
fn every_data_file_gives_the_same_verdict_turn_by_turn() {
    let compared: usize = data_documents().iter().map(check).sum();
    assert!(compared >= 24, "only {compared} splits compared");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_history_walked_turn_by_turn_is_the_file_validated_whole(seed in any::<u64>(), mutation in 0..=Mutation::ALL.len()) {
        check(&legal_or_mutated(seed, mutation));
    }
}
