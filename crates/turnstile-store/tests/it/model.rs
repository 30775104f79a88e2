//! Model-based test: random sequences of ledger operations on one conversation and two
//! operation ids, run against the real store and against a small reference model of the
//! transitions; every outcome and the final states must agree.
//!
//! The seed is printed; replay with `TURNSTILE_SEED=<seed>`. Cases: `TURNSTILE_MODEL_CASES`.

use crate::support::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use std::collections::HashMap;
use turnstile_core::dispatch::DispatchState;
use turnstile_core::{Generation, Revision};
use turnstile_store::*;

const OPERATIONS: usize = 2;
const OPS_PER_CASE_MAX: usize = 40;

#[derive(Clone, Debug)]
enum Op {
    AppendUser { stale: bool },
    Prepare { op: usize },
    Begin { op: usize },
    Transition { op: usize, from: u8, to: u8 },
    Commit { op: usize, stale_generation: bool },
    Cancel { op: usize },
    Rearm { op: usize },
}

const STATES: [DispatchState; 8] = DispatchState::ALL;

fn op_strategy() -> impl Strategy<Value = Op> {
    let op = 0..OPERATIONS;
    prop_oneof![
        any::<bool>().prop_map(|stale| Op::AppendUser { stale }),
        op.clone().prop_map(|op| Op::Prepare { op }),
        op.clone().prop_map(|op| Op::Begin { op }),
        (op.clone(), 0u8..8, 0u8..8).prop_map(|(op, from, to)| Op::Transition { op, from, to }),
        (op.clone(), 0u8..8, 0u8..8).prop_map(|(op, from, to)| Op::Transition { op, from, to }),
        (op.clone(), any::<bool>()).prop_map(|(op, stale_generation)| Op::Commit { op, stale_generation }),
        op.clone().prop_map(|op| Op::Cancel { op }),
        op.prop_map(|op| Op::Rearm { op }),
    ]
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct ModelDispatch {
    revision: u64,
    state: DispatchState,
    active: Option<u64>,
    last: u64,
    cancel: u64,
    committed_revision: Option<u64>,
}

#[derive(Debug, Default)]
struct Model {
    revision: u64,
    dispatches: HashMap<usize, ModelDispatch>,
    quarantined: usize,
}

/// Outcomes reduced to what the model predicts.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Seen {
    Appended(u64),
    Conflict,
    Created,
    Existing,
    PrepareConflict,
    Began(u64),
    Refused,
    Applied,
    Committed(u64),
    CommitRefused(CommitRefusal),
    Cancelled(u64),
    Skipped,
}

/// The store's attempt budget (`ops::begin_attempt`).
const ATTEMPTS_PER_DISPATCH_MAX: u64 = 4;

fn operation_id(op: usize) -> String {
    format!("op-{op}")
}

