//! The adapter registry: which adapter versions exist, what each can represent, and the
//! `adapter_digest` that pins its rendering rules.
//!
//! An adapter id is `<api>@<version>` (`shared/spec/conversation-v1.md` §3). Each version
//! declares its rules in a [`RulesDescriptor`]; `adapter_digest` is SHA-256 over the RFC 8785
//! form of that descriptor *plus the bytes the adapter renders for a fixed set of probe
//! conversations* ([`crate::probe`]). So the digest changes whenever a declared rule changes
//! and also whenever the rendering code changes its output for any probed feature, even if
//! nobody remembered to bump [`RulesDescriptor::rules_revision`]. `tests/it/registry.rs` pins
//! the digests, so such a change is always a visible, reviewed snapshot update.

use serde::Serialize;
use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;
use turnstile_core::Digest;

/// A provider API family (one module tree per family).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Api {
    /// OpenAI Chat Completions, `POST /v1/chat/completions`.
    OpenaiChat,
    /// OpenAI Responses, `POST /v1/responses`.
    OpenaiResponses,
    /// Anthropic Messages, `POST /v1/messages`.
    AnthropicMessages,
    /// Google Gemini `generateContent` (streaming endpoint).
    Gemini,
}

/// Headers of a plain JSON request.
pub(crate) const JSON_HEADERS: &[(&str, &str)] = &[("content-type", "application/json")];
/// Headers of an Anthropic Messages request (the API version is pinned by the adapter).
pub(crate) const ANTHROPIC_HEADERS: &[(&str, &str)] = &[
    ("content-type", "application/json"),
    ("anthropic-version", "2023-06-01"),
];

/// Percent-encode a model name for use as one path segment (RFC 3986 unreserved kept).
fn path_segment(model: &str) -> String {
    let mut out = String::with_capacity(model.len());
    for byte in model.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

impl Api {
    /// The id prefix (`openai-chat`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Api::OpenaiChat => "openai-chat",
            Api::OpenaiResponses => "openai-responses",
            Api::AnthropicMessages => "anthropic-messages",
            Api::Gemini => "gemini",
        }
    }

    /// Path and query of a request to this API (the model is part of the path for Gemini
    /// only). The one place these live: renderers and the gateway's transport both use it.
    pub fn request_path(self, model: &str, stream: bool) -> String {
        match self {
            Api::OpenaiChat => "/v1/chat/completions".to_owned(),
            Api::OpenaiResponses => "/v1/responses".to_owned(),
            Api::AnthropicMessages => "/v1/messages".to_owned(),
            Api::Gemini => {
                let method = if stream {
                    ":streamGenerateContent?alt=sse"
                } else {
                    ":generateContent"
                };
                format!("/v1beta/models/{}{method}", path_segment(model))
            }
        }
    }

    /// The non-secret headers every request to this API carries (credentials are added by the
    /// transport at send time and never appear here).
    pub fn request_headers(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Api::AnthropicMessages => ANTHROPIC_HEADERS,
            Api::OpenaiChat | Api::OpenaiResponses | Api::Gemini => JSON_HEADERS,
        }
    }

    /// The provider whose opaque data (reasoning signatures, encrypted content) this API
    /// accepts back. Matches the `provider` field of v1 `reasoning` blocks.
    pub fn provider(self) -> &'static str {
        match self {
            Api::OpenaiChat | Api::OpenaiResponses => "openai",
            Api::AnthropicMessages => "anthropic",
            Api::Gemini => "gemini",
        }
    }
}

/// One adapter version. The set is closed: adding a version is a code change with its own
/// descriptor, golden snapshots and pinned digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum AdapterId {
    /// `openai-chat@1`: `system` role, `max_tokens`, no documents.
    OpenaiChatV1,
    /// `openai-chat@2`: `developer` role, `max_completion_tokens`, documents as file parts.
    OpenaiChatV2,
    /// `openai-responses@1`.
    OpenaiResponsesV1,
    /// `anthropic-messages@1`: no documents.
    AnthropicMessagesV1,
    /// `anthropic-messages@2`: `document` blocks.
    AnthropicMessagesV2,
    /// `gemini@1`.
    GeminiV1,
}

/// An adapter id that is not in the registry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UnknownAdapter {
    /// The text is not `<api>@<version>` of a registered adapter.
    #[error(
        "unknown adapter {0:?}; known: openai-chat@1, openai-chat@2, openai-responses@1, anthropic-messages@1, anthropic-messages@2, gemini@1"
    )]
    Unknown(String),
}

impl AdapterId {
    /// Every registered adapter, in a stable order.
    pub const ALL: [AdapterId; 6] = [
        AdapterId::OpenaiChatV1,
        AdapterId::OpenaiChatV2,
        AdapterId::OpenaiResponsesV1,
        AdapterId::AnthropicMessagesV1,
        AdapterId::AnthropicMessagesV2,
        AdapterId::GeminiV1,
    ];

