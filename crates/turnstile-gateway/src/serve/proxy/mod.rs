//! Drop-in proxy mode: provider-compatible endpoints, so an application adopts Turnstile by
//! pointing its SDK's base URL at the gateway.
//!
//! `POST /v1/chat/completions`, `POST /v1/responses`, `POST /v1/messages` and
//! `POST /v1beta/models/{model}:generateContent|streamGenerateContent` (and the same under
//! `/v1/models/…`, google-genai's default API version), all mounted by [`router`], which also
//! answers every wrong method and unknown path under these prefixes in the client API's own
//! error shape. Each request is:
//!
//! 1. authenticated with the SDK's own header (`Authorization: Bearer`, `x-api-key`,
//!    `x-goog-api-key` or `?key=`; with tenants configured it must be a tenant token);
//! 2. routed by (endpoint API, model) to a [`RouteSpec`] from the config's `[[routes]]`, or
//!    with none configured to the simulator with the endpoint's own API (mode `on`);
//! 3. in mode `on` (and `on-no-tools` for a request without tools): imported into a v1 graph
//!    (`turnstile_adapters::import`), validated (an illegal sequence gets the provider-style 400
//!    with our violation codes and is never sent), stored as a new conversation in one
//!    transaction, rendered with the route's adapter — which may speak another API than the
//!    client — dispatched through the same ledger and driver as `/v1/conversations/{id}/dispatch`,
//!    and answered in the client's wire format (`respond`): text streams as it arrives, tool
//!    calls only from the committed turn;
//! 4. in mode `shadow` (and `on-no-tools` for a request with tools): forwarded untouched
//!    (`shadow`), with our rendering compared beside it.
//!
//! Stateless clients resend the whole history every time, so every request is its own
//! conversation (`proxy-<id>`). An `Idempotency-Key` header names it instead: a retry with the
//! same key and the same history attaches to the first dispatch and never sends twice; the
//! same key with another history is 409. Committed tool calls are claimed for the client
//! (holder `proxy-client`) at once: the client runs them and sends the results in its next
//! request, which is a new conversation.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - Gemini is served under `/v1/models/…` and `/v1beta/models/…`; every wrong method and unknown
//!   path under a provider prefix is answered in the client API's error shape. Enforced in
//!   `proxy/mod.rs::router`, `client_api`. Tests:
//!   `gateway/tests/it/proxy.rs::gemini_is_served_under_v1_as_well_as_v1beta…`,
//!   `proxy_sdk.py::gemini_default_api_version`.
//!
//! The path of one request in mode `on`: `admit` (import → structure → validate; an illegal history
//! is refused here, before anything is stored) → `place` (a continuation of a committed
//! conversation, or a fresh one imported in the prepare's own write) → `targets_of` →
//! `prepare_dispatch` (`api::render_targets`, no I/O, then `api::store_rendered`) → the dispatch's
//! hub, read by one `Follower` per request, which pumps the `answer.rs` machines and hands the
//! committed calls to the client. The simulation calls the same functions.

pub mod answer;
pub mod continuation;
pub mod previous;
pub mod refusals;
pub mod respond;
pub mod shadow;

use super::api::{self, ApiError, Early, Started, Target, caller_with_token, hub_for};
use super::config::{Mode, Route};
use super::hub::{ClientEvent, Next, Receiver};
use super::{Shared, metrics, now};
use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use respond::{Addressee, Answerer, Part, parts_of};
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use std::convert::Infallible;
use std::sync::Arc;
use turnstile_adapters::AdapterId;
use turnstile_adapters::Api;
use turnstile_adapters::import::{GeminiCall, ImportError, Imported, import_value, parse_body};
use turnstile_core::dispatch::DispatchState;
use turnstile_core::dispatch::Timestamp;
use turnstile_core::{Conversation, Verdict, Violation, validate};
use turnstile_drive::DriveEvent;
use turnstile_store::{ImportOutcome, Ledger};

/// Holder recorded on tool calls handed to a proxy client (state `client`).
pub const PROXY_CLIENT_HOLDER: &str = "proxy-client";
/// Most records `GET /v1/shadow/diffs` answers.
const SHADOW_DIFFS_LIMIT_MAX: usize = 1000;

/// A resolved route.
#[derive(Clone, Debug)]
pub struct RouteSpec {
    /// Rollout mode.
    pub mode: Mode,
    /// `on`, `on-no-tools` or `shadow`, for labels.
    pub mode_label: &'static str,
    /// Provider of our request.
    pub provider: String,
    /// Our adapter.
    pub adapter: AdapterId,
    /// Our model (None: the client's).
    pub target_model: Option<String>,
    /// Where the original bytes go.
    pub original_provider: String,
    /// Failover targets, in order.
    pub fallbacks: Vec<super::config::Fallback>,
    /// How a streamed client request is answered.
    pub answer: super::config::AnswerMode,
    /// Repair an illegal request history before dispatch (off unless the route says so).
    pub repair_history: bool,
    /// The route as configured, `<api>/<model>`, for the metrics' `route` label.
    pub label: String,
}

fn mode_label(mode: Mode) -> &'static str {
    match mode {
        Mode::On => "on",
        Mode::OnNoTools => "on-no-tools",
        Mode::Shadow => "shadow",
    }
}

/// The `api` metric label.
pub fn api_label(api: Api) -> &'static str {
    api.as_str()
}

/// The newest adapter version of an API: the embedded default's choice.
fn newest_adapter(api: Api) -> AdapterId {
    AdapterId::ALL
        .into_iter()
        .filter(|adapter| adapter.api() == api)
        .max_by_key(|adapter| adapter.version())
        .unwrap_or(AdapterId::OpenaiChatV1)
}

