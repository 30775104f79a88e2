//! Records read from the ledger and the outcomes of its operations. Every compare-and-set
//! returns an outcome enum whose losing variants are ordinary values, never errors.

use serde_json::Value;
use turnstile_core::dispatch::{DispatchState, Timestamp};
use turnstile_core::manifest::DispatchManifest;
use turnstile_core::{Generation, Revision, Violation};

/// Most quarantined blocks kept per dispatch; more are counted and dropped.
pub const QUARANTINE_PER_DISPATCH_MAX: u64 = 1_024;
/// Most operations one SQLite group commit gathers into one transaction.
pub const GROUP_COMMIT_OPS_MAX: usize = 256;
/// Largest request body a dispatch may store, in bytes.
pub const REQUEST_BYTES_MAX: usize = 32 * 1024 * 1024;
/// Most targets of one dispatch (its own manifest and its failover targets).
pub const TARGETS_PER_DISPATCH_MAX: usize = 8;
/// Most attempts (generations) one dispatch may start: the driver's budget, enforced again
/// by the begin compare-and-set itself, so it holds across restarts, replicas and a driver
/// that miscounts.
pub const ATTEMPTS_PER_DISPATCH_MAX: u64 = turnstile_drive::ATTEMPTS_PER_DISPATCH_MAX;
/// The default bound on one store operation (`store_timeout_ms`, [`crate::StoreOptions`]).
pub const STORE_TIMEOUT_MS_DEFAULT: u64 = 10_000;
/// How long a SQLite connection waits for another process's write lock.
pub const SQLITE_BUSY_TIMEOUT_MS: u64 = 10_000;
/// The page size of a new SQLite ledger file.
pub const SQLITE_PAGE_SIZE_BYTES: usize = 2048;
/// Most idle read connections a SQLite ledger keeps open (reads run on the calling thread, so
/// as many run at once as threads call; the ones above this are closed after their read).
pub const SQLITE_READERS_IDLE_MAX: usize = 8;
/// WAL frames (pages) at which a SQLite ledger's checkpoint thread copies the WAL back into
/// the database file: SQLite's own default for `wal_autocheckpoint`, run off the writer.
pub const SQLITE_CHECKPOINT_PAGES: i32 = 1000;
/// WAL frames past which the writer checkpoints after its commit itself, as SQLite would:
/// the bound on the WAL when the checkpoint thread falls behind (32 MiB at 2 KiB pages).
pub const SQLITE_WAL_PAGES_MAX: i32 = 16_000;
/// Most checkpoint passes the checkpoint thread runs per wake-up, each copying what the
/// writer committed during the one before, until one leaves nothing uncopied.
pub const SQLITE_CHECKPOINT_PASSES_MAX: usize = 3;

/// Answer of [`crate::Ledger::conversation_since`].
#[derive(Clone, Debug, PartialEq)]
pub struct ConversationTail {
    /// The conversation's revision.
    pub revision: Revision,
    /// The id of its turn at the revision asked about (None at revision 0, or when the
    /// conversation has no turn there: it is behind the reader).
    pub turn_id_at: Option<String>,
    /// Its turns after the revision asked about, in order (`turnstile.conversation.v1` turns,
    /// each stamped with its revision).
    pub turns: Vec<Value>,
    /// The digest stored with each of `turns`, as stored (`Turn::digest` of the turn when it
    /// was written; `None` for a row written before the store kept digests).
    pub turn_digests: Vec<Option<String>>,
}

/// Answer of [`crate::Ledger::conversation_with_digests`]: the committed history and the digest
/// stored with each of its turns.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredConversation {
    /// The `turnstile.conversation.v1` document, as [`crate::Ledger::conversation`] answers it.
    pub document: Value,
    /// The digest stored with each turn of `document`, in order, as in
    /// [`ConversationTail::turn_digests`].
    pub turn_digests: Vec<Option<String>>,
}

/// Answer of `create_conversation`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CreateOutcome {
    /// Created at revision 0.
    Created,
    /// A conversation with that id exists already (nothing changed).
    AlreadyExists,
}

