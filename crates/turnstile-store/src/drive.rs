//! The one mapping from the driver's [`StoreOp`]s to [`Ledger`] calls, used by every pump
//! (the gateway's tokio task and the simulation), so what is written for a driver decision is
//! written the same way everywhere.

use crate::{
    BeginExpect, BeginOutcome, BindOutcome, Carried, CommitOutcome, CommitRefusal, DispatchRecord, Lease,
    Ledger, QuarantineEntry, TransitionOutcome,
};
use std::sync::Arc;
use turnstile_core::dispatch::Timestamp;
use turnstile_drive::{AttemptView, DispatchBasis, RecoverySpent, StoreOp, StoreResult};

/// What the driver needs of a stored dispatch.
pub fn basis_of(record: &DispatchRecord) -> DispatchBasis {
    DispatchBasis {
        operation_id: record.operation_id.clone(),
        revision: record.revision,
        cancel_generation: record.cancel_generation,
        request_digest: record.request_digest.clone(),
        request_bytes: Arc::new(record.request_bytes.clone()),
    }
}

/// Perform `op` for `operation_id` as lease holder `holder`; the answer for
/// `Drive::handle_store`. A store error is [`StoreResult::Failed`]: its outcome is unknown.
///
/// One clock for fencing: every lease this writes and every lease comparison the store makes is
/// on the store's clock ([`Ledger::store_now`]). `caller_now` is the driver's own clock; a
/// lease end it asks for is written as the same *duration* from the store's now, and leases
/// it reads back are moved into its clock the same way, so a replica whose clock is skewed
/// (by any amount) agrees with every other replica on when a lease runs out.
pub async fn perform(
    ledger: &dyn Ledger,
    holder: &str,
    operation_id: &str,
    op: &StoreOp,
    caller_now: Timestamp,
) -> StoreResult {
    perform_with_evidence(ledger, holder, operation_id, op, caller_now, Vec::new()).await
}

