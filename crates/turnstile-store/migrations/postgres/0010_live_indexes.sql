-- Version 10 (PostgreSQL): state indexes that hold only the rows a sweep looks for, as on
-- SQLite (where this version also rebuilds attempts, handles and transitions into fewer
-- B-trees; PostgreSQL has no rowid to save). A finished attempt or dispatch leaves the index
-- instead of growing it for ever.
DROP INDEX attempts_by_state;
CREATE INDEX attempts_live ON attempts (state)
    WHERE state IN ('DISPATCHING', 'SENT', 'STREAMING', 'UNKNOWN');
DROP INDEX dispatches_by_state;
CREATE INDEX dispatches_prepared ON dispatches (updated_at, operation_id) WHERE state = 'PREPARED';
