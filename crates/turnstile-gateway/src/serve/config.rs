//! Gateway configuration: a TOML file (`--config FILE`) whose keys match the command-line flags,
//! plus tenants and real providers. Every key and its default is listed in
//! `docs/operating.md`; flags override the file.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;

/// Default listen address (spec).
pub const LISTEN_DEFAULT: &str = "127.0.0.1:8080";
/// Default store (spec: SQLite at `./turnstile.db`).
pub const STORE_DEFAULT: &str = "sqlite:./turnstile.db";
/// Largest HTTP request body the API accepts.
/// Default `header_read_timeout_ms`: 10 s, far above a real client's header time on any link,
/// and short enough that an idle or trickling connection frees its descriptor soon.
pub const HEADER_READ_TIMEOUT_MS_DEFAULT: u64 = 10_000;
/// Default `connections_max`: well under the usual 1,024-descriptor soft limit, leaving room for
/// the store, provider connections and the overflow answers.
pub const CONNECTIONS_MAX_DEFAULT: usize = 768;
/// Default `requests_per_connection_max`: a kept-alive connection is closed after this many
/// requests (nginx's `keepalive_requests` default), so no client holds one for ever.
pub const REQUESTS_PER_CONNECTION_MAX_DEFAULT: u64 = 1_000;
/// Default `client_write_timeout_ms`: 30 s. A client that has taken no byte for that long
/// while the gateway has bytes for it is gone or stuck; a slow mobile link still takes a few
/// KiB in that time. Its connection is closed so that its buffers and the dispatch backlog it
/// holds are freed (its dispatch is unaffected).
pub const CLIENT_WRITE_TIMEOUT_MS_DEFAULT: u64 = 30_000;
/// Default `drain_timeout_ms`: 30 s, Kubernetes' default grace period (systemd's
/// `TimeoutStopSec` is 90 s). Set it a little under the grace period the process gets, and
/// above the longest stream you expect.
pub const DRAIN_TIMEOUT_MS_DEFAULT: u64 = 30_000;
/// Largest `drain_timeout_ms`: one hour.
pub const DRAIN_TIMEOUT_MS_MAX: u64 = 3_600_000;

/// Default `body_read_timeout_ms`: 30 s for a request's whole body once its headers are in.
/// The largest body (`body_bytes_max`, 8 MiB) needs about 280 KB/s to make it; a client that
/// sends part of a body and then nothing is gone or hostile (a body slow-loris).
pub const BODY_READ_TIMEOUT_MS_DEFAULT: u64 = 30_000;
/// Default `listen_backlog`: connections the kernel queues before the gateway accepts them. A
/// burst larger than it is reset by the kernel instead of answered 503 `overloaded` (128, the
/// old value, reset 135 of 500 simultaneous connects on a busy host). Linux caps it at
/// `net.core.somaxconn` (4096 by default since 5.4).
pub const LISTEN_BACKLOG_DEFAULT: u32 = 1024;
/// Default `store_timeout_ms` ([`turnstile_store::STORE_TIMEOUT_MS_DEFAULT`]): what SQLite
/// already waited for a write lock.
pub const STORE_TIMEOUT_MS_DEFAULT: u64 = turnstile_store::STORE_TIMEOUT_MS_DEFAULT;
/// Largest `store_connect_retry_ms`: ten minutes. The default, 0, fails at the first refusal.
pub const STORE_CONNECT_RETRY_MS_MAX: u64 = 600_000;
/// Default `health_timeout_ms`: `/healthz` and `/readyz` answer within 2 s whatever the store
/// does, under the 1 s–10 s probe timeouts load balancers and Kubernetes use once raised from
/// Kubernetes' 1 s default (docs/operating.md, "Health and readiness").
pub const HEALTH_TIMEOUT_MS_DEFAULT: u64 = 2_000;
pub const BODY_BYTES_MAX_DEFAULT: usize = 8 * 1024 * 1024;
/// Provider request timeout: connecting and receiving the response head.
pub const PROVIDER_CONNECT_TIMEOUT_MS_DEFAULT: u64 = 10_000;
/// Longest silence between two stream chunks before the attempt counts as interrupted.
pub const PROVIDER_IDLE_TIMEOUT_MS_DEFAULT: u64 = 60_000;
/// Default whole-attempt bound (10 minutes).
pub const PROVIDER_ATTEMPT_TIMEOUT_MS_DEFAULT: u64 = 600_000;

