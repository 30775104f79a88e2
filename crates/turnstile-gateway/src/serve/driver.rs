//! The gateway's pump for the sans-IO dispatch driver ([`turnstile_drive::Drive`]): one tokio
//! task per live dispatch performs the driver's actions against the ledger (through the one
//! mapping, `turnstile_store::drive::perform`), the provider transport, the client hub and the
//! metrics, and feeds back what happened with the wall clock. A client that disconnects does
//! not stop it, so the commit still happens and is readable later by operation id.
//!
//! What lives where: every *decision* (which write, when bytes may go out, what to
//! quarantine, when to retry, resume or give up) is the driver's; *conditions* (who wins) are
//! the store's compare-and-sets; this file only moves data between them and the network. The
//! simulation (`turnstile-testkit`) pumps the same driver.

use super::attempts::AttemptLog;
use super::drain::Phase;
use super::hub::Hub;
use super::metrics;
use super::traces;
use super::transport::{self, Endpoint, TransportEvent};
use super::{Shared, now};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use turnstile_adapters::decode::StreamApi;
use turnstile_core::assemble::Toolset;
use turnstile_core::dispatch::{DispatchState, ProviderRecovery, UnknownAttempt};
use turnstile_drive::{Action, ConnectionId, Count, Drive, DriveEvent, DriveSpec, Ending, Request};
use turnstile_store::DispatchRecord;

/// How much longer than `provider_idle_timeout_ms` the transport waits for a body's next bytes.
const IDLE_BACKSTOP: Duration = Duration::from_secs(2);

/// What a response connection's target did, for the circuit breaker.
enum Outcome {
    Head(u16, Option<u64>),
    End,
    Broken,
    Unreachable,
}

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
    /// Every target of the dispatch, its own manifest (the fields above) first, then its
    /// failover targets in order.
    pub targets: Vec<TargetContext>,
    /// Where client events go.
    pub hub: Arc<Hub>,
    /// The trace context of the request that started the dispatch (`traces.rs`).
    pub trace_parent: traces::Parent,
}

/// One target of a dispatch: where its attempts go and what they send.
#[derive(Clone)]
pub struct TargetContext {
    /// Which stream format its provider speaks.
    pub api: StreamApi,
    /// Model name from its manifest.
    pub model: String,
    /// Where to send.
    pub endpoint: Endpoint,
    /// Its manifest's `request_digest` and the stored bytes.
    pub request_digest: String,
    /// The stored bytes.
    pub request_bytes: Arc<Vec<u8>>,
    /// Provider name (metrics: `provider/model`).
    pub provider: String,
}

/// How the circuit breaker names a provider's model.
pub fn breaker_label(provider: &str, model: &str) -> String {
    format!("{provider}/{model}")
}

impl TargetContext {
    /// How the circuit breaker names it.
    pub fn label(&self) -> String {
        breaker_label(&self.provider, &self.model)
    }
}

fn provider_recovery(endpoint: &Endpoint, api: StreamApi) -> ProviderRecovery {
    ProviderRecovery {
        // Only the Responses API can resume a stream by handle (provider-rules.md).
        resume_by_handle: endpoint.resume_by_handle && api == StreamApi::OpenAiResponses,
        honours_idempotency_key: endpoint.honours_idempotency_key,
    }
}

/// `fresh`: the dispatch's prepare began its first attempt just now (nothing to read back of
/// earlier attempts).
async fn spec_of(shared: &Shared, ctx: &DriveContext, fresh: bool) -> DriveSpec {
    let (attempts_before, last_target) = if fresh {
        (0, None)
    } else {
        turnstile_store::drive::attempts_so_far(shared.ledger.as_ref(), &ctx.record).await
    };
    let targets = ctx
        .targets
        .iter()
        .map(|target| turnstile_drive::DriveTarget {
            request_digest: target.request_digest.clone(),
            request_bytes: target.request_bytes.clone(),
            api: target.api,
            recovery: provider_recovery(&target.endpoint, target.api),
            label: target.provider.clone(),
            decoder: turnstile_adapters::decode::DecoderOptions {
                vendor_usage: target.endpoint.vendor_usage,
            },
            timeouts: target.endpoint.timeouts,
        })
        .collect();
    let cooling = ctx
        .targets
        .iter()
        .map(|target| shared.breaker.cooling(&target.label(), now()))
        .collect();
    // The dispatch's own bytes are shared with target 0 (one copy per dispatch, not two).
    let basis = turnstile_drive::DispatchBasis {
        operation_id: ctx.record.operation_id.clone(),
        revision: ctx.record.revision,
        cancel_generation: ctx.record.cancel_generation,
        request_digest: ctx.record.request_digest.clone(),
        request_bytes: ctx.targets[0].request_bytes.clone(),
    };
    DriveSpec {
        basis,
        targets,
        cooling,
        last_target,
        toolset: ctx.toolset.clone(),
        call_ids_taken: ctx.call_ids_taken.clone(),
        lease_ms: shared.lease_ms,
        attempts_before,
        timeouts: shared.timeouts,
    }
}

