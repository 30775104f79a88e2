-- Version 1 of the dispatch ledger (SQLite). Times are milliseconds since the Unix epoch,
-- passed in by the caller; nothing here reads a clock.
CREATE TABLE conversations (
    conversation_id TEXT PRIMARY KEY,
    revision        INTEGER NOT NULL,
    tools           TEXT NOT NULL,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);
CREATE TABLE turns (
    conversation_id TEXT NOT NULL REFERENCES conversations (conversation_id),
    revision        INTEGER NOT NULL,
    role            TEXT NOT NULL,
    generation      INTEGER,
    operation_id    TEXT,
    turn            TEXT NOT NULL,
    committed_at    INTEGER NOT NULL,
    PRIMARY KEY (conversation_id, revision)
);
CREATE TABLE dispatches (
    operation_id       TEXT PRIMARY KEY,
    conversation_id    TEXT NOT NULL REFERENCES conversations (conversation_id),
    revision           INTEGER NOT NULL,
    manifest           TEXT NOT NULL,
    manifest_digest    TEXT NOT NULL,
    request_digest     TEXT NOT NULL,
    request_bytes      BLOB NOT NULL,
    provider           TEXT NOT NULL,
    state              TEXT NOT NULL,
    cancel_generation  INTEGER NOT NULL,
    generation_last    INTEGER NOT NULL,
    active_generation  INTEGER,
    committed_revision INTEGER,
    quarantined        INTEGER NOT NULL,
    created_at         INTEGER NOT NULL,
    updated_at         INTEGER NOT NULL
);
CREATE INDEX dispatches_by_conversation ON dispatches (conversation_id);
CREATE TABLE attempts (
    operation_id     TEXT NOT NULL REFERENCES dispatches (operation_id),
    generation       INTEGER NOT NULL,
    state            TEXT NOT NULL,
    idempotency_key  TEXT NOT NULL,
    request_digest   TEXT NOT NULL,
    handle           TEXT,
    lease_holder     TEXT NOT NULL,
    lease_expires_at INTEGER NOT NULL,
    started_at       INTEGER NOT NULL,
    PRIMARY KEY (operation_id, generation)
);
CREATE INDEX attempts_by_state ON attempts (state);
CREATE TABLE handles (
    provider        TEXT NOT NULL,
    handle          TEXT NOT NULL,
    manifest_digest TEXT NOT NULL,
    operation_id    TEXT NOT NULL,
    generation      INTEGER NOT NULL,
    bound_at        INTEGER NOT NULL,
    PRIMARY KEY (provider, handle)
);
CREATE TABLE transitions (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    operation_id TEXT NOT NULL,
    generation   INTEGER,
    from_state   TEXT,
    to_state     TEXT NOT NULL,
    at           INTEGER NOT NULL
);
CREATE INDEX transitions_by_attempt ON transitions (operation_id, generation);
CREATE TABLE tool_calls (
    conversation_id  TEXT NOT NULL,
    call_id          TEXT NOT NULL,
    revision         INTEGER NOT NULL,
    position         INTEGER NOT NULL,
    generation       INTEGER NOT NULL,
    operation_id     TEXT NOT NULL,
    tool             TEXT NOT NULL,
    arguments        TEXT NOT NULL,
    args_digest      TEXT NOT NULL,
    state            TEXT NOT NULL,
    claim            INTEGER NOT NULL,
    claim_holder     TEXT,
    claim_expires_at INTEGER,
    result_revision  INTEGER,
    PRIMARY KEY (conversation_id, call_id)
);
CREATE INDEX tool_calls_by_state ON tool_calls (state);
CREATE TABLE quarantine (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    operation_id TEXT NOT NULL,
    generation   INTEGER NOT NULL,
    reason       TEXT NOT NULL,
    content      TEXT NOT NULL,
    at           INTEGER NOT NULL
);
CREATE TABLE counters (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT INTO counters (name, value) VALUES
    ('foreign_handle_refusals', 0), ('canonical_cas_conflicts', 0), ('late_blocks', 0),
    ('quarantine_dropped', 0), ('tool_result_duplicates', 0);
