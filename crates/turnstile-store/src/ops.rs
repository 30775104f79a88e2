//! Every ledger operation, written once against [`Tx`] for both databases.
//!
//! Correctness comes only from conditional writes: each state change is an `UPDATE … WHERE`
//! whose condition is the invariant (revision, cancel generation, active generation, state),
//! or an `INSERT … ON CONFLICT DO NOTHING`, and the affected-row count decides who won. Reads
//! before a write only pick the statement to run or explain a refusal; they never decide a
//! winner. Rows are locked in one order everywhere (conversation → dispatch → attempt →
//! tool call) so PostgreSQL never deadlocks two of these transactions.
//!
//! Where things are. The acceptance point is `prepare_and_begin` (`prepare_beginning`: a fresh
//! dispatch inserted DISPATCHING with its attempt and both history rows); `import_and_prepare` is a
//! fresh proxy conversation's import in that same write, its history validated before the
//! transaction by `history::check_import`. A checked prepare's checks and its JSON are
//! `prepare_rows`, worked out before the transaction; a sealed target (`types.rs::SealedTarget`,
//! vouched for by the render that computed its digests) is moved in and not hashed again
//! (`Checks::Sealed`: only the bounds). A dispatch's exact request bytes live in `dispatch_bodies`
//! (migration 8) with its manifest and render policy (migration 9), written once. The commit
//! carries the held SENT, STREAMING and handle (`types.rs::Carried`) and moves the dispatch and its
//! attempt rows once (`carry_to_committed`). The state indexes are partial and hold only live
//! attempts and PREPARED dispatches (migrations 10 and 11; the sweeps' SQL is `sweeps`,
//! `LIVE_ATTEMPTS`). `conversation_since` gives a reader holding revision R the turns after it. The
//! tool-call ledger for executors: `claim_call`, `renew_call`, `release_call`, `hand_to_client`,
//! `abandon_client_calls`, `submit_tool_result`, `tool_call_idempotency_key`; `listed_state_sql`
//! and `pending_sql` read the states by the store's clock; the states and their diagram are on
//! `types.rs::ToolCallState`.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a prepare is checked before its transaction (a checked one: every body's and manifest's
//!   digest; a sealed one: its bounds, row below); an invalid one writes nothing, a valid one
//!   stores its bodies exactly in one write. Enforced in `store/src/ops.rs::prepare_rows` (called
//!   before the transaction on both backends; on SQLite from `sqlite.rs::PrepareInputs::checked`,
//!   large bodies on the blocking pool). Tests:
//!   `store/tests/it/conformance.rs::a_large_body_is_checked_off_the_writer_and_stored_exactly`
//!   (SQLite and PostgreSQL, 3 MiB bodies with a failover target, `write_ops` 0 then 1; red with a
//!   byte dropped on the blocking-pool path; where the check runs is the code's structure, not
//!   observed by the test),
//!   `prepare_refuses_bytes_that_do_not_match_the_manifest_and_stale_revisions`.
//! - late or foreign blocks only in quarantine. Enforced in `assemble.rs`, `dispatch.rs`,
//!   `ops.rs::commit`. Tests: `core/tests/it/assemble.rs`, `store` conformance, `serve.rs`.
//! - the render policy a manifest pins is kept and shown with its dispatch, and hashes to
//!   `policy_digest`. Enforced in `store/src/ops.rs::prepare` (refuses a policy that does not
//!   hash), `api.rs::prepare_dispatch`, `get_dispatch`. Tests:
//!   `store/tests/it/conformance.rs::the_render_policy_is_kept_with_its_dispatch…`,
//!   `serve.rs::the_dispatch_view_shows_the_render_policy…`.
//! - every claim of one call carries the same idempotency key. Enforced in
//!   `ops.rs::tool_call_idempotency_key`. Tests: `tool_ledger.rs::claims_racing_on_two_replicas…`,
//!   `…an_expired_call_is_listed…`, `executor.rs::an_executor_that_dies_mid_call…`.

use crate::error::StoreError;
use crate::history::{self, Checked, NewToolCall, States};
use crate::sql::{Dialect, Row, SqlValue, Tx};
use crate::types::*;
use serde_json::Value;
use turnstile_core::dispatch::{DispatchState, Timestamp};
use turnstile_core::manifest::DispatchManifest;
use turnstile_core::{Digest, Generation, Revision};

fn ts(at: Timestamp) -> SqlValue {
    SqlValue::from(at.0)
}

fn state_of(text: &str) -> Result<DispatchState, StoreError> {
    DispatchState::parse(text).ok_or_else(|| StoreError::Corrupt(format!("unknown state {text:?}")))
}

fn json_of(text: &str) -> Result<Value, StoreError> {
    serde_json::from_str(text).map_err(|error| StoreError::Corrupt(format!("stored JSON: {error}")))
}

/// The idempotency key of an attempt: stable for (operation, generation), so a replay of the
/// same generation sends the same key, and free of client text.
pub fn idempotency_key(operation_id: &str, generation: Generation) -> String {
    let digest = Digest::of_bytes(format!("{operation_id}\n{}", generation.0).as_bytes());
    let hex = digest.as_str().trim_start_matches("sha256:");
    format!("ts-{}", &hex[..32])
}

/// [`crate::Ledger::write_probe`]: one row written, nothing changed that anyone reads.
pub async fn write_probe<T: Tx>(tx: &mut T) -> Result<(), StoreError> {
    tx.execute(
        "UPDATE schema_migrations SET applied_at = applied_at \
         WHERE version = (SELECT MAX(version) FROM schema_migrations)",
        &[],
    )
    .await?;
    Ok(())
}

async fn bump_counter<T: Tx>(tx: &mut T, name: &str) -> Result<(), StoreError> {
    tx.execute(
        "UPDATE counters SET value = value + 1 WHERE name = $1",
        &[name.into()],
    )
    .await?;
    Ok(())
}

async fn record_transition<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Option<Generation>,
    from: Option<DispatchState>,
    to: DispatchState,
    now: Timestamp,
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO transitions (operation_id, generation, from_state, to_state, at) \
         VALUES ($1, $2, $3, $4, $5)",
        &[
            operation_id.into(),
            generation.map(|generation| generation.0).into(),
            from.map(DispatchState::as_str).into(),
            to.as_str().into(),
            ts(now),
        ],
    )
    .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Conversations and turns

pub(crate) async fn create_conversation<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    tools: &Value,
    now: Timestamp,
) -> Result<CreateOutcome, StoreError> {
    let inserted = tx
        .execute(
            "INSERT INTO conversations (conversation_id, revision, tools, created_at, updated_at) \
             VALUES ($1, 0, $2, $3, $3) ON CONFLICT (conversation_id) DO NOTHING",
            &[conversation_id.into(), tools.to_string().into(), ts(now)],
        )
        .await?;
    Ok(if inserted == 1 {
        CreateOutcome::Created
    } else {
        CreateOutcome::AlreadyExists
    })
}

/// Create a conversation together with its whole history (the proxy's stateless import),
/// already stamped and validated as one document by [`history::check_import`] on the caller:
/// this writes only. `ready` and `waiting` histories are accepted. Imported tool calls never
/// enter the execution ledger: whoever sent the history ran them already.
pub(crate) async fn import_conversation<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    tools: &Value,
    checked: &history::CheckedImport,
    now: Timestamp,
) -> Result<ImportOutcome, StoreError> {
    let revision = checked.revision;
    let inserted = tx
        .execute(
            "INSERT INTO conversations (conversation_id, revision, tools, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $4) ON CONFLICT (conversation_id) DO NOTHING",
            &[
                conversation_id.into(),
                revision.0.into(),
                tools.to_string().into(),
                ts(now),
            ],
        )
        .await?;
    if inserted != 1 {
        let current = conversation_revision(tx, conversation_id, false)
            .await?
            .unwrap_or(Revision(0));
        return Ok(ImportOutcome::AlreadyExists { revision: current });
    }
    for turn in &checked.turns {
        insert_row(tx, conversation_id, turn, None, now).await?;
    }
    Ok(ImportOutcome::Created { revision })
}

/// [`import_conversation`], then, in the same transaction, [`prepare_and_begin`] (or, without
/// `begin`, [`prepare_targets`]) of the conversation's first dispatch: a fresh proxy request's
/// import, prepare and acceptance point are one durable write. All or nothing: nothing is
/// prepared when the import does not create the conversation, and nothing is imported when
/// the prepare would be refused (a manifest of another conversation or revision, an operation
/// id that is taken: checked before the import). A prepare refused after the import all the
/// same (another replica took the operation id in between) is an error that rolls the
/// transaction back.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn import_and_prepare<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    tools: &Value,
    checked: &history::CheckedImport,
    manifest: &DispatchManifest,
    request_bytes: &[u8],
    fallbacks: &[PreparedTarget],
    rows: PrepareRows,
    begin: Option<&BeginAtOnce>,
    now: Timestamp,
) -> Result<ImportPrepared, StoreError> {
    if manifest.body.conversation_id != conversation_id {
        return Ok(ImportPrepared::NotPrepared(PrepareOutcome::NotFound));
    }
    if manifest.body.conversation_revision != checked.revision {
        return Ok(ImportPrepared::NotPrepared(PrepareOutcome::StaleRevision {
            current: checked.revision,
        }));
    }
    if let Some(existing) = dispatch(tx, &manifest.body.operation_id).await? {
        // A stored conversation of this id answers first, as the import would.
        if let Some(current) = conversation_revision(tx, conversation_id, false).await? {
            return Ok(ImportPrepared::NotImported(ImportOutcome::AlreadyExists {
                revision: current,
            }));
        }
        let stored = fallback_digests_of(tx, &manifest.body.operation_id).await?;
        let fallback_digests: Vec<&str> = fallbacks
            .iter()
            .map(|fallback| fallback.manifest.manifest_digest.as_str())
            .collect();
        return Ok(ImportPrepared::NotPrepared(same_or_conflict(
            existing,
            manifest.manifest_digest.as_str(),
            &stored,
            &fallback_digests,
        )));
    }
    let revision = match import_conversation(tx, conversation_id, tools, checked, now).await? {
        ImportOutcome::Created { revision } => revision,
        refused => return Ok(ImportPrepared::NotImported(refused)),
    };
    let (prepared, began) = match begin {
        Some(begin) => prepare_and_begin(tx, manifest, request_bytes, fallbacks, rows, begin, now).await?,
        None => (
            prepare_targets(tx, manifest, request_bytes, fallbacks, rows, now).await?,
            None,
        ),
    };
    if !matches!(prepared, PrepareOutcome::Created(_)) {
        return Err(StoreError::CommitFailed(format!(
            "the first prepare of imported conversation {conversation_id} was refused inside its \
             transaction ({prepared:?}); neither was written"
        )));
    }
    Ok(ImportPrepared::Prepared {
        revision,
        prepared,
        began,
    })
}

/// Conversations whose ids start with `id_prefix` and that committed a call with this id (the
/// proxy's continuation lookup; call ids are unique within a conversation, not across).
pub(crate) async fn conversations_with_call<T: Tx>(
    tx: &mut T,
    call_id: &str,
    id_prefix: &str,
) -> Result<Vec<String>, StoreError> {
    let rows = tx
        .query(
            "SELECT conversation_id FROM tool_calls WHERE call_id = $1 ORDER BY conversation_id",
            &[call_id.into()],
        )
        .await?;
    let mut found = Vec::new();
    for row in &rows {
        let id = row.text(0)?;
        if id.starts_with(id_prefix) {
            found.push(id);
        }
    }
    Ok(found)
}

/// A conversation's revision and tools (the reads that need the tools: the whole document and
/// a walk of the history; every check of a head alone is [`conversation_revision`]).
async fn conversation_head<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
) -> Result<Option<(Revision, Value)>, StoreError> {
    let rows = tx
        .query(
            "SELECT revision, tools FROM conversations WHERE conversation_id = $1",
            &[conversation_id.into()],
        )
        .await?;
    match rows.first() {
        None => Ok(None),
        Some(row) => Ok(Some((Revision(row.uint(0)?), json_of(&row.text(1)?)?))),
    }
}

/// A conversation's revision only, without reading and parsing its tools (which only a check
/// that must walk the history needs); with `share_lock`, held shared on PostgreSQL until the
/// transaction ends.
async fn conversation_revision<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    share_lock: bool,
) -> Result<Option<Revision>, StoreError> {
    let sql = if share_lock && tx.dialect() == Dialect::Postgres {
        "SELECT revision FROM conversations WHERE conversation_id = $1 FOR SHARE"
    } else {
        "SELECT revision FROM conversations WHERE conversation_id = $1"
    };
    let rows = tx.query(sql, &[conversation_id.into()]).await?;
    rows.first().map(|row| Ok(Revision(row.uint(0)?))).transpose()
}

async fn turns_up_to<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    revision: Revision,
) -> Result<Vec<Value>, StoreError> {
    let rows = tx
        .query(
            "SELECT turn FROM turns WHERE conversation_id = $1 AND revision <= $2 ORDER BY revision",
            &[conversation_id.into(), revision.0.into()],
        )
        .await?;
    rows.iter().map(|row| json_of(&row.text(0)?)).collect()
}

/// [`turns_up_to`] with the digest stored beside each turn.
async fn turns_and_digests_up_to<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    revision: Revision,
) -> Result<(Vec<Value>, Vec<Option<String>>), StoreError> {
    let rows = tx
        .query(
            "SELECT turn, digest FROM turns WHERE conversation_id = $1 AND revision <= $2 ORDER BY revision",
            &[conversation_id.into(), revision.0.into()],
        )
        .await?;
    let mut turns = Vec::with_capacity(rows.len());
    let mut digests = Vec::with_capacity(rows.len());
    for row in &rows {
        turns.push(json_of(&row.text(0)?)?);
        digests.push(row.text_opt(1)?);
    }
    Ok((turns, digests))
}

pub(crate) async fn conversation_with_digests<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
) -> Result<Option<StoredConversation>, StoreError> {
    let Some((revision, tools)) = conversation_head(tx, conversation_id).await? else {
        return Ok(None);
    };
    let (turns, turn_digests) = turns_and_digests_up_to(tx, conversation_id, revision).await?;
    Ok(Some(StoredConversation {
        document: serde_json::json!({
            "format": turnstile_core::conversation::FORMAT_V1,
            "conversation_id": conversation_id,
            "revision": revision.0,
            "tools": tools,
            "turns": turns,
        }),
        turn_digests,
    }))
}

