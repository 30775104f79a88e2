//! Proxy refusals: every request the proxy answered with a refusal of the history (an illegal
//! sequence, results still pending, a body that does not import) is kept here, newest first,
//! with its violation codes, the offending blocks and an outline of the turns around them, so
//! whoever runs the gateway sees what a client sent and why nothing was sent on.
//!
//! In memory, per replica, the last `proxy_refusals_max` (config; default
//! [`PROXY_REFUSALS_MAX_DEFAULT`]) of them: a refusal changes no state (nothing was sent or
//! stored), so it is diagnostics like the shadow diffs, not ledger. Each record is bounded:
//! at most [`REFUSAL_BLOCKS_MAX`] offending blocks of at most [`REFUSAL_BLOCK_BYTES_MAX`] bytes
//! of JSON each, and an outline of at most [`REFUSAL_TURNS_MAX`] turns (ids, roles, block
//! kinds; no content).
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - proxy refusals are kept newest first, bounded, with codes and the offending block. Enforced in
//!   `serve/proxy/refusals.rs`. Tests: `console_api.rs::proxy_refusals_are_kept_newest_first…` (red
//!   oldest first).

use super::super::{Shared, now};
use crate::serve::api;
use crate::serve::feed::{Change, Feed};
use axum::Json;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::Mutex;
use turnstile_adapters::Api;
use turnstile_core::Violation;

/// Refusals kept per replica unless configured.
pub const PROXY_REFUSALS_MAX_DEFAULT: usize = 1000;
/// Offending blocks kept per refusal.
pub const REFUSAL_BLOCKS_MAX: usize = 16;
/// Bytes of one offending block's JSON kept (longer: cut, and marked `truncated`).
pub const REFUSAL_BLOCK_BYTES_MAX: usize = 4096;
/// Turns in a refusal's outline.
pub const REFUSAL_TURNS_MAX: usize = 64;
/// Most refusals one page answers.
pub const REFUSALS_PAGE_MAX: usize = 500;

struct Record {
    id: u64,
    tenant_prefix: String,
    body: Value,
}

/// The newest refusals.
pub struct Refusals {
    records: Mutex<(u64, VecDeque<Record>)>,
    max: usize,
    feed: Arc<Feed>,
}

/// Why the proxy refused a request.
pub enum Refusal<'a> {
    /// The history is illegal.
    Rejected(&'a [Violation]),
    /// Calls without results.
    Waiting(&'a [String]),
    /// The body does not import (code and JSON path of the importer).
    NotImportable {
        /// `ImportError::code`.
        code: &'a str,
        /// `ImportError::path`.
        path: &'a str,
    },
}

/// One refusal as recorded.
pub struct Refused<'a> {
    /// The caller's store-id prefix (its tenant).
    pub tenant_prefix: &'a str,
    /// The client's API.
    pub api: Api,
    /// The client's model ("" when the body did not import).
    pub model: &'a str,
    /// What was refused.
    pub refusal: Refusal<'a>,
    /// The imported v1 document, when there is one.
    pub document: Option<&'a Value>,
    /// The repair plan of a route with `repair_history` that could not make the history legal
    /// (its `needs_person`): shown with the refusal as `repair`.
    pub repair: Option<&'a turnstile_core::repair::RepairPlan>,
}

/// A block's JSON, cut to [`REFUSAL_BLOCK_BYTES_MAX`] on a character boundary.
fn bounded_json(value: &Value) -> (String, bool) {
    let text = value.to_string();
    if text.len() <= REFUSAL_BLOCK_BYTES_MAX {
        return (text, false);
    }
    let mut end = REFUSAL_BLOCK_BYTES_MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    (text[..end].to_owned(), true)
}

