-- Version 12 (PostgreSQL): each committed turn's digest beside it, as in the SQLite script
-- (issue 49 item 7). NULL for rows written before this version: those are not checked.
ALTER TABLE turns ADD COLUMN digest TEXT;
