//! The simulation world: the real `DispatchMachine`, the real adapters (render, manifest,
//! decoders) and assembler, and the real SQLite ledger on a temporary file, with the effects
//! performed the way `turnstile-gateway`'s `serve/driver.rs` performs them — ported line by
//! line to a synchronous, single-threaded loop over a virtual clock. The scripted
//! [`Provider`] is the only stand-in.
//!
//! One step is one scheduling choice of the seed: deliver the next piece (head, chunk, end) of
//! one open provider connection (connections interleave in any order), fire the earliest
//! timer, or sweep expired leases. A crash may follow any effect: every in-memory part is
//! dropped, the same SQLite file is reopened and start-up recovery runs.

use crate::plan::{Bugs, FaultKind, FaultPlan};
use crate::provider::{Answer, Provider};
use crate::report::{Invariant, SeedReport};
use crate::rng::Rng;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use turnstile_adapters::decode::{Decoder, StreamApi};
use turnstile_adapters::{AdapterId, Catalog, Graph, PrepareOutcome, PrepareRequest, RenderCache, prepare};
use turnstile_core::assemble::{Assembler, AssemblerConfig, Disposition, Output, RetractReason, Toolset};
use turnstile_core::dispatch::{
    ClientEvent, DispatchMachine, DispatchState, Effect, Prepared, ProviderInput, ProviderRecovery,
    QuarantineReason, RecoveryDecision, StoreAnswer, Timestamp, UnknownAttempt, Write, recovery_decision,
};
use turnstile_core::stream::{SeqSource, StreamEvent};
use turnstile_core::{
    Conversation, Digest, Generation, MessageSequence, Revision, Validated, Verdict, validate,
};
use turnstile_store::{
    BeginExpect, BeginOutcome, BindOutcome, ClaimOutcome, CommitOutcome, DispatchRecord, Fault, Lease,
    Ledger, PrepareOutcome as StorePrepare, QuarantineEntry, SqliteLedger, Synchronous, ToolCallState,
    TransitionOutcome,
};

/// The lease holder of the simulated gateway (stable across its restarts, as in production).
pub const HOLDER: &str = "dst-replica";
/// The holder id the lease sweep uses (as `serve/mod.rs`).
pub const SWEEP_HOLDER: &str = "turnstile-sweep";
/// Attempt lease.
pub const LEASE_MS: u64 = 5_000;
/// Slack on "every UNKNOWN resolves within lease + ε" in the liveness phase.
pub const EPSILON_MS: u64 = 1_000;
/// The conversation every seed works on.
pub const CONVERSATION_ID: &str = "dst-conversation";
/// Most steps of one phase (a run that needs more is a liveness finding).
pub const STEPS_PER_PHASE_MAX: u64 = 600;
/// Most client rounds (dispatch, then tool results) per seed.
pub const ROUNDS_MAX: u64 = 3;
/// Most operations a client starts for one round before moving on.
pub const OPS_PER_ROUND_MAX: u64 = 3;
/// As `serve/driver.rs`.
pub const ATTEMPTS_PER_DISPATCH_MAX: u64 = 4;
/// As `serve/driver.rs`.
const RESUMES_PER_GENERATION_MAX: u32 = 3;
/// Virtual time one delivery may take.
const DELIVERY_MS_MAX: u64 = 40;

/// How a world is set up besides its seed.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Keep a trace of every step.
    pub trace: bool,
    /// Planted bugs (all off for a real run).
    pub bugs: Bugs,
    /// Handle a store error on an awaited write exactly as `serve/driver.rs` does today (no
    /// answer, the driver keeps waiting and keeps the dispatch from the lease sweep). Off: the
    /// driver stops and leaves the dispatch to the sweep — the fix proposed in
    /// `docs/reliability.md`, which the default run uses. See `docs/decisions.md`.
    pub production_store_errors: bool,
}

/// One provider connection as the gateway's transport sees it.
pub(crate) struct Conn {
    pub(crate) op: String,
    pub(crate) generation: Generation,
    decoder: Box<dyn Decoder>,
    status: u16,
    head_delivered: bool,
    saw_event: bool,
    resume: bool,
    chunks: VecDeque<Vec<u8>>,
    clean_end: bool,
    /// Planted bug `commit_late_turn` only: an assembler of the stream's own (old) generation.
    side: Option<Assembler>,
}

/// One dispatch's driver (the port of `serve/driver.rs::Driver`).
pub(crate) struct Driver {
    pub(crate) op: String,
    record: DispatchRecord,
    pub(crate) machine: DispatchMachine,
    assembler: Option<Assembler>,
    attempts_started: u64,
    provider_sequence_last: Option<u64>,
    idempotency_keys: HashMap<Generation, String>,
    retracted: HashSet<Generation>,
    provider_ended: HashSet<Generation>,
    resume_refused: HashSet<Generation>,
    resumes: HashMap<Generation, u32>,
    stopped: bool,
    /// As in the gateway driver: a retract that would repeat on every attempt ends retrying.
    final_retract: bool,
}

impl Driver {
    fn finished(&self) -> bool {
        let state = self.machine.state();
        self.stopped
            || state.is_terminal()
            || (state == DispatchState::Prepared && self.machine.poll_timeout().is_none() && self.gave_up())
    }

    fn gave_up(&self) -> bool {
        self.attempts_started >= ATTEMPTS_PER_DISPATCH_MAX || self.final_retract
    }
}

/// What the checker remembers beyond the store.
#[derive(Default)]
pub(crate) struct History {
    /// (operation, generation) that showed preview.
    pub(crate) previewed: HashSet<(String, u64)>,
    /// (operation, generation) retracted to the client (or whose client stream a crash cut).
    pub(crate) retracted: HashSet<(String, u64)>,
    /// Call ids executors were shown.
    pub(crate) exposed: HashSet<String>,
    /// Operations sent at least once.
    pub(crate) sent_ops: HashSet<String>,
    /// Foreign-handle refusals the world saw.
    pub(crate) bind_refusals: u64,
    /// Bind writes whose answer a store fault hid (each may or may not have counted).
    pub(crate) bind_ambiguous: u64,
    /// Re-render digest per operation (the checker's own render).
    pub(crate) rerendered: HashMap<String, Result<String, String>>,
    /// Call ids already reported as partial.
    pub(crate) partial_reported: HashSet<String>,
    /// (operation, generation) committed.
    committed: HashSet<(String, u64)>,
}

