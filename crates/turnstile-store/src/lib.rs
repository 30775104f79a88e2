//! The `Ledger` trait and its SQLite (embedded default) and PostgreSQL implementations. The
//! store is the arbiter: every state change that matters is a conditional write whose
//! condition is the invariant (revision, cancel generation, active generation, state).
#![warn(missing_docs)]
#![forbid(unsafe_code)]
