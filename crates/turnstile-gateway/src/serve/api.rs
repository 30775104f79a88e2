//! The HTTP API of `shared/spec/gateway-api.md`: one error type with one `IntoResponse`, tenant
//! scoping, body limits, and the dispatch entry point (validate → waiting / rejected / render
//! → admission → manifest → prepare → driver).
//!
//! Tenants: with tenants configured every request needs `Authorization: Bearer <token>`, and a
//! tenant's conversations and operations live under the store ids `<tenant>~<id>`, so another
//! tenant's conversation answers exactly like a missing one (404). Responses show the caller's
//! own ids; manifests (which pin exactly what was sent) show the store id.
//!
//! Also here: `harden` (JSON errors for the router's own 404, 405, 414 and rejections), the
//! executor routes (`/v1/tool-calls/…/claim|renew|release|result`), `healthz` and `readyz`. Client
//! events are written as JSON only at this edge (`push_event_data`, straight into bytes, and
//! `client_event_json`); the hub and the change feed carry them typed.

use super::driver::{self, DriveContext};
use super::hub::{Hub, Next};
use super::{Shared, metrics, now};
use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use turnstile_adapters::decode::StreamApi;
use turnstile_adapters::output_format::OutputFormat;
use turnstile_adapters::prepare::{
    PrepareOutcome, PrepareRequest, Prepared, SettingError, Settings, prepare_with_settings,
};
use turnstile_adapters::registry::AdapterId;
use turnstile_adapters::render::{Graph, NotRenderable, TextContent};
use turnstile_adapters::sampling::{Sampling, SamplingError};
use turnstile_adapters::tool_choice::{Choice, ToolChoice};
use turnstile_adapters::{Catalog, RenderCache};
use turnstile_core::dispatch::{DispatchState, Timestamp};
use turnstile_core::{Conversation, KeptConversation, Revision, Verdict, limits, validate};
use turnstile_store::{
    AppendOutcome, CLAIM_LEASE_MS_MAX, CallClaimOutcome, CreateOutcome, ReleaseOutcome, RenewOutcome,
    ResultOutcome, ToolCallState,
};

/// Longest id a client may choose.
pub const ID_BYTES_MAX: usize = 128;
/// How often a client watching a dispatch driven elsewhere polls the ledger.
const WATCH_POLL: Duration = Duration::from_millis(100);

/// Every error code of the native API, one variant each: the strings are API (the spec names
/// `revision_conflict`, `invalid_request`, `stale_claim`; a test holds every code the spec
/// names against [`ErrorCode::ALL`]), messages are not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorCode {
    /// The body exceeds `body_bytes_max` (413).
    BodyTooLarge,
    /// `POST /v1/conversations` with an id that exists (409).
    ConversationExists,
    /// A second result for a call (409).
    DuplicateResult,
    /// A bug of ours (500).
    Internal,
    /// An id that is empty, too long, of other characters, or `.`/`..` (422).
    InvalidId,
    /// A body that is not JSON (400).
    InvalidJson,
    /// A well-formed JSON body, path or query of the wrong shape: not an object, an unknown
    /// field, a field of the wrong type or range (422; 400 for a query or path the router
    /// cannot read).
    InvalidRequest,
    /// A tool's schema that does not compile (422).
    InvalidToolSchema,
    /// A named limit was exceeded (422).
    LimitExceeded,
    /// A stored manifest that is not intact (500).
    ManifestInvalid,
    /// A path that exists with another method (405).
    MethodNotAllowed,
    /// No such conversation, dispatch, tool call or route (404).
    NotFound,
    /// The graph cannot be built for rendering (422).
    NotRenderable,
    /// An operation id used for another conversation or manifest (409).
    OperationConflict,
    /// Admission refused: prompt plus output cap exceed the window (422).
    OverBudget,
    /// The history would be illegal; `violations` say why (422).
    Rejected,
    /// The conversation is not at the expected revision (409).
    RevisionConflict,
    /// A generation setting out of the target API's range (422).
    SettingOutOfRange,
    /// The claim is not the current one (409).
    StaleClaim,
    /// The ledger cannot be reached (503).
    StoreUnavailable,
    /// Stored history that no longer decodes (500).
    StoredHistoryUnreadable,
    /// A stored turn that no longer matches the digest stored with it (500): a dispatch of
    /// that conversation is refused and nothing is sent.
    StoredHistoryCorrupt,
    /// A missing or unknown bearer token (401).
    Unauthorized,
    /// The tool call is claimed by someone else or done (409).
    Unavailable,
    /// No adapter of that id (422).
    UnknownAdapter,
    /// No provider of that name is configured (422).
    UnknownProvider,
    /// A generation setting the target API has no field for (422).
    UnsupportedSetting,
    /// The request target is longer than [`URI_BYTES_MAX`] (414).
    UriTooLong,
    /// The listener is at `connections_max` (503; `/healthz` still answers).
    Overloaded,
    /// A tool choice names a tool the conversation does not declare (422).
    UnknownTool,
    /// The process is shutting down and takes no new requests (503; retry on another
    /// replica). As a stream's `error` event: the dispatch outlived the drain timeout and was
    /// handed to recovery; attach again with the same `operation_id`.
    ShuttingDown,

    /// The request's body did not arrive within `body_read_timeout_ms` (408).
    BodyTimeout,
    /// The request's header fields are too many or too large for the HTTP parser (431).
    HeadersTooLarge,
}

impl ErrorCode {
    /// Every code (held against the spec by the tests; the binary itself needs no list).
    pub const ALL: [ErrorCode; 33] = [
        ErrorCode::BodyTooLarge,
        ErrorCode::ConversationExists,
        ErrorCode::DuplicateResult,
        ErrorCode::Internal,
        ErrorCode::InvalidId,
        ErrorCode::InvalidJson,
        ErrorCode::InvalidRequest,
        ErrorCode::InvalidToolSchema,
        ErrorCode::LimitExceeded,
        ErrorCode::ManifestInvalid,
        ErrorCode::MethodNotAllowed,
        ErrorCode::NotFound,
        ErrorCode::NotRenderable,
        ErrorCode::OperationConflict,
        ErrorCode::OverBudget,
        ErrorCode::Rejected,
        ErrorCode::RevisionConflict,
        ErrorCode::SettingOutOfRange,
        ErrorCode::StaleClaim,
        ErrorCode::StoreUnavailable,
        ErrorCode::StoredHistoryUnreadable,
        ErrorCode::StoredHistoryCorrupt,
        ErrorCode::Unauthorized,
        ErrorCode::Unavailable,
        ErrorCode::UnknownAdapter,
        ErrorCode::UnknownProvider,
        ErrorCode::UnsupportedSetting,
        ErrorCode::UriTooLong,
        ErrorCode::Overloaded,
        ErrorCode::UnknownTool,
        ErrorCode::ShuttingDown,
        ErrorCode::BodyTimeout,
        ErrorCode::HeadersTooLarge,
    ];

    /// The code's string.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BodyTooLarge => "body_too_large",
            ErrorCode::BodyTimeout => "body_timeout",
            ErrorCode::HeadersTooLarge => "headers_too_large",
            ErrorCode::ConversationExists => "conversation_exists",
            ErrorCode::DuplicateResult => "duplicate_result",
            ErrorCode::Internal => "internal",
            ErrorCode::InvalidId => "invalid_id",
            ErrorCode::InvalidJson => "invalid_json",
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::InvalidToolSchema => "invalid_tool_schema",
            ErrorCode::LimitExceeded => "limit_exceeded",
            ErrorCode::ManifestInvalid => "manifest_invalid",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::NotFound => "not_found",
            ErrorCode::NotRenderable => "not_renderable",
            ErrorCode::OperationConflict => "operation_conflict",
            ErrorCode::OverBudget => "over_budget",
            ErrorCode::Rejected => "rejected",
            ErrorCode::RevisionConflict => "revision_conflict",
            ErrorCode::SettingOutOfRange => "setting_out_of_range",
            ErrorCode::StaleClaim => "stale_claim",
            ErrorCode::StoreUnavailable => "store_unavailable",
            ErrorCode::StoredHistoryUnreadable => "stored_history_unreadable",
            ErrorCode::StoredHistoryCorrupt => "stored_history_corrupt",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::UnknownAdapter => "unknown_adapter",
            ErrorCode::UnknownProvider => "unknown_provider",
            ErrorCode::UnsupportedSetting => "unsupported_setting",
            ErrorCode::UriTooLong => "uri_too_long",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::UnknownTool => "unknown_tool",
            ErrorCode::ShuttingDown => "shutting_down",
        }
    }

    /// The code spelled `text`, if it is one of ours.
    pub fn parse(text: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|code| code.as_str() == text)
    }
}

/// Longest request target (path and query) answered by a handler; a longer one is 414
/// `uri_too_long` in our JSON shape (hyper refuses targets beyond its own read buffer first).
pub const URI_BYTES_MAX: usize = 8 * 1024;

/// The one API error: a status, a stable code, a message, and optional extra fields.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: ErrorCode,
    message: String,
    extra: Value,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            extra: Value::Null,
        }
    }
    pub(crate) fn with(mut self, extra: Value) -> ApiError {
        self.extra = extra;
        self
    }
    pub(crate) fn not_found(what: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::NotFound,
            format!("no such {what}"),
        )
    }
    pub(crate) fn store(error: turnstile_store::StoreError) -> ApiError {
        tracing::error!(%error, "store error");
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::StoreUnavailable,
            "the ledger is unavailable",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut error = json!({"code": self.code.as_str(), "message": self.message});
        if let Value::Object(extra) = self.extra {
            for (key, value) in extra {
                error[key] = value;
            }
        }
        (self.status, Json(json!({"error": error}))).into_response()
    }
}

pub(crate) type ApiResult = Result<Response, ApiError>;

impl ApiError {
    /// The stable code.
    pub(crate) fn code(&self) -> &'static str {
        self.code.as_str()
    }
    /// The HTTP status.
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }
    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
    /// Extra fields.
    pub(crate) fn extra(&self) -> &Value {
        &self.extra
    }
}

/// Who is calling: the tenant prefix for store ids ("" with no tenants configured).
#[derive(Clone)]
pub struct Caller {
    prefix: String,
}

impl Caller {
    pub(crate) fn store_id(&self, id: &str) -> String {
        format!("{}{id}", self.prefix)
    }
    /// The tenant's name (None without tenants): who asked, for a repair's record.
    pub(crate) fn tenant(&self) -> Option<&str> {
        self.prefix.strip_suffix('~')
    }
    fn client_id<'a>(&self, store_id: &'a str) -> Option<&'a str> {
        store_id.strip_prefix(self.prefix.as_str())
    }
}

/// Authenticate: with tenants configured, a known bearer token is required.
pub fn caller(shared: &Shared, headers: &HeaderMap) -> Result<Caller, ApiError> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    caller_with_token(shared, token)
}

/// Authenticate a token found wherever the client's API puts it (the proxy endpoints accept
/// the SDKs' own headers).
pub fn caller_with_token(shared: &Shared, token: Option<&str>) -> Result<Caller, ApiError> {
    if shared.tenants.is_empty() {
        return Ok(Caller {
            prefix: String::new(),
        });
    }
    let tenant = token.and_then(|token| shared.tenants.iter().find(|(known, _)| known == token));
    match tenant {
        Some((_, name)) => Ok(Caller {
            prefix: format!("{name}~"),
        }),
        None => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            ErrorCode::Unauthorized,
            "a valid bearer token is required",
        )),
    }
}

fn check_id(id: &str, what: &str) -> Result<(), ApiError> {
    // `.` and `..` are path segments to every URL parser: an id spelled so could not be
    // addressed as `/v1/conversations/{id}` (spec additions: refused).
    let ok = !id.is_empty()
        && id != "."
        && id != ".."
        && id.len() <= ID_BYTES_MAX
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidId,
            format!("{what} must be 1–{ID_BYTES_MAX} characters of A–Z a–z 0–9 - _ . :, and not . or .."),
        ))
    }
}

/// Authenticate, then read the JSON body within its limits.
pub(crate) async fn authenticated_json(
    shared: &Shared,
    request: Request,
) -> Result<(Caller, Value), ApiError> {
    let (parts, body) = request.into_parts();
    let caller = caller(shared, &parts.headers)?;
    Ok((caller, json_body(shared, body).await?))
}

