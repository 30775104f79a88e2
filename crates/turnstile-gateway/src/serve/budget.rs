//! One byte budget for provider output held in memory by every dispatch of this process (the
//! assembler's blocks and the hub's backlog grow with what the provider sends). When a chunk
//! would take the total past `provider_output_bytes_max`, the dispatch holding the most is
//! shed: its attempt ends at once with `output_budget_exhausted` (nothing of it commits, it is
//! not retried, the client is told), and its bytes are given back. Counted in
//! `turnstile_provider_output_shed_total`; the bytes held are `turnstile_provider_output_bytes`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::Notify;

/// The process-wide budget.
pub struct OutputBudget {
    max: u64,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    total: u64,
    /// Bytes of dispatches already chosen to end (they come back when those drivers end):
    /// not counted again when choosing, so one overflow sheds one dispatch, not every one.
    shedding: u64,
    next_share: u64,
    by_share: HashMap<u64, Held>,
}

struct Held {
    bytes: u64,
    shed: Arc<AtomicBool>,
    wake: Arc<Notify>,
}

/// What one dispatch's driver holds of the budget; gives it all back when dropped.
pub struct Share {
    budget: Arc<OutputBudget>,
    id: u64,
    shed: Arc<AtomicBool>,
    wake: Arc<Notify>,
}

impl OutputBudget {
    /// A budget of `max` bytes (0: no budget).
    pub fn new(max: u64) -> Arc<OutputBudget> {
        Arc::new(OutputBudget {
            max,
            inner: Mutex::new(Inner::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes held now, by every dispatch.
    pub fn held(&self) -> u64 {
        self.lock().total
    }

    /// The share of a driver that starts receiving.
    pub fn join(self: &Arc<Self>) -> Share {
        let shed = Arc::new(AtomicBool::new(false));
        let wake = Arc::new(Notify::new());
        let mut inner = self.lock();
        let id = inner.next_share;
        inner.next_share += 1;
        inner.by_share.insert(
            id,
            Held {
                bytes: 0,
                shed: shed.clone(),
                wake: wake.clone(),
            },
        );
        Share {
            budget: self.clone(),
            id,
            shed,
            wake,
        }
    }
}

impl Share {
    /// Count `bytes` more held by this dispatch. True when this dispatch must end now: the
    /// budget is exhausted and it holds the most (or another dispatch's overflow chose it).
    pub fn take(&self, bytes: u64) -> bool {
        let budget = &self.budget;
        if budget.max == 0 {
            return false;
        }
        let mut inner = budget.lock();
        let shed = self.shed.load(Ordering::Relaxed);
        inner.total = inner.total.saturating_add(bytes);
        if shed {
            inner.shedding = inner.shedding.saturating_add(bytes);
        }
        if let Some(held) = inner.by_share.get_mut(&self.id) {
            held.bytes = held.bytes.saturating_add(bytes);
        }
        if inner.total.saturating_sub(inner.shedding) > budget.max
            && let Some(largest) = inner
                .by_share
                .values()
                .filter(|held| !held.shed.load(Ordering::Relaxed))
                .max_by_key(|held| held.bytes)
        {
            largest.shed.store(true, Ordering::Relaxed);
            largest.wake.notify_one();
            let bytes = largest.bytes;
            inner.shedding = inner.shedding.saturating_add(bytes);
        }
        self.shed.load(Ordering::Relaxed)
    }

    /// Resolves once this dispatch was chosen to end (by its own chunk or another's), so a
    /// driver that receives nothing ends at once too.
    pub async fn chosen(&self) {
        while !self.is_shed() {
            self.wake.notified().await;
        }
    }

    /// This dispatch was chosen to end (by its own chunk or another's).
    pub fn is_shed(&self) -> bool {
        self.shed.load(Ordering::Relaxed)
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut inner = self.budget.lock();
        if let Some(held) = inner.by_share.remove(&self.id) {
            inner.total = inner.total.saturating_sub(held.bytes);
            if held.shed.load(Ordering::Relaxed) {
                inner.shedding = inner.shedding.saturating_sub(held.bytes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_dispatch_is_shed_and_its_bytes_come_back() {
        let budget = OutputBudget::new(100);
        let small = budget.join();
        let large = budget.join();
        assert!(!small.take(20));
        assert!(!large.take(70));
        // The small one's chunk crosses the budget: the large one is chosen, not the small.
        assert!(!small.take(20), "the small dispatch goes on");
        assert!(large.is_shed(), "the largest is shed");
        assert_eq!(budget.held(), 110);
        // While the chosen one winds down, its bytes are not held against the others: one
        // overflow ends one dispatch, not the next one too.
        assert!(!small.take(1), "no cascade");
        assert!(!small.is_shed());
        drop(large);
        assert_eq!(budget.held(), 41, "a shed dispatch gives its bytes back");
        assert!(!small.take(50));
        assert!(!small.is_shed());
    }

    #[test]
    fn no_budget_sheds_nothing() {
        let budget = OutputBudget::new(0);
        let share = budget.join();
        assert!(!share.take(u64::MAX));
        assert!(!share.is_shed());
    }
}
