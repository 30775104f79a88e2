//! One byte budget for provider output held in memory by this process: what each dispatch's
//! driver holds (the assembler's blocks grow with what the provider sends) and what each
//! dispatch's client backlog holds (`hub.rs`: the events kept for its clients, held for as long
//! as a client is attached, after the dispatch ended too). When the total would pass
//! `provider_output_bytes_max`:
//!
//! 1. client backlogs drop their previews first, the largest first, as many as cover the
//!    excess (nothing of any dispatch is lost: a client behind them is told of the gap and the
//!    commit carries the text; counted in `turnstile_client_backlog_sheds_total`);
//! 2. if that is not enough, the dispatch holding the most is shed: its attempt ends at once
//!    with `output_budget_exhausted` (nothing of it commits, it is not retried, the client is
//!    told), and its bytes are given back. Counted in `turnstile_provider_output_shed_total`.
//!
//! The bytes held are `turnstile_provider_output_bytes` (read at each scrape).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
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
    kind: Kind,
}

enum Kind {
    /// A dispatch's driver: shed by ending the dispatch.
    Dispatch {
        shed: Arc<AtomicBool>,
        wake: Arc<Notify>,
    },
    /// A client backlog: relieved by dropping its previews (`droppable` of its bytes).
    Backlog {
        droppable: u64,
        backlog: Weak<dyn Backlog>,
    },
}

/// A client backlog the budget can relieve (a dispatch's hub).
pub trait Backlog: Send + Sync {
    /// Drop every preview kept, giving their bytes back through its [`BacklogShare`]. Called
    /// with no lock of the budget held.
    fn drop_previews(&self);
}

/// What one dispatch's driver holds of the budget; gives it all back when dropped.
pub struct Share {
    budget: Arc<OutputBudget>,
    id: u64,
    shed: Arc<AtomicBool>,
    wake: Arc<Notify>,
}

/// What one client backlog holds of the budget; gives it all back when dropped.
pub struct BacklogShare {
    budget: Arc<OutputBudget>,
    id: u64,
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

    /// Bytes held now, by every dispatch and client backlog.
    pub fn held(&self) -> u64 {
        self.lock().total
    }

    fn insert(&self, kind: Kind) -> u64 {
        let mut inner = self.lock();
        let id = inner.next_share;
        inner.next_share += 1;
        inner.by_share.insert(id, Held { bytes: 0, kind });
        id
    }

    /// The share of a driver that starts receiving.
    pub fn join(self: &Arc<Self>) -> Share {
        let shed = Arc::new(AtomicBool::new(false));
        let wake = Arc::new(Notify::new());
        let id = self.insert(Kind::Dispatch {
            shed: shed.clone(),
            wake: wake.clone(),
        });
        Share {
            budget: self.clone(),
            id,
            shed,
            wake,
        }
    }

    /// The share of a client backlog (held weakly: the budget never keeps a backlog alive).
    pub fn join_backlog(self: &Arc<Self>, backlog: Weak<dyn Backlog>) -> BacklogShare {
        let id = self.insert(Kind::Backlog {
            droppable: 0,
            backlog,
        });
        BacklogShare {
            budget: self.clone(),
            id,
        }
    }

