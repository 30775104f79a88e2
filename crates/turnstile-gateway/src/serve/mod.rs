//! `turnstile serve`: the gateway. Start-up order: config → store → start-up recovery (every
//! live attempt of a dead process becomes UNKNOWN and gets a recovery driver) → built-in
//! simulator (unless `sim_url`) → listener. SIGINT/SIGTERM drains (`drain.rs`): no new
//! requests, live dispatches finish within `drain_timeout_ms`, and what is left is handed to
//! recovery with a typed event to each client.

pub mod api;
pub mod attempts;
pub mod breaker;
pub mod budget;
pub mod config;
pub mod drain;
pub mod driver;
pub mod feed;
pub mod hub;
pub mod kept;
pub mod listener;
pub mod metrics;
pub mod parse_errors;
pub mod proxy;
pub mod repair;
pub mod start;
pub mod traces;
pub mod transport;
pub mod write_timeout;

use axum::Router;
use axum::routing::{any, get, post};
use config::Config;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::Mutex;
use transport::Endpoint;
use turnstile_adapters::catalog::Catalog;
use turnstile_adapters::render::RenderCache;
use turnstile_core::assemble::ToolsetCache;
use turnstile_core::dispatch::Timestamp;
use turnstile_store::Ledger;

/// State shared by every request and driver.
pub struct Shared {
    /// The durable ledger.
    pub ledger: Arc<dyn Ledger>,
    /// HTTP client for providers.
    pub client: reqwest::Client,
    /// Providers by name (`sim` included).
    pub endpoints: HashMap<String, Endpoint>,
    /// Attempt lease.
    pub lease_ms: u64,
    /// Longest gap between stream chunks.
    pub idle: Duration,
    /// Bounds on every wait of an attempt (head, idle, whole attempt).
    pub timeouts: turnstile_drive::Timeouts,
    /// This replica's lease-holder id.
    pub holder: String,
    /// (token, tenant name) pairs.
    pub tenants: Vec<(String, String)>,
    /// Largest API body.
    pub body_bytes_max: usize,
    /// Live client-event hubs by store operation id.
    pub hubs: Mutex<HashMap<String, Arc<hub::Hub>>>,
    /// The tails of the dispatches driven here that finished, newest last, at most
    /// [`hub::FINISHED_TAILS_MAX`]: what a stream resumed by `Last-Event-ID` after its dispatch
    /// ended still gets, under the ids it was first sent with.
    pub finished_tails: std::sync::Mutex<std::collections::VecDeque<(String, Arc<hub::Hub>)>>,
    /// Since when each dispatch driven here is UNKNOWN.
    pub unknown_since: Mutex<HashMap<String, Timestamp>>,
    /// Compiled tool schemas by toolset digest.
    pub toolsets: Mutex<ToolsetCache>,
    /// Rendered fragments by block digest, kept render states and body midstates, one cache
    /// per share of the conversations.
    pub render_caches: RenderCaches,
    /// Stored conversations kept decoded between dispatches (`kept.rs`).
    pub kept: kept::KeptConversations,
    /// Model catalog.
    pub catalog: Catalog,
    /// Prometheus exposition.
    pub prometheus: metrics_exporter_prometheus::PrometheusHandle,
    /// Drop-in proxy routes (empty: everything to the simulator).
    pub routes: Vec<config::Route>,
    /// The newest shadow comparisons.
    pub shadow: proxy::shadow::Diffs,
    /// One byte budget for provider output held in memory by every dispatch and client
    /// backlog.
    pub output_budget: Arc<budget::OutputBudget>,
    /// Most previews a dispatch's hub keeps (`stream_backlog_previews_max`).
    pub backlog_previews_max: usize,
    /// The change feed of `GET /v1/events`.
    pub feed: Arc<feed::Feed>,
    /// The newest proxy refusals (`GET /v1/proxy/refusals`).
    pub refusals: proxy::refusals::Refusals,
    /// Per-target failure counts and cool-downs for failover (`breaker.rs`).
    pub breaker: breaker::Breaker,
    /// How long a call handed to a proxy client stays `client` (store clock) before it reads
    /// `client_abandoned` (`proxy_client_call_timeout_ms`).
    pub client_call_timeout_ms: u64,
    /// Where the process is in its shutdown, and what must end before it exits (`drain.rs`).
    pub drain: Arc<drain::Drain>,

