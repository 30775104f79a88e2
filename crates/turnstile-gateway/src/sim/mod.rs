//! `turnstile sim`: a provider simulator on loopback that speaks the real wire formats of
//! OpenAI Chat, OpenAI Responses (with background mode and resume), Anthropic Messages and
//! Gemini, with scripted replies and faults (`shared/spec/gateway-api.md`).
//!
//! It is a test instrument, not a model: replies come from `POST /sim/script` queues keyed by
//! model name; `GET /sim/requests` returns every request received, byte for byte, with
//! credentials removed, so tests compare what was sent with its manifest.

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use turnstile_adapters::simulate::script::{self, Faults, Reply, Script};
use turnstile_adapters::simulate::wire::{self, Api, Frame};

/// Headers that carry credentials; never recorded.
const CREDENTIAL_HEADERS: &[&str] = &[
    "authorization",
    "x-api-key",
    "x-goog-api-key",
    "api-key",
    "proxy-authorization",
];
/// Most requests kept for `GET /sim/requests` (oldest dropped first).
const REQUESTS_KEPT_MAX: usize = 10_000;
/// How long a cut or disconnected stream waits before dropping the connection (see
/// `stream_response`).
const ABORT_FLUSH_DELAY: Duration = Duration::from_millis(50);
/// Largest request body accepted.
const REQUEST_BYTES_MAX: usize = 64 * 1024 * 1024;

/// One recorded request.
#[derive(Clone, Debug, serde::Serialize)]
struct Recorded {
    path: String,
    headers: serde_json::Map<String, Value>,
    body: String,
}

/// A reply already produced, kept for resume (Responses) and idempotent replay.
#[derive(Clone)]
struct Produced {
    api: Api,
    frames: Vec<Frame>,
    whole: Value,
    resumable: bool,
    /// The reply's pace (`delay_ms` per event): a resumed background response goes on at
    /// the pace it was generated at.
    delay_ms: Option<u64>,
    /// Its stop event reached a client (what `GET /v1/responses/{id}` reports as
    /// `completed`), or it was cancelled; until then a background response is `in_progress`.
    progress: Arc<Mutex<Progress>>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Progress {
    #[default]
    InProgress,
    Completed,
    Cancelled,
}

struct SimState {
    /// Distinguishes this simulator process's handles from every other's.
    instance: String,
    queues: HashMap<String, VecDeque<Reply>>,
    requests: VecDeque<Recorded>,
    produced: HashMap<String, Produced>,
    idempotent: HashMap<String, String>,
    handles_issued: u64,
}

impl Default for SimState {
    fn default() -> SimState {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_nanos());
        SimState {
            instance: format!("{:x}", nanos ^ u128::from(std::process::id())),
            queues: HashMap::new(),
            requests: VecDeque::new(),
            produced: HashMap::new(),
            idempotent: HashMap::new(),
            handles_issued: 0,
        }
    }
}

/// The simulator's shared state.
#[derive(Clone, Default)]
pub struct Sim {
    state: Arc<Mutex<SimState>>,
}

impl Sim {
    fn lock(&self) -> MutexGuard<'_, SimState> {
        // A panic while holding this lock would be a simulator bug; keep serving the other
        // tests' requests with whatever state is there rather than poisoning them all.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The simulator's routes.
pub fn router(sim: Sim) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/responses", post(responses))
        .route("/v1/responses/{id}", get(responses_get))
        .route("/v1/responses/{id}/cancel", post(responses_cancel))
        .route("/v1/messages", post(messages))
        .route("/v1beta/models/{*model_action}", post(gemini))
        .route("/sim/script", post(script_post))
        .route("/sim/requests", get(requests_get))
        .route("/sim/reset", post(reset))
        .layer(axum::extract::DefaultBodyLimit::max(REQUEST_BYTES_MAX))
        .with_state(sim)
}

/// Only the scripting and request-log routes, for a gateway that embeds the simulator: its
/// clients script replies through the gateway's own address.
pub fn control_router(sim: Sim) -> Router {
    Router::new()
        .route("/sim/script", post(script_post))
        .route("/sim/requests", get(requests_get))
        .route("/sim/reset", post(reset))
        .with_state(sim)
}

