//! The dispatch state machine (`shared/spec/gateway-api.md`, "Dispatch states") as pure,
//! sans-IO code in the quinn-proto shape: `handle_*` inputs with the time passed in, `poll_*`
//! outputs that are plain data. The gateway performs the effects in order and feeds the
//! answers of the store and the provider back in.
//!
//! The acceptance point is enforced by structure: [`Effect::Send`] is only ever produced while
//! handling [`StoreAnswer::Began`] or [`StoreAnswer::Replayed`], that is after the store
//! acknowledged the durable PREPARED → DISPATCHING write (or UNKNOWN → DISPATCHING for a replay
//! of the same generation). No other code path builds it.
//!
//! Recovery after a crash is a pure decision too: [`recovery_decision`] picks resume by handle,
//! replay of the same generation with the same idempotency key, or waiting until the old
//! attempt is confirmed dead (lease expired, or the provider said it ended) before a new
//! generation may begin. A new attempt re-sends the manifest's stored bytes: [`Effect::Send`]
//! names them by the manifest's `request_digest`, never by a fresh render.

use crate::ids::{Generation, Revision};
use std::collections::VecDeque;
use std::fmt;

/// Milliseconds since the Unix epoch, as read by the caller's clock. The core never reads a
/// clock itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// This instant plus `ms` milliseconds (saturating).
    pub fn plus_ms(self, ms: u64) -> Timestamp {
        Timestamp(self.0.saturating_add(ms))
    }
}

/// Default attempt lease (spec: 5 seconds, configurable).
pub const LEASE_MS_DEFAULT: u64 = 5_000;
/// Longest lease a caller may configure: a dead attempt blocks a new generation this long.
pub const LEASE_MS_MAX: u64 = 10 * 60 * 1_000;
/// Most effects queued in one machine before the caller polled them; more is a caller bug.
pub const EFFECTS_QUEUED_MAX: usize = 64;

/// The state of a dispatch and of each of its attempts.
///
/// ```text
///                 begin (CAS on revision, cancel_generation, state = PREPARED;
///                        allocates attempt_generation; durable = acceptance point)
///   PREPARED ───────────────────────────────▶ DISPATCHING ──▶ SENT ──▶ STREAMING ──▶ COMMITTED
///     │  ▲                                      │  ▲  │         │  │        │ ▲ (canonical CAS on
///     │  │ rearm (dispatch only: the old        │  │  │         │  │        │ │  revision, active
///     │  │ attempt is confirmed terminated)     │  │  │         │  │        │ │  generation, state)
///     │  │                                      ▼  │  │         ▼  │        ▼ │
///     │  └──────── FAILED ◀───────────────── UNKNOWN ◀┼─────────┴──┼────────┘ │
///     │            ABANDONED ◀───────────────  │  │   │            │          │
///     │                                        │  └───┘ replay same generation (same key)
///     │ cancel                                 └────────────────────────────────┘
///     ▼                                          resume by handle
///   ABANDONED
/// ```
///
/// Every edge, as [`DispatchState::can_transition`] lists it:
/// PREPARED → DISPATCHING | ABANDONED; DISPATCHING → SENT | UNKNOWN | FAILED | ABANDONED;
/// SENT → STREAMING | UNKNOWN | FAILED | ABANDONED; STREAMING → COMMITTED | UNKNOWN | ABANDONED;
/// UNKNOWN → DISPATCHING (replay) | STREAMING (resume) | FAILED | ABANDONED;
/// FAILED | ABANDONED → PREPARED (rearm: the dispatch, never the attempt, which stays terminal).
/// COMMITTED is terminal. FAILED means the provider confirmably produced nothing; ABANDONED
/// means the attempt was confirmed terminated and its partial output discarded (quarantined).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DispatchState {
    /// Manifest and request bytes stored; no attempt in flight.
    Prepared,
    /// An attempt generation is allocated and durable; bytes may be going out.
    Dispatching,
    /// The request was written and accepted by the provider.
    Sent,
    /// The provider's response is arriving.
    Streaming,
    /// Exactly one assistant turn was appended at revision + 1. Terminal.
    Committed,
    /// The attempt may or may not be running at the provider (a crash or a disconnect).
    Unknown,
    /// The provider confirmably produced nothing (e.g. a 4xx before any event).
    Failed,
    /// The attempt was confirmed terminated; its partial output was discarded.
    Abandoned,
}