/// First matching route; with no routes configured, the simulator with the endpoint's API when
/// there is one (`sim`: the embedded default or `sim_url`), else none.
fn route_for(routes: &[Route], simulator: bool, api: Api, model: &str) -> Option<RouteSpec> {
    if routes.is_empty() {
        if !simulator {
            return None;
        }
        return Some(RouteSpec {
            mode: Mode::On,
            mode_label: "on",
            provider: "sim".into(),
            adapter: newest_adapter(api),
            target_model: None,
            original_provider: "sim".into(),
            fallbacks: Vec::new(),
            answer: super::config::AnswerMode::Stream,
            repair_history: false,
            label: format!("{}/*", api.as_str()),
        });
    }
    let route = routes.iter().find(|route| route.matches(api.as_str(), model))?;
    Some(RouteSpec {
        mode: route.mode,
        mode_label: mode_label(route.mode),
        provider: route.provider.clone(),
        // Invariant: `Config::check` parsed every route's adapter at start-up.
        adapter: route.adapter.parse().ok()?,
        target_model: route.target_model.clone(),
        original_provider: route
            .original_provider
            .clone()
            .unwrap_or_else(|| route.provider.clone()),
        fallbacks: route.fallbacks.clone(),
        answer: route.answer,
        repair_history: route.repair_history,
        label: format!("{}/{}", route.api, route.model),
    })
}

/// A provider-style error response.
pub fn provider_error(api: Api, status: StatusCode, code: &str, message: &str, extra: &Value) -> Response {
    (
        status,
        Json(respond::error_body(api, status.as_u16(), code, message, extra)),
    )
        .into_response()
}

fn from_api_error(api: Api, error: ApiError) -> Response {
    // Provider APIs answer every problem with the request itself with 400, where our own API
    // says 422 (unprocessable: unsupported setting, over budget, unknown adapter, …).
    let status = match error.status() {
        StatusCode::UNPROCESSABLE_ENTITY => StatusCode::BAD_REQUEST,
        status => status,
    };
    provider_error(api, status, error.code(), error.message(), error.extra())
}

/// The key the client's SDK authenticates with, wherever its API puts it.
fn client_token<'a>(headers: &'a HeaderMap, query: &'a str) -> Option<&'a str> {
    let header_value = |name: &str| headers.get(name).and_then(|value| value.to_str().ok());
    header_value(header::AUTHORIZATION.as_str())
        .and_then(|value| value.strip_prefix("Bearer "))
        .or_else(|| header_value("x-api-key"))
        .or_else(|| header_value("x-goog-api-key"))
        .or_else(|| query.split('&').find_map(|pair| pair.strip_prefix("key=")))
}

/// The few top-level fields routing needs before the import (serde skips the rest).
#[derive(Default, Deserialize)]
struct Peek {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    previous_response_id: Option<String>,
}

#[derive(Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// The proxy's routes (merged into the gateway's router): the four provider endpoints, with a
/// wrong method answered 405 and an unknown path under a provider prefix answered 404, each in
/// the error shape of the client API the request speaks ([`client_api`]).
pub fn router() -> axum::Router<Arc<Shared>> {
    use axum::routing::{any, post};
    axum::Router::new()
        .route(
            "/v1/chat/completions",
            post(chat_completions).fallback(wrong_method),
        )
        .route("/v1/responses", post(responses).fallback(wrong_method))
        .route("/v1/messages", post(messages).fallback(wrong_method))
        .route("/v1beta/models/{target}", post(gemini).fallback(wrong_method))
        // google-genai 3 defaults to API version `v1`; the request format is the same.
        .route("/v1/models/{target}", post(gemini).fallback(wrong_method))
        .route("/v1beta/{*rest}", any(unknown_path))
        .route("/v1/messages/{*rest}", any(unknown_path))
        .route("/v1/chat/{*rest}", any(unknown_path))
        .route("/v1/responses/{*rest}", any(unknown_path))
        .route("/v1/models", any(unknown_path))
}

/// Which provider API a request speaks, from its path and its SDK's headers: Gemini for
/// `/v1beta/…` or Google's key (`x-goog-api-key`, `?key=`), Anthropic for `anthropic-version`
/// or `x-api-key`, OpenAI for `/v1/chat/…`, `/v1/responses…` or a bearer token on `/v1/models`.
/// None: not a provider request (the native API's shape applies).
pub fn client_api(headers: &HeaderMap, path: &str, query: &str) -> Option<Api> {
    let has = |name: &str| headers.contains_key(name);
    // Gemini's methods are `models/{model}:{method}` under `/v1beta` and `/v1` alike;
    // OpenAI's `/v1/models/{id}` has no colon method.
    let gemini_method =
        path.starts_with("/v1/models/") && path.rsplit('/').next().is_some_and(|last| last.contains(':'));
    if path.starts_with("/v1beta/")
        || gemini_method
        || has("x-goog-api-key")
        || query.split('&').any(|pair| pair.starts_with("key="))
    {
        return Some(Api::Gemini);
    }
    if has("anthropic-version") || has("x-api-key") || path.starts_with("/v1/messages") {
        return Some(Api::AnthropicMessages);
    }
    if path.starts_with("/v1/responses") {
        return Some(Api::OpenaiResponses);
    }
    if path.starts_with("/v1/chat/") || path == "/v1/chat" || path.starts_with("/v1/models") {
        return Some(Api::OpenaiChat);
    }
    None
}

