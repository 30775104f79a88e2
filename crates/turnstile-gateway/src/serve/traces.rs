//! OpenTelemetry traces of dispatches (`shared/spec/gateway-api.md`, "Traces"), exported as
//! OTLP/HTTP protobuf. Off unless `otlp_endpoint` (config) or `OTEL_EXPORTER_OTLP_ENDPOINT` /
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (environment) is set: then nothing is installed, the
//! pump's [`Hook`] is `None` and every call on it returns at once.
//!
//! The span tree, built from what the dispatch pump (`driver.rs`) already sees:
//!
//! ```text
//! caller's span (W3C traceparent of the dispatch or proxy request, if any)
//! └── "chat {model}" (INTERNAL)  one per dispatch: GenAI attributes of the outcome,
//!     │                          turnstile.*; events turnstile.recovery
//!     ├── "attempt {model}" (CLIENT)  one per generation: its own response id, finish
//!     │                               reasons, usage; events turnstile.transition, .retract,
//!     │                               .resume, .replay, .connection; traceparent sent with it
//!     └── "attempt {model}" (CLIENT)  the next generation (retry / new generation)
//! ```
//!
//! Why the SDK's `BatchSpanProcessor`: spans end on the dispatch path with a `try_send` into a
//! bounded channel, so a dispatch never waits for the collector; export runs on the
//! processor's own thread with a blocking client. [`Bounded`] in front of it keeps an exact
//! count of spans queued or being exported and refuses a span beyond `OTEL_BSP_MAX_QUEUE_SIZE`
//! (counted as dropped), so a scrape shows the queue and what was lost.
//!
//! No message content and no credential is put in a span: attributes are ids, names, counts,
//! states and codes. With `otlp_capture_content` (or
//! `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`) the dispatch span also carries
//! `gen_ai.system_instructions`, `gen_ai.input.messages` and `gen_ai.output.messages` as JSON
//! strings in the conventions' message schema, each bounded by [`CONTENT_BYTES_MAX`].
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - no span holds a credential or message text unless content capture is on. Enforced in
//!   `serve/traces.rs` (attributes are ids, names, counts, states, codes; content only under
//!   `capture_content`). Tests:
//!   `traces.rs::a_streamed_dispatch_joins_the_callers_trace_with_genai_attributes_and_no_key_or_text`,
//!   `…a_proxied_request_joins…`,
//!   `…content_capture_records_the_conventions_messages_only_when_turned_on`.
//! - a caller's `traceparent` (native or proxy) makes the dispatch span its child; each provider
//!   request carries its attempt span's `traceparent`. Enforced in `serve/traces.rs`
//!   (`accept_traceparent`, `Hook::open`), `api.rs::dispatch` (`traces::carry`),
//!   `api.rs::context_with` (`Parent::current`). Tests: `traces.rs::a_streamed_dispatch_joins…`,
//!   `…a_proxied_request_joins_the_callers_trace…`,
//!   `…a_retried_dispatch_has_one_attempt_span_per_generation…`.
//! - span usage and finish reasons are the ledger's outcome (what `/v1/dispatches` reports); the
//!   response id is the handle bound to the attempt. Enforced in `serve/traces.rs`
//!   (`DispatchTrace::store`: `Commit`, `BindHandle`). Tests: `traces.rs` (every dispatch test,
//!   `assert_outcome_matches`).
//! - with no endpoint nothing is traced: no pipeline, no `traceparent` sent, no trace metrics.
//!   Enforced in `serve/traces.rs::wanted`, `install`, `Hook` (`None`). Tests:
//!   `traces.rs::without_an_endpoint_nothing_is_traced_and_no_traceparent_is_sent`.

use super::config::Config;
use super::transport::Endpoint;
use metrics::{counter, gauge};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Array, Context, KeyValue, StringValue, Value as OtelValue};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider, SpanData, SpanExporter,
    SpanProcessor,
};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use turnstile_adapters::decode::StreamApi;
use turnstile_core::dispatch::DispatchState;
use turnstile_drive::{ConnectionId, Count, DriveEvent, Ending, Request, StoreOp, StoreResult};
use turnstile_store::DispatchRecord;

/// Spans queued or being exported (gauge; never above the queue bound).
pub const TRACE_QUEUE_SPANS: &str = "turnstile_trace_queue_spans";
/// Spans by outcome: `exported`, `failed` (the collector refused or was unreachable),
/// `dropped` (the queue was full).
pub const TRACE_SPANS: &str = "turnstile_trace_spans_total";
/// The `outcome` labels of [`TRACE_SPANS`].
pub const TRACE_SPAN_OUTCOMES: [&str; 3] = ["exported", "failed", "dropped"];

