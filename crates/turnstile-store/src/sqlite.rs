//! SQLite ledger: the embedded default.
//!
//! **One writer thread with group commit.** rusqlite is synchronous; rather than
//! `spawn_blocking` per call (a pool of threads that would only queue on SQLite's single write
//! lock), each [`SqliteLedger`] owns one connection on one dedicated thread. Callers send an
//! operation and await its answer. The thread drains whatever operations are queued, runs
//! them in one `BEGIN IMMEDIATE` transaction, takes in those queued meanwhile (up to
//! `GROUP_COMMIT_OPS_MAX` in all), commits once, and only then answers all of them. The
//! operations run bare; when one fails after writing, the group is rolled back and run again
//! with each operation inside its own `SAVEPOINT`, so an operation that fails rolls back
//! alone either way ([`run_batch`]). One
//! fsync covers the whole group, so concurrent conversations share the durability cost; a
//! lone writer pays one fsync per operation. The outcome of each
//! operation still comes only from its own conditional writes: batching changes when the
//! fsync happens, never who wins. Two `SqliteLedger`s on one file (two "replicas") exclude
//! each other through SQLite's write lock (`busy_timeout`).
//!
//! **Reads do not queue.** Only writes go to the writer thread. A read-only operation runs on
//! the calling thread, on a pooled reader connection (`query_only`), in one `BEGIN DEFERRED`
//! transaction: one WAL snapshot, which holds every write acknowledged before the read began
//! (the writer answers only after its commit). The cost is that a read blocks its async
//! worker for as long as the query takes (they are indexed lookups, plus decoding the turns
//! of `conversation`), and a reader that finds the database busy (WAL recovery by another
//! process after a crash) waits up to `busy_timeout` like the writer does.
//!
//! **Durability.** WAL mode with `synchronous=FULL` by default: the WAL is fsynced at every
//! commit, so an acknowledged transition (in particular DISPATCHING, the acceptance point)
//! survives power loss. `synchronous=NORMAL` ([`Synchronous::Normal`]) fsyncs only at
//! checkpoints: still safe against a process crash and never corrupt, but the last
//! acknowledged transactions can roll back after a power loss or OS crash, which means a
//! request may have been sent for an attempt whose DISPATCHING row is gone. Use it only where
//! that is acceptable (tests, throwaway gateways). On Linux each sync is an `fdatasync(2)`:
//! the bundled SQLite is built with `HAVE_FDATASYNC` (`.cargo/config.toml`), which writes the
//! data and the size a later read needs, not the mtime.
//!
//! **Checkpoints off the writer.** The writer's WAL hook wakes a checkpoint thread of the
//! ledger's own, which copies the WAL back into the database file on its own connection while
//! the writer goes on committing; the writer checkpoints itself only when the WAL outgrew its
//! bound ([`start_checkpointer`]).
//!
//! Also: a cached statement is never parsed again (`SQLITE_DBCONFIG_ENABLE_QPSG`), statement
//! journals are kept in memory, a new file gets 2 KiB pages, reads run on up to 8 idle `query_only`
//! reader connections, and the bundled SQLite is built with `SQLITE_DEFAULT_MEMSTATUS=0` and two
//! other recommended options (`.cargo/config.toml`).
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a SQLite group commit keeps exactly the writes of its operations that succeeded: a failed
//!   operation's writes are rolled back alone, the others commit once. Enforced in
//!   `store/src/sqlite.rs::run_batch` (operations run bare; one that fails or panics after writing
//!   rolls the group back, and `run_in_savepoints` runs it again, a savepoint per operation).
//!   Tests:
//!   `store/src/sqlite.rs::tests::a_group_commit_keeps_the_writes_of_the_operations_that_succeeded_and_only_those`
//!   (failures first, between, last, everywhere, and the write count; red with a failed savepoint
//!   released instead of rolled back, and red with a failure after writing not rolling the group
//!   back).

use crate::clock::StoreClock;
use crate::error::StoreError;
use crate::faults::{Fault, FaultInjector};
use crate::history::{self, Checked, ValidationCache};
use crate::migrations::{MIGRATIONS, SCHEMA_MIGRATIONS_DDL, latest};
use crate::sql::{Dialect, Row, SqlValue, Tx, block_on_ready};
use crate::types::*;
use crate::{ConversationPage, ConversationQuery, Ledger, ops};
use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::{Connection, OptionalExtension};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use turnstile_core::dispatch::{DispatchState, Timestamp};
use turnstile_core::manifest::DispatchManifest;
use turnstile_core::{Generation, Revision};

/// SQLite's `synchronous` setting for the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Synchronous {
    /// fsync the WAL at every commit (the default: acknowledged = durable).
    Full,
    /// fsync only at checkpoints (see the module docs for what can be lost).
    Normal,
}

/// How a group commit ended, handed to each operation's reply.
#[derive(Clone, Debug)]
enum BatchEnd {
    Committed,
    Lost(&'static str),
    Failed(String),
}

/// How one run of an operation went ([`Op::run`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ran {
    /// It succeeded; its answer waits for the group's end.
    Ok,
    /// It failed; its answer (the failure) waits for the group's end, and whatever it wrote
    /// must not be kept.
    Failed,
    /// It answered its caller already, having written nothing (a check that stopped for the
    /// history, `StoreError::HistoryNeeded`): the group's end is not its own, and a group of
    /// only such operations takes no injected fault.
    Answered,
}

/// An operation for the writer thread. It may run more than once: a group whose operation
/// failed after writing is rolled back and run again ([`run_batch`]); only the last run's
/// result is answered.
trait Op: Send {
    /// Run on `tx`, or (`None`) fail because the group could not even begin; keep the result.
    fn run(&mut self, tx: Option<&mut SqliteTx<'_>>) -> Ran;
    /// The operation panicked (a bug): its caller is told `WriterGone` (its answer channel is
    /// dropped), and it never runs again.
    fn abandon(&mut self);
    /// Whether it still has an answer to give (it was neither abandoned nor answered on its
    /// own), so a second run of its group runs it again.
    fn runnable(&self) -> bool;
    /// Answer the caller with the last run's result, as the group ended.
    fn answer(self: Box<Self>, end: BatchEnd);
}

type Job = Box<dyn Op>;

/// An [`Op`] that answers through a oneshot channel.
struct Answered<T, F> {
    operation: F,
    result: Option<Result<T, StoreError>>,
    answer: Option<tokio::sync::oneshot::Sender<Result<T, StoreError>>>,
}

impl<T, F> Op for Answered<T, F>
where
    T: Send,
    F: FnMut(&mut SqliteTx<'_>) -> Result<T, StoreError> + Send,
{
    fn run(&mut self, tx: Option<&mut SqliteTx<'_>>) -> Ran {
        let result = match tx {
            Some(tx) => (self.operation)(tx),
            None => Err(StoreError::CommitFailed("the transaction could not begin".into())),
        };
        if matches!(result, Err(StoreError::HistoryNeeded { .. })) {
            if let Some(answer) = self.answer.take() {
                // The caller may have gone away (its future was dropped); nothing to tell then.
                let _ = answer.send(result);
            }
            self.result = None;
            return Ran::Answered;
        }
        let ran = if result.is_ok() { Ran::Ok } else { Ran::Failed };
        self.result = Some(result);
        ran
    }

    fn abandon(&mut self) {
        self.answer = None;
        self.result = None;
    }

    fn runnable(&self) -> bool {
        self.answer.is_some()
    }

    fn answer(self: Box<Self>, end: BatchEnd) {
        let (Some(answer), Some(result)) = (self.answer, self.result) else {
            return;
        };
        let result = match end {
            BatchEnd::Committed => result,
            BatchEnd::Lost(what) => Err(StoreError::ConnectionLost(what)),
            BatchEnd::Failed(message) => Err(StoreError::CommitFailed(message)),
        };
        let _ = answer.send(result);
    }
}

/// A transaction on one of the ledger's connections: the writer thread's (a write, inside its
/// group's transaction) or a reader's (a read, in its own read transaction).
pub struct SqliteTx<'c> {
    connection: &'c Connection,
    counters: &'c WriterCounters,
}

impl SqliteTx<'_> {
    /// Count the times SQLite parsed `statement` again since it was cached (its re-prepare
    /// counter, reset as it is read).
    fn count_reprepares(&self, statement: &rusqlite::Statement<'_>) {
        let again = statement.reset_status(rusqlite::StatementStatus::RePrepare);
        if again > 0 {
            self.counters
                .reprepares
                .fetch_add(again as u64, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// `$1 … $n` → `?1 … ?n` (explicit indexes, so repeated and out-of-order uses bind right).
fn sqlite_sql(sql: &str) -> String {
    sql.replace('$', "?")
}

impl rusqlite::ToSql for SqlValue {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(match self {
            SqlValue::Null => ValueRef::Null,
            SqlValue::Int(value) => ValueRef::Integer(*value),
            SqlValue::Text(value) => ValueRef::Text(value.as_bytes()),
            SqlValue::Bytes(value) => ValueRef::Blob(value),
        }))
    }
}

fn value_of(value: ValueRef<'_>) -> Result<SqlValue, StoreError> {
    Ok(match value {
        ValueRef::Null => SqlValue::Null,
        ValueRef::Integer(value) => SqlValue::Int(value),
        ValueRef::Text(bytes) => SqlValue::Text(
            String::from_utf8(bytes.to_vec())
                .map_err(|_| StoreError::Corrupt("text column is not UTF-8".into()))?,
        ),
        ValueRef::Blob(bytes) => SqlValue::Bytes(bytes.to_vec()),
        ValueRef::Real(_) => return Err(StoreError::Corrupt("unexpected REAL column".into())),
    })
}

/// Every row of `statement` run with `params`.
fn read_rows(
    statement: &mut rusqlite::CachedStatement<'_>,
    columns: usize,
    params: &[SqlValue],
) -> Result<Vec<Row>, StoreError> {
    let mut rows = statement.query(rusqlite::params_from_iter(params.iter()))?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        let mut values = Vec::with_capacity(columns);
        for index in 0..columns {
            values.push(value_of(row.get_ref(index)?)?);
        }
        out.push(Row(values));
    }
    Ok(out)
}

impl Tx for SqliteTx<'_> {
    fn dialect(&self) -> Dialect {
        Dialect::Sqlite
    }