impl Model {
    fn step(&mut self, operation: &Op) -> Seen {
        match *operation {
            Op::AppendUser { stale } => {
                if stale && self.revision > 0 {
                    return Seen::Conflict;
                }
                self.revision += 1;
                Seen::Appended(self.revision)
            }
            Op::Prepare { op } => match self.dispatches.get(&op) {
                Some(dispatch) if dispatch.revision == self.revision => Seen::Existing,
                Some(_) => Seen::PrepareConflict,
                None => {
                    self.dispatches.insert(
                        op,
                        ModelDispatch {
                            revision: self.revision,
                            state: DispatchState::Prepared,
                            active: None,
                            last: 0,
                            cancel: 0,
                            committed_revision: None,
                        },
                    );
                    Seen::Created
                }
            },
            Op::Begin { op } => {
                let revision = self.revision;
                let Some(dispatch) = self.dispatches.get_mut(&op) else {
                    return Seen::Refused;
                };
                if dispatch.state != DispatchState::Prepared {
                    return Seen::Refused;
                }
                if dispatch.revision != revision || dispatch.last >= ATTEMPTS_PER_DISPATCH_MAX {
                    // It can never begin: the refusal ends it.
                    dispatch.state = DispatchState::Abandoned;
                    return Seen::Refused;
                }
                dispatch.last += 1;
                dispatch.active = Some(dispatch.last);
                dispatch.state = DispatchState::Dispatching;
                Seen::Began(dispatch.last)
            }
            Op::Transition { op, from, to } => {
                let (from, to) = (STATES[from as usize], STATES[to as usize]);
                if !ops::is_plain_transition(from, to) {
                    return Seen::Skipped;
                }
                let Some(dispatch) = self.dispatches.get_mut(&op) else {
                    return Seen::Skipped;
                };
                if dispatch.active.is_none() {
                    return Seen::Skipped;
                }
                if dispatch.state != from {
                    return Seen::Refused;
                }
                dispatch.state = to;
                Seen::Applied
            }
            Op::Commit { op, stale_generation } => {
                let revision = self.revision;
                let Some(dispatch) = self.dispatches.get_mut(&op) else {
                    return Seen::Skipped;
                };
                let Some(active) = dispatch.active else {
                    return Seen::Skipped;
                };
                let generation = if stale_generation && active > 1 {
                    active - 1
                } else {
                    active
                };
                if dispatch.state == DispatchState::Committed && generation == active {
                    return Seen::Committed(dispatch.committed_revision.unwrap());
                }
                let refusal = if generation != active {
                    Some(CommitRefusal::ForeignGeneration)
                } else if dispatch.state != DispatchState::Streaming {
                    Some(CommitRefusal::WrongState(dispatch.state))
                } else if revision != dispatch.revision {
                    Some(CommitRefusal::RevisionMoved)
                } else {
                    None
                };
                match refusal {
                    Some(reason) => {
                        self.quarantined += 1;
                        if reason == CommitRefusal::RevisionMoved {
                            // Another turn won: the loser ends in the refusal's transaction.
                            dispatch.state = DispatchState::Abandoned;
                        }
                        Seen::CommitRefused(reason)
                    }
                    None => {
                        self.revision += 1;
                        dispatch.state = DispatchState::Committed;
                        dispatch.committed_revision = Some(self.revision);
                        Seen::Committed(self.revision)
                    }
                }
            }
            Op::Cancel { op } => {
                let Some(dispatch) = self.dispatches.get_mut(&op) else {
                    return Seen::Refused;
                };
                if !dispatch.state.can_transition(DispatchState::Abandoned)
                    || dispatch.state == DispatchState::Failed
                {
                    return Seen::Refused;
                }
                dispatch.cancel += 1;
                dispatch.state = DispatchState::Abandoned;
                Seen::Cancelled(dispatch.cancel)
            }
            Op::Rearm { op } => {
                let Some(dispatch) = self.dispatches.get_mut(&op) else {
                    return Seen::Skipped;
                };
                if dispatch.active.is_none() {
                    return Seen::Skipped;
                }
                if matches!(dispatch.state, DispatchState::Unknown | DispatchState::Failed) {
                    dispatch.state = DispatchState::Prepared;
                    Seen::Applied
                } else {
                    Seen::Refused
                }
            }
        }
    }
}

async fn apply(store: &Store, model: &Model, operation: &Op, index: usize) -> Seen {
    let now = at(1_000 + index as u64);
    match *operation {
        Op::AppendUser { stale } => {
            let expected = if stale && model.revision > 0 {
                model.revision - 1
            } else {
                model.revision
            };
            match store
                .append_turn("c", Revision(expected), &user_turn(&format!("u{index}")), now)
                .await
                .unwrap()
            {
                AppendOutcome::Appended { revision } => Seen::Appended(revision.0),
                AppendOutcome::Conflict { .. } => Seen::Conflict,
                other => panic!("append: {other:?}"),
            }
        }
        Op::Prepare { op } => {
            let (manifest, bytes) = manifest(&operation_id(op), "c", model.revision, "m");
            match store.prepare(&manifest, &bytes, now).await.unwrap() {
                PrepareOutcome::Created(_) => Seen::Created,
                PrepareOutcome::Existing(_) => Seen::Existing,
                PrepareOutcome::Conflict { .. } => Seen::PrepareConflict,
                other => panic!("prepare: {other:?}"),
            }
        }
        Op::Begin { op } => {
            let Some(record) = store.dispatch(&operation_id(op)).await.unwrap() else {
                return Seen::Refused;
            };
            let expect = BeginExpect {
                revision: record.revision,
                cancel_generation: record.cancel_generation,
                target: 0,
            };
            match store
                .begin_attempt(&operation_id(op), expect, &lease("r", 1_000_000), now)
                .await
                .unwrap()
            {
                BeginOutcome::Began { generation, .. } => Seen::Began(generation.0),
                BeginOutcome::Refused { .. } => Seen::Refused,
            }
        }
        Op::Transition { op, from, to } => {
            let (from, to) = (STATES[from as usize], STATES[to as usize]);
            let Some(active) = model.dispatches.get(&op).and_then(|dispatch| dispatch.active) else {
                return Seen::Skipped;
            };
            if !ops::is_plain_transition(from, to) {
                return Seen::Skipped;
            }
            match store
                .transition(&operation_id(op), Generation(active), from, to, now)
                .await
                .unwrap()
            {
                TransitionOutcome::Applied => Seen::Applied,
                TransitionOutcome::Refused { .. } => Seen::Refused,
            }
        }
        Op::Commit { op, stale_generation } => {
            let Some(dispatch) = model.dispatches.get(&op) else {
                return Seen::Skipped;
            };
            let Some(active) = dispatch.active else {
                return Seen::Skipped;
            };
            let generation = if stale_generation && active > 1 {
                active - 1
            } else {
                active
            };
            let turn = assistant_turn(&format!("a{index}"), 0);
            match store
                .commit(
                    &operation_id(op),
                    Generation(generation),
                    Revision(dispatch.revision),
                    &turn,
                    now,
                )
                .await
                .unwrap()
            {
                CommitOutcome::Committed { revision, .. } => Seen::Committed(revision.0),
                CommitOutcome::Refused(reason) => Seen::CommitRefused(reason),
                other => panic!("commit: {other:?}"),
            }
        }
        Op::Cancel { op } => match store.cancel(&operation_id(op), None, now).await.unwrap() {
            CancelOutcome::Cancelled { cancel_generation } => Seen::Cancelled(cancel_generation),
            CancelOutcome::Refused { .. } => Seen::Refused,
        },
        Op::Rearm { op } => {
            let Some(active) = model.dispatches.get(&op).and_then(|dispatch| dispatch.active) else {
                return Seen::Skipped;
            };
            match store
                .abandon_and_rearm(&operation_id(op), Generation(active), true, now)
                .await
                .unwrap()
            {
                TransitionOutcome::Applied => Seen::Applied,
                TransitionOutcome::Refused { .. } => Seen::Refused,
            }
        }
    }
}