fn shaped_error(request: &Request, status: StatusCode, code: &'static str, message: &str) -> Response {
    let uri = request.uri();
    match client_api(request.headers(), uri.path(), uri.query().unwrap_or("")) {
        Some(api) => provider_error(api, status, code, message, &Value::Null),
        None => api::ApiError::new(
            status,
            api::ErrorCode::parse(code).unwrap_or(api::ErrorCode::NotFound),
            message.to_owned(),
        )
        .into_response(),
    }
}

/// A provider endpoint asked with another method than POST.
async fn wrong_method(request: Request) -> Response {
    shaped_error(
        &request,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this endpoint takes POST",
    )
}

/// A path under a provider prefix that the proxy does not serve.
async fn unknown_path(request: Request) -> Response {
    shaped_error(
        &request,
        StatusCode::NOT_FOUND,
        "not_found",
        "the proxy does not serve this path",
    )
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    handle(shared, Api::OpenaiChat, None, request).await
}

/// `POST /v1/responses`.
pub async fn responses(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    handle(shared, Api::OpenaiResponses, None, request).await
}

/// `POST /v1/messages`.
pub async fn messages(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    handle(shared, Api::AnthropicMessages, None, request).await
}

/// `POST /v1beta/models/{model}:generateContent` and `…:streamGenerateContent` (also under
/// `/v1/models/`).
pub async fn gemini(
    State(shared): State<Arc<Shared>>,
    Path(target): Path<String>,
    request: Request,
) -> Response {
    let Some((model, method)) = target.rsplit_once(':') else {
        return provider_error(
            Api::Gemini,
            StatusCode::NOT_FOUND,
            "not_found",
            "expected {model}:generateContent",
            &Value::Null,
        );
    };
    let stream = match method {
        "streamGenerateContent" => true,
        "generateContent" => false,
        _ => {
            return provider_error(
                Api::Gemini,
                StatusCode::NOT_FOUND,
                "not_found",
                "unknown method",
                &Value::Null,
            );
        }
    };
    let call = GeminiCall {
        model: model.to_owned(),
        stream,
    };
    handle(shared, Api::Gemini, Some(call), request).await
}

#[derive(Deserialize)]
pub struct DiffsQuery {
    #[serde(default)]
    limit: Option<usize>,
}

/// `GET /v1/shadow/diffs?limit=N`: the caller's newest shadow records, newest first.
pub async fn shadow_diffs(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(query): Query<DiffsQuery>,
) -> Response {
    let caller = match api::caller(&shared, &headers) {
        Ok(caller) => caller,
        Err(error) => return error.into_response(),
    };
    let limit = query.limit.unwrap_or(100).min(SHADOW_DIFFS_LIMIT_MAX);
    let diffs = shared.shadow.newest(&caller.store_id(""), limit);
    Json(json!({"diffs": diffs})).into_response()
}

async fn handle(shared: Arc<Shared>, api: Api, gemini: Option<GeminiCall>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let query = parts.uri.query().unwrap_or("").to_owned();
    let caller = match caller_with_token(&shared, client_token(&parts.headers, &query)) {
        Ok(caller) => caller,
        Err(error) => return from_api_error(api, error),
    };
    let bytes = match axum::body::to_bytes(body, shared.body_bytes_max).await {
        Ok(bytes) => bytes,
        Err(error) => {
            let (status, code, message) = super::api::body_unread(&error, shared.body_bytes_max);
            return provider_error(api, status, code.as_str(), &message, &Value::Null);
        }
    };
    // The body is parsed once: routing peeks at the parsed value, the importer takes it.
    let body = parse_body(&bytes);
    let peek: Peek = match (&gemini, &body) {
        (Some(_), _) => Peek::default(),
        (None, Ok(value)) => Peek::deserialize(value).unwrap_or_default(),
        // Past the importer's limits (or not JSON): routing still reads what it can, so a
        // shadow route forwards it untouched as before.
        (None, Err(_)) => serde_json::from_slice(&bytes).unwrap_or_default(),
    };
    let model = match &gemini {
        Some(call) => call.model.clone(),
        None => peek.model.clone().unwrap_or_default(),
    };
    let simulator = shared.endpoints.contains_key("sim");
    let Some(route) = route_for(&shared.routes, simulator, api, &model) else {
        return provider_error(
            api,
            StatusCode::NOT_FOUND,
            "model_not_found",
            &format!("no route for model {model:?} on {}", api.as_str()),
            &Value::Null,
        );
    };
    let idempotency_key = parts
        .headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let local_id = match &idempotency_key {
        Some(key) => {
            let digest = Sha256::digest(format!("{}\n{key}", api.as_str()).as_bytes());
            format!("proxy-k-{}", &hex::encode(digest)[..40])
        }
        None => format!("proxy-{}", super::fresh_id()),
    };
    let conversation_id = caller.store_id(&local_id);
    // A Responses request continuing one of *our* responses is always ours (the provider has
    // never seen that id); any other previous_response_id follows the route's mode.
    let continued = match peek
        .previous_response_id
        .as_deref()
        .filter(|_| api == Api::OpenaiResponses)
    {
        Some(previous) => match previous::conversation_of(previous) {
            Some(local) => match stored_response(&shared, &caller.store_id(local)).await {
                Ok(document) => Some(document),
                Err(response) => return response,
            },
            None => None,
        },
        None => None,
    };
    let imported = body.and_then(|value| match &continued {
        None => import_value(api, value, &conversation_id, gemini.clone()),
        Some(stored) => import_continuation(value, &conversation_id, stored),
    });
    let ours = match route.mode {
        _ if continued.is_some() => true,
        Mode::On => true,
        Mode::Shadow => false,
        Mode::OnNoTools => matches!(&imported, Ok(imported) if !imported.has_tools),
    };
    if !ours {
        let path_and_query = original_path(api, gemini.as_ref(), &query);
        return shadow::forward(
            shared.clone(),
            caller.store_id(""),
            api,
            route.clone(),
            path_and_query,
            parts.headers,
            bytes,
            imported,
            route.mode_label,
        )
        .await;
    }
    let include_usage = peek
        .stream_options
        .and_then(|options| options.include_usage)
        .unwrap_or(false);
    match serve_ours(
        &shared,
        api,
        &route,
        imported,
        conversation_id,
        &caller.store_id("proxy-"),
        idempotency_key.is_some(),
        include_usage,
    )
    .await
    {
        Ok(response) => {
            metrics::proxy_request(api_label(api), route.mode_label, "ours");
            response
        }
        Err(response) => {
            metrics::proxy_request(api_label(api), route.mode_label, "refused");
            response
        }
    }
}