pub(crate) async fn conversation<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
) -> Result<Option<Value>, StoreError> {
    let Some((revision, tools)) = conversation_head(tx, conversation_id).await? else {
        return Ok(None);
    };
    let turns = turns_up_to(tx, conversation_id, revision).await?;
    Ok(Some(serde_json::json!({
        "format": turnstile_core::conversation::FORMAT_V1,
        "conversation_id": conversation_id,
        "revision": revision.0,
        "tools": tools,
        "turns": turns,
    })))
}

pub(crate) async fn conversation_since<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    after: Revision,
) -> Result<Option<ConversationTail>, StoreError> {
    let Some(revision) = conversation_revision(tx, conversation_id, false).await? else {
        return Ok(None);
    };
    // The turn at `after` too (its id checks the reader's history), then the ones after it.
    let rows = tx
        .query(
            "SELECT revision, turn, digest FROM turns WHERE conversation_id = $1 AND revision >= $2 \
             AND revision <= $3 ORDER BY revision",
            &[conversation_id.into(), after.0.into(), revision.0.into()],
        )
        .await?;
    let mut turn_id_at = None;
    let mut turns = Vec::with_capacity(rows.len());
    let mut turn_digests = Vec::with_capacity(rows.len());
    for row in &rows {
        let turn = json_of(&row.text(1)?)?;
        if row.uint(0)? == after.0 {
            turn_id_at = turn.get("id").and_then(Value::as_str).map(str::to_owned);
        } else {
            turns.push(turn);
            turn_digests.push(row.text_opt(2)?);
        }
    }
    Ok(Some(ConversationTail {
        revision,
        turn_id_at,
        turns,
        turn_digests,
    }))
}

/// Claim revision `expected + 1` (the conditional write), then insert the turn.
async fn claim_revision<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    expected: Revision,
    now: Timestamp,
) -> Result<bool, StoreError> {
    let claimed = tx
        .execute(
            "UPDATE conversations SET revision = revision + 1, updated_at = $3 \
             WHERE conversation_id = $1 AND revision = $2",
            &[conversation_id.into(), expected.0.into(), ts(now)],
        )
        .await?;
    Ok(claimed == 1)
}

#[allow(clippy::too_many_arguments)]
async fn insert_turn<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    revision: Revision,
    turn: &Value,
    generation: Option<Generation>,
    operation_id: Option<&str>,
    digest: Digest,
    now: Timestamp,
) -> Result<(), StoreError> {
    let mut row = history::StampedTurn::of(turn, revision, digest);
    row.generation = generation.map(|generation| generation.0);
    insert_row(tx, conversation_id, &row, operation_id, now).await
}

/// Insert a turn's row as [`history::StampedTurn`] holds it.
async fn insert_row<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    row: &history::StampedTurn,
    operation_id: Option<&str>,
    now: Timestamp,
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO turns (conversation_id, revision, role, generation, operation_id, turn, committed_at, digest) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        &[
            conversation_id.into(),
            row.revision.0.into(),
            row.role.as_str().into(),
            row.generation.into(),
            operation_id.into(),
            row.text.as_str().into(),
            ts(now),
            row.digest.as_str().into(),
        ],
    )
    .await?;
    Ok(())
}

/// The would-be history check of a turn appended at `revision` after `expected`: only the new
/// turn when the validator's state after `expected` is kept, else the whole history read and
/// walked once. On success the turn's calls and the state after it.
async fn check_turn<T: Tx>(
    tx: &mut T,
    states: &States<'_>,
    conversation_id: &str,
    expected: Revision,
    stamped: Value,
    revision: Revision,
) -> Result<Result<history::CheckedTurn, Vec<turnstile_core::Violation>>, StoreError> {
    Ok(match states.take(conversation_id, expected)? {
        Some(state) => history::check_next(state, stamped),
        None => {
            // Only a walk of the whole history needs the tools (a kept state has them). Every
            // caller found the conversation in this transaction, and no write deletes one.
            let Some((_, tools)) = conversation_head(tx, conversation_id).await? else {
                return Err(StoreError::Corrupt(format!(
                    "conversation {conversation_id} vanished inside its transaction"
                )));
            };
            let history = turns_up_to(tx, conversation_id, expected).await?;
            history::check_append_state(conversation_id, &tools, history, stamped, revision)
        }
    })
}

/// A conversation's tools and its turns up to `revision` (the history a check walks when it
/// finds no validator state), read outside the write transaction: `None` when there is no such
/// conversation or its head is not at `revision`.
pub(crate) async fn history_at<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    revision: Revision,
) -> Result<Option<(Value, Vec<Value>)>, StoreError> {
    let Some((current, tools)) = conversation_head(tx, conversation_id).await? else {
        return Ok(None);
    };
    // Only the head's state is worth keeping: a check at an older revision is refused anyway
    // (the conversation moved), and its state must not replace a newer one.
    if current != revision {
        return Ok(None);
    }
    Ok(Some((tools, turns_up_to(tx, conversation_id, revision).await?)))
}

/// Append a turn at `expected + 1` (see [`check_turn`] for `states`; `next` is set to the state
/// after it on success).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn append_turn<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    expected: Revision,
    turn: &Value,
    states: &States<'_>,
    next: &mut Option<Checked>,
    now: Timestamp,
) -> Result<AppendOutcome, StoreError> {
    let Some(current) = conversation_revision(tx, conversation_id, false).await? else {
        return Ok(AppendOutcome::NotFound);
    };
    if current != expected {
        return Ok(AppendOutcome::Conflict { current });
    }
    let revision = Revision(expected.0 + 1);
    let Some(stamped) = history::stamp_turn(turn, revision, None) else {
        return Ok(AppendOutcome::Rejected(vec![turnstile_core::Violation {
            code: turnstile_core::ViolationCode::InvalidStructure,
            turn: None,
            block: None,
            call_id: None,
            message: "a turn must be an object".into(),
        }]));
    };
    let checked = match check_turn(tx, states, conversation_id, expected, stamped.clone(), revision).await? {
        Ok(checked) => checked,
        Err(violations) => return Ok(AppendOutcome::Rejected(violations)),
    };
    if !claim_revision(tx, conversation_id, expected, now).await? {
        let current = conversation_revision(tx, conversation_id, false)
            .await?
            .unwrap_or(expected);
        return Ok(AppendOutcome::Conflict { current });
    }
    let generation = stamped.get("generation").and_then(Value::as_u64).map(Generation);
    insert_turn(
        tx,
        conversation_id,
        revision,
        &stamped,
        generation,
        None,
        checked.digest,
        now,
    )
    .await?;
    // Results appended as an ordinary tool turn close their calls in the execution ledger too
    // (the validator has just checked that each answers an open call exactly once).
    if stamped.get("role").and_then(Value::as_str) == Some("tool") {
        for block in stamped
            .get("blocks")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(call_id) = block.get("call_id").and_then(Value::as_str) {
                tx.execute(
                    "UPDATE tool_calls SET state = 'done', result_revision = $3 \
                     WHERE conversation_id = $1 AND call_id = $2 AND state <> 'done'",
                    &[conversation_id.into(), call_id.into(), revision.0.into()],
                )
                .await?;
            }
        }
    }
    *next = Some(Checked {
        conversation_id: conversation_id.to_owned(),
        revision,
        history: checked.history,
    });
    Ok(AppendOutcome::Appended { revision })
}

/// [`append_turn`] of a repaired history's turn, and in the same transaction the durable record
/// of the repair, keyed by the revision the turn makes: the repair and its record land
/// together or not at all.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn append_repair<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    expected: Revision,
    turn: &Value,
    repair: &NewRepair,
    states: &States<'_>,
    next: &mut Option<Checked>,
    now: Timestamp,
) -> Result<AppendOutcome, StoreError> {
    let outcome = append_turn(tx, conversation_id, expected, turn, states, next, now).await?;
    if let AppendOutcome::Appended { revision } = &outcome {
        tx.execute(
            "INSERT INTO history_repairs (conversation_id, revision, plan_digest, plan, tenant, actor, repaired_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
            &[
                conversation_id.into(),
                revision.0.into(),
                repair.plan_digest.as_str().into(),
                repair.plan.to_string().into(),
                repair.tenant.clone().into(),
                repair.actor.clone().into(),
                ts(now),
            ],
        )
        .await?;
    }
    Ok(outcome)
}

/// The repairs recorded for a conversation, oldest first.
pub(crate) async fn repairs<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
) -> Result<Vec<RepairRecord>, StoreError> {
    let rows = tx
        .query(
            "SELECT revision, plan_digest, plan, tenant, actor, repaired_at FROM history_repairs \
             WHERE conversation_id = $1 ORDER BY revision",
            &[conversation_id.into()],
        )
        .await?;
    rows.iter()
        .map(|row| {
            Ok(RepairRecord {
                revision: Revision(row.uint(0)?),
                plan_digest: row.text(1)?,
                plan: json_of(&row.text(2)?)?,
                tenant: row.text_opt(3)?,
                actor: row.text_opt(4)?,
                repaired_at: Timestamp(row.uint(5)?),
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Dispatches

/// The term of the partial index `attempts_live` (migration 11): attempts that are not over.
/// A query that sweeps live attempts repeats it word for word, so SQLite's planner (which
/// proves a partial index usable only from a term it finds in the query) reads the index.
/// Equalities rather than an `IN` list: SQLite checks the term on every insert and update of
/// an attempt, and codes an `IN` list of more than two constants with a temporary B-tree.
pub(crate) const LIVE_ATTEMPTS: &str =
    "(state = 'DISPATCHING' OR state = 'SENT' OR state = 'STREAMING' OR state = 'UNKNOWN')";

/// A dispatch with its manifest and request bytes (kept in `dispatch_bodies`, migrations 8
/// and 9).
const DISPATCH_COLUMNS: &str = "d.operation_id, d.conversation_id, d.revision, b.manifest, d.manifest_digest, \
     d.request_digest, b.request_bytes, d.provider, d.state, d.cancel_generation, d.active_generation, \
     d.committed_revision, d.outcome";

fn dispatch_from_row(row: &Row) -> Result<DispatchRecord, StoreError> {
    Ok(DispatchRecord {
        operation_id: row.text(0)?,
        conversation_id: row.text(1)?,
        revision: Revision(row.uint(2)?),
        manifest: json_of(&row.text(3)?)?,
        manifest_digest: row.text(4)?,
        request_digest: row.text(5)?,
        // NULL (no `dispatch_bodies` row) is `Corrupt`, as any wrong column type is.
        request_bytes: row.bytes(6)?,
        provider: row.text(7)?,
        state: state_of(&row.text(8)?)?,
        cancel_generation: row.uint(9)?,
        active_generation: row.uint_opt(10)?.map(Generation),
        committed_revision: row.uint_opt(11)?.map(Revision),
        outcome: row.text_opt(12)?.map(|text| json_of(&text)).transpose()?,
    })
}

pub(crate) async fn dispatch<T: Tx>(
    tx: &mut T,
    operation_id: &str,
) -> Result<Option<DispatchRecord>, StoreError> {
    // A dispatch without its body is a corrupt store, never "no such dispatch" (which would
    // let a retry of its operation id look for a dispatch that is not there).
    let sql = format!(
        "SELECT {DISPATCH_COLUMNS} FROM dispatches d LEFT JOIN dispatch_bodies b ON b.operation_id = d.operation_id \
         WHERE d.operation_id = $1"
    );
    let rows = tx.query(&sql, &[operation_id.into()]).await?;
    rows.first().map(dispatch_from_row).transpose()
}

/// The small columns of a dispatch (no manifest, no request bytes): what the hot operations
/// read to pick their statement.
struct DispatchHead {
    conversation_id: String,
    revision: Revision,
    manifest_digest: String,
    request_digest: String,
    provider: String,
    state: DispatchState,
    active_generation: Option<Generation>,
    committed_revision: Option<Revision>,
}

async fn dispatch_head<T: Tx>(tx: &mut T, operation_id: &str) -> Result<Option<DispatchHead>, StoreError> {
    let rows = tx
        .query(
            "SELECT conversation_id, revision, manifest_digest, request_digest, provider, state, \
             active_generation, committed_revision FROM dispatches WHERE operation_id = $1",
            &[operation_id.into()],
        )
        .await?;
    let Some(row) = rows.first() else {
        return Ok(None);
    };
    Ok(Some(DispatchHead {
        conversation_id: row.text(0)?,
        revision: Revision(row.uint(1)?),
        manifest_digest: row.text(2)?,
        request_digest: row.text(3)?,
        provider: row.text(4)?,
        state: state_of(&row.text(5)?)?,
        active_generation: row.uint_opt(6)?.map(Generation),
        committed_revision: row.uint_opt(7)?.map(Revision),
    }))
}

/// State and active generation of a dispatch (to explain a refusal; never to decide one).
async fn dispatch_state<T: Tx>(
    tx: &mut T,
    operation_id: &str,
) -> Result<Option<(DispatchState, Option<Generation>)>, StoreError> {
    let rows = tx
        .query(
            "SELECT state, active_generation FROM dispatches WHERE operation_id = $1",
            &[operation_id.into()],
        )
        .await?;
    match rows.first() {
        None => Ok(None),
        Some(row) => Ok(Some((state_of(&row.text(0)?)?, row.uint_opt(1)?.map(Generation)))),
    }
}

/// Why one target's manifest, bytes and policy cannot be stored (None: they can): its bounds,
/// then (the bounds first, so an oversized body is refused without hashing all of it) its
/// digests.
pub(crate) fn target_invalid(
    manifest: &DispatchManifest,
    request_bytes: &[u8],
    policy: Option<&Value>,
) -> Option<&'static str> {
    bounds_invalid(manifest, request_bytes).or_else(|| digests_mismatch(manifest, request_bytes, policy))
}

/// Which of a target's digests does not match what it names (None: all three do), hashing
/// all of them whatever their size: [`target_invalid`]'s second half, and the check behind
/// [`crate::SealedTarget::vouched`] in debug builds.
pub(crate) fn digests_mismatch(
    manifest: &DispatchManifest,
    request_bytes: &[u8],
    policy: Option<&Value>,
) -> Option<&'static str> {
    if !manifest.is_intact() {
        return Some("manifest_digest does not match the manifest");
    }
    if let Some(policy) = policy
        && Digest::of_value(policy) != manifest.body.policy_digest
    {
        return Some("the policy does not match policy_digest");
    }
    if Digest::of_bytes(request_bytes) != manifest.body.request_digest {
        return Some("request bytes do not match request_digest");
    }
    None
}

/// [`target_invalid`] less what hashes: all a [`crate::SealedTarget`], whose digests are
/// known to match, is checked for.
fn bounds_invalid(manifest: &DispatchManifest, request_bytes: &[u8]) -> Option<&'static str> {
    // The digest would not pin a number above 2^53 (no real count or revision comes near it).
    if !manifest.body.numbers_exact() {
        return Some("a manifest integer is above 2^53, where its digest cannot pin it");
    }
    if request_bytes.len() > REQUEST_BYTES_MAX {
        return Some("request bytes exceed REQUEST_BYTES_MAX");
    }
    None
}

/// How a prepare's targets are checked before anything is stored ([`prepare_rows`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Checks {
    /// Every digest hashed and compared ([`target_invalid`]): targets from elsewhere.
    Hash,
    /// [`crate::SealedTarget`]s: their digests match; only the bounds are checked.
    Sealed,
}

/// What a prepare stores besides the caller's bytes, worked out before its transaction: every
/// check that needs no store (the digests of the manifests, bodies and policies unless the
/// targets are sealed; the bounds; the targets' agreement) and the serialised JSON. Pure, so
/// the SQLite ledger computes it before it queues the SQL for its writer
/// (`sqlite.rs::PrepareInputs::checked`, `::sealed`).
pub(crate) struct PrepareRows {
    /// The manifest the rows are for (checked again by [`prepare_targets`]).
    manifest_digest: String,
    manifest_json: String,
    manifest_value: Value,
    policy_json: Option<String>,
    /// Each fallback's manifest and policy, serialised, in order.
    fallbacks: Vec<(String, Option<String>)>,
}

/// Check a prepare's inputs and serialise what it stores (every backend calls this before its
/// transaction; [`prepare_targets`] and [`prepare_and_begin`] take the rows). The inner `Err`
/// is why the prepare is [`PrepareOutcome::Invalid`].
pub(crate) fn prepare_rows(
    manifest: &DispatchManifest,
    request_bytes: &[u8],
    policy: Option<&Value>,
    fallbacks: &[PreparedTarget],
    checks: Checks,
) -> Result<Result<PrepareRows, &'static str>, StoreError> {
    let invalid = |why| Ok(Err(why));
    let one_invalid = |manifest: &DispatchManifest, request_bytes: &[u8], policy: Option<&Value>| match checks
    {
        Checks::Hash => target_invalid(manifest, request_bytes, policy),
        Checks::Sealed => bounds_invalid(manifest, request_bytes),
    };
    if fallbacks.len() + 1 > TARGETS_PER_DISPATCH_MAX {
        return invalid("more targets than TARGETS_PER_DISPATCH_MAX");
    }
    for fallback in fallbacks {
        if let Some(why) = one_invalid(
            &fallback.manifest,
            &fallback.request_bytes,
            fallback.policy.as_ref(),
        ) {
            return invalid(why);
        }
        let (a, b) = (&manifest.body, &fallback.manifest.body);
        if a.operation_id != b.operation_id
            || a.conversation_id != b.conversation_id
            || a.conversation_revision != b.conversation_revision
            || a.sequence_digest != b.sequence_digest
        {
            return invalid(
                "a failover target's manifest is for another operation, conversation, revision or sequence",
            );
        }
    }
    if let Some(why) = one_invalid(manifest, request_bytes, policy) {
        return invalid(why);
    }
    let serialised = |manifest: &DispatchManifest| {
        serde_json::to_string(manifest)
            .map_err(|error| StoreError::Corrupt(format!("manifest does not serialise: {error}")))
    };
    let manifest_json = serialised(manifest)?;
    // The record's copy is built from the struct, not parsed back from the text just written.
    let manifest_value = serde_json::to_value(manifest)
        .map_err(|error| StoreError::Corrupt(format!("manifest does not serialise: {error}")))?;
    let fallbacks = fallbacks
        .iter()
        .map(|fallback| {
            Ok((
                serialised(&fallback.manifest)?,
                fallback.policy.as_ref().map(Value::to_string),
            ))
        })
        .collect::<Result<_, StoreError>>()?;
    Ok(Ok(PrepareRows {
        manifest_digest: manifest.manifest_digest.as_str().to_owned(),
        manifest_json,
        manifest_value,
        policy_json: policy.map(Value::to_string),
        fallbacks,
    }))
}

