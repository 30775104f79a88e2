//! The dispatch driver: performs the effects of one [`DispatchMachine`] in order against the
//! ledger, the provider transport, the stream decoder and the assembler, and feeds their
//! answers back. One tokio task per live dispatch; a client that disconnects does not stop it,
//! so the commit still happens and is readable later by operation id.
//!
//! What lives where: *decisions* (which write, when bytes may go out, what to quarantine) are
//! the core machine's and the assembler's; *conditions* (who wins) are the store's
//! compare-and-sets; this file only moves data between them and the network.

use super::hub::Hub;
use super::metrics;
use super::transport::{self, Endpoint, TransportEvent};
use super::{Shared, now};
use serde_json::{Value, json};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use turnstile_adapters::decode::{Decoder, StreamApi};
use turnstile_core::Digest;
use turnstile_core::assemble::{Assembler, AssemblerConfig, Disposition, Output, RetractReason, Toolset};
use turnstile_core::dispatch::{
    ClientEvent, DispatchMachine, DispatchState, Effect, Prepared, ProviderInput, ProviderRecovery,
    RecoveryDecision, StoreAnswer, UnknownAttempt, Write, recovery_decision,
};
use turnstile_core::ids::Generation;
use turnstile_core::stream::{SeqSource, StreamEvent};
use turnstile_store::{
    BeginExpect, BeginOutcome, BindOutcome, CommitOutcome, DispatchRecord, Lease, QuarantineEntry,
    TransitionOutcome,
};

/// Most attempts (generations) the gateway starts for one dispatch before giving up; each
/// costs a billed provider call.
pub const ATTEMPTS_PER_DISPATCH_MAX: u64 = 4;
/// Transport events buffered per dispatch.
const TRANSPORT_QUEUE_MAX: usize = 256;

/// Everything one driver needs that does not change during the dispatch.
pub struct DriveContext {
    /// The stored dispatch.
    pub record: DispatchRecord,
    /// Which stream format the provider speaks.
    pub api: StreamApi,
    /// Model name from the manifest.
    pub model: String,
    /// Where to send.
    pub endpoint: Endpoint,
    /// The conversation's compiled tools (None: the conversation declares none).
    pub toolset: Option<Arc<Toolset>>,
    /// Call ids already in the history.
    pub call_ids_taken: HashSet<String>,
    /// Where client events go.
    pub hub: Arc<Hub>,
}

/// One connection's decoding state.
struct Connection {
    generation: Generation,
    decoder: Box<dyn Decoder>,
    status: Option<u16>,
    saw_event: bool,
    /// A resume of an earlier connection of the same generation.
    resume: bool,
}

/// Most resumes of one generation before it is treated as interrupted for good.
const RESUMES_PER_GENERATION_MAX: u32 = 3;

struct Driver {
    shared: Arc<Shared>,
    ctx: DriveContext,
    machine: DispatchMachine,
    assembler: Option<Assembler>,
    connections: HashMap<u64, Connection>,
    connection_next: u64,
    sender: mpsc::Sender<(u64, TransportEvent)>,
    attempts_started: u64,
    provider_sequence_last: Option<u64>,
    idempotency_keys: HashMap<Generation, String>,
    state: DispatchState,
    /// Generations whose preview was already retracted (one retract event each).
    retracted: HashSet<Generation>,
    /// Generations the provider confirmably ended (their body ended cleanly).
    provider_ended: HashSet<Generation>,
    /// Generations whose resume the provider refused (or that ran out of resumes).
    resume_refused: HashSet<Generation>,
    /// Resumes opened per generation.
    resumes: HashMap<Generation, u32>,
    /// The machine can make no further progress here (begin or recovery refused: another
    /// replica or a cancel decided).
    stopped: bool,
    /// A retract reason that would repeat on every attempt of the same bytes (the output cap
    /// ended the response inside a tool call's arguments): no further attempt is made.
    final_retract: Option<&'static str>,
    /// The turn of the winning commit, for the `committed` event.
    committed_turn: Option<Value>,
    /// Stop reason and usage of each generation's commit offer, for the `committed` event
    /// (the proxy answers clients with them).
    offer_facts: HashMap<Generation, Value>,
}