/// Why a route's provider is refused; `sim` says when it exists.
fn unknown_provider(name: &str) -> String {
    if name == "sim" {
        "provider \"sim\" exists only on the embedded default (no providers, no tenants) or with \
         sim_url"
            .to_owned()
    } else {
        format!("unknown provider {name:?}")
    }
}

/// Where provider `sim` is ([`Config::simulator`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Simulator {
    /// The built-in simulator, with its control routes on the gateway.
    Embedded,
    /// An external `turnstile sim` at this base URL (`sim_url`).
    External(String),
    /// No provider `sim` and no `/sim/*` route.
    Off,
}

/// How log lines are written: `text` (one human line each, coloured only on a terminal) or
/// `json` (one JSON object per line, for a log pipeline).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Most `[[prices]]` entries.
pub const PRICES_MAX: usize = 4096;

/// One model's price, US dollars per million tokens of each kind, as the operator's contract
/// with the provider says (`[[prices]]`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Configured provider name.
    pub provider: String,
    /// Model name as dispatched.
    pub model: String,
    /// Input tokens (not counting cache reads or writes where the provider counts them apart).
    pub input_usd_per_mtok: f64,
    /// Output tokens (reasoning tokens included, as providers bill them).
    pub output_usd_per_mtok: f64,
    /// Input tokens read from the prompt cache (default: the input price).
    #[serde(default)]
    pub cached_usd_per_mtok: Option<f64>,
    /// Input tokens written to the prompt cache (default: the input price).
    #[serde(default)]
    pub cache_write_usd_per_mtok: Option<f64>,
}

impl Price {
    /// Dollars per token of `kind` (`input`, `output`, `cached`, `cache_write`).
    pub fn per_token(&self, kind: &str) -> f64 {
        let per_mtok = match kind {
            "output" => self.output_usd_per_mtok,
            "cached" => self.cached_usd_per_mtok.unwrap_or(self.input_usd_per_mtok),
            "cache_write" => self.cache_write_usd_per_mtok.unwrap_or(self.input_usd_per_mtok),
            _ => self.input_usd_per_mtok,
        };
        per_mtok / 1_000_000.0
    }
}

