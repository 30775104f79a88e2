//! [`Drive`]: one dispatch, from PREPARED (or UNKNOWN after a crash) to its end.
//!
//! The driver is an event loop without I/O. Inputs are queued as work; [`Drive::poll_action`]
//! advances it until it needs something from outside: a store answer (exactly one
//! [`StoreOp`] is outstanding at a time, and nothing else advances until
//! [`Drive::handle_store`] answers it), or more input. The core machine's effects always run
//! before the next piece of queued work, so every machine input is followed by its effects
//! exactly as a synchronous driver would perform them.
//!
//! Polling order for a pump:
//! 1. call [`Drive::poll_action`] until it answers `None`, performing each [`Action`] in
//!    order (a [`Action::Store`] is performed and answered before the next poll);
//! 2. wait for a provider input (`handle_head`, `handle_chunk`, `handle_end`) or until
//!    [`Drive::poll_timeout`], then call the input or [`Drive::handle_timeout`];
//! 3. stop when [`Drive::is_finished`].

use crate::types::*;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use turnstile_adapters::decode::{Decoder, StreamApi};
use turnstile_core::Digest;
use turnstile_core::assemble::{Assembler, AssemblerConfig, Disposition, Output, RetractReason, Toolset};
use turnstile_core::dispatch::{
    ClientEvent, DispatchMachine, DispatchState, Effect, Handled, IgnoreReason, Prepared, ProviderInput,
    ProviderRecovery, QuarantineReason, RecoveryDecision, StoreAnswer, Timestamp, UnknownAttempt, Write,
    recovery_decision,
};
use turnstile_core::ids::Generation;
use turnstile_core::stream::{SeqSource, Sequenced, StreamEvent};

/// Most attempts (generations) started for one dispatch before giving up; each costs a billed
/// provider call.
pub const ATTEMPTS_PER_DISPATCH_MAX: u64 = 4;
/// Most resumes of one generation before it is treated as interrupted for good.
pub const RESUMES_PER_GENERATION_MAX: u32 = 3;
/// Most replays (same generation, same idempotency key) of one generation before recovery
/// stops relying on the provider's deduplication and waits for the lease instead.
pub const REPLAYS_PER_GENERATION_MAX: u32 = 3;
/// The share of a lease its holder keeps as margin: a driver stops on its own this long before
/// the end of the lease it last renewed (counted from when it asked for it, by its own clock,
/// so the store's end is never earlier). It covers a late timer and a slow close; clock rates
/// drift by parts per million.
/// `docs/decisions/0127-a-holder-fences-itself-it-stops-before-its-lease-can-run.md`, "A holder
/// fences itself".
pub const FENCE_MARGIN_DIVISOR: u64 = 5;
/// How soon a failed lease renewal is tried again, as a share of the lease.
const RENEW_RETRY_DIVISOR: u64 = 20;

/// When a holder that asked for a lease of `lease_ms` at `asked_at` (its own clock) must have
/// stopped: before the store's end of that lease, by the margin.
pub fn fence_deadline(asked_at: Timestamp, lease_ms: u64) -> Timestamp {
    asked_at.plus_ms(lease_ms - lease_ms / FENCE_MARGIN_DIVISOR)
}

/// Slack added to a lease end read back from the store before a rearm is tried.
const REARM_MARGIN_MS: u64 = 50;
/// Largest status or cancel answer read (a Responses object without its output is far
/// smaller; a bigger one is cut and read as no word).
const PROBE_BODY_MAX: usize = 256 * 1024;
/// Most bytes of a refusal's body kept for its message.
const REFUSAL_BODY_MAX: usize = 16 * 1024;
/// Most bytes of a provider's refusal message passed on to the client.
const REFUSAL_MESSAGE_MAX: usize = 1024;
/// Most decoded events of a foreign handle's stream kept in its quarantine entry.
const FOREIGN_EVENTS_KEPT_MAX: usize = 1_024;
/// Most pieces of queued input (a pump that outruns the driver is a bug).
const WORK_QUEUED_MAX: usize = 65_536;

/// Everything a driver needs that does not change during the dispatch.
#[derive(Clone)]
pub struct DriveSpec {
    /// The stored dispatch.
    pub basis: DispatchBasis,
    /// Its targets: 0 is the dispatch's own manifest (its bytes are `basis.request_bytes`),
    /// the rest its failover targets in order. Never empty.
    pub targets: Vec<DriveTarget>,
    /// Targets whose provider is cooling down after repeated failures (the gateway's circuit
    /// breaker): skipped when the next target is chosen, unless none other is left.
    pub cooling: Vec<bool>,
    /// The target of the dispatch's latest attempt, if it had one (durable, from the store):
    /// a driver that picks up a rearmed dispatch goes on from there, not from target 0.
    pub last_target: Option<u32>,
    /// The conversation's compiled tools (None: it declares none).
    pub toolset: Option<Arc<Toolset>>,
    /// Call ids already in the history.
    pub call_ids_taken: HashSet<String>,
    /// Attempt lease.
    pub lease_ms: u64,
    /// Attempts already started for this dispatch (durable, from the store): the budget
    /// counts across restarts.
    pub attempts_before: u64,
    /// Bounds on every wait.
    pub timeouts: Timeouts,
}

impl std::fmt::Debug for DriveSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriveSpec")
            .field("operation_id", &self.basis.operation_id)
            .field("targets", &self.targets.len())
            .finish_non_exhaustive()
    }
}

/// One connection's decoding state.
struct Connection {
    generation: Generation,
    decoder: Box<dyn Decoder>,
    status: Option<u16>,
    saw_event: bool,
    /// A resume of an earlier connection of the same generation.
    resume: bool,
    /// A question about the response rather than the response itself (its JSON body is
    /// read whole, not decoded as a stream).
    probe: Option<ProbeKind>,
    body: Vec<u8>,
    /// When it was opened, and when something last arrived on it.
    opened_at: Timestamp,
    active_at: Timestamp,
    /// Its target's bounds (the target's own, else the spec's), fixed when it opens.
    timeouts: Timeouts,
}

impl Connection {
    /// When this connection has waited too long, by its target's bounds.
    fn deadline(&self) -> Timestamp {
        let timeouts = self.timeouts;
        if self.probe.is_some() {
            // A question, not a stream: its whole answer within the head bound.
            return self.opened_at.plus_ms(timeouts.head_ms);
        }
        let whole = self.opened_at.plus_ms(timeouts.attempt_ms);
        let wait = match self.status {
            None => self.opened_at.plus_ms(timeouts.head_ms),
            Some(_) => self.active_at.plus_ms(timeouts.idle_ms),
        };
        whole.min(wait)
    }
}

/// What a probe's answer lets go on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AfterProbe {
    Rearm,
    GiveUp(&'static str),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ProbeKind {
    Status,
    Cancel,
}

/// Queued work, in order.
enum Work {
    Head {
        connection: ConnectionId,
        status: u16,
    },
    Chunk {
        connection: ConnectionId,
        bytes: Vec<u8>,
    },
    End {
        connection: ConnectionId,
        ending: Ending,
    },
    Timeout,
    DrainDecoder(ConnectionId),
    /// One decoded event, in stages (one machine input per stage).
    Event {
        connection: ConnectionId,
        generation: Generation,
        stage: u8,
        sequenced: Sequenced,
    },
    DrainAssembler(Generation),
    ConnectionEnded {
        connection: ConnectionId,
        ending: Ending,
    },
    AfterEnd {
        generation: Generation,
        clean: bool,
    },
    /// Read the attempt's stored facts, then decide recovery.
    Interruption {
        generation: Generation,
        provider_ended: bool,
    },
    InterruptionTail {
        tail: Box<Tail>,
    },
    /// The process is shutting down and its drain timeout passed: stop here and leave the
    /// dispatch to recovery.
    HandOver,
    /// The pump's memory budget ends the dispatch.
    Shed {
        reason: &'static str,
    },
    /// Keep material out of history, in the quarantine log.
    Quarantine {
        generation: Generation,
        reason: &'static str,
        content: Value,
    },
}

/// What to do after an interruption's own effects ran.
struct Tail {
    generation: Generation,
    attempt: UnknownAttempt,
    recovery: ProviderRecovery,
    decision: RecoveryDecision,
}

/// The continuation of the outstanding store operation.
enum Pending {
    MachineWrite(WriteKind),
    Bind {
        generation: Generation,
        handle: String,
    },
    Quarantine,
    Interruption {
        generation: Generation,
        provider_ended: bool,
        interrupt: bool,
    },
    ReplayKey {
        generation: Generation,
    },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum WriteKind {
    Begin,
    Transition {
        from: DispatchState,
        to: DispatchState,
    },
    Replay {
        generation: Generation,
    },
    AbandonAndRearm,
    /// A refused attempt to FAILED and the dispatch to PREPARED for its next target.
    FailOver {
        from: DispatchState,
    },
    RenewLease,
    Commit {
        generation: Generation,
    },
    Cancel,
}

impl WriteKind {
    /// Writes whose answer the machine waits for: if one fails, its outcome is unknown.
    fn awaited(self) -> bool {
        matches!(
            self,
            WriteKind::Begin
                | WriteKind::Replay { .. }
                | WriteKind::AbandonAndRearm
                | WriteKind::FailOver { .. }
                | WriteKind::Commit { .. }
                | WriteKind::Transition {
                    from: DispatchState::Unknown,
                    to: DispatchState::Streaming,
                }
        )
    }
}

/// A failover waiting for its FAILED write.
#[derive(Clone, Debug)]
struct PendingFailover {
    generation: Generation,
    to: usize,
    reason: String,
}

/// Whether a refused request moves the dispatch to its next target: 408, 409, 429 and 5xx
/// (the provider may answer another time, another provider now), or no connection at all
/// (`None`). Any other status is the request's own fault and would fail everywhere.
pub fn fails_over_on(status: Option<u16>) -> bool {
    match status {
        None => true,
        Some(status) => matches!(status, 408 | 409 | 429) || (500..600).contains(&status),
    }
}

/// One dispatch's driver. See the module documentation for the polling order.
pub struct Drive {
    spec: DriveSpec,
    machine: DispatchMachine,
    now: Timestamp,
    assembler: Option<Assembler>,
    connections: BTreeMap<ConnectionId, Connection>,
    connection_next: u64,
    attempts_started: u64,
    /// The target the next begin sends, and the target each generation sent.
    target: usize,
    targets_of: HashMap<Generation, usize>,
    /// A failover decided on a refused request: after its FAILED write, the dispatch is
    /// rearmed and the next generation sends `to`.
    failover: Option<PendingFailover>,
    /// Why each generation stopped (kept after its end write, for the failover's reason).
    stop_reasons: HashMap<Generation, String>,
    /// Generations this driver took over in UNKNOWN (their first request was someone's).
    recovered_generations: HashSet<Generation>,
    provider_sequence_last: Option<u64>,
    idempotency_keys: HashMap<Generation, String>,
    /// The state as the store knows it (for transition counts).
    state: DispatchState,
    retracted: HashSet<Generation>,
    /// Generations that showed preview text.
    previewed: HashSet<Generation>,
    provider_ended: HashSet<Generation>,
    resume_refused: HashSet<Generation>,
    resumes: HashMap<Generation, u32>,
    /// Replays made per generation, and generations whose replay cannot help (their
    /// provider handle belongs to another manifest).
    replays: HashMap<Generation, u32>,
    replay_refused: HashSet<Generation>,
    /// Why each generation stopped, noted when the driver sees it and written with the
    /// transition that ends the attempt (the first cause since that write wins: a head
    /// timeout closes the connection, which is not also a cut).
    end_causes: HashMap<Generation, String>,
    /// Provider handles known per generation (bound, read back, or seen on the stream).
    handles: HashMap<Generation, String>,
    /// Generations whose provider was asked before a new generation, and what it said.
    probed: HashSet<Generation>,
    provider_words: HashMap<Generation, String>,
    /// What waits for the provider's answer: the rearm (the machine waits for its write) or
    /// the end of a dispatch that gave up.
    after_probe: Option<(Generation, AfterProbe)>,
    /// Generations whose provider handle belongs to another manifest: it is never asked
    /// about, cancelled or resumed (the response is someone else's).
    foreign: HashSet<Generation>,
    stopped: bool,
    final_retract: Option<&'static str>,
    committed_turn: Option<Value>,
    offer_facts: HashMap<Generation, Value>,
    suppress_interrupt_retract: bool,
    work: VecDeque<Work>,
    pending: Option<Pending>,
    actions: VecDeque<Action>,
    /// Writes held back (SENT, STREAMING, a handle bind) until a write that needs them in the
    /// store first, or the commit that carries them
    /// (`docs/decisions/0083-two-durable-writes-per-dispatch-the-prepare-begins-the.md`: two
    /// durable writes per dispatch).
    behind: Vec<(StoreOp, Pending)>,
    /// Store operations to perform, in order, one at a time.
    outbox: VecDeque<(StoreOp, Pending)>,
    /// What the outstanding commit carries of `behind`.
    carried: Vec<(StoreOp, Pending)>,
    /// The first attempt the prepare already began in its own transaction.
    prebegun: Option<(Generation, String)>,
    /// A generation whose handle is held, not yet checked against the manifest, and the
    /// events decoded since (bounded): if the handle turns out to be another manifest's, they
    /// go to the quarantine log with it, as the queued events of a handle refused at once do.
    unchecked: Option<Generation>,
    unchecked_events: Vec<Sequenced>,
    /// When the outstanding lease write (begin, replay, resume, renewal) was asked for.
    lease_asked_at: Option<Timestamp>,
    /// This driver stopped on its own before its lease could run out: nothing of the machine
    /// goes out any more (no send, no write, no event); the ledger decides.
    fenced: bool,
    /// The process is shutting down and its drain timeout passed: stop before anything else.
    handing_over: bool,
    /// While this driver holds an attempt's lease: when it must have stopped, by its own
    /// clock ([`fence_deadline`] of the last lease write that landed).
    fence_at: Option<Timestamp>,
}

impl std::fmt::Debug for Drive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drive")
            .field("operation_id", &self.spec.basis.operation_id)
            .field("state", &self.machine.state())
            .field("generation", &self.machine.generation())
            .finish_non_exhaustive()
    }
}