/// [`perform`], with attempt evidence the pump gathered (`Ledger::record_evidence`) appended in
/// a winning commit's transaction; ignored by every other operation.
pub async fn perform_with_evidence(
    ledger: &dyn Ledger,
    holder: &str,
    operation_id: &str,
    op: &StoreOp,
    caller_now: Timestamp,
    evidence: Vec<(turnstile_core::Generation, serde_json::Value)>,
) -> StoreResult {
    let fenced = matches!(
        op,
        StoreOp::Begin { .. }
            | StoreOp::Replay { .. }
            | StoreOp::Resume { .. }
            | StoreOp::RenewLease { .. }
            | StoreOp::AbandonAndRearm { .. }
            | StoreOp::FailOver { .. }
            | StoreOp::ReadAttempts
    );
    let now = if fenced {
        match ledger.store_now().await {
            Ok(store_now) => store_now,
            Err(error) => return StoreResult::Failed(error.to_string()),
        }
    } else {
        caller_now
    };
    let clocks = Clocks {
        caller_now,
        store_now: now,
    };
    let lease = |expires_at| Lease {
        holder: holder.to_owned(),
        expires_at: clocks.to_store(expires_at),
    };
    let failed = |error: crate::StoreError| StoreResult::Failed(error.to_string());
    let transition = |outcome: Result<TransitionOutcome, crate::StoreError>| match outcome {
        Ok(TransitionOutcome::Applied) => StoreResult::Applied,
        Ok(TransitionOutcome::Refused { .. }) => StoreResult::Refused,
        Err(error) => failed(error),
    };
    match op {
        StoreOp::Begin {
            target,
            expected_revision,
            expected_cancel_generation,
            lease_expires_at,
        } => {
            let expect = BeginExpect {
                revision: *expected_revision,
                cancel_generation: *expected_cancel_generation,
                target: *target,
            };
            match ledger
                .begin_attempt(operation_id, expect, &lease(*lease_expires_at), now)
                .await
            {
                Ok(BeginOutcome::Began {
                    generation,
                    idempotency_key,
                }) => StoreResult::Began {
                    generation,
                    idempotency_key,
                },
                Ok(BeginOutcome::Refused { .. }) => StoreResult::BeginRefused,
                Err(error) => failed(error),
            }
        }
        StoreOp::Resume {
            generation,
            lease_expires_at,
        } => transition(
            ledger
                .resume_attempt(operation_id, *generation, &lease(*lease_expires_at), now)
                .await,
        ),
        StoreOp::Transition {
            generation,
            from,
            to,
            reason,
        } => transition(match reason {
            Some(reason) => {
                ledger
                    .end_attempt(operation_id, *generation, *from, *to, reason, now)
                    .await
            }
            None => {
                ledger
                    .transition(operation_id, *generation, *from, *to, now)
                    .await
            }
        }),
        StoreOp::FailOver {
            generation,
            from,
            reason,
        } => transition(
            ledger
                .fail_over(operation_id, *generation, *from, reason, now)
                .await,
        ),
        StoreOp::Replay {
            generation,
            lease_expires_at,
        } => transition(
            ledger
                .replay_attempt(operation_id, *generation, &lease(*lease_expires_at), now)
                .await,
        ),
        StoreOp::AbandonAndRearm {
            generation,
            provider_ended,
            provider_word,
        } => transition(match provider_word {
            Some(word) => {
                ledger
                    .abandon_on_provider_word(operation_id, *generation, word, now)
                    .await
            }
            None => {
                ledger
                    .abandon_and_rearm(operation_id, *generation, *provider_ended, now)
                    .await
            }
        }),
        StoreOp::RenewLease {
            generation,
            lease_expires_at,
        } => transition(
            ledger
                .renew_lease(operation_id, *generation, &lease(*lease_expires_at), now)
                .await,
        ),
        StoreOp::BindHandle { generation, handle } => {
            match ledger.bind_handle(operation_id, *generation, handle, now).await {
                Ok(BindOutcome::Refused { .. }) => StoreResult::BindRefused,
                Ok(BindOutcome::Bound | BindOutcome::AlreadyBound | BindOutcome::StaleGeneration) => {
                    StoreResult::Applied
                }
                Err(error) => failed(error),
            }
        }
        StoreOp::Commit {
            generation,
            expected_revision,
            turn,
            outcome,
            from,
            handle,
            bind,
        } => match ledger
            .commit_carrying(
                operation_id,
                *generation,
                *expected_revision,
                turn,
                outcome.as_ref(),
                &Carried {
                    from: *from,
                    handle: handle.clone(),
                    bind: *bind,
                    evidence,
                },
                now,
            )
            .await
        {
            Ok(CommitOutcome::Committed { revision, .. }) => StoreResult::Committed { revision },
            Ok(CommitOutcome::Refused(CommitRefusal::ForeignHandle)) => StoreResult::BindRefused,
            Ok(CommitOutcome::Refused(_)) => StoreResult::CommitRefused,
            Ok(CommitOutcome::Rejected(violations)) => {
                StoreResult::CommitRejected(violations.into_iter().map(|violation| violation.code).collect())
            }
            Err(error) => failed(error),
        },
        StoreOp::Cancel {
            expected_cancel_generation,
        } => match ledger
            .cancel(operation_id, Some(*expected_cancel_generation), now)
            .await
        {
            Ok(_) => StoreResult::Applied,
            Err(error) => failed(error),
        },
        StoreOp::Quarantine {
            generation,
            reason,
            content,
        } => {
            let entry = QuarantineEntry {
                operation_id: operation_id.to_owned(),
                generation: *generation,
                reason: (*reason).to_owned(),
                content: content.clone(),
            };
            match ledger.quarantine(&entry, now).await {
                Ok(_) => StoreResult::Applied,
                Err(error) => failed(error),
            }
        }
        StoreOp::ReadAttempts => match ledger.attempts(operation_id).await {
            Ok(attempts) => StoreResult::Attempts(
                attempts
                    .into_iter()
                    .map(|attempt| AttemptView {
                        spent: spent_of(&attempt),
                        generation: attempt.generation,
                        handle: attempt.handle,
                        idempotency_key: attempt.idempotency_key,
                        lease_expires_at: clocks.to_caller(attempt.lease_expires_at),
                        target: attempt.target,
                    })
                    .collect(),
            ),
            Err(error) => failed(error),
        },
    }
}

/// What recovery already spent on a stored attempt.
pub fn spent_of(attempt: &crate::AttemptRecord) -> RecoverySpent {
    RecoverySpent {
        resumes: attempt.resumes,
        replays: attempt.replays,
    }
}

/// The store's now and a caller's now, read together: durations carry over between them.
#[derive(Clone, Copy)]
struct Clocks {
    caller_now: Timestamp,
    store_now: Timestamp,
}

impl Clocks {
    /// A caller's instant as the same distance from the store's now.
    fn to_store(self, at: Timestamp) -> Timestamp {
        Timestamp(
            self.store_now
                .0
                .saturating_add(at.0)
                .saturating_sub(self.caller_now.0),
        )
    }

    /// A store instant as the same distance from the caller's now.
    fn to_caller(self, at: Timestamp) -> Timestamp {
        Timestamp(
            self.caller_now
                .0
                .saturating_add(at.0)
                .saturating_sub(self.store_now.0),
        )
    }
}