/// The whole configuration.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Listen address.
    #[serde(default = "listen_default")]
    pub listen: String,
    /// `sqlite:PATH` or `postgres://…`.
    #[serde(default = "store_default")]
    pub store: String,
    /// Use an external `turnstile sim` as provider `sim` instead of the built-in one.
    #[serde(default)]
    pub sim_url: Option<String>,
    /// Attempt lease in milliseconds (spec default 5 s).
    #[serde(default = "lease_ms_default")]
    pub lease_ms: u64,
    /// Largest API request body.
    #[serde(default = "body_bytes_max_default")]
    pub body_bytes_max: usize,
    /// Time a client connection has to deliver a request's headers once it is ready for one
    /// (new or kept alive): ends slow-loris and idle keep-alive connections (`listener.rs`).
    #[serde(default = "header_read_timeout_default")]
    pub header_read_timeout_ms: u64,
    /// Client connections served at once; beyond it a connection gets 503 `overloaded`
    /// (`GET /healthz` still answers).
    #[serde(default = "connections_max_default")]
    pub connections_max: usize,
    /// Requests served on one kept-alive connection before it is closed.
    #[serde(default = "requests_per_connection_max_default")]
    pub requests_per_connection_max: u64,
    /// Longest a client connection may take no byte while the gateway has bytes to write to
    /// it; then it is closed (`listener.rs`).
    #[serde(default = "client_write_timeout_default")]
    pub client_write_timeout_ms: u64,
    /// After SIGTERM/SIGINT, how long live dispatches may run on before what is left is
    /// handed to recovery (`drain.rs`); 0 hands over at once.
    #[serde(default = "drain_timeout_default")]
    pub drain_timeout_ms: u64,

    /// Longest a request's body may take to arrive once its headers are in; then the request
    /// is answered 408 `body_timeout` and its connection closed (`listener.rs`).
    #[serde(default = "body_read_timeout_default")]
    pub body_read_timeout_ms: u64,
    /// Connections the kernel queues for the listener before they are accepted.
    #[serde(default = "listen_backlog_default")]
    pub listen_backlog: u32,
    /// Longest one store operation may take (PostgreSQL: also `statement_timeout` and
    /// `lock_timeout`); past it the request gets 503 `store_unavailable`.
    #[serde(default = "store_timeout_default")]
    pub store_timeout_ms: u64,
    /// At start, how long a store that cannot be reached yet (connection refused, unknown
    /// host, no answer, server starting up) is tried again before the process exits with the
    /// store status; 0 (default) tries once. Credentials, TLS and a missing database are never
    /// retried (`serve/start.rs`).
    #[serde(default)]
    pub store_connect_retry_ms: u64,
    /// Longest `/healthz` and `/readyz` wait for the store before they answer 503.
    #[serde(default = "health_timeout_default")]
    pub health_timeout_ms: u64,
    /// Most previews a dispatch's client backlog keeps (`hub.rs`); older ones are dropped and
    /// a client behind them is told of the gap. Every other event is kept.
    #[serde(default = "stream_backlog_previews_max_default")]
    pub stream_backlog_previews_max: usize,
    /// Provider connect + response-head timeout.
    #[serde(default = "connect_timeout_default")]
    pub provider_connect_timeout_ms: u64,
    /// Longest gap between stream chunks.
    #[serde(default = "idle_timeout_default")]
    pub provider_idle_timeout_ms: u64,
    /// Longest one attempt may take from its request to the end of its body, whatever arrives
    /// (an endless or ping-only stream ends here).
    #[serde(default = "attempt_timeout_default")]
    pub provider_attempt_timeout_ms: u64,
    /// One budget for provider output held in memory by all dispatches of this process, in
    /// bytes (0: none). Past it the dispatch holding the most ends (`output_budget_exhausted`).
    #[serde(default = "output_bytes_default")]
    pub provider_output_bytes_max: u64,
    /// Failover's circuit breaker: consecutive failures of one target (`provider/model`) that
    /// make it cool down (`breaker.rs`).
    #[serde(default = "breaker_failures_default")]
    pub failover_breaker_failures: u32,
    /// How long a target whose breaker opened is skipped while another target is left.
    #[serde(default = "breaker_cooldown_default")]
    pub failover_cooldown_ms: u64,
    /// Replica id used as lease holder (default: host, process id and a start nonce).
    #[serde(default)]
    pub replica_id: Option<String>,
    /// Tests only: this process's clock runs this many ms ahead (negative: behind) of the
    /// system clock. Leases are judged by the store's clock, so a skewed replica must behave
    /// exactly like a punctual one; this is how the tests show it.
    #[serde(default)]
    pub test_clock_offset_ms: i64,
    /// Bearer-token tenants. None configured: no token needed, loopback only.
    #[serde(default)]
    pub tenants: Vec<Tenant>,
    /// Real providers by name (the simulator is always provider `sim`).
    #[serde(default)]
    pub providers: BTreeMap<String, Provider>,
    /// Model catalog overrides (context windows, output caps), as the adapters' catalog takes
    /// them.
    #[serde(default)]
    pub models: Option<toml::Value>,
    /// Drop-in proxy routes, first match wins. None configured: every model on every proxy
    /// endpoint goes to the simulator with the endpoint's own API (mode `on`).
    #[serde(default)]
    pub routes: Vec<Route>,
    /// How many shadow diffs `GET /v1/shadow/diffs` keeps (oldest dropped first).
    #[serde(default = "shadow_diffs_max_default")]
    pub shadow_diffs_max: usize,
    /// OTLP/HTTP collector base URL for traces (`/v1/traces` is appended), e.g.
    /// `http://127.0.0.1:4318`; overrides `OTEL_EXPORTER_OTLP_ENDPOINT`. Unset and no
    /// endpoint in the environment: no traces (`serve/traces.rs`).
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// Record message content on dispatch spans (`gen_ai.input.messages`, …). Off by default:
    /// content is user data.
    #[serde(default)]
    pub otlp_capture_content: bool,
    /// How log lines are written to standard error (`--log-format` overrides it).
    #[serde(default)]
    pub log_format: LogFormat,
    /// Per-model prices for `turnstile_cost_microdollars_total` (none built in: a catalogue in
    /// the binary would go stale).
    #[serde(default)]
    pub prices: Vec<Price>,
    /// How many proxy refusals `GET /v1/proxy/refusals` keeps (oldest dropped first).
    #[serde(default = "proxy_refusals_max_default")]
    pub proxy_refusals_max: usize,
    /// How long a tool call handed to a proxy client counts as pending without a follow-up
    /// carrying its result, by the store's clock; then it reads `client_abandoned`
    /// (1..=[`turnstile_store::CLIENT_CALL_TIMEOUT_MS_MAX`]).
    #[serde(default = "client_call_timeout_default")]
    pub proxy_client_call_timeout_ms: u64,
    /// Bytes of each body (the client's and ours) a shadow record keeps for the console's diff.
    #[serde(default = "shadow_body_bytes_max_default")]
    pub shadow_body_bytes_max: usize,
}

