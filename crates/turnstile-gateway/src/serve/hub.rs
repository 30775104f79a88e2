//! Client event fan-out for one dispatch: every event is kept (a bounded backlog) and
//! broadcast, so a client that attaches late with the same operation id sees the whole stream,
//! and a client that leaves loses nothing of the dispatch itself.

use serde_json::Value;
use std::sync::Mutex;
use tokio::sync::broadcast;

/// Most events kept for late attachers.
pub const BACKLOG_EVENTS_MAX: usize = 100_000;
const CHANNEL_CAPACITY: usize = 4_096;

/// One client event: the SSE `event:` name and its JSON data.
pub type ClientMessage = (&'static str, Value);

struct Inner {
    backlog: Vec<ClientMessage>,
    finished: bool,
}

/// The fan-out point.
pub struct Hub {
    inner: Mutex<Inner>,
    sender: broadcast::Sender<Option<ClientMessage>>,
}

impl Default for Hub {
    fn default() -> Hub {
        Hub::new()
    }
}

impl Hub {
    /// An empty hub.
    pub fn new() -> Hub {
        let (sender, _) = broadcast::channel(CHANNEL_CAPACITY);
        Hub {
            inner: Mutex::new(Inner {
                backlog: Vec::new(),
                finished: false,
            }),
            sender,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Publish an event.
    pub fn send(&self, event: &'static str, data: Value) {
        let mut inner = self.lock();
        if inner.backlog.len() < BACKLOG_EVENTS_MAX {
            inner.backlog.push((event, data.clone()));
        }
        let _ = self.sender.send(Some((event, data)));
    }

    /// The dispatch driver is done: no more events.
    pub fn finish(&self) {
        let mut inner = self.lock();
        inner.finished = true;
        let _ = self.sender.send(None);
    }

    /// Everything so far, and a receiver for what follows (`None` marks the end). Taken under
    /// one lock so no event falls between the two.
    pub fn subscribe(
        &self,
    ) -> (
        Vec<ClientMessage>,
        bool,
        broadcast::Receiver<Option<ClientMessage>>,
    ) {
        let inner = self.lock();
        (inner.backlog.clone(), inner.finished, self.sender.subscribe())
    }
}