/// Store a new dispatch from its checked [`PrepareRows`] (only the SQL), or answer the one
/// already stored under its operation id.
pub(crate) async fn prepare_targets<T: Tx>(
    tx: &mut T,
    manifest: &DispatchManifest,
    request_bytes: &[u8],
    fallbacks: &[PreparedTarget],
    rows: PrepareRows,
    now: Timestamp,
) -> Result<PrepareOutcome, StoreError> {
    Ok(
        prepare_beginning(tx, manifest, request_bytes, fallbacks, rows, None, now)
            .await?
            .0,
    )
}

/// [`prepare_targets`], and with `begin`, for a dispatch it creates, its first attempt begun
/// in the same statements: the dispatch row is inserted DISPATCHING at generation 1 with its
/// attempt row and both history rows (PREPARED, then DISPATCHING) in one insert, which is what
/// a PREPARED insert followed by [`begin_attempt`] writes, less the row states nobody could
/// read inside the transaction (a PREPARED row and its entry in the unattended-prepare index)
/// and the reads of rows this transaction just wrote. The conversation row is read under a
/// share lock first (PostgreSQL), the lock `begin_attempt` takes, so its revision cannot move
/// before the commit. A `begin.target` the dispatch has no target for stores the dispatch
/// PREPARED and refuses the begin, as `begin_attempt` would.
async fn prepare_beginning<T: Tx>(
    tx: &mut T,
    manifest: &DispatchManifest,
    request_bytes: &[u8],
    fallbacks: &[PreparedTarget],
    rows: PrepareRows,
    begin: Option<&BeginAtOnce>,
    now: Timestamp,
) -> Result<(PrepareOutcome, Option<BeginOutcome>), StoreError> {
    if rows.manifest_digest != manifest.manifest_digest.as_str() || rows.fallbacks.len() != fallbacks.len() {
        return Err(StoreError::Corrupt(
            "a prepare's rows are for other targets".into(),
        ));
    }
    let fallback_digests: Vec<&str> = fallbacks
        .iter()
        .map(|fallback| fallback.manifest.manifest_digest.as_str())
        .collect();
    let PrepareRows {
        manifest_digest: _,
        manifest_json,
        manifest_value,
        policy_json,
        fallbacks: fallback_rows,
    } = rows;
    let operation_id = manifest.body.operation_id.as_str();
    let manifest_digest = manifest.manifest_digest.as_str();
    if let Some(existing) = dispatch(tx, operation_id).await? {
        let stored = fallback_digests_of(tx, operation_id).await?;
        return Ok((
            same_or_conflict(existing, manifest_digest, &stored, &fallback_digests),
            None,
        ));
    }
    let conversation_id = manifest.body.conversation_id.as_str();
    // The first attempt sends the bytes of one of the dispatch's targets: a begin naming a
    // target it does not have begins nothing (and takes no lock).
    let beginning = begin.and_then(|begin| {
        let request_digest = match begin.target {
            0 => Some(manifest.body.request_digest.as_str()),
            target => fallbacks
                .get(target as usize - 1)
                .map(|fallback| fallback.manifest.body.request_digest.as_str()),
        };
        request_digest.map(|request_digest| (begin, request_digest))
    });
    // Lock order: conversation first (shared when beginning: the begin holds its revision).
    let Some(current) = conversation_revision(tx, conversation_id, beginning.is_some()).await? else {
        return Ok((PrepareOutcome::NotFound, None));
    };
    if current != manifest.body.conversation_revision {
        return Ok((PrepareOutcome::StaleRevision { current }, None));
    }
    // Its lease runs from the store's now.
    let first = match beginning {
        Some((begin, request_digest)) => Some((begin, request_digest, store_now(tx).await?)),
        None => None,
    };
    let first_generation = Generation(1);
    let (state, generation_last, active_generation) = match first {
        Some(_) => (DispatchState::Dispatching, 1u64, Some(first_generation.0)),
        None => (DispatchState::Prepared, 0, None),
    };
    // `updated_at` on the store's clock: the sweep compares it with the store's now
    // (`prepared_unattended`), never with a replica's. A begun dispatch's is the begin's now,
    // as `begin_attempt` writes it.
    let updated_at = match first {
        Some(_) => "$11",
        None => tx.dialect().now_ms(),
    };
    let mut params: Vec<SqlValue> = vec![
        operation_id.into(),
        conversation_id.into(),
        manifest.body.conversation_revision.0.into(),
        manifest_digest.into(),
        manifest.body.request_digest.as_str().into(),
        manifest.body.provider.as_str().into(),
        ts(now),
        state.as_str().into(),
        generation_last.into(),
        active_generation.into(),
    ];
    if let Some((_, _, store_now)) = first {
        params.push(ts(store_now));
    }
    let inserted = tx
        .execute(
            &format!(
                "INSERT INTO dispatches (operation_id, conversation_id, revision, manifest_digest, \
                 request_digest, provider, state, cancel_generation, generation_last, active_generation, \
                 quarantined, created_at, updated_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $8, 0, $9, $10, 0, $7, {updated_at}) \
                 ON CONFLICT (operation_id) DO NOTHING"
            ),
            &params,
        )
        .await?;
    if inserted == 0 {
        // Another replica inserted the same operation id between our read and our insert.
        let record = dispatch(tx, operation_id)
            .await?
            .ok_or_else(|| StoreError::Corrupt("dispatch vanished inside its transaction".into()))?;
        let stored = fallback_digests_of(tx, operation_id).await?;
        return Ok((
            same_or_conflict(record, manifest_digest, &stored, &fallback_digests),
            None,
        ));
    }
    // What the dispatch was prepared with, written once: the row above is the one that changes.
    tx.execute(
        "INSERT INTO dispatch_bodies (operation_id, request_bytes, manifest, policy) VALUES ($1, $2, $3, $4)",
        &[
            operation_id.into(),
            request_bytes.into(),
            manifest_json.into(),
            policy_json.into(),
        ],
    )
    .await?;
    // The row just inserted, as `dispatch` would read it back (without reading the request
    // bytes back through the page cache: they are the caller's).
    let record = DispatchRecord {
        operation_id: operation_id.to_owned(),
        conversation_id: conversation_id.to_owned(),
        revision: manifest.body.conversation_revision,
        manifest: manifest_value,
        manifest_digest: manifest_digest.to_owned(),
        request_digest: manifest.body.request_digest.as_str().to_owned(),
        request_bytes: request_bytes.to_vec(),
        provider: manifest.body.provider.clone(),
        state,
        cancel_generation: 0,
        active_generation: active_generation.map(Generation),
        committed_revision: None,
        outcome: None,
    };
    for (index, (fallback, (manifest_json, policy_json))) in fallbacks.iter().zip(fallback_rows).enumerate() {
        tx.execute(
            "INSERT INTO dispatch_targets (operation_id, position, manifest, manifest_digest, request_digest, \
             request_bytes, provider, policy) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            &[
                operation_id.into(),
                (index as u64 + 1).into(),
                manifest_json.into(),
                fallback.manifest.manifest_digest.as_str().into(),
                fallback.manifest.body.request_digest.as_str().into(),
                fallback.request_bytes.as_slice().into(),
                fallback.manifest.body.provider.as_str().into(),
                policy_json.into(),
            ],
        )
        .await?;
    }
    let Some((begin, request_digest, store_now)) = first else {
        record_transition(tx, operation_id, None, None, DispatchState::Prepared, now).await?;
        // A begin asked for a target this dispatch does not have: refused, nothing begun.
        let refused = begin.map(|_| BeginOutcome::Refused {
            state: Some(DispatchState::Prepared),
            active_generation: None,
        });
        return Ok((PrepareOutcome::Created(record), refused));
    };
    let lease = Lease {
        holder: begin.holder.clone(),
        expires_at: store_now.plus_ms(begin.lease_ms),
    };
    let key = insert_attempt(
        tx,
        operation_id,
        first_generation,
        request_digest,
        &lease,
        store_now,
        begin.target,
    )
    .await?;
    // Both history rows in one insert: the prepare (the caller's clock, as a prepare without a
    // begin writes it) and the begin (the store's, as `begin_attempt` writes it).
    tx.execute(
        "INSERT INTO transitions (operation_id, generation, from_state, to_state, at) \
         VALUES ($1, NULL, NULL, $3, $4), ($1, $2, $3, $5, $6)",
        &[
            operation_id.into(),
            first_generation.0.into(),
            DispatchState::Prepared.as_str().into(),
            ts(now),
            DispatchState::Dispatching.as_str().into(),
            ts(store_now),
        ],
    )
    .await?;
    Ok((
        PrepareOutcome::Created(record),
        Some(BeginOutcome::Began {
            generation: first_generation,
            idempotency_key: key,
        }),
    ))
}

/// [`prepare_targets`], and for a dispatch it created, the begin of its first attempt in the
/// same transaction (one durable write is both the prepare and the acceptance point). The
/// lease runs from the store's now. An existing dispatch is answered as it is, without a
/// begin: whoever created it drives it.
pub(crate) async fn prepare_and_begin<T: Tx>(
    tx: &mut T,
    manifest: &DispatchManifest,
    request_bytes: &[u8],
    fallbacks: &[PreparedTarget],
    rows: PrepareRows,
    begin: &BeginAtOnce,
    now: Timestamp,
) -> Result<(PrepareOutcome, Option<BeginOutcome>), StoreError> {
    prepare_beginning(tx, manifest, request_bytes, fallbacks, rows, Some(begin), now).await
}

