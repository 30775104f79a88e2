//! Read-only listings for people running a gateway: conversations most recently updated first
//! (cursor paged, searched by a substring of the id, filtered by the last dispatch's state or
//! provider and by calls awaiting a result) and the quarantine log newest first (paged by row
//! id). Tenant scoping is an id prefix compared with `substr`, never `LIKE` (a tenant name may
//! hold `%` or `_`), and a search matches only the part of the id after that prefix, so a
//! tenant can never find a conversation by its own tenant's name.
//!
//! Both listings are keyset-paged: a page is one indexed range scan from the cursor
//! (`conversations_by_update`, migration 5; the quarantine's primary key), whatever the depth,
//! and a row that moves while a client pages (a conversation updated again) is seen again on
//! the first page, never duplicated within one walk of older pages.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a listing shows a tenant only its own conversations, each once across pages, newest first; a
//!   search matches only the id after the tenant prefix. Enforced in
//!   `store/src/listing.rs::conversations` (`substr` prefix, keyset on `(updated_at, id)`). Tests:
//!   `store/tests/it/listing.rs::conversations_are_listed_newest_first_paged_searched_and_tenant_scoped`
//!   (SQLite and PostgreSQL; red with the prefix test dropped and with `<=` in the cursor),
//!   `gateway/tests/it/console_api.rs::conversations_are_listed…`.
//! - the quarantine is listed newest first, paged, per tenant. Enforced in
//!   `listing.rs::quarantine_page`. Tests:
//!   `listing.rs::the_quarantine_pages_newest_first_within_a_prefix` (red with `ORDER BY id`).

use crate::error::StoreError;
use crate::ops::quarantine_record;
use crate::sql::{Dialect, SqlValue, Tx};
use crate::types::QuarantineRecord;
use turnstile_core::Revision;
use turnstile_core::dispatch::{DispatchState, Timestamp};

/// Most conversations one listing page answers (the spec's `limit` maximum).
pub const CONVERSATIONS_PAGE_MAX: u64 = 500;
/// Most quarantine entries one page answers.
pub const QUARANTINE_PAGE_MAX: u64 = 500;
/// Longest search text (`q`), in bytes: ids are at most 128 bytes, longer text matches nothing.
pub const SEARCH_BYTES_MAX: usize = 256;

/// Where a page of conversations continues: the last row of the page before, in listing order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConversationCursor {
    /// Its `updated_at`.
    pub updated_at: Timestamp,
    /// Its store id.
    pub conversation_id: String,
}

/// Whether a conversation has calls awaiting a result (any state but `done` and
/// `client_abandoned`, by the store's clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PendingFilter {
    /// Only conversations with at least one.
    Some,
    /// Only conversations with none.
    None,
}

/// What to list.
#[derive(Clone, Debug, Default)]
pub struct ConversationQuery {
    /// Store ids start with this (the tenant's prefix; "" without tenants).
    pub id_prefix: String,
    /// A substring of the id after the prefix ("" matches every id).
    pub search: String,
    /// Continue after this row.
    pub after: Option<ConversationCursor>,
    /// Only conversations whose last dispatch is in this state.
    pub state: Option<DispatchState>,
    /// Only conversations whose last dispatch went to this provider.
    pub provider: Option<String>,
    /// Only conversations with (or without) calls awaiting a result.
    pub pending: Option<PendingFilter>,
    /// Page size, 1..=[`CONVERSATIONS_PAGE_MAX`].
    pub limit: u64,
}

/// The newest dispatch of a conversation (by creation time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LastDispatch {
    /// Its store operation id.
    pub operation_id: String,
    /// Its state.
    pub state: DispatchState,
    /// The provider it was prepared for.
    pub provider: String,
}

/// One listed conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConversationSummary {
    /// Store id.
    pub conversation_id: String,
    /// Committed turns.
    pub revision: Revision,
    /// Time of its last committed change (creation, turn, commit), as passed in by the writer.
    pub updated_at: Timestamp,
    /// Its newest dispatch, if any.
    pub last_dispatch: Option<LastDispatch>,
    /// Its calls awaiting a result (tool-call ledger rows neither `done` nor `client_abandoned`,
    /// by the store's clock at the read).
    pub pending_calls: u64,
}

/// One page of conversations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConversationPage {
    /// Most recently updated first.
    pub conversations: Vec<ConversationSummary>,
    /// Where the next page starts; `None` on the last page.
    pub next: Option<ConversationCursor>,
}

/// Numbered parameters for SQL assembled from optional conditions.
struct Params(Vec<SqlValue>);

impl Params {
    fn bind(&mut self, value: SqlValue) -> String {
        self.0.push(value);
        format!("${}", self.0.len())
    }
}