    /// The API family.
    pub fn api(self) -> Api {
        match self {
            AdapterId::OpenaiChatV1 | AdapterId::OpenaiChatV2 => Api::OpenaiChat,
            AdapterId::OpenaiResponsesV1 => Api::OpenaiResponses,
            AdapterId::AnthropicMessagesV1 | AdapterId::AnthropicMessagesV2 => Api::AnthropicMessages,
            AdapterId::GeminiV1 => Api::Gemini,
        }
    }

    /// The version number within the family.
    pub fn version(self) -> u32 {
        match self {
            AdapterId::OpenaiChatV2 | AdapterId::AnthropicMessagesV2 => 2,
            _ => 1,
        }
    }

    /// The id string, e.g. `anthropic-messages@1`.
    pub fn as_str(self) -> &'static str {
        match self {
            AdapterId::OpenaiChatV1 => "openai-chat@1",
            AdapterId::OpenaiChatV2 => "openai-chat@2",
            AdapterId::OpenaiResponsesV1 => "openai-responses@1",
            AdapterId::AnthropicMessagesV1 => "anthropic-messages@1",
            AdapterId::AnthropicMessagesV2 => "anthropic-messages@2",
            AdapterId::GeminiV1 => "gemini@1",
        }
    }

    /// The default provider name for manifests.
    pub fn provider(self) -> &'static str {
        self.api().provider()
    }

    /// The declared rendering rules of this version.
    pub fn rules(self) -> &'static RulesDescriptor {
        match self {
            AdapterId::OpenaiChatV1 => &crate::openai_chat::v1::render::RULES,
            AdapterId::OpenaiChatV2 => &crate::openai_chat::v2::render::RULES,
            AdapterId::OpenaiResponsesV1 => &crate::openai_responses::v1::render::RULES,
            AdapterId::AnthropicMessagesV1 => &crate::anthropic_messages::v1::render::RULES,
            AdapterId::AnthropicMessagesV2 => &crate::anthropic_messages::v2::render::RULES,
            AdapterId::GeminiV1 => &crate::gemini::v1::render::RULES,
        }
    }

    /// Whether this version can represent a v1 block kind.
    pub fn represents(self, kind: &str) -> bool {
        self.rules().representable_kinds.contains(&kind)
    }

    /// The adapter digest: SHA-256 over the canonical rules descriptor and the renderings of
    /// the probe conversations. Computed once per process and shared.
    pub fn adapter_digest(self) -> &'static Digest {
        static DIGESTS: OnceLock<Vec<Digest>> = OnceLock::new();
        let digests = DIGESTS.get_or_init(|| {
            AdapterId::ALL
                .iter()
                .map(|id| crate::probe::digest(*id))
                .collect()
        });
        // Invariant: `ALL` lists every variant, so the position always exists.
        let index = AdapterId::ALL
            .iter()
            .position(|id| *id == self)
            .expect("AdapterId::ALL lists every adapter");
        &digests[index]
    }
}

impl fmt::Display for AdapterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AdapterId {
    type Err = UnknownAdapter;

    fn from_str(text: &str) -> Result<AdapterId, UnknownAdapter> {
        AdapterId::ALL
            .into_iter()
            .find(|id| id.as_str() == text)
            .ok_or_else(|| UnknownAdapter::Unknown(text.to_owned()))
    }
}

impl Serialize for AdapterId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// The declared rendering rules of one adapter version. Every field is part of
/// `adapter_digest`; a change to any of them is a change of rules.
#[derive(Debug, Serialize)]
pub struct RulesDescriptor {
    /// Adapter id.
    pub adapter: &'static str,
    /// Bumped by hand whenever the rendering code changes in a way the probes might miss.
    pub rules_revision: u32,
    /// HTTP method and path template (`{model}` is substituted).
    pub endpoint: &'static str,
    /// v1 block kinds this version can represent; any other kind pauses.
    pub representable_kinds: &'static [&'static str],
    /// Parts inside a representable kind that still cannot be represented (they pause too),
    /// e.g. `tool_result.image` where the API's tool messages take text only.
    pub unrepresentable_parts: &'static [&'static str],
    /// Where system turns go.
    pub system_placement: &'static str,
    /// The request field that carries `max_output_tokens`.
    pub max_output_tokens_field: &'static str,
    /// How tool results are placed.
    pub result_placement: &'static str,
    /// Call-id constraint of the API (ids that break it are mapped, see `call_ids.rs`).
    pub call_id_rule: &'static str,
    /// What happens to provider-affine reasoning.
    pub reasoning: &'static str,
    /// How `context` blocks are wrapped.
    pub context_wrapping: &'static str,
    /// Non-secret headers sent with the body.
    pub headers: &'static [(&'static str, &'static str)],
}
