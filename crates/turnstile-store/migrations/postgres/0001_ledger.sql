-- Version 1 of the dispatch ledger (PostgreSQL). Times are milliseconds since the Unix epoch,
-- passed in by the caller; nothing here reads a clock.
CREATE TABLE conversations (
    conversation_id TEXT PRIMARY KEY,
    revision        BIGINT NOT NULL,
    tools           TEXT NOT NULL,
    created_at      BIGINT NOT NULL,
    updated_at      BIGINT NOT NULL
);
CREATE TABLE turns (
    conversation_id TEXT NOT NULL REFERENCES conversations (conversation_id),
    revision        BIGINT NOT NULL,
    role            TEXT NOT NULL,
    generation      BIGINT,
    operation_id    TEXT,
    turn            TEXT NOT NULL,
    committed_at    BIGINT NOT NULL,
    PRIMARY KEY (conversation_id, revision)
);
CREATE TABLE dispatches (
    operation_id       TEXT PRIMARY KEY,
    conversation_id    TEXT NOT NULL REFERENCES conversations (conversation_id),
    revision           BIGINT NOT NULL,
    manifest           TEXT NOT NULL,
    manifest_digest    TEXT NOT NULL,
    request_digest     TEXT NOT NULL,
    request_bytes      BYTEA NOT NULL,
    provider           TEXT NOT NULL,
    state              TEXT NOT NULL,
    cancel_generation  BIGINT NOT NULL,
    generation_last    BIGINT NOT NULL,
    active_generation  BIGINT,
    committed_revision BIGINT,
    quarantined        BIGINT NOT NULL,
    created_at         BIGINT NOT NULL,
    updated_at         BIGINT NOT NULL
);
CREATE INDEX dispatches_by_conversation ON dispatches (conversation_id);
CREATE TABLE attempts (
    operation_id     TEXT NOT NULL REFERENCES dispatches (operation_id),
    generation       BIGINT NOT NULL,
    state            TEXT NOT NULL,
    idempotency_key  TEXT NOT NULL,
    request_digest   TEXT NOT NULL,
    handle           TEXT,
    lease_holder     TEXT NOT NULL,
    lease_expires_at BIGINT NOT NULL,
    started_at       BIGINT NOT NULL,
    PRIMARY KEY (operation_id, generation)
);
CREATE INDEX attempts_by_state ON attempts (state);
CREATE TABLE handles (
    provider        TEXT NOT NULL,
    handle          TEXT NOT NULL,
    manifest_digest TEXT NOT NULL,
    operation_id    TEXT NOT NULL,
    generation      BIGINT NOT NULL,
    bound_at        BIGINT NOT NULL,
    PRIMARY KEY (provider, handle)
);
CREATE TABLE transitions (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id TEXT NOT NULL,
    generation   BIGINT,
    from_state   TEXT,
    to_state     TEXT NOT NULL,
    at           BIGINT NOT NULL
);
CREATE INDEX transitions_by_attempt ON transitions (operation_id, generation);
CREATE TABLE tool_calls (
    conversation_id  TEXT NOT NULL,
    call_id          TEXT NOT NULL,
    revision         BIGINT NOT NULL,
    position         BIGINT NOT NULL,
    generation       BIGINT NOT NULL,
    operation_id     TEXT NOT NULL,
    tool             TEXT NOT NULL,
    arguments        TEXT NOT NULL,
    args_digest      TEXT NOT NULL,
    state            TEXT NOT NULL,
    claim            BIGINT NOT NULL,
    claim_holder     TEXT,
    claim_expires_at BIGINT,
    result_revision  BIGINT,
    PRIMARY KEY (conversation_id, call_id)
);
CREATE INDEX tool_calls_by_state ON tool_calls (state);
CREATE TABLE quarantine (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id TEXT NOT NULL,
    generation   BIGINT NOT NULL,
    reason       TEXT NOT NULL,
    content      TEXT NOT NULL,
    at           BIGINT NOT NULL
);
CREATE TABLE counters (
    name  TEXT PRIMARY KEY,
    value BIGINT NOT NULL
);
INSERT INTO counters (name, value) VALUES
    ('foreign_handle_refusals', 0), ('canonical_cas_conflicts', 0), ('late_blocks', 0),
    ('quarantine_dropped', 0), ('tool_result_duplicates', 0);