    /// Longest `/healthz` and `/readyz` wait for the store (`health_timeout_ms`).
    pub health_timeout: Duration,
}

impl Shared {
    /// A new hub for a dispatch's client events: announced on the change feed, keeping at
    /// most `stream_backlog_previews_max` previews, and counted against the output budget for
    /// as long as anyone holds it.
    pub fn hub(&self, conversation_id: &str, operation_id: &str) -> Arc<hub::Hub> {
        let hub = Arc::new(
            hub::Hub::observed(self.feed.clone(), conversation_id, operation_id)
                .previews_max(self.backlog_previews_max),
        );
        hub.count_in(&self.output_budget);
        hub
    }
}

/// The gateway's render caches, one per share of the conversations (by a hash of the
/// conversation id). A render holds its own conversation's cache only, so dispatches of
/// different conversations render at once on different workers rather than one after the
/// other behind one lock; a conversation's kept render state and body midstates stay in its
/// own cache. Each is [`RenderCache::one_of`] the shards, so together they keep no more
/// fragments than one cache would, and no fewer than 4 bodies and render states (8 MiB of
/// each) per shard. Fragments are content-addressed: a fragment two shards both rendered is
/// kept twice, never wrongly.
pub struct RenderCaches {
    shards: Box<[Mutex<RenderCache>]>,
    /// Renders run off the async worker (`api::prepare_dispatch`, `tokio::task::block_in_place`).
    off_worker: AtomicU64,
}

impl RenderCaches {
    /// Most shards: past 8, the floors of a shard's kept bodies and render states
    /// ([`RenderCache::one_of`]) make the shards keep more than one cache would, twice at 16.
    pub const SHARDS_MAX: usize = 16;

    /// Two per hardware thread (so that two renders rarely meet on one), at most
    /// [`RenderCaches::SHARDS_MAX`].
    pub fn shards_for_this_machine() -> usize {
        let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        (2 * threads).min(RenderCaches::SHARDS_MAX)
    }

    /// `shards` caches (at least one, at most [`RenderCaches::SHARDS_MAX`]).
    pub fn new(shards: usize) -> RenderCaches {
        let shards = shards.clamp(1, RenderCaches::SHARDS_MAX);
        RenderCaches {
            shards: (0..shards)
                .map(|_| Mutex::new(RenderCache::one_of(shards)))
                .collect(),
            off_worker: AtomicU64::new(0),
        }
    }

    /// The index of the cache `conversation_id` renders through.
    pub fn shard_of(&self, conversation_id: &str) -> usize {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        conversation_id.hash(&mut hasher);
        (hasher.finish() % self.shards.len() as u64) as usize
    }

    /// The cache `conversation_id` renders through.
    pub fn of(&self, conversation_id: &str) -> &Mutex<RenderCache> {
        &self.shards[self.shard_of(conversation_id)]
    }

    /// Number of caches.
    pub fn len(&self) -> usize {
        self.shards.len()
    }

    /// Never: there is at least one cache.
    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    /// Count a render run off the async worker.
    pub fn ran_off_worker(&self) {
        self.off_worker.fetch_add(1, Ordering::Relaxed);
    }

    /// Renders run off the async worker since start (`turnstile_renders_off_worker_total`).
    pub fn off_worker(&self) -> u64 {
        self.off_worker.load(Ordering::Relaxed)
    }

    /// (renders, renders that resumed from a kept state) through every cache since start.
    pub async fn renders(&self) -> (u64, u64) {
        let mut totals = (0, 0);
        for shard in self.shards.iter() {
            let cache = shard.lock().await;
            totals.0 += cache.renders();
            totals.1 += cache.resumed().0;
        }
        totals
    }
}

/// The gateway's clock, read here and passed into the core as a value: epoch milliseconds that
/// never go back and never run slower than the monotonic clock, yet follow the wall clock
/// forward (see [`forward_clock`]). A driver's fence is counted on it, so a wall clock stepped
/// back (NTP, a restored VM) cannot delay a fence, and one stepped forward stops the holder as
/// early as a store reading the same host clock (SQLite) would expire its lease.
pub fn now() -> Timestamp {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    static WALL_AHEAD_MS: AtomicU64 = AtomicU64::new(0);
    let start = *START.get_or_init(std::time::Instant::now);
    let wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as u64);
    let elapsed = start.elapsed().as_millis() as u64;
    let reading = forward_clock(&WALL_AHEAD_MS, wall, elapsed);
    Timestamp(reading.saturating_add_signed(CLOCK_OFFSET_MS.load(std::sync::atomic::Ordering::Relaxed)))
}

