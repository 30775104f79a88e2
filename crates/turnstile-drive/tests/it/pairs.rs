//! The driver against scripted store answers: recovery budgets come from the store, and the
//! pair assertions across the store boundary fire when the store answers something impossible.

use std::collections::HashSet;
use std::sync::Arc;
use turnstile_adapters::decode::StreamApi;
use turnstile_core::Digest;
use turnstile_core::dispatch::{ProviderRecovery, Timestamp, UnknownAttempt};
use turnstile_core::{Generation, Revision};
use turnstile_drive::*;

const LEASE_MS: u64 = 5_000;

fn spec(recovery: ProviderRecovery, attempts_before: u64) -> DriveSpec {
    let bytes = br#"{"model":"m","messages":[]}"#.to_vec();
    DriveSpec {
        basis: DispatchBasis {
            operation_id: "op-1".into(),
            revision: Revision(3),
            cancel_generation: 0,
            request_digest: Digest::of_bytes(&bytes).as_str().to_owned(),
            request_bytes: Arc::new(bytes),
        },
        api: StreamApi::OpenAiResponses,
        recovery,
        toolset: None,
        call_ids_taken: HashSet::new(),
        lease_ms: LEASE_MS,
        attempts_before,
        timeouts: Timeouts::default(),
    }
}

fn unknown(generation: u64, lease_expires_at: u64) -> UnknownAttempt {
    UnknownAttempt {
        generation: Generation(generation),
        handle: Some("resp_1".into()),
        idempotency_key: "key-1".into(),
        lease_expires_at: Timestamp(lease_expires_at),
        provider_confirmed_ended: false,
    }
}

/// The driver's next store operation, skipping counts and client events.
fn next_store_op(drive: &mut Drive) -> Option<StoreOp> {
    while let Some(action) = drive.poll_action() {
        if let Action::Store(op) = action {
            return Some(op);
        }
    }
    None
}

const BOTH: ProviderRecovery = ProviderRecovery {
    resume_by_handle: true,
    honours_idempotency_key: true,
};

#[test]
fn a_fresh_recovery_budget_resumes_at_once() {
    let mut drive = Drive::recovered(
        spec(BOTH, 1),
        &unknown(1, 60_000),
        RecoverySpent::default(),
        Timestamp(1_000),
    );
    assert!(
        matches!(next_store_op(&mut drive), Some(StoreOp::Resume { .. })),
        "a resumable attempt with nothing spent is resumed"
    );
}

#[test]
fn resumes_spent_by_other_drivers_leave_the_replay_and_then_the_lease() {
    // Another replica already resumed this generation to the cap: replay with the same key.
    let resumes_spent = RecoverySpent {
        resumes: RESUMES_PER_GENERATION_MAX,
        replays: 0,
    };
    let mut drive = Drive::recovered(
        spec(BOTH, 1),
        &unknown(1, 60_000),
        resumes_spent,
        Timestamp(1_000),
    );
    assert!(
        matches!(next_store_op(&mut drive), Some(StoreOp::Replay { .. })),
        "resumes spent elsewhere: the driver replays instead"
    );
    // Both spent: nothing is sent or taken over before the old lease runs out.
    let all_spent = RecoverySpent {
        resumes: RESUMES_PER_GENERATION_MAX,
        replays: REPLAYS_PER_GENERATION_MAX,
    };
    let mut drive = Drive::recovered(spec(BOTH, 1), &unknown(1, 60_000), all_spent, Timestamp(1_000));
    assert_eq!(
        next_store_op(&mut drive),
        None,
        "nothing before the lease runs out"
    );
    assert!(
        drive.poll_timeout().is_some_and(|at| at >= Timestamp(60_000)),
        "it waits for the old lease: {:?}",
        drive.poll_timeout()
    );
    drive.handle_timeout(Timestamp(60_001));
    assert!(
        matches!(
            next_store_op(&mut drive),
            Some(StoreOp::AbandonAndRearm {
                provider_ended: false,
                ..
            })
        ),
        "after the lease: abandon and a new generation"
    );
}

#[test]
#[should_panic(expected = "generations only grow")]
fn a_begin_answered_with_an_old_generation_trips_the_pair_assertion() {
    let none = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: false,
    };
    // Two attempts are already stored for this dispatch.
    let mut drive = Drive::new(spec(none, 2), Timestamp(1_000));
    assert!(matches!(next_store_op(&mut drive), Some(StoreOp::Begin { .. })));
    drive.handle_store(
        Timestamp(1_001),
        StoreResult::Began {
            generation: Generation(2),
            idempotency_key: "key-2".into(),
        },
    );
    while drive.poll_action().is_some() {}
}

#[test]
#[should_panic(expected = "another idempotency key")]
fn an_attempt_read_back_with_another_key_trips_the_pair_assertion() {
    let only_replay = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: true,
    };
    let mut drive = Drive::new(spec(only_replay, 0), Timestamp(1_000));
    assert!(matches!(next_store_op(&mut drive), Some(StoreOp::Begin { .. })));
    drive.handle_store(
        Timestamp(1_001),
        StoreResult::Began {
            generation: Generation(1),
            idempotency_key: "key-1".into(),
        },
    );
    // The connection breaks before a head: the driver reads the attempt back to decide.
    let mut connection = None;
    while let Some(action) = drive.poll_action() {
        match action {
            Action::Open { connection: id, .. } => connection = Some(id),
            Action::Store(_) => drive.handle_store(Timestamp(1_002), StoreResult::Applied),
            _ => {}
        }
    }
    drive.handle_end(Timestamp(1_003), connection.expect("opened"), Ending::Broken);
    let op = next_store_op(&mut drive);
    assert_eq!(op, Some(StoreOp::ReadAttempts));
    drive.handle_store(
        Timestamp(1_004),
        StoreResult::Attempts(vec![AttemptView {
            generation: Generation(1),
            handle: None,
            idempotency_key: "key-other".into(),
            lease_expires_at: Timestamp(6_001),
            spent: RecoverySpent::default(),
        }]),
    );
    while drive.poll_action().is_some() {}
}
