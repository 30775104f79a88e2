//! Fault plans (probabilities drawn per seed: calm seeds and storms) and the planted bugs the
//! "checker can fail" tests switch on.

use crate::rng::Rng;

/// Every fault the world injects, counted by kind in the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// The gateway process crashed after an effect boundary (memory dropped, file reopened,
    /// recovery run).
    Crash,
    /// A store transaction lost its connection before COMMIT.
    StoreDropBeforeCommit,
    /// A store transaction committed, then lost its connection before the answer.
    StoreDropAfterCommit,
    /// The provider answered 429.
    Provider429,
    /// The provider answered 500.
    Provider500,
    /// The connection was cut at an arbitrary byte (tool arguments cut mid-token included).
    CutAtByte,
    /// The connection closed after some whole events.
    Disconnect,
    /// Every event was sent twice.
    DuplicateDeltas,
    /// The stop event(s) were left out (the body still ended cleanly).
    LostStop,
    /// The provider reported a handle already bound to another dispatch's manifest.
    ForeignHandle,
    /// An older generation's stream kept delivering after a newer attempt started.
    OldStreamResumed,
    /// The provider refused to resume a stream by handle.
    ResumeRefused,
    /// The adapter was upgraded (@1 → @2) between prepare and a retry.
    AdapterUpgrade,
    /// A client offered a result for a call that does not exist.
    OrphanResult,
    /// A client offered a second result for one call.
    DuplicateResult,
    /// The provider honoured an idempotency key by replaying the first reply.
    IdempotentReplay,
    /// The provider accepted a request and never sent a response head.
    HungHead,
    /// The provider's stream never ended (pings only after some events).
    EndlessStream,
    /// The client left after its dispatch was prepared, before a driver started.
    ClientLeft,
    /// Two operations raced on one revision (on different replicas).
    RacingOperations,
    /// The second replica's clock is skewed against the store's (per seed).
    ClockSkew,
    /// The client retried an operation with the same operation id (it attaches).
    ClientRetry,
    /// An executor claimed a tool call and died before its result.
    ExecutorCrash,
    /// The operation was prepared with a failover target (its own manifest) beside its own.
    FailoverTargets,
    /// A dialect, not a fault: an OpenAI Chat body ended after its finish reason and usage,
    /// without `data: [DONE]`.
    NoDone,
    /// A dialect, not a fault: a whole JSON answer to the stream request.
    JsonAnswer,
    /// One replica was cut off from the store for a while (its store operations failed, its
    /// provider connections went on), shorter or longer than a lease.
    StorePartition,
    /// One replica stopped running for a while (a stop-the-world pause, a frozen VM): its
    /// timers, store answers and provider bytes wait, its connections stay open, shorter or
    /// longer than a lease.
    ReplicaPause,
    /// One replica's store stopped answering for a while (a lock, a stuck disk, a failing-over
    /// primary): its drivers' operations answer late, or `Failed` at the driver's
    /// `store_wait_deadline`, shorter or longer than a lease (issue 49).
    StoreStall,
    /// A stalled write landed in the store after its driver had been told it failed.
    StoreLateWrite,
}

