//! Request fields that only the client's own API can take (reasoning and thinking settings,
//! service tier, stored completions, prompt-cache keys, log probabilities, safety settings, …),
//! carried byte for byte when the target API is the client's, and refused by name when it is
//! not — never dropped, never translated into another API's field with a different meaning.
//!
//! What this module owns and why:
//! - [`Passthrough`]: the fields, as the client sent them, with the API they belong to. The
//!   importers fill it ([`read`], [`read_gemini_config`]); the render policy records it, so
//!   `policy_digest` pins it.
//! - [`Passthrough::check`]: towards another API every field is refused
//!   ([`PassthroughError::Unsupported`], naming the client's field), except the few in
//!   [`INERT_ACROSS_APIS`] — identifiers for the provider's own bookkeeping (`metadata`, `user`,
//!   `safety_identifier`, Gemini `labels`) that cannot change what the provider generates or
//!   bills. Those are left out towards another API and reported in `x-turnstile-dropped`
//!   ([`Passthrough::dropped_towards`]).
//! - [`Passthrough::write_top`] / [`Passthrough::write_config`]: same API, the fields are written
//!   where the client put them (top level, or Gemini's `generationConfig`), values in RFC 8785
//!   form. Every field listed here is one the renderers never write themselves, so no key is
//!   ever written twice.
//!
//! The lists (field names as each API spells them):
//! - OpenAI Chat: `metadata`, `user`, `safety_identifier`, `service_tier`, `store`,
//!   `prompt_cache_key`, `prompt_cache_retention`, `reasoning_effort`, `verbosity`, `logprobs`,
//!   `top_logprobs`, `logit_bias`, `prediction`.
//! - OpenAI Responses: `metadata`, `user`, `safety_identifier`, `service_tier`, `store`,
//!   `prompt_cache_key`, `prompt_cache_retention`, `reasoning`, `truncation`, `top_logprobs`,
//!   `max_tool_calls`.
//! - Anthropic Messages: `metadata`, `service_tier`, `thinking`, `cache_control` (the request's
//!   automatic cache breakpoint; per-block breakpoints live on their v1 blocks, `cache.rs`).
//! - Gemini: top-level `safetySettings`, `labels`; inside `generationConfig`: `thinkingConfig`,
//!   `responseLogprobs`, `logprobs`, `mediaResolution`.
//! - Fields of one element of the request ([`ElementField`], [`Passthrough::elements`]), kept
//!   with what they belong to, so the renderer writes each back in its place: a tool's
//!   `strict: true` (Chat `tools[].function.strict`, Responses `tools[].strict`; by tool name),
//!   a Chat message's `name` (`messages[].name`; by the id of the turn it opened), an image's
//!   `detail` other than `auto` (Chat `…image_url.detail`, Responses `input[].content[].detail`;
//!   by the image block's id). Towards another API each is refused by that path, like the
//!   top-level fields. Their absent values (`strict` false, `detail` `auto`, no `name`) are what
//!   every renderer writes anyway, so they are not recorded.
//! - OpenAI Responses `include` is kept apart ([`Passthrough::include`]): the renderer always
//!   asks for `reasoning.encrypted_content` (to replay reasoning), and writes the client's other
//!   values after it, each once; towards another API any value but that one is refused.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a client-only field reaches a target of the client's API exactly, and is refused by name
//!   towards another (only identifiers are left out, and reported). Enforced in
//!   `adapters/src/passthrough.rs` (`Passthrough::check`, `write_top`, `write_config`). Tests:
//!   `adapters/tests/it/render_passthrough.rs`,
//!   `proxy.rs::client_only_fields_reach_a_provider_of_the_same_api…`.
//! - a client-only field of one element (tool `strict`, Chat `messages[].name`, image `detail`)
//!   reaches a target of the client's API on its own element, never through a cached fragment into
//!   another request, and is refused by its path towards another API. Enforced in
//!   `adapters/src/passthrough.rs` (`ElementField`, `Passthrough::element`, `check`),
//!   `openai_chat/mod.rs` / `openai_responses/v1/render.rs` (`Ctx::uncached`). Tests:
//!   `adapters/tests/it/render_element_fields.rs`,
//!   `proxy.rs::element_fields_reach_a_provider_of_the_same_api_in_place…`.

use crate::import::{ImportError, Obj};
use crate::registry::Api;
use serde::Serialize;
use serde_json::Value;

