//! The data that crosses the driver's boundary: what it asks the store to do ([`StoreOp`]) and
//! what the store answered ([`StoreResult`]), what the pump must do ([`Action`]), what clients
//! are told ([`DriveEvent`]) and what is counted ([`Count`]).

use serde_json::Value;
use std::sync::Arc;
use turnstile_core::dispatch::{DispatchState, Timestamp};
use turnstile_core::{Generation, Revision, ViolationCode};

/// One provider connection of a dispatch, numbered by the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnectionId(pub u64);

/// What the driver needs of the stored dispatch (the store's `DispatchRecord`, trimmed).
#[derive(Clone, Debug)]
pub struct DispatchBasis {
    /// The operation.
    pub operation_id: String,
    /// The revision the dispatch answers.
    pub revision: Revision,
    /// The cancel generation the dispatch was prepared under.
    pub cancel_generation: u64,
    /// The manifest's `request_digest`.
    pub request_digest: String,
    /// The stored bytes; the only bytes that may be sent.
    pub request_bytes: Arc<Vec<u8>>,
}

/// An attempt as the store holds it (for recovery decisions).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttemptView {
    /// Its generation.
    pub generation: Generation,
    /// The provider handle bound to it.
    pub handle: Option<String>,
    /// Its idempotency key.
    pub idempotency_key: String,
    /// When its lease runs out.
    pub lease_expires_at: Timestamp,
    /// What recovery already spent on it, by every driver.
    pub spent: RecoverySpent,
    /// Which target of the dispatch it sent.
    pub target: u32,
}

/// One target of a dispatch as the driver sees it: the exact bytes its manifest names, the
/// stream format its provider speaks and what that provider offers for recovery. Target 0 is
/// the dispatch's own manifest; the rest are its failover targets, in order.
#[derive(Clone, Debug)]
pub struct DriveTarget {
    /// Its manifest's `request_digest`.
    pub request_digest: String,
    /// The stored bytes; the only bytes an attempt on this target may send.
    pub request_bytes: Arc<Vec<u8>>,
    /// Which stream format its provider speaks.
    pub api: turnstile_adapters::decode::StreamApi,
    /// What its provider offers for recovery.
    pub recovery: turnstile_core::dispatch::ProviderRecovery,
    /// How metrics name it: its provider (a configured name, so label values stay bounded).
    pub label: String,
    /// What its decoder may assume of the upstream beyond the wire format.
    pub decoder: turnstile_adapters::decode::DecoderOptions,
    /// Its provider's own bounds on an attempt's waits; `None`: the spec's
    /// ([`crate::DriveSpec::timeouts`]). Fixed for a connection when it opens.
    pub timeouts: Option<Timeouts>,
}

/// Resumes and replays already made of one generation, by every driver on every replica (the
/// store counts them in the take-over writes), so the per-generation budgets hold across
/// drivers, restarts and replicas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecoverySpent {
    /// Resumes by handle.
    pub resumes: u32,
    /// Replays with the same idempotency key.
    pub replays: u32,
}

/// A store operation the pump performs through `turnstile_store::drive::perform`, then answers
/// with [`crate::Drive::handle_store`]. Exactly one is outstanding at a time.
#[derive(Clone, Debug, PartialEq)]
pub enum StoreOp {
    /// PREPARED → DISPATCHING, allocating a generation (`Ledger::begin_attempt`).
    Begin {
        /// Which target the attempt sends (recorded on it with that target's digest).
        target: u32,
        /// Expected revision.
        expected_revision: Revision,
        /// Expected cancel generation.
        expected_cancel_generation: u64,
        /// The lease's end.
        lease_expires_at: Timestamp,
    },
    /// A forward transition of the active attempt.
    Transition {
        /// Generation.
        generation: Generation,
        /// From.
        from: DispatchState,
        /// To.
        to: DispatchState,
        /// Why the attempt stopped, when this transition ends it (UNKNOWN, FAILED, ABANDONED):
        /// stored as the attempt's `end_reason`.
        reason: Option<String>,
    },
    /// A refused attempt (DISPATCHING or SENT) to FAILED and the dispatch back to PREPARED for
    /// its next target, in one write (`Ledger::fail_over`).
    FailOver {
        /// Generation.
        generation: Generation,
        /// Its state now.
        from: DispatchState,
        /// Why it was refused (`provider_status_429`, `provider_unreachable`, …).
        reason: String,
    },
    /// UNKNOWN → DISPATCHING under the same generation.
    Replay {
        /// Generation.
        generation: Generation,
        /// The lease's end.
        lease_expires_at: Timestamp,
    },
    /// UNKNOWN → STREAMING under the same generation (resume by handle), re-fenced to this
    /// driver's holder.
    Resume {
        /// Generation.
        generation: Generation,
        /// The lease's end.
        lease_expires_at: Timestamp,
    },
    /// UNKNOWN → ABANDONED and back to PREPARED.
    AbandonAndRearm {
        /// Generation.
        generation: Generation,
        /// The provider confirmed the attempt ended.
        provider_ended: bool,
        /// The provider's own word on it, when it gave one (`provider_cancelled`,
        /// `provider_status_completed`, …): stored as how its end was confirmed.
        provider_word: Option<String>,
    },
    /// Extend the attempt's lease.
    RenewLease {
        /// Generation.
        generation: Generation,
        /// The lease's end.
        lease_expires_at: Timestamp,
    },
    /// Bind the provider's handle to the attempt.
    BindHandle {
        /// Generation.
        generation: Generation,
        /// The handle.
        handle: String,
    },
    /// The canonical commit (with the provider's outcome in the same transaction).
    Commit {
        /// Generation.
        generation: Generation,
        /// The revision it must land on + 1.
        expected_revision: Revision,
        /// The assembled turn.
        turn: Value,
        /// Stop reason and usage, if the provider reported them.
        outcome: Option<Value>,
        /// The attempt's state as the store holds it (DISPATCHING, SENT or STREAMING): the
        /// commit writes the transitions held back since then, in its own transaction.
        from: DispatchState,
        /// A provider handle held back for the commit to record.
        handle: Option<String>,
        /// Whether the commit also binds it (unique per provider, checked against the
        /// manifest): only where the handle is an identity (`Drive::handle_is_identity`).
        bind: bool,
    },
    /// Cancel the dispatch.
    Cancel {
        /// Expected cancel generation.
        expected_cancel_generation: u64,
    },
    /// Keep a late or foreign block out of history.
    Quarantine {
        /// Generation it came from.
        generation: Generation,
        /// Why.
        reason: &'static str,
        /// What it was.
        content: Value,
    },
    /// Read the dispatch's attempts.
    ReadAttempts,
}

