//! The small SQL surface every operation is written against, once, for both databases.
//!
//! Operations in [`crate::ops`] are `async fn`s over a [`Tx`]: an open transaction that can
//! execute a statement (returning the affected-row count, which is how every compare-and-set
//! learns whether it won) and run a query. PostgreSQL implements it with tokio-postgres;
//! SQLite implements it synchronously (its futures are ready at once) and drives the same
//! code on its writer thread with [`block_on_ready`]. Statements use `$1 … $n` placeholders;
//! the SQLite side rewrites them to `?1 … ?n`.

use crate::error::StoreError;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

/// One SQL parameter or column value. Only the types the schema uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SqlValue {
    /// SQL NULL.
    Null,
    /// BIGINT / INTEGER.
    Int(i64),
    /// TEXT.
    Text(String),
    /// BLOB / BYTEA.
    Bytes(Vec<u8>),
}

impl From<i64> for SqlValue {
    fn from(value: i64) -> SqlValue {
        SqlValue::Int(value)
    }
}

impl From<u64> for SqlValue {
    fn from(value: u64) -> SqlValue {
        // Revisions, generations and timestamps stay far below i64::MAX; saturate rather
        // than wrap if a caller ever passes more.
        SqlValue::Int(i64::try_from(value).unwrap_or(i64::MAX))
    }
}

impl From<&str> for SqlValue {
    fn from(value: &str) -> SqlValue {
        SqlValue::Text(value.to_owned())
    }
}

impl From<String> for SqlValue {
    fn from(value: String) -> SqlValue {
        SqlValue::Text(value)
    }
}

impl From<&[u8]> for SqlValue {
    fn from(value: &[u8]) -> SqlValue {
        SqlValue::Bytes(value.to_vec())
    }
}

impl<T: Into<SqlValue>> From<Option<T>> for SqlValue {
    fn from(value: Option<T>) -> SqlValue {
        value.map_or(SqlValue::Null, Into::into)
    }
}

/// One result row: its column values in select order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row(pub Vec<SqlValue>);

impl Row {
    fn column(&self, index: usize) -> Result<&SqlValue, StoreError> {
        self.0
            .get(index)
            .ok_or_else(|| StoreError::Corrupt(format!("row has no column {index}")))
    }

    /// An integer column.
    pub fn int(&self, index: usize) -> Result<i64, StoreError> {
        match self.column(index)? {
            SqlValue::Int(value) => Ok(*value),
            other => Err(StoreError::Corrupt(format!(
                "column {index}: expected integer, found {other:?}"
            ))),
        }
    }

    /// A non-negative integer column.
    pub fn uint(&self, index: usize) -> Result<u64, StoreError> {
        let value = self.int(index)?;
        u64::try_from(value).map_err(|_| StoreError::Corrupt(format!("column {index}: negative {value}")))
    }

    /// A nullable non-negative integer column.
    pub fn uint_opt(&self, index: usize) -> Result<Option<u64>, StoreError> {
        match self.column(index)? {
            SqlValue::Null => Ok(None),
            _ => self.uint(index).map(Some),
        }
    }

    /// A text column.
    pub fn text(&self, index: usize) -> Result<String, StoreError> {
        match self.column(index)? {
            SqlValue::Text(value) => Ok(value.clone()),
            other => Err(StoreError::Corrupt(format!(
                "column {index}: expected text, found {other:?}"
            ))),
        }
    }

    /// A nullable text column.
    pub fn text_opt(&self, index: usize) -> Result<Option<String>, StoreError> {
        match self.column(index)? {
            SqlValue::Null => Ok(None),
            _ => self.text(index).map(Some),
        }
    }

    /// A bytes column.
    pub fn bytes(&self, index: usize) -> Result<Vec<u8>, StoreError> {
        match self.column(index)? {
            SqlValue::Bytes(value) => Ok(value.clone()),
            other => Err(StoreError::Corrupt(format!(
                "column {index}: expected bytes, found {other:?}"
            ))),
        }
    }
}

/// Which database a [`Tx`] talks to (for the few statements that differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// SQLite: one writer at a time (`BEGIN IMMEDIATE`), so no row locks are needed.
    Sqlite,
    /// PostgreSQL at READ COMMITTED: conditional writes plus `FOR SHARE` where a condition
    /// reads another row.
    Postgres,
}

impl Dialect {
    /// The SQL expression for the store's own clock in epoch milliseconds: the one clock every
    /// lease and fencing decision is judged by, whichever process (and whichever local clock)
    /// issues the statement. PostgreSQL: the server's `clock_timestamp()`. SQLite: the
    /// connection's `turnstile_now_ms()` function ([`crate::StoreClock`]), the host's system
    /// clock (`julianday('now')`) unless a test gives the store a manual clock.
    pub fn now_ms(self) -> &'static str {
        match self {
            // The manual clock when the connection has one, else SQLite's own time.
            Dialect::Sqlite => {
                "COALESCE(turnstile_now_ms(), CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER))"
            }
            Dialect::Postgres => "(floor(extract(epoch from clock_timestamp()) * 1000))::bigint",
        }
    }
}

/// An open transaction.
pub trait Tx {
    /// The database behind it.
    fn dialect(&self) -> Dialect;
    /// Execute one statement; the affected-row count.
    fn execute(&mut self, sql: &str, params: &[SqlValue]) -> impl Future<Output = Result<u64, StoreError>>;
    /// Run a query; all rows.
    fn query(&mut self, sql: &str, params: &[SqlValue])
    -> impl Future<Output = Result<Vec<Row>, StoreError>>;
}

/// Run a future that never waits (SQLite's `Tx` is synchronous) to completion.
pub(crate) fn block_on_ready<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut context = Context::from_waker(Waker::noop());
    match future.as_mut().poll(&mut context) {
        Poll::Ready(output) => output,
        // Invariant: only used with `SqliteTx`, whose methods contain no await point that can
        // pend, so the first poll always completes.
        Poll::Pending => panic!("a SQLite operation awaited something that can pend"),
    }
}