impl History {
    pub(crate) fn committed_insert(&mut self, op: &str, generation: u64) {
        self.committed.insert((op.to_owned(), generation));
    }

    pub(crate) fn committed_contains(&self, op: &str, generation: u64) -> bool {
        self.committed.contains(&(op.to_owned(), generation))
    }

    pub(crate) fn committed_count(&self) -> u64 {
        self.committed.len() as u64
    }
}

/// The phase of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Faults on.
    Safety,
    /// Faults healed; everything must resolve.
    Liveness,
}

/// The whole simulated world of one seed.
pub struct World {
    /// The seed (kept for traces).
    #[allow(dead_code)]
    pub(crate) seed: u64,
    pub(crate) rng: Rng,
    pub(crate) plan: FaultPlan,
    pub(crate) bugs: Bugs,
    production_store_errors: bool,
    trace_on: bool,
    _dir: tempfile::TempDir,
    path: PathBuf,
    pub(crate) rt: tokio::runtime::Runtime,
    ledger: Option<SqliteLedger>,
    /// A second, independent connection to the same file: what it sees is committed.
    witness: Option<SqliteLedger>,
    pub(crate) now: u64,
    pub(crate) step: u64,
    pub(crate) phase: Phase,
    provider: Provider,
    api: StreamApi,
    adapter: AdapterId,
    upgraded: bool,
    catalog: Catalog,
    render_cache: RenderCache,
    toolset: Arc<Toolset>,
    conns: BTreeMap<u64, Conn>,
    conn_next: u64,
    limbo: Vec<Conn>,
    pub(crate) drivers: Vec<Driver>,
    pub(crate) ops: Vec<String>,
    ops_in_round: u64,
    rounds_done: u64,
    rounds: u64,
    crashed: bool,
    /// The store or what executors were shown changed since the last check.
    pub(crate) dirty: bool,
    pub(crate) history: History,
    pub(crate) report: SeedReport,
}

/// Call a ledger method on the current store, synchronously.
macro_rules! store {
    ($world:expr, $method:ident ( $($arg:expr),* $(,)? )) => {{
        let ledger = $world.ledger();
        $world.rt.block_on(ledger.$method($($arg),*))
    }};
}
pub(crate) use store;

fn tools() -> Value {
    json!([{
        "name": "get_weather",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": false
        }
    }])
}

fn prepared_of(record: &DispatchRecord) -> Prepared {
    Prepared {
        revision: record.revision,
        cancel_generation: record.cancel_generation,
        request_digest: record.request_digest.clone(),
    }
}

/// Defence in depth before a commit, as in `serve/driver.rs`.
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