/// One reading of a clock that is the monotonic `elapsed` since start plus the largest
/// `wall - elapsed` seen so far (kept in `ahead`): a wall clock stepped forward moves it forward
/// at once; one stepped back is ignored, and the reading goes on at the monotonic pace.
pub fn forward_clock(ahead: &AtomicU64, wall_ms: u64, elapsed_ms: u64) -> u64 {
    let candidate = wall_ms.saturating_sub(elapsed_ms);
    let previous = ahead.fetch_max(candidate, Ordering::AcqRel);
    previous.max(candidate).saturating_add(elapsed_ms)
}

/// The gateway's own clock offset (`test_clock_offset_ms`; 0 outside tests).
static CLOCK_OFFSET_MS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// A fresh id for things the client did not name.
pub fn fresh_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    format!(
        "{:x}{:04x}",
        now().0,
        COUNTER.fetch_add(1, Ordering::Relaxed) & 0xffff
    )
}

/// The gateway's routes.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route(
            "/v1/conversations",
            post(api::create_conversation).get(api::list_conversations),
        )
        .route("/v1/conversations/{id}", get(api::get_conversation))
        .route("/v1/conversations/{id}/turns", post(api::append_turn))
        .route("/v1/conversations/{id}/repair", post(repair::repair_conversation))
        // OpenAI's Conversations API: refused in OpenAI's error shape, whatever the method.
        .route(
            "/v1/conversations/{id}/items",
            any(api::openai_conversations_refused),
        )
        .route(
            "/v1/conversations/{id}/items/{item_id}",
            any(api::openai_conversations_refused),
        )
        .route("/v1/conversations/{id}/dispatch", post(api::dispatch))
        .route("/v1/dispatches/{operation_id}", get(api::get_dispatch))
        .route("/v1/tool-calls", get(api::tool_calls))
        .route(
            "/v1/tool-calls/{conversation_id}/{call_id}/claim",
            post(api::claim_tool_call),
        )
        .route(
            "/v1/tool-calls/{conversation_id}/{call_id}/renew",
            post(api::renew_tool_call),
        )
        .route(
            "/v1/tool-calls/{conversation_id}/{call_id}/release",
            post(api::release_tool_call),
        )
        .route(
            "/v1/tool-calls/{conversation_id}/{call_id}/result",
            post(api::submit_tool_result),
        )
        .route("/v1/quarantine", get(api::quarantine))
        .merge(proxy::router())
        .route("/v1/shadow/diffs", get(proxy::shadow_diffs))
        .route("/metrics", get(api::metrics_text))
        .route("/healthz", get(api::healthz))
        .route("/livez", get(api::livez))
        .route("/readyz", get(api::readyz))
        .route("/", get(crate::console::index))
        .route("/console/{file}", get(crate::console::module))
        .route("/v1/events", get(feed::events))
        .route("/v1/proxy/refusals", get(proxy::refusals::list))
        .fallback(api::fallback)
        .with_state(shared)
}

/// Overrides from the command line.
pub struct Flags {
    /// `--listen`.
    pub listen: Option<String>,
    /// `--store`.
    pub store: Option<String>,
    /// `--sim-url`.
    pub sim_url: Option<String>,
    /// `--config`.
    pub config: Option<String>,
}