impl DispatchState {
    /// Every state, in diagram order.
    pub const ALL: [DispatchState; 8] = [
        DispatchState::Prepared,
        DispatchState::Dispatching,
        DispatchState::Sent,
        DispatchState::Streaming,
        DispatchState::Committed,
        DispatchState::Unknown,
        DispatchState::Failed,
        DispatchState::Abandoned,
    ];

    /// The spec string (`PREPARED`, …), also the value stored in the ledger.
    pub fn as_str(self) -> &'static str {
        match self {
            DispatchState::Prepared => "PREPARED",
            DispatchState::Dispatching => "DISPATCHING",
            DispatchState::Sent => "SENT",
            DispatchState::Streaming => "STREAMING",
            DispatchState::Committed => "COMMITTED",
            DispatchState::Unknown => "UNKNOWN",
            DispatchState::Failed => "FAILED",
            DispatchState::Abandoned => "ABANDONED",
        }
    }

    /// Parse a spec string.
    pub fn parse(text: &str) -> Option<DispatchState> {
        DispatchState::ALL
            .into_iter()
            .find(|state| state.as_str() == text)
    }

    /// Whether an attempt in this state may still produce output (its lease matters).
    pub fn is_live(self) -> bool {
        matches!(
            self,
            DispatchState::Dispatching
                | DispatchState::Sent
                | DispatchState::Streaming
                | DispatchState::Unknown
        )
    }

    /// Whether the state is one the spec calls terminal for an attempt.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            DispatchState::Committed | DispatchState::Failed | DispatchState::Abandoned
        )
    }

    /// Whether `self → to` is an edge of the diagram. The store checks the same table before
    /// writing a history row, and this machine asserts it before every change of state.
    pub fn can_transition(self, to: DispatchState) -> bool {
        use DispatchState::*;
        matches!(
            (self, to),
            (Prepared, Dispatching)
                | (Prepared, Abandoned)
                | (Dispatching, Sent | Unknown | Failed | Abandoned)
                | (Sent, Streaming | Unknown | Failed | Abandoned)
                | (Streaming, Committed | Unknown | Abandoned)
                | (Unknown, Dispatching | Streaming | Failed | Abandoned)
                | (Failed | Abandoned, Prepared)
        )
    }
}

impl fmt::Display for DispatchState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the provider in use supports for getting back to an attempt after a crash
/// (`shared/reference/provider-rules.md`: only OpenAI Responses in background mode resumes a
/// stream; no real provider honours an idempotency key today, the simulator can do both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ProviderRecovery {
    /// A stream can be resumed by its provider handle (response id).
    pub resume_by_handle: bool,
    /// A repeated request with the same idempotency key gets the same reply, not a second one.
    pub honours_idempotency_key: bool,
}

/// An attempt found in UNKNOWN after start-up (or after a disconnect).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownAttempt {
    /// Its generation.
    pub generation: Generation,
    /// The provider handle bound to it, if one was seen.
    pub handle: Option<String>,
    /// The idempotency key it was sent with.
    pub idempotency_key: String,
    /// When its lease runs out (it is presumed dead from then on).
    pub lease_expires_at: Timestamp,
    /// The provider said this attempt ended (e.g. a status poll answered "failed/cancelled").
    pub provider_confirmed_ended: bool,
}

/// What to do with an UNKNOWN attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub enum RecoveryDecision {
    /// Reattach to the running response by its handle; same generation, nothing re-sent.
    ResumeByHandle {
        /// The generation resumed.
        generation: Generation,
        /// The provider handle.
        handle: String,
    },
    /// Re-send the stored bytes under the same generation and idempotency key; the provider
    /// deduplicates. Needs a durable UNKNOWN → DISPATCHING write first.
    ReplaySameGeneration {
        /// The generation replayed.
        generation: Generation,
        /// The key it was first sent with.
        idempotency_key: String,
    },
    /// The old attempt is confirmed dead: mark it ABANDONED, rearm, and begin a new generation
    /// that re-sends the stored bytes.
    AbandonThenNewGeneration {
        /// The dead generation.
        generation: Generation,
    },
    /// Nothing may start yet: the old attempt could still be running.
    WaitUntil(Timestamp),
}

