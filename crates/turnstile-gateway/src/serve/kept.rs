//! Stored conversations kept decoded in memory between dispatches (issue 21), so an agent
//! loop's next dispatch reads, decodes and checks only the turns committed since the last one.
//!
//! A dispatch of a stored conversation takes its [`KeptConversation`] out of this cache and
//! asks the store for what happened after the kept revision (`Ledger::conversation_since`, one
//! read of the new turns), pushes those turns (decode, validator state, message sequence: each
//! for the cost of the turn), and puts it back after the dispatch. The store stays the truth:
//! the kept history is used only when the store's turn at the kept revision has the id of the
//! kept history's last turn and the store holds exactly the turns after it; anything else (an
//! unknown conversation, a store behind the kept revision, a gap) reads the whole document, as
//! every dispatch did before. A kept entry is keyed by the store's conversation id (tenant
//! prefix included) and holds exactly the committed history at its revision, which never
//! changes once committed (the revision CAS), so another replica's appends only make it older,
//! never wrong.
//!
//! Every stored turn is checked against the digest stored beside it as it is decoded here, once:
//! on the whole read and for each turn of a tail, never again for a kept one. A mismatch (a
//! changed byte in the store) refuses the dispatch with `stored_history_corrupt` before it is
//! prepared, so nothing is sent, and drops the kept history ([`check_turns`]).
//!
//! Bounds: [`KeptConversations::ENTRIES_MAX`] conversations and
//! [`KeptConversations::BYTES_MAX`] bytes of their JSON (an estimate from the stored turns),
//! least recently used out first. A conversation bigger than the byte bound is not kept.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a gateway's kept history is used only as the store's history: the kept revision's turn has the
//!   kept last turn's id and the tail is every turn after it, else the whole document is read; the
//!   bytes it renders are a fresh replica's. Enforced in `gateway/src/serve/kept.rs` (`current`),
//!   `store/src/ops.rs::conversation_since`. Tests:
//!   `gateway/tests/it/serve.rs::an_agent_loop_reads_only_the_new_turns_and_sends_what_a_fresh_replica_sends`
//!   (SQLite and PostgreSQL; a turn appended by another replica; red with a tail turn skipped or
//!   the kept path never taken), `gateway/src/serve/kept.rs::tests` (another history under the same
//!   id, one ahead of the store: the store's is read whole; bounds, LRU, the newer of two kept),
//!   `store/tests/it/conformance.rs::a_reader_s_tail_is_the_turns_after_its_revision…`.

use super::Shared;
use super::api::{ApiError, ErrorCode};
use axum::http::StatusCode;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use turnstile_core::conversation::Turn;
use turnstile_core::{Conversation, KeptConversation};

/// The cache. `take` and `put` lock only to move an entry in or out.
#[derive(Default)]
pub struct KeptConversations {
    inner: Mutex<Inner>,
    hits: AtomicU64,
    misses: AtomicU64,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    bytes: usize,
    clock: u64,
}

struct Entry {
    kept: KeptConversation,
    bytes: usize,
    used: u64,
}

/// A conversation as a dispatch uses it: kept, with the estimate of its size.
pub struct Current {
    pub kept: KeptConversation,
    pub bytes: usize,
}

impl KeptConversations {
    /// Most conversations kept.
    pub const ENTRIES_MAX: usize = 256;
    /// Most bytes kept (estimated from the stored JSON).
    pub const BYTES_MAX: usize = 256 * 1024 * 1024;

    /// (dispatches that used a kept history, dispatches that read the whole one).
    pub fn stats(&self) -> (u64, u64) {
        (
            self.hits.load(Ordering::Relaxed),
            self.misses.load(Ordering::Relaxed),
        )
    }

    fn take(&self, conversation_id: &str) -> Option<Current> {
        let mut inner = self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let entry = inner.entries.remove(conversation_id)?;
        inner.bytes -= entry.bytes;
        Some(Current {
            kept: entry.kept,
            bytes: entry.bytes,
        })
    }

