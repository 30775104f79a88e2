//! Integration tests of turnstile-store (one binary, see STYLE.md): the conformance suite for
//! SQLite and PostgreSQL, races between two replicas, crash windows on SQLite, and a
//! model-based test against a small reference model of the transitions.

mod conformance;
mod crash;
mod model;
mod races;
mod support;