/// Default span queue bound (the SDK's and the OpenTelemetry specification's default).
pub const QUEUE_SPANS_MAX_DEFAULT: usize = 2_048;
/// Largest JSON text of one captured content attribute; older messages are left out first, and
/// a longer single text part is cut, keeping the JSON structure.
pub const CONTENT_BYTES_MAX: usize = 64 * 1024;
/// Longest single text part in captured content.
pub const CONTENT_PART_CHARS_MAX: usize = 16 * 1024;
/// Attempt spans per dispatch (far above the driver's attempt budget; a bound all the same).
pub const ATTEMPT_SPANS_MAX: usize = 16;

/// What the gateway needs of an installed trace pipeline.
struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    capture_content: bool,
}

static TRACES: OnceLock<Traces> = OnceLock::new();

fn truthy(name: &str) -> bool {
    std::env::var(name).is_ok_and(|value| value.trim().eq_ignore_ascii_case("true"))
}

fn set(name: &str) -> bool {
    std::env::var(name).is_ok_and(|value| !value.trim().is_empty())
}

/// The traces endpoint from the config key, OTLP's base-URL rule (`/v1/traces` appended), or
/// `None` to leave it to the environment.
fn configured_endpoint(config: &Config) -> Option<String> {
    config.otlp_endpoint.as_ref().map(|base| {
        let base = base.trim_end_matches('/');
        if base.ends_with("/v1/traces") {
            base.to_owned()
        } else {
            format!("{base}/v1/traces")
        }
    })
}

/// Whether traces are on: an endpoint is configured and the SDK is not disabled.
pub fn wanted(config: &Config) -> bool {
    let endpoint = config.otlp_endpoint.is_some()
        || set("OTEL_EXPORTER_OTLP_ENDPOINT")
        || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    endpoint && !truthy("OTEL_SDK_DISABLED")
}

/// Install the trace pipeline if [`wanted`]. Refuses what it cannot honour (a protocol other
/// than `http/protobuf`, an endpoint that is not a URL) instead of exporting nothing silently.
pub fn install(config: &Config) -> Result<bool, String> {
    if !wanted(config) {
        return Ok(false);
    }
    for variable in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Ok(protocol) = std::env::var(variable) {
            if protocol.trim() != "http/protobuf" {
                return Err(format!(
                    "{variable}={protocol:?}: this gateway exports traces as http/protobuf only"
                ));
            }
            break;
        }
    }
    let mut builder = opentelemetry_otlp::SpanExporter::builder().with_http();
    if let Some(endpoint) = configured_endpoint(config) {
        use opentelemetry_otlp::WithExportConfig as _;
        builder = builder.with_endpoint(endpoint);
    }
    let exporter = builder
        .build()
        .map_err(|error| format!("OTLP trace exporter: {error}"))?;
    let queue_spans_max = std::env::var("OTEL_BSP_MAX_QUEUE_SIZE")
        .ok()
        .and_then(|value| value.trim().parse::<usize>().ok())
        .filter(|&max| max > 0)
        .unwrap_or(QUEUE_SPANS_MAX_DEFAULT);
    let outstanding = Arc::new(AtomicUsize::new(0));
    // The environment's OTEL_BSP_* settings apply; the queue bound is set explicitly so that
    // `Bounded` and the processor agree on it.
    let batch = BatchConfigBuilder::default()
        .with_max_queue_size(queue_spans_max)
        .build();
    let processor = BatchSpanProcessor::builder(Counted {
        inner: exporter,
        outstanding: outstanding.clone(),
    })
    .with_batch_config(batch)
    .build();
    let mut resource = opentelemetry_sdk::Resource::builder();
    let named = set("OTEL_SERVICE_NAME")
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|value| value.contains("service.name="));
    if !named {
        resource = resource.with_service_name("turnstile");
    }
    let provider = SdkTracerProvider::builder()
        .with_span_processor(Bounded {
            inner: processor,
            outstanding,
            max: queue_spans_max,
        })
        .with_resource(resource.build())
        .build();
    let tracer = opentelemetry::trace::TracerProvider::tracer(&provider, "turnstile");
    for outcome in TRACE_SPAN_OUTCOMES {
        counter!(TRACE_SPANS, "outcome" => outcome).absolute(0);
    }
    gauge!(TRACE_QUEUE_SPANS).set(0.0);
    let traces = Traces {
        provider,
        tracer,
        capture_content: config.otlp_capture_content
            || truthy("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"),
    };
    TRACES
        .set(traces)
        .map_err(|_| "the trace pipeline is installed once per process".to_owned())?;
    Ok(true)
}

/// Export what is queued and stop the exporter (graceful shutdown). Blocks up to the SDK's
/// shutdown bound: call it off the async runtime.
pub fn shutdown() {
    if let Some(traces) = TRACES.get()
        && let Err(error) = traces.provider.shutdown()
    {
        tracing::warn!(%error, "trace export at shutdown");
    }
}

