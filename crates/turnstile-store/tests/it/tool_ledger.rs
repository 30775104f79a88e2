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
    a_client_call_past_its_bound_by_the_store_s_clock_is_client_abandoned_not_pending_and_a_late_result_still_closes_it,
    a_fork_of_the_client_abandons_its_calls_up_to_the_revision_it_left_and_no_others,
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
            .hand_to_client("c", "a-call-0", "proxy-client", CLIENT_CALL_TIMEOUT_MS_DEFAULT)
            .await
            .unwrap()
    );
    assert_eq!(
        store.release_call("c", "a-call-0", held.claim).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert!(
        store
            .hand_to_client("c", "a-call-0", "proxy-client", CLIENT_CALL_TIMEOUT_MS_DEFAULT)
            .await
            .unwrap()
    );
    assert!(
        store
            .hand_to_client("c", "a-call-1", "proxy-client", CLIENT_CALL_TIMEOUT_MS_DEFAULT)
            .await
            .unwrap()
    );
    assert!(
        !store
            .hand_to_client("c", "a-call-0", "proxy-client", CLIENT_CALL_TIMEOUT_MS_DEFAULT)
            .await
            .unwrap(),
        "handed once"
    );
    let call = listed(&*store, "a-call-1").await;
    assert_eq!(
        (call.state, call.claim, call.claim_holder.as_deref()),
        (ToolCallState::Client, 0, Some("proxy-client")),
        "no claim"
    );
    let hold_ends = call.claim_expires_at.expect("the client's hold has an end").0;
    let now = store.store_now().await.unwrap().0;
    assert!(
        hold_ends > now && hold_ends <= now + CLIENT_CALL_TIMEOUT_MS_DEFAULT,
        "the hold ends within the default bound of the store's now: {hold_ends} vs {now}"
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
            .hand_to_client("c", "a-call-0", "proxy-client", CLIENT_CALL_TIMEOUT_MS_DEFAULT)
            .await
            .unwrap()
    );
    assert!(
        !store
            .hand_to_client("c", "nope", "proxy-client", CLIENT_CALL_TIMEOUT_MS_DEFAULT)
            .await
            .unwrap()
    );
    check_invariants(&*store, &["c".into()]).await;
}

/// The conversation's `pending_calls` in the listing.
async fn pending_calls(store: &dyn Ledger, conversation_id: &str) -> u64 {
    let page = store
        .conversation_page(&ConversationQuery {
            limit: 50,
            ..ConversationQuery::default()
        })
        .await
        .unwrap();
    page.conversations
        .iter()
        .find(|summary| summary.conversation_id == conversation_id)
        .unwrap_or_else(|| panic!("{conversation_id} is not listed"))
        .pending_calls
}

/// Ids of the conversations the listing shows with (`Some`) or without (`None`) pending calls.
async fn listed_by_pending(store: &dyn Ledger, pending: PendingFilter) -> Vec<String> {
    let page = store
        .conversation_page(&ConversationQuery {
            limit: 50,
            pending: Some(pending),
            ..ConversationQuery::default()
        })
        .await
        .unwrap();
    page.conversations
        .into_iter()
        .map(|summary| summary.conversation_id)
        .collect()
}

/// Ids of the calls listed in `state`.
async fn listed_in(store: &dyn Ledger, state: ToolCallState) -> Vec<String> {
    store
        .tool_calls(Some(state))
        .await
        .unwrap()
        .into_iter()
        .map(|call| call.call_id)
        .collect()
}