fn outline(document: &Value) -> Value {
    let turns = document["turns"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let outline: Vec<Value> = turns
        .iter()
        .take(REFUSAL_TURNS_MAX)
        .map(|turn| {
            let blocks = turn["blocks"].as_array().map(Vec::as_slice).unwrap_or(&[]);
            json!({"id": turn["id"], "role": turn["role"],
                   "blocks": blocks.iter().take(limits_blocks()).map(|block| json!({"id": block["id"], "kind": block["kind"]})).collect::<Vec<_>>()})
        })
        .collect();
    json!({"turns": outline, "turns_total": turns.len()})
}

fn limits_blocks() -> usize {
    turnstile_core::limits::BLOCKS_PER_TURN_MAX
}

/// The offending blocks (or, for a violation of a whole turn, the turn) of `violations`.
fn offending(document: &Value, violations: &[Violation]) -> Vec<Value> {
    let turns = document["turns"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let mut found = Vec::new();
    for violation in violations {
        if found.len() == REFUSAL_BLOCKS_MAX {
            break;
        }
        let Some(turn_id) = violation.turn.as_deref() else {
            continue;
        };
        let Some(turn) = turns.iter().find(|turn| turn["id"].as_str() == Some(turn_id)) else {
            continue;
        };
        let block = violation.block.as_deref().and_then(|block_id| {
            turn["blocks"]
                .as_array()
                .and_then(|blocks| blocks.iter().find(|block| block["id"].as_str() == Some(block_id)))
        });
        let (json_text, truncated) = bounded_json(block.unwrap_or(turn));
        found.push(
            json!({"code": violation.code.as_str(), "turn": turn_id, "block": violation.block,
                          "role": turn["role"], "json": json_text, "truncated": truncated}),
        );
    }
    found
}

impl Refusals {
    /// Keep at most `max` refusals, announcing each on `feed`.
    pub fn new(max: usize, feed: Arc<Feed>) -> Refusals {
        Refusals {
            records: Mutex::new((0, VecDeque::new())),
            max,
            feed,
        }
    }

    /// Record one refusal.
    pub fn record(&self, refused: Refused<'_>) {
        let mut body = json!({"at": now().0, "api": refused.api.as_str(), "model": refused.model});
        match refused.refusal {
            Refusal::Rejected(violations) => {
                body["code"] = json!("illegal_sequence");
                body["violations"] = api::violations_json(violations);
                if let Some(document) = refused.document {
                    body["offending"] = json!(offending(document, violations));
                }
            }
            Refusal::Waiting(pending) => {
                body["code"] = json!("tool_results_pending");
                body["pending"] = json!(pending.iter().take(REFUSAL_BLOCKS_MAX).collect::<Vec<_>>());
            }
            Refusal::NotImportable { code, path } => {
                body["code"] = json!(code);
                body["path"] = json!(path);
            }
        }
        if let Some(document) = refused.document {
            body["outline"] = outline(document);
        }
        if let Some(plan) = refused.repair {
            body["repair"] = json!({"plan_digest": plan.digest, "actions": plan.actions.len(),
                                    "needs_person": api::violations_json(&plan.needs_person)});
        }
        // A poisoned lock only means another push panicked mid-way; the deque is still whole.
        let mut records = self
            .records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        records.0 += 1;
        let id = records.0;
        records.1.push_back(Record {
            id,
            tenant_prefix: refused.tenant_prefix.to_owned(),
            body,
        });
        while records.1.len() > self.max {
            records.1.pop_front();
        }
        drop(records);
        self.feed.publish(Change::Proxy {
            tenant_prefix: refused.tenant_prefix.to_owned(),
            kind: "refusal",
        });
    }

    /// One tenant's refusals older than `before`, newest first, and the next page's `before`.
    pub fn page(&self, tenant_prefix: &str, before: Option<u64>, limit: usize) -> (Vec<Value>, Option<u64>) {
        let records = self
            .records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut page: Vec<&Record> = records
            .1
            .iter()
            .rev()
            .filter(|record| {
                record.tenant_prefix == tenant_prefix && before.is_none_or(|before| record.id < before)
            })
            .take(limit + 1)
            .collect();
        let next = if page.len() > limit {
            page.truncate(limit);
            page.last().map(|record| record.id)
        } else {
            None
        };
        let page = page
            .into_iter()
            .map(|record| {
                let mut body = record.body.clone();
                body["id"] = json!(record.id);
                body
            })
            .collect();
        (page, next)
    }
}

/// `GET /v1/proxy/refusals` query.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RefusalsQuery {
    limit: Option<u64>,
    before: Option<u64>,
}

/// `GET /v1/proxy/refusals?limit=N&before=ID`: `{"refusals": [newest first], "next": ID|null}`.
pub async fn list(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(query): Query<RefusalsQuery>,
) -> Response {
    let caller = match api::caller(&shared, &headers) {
        Ok(caller) => caller,
        Err(error) => return error.into_response(),
    };
    let limit = match api::list_limit(query.limit, REFUSALS_PAGE_MAX as u64) {
        Ok(limit) => limit as usize,
        Err(error) => return error.into_response(),
    };
    let (refusals, next) = shared.refusals.page(&caller.store_id(""), query.before, limit);
    Json(json!({"refusals": refusals, "next": next})).into_response()
}