/// The manifest digests of a dispatch's failover targets, in order.
async fn fallback_digests_of<T: Tx>(tx: &mut T, operation_id: &str) -> Result<Vec<String>, StoreError> {
    let rows = tx
        .query(
            "SELECT manifest_digest FROM dispatch_targets WHERE operation_id = $1 ORDER BY position",
            &[operation_id.into()],
        )
        .await?;
    rows.iter().map(|row| row.text(0)).collect()
}

/// The failover targets of a dispatch (positions 1..), in order; its own manifest is the
/// dispatch record.
pub(crate) async fn dispatch_fallbacks<T: Tx>(
    tx: &mut T,
    operation_id: &str,
) -> Result<Vec<TargetRecord>, StoreError> {
    let text = |manifest: &Value, field: &str| manifest[field].as_str().unwrap_or_default().to_owned();
    let mut targets = Vec::new();
    let rows = tx
        .query(
            "SELECT position, manifest, manifest_digest, request_digest, request_bytes, provider \
             FROM dispatch_targets WHERE operation_id = $1 ORDER BY position",
            &[operation_id.into()],
        )
        .await?;
    for row in &rows {
        let manifest = json_of(&row.text(1)?)?;
        targets.push(TargetRecord {
            position: u32::try_from(row.uint(0)?)
                .map_err(|_| StoreError::Corrupt("target position out of range".into()))?,
            model: text(&manifest, "model"),
            adapter: text(&manifest, "adapter"),
            manifest,
            manifest_digest: row.text(2)?,
            request_digest: row.text(3)?,
            request_bytes: row.bytes(4)?,
            provider: row.text(5)?,
        });
    }
    Ok(targets)
}

/// The request digest, manifest digest and provider of target `position` (None: no such
/// target).
async fn target_head<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    position: u32,
) -> Result<Option<(String, String, String)>, StoreError> {
    let rows = tx
        .query(
            "SELECT request_digest, manifest_digest, provider FROM dispatch_targets \
             WHERE operation_id = $1 AND position = $2",
            &[operation_id.into(), u64::from(position).into()],
        )
        .await?;
    rows.first()
        .map(|row| Ok((row.text(0)?, row.text(1)?, row.text(2)?)))
        .transpose()
}

fn same_or_conflict(
    existing: DispatchRecord,
    manifest_digest: &str,
    stored_fallbacks: &[String],
    fallbacks: &[&str],
) -> PrepareOutcome {
    if existing.manifest_digest == manifest_digest
        && stored_fallbacks.len() == fallbacks.len()
        && stored_fallbacks.iter().zip(fallbacks).all(|(a, b)| a == b)
    {
        PrepareOutcome::Existing(existing)
    } else {
        PrepareOutcome::Conflict {
            existing_manifest_digest: existing.manifest_digest,
        }
    }
}

/// The DISPATCHING attempt row of a begin (`begin_attempt`, or a prepare that begins at once):
/// its idempotency key (returned), the bytes it sends, its lease, its start and its target.
async fn insert_attempt<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    request_digest: &str,
    lease: &Lease,
    started_at: Timestamp,
    target: u32,
) -> Result<String, StoreError> {
    let key = idempotency_key(operation_id, generation);
    tx.execute(
        "INSERT INTO attempts (operation_id, generation, state, idempotency_key, request_digest, handle, \
         lease_holder, lease_expires_at, started_at, target) \
         VALUES ($1, $2, 'DISPATCHING', $3, $4, NULL, $5, $6, $7, $8)",
        &[
            operation_id.into(),
            generation.0.into(),
            key.as_str().into(),
            request_digest.into(),
            lease.holder.as_str().into(),
            ts(lease.expires_at),
            ts(started_at),
            u64::from(target).into(),
        ],
    )
    .await?;
    Ok(key)
}

pub(crate) async fn begin_attempt<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    expect: BeginExpect,
    lease: &Lease,
    now: Timestamp,
) -> Result<BeginOutcome, StoreError> {
    let Some(record) = dispatch_head(tx, operation_id).await? else {
        return Ok(BeginOutcome::Refused {
            state: None,
            active_generation: None,
        });
    };
    // The attempt sends one target's bytes: the dispatch's own, or a failover target's.
    let request_digest = if expect.target == 0 {
        record.request_digest.clone()
    } else {
        match target_head(tx, operation_id, expect.target).await? {
            Some((request_digest, _, _)) => request_digest,
            None => {
                return Ok(BeginOutcome::Refused {
                    state: Some(record.state),
                    active_generation: record.active_generation,
                });
            }
        }
    };
    // Lock order: conversation first (shared: the condition reads its revision).
    conversation_revision(tx, &record.conversation_id, true).await?;
    let rows = tx
        .query(
            "UPDATE dispatches SET state = 'DISPATCHING', active_generation = generation_last + 1, \
             generation_last = generation_last + 1, updated_at = $5 \
             WHERE operation_id = $1 AND state = 'PREPARED' AND cancel_generation = $2 AND revision = $3 \
             AND generation_last < $4 \
             AND EXISTS (SELECT 1 FROM conversations c \
                         WHERE c.conversation_id = dispatches.conversation_id AND c.revision = $3) \
             RETURNING active_generation",
            &[
                operation_id.into(),
                expect.cancel_generation.into(),
                expect.revision.0.into(),
                ATTEMPTS_PER_DISPATCH_MAX.into(),
                ts(now),
            ],
        )
        .await?;
    let Some(row) = rows.first() else {
        // A PREPARED dispatch that can never begin (the conversation moved past its revision,
        // or its attempt budget is spent) ends here, in the refusal's own transaction: nothing
        // would ever drive it, and every sweep would pick it up again.
        let ended = tx
            .execute(
                "UPDATE dispatches SET state = 'ABANDONED', updated_at = $3 \
                 WHERE operation_id = $1 AND state = 'PREPARED' AND (generation_last >= $2 \
                 OR NOT EXISTS (SELECT 1 FROM conversations c \
                                WHERE c.conversation_id = dispatches.conversation_id \
                                AND c.revision = dispatches.revision))",
                &[operation_id.into(), ATTEMPTS_PER_DISPATCH_MAX.into(), ts(now)],
            )
            .await?;
        if ended == 1 {
            record_transition(
                tx,
                operation_id,
                None,
                Some(DispatchState::Prepared),
                DispatchState::Abandoned,
                now,
            )
            .await?;
        }
        let found = dispatch_state(tx, operation_id).await?;
        return Ok(BeginOutcome::Refused {
            state: found.map(|(state, _)| state),
            active_generation: found.and_then(|(_, generation)| generation),
        });
    };
    let generation = Generation(row.uint(0)?);
    let key = insert_attempt(
        tx,
        operation_id,
        generation,
        &request_digest,
        lease,
        now,
        expect.target,
    )
    .await?;
    record_transition(
        tx,
        operation_id,
        Some(generation),
        Some(DispatchState::Prepared),
        DispatchState::Dispatching,
        now,
    )
    .await?;
    Ok(BeginOutcome::Began {
        generation,
        idempotency_key: key,
    })
}

/// The plain fenced transitions: everything except begin, replay, rearm, commit and cancel,
/// which have their own operations.
pub fn is_plain_transition(from: DispatchState, to: DispatchState) -> bool {
    use DispatchState::*;
    from.can_transition(to)
        && matches!(
            (from, to),
            (Dispatching, Sent)
                | (Sent, Streaming)
                | (Dispatching | Sent | Streaming, Unknown)
                | (Dispatching | Sent | Unknown, Failed)
                | (Dispatching | Sent | Streaming | Unknown, Abandoned)
                | (Unknown, Streaming)
        )
}

async fn refused<T: Tx>(tx: &mut T, operation_id: &str) -> Result<TransitionOutcome, StoreError> {
    let found = dispatch_state(tx, operation_id).await?;
    Ok(TransitionOutcome::Refused {
        state: found.map(|(state, _)| state),
        active_generation: found.and_then(|(_, generation)| generation),
    })
}

/// Move the dispatch and its attempt `generation` from `from` to `to`, both conditionally.
async fn move_both<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    from: DispatchState,
    to: DispatchState,
    now: Timestamp,
) -> Result<bool, StoreError> {
    let moved = tx
        .execute(
            "UPDATE dispatches SET state = $4, updated_at = $5 \
             WHERE operation_id = $1 AND active_generation = $2 AND state = $3",
            &[
                operation_id.into(),
                generation.0.into(),
                from.as_str().into(),
                to.as_str().into(),
                ts(now),
            ],
        )
        .await?;
    if moved == 0 {
        return Ok(false);
    }
    let attempt = tx
        .execute(
            "UPDATE attempts SET state = $4 WHERE operation_id = $1 AND generation = $2 AND state = $3",
            &[
                operation_id.into(),
                generation.0.into(),
                from.as_str().into(),
                to.as_str().into(),
            ],
        )
        .await?;
    if attempt != 1 {
        return Err(StoreError::Corrupt(format!(
            "dispatch {operation_id} was {from} at generation {} but its attempt was not",
            generation.0
        )));
    }
    record_transition(tx, operation_id, Some(generation), Some(from), to, now).await?;
    Ok(true)
}

pub(crate) async fn transition<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    from: DispatchState,
    to: DispatchState,
    now: Timestamp,
) -> Result<TransitionOutcome, StoreError> {
    end_attempt(tx, operation_id, generation, from, to, None, now).await
}

/// A plain transition that also records why the attempt stopped (`reason`), in the same
/// transaction, so the attempt's story survives the process that saw it.
pub(crate) async fn end_attempt<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    from: DispatchState,
    to: DispatchState,
    reason: Option<&str>,
    now: Timestamp,
) -> Result<TransitionOutcome, StoreError> {
    if !is_plain_transition(from, to) {
        return Err(StoreError::IllegalTransition { from, to });
    }
    if !move_both(tx, operation_id, generation, from, to, now).await? {
        return refused(tx, operation_id).await;
    }
    if let Some(reason) = reason {
        set_end_reason(tx, operation_id, generation, reason).await?;
    }
    Ok(TransitionOutcome::Applied)
}

/// The dispatch back to PREPARED from `from` at `generation` (fail-over and rearm); the rows
/// moved (0: it was not there any more).
async fn dispatch_back_to_prepared<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    from: DispatchState,
    now: Timestamp,
) -> Result<u64, StoreError> {
    tx.execute(
        "UPDATE dispatches SET state = 'PREPARED', updated_at = $4 \
         WHERE operation_id = $1 AND active_generation = $2 AND state = $3",
        &[
            operation_id.into(),
            generation.0.into(),
            from.as_str().into(),
            ts(now),
        ],
    )
    .await
}

/// See [`crate::Ledger::fail_over`].
pub(crate) async fn fail_over<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    from: DispatchState,
    reason: &str,
    now: Timestamp,
) -> Result<TransitionOutcome, StoreError> {
    if !matches!(from, DispatchState::Dispatching | DispatchState::Sent) {
        return Err(StoreError::IllegalTransition {
            from,
            to: DispatchState::Failed,
        });
    }
    let moved = dispatch_back_to_prepared(tx, operation_id, generation, from, now).await?;
    if moved == 0 {
        return refused(tx, operation_id).await;
    }
    move_attempt(
        tx,
        operation_id,
        generation,
        from,
        "state = 'FAILED', confirmed_over = 'provider_refused'",
    )
    .await?;
    set_end_reason(tx, operation_id, generation, reason).await?;
    record_transition(
        tx,
        operation_id,
        Some(generation),
        Some(from),
        DispatchState::Failed,
        now,
    )
    .await?;
    record_transition(
        tx,
        operation_id,
        None,
        Some(DispatchState::Failed),
        DispatchState::Prepared,
        now,
    )
    .await?;
    Ok(TransitionOutcome::Applied)
}

/// Longest stored end reason (a reason is a code, not a message).
const END_REASON_MAX: usize = 64;

async fn set_end_reason<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    reason: &str,
) -> Result<(), StoreError> {
    let reason: String = reason.chars().take(END_REASON_MAX).collect();
    tx.execute(
        "UPDATE attempts SET end_reason = $3 WHERE operation_id = $1 AND generation = $2",
        &[operation_id.into(), generation.0.into(), reason.as_str().into()],
    )
    .await?;
    Ok(())
}

pub(crate) async fn replay_attempt<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    lease: &Lease,
    now: Timestamp,
) -> Result<TransitionOutcome, StoreError> {
    take_over(
        tx,
        operation_id,
        generation,
        DispatchState::Dispatching,
        lease,
        now,
    )
    .await
}

/// UNKNOWN → STREAMING when resuming by handle, re-fenced to the resuming holder in the same
/// conditional write (a takeover by another replica renews its own lease afterwards).
pub(crate) async fn resume_attempt<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    lease: &Lease,
    now: Timestamp,
) -> Result<TransitionOutcome, StoreError> {
    take_over(tx, operation_id, generation, DispatchState::Streaming, lease, now).await
}

/// UNKNOWN → `to` for the same generation, with the lease moved to `lease.holder`.
async fn take_over<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    to: DispatchState,
    lease: &Lease,
    now: Timestamp,
) -> Result<TransitionOutcome, StoreError> {
    // The per-generation caps are the store's: a take-over past them is refused, whatever a
    // driver counted (two drivers that read the counts before each other's take-over cannot
    // both pass: the state compare-and-set below lets one of them through).
    let (counter, cap) = if to == DispatchState::Streaming {
        ("resumes", turnstile_drive::RESUMES_PER_GENERATION_MAX)
    } else {
        ("replays", turnstile_drive::REPLAYS_PER_GENERATION_MAX)
    };
    let spent = tx
        .query(
            &format!("SELECT {counter} FROM attempts WHERE operation_id = $1 AND generation = $2"),
            &[operation_id.into(), generation.0.into()],
        )
        .await?;
    if spent
        .first()
        .map(|row| row.uint(0))
        .transpose()?
        .is_some_and(|spent| spent >= u64::from(cap))
    {
        return refused(tx, operation_id).await;
    }
    if !move_both(tx, operation_id, generation, DispatchState::Unknown, to, now).await? {
        return refused(tx, operation_id).await;
    }
    // Every take-over is counted on the attempt, whoever makes it: the resume and replay
    // budgets are per generation across drivers, restarts and replicas. A live attempt has
    // no end reason (its earlier stop stays visible in its history).
    let sql = format!(
        "UPDATE attempts SET lease_holder = $3, lease_expires_at = $4, {counter} = {counter} + 1, \
         end_reason = NULL \
         WHERE operation_id = $1 AND generation = $2"
    );
    tx.execute(
        &sql,
        &[
            operation_id.into(),
            generation.0.into(),
            lease.holder.as_str().into(),
            ts(lease.expires_at),
        ],
    )
    .await?;
    Ok(TransitionOutcome::Applied)
}

