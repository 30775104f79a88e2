//! Races between two "replicas" (two independent stores with their own connections on one
//! database): many tasks racing the same operation id, two operations on the same revision,
//! two generations' canonical commits against a cancel. Exactly one winner every round.
//!
//! Rounds: `TURNSTILE_RACE_ROUNDS` (default 1000 per race on SQLite, 400 on PostgreSQL, whose
//! fsync-on round trips cost more on this 2-core machine), `RACE_ROUNDS_IN_FLIGHT` at a time
//! so the databases' commit grouping keeps the suite quick with durability on.

use crate::support::*;
use std::sync::Arc;
use tokio::task::JoinSet;
use turnstile_core::dispatch::DispatchState;
use turnstile_core::{Generation, Revision};
use turnstile_store::*;

const RACE_ROUNDS_SQLITE_DEFAULT: usize = 1000;
const RACE_ROUNDS_POSTGRES_DEFAULT: usize = 400;
const RACE_ROUNDS_IN_FLIGHT: usize = 24;
const TASKS_PER_ROUND: usize = 8;

fn rounds(backend: Backend) -> usize {
    std::env::var("TURNSTILE_RACE_ROUNDS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(match backend {
            Backend::Sqlite => RACE_ROUNDS_SQLITE_DEFAULT,
            Backend::Postgres => RACE_ROUNDS_POSTGRES_DEFAULT,
        })
}

macro_rules! races {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            use crate::support::Backend;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    super::$case(Backend::Sqlite, stringify!($case)).await
                }
            )*
        }
        mod postgres {
            use crate::support::Backend;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    super::$case(Backend::Postgres, stringify!($case)).await
                }
            )*
        }
    };
}

races!(
    many_tasks_on_two_replicas_racing_one_operation_id_make_exactly_one_dispatch_and_one_attempt,
    two_operations_on_the_same_revision_commit_exactly_one_turn,
    two_generations_and_a_cancel_racing_leave_exactly_one_winner,
);

type Replica = Arc<Store>;

async fn replicas(backend: Backend, name: &str) -> (Place, [Replica; 2]) {
    let place = place(backend, name).await;
    let first = Arc::new(open_at(&place, 16).await);
    let second = Arc::new(open_at(&place, 16).await);
    (place, [first, second])
}

/// Run `round(index)` for every round, a bounded number at a time.
async fn run_rounds<F, Fut>(backend: Backend, round: F)
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let total = rounds(backend);
    let mut in_flight = JoinSet::new();
    for index in 0..total {
        if in_flight.len() >= RACE_ROUNDS_IN_FLIGHT {
            in_flight.join_next().await.unwrap().unwrap();
        }
        in_flight.spawn(round(index));
    }
    while let Some(result) = in_flight.join_next().await {
        result.unwrap();
    }
}

pub async fn many_tasks_on_two_replicas_racing_one_operation_id_make_exactly_one_dispatch_and_one_attempt(
    backend: Backend,
    name: &str,
) {
    let (_place, [a, b]) = replicas(backend, name).await;
    run_rounds(backend, |index| {
        let (a, b) = (a.clone(), b.clone());
        async move {
            let conversation_id = format!("c{index}");
            let operation_id = format!("op{index}");
            conversation_at_1(&**a, &conversation_id).await;
            let (manifest, bytes) = manifest(&operation_id, &conversation_id, 1, "m");
            let (other, other_bytes) = crate::support::manifest(&operation_id, &conversation_id, 1, "other");
            let mut tasks = JoinSet::new();
            for task in 0..TASKS_PER_ROUND + 2 {
                let store = if task % 2 == 0 { a.clone() } else { b.clone() };
                let (manifest, bytes) = if task < TASKS_PER_ROUND {
                    (manifest.clone(), bytes.clone())
                } else {
                    (other.clone(), other_bytes.clone())
                };
                tasks.spawn(async move { store.prepare(&manifest, &bytes, at(10)).await.unwrap() });
            }
            let (mut created, mut existing, mut conflicts) = (0, 0, 0);
            while let Some(outcome) = tasks.join_next().await {
                match outcome.unwrap() {
                    PrepareOutcome::Created(_) => created += 1,
                    PrepareOutcome::Existing(_) => existing += 1,
                    PrepareOutcome::Conflict { .. } => conflicts += 1,
                    other => panic!("round {index}: {other:?}"),
                }
            }
            // The other manifest may win the insert; then the same manifest conflicts instead.
            assert_eq!(created, 1, "round {index}: exactly one dispatch");
            assert_eq!(created + existing + conflicts, TASKS_PER_ROUND + 2);
            let record = a.dispatch(&operation_id).await.unwrap().unwrap();
            let mut tasks = JoinSet::new();
            for task in 0..TASKS_PER_ROUND {
                let store = if task % 2 == 0 { a.clone() } else { b.clone() };
                let operation_id = operation_id.clone();
                let expect = BeginExpect {
                    revision: record.revision,
                    cancel_generation: record.cancel_generation,
                    target: 0,
                };
                tasks.spawn(async move {
                    store
                        .begin_attempt(&operation_id, expect, &lease(&format!("r{task}"), 5_000), at(11))
                        .await
                        .unwrap()
                });
            }
            let mut began = Vec::new();
            while let Some(outcome) = tasks.join_next().await {
                if let BeginOutcome::Began { generation, .. } = outcome.unwrap() {
                    began.push(generation);
                }
            }
            assert_eq!(began, vec![Generation(1)], "round {index}: exactly one attempt");
            assert_eq!(b.attempts(&operation_id).await.unwrap().len(), 1);
        }
    })
    .await;
}

