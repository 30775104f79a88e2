-- Version 10 (SQLite): fewer B-trees written per dispatch, and state indexes that hold only
-- the rows a sweep looks for (issue 21;
-- docs/decisions/0091-fewer-b-trees-per-dispatch-partial-state-indexes-without.md, "Fewer B-trees
-- per dispatch"). Every page a transaction changes is one WAL frame; a row of a rowid table with a
-- TEXT primary key lives in two B-trees (the table and its key's index), and AUTOINCREMENT writes
-- sqlite_sequence on every insert. The migration runs with foreign keys off, as SQLite's procedure
-- for changing a table's definition asks; the ledger checks them before it commits.

-- attempts and handles: rows of a few hundred bytes, always found by their primary key, so
-- one B-tree each.
CREATE TABLE attempts_v10 (
    operation_id     TEXT NOT NULL REFERENCES dispatches (operation_id),
    generation       INTEGER NOT NULL,
    state            TEXT NOT NULL,
    idempotency_key  TEXT NOT NULL,
    request_digest   TEXT NOT NULL,
    handle           TEXT,
    lease_holder     TEXT NOT NULL,
    lease_expires_at INTEGER NOT NULL,
    started_at       INTEGER NOT NULL,
    resumes          INTEGER NOT NULL DEFAULT 0,
    replays          INTEGER NOT NULL DEFAULT 0,
    end_reason       TEXT,
    confirmed_over   TEXT,
    target           INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (operation_id, generation)
) WITHOUT ROWID;
INSERT INTO attempts_v10 (operation_id, generation, state, idempotency_key, request_digest, handle,
    lease_holder, lease_expires_at, started_at, resumes, replays, end_reason, confirmed_over, target)
SELECT operation_id, generation, state, idempotency_key, request_digest, handle,
    lease_holder, lease_expires_at, started_at, resumes, replays, end_reason, confirmed_over, target
FROM attempts ORDER BY operation_id, generation;
DROP TABLE attempts;
ALTER TABLE attempts_v10 RENAME TO attempts;
-- Only attempts that are not over: the expiry sweep, the UNKNOWN sweep and the stuck age read
-- these, and a finished attempt leaves the index instead of growing it for ever.
CREATE INDEX attempts_live ON attempts (state)
    WHERE state IN ('DISPATCHING', 'SENT', 'STREAMING', 'UNKNOWN');

CREATE TABLE handles_v10 (
    provider        TEXT NOT NULL,
    handle          TEXT NOT NULL,
    manifest_digest TEXT NOT NULL,
    operation_id    TEXT NOT NULL,
    generation      INTEGER NOT NULL,
    bound_at        INTEGER NOT NULL,
    PRIMARY KEY (provider, handle)
) WITHOUT ROWID;
INSERT INTO handles_v10 (provider, handle, manifest_digest, operation_id, generation, bound_at)
SELECT provider, handle, manifest_digest, operation_id, generation, bound_at FROM handles
ORDER BY provider, handle;
DROP TABLE handles;
ALTER TABLE handles_v10 RENAME TO handles;

-- transitions: the same ids, without AUTOINCREMENT. Rows are never deleted, so the next id is
-- still the largest plus one and `ORDER BY id` keeps its meaning. (Dropping the old table
-- removes its sqlite_sequence row.)
CREATE TABLE transitions_v10 (
    id           INTEGER PRIMARY KEY,
    operation_id TEXT NOT NULL,
    generation   INTEGER,
    from_state   TEXT,
    to_state     TEXT NOT NULL,
    at           INTEGER NOT NULL
);
INSERT INTO transitions_v10 (id, operation_id, generation, from_state, to_state, at)
SELECT id, operation_id, generation, from_state, to_state, at FROM transitions;
DROP TABLE transitions;
ALTER TABLE transitions_v10 RENAME TO transitions;
CREATE INDEX transitions_by_attempt ON transitions (operation_id, generation);

-- Only PREPARED dispatches: the sweep of dispatches nobody drives reads this, in its order.
DROP INDEX dispatches_by_state;
CREATE INDEX dispatches_prepared ON dispatches (updated_at, operation_id) WHERE state = 'PREPARED';
