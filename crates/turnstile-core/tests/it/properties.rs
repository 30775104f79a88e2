//! Property tests over generated conversations: legal ones are ready or waiting (with exactly
//! the calls left unanswered), and each one-rule mutation is rejected with its code. proptest
//! prints the failing seed; `PROPTEST_CASES` scales the run.

use crate::generate::{Expect, Mutation, Rng, legal, mutate};
use proptest::prelude::*;
use std::collections::BTreeSet;
use turnstile_core::{Conversation, MessageSequence, Validated, Verdict, validate};

fn verdict_of(value: &serde_json::Value) -> Verdict {
    validate(&Conversation::from_value(value.clone()).expect("generated conversations are readable"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn legal_conversations_are_ready_or_waiting_for_exactly_the_unanswered_calls(seed in any::<u64>(), rounds in 1usize..6) {
        let (conversation, expect) = legal(seed, rounds);
        let verdict = verdict_of(&conversation);
        match expect {
            Expect::Ready => prop_assert_eq!(verdict, Verdict::Ready, "seed {}", seed),
            Expect::Waiting(pending) => {
                let Verdict::Waiting { pending: actual } = verdict else {
                    return Err(TestCaseError::fail(format!("seed {seed}: expected waiting, got {verdict:?}")));
                };
                let actual: Vec<String> = actual.into_iter().map(|id| id.0).collect();
                prop_assert_eq!(actual, pending, "seed {}", seed);
            }
        }
        // A legal conversation always builds a graph with one edge per call.
        let decoded = Conversation::from_value(conversation.clone()).unwrap();
        let sequence = MessageSequence::build(Validated::new(&decoded).unwrap());
        let calls = conversation.to_string().matches("\"tool_call\"").count();
        prop_assert_eq!(sequence.edges.len(), calls);
    }

    #[test]
    fn each_one_rule_mutation_is_rejected_with_its_code(seed in any::<u64>(), rounds in 2usize..6, which in 0usize..11) {
        let (mut conversation, _) = legal(seed, rounds);
        let mut rng = Rng::new(seed ^ 0xA5A5);
        // Try the chosen mutation first, then the others, so every seed tests something.
        let order = (0..Mutation::ALL.len()).map(|i| Mutation::ALL[(which + i) % Mutation::ALL.len()]);
        let mut applied = None;
        for mutation in order {
            if mutate(&mut conversation, mutation, &mut rng) {
                applied = Some(mutation);
                break;
            }
        }
        let mutation = applied.expect("insert-unknown-kind always applies");
        let Verdict::Rejected(violations) = verdict_of(&conversation) else {
            return Err(TestCaseError::fail(format!("seed {seed}: {mutation:?} was not rejected")));
        };
        let codes: BTreeSet<&str> = violations.iter().map(|v| v.code.as_str()).collect();
        prop_assert!(codes.contains(mutation.code()), "seed {} {:?}: codes {:?}", seed, mutation, codes);
        if mutation.exact() {
            prop_assert_eq!(codes.len(), 1, "seed {} {:?}: codes {:?}", seed, mutation, codes);
        }
    }
}

#[test]
fn every_mutation_applies_to_some_generated_conversation() {
    for mutation in Mutation::ALL {
        let applied = (0..200u64).any(|seed| {
            let (mut conversation, _) = legal(seed, 4);
            mutate(&mut conversation, mutation, &mut Rng::new(seed))
        });
        assert!(applied, "{mutation:?} never applied in 200 seeds");
    }
}