/// Decide how to recover one UNKNOWN attempt. Pure: same inputs, same answer.
pub fn recovery_decision(
    attempt: &UnknownAttempt,
    provider: ProviderRecovery,
    now: Timestamp,
) -> RecoveryDecision {
    if provider.resume_by_handle
        && let Some(handle) = &attempt.handle
    {
        return RecoveryDecision::ResumeByHandle {
            generation: attempt.generation,
            handle: handle.clone(),
        };
    }
    if provider.honours_idempotency_key {
        return RecoveryDecision::ReplaySameGeneration {
            generation: attempt.generation,
            idempotency_key: attempt.idempotency_key.clone(),
        };
    }
    if attempt.provider_confirmed_ended || now >= attempt.lease_expires_at {
        return RecoveryDecision::AbandonThenNewGeneration {
            generation: attempt.generation,
        };
    }
    RecoveryDecision::WaitUntil(attempt.lease_expires_at)
}

/// A durable write the gateway must make through the ledger, then answer with a
/// [`StoreAnswer`].
#[derive(Clone, Debug, PartialEq)]
pub enum Write {
    /// PREPARED → DISPATCHING: the compare-and-set that allocates a generation. Answer with
    /// [`StoreAnswer::Began`] or [`StoreAnswer::BeginRefused`].
    Begin {
        /// Condition: the conversation is still at this revision.
        expected_revision: Revision,
        /// Condition: nobody cancelled since.
        expected_cancel_generation: u64,
        /// The new attempt's lease.
        lease_expires_at: Timestamp,
    },
    /// A plain transition of the active attempt, fenced by its generation. Answer only if the
    /// store refused it ([`StoreAnswer::TransitionRefused`]).
    Transition {
        /// The active generation.
        generation: Generation,
        /// Expected current state.
        from: DispatchState,
        /// New state.
        to: DispatchState,
    },
    /// UNKNOWN → DISPATCHING for the same generation. Answer with [`StoreAnswer::Replayed`]
    /// or [`StoreAnswer::TransitionRefused`].
    Replay {
        /// The generation replayed.
        generation: Generation,
        /// Its renewed lease.
        lease_expires_at: Timestamp,
    },
    /// Mark the dead attempt ABANDONED and the dispatch PREPARED again. Answer with
    /// [`StoreAnswer::Rearmed`] or [`StoreAnswer::TransitionRefused`].
    AbandonAndRearm {
        /// The dead generation.
        generation: Generation,
    },
    /// Extend the lease of the active attempt (fenced by generation). Answer only if refused
    /// ([`StoreAnswer::LeaseLost`]).
    RenewLease {
        /// The active generation (the fencing token).
        generation: Generation,
        /// The new expiry.
        lease_expires_at: Timestamp,
    },
    /// The canonical commit: one assistant turn at revision + 1, conditional on (revision,
    /// active generation, state). Answer with [`StoreAnswer::Committed`] or
    /// [`StoreAnswer::CommitRefused`].
    Commit {
        /// The generation that produced the turn.
        generation: Generation,
        /// Condition: the conversation is still at this revision.
        expected_revision: Revision,
        /// The whole assistant turn (v1 turn JSON).
        turn: serde_json::Value,
    },
    /// Cancel the dispatch (bumps `cancel_generation`).
    Cancel {
        /// Condition: the cancel generation the machine knows.
        expected_cancel_generation: u64,
    },
}

