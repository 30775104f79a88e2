//! The listings of `turnstile_store::listing` on both databases (instantiated by the
//! conformance suite): conversations newest first, keyset-paged, searched, filtered and
//! tenant-scoped; the quarantine newest first and paged.

use crate::support::*;
use serde_json::json;
use turnstile_core::dispatch::DispatchState;
use turnstile_core::{Generation, Revision};
use turnstile_store::*;

fn query(prefix: &str, limit: u64) -> ConversationQuery {
    ConversationQuery {
        id_prefix: prefix.into(),
        limit,
        ..ConversationQuery::default()
    }
}

fn ids(page: &ConversationPage) -> Vec<String> {
    page.conversations
        .iter()
        .map(|summary| summary.conversation_id.clone())
        .collect()
}

/// Every page of a query, walked by its cursors.
async fn walk(store: &dyn Ledger, mut query: ConversationQuery) -> Vec<String> {
    let mut seen = Vec::new();
    for _ in 0..100 {
        let page = store.conversation_page(&query).await.unwrap();
        assert!(page.conversations.len() as u64 <= query.limit);
        seen.extend(ids(&page));
        match page.next {
            Some(next) => query.after = Some(next),
            None => return seen,
        }
    }
    panic!("more than 100 pages");
}

/// Seven conversations of tenant `a~` (two updated at the same instant) and three of a tenant
/// whose name holds SQL wildcards: pages of three walk tenant `a~` newest first with ties
/// broken by id, each exactly once; a search matches only the id after the tenant prefix.
pub async fn conversations_are_listed_newest_first_paged_searched_and_tenant_scoped(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    for (index, at_ms) in [10, 20, 30, 40, 40, 60, 70].into_iter().enumerate() {
        let id = format!("a~chat-{index}");
        assert_eq!(
            store.create_conversation(&id, &tools(), at(at_ms)).await.unwrap(),
            CreateOutcome::Created
        );
    }
    for index in 0..3 {
        let id = format!("a_%~chat-{index}");
        let _ = store
            .create_conversation(&id, &tools(), at(100 + index))
            .await
            .unwrap();
    }
    // An append moves a conversation to the front.
    assert_eq!(
        store
            .append_turn("a~chat-0", Revision(0), &user_turn("u"), at(80))
            .await
            .unwrap(),
        AppendOutcome::Appended {
            revision: Revision(1)
        }
    );
    let expected: Vec<String> = [0, 6, 5, 4, 3, 2, 1]
        .into_iter()
        .map(|index| format!("a~chat-{index}"))
        .collect();
    assert_eq!(walk(&*store, query("a~", 3)).await, expected);
    assert_eq!(walk(&*store, query("a~", 500)).await, expected);
    let first = store.conversation_page(&query("a~", 3)).await.unwrap();
    assert_eq!(first.conversations[0].revision, Revision(1));
    assert_eq!(first.conversations[0].updated_at, at(80));
    assert!(first.conversations[0].last_dispatch.is_none());
    // The wildcard tenant sees its own three only; `a~` never sees them.
    assert_eq!(walk(&*store, query("a_%~", 2)).await.len(), 3);
    assert_eq!(walk(&*store, query("a%", 50)).await, Vec::<String>::new());
    // Search: a substring of the id after the prefix; the tenant's own name matches nothing.
    let search = |text: &str| ConversationQuery {
        search: text.into(),
        ..query("a~", 50)
    };
    assert_eq!(walk(&*store, search("chat-3")).await, vec!["a~chat-3".to_owned()]);
    assert_eq!(walk(&*store, search("hat-")).await, expected);
    assert_eq!(walk(&*store, search("a~")).await, Vec::<String>::new());
    assert_eq!(walk(&*store, search("%")).await, Vec::<String>::new());
}