/// Drive a fresh PREPARED dispatch to its end.
pub async fn drive_new(shared: Arc<Shared>, ctx: DriveContext) {
    let spec = spec_of(&shared, &ctx, false).await;
    let drive = Drive::new(spec, now());
    run(shared, ctx, drive).await;
}

/// Drive a dispatch whose first attempt its prepare began (`Ledger::prepare_sealed` with a
/// begin).
pub async fn drive_begun(shared: Arc<Shared>, ctx: DriveContext, began: super::api::Began) {
    let spec = spec_of(&shared, &ctx, true).await;
    // Its lease was asked for when the prepare ran: the driver's fence counts from then.
    let drive = Drive::begun(
        spec,
        began.asked_at,
        began.target,
        began.generation,
        began.idempotency_key,
    );
    run(shared, ctx, drive).await;
}

/// Drive a dispatch whose active attempt is UNKNOWN (start-up recovery or a takeover).
pub async fn drive_recovered(
    shared: Arc<Shared>,
    ctx: DriveContext,
    attempt: UnknownAttempt,
    spent: turnstile_drive::RecoverySpent,
    target: u32,
) {
    let spec = spec_of(&shared, &ctx, false).await;
    let drive = Drive::recovered(spec, &attempt, spent, target, now());
    run(shared, ctx, drive).await;
}

/// The pump's own state: open connections and where their events go.
struct Pump {
    shared: Arc<Shared>,
    ctx: DriveContext,
    sender: mpsc::Sender<(ConnectionId, TransportEvent)>,
    connections: HashMap<ConnectionId, JoinHandle<()>>,
    /// Connection tasks aborted here; awaited before a hand-over's clients are told, so the
    /// store releases the lease only after they are gone (`drain.rs`).
    aborted: Vec<JoinHandle<()>>,
    /// Which target each connection went to, whether it is a response (not a question), and
    /// the status of its head once it came (the circuit breaker's record of outcomes).
    provider_of: HashMap<ConnectionId, (usize, bool, Option<u16>)>,
    /// This dispatch's spans (a no-op when traces are off).
    trace: traces::Hook,
    /// What each provider response connection did: metrics and evidence (`attempts.rs`).
    log: AttemptLog,
    /// The target of the last response connection opened (the dispatch's metric labels).
    current_target: usize,
    /// The committed generation's usage as the provider reported it (the dispatch's log line).
    committed_usage: Option<serde_json::Value>,
    /// The last error code told to the dispatch's clients (the dispatch's log line).
    error: Option<String>,
    /// The dispatch span's trace id ("" with traces off), read at its start: the log line is
    /// written after the span ended.
    trace_id: String,
}

