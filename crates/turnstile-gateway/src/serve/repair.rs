//! `POST /v1/conversations/{id}/repair`: the history doctor's door for a stored conversation
//! (`turnstile_core::repair`, `docs/operating.md` "Repairing a history"), and the repair
//! records `GET /v1/conversations/{id}` shows.
//!
//! A stored history is legal by construction (every write passes the validator), so the one
//! way it bricks is a call nobody will answer: an agent that stopped at its iteration limit, an
//! executor that is gone. Its next user turn is refused (`missing_result`) for ever. The repair
//! closes those calls with gateway `cancel` results in one new tool turn, appended as the next
//! revision in the transaction that writes the repair's record (plan, digest, tenant, actor,
//! time; `Ledger::append_repair`). Committed turns are never rewritten: a plan that would change
//! one is refused with its plan and violations, for a person.

use super::api::{self, ApiError, ApiResult, ErrorCode};
use super::{Shared, metrics, now};
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json};
use serde_json::{Value, json};
use std::sync::Arc;
use turnstile_adapters::import::{ImportError, Imported};
use turnstile_core::Revision;
use turnstile_core::repair::{self, Action, Options, Placement, RepairPlan};
use turnstile_store::{AppendOutcome, NewRepair};

/// The response header of a proxied request whose history was repaired:
/// `plan=<digest>; <cause>=<count>,…`.
pub const REPAIRED_HEADER: &str = "x-turnstile-repaired";

/// Longest `actor` a repair request may name.
pub const ACTOR_BYTES_MAX: usize = 256;

/// The metric `route` label of this door.
const ROUTE_NATIVE: &str = "native";

/// The request body: `{"expected_revision"?, "dry_run"?, "actor"?}`.
struct RepairBody {
    expected_revision: Option<u64>,
    dry_run: bool,
    actor: Option<String>,
}

fn invalid(message: &str) -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        ErrorCode::InvalidRequest,
        message,
    )
}

fn read_body(body: Value) -> Result<RepairBody, ApiError> {
    let map = api::strict_object(body, &["expected_revision", "dry_run", "actor"])?;
    let expected_revision = match map.get("expected_revision") {
        None => None,
        Some(value) => Some(
            value
                .as_u64()
                .ok_or_else(|| invalid("expected_revision must be a non-negative integer"))?,
        ),
    };
    let dry_run = match map.get("dry_run") {
        None => false,
        Some(value) => value
            .as_bool()
            .ok_or_else(|| invalid("dry_run must be a boolean"))?,
    };
    let actor = match map.get("actor") {
        None | Some(Value::Null) => None,
        Some(Value::String(actor)) if actor.len() <= ACTOR_BYTES_MAX => Some(actor.clone()),
        Some(Value::String(_)) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::LimitExceeded,
                format!("actor is longer than {ACTOR_BYTES_MAX} bytes"),
            )
            .with(json!({"limit": "ACTOR_BYTES_MAX"})));
        }
        Some(_) => return Err(invalid("actor must be a string")),
    };
    if !dry_run && expected_revision.is_none() {
        return Err(invalid("a repair that is not a dry run needs expected_revision"));
    }
    Ok(RepairBody {
        expected_revision,
        dry_run,
        actor,
    })
}

/// The new last turn the plan appends, when that is all it does (the only change a stored,
/// hence legal, history can need); `None` for a plan that would change a committed turn.
fn appended_turn(plan: &RepairPlan, repaired: &Value) -> Option<Value> {
    let only_appends = plan.actions.iter().all(|action| {
        matches!(
            action,
            Action::Cancel {
                placement: Placement::NewLastTurn { .. },
                ..
            }
        )
    });
    if !only_appends || !plan.is_complete() {
        return None;
    }
    repaired["turns"].as_array()?.last().cloned()
}