/// Rollout mode of a proxy route.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Forward the client's original bytes; render ours beside them and record the diff.
    Shadow,
    /// Ours for requests without tools, the original (with a diff recorded) otherwise.
    OnNoTools,
    /// Ours: import, validate, render, dispatch through the ledger.
    On,
}

/// How a proxy route answers a streamed client request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AnswerMode {
    /// Forward preview text as it arrives; a failover whose text diverges from what was sent
    /// ends the stream with an error (`preview_diverged`).
    #[default]
    Stream,
    /// Forward nothing until the commit, then stream the committed turn at once: after a
    /// failover the client gets the fallback's whole answer, never an error for divergence.
    Commit,
}

/// One proxy route: which client requests it takes and where they go.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// The endpoint's API: `openai-chat`, `openai-responses`, `anthropic-messages`, `gemini`.
    pub api: String,
    /// Client model: exact name, a prefix ending in `*`, or `*` (default).
    #[serde(default = "any_model")]
    pub model: String,
    /// Rollout mode (default `on`).
    #[serde(default = "mode_default")]
    pub mode: Mode,
    /// Provider for our request (`sim` or a configured provider).
    pub provider: String,
    /// Adapter id for our request; its API may differ from `api` (an Anthropic client served by
    /// an OpenAI model). Rolling back is naming an older version here.
    pub adapter: String,
    /// Model for our request (default: the client's).
    #[serde(default)]
    pub target_model: Option<String>,
    /// Where the client's original bytes go in `shadow` and `on-no-tools` (default `provider`);
    /// it must speak `api`.
    #[serde(default)]
    pub original_provider: Option<String>,
    /// Failover targets, in order, tried while nothing of the dispatch is committed
    /// (`shared/spec/gateway-api.md`, "Failover"). Each renders its own request from the same
    /// history; its adapter's API may differ from the route's.
    #[serde(default)]
    pub fallbacks: Vec<Fallback>,
    /// How a streamed client request is answered (default `stream`).
    #[serde(default)]
    pub answer: AnswerMode,
    /// Repair a request's illegal history before dispatch (`turnstile_core::repair`, pending
    /// calls closed) instead of refusing it (default `false`: refused, as always).
    #[serde(default)]
    pub repair_history: bool,
}

/// One failover target of a route.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fallback {
    /// Provider (`sim` or a configured provider).
    pub provider: String,
    /// Adapter id.
    pub adapter: String,
    /// Model (default: the route's `target_model`, else the client's).
    #[serde(default)]
    pub target_model: Option<String>,
}

impl Route {
    /// Whether this route takes a request for `model` on `api`.
    pub fn matches(&self, api: &str, model: &str) -> bool {
        self.api == api
            && match self.model.strip_suffix('*') {
                Some(prefix) => model.starts_with(prefix),
                None => self.model == model,
            }
    }
}

fn breaker_failures_default() -> u32 {
    super::breaker::FAILURES_DEFAULT
}
fn breaker_cooldown_default() -> u64 {
    super::breaker::COOLDOWN_MS_DEFAULT
}
fn any_model() -> String {
    "*".into()
}
fn mode_default() -> Mode {
    Mode::On
}
fn shadow_diffs_max_default() -> usize {
    100
}
fn proxy_refusals_max_default() -> usize {
    super::proxy::refusals::PROXY_REFUSALS_MAX_DEFAULT
}
fn client_call_timeout_default() -> u64 {
    turnstile_store::CLIENT_CALL_TIMEOUT_MS_DEFAULT
}
fn shadow_body_bytes_max_default() -> usize {
    super::proxy::shadow::SHADOW_BODY_BYTES_MAX_DEFAULT
}