impl FaultKind {
    /// The name used in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Crash => "crash",
            FaultKind::StoreDropBeforeCommit => "store_drop_before_commit",
            FaultKind::StoreDropAfterCommit => "store_drop_after_commit",
            FaultKind::Provider429 => "provider_429",
            FaultKind::Provider500 => "provider_500",
            FaultKind::CutAtByte => "cut_at_byte",
            FaultKind::Disconnect => "disconnect",
            FaultKind::DuplicateDeltas => "duplicate_deltas",
            FaultKind::LostStop => "lost_stop",
            FaultKind::ForeignHandle => "foreign_handle",
            FaultKind::OldStreamResumed => "old_stream_resumed",
            FaultKind::ResumeRefused => "resume_refused",
            FaultKind::AdapterUpgrade => "adapter_upgrade",
            FaultKind::OrphanResult => "orphan_result",
            FaultKind::DuplicateResult => "duplicate_result",
            FaultKind::IdempotentReplay => "idempotent_replay",
            FaultKind::HungHead => "hung_head",
            FaultKind::EndlessStream => "endless_stream",
            FaultKind::ClientLeft => "client_left",
            FaultKind::RacingOperations => "racing_operations",
            FaultKind::ClockSkew => "clock_skew",
            FaultKind::ClientRetry => "client_retry",
            FaultKind::ExecutorCrash => "executor_crash",
            FaultKind::FailoverTargets => "failover_targets",
            FaultKind::NoDone => "no_done",
            FaultKind::JsonAnswer => "json_answer",
            FaultKind::StorePartition => "store_partition",
            FaultKind::ReplicaPause => "replica_pause",
            FaultKind::StoreStall => "store_stall",
            FaultKind::StoreLateWrite => "store_late_write",
        }
    }
}

/// Probabilities of each fault for one seed, plus the provider's recovery abilities.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultPlan {
    /// Crash after an effect boundary (per effect).
    pub crash: f64,
    /// A store write loses its connection (per write).
    pub store_drop: f64,
    /// Provider answers 429 or 500 (per request).
    pub status: f64,
    /// Cut the body at an arbitrary byte (per request).
    pub cut: f64,
    /// Close after some whole events (per request).
    pub disconnect: f64,
    /// Send every event twice (per request).
    pub duplicate: f64,
    /// Leave out the stop event (per request).
    pub lost_stop: f64,
    /// Report a handle bound to another manifest (per request).
    pub foreign_handle: f64,
    /// Keep an old stream alive across a crash and deliver it to the new process (per crash).
    pub old_stream: f64,
    /// Refuse a resume by handle (per resume).
    pub resume_refused: f64,
    /// A client offers an orphan result (per round).
    pub orphan_result: f64,
    /// A client offers a duplicate result (per call).
    pub duplicate_result: f64,
    /// Upgrade the configured adapter @1 → @2 at the first crash.
    pub adapter_upgrade: bool,
    /// The provider honours idempotency keys.
    pub honours_idempotency_key: bool,
    /// The provider lets Responses streams be resumed by handle.
    pub resume_by_handle: bool,
    /// Never send a response head (per request).
    pub hang: f64,
    /// Stream pings for ever after some events (per request).
    pub endless: f64,
    /// The client leaves after its dispatch was prepared (per operation).
    pub client_leaves: f64,
    /// Start two operations at once on one revision (per operation).
    pub race: f64,
    /// The client retries an operation with the same id (per operation).
    pub client_retry: f64,
    /// The second replica's clock minus the store's, in ms (within and beyond the lease).
    pub skew_ms: i64,
    /// An executor dies between claim and result (per call).
    pub executor_crash: f64,
    /// An operation names a failover target beside its own (per operation).
    pub failover: f64,
    /// How often the provider speaks a dialect compatible servers speak (per request): no
    /// `[DONE]` on OpenAI Chat, a whole JSON answer to a stream request. Not a fault: it stays
    /// in the liveness phase.
    pub dialect: f64,
    /// One replica is cut off from the store for a window of the safety phase (per seed).
    pub partition: f64,
}

