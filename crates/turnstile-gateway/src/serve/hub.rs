//! Client event fan-out for one dispatch: every event is kept (a bounded backlog) and
//! broadcast, so a client that attaches late with the same operation id sees the stream, and a
//! client that leaves loses nothing of the dispatch itself.
//!
//! The events are the driver's own typed [`DriveEvent`]s, each behind one `Arc`: the hub never
//! writes JSON, and no subscriber copies an event. JSON is written at the edges only — the
//! native SSE stream (`api::sse_response`, the spec's "client stream events") and the proxy's
//! encoders (`proxy::respond`) — and the change feed reads the typed fields ([`Hub::observed`]).
//!
//! Bounds. The backlog keeps at most `previews_max` previews (config
//! `stream_backlog_previews_max`, default [`BACKLOG_PREVIEWS_MAX`]: 100,000 previews of about
//! 330 bytes each, ~33 MB, a long answer of 64k–128k output tokens at one or two tokens per
//! delta). Past it the *oldest* previews are dropped; every other event (state changes,
//! retractions, usage, the commit, errors: a few per attempt, bounded by the driver's attempt
//! budget) is kept whatever happens, so the end of a dispatch always reaches a client that is
//! still attached. A client whose position fell behind the dropped previews reads a typed gap
//! ([`Next::Gap`]) in their place and goes on; revocable text is all it misses, and the commit
//! carries the whole turn. The same drop happens when the process-wide output budget needs the
//! room (`budget.rs`: a hub is a [`Backlog`]): what a hub holds counts against
//! `provider_output_bytes_max` for as long as anyone holds the hub — its driver, or a client
//! that stopped reading (until the listener's write timeout disconnects it).

use super::budget::{Backlog, BacklogShare, OutputBudget};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::Notify;
use turnstile_core::Generation;
use turnstile_drive::DriveEvent;

/// Default most previews a hub keeps (config `stream_backlog_previews_max`).
pub const BACKLOG_PREVIEWS_MAX: usize = 100_000;

/// Most finished dispatches whose tails ([`Hub::finished_tail`]) a process keeps for streams
/// resumed after the end (a few events each).
pub const FINISHED_TAILS_MAX: usize = 4096;

/// One client event, shared by every subscriber (a preview delta or a committed turn is never
/// copied per client).
pub type ClientEvent = Arc<DriveEvent>;

/// What a receiver reads next.
#[derive(Debug)]
pub enum Next {
    /// The next event; [`Receiver::id_last`] is its id.
    Event(ClientEvent),
    /// Previews this receiver had not read were dropped (the backlog's preview limit, or the
    /// output budget); reading goes on after them. [`Receiver::id_last`] is the id of the last
    /// one dropped, so a stream resumed from it continues after the gap.
    Gap {
        /// How many previews this receiver missed.
        previews_missed: u64,
    },
}

/// Memory one kept event is counted for against the output budget: its text and JSON, plus
/// the event, its `Arc` and its backlog slot.
fn held_bytes(event: &DriveEvent) -> u64 {
    const EVENT_BYTES: usize = std::mem::size_of::<DriveEvent>()
        + 2 * std::mem::size_of::<usize>()
        + std::mem::size_of::<(u64, ClientEvent)>();
    let text = match event {
        DriveEvent::Preview { delta, .. } => delta.len(),
        DriveEvent::Retract { reason, .. } => reason.len(),
        DriveEvent::Error { code, message } => code.len() + message.len(),
        DriveEvent::Committed { turn, facts, .. } => json_len(turn) + facts.as_ref().map_or(0, json_len),
        DriveEvent::State { .. } | DriveEvent::Usage { .. } => 0,
    };
    (EVENT_BYTES + text) as u64
}