async fn run(shared: Arc<Shared>, ctx: DriveContext, mut drive: Drive) {
    let (sender, mut receiver) = mpsc::channel(TRANSPORT_QUEUE_MAX);
    let operation_id = ctx.record.operation_id.clone();
    let trace = traces::Hook::start(&ctx.record, ctx.api, &ctx.model, &ctx.endpoint, &ctx.trace_parent);
    if trace.captures_content()
        && let Ok(Some(document)) = shared.ledger.conversation(&ctx.record.conversation_id).await
    {
        trace.input(&document, ctx.record.revision.0);
    }
    let mut pump = Pump {
        shared,
        ctx,
        sender,
        connections: HashMap::new(),
        aborted: Vec::new(),
        provider_of: HashMap::new(),
        trace,
        log: AttemptLog::new(std::time::Instant::now()),
        current_target: 0,
        committed_usage: None,
        error: None,
        trace_id: String::new(),
    };
    pump.trace_id = pump.trace.trace_id().unwrap_or_default();
    // The process does not exit before this dispatch ended or was handed over: every caller
    // spawns the driver with `Drain::spawn`, which counts it before its first poll.
    let mut handed_over = false;
    // What this dispatch holds of the process-wide output budget (given back when it ends).
    let share = pump.shared.output_budget.join();
    let mut shed = false;
    // The driver's clock starts where it was made (a prepared-and-begun one at its prepare):
    // it reads the present before anything goes out, so a fence already past stops it.
    drive.handle_timeout(now());
    if pump.shared.drain.phase() >= Phase::HandingOver {
        // Started after the hand-over began (a request or sweep still in flight when it
        // did): nothing goes out; recovery takes the dispatch (review finding 3).
        handed_over = true;
        drive.handle_hand_over(now());
    }
    pump.perform(&mut drive).await;
    while !drive.is_finished() {
        let sleep = match drive.poll_timeout() {
            Some(at) => Duration::from_millis(at.0.saturating_sub(now().0)),
            None => Duration::from_secs(3600),
        };
        tokio::select! {
            received = receiver.recv() => {
                // Invariant: the pump holds a sender, so the channel never closes first.
                let Some((connection, event)) = received else { break };
                if !pump.connections.contains_key(&connection) {
                    continue;
                }
                pump.trace.transport(connection, &event);
                match event {
                    TransportEvent::Head { status, retry_after_ms, request_id } => {
                        pump.log.head(connection, status, retry_after_ms, request_id.as_deref());
                        pump.provider_outcome(connection, Outcome::Head(status, retry_after_ms));
                        drive.handle_head(now(), connection, status);
                    }
                    TransportEvent::Chunk(bytes) => {
                        pump.log.chunk(connection, &bytes);
                        let over = share.take(bytes.len() as u64);
                        metrics::output_bytes(pump.shared.output_budget.held());
                        if over && !shed {
                            shed = true;
                            tracing::warn!(%operation_id, "provider output budget exhausted: this dispatch held the most and ends");
                            metrics::bump(metrics::OUTPUT_SHED);
                            drive.handle_shed(now(), "output_budget_exhausted");
                        } else if !shed {
                            drive.handle_chunk(now(), connection, bytes.to_vec());
                        }
                    }
                    TransportEvent::End => {
                        pump.connection_ended(connection, "clean");
                        pump.provider_outcome(connection, Outcome::End);
                        pump.connections.remove(&connection);
                        drive.handle_end(now(), connection, Ending::Clean);
                    }
                    TransportEvent::Broken(reason) => {
                        tracing::info!(%operation_id, connection = connection.0, %reason, "provider connection broke");
                        pump.connection_ended(connection, "broken");
                        pump.provider_outcome(connection, Outcome::Broken);
                        pump.connections.remove(&connection);
                        drive.handle_end(now(), connection, Ending::Broken);
                    }
                    TransportEvent::Unreachable(reason) => {
                        tracing::info!(%operation_id, connection = connection.0, %reason, "provider unreachable");
                        pump.connection_ended(connection, "unreachable");
                        pump.provider_outcome(connection, Outcome::Unreachable);
                        pump.connections.remove(&connection);
                        drive.handle_end(now(), connection, Ending::Unreachable);
                    }
                }
            }
            _ = tokio::time::sleep(sleep) => drive.handle_timeout(now()),
            () = pump.shared.drain.reached(Phase::HandingOver), if !handed_over => {
                // The process is shutting down and its drain timeout passed.
                handed_over = true;
                drive.handle_hand_over(now());
            }
            () = share.chosen(), if !shed => {
                // Another dispatch's chunk chose this one, which holds the most.
                shed = true;
                tracing::warn!(%operation_id, "provider output budget exhausted: this dispatch held the most and ends");
                metrics::bump(metrics::OUTPUT_SHED);
                drive.handle_shed(now(), "output_budget_exhausted");
            }
        }
        pump.perform(&mut drive).await;
    }
    drop(share);
    metrics::output_bytes(pump.shared.output_budget.held());
    pump.trace.finish(drive.state());
    pump.log.close_all();
    let left = pump.log.take_all();
    pump.write_evidence(left);
    let outcome = match drive.state() {
        DispatchState::Committed => Some("committed"),
        DispatchState::Failed => Some("failed"),
        DispatchState::Abandoned => Some("abandoned"),
        _ => None,
    };
    let labels = pump.labels();
    if let Some(outcome) = outcome {
        metrics::dispatch_ended(&labels, outcome, pump.log.accepted().elapsed().as_secs_f64());
        if let Some(prompt) = pump.ctx.record.manifest["prompt_tokens"].as_u64() {
            metrics::estimated_tokens(&labels, &pump.tenant(), prompt);
        }
    }
    if outcome.is_some()
        && let Some(code) = &pump.error
    {
        metrics::dispatch_error(&labels, code);
    }
    pump.log_end(&drive, handed_over);
    // Nothing of this dispatch is read from the provider any more.
    for (_, task) in pump.connections.drain() {
        task.abort();
        pump.aborted.push(task);
    }
    let shared = pump.shared.clone();
    if handed_over && drive.fenced() {
        // Handed to recovery: every provider connection of this dispatch ends before its
        // clients are told, and before the store releases the lease (`drain.rs`).
        for task in pump.aborted.drain(..) {
            let _ = task.await;
        }
        shared.unknown_since.lock().await.remove(&operation_id);
        pump.ctx.hub.send(DriveEvent::Error {
            code: "shutting_down".into(),
            message: turnstile_drive::error_message("shutting_down").into(),
        });
        pump.ctx.hub.finish();
        remove_hub(&shared, &operation_id, &pump.ctx.hub).await;
        return;
    }
    shared.unknown_since.lock().await.remove(&operation_id);
    // Stopped: another replica, the sweep or the ledger decides now. Watch unless the ledger
    // says the dispatch ended without a commit (a PREPARED one is driven again by the sweep; a
    // failed read is no proof of anything).
    let driven_elsewhere = drive.stopped()
        && match shared.ledger.dispatch(&operation_id).await {
            Ok(Some(record)) => {
                record.state.is_live()
                    || record.state == DispatchState::Committed
                    || record.state == DispatchState::Prepared
            }
            Ok(None) => false,
            Err(_) => true,
        };
    if driven_elsewhere {
        // Another replica owns the dispatch now (or the ledger does, after a failed write):
        // relay its progress from the ledger to this dispatch's clients instead of ending
        // their stream with an error. Out of the hub map first, so this replica's lease sweep
        // may recover the dispatch if nobody drives it.
        remove_hub(&shared, &operation_id, &pump.ctx.hub).await;
        let hub = pump.ctx.hub.clone();
        super::api::watch(shared.clone(), operation_id.clone(), hub).await;
    } else {
        if drive.stopped() {
            // Nobody drives it: the conversation moved on, or the dispatch was cancelled.
            pump.ctx.hub.send(DriveEvent::Error {
                code: "begin_refused".into(),
                message: turnstile_drive::error_message("begin_refused").into(),
            });
        }
        pump.ctx.hub.finish();
    }
    remove_hub(&shared, &operation_id, &pump.ctx.hub).await;
}

