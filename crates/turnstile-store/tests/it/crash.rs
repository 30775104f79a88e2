//! Crash windows on SQLite: run a dispatch lifecycle step by step, stop after every persisted
//! step (and, separately, die inside every step before its COMMIT), reopen the same file, run
//! start-up recovery, and check: no attempt stays DISPATCHING, no request was sent without
//! its DISPATCHING row, at most one canonical turn per revision, and the tool-call ledger is
//! exactly the tool calls of committed turns. Then recovery must be able to finish the
//! dispatch from there with exactly one canonical assistant turn.

use crate::support::*;
use serde_json::json;
use turnstile_core::dispatch::{
    DispatchState, ProviderRecovery, RecoveryDecision, UnknownAttempt, recovery_decision,
};
use turnstile_core::{Generation, Revision};
use turnstile_store::*;

const CONVERSATION: &str = "c";
const OPERATION: &str = "op-1";
const HOLDER: &str = "replica-a";
const STEPS: usize = 12;

/// What the provider received: (operation, generation, bytes). Survives the "crash".
type SentLog = Vec<(String, Generation, Vec<u8>)>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Crash {
    AfterStep,
    InsideStepBeforeCommit,
}

async fn step(store: &Store, index: usize, sent: &mut SentLog) -> Result<(), StoreError> {
    let generation = Generation(1);
    let content = json!([{"kind": "text", "text": "ok"}]);
    match index {
        0 => store
            .create_conversation(CONVERSATION, &tools(), at(1))
            .await
            .map(drop),
        1 => store
            .append_turn(CONVERSATION, Revision(0), &user_turn("u1"), at(2))
            .await
            .map(drop),
        2 => {
            let (manifest, bytes) = manifest(OPERATION, CONVERSATION, 1, "m");
            store.prepare(&manifest, &bytes, at(3)).await.map(drop)
        }
        3 => {
            let expect = BeginExpect {
                revision: Revision(1),
                cancel_generation: 0,
            };
            let outcome = store
                .begin_attempt(OPERATION, expect, &lease(HOLDER, 5_000), at(4))
                .await?;
            if let BeginOutcome::Began { generation, .. } = outcome {
                // The acceptance point passed: only now do bytes go out.
                let record = store.dispatch(OPERATION).await?.unwrap();
                sent.push((OPERATION.into(), generation, record.request_bytes));
            }
            Ok(())
        }
        4 => store
            .transition(
                OPERATION,
                generation,
                DispatchState::Dispatching,
                DispatchState::Sent,
                at(5),
            )
            .await
            .map(drop),
        5 => store
            .bind_handle(OPERATION, generation, "resp_1", at(6))
            .await
            .map(drop),
        6 => store
            .transition(
                OPERATION,
                generation,
                DispatchState::Sent,
                DispatchState::Streaming,
                at(7),
            )
            .await
            .map(drop),
        7 => store
            .commit(OPERATION, generation, Revision(1), &assistant_turn("a", 2), at(8))
            .await
            .map(drop),
        8 => store
            .claim_tool_call(CONVERSATION, "a-call-0", &lease("exec", 1_000), at(9))
            .await
            .map(drop),
        9 => store
            .submit_tool_result(CONVERSATION, "a-call-0", 1, "success", &content, at(10))
            .await
            .map(drop),
        10 => store
            .claim_tool_call(CONVERSATION, "a-call-1", &lease("exec", 1_000), at(11))
            .await
            .map(drop),
        11 => store
            .submit_tool_result(CONVERSATION, "a-call-1", 1, "success", &content, at(12))
            .await
            .map(drop),
        _ => unreachable!("only {STEPS} steps"),
    }
}

async fn check_after_recovery(store: &Store, sent: &SentLog) {
    let report = store.recover_startup(HOLDER, at(100)).await.unwrap();
    for attempt in &report.unknown {
        assert_ne!(attempt.state, DispatchState::Dispatching);
    }
    if let Some(record) = store.dispatch(OPERATION).await.unwrap() {
        assert!(
            !matches!(
                record.state,
                DispatchState::Dispatching | DispatchState::Sent | DispatchState::Streaming
            ),
            "no attempt stays live after this replica's restart: {:?}",
            record.state
        );
    }
    let attempts = store.attempts(OPERATION).await.unwrap();
    for attempt in &attempts {
        assert_ne!(
            attempt.state,
            DispatchState::Dispatching,
            "no attempt stays DISPATCHING"
        );
    }
    for (operation_id, generation, bytes) in sent {
        let attempt = attempts
            .iter()
            .find(|attempt| &attempt.operation_id == operation_id && attempt.generation == *generation)
            .unwrap_or_else(|| {
                panic!("bytes sent for {operation_id}/{generation:?} without a DISPATCHING row")
            });
        assert_eq!(
            attempt.history.first().map(|(state, _)| *state),
            Some(DispatchState::Dispatching)
        );
        assert_eq!(
            turnstile_core::Digest::of_bytes(bytes).as_str(),
            attempt.request_digest
        );
    }
    check_invariants(&**store, &[CONVERSATION.into()]).await;
}

