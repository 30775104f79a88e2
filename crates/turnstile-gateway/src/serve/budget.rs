//! One byte budget for provider output held in memory by every dispatch of this process (the
//! assembler's blocks and the hub's backlog grow with what the provider sends). When a chunk
//! would take the total past `provider_output_bytes_max`, the dispatch holding the most is
//! shed: its attempt ends at once with `output_budget_exhausted` (nothing of it commits, it is
//! not retried, the client is told), and its bytes are given back. Counted in
//! `turnstile_provider_output_shed_total`; the bytes held are `turnstile_provider_output_bytes`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// The process-wide budget.
pub struct OutputBudget {
    max: u64,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    total: u64,
    by_dispatch: HashMap<String, Held>,
}

struct Held {
    bytes: u64,
    shed: Arc<AtomicBool>,
}

/// What one dispatch holds of the budget; gives it all back when dropped.
pub struct Share {
    budget: Arc<OutputBudget>,
    operation_id: String,
    shed: Arc<AtomicBool>,
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

    /// The share of a dispatch that starts receiving.
    pub fn join(self: &Arc<Self>, operation_id: &str) -> Share {
        let shed = Arc::new(AtomicBool::new(false));
        let mut inner = self.lock();
        let held = inner.by_dispatch.entry(operation_id.to_owned()).or_insert_with(|| Held {
            bytes: 0,
            shed: shed.clone(),
        });
        Share {
            budget: self.clone(),
            operation_id: operation_id.to_owned(),
            shed: held.shed.clone(),
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
        inner.total = inner.total.saturating_add(bytes);
        if let Some(held) = inner.by_dispatch.get_mut(&self.operation_id) {
            held.bytes = held.bytes.saturating_add(bytes);
        }
        if inner.total > budget.max
            && let Some((_, largest)) = inner
                .by_dispatch
                .iter()
                .filter(|(_, held)| !held.shed.load(Ordering::Relaxed))
                .max_by_key(|(_, held)| held.bytes)
        {
            largest.shed.store(true, Ordering::Relaxed);
        }
        self.shed.load(Ordering::Relaxed)
    }

    /// This dispatch was chosen to end (by its own chunk or another's).
    pub fn is_shed(&self) -> bool {
        self.shed.load(Ordering::Relaxed)
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut inner = self.budget.lock();
        if let Some(held) = inner.by_dispatch.remove(&self.operation_id) {
            inner.total = inner.total.saturating_sub(held.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_dispatch_is_shed_and_its_bytes_come_back() {
        let budget = OutputBudget::new(100);
        let small = budget.join("small");
        let large = budget.join("large");
        assert!(!small.take(20));
        assert!(!large.take(70));
        // The small one's chunk crosses the budget: the large one is chosen, not the small.
        assert!(!small.take(20), "the small dispatch goes on");
        assert!(large.is_shed(), "the largest is shed");
        assert_eq!(budget.held(), 110);
        drop(large);
        assert_eq!(budget.held(), 40, "a shed dispatch gives its bytes back");
        assert!(!small.take(50));
        assert!(!small.is_shed());
    }

    #[test]
    fn no_budget_sheds_nothing() {
        let budget = OutputBudget::new(0);
        let share = budget.join("a");
        assert!(!share.take(u64::MAX));
        assert!(!share.is_shed());
    }
}