/// Serve on a bound listener until the future is dropped.
pub async fn serve(listener: tokio::net::TcpListener, sim: Sim) -> std::io::Result<()> {
    // TCP_NODELAY: streamed events are small writes; with Nagle on, each one after the first on
    // a kept-alive connection waits for the client's delayed ACK (~40 ms on Linux).
    use axum::serve::ListenerExt;
    axum::serve(listener.tap_io(set_nodelay), router(sim)).await
}

async fn script_post(State(sim): State<Sim>, body: Bytes) -> Response {
    let script: Script = match serde_json::from_slice(&body) {
        Ok(script) => script,
        Err(error) => {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({"error": {"code": "bad_script", "message": error.to_string()}})),
            )
                .into_response();
        }
    };
    let mut state = sim.lock();
    let queue = state.queues.entry(script.model.clone()).or_default();
    queue.extend(script.replies);
    let queued = queue.len();
    axum::Json(json!({"model": script.model, "queued": queued})).into_response()
}

async fn requests_get(State(sim): State<Sim>) -> Response {
    let requests: Vec<Recorded> = sim.lock().requests.iter().cloned().collect();
    axum::Json(requests).into_response()
}

async fn reset(State(sim): State<Sim>) -> Response {
    *sim.lock() = SimState::default();
    StatusCode::NO_CONTENT.into_response()
}

fn record(state: &mut SimState, path: String, headers: &HeaderMap, body: &[u8]) {
    let mut recorded = serde_json::Map::new();
    for (name, value) in headers {
        if CREDENTIAL_HEADERS.contains(&name.as_str()) {
            continue;
        }
        recorded.insert(
            name.as_str().to_owned(),
            json!(String::from_utf8_lossy(value.as_bytes())),
        );
    }
    if state.requests.len() == REQUESTS_KEPT_MAX {
        state.requests.pop_front();
    }
    state.requests.push_back(Recorded {
        path,
        headers: recorded,
        body: String::from_utf8_lossy(body).into_owned(),
    });
}

async fn chat(State(sim): State<Sim>, headers: HeaderMap, body: Bytes) -> Response {
    provider_request(
        sim,
        Api::OpenAiChat,
        "/v1/chat/completions".into(),
        None,
        headers,
        body,
    )
    .await
}

async fn responses(State(sim): State<Sim>, headers: HeaderMap, body: Bytes) -> Response {
    provider_request(
        sim,
        Api::OpenAiResponses,
        "/v1/responses".into(),
        None,
        headers,
        body,
    )
    .await
}

async fn messages(State(sim): State<Sim>, headers: HeaderMap, body: Bytes) -> Response {
    provider_request(sim, Api::Anthropic, "/v1/messages".into(), None, headers, body).await
}

async fn gemini(
    State(sim): State<Sim>,
    Path(model_action): Path<String>,
    query: axum::extract::RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = match &query.0 {
        Some(query) => format!("/v1beta/models/{model_action}?{query}"),
        None => format!("/v1beta/models/{model_action}"),
    };
    let Some((model, action)) = model_action.rsplit_once(':') else {
        return error_response(Api::Gemini, 404);
    };
    let stream = match action {
        "streamGenerateContent" => Some(true),
        "generateContent" => Some(false),
        _ => return error_response(Api::Gemini, 404),
    };
    // Without alt=sse, Gemini streams a JSON array; only the SSE form is simulated.
    if stream == Some(true)
        && !query
            .0
            .as_deref()
            .unwrap_or("")
            .split('&')
            .any(|pair| pair == "alt=sse")
    {
        return error_response(Api::Gemini, 400);
    }
    provider_request(
        sim,
        Api::Gemini,
        path,
        Some((model.to_owned(), stream.unwrap_or(false))),
        headers,
        body,
    )
    .await
}

fn error_response(api: Api, status: u16) -> Response {
    error_response_saying(api, status, None)
}

fn error_response_saying(api: Api, status: u16, message: Option<&str>) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut body = wire::error_body(api, status);
    if let Some(message) = message {
        if let Some(error) = body.get_mut("error") {
            error["message"] = serde_json::json!(message);
        }
    }
    let mut response = (code, axum::Json(body)).into_response();
    // A request id header, as OpenAI (`x-request-id`) sends one: the gateway keeps it as the
    // attempt's evidence.
    static ERRORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let number = ERRORS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    if let Ok(value) = header::HeaderValue::from_str(&format!("req_sim_error_{number}")) {
        response.headers_mut().insert("x-request-id", value);
    }
    if status == 429 {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    }
    response
}