/// Run the gateway until a shutdown signal. A failure names its stage (configuration, store,
/// listen: `start.rs`), which the CLI turns into its exit status.
pub async fn run(flags: Flags) -> Result<(), start::Failure> {
    use start::Failure;
    let mut config = match &flags.config {
        Some(path) => Config::load(path).map_err(Failure::config)?,
        None => Config::default(),
    };
    if let Some(listen) = flags.listen {
        config.listen = listen;
    }
    if let Some(store) = flags.store {
        config.store = store;
    }
    if flags.sim_url.is_some() {
        config.sim_url = flags.sim_url;
    }
    let address = config.check().map_err(Failure::config)?;
    let prometheus = metrics::install().map_err(Failure::config)?;
    metrics::set_prices(&config.prices);
    let tracing_on = traces::install(&config).map_err(Failure::config)?;
    let ledger: Arc<dyn Ledger> = Arc::from(
        start::open_store(
            &config.store,
            turnstile_store::StoreOptions {
                timeout_ms: config.store_timeout_ms,
            },
            Duration::from_millis(config.store_connect_retry_ms),
        )
        .await
        .map_err(|error| match error {
            // Not the store's fault: the URL itself is wrong.
            turnstile_store::StoreError::BadUrl => {
                Failure::config(format!("store {}: {error}", redact(&config.store)))
            }
            _ => Failure::store(format!("store {}: {error}", redact(&config.store))),
        })?,
    );

    // The built-in simulator only on the embedded default (`Config::simulator`): it listens on
    // its own loopback port (real HTTP between gateway and simulator) and its scripting routes
    // are also mounted on the gateway, so `POST /sim/script` works there. With tenants or real
    // providers there is no provider `sim` and no `/sim/*` route unless `sim_url` names one.
    let mut sim_control = None;
    let sim_url = match config.simulator() {
        config::Simulator::External(url) => Some(url),
        config::Simulator::Embedded => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(|error| Failure::listen(format!("built-in simulator: {error}")))?;
            let sim_address = listener
                .local_addr()
                .map_err(|error| Failure::listen(error.to_string()))?;
            let sim = crate::sim::Sim::default();
            sim_control = Some(crate::sim::control_router(sim.clone()));
            tokio::spawn(crate::sim::serve(listener, sim));
            Some(format!("http://{sim_address}"))
        }
        config::Simulator::Off => None,
    };
    let timeouts = turnstile_drive::Timeouts {
        head_ms: config.provider_connect_timeout_ms,
        idle_ms: config.provider_idle_timeout_ms,
        attempt_ms: config.provider_attempt_timeout_ms,
    };
    let mut endpoints = HashMap::new();
    if let Some(sim_url) = &sim_url {
        endpoints.insert(
            "sim".to_owned(),
            Endpoint {
                base_url: sim_url.clone(),
                api_key_env: None,
                resume_by_handle: true,
                honours_idempotency_key: false,
                // The simulator counts usage as the vendors do (`simulate::wire`).
                vendor_usage: true,
                text_content: turnstile_adapters::TextContent::Parts,
                timeouts: None,
            },
        );
    }
    for (name, provider) in &config.providers {
        // A missing key would only show up as the provider's 401 on the first dispatch.
        if let Some(variable) = &provider.api_key_env
            && std::env::var_os(variable).is_none()
        {
            return Err(Failure::config(format!(
                "provider {name:?}: the environment variable {variable} is not set"
            )));
        }
        endpoints.insert(
            name.clone(),
            Endpoint {
                base_url: provider.base_url.trim_end_matches('/').to_owned(),
                api_key_env: provider.api_key_env.clone(),
                resume_by_handle: provider.resume_by_handle,
                honours_idempotency_key: provider.honours_idempotency_key,
                vendor_usage: provider.vendor_usage(),
                text_content: provider.text_content,
                timeouts: provider.timeouts(timeouts),
            },
        );
    }
    let mut tenants = Vec::new();
    for tenant in &config.tenants {
        let token = match (&tenant.token, &tenant.token_env) {
            (Some(token), _) => token.clone(),
            (None, Some(variable)) => std::env::var(variable)
                .map_err(|_| Failure::config(format!("tenant {:?}: {variable} is not set", tenant.name)))?,
            (None, None) => unreachable!("Config::check refuses a tenant without a token"),
        };
        if token.is_empty() {
            return Err(Failure::config(format!(
                "tenant {:?}: its token is empty",
                tenant.name
            )));
        }
        // Two tenants with one token: the first would answer for both (a client of one acting
        // as the other). Refused, whatever put them there (a chart's colliding variables).
        if let Some((_, first)) = tenants
            .iter()
            .find(|(known, _): &&(String, String)| *known == token)
        {
            return Err(Failure::config(format!(
                "tenants {first:?} and {:?} have the same token: each tenant needs its own",
                tenant.name
            )));
        }
        tenants.push((token, tenant.name.clone()));
    }
    let mut catalog = Catalog::builtin();
    if let Some(models) = &config.models {
        let value =
            serde_json::to_value(models).map_err(|error| Failure::config(format!("models: {error}")))?;
        catalog
            .apply_overrides(value)
            .map_err(|error| Failure::config(format!("models: {error}")))?;
    }
    // Process-wide, so the longest head bound of any provider: an upper bound only; each
    // target's own head bound is the driver's deadline (decisions: per-provider timeouts).
    let connect_timeout_ms = endpoints
        .values()
        .filter_map(|endpoint| endpoint.timeouts.map(|own| own.head_ms))
        .fold(config.provider_connect_timeout_ms, u64::max);
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(connect_timeout_ms))
        .build()
        .map_err(|error| Failure::config(format!("HTTP client: {error}")))?;
    // Unique per process unless configured: two processes never share a lease holder by
    // accident (a same-host rolling restart would otherwise take the old process's live
    // attempts for its own crashed ones). A restart therefore recovers its predecessor's
    // attempts when their leases run out by the store's clock.
    let holder = config.replica_id.clone().unwrap_or_else(default_replica_id);
    CLOCK_OFFSET_MS.store(config.test_clock_offset_ms, std::sync::atomic::Ordering::Relaxed);
    let feed = Arc::new(feed::Feed::new());
    let shared = Arc::new(Shared {
        ledger,
        client,
        endpoints,
        lease_ms: config.lease_ms.clamp(1, turnstile_core::dispatch::LEASE_MS_MAX),
        idle: Duration::from_millis(config.provider_idle_timeout_ms),
        timeouts,
        holder,
        tenants,
        body_bytes_max: config.body_bytes_max,
        hubs: Mutex::new(HashMap::new()),
        finished_tails: std::sync::Mutex::new(std::collections::VecDeque::new()),
        unknown_since: Mutex::new(HashMap::new()),
        toolsets: Mutex::new(ToolsetCache::new()),
        render_caches: RenderCaches::new(RenderCaches::shards_for_this_machine()),
        kept: kept::KeptConversations::default(),
        catalog,
        prometheus,
        routes: config.routes.clone(),
        shadow: proxy::shadow::Diffs::new(config.shadow_diffs_max, config.shadow_body_bytes_max),
        feed: feed.clone(),
        refusals: proxy::refusals::Refusals::new(config.proxy_refusals_max, feed),
        breaker: breaker::Breaker::new(config.failover_breaker_failures, config.failover_cooldown_ms),
        output_budget: budget::OutputBudget::new(config.provider_output_bytes_max),
        client_call_timeout_ms: config.proxy_client_call_timeout_ms,
        drain: Arc::new(drain::Drain::new()),

        health_timeout: Duration::from_millis(config.health_timeout_ms.max(1)),

        backlog_previews_max: config.stream_backlog_previews_max,
    });

    // The BPE tables load beside recovery, not on the first request that counts tokens. Best
    // effort: without the thread, the first render loads them as before.
    if let Err(error) = std::thread::Builder::new()
        .name("turnstile-warm-up".into())
        .spawn(turnstile_adapters::tokens::warm_up)
    {
        tracing::warn!(%error, "no warm-up thread; the first render loads the tokenizers");
    }
    let recovered = recover(&shared, &shared.holder.clone(), 0)
        .await
        .map_err(Failure::store)?;
    tokio::spawn(sweep(shared.clone()));
    tracing::info!(
        target: "turnstile::start",
        version = env!("CARGO_PKG_VERSION"),
        commit = env!("TURNSTILE_COMMIT"),
        replica_id = %shared.holder,
        store = %redact(&config.store),
        tenants = %config.tenants.iter().map(|tenant| tenant.name.as_str()).collect::<Vec<_>>().join(" "),
        providers = %config.providers.keys().map(String::as_str).collect::<Vec<_>>().join(" "),
        routes = config.routes.len(),
        recovered,
        "starting"
    );

    let listener = listener::bind(address, config.listen_backlog)
        .map_err(|error| Failure::listen(format!("listen on {address}: {error}")))?;
    let bound = listener
        .local_addr()
        .map_err(|error| Failure::listen(error.to_string()))?;
    println!(
        "turnstile serve listening on http://{bound} (store {}, sim {})",
        redact(&config.store),
        sim_url.as_deref().unwrap_or("off")
    );
    let drained = drain_after_signal(shared.clone(), Duration::from_millis(config.drain_timeout_ms));
    let drain = shared.drain.clone();
    let in_flight = shared.clone();
    let mut app = api::harden(router(shared)).layer(axum::middleware::from_fn(log_request));
    if let Some(control) = sim_control {
        app = app.merge(control);
    }
    if tracing_on {
        app = app.layer(axum::middleware::from_fn(traces::accept_traceparent));
    }
    // TCP_NODELAY on client connections: client event streams are many small writes (see
    // `sim::set_nodelay`).
    let descriptors = listener::descriptor_limit();
    let limits = listener::Limits::of(&config).within_descriptors(descriptors);
    if limits.connections_max < config.connections_max {
        tracing::warn!(
            connections_max = config.connections_max,
            serving = limits.connections_max,
            descriptors = descriptors.unwrap_or(0),
            "the descriptor limit (RLIMIT_NOFILE) serves fewer connections than connections_max; \
             raise it (ulimit -n, LimitNOFILE=) to serve connections_max"
        );
    }
    let served = listener::serve(listener, app, limits, drain, drained)
        .await
        .map_err(|error| Failure::listen(error.to_string()));
    if tracing_on {
        // Export what is queued before the process ends (bounded by the SDK's shutdown time).
        let _ = tokio::task::spawn_blocking(traces::shutdown).await;
    }
    tracing::info!(
        target: "turnstile::shutdown",
        in_flight = %in_flight_ids(&in_flight).await,
        "stopped"
    );
    served
}