fn prepared_of(record: &DispatchRecord) -> Prepared {
    Prepared {
        revision: record.revision,
        cancel_generation: record.cancel_generation,
        request_digest: record.request_digest.clone(),
    }
}

fn provider_recovery(endpoint: &Endpoint, api: StreamApi) -> ProviderRecovery {
    ProviderRecovery {
        // Only the Responses API can resume a stream by handle (provider-rules.md).
        resume_by_handle: endpoint.resume_by_handle && api == StreamApi::OpenAiResponses,
        honours_idempotency_key: endpoint.honours_idempotency_key,
    }
}

/// Drive a fresh PREPARED dispatch to its end.
pub async fn drive_new(shared: Arc<Shared>, ctx: DriveContext) {
    let mut machine = DispatchMachine::new(prepared_of(&ctx.record), shared.lease_ms);
    let _ = machine.start(now());
    run(shared, ctx, machine, DispatchState::Prepared).await;
}

/// Drive a dispatch whose active attempt is UNKNOWN (start-up recovery or a takeover).
pub async fn drive_recovered(shared: Arc<Shared>, ctx: DriveContext, attempt: UnknownAttempt) {
    let recovery = provider_recovery(&ctx.endpoint, ctx.api);
    count_recovery(&recovery_decision(&attempt, recovery, now()));
    let machine = DispatchMachine::recover(
        now(),
        prepared_of(&ctx.record),
        shared.lease_ms,
        &attempt,
        recovery,
    );
    run(shared, ctx, machine, DispatchState::Unknown).await;
}

fn count_recovery(decision: &RecoveryDecision) {
    // A new generation is counted when its rearm write lands (it may follow a wait).
    match decision {
        RecoveryDecision::ResumeByHandle { .. } => metrics::recovery("resumed"),
        RecoveryDecision::ReplaySameGeneration { .. } => metrics::recovery("replayed"),
        RecoveryDecision::WaitUntil(_) => metrics::recovery("waiting"),
        RecoveryDecision::AbandonThenNewGeneration { .. } => {}
    }
}

async fn run(shared: Arc<Shared>, ctx: DriveContext, machine: DispatchMachine, state: DispatchState) {
    let (sender, mut receiver) = mpsc::channel(TRANSPORT_QUEUE_MAX);
    let operation_id = ctx.record.operation_id.clone();
    let mut driver = Driver {
        shared,
        ctx,
        machine,
        assembler: None,
        connections: HashMap::new(),
        connection_next: 0,
        sender,
        attempts_started: 0,
        provider_sequence_last: None,
        idempotency_keys: HashMap::new(),
        state,
        stopped: false,
        final_retract: None,
        committed_turn: None,
        offer_facts: HashMap::new(),
        retracted: HashSet::new(),
        provider_ended: HashSet::new(),
        resume_refused: HashSet::new(),
        resumes: HashMap::new(),
    };
    driver.track_unknown();
    driver.perform_effects(false).await;
    while !driver.finished() {
        let timeout = driver.machine.poll_timeout();
        let sleep = match timeout {
            Some(at) => Duration::from_millis(at.0.saturating_sub(now().0)),
            None => Duration::from_secs(3600),
        };
        tokio::select! {
            received = receiver.recv() => {
                // Invariant: the driver holds a sender, so the channel never closes first.
                let Some((connection, event)) = received else { break };
                driver.transport_event(connection, event).await;
            }
            _ = tokio::time::sleep(sleep) => {
                let _ = driver.machine.handle_timeout(now());
                driver.perform_effects(false).await;
            }
        }
    }
    driver.shared.unknown_since.lock().await.remove(&operation_id);
    let driven_elsewhere = driver.stopped
        && matches!(
            driver.shared.ledger.dispatch(&operation_id).await,
            Ok(Some(record)) if record.state.is_live() || record.state == DispatchState::Committed
        );
    if driven_elsewhere {
        // Another replica owns the dispatch now (or the ledger does, after a failed write):
        // relay its progress from the ledger to this dispatch's clients instead of ending
        // their stream with an error. Out of the hub map first, so this replica's lease sweep
        // may recover the dispatch if nobody drives it.
        driver.shared.hubs.lock().await.remove(&operation_id);
        let hub = driver.ctx.hub.clone();
        super::api::watch(driver.shared.clone(), operation_id.clone(), hub).await;
    } else {
        if driver.stopped {
            // Nobody drives it: the conversation moved on, or the dispatch was cancelled.
            driver.emit(
                "error",
                json!({"code": "begin_refused", "message": error_message("begin_refused")}),
            );
        }
        driver.ctx.hub.finish();
    }
    driver.shared.hubs.lock().await.remove(&operation_id);
}

