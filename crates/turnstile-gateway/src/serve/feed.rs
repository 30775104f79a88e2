//! The change feed: `GET /v1/events`, a tenant-scoped SSE stream that says "conversation X is at
//! revision N" and "dispatch Y is in state S" as they happen in this process, so a page can
//! re-read exactly what changed instead of polling everything.
//!
//! It carries ids and states only, never content: a subscriber re-reads the conversation or
//! dispatch through the ordinary API with its own token. Publishers are the API's writes
//! (create, turn, tool result), the proxy's refusals and shadow records (`event: proxy`), and every dispatch hub ([`super::hub::Hub::observed`]: its
//! `state` and `committed` events, including hubs that watch a dispatch another replica drives).
//!
//! Bounds: one broadcast ring of [`FEED_RING_EVENTS`] for the whole process (a subscriber that
//! falls further behind gets `event: resync` and re-reads its view instead of a silent gap), at
//! most [`FEED_SUBSCRIBERS_MAX`] subscribers (the next is 503 `overloaded`), and a comment line
//! every [`FEED_KEEPALIVE`] so proxies do not cut an idle stream.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - the change feed carries only the subscriber's tenant's ids, and no content. Enforced in
//!   `serve/feed.rs::client_event`. Tests: `feed.rs::tests::a_tenant_sees_only_its_own_changes…`,
//!   `console_api.rs::the_change_feed_announces_a_tenants_own…` (red with other tenants' ids let
//!   through).

use super::Shared;
use super::api::{ApiError, ApiResult, ErrorCode, caller};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::broadcast;

/// Changes kept for subscribers that are behind (one ring per process, ~100 bytes each).
pub const FEED_RING_EVENTS: usize = 4096;
/// Most concurrent subscribers.
pub const FEED_SUBSCRIBERS_MAX: usize = 256;
/// Interval of the keep-alive comment.
pub const FEED_KEEPALIVE: Duration = Duration::from_secs(15);

/// One change, in store ids.
#[derive(Clone, Debug)]
pub enum Change {
    /// The conversation's committed history changed (created, turn, tool result, commit).
    Conversation {
        /// Store id.
        conversation_id: String,
        /// Its revision after the change.
        revision: u64,
    },
    /// A dispatch changed state.
    Dispatch {
        /// Store operation id.
        operation_id: String,
        /// Store id of its conversation.
        conversation_id: String,
        /// Its new state.
        state: String,
    },
    /// A proxy request was refused, or a shadow comparison was recorded (`kind`).
    Proxy {
        /// The tenant's store-id prefix.
        tenant_prefix: String,
        /// `refusal` or `shadow`.
        kind: &'static str,
    },
}

/// The process's feed.
pub struct Feed {
    sender: broadcast::Sender<Change>,
    subscribers: Arc<AtomicUsize>,
}

impl Default for Feed {
    fn default() -> Feed {
        Feed::new()
    }
}