    /// Keep `current` for the next dispatch of `conversation_id` (a newer one of the same id
    /// put meanwhile by a concurrent dispatch stays).
    pub fn put(&self, conversation_id: &str, current: Current) {
        if current.bytes > Self::BYTES_MAX {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        inner.clock += 1;
        let used = inner.clock;
        if let Some(existing) = inner.entries.get(conversation_id)
            && existing.kept.conversation().revision >= current.kept.conversation().revision
        {
            return;
        }
        if let Some(replaced) = inner.entries.insert(
            conversation_id.to_owned(),
            Entry {
                kept: current.kept,
                bytes: current.bytes,
                used,
            },
        ) {
            inner.bytes -= replaced.bytes;
        }
        inner.bytes += current.bytes;
        while inner.entries.len() > Self::ENTRIES_MAX || inner.bytes > Self::BYTES_MAX {
            let Some(oldest) = inner
                .entries
                .iter()
                .min_by_key(|(_, entry)| entry.used)
                .map(|(id, _)| id.clone())
            else {
                break;
            };
            if let Some(evicted) = inner.entries.remove(&oldest) {
                inner.bytes -= evicted.bytes;
            }
        }
    }
}

/// The stored conversation `conversation_id` as the store has it now, from the kept history
/// plus the turns committed since when possible, else from the whole document. `None`: no
/// such conversation.
pub async fn current(shared: &Shared, conversation_id: &str) -> Result<Option<Current>, ApiError> {
    current_in(&shared.kept, shared.ledger.as_ref(), conversation_id).await
}

/// [`current`] against one cache and one store.
async fn current_in(
    cache: &KeptConversations,
    ledger: &dyn turnstile_store::Ledger,
    conversation_id: &str,
) -> Result<Option<Current>, ApiError> {
    if let Some(mut current) = cache.take(conversation_id) {
        let revision = current.kept.conversation().revision;
        let tail = ledger
            .conversation_since(conversation_id, revision)
            .await
            .map_err(ApiError::store)?;
        let Some(tail) = tail else {
            return Ok(None);
        };
        let last_id = current
            .kept
            .conversation()
            .turns
            .last()
            .and_then(|turn| turn.id.as_deref());
        let continues = tail.revision >= revision
            && tail.turn_id_at.as_deref() == last_id
            && tail.turns.len() as u64 == tail.revision.0 - revision.0;
        if continues {
            let mut readable = true;
            for (turn, stored_digest) in tail.turns.into_iter().zip(&tail.turn_digests) {
                current.bytes += value_bytes(&turn);
                if current.kept.push_turn(turn, tail.revision).is_err() {
                    readable = false;
                    break;
                }
                // The turn just pushed, checked as it was decoded; the kept ones were checked
                // when they were read. A mismatch drops the kept history (it is not put back).
                let pushed = current.kept.conversation().turns.last();
                check_turns(conversation_id, pushed.into_iter(), [stored_digest])?;
            }
            if readable {
                cache.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(Some(current));
            }
        }
    }
    cache.misses.fetch_add(1, Ordering::Relaxed);
    let Some(stored) = ledger
        .conversation_with_digests(conversation_id)
        .await
        .map_err(ApiError::store)?
    else {
        return Ok(None);
    };
    let bytes = value_bytes(&stored.document);
    let conversation = Conversation::from_value(stored.document).map_err(|error| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::StoredHistoryUnreadable,
            error.to_string(),
        )
    })?;
    check_turns(conversation_id, conversation.turns.iter(), &stored.turn_digests)?;
    Ok(Some(Current {
        kept: KeptConversation::new(conversation),
        bytes,
    }))
}

/// Each decoded stored turn against the digest stored beside it (issue 49 item 7): the first
/// that differs refuses the dispatch with `stored_history_corrupt` (500), counted in
/// `turnstile_stored_history_corrupt_total`, before anything is prepared or sent. A turn stored
/// without a digest (a row written before migration 12) is taken as it is. The cost is
/// [`Turn::digest`] per turn read: a hash of its block digests, which the decode computed.
fn check_turns<'a>(
    conversation_id: &str,
    turns: impl Iterator<Item = &'a Turn>,
    stored_digests: impl IntoIterator<Item = &'a Option<String>>,
) -> Result<(), ApiError> {
    for (turn, stored) in turns.zip(stored_digests) {
        let Some(stored) = stored else { continue };
        let digest = turn.digest();
        if digest.as_str() == stored {
            continue;
        }
        let revision = turn.revision.map_or(0, |revision| revision.0);
        tracing::error!(
            conversation_id,
            revision,
            stored = %stored,
            read = %digest,
            "a stored turn does not match the digest stored with it; the dispatch is refused, nothing sent"
        );
        super::metrics::bump(super::metrics::STORED_HISTORY_CORRUPT);
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::StoredHistoryCorrupt,
            format!(
                "the stored turn at revision {revision} does not match the digest stored with it; nothing was sent"
            ),
        ));
    }
    Ok(())
}

/// An estimate of a JSON value's size: its strings' bytes and a few per node (what the decoded
/// conversation holds grows with it).
fn value_bytes(value: &Value) -> usize {
    match value {
        Value::String(text) => text.len() + 8,
        Value::Array(items) => 8 + items.iter().map(value_bytes).sum::<usize>(),
        Value::Object(map) => {
            8 + map
                .iter()
                .map(|(key, value)| key.len() + value_bytes(value))
                .sum::<usize>()
        }
        _ => 8,
    }
}

