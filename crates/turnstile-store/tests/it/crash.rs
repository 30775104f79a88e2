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
                target: 0,
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
            .claim_tool_call(CONVERSATION, "a-call-0", &lease("exec", 10), at(9))
            .await
            .map(drop),
        9 => store
            .submit_tool_result(CONVERSATION, "a-call-0", 1, "success", &content, at(10))
            .await
            .map(drop),
        10 => store
            .claim_tool_call(CONVERSATION, "a-call-1", &lease("exec", 12), at(11))
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
                    target: 0,
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
        // A claim taken before the crash (a 1 ms lease on the store's clock) runs out first.
        wait_until_not_claimed(&**store, CONVERSATION, &call.call_id).await;
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

// ---------------------------------------------------------------------------------------------
// A real crash: a child process runs lifecycles (8 at a time, so group commits are in flight)
// and is killed with SIGKILL at a seeded random moment; the parent reopens the file, recovers
// and checks the invariants. Repeated on the same file.

const CHILD_VAR: &str = "TURNSTILE_CRASH_CHILD_DB";
const CHILD_SENT_VAR: &str = "TURNSTILE_CRASH_CHILD_SENT";
const CHILD_ROUND_VAR: &str = "TURNSTILE_CRASH_CHILD_ROUND";
const CHILD_TEST: &str = "crash::the_killed_child_process_entry_point_does_nothing_unless_spawned";
const KILL_ROUNDS: u64 = 3;
const CHILD_TASKS: u64 = 8;

async fn child_lifecycle(store: &SqliteLedger, tag: &str, sent: &std::sync::Mutex<std::fs::File>) {
    use std::io::Write;
    let conversation_id = format!("k-{tag}");
    let operation_id = format!("kop-{tag}");
    conversation_at_1(store, &conversation_id).await;
    let (manifest, bytes) = manifest(&operation_id, &conversation_id, 1, "m");
    let _ = store.prepare(&manifest, &bytes, at(10)).await.unwrap();
    let expect = BeginExpect {
        revision: Revision(1),
        cancel_generation: 0,
        target: 0,
    };
    let BeginOutcome::Began { generation, .. } = store
        .begin_attempt(&operation_id, expect, &lease("child", 5_000), at(11))
        .await
        .unwrap()
    else {
        panic!("begin refused");
    };
    {
        // The acceptance point passed; record the "send" durably before going on, as one
        // write: `writeln!` on a file writes each formatted piece with its own syscall, and a
        // kill between two of them left a line without its digest (seed 1796538627048102337).
        let mut file = sent.lock().unwrap();
        let line = format!(
            "{operation_id} {} {}\n",
            generation.0, manifest.body.request_digest
        );
        file.write_all(line.as_bytes()).unwrap();
        file.sync_data().unwrap();
    }
    to_streaming(store, &operation_id, generation).await;
    let _ = store
        .commit(
            &operation_id,
            generation,
            Revision(1),
            &assistant_turn(&format!("ka-{tag}"), 2),
            at(13),
        )
        .await
        .unwrap();
    for index in 0..2 {
        let call_id = format!("ka-{tag}-call-{index}");
        if let ClaimOutcome::Claimed { claim } = store
            .claim_tool_call(&conversation_id, &call_id, &lease("exec", 1_000), at(14))
            .await
            .unwrap()
        {
            let content = json!([{"kind": "text", "text": "ok"}]);
            let _ = store
                .submit_tool_result(&conversation_id, &call_id, claim, "success", &content, at(15))
                .await
                .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_killed_child_process_entry_point_does_nothing_unless_spawned() {
    let Ok(path) = std::env::var(CHILD_VAR) else {
        return;
    };
    let sent_path = std::env::var(CHILD_SENT_VAR).unwrap();
    let round = std::env::var(CHILD_ROUND_VAR).unwrap();
    let store = std::sync::Arc::new(SqliteLedger::open(&path, Synchronous::Full).unwrap());
    let sent = std::sync::Arc::new(std::sync::Mutex::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(sent_path)
            .unwrap(),
    ));
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..CHILD_TASKS {
        let (store, sent, round) = (store.clone(), sent.clone(), round.clone());
        tasks.spawn(async move {
            for index in 0.. {
                child_lifecycle(&store, &format!("{round}-{task}-{index}"), &sent).await;
            }
        });
    }
    // Runs until the parent kills this process.
    while let Some(result) = tasks.join_next().await {
        result.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_mid_write_recovers_with_every_invariant_intact() {
    let seed = std::env::var("TURNSTILE_SEED")
        .ok()
        .and_then(|text| text.parse::<u64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(7, |elapsed| elapsed.as_nanos() as u64)
        });
    eprintln!("kill -9 test: seed {seed}; replay the kill points with TURNSTILE_SEED={seed}");
    let place = place(Backend::Sqlite, "kill").await;
    let sent_path = place.dir.path().join("sent.log");
    let mut state = seed | 1;
    for round in 0..KILL_ROUNDS {
        // xorshift: the kill point of this round, 300..1300 ms after start.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let kill_after_ms = 300 + state % 1_000;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", CHILD_TEST, "--nocapture", "--test-threads=1"])
            .env(CHILD_VAR, place.sqlite_path())
            .env(CHILD_SENT_VAR, &sent_path)
            .env(CHILD_ROUND_VAR, round.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(kill_after_ms)).await;
        child.kill().unwrap();
        let _ = child.wait().unwrap();

        let store = open_at(&place, 1).await;
        let report = store.recover_startup("child", at(100)).await.unwrap();
        assert!(
            report
                .unknown
                .iter()
                .all(|attempt| attempt.state == DispatchState::Unknown)
        );
        let sent = std::fs::read_to_string(&sent_path).unwrap_or_default();
        let mut conversations = std::collections::BTreeSet::new();
        // Only whole records: the kill can still cut the last one short (a write to a file can
        // stop at a page boundary once the kill is pending), and a record cut short is a send
        // the child never finished recording.
        let whole = &sent[..sent.rfind('\n').map_or(0, |end| end + 1)];
        for line in whole.lines() {
            let mut fields = line.split(' ');
            let (operation_id, generation, digest) = (
                fields.next().unwrap(),
                fields.next().unwrap(),
                fields.next().unwrap(),
            );
            let attempts = store.attempts(operation_id).await.unwrap();
            let attempt = attempts
                .iter()
                .find(|attempt| attempt.generation.0.to_string() == generation)
                .unwrap_or_else(|| {
                    panic!("seed {seed}: {operation_id}/{generation} sent without its DISPATCHING row")
                });
            assert_eq!(attempt.request_digest, digest);
            assert_ne!(attempt.state, DispatchState::Dispatching, "seed {seed}");
            conversations.insert(
                store
                    .dispatch(operation_id)
                    .await
                    .unwrap()
                    .unwrap()
                    .conversation_id,
            );
        }
        for earlier_round in 0..=round {
            for task in 0..CHILD_TASKS {
                for index in 0..10_000 {
                    let conversation_id = format!("k-{earlier_round}-{task}-{index}");
                    if store.conversation(&conversation_id).await.unwrap().is_none() {
                        break;
                    }
                    conversations.insert(conversation_id);
                }
            }
        }
        let conversations: Vec<String> = conversations.into_iter().collect();
        check_invariants(&*store, &conversations).await;
        eprintln!(
            "kill -9 round {round}: killed after {kill_after_ms} ms, {} sends, {} conversations",
            sent.lines().count(),
            conversations.len()
        );
    }
}
