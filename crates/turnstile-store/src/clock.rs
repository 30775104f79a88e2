//! The store's clock: the one clock lease and fencing decisions are judged by.
//!
//! Every conditional write that compares a lease with "now" reads "now" inside the statement
//! ([`crate::sql::Dialect::now_ms`]), never from the caller: two replicas whose own clocks
//! disagree (skew, a paused VM, a test's offset) still agree on whether a lease ran out.
//! PostgreSQL reads the server's `clock_timestamp()`. SQLite has no server, so its connection
//! reads its own time in SQL (`julianday('now')`: the host's clock, which every process opening
//! the same file on that host shares), unless its connection carries a manual clock
//! ([`StoreClock::Manual`], through the `turnstile_now_ms()` SQL function) that the
//! deterministic simulation advances as its virtual time.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Where a SQLite store reads its time.
#[derive(Clone, Debug, Default)]
pub enum StoreClock {
    /// The host's system clock (production).
    #[default]
    System,
    /// A clock the owner sets (the simulation's virtual time, in epoch milliseconds).
    Manual(Arc<AtomicU64>),
}

impl StoreClock {
    /// A manual clock starting at `start_ms`, and the handle that moves it.
    pub fn manual(start_ms: u64) -> (StoreClock, Arc<AtomicU64>) {
        let handle = Arc::new(AtomicU64::new(start_ms));
        (StoreClock::Manual(Arc::clone(&handle)), handle)
    }

    /// The manual clock's reading in epoch milliseconds; `None` for [`StoreClock::System`],
    /// whose time SQLite reads itself (`julianday('now')` in [`crate::sql::Dialect::now_ms`]).
    pub fn manual_ms(&self) -> Option<u64> {
        match self {
            StoreClock::System => None,
            StoreClock::Manual(handle) => Some(handle.load(Ordering::SeqCst)),
        }
    }
}