/// A page of conversations (see the module doc).
pub(crate) async fn conversations<T: Tx>(
    tx: &mut T,
    query: &ConversationQuery,
) -> Result<ConversationPage, StoreError> {
    assert!(
        (1..=CONVERSATIONS_PAGE_MAX).contains(&query.limit),
        "the caller bounds the page size"
    );
    let mut params = Params(Vec::new());
    let prefix_chars = query.id_prefix.chars().count() as u64;
    let prefix_len = params.bind(prefix_chars.into());
    let prefix = params.bind(query.id_prefix.as_str().into());
    let mut inner = format!("substr(c.conversation_id, 1, {prefix_len}) = {prefix}");
    if !query.search.is_empty() {
        let search = params.bind(query.search.as_str().into());
        let position = match tx.dialect() {
            Dialect::Sqlite => "instr",
            Dialect::Postgres => "strpos",
        };
        inner.push_str(&format!(
            " AND {position}(substr(c.conversation_id, {prefix_len} + 1), {search}) > 0"
        ));
    }
    if let Some(after) = &query.after {
        let at = params.bind(after.updated_at.0.into());
        let id = params.bind(after.conversation_id.as_str().into());
        inner.push_str(&format!(
            " AND (c.updated_at < {at} OR (c.updated_at = {at} AND c.conversation_id < {id}))"
        ));
    }
    let mut outer = vec!["TRUE".to_owned()];
    if let Some(state) = query.state {
        outer.push(format!("state = {}", params.bind(state.as_str().into())));
    }
    if let Some(provider) = &query.provider {
        outer.push(format!("provider = {}", params.bind(provider.as_str().into())));
    }
    match query.pending {
        Some(PendingFilter::Some) => outer.push("pending > 0".into()),
        Some(PendingFilter::None) => outer.push("pending = 0".into()),
        None => {}
    }
    // One row more than the page tells whether another page follows.
    let fetch = params.bind((query.limit + 1).into());
    let sql = format!(
        "SELECT conversation_id, revision, updated_at, operation_id, state, provider, pending FROM (\
           SELECT c.conversation_id, c.revision, c.updated_at, d.operation_id, d.state, d.provider, \
             (SELECT COUNT(*) FROM tool_calls t WHERE t.conversation_id = c.conversation_id \
                AND {pending}) AS pending \
           FROM conversations c LEFT JOIN dispatches d ON d.operation_id = (\
             SELECT x.operation_id FROM dispatches x WHERE x.conversation_id = c.conversation_id \
             ORDER BY x.created_at DESC, x.operation_id DESC LIMIT 1) \
           WHERE {inner}) AS listed \
         WHERE {} ORDER BY updated_at DESC, conversation_id DESC LIMIT {fetch}",
        outer.join(" AND "),
        pending = crate::ops::pending_sql(tx.dialect(), "t"),
    );
    let rows = tx.query(&sql, &params.0).await?;
    let mut conversations = Vec::with_capacity(rows.len());
    for row in &rows {
        let last_dispatch = match (row.text_opt(3)?, row.text_opt(4)?, row.text_opt(5)?) {
            (Some(operation_id), Some(state), Some(provider)) => Some(LastDispatch {
                operation_id,
                state: DispatchState::parse(&state)
                    .ok_or_else(|| StoreError::Corrupt(format!("unknown state {state:?}")))?,
                provider,
            }),
            _ => None,
        };
        conversations.push(ConversationSummary {
            conversation_id: row.text(0)?,
            revision: Revision(row.uint(1)?),
            updated_at: Timestamp(row.uint(2)?),
            last_dispatch,
            pending_calls: row.uint(6)?,
        });
    }
    let next = if conversations.len() as u64 > query.limit {
        conversations.truncate(query.limit as usize);
        conversations.last().map(|last| ConversationCursor {
            updated_at: last.updated_at,
            conversation_id: last.conversation_id.clone(),
        })
    } else {
        None
    };
    Ok(ConversationPage { conversations, next })
}

/// One page of the quarantine log.
#[derive(Clone, Debug, PartialEq)]
pub struct QuarantinePage {
    /// Newest first.
    pub entries: Vec<QuarantineRecord>,
    /// The `before` of the next page; `None` on the last page.
    pub next: Option<i64>,
}

/// Quarantine entries of dispatches whose ids start with `id_prefix`, newest first, older than
/// row `before` when given; at most `limit` (1..=[`QUARANTINE_PAGE_MAX`]).
pub(crate) async fn quarantine_page<T: Tx>(
    tx: &mut T,
    id_prefix: &str,
    before: Option<i64>,
    limit: u64,
) -> Result<QuarantinePage, StoreError> {
    assert!(
        (1..=QUARANTINE_PAGE_MAX).contains(&limit),
        "the caller bounds the page size"
    );
    let mut params = Params(Vec::new());
    let prefix_len = params.bind((id_prefix.chars().count() as u64).into());
    let prefix = params.bind(id_prefix.into());
    let mut condition = format!("substr(operation_id, 1, {prefix_len}) = {prefix}");
    if let Some(before) = before {
        condition.push_str(&format!(" AND id < {}", params.bind(before.into())));
    }
    let fetch = params.bind((limit + 1).into());
    let sql = format!(
        "SELECT id, operation_id, generation, reason, content, at FROM quarantine \
         WHERE {condition} ORDER BY id DESC LIMIT {fetch}"
    );
    let rows = tx.query(&sql, &params.0).await?;
    let mut entries = rows
        .iter()
        .map(quarantine_record)
        .collect::<Result<Vec<_>, StoreError>>()?;
    let next = if entries.len() as u64 > limit {
        entries.truncate(limit as usize);
        entries.last().map(|last| last.id)
    } else {
        None
    };
    Ok(QuarantinePage { entries, next })
}