impl Driver {
    fn finished(&self) -> bool {
        let state = self.machine.state();
        // A terminal state with no effect left; FAILED/ABANDONED stay terminal for this
        // process (a rearm is a machine decision that would have queued a begin).
        self.stopped
            || state.is_terminal()
            || (state == DispatchState::Prepared && self.machine.poll_timeout().is_none() && self.gave_up())
    }

    /// Keep `turnstile_dispatch_unknown_age_seconds` honest: remember since when this
    /// dispatch is UNKNOWN, forget it when it leaves.
    fn track_unknown(&self) {
        let shared = self.shared.clone();
        let operation_id = self.ctx.record.operation_id.clone();
        let unknown = self.state == DispatchState::Unknown;
        tokio::spawn(async move {
            let mut since = shared.unknown_since.lock().await;
            if unknown {
                since.entry(operation_id).or_insert_with(now);
            } else {
                since.remove(&operation_id);
            }
        });
    }

    /// What the provider offers for getting back to `generation`: no resume after a clean end
    /// (the provider finished that response), after a refused resume, or past the resume cap.
    fn recovery_for(&self, generation: Generation, clean_end: bool) -> ProviderRecovery {
        let mut recovery = provider_recovery(&self.ctx.endpoint, self.ctx.api);
        if clean_end
            || self.resume_refused.contains(&generation)
            || self.resumes.get(&generation).copied().unwrap_or(0) >= RESUMES_PER_GENERATION_MAX
        {
            recovery.resume_by_handle = false;
        }
        recovery
    }

    fn gave_up(&self) -> bool {
        self.attempts_started >= ATTEMPTS_PER_DISPATCH_MAX || self.final_retract.is_some()
    }

    fn emit(&self, event: &'static str, data: Value) {
        self.ctx.hub.send(event, data);
    }

    /// One retract per generation, whoever noticed first (assembler or machine).
    fn retract(&mut self, generation: Generation, reason: &str) {
        if self.retracted.insert(generation) {
            metrics::bump(metrics::PREVIEW_RETRACTIONS);
            self.emit("retract", json!({"generation": generation.0, "reason": reason}));
        }
    }

    /// Perform queued effects in order. `suppress_interrupt_retract`: the machine retracts on
    /// every interruption, but when the stream will be resumed by handle the preview stays
    /// valid, so that retract is not shown.
    async fn perform_effects(&mut self, suppress_interrupt_retract: bool) {
        while let Some(effect) = self.machine.poll_effect() {
            match effect {
                Effect::Persist(write) => {
                    if let Some(answer) = self.persist(write).await {
                        let _ = self.machine.handle_store(now(), answer);
                    }
                }
                Effect::Send {
                    generation,
                    idempotency_key,
                    request_digest,
                } => {
                    self.send(generation, idempotency_key, &request_digest);
                }
                Effect::Resume { generation, handle } => self.resume(generation, &handle),
                Effect::BindHandle { generation, handle } => self.bind(generation, &handle).await,
                Effect::Emit(event) => match event {
                    ClientEvent::State { state, generation } => {
                        self.emit(
                            "state",
                            json!({"state": state.as_str(), "generation": generation.map(|g| g.0)}),
                        );
                    }
                    ClientEvent::Retract {
                        reason: "interrupted",
                        ..
                    } if suppress_interrupt_retract => {}
                    ClientEvent::Retract { generation, reason } => self.retract(generation, reason),
                    ClientEvent::Committed { revision } => {
                        let turn = self.committed_turn.take().unwrap_or(Value::Null);
                        let mut data = json!({"revision": revision.0, "turn": turn});
                        let facts = turn["generation"]
                            .as_u64()
                            .and_then(|generation| self.offer_facts.remove(&Generation(generation)));
                        if let (Some(Value::Object(facts)), Some(object)) = (facts, data.as_object_mut()) {
                            object.extend(facts);
                        }
                        self.emit("committed", data);
                    }
                    ClientEvent::Error {
                        code: code @ ("begin_refused" | "recovery_refused"),
                    } => {
                        // Not an error for the client: the driver switches to watching the
                        // dispatch that someone else drives (see `run`).
                        tracing::info!(operation_id = %self.ctx.record.operation_id, code, "dispatch driven elsewhere");
                    }
                    ClientEvent::Error { code } => {
                        self.emit("error", json!({"code": code, "message": error_message(code)}));
                    }
                },
                Effect::Quarantine {
                    generation,
                    reason,
                    content,
                } => {
                    let reason = match reason {
                        turnstile_core::dispatch::QuarantineReason::ForeignGeneration => "foreign_generation",
                        turnstile_core::dispatch::QuarantineReason::Late => "late",
                    };
                    self.quarantine(generation, reason, content).await;
                }
                Effect::ExposeToolCalls { .. } => {
                    // The store inserted them in the commit transaction; executors read
                    // GET /v1/tool-calls. Nothing to do here by design.
                }
            }
        }
    }