/// One tenant.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    /// Tenant name (conversations are scoped by it).
    pub name: String,
    /// The bearer token, literally (tests), or…
    #[serde(default)]
    pub token: Option<String>,
    /// …the environment variable that holds it (production).
    #[serde(default)]
    pub token_env: Option<String>,
}

/// One real provider.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Provider {
    /// Base URL, e.g. `https://api.anthropic.com`.
    pub base_url: String,
    /// Environment variable holding the API key (the key itself is never in the file).
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Resume streams by handle (OpenAI Responses background mode).
    #[serde(default)]
    pub resume_by_handle: bool,
    /// The provider honours our idempotency key (no real one does today).
    #[serde(default)]
    pub honours_idempotency_key: bool,
    /// What an OpenAI Chat usage short of the streamed output means: `strict` (a delta
    /// arrived twice: the attempt is retracted) or `notice` (the upstream counts its own way:
    /// a metric and a log line). Default: `strict` for OpenAI's own API
    /// (`https://api.openai.com`), `notice` for every other base URL ([`Provider::vendor_usage`]).
    #[serde(default)]
    pub usage_check: Option<UsageCheck>,
    /// OpenAI Chat: `parts` (default) writes a message's text as an array of text parts,
    /// `string` as one string where every part of the message is text, for compatible
    /// servers that take only that form. Other APIs ignore it.
    #[serde(default)]
    pub text_content: turnstile_adapters::TextContent,
    /// This provider's connect + response-head bound; default `provider_connect_timeout_ms`.
    /// An upstream that retries internally (a LiteLLM proxy) needs one above its own retry
    /// budget, or its late answer is an unknown outcome (decisions: per-provider timeouts).
    #[serde(default)]
    pub connect_timeout_ms: Option<u64>,
    /// This provider's longest gap between stream chunks; default `provider_idle_timeout_ms`.
    #[serde(default)]
    pub idle_timeout_ms: Option<u64>,
    /// This provider's bound on one whole attempt; default `provider_attempt_timeout_ms`.
    #[serde(default)]
    pub attempt_timeout_ms: Option<u64>,
}

/// [`Provider::usage_check`].
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum UsageCheck {
    /// The upstream counts usage with the vendor's tokenizer.
    Strict,
    /// The upstream may count its own way.
    Notice,
}

impl Provider {
    /// This provider's own bounds on an attempt's waits, each defaulting to the global one;
    /// `None` if it sets none (its targets use the global bounds).
    pub fn timeouts(&self, global: turnstile_drive::Timeouts) -> Option<turnstile_drive::Timeouts> {
        if self.connect_timeout_ms.is_none()
            && self.idle_timeout_ms.is_none()
            && self.attempt_timeout_ms.is_none()
        {
            return None;
        }
        Some(turnstile_drive::Timeouts {
            head_ms: self.connect_timeout_ms.unwrap_or(global.head_ms),
            idle_ms: self.idle_timeout_ms.unwrap_or(global.idle_ms),
            attempt_ms: self.attempt_timeout_ms.unwrap_or(global.attempt_ms),
        })
    }

    /// Whether the upstream counts usage as the vendor does (see [`Provider::usage_check`]).
    pub fn vendor_usage(&self) -> bool {
        match self.usage_check {
            Some(check) => check == UsageCheck::Strict,
            None => {
                let rest = self.base_url.strip_prefix("https://").unwrap_or("");
                let host = rest.split(['/', ':']).next().unwrap_or("");
                host.eq_ignore_ascii_case("api.openai.com")
            }
        }
    }
}

