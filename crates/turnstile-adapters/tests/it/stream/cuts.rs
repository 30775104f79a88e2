//! The exhaustive cut test: every stream cut at every byte offset commits nothing, or (only when
//! the cut is after the stop signal) exactly the full turn. Run for both endings: a live
//! connection (WHATWG discard of an unterminated event) and a stored file (`turnstile
//! assemble`). The decoder and the assembler are snapshots (`fork`, `Clone`), so each cut costs
//! only its own tail.

use super::captures::{capture_bytes, cases};
use super::support::{
    Ending, Outcome, assembler, captures_dir, end, feed, outcome_of, own_fixtures, toolset,
};
use std::sync::Arc;
use turnstile_adapters::decode::StreamApi;
use turnstile_core::assemble::Toolset;
use turnstile_core::stream::StreamEvent;

/// Check every cut of one stream; returns the number of cut points checked.
fn check_every_cut(
    api: StreamApi,
    name: &str,
    bytes: &[u8],
    ending: Ending,
    toolset: Option<Arc<Toolset>>,
) -> usize {
    let mut decoder = api.decoder();
    let mut live = assembler(toolset);
    let mut outcomes: Vec<Outcome> = Vec::with_capacity(bytes.len() + 1);
    // Byte count at which the decoder first emitted the stop signal.
    let mut stop_seen_at: Option<usize> = None;
    let mut live_outcome: Option<Outcome> = None;
    for cut in 0..=bytes.len() {
        if cut > 0 {
            decoder.handle_bytes(&bytes[cut - 1..cut]);
            let events: Vec<_> = std::iter::from_fn(|| decoder.poll_event()).collect();
            if !events.is_empty() {
                live_outcome = None;
                if stop_seen_at.is_none()
                    && events
                        .iter()
                        .any(|event| matches!(event.event, StreamEvent::Stop { .. }))
                {
                    stop_seen_at = Some(cut);
                }
                feed(&mut live, events);
            }
        }
        // The outcome if the input ended here.
        let mut tail_decoder = decoder.fork();
        end(&mut *tail_decoder, ending);
        let tail: Vec<_> = std::iter::from_fn(|| tail_decoder.poll_event()).collect();
        let outcome = if tail.is_empty() {
            live_outcome
                .get_or_insert_with(|| {
                    let mut snapshot = live.clone();
                    snapshot.handle_end_of_input();
                    outcome_of(&mut snapshot)
                })
                .clone()
        } else {
            let mut snapshot = live.clone();
            feed(&mut snapshot, tail);
            snapshot.handle_end_of_input();
            outcome_of(&mut snapshot)
        };
        outcomes.push(outcome);
    }
    let full = outcomes.last().unwrap().clone();
    let first_commit = outcomes
        .iter()
        .position(|outcome| matches!(outcome, Outcome::Committed(_)));
    match (&full, first_commit) {
        (Outcome::Committed(_), Some(first)) => {
            for (cut, outcome) in outcomes.iter().enumerate().skip(first) {
                assert_eq!(
                    outcome, &full,
                    "{name} ({ending:?}): cut {cut} committed something else"
                );
            }
            for (cut, outcome) in outcomes.iter().enumerate().take(first) {
                assert!(
                    matches!(outcome, Outcome::Retracted(_)),
                    "{name} ({ending:?}): cut {cut}: {outcome:?}"
                );
            }
            // The stop signal's event must be inside the prefix: at most its blank line (up to
            // CRLF CRLF) may be missing, and only under the file rule.
            let stop_at = stop_seen_at.expect("a committed stream has a stop signal");
            let slack = if ending == Ending::File { 4 } else { 0 };
            assert!(
                first + slack >= stop_at,
                "{name} ({ending:?}): committed at cut {first}, before the stop signal (complete at {stop_at})"
            );
        }
        (Outcome::Retracted(_), None) => {}
        _ => panic!("{name} ({ending:?}): full outcome {full:?} with first commit at {first_commit:?}"),
    }
    outcomes.len()
}

#[test]
fn every_stream_cut_at_every_byte_commits_nothing_or_exactly_the_full_turn() {
    let mut cut_points = 0;
    let mut streams = 0;
    for (api, name, bytes, _) in own_fixtures() {
        for ending in [Ending::Live, Ending::File] {
            cut_points += check_every_cut(api, &name, &bytes, ending, Some(toolset()));
            streams += 1;
        }
    }
    if let Some(dir) = captures_dir() {
        for (relative, api, _) in cases() {
            let bytes = capture_bytes(&dir, relative);
            for ending in [Ending::Live, Ending::File] {
                cut_points += check_every_cut(api, relative, &bytes, ending, None);
                streams += 1;
            }
        }
    }
    println!("exhaustive cut test: {cut_points} cut points over {streams} stream/ending pairs");
    assert!(
        cut_points > 20_000,
        "only {cut_points} cut points: fixtures went missing"
    );
}