/// The transitions held back until a write that needs them in the store first, or the commit
/// that carries them (SENT and STREAMING;
/// `docs/decisions/0083-two-durable-writes-per-dispatch-the-prepare-begins-the.md`: two durable
/// writes per dispatch). A handle's bind may be held too (`Drive::may_hold_handle`).
fn holds_back(op: &StoreOp) -> bool {
    matches!(
        op,
        StoreOp::Transition {
            from: DispatchState::Dispatching,
            to: DispatchState::Sent,
            ..
        } | StoreOp::Transition {
            from: DispatchState::Sent,
            to: DispatchState::Streaming,
            ..
        }
    )
}

fn prepared_of(basis: &DispatchBasis) -> Prepared {
    Prepared {
        revision: basis.revision,
        cancel_generation: basis.cancel_generation,
        request_digest: basis.request_digest.clone(),
    }
}

fn ignore_code(reason: IgnoreReason) -> &'static str {
    match reason {
        IgnoreReason::ForeignGeneration => "foreign_generation",
        IgnoreReason::UnexpectedAnswer => "unexpected_answer",
        IgnoreReason::NotInThisState => "not_in_this_state",
        IgnoreReason::Finished => "finished",
    }
}

impl Drive {
    /// A driver for a fresh PREPARED dispatch; its first action begins an attempt.
    pub fn new(spec: DriveSpec, now: Timestamp) -> Drive {
        let mut machine = DispatchMachine::new(prepared_of(&spec.basis), spec.lease_ms);
        let started = machine.start(now);
        let mut drive = Drive::with_machine(spec, machine, DispatchState::Prepared, now);
        drive.counted(started);
        drive
    }

    /// A driver for a dispatch whose first attempt the prepare already began, in the same
    /// transaction (`Ledger::prepare_and_begin`): generation `generation` with
    /// `idempotency_key`, on `target`. Its first action sends.
    pub fn begun(
        spec: DriveSpec,
        now: Timestamp,
        target: u32,
        generation: Generation,
        idempotency_key: String,
    ) -> Drive {
        let mut drive = Drive::new(spec, now);
        drive.target = (target as usize).min(drive.spec.targets.len() - 1);
        drive.prebegun = Some((generation, idempotency_key));
        // `now` is when the prepare asked for the attempt's lease: the fence counts from there.
        drive.lease_asked_at = Some(now);
        // The store's count of attempts, read after that write, already holds this one.
        drive.attempts_started = generation.0.saturating_sub(1);
        drive
    }

    /// A driver for a dispatch whose active attempt is UNKNOWN (start-up recovery, the lease
    /// sweep, a takeover).
    /// `spent`: what recovery already spent on that generation, by every driver (the store's
    /// counts), so a sweep on another replica cannot resume or replay it without bound.
    /// `target`: which target that attempt sent (the store's `attempts.target`).
    pub fn recovered(
        spec: DriveSpec,
        attempt: &UnknownAttempt,
        spent: RecoverySpent,
        target: u32,
        now: Timestamp,
    ) -> Drive {
        let placeholder = DispatchMachine::new(prepared_of(&spec.basis), spec.lease_ms);
        let mut drive = Drive::with_machine(spec, placeholder, DispatchState::Unknown, now);
        let target = (target as usize).min(drive.spec.targets.len() - 1);
        drive.target = target;
        drive.targets_of.insert(attempt.generation, target);
        drive.recovered_generations.insert(attempt.generation);
        drive.spent(attempt.generation, spent);
        if let Some(handle) = &attempt.handle {
            drive.handles.insert(attempt.generation, handle.clone());
        }
        let recovery = drive.recovery_for(attempt.generation, attempt.provider_confirmed_ended);
        let decision = recovery_decision(attempt, recovery, now);
        drive.machine = DispatchMachine::recover(
            now,
            drive.prepared_for(attempt.generation),
            drive.spec.lease_ms,
            attempt,
            recovery,
        );
        drive
            .idempotency_keys
            .insert(attempt.generation, attempt.idempotency_key.clone());
        drive.actions.push_back(Action::Count(Count::Unknown(true)));
        drive.count_recovery(&decision);
        drive
    }

    fn with_machine(
        spec: DriveSpec,
        machine: DispatchMachine,
        state: DispatchState,
        now: Timestamp,
    ) -> Drive {
        assert!(!spec.targets.is_empty(), "a dispatch has at least one target");
        let mut drive = Drive {
            attempts_started: spec.attempts_before,
            target: 0,
            targets_of: HashMap::new(),
            failover: None,
            stop_reasons: HashMap::new(),
            recovered_generations: HashSet::new(),
            spec,
            machine,
            now,
            assembler: None,
            connections: BTreeMap::new(),
            connection_next: 0,
            provider_sequence_last: None,
            idempotency_keys: HashMap::new(),
            state,
            retracted: HashSet::new(),
            previewed: HashSet::new(),
            provider_ended: HashSet::new(),
            resume_refused: HashSet::new(),
            resumes: HashMap::new(),
            replays: HashMap::new(),
            replay_refused: HashSet::new(),
            end_causes: HashMap::new(),
            handles: HashMap::new(),
            probed: HashSet::new(),
            provider_words: HashMap::new(),
            after_probe: None,
            foreign: HashSet::new(),
            stopped: false,
            final_retract: None,
            committed_turn: None,
            offer_facts: HashMap::new(),
            suppress_interrupt_retract: false,
            work: VecDeque::new(),
            pending: None,
            actions: VecDeque::new(),
            behind: Vec::new(),
            outbox: VecDeque::new(),
            carried: Vec::new(),
            prebegun: None,
            unchecked: None,
            unchecked_events: Vec::new(),
            lease_asked_at: None,
            fenced: false,
            handing_over: false,
            fence_at: None,
        };
        // A dispatch rearmed after an attempt goes on from the target after that attempt's;
        // a fresh one starts at its own manifest (target 0), cooling targets skipped.
        drive.target = match drive.spec.last_target {
            Some(last) => drive.next_target(last as usize).unwrap_or(last as usize),
            None => drive.pick_target(0),
        }
        .min(drive.spec.targets.len() - 1);
        drive
    }

    /// The first target at or after `from` that is not cooling down (`from` itself if all are).
    fn pick_target(&self, from: usize) -> usize {
        (from..self.spec.targets.len())
            .find(|&index| !self.spec.cooling.get(index).copied().unwrap_or(false))
            .unwrap_or(from)
    }

    /// The target after `current`, if the dispatch has one.
    fn next_target(&self, current: usize) -> Option<usize> {
        (current + 1 < self.spec.targets.len()).then(|| self.pick_target(current + 1))
    }

    /// The target `generation` sent (the next begin's target for one not begun here).
    fn target_of(&self, generation: Generation) -> usize {
        self.targets_of.get(&generation).copied().unwrap_or(self.target)
    }

    fn target_spec(&self, generation: Generation) -> &DriveTarget {
        &self.spec.targets[self.target_of(generation).min(self.spec.targets.len() - 1)]
    }

    /// What the machine needs for `generation`: a replay sends that generation's target's
    /// bytes, so the machine names them by that target's digest.
    fn prepared_for(&self, generation: Generation) -> Prepared {
        let mut prepared = prepared_of(&self.spec.basis);
        prepared.request_digest = self.target_spec(generation).request_digest.clone();
        prepared
    }

    /// The operation this driver drives.
    pub fn operation_id(&self) -> &str {
        &self.spec.basis.operation_id
    }

    /// The stored bytes of `target` (what an [`Request::Send`] on a connection to it sends).
    pub fn request_bytes(&self, target: u32) -> &Arc<Vec<u8>> {
        let index = (target as usize).min(self.spec.targets.len() - 1);
        &self.spec.targets[index].request_bytes
    }

    /// The machine's state.
    pub fn state(&self) -> DispatchState {
        self.machine.state()
    }

    /// The active generation.
    pub fn generation(&self) -> Option<Generation> {
        self.machine.generation()
    }

    /// Attempts started for this dispatch, across restarts.
    pub fn attempts_started(&self) -> u64 {
        self.attempts_started
    }

    /// The driver can make no further progress: a begin or recovery was refused (another
    /// replica or a cancel decided), or a store write failed and the lease decides.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Nothing more will happen here (the pump may drop the driver once its actions ran).
    pub fn is_finished(&self) -> bool {
        if self.pending.is_some()
            || !self.work.is_empty()
            || !self.actions.is_empty()
            || !self.outbox.is_empty()
        {
            return false;
        }
        let state = self.machine.state();
        self.stopped
            || state.is_terminal()
            || (state == DispatchState::Prepared && self.machine.poll_timeout().is_none() && self.gave_up())
    }