pub(crate) async fn abandon_and_rearm<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    provider_confirmed_ended: bool,
    now: Timestamp,
) -> Result<TransitionOutcome, StoreError> {
    abandon_and_rearm_on(tx, operation_id, generation, provider_confirmed_ended, None, now).await
}

/// [`abandon_and_rearm`] recording the provider's own word on the old attempt (e.g.
/// `provider_cancelled`) as how its end was confirmed.
pub(crate) async fn abandon_and_rearm_on<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    provider_confirmed_ended: bool,
    provider_word: Option<&str>,
    now: Timestamp,
) -> Result<TransitionOutcome, StoreError> {
    // The old attempt must be confirmed dead: its lease expired, or the provider said so.
    // That is part of the condition, so no replica can start a new generation early.
    let attempt = tx
        .query(
            "UPDATE attempts SET state = 'ABANDONED', \
             confirmed_over = COALESCE($5, CASE WHEN lease_expires_at <= $3 THEN 'lease_expired' ELSE 'provider_ended' END) \
             WHERE operation_id = $1 AND generation = $2 \
             AND state = 'UNKNOWN' AND (lease_expires_at <= $3 OR $4 = 1) \
             AND EXISTS (SELECT 1 FROM dispatches d WHERE d.operation_id = attempts.operation_id \
                         AND d.active_generation = $2 AND d.state = 'UNKNOWN') \
             RETURNING generation",
            &[
                operation_id.into(),
                generation.0.into(),
                ts(now),
                SqlValue::Int(i64::from(provider_confirmed_ended)),
                provider_word.map(str::to_owned).into(),
            ],
        )
        .await?;
    let from = if attempt.is_empty() {
        // A FAILED attempt is terminal and may be rearmed, but only when its end is confirmed
        // (the provider refused it: `provider_confirmed_ended`) or its lease ran out: an
        // attempt that failed on a replay may still run at the provider from its first
        // request, and no generation may start beside it.
        if !provider_confirmed_ended {
            let expired = tx
                .query(
                    "SELECT 1 FROM attempts WHERE operation_id = $1 AND generation = $2 \
                     AND state = 'FAILED' AND lease_expires_at <= $3",
                    &[operation_id.into(), generation.0.into(), ts(now)],
                )
                .await?;
            if expired.is_empty() {
                return refused(tx, operation_id).await;
            }
        }
        DispatchState::Failed
    } else {
        record_transition(
            tx,
            operation_id,
            Some(generation),
            Some(DispatchState::Unknown),
            DispatchState::Abandoned,
            now,
        )
        .await?;
        DispatchState::Unknown
    };
    let rearmed = dispatch_back_to_prepared(tx, operation_id, generation, from, now).await?;
    if rearmed == 0 {
        if from == DispatchState::Unknown {
            return Err(StoreError::Corrupt(format!(
                "attempt {operation_id}/{} was UNKNOWN but its dispatch was not",
                generation.0
            )));
        }
        return refused(tx, operation_id).await;
    }
    let via = if from == DispatchState::Unknown {
        DispatchState::Abandoned
    } else {
        DispatchState::Failed
    };
    record_transition(tx, operation_id, None, Some(via), DispatchState::Prepared, now).await?;
    Ok(TransitionOutcome::Applied)
}

pub(crate) async fn renew_lease<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    lease: &Lease,
    now: Timestamp,
) -> Result<TransitionOutcome, StoreError> {
    // A lease that ran out by the store's clock is not renewed: its holder promised to have
    // stopped by then, and the sweep may already be deciding recovery on that promise.
    let renewed = tx
        .execute(
            "UPDATE attempts SET lease_expires_at = $4 WHERE operation_id = $1 AND generation = $2 \
             AND lease_holder = $3 AND (state = 'DISPATCHING' OR state = 'SENT' OR state = 'STREAMING') \
             AND lease_expires_at > $5 \
             AND EXISTS (SELECT 1 FROM dispatches d WHERE d.operation_id = attempts.operation_id \
                         AND d.active_generation = $2)",
            &[
                operation_id.into(),
                generation.0.into(),
                lease.holder.as_str().into(),
                ts(lease.expires_at),
                ts(now),
            ],
        )
        .await?;
    if renewed == 1 {
        Ok(TransitionOutcome::Applied)
    } else {
        refused(tx, operation_id).await
    }
}

pub(crate) async fn bind_handle<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    handle: &str,
    now: Timestamp,
) -> Result<BindOutcome, StoreError> {
    let Some(record) = dispatch_head(tx, operation_id).await? else {
        return Ok(BindOutcome::StaleGeneration);
    };
    if record.active_generation != Some(generation) {
        return Ok(BindOutcome::StaleGeneration);
    }
    // A handle belongs to the manifest its attempt sent (a failover target's is its own).
    let target = tx
        .query(
            "SELECT target FROM attempts WHERE operation_id = $1 AND generation = $2",
            &[operation_id.into(), generation.0.into()],
        )
        .await?
        .first()
        .map(|row| row.uint(0))
        .transpose()?
        .unwrap_or(0);
    let outcome = insert_handle(tx, &record, operation_id, generation, target, handle, now).await?;
    if matches!(outcome, BindOutcome::Refused { .. }) {
        return Ok(outcome);
    }
    tx.execute(
        "UPDATE attempts SET handle = $3 WHERE operation_id = $1 AND generation = $2 AND handle IS NULL",
        &[operation_id.into(), generation.0.into(), handle.into()],
    )
    .await?;
    Ok(outcome)
}

/// The handle row of an attempt of `record` (its dispatch) that sent target `target`: bound
/// to the manifest that target sent, or found bound already (to it: `AlreadyBound`; to another
/// manifest: `Refused`, counted). The attempt row's own `handle` column is the caller's.
async fn insert_handle<T: Tx>(
    tx: &mut T,
    record: &DispatchHead,
    operation_id: &str,
    generation: Generation,
    target: u64,
    handle: &str,
    now: Timestamp,
) -> Result<BindOutcome, StoreError> {
    let mut manifest_digest = record.manifest_digest.as_str();
    let mut provider = record.provider.as_str();
    let target_row;
    if target != 0 {
        let position =
            u32::try_from(target).map_err(|_| StoreError::Corrupt("target out of range".into()))?;
        let Some((_, target_manifest, target_provider)) = target_head(tx, operation_id, position).await?
        else {
            return Err(StoreError::Corrupt(format!(
                "attempt {operation_id}/{} names target {target}, which is not stored",
                generation.0
            )));
        };
        target_row = (target_manifest, target_provider);
        manifest_digest = target_row.0.as_str();
        provider = target_row.1.as_str();
    }
    let inserted = tx
        .execute(
            "INSERT INTO handles (provider, handle, manifest_digest, operation_id, generation, bound_at) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (provider, handle) DO NOTHING",
            &[
                provider.into(),
                handle.into(),
                manifest_digest.into(),
                operation_id.into(),
                generation.0.into(),
                ts(now),
            ],
        )
        .await?;
    if inserted == 1 {
        return Ok(BindOutcome::Bound);
    }
    let rows = tx
        .query(
            "SELECT manifest_digest FROM handles WHERE provider = $1 AND handle = $2",
            &[provider.into(), handle.into()],
        )
        .await?;
    let bound_to = rows
        .first()
        .map(|row| row.text(0))
        .transpose()?
        .ok_or_else(|| StoreError::Corrupt("handle conflict without a row".into()))?;
    if bound_to != manifest_digest {
        bump_counter(tx, "foreign_handle_refusals").await?;
        return Ok(BindOutcome::Refused { bound_to });
    }
    Ok(BindOutcome::AlreadyBound)
}

pub(crate) async fn cancel<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    expected_cancel_generation: Option<u64>,
    now: Timestamp,
) -> Result<CancelOutcome, StoreError> {
    let Some((state, generation)) = dispatch_state(tx, operation_id).await? else {
        return Ok(CancelOutcome::Refused { state: None });
    };
    if !state.can_transition(DispatchState::Abandoned) || state == DispatchState::Failed {
        return Ok(CancelOutcome::Refused { state: Some(state) });
    }
    let rows = tx
        .query(
            "UPDATE dispatches SET state = 'ABANDONED', cancel_generation = cancel_generation + 1, \
             updated_at = $4 WHERE operation_id = $1 AND state = $2 \
             AND ($3 < 0 OR cancel_generation = $3) RETURNING cancel_generation",
            &[
                operation_id.into(),
                state.as_str().into(),
                SqlValue::Int(expected_cancel_generation.map_or(-1, |value| {
                    // Cancel generations are small counters; saturate rather than wrap.
                    i64::try_from(value).unwrap_or(i64::MAX)
                })),
                ts(now),
            ],
        )
        .await?;
    let Some(row) = rows.first() else {
        let found = dispatch_state(tx, operation_id).await?;
        return Ok(CancelOutcome::Refused {
            state: found.map(|(state, _)| state),
        });
    };
    let cancel_generation = row.uint(0)?;
    let attempt_generation = if state.is_live() { generation } else { None };
    if let Some(generation) = attempt_generation {
        tx.execute(
            "UPDATE attempts SET state = 'ABANDONED', end_reason = COALESCE(end_reason, 'cancelled') \
             WHERE operation_id = $1 AND generation = $2 AND state = $3",
            &[operation_id.into(), generation.0.into(), state.as_str().into()],
        )
        .await?;
    }
    record_transition(
        tx,
        operation_id,
        attempt_generation,
        Some(state),
        DispatchState::Abandoned,
        now,
    )
    .await?;
    Ok(CancelOutcome::Cancelled { cancel_generation })
}

// ---------------------------------------------------------------------------------------------
// Canonical commit, quarantine

async fn tool_call_ids<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    revision: Revision,
) -> Result<Vec<String>, StoreError> {
    let rows = tx
        .query(
            "SELECT call_id FROM tool_calls WHERE conversation_id = $1 AND revision = $2 ORDER BY position",
            &[conversation_id.into(), revision.0.into()],
        )
        .await?;
    rows.iter().map(|row| row.text(0)).collect()
}

async fn commit_refusal<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    expected: DispatchState,
) -> Result<CommitRefusal, StoreError> {
    Ok(match dispatch_state(tx, operation_id).await? {
        None => CommitRefusal::NotFound,
        Some((_, active)) if active != Some(generation) => CommitRefusal::ForeignGeneration,
        Some((state, _)) if state != expected => CommitRefusal::WrongState(state),
        Some(_) => CommitRefusal::RevisionMoved,
    })
}

/// The states a carried attempt moves through on its way to COMMITTED, from its stored state
/// (none for STREAMING; None: not a state a commit can carry the attempt from).
fn carried_steps(from: DispatchState) -> Option<&'static [(DispatchState, DispatchState)]> {
    use DispatchState::*;
    match from {
        Dispatching => Some(&[(Dispatching, Sent), (Sent, Streaming)]),
        Sent => Some(&[(Sent, Streaming)]),
        Streaming => Some(&[]),
        _ => None,
    }
}

/// The canonical commit. `states`: the validator's state after the stored history, if this
/// process kept it; on a commit, `next` is set to the state after the new turn (for the
/// caller to keep once the transaction committed).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn commit<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    expected_revision: Revision,
    turn: &Value,
    outcome: Option<&Value>,
    carried: &Carried,
    states: &States<'_>,
    next: &mut Option<Checked>,
    now: Timestamp,
) -> Result<CommitOutcome, StoreError> {
    let Some(steps) = carried_steps(carried.from) else {
        return Err(StoreError::IllegalTransition {
            from: carried.from,
            to: DispatchState::Committed,
        });
    };
    let Some(record) = dispatch_head(tx, operation_id).await? else {
        return Ok(CommitOutcome::Refused(CommitRefusal::NotFound));
    };
    // A retry of the winning commit (e.g. after a connection drop past COMMIT) gets the same
    // answer, without a second turn.
    if record.state == DispatchState::Committed
        && record.active_generation == Some(generation)
        && let Some(revision) = record.committed_revision
    {
        let tool_calls = tool_call_ids(tx, &record.conversation_id, revision).await?;
        return Ok(CommitOutcome::Committed { revision, tool_calls });
    }
    let conversation_id = record.conversation_id.clone();
    let revision = Revision(expected_revision.0 + 1);
    let refuse = |reason: CommitRefusal| CommitOutcome::Refused(reason);
    if expected_revision != record.revision {
        quarantine_turn(tx, operation_id, generation, "commit_refused", turn, now).await?;
        bump_counter(tx, "canonical_cas_conflicts").await?;
        return Ok(refuse(CommitRefusal::RevisionMoved));
    }
    let Some(stamped) = history::stamp_turn(turn, revision, Some(generation.0)) else {
        quarantine_turn(tx, operation_id, generation, "rejected", turn, now).await?;
        return Ok(CommitOutcome::Rejected(Vec::new()));
    };
    // The conversation is not read here: the dispatch row refers to it (a foreign key) and no
    // write deletes one, and the claim of its revision below is the compare-and-set. A claim
    // that fails asks whether it exists (`NotFound`) before anything else.
    // Only the new turn is checked when the validator's state after the stored history is
    // kept; else the whole history is read and walked once.
    let checked = check_turn(
        tx,
        states,
        &conversation_id,
        expected_revision,
        stamped.clone(),
        revision,
    )
    .await?;
    let history::CheckedTurn {
        calls,
        history: state,
        digest,
    } = match checked {
        Ok(checked) => checked,
        Err(violations) => {
            quarantine_turn(tx, operation_id, generation, "rejected", turn, now).await?;
            // The attempt did stream: its carried states are history rows all the same.
            for (from, to) in steps {
                move_both(tx, operation_id, generation, *from, *to, now).await?;
            }
            return Ok(CommitOutcome::Rejected(violations));
        }
    };
    tx.execute("SAVEPOINT canonical", &[]).await?;
    // Lock order: conversation, then dispatch. The carried transitions (SENT, STREAMING) are
    // written here, each with its history row, only when the commit wins.
    let carried_target = if claim_revision(tx, &conversation_id, expected_revision, now).await? {
        carry_to_committed(
            tx,
            operation_id,
            generation,
            carried.from,
            steps,
            (revision, outcome, carried.handle.as_deref()),
            now,
        )
        .await?
    } else {
        None
    };
    let won = carried_target.is_some();
    // The handle the attempt saw, bound and checked in this transaction (after the conversation
    // and dispatch rows, the lock order every write keeps): a handle bound to another manifest
    // never commits, the same refusal a bind of its own would have met. The attempt row took
    // the handle with its move above (rolled back with it on a refusal).
    if let Some(target) = carried_target
        && carried.bind
        && let Some(handle) = &carried.handle
        && let BindOutcome::Refused { .. } =
            insert_handle(tx, &record, operation_id, generation, target, handle, now).await?
    {
        tx.execute("ROLLBACK TO SAVEPOINT canonical", &[]).await?;
        tx.execute("RELEASE SAVEPOINT canonical", &[]).await?;
        bump_counter(tx, "foreign_handle_refusals").await?;
        return Ok(refuse(CommitRefusal::ForeignHandle));
    }
    if !won {
        tx.execute("ROLLBACK TO SAVEPOINT canonical", &[]).await?;
        tx.execute("RELEASE SAVEPOINT canonical", &[]).await?;
        if conversation_revision(tx, &conversation_id, false)
            .await?
            .is_none()
        {
            return Ok(refuse(CommitRefusal::NotFound));
        }
        let reason = commit_refusal(tx, operation_id, generation, carried.from).await?;
        quarantine_turn(tx, operation_id, generation, "commit_refused", turn, now).await?;
        bump_counter(tx, "canonical_cas_conflicts").await?;
        if reason == CommitRefusal::RevisionMoved {
            // Another turn won the revision: this dispatch can never commit. It ends here, in
            // the refusal's own transaction, instead of staying live until its lease runs out
            // and being recovered, rearmed and refused again.
            for (from, to) in steps {
                move_both(tx, operation_id, generation, *from, *to, now).await?;
            }
            move_both(
                tx,
                operation_id,
                generation,
                DispatchState::Streaming,
                DispatchState::Abandoned,
                now,
            )
            .await?;
            set_end_reason(tx, operation_id, generation, "revision_moved").await?;
        }
        return Ok(refuse(reason));
    }
    tx.execute("RELEASE SAVEPOINT canonical", &[]).await?;
    insert_turn(
        tx,
        &conversation_id,
        revision,
        &stamped,
        Some(generation),
        Some(operation_id),
        digest,
        now,
    )
    .await?;
    insert_tool_calls(tx, &conversation_id, revision, generation, operation_id, &calls).await?;
    insert_evidence(tx, operation_id, &carried.evidence, now).await?;
    *next = Some(Checked {
        conversation_id,
        revision,
        history: state,
    });
    Ok(CommitOutcome::Committed {
        revision,
        tool_calls: calls.into_iter().map(|call| call.call_id).collect(),
    })
}