/// What the store answered to a [`Write`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreAnswer {
    /// The begin CAS won; this generation is durable.
    Began {
        /// The allocated generation.
        generation: Generation,
        /// The idempotency key stored with it.
        idempotency_key: String,
    },
    /// The begin CAS lost (revision moved, cancelled, or another replica began).
    BeginRefused,
    /// The replay write is durable.
    Replayed {
        /// The generation.
        generation: Generation,
        /// Its idempotency key.
        idempotency_key: String,
    },
    /// The old attempt is ABANDONED and the dispatch PREPARED again.
    Rearmed,
    /// A conditional transition found another state or generation.
    TransitionRefused,
    /// The lease could not be renewed: this generation is no longer the active one.
    LeaseLost,
    /// The canonical turn is committed at this revision.
    Committed {
        /// The new revision.
        revision: Revision,
    },
    /// The canonical CAS lost; the store quarantined the turn's blocks.
    CommitRefused,
    /// The commit carried a provider handle that is bound to another manifest: nothing was
    /// committed and the attempt is still STREAMING (the driver treats it as interrupted).
    CommitUnbound,
}

/// What the provider side reported for one attempt.
#[derive(Clone, Debug, PartialEq)]
pub enum ProviderInput {
    /// The request was accepted (status line / first response bytes).
    Accepted,
    /// The provider handle (response id, message id) was seen.
    Handle(String),
    /// The first stream event arrived.
    FirstEvent,
    /// The assembler closed the whole turn (issue 4's assembler produces it).
    Completed {
        /// v1 assistant turn JSON, whole blocks only.
        turn: serde_json::Value,
    },
    /// The provider confirmably produced nothing (4xx before any event).
    Rejected,
    /// The connection broke or the stream ended without its stop event: the attempt may
    /// still be running at the provider.
    Interrupted,
}

/// An event for the client stream (`event: state`, `committed`, `retract`, `error`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientEvent {
    /// `event: state`.
    State {
        /// New state.
        state: DispatchState,
        /// The attempt generation, once one exists.
        generation: Option<Generation>,
    },
    /// `event: retract`: all preview of that generation is void.
    Retract {
        /// The generation.
        generation: Generation,
        /// Why (`interrupted`, `commit_refused`, `lease_lost`, `cancelled`).
        reason: &'static str,
    },
    /// `event: committed`.
    Committed {
        /// The revision of the committed turn.
        revision: Revision,
    },
    /// `event: error`.
    Error {
        /// A stable code.
        code: &'static str,
    },
}

/// Why blocks went to quarantine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuarantineReason {
    /// They came from a generation that is not the active one.
    ForeignGeneration,
    /// They arrived after the dispatch left a state where they could be committed.
    Late,
}

/// One effect for the gateway to perform, in the order polled.
#[derive(Clone, Debug, PartialEq)]
#[must_use]
pub enum Effect {
    /// Make this durable write, then feed the answer back with
    /// [`DispatchMachine::handle_store`].
    Persist(Write),
    /// Send the stored request bytes (those whose digest is `request_digest`), with this
    /// idempotency key. Only produced after the DISPATCHING write was acknowledged.
    Send {
        /// The attempt.
        generation: Generation,
        /// The key to send.
        idempotency_key: String,
        /// Which bytes: the manifest's request digest.
        request_digest: String,
    },
    /// Reattach to a running response by its handle.
    Resume {
        /// The attempt.
        generation: Generation,
        /// The handle.
        handle: String,
    },
    /// Bind the provider handle to the manifest digest.
    BindHandle {
        /// The attempt.
        generation: Generation,
        /// The handle.
        handle: String,
    },
    /// Tell the client.
    Emit(ClientEvent),
    /// Record blocks in the quarantine log; they never become history.
    Quarantine {
        /// The generation they came from.
        generation: Generation,
        /// Why.
        reason: QuarantineReason,
        /// The content (a turn or a block, as JSON).
        content: serde_json::Value,
    },
    /// The committed turn's tool calls are in the tool-call ledger now: tell executors.
    ExposeToolCalls {
        /// The revision of the assistant turn.
        revision: Revision,
    },
}

/// Why an input was ignored. Ignoring is an operating condition (counted), not an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IgnoreReason {
    /// The input names a generation other than the active one.
    ForeignGeneration,
    /// The machine is not waiting for this store answer (a duplicate or a late one).
    UnexpectedAnswer,
    /// The input does not apply in the current state (e.g. a duplicate `FirstEvent`).
    NotInThisState,
    /// The dispatch already reached a terminal state.
    Finished,
}

