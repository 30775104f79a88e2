//! `Conversation::push_turn` against decoding the whole file: a conversation built turn by
//! turn in memory decodes and validates exactly as the file holding all of its turns, and
//! `pop_turn` gives back the conversation as it was.

use crate::generate::{Mutation, legal_or_mutated};
use proptest::prelude::*;
use serde_json::Value;
use turnstile_core::{Conversation, Revision, validate};

/// Decode `document` whole, and again from its first turn with every later turn pushed; the
/// revision pushed is the turn's own when it has one, else the count of turns so far.
fn check(document: &Value) {
    let Ok(whole) = Conversation::from_value(document.clone()) else {
        return;
    };
    let turns = document["turns"].as_array().cloned().unwrap_or_default();
    let Some((first, rest)) = turns.split_first() else {
        return;
    };
    let mut prefix = document.clone();
    prefix["turns"] = Value::Array(vec![first.clone()]);
    prefix["revision"] = first.get("revision").cloned().unwrap_or(Value::from(1));
    let Ok(mut built) = Conversation::from_value(prefix) else {
        return;
    };
    for (index, turn) in rest.iter().enumerate() {
        let last = index + 1 == rest.len();
        let revision = if last {
            whole.revision
        } else {
            turn.get("revision")
                .and_then(Value::as_u64)
                .map_or(Revision(index as u64 + 2), Revision)
        };
        let before = built.clone();
        let pushed = built.push_turn(turn.clone(), revision).expect("within limits");
        let mut undone = built.clone();
        assert!(undone.pop_turn(pushed).is_some());
        assert_eq!(undone, before, "pop_turn restores the conversation");
    }
    assert_eq!(validate(&built), validate(&whole));
    assert_eq!(built.turns, whole.turns);
    assert_eq!(built.revision, whole.revision);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn a_conversation_pushed_turn_by_turn_is_the_file_decoded_whole(seed in any::<u64>(), mutation in 0..=Mutation::ALL.len()) {
        check(&legal_or_mutated(seed, mutation));
    }
}