/// Set `set` (constant SQL) on the attempt of `generation`, which must be in `from`: its
/// dispatch just moved from `from` under that generation, so an attempt elsewhere is a corrupt
/// store.
async fn move_attempt<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    from: DispatchState,
    set: &'static str,
) -> Result<(), StoreError> {
    let attempt = tx
        .execute(
            &format!("UPDATE attempts SET {set} WHERE operation_id = $1 AND generation = $2 AND state = $3"),
            &[operation_id.into(), generation.0.into(), from.as_str().into()],
        )
        .await?;
    if attempt != 1 {
        return Err(StoreError::Corrupt(format!(
            "dispatch {operation_id} was {from} at generation {} but its attempt was not",
            generation.0
        )));
    }
    Ok(())
}

/// The winning commit's moves of the dispatch and its attempt, from the state the attempt was
/// carried in (`from`) to COMMITTED, in three statements whatever `steps` carried: the dispatch
/// row (with its committed revision and outcome) and the attempt row (with its end reason and
/// the handle it saw, unless it has one) move once, each only from `from` under `generation`,
/// and every transition on the way (SENT, STREAMING, COMMITTED) gets its history row in one
/// insert. `None` (nothing written) when the dispatch is no longer in `from` at `generation`,
/// else the target the attempt sent; what `move_both` step by step wrote, minus the
/// intermediate row states nobody could read inside the transaction.
async fn carry_to_committed<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    from: DispatchState,
    steps: &[(DispatchState, DispatchState)],
    (revision, outcome, handle): (Revision, Option<&Value>, Option<&str>),
    now: Timestamp,
) -> Result<Option<u64>, StoreError> {
    let moved = tx
        .execute(
            "UPDATE dispatches SET state = 'COMMITTED', updated_at = $4, committed_revision = $5, outcome = $6 \
             WHERE operation_id = $1 AND active_generation = $2 AND state = $3",
            &[
                operation_id.into(),
                generation.0.into(),
                from.as_str().into(),
                ts(now),
                revision.0.into(),
                outcome.map(Value::to_string).into(),
            ],
        )
        .await?;
    if moved == 0 {
        return Ok(None);
    }
    let attempt = tx
        .query(
            "UPDATE attempts SET state = 'COMMITTED', end_reason = 'committed', handle = COALESCE(handle, $4) \
             WHERE operation_id = $1 AND generation = $2 AND state = $3 RETURNING target",
            &[
                operation_id.into(),
                generation.0.into(),
                from.as_str().into(),
                handle.into(),
            ],
        )
        .await?;
    let Some(target) = attempt.first().map(|row| row.uint(0)).transpose()? else {
        return Err(StoreError::Corrupt(format!(
            "dispatch {operation_id} was {from} at generation {} but its attempt was not",
            generation.0
        )));
    };
    let moves: Vec<(DispatchState, DispatchState)> = steps
        .iter()
        .copied()
        .chain([(DispatchState::Streaming, DispatchState::Committed)])
        .collect();
    let mut sql =
        String::from("INSERT INTO transitions (operation_id, generation, from_state, to_state, at) VALUES ");
    let mut params: Vec<SqlValue> = vec![operation_id.into(), generation.0.into(), ts(now)];
    for (index, (step_from, step_to)) in moves.iter().enumerate() {
        if index > 0 {
            sql.push_str(", ");
        }
        let at = params.len();
        sql.push_str(&format!("($1, $2, ${}, ${}, $3)", at + 1, at + 2));
        params.push(step_from.as_str().into());
        params.push(step_to.as_str().into());
    }
    tx.execute(&sql, &params).await?;
    Ok(Some(target))
}

async fn insert_tool_calls<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    revision: Revision,
    generation: Generation,
    operation_id: &str,
    calls: &[NewToolCall],
) -> Result<(), StoreError> {
    for (position, call) in calls.iter().enumerate() {
        tx.execute(
            "INSERT INTO tool_calls (conversation_id, call_id, revision, position, generation, operation_id, \
             tool, arguments, args_digest, state, claim) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'ready', 0)",
            &[
                conversation_id.into(),
                call.call_id.as_str().into(),
                revision.0.into(),
                (position as u64).into(),
                generation.0.into(),
                operation_id.into(),
                call.tool.as_str().into(),
                call.arguments.to_string().into(),
                call.args_digest.as_str().into(),
            ],
        )
        .await?;
    }
    Ok(())
}

async fn quarantine_turn<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    generation: Generation,
    reason: &str,
    content: &Value,
    now: Timestamp,
) -> Result<bool, StoreError> {
    let room = tx
        .execute(
            "UPDATE dispatches SET quarantined = quarantined + 1 WHERE operation_id = $1 AND quarantined < $2",
            &[operation_id.into(), QUARANTINE_PER_DISPATCH_MAX.into()],
        )
        .await?;
    if room == 0 {
        bump_counter(tx, "quarantine_dropped").await?;
        return Ok(false);
    }
    tx.execute(
        "INSERT INTO quarantine (operation_id, generation, reason, content, at) VALUES ($1, $2, $3, $4, $5)",
        &[
            operation_id.into(),
            generation.0.into(),
            reason.into(),
            content.to_string().into(),
            ts(now),
        ],
    )
    .await?;
    bump_counter(tx, "late_blocks").await?;
    Ok(true)
}

pub(crate) async fn quarantine<T: Tx>(
    tx: &mut T,
    entry: &QuarantineEntry,
    now: Timestamp,
) -> Result<bool, StoreError> {
    quarantine_turn(
        tx,
        &entry.operation_id,
        entry.generation,
        &entry.reason,
        &entry.content,
        now,
    )
    .await
}

pub(crate) async fn quarantined<T: Tx>(tx: &mut T, limit: u64) -> Result<Vec<QuarantineRecord>, StoreError> {
    let rows = tx
        .query(
            "SELECT id, operation_id, generation, reason, content, at FROM quarantine ORDER BY id LIMIT $1",
            &[limit.into()],
        )
        .await?;
    rows.iter().map(quarantine_record).collect()
}

/// A quarantine row as selected by [`quarantined`] and `listing::quarantine_page`
/// (`id, operation_id, generation, reason, content, at`).
pub(crate) fn quarantine_record(row: &Row) -> Result<QuarantineRecord, StoreError> {
    Ok(QuarantineRecord {
        id: row.int(0)?,
        entry: QuarantineEntry {
            operation_id: row.text(1)?,
            generation: Generation(row.uint(2)?),
            reason: row.text(3)?,
            content: json_of(&row.text(4)?)?,
        },
        at: Timestamp(row.uint(5)?),
    })
}

// ---------------------------------------------------------------------------------------------
// Tool-call ledger

/// The idempotency key of a committed tool call: the same for every claim of the call (so a
/// second executor that takes over an expired claim passes the tool the key the first one did),
/// derived from the store's conversation id, the call id and the generation that made the call,
/// and free of client text. 64 hex digits of SHA-256 behind `tc-`.
pub fn tool_call_idempotency_key(conversation_id: &str, call_id: &str, generation: Generation) -> String {
    let digest =
        Digest::of_bytes(format!("tool-call\n{conversation_id}\n{call_id}\n{}", generation.0).as_bytes());
    format!("tc-{}", digest.as_str().trim_start_matches("sha256:"))
}

/// A call's listed state as SQL over the `tool_calls` row named `row` (`t`, or `tool_calls`),
/// judged by the store's clock inside the statement: a `claimed` row whose lease ran out reads
/// `expired`; a `client` row whose hold ended reads `client_abandoned` (its bound ran out, a
/// fork brought it forward, or it was handed before holds had an end: no `claim_expires_at`).
pub(crate) fn listed_state_sql(dialect: Dialect, row: &str) -> String {
    format!(
        "CASE WHEN {row}.state = 'claimed' AND {row}.claim_expires_at <= {now} THEN 'expired' \
         WHEN {row}.state = 'client' AND ({abandoned}) THEN 'client_abandoned' ELSE {row}.state END",
        now = dialect.now_ms(),
        abandoned = client_hold_ended_sql(dialect, row),
    )
}

/// The condition under which a `client` row's hold has ended, by the store's clock.
fn client_hold_ended_sql(dialect: Dialect, row: &str) -> String {
    format!(
        "{row}.claim_expires_at IS NULL OR {row}.claim_expires_at <= {now}",
        now = dialect.now_ms()
    )
}

/// Whether the `tool_calls` row named `row` awaits a result, as SQL: every listed state but
/// `done` and `client_abandoned` ([`ToolCallState::is_pending`]).
pub(crate) fn pending_sql(dialect: Dialect, row: &str) -> String {
    format!(
        "{row}.state <> 'done' AND NOT ({row}.state = 'client' AND ({}))",
        client_hold_ended_sql(dialect, row)
    )
}

/// The listed columns; the state is judged by the store's clock inside the statement
/// ([`listed_state_sql`]).
fn tool_call_columns(dialect: Dialect) -> String {
    format!(
        "conversation_id, call_id, revision, generation, tool, arguments, args_digest, \
         {}, claim, claim_holder, claim_expires_at, result_revision",
        listed_state_sql(dialect, "tool_calls")
    )
}

fn tool_call_state(text: &str) -> Result<ToolCallState, StoreError> {
    ToolCallState::parse(text).ok_or_else(|| StoreError::Corrupt(format!("tool call state {text:?}")))
}

fn tool_call_from_row(row: &Row) -> Result<ToolCallRecord, StoreError> {
    let conversation_id = row.text(0)?;
    let call_id = row.text(1)?;
    let generation = Generation(row.uint(3)?);
    Ok(ToolCallRecord {
        idempotency_key: tool_call_idempotency_key(&conversation_id, &call_id, generation),
        conversation_id,
        call_id,
        revision: Revision(row.uint(2)?),
        generation,
        tool: row.text(4)?,
        arguments: json_of(&row.text(5)?)?,
        args_digest: row.text(6)?,
        state: tool_call_state(&row.text(7)?)?,
        claim: row.uint(8)?,
        claim_holder: row.text_opt(9)?,
        claim_expires_at: row.uint_opt(10)?.map(Timestamp),
        result_revision: row.uint_opt(11)?.map(Revision),
    })
}

pub(crate) async fn tool_calls<T: Tx>(
    tx: &mut T,
    state: Option<ToolCallState>,
) -> Result<Vec<ToolCallRecord>, StoreError> {
    let columns = tool_call_columns(tx.dialect());
    let now = tx.dialect().now_ms();
    let condition = match state {
        None => String::new(),
        Some(ToolCallState::Claimed) => format!("WHERE state = 'claimed' AND claim_expires_at > {now} "),
        Some(ToolCallState::Expired) => format!("WHERE state = 'claimed' AND claim_expires_at <= {now} "),
        Some(ToolCallState::Client) => format!("WHERE state = 'client' AND claim_expires_at > {now} "),
        Some(ToolCallState::ClientAbandoned) => format!(
            "WHERE state = 'client' AND ({}) ",
            client_hold_ended_sql(tx.dialect(), "tool_calls")
        ),
        Some(stored) => format!("WHERE state = '{}' ", stored.as_str()),
    };
    let sql =
        format!("SELECT {columns} FROM tool_calls {condition}ORDER BY conversation_id, revision, position");
    let rows = tx.query(&sql, &[]).await?;
    rows.iter().map(tool_call_from_row).collect()
}