fn listen_default() -> String {
    LISTEN_DEFAULT.into()
}
fn store_default() -> String {
    STORE_DEFAULT.into()
}
fn lease_ms_default() -> u64 {
    turnstile_core::dispatch::LEASE_MS_DEFAULT
}
fn body_bytes_max_default() -> usize {
    BODY_BYTES_MAX_DEFAULT
}
fn header_read_timeout_default() -> u64 {
    HEADER_READ_TIMEOUT_MS_DEFAULT
}
fn connections_max_default() -> usize {
    CONNECTIONS_MAX_DEFAULT
}
fn requests_per_connection_max_default() -> u64 {
    REQUESTS_PER_CONNECTION_MAX_DEFAULT
}
fn client_write_timeout_default() -> u64 {
    CLIENT_WRITE_TIMEOUT_MS_DEFAULT
}
fn drain_timeout_default() -> u64 {
    DRAIN_TIMEOUT_MS_DEFAULT
}
fn body_read_timeout_default() -> u64 {
    BODY_READ_TIMEOUT_MS_DEFAULT
}
fn listen_backlog_default() -> u32 {
    LISTEN_BACKLOG_DEFAULT
}
fn store_timeout_default() -> u64 {
    STORE_TIMEOUT_MS_DEFAULT
}
fn health_timeout_default() -> u64 {
    HEALTH_TIMEOUT_MS_DEFAULT
}
fn stream_backlog_previews_max_default() -> usize {
    super::hub::BACKLOG_PREVIEWS_MAX
}
fn connect_timeout_default() -> u64 {
    PROVIDER_CONNECT_TIMEOUT_MS_DEFAULT
}
fn idle_timeout_default() -> u64 {
    PROVIDER_IDLE_TIMEOUT_MS_DEFAULT
}
fn attempt_timeout_default() -> u64 {
    PROVIDER_ATTEMPT_TIMEOUT_MS_DEFAULT
}

/// Default of `provider_output_bytes_max`: 1 GiB across all dispatches.
pub const PROVIDER_OUTPUT_BYTES_MAX_DEFAULT: u64 = 1 << 30;

fn output_bytes_default() -> u64 {
    PROVIDER_OUTPUT_BYTES_MAX_DEFAULT
}

impl Default for Config {
    fn default() -> Config {
        // Invariant: an empty document has every key defaulted.
        toml::from_str("").expect("the empty config is valid")
    }
}

impl Config {
    /// Read a config file.
    pub fn load(path: &str) -> Result<Config, String> {
        let text = std::fs::read_to_string(path).map_err(|error| format!("cannot read {path}: {error}"))?;
        toml::from_str(&text).map_err(|error| format!("{path}: {error}"))
    }

    /// Where provider `sim` is, if anywhere. The built-in simulator (whose `/sim/*` control
    /// routes are mounted on the gateway, with no token) runs only on the embedded default: no
    /// `sim_url`, no real provider and no tenant. With tenants or real providers there is no
    /// provider `sim` and no `/sim/*` route unless `sim_url` names an external simulator on
    /// purpose (its control routes are then that process's, never the gateway's).
    pub fn simulator(&self) -> Simulator {
        match &self.sim_url {
            Some(url) => Simulator::External(url.trim_end_matches('/').to_owned()),
            None if self.providers.is_empty() && self.tenants.is_empty() => Simulator::Embedded,
            None => Simulator::Off,
        }
    }