/// Why a request body could not be read: its deadline passed (408 `body_timeout`, the
/// listener's [`super::listener::BodyTimedOut`]), it was malformed on the wire (400
/// `invalid_request`: a bad chunk size, a connection cut mid-body), or it exceeded `limit` (413).
pub(crate) fn body_unread(error: &axum::Error, limit: usize) -> (StatusCode, ErrorCode, String) {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = cause {
        if current.is::<super::listener::BodyTimedOut>() {
            return (
                StatusCode::REQUEST_TIMEOUT,
                ErrorCode::BodyTimeout,
                "the request body did not arrive within body_read_timeout_ms".to_owned(),
            );
        }
        if current.is::<hyper::Error>() {
            return (
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidRequest,
                "the request body could not be read".to_owned(),
            );
        }
        cause = current.source();
    }
    (
        StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::BodyTooLarge,
        format!("the body exceeds {limit} bytes"),
    )
}

/// Read a JSON body within the size and depth limits (413 / 422 / 400).
async fn json_body(shared: &Shared, body: Body) -> Result<Value, ApiError> {
    let bytes = axum::body::to_bytes(body, shared.body_bytes_max)
        .await
        .map_err(|error| {
            let (status, code, message) = body_unread(&error, shared.body_bytes_max);
            ApiError::new(status, code, message)
        })?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        // An empty body is an empty object: the handler names what is missing.
        return Ok(json!({}));
    }
    turnstile_core::parse::json_from_slice(&bytes).map_err(|error| match error {
        turnstile_core::conversation::Unreadable::Limit { what, .. } => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::LimitExceeded,
            format!("limit exceeded: {what}"),
        )
        .with(json!({"limit": what})),
        other => ApiError::new(StatusCode::BAD_REQUEST, ErrorCode::InvalidJson, other.to_string()),
    })
}

/// A native body must be a JSON object naming only fields the endpoint knows (spec additions:
/// unknown fields are 422 `invalid_request`, never ignored; so is a body that is not an object).
pub(crate) fn strict_object(
    body: Value,
    allowed: &[&str],
) -> Result<serde_json::Map<String, Value>, ApiError> {
    let Value::Object(map) = body else {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidRequest,
            "the body must be a JSON object",
        ));
    };
    if let Some(unknown) = map.keys().find(|key| !allowed.contains(&key.as_str())) {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidRequest,
            format!(
                "unknown field {unknown:?}; this endpoint takes {}",
                allowed.join(", ")
            ),
        )
        .with(json!({"field": unknown})));
    }
    Ok(map)
}

pub(crate) fn violations_json(violations: &[turnstile_core::Violation]) -> Value {
    serde_json::to_value(violations).unwrap_or(Value::Null)
}

/// The conversation document with the caller's own id.
pub(crate) fn client_document(caller: &Caller, mut document: Value) -> Value {
    if let Some(id) = document["conversation_id"]
        .as_str()
        .and_then(|id| caller.client_id(id))
        .map(str::to_owned)
    {
        document["conversation_id"] = json!(id);
    }
    document
}

/// Fields of OpenAI's Conversations API create (`items`, `metadata`) that the native create
/// does not take: a body naming one is that API's, not a mistaken native one.
const OPENAI_CONVERSATIONS_FIELDS: &[&str] = &["items", "metadata"];

/// OpenAI's Conversations API (`POST /v1/conversations` with `items`, `/v1/conversations/{id}/
/// items`) shares the native API's path and is not served. Its clients (the OpenAI Agents SDK's
/// conversation session) get 404 in OpenAI's error shape naming it and what to use instead,
/// never the native "unknown field items". 404, not 501: the OpenAI SDKs retry every 5xx, and
/// retrying cannot help
/// (docs/decisions/0120-openais-conversations-api-is-refused-in-openais-shape.md, 2026-12-07).
pub async fn openai_conversations_refused() -> Response {
    super::proxy::provider_error(
        turnstile_adapters::Api::OpenaiResponses,
        StatusCode::NOT_FOUND,
        "unsupported_endpoint",
        "OpenAI's Conversations API (/v1/conversations with items, /v1/conversations/{id}/items) \
         is not served by this gateway: send the whole input with each request, or continue a \
         response with previous_response_id on /v1/responses. Turnstile's own /v1/conversations \
         takes conversation_id and tools.",
        &Value::Null,
    )
}

pub async fn create_conversation(State(shared): State<Arc<Shared>>, request: Request) -> ApiResult {
    let (caller, body) = authenticated_json(&shared, request).await?;
    if OPENAI_CONVERSATIONS_FIELDS
        .iter()
        .any(|field| body.get(field).is_some())
    {
        return Ok(openai_conversations_refused().await);
    }
    let body = strict_object(body, &["conversation_id", "tools"])?;
    let id = match body.get("conversation_id") {
        Some(Value::String(id)) => id.clone(),
        None | Some(Value::Null) => format!("c-{}", super::fresh_id()),
        Some(_) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::InvalidId,
                "conversation_id must be a string",
            ));
        }
    };
    check_id(&id, "conversation_id")?;
    let tools = body.get("tools").cloned().unwrap_or(json!([]));
    // The tools must decode as v1 tools: check through the same decoder the validator uses.
    let probe = json!({"format": turnstile_core::conversation::FORMAT_V1, "conversation_id": id, "revision": 0,
                       "tools": tools, "turns": []});
    let conversation = Conversation::from_value(probe).map_err(|error| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::LimitExceeded,
            error.to_string(),
        )
    })?;
    if let Verdict::Rejected(violations) = validate(&conversation) {
        metrics::rejected(&violations);
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::Rejected,
            "the tools are malformed",
        )
        .with(json!({"violations": violations_json(&violations)})));
    }
    // Tool schemas compile here, not at the first dispatch: a schema the assembler cannot use
    // is refused before anything depends on it.
    if !conversation.tools.is_empty() {
        shared
            .toolsets
            .lock()
            .await
            .compiled(&conversation.toolset_digest, &conversation.tools)
            .map_err(|error| {
                ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    ErrorCode::InvalidToolSchema,
                    error.to_string(),
                )
            })?;
    }
    match shared
        .ledger
        .create_conversation(&caller.store_id(&id), &tools, now())
        .await
        .map_err(ApiError::store)?
    {
        CreateOutcome::Created => Ok({
            shared.feed.conversation(&caller.store_id(&id), 0);
            (
                StatusCode::CREATED,
                Json(json!({"conversation_id": id, "revision": 0})),
            )
                .into_response()
        }),
        CreateOutcome::AlreadyExists => Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::ConversationExists,
            format!("conversation {id:?} exists already"),
        )),
    }
}

pub async fn get_conversation(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult {
    let caller = caller(&shared, &headers)?;
    match shared
        .ledger
        .conversation(&caller.store_id(&id))
        .await
        .map_err(ApiError::store)?
    {
        Some(document) => {
            let document = super::repair::with_repairs(&shared, &caller.store_id(&id), document).await?;
            Ok(Json(client_document(&caller, document)).into_response())
        }
        None => Err(ApiError::not_found("conversation")),
    }
}

pub async fn append_turn(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    request: Request,
) -> ApiResult {
    let (caller, body) = authenticated_json(&shared, request).await?;
    let body = Value::Object(strict_object(body, &["expected_revision", "turn"])?);
    let expected = body["expected_revision"].as_u64().ok_or_else(|| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidRequest,
            "expected_revision must be a non-negative integer",
        )
    })?;
    let turn = body.get("turn").cloned().unwrap_or(Value::Null);
    let blocks = turn["blocks"].as_array().map_or(0, Vec::len);
    if blocks > limits::BLOCKS_PER_TURN_MAX {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::LimitExceeded,
            format!("a turn holds at most {} blocks", limits::BLOCKS_PER_TURN_MAX),
        )
        .with(json!({"limit": "BLOCKS_PER_TURN_MAX"})));
    }
    let outcome = shared
        .ledger
        .append_turn(&caller.store_id(&id), Revision(expected), &turn, now())
        .await
        .map_err(ApiError::store)?;
    match outcome {
        AppendOutcome::Appended { revision } => {
            shared.feed.conversation(&caller.store_id(&id), revision.0);
            Ok(Json(json!({"revision": revision.0})).into_response())
        }
        AppendOutcome::Conflict { current } => Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::RevisionConflict,
            format!("the conversation is at revision {current}, not {expected}"),
        )
        .with(json!({"current_revision": current.0}))),
        AppendOutcome::Rejected(violations) => {
            metrics::rejected(&violations);
            Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::Rejected,
                "the turn would make the history illegal",
            )
            .with(json!({"violations": violations_json(&violations)})))
        }
        AppendOutcome::NotFound => Err(ApiError::not_found("conversation")),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DispatchBody {
    operation_id: String,
    /// Where the dispatch goes; or `targets`: the same, then failover targets in order
    /// (`shared/spec/gateway-api.md`, "Failover"). Exactly one of the two.
    #[serde(default)]
    target: Option<Target>,
    #[serde(default)]
    targets: Option<Vec<Target>>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    stream: bool,
    /// Generation settings in neutral names (`temperature`, `top_p`, `top_k`, `stop`, `seed`,
    /// `presence_penalty`, `frequency_penalty`); absent means none. An unknown name is 422
    /// `invalid_request`, a setting the adapter's API cannot take 422 `unsupported_setting` or
    /// `setting_out_of_range`
    /// (`docs/decisions/0041-generation-settings-travel-with-the-request.md`, 2026-11-30).
    #[serde(default)]
    sampling: Sampling,
    /// The revision the caller answers: another revision is 409 `revision_conflict` and
    /// nothing is prepared or sent (`shared/spec/gateway-api.md`, "Dispatch guard").
    #[serde(default)]
    expected_revision: Option<u64>,
    /// Tool choice in neutral names (`{"type": "auto" | "none" | "required"}`, `{"type":
    /// "tool", "name"}`, `{"type": "allowed", "mode", "tools"}`, `{"type": "validated"}`) and
    /// the parallel switch; one the adapter's API cannot spell is 422 `unsupported_setting`
    /// (`tool_choice.rs`,
    /// `docs/decisions/0052-tool-choice-and-parallel-tool-calls-travel-with-the.md`, 2026-12-01).
    #[serde(default)]
    tool_choice: Option<Choice>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    /// Structured output in neutral names (`{"type": "text" | "json_object"}`, `{"type":
    /// "json_schema", "name"?, "description"?, "schema", "strict"?}`, `{"type": "gemini", …}`);
    /// one the adapter's API cannot take is 422 `unsupported_setting` (`output_format.rs`).
    #[serde(default)]
    output_format: OutputFormat,
}

/// Where a dispatch goes.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    /// Provider name (`sim` by default).
    #[serde(default = "sim_provider")]
    pub provider: String,
    /// Model name.
    pub model: String,
    /// Adapter id.
    pub adapter: String,
}

fn sim_provider() -> String {
    "sim".into()
}

/// How the dispatch request ends before any dispatch exists (waiting, rejected, paused).
pub enum Early {
    Waiting(Vec<String>),
    Rejected(Vec<turnstile_core::Violation>),
    Paused(Value),
}

fn early_response(early: Early, stream: bool) -> Response {
    let (event, data, status) = match early {
        Early::Waiting(pending) => ("waiting", json!({"pending": pending}), StatusCode::OK),
        Early::Rejected(violations) => (
            "rejected",
            json!({"violations": violations_json(&violations)}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        Early::Paused(reason) => ("paused", json!({"reason": reason}), StatusCode::CONFLICT),
    };
    if stream {
        sse_once(event, &data)
    } else {
        let mut body = data;
        body["status"] = json!(event);
        (status, Json(body)).into_response()
    }
}

pub async fn dispatch(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    request: Request,
) -> ApiResult {
    // Preparation and the driver's start run in their own task: a client that disconnects
    // while its dispatch is being prepared drops this future, not the dispatch (the driver
    // runs to its end and the outcome is readable by operation id).
    match tokio::spawn(super::traces::carry(dispatch_detached(shared, id, request))).await {
        Ok(result) => result,
        Err(error) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Internal,
            format!("dispatch task failed: {error}"),
        )),
    }
}

