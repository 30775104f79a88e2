//! Store failures. A lost compare-and-set is *not* here: it is a normal outcome of each
//! operation (see [`crate::types`]). These are the cases where the store could not answer.

/// Why the store could not answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// SQLite reported an error.
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// PostgreSQL reported an error or the connection failed.
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    /// No PostgreSQL connection could be taken from the pool.
    #[error("postgres pool: {0}")]
    Pool(String),
    /// The connection was lost around a commit; whether the write landed is unknown until it
    /// is read back (operations are idempotent or report the state they find, so a retry is
    /// safe).
    #[error("connection lost ({0})")]
    ConnectionLost(&'static str),
    /// The store did not answer within its bound (`store_timeout_ms`: a statement or lock wait
    /// the database cancelled, a pool wait, or an operation the database never answered, as
    /// when it is frozen); nothing landed. A deadline that ran out during COMMIT is
    /// [`StoreError::ConnectionLost`] instead: whether that commit landed is unknown.
    #[error("the store did not answer in time ({0})")]
    TimedOut(&'static str),
    /// The SQLite writer thread is gone (the ledger was closed or the thread panicked).
    #[error("the SQLite writer thread has stopped")]
    WriterGone,
    /// A stored row does not decode (schema drift or manual edits).
    #[error("stored data does not decode: {0}")]
    Corrupt(String),
    /// The database schema is newer than this build knows.
    #[error("database schema version {found} is newer than this build's {known}")]
    SchemaTooNew {
        /// Version found in the database.
        found: i64,
        /// Newest version this build knows.
        known: i64,
    },
    /// Our own code asked for an edge that is not in the dispatch diagram (a bug).
    #[error("illegal dispatch transition {from} -> {to}")]
    IllegalTransition {
        /// State the caller expected.
        from: turnstile_core::dispatch::DispatchState,
        /// State the caller asked for.
        to: turnstile_core::dispatch::DispatchState,
    },
    /// The transaction did not commit (the database refused COMMIT); nothing landed.
    #[error("commit failed: {0}")]
    CommitFailed(String),
    /// The store URL is not one this build understands.
    #[error("unsupported store URL (expected sqlite:PATH or postgres://…)")]
    BadUrl,
    /// Internal to the SQLite ledger, never returned by it: a check found no validator state
    /// for this conversation at this revision and may not walk the history on the writer
    /// thread. The operation stops before its first write; the ledger walks
    /// the history off the writer and runs the operation again.
    #[doc(hidden)]
    #[error("internal: no validator state for {conversation_id} at revision {revision}")]
    HistoryNeeded {
        /// The conversation.
        conversation_id: String,
        /// The revision whose state the check needs.
        revision: u64,
    },
}
