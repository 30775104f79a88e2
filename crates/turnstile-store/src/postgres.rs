//! PostgreSQL ledger, for several gateway replicas on one database.
//!
//! tokio-postgres behind a deadpool pool; each operation is one READ COMMITTED transaction
//! running the shared [`crate::ops`]. Under READ COMMITTED an `UPDATE … WHERE <condition>`
//! that waits for another transaction's row lock re-evaluates its condition on the committed
//! row, so the affected-row count is the verdict of the compare-and-set, exactly as on
//! SQLite. No SERIALIZABLE isolation and no in-process lock is involved. Statements are
//! prepared once per connection (deadpool's statement cache).
//!
//! Commit grouping is PostgreSQL's own: concurrent transactions on different connections
//! share WAL flushes, so throughput with many conversations grows with the pool size.

use crate::error::StoreError;
use crate::faults::{Fault, FaultInjector};
use crate::history::{self, Checked};
use crate::migrations::{MIGRATIONS, SCHEMA_MIGRATIONS_DDL, latest};
use crate::sql::{Dialect, Row, SqlValue, Tx};
use crate::types::*;
use crate::{ConversationPage, ConversationQuery, Ledger, ops};
use bytes::BytesMut;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use serde_json::Value;
use std::error::Error as StdError;
use std::sync::Arc;
use tokio_postgres::NoTls;
use tokio_postgres::types::{IsNull, ToSql, Type};
use turnstile_core::dispatch::{DispatchState, Timestamp};
use turnstile_core::manifest::DispatchManifest;
use turnstile_core::{Generation, Revision};

/// Connections per pool unless the caller says otherwise.
pub const POOL_SIZE_DEFAULT: usize = 16;
/// Largest pool a caller may ask for.
pub const POOL_SIZE_MAX: usize = 256;
/// Advisory lock key that serialises migrations across replicas.
const MIGRATION_LOCK_KEY: i64 = 0x7475_726e_7374_696c; // "turnstil"

/// Wall-clock milliseconds, only for `schema_migrations.applied_at` (an audit column that no
/// decision reads).
pub(crate) fn wall_clock_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| {
            i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX)
        })
}

impl ToSql for SqlValue {
    fn to_sql(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, Box<dyn StdError + Sync + Send>> {
        match self {
            SqlValue::Null => Ok(IsNull::Yes),
            SqlValue::Int(value) if *ty == Type::INT4 => i32::try_from(*value)?.to_sql(ty, out),
            SqlValue::Int(value) if *ty == Type::INT2 => i16::try_from(*value)?.to_sql(ty, out),
            SqlValue::Int(value) => value.to_sql(ty, out),
            SqlValue::Text(value) => value.to_sql(ty, out),
            SqlValue::Bytes(value) => value.to_sql(ty, out),
        }
    }

    fn accepts(_ty: &Type) -> bool {
        true
    }

    tokio_postgres::types::to_sql_checked!();
}

fn row_of(row: &tokio_postgres::Row) -> Result<Row, StoreError> {
    let mut values = Vec::with_capacity(row.len());
    for (index, column) in row.columns().iter().enumerate() {
        let ty = column.type_();
        let value = if *ty == Type::INT8 {
            row.try_get::<_, Option<i64>>(index)?.map(SqlValue::Int)
        } else if *ty == Type::INT4 {
            row.try_get::<_, Option<i32>>(index)?
                .map(|value| SqlValue::Int(value.into()))
        } else if *ty == Type::BYTEA {
            row.try_get::<_, Option<Vec<u8>>>(index)?.map(SqlValue::Bytes)
        } else {
            row.try_get::<_, Option<String>>(index)?.map(SqlValue::Text)
        };
        values.push(value.unwrap_or(SqlValue::Null));
    }
    Ok(Row(values))
}

/// A transaction on a pooled connection.
pub struct PgTx<'a> {
    inner: deadpool_postgres::Transaction<'a>,
    /// A statement of this transaction changed a row (for `Ledger::write_ops`).
    wrote: bool,
}

fn is_write(sql: &str) -> bool {
    sql.starts_with("UPDATE") || sql.starts_with("INSERT") || sql.starts_with("DELETE")
}

fn is_control(sql: &str) -> bool {
    sql.starts_with("SAVEPOINT") || sql.starts_with("ROLLBACK") || sql.starts_with("RELEASE")
}