/// The stored history of a committed proxy response (`previous_response_id`), or the
/// provider-style error the client gets instead.
async fn stored_response(shared: &Arc<Shared>, store_id: &str) -> Result<Value, Response> {
    let api = Api::OpenaiResponses;
    let record = shared
        .ledger
        .dispatch(store_id)
        .await
        .map_err(|error| from_api_error(api, ApiError::store(error)))?;
    let Some(record) = record else {
        return Err(provider_error(
            api,
            StatusCode::NOT_FOUND,
            "previous_response_not_found",
            "no response with that id was committed here",
            &Value::Null,
        ));
    };
    if record.state != turnstile_core::dispatch::DispatchState::Committed {
        return Err(provider_error(
            api,
            StatusCode::CONFLICT,
            "previous_response_not_committed",
            &format!(
                "that response is {} and cannot be continued yet",
                record.state.as_str()
            ),
            &Value::Null,
        ));
    }
    let mut document = shared
        .ledger
        .conversation(&record.conversation_id)
        .await
        .map_err(|error| from_api_error(api, ApiError::store(error)))?
        .ok_or_else(|| {
            provider_error(
                api,
                StatusCode::NOT_FOUND,
                "previous_response_not_found",
                "the response's conversation is gone",
                &Value::Null,
            )
        })?;
    // The conversation may have moved on since (a stateless continuation appended to it): the
    // response is the history up to its own committed turn.
    let committed = record
        .committed_revision
        .map_or(0, |revision| revision.0 as usize);
    if let Some(turns) = document["turns"].as_array_mut() {
        turns.truncate(committed);
    }
    document["revision"] = json!(committed);
    Ok(document)
}

/// Import a Responses request that continues a stored response: its own input imported
/// without `previous_response_id`, spliced after the stored history.
fn import_continuation(
    mut value: Value,
    conversation_id: &str,
    stored: &Value,
) -> Result<Imported, ImportError> {
    if let Some(object) = value.as_object_mut() {
        object.remove("previous_response_id");
    }
    let mut imported = import_value(Api::OpenaiResponses, value, conversation_id, None)?;
    imported.document =
        previous::splice(stored, &imported.document).map_err(|error| ImportError::Unrepresentable {
            path: "previous_response_id".into(),
            what: format!("the stored response cannot be continued: {error:?}"),
        })?;
    Ok(imported)
}

/// The original request's path for the provider (Gemini's `key` query parameter dropped: the
/// provider's key is the gateway's own).
fn original_path(api: Api, gemini: Option<&GeminiCall>, query: &str) -> String {
    let query: Vec<&str> = query
        .split('&')
        .filter(|pair| !pair.is_empty() && !pair.starts_with("key="))
        .collect();
    let path = match (api, gemini) {
        (Api::Gemini, Some(call)) => {
            let method = if call.stream {
                "streamGenerateContent"
            } else {
                "generateContent"
            };
            let model_path = Api::Gemini.request_path(&call.model, false);
            // `request_path` encodes the model; swap the method it chose.
            model_path.replace(":generateContent", &format!(":{method}"))
        }
        _ => api.request_path("", false),
    };
    if query.is_empty() {
        path
    } else {
        format!("{path}?{}", query.join("&"))
    }
}

/// Why a proxied request is not admitted: nothing is stored or sent.
pub enum NotAdmitted {
    /// The body is not a request the importer can carry (the field is named).
    NotImportable(ImportError),
    /// The imported document is not a conversation.
    Unreadable(String),
    /// The last assistant turn has calls without results.
    Waiting(Box<Imported>, Vec<String>),
    /// The sequence is illegal.
    Rejected(Box<Imported>, Vec<Violation>),
}

/// Import → structure → validate (steps 3 of the module doc, before anything is stored): the
/// request as a ready conversation, or why not.
pub fn admit(imported: Result<Imported, ImportError>) -> Result<(Imported, Conversation), NotAdmitted> {
    let imported = imported.map_err(NotAdmitted::NotImportable)?;
    let conversation = Conversation::from_value(imported.document.clone())
        .map_err(|error| NotAdmitted::Unreadable(error.to_string()))?;
    match validate(&conversation) {
        Verdict::Ready => Ok((imported, conversation)),
        Verdict::Waiting { pending } => {
            let pending = pending.into_iter().map(|call| call.0).collect();
            Err(NotAdmitted::Waiting(Box::new(imported), pending))
        }
        Verdict::Rejected(violations) => Err(NotAdmitted::Rejected(Box::new(imported), violations)),
    }
}