async fn dispatch_detached(shared: Arc<Shared>, id: String, request: Request) -> ApiResult {
    let id_seen = Stream::id_seen(request.headers());
    let (caller, body) = authenticated_json(&shared, request).await?;
    let body = Value::Object(strict_object(
        body,
        &[
            "operation_id",
            "target",
            "targets",
            "max_output_tokens",
            "stream",
            "sampling",
            "expected_revision",
            "tool_choice",
            "parallel_tool_calls",
            "output_format",
        ],
    )?);
    let mut request: DispatchBody = serde_json::from_value(body).map_err(|error| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidRequest,
            error.to_string(),
        )
    })?;
    check_id(&request.operation_id, "operation_id")?;
    let targets = match (request.target.take(), request.targets.take()) {
        (Some(target), None) => vec![target],
        (None, Some(targets))
            if !targets.is_empty() && targets.len() <= turnstile_store::TARGETS_PER_DISPATCH_MAX =>
        {
            targets
        }
        (None, Some(_)) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::InvalidRequest,
                format!(
                    "targets takes 1 to {} targets",
                    turnstile_store::TARGETS_PER_DISPATCH_MAX
                ),
            )
            .with(json!({"field": "targets"})));
        }
        _ => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::InvalidRequest,
                "give exactly one of target and targets",
            )
            .with(json!({"field": "target"})));
        }
    };
    if request.max_output_tokens == Some(0) {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidRequest,
            "max_output_tokens must be at least 1",
        )
        .with(json!({"field": "max_output_tokens"})));
    }
    let conversation_id = caller.store_id(&id);
    let operation_id = caller.store_id(&request.operation_id);
    let stream = Stream::of(request.stream, id_seen);

    // No read of the operation id first: the prepare answers whether it exists, in the
    // transaction that stores it (`ops::prepare_beginning` looks it up before it reads the
    // conversation or writes). Only an answer that stored nothing (an error, waiting,
    // rejected, paused) asks the store whether the operation exists after all, and then
    // attaches to it as the read first did: a client asking again with the same operation id
    // gets that dispatch, whatever the conversation became since
    // (docs/decisions/0112-a-dispatch-reads-its-operation-id-only-when-its-prepare.md, "A dispatch
    // reads its operation id only when its prepare stored nothing").
    let stored = match super::kept::current(&shared, &conversation_id).await {
        // The kept history plus the turns committed since, or the whole document (`kept.rs`).
        Ok(Some(current)) => {
            let answer = dispatch_current(
                &shared,
                caller.clone(),
                &current.kept,
                request,
                operation_id.clone(),
                &targets,
                stream,
            )
            .await;
            shared.kept.put(&conversation_id, current);
            answer
        }
        Ok(None) => Dispatched::NotStored(Err(ApiError::not_found("conversation"))),
        Err(error) => Dispatched::NotStored(Err(error)),
    };
    match stored {
        Dispatched::Stored(answer) => answer,
        Dispatched::NotStored(answer) => {
            attach_existing(shared, caller, &conversation_id, &operation_id, stream, answer).await
        }
    }
}

/// After a dispatch request that stored nothing: attach to the dispatch its operation id
/// already names (`operation_conflict` when that dispatch is another conversation's), else
/// give the request's own `answer`.
async fn attach_existing(
    shared: Arc<Shared>,
    caller: Caller,
    conversation_id: &str,
    operation_id: &str,
    stream: Stream,
    answer: ApiResult,
) -> ApiResult {
    let Some(record) = shared
        .ledger
        .dispatch(operation_id)
        .await
        .map_err(ApiError::store)?
    else {
        return answer;
    };
    if record.conversation_id != conversation_id {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::OperationConflict,
            "that operation id belongs to another conversation",
        ));
    }
    attach(shared, caller, record, None, stream, None).await
}

/// How a dispatch request ended: with a dispatch the store holds for its operation id
/// (created by this request, or found by its prepare), or with nothing stored for it.
enum Dispatched {
    /// The answer of the stored dispatch (attached to).
    Stored(ApiResult),
    /// The answer when nothing was stored: an error, or waiting, rejected or paused. The
    /// operation id may still name an earlier dispatch, which the caller looks for.
    NotStored(ApiResult),
}

/// The rest of a dispatch of a stored conversation, once it is current: the revision check,
/// the verdict (kept, so no walk of the history), the prepare and the attach.
async fn dispatch_current(
    shared: &Arc<Shared>,
    caller: Caller,
    kept: &KeptConversation,
    request: DispatchBody,
    operation_id: String,
    targets: &[Target],
    stream: Stream,
) -> Dispatched {
    let conversation = kept.conversation();
    if let Some(expected) = request.expected_revision
        && expected != conversation.revision.0
    {
        return Dispatched::NotStored(Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::RevisionConflict,
            "the conversation is not at the expected revision",
        )
        .with(json!({"current_revision": conversation.revision.0}))));
    }
    // Validated once, when each turn was kept: the proof and the sequence go on into the render.
    // The kept conversation's graph carries its turn stamps, so the render resumes from the
    // state kept after the last dispatch's render (`turnstile_adapters::render`, "resume").
    let graph = match (kept.verdict(), Graph::kept(kept)) {
        (Verdict::Ready, Some(graph)) => graph,
        (Verdict::Waiting { pending }, _) => {
            let pending = pending.into_iter().map(|call| call.0).collect();
            return Dispatched::NotStored(Ok(early_response(Early::Waiting(pending), request.stream)));
        }
        (Verdict::Rejected(violations), _) => {
            metrics::rejected(&violations);
            return Dispatched::NotStored(Ok(early_response(Early::Rejected(violations), request.stream)));
        }
        (Verdict::Ready, None) => {
            return Dispatched::NotStored(Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                ErrorCode::Internal,
                "a ready verdict without its proof",
            )));
        }
    };
    let started = prepare_dispatch(
        shared,
        graph,
        operation_id,
        targets,
        request.max_output_tokens,
        Settings {
            sampling: request.sampling,
            tool_choice: ToolChoice {
                tool_choice: request.tool_choice,
                parallel_tool_calls: request.parallel_tool_calls,
            },
            output_format: request.output_format,
            passthrough: Default::default(),
            repair: None,
        },
        None,
    )
    .await;
    match started {
        Ok(Started::Record(record, began)) => Dispatched::Stored(
            attach(shared.clone(), caller, record, began, stream, Some(conversation)).await,
        ),
        Ok(Started::Early(early)) => Dispatched::NotStored(Ok(early_response(early, request.stream))),
        // This endpoint imports nothing.
        Ok(Started::NotImported(_)) => Dispatched::NotStored(Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Internal,
            "an import refused without an import",
        ))),
        Err(error) => Dispatched::NotStored(Err(error)),
    }
}

/// How preparing a dispatch ended: a stored dispatch to attach to, or no dispatch at all.
pub enum Started {
    /// Stored (new or existing with the same manifest), and the first attempt if the prepare
    /// began it.
    Record(turnstile_store::DispatchRecord, Option<Began>),
    /// Paused: the adapter cannot represent the graph.
    Early(Early),
    /// The conversation to import with the prepare was not (`Rejected`, `AlreadyExists`):
    /// nothing was written.
    NotImported(turnstile_store::ImportOutcome),
}

/// A request setting the adapter's API cannot take: 422 with the setting's neutral name and
/// the adapter, plus the documented bounds when it is a range (or count) that was broken.
fn setting_error(error: SettingError, adapter: AdapterId) -> ApiError {
    let mut extra = json!({"setting": error.field(), "adapter": adapter.as_str()});
    match &error {
        SettingError::Sampling(SamplingError::OutOfRange { value, min, max, .. }) => {
            extra["value"] = json!(value);
            extra["min"] = json!(min);
            extra["max"] = json!(max);
        }
        SettingError::Sampling(SamplingError::TooMany { count, max, .. }) => {
            extra["count"] = json!(count);
            extra["max"] = json!(max);
        }
        _ => {}
    }
    let code = ErrorCode::parse(error.code()).unwrap_or(ErrorCode::UnsupportedSetting);
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, code, error.to_string()).with(extra)
}

/// Render → admission → manifest → `ledger.prepare` for a conversation the validator called
/// ready. Shared by the dispatch endpoint and the proxy endpoints. `settings` are checked
/// against the adapter's API before anything renders: a setting it cannot take is 422
/// `unsupported_setting` / `setting_out_of_range`, never dropped or clamped.
///
/// `targets`: the dispatch's own target first, then its failover targets. Each renders its
/// own request from the same graph with its own adapter and is held to the same rules: one
/// that cannot take a setting, is over its window or cannot represent the graph refuses the
/// whole dispatch, naming it (`target` in the error), before anything is stored or sent.
pub(crate) async fn prepare_dispatch(
    shared: &Arc<Shared>,
    graph: Result<Graph<'_>, NotRenderable>,
    operation_id: String,
    targets: &[Target],
    max_output_tokens: Option<u64>,
    settings: Settings,
    import: Option<&NewConversation>,
) -> Result<Started, ApiError> {
    let rendering = |provider: &str| {
        shared.endpoints.get(provider).map(|endpoint| ProviderRendering {
            background: endpoint.resume_by_handle,
            text_content: endpoint.text_content,
        })
    };
    // The graph is built (by the caller) before its conversation's render cache is locked; a
    // graph that cannot be built renders nothing, through any cache.
    let conversation_id = match &graph {
        Ok(graph) => graph.conversation().conversation_id.as_str(),
        Err(_) => "",
    };
    let rendered = {
        let mut cache = shared.render_caches.of(conversation_id).lock().await;
        let fresh = match &graph {
            Ok(graph) => blocks_to_render(&cache, graph.conversation(), targets),
            Err(_) => 0,
        };
        let mut render = || {
            render_targets(
                &shared.catalog,
                &mut cache,
                &rendering,
                &graph,
                &operation_id,
                targets,
                max_output_tokens,
                &settings,
            )
        };
        // A large render (with its token count and body digest) would hold this async worker,
        // and every request queued on it, for milliseconds: the worker's other tasks move to
        // another thread while it runs. Only on the multi-thread runtime the gateway serves on
        // (a current-thread runtime has no other thread to move them to).
        if fresh > RENDER_INLINE_BLOCKS_MAX
            && tokio::runtime::Handle::current().runtime_flavor()
                == tokio::runtime::RuntimeFlavor::MultiThread
        {
            shared.render_caches.ran_off_worker();
            tokio::task::block_in_place(render)?
        } else {
            render()?
        }
    };
    match rendered {
        Ok(rendered) => {
            // The prepare begins the first attempt in its own transaction (one durable write
            // for both), unless the dispatch's own target is cooling down: then the driver
            // chooses the target and begins on its own.
            let label = driver::breaker_label(
                &rendered.manifest().body.provider,
                &rendered.manifest().body.model,
            );
            let begin = (!shared.breaker.cooling(&label, now())).then(|| turnstile_store::BeginAtOnce {
                holder: shared.holder.clone(),
                lease_ms: shared.lease_ms,
                target: 0,
            });
            match store_rendered_importing(shared.ledger.as_ref(), rendered, begin.as_ref(), import, now())
                .await?
            {
                Ok((record, began)) => Ok(Started::Record(record, began)),
                Err(refused) => Ok(Started::NotImported(refused)),
            }
        }
        Err(early) => Ok(Started::Early(early)),
    }
}

/// Most blocks a dispatch renders on its async worker; a render of more (over all its targets,
/// not counting the turns a kept render state covers) runs under `block_in_place`. A 500-block
/// cold render takes about a millisecond here; handing the worker's tasks over costs a few
/// microseconds.
pub const RENDER_INLINE_BLOCKS_MAX: usize = 500;

/// The blocks a dispatch's renders will write, over every target: each target's turns after
/// the state its render would resume from (`RenderCache::kept_turn`; all of them for a target
/// whose adapter does not parse: its render fails at once, wherever it runs).
fn blocks_to_render(
    cache: &RenderCache,
    conversation: &turnstile_core::Conversation,
    targets: &[Target],
) -> usize {
    let blocks_from = |turn: usize| -> usize {
        conversation
            .turns
            .get(turn..)
            .map_or(0, |turns| turns.iter().map(|turn| turn.blocks.len()).sum())
    };
    targets
        .iter()
        .map(|target| {
            let kept = target.adapter.parse::<AdapterId>().map_or(0, |adapter| {
                cache.kept_turn(adapter, &target.model, &conversation.conversation_id)
            });
            blocks_from(kept)
        })
        .sum()
}

/// The first attempt a prepare began in its own transaction (`Ledger::prepare_sealed` with a
/// begin).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Began {
    /// The target it sends.
    pub target: u32,
    /// Its generation.
    pub generation: turnstile_core::Generation,
    /// Its idempotency key.
    pub idempotency_key: String,
    /// How many failover targets the prepare stored (none: the driver need not read them).
    pub fallbacks: usize,
    /// When the prepare asked for the attempt's lease (this process's clock, before the
    /// store's transaction): the driver fences itself from here.
    pub asked_at: Timestamp,
}

/// Every target of a dispatch rendered and sealed, before anything is stored: target 0's
/// manifest, bytes and render policy, then the failover targets', each as the prepare sealed
/// it (the store hashes none of them again).
pub struct Rendered {
    pub target: turnstile_store::SealedTarget,
    pub fallbacks: Vec<turnstile_store::SealedTarget>,
}

impl Rendered {
    /// Target 0's manifest.
    pub fn manifest(&self) -> &turnstile_core::manifest::DispatchManifest {
        &self.target.target().manifest
    }
}