    async fn execute(&mut self, sql: &str, params: &[SqlValue]) -> Result<u64, StoreError> {
        self.counters
            .statements
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut statement = self.connection.prepare_cached(&sqlite_sql(sql))?;
        let changed = statement.execute(rusqlite::params_from_iter(params.iter()));
        self.count_reprepares(&statement);
        Ok(changed? as u64)
    }

    async fn query(&mut self, sql: &str, params: &[SqlValue]) -> Result<Vec<Row>, StoreError> {
        self.counters
            .statements
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut statement = self.connection.prepare_cached(&sqlite_sql(sql))?;
        let columns = statement.column_count();
        let read = read_rows(&mut statement, columns, params);
        self.count_reprepares(&statement);
        read
    }
}

/// The SQLite ledger. Cheap to share behind an `Arc`; dropping it stops its writer thread
/// after the queued operations ran.
pub struct SqliteLedger {
    jobs: Option<mpsc::Sender<Job>>,
    writer: Option<JoinHandle<()>>,
    /// The checkpoint thread ([`start_checkpointer`]); it ends after the writer's connection
    /// closes.
    checkpointer: Option<JoinHandle<()>>,
    faults: Arc<FaultInjector>,
    counters: Arc<WriterCounters>,
    validation: Arc<ValidationCache>,
    readers: Readers,
    /// The outcome of the writer's last operation for this ledger (`Ledger::write_failing`).
    write_health: crate::WriteHealth,
}

/// What the writer thread counts.
#[derive(Default)]
struct WriterCounters {
    /// Committed operations that changed a row (`Ledger::write_ops`).
    write_ops: std::sync::atomic::AtomicU64,
    /// Read transactions, and committed operations of the writer that changed no row
    /// (`Ledger::read_ops`).
    read_ops: std::sync::atomic::AtomicU64,
    /// Times a cached statement was parsed and planned again
    /// ([`SqliteLedger::reprepares`]).
    reprepares: std::sync::atomic::AtomicU64,
    /// Statements the operations ran, on the writer and the readers, not counting the
    /// transaction control around each operation ([`SqliteLedger::statements`]).
    statements: std::sync::atomic::AtomicU64,
    /// Groups rolled back and run again, each operation in its own savepoint, because one
    /// failed after writing ([`run_batch`], [`SqliteLedger::reruns`]).
    reruns: std::sync::atomic::AtomicU64,
    /// Checkpoint passes the checkpoint thread ran ([`SqliteLedger::checkpoints`]).
    checkpoints: std::sync::atomic::AtomicU64,
    /// Checkpoints the writer ran after its own commit, the WAL having grown past
    /// `SQLITE_WAL_PAGES_MAX` ([`SqliteLedger::checkpoints`]).
    writer_checkpoints: std::sync::atomic::AtomicU64,
    /// Checkpoints that failed, on either thread.
    checkpoint_failures: std::sync::atomic::AtomicU64,
    /// Pages in the WAL after the writer's last commit, as its WAL hook was told
    /// ([`SqliteLedger::wal_pages`]).
    wal_pages: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for SqliteLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteLedger").finish_non_exhaustive()
    }
}

fn migrate(connection: &mut Connection) -> Result<(), StoreError> {
    // Foreign keys are off while migrating, as SQLite's procedure for changing a table's
    // definition asks (a rebuilt table that others refer to could not be dropped otherwise;
    // none of version 10's three is, but a later migration may rebuild one), and the pragma
    // cannot change inside a transaction. Whatever was applied is checked before the commit;
    // the caller turns them on afterwards.
    connection.execute_batch("PRAGMA foreign_keys = OFF;")?;
    let tx = connection.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    tx.execute_batch(SCHEMA_MIGRATIONS_DDL)?;
    let current: i64 = tx
        .query_row("SELECT MAX(version) FROM schema_migrations", [], |row| {
            row.get::<_, Option<i64>>(0)
        })
        .optional()?
        .flatten()
        .unwrap_or(0);
    if current > latest() {
        return Err(StoreError::SchemaTooNew {
            found: current,
            known: latest(),
        });
    }
    // Every known version not applied yet, in order (not only those above the newest applied:
    // a version merged later with a lower number is applied too).
    let applied: std::collections::HashSet<i64> = {
        let mut statement = tx.prepare("SELECT version FROM schema_migrations")?;
        let rows = statement.query_map([], |row| row.get::<_, i64>(0))?;
        rows.collect::<Result<_, _>>()?
    };
    let mut changed = false;
    for migration in MIGRATIONS
        .iter()
        .filter(|migration| !applied.contains(&migration.version))
    {
        tx.execute_batch(migration.sqlite)?;
        tx.execute(
            "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?1, ?2, ?3)",
            rusqlite::params![
                migration.version,
                migration.name,
                crate::postgres::wall_clock_ms()
            ],
        )?;
        changed = true;
    }
    if changed {
        let broken: Vec<String> = {
            let mut statement = tx.prepare("PRAGMA foreign_key_check")?;
            let rows = statement.query_map([], |row| {
                Ok(format!(
                    "{} row {:?} -> {}",
                    row.get::<_, String>(0)?,
                    row.get::<_, Option<i64>>(1)?,
                    row.get::<_, String>(2)?
                ))
            })?;
            rows.collect::<Result<_, _>>()?
        };
        if !broken.is_empty() {
            return Err(StoreError::Corrupt(format!(
                "foreign keys broken after migrating: {}",
                broken.join(", ")
            )));
        }
    }
    tx.commit()?;
    Ok(())
}

/// A connection to `path` with the store's clock and the settings every connection of the
/// ledger shares (the writer's and the readers').
fn open_connection(path: &Path, clock: &StoreClock) -> Result<Connection, StoreError> {
    let connection = Connection::open(path)?;
    let clock = clock.clone();
    connection.create_scalar_function(
        "turnstile_now_ms",
        0,
        rusqlite::functions::FunctionFlags::SQLITE_UTF8,
        move |_| Ok(clock.manual_ms().map(|ms| i64::try_from(ms).unwrap_or(i64::MAX))),
    )?;
    connection.busy_timeout(std::time::Duration::from_millis(SQLITE_BUSY_TIMEOUT_MS))?;
    connection.set_prepared_statement_cache_capacity(128);
    // Plans never depend on a bound value (the query planner stability guarantee).
    // Without it, SQLite's planner marks some parameters of a statement as able to change
    // its plan ("reprepare on bind"), and rusqlite's statement cache clears the bindings of
    // every statement it takes back, which expires a marked statement: each later use
    // parsed and planned it again. The conversation's turns and the dispatch read did, a
    // fifth of the writer's time under load (`SqliteLedger::reprepares`).
    connection.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;
    Ok(connection)
}

/// The ledger's read connections: a read runs on the calling thread, on one of these, in its
/// own read transaction (WAL readers never wait for the writer, and see exactly what its last
/// commit left). Connections are opened when no idle one is left and kept up to
/// `SQLITE_READERS_IDLE_MAX`; each is `query_only`, so a write sent here by mistake fails
/// instead of racing the writer.
struct Readers {
    path: std::path::PathBuf,
    clock: StoreClock,
    idle: std::sync::Mutex<Vec<Connection>>,
}

impl Readers {
    fn take(&self) -> Result<Connection, StoreError> {
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop();
        match idle {
            Some(connection) => Ok(connection),
            None => {
                let connection = open_connection(&self.path, &self.clock)?;
                connection.execute_batch("PRAGMA query_only = ON;")?;
                Ok(connection)
            }
        }
    }

    fn give_back(&self, connection: Connection) {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if idle.len() < SQLITE_READERS_IDLE_MAX {
            idle.push(connection);
        }
    }
}

impl SqliteLedger {
    /// Open (creating and migrating if needed) the ledger at `path`.
    pub fn open(path: impl AsRef<Path>, synchronous: Synchronous) -> Result<SqliteLedger, StoreError> {
        SqliteLedger::open_with_clock(path, synchronous, StoreClock::System)
    }