/// The store's answer to a [`StoreOp`].
#[derive(Clone, Debug, PartialEq)]
pub enum StoreResult {
    /// Begin won: a new generation.
    Began {
        /// The generation.
        generation: Generation,
        /// Its idempotency key.
        idempotency_key: String,
    },
    /// Begin lost (revision moved, cancelled, begun elsewhere).
    BeginRefused,
    /// A conditional write applied.
    Applied,
    /// A conditional write was refused.
    Refused,
    /// Commit won.
    Committed {
        /// The new revision.
        revision: Revision,
    },
    /// Commit lost the compare-and-set.
    CommitRefused,
    /// The store's validator rejected the turn.
    CommitRejected(Vec<ViolationCode>),
    /// The handle belongs to another manifest.
    BindRefused,
    /// The attempts.
    Attempts(Vec<AttemptView>),
    /// The operation failed; whether it landed is unknown.
    Failed(String),
}

/// How a provider connection ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The body ended normally.
    Clean,
    /// The connection broke or timed out after the request may have reached the provider
    /// (its outcome there is unknown).
    Broken,
    /// The connection could not be made: nothing was sent.
    Unreachable,
}

/// Bounds on every wait of an attempt (`docs/operating.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// From opening a connection to its response head.
    pub head_ms: u64,
    /// Between two pieces of a response body.
    pub idle_ms: u64,
    /// From opening a connection to its end, whatever arrives (an endless or ping-only stream
    /// ends here).
    pub attempt_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            head_ms: 30_000,
            idle_ms: 60_000,
            attempt_ms: 600_000,
        }
    }
}

/// What a request to the provider is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Send the stored bytes of the connection's target ([`DriveTarget::request_bytes`]).
    Send {
        /// The attempt's idempotency key.
        idempotency_key: String,
    },
    /// Resume a stream by its provider handle.
    Resume {
        /// The handle.
        handle: String,
        /// The provider sequence number last seen.
        after_sequence: Option<u64>,
    },
    /// Ask the provider whether the response behind `handle` still runs (OpenAI Responses:
    /// `GET /v1/responses/{handle}`; the pump reports the JSON body like any other).
    Status {
        /// The handle.
        handle: String,
    },
    /// Ask the provider to stop the response behind `handle` (OpenAI Responses:
    /// `POST /v1/responses/{handle}/cancel`).
    Cancel {
        /// The handle.
        handle: String,
    },
}

/// What the pump must do, in order.
#[derive(Clone, Debug, PartialEq)]
#[must_use]
pub enum Action {
    /// Perform this store operation and answer with [`crate::Drive::handle_store`] before
    /// polling again.
    Store(StoreOp),
    /// Open a provider connection; report what happens on it with the `handle_*` inputs.
    Open {
        /// The connection's number.
        connection: ConnectionId,
        /// The attempt it belongs to.
        generation: Generation,
        /// The target (provider endpoint, API, model) the connection goes to.
        target: u32,
        /// What to send.
        request: Request,
    },
    /// Drop a connection (its events are no longer wanted).
    Close {
        /// The connection.
        connection: ConnectionId,
    },
    /// Tell the dispatch's clients.
    Emit(DriveEvent),
    /// Count.
    Count(Count),
    /// The commit of `revision` exposed its tool calls to executors (they read the ledger).
    ExposeToolCalls {
        /// The revision committed.
        revision: Revision,
    },
}