    /// Refuse configurations that would be unsafe to run.
    pub fn check(&self) -> Result<SocketAddr, String> {
        let address: SocketAddr = self
            .listen
            .parse()
            .map_err(|error| format!("listen {:?}: {error}", self.listen))?;
        if self.tenants.is_empty() && !address.ip().is_loopback() {
            return Err(format!(
                "no tenants are configured, so the gateway needs no token and refuses to listen on \
                 {address}: configure [[tenants]] or listen on a loopback address"
            ));
        }
        if self.prices.len() > PRICES_MAX {
            return Err(format!("[[prices]]: at most {PRICES_MAX} entries"));
        }
        let mut priced = std::collections::HashSet::new();
        for price in &self.prices {
            let amounts = [
                Some(price.input_usd_per_mtok),
                Some(price.output_usd_per_mtok),
                price.cached_usd_per_mtok,
                price.cache_write_usd_per_mtok,
            ];
            if amounts
                .into_iter()
                .flatten()
                .any(|amount| !amount.is_finite() || amount < 0.0)
            {
                return Err(format!(
                    "[[prices]] {}/{}: prices are finite and not negative",
                    price.provider, price.model
                ));
            }
            if !priced.insert((price.provider.as_str(), price.model.as_str())) {
                return Err(format!(
                    "[[prices]] {}/{}: priced twice",
                    price.provider, price.model
                ));
            }
        }
        for (index, tenant) in self.tenants.iter().enumerate() {
            if self.tenants[..index]
                .iter()
                .any(|earlier| earlier.name == tenant.name)
            {
                return Err(format!("tenant {:?} is named twice", tenant.name));
            }
            // A tenant name is a store-id prefix ending in `~`: a `~` (or anything outside a
            // plain id) in it could make one tenant's ids a prefix of another's.
            let plain = !tenant.name.is_empty()
                && tenant.name.len() <= 64
                && tenant
                    .name
                    .bytes()
                    .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.'));
            if !plain {
                return Err(format!(
                    "tenant name {:?} must be 1–64 characters of A–Z a–z 0–9 - _ .",
                    tenant.name
                ));
            }
            if tenant.token.is_none() && tenant.token_env.is_none() {
                return Err(format!(
                    "tenant {:?} has neither token nor token_env",
                    tenant.name
                ));
            }
        }
        for (index, route) in self.routes.iter().enumerate() {
            let simulator = !matches!(self.simulator(), Simulator::Off);
            let known = |name: &str| (simulator && name == "sim") || self.providers.contains_key(name);
            if !matches!(
                route.api.as_str(),
                "openai-chat" | "openai-responses" | "anthropic-messages" | "gemini"
            ) {
                return Err(format!("routes[{index}]: unknown api {:?}", route.api));
            }
            if route.adapter.parse::<turnstile_adapters::AdapterId>().is_err() {
                return Err(format!("routes[{index}]: unknown adapter {:?}", route.adapter));
            }
            if !known(&route.provider) {
                return Err(format!("routes[{index}]: {}", unknown_provider(&route.provider)));
            }
            if let Some(original) = &route.original_provider {
                if !known(original) {
                    return Err(format!(
                        "routes[{index}]: original_provider: {}",
                        unknown_provider(original)
                    ));
                }
            }
            if route.fallbacks.len() + 1 > turnstile_store::TARGETS_PER_DISPATCH_MAX {
                return Err(format!(
                    "routes[{index}]: at most {} fallbacks",
                    turnstile_store::TARGETS_PER_DISPATCH_MAX - 1
                ));
            }
            for (position, fallback) in route.fallbacks.iter().enumerate() {
                if fallback.adapter.parse::<turnstile_adapters::AdapterId>().is_err() {
                    return Err(format!(
                        "routes[{index}].fallbacks[{position}]: unknown adapter {:?}",
                        fallback.adapter
                    ));
                }
                if !known(&fallback.provider) {
                    return Err(format!(
                        "routes[{index}].fallbacks[{position}]: {}",
                        unknown_provider(&fallback.provider)
                    ));
                }
            }
        }
        if self.providers.contains_key("sim") {
            return Err("provider name \"sim\" is reserved for the simulator (use sim_url)".into());
        }
        if self.drain_timeout_ms > DRAIN_TIMEOUT_MS_MAX {
            return Err(format!(
                "drain_timeout_ms must be 0–{DRAIN_TIMEOUT_MS_MAX} (ms), not {}",
                self.drain_timeout_ms
            ));
        }
        if self.store_connect_retry_ms > STORE_CONNECT_RETRY_MS_MAX {
            return Err(format!(
                "store_connect_retry_ms must be 0–{STORE_CONNECT_RETRY_MS_MAX} (ms), not {}",
                self.store_connect_retry_ms
            ));
        }
        if !(1..=turnstile_store::CLIENT_CALL_TIMEOUT_MS_MAX).contains(&self.proxy_client_call_timeout_ms) {
            return Err(format!(
                "proxy_client_call_timeout_ms must be 1–{} (ms), not {}",
                turnstile_store::CLIENT_CALL_TIMEOUT_MS_MAX,
                self.proxy_client_call_timeout_ms
            ));
        }
        Ok(address)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_name_that_could_overlap_another_tenants_ids_is_refused() {
        for (name, ok) in [
            ("acme", true),
            ("a~proxy-x", false),
            ("", false),
            ("a b", false),
            ("team_1.eu-2", true),
        ] {
            let config: Config =
                toml::from_str(&format!("[[tenants]]\nname = {name:?}\ntoken = \"t\"\n")).unwrap();
            assert_eq!(config.check().is_ok(), ok, "{name:?}");
        }
    }

    #[test]
    fn routes_name_known_apis_adapters_and_providers() {
        let route = |body: &str| {
            toml::from_str::<Config>(&format!("[[routes]]\n{body}\n"))
                .unwrap()
                .check()
        };
        assert!(
            route("api = \"openai-chat\"\nprovider = \"sim\"\nadapter = \"anthropic-messages@2\"").is_ok()
        );
        assert!(route("api = \"openai-chats\"\nprovider = \"sim\"\nadapter = \"openai-chat@1\"").is_err());
        assert!(route("api = \"openai-chat\"\nprovider = \"sim\"\nadapter = \"openai-chat@9\"").is_err());
        assert!(route("api = \"openai-chat\"\nprovider = \"nobody\"\nadapter = \"openai-chat@1\"").is_err());
        assert!(
            route(
                "api = \"gemini\"\nprovider = \"sim\"\nadapter = \"gemini@1\"\noriginal_provider = \"nobody\""
            )
            .is_err()
        );
    }

    #[test]
    fn the_proxy_client_call_bound_defaults_to_an_hour_and_is_refused_outside_its_range() {
        let bound = |text: &str| toml::from_str::<Config>(text).unwrap();
        assert_eq!(
            bound("").proxy_client_call_timeout_ms,
            turnstile_store::CLIENT_CALL_TIMEOUT_MS_DEFAULT
        );
        assert_eq!(turnstile_store::CLIENT_CALL_TIMEOUT_MS_DEFAULT, 3_600_000);
        for (text, ok) in [
            ("proxy_client_call_timeout_ms = 1", true),
            ("proxy_client_call_timeout_ms = 604800000", true),
            ("proxy_client_call_timeout_ms = 0", false),
            ("proxy_client_call_timeout_ms = 604800001", false),
        ] {
            assert_eq!(bound(text).check().is_ok(), ok, "{text}");
        }
    }

    #[test]
    fn the_drain_timeout_defaults_to_30_s_and_is_refused_past_an_hour() {
        let config = |text: &str| toml::from_str::<Config>(text).unwrap();
        assert_eq!(config("").drain_timeout_ms, 30_000);
        for (text, ok) in [
            ("drain_timeout_ms = 0", true),
            ("drain_timeout_ms = 3600000", true),
            ("drain_timeout_ms = 3600001", false),
        ] {
            assert_eq!(config(text).check().is_ok(), ok, "{text}");
        }
    }

    #[test]
    fn the_store_connect_retry_defaults_to_none_and_is_refused_past_ten_minutes() {
        let config = |text: &str| toml::from_str::<Config>(text).unwrap();
        assert_eq!(config("").store_connect_retry_ms, 0);
        for (text, ok) in [
            ("store_connect_retry_ms = 600000", true),
            ("store_connect_retry_ms = 600001", false),
        ] {
            assert_eq!(config(text).check().is_ok(), ok, "{text}");
        }
    }

    #[test]
    fn the_built_in_simulator_runs_only_on_the_embedded_default() {
        let config = |text: &str| toml::from_str::<Config>(text).unwrap();
        assert_eq!(config("").simulator(), Simulator::Embedded);
        let tenant = "[[tenants]]\nname = \"acme\"\ntoken = \"t\"\n";
        let provider = "[providers.openai]\nbase_url = \"https://api.openai.com\"\n";
        assert_eq!(config(tenant).simulator(), Simulator::Off);
        assert_eq!(config(provider).simulator(), Simulator::Off);
        assert_eq!(
            config(&format!("sim_url = \"http://127.0.0.1:9/\"\n{tenant}")).simulator(),
            Simulator::External("http://127.0.0.1:9".into())
        );
        // A route to `sim` with no simulator is refused at start-up, naming when it exists.
        let route = "[[routes]]\napi = \"openai-chat\"\nprovider = \"sim\"\nadapter = \"openai-chat@2\"\n";
        let error = config(&format!("{tenant}{route}")).check().unwrap_err();
        assert!(error.contains("embedded default"), "{error}");
        let error = config(&format!("{provider}{route}")).check().unwrap_err();
        assert!(error.contains("embedded default"), "{error}");
        assert!(config(route).check().is_ok());
    }
}