async fn run_case(backend: Backend, operations: &[Op]) {
    let (_place, store) = open_fresh(backend, "model").await;
    assert_eq!(
        store.create_conversation("c", &tools(), at(1)).await.unwrap(),
        CreateOutcome::Created
    );
    let mut model = Model::default();
    for (index, operation) in operations.iter().enumerate() {
        let seen = apply(&store, &model, operation, index).await;
        let expected = model.step(operation);
        assert_eq!(seen, expected, "step {index}: {operation:?}");
    }
    let document = store.conversation("c").await.unwrap().unwrap();
    assert_eq!(document["revision"].as_u64().unwrap(), model.revision);
    for op in 0..OPERATIONS {
        let stored = store.dispatch(&operation_id(op)).await.unwrap();
        let modelled = model.dispatches.get(&op);
        assert_eq!(stored.is_some(), modelled.is_some());
        if let (Some(stored), Some(modelled)) = (stored, modelled) {
            assert_eq!(stored.state, modelled.state);
            assert_eq!(
                stored.active_generation.map(|generation| generation.0),
                modelled.active
            );
            assert_eq!(stored.cancel_generation, modelled.cancel);
            // Every attempt but the active one is terminal.
            for attempt in store.attempts(&operation_id(op)).await.unwrap() {
                if Some(attempt.generation.0) != modelled.active {
                    assert!(attempt.state.is_terminal(), "{attempt:?}");
                }
            }
        }
    }
    assert_eq!(store.quarantined(1_000).await.unwrap().len(), model.quarantined);
    check_invariants(&*store, &["c".into()]).await;
}

fn seed() -> u64 {
    std::env::var("TURNSTILE_SEED")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |elapsed| elapsed.as_nanos() as u64)
        })
}

fn run_model(backend: Backend, cases_default: u32) {
    let seed = seed();
    let cases = std::env::var("TURNSTILE_MODEL_CASES")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(cases_default);
    eprintln!("model test ({backend:?}): seed {seed}; replay with TURNSTILE_SEED={seed}");
    let config = Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        max_shrink_iters: 200,
        ..Config::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut runner = TestRunner::new(config);
    let strategy = proptest::collection::vec(op_strategy(), 1..OPS_PER_CASE_MAX);
    let result = runner.run(&strategy, |operations| {
        runtime.block_on(run_case(backend, &operations));
        Ok(())
    });
    if let Err(failure) = result {
        panic!("model test failed (seed {seed}): {failure}");
    }
}

#[test]
fn sqlite_agrees_with_the_reference_model_of_the_transitions() {
    run_model(Backend::Sqlite, 48);
}

#[test]
fn postgres_agrees_with_the_reference_model_of_the_transitions() {
    run_model(Backend::Postgres, 24);
}
