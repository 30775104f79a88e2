//! What start-up failures are, for the operator: which stage failed (configuration, store,
//! listen: one exit status each, `cli::Exit`), and the store's bounded retry at start
//! (`store_connect_retry_ms`), so that replicas may start before their database.

use std::time::{Duration, Instant};
use turnstile_store::{Ledger, StoreError, StoreOptions};

/// The stage a start-up (or the serving after it) failed in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The configuration file, a flag, or something it names (an unset environment variable,
    /// a bad OTLP endpoint).
    Config,
    /// The store: unreachable, refused us, or failed start-up recovery.
    Store,
    /// The listening socket (address in use, no permission) or the serving on it.
    Listen,
}

/// Why `turnstile serve` stopped with a failure.
#[derive(Debug)]
pub struct Failure {
    /// Where.
    pub stage: Stage,
    /// What, in words an operator acts on.
    pub message: String,
}

impl Failure {
    /// A configuration failure.
    pub fn config(message: impl Into<String>) -> Failure {
        Failure {
            stage: Stage::Config,
            message: message.into(),
        }
    }

    /// A store failure.
    pub fn store(message: impl Into<String>) -> Failure {
        Failure {
            stage: Stage::Store,
            message: message.into(),
        }
    }

    /// A listen failure.
    pub fn listen(message: impl Into<String>) -> Failure {
        Failure {
            stage: Stage::Listen,
            message: message.into(),
        }
    }
}

/// First wait between two connection attempts; it doubles up to [`RETRY_WAIT_MAX`].
const RETRY_WAIT_FIRST: Duration = Duration::from_millis(100);
/// Longest wait between two connection attempts.
const RETRY_WAIT_MAX: Duration = Duration::from_secs(2);

/// Open the store at `url`, trying again for up to `retry` while the failure is one that
/// waiting may cure ([`turnstile_store::ConnectCause::retryable`]); each attempt is bounded by
/// `options.timeout_ms`. Returns the last failure once the window has passed, or at once for a
/// failure no wait cures.
pub async fn open_store(
    url: &str,
    options: StoreOptions,
    retry: Duration,
) -> Result<Box<dyn Ledger>, StoreError> {
    let deadline = Instant::now() + retry;
    let mut wait = RETRY_WAIT_FIRST;
    let mut attempts = 1u32;
    loop {
        let error = match turnstile_store::open_with(url, options).await {
            Ok(ledger) => return Ok(ledger),
            Err(error) => error,
        };
        let retryable = matches!(&error, StoreError::Connect { cause, .. } if cause.retryable());
        let left = deadline.saturating_duration_since(Instant::now());
        if !retryable || left.is_zero() {
            return Err(error);
        }
        let pause = wait.min(left);
        tracing::warn!(
            attempts,
            retry_in_ms = pause.as_millis() as u64,
            window_left_ms = left.as_millis() as u64,
            %error,
            "the store cannot be reached yet; trying again within store_connect_retry_ms"
        );
        tokio::time::sleep(pause).await;
        wait = (wait * 2).min(RETRY_WAIT_MAX);
        attempts += 1;
    }
}