/// What a provider's configuration changes in the requests rendered for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProviderRendering {
    /// OpenAI Responses background mode: the provider resumes streams by handle.
    pub background: bool,
    /// OpenAI Chat: all-text messages as one string (`[providers.NAME] text_content`).
    pub text_content: TextContent,
}

/// Render → admission → manifest for every target, without I/O (the gateway's
/// [`prepare_dispatch`] and the deterministic simulation's proxy clients call it). `graph` is
/// the one graph of the validated history every target renders (its validation proof came
/// in with it: nothing here validates again).
/// `rendering(provider)`: None when the provider is not configured.
#[allow(clippy::too_many_arguments)]
pub fn render_targets(
    catalog: &Catalog,
    cache: &mut RenderCache,
    rendering: &dyn Fn(&str) -> Option<ProviderRendering>,
    graph: &Result<Graph<'_>, NotRenderable>,
    operation_id: &str,
    targets: &[Target],
    max_output_tokens: Option<u64>,
    settings: &Settings,
) -> Result<Result<Rendered, Early>, ApiError> {
    let named = |mut error: ApiError, index: usize| {
        if targets.len() > 1 {
            match &mut error.extra {
                Value::Object(extra) => {
                    extra.insert("target".into(), json!(index));
                }
                extra => *extra = json!({"target": index}),
            }
        }
        error
    };
    let mut prepared = Vec::with_capacity(targets.len());
    for (index, target) in targets.iter().enumerate() {
        match prepare_target(
            catalog,
            cache,
            rendering,
            graph,
            operation_id,
            target,
            max_output_tokens,
            settings,
        ) {
            Ok(Ok(one)) => prepared.push(one),
            Ok(Err(mut early)) => {
                if targets.len() > 1
                    && let Early::Paused(reason) = &mut early
                {
                    reason["target"] = json!(index);
                }
                return Ok(Err(early));
            }
            Err(error) => return Err(named(error, index)),
        }
    }
    let mut prepared = prepared.into_iter();
    let Some(target) = prepared.next() else {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidRequest,
            "a dispatch needs a target",
        ));
    };
    Ok(Ok(Rendered {
        target,
        fallbacks: prepared.collect(),
    }))
}

/// A fresh conversation imported in the transaction that prepares its first dispatch (the
/// drop-in proxy's fresh request: `Ledger::import_and_prepare_sealed`).
#[derive(Clone, Debug)]
pub struct NewConversation {
    /// Its id.
    pub conversation_id: String,
    /// Its tools.
    pub tools: Value,
    /// Its whole history, unstamped.
    pub turns: Vec<Value>,
}

/// `ledger.prepare_sealed` of what [`render_targets`] sealed (nothing hashed again), its
/// outcome as the API's answer.
pub async fn store_rendered(
    ledger: &dyn turnstile_store::Ledger,
    rendered: Rendered,
    begin: Option<&turnstile_store::BeginAtOnce>,
    now: Timestamp,
) -> Result<(turnstile_store::DispatchRecord, Option<Began>), ApiError> {
    match store_rendered_importing(ledger, rendered, begin, None, now).await? {
        Ok(stored) => Ok(stored),
        // Nothing is imported without a conversation to import.
        Err(_) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Internal,
            "an import refused without an import",
        )),
    }
}

/// [`store_rendered`], and with `import`, the conversation's import in the same transaction
/// (inner `Err`: the import was refused, `Rejected` or `AlreadyExists`, and nothing was
/// written).
pub async fn store_rendered_importing(
    ledger: &dyn turnstile_store::Ledger,
    rendered: Rendered,
    begin: Option<&turnstile_store::BeginAtOnce>,
    import: Option<&NewConversation>,
    now: Timestamp,
) -> Result<Result<(turnstile_store::DispatchRecord, Option<Began>), turnstile_store::ImportOutcome>, ApiError>
{
    let Rendered { target, fallbacks } = rendered;
    let fallback_count = fallbacks.len();
    let (outcome, begun) = match import {
        Some(import) => {
            use turnstile_store::ImportPrepared;
            let imported = ledger
                .import_and_prepare_sealed(
                    &import.conversation_id,
                    &import.tools,
                    &import.turns,
                    target,
                    fallbacks,
                    begin,
                    now,
                )
                .await
                .map_err(ApiError::store)?;
            match imported {
                ImportPrepared::NotImported(refused) => return Ok(Err(refused)),
                ImportPrepared::NotPrepared(outcome) => Ok((outcome, None)),
                ImportPrepared::Prepared { prepared, began, .. } => Ok((prepared, began)),
            }
        }
        None => ledger.prepare_sealed(target, fallbacks, begin, now).await,
    }
    .map_err(ApiError::store)?;
    // A refused begin (the conversation moved on in between) leaves what the store decided:
    // the dispatch is attached to as it is.
    let began = match (begun, begin) {
        (
            Some(turnstile_store::BeginOutcome::Began {
                generation,
                idempotency_key,
            }),
            Some(begin),
        ) => Some(Began {
            target: begin.target,
            generation,
            idempotency_key,
            fallbacks: fallback_count,
            asked_at: now,
        }),
        _ => None,
    };
    use turnstile_store::PrepareOutcome as Stored;
    match outcome {
        Stored::Created(record) | Stored::Existing(record) => Ok(Ok((record, began))),
        Stored::Conflict { .. } => Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::OperationConflict,
            "that operation id names a different request",
        )),
        Stored::StaleRevision { current } => Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::RevisionConflict,
            "the conversation moved while preparing",
        )
        .with(json!({"current_revision": current.0}))),
        Stored::NotFound => Err(ApiError::not_found("conversation")),
        Stored::Invalid(why) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::ManifestInvalid,
            why,
        )),
    }
}

/// One target's manifest, exact bytes and render policy (Err(Early): it cannot represent the
/// graph).
#[allow(clippy::too_many_arguments)]
fn prepare_target(
    catalog: &Catalog,
    cache: &mut RenderCache,
    rendering: &dyn Fn(&str) -> Option<ProviderRendering>,
    graph: &Result<Graph<'_>, NotRenderable>,
    operation_id: &str,
    target: &Target,
    max_output_tokens: Option<u64>,
    settings: &Settings,
) -> Result<Result<turnstile_store::SealedTarget, Early>, ApiError> {
    let adapter: AdapterId = target.adapter.parse().map_err(|_| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::UnknownAdapter,
            format!("no adapter {:?}", target.adapter),
        )
    })?;
    settings
        .sampling
        .check(adapter.api())
        .map_err(|error| setting_error(SettingError::Sampling(error), adapter))?;
    let Some(ProviderRendering {
        background,
        text_content,
    }) = rendering(&target.provider)
    else {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::UnknownProvider,
            format!("no provider {:?} is configured", target.provider),
        ));
    };
    let graph = graph.clone().map_err(|error| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::NotRenderable,
            error.to_string(),
        )
    })?;
    let prepare_request = PrepareRequest {
        operation_id: operation_id.to_owned(),
        adapter,
        provider: Some(target.provider.clone()),
        model: target.model.clone(),
        max_output_tokens,
        // The gateway always streams from the provider; `stream` only shapes the answer.
        stream: true,
        // Resumable by handle where the provider is configured for it (Responses only).
        background,
        // Chat text as one string where the provider asks for it (`text_content`).
        text_content,
    };
    let outcome = prepare_with_settings(graph, &prepare_request, settings, catalog, cache);
    let prepared = match outcome.map_err(|error| setting_error(error, adapter))? {
        PrepareOutcome::Prepared(prepared) => prepared,
        PrepareOutcome::Paused(pauses) => {
            let reason = json!({"code": "unrepresentable", "adapter": adapter.as_str(),
                                "blocks": serde_json::to_value(&pauses).unwrap_or(Value::Null)});
            return Ok(Err(Early::Paused(reason)));
        }
        PrepareOutcome::OverBudget(over) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::OverBudget,
                "prompt tokens plus the output cap exceed the model's context window",
            )
            .with(
                json!({"prompt_tokens": over.prompt_tokens, "max_output_tokens": over.max_output_tokens,
                         "context_window": over.context_window}),
            ));
        }
    };
    // The render policy the manifest pins (`policy_digest`) is kept beside it, to be shown.
    let Prepared {
        manifest,
        rendered,
        policy,
        ..
    } = *prepared;
    // The prepare just computed every digest of the manifest from exactly these bytes and this
    // policy: the store takes them as they are, without hashing them again.
    Ok(Ok(turnstile_store::SealedTarget::vouched(
        turnstile_store::PreparedTarget {
            manifest,
            request_bytes: rendered.body,
            policy: Some(policy),
        },
    )))
}

/// The client-event hub of a dispatch: its live hub in this process, a new driver for a
/// PREPARED one, or a watch of the ledger for one that is finished or driven elsewhere.
pub(crate) async fn hub_for(
    shared: &Arc<Shared>,
    record: turnstile_store::DispatchRecord,
    began: Option<Began>,
    prepared_from: Option<&Conversation>,
) -> Result<Arc<Hub>, ApiError> {
    let operation_id = record.operation_id.clone();
    let conversation_id = record.conversation_id.clone();
    let hub = {
        let mut hubs = shared.hubs.lock().await;
        match hubs.get(&operation_id) {
            Some(hub) => Some(hub.clone()),
            None if record.state == DispatchState::Prepared || began.is_some() => {
                let hub = shared.hub(&record.conversation_id, &operation_id);
                hubs.insert(operation_id.clone(), hub.clone());
                // A dispatch this request just prepared: its failover targets are known.
                let no_fallbacks = began.as_ref().is_some_and(|began| began.fallbacks == 0);
                match context_with(shared, record.clone(), hub.clone(), prepared_from, no_fallbacks).await {
                    Ok(ctx) => {
                        match began {
                            Some(began) => {
                                shared
                                    .drain
                                    .spawn(driver::drive_begun(shared.clone(), ctx, began))
                            }
                            None => shared.drain.spawn(driver::drive_new(shared.clone(), ctx)),
                        };
                        Some(hub)
                    }
                    Err(error) => {
                        // No hub without a driver: the dispatch stays PREPARED for the sweep
                        // (or a later attach) instead of waiting on a hub nobody feeds; one the
                        // prepare began is recovered once its lease runs out.
                        hubs.remove(&operation_id);
                        hub.finish();
                        return Err(error);
                    }
                }
            }
            None => None,
        }
    };
    let hub = match hub {
        Some(hub) => hub,
        None => {
            // Finished, or driven by another replica: watch the ledger.
            let hub = shared.hub(&conversation_id, &operation_id);
            // Its ids are its own, not the driver's: a `Last-Event-ID` is ignored.
            hub.renumbered();
            tokio::spawn(watch(shared.clone(), operation_id.clone(), hub.clone()));
            hub
        }
    };
    Ok(hub)
}

/// Attach to a dispatch: its live hub in this process, a new driver for a PREPARED one, the
/// stored outcome of a finished one, or a watch of one driven by another replica.
async fn attach(
    shared: Arc<Shared>,
    caller: Caller,
    record: turnstile_store::DispatchRecord,
    began: Option<Began>,
    stream: Stream,
    prepared_from: Option<&Conversation>,
) -> ApiResult {
    let operation_id = record.operation_id.clone();
    if let Stream::Sse { id_seen } = stream {
        // A dispatch that finished here streams from its kept tail, under the ids its events
        // were first sent with; one still driven here from its hub; any other from a watch of
        // the ledger (new ids: the `Last-Event-ID` is ignored and the outcome sent again).
        let tail = match began {
            None if !shared.hubs.lock().await.contains_key(&operation_id) => {
                finished_tail(&shared, &operation_id)
            }
            _ => None,
        };
        let hub = match tail {
            Some(tail) => tail,
            None => hub_for(&shared, record, began, prepared_from).await?,
        };
        return Ok(sse_response(hub.subscribe_after(id_seen)));
    }
    let hub = hub_for(&shared, record, began, prepared_from).await?;
    let _ = caller;
    {
        let mut receiver = hub.subscribe();
        let mut events = Vec::new();
        let mut previews_missed = 0;
        while let Some(next) = receiver.recv().await {
            match next {
                Next::Event(event) => events.push(event),
                Next::Gap {
                    previews_missed: missed,
                } => previews_missed += missed,
            }
        }
        // A commit is final: its state needs no read. Anything else is what the ledger says.
        let committed_here = events
            .iter()
            .any(|event| matches!(&**event, turnstile_drive::DriveEvent::Committed { .. }));
        let state = if committed_here {
            DispatchState::Committed.as_str()
        } else {
            let record = shared
                .ledger
                .dispatch(&operation_id)
                .await
                .map_err(ApiError::store)?;
            record.as_ref().map_or("unknown", |record| record.state.as_str())
        };
        let body = whole_answer(
            caller.client_id(&operation_id).unwrap_or(&operation_id),
            state,
            &events,
            previews_missed,
        );
        Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
    }
}