/// Drive whatever state recovery left to a committed dispatch with both results.
async fn finish(store: &Store, sent: &mut SentLog) {
    let _ = store
        .create_conversation(CONVERSATION, &tools(), at(200))
        .await
        .unwrap();
    let _ = store
        .append_turn(CONVERSATION, Revision(0), &user_turn("u1"), at(201))
        .await
        .unwrap();
    let (manifest, bytes) = manifest(OPERATION, CONVERSATION, 1, "m");
    let _ = store.prepare(&manifest, &bytes, at(202)).await.unwrap();
    let mut now = 1_000;
    for _ in 0..4 {
        now += 1_000;
        let record = store.dispatch(OPERATION).await.unwrap().unwrap();
        match record.state {
            DispatchState::Committed => break,
            DispatchState::Prepared => {
                let expect = BeginExpect {
                    revision: record.revision,
                    cancel_generation: record.cancel_generation,
                };
                let BeginOutcome::Began { generation, .. } = store
                    .begin_attempt(OPERATION, expect, &lease(HOLDER, now + 5_000), at(now))
                    .await
                    .unwrap()
                else {
                    panic!("begin refused after recovery");
                };
                // Re-send the stored bytes, never a fresh render.
                sent.push((OPERATION.into(), generation, record.request_bytes.clone()));
                to_streaming(&**store, OPERATION, generation).await;
                let outcome = store
                    .commit(
                        OPERATION,
                        generation,
                        record.revision,
                        &assistant_turn("a", 2),
                        at(now),
                    )
                    .await
                    .unwrap();
                assert!(matches!(outcome, CommitOutcome::Committed { .. }), "{outcome:?}");
            }
            DispatchState::Unknown => {
                let attempts = store.attempts(OPERATION).await.unwrap();
                let attempt = attempts.last().unwrap();
                let unknown = UnknownAttempt {
                    generation: attempt.generation,
                    handle: attempt.handle.clone(),
                    idempotency_key: attempt.idempotency_key.clone(),
                    lease_expires_at: attempt.lease_expires_at,
                    provider_confirmed_ended: false,
                };
                // Not before the lease ran out; then a new generation.
                let early = recovery_decision(&unknown, ProviderRecovery::default(), at(100));
                assert_eq!(early, RecoveryDecision::WaitUntil(attempt.lease_expires_at));
                let RecoveryDecision::AbandonThenNewGeneration { generation } =
                    recovery_decision(&unknown, ProviderRecovery::default(), attempt.lease_expires_at)
                else {
                    panic!("no new generation after the lease");
                };
                assert_eq!(
                    store
                        .abandon_and_rearm(OPERATION, generation, false, attempt.lease_expires_at)
                        .await
                        .unwrap(),
                    TransitionOutcome::Applied
                );
            }
            other => panic!("unexpected state after recovery: {other:?}"),
        }
    }
    for call in store.tool_calls(None).await.unwrap() {
        if call.state == ToolCallState::Done {
            continue;
        }
        now += 1;
        let ClaimOutcome::Claimed { claim } = store
            .claim_tool_call(
                CONVERSATION,
                &call.call_id,
                &lease("exec-2", now + 1_000),
                at(now),
            )
            .await
            .unwrap()
        else {
            panic!("claim after recovery refused");
        };
        let content = json!([{"kind": "text", "text": "ok"}]);
        assert!(matches!(
            store
                .submit_tool_result(CONVERSATION, &call.call_id, claim, "success", &content, at(now))
                .await
                .unwrap(),
            ResultOutcome::Appended { .. }
        ));
    }
}

async fn crash_at(index: usize, crash: Crash) {
    let place = place(Backend::Sqlite, "crash").await;
    let mut sent = SentLog::new();
    {
        let store = open_at(&place, 1).await;
        for earlier in 0..index {
            step(&store, earlier, &mut sent).await.unwrap();
        }
        match crash {
            Crash::AfterStep => step(&store, index, &mut sent).await.unwrap(),
            Crash::InsideStepBeforeCommit => {
                store.faults().arm(Fault::DropBeforeCommit);
                assert!(step(&store, index, &mut sent).await.is_err());
            }
        }
        // The process stops here: the store is gone, only the file remains.
    }
    let store = open_at(&place, 1).await;
    check_after_recovery(&store, &sent).await;
    finish(&store, &mut sent).await;
    check_after_recovery(&store, &sent).await;
    let document = store.conversation(CONVERSATION).await.unwrap().unwrap();
    let assistant_turns = document["turns"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|turn| turn["role"] == "assistant")
        .count();
    assert_eq!(
        assistant_turns, 1,
        "crash {crash:?} at step {index}: one canonical turn"
    );
    assert_eq!(document["revision"], 4);
    assert!(
        sent.len() <= 2,
        "at most the first generation and one retry were sent"
    );
    let ledger = store.tool_calls(None).await.unwrap();
    assert_eq!(ledger.len(), 2);
    assert!(ledger.iter().all(|call| call.state == ToolCallState::Done));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_after_every_persisted_step_recovers_to_exactly_one_canonical_turn() {
    for index in 0..STEPS {
        crash_at(index, Crash::AfterStep).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dying_inside_every_step_before_commit_recovers_to_exactly_one_canonical_turn() {
    for index in 0..STEPS {
        crash_at(index, Crash::InsideStepBeforeCommit).await;
    }
}