/// Answer of `import_conversation`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImportOutcome {
    /// Created with the whole history; the conversation is at this revision.
    Created {
        /// Number of imported turns.
        revision: Revision,
    },
    /// A conversation with that id exists already (nothing changed).
    AlreadyExists {
        /// Its current revision.
        revision: Revision,
    },
    /// The history is illegal; nothing was written.
    Rejected(Vec<turnstile_core::Violation>),
}

/// Answer of `append_turn` (HTTP: 200 / 409 / 422 / 404).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AppendOutcome {
    /// The turn is committed at this revision.
    Appended {
        /// The new revision.
        revision: Revision,
    },
    /// `expected_revision` was stale.
    Conflict {
        /// The revision the conversation is at.
        current: Revision,
    },
    /// The would-be history is illegal; nothing was written.
    Rejected(Vec<Violation>),
    /// No such conversation.
    NotFound,
}

/// A history repair to record with the turn it appends (`Ledger::append_repair`): the plan
/// (`turnstile_core::repair`) as JSON and its digest, and who asked.
#[derive(Clone, Debug, PartialEq)]
pub struct NewRepair {
    /// The plan's `digest`.
    pub plan_digest: String,
    /// The whole plan, as the caller was shown it.
    pub plan: Value,
    /// The tenant that asked (None without tenants).
    pub tenant: Option<String>,
    /// Who asked, as the caller named itself (free text, bounded by the caller).
    pub actor: Option<String>,
}

/// A recorded history repair, as `Ledger::repairs` reads it back.
#[derive(Clone, Debug, PartialEq)]
pub struct RepairRecord {
    /// The revision the repaired turn made.
    pub revision: Revision,
    /// The plan's `digest`.
    pub plan_digest: String,
    /// The whole plan.
    pub plan: Value,
    /// The tenant that asked.
    pub tenant: Option<String>,
    /// Who asked, as named.
    pub actor: Option<String>,
    /// When (ms since the epoch, the writer's `now`).
    pub repaired_at: Timestamp,
}

/// A stored dispatch.
#[derive(Clone, Debug, PartialEq)]
pub struct DispatchRecord {
    /// Client-chosen operation id.
    pub operation_id: String,
    /// Conversation id.
    pub conversation_id: String,
    /// Revision it was rendered from.
    pub revision: Revision,
    /// The manifest JSON exactly as given.
    pub manifest: Value,
    /// Its `manifest_digest`.
    pub manifest_digest: String,
    /// Its `request_digest`.
    pub request_digest: String,
    /// The exact request bytes every attempt sends.
    pub request_bytes: Vec<u8>,
    /// Provider name from the manifest.
    pub provider: String,
    /// Current state.
    pub state: DispatchState,
    /// Bumped by each cancel; part of the begin condition.
    pub cancel_generation: u64,
    /// The active attempt's generation (the last one allocated).
    pub active_generation: Option<Generation>,
    /// The revision of its committed turn, once COMMITTED.
    pub committed_revision: Option<Revision>,
    /// What the provider said about the committed response (`stop_reason`, `usage`), once
    /// recorded in the commit (`Ledger::commit_with_outcome`).
    pub outcome: Option<Value>,
}

/// One attempt (generation) of a dispatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttemptRecord {
    /// Its dispatch.
    pub operation_id: String,
    /// Its generation.
    pub generation: Generation,
    /// Its state.
    pub state: DispatchState,
    /// Idempotency key sent with it.
    pub idempotency_key: String,
    /// Digest of the bytes it sent.
    pub request_digest: String,
    /// Provider handle, once bound.
    pub handle: Option<String>,
    /// Who drives it.
    pub lease_holder: String,
    /// Its lease; after this it is presumed dead.
    pub lease_expires_at: Timestamp,
    /// Every state it went through, with the time passed in.
    pub history: Vec<(DispatchState, Timestamp)>,
    /// Resumes by handle made of it, by every driver (the per-generation budget).
    pub resumes: u32,
    /// Replays with its idempotency key made of it, by every driver.
    pub replays: u32,
    /// Why it last stopped (`stream_cut`, `head_timeout`, `resume_refused`,
    /// `provider_status_503`, `lease_expired`, `committed`, …); None while nothing stopped it.
    pub end_reason: Option<String>,
    /// How its end was confirmed before a new generation: `lease_expired` (by the store's
    /// clock) or `provider_ended` (the provider's own word).
    pub confirmed_over: Option<String>,
    /// Which target of the dispatch it sent (0: the dispatch's own manifest).
    pub target: u32,
}