/// The configured tenant whose prefix `operation_id` carries (`name~id`), else `none`.
pub fn tenant_of(shared: &Shared, operation_id: &str) -> String {
    operation_id
        .split_once('~')
        .map(|(name, _)| name)
        .filter(|name| shared.tenants.iter().any(|(_, known)| known == name))
        .unwrap_or("none")
        .to_owned()
}

/// Forget this dispatch's hub, unless a newer one (a later driver here) took its place.
async fn remove_hub(shared: &Shared, operation_id: &str, hub: &Arc<Hub>) {
    let mut hubs = shared.hubs.lock().await;
    if hubs
        .get(operation_id)
        .is_some_and(|current| Arc::ptr_eq(current, hub))
    {
        // Its tail is kept before the hub is forgotten (under the same lock), so a stream
        // resumed meanwhile finds one or the other.
        if hub.is_finished() {
            let mut tails = shared
                .finished_tails
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if tails.len() >= super::hub::FINISHED_TAILS_MAX {
                tails.pop_front();
            }
            tails.push_back((operation_id.to_owned(), Arc::new(hub.finished_tail())));
        }
        hubs.remove(operation_id);
    }
}

impl Pump {
    /// A response connection ended: counted, and its evidence put on its attempt's span.
    fn connection_ended(&mut self, connection: ConnectionId, end: &'static str) {
        self.log.ended(connection, end);
        if let Some((generation, row)) = self.log.row(connection) {
            self.trace.evidence(generation.0, &row);
        }
    }

