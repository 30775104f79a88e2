//! Shadow mode: the client's original bytes go to the provider untouched and the provider's
//! answer goes back untouched; beside them Turnstile imports, validates and renders its own
//! request and records how it differs — bytes (identical? where the first difference is) and
//! meaning (`turnstile_adapters::import::semantic_diff`: roles, texts, calls, results, tools)
//! — plus what the validator would have refused. The last `shadow_diffs_max` records are at
//! `GET /v1/shadow/diffs`; counts are in `turnstile_shadow_*` metrics. Nothing here touches
//! the ledger: shadow traffic is observed, not protected.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - every shadow record carries our manifest, or null with the reason none could be made; bytes
//!   are compared only when both sides exist. Enforced in `serve/proxy/shadow.rs::compare`. Tests:
//!   `proxy.rs::shadow_forwards_the_original_bytes…`.

use super::super::{Shared, metrics, now};
use super::{RouteSpec, api_label, provider_error};
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::Mutex;
use turnstile_adapters::Api;
use turnstile_adapters::import::{ImportError, Imported, import, semantic_diff};
use turnstile_adapters::prepare::{PrepareOutcome, PrepareRequest, Settings, prepare_with_settings};
use turnstile_adapters::render::{Graph, RenderCache};
use turnstile_core::{Conversation, MessageSequence, Validated, Verdict};

/// Bytes of each body a shadow record keeps unless configured (`shadow_body_bytes_max`):
/// enough for the console's side-by-side diff of any ordinary request, and with the default
/// 100 records at most ~13 MB per replica.
pub const SHADOW_BODY_BYTES_MAX_DEFAULT: usize = 64 * 1024;

/// The last N shadow records, newest last.
pub struct Diffs {
    records: Mutex<VecDeque<Value>>,
    max: usize,
    body_bytes_max: usize,
}

impl Diffs {
    /// Keep at most `max` records, with at most `body_bytes_max` bytes of each body.
    pub fn new(max: usize, body_bytes_max: usize) -> Diffs {
        Diffs {
            records: Mutex::new(VecDeque::new()),
            max,
            body_bytes_max,
        }
    }

    fn push(&self, record: Value) {
        // A poisoned lock only means another push panicked mid-way; the deque is still whole.
        let mut records = self
            .records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        records.push_back(record);
        while records.len() > self.max {
            records.pop_front();
        }
    }

    /// The newest `limit` records of one tenant, newest first.
    pub fn newest(&self, tenant_prefix: &str, limit: usize) -> Vec<Value> {
        let records = self
            .records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        records
            .iter()
            .rev()
            .filter(|record| record["tenant_prefix"].as_str() == Some(tenant_prefix))
            .take(limit)
            .map(|record| {
                let mut record = record.clone();
                if let Some(object) = record.as_object_mut() {
                    object.remove("tenant_prefix");
                }
                record
            })
            .collect()
    }
}

/// Request headers that carry meaning for the provider and are passed on (never credentials:
/// the provider's key comes from the gateway's own configuration).
const FORWARDED_HEADERS: [&str; 6] = [
    "content-type",
    "accept",
    "idempotency-key",
    "anthropic-version",
    "anthropic-beta",
    "openai-beta",
];