/// The length of `value` as JSON, a measure of the memory it takes (no copy is made).
fn json_len(value: &serde_json::Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing into a counter cannot fail.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

struct Inner {
    /// The events kept, in id order, each with its id: its ordinal in the dispatch's stream,
    /// from 1 (the native stream's SSE `id:`). A driver's or a watch's hub numbers every event
    /// it is sent, so ids are consecutive there; a finished hub's tail
    /// ([`Hub::finished_tail`]) keeps the ids of the events it kept.
    backlog: VecDeque<(u64, ClientEvent)>,
    /// Events taken off the front of `backlog` so far: the position of its first event in the
    /// whole stream (a receiver's cursor counts positions in the whole stream).
    evicted: u64,
    /// The events other than previews taken off the front (never dropped: a receiver behind
    /// them still reads them), in id order; every one is older than the last dropped preview.
    pinned: Vec<(u64, ClientEvent)>,
    /// Previews in `backlog`.
    previews_kept: usize,
    /// The id of the last preview dropped (0: none). The last event taken off the front is
    /// always a preview, so it is also the last id evicted.
    preview_id_dropped_last: u64,
    /// The id of the last event numbered.
    id_last: u64,
    finished: bool,
    /// The target each generation's connections went to, as the pump opened them (at most one
    /// entry per attempt: bounded by the attempt budget): a proxy stream names the target
    /// whose preview opened it ([`Receiver::target_of`]).
    targets: Vec<(Generation, usize)>,
    /// The ids are this hub's own, not those a driver gave the same dispatch's events (a watch
    /// of the ledger relaying a stored outcome): a client's `Last-Event-ID` means nothing here.
    renumbered: bool,
}

impl Inner {
    fn empty() -> Inner {
        Inner {
            backlog: VecDeque::new(),
            evicted: 0,
            pinned: Vec::new(),
            previews_kept: 0,
            preview_id_dropped_last: 0,
            id_last: 0,
            finished: false,
            targets: Vec::new(),
            renumbered: false,
        }
    }

    /// Take events off the front until `count` previews are dropped (the events between them
    /// are pinned); answers the bytes of the previews dropped.
    fn drop_oldest_previews(&mut self, count: usize) -> u64 {
        let mut left = count;
        let mut bytes = 0;
        while left > 0 {
            let Some((id, event)) = self.backlog.pop_front() else {
                break;
            };
            self.evicted += 1;
            if matches!(*event, DriveEvent::Preview { .. }) {
                left -= 1;
                self.previews_kept -= 1;
                self.preview_id_dropped_last = id;
                bytes += held_bytes(&event);
            } else {
                self.pinned.push((id, event));
            }
        }
        bytes
    }
}

/// The fan-out point. The backlog is the only copy of the events: a receiver is a cursor into
/// it, starting at its first event and woken when it grows, so a late subscriber reads the same
/// events as an early one (nothing is copied at subscription: a full backlog is 100,000
/// previews), and a dispatch allocates nothing up front (a broadcast ring of 4,096 slots per
/// dispatch used to cost more CPU than the rest of the hub).
pub struct Hub {
    inner: Mutex<Inner>,
    grew: Notify,
    /// Where its `state` and `committed` events are also announced ([`Hub::observed`]).
    observer: Option<Observer>,
    /// Most previews kept ([`Hub::previews_max`]).
    previews_max: usize,
    /// What the backlog holds of the output budget ([`Hub::count_in`]).
    share: OnceLock<BacklogShare>,
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

/// A receiver's place in the stream.
struct Position {
    /// The position (in the whole stream, dropped events included) of the next event to read.
    cursor: u64,
    /// The id of the event read last, or the one subscribed after.
    id_last: u64,
    /// While catching up across dropped previews: the id it was at before them.
    gap_from: Option<u64>,
}

impl Position {
    /// What can be read now without waiting.
    fn next(&mut self, inner: &Inner) -> Option<Next> {
        if self.cursor < inner.evicted {
            // Behind the front: first the kept events it has not read (in id order), then the
            // gap where the dropped previews were.
            let from = *self.gap_from.get_or_insert(self.id_last);
            if let Some((id, event)) = inner.pinned.iter().find(|(id, _)| *id > self.id_last) {
                self.id_last = *id;
                return Some(Next::Event(event.clone()));
            }
            let pinned = inner.pinned.iter().filter(|(id, _)| *id > from).count() as u64;
            let previews_missed = inner
                .preview_id_dropped_last
                .saturating_sub(from)
                .saturating_sub(pinned);
            self.id_last = self.id_last.max(inner.preview_id_dropped_last);
            self.cursor = inner.evicted;
            self.gap_from = None;
            return Some(Next::Gap { previews_missed });
        }
        let index = usize::try_from(self.cursor - inner.evicted).ok()?;
        let (id, event) = inner.backlog.get(index)?;
        self.cursor += 1;
        self.id_last = *id;
        Some(Next::Event(event.clone()))
    }
}

/// A subscriber's position in the hub's events.
pub struct Receiver {
    hub: Arc<Hub>,
    position: Position,
}

impl Receiver {
    /// The next event or gap; `None` once the hub is finished and everything was read.
    pub async fn recv(&mut self) -> Option<Next> {
        loop {
            // Registered before looking, so a send between the look and the wait still wakes us.
            let grew = self.hub.grew.notified();
            tokio::pin!(grew);
            grew.as_mut().enable();
            {
                let inner = self.hub.lock();
                if let Some(next) = self.position.next(&inner) {
                    return Some(next);
                }
                if inner.finished {
                    return None;
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

    /// The next event if the hub already has it; `None` when the receiver would have to wait,
    /// the stream ended, or previews it has not read were dropped ([`Receiver::recv`] tells
    /// which).
    pub fn try_recv(&mut self) -> Option<ClientEvent> {
        let inner = self.hub.lock();
        if self.position.cursor < inner.evicted {
            return None;
        }
        match self.position.next(&inner)? {
            Next::Event(event) => Some(event),
            // Not behind the front, so never a gap.
            Next::Gap { .. } => None,
        }
    }

    /// The id of the event (or the end of the gap) returned last, or of the event subscribed
    /// after (0 before the first): what the native stream writes as its SSE `id:`.
    pub fn id_last(&self) -> u64 {
        self.position.id_last
    }
}

impl Hub {
    /// An empty hub.
    pub fn new() -> Hub {
        Hub {
            inner: Mutex::new(Inner::empty()),
            grew: Notify::new(),
            observer: None,
            previews_max: BACKLOG_PREVIEWS_MAX,
            share: OnceLock::new(),
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

    /// Keep at most `previews_max` previews (at least 1); older ones are dropped.
    pub fn previews_max(mut self, previews_max: usize) -> Hub {
        self.previews_max = previews_max.max(1);
        self
    }

    /// Count what this hub holds against `budget` from now on, until the hub is dropped (and
    /// let the budget drop its previews when it needs the room). Once per hub.
    pub fn count_in(self: &Arc<Self>, budget: &Arc<OutputBudget>) {
        let backlog: std::sync::Weak<dyn Backlog> = Arc::downgrade(self) as std::sync::Weak<dyn Backlog>;
        let share = budget.join_backlog(backlog);
        let (held, droppable) = {
            let inner = self.lock();
            inner
                .pinned
                .iter()
                .chain(inner.backlog.iter())
                .fold((0, 0), |(held, droppable), (_, event)| {
                    let bytes = held_bytes(event);
                    let preview = u64::from(matches!(**event, DriveEvent::Preview { .. }));
                    (held + bytes, droppable + bytes * preview)
                })
        };
        share.take(held - droppable, false);
        share.take(droppable, true);
        let _ = self.share.set(share);
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

    /// Publish an event. Past `previews_max` previews the oldest one is dropped; no other
    /// event is ever dropped.
    pub fn send(&self, event: DriveEvent) {
        self.announce(&event);
        let preview = matches!(event, DriveEvent::Preview { .. });
        let bytes = if self.share.get().is_some() {
            held_bytes(&event)
        } else {
            0
        };
        let dropped = {
            let mut inner = self.lock();
            inner.id_last += 1;
            let id = inner.id_last;
            inner.backlog.push_back((id, Arc::new(event)));
            if preview {
                inner.previews_kept += 1;
            }
            let over = inner.previews_kept.saturating_sub(self.previews_max);
            inner.drop_oldest_previews(over)
        };
        self.grew.notify_waiters();
        // Outside the hub's lock: the budget may call back into any hub to drop its previews.
        if let Some(share) = self.share.get() {
            share.give(dropped, true);
            share.take(bytes, preview);
        }
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
    /// (`None`). It reads the shared backlog by cursor, so there is no seam between "backlog"
    /// and "live" for an event to fall into, and subscribing copies nothing. Previews already
    /// dropped are a gap at its start.
    pub fn subscribe(self: &Arc<Self>) -> Receiver {
        self.subscribe_after(None)
    }

    /// A receiver of the events after the one whose id is `id_seen` (a client's
    /// `Last-Event-ID`), or of the whole stream when that is not an id this hub has sent: none
    /// given, greater than the last id sent so far, or the hub is [`Hub::renumbered`].
    /// Resuming never repeats an event, and never skips one the hub still has (previews
    /// dropped after `id_seen` are a gap).
    pub fn subscribe_after(self: &Arc<Self>, id_seen: Option<u64>) -> Receiver {
        let position = {
            let inner = self.lock();
            match id_seen {
                Some(seen) if !inner.renumbered && seen <= inner.id_last => {
                    let front = inner.backlog.front().map_or(inner.id_last + 1, |(id, _)| *id);
                    let cursor = if inner.evicted > 0 && seen < front {
                        // Among the events taken off the front, whose ids are consecutive
                        // (only a driver's or watch's hub drops any): event `seen` was at
                        // position `seen - 1`.
                        seen
                    } else {
                        inner.evicted + inner.backlog.partition_point(|(id, _)| *id <= seen) as u64
                    };
                    Position {
                        cursor,
                        id_last: seen,
                        gap_from: None,
                    }
                }
                _ => Position {
                    cursor: 0,
                    id_last: 0,
                    gap_from: None,
                },
            }
        };
        Receiver {
            hub: self.clone(),
            position,
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
            .pinned
            .iter()
            .chain(inner.backlog.iter())
            .filter(|(_, event)| !matches!(**event, DriveEvent::Preview { .. } | DriveEvent::Usage { .. }))
            .cloned()
            .collect();
        Hub {
            inner: Mutex::new(Inner {
                backlog,
                finished: true,
                targets: inner.targets.clone(),
                renumbered: inner.renumbered,
                id_last: inner.id_last,
                ..Inner::empty()
            }),
            grew: Notify::new(),
            observer: None,
            previews_max: self.previews_max,
            share: OnceLock::new(),
        }
    }
}

impl Backlog for Hub {
    fn drop_previews(&self) {
        let dropped = {
            let mut inner = self.lock();
            let count = inner.previews_kept;
            inner.drop_oldest_previews(count)
        };
        if let Some(share) = self.share.get() {
            share.give(dropped, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::budget::OutputBudget;
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

    /// Every event of `receiver` until the end, and the gaps read (previews missed each).
    async fn read_all(receiver: &mut Receiver) -> (Vec<ClientEvent>, Result<(), Vec<u64>>) {
        let mut seen = Vec::new();
        let mut gaps = Vec::new();
        while let Some(next) = receiver.recv().await {
            match next {
                Next::Event(event) => seen.push(event),
                Next::Gap { previews_missed } => gaps.push(previews_missed),
            }
        }
        (seen, if gaps.is_empty() { Ok(()) } else { Err(gaps) })
    }

    /// Every event and gap of `receiver` until the end, each with the id it leaves the
    /// receiver at: `Err(missed)` for a gap.
    async fn read_with_ids(receiver: &mut Receiver) -> Vec<(u64, Result<ClientEvent, u64>)> {
        let mut read = Vec::new();
        while let Some(next) = receiver.recv().await {
            let item = match next {
                Next::Event(event) => Ok(event),
                Next::Gap { previews_missed } => Err(previews_missed),
            };
            read.push((receiver.id_last(), item));
        }
        read
    }

    fn state(state: DispatchState) -> DriveEvent {
        DriveEvent::State {
            state,
            generation: Some(Generation(1)),
        }
    }

    fn committed() -> DriveEvent {
        DriveEvent::Committed {
            revision: Revision(2),
            turn: serde_json::json!({"revision": 2, "blocks": [{"kind": "text", "text": "x".repeat(1000)}]}),
            facts: None,
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
        assert!(late.recv().await.is_none());
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
    async fn past_the_preview_limit_the_oldest_previews_are_dropped_and_a_late_reader_gets_a_gap_then_every_other_event_and_the_commit()
     {
        let hub = Arc::new(Hub::new().previews_max(3));
        // ids: 1 state, 2–6 previews 1–5, 7 retract, 8 state, 9–13 previews 6–10, 14 commit.
        hub.send(state(DispatchState::Streaming));
        for number in 1..=5 {
            hub.send(preview(number));
        }
        hub.send(DriveEvent::Retract {
            generation: Generation(1),
            reason: "stream_cut".into(),
        });
        hub.send(state(DispatchState::Streaming));
        for number in 6..=10 {
            hub.send(preview(number));
        }
        hub.send(committed());
        hub.finish();
        let read = read_with_ids(&mut hub.subscribe()).await;
        let shape: Vec<(u64, String)> = read
            .iter()
            .map(|(id, item)| {
                let what = match item {
                    Err(missed) => format!("gap {missed}"),
                    Ok(event) => match &**event {
                        DriveEvent::Preview { delta, .. } => format!("preview {delta}"),
                        DriveEvent::State { .. } => "state".into(),
                        DriveEvent::Retract { .. } => "retract".into(),
                        DriveEvent::Committed { .. } => "committed".into(),
                        other => format!("{other:?}"),
                    },
                };
                (*id, what)
            })
            .collect();
        let expected: Vec<(u64, String)> = [
            (1, "state"),
            (7, "retract"),
            (8, "state"),
            // Previews 1–7 (ids 2–6, 9, 10) were dropped; ids go on after the last of them.
            (10, "gap 7"),
            (11, "preview 8"),
            (12, "preview 9"),
            (13, "preview 10"),
            (14, "committed"),
        ]
        .into_iter()
        .map(|(id, what)| (id, what.to_owned()))
        .collect();
        assert_eq!(shape, expected);
    }

    #[tokio::test]
    async fn a_reader_that_keeps_up_reads_every_preview_however_small_the_limit() {
        let hub = Arc::new(Hub::new().previews_max(2));
        let mut reader = hub.subscribe();
        for number in 1..=50 {
            hub.send(preview(number));
            match reader.recv().await {
                Some(Next::Event(event)) => assert_eq!(number_of(&event), Some(number)),
                other => panic!("expected preview {number}, got {other:?}"),
            }
        }
        hub.send(committed());
        hub.finish();
        let (seen, ended) = read_all(&mut reader).await;
        assert!(ended.is_ok());
        assert!(matches!(*seen[0], DriveEvent::Committed { .. }));
    }

    #[tokio::test]
    async fn a_reader_that_falls_behind_mid_stream_gets_a_gap_of_exactly_what_it_missed() {
        let hub = Arc::new(Hub::new().previews_max(4));
        let mut reader = hub.subscribe();
        hub.send(preview(1));
        assert!(matches!(reader.recv().await, Some(Next::Event(_))));
        // It stops reading while 20 more previews and a state change go by.
        for number in 2..=11 {
            hub.send(preview(number));
        }
        hub.send(state(DispatchState::Streaming));
        for number in 12..=21 {
            hub.send(preview(number));
        }
        hub.send(committed());
        hub.finish();
        let read = read_with_ids(&mut reader).await;
        // The state change (kept), then the gap over previews 2–17, then 18–21 and the commit.
        assert!(matches!(&read[0], (12, Ok(event)) if matches!(**event, DriveEvent::State { .. })));
        assert!(matches!(read[1], (18, Err(16))), "{:?}", read[1]);
        let numbers: Vec<u64> = read[2..6]
            .iter()
            .filter_map(|(_, item)| item.as_ref().ok().and_then(|event| number_of(event)))
            .collect();
        assert_eq!(numbers, vec![18, 19, 20, 21]);
        assert!(matches!(&read[6], (23, Ok(event)) if matches!(**event, DriveEvent::Committed { .. })));
        assert_eq!(read.len(), 7);
        // Resumed from inside the dropped previews: the events after it, the gap counted from
        // there.
        let resumed = read_with_ids(&mut hub.subscribe_after(Some(5))).await;
        assert!(matches!(&resumed[0], (12, Ok(_))));
        assert!(matches!(resumed[1], (18, Err(12))), "{:?}", resumed[1]);
        // Resumed from the gap's id: no gap, the rest.
        let after_gap = read_with_ids(&mut hub.subscribe_after(Some(18))).await;
        assert_eq!(after_gap.len(), 5);
        assert!(after_gap.iter().all(|(id, item)| *id > 18 && item.is_ok()));
    }

    #[tokio::test]
    async fn what_a_hub_holds_counts_against_the_budget_until_the_hub_is_dropped() {
        let budget = OutputBudget::new(1 << 30);
        let hub = Arc::new(Hub::new().previews_max(10));
        hub.count_in(&budget);
        for number in 1..=5 {
            hub.send(preview(number));
        }
        hub.send(committed());
        hub.finish();
        let held = budget.held();
        assert!(held > 1000, "the commit's turn is counted: {held}");
        // A client still holds it after the dispatch ended: still counted.
        let mut reader = hub.subscribe();
        drop(hub);
        assert_eq!(budget.held(), held);
        let (seen, _) = read_all(&mut reader).await;
        assert_eq!(seen.len(), 6);
        drop(reader);
        assert_eq!(budget.held(), 0, "given back with the last holder");
    }

    #[tokio::test]
    async fn over_the_budget_a_backlog_drops_its_previews_before_any_dispatch_is_shed() {
        let budget = OutputBudget::new(20_000);
        let dispatch = budget.join();
        assert!(!dispatch.take(5_000));
        let hub = Arc::new(Hub::new());
        hub.count_in(&budget);
        let mut reader = hub.subscribe();
        hub.send(state(DispatchState::Streaming));
        for _ in 0..20 {
            hub.send(DriveEvent::Preview {
                generation: Generation(1),
                block_index: 0,
                delta: "y".repeat(1000),
            });
        }
        // 5,000 + about 20 × 1,100 crossed 20,000: the previews went, the dispatch goes on.
        assert!(!dispatch.is_shed());
        assert!(budget.held() <= 20_000, "{}", budget.held());
        hub.send(committed());
        hub.finish();
        let (seen, gaps) = read_all(&mut reader).await;
        let missed: u64 = gaps.unwrap_err().iter().sum();
        let previews = seen
            .iter()
            .filter(|event| matches!(***event, DriveEvent::Preview { .. }))
            .count() as u64;
        assert_eq!(missed + previews, 20);
        assert!(matches!(**seen.last().unwrap(), DriveEvent::Committed { .. }));
        // With nothing left to drop, the dispatch holding the most is shed as before.
        assert!(dispatch.take(30_000));
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
        assert_eq!(numbers(hub.subscribe_after(Some(5))).await, (vec![], 5));
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
        assert!(done.recv().await.is_none());
    }
}