/// How a dispatch request wants its answer.
#[derive(Clone, Copy)]
enum Stream {
    /// One JSON body once the dispatch ends.
    Whole,
    /// The native SSE stream, after the event `id_seen` (the request's `Last-Event-ID`, when
    /// it is a decimal id) or from the first.
    Sse {
        /// The client's `Last-Event-ID`.
        id_seen: Option<u64>,
    },
}

impl Stream {
    fn of(stream: bool, id_seen: Option<u64>) -> Stream {
        if stream {
            Stream::Sse { id_seen }
        } else {
            Stream::Whole
        }
    }

    /// A request's `Last-Event-ID`.
    fn id_seen(headers: &HeaderMap) -> Option<u64> {
        // Anything but a decimal id (garbage, or another server's) is as if absent: the whole
        // stream, never a guess at where to start
        // (docs/decisions/0126-native-streams-resume-by-last-event-id-the-proxys.md, "Native
        // streams resume by Last-Event-ID").
        headers
            .get("last-event-id")
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.trim().parse::<u64>().ok())
    }
}

/// The kept tail of a dispatch that finished in this process, if it is still kept.
fn finished_tail(shared: &Shared, operation_id: &str) -> Option<Arc<Hub>> {
    let tails = shared
        .finished_tails
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    tails
        .iter()
        .rev()
        .find(|(id, _)| id == operation_id)
        .map(|(_, tail)| tail.clone())
}

/// Write `event`'s client JSON data (what [`client_event_json`] gives, serialised: members
/// sorted as a `Value` writes them) and answer its `event:` name. The frequent events (state,
/// preview, retract, error) are written straight; a commit and a usage report, one each per
/// dispatch at most, through their `Value`.
fn push_event_data(out: &mut Vec<u8>, event: &turnstile_drive::DriveEvent) -> &'static str {
    use std::io::Write as _;
    use turnstile_core::digest::push_json_string;
    use turnstile_drive::DriveEvent;
    // Writes into a Vec cannot fail.
    match event {
        DriveEvent::State { state, generation } => {
            out.extend_from_slice(b"{\"generation\":");
            match generation {
                Some(generation) => {
                    let _ = write!(out, "{}", generation.0);
                }
                None => out.extend_from_slice(b"null"),
            }
            out.extend_from_slice(b",\"state\":");
            push_json_string(out, state.as_str());
            out.push(b'}');
            "state"
        }
        DriveEvent::Preview {
            generation,
            block_index,
            delta,
        } => {
            let _ = write!(out, "{{\"block_index\":{block_index},\"delta\":");
            push_json_string(out, delta);
            let _ = write!(out, ",\"generation\":{}}}", generation.0);
            "preview"
        }
        DriveEvent::Retract { generation, reason } => {
            let _ = write!(out, "{{\"generation\":{},\"reason\":", generation.0);
            push_json_string(out, reason);
            out.push(b'}');
            "retract"
        }
        DriveEvent::Error { code, message } => {
            out.extend_from_slice(b"{\"code\":");
            push_json_string(out, code);
            out.extend_from_slice(b",\"message\":");
            push_json_string(out, message);
            out.push(b'}');
            "error"
        }
        // One each per dispatch at most: through their `Value`, as the stream writes them.
        DriveEvent::Committed { .. } | DriveEvent::Usage { .. } => {
            let (name, data) = client_event_json(event);
            let _ = serde_json::to_writer(out, &data);
            name
        }
    }
}

/// The non-streamed answer of a dispatch, as bytes: `{"events": [...], "operation_id", "revision"?,
/// "state", "turn"?}` with every event (`usage` reports included, as this answer always listed
/// them) as `{"data", "event"}`, and the last committed turn and its revision. Written straight
/// into one buffer, members in the order a `serde_json::Value` of the same answer writes them
/// (sorted), without building that `Value` and a map per event first (issue 21: the tree's
/// inserts and drops were a tenth of a native dispatch's instructions).
/// `previews_missed`: previews the hub dropped before they were read (written as
/// `"previews_missed"` when not 0; the events list lacks them, the turn does not).
fn whole_answer(
    operation_id: &str,
    state: &str,
    events: &[Arc<turnstile_drive::DriveEvent>],
    previews_missed: u64,
) -> Vec<u8> {
    use std::io::Write as _;
    use turnstile_core::digest::push_json_string;
    use turnstile_drive::DriveEvent;
    let mut out = Vec::with_capacity(256 + 96 * events.len());
    out.extend_from_slice(b"{\"events\":[");
    for (index, event) in events.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"data\":");
        let name = push_event_data(&mut out, event);
        out.extend_from_slice(b",\"event\":");
        push_json_string(&mut out, name);
        out.push(b'}');
    }
    out.extend_from_slice(b"],\"operation_id\":");
    push_json_string(&mut out, operation_id);
    if previews_missed > 0 {
        let _ = write!(out, ",\"previews_missed\":{previews_missed}");
    }
    let committed = events.iter().rev().find_map(|event| match &**event {
        DriveEvent::Committed { revision, turn, .. } => Some((revision, turn)),
        _ => None,
    });
    if let Some((revision, _)) = committed {
        let _ = write!(out, ",\"revision\":{}", revision.0);
    }
    out.extend_from_slice(b",\"state\":");
    push_json_string(&mut out, state);
    if let Some((_, turn)) = committed {
        out.extend_from_slice(b",\"turn\":");
        let _ = serde_json::to_writer(&mut out, turn);
    }
    out.push(b'}');
    out
}

/// Poll the ledger for a dispatch this process does not drive, relaying its state until it is
/// terminal (then its committed turn, if any).
/// A ledger that cannot be read is tried again for three leases (the dispatch's fate is decided
/// by then, here or elsewhere); then the clients are told `ledger_unreachable` and how to attach
/// again, never a silent end.
/// A shutdown whose drain timeout passed ends the watch with `error shutting_down`.
pub(crate) async fn watch(shared: Arc<Shared>, operation_id: String, hub: Arc<Hub>) {
    let _running = shared.drain.task();
    let mut last: Option<DispatchState> = None;
    let patience = Duration::from_millis(shared.lease_ms.saturating_mul(3));
    let mut unreadable_since: Option<std::time::Instant> = None;
    // Invariant: once it completed, the check at the top of the loop ends the watch before it
    // could be polled again.
    let handing_over = shared.drain.reached(super::drain::Phase::HandingOver);
    tokio::pin!(handing_over);
    loop {
        if shared.drain.phase() == super::drain::Phase::HandingOver {
            hub.send(turnstile_drive::DriveEvent::Error {
                code: "shutting_down".into(),
                message: turnstile_drive::error_message("shutting_down").into(),
            });
            break;
        }
        let record = match shared.ledger.dispatch(&operation_id).await {
            Ok(Some(record)) => {
                unreadable_since = None;
                record
            }
            Ok(None) => break,
            Err(error) => {
                let since = *unreadable_since.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() >= patience {
                    tracing::warn!(%operation_id, %error, "the ledger stayed unreadable: clients told to attach again");
                    hub.send(turnstile_drive::DriveEvent::Error {
                        code: "ledger_unreachable".into(),
                        message: turnstile_drive::error_message("ledger_unreachable").into(),
                    });
                    break;
                }
                tokio::select! {
                    () = tokio::time::sleep(WATCH_POLL) => {}
                    () = &mut handing_over => {}
                }
                continue;
            }
        };
        if last != Some(record.state) {
            last = Some(record.state);
            hub.send(turnstile_drive::DriveEvent::State {
                state: record.state,
                generation: record.active_generation,
            });
        }
        if record.state.is_terminal() {
            if let Some(revision) = record.committed_revision {
                let turn = match shared.ledger.conversation(&record.conversation_id).await {
                    Ok(Some(document)) => document["turns"]
                        .as_array()
                        .and_then(|turns| turns.iter().find(|turn| turn["revision"] == revision.0))
                        .cloned()
                        .unwrap_or(Value::Null),
                    _ => Value::Null,
                };
                // The same event the driver emits at its commit: the stored outcome is the
                // commit offer's facts (stop reason and usage).
                hub.send(turnstile_drive::DriveEvent::Committed {
                    revision,
                    turn,
                    facts: record.outcome.clone(),
                });
            }
            break;
        }
        tokio::select! {
            () = tokio::time::sleep(WATCH_POLL) => {}
            () = &mut handing_over => {}
        }
    }
    hub.finish();
}

/// What a driver needs about a stored dispatch.
pub async fn context_for(
    shared: &Arc<Shared>,
    record: turnstile_store::DispatchRecord,
    hub: Arc<Hub>,
) -> Result<DriveContext, ApiError> {
    context_with(shared, record, hub, None, false).await
}

/// [`context_for`], reusing the conversation the caller just prepared from when it is the one
/// the dispatch was rendered from (same id and revision) instead of reading and decoding the
/// whole history again.
async fn context_with(
    shared: &Arc<Shared>,
    record: turnstile_store::DispatchRecord,
    hub: Arc<Hub>,
    known: Option<&Conversation>,
    no_fallbacks: bool,
) -> Result<DriveContext, ApiError> {
    let manifest = &record.manifest;
    let adapter = manifest["adapter"].as_str().unwrap_or("");
    let api = StreamApi::for_adapter(adapter).ok_or_else(|| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::UnknownAdapter,
            format!("stored adapter {adapter:?}"),
        )
    })?;
    let model = manifest["model"].as_str().unwrap_or("").to_owned();
    let endpoint_of = |provider: &str| {
        shared.endpoints.get(provider).cloned().ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::UnknownProvider,
                format!("provider {provider:?} is not configured"),
            )
        })
    };
    let endpoint = endpoint_of(&record.provider)?;
    let mut targets = vec![super::driver::TargetContext {
        api,
        model: model.clone(),
        endpoint: endpoint.clone(),
        request_digest: record.request_digest.clone(),
        request_bytes: Arc::new(record.request_bytes.clone()),
        provider: record.provider.clone(),
    }];
    // Failover targets, each with its own manifest and bytes (none for most dispatches).
    let fallbacks = if no_fallbacks {
        Vec::new()
    } else {
        shared
            .ledger
            .dispatch_fallbacks(&record.operation_id)
            .await
            .map_err(ApiError::store)?
    };
    for target in fallbacks {
        let api = StreamApi::for_adapter(&target.adapter).ok_or_else(|| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                ErrorCode::UnknownAdapter,
                format!("stored adapter {:?}", target.adapter),
            )
        })?;
        targets.push(super::driver::TargetContext {
            api,
            endpoint: endpoint_of(&target.provider)?,
            model: target.model,
            request_digest: target.request_digest,
            request_bytes: Arc::new(target.request_bytes),
            provider: target.provider,
        });
    }
    let known = known.filter(|conversation| {
        conversation.conversation_id == record.conversation_id && conversation.revision == record.revision
    });
    let read;
    let conversation = match known {
        Some(conversation) => conversation,
        None => {
            let document = shared
                .ledger
                .conversation(&record.conversation_id)
                .await
                .map_err(ApiError::store)?
                .ok_or_else(|| ApiError::not_found("conversation"))?;
            read = Conversation::from_value(document).map_err(|error| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    ErrorCode::StoredHistoryUnreadable,
                    error.to_string(),
                )
            })?;
            &read
        }
    };
    let toolset = if conversation.tools.is_empty() {
        None
    } else {
        let mut cache = shared.toolsets.lock().await;
        Some(
            cache
                .compiled(&conversation.toolset_digest, &conversation.tools)
                .map_err(|error| {
                    ApiError::new(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        ErrorCode::InvalidToolSchema,
                        error.to_string(),
                    )
                })?,
        )
    };
    let mut call_ids_taken = HashSet::new();
    for turn in &conversation.turns {
        for block in &turn.blocks {
            if let turnstile_core::conversation::BlockBody::ToolCall { call_id, .. } = &block.body {
                call_ids_taken.insert(call_id.0.clone());
            }
        }
    }
    Ok(DriveContext {
        record,
        api,
        model,
        endpoint,
        targets,
        toolset,
        call_ids_taken,
        hub,
        trace_parent: super::traces::Parent::current(),
    })
}

