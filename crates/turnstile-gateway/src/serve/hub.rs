//! Client event fan-out for one dispatch: every event is kept (a bounded backlog) and
//! broadcast, so a client that attaches late with the same operation id sees the whole stream,
//! and a client that leaves loses nothing of the dispatch itself.
//!
//! The events are the driver's own typed [`DriveEvent`]s, each behind one `Arc`: the hub never
//! writes JSON, and no subscriber copies an event. JSON is written at the edges only — the
//! native SSE stream (`api::sse_response`, the spec's "client stream events") and the proxy's
//! encoders (`proxy::respond`) — and the change feed reads the typed fields ([`Hub::observed`]).

use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
pub use tokio::sync::broadcast::error::RecvError;
use turnstile_core::Generation;
use turnstile_drive::DriveEvent;

/// Most events kept for late attachers.
pub const BACKLOG_EVENTS_MAX: usize = 100_000;

/// Most finished dispatches whose tails ([`Hub::finished_tail`]) a process keeps for streams
/// resumed after the end (a few events each).
pub const FINISHED_TAILS_MAX: usize = 4096;

/// One client event, shared by every subscriber (a preview delta or a committed turn is never
/// copied per client).
pub type ClientEvent = Arc<DriveEvent>;

struct Inner {
    /// The events kept, each with its id: its ordinal in the dispatch's stream, from 1 (the
    /// native stream's SSE `id:`). Ids increase; a driver's hub numbers every event, a
    /// finished hub's tail ([`Hub::finished_tail`]) keeps the ids of the events it kept.
    backlog: Vec<(u64, ClientEvent)>,
    /// Events not kept because the backlog was full.
    dropped: u64,
    finished: bool,
    /// The target each generation's connections went to, as the pump opened them (at most one
    /// entry per attempt: bounded by the attempt budget): a proxy stream names the target
    /// whose preview opened it ([`Receiver::target_of`]).
    targets: Vec<(Generation, usize)>,
    /// The ids are this hub's own, not those a driver gave the same dispatch's events (a watch
    /// of the ledger relaying a stored outcome): a client's `Last-Event-ID` means nothing here.
    renumbered: bool,
}

/// The fan-out point. The backlog is the only copy of the events: a receiver is a cursor into
/// it, starting at its first event and woken when it grows, so a late subscriber reads the same
/// vector as an early one (nothing is copied at subscription: a full backlog is 100,000
/// events), a slow client never lags behind a fixed-size ring, and a dispatch allocates nothing
/// up front (a broadcast ring of 4,096 slots per dispatch used to cost more CPU than the rest
/// of the hub).
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
    /// The id of the event [`Receiver::recv`] or [`Receiver::try_recv`] returned last.
    id_last: u64,
}