/// Top-level fields carried same-API, per API.
const TOP: &[(Api, &[&str])] = &[
    (
        Api::OpenaiChat,
        &[
            "metadata",
            "user",
            "safety_identifier",
            "service_tier",
            "store",
            "prompt_cache_key",
            "prompt_cache_retention",
            "reasoning_effort",
            "verbosity",
            "logprobs",
            "top_logprobs",
            "logit_bias",
            "prediction",
        ],
    ),
    (
        Api::OpenaiResponses,
        &[
            "metadata",
            "user",
            "safety_identifier",
            "service_tier",
            "store",
            "prompt_cache_key",
            "prompt_cache_retention",
            "reasoning",
            "truncation",
            "top_logprobs",
            "max_tool_calls",
        ],
    ),
    (
        Api::AnthropicMessages,
        &["metadata", "service_tier", "thinking", "cache_control"],
    ),
    (Api::Gemini, &["safetySettings", "labels"]),
];

/// Gemini `generationConfig` fields carried same-API.
const GEMINI_CONFIG: &[&str] = &[
    "thinkingConfig",
    "responseLogprobs",
    "logprobs",
    "mediaResolution",
];

/// Fields that identify the caller to the provider's own bookkeeping and cannot change what it
/// generates or bills: left out (and reported) towards another API rather than refused.
pub const INERT_ACROSS_APIS: &[&str] = &["metadata", "user", "safety_identifier", "labels"];

/// The top-level fields `api` carries same-API.
pub fn top_fields(api: Api) -> &'static [&'static str] {
    TOP.iter()
        .find(|(table_api, _)| *table_api == api)
        .map_or(&[], |(_, fields)| fields)
}

/// The `generationConfig` fields Gemini carries same-API.
pub fn gemini_config_fields() -> &'static [&'static str] {
    GEMINI_CONFIG
}

/// Which element field an [`ElementField`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ElementKind {
    /// A tool's `strict: true`, on the tool's name.
    Strict,
    /// A Chat message's `name`, on the id of the turn the message opened.
    Name,
    /// An image's `detail`, on the image block's id.
    Detail,
}

/// A client-only field of one element of the request, with the element it belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ElementField {
    /// Which field.
    pub kind: ElementKind,
    /// The client's field as an index-free path (`tools[].function.strict`): the refusal names
    /// it.
    pub field: String,
    /// The tool name, turn id or block id it belongs to.
    pub on: String,
    /// The value as the client sent it.
    pub value: Value,
}

/// Client-API-only fields of one request. `Default` is "none".
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Passthrough {
    /// The API the fields belong to (None: no field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api: Option<Api>,
    /// Top-level fields, in the order of the API's list below.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<(String, Value)>,
    /// Gemini `generationConfig` fields, in the order of the list.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub config: Vec<(String, Value)>,
    /// OpenAI Responses `include` values other than the one the renderer always writes
    /// ([`RESPONSES_INCLUDE_ALWAYS`]), in the client's order, without repeats.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub include: Vec<String>,
    /// Fields of single elements (tools, messages, images), in the order the client sent them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub elements: Vec<ElementField>,
}

/// The `include` value the Responses renderer always writes.
pub const RESPONSES_INCLUDE_ALWAYS: &str = "reasoning.encrypted_content";

/// Why a target API cannot take a request's client-only fields. Tests assert
/// [`PassthroughError::code`] and [`PassthroughError::field`], never the message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PassthroughError {
    /// The field belongs to the client's API and the target speaks another. Code
    /// `unsupported_setting`.
    #[error("{field} is a field of {from} that {to} does not take", from = from.as_str(), to = to.as_str())]
    Unsupported {
        /// The client's field (`generationConfig.thinkingConfig` for a config field).
        field: String,
        /// The client's API.
        from: Api,
        /// The target API.
        to: Api,
    },
}

impl PassthroughError {
    /// The machine-readable code: `unsupported_setting`.
    pub fn code(&self) -> &'static str {
        "unsupported_setting"
    }

    /// The client's field.
    pub fn field(&self) -> &str {
        match self {
            PassthroughError::Unsupported { field, .. } => field,
        }
    }
}

impl Passthrough {
    /// Whether there is no field.
    pub fn is_unset(&self) -> bool {
        self.fields.is_empty()
            && self.config.is_empty()
            && self.include.is_empty()
            && self.elements.is_empty()
    }

    /// The value of the element field `kind` on `on`, when `target` is the client's API.
    pub fn element(&self, target: Api, kind: ElementKind, on: &str) -> Option<&Value> {
        if self.api != Some(target) {
            return None;
        }
        self.elements
            .iter()
            .find(|element| element.kind == kind && element.on == on)
            .map(|element| &element.value)
    }

