//! The core's sans-IO `DispatchMachine` driven against a real store: every effect performed in
//! order, every store answer fed back. Proves the contract between the two crates: `Send`
//! only ever follows a durable DISPATCHING row (checked through a second, independent store on
//! the same database), two replicas' machines for one operation send once, and recovery
//! re-sends the stored bytes under a new generation only after the old lease.

use crate::support::*;
use std::collections::VecDeque;
use turnstile_core::dispatch::*;
use turnstile_core::{Generation, Revision};
use turnstile_store::*;

macro_rules! both {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            use crate::support::Backend;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(Backend::Sqlite, stringify!($case)).await
                }
            )*
        }
        mod postgres {
            use crate::support::Backend;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(Backend::Postgres, stringify!($case)).await
                }
            )*
        }
    };
}

both!(
    a_machine_driven_against_the_store_sends_only_after_a_durable_dispatching_row,
    two_replicas_machines_for_one_operation_send_exactly_once,
    a_recovered_machine_waits_for_the_lease_then_resends_the_stored_bytes,
);

/// What happened while driving one machine.
#[derive(Default)]
struct Run {
    sends: Vec<(Generation, String)>,
    events: Vec<ClientEvent>,
    committed: Option<Revision>,
}

/// Perform every queued effect against `store`, feeding answers back; provider inputs for the
/// attempt are scripted and delivered right after its `Send`. `witness` is an independent
/// store on the same database that must already see the DISPATCHING row when `Send` comes.
#[allow(clippy::too_many_arguments)] // A test driver: every input spelled out at the call.
async fn drive(
    machine: &mut DispatchMachine,
    store: &Store,
    witness: &Store,
    operation_id: &str,
    holder: &str,
    mut script: VecDeque<ProviderInput>,
    run: &mut Run,
    now: Timestamp,
) {
    while let Some(effect) = machine.poll_effect() {
        match effect {
            Effect::Persist(Write::Begin {
                expected_revision,
                expected_cancel_generation,
                lease_expires_at,
            }) => {
                let expect = BeginExpect {
                    revision: expected_revision,
                    cancel_generation: expected_cancel_generation,
                    target: 0,
                };
                let lease = Lease {
                    holder: holder.into(),
                    expires_at: lease_expires_at,
                };
                let answer = match store
                    .begin_attempt(operation_id, expect, &lease, now)
                    .await
                    .unwrap()
                {
                    BeginOutcome::Began {
                        generation,
                        idempotency_key,
                    } => StoreAnswer::Began {
                        generation,
                        idempotency_key,
                    },
                    BeginOutcome::Refused { .. } => StoreAnswer::BeginRefused,
                };
                let _ = machine.handle_store(now, answer);
            }
            Effect::Persist(Write::Transition { generation, from, to }) => {
                if let TransitionOutcome::Refused { .. } = store
                    .transition(operation_id, generation, from, to, now)
                    .await
                    .unwrap()
                {
                    let _ = machine.handle_store(now, StoreAnswer::TransitionRefused);
                }
            }
            Effect::Persist(Write::AbandonAndRearm { generation }) => {
                let answer = match store
                    .abandon_and_rearm(operation_id, generation, false, now)
                    .await
                    .unwrap()
                {
                    TransitionOutcome::Applied => StoreAnswer::Rearmed,
                    TransitionOutcome::Refused { .. } => StoreAnswer::TransitionRefused,
                };
                let _ = machine.handle_store(now, answer);
            }
            Effect::Persist(Write::Commit {
                generation,
                expected_revision,
                turn,
            }) => {
                let answer = match store
                    .commit(operation_id, generation, expected_revision, &turn, now)
                    .await
                    .unwrap()
                {
                    CommitOutcome::Committed { revision, .. } => StoreAnswer::Committed { revision },
                    _ => StoreAnswer::CommitRefused,
                };
                let _ = machine.handle_store(now, answer);
            }
            Effect::Persist(other) => panic!("not scripted here: {other:?}"),
            Effect::Send {
                generation,
                idempotency_key,
                request_digest,
            } => {
                // The acceptance point: an independent connection already sees the row.
                let attempts = witness.attempts(operation_id).await.unwrap();
                let attempt = attempts
                    .iter()
                    .find(|attempt| attempt.generation == generation)
                    .expect("Send before its DISPATCHING row was durable");
                assert_eq!(attempt.state, DispatchState::Dispatching);
                assert_eq!(attempt.idempotency_key, idempotency_key);
                let record = witness.dispatch(operation_id).await.unwrap().unwrap();
                assert_eq!(
                    record.request_digest, request_digest,
                    "the stored bytes are what is sent"
                );
                run.sends.push((generation, request_digest));
                while let Some(input) = script.pop_front() {
                    let _ = machine.handle_provider(now, generation, input);
                }
            }
            Effect::BindHandle { generation, handle } => {
                let _ = store
                    .bind_handle(operation_id, generation, &handle, now)
                    .await
                    .unwrap();
            }
            Effect::Emit(event) => {
                if let ClientEvent::Committed { revision } = event {
                    run.committed = Some(revision);
                }
                run.events.push(event);
            }
            Effect::ExposeToolCalls { revision } => {
                let calls = store.tool_calls(Some(ToolCallState::Ready)).await.unwrap();
                assert!(calls.iter().any(|call| call.revision == revision));
            }
            Effect::Quarantine { .. } | Effect::Resume { .. } => {}
        }
    }
}