/// Counts every span the exporter finished with (exported or failed) and frees its place in
/// the queue.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    outstanding: Arc<AtomicUsize>,
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        let outcome = if result.is_ok() { "exported" } else { "failed" };
        counter!(TRACE_SPANS, "outcome" => outcome).increment(spans as u64);
        let left = self
            .outstanding
            .fetch_sub(spans, Ordering::AcqRel)
            .saturating_sub(spans);
        gauge!(TRACE_QUEUE_SPANS).set(left as f64);
        result
    }
    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }
    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }
    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The queue bound in front of the batch processor: a span that would make more than `max`
/// queued or in export is dropped and counted; nothing here ever waits.
#[derive(Debug)]
struct Bounded<P> {
    inner: P,
    outstanding: Arc<AtomicUsize>,
    max: usize,
}

impl<P: SpanProcessor> SpanProcessor for Bounded<P> {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }
    fn on_end(&self, span: SpanData) {
        let taken = self
            .outstanding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                (queued < self.max).then_some(queued + 1)
            });
        match taken {
            Ok(queued) => {
                gauge!(TRACE_QUEUE_SPANS).set((queued + 1) as f64);
                self.inner.on_end(span);
            }
            Err(_) => counter!(TRACE_SPANS, "outcome" => "dropped").increment(1),
        }
    }
    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }
    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }
    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

struct HeaderReader<'a>(&'a axum::http::HeaderMap);

impl Extractor for HeaderReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|name| name.as_str()).collect()
    }
}

struct HeaderWriter<'a>(&'a mut Vec<(String, String)>);

impl Injector for HeaderWriter<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.push((key.to_owned(), value));
    }
}

/// Axum middleware (installed only when traces are on): the request's W3C `traceparent` /
/// `tracestate` become the current context while the handler runs, so a dispatch it starts
/// joins the caller's trace. A malformed header is ignored (W3C: start a new trace).
pub async fn accept_traceparent(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use opentelemetry::context::FutureExt as _;
    let parent = TraceContextPropagator::new().extract(&HeaderReader(request.headers()));
    next.run(request).with_context(parent).await
}

/// Run `future` (a task about to be spawned) in the current trace context.
pub fn carry<F: std::future::Future>(future: F) -> opentelemetry::context::WithContext<F> {
    use opentelemetry::context::FutureExt as _;
    future.with_current_context()
}

/// Where a dispatch's span hangs: the caller's context when it came with a request.
#[derive(Clone, Debug, Default)]
pub struct Parent(Option<Context>);

impl Parent {
    /// The current context (the caller's, inside [`accept_traceparent`]); nothing when traces
    /// are off.
    pub fn current() -> Parent {
        Parent(TRACES.get().map(|_| Context::current()))
    }
}

/// The GenAI provider name of an API (the conventions' well-known values).
fn provider_name(api: StreamApi) -> &'static str {
    match api {
        StreamApi::AnthropicMessages => "anthropic",
        StreamApi::OpenAiChat | StreamApi::OpenAiResponses => "openai",
        _ => "gcp.gemini",
    }
}

/// The GenAI operation name of an API.
fn operation_name(api: StreamApi) -> &'static str {
    match api {
        StreamApi::AnthropicMessages | StreamApi::OpenAiChat | StreamApi::OpenAiResponses => "chat",
        _ => "generate_content",
    }
}