/// Operation ids of the dispatches this process still holds a client backlog for (at most
/// [`IN_FLIGHT_LOGGED_MAX`], then a count of the rest), for the shutdown lines.
async fn in_flight_ids(shared: &Shared) -> String {
    let hubs = shared.hubs.lock().await;
    let mut ids: Vec<&str> = hubs
        .keys()
        .map(String::as_str)
        .take(IN_FLIGHT_LOGGED_MAX)
        .collect();
    ids.sort_unstable();
    let mut line = ids.join(" ");
    if hubs.len() > IN_FLIGHT_LOGGED_MAX {
        line.push_str(&format!(" (+{} more)", hubs.len() - IN_FLIGHT_LOGGED_MAX));
    }
    line
}

/// Operation ids a shutdown line names at most.
const IN_FLIGHT_LOGGED_MAX: usize = 64;

/// One line per HTTP request the router answered: method, route (the matched pattern, never
/// the ids in the path), status, time to the response head, and the operation id where the
/// request names one (`/v1/dispatches/{operation_id}`, a proxy answer's
/// `x-turnstile-operation-id`). Probes and scrapes (`/healthz`, `/livez`, `/readyz`,
/// `/metrics`) at `debug`, so a scrape every few seconds does not drown the rest.
async fn log_request(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let started = std::time::Instant::now();
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |path| path.as_str().to_owned());
    let named = (route == "/v1/dispatches/{operation_id}")
        .then(|| request.uri().path().rsplit('/').next().map(str::to_owned))
        .flatten();
    let response = next.run(request).await;
    let operation_id = response
        .headers()
        .get("x-turnstile-operation-id")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned)
        .or(named)
        .unwrap_or_default();
    let status = response.status().as_u16();
    let duration_ms = started.elapsed().as_millis() as u64;
    if matches!(route.as_str(), "/healthz" | "/livez" | "/readyz" | "/metrics") {
        tracing::debug!(target: "turnstile::http", %method, %route, status, duration_ms, %operation_id, "request");
    } else {
        tracing::info!(target: "turnstile::http", %method, %route, status, duration_ms, %operation_id, "request");
    }
    response
}