/// The outcome of one `handle_*` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Handled {
    /// The input was applied; poll for effects.
    Accepted,
    /// The input changed nothing.
    Ignored(IgnoreReason),
}

/// Which store answer the machine waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Awaiting {
    Begin,
    Replay,
    Rearm,
    Commit,
}

/// What the machine needs to start driving a prepared dispatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepared {
    /// Revision the manifest was rendered from.
    pub revision: Revision,
    /// `cancel_generation` as stored with the dispatch.
    pub cancel_generation: u64,
    /// The manifest's `request_digest` (names the stored bytes to send).
    pub request_digest: String,
}

/// The driver of one dispatch.
///
/// Calling order, after creating it with [`DispatchMachine::new`] or
/// [`DispatchMachine::recover`]:
/// 1. call [`DispatchMachine::start`] (fresh dispatch) once;
/// 2. after every `handle_*` call (and after `start`/`recover`), drain
///    [`DispatchMachine::poll_effect`] until it returns `None` and perform each effect in that
///    order; a [`Effect::Persist`] must be answered with [`DispatchMachine::handle_store`]
///    before later effects that depend on it are performed (the machine only produces such
///    effects after the answer, so performing them in order is enough);
/// 3. then read [`DispatchMachine::poll_timeout`] and call [`DispatchMachine::handle_timeout`]
///    when that instant has passed (lease renewal, waiting for a dead attempt's lease).
#[derive(Debug)]
pub struct DispatchMachine {
    state: DispatchState,
    revision: Revision,
    cancel_generation: u64,
    request_digest: String,
    generation: Option<Generation>,
    lease_ms: u64,
    lease_renew_at: Option<Timestamp>,
    wait_until: Option<Timestamp>,
    awaiting: Option<Awaiting>,
    effects: VecDeque<Effect>,
    ignored_total: u64,
}

impl DispatchMachine {
    /// A machine for a dispatch the store has PREPARED. `lease_ms` is clamped to
    /// `1..=LEASE_MS_MAX`.
    pub fn new(prepared: Prepared, lease_ms: u64) -> DispatchMachine {
        DispatchMachine {
            state: DispatchState::Prepared,
            revision: prepared.revision,
            cancel_generation: prepared.cancel_generation,
            request_digest: prepared.request_digest,
            generation: None,
            lease_ms: lease_ms.clamp(1, LEASE_MS_MAX),
            lease_renew_at: None,
            wait_until: None,
            awaiting: None,
            effects: VecDeque::new(),
            ignored_total: 0,
        }
    }

    /// Failover: the next attempt sends another target's stored bytes (those whose digest is
    /// `request_digest`). Only while PREPARED, before the begin that allocates that attempt's
    /// generation is answered; false (and nothing changes) in any other state.
    pub fn retarget(&mut self, request_digest: String) -> bool {
        if self.state != DispatchState::Prepared {
            return false;
        }
        self.request_digest = request_digest;
        true
    }

    /// A machine for a dispatch whose attempt is UNKNOWN (after start-up recovery), with the
    /// recovery decision already applied to its effects.
    pub fn recover(
        now: Timestamp,
        prepared: Prepared,
        lease_ms: u64,
        attempt: &UnknownAttempt,
        provider: ProviderRecovery,
    ) -> DispatchMachine {
        let mut machine = DispatchMachine::new(prepared, lease_ms);
        machine.state = DispatchState::Unknown;
        machine.generation = Some(attempt.generation);
        machine.apply_recovery(now, recovery_decision(attempt, provider, now));
        machine
    }

    fn apply_recovery(&mut self, now: Timestamp, decision: RecoveryDecision) {
        match decision {
            RecoveryDecision::ResumeByHandle { generation, handle } => {
                self.enter(DispatchState::Streaming);
                self.push(Effect::Persist(Write::Transition {
                    generation,
                    from: DispatchState::Unknown,
                    to: DispatchState::Streaming,
                }));
                self.push(Effect::Resume { generation, handle });
                self.lease_renew_at = Some(now);
            }
            RecoveryDecision::ReplaySameGeneration { generation, .. } => {
                self.awaiting = Some(Awaiting::Replay);
                self.push(Effect::Persist(Write::Replay {
                    generation,
                    lease_expires_at: now.plus_ms(self.lease_ms),
                }));
            }
            RecoveryDecision::AbandonThenNewGeneration { generation } => {
                self.awaiting = Some(Awaiting::Rearm);
                self.push(Effect::Persist(Write::AbandonAndRearm { generation }));
            }
            RecoveryDecision::WaitUntil(at) => self.wait_until = Some(at),
        }
    }