/// One failover target of a dispatch as given to [`crate::Ledger::prepare_targets`]: its
/// own manifest (same operation, conversation, revision and sequence as the dispatch's), its
/// exact bytes and its render policy.
#[derive(Clone, Debug)]
pub struct PreparedTarget {
    /// The sealed manifest.
    pub manifest: DispatchManifest,
    /// The bytes its `request_digest` names.
    pub request_bytes: Vec<u8>,
    /// The render policy its `policy_digest` names, if kept.
    pub policy: Option<Value>,
}

/// A [`PreparedTarget`] whose digests are known to match what they name: `manifest_digest`
/// its manifest, `request_digest` its bytes, `policy_digest` its policy. The target inside
/// is reachable only through `&`, so nothing checked can change afterwards, and the store
/// takes it ([`crate::Ledger::prepare_sealed`], [`crate::Ledger::import_and_prepare_sealed`])
/// without hashing any of it again: a dispatch's body is hashed once, by the render that
/// produced it (issue 21, "hash once"). The store still checks what costs no hashing (the
/// bounds, the targets' agreement).
#[derive(Clone, Debug)]
pub struct SealedTarget {
    target: PreparedTarget,
}

impl SealedTarget {
    /// Hash and compare every digest of `target` (a manifest from elsewhere); `Err` is why a
    /// checked prepare answers `Invalid` (`ops::target_invalid`).
    pub fn check(target: PreparedTarget) -> Result<SealedTarget, &'static str> {
        match crate::ops::target_invalid(&target.manifest, &target.request_bytes, target.policy.as_ref()) {
            Some(why) => Err(why),
            None => Ok(SealedTarget { target }),
        }
    }

    /// A target whose digests the caller has just computed from exactly these bytes and this
    /// policy: the render's prepare (`turnstile_adapters::prepare`, which hashes the body
    /// incrementally and the policy and manifest whole) and nothing else. Not hashed again;
    /// debug builds (every test) hash and compare anyway, and panic on a mismatch.
    pub fn vouched(target: PreparedTarget) -> SealedTarget {
        debug_assert_eq!(
            crate::ops::digests_mismatch(&target.manifest, &target.request_bytes, target.policy.as_ref()),
            None,
            "a vouched target's digests do not match"
        );
        SealedTarget { target }
    }

    /// The target.
    pub fn target(&self) -> &PreparedTarget {
        &self.target
    }

    /// The target, no longer known to be intact once it can be changed.
    pub fn into_target(self) -> PreparedTarget {
        self.target
    }
}

/// One target of a stored dispatch ([`crate::Ledger::dispatch_targets`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetRecord {
    /// 0 for the dispatch's own manifest, then the failover order.
    pub position: u32,
    /// The manifest JSON as given.
    pub manifest: Value,
    /// Its `manifest_digest`.
    pub manifest_digest: String,
    /// Its `request_digest`.
    pub request_digest: String,
    /// The exact bytes an attempt on this target sends.
    pub request_bytes: Vec<u8>,
    /// Provider, model and adapter from its manifest.
    pub provider: String,
    /// Model.
    pub model: String,
    /// Adapter id.
    pub adapter: String,
}