/// Start-up recovery, before the listener opens: this process's (and any expired) live
/// attempts become UNKNOWN, and each UNKNOWN dispatch gets a driver that resumes, replays or
/// waits for the old attempt's lease before a new generation.
async fn recover(shared: &Arc<Shared>, holder: &str, prepared_idle_ms: u64) -> Result<usize, String> {
    // Live attempts of `holder` (this replica's previous incarnation) and attempts of any
    // holder whose lease expired are presumed dead and become UNKNOWN.
    let recoverable =
        turnstile_store::drive::recoverable(shared.ledger.as_ref(), holder, now(), prepared_idle_ms)
            .await
            .map_err(|error| format!("recovery: {error}"))?;
    let mut taken = 0;
    for found in recoverable {
        let operation_id = found.record().operation_id.clone();
        let hub = {
            let mut hubs = shared.hubs.lock().await;
            if hubs.contains_key(&operation_id) {
                continue;
            }
            let record = found.record();
            let hub = shared.hub(&record.conversation_id, &operation_id);
            hubs.insert(operation_id.clone(), hub.clone());
            hub
        };
        let (record, attempt) = match found {
            turnstile_store::drive::Recoverable::Unknown {
                record,
                attempt,
                spent,
                target,
            } => (record, Some((attempt, spent, target))),
            turnstile_store::drive::Recoverable::Prepared { record } => (record, None),
        };
        match api::context_for(shared, record, hub.clone()).await {
            Ok(ctx) => match attempt {
                Some((unknown, spent, target)) => {
                    taken += 1;
                    tracing::info!(
                        target: "turnstile::recovery",
                        %operation_id,
                        generation = unknown.generation.0,
                        target,
                        by = if holder == SWEEP_HOLDER { "sweep" } else { "start-up" },
                        "taking over an interrupted dispatch"
                    );
                    shared.drain.spawn(driver::drive_recovered(
                        shared.clone(),
                        ctx,
                        unknown,
                        spent,
                        target,
                    ));
                }
                None => {
                    taken += 1;
                    tracing::info!(target: "turnstile::recovery", %operation_id, "driving a PREPARED dispatch nobody drives");
                    shared.drain.spawn(driver::drive_new(shared.clone(), ctx));
                }
            },
            Err(error) => {
                shared.hubs.lock().await.remove(&operation_id);
                hub.finish();
                tracing::error!(target: "turnstile::recovery", %operation_id, ?error, "cannot recover");
            }
        }
    }
    Ok(taken)
}