/// Attempts the store already holds for `record`: the attempt budget is durable, counted
/// across restarts and replicas.
pub async fn attempts_before(ledger: &dyn Ledger, record: &DispatchRecord) -> u64 {
    attempts_so_far(ledger, record).await.0
}

/// [`attempts_before`] and the target of the latest attempt (None: no attempt, or unread), for
/// `DriveSpec::attempts_before` and `DriveSpec::last_target`.
pub async fn attempts_so_far(ledger: &dyn Ledger, record: &DispatchRecord) -> (u64, Option<u32>) {
    if record.active_generation.is_none() {
        return (0, None);
    }
    match ledger.attempts(&record.operation_id).await {
        Ok(attempts) => (
            attempts.len() as u64,
            attempts.last().map(|attempt| attempt.target),
        ),
        // Unread: the highest generation the record names is a lower bound (generations
        // start at 1 and only grow).
        Err(_) => (
            record.active_generation.map_or(0, |generation| generation.0),
            None,
        ),
    }
}

/// How often a replica sweeps for attempts whose lease ran out and dispatches nobody drives:
/// half a lease (at least 100 ms), so a dead attempt is recovered within 1.5 leases.
pub const fn sweep_period_ms(lease_ms: u64) -> u64 {
    let half = lease_ms / 2;
    if half < 100 { 100 } else { half }
}

/// Most PREPARED dispatches one sweep picks up.
pub const PREPARED_PICKUP_MAX: u64 = 256;

/// A dispatch nobody drives, ready for a driver.
#[derive(Clone, Debug)]
pub enum Recoverable {
    /// Its active attempt is UNKNOWN: `Drive::recovered`.
    Unknown {
        /// The stored dispatch.
        record: DispatchRecord,
        /// Its UNKNOWN attempt, its lease in the caller's clock.
        attempt: turnstile_core::dispatch::UnknownAttempt,
        /// What recovery already spent on that attempt (for `Drive::recovered`).
        spent: RecoverySpent,
        /// Which target that attempt sent.
        target: u32,
    },
    /// PREPARED and not touched for a lease: `Drive::new` (its begin is a compare-and-set,
    /// so a driver that is about to begin it elsewhere loses nothing).
    Prepared {
        /// The stored dispatch.
        record: DispatchRecord,
    },
}

impl Recoverable {
    /// The stored dispatch.
    pub fn record(&self) -> &DispatchRecord {
        match self {
            Recoverable::Unknown { record, .. } | Recoverable::Prepared { record } => record,
        }
    }
}

/// Start-up recovery and the lease sweep, decided once for every pump: live attempts of
/// `holder` and attempts whose lease expired (by the store's clock) become UNKNOWN
/// (`Ledger::recover_startup`), and each dispatch whose *active* attempt is UNKNOWN is answered
/// once; PREPARED dispatches untouched for `prepared_idle_ms` (0 at start-up: all of them) are
/// answered too, so no dispatch depends on a request future staying alive.
pub async fn recoverable(
    ledger: &dyn Ledger,
    holder: &str,
    now: Timestamp,
    prepared_idle_ms: u64,
) -> Result<Vec<Recoverable>, crate::StoreError> {
    let clocks = Clocks {
        caller_now: now,
        store_now: ledger.store_now().await?,
    };
    let report = ledger.recover_startup(holder, clocks.store_now).await?;
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for attempt in report.unknown {
        if !seen.insert(attempt.operation_id.clone()) {
            continue;
        }
        let Some(record) = ledger.dispatch(&attempt.operation_id).await? else {
            continue;
        };
        if record.state != turnstile_core::dispatch::DispatchState::Unknown
            || record.active_generation != Some(attempt.generation)
        {
            continue;
        }
        out.push(Recoverable::Unknown {
            record,
            attempt: turnstile_core::dispatch::UnknownAttempt {
                generation: attempt.generation,
                handle: attempt.handle.clone(),
                idempotency_key: attempt.idempotency_key.clone(),
                lease_expires_at: clocks.to_caller(attempt.lease_expires_at),
                provider_confirmed_ended: false,
            },
            spent: spent_of(&attempt),
            target: attempt.target,
        });
    }
    for operation_id in ledger
        .prepared_unattended(prepared_idle_ms, PREPARED_PICKUP_MAX)
        .await?
    {
        if !seen.insert(operation_id.clone()) {
            continue;
        }
        if let Some(record) = ledger.dispatch(&operation_id).await?
            && record.state == turnstile_core::dispatch::DispatchState::Prepared
        {
            out.push(Recoverable::Prepared { record });
        }
    }
    Ok(out)
}
