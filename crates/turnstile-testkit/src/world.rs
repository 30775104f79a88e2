//! The simulation world: the gateway's own dispatch driver ([`turnstile_drive::Drive`]), the
//! real adapters (render, manifest) and the real SQLite ledger on a temporary file, pumped by a
//! synchronous, single-threaded loop over a virtual clock. Only the world around the driver is
//! simulated: the scheduler, the clock, the scripted [`Provider`], faults and crashes. The
//! driver's store operations go through the same mapping the gateway uses
//! (`turnstile_store::drive::perform`); start-up recovery and the lease sweep choose what to
//! recover with the same function (`turnstile_store::drive::recoverable`). This file holds no
//! dispatch decision of its own; planted bugs are hooks here, on the pump's side.
//!
//! One step is one scheduling choice of the seed: deliver the next piece (head, chunk, end) of
//! one open provider connection (connections interleave in any order), fire the earliest
//! timer, or sweep expired leases. A crash may follow any action: every in-memory part is
//! dropped, the same SQLite file is reopened and start-up recovery runs.

use crate::plan::{Bugs, FaultKind, FaultPlan};
use crate::provider::{Answer, Provider};
use crate::report::{Invariant, SeedReport};
use crate::rng::Rng;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use turnstile_adapters::decode::{Decoder, StreamApi};
use turnstile_adapters::{AdapterId, Catalog, Graph, PrepareOutcome, PrepareRequest, prepare};
use turnstile_core::assemble::{Assembler, AssemblerConfig, Output, Toolset};
use turnstile_core::dispatch::{DispatchState, ProviderRecovery, Timestamp};
use turnstile_core::{Conversation, Generation, MessageSequence, Revision, Validated, Verdict, validate};
use turnstile_drive::{
    Action, ConnectionId, Count, Drive, DriveEvent, DriveSpec, Ending, Request, StoreOp, StoreResult,
    Timeouts,
};
use turnstile_store::{
    CallClaimOutcome, ClaimOutcome, DispatchRecord, Fault, Lease, Ledger, PrepareOutcome as StorePrepare,
    ResultOutcome, SqliteLedger, StoreClock, Synchronous, ToolCallState,
};

/// Gateway replicas sharing the store in every seed.
pub const REPLICAS: usize = 2;
/// The holder id the lease sweep uses (as `serve/mod.rs`).
pub const SWEEP_HOLDER: &str = "turnstile-sweep";
/// Attempt lease.
pub const LEASE_MS: u64 = 5_000;
/// How often each replica sweeps (the gateway's own period for this lease).
pub const SWEEP_PERIOD_MS: u64 = turnstile_store::drive::sweep_period_ms(LEASE_MS);
/// Slack on "every UNKNOWN resolves within lease + ε" in the liveness phase.
pub const EPSILON_MS: u64 = 1_000;
/// Liveness: once faults heal, every operation is terminal within this much virtual time. An
/// attempt in flight may stream up to its deadline, its lease then runs out, and a sweep
/// (every [`SWEEP_PERIOD_MS`]) finds it.
pub const LIVENESS_BOUND_MS: u64 = TIMEOUTS.attempt_ms + LEASE_MS + SWEEP_PERIOD_MS + EPSILON_MS;
/// The conversation every seed works on.
/// In the proxy's id space (`proxy-`), so a proxied follow-up request can continue it.
pub const CONVERSATION_ID: &str = "proxy-dst-conversation";
/// The model of every dispatch's own target, and of its failover target when it has one.
pub const PRIMARY_MODEL: &str = "dst-model";
/// The failover target's model.
pub const FALLBACK_MODEL: &str = "dst-fallback";
/// Most steps of one phase (a run that needs more is a liveness finding).
pub const STEPS_PER_PHASE_MAX: u64 = 600;
/// Most client rounds (dispatch, then tool results) per seed.
pub const ROUNDS_MAX: u64 = 3;
/// Most operations a client starts for one round before moving on.
pub const OPS_PER_ROUND_MAX: u64 = 3;
/// The driver's attempt budget (re-exported for the checker).
pub const ATTEMPTS_PER_DISPATCH_MAX: u64 = turnstile_drive::ATTEMPTS_PER_DISPATCH_MAX;
/// The driver's bounds on every wait, in virtual time. The head bound is the gateway's
/// default, longer than a lease: a connection that waits for its head outlives the lease it
/// began under, so a holder cut off from the store must stop on its own (issue 47). Idle stays
/// short: pings do not extend it, so an endless stream ends there.
pub const TIMEOUTS: Timeouts = Timeouts {
    head_ms: 30_000,
    idle_ms: 2_000,
    attempt_ms: 60_000,
};
/// Share of seeds whose follow-up requests go through the drop-in proxy.
pub const PROXY_SEEDS: f64 = 0.35;
/// Salt of the proxy draw's own random stream.
const PROXY_SEED_SALT: u64 = 0x7072_6f78_795f_7365;
/// Virtual time one delivery may take.
const DELIVERY_MS_MAX: u64 = 40;
/// Salt of the store stall's own random stream ("stall").
const STALL_SEED_SALT: u64 = 0x7374_616c_6c00_0000;

/// How a world is set up besides its seed.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Keep a trace of every step.
    pub trace: bool,
    /// Planted bugs (all off for a real run).
    pub bugs: Bugs,
}

/// One provider connection as the gateway's transport sees it.
pub(crate) struct Conn {
    pub(crate) op: String,
    pub(crate) generation: Generation,
    /// The replica whose transport holds it.
    pub(crate) replica: usize,
    /// The head never arrives.
    hang: bool,
    /// Pings for ever after the chunks.
    endless: bool,
    /// The driver's number for it (None: a stray stream no live driver opened).
    pub(crate) connection: Option<ConnectionId>,
    /// A status or cancel question about the response, not the response itself.
    pub(crate) probe: bool,
    status: u16,
    head_delivered: bool,
    chunks: std::collections::VecDeque<Vec<u8>>,
    clean_end: bool,
    /// Planted bug `commit_late_turn` only: a decoder and assembler of the stream's own
    /// (old) generation, outside the driver.
    side: Option<(Box<dyn Decoder>, Assembler)>,
}

/// One live driver and its dispatch.
pub(crate) struct SimDriver {
    pub(crate) op: String,
    pub(crate) drive: Drive,
    /// The replica running it.
    pub(crate) replica: usize,
}

/// One replica cut off from the store (its store operations fail, its provider connections go
/// on) during `[from, until)` of the safety phase, in virtual time.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Partition {
    pub(crate) replica: usize,
    pub(crate) from: u64,
    pub(crate) until: u64,
}

/// One replica stopped (a stop-the-world pause, a frozen VM) during `[from, until)` of the
/// safety phase: nothing of it runs (timers, sweeps, provider bytes wait; its connections stay
/// open at the provider), then it goes on with its clock jumped forward.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pause {
    pub(crate) replica: usize,
    pub(crate) from: u64,
    pub(crate) until: u64,
}

/// One replica's store stalled during `[from, until)` of the safety phase: every store
/// operation its drivers issue then is answered when the store unblocks at `until` (applied, or
/// lost with its connection), unless the driver's `store_wait_deadline` comes first.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StoreStall {
    pub(crate) replica: usize,
    pub(crate) from: u64,
    pub(crate) until: u64,
}

/// A stalled store operation on its way: at `at` the store applies it (`lands`) or its
/// connection is lost, whatever became of the driver that issued it.
struct InFlight {
    id: u64,
    op_name: String,
    replica: usize,
    holder: String,
    /// The issuing replica's clock when the operation was issued (the pump's `now()`).
    issued: Timestamp,
    op: StoreOp,
    lands: bool,
    at: u64,
}

/// A driver waiting for the answer to a stalled store operation (the gateway pump's
/// `tokio::time::timeout(wait, performed)`).
struct StoreWait {
    op_name: String,
    replica: usize,
    in_flight: u64,
    /// The driver's `store_wait_deadline`, in virtual time: then it is answered `Failed`.
    deadline: Option<u64>,
    /// The store's answer, once the operation landed or was lost.
    answer: Option<StoreResult>,
}

