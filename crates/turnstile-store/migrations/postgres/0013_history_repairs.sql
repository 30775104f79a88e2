-- Version 13 (PostgreSQL): the durable record of each history repair, as in the SQLite script
-- (issue 54).
CREATE TABLE history_repairs (
    conversation_id TEXT NOT NULL REFERENCES conversations (conversation_id),
    revision        BIGINT NOT NULL,
    plan_digest     TEXT NOT NULL,
    plan            TEXT NOT NULL,
    tenant          TEXT,
    actor           TEXT,
    repaired_at     BIGINT NOT NULL,
    PRIMARY KEY (conversation_id, revision)
);