impl Feed {
    /// An empty feed.
    pub fn new() -> Feed {
        Feed {
            sender: broadcast::channel(FEED_RING_EVENTS).0,
            subscribers: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Publish a change (nobody listening is fine).
    pub fn publish(&self, change: Change) {
        let _ = self.sender.send(change);
    }

    /// A receiver of the changes published from now on.
    pub fn changes(&self) -> broadcast::Receiver<Change> {
        self.sender.subscribe()
    }

    /// A conversation is at `revision`.
    pub fn conversation(&self, conversation_id: &str, revision: u64) {
        self.publish(Change::Conversation {
            conversation_id: conversation_id.to_owned(),
            revision,
        });
    }
}

/// Releases a subscriber's slot when its stream ends.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The change as the caller sees it (own ids), or `None` for another tenant's.
fn client_event(prefix: &str, change: &Change) -> Option<(&'static str, Value)> {
    match change {
        Change::Conversation {
            conversation_id,
            revision,
        } => {
            let id = conversation_id.strip_prefix(prefix)?;
            Some((
                "conversation",
                json!({"conversation_id": id, "revision": revision}),
            ))
        }
        Change::Dispatch {
            operation_id,
            conversation_id,
            state,
        } => {
            let operation = operation_id.strip_prefix(prefix)?;
            let conversation = conversation_id.strip_prefix(prefix)?;
            Some((
                "dispatch",
                json!({"operation_id": operation, "conversation_id": conversation, "state": state}),
            ))
        }
        Change::Proxy { tenant_prefix, kind } => {
            (tenant_prefix == prefix).then(|| ("proxy", json!({"kind": kind})))
        }
    }
}

fn frame(event: &str, data: &Value) -> Result<Bytes, Infallible> {
    Ok(Bytes::from(format!("event: {event}\ndata: {data}\n\n")))
}

/// `GET /v1/events`: `event: ready` first (subscribed; what happens from here on is sent), then
/// `conversation` / `dispatch` changes of the caller's tenant, `resync` after a gap.
pub async fn events(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> ApiResult {
    let caller = caller(&shared, &headers)?;
    let feed = &shared.feed;
    if feed.subscribers.fetch_add(1, Ordering::AcqRel) >= FEED_SUBSCRIBERS_MAX {
        feed.subscribers.fetch_sub(1, Ordering::AcqRel);
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Overloaded,
            format!("at most {FEED_SUBSCRIBERS_MAX} change-feed subscribers"),
        ));
    }
    let slot = Slot(feed.subscribers.clone());
    let mut receiver = feed.changes();
    let prefix = caller.store_id("");
    let (sender, out) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(64);
    let drain = shared.drain.clone();
    tokio::spawn(async move {
        let _slot = slot;
        // A shutting-down process ends its feeds (an idle console tab would otherwise hold
        // the shutdown for the whole drain); the page subscribes again elsewhere.
        let draining = drain.reached(super::drain::Phase::Draining);
        tokio::pin!(draining);
        if sender.send(frame("ready", &json!({}))).await.is_err() {
            return;
        }
        let mut keepalive = tokio::time::interval(FEED_KEEPALIVE);
        keepalive.tick().await;
        loop {
            let next = tokio::select! {
                received = receiver.recv() => received,
                _ = keepalive.tick() => {
                    if sender.send(Ok(Bytes::from_static(b": keep-alive\n\n"))).await.is_err() {
                        return;
                    }
                    continue;
                }
                () = sender.closed() => return,
                () = &mut draining => return,
            };
            let bytes = match next {
                Ok(change) => match client_event(&prefix, &change) {
                    Some((event, data)) => frame(event, &data),
                    None => continue,
                },
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    frame("resync", &json!({"missed": missed}))
                }
                Err(broadcast::error::RecvError::Closed) => return,
            };
            if sender.send(bytes).await.is_err() {
                return;
            }
        }
    });
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(
            out,
        )))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_sees_only_its_own_changes_under_its_own_ids() {
        let theirs = Change::Conversation {
            conversation_id: "b~c1".into(),
            revision: 3,
        };
        assert!(client_event("a~", &theirs).is_none());
        let ours = Change::Dispatch {
            operation_id: "a~op".into(),
            conversation_id: "a~c1".into(),
            state: "STREAMING".into(),
        };
        let (event, data) = client_event("a~", &ours).unwrap();
        assert_eq!(event, "dispatch");
        assert_eq!(
            data,
            json!({"operation_id": "op", "conversation_id": "c1", "state": "STREAMING"})
        );
        // A dispatch of ours on another tenant's conversation cannot exist; if it did, hidden.
        let mixed = Change::Dispatch {
            operation_id: "a~op".into(),
            conversation_id: "b~c1".into(),
            state: "SENT".into(),
        };
        assert!(client_event("a~", &mixed).is_none());
    }
}
