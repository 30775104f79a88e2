//! The `Ledger` trait and its SQLite (embedded default) and PostgreSQL implementations. The
//! store is the arbiter: every state change that matters is a conditional write whose
//! condition is the invariant (revision, cancel generation, active generation, state), and the
//! affected-row count decides the winner. Nothing here relies on an in-process lock or on
//! SERIALIZABLE isolation for correctness: two gateway replicas with their own connection
//! pools on one database can race any operation and exactly one wins.
//!
//! Layout: [`ops`] holds every operation once, as `async fn`s over the small [`sql::Tx`]
//! surface; [`sqlite::SqliteLedger`] drives them on one writer thread with group commit,
//! [`postgres::PgLedger`] on a deadpool of tokio-postgres connections. [`types`] holds the
//! records and the outcome enums (a lost compare-and-set is an outcome, not an error).
//!
//! Time is passed in by the caller ([`Timestamp`], milliseconds since the Unix epoch), as in
//! the core: the history rows and leases are as reproducible as the core's decisions.
//! The tool-call ledger's claim leases are the exception: they are set and judged by the
//! store's own clock inside each statement ([`clock`]; `Ledger::claim_call`), so executors and
//! replicas with different clocks agree on when a claim ran out.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - readiness reports failing writes (a full disk) that reads do not show, and recovers without
//!   traffic. Enforced in `store/src/lib.rs::WriteHealth` (recorded per write transaction),
//!   `Ledger::write_probe`, `api.rs::readyz`. Tests:
//!   `gateway/tests/it/health.rs::readiness_reports_failing_writes…` (red without the probe),
//!   `store/tests/it/bounded.rs::a_sqlite_write_lock_held…`.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod clock;
pub mod drive;
pub mod error;
pub mod faults;
mod history;
pub mod listing;
pub mod migrations;
pub mod ops;
pub mod postgres;
pub mod sql;
pub mod sqlite;
pub mod types;

pub use clock::StoreClock;
pub use error::{ConnectCause, StoreError};
pub use faults::{Fault, FaultInjector};
pub use listing::{
    ConversationCursor, ConversationPage, ConversationQuery, ConversationSummary, LastDispatch,
    PendingFilter, QuarantinePage,
};
pub use postgres::PgLedger;
pub use sqlite::{SqliteLedger, Synchronous};
pub use turnstile_core::dispatch::{DispatchState, Timestamp};
pub use types::*;

use serde_json::Value;
use turnstile_core::manifest::DispatchManifest;
use turnstile_core::{Generation, Revision};

/// How a ledger bounds its waits ([`open_with`]).
#[derive(Clone, Copy, Debug)]
pub struct StoreOptions {
    /// Longest one operation may wait on PostgreSQL, pool wait and commit included
    /// (`store_timeout_ms`): also its `statement_timeout` and `lock_timeout`. Past it the
    /// operation fails with [`StoreError::TimedOut`] (the gateway answers 503
    /// `store_unavailable`). SQLite waits [`SQLITE_BUSY_TIMEOUT_MS`] for another process's
    /// write lock.
    pub timeout_ms: u64,
}

impl Default for StoreOptions {
    fn default() -> StoreOptions {
        StoreOptions {
            timeout_ms: STORE_TIMEOUT_MS_DEFAULT,
        }
    }
}

/// The outcome of a ledger's most recent write transaction ([`Ledger::write_failing`]).
#[derive(Debug, Default)]
pub struct WriteHealth {
    failing: std::sync::atomic::AtomicBool,
}