    /// Whether any element field `kind` goes to `target`.
    pub fn has_elements(&self, target: Api, kind: ElementKind) -> bool {
        self.api == Some(target) && self.elements.iter().any(|element| element.kind == kind)
    }

    /// Take the element fields the importer of `api` collected.
    pub(crate) fn take_elements(&mut self, api: Api, elements: Vec<ElementField>) {
        if !elements.is_empty() {
            self.api = Some(api);
            self.elements = elements;
        }
    }

    fn crosses(&self, target: Api) -> bool {
        self.api.is_some_and(|api| api != target)
    }

    /// Every field goes to the client's own API; towards another, only the inert ones may be
    /// left out, and the first other field is the error.
    pub fn check(&self, target: Api) -> Result<(), PassthroughError> {
        let Some(from) = self.api.filter(|_| self.crosses(target)) else {
            return Ok(());
        };
        let refused = self
            .fields
            .iter()
            .map(|(name, _)| (name.clone(), name.as_str()))
            .chain(
                self.config
                    .iter()
                    .map(|(name, _)| (format!("generationConfig.{name}"), "")),
            )
            .chain((!self.include.is_empty()).then(|| ("include".to_owned(), "")))
            .chain(self.elements.iter().map(|element| (element.field.clone(), "")))
            .find(|(_, name)| !INERT_ACROSS_APIS.contains(name));
        match refused {
            Some((field, _)) => Err(PassthroughError::Unsupported {
                field,
                from,
                to: target,
            }),
            None => Ok(()),
        }
    }

    /// The fields left out towards `target` (the inert ones, when it is another API), for the
    /// client's `x-turnstile-dropped`.
    pub fn dropped_towards(&self, target: Api) -> Vec<String> {
        if !self.crosses(target) {
            return Vec::new();
        }
        self.fields.iter().map(|(name, _)| name.clone()).collect()
    }

    fn write(fields: &[(String, Value)], out: &mut Vec<u8>) -> String {
        let start = out.len();
        for (name, value) in fields {
            out.push(b',');
            crate::render::push_json_string(out, name);
            out.push(b':');
            out.extend_from_slice(&turnstile_core::digest::canonical_bytes(value));
        }
        String::from_utf8_lossy(&out[start..]).into_owned()
    }

    /// Append the top-level fields when `target` is the client's API; the text written.
    pub(crate) fn write_top(&self, target: Api, out: &mut Vec<u8>) -> String {
        if self.api != Some(target) {
            return String::new();
        }
        Passthrough::write(&self.fields, out)
    }

    /// Append Gemini's `generationConfig` fields when `target` is the client's API.
    pub(crate) fn write_config(&self, target: Api, out: &mut Vec<u8>) -> String {
        if self.api != Some(target) {
            return String::new();
        }
        Passthrough::write(&self.config, out)
    }
}

/// Take `api`'s top-level client-only fields out of the body being imported (a field whose
/// value carries nothing — `null` — is not one).
pub(crate) fn read(api: Api, top: &mut Obj, passthrough: &mut Passthrough) -> Result<(), ImportError> {
    for name in top_fields(api) {
        if let Some(value) = top.take(name) {
            passthrough.api = Some(api);
            passthrough.fields.push(((*name).to_owned(), value));
        }
    }
    Ok(())
}

/// Take OpenAI Responses' `include` out of the body being imported.
pub(crate) fn read_responses_include(
    top: &mut Obj,
    passthrough: &mut Passthrough,
) -> Result<(), ImportError> {
    for value in top.strings("include", false)? {
        if value != RESPONSES_INCLUDE_ALWAYS && !passthrough.include.contains(&value) {
            passthrough.api = Some(Api::OpenaiResponses);
            passthrough.include.push(value);
        }
    }
    Ok(())
}

/// The `include` list a Responses request is rendered with: the value the renderer needs, then
/// the client's others (same API only).
pub(crate) fn responses_include(passthrough: &Passthrough) -> Vec<&str> {
    let mut include = vec![RESPONSES_INCLUDE_ALWAYS];
    if passthrough.api == Some(Api::OpenaiResponses) {
        include.extend(passthrough.include.iter().map(String::as_str));
    }
    include
}

/// Take Gemini's client-only `generationConfig` fields out of the config being imported.
pub(crate) fn read_gemini_config(config: &mut Obj, passthrough: &mut Passthrough) {
    for name in GEMINI_CONFIG {
        if let Some(value) = config.take(name) {
            passthrough.api = Some(Api::Gemini);
            passthrough.config.push(((*name).to_owned(), value));
        }
    }
}