    /// When [`Drive::handle_timeout`] should be called next.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        if self.stopped {
            return None;
        }
        let connections = self.connections.values().map(Connection::deadline).min();
        [self.machine.poll_timeout(), connections, self.fence()]
            .into_iter()
            .flatten()
            .min()
    }

    /// While this driver holds an attempt's lease: the moment it stops on its own, by its own
    /// clock, unless a renewal lands first
    /// (`docs/decisions/0127-a-holder-fences-itself-it-stops-before-its-lease-can-run.md`, "A
    /// holder fences itself").
    fn fence(&self) -> Option<Timestamp> {
        let holds = matches!(
            self.machine.state(),
            DispatchState::Dispatching | DispatchState::Sent | DispatchState::Streaming
        );
        self.fence_at.filter(|_| holds && !self.stopped)
    }

    /// How long a pump may wait for the store while provider connections are open: until the
    /// fence (then it answers the outstanding operation [`StoreResult::Failed`], whatever the
    /// store does with it later). `None`: no connection depends on the lease.
    pub fn store_wait_deadline(&self) -> Option<Timestamp> {
        self.fence().filter(|_| !self.connections.is_empty())
    }

    /// A lease write landed: the fence moves to the lease it granted.
    fn lease_granted(&mut self) {
        if let Some(asked_at) = self.lease_asked_at.take() {
            self.fence_at = Some(fence_deadline(asked_at, self.spec.lease_ms));
        }
    }

    /// Stop before the lease runs out: close every provider connection, void this driver's
    /// preview, and leave the attempt to recovery by the store's clock. Nothing the machine
    /// still has goes out (no send, write or event): the ledger tells the clients the rest.
    fn self_fence(&mut self, reason: &'static str) {
        if self.fenced {
            return;
        }
        self.fenced = true;
        self.stopped = true;
        self.fence_at = None;
        self.actions.push_back(Action::Count(Count::SelfFenced(reason)));
        let open: Vec<ConnectionId> = self.connections.keys().copied().collect();
        for connection in open {
            self.actions.push_back(Action::Close { connection });
        }
        self.connections.clear();
        self.work.clear();
        self.outbox.clear();
        self.behind.clear();
        self.after_probe = None;
        self.failover = None;
        if let Some(generation) = self.machine.generation() {
            self.retract(generation, reason);
        }
    }

    /// Whether this driver stopped on its own before its lease could run out.
    pub fn fenced(&self) -> bool {
        self.fenced
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        self.now = now;
        self.queue(Work::Timeout);
    }

    /// A provider connection's response head arrived.
    pub fn handle_head(&mut self, now: Timestamp, connection: ConnectionId, status: u16) {
        self.now = now;
        self.queue(Work::Head { connection, status });
    }

    /// Body bytes arrived on a connection.
    pub fn handle_chunk(&mut self, now: Timestamp, connection: ConnectionId, bytes: Vec<u8>) {
        self.now = now;
        self.queue(Work::Chunk { connection, bytes });
    }

    /// A connection ended.
    pub fn handle_end(&mut self, now: Timestamp, connection: ConnectionId, ending: Ending) {
        self.now = now;
        self.queue(Work::End { connection, ending });
    }

    /// The pump must stop holding this dispatch's provider output (its process-wide memory
    /// budget chose it): the attempt ends at once, nothing of it commits, and the dispatch ends
    /// with `reason` instead of trying again (the same reply would need the same memory).
    pub fn handle_shed(&mut self, now: Timestamp, reason: &'static str) {
        self.now = now;
        self.queue(Work::Shed { reason });
    }

    /// The process is shutting down and its drain timeout passed (`docs/operating.md`,
    /// "Shutdown and drain"): stop as a self-fence does (reason `shutting_down`): every provider
    /// connection closed, this driver's preview retracted, nothing more sent, written or
    /// emitted; the attempt is left to recovery (the pump releases its lease once every
    /// connection is closed). Queued behind the inputs already given, so a store operation in
    /// flight is answered first.
    pub fn handle_hand_over(&mut self, now: Timestamp) {
        self.now = now;
        // Queued input already read is finished first (a complete answer still commits); a
        // send or resume the machine asks for meanwhile is refused (`effect`).
        self.handing_over = true;
        self.queue(Work::HandOver);
    }

    /// The answer to the outstanding [`Action::Store`].
    pub fn handle_store(&mut self, now: Timestamp, result: StoreResult) {
        self.now = now;
        // Invariant: pumps answer exactly the operation they were given.
        let Some(pending) = self.pending.take() else {
            panic!("a store answer without an outstanding store operation");
        };
        match pending {
            Pending::MachineWrite(kind) => self.write_answered(kind, result),
            Pending::Bind { generation, handle } => self.bind_answered(generation, &handle, result, None),
            Pending::Quarantine => {
                if let StoreResult::Failed(_) = result {
                    self.actions.push_back(Action::Count(Count::StoreFailure));
                }
            }
            Pending::Interruption {
                generation,
                provider_ended,
                interrupt,
            } => self.interruption_answered(generation, provider_ended, interrupt, result),
            Pending::ReplayKey { generation } => {
                let key = match result {
                    StoreResult::Attempts(attempts) => attempts
                        .into_iter()
                        .find(|attempt| attempt.generation == generation)
                        .map(|attempt| attempt.idempotency_key),
                    _ => None,
                };
                let Some(key) = key.filter(|key| !key.is_empty()) else {
                    // Never send without the attempt's own key: stop, the lease decides.
                    self.actions.push_back(Action::Count(Count::StoreFailure));
                    self.stopped = true;
                    return;
                };
                self.idempotency_keys.insert(generation, key.clone());
                let handled = self.machine.handle_store(
                    self.now,
                    StoreAnswer::Replayed {
                        generation,
                        idempotency_key: key,
                    },
                );
                self.counted(handled);
            }
        }
    }

    /// The next thing the pump must do.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<Action> {
        if self.actions.is_empty() {
            self.advance();
        }
        self.actions.pop_front()
    }

    fn queue(&mut self, work: Work) {
        assert!(
            self.work.len() < WORK_QUEUED_MAX,
            "driver input was not polled (WORK_QUEUED_MAX)"
        );
        self.work.push_back(work);
    }

    fn advance(&mut self) {
        while self.actions.is_empty() && self.pending.is_none() {
            if self.fence().is_some_and(|at| self.now >= at) {
                // Past the fence nothing proceeds: no read, no send, no write.
                self.self_fence("lease_ending");
                continue;
            }
            if let Some((op, pending)) = self.outbox.pop_front() {
                self.issue(op, pending);
                continue;
            }
            if let Some(effect) = self.machine.poll_effect() {
                self.effect(effect);
                continue;
            }
            let Some(work) = self.work.pop_front() else {
                return;
            };
            self.step(work);
        }
    }

    /// A store operation, in order after those queued: held back, carried by the commit, or
    /// performed (after the held-back writes it must follow).
    fn store(&mut self, op: StoreOp, pending: Pending) {
        let held = match &op {
            StoreOp::BindHandle { generation, .. } => self.may_hold_handle(*generation),
            op => holds_back(op),
        };
        if held {
            if let StoreOp::BindHandle { generation, .. } = &op {
                self.unchecked = Some(*generation);
                self.unchecked_events.clear();
            }
            self.behind.push((op, pending));
            return;
        }
        let op = match op {
            StoreOp::Commit {
                generation,
                expected_revision,
                turn,
                outcome,
                ..
            } => {
                let (from, handle) = self.carry();
                StoreOp::Commit {
                    generation,
                    expected_revision,
                    turn,
                    outcome,
                    from,
                    handle,
                    bind: self.handle_is_identity(generation),
                }
            }
            // None of them moves the attempt: they need nothing in the store first (a bind is
            // checked against the manifest, whatever the attempt's state).
            op @ (StoreOp::Quarantine { .. } | StoreOp::ReadAttempts | StoreOp::BindHandle { .. }) => op,
            op => {
                // A held handle that is no identity stays held (`handle_is_identity`): the commit
                // records it unbound, and a server that reuses its ids must not turn a renewal
                // or a transition into a foreign handle.
                let (keep, flush): (Vec<_>, Vec<_>) =
                    std::mem::take(&mut self.behind).into_iter().partition(|(op, _)| {
                        matches!(op, StoreOp::BindHandle { generation, .. } if !self.handle_is_identity(*generation))
                    });
                self.behind = keep;
                self.outbox.extend(flush);
                op
            }
        };
        if self.pending.is_none() && self.outbox.is_empty() {
            self.issue(op, pending);
        } else {
            self.outbox.push_back((op, pending));
        }
    }

    fn issue(&mut self, op: StoreOp, pending: Pending) {
        assert!(self.pending.is_none(), "two store operations outstanding");
        let asked = match &op {
            StoreOp::Begin { lease_expires_at, .. }
            | StoreOp::Replay { lease_expires_at, .. }
            | StoreOp::Resume { lease_expires_at, .. }
            | StoreOp::RenewLease { lease_expires_at, .. } => Some(*lease_expires_at),
            _ => None,
        };
        if let Some(lease_expires_at) = asked {
            // The store ends this lease at its clock when the write runs plus what is left of
            // the lease the write names (`store::drive::perform` rebases it), so by ours no later
            // than the lease's own end: count from when the lease was named, or from now if
            // that is earlier (a write issued late, after held writes, asks for less).
            let named = Timestamp(lease_expires_at.0.saturating_sub(self.spec.lease_ms));
            self.lease_asked_at = Some(named.min(self.now));
        }
        self.pending = Some(pending);
        self.actions.push_back(Action::Store(op));
    }

    /// What the commit carries of the held-back writes: the attempt's stored state and the
    /// handle to bind. A shape the commit cannot carry (two binds) is performed first.
    fn carry(&mut self) -> (DispatchState, Option<String>) {
        let binds = self
            .behind
            .iter()
            .filter(|(op, _)| matches!(op, StoreOp::BindHandle { .. }))
            .count();
        if binds > 1 {
            self.outbox.extend(self.behind.drain(..));
            return (DispatchState::Streaming, None);
        }
        self.carried = std::mem::take(&mut self.behind);
        let mut from = DispatchState::Streaming;
        let mut handle = None;
        for (op, _) in self.carried.iter().rev() {
            match op {
                StoreOp::Transition { from: held, .. } => from = *held,
                StoreOp::BindHandle { handle: held, .. } => handle = Some(held.clone()),
                _ => {}
            }
        }
        (from, handle)
    }

    /// Whether `generation`'s handle may wait for the commit: only on a first send to a
    /// target that cannot resume by handle, where a durable handle would only serve the
    /// commit's check (this process keeps it in memory for a status or cancel question; after
    /// a crash the expired lease confirms the attempt over instead). A resumable target binds
    /// at once (recovery resumes by it), and so does a replayed or recovered generation (its
    /// handle may be someone else's, and the sooner that is known the sooner its output stops).
    fn may_hold_handle(&self, generation: Generation) -> bool {
        !self.target_spec(generation).recovery.resume_by_handle
            && !self.recovered_generations.contains(&generation)
            && !self.replays.contains_key(&generation)
    }

    /// Whether this driver held the only connection to `generation`'s response and it is
    /// closed (the provider ended it, it broke under us, or we closed it): its one request was
    /// this driver's own send (no replay, resume or recovery: a refused replay or resume is no
    /// proof the first request ended), and the target offers no other way to read a response
    /// (no resume by handle, no deduplication by our key, not Responses, whose response can be
    /// asked about and cancelled by id). Then no one can deliver that
    /// response any more, and the new generation need not wait for the lease. A crash, another
    /// replica's attempt or a resumable target still waits for it.
    fn closed_here(&self, generation: Generation) -> bool {
        let target = self.target_spec(generation);
        let recovery = target.recovery;
        // A Responses response can be asked about and cancelled by its id: its own protocol
        // (`ask_provider_first`) decides, and a "still running" must never be overruled here.
        target.api != StreamApi::OpenAiResponses
            && !recovery.resume_by_handle
            && !recovery.honours_idempotency_key
            && !self.recovered_generations.contains(&generation)
            && self.replays.get(&generation).copied().unwrap_or(0) == 0
            && self.resumes.get(&generation).copied().unwrap_or(0) == 0
            && !self
                .connections
                .values()
                .any(|connection| connection.generation == generation && connection.probe.is_none())
    }

    /// Whether `generation`'s handle names its response anywhere but on its own connection:
    /// a resume or replay (recovery goes by it), a Responses target (status and cancel
    /// questions, `previous_response_id`), a provider that deduplicates by our key. Only
    /// then is it bound, unique per provider; elsewhere it is recorded on the attempt, and a
    /// server that reuses ids (`chatcmpl-1` again after its restart) commits as any other.
    fn handle_is_identity(&self, generation: Generation) -> bool {
        let target = self.target_spec(generation);
        target.api == StreamApi::OpenAiResponses
            || target.recovery.resume_by_handle
            || target.recovery.honours_idempotency_key
            || self.recovered_generations.contains(&generation)
            || self.replays.contains_key(&generation)
    }

    fn emit(&mut self, event: DriveEvent) {
        self.actions.push_back(Action::Emit(event));
    }

    fn emit_error(&mut self, code: &str) {
        self.emit(DriveEvent::Error {
            code: code.to_owned(),
            message: error_message(code).into(),
        });
    }

    fn counted(&mut self, handled: Handled) {
        if let Handled::Ignored(reason) = handled {
            self.actions
                .push_back(Action::Count(Count::Ignored(ignore_code(reason))));
        }
    }

    fn count_recovery(&mut self, decision: &RecoveryDecision) {
        // A new generation is counted when its rearm write lands (it may follow a wait).
        let outcome = match decision {
            RecoveryDecision::ResumeByHandle { .. } => "resumed",
            RecoveryDecision::ReplaySameGeneration { .. } => "replayed",
            RecoveryDecision::WaitUntil(_) => "waiting",
            RecoveryDecision::AbandonThenNewGeneration { .. } => return,
        };
        self.actions.push_back(Action::Count(Count::Recovery(outcome)));
    }

    /// Fold in what the store says recovery spent on `generation` (another driver may have
    /// resumed or replayed it too).
    fn spent(&mut self, generation: Generation, spent: RecoverySpent) {
        let resumes = self.resumes.entry(generation).or_default();
        *resumes = (*resumes).max(spent.resumes);
        let replays = self.replays.entry(generation).or_default();
        *replays = (*replays).max(spent.replays);
    }

    /// Pair assertion across the store boundary (on in release): what the driver was told when
    /// it began (or recovered) `generation` is what it reads back.
    fn read_back(&self, generation: Generation, idempotency_key: &str) {
        if let Some(known) = self.idempotency_keys.get(&generation) {
            assert_eq!(
                known, idempotency_key,
                "{} g{}: the store gave back another idempotency key than it began with",
                self.spec.basis.operation_id, generation.0
            );
        }
    }

    /// Note why `generation` stopped (kept until the write that ends the attempt).
    fn cause(&mut self, generation: Generation, reason: impl Into<String>) {
        let reason = reason.into();
        self.stop_reasons
            .entry(generation)
            .or_insert_with(|| reason.clone());
        self.end_causes.entry(generation).or_insert(reason);
    }

    fn gave_up(&self) -> bool {
        self.attempts_started >= ATTEMPTS_PER_DISPATCH_MAX || self.final_retract.is_some()
    }

    /// What the provider offers for getting back to `generation`: no resume after a clean end
    /// (the provider finished that response), after a refused resume, or past the resume cap.
    fn recovery_for(&self, generation: Generation, clean_end: bool) -> ProviderRecovery {
        let mut recovery = self.target_spec(generation).recovery;
        if clean_end
            || self.resume_refused.contains(&generation)
            || self.resumes.get(&generation).copied().unwrap_or(0) >= RESUMES_PER_GENERATION_MAX
        {
            recovery.resume_by_handle = false;
        }
        if self.replay_refused.contains(&generation)
            || self.replays.get(&generation).copied().unwrap_or(0) >= REPLAYS_PER_GENERATION_MAX
        {
            // Replaying the same key would only bring back the same answer.
            recovery.honours_idempotency_key = false;
        }
        recovery
    }

    /// One retract per generation, whoever noticed first (assembler or machine).
    fn retract(&mut self, generation: Generation, reason: &str) {
        if self.retracted.insert(generation) {
            // The metric counts previews taken back: a generation that showed nothing (a
            // refusal before any event, a failover) is retracted to the client all the same.
            if self.previewed.contains(&generation) {
                self.actions.push_back(Action::Count(Count::PreviewRetraction));
            }
            self.emit(DriveEvent::Retract {
                generation,
                reason: reason.to_owned(),
            });
        }
    }

    fn transitioned(&mut self, from: DispatchState, to: DispatchState) {
        self.actions
            .push_back(Action::Count(Count::Transition { from, to }));
        self.state = to;
        if from == DispatchState::Unknown {
            self.actions.push_back(Action::Count(Count::Unknown(false)));
        }
        if to == DispatchState::Unknown {
            self.actions.push_back(Action::Count(Count::Unknown(true)));
        }
    }

    fn effect(&mut self, effect: Effect) {
        if self.fenced {
            return;
        }
        if self.handing_over && matches!(effect, Effect::Send { .. } | Effect::Resume { .. }) {
            // Nothing new goes out after the hand-over (a driver started after it began).
            self.self_fence("shutting_down");
            return;
        }
        if self.stopped
            && matches!(
                effect,
                Effect::Send { .. } | Effect::Resume { .. } | Effect::BindHandle { .. }
            )
        {
            // This driver no longer owns the attempt: nothing may go out or be bound for it.
            return;
        }
        match effect {
            Effect::Persist(write) => self.persist(write),
            Effect::Send {
                generation,
                idempotency_key,
                request_digest,
            } => self.send(generation, idempotency_key, &request_digest),
            Effect::Resume { generation, handle } => self.resume(generation, handle),
            Effect::BindHandle { generation, handle } => {
                let pending = Pending::Bind {
                    generation,
                    handle: handle.clone(),
                };
                self.store(StoreOp::BindHandle { generation, handle }, pending);
            }
            Effect::Emit(event) => match event {
                ClientEvent::State { state, generation } => {
                    self.emit(DriveEvent::State { state, generation });
                }
                ClientEvent::Retract {
                    reason: "interrupted",
                    ..
                } if self.suppress_interrupt_retract => {}
                ClientEvent::Retract { generation, reason } => self.retract(generation, reason),
                ClientEvent::Committed { revision } => {
                    let turn = self.committed_turn.take().unwrap_or(Value::Null);
                    let facts = turn["generation"]
                        .as_u64()
                        .and_then(|generation| self.offer_facts.remove(&Generation(generation)));
                    self.emit(DriveEvent::Committed {
                        revision,
                        turn,
                        facts,
                    });
                }
                ClientEvent::Error {
                    code: "begin_refused" | "recovery_refused",
                } => {
                    // Not an error for the client: the pump switches to watching the dispatch
                    // that someone else drives (see `stopped`).
                }
                ClientEvent::Error { code } => self.emit_error(code),
            },
            Effect::Quarantine {
                generation,
                reason,
                content,
            } => {
                let reason = match reason {
                    QuarantineReason::ForeignGeneration => "foreign_generation",
                    QuarantineReason::Late => "late",
                };
                self.quarantine(generation, reason, content);
            }
            Effect::ExposeToolCalls { revision } => {
                // The store inserted them in the commit transaction; executors read the ledger.
                self.actions.push_back(Action::ExposeToolCalls { revision });
            }
        }
    }

    /// Before a new generation replaces an OpenAI Responses attempt whose handle is known, ask
    /// the provider about it (a background response keeps running after its connection
    /// closed): a response still running is cancelled, so two generations never run at once
    /// at the provider. The rearm waits for the answer (every probe is bounded by the
    /// connection deadlines); without an answer the expired lease is the confirmation.
    fn ask_provider_first(&mut self, generation: Generation) -> bool {
        if self.stopped
            || self.target_spec(generation).api != StreamApi::OpenAiResponses
            || !self.probed.insert(generation)
        {
            return false;
        }
        let Some(handle) = self.own_handle(generation) else {
            return false;
        };
        self.after_probe = Some((generation, AfterProbe::Rearm));
        self.open(generation, Request::Status { handle }, false);
        true
    }

    /// The provider handle of `generation` if it is this dispatch's own (bound, read back, or
    /// seen on its stream and not refused as another manifest's) and safe in a URL path.
    fn own_handle(&self, generation: Generation) -> Option<String> {
        let unchecked =
            self.behind.iter().chain(&self.carried).any(
                |(op, _)| matches!(op, StoreOp::BindHandle { generation: held, .. } if *held == generation),
            );
        if self.foreign.contains(&generation) || unchecked {
            // Never ask about (or cancel) a response by a handle the store has not yet matched
            // to this manifest.
            return None;
        }
        let handle = self.handles.get(&generation).cloned().or_else(|| {
            self.assembler
                .as_ref()
                .filter(|assembler| assembler.generation() == generation)
                .and_then(|assembler| assembler.handle().map(str::to_owned))
        })?;
        let safe = !handle.is_empty()
            && handle.len() <= 256
            && handle
                .bytes()
                .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'-' | b'.'));
        safe.then_some(handle)
    }

    /// A dispatch that gives up while a Responses attempt of its own may still run at the
    /// provider: cancel it first (bounded), then end.
    fn give_up(&mut self, code: &'static str) {
        if let Some(generation) = self.machine.generation()
            && !self.stopped
            && self.target_spec(generation).api == StreamApi::OpenAiResponses
            && self.after_probe.is_none()
            && self.probed.insert(generation)
            && let Some(handle) = self.own_handle(generation)
        {
            self.after_probe = Some((generation, AfterProbe::GiveUp(code)));
            self.open(generation, Request::Cancel { handle }, false);
            return;
        }
        self.emit_error(code);
        let handled = self.machine.handle_cancel(self.now);
        self.counted(handled);
    }

    /// A status or cancel answer arrived (or the probe ended without one).
    fn probe_ended(&mut self, open: Connection, ending: Ending) {
        let generation = open.generation;
        let answered =
            ending == Ending::Clean && open.status.is_some_and(|status| (200..300).contains(&status));
        let status = answered
            .then(|| turnstile_core::parse::bounded_value(&open.body))
            .flatten()
            .and_then(|body| body.get("status").and_then(Value::as_str).map(str::to_owned));
        match (open.probe, status.as_deref()) {
            (Some(ProbeKind::Status), Some("queued" | "in_progress")) => {
                if let Some(handle) = self.own_handle(generation) {
                    self.open(generation, Request::Cancel { handle }, false);
                    return;
                }
            }
            (Some(ProbeKind::Status), Some(word @ ("completed" | "failed" | "cancelled" | "incomplete"))) => {
                self.provider_words
                    .insert(generation, format!("provider_status_{word}"));
            }
            (Some(ProbeKind::Cancel), Some("cancelled")) => {
                self.provider_words
                    .insert(generation, "provider_cancelled".to_owned());
            }
            _ => {}
        }
        match self.after_probe.take() {
            Some((waiting, AfterProbe::Rearm)) if waiting == generation => {
                self.persist(Write::AbandonAndRearm { generation });
            }
            Some((waiting, AfterProbe::GiveUp(code))) if waiting == generation => {
                self.emit_error(code);
                let handled = self.machine.handle_cancel(self.now);
                self.counted(handled);
            }
            other => self.after_probe = other,
        }
    }

    fn quarantine(&mut self, generation: Generation, reason: &'static str, content: Value) {
        self.actions.push_back(Action::Count(Count::LateBlock));
        self.store(
            StoreOp::Quarantine {
                generation,
                reason,
                content,
            },
            Pending::Quarantine,
        );
    }

    fn persist(&mut self, write: Write) {
        let (op, kind) = match write {
            Write::Begin {
                expected_revision,
                expected_cancel_generation,
                lease_expires_at,
            } => {
                if self.gave_up() {
                    // The budget is spent: end the dispatch durably (ABANDONED), so nothing
                    // picks a PREPARED dispatch up again and again.
                    let code = self.final_retract.unwrap_or("attempts_exhausted");
                    self.emit_error(code);
                    let handled = self.machine.handle_cancel(self.now);
                    self.counted(handled);
                    return;
                }
                // The attempt sends the chosen target's bytes (failover moved it, or not).
                let digest = self.spec.targets[self.target].request_digest.clone();
                self.machine.retarget(digest);
                if let Some((generation, idempotency_key)) = self.prebegun.take() {
                    // The prepare began this attempt in its own transaction.
                    self.write_answered(
                        WriteKind::Begin,
                        StoreResult::Began {
                            generation,
                            idempotency_key,
                        },
                    );
                    return;
                }
                (
                    StoreOp::Begin {
                        target: self.target as u32,
                        expected_revision,
                        expected_cancel_generation,
                        lease_expires_at,
                    },
                    WriteKind::Begin,
                )
            }
            Write::Transition {
                generation,
                from: DispatchState::Unknown,
                to: DispatchState::Streaming,
            } => (
                // A resume takes the attempt over: the lease moves to this driver.
                StoreOp::Resume {
                    generation,
                    lease_expires_at: self.now.plus_ms(self.spec.lease_ms),
                },
                WriteKind::Transition {
                    from: DispatchState::Unknown,
                    to: DispatchState::Streaming,
                },
            ),
            Write::Transition { generation, from, to } => {
                let ends = matches!(
                    to,
                    DispatchState::Unknown | DispatchState::Failed | DispatchState::Abandoned
                );
                let reason = if ends {
                    self.end_causes.remove(&generation)
                } else {
                    None
                };
                (
                    StoreOp::Transition {
                        generation,
                        from,
                        to,
                        reason,
                    },
                    WriteKind::Transition { from, to },
                )
            }
            Write::Replay {
                generation,
                lease_expires_at,
            } => (
                StoreOp::Replay {
                    generation,
                    lease_expires_at,
                },
                WriteKind::Replay { generation },
            ),
            Write::AbandonAndRearm { generation } => {
                if self.ask_provider_first(generation) {
                    return;
                }
                let provider_word = self.provider_words.remove(&generation);
                (
                    StoreOp::AbandonAndRearm {
                        generation,
                        provider_ended: self.provider_ended.contains(&generation) || provider_word.is_some(),
                        provider_word,
                    },
                    WriteKind::AbandonAndRearm,
                )
            }
            Write::RenewLease {
                generation,
                lease_expires_at,
            } => (
                StoreOp::RenewLease {
                    generation,
                    lease_expires_at,
                },
                WriteKind::RenewLease,
            ),
            Write::Commit {
                generation,
                expected_revision,
                turn,
            } => {
                // The provider's stop reason and usage go into the same transaction, for
                // clients that attach later (same operation id, Idempotency-Key).
                let outcome = self.offer_facts.get(&generation).cloned();
                self.committed_turn = Some(turn.clone());
                (
                    StoreOp::Commit {
                        generation,
                        expected_revision,
                        turn,
                        outcome,
                        from: DispatchState::Streaming,
                        handle: None,
                        bind: true,
                    },
                    WriteKind::Commit { generation },
                )
            }
            Write::Cancel {
                expected_cancel_generation,
            } => (
                StoreOp::Cancel {
                    expected_cancel_generation,
                },
                WriteKind::Cancel,
            ),
        };
        self.store(op, Pending::MachineWrite(kind));
    }

    fn write_answered(&mut self, kind: WriteKind, result: StoreResult) {
        let answer = match (kind, result) {
            (WriteKind::RenewLease, StoreResult::Failed(_)) => {
                // Its outcome is unknown: the lease last granted still holds until the fence.
                // Try again soon; a store that answers before the fence lets the attempt go on.
                self.lease_asked_at = None;
                self.actions.push_back(Action::Count(Count::StoreFailure));
                let retry = (self.spec.lease_ms / RENEW_RETRY_DIVISOR).max(1);
                self.machine.renew_again_at(self.now.plus_ms(retry));
                return;
            }
            (_, StoreResult::Failed(_)) => {
                self.carried.clear();
                self.store_failed(kind);
                return;
            }
            (
                WriteKind::Begin,
                StoreResult::Began {
                    generation,
                    idempotency_key,
                },
            ) => {
                // Pair assertion across the store boundary (on in release): generations only
                // grow. The store allocates them one by one per dispatch, so a begin never
                // answers a generation at or below one this driver already knows of.
                assert!(
                    generation.0
                        > self
                            .attempts_started
                            .max(self.machine.generation().map_or(0, |g| g.0)),
                    "store answered generation {} for {} after {} attempts: generations only grow",
                    generation.0,
                    self.spec.basis.operation_id,
                    self.attempts_started
                );
                // Generations are allocated one by one per dispatch by the store: the
                // generation is the durable count of attempts, across restarts and replicas.
                self.attempts_started = (self.attempts_started + 1).max(generation.0);
                let from = self.state;
                self.transitioned(from, DispatchState::Dispatching);
                self.targets_of.insert(generation, self.target);
                self.idempotency_keys.insert(generation, idempotency_key.clone());
                self.lease_granted();
                StoreAnswer::Began {
                    generation,
                    idempotency_key,
                }
            }
            (WriteKind::Begin, _) => {
                self.stopped = true;
                StoreAnswer::BeginRefused
            }
            (WriteKind::Transition { from, to }, StoreResult::Applied) => {
                if (from, to) == (DispatchState::Unknown, DispatchState::Streaming) {
                    // A resume took the attempt's lease over.
                    self.lease_granted();
                }
                self.transitioned(from, to);
                return;
            }
            (WriteKind::FailOver { from }, StoreResult::Applied) => {
                self.transitioned(from, DispatchState::Failed);
                self.fail_over();
                return;
            }
            (WriteKind::FailOver { .. }, _) => {
                // Another replica or a cancel decided: the refused attempt stays FAILED.
                self.failover = None;
                self.stopped = true;
                return;
            }
            (WriteKind::Transition { .. }, _) => {
                // Another replica (or a cancel) owns the attempt now: this driver's preview is
                // void, and the ledger tells the clients what happens next.
                self.stopped = true;
                StoreAnswer::TransitionRefused
            }
            (WriteKind::Replay { generation }, StoreResult::Applied) => {
                self.lease_granted();
                *self.replays.entry(generation).or_default() += 1;
                self.transitioned(DispatchState::Unknown, DispatchState::Dispatching);
                match self.idempotency_keys.get(&generation).cloned() {
                    Some(key) => StoreAnswer::Replayed {
                        generation,
                        idempotency_key: key,
                    },
                    None => {
                        self.store(StoreOp::ReadAttempts, Pending::ReplayKey { generation });
                        return;
                    }
                }
            }
            (WriteKind::Replay { .. }, _) => {
                self.stopped = true;
                StoreAnswer::TransitionRefused
            }
            (WriteKind::AbandonAndRearm, StoreResult::Applied) => {
                self.transitioned(DispatchState::Unknown, DispatchState::Abandoned);
                self.actions
                    .push_back(Action::Count(Count::Recovery("new_generation")));
                self.state = DispatchState::Prepared;
                // The old attempt is confirmed over (lease or the provider's word): the new
                // generation goes to the next target, if the dispatch has one.
                if let Some(previous) = self.machine.generation() {
                    let from = self.target_of(previous);
                    if let Some(to) = self.next_target(from) {
                        let reason = self
                            .stop_reasons
                            .get(&previous)
                            .cloned()
                            .unwrap_or_else(|| "interrupted".to_owned());
                        self.count_failover(from, to, reason);
                        self.target = to;
                    }
                }
                StoreAnswer::Rearmed
            }
            (WriteKind::AbandonAndRearm, _) => {
                self.stopped = true;
                StoreAnswer::TransitionRefused
            }
            (WriteKind::RenewLease, StoreResult::Applied) => {
                self.lease_granted();
                return;
            }
            (WriteKind::RenewLease, _) => {
                // Refused: the attempt is no longer this driver's (its lease ran out by the
                // store's clock, or another replica took it over). Stop now.
                self.lease_asked_at = None;
                self.self_fence("lease_lost");
                return;
            }
            (WriteKind::Commit { generation }, StoreResult::Committed { revision }) => {
                // Pair assertion (on in release): a commit lands at the answered revision + 1.
                assert_eq!(
                    revision.0,
                    self.spec.basis.revision.0 + 1,
                    "the commit of {} answering revision {} landed elsewhere",
                    self.spec.basis.operation_id,
                    self.spec.basis.revision.0
                );
                // The transitions it carried landed with it (and its handle was this manifest's).
                if self.unchecked == Some(generation) {
                    self.unchecked = None;
                    self.unchecked_events = Vec::new();
                }
                for (op, _) in std::mem::take(&mut self.carried) {
                    if let StoreOp::Transition { from, to, .. } = op {
                        self.transitioned(from, to);
                    }
                }
                let from = self.state;
                self.transitioned(from, DispatchState::Committed);
                // The store appends the turn as offered, stamped with its revision: the client
                // event needs no second read of the whole history.
                if let Some(turn) = &mut self.committed_turn {
                    turn["revision"] = json!(revision.0);
                }
                StoreAnswer::Committed { revision }
            }
            (WriteKind::Commit { generation }, StoreResult::BindRefused) => {
                // The handle it carried is another manifest's: nothing landed, the carried
                // transitions are held back again, and the attempt ends as a refused bind
                // would have ended it.
                let turn = self.committed_turn.take();
                let mut handle = String::new();
                for (op, pending) in std::mem::take(&mut self.carried) {
                    match op {
                        StoreOp::BindHandle { handle: held, .. } => handle = held,
                        op => self.behind.push((op, pending)),
                    }
                }
                let handled = self.machine.handle_store(self.now, StoreAnswer::CommitUnbound);
                self.counted(handled);
                self.bind_answered(generation, &handle, StoreResult::BindRefused, turn);
                return;
            }
            (WriteKind::Commit { .. }, StoreResult::CommitRejected(codes)) => {
                // The store wrote the carried states before it refused the turn.
                for (op, _) in std::mem::take(&mut self.carried) {
                    if let StoreOp::Transition { from, to, .. } = op {
                        self.transitioned(from, to);
                    }
                }
                self.committed_turn = None;
                self.actions.push_back(Action::Count(Count::Rejected(codes)));
                self.actions.push_back(Action::Count(Count::LateBlock));
                StoreAnswer::CommitRefused
            }
            (WriteKind::Commit { .. }, _) => {
                self.carried.clear();
                self.committed_turn = None;
                self.actions.push_back(Action::Count(Count::CasConflict));
                self.actions.push_back(Action::Count(Count::LateBlock));
                StoreAnswer::CommitRefused
            }
            (WriteKind::Cancel, _) => return,
        };
        let handled = self.machine.handle_store(self.now, answer);
        self.counted(handled);
    }

    fn count_failover(&mut self, from: usize, to: usize, reason: String) {
        self.actions.push_back(Action::Count(Count::Failover {
            from_target: from as u32,
            from: self.spec.targets[from].label.clone(),
            to: self.spec.targets[to].label.clone(),
            reason,
        }));
    }

    /// The refused attempt is FAILED and the dispatch PREPARED again (one write): the next generation
    /// sends the next target's bytes. Nothing of the failed attempt reaches the next request
    /// (each target's bytes were rendered from the committed history before anything was
    /// sent); its preview, if any, is void.
    fn fail_over(&mut self) {
        let Some(failover) = self.failover.take() else {
            return;
        };
        self.transitioned(DispatchState::Failed, DispatchState::Prepared);
        // Its cause was written with the failover itself.
        self.end_causes.remove(&failover.generation);
        let from = self.target_of(failover.generation);
        self.count_failover(from, failover.to, failover.reason);
        self.retract(failover.generation, "failover");
        self.target = failover.to;
        self.assembler = None;
        let mut prepared = prepared_of(&self.spec.basis);
        prepared.request_digest = self.spec.targets[self.target].request_digest.clone();
        self.machine = DispatchMachine::new(prepared, self.spec.lease_ms);
        let started = self.machine.start(self.now);
        self.counted(started);
    }

    /// A store write failed: its outcome is unknown.
    fn store_failed(&mut self, kind: WriteKind) {
        self.actions.push_back(Action::Count(Count::StoreFailure));
        if let WriteKind::Transition { from, to } = kind
            && matches!(
                (from, to),
                (DispatchState::Dispatching, DispatchState::Sent)
                    | (DispatchState::Sent, DispatchState::Streaming)
            )
            && let Some(generation) = self.machine.generation()
        {
            // A held transition flushed before another write: held again, with the held writes
            // flushed after it (they must follow it), so the commit (or the next write)
            // carries them and a store back in time loses nothing.
            let mut held = vec![(
                StoreOp::Transition {
                    generation,
                    from,
                    to,
                    reason: None,
                },
                Pending::MachineWrite(kind),
            )];
            for (op, pending) in std::mem::take(&mut self.outbox) {
                // Only held writes are flushed before another: a bind here was held too.
                if holds_back(&op) || matches!(op, StoreOp::BindHandle { .. }) {
                    held.push((op, pending));
                } else {
                    self.outbox.push_back((op, pending));
                }
            }
            held.append(&mut self.behind);
            self.behind = held;
            return;
        }
        if kind.awaited() && self.fence().is_some_and(|at| self.now >= at) {
            // The write waited until the fence: stop as a holder whose lease ends does.
            self.self_fence("lease_ending");
            return;
        }
        if kind.awaited() {
            // The machine would wait forever for an answer that will not come. Stop driving:
            // the ledger decides (a write that landed is relayed by a watcher; one that did
            // not leaves a lease that the sweep recovers once it runs out).
            self.stopped = true;
            if let Some(generation) = self.machine.generation() {
                // This process will not finish this generation: its preview is void here.
                self.retract(generation, "store_unavailable");
            }
        }
        // No error event: the dispatch may still commit (the write may have landed, or a
        // driver elsewhere finishes it). The pump relays what the ledger says instead.
    }

    fn send(&mut self, generation: Generation, idempotency_key: String, request_digest: &str) {
        // The manifest names the bytes by digest: anything else must never leave. Each
        // target's bytes are checked against the digest the machine sends under.
        let target = self.target_spec(generation);
        if target.request_digest != request_digest
            || Digest::of_bytes(&target.request_bytes).as_str() != request_digest
        {
            self.actions.push_back(Action::Count(Count::IllegalSend));
            self.cause(generation, "illegal_send");
            let handled = self
                .machine
                .handle_provider(self.now, generation, ProviderInput::Rejected);
            self.counted(handled);
            return;
        }
        self.assembler = Some(self.new_assembler(generation, None));
        self.provider_sequence_last = None;
        self.open(generation, Request::Send { idempotency_key }, false);
    }

    fn resume(&mut self, generation: Generation, handle: String) {
        match &mut self.assembler {
            Some(assembler) if assembler.generation() == generation => assembler.handle_connection_start(),
            _ => self.assembler = Some(self.new_assembler(generation, Some(handle.clone()))),
        }
        *self.resumes.entry(generation).or_default() += 1;
        let after_sequence = self.provider_sequence_last;
        self.open(
            generation,
            Request::Resume {
                handle,
                after_sequence,
            },
            true,
        );
    }

    fn new_assembler(&self, generation: Generation, handle_bound: Option<String>) -> Assembler {
        let mut config = AssemblerConfig::new(
            generation,
            format!("{}.g{}", self.spec.basis.operation_id, generation.0),
        );
        config.toolset = self.spec.toolset.clone();
        config.call_ids_taken = self.spec.call_ids_taken.clone();
        config.handle_bound = handle_bound;
        Assembler::new(config)
    }

    fn open(&mut self, generation: Generation, request: Request, resume: bool) {
        let probe = match request {
            Request::Status { .. } => Some(ProbeKind::Status),
            Request::Cancel { .. } => Some(ProbeKind::Cancel),
            Request::Send { .. } | Request::Resume { .. } => None,
        };
        let connection = ConnectionId(self.connection_next);
        self.connection_next += 1;
        self.connections.insert(
            connection,
            Connection {
                generation,
                decoder: {
                    let target = self.target_spec(generation);
                    target.api.decoder_with(target.decoder)
                },
                status: None,
                saw_event: false,
                resume,
                probe,
                body: Vec::new(),
                opened_at: self.now,
                active_at: self.now,
                timeouts: self
                    .target_spec(generation)
                    .timeouts
                    .unwrap_or(self.spec.timeouts),
            },
        );
        let target = self.target_of(generation) as u32;
        self.actions.push_back(Action::Open {
            connection,
            generation,
            target,
            request,
        });
    }

    /// `turn`: the whole turn, when the refusal came with the commit that carried the handle.
    fn bind_answered(
        &mut self,
        generation: Generation,
        handle: &str,
        result: StoreResult,
        turn: Option<Value>,
    ) {
        // The events decoded while the handle was held (none when it was bound at once).
        let mut events: Vec<Value> = Vec::new();
        if self.unchecked == Some(generation) {
            self.unchecked = None;
            if matches!(result, StoreResult::BindRefused) {
                events = std::mem::take(&mut self.unchecked_events)
                    .iter()
                    .map(|sequenced| serde_json::to_value(&sequenced.event).unwrap_or(Value::Null))
                    .collect();
            }
            self.unchecked_events = Vec::new();
        }
        match result {
            StoreResult::BindRefused => {
                // The handle belongs to another manifest: nothing from it may be merged, and a
                // replay of the same key would bring the same handle back.
                self.actions.push_back(Action::Count(Count::ForeignHandle));
                self.replay_refused.insert(generation);
                self.resume_refused.insert(generation);
                self.foreign.insert(generation);
                self.cause(generation, "foreign_handle");
                // What arrived under it goes to the quarantine log with its reason, never
                // dropped unseen (and never merged).
                let mut content = match turn {
                    Some(turn) => json!({"generation": generation.0, "turn": turn}),
                    None => self
                        .assembler
                        .as_ref()
                        .filter(|assembler| assembler.generation() == generation)
                        .map_or_else(|| json!({"generation": generation.0}), Assembler::material),
                };
                content["handle"] = json!(handle);
                let closed: Vec<ConnectionId> = self
                    .connections
                    .iter()
                    .filter(|(_, connection)| connection.generation == generation)
                    .map(|(id, _)| *id)
                    .collect();
                // The rest of what arrived on its connections (bytes still queued, events the
                // decoder holds) is kept with it, as decoded events, up to a bound.
                for connection in &closed {
                    let mut queued = Vec::new();
                    self.work.retain(|work| match work {
                        Work::Chunk {
                            connection: id,
                            bytes,
                        } if id == connection => {
                            queued.push(bytes.clone());
                            false
                        }
                        _ => true,
                    });
                    if let Some(mut open) = self.connections.remove(connection) {
                        for bytes in queued {
                            open.decoder.handle_bytes(&bytes);
                        }
                        while let Some(sequenced) = open.decoder.poll_event() {
                            if events.len() < FOREIGN_EVENTS_KEPT_MAX {
                                events.push(serde_json::to_value(&sequenced.event).unwrap_or(Value::Null));
                            }
                        }
                    }
                    self.actions.push_back(Action::Close {
                        connection: *connection,
                    });
                }
                content["events"] = Value::Array(events);
                self.work.push_front(Work::Quarantine {
                    generation,
                    reason: "foreign_handle",
                    content,
                });
                // One interruption per generation: if its reading is already queued (it
                // flushed this bind), that one decides, now knowing the handle is foreign.
                let queued = self.outbox.iter().any(|(_, pending)| {
                    matches!(pending, Pending::Interruption { generation: queued, .. } if *queued == generation)
                });
                if !queued {
                    self.interrupted(generation, false, true);
                }
            }
            StoreResult::Failed(_) => {
                // A handle that is not durably bound only loses resume-by-handle after a crash;
                // the attempt goes on (the lease still fences it).
                self.actions.push_back(Action::Count(Count::StoreFailure));
            }
            _ => {}
        }
    }

    /// Start recovery of an interrupted attempt: read what the store holds of it first.
    /// `interrupt`: the machine still has to hear of the interruption.
    fn interrupted(&mut self, generation: Generation, provider_ended: bool, interrupt: bool) {
        // A handle held for the commit is checked first, so recovery decides knowing whether it
        // is another manifest's (a refused one is never replayed or resumed). A handle that is
        // no identity (`handle_is_identity`) is never bound: recovery looks nothing up by it,
        // and a server that reuses its ids must not turn a cut into a foreign handle.
        let (binds, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.behind).into_iter().partition(
            |(op, _)| matches!(op, StoreOp::BindHandle { generation: held, .. } if *held == generation),
        );
        self.behind = rest;
        if !binds.is_empty() && self.handle_is_identity(generation) {
            if self.pending.is_none() && self.outbox.is_empty() {
                let mut binds = binds.into_iter();
                if let Some((op, pending)) = binds.next() {
                    self.issue(op, pending);
                }
                self.outbox.extend(binds);
            } else {
                self.outbox.extend(binds);
            }
        }
        self.store(
            StoreOp::ReadAttempts,
            Pending::Interruption {
                generation,
                provider_ended,
                interrupt,
            },
        );
    }

    fn interruption_answered(
        &mut self,
        generation: Generation,
        provider_ended: bool,
        interrupt: bool,
        result: StoreResult,
    ) {
        let record = match result {
            StoreResult::Attempts(attempts) => attempts
                .into_iter()
                .find(|attempt| attempt.generation == generation),
            _ => None,
        };
        if let Some(record) = &record {
            self.read_back(generation, &record.idempotency_key);
            self.spent(generation, record.spent);
            let target = (record.target as usize).min(self.spec.targets.len() - 1);
            self.targets_of.entry(generation).or_insert(target);
        }
        let Some(record) = record else {
            // No durable view of the attempt (a store failure, or it is gone): this driver
            // cannot decide recovery; stop and leave it to the lease sweep.
            if interrupt {
                let handled = self
                    .machine
                    .handle_provider(self.now, generation, ProviderInput::Interrupted);
                self.counted(handled);
            }
            self.actions.push_back(Action::Count(Count::StoreFailure));
            self.stopped = true;
            return;
        };
        let foreign = self.foreign.contains(&generation);
        let attempt = UnknownAttempt {
            generation,
            // Never another manifest's handle: it is not ours to resume, ask about or cancel.
            handle: record.handle.clone().filter(|_| !foreign).or_else(|| {
                self.assembler
                    .as_ref()
                    .filter(|_| !foreign)
                    .and_then(|assembler| assembler.handle().map(str::to_owned))
            }),
            idempotency_key: record.idempotency_key.clone(),
            // A margin for the round trip the clock rebasing cannot see, so the rearm does not
            // arrive a moment before the store's clock says the lease ran out.
            lease_expires_at: record.lease_expires_at.plus_ms(REARM_MARGIN_MS),
            provider_confirmed_ended: provider_ended,
        };
        if provider_ended {
            self.provider_ended.insert(generation);
        }
        let mut attempt = attempt;
        if !provider_ended && self.closed_here(generation) {
            // The only connection to this generation's response was this driver's, and it is
            // closed: nothing can deliver that response to anyone any more, so its end is
            // confirmed here, without waiting for the lease
            // (`docs/decisions/0123-an-attempt-whose-only-connection-this-driver-closed-is.md`).
            attempt.provider_confirmed_ended = true;
            self.provider_words
                .insert(generation, "connection_closed".to_owned());
        }
        if let Some(handle) = &attempt.handle {
            self.handles.insert(generation, handle.clone());
        }
        let recovery = self.recovery_for(generation, provider_ended);
        let decision = recovery_decision(&attempt, recovery, self.now);
        if !matches!(decision, RecoveryDecision::AbandonThenNewGeneration { .. }) {
            // Not abandoned now: the word must not outlive this decision.
            self.provider_words.remove(&generation);
        }
        // The interruption's own effects (UNKNOWN, retract unless resuming) run next.
        self.suppress_interrupt_retract = matches!(decision, RecoveryDecision::ResumeByHandle { .. });
        if interrupt {
            let handled = self
                .machine
                .handle_provider(self.now, generation, ProviderInput::Interrupted);
            self.counted(handled);
        }
        self.work.push_front(Work::InterruptionTail {
            tail: Box::new(Tail {
                generation,
                attempt,
                recovery,
                decision,
            }),
        });
    }

    fn interruption_tail(&mut self, tail: Tail) {
        self.suppress_interrupt_retract = false;
        let resuming = matches!(tail.decision, RecoveryDecision::ResumeByHandle { .. });
        if self.gave_up() && !resuming {
            let code = self.final_retract.unwrap_or("attempts_exhausted");
            self.give_up(code);
            return;
        }
        self.count_recovery(&tail.decision);
        if !resuming {
            self.assembler = None;
        }
        if self.machine.state() != DispatchState::Unknown {
            // The write to UNKNOWN was refused (another replica owns the attempt) or the
            // dispatch ended: there is nothing to recover here.
            self.stopped = true;
            return;
        }
        self.idempotency_keys
            .insert(tail.generation, tail.attempt.idempotency_key.clone());
        self.machine = DispatchMachine::recover(
            self.now,
            self.prepared_for(tail.generation),
            self.spec.lease_ms,
            &tail.attempt,
            tail.recovery,
        );
        self.state = DispatchState::Unknown;
    }

    fn step(&mut self, work: Work) {
        match work {
            Work::Timeout => {
                // Every wait has a bound: a connection past its deadline (no head, idle, or
                // the whole attempt) is closed and ends as broken (its outcome at the provider
                // is unknown, so recovery decides, never a blind resend).
                let now = self.now;
                let expired: Vec<ConnectionId> = self
                    .connections
                    .iter()
                    .filter(|(_, connection)| connection.deadline() <= now)
                    .map(|(id, _)| *id)
                    .collect();
                let connection_deadline = !expired.is_empty();
                for connection in expired {
                    if let Some(open) = self.connections.get(&connection)
                        && open.probe.is_none()
                    {
                        let reason = if open.opened_at.plus_ms(open.timeouts.attempt_ms) <= now {
                            "attempt_timeout"
                        } else if open.status.is_none() {
                            "head_timeout"
                        } else {
                            "idle_timeout"
                        };
                        let generation = open.generation;
                        self.cause(generation, reason);
                    }
                    self.actions.push_back(Action::Count(Count::Timeout));
                    self.actions.push_back(Action::Close { connection });
                    self.work.push_back(Work::ConnectionEnded {
                        connection,
                        ending: Ending::Broken,
                    });
                }
                let handled = self.machine.handle_timeout(self.now);
                if !connection_deadline {
                    self.counted(handled);
                }
            }
            Work::Head { connection, status } => {
                let Some(open) = self.connections.get_mut(&connection) else {
                    return;
                };
                open.status = Some(status);
                open.active_at = self.now;
                let generation = open.generation;
                if open.probe.is_none() && (200..300).contains(&status) {
                    let handled = self
                        .machine
                        .handle_provider(self.now, generation, ProviderInput::Accepted);
                    self.counted(handled);
                }
            }
            Work::Chunk { connection, bytes } => {
                let Some(open) = self.connections.get_mut(&connection) else {
                    return;
                };
                if open.probe.is_some() || open.status.is_some_and(|status| !(200..300).contains(&status)) {
                    // A stream's activity is what it decodes to (`Work::DrainDecoder`): bytes
                    // that decode to nothing (Anthropic's `ping`, SSE comments) do not keep a
                    // stalled stream alive past the idle bound.
                    open.active_at = self.now;
                }
                if open.status.is_some_and(|status| !(200..300).contains(&status)) {
                    // A refusal's body: its words are the client's only clue (a bad model
                    // name, a context overflow, a content filter).
                    let room = REFUSAL_BODY_MAX.saturating_sub(open.body.len());
                    open.body.extend_from_slice(&bytes[..bytes.len().min(room)]);
                    return;
                }
                if open.probe.is_some() {
                    let room = PROBE_BODY_MAX.saturating_sub(open.body.len());
                    open.body.extend_from_slice(&bytes[..bytes.len().min(room)]);
                    return;
                }
                open.decoder.handle_bytes(&bytes);
                self.work.push_front(Work::DrainDecoder(connection));
            }
            Work::End { connection, ending } => {
                let Some(open) = self.connections.get_mut(&connection) else {
                    return;
                };
                if open.probe.is_some() {
                    self.work.push_front(Work::ConnectionEnded { connection, ending });
                    return;
                }
                if ending == Ending::Clean {
                    open.decoder.handle_end_of_input();
                }
                self.work.push_front(Work::ConnectionEnded { connection, ending });
                self.work.push_front(Work::DrainDecoder(connection));
            }
            Work::DrainDecoder(connection) => {
                let Some(open) = self.connections.get_mut(&connection) else {
                    return;
                };
                let generation = open.generation;
                let Some(sequenced) = open.decoder.poll_event() else {
                    return;
                };
                open.active_at = self.now;
                if self.unchecked == Some(generation) && self.unchecked_events.len() < FOREIGN_EVENTS_KEPT_MAX
                {
                    self.unchecked_events.push(sequenced.clone());
                }
                self.work.push_front(Work::DrainDecoder(connection));
                self.work.push_front(Work::Event {
                    connection,
                    generation,
                    stage: 0,
                    sequenced,
                });
            }
            Work::Event {
                connection,
                generation,
                stage,
                sequenced,
            } => self.event(connection, generation, stage, sequenced),
            Work::DrainAssembler(generation) => self.drain_assembler(generation),
            Work::ConnectionEnded { connection, ending } => self.connection_ended(connection, ending),
            Work::AfterEnd { generation, clean } => {
                if self.machine.state().is_terminal() || self.machine.generation() != Some(generation) {
                    return;
                }
                if matches!(
                    self.machine.state(),
                    DispatchState::Dispatching | DispatchState::Sent | DispatchState::Streaming
                ) {
                    self.cause(
                        generation,
                        if clean { "ended_without_stop" } else { "stream_cut" },
                    );
                    self.work.push_front(Work::Interruption {
                        generation,
                        provider_ended: clean,
                    });
                }
            }
            Work::Interruption {
                generation,
                provider_ended,
            } => self.interrupted(generation, provider_ended, true),
            Work::InterruptionTail { tail } => self.interruption_tail(*tail),
            Work::Quarantine {
                generation,
                reason,
                content,
            } => self.quarantine(generation, reason, content),
            // A dispatch that ended (committed, failed) or a driver that already stopped has
            // nothing to hand over: its outcome stands, and nothing is retracted after it.
            Work::HandOver if self.stopped || self.machine.state().is_terminal() => {}
            Work::HandOver => self.self_fence("shutting_down"),
            Work::Shed { reason } => {
                if self.final_retract.is_none() {
                    self.final_retract = Some(reason);
                }
                let open: Vec<(ConnectionId, Generation)> = self
                    .connections
                    .iter()
                    .filter(|(_, connection)| connection.probe.is_none())
                    .map(|(id, connection)| (*id, connection.generation))
                    .collect();
                for (connection, generation) in open {
                    self.cause(generation, reason);
                    self.resume_refused.insert(generation);
                    self.replay_refused.insert(generation);
                    self.actions.push_back(Action::Close { connection });
                    self.work.push_back(Work::ConnectionEnded {
                        connection,
                        ending: Ending::Broken,
                    });
                }
            }
        }
    }

    fn event(&mut self, connection: ConnectionId, generation: Generation, stage: u8, sequenced: Sequenced) {
        match stage {
            0 => {
                if let Some(open) = self.connections.get_mut(&connection)
                    && !open.saw_event
                {
                    open.saw_event = true;
                    let handled =
                        self.machine
                            .handle_provider(self.now, generation, ProviderInput::FirstEvent);
                    self.counted(handled);
                }
                self.work.push_front(Work::Event {
                    connection,
                    generation,
                    stage: 1,
                    sequenced,
                });
            }
            1 => {
                if sequenced.seq.source == SeqSource::Provider {
                    self.provider_sequence_last = Some(
                        self.provider_sequence_last
                            .map_or(sequenced.seq.number, |last| last.max(sequenced.seq.number)),
                    );
                }
                if let StreamEvent::Handle { handle } = &sequenced.event {
                    let handled = self.machine.handle_provider(
                        self.now,
                        generation,
                        ProviderInput::Handle(handle.clone()),
                    );
                    self.counted(handled);
                }
                if let StreamEvent::Usage {
                    input_tokens,
                    output_tokens,
                    cache_creation_input_tokens,
                    cache_read_input_tokens,
                } = &sequenced.event
                {
                    let usage = turnstile_core::assemble::Usage {
                        input_tokens: *input_tokens,
                        output_tokens: *output_tokens,
                        cache_creation_input_tokens: *cache_creation_input_tokens,
                        cache_read_input_tokens: *cache_read_input_tokens,
                    };
                    self.emit(DriveEvent::Usage { generation, usage });
                }
                if let StreamEvent::Notice { code, detail } = &sequenced.event {
                    let target = self.target_spec(generation).label.clone();
                    self.actions.push_back(Action::Count(Count::Notice {
                        target,
                        code: code.clone(),
                        detail: detail.clone(),
                    }));
                }
                self.work.push_front(Work::Event {
                    connection,
                    generation,
                    stage: 2,
                    sequenced,
                });
            }
            _ => {
                if !self.connections.contains_key(&connection) {
                    // The connection was dropped (a foreign handle): its events are not read.
                    return;
                }
                let Some(assembler) = &mut self.assembler else {
                    return;
                };
                match assembler.handle_event(generation, sequenced) {
                    Disposition::Quarantined(material) => {
                        let content = serde_json::to_value(&*material).unwrap_or(Value::Null);
                        let from = material.generation;
                        self.work.push_front(Work::DrainAssembler(generation));
                        self.quarantine(from, "foreign_generation", content);
                    }
                    Disposition::Accepted => self.work.push_front(Work::DrainAssembler(generation)),
                    Disposition::Ignored(_) => {
                        self.actions
                            .push_back(Action::Count(Count::Ignored("assembler_ignored")));
                        self.work.push_front(Work::DrainAssembler(generation));
                    }
                }
            }
        }
    }

    fn drain_assembler(&mut self, generation: Generation) {
        let Some(assembler) = &mut self.assembler else {
            return;
        };
        let Some(output) = assembler.poll_output() else {
            return;
        };
        self.work.push_front(Work::DrainAssembler(generation));
        match output {
            Output::Preview {
                generation,
                block_index,
                delta,
            } => {
                self.previewed.insert(generation);
                self.emit(DriveEvent::Preview {
                    generation,
                    block_index: block_index.0,
                    delta,
                })
            }
            Output::Retract { generation, reason } => {
                // The machine hears of it as an interruption when the connection ends; the
                // client hears now, with the assembler's more precise reason.
                if matches!(reason, RetractReason::MaxTokensInToolArguments { .. }) {
                    // The same bytes under the same cap would stop there again: sending them
                    // again only bills the same truncation.
                    self.final_retract = Some(reason.code());
                }
                self.retract(generation, reason.code());
                self.cause(generation, reason.code());
                // Resuming or replaying a generation the assembler gave up on cannot commit it.
                self.resume_refused.insert(generation);
                self.replay_refused.insert(generation);
                // Nothing of this generation can commit any more: stop reading it at once
                // (a limit breach must not keep a connection open until the provider closes).
                let open: Vec<ConnectionId> = self
                    .connections
                    .iter()
                    .filter(|(_, connection)| connection.generation == generation)
                    .map(|(id, _)| *id)
                    .collect();
                for connection in open {
                    self.actions.push_back(Action::Close { connection });
                    self.work.push_back(Work::ConnectionEnded {
                        connection,
                        ending: Ending::Broken,
                    });
                }
            }
            Output::Commit(offer) => {
                if !tool_arguments_complete(&offer.turn) {
                    self.actions.push_back(Action::Count(Count::PartialToolDispatch));
                    return;
                }
                // `usage`: `input_tokens`, `output_tokens`, and the cache counters when reported;
                // `target`: the index of the target that answered (who answered, after failover).
                let usage = offer.usage.unwrap_or_default();
                self.offer_facts.insert(
                    offer.generation,
                    json!({"stop_reason": offer.stop_reason, "usage": usage,
                           "target": self.target_of(offer.generation)}),
                );
                let handled = self.machine.handle_provider(
                    self.now,
                    generation,
                    ProviderInput::Completed { turn: offer.turn },
                );
                self.counted(handled);
            }
        }
    }

    fn connection_ended(&mut self, connection: ConnectionId, ending: Ending) {
        let Some(open) = self.connections.remove(&connection) else {
            return;
        };
        if open.probe.is_some() {
            self.probe_ended(open, ending);
            return;
        }
        let generation = open.generation;
        if self.machine.generation() != Some(generation) || self.machine.state().is_terminal() {
            return;
        }
        let status_failed = open.status.is_some_and(|status| !(200..300).contains(&status));
        // Nothing was produced and nothing runs at the provider: a connection that could not
        // be made, or an error status.
        let failed = ending == Ending::Unreachable || status_failed;
        if open.resume && (failed || !open.saw_event || open.status.is_none()) {
            // The provider refused the resume or had nothing more: no more resumes of this
            // generation; it is interrupted like any other. A refused resume says nothing about
            // whether the response still runs: it is not a confirmed end.
            self.resume_refused.insert(generation);
            self.cause(generation, "resume_refused");
        } else if failed {
            let code = match open.status {
                Some(status) => format!("provider_status_{status}"),
                None => "provider_unreachable".to_owned(),
            };
            self.cause(generation, code.clone());
            // Only a generation whose one request was this refused one is over: a refused
            // replay or resume says nothing of the generation's first request, which may still
            // run at the provider (it ends FAILED as without failover).
            let only_request = !open.resume
                && self.replays.get(&generation).copied().unwrap_or(0) == 0
                && self.resumes.get(&generation).copied().unwrap_or(0) == 0
                && !self.recovered_generations.contains(&generation);
            let next = (only_request
                && fails_over_on(open.status)
                && self.attempts_started < ATTEMPTS_PER_DISPATCH_MAX)
                .then(|| self.next_target(self.target_of(generation)))
                .flatten();
            let from = self.machine.state();
            if let Some(to) = next
                && matches!(from, DispatchState::Dispatching | DispatchState::Sent)
            {
                // Not the dispatch's end: one write moves the attempt to FAILED and the
                // dispatch back to PREPARED (it is never FAILED in between); the machine of
                // the next generation starts when it lands.
                self.failover = Some(PendingFailover {
                    generation,
                    to,
                    reason: code.clone(),
                });
                self.store(
                    StoreOp::FailOver {
                        generation,
                        from,
                        reason: code,
                    },
                    Pending::MachineWrite(WriteKind::FailOver { from }),
                );
                return;
            }
            let message = refusal_message(open.status, &open.body);
            self.emit(DriveEvent::Error {
                code,
                message: message.into(),
            });
            let handled = self
                .machine
                .handle_provider(self.now, generation, ProviderInput::Rejected);
            self.counted(handled);
            return;
        }
        // The provider's own word that the response is over: a successful body that ended
        // cleanly (a resume only when it delivered something).
        let confirmed_end = ending == Ending::Clean && !status_failed && (!open.resume || open.saw_event);
        let resumable = self.recovery_for(generation, confirmed_end).resume_by_handle
            && self
                .assembler
                .as_ref()
                .is_some_and(|assembler| assembler.handle().is_some());
        self.work.push_front(Work::AfterEnd {
            generation,
            clean: confirmed_end,
        });
        if !resumable {
            if let Some(assembler) = &mut self.assembler {
                assembler.handle_end_of_input();
            }
            self.work.push_front(Work::DrainAssembler(generation));
        }
    }
}