/// Holder id no live lease uses: a sweep with it only finds expired leases.
const SWEEP_HOLDER: &str = "turnstile-sweep";

/// After start-up, keep looking for attempts whose lease ran out (another replica died, or
/// this one lost track): they become UNKNOWN and get a recovery driver here. Several
/// replicas may sweep the same attempt; the store's compare-and-sets let one recover it.
async fn sweep(shared: Arc<Shared>) {
    let period = Duration::from_millis(turnstile_store::drive::sweep_period_ms(shared.lease_ms));
    loop {
        tokio::select! {
            () = tokio::time::sleep(period) => {}
            // A draining process takes nothing over.
            () = shared.drain.reached(drain::Phase::Draining) => return,
        }
        if let Err(error) = recover(&shared, SWEEP_HOLDER, shared.lease_ms).await {
            tracing::warn!(%error, "lease sweep failed");
        }
    }
}

fn default_replica_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_owned());
    // Host, process and a start nonce (the start instant in nanoseconds): unique per process.
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    format!("turnstile@{host}/{}/{nonce:x}", std::process::id())
}

/// A store URL without its password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &url[scheme + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// How long the drivers left at the drain timeout get to stop before the store is asked to
/// release their leases (a driver inside a store write finishes it first); past it the
/// release is skipped and the leases run out by the store's clock.
const HAND_OVER_WAIT: Duration = Duration::from_secs(5);