#[cfg(test)]
mod tests {
    //! The fallback rules of [`current_in`] against a real SQLite store: a kept history is used
    //! only when the store continues it; a kept history the store does not hold (another
    //! history under the same id, one ahead of the store) is replaced by the store's.

    use super::*;
    use serde_json::json;
    use turnstile_core::Revision;
    use turnstile_core::dispatch::Timestamp;
    use turnstile_store::{AppendOutcome, Ledger, SqliteLedger, Synchronous};

    fn user(id: &str) -> Value {
        json!({"id": id, "role": "user", "blocks": [{"id": format!("{id}-b"), "kind": "text", "text": "hi"}]})
    }

    async fn append(store: &SqliteLedger, at: u64, id: &str) {
        let outcome = store
            .append_turn("c", Revision(at), &user(id), Timestamp(at + 10))
            .await
            .unwrap();
        assert!(matches!(outcome, AppendOutcome::Appended { .. }), "{outcome:?}");
    }

    /// A kept conversation "c" at `revision` with these turn ids (not the store's).
    fn foreign(revision: u64, ids: &[&str]) -> Current {
        let turns: Vec<Value> = ids
            .iter()
            .enumerate()
            .map(|(index, id)| {
                let mut turn = user(id);
                turn["revision"] = json!(index as u64 + 1);
                turn
            })
            .collect();
        let document = json!({"format": turnstile_core::conversation::FORMAT_V1, "conversation_id": "c",
                              "revision": revision, "tools": [], "turns": turns});
        Current {
            kept: KeptConversation::new(Conversation::from_value(document).unwrap()),
            bytes: 100,
        }
    }

    fn ids(current: &Current) -> Vec<String> {
        current
            .kept
            .conversation()
            .turns
            .iter()
            .map(|turn| turn.id.clone().unwrap())
            .collect()
    }

    #[tokio::test]
    async fn a_kept_history_is_used_only_when_the_store_continues_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteLedger::open(dir.path().join("kept.db"), Synchronous::Full).unwrap();
        store
            .create_conversation("c", &json!([]), Timestamp(1))
            .await
            .unwrap();
        append(&store, 0, "u1").await;
        append(&store, 1, "u2").await;
        let cache = KeptConversations::default();
        assert!(current_in(&cache, &store, "nowhere").await.unwrap().is_none());
        let first = current_in(&cache, &store, "c").await.unwrap().unwrap();
        assert_eq!(
            (ids(&first), cache.stats()),
            (vec!["u1".into(), "u2".into()], (0, 2))
        );
        cache.put("c", first);

        // The store continues the kept history: only the new turn is read.
        append(&store, 2, "u3").await;
        let next = current_in(&cache, &store, "c").await.unwrap().unwrap();
        assert_eq!(ids(&next), ["u1", "u2", "u3"]);
        assert_eq!(cache.stats(), (1, 2), "read through the kept history");
        assert_eq!(next.kept.conversation().revision, Revision(3));
        assert_eq!(next.kept.verdict(), turnstile_core::Verdict::Ready);
        cache.put("c", next);

        // Another history under the same id at the same revision: the store's is read whole.
        let _ = cache.take("c");
        cache.put("c", foreign(3, &["x1", "x2", "x3"]));
        let replaced = current_in(&cache, &store, "c").await.unwrap().unwrap();
        assert_eq!(
            (ids(&replaced), cache.stats()),
            (vec!["u1".into(), "u2".into(), "u3".into()], (1, 3))
        );

        // A kept history ahead of the store (its turn at revision 5 is not in the store).
        let _ = cache.take("c");
        cache.put("c", foreign(5, &["u1", "u2", "u3", "u4", "u5"]));
        let behind = current_in(&cache, &store, "c").await.unwrap().unwrap();
        assert_eq!(
            (ids(&behind), cache.stats()),
            (vec!["u1".into(), "u2".into(), "u3".into()], (1, 4))
        );
        assert_eq!(behind.kept.conversation().revision, Revision(3));
    }

    #[test]
    fn the_cache_keeps_to_its_bounds_and_keeps_the_newer_of_two() {
        let cache = KeptConversations::default();
        cache.put("c", foreign(2, &["a", "b"]));
        cache.put("c", foreign(1, &["a"]));
        assert_eq!(
            ids(&cache.take("c").unwrap()),
            ["a", "b"],
            "an older history does not replace a newer one"
        );
        for index in 0..KeptConversations::ENTRIES_MAX + 10 {
            cache.put(&format!("c-{index}"), foreign(1, &["a"]));
        }
        let inner = cache.inner.lock().unwrap();
        assert_eq!(inner.entries.len(), KeptConversations::ENTRIES_MAX);
        assert!(
            !inner.entries.contains_key("c-0"),
            "the least recently used went first"
        );
        assert_eq!(inner.bytes, 100 * KeptConversations::ENTRIES_MAX);
    }
}
