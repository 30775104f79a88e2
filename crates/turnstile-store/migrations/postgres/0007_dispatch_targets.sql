-- Failover (shared/spec/gateway-api.md, "Additions (2026-12)", "Failover"): a dispatch may name
-- several targets, each with its own manifest and exact bytes, rendered from the same graph.
-- Target 0 is the dispatch row itself (manifest, request bytes, policy); targets 1.. are here.
-- Each attempt records which target it sent (`attempts.target`), and its request_digest is
-- that target's.
CREATE TABLE dispatch_targets (
    operation_id    TEXT NOT NULL REFERENCES dispatches (operation_id),
    position        BIGINT NOT NULL,
    manifest        TEXT NOT NULL,
    manifest_digest TEXT NOT NULL,
    request_digest  TEXT NOT NULL,
    request_bytes   BYTEA NOT NULL,
    provider        TEXT NOT NULL,
    policy          TEXT,
    PRIMARY KEY (operation_id, position)
);
ALTER TABLE attempts ADD COLUMN target BIGINT NOT NULL DEFAULT 0;