    async fn quarantine(&mut self, generation: Generation, reason: &str, content: Value) {
        metrics::bump(metrics::LATE_BLOCKS);
        let entry = QuarantineEntry {
            operation_id: self.ctx.record.operation_id.clone(),
            generation,
            reason: reason.to_owned(),
            content,
        };
        if let Err(error) = self.shared.ledger.quarantine(&entry, now()).await {
            tracing::warn!(operation_id = %entry.operation_id, %error, "quarantine write failed");
        }
    }

    fn transitioned(&mut self, from: DispatchState, to: DispatchState) {
        metrics::transition(from, to);
        self.state = to;
        if from == DispatchState::Unknown || to == DispatchState::Unknown {
            self.track_unknown();
        }
    }

    async fn persist(&mut self, write: Write) -> Option<StoreAnswer> {
        let ledger = &self.shared.ledger;
        let operation_id = self.ctx.record.operation_id.clone();
        let lease = |expires_at| Lease {
            holder: self.shared.holder.clone(),
            expires_at,
        };
        // Writes whose answer the machine waits for: if one fails, its outcome is unknown.
        let awaited = matches!(
            write,
            Write::Begin { .. } | Write::Replay { .. } | Write::AbandonAndRearm { .. } | Write::Commit { .. }
        );
        let result: Result<(), turnstile_store::StoreError> = match write {
            Write::Begin {
                expected_revision,
                expected_cancel_generation,
                lease_expires_at,
            } => {
                if self.gave_up() {
                    self.emit(
                        "error",
                        json!({"code": "attempts_exhausted", "message": error_message("attempts_exhausted")}),
                    );
                    return None;
                }
                let expect = BeginExpect {
                    revision: expected_revision,
                    cancel_generation: expected_cancel_generation,
                };
                match ledger
                    .begin_attempt(&operation_id, expect, &lease(lease_expires_at), now())
                    .await
                {
                    Ok(BeginOutcome::Began {
                        generation,
                        idempotency_key,
                    }) => {
                        self.attempts_started += 1;
                        let from = self.state;
                        self.transitioned(from, DispatchState::Dispatching);
                        self.idempotency_keys.insert(generation, idempotency_key.clone());
                        return Some(StoreAnswer::Began {
                            generation,
                            idempotency_key,
                        });
                    }
                    Ok(BeginOutcome::Refused { .. }) => {
                        self.stopped = true;
                        return Some(StoreAnswer::BeginRefused);
                    }
                    Err(error) => Err(error),
                }
            }
            Write::Transition { generation, from, to } => {
                match ledger
                    .transition(&operation_id, generation, from, to, now())
                    .await
                {
                    Ok(TransitionOutcome::Applied) => {
                        self.transitioned(from, to);
                        return None;
                    }
                    Ok(TransitionOutcome::Refused { .. }) => return Some(StoreAnswer::TransitionRefused),
                    Err(error) => Err(error),
                }
            }
            Write::Replay {
                generation,
                lease_expires_at,
            } => {
                match ledger
                    .replay_attempt(&operation_id, generation, &lease(lease_expires_at), now())
                    .await
                {
                    Ok(TransitionOutcome::Applied) => {
                        self.transitioned(DispatchState::Unknown, DispatchState::Dispatching);
                        let key = self.idempotency_key_of(generation).await;
                        return Some(StoreAnswer::Replayed {
                            generation,
                            idempotency_key: key,
                        });
                    }
                    Ok(TransitionOutcome::Refused { .. }) => {
                        self.stopped = true;
                        return Some(StoreAnswer::TransitionRefused);
                    }
                    Err(error) => Err(error),
                }
            }
            Write::AbandonAndRearm { generation } => {
                let ended = self.provider_ended.contains(&generation);
                match ledger
                    .abandon_and_rearm(&operation_id, generation, ended, now())
                    .await
                {
                    Ok(TransitionOutcome::Applied) => {
                        self.transitioned(DispatchState::Unknown, DispatchState::Abandoned);
                        metrics::recovery("new_generation");
                        self.state = DispatchState::Prepared;
                        return Some(StoreAnswer::Rearmed);
                    }
                    Ok(TransitionOutcome::Refused { .. }) => {
                        self.stopped = true;
                        return Some(StoreAnswer::TransitionRefused);
                    }
                    Err(error) => Err(error),
                }
            }
            Write::RenewLease {
                generation,
                lease_expires_at,
            } => {
                match ledger
                    .renew_lease(&operation_id, generation, &lease(lease_expires_at))
                    .await
                {
                    Ok(TransitionOutcome::Applied) => return None,
                    Ok(TransitionOutcome::Refused { .. }) => return Some(StoreAnswer::LeaseLost),
                    Err(error) => Err(error),
                }
            }
            Write::Commit {
                generation,
                expected_revision,
                turn,
            } => {
                // The provider's stop reason and usage go into the same transaction, for
                // clients that attach later (same operation id, Idempotency-Key).
                let outcome = self.offer_facts.get(&generation).cloned();
                match ledger
                    .commit_with_outcome(
                        &operation_id,
                        generation,
                        expected_revision,
                        &turn,
                        outcome.as_ref(),
                        now(),
                    )
                    .await
                {
                    Ok(CommitOutcome::Committed { revision, .. }) => {
                        let from = self.state;
                        self.transitioned(from, DispatchState::Committed);
                        // The store appends the turn as offered, stamped with its revision:
                        // the client event needs no second read of the whole history.
                        let mut committed = turn;
                        committed["revision"] = json!(revision.0);
                        self.committed_turn = Some(committed);
                        return Some(StoreAnswer::Committed { revision });
                    }
                    Ok(CommitOutcome::Refused(_)) => {
                        metrics::bump(metrics::CANONICAL_CAS_CONFLICTS);
                        metrics::bump(metrics::LATE_BLOCKS);
                        return Some(StoreAnswer::CommitRefused);
                    }
                    Ok(CommitOutcome::Rejected(violations)) => {
                        metrics::rejected(&violations);
                        metrics::bump(metrics::LATE_BLOCKS);
                        return Some(StoreAnswer::CommitRefused);
                    }
                    Err(error) => Err(error),
                }
            }
            Write::Cancel {
                expected_cancel_generation,
            } => {
                match ledger
                    .cancel(&operation_id, Some(expected_cancel_generation), now())
                    .await
                {
                    Ok(_) => return None,
                    Err(error) => Err(error),
                }
            }
        };
        if let Err(error) = result {
            if awaited {
                // The machine would wait forever for an answer that will not come. Stop
                // driving: the ledger decides (a write that landed is relayed by the watch; one
                // that did not leaves a lease that the sweep recovers once it runs out).
                self.stopped = true;
                if let Some(generation) = self.machine.generation() {
                    // This process will not finish this generation: its preview is void here.
                    self.retract(generation, "store_unavailable");
                }
            }
            // A store error leaves the outcome unknown; the lease will let recovery decide.
            tracing::error!(%operation_id, %error, "ledger write failed");
            self.emit(
                "error",
                json!({"code": "store_unavailable", "message": error_message("store_unavailable")}),
            );
        }
        None
    }