/// A client event as the spec writes it (`gateway-api.md`, "Client stream events"): its
/// `event:` name and its JSON data. The only place the native API turns a hub event into JSON.
fn client_event_json(event: &turnstile_drive::DriveEvent) -> (&'static str, Value) {
    use turnstile_drive::DriveEvent;
    match event {
        DriveEvent::State { state, generation } => (
            "state",
            json!({"state": state.as_str(), "generation": generation.map(|g| g.0)}),
        ),
        DriveEvent::Preview {
            generation,
            block_index,
            delta,
        } => (
            "preview",
            json!({"generation": generation.0, "block_index": block_index, "delta": delta}),
        ),
        DriveEvent::Retract { generation, reason } => {
            ("retract", json!({"generation": generation.0, "reason": reason}))
        }
        DriveEvent::Committed {
            revision,
            turn,
            facts,
        } => {
            let mut data = json!({"revision": revision.0, "turn": turn});
            if let (Some(Value::Object(facts)), Some(object)) = (facts, data.as_object_mut()) {
                object.extend(facts.iter().map(|(key, value)| (key.clone(), value.clone())));
            }
            ("committed", data)
        }
        DriveEvent::Usage { generation, usage } => {
            ("usage", json!({"generation": generation.0, "usage": usage}))
        }
        DriveEvent::Error { code, message } => ("error", json!({"code": code, "message": message})),
    }
}

/// One SSE event: its `id:` (the dispatch's event ordinal, what a client resumes after with
/// `Last-Event-ID`), its `event:` name and its `data:`.
fn sse_frame(id: u64, event: &str, data: &Value) -> Bytes {
    Bytes::from(format!("id: {id}\nevent: {event}\ndata: {data}\n\n"))
}

/// [`sse_frame`] of a hub event, its data written by [`push_event_data`] (the same bytes).
fn sse_event_frame(id: u64, event: &turnstile_drive::DriveEvent) -> Bytes {
    use std::io::Write as _;
    let mut data = Vec::with_capacity(96);
    let name = push_event_data(&mut data, event);
    let mut frame = Vec::with_capacity(data.len() + name.len() + 40);
    // Writes into a Vec cannot fail.
    let _ = write!(frame, "id: {id}\n");
    frame.extend_from_slice(b"event: ");
    frame.extend_from_slice(name.as_bytes());
    frame.extend_from_slice(b"\ndata: ");
    frame.extend_from_slice(&data);
    frame.extend_from_slice(b"\n\n");
    Bytes::from(frame)
}

/// An SSE response: every event of the dispatch from the receiver's position (its first, or
/// the one after a client's `Last-Event-ID`), until the end marker. Each event carries its
/// hub id as its SSE `id:`.
fn sse_response(mut receiver: super::hub::Receiver) -> Response {
    let (sender, out) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(64);
    tokio::spawn(async move {
        loop {
            match receiver.recv().await {
                // The spec's client events only: the hub's `usage` reports are for the proxy.
                Some(Next::Event(event)) if matches!(*event, turnstile_drive::DriveEvent::Usage { .. }) => {}
                Some(Next::Event(event)) => {
                    if sender
                        .send(Ok(sse_event_frame(receiver.id_last(), &event)))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                None => return,
                Some(Next::Gap { previews_missed }) => {
                    // Under the id of the last preview dropped: a resume from it goes on after
                    // the gap. The stream goes on; the commit still comes.
                    metrics::bump(metrics::CLIENT_STREAM_GAPS);
                    let data = json!({"previews_missed": previews_missed});
                    if sender
                        .send(Ok(sse_frame(receiver.id_last(), "gap", &data)))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
    });
    sse_headers(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(
        out,
    )))
}

/// An SSE response of one event (an answer before any dispatch exists: `waiting`, `rejected`,
/// `paused`), streamed like every other SSE body. Its id is 0, "nothing of a dispatch": a
/// client that resumes from it gets the whole stream of whatever its request starts then.
fn sse_once(event: &str, data: &Value) -> Response {
    let frame = sse_frame(0, event, data);
    sse_headers(Body::from_stream(tokio_stream::once(Ok::<_, Infallible>(frame))))
}

fn sse_headers(body: Body) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

pub async fn get_dispatch(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path(operation_id): Path<String>,
) -> ApiResult {
    let caller = caller(&shared, &headers)?;
    let store_id = caller.store_id(&operation_id);
    let record = shared
        .ledger
        .dispatch(&store_id)
        .await
        .map_err(ApiError::store)?
        .ok_or_else(|| ApiError::not_found("dispatch"))?;
    let attempts = shared.ledger.attempts(&store_id).await.map_err(ApiError::store)?;
    let policy = shared
        .ledger
        .dispatch_policy(&store_id)
        .await
        .map_err(ApiError::store)?;
    let fallbacks = shared
        .ledger
        .dispatch_fallbacks(&store_id)
        .await
        .map_err(ApiError::store)?;
    // Every target: the dispatch's own manifest, then its failover targets, each with the
    // manifest its attempts sent.
    let text = |manifest: &Value, field: &str| manifest[field].as_str().unwrap_or_default().to_owned();
    let mut targets = vec![
        json!({"position": 0, "provider": record.provider, "model": text(&record.manifest, "model"),
                                  "adapter": text(&record.manifest, "adapter"), "manifest_digest": record.manifest_digest,
                                  "request_digest": record.request_digest}),
    ];
    for target in &fallbacks {
        targets.push(
            json!({"position": target.position, "provider": target.provider, "model": target.model,
                            "adapter": target.adapter, "manifest_digest": target.manifest_digest,
                            "request_digest": target.request_digest, "manifest": target.manifest,
                            "request_body": String::from_utf8_lossy(&target.request_bytes)}),
        );
    }
    // What the provider's side of each attempt's connections showed (`attempts.rs`).
    let evidence = shared.ledger.evidence(&store_id).await.map_err(ApiError::store)?;
    let attempts: Vec<Value> = attempts
        .into_iter()
        .map(|attempt| {
            let target = &targets[(attempt.target as usize).min(targets.len() - 1)];
            let seen: Vec<&Value> = evidence
                .iter()
                .filter(|(generation, _)| *generation == attempt.generation)
                .map(|(_, row)| row)
                .collect();
            json!({"generation": attempt.generation.0, "state": attempt.state.as_str(), "handle": attempt.handle,
                   "target": attempt.target, "provider": target["provider"], "model": target["model"],
                   "adapter": target["adapter"], "manifest_digest": target["manifest_digest"],
                   "request_digest": attempt.request_digest,
                   "end_reason": attempt.end_reason, "confirmed_over": attempt.confirmed_over,
                   "resumes": attempt.resumes, "replays": attempt.replays, "evidence": seen,
                   "history": attempt.history.iter().map(|(state, at)| json!({"state": state.as_str(), "at": at.0})).collect::<Vec<_>>()})
        })
        .collect();
    let mut body = json!({"operation_id": operation_id, "state": record.state.as_str(), "manifest": record.manifest,
                   "request_digest": record.request_digest, "request_body": String::from_utf8_lossy(&record.request_bytes),
                   "attempts": attempts, "targets": targets});
    // The committed attempt's stop reason and usage, as the provider reported them (traces
    // carry the same numbers).
    body["outcome"] = record.outcome.clone().unwrap_or(Value::Null);
    // Every setting that reaches the provider (sampling, tool choice, output format, client
    // fields, cache breakpoints): it hashes to the manifest's `policy_digest`.
    body["policy"] = policy.unwrap_or(Value::Null);
    Ok(Json(body).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCallQuery {
    state: Option<String>,
}

/// The execution ledger (`GET /v1/tool-calls?state=ready|claimed|expired|done`, and `client`
/// and `client_abandoned` for calls handed to a proxy client). States are judged by the store's
/// clock at the read: a claim whose lease ran out is listed as `expired`, a client's hold that
/// ended as `client_abandoned`.
pub async fn tool_calls(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    query: Result<Query<ToolCallQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult {
    let caller = caller(&shared, &headers)?;
    // A query string that cannot be read (an unknown or repeated parameter) is 400, as an
    // unreadable path is; a readable one naming no state is 422.
    let Query(query) = query.map_err(|rejection| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidRequest,
            rejection.body_text(),
        )
    })?;
    let state = match query.state.as_deref() {
        None => None,
        Some(text) => Some(ToolCallState::parse(text).ok_or_else(|| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::InvalidRequest,
                "state is ready, claimed, expired, client, client_abandoned or done",
            )
        })?),
    };
    let calls = shared.ledger.tool_calls(state).await.map_err(ApiError::store)?;
    let calls: Vec<Value> = calls
        .into_iter()
        .filter_map(|call| {
            let conversation_id = caller.client_id(&call.conversation_id)?.to_owned();
            Some(json!({"conversation_id": conversation_id, "call_id": call.call_id, "revision": call.revision.0,
                        "generation": call.generation.0, "tool": call.tool, "arguments": call.arguments,
                        "args_digest": call.args_digest, "state": call.state.as_str(), "claim": call.claim,
                        "claims": call.claim, "holder": call.claim_holder,
                        "claim_expires_at": call.claim_expires_at.map(|at| at.0),
                        "idempotency_key": call.idempotency_key}))
        })
        .collect();
    Ok(Json(json!({"tool_calls": calls})).into_response())
}

/// `POST …/claim`: `{"holder", "lease_ms"?}`. `holder` is required (the spec's claim body
/// names it): an empty body or `{}` claims nothing
/// (docs/decisions/0129-a-claim-names-its-holder.md, "A claim names its holder").
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClaimBody {
    #[serde(default)]
    holder: Option<String>,
    #[serde(default)]
    lease_ms: Option<u64>,
}

/// `POST …/renew`: `{"claim", "lease_ms"?}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RenewBody {
    claim: u64,
    #[serde(default)]
    lease_ms: Option<u64>,
}

/// `POST …/release`: `{"claim"}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseBody {
    claim: u64,
}

/// `POST …/result`: `{"claim", "status"?, "content"?}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResultBody {
    claim: u64,
    #[serde(default = "success_status")]
    status: String,
    #[serde(default)]
    content: Option<Value>,
}

fn success_status() -> String {
    "success".into()
}

/// Authenticate and read a strict executor body (422 `invalid_request` on unknown fields,
/// missing or mistyped ones).
async fn executor_body<T: serde::de::DeserializeOwned>(
    shared: &Shared,
    request: Request,
) -> Result<(Caller, T), ApiError> {
    let (caller, body) = authenticated_json(shared, request).await?;
    if !body.is_object() {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidRequest,
            "the body must be a JSON object",
        ));
    }
    let body = serde_json::from_value(body).map_err(|error| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidRequest,
            error.to_string(),
        )
    })?;
    Ok((caller, body))
}

/// A claim lease: the gateway's `lease_ms` when absent, else 1..=`CLAIM_LEASE_MS_MAX` (refused,
/// never clamped).
fn claim_lease_ms(shared: &Shared, lease_ms: Option<u64>) -> Result<u64, ApiError> {
    match lease_ms {
        None => Ok(shared.lease_ms.clamp(1, CLAIM_LEASE_MS_MAX)),
        Some(ms) if (1..=CLAIM_LEASE_MS_MAX).contains(&ms) => Ok(ms),
        Some(_) => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidRequest,
            format!("lease_ms must be 1–{CLAIM_LEASE_MS_MAX}"),
        )
        .with(json!({"limit": "CLAIM_LEASE_MS_MAX"}))),
    }
}

fn stale_claim(state: ToolCallState) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        ErrorCode::StaleClaim,
        "the claim is not the call's current one, or its lease ran out",
    )
    .with(json!({"state": state.as_str()}))
}

pub async fn claim_tool_call(
    State(shared): State<Arc<Shared>>,
    Path((conversation_id, call_id)): Path<(String, String)>,
    request: Request,
) -> ApiResult {
    let (caller, body): (_, ClaimBody) = executor_body(&shared, request).await?;
    let Some(holder) = body.holder else {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidRequest,
            "a claim names its holder: {\"holder\": \"<executor name>\", \"lease_ms\"?}",
        )
        .with(json!({"field": "holder"})));
    };
    let lease_ms = claim_lease_ms(&shared, body.lease_ms)?;
    if holder.is_empty() || holder.len() > ID_BYTES_MAX || holder.chars().any(char::is_control) {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidRequest,
            format!("holder must be 1–{ID_BYTES_MAX} bytes without control characters"),
        ));
    }
    match shared
        .ledger
        .claim_call(&caller.store_id(&conversation_id), &call_id, &holder, lease_ms)
        .await
        .map_err(ApiError::store)?
    {
        CallClaimOutcome::Claimed(granted) => {
            metrics::bump(metrics::TOOL_CALL_CLAIMS);
            if granted.took_over_expired {
                metrics::bump(metrics::TOOL_CALL_EXPIRIES);
            }
            Ok(Json(
                json!({"claim": granted.claim, "lease_expires_at": granted.lease_expires_at.0,
                           "idempotency_key": granted.idempotency_key,
                           "took_over_expired": granted.took_over_expired}),
            )
            .into_response())
        }
        CallClaimOutcome::Unavailable { state } => Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::Unavailable,
            "the call is claimed, handed to the client, or done",
        )
        .with(json!({"state": state.as_str()}))),
        CallClaimOutcome::NotFound => Err(ApiError::not_found("tool call")),
    }
}

