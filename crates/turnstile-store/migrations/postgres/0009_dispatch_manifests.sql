-- Manifests and render policies out of the dispatch row (issue 21), as migration 8 did for the
-- request bytes. Both are written once at the prepare and never change, yet they were most of
-- the row (about 1.5 KB of its 2 KB): every state change of a dispatch rewrote them (a new
-- tuple version on PostgreSQL, a rewritten record in SQLite's WAL). They join the body in
-- `dispatch_bodies`; the row that changes keeps only what changes and what is matched on.
--
-- Like migration 8 it removes columns: every replica is stopped before the upgrade
-- (docs/operating.md); the copy runs under the LOCK below.
LOCK TABLE dispatches IN SHARE ROW EXCLUSIVE MODE;
ALTER TABLE dispatch_bodies ADD COLUMN manifest TEXT;
ALTER TABLE dispatch_bodies ADD COLUMN policy TEXT;
UPDATE dispatch_bodies b SET manifest = d.manifest, policy = d.policy
    FROM dispatches d WHERE d.operation_id = b.operation_id;
ALTER TABLE dispatches DROP COLUMN manifest;
ALTER TABLE dispatches DROP COLUMN policy;
