-- Manifests and render policies out of the dispatch row (issue 21), as migration 8 did for the
-- request bytes. Both are written once at the prepare and never change, yet they were most of
-- the row (about 1.5 KB of its 2 KB): every state change of a dispatch (begin, each carried
-- transition, the commit) rewrote them into the WAL, and a page held one or two dispatches, so
-- each dispatch of a group commit dirtied its own page. They join the body in
-- `dispatch_bodies`; the row that changes keeps only what changes and what is matched on.
--
-- Like migration 8 it removes columns: every replica is stopped before the upgrade
-- (docs/operating.md); the copy runs in the migration's IMMEDIATE transaction.
ALTER TABLE dispatch_bodies ADD COLUMN manifest TEXT;
ALTER TABLE dispatch_bodies ADD COLUMN policy TEXT;
UPDATE dispatch_bodies SET
    manifest = (SELECT d.manifest FROM dispatches d WHERE d.operation_id = dispatch_bodies.operation_id),
    policy = (SELECT d.policy FROM dispatches d WHERE d.operation_id = dispatch_bodies.operation_id);
ALTER TABLE dispatches DROP COLUMN manifest;
ALTER TABLE dispatches DROP COLUMN policy;