/// The stored stop reason as a finish-reason string (`Other` carries the provider's own word).
fn finish_reason(stop_reason: &Value) -> Option<String> {
    match stop_reason {
        Value::String(reason) => Some(reason.clone()),
        Value::Object(object) => object.get("other").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// Finish reasons and usage of a commit's outcome (`{"stop_reason", "usage"}`).
fn outcome_attributes(outcome: &Value) -> Vec<KeyValue> {
    let mut attributes = Vec::new();
    if let Some(reason) = finish_reason(&outcome["stop_reason"]) {
        attributes.push(KeyValue::new(
            "gen_ai.response.finish_reasons",
            OtelValue::Array(Array::String(vec![StringValue::from(reason)])),
        ));
    }
    for (field, key) in [
        ("input_tokens", "gen_ai.usage.input_tokens"),
        ("output_tokens", "gen_ai.usage.output_tokens"),
    ] {
        if let Some(tokens) = outcome["usage"][field].as_u64() {
            attributes.push(KeyValue::new(key, i64::try_from(tokens).unwrap_or(i64::MAX)));
        }
    }
    attributes
}

fn state_value(state: DispatchState) -> KeyValue {
    KeyValue::new("turnstile.state", state.as_str())
}

/// One open attempt span.
struct Attempt {
    cx: Context,
    state: DispatchState,
    error: Option<String>,
}

/// The spans of one dispatch, fed by the pump.
pub struct DispatchTrace {
    tracer: SdkTracer,
    dispatch: Context,
    name: String,
    common: Vec<KeyValue>,
    attempts: BTreeMap<u64, Attempt>,
    attempts_started: usize,
    connections: BTreeMap<ConnectionId, u64>,
    generation: Option<u64>,
    error: Option<String>,
    capture_content: bool,
    api: StreamApi,
}

/// Longest error body or retracted preview put on an attempt span (content capture only).
pub const EVIDENCE_TEXT_MAX: usize = 4096;

/// `text` cut to at most `max` bytes at a character boundary.
fn cut_to(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// The pump's handle on its dispatch's spans: `None` when traces are off (every method is then
/// a no-op), so `driver.rs` calls it unconditionally.
#[derive(Default)]
pub struct Hook(Option<Box<DispatchTrace>>);

fn server_attributes(endpoint: &Endpoint) -> Vec<KeyValue> {
    let Ok(url) = reqwest::Url::parse(&endpoint.base_url) else {
        return Vec::new();
    };
    let mut attributes = Vec::new();
    if let Some(host) = url.host_str() {
        attributes.push(KeyValue::new("server.address", host.to_owned()));
    }
    if let Some(port) = url.port_or_known_default() {
        attributes.push(KeyValue::new("server.port", i64::from(port)));
    }
    attributes
}

impl Hook {
    /// Open the dispatch span (a child of `parent`, or a new trace).
    pub fn start(
        record: &DispatchRecord,
        api: StreamApi,
        model: &str,
        endpoint: &Endpoint,
        parent: &Parent,
    ) -> Hook {
        let Some(traces) = TRACES.get() else {
            return Hook(None);
        };
        let mut common = vec![
            KeyValue::new("gen_ai.operation.name", operation_name(api)),
            KeyValue::new("gen_ai.provider.name", provider_name(api)),
            KeyValue::new("gen_ai.request.model", model.to_owned()),
            KeyValue::new("gen_ai.conversation.id", record.conversation_id.clone()),
            KeyValue::new("turnstile.operation_id", record.operation_id.clone()),
            KeyValue::new("turnstile.conversation_id", record.conversation_id.clone()),
            KeyValue::new(
                "turnstile.revision",
                i64::try_from(record.revision.0).unwrap_or(i64::MAX),
            ),
            KeyValue::new("turnstile.provider", record.provider.clone()),
        ];
        if let Some(adapter) = record.manifest["adapter"].as_str() {
            common.push(KeyValue::new("turnstile.adapter", adapter.to_owned()));
        }
        if let Some(max) = record.manifest["max_output_tokens"].as_u64() {
            common.push(KeyValue::new(
                "gen_ai.request.max_tokens",
                i64::try_from(max).unwrap_or(i64::MAX),
            ));
        }
        common.extend(server_attributes(endpoint));
        let name = format!("{} {model}", operation_name(api));
        let parent_cx = parent.0.clone().unwrap_or_default();
        let span = traces
            .tracer
            .span_builder(name.clone())
            .with_kind(SpanKind::Internal)
            .with_attributes(common.clone())
            .start_with_context(&traces.tracer, &parent_cx);
        Hook(Some(Box::new(DispatchTrace {
            tracer: traces.tracer.clone(),
            dispatch: parent_cx.with_span(span),
            name,
            common,
            attempts: BTreeMap::new(),
            attempts_started: 0,
            connections: BTreeMap::new(),
            generation: None,
            error: None,
            capture_content: traces.capture_content,
            api,
        })))
    }

    /// Whether content capture is on for this dispatch (the pump then reads the history).
    pub fn captures_content(&self) -> bool {
        self.0.as_ref().is_some_and(|trace| trace.capture_content)
    }

    /// Record the input the dispatch answers (content capture only): the conversation's turns
    /// up to the dispatch's revision.
    pub fn input(&self, document: &Value, revision: u64) {
        let Some(trace) = &self.0 else { return };
        let turns: Vec<&Value> = document["turns"]
            .as_array()
            .map(|turns| {
                turns
                    .iter()
                    .filter(|turn| turn["revision"].as_u64().is_some_and(|r| r <= revision))
                    .collect()
            })
            .unwrap_or_default();
        let separate_system = trace.api != StreamApi::OpenAiChat;
        let mut system = Vec::new();
        let mut messages = Vec::new();
        for turn in turns {
            let role = turn["role"].as_str().unwrap_or("user");
            let parts = parts_of(turn);
            if role == "system" && separate_system {
                system.extend(parts);
            } else {
                messages.push(json!({"role": role, "parts": parts}));
            }
        }
        let span = trace.dispatch.span();
        if !system.is_empty() {
            let (text, _) = bounded_json(system);
            span.set_attribute(KeyValue::new("gen_ai.system_instructions", text));
        }
        let (text, left_out) = bounded_json(messages);
        span.set_attribute(KeyValue::new("gen_ai.input.messages", text));
        if left_out > 0 {
            span.set_attribute(KeyValue::new(
                "turnstile.content.input_messages_left_out",
                i64::try_from(left_out).unwrap_or(i64::MAX),
            ));
        }
    }

    /// A connection opens for `generation`: returns the headers that carry the attempt's trace
    /// context to the provider (none when traces are off).
    pub fn open(
        &mut self,
        connection: ConnectionId,
        generation: u64,
        request: &Request,
    ) -> Vec<(String, String)> {
        let Some(trace) = &mut self.0 else {
            return Vec::new();
        };
        if trace.connections.len() < ATTEMPT_SPANS_MAX * 4 {
            trace.connections.insert(connection, generation);
        }
        let Some(attempt) = trace.attempt(generation) else {
            return Vec::new();
        };
        let kind = match request {
            Request::Send { .. } => "send",
            Request::Resume { .. } => "resume",
            Request::Status { .. } => "status",
            Request::Cancel { .. } => "cancel",
        };
        attempt.cx.span().add_event(
            "turnstile.connection",
            vec![KeyValue::new("turnstile.request", kind)],
        );
        let mut headers = Vec::new();
        TraceContextPropagator::new().inject_context(&attempt.cx, &mut HeaderWriter(&mut headers));
        headers
    }

    /// The dispatch span's trace id (hex), for log lines; `None` when traces are off.
    pub fn trace_id(&self) -> Option<String> {
        let trace = self.0.as_ref()?;
        Some(trace.dispatch.span().span_context().trace_id().to_string())
    }

    /// A connection's evidence (`attempts.rs`) on its attempt's span: request id,
    /// `retry-after`, bytes and timings always; the provider's error body and the retracted
    /// preview (which may echo message text) only under content capture, at most
    /// [`EVIDENCE_TEXT_MAX`] bytes each.
    pub fn evidence(&mut self, generation: u64, evidence: &Value) {
        let Some(trace) = &mut self.0 else { return };
        let capture = trace.capture_content;
        let Some(attempt) = trace.attempts.get_mut(&generation) else {
            return;
        };
        let span = attempt.cx.span();
        if let Some(id) = evidence["provider_request_id"].as_str() {
            span.set_attribute(KeyValue::new("turnstile.provider_request_id", id.to_owned()));
        }
        for (field, name) in [
            ("retry_after_ms", "turnstile.retry_after_ms"),
            ("bytes_received", "turnstile.bytes_received"),
            ("head_ms", "turnstile.head_ms"),
            ("first_byte_ms", "turnstile.first_byte_ms"),
            ("duration_ms", "turnstile.duration_ms"),
        ] {
            if let Some(value) = evidence[field].as_u64() {
                span.set_attribute(KeyValue::new(name, i64::try_from(value).unwrap_or(i64::MAX)));
            }
        }
        if let Some(body) = evidence["error_body"].as_str() {
            span.set_attribute(KeyValue::new("turnstile.error_body_bytes", body.len() as i64));
            if capture {
                span.set_attribute(KeyValue::new(
                    "turnstile.error_body",
                    cut_to(body, EVIDENCE_TEXT_MAX),
                ));
            }
        }
        if capture && let Some(text) = evidence["retracted_preview"]["text"].as_str() {
            span.set_attribute(KeyValue::new(
                "turnstile.retracted_preview",
                cut_to(text, EVIDENCE_TEXT_MAX),
            ));
        }
    }

    /// What a provider connection reported (only heads and endings matter here).
    pub fn transport(&mut self, connection: ConnectionId, event: &super::transport::TransportEvent) {
        use super::transport::TransportEvent;
        match event {
            TransportEvent::Head { status, .. } => self.head(connection, *status),
            TransportEvent::Chunk(_) => {}
            TransportEvent::End => self.ended(connection, Ending::Clean),
            TransportEvent::Broken(_) => self.ended(connection, Ending::Broken),
            TransportEvent::Unreachable(_) => self.ended(connection, Ending::Unreachable),
        }
    }

    fn head(&mut self, connection: ConnectionId, status: u16) {
        let Some(attempt) = self.attempt_of(connection) else {
            return;
        };
        attempt
            .cx
            .span()
            .set_attribute(KeyValue::new("http.response.status_code", i64::from(status)));
        if status >= 400 {
            attempt.error = Some(status.to_string());
        }
    }

    fn ended(&mut self, connection: ConnectionId, ending: Ending) {
        let Some(trace) = &mut self.0 else { return };
        let Some(generation) = trace.connections.remove(&connection) else {
            return;
        };
        let Some(attempt) = trace.attempts.get_mut(&generation) else {
            return;
        };
        let (word, error) = match ending {
            Ending::Clean => ("clean", None),
            Ending::Broken => ("broken", Some("connection_broken")),
            Ending::Unreachable => ("unreachable", Some("provider_unreachable")),
        };
        attempt.cx.span().add_event(
            "turnstile.connection.end",
            vec![KeyValue::new("turnstile.ending", word)],
        );
        if let Some(error) = error {
            attempt.error.get_or_insert_with(|| error.to_owned());
        }
    }

    /// A store operation and its answer.
    pub fn store(&mut self, op: &StoreOp, result: &StoreResult) {
        let Some(trace) = &mut self.0 else { return };
        trace.store(op, result);
    }

    /// A client event.
    pub fn emit(&mut self, event: &DriveEvent) {
        let Some(trace) = &mut self.0 else { return };
        match event {
            DriveEvent::Retract { generation, reason } => {
                if let Some(attempt) = trace.attempts.get(&generation.0) {
                    attempt.cx.span().add_event(
                        "turnstile.retract",
                        vec![KeyValue::new("turnstile.reason", reason.clone())],
                    );
                }
            }
            DriveEvent::State {
                state: state @ (DispatchState::Sent | DispatchState::Streaming),
                generation: Some(generation),
            } => {
                // When it happened: the driver may write it later, with the commit. (A resume's
                // UNKNOWN → STREAMING is its own `turnstile.resume` event.)
                if let Some(attempt) = trace.attempts.get_mut(&generation.0)
                    && matches!(attempt.state, DispatchState::Dispatching | DispatchState::Sent)
                {
                    attempt.cx.span().add_event(
                        "turnstile.transition",
                        vec![
                            KeyValue::new("turnstile.from", attempt.state.as_str()),
                            KeyValue::new("turnstile.to", state.as_str()),
                        ],
                    );
                    attempt.state = *state;
                }
            }
            DriveEvent::Error { code, .. } => trace.error = Some(code.clone()),
            DriveEvent::Committed { turn, facts, .. } if trace.capture_content => {
                let mut message = json!({"role": "assistant", "parts": parts_of(turn)});
                if let Some(reason) = facts
                    .as_ref()
                    .and_then(|facts| finish_reason(&facts["stop_reason"]))
                {
                    message["finish_reason"] = json!(reason);
                }
                let (text, _) = bounded_json(vec![message]);
                trace
                    .dispatch
                    .span()
                    .set_attribute(KeyValue::new("gen_ai.output.messages", text));
            }
            _ => {}
        }
    }

    /// A count the driver made.
    pub fn count(&mut self, count: &Count) {
        let Some(trace) = &mut self.0 else { return };
        match count {
            Count::Recovery(outcome) => trace.dispatch.span().add_event(
                "turnstile.recovery",
                vec![KeyValue::new("turnstile.recovery.outcome", *outcome)],
            ),
            Count::Timeout => {
                if let Some(generation) = trace.generation
                    && let Some(attempt) = trace.attempts.get_mut(&generation)
                {
                    attempt.error = Some("timeout".into());
                }
            }
            _ => {}
        }
    }

    /// The dispatch ended here (finished or stopped): close every span.
    pub fn finish(&mut self, state: DispatchState) {
        let Some(trace) = self.0.take() else { return };
        trace.finish(state);
    }

    fn attempt_of(&mut self, connection: ConnectionId) -> Option<&mut Attempt> {
        let trace = self.0.as_mut()?;
        let generation = trace.connections.get(&connection)?;
        trace.attempts.get_mut(generation)
    }
}

impl DispatchTrace {
    /// The attempt span of `generation`, opened on first sight (a fresh begin, or a recovered
    /// attempt of an earlier process).
    fn attempt(&mut self, generation: u64) -> Option<&mut Attempt> {
        if !self.attempts.contains_key(&generation) {
            if self.attempts_started >= ATTEMPT_SPANS_MAX {
                return None;
            }
            self.attempts_started += 1;
            let mut attributes = self.common.clone();
            attributes.push(KeyValue::new(
                "turnstile.generation",
                i64::try_from(generation).unwrap_or(i64::MAX),
            ));
            let span = self
                .tracer
                .span_builder(self.name.replacen(operation_name(self.api), "attempt", 1))
                .with_kind(SpanKind::Client)
                .with_attributes(attributes)
                .start_with_context(&self.tracer, &self.dispatch);
            self.attempts.insert(
                generation,
                Attempt {
                    cx: self.dispatch.with_span(span),
                    state: DispatchState::Dispatching,
                    error: None,
                },
            );
        }
        self.generation = Some(generation);
        self.attempts.get_mut(&generation)
    }

    fn store(&mut self, op: &StoreOp, result: &StoreResult) {
        match (op, result) {
            (StoreOp::Begin { .. }, StoreResult::Began { generation, .. }) => {
                self.attempt(generation.0);
            }
            (
                StoreOp::Transition {
                    generation,
                    from,
                    to,
                    reason,
                },
                StoreResult::Applied,
            ) if !matches!(to, DispatchState::Sent | DispatchState::Streaming) => {
                // SENT and STREAMING are traced when they happen (`emit`), not when written.
                if let Some(attempt) = self.attempt(generation.0) {
                    let mut attributes = vec![
                        KeyValue::new("turnstile.from", from.as_str()),
                        KeyValue::new("turnstile.to", to.as_str()),
                    ];
                    if let Some(reason) = reason {
                        attributes.push(KeyValue::new("turnstile.end_reason", reason.clone()));
                    }
                    attempt.cx.span().add_event("turnstile.transition", attributes);
                    attempt.state = *to;
                }
                if to.is_terminal() {
                    self.end_attempt(generation.0);
                }
            }
            (StoreOp::Replay { generation, .. }, StoreResult::Applied) => {
                if let Some(attempt) = self.attempt(generation.0) {
                    attempt.cx.span().add_event("turnstile.replay", Vec::new());
                    attempt.state = DispatchState::Dispatching;
                }
            }
            (StoreOp::Resume { generation, .. }, StoreResult::Applied) => {
                if let Some(attempt) = self.attempt(generation.0) {
                    attempt.cx.span().add_event("turnstile.resume", Vec::new());
                    attempt.state = DispatchState::Streaming;
                }
            }
            (
                StoreOp::AbandonAndRearm {
                    generation,
                    provider_ended,
                    provider_word,
                },
                StoreResult::Applied,
            ) => {
                if let Some(attempt) = self.attempt(generation.0) {
                    let mut attributes = vec![KeyValue::new("turnstile.provider_ended", *provider_ended)];
                    if let Some(word) = provider_word {
                        attributes.push(KeyValue::new("turnstile.confirmed_over", word.clone()));
                    }
                    attempt.cx.span().add_event("turnstile.abandon", attributes);
                    attempt.state = DispatchState::Abandoned;
                    attempt.error.get_or_insert_with(|| "abandoned".to_owned());
                }
                self.end_attempt(generation.0);
            }
            (StoreOp::BindHandle { generation, handle }, StoreResult::Applied) => {
                if let Some(attempt) = self.attempt(generation.0) {
                    attempt
                        .cx
                        .span()
                        .set_attribute(KeyValue::new("gen_ai.response.id", handle.clone()));
                }
            }
            (
                StoreOp::Commit {
                    generation,
                    outcome,
                    handle,
                    ..
                },
                StoreResult::Committed { revision },
            ) => {
                let mut attributes = outcome.as_ref().map(outcome_attributes).unwrap_or_default();
                // A handle the commit carried was bound in its transaction.
                if let Some(handle) = handle
                    && let Some(attempt) = self.attempt(generation.0)
                {
                    attempt
                        .cx
                        .span()
                        .set_attribute(KeyValue::new("gen_ai.response.id", handle.clone()));
                }
                if let Some(attempt) = self.attempt(generation.0) {
                    attempt.cx.span().set_attributes(attributes.clone());
                    attempt.state = DispatchState::Committed;
                    attempt.error = None;
                }
                self.end_attempt(generation.0);
                attributes.push(KeyValue::new(
                    "turnstile.committed_revision",
                    i64::try_from(revision.0).unwrap_or(i64::MAX),
                ));
                self.dispatch.span().set_attributes(attributes);
            }
            (_, StoreResult::Failed(_)) => {
                self.dispatch
                    .span()
                    .add_event("turnstile.store_failure", Vec::new());
            }
            _ => {}
        }
    }

    fn end_attempt(&mut self, generation: u64) {
        let Some(attempt) = self.attempts.remove(&generation) else {
            return;
        };
        let span = attempt.cx.span();
        span.set_attribute(state_value(attempt.state));
        if attempt.state != DispatchState::Committed
            && let Some(error) = &attempt.error
        {
            span.set_attribute(KeyValue::new("error.type", error.clone()));
            span.set_status(Status::error(error.clone()));
        }
        span.end();
    }

    fn finish(mut self, state: DispatchState) {
        let generations: Vec<u64> = self.attempts.keys().copied().collect();
        for generation in generations {
            self.end_attempt(generation);
        }
        let span = self.dispatch.span();
        span.set_attribute(state_value(state));
        if let Some(generation) = self.generation {
            span.set_attribute(KeyValue::new(
                "turnstile.generation",
                i64::try_from(generation).unwrap_or(i64::MAX),
            ));
        }
        // The response id of the dispatch is its committed attempt's (the last bound).
        if state != DispatchState::Committed {
            let error = self
                .error
                .clone()
                .unwrap_or_else(|| state.as_str().to_ascii_lowercase());
            span.set_attribute(KeyValue::new("error.type", error.clone()));
            span.set_status(Status::error(error));
        }
        span.end();
    }
}

/// A v1 turn's blocks as GenAI message parts. Media and opaque reasoning are named, not copied.
fn parts_of(turn: &Value) -> Vec<Value> {
    let Some(blocks) = turn["blocks"].as_array() else {
        return Vec::new();
    };
    blocks
        .iter()
        .map(|block| match block["kind"].as_str().unwrap_or("") {
            "text" | "context" => json!({"type": "text", "content": cut(block["text"].as_str().unwrap_or(""))}),
            "tool_call" => {
                let arguments = match &block["arguments"] {
                    Value::String(text) => serde_json::from_str(text).unwrap_or_else(|_| json!(cut(text))),
                    other => other.clone(),
                };
                json!({"type": "tool_call", "id": block["call_id"], "name": block["tool"], "arguments": arguments})
            }
            "tool_result" => {
                let response: Vec<Value> = block["content"]
                    .as_array()
                    .map(|content| {
                        content
                            .iter()
                            .map(|part| match part["text"].as_str() {
                                Some(text) => json!({"type": "text", "content": cut(text)}),
                                None => json!({"type": part["kind"]}),
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                json!({"type": "tool_call_response", "id": block["call_id"], "response": response})
            }
            "image" | "document" => json!({"type": block["kind"], "mime_type": block["media_type"]}),
            other => json!({"type": other}),
        })
        .collect()
}

fn cut(text: &str) -> String {
    match text.char_indices().nth(CONTENT_PART_CHARS_MAX) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

/// JSON text of `items` within [`CONTENT_BYTES_MAX`], leaving the oldest out first; how many
/// were left out.
fn bounded_json(mut items: Vec<Value>) -> (String, usize) {
    let mut left_out = 0;
    loop {
        let text = Value::Array(items.clone()).to_string();
        if text.len() <= CONTENT_BYTES_MAX || items.is_empty() {
            return (text, left_out);
        }
        items.remove(0);
        left_out += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captured_content_stays_within_its_bound_and_keeps_the_newest_messages() {
        let big = "x".repeat(CONTENT_PART_CHARS_MAX * 2);
        let turn = json!({"role": "user", "blocks": [{"kind": "text", "text": big}]});
        let parts = parts_of(&turn);
        let content = parts[0]["content"].as_str().unwrap();
        assert_eq!(content.chars().count(), CONTENT_PART_CHARS_MAX + 1);
        let messages: Vec<Value> = (0..10)
            .map(|index| json!({"role": "user", "index": index, "parts": parts.clone()}))
            .collect();
        let (text, left_out) = bounded_json(messages);
        assert!(text.len() <= CONTENT_BYTES_MAX, "{}", text.len());
        let kept: Vec<Value> = serde_json::from_str(&text).unwrap();
        assert_eq!(kept.len() + left_out, 10);
        assert_eq!(kept.last().unwrap()["index"], 9, "the newest message is kept");
    }

    #[test]
    fn a_tool_call_and_its_result_become_the_conventions_parts() {
        let call = json!({"role": "assistant", "blocks": [{"kind": "tool_call", "call_id": "c1",
                          "tool": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                          {"kind": "reasoning", "provider": "anthropic", "signature": "opaque"}]});
        assert_eq!(
            parts_of(&call),
            vec![
                json!({"type": "tool_call", "id": "c1", "name": "get_weather", "arguments": {"city": "Paris"}}),
                json!({"type": "reasoning"})
            ]
        );
        let result = json!({"role": "tool", "blocks": [{"kind": "tool_result", "call_id": "c1",
                            "content": [{"kind": "text", "text": "12C"}]}]});
        assert_eq!(
            parts_of(&result),
            vec![
                json!({"type": "tool_call_response", "id": "c1", "response": [{"type": "text", "content": "12C"}]})
            ]
        );
    }

    #[test]
    fn finish_reasons_and_usage_come_from_the_stored_outcome() {
        let outcome = json!({"stop_reason": {"other": "pause_turn"}, "usage": {"input_tokens": 12, "output_tokens": null}});
        let attributes = outcome_attributes(&outcome);
        assert_eq!(attributes.len(), 2, "{attributes:?}");
        assert_eq!(attributes[0].key.as_str(), "gen_ai.response.finish_reasons");
        assert_eq!(
            attributes[0].value,
            OtelValue::Array(Array::String(vec![StringValue::from("pause_turn")]))
        );
        assert_eq!(attributes[1], KeyValue::new("gen_ai.usage.input_tokens", 12_i64));
    }
}