/// A client event of the dispatch stream (`shared/spec/gateway-api.md`, client stream events).
#[derive(Clone, Debug, PartialEq)]
pub enum DriveEvent {
    /// The dispatch state.
    State {
        /// The state.
        state: DispatchState,
        /// Active generation.
        generation: Option<Generation>,
    },
    /// Revocable preview text.
    Preview {
        /// Generation.
        generation: Generation,
        /// Block.
        block_index: u64,
        /// Text.
        delta: String,
    },
    /// Void all preview of a generation.
    Retract {
        /// Generation.
        generation: Generation,
        /// Why (a code).
        reason: String,
    },
    /// The canonical commit.
    Committed {
        /// The revision.
        revision: Revision,
        /// The committed turn, stamped with its revision.
        turn: Value,
        /// Stop reason, usage and the answering target's index of the commit offer
        /// (`{"stop_reason", "usage", "target"}`), if known.
        facts: Option<Value>,
    },
    /// The provider's token counts as a stream reports them (Anthropic's `message_start`
    /// carries the input count and cache counters before any text), for a client API that
    /// shows them before the commit. Informational: the committed usage is in `Committed`.
    Usage {
        /// Generation.
        generation: Generation,
        /// The counts of this report (`input_tokens`, `output_tokens`, cache counters).
        usage: turnstile_core::assemble::Usage,
    },
    /// An error code for the client.
    Error {
        /// Code.
        code: String,
        /// Human text: [`error_message`] of the code, or the provider's own words for a refusal
        /// (`provider_status_*`).
        message: std::borrow::Cow<'static, str>,
    },
}

/// What a pump counts (the gateway maps these to the spec's metric names).
#[derive(Clone, Debug, PartialEq)]
pub enum Count {
    /// A durable state transition.
    Transition {
        /// From.
        from: DispatchState,
        /// To.
        to: DispatchState,
    },
    /// A recovery outcome (`resumed`, `replayed`, `waiting`, `new_generation`).
    Recovery(&'static str),
    /// A generation that showed preview was retracted (once per generation).
    PreviewRetraction,
    /// A lost canonical compare-and-set.
    CasConflict,
    /// A late or foreign block.
    LateBlock,
    /// A foreign handle refused.
    ForeignHandle,
    /// Stored bytes that do not match the manifest (never sent).
    IllegalSend,
    /// A commit offer with incomplete tool arguments (never committed).
    PartialToolDispatch,
    /// Violations the store's validator found in an offered turn.
    Rejected(Vec<ViolationCode>),
    /// The dispatch entered (true) or left (false) UNKNOWN.
    Unknown(bool),
    /// A store failure on the dispatch path (the attempt was ended explicitly).
    StoreFailure,
    /// The driver stopped on its own before the lease it holds could run out (its renewal was
    /// refused, or the store did not answer in time): its provider connections are closed, its
    /// preview retracted, and recovery decides by the store's clock. The reason:
    /// `lease_lost` (a renewal refused) or `lease_ending` (no renewal landed in time).
    SelfFenced(&'static str),
    /// A connection closed because it waited past a bound (head, idle, whole attempt).
    Timeout,
    /// An input the driver ignored, with the reason (stale, duplicate, foreign).
    Ignored(&'static str),
    /// Something a decoder noticed that decided nothing ([`StreamEvent::Notice`]).
    ///
    /// [`StreamEvent::Notice`]: turnstile_core::stream::StreamEvent::Notice
    Notice {
        /// The target's label.
        target: String,
        /// The notice's code (`usage_mismatch`).
        code: String,
        /// What was noticed.
        detail: String,
    },
    /// The dispatch moved from one target to the next (labels as in [`DriveTarget::label`]).
    Failover {
        /// The index of the target that failed.
        from_target: u32,
        /// The target that failed.
        from: String,
        /// The target the next generation sends.
        to: String,
        /// Why (`provider_status_429`, `provider_unreachable`, `head_timeout`, `stream_cut`, …).
        reason: String,
    },
}

/// The human message of an error code.
pub fn error_message(code: &str) -> &'static str {
    match code {
        "begin_refused" => {
            "the dispatch could not begin: the conversation moved, it was cancelled, or another replica began it"
        }
        "recovery_refused" => "another replica took over this dispatch",
        "attempts_exhausted" => "the provider did not produce a complete turn within the attempt limit",
        "max_tokens_in_tool_arguments" => {
            "the output cap ended the response inside a tool call's arguments; nothing was committed and the same request would stop there again: raise the output cap"
        }
        "store_unavailable" => "the ledger could not be written; the lease decides what happens next",
        "ledger_unreachable" => {
            "this replica lost the ledger and stopped driving the dispatch; it goes on elsewhere or after recovery: attach again with the same operation_id (or read GET /v1/dispatches/{operation_id}) for its outcome"
        }
        "shutting_down" => {
            "this gateway is shutting down and its drain timeout passed: it stopped driving the dispatch, which goes on elsewhere or after its restart; attach again with the same operation_id (or read GET /v1/dispatches/{operation_id}) for its outcome"
        }
        "output_budget_exhausted" => {
            "the gateway's memory budget for provider output was exhausted and this dispatch held the most; nothing was committed"
        }
        "provider_unreachable" | "provider_status" => "the provider produced nothing",
        _ => "dispatch error",
    }
}
