-- The provider's stop reason and usage of a committed dispatch, so a client attaching later
-- (same operation id or Idempotency-Key) is answered with them too.
ALTER TABLE dispatches ADD COLUMN outcome TEXT;