impl Tx for PgTx<'_> {
    fn dialect(&self) -> Dialect {
        Dialect::Postgres
    }

    async fn execute(&mut self, sql: &str, params: &[SqlValue]) -> Result<u64, StoreError> {
        if params.is_empty() && is_control(sql) {
            self.inner.batch_execute(sql).await?;
            return Ok(0);
        }
        let statement = self.inner.prepare_cached(sql).await?;
        let refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|param| param as &(dyn ToSql + Sync)).collect();
        let changed = self.inner.execute(&statement, &refs).await?;
        self.wrote |= changed > 0;
        Ok(changed)
    }

    async fn query(&mut self, sql: &str, params: &[SqlValue]) -> Result<Vec<Row>, StoreError> {
        let statement = self.inner.prepare_cached(sql).await?;
        let refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|param| param as &(dyn ToSql + Sync)).collect();
        let rows = self.inner.query(&statement, &refs).await?;
        self.wrote |= !rows.is_empty() && is_write(sql);
        rows.iter().map(row_of).collect()
    }
}

/// The PostgreSQL ledger. Clone-free sharing: put it behind an `Arc`.
pub struct PgLedger {
    pool: Pool,
    faults: Arc<FaultInjector>,
    write_ops: std::sync::atomic::AtomicU64,
    /// Committed transactions that changed no row (`Ledger::read_ops`).
    read_ops: std::sync::atomic::AtomicU64,
    validation: crate::history::ValidationCache,
    /// Longest one operation may take, pool wait and commit included (`store_timeout_ms`).
    timeout: std::time::Duration,
    /// The outcome of the last write transaction (`Ledger::write_failing`).
    write_health: crate::WriteHealth,
}

impl std::fmt::Debug for PgLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgLedger").finish_non_exhaustive()
    }
}

fn is_plain_identifier(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !name.as_bytes()[0].is_ascii_digit()
}

impl PgLedger {
    /// Connect a pool of `pool_size` connections (clamped to `1..=POOL_SIZE_MAX`) and migrate.
    /// With `schema`, every table lives in that schema (created if missing; lowercase letters,
    /// digits and `_` only), so one database can hold several independent ledgers (tests).
    pub async fn connect(url: &str, schema: Option<&str>, pool_size: usize) -> Result<PgLedger, StoreError> {
        PgLedger::connect_with(url, schema, pool_size, crate::StoreOptions::default()).await
    }

