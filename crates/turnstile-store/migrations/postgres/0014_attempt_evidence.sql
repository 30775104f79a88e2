-- Version 14 (PostgreSQL): per-connection attempt evidence, as in the SQLite script (issue 51).
CREATE TABLE attempt_evidence (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id TEXT NOT NULL,
    generation   BIGINT NOT NULL,
    evidence     TEXT NOT NULL,
    at           BIGINT NOT NULL
);
CREATE INDEX attempt_evidence_by_operation ON attempt_evidence (operation_id, generation);