/// One call's listed state (store clock), or None when there is no such call: the explanation
/// of a refused claim, renewal or release (never what decides it).
async fn listed_state<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    call_id: &str,
) -> Result<Option<ToolCallState>, StoreError> {
    let sql = format!(
        "SELECT {} FROM tool_calls WHERE conversation_id = $1 AND call_id = $2",
        listed_state_sql(tx.dialect(), "tool_calls")
    );
    let rows = tx.query(&sql, &[conversation_id.into(), call_id.into()]).await?;
    rows.first().map(|row| tool_call_state(&row.text(0)?)).transpose()
}

/// ready or expired → claimed, with a lease of `lease_ms` from the store's clock. Two
/// conditional writes, each deciding alone: first the takeover of an expired claim (so the
/// answer can say the tool may have run), then the claim of a ready call.
pub(crate) async fn claim_call<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    call_id: &str,
    holder: &str,
    lease_ms: u64,
) -> Result<CallClaimOutcome, StoreError> {
    let now = tx.dialect().now_ms();
    let lease_ms = lease_ms.clamp(1, CLAIM_LEASE_MS_MAX);
    for (condition, took_over_expired) in [
        (format!("state = 'claimed' AND claim_expires_at <= {now}"), true),
        ("state = 'ready'".to_owned(), false),
    ] {
        let sql = format!(
            "UPDATE tool_calls SET state = 'claimed', claim = claim + 1, claim_holder = $3, \
             claim_expires_at = {now} + $4 WHERE conversation_id = $1 AND call_id = $2 AND {condition} \
             RETURNING claim, claim_expires_at, generation"
        );
        let rows = tx
            .query(
                &sql,
                &[
                    conversation_id.into(),
                    call_id.into(),
                    holder.into(),
                    lease_ms.into(),
                ],
            )
            .await?;
        if let Some(row) = rows.first() {
            let generation = Generation(row.uint(2)?);
            return Ok(CallClaimOutcome::Claimed(CallClaim {
                claim: row.uint(0)?,
                lease_expires_at: Timestamp(row.uint(1)?),
                idempotency_key: tool_call_idempotency_key(conversation_id, call_id, generation),
                took_over_expired,
            }));
        }
    }
    Ok(match listed_state(tx, conversation_id, call_id).await? {
        None => CallClaimOutcome::NotFound,
        Some(state) => CallClaimOutcome::Unavailable { state },
    })
}

/// The older claim form: the lease's length is `lease.expires_at - now` (only the caller's
/// duration is used); the lease itself runs on the store's clock, as every claim's does.
pub(crate) async fn claim_tool_call<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    call_id: &str,
    lease: &Lease,
    now: Timestamp,
) -> Result<ClaimOutcome, StoreError> {
    let lease_ms = lease.expires_at.0.saturating_sub(now.0);
    Ok(
        match claim_call(tx, conversation_id, call_id, &lease.holder, lease_ms).await? {
            CallClaimOutcome::Claimed(granted) => ClaimOutcome::Claimed { claim: granted.claim },
            CallClaimOutcome::Unavailable { state } => ClaimOutcome::Unavailable { state },
            CallClaimOutcome::NotFound => ClaimOutcome::NotFound,
        },
    )
}

/// Extend the current claim's lease to `lease_ms` from the store's clock; only while the claim
/// is current and its lease has not run out (after that the call was listed as expired and may
/// be someone else's).
pub(crate) async fn renew_call<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    call_id: &str,
    claim: u64,
    lease_ms: u64,
) -> Result<RenewOutcome, StoreError> {
    let now = tx.dialect().now_ms();
    let lease_ms = lease_ms.clamp(1, CLAIM_LEASE_MS_MAX);
    let sql = format!(
        "UPDATE tool_calls SET claim_expires_at = {now} + $4 WHERE conversation_id = $1 AND call_id = $2 \
         AND state = 'claimed' AND claim = $3 AND claim_expires_at > {now} RETURNING claim_expires_at"
    );
    let rows = tx
        .query(
            &sql,
            &[
                conversation_id.into(),
                call_id.into(),
                claim.into(),
                lease_ms.into(),
            ],
        )
        .await?;
    if let Some(row) = rows.first() {
        return Ok(RenewOutcome::Renewed {
            lease_expires_at: Timestamp(row.uint(0)?),
        });
    }
    Ok(match listed_state(tx, conversation_id, call_id).await? {
        None => RenewOutcome::NotFound,
        Some(state) => RenewOutcome::StaleClaim { state },
    })
}

/// claimed → ready, by the current claim while its lease runs. The claim counter stays, so the
/// released claim's late result is refused and the next claim gets a new number.
pub(crate) async fn release_call<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    call_id: &str,
    claim: u64,
) -> Result<ReleaseOutcome, StoreError> {
    let sql = format!(
        "UPDATE tool_calls SET state = 'ready', claim_holder = NULL, claim_expires_at = NULL \
         WHERE conversation_id = $1 AND call_id = $2 AND state = 'claimed' AND claim = $3 \
         AND claim_expires_at > {now}",
        now = tx.dialect().now_ms()
    );
    let released = tx
        .execute(&sql, &[conversation_id.into(), call_id.into(), claim.into()])
        .await?;
    if released == 1 {
        return Ok(ReleaseOutcome::Released);
    }
    Ok(match listed_state(tx, conversation_id, call_id).await? {
        None => ReleaseOutcome::NotFound,
        Some(state) => ReleaseOutcome::StaleClaim { state },
    })
}

/// ready → client: the proxy handed the call to the client in the provider's response; the
/// client's follow-up carries the result (an appended tool turn closes it). The client's hold
/// ends `bound_ms` (1..=[`CLIENT_CALL_TIMEOUT_MS_MAX`]) after the hand-over by the store's
/// clock, when the call reads `client_abandoned`. `false` when the call was not ready (someone
/// claimed it first, or it is answered already).
pub(crate) async fn hand_to_client<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    call_id: &str,
    holder: &str,
    bound_ms: u64,
) -> Result<bool, StoreError> {
    let bound_ms = bound_ms.clamp(1, CLIENT_CALL_TIMEOUT_MS_MAX);
    let sql = format!(
        "UPDATE tool_calls SET state = 'client', claim_holder = $3, claim_expires_at = {now} + $4 \
         WHERE conversation_id = $1 AND call_id = $2 AND state = 'ready'",
        now = tx.dialect().now_ms()
    );
    let handed = tx
        .execute(
            &sql,
            &[
                conversation_id.into(),
                call_id.into(),
                holder.into(),
                bound_ms.into(),
            ],
        )
        .await?;
    Ok(handed == 1)
}

/// client → client_abandoned now (store clock) for every call of the conversation committed at
/// or before `revision` whose client still holds it: a follow-up of the same client forked away
/// from the conversation as it stood at `revision`. Calls committed after it (another request
/// continued the conversation meanwhile) keep their hold. Answers how many calls it ended.
pub(crate) async fn abandon_client_calls<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    revision: Revision,
) -> Result<u64, StoreError> {
    let sql = format!(
        "UPDATE tool_calls SET claim_expires_at = {now} WHERE conversation_id = $1 \
         AND state = 'client' AND revision <= $2 AND claim_expires_at > {now}",
        now = tx.dialect().now_ms()
    );
    tx.execute(&sql, &[conversation_id.into(), revision.0.into()])
        .await
}

#[allow(clippy::too_many_arguments)]
pub(crate) async fn submit_tool_result<T: Tx>(
    tx: &mut T,
    conversation_id: &str,
    call_id: &str,
    claim: u64,
    status: &str,
    content: &Value,
    states: &States<'_>,
    next: &mut Option<Checked>,
    now: Timestamp,
) -> Result<ResultOutcome, StoreError> {
    let sql = format!(
        "SELECT {} FROM tool_calls WHERE conversation_id = $1 AND call_id = $2",
        tool_call_columns(tx.dialect())
    );
    let rows = tx.query(&sql, &[conversation_id.into(), call_id.into()]).await?;
    let Some(call) = rows.first().map(tool_call_from_row).transpose()? else {
        return Ok(ResultOutcome::NotFound);
    };
    if call.state == ToolCallState::Done {
        bump_counter(tx, "tool_result_duplicates").await?;
        return Ok(ResultOutcome::Duplicate);
    }
    // The latest claim's result is accepted even after its lease ran out, as long as nobody
    // claimed the call again (that would have bumped the claim number): the claim number, not
    // the lease, fences results
    // (`docs/decisions/0043-tool-call-ledger-the-idempotency-key-and-which-late.md`, 2026-12-01).
    let claimed = matches!(call.state, ToolCallState::Claimed | ToolCallState::Expired);
    if !claimed || call.claim != claim {
        return Ok(ResultOutcome::StaleClaim);
    }
    let Some(current) = conversation_revision(tx, conversation_id, false).await? else {
        return Ok(ResultOutcome::NotFound);
    };
    let revision = Revision(current.0 + 1);
    let turn = serde_json::json!({
        "id": format!("{call_id}:result"),
        "role": "tool",
        "revision": revision.0,
        "blocks": [{
            "id": format!("{call_id}:result:0"),
            "kind": "tool_result",
            "call_id": call_id,
            "tool": call.tool,
            "args_digest": call.args_digest,
            "generation": call.generation.0,
            "status": status,
            "content": content,
        }],
    });
    let checked = match check_turn(tx, states, conversation_id, current, turn.clone(), revision).await? {
        Ok(checked) => checked,
        Err(violations) => return Ok(ResultOutcome::Rejected(violations)),
    };
    tx.execute("SAVEPOINT tool_result", &[]).await?;
    if !claim_revision(tx, conversation_id, current, now).await? {
        tx.execute("ROLLBACK TO SAVEPOINT tool_result", &[]).await?;
        tx.execute("RELEASE SAVEPOINT tool_result", &[]).await?;
        return Ok(ResultOutcome::Conflict);
    }
    let done = tx
        .execute(
            "UPDATE tool_calls SET state = 'done', result_revision = $4 \
             WHERE conversation_id = $1 AND call_id = $2 AND state = 'claimed' AND claim = $3",
            &[
                conversation_id.into(),
                call_id.into(),
                claim.into(),
                revision.0.into(),
            ],
        )
        .await?;
    if done == 0 {
        tx.execute("ROLLBACK TO SAVEPOINT tool_result", &[]).await?;
        tx.execute("RELEASE SAVEPOINT tool_result", &[]).await?;
        return Ok(ResultOutcome::StaleClaim);
    }
    tx.execute("RELEASE SAVEPOINT tool_result", &[]).await?;
    insert_turn(
        tx,
        conversation_id,
        revision,
        &turn,
        None,
        None,
        checked.digest,
        now,
    )
    .await?;
    *next = Some(Checked {
        conversation_id: conversation_id.to_owned(),
        revision,
        history: checked.history,
    });
    Ok(ResultOutcome::Appended { revision })
}

// ---------------------------------------------------------------------------------------------
// Attempts, recovery, counters

const ATTEMPT_COLUMNS: &str = "operation_id, generation, state, idempotency_key, request_digest, handle, lease_holder, lease_expires_at, resumes, replays, end_reason, confirmed_over, target";

async fn attempt_from_row<T: Tx>(tx: &mut T, row: &Row) -> Result<AttemptRecord, StoreError> {
    let operation_id = row.text(0)?;
    let generation = Generation(row.uint(1)?);
    let history_rows = tx
        .query(
            "SELECT to_state, at FROM transitions WHERE operation_id = $1 AND generation = $2 ORDER BY id",
            &[operation_id.as_str().into(), generation.0.into()],
        )
        .await?;
    let history = history_rows
        .iter()
        .map(|row| Ok((state_of(&row.text(0)?)?, Timestamp(row.uint(1)?))))
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(AttemptRecord {
        operation_id,
        generation,
        state: state_of(&row.text(2)?)?,
        idempotency_key: row.text(3)?,
        request_digest: row.text(4)?,
        handle: row.text_opt(5)?,
        lease_holder: row.text(6)?,
        lease_expires_at: Timestamp(row.uint(7)?),
        history,
        resumes: u32::try_from(row.uint(8)?).unwrap_or(u32::MAX),
        replays: u32::try_from(row.uint(9)?).unwrap_or(u32::MAX),
        end_reason: row.text_opt(10)?,
        confirmed_over: row.text_opt(11)?,
        target: u32::try_from(row.uint(12)?).unwrap_or(u32::MAX),
    })
}

/// Append what the provider's side of attempts' connections showed (`attempt_evidence`,
/// migration 14), each row as given: the caller bounds them ([`EVIDENCE_BYTES_MAX`] each here,
/// past which a row keeps only its generation and the fact it was cut).
pub(crate) async fn insert_evidence<T: Tx>(
    tx: &mut T,
    operation_id: &str,
    rows: &[(Generation, Value)],
    now: Timestamp,
) -> Result<(), StoreError> {
    for (generation, evidence) in rows.iter().take(EVIDENCE_ROWS_MAX) {
        let mut text = evidence.to_string();
        if text.len() > EVIDENCE_BYTES_MAX {
            text = serde_json::json!({"generation": generation.0, "evidence_truncated": true}).to_string();
        }
        tx.execute(
            "INSERT INTO attempt_evidence (operation_id, generation, evidence, at) VALUES ($1, $2, $3, $4)",
            &[operation_id.into(), generation.0.into(), text.into(), ts(now)],
        )
        .await?;
    }
    Ok(())
}

/// Evidence rows of one dispatch, oldest first (at most [`EVIDENCE_ROWS_MAX`] × its attempts).
pub(crate) async fn evidence<T: Tx>(
    tx: &mut T,
    operation_id: &str,
) -> Result<Vec<(Generation, Value)>, StoreError> {
    let rows = tx
        .query(
            "SELECT generation, evidence FROM attempt_evidence WHERE operation_id = $1 ORDER BY id LIMIT 1024",
            &[operation_id.into()],
        )
        .await?;
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        let text = row.text(1)?;
        let value = serde_json::from_str(&text)
            .map_err(|error| StoreError::Corrupt(format!("attempt evidence of {operation_id}: {error}")))?;
        out.push((Generation(row.uint(0)?), value));
    }
    Ok(out)
}

/// Largest evidence row stored (JSON bytes): a 64 KiB error body, a 16 KiB preview, the rest.
pub const EVIDENCE_BYTES_MAX: usize = 160 * 1024;
/// Evidence rows one write appends at most.
pub const EVIDENCE_ROWS_MAX: usize = 64;