    /// Open the ledger at `path` with `clock` as the store's clock (`turnstile_now_ms()` in
    /// SQL; see [`crate::clock`]).
    pub fn open_with_clock(
        path: impl AsRef<Path>,
        synchronous: Synchronous,
        clock: StoreClock,
    ) -> Result<SqliteLedger, StoreError> {
        let path = path.as_ref().to_path_buf();
        let mut connection = open_connection(&path, &clock)?;
        // A new file gets 2 KiB pages (SQLite ignores this for an existing one). A dispatch's
        // transaction dirties one page in each of a dozen B-trees (its rows and their index
        // entries sit apart), and each dirty page is one WAL frame: halving the page halves
        // the bytes every commit writes and checkpoints, and no row the hot path writes needs
        // more (docs/decisions/0090-the-sqlite-writer-writes-less-and-reads-do-not-queue.md, "The
        // SQLite writer writes less").
        connection.execute_batch(&format!("PRAGMA page_size = {SQLITE_PAGE_SIZE_BYTES};"))?;
        let mode: String = connection.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Corrupt(format!(
                "journal_mode is {mode}, expected wal"
            )));
        }
        connection.execute_batch(match synchronous {
            Synchronous::Full => "PRAGMA synchronous = FULL;",
            Synchronous::Normal => "PRAGMA synchronous = NORMAL;",
        })?;
        // Statement journals in memory. Inside a savepoint (the commit's own, and every
        // operation's when a group runs again after a failure, `run_batch`) and for a
        // statement that may abort halfway, a page that an earlier write of the transaction
        // already changed is first copied to the savepoint's journal; past 64 KiB SQLite spills
        // that journal to a temporary file, opened, written and deleted per group. It never
        // needs to outlive the transaction, and its size is bounded by the group's dirty pages.
        connection.execute_batch("PRAGMA temp_store = MEMORY;")?;
        migrate(&mut connection)?;
        connection.execute_batch("PRAGMA foreign_keys = ON;")?;
        let enforced: i64 = connection.query_row("PRAGMA foreign_keys", [], |row| row.get(0))?;
        if enforced != 1 {
            return Err(StoreError::Corrupt("foreign keys could not be turned on".into()));
        }
        let faults = Arc::new(FaultInjector::default());
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread_faults = Arc::clone(&faults);
        let counters = Arc::new(WriterCounters::default());
        let thread_counters = Arc::clone(&counters);
        let checkpointer = start_checkpointer(&mut connection, &path, &clock, synchronous, &counters)?;
        let writer = std::thread::Builder::new()
            .name("turnstile-sqlite-writer".into())
            .spawn(move || writer_loop(connection, queue, thread_faults, thread_counters))
            .map_err(|error| StoreError::CommitFailed(format!("cannot start the writer thread: {error}")))?;
        Ok(SqliteLedger {
            jobs: Some(jobs),
            writer: Some(writer),
            checkpointer: Some(checkpointer),
            faults,
            counters,
            validation: Arc::default(),
            readers: Readers {
                path,
                clock,
                idle: std::sync::Mutex::default(),
            },
            write_health: crate::WriteHealth::default(),
        })
    }

    /// Times the writer or a reader parsed and planned one of its cached statements again since
    /// this ledger opened. A statement is parsed once per connection; a count above zero means
    /// something expires the cache (a schema change, or a plan tied to bound values).
    pub fn reprepares(&self) -> u64 {
        self.counters
            .reprepares
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Statements the operations of this ledger ran since it opened, on its writer and its
    /// readers, their own savepoints included; the transaction control around each operation
    /// (BEGIN, SAVEPOINT op, RELEASE, COMMIT) is not counted. For a test that fails when the hot
    /// path's operations grow (issue 21).
    #[doc(hidden)]
    pub fn statements(&self) -> u64 {
        self.counters
            .statements
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Group commits rolled back and run again since this ledger opened, because one of their
    /// operations failed after writing (each then ran in its own savepoint). Zero while every
    /// operation succeeds or refuses before it writes: no group paid for savepoints.
    #[doc(hidden)]
    pub fn reruns(&self) -> u64 {
        self.counters.reruns.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Pages in the WAL after the writer's last commit (0 before the first): what SQLite told
    /// the writer's WAL hook, observed without touching the WAL.
    #[doc(hidden)]
    pub fn wal_pages(&self) -> u64 {
        self.counters.wal_pages.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Checkpoints since this ledger opened: `(passes of the checkpoint thread, checkpoints
    /// by the writer after its commit, failures)` ([`start_checkpointer`]). The writer
    /// checkpoints only when the WAL outgrew `SQLITE_WAL_PAGES_MAX`.
    #[doc(hidden)]
    pub fn checkpoints(&self) -> (u64, u64, u64) {
        let load =
            |counter: &std::sync::atomic::AtomicU64| counter.load(std::sync::atomic::Ordering::Relaxed);
        (
            load(&self.counters.checkpoints),
            load(&self.counters.writer_checkpoints),
            load(&self.counters.checkpoint_failures),
        )
    }

    /// The query plan SQLite chose for each sweep that should read a partial state index
    /// (migrations 10 and 11): `(sweep, plan, index it should read)`, the plan as `EXPLAIN QUERY PLAN`
    /// details joined by "; ". For a test that fails when a sweep stops using its index.
    #[doc(hidden)]
    pub fn sweep_plans(&self) -> Result<Vec<(String, String, String)>, StoreError> {
        let connection = self.readers.take()?;
        let mut plans = Vec::new();
        for (name, sql, index) in ops::sweeps(Dialect::Sqlite) {
            let mut statement = connection.prepare(&format!("EXPLAIN QUERY PLAN {}", sqlite_sql(&sql)))?;
            let unbound = std::iter::repeat_n(rusqlite::types::Null, statement.parameter_count());
            let details = statement
                .query_map(rusqlite::params_from_iter(unbound), |row| row.get::<_, String>(3))?
                .collect::<Result<Vec<_>, _>>()?;
            plans.push((name.to_owned(), details.join("; "), index.to_owned()));
        }
        self.readers.give_back(connection);
        Ok(plans)
    }

    /// The fault injector of this ledger's transaction driver (tests).
    pub fn faults(&self) -> &FaultInjector {
        &self.faults
    }

    async fn run<T, F>(&self, operation: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnMut(&mut SqliteTx<'_>) -> Result<T, StoreError> + Send + 'static,
    {
        let (answer, answered) = tokio::sync::oneshot::channel::<Result<T, StoreError>>();
        let job: Job = Box::new(Answered {
            operation,
            result: None,
            answer: Some(answer),
        });
        let Some(jobs) = &self.jobs else {
            return Err(StoreError::WriterGone);
        };
        let writes_before = self.counters.write_ops.load(std::sync::atomic::Ordering::Relaxed);
        let outcome = match jobs.send(job) {
            Ok(()) => answered.await.unwrap_or(Err(StoreError::WriterGone)),
            Err(_) => Err(StoreError::WriterGone),
        };
        match &outcome {
            // Only a committed write shows that writes work: an operation that changed nothing
            // commits even on a full disk (the lease sweep's does, every half lease). Any
            // operation's write committed meanwhile is as good as this one's (the writer
            // counts a group's writes before it answers).
            Ok(_) => {
                if self.counters.write_ops.load(std::sync::atomic::Ordering::Relaxed) > writes_before {
                    self.write_health.committed();
                }
            }
            Err(error) => self.write_health.failed(error),
        }
        outcome
    }
}

impl SqliteLedger {
    /// Run a read-only `operation` now, on the calling thread, in one read transaction on a
    /// reader connection. It never queues behind the writer's group commit (whose fsync a read
    /// has no reason to wait for) and sees every acknowledged write: the writer answers only
    /// after its commit.
    fn read<T>(
        &self,
        operation: impl FnOnce(&mut SqliteTx<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let value = self.read_within(operation)?;
        // An armed fault is for the next transaction that would have succeeded, a read's too
        // (as on PostgreSQL, where a read is a transaction of the pool): its answer is lost,
        // nothing was written.
        match self.faults.take() {
            Some(Fault::DropBeforeCommit) => Err(StoreError::ConnectionLost("before commit")),
            Some(Fault::DropAfterCommit) => Err(StoreError::ConnectionLost("after commit")),
            None => Ok(value),
        }
    }

    /// [`SqliteLedger::read`] as part of a write operation (the history a check walks before
    /// the writer runs it, [`SqliteLedger::warm`]): an injected fault is for the write's own
    /// transaction, not this read.
    fn read_within<T>(
        &self,
        operation: impl FnOnce(&mut SqliteTx<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let connection = self.readers.take()?;
        control(&connection, "BEGIN DEFERRED")?;
        let mut tx = SqliteTx {
            connection: &connection,
            counters: &self.counters,
        };
        let result = operation(&mut tx);
        // Ending a read transaction releases its snapshot; it cannot lose anything. SQLite may
        // have rolled the transaction back already (an I/O error, out of memory): then the
        // operation's own error is the one to report, and the connection is not reused.
        if connection.is_autocommit() {
            return result;
        }
        let ended = control(&connection, "COMMIT");
        if ended.is_ok() {
            self.readers.give_back(connection);
        }
        let value = result?;
        ended?;
        // Counted once ended, as PostgreSQL counts a read once committed.
        self.counters
            .read_ops
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(value)
    }
}

impl SqliteLedger {
    /// [`SqliteLedger::run`] for an operation that checks a would-be history: it gets the
    /// validator states this ledger keeps, and the state it leaves for its revision is kept
    /// only once its group committed.
    async fn run_checked<T, F>(&self, operation: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnMut(&mut SqliteTx<'_>, &ValidationCache, &mut Option<Checked>) -> Result<T, StoreError>
            + Send
            + 'static,
    {
        let cache = Arc::clone(&self.validation);
        let mut operation = operation;
        let (outcome, next) = self
            .run(move |tx| {
                let mut next = None;
                let outcome = operation(tx, &cache, &mut next)?;
                Ok((outcome, next))
            })
            .await?;
        if let Some(next) = next {
            self.validation.put(next);
        }
        Ok(outcome)
    }
}

impl SqliteLedger {
    /// [`SqliteLedger::run_checked`] for an operation that checks a new turn against the
    /// stored history ([`history::States`]): the writer never walks that history. On a miss
    /// the operation stops before it writes (`HistoryNeeded`), the history is read and walked
    /// here, on the caller ([`SqliteLedger::warm`]), and the operation runs again; only if the
    /// state is gone again by then (taken by another operation, evicted) does that run walk in
    /// the writer.
    async fn run_checking<T, F>(&self, operation: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: Fn(&mut SqliteTx<'_>, &history::States<'_>, &mut Option<Checked>) -> Result<T, StoreError>
            + Send
            + Sync
            + 'static,
    {
        let operation = Arc::new(operation);
        let mut walk = false;
        loop {
            let (cache, run) = (Arc::clone(&self.validation), Arc::clone(&operation));
            let result = self
                .run(move |tx| {
                    let mut next = None;
                    let states = history::States { cache: &cache, walk };
                    let outcome = run(tx, &states, &mut next)?;
                    Ok((outcome, next))
                })
                .await;
            match result {
                Err(StoreError::HistoryNeeded {
                    conversation_id,
                    revision,
                }) if !walk => {
                    // A read that fails here costs only the walk: the next run makes it in
                    // the writer, and meets the same storage there if it is failing.
                    let _ = self.warm(&conversation_id, Revision(revision));
                    walk = true;
                }
                Err(error) => return Err(error),
                Ok((outcome, next)) => {
                    if let Some(next) = next {
                        self.validation.put(next);
                    }
                    return Ok(outcome);
                }
            }
        }
    }

    /// Read `conversation_id`'s history up to `revision` on a read connection and keep the
    /// validator's state after it, walked here rather than in the writer. Nothing is kept when
    /// the conversation is not at `revision` yet or its history is not legal: the operation's
    /// next run then walks in the writer and reports what it finds.
    fn warm(&self, conversation_id: &str, revision: Revision) -> Result<(), StoreError> {
        if self.validation.holds(conversation_id, revision) {
            return Ok(());
        }
        let id = conversation_id.to_owned();
        let Some((tools, turns)) =
            self.read_within(|tx| block_on_ready(ops::history_at(tx, &id, revision)))?
        else {
            return Ok(());
        };
        if let Some(checked) = history::state_at(conversation_id, &tools, turns, revision) {
            self.validation.put(checked);
        }
        Ok(())
    }
}

impl Drop for SqliteLedger {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(writer) = self.writer.take() {
            // The thread ends once the queue is drained; a panic there was already reported
            // to every waiting caller as `WriterGone`.
            let _ = writer.join();
        }
        if let Some(checkpointer) = self.checkpointer.take() {
            // The writer's connection, which held the only sender, is closed: the thread
            // ends after the checkpoint it may be running.
            let _ = checkpointer.join();
        }
    }
}

/// Start the ledger's checkpoint thread and hand it the writer's WAL hook.
///
/// SQLite checkpoints in the connection that commits, once the WAL holds
/// `wal_autocheckpoint` pages: the writer then copies up to a thousand pages into the
/// database file and syncs it inside a commit, and every operation queued behind waits
/// (docs/decisions/0109-checkpoints-off-the-writer.md, "Checkpoints off the writer"). Instead the
/// writer's hook (which replaces SQLite's automatic checkpoint; it runs after each commit with the
/// WAL's size in pages) wakes this thread, which runs a `PASSIVE` checkpoint on its own connection:
/// it never takes the write lock, so the writer goes on committing while it copies. Past
/// `SQLITE_WAL_PAGES_MAX` (the thread stalled or behind) the writer checkpoints itself, as SQLite
/// would have, so the WAL stays bounded either way.
fn start_checkpointer(
    writer: &mut Connection,
    path: &Path,
    clock: &StoreClock,
    synchronous: Synchronous,
    counters: &Arc<WriterCounters>,
) -> Result<JoinHandle<()>, StoreError> {
    let connection = open_connection(path, clock)?;
    // A checkpoint syncs the WAL before copying and the database file after at either
    // setting; the same setting as the writer's, so the two connections never differ.
    connection.execute_batch(match synchronous {
        Synchronous::Full => "PRAGMA synchronous = FULL;",
        Synchronous::Normal => "PRAGMA synchronous = NORMAL;",
    })?;
    // A capacity of one: a wake-up while one is pending is dropped (the pending checkpoint
    // takes what it brought), so the writer's hook never blocks.
    let (wake, woken) = mpsc::sync_channel::<()>(1);
    let hook_counters = Arc::clone(counters);
    // The WAL's size at which the hook wakes the thread next: a thousand pages past the
    // last wake-up, back to a thousand once the WAL started over. Waking at every commit
    // past a thousand pages had the thread checkpoint again and again the few frames each
    // commit adds (44 % more fsyncs in all on disk, and the WAL started over less often).
    let mut wake_at = SQLITE_CHECKPOINT_PAGES;
    writer.wal_hook(Some(
        // It always answers `Ok`: SQLite runs it after the commit, and an error would make
        // the COMMIT statement fail on a transaction already written.
        move |wal: &mut rusqlite::hooks::Wal, pages: std::ffi::c_int| {
            hook_counters.wal_pages.store(
                u64::try_from(pages).unwrap_or(0),
                std::sync::atomic::Ordering::Relaxed,
            );
            if pages < wake_at - SQLITE_CHECKPOINT_PAGES {
                wake_at = SQLITE_CHECKPOINT_PAGES;
            }
            if pages >= SQLITE_WAL_PAGES_MAX {
                let counter = match wal.checkpoint_v2(rusqlite::wal::CheckpointMode::PASSIVE) {
                    Ok(_) => Some(&hook_counters.writer_checkpoints),
                    // The checkpoint thread is running one: the next commit tries again.
                    Err(error) if error.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy) => {
                        None
                    }
                    Err(_) => Some(&hook_counters.checkpoint_failures),
                };
                if let Some(counter) = counter {
                    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            } else if pages >= wake_at {
                let _ = wake.try_send(());
                wake_at = pages.saturating_add(SQLITE_CHECKPOINT_PAGES);
            }
            Ok(())
        },
    ))?;
    let thread_counters = Arc::clone(counters);
    std::thread::Builder::new()
        .name("turnstile-sqlite-checkpoint".into())
        .spawn(move || {
            while woken.recv().is_ok() {
                // The writer commits while a pass copies: the next pass copies what those
                // commits added, far less. Once a pass leaves nothing uncopied, the writer's
                // next transaction starts the WAL over (when no reader still needs it). A
                // checkpoint the writer is running meanwhile is reported in the row's first
                // column, not as an error.
                for _ in 0..SQLITE_CHECKPOINT_PASSES_MAX {
                    let pass = connection.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| {
                        Ok((
                            row.get::<_, i64>(0)?,
                            row.get::<_, i64>(1)?,
                            row.get::<_, i64>(2)?,
                        ))
                    });
                    let (counter, done) = match pass {
                        // The writer was running one: it copies what this pass would have.
                        Ok((1, _, _)) => (None, true),
                        Ok((_, frames, copied)) => (Some(&thread_counters.checkpoints), copied >= frames),
                        Err(_) => (Some(&thread_counters.checkpoint_failures), true),
                    };
                    if let Some(counter) = counter {
                        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    if done {
                        break;
                    }
                }
            }
        })
        .map_err(|error| StoreError::CommitFailed(format!("cannot start the checkpoint thread: {error}")))
}

fn writer_loop(
    mut connection: Connection,
    queue: mpsc::Receiver<Job>,
    faults: Arc<FaultInjector>,
    counters: Arc<WriterCounters>,
) {
    while let Ok(first) = queue.recv() {
        let mut batch = vec![first];
        while batch.len() < GROUP_COMMIT_OPS_MAX {
            match queue.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        run_batch(&connection, batch, &queue, &faults, &counters);
    }
    // The hook holds the checkpoint thread's only sender, and `Drop` joins that thread: take
    // it off here rather than trust the connection's close to free it (a close that fails,
    // for a statement still open, frees nothing).
    let _ =
        connection.wal_hook(None::<fn(&mut rusqlite::hooks::Wal, std::ffi::c_int) -> rusqlite::Result<()>>);
}

/// One transaction-control statement through the statement cache: `execute_batch` would
/// parse it again on every call, and the writer runs several per group commit.
fn control(connection: &Connection, sql: &str) -> rusqlite::Result<()> {
    connection.prepare_cached(sql)?.execute([]).map(|_| ())
}

/// Run one group commit; `counters.write_ops` counts its operations that changed a row, once
/// committed and before anyone is answered. Operations queued while the group runs join it
/// (up to `GROUP_COMMIT_OPS_MAX` in all) rather than wait for the next group's fsync: the
/// group is whatever is queued when the writer reaches its COMMIT.
///
/// **Optimistic: no savepoint per operation.** Every operation runs bare in the group's
/// transaction. One that fails having written nothing (`total_changes` did not move: a
/// refusal before its first write) leaves nothing to undo, and the group goes on. One that
/// fails or panics after writing cannot be undone alone: the whole transaction is rolled back
/// and the group runs again ([`run_in_savepoints`]), each operation in its own savepoint as
/// before, so exactly the writes of the operations that succeeded are kept. The outcome of
/// every operation still comes only from its own conditional writes; a second run answers
/// from the store as it is then, which the first run's rollback left as it was before the
/// group. Savepoints cost every operation a statement pair and a copy of each page an earlier
/// operation of its group had changed (the sub-journal); a failure after a write is a bug or a
/// storage error, rare enough to pay the second run.
fn run_batch(
    connection: &Connection,
    batch: Vec<Job>,
    queue: &mpsc::Receiver<Job>,
    faults: &FaultInjector,
    counters: &WriterCounters,
) {
    if let Err(error) = control(connection, "BEGIN IMMEDIATE") {
        fail_group(Vec::new(), batch, error.to_string());
        return;
    }
    let mut done: Vec<Job> = Vec::with_capacity(batch.len());
    let (mut wrote, mut unchanged) = (0, 0);
    let mut taken = batch.len();
    let mut pending = batch.into_iter();
    loop {
        let mut job = match pending.next() {
            Some(job) => job,
            None if taken < GROUP_COMMIT_OPS_MAX => match queue.try_recv() {
                Ok(job) => {
                    taken += 1;
                    job
                }
                Err(_) => break,
            },
            None => break,
        };
        let changes_before = connection.total_changes();
        let mut tx = SqliteTx { connection, counters };
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.run(Some(&mut tx))));
        let changed = connection.total_changes() > changes_before;
        if connection.is_autocommit() {
            // SQLite rolled the group's transaction back itself (an I/O error, a full disk,
            // out of memory): nothing of the group is left, so every operation of it fails.
            if ran.is_err() {
                job.abandon();
            }
            done.push(job);
            fail_group(
                done,
                pending,
                "the transaction was rolled back by an error".into(),
            );
            return;
        }
        let undo = match ran {
            Ok(Ran::Answered) => changed,
            Ok(Ran::Ok) => {
                if changed {
                    wrote += 1;
                } else {
                    unchanged += 1;
                }
                done.push(job);
                false
            }
            Ok(Ran::Failed) => {
                done.push(job);
                changed
            }
            // A panicking operation (a bug) must not take the writer down with the other
            // callers' operations: its own caller sees `WriterGone` and its writes are undone.
            Err(_) => {
                job.abandon();
                changed
            }
        };
        if undo {
            let rolled_back = control(connection, "ROLLBACK");
            if rolled_back.is_err() || !connection.is_autocommit() {
                // Nothing of the group may be kept, and it cannot run again on this
                // transaction: every operation of it fails.
                let message = match rolled_back {
                    Err(error) => format!("the group could not be rolled back: {error}"),
                    Ok(()) => "the group could not be rolled back".to_owned(),
                };
                fail_group(done, pending, message);
                return;
            }
            counters.reruns.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            run_in_savepoints(
                connection,
                done.into_iter().chain(pending).collect(),
                faults,
                counters,
            );
            return;
        }
    }
    end_group(connection, done, (wrote, unchanged), faults, counters);
}

/// Answer every operation of `jobs` with how the group ended.
fn finish(jobs: Vec<Job>, end: &BatchEnd) {
    for job in jobs {
        job.answer(end.clone());
    }
}

/// The group failed (it could not begin, or its transaction is lost): the operations that ran
/// (`done`) and the rest, which never run now (each still with an answer to give is told its
/// group could not begin), are answered with `message`.
fn fail_group(mut done: Vec<Job>, rest: impl IntoIterator<Item = Job>, message: String) {
    done.extend(rest.into_iter().filter(|job| job.runnable()).map(|mut job| {
        job.run(None);
        job
    }));
    finish(done, &BatchEnd::Failed(message));
}

/// Run `jobs` again after a rollback, each in its own `SAVEPOINT` (an operation that fails
/// rolls back alone), and end the group. Operations that were abandoned (they panicked) answer
/// nothing and are not run again.
fn run_in_savepoints(
    connection: &Connection,
    jobs: Vec<Job>,
    faults: &FaultInjector,
    counters: &WriterCounters,
) {
    if let Err(error) = control(connection, "BEGIN IMMEDIATE") {
        fail_group(Vec::new(), jobs, error.to_string());
        return;
    }
    let mut done = Vec::with_capacity(jobs.len());
    let (mut wrote, mut unchanged) = (0, 0);
    let mut pending = jobs.into_iter();
    while let Some(mut job) = pending.next() {
        if !job.runnable() {
            continue;
        }
        let changes_before = connection.total_changes();
        let savepoint = control(connection, "SAVEPOINT op");
        let mut tx = SqliteTx { connection, counters };
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.run(Some(&mut tx))));
        let ok = match ran {
            Ok(ran) => ran == Ran::Ok,
            Err(_) => {
                job.abandon();
                false
            }
        };
        let closed = match (savepoint, ok) {
            (Ok(()), true) => control(connection, "RELEASE op"),
            (Ok(()), false) => {
                control(connection, "ROLLBACK TO op").and_then(|()| control(connection, "RELEASE op"))
            }
            (Err(error), _) => Err(error),
        };
        // One that answered on its own (`HistoryNeeded`) or panicked has nothing left to tell,
        // and a group of only such operations ends as the first run would have: rolled back,
        // taking no injected fault.
        if job.runnable() {
            done.push(job);
        }
        if let Err(error) = closed {
            // The transaction is in an unknown state: give up the whole group, and answer
            // the operations of it that did not run yet with the same failure.
            let _ = control(connection, "ROLLBACK");
            fail_group(done, pending, error.to_string());
            return;
        }
        if ok && connection.total_changes() > changes_before {
            wrote += 1;
        } else if ok {
            unchanged += 1;
        }
    }
    end_group(connection, done, (wrote, unchanged), faults, counters);
}

/// Commit the group's transaction and answer its operations (`done`: those with an answer to
/// give), or roll it back and tell them why; `wrote` of them changed a row, `unchanged` ran to
/// the end and changed none.
fn end_group(
    connection: &Connection,
    done: Vec<Job>,
    (wrote, unchanged): (u64, u64),
    faults: &FaultInjector,
    counters: &WriterCounters,
) {
    let count = || {
        use std::sync::atomic::Ordering::Relaxed;
        counters.write_ops.fetch_add(wrote, Relaxed);
        counters.read_ops.fetch_add(unchanged, Relaxed);
    };
    if done.is_empty() {
        // Every operation of the group answered already and wrote nothing.
        let _ = control(connection, "ROLLBACK");
        return;
    }
    match faults.take() {
        Some(Fault::DropBeforeCommit) => {
            let _ = control(connection, "ROLLBACK");
            finish(done, &BatchEnd::Lost("before commit"));
            return;
        }
        Some(Fault::DropAfterCommit) => {
            let end = match control(connection, "COMMIT") {
                Ok(()) => {
                    count();
                    BatchEnd::Lost("after commit")
                }
                Err(error) => {
                    let _ = control(connection, "ROLLBACK");
                    BatchEnd::Failed(error.to_string())
                }
            };
            finish(done, &end);
            return;
        }
        None => {}
    }
    match control(connection, "COMMIT") {
        Ok(()) => {
            count();
            finish(done, &BatchEnd::Committed);
        }
        Err(error) => {
            let _ = control(connection, "ROLLBACK");
            finish(done, &BatchEnd::Failed(error.to_string()));
        }
    }
}

/// Bodies above this many bytes in all are checked on tokio's blocking pool rather than on the
/// calling async worker (hashing 1 MiB takes about 0.7 ms here; below it, the hop to the pool
/// would cost more than it saves).
const PREPARE_CHECK_INLINE_BYTES_MAX: usize = 1 << 20;

/// A prepare's inputs (its manifest, body and fallbacks), owned, to go to the writer thread.
struct PrepareInputs {
    manifest: DispatchManifest,
    bytes: Vec<u8>,
    policy: Option<Value>,
    fallbacks: Vec<PreparedTarget>,
    /// How they were checked (and are checked again by a second run of their group).
    checks: ops::Checks,
}

impl PrepareInputs {
    /// The inputs, owned, with their checked rows ([`ops::prepare_rows`]), or (inner `Err`)
    /// why the prepare is `Invalid`. The checks hash every body and never run on the writer
    /// thread, where every dispatch queues; large bodies are hashed on the blocking pool.
    async fn checked(
        manifest: &DispatchManifest,
        request_bytes: &[u8],
        policy: Option<&Value>,
        fallbacks: &[PreparedTarget],
    ) -> Result<Result<(PrepareInputs, ops::PrepareRows), &'static str>, StoreError> {
        let inputs = PrepareInputs {
            manifest: manifest.clone(),
            bytes: request_bytes.to_vec(),
            policy: policy.cloned(),
            fallbacks: fallbacks.to_vec(),
            checks: ops::Checks::Hash,
        };
        let check = move || (inputs.check(), inputs);
        let bytes = request_bytes.len()
            + fallbacks
                .iter()
                .map(|fallback| fallback.request_bytes.len())
                .sum::<usize>();
        let (checked, inputs) = if bytes > PREPARE_CHECK_INLINE_BYTES_MAX {
            match tokio::task::spawn_blocking(check).await {
                Ok(checked) => checked,
                // A panic in the checks is the same bug on either path: pass it on.
                Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
                Err(error) => {
                    return Err(StoreError::CommitFailed(format!(
                        "the prepare's checks were cancelled: {error}"
                    )));
                }
            }
        } else {
            check()
        };
        Ok(checked?.map(|rows| (inputs, rows)))
    }

    /// [`PrepareInputs::checked`] of sealed targets, moved in: nothing is copied or hashed,
    /// so it runs on the calling worker whatever the bodies' size.
    fn sealed(
        target: SealedTarget,
        fallbacks: Vec<SealedTarget>,
    ) -> Result<Result<(PrepareInputs, ops::PrepareRows), &'static str>, StoreError> {
        let PreparedTarget {
            manifest,
            request_bytes,
            policy,
        } = target.into_target();
        let inputs = PrepareInputs {
            manifest,
            bytes: request_bytes,
            policy,
            fallbacks: fallbacks.into_iter().map(SealedTarget::into_target).collect(),
            checks: ops::Checks::Sealed,
        };
        Ok(inputs.check()?.map(|rows| (inputs, rows)))
    }

    /// Their rows ([`ops::prepare_rows`] with their own checks), or why they are `Invalid`.
    fn check(&self) -> Result<Result<ops::PrepareRows, &'static str>, StoreError> {
        ops::prepare_rows(
            &self.manifest,
            &self.bytes,
            self.policy.as_ref(),
            &self.fallbacks,
            self.checks,
        )
    }
}

impl PrepareInputs {
    /// The rows for one run of the prepare's SQL: the ones checked before it queued (`rows`,
    /// taken by its first run), or, for a second run of its group (a rollback of the first
    /// run, [`run_batch`]), the same rows worked out again, on the writer, rather than kept
    /// twice on every prepare for a rare path.
    fn rows(&self, rows: &mut Option<ops::PrepareRows>) -> Result<ops::PrepareRows, StoreError> {
        match rows.take() {
            Some(rows) => Ok(rows),
            None => self.check()?.map_err(|why| {
                StoreError::Corrupt(format!("a prepare checked before its run no longer does: {why}"))
            }),
        }
    }
}

impl SqliteLedger {
    /// The SQL of a prepare whose inputs are checked: with `begin`, [`ops::prepare_and_begin`],
    /// else [`ops::prepare_targets`].
    async fn prepare_inputs(
        &self,
        inputs: PrepareInputs,
        rows: ops::PrepareRows,
        begin: Option<&BeginAtOnce>,
        now: Timestamp,
    ) -> Result<(PrepareOutcome, Option<BeginOutcome>), StoreError> {
        let mut rows = Some(rows);
        match begin.cloned() {
            Some(begin) => {
                self.run(move |tx| {
                    block_on_ready(ops::prepare_and_begin(
                        tx,
                        &inputs.manifest,
                        &inputs.bytes,
                        &inputs.fallbacks,
                        inputs.rows(&mut rows)?,
                        &begin,
                        now,
                    ))
                })
                .await
            }
            None => self
                .run(move |tx| {
                    block_on_ready(ops::prepare_targets(
                        tx,
                        &inputs.manifest,
                        &inputs.bytes,
                        &inputs.fallbacks,
                        inputs.rows(&mut rows)?,
                        now,
                    ))
                })
                .await
                .map(|outcome| (outcome, None)),
        }
    }

    /// The SQL of an import and its prepare, the history and the prepare's inputs checked.
    #[allow(clippy::too_many_arguments)]
    async fn import_inputs(
        &self,
        conversation_id: &str,
        tools: &Value,
        checked: history::CheckedImport,
        inputs: PrepareInputs,
        rows: ops::PrepareRows,
        begin: Option<&BeginAtOnce>,
        now: Timestamp,
    ) -> Result<ImportPrepared, StoreError> {
        let (id, tools, begin, mut checked) =
            (conversation_id.to_owned(), tools.clone(), begin.cloned(), checked);
        let mut rows = Some(rows);
        self.run_checked(move |tx, _, next| {
            let outcome = block_on_ready(ops::import_and_prepare(
                tx,
                &id,
                &tools,
                &checked,
                &inputs.manifest,
                &inputs.bytes,
                &inputs.fallbacks,
                inputs.rows(&mut rows)?,
                begin.as_ref(),
                now,
            ))?;
            if let ImportPrepared::Prepared { revision, .. } = &outcome {
                *next = checked.history.take().map(|history| Checked {
                    conversation_id: id.clone(),
                    revision: *revision,
                    history,
                });
            }
            Ok(outcome)
        })
        .await
    }
}

#[async_trait::async_trait]
impl Ledger for SqliteLedger {
    fn history_walks(&self) -> u64 {
        self.validation.walks()
    }

    fn history_walks_in_transaction(&self) -> u64 {
        self.validation.walks_in_transaction()
    }

    fn write_ops(&self) -> u64 {
        self.counters.write_ops.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn read_ops(&self) -> u64 {
        self.counters.read_ops.load(std::sync::atomic::Ordering::Relaxed)
    }

    async fn create_conversation(
        &self,
        conversation_id: &str,
        tools: &Value,
        now: Timestamp,
    ) -> Result<CreateOutcome, StoreError> {
        let (id, tools_owned) = (conversation_id.to_owned(), tools.clone());
        let created = self
            .run(move |tx| block_on_ready(ops::create_conversation(tx, &id, &tools_owned, now)))
            .await?;
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
        // Stamped and validated here, on the caller: the writer thread only writes.
        let checked = match history::check_import(conversation_id, tools, turns) {
            Ok(checked) => checked,
            Err(violations) => return Ok(ImportOutcome::Rejected(violations)),
        };
        let (id, tools, mut checked) = (conversation_id.to_owned(), tools.clone(), checked);
        self.run_checked(move |tx, _, next| {
            let outcome = block_on_ready(ops::import_conversation(tx, &id, &tools, &checked, now))?;
            if let ImportOutcome::Created { revision } = outcome {
                *next = checked.history.take().map(|history| Checked {
                    conversation_id: id.clone(),
                    revision,
                    history,
                });
            }
            Ok(outcome)
        })
        .await
    }

    async fn conversations_with_call(
        &self,
        call_id: &str,
        id_prefix: &str,
    ) -> Result<Vec<String>, StoreError> {
        let (call_id, id_prefix) = (call_id.to_owned(), id_prefix.to_owned());
        self.read(|tx| block_on_ready(ops::conversations_with_call(tx, &call_id, &id_prefix)))
    }

    async fn conversation(&self, conversation_id: &str) -> Result<Option<Value>, StoreError> {
        let id = conversation_id.to_owned();
        self.read(|tx| block_on_ready(ops::conversation(tx, &id)))
    }

    async fn conversation_with_digests(
        &self,
        conversation_id: &str,
    ) -> Result<Option<StoredConversation>, StoreError> {
        let id = conversation_id.to_owned();
        self.read(|tx| block_on_ready(ops::conversation_with_digests(tx, &id)))
    }

    async fn conversation_since(
        &self,
        conversation_id: &str,
        after: Revision,
    ) -> Result<Option<ConversationTail>, StoreError> {
        let id = conversation_id.to_owned();
        self.read(|tx| block_on_ready(ops::conversation_since(tx, &id, after)))
    }

    async fn append_turn(
        &self,
        conversation_id: &str,
        expected: Revision,
        turn: &Value,
        now: Timestamp,
    ) -> Result<AppendOutcome, StoreError> {
        let (id, turn) = (conversation_id.to_owned(), turn.clone());
        self.run_checking(move |tx, states, next| {
            block_on_ready(ops::append_turn(tx, &id, expected, &turn, states, next, now))
        })
        .await
    }

    async fn append_repair(
        &self,
        conversation_id: &str,
        expected: Revision,
        turn: &Value,
        repair: &NewRepair,
        now: Timestamp,
    ) -> Result<AppendOutcome, StoreError> {
        let (id, turn, repair) = (conversation_id.to_owned(), turn.clone(), repair.clone());
        self.run_checking(move |tx, states, next| {
            block_on_ready(ops::append_repair(
                tx, &id, expected, &turn, &repair, states, next, now,
            ))
        })
        .await
    }

    async fn repairs(&self, conversation_id: &str) -> Result<Vec<RepairRecord>, StoreError> {
        let id = conversation_id.to_owned();
        self.read(|tx| block_on_ready(ops::repairs(tx, &id)))
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
        let (inputs, rows) = match PrepareInputs::checked(manifest, request_bytes, policy, fallbacks).await? {
            Ok(checked) => checked,
            Err(why) => return Ok(PrepareOutcome::Invalid(why)),
        };
        Ok(self.prepare_inputs(inputs, rows, None, now).await?.0)
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
        let (inputs, rows) = match PrepareInputs::checked(manifest, request_bytes, policy, fallbacks).await? {
            Ok(checked) => checked,
            Err(why) => return Ok((PrepareOutcome::Invalid(why), None)),
        };
        self.prepare_inputs(inputs, rows, Some(begin), now).await
    }

    async fn prepare_sealed(
        &self,
        target: SealedTarget,
        fallbacks: Vec<SealedTarget>,
        begin: Option<&BeginAtOnce>,
        now: Timestamp,
    ) -> Result<(PrepareOutcome, Option<BeginOutcome>), StoreError> {
        let (inputs, rows) = match PrepareInputs::sealed(target, fallbacks)? {
            Ok(checked) => checked,
            Err(why) => return Ok((PrepareOutcome::Invalid(why), None)),
        };
        self.prepare_inputs(inputs, rows, begin, now).await
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
        let (inputs, rows) = match PrepareInputs::checked(manifest, request_bytes, policy, fallbacks).await? {
            Ok(checked) => checked,
            Err(why) => return Ok(ImportPrepared::NotPrepared(PrepareOutcome::Invalid(why))),
        };
        self.import_inputs(conversation_id, tools, checked, inputs, rows, begin, now)
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
        let (inputs, rows) = match PrepareInputs::sealed(target, fallbacks)? {
            Ok(checked) => checked,
            Err(why) => return Ok(ImportPrepared::NotPrepared(PrepareOutcome::Invalid(why))),
        };
        self.import_inputs(conversation_id, tools, checked, inputs, rows, begin, now)
            .await
    }
    async fn dispatch_fallbacks(&self, operation_id: &str) -> Result<Vec<TargetRecord>, StoreError> {
        let op = operation_id.to_owned();
        self.read(|tx| block_on_ready(ops::dispatch_fallbacks(tx, &op)))
    }

    async fn dispatch_policy(&self, operation_id: &str) -> Result<Option<Value>, StoreError> {
        let op = operation_id.to_owned();
        self.read(|tx| block_on_ready(ops::dispatch_policy(tx, &op)))
    }

    async fn dispatch(&self, operation_id: &str) -> Result<Option<DispatchRecord>, StoreError> {
        let op = operation_id.to_owned();
        self.read(|tx| block_on_ready(ops::dispatch(tx, &op)))
    }

    async fn attempts(&self, operation_id: &str) -> Result<Vec<AttemptRecord>, StoreError> {
        let op = operation_id.to_owned();
        self.read(|tx| block_on_ready(ops::attempts(tx, &op)))
    }

    async fn begin_attempt(
        &self,
        operation_id: &str,
        expect: BeginExpect,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<BeginOutcome, StoreError> {
        let (op, lease) = (operation_id.to_owned(), lease.clone());
        self.run(move |tx| block_on_ready(ops::begin_attempt(tx, &op, expect, &lease, now)))
            .await
    }

    async fn transition(
        &self,
        operation_id: &str,
        generation: Generation,
        from: DispatchState,
        to: DispatchState,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        let op = operation_id.to_owned();
        self.run(move |tx| block_on_ready(ops::transition(tx, &op, generation, from, to, now)))
            .await
    }

    async fn fail_over(
        &self,
        operation_id: &str,
        generation: Generation,
        from: DispatchState,
        reason: &str,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        let (op, reason) = (operation_id.to_owned(), reason.to_owned());
        self.run(move |tx| block_on_ready(ops::fail_over(tx, &op, generation, from, &reason, now)))
            .await
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
        let (op, reason) = (operation_id.to_owned(), reason.to_owned());
        self.run(move |tx| {
            block_on_ready(ops::end_attempt(
                tx,
                &op,
                generation,
                from,
                to,
                Some(&reason),
                now,
            ))
        })
        .await
    }

    async fn replay_attempt(
        &self,
        operation_id: &str,
        generation: Generation,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        let (op, lease) = (operation_id.to_owned(), lease.clone());
        self.run(move |tx| block_on_ready(ops::replay_attempt(tx, &op, generation, &lease, now)))
            .await
    }

    async fn resume_attempt(
        &self,
        operation_id: &str,
        generation: Generation,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        let (op, lease) = (operation_id.to_owned(), lease.clone());
        self.run(move |tx| block_on_ready(ops::resume_attempt(tx, &op, generation, &lease, now)))
            .await
    }

    async fn abandon_on_provider_word(
        &self,
        operation_id: &str,
        generation: Generation,
        provider_word: &str,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        let (op, word) = (operation_id.to_owned(), provider_word.to_owned());
        self.run(move |tx| {
            block_on_ready(ops::abandon_and_rearm_on(
                tx,
                &op,
                generation,
                true,
                Some(&word),
                now,
            ))
        })
        .await
    }

    async fn abandon_and_rearm(
        &self,
        operation_id: &str,
        generation: Generation,
        provider_confirmed_ended: bool,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        let op = operation_id.to_owned();
        self.run(move |tx| {
            block_on_ready(ops::abandon_and_rearm(
                tx,
                &op,
                generation,
                provider_confirmed_ended,
                now,
            ))
        })
        .await
    }

    async fn renew_lease(
        &self,
        operation_id: &str,
        generation: Generation,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<TransitionOutcome, StoreError> {
        let (op, lease) = (operation_id.to_owned(), lease.clone());
        self.run(move |tx| block_on_ready(ops::renew_lease(tx, &op, generation, &lease, now)))
            .await
    }

    async fn bind_handle(
        &self,
        operation_id: &str,
        generation: Generation,
        handle: &str,
        now: Timestamp,
    ) -> Result<BindOutcome, StoreError> {
        let (op, handle) = (operation_id.to_owned(), handle.to_owned());
        self.run(move |tx| block_on_ready(ops::bind_handle(tx, &op, generation, &handle, now)))
            .await
    }

    async fn cancel(
        &self,
        operation_id: &str,
        expected_cancel_generation: Option<u64>,
        now: Timestamp,
    ) -> Result<CancelOutcome, StoreError> {
        let op = operation_id.to_owned();
        self.run(move |tx| block_on_ready(ops::cancel(tx, &op, expected_cancel_generation, now)))
            .await
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
        let (op, turn, outcome, carried) = (
            operation_id.to_owned(),
            turn.clone(),
            outcome.cloned(),
            carried.clone(),
        );
        self.run_checking(move |tx, states, next| {
            block_on_ready(ops::commit(
                tx,
                &op,
                generation,
                expected_revision,
                &turn,
                outcome.as_ref(),
                &carried,
                states,
                next,
                now,
            ))
        })
        .await
    }

    async fn quarantine(&self, entry: &QuarantineEntry, now: Timestamp) -> Result<bool, StoreError> {
        let entry = entry.clone();
        self.run(move |tx| block_on_ready(ops::quarantine(tx, &entry, now)))
            .await
    }

    async fn quarantined(&self, limit: u64) -> Result<Vec<QuarantineRecord>, StoreError> {
        self.read(|tx| block_on_ready(ops::quarantined(tx, limit)))
    }

    async fn tool_calls(&self, state: Option<ToolCallState>) -> Result<Vec<ToolCallRecord>, StoreError> {
        self.read(|tx| block_on_ready(ops::tool_calls(tx, state)))
    }

    async fn claim_tool_call(
        &self,
        conversation_id: &str,
        call_id: &str,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<ClaimOutcome, StoreError> {
        let (id, call, lease) = (conversation_id.to_owned(), call_id.to_owned(), lease.clone());
        self.run(move |tx| block_on_ready(ops::claim_tool_call(tx, &id, &call, &lease, now)))
            .await
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
        let (id, call, status, content) = (
            conversation_id.to_owned(),
            call_id.to_owned(),
            status.to_owned(),
            content.clone(),
        );
        self.run_checking(move |tx, states, next| {
            block_on_ready(ops::submit_tool_result(
                tx, &id, &call, claim, &status, &content, states, next, now,
            ))
        })
        .await
    }

    async fn recover_startup(&self, holder: &str, now: Timestamp) -> Result<RecoveryReport, StoreError> {
        let holder = holder.to_owned();
        self.run(move |tx| block_on_ready(ops::recover_startup(tx, &holder, now)))
            .await
    }

    async fn release_holder(&self, holder: &str, now: Timestamp) -> Result<u64, StoreError> {
        let holder = holder.to_owned();
        self.run(move |tx| block_on_ready(ops::release_holder(tx, &holder, now)))
            .await
    }

    async fn counters(&self) -> Result<Counters, StoreError> {
        self.read(|tx| block_on_ready(ops::counters(tx)))
    }

    fn write_failing(&self) -> bool {
        self.write_health.failing()
    }

    async fn write_probe(&self) -> Result<(), StoreError> {
        self.run(|tx| block_on_ready(ops::write_probe(tx))).await
    }

    async fn prepared_unattended(&self, idle_ms: u64, limit: u64) -> Result<Vec<String>, StoreError> {
        self.read(|tx| block_on_ready(ops::prepared_unattended(tx, idle_ms, limit)))
    }

    async fn stuck_age_ms(&self) -> Result<u64, StoreError> {
        self.read(|tx| block_on_ready(ops::stuck_age_ms(tx)))
    }

    async fn store_now(&self) -> Result<Timestamp, StoreError> {
        self.run(move |tx| block_on_ready(ops::store_now(tx))).await
    }

    async fn claim_call(
        &self,
        conversation_id: &str,
        call_id: &str,
        holder: &str,
        lease_ms: u64,
    ) -> Result<CallClaimOutcome, StoreError> {
        let (id, call, holder) = (conversation_id.to_owned(), call_id.to_owned(), holder.to_owned());
        self.run(move |tx| block_on_ready(ops::claim_call(tx, &id, &call, &holder, lease_ms)))
            .await
    }

    async fn renew_call(
        &self,
        conversation_id: &str,
        call_id: &str,
        claim: u64,
        lease_ms: u64,
    ) -> Result<RenewOutcome, StoreError> {
        let (id, call) = (conversation_id.to_owned(), call_id.to_owned());
        self.run(move |tx| block_on_ready(ops::renew_call(tx, &id, &call, claim, lease_ms)))
            .await
    }

    async fn release_call(
        &self,
        conversation_id: &str,
        call_id: &str,
        claim: u64,
    ) -> Result<ReleaseOutcome, StoreError> {
        let (id, call) = (conversation_id.to_owned(), call_id.to_owned());
        self.run(move |tx| block_on_ready(ops::release_call(tx, &id, &call, claim)))
            .await
    }

    async fn hand_to_client(
        &self,
        conversation_id: &str,
        call_id: &str,
        holder: &str,
        bound_ms: u64,
    ) -> Result<bool, StoreError> {
        let (id, call, holder) = (conversation_id.to_owned(), call_id.to_owned(), holder.to_owned());
        self.run(move |tx| block_on_ready(ops::hand_to_client(tx, &id, &call, &holder, bound_ms)))
            .await
    }

    async fn abandon_client_calls(
        &self,
        conversation_id: &str,
        revision: Revision,
    ) -> Result<u64, StoreError> {
        let id = conversation_id.to_owned();
        self.run(move |tx| block_on_ready(ops::abandon_client_calls(tx, &id, revision)))
            .await
    }

    async fn conversation_page(&self, query: &ConversationQuery) -> Result<ConversationPage, StoreError> {
        let query = query.clone();
        self.read(|tx| block_on_ready(crate::listing::conversations(tx, &query)))
    }

    async fn quarantine_page(
        &self,
        id_prefix: &str,
        before: Option<i64>,
        limit: u64,
    ) -> Result<crate::listing::QuarantinePage, StoreError> {
        let id_prefix = id_prefix.to_owned();
        self.read(|tx| block_on_ready(crate::listing::quarantine_page(tx, &id_prefix, before, limit)))
    }

    async fn record_evidence(
        &self,
        operation_id: &str,
        rows: &[(Generation, Value)],
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let (op, rows) = (operation_id.to_owned(), rows.to_vec());
        self.run(move |tx| block_on_ready(ops::insert_evidence(tx, &op, &rows, now)))
            .await
    }

    async fn evidence(&self, operation_id: &str) -> Result<Vec<(Generation, Value)>, StoreError> {
        let op = operation_id.to_owned();
        self.read(|tx| block_on_ready(ops::evidence(tx, &op)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// What each operation of a group was told, by its value.
    type Told = Arc<Mutex<Vec<(i64, String)>>>;

    /// A group's operations as (value, fails), and the values whose rows it keeps.
    type Case = (&'static [(i64, bool)], &'static [i64]);

    /// How a test operation behaves when it runs.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Does {
        /// Inserts its value.
        Insert,
        /// Inserts its value, then fails: only a rollback removes its row.
        FailAfterWriting,
        /// Fails before writing anything.
        FailFirst,
        /// Inserts its value, then panics (a bug).
        Panic,
        /// Inserts its value; run again, answers its caller on its own having written nothing
        /// (as an operation stopping for the history does).
        AnswersWhenRunAgain,
    }

    /// A test operation: `does` with `value` into `t`, telling `told` how its group ended, and
    /// `modes` whether each of its runs was inside a savepoint named `op` (its first statement
    /// is `ROLLBACK TO op`, which rolls back nothing there and fails where there is none).
    struct TestOp {
        value: i64,
        does: Does,
        told: Told,
        modes: Arc<Mutex<Vec<(i64, bool)>>>,
        /// Run once, at the operation's first run (the first operation queues others).
        first: Option<Box<dyn FnOnce() + Send>>,
        ran: bool,
        abandoned: bool,
        answered: bool,
    }

    impl Op for TestOp {
        fn run(&mut self, tx: Option<&mut SqliteTx<'_>>) -> Ran {
            if let Some(first) = self.first.take() {
                first();
            }
            self.ran = true;
            let Some(tx) = tx else { return Ran::Failed };
            let in_savepoint = block_on_ready(tx.execute("ROLLBACK TO op", &[])).is_ok();
            self.modes.lock().unwrap().push((self.value, in_savepoint));
            if self.does == Does::FailFirst {
                return Ran::Failed;
            }
            if self.does == Does::AnswersWhenRunAgain && in_savepoint {
                self.answered = true;
                self.told
                    .lock()
                    .unwrap()
                    .push((self.value, "answered on its own".into()));
                return Ran::Answered;
            }
            let inserted =
                block_on_ready(tx.execute("INSERT INTO t (x) VALUES ($1)", &[self.value.into()])).is_ok();
            match self.does {
                Does::Panic => panic!("a test operation panics after writing"),
                Does::Insert if inserted => Ran::Ok,
                _ => Ran::Failed,
            }
        }

        fn abandon(&mut self) {
            self.abandoned = true;
        }

        fn runnable(&self) -> bool {
            !self.abandoned && !self.answered
        }

        fn answer(self: Box<Self>, end: BatchEnd) {
            if self.ran && !self.abandoned && !self.answered {
                self.told.lock().unwrap().push((self.value, format!("{end:?}")));
            }
        }
    }

    /// Test operations, with what they tell.
    #[derive(Default)]
    struct Ops {
        told: Told,
        modes: Arc<Mutex<Vec<(i64, bool)>>>,
    }

    impl Ops {
        fn op(&self, value: i64, does: Does) -> Job {
            Box::new(TestOp {
                value,
                does,
                told: Arc::clone(&self.told),
                modes: Arc::clone(&self.modes),
                first: None,
                ran: false,
                abandoned: false,
                answered: false,
            })
        }

        fn told(&self) -> Vec<(i64, String)> {
            self.told.lock().unwrap().clone()
        }

        fn modes(&self) -> Vec<(i64, bool)> {
            self.modes.lock().unwrap().clone()
        }
    }

    /// An operation that inserts `value` into `t`, then fails when `fails`: a failing one has
    /// written before it fails, so only a rollback removes its row.
    fn insert(value: i64, fails: bool, ops: &Ops) -> Job {
        ops.op(
            value,
            if fails {
                Does::FailAfterWriting
            } else {
                Does::Insert
            },
        )
    }

    /// A WAL database in `dir` with the one table the operations above write.
    fn table_t(dir: &tempfile::TempDir) -> Connection {
        let connection = Connection::open(dir.path().join("t.db")).unwrap();
        connection
            .execute_batch("PRAGMA journal_mode = WAL; CREATE TABLE t (x INTEGER NOT NULL);")
            .unwrap();
        connection
    }

    fn rows(connection: &Connection) -> Vec<i64> {
        let mut statement = connection.prepare("SELECT x FROM t ORDER BY x").unwrap();
        statement
            .query_map([], |row| row.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    /// A group commit keeps exactly the writes of the operations that succeeded, whichever
    /// place a failing one has (first, between, last, every one): a failure after writing
    /// rolls the group back, and its second run gives each operation its own savepoint,
    /// rolled back alone. Each operation is answered once, in order, with the group's end.
    #[test]
    fn a_group_commit_keeps_the_writes_of_the_operations_that_succeeded_and_only_those() {
        let dir = tempfile::tempdir().unwrap();
        let connection = table_t(&dir);
        let (faults, counters) = (FaultInjector::default(), WriterCounters::default());
        let (_sender, nothing_queued) = mpsc::channel::<Job>();
        let cases: [Case; 7] = [
            (&[(1, true)], &[]),
            (&[(1, false)], &[1]),
            (&[(1, false), (2, true)], &[1]),
            (&[(1, true), (2, false), (3, true), (4, false)], &[2, 4]),
            (&[(1, false), (2, true), (3, false)], &[1, 3]),
            (&[(1, true), (2, true)], &[]),
            (&[(1, true), (2, true), (3, false), (4, false)], &[3, 4]),
        ];
        for (group, kept) in cases {
            connection.execute_batch("DELETE FROM t").unwrap();
            let ops = Ops::default();
            let batch = group
                .iter()
                .map(|&(value, fails)| insert(value, fails, &ops))
                .collect();
            let wrote = counters.write_ops.load(std::sync::atomic::Ordering::Relaxed);
            run_batch(&connection, batch, &nothing_queued, &faults, &counters);
            assert_eq!(rows(&connection), kept, "group {group:?}");
            assert_eq!(
                counters.write_ops.load(std::sync::atomic::Ordering::Relaxed) - wrote,
                kept.len() as u64,
                "group {group:?}: the operations that wrote and committed are counted"
            );
            let told = ops.told();
            let answered: Vec<i64> = told.iter().map(|(value, _)| *value).collect();
            let all: Vec<i64> = group.iter().map(|(value, _)| *value).collect();
            assert_eq!(answered, all, "group {group:?}: each answered once, in order");
            assert!(
                told.iter().all(|(_, end)| end == "Committed"),
                "group {group:?}: {told:?}"
            );
            assert!(
                connection.is_autocommit(),
                "group {group:?} left a transaction open"
            );
        }
        // A fault armed for the group reaches its operations even when none of them wrote.
        faults.arm(Fault::DropBeforeCommit);
        let ops = Ops::default();
        run_batch(
            &connection,
            vec![insert(9, true, &ops)],
            &nothing_queued,
            &faults,
            &counters,
        );
        assert_eq!(ops.told()[0].1, "Lost(\"before commit\")");
        assert!(connection.is_autocommit());
    }

    /// A group whose operations all succeed, or fail before writing, runs once and without a
    /// savepoint. One that fails or panics after writing rolls the group back, and the group
    /// runs again with each operation in its own savepoint. Either way exactly the rows of the
    /// operations that succeeded are kept, and each caller is answered once, in order (a
    /// panicking one never: its caller sees `WriterGone`).
    #[test]
    fn a_group_runs_without_savepoints_unless_an_operation_fails_after_writing() {
        let dir = tempfile::tempdir().unwrap();
        let connection = table_t(&dir);
        let (faults, counters) = (FaultInjector::default(), WriterCounters::default());
        let (_sender, nothing_queued) = mpsc::channel::<Job>();
        let reruns = || counters.reruns.load(std::sync::atomic::Ordering::Relaxed);
        let values = |told: Vec<(i64, String)>| {
            assert!(told.iter().all(|(_, end)| end == "Committed"), "{told:?}");
            told.into_iter().map(|(value, _)| value).collect::<Vec<_>>()
        };
        // A group of three inserts whose second one `does` as asked, on an empty table; only
        // the rows of 1 and 3 are kept whatever it does.
        let run = |does: Does| {
            connection.execute_batch("DELETE FROM t").unwrap();
            let ops = Ops::default();
            let group = vec![ops.op(1, Does::Insert), ops.op(2, does), ops.op(3, Does::Insert)];
            run_batch(&connection, group, &nothing_queued, &faults, &counters);
            assert_eq!(rows(&connection), [1, 3], "{does:?}");
            ops
        };
        // Succeeding, or failing first: one bare run.
        let ops = run(Does::FailFirst);
        assert_eq!(ops.modes(), [(1, false), (2, false), (3, false)]);
        assert_eq!(reruns(), 0);
        assert_eq!(values(ops.told()), [1, 2, 3]);
        // Failing after writing: the bare run stops there; the second runs every one in a
        // savepoint.
        let ops = run(Does::FailAfterWriting);
        assert_eq!(
            ops.modes(),
            [(1, false), (2, false), (1, true), (2, true), (3, true)]
        );
        assert_eq!(reruns(), 1);
        assert_eq!(values(ops.told()), [1, 2, 3]);
        // Panicking after writing: the same, and the panicking one is not run again.
        let ops = run(Does::Panic);
        assert_eq!(ops.modes(), [(1, false), (2, false), (1, true), (3, true)]);
        assert_eq!(reruns(), 2);
        assert_eq!(values(ops.told()), [1, 3]);
        assert!(connection.is_autocommit());
        // A second run left with nobody to answer (one answered on its own, the other
        // panicked) rolls back as a first run would, taking no injected fault: the fault stays
        // for the next group that has answers to give.
        connection.execute_batch("DELETE FROM t").unwrap();
        faults.arm(Fault::DropBeforeCommit);
        let ops = Ops::default();
        let group = vec![ops.op(1, Does::AnswersWhenRunAgain), ops.op(2, Does::Panic)];
        run_batch(&connection, group, &nothing_queued, &faults, &counters);
        assert_eq!(rows(&connection), Vec::<i64>::new());
        assert_eq!(ops.told(), [(1, "answered on its own".to_owned())]);
        assert_eq!(reruns(), 3);
        assert!(
            matches!(faults.take(), Some(Fault::DropBeforeCommit)),
            "the fault was taken"
        );
        assert!(connection.is_autocommit());
    }

    /// Operations queued while a group runs join it, before its COMMIT (one fsync for all),
    /// up to `GROUP_COMMIT_OPS_MAX` operations in the group; the rest wait in the queue.
    #[test]
    fn operations_queued_while_a_group_runs_join_it_up_to_the_group_limit() {
        let dir = tempfile::tempdir().unwrap();
        let connection = table_t(&dir);
        let (faults, counters) = (FaultInjector::default(), WriterCounters::default());
        let (sender, queue) = mpsc::channel::<Job>();
        let ops = Arc::new(Ops::default());
        // The first operation queues the next ones while it runs, as callers do meanwhile.
        let late = GROUP_COMMIT_OPS_MAX + 3;
        let first: Job = {
            let (queued, sender) = (Arc::clone(&ops), sender.clone());
            let mut first = TestOp {
                value: 0,
                does: Does::Insert,
                told: Arc::clone(&ops.told),
                modes: Arc::clone(&ops.modes),
                first: None,
                ran: false,
                abandoned: false,
                answered: false,
            };
            first.first = Some(Box::new(move || {
                for value in 1..=late as i64 {
                    sender.send(insert(value, false, &queued)).unwrap();
                }
            }));
            Box::new(first)
        };
        run_batch(&connection, vec![first], &queue, &faults, &counters);
        let answered = ops.told();
        let expected: Vec<i64> = (0..GROUP_COMMIT_OPS_MAX as i64).collect();
        assert_eq!(
            answered.iter().map(|(value, _)| *value).collect::<Vec<_>>(),
            expected
        );
        assert!(answered.iter().all(|(_, end)| end == "Committed"));
        assert_eq!(rows(&connection), expected, "one group, committed together");
        assert_eq!(
            queue.try_iter().count(),
            late + 1 - GROUP_COMMIT_OPS_MAX,
            "the rest wait"
        );
        assert!(connection.is_autocommit());
    }
}