/// Forward the original bytes and relay the provider's answer; record the comparison in the
/// background.
#[allow(clippy::too_many_arguments)]
pub async fn forward(
    shared: Arc<Shared>,
    tenant_prefix: String,
    api: Api,
    route: RouteSpec,
    path_and_query: String,
    headers: HeaderMap,
    body: Bytes,
    imported: Result<Imported, ImportError>,
    mode_label: &'static str,
) -> Response {
    let provider = route.original_provider.clone();
    let Some(endpoint) = shared.endpoints.get(&provider).cloned() else {
        return provider_error(
            api,
            StatusCode::SERVICE_UNAVAILABLE,
            "unknown_provider",
            "the route's original provider is not configured",
            &Value::Null,
        );
    };
    {
        let shared = shared.clone();
        let body = body.clone();
        let route = route.clone();
        tokio::spawn(async move {
            let record = compare(&shared, api, &route, &body, imported);
            let kinds: Vec<&'static str> = metrics::SHADOW_DIFF_KINDS
                .into_iter()
                .filter(|kind| record["differs"][*kind].as_bool() == Some(true))
                .collect();
            metrics::shadow(api_label(api), &kinds);
            let mut record = record;
            record["tenant_prefix"] = json!(tenant_prefix);
            shared.shadow.push(record);
            shared.feed.publish(crate::serve::feed::Change::Proxy {
                tenant_prefix,
                kind: "shadow",
            });
        });
    }
    let mut request = shared
        .client
        .post(format!("{}{path_and_query}", endpoint.base_url))
        .body(body);
    for name in FORWARDED_HEADERS {
        if let Some(value) = headers.get(name) {
            request = request.header(name, value.clone());
        }
    }
    if let Some(variable) = &endpoint.api_key_env {
        if let Ok(key) = std::env::var(variable) {
            let (name, value) = super::super::transport::auth_header_for(api, &key);
            request = request.header(name, value);
        }
    }
    metrics::proxy_request(api_label(api), mode_label, "original");
    let response = match request.send().await {
        Ok(response) => response,
        Err(error) => {
            return provider_error(
                api,
                StatusCode::BAD_GATEWAY,
                "provider_unreachable",
                &error.without_url().to_string(),
                &Value::Null,
            );
        }
    };
    let status = StatusCode::from_u16(response.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    // The provider's own headers go back too (retry-after, x-should-retry, request ids, rate-limit
    // counters: SDKs back off by them), except those that describe this one connection.
    let mut relayed = axum::http::HeaderMap::new();
    for (name, value) in response.headers() {
        if !HOP_BY_HOP_HEADERS.contains(&name.as_str()) {
            relayed.append(name.clone(), value.clone());
        }
    }
    let mut out = Response::builder()
        .status(status)
        .header("x-turnstile-mode", mode_label)
        .body(Body::from_stream(response.bytes_stream()))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    out.headers_mut().extend(relayed);
    if !out.headers().contains_key(header::CONTENT_TYPE) {
        out.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/json"),
        );
    }
    out
}

/// Response headers that belong to one connection (RFC 9110 §7.6.1) or to a body we re-frame.
const HOP_BY_HOP_HEADERS: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
];

/// A body as text for the record: at most `max` bytes (cut on a character boundary of the
/// lossy UTF-8 reading), and whether it was cut.
fn kept_body(body: &[u8], max: usize) -> (String, bool) {
    let text = String::from_utf8_lossy(&body[..body.len().min(max)]).into_owned();
    (text, body.len() > max)
}

/// Where two byte strings first differ (None: identical).
fn first_difference(ours: &[u8], theirs: &[u8]) -> Option<usize> {
    let common = ours.iter().zip(theirs).take_while(|(a, b)| a == b).count();
    if common == ours.len() && common == theirs.len() {
        None
    } else {
        Some(common)
    }
}