/// `POST /v1/tool-calls/{conversation_id}/{call_id}/renew`.
pub async fn renew_tool_call(
    State(shared): State<Arc<Shared>>,
    Path((conversation_id, call_id)): Path<(String, String)>,
    request: Request,
) -> ApiResult {
    let (caller, body): (_, RenewBody) = executor_body(&shared, request).await?;
    let lease_ms = claim_lease_ms(&shared, body.lease_ms)?;
    match shared
        .ledger
        .renew_call(&caller.store_id(&conversation_id), &call_id, body.claim, lease_ms)
        .await
        .map_err(ApiError::store)?
    {
        RenewOutcome::Renewed { lease_expires_at } => {
            metrics::bump(metrics::TOOL_CALL_RENEWALS);
            Ok(Json(json!({"claim": body.claim, "lease_expires_at": lease_expires_at.0})).into_response())
        }
        RenewOutcome::StaleClaim { state } => Err(stale_claim(state)),
        RenewOutcome::NotFound => Err(ApiError::not_found("tool call")),
    }
}

/// `POST /v1/tool-calls/{conversation_id}/{call_id}/release`.
pub async fn release_tool_call(
    State(shared): State<Arc<Shared>>,
    Path((conversation_id, call_id)): Path<(String, String)>,
    request: Request,
) -> ApiResult {
    let (caller, body): (_, ReleaseBody) = executor_body(&shared, request).await?;
    match shared
        .ledger
        .release_call(&caller.store_id(&conversation_id), &call_id, body.claim)
        .await
        .map_err(ApiError::store)?
    {
        ReleaseOutcome::Released => {
            metrics::bump(metrics::TOOL_CALL_RELEASES);
            Ok(Json(json!({"claim": body.claim, "state": ToolCallState::Ready.as_str()})).into_response())
        }
        ReleaseOutcome::StaleClaim { state } => Err(stale_claim(state)),
        ReleaseOutcome::NotFound => Err(ApiError::not_found("tool call")),
    }
}

pub async fn submit_tool_result(
    State(shared): State<Arc<Shared>>,
    Path((conversation_id, call_id)): Path<(String, String)>,
    request: Request,
) -> ApiResult {
    let (caller, body): (_, ResultBody) = executor_body(&shared, request).await?;
    let content = body.content.unwrap_or(json!([]));
    let outcome = shared
        .ledger
        .submit_tool_result(
            &caller.store_id(&conversation_id),
            &call_id,
            body.claim,
            &body.status,
            &content,
            now(),
        )
        .await
        .map_err(ApiError::store)?;
    match outcome {
        ResultOutcome::Appended { revision } => {
            shared
                .feed
                .conversation(&caller.store_id(&conversation_id), revision.0);
            Ok(Json(json!({"revision": revision.0})).into_response())
        }
        ResultOutcome::StaleClaim => {
            metrics::bump(metrics::TOOL_RESULT_STALE);
            Err(ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::StaleClaim,
                "the claim is not the call's current one (it was released or taken over)",
            ))
        }
        ResultOutcome::Duplicate => {
            metrics::bump(metrics::TOOL_RESULT_DUPLICATES);
            Err(ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::DuplicateResult,
                "the call already has its result",
            ))
        }
        ResultOutcome::Rejected(violations) => {
            metrics::rejected(&violations);
            Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::Rejected,
                "the result would make the history illegal",
            )
            .with(json!({"violations": violations_json(&violations)})))
        }
        ResultOutcome::NotFound => Err(ApiError::not_found("tool call")),
        ResultOutcome::Conflict => Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::RevisionConflict,
            "another turn landed; retry",
        )),
    }
}

// ---- Listings for the console (issue 18): conversations, quarantine pages ----

/// `GET /v1/conversations` query (spec additions: `limit`, `after`, `q`; ours: `state`,
/// `provider`, `pending`). Unknown parameters are refused like unknown body fields.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConversationListQuery {
    limit: Option<u64>,
    after: Option<String>,
    q: Option<String>,
    state: Option<String>,
    provider: Option<String>,
    pending: Option<bool>,
}

/// Page size of a listing when the client names none.
const LIST_LIMIT_DEFAULT: u64 = 50;

fn bad_query(message: impl Into<String>) -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        ErrorCode::InvalidRequest,
        message,
    )
}

/// A listing's page size: `limit` or the default, refused outside 1..=`max`.
pub(crate) fn list_limit(limit: Option<u64>, max: u64) -> Result<u64, ApiError> {
    let limit = limit.unwrap_or(LIST_LIMIT_DEFAULT.min(max));
    if (1..=max).contains(&limit) {
        Ok(limit)
    } else {
        Err(bad_query(format!("limit must be 1–{max}")))
    }
}

/// A listing cursor is `<updated_at>.<conversation id>` (opaque to clients; the id is the
/// caller's own, so a cursor never names a tenant).
fn conversation_cursor(
    caller: &Caller,
    cursor: &str,
) -> Result<turnstile_store::ConversationCursor, ApiError> {
    let (at, id) = cursor
        .split_once('.')
        .ok_or_else(|| bad_query("after is not a cursor this listing gave"))?;
    let at: u64 = at
        .parse()
        .map_err(|_| bad_query("after is not a cursor this listing gave"))?;
    check_id(id, "the cursor's conversation id")?;
    Ok(turnstile_store::ConversationCursor {
        updated_at: turnstile_core::dispatch::Timestamp(at),
        conversation_id: caller.store_id(id),
    })
}

/// `GET /v1/conversations?limit=N&after=CURSOR&q=TEXT&state=S&provider=P&pending=BOOL`: most
/// recently updated first; `last_dispatch` is the newest dispatch (`provider` added),
/// `pending_calls` the calls without a result.
pub async fn list_conversations(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(query): Query<ConversationListQuery>,
) -> ApiResult {
    let caller = caller(&shared, &headers)?;
    let limit = list_limit(query.limit, turnstile_store::listing::CONVERSATIONS_PAGE_MAX)?;
    let search = query.q.unwrap_or_default();
    if search.len() > turnstile_store::listing::SEARCH_BYTES_MAX {
        return Err(bad_query(format!(
            "q is at most {} bytes",
            turnstile_store::listing::SEARCH_BYTES_MAX
        )));
    }
    let state = match query.state.as_deref() {
        None | Some("") => None,
        Some(text) => Some(
            DispatchState::parse(text)
                .ok_or_else(|| bad_query(format!("state {text:?} is not a dispatch state")))?,
        ),
    };
    let after = query
        .after
        .as_deref()
        .filter(|cursor| !cursor.is_empty())
        .map(|cursor| conversation_cursor(&caller, cursor))
        .transpose()?;
    let listing = turnstile_store::ConversationQuery {
        id_prefix: caller.store_id(""),
        search,
        after,
        state,
        provider: query.provider.filter(|provider| !provider.is_empty()),
        pending: query.pending.map(|pending| {
            if pending {
                turnstile_store::PendingFilter::Some
            } else {
                turnstile_store::PendingFilter::None
            }
        }),
        limit,
    };
    let page = shared
        .ledger
        .conversation_page(&listing)
        .await
        .map_err(ApiError::store)?;
    let client = |id: &str| caller.client_id(id).unwrap_or(id).to_owned();
    let conversations: Vec<Value> = page
        .conversations
        .iter()
        .map(|summary| {
            let last = summary.last_dispatch.as_ref().map(|last| {
                json!({"operation_id": client(&last.operation_id), "state": last.state.as_str(), "provider": last.provider})
            });
            json!({"conversation_id": client(&summary.conversation_id), "revision": summary.revision.0,
                   "updated_at": summary.updated_at.0, "last_dispatch": last, "pending_calls": summary.pending_calls})
        })
        .collect();
    let next = page
        .next
        .map(|next| format!("{}.{}", next.updated_at.0, client(&next.conversation_id)));
    Ok(Json(json!({"conversations": conversations, "next": next})).into_response())
}

/// `GET /v1/quarantine` query.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuarantineQuery {
    limit: Option<u64>,
    before: Option<i64>,
}

/// `GET /v1/quarantine?limit=N&before=ID`: the caller's quarantined blocks newest first, with
/// time and content; `next` is the `before` of the next page.
pub async fn quarantine(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(query): Query<QuarantineQuery>,
) -> ApiResult {
    let caller = caller(&shared, &headers)?;
    let limit = list_limit(query.limit, turnstile_store::listing::QUARANTINE_PAGE_MAX)?;
    let page = shared
        .ledger
        .quarantine_page(&caller.store_id(""), query.before, limit)
        .await
        .map_err(ApiError::store)?;
    let entries: Vec<Value> = page
        .entries
        .into_iter()
        .filter_map(|record| {
            let operation_id = caller.client_id(&record.entry.operation_id)?.to_owned();
            Some(
                json!({"id": record.id, "operation_id": operation_id, "generation": record.entry.generation.0,
                        "reason": record.entry.reason, "content": record.entry.content, "at": record.at.0}),
            )
        })
        .collect();
    Ok(Json(json!({"quarantine": entries, "next": page.next})).into_response())
}

pub async fn metrics_text(State(shared): State<Arc<Shared>>) -> Response {
    // From the store: the oldest attempt past its lease that is not over, on any replica.
    if let Ok(age_ms) = shared.ledger.stuck_age_ms().await {
        metrics::unknown_age(age_ms as f64 / 1000.0);
    }
    metrics::store_write_ops(shared.ledger.write_ops());
    metrics::store_read_ops(shared.ledger.read_ops());
    let (kept, whole) = shared.kept.stats();
    metrics::conversation_reads(kept, whole);
    // Read here: client backlogs change it without a driver to report it.
    metrics::output_bytes(shared.output_budget.held());
    let (renders, resumed) = shared.render_caches.renders().await;
    metrics::renders(renders, resumed, shared.render_caches.off_worker());
    metrics::breaker_open(shared.breaker.open_count(super::now()));
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        shared.prometheus.render(),
    )
        .into_response()
}

/// Liveness and store reachability (spec): 200 when the store answered a read within
/// `health_timeout_ms`, else 503, always within that bound, whatever the store does.
pub async fn healthz(State(shared): State<Arc<Shared>>) -> Response {
    if store_answers(&shared, tokio::time::Instant::now() + shared.health_timeout).await {
        Json(json!({"status": "ok", "store": "reachable"})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "degraded", "store": "unreachable"})),
        )
            .into_response()
    }
}

/// The process answers: no store involved (a Kubernetes liveness probe; a restart cures
/// nothing a store outage causes).
pub async fn livez() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

/// Readiness: the store answers a read, and its writes are not failing, within
/// `health_timeout_ms`. Writes are judged by the outcome of the last write transaction
/// (`Ledger::write_failing`); only while that failed does this write itself (a probe that
/// changes nothing anyone reads), so a store whose disk filled and was freed is seen ready again
/// without waiting for traffic it is not sent. 503 carries `store_unavailable`.
pub async fn readyz(State(shared): State<Arc<Shared>>) -> Response {
    let deadline = tokio::time::Instant::now() + shared.health_timeout;
    let reachable = store_answers(&shared, deadline).await;
    let writes_ok = reachable && (!shared.ledger.write_failing() || write_probe(&shared, deadline).await);
    let store = if reachable { "reachable" } else { "unreachable" };
    let writes = match (reachable, writes_ok) {
        (false, _) => "unknown",
        (true, true) => "ok",
        (true, false) => "failing",
    };
    if writes_ok {
        return Json(json!({"status": "ready", "store": store, "writes": writes})).into_response();
    }
    let message = if reachable {
        "the store's writes are failing"
    } else {
        "the store did not answer within health_timeout_ms"
    };
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({
            "status": "not_ready",
            "store": store,
            "writes": writes,
            "error": {"code": ErrorCode::StoreUnavailable.as_str(), "message": message},
        })),
    )
        .into_response()
}

/// The store answered a read before `deadline`. The read runs on its own task, so a deadline
/// that passes does not cancel it halfway through its transaction.
async fn store_answers(shared: &Arc<Shared>, deadline: tokio::time::Instant) -> bool {
    let ledger = Arc::clone(&shared.ledger);
    let read = tokio::spawn(async move { ledger.counters().await.is_ok() });
    matches!(tokio::time::timeout_at(deadline, read).await, Ok(Ok(true)))
}