/// One gateway process sharing the store.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Replica {
    /// Its clock minus the store's (virtual) clock, ms.
    skew_ms: i64,
    /// Restarts so far: each incarnation is a new process with a new lease-holder id (the
    /// gateway's default replica id is unique per process).
    pub(crate) incarnation: u64,
    /// When its next lease sweep runs (virtual time): every replica sweeps every
    /// [`SWEEP_PERIOD_MS`] beside its live drivers, as `serve/mod.rs::sweep` does.
    sweep_at: u64,
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
    /// (operation, generation) the provider is known to have ended (an error status, or a
    /// body delivered to its clean end): nothing of it runs any more.
    pub(crate) provider_over: HashSet<(String, u64)>,
    /// (operation, generation) → every (replica, incarnation) that opened a provider request of
    /// it (sends, replays, resumes; not status or cancel questions).
    pub(crate) opened_by: HashMap<(String, u64), HashSet<(usize, u64)>>,
    /// (operation, generation) abandoned as `connection_closed` by its only opener, in the same
    /// incarnation, when no connection of it was open (the world's facts, not the driver's).
    pub(crate) closed_by_opener: HashSet<(String, u64)>,
    /// Provider requests (sends, replays and resumes) per operation, across restarts.
    pub(crate) provider_requests: HashMap<String, u64>,
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
    /// The seed's store partition, if it has one.
    pub(crate) partition: Option<Partition>,
    /// The seed's replica pause, if it has one.
    pub(crate) pause: Option<Pause>,
    /// The paused replica ran again (its first move after waking was taken).
    pause_woken: bool,
    /// A pause still to start: its replica and length.
    pause_armed: Option<(usize, u64)>,
    /// The pause's own random stream.
    pauses: Rng,
    /// The seed's store stall, once it started.
    pub(crate) stall: Option<StoreStall>,
    /// A stall still to start: its replica and length.
    stall_armed: Option<(usize, u64)>,
    /// The stall's own random stream.
    stalls: Rng,
    /// Stalled store operations not yet landed or lost.
    in_flight: Vec<InFlight>,
    in_flight_next: u64,
    /// Drivers waiting for a stalled operation's answer.
    store_waits: Vec<StoreWait>,
    pub(crate) bugs: Bugs,
    trace_on: bool,
    _dir: tempfile::TempDir,
    path: PathBuf,
    pub(crate) rt: tokio::runtime::Runtime,
    ledger: Option<SqliteLedger>,
    /// A second, independent connection to the same file: what it sees is committed.
    witness: Option<SqliteLedger>,
    /// The store's clock (the virtual time, read in SQL).
    store_clock: Arc<AtomicU64>,
    pub(crate) now: u64,
    pub(crate) step: u64,
    pub(crate) phase: Phase,
    provider: Provider,
    pub(crate) api: StreamApi,
    pub(crate) adapter: AdapterId,
    upgraded: bool,
    pub(crate) catalog: Catalog,
    /// The gateway's render caches, as many shards as it keeps on this machine: the world
    /// renders through the shard its conversation hashes to, as `prepare_dispatch` does.
    pub(crate) render_caches: turnstile_gateway::serve::RenderCaches,
    pub(crate) toolset: Arc<Toolset>,
    pub(crate) conns: BTreeMap<u64, Conn>,
    conn_next: u64,
    pub(crate) replicas: Vec<Replica>,
    /// The replica a pending crash kills.
    crash_replica: usize,
    pub(crate) limbo: Vec<Conn>,
    pub(crate) drivers: Vec<SimDriver>,
    pub(crate) ops: Vec<String>,
    pub(crate) ops_in_round: u64,
    rounds_done: u64,
    rounds: u64,
    crashed: bool,
    /// The store or what executors were shown changed since the last check.
    pub(crate) dirty: bool,
    pub(crate) history: History,
    pub(crate) report: SeedReport,
    /// A proxy seed: follow-up requests go through the drop-in proxy (`proxy.rs`).
    pub(crate) proxy: bool,
    /// Proxied requests and their clients.
    pub(crate) proxy_clients: Vec<crate::proxy::ProxyClient>,
    /// The proxy client's own history (what it sent last, with the answer it decoded).
    pub(crate) client_history: Option<Value>,
    /// Conversations a proxied request forked into, with the turns it imported.
    pub(crate) forks: Vec<(String, u64)>,
    /// Fresh proxy conversation ids handed out.
    pub(crate) fresh_next: u64,
    /// What each proxied dispatch was rendered with besides its history.
    pub(crate) proxy_renders: HashMap<String, crate::proxy::ProxyRender>,
    /// The events of the driver being pumped, for the proxy followers.
    event_batch: Vec<(String, DriveEvent)>,
}