    /// [`PgLedger::connect`] within the bounds of `options`. Every connection gets
    /// `statement_timeout` and `lock_timeout` of `options.timeout_ms` (the database cancels a
    /// statement or lock wait past it) and an `idle_in_transaction_session_timeout` of twice that
    /// (a transaction whose client vanished mid-way releases its locks); connecting, taking a
    /// connection from the pool and the whole operation are bounded by it on this side too, for
    /// a database that answers nothing at all (frozen, or a partition that drops packets).
    pub async fn connect_with(
        url: &str,
        schema: Option<&str>,
        pool_size: usize,
        options: crate::StoreOptions,
    ) -> Result<PgLedger, StoreError> {
        let timeout_ms = options.timeout_ms.max(1);
        let timeout = std::time::Duration::from_millis(timeout_ms);
        // A URL that does not parse is the operator's to fix, not the store's to retry.
        let mut config: tokio_postgres::Config = url.parse().map_err(|_| StoreError::BadUrl)?;
        // Appended to any `options` the URL carries (a later `-c` of the same name wins).
        let mut server_options = config.get_options().unwrap_or_default().to_owned();
        server_options.push_str(&format!(
            " -c statement_timeout={timeout_ms} -c lock_timeout={timeout_ms} \
             -c idle_in_transaction_session_timeout={}",
            timeout_ms.saturating_mul(2)
        ));
        if let Some(schema) = schema {
            if !is_plain_identifier(schema) {
                return Err(StoreError::BadUrl);
            }
            server_options.push_str(&format!(" -c search_path={schema}"));
        }
        config.options(server_options.trim_start());
        config.connect_timeout(timeout);
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(pool_size.clamp(1, POOL_SIZE_MAX))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(timeout))
            .recycle_timeout(Some(timeout))
            .build()
            .map_err(|error| StoreError::Pool(error.to_string()))?;
        let ledger = PgLedger {
            pool,
            faults: Arc::new(FaultInjector::default()),
            write_ops: std::sync::atomic::AtomicU64::new(0),
            read_ops: std::sync::atomic::AtomicU64::new(0),
            validation: Default::default(),
            timeout,
            write_health: Default::default(),
        };
        ledger.migrate(schema).await?;
        Ok(ledger)
    }

    /// The fault injector of this ledger's transaction driver (tests).
    pub fn faults(&self) -> &FaultInjector {
        &self.faults
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(|error| match error {
            deadpool_postgres::PoolError::Backend(error) => StoreError::Postgres(error),
            deadpool_postgres::PoolError::Timeout(_) => StoreError::TimedOut("no connection from the pool"),
            other => StoreError::Pool(other.to_string()),
        })
    }

    async fn migrate(&self, schema: Option<&str>) -> Result<(), StoreError> {
        // The first connection: its failure is reported with its cause.
        let mut client = self.client().await.map_err(StoreError::at_connect)?;
        let tx = client.transaction().await?;
        // Migrations are not bounded by `store_timeout_ms`: a rebuild of a large table takes
        // as long as it takes, and a replica starting meanwhile waits for the migration lock
        // rather than failing its start.
        tx.batch_execute("SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0")
            .await?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK_KEY])
            .await?;
        if let Some(schema) = schema {
            // Checked by `is_plain_identifier`: no quoting needed.
            tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                .await?;
        }
        tx.batch_execute(SCHEMA_MIGRATIONS_DDL).await?;
        let current: i64 = tx
            .query_one("SELECT COALESCE(MAX(version), 0) FROM schema_migrations", &[])
            .await?
            .try_get(0)?;
        if current > latest() {
            return Err(StoreError::SchemaTooNew {
                found: current,
                known: latest(),
            });
        }
        // Every known version not applied yet, in order (not only those above the newest
        // applied: a version merged later with a lower number is applied too).
        let applied: std::collections::HashSet<i64> = tx
            .query("SELECT version FROM schema_migrations", &[])
            .await?
            .iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()?;
        for migration in MIGRATIONS
            .iter()
            .filter(|migration| !applied.contains(&migration.version))
        {
            tx.batch_execute(migration.postgres).await?;
            tx.execute(
                "INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)",
                &[&migration.version, &migration.name, &wall_clock_ms()],
            )
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

/// Run one operation in one transaction: commit on `Ok`, roll back on `Err`, and apply an
/// armed connection fault around COMMIT (the connection is discarded, as a real drop would).
macro_rules! in_tx {
    ($self:ident, |$tx:ident| $body:expr) => {{
        let mut client = match $self.client().await {
            Ok(client) => client,
            Err(error) => {
                $self.write_health.failed(&error);
                return Err(error);
            }
        };
        // Set just before COMMIT is sent: a deadline that runs out after it cannot tell
        // whether the transaction landed.
        let committing = std::sync::atomic::AtomicBool::new(false);
        let bounded = tokio::time::timeout($self.timeout, async {
            let inner = client.transaction().await?;
            let mut $tx = PgTx { inner, wrote: false };
            let result = $body.await;
            match result {
                // Dropping the transaction rolls it back.
                Err(error) => {
                    drop($tx);
                    Err(error)
                }
                Ok(value) => match $self.faults.take() {
                    None => {
                        let wrote = $tx.wrote;
                        committing.store(true, std::sync::atomic::Ordering::Relaxed);
                        $tx.inner.commit().await?;
                        let counter = if wrote { &$self.write_ops } else { &$self.read_ops };
                        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if wrote {
                            $self.write_health.committed();
                        }
                        Ok(value)
                    }
                    Some(Fault::DropBeforeCommit) => {
                        drop($tx);
                        Err(StoreError::ConnectionLost("before commit"))
                    }
                    Some(Fault::DropAfterCommit) => {
                        let wrote = $tx.wrote;
                        $tx.inner.commit().await?;
                        let counter = if wrote { &$self.write_ops } else { &$self.read_ops };
                        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        Err(StoreError::ConnectionLost("after commit"))
                    }
                },
            }
        })
        .await;
        let outcome = match bounded {
            Ok(outcome) => outcome.map_err(timed_out_on_the_server),
            // The database answered nothing within the bound (frozen, or a partition): the
            // transaction is abandoned with its connection, and the server rolls it back when
            // it sees the connection gone.
            Err(_) if committing.load(std::sync::atomic::Ordering::Relaxed) => Err(
                StoreError::ConnectionLost("no answer to COMMIT within store_timeout_ms"),
            ),
            Err(_) => Err(StoreError::TimedOut("no answer within store_timeout_ms")),
        };
        if matches!(
            outcome,
            Err(StoreError::ConnectionLost(_) | StoreError::TimedOut(_))
        ) {
            // Discard the connection instead of returning it to the pool, as a real drop would:
            // after a deadline it may still carry the abandoned transaction.
            drop(deadpool_postgres::Object::take(client));
        }
        if let Err(error) = &outcome {
            $self.write_health.failed(error);
        }
        outcome
    }};
}

/// A statement or lock wait the database cancelled at `statement_timeout` / `lock_timeout`
/// (SQLSTATE 57014 / 55P03) is [`StoreError::TimedOut`]; anything else is left as it is.
fn timed_out_on_the_server(error: StoreError) -> StoreError {
    match &error {
        StoreError::Postgres(cause)
            if cause.code().is_some_and(|code| {
                *code == tokio_postgres::error::SqlState::QUERY_CANCELED
                    || *code == tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE
            }) =>
        {
            StoreError::TimedOut("the database cancelled a wait at store_timeout_ms")
        }
        _ => error,
    }
}

/// Sealed targets out of their seals, with their rows (`Checks::Sealed`: nothing hashed) or
/// why they are `Invalid`.
#[allow(clippy::type_complexity)]
fn unsealed(
    target: SealedTarget,
    fallbacks: Vec<SealedTarget>,
) -> Result<
    (
        PreparedTarget,
        Vec<PreparedTarget>,
        Result<ops::PrepareRows, &'static str>,
    ),
    StoreError,
> {
    let target = target.into_target();
    let fallbacks: Vec<PreparedTarget> = fallbacks.into_iter().map(SealedTarget::into_target).collect();
    let rows = ops::prepare_rows(
        &target.manifest,
        &target.request_bytes,
        target.policy.as_ref(),
        &fallbacks,
        ops::Checks::Sealed,
    )?;
    Ok((target, fallbacks, rows))
}

impl PgLedger {
    /// The transaction of a prepare whose inputs are checked: with `begin`,
    /// [`ops::prepare_and_begin`], else [`ops::prepare_targets`].
    async fn prepare_with_rows(
        &self,
        manifest: &DispatchManifest,
        request_bytes: &[u8],
        fallbacks: &[PreparedTarget],
        rows: ops::PrepareRows,
        begin: Option<&BeginAtOnce>,
        now: Timestamp,
    ) -> Result<(PrepareOutcome, Option<BeginOutcome>), StoreError> {
        match begin {
            Some(begin) => in_tx!(self, |tx| ops::prepare_and_begin(
                &mut tx,
                manifest,
                request_bytes,
                fallbacks,
                rows,
                begin,
                now
            )),
            None => in_tx!(self, |tx| ops::prepare_targets(
                &mut tx,
                manifest,
                request_bytes,
                fallbacks,
                rows,
                now
            ))
            .map(|outcome| (outcome, None)),
        }
    }

    /// The transaction of an import and its prepare, the history and the prepare's inputs
    /// checked.
    #[allow(clippy::too_many_arguments)]
    async fn import_rows(
        &self,
        conversation_id: &str,
        tools: &Value,
        checked: history::CheckedImport,
        manifest: &DispatchManifest,
        request_bytes: &[u8],
        fallbacks: &[PreparedTarget],
        rows: ops::PrepareRows,
        begin: Option<&BeginAtOnce>,
        now: Timestamp,
    ) -> Result<ImportPrepared, StoreError> {
        let outcome = in_tx!(self, |tx| ops::import_and_prepare(
            &mut tx,
            conversation_id,
            tools,
            &checked,
            manifest,
            request_bytes,
            fallbacks,
            rows,
            begin,
            now
        ))?;
        if let ImportPrepared::Prepared { revision, .. } = &outcome
            && let Some(history) = checked.history
        {
            self.validation.put(Checked {
                conversation_id: conversation_id.to_owned(),
                revision: *revision,
                history,
            });
        }
        Ok(outcome)
    }
}

#[async_trait::async_trait]
impl Ledger for PgLedger {
    fn history_walks(&self) -> u64 {
        self.validation.walks()
    }

    fn history_walks_in_transaction(&self) -> u64 {
        self.validation.walks_in_transaction()
    }

    fn write_ops(&self) -> u64 {
        self.write_ops.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn read_ops(&self) -> u64 {
        self.read_ops.load(std::sync::atomic::Ordering::Relaxed)
    }

    async fn create_conversation(
        &self,
        conversation_id: &str,
        tools: &Value,
        now: Timestamp,
    ) -> Result<CreateOutcome, StoreError> {
        let created = in_tx!(self, |tx| ops::create_conversation(
            &mut tx,
            conversation_id,
            tools,
            now
        ))?;
        if created == CreateOutcome::Created {
            // The state of the empty history, so that its first append checks its own turn.
            if let Some(checked) = history::state_at(conversation_id, tools, Vec::new(), Revision(0)) {
                self.validation.put(checked);
            }
        }
        Ok(created)
    }

    async fn import_conversation(
        &self,
        conversation_id: &str,
        tools: &Value,
        turns: &[Value],
        now: Timestamp,
    ) -> Result<ImportOutcome, StoreError> {
        // Stamped and validated before the transaction, as on SQLite.
        let checked = match history::check_import(conversation_id, tools, turns) {
            Ok(checked) => checked,
            Err(violations) => return Ok(ImportOutcome::Rejected(violations)),
        };
        let outcome = in_tx!(self, |tx| ops::import_conversation(
            &mut tx,
            conversation_id,
            tools,
            &checked,
            now
        ))?;
        if let ImportOutcome::Created { revision } = outcome
            && let Some(history) = checked.history
        {
            self.validation.put(Checked {
                conversation_id: conversation_id.to_owned(),
                revision,
                history,
            });
        }
        Ok(outcome)
    }

    async fn conversations_with_call(
        &self,
        call_id: &str,
        id_prefix: &str,
    ) -> Result<Vec<String>, StoreError> {
        in_tx!(self, |tx| ops::conversations_with_call(
            &mut tx, call_id, id_prefix
        ))
    }

    async fn conversation(&self, conversation_id: &str) -> Result<Option<Value>, StoreError> {
        in_tx!(self, |tx| ops::conversation(&mut tx, conversation_id))
    }

    async fn conversation_with_digests(
        &self,
        conversation_id: &str,
    ) -> Result<Option<StoredConversation>, StoreError> {
        in_tx!(self, |tx| ops::conversation_with_digests(
            &mut tx,
            conversation_id
        ))
    }

    async fn conversation_since(
        &self,
        conversation_id: &str,
        after: Revision,
    ) -> Result<Option<ConversationTail>, StoreError> {
        in_tx!(self, |tx| ops::conversation_since(
            &mut tx,
            conversation_id,
            after
        ))
    }

    async fn append_turn(
        &self,
        conversation_id: &str,
        expected: Revision,
        turn: &Value,
        now: Timestamp,
    ) -> Result<AppendOutcome, StoreError> {
        let mut next = None;
        let outcome = in_tx!(self, |tx| ops::append_turn(
            &mut tx,
            conversation_id,
            expected,
            turn,
            &history::States {
                cache: &self.validation,
                walk: true,
            },
            &mut next,
            now
        ))?;
        if let Some(next) = next {
            self.validation.put(next);
        }
        Ok(outcome)
    }

    async fn append_repair(
        &self,
        conversation_id: &str,
        expected: Revision,
        turn: &Value,
        repair: &NewRepair,
        now: Timestamp,
    ) -> Result<AppendOutcome, StoreError> {
        let mut next = None;
        let outcome = in_tx!(self, |tx| ops::append_repair(
            &mut tx,
            conversation_id,
            expected,
            turn,
            repair,
            &history::States {
                cache: &self.validation,
                walk: true,
            },
            &mut next,
            now
        ))?;
        if let Some(next) = next {
            self.validation.put(next);
        }
        Ok(outcome)
    }

    async fn repairs(&self, conversation_id: &str) -> Result<Vec<RepairRecord>, StoreError> {
        in_tx!(self, |tx| ops::repairs(&mut tx, conversation_id))
    }

    async fn prepare_with_policy(
        &self,
        manifest: &DispatchManifest,
        request_bytes: &[u8],
        policy: Option<&Value>,
        now: Timestamp,
    ) -> Result<PrepareOutcome, StoreError> {
        self.prepare_targets(manifest, request_bytes, policy, &[], now)
            .await
    }

    async fn prepare_targets(
        &self,
        manifest: &DispatchManifest,
        request_bytes: &[u8],
        policy: Option<&Value>,
        fallbacks: &[PreparedTarget],
        now: Timestamp,
    ) -> Result<PrepareOutcome, StoreError> {
        // Checked before the transaction, as on SQLite.
        let rows = match ops::prepare_rows(manifest, request_bytes, policy, fallbacks, ops::Checks::Hash)? {
            Ok(rows) => rows,
            Err(why) => return Ok(PrepareOutcome::Invalid(why)),
        };
        self.prepare_with_rows(manifest, request_bytes, fallbacks, rows, None, now)
            .await
            .map(|(outcome, _)| outcome)
    }

    async fn prepare_and_begin(
        &self,
        manifest: &DispatchManifest,
        request_bytes: &[u8],
        policy: Option<&Value>,
        fallbacks: &[PreparedTarget],
        begin: &BeginAtOnce,
        now: Timestamp,
    ) -> Result<(PrepareOutcome, Option<BeginOutcome>), StoreError> {
        // Checked before the transaction, as on SQLite.
        let rows = match ops::prepare_rows(manifest, request_bytes, policy, fallbacks, ops::Checks::Hash)? {
            Ok(rows) => rows,
            Err(why) => return Ok((PrepareOutcome::Invalid(why), None)),
        };
        self.prepare_with_rows(manifest, request_bytes, fallbacks, rows, Some(begin), now)
            .await
    }

    async fn import_and_prepare(
        &self,
        conversation_id: &str,
        tools: &Value,
        turns: &[Value],
        manifest: &DispatchManifest,
        request_bytes: &[u8],
        policy: Option<&Value>,
        fallbacks: &[PreparedTarget],
        begin: Option<&BeginAtOnce>,
        now: Timestamp,
    ) -> Result<ImportPrepared, StoreError> {
        let checked = match history::check_import(conversation_id, tools, turns) {
            Ok(checked) => checked,
            Err(violations) => return Ok(ImportPrepared::NotImported(ImportOutcome::Rejected(violations))),
        };
        let rows = match ops::prepare_rows(manifest, request_bytes, policy, fallbacks, ops::Checks::Hash)? {
            Ok(rows) => rows,
            Err(why) => return Ok(ImportPrepared::NotPrepared(PrepareOutcome::Invalid(why))),
        };
        self.import_rows(
            conversation_id,
            tools,
            checked,
            manifest,
            request_bytes,
            fallbacks,
            rows,
            begin,
            now,
        )
        .await
    }

    async fn prepare_sealed(
        &self,
        target: SealedTarget,
        fallbacks: Vec<SealedTarget>,
        begin: Option<&BeginAtOnce>,
        now: Timestamp,
    ) -> Result<(PrepareOutcome, Option<BeginOutcome>), StoreError> {
        let (target, fallbacks, rows) = unsealed(target, fallbacks)?;
        let rows = match rows {
            Ok(rows) => rows,
            Err(why) => return Ok((PrepareOutcome::Invalid(why), None)),
        };
        self.prepare_with_rows(
            &target.manifest,
            &target.request_bytes,
            &fallbacks,
            rows,
            begin,
            now,
        )
        .await
    }

    async fn import_and_prepare_sealed(
        &self,
        conversation_id: &str,
        tools: &Value,
        turns: &[Value],
        target: SealedTarget,
        fallbacks: Vec<SealedTarget>,
        begin: Option<&BeginAtOnce>,
        now: Timestamp,
    ) -> Result<ImportPrepared, StoreError> {
        let checked = match history::check_import(conversation_id, tools, turns) {
            Ok(checked) => checked,
            Err(violations) => return Ok(ImportPrepared::NotImported(ImportOutcome::Rejected(violations))),
        };
        let (target, fallbacks, rows) = unsealed(target, fallbacks)?;
        let rows = match rows {
            Ok(rows) => rows,
            Err(why) => return Ok(ImportPrepared::NotPrepared(PrepareOutcome::Invalid(why))),
        };
        self.import_rows(
            conversation_id,
            tools,
            checked,
            &target.manifest,
            &target.request_bytes,
            &fallbacks,
            rows,
            begin,
            now,
        )
        .await
    }

    async fn dispatch_fallbacks(&self, operation_id: &str) -> Result<Vec<TargetRecord>, StoreError> {
        in_tx!(self, |tx| ops::dispatch_fallbacks(&mut tx, operation_id))
    }

    async fn dispatch_policy(&self, operation_id: &str) -> Result<Option<Value>, StoreError> {
        in_tx!(self, |tx| ops::dispatch_policy(&mut tx, operation_id))
    }

    async fn dispatch(&self, operation_id: &str) -> Result<Option<DispatchRecord>, StoreError> {
        in_tx!(self, |tx| ops::dispatch(&mut tx, operation_id))
    }

    async fn attempts(&self, operation_id: &str) -> Result<Vec<AttemptRecord>, StoreError> {
        in_tx!(self, |tx| ops::attempts(&mut tx, operation_id))
    }

    async fn begin_attempt(
        &self,
        operation_id: &str,
        expect: BeginExpect,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<BeginOutcome, StoreError> {
        in_tx!(self, |tx| ops::begin_attempt(
            &mut tx,
            operation_id,
            expect,
            lease,
            now
        ))
    }

    async fn transition(
        &self,
        operation_id: &str,
        generation: Generation,
        from: DispatchState,
        to: DispatchState,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        in_tx!(self, |tx| ops::transition(
            &mut tx,
            operation_id,
            generation,
            from,
            to,
            now
        ))
    }

    async fn fail_over(
        &self,
        operation_id: &str,
        generation: Generation,
        from: DispatchState,
        reason: &str,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        in_tx!(self, |tx| ops::fail_over(
            &mut tx,
            operation_id,
            generation,
            from,
            reason,
            now
        ))
    }

    async fn end_attempt(
        &self,
        operation_id: &str,
        generation: Generation,
        from: DispatchState,
        to: DispatchState,
        reason: &str,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        in_tx!(self, |tx| ops::end_attempt(
            &mut tx,
            operation_id,
            generation,
            from,
            to,
            Some(reason),
            now
        ))
    }

    async fn replay_attempt(
        &self,
        operation_id: &str,
        generation: Generation,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        in_tx!(self, |tx| ops::replay_attempt(
            &mut tx,
            operation_id,
            generation,
            lease,
            now
        ))
    }

    async fn resume_attempt(
        &self,
        operation_id: &str,
        generation: Generation,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        in_tx!(self, |tx| ops::resume_attempt(
            &mut tx,
            operation_id,
            generation,
            lease,
            now
        ))
    }

    async fn abandon_on_provider_word(
        &self,
        operation_id: &str,
        generation: Generation,
        provider_word: &str,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        in_tx!(self, |tx| ops::abandon_and_rearm_on(
            &mut tx,
            operation_id,
            generation,
            true,
            Some(provider_word),
            now
        ))
    }

    async fn abandon_and_rearm(
        &self,
        operation_id: &str,
        generation: Generation,
        provider_confirmed_ended: bool,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        in_tx!(self, |tx| ops::abandon_and_rearm(
            &mut tx,
            operation_id,
            generation,
            provider_confirmed_ended,
            now
        ))
    }

    async fn renew_lease(
        &self,
        operation_id: &str,
        generation: Generation,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        in_tx!(self, |tx| ops::renew_lease(
            &mut tx,
            operation_id,
            generation,
            lease,
            now
        ))
    }

    async fn bind_handle(
        &self,
        operation_id: &str,
        generation: Generation,
        handle: &str,
        now: Timestamp,
    ) -> Result<BindOutcome, StoreError> {
        in_tx!(self, |tx| ops::bind_handle(
            &mut tx,
            operation_id,
            generation,
            handle,
            now
        ))
    }

    async fn cancel(
        &self,
        operation_id: &str,
        expected_cancel_generation: Option<u64>,
        now: Timestamp,
    ) -> Result<CancelOutcome, StoreError> {
        in_tx!(self, |tx| ops::cancel(
            &mut tx,
            operation_id,
            expected_cancel_generation,
            now
        ))
    }

    async fn commit_carrying(
        &self,
        operation_id: &str,
        generation: Generation,
        expected_revision: Revision,
        turn: &Value,
        outcome: Option<&Value>,
        carried: &Carried,
        now: Timestamp,
    ) -> Result<CommitOutcome, StoreError> {
        let mut next = None;
        let outcome = in_tx!(self, |tx| ops::commit(
            &mut tx,
            operation_id,
            generation,
            expected_revision,
            turn,
            outcome,
            carried,
            &history::States {
                cache: &self.validation,
                walk: true,
            },
            &mut next,
            now
        ))?;
        // Kept only now: the transaction that wrote this revision committed.
        if let Some(next) = next {
            self.validation.put(next);
        }
        Ok(outcome)
    }

    async fn quarantine(&self, entry: &QuarantineEntry, now: Timestamp) -> Result<bool, StoreError> {
        in_tx!(self, |tx| ops::quarantine(&mut tx, entry, now))
    }

    async fn quarantined(&self, limit: u64) -> Result<Vec<QuarantineRecord>, StoreError> {
        in_tx!(self, |tx| ops::quarantined(&mut tx, limit))
    }

    async fn tool_calls(&self, state: Option<ToolCallState>) -> Result<Vec<ToolCallRecord>, StoreError> {
        in_tx!(self, |tx| ops::tool_calls(&mut tx, state))
    }

    async fn claim_tool_call(
        &self,
        conversation_id: &str,
        call_id: &str,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<ClaimOutcome, StoreError> {
        in_tx!(self, |tx| ops::claim_tool_call(
            &mut tx,
            conversation_id,
            call_id,
            lease,
            now
        ))
    }

    async fn submit_tool_result(
        &self,
        conversation_id: &str,
        call_id: &str,
        claim: u64,
        status: &str,
        content: &Value,
        now: Timestamp,
    ) -> Result<ResultOutcome, StoreError> {
        let mut next = None;
        let outcome = in_tx!(self, |tx| ops::submit_tool_result(
            &mut tx,
            conversation_id,
            call_id,
            claim,
            status,
            content,
            &history::States {
                cache: &self.validation,
                walk: true,
            },
            &mut next,
            now
        ))?;
        if let Some(next) = next {
            self.validation.put(next);
        }
        Ok(outcome)
    }

    async fn recover_startup(&self, holder: &str, now: Timestamp) -> Result<RecoveryReport, StoreError> {
        in_tx!(self, |tx| ops::recover_startup(&mut tx, holder, now))
    }

    async fn release_holder(&self, holder: &str, now: Timestamp) -> Result<u64, StoreError> {
        in_tx!(self, |tx| ops::release_holder(&mut tx, holder, now))
    }

    async fn counters(&self) -> Result<Counters, StoreError> {
        in_tx!(self, |tx| ops::counters(&mut tx))
    }

    fn write_failing(&self) -> bool {
        self.write_health.failing()
    }

    async fn write_probe(&self) -> Result<(), StoreError> {
        in_tx!(self, |tx| ops::write_probe(&mut tx))
    }

    async fn prepared_unattended(&self, idle_ms: u64, limit: u64) -> Result<Vec<String>, StoreError> {
        in_tx!(self, |tx| ops::prepared_unattended(&mut tx, idle_ms, limit))
    }

    async fn stuck_age_ms(&self) -> Result<u64, StoreError> {
        in_tx!(self, |tx| ops::stuck_age_ms(&mut tx))
    }

    async fn store_now(&self) -> Result<Timestamp, StoreError> {
        in_tx!(self, |tx| ops::store_now(&mut tx))
    }

    async fn claim_call(
        &self,
        conversation_id: &str,
        call_id: &str,
        holder: &str,
        lease_ms: u64,
    ) -> Result<CallClaimOutcome, StoreError> {
        in_tx!(self, |tx| ops::claim_call(
            &mut tx,
            conversation_id,
            call_id,
            holder,
            lease_ms
        ))
    }

    async fn renew_call(
        &self,
        conversation_id: &str,
        call_id: &str,
        claim: u64,
        lease_ms: u64,
    ) -> Result<RenewOutcome, StoreError> {
        in_tx!(self, |tx| ops::renew_call(
            &mut tx,
            conversation_id,
            call_id,
            claim,
            lease_ms
        ))
    }

    async fn release_call(
        &self,
        conversation_id: &str,
        call_id: &str,
        claim: u64,
    ) -> Result<ReleaseOutcome, StoreError> {
        in_tx!(self, |tx| ops::release_call(
            &mut tx,
            conversation_id,
            call_id,
            claim
        ))
    }

    async fn hand_to_client(
        &self,
        conversation_id: &str,
        call_id: &str,
        holder: &str,
        bound_ms: u64,
    ) -> Result<bool, StoreError> {
        in_tx!(self, |tx| ops::hand_to_client(
            &mut tx,
            conversation_id,
            call_id,
            holder,
            bound_ms
        ))
    }

    async fn abandon_client_calls(
        &self,
        conversation_id: &str,
        revision: Revision,
    ) -> Result<u64, StoreError> {
        in_tx!(self, |tx| ops::abandon_client_calls(
            &mut tx,
            conversation_id,
            revision
        ))
    }

    async fn conversation_page(&self, query: &ConversationQuery) -> Result<ConversationPage, StoreError> {
        in_tx!(self, |tx| crate::listing::conversations(&mut tx, query))
    }

    async fn quarantine_page(
        &self,
        id_prefix: &str,
        before: Option<i64>,
        limit: u64,
    ) -> Result<crate::listing::QuarantinePage, StoreError> {
        in_tx!(self, |tx| crate::listing::quarantine_page(
            &mut tx, id_prefix, before, limit
        ))
    }

    async fn record_evidence(
        &self,
        operation_id: &str,
        rows: &[(Generation, Value)],
        now: Timestamp,
    ) -> Result<(), StoreError> {
        in_tx!(self, |tx| ops::insert_evidence(&mut tx, operation_id, rows, now))
    }

    async fn evidence(&self, operation_id: &str) -> Result<Vec<(Generation, Value)>, StoreError> {
        in_tx!(self, |tx| ops::evidence(&mut tx, operation_id))
    }
}
