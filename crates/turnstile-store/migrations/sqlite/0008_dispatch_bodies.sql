-- Request bodies out of the dispatch row (issue 21). SQLite stores a row as one record and
-- rewrites all of it on every UPDATE: with the exact request bytes (hundreds of KiB for a long
-- conversation) in `dispatches`, every state change of a dispatch rewrote its body into the
-- WAL, and every read of a column stored after it (state, generations, timestamps: the sweep,
-- each transition) walked the body's overflow pages. The bytes never change after the
-- prepare, so they get their own table, written once; the hot reads and writes of a dispatch
-- no longer touch them.
--
-- The first migration that removes a column: a replica of an older build cannot write a
-- dispatch once it ran (its INSERT names the column), so every replica is stopped before the
-- upgrade (docs/operating.md). No body is lost to one that is still running: the copy runs
-- under a lock that holds off every other writer of `dispatches` until the column is gone
-- (SQLite: the migration's IMMEDIATE transaction; PostgreSQL: a LOCK TABLE in its copy of
-- this migration).
CREATE TABLE dispatch_bodies (
    operation_id  TEXT PRIMARY KEY REFERENCES dispatches (operation_id),
    request_bytes BLOB NOT NULL
);
INSERT INTO dispatch_bodies (operation_id, request_bytes) SELECT operation_id, request_bytes FROM dispatches;
ALTER TABLE dispatches DROP COLUMN request_bytes;
-- The sweep of PREPARED dispatches nobody drives (`prepared_unattended`) reads this index,
-- not every dispatch.
CREATE INDEX dispatches_by_state ON dispatches (state, updated_at);