async fn provider_request(
    sim: Sim,
    api: Api,
    path: String,
    gemini_model: Option<(String, bool)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let (model, stream) = match gemini_model {
        Some((model, stream)) => (model, stream),
        None => (
            request
                .get("model")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned(),
            request.get("stream").and_then(Value::as_bool).unwrap_or(false),
        ),
    };
    let background = request
        .get("background")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let idempotency_key = headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
        .map(|key| format!("{model}\u{0}{key}"));

    let (produced, faults, handle) = {
        let mut state = sim.lock();
        record(&mut state, path, &headers, &body);
        if request.is_null() || model.is_empty() {
            drop(state);
            return error_response(api, 400);
        }
        // An idempotent reply seen before under this key: the same reply again, without the
        // transport faults of the first delivery.
        let replay = idempotency_key
            .as_ref()
            .and_then(|key| state.idempotent.get(key).cloned())
            .and_then(|handle| {
                state
                    .produced
                    .get(&handle)
                    .cloned()
                    .map(|produced| (produced, handle))
            });
        match replay {
            Some((produced, handle)) => (produced, Faults::default(), handle),
            None => {
                let reply = state
                    .queues
                    .get_mut(&model)
                    .and_then(VecDeque::pop_front)
                    .unwrap_or_else(script::default_reply);
                if let Some(status) = reply.faults.status {
                    drop(state);
                    return error_response_saying(api, status, reply.faults.error_message.as_deref());
                }
                state.handles_issued += 1;
                let number = state.handles_issued;
                // Unique across simulator processes, as real provider handles are: a handle
                // reused by a restarted simulator would (rightly) be refused by a ledger that
                // bound it to another manifest.
                let instance = &state.instance;
                let handle = reply.faults.handle.clone().unwrap_or_else(|| match api {
                    Api::OpenAiChat => format!("chatcmpl-sim{instance}n{number}"),
                    Api::OpenAiResponses => format!("resp_sim{instance}n{number}"),
                    Api::Anthropic => format!("msg_sim{instance}n{number}"),
                    Api::Gemini => format!("sim-{instance}n{number}"),
                });
                let ids = wire::call_ids(api, &reply, number);
                let frames = wire::frames(api, &reply, &handle, &model, &ids, body.len());
                let whole = wire::whole_body(api, &reply, &handle, &model, &ids, body.len());
                let resumable = reply.faults.resumable.unwrap_or(background);
                let produced = Produced {
                    api,
                    frames,
                    whole,
                    resumable,
                    delay_ms: reply.faults.delay_ms,
                    progress: Arc::default(),
                };
                state.produced.insert(handle.clone(), produced.clone());
                if reply.faults.idempotent {
                    if let Some(key) = &idempotency_key {
                        state.idempotent.insert(key.clone(), handle.clone());
                    }
                }
                (produced, reply.faults, handle)
            }
        }
    };
    let _ = handle;
    if let Some(head_delay_ms) = faults.head_delay_ms {
        tokio::time::sleep(Duration::from_millis(head_delay_ms)).await;
    }
    if stream && !faults.json_answer {
        stream_response(produced.frames, &faults, Some(produced.progress.clone()))
    } else {
        axum::Json(produced.whole).into_response()
    }
}

#[derive(Deserialize)]
struct ResumeQuery {
    stream: Option<bool>,
    starting_after: Option<u64>,
}

async fn responses_get(
    State(sim): State<Sim>,
    Path(id): Path<String>,
    Query(query): Query<ResumeQuery>,
    headers: HeaderMap,
) -> Response {
    let produced = {
        let mut state = sim.lock();
        let path = match (query.stream, query.starting_after) {
            (Some(stream), Some(after)) => {
                format!("/v1/responses/{id}?stream={stream}&starting_after={after}")
            }
            (Some(stream), None) => format!("/v1/responses/{id}?stream={stream}"),
            _ => format!("/v1/responses/{id}"),
        };
        record(&mut state, path, &headers, b"");
        state.produced.get(&id).cloned()
    };
    let Some(produced) = produced.filter(|produced| produced.api == Api::OpenAiResponses) else {
        return error_response(Api::OpenAiResponses, 404);
    };
    if !produced.resumable {
        // Real API: only background responses can be retrieved and resumed.
        return error_response(Api::OpenAiResponses, 400);
    }
    if query.stream != Some(true) {
        let progress = *produced
            .progress
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut whole = produced.whole.clone();
        whole["status"] = json!(match progress {
            Progress::InProgress => "in_progress",
            Progress::Completed => "completed",
            Progress::Cancelled => "cancelled",
        });
        return axum::Json(whole).into_response();
    }
    let after = query.starting_after;
    let pace = Faults {
        delay_ms: produced.delay_ms,
        ..Faults::default()
    };
    let frames: Vec<Frame> = produced
        .frames
        .into_iter()
        .filter(|frame| match (frame.sequence, after) {
            (Some(sequence), Some(after)) => sequence > after,
            _ => true,
        })
        .collect();
    stream_response(frames, &pace, Some(produced.progress.clone()))
}