/// Call a ledger method on the current store, synchronously.
macro_rules! store {
    ($world:expr, $method:ident ( $($arg:expr),* $(,)? )) => {{
        $world.sync_store_clock();
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

impl World {
    /// Build the world of `seed`: a fresh SQLite file, a conversation waiting for a reply.
    pub fn new(seed: u64, options: Options) -> Result<World, String> {
        let mut rng = Rng::new(seed);
        let plan = FaultPlan::draw(&mut rng);
        let skew_ms = plan.skew_ms;
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
        let (clock, store_clock) = StoreClock::manual(1_000_000);
        let ledger = SqliteLedger::open_with_clock(&path, Synchronous::Full, clock)
            .map_err(|error| error.to_string())?;
        let toolset = Arc::new(Toolset::from_json(&tools()).map_err(|error| error.to_string())?);
        let mut rounds = 1 + rng.below(ROUNDS_MAX);
        // From its own stream, so the other draws of a seed stay as they were.
        let proxy = Rng::new(seed ^ PROXY_SEED_SALT).chance(PROXY_SEEDS);
        if proxy {
            // The first round is a /dispatch; the proxy continues it.
            rounds = rounds.max(2);
        }
        let mut world = World {
            seed,
            rng,
            plan,
            partition: None,
            pause: None,
            pause_woken: false,
            pause_armed: None,
            pauses: Rng::new(0),
            stall: None,
            stall_armed: None,
            stalls: Rng::new(0),
            in_flight: Vec::new(),
            in_flight_next: 0,
            store_waits: Vec::new(),
            bugs: options.bugs,
            trace_on: options.trace,
            _dir: dir,
            path,
            rt,
            ledger: Some(ledger),
            witness: None,
            store_clock,
            now: 1_000_000,
            step: 0,
            phase: Phase::Safety,
            provider: Provider::new(api),
            api,
            adapter,
            upgraded: false,
            catalog: Catalog::builtin(),
            render_caches: turnstile_gateway::serve::RenderCaches::new(
                turnstile_gateway::serve::RenderCaches::shards_for_this_machine(),
            ),
            toolset,
            conns: BTreeMap::new(),
            conn_next: 0,
            crash_replica: 0,
            replicas: (0..REPLICAS)
                .map(|index| Replica {
                    skew_ms: if index == 0 { 0 } else { skew_ms },
                    incarnation: 0,
                    // Staggered: the replicas' sweeps do not run in lock step.
                    sweep_at: 1_000_000 + SWEEP_PERIOD_MS * (index as u64 + 1) / REPLICAS as u64,
                })
                .collect(),
            limbo: Vec::new(),
            drivers: Vec::new(),
            ops: Vec::new(),
            ops_in_round: 0,
            rounds_done: 0,
            rounds,
            crashed: false,
            dirty: true,
            history: History::default(),
            proxy,
            proxy_clients: Vec::new(),
            client_history: None,
            forks: Vec::new(),
            fresh_next: 0,
            proxy_renders: HashMap::new(),
            event_batch: Vec::new(),
            report: SeedReport {
                seed,
                replicas: REPLICAS as u64,
                clock_skew_ms_max: skew_ms.unsigned_abs(),
                ..SeedReport::default()
            },
        };
        if skew_ms != 0 {
            world.report.fault(FaultKind::ClockSkew);
        }
        if world.rng.chance(world.plan.partition) {
            // Shorter than 3/10 of a lease (a stream rides it out) or longer than a lease (its
            // holder must stop on its own before the other replica takes over).
            let from = world.now + world.rng.below(6_000);
            let length = if world.rng.chance(0.5) {
                1 + world.rng.below(LEASE_MS * 3 / 10)
            } else {
                LEASE_MS + world.rng.below(2 * LEASE_MS)
            };
            world.partition = Some(Partition {
                replica: world.rng.index(REPLICAS),
                from,
                until: from + length,
            });
            world.report.fault(FaultKind::StorePartition);
        }
        // Drawn from a stream of its own, so every other draw of a seed stays as it was.
        let mut pauses = Rng::new(seed ^ 0x7061_7573_6500_0000);
        if pauses.chance(0.3) {
            // Shorter than 3/10 of a lease, or longer than a lease: the paused holder wakes
            // past its fence, after another replica may have taken its dispatch over. It starts
            // while the replica reads a provider stream (`schedule`).
            let length = if pauses.chance(0.4) {
                1 + pauses.below(LEASE_MS * 3 / 10)
            } else {
                LEASE_MS + pauses.below(2 * LEASE_MS)
            };
            world.pause_armed = Some((pauses.index(REPLICAS), length));
        }
        world.pauses = pauses;
        // The store stall, from a stream of its own as well.
        let mut stalls = Rng::new(seed ^ STALL_SEED_SALT);
        if stalls.chance(0.3) {
            // Shorter than 3/10 of a lease (the real answer comes before the fence), or longer
            // than a lease (the fence comes first: `Failed`, and the write may land later).
            let length = if stalls.chance(0.4) {
                1 + stalls.below(LEASE_MS * 3 / 10)
            } else {
                LEASE_MS + stalls.below(2 * LEASE_MS)
            };
            world.stall_armed = Some((stalls.index(REPLICAS), length));
        }
        world.stalls = stalls;
        world.witness = Some(world.open_store()?);
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

    /// Open the store file with the store's (virtual) clock.
    fn open_store(&self) -> Result<SqliteLedger, String> {
        SqliteLedger::open_with_clock(
            &self.path,
            Synchronous::Full,
            StoreClock::Manual(Arc::clone(&self.store_clock)),
        )
        .map_err(|error| error.to_string())
    }

    /// The store's clock reads the virtual time.
    pub(crate) fn sync_store_clock(&self) {
        self.store_clock.store(self.now, Ordering::SeqCst);
    }

    /// Whether `replica` is cut off from the store now (the safety phase only).
    pub(crate) fn partitioned(&self, replica: usize) -> bool {
        self.phase == Phase::Safety
            && self
                .partition
                .is_some_and(|cut| cut.replica == replica && (cut.from..cut.until).contains(&self.now))
    }

    /// Whether `replica` is stopped now (the safety phase only): when it runs again.
    pub(crate) fn paused_until(&self, replica: usize) -> Option<u64> {
        self.pause
            .filter(|pause| {
                self.phase == Phase::Safety
                    && pause.replica == replica
                    && (pause.from..pause.until).contains(&self.now)
            })
            .map(|pause| pause.until)
    }

    /// Where a request meant for `replica` goes: there, unless it is paused (a balancer's health
    /// check sends it to a replica that answers; a stopped process takes no new work).
    pub(crate) fn answering(&self, replica: usize) -> usize {
        if self.paused_until(replica).is_some() {
            (replica + 1) % REPLICAS
        } else {
            replica
        }
    }

    /// Replica `replica`'s own clock.
    pub(crate) fn local_now(&self, replica: usize) -> Timestamp {
        let skew = self.replicas[replica].skew_ms;
        Timestamp(self.now.saturating_add_signed(skew))
    }

    /// A replica's instant on the virtual (store) clock.
    fn to_virtual(&self, replica: usize, at: Timestamp) -> u64 {
        at.0.saturating_add_signed(-self.replicas[replica].skew_ms)
    }

    /// Replica `replica`'s lease-holder id (new with every restart, as the gateway's default).
    pub(crate) fn holder(&self, replica: usize) -> String {
        format!("dst-replica-{replica}.{}", self.replicas[replica].incarnation)
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
        self.render_for(revision, adapter, operation_id, max_output_tokens, PRIMARY_MODEL)
    }

    /// [`World::render_at`] for `model` (a failover target's).
    pub(crate) fn render_for(
        &mut self,
        revision: u64,
        adapter: AdapterId,
        operation_id: &str,
        max_output_tokens: Option<u64>,
        model: &str,
    ) -> Result<(turnstile_core::manifest::DispatchManifest, Vec<u8>), String> {
        let document = self.history_at(CONVERSATION_ID, revision)?;
        self.render_document(document, adapter, operation_id, max_output_tokens, model)
    }

    /// The stored history of `conversation_id` up to `revision`.
    pub(crate) fn history_at(&mut self, conversation_id: &str, revision: u64) -> Result<Value, String> {
        let mut document = store!(self, conversation(conversation_id))
            .map_err(|e| e.to_string())?
            .ok_or("no conversation")?;
        if let Some(turns) = document["turns"].as_array_mut() {
            turns.retain(|turn| turn["revision"].as_u64().is_some_and(|r| r <= revision));
        }
        document["revision"] = json!(revision);
        Ok(document)
    }

    /// Render a history document with `adapter` for `model`: (manifest, body).
    pub(crate) fn render_document(
        &mut self,
        document: Value,
        adapter: AdapterId,
        operation_id: &str,
        max_output_tokens: Option<u64>,
        model: &str,
    ) -> Result<(turnstile_core::manifest::DispatchManifest, Vec<u8>), String> {
        let revision = document["revision"].as_u64().unwrap_or(0);
        let conversation = Conversation::from_value(document).map_err(|e| format!("{e:?}"))?;
        match validate(&conversation) {
            Verdict::Ready => {}
            Verdict::Rejected(violations) => {
                let codes: Vec<String> = violations
                    .iter()
                    .map(|violation| {
                        format!(
                            "{} at {:?}: {}",
                            violation.code.as_str(),
                            violation.turn,
                            violation.message
                        )
                    })
                    .collect();
                return Err(format!("history at {revision} is rejected: {}", codes.join(", ")));
            }
            other => return Err(format!("history at {revision} is not ready: {}", other.status())),
        }
        let validated = Validated::new(&conversation).map_err(|e| format!("{e:?}"))?;
        let sequence = MessageSequence::build(validated);
        let graph = Graph::new(validated, &sequence).map_err(|e| e.to_string())?;
        let request = PrepareRequest {
            operation_id: operation_id.to_owned(),
            adapter,
            provider: None,
            model: model.into(),
            max_output_tokens,
            stream: true,
            background: false,
            text_content: Default::default(),
        };
        let mut cache = self
            .render_caches
            .of(&conversation.conversation_id)
            .try_lock()
            .map_err(|_| "the world renders one request at a time: its cache is free".to_owned())?;
        match prepare(graph, &request, &self.catalog, &mut cache) {
            PrepareOutcome::Prepared(prepared) => Ok((prepared.manifest, prepared.rendered.body)),
            PrepareOutcome::Paused(pauses) => Err(format!("paused: {pauses:?}")),
            PrepareOutcome::OverBudget(over) => Err(format!("over budget: {over:?}")),
        }
    }

    /// The client starts a new operation at the conversation's current revision.
    fn start_op(&mut self) -> Result<(), String> {
        let replica = self.rng.index(REPLICAS);
        let replica = self.answering(replica);
        self.start_op_on(replica)?;
        if self.phase == Phase::Safety && self.rng.chance(self.plan.race) {
            // Another client asks the same question at the same revision, on the other replica.
            self.report.fault(FaultKind::RacingOperations);
            let other = self.answering((replica + 1) % REPLICAS);
            self.start_op_on(other)?;
        }
        Ok(())
    }

    fn start_op_on(&mut self, replica: usize) -> Result<(), String> {
        self.dirty = true;
        let document = store!(self, conversation(CONVERSATION_ID))
            .map_err(|e| e.to_string())?
            .ok_or("no conversation")?;
        let revision = document["revision"].as_u64().unwrap_or(0);
        let operation_id = format!("op-{}", self.ops.len() + 1);
        let adapter = self.adapter;
        let (manifest, bytes) = self.render_at(revision, adapter, &operation_id, None)?;
        // Some operations name a failover target: its own manifest, rendered from the same
        // history for another model, stored beside the dispatch's own (the gateway's
        // `targets`). The driver moves to it after a refusal or a confirmed-dead attempt.
        let mut fallbacks = Vec::new();
        if self.phase == Phase::Safety && self.rng.chance(self.plan.failover) {
            self.report.fault(FaultKind::FailoverTargets);
            let (manifest, request_bytes) =
                self.render_for(revision, adapter, &operation_id, None, FALLBACK_MODEL)?;
            fallbacks.push(turnstile_store::SealedTarget::vouched(
                turnstile_store::PreparedTarget {
                    manifest,
                    request_bytes,
                    policy: None,
                },
            ));
        }
        // The replica's own clock stamps what it prepares, as the gateway's does.
        let now = self.local_now(replica);
        // As the gateway's `prepare_dispatch`: the prepare begins the first attempt in the
        // same transaction (no breaker here: target 0 never cools).
        let begin = turnstile_store::BeginAtOnce {
            holder: self.holder(replica),
            lease_ms: LEASE_MS,
            target: 0,
        };
        // As the gateway's: the targets the render just sealed, not hashed again by the store.
        let target = turnstile_store::SealedTarget::vouched(turnstile_store::PreparedTarget {
            manifest,
            request_bytes: bytes,
            policy: None,
        });
        let prepared = store!(self, prepare_sealed(target, fallbacks, Some(&begin), now));
        let (prepared, began) = prepared.map_err(|e| e.to_string())?;
        let record = match prepared {
            StorePrepare::Created(record) | StorePrepare::Existing(record) => record,
            other => return Err(format!("prepare refused: {other:?}")),
        };
        let began = match began {
            Some(turnstile_store::BeginOutcome::Began {
                generation,
                idempotency_key,
            }) => Some((generation, idempotency_key)),
            _ => None,
        };
        self.trace(format!(
            "client starts {operation_id} at revision {revision} with {} on replica {replica}",
            adapter.as_str()
        ));
        self.ops.push(operation_id.clone());
        self.ops_in_round += 1;
        if self.phase == Phase::Safety && self.rng.chance(self.plan.client_leaves) {
            // The client went away while its dispatch was being prepared: the request future
            // is gone before a driver started. Only the sweep can pick the dispatch up.
            self.report.fault(FaultKind::ClientLeft);
            self.report.disconnects += 1;
            self.trace(format!("{operation_id}: client left before a driver started"));
            return Ok(());
        }
        match began {
            Some((generation, idempotency_key)) => {
                self.drive_begun(replica, record, generation, idempotency_key)
            }
            None => self.drive_prepared(replica, record),
        }
        if self.phase == Phase::Safety && self.rng.chance(self.plan.client_retry) {
            // The client retries with the same operation id on any replica: it attaches.
            self.report.fault(FaultKind::ClientRetry);
            let again = self.rng.index(REPLICAS);
            let again = self.answering(again);
            if let Ok(Some(record)) = store!(self, dispatch(&operation_id))
                && record.state == DispatchState::Prepared
            {
                self.drive_prepared(again, record);
            }
        }
        Ok(())
    }

    /// A driver on `replica` for a dispatch whose prepare began its first attempt.
    pub(crate) fn drive_begun(
        &mut self,
        replica: usize,
        record: DispatchRecord,
        generation: turnstile_core::Generation,
        idempotency_key: String,
    ) {
        let spec = self.spec_for(&record);
        let drive = Drive::begun(spec, self.local_now(replica), 0, generation, idempotency_key);
        self.start_driver(SimDriver {
            op: record.operation_id.clone(),
            drive,
            replica,
        });
    }

    /// A driver for a PREPARED dispatch on `replica` (a client's request, a client's retry
    /// with the same operation id, or the sweep).
    pub(crate) fn drive_prepared(&mut self, replica: usize, record: DispatchRecord) {
        if self
            .drivers
            .iter()
            .any(|driver| driver.op == record.operation_id && driver.replica == replica)
        {
            // The replica already drives it: a retry attaches to the same hub.
            return;
        }
        let spec = self.spec_for(&record);
        let drive = Drive::new(spec, self.local_now(replica));
        self.start_driver(SimDriver {
            op: record.operation_id.clone(),
            drive,
            replica,
        });
    }

    /// What the gateway's `context_for` gives a driver.
    fn spec_for(&mut self, record: &DispatchRecord) -> DriveSpec {
        let (attempts_before, last_target) = {
            self.sync_store_clock();
            let ledger = self.ledger();
            self.rt
                .block_on(turnstile_store::drive::attempts_so_far(ledger, record))
        };
        let basis = turnstile_store::drive::basis_of(record);
        let mut targets = vec![turnstile_drive::DriveTarget {
            request_digest: basis.request_digest.clone(),
            request_bytes: basis.request_bytes.clone(),
            api: self.api,
            recovery: self.provider_recovery(),
            label: "sim".to_owned(),
            decoder: turnstile_adapters::decode::DecoderOptions::VENDOR,
            timeouts: None,
        }];
        // As the gateway's `context_with`: every failover target with its own bytes.
        let fallbacks = store!(self, dispatch_fallbacks(&record.operation_id)).unwrap_or_default();
        for fallback in fallbacks {
            targets.push(turnstile_drive::DriveTarget {
                request_digest: fallback.request_digest,
                request_bytes: std::sync::Arc::new(fallback.request_bytes),
                api: self.api,
                recovery: self.provider_recovery(),
                label: fallback.provider,
                decoder: turnstile_adapters::decode::DecoderOptions::VENDOR,
                timeouts: None,
            });
        }
        let cooling = vec![false; targets.len()];
        DriveSpec {
            targets,
            cooling,
            last_target,
            basis,
            toolset: Some(self.toolset.clone()),
            call_ids_taken: self.call_ids_taken(),
            lease_ms: LEASE_MS,
            attempts_before,
            timeouts: if self.bugs.no_attempt_deadline {
                // Planted defect: no bound on a stream that never ends.
                Timeouts {
                    attempt_ms: u64::MAX / 4,
                    idle_ms: u64::MAX / 4,
                    ..TIMEOUTS
                }
            } else {
                TIMEOUTS
            },
        }
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

    pub(crate) fn provider_recovery(&self) -> ProviderRecovery {
        ProviderRecovery {
            resume_by_handle: self.plan.resume_by_handle && self.api == StreamApi::OpenAiResponses,
            honours_idempotency_key: self.plan.honours_idempotency_key,
        }
    }

    /// After an action of `replica`: maybe that process dies now.
    fn maybe_crash(&mut self, replica: usize) -> bool {
        if self.crashed {
            // One pending crash at a time; the other replica keeps running until it happens.
            return self.crash_replica == replica;
        }
        if self.phase == Phase::Safety && self.rng.chance(self.plan.crash) {
            self.crashed = true;
            self.crash_replica = replica;
        }
        self.crashed
    }

    /// A crash of `replica` is pending: it does nothing more until it restarts.
    pub(crate) fn dead(&self, replica: usize) -> bool {
        self.crashed && self.crash_replica == replica
    }

    /// Perform a new driver's first actions and keep it.
    fn start_driver(&mut self, mut driver: SimDriver) {
        self.pump(&mut driver);
        self.drivers.push(driver);
    }

    /// Perform every action the driver has, in order, as `serve/driver.rs` does; a crash may
    /// follow any of them.
    fn pump(&mut self, driver: &mut SimDriver) {
        self.pump_actions(driver);
        // What the driver emitted reaches the replica's proxy followers together (they read
        // the hub concurrently); a process that died lost them with its hub.
        let batch = std::mem::take(&mut self.event_batch);
        if !self.dead(driver.replica) && !batch.is_empty() {
            self.proxy_events(driver.replica, batch);
        }
    }

    fn pump_actions(&mut self, driver: &mut SimDriver) {
        while !self.dead(driver.replica) {
            let Some(action) = driver.drive.poll_action() else {
                return;
            };
            match action {
                Action::Store(op) => self.perform_store(driver, op),
                Action::Open {
                    connection,
                    generation,
                    target,
                    request,
                } => self.open(driver, connection, generation, target, request),
                Action::Close { connection } => {
                    let op = driver.op.clone();
                    self.conns
                        .retain(|_, conn| !(conn.op == op && conn.connection == Some(connection)));
                }
                Action::Emit(event) => self.emitted(driver, event),
                Action::Count(count) => match count {
                    Count::PartialToolDispatch => self.report.partial_tool_dispatch += 1,
                    Count::Failover { from, to, reason, .. } => {
                        self.report.failovers += 1;
                        self.trace(format!("{} fails over from {from} to {to} ({reason})", driver.op));
                    }
                    Count::IllegalSend => self.trace(format!(
                        "{} stored bytes do not match the manifest; not sent",
                        driver.op
                    )),
                    _ => {}
                },
                Action::ExposeToolCalls { revision } => {
                    // Executors read the ledger's ready calls of the committed revision.
                    if let Ok(calls) = store!(self, tool_calls(Some(ToolCallState::Ready))) {
                        for call in calls.into_iter().filter(|call| call.revision == revision) {
                            self.history.exposed.insert(call.call_id);
                        }
                    }
                }
            }
            if self.maybe_crash(driver.replica) {
                return;
            }
            if self.waits_for_store(&driver.op, driver.replica) {
                // Its pump awaits the stalled operation: nothing else of it runs meanwhile.
                return;
            }
        }
    }

    fn emitted(&mut self, driver: &SimDriver, event: DriveEvent) {
        self.event_batch.push((driver.op.clone(), event.clone()));
        match event {
            DriveEvent::Preview { generation, .. } => {
                self.history.previewed.insert((driver.op.clone(), generation.0));
                self.check_stale_read(&driver.op, generation, "preview");
            }
            DriveEvent::Retract { generation, reason } => {
                if self.bugs.skip_retract {
                    return;
                }
                self.trace(format!("{} g{} retract ({reason})", driver.op, generation.0));
                self.history.retracted.insert((driver.op.clone(), generation.0));
            }
            DriveEvent::State { state, generation } => {
                self.trace(format!(
                    "{} state {state} g{:?}",
                    driver.op,
                    generation.map(|g| g.0)
                ));
            }
            DriveEvent::Committed { revision, .. } => {
                self.trace(format!("{} committed at revision {}", driver.op, revision.0));
            }
            DriveEvent::Error { code, .. } => self.trace(format!("{} error {code}", driver.op)),
            DriveEvent::Usage { .. } => {}
        }
    }

    /// Arm a store fault for the next operation, per the plan.
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

    /// One store operation through the gateway's own mapping, with the plan's faults and the
    /// planted bugs that live on this side of the driver.
    fn perform_store(&mut self, driver: &mut SimDriver, mut op: StoreOp) {
        self.dirty = true;
        if self.partitioned(driver.replica) {
            // The replica cannot reach the store: nothing is written, the answer is a failure.
            self.trace(format!(
                "{} store partitioned from replica {}: {op:?}",
                driver.op, driver.replica
            ));
            driver.drive.handle_store(
                self.local_now(driver.replica),
                StoreResult::Failed("partitioned".into()),
            );
            return;
        }
        match &mut op {
            StoreOp::Begin { .. } if self.bugs.send_before_persist => {
                // Planted bug: the request goes out before the begin write.
                let body = driver.drive.request_bytes(0).as_ref().clone();
                self.check_send(&driver.op, None, 0, &body);
            }
            StoreOp::Commit { turn, .. } => {
                if self.bugs.expose_before_commit {
                    for block in turn["blocks"].as_array().into_iter().flatten() {
                        if let Some(call_id) = block["call_id"].as_str() {
                            self.history.exposed.insert(call_id.to_owned());
                        }
                    }
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
            }
            StoreOp::Quarantine {
                generation, reason, ..
            } => {
                self.trace(format!("{} g{} quarantine {reason}", driver.op, generation.0));
            }
            _ => {}
        }
        if self.bugs.resume_keeps_holder
            && let StoreOp::Resume { generation, .. } = op
        {
            // Planted defect: the resume leaves the old holder on the attempt.
            op = StoreOp::Transition {
                generation,
                from: DispatchState::Unknown,
                to: DispatchState::Streaming,
                reason: None,
            };
        }
        let now = self.local_now(driver.replica);
        let holder = self.holder(driver.replica);
        if let Some(until) = self.stalled_until(driver.replica) {
            self.stall_store(driver, op, holder, now, until);
            return;
        }
        let result = self.apply_store(driver.replica, &driver.op.clone(), &holder, now, &op, true);
        driver.drive.handle_store(self.local_now(driver.replica), result);
    }

    /// Apply one store operation of `op_name`'s driver on `replica` (now, or late after a
    /// stall). `seen`: its answer reaches the driver (a late write's does not).
    fn apply_store(
        &mut self,
        replica: usize,
        op_name: &str,
        holder: &str,
        now: Timestamp,
        op: &StoreOp,
        seen: bool,
    ) -> StoreResult {
        self.dirty = true;
        if let StoreOp::AbandonAndRearm {
            generation,
            provider_word: Some(word),
            ..
        } = op
            && word == "connection_closed"
        {
            let key = (op_name.to_owned(), generation.0);
            let incarnation = self.replicas[replica].incarnation;
            let only_opener = self
                .history
                .opened_by
                .get(&key)
                .is_some_and(|openers| openers.len() == 1 && openers.contains(&(replica, incarnation)));
            let none_open = !self
                .conns
                .values()
                .chain(self.limbo.iter())
                .any(|conn| conn.op == op_name && conn.generation == *generation && !conn.probe);
            if only_opener && none_open {
                self.history.closed_by_opener.insert(key);
            }
        }
        // Faults on reads as well as writes.
        self.arm_store_fault();
        self.sync_store_clock();
        if self.bugs.replica_clock_fencing {
            // Planted defect: leases judged by the calling replica's own clock.
            self.store_clock.store(now.0, Ordering::SeqCst);
        }
        let result = {
            let ledger = self.ledger();
            self.rt
                .block_on(turnstile_store::drive::perform(ledger, holder, op_name, op, now))
        };
        self.sync_store_clock();
        match (op, &result) {
            (
                StoreOp::BindHandle { generation, handle }
                | StoreOp::Commit {
                    generation,
                    handle: Some(handle),
                    ..
                },
                StoreResult::BindRefused,
            ) => {
                if seen {
                    self.history.bind_refusals += if self.bugs.miscount_foreign_handles { 2 } else { 1 };
                } else {
                    // Counted by the store; no driver saw it.
                    self.history.bind_ambiguous += 1;
                }
                self.trace(format!(
                    "{op_name} g{} handle {handle} refused (foreign)",
                    generation.0
                ));
            }
            (
                StoreOp::BindHandle { .. } | StoreOp::Commit { handle: Some(_), .. },
                StoreResult::Failed(error),
            ) => {
                self.history.bind_ambiguous += 1;
                self.trace(format!("{op_name} bind_handle failed: {error}"));
            }
            (_, StoreResult::Failed(error)) => {
                self.trace(format!("{op_name} store error: {error}"));
            }
            _ => {}
        }
        result
    }

    /// The end of `replica`'s store stall while its store stalls now (safety phase only).
    pub(crate) fn stalled_until(&self, replica: usize) -> Option<u64> {
        self.stall
            .filter(|stall| {
                self.phase == Phase::Safety
                    && stall.replica == replica
                    && (stall.from..stall.until).contains(&self.now)
            })
            .map(|stall| stall.until)
    }

    /// A store operation issued into a stall: it is on its way until the store unblocks; the
    /// driver waits for it, as the gateway's pump does, until its `store_wait_deadline`.
    fn stall_store(
        &mut self,
        driver: &SimDriver,
        op: StoreOp,
        holder: String,
        issued: Timestamp,
        until: u64,
    ) {
        let id = self.in_flight_next;
        self.in_flight_next += 1;
        let lands = self.stalls.chance(0.7);
        let deadline = driver
            .drive
            .store_wait_deadline()
            .map(|at| self.to_virtual(driver.replica, at).max(self.now));
        self.trace(format!(
            "{} store stalled on replica {} until {until} (lands: {lands}, deadline {deadline:?}): {op:?}",
            driver.op, driver.replica
        ));
        self.in_flight.push(InFlight {
            id,
            op_name: driver.op.clone(),
            replica: driver.replica,
            holder,
            issued,
            op,
            lands,
            at: until,
        });
        self.store_waits.push(StoreWait {
            op_name: driver.op.clone(),
            replica: driver.replica,
            in_flight: id,
            deadline,
            answer: None,
        });
    }

    /// The driver `op_name` on `replica` waits for a stalled store operation.
    fn waits_for_store(&self, op_name: &str, replica: usize) -> bool {
        self.store_waits
            .iter()
            .any(|wait| wait.op_name == op_name && wait.replica == replica)
    }

    /// When the next stalled operation lands, or the next waiting driver is answered (a paused
    /// replica's pump runs when it wakes).
    fn next_stall_event(&self) -> Option<u64> {
        let lands = self.in_flight.iter().map(|flight| flight.at);
        let answers = self.store_waits.iter().filter_map(|wait| {
            let resumes = self.paused_until(wait.replica).unwrap_or(0);
            match (&wait.answer, wait.deadline) {
                (Some(_), _) => Some(self.now.max(resumes)),
                (None, Some(deadline)) => Some(deadline.max(resumes)),
                (None, None) => None,
            }
        });
        lands.chain(answers).min()
    }

    /// The next due stall event: a stalled operation lands (or its connection is lost), or a
    /// waiting driver gets its answer (the store's, or `Failed` at its deadline).
    fn stall_event(&mut self) {
        self.dirty = true;
        if let Some(index) = self.in_flight.iter().position(|flight| flight.at <= self.now) {
            let flight = self.in_flight.remove(index);
            let waiting = self
                .store_waits
                .iter()
                .position(|wait| wait.in_flight == flight.id && wait.answer.is_none());
            let result = if flight.lands {
                if waiting.is_none() {
                    self.report.fault(FaultKind::StoreLateWrite);
                }
                self.trace(format!(
                    "{} stalled store operation lands (driver {}): {:?}",
                    flight.op_name,
                    if waiting.is_some() { "waiting" } else { "gone" },
                    flight.op
                ));
                self.apply_store(
                    flight.replica,
                    &flight.op_name,
                    &flight.holder,
                    flight.issued,
                    &flight.op,
                    waiting.is_some(),
                )
            } else {
                self.trace(format!("{} stalled store operation lost", flight.op_name));
                StoreResult::Failed("the store connection was lost during a stall".into())
            };
            if let Some(index) = waiting {
                self.store_waits[index].answer = Some(result);
            }
            return;
        }
        let now = self.now;
        let Some(index) = self.store_waits.iter().position(|wait| {
            let resumes = self.paused_until(wait.replica).unwrap_or(0);
            match (&wait.answer, wait.deadline) {
                (Some(_), _) => resumes <= now,
                (None, Some(deadline)) => deadline.max(resumes) <= now,
                (None, None) => false,
            }
        }) else {
            return;
        };
        let wait = self.store_waits.remove(index);
        let result = wait.answer.unwrap_or_else(|| {
            StoreResult::Failed("the store did not answer before this replica's lease ends".into())
        });
        self.trace(format!(
            "{} on replica {}: stalled store answer {result:?}",
            wait.op_name, wait.replica
        ));
        let Some(index) = self
            .drivers
            .iter()
            .position(|driver| driver.op == wait.op_name && driver.replica == wait.replica)
        else {
            return;
        };
        let mut driver = self.drivers.swap_remove(index);
        driver.drive.handle_store(self.local_now(driver.replica), result);
        self.pump(&mut driver);
        self.drivers.push(driver);
    }

    fn open(
        &mut self,
        driver: &mut SimDriver,
        connection: ConnectionId,
        generation: Generation,
        target: u32,
        request: Request,
    ) {
        let send = matches!(request, Request::Send { .. });
        let probe = matches!(request, Request::Status { .. } | Request::Cancel { .. });
        if !probe {
            let incarnation = self.replicas[driver.replica].incarnation;
            self.history
                .opened_by
                .entry((driver.op.clone(), generation.0))
                .or_default()
                .insert((driver.replica, incarnation));
        }
        if matches!(request, Request::Send { .. } | Request::Resume { .. }) {
            // Billed requests (status questions and cancels are not).
            *self
                .history
                .provider_requests
                .entry(driver.op.clone())
                .or_default() += 1;
            self.check_provider_requests(&driver.op);
        }
        let answer = match request {
            Request::Send { idempotency_key } => {
                let sent_target = if self.bugs.failover_sends_first_target {
                    0
                } else {
                    target
                };
                let mut body = driver.drive.request_bytes(sent_target).as_ref().clone();
                if self.bugs.rerender_on_retry && self.history.sent_ops.contains(&driver.op) {
                    // Planted bug: a retry renders afresh with whatever adapter is configured now.
                    let revision = store!(self, dispatch(&driver.op))
                        .ok()
                        .flatten()
                        .map_or(0, |record| record.revision.0);
                    let adapter = self.adapter;
                    if let Ok((_, fresh)) = self.render_at(revision, adapter, &driver.op.clone(), None) {
                        body = fresh;
                    }
                }
                self.check_send(&driver.op, Some(generation), target, &body);
                self.check_new_generation(&driver.op, generation, driver.replica);
                self.history.sent_ops.insert(driver.op.clone());
                self.report.sends += 1;
                self.trace(format!(
                    "{} g{} send {} bytes key {idempotency_key} (replica {})",
                    driver.op,
                    generation.0,
                    body.len(),
                    driver.replica
                ));
                let (rng, plan, report) = (&mut self.rng, &self.plan, &mut self.report);
                self.provider.request(rng, plan, report, &body, &idempotency_key)
            }
            Request::Resume {
                handle,
                after_sequence,
            } => {
                self.trace(format!("{} g{} resume {handle}", driver.op, generation.0));
                let (rng, plan, report) = (&mut self.rng, &self.plan, &mut self.report);
                self.provider.resume(rng, plan, report, &handle, after_sequence)
            }
            Request::Status { handle } => {
                // A stray stream of that generation still delivering (kept across a crash) is
                // the response still running at the provider.
                let running = self.provider.knows(&handle) && self.stray_streams(&driver.op, generation);
                self.trace(format!(
                    "{} g{} status of {handle}: {}",
                    driver.op,
                    generation.0,
                    if running { "in_progress" } else { "as produced" }
                ));
                if running {
                    Provider::response_object(&handle, "in_progress")
                } else {
                    self.provider.status(&handle)
                }
            }
            Request::Cancel { handle } => {
                if self.provider.knows(&handle) && self.stray_streams(&driver.op, generation) {
                    // Cancelled: its stray streams stop, and nothing of it runs any more.
                    self.limbo
                        .retain(|conn| !(conn.op == driver.op && conn.generation == generation));
                    self.conns.retain(|_, conn| {
                        !(conn.op == driver.op && conn.generation == generation && conn.connection.is_none())
                    });
                    self.history
                        .provider_over
                        .insert((driver.op.clone(), generation.0));
                    self.trace(format!("{} g{} cancelled {handle}", driver.op, generation.0));
                    Provider::response_object(&handle, "cancelled")
                } else {
                    self.trace(format!(
                        "{} g{} cancel {handle}: refused",
                        driver.op, generation.0
                    ));
                    self.provider.cancel(&handle)
                }
            }
        };
        if send && !(200..300).contains(&answer.status) {
            // An error status: nothing of this attempt runs at the provider.
            self.history
                .provider_over
                .insert((driver.op.clone(), generation.0));
        }
        let op = driver.op.clone();
        self.open_connection(&op, generation, driver.replica, Some(connection), probe, answer);
        // An older stream of this dispatch, kept alive across a crash, delivers again now.
        let mut index = 0;
        while index < self.limbo.len() {
            if self.limbo[index].op == op && self.limbo[index].generation < generation {
                let mut conn = self.limbo.swap_remove(index);
                self.report.fault(FaultKind::OldStreamResumed);
                self.trace(format!("{op} old stream of g{} resumes", conn.generation.0));
                // Nothing of this process opened it: the driver never hears of it.
                conn.connection = None;
                let id = self.conn_next;
                self.conn_next += 1;
                self.conns.insert(id, conn);
            } else {
                index += 1;
            }
        }
    }

    fn open_connection(
        &mut self,
        op: &str,
        generation: Generation,
        replica: usize,
        connection: Option<ConnectionId>,
        probe: bool,
        answer: Answer,
    ) {
        let id = self.conn_next;
        self.conn_next += 1;
        self.conns.insert(
            id,
            Conn {
                op: op.to_owned(),
                generation,
                replica,
                hang: answer.hang,
                endless: answer.endless,
                connection,
                probe,
                status: answer.status,
                head_delivered: false,
                chunks: answer.chunks,
                clean_end: answer.clean_end,
                side: None,
            },
        );
    }

    /// Connections that have something to deliver (a hung head delivers nothing).
    fn deliverable(&self) -> Vec<u64> {
        self.conns
            .iter()
            .filter(|(_, conn)| !conn.hang && self.paused_until(conn.replica).is_none())
            .filter(|(_, conn)| !self.waits_for_store(&conn.op, conn.replica))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Deliver the next piece of connection `id` to its dispatch's driver.
    fn deliver(&mut self, id: u64) {
        let Some(conn) = self.conns.get(&id) else {
            return;
        };
        let op = conn.op.clone();
        let replica = conn.replica;
        if self.bugs.commit_late_turn && conn.connection.is_none() {
            self.commit_late(id);
            return;
        }
        let Some(index) = self
            .drivers
            .iter()
            .position(|driver| driver.op == op && driver.replica == replica)
        else {
            // Nobody listens any more (the driver finished): the connection is dropped.
            self.conns.remove(&id);
            return;
        };
        let Some(connection) = conn.connection else {
            // A stray stream: no live driver opened it, so nothing reads it.
            self.conns.remove(&id);
            return;
        };
        let mut driver = self.drivers.swap_remove(index);
        let now = self.local_now(replica);
        let conn = self.conns.get_mut(&id).map(|conn| {
            if !conn.head_delivered {
                conn.head_delivered = true;
                (Some(conn.status), None, false)
            } else if let Some(chunk) = conn.chunks.pop_front() {
                (None, Some(chunk), false)
            } else if conn.endless {
                (None, Some(b": ping\n\n".to_vec()), false)
            } else {
                (None, None, conn.clean_end)
            }
        });
        match conn {
            Some((Some(status), _, _)) => driver.drive.handle_head(now, connection, status),
            Some((None, Some(chunk), _)) => driver.drive.handle_chunk(now, connection, chunk),
            Some((None, None, clean)) => {
                if let Some(conn) = self.conns.remove(&id)
                    && clean
                    && (200..300).contains(&conn.status)
                {
                    // The provider's body ended: that response is over.
                    self.history.provider_over.insert((op.clone(), conn.generation.0));
                }
                let ending = if clean { Ending::Clean } else { Ending::Broken };
                driver.drive.handle_end(now, connection, ending);
            }
            None => {}
        }
        self.pump(&mut driver);
        self.drivers.push(driver);
    }

    /// Planted bug: assemble an old generation's stream on its own and append its turn with
    /// `append_turn` (conditional on the revision only, not on the active generation).
    fn commit_late(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let generation = conn.generation;
        let op = conn.op.clone();
        let chunk = if !conn.head_delivered {
            conn.head_delivered = true;
            None
        } else if let Some(chunk) = conn.chunks.pop_front() {
            Some(chunk)
        } else {
            self.conns.remove(&id);
            return;
        };
        let Some(chunk) = chunk else {
            return;
        };
        let api = self.api;
        let toolset = self.toolset.clone();
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let (decoder, assembler) = conn.side.get_or_insert_with(|| {
            let mut config = AssemblerConfig::new(generation, format!("{op}.g{}", generation.0));
            config.toolset = Some(toolset);
            (api.decoder(), Assembler::new(config))
        });
        decoder.handle_bytes(&chunk);
        let mut turns = Vec::new();
        while let Some(event) = decoder.poll_event() {
            let _ = assembler.handle_event(generation, event);
            while let Some(output) = assembler.poll_output() {
                if let Output::Commit(offer) = output {
                    turns.push(offer.turn);
                }
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
            self.dirty = true;
            self.trace(format!("{op} g{} late turn appended: {outcome:?}", generation.0));
        }
    }

    /// Crash one replica: drop its in-memory parts (drivers, connections, clients' streams),
    /// reopen the store file, and run its start-up recovery as a new process.
    fn crash(&mut self) {
        self.crashed = false;
        self.dirty = true;
        self.report.fault(FaultKind::Crash);
        // The process whose action was the last one dies.
        let replica = self.crash_replica;
        self.trace(format!(
            "CRASH of replica {replica}: memory dropped, ledger reopened"
        ));
        // Clients' streams are cut: whatever preview they saw is void (the client contract).
        for driver in self.drivers.iter().filter(|driver| driver.replica == replica) {
            self.report.disconnects += 1;
            for (op, generation) in self.history.previewed.iter() {
                if *op == driver.op {
                    self.history.retracted.insert((op.clone(), *generation));
                }
            }
        }
        self.drivers.retain(|driver| driver.replica != replica);
        // Its pumps died with it; their stalled operations may still land.
        self.store_waits.retain(|wait| wait.replica != replica);
        self.proxy_events_end(None, replica, true);
        let conns = std::mem::take(&mut self.conns);
        for (id, conn) in conns {
            if conn.replica != replica {
                self.conns.insert(id, conn);
            } else if conn.status == 200 && !conn.chunks.is_empty() && self.rng.chance(self.plan.old_stream) {
                self.limbo.push(conn);
            }
        }
        self.replicas[replica].incarnation += 1;
        self.ledger = None;
        self.witness = None;
        match self.open_store() {
            Ok(ledger) => {
                self.ledger = Some(ledger);
                self.witness = self.open_store().ok();
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
        // Start-up recovery of the new process: its own holder id is new, so it finds the old
        // process's attempts when their leases run out (and every PREPARED dispatch at once).
        let holder = self.holder(replica);
        self.recover(replica, &holder, 0);
    }

    /// Start-up recovery (`serve/mod.rs::recover`), also the lease sweep with [`SWEEP_HOLDER`].
    fn recover(&mut self, replica: usize, holder: &str, prepared_idle_ms: u64) {
        let now = self.local_now(replica);
        self.sync_store_clock();
        let found = {
            let ledger = self.ledger();
            self.rt.block_on(turnstile_store::drive::recoverable(
                ledger,
                holder,
                now,
                prepared_idle_ms,
            ))
        };
        let Ok(found) = found else {
            return;
        };
        for found in found {
            let op = found.record().operation_id.clone();
            if self
                .drivers
                .iter()
                .any(|driver| driver.op == op && driver.replica == replica)
            {
                continue;
            }
            match found {
                turnstile_store::drive::Recoverable::Unknown {
                    record,
                    attempt,
                    spent,
                    target,
                } => {
                    self.trace(format!(
                        "{op} recovered in UNKNOWN g{} on replica {replica} (spent {spent:?})",
                        attempt.generation.0
                    ));
                    let spec = self.spec_for(&record);
                    let drive = Drive::recovered(spec, &attempt, spent, target, self.local_now(replica));
                    self.start_driver(SimDriver { op, drive, replica });
                }
                turnstile_store::drive::Recoverable::Prepared { record } => {
                    if self.bugs.sweep_skips_prepared {
                        continue;
                    }
                    self.trace(format!("{op} PREPARED and undriven: driven by replica {replica}"));
                    self.drive_prepared(replica, record);
                }
            }
            if self.dead(replica) {
                return;
            }
        }
    }

    /// One scheduling step. False when nothing is left to do.
    fn schedule(&mut self) -> bool {
        let finished: Vec<(String, usize)> = self
            .drivers
            .iter()
            .filter(|driver| driver.drive.is_finished())
            .map(|driver| (driver.op.clone(), driver.replica))
            .collect();
        for (op, replica) in finished {
            // The hub finished: its followers read the end.
            self.proxy_events_end(Some(&op), replica, false);
            // As the gateway's pump: a finished driver reads none of its connections any more.
            self.conns
                .retain(|_, conn| !(conn.op == op && conn.replica == replica && conn.connection.is_some()));
        }
        self.drivers.retain(|driver| !driver.drive.is_finished());
        if let Some((replica, length)) = self.pause_armed
            && self.phase == Phase::Safety
            && self
                .conns
                .values()
                .any(|conn| conn.replica == replica && conn.connection.is_some() && !conn.probe)
            && self.pauses.chance(0.25)
        {
            self.pause_armed = None;
            self.pause = Some(Pause {
                replica,
                from: self.now,
                until: self.now + length,
            });
            self.report.fault(FaultKind::ReplicaPause);
            self.trace(format!("replica {replica} pauses for {length} ms"));
        }
        if let Some((replica, length)) = self.stall_armed
            && self.phase == Phase::Safety
            && self
                .conns
                .values()
                .any(|conn| conn.replica == replica && conn.connection.is_some() && !conn.probe)
            && self.stalls.chance(0.25)
        {
            // It starts while the replica reads a provider stream: its renewals and writes then
            // meet the store wait deadline.
            self.stall_armed = None;
            self.stall = Some(StoreStall {
                replica,
                from: self.now,
                until: self.now + length,
            });
            self.report.fault(FaultKind::StoreStall);
            self.trace(format!("the store stalls for replica {replica} for {length} ms"));
        }
        let stall_at = self.next_stall_event();
        if let Some(at) = stall_at
            && at <= self.now
        {
            self.stall_event();
            return true;
        }
        if let Some(pause) = self.pause
            && !self.pause_woken
            && (self.now >= pause.until || self.phase != Phase::Safety)
        {
            // A process waking from a stop finds bytes in its sockets and its timers overdue
            // at once; its first move here is a read, so a holder that does not check its fence
            // before reading shows a stale generation.
            self.pause_woken = true;
            let waiting = self
                .conns
                .iter()
                .find(|(_, conn)| conn.replica == pause.replica && !conn.hang && conn.connection.is_some())
                .filter(|(_, conn)| !self.waits_for_store(&conn.op, conn.replica))
                .map(|(id, _)| *id);
            if let Some(id) = waiting {
                self.trace(format!(
                    "replica {} wakes from its pause: a read first",
                    pause.replica
                ));
                self.deliver(id);
                return true;
            }
        }
        // Timers that are due fire first (each replica's timer, on the virtual clock).
        let due = self
            .drivers
            .iter()
            .enumerate()
            .filter_map(|(index, driver)| {
                // A paused replica's timers fire when it runs again.
                let resumes = self.paused_until(driver.replica).unwrap_or(0);
                driver
                    .drive
                    .poll_timeout()
                    .map(|at| (self.to_virtual(driver.replica, at).max(resumes), index))
            })
            .filter(|(_, index)| {
                !(self.bugs.no_lease_timer && self.drivers[*index].drive.state() == DispatchState::Unknown)
            })
            // A driver awaiting a stalled store operation is answered by `stall_event`.
            .filter(|(_, index)| {
                let driver = &self.drivers[*index];
                !self.waits_for_store(&driver.op, driver.replica)
            })
            .min();
        let sweep = self.next_sweep();
        let ids = self.deliverable();
        if !ids.is_empty() {
            if let Some((at, index)) = due
                && at <= self.now
            {
                self.fire(index);
                return true;
            }
            if let Some((at, replica)) = sweep
                && at <= self.now
            {
                self.sweep(replica);
                return true;
            }
            let id = ids[self.rng.index(ids.len())];
            self.now += self.rng.below(DELIVERY_MS_MAX);
            self.deliver(id);
            return true;
        }
        if let Some(at) = stall_at
            && due.is_none_or(|(due_at, _)| at <= due_at)
            && sweep.is_none_or(|(sweep_at, _)| at <= sweep_at)
        {
            let wakes = self
                .pause
                .filter(|pause| !self.pause_woken && self.now < pause.until && at >= pause.until)
                .map(|pause| pause.until);
            self.now = wakes.unwrap_or(at).max(self.now);
            if wakes.is_none() {
                self.stall_event();
            }
            return true;
        }
        // Time that runs past the end of a pause stops there first: the woken replica's first
        // move (above) comes before any timer of that instant.
        let wakes_by = |at: u64| {
            self.pause
                .filter(|pause| !self.pause_woken && self.now < pause.until && at >= pause.until)
                .map(|pause| pause.until)
        };
        match (due, sweep) {
            (Some((at, index)), sweep) if sweep.is_none_or(|(sweep_at, _)| at <= sweep_at) => {
                if let Some(until) = wakes_by(at) {
                    self.now = until;
                    return true;
                }
                self.now = self.now.max(at);
                self.fire(index);
                true
            }
            (_, Some((at, replica))) => {
                if let Some(until) = wakes_by(at) {
                    self.now = until;
                    return true;
                }
                self.now = self.now.max(at);
                self.sweep(replica);
                true
            }
            _ => match self.pause.filter(|pause| self.now < pause.until) {
                // Only the paused replica has work left (bytes waiting): time runs on to it.
                Some(pause) if self.paused_until(pause.replica).is_some() => {
                    self.now = pause.until;
                    true
                }
                _ => false,
            },
        }
    }

    fn fire(&mut self, index: usize) {
        let mut driver = self.drivers.swap_remove(index);
        driver.drive.handle_timeout(self.local_now(driver.replica));
        self.pump(&mut driver);
        self.drivers.push(driver);
    }

    /// Streams of `op`'s `generation` that no live driver reads (kept across a crash, or not
    /// yet delivering again) are still running at the provider.
    fn stray_streams(&self, op: &str, generation: Generation) -> bool {
        self.limbo
            .iter()
            .any(|conn| conn.op == op && conn.generation == generation)
            || self
                .conns
                .values()
                .any(|conn| conn.op == op && conn.generation == generation && conn.connection.is_none())
    }

    /// The replica whose periodic sweep is next, while any operation is not over (a quiet
    /// system with every operation ended has nothing to sweep; the client moves next).
    fn next_sweep(&mut self) -> Option<(u64, usize)> {
        if !self.operations_open() {
            return None;
        }
        (0..REPLICAS)
            .filter(|replica| !self.dead(*replica))
            .map(|replica| {
                let resumes = self.paused_until(replica).unwrap_or(0);
                // A sweep's store reads wait out a stall of its replica's store.
                let unstalls = self.stalled_until(replica).unwrap_or(0);
                (
                    self.replicas[replica].sweep_at.max(resumes).max(unstalls),
                    replica,
                )
            })
            .min()
    }

    /// Some operation's dispatch is not in a terminal state.
    fn operations_open(&mut self) -> bool {
        self.ops
            .clone()
            .into_iter()
            .any(|op| !matches!(store!(self, dispatch(&op)), Ok(Some(record)) if record.state.is_terminal()))
    }

    /// One replica's lease sweep (`serve/mod.rs::sweep`): attempts whose lease ran out by the
    /// store's clock, and PREPARED dispatches nobody touched for a lease.
    fn sweep(&mut self, replica: usize) {
        self.replicas[replica].sweep_at = self.now + SWEEP_PERIOD_MS;
        if self.partitioned(replica) {
            self.trace(format!("lease sweep on replica {replica}: store partitioned"));
            return;
        }
        self.trace(format!("lease sweep on replica {replica}"));
        self.recover(replica, SWEEP_HOLDER, LEASE_MS);
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
        if last_role == "assistant" && self.proxy {
            // A stateless agent: its follow-up request (the results, or a new question) goes
            // through the drop-in proxy with the whole history.
            self.rounds_done += 1;
            self.ops_in_round = 0;
            if self.rounds_done >= self.rounds {
                return Ok(false);
            }
            self.proxy_round()?;
            return Ok(true);
        }
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
            if self.phase == Phase::Safety && self.rng.chance(self.plan.executor_crash) {
                self.executor_crashes_mid_call(&call_id, &content);
                self.step += 1;
                self.dirty = true;
                self.check();
                continue;
            }
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

    /// An executor claims a call and dies before its result; its lease runs out by the store's
    /// clock, the call is listed `expired`, a second executor claims it — with the same
    /// idempotency key — and answers; the first executor's late result is refused.
    fn executor_crashes_mid_call(&mut self, call_id: &str, content: &Value) {
        self.report.fault(FaultKind::ExecutorCrash);
        let step = self.step;
        let first = match store!(self, claim_call(CONVERSATION_ID, call_id, "executor-a", LEASE_MS)) {
            Ok(CallClaimOutcome::Claimed(claim)) => claim,
            other => {
                self.trace(format!("executor-a could not claim {call_id}: {other:?}"));
                return;
            }
        };
        self.trace(format!("executor-a claimed {call_id} and died"));
        // Time passes until the lease ran out (the store's clock is the virtual one).
        self.now = self.now.max(first.lease_expires_at.0) + 1;
        let listed = store!(self, tool_calls(Some(ToolCallState::Expired))).unwrap_or_default();
        if !listed.iter().any(|call| call.call_id == call_id) {
            self.report.violate(
                step,
                Invariant::ToolLedger,
                format!("{call_id}: the dead executor's call is not listed expired"),
            );
        }
        let second = match store!(self, claim_call(CONVERSATION_ID, call_id, "executor-b", LEASE_MS)) {
            Ok(CallClaimOutcome::Claimed(claim)) => claim,
            other => {
                self.report.violate(
                    step,
                    Invariant::ToolLedger,
                    format!("{call_id}: an expired call could not be claimed again: {other:?}"),
                );
                return;
            }
        };
        if second.idempotency_key != first.idempotency_key || !second.took_over_expired {
            self.report.violate(
                step,
                Invariant::ToolLedger,
                format!(
                    "{call_id}: the takeover's key {} differs from the first claim's {} (or was not marked a takeover)",
                    second.idempotency_key, first.idempotency_key
                ),
            );
        }
        let now = self.ts();
        // Planted bug: the dead executor comes back and answers with whatever claim is current.
        let late_claim = if self.bugs.executor_uses_current_claim {
            second.claim
        } else {
            first.claim
        };
        let late = store!(
            self,
            submit_tool_result(CONVERSATION_ID, call_id, late_claim, "success", content, now)
        );
        let answered = store!(
            self,
            submit_tool_result(CONVERSATION_ID, call_id, second.claim, "success", content, now)
        );
        self.trace(format!(
            "{call_id}: late result {late:?}, takeover's result {answered:?}"
        ));
        if matches!(late, Ok(ResultOutcome::Appended { .. })) {
            self.report.violate(
                step,
                Invariant::ToolLedger,
                format!(
                    "{call_id}: the result of a claim whose lease ran out and was taken over was accepted"
                ),
            );
        }
        if !matches!(answered, Ok(ResultOutcome::Appended { .. })) {
            self.report.violate(
                step,
                Invariant::ToolLedger,
                format!("{call_id}: the current claim's result was refused: {answered:?}"),
            );
        }
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
                    && self.now > phase_start + LIVENESS_BOUND_MS
                    && self.operations_open()
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