    async fn idempotency_key_of(&mut self, generation: Generation) -> String {
        if let Some(key) = self.idempotency_keys.get(&generation) {
            return key.clone();
        }
        let attempts = self
            .shared
            .ledger
            .attempts(&self.ctx.record.operation_id)
            .await
            .unwrap_or_default();
        attempts
            .into_iter()
            .find(|attempt| attempt.generation == generation)
            .map(|attempt| attempt.idempotency_key)
            .unwrap_or_default()
    }

    fn new_assembler(&self, generation: Generation, handle_bound: Option<String>) -> Assembler {
        let mut config = AssemblerConfig::new(
            generation,
            format!("{}.g{}", self.ctx.record.operation_id, generation.0),
        );
        config.toolset = self.ctx.toolset.clone();
        config.call_ids_taken = self.ctx.call_ids_taken.clone();
        config.handle_bound = handle_bound;
        Assembler::new(config)
    }

    fn open_connection(&mut self, generation: Generation, outgoing: transport::Outgoing, resume: bool) {
        let id = self.connection_next;
        self.connection_next += 1;
        self.connections.insert(
            id,
            Connection {
                generation,
                decoder: self.ctx.api.decoder(),
                status: None,
                saw_event: false,
                resume,
            },
        );
        let (forward, mut events) = mpsc::channel(TRANSPORT_QUEUE_MAX);
        let sender = self.sender.clone();
        tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                if sender.send((id, event)).await.is_err() {
                    return;
                }
            }
        });
        tokio::spawn(transport::perform(
            self.shared.client.clone(),
            self.ctx.endpoint.clone(),
            self.ctx.api,
            outgoing,
            self.shared.idle,
            forward,
        ));
    }

    fn send(&mut self, generation: Generation, idempotency_key: String, request_digest: &str) {
        // The manifest names the bytes by digest: anything else must never leave.
        if Digest::of_bytes(&self.ctx.record.request_bytes).as_str() != request_digest {
            metrics::bump(metrics::ILLEGAL_SENDS);
            tracing::error!(operation_id = %self.ctx.record.operation_id, "stored bytes do not match the manifest; not sent");
            let _ = self
                .machine
                .handle_provider(now(), generation, ProviderInput::Rejected);
            return;
        }
        self.assembler = Some(self.new_assembler(generation, None));
        self.provider_sequence_last = None;
        let outgoing = transport::send_request(
            &self.ctx.endpoint,
            self.ctx.api,
            &self.ctx.model,
            self.ctx.record.request_bytes.clone(),
            &idempotency_key,
        );
        self.open_connection(generation, outgoing, false);
    }

    fn resume(&mut self, generation: Generation, handle: &str) {
        match &mut self.assembler {
            Some(assembler) if assembler.generation() == generation => assembler.handle_connection_start(),
            _ => self.assembler = Some(self.new_assembler(generation, Some(handle.to_owned()))),
        }
        *self.resumes.entry(generation).or_default() += 1;
        let outgoing = transport::resume_request(&self.ctx.endpoint, handle, self.provider_sequence_last);
        self.open_connection(generation, outgoing, true);
    }

    async fn bind(&mut self, generation: Generation, handle: &str) {
        match self
            .shared
            .ledger
            .bind_handle(&self.ctx.record.operation_id, generation, handle, now())
            .await
        {
            Ok(BindOutcome::Bound | BindOutcome::AlreadyBound | BindOutcome::StaleGeneration) => {}
            Ok(BindOutcome::Refused { .. }) => {
                // The handle belongs to another manifest: nothing from it may be merged.
                metrics::bump(metrics::FOREIGN_HANDLES);
                self.connections
                    .retain(|_, connection| connection.generation != generation);
                let _ = self
                    .machine
                    .handle_provider(now(), generation, ProviderInput::Interrupted);
                // Boxed: recovery performs effects, which may bind a handle again.
                Box::pin(self.after_interruption(generation, false)).await;
            }
            Err(error) => tracing::warn!(%error, "bind_handle failed"),
        }
    }

    async fn transport_event(&mut self, connection_id: u64, event: TransportEvent) {
        let Some(connection) = self.connections.get_mut(&connection_id) else {
            return;
        };
        let generation = connection.generation;
        match event {
            TransportEvent::Head { status } => {
                connection.status = Some(status);
                if (200..300).contains(&status) {
                    let _ = self
                        .machine
                        .handle_provider(now(), generation, ProviderInput::Accepted);
                    self.perform_effects(false).await;
                }
            }
            TransportEvent::Chunk(bytes) => {
                if connection
                    .status
                    .is_some_and(|status| !(200..300).contains(&status))
                {
                    return;
                }
                connection.decoder.handle_bytes(&bytes);
                self.drain_decoder(connection_id).await;
            }
            TransportEvent::End | TransportEvent::Broken(_) => {
                let clean_end = matches!(event, TransportEvent::End);
                if let TransportEvent::Broken(reason) = &event {
                    tracing::info!(operation_id = %self.ctx.record.operation_id, generation = generation.0, %reason, "provider connection broke");
                }
                let broken_before_head =
                    matches!(event, TransportEvent::Broken(_)) && connection.status.is_none();
                let status = connection.status;
                let is_resume = connection.resume;
                if let TransportEvent::End = event {
                    connection.decoder.handle_end_of_input();
                }
                self.drain_decoder(connection_id).await;
                let saw_event = self
                    .connections
                    .remove(&connection_id)
                    .is_some_and(|c| c.saw_event);
                if self.machine.generation() != Some(generation) || self.machine.state().is_terminal() {
                    return;
                }
                let failed = broken_before_head || status.is_some_and(|status| !(200..300).contains(&status));
                if is_resume && (failed || !saw_event) {
                    // The provider refused the resume or had nothing more: no more resumes of
                    // this generation; it is interrupted like any other.
                    self.resume_refused.insert(generation);
                } else if failed {
                    // Nothing was produced: a refused connection or an error status.
                    let code = match status {
                        Some(status) => format!("provider_status_{status}"),
                        None => "provider_unreachable".to_owned(),
                    };
                    self.emit(
                        "error",
                        json!({"code": code, "message": "the provider produced nothing"}),
                    );
                    let _ = self
                        .machine
                        .handle_provider(now(), generation, ProviderInput::Rejected);
                    self.perform_effects(false).await;
                    return;
                }
                let resumable = self.recovery_for(generation, clean_end).resume_by_handle
                    && self
                        .assembler
                        .as_ref()
                        .is_some_and(|assembler| assembler.handle().is_some());
                if !resumable {
                    if let Some(assembler) = &mut self.assembler {
                        assembler.handle_end_of_input();
                    }
                    self.drain_assembler(generation).await;
                }
                if self.machine.state().is_terminal() || self.machine.generation() != Some(generation) {
                    return;
                }
                if matches!(
                    self.machine.state(),
                    DispatchState::Dispatching | DispatchState::Sent | DispatchState::Streaming
                ) {
                    let _ = self
                        .machine
                        .handle_provider(now(), generation, ProviderInput::Interrupted);
                    self.after_interruption(generation, clean_end).await;
                }
            }
        }
    }

    /// After an interruption: decide recovery with the store's view of the attempt. A body
    /// that ended cleanly (without its stop event) is an attempt the provider confirmably
    /// ended; a broken connection is not, so a new generation waits for its lease.
    async fn after_interruption(&mut self, generation: Generation, provider_ended: bool) {
        let attempts = self
            .shared
            .ledger
            .attempts(&self.ctx.record.operation_id)
            .await
            .unwrap_or_default();
        let Some(record) = attempts
            .into_iter()
            .find(|attempt| attempt.generation == generation)
        else {
            self.perform_effects(false).await;
            return;
        };
        let attempt = UnknownAttempt {
            generation,
            handle: record.handle.clone().or_else(|| {
                self.assembler
                    .as_ref()
                    .and_then(|a| a.handle().map(str::to_owned))
            }),
            idempotency_key: record.idempotency_key.clone(),
            lease_expires_at: record.lease_expires_at,
            provider_confirmed_ended: provider_ended,
        };
        if provider_ended {
            self.provider_ended.insert(generation);
        }
        let recovery = self.recovery_for(generation, provider_ended);
        let decision = recovery_decision(&attempt, recovery, now());
        let resuming = matches!(decision, RecoveryDecision::ResumeByHandle { .. });
        // Perform the interruption's own effects (UNKNOWN, retract unless resuming).
        self.perform_effects(resuming).await;
        if self.gave_up() && !resuming {
            let code = self.final_retract.unwrap_or("attempts_exhausted");
            self.emit("error", json!({"code": code, "message": error_message(code)}));
            let _ = self.machine.handle_cancel(now());
            self.perform_effects(false).await;
            return;
        }
        count_recovery(&decision);
        if !resuming {
            self.assembler = None;
        }
        let assembler = self.assembler.take();
        self.machine = DispatchMachine::recover(
            now(),
            prepared_of(&self.ctx.record),
            self.shared.lease_ms,
            &attempt,
            recovery,
        );
        self.assembler = assembler;
        self.state = DispatchState::Unknown;
        self.perform_effects(false).await;
    }

    async fn drain_decoder(&mut self, connection_id: u64) {
        loop {
            let Some(connection) = self.connections.get_mut(&connection_id) else {
                return;
            };
            let generation = connection.generation;
            let Some(sequenced) = connection.decoder.poll_event() else {
                break;
            };
            if !connection.saw_event {
                connection.saw_event = true;
                let _ = self
                    .machine
                    .handle_provider(now(), generation, ProviderInput::FirstEvent);
                self.perform_effects(false).await;
            }
            if sequenced.seq.source == SeqSource::Provider {
                self.provider_sequence_last = Some(
                    self.provider_sequence_last
                        .map_or(sequenced.seq.number, |last| last.max(sequenced.seq.number)),
                );
            }
            if let StreamEvent::Handle { handle } = &sequenced.event {
                let _ =
                    self.machine
                        .handle_provider(now(), generation, ProviderInput::Handle(handle.clone()));
                self.perform_effects(false).await;
            }
            let Some(assembler) = &mut self.assembler else {
                continue;
            };
            match assembler.handle_event(generation, sequenced) {
                Disposition::Quarantined(material) => {
                    let content = serde_json::to_value(&*material).unwrap_or(Value::Null);
                    self.quarantine(material.generation, "foreign_generation", content)
                        .await;
                }
                Disposition::Accepted | Disposition::Ignored(_) => {}
            }
            self.drain_assembler(generation).await;
        }
    }

    async fn drain_assembler(&mut self, generation: Generation) {
        loop {
            let Some(assembler) = &mut self.assembler else {
                return;
            };
            let Some(output) = assembler.poll_output() else {
                return;
            };
            match output {
                Output::Preview {
                    generation,
                    block_index,
                    delta,
                } => {
                    self.emit(
                        "preview",
                        json!({"generation": generation.0, "block_index": block_index.0, "delta": delta}),
                    );
                }
                Output::Retract { generation, reason } => {
                    // The machine hears of it as an interruption when the connection ends;
                    // the client hears now, with the assembler's more precise reason.
                    if matches!(reason, RetractReason::MaxTokensInToolArguments { .. }) {
                        // The same bytes under the same cap would stop there again: sending
                        // them again only bills the same truncation.
                        self.final_retract = Some(reason.code());
                    }
                    self.retract(generation, reason.code());
                }
                Output::Commit(offer) => {
                    if !tool_arguments_complete(&offer.turn) {
                        metrics::bump(metrics::PARTIAL_TOOL_DISPATCH);
                        continue;
                    }
                    let (input_tokens, output_tokens) = offer.usage.unwrap_or((None, None));
                    self.offer_facts.insert(
                        offer.generation,
                        json!({"stop_reason": offer.stop_reason,
                               "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}),
                    );
                    let _ = self.machine.handle_provider(
                        now(),
                        generation,
                        ProviderInput::Completed { turn: offer.turn },
                    );
                    self.perform_effects(false).await;
                }
            }
        }
    }
}

/// Defence in depth before a commit: every tool_call block carries one complete JSON object.
/// The assembler only offers such turns; if this ever fails, it is counted as a partial tool
/// dispatch (the metric that must stay 0) and nothing is committed.
fn tool_arguments_complete(turn: &Value) -> bool {
    turn["blocks"].as_array().is_some_and(|blocks| {
        blocks
            .iter()
            .filter(|block| block["kind"] == "tool_call")
            .all(|block| match &block["arguments"] {
                Value::Object(_) => true,
                Value::String(text) => matches!(serde_json::from_str::<Value>(text), Ok(Value::Object(_))),
                _ => false,
            })
    })
}

fn error_message(code: &str) -> &'static str {
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
        _ => "dispatch error",
    }
}
