//! Stream faults, each with its expected outcome (proptest; the seed is printed on failure and
//! replays the case): duplicated events, reordered parallel tool blocks, a resumed connection
//! that overlaps what was received, a lost stop event, a late block from an older generation.

use super::support::{
    Ending, GENERATION, Outcome, Rng, assembler, decode_chunks, feed, finish, own_fixtures, toolset,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashSet};
use turnstile_adapters::decode::StreamApi;
use turnstile_core::Generation;
use turnstile_core::assemble::{Disposition, IgnoreReason, Phase, QuarantineReason};
use turnstile_core::stream::{BlockIndex, BlockStart, Sequenced, StreamEvent};

/// Fixtures that commit, with their decoded events.
/// A committing fixture: API, name, bytes, decoded events, expected outcome.
type Committing = (StreamApi, String, Vec<u8>, Vec<Sequenced>, Outcome);

fn committing() -> Vec<Committing> {
    own_fixtures()
        .into_iter()
        .filter(|(_, _, _, expected)| matches!(expected, Outcome::Committed(_)))
        .map(|(api, name, bytes, expected)| {
            let events = decode_chunks(api, [bytes.as_slice()], Ending::Live);
            (api, name, bytes, events, expected)
        })
        .collect()
}

fn assemble(events: impl IntoIterator<Item = Sequenced>) -> Outcome {
    let mut assembler = assembler(Some(toolset()));
    feed(&mut assembler, events);
    finish(&mut assembler)
}

