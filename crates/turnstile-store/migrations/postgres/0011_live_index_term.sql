-- Version 11 (PostgreSQL): the live-attempts index's term as equalities joined by OR, the
-- same set as version 10's `IN` list. On SQLite the `IN` form cost a temporary B-tree per
-- insert and two per update of an attempt (see the SQLite script); here it is only so that
-- both databases keep one term, which the sweeps repeat word for word (`ops::LIVE_ATTEMPTS`).
DROP INDEX attempts_live;
CREATE INDEX attempts_live ON attempts (state)
    WHERE state = 'DISPATCHING' OR state = 'SENT' OR state = 'STREAMING' OR state = 'UNKNOWN';