/// Answer of `prepare`.
#[derive(Clone, Debug, PartialEq)]
pub enum PrepareOutcome {
    /// A new dispatch in PREPARED.
    Created(DispatchRecord),
    /// The same operation id with the same manifest: the existing dispatch (attach to it).
    Existing(DispatchRecord),
    /// The operation id is taken by a different manifest.
    Conflict {
        /// The manifest digest stored under that id.
        existing_manifest_digest: String,
    },
    /// The conversation moved past the manifest's revision.
    StaleRevision {
        /// Where it is.
        current: Revision,
    },
    /// No such conversation.
    NotFound,
    /// The manifest is not sealed correctly or the bytes do not match `request_digest`.
    Invalid(&'static str),
}

/// Conditions of the begin compare-and-set besides `state = PREPARED`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BeginExpect {
    /// The conversation must still be at this revision.
    pub revision: Revision,
    /// Nobody cancelled since this cancel generation was read.
    pub cancel_generation: u64,
    /// Which of the dispatch's targets the attempt sends (0: the dispatch's own manifest;
    /// 1.. its failover targets, [`crate::Ledger::dispatch_targets`]). Recorded on the attempt
    /// with that target's `request_digest`.
    pub target: u32,
}

/// A lease on an attempt: who drives it and until when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// Replica id.
    pub holder: String,
    /// Expiry.
    pub expires_at: Timestamp,
}

/// Answer of `begin_attempt`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BeginOutcome {
    /// DISPATCHING is durable with this generation: bytes may go out.
    Began {
        /// The allocated generation.
        generation: Generation,
        /// The idempotency key to send (derived from operation id and generation).
        idempotency_key: String,
    },
    /// The compare-and-set lost; nothing changed.
    Refused {
        /// The dispatch's state as found (None: no such dispatch).
        state: Option<DispatchState>,
        /// Its active generation as found.
        active_generation: Option<Generation>,
    },
}

/// Answer of a fenced transition, replay, rearm or lease renewal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransitionOutcome {
    /// Written.
    Applied,
    /// The condition (generation, state) did not hold; nothing changed.
    Refused {
        /// The dispatch's state as found.
        state: Option<DispatchState>,
        /// Its active generation as found.
        active_generation: Option<Generation>,
    },
}

/// Answer of `bind_handle`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BindOutcome {
    /// Bound now.
    Bound,
    /// Already bound to this manifest (a repeat).
    AlreadyBound,
    /// The handle is bound to another manifest: refused and counted.
    Refused {
        /// The manifest digest it is bound to.
        bound_to: String,
    },
    /// The attempt is not the active one (fenced).
    StaleGeneration,
}

/// Answer of `cancel`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The dispatch is ABANDONED now; its new cancel generation.
    Cancelled {
        /// The bumped cancel generation.
        cancel_generation: u64,
    },
    /// Already terminal or the expected cancel generation was stale.
    Refused {
        /// The state found.
        state: Option<DispatchState>,
    },
}

/// Why a canonical commit lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitRefusal {
    /// No such dispatch.
    NotFound,
    /// The generation is not the dispatch's active one.
    ForeignGeneration,
    /// The dispatch is not STREAMING.
    WrongState(DispatchState),
    /// The conversation is not at the dispatch's revision any more (another turn won).
    RevisionMoved,
    /// The handle the commit carried is bound to another manifest: nothing was committed, the
    /// attempt is as it was (its carried transitions were not written) and the refusal is
    /// counted as a foreign handle.
    ForeignHandle,
}

/// What a canonical commit carries of the attempt's progress that was not written on its own
/// (`docs/decisions/0083-two-durable-writes-per-dispatch-the-prepare-begins-the.md`, "two durable
/// writes per dispatch"): the attempt's state as the store holds it, from which the commit moves it
/// through SENT and STREAMING (a history row each), and the provider handle, bound and checked
/// against the manifest in the same transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Carried {
    /// The attempt's stored state: DISPATCHING, SENT or STREAMING.
    pub from: DispatchState,
    /// A provider handle not bound yet.
    pub handle: Option<String>,
    /// Whether the handle is bound (unique per provider, checked against the manifest) or only
    /// recorded on the attempt: a handle is an identity only where something looks a response
    /// up by it (a resume, a status or cancel question, `previous_response_id`). The answer to
    /// a fresh send arrived on the attempt's own connection whatever id it names, and
    /// compatible servers reuse ids (`chatcmpl-1` again after a restart).
    pub bind: bool,
    /// What the provider's side of the dispatch's connections showed, not written yet
    /// (`attempt_evidence`): appended in the commit's transaction when it wins, so a dispatch
    /// that commits costs no extra write for it.
    pub evidence: Vec<(Generation, serde_json::Value)>,
}