/// A request that was not admitted: recorded for the console, answered in the client's shape.
fn refuse(
    shared: &Shared,
    tenant_prefix: &str,
    api: Api,
    not: NotAdmitted,
    repair: Option<&turnstile_core::repair::RepairPlan>,
) -> Response {
    match not {
        NotAdmitted::NotImportable(error) => {
            shared.refusals.record(refusals::Refused {
                tenant_prefix,
                api,
                model: "",
                refusal: refusals::Refusal::NotImportable {
                    code: error.code(),
                    path: &error.path(),
                },
                document: None,
                repair,
            });
            let mut extra = json!({"path": error.path()});
            if let ImportError::ThreadUnsupported { .. } = error {
                // Where Anthropic's own refusal puts it, for the SDK to fall back to the whole
                // history.
                extra["details"] = json!({"error_code": error.code(), "unsupported": [error.path()]});
            }
            provider_error(
                api,
                StatusCode::BAD_REQUEST,
                error.code(),
                &error.to_string(),
                &extra,
            )
        }
        NotAdmitted::Unreadable(error) => provider_error(
            api,
            StatusCode::BAD_REQUEST,
            "invalid_structure",
            &error,
            &Value::Null,
        ),
        NotAdmitted::Waiting(imported, pending) => {
            shared.refusals.record(refusals::Refused {
                tenant_prefix,
                api,
                model: &imported.model,
                refusal: refusals::Refusal::Waiting(&pending),
                document: Some(&imported.document),
                repair,
            });
            provider_error(
                api,
                StatusCode::BAD_REQUEST,
                "tool_results_pending",
                "the last assistant turn has tool calls without results; nothing was sent",
                &json!({"pending": pending}),
            )
        }
        NotAdmitted::Rejected(imported, violations) => {
            metrics::rejected(&violations);
            shared.refusals.record(refusals::Refused {
                tenant_prefix,
                api,
                model: &imported.model,
                refusal: refusals::Refusal::Rejected(&violations),
                document: Some(&imported.document),
                repair,
            });
            let codes: Vec<&str> = violations
                .iter()
                .map(|violation| violation.code.as_str())
                .collect();
            provider_error(
                api,
                StatusCode::BAD_REQUEST,
                "illegal_sequence",
                &format!(
                    "the conversation is not a legal request ({}); nothing was sent",
                    codes.join(", ")
                ),
                &json!({"violations": api::violations_json(&violations)}),
            )
        }
    }
}

/// Where an admitted request's dispatch goes.
pub struct Placed {
    /// The conversation it continues or was stored as.
    pub conversation_id: String,
    /// Its dispatch's operation id.
    pub operation_id: String,
    /// The history the dispatch renders.
    pub conversation: Conversation,
    /// A fresh conversation not stored yet: it is imported in the transaction that prepares
    /// its dispatch (`api::store_rendered_importing`), so the request makes two durable writes,
    /// not three, and a request refused while rendering stores nothing.
    pub import: Option<api::NewConversation>,
}

/// Store an admitted request: a stateless request that continues a conversation committed here
/// appends to it (an Idempotency-Key names its own conversation and keeps the retry semantics,
/// and is imported here); anything else is a new conversation `conversation_id`, to import
/// with its dispatch's prepare (`Placed::import`). `now` stamps what is written.
#[allow(clippy::too_many_arguments)]
pub async fn place(
    ledger: &dyn Ledger,
    api: Api,
    proxy_prefix: &str,
    conversation_id: String,
    imported: &Imported,
    conversation: Conversation,
    keyed: bool,
    now: Timestamp,
) -> Result<Placed, Response> {
    let continued = if keyed {
        None
    } else {
        continuation::find_and_append(ledger, proxy_prefix, &imported.document, now).await
    };
    if let Some(continued) = continued {
        // This request's cache breakpoints, not the ones stored with earlier requests.
        let document = continuation::with_request_marks(continued.document, &imported.document);
        let conversation = Conversation::from_value(document).map_err(|error| {
            provider_error(
                api,
                StatusCode::INTERNAL_SERVER_ERROR,
                "stored_history_unreadable",
                &error.to_string(),
                &Value::Null,
            )
        })?;
        let operation_id = continued_operation_id(&continued.conversation_id, conversation.revision);
        return Ok(Placed {
            conversation_id: continued.conversation_id,
            operation_id,
            conversation,
            import: None,
        });
    }
    let turns: Vec<Value> = imported.document["turns"].as_array().cloned().unwrap_or_default();
    let tools = imported.document["tools"].clone();
    if !keyed {
        return Ok(Placed {
            operation_id: conversation_id.clone(),
            import: Some(api::NewConversation {
                conversation_id: conversation_id.clone(),
                tools,
                turns,
            }),
            conversation_id,
            conversation,
        });
    }
    let stored = ledger
        .import_conversation(&conversation_id, &tools, &turns, now)
        .await
        .map_err(|error| from_api_error(api, ApiError::store(error)))?;
    match stored {
        ImportOutcome::Created { .. } => {}
        ImportOutcome::AlreadyExists { .. } => {
            // A retry under the same key: the same history attaches, another one conflicts.
            let document = ledger
                .conversation(&conversation_id)
                .await
                .map_err(|error| from_api_error(api, ApiError::store(error)))?
                .unwrap_or(Value::Null);
            if !same_prefix(&document["turns"], &turns) || document["tools"] != tools {
                return Err(provider_error(
                    api,
                    StatusCode::CONFLICT,
                    "idempotency_conflict",
                    "this Idempotency-Key was used for another request",
                    &Value::Null,
                ));
            }
        }
        refused @ ImportOutcome::Rejected(_) => return Err(import_refused(api, refused)),
    }
    // A keyed request never continues: the conversation its client leaves is abandoned here.
    continuation::abandon_left_behind(ledger, proxy_prefix, &imported.document).await;
    let operation_id = keyed_operation(ledger, &conversation_id)
        .await
        .map_err(|error| from_api_error(api, ApiError::store(error)))?;
    Ok(Placed {
        conversation_id,
        operation_id,
        conversation,
        import: None,
    })
}

