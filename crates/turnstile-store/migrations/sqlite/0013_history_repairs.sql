-- Version 13 (SQLite): the durable record of each history repair (issue 54; docs/operating.md,
-- "Repairing a history"). One row per repair, written in the transaction that appends the
-- repaired turn, keyed by the revision that turn made: the plan as JSON (what it changed and
-- what it took out, verbatim), its digest, who asked and when (store clock, ms).
CREATE TABLE history_repairs (
    conversation_id TEXT NOT NULL REFERENCES conversations (conversation_id),
    revision        INTEGER NOT NULL,
    plan_digest     TEXT NOT NULL,
    plan            TEXT NOT NULL,
    tenant          TEXT,
    actor           TEXT,
    repaired_at     INTEGER NOT NULL,
    PRIMARY KEY (conversation_id, revision)
);
