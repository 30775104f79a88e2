//! Provider transports: one HTTP request per attempt, its streaming body forwarded chunk by
//! chunk to the dispatch driver. No retries here: every retry is a state-machine decision
//! (`turnstile_core::dispatch`), never a blind HTTP retry.
//!
//! Credentials: the API key is read from the environment variable the config names, added as
//! the provider's auth header at send time, and never logged, stored or put in a manifest.

use bytes::Bytes;
use futures_util::StreamExt;
use std::time::Duration;
use tokio::sync::mpsc;
use turnstile_adapters::Api;
use turnstile_adapters::decode::StreamApi;

/// Longest provider request id kept (a header value past it is cut at a character boundary).
pub const REQUEST_ID_BYTES_MAX: usize = 256;

/// The headers providers name their request id in: OpenAI (`x-request-id`), Anthropic
/// (`request-id`, provider-rules.md), Google (`x-goog-request-id`); the first present wins.
const REQUEST_ID_HEADERS: [&str; 3] = ["x-request-id", "request-id", "x-goog-request-id"];

/// The provider's request id of a response, bounded.
fn request_id(headers: &reqwest::header::HeaderMap) -> Option<String> {
    let value = REQUEST_ID_HEADERS
        .iter()
        .find_map(|name| headers.get(*name))?
        .to_str()
        .ok()?;
    let mut end = value.len().min(REQUEST_ID_BYTES_MAX);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    Some(value[..end].to_owned())
}

/// What one attempt's connection reports, in order.
#[derive(Debug)]
pub enum TransportEvent {
    /// The response head arrived with this status.
    Head {
        /// HTTP status.
        status: u16,
        /// Its `retry-after`, in milliseconds (delta-seconds only), if any.
        retry_after_ms: Option<u64>,
        /// The provider's request id header (`x-request-id`, `request-id`,
        /// `x-goog-request-id`), at most [`REQUEST_ID_BYTES_MAX`] bytes of it.
        request_id: Option<String>,
    },
    /// Body bytes.
    Chunk(Bytes),
    /// The body ended cleanly.
    End,
    /// The connection broke or timed out; the request may have reached the provider.
    Broken(String),
    /// The connection could not be made: nothing was sent.
    Unreachable(String),
}

/// Where and how to reach one provider.
#[derive(Clone, Debug)]
pub struct Endpoint {
    /// Base URL without a trailing slash.
    pub base_url: String,
    /// Environment variable with the API key (None: no auth header, e.g. the simulator).
    pub api_key_env: Option<String>,
    /// Resume streams by handle (OpenAI Responses).
    pub resume_by_handle: bool,
    /// The provider honours our idempotency key.
    pub honours_idempotency_key: bool,
    /// The provider counts usage as its vendor does (`config::Provider::vendor_usage`).
    pub vendor_usage: bool,
    /// OpenAI Chat: how all-text messages carry their text (`text_content`).
    pub text_content: turnstile_adapters::TextContent,
    /// The provider's own bounds on an attempt's waits (`connect_timeout_ms`,
    /// `idle_timeout_ms`, `attempt_timeout_ms`); `None`: the global ones.
    pub timeouts: Option<turnstile_drive::Timeouts>,
}

/// The adapters' API for a stream API: where the path and non-secret headers of a stored
/// request come from (the stored bytes are always a streaming request).
fn wire_api(api: StreamApi) -> Api {
    match api {
        StreamApi::OpenAiChat => Api::OpenaiChat,
        StreamApi::OpenAiResponses => Api::OpenaiResponses,
        StreamApi::AnthropicMessages => Api::AnthropicMessages,
        _ => Api::Gemini,
    }
}

fn auth_header(api: StreamApi, key: &str) -> (&'static str, String) {
    auth_header_for(wire_api(api), key)
}

/// The auth header of a provider speaking `api` (the proxy's pass-through uses it).
pub fn auth_header_for(api: Api, key: &str) -> (&'static str, String) {
    match api {
        Api::AnthropicMessages => ("x-api-key", key.to_owned()),
        Api::Gemini => ("x-goog-api-key", key.to_owned()),
        Api::OpenaiChat | Api::OpenaiResponses => ("authorization", format!("Bearer {key}")),
    }
}

/// One outgoing request.
pub struct Outgoing {
    /// GET (resume) or POST.
    pub method: reqwest::Method,
    /// Full URL.
    pub url: String,
    /// Non-secret headers.
    pub headers: Vec<(String, String)>,
    /// Body (empty for GET).
    pub body: Vec<u8>,
}

