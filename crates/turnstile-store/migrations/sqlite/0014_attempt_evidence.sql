-- Version 14 (SQLite): what the provider's side of each attempt's connection showed (issue 51;
-- docs/decisions/0171-per-attempt-evidence.md): status, request id, retry-after, the bounded
-- error body, bytes, timings, usage and the retracted preview, one JSON row per response
-- connection, written once (a failed connection on its own, the committed one in the commit's
-- transaction). Only appended; read by `GET /v1/dispatches/{id}`. No column of another table
-- changes, so a replica of the older build keeps working beside it (it writes no evidence).
CREATE TABLE attempt_evidence (
    id           INTEGER PRIMARY KEY,
    operation_id TEXT NOT NULL,
    generation   INTEGER NOT NULL,
    evidence     TEXT NOT NULL,
    at           INTEGER NOT NULL
);
CREATE INDEX attempt_evidence_by_operation ON attempt_evidence (operation_id, generation);