impl Receiver {
    /// The next event; `Ok(None)` once the hub is finished and every event was read;
    /// `Err(Lagged)` only if events beyond the backlog limit were dropped (after every event
    /// the backlog kept).
    pub async fn recv(&mut self) -> Result<Option<ClientEvent>, RecvError> {
        loop {
            // Registered before looking, so a send between the look and the wait still wakes us.
            let grew = self.hub.grew.notified();
            tokio::pin!(grew);
            grew.as_mut().enable();
            {
                let inner = self.hub.lock();
                if let Some((id, event)) = inner.backlog.get(self.cursor) {
                    self.cursor += 1;
                    self.id_last = *id;
                    return Ok(Some(event.clone()));
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

    /// The target `generation`'s connections went to, if this process opened one.
    pub fn target_of(&self, generation: Generation) -> Option<usize> {
        let inner = self.hub.lock();
        inner
            .targets
            .iter()
            .find(|(opened, _)| *opened == generation)
            .map(|(_, target)| *target)
    }

    /// The next event if the hub already has it; `None` when the receiver would have to wait
    /// (or the stream ended: [`Receiver::recv`] tells which).
    pub fn try_recv(&mut self) -> Option<ClientEvent> {
        let inner = self.hub.lock();
        let (id, event) = inner.backlog.get(self.cursor).cloned()?;
        self.cursor += 1;
        self.id_last = id;
        Some(event)
    }

    /// The id of the event returned last (0 before the first): what the native stream writes
    /// as its SSE `id:`.
    pub fn id_last(&self) -> u64 {
        self.id_last
    }

    /// The id of the last event the hub has sent or dropped so far (for an event that ends a
    /// stream without being one of the hub's, such as the lagged error).
    pub fn id_sent_last(&self) -> u64 {
        let inner = self.hub.lock();
        inner.backlog.last().map_or(0, |(id, _)| *id) + inner.dropped
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
                targets: Vec::new(),
                renumbered: false,
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

    fn announce(&self, event: &DriveEvent) {
        let Some(observer) = &self.observer else { return };
        match event {
            DriveEvent::State { state, .. } => observer.feed.publish(super::feed::Change::Dispatch {
                operation_id: observer.operation_id.clone(),
                conversation_id: observer.conversation_id.clone(),
                state: state.as_str().to_owned(),
            }),
            DriveEvent::Committed { revision, .. } => {
                observer.feed.conversation(&observer.conversation_id, revision.0);
            }
            DriveEvent::Preview { .. }
            | DriveEvent::Retract { .. }
            | DriveEvent::Usage { .. }
            | DriveEvent::Error { .. } => {}
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Publish an event.
    pub fn send(&self, event: DriveEvent) {
        self.announce(&event);
        {
            let mut inner = self.lock();
            if inner.backlog.len() < BACKLOG_EVENTS_MAX {
                let id = inner.backlog.last().map_or(0, |(id, _)| *id) + 1;
                inner.backlog.push((id, Arc::new(event)));
            } else {
                inner.dropped += 1;
            }
        }
        self.grew.notify_waiters();
    }

    /// The pump opened a connection of `generation` to `target`: recorded before any of its
    /// events can be sent.
    pub fn opened(&self, generation: Generation, target: usize) {
        let mut inner = self.lock();
        if !inner.targets.iter().any(|(known, _)| *known == generation) {
            inner.targets.push((generation, target));
        }
    }

    /// The dispatch driver is done: no more events.
    pub fn finish(&self) {
        self.lock().finished = true;
        self.grew.notify_waiters();
    }

    /// A receiver of the whole stream: every event so far, then what follows, then the end
    /// (`Ok(None)`). It reads the shared backlog by cursor, so there is no seam between
    /// "backlog" and "live" for an event to fall into, and subscribing copies nothing.
    pub fn subscribe(self: &Arc<Self>) -> Receiver {
        self.subscribe_after(None)
    }

    /// A receiver of the events after the one whose id is `id_seen` (a client's
    /// `Last-Event-ID`), or of the whole stream when that is not an id this hub has sent: none
    /// given, greater than the last id sent so far, or the hub is [`Hub::renumbered`].
    /// Resuming never repeats an event, and never skips one the hub still has.
    pub fn subscribe_after(self: &Arc<Self>, id_seen: Option<u64>) -> Receiver {
        let cursor = {
            let inner = self.lock();
            let id_sent_last = inner.backlog.last().map_or(0, |(id, _)| *id);
            match id_seen {
                Some(seen) if !inner.renumbered && seen <= id_sent_last => {
                    inner.backlog.partition_point(|(id, _)| *id <= seen)
                }
                _ => 0,
            }
        };
        Receiver {
            hub: self.clone(),
            cursor,
            id_last: 0,
        }
    }

    /// Mark this hub's ids as its own (a watch relaying a stored outcome under new ids), so a
    /// client's `Last-Event-ID` is ignored by [`Hub::subscribe_after`].
    pub fn renumbered(&self) {
        self.lock().renumbered = true;
    }

    /// Whether the hub is finished (no more events).
    pub fn is_finished(&self) -> bool {
        self.lock().finished
    }

    /// What a client reconnecting to this finished dispatch still needs, under the same ids:
    /// its state changes, retractions, commit and errors, without its previews (revocable, and
    /// what was committed is in the commit). Kept after the dispatch's hub is gone, so that a
    /// reconnect with a `Last-Event-ID` gets exactly the terminal events it missed, at a small
    /// fraction of the backlog's size.
    pub fn finished_tail(&self) -> Hub {
        let inner = self.lock();
        let backlog = inner
            .backlog
            .iter()
            .filter(|(_, event)| !matches!(**event, DriveEvent::Preview { .. } | DriveEvent::Usage { .. }))
            .cloned()
            .collect();
        Hub {
            inner: Mutex::new(Inner {
                backlog,
                dropped: inner.dropped,
                finished: true,
                targets: inner.targets.clone(),
                renumbered: inner.renumbered,
            }),
            grew: Notify::new(),
            observer: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnstile_core::dispatch::DispatchState;
    use turnstile_core::{Generation, Revision};

    fn preview(number: u64) -> DriveEvent {
        DriveEvent::Preview {
            generation: Generation(1),
            block_index: 0,
            delta: number.to_string(),
        }
    }

    fn number_of(event: &DriveEvent) -> Option<u64> {
        match event {
            DriveEvent::Preview { delta, .. } => delta.parse().ok(),
            _ => None,
        }
    }

    /// Every event of `receiver` until the end, and how it ended.
    async fn read_all(receiver: &mut Receiver) -> (Vec<ClientEvent>, Result<(), RecvError>) {
        let mut seen = Vec::new();
        loop {
            match receiver.recv().await {
                Ok(Some(event)) => seen.push(event),
                Ok(None) => return (seen, Ok(())),
                Err(error) => return (seen, Err(error)),
            }
        }
    }

    #[tokio::test]
    async fn a_receiver_sees_every_event_in_order_however_late_or_slow_it_is() {
        let hub = Arc::new(Hub::new());
        hub.send(DriveEvent::State {
            state: DispatchState::Dispatching,
            generation: Some(Generation(1)),
        });
        // Subscribed after the first event, while the stream goes on.
        let mut early = hub.subscribe();
        let sender = {
            let hub = hub.clone();
            tokio::spawn(async move {
                for number in 1..=10_000 {
                    hub.send(preview(number));
                    if number % 1000 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                hub.finish();
            })
        };
        let (seen, ended) = read_all(&mut early).await;
        sender.await.unwrap();
        assert!(ended.is_ok());
        assert!(matches!(*seen[0], DriveEvent::State { .. }));
        let numbers: Vec<u64> = seen[1..].iter().filter_map(|event| number_of(event)).collect();
        assert_eq!(numbers, (1..=10_000).collect::<Vec<u64>>());
        assert_eq!(seen.len(), 10_001);
        // A late subscriber reads the same events (the same allocations: nothing is copied per
        // subscriber) and then the end.
        let mut late = hub.subscribe();
        let (again, ended) = read_all(&mut late).await;
        assert!(ended.is_ok());
        assert_eq!(again.len(), seen.len());
        assert!(again.iter().zip(&seen).all(|(a, b)| Arc::ptr_eq(a, b)));
        assert!(matches!(late.recv().await, Ok(None)));
    }

    #[tokio::test]
    async fn a_subscriber_between_two_sends_loses_nothing_of_either() {
        let hub = Arc::new(Hub::new());
        let mut readers = Vec::new();
        for number in 0..100 {
            readers.push(hub.subscribe());
            hub.send(preview(number));
        }
        hub.finish();
        for mut reader in readers {
            let (seen, ended) = read_all(&mut reader).await;
            assert!(ended.is_ok());
            let numbers: Vec<u64> = seen.iter().filter_map(|event| number_of(event)).collect();
            assert_eq!(numbers, (0..100).collect::<Vec<u64>>());
        }
    }

    #[tokio::test]
    async fn events_beyond_the_backlog_limit_end_every_reader_with_lagged_after_what_was_kept() {
        let hub = Arc::new(Hub::new());
        for number in 0..BACKLOG_EVENTS_MAX as u64 + 3 {
            hub.send(preview(number));
        }
        hub.finish();
        let mut reader = hub.subscribe();
        let (seen, ended) = read_all(&mut reader).await;
        assert_eq!(seen.len(), BACKLOG_EVENTS_MAX);
        assert!(matches!(ended, Err(RecvError::Lagged(3))));
    }

    #[tokio::test]
    async fn an_observed_hub_announces_states_and_commits_from_the_typed_fields() {
        let feed = Arc::new(super::super::feed::Feed::new());
        let mut changes = feed.changes();
        let hub = Hub::observed(feed.clone(), "t~c1", "t~op1");
        hub.send(DriveEvent::State {
            state: DispatchState::Streaming,
            generation: Some(Generation(2)),
        });
        hub.send(preview(1));
        hub.send(DriveEvent::Committed {
            revision: Revision(4),
            turn: serde_json::json!({"revision": 4}),
            facts: None,
        });
        hub.finish();
        match changes.try_recv() {
            Ok(super::super::feed::Change::Dispatch {
                operation_id,
                conversation_id,
                state,
            }) => assert_eq!(
                (operation_id.as_str(), conversation_id.as_str(), state.as_str()),
                ("t~op1", "t~c1", "STREAMING")
            ),
            other => panic!("expected the state change, got {other:?}"),
        }
        match changes.try_recv() {
            Ok(super::super::feed::Change::Conversation {
                conversation_id,
                revision,
            }) => assert_eq!((conversation_id.as_str(), revision), ("t~c1", 4)),
            other => panic!("expected the commit, got {other:?}"),
        }
        // The preview was not announced: the feed carries ids and states only.
        assert!(changes.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_receiver_after_a_seen_id_gets_the_events_after_it_and_an_unknown_id_gets_all() {
        let hub = Arc::new(Hub::new());
        for number in 1..=5 {
            hub.send(preview(number));
        }
        hub.finish();
        let numbers = |mut receiver: Receiver| async move {
            let (seen, ended) = read_all(&mut receiver).await;
            assert!(ended.is_ok());
            (
                seen.iter()
                    .filter_map(|event| number_of(event))
                    .collect::<Vec<u64>>(),
                receiver.id_last(),
            )
        };
        // Ids are ordinals from 1: event `n` is id `n` here.
        assert_eq!(numbers(hub.subscribe_after(Some(3))).await, (vec![4, 5], 5));
        assert_eq!(numbers(hub.subscribe_after(Some(5))).await, (vec![], 0));
        assert_eq!(
            numbers(hub.subscribe_after(Some(0))).await,
            (vec![1, 2, 3, 4, 5], 5)
        );
        // Not an id this hub has sent: the whole stream.
        assert_eq!(
            numbers(hub.subscribe_after(Some(6))).await,
            (vec![1, 2, 3, 4, 5], 5)
        );
        // A renumbered hub's ids are not the ones a client has seen.
        let watch = Arc::new(Hub::new());
        watch.send(preview(1));
        watch.renumbered();
        watch.finish();
        assert_eq!(numbers(watch.subscribe_after(Some(1))).await, (vec![1], 1));
    }

    #[tokio::test]
    async fn a_finished_tail_keeps_the_terminal_events_under_their_first_ids() {
        let hub = Arc::new(Hub::new());
        hub.send(DriveEvent::State {
            state: DispatchState::Streaming,
            generation: Some(Generation(1)),
        });
        hub.send(preview(1));
        hub.send(preview(2));
        hub.send(DriveEvent::Committed {
            revision: Revision(2),
            turn: serde_json::json!({"revision": 2}),
            facts: None,
        });
        hub.finish();
        let tail = Arc::new(hub.finished_tail());
        let mut all = tail.subscribe();
        let (seen, ended) = read_all(&mut all).await;
        assert!(ended.is_ok());
        assert_eq!(seen.len(), 2);
        assert!(matches!(*seen[1], DriveEvent::Committed { .. }));
        assert_eq!(all.id_last(), 4);
        // After a preview's id: the commit only, once.
        let mut after = tail.subscribe_after(Some(2));
        let (seen, _) = read_all(&mut after).await;
        assert_eq!(seen.len(), 1);
        assert!(matches!(*seen[0], DriveEvent::Committed { .. }));
        // After the commit's id: nothing.
        let mut done = tail.subscribe_after(Some(4));
        assert!(matches!(done.recv().await, Ok(None)));
    }
}