/// The answer to a fresh request whose import the store refused (nothing was written).
pub fn import_refused(api: Api, refused: ImportOutcome) -> Response {
    match refused {
        ImportOutcome::Rejected(violations) => provider_error(
            api,
            StatusCode::BAD_REQUEST,
            "illegal_sequence",
            "the conversation is not a legal request; nothing was sent",
            &json!({"violations": api::violations_json(&violations)}),
        ),
        ImportOutcome::AlreadyExists { .. } | ImportOutcome::Created { .. } => provider_error(
            api,
            StatusCode::CONFLICT,
            "conversation_exists",
            "a fresh proxy conversation id was taken",
            &Value::Null,
        ),
    }
}

/// The operation id of a dispatch that continues `conversation_id` at `revision`.
pub fn continued_operation_id(conversation_id: &str, revision: turnstile_core::Revision) -> String {
    format!("{conversation_id}.r{}", revision.0)
}

/// The route's target, then its fallbacks (each its own adapter and model), in order; `model`
/// is the client's.
pub fn targets_of(route: &RouteSpec, model: &str) -> Vec<Target> {
    let model = route.target_model.clone().unwrap_or_else(|| model.to_owned());
    let mut targets = vec![Target {
        provider: route.provider.clone(),
        model: model.clone(),
        adapter: route.adapter.as_str().to_owned(),
    }];
    targets.extend(route.fallbacks.iter().map(|fallback| Target {
        provider: fallback.provider.clone(),
        model: fallback.target_model.clone().unwrap_or_else(|| model.clone()),
        adapter: fallback.adapter.clone(),
    }));
    targets
}

/// The request's settings besides its history, as the render takes them.
pub fn settings_of(imported: &Imported) -> turnstile_adapters::prepare::Settings {
    turnstile_adapters::prepare::Settings {
        sampling: imported.sampling.clone(),
        tool_choice: imported.tool_choice.clone(),
        output_format: imported.output_format.clone(),
        passthrough: imported.passthrough.clone(),
        repair: None,
    }
}

/// Mode `on`: import → validate → store → prepare → dispatch → answer.
#[allow(clippy::too_many_arguments)]
async fn serve_ours(
    shared: &Arc<Shared>,
    api: Api,
    route: &RouteSpec,
    imported: Result<Imported, ImportError>,
    conversation_id: String,
    proxy_prefix: &str,
    keyed: bool,
    include_usage: bool,
) -> Result<Response, Response> {
    let tenant_prefix = proxy_prefix.strip_suffix("proxy-").unwrap_or("");
    // Off unless the route asks: a repaired history, with the plan that made it.
    let (imported, repair) = match route.repair_history {
        true => super::repair::repair_imported(imported),
        false => (imported, None),
    };
    let (imported, conversation) =
        admit(imported).map_err(|not| refuse(shared, tenant_prefix, api, not, repair.as_ref()))?;
    // Admitted: a plan that was applied (one that was not would have been refused above).
    let repair = repair.filter(turnstile_core::repair::RepairPlan::is_complete);
    let Placed {
        conversation_id,
        operation_id,
        conversation,
        import,
    } = place(
        shared.ledger.as_ref(),
        api,
        proxy_prefix,
        conversation_id,
        &imported,
        conversation,
        keyed,
        now(),
    )
    .await?;
    let client_model = imported.model.clone();
    let targets = targets_of(route, &imported.model);
    // Once per dispatch, whatever the number of targets: `admit` checked the request, but a
    // continuation renders the stored history with the request's turns appended.
    // (`admit` said ready and the store checked every append: a failure here is ours.)
    let validated = turnstile_core::Validated::new(&conversation).map_err(|_| {
        from_api_error(
            api,
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                api::ErrorCode::Internal,
                "validation changed",
            ),
        )
    })?;
    let sequence = turnstile_core::MessageSequence::build(validated);
    let started = api::prepare_dispatch(
        shared,
        turnstile_adapters::Graph::new(validated, &sequence),
        operation_id.clone(),
        &targets,
        imported.max_output_tokens,
        turnstile_adapters::prepare::Settings {
            repair: repair.as_ref().and_then(|plan| serde_json::to_value(plan).ok()),
            ..settings_of(&imported)
        },
        import.as_ref(),
    )
    .await
    .map_err(|error| from_api_error(api, error))?;
    let (record, began) = match started {
        Started::Record(record, began) => (record, began),
        Started::NotImported(refused) => return Err(import_refused(api, refused)),
        Started::Early(Early::Paused(reason)) => {
            return Err(provider_error(
                api,
                StatusCode::BAD_REQUEST,
                "paused",
                &format!(
                    "{} cannot represent this conversation; it is paused, never degraded",
                    route.adapter.as_str()
                ),
                &json!({"reason": reason}),
            ));
        }
        Started::Early(_) => {
            return Err(provider_error(
                api,
                StatusCode::BAD_REQUEST,
                "not_ready",
                "the conversation is not ready",
                &Value::Null,
            ));
        }
    };
    let prompt_tokens = record.manifest["prompt_tokens"].as_u64().unwrap_or(0);
    let hub = hub_for(shared, record, began, Some(&conversation))
        .await
        .map_err(|error| from_api_error(api, error))?;
    let to = Addressee {
        api,
        id: client_response_id(api, &operation_id),
        model: client_model,
        created: now().0 / 1000,
        include_usage,
        served_by: targets
            .iter()
            .map(|target| Answerer {
                provider: target.provider.clone(),
                model: target.model.clone(),
            })
            .collect(),
    };
    let mut headers = vec![("x-turnstile-operation-id", local_part(&operation_id).to_owned())];
    if let Some(plan) = &repair {
        headers.push((super::repair::REPAIRED_HEADER, super::repair::header_value(plan)));
        metrics::history_repairs(plan, &route.label);
    }
    // What the graph does not carry, and the client-only identifiers left out towards another
    // API (`passthrough::INERT_ACROSS_APIS`).
    let mut dropped = imported.dropped.clone();
    dropped.extend(imported.passthrough.dropped_towards(route.adapter.api()));
    dropped.extend(turnstile_adapters::cache::dropped_towards(
        route.adapter.api(),
        &conversation,
    ));
    dropped.sort();
    dropped.dedup();
    if !dropped.is_empty() {
        headers.push(("x-turnstile-dropped", dropped.join(",")));
    }
    // One reader of the dispatch's events per request, in its own task: it answers the client
    // and hands the committed tool calls over, whether or not the client is still there.
    let follower = Follower {
        shared: shared.clone(),
        conversation_id: conversation_id.clone(),
        receiver: hub.subscribe(),
        committed: false,
        ended: false,
        gap: false,
    };
    let (reply, answer) = tokio::sync::oneshot::channel();
    let commit_first = route.answer == super::config::AnswerMode::Commit;
    tokio::spawn(follow(
        follower,
        to,
        prompt_tokens,
        imported.stream,
        commit_first,
        reply,
    ));
    // Invariant: `follow` replies before it returns; only a panic there drops the sender.
    let mut response = answer.await.unwrap_or_else(|_| {
        provider_error(
            api,
            StatusCode::INTERNAL_SERVER_ERROR,
            "no_commit",
            "the request's answer was lost",
            &Value::Null,
        )
    });
    for (name, value) in headers {
        if let Ok(value) = header::HeaderValue::from_str(&value) {
            response.headers_mut().insert(name, value);
        }
    }
    Ok(response)
}