fn tool_blocks(events: &[Sequenced]) -> HashSet<BlockIndex> {
    events
        .iter()
        .filter_map(|event| match &event.event {
            StreamEvent::BlockStart {
                index,
                block: BlockStart::ToolCall { .. },
            } => Some(*index),
            _ => None,
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn duplicated_events_change_nothing(seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        for (_, name, _, events, expected) in committing() {
            let mut noisy = Vec::new();
            for (position, event) in events.iter().enumerate() {
                noisy.push(event.clone());
                // Re-deliver an already delivered event now and then (a buffered event fed
                // twice). Only earlier ones: an event from the future would be a reorder
                // within a block, which must not commit (see the reorder test).
                if rng.below(3) == 0 {
                    noisy.push(events[rng.below(position + 1)].clone());
                }
            }
            prop_assert_eq!(assemble(noisy), expected.clone(), "seed {} fixture {}", seed, name);
        }
    }

    #[test]
    fn a_responses_stream_with_duplicated_sse_events_assembles_once(seed in any::<u64>()) {
        // Responses numbers every event, so even a duplicate on the wire is recognised.
        let mut rng = Rng::new(seed);
        for (api, name, bytes, _, expected) in committing() {
            if api != StreamApi::OpenAiResponses {
                continue;
            }
            let text = String::from_utf8(bytes).unwrap();
            let mut doubled = String::new();
            for event in text.split_inclusive("\n\n") {
                doubled.push_str(event);
                if rng.below(2) == 0 {
                    doubled.push_str(event);
                }
            }
            let events = decode_chunks(api, [doubled.as_bytes()], Ending::Live);
            prop_assert_eq!(assemble(events), expected.clone(), "seed {} fixture {}", seed, name);
        }
    }

    #[test]
    fn reordered_parallel_tool_blocks_give_the_same_turn(seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        for (_, name, _, events, expected) in committing() {
            let tools = tool_blocks(&events);
            if tools.len() < 2 {
                continue;
            }
            // Positions holding tool-block events, and each block's events in order.
            let positions: Vec<usize> = (0..events.len())
                .filter(|&i| events[i].event.block_index().is_some_and(|index| tools.contains(&index)))
                .collect();
            let mut queues: BTreeMap<BlockIndex, Vec<Sequenced>> = BTreeMap::new();
            for &i in &positions {
                queues.entry(events[i].event.block_index().unwrap()).or_default().push(events[i].clone());
            }
            for queue in queues.values_mut() {
                queue.reverse();
            }
            // A random interleaving that keeps each block's own order.
            let mut reordered = events.clone();
            for &position in &positions {
                let live: Vec<BlockIndex> = queues.iter().filter(|(_, q)| !q.is_empty()).map(|(k, _)| *k).collect();
                let pick = live[rng.below(live.len())];
                reordered[position] = queues.get_mut(&pick).unwrap().pop().unwrap();
            }
            prop_assert_eq!(assemble(reordered), expected.clone(), "seed {} fixture {}", seed, name);
        }
    }

    #[test]
    fn a_resumed_stream_that_overlaps_what_was_received_adds_nothing_twice(seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        for (api, name, bytes, _, expected) in committing() {
            let cut = rng.below(bytes.len());
            let mut assembler = assembler(Some(toolset()));
            // The first connection drops at a random byte.
            let first = decode_chunks(api, [&bytes[..cut]], Ending::Live);
            let received = first.len();
            feed(&mut assembler, first);
            let open_after_first = assembler.phase() == Phase::Open;
            assembler.handle_connection_start();
            let resumed: Vec<u8> = if api == StreamApi::OpenAiResponses {
                // `starting_after=N` with N at or before what arrived: replay from an earlier
                // event boundary (the provider's sequence numbers make the overlap visible).
                let text = std::str::from_utf8(&bytes).unwrap();
                let boundaries: Vec<usize> = std::iter::once(0)
                    .chain(text.match_indices("\n\n").map(|(at, _)| at + 2))
                    .filter(|&at| at <= cut)
                    .collect();
                bytes[boundaries[rng.below(boundaries.len())]..].to_vec()
            } else {
                // No provider sequence: the replay starts from the first byte again, and the
                // receive ordinals line up with the first connection's.
                bytes.clone()
            };
            let mut duplicates = 0;
            for event in decode_chunks(api, [resumed.as_slice()], Ending::Live) {
                if assembler.handle_event(GENERATION, event) == Disposition::Ignored(IgnoreReason::Duplicate) {
                    duplicates += 1;
                }
            }
            prop_assert_eq!(finish(&mut assembler), expected.clone(), "seed {} fixture {} cut {}", seed, name, cut);
            if api != StreamApi::OpenAiResponses && open_after_first {
                prop_assert_eq!(duplicates, received, "seed {} fixture {}", seed, name);
            }
        }
    }

    #[test]
    fn a_late_block_from_an_older_generation_is_quarantined_and_never_merged(seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        let fixtures = committing();
        for (_, name, _, events, expected) in &fixtures {
            // The older attempt's events: another fixture's stream, tagged generation 0.
            let (_, _, _, older, _) = &fixtures[rng.below(fixtures.len())];
            let mut assembler = assembler(Some(toolset()));
            let mut injected = 0;
            let mut older = older.iter();
            for event in events {
                if rng.below(2) == 0
                    && let Some(late) = older.next() {
                        injected += 1;
                        match assembler.handle_event(Generation(0), late.clone()) {
                            Disposition::Quarantined(material) => {
                                prop_assert_eq!(material.reason, QuarantineReason::OtherGeneration);
                                prop_assert_eq!(&material.event, late);
                            }
                            other => prop_assert!(false, "seed {} {}: merged: {:?}", seed, name, other),
                        }
                    }
                let _ = assembler.handle_event(GENERATION, event.clone());
            }
            prop_assert_eq!(assembler.stats().quarantined, injected);
            prop_assert_eq!(finish(&mut assembler), expected.clone(), "seed {} fixture {}", seed, name);
        }
    }
}

#[test]
fn a_lost_stop_event_commits_nothing() {
    for (_, name, _, events, _) in committing() {
        let stop_numbers: HashSet<u64> = events
            .iter()
            .filter(|event| matches!(event.event, StreamEvent::Stop { .. }))
            .map(|event| event.seq.number)
            .collect();
        assert_eq!(stop_numbers.len(), 1, "{name}");
        // Lose the whole provider event that carried the stop signal.
        let without: Vec<Sequenced> = events
            .into_iter()
            .filter(|event| !stop_numbers.contains(&event.seq.number))
            .collect();
        match assemble(without) {
            Outcome::Retracted(code) => {
                assert!(code == "missing_stop" || code == "cut_stream", "{name}: {code}")
            }
            Outcome::Committed(turn) => panic!("{name}: committed without a stop signal: {turn}"),
        }
    }
}
