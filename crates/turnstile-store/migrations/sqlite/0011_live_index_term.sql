-- Version 11 (SQLite): the live-attempts index's term as equalities (issue 21;
-- docs/decisions/0106-the-live-attempts-index-is-kept-without-a-temporary.md, "The live-attempts
-- index is kept without a temporary table"). SQLite checks a partial index's term on every insert
-- into the table and on every update of a row, the old row and the new. It codes `state IN (four
-- constants)` with a temporary B-tree built for the statement (`OpenEphemeral`; two constants or
-- fewer it codes as comparisons), so inserting an attempt built one and moving one built two. The
-- same set written as equalities joined by OR is coded as comparisons. The sweeps repeat the term
-- word for word (`ops::LIVE_ATTEMPTS`), so the planner still reads the index.
DROP INDEX attempts_live;
CREATE INDEX attempts_live ON attempts (state)
    WHERE state = 'DISPATCHING' OR state = 'SENT' OR state = 'STREAMING' OR state = 'UNKNOWN';