/// Defence in depth before a commit: every tool_call block carries one complete JSON object.
/// The assembler only offers such turns; if this ever fails, it is counted as a partial tool
/// dispatch (the metric that must stay 0) and nothing is committed.
pub(crate) fn tool_arguments_complete(turn: &Value) -> bool {
    turn["blocks"].as_array().is_some_and(|blocks| {
        blocks
            .iter()
            .filter(|block| block["kind"] == "tool_call")
            .all(|block| match &block["arguments"] {
                Value::Object(_) => true,
                Value::String(text) => matches!(
                    turnstile_core::parse::bounded_value(text.as_bytes()),
                    Some(Value::Object(_))
                ),
                _ => false,
            })
    })
}

/// The client's message for a provider's refusal: its status and the provider's own words,
/// from any of the four APIs' error shapes (`{"error": {"message"}}`, `{"error": "…"}`,
/// `{"message"}`, Gemini's `[{"error": …}]`), else the start of the body as text.
pub fn refusal_message(status: Option<u16>, body: &[u8]) -> String {
    let Some(status) = status else {
        return error_message("provider_unreachable").to_owned();
    };
    let from_json = turnstile_core::parse::bounded_value(body).and_then(|value| {
        let value = match value {
            Value::Array(mut items) if !items.is_empty() => items.swap_remove(0),
            value => value,
        };
        let error = value.get("error").unwrap_or(&value);
        match error {
            Value::String(text) => Some(text.clone()),
            _ => error.get("message").and_then(Value::as_str).map(str::to_owned),
        }
    });
    let words = from_json.unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_owned());
    let words: String = words
        .chars()
        .filter(|c| (!c.is_control() || *c == ' ') && !is_bidi_control(*c))
        .collect();
    let mut words = redact_keys(&words);
    if words.len() > REFUSAL_MESSAGE_MAX {
        let mut end = REFUSAL_MESSAGE_MAX;
        while !words.is_char_boundary(end) {
            end -= 1;
        }
        words.truncate(end);
        words.push('…');
    }
    if words.is_empty() {
        format!("the provider refused the request with HTTP {status} and no message")
    } else {
        format!("the provider refused the request with HTTP {status}: {words}")
    }
}

/// Unicode's bidirectional formatting characters: text that reorders what follows it.
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{200E}' | '\u{200F}')
}

/// A provider that echoes the request's credential in its refusal must not pass it on: a word
/// shaped like an API key (`sk-…`, `sk_…`, `gsk_…`, `xai-…`, Google's `AIza…`) and the word after
/// `Bearer` are replaced by `[redacted]`.
fn redact_keys(text: &str) -> String {
    const PREFIXES: [&str; 5] = ["sk-", "sk_", "gsk_", "xai-", "AIza"];
    let mut out = String::with_capacity(text.len());
    let mut after_bearer = false;
    for (index, word) in text.split(' ').enumerate() {
        if index > 0 {
            out.push(' ');
        }
        let core = word.trim_matches(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'));
        let key_like = core.len() >= 12 && PREFIXES.iter().any(|prefix| core.starts_with(prefix));
        if (after_bearer && !core.is_empty()) || key_like {
            out.push_str(&word.replace(core, "[redacted]"));
        } else {
            out.push_str(word);
        }
        after_bearer = core.eq_ignore_ascii_case("bearer");
    }
    out
}