/// The store committed a write probe before `deadline` (its own task, as [`store_answers`]:
/// one that finishes late still records its outcome for the next probe).
async fn write_probe(shared: &Arc<Shared>, deadline: tokio::time::Instant) -> bool {
    let ledger = Arc::clone(&shared.ledger);
    let probe = tokio::spawn(async move { ledger.write_probe().await.is_ok() });
    matches!(tokio::time::timeout_at(deadline, probe).await, Ok(Ok(true)))
}

/// Unrouted requests: 404 in the API's JSON error shape.
pub async fn fallback() -> ApiResult {
    Err(ApiError::not_found("route"))
}

/// A path that exists, with a method it does not take.
pub async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        ErrorCode::MethodNotAllowed,
        "this path does not take that method",
    )
}

/// Every error of the router in our JSON shape (spec additions: "every error of the native
/// API, including 404, 405, 413, 414 and query-string errors"): 405 from the method fallback,
/// 414 for a target over [`URI_BYTES_MAX`], and any error response that is not JSON already
/// (axum's plain-text `Path`/`Query` rejections) rewritten by [`json_errors`].
pub fn harden(router: axum::Router) -> axum::Router {
    router
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn(json_errors))
}

/// Longest text of a rejection kept as the message.
const REJECTION_TEXT_BYTES_MAX: usize = 1024;

/// The drop-in proxy's paths (`serve/mod.rs::router`).
fn is_proxy_path(path: &str) -> bool {
    matches!(path, "/v1/chat/completions" | "/v1/responses" | "/v1/messages")
        || path.starts_with("/v1/responses/")
        || path.starts_with("/v1beta/")
}

async fn json_errors(request: Request, next: axum::middleware::Next) -> Response {
    let target_len = request
        .uri()
        .path_and_query()
        .map_or(0, |target| target.as_str().len());
    if target_len > URI_BYTES_MAX {
        return ApiError::new(
            StatusCode::URI_TOO_LONG,
            ErrorCode::UriTooLong,
            format!("the request target exceeds {URI_BYTES_MAX} bytes"),
        )
        .into_response();
    }
    // The provider-compatible endpoints answer in their provider's error shape, and in shadow
    // mode forward the provider's own response untouched: never rewritten here.
    let proxied = is_proxy_path(request.uri().path());
    let response = next.run(request).await;
    if proxied {
        return response;
    }
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let code = match status {
        StatusCode::NOT_FOUND => ErrorCode::NotFound,
        StatusCode::METHOD_NOT_ALLOWED => ErrorCode::MethodNotAllowed,
        StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::BodyTooLarge,
        StatusCode::URI_TOO_LONG => ErrorCode::UriTooLong,
        StatusCode::UNAUTHORIZED => ErrorCode::Unauthorized,
        status if status.is_server_error() => ErrorCode::Internal,
        _ => ErrorCode::InvalidRequest,
    };
    let text = axum::body::to_bytes(response.into_body(), REJECTION_TEXT_BYTES_MAX)
        .await
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        text
    };
    ApiError::new(status, code, message).into_response()
}

#[cfg(test)]
mod tests {
    use super::ErrorCode;
    use proptest::prelude::*;
    use serde_json::{Value, json};
    use std::collections::HashSet;
    use std::sync::Arc;
    use turnstile_core::assemble::Usage;
    use turnstile_core::dispatch::DispatchState;
    use turnstile_core::{Generation, Revision};
    use turnstile_drive::DriveEvent;

    /// The non-streamed answer as it was written before `whole_answer`: a `Value` built with
    /// `json!` and serialised (the definition `whole_answer` must keep, byte for byte).
    fn answer_through_value(operation_id: &str, state: &str, events: &[Arc<DriveEvent>]) -> Vec<u8> {
        let listed: Vec<Value> = events
            .iter()
            .map(|event| {
                let (name, data) = super::client_event_json(event);
                json!({"event": name, "data": data})
            })
            .collect();
        let mut body = json!({"operation_id": operation_id, "state": state, "events": listed});
        let committed = events.iter().rev().find_map(|event| match &**event {
            DriveEvent::Committed { revision, turn, .. } => Some((revision, turn)),
            _ => None,
        });
        if let Some((revision, turn)) = committed {
            body["revision"] = json!(revision.0);
            body["turn"] = turn.clone();
        }
        serde_json::to_vec(&body).unwrap()
    }

    /// Any text, control characters (which JSON escapes) drawn as often as any other char.
    fn any_text() -> impl Strategy<Value = String> {
        let one = prop_oneof![
            any::<char>(),
            (0u8..0x20).prop_map(char::from),
            Just('"'),
            Just('\\')
        ];
        prop::collection::vec(one, 0..40).prop_map(String::from_iter)
    }

    fn any_event() -> impl Strategy<Value = DriveEvent> {
        let text = any_text;
        let states = prop::sample::select(vec![
            DispatchState::Prepared,
            DispatchState::Dispatching,
            DispatchState::Sent,
            DispatchState::Streaming,
            DispatchState::Unknown,
            DispatchState::Committed,
            DispatchState::Failed,
            DispatchState::Abandoned,
        ]);
        prop_oneof![
            (states, any::<Option<u64>>()).prop_map(|(state, generation)| DriveEvent::State {
                state,
                generation: generation.map(Generation),
            }),
            (any::<u64>(), any::<u64>(), text()).prop_map(|(generation, block_index, delta)| {
                DriveEvent::Preview {
                    generation: Generation(generation),
                    block_index,
                    delta,
                }
            }),
            (any::<u64>(), text()).prop_map(|(generation, reason)| DriveEvent::Retract {
                generation: Generation(generation),
                reason,
            }),
            (any::<u64>(), text(), any::<Option<u64>>(), any::<bool>()).prop_map(
                |(revision, text, tokens, facts)| DriveEvent::Committed {
                    revision: Revision(revision),
                    turn: json!({"id": text, "role": "assistant", "revision": revision,
                                 "blocks": [{"id": "b0", "kind": "text", "text": text}]}),
                    facts: facts
                        .then(|| json!({"stop_reason": "end_turn", "usage": {"output_tokens": tokens}})),
                }
            ),
            (any::<u64>(), any::<Option<u64>>(), any::<Option<u64>>()).prop_map(
                |(generation, input_tokens, cache_read_input_tokens)| DriveEvent::Usage {
                    generation: Generation(generation),
                    usage: Usage {
                        input_tokens,
                        output_tokens: None,
                        cache_creation_input_tokens: None,
                        cache_read_input_tokens,
                    },
                }
            ),
            (
                text(),
                prop::sample::select(vec!["the provider failed", "a \"quoted\"\n message"])
            )
                .prop_map(|(code, message)| DriveEvent::Error {
                    code,
                    message: message.into()
                }),
        ]
    }

    proptest! {
        /// Issue 21: the non-streamed answer written straight into bytes is the answer the
        /// `Value` of it wrote, for any events (every kind, any text: quotes, control
        /// characters, non-ASCII), any operation id and state.
        #[test]
        fn the_whole_answer_is_byte_for_byte_its_value(
            events in prop::collection::vec(any_event(), 0..12),
            operation_id in any_text(),
            state in any_text(),
        ) {
            let events: Vec<Arc<DriveEvent>> = events.into_iter().map(Arc::new).collect();
            let written = super::whole_answer(&operation_id, &state, &events, 0);
            let through_value = answer_through_value(&operation_id, &state, &events);
            prop_assert_eq!(String::from_utf8(written).unwrap(), String::from_utf8(through_value).unwrap());
            for event in &events {
                let (name, data) = super::client_event_json(event);
                prop_assert_eq!(super::sse_event_frame(7, event), super::sse_frame(7, name, &data));
            }
        }
    }

    fn spec_text() -> String {
        let shared = std::env::var_os("TURNSTILE_SHARED")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
        let path = shared.join("spec/gateway-api.md");
        // The spec is the contract: without it this test fails rather than passing unchecked.
        std::fs::read_to_string(&path)
            .unwrap_or_else(|error| panic!("{}: {error} (set TURNSTILE_SHARED)", path.display()))
    }

    #[test]
    fn native_client_events_are_written_as_the_spec_names_them() {
        use super::{client_event_json, sse_frame};
        use serde_json::json;
        use turnstile_core::dispatch::DispatchState;
        use turnstile_core::{Generation, Revision};
        use turnstile_drive::DriveEvent;
        let check = |event: DriveEvent, expected: &str| {
            let (name, data) = client_event_json(&event);
            assert_eq!(String::from_utf8_lossy(&sse_frame(5, name, &data)), expected);
        };
        check(
            DriveEvent::State {
                state: DispatchState::Streaming,
                generation: Some(Generation(3)),
            },
            "id: 5\nevent: state\ndata: {\"generation\":3,\"state\":\"STREAMING\"}\n\n",
        );
        check(
            DriveEvent::State {
                state: DispatchState::Prepared,
                generation: None,
            },
            "id: 5\nevent: state\ndata: {\"generation\":null,\"state\":\"PREPARED\"}\n\n",
        );
        check(
            DriveEvent::Preview {
                generation: Generation(3),
                block_index: 1,
                delta: "Hi \"you\"".into(),
            },
            "id: 5\nevent: preview\ndata: {\"block_index\":1,\"delta\":\"Hi \\\"you\\\"\",\"generation\":3}\n\n",
        );
        check(
            DriveEvent::Retract {
                generation: Generation(3),
                reason: "stream_broken".into(),
            },
            "id: 5\nevent: retract\ndata: {\"generation\":3,\"reason\":\"stream_broken\"}\n\n",
        );
        // The commit offer's facts sit beside the revision and the turn.
        check(
            DriveEvent::Committed {
                revision: Revision(5),
                turn: json!({"id": "t", "revision": 5}),
                facts: Some(json!({"stop_reason": "end_turn", "usage": {"input_tokens": 1}})),
            },
            "id: 5\nevent: committed\ndata: {\"revision\":5,\"stop_reason\":\"end_turn\",\"turn\":{\"id\":\"t\",\"revision\":5},\"usage\":{\"input_tokens\":1}}\n\n",
        );
        check(
            DriveEvent::Committed {
                revision: Revision(5),
                turn: json!({"id": "t"}),
                facts: None,
            },
            "id: 5\nevent: committed\ndata: {\"revision\":5,\"turn\":{\"id\":\"t\"}}\n\n",
        );
        check(
            DriveEvent::Error {
                code: "begin_refused".into(),
                message: "no".into(),
            },
            "id: 5\nevent: error\ndata: {\"code\":\"begin_refused\",\"message\":\"no\"}\n\n",
        );
        // Not a native stream event (`sse_response` leaves it out), but listed by the
        // non-streaming answer.
        check(
            DriveEvent::Usage {
                generation: Generation(3),
                usage: turnstile_core::assemble::Usage {
                    input_tokens: Some(7),
                    ..Default::default()
                },
            },
            "id: 5\nevent: usage\ndata: {\"generation\":3,\"usage\":{\"input_tokens\":7,\"output_tokens\":null}}\n\n",
        );
    }

    #[test]
    fn error_codes_are_distinct_snake_case_strings() {
        let mut seen = HashSet::new();
        for code in ErrorCode::ALL {
            let text = code.as_str();
            assert!(seen.insert(text), "{text} twice");
            assert!(
                !text.is_empty() && text.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{text}"
            );
        }
    }

    #[test]
    fn every_error_code_the_spec_names_is_one_of_ours() {
        // The spec names codes as "<status> `code`" (409 `revision_conflict`, 422
        // `invalid_request`, 409 `stale_claim`, …).
        let spec = spec_text();
        let ours: HashSet<&str> = ErrorCode::ALL.iter().map(|code| code.as_str()).collect();
        let mut named = Vec::new();
        for (at, _) in spec.match_indices('`') {
            // "<status>" then spaces or a line break, then the code in backticks.
            let before = spec[..at].trim_end_matches([' ', '\n']);
            if before.len() == spec[..at].len() || before.len() < 4 {
                continue;
            }
            let (head, status) = before.split_at(before.len() - 3);
            let digits = status.bytes().all(|b| b.is_ascii_digit());
            if !digits || !head.ends_with([' ', '\n', '(']) {
                continue;
            }
            let rest = &spec[at + 1..];
            let Some(end) = rest.find('`') else { continue };
            named.push((status.to_owned(), rest[..end].to_owned()));
        }
        assert!(named.len() >= 3, "the spec names codes: {named:?}");
        for (status, code) in &named {
            assert!(
                ours.contains(code.as_str()),
                "the spec's {status} `{code}` is not an ErrorCode"
            );
        }
        for must in ["revision_conflict", "invalid_request", "stale_claim"] {
            assert!(
                named.iter().any(|(_, code)| code == must),
                "{must} no longer in the spec?"
            );
        }
    }
}
