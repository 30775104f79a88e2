-- Version 12 (SQLite): each committed turn's digest beside it (issue 49 item 7;
-- docs/decisions/0133-stored-turns-carry-their-digest-a-dispatch-checks-it-as.md, "Stored turns
-- carry their digest"). `Turn::digest` of the turn as decoded when it was checked before the write;
-- a dispatch decodes the stored turn and compares, so a changed byte is refused, never sent. Rows
-- written before this version have none (NULL) and are not checked.
ALTER TABLE turns ADD COLUMN digest TEXT;