    /// Begin the first attempt of a PREPARED dispatch.
    pub fn start(&mut self, now: Timestamp) -> Handled {
        if self.state != DispatchState::Prepared || self.awaiting.is_some() {
            return self.ignore(IgnoreReason::NotInThisState);
        }
        self.persist_begin(now);
        Handled::Accepted
    }

    fn persist_begin(&mut self, now: Timestamp) {
        self.awaiting = Some(Awaiting::Begin);
        self.push(Effect::Persist(Write::Begin {
            expected_revision: self.revision,
            expected_cancel_generation: self.cancel_generation,
            lease_expires_at: now.plus_ms(self.lease_ms),
        }));
    }

    /// The current state as this machine knows it.
    pub fn state(&self) -> DispatchState {
        self.state
    }

    /// The active generation, once one was allocated.
    pub fn generation(&self) -> Option<Generation> {
        self.generation
    }

    /// How many inputs were ignored (stale, duplicate, foreign).
    pub fn ignored_total(&self) -> u64 {
        self.ignored_total
    }

    /// The next effect to perform, in order.
    #[must_use]
    pub fn poll_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    /// When [`DispatchMachine::handle_timeout`] should be called next, if ever.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        match (self.lease_renew_at, self.wait_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Time passed: renew the lease, or stop waiting for a dead attempt.
    pub fn handle_timeout(&mut self, now: Timestamp) -> Handled {
        let mut acted = false;
        if let Some(at) = self.wait_until
            && now >= at
            && self.state == DispatchState::Unknown
            && self.awaiting.is_none()
        {
            self.wait_until = None;
            let generation = self.active_generation();
            self.apply_recovery(now, RecoveryDecision::AbandonThenNewGeneration { generation });
            acted = true;
        }
        if let Some(at) = self.lease_renew_at
            && now >= at
            && self.state.is_live()
            && self.state != DispatchState::Unknown
        {
            let generation = self.active_generation();
            self.push(Effect::Persist(Write::RenewLease {
                generation,
                lease_expires_at: now.plus_ms(self.lease_ms),
            }));
            self.lease_renew_at = Some(now.plus_ms(self.lease_ms / 2));
            acted = true;
        }
        if acted {
            Handled::Accepted
        } else {
            self.ignore(IgnoreReason::NotInThisState)
        }
    }

    /// A lease renewal failed (its outcome unknown): try again at `at` instead of half a lease
    /// later, while the attempt is still this machine's. The holder stops on its own before the
    /// lease it last renewed runs out (the driver's fence); a store that answers before then
    /// lets the attempt go on.
    pub fn renew_again_at(&mut self, at: Timestamp) {
        if self.lease_renew_at.is_some() && self.state.is_live() && self.state != DispatchState::Unknown {
            self.lease_renew_at = Some(at);
        }
    }