/// Poll the listing (bounded) until the call is listed as `client_abandoned`; until then it
/// must be listed as `client`.
async fn until_client_abandoned(store: &dyn Ledger, call_id: &str) -> ToolCallRecord {
    let deadline = tokio::time::Instant::now() + EXPIRY_WAIT_MAX;
    loop {
        let call = listed(store, call_id).await;
        if call.state == ToolCallState::ClientAbandoned {
            return call;
        }
        assert_eq!(call.state, ToolCallState::Client, "{call:?}");
        assert!(
            tokio::time::Instant::now() < deadline,
            "{call_id} not client_abandoned after {EXPIRY_WAIT_MAX:?}: {call:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A result turn for `call_ids` of conversation `c` (each with its call's envelope).
async fn results_turn(store: &dyn Ledger, id: &str, call_ids: &[&str]) -> serde_json::Value {
    let calls = store.tool_calls(None).await.unwrap();
    let blocks: Vec<serde_json::Value> = call_ids
        .iter()
        .map(|call_id| {
            let call = calls
                .iter()
                .find(|call| call.conversation_id == "c" && call.call_id == *call_id)
                .expect("listed call");
            json!({"id": format!("{id}-{call_id}"), "kind": "tool_result", "call_id": call_id,
                   "tool": call.tool, "args_digest": call.args_digest, "generation": call.generation.0,
                   "status": "success", "content": [{"kind": "text", "text": "12C"}]})
        })
        .collect();
    json!({"id": id, "role": "tool", "blocks": blocks})
}

/// A call handed to the proxy client holds until `bound_ms` after the hand-over by the store's
/// clock; from then it reads `client_abandoned` in every listing, claim and result answer, it
/// leaves the conversation's pending count, and executors still never get it. A late follow-up
/// carrying its result closes it once (`done`); a second result is refused.
pub async fn a_client_call_past_its_bound_by_the_store_s_clock_is_client_abandoned_not_pending_and_a_late_result_still_closes_it(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    calls_committed(&*store, 3).await;
    assert_eq!(pending_calls(&*store, "c").await, 3, "three ready calls");
    // A long bound: the hold ends that long after the store's now at the hand-over.
    let before = store.store_now().await.unwrap().0;
    assert!(
        store
            .hand_to_client("c", "a-call-0", "proxy-client", 60_000)
            .await
            .unwrap()
    );
    let after = store.store_now().await.unwrap().0;
    let held = listed(&*store, "a-call-0").await;
    assert_eq!(held.state, ToolCallState::Client);
    let hold_ends = held.claim_expires_at.expect("a hold with an end").0;
    assert!(
        hold_ends >= before + 60_000 && hold_ends <= after + 60_000,
        "hold ends at {hold_ends}, not 60 s after the store's now [{before}, {after}]"
    );
    // A 1 ms bound runs out at once by the store's clock.
    assert!(
        store
            .hand_to_client("c", "a-call-1", "proxy-client", 1)
            .await
            .unwrap()
    );
    let abandoned = until_client_abandoned(&*store, "a-call-1").await;
    assert_eq!(
        (abandoned.claim, abandoned.claim_holder.as_deref()),
        (0, Some("proxy-client"))
    );
    assert_eq!(listed_in(&*store, ToolCallState::Client).await, ["a-call-0"]);
    assert_eq!(
        listed_in(&*store, ToolCallState::ClientAbandoned).await,
        ["a-call-1"]
    );
    assert_eq!(listed_in(&*store, ToolCallState::Ready).await, ["a-call-2"]);
    assert_eq!(
        pending_calls(&*store, "c").await,
        2,
        "a ready and a client call are pending, the abandoned one is not"
    );
    // Never offered to executors, and no claim answers for it.
    assert_eq!(
        store
            .claim_call("c", "a-call-1", "exec-1", LONG_LEASE_MS)
            .await
            .unwrap(),
        CallClaimOutcome::Unavailable {
            state: ToolCallState::ClientAbandoned
        }
    );
    assert_eq!(
        store
            .submit_tool_result("c", "a-call-1", 0, "success", &json!([]), at(30))
            .await
            .unwrap(),
        ResultOutcome::StaleClaim
    );
    assert!(
        !store
            .hand_to_client("c", "a-call-1", "proxy-client", 60_000)
            .await
            .unwrap(),
        "an abandoned call is not handed again"
    );
    // A late follow-up carrying the result closes it: abandonment is bookkeeping, not refusal.
    let late = results_turn(&*store, "late", &["a-call-1"]).await;
    assert_eq!(
        store.append_turn("c", Revision(2), &late, at(31)).await.unwrap(),
        AppendOutcome::Appended {
            revision: Revision(3)
        }
    );
    let closed = listed(&*store, "a-call-1").await;
    assert_eq!(
        (closed.state, closed.result_revision),
        (ToolCallState::Done, Some(Revision(3)))
    );
    let again = results_turn(&*store, "again", &["a-call-1"]).await;
    assert!(
        matches!(
            store.append_turn("c", Revision(3), &again, at(32)).await.unwrap(),
            AppendOutcome::Rejected(_)
        ),
        "a second result is a duplicate"
    );
    assert_eq!(pending_calls(&*store, "c").await, 2);
    check_invariants(&*store, &["c".into()]).await;
}

/// A follow-up of the client that forks away from the conversation as it stood at revision R
/// ends (now, by the store's clock) exactly the calls the client held there at or before R:
/// not those committed after R, not ready or done ones, not another conversation's. The
/// conversation leaves the pending listing; a late follow-up still closes the calls.
pub async fn a_fork_of_the_client_abandons_its_calls_up_to_the_revision_it_left_and_no_others(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    // Conversation "c": two calls at revision 2, answered at 3, then one more call at 4 and a
    // ready one beside it.
    calls_committed(&*store, 2).await;
    for call_id in ["a-call-0", "a-call-1"] {
        assert!(
            store
                .hand_to_client("c", call_id, "proxy-client", LONG_LEASE_MS)
                .await
                .unwrap()
        );
    }
    // Another client's conversation "d" holding a call of its own.
    conversation_at_1(&*store, "d").await;
    let generation = prepared_and_begun(&*store, "op-d", "d", 1).await;
    to_streaming(&*store, "op-d", generation).await;
    assert!(matches!(
        store
            .commit("op-d", generation, Revision(1), &assistant_turn("d", 1), at(20))
            .await
            .unwrap(),
        CommitOutcome::Committed { .. }
    ));
    assert!(
        store
            .hand_to_client("d", "d-call-0", "proxy-client", LONG_LEASE_MS)
            .await
            .unwrap()
    );
    assert_eq!(
        store.abandon_client_calls("c", Revision(1)).await.unwrap(),
        0,
        "nothing was handed at or before revision 1"
    );
    assert_eq!(listed_in(&*store, ToolCallState::Client).await.len(), 3);
    let both = results_turn(&*store, "r3", &["a-call-0", "a-call-1"]).await;
    assert_eq!(
        store.append_turn("c", Revision(2), &both, at(30)).await.unwrap(),
        AppendOutcome::Appended {
            revision: Revision(3)
        }
    );
    let generation = prepared_and_begun(&*store, "op-2", "c", 3).await;
    to_streaming(&*store, "op-2", generation).await;
    assert!(matches!(
        store
            .commit("op-2", generation, Revision(3), &assistant_turn("b", 2), at(40))
            .await
            .unwrap(),
        CommitOutcome::Committed { .. }
    ));
    assert!(
        store
            .hand_to_client("c", "b-call-0", "proxy-client", LONG_LEASE_MS)
            .await
            .unwrap()
    );
    assert_eq!(
        pending_calls(&*store, "c").await,
        2,
        "b-call-0 (client), b-call-1 (ready)"
    );
    // A fork that left "c" as it stood at revision 3 (before the new calls) ends nothing: the
    // call handed at revision 4 belongs to a request that did continue the conversation.
    assert_eq!(store.abandon_client_calls("c", Revision(3)).await.unwrap(), 0);
    assert_eq!(listed(&*store, "b-call-0").await.state, ToolCallState::Client);
    // A fork that left it at revision 4 ends the client's call there, now.
    let before = store.store_now().await.unwrap().0;
    assert_eq!(store.abandon_client_calls("c", Revision(4)).await.unwrap(), 1);
    let after = store.store_now().await.unwrap().0;
    let abandoned = listed(&*store, "b-call-0").await;
    assert_eq!(abandoned.state, ToolCallState::ClientAbandoned);
    let ended = abandoned.claim_expires_at.expect("an ended hold").0;
    assert!(
        (before..=after).contains(&ended),
        "ended at the store's now: {ended} not in [{before}, {after}]"
    );
    assert_eq!(
        store.abandon_client_calls("c", Revision(4)).await.unwrap(),
        0,
        "ended once"
    );
    assert_eq!(listed(&*store, "b-call-1").await.state, ToolCallState::Ready);
    assert_eq!(
        listed_in(&*store, ToolCallState::Done).await,
        ["a-call-0", "a-call-1"]
    );
    assert_eq!(listed_in(&*store, ToolCallState::Client).await, ["d-call-0"]);
    assert_eq!(pending_calls(&*store, "c").await, 1, "only the ready b-call-1");
    assert_eq!(pending_calls(&*store, "d").await, 1);
    // Once the ready call is claimed and answered, "c" has nothing pending and is listed so.
    let granted = claimed(&*store, "b-call-1", "exec-1", LONG_LEASE_MS).await;
    assert!(matches!(
        store
            .submit_tool_result("c", "b-call-1", granted.claim, "success", &json!([]), at(50))
            .await
            .unwrap(),
        ResultOutcome::Appended { .. }
    ));
    assert_eq!(pending_calls(&*store, "c").await, 0);
    assert_eq!(listed_by_pending(&*store, PendingFilter::None).await, ["c"]);
    assert_eq!(listed_by_pending(&*store, PendingFilter::Some).await, ["d"]);
    // The client that did not go away after all: its follow-up closes the abandoned call.
    let late = results_turn(&*store, "late", &["b-call-0"]).await;
    assert_eq!(
        store.append_turn("c", Revision(5), &late, at(60)).await.unwrap(),
        AppendOutcome::Appended {
            revision: Revision(6)
        }
    );
    assert_eq!(listed(&*store, "b-call-0").await.state, ToolCallState::Done);
    assert_eq!(pending_calls(&*store, "c").await, 0);
    check_invariants(&*store, &["c".into(), "d".into()]).await;
}

/// On a SQLite store with a manual clock a client's hold ends exactly at the hand-over's time
/// plus the bound: `client` one millisecond before, `client_abandoned` at it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_manual_store_clock_a_client_s_hold_ends_exactly_at_its_bound() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let (clock, handle) = StoreClock::manual(2_000_000);
    let store = SqliteLedger::open_with_clock(dir.path().join("ledger.db"), Synchronous::Full, clock)
        .expect("open sqlite");
    calls_committed(&store, 1).await;
    assert!(
        store
            .hand_to_client("c", "a-call-0", "proxy-client", 5_000)
            .await
            .unwrap()
    );
    assert_eq!(
        listed(&store, "a-call-0").await.claim_expires_at,
        Some(Timestamp(2_005_000))
    );
    handle.store(2_004_999, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(listed(&store, "a-call-0").await.state, ToolCallState::Client);
    assert_eq!(pending_calls(&store, "c").await, 1);
    handle.store(2_005_000, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        listed(&store, "a-call-0").await.state,
        ToolCallState::ClientAbandoned
    );
    assert_eq!(pending_calls(&store, "c").await, 0);
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