impl FaultPlan {
    /// Draw a plan: each fault is off half the time, otherwise up to its storm rate.
    pub fn draw(rng: &mut Rng) -> FaultPlan {
        let mut rate = |max: f64| if rng.chance(0.5) { 0.0 } else { rng.unit() * max };
        let crash = rate(0.08);
        let store_drop = rate(0.05);
        let status = rate(0.3);
        let cut = rate(0.4);
        let disconnect = rate(0.3);
        let duplicate = rate(0.5);
        let lost_stop = rate(0.3);
        let foreign_handle = rate(0.2);
        let old_stream = rate(0.8);
        let resume_refused = rate(0.5);
        let orphan_result = rate(0.8);
        let duplicate_result = rate(0.5);
        let hang = rate(0.15);
        let endless = rate(0.15);
        let client_leaves = rate(0.3);
        let race = rate(0.5);
        let client_retry = rate(0.5);
        let executor_crash = rate(0.5);
        FaultPlan {
            crash,
            store_drop,
            status,
            cut,
            disconnect,
            duplicate,
            lost_stop,
            foreign_handle,
            old_stream,
            resume_refused,
            orphan_result,
            duplicate_result,
            adapter_upgrade: rng.chance(0.5),
            honours_idempotency_key: rng.chance(0.3),
            resume_by_handle: rng.chance(0.5),
            hang,
            endless,
            client_leaves,
            race,
            client_retry,
            executor_crash,
            skew_ms: match rng.below(5) {
                0 => 0,
                1 => 2_500,
                2 => -2_500,
                3 => 15_000,
                _ => -15_000,
            },
            failover: if rng.chance(0.5) { 0.0 } else { rng.unit() * 0.6 },
            dialect: if rng.chance(0.5) { 0.0 } else { rng.unit() * 0.5 },
            partition: if rng.chance(0.6) { 0.0 } else { 1.0 },
        }
    }

    /// The same provider abilities with every fault healed (the liveness phase).
    pub fn healed(&self) -> FaultPlan {
        FaultPlan {
            adapter_upgrade: false,
            honours_idempotency_key: self.honours_idempotency_key,
            resume_by_handle: self.resume_by_handle,
            skew_ms: self.skew_ms,
            dialect: self.dialect,
            ..FaultPlan::default()
        }
    }
}

/// Bugs planted on purpose, to show the checker catches each one. All off in a real run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bugs {
    /// Open the provider request before the begin write (bytes before a durable DISPATCHING).
    pub send_before_persist: bool,
    /// Re-render with the currently configured adapter on a retry instead of sending the
    /// stored bytes.
    pub rerender_on_retry: bool,
    /// Append a late or foreign turn through `append_turn` instead of quarantining it (a commit
    /// without the generation condition).
    pub commit_late_turn: bool,
    /// Show tool calls to executors from the commit offer, before the commit CAS.
    pub expose_before_commit: bool,
    /// Drop retract events (previews of a lost generation stay on screen).
    pub skip_retract: bool,
    /// Cut a tool call's arguments in the offered turn before the commit.
    pub commit_partial_arguments: bool,
    /// Never fire the "old lease ran out" timer (UNKNOWN waits forever).
    pub no_lease_timer: bool,
    /// Count foreign-handle refusals twice in the world's own tally (metrics drift).
    pub miscount_foreign_handles: bool,
    /// Judge leases by each replica's own clock (the store's SQL clock follows the calling
    /// replica's): the defect "lease expiry judged by each replica's wall clock".
    pub replica_clock_fencing: bool,
    /// Resume by handle without moving the lease to the resuming replica (the defect "a
    /// resumed attempt taken over by another replica never finishes").
    pub resume_keeps_holder: bool,
    /// The sweep ignores PREPARED dispatches nobody drives (the defect "a client that
    /// disconnects while its dispatch is prepared leaves it PREPARED for ever").
    pub sweep_skips_prepared: bool,
    /// No bound on how long one attempt may stream (the defect "no stream deadline").
    pub no_attempt_deadline: bool,
    /// A dead executor comes back and answers with the call's current claim instead of its own
    /// (an executor that "blindly claims a call listed as claimed").
    pub executor_uses_current_claim: bool,
    /// A failover attempt sends the first target's bytes (the pump looks up the wrong
    /// target): a body that is not its attempt's manifest.
    pub failover_sends_first_target: bool,
    /// A proxy client's answer is built from the commit with its last tool call left out.
    pub proxy_answer_drops_call: bool,
}
