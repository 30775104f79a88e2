//! Connection drops around COMMIT, injected into the real store's transaction driver for the
//! conformance suite. Production code never arms it; an unarmed injector costs one atomic
//! load per transaction.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Where the next transaction loses its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The connection drops before COMMIT: nothing lands, the caller gets
    /// [`crate::StoreError::ConnectionLost`].
    DropBeforeCommit,
    /// COMMIT lands, then the connection drops before the answer: the caller gets
    /// [`crate::StoreError::ConnectionLost`] although the write is durable.
    DropAfterCommit,
}

/// A queue of faults; each transaction (SQLite: each group commit) takes the next one.
#[derive(Debug, Default)]
pub struct FaultInjector {
    armed: AtomicBool,
    queue: Mutex<Vec<Fault>>,
}

impl FaultInjector {
    /// Make the next transaction fail this way.
    pub fn arm(&self, fault: Fault) {
        let mut queue = match self.queue.lock() {
            Ok(queue) => queue,
            Err(poisoned) => poisoned.into_inner(),
        };
        queue.insert(0, fault);
        self.armed.store(true, Ordering::SeqCst);
    }

    /// The fault for the transaction about to commit, if one is armed.
    pub(crate) fn take(&self) -> Option<Fault> {
        if !self.armed.load(Ordering::Relaxed) {
            return None;
        }
        let mut queue = match self.queue.lock() {
            Ok(queue) => queue,
            Err(poisoned) => poisoned.into_inner(),
        };
        let fault = queue.pop();
        if queue.is_empty() {
            self.armed.store(false, Ordering::SeqCst);
        }
        fault
    }
}