impl Default for Carried {
    fn default() -> Carried {
        Carried {
            evidence: Vec::new(),
            from: DispatchState::Streaming,
            handle: None,
            bind: true,
        }
    }
}

/// Answer of `import_and_prepare`.
#[derive(Clone, Debug, PartialEq)]
pub enum ImportPrepared {
    /// The history was not imported (`Rejected`, or `AlreadyExists`): nothing was written.
    NotImported(ImportOutcome),
    /// The prepare was refused (`Invalid` bytes or manifest; `NotFound`: a manifest of another
    /// conversation; `StaleRevision`: of another revision than the import's, which `current`
    /// is; `Existing` or `Conflict`: its operation id is taken): nothing was written, the
    /// history was not imported either.
    NotPrepared(PrepareOutcome),
    /// Imported at `revision`, and the dispatch prepared (and, when asked, begun) in the same
    /// transaction.
    Prepared {
        /// Number of imported turns.
        revision: Revision,
        /// The prepare's outcome: always `Created`.
        prepared: PrepareOutcome,
        /// The begin's outcome (`None` without a begin or when the prepare did not create).
        began: Option<BeginOutcome>,
    },
}

/// Begin the first attempt in the transaction that prepares the dispatch (the acceptance
/// point and the prepare in one durable write): `Ledger::prepare_and_begin`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BeginAtOnce {
    /// The lease holder (this replica).
    pub holder: String,
    /// The lease, from the store's now.
    pub lease_ms: u64,
    /// Which target the first attempt sends.
    pub target: u32,
}

/// Answer of `commit`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommitOutcome {
    /// The assistant turn is history at this revision and its tool calls are in the ledger.
    /// Also the answer to a retry of the same generation's commit.
    Committed {
        /// The turn's revision.
        revision: Revision,
        /// Its tool call ids, in order.
        tool_calls: Vec<String>,
    },
    /// The compare-and-set lost; the turn went to the quarantine log.
    Refused(CommitRefusal),
    /// The turn would make the history illegal; quarantined, nothing committed.
    Rejected(Vec<Violation>),
}

/// A block (or a whole turn) that must never become history.
#[derive(Clone, Debug, PartialEq)]
pub struct QuarantineEntry {
    /// Its dispatch.
    pub operation_id: String,
    /// The generation that produced it.
    pub generation: Generation,
    /// Why (`foreign_generation`, `late`, `commit_refused`, `rejected`).
    pub reason: String,
    /// The content.
    pub content: Value,
}

/// A quarantine log row.
#[derive(Clone, Debug, PartialEq)]
pub struct QuarantineRecord {
    /// Row id (insertion order).
    pub id: i64,
    /// The entry.
    pub entry: QuarantineEntry,
    /// When it was recorded.
    pub at: Timestamp,
}

/// Longest lease an executor may ask for on a claim (the dispatch lease's limit).
pub const CLAIM_LEASE_MS_MAX: u64 = turnstile_core::dispatch::LEASE_MS_MAX;

/// Default bound on a call handed to a proxy client (`proxy_client_call_timeout_ms`): an hour,
/// far above any agent's tool run between two requests, and short enough that a client that
/// went away stops counting as pending the same day.
pub const CLIENT_CALL_TIMEOUT_MS_DEFAULT: u64 = 3_600_000;
/// Longest bound a gateway may set on a call handed to a proxy client: a week.
pub const CLIENT_CALL_TIMEOUT_MS_MAX: u64 = 7 * 24 * 3_600_000;