impl World {
    /// Build the world of `seed`: a fresh SQLite file, a conversation waiting for a reply.
    pub fn new(seed: u64, options: Options) -> Result<World, String> {
        let mut rng = Rng::new(seed);
        let plan = FaultPlan::draw(&mut rng);
        let (api, adapter) = match rng.below(4) {
            0 => (StreamApi::OpenAiChat, AdapterId::OpenaiChatV1),
            1 => (StreamApi::OpenAiResponses, AdapterId::OpenaiResponsesV1),
            2 => (StreamApi::AnthropicMessages, AdapterId::AnthropicMessagesV1),
            _ => (StreamApi::Gemini, AdapterId::GeminiV1),
        };
        // tmpfs when there is one: fsync (synchronous=FULL) is then cheap, semantics unchanged.
        let dir = match tempfile::tempdir_in("/dev/shm") {
            Ok(dir) => dir,
            Err(_) => tempfile::tempdir().map_err(|error| error.to_string())?,
        };
        let path = dir.path().join("ledger.db");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|error| error.to_string())?;
        let ledger = SqliteLedger::open(&path, Synchronous::Full).map_err(|error| error.to_string())?;
        let toolset = Arc::new(Toolset::from_json(&tools()).map_err(|error| error.to_string())?);
        let rounds = 1 + rng.below(ROUNDS_MAX);
        let mut world = World {
            seed,
            rng,
            plan,
            bugs: options.bugs,
            production_store_errors: options.production_store_errors,
            trace_on: options.trace,
            _dir: dir,
            path,
            rt,
            ledger: Some(ledger),
            witness: None,
            now: 1_000_000,
            step: 0,
            phase: Phase::Safety,
            provider: Provider::new(api),
            api,
            adapter,
            upgraded: false,
            catalog: Catalog::builtin(),
            render_cache: RenderCache::new(),
            toolset,
            conns: BTreeMap::new(),
            conn_next: 0,
            limbo: Vec::new(),
            drivers: Vec::new(),
            ops: Vec::new(),
            ops_in_round: 0,
            rounds_done: 0,
            rounds,
            crashed: false,
            dirty: true,
            history: History::default(),
            report: SeedReport {
                seed,
                ..SeedReport::default()
            },
        };
        world.witness = Some(SqliteLedger::open(&world.path, Synchronous::Full).map_err(|e| e.to_string())?);
        world.trace(format!(
            "seed {seed}: adapter {} rounds {rounds} plan {:?}",
            adapter.as_str(),
            world.plan
        ));
        let now = world.ts();
        store!(world, create_conversation(CONVERSATION_ID, &tools(), now)).map_err(|e| e.to_string())?;
        let system = json!({"id": "sys", "role": "system", "blocks": [{"id": "sys-b", "kind": "text", "text": "Answer briefly."}]});
        store!(world, append_turn(CONVERSATION_ID, Revision(0), &system, now)).map_err(|e| e.to_string())?;
        world.user_turn(Revision(1))?;
        Ok(world)
    }

    pub(crate) fn ledger(&self) -> &SqliteLedger {
        // Invariant: the ledger is only None inside `crash`, which reopens it before returning.
        match &self.ledger {
            Some(ledger) => ledger,
            None => panic!("ledger used while crashed"),
        }
    }

    /// The independent witness connection (falls back to the ledger if it could not reopen).
    pub(crate) fn witness(&self) -> &SqliteLedger {
        match &self.witness {
            Some(witness) => witness,
            None => self.ledger(),
        }
    }

    pub(crate) fn ts(&self) -> Timestamp {
        Timestamp(self.now)
    }

    pub(crate) fn trace(&mut self, line: String) {
        if self.trace_on {
            self.report
                .trace
                .push(format!("[{} t={}] {line}", self.step, self.now));
        }
    }

    fn user_turn(&mut self, expected: Revision) -> Result<(), String> {
        let id = format!("user-{}", expected.0 + 1);
        let turn = json!({"id": id, "role": "user", "blocks": [{"id": format!("{id}-b"), "kind": "text", "text": "What is the weather?"}]});
        let now = self.ts();
        store!(self, append_turn(CONVERSATION_ID, expected, &turn, now)).map_err(|e| e.to_string())?;
        Ok(())
    }

    /// Render the history up to `revision` with `adapter`: (request digest, body).
    pub(crate) fn render_at(
        &mut self,
        revision: u64,
        adapter: AdapterId,
        operation_id: &str,
        max_output_tokens: Option<u64>,
    ) -> Result<(turnstile_core::manifest::DispatchManifest, Vec<u8>), String> {
        let mut document = store!(self, conversation(CONVERSATION_ID))
            .map_err(|e| e.to_string())?
            .ok_or("no conversation")?;
        if let Some(turns) = document["turns"].as_array_mut() {
            turns.retain(|turn| turn["revision"].as_u64().is_some_and(|r| r <= revision));
        }
        document["revision"] = json!(revision);
        let conversation = Conversation::from_value(document).map_err(|e| format!("{e:?}"))?;
        match validate(&conversation) {
            Verdict::Ready => {}
            other => return Err(format!("history at {revision} is not ready: {}", other.status())),
        }
        let validated = Validated::new(&conversation).map_err(|e| format!("{e:?}"))?;
        let sequence = MessageSequence::build(validated);
        let graph = Graph::new(validated, &sequence).map_err(|e| e.to_string())?;
        let request = PrepareRequest {
            operation_id: operation_id.to_owned(),
            adapter,
            provider: None,
            model: "dst-model".into(),
            max_output_tokens,
            stream: true,
            background: false,
        };
        match prepare(graph, &request, &self.catalog, &mut self.render_cache) {
            PrepareOutcome::Prepared(prepared) => Ok((prepared.manifest, prepared.rendered.body)),
            PrepareOutcome::Paused(pauses) => Err(format!("paused: {pauses:?}")),
            PrepareOutcome::OverBudget(over) => Err(format!("over budget: {over:?}")),
        }
    }

    /// The client starts a new operation at the conversation's current revision.
    fn start_op(&mut self) -> Result<(), String> {
        self.dirty = true;
        let document = store!(self, conversation(CONVERSATION_ID))
            .map_err(|e| e.to_string())?
            .ok_or("no conversation")?;
        let revision = document["revision"].as_u64().unwrap_or(0);
        let operation_id = format!("op-{}", self.ops.len() + 1);
        let adapter = self.adapter;
        let (manifest, bytes) = self.render_at(revision, adapter, &operation_id, None)?;
        let now = self.ts();
        let record = match store!(self, prepare(&manifest, &bytes, now)).map_err(|e| e.to_string())? {
            StorePrepare::Created(record) | StorePrepare::Existing(record) => record,
            other => return Err(format!("prepare refused: {other:?}")),
        };
        self.trace(format!(
            "client starts {operation_id} at revision {revision} with {}",
            adapter.as_str()
        ));
        self.ops.push(operation_id.clone());
        self.ops_in_round += 1;
        let mut driver = self.driver_for(record);
        let _ = driver.machine.start(self.ts());
        self.perform_effects(&mut driver, false);
        self.drivers.push(driver);
        Ok(())
    }

    fn driver_for(&self, record: DispatchRecord) -> Driver {
        let machine = DispatchMachine::new(prepared_of(&record), LEASE_MS);
        Driver {
            op: record.operation_id.clone(),
            record,
            machine,
            assembler: None,
            attempts_started: 0,
            provider_sequence_last: None,
            idempotency_keys: HashMap::new(),
            retracted: HashSet::new(),
            provider_ended: HashSet::new(),
            resume_refused: HashSet::new(),
            resumes: HashMap::new(),
            stopped: false,
            final_retract: false,
        }
    }

    fn provider_recovery(&self) -> ProviderRecovery {
        ProviderRecovery {
            resume_by_handle: self.plan.resume_by_handle && self.api == StreamApi::OpenAiResponses,
            honours_idempotency_key: self.plan.honours_idempotency_key,
        }
    }

    fn recovery_for(&self, driver: &Driver, generation: Generation, clean_end: bool) -> ProviderRecovery {
        let mut recovery = self.provider_recovery();
        if clean_end
            || driver.resume_refused.contains(&generation)
            || driver.resumes.get(&generation).copied().unwrap_or(0) >= RESUMES_PER_GENERATION_MAX
        {
            recovery.resume_by_handle = false;
        }
        recovery
    }

    fn maybe_crash(&mut self) -> bool {
        if self.crashed {
            return true;
        }
        if self.phase == Phase::Safety && self.rng.chance(self.plan.crash) {
            self.crashed = true;
        }
        self.crashed
    }

    fn retract(&mut self, driver: &mut Driver, generation: Generation, reason: &str) {
        if self.bugs.skip_retract {
            return;
        }
        if driver.retracted.insert(generation) {
            self.trace(format!("{} g{} retract ({reason})", driver.op, generation.0));
            self.history.retracted.insert((driver.op.clone(), generation.0));
        }
    }

    fn perform_effects(&mut self, driver: &mut Driver, suppress_interrupt_retract: bool) {
        while let Some(effect) = driver.machine.poll_effect() {
            if self.crashed {
                return;
            }
            match effect {
                Effect::Persist(write) => {
                    if let Some(answer) = self.persist(driver, write) {
                        let _ = driver.machine.handle_store(self.ts(), answer);
                    }
                }
                Effect::Send {
                    generation,
                    idempotency_key,
                    request_digest,
                } => self.send(driver, generation, idempotency_key, &request_digest),
                Effect::Resume { generation, handle } => self.resume(driver, generation, &handle),
                Effect::BindHandle { generation, handle } => self.bind(driver, generation, &handle),
                Effect::Emit(event) => match event {
                    ClientEvent::State { state, generation } => {
                        self.trace(format!(
                            "{} state {state} g{:?}",
                            driver.op,
                            generation.map(|g| g.0)
                        ));
                    }
                    ClientEvent::Retract {
                        reason: "interrupted",
                        ..
                    } if suppress_interrupt_retract => {}
                    ClientEvent::Retract { generation, reason } => self.retract(driver, generation, reason),
                    ClientEvent::Committed { revision } => {
                        self.trace(format!("{} committed at revision {}", driver.op, revision.0));
                    }
                    ClientEvent::Error { code } => self.trace(format!("{} error {code}", driver.op)),
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
                    self.quarantine(driver, generation, reason, content);
                }
                Effect::ExposeToolCalls { revision } => {
                    // Executors read the ledger's ready calls of the committed revision.
                    if let Ok(calls) = store!(self, tool_calls(Some(ToolCallState::Ready))) {
                        for call in calls.into_iter().filter(|call| call.revision == revision) {
                            self.history.exposed.insert(call.call_id);
                        }
                    }
                }
            }
            if self.maybe_crash() {
                return;
            }
        }
    }

    fn quarantine(&mut self, driver: &mut Driver, generation: Generation, reason: &str, content: Value) {
        self.trace(format!("{} g{} quarantine {reason}", driver.op, generation.0));
        self.dirty = true;
        let now = self.ts();
        if self.bugs.commit_late_turn && content.get("role").is_some() {
            // Planted bug: the late turn goes into history without the generation condition.
            let revision = store!(self, conversation(CONVERSATION_ID))
                .ok()
                .flatten()
                .and_then(|doc| doc["revision"].as_u64())
                .unwrap_or(0);
            let _ = store!(
                self,
                append_turn(CONVERSATION_ID, Revision(revision), &content, now)
            );
            return;
        }
        let entry = QuarantineEntry {
            operation_id: driver.op.clone(),
            generation,
            reason: reason.to_owned(),
            content,
        };
        let _ = store!(self, quarantine(&entry, now));
    }

    /// Arm a store fault for the next write, per the plan.
    fn arm_store_fault(&mut self) {
        if self.phase == Phase::Safety && self.rng.chance(self.plan.store_drop) {
            let fault = if self.rng.chance(0.5) {
                self.report.fault(FaultKind::StoreDropBeforeCommit);
                Fault::DropBeforeCommit
            } else {
                self.report.fault(FaultKind::StoreDropAfterCommit);
                Fault::DropAfterCommit
            };
            self.ledger().faults().arm(fault);
        }
    }

    fn persist(&mut self, driver: &mut Driver, write: Write) -> Option<StoreAnswer> {
        self.dirty = true;
        let operation_id = driver.op.clone();
        let now = self.ts();
        let lease = |expires_at| Lease {
            holder: HOLDER.to_owned(),
            expires_at,
        };
        let awaited = matches!(
            write,
            Write::Begin { .. } | Write::Replay { .. } | Write::AbandonAndRearm { .. } | Write::Commit { .. }
        );
        let error = match write {
            Write::Begin {
                expected_revision,
                expected_cancel_generation,
                lease_expires_at,
            } => {
                if driver.gave_up() {
                    self.trace(format!("{operation_id} attempts exhausted"));
                    return None;
                }
                if self.bugs.send_before_persist {
                    // Planted bug: the request goes out before the begin write.
                    let body = driver.record.request_bytes.clone();
                    self.check_send(&operation_id, None, &body);
                }
                let expect = BeginExpect {
                    revision: expected_revision,
                    cancel_generation: expected_cancel_generation,
                };
                self.arm_store_fault();
                match store!(
                    self,
                    begin_attempt(&operation_id, expect, &lease(lease_expires_at), now)
                ) {
                    Ok(BeginOutcome::Began {
                        generation,
                        idempotency_key,
                    }) => {
                        driver.attempts_started += 1;
                        driver
                            .idempotency_keys
                            .insert(generation, idempotency_key.clone());
                        return Some(StoreAnswer::Began {
                            generation,
                            idempotency_key,
                        });
                    }
                    Ok(BeginOutcome::Refused { .. }) => {
                        driver.stopped = true;
                        return Some(StoreAnswer::BeginRefused);
                    }
                    Err(error) => error,
                }
            }
            Write::Transition { generation, from, to } => {
                self.arm_store_fault();
                match store!(self, transition(&operation_id, generation, from, to, now)) {
                    Ok(TransitionOutcome::Applied) => return None,
                    Ok(TransitionOutcome::Refused { .. }) => return Some(StoreAnswer::TransitionRefused),
                    Err(error) => error,
                }
            }
            Write::Replay {
                generation,
                lease_expires_at,
            } => {
                self.arm_store_fault();
                match store!(
                    self,
                    replay_attempt(&operation_id, generation, &lease(lease_expires_at), now)
                ) {
                    Ok(TransitionOutcome::Applied) => {
                        let key = match driver.idempotency_keys.get(&generation) {
                            Some(key) => key.clone(),
                            None => store!(self, attempts(&operation_id))
                                .unwrap_or_default()
                                .into_iter()
                                .find(|attempt| attempt.generation == generation)
                                .map(|attempt| attempt.idempotency_key)
                                .unwrap_or_default(),
                        };
                        return Some(StoreAnswer::Replayed {
                            generation,
                            idempotency_key: key,
                        });
                    }
                    Ok(TransitionOutcome::Refused { .. }) => {
                        driver.stopped = true;
                        return Some(StoreAnswer::TransitionRefused);
                    }
                    Err(error) => error,
                }
            }
            Write::AbandonAndRearm { generation } => {
                let ended = driver.provider_ended.contains(&generation);
                self.arm_store_fault();
                match store!(self, abandon_and_rearm(&operation_id, generation, ended, now)) {
                    Ok(TransitionOutcome::Applied) => return Some(StoreAnswer::Rearmed),
                    Ok(TransitionOutcome::Refused { .. }) => {
                        driver.stopped = true;
                        return Some(StoreAnswer::TransitionRefused);
                    }
                    Err(error) => error,
                }
            }
            Write::RenewLease {
                generation,
                lease_expires_at,
            } => {
                self.arm_store_fault();
                match store!(
                    self,
                    renew_lease(&operation_id, generation, &lease(lease_expires_at))
                ) {
                    Ok(TransitionOutcome::Applied) => return None,
                    Ok(TransitionOutcome::Refused { .. }) => return Some(StoreAnswer::LeaseLost),
                    Err(error) => error,
                }
            }
            Write::Commit {
                generation,
                expected_revision,
                turn,
            } => {
                self.arm_store_fault();
                match store!(
                    self,
                    commit(&operation_id, generation, expected_revision, &turn, now)
                ) {
                    Ok(CommitOutcome::Committed { revision, .. }) => {
                        return Some(StoreAnswer::Committed { revision });
                    }
                    Ok(CommitOutcome::Refused(_) | CommitOutcome::Rejected(_)) => {
                        return Some(StoreAnswer::CommitRefused);
                    }
                    Err(error) => error,
                }
            }
            Write::Cancel {
                expected_cancel_generation,
            } => {
                self.arm_store_fault();
                match store!(self, cancel(&operation_id, Some(expected_cancel_generation), now)) {
                    Ok(_) => return None,
                    Err(error) => error,
                }
            }
        };
        // As the gateway: a store error leaves the outcome unknown; the lease decides.
        self.trace(format!("{operation_id} store error: {error}"));
        if awaited && !self.production_store_errors {
            // The machine will never get its answer: stop (retracting the preview, since this
            // driver will not commit it), so the lease sweep can take over.
            driver.stopped = true;
            if let Some(generation) = driver.machine.generation() {
                self.retract(driver, generation, "store_unavailable");
            }
        }
        None
    }

    fn open_connection(&mut self, op: &str, generation: Generation, answer: Answer, resume: bool) {
        let id = self.conn_next;
        self.conn_next += 1;
        self.conns.insert(
            id,
            Conn {
                op: op.to_owned(),
                generation,
                decoder: self.api.decoder(),
                status: answer.status,
                head_delivered: false,
                saw_event: false,
                resume,
                chunks: answer.chunks,
                clean_end: answer.clean_end,
                side: None,
            },
        );
    }

    fn send(
        &mut self,
        driver: &mut Driver,
        generation: Generation,
        idempotency_key: String,
        request_digest: &str,
    ) {
        if Digest::of_bytes(&driver.record.request_bytes).as_str() != request_digest {
            self.trace(format!(
                "{} stored bytes do not match the manifest; not sent",
                driver.op
            ));
            let _ = driver
                .machine
                .handle_provider(self.ts(), generation, ProviderInput::Rejected);
            return;
        }
        let mut body = driver.record.request_bytes.clone();
        if self.bugs.rerender_on_retry && self.history.sent_ops.contains(&driver.op) {
            // Planted bug: a retry renders afresh with whatever adapter is configured now.
            let revision = driver.record.revision.0;
            let adapter = self.adapter;
            if let Ok((_, fresh)) = self.render_at(revision, adapter, &driver.op.clone(), None) {
                body = fresh;
            }
        }
        self.check_send(&driver.op, Some(generation), &body);
        self.history.sent_ops.insert(driver.op.clone());
        self.report.sends += 1;
        self.trace(format!(
            "{} g{} send {} bytes key {idempotency_key}",
            driver.op,
            generation.0,
            body.len()
        ));
        driver.assembler = Some(self.new_assembler(driver, generation, None));
        driver.provider_sequence_last = None;
        let (rng, plan, report) = (&mut self.rng, &self.plan, &mut self.report);
        let answer = self.provider.request(rng, plan, report, &body, &idempotency_key);
        let op = driver.op.clone();
        self.open_connection(&op, generation, answer, false);
        // An older stream of this dispatch, kept alive across a crash, delivers again now.
        let mut index = 0;
        while index < self.limbo.len() {
            if self.limbo[index].op == op && self.limbo[index].generation < generation {
                let conn = self.limbo.swap_remove(index);
                self.report.fault(FaultKind::OldStreamResumed);
                self.trace(format!("{op} old stream of g{} resumes", conn.generation.0));
                let id = self.conn_next;
                self.conn_next += 1;
                self.conns.insert(id, conn);
            } else {
                index += 1;
            }
        }
    }

    fn new_assembler(
        &mut self,
        driver: &Driver,
        generation: Generation,
        handle_bound: Option<String>,
    ) -> Assembler {
        let mut config = AssemblerConfig::new(generation, format!("{}.g{}", driver.op, generation.0));
        config.toolset = Some(self.toolset.clone());
        config.call_ids_taken = self.call_ids_taken();
        config.handle_bound = handle_bound;
        Assembler::new(config)
    }

    fn call_ids_taken(&mut self) -> HashSet<String> {
        let mut taken = HashSet::new();
        if let Ok(Some(document)) = store!(self, conversation(CONVERSATION_ID)) {
            for turn in document["turns"].as_array().into_iter().flatten() {
                for block in turn["blocks"].as_array().into_iter().flatten() {
                    if let Some(call_id) = block["call_id"].as_str() {
                        taken.insert(call_id.to_owned());
                    }
                }
            }
        }
        taken
    }

    fn resume(&mut self, driver: &mut Driver, generation: Generation, handle: &str) {
        match &mut driver.assembler {
            Some(assembler) if assembler.generation() == generation => assembler.handle_connection_start(),
            _ => driver.assembler = Some(self.new_assembler(driver, generation, Some(handle.to_owned()))),
        }
        *driver.resumes.entry(generation).or_default() += 1;
        self.trace(format!("{} g{} resume {handle}", driver.op, generation.0));
        let (rng, plan, report) = (&mut self.rng, &self.plan, &mut self.report);
        let answer = self
            .provider
            .resume(rng, plan, report, handle, driver.provider_sequence_last);
        let op = driver.op.clone();
        self.open_connection(&op, generation, answer, true);
    }

    fn bind(&mut self, driver: &mut Driver, generation: Generation, handle: &str) {
        self.dirty = true;
        let now = self.ts();
        self.arm_store_fault();
        match store!(self, bind_handle(&driver.op, generation, handle, now)) {
            Ok(BindOutcome::Refused { .. }) => {
                self.history.bind_refusals += if self.bugs.miscount_foreign_handles { 2 } else { 1 };
                self.trace(format!(
                    "{} g{} handle {handle} refused (foreign)",
                    driver.op, generation.0
                ));
                let op = driver.op.clone();
                self.conns
                    .retain(|_, conn| !(conn.op == op && conn.generation == generation));
                let _ = driver
                    .machine
                    .handle_provider(self.ts(), generation, ProviderInput::Interrupted);
                self.after_interruption(driver, generation, false);
            }
            Ok(_) => {}
            Err(error) => {
                self.history.bind_ambiguous += 1;
                self.trace(format!("{} bind_handle failed: {error}", driver.op));
            }
        }
    }

    /// Deliver the next piece of connection `id` to its dispatch's driver.
    fn deliver(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let op = conn.op.clone();
        let Some(index) = self.drivers.iter().position(|driver| driver.op == op) else {
            // Nobody listens any more (the driver finished): the connection is dropped.
            self.conns.remove(&id);
            return;
        };
        let mut driver = self.drivers.swap_remove(index);
        self.transport_event(&mut driver, id);
        self.drivers.push(driver);
    }

    fn transport_event(&mut self, driver: &mut Driver, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let generation = conn.generation;
        if !conn.head_delivered {
            conn.head_delivered = true;
            if (200..300).contains(&conn.status) {
                let _ = driver
                    .machine
                    .handle_provider(self.ts(), generation, ProviderInput::Accepted);
                self.perform_effects(driver, false);
            }
            return;
        }
        if let Some(chunk) = conn.chunks.pop_front() {
            if !(200..300).contains(&conn.status) {
                return;
            }
            conn.decoder.handle_bytes(&chunk);
            self.drain_decoder(driver, id);
            return;
        }
        // The end of the body: clean, or a broken connection.
        let clean_end = conn.clean_end;
        let status = conn.status;
        let is_resume = conn.resume;
        if clean_end {
            conn.decoder.handle_end_of_input();
        }
        self.drain_decoder(driver, id);
        if self.crashed {
            return;
        }
        let saw_event = self.conns.remove(&id).is_some_and(|conn| conn.saw_event);
        if driver.machine.generation() != Some(generation) || driver.machine.state().is_terminal() {
            return;
        }
        let failed = !(200..300).contains(&status);
        if is_resume && (failed || !saw_event) {
            driver.resume_refused.insert(generation);
        } else if failed {
            self.trace(format!(
                "{} g{} provider status {status}",
                driver.op, generation.0
            ));
            let _ = driver
                .machine
                .handle_provider(self.ts(), generation, ProviderInput::Rejected);
            self.perform_effects(driver, false);
            return;
        }
        let resumable = self.recovery_for(driver, generation, clean_end).resume_by_handle
            && driver
                .assembler
                .as_ref()
                .is_some_and(|assembler| assembler.handle().is_some());
        if !resumable {
            if let Some(assembler) = &mut driver.assembler {
                assembler.handle_end_of_input();
            }
            self.drain_assembler(driver, generation);
            if self.crashed {
                return;
            }
        }
        if driver.machine.state().is_terminal() || driver.machine.generation() != Some(generation) {
            return;
        }
        if matches!(
            driver.machine.state(),
            DispatchState::Dispatching | DispatchState::Sent | DispatchState::Streaming
        ) {
            let _ = driver
                .machine
                .handle_provider(self.ts(), generation, ProviderInput::Interrupted);
            self.after_interruption(driver, generation, clean_end);
        }
    }

    fn after_interruption(&mut self, driver: &mut Driver, generation: Generation, provider_ended: bool) {
        if self.crashed {
            return;
        }
        let attempts = store!(self, attempts(&driver.op)).unwrap_or_default();
        let Some(record) = attempts
            .into_iter()
            .find(|attempt| attempt.generation == generation)
        else {
            self.perform_effects(driver, false);
            return;
        };
        let attempt = UnknownAttempt {
            generation,
            handle: record.handle.clone().or_else(|| {
                driver
                    .assembler
                    .as_ref()
                    .and_then(|a| a.handle().map(str::to_owned))
            }),
            idempotency_key: record.idempotency_key.clone(),
            lease_expires_at: record.lease_expires_at,
            provider_confirmed_ended: provider_ended,
        };
        if provider_ended {
            driver.provider_ended.insert(generation);
        }
        let recovery = self.recovery_for(driver, generation, provider_ended);
        let decision = recovery_decision(&attempt, recovery, self.ts());
        let resuming = matches!(decision, RecoveryDecision::ResumeByHandle { .. });
        self.perform_effects(driver, resuming);
        if self.crashed {
            return;
        }
        if driver.gave_up() && !resuming {
            self.trace(format!("{} attempts exhausted: cancel", driver.op));
            let _ = driver.machine.handle_cancel(self.ts());
            self.perform_effects(driver, false);
            return;
        }
        if !resuming {
            driver.assembler = None;
        }
        let assembler = driver.assembler.take();
        driver.machine = DispatchMachine::recover(
            self.ts(),
            prepared_of(&driver.record),
            LEASE_MS,
            &attempt,
            recovery,
        );
        driver.assembler = assembler;
        self.perform_effects(driver, false);
    }

    fn drain_decoder(&mut self, driver: &mut Driver, id: u64) {
        loop {
            if self.crashed {
                return;
            }
            let Some(conn) = self.conns.get_mut(&id) else {
                return;
            };
            let generation = conn.generation;
            let Some(sequenced) = conn.decoder.poll_event() else {
                break;
            };
            if !conn.saw_event {
                conn.saw_event = true;
                let _ = driver
                    .machine
                    .handle_provider(self.ts(), generation, ProviderInput::FirstEvent);
                self.perform_effects(driver, false);
                if self.crashed {
                    return;
                }
            }
            if sequenced.seq.source == SeqSource::Provider {
                driver.provider_sequence_last = Some(
                    driver
                        .provider_sequence_last
                        .map_or(sequenced.seq.number, |last| last.max(sequenced.seq.number)),
                );
            }
            if let StreamEvent::Handle { handle } = &sequenced.event {
                let _ = driver.machine.handle_provider(
                    self.ts(),
                    generation,
                    ProviderInput::Handle(handle.clone()),
                );
                self.perform_effects(driver, false);
                if self.crashed {
                    return;
                }
            }
            if self.bugs.commit_late_turn
                && driver
                    .assembler
                    .as_ref()
                    .is_some_and(|assembler| assembler.generation() != generation)
            {
                self.commit_late(driver, id, generation, sequenced);
                continue;
            }
            let Some(assembler) = &mut driver.assembler else {
                continue;
            };
            match assembler.handle_event(generation, sequenced) {
                Disposition::Quarantined(material) => {
                    let content = serde_json::to_value(&*material).unwrap_or(Value::Null);
                    self.quarantine(driver, material.generation, "foreign_generation", content);
                }
                Disposition::Accepted | Disposition::Ignored(_) => {}
            }
            self.drain_assembler(driver, generation);
        }
    }

    /// Planted bug: assemble an old generation's stream on its own and append its turn with
    /// `append_turn` (conditional on the revision only, not on the active generation).
    fn commit_late(
        &mut self,
        driver: &mut Driver,
        id: u64,
        generation: Generation,
        sequenced: turnstile_core::stream::Sequenced,
    ) {
        let fresh = self.new_assembler(driver, generation, None);
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let side = conn.side.get_or_insert(fresh);
        let _ = side.handle_event(generation, sequenced);
        let mut turns = Vec::new();
        while let Some(output) = side.poll_output() {
            if let Output::Commit(offer) = output {
                turns.push(offer.turn);
            }
        }
        for turn in turns {
            let now = self.ts();
            let revision = store!(self, conversation(CONVERSATION_ID))
                .ok()
                .flatten()
                .and_then(|doc| doc["revision"].as_u64())
                .unwrap_or(0);
            let outcome = store!(self, append_turn(CONVERSATION_ID, Revision(revision), &turn, now));
            self.trace(format!(
                "{} g{} late turn appended: {outcome:?}",
                driver.op, generation.0
            ));
            self.dirty = true;
        }
    }

    fn drain_assembler(&mut self, driver: &mut Driver, generation: Generation) {
        loop {
            if self.crashed {
                return;
            }
            let Some(assembler) = &mut driver.assembler else {
                return;
            };
            let Some(output) = assembler.poll_output() else {
                return;
            };
            match output {
                Output::Preview { generation, .. } => {
                    self.history.previewed.insert((driver.op.clone(), generation.0));
                }
                Output::Retract { generation, reason } => {
                    if matches!(reason, RetractReason::MaxTokensInToolArguments { .. }) {
                        driver.final_retract = true;
                    }
                    self.retract(driver, generation, reason.code())
                }
                Output::Commit(offer) => {
                    let mut turn = offer.turn;
                    if self.bugs.expose_before_commit {
                        for call in &offer.calls {
                            self.history.exposed.insert(call.call_id.clone());
                        }
                        self.dirty = true;
                    }
                    if self.bugs.commit_partial_arguments
                        && let Some(blocks) = turn["blocks"].as_array_mut()
                    {
                        for block in blocks.iter_mut().filter(|block| block["kind"] == "tool_call") {
                            let text = match &block["arguments"] {
                                Value::String(text) => text.clone(),
                                other => other.to_string(),
                            };
                            block["arguments"] =
                                json!({"city": text.chars().take(3).collect::<String>(), "cut": true});
                        }
                    }
                    if !tool_arguments_complete(&turn) {
                        self.report.partial_tool_dispatch += 1;
                        continue;
                    }
                    let _ = driver.machine.handle_provider(
                        self.ts(),
                        generation,
                        ProviderInput::Completed { turn },
                    );
                    self.perform_effects(driver, false);
                }
            }
        }
    }

    /// Crash the gateway: drop every in-memory part, reopen the same file, recover.
    fn crash(&mut self) {
        self.crashed = false;
        self.dirty = true;
        self.report.fault(FaultKind::Crash);
        self.trace("CRASH: memory dropped, ledger reopened".into());
        // Clients' streams are cut: whatever preview they saw is void (the client contract).
        for driver in &self.drivers {
            for (op, generation) in self.history.previewed.iter() {
                if *op == driver.op {
                    self.history.retracted.insert((op.clone(), *generation));
                }
            }
        }
        self.drivers.clear();
        let conns = std::mem::take(&mut self.conns);
        for (_, conn) in conns {
            if conn.status == 200 && !conn.chunks.is_empty() && self.rng.chance(self.plan.old_stream) {
                self.limbo.push(conn);
            }
        }
        self.ledger = None;
        self.witness = None;
        match SqliteLedger::open(&self.path, Synchronous::Full) {
            Ok(ledger) => {
                self.ledger = Some(ledger);
                self.witness = SqliteLedger::open(&self.path, Synchronous::Full).ok();
            }
            Err(error) => {
                let step = self.step;
                self.report
                    .violate(step, Invariant::Panic, format!("reopen failed: {error}"));
                return;
            }
        }
        if self.plan.adapter_upgrade && !self.upgraded {
            self.upgraded = true;
            let upgraded = match self.adapter {
                AdapterId::OpenaiChatV1 => AdapterId::OpenaiChatV2,
                AdapterId::AnthropicMessagesV1 => AdapterId::AnthropicMessagesV2,
                other => other,
            };
            if upgraded != self.adapter {
                self.report.fault(FaultKind::AdapterUpgrade);
                self.trace(format!(
                    "adapter upgraded {} -> {}",
                    self.adapter.as_str(),
                    upgraded.as_str()
                ));
                self.adapter = upgraded;
            }
        }
        self.recover(HOLDER);
        // Clients retry operations still PREPARED (the gateway attaches and drives them).
        for op in self.ops.clone() {
            if let Ok(Some(record)) = store!(self, dispatch(&op))
                && record.state == DispatchState::Prepared
                && !self.drivers.iter().any(|driver| driver.op == op)
            {
                let mut driver = self.driver_for(record);
                let _ = driver.machine.start(self.ts());
                self.perform_effects(&mut driver, false);
                self.drivers.push(driver);
                if self.crashed {
                    return;
                }
            }
        }
    }

    /// Start-up recovery (`serve/mod.rs::recover`), also the lease sweep with [`SWEEP_HOLDER`].
    fn recover(&mut self, holder: &str) {
        let now = self.ts();
        let Ok(report) = store!(self, recover_startup(holder, now)) else {
            return;
        };
        let mut seen = HashSet::new();
        for attempt in report.unknown {
            if !seen.insert(attempt.operation_id.clone())
                || self
                    .drivers
                    .iter()
                    .any(|driver| driver.op == attempt.operation_id)
            {
                continue;
            }
            let Ok(Some(record)) = store!(self, dispatch(&attempt.operation_id)) else {
                continue;
            };
            if record.state != DispatchState::Unknown || record.active_generation != Some(attempt.generation)
            {
                continue;
            }
            let unknown = UnknownAttempt {
                generation: attempt.generation,
                handle: attempt.handle.clone(),
                idempotency_key: attempt.idempotency_key.clone(),
                lease_expires_at: attempt.lease_expires_at,
                provider_confirmed_ended: false,
            };
            self.trace(format!(
                "{} recovered in UNKNOWN g{}",
                record.operation_id, attempt.generation.0
            ));
            let recovery = self.provider_recovery();
            let mut driver = self.driver_for(record);
            driver.machine = DispatchMachine::recover(
                self.ts(),
                prepared_of(&driver.record),
                LEASE_MS,
                &unknown,
                recovery,
            );
            self.perform_effects(&mut driver, false);
            self.drivers.push(driver);
            if self.crashed {
                return;
            }
        }
    }

    /// One scheduling step. False when nothing is left to do.
    fn schedule(&mut self) -> bool {
        self.drivers.retain(|driver| !driver.finished());
        // Timers that are due fire first.
        let due = self
            .drivers
            .iter()
            .enumerate()
            .filter_map(|(index, driver)| driver.machine.poll_timeout().map(|at| (at, index)))
            .filter(|(_, index)| {
                !(self.bugs.no_lease_timer && self.drivers[*index].machine.state() == DispatchState::Unknown)
            })
            .min();
        if !self.conns.is_empty() {
            if let Some((at, index)) = due
                && at.0 <= self.now
            {
                self.fire(index);
                return true;
            }
            let ids: Vec<u64> = self.conns.keys().copied().collect();
            let id = ids[self.rng.index(ids.len())];
            self.now += self.rng.below(DELIVERY_MS_MAX);
            self.deliver(id);
            return true;
        }
        if let Some((at, index)) = due {
            self.now = self.now.max(at.0);
            self.fire(index);
            return true;
        }
        // Nothing scheduled: the lease sweep finds attempts whose lease ran out.
        self.sweep()
    }

    fn fire(&mut self, index: usize) {
        let mut driver = self.drivers.swap_remove(index);
        let _ = driver.machine.handle_timeout(self.ts());
        self.perform_effects(&mut driver, false);
        self.drivers.push(driver);
    }

    fn sweep(&mut self) -> bool {
        let mut expiry: Option<u64> = None;
        for op in self.ops.clone() {
            if self.drivers.iter().any(|driver| driver.op == op) {
                continue;
            }
            for attempt in store!(self, attempts(&op)).unwrap_or_default() {
                if attempt.state.is_live() {
                    let at = attempt.lease_expires_at.0;
                    expiry = Some(expiry.map_or(at, |e: u64| e.min(at)));
                }
            }
        }
        let Some(at) = expiry else {
            return false;
        };
        let drivers_before = self.drivers.len();
        self.now = self.now.max(at);
        self.trace("lease sweep".into());
        self.recover(SWEEP_HOLDER);
        self.drivers.len() > drivers_before || self.crashed
    }

    /// The client's next move when the system is quiet. False when the run is over.
    fn client_next(&mut self) -> Result<bool, String> {
        if self.rounds_done >= self.rounds {
            return Ok(false);
        }
        let Some(op) = self.ops.last().cloned() else {
            self.start_op()?;
            return Ok(true);
        };
        let record = store!(self, dispatch(&op))
            .map_err(|e| e.to_string())?
            .ok_or("lost dispatch")?;
        if record.state.is_live() {
            // Still live without a driver or timer: nothing the client can do.
            return Ok(false);
        }
        let document = store!(self, conversation(CONVERSATION_ID))
            .map_err(|e| e.to_string())?
            .ok_or("no conversation")?;
        let last_role = document["turns"]
            .as_array()
            .and_then(|turns| turns.last())
            .map(|turn| turn["role"].clone())
            .unwrap_or(Value::Null);
        if last_role == "assistant" {
            // Some operation's reply committed (not necessarily the last one started).
            self.tool_results()?;
            self.rounds_done += 1;
            self.ops_in_round = 0;
        } else if self.ops_in_round >= OPS_PER_ROUND_MAX {
            self.rounds_done += 1;
            self.ops_in_round = 0;
        }
        if self.rounds_done >= self.rounds {
            return Ok(false);
        }
        self.start_op()?;
        Ok(true)
    }

    /// Executors run the committed calls and clients offer results in any order, with orphan
    /// and duplicate results; without calls the user says something new.
    fn tool_results(&mut self) -> Result<(), String> {
        self.dirty = true;
        let mut calls: Vec<String> = store!(self, tool_calls(Some(ToolCallState::Ready)))
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|call| call.call_id)
            .collect();
        let now = self.ts();
        if calls.is_empty() {
            let revision = store!(self, conversation(CONVERSATION_ID))
                .map_err(|e| e.to_string())?
                .and_then(|doc| doc["revision"].as_u64())
                .unwrap_or(0);
            return self.user_turn(Revision(revision));
        }
        self.rng.shuffle(&mut calls);
        if self.rng.chance(self.plan.orphan_result) {
            self.report.fault(FaultKind::OrphanResult);
            let position = self.rng.index(calls.len() + 1);
            calls.insert(position, format!("orphan-{}", self.rng.below(1000)));
        }
        let content = json!([{"kind": "text", "text": "18C and sunny"}]);
        for call_id in calls {
            let lease = Lease {
                holder: "executor".into(),
                expires_at: Timestamp(self.now + LEASE_MS),
            };
            let claim = match store!(self, claim_tool_call(CONVERSATION_ID, &call_id, &lease, now)) {
                Ok(ClaimOutcome::Claimed { claim }) => claim,
                _ => 1,
            };
            let outcome = store!(
                self,
                submit_tool_result(CONVERSATION_ID, &call_id, claim, "success", &content, now)
            );
            self.trace(format!("client result for {call_id}: {outcome:?}"));
            if self.rng.chance(self.plan.duplicate_result) {
                self.report.fault(FaultKind::DuplicateResult);
                let again = store!(
                    self,
                    submit_tool_result(CONVERSATION_ID, &call_id, claim, "success", &content, now)
                );
                self.trace(format!("client duplicate result for {call_id}: {again:?}"));
            }
            self.step += 1;
            self.dirty = true;
            self.check();
        }
        Ok(())
    }

    /// Run both phases, checking after every step; returns the seed's report.
    pub fn run(mut self) -> SeedReport {
        if let Err(error) = self.start_op() {
            let step = self.step;
            self.report
                .violate(step, Invariant::Panic, format!("setup: {error}"));
            return self.report;
        }
        self.check();
        for phase in [Phase::Safety, Phase::Liveness] {
            self.phase = phase;
            let phase_start = self.now;
            if phase == Phase::Liveness {
                self.plan = self.plan.healed();
                self.trace("LIVENESS: faults healed".into());
            }
            let mut steps = 0;
            while steps < STEPS_PER_PHASE_MAX {
                steps += 1;
                self.step += 1;
                if self.crashed {
                    self.crash();
                } else if !self.schedule() {
                    if phase == Phase::Liveness {
                        break;
                    }
                    match self.client_next() {
                        Ok(true) => {}
                        Ok(false) => break,
                        Err(error) => {
                            let step = self.step;
                            self.report
                                .violate(step, Invariant::Panic, format!("client: {error}"));
                            break;
                        }
                    }
                }
                self.check();
                if phase == Phase::Liveness
                    && self.now > phase_start + LEASE_MS + EPSILON_MS
                    && self.unknown_count() > 0
                {
                    break;
                }
            }
            if self.crashed {
                self.crash();
            }
        }
        self.final_checks();
        self.report.steps = self.step;
        self.report
    }
}