    /// Usage the provider reported for attempts that committed nothing (billed all the same),
    /// from their evidence rows; rows of `committed` are counted from the commit instead.
    fn count_uncommitted_usage(
        &self,
        rows: &[(turnstile_core::Generation, serde_json::Value)],
        committed: Option<u64>,
    ) {
        let tenant = self.tenant();
        for (generation, row) in rows {
            if Some(generation.0) != committed && row["usage"].is_object() {
                let labels = metrics::target_labels(
                    row["provider"].as_str().unwrap_or_default(),
                    row["model"].as_str().unwrap_or_default(),
                );
                metrics::usage(&labels, &tenant, false, &row["usage"]);
            }
        }
    }

    /// One line when the dispatch ends here: who, what, which targets and attempts (with how
    /// each ended), tokens, duration and the trace id.
    fn log_end(&self, drive: &Drive, handed_over: bool) {
        let record = &self.ctx.record;
        let usage = self.committed_usage.as_ref();
        let tokens = |field: &str| usage.and_then(|usage| usage[field].as_u64());
        tracing::info!(
            target: "turnstile::dispatch",
            operation_id = %record.operation_id,
            conversation_id = %record.conversation_id,
            tenant = %self.tenant(),
            state = drive.state().as_str(),
            error = self.error.as_deref().unwrap_or(""),
            handed_over,
            targets_tried = %self.log.targets_tried(&self.ctx.targets),
            attempts = %self.log.summary(),
            input_tokens = tokens("input_tokens"),
            output_tokens = tokens("output_tokens"),
            duration_ms = self.log.accepted().elapsed().as_millis() as u64,
            trace_id = %self.trace_id,
            "dispatch ended"
        );
    }

    /// The `tenant` label: the configured tenant whose prefix the operation id carries, else
    /// `none` (no tenants configured).
    fn tenant(&self) -> String {
        tenant_of(&self.shared, &self.ctx.record.operation_id)
    }

    /// The dispatch's metric labels: the target of its last response connection.
    fn labels(&self) -> (String, String) {
        let target = &self.ctx.targets[self.current_target.min(self.ctx.targets.len() - 1)];
        metrics::target_labels(&target.provider, &target.model)
    }

    /// Perform every action the driver has, in order.
    async fn perform(&mut self, drive: &mut Drive) {
        while let Some(action) = drive.poll_action() {
            match action {
                Action::Store(op) => {
                    // The commit carries the evidence gathered so far (written with it when it
                    // wins, on its own when it does not).
                    let evidence = match op {
                        turnstile_drive::StoreOp::Commit { generation, .. } => {
                            self.log.take_for_commit(generation.0)
                        }
                        _ => Vec::new(),
                    };
                    for (generation, row) in &evidence {
                        self.trace.evidence(generation.0, row);
                    }
                    let carried = evidence.clone();
                    let performed = turnstile_store::drive::perform_with_evidence(
                        self.shared.ledger.as_ref(),
                        &self.shared.holder,
                        &self.ctx.record.operation_id,
                        &op,
                        now(),
                        carried,
                    );
                    // While provider connections hang on the lease, the store is waited for
                    // only until the driver's fence: then the operation's outcome is unknown
                    // and the driver stops before its lease can run out (a dropped write may
                    // still land; every write is fenced by generation).
                    let result = match drive.store_wait_deadline() {
                        Some(fence) => {
                            let wait = Duration::from_millis(fence.0.saturating_sub(now().0));
                            match tokio::time::timeout(wait, performed).await {
                                Ok(result) => result,
                                Err(_) => turnstile_drive::StoreResult::Failed(
                                    "the store did not answer before this replica's lease ends".into(),
                                ),
                            }
                        }
                        None => performed.await,
                    };
                    if let turnstile_drive::StoreResult::Failed(error) = &result {
                        tracing::error!(operation_id = %self.ctx.record.operation_id, %error, "ledger operation failed");
                    }
                    match (&op, &result) {
                        (
                            turnstile_drive::StoreOp::Commit {
                                generation, outcome, ..
                            },
                            turnstile_drive::StoreResult::Committed { .. },
                        ) => {
                            self.log.committed(generation.0);
                            let usage = outcome.as_ref().map(|outcome| outcome["usage"].clone());
                            if let Some(usage) = &usage {
                                metrics::usage(&self.labels(), &self.tenant(), true, usage);
                            }
                            // Usage other generations reported rode in the commit too.
                            self.count_uncommitted_usage(&evidence, Some(generation.0));
                            self.committed_usage = usage;
                        }
                        _ => self.write_evidence(super::attempts::not_committed(evidence)),
                    }
                    self.trace.store(&op, &result);
                    drive.handle_store(now(), result);
                }
                Action::Open {
                    connection,
                    generation,
                    target,
                    request,
                } => {
                    // Who answers: the proxy names the target of the generation whose preview
                    // opens its stream (`hub::Receiver::target_of`).
                    self.ctx.hub.opened(generation, target as usize);
                    let trace_headers = self.trace.open(connection, generation.0, &request);
                    self.open(drive, connection, target, generation.0, request, trace_headers);
                }
                Action::Close { connection } => {
                    self.log.ended(connection, "closed");
                    if let Some(task) = self.connections.remove(&connection) {
                        task.abort();
                        self.aborted.push(task);
                    }
                }
                Action::Emit(event) => {
                    self.trace.emit(&event);
                    let labels = self.labels();
                    self.log.event(&event, &labels);
                    if let DriveEvent::Error { code, .. } = &event {
                        self.error = Some(code.clone());
                    }
                    // Typed to the hub; JSON only at the client edges (`hub.rs`).
                    self.ctx.hub.send(event);
                }
                Action::Count(count) => {
                    self.trace.count(&count);
                    self.count(count).await;
                }
                Action::ExposeToolCalls { .. } => {
                    // The store inserted them in the commit transaction; executors read
                    // GET /v1/tool-calls. Nothing to do here by design.
                }
            }
        }
        // Connections that failed, once their end (and any retraction) was handled.
        let failed = self.log.take_failed();
        self.write_evidence(failed);
    }

