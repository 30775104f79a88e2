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
    /// PostgreSQL could not be reached or refused this client at connect time, with the cause
    /// an operator acts on (start-up: `turnstile serve` retries the retryable ones within
    /// `store_connect_retry_ms`).
    #[error("cannot connect to PostgreSQL: {cause}: {detail}")]
    Connect {
        /// What went wrong, in the operator's terms.
        cause: ConnectCause,
        /// The driver's own account (each error of its chain, outermost first).
        detail: String,
    },
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

/// Why a connection to PostgreSQL failed ([`StoreError::Connect`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectCause {
    /// Nothing listens at the host and port (TCP connection refused).
    Refused,
    /// The host name does not resolve.
    UnknownHost,
    /// No answer within the connect bound (`store_timeout_ms`): packets dropped, host down.
    TimedOut,
    /// The server refused the role or its password (SQLSTATE class 28), or the URL has none.
    Authentication,
    /// TLS is required (by the URL's `sslmode` or the server's `pg_hba.conf`) and this build
    /// connects without it, or the handshake failed.
    Tls,
    /// The database named in the URL does not exist (SQLSTATE 3D000).
    MissingDatabase,
    /// The server answered but takes no connection now: starting up, shutting down, or out of
    /// connection slots (SQLSTATE 57P01–57P03, 53300).
    Unavailable,
    /// Anything else the driver reported.
    Other,
}

impl ConnectCause {
    /// Whether waiting may cure it: the server is not there or not ready yet. A definite
    /// refusal (credentials, TLS, a missing database) is not retried: it needs an operator.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ConnectCause::Refused
                | ConnectCause::UnknownHost
                | ConnectCause::TimedOut
                | ConnectCause::Unavailable
        )
    }

    /// Stable lower-case name (logs).
    pub fn name(self) -> &'static str {
        match self {
            ConnectCause::Refused => "refused",
            ConnectCause::UnknownHost => "unknown_host",
            ConnectCause::TimedOut => "timed_out",
            ConnectCause::Authentication => "authentication",
            ConnectCause::Tls => "tls",
            ConnectCause::MissingDatabase => "missing_database",
            ConnectCause::Unavailable => "unavailable",
            ConnectCause::Other => "other",
        }
    }
}

impl std::fmt::Display for ConnectCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConnectCause::Refused => {
                "connection refused: nothing listens at that host and port (is PostgreSQL \
                 running, and is the port right?)"
            }
            ConnectCause::UnknownHost => {
                "unknown host: the host name in the store URL does not resolve (check its \
                 spelling and DNS)"
            }
            ConnectCause::TimedOut => {
                "no answer within store_timeout_ms (is the host up? a firewall dropping packets?)"
            }
            ConnectCause::Authentication => {
                "authentication failed: the server refused the user or its password (check the \
                 credentials in the store URL and pg_hba.conf)"
            }
            ConnectCause::Tls => {
                "TLS: the URL's sslmode or the server's pg_hba.conf requires TLS, which this \
                 build does not speak to PostgreSQL (allow a plain connection on a trusted \
                 network, or connect through a TLS-terminating proxy)"
            }
            ConnectCause::MissingDatabase => {
                "the database named in the store URL does not exist (create it first: \
                 CREATE DATABASE …)"
            }
            ConnectCause::Unavailable => {
                "the server takes no connection now (starting up, shutting down, or out of \
                 connection slots)"
            }
            ConnectCause::Other => "the connection failed",
        })
    }
}

impl StoreError {
    /// This error as a failure to connect, where it is one: a driver error of the first
    /// connection becomes [`StoreError::Connect`] with its cause; anything else is unchanged.
    pub fn at_connect(self) -> StoreError {
        match self {
            StoreError::Postgres(error) => {
                let cause = connect_cause(&error);
                StoreError::Connect {
                    cause,
                    detail: chain(&error),
                }
            }
            StoreError::TimedOut(what) => StoreError::Connect {
                cause: ConnectCause::TimedOut,
                detail: what.to_owned(),
            },
            other => other,
        }
    }
}

/// Every error of `error`'s source chain, outermost first, joined by ": " (tokio-postgres
/// prints only the outermost, "error connecting to server", which names no cause).
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        let own = inner.to_string();
        if !text.ends_with(&own) {
            text.push_str(": ");
            text.push_str(&own);
        }
        source = inner.source();
    }
    text
}

/// The operator's cause of a connect failure: the server's SQLSTATE where it answered, the
/// socket error where it did not.
fn connect_cause(error: &tokio_postgres::Error) -> ConnectCause {
    if let Some(db) = error.as_db_error() {
        let code = db.code().code();
        return match code {
            "3D000" => ConnectCause::MissingDatabase,
            // pg_hba.conf has only `hostssl` lines for this client.
            _ if code.starts_with("28") && db.message().contains("no encryption") => ConnectCause::Tls,
            _ if code.starts_with("28") => ConnectCause::Authentication,
            "57P01" | "57P02" | "57P03" | "53300" => ConnectCause::Unavailable,
            _ => ConnectCause::Other,
        };
    }
    let outer = error.to_string();
    if outer.contains("TLS") {
        return ConnectCause::Tls;
    }
    if outer.contains("password missing") {
        return ConnectCause::Authentication;
    }
    let mut source = std::error::Error::source(error);
    while let Some(inner) = source {
        if let Some(io) = inner.downcast_ref::<std::io::Error>() {
            match io.kind() {
                std::io::ErrorKind::ConnectionRefused => return ConnectCause::Refused,
                std::io::ErrorKind::TimedOut => return ConnectCause::TimedOut,
                _ => {}
            }
            // std's resolver error has no kind of its own (getaddrinfo's EAI_* codes).
            if io.to_string().contains("failed to lookup address") {
                return ConnectCause::UnknownHost;
            }
        }
        source = inner.source();
    }
    if outer.contains("timeout") || outer.contains("timed out") {
        return ConnectCause::TimedOut;
    }
    ConnectCause::Other
}