/// `POST /v1/conversations/{id}/repair`.
pub async fn repair_conversation(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    request: Request,
) -> ApiResult {
    let (caller, body) = api::authenticated_json(&shared, request).await?;
    let body = read_body(body)?;
    let store_id = caller.store_id(&id);
    let Some(stored) = shared
        .ledger
        .conversation(&store_id)
        .await
        .map_err(ApiError::store)?
    else {
        return Err(ApiError::not_found("conversation"));
    };
    // The plan is the caller's view: its own conversation id, digests over that document.
    let document = api::client_document(&caller, stored);
    let current = document["revision"].as_u64().unwrap_or(0);
    let plan = repair::plan(&document, Options { close_pending: true }).map_err(|error| {
        tracing::error!(%error, conversation = %store_id, "stored history unreadable for a repair");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::StoredHistoryUnreadable,
            "the stored history cannot be read",
        )
    })?;
    let plan_json = serde_json::to_value(&plan).unwrap_or(Value::Null);
    if let Some(expected) = body.expected_revision
        && expected != current
    {
        return Err(conflict(current, expected));
    }
    if body.dry_run || plan.is_empty() {
        return Ok(Json(json!({"plan": plan_json, "applied": false, "revision": current})).into_response());
    }
    // The plan was made for this document: applying it cannot fail.
    let repaired = repair::apply(&plan, &document).unwrap_or(Value::Null);
    let Some(turn) = appended_turn(&plan, &repaired) else {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::Rejected,
            "the repair would change committed turns or leaves violations: a person decides",
        )
        .with(json!({"violations": api::violations_json(&plan.needs_person), "plan": plan_json})));
    };
    let record = NewRepair {
        plan_digest: plan.digest.as_str().to_owned(),
        plan: plan_json.clone(),
        tenant: caller.tenant().map(str::to_owned),
        actor: body.actor,
    };
    let expected = Revision(current);
    match shared
        .ledger
        .append_repair(&store_id, expected, &turn, &record, now())
        .await
        .map_err(ApiError::store)?
    {
        AppendOutcome::Appended { revision } => {
            shared.feed.conversation(&store_id, revision.0);
            metrics::history_repairs(&plan, ROUTE_NATIVE);
            Ok(Json(json!({"plan": plan_json, "applied": true, "revision": revision.0})).into_response())
        }
        AppendOutcome::Conflict { current } => Err(conflict(current.0, expected.0)),
        AppendOutcome::Rejected(violations) => {
            // A plan computed from the revision just read passes the validator; a refusal is
            // a bug of ours, said as the store's violations.
            tracing::error!(conversation = %store_id, ?violations, "a repair plan's turn was refused");
            Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::Rejected,
                "the repaired turn would make the history illegal",
            )
            .with(json!({"violations": api::violations_json(&violations), "plan": plan_json})))
        }
        AppendOutcome::NotFound => Err(ApiError::not_found("conversation")),
    }
}

fn conflict(current: u64, expected: u64) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        ErrorCode::RevisionConflict,
        format!("the conversation is at revision {current}, not {expected}"),
    )
    .with(json!({"current_revision": current}))
}

/// The conversation document with its repair records under `repairs`, oldest first; the
/// document as it is when there are none (the v1 document of every unrepaired conversation is
/// unchanged).
pub async fn with_repairs(shared: &Shared, store_id: &str, mut document: Value) -> Result<Value, ApiError> {
    let records = shared.ledger.repairs(store_id).await.map_err(ApiError::store)?;
    if records.is_empty() {
        return Ok(document);
    }
    let records: Vec<Value> = records
        .into_iter()
        .map(|record| {
            json!({
                "revision": record.revision.0,
                "plan_digest": record.plan_digest,
                "tenant": record.tenant,
                "actor": record.actor,
                "repaired_at": record.repaired_at.0,
                "plan": record.plan,
            })
        })
        .collect();
    document["repairs"] = Value::Array(records);
    Ok(document)
}

/// A proxy route's repair (`repair_history`): the imported request with its history repaired,
/// and the plan, when there is something to repair. A plan that cannot make the history legal
/// is not applied (the request is refused as it stands, the plan shown with the refusal); the
/// plan comes back so the caller can tell (`RepairPlan::is_complete`).
pub fn repair_imported(
    imported: Result<Imported, ImportError>,
) -> (Result<Imported, ImportError>, Option<RepairPlan>) {
    let Ok(mut imported) = imported else {
        return (imported, None);
    };
    // A document that is not v1 at all is the importer's bug; `admit` reports it as it is.
    let Ok(plan) = repair::plan(&imported.document, Options { close_pending: true }) else {
        return (Ok(imported), None);
    };
    if plan.is_empty() {
        return (Ok(imported), None);
    }
    if plan.is_complete()
        && let Ok(repaired) = repair::apply(&plan, &imported.document)
    {
        imported.document = repaired;
    }
    (Ok(imported), Some(plan))
}

/// The value of [`REPAIRED_HEADER`] for an applied plan.
pub fn header_value(plan: &RepairPlan) -> String {
    let counts: Vec<String> = plan
        .counts()
        .into_iter()
        .map(|(cause, count)| format!("{}={count}", cause.as_str()))
        .collect();
    format!("plan={}; {}", plan.digest, counts.join(","))
}
