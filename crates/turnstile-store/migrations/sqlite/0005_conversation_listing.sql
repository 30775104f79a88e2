-- The console's conversation listing (most recently updated first, keyset-paged) reads one
-- index range from the cursor instead of sorting every conversation.
CREATE INDEX conversations_by_update ON conversations (updated_at DESC, conversation_id DESC);