    /// Write attempt evidence on its own, off the dispatch's path (a failure path: one write
    /// per failed connection; nothing waits for it).
    fn write_evidence(&self, rows: Vec<(turnstile_core::Generation, serde_json::Value)>) {
        if rows.is_empty() {
            return;
        }
        self.count_uncommitted_usage(&rows, None);
        let shared = self.shared.clone();
        let operation_id = self.ctx.record.operation_id.clone();
        tokio::spawn(async move {
            if let Err(error) = shared.ledger.record_evidence(&operation_id, &rows, now()).await {
                tracing::warn!(%operation_id, %error, "attempt evidence not written");
            }
        });
    }

    fn open(
        &mut self,
        drive: &Drive,
        connection: ConnectionId,
        target: u32,
        generation: u64,
        request: Request,
        trace_headers: Vec<(String, String)>,
    ) {
        let index = (target as usize).min(self.ctx.targets.len() - 1);
        let to = &self.ctx.targets[index];
        let streams = matches!(request, Request::Send { .. } | Request::Resume { .. });
        self.provider_of.insert(connection, (index, streams, None));
        if streams {
            self.current_target = index;
            let kind = if matches!(request, Request::Send { .. }) {
                "send"
            } else {
                "resume"
            };
            self.log
                .opened(connection, generation, index, (&to.provider, &to.model), kind);
        }
        let mut outgoing = match request {
            Request::Send { idempotency_key } => transport::send_request(
                &to.endpoint,
                to.api,
                &to.model,
                drive.request_bytes(target).as_ref().clone(),
                &idempotency_key,
            ),
            Request::Resume {
                handle,
                after_sequence,
            } => transport::resume_request(&to.endpoint, &handle, after_sequence),
            Request::Status { handle } => transport::status_request(&to.endpoint, &handle),
            Request::Cancel { handle } => transport::cancel_request(&to.endpoint, &handle),
        };
        outgoing.headers.extend(trace_headers);
        let (forward, mut events) = mpsc::channel(TRANSPORT_QUEUE_MAX);
        let sender = self.sender.clone();
        let client = self.shared.client.clone();
        let endpoint = to.endpoint.clone();
        let api = to.api;
        // A backstop: the driver enforces the idle bound on decoded events and closes the
        // connection itself (`idle_timeout`); this timer only ends a body the pump stopped
        // reading, later, so the two never race to name the end. The target's own idle bound
        // where its provider sets one.
        let idle = match to.endpoint.timeouts {
            Some(own) => Duration::from_millis(own.idle_ms),
            None => self.shared.idle,
        } + IDLE_BACKSTOP;
        let task = tokio::spawn(async move {
            let relay = async move {
                while let Some(event) = events.recv().await {
                    if sender.send((connection, event)).await.is_err() {
                        return;
                    }
                }
            };
            tokio::join!(
                transport::perform(client, endpoint, api, outgoing, idle, forward),
                relay
            );
        });
        self.connections.insert(connection, task);
    }