    /// Over the budget: relieve client backlogs first (largest first, as many as cover the
    /// excess), then, still over, mark the dispatch holding the most to end.
    fn relieve(&self) {
        if self.max == 0 {
            return;
        }
        let victims: Vec<Weak<dyn Backlog>> = {
            let inner = self.lock();
            let mut excess = inner
                .total
                .saturating_sub(inner.shedding)
                .saturating_sub(self.max);
            if excess == 0 {
                return;
            }
            let mut backlogs: Vec<(u64, &Weak<dyn Backlog>)> = inner
                .by_share
                .values()
                .filter_map(|held| match &held.kind {
                    Kind::Backlog { droppable, backlog } if *droppable > 0 => Some((*droppable, backlog)),
                    _ => None,
                })
                .collect();
            backlogs.sort_by_key(|(droppable, _)| std::cmp::Reverse(*droppable));
            let mut victims = Vec::new();
            for (droppable, backlog) in backlogs {
                if excess == 0 {
                    break;
                }
                excess = excess.saturating_sub(droppable);
                victims.push(backlog.clone());
            }
            victims
        };
        for victim in victims {
            // A backlog being dropped gives its bytes back by itself.
            if let Some(backlog) = victim.upgrade() {
                backlog.drop_previews();
                super::metrics::bump(super::metrics::CLIENT_BACKLOG_SHEDS);
            }
        }
        let mut inner = self.lock();
        if inner.total.saturating_sub(inner.shedding) <= self.max {
            return;
        }
        let largest = inner
            .by_share
            .values()
            .filter_map(|held| match &held.kind {
                Kind::Dispatch { shed, wake } if !shed.load(Ordering::Relaxed) => {
                    Some((held.bytes, shed, wake))
                }
                _ => None,
            })
            .max_by_key(|(bytes, _, _)| *bytes)
            .map(|(bytes, shed, wake)| (bytes, shed.clone(), wake.clone()));
        if let Some((bytes, shed, wake)) = largest {
            shed.store(true, Ordering::Relaxed);
            wake.notify_one();
            inner.shedding = inner.shedding.saturating_add(bytes);
        }
    }
}

impl Share {
    /// Count `bytes` more held by this dispatch. True when this dispatch must end now: the
    /// budget is exhausted, no client backlog can make room, and it holds the most (or
    /// another dispatch's overflow chose it).
    pub fn take(&self, bytes: u64) -> bool {
        let budget = &self.budget;
        if budget.max == 0 {
            return false;
        }
        {
            let mut inner = budget.lock();
            inner.total = inner.total.saturating_add(bytes);
            if self.shed.load(Ordering::Relaxed) {
                inner.shedding = inner.shedding.saturating_add(bytes);
            }
            if let Some(held) = inner.by_share.get_mut(&self.id) {
                held.bytes = held.bytes.saturating_add(bytes);
            }
        }
        budget.relieve();
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
            if self.shed.load(Ordering::Relaxed) {
                inner.shedding = inner.shedding.saturating_sub(held.bytes);
            }
        }
    }
}

impl BacklogShare {
    /// Count `bytes` more held by this backlog (`droppable`: a preview's, which it can drop).
    /// Over the budget, backlogs are relieved at once: with no lock of the caller's held, this
    /// may call [`Backlog::drop_previews`] on any backlog, this one included.
    pub fn take(&self, bytes: u64, droppable: bool) {
        if self.change(bytes, droppable, true) {
            self.budget.relieve();
        }
    }

    /// `bytes` this backlog no longer holds (`droppable`: a preview's).
    pub fn give(&self, bytes: u64, droppable: bool) {
        self.change(bytes, droppable, false);
    }

    /// Apply a change; true when the total is now over the budget (worth relieving).
    fn change(&self, bytes: u64, droppable: bool, more: bool) -> bool {
        let budget = &self.budget;
        let mut inner = budget.lock();
        inner.total = if more {
            inner.total.saturating_add(bytes)
        } else {
            inner.total.saturating_sub(bytes)
        };
        if let Some(held) = inner.by_share.get_mut(&self.id) {
            let step = |value: u64| {
                if more {
                    value.saturating_add(bytes)
                } else {
                    value.saturating_sub(bytes)
                }
            };
            held.bytes = step(held.bytes);
            if let Kind::Backlog { droppable: kept, .. } = &mut held.kind
                && droppable
            {
                *kept = step(*kept);
            }
        }
        budget.max != 0 && inner.total.saturating_sub(inner.shedding) > budget.max
    }
}

impl Drop for BacklogShare {
    fn drop(&mut self) {
        let mut inner = self.budget.lock();
        if let Some(held) = inner.by_share.remove(&self.id) {
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