/// Filters by the newest dispatch's state and provider and by calls awaiting a result.
pub async fn conversation_listing_filters_by_last_dispatch_and_pending_calls(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    for id in ["waiting", "prepared", "quiet"] {
        conversation_at_1(&*store, id).await;
    }
    // `waiting`: an older dispatch, then a newer one that commits two calls.
    let (old, bytes) = manifest("op-old", "waiting", 1, "m");
    let _ = store.prepare(&old, &bytes, at(5)).await.unwrap();
    let generation = prepared_and_begun(&*store, "op-w", "waiting", 1).await;
    to_streaming(&*store, "op-w", generation).await;
    assert!(matches!(
        store
            .commit("op-w", generation, Revision(1), &assistant_turn("w", 2), at(30))
            .await
            .unwrap(),
        CommitOutcome::Committed { .. }
    ));
    let (prepared, bytes) = manifest("op-p", "prepared", 1, "m");
    let _ = store.prepare(&prepared, &bytes, at(10)).await.unwrap();

    let all = store.conversation_page(&query("", 50)).await.unwrap();
    let waiting = all
        .conversations
        .iter()
        .find(|summary| summary.conversation_id == "waiting")
        .unwrap();
    assert_eq!(
        waiting.last_dispatch,
        Some(LastDispatch {
            operation_id: "op-w".into(),
            state: DispatchState::Committed,
            provider: "sim".into()
        })
    );
    assert_eq!((waiting.revision, waiting.pending_calls), (Revision(2), 2));
    let filtered = |query: ConversationQuery| {
        let store = &store;
        async move {
            let mut found = ids(&store.conversation_page(&query).await.unwrap());
            found.sort();
            found
        }
    };
    let by_state = |state| ConversationQuery {
        state: Some(state),
        ..query("", 50)
    };
    assert_eq!(filtered(by_state(DispatchState::Committed)).await, ["waiting"]);
    assert_eq!(filtered(by_state(DispatchState::Prepared)).await, ["prepared"]);
    assert_eq!(
        filtered(by_state(DispatchState::Unknown)).await,
        Vec::<String>::new()
    );
    let by_provider = |provider: &str| ConversationQuery {
        provider: Some(provider.into()),
        ..query("", 50)
    };
    assert_eq!(filtered(by_provider("sim")).await, ["prepared", "waiting"]);
    assert_eq!(filtered(by_provider("openai")).await, Vec::<String>::new());
    let by_pending = |pending| ConversationQuery {
        pending: Some(pending),
        ..query("", 50)
    };
    assert_eq!(filtered(by_pending(PendingFilter::Some)).await, ["waiting"]);
    assert_eq!(
        filtered(by_pending(PendingFilter::None)).await,
        ["prepared", "quiet"]
    );
    // A result closes one call: one is still pending.
    let claim = match store
        .claim_call("waiting", "w-call-0", "executor", 60_000)
        .await
        .unwrap()
    {
        CallClaimOutcome::Claimed(claim) => claim.claim,
        other => panic!("claim: {other:?}"),
    };
    assert!(matches!(
        store
            .submit_tool_result(
                "waiting",
                "w-call-0",
                claim,
                "success",
                &json!([{"kind": "text", "text": "ok"}]),
                at(40)
            )
            .await
            .unwrap(),
        ResultOutcome::Appended { .. }
    ));
    let page = store
        .conversation_page(&by_pending(PendingFilter::Some))
        .await
        .unwrap();
    assert_eq!(page.conversations[0].pending_calls, 1);
}

/// The quarantine newest first, paged by row id, and only the prefix's operations.
pub async fn the_quarantine_pages_newest_first_within_a_prefix(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    for tenant in ["a~", "b~"] {
        let conversation = format!("{tenant}c");
        let operation = format!("{tenant}op");
        conversation_at_1(&*store, &conversation).await;
        let generation = prepared_and_begun(&*store, &operation, &conversation, 1).await;
        for index in 0..5 {
            let entry = QuarantineEntry {
                operation_id: operation.clone(),
                generation,
                reason: "late".into(),
                content: json!({"kind": "text", "text": format!("{tenant}{index}")}),
            };
            assert!(store.quarantine(&entry, at(100 + index)).await.unwrap());
        }
    }
    let texts = |records: &[QuarantineRecord]| -> Vec<String> {
        records
            .iter()
            .map(|record| record.entry.content["text"].as_str().unwrap().to_owned())
            .collect()
    };
    let first = store.quarantine_page("a~", None, 2).await.unwrap();
    assert_eq!(texts(&first.entries), ["a~4", "a~3"]);
    assert_eq!(first.entries[0].entry.generation, Generation(1));
    assert_eq!(first.entries[0].at, at(104));
    assert_eq!(first.next, Some(first.entries[1].id));
    let second = store.quarantine_page("a~", first.next, 2).await.unwrap();
    assert_eq!(texts(&second.entries), ["a~2", "a~1"]);
    let last = store.quarantine_page("a~", second.next, 2).await.unwrap();
    assert_eq!((texts(&last.entries), last.next), (vec!["a~0".to_owned()], None));
    let whole = store.quarantine_page("b~", None, 5).await.unwrap();
    assert_eq!((whole.entries.len(), whole.next), (5, None));
    assert!(
        store
            .quarantine_page("c~", None, 500)
            .await
            .unwrap()
            .entries
            .is_empty()
    );
}