    /// The store answered a [`Write`].
    pub fn handle_store(&mut self, now: Timestamp, answer: StoreAnswer) -> Handled {
        match (self.awaiting, answer) {
            (
                Some(Awaiting::Begin),
                StoreAnswer::Began {
                    generation,
                    idempotency_key,
                },
            ) => {
                self.awaiting = None;
                if let Some(previous) = self.generation {
                    // Generations only grow: the store allocated it by CAS.
                    assert!(
                        generation > previous,
                        "store allocated a generation that does not grow"
                    );
                }
                self.generation = Some(generation);
                self.enter(DispatchState::Dispatching);
                self.emit_state();
                self.lease_renew_at = Some(now.plus_ms(self.lease_ms / 2));
                // The acceptance point: the DISPATCHING row is durable, bytes may go out.
                self.push(Effect::Send {
                    generation,
                    idempotency_key,
                    request_digest: self.request_digest.clone(),
                });
                Handled::Accepted
            }
            (Some(Awaiting::Begin), StoreAnswer::BeginRefused) => {
                self.awaiting = None;
                self.push(Effect::Emit(ClientEvent::Error {
                    code: "begin_refused",
                }));
                Handled::Accepted
            }
            (
                Some(Awaiting::Replay),
                StoreAnswer::Replayed {
                    generation,
                    idempotency_key,
                },
            ) => {
                self.awaiting = None;
                assert_eq!(
                    Some(generation),
                    self.generation,
                    "replay answered for another generation"
                );
                self.enter(DispatchState::Dispatching);
                self.emit_state();
                self.lease_renew_at = Some(now.plus_ms(self.lease_ms / 2));
                self.push(Effect::Send {
                    generation,
                    idempotency_key,
                    request_digest: self.request_digest.clone(),
                });
                Handled::Accepted
            }
            (Some(Awaiting::Rearm), StoreAnswer::Rearmed) => {
                self.awaiting = None;
                self.enter(DispatchState::Abandoned);
                self.enter(DispatchState::Prepared);
                self.persist_begin(now);
                Handled::Accepted
            }
            (Some(Awaiting::Replay | Awaiting::Rearm), StoreAnswer::TransitionRefused) => {
                // Another replica took the attempt over; this machine stops driving it.
                self.awaiting = None;
                self.lease_renew_at = None;
                self.push(Effect::Emit(ClientEvent::Error {
                    code: "recovery_refused",
                }));
                Handled::Accepted
            }
            (Some(Awaiting::Commit), StoreAnswer::Committed { revision }) => {
                self.awaiting = None;
                assert_eq!(
                    revision.0,
                    self.revision.0 + 1,
                    "canonical turn must land at revision + 1"
                );
                self.enter(DispatchState::Committed);
                self.lease_renew_at = None;
                self.emit_state();
                self.push(Effect::Emit(ClientEvent::Committed { revision }));
                self.push(Effect::ExposeToolCalls { revision });
                Handled::Accepted
            }
            (Some(Awaiting::Commit), StoreAnswer::CommitUnbound) => {
                // Still STREAMING; the interruption that follows decides what happens next.
                self.awaiting = None;
                Handled::Accepted
            }
            (Some(Awaiting::Commit), StoreAnswer::CommitRefused) => {
                self.awaiting = None;
                self.lose("commit_refused");
                Handled::Accepted
            }
            (None, StoreAnswer::TransitionRefused | StoreAnswer::LeaseLost) if self.state.is_live() => {
                self.lose("lease_lost");
                Handled::Accepted
            }
            _ => self.ignore(IgnoreReason::UnexpectedAnswer),
        }
    }

