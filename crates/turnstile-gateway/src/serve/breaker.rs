//! The failover circuit breaker: per target (`provider/model`), consecutive failures of this
//! process (a refused request with a failover status, no connection, no response head in
//! time, a stream cut before its stop signal) open it for a cool-down; a 429's `retry-after`
//! opens it at once for that long. A dispatch with several targets skips a cooling one when
//! it chooses where to begin or where to go next, unless no other is left
//! (`DriveSpec::cooling`). A single-target dispatch is never refused by it. One per process;
//! the wall clock is fine here: nothing is fenced by it, it only orders preferences.

use std::collections::HashMap;
use std::sync::Mutex;
use turnstile_core::dispatch::Timestamp;

/// Consecutive failures that open a target's breaker (`failover_breaker_failures`).
pub const FAILURES_DEFAULT: u32 = 3;
/// How long an opened breaker keeps its target cooling (`failover_cooldown_ms`).
pub const COOLDOWN_MS_DEFAULT: u64 = 30_000;
/// Longest `retry-after` honoured as a cool-down (a larger one is capped).
pub const RETRY_AFTER_MS_MAX: u64 = 600_000;
/// Most targets remembered (the least recently failed are forgotten beyond it).
const TARGETS_MAX: usize = 4_096;

#[derive(Clone, Copy, Debug)]
struct Entry {
    failures: u32,
    open_until: Option<Timestamp>,
    last_failure: Timestamp,
}

/// Per-target failure counts and cool-downs.
pub struct Breaker {
    entries: Mutex<HashMap<String, Entry>>,
    failures: u32,
    cooldown_ms: u64,
}

impl Breaker {
    /// A breaker opening after `failures` consecutive failures for `cooldown_ms`.
    pub fn new(failures: u32, cooldown_ms: u64) -> Breaker {
        Breaker {
            entries: Mutex::new(HashMap::new()),
            failures: failures.max(1),
            cooldown_ms,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether `label`'s target is cooling down at `now`.
    pub fn cooling(&self, label: &str, now: Timestamp) -> bool {
        self.lock()
            .get(label)
            .and_then(|entry| entry.open_until)
            .is_some_and(|until| now < until)
    }

    /// A failure of `label`'s target; `retry_after_ms`: the provider asked to wait that long.
    pub fn failure(&self, label: &str, retry_after_ms: Option<u64>, now: Timestamp) {
        let mut entries = self.lock();
        if entries.len() >= TARGETS_MAX && !entries.contains_key(label) {
            let oldest = entries
                .iter()
                .min_by_key(|(_, entry)| entry.last_failure)
                .map(|(label, _)| label.clone());
            if let Some(oldest) = oldest {
                entries.remove(&oldest);
            }
        }
        let entry = entries.entry(label.to_owned()).or_insert(Entry {
            failures: 0,
            open_until: None,
            last_failure: now,
        });
        entry.failures = entry.failures.saturating_add(1);
        entry.last_failure = now;
        let mut until = entry.open_until.filter(|until| now < *until);
        if entry.failures >= self.failures {
            until = until.max(Some(now.plus_ms(self.cooldown_ms)));
        }
        if let Some(wait) = retry_after_ms {
            until = until.max(Some(now.plus_ms(wait.min(RETRY_AFTER_MS_MAX))));
        }
        entry.open_until = until;
    }

    /// A success of `label`'s target: its failures are forgotten and it is not cooling.
    /// How many targets are cooling down at `now` (`turnstile_breaker_open_targets`).
    pub fn open_count(&self, now: Timestamp) -> usize {
        self.lock()
            .values()
            .filter(|entry| entry.open_until.is_some_and(|until| now < until))
            .count()
    }

    pub fn success(&self, label: &str) {
        self.lock().remove(label);
    }
}

/// `retry-after` as milliseconds: delta-seconds only (an HTTP date is not read: it needs the
/// provider's clock).
pub fn retry_after_ms(value: &str) -> Option<u64> {
    let seconds: f64 = value.trim().parse().ok()?;
    (seconds.is_finite() && seconds >= 0.0).then(|| (seconds * 1000.0).min(RETRY_AFTER_MS_MAX as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_failures_open_the_breaker_for_the_cooldown_and_a_success_closes_it() {
        let breaker = Breaker::new(2, 1_000);
        let at = Timestamp(10_000);
        breaker.failure("a/m", None, at);
        assert!(!breaker.cooling("a/m", at), "one failure is not enough");
        breaker.failure("a/m", None, at);
        assert!(breaker.cooling("a/m", at.plus_ms(999)));
        assert!(!breaker.cooling("a/m", at.plus_ms(1_000)), "the cool-down ends");
        assert!(!breaker.cooling("b/m", at), "per target");
        breaker.success("a/m");
        breaker.failure("a/m", None, at);
        assert!(!breaker.cooling("a/m", at), "a success resets the count");
    }

    #[test]
    fn a_retry_after_cools_the_target_at_once_for_that_long() {
        let breaker = Breaker::new(3, 1_000);
        let at = Timestamp(0);
        breaker.failure("a/m", Some(5_000), at);
        assert!(breaker.cooling("a/m", at.plus_ms(4_999)));
        assert!(!breaker.cooling("a/m", at.plus_ms(5_000)));
        assert_eq!(retry_after_ms("2"), Some(2_000));
        assert_eq!(retry_after_ms(" 0.5 "), Some(500));
        assert_eq!(retry_after_ms("Wed, 21 Oct 2026 07:28:00 GMT"), None);
        assert_eq!(retry_after_ms("-1"), None);
        assert_eq!(retry_after_ms("1e12"), Some(RETRY_AFTER_MS_MAX));
    }
}
