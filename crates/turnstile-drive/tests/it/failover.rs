//! Issue 47: the driver's failover rules on its own, against a scripted store and provider.
//! A refused first request moves the dispatch to the next target; a refused **replay** does
//! not (the generation's first request may still run at the provider, so the seed's rule
//! forbids a new generation until it is confirmed over); a cut stream waits for its lease
//! unless this driver held its only connection.

use std::collections::HashSet;
use std::sync::Arc;
use turnstile_adapters::decode::StreamApi;
use turnstile_core::Digest;
use turnstile_core::dispatch::{ProviderRecovery, Timestamp};
use turnstile_core::{Generation, Revision};
use turnstile_drive::*;

const LEASE_MS: u64 = 5_000;

fn target(body: &str, recovery: ProviderRecovery, label: &str) -> DriveTarget {
    DriveTarget {
        request_digest: Digest::of_bytes(body.as_bytes()).as_str().to_owned(),
        request_bytes: Arc::new(body.as_bytes().to_vec()),
        api: StreamApi::AnthropicMessages,
        recovery,
        label: label.to_owned(),
        decoder: turnstile_adapters::decode::DecoderOptions::VENDOR,
        timeouts: None,
    }
}

/// A dispatch with a failover target; both providers deduplicate by our key (so a cut stream
/// is replayed under the same generation, not resent as a new one).
fn two_targets() -> DriveSpec {
    let dedupe = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: true,
    };
    let primary = target(r#"{"model":"a"}"#, dedupe, "a/m");
    DriveSpec {
        basis: DispatchBasis {
            operation_id: "op-1".into(),
            revision: Revision(3),
            cancel_generation: 0,
            request_digest: primary.request_digest.clone(),
            request_bytes: primary.request_bytes.clone(),
        },
        targets: vec![primary, target(r#"{"model":"b"}"#, dedupe, "b/m")],
        cooling: vec![false, false],
        last_target: None,
        toolset: None,
        call_ids_taken: HashSet::new(),
        lease_ms: LEASE_MS,
        attempts_before: 0,
        timeouts: Timeouts::default(),
    }
}

/// What a provider does with each request, in order.
#[derive(Clone, Copy)]
enum Answer {
    /// A head, then the connection breaks before any event (the request may still run).
    Cut,
    /// A refusal before any event.
    Status(u16),
}

/// Every store operation the driver asks for while the provider answers `answers` in turn;
/// the store applies everything (lease ends read back as `lease_expires_at`).
fn run(answers: &[Answer], lease_expires_at: u64) -> Vec<StoreOp> {
    run_from(
        Drive::new(two_targets(), Timestamp(1_000)),
        0,
        answers,
        lease_expires_at,
    )
}

fn run_from(
    mut drive: Drive,
    mut generation: u64,
    answers: &[Answer],
    lease_expires_at: u64,
) -> Vec<StoreOp> {
    let mut ops = Vec::new();
    let mut answers = answers.iter();
    let mut at = 1_000;
    for _ in 0..10_000 {
        let Some(action) = drive.poll_action() else {
            // Quiet: let time pass to the driver's next timer, if it has one.
            match drive.poll_timeout() {
                Some(due) if !drive.is_finished() && due.0 < 1_000_000 => {
                    at = at.max(due.0);
                    drive.handle_timeout(Timestamp(at));
                    continue;
                }
                _ => return ops,
            }
        };
        at += 1;
        match action {
            Action::Store(op) => {
                let answer = match &op {
                    StoreOp::Begin { .. } => {
                        generation += 1;
                        StoreResult::Began {
                            generation: Generation(generation),
                            idempotency_key: format!("key-{generation}"),
                        }
                    }
                    StoreOp::ReadAttempts => StoreResult::Attempts(vec![AttemptView {
                        generation: Generation(generation),
                        handle: None,
                        idempotency_key: format!("key-{generation}"),
                        lease_expires_at: Timestamp(lease_expires_at),
                        spent: RecoverySpent::default(),
                        target: 0,
                    }]),
                    _ => StoreResult::Applied,
                };
                ops.push(op);
                drive.handle_store(Timestamp(at), answer);
            }
            Action::Open { connection, .. } => match answers.next() {
                Some(Answer::Cut) => {
                    drive.handle_head(Timestamp(at), connection, 200);
                    drive.handle_end(Timestamp(at), connection, Ending::Broken);
                }
                Some(Answer::Status(status)) => {
                    drive.handle_head(Timestamp(at), connection, *status);
                    drive.handle_end(Timestamp(at), connection, Ending::Clean);
                }
                None => return ops,
            },
            _ => {}
        }
    }
    panic!("the driver did not settle: {ops:?}");
}

fn begins(ops: &[StoreOp]) -> Vec<u32> {
    ops.iter()
        .filter_map(|op| match op {
            StoreOp::Begin { target, .. } => Some(*target),
            _ => None,
        })
        .collect()
}

#[test]
fn a_refused_first_request_fails_over_to_the_next_target_at_once() {
    let ops = run(&[Answer::Status(503)], 6_000);
    assert!(
        ops.iter().any(|op| matches!(op, StoreOp::FailOver { .. })),
        "{ops:?}"
    );
    assert_eq!(begins(&ops), vec![0, 1]);
}

#[test]
fn a_refused_replay_does_not_fail_over_while_the_first_request_may_still_run() {
    // Generation 1 on target 0 is UNKNOWN (its driver died mid-stream); its provider
    // deduplicates, so recovery replays it under the same key; the replay is refused with a
    // failover status. The first request may still run at the provider: no FailOver write, and
    // no begin on the next target before generation 1 is abandoned past its lease.
    let lease_end = 60_000;
    let unknown = turnstile_core::dispatch::UnknownAttempt {
        generation: Generation(1),
        handle: None,
        idempotency_key: "key-1".into(),
        lease_expires_at: Timestamp(lease_end),
        provider_confirmed_ended: false,
    };
    let drive = Drive::recovered(
        two_targets(),
        &unknown,
        RecoverySpent::default(),
        0,
        Timestamp(1_000),
    );
    let ops = run_from(drive, 1, &[Answer::Status(503)], lease_end);
    assert!(
        ops.iter().any(|op| matches!(op, StoreOp::Replay { .. })),
        "the UNKNOWN generation is replayed first: {ops:?}"
    );
    assert!(
        !ops.iter().any(|op| matches!(op, StoreOp::FailOver { .. })),
        "a refused replay moved the dispatch to the next target: {ops:?}"
    );
    let rearm = ops
        .iter()
        .position(|op| matches!(op, StoreOp::AbandonAndRearm { .. }));
    if let Some(begin) = ops.iter().position(|op| matches!(op, StoreOp::Begin { .. })) {
        assert!(
            rearm.is_some_and(|rearm| rearm < begin),
            "a second generation began without the first one abandoned: {ops:?}"
        );
    }
}

#[test]
fn a_cut_stream_on_a_provider_without_recovery_waits_for_nothing_only_when_this_driver_held_its_only_connection()
 {
    // Neither target deduplicates nor resumes: a cut of this driver's own first request is
    // confirmed over here (`connection_closed`), and the next generation goes to the next
    // target at once, after an abandon that says so.
    let mut spec = two_targets();
    for target in &mut spec.targets {
        target.recovery.honours_idempotency_key = false;
    }
    let ops = run_from(
        Drive::new(spec, Timestamp(1_000)),
        0,
        &[Answer::Cut, Answer::Status(200)],
        60_000,
    );
    let abandon = ops
        .iter()
        .find(|op| matches!(op, StoreOp::AbandonAndRearm { .. }))
        .expect("the cut generation is abandoned");
    assert!(
        matches!(abandon, StoreOp::AbandonAndRearm { provider_word: Some(word), .. } if word == "connection_closed"),
        "{ops:?}"
    );
    assert_eq!(begins(&ops)[..2], [0, 1], "{ops:?}");
}