pub(crate) async fn attempts<T: Tx>(
    tx: &mut T,
    operation_id: &str,
) -> Result<Vec<AttemptRecord>, StoreError> {
    let sql = format!("SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE operation_id = $1 ORDER BY generation");
    let rows = tx.query(&sql, &[operation_id.into()]).await?;
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        out.push(attempt_from_row(tx, row).await?);
    }
    Ok(out)
}

pub(crate) async fn recover_startup<T: Tx>(
    tx: &mut T,
    holder: &str,
    now: Timestamp,
) -> Result<RecoveryReport, StoreError> {
    // Live attempts this replica drove before it stopped, or whose lease ran out (their
    // driver is gone), become UNKNOWN first. Another replica's attempts under a running lease
    // are left alone.
    let rows = tx
        .query(&expiring_attempts_sql(), &[holder.into(), ts(now)])
        .await?;
    let mut marked_unknown = 0;
    for row in &rows {
        let operation_id = row.text(0)?;
        let generation = Generation(row.uint(1)?);
        let from = state_of(&row.text(2)?)?;
        // Why it stopped: its lease ran out (its driver is gone), or this replica restarted.
        let story = "UPDATE attempts SET end_reason = CASE WHEN lease_expires_at <= $3 \
                     THEN 'lease_expired' ELSE 'replica_restarted' END \
                     WHERE operation_id = $1 AND generation = $2";
        if move_both(tx, &operation_id, generation, from, DispatchState::Unknown, now).await? {
            tx.execute(
                story,
                &[operation_id.as_str().into(), generation.0.into(), ts(now)],
            )
            .await?;
            marked_unknown += 1;
        } else {
            // Not the active generation any more: mark only the attempt.
            let moved = tx
                .execute(
                    "UPDATE attempts SET state = 'UNKNOWN' WHERE operation_id = $1 AND generation = $2 AND state = $3",
                    &[operation_id.as_str().into(), generation.0.into(), from.as_str().into()],
                )
                .await?;
            if moved == 1 {
                record_transition(
                    tx,
                    &operation_id,
                    Some(generation),
                    Some(from),
                    DispatchState::Unknown,
                    now,
                )
                .await?;
                tx.execute(
                    story,
                    &[operation_id.as_str().into(), generation.0.into(), ts(now)],
                )
                .await?;
                marked_unknown += 1;
            }
        }
    }
    let rows = tx.query(&unknown_attempts_sql(), &[]).await?;
    let mut unknown = Vec::with_capacity(rows.len());
    for row in &rows {
        unknown.push(attempt_from_row(tx, row).await?);
    }
    Ok(RecoveryReport {
        marked_unknown,
        unknown,
    })
}

/// A holder that closed every provider connection of its live attempts (a drained process
/// handing them over) gives them up: their leases end now, by the store's clock, and those
/// still DISPATCHING, SENT or STREAMING become UNKNOWN with `end_reason = shutting_down`, so
/// any replica's sweep, or the next start, recovers them at once instead of waiting out the
/// lease. Another holder's attempts are untouched. Answers how many attempts were released.
pub(crate) async fn release_holder<T: Tx>(
    tx: &mut T,
    holder: &str,
    now: Timestamp,
) -> Result<u64, StoreError> {
    let released = tx
        .execute(
            &format!(
                "UPDATE attempts SET lease_expires_at = $2 \
                 WHERE {LIVE_ATTEMPTS} AND lease_holder = $1 AND lease_expires_at > $2"
            ),
            &[holder.into(), ts(now)],
        )
        .await?;
    let rows = tx
        .query(
            &format!(
                "SELECT operation_id, generation, state FROM attempts \
                 WHERE {LIVE_ATTEMPTS} AND state IN ('DISPATCHING', 'SENT', 'STREAMING') \
                 AND lease_holder = $1 ORDER BY operation_id, generation"
            ),
            &[holder.into()],
        )
        .await?;
    for row in &rows {
        let operation_id = row.text(0)?;
        let generation = Generation(row.uint(1)?);
        let from = state_of(&row.text(2)?)?;
        if !move_both(tx, &operation_id, generation, from, DispatchState::Unknown, now).await? {
            // Not the active generation any more: mark only the attempt.
            let moved = tx
                .execute(
                    "UPDATE attempts SET state = 'UNKNOWN' WHERE operation_id = $1 AND generation = $2 AND state = $3",
                    &[operation_id.as_str().into(), generation.0.into(), from.as_str().into()],
                )
                .await?;
            if moved != 1 {
                continue;
            }
            record_transition(
                tx,
                &operation_id,
                Some(generation),
                Some(from),
                DispatchState::Unknown,
                now,
            )
            .await?;
        }
        tx.execute(
            "UPDATE attempts SET end_reason = 'shutting_down' WHERE operation_id = $1 AND generation = $2",
            &[operation_id.as_str().into(), generation.0.into()],
        )
        .await?;
    }
    Ok(released)
}

/// The render policy kept with a dispatch.
pub(crate) async fn dispatch_policy<T: Tx>(
    tx: &mut T,
    operation_id: &str,
) -> Result<Option<Value>, StoreError> {
    let rows = tx
        .query(
            "SELECT b.operation_id, b.policy FROM dispatches d \
             LEFT JOIN dispatch_bodies b ON b.operation_id = d.operation_id WHERE d.operation_id = $1",
            &[operation_id.into()],
        )
        .await?;
    let Some(row) = rows.first() else {
        return Ok(None);
    };
    if row.text_opt(0)?.is_none() {
        return Err(StoreError::Corrupt(format!(
            "dispatch {operation_id} has no body row"
        )));
    }
    match row.text_opt(1)? {
        Some(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|error| StoreError::Corrupt(format!("stored policy of {operation_id}: {error}"))),
        None => Ok(None),
    }
}

/// PREPARED dispatches not updated for `idle_ms` by the store's clock (most `limit`): a
/// dispatch whose client left before a driver started, or whose driver died before its begin.
pub(crate) async fn prepared_unattended<T: Tx>(
    tx: &mut T,
    idle_ms: u64,
    limit: u64,
) -> Result<Vec<String>, StoreError> {
    let sql = prepared_unattended_sql(tx.dialect());
    let rows = tx.query(&sql, &[idle_ms.into(), limit.into()]).await?;
    rows.iter().map(|row| row.text(0)).collect()
}

/// How long the oldest attempt that is not over (live or UNKNOWN) has been past its lease, by
/// the store's clock; 0 when none is.
pub(crate) async fn stuck_age_ms<T: Tx>(tx: &mut T) -> Result<u64, StoreError> {
    let rows = tx.query(&stuck_age_sql(tx.dialect()), &[]).await?;
    match rows.first() {
        Some(row) => Ok(row.int(0)?.max(0) as u64),
        None => Ok(0),
    }
}

/// Live attempts that may have lost their driver (`recover_startup`): this replica's, or any
/// whose lease ran out.
fn expiring_attempts_sql() -> String {
    format!(
        "SELECT operation_id, generation, state FROM attempts \
         WHERE {LIVE_ATTEMPTS} AND state IN ('DISPATCHING', 'SENT', 'STREAMING') \
         AND (lease_holder = $1 OR lease_expires_at <= $2) ORDER BY operation_id, generation"
    )
}

/// Every UNKNOWN attempt (`recover_startup`).
fn unknown_attempts_sql() -> String {
    format!(
        "SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE {LIVE_ATTEMPTS} AND state = 'UNKNOWN' \
         ORDER BY operation_id, generation"
    )
}

fn prepared_unattended_sql(dialect: Dialect) -> String {
    format!(
        "SELECT operation_id FROM dispatches WHERE state = 'PREPARED' AND updated_at <= {} - $1 \
         ORDER BY updated_at, operation_id LIMIT $2",
        dialect.now_ms()
    )
}

fn stuck_age_sql(dialect: Dialect) -> String {
    let now = dialect.now_ms();
    format!(
        "SELECT COALESCE(MAX({now} - lease_expires_at), 0) FROM attempts \
         WHERE {LIVE_ATTEMPTS} AND lease_expires_at <= {now}"
    )
}

/// The sweeps that read the partial state indexes of migrations 10 and 11, by name, with the index
/// each must read (the SQLite ledger checks their plans in a test).
pub(crate) fn sweeps(dialect: Dialect) -> Vec<(&'static str, String, &'static str)> {
    vec![
        ("expiring attempts", expiring_attempts_sql(), "attempts_live"),
        ("unknown attempts", unknown_attempts_sql(), "attempts_live"),
        ("stuck age", stuck_age_sql(dialect), "attempts_live"),
        (
            "prepared unattended",
            prepared_unattended_sql(dialect),
            "dispatches_prepared",
        ),
    ]
}

/// The store's clock (see [`crate::clock`]).
pub(crate) async fn store_now<T: Tx>(tx: &mut T) -> Result<Timestamp, StoreError> {
    let sql = format!("SELECT {}", tx.dialect().now_ms());
    let rows = tx.query(&sql, &[]).await?;
    let row = rows
        .first()
        .ok_or_else(|| StoreError::Corrupt("the clock query answered no row".into()))?;
    Ok(Timestamp(row.uint(0)?))
}

pub(crate) async fn counters<T: Tx>(tx: &mut T) -> Result<Counters, StoreError> {
    let rows = tx.query("SELECT name, value FROM counters", &[]).await?;
    let mut counters = Counters::default();
    for row in &rows {
        let value = row.uint(1)?;
        match row.text(0)?.as_str() {
            "foreign_handle_refusals" => counters.foreign_handle_refusals = value,
            "canonical_cas_conflicts" => counters.canonical_cas_conflicts = value,
            "late_blocks" => counters.late_blocks = value,
            "quarantine_dropped" => counters.quarantine_dropped = value,
            "tool_result_duplicates" => counters.tool_result_duplicates = value,
            _ => {}
        }
    }
    Ok(counters)
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnstile_core::manifest::{MANIFEST_FORMAT_V1, ManifestBody};

    fn target(prompt_tokens: u64) -> PreparedTarget {
        let bytes = b"{\"model\":\"m\"}".to_vec();
        let zero = Digest::of_bytes(b"");
        let body = ManifestBody {
            format: MANIFEST_FORMAT_V1.into(),
            operation_id: "op".into(),
            conversation_id: "c".into(),
            conversation_revision: Revision(1),
            sequence_digest: zero.clone(),
            adapter: "sim@1".into(),
            adapter_digest: zero.clone(),
            provider: "sim".into(),
            model: "m".into(),
            toolset_digest: zero.clone(),
            policy_digest: zero,
            max_output_tokens: 256,
            prompt_tokens,
            request_digest: Digest::of_bytes(&bytes),
        };
        PreparedTarget {
            manifest: body.seal(),
            request_bytes: bytes,
            policy: None,
        }
    }

    /// The sealed checks hash nothing: a body, manifest and policy none of whose digests match
    /// pass them (a `SealedTarget` cannot hold such a target; the hashed checks refuse it),
    /// while a bound is still refused either way.
    #[test]
    fn sealed_checks_hash_nothing_and_still_check_the_bounds() {
        let mut wrong = target(10);
        wrong.request_bytes.push(b' ');
        wrong.manifest.body.model = "not what was sealed".into();
        wrong.policy = Some(serde_json::json!({"sampling": {"temperature": 0.5}}));
        let rows = |target: &PreparedTarget, checks| {
            prepare_rows(
                &target.manifest,
                &target.request_bytes,
                target.policy.as_ref(),
                std::slice::from_ref(target),
                checks,
            )
            .unwrap()
        };
        assert!(rows(&wrong, Checks::Sealed).is_ok());
        assert_eq!(
            rows(&wrong, Checks::Hash).err(),
            Some("manifest_digest does not match the manifest")
        );
        let huge = target(u64::MAX);
        for checks in [Checks::Sealed, Checks::Hash] {
            assert_eq!(
                rows(&huge, checks).err(),
                Some("a manifest integer is above 2^53, where its digest cannot pin it")
            );
        }
        // The body's size, the number of targets and their agreement, in both modes.
        let mut oversized = target(10);
        oversized.request_bytes = vec![b' '; REQUEST_BYTES_MAX + 1];
        let mut body = oversized.manifest.body.clone();
        body.request_digest = Digest::of_bytes(&oversized.request_bytes);
        oversized.manifest = body.seal();
        let mut body = target(10).manifest.body;
        body.conversation_revision = Revision(2);
        let other = PreparedTarget {
            manifest: body.seal(),
            ..target(10)
        };
        let one = target(10);
        for checks in [Checks::Sealed, Checks::Hash] {
            assert_eq!(
                rows(&oversized, checks).err(),
                Some("request bytes exceed REQUEST_BYTES_MAX")
            );
            let too_many = vec![one.clone(); TARGETS_PER_DISPATCH_MAX];
            let refused = prepare_rows(&one.manifest, &one.request_bytes, None, &too_many, checks).unwrap();
            assert_eq!(refused.err(), Some("more targets than TARGETS_PER_DISPATCH_MAX"));
            let disagreeing = prepare_rows(
                &one.manifest,
                &one.request_bytes,
                None,
                std::slice::from_ref(&other),
                checks,
            )
            .unwrap();
            assert_eq!(
                disagreeing.err(),
                Some(
                    "a failover target's manifest is for another operation, conversation, revision or sequence"
                )
            );
        }
    }

    /// What stands in for the hashing the store no longer does: the digest check a vouched
    /// target gets, which a debug build (every `cargo test`) runs, panicking on a mismatch.
    #[test]
    fn a_vouched_target_that_does_not_match_is_caught_by_the_debug_check() {
        let mut wrong = target(10);
        wrong.request_bytes.push(b' ');
        assert_eq!(
            digests_mismatch(&wrong.manifest, &wrong.request_bytes, None),
            Some("request bytes do not match request_digest")
        );
        assert_eq!(
            digests_mismatch(&target(10).manifest, &target(10).request_bytes, None),
            None
        );
        let vouched = std::panic::catch_unwind(|| crate::SealedTarget::vouched(wrong));
        // The check is a debug assertion: a release build vouches without hashing.
        assert_eq!(vouched.is_err(), cfg!(debug_assertions));
    }
}
