//! Shutdown and drain (issue 49, item 6). SIGTERM or SIGINT moves the process through three
//! phases, each one-way:
//!
//! - **Serving**: as usual.
//! - **Draining**: the listener answers every new request 503 `shutting_down` except
//!   `GET /healthz` and `GET /metrics`, closes kept-alive connections once their response is
//!   written, and ends change-feed streams; the lease sweep stops taking dispatches over. Live
//!   dispatches run on to their end, their clients attached, for up to `drain_timeout_ms`.
//! - **Handing over**: past the timeout every driver still running stops as a self-fence does
//!   (provider connections closed, preview retracted, nothing more written) and its clients
//!   get `error shutting_down` (attach again with the same `operation_id`); ledger watches end
//!   with the same error. Once every driver is gone (so no provider connection of this holder
//!   is open), the store releases this holder's live attempts: their leases end now and they
//!   become UNKNOWN, so another replica's sweep, or the next start, recovers them at once.
//!
//! A drain that finishes in time leaves nothing live: a restart then sends nothing again.
//! Everything that must finish before the process exits holds a [`Task`] guard.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::{Notify, watch};

/// Where the process is in its shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// Serving as usual.
    Serving,
    /// A shutdown signal came: no new work, live dispatches run on.
    Draining,
    /// The drain timeout passed: what is left stops and is handed to recovery.
    HandingOver,
}

/// The process's shutdown state, shared by the listener, the drivers and the watches.
pub struct Drain {
    phase: watch::Sender<Phase>,
    tasks: AtomicUsize,
    idle: Notify,
}

impl Default for Drain {
    fn default() -> Drain {
        Drain::new()
    }
}

impl Drain {
    /// Serving, with nothing running.
    pub fn new() -> Drain {
        Drain {
            phase: watch::channel(Phase::Serving).0,
            tasks: AtomicUsize::new(0),
            idle: Notify::new(),
        }
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    /// Whether a shutdown began (no new work is taken).
    pub fn is_draining(&self) -> bool {
        self.phase() >= Phase::Draining
    }

    /// Move on to `phase` (never back).
    pub fn enter(&self, phase: Phase) {
        self.phase.send_if_modified(|current| {
            let later = phase > *current;
            if later {
                *current = phase;
            }
            later
        });
    }

    /// Completes once the process is at `phase` or later.
    pub async fn reached(&self, phase: Phase) {
        let mut receiver = self.phase.subscribe();
        // Invariant: the sender lives in `self`, so the channel cannot close while borrowed.
        let _ = receiver.wait_for(|current| *current >= phase).await;
    }

    /// A guard for work the process must see finished (or handed over) before it exits: a
    /// dispatch driver or a ledger watch.
    pub fn task(self: &Arc<Drain>) -> Task {
        self.tasks.fetch_add(1, Ordering::AcqRel);
        Task(self.clone())
    }

    /// Spawn work the process must see finished, its guard taken before the spawn returns: a
    /// drain that looks between the spawn and the task's first poll sees it running (a guard
    /// taken inside the task could be missed, and the process exit under a dispatch its request
    /// had just started).
    pub fn spawn<F>(self: &Arc<Drain>, work: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let running = self.task();
        tokio::spawn(async move {
            let _running = running;
            work.await
        })
    }

    /// Guards held now.
    pub fn running(&self) -> usize {
        self.tasks.load(Ordering::Acquire)
    }

    /// Completes once no guard is held.
    pub async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            // Registered before the check, so a release between the two is not missed.
            notified.as_mut().enable();
            if self.running() == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// Held by a driver or watch while it runs (see [`Drain::task`]).
pub struct Task(Arc<Drain>);

impl Drop for Task {
    fn drop(&mut self) {
        if self.0.tasks.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn phases_only_move_forward_and_idle_waits_for_every_guard() {
        let drain = Arc::new(Drain::new());
        assert!(!drain.is_draining());
        drain.enter(Phase::HandingOver);
        drain.enter(Phase::Draining);
        assert_eq!(drain.phase(), Phase::HandingOver);
        drain.reached(Phase::Draining).await;
        let first = drain.task();
        let second = drain.task();
        let waiting = tokio::spawn({
            let drain = drain.clone();
            async move { drain.idle().await }
        });
        drop(first);
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "one guard is still held");
        drop(second);
        waiting.await.unwrap();
        assert_eq!(drain.running(), 0);
    }

    /// On a current-thread runtime a spawned task is not polled before the spawner yields: the
    /// guard must already be counted then (red with the guard taken inside the task).
    #[tokio::test(flavor = "current_thread")]
    async fn spawned_work_is_counted_before_its_first_poll() {
        let drain = Arc::new(Drain::new());
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let work = drain.spawn(async move {
            let _ = released.await;
        });
        assert_eq!(drain.running(), 1, "counted before the task ran");
        let idle = tokio::spawn({
            let drain = drain.clone();
            async move { drain.idle().await }
        });
        tokio::task::yield_now().await;
        assert!(!idle.is_finished(), "the drain waits for spawned work");
        release.send(()).unwrap();
        work.await.unwrap();
        idle.await.unwrap();
        assert_eq!(drain.running(), 0);
    }
}
