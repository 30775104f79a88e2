//! Client event fan-out for one dispatch: every event is kept (a bounded backlog) and
//! broadcast, so a client that attaches late with the same operation id sees the whole stream,
//! and a client that leaves loses nothing of the dispatch itself.

use serde_json::Value;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
pub use tokio::sync::broadcast::error::RecvError;

/// Most events kept for late attachers.
pub const BACKLOG_EVENTS_MAX: usize = 100_000;

/// One client event: the SSE `event:` name and its JSON data.
pub type ClientMessage = (&'static str, Value);

struct Inner {
    backlog: Vec<ClientMessage>,
    /// Events not kept because the backlog was full.
    dropped: u64,
    finished: bool,
}

/// The fan-out point. The backlog is the only copy of the events: a receiver is a cursor into
/// it, woken when it grows, so a slow client never lags behind a fixed-size ring (and a dispatch
/// allocates nothing up front — a broadcast ring of 4,096 slots per dispatch used to cost more
/// CPU than the rest of the hub).
pub struct Hub {
    inner: Mutex<Inner>,
    grew: Notify,
    /// Where its `state` and `committed` events are also announced ([`Hub::observed`]).
    observer: Option<Observer>,
}

/// The change feed and the store ids a hub announces its dispatch's changes under.
struct Observer {
    feed: Arc<super::feed::Feed>,
    conversation_id: String,
    operation_id: String,
}

impl Default for Hub {
    fn default() -> Hub {
        Hub::new()
    }
}

/// A subscriber's position in the hub's events.
pub struct Receiver {
    hub: Arc<Hub>,
    cursor: usize,
}

impl Receiver {
    /// The next event; `Ok(None)` once the hub is finished and every event was read;
    /// `Err(Lagged)` only if events beyond the backlog limit were dropped.
    pub async fn recv(&mut self) -> Result<Option<ClientMessage>, RecvError> {
        loop {
            // Registered before looking, so a send between the look and the wait still wakes us.
            let grew = self.hub.grew.notified();
            tokio::pin!(grew);
            grew.as_mut().enable();
            {
                let inner = self.hub.lock();
                if let Some(message) = inner.backlog.get(self.cursor) {
                    self.cursor += 1;
                    return Ok(Some(message.clone()));
                }
                if inner.dropped > 0 {
                    return Err(RecvError::Lagged(inner.dropped));
                }
                if inner.finished {
                    return Ok(None);
                }
            }
            grew.await;
        }
    }
}

impl Hub {
    /// An empty hub.
    pub fn new() -> Hub {
        Hub {
            inner: Mutex::new(Inner {
                backlog: Vec::new(),
                dropped: 0,
                finished: false,
            }),
            grew: Notify::new(),
            observer: None,
        }
    }

    /// A hub whose dispatch's state changes and commit are also published on the change feed
    /// (ids only; subscribers re-read through the API).
    pub fn observed(feed: Arc<super::feed::Feed>, conversation_id: &str, operation_id: &str) -> Hub {
        Hub {
            observer: Some(Observer {
                feed,
                conversation_id: conversation_id.to_owned(),
                operation_id: operation_id.to_owned(),
            }),
            ..Hub::new()
        }
    }

    fn announce(&self, event: &str, data: &Value) {
        let Some(observer) = &self.observer else { return };
        match event {
            "state" => {
                if let Some(state) = data["state"].as_str() {
                    observer.feed.publish(super::feed::Change::Dispatch {
                        operation_id: observer.operation_id.clone(),
                        conversation_id: observer.conversation_id.clone(),
                        state: state.to_owned(),
                    });
                }
            }
            "committed" => {
                if let Some(revision) = data["revision"].as_u64() {
                    observer.feed.conversation(&observer.conversation_id, revision);
                }
            }
            _ => {}
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Publish an event.
    pub fn send(&self, event: &'static str, data: Value) {
        self.announce(event, &data);
        {
            let mut inner = self.lock();
            if inner.backlog.len() < BACKLOG_EVENTS_MAX {
                inner.backlog.push((event, data));
            } else {
                inner.dropped += 1;
            }
        }
        self.grew.notify_waiters();
    }

    /// The dispatch driver is done: no more events.
    pub fn finish(&self) {
        self.lock().finished = true;
        self.grew.notify_waiters();
    }

    /// Everything so far, and a receiver for what follows (`None` marks the end). Taken under
    /// one lock so no event falls between the two.
    pub fn subscribe(self: &Arc<Self>) -> (Vec<ClientMessage>, bool, Receiver) {
        let inner = self.lock();
        let receiver = Receiver {
            hub: self.clone(),
            cursor: inner.backlog.len(),
        };
        (inner.backlog.clone(), inner.finished, receiver)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[tokio::test]
    async fn a_receiver_sees_every_event_after_its_backlog_in_order_however_slow_it_is() {
        let hub = Arc::new(Hub::new());
        hub.send("state", json!(0));
        let (backlog, finished, mut receiver) = hub.subscribe();
        assert_eq!((backlog.len(), finished), (1, false));
        let sender = {
            let hub = hub.clone();
            tokio::spawn(async move {
                for number in 1..=10_000 {
                    hub.send("preview", json!(number));
                    if number % 1000 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                hub.finish();
            })
        };
        let mut seen = Vec::new();
        while let Ok(Some((_, data))) = receiver.recv().await {
            seen.push(data.as_u64().unwrap());
        }
        sender.await.unwrap();
        assert_eq!(seen, (1..=10_000).collect::<Vec<u64>>());
        // A late subscriber gets the whole backlog and an immediate end.
        let (backlog, finished, mut late) = hub.subscribe();
        assert_eq!((backlog.len(), finished), (10_001, true));
        assert!(matches!(late.recv().await, Ok(None)));
    }
}
