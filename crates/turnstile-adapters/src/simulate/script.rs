//! Scripted replies and their faults, exactly as `POST /sim/script` takes them
//! (`shared/spec/gateway-api.md`, "Provider simulator").

use serde::Deserialize;
use serde_json::Value;

/// Body of `POST /sim/script`.
#[derive(Debug, Deserialize)]
pub struct Script {
    /// Replies are queued for requests naming this model.
    pub model: String,
    /// Consumed in order.
    pub replies: Vec<Reply>,
}

/// One scripted reply.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Reply {
    /// Assistant text (may be empty).
    #[serde(default)]
    pub text: String,
    /// Parallel tool calls.
    #[serde(default)]
    pub tool_calls: Vec<ScriptedCall>,
    /// Faults applied to this reply.
    #[serde(default)]
    pub faults: Faults,
}

/// A scripted tool call. `arguments` may be an object (sent as its JSON text) or a string
/// (sent verbatim, so a test can script invalid or cut arguments).
#[derive(Clone, Debug, Deserialize)]
pub struct ScriptedCall {
    /// Call id; generated when absent.
    pub id: Option<String>,
    /// Tool name.
    pub name: String,
    /// Arguments.
    #[serde(default = "empty_object")]
    pub arguments: Value,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

impl ScriptedCall {
    /// The arguments as the JSON text the model "produced".
    pub fn arguments_text(&self) -> String {
        match &self.arguments {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        }
    }
}

/// The fault keys of the spec.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Faults {
    /// Close the connection after this many body bytes.
    pub cut_at_byte: Option<usize>,
    /// Leave out the stop event(s).
    #[serde(default)]
    pub drop_stop: bool,
    /// Send every event twice.
    #[serde(default)]
    pub duplicate_events: bool,
    /// Emit the tool-call blocks in reverse order (their indices/keys unchanged).
    #[serde(default)]
    pub reorder_tool_calls: bool,
    /// Close the connection after this many events.
    pub disconnect_after_events: Option<usize>,
    /// Sleep this long before each event.
    pub delay_ms: Option<u64>,
    /// Sleep this long before the response head, as an upstream that retries internally
    /// (a LiteLLM proxy with its default retries) answers late.
    pub head_delay_ms: Option<u64>,
    /// Answer with this HTTP status (and the provider's error body) instead of a stream.
    pub status: Option<u16>,
    /// The message of that error body (default `simulated error <status>`).
    pub error_message: Option<String>,
    /// The handle can be resumed from the last sequence number (Responses API).
    pub resumable: Option<bool>,
    /// A repeated idempotency key gets the same reply instead of the next scripted one.
    #[serde(default)]
    pub idempotent: bool,
    /// The world's dialects (not faults of the spec: what compatible servers do). Answer with
    /// this response id, as a server that numbers its ids per process does after a restart.
    pub handle: Option<String>,
    /// OpenAI Chat: end the body after the usage chunk, without `data: [DONE]`.
    #[serde(default)]
    pub omit_done: bool,
    /// Report this many output tokens, as a server that counts its own way does.
    pub usage_output_tokens: Option<u64>,
    /// Answer a stream request with the whole JSON body (`application/json`), as a server
    /// that ignores `stream: true` does.
    #[serde(default)]
    pub json_answer: bool,
}

/// The reply for a model with nothing queued.
pub fn default_reply() -> Reply {
    Reply {
        text: "Hello from the Turnstile simulator.".into(),
        ..Reply::default()
    }
}