fn happy_script(tag: &str) -> VecDeque<ProviderInput> {
    VecDeque::from([
        ProviderInput::Accepted,
        ProviderInput::Handle(format!("resp-{tag}")),
        ProviderInput::FirstEvent,
        ProviderInput::Completed {
            turn: assistant_turn(tag, 2),
        },
    ])
}

async fn prepared(store: &Store, operation_id: &str, conversation_id: &str) -> Prepared {
    conversation_at_1(&**store, conversation_id).await;
    let (manifest, bytes) = manifest(operation_id, conversation_id, 1, "m");
    let (PrepareOutcome::Created(record) | PrepareOutcome::Existing(record)) =
        store.prepare(&manifest, &bytes, at(10)).await.unwrap()
    else {
        panic!("prepare failed");
    };
    Prepared {
        revision: record.revision,
        cancel_generation: record.cancel_generation,
        request_digest: record.request_digest,
    }
}

pub async fn a_machine_driven_against_the_store_sends_only_after_a_durable_dispatching_row(
    backend: Backend,
    name: &str,
) {
    let place = place(backend, name).await;
    let (store, witness) = (open_at(&place, 4).await, open_at(&place, 2).await);
    let prepared = prepared(&store, "op-1", "c").await;
    let mut machine = DispatchMachine::new(prepared, LEASE_MS_DEFAULT);
    let mut run = Run::default();
    let _ = machine.start(at(100));
    drive(
        &mut machine,
        &store,
        &witness,
        "op-1",
        "replica-a",
        happy_script("a"),
        &mut run,
        at(100),
    )
    .await;
    assert_eq!(run.sends.len(), 1);
    assert_eq!(run.committed, Some(Revision(2)));
    assert_eq!(machine.state(), DispatchState::Committed);
    let attempts = witness.attempts("op-1").await.unwrap();
    let states: Vec<_> = attempts[0].history.iter().map(|(state, _)| *state).collect();
    assert_eq!(
        states,
        vec![
            DispatchState::Dispatching,
            DispatchState::Sent,
            DispatchState::Streaming,
            DispatchState::Committed
        ]
    );
    assert_eq!(attempts[0].handle.as_deref(), Some("resp-a"));
    check_invariants(&*witness, &["c".into()]).await;
}