pub async fn two_operations_on_the_same_revision_commit_exactly_one_turn(backend: Backend, name: &str) {
    let (_place, [a, b]) = replicas(backend, name).await;
    run_rounds(backend, |index| {
        let (a, b) = (a.clone(), b.clone());
        async move {
            let conversation_id = format!("c{index}");
            conversation_at_1(&**a, &conversation_id).await;
            // Two user turns racing on revision 1.
            let (turn_a, turn_b) = (
                user_turn(&format!("{conversation_id}-ua")),
                user_turn(&format!("{conversation_id}-ub")),
            );
            let (first, second) = tokio::join!(
                a.append_turn(&conversation_id, Revision(1), &turn_a, at(3)),
                b.append_turn(&conversation_id, Revision(1), &turn_b, at(3)),
            );
            let appended = [first.unwrap(), second.unwrap()]
                .iter()
                .filter(|outcome| matches!(outcome, AppendOutcome::Appended { .. }))
                .count();
            assert_eq!(appended, 1, "round {index}: one append wins");
            // Two dispatches on revision 2, both streaming, committing at once.
            let mut generations = Vec::new();
            for (store, tag) in [(&a, "x"), (&b, "y")] {
                let operation_id = format!("op{index}{tag}");
                let generation = prepared_and_begun(&***store, &operation_id, &conversation_id, 2).await;
                to_streaming(&***store, &operation_id, generation).await;
                generations.push((operation_id, generation));
            }
            let turn_x = assistant_turn(&format!("{conversation_id}-x"), 2);
            let turn_y = assistant_turn(&format!("{conversation_id}-y"), 1);
            let (x, y) = tokio::join!(
                a.commit(&generations[0].0, generations[0].1, Revision(2), &turn_x, at(20)),
                b.commit(&generations[1].0, generations[1].1, Revision(2), &turn_y, at(20)),
            );
            let outcomes = [x.unwrap(), y.unwrap()];
            let committed = outcomes
                .iter()
                .filter(|outcome| matches!(outcome, CommitOutcome::Committed { .. }))
                .count();
            assert_eq!(
                committed, 1,
                "round {index}: exactly one canonical turn: {outcomes:?}"
            );
            assert!(outcomes.contains(&CommitOutcome::Refused(CommitRefusal::RevisionMoved)));
            let document = a.conversation(&conversation_id).await.unwrap().unwrap();
            assert_eq!(document["revision"], 3);
        }
    })
    .await;
    let conversation_ids: Vec<String> = (0..rounds(backend)).map(|index| format!("c{index}")).collect();
    check_invariants(&**a, &conversation_ids).await;
    assert_eq!(a.quarantined(u64::MAX >> 1).await.unwrap().len(), rounds(backend));
}

pub async fn two_generations_and_a_cancel_racing_leave_exactly_one_winner(backend: Backend, name: &str) {
    let (_place, [a, b]) = replicas(backend, name).await;
    run_rounds(backend, |index| {
        let (a, b) = (a.clone(), b.clone());
        async move {
            let conversation_id = format!("c{index}");
            let operation_id = format!("op{index}");
            conversation_at_1(&**a, &conversation_id).await;
            let first = prepared_and_begun(&**a, &operation_id, &conversation_id, 1).await;
            to_streaming(&**a, &operation_id, first).await;
            let _ = a
                .transition(
                    &operation_id,
                    first,
                    DispatchState::Streaming,
                    DispatchState::Unknown,
                    at(30),
                )
                .await
                .unwrap();
            assert_eq!(
                b.abandon_and_rearm(&operation_id, first, true, at(31))
                    .await
                    .unwrap(),
                TransitionOutcome::Applied
            );
            let expect = BeginExpect {
                revision: Revision(1),
                cancel_generation: 0,
                target: 0,
            };
            let BeginOutcome::Began {
                generation: second, ..
            } = b
                .begin_attempt(&operation_id, expect, &lease("replica-b", 9_000), at(32))
                .await
                .unwrap()
            else {
                panic!("round {index}: second generation refused");
            };
            to_streaming(&**b, &operation_id, second).await;
            let late = assistant_turn(&format!("{conversation_id}-late"), 1);
            let fresh = assistant_turn(&format!("{conversation_id}-fresh"), 1);
            let (old, new, cancel) = tokio::join!(
                a.commit(&operation_id, first, Revision(1), &late, at(40)),
                b.commit(&operation_id, second, Revision(1), &fresh, at(40)),
                a.cancel(&operation_id, None, at(40)),
            );
            assert!(
                matches!(
                    old.unwrap(),
                    CommitOutcome::Refused(CommitRefusal::ForeignGeneration)
                ),
                "round {index}: the old generation never commits"
            );
            let committed = matches!(new.unwrap(), CommitOutcome::Committed { .. });
            let cancelled = matches!(cancel.unwrap(), CancelOutcome::Cancelled { .. });
            assert!(
                committed ^ cancelled,
                "round {index}: exactly one of commit and cancel wins"
            );
            let document = b.conversation(&conversation_id).await.unwrap().unwrap();
            assert_eq!(document["revision"], if committed { 2 } else { 1 });
        }
    })
    .await;
    let conversation_ids: Vec<String> = (0..rounds(backend)).map(|index| format!("c{index}")).collect();
    check_invariants(&**a, &conversation_ids).await;
}
