-- Proxy continuation finds the conversation that committed a call by its call id.
CREATE INDEX tool_calls_by_call_id ON tool_calls (call_id);
