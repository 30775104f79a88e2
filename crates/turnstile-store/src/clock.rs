//! The store's clock: the one clock lease and fencing decisions are judged by.
//!
//! Every conditional write that compares a lease with "now" reads "now" inside the statement
//! ([`crate::sql::Dialect::now_ms`]), never from the caller: two replicas whose own clocks
//! disagree (skew, a paused VM, a test's offset) still agree on whether a lease ran out.
//! PostgreSQL reads the server's `clock_timestamp()`. SQLite has no server, so its connection
//! carries a `turnstile_now_ms()` SQL function backed by a [`StoreClock`]: the host's system
//! clock in production (what every process opening the same file on that host shares), or a
//! manual clock that the deterministic simulation advances as its virtual time.

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

    /// The clock's reading in epoch milliseconds.
    pub fn now_ms(&self) -> u64 {
        match self {
            StoreClock::System => system_ms(),
            StoreClock::Manual(handle) => handle.load(Ordering::SeqCst),
        }
    }
}

fn system_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
        })
}