/// Build the request for a send of stored bytes.
pub fn send_request(
    endpoint: &Endpoint,
    api: StreamApi,
    model: &str,
    body: Vec<u8>,
    idempotency_key: &str,
) -> Outgoing {
    let wire = wire_api(api);
    let path = wire.request_path(model, true);
    let mut headers: Vec<(String, String)> = wire
        .request_headers()
        .iter()
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect();
    headers.push(("idempotency-key".into(), idempotency_key.to_owned()));
    Outgoing {
        method: reqwest::Method::POST,
        url: format!("{}{path}", endpoint.base_url),
        headers,
        body,
    }
}

/// Build the request that resumes a Responses stream after `sequence_last`.
pub fn resume_request(endpoint: &Endpoint, handle: &str, sequence_last: Option<u64>) -> Outgoing {
    let mut url = format!("{}/v1/responses/{handle}?stream=true", endpoint.base_url);
    if let Some(after) = sequence_last {
        url.push_str(&format!("&starting_after={after}"));
    }
    Outgoing {
        method: reqwest::Method::GET,
        url,
        headers: Vec::new(),
        body: Vec::new(),
    }
}

/// Build the question "does the response behind `handle` still run?" (OpenAI Responses:
/// `GET /v1/responses/{id}`, answered with the response object and its `status`).
pub fn status_request(endpoint: &Endpoint, handle: &str) -> Outgoing {
    Outgoing {
        method: reqwest::Method::GET,
        url: format!("{}/v1/responses/{handle}", endpoint.base_url),
        headers: Vec::new(),
        body: Vec::new(),
    }
}

/// Build the request that stops the response behind `handle` (OpenAI Responses:
/// `POST /v1/responses/{id}/cancel`, answered with the response object, `status: cancelled`).
pub fn cancel_request(endpoint: &Endpoint, handle: &str) -> Outgoing {
    Outgoing {
        method: reqwest::Method::POST,
        url: format!("{}/v1/responses/{handle}/cancel", endpoint.base_url),
        headers: Vec::new(),
        body: Vec::new(),
    }
}

/// Perform a request, forwarding everything to `events`. Ends when the body ends or breaks,
/// when the receiver is dropped, or after `idle` without a chunk.
pub async fn perform(
    client: reqwest::Client,
    endpoint: Endpoint,
    api: StreamApi,
    outgoing: Outgoing,
    idle: Duration,
    events: mpsc::Sender<TransportEvent>,
) {
    let mut request = client.request(outgoing.method, &outgoing.url);
    for (name, value) in &outgoing.headers {
        request = request.header(name, value);
    }
    if let Some(variable) = &endpoint.api_key_env {
        if let Ok(key) = std::env::var(variable) {
            let (name, value) = auth_header(api, &key);
            request = request.header(name, value);
        }
    }
    if !outgoing.body.is_empty() {
        request = request.body(outgoing.body);
    }
    let response = match request.send().await {
        Ok(response) => response,
        Err(error) => {
            // reqwest errors name the URL, never headers: no credential can leak here. A
            // connect error sent nothing; anything else (a pooled connection the provider had
            // closed, a reset) may have delivered the request.
            let unreachable = error.is_connect();
            let reason = error.without_url().to_string();
            let event = if unreachable {
                TransportEvent::Unreachable(reason)
            } else {
                TransportEvent::Broken(reason)
            };
            let _ = events.send(event).await;
            return;
        }
    };
    if events
        .send(TransportEvent::Head {
            status: response.status().as_u16(),
            retry_after_ms: response
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|value| value.to_str().ok())
                .and_then(super::breaker::retry_after_ms),
            request_id: request_id(response.headers()),
        })
        .await
        .is_err()
    {
        return;
    }
    let mut body = response.bytes_stream();
    loop {
        match tokio::time::timeout(idle, body.next()).await {
            Ok(Some(Ok(chunk))) => {
                if events.send(TransportEvent::Chunk(chunk)).await.is_err() {
                    return;
                }
            }
            Ok(Some(Err(error))) => {
                let _ = events
                    .send(TransportEvent::Broken(error.without_url().to_string()))
                    .await;
                return;
            }
            Ok(None) => {
                let _ = events.send(TransportEvent::End).await;
                return;
            }
            Err(_) => {
                let _ = events.send(TransportEvent::Broken("idle timeout".into())).await;
                return;
            }
        }
    }
}