/// Most retries under one Idempotency-Key after failed dispatches.
const KEYED_RETRIES_MAX: u32 = 100;

/// The dispatch a keyed request attaches to: the key's first dispatch, or — when that one (and
/// each retry after it) ended FAILED or ABANDONED without a commit — the next `<id>.k<n>`, so a
/// key is never poisoned by a provider's transient refusal.
async fn keyed_operation(
    ledger: &dyn Ledger,
    conversation_id: &str,
) -> Result<String, turnstile_store::StoreError> {
    let mut operation_id = conversation_id.to_owned();
    for retry in 1..=KEYED_RETRIES_MAX {
        match ledger.dispatch(&operation_id).await? {
            Some(record) if matches!(record.state, DispatchState::Failed | DispatchState::Abandoned) => {
                operation_id = format!("{conversation_id}.k{retry}");
            }
            _ => break,
        }
    }
    Ok(operation_id)
}

/// The id without the tenant prefix.
fn local_part(store_id: &str) -> &str {
    store_id.rsplit_once('~').map_or(store_id, |(_, local)| local)
}

fn client_response_id(api: Api, operation_id: &str) -> String {
    let local = local_part(operation_id);
    match api {
        Api::OpenaiChat => format!("chatcmpl-{local}"),
        Api::OpenaiResponses => format!("resp_{local}"),
        Api::AnthropicMessages => format!("msg_{local}"),
        Api::Gemini => local.to_owned(),
    }
}

/// Stored turns equal the request's (ignoring the stamped revisions).
fn same_prefix(stored: &Value, turns: &[Value]) -> bool {
    let strip = |turn: &Value| {
        let mut turn = turn.clone();
        if let Some(object) = turn.as_object_mut() {
            object.remove("revision");
        }
        turn
    };
    match stored.as_array() {
        Some(stored) => {
            stored.len() >= turns.len() && stored.iter().zip(turns).all(|(a, b)| strip(a) == strip(b))
        }
        None => false,
    }
}

/// The one reader of a proxied request's dispatch events
/// (`docs/decisions/0078-typed-hub-events-one-hub-reader-per-proxy-request.md`, 2026-12-01: one
/// subscription per proxy request). Reading the commit hands its tool calls to the client before
/// the commit is passed on, so the answer that shows a call never precedes its hand-over.
struct Follower {
    shared: Arc<Shared>,
    conversation_id: String,
    receiver: Receiver,
    /// The commit was read (and its calls handed over).
    committed: bool,
    /// The events ended (the hub finished).
    ended: bool,
    /// Previews were dropped before this reader read them, since [`Follower::gap`] was last
    /// asked.
    gap: bool,
}

impl Follower {
    /// The next event; `None` at the end. Dropped previews are skipped and noted
    /// ([`Follower::gap`]).
    async fn next(&mut self) -> Option<ClientEvent> {
        loop {
            if self.ended {
                return None;
            }
            match self.receiver.recv().await {
                Some(Next::Event(event)) => return Some(self.read(event).await),
                Some(Next::Gap { .. }) => {
                    metrics::bump(metrics::CLIENT_STREAM_GAPS);
                    self.gap = true;
                }
                None => self.ended = true,
            }
        }
    }

