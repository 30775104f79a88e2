//! Versioned schema migrations, one list for both databases. Each version is applied once,
//! in order, inside one transaction that also records it in `schema_migrations`; a database
//! newer than this build is refused rather than written to.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a dispatch's request bytes, manifest and policy are written once and survive the schema
//!   changes that moved them. Enforced in `store/migrations/*/0008_dispatch_bodies.sql`,
//!   `0009_dispatch_manifests.sql`, `ops.rs::prepare_targets`. Tests:
//!   `store/tests/it/conformance.rs::a_version_7_database_keeps_every_request_body_manifest_and_policy_across_migrations_8_and_9`
//!   (SQLite and PostgreSQL, a 300 KB body, a NULL policy), every conformance case reading
//!   `dispatch`.
//! - a sweep of live attempts or PREPARED dispatches reads a partial index that holds only those
//!   rows; a schema rebuild keeps every attempt, handle and transition (ids and order) and every
//!   foreign key. Enforced in `store/migrations/*/0010_live_indexes.sql`,
//!   `store/src/ops.rs::sweeps` (`LIVE_ATTEMPTS` repeated in each sweep),
//!   `store/src/sqlite.rs::migrate` (foreign keys off, `foreign_key_check` before commit). Tests:
//!   `store/tests/it/conformance.rs::a_version_9_database_keeps_its_attempts_handles_and_transitions_and_sweeps_read_live_rows_only`
//!   (rows and sweeps on both databases; the plans, every column of the rebuilt rows and the
//!   attempts foreign key on SQLite; red with the term dropped from a sweep: `SCAN attempts`, and
//!   with the foreign key dropped from the rebuild).

/// One schema version.
#[derive(Clone, Copy, Debug)]
pub struct Migration {
    /// Version number (1, 2, …).
    pub version: i64,
    /// Short name.
    pub name: &'static str,
    /// SQLite script.
    pub sqlite: &'static str,
    /// PostgreSQL script.
    pub postgres: &'static str,
}

/// Every migration, oldest first.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "ledger",
        sqlite: include_str!("../migrations/sqlite/0001_ledger.sql"),
        postgres: include_str!("../migrations/postgres/0001_ledger.sql"),
    },
    Migration {
        version: 2,
        name: "call_id_index",
        sqlite: include_str!("../migrations/sqlite/0002_call_id_index.sql"),
        postgres: include_str!("../migrations/postgres/0002_call_id_index.sql"),
    },
    Migration {
        version: 3,
        name: "dispatch_outcome",
        sqlite: include_str!("../migrations/sqlite/0003_dispatch_outcome.sql"),
        postgres: include_str!("../migrations/postgres/0003_dispatch_outcome.sql"),
    },
    Migration {
        version: 4,
        name: "attempt_story",
        sqlite: include_str!("../migrations/sqlite/0004_attempt_story.sql"),
        postgres: include_str!("../migrations/postgres/0004_attempt_story.sql"),
    },
    Migration {
        version: 5,
        name: "conversation_listing",
        sqlite: include_str!("../migrations/sqlite/0005_conversation_listing.sql"),
        postgres: include_str!("../migrations/postgres/0005_conversation_listing.sql"),
    },
    Migration {
        version: 6,
        name: "dispatch_policy",
        sqlite: include_str!("../migrations/sqlite/0006_dispatch_policy.sql"),
        postgres: include_str!("../migrations/postgres/0006_dispatch_policy.sql"),
    },
    Migration {
        version: 7,
        name: "dispatch_targets",
        sqlite: include_str!("../migrations/sqlite/0007_dispatch_targets.sql"),
        postgres: include_str!("../migrations/postgres/0007_dispatch_targets.sql"),
    },
    Migration {
        version: 8,
        name: "dispatch_bodies",
        sqlite: include_str!("../migrations/sqlite/0008_dispatch_bodies.sql"),
        postgres: include_str!("../migrations/postgres/0008_dispatch_bodies.sql"),
    },
    Migration {
        version: 9,
        name: "dispatch_manifests",
        sqlite: include_str!("../migrations/sqlite/0009_dispatch_manifests.sql"),
        postgres: include_str!("../migrations/postgres/0009_dispatch_manifests.sql"),
    },
    Migration {
        version: 10,
        name: "live_indexes",
        sqlite: include_str!("../migrations/sqlite/0010_live_indexes.sql"),
        postgres: include_str!("../migrations/postgres/0010_live_indexes.sql"),
    },
    Migration {
        version: 11,
        name: "live_index_term",
        sqlite: include_str!("../migrations/sqlite/0011_live_index_term.sql"),
        postgres: include_str!("../migrations/postgres/0011_live_index_term.sql"),
    },
    Migration {
        version: 12,
        name: "turn_digests",
        sqlite: include_str!("../migrations/sqlite/0012_turn_digests.sql"),
        postgres: include_str!("../migrations/postgres/0012_turn_digests.sql"),
    },
    Migration {
        version: 13,
        name: "history_repairs",
        sqlite: include_str!("../migrations/sqlite/0013_history_repairs.sql"),
        postgres: include_str!("../migrations/postgres/0013_history_repairs.sql"),
    },
    // Issue 51.
    Migration {
        version: 14,
        name: "attempt_evidence",
        sqlite: include_str!("../migrations/sqlite/0014_attempt_evidence.sql"),
        postgres: include_str!("../migrations/postgres/0014_attempt_evidence.sql"),
    },
];

/// The newest version this build knows.
pub fn latest() -> i64 {
    MIGRATIONS.last().map_or(0, |migration| migration.version)
}

/// The table that records applied versions (same DDL on both databases).
pub(crate) const SCHEMA_MIGRATIONS_DDL: &str = "CREATE TABLE IF NOT EXISTS schema_migrations (\
     version BIGINT PRIMARY KEY, name TEXT NOT NULL, applied_at BIGINT NOT NULL)";