/// State of a committed tool call in the execution ledger, as listed.
///
/// ```text
///            claim                      result (claim = current)
///   ready ──────────▶ claimed ─────────────────────────────────▶ done
///     ▲   ◀──────────    │  ▲ renew (claim = current, lease running)  ▲
///     │     release      │  │                                         │
///     │                  │ lease ran out (store clock)                │ result (claim = current)
///     │                  ▼                                            │
///     │               expired ──── claim again (claim + 1, same idempotency key) ──▶ claimed
///     │
///     └─ handed to the proxy client ──▶ client ── follow-up carrying the result ──▶ done
///                                         │                                         ▲
///                                         │ its bound ran out (store clock),        │ a late follow-up
///                                         ▼ or a follow-up of its client forked     │ carrying the result
///                                    client_abandoned ──────────────────────────────┘
/// ```
///
/// `expired` is not stored: it is a `claimed` row whose `claim_expires_at` is at or before the
/// store's clock, computed inside every statement that reads or changes the row, so a lease runs
/// out at the same instant for every replica and needs no sweeper. `client_abandoned` is read
/// the same way: a `client` row's `claim_expires_at` is when its client's hold ends (the
/// hand-over's time plus the bound, by the store's clock; a fork moves it to the fork's
/// instant), and a row at or past it reads `client_abandoned`. Every change is fenced by the
/// claim number; a tool turn appended directly closes the call from any state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ToolCallState {
    /// Committed, waiting for an executor.
    Ready,
    /// An executor holds it under a lease that is still running.
    Claimed,
    /// Its last claim's lease ran out without a result: it may have run, its outcome is
    /// unknown; it can be claimed again (with the same idempotency key).
    Expired,
    /// Handed to the proxy client that received it in the provider's response: the client runs
    /// it and its follow-up request carries the result. Never offered to executors.
    Client,
    /// Handed to the proxy client, whose hold ended without a result in this conversation: its
    /// bound ran out by the store's clock, or a later follow-up of the same client forked away
    /// from the turn that made it. Not pending; never offered to executors. Bookkeeping, not a
    /// refusal: a follow-up that still carries its result closes it (`done`).
    ClientAbandoned,
    /// Its result is committed history.
    Done,
}

impl ToolCallState {
    /// Every state, in lifecycle order.
    pub const ALL: [ToolCallState; 6] = [
        ToolCallState::Ready,
        ToolCallState::Claimed,
        ToolCallState::Expired,
        ToolCallState::Client,
        ToolCallState::ClientAbandoned,
        ToolCallState::Done,
    ];

    /// The listed string.
    pub fn as_str(self) -> &'static str {
        match self {
            ToolCallState::Ready => "ready",
            ToolCallState::Claimed => "claimed",
            ToolCallState::Expired => "expired",
            ToolCallState::Client => "client",
            ToolCallState::ClientAbandoned => "client_abandoned",
            ToolCallState::Done => "done",
        }
    }

    /// Whether a call in this state awaits a result: every state but `done` and
    /// `client_abandoned` (what the conversation listing counts as `pending_calls`).
    pub fn is_pending(self) -> bool {
        !matches!(self, ToolCallState::Done | ToolCallState::ClientAbandoned)
    }

    /// Parse the listed string.
    pub fn parse(text: &str) -> Option<ToolCallState> {
        ToolCallState::ALL
            .into_iter()
            .find(|state| state.as_str() == text)
    }
}