pub async fn two_replicas_machines_for_one_operation_send_exactly_once(backend: Backend, name: &str) {
    let place = place(backend, name).await;
    let (a, b) = (open_at(&place, 4).await, open_at(&place, 4).await);
    let prepared_a = prepared(&a, "op-1", "c").await;
    let prepared_b = {
        let record = b.dispatch("op-1").await.unwrap().unwrap();
        Prepared {
            revision: record.revision,
            cancel_generation: record.cancel_generation,
            request_digest: record.request_digest,
        }
    };
    let mut first = DispatchMachine::new(prepared_a, LEASE_MS_DEFAULT);
    let mut second = DispatchMachine::new(prepared_b, LEASE_MS_DEFAULT);
    let (mut run_a, mut run_b) = (Run::default(), Run::default());
    let _ = first.start(at(100));
    let _ = second.start(at(100));
    tokio::join!(
        drive(
            &mut first,
            &a,
            &b,
            "op-1",
            "replica-a",
            happy_script("a"),
            &mut run_a,
            at(100)
        ),
        drive(
            &mut second,
            &b,
            &a,
            "op-1",
            "replica-b",
            happy_script("b"),
            &mut run_b,
            at(100)
        ),
    );
    assert_eq!(run_a.sends.len() + run_b.sends.len(), 1, "exactly one send");
    let loser = if run_a.sends.is_empty() { &run_a } else { &run_b };
    assert!(loser.events.contains(&ClientEvent::Error {
        code: "begin_refused"
    }));
    assert_eq!(a.attempts("op-1").await.unwrap().len(), 1);
    check_invariants(&*a, &["c".into()]).await;
}

pub async fn a_recovered_machine_waits_for_the_lease_then_resends_the_stored_bytes(
    backend: Backend,
    name: &str,
) {
    let place = place(backend, name).await;
    let (store, witness) = (open_at(&place, 4).await, open_at(&place, 2).await);
    let prepared_first = prepared(&store, "op-1", "c").await;
    // A first machine begins and its process dies right after the send.
    let mut machine = DispatchMachine::new(prepared_first.clone(), LEASE_MS_DEFAULT);
    let mut run = Run::default();
    let _ = machine.start(at(100));
    drive(
        &mut machine,
        &store,
        &witness,
        "op-1",
        "replica-a",
        VecDeque::new(),
        &mut run,
        at(100),
    )
    .await;
    assert_eq!(run.sends.len(), 1);
    drop(machine);

    let report = store.recover_startup("replica-a", at(200)).await.unwrap();
    let attempt = &report.unknown[0];
    let unknown = UnknownAttempt {
        generation: attempt.generation,
        handle: attempt.handle.clone(),
        idempotency_key: attempt.idempotency_key.clone(),
        lease_expires_at: attempt.lease_expires_at,
        provider_confirmed_ended: false,
    };
    let mut machine = DispatchMachine::recover(
        at(200),
        prepared_first,
        LEASE_MS_DEFAULT,
        &unknown,
        ProviderRecovery::default(),
    );
    drive(
        &mut machine,
        &store,
        &witness,
        "op-1",
        "replica-a",
        happy_script("r"),
        &mut run,
        at(200),
    )
    .await;
    assert_eq!(run.sends.len(), 1, "nothing re-sent while the old lease runs");
    let wake = machine.poll_timeout().unwrap();
    assert_eq!(wake, attempt.lease_expires_at);
    let _ = machine.handle_timeout(wake);
    drive(
        &mut machine,
        &store,
        &witness,
        "op-1",
        "replica-a",
        happy_script("r"),
        &mut run,
        wake,
    )
    .await;
    assert_eq!(run.sends.len(), 2);
    assert_eq!(run.sends[1].0, Generation(2));
    assert_eq!(
        run.sends[1].1, run.sends[0].1,
        "the same stored bytes, not a fresh render"
    );
    assert_eq!(run.committed, Some(Revision(2)));
    check_invariants(&*witness, &["c".into()]).await;
}