impl WriteHealth {
    /// A write transaction committed.
    pub fn committed(&self) {
        self.failing.store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// A transaction failed with `error`. Failures that say nothing about the store (our own
    /// illegal transition, the SQLite ledger's internal retry signal) are not recorded.
    pub fn failed(&self, error: &StoreError) {
        if !matches!(
            error,
            StoreError::HistoryNeeded { .. } | StoreError::IllegalTransition { .. }
        ) {
            self.failing.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The last write transaction failed and none committed since.
    pub fn failing(&self) -> bool {
        self.failing.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The durable dispatch ledger. Every method is one transaction; every write method is a
/// compare-and-set whose losing side is an ordinary outcome.
///
/// Async because the PostgreSQL driver is; the SQLite implementation runs the same operations
/// on its own writer thread (see [`sqlite`] for why not `spawn_blocking`).
#[async_trait::async_trait]
pub trait Ledger: Send + Sync {
    /// Operations of this process that changed at least one stored row and were committed
    /// (a count in memory, from zero at open): the durable writes a workload costs. A change
    /// an operation undid to a savepoint of its own still counts it.
    fn write_ops(&self) -> u64;

    /// Operations of this process that ended without changing a stored row (a count in
    /// memory, from zero at open): every read that succeeded, and every write that committed
    /// having changed nothing (an existing dispatch, a refusal that writes no row). With
    /// [`Ledger::write_ops`], the store round trips a workload costs. SQLite also counts the
    /// read a check makes of a history it has no validator state for, before its write;
    /// PostgreSQL makes that read inside the write.
    fn read_ops(&self) -> u64;

    /// Appends and commits of this process whose history check read and walked the whole
    /// stored history (no validator state kept for its revision); the others checked the new
    /// turn only.
    fn history_walks(&self) -> u64;

    /// Of [`Ledger::history_walks`], those made inside the write transaction. PostgreSQL walks
    /// in the operation's own transaction (its connection, not a shared thread); SQLite walks
    /// on the caller before its writer thread runs the operation, and in the writer only when
    /// that walk kept nothing usable: the state was taken or evicted again in between, the read
    /// failed, or the revision the check needs is not committed yet (two writes to one
    /// conversation in one group commit, such as parallel tool results). Such an operation
    /// counts two walks in `history_walks`.
    fn history_walks_in_transaction(&self) -> u64;

    /// Create a conversation at revision 0 with its declared tools (a v1 `tools` array).
    async fn create_conversation(
        &self,
        conversation_id: &str,
        tools: &Value,
        now: Timestamp,
    ) -> Result<CreateOutcome, StoreError>;

    /// Create a conversation with a whole validated history in one transaction, at revision
    /// `turns.len()` (the proxy's stateless import). Imported calls skip the execution ledger.
    async fn import_conversation(
        &self,
        conversation_id: &str,
        tools: &Value,
        turns: &[Value],
        now: Timestamp,
    ) -> Result<ImportOutcome, StoreError>;

    /// Ids (starting with `id_prefix`) of the conversations whose execution ledger holds a call
    /// with this id: how the proxy finds the conversation a stateless request continues.
    async fn conversations_with_call(
        &self,
        call_id: &str,
        id_prefix: &str,
    ) -> Result<Vec<String>, StoreError>;

    /// The committed history as a `turnstile.conversation.v1` document.
    async fn conversation(&self, conversation_id: &str) -> Result<Option<Value>, StoreError>;

    /// [`Ledger::conversation`] with the digest stored beside each turn, for a reader that
    /// decodes the turns and checks them against it (a dispatch).
    async fn conversation_with_digests(
        &self,
        conversation_id: &str,
    ) -> Result<Option<StoredConversation>, StoreError>;

    /// What a reader that holds the history up to revision `after` needs to be current: the
    /// conversation's revision, the id of its turn at `after` (to check the held history is
    /// this one) and the turns after it, in order. `None` when there is no such conversation.
    async fn conversation_since(
        &self,
        conversation_id: &str,
        after: Revision,
    ) -> Result<Option<ConversationTail>, StoreError>;

    /// Append a committed turn at `expected + 1` if the conversation is at `expected` and the
    /// would-be history passes the validator.
    async fn append_turn(
        &self,
        conversation_id: &str,
        expected: Revision,
        turn: &Value,
        now: Timestamp,
    ) -> Result<AppendOutcome, StoreError>;

    /// [`Ledger::append_turn`] of a repaired history's turn (`turnstile_core::repair`), with the
    /// durable record of the repair in the same transaction.
    async fn append_repair(
        &self,
        conversation_id: &str,
        expected: Revision,
        turn: &Value,
        repair: &NewRepair,
        now: Timestamp,
    ) -> Result<AppendOutcome, StoreError>;

    /// The repairs recorded for a conversation, oldest first (empty for none or no such
    /// conversation).
    async fn repairs(&self, conversation_id: &str) -> Result<Vec<RepairRecord>, StoreError>;

    /// Store a dispatch: the manifest as given and the exact request bytes. Idempotent on the
    /// manifest's `operation_id`.
    async fn prepare(
        &self,
        manifest: &DispatchManifest,
        request_bytes: &[u8],
        now: Timestamp,
    ) -> Result<PrepareOutcome, StoreError> {
        self.prepare_with_policy(manifest, request_bytes, None, now).await
    }

    /// [`Ledger::prepare`] that also keeps the render policy the manifest pins (it must hash
    /// to the manifest's `policy_digest`, else `Invalid`), for [`Ledger::dispatch_policy`].
    async fn prepare_with_policy(
        &self,
        manifest: &DispatchManifest,
        request_bytes: &[u8],
        policy: Option<&Value>,
        now: Timestamp,
    ) -> Result<PrepareOutcome, StoreError>;

    /// [`Ledger::prepare_with_policy`] for a dispatch with failover targets: the manifest is the
    /// dispatch's own (target 0); `fallbacks` are targets 1.., each with its own manifest for
    /// the same operation, conversation, revision and sequence, stored in the same
    /// transaction. An existing dispatch is `Existing` only if every target's manifest digest
    /// is the same, in the same order (else `Conflict`).
    async fn prepare_targets(
        &self,
        manifest: &DispatchManifest,
        request_bytes: &[u8],
        policy: Option<&Value>,
        fallbacks: &[PreparedTarget],
        now: Timestamp,
    ) -> Result<PrepareOutcome, StoreError>;

    /// [`Ledger::prepare_targets`] that also begins the first attempt of a dispatch it created,
    /// in the same transaction (PREPARED → DISPATCHING at once, on target `begin.target`, the
    /// lease from the store's now): the prepare and the acceptance point are one durable write.
    /// `None` beside an outcome other than `Created`.
    async fn prepare_and_begin(
        &self,
        manifest: &DispatchManifest,
        request_bytes: &[u8],
        policy: Option<&Value>,
        fallbacks: &[PreparedTarget],
        begin: &BeginAtOnce,
        now: Timestamp,
    ) -> Result<(PrepareOutcome, Option<BeginOutcome>), StoreError>;

    /// [`Ledger::import_conversation`] and, in the same transaction, the prepare of its first
    /// dispatch ([`Ledger::prepare_and_begin`] with `begin`, [`Ledger::prepare_targets`]
    /// without): a fresh proxy request's import, prepare and acceptance point are one durable
    /// write. The history and the prepare's inputs are checked before the transaction; nothing
    /// is written unless the history is legal and the id free (`NotImported`) and the inputs
    /// intact (`NotPrepared`).
    #[allow(clippy::too_many_arguments)]
    async fn import_and_prepare(
        &self,
        conversation_id: &str,
        tools: &Value,
        turns: &[Value],
        manifest: &DispatchManifest,
        request_bytes: &[u8],
        policy: Option<&Value>,
        fallbacks: &[PreparedTarget],
        begin: Option<&BeginAtOnce>,
        now: Timestamp,
    ) -> Result<ImportPrepared, StoreError>;

    /// [`Ledger::prepare_and_begin`] (with `begin`) or [`Ledger::prepare_targets`] (without)
    /// of targets sealed in this process: `target` is the dispatch's own, `fallbacks` the
    /// failover targets in order. Their digests are not computed again ([`SealedTarget`]);
    /// everything else is checked and stored as by those two.
    async fn prepare_sealed(
        &self,
        target: SealedTarget,
        fallbacks: Vec<SealedTarget>,
        begin: Option<&BeginAtOnce>,
        now: Timestamp,
    ) -> Result<(PrepareOutcome, Option<BeginOutcome>), StoreError>;

    /// [`Ledger::import_and_prepare`] of targets sealed in this process, their digests not
    /// computed again ([`Ledger::prepare_sealed`]).
    #[allow(clippy::too_many_arguments)]
    async fn import_and_prepare_sealed(
        &self,
        conversation_id: &str,
        tools: &Value,
        turns: &[Value],
        target: SealedTarget,
        fallbacks: Vec<SealedTarget>,
        begin: Option<&BeginAtOnce>,
        now: Timestamp,
    ) -> Result<ImportPrepared, StoreError>;

    /// The failover targets of a dispatch (positions 1.., in order; its own manifest, target
    /// 0, is the dispatch record); empty for most dispatches.
    async fn dispatch_fallbacks(&self, operation_id: &str) -> Result<Vec<TargetRecord>, StoreError>;

    /// The render policy kept with a dispatch (None: none was given, or no such dispatch).
    async fn dispatch_policy(&self, operation_id: &str) -> Result<Option<Value>, StoreError>;

    /// A dispatch by operation id.
    async fn dispatch(&self, operation_id: &str) -> Result<Option<DispatchRecord>, StoreError>;

    /// Its attempts with their transition history, oldest first.
    async fn attempts(&self, operation_id: &str) -> Result<Vec<AttemptRecord>, StoreError>;

    /// PREPARED → DISPATCHING: one conditional write on (conversation revision, cancel
    /// generation, state = PREPARED) that allocates the attempt generation and stores the
    /// request digest and idempotency key. Durable when it returns `Began`.
    async fn begin_attempt(
        &self,
        operation_id: &str,
        expect: BeginExpect,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<BeginOutcome, StoreError>;

    /// A fenced transition of the active attempt: SENT, STREAMING, UNKNOWN, FAILED,
    /// ABANDONED, and UNKNOWN → STREAMING when resuming by handle.
    async fn transition(
        &self,
        operation_id: &str,
        generation: Generation,
        from: DispatchState,
        to: DispatchState,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError>;

    /// [`Ledger::transition`] that also records why the attempt stopped (its `end_reason`),
    /// in the same transaction.
    async fn end_attempt(
        &self,
        operation_id: &str,
        generation: Generation,
        from: DispatchState,
        to: DispatchState,
        reason: &str,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError>;

    /// Failover from a refused attempt, in one transaction: attempt `generation` from `from`
    /// (DISPATCHING or SENT) to FAILED with `reason` (confirmed over: `provider_refused`) and
    /// the dispatch back to PREPARED for its next target. The dispatch is never FAILED in
    /// between, so no watcher, sweep or retry on any replica sees an end that is not one, and
    /// a crash leaves either the old attempt (its lease decides) or a PREPARED dispatch (the
    /// sweep drives it), never a stranded one.
    async fn fail_over(
        &self,
        operation_id: &str,
        generation: Generation,
        from: DispatchState,
        reason: &str,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError>;

    /// UNKNOWN → DISPATCHING for the same generation (replay with the same idempotency key).
    async fn replay_attempt(
        &self,
        operation_id: &str,
        generation: Generation,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError>;

    /// UNKNOWN → STREAMING for the same generation (resume by handle), re-fenced to
    /// `lease.holder` in the same conditional write.
    async fn resume_attempt(
        &self,
        operation_id: &str,
        generation: Generation,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError>;

    /// The old attempt is confirmed dead (its lease expired at `now`, or the provider said it
    /// ended): mark it ABANDONED (a FAILED one stays FAILED) and the dispatch PREPARED again,
    /// so a new generation may begin. Refused while the old lease runs.
    async fn abandon_and_rearm(
        &self,
        operation_id: &str,
        generation: Generation,
        provider_confirmed_ended: bool,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError>;

    /// [`Ledger::abandon_and_rearm`] on the provider's own word (`provider_cancelled`,
    /// `provider_status_completed`, …), recorded as how the old attempt's end was confirmed.
    async fn abandon_on_provider_word(
        &self,
        operation_id: &str,
        generation: Generation,
        provider_word: &str,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError>;

    /// Extend the lease of the active attempt; the generation is the fencing token. A lease
    /// that ran out by `now` (the store's clock) is not renewed: its holder promised to have
    /// stopped by then, and recovery may already act on that promise.
    async fn renew_lease(
        &self,
        operation_id: &str,
        generation: Generation,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError>;

    /// Bind a provider handle to the dispatch's manifest digest. A handle bound to another
    /// manifest is refused and counted.
    async fn bind_handle(
        &self,
        operation_id: &str,
        generation: Generation,
        handle: &str,
        now: Timestamp,
    ) -> Result<BindOutcome, StoreError>;

    /// Cancel: bump `cancel_generation` and make the dispatch ABANDONED (with its live
    /// attempt). `expected_cancel_generation` makes it conditional too.
    async fn cancel(
        &self,
        operation_id: &str,
        expected_cancel_generation: Option<u64>,
        now: Timestamp,
    ) -> Result<CancelOutcome, StoreError>;

    /// The canonical commit: one transaction, conditional on (revision, active generation,
    /// state = STREAMING), appending exactly one assistant turn at revision + 1 and its tool
    /// calls to the tool-call ledger. A loser's turn goes to the quarantine log.
    async fn commit(
        &self,
        operation_id: &str,
        generation: Generation,
        expected_revision: Revision,
        turn: &Value,
        now: Timestamp,
    ) -> Result<CommitOutcome, StoreError> {
        self.commit_with_outcome(operation_id, generation, expected_revision, turn, None, now)
            .await
    }

    /// [`Ledger::commit_with_outcome`] for an attempt whose SENT, STREAMING and handle were
    /// not written on their own: the commit writes them first, in its own transaction
    /// ([`Carried`]). A carried handle bound to another manifest refuses the commit
    /// (`CommitRefusal::ForeignHandle`) and nothing of it is written but that count.
    #[allow(clippy::too_many_arguments)]
    async fn commit_carrying(
        &self,
        operation_id: &str,
        generation: Generation,
        expected_revision: Revision,
        turn: &Value,
        outcome: Option<&Value>,
        carried: &Carried,
        now: Timestamp,
    ) -> Result<CommitOutcome, StoreError>;

    /// [`Ledger::commit`], recording in the same transaction what the provider said about the
    /// response (`stop_reason`, `usage`: the dispatch's `outcome`), so a client attaching later
    /// is answered with the provider's figures.
    async fn commit_with_outcome(
        &self,
        operation_id: &str,
        generation: Generation,
        expected_revision: Revision,
        turn: &Value,
        outcome: Option<&Value>,
        now: Timestamp,
    ) -> Result<CommitOutcome, StoreError> {
        self.commit_carrying(
            operation_id,
            generation,
            expected_revision,
            turn,
            outcome,
            &Carried::default(),
            now,
        )
        .await
    }

    /// Record blocks that must never become history. `false` when over the per-dispatch
    /// limit or the dispatch is unknown (then only counted).
    async fn quarantine(&self, entry: &QuarantineEntry, now: Timestamp) -> Result<bool, StoreError>;

    /// The quarantine log, oldest first.
    async fn quarantined(&self, limit: u64) -> Result<Vec<QuarantineRecord>, StoreError>;

    /// The tool-call ledger, optionally only one state.
    async fn tool_calls(&self, state: Option<ToolCallState>) -> Result<Vec<ToolCallRecord>, StoreError>;

    /// ready → claimed (or re-claim after the claim lease expired); the claim counter is the
    /// fencing token of the result. The lease lasts `lease.expires_at - now` on the store's
    /// clock ([`Ledger::claim_call`] is the full form).
    async fn claim_tool_call(
        &self,
        conversation_id: &str,
        call_id: &str,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<ClaimOutcome, StoreError>;

    /// claimed → done: append the result as a tool turn (through the validator) at the next
    /// revision. `status` is `success`, `error` or `cancel`; `content` the v1 parts array.
    async fn submit_tool_result(
        &self,
        conversation_id: &str,
        call_id: &str,
        claim: u64,
        status: &str,
        content: &Value,
        now: Timestamp,
    ) -> Result<ResultOutcome, StoreError>;

    /// Start-up recovery: live attempts of `holder`, and those whose lease expired, become
    /// UNKNOWN; answers every UNKNOWN attempt for the recovery decisions.
    async fn recover_startup(&self, holder: &str, now: Timestamp) -> Result<RecoveryReport, StoreError>;

    /// A holder that closed every provider connection of its live attempts gives them up
    /// (a drained process at shutdown): their leases end at `now` (the store's clock) and
    /// those DISPATCHING, SENT or STREAMING become UNKNOWN (`end_reason = shutting_down`), so
    /// recovery anywhere starts at once. Answers how many attempts were released. Call it only
    /// once nothing of `holder` can still read a provider.
    async fn release_holder(&self, holder: &str, now: Timestamp) -> Result<u64, StoreError>;

    /// The store's counters.
    async fn counters(&self) -> Result<Counters, StoreError>;

    /// The most recent write transaction of this process failed (a full disk, a lock or
    /// statement timeout, a lost connection) and none has committed since: what readiness
    /// reports without writing itself. `false` until a write fails.
    fn write_failing(&self) -> bool;

    /// One small write that changes nothing anyone reads (`applied_at` of the newest schema
    /// migration set to itself), committed as every write is: readiness runs it only while
    /// [`Ledger::write_failing`], so that a store whose disk filled and then freed is seen
    /// ready again without waiting for traffic it is not sent. Its outcome is recorded as any
    /// write's.
    async fn write_probe(&self) -> Result<(), StoreError>;

    /// PREPARED dispatches not updated for `idle_ms` by the store's clock, oldest first (at
    /// most `limit`): nobody drives them (see `drive::recoverable`).
    async fn prepared_unattended(&self, idle_ms: u64, limit: u64) -> Result<Vec<String>, StoreError>;

    /// How long the oldest attempt that is not over (live or UNKNOWN) has been past its lease,
    /// in ms by the store's clock (0: none is): a stuck dispatch, seen from every replica.
    async fn stuck_age_ms(&self) -> Result<u64, StoreError>;

    /// The store's clock ([`clock`]): the time every lease and fencing decision is judged by.
    async fn store_now(&self) -> Result<Timestamp, StoreError>;

    /// Executor claim: ready or expired → claimed for `lease_ms` (1..=[`CLAIM_LEASE_MS_MAX`])
    /// from the store's clock. Answers the fencing token, the lease's expiry and the call's
    /// idempotency key (the same for every claim of the call).
    async fn claim_call(
        &self,
        conversation_id: &str,
        call_id: &str,
        holder: &str,
        lease_ms: u64,
    ) -> Result<CallClaimOutcome, StoreError>;

    /// Extend the current claim's lease to `lease_ms` from the store's clock; refused when the
    /// claim is not current or its lease already ran out.
    async fn renew_call(
        &self,
        conversation_id: &str,
        call_id: &str,
        claim: u64,
        lease_ms: u64,
    ) -> Result<RenewOutcome, StoreError>;

    /// Give a claimed call back (claimed → ready); refused when the claim is not current or
    /// its lease already ran out.
    async fn release_call(
        &self,
        conversation_id: &str,
        call_id: &str,
        claim: u64,
    ) -> Result<ReleaseOutcome, StoreError>;

    /// The proxy handed the call to its client (ready → client); `false` when it was not ready.
    /// The client's hold ends `bound_ms` (1..=[`CLIENT_CALL_TIMEOUT_MS_MAX`]) later by the
    /// store's clock: the call then reads `client_abandoned`.
    async fn hand_to_client(
        &self,
        conversation_id: &str,
        call_id: &str,
        holder: &str,
        bound_ms: u64,
    ) -> Result<bool, StoreError>;

    /// A follow-up of the proxy client forked away from the conversation as it stood at
    /// `revision`: its calls committed at or before `revision` that the client still holds end
    /// now by the store's clock (client → `client_abandoned`). Answers how many.
    async fn abandon_client_calls(
        &self,
        conversation_id: &str,
        revision: Revision,
    ) -> Result<u64, StoreError>;

    /// A page of conversations, most recently updated first ([`listing`]).
    async fn conversation_page(&self, query: &ConversationQuery) -> Result<ConversationPage, StoreError>;

    /// Quarantine entries of operations whose ids start with `id_prefix`, newest first, older
    /// than row `before` when given ([`listing::quarantine_page`]).
    async fn quarantine_page(
        &self,
        id_prefix: &str,
        before: Option<i64>,
        limit: u64,
    ) -> Result<listing::QuarantinePage, StoreError>;

    /// Append attempt evidence (what the provider's side of connections showed) in one write;
    /// the rows are bounded by the caller and by `ops::EVIDENCE_BYTES_MAX` each.
    async fn record_evidence(
        &self,
        operation_id: &str,
        rows: &[(Generation, Value)],
        now: Timestamp,
    ) -> Result<(), StoreError>;

    /// A dispatch's attempt evidence, oldest first.
    async fn evidence(&self, operation_id: &str) -> Result<Vec<(Generation, Value)>, StoreError>;
}

/// Open a store by URL: `sqlite:PATH` or `postgres://…`.
pub async fn open(url: &str) -> Result<Box<dyn Ledger>, StoreError> {
    open_with(url, StoreOptions::default()).await
}

/// [`open`] with the bounds of `options`.
pub async fn open_with(url: &str, options: StoreOptions) -> Result<Box<dyn Ledger>, StoreError> {
    if let Some(path) = url.strip_prefix("sqlite:") {
        let ledger = SqliteLedger::open(path, Synchronous::Full)?;
        return Ok(Box::new(ledger));
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let ledger = PgLedger::connect_with(url, None, postgres::POOL_SIZE_DEFAULT, options).await?;
        return Ok(Box::new(ledger));
    }
    Err(StoreError::BadUrl)
}
