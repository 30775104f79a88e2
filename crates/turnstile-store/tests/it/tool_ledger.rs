//! The tool-call ledger executors rely on (`shared/spec/gateway-api.md`, "Tool-call ledger for
//! executors"), on SQLite and PostgreSQL: claim races between two replicas, renewals and
//! releases fenced by the claim number, `expired` as a listed state judged by the store's clock
//! and claimable again with the same idempotency key, results fenced by the claim number, and
//! calls handed to a proxy client.
//!
//! Expiry without long sleeps: a claim's lease is shortened to 1 ms by a renewal (or granted
//! that short), then a bounded poll on the listing waits until the store says `expired`.

use crate::support::*;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use turnstile_core::Revision;
use turnstile_store::*;

macro_rules! tool_ledger {
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

tool_ledger!(
    claims_racing_on_two_replicas_grant_exactly_one_claim_of_a_ready_or_an_expired_call,
    a_renewal_extends_only_the_current_running_claim_and_after_expiry_is_refused,
    a_release_by_a_stale_claim_is_refused_and_the_current_claim_puts_the_call_back_to_ready,
    an_expired_call_is_listed_and_claimed_again_with_the_same_idempotency_key_and_only_the_new_claim_s_result_counts,
    the_latest_claim_s_result_is_accepted_after_its_lease_ran_out_while_nobody_claimed_again,
    leases_run_on_the_store_clock_whatever_time_the_caller_passes,
    a_call_handed_to_the_client_is_never_offered_to_executors_and_its_appended_result_closes_it,
);

/// Longest a test waits for the store to list a lease as run out.
const EXPIRY_WAIT_MAX: Duration = Duration::from_secs(10);
/// Rounds of the claim race (each: a ready race and an expired-takeover race).
const CLAIM_RACE_ROUNDS: usize = 40;
/// Claimants per race, split over the two replicas.
const CLAIMANTS: usize = 8;
/// A lease that never runs out during a test.
const LONG_LEASE_MS: u64 = 600_000;

/// Conversation "c" at revision 2: one assistant turn with `calls` committed calls
/// (`a-call-0`, …), all `ready`.
async fn calls_committed(store: &dyn Ledger, calls: usize) {
    conversation_at_1(store, "c").await;
    let generation = prepared_and_begun(store, "op-1", "c", 1).await;
    to_streaming(store, "op-1", generation).await;
    let outcome = store
        .commit(
            "op-1",
            generation,
            Revision(1),
            &assistant_turn("a", calls),
            at(20),
        )
        .await
        .unwrap();
    assert!(matches!(outcome, CommitOutcome::Committed { .. }), "{outcome:?}");
}

async fn listed(store: &dyn Ledger, call_id: &str) -> ToolCallRecord {
    store
        .tool_calls(None)
        .await
        .unwrap()
        .into_iter()
        .find(|call| call.call_id == call_id)
        .unwrap_or_else(|| panic!("{call_id} is not in the ledger"))
}

/// Poll the listing (bounded) until the call is listed as `expired`.
async fn until_expired(store: &dyn Ledger, call_id: &str) -> ToolCallRecord {
    let deadline = tokio::time::Instant::now() + EXPIRY_WAIT_MAX;
    loop {
        let call = listed(store, call_id).await;
        if call.state == ToolCallState::Expired {
            return call;
        }
        assert_eq!(call.state, ToolCallState::Claimed, "{call:?}");
        assert!(
            tokio::time::Instant::now() < deadline,
            "{call_id} not expired after {EXPIRY_WAIT_MAX:?}: {call:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn claimed(store: &dyn Ledger, call_id: &str, holder: &str, lease_ms: u64) -> CallClaim {
    match store.claim_call("c", call_id, holder, lease_ms).await.unwrap() {
        CallClaimOutcome::Claimed(granted) => granted,
        other => panic!("claim of {call_id} by {holder}: {other:?}"),
    }
}

/// Make the claim's lease run out now: shorten it to 1 ms and wait until the store lists it
/// as expired.
async fn expire(store: &dyn Ledger, call_id: &str, claim: u64) -> ToolCallRecord {
    assert!(matches!(
        store.renew_call("c", call_id, claim, 1).await.unwrap(),
        RenewOutcome::Renewed { .. }
    ));
    until_expired(store, call_id).await
}

async fn race(replicas: &[Arc<Store>; 2], call_id: &str, round: usize) -> Vec<CallClaimOutcome> {
    let mut tasks = JoinSet::new();
    for index in 0..CLAIMANTS {
        let replica = Arc::clone(&replicas[index % 2]);
        let call_id = call_id.to_owned();
        tasks.spawn(async move {
            replica
                .claim_call("c", &call_id, &format!("exec-{round}-{index}"), LONG_LEASE_MS)
                .await
                .unwrap()
        });
    }
    let mut outcomes = Vec::new();
    while let Some(outcome) = tasks.join_next().await {
        outcomes.push(outcome.unwrap());
    }
    outcomes
}

fn the_one_winner(outcomes: &[CallClaimOutcome]) -> CallClaim {
    let winners: Vec<&CallClaim> = outcomes
        .iter()
        .filter_map(|outcome| match outcome {
            CallClaimOutcome::Claimed(granted) => Some(granted),
            _ => None,
        })
        .collect();
    assert_eq!(winners.len(), 1, "{outcomes:?}");
    for outcome in outcomes {
        assert!(
            matches!(
                outcome,
                CallClaimOutcome::Claimed(_)
                    | CallClaimOutcome::Unavailable {
                        state: ToolCallState::Claimed
                    }
            ),
            "{outcome:?}"
        );
    }
    winners[0].clone()
}

pub async fn claims_racing_on_two_replicas_grant_exactly_one_claim_of_a_ready_or_an_expired_call(
    backend: Backend,
    name: &str,
) {
    let place = place(backend, name).await;
    let replicas = [
        Arc::new(open_at(&place, 16).await),
        Arc::new(open_at(&place, 16).await),
    ];
    calls_committed(&**replicas[0], 1).await;
    let key = listed(&**replicas[0], "a-call-0").await.idempotency_key;
    let mut claims = 0;
    for round in 0..CLAIM_RACE_ROUNDS {
        // A ready call: one claimant wins.
        let winner = the_one_winner(&race(&replicas, "a-call-0", round).await);
        claims += 1;
        assert_eq!(winner.claim, claims, "round {round}");
        assert!(!winner.took_over_expired);
        assert_eq!(winner.idempotency_key, key);
        // Its lease runs out: one claimant takes it over.
        expire(&**replicas[round % 2], "a-call-0", winner.claim).await;
        let taker = the_one_winner(&race(&replicas, "a-call-0", round).await);
        claims += 1;
        assert_eq!(taker.claim, claims, "round {round}");
        assert!(taker.took_over_expired);
        assert_eq!(taker.idempotency_key, key);
        // Given back for the next round.
        assert_eq!(
            replicas[(round + 1) % 2]
                .release_call("c", "a-call-0", taker.claim)
                .await
                .unwrap(),
            ReleaseOutcome::Released
        );
    }
    let call = listed(&**replicas[1], "a-call-0").await;
    assert_eq!((call.state, call.claim), (ToolCallState::Ready, claims));
}

pub async fn a_renewal_extends_only_the_current_running_claim_and_after_expiry_is_refused(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    calls_committed(&*store, 1).await;
    let first = claimed(&*store, "a-call-0", "exec-1", 1_000).await;
    let RenewOutcome::Renewed { lease_expires_at } = store
        .renew_call("c", "a-call-0", first.claim, LONG_LEASE_MS)
        .await
        .unwrap()
    else {
        panic!("the current claim could not renew");
    };
    assert!(lease_expires_at.0 >= first.lease_expires_at.0 + LONG_LEASE_MS - 1_000);
    assert_eq!(
        listed(&*store, "a-call-0").await.claim_expires_at,
        Some(lease_expires_at)
    );
    assert_eq!(
        store
            .renew_call("c", "a-call-0", first.claim + 1, LONG_LEASE_MS)
            .await
            .unwrap(),
        RenewOutcome::StaleClaim {
            state: ToolCallState::Claimed
        },
        "a claim number that was never granted"
    );
    // The lease runs out: renewing now is refused (the call was listed as expired, another
    // executor may hold it already), and nothing changed.
    let expired = expire(&*store, "a-call-0", first.claim).await;
    assert_eq!(
        store
            .renew_call("c", "a-call-0", first.claim, LONG_LEASE_MS)
            .await
            .unwrap(),
        RenewOutcome::StaleClaim {
            state: ToolCallState::Expired
        }
    );
    assert_eq!(listed(&*store, "a-call-0").await, expired);
    // Taken over: the old claim stays refused, the new one renews.
    let second = claimed(&*store, "a-call-0", "exec-2", 1_000).await;
    assert_eq!(
        store
            .renew_call("c", "a-call-0", first.claim, LONG_LEASE_MS)
            .await
            .unwrap(),
        RenewOutcome::StaleClaim {
            state: ToolCallState::Claimed
        }
    );
    assert!(matches!(
        store
            .renew_call("c", "a-call-0", second.claim, LONG_LEASE_MS)
            .await
            .unwrap(),
        RenewOutcome::Renewed { .. }
    ));
    assert_eq!(
        store.renew_call("c", "nope", 1, LONG_LEASE_MS).await.unwrap(),
        RenewOutcome::NotFound
    );
}

pub async fn a_release_by_a_stale_claim_is_refused_and_the_current_claim_puts_the_call_back_to_ready(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    calls_committed(&*store, 1).await;
    let first = claimed(&*store, "a-call-0", "exec-1", LONG_LEASE_MS).await;
    expire(&*store, "a-call-0", first.claim).await;
    assert_eq!(
        store.release_call("c", "a-call-0", first.claim).await.unwrap(),
        ReleaseOutcome::StaleClaim {
            state: ToolCallState::Expired
        },
        "a claim whose lease ran out is not current"
    );
    let second = claimed(&*store, "a-call-0", "exec-2", LONG_LEASE_MS).await;
    assert_eq!(
        store.release_call("c", "a-call-0", first.claim).await.unwrap(),
        ReleaseOutcome::StaleClaim {
            state: ToolCallState::Claimed
        }
    );
    assert_eq!(
        listed(&*store, "a-call-0").await.claim_holder.as_deref(),
        Some("exec-2")
    );
    assert_eq!(
        store.release_call("c", "a-call-0", second.claim).await.unwrap(),
        ReleaseOutcome::Released
    );
    let call = listed(&*store, "a-call-0").await;
    assert_eq!(
        (call.state, call.claim, call.claim_expires_at),
        (ToolCallState::Ready, 2, None)
    );
    assert_eq!(
        store.tool_calls(Some(ToolCallState::Ready)).await.unwrap().len(),
        1
    );
    // Released twice, or a released claim's late result: refused.
    assert_eq!(
        store.release_call("c", "a-call-0", second.claim).await.unwrap(),
        ReleaseOutcome::StaleClaim {
            state: ToolCallState::Ready
        }
    );
    let content = json!([{"kind": "text", "text": "12C"}]);
    assert_eq!(
        store
            .submit_tool_result("c", "a-call-0", second.claim, "success", &content, at(30))
            .await
            .unwrap(),
        ResultOutcome::StaleClaim
    );
    // The next claim gets a new number and the same key.
    let third = claimed(&*store, "a-call-0", "exec-3", LONG_LEASE_MS).await;
    assert_eq!(third.claim, 3);
    assert!(!third.took_over_expired);
    assert_eq!(third.idempotency_key, first.idempotency_key);
    assert_eq!(
        store.release_call("c", "nope", 1).await.unwrap(),
        ReleaseOutcome::NotFound
    );
}

pub async fn an_expired_call_is_listed_and_claimed_again_with_the_same_idempotency_key_and_only_the_new_claim_s_result_counts(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    calls_committed(&*store, 2).await;
    let ready = store.tool_calls(Some(ToolCallState::Ready)).await.unwrap();
    assert_eq!(ready.len(), 2);
    assert!(
        ready
            .iter()
            .all(|call| call.claim == 0 && call.claim_expires_at.is_none())
    );
    assert_ne!(ready[0].idempotency_key, ready[1].idempotency_key);
    let first = claimed(&*store, "a-call-0", "exec-1", 1).await;
    assert_eq!(first.idempotency_key, ready[0].idempotency_key);
    let expired = until_expired(&*store, "a-call-0").await;
    assert_eq!(expired.claim, 1, "one claim so far");
    assert_eq!(expired.claim_expires_at, Some(first.lease_expires_at));
    assert_eq!(expired.claim_holder.as_deref(), Some("exec-1"));
    // Listed under `expired`, not under `ready` or `claimed`.
    let ids = |calls: Vec<ToolCallRecord>| calls.into_iter().map(|call| call.call_id).collect::<Vec<_>>();
    assert_eq!(
        ids(store.tool_calls(Some(ToolCallState::Expired)).await.unwrap()),
        vec!["a-call-0"]
    );
    assert_eq!(
        ids(store.tool_calls(Some(ToolCallState::Ready)).await.unwrap()),
        vec!["a-call-1"]
    );
    assert!(
        store
            .tool_calls(Some(ToolCallState::Claimed))
            .await
            .unwrap()
            .is_empty()
    );
    // Claimed again: a new fencing token, the same idempotency key, flagged as a takeover.
    let second = claimed(&*store, "a-call-0", "exec-2", LONG_LEASE_MS).await;
    assert_eq!(second.claim, 2);
    assert!(second.took_over_expired);
    assert_eq!(second.idempotency_key, first.idempotency_key);
    let call = listed(&*store, "a-call-0").await;
    assert_eq!(
        (call.state, call.claim, call.claim_expires_at),
        (ToolCallState::Claimed, 2, Some(second.lease_expires_at))
    );
    assert!(matches!(
        store
            .claim_call("c", "a-call-0", "exec-3", LONG_LEASE_MS)
            .await
            .unwrap(),
        CallClaimOutcome::Unavailable {
            state: ToolCallState::Claimed
        }
    ));
    // The first executor's late result is stale; the second's closes the call, once.
    let content = json!([{"kind": "text", "text": "12C"}]);
    assert_eq!(
        store
            .submit_tool_result("c", "a-call-0", first.claim, "success", &content, at(30))
            .await
            .unwrap(),
        ResultOutcome::StaleClaim
    );
    assert_eq!(
        store
            .submit_tool_result("c", "a-call-0", second.claim, "success", &content, at(31))
            .await
            .unwrap(),
        ResultOutcome::Appended {
            revision: Revision(3)
        }
    );
    assert_eq!(
        store
            .submit_tool_result("c", "a-call-0", second.claim, "success", &content, at(32))
            .await
            .unwrap(),
        ResultOutcome::Duplicate
    );
    let call = listed(&*store, "a-call-0").await;
    assert_eq!(
        (call.state, call.result_revision),
        (ToolCallState::Done, Some(Revision(3)))
    );
    assert!(matches!(
        store
            .claim_call("c", "a-call-0", "exec-3", LONG_LEASE_MS)
            .await
            .unwrap(),
        CallClaimOutcome::Unavailable {
            state: ToolCallState::Done
        }
    ));
    assert_eq!(
        store
            .claim_call("c", "nope", "exec-3", LONG_LEASE_MS)
            .await
            .unwrap(),
        CallClaimOutcome::NotFound
    );
    check_invariants(&*store, &["c".into()]).await;
}

pub async fn the_latest_claim_s_result_is_accepted_after_its_lease_ran_out_while_nobody_claimed_again(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    calls_committed(&*store, 1).await;
    let only = claimed(&*store, "a-call-0", "exec-1", LONG_LEASE_MS).await;
    expire(&*store, "a-call-0", only.claim).await;
    let content = json!([{"kind": "text", "text": "12C"}]);
    assert_eq!(
        store
            .submit_tool_result("c", "a-call-0", only.claim, "success", &content, at(30))
            .await
            .unwrap(),
        ResultOutcome::Appended {
            revision: Revision(3)
        }
    );
    assert_eq!(listed(&*store, "a-call-0").await.state, ToolCallState::Done);
}

pub async fn leases_run_on_the_store_clock_whatever_time_the_caller_passes(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    calls_committed(&*store, 2).await;
    // A caller whose clock reads 1970 asks for a 60 s lease: it runs 60 s from the store's now,
    // not from the caller's (by which it would have run out decades ago).
    let before = store.store_now().await.unwrap();
    let ClaimOutcome::Claimed { claim } = store
        .claim_tool_call("c", "a-call-0", &lease("exec-1", 60_023), at(23))
        .await
        .unwrap()
    else {
        panic!("claim refused");
    };
    let after = store.store_now().await.unwrap();
    let call = listed(&*store, "a-call-0").await;
    assert_eq!((call.state, call.claim), (ToolCallState::Claimed, claim));
    let expires = call.claim_expires_at.expect("a claimed call has an expiry").0;
    assert!(
        expires >= before.0 + 60_000 && expires <= after.0 + 60_000,
        "expiry {expires} not 60 s after the store's now [{}, {}]",
        before.0,
        after.0
    );
    // A caller whose clock reads far in the future cannot take the running claim over.
    assert_eq!(
        store
            .claim_tool_call("c", "a-call-0", &lease("exec-2", u64::MAX), at(u64::MAX - 1))
            .await
            .unwrap(),
        ClaimOutcome::Unavailable {
            state: ToolCallState::Claimed
        }
    );
    // The full form's answer is on the store's clock too.
    let granted = claimed(&*store, "a-call-1", "exec-1", 60_000).await;
    let now = store.store_now().await.unwrap();
    assert!(granted.lease_expires_at.0 > now.0 && granted.lease_expires_at.0 <= now.0 + 60_000);
}

pub async fn a_call_handed_to_the_client_is_never_offered_to_executors_and_its_appended_result_closes_it(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    calls_committed(&*store, 2).await;
    // A call an executor holds is not handed to the client.
    let held = claimed(&*store, "a-call-0", "exec-1", LONG_LEASE_MS).await;
    assert!(
        !store
            .hand_to_client("c", "a-call-0", "proxy-client")
            .await
            .unwrap()
    );
    assert_eq!(
        store.release_call("c", "a-call-0", held.claim).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert!(
        store
            .hand_to_client("c", "a-call-0", "proxy-client")
            .await
            .unwrap()
    );
    assert!(
        store
            .hand_to_client("c", "a-call-1", "proxy-client")
            .await
            .unwrap()
    );
    assert!(
        !store
            .hand_to_client("c", "a-call-0", "proxy-client")
            .await
            .unwrap(),
        "handed once"
    );
    let call = listed(&*store, "a-call-1").await;
    assert_eq!(
        (call.state, call.claim, call.claim_expires_at),
        (ToolCallState::Client, 0, None),
        "no claim and no lease"
    );
    for state in [
        ToolCallState::Ready,
        ToolCallState::Claimed,
        ToolCallState::Expired,
    ] {
        assert!(
            store.tool_calls(Some(state)).await.unwrap().is_empty(),
            "{state:?}"
        );
    }
    assert_eq!(
        store.tool_calls(Some(ToolCallState::Client)).await.unwrap().len(),
        2
    );
    assert_eq!(
        store
            .claim_call("c", "a-call-0", "exec-1", LONG_LEASE_MS)
            .await
            .unwrap(),
        CallClaimOutcome::Unavailable {
            state: ToolCallState::Client
        }
    );
    let content = json!([{"kind": "text", "text": "12C"}]);
    assert_eq!(
        store
            .submit_tool_result("c", "a-call-1", 0, "success", &content, at(30))
            .await
            .unwrap(),
        ResultOutcome::StaleClaim,
        "only the client's follow-up answers it"
    );
    // The follow-up carries both results as one tool turn (each with its call's envelope:
    // tool, arguments digest, generation): both calls close.
    let calls = store.tool_calls(Some(ToolCallState::Client)).await.unwrap();
    let envelope = |call_id: &str| {
        let call = calls
            .iter()
            .find(|call| call.call_id == call_id)
            .expect("listed call");
        (call.args_digest.clone(), call.generation.0)
    };
    let ((digest1, generation1), (digest0, generation0)) = (envelope("a-call-1"), envelope("a-call-0"));
    let results = json!({"id": "t-results", "role": "tool", "blocks": [
        {"id": "r1", "kind": "tool_result", "call_id": "a-call-1", "tool": "get_weather",
         "args_digest": digest1, "generation": generation1, "status": "success", "content": content},
        {"id": "r0", "kind": "tool_result", "call_id": "a-call-0", "tool": "get_weather",
         "args_digest": digest0, "generation": generation0, "status": "success", "content": content}]});
    assert_eq!(
        store
            .append_turn("c", Revision(2), &results, at(31))
            .await
            .unwrap(),
        AppendOutcome::Appended {
            revision: Revision(3)
        }
    );
    let done = store.tool_calls(Some(ToolCallState::Done)).await.unwrap();
    assert_eq!(done.len(), 2);
    assert!(done.iter().all(|call| call.result_revision == Some(Revision(3))));
    assert!(
        !store
            .hand_to_client("c", "a-call-0", "proxy-client")
            .await
            .unwrap()
    );
    assert!(!store.hand_to_client("c", "nope", "proxy-client").await.unwrap());
    check_invariants(&*store, &["c".into()]).await;
}

/// On a SQLite store with a manual clock (the simulation's virtual time) a lease runs out
/// exactly when that clock reaches its expiry: claimed one millisecond before, expired at it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_manual_store_clock_a_lease_runs_out_exactly_at_its_expiry() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let (clock, handle) = StoreClock::manual(1_000_000);
    let store = SqliteLedger::open_with_clock(dir.path().join("ledger.db"), Synchronous::Full, clock)
        .expect("open sqlite");
    calls_committed(&store, 1).await;
    let granted = claimed(&store, "a-call-0", "exec-1", 5_000).await;
    assert_eq!(granted.lease_expires_at, Timestamp(1_005_000));
    handle.store(1_004_999, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(listed(&store, "a-call-0").await.state, ToolCallState::Claimed);
    assert!(matches!(
        store.claim_call("c", "a-call-0", "exec-2", 5_000).await.unwrap(),
        CallClaimOutcome::Unavailable {
            state: ToolCallState::Claimed
        }
    ));
    let RenewOutcome::Renewed { lease_expires_at } =
        store.renew_call("c", "a-call-0", granted.claim, 1).await.unwrap()
    else {
        panic!("renewal refused");
    };
    assert_eq!(lease_expires_at, Timestamp(1_005_000));
    handle.store(1_005_000, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(listed(&store, "a-call-0").await.state, ToolCallState::Expired);
    assert_eq!(
        store
            .renew_call("c", "a-call-0", granted.claim, 5_000)
            .await
            .unwrap(),
        RenewOutcome::StaleClaim {
            state: ToolCallState::Expired
        }
    );
    let second = claimed(&store, "a-call-0", "exec-2", 5_000).await;
    assert!(second.took_over_expired);
    assert_eq!(second.lease_expires_at, Timestamp(1_010_000));
}
