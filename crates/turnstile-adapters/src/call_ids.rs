//! Call-id rules of the target APIs and the deterministic mapping for ids that break them.
//!
//! We keep our own call ids in the conversation and the ledger. Where a target API's id rule
//! rejects one, the adapter sends `tc_` + the first 32 hex digits of SHA-256 of our id
//! instead, on the call *and* on its result (so they still pair), and records the pair in the
//! render policy (`call_ids`), which the manifest pins by `policy_digest`. The mapping is a
//! pure function of the id, so cached fragments stay valid and a history renders to the same
//! bytes every time. A mapped id that collides with another id of the conversation pauses.
//!
//! Rules (quoted in `shared/reference/provider-rules.md` §0.5 with their sources):
//! - Anthropic: `^[a-zA-Z0-9_-]+$` ("String should match pattern", tailcallhq/forgecode#1142).
//! - OpenAI Chat: at most 40 characters (`string_above_max_length`, agno-agi/agno#5382).
//! - OpenAI Responses: `call_id` 1–64 characters (`FunctionCallOutputItemParam`, spec l.70109).
//! - Gemini: ids are optional and are not sent; calls and responses pair by position.

use std::borrow::Cow;
use turnstile_core::Digest;

/// A target API's call-id rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CallIdRule {
    /// Any id of at most this many characters.
    LengthMax(usize),
    /// `^[a-zA-Z0-9_-]+$`.
    AsciiWordOrDash,
}

impl CallIdRule {
    /// Whether the API accepts `id` as is.
    pub fn accepts(self, id: &str) -> bool {
        match self {
            CallIdRule::LengthMax(max) => !id.is_empty() && id.chars().count() <= max,
            CallIdRule::AsciiWordOrDash => {
                !id.is_empty()
                    && id
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            }
        }
    }
}

/// The id to send for our `id` under `rule`: unchanged when accepted, else `tc_<32 hex>`.
pub fn map(id: &str, rule: CallIdRule) -> Cow<'_, str> {
    if rule.accepts(id) {
        return Cow::Borrowed(id);
    }
    let digest = Digest::of_bytes(id.as_bytes());
    // `sha256:` + 64 hex digits; take 32 of them (128 bits).
    let hex = &digest.as_str()["sha256:".len().."sha256:".len() + 32];
    Cow::Owned(format!("tc_{hex}"))
}
