//! Integration tests of turnstile-store (one binary, see STYLE.md): the conformance suite for
//! SQLite and PostgreSQL (`TURNSTILE_PG_URL`; missing → those cases fail, never skip), races
//! between two replicas, crash windows on SQLite (stop after each step, die before COMMIT,
//! kill -9 a child process), the core's `DispatchMachine` driven against both stores, and a
//! model-based test against a small reference model of the transitions.

mod bounded;
mod conformance;
mod crash;
mod listing;
mod machine;
mod model;
mod races;
mod support;
mod tool_ledger;