/// Import → validate → render ours with the route's adapter → compare with the original.
pub fn compare(
    shared: &Shared,
    api: Api,
    route: &RouteSpec,
    original: &[u8],
    imported: Result<Imported, ImportError>,
) -> Value {
    let mut record = json!({"at": now().0, "api": api.as_str(), "adapter": route.adapter.as_str(),
        "provider": route.original_provider, "mode": route.mode_label,
        // `bytes` stays null unless both sides exist; `manifest` is ours, or null with the
        // reason none could be made.
        "differs": {"bytes": null, "semantic": false, "would_reject": false, "not_importable": false},
        "manifest": null, "manifest_reason": null});
    // Both bodies (bounded) for a diff a person can read; `ours` is null until we have one.
    let (original_text, original_truncated) = kept_body(original, shared.shadow.body_bytes_max);
    record["bodies"] = json!({"original": original_text, "original_truncated": original_truncated,
                              "ours": null, "ours_truncated": false});
    let imported = match imported {
        Ok(imported) => imported,
        Err(error) => {
            record["differs"]["not_importable"] = json!(true);
            record["manifest_reason"] = json!("not_importable");
            record["import_error"] =
                json!({"code": error.code(), "path": error.path(), "message": error.to_string()});
            return record;
        }
    };
    record["model"] = json!(imported.model);
    record["dropped"] = json!(imported.dropped);
    let conversation = match Conversation::from_value(imported.document.clone()) {
        Ok(conversation) => conversation,
        Err(error) => {
            record["differs"]["would_reject"] = json!(true);
            record["verdict"] = json!("rejected");
            record["manifest_reason"] = json!("rejected");
            record["violations"] = json!([{"code": "invalid_structure", "message": error.to_string()}]);
            return record;
        }
    };
    // One validation: the verdict for the record, the proof for the graph.
    let (verdict, validated) = Validated::with_verdict(&conversation);
    match verdict {
        Verdict::Ready => record["verdict"] = json!("ready"),
        Verdict::Waiting { pending } => {
            record["differs"]["would_reject"] = json!(true);
            record["verdict"] = json!("waiting");
            record["manifest_reason"] = json!("waiting");
            record["pending"] = json!(pending.into_iter().map(|call| call.0).collect::<Vec<_>>());
            return record;
        }
        Verdict::Rejected(violations) => {
            metrics::rejected(&violations);
            record["differs"]["would_reject"] = json!(true);
            record["verdict"] = json!("rejected");
            record["manifest_reason"] = json!("rejected");
            record["violations"] = crate::serve::api::violations_json(&violations);
            return record;
        }
    }
    // Invariant: a ready verdict comes with its proof.
    let Some(validated) = validated else {
        return record;
    };
    let sequence = MessageSequence::build(validated);
    let Ok(graph) = Graph::new(validated, &sequence) else {
        return record;
    };
    let request = PrepareRequest {
        operation_id: "shadow".into(),
        adapter: route.adapter,
        provider: Some(route.provider.clone()),
        model: route
            .target_model
            .clone()
            .unwrap_or_else(|| imported.model.clone()),
        max_output_tokens: imported.max_output_tokens,
        stream: imported.stream,
        background: false,
        // The bytes the route's provider would get.
        text_content: shared
            .endpoints
            .get(&route.provider)
            .map(|endpoint| endpoint.text_content)
            .unwrap_or_default(),
    };
    // A private cache: shadow traffic must not evict the live path's fragments.
    let mut cache = RenderCache::new();
    let settings = Settings {
        sampling: imported.sampling.clone(),
        tool_choice: imported.tool_choice.clone(),
        output_format: imported.output_format.clone(),
        passthrough: imported.passthrough.clone(),
        repair: None,
    };
    let outcome = match prepare_with_settings(graph, &request, &settings, &shared.catalog, &mut cache) {
        Ok(outcome) => outcome,
        Err(refusal) => {
            record["differs"]["would_reject"] = json!(true);
            record["verdict"] = json!(refusal.code());
            record["manifest_reason"] = json!("refused");
            record["refusal"] = json!(refusal.to_string());
            return record;
        }
    };
    let ours = match outcome {
        PrepareOutcome::Prepared(prepared) => {
            record["manifest"] = serde_json::to_value(&prepared.manifest).unwrap_or(Value::Null);
            prepared.rendered.body
        }
        PrepareOutcome::Paused(pauses) => {
            record["differs"]["would_reject"] = json!(true);
            record["verdict"] = json!("paused");
            record["manifest_reason"] = json!("paused");
            record["pauses"] = serde_json::to_value(&pauses).unwrap_or(Value::Null);
            return record;
        }
        PrepareOutcome::OverBudget(over) => {
            record["differs"]["would_reject"] = json!(true);
            record["verdict"] = json!("over_budget");
            record["manifest_reason"] = json!("over_budget");
            record["prompt_tokens"] = json!(over.prompt_tokens);
            return record;
        }
    };
    let ours_api = route.adapter.api();
    let difference = if ours_api == api {
        first_difference(&ours, original)
    } else {
        Some(0)
    };
    record["bytes"] = json!({"identical": difference.is_none(), "first_difference_at": difference,
                             "original_len": original.len(), "ours_len": ours.len(), "ours_api": ours_api.as_str()});
    record["differs"]["bytes"] = json!(difference.is_some());
    let (ours_text, ours_truncated) = kept_body(&ours, shared.shadow.body_bytes_max);
    record["bodies"]["ours"] = json!(ours_text);
    record["bodies"]["ours_truncated"] = json!(ours_truncated);
    let gemini = (ours_api == Api::Gemini).then(|| turnstile_adapters::import::GeminiCall {
        model: request.model.clone(),
        stream: request.stream,
    });
    let conversation_id = imported.document["conversation_id"]
        .as_str()
        .unwrap_or("shadow")
        .to_owned();
    let semantic = match import(ours_api, &ours, &conversation_id, gemini) {
        Ok(ours) => semantic_diff(&ours.document, &imported.document),
        Err(error) => vec![format!("our own request does not import: {error}")],
    };
    record["differs"]["semantic"] = json!(!semantic.is_empty());
    record["semantic"] = json!(semantic);
    record
}