/// One call in the tool-call (execution) ledger.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCallRecord {
    /// Conversation.
    pub conversation_id: String,
    /// Call id.
    pub call_id: String,
    /// Revision of the assistant turn that made it.
    pub revision: Revision,
    /// Generation of that turn.
    pub generation: Generation,
    /// Tool name.
    pub tool: String,
    /// Arguments (a JSON object).
    pub arguments: Value,
    /// `sha256:` of the canonical arguments.
    pub args_digest: String,
    /// Ledger state, judged by the store's clock at the read.
    pub state: ToolCallState,
    /// Claim counter: how many claims the call has had, and the fencing token of the latest.
    pub claim: u64,
    /// Holder of the latest claim (while claimed or expired).
    pub claim_holder: Option<String>,
    /// When the latest claim's lease runs (or ran) out, by the store's clock; for a call
    /// handed to the proxy client, when the client's hold ends (`client_abandoned` from then).
    pub claim_expires_at: Option<Timestamp>,
    /// Revision of the tool turn holding its result, once done.
    pub result_revision: Option<Revision>,
    /// The idempotency key every claim of this call is given
    /// ([`crate::ops::tool_call_idempotency_key`]).
    pub idempotency_key: String,
}

/// Answer of `claim_tool_call` (the older form of [`CallClaimOutcome`], kept for callers that
/// need only the fencing token).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// Claimed; present `claim` with the result.
    Claimed {
        /// Fencing token.
        claim: u64,
    },
    /// Held by another executor whose lease has not expired, or already done.
    Unavailable {
        /// Its state.
        state: ToolCallState,
    },
    /// No such call in the ledger.
    NotFound,
}

/// A claim as granted by `claim_call`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallClaim {
    /// Fencing token of this claim (also how many claims the call has had).
    pub claim: u64,
    /// When its lease runs out, by the store's clock.
    pub lease_expires_at: Timestamp,
    /// The call's idempotency key: the same for every claim of the call, for the executor to
    /// pass to the tool.
    pub idempotency_key: String,
    /// The call was `expired` (an earlier claim's lease ran out): the tool may have run already.
    pub took_over_expired: bool,
}

/// Answer of `claim_call`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallClaimOutcome {
    /// Claimed.
    Claimed(CallClaim),
    /// Claimed by someone whose lease is still running, handed to the proxy client, or done.
    Unavailable {
        /// Its state.
        state: ToolCallState,
    },
    /// No such call in the ledger.
    NotFound,
}

/// Answer of `renew_call`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RenewOutcome {
    /// The lease runs until this instant (store clock).
    Renewed {
        /// New expiry.
        lease_expires_at: Timestamp,
    },
    /// The claim is not the current one, or its lease already ran out: nothing changed.
    StaleClaim {
        /// The call's state as found.
        state: ToolCallState,
    },
    /// No such call.
    NotFound,
}

/// Answer of `release_call`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The call is `ready` again.
    Released,
    /// The claim is not the current one, or its lease already ran out: nothing changed.
    StaleClaim {
        /// The call's state as found.
        state: ToolCallState,
    },
    /// No such call.
    NotFound,
}

/// Answer of `submit_tool_result`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResultOutcome {
    /// The tool turn is committed at this revision.
    Appended {
        /// Its revision.
        revision: Revision,
    },
    /// The claim token is not the current one (the lease expired and someone re-claimed).
    StaleClaim,
    /// The call already has its result (counted as a duplicate).
    Duplicate,
    /// The would-be history is illegal; nothing written.
    Rejected(Vec<Violation>),
    /// No such call.
    NotFound,
    /// Another turn landed at the same time; retry.
    Conflict,
}

/// What start-up recovery found and did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Attempts moved to UNKNOWN by this run.
    pub marked_unknown: u64,
    /// Every attempt now UNKNOWN (this run's and older ones), for the recovery decisions.
    pub unknown: Vec<AttemptRecord>,
}

/// Counters kept by the store (exported as metrics by the gateway).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Handles refused because they are bound to another manifest.
    pub foreign_handle_refusals: u64,
    /// Canonical commits that lost their compare-and-set.
    pub canonical_cas_conflicts: u64,
    /// Blocks written to the quarantine log.
    pub late_blocks: u64,
    /// Quarantine entries dropped over `QUARANTINE_PER_DISPATCH_MAX`.
    pub quarantine_dropped: u64,
    /// Tool results submitted for a call that already had one.
    pub tool_result_duplicates: u64,
}