    /// Tell the circuit breaker how a response connection's target did (status and cancel
    /// questions are not counted): a refusal with a failover status, no connection or a broken
    /// stream is a failure; only a stream that ended cleanly is a success (a 200 whose stream is
    /// then cut is not).
    fn provider_outcome(&mut self, connection: ConnectionId, outcome: Outcome) {
        let Some(&mut (index, true, ref mut head)) = self.provider_of.get_mut(&connection) else {
            return;
        };
        if let Outcome::Head(status, _) = outcome {
            *head = Some(status);
        }
        let head = *head;
        let Some(target) = self.ctx.targets.get(index) else {
            return;
        };
        let label = target.label();
        match outcome {
            Outcome::Head(status, _) if (200..300).contains(&status) => {}
            Outcome::Head(status, retry_after_ms) => {
                if turnstile_drive::fails_over_on(Some(status)) {
                    let retry_after = retry_after_ms.filter(|_| status == 429);
                    self.shared.breaker.failure(&label, retry_after, now());
                }
            }
            // The clean end of a refusal's error body is not a success: its head was counted.
            Outcome::End if head.is_some_and(|status| (200..300).contains(&status)) => {
                self.shared.breaker.success(&label)
            }
            Outcome::End => {}
            Outcome::Broken | Outcome::Unreachable => self.shared.breaker.failure(&label, None, now()),
        }
    }

    async fn count(&self, count: Count) {
        match count {
            Count::Transition { from, to } => metrics::transition(from, to),
            Count::Recovery(outcome) => metrics::recovery(outcome),
            Count::PreviewRetraction => metrics::bump(metrics::PREVIEW_RETRACTIONS),
            Count::CasConflict => metrics::bump(metrics::CANONICAL_CAS_CONFLICTS),
            Count::LateBlock => metrics::bump(metrics::LATE_BLOCKS),
            Count::ForeignHandle => metrics::bump(metrics::FOREIGN_HANDLES),
            Count::IllegalSend => {
                metrics::bump(metrics::ILLEGAL_SENDS);
                tracing::error!(operation_id = %self.ctx.record.operation_id, "stored bytes do not match the manifest; not sent");
            }
            Count::PartialToolDispatch => metrics::bump(metrics::PARTIAL_TOOL_DISPATCH),
            Count::Rejected(codes) => metrics::rejected_codes(&codes),
            Count::Unknown(entered) => {
                let mut since = self.shared.unknown_since.lock().await;
                if entered {
                    since
                        .entry(self.ctx.record.operation_id.clone())
                        .or_insert_with(now);
                } else {
                    since.remove(&self.ctx.record.operation_id);
                }
            }
            Count::StoreFailure => metrics::bump(metrics::DRIVER_STORE_FAILURES),
            Count::SelfFenced("shutting_down") => {
                tracing::info!(operation_id = %self.ctx.record.operation_id, "drain timeout passed: provider connections closed, the dispatch is handed to recovery");
                metrics::self_fenced("shutting_down");
            }
            Count::SelfFenced(reason) => {
                tracing::warn!(operation_id = %self.ctx.record.operation_id, %reason, "lease could not be kept: provider connections closed before it runs out; recovery decides");
                metrics::self_fenced(reason);
            }
            Count::Ignored(reason) => metrics::ignored(reason),
            Count::Notice { target, code, detail } => {
                tracing::warn!(operation_id = %self.ctx.record.operation_id, provider = %target, %code, %detail, "provider stream notice");
                metrics::notice(&target, &code);
            }
            Count::Timeout => metrics::bump(metrics::PROVIDER_TIMEOUTS),
            Count::Failover {
                from_target,
                from,
                to,
                reason,
            } => {
                // A connection the driver closed at a deadline reported nothing to the breaker.
                if reason.ends_with("_timeout")
                    && let Some(target) = self.ctx.targets.get(from_target as usize)
                {
                    self.shared.breaker.failure(&target.label(), None, now());
                }
                tracing::info!(operation_id = %self.ctx.record.operation_id, %from, %to, %reason, "failover");
                metrics::failover(&from, &to, &reason);
            }
        }
    }
}