/// `POST /v1/responses/{id}/cancel`: a background response still running is cancelled and
/// answered with `status: cancelled`; one that completed cannot be (400, as on the real API).
async fn responses_cancel(State(sim): State<Sim>, Path(id): Path<String>, headers: HeaderMap) -> Response {
    let produced = {
        let mut state = sim.lock();
        record(&mut state, format!("/v1/responses/{id}/cancel"), &headers, b"");
        state.produced.get(&id).cloned()
    };
    let Some(produced) = produced.filter(|produced| produced.api == Api::OpenAiResponses) else {
        return error_response(Api::OpenAiResponses, 404);
    };
    if !produced.resumable {
        return error_response(Api::OpenAiResponses, 400);
    }
    let mut progress = produced
        .progress
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if *progress == Progress::Completed {
        return error_response(Api::OpenAiResponses, 400);
    }
    *progress = Progress::Cancelled;
    let mut whole = produced.whole.clone();
    whole["status"] = json!("cancelled");
    axum::Json(whole).into_response()
}

/// Stream frames with the reply's faults applied. A cut or disconnect ends the body with an
/// error, so the connection is closed without the final chunk (what a dropped TCP connection
/// looks like to the client).
fn stream_response(frames: Vec<Frame>, faults: &Faults, progress: Option<Arc<Mutex<Progress>>>) -> Response {
    let mut events: Vec<Frame> = frames
        .into_iter()
        .filter(|frame| !(faults.drop_stop && frame.stop))
        .collect();
    // A body that ends with the stop event completes the response (for its status).
    let delivers_stop = events.iter().any(|frame| frame.stop);
    if faults.duplicate_events {
        events = events
            .into_iter()
            .flat_map(|frame| [frame.clone(), frame])
            .collect();
    }
    let mut abort = false;
    if let Some(count) = faults.disconnect_after_events {
        if count < events.len() {
            events.truncate(count);
            abort = true;
        }
    }
    let mut chunks: Vec<Vec<u8>> = events.into_iter().map(|frame| frame.bytes).collect();
    if let Some(cut) = faults.cut_at_byte {
        let mut remaining = cut;
        let mut kept = Vec::new();
        let total: usize = chunks.iter().map(Vec::len).sum();
        if cut < total {
            for mut chunk in chunks {
                if remaining == 0 {
                    break;
                }
                if chunk.len() > remaining {
                    chunk.truncate(remaining);
                }
                remaining -= chunk.len();
                kept.push(chunk);
            }
            chunks = kept;
            abort = true;
        }
    }
    let delay = faults.delay_ms.map(Duration::from_millis);
    let (sender, receiver) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        for chunk in chunks {
            if let Some(delay) = delay {
                tokio::time::sleep(delay).await;
            }
            if sender.send(Ok(Bytes::from(chunk))).await.is_err() {
                return;
            }
        }
        if !abort
            && delivers_stop
            && let Some(progress) = &progress
        {
            let mut progress = progress.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if *progress == Progress::InProgress {
                *progress = Progress::Completed;
            }
        }
        if abort {
            // Let the server write out what was sent before it drops the connection: hyper
            // discards its unflushed buffer when a body fails, and it flushes when the body
            // stream is pending. The client then sees the bytes and, after them, a broken
            // connection without the final chunk — what a dropped TCP connection looks like.
            tokio::time::sleep(ABORT_FLUSH_DELAY).await;
            let _ = sender
                .send(Err(std::io::Error::other("simulated connection loss")))
                .await;
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(ReceiverStream::new(receiver)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Turn Nagle's algorithm off on an accepted connection (streams are many small writes).
pub fn set_nodelay(tcp: &mut tokio::net::TcpStream) {
    if let Err(error) = tcp.set_nodelay(true) {
        tracing::warn!(%error, "TCP_NODELAY could not be set");
    }
}