    /// The provider side reported something about attempt `generation`.
    pub fn handle_provider(
        &mut self,
        now: Timestamp,
        generation: Generation,
        input: ProviderInput,
    ) -> Handled {
        let _ = now;
        if self.generation != Some(generation) {
            if let ProviderInput::Completed { turn } = input {
                self.push(Effect::Quarantine {
                    generation,
                    reason: QuarantineReason::ForeignGeneration,
                    content: turn,
                });
            }
            return self.ignore(IgnoreReason::ForeignGeneration);
        }
        if self.state.is_terminal() || self.awaiting == Some(Awaiting::Commit) {
            if let ProviderInput::Completed { turn } = input {
                self.push(Effect::Quarantine {
                    generation,
                    reason: QuarantineReason::Late,
                    content: turn,
                });
            }
            return self.ignore(IgnoreReason::Finished);
        }
        match (self.state, input) {
            (DispatchState::Dispatching, ProviderInput::Accepted) => {
                self.transition(DispatchState::Sent);
            }
            (
                DispatchState::Dispatching | DispatchState::Sent | DispatchState::Streaming,
                ProviderInput::Handle(handle),
            ) => {
                self.push(Effect::BindHandle { generation, handle });
            }
            (DispatchState::Dispatching, ProviderInput::FirstEvent) => {
                self.transition(DispatchState::Sent);
                self.transition(DispatchState::Streaming);
            }
            (DispatchState::Sent, ProviderInput::FirstEvent) => {
                self.transition(DispatchState::Streaming);
            }
            (DispatchState::Streaming, ProviderInput::Completed { turn }) => {
                self.awaiting = Some(Awaiting::Commit);
                self.push(Effect::Persist(Write::Commit {
                    generation,
                    expected_revision: self.revision,
                    turn,
                }));
            }
            (DispatchState::Dispatching | DispatchState::Sent, ProviderInput::Rejected) => {
                self.transition(DispatchState::Failed);
                self.lease_renew_at = None;
            }
            (
                DispatchState::Dispatching | DispatchState::Sent | DispatchState::Streaming,
                ProviderInput::Interrupted,
            ) => {
                self.transition(DispatchState::Unknown);
                self.lease_renew_at = None;
                self.push(Effect::Emit(ClientEvent::Retract {
                    generation,
                    reason: "interrupted",
                }));
            }
            (_, ProviderInput::Completed { turn }) => {
                // A whole turn outside STREAMING (e.g. after UNKNOWN) is never committed here.
                self.push(Effect::Quarantine {
                    generation,
                    reason: QuarantineReason::Late,
                    content: turn,
                });
                return self.ignore(IgnoreReason::NotInThisState);
            }
            _ => return self.ignore(IgnoreReason::NotInThisState),
        }
        Handled::Accepted
    }

    /// The client (or an operator) cancelled the dispatch.
    pub fn handle_cancel(&mut self, now: Timestamp) -> Handled {
        let _ = now;
        if self.state.is_terminal() {
            return self.ignore(IgnoreReason::Finished);
        }
        if self.awaiting == Some(Awaiting::Commit) {
            // The canonical commit is in flight; its answer decides (the store is the arbiter).
            return self.ignore(IgnoreReason::NotInThisState);
        }
        self.push(Effect::Persist(Write::Cancel {
            expected_cancel_generation: self.cancel_generation,
        }));
        self.cancel_generation += 1;
        self.awaiting = None;
        self.lease_renew_at = None;
        self.wait_until = None;
        if let Some(generation) = self.generation
            && self.state.is_live()
        {
            self.push(Effect::Emit(ClientEvent::Retract {
                generation,
                reason: "cancelled",
            }));
        }
        self.enter(DispatchState::Abandoned);
        self.emit_state();
        Handled::Accepted
    }

    fn lose(&mut self, reason: &'static str) {
        self.lease_renew_at = None;
        let generation = self.active_generation();
        self.push(Effect::Emit(ClientEvent::Retract { generation, reason }));
        if self.state != DispatchState::Abandoned {
            self.enter(DispatchState::Abandoned);
            self.emit_state();
        }
    }

    fn active_generation(&self) -> Generation {
        // Invariant: every caller runs in a live or post-attempt state, which is only reached
        // through `Began`, `Replayed` or `recover`, all of which set the generation.
        match self.generation {
            Some(generation) => generation,
            None => panic!("no generation in state {}", self.state),
        }
    }

    fn transition(&mut self, to: DispatchState) {
        let from = self.state;
        let generation = self.active_generation();
        self.enter(to);
        self.push(Effect::Persist(Write::Transition { generation, from, to }));
        self.emit_state();
    }

    fn enter(&mut self, to: DispatchState) {
        assert!(
            self.state.can_transition(to),
            "impossible dispatch transition {} -> {}",
            self.state,
            to
        );
        self.state = to;
    }

    fn emit_state(&mut self) {
        self.push(Effect::Emit(ClientEvent::State {
            state: self.state,
            generation: self.generation,
        }));
    }

    fn push(&mut self, effect: Effect) {
        assert!(
            self.effects.len() < EFFECTS_QUEUED_MAX,
            "effects were not polled (EFFECTS_QUEUED_MAX)"
        );
        self.effects.push_back(effect);
    }

    fn ignore(&mut self, reason: IgnoreReason) -> Handled {
        self.ignored_total += 1;
        Handled::Ignored(reason)
    }
}