/// After SIGINT/SIGTERM: drain for up to `drain_timeout`, then hand what is left to recovery
/// (`drain.rs`). Completes when the listener may close.
async fn drain_after_signal(shared: Arc<Shared>, drain_timeout: Duration) {
    shutdown_signal().await;
    let drain = &shared.drain;
    drain.enter(drain::Phase::Draining);
    tracing::info!(
        target: "turnstile::shutdown",
        running = drain.running(),
        in_flight = %in_flight_ids(&shared).await,
        drain_timeout_ms = drain_timeout.as_millis() as u64,
        "shutdown signal: no new requests; live dispatches run on"
    );
    if tokio::time::timeout(drain_timeout, drain.idle()).await.is_ok() {
        tracing::info!("drained: nothing is left to hand over");
        return;
    }
    drain.enter(drain::Phase::HandingOver);
    tracing::warn!(
        target: "turnstile::shutdown",
        running = drain.running(),
        in_flight = %in_flight_ids(&shared).await,
        "drain timeout passed: the dispatches left are handed to recovery"
    );
    if tokio::time::timeout(HAND_OVER_WAIT, drain.idle()).await.is_err() {
        tracing::warn!(
            running = drain.running(),
            "not every driver stopped in time: their leases run out by the store's clock"
        );
        return;
    }
    // Every driver is gone, and with it every provider connection of this holder.
    let released = match shared.ledger.store_now().await {
        Ok(store_now) => shared.ledger.release_holder(&shared.holder, store_now).await,
        Err(error) => Err(error),
    };
    match released {
        Ok(count) => tracing::info!(count, "live attempts released to recovery"),
        Err(error) => {
            tracing::warn!(%error, "could not release the live attempts: their leases run out by the store's clock")
        }
    }
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = interrupt => {}
        _ = terminate => {}
    }
}

#[cfg(test)]
mod tests {
    use super::{RenderCaches, forward_clock};
    use std::sync::atomic::AtomicU64;

    /// Issue 47 (review finding 5): the fence's clock never goes back and never slows down when
    /// the wall clock is stepped back, and follows a step forward at once. Red with the plain
    /// wall clock (the reading after the step back would be 1,000 s earlier).
    #[test]
    fn the_clock_ignores_a_wall_step_back_and_follows_a_step_forward() {
        let ahead = AtomicU64::new(0);
        let start_wall = 1_800_000_000_000;
        assert_eq!(forward_clock(&ahead, start_wall, 0), start_wall);
        assert_eq!(forward_clock(&ahead, start_wall + 400, 400), start_wall + 400);
        // Stepped back 1,000 s, 600 ms of monotonic time later: 1,000 ms after the start.
        assert_eq!(
            forward_clock(&ahead, start_wall + 1_000 - 1_000_000, 1_000),
            start_wall + 1_000
        );
        // Stepped forward 60 s: the reading follows at once, then runs on monotonically.
        assert_eq!(
            forward_clock(&ahead, start_wall + 61_100, 1_100),
            start_wall + 61_100
        );
        assert_eq!(
            forward_clock(&ahead, start_wall + 1_200, 1_200),
            start_wall + 61_200
        );
    }
    use turnstile_adapters::render::RenderCache;

    /// Issue 21: renders of two conversations in different shards do not wait on one lock,
    /// while two renders of one conversation do (its kept render state is one); together the
    /// shards keep no more than one cache's bounds; a conversation always maps to one shard.
    #[test]
    fn conversations_render_through_their_own_shard_and_the_shards_share_one_bound() {
        let caches = RenderCaches::new(4);
        assert_eq!(caches.len(), 4);
        let first = "conversation-0";
        let other = (1..100)
            .map(|index| format!("conversation-{index}"))
            .find(|id| caches.shard_of(id) != caches.shard_of(first))
            .expect("100 ids do not all hash to one of 4 shards");
        assert_eq!(caches.shard_of(first), caches.shard_of(first));
        let held = caches.of(first).try_lock().expect("nothing holds it");
        assert!(
            caches.of(&other).try_lock().is_ok(),
            "another conversation's render does not wait for this one"
        );
        assert!(
            caches.of(first).try_lock().is_err(),
            "a second render of the same conversation waits"
        );
        drop(held);
        let (fragments, bytes) = RenderCache::new().bounds();
        let mut total = (0, 0);
        for index in 0..caches.len() {
            let id = (0..1000)
                .map(|n| format!("c-{n}"))
                .find(|id| caches.shard_of(id) == index)
                .expect("every shard is reached");
            let (shard_fragments, shard_bytes) = caches.of(&id).try_lock().unwrap().bounds();
            total = (total.0 + shard_fragments, total.1 + shard_bytes);
        }
        assert!(total.0 <= fragments && total.1 <= bytes, "{total:?}");
        assert_eq!(RenderCaches::new(0).len(), 1);
        assert_eq!(RenderCaches::new(1000).len(), RenderCaches::SHARDS_MAX);
    }
}