    /// Whether previews were dropped before the event [`Follower::next`] returned last (asked
    /// once: the answer then forwards no more preview, and the commit sends the rest).
    fn gap(&mut self) -> bool {
        std::mem::take(&mut self.gap)
    }

    /// The next event if the hub already has it.
    async fn next_ready(&mut self) -> Option<ClientEvent> {
        let event = self.receiver.try_recv()?;
        Some(self.read(event).await)
    }

    async fn read(&mut self, event: ClientEvent) -> ClientEvent {
        if let DriveEvent::Committed { turn, .. } = &*event
            && !self.committed
        {
            self.committed = true;
            hand_to_client(
                self.shared.ledger.as_ref(),
                &self.conversation_id,
                turn,
                self.shared.client_call_timeout_ms,
            )
            .await;
        }
        event
    }

    /// Read on to the commit or the end, the client gone or not: its calls are handed over.
    async fn finish(mut self) {
        while !self.committed && self.next().await.is_some() {}
    }
}

/// Answer one proxied request from its dispatch's events, then read on to the hand-over.
async fn follow(
    mut follower: Follower,
    to: Addressee,
    prompt_tokens: u64,
    stream: bool,
    commit_first: bool,
    reply: tokio::sync::oneshot::Sender<Response>,
) {
    if stream {
        stream_answer(&mut follower, to, prompt_tokens, commit_first, reply).await;
    } else {
        let response = whole_answer(&mut follower, to, prompt_tokens).await;
        let _ = reply.send(response);
    }
    follower.finish().await;
}

/// Hand the committed tool calls to the proxy client: the client runs them and its follow-up
/// request carries the results (continuation appends them, which closes the calls). Handed,
/// not claimed: no executor is offered them. The client's hold ends `bound_ms` later by the
/// store's clock (`client_abandoned`), or earlier when a follow-up of the client forks
/// (`continuation::find_and_append`).
pub async fn hand_to_client(ledger: &dyn Ledger, conversation_id: &str, turn: &Value, bound_ms: u64) {
    for part in parts_of(turn) {
        if let Part::Call { id, .. } = part
            && let Err(error) = ledger
                .hand_to_client(conversation_id, &id, PROXY_CLIENT_HOLDER, bound_ms)
                .await
        {
            tracing::warn!(%error, "handing a proxy tool call to the client failed");
        }
    }
}

fn failure_response(api: Api, failure: &answer::Failure) -> Response {
    provider_error(api, failure.status, &failure.code, &failure.message, &Value::Null)
}

async fn whole_answer(follower: &mut Follower, to: Addressee, prompt_tokens: u64) -> Response {
    let api = to.api;
    let mut answer = answer::WholeAnswer::new(to, prompt_tokens);
    while let Some(event) = follower.next().await {
        if let Some(body) = answer.push(&event) {
            let mut response = Json(body).into_response();
            if let Some(answerer) = answer.answered_by() {
                name_answerer(&mut response, answerer);
            }
            return response;
        }
    }
    failure_response(api, &answer.end())
}

/// `x-turnstile-provider` and `x-turnstile-model`: who answered.
fn name_answerer(response: &mut Response, answerer: &Answerer) {
    for (name, value) in answerer.headers() {
        if let Ok(value) = header::HeaderValue::from_str(value) {
            response.headers_mut().insert(name, value);
        }
    }
}

/// Stream the answer ([`answer::StreamAnswer`] decides what is sent; this pumps it).
async fn stream_answer(
    follower: &mut Follower,
    to: Addressee,
    prompt_tokens: u64,
    commit_first: bool,
    reply: tokio::sync::oneshot::Sender<Response>,
) {
    let api = to.api;
    let mut answer = answer::StreamAnswer::new(to, prompt_tokens);
    if commit_first {
        answer.wait_for_commit();
    }
    // The status line waits for the first sign of an answer.
    while let Some(event) = follower.next().await {
        if follower.gap() {
            answer.previews_dropped();
        }
        match answer.before_head(event) {
            answer::Head::Wait => continue,
            answer::Head::Fail(failure) => {
                let _ = reply.send(failure_response(api, &failure));
                return;
            }
            answer::Head::Open => break,
        }
    }
    // Who answers: the target of the generation whose preview opened the stream (or of the
    // commit that came first). The headers go out with the status line: a failover later in
    // this stream cannot rename them.
    let target = match answer.opener() {
        Some(answer::Opener::Generation(generation)) => follower.receiver.target_of(generation),
        Some(answer::Opener::Target(target)) => Some(target),
        None => None,
    };
    let answerer = target.and_then(|target| answer.answered_by(target));
    // What the hub already has joins what was read.
    let mut ready = Vec::new();
    while let Some(event) = follower.next_ready().await {
        ready.push(event);
    }
    let (sender, out) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(64);
    let mut response = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(
            out,
        )))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    if let Some(answerer) = &answerer {
        name_answerer(&mut response, answerer);
    }
    if reply.send(response).is_err() {
        // The client left before the status line.
        return;
    }
    let send = |bytes: Vec<u8>| {
        let sender = sender.clone();
        async move { bytes.is_empty() || sender.send(Ok(Bytes::from(bytes))).await.is_ok() }
    };
    let mut frames = answer.open(ready);
    loop {
        if !send(frames.bytes).await || frames.done {
            return;
        }
        frames = match follower.next().await {
            Some(event) => {
                if follower.gap() {
                    answer.previews_dropped();
                }
                answer.push(&event)
            }
            None => answer.end(),
        };
    }
}
