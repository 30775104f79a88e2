//! Importers: a provider request body → a `turnstile.conversation.v1` document, the inverse of
//! the renderers. The gateway's drop-in proxy (OpenAI-, Anthropic- and Gemini-compatible
//! endpoints) and its shadow mode use them; clients are stateless, so every request carries the
//! whole history and imports to the whole document.
//!
//! What this module owns and why:
//! - [`import`]: bounded parsing (the core's `parse::json_from_slice`, so body size and JSON
//!   depth are checked before serde builds anything), then one importer per API
//!   (`<api>/import.rs`, one per API rather than per version: a request body does not say
//!   which adapter version produced it, so each importer accepts the union of its versions,
//!   e.g. both `system` and `developer`, `max_tokens` and `max_completion_tokens`).
//! - The document builder shared by the importers: turn ids `t-1`…, block ids `t-1-b-1`…,
//!   revisions 1..n, `generation: 1` on assistant turns, and result envelopes whose `tool`,
//!   `args_digest` and `generation` are copied from the matched call earlier in the imported
//!   history. The same bytes always import to the same document.
//! - [`semantic_diff`]: the comparison shadow mode reports, and the round-trip tests use.
//!
//! Two kinds of problem, kept apart on purpose:
//! - A request the provider would take but v1 cannot hold (audio, `n > 1`, server-side state
//!   or tools, unknown part types, …) is an [`ImportError`]: the gateway answers 400.
//! - A history v1 can hold but the validator rejects (an orphan, duplicate or missing result, a
//!   mid-conversation system message, unclosed arguments, a block in the wrong role) is
//!   imported as it is, so the validator reports it with its spec code. The importer never
//!   moves, merges, drops or invents a turn or block to make a history legal.
//!
//! Generation settings (temperature, top-p, top-k, stop sequences, seed, penalties) are read
//! into [`Imported::sampling`] in neutral names and checked against the ranges the client's own
//! API documents (`sampling.rs`): a value that API would refuse is `invalid_request` here too.
//! Tool choice and parallel tool calls are read into [`Imported::tool_choice`] (`tool_choice.rs`).
//! Anthropic per-block `cache_control` becomes the v1 `cache` breakpoint of its block or tool
//! (`cache.rs`). Request fields neither the graph nor the settings carry are listed in
//! [`Imported::dropped`], never silently lost; a field whose value carries nothing (`null`,
//! `[]`, `{}`) is not listed.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - import is the inverse of render (same meaning), for every adapter. Enforced in
//!   `adapters/src/<api>/import.rs`. Tests: `adapters/tests/it/import_props.rs` (round trip over
//!   random legal conversations), `fuzz/fuzz_targets/import.rs`.

use crate::registry::Api;
use crate::sampling::{Sampling, SamplingError};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use turnstile_core::conversation::{Arguments, MediaSource, Role, Trust};
use turnstile_core::limits;

/// A provider request imported as a v1 document, with the request parameters the gateway needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Imported {
    /// A complete `turnstile.conversation.v1` document: `format`, `conversation_id` (the one
    /// passed in), `revision` = number of turns, `tools` = `[{name, description?,
    /// input_schema}]`, turns `t-1`… with revisions 1..n. Not validated here: the gateway runs
    /// the validator, which reports illegal history with its spec code.
    pub document: Value,
    /// The model: from the body, or for Gemini from [`GeminiCall`] (it is in the URL path).
    pub model: String,
    /// Whether the client asked for a stream (Gemini: from [`GeminiCall`]).
    pub stream: bool,
    /// `max_tokens` / `max_completion_tokens` / `max_output_tokens` /
    /// `generationConfig.maxOutputTokens`, when given.
    pub max_output_tokens: Option<u64>,
    /// Tool definitions are present, or any tool_call / tool_result block.
    pub has_tools: bool,
    /// The generation settings the client asked for, in neutral names, within the ranges its
    /// API documents (the target adapter's API checks them again when it renders).
    pub sampling: Sampling,
    /// The tool choice and parallel switch the client asked for, in neutral names
    /// (`tool_choice.rs`); the target adapter's API checks them when it renders.
    pub tool_choice: crate::tool_choice::ToolChoice,
    /// The structured output the client asked for (`output_format.rs`).
    pub output_format: crate::output_format::OutputFormat,
    /// Fields only the client's API takes (`passthrough.rs`), as given.
    pub passthrough: crate::passthrough::Passthrough,
    /// Request fields neither the graph nor [`Imported::sampling`] carries, as index-free paths
    /// (`tool_choice`, `messages[].name`, `system[].cache_control`, …): sorted, deduplicated.
    pub dropped: Vec<String>,
}

/// What a Gemini request does not carry in its body: the model and the method are in the URL
/// path (`/v1beta/models/{model}:streamGenerateContent`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GeminiCall {
    /// The model from the path.
    pub model: String,
    /// Whether the path was `:streamGenerateContent`.
    pub stream: bool,
}

/// Why a request body cannot be imported. Tests assert [`ImportError::code`] and
/// [`ImportError::path`], never the message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// The body is not JSON, not an object, or a field is missing, has the wrong type, or (a
    /// generation setting) lies outside the range the provider's own schema documents. Code
    /// `invalid_request`.
    #[error("malformed request at {path:?}: {message}")]
    Malformed {
        /// Where, like `messages[3].content[0].type` (empty for the whole body).
        path: String,
        /// What is wrong.
        message: String,
    },
    /// Valid for the provider but not representable in v1 (audio, `n > 1`,
    /// `previous_response_id`, server-side tools, unknown content part types, …). Code
    /// `unrepresentable`.
    #[error("not representable in turnstile.conversation.v1 at {path:?}: {what}")]
    Unrepresentable {
        /// Where, like `input[2].type`.
        path: String,
        /// What cannot be represented.
        what: String,
    },
    /// Anthropic's `thread` (server-side message threads, sent by the SDK's tool runner): the
    /// gateway keeps no thread state. Code `thread_unsupported_request`, the code Anthropic's
    /// clients read (in `error.details.error_code`) to resend the turn with the whole history.
    #[error("message threads are not supported; resend the whole history without `thread`")]
    ThreadUnsupported {
        /// Where (`thread`).
        path: String,
    },
    /// A named limit of `turnstile_core::limits` was exceeded (body bytes, JSON depth, turns,
    /// blocks, tools). Code `limit_exceeded`.
    #[error("limit exceeded at {path:?}: {what} is {actual}, the maximum is {max}")]
    Limit {
        /// Where (empty for the whole body).
        path: String,
        /// The limit's constant name, e.g. `JSON_DEPTH_MAX`.
        what: &'static str,
        /// What the input had (or a lower bound of it).
        actual: usize,
        /// The limit.
        max: usize,
    },
}

impl ImportError {
    /// The machine-readable code: `invalid_request`, `unrepresentable` or `limit_exceeded`.
    pub fn code(&self) -> &'static str {
        match self {
            ImportError::Malformed { .. } => "invalid_request",
            ImportError::Unrepresentable { .. } => "unrepresentable",
            ImportError::Limit { .. } => "limit_exceeded",
            ImportError::ThreadUnsupported { .. } => "thread_unsupported_request",
        }
    }

    /// Where in the body (empty for the whole body).
    pub fn path(&self) -> &str {
        match self {
            ImportError::Malformed { path, .. }
            | ImportError::Unrepresentable { path, .. }
            | ImportError::Limit { path, .. }
            | ImportError::ThreadUnsupported { path } => path,
        }
    }

    pub(crate) fn malformed(path: impl Into<String>, message: impl Into<String>) -> ImportError {
        ImportError::Malformed {
            path: path.into(),
            message: message.into(),
        }
    }

    pub(crate) fn unrepresentable(path: impl Into<String>, what: impl Into<String>) -> ImportError {
        ImportError::Unrepresentable {
            path: path.into(),
            what: what.into(),
        }
    }
}

/// Import one request body of `api` as a v1 document with id `conversation_id`. `gemini`
/// carries the model and method from the URL path and is required for [`Api::Gemini`] (ignored
/// otherwise). Never panics; see the module docs for what is an error and what is left to the
/// validator.
pub fn import(
    api: Api,
    body: &[u8],
    conversation_id: &str,
    gemini: Option<GeminiCall>,
) -> Result<Imported, ImportError> {
    import_value(api, parse_body(body)?, conversation_id, gemini)
}

/// A request body as JSON, the input limits (size, depth) checked before parsing: the first
/// half of [`import`], for a caller that reads a field of the body itself (the proxy routes by
/// `model`) and should not parse it twice.
pub fn parse_body(body: &[u8]) -> Result<Value, ImportError> {
    turnstile_core::parse::json_from_slice(body).map_err(|error| match error {
        turnstile_core::conversation::Unreadable::Limit { what, actual, max } => ImportError::Limit {
            path: String::new(),
            what,
            actual,
            max,
        },
        other => ImportError::malformed("", other.to_string()),
    })
}

/// [`import`] of a body [`parse_body`] already parsed.
pub fn import_value(
    api: Api,
    value: Value,
    conversation_id: &str,
    gemini: Option<GeminiCall>,
) -> Result<Imported, ImportError> {
    let top = Obj::new(value, String::new(), String::new())?;
    let mut builder = Builder::default();
    let head = match api {
        Api::OpenaiChat => crate::openai_chat::import::import(top, &mut builder)?,
        Api::OpenaiResponses => crate::openai_responses::import::import(top, &mut builder)?,
        Api::AnthropicMessages => crate::anthropic_messages::import::import(top, &mut builder)?,
        Api::Gemini => {
            let call = gemini.ok_or_else(|| {
                ImportError::malformed(
                    "model",
                    "a Gemini request carries its model in the URL path: the caller passes it",
                )
            })?;
            crate::gemini::import::import(top, call, &mut builder)?
        }
    };
    check_sampling(api, &head.sampling)?;
    Ok(builder.finish(conversation_id, head))
}

/// The request parameters an importer reads besides the conversation.
pub(crate) struct Head {
    pub model: String,
    pub stream: bool,
    pub max_output_tokens: Option<u64>,
    pub sampling: Sampling,
    pub tool_choice: crate::tool_choice::ToolChoice,
    pub output_format: crate::output_format::OutputFormat,
    pub passthrough: crate::passthrough::Passthrough,
}

/// A setting outside the range the client's own API documents is malformed for that API (the
/// provider would answer 400 too), at the path of the API's own field.
fn check_sampling(api: Api, sampling: &Sampling) -> Result<(), ImportError> {
    let Err(error) = sampling.check(api) else {
        return Ok(());
    };
    let setting = error.setting();
    let field = crate::sampling::field_name(api, setting).unwrap_or(setting.as_str());
    let path = match api {
        Api::Gemini => format!("generationConfig.{field}"),
        _ => field.to_owned(),
    };
    let message = match error {
        SamplingError::OutOfRange { value, min, max, .. } => {
            format!("{value} is outside the documented range {min} to {max}")
        }
        SamplingError::TooMany { count, max, .. } => {
            format!("{count} stop sequences; at most {max} are allowed")
        }
        other => other.to_string(),
    };
    Err(ImportError::malformed(path, message))
}

// ---------------------------------------------------------------------------------------------
// Reading the body: a JSON object with its path, consumed field by field.

/// A JSON object of the body being consumed. Fields are taken out as they are read; whatever is
/// left at [`Obj::finish`] is reported as dropped. `path` has indices (for errors), `pattern`
/// has none (for the dropped list).
pub(crate) struct Obj {
    map: Map<String, Value>,
    path: String,
    pattern: String,
}

fn join(base: &str, key: &str) -> String {
    if base.is_empty() {
        key.to_owned()
    } else {
        format!("{base}.{key}")
    }
}

pub(crate) fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl Obj {
    /// The object at `path`, or `Malformed` when the value is not an object.
    pub fn new(value: Value, path: String, pattern: String) -> Result<Obj, ImportError> {
        match value {
            Value::Object(map) => Ok(Obj { map, path, pattern }),
            other => Err(ImportError::malformed(
                path,
                format!("expected an object, found {}", type_name(&other)),
            )),
        }
    }

    /// The path of a field of this object.
    pub fn path_of(&self, key: &str) -> String {
        join(&self.path, key)
    }

    /// The path of this object.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The index-free path of a field of this object.
    pub fn pattern_of(&self, key: &str) -> String {
        join(&self.pattern, key)
    }

    /// Whether a field is present and not null.
    pub fn has(&self, key: &str) -> bool {
        matches!(self.map.get(key), Some(value) if !value.is_null())
    }

    /// The names of the fields left, in order.
    pub fn keys(&self) -> Vec<String> {
        self.map.keys().cloned().collect()
    }

    /// Take a field; `null` reads as absent.
    pub fn take(&mut self, key: &str) -> Option<Value> {
        match self.map.remove(key) {
            None | Some(Value::Null) => None,
            value => value,
        }
    }

    /// Take a field that must be present.
    pub fn required(&mut self, key: &str) -> Result<Value, ImportError> {
        self.take(key)
            .ok_or_else(|| ImportError::malformed(self.path_of(key), "required field is missing"))
    }

    fn wrong(&self, key: &str, expected: &str, found: &Value) -> ImportError {
        ImportError::malformed(
            self.path_of(key),
            format!("expected {expected}, found {}", type_name(found)),
        )
    }

    /// An optional string field.
    pub fn string(&mut self, key: &str) -> Result<Option<String>, ImportError> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::String(text)) => Ok(Some(text)),
            Some(other) => Err(self.wrong(key, "a string", &other)),
        }
    }

    /// A required string field.
    pub fn required_string(&mut self, key: &str) -> Result<String, ImportError> {
        match self.required(key)? {
            Value::String(text) => Ok(text),
            other => Err(self.wrong(key, "a string", &other)),
        }
    }

    /// An optional boolean field.
    pub fn bool(&mut self, key: &str) -> Result<Option<bool>, ImportError> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::Bool(flag)) => Ok(Some(flag)),
            Some(other) => Err(self.wrong(key, "a boolean", &other)),
        }
    }

    /// An optional non-negative integer field.
    pub fn u64(&mut self, key: &str) -> Result<Option<u64>, ImportError> {
        match self.take(key) {
            None => Ok(None),
            Some(value) => match value.as_u64() {
                Some(number) => Ok(Some(number)),
                None => Err(self.wrong(key, "a non-negative integer", &value)),
            },
        }
    }

    /// An optional number field.
    pub fn f64(&mut self, key: &str) -> Result<Option<f64>, ImportError> {
        match self.take(key) {
            None => Ok(None),
            Some(value) => match value.as_f64() {
                Some(number) => Ok(Some(number)),
                None => Err(self.wrong(key, "a number", &value)),
            },
        }
    }

    /// An optional integer field (within i64). With `integral_floats`, a float without a
    /// fractional part (`40.0`) is accepted as that integer, as protobuf's JSON parser does for
    /// Gemini's integer fields (and as Google's own SDKs send `top_k`).
    pub fn i64(&mut self, key: &str, integral_floats: bool) -> Result<Option<i64>, ImportError> {
        let Some(value) = self.take(key) else {
            return Ok(None);
        };
        if let Some(number) = value.as_i64() {
            return Ok(Some(number));
        }
        match value.as_f64() {
            // The range check keeps the cast exact: every integral double in it is an i64.
            Some(number)
                if integral_floats
                    && value.is_f64()
                    && number.fract() == 0.0
                    && (i64::MIN as f64..i64::MAX as f64).contains(&number) =>
            {
                Ok(Some(number as i64))
            }
            _ => Err(self.wrong(key, "an integer", &value)),
        }
    }

    /// An optional non-negative integer field (see [`Obj::i64`] for `integral_floats`).
    pub fn count(&mut self, key: &str, integral_floats: bool) -> Result<Option<u64>, ImportError> {
        if let Some(Value::Number(number)) = self.map.get(key)
            && number.as_u64().is_some()
        {
            return self.u64(key);
        }
        match self.i64(key, integral_floats)? {
            None => Ok(None),
            Some(number) => u64::try_from(number)
                .map(Some)
                .map_err(|_| ImportError::malformed(self.path_of(key), "expected a non-negative integer")),
        }
    }

    /// An optional list of strings; with `single`, one string is a list of one (OpenAI Chat's
    /// `stop`). Absent, `null` and `[]` are the empty list.
    pub fn strings(&mut self, key: &str, single: bool) -> Result<Vec<String>, ImportError> {
        let items = match self.take(key) {
            None => return Ok(Vec::new()),
            Some(Value::String(text)) if single => return Ok(vec![text]),
            Some(Value::Array(items)) => items,
            Some(other) => {
                let expected = if single {
                    "a string or an array of strings"
                } else {
                    "an array of strings"
                };
                return Err(self.wrong(key, expected, &other));
            }
        };
        let path = self.path_of(key);
        items
            .into_iter()
            .enumerate()
            .map(|(index, item)| match item {
                Value::String(text) => Ok(text),
                other => Err(ImportError::malformed(
                    format!("{path}[{index}]"),
                    format!("expected a string, found {}", type_name(&other)),
                )),
            })
            .collect()
    }

    /// An optional array field.
    pub fn array(&mut self, key: &str) -> Result<Option<Vec<Value>>, ImportError> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(other) => Err(self.wrong(key, "an array", &other)),
        }
    }

    /// A required array field.
    pub fn required_array(&mut self, key: &str) -> Result<Vec<Value>, ImportError> {
        match self.required(key)? {
            Value::Array(items) => Ok(items),
            other => Err(self.wrong(key, "an array", &other)),
        }
    }

    /// An optional object field.
    pub fn object(&mut self, key: &str) -> Result<Option<Obj>, ImportError> {
        match self.take(key) {
            None => Ok(None),
            Some(value) => Obj::new(value, self.path_of(key), self.pattern_of(key)).map(Some),
        }
    }

    /// A required object field.
    pub fn required_object(&mut self, key: &str) -> Result<Obj, ImportError> {
        let value = self.required(key)?;
        Obj::new(value, self.path_of(key), self.pattern_of(key))
    }

    /// The elements of an array field taken from this object, each with its path and pattern.
    pub fn elements(&self, key: &str, items: Vec<Value>) -> Vec<(String, String, Value)> {
        let path = self.path_of(key);
        let pattern = format!("{}[]", self.pattern_of(key));
        items
            .into_iter()
            .enumerate()
            .map(|(index, item)| (format!("{path}[{index}]"), pattern.clone(), item))
            .collect()
    }

    /// A field whose presence (not null, not empty) asks for something v1 cannot represent.
    pub fn refuse(&mut self, key: &str, what: &str) -> Result<(), ImportError> {
        match self.take(key) {
            None => Ok(()),
            Some(value) if carries_nothing(&value) => Ok(()),
            Some(_) => Err(ImportError::unrepresentable(self.path_of(key), what)),
        }
    }

    /// Rename every `snake_case` key to `camelCase` (the Gemini REST API accepts both
    /// spellings, and its own curl examples use snake case). Both spellings at once is
    /// malformed.
    pub fn camel_case_keys(&mut self) -> Result<(), ImportError> {
        let snake: Vec<String> = self.map.keys().filter(|key| key.contains('_')).cloned().collect();
        for key in snake {
            let camel = camel_case(&key);
            if camel == key {
                continue;
            }
            if self.map.contains_key(&camel) {
                return Err(ImportError::malformed(
                    self.path_of(&key),
                    format!("both {key:?} and {camel:?} are given"),
                ));
            }
            if let Some(value) = self.map.remove(&key) {
                self.map.insert(camel, value);
            }
        }
        Ok(())
    }

    /// Report every field left as dropped.
    pub fn finish(self, builder: &mut Builder) {
        for (key, value) in self.map {
            if !carries_nothing(&value) {
                builder.dropped.insert(join(&self.pattern, &key));
            }
        }
    }
}

fn camel_case(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    let mut upper = false;
    for (index, character) in key.chars().enumerate() {
        if character == '_' && index > 0 {
            upper = true;
        } else if upper {
            out.extend(character.to_uppercase());
            upper = false;
        } else {
            out.push(character);
        }
    }
    out
}

/// `null`, `[]` and `{}` carry nothing: leaving them out loses nothing.
fn carries_nothing(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Array(items) => items.is_empty(),
        Value::Object(map) => map.is_empty(),
        _ => false,
    }
}

/// An image or document source from a URL: a `data:<media type>;base64,<data>` URL becomes
/// inline data, anything else stays a URL.
pub(crate) fn source_from_url(url: String, media_type: Option<String>) -> MediaSource {
    if let Some(rest) = url.strip_prefix("data:")
        && let Some((header, data)) = rest.split_once(',')
        && let Some(media) = header.strip_suffix(";base64")
        && !media.is_empty()
    {
        return MediaSource::Base64 {
            media_type: media.to_owned(),
            data: data.to_owned(),
        };
    }
    MediaSource::Url { url, media_type }
}

/// Encode bytes as standard base64 with padding (RFC 4648 §4).
pub(crate) fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b0 = chunk[0] as u32;
        let b1 = chunk.get(1).copied().unwrap_or(0) as u32;
        let b2 = chunk.get(2).copied().unwrap_or(0) as u32;
        let triple = (b0 << 16) | (b1 << 8) | b2;
        for index in 0..4 {
            if index <= chunk.len() {
                out.push(ALPHABET[((triple >> (18 - 6 * index)) & 0x3f) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Building the document.

/// Result status of an imported tool result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Success,
    Error,
}

/// One content part of an imported tool result.
pub(crate) enum ResultContent {
    Text(String),
    Image(MediaSource),
}

struct TurnDraft {
    role: Role,
    blocks: Vec<Value>,
    /// Calls of this turn: (call id, tool).
    calls: Vec<(String, String)>,
}

/// What a result copies from its call.
#[derive(Clone)]
struct CallEnvelope {
    tool: String,
    args_digest: Option<String>,
}

/// The message being imported: which role it opens and whether a block has gone in yet.
struct Message {
    role: Role,
    /// Whether the next block must open a new turn even when the last turn has its role.
    fresh: bool,
    pushed: bool,
    path: String,
}

/// Builds the v1 document. Importers announce each provider message with [`Builder::begin`],
/// add blocks with a role (a message whose blocks change role, like an Anthropic user message
/// holding tool results and text, splits into consecutive turns in order), and close it with
/// [`Builder::end`], which keeps an empty message as an empty turn for the validator to
/// report.
#[derive(Default)]
pub(crate) struct Builder {
    turns: Vec<TurnDraft>,
    tools: Vec<Value>,
    pub(crate) dropped: BTreeSet<String>,
    /// Client-only fields of single elements (`passthrough::ElementField`), for the head.
    pub(crate) elements: Vec<crate::passthrough::ElementField>,
    calls: HashMap<String, CallEnvelope>,
    blocks_total: usize,
    has_tool_blocks: bool,
    message: Option<Message>,
}

/// The generation written on every imported assistant turn (and so on every matched result):
/// a stateless request has no dispatch history, so each assistant turn counts as attempt 1.
pub(crate) const IMPORTED_GENERATION: u64 = 1;

impl Builder {
    /// Start a provider message of `role`. With `merge`, its blocks continue the last turn when
    /// that turn has the same role (a run of tool messages, Responses items of one assistant
    /// turn); otherwise they open a new turn.
    pub fn begin(&mut self, role: Role, merge: bool, path: String) {
        self.message = Some(Message {
            role,
            fresh: !merge,
            pushed: false,
            path,
        });
    }

    /// Close the current message: one that added no block still becomes an (empty) turn
    /// unless it merged into a turn of its role.
    pub fn end(&mut self) -> Result<(), ImportError> {
        let Some(message) = self.message.as_ref() else {
            return Ok(());
        };
        let role = message.role;
        if !message.pushed && (message.fresh || self.last_role() != Some(role)) {
            self.open(role)?;
        }
        self.message = None;
        Ok(())
    }

    fn message_path(&self) -> String {
        self.message
            .as_ref()
            .map(|message| message.path.clone())
            .unwrap_or_default()
    }

    fn open(&mut self, role: Role) -> Result<(), ImportError> {
        if self.turns.len() >= limits::TURNS_MAX {
            return Err(ImportError::Limit {
                path: self.message_path(),
                what: "TURNS_MAX",
                actual: self.turns.len() + 1,
                max: limits::TURNS_MAX,
            });
        }
        self.turns.push(TurnDraft {
            role,
            blocks: Vec::new(),
            calls: Vec::new(),
        });
        Ok(())
    }

    /// The role of the last turn.
    pub fn last_role(&self) -> Option<Role> {
        self.turns.last().map(|turn| turn.role)
    }

    /// Make the last turn one of `role` for the next block of the current message.
    pub fn place(&mut self, role: Role) -> Result<(), ImportError> {
        let fresh = self.message.as_ref().is_none_or(|message| message.fresh);
        if fresh || self.last_role() != Some(role) {
            self.open(role)?;
        }
        if let Some(message) = self.message.as_mut() {
            message.fresh = false;
            message.pushed = true;
        }
        Ok(())
    }

    /// The id of the last turn (`t-<n>`).
    pub fn turn_id(&self) -> String {
        format!("t-{}", self.turns.len())
    }

    /// Number of calls in the last turn so far.
    pub fn turn_call_count(&self) -> usize {
        self.turns.last().map_or(0, |turn| turn.calls.len())
    }

    /// The calls (call id, tool) of the last turn, when it is an assistant turn.
    pub fn last_assistant_calls(&self) -> Option<Vec<(String, String)>> {
        self.turns
            .last()
            .filter(|turn| turn.role == Role::Assistant)
            .map(|turn| turn.calls.clone())
    }

    fn push(&mut self, role: Role, mut block: Map<String, Value>) -> Result<(), ImportError> {
        self.place(role)?;
        let path = self.message_path();
        let turn_number = self.turns.len();
        let Some(turn) = self.turns.last_mut() else {
            // `place` always leaves a turn; nothing to add to otherwise.
            return Ok(());
        };
        if turn.blocks.len() >= limits::BLOCKS_PER_TURN_MAX {
            return Err(ImportError::Limit {
                path,
                what: "BLOCKS_PER_TURN_MAX",
                actual: turn.blocks.len() + 1,
                max: limits::BLOCKS_PER_TURN_MAX,
            });
        }
        if self.blocks_total >= limits::BLOCKS_MAX {
            return Err(ImportError::Limit {
                path,
                what: "BLOCKS_MAX",
                actual: self.blocks_total + 1,
                max: limits::BLOCKS_MAX,
            });
        }
        self.blocks_total += 1;
        block.insert(
            "id".into(),
            Value::String(format!("t-{turn_number}-b-{}", turn.blocks.len() + 1)),
        );
        turn.blocks.push(Value::Object(block));
        Ok(())
    }

    /// A `text` block.
    pub fn text(&mut self, role: Role, text: String) -> Result<(), ImportError> {
        let mut block = Map::new();
        block.insert("kind".into(), "text".into());
        block.insert("text".into(), Value::String(text));
        self.push(role, block)
    }

    /// An `image` block.
    pub fn image(&mut self, role: Role, source: MediaSource) -> Result<(), ImportError> {
        let mut block = Map::new();
        block.insert("kind".into(), "image".into());
        write_source(&mut block, source);
        self.push(role, block)
    }

    /// An `image` block with the client's image `detail` (its field path and value), carried as
    /// a `passthrough::ElementField` on the block's id.
    pub fn image_with_detail(
        &mut self,
        role: Role,
        source: MediaSource,
        detail: Option<(String, String)>,
    ) -> Result<(), ImportError> {
        self.image(role, source)?;
        if let Some((field, detail)) = detail
            && let Some(block) = self.last_block_id()
        {
            self.element(
                crate::passthrough::ElementKind::Detail,
                field,
                block,
                Value::String(detail),
            );
        }
        Ok(())
    }

    /// A `document` block.
    pub fn document(
        &mut self,
        role: Role,
        source: MediaSource,
        title: Option<String>,
    ) -> Result<(), ImportError> {
        let mut block = Map::new();
        block.insert("kind".into(), "document".into());
        write_source(&mut block, source);
        if let Some(title) = title {
            block.insert("title".into(), Value::String(title));
        }
        self.push(role, block)
    }

    /// A `reasoning` block (v1 needs a signature or an encrypted payload; callers check).
    pub fn reasoning(
        &mut self,
        role: Role,
        provider: &str,
        signature: Option<String>,
        encrypted: Option<String>,
        text: Option<String>,
    ) -> Result<(), ImportError> {
        let mut block = Map::new();
        block.insert("kind".into(), "reasoning".into());
        block.insert("provider".into(), provider.into());
        for (key, value) in [("signature", signature), ("encrypted", encrypted), ("text", text)] {
            if let Some(value) = value {
                block.insert(key.into(), Value::String(value));
            }
        }
        self.push(role, block)
    }

    /// A `tool_call` block. `arguments` is the provider's raw JSON text (a string, kept as is
    /// so the validator judges it) or an object.
    pub fn tool_call(
        &mut self,
        role: Role,
        call_id: String,
        tool: String,
        arguments: Value,
    ) -> Result<(), ImportError> {
        let parsed = match &arguments {
            Value::Object(map) => Some(Arguments::from_object(map.clone())),
            Value::String(text) => Some(Arguments::from_text(text.clone())),
            _ => None,
        };
        let args_digest = parsed
            .as_ref()
            .and_then(Arguments::digest)
            .map(|digest| digest.as_str().to_owned());
        self.calls.insert(
            call_id.clone(),
            CallEnvelope {
                tool: tool.clone(),
                args_digest,
            },
        );
        self.has_tool_blocks = true;
        let mut block = Map::new();
        block.insert("kind".into(), "tool_call".into());
        block.insert("call_id".into(), Value::String(call_id.clone()));
        block.insert("tool".into(), Value::String(tool.clone()));
        block.insert("arguments".into(), arguments);
        self.push(role, block)?;
        if let Some(turn) = self.turns.last_mut() {
            turn.calls.push((call_id, tool));
        }
        Ok(())
    }

    /// A `tool_result` block whose envelope (`tool`, `args_digest`, `generation`) comes from
    /// the call with that id earlier in the imported history. With no such call it is an
    /// orphan: `tool` is `tool_hint` (the name the provider gave, if any, else empty) and the
    /// validator reports `orphan_result`.
    pub fn tool_result(
        &mut self,
        role: Role,
        call_id: String,
        tool_hint: Option<String>,
        status: Status,
        content: Vec<ResultContent>,
    ) -> Result<(), ImportError> {
        self.has_tool_blocks = true;
        let mut block = Map::new();
        block.insert("kind".into(), "tool_result".into());
        match self.calls.get(&call_id).cloned() {
            Some(envelope) => {
                block.insert("tool".into(), Value::String(envelope.tool));
                if let Some(digest) = envelope.args_digest {
                    block.insert("args_digest".into(), Value::String(digest));
                }
                block.insert("generation".into(), IMPORTED_GENERATION.into());
            }
            None => {
                block.insert("tool".into(), Value::String(tool_hint.unwrap_or_default()));
            }
        }
        block.insert("call_id".into(), Value::String(call_id));
        block.insert(
            "status".into(),
            match status {
                Status::Success => "success",
                Status::Error => "error",
            }
            .into(),
        );
        let parts = content
            .into_iter()
            .map(|part| {
                let mut map = Map::new();
                match part {
                    ResultContent::Text(text) => {
                        map.insert("kind".into(), "text".into());
                        map.insert("text".into(), Value::String(text));
                    }
                    ResultContent::Image(source) => {
                        map.insert("kind".into(), "image".into());
                        write_source(&mut map, source);
                    }
                }
                Value::Object(map)
            })
            .collect();
        block.insert("content".into(), Value::Array(parts));
        self.push(role, block)
    }

    /// A v1 tool definition.
    pub fn tool(
        &mut self,
        name: String,
        description: Option<String>,
        input_schema: Option<Value>,
        path: &str,
    ) -> Result<(), ImportError> {
        if self.tools.len() >= limits::TOOLS_MAX {
            return Err(ImportError::Limit {
                path: path.to_owned(),
                what: "TOOLS_MAX",
                actual: self.tools.len() + 1,
                max: limits::TOOLS_MAX,
            });
        }
        let mut tool = Map::new();
        tool.insert("name".into(), Value::String(name));
        if let Some(description) = description {
            tool.insert("description".into(), Value::String(description));
        }
        let schema = input_schema
            .unwrap_or_else(|| Value::Object(Map::from_iter([("type".to_owned(), Value::from("object"))])));
        tool.insert("input_schema".into(), schema);
        self.tools.push(Value::Object(tool));
        Ok(())
    }

    /// The id of the turn added last (`t-N`, as [`Builder::finish`] writes it).
    pub fn last_turn_id(&self) -> String {
        format!("t-{}", self.turns.len())
    }

    /// The id of the block added last (`t-N-b-M`, as `push` writes it).
    pub fn last_block_id(&self) -> Option<String> {
        self.turns
            .last()
            .and_then(|turn| turn.blocks.last())
            .and_then(|block| block.get("id"))
            .and_then(Value::as_str)
            .map(str::to_owned)
    }

    /// Record a client-only field of one element (`passthrough::ElementField`).
    pub fn element(
        &mut self,
        kind: crate::passthrough::ElementKind,
        field: String,
        on: String,
        value: Value,
    ) {
        self.elements.push(crate::passthrough::ElementField {
            kind,
            field,
            on,
            value,
        });
    }

    /// Put a prompt-cache breakpoint (a v1 `cache` value) on the block added last.
    pub fn mark_last_block(&mut self, mark: Value) {
        if let Some(Value::Object(block)) = self.turns.last_mut().and_then(|turn| turn.blocks.last_mut()) {
            block.insert(turnstile_core::conversation::CACHE_FIELD.into(), mark);
        }
    }

    /// Put a prompt-cache breakpoint on the tool added last.
    pub fn mark_last_tool(&mut self, mark: Value) {
        if let Some(Value::Object(tool)) = self.tools.last_mut() {
            tool.insert(turnstile_core::conversation::CACHE_FIELD.into(), mark);
        }
    }

    /// Record a dropped field by its index-free path.
    pub fn drop_path(&mut self, pattern: String) {
        self.dropped.insert(pattern);
    }

    fn finish(self, conversation_id: &str, head: Head) -> Imported {
        let has_tools = !self.tools.is_empty() || self.has_tool_blocks;
        let revision = self.turns.len();
        let turns: Vec<Value> = self
            .turns
            .into_iter()
            .enumerate()
            .map(|(index, turn)| {
                let mut map = Map::new();
                map.insert("id".into(), Value::String(format!("t-{}", index + 1)));
                map.insert("revision".into(), (index as u64 + 1).into());
                map.insert("role".into(), turn.role.as_str().into());
                if turn.role == Role::Assistant {
                    map.insert("generation".into(), IMPORTED_GENERATION.into());
                }
                map.insert("blocks".into(), Value::Array(turn.blocks));
                Value::Object(map)
            })
            .collect();
        let mut document = Map::new();
        document.insert("format".into(), turnstile_core::conversation::FORMAT_V1.into());
        document.insert("conversation_id".into(), conversation_id.into());
        document.insert("revision".into(), (revision as u64).into());
        document.insert("tools".into(), Value::Array(self.tools));
        document.insert("turns".into(), Value::Array(turns));
        Imported {
            document: Value::Object(document),
            model: head.model,
            stream: head.stream,
            max_output_tokens: head.max_output_tokens,
            has_tools,
            sampling: head.sampling,
            tool_choice: head.tool_choice,
            output_format: head.output_format,
            passthrough: head.passthrough,
            dropped: self.dropped.into_iter().collect(),
        }
    }
}

fn write_source(map: &mut Map<String, Value>, source: MediaSource) {
    match source {
        MediaSource::Base64 { media_type, data } => {
            map.insert("media_type".into(), Value::String(media_type));
            map.insert("data".into(), Value::String(data));
        }
        MediaSource::Url { url, media_type } => {
            map.insert("url".into(), Value::String(url));
            if let Some(media_type) = media_type {
                map.insert("media_type".into(), Value::String(media_type));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Semantic comparison.

/// Compare the meaning of two v1 documents (both normally [`Imported::document`]s) and return
/// the differences in words; empty means the same meaning. Never panics, whatever the values.
///
/// What counts (and what is normalized away, because the APIs cannot keep it):
/// - roles in order, with consecutive turns of one role taken as one message (Anthropic and
///   Gemini merge them; a run of tool turns is one run anyway);
/// - system and user messages: their parts in order — text, `context` as the wrapped text it
///   renders to (every adapter sends it as text, and it imports back as text), images and
///   documents by source (URL sources by URL only; `text/plain` documents by their decoded
///   bytes); a document's title only when both sides have one (Gemini has no title);
///   whitespace-only text is ignored (Anthropic rejects it, so it is left out);
/// - assistant messages: texts in order, calls in order (call id, tool, canonical arguments),
///   reasoning in order (provider, signature, encrypted; its text only when both sides have
///   one). Text and calls are compared as two sequences because OpenAI Chat's wire format
///   cannot hold their interleaving;
/// - tool runs: results by call id (any order is legal), each with status and content; a
///   leading text part that is exactly a renderer status note (`[tool result status: error]`,
///   or the cancel note) is folded into the status, since that is how APIs without a status
///   field carry it; whitespace-only text parts are ignored;
/// - tools by name: description and canonical input schema.
pub fn semantic_diff(ours: &Value, theirs: &Value) -> Vec<String> {
    let ours = Meaning::of(ours);
    let theirs = Meaning::of(theirs);
    let mut out = Vec::new();
    diff_tools(&ours.tools, &theirs.tools, &mut out);
    let count = ours.messages.len().max(theirs.messages.len());
    for index in 0..count {
        match (ours.messages.get(index), theirs.messages.get(index)) {
            (Some(a), Some(b)) => diff_message(index + 1, a, b, &mut out),
            (Some(a), None) => out.push(format!("message {}: only ours has it ({})", index + 1, a.role())),
            (None, Some(b)) => out.push(format!(
                "message {}: only theirs has it ({})",
                index + 1,
                b.role()
            )),
            (None, None) => {}
        }
    }
    out
}

struct Meaning {
    tools: BTreeMap<String, (Option<String>, String)>,
    messages: Vec<MessageMeaning>,
}

#[derive(Debug, PartialEq)]
enum Source {
    Inline { media_type: String, data: String },
    Url(String),
}

#[derive(Debug)]
enum Part {
    Text(String),
    Image(Source),
    Document(Source, Option<String>),
    Other(String),
}

#[derive(Debug, PartialEq)]
struct CallMeaning {
    call_id: String,
    tool: String,
    arguments: String,
}

#[derive(Debug)]
struct ReasoningMeaning {
    provider: String,
    signature: Option<String>,
    encrypted: Option<String>,
    text: Option<String>,
}

#[derive(Debug)]
struct ResultMeaning {
    call_id: String,
    status: String,
    content: Vec<Part>,
}

#[derive(Debug)]
enum MessageMeaning {
    /// System or user (or an unknown role): parts in order.
    Parts {
        role: String,
        parts: Vec<Part>,
    },
    Assistant {
        texts: Vec<Part>,
        calls: Vec<CallMeaning>,
        reasoning: Vec<ReasoningMeaning>,
    },
    Tool {
        results: Vec<ResultMeaning>,
    },
}

impl MessageMeaning {
    fn role(&self) -> &str {
        match self {
            MessageMeaning::Parts { role, .. } => role,
            MessageMeaning::Assistant { .. } => "assistant",
            MessageMeaning::Tool { .. } => "tool",
        }
    }
}

fn str_of<'a>(value: &'a Value, key: &str) -> Option<&'a str> {
    value.get(key).and_then(Value::as_str)
}

fn canonical_text(value: &Value) -> String {
    String::from_utf8_lossy(&turnstile_core::digest::canonical_bytes(value)).into_owned()
}

fn source_of(block: &Value) -> Source {
    if let Some(url) = str_of(block, "url") {
        return Source::Url(url.to_owned());
    }
    let media_type = str_of(block, "media_type").unwrap_or("").to_owned();
    let data = str_of(block, "data").unwrap_or("").to_owned();
    if media_type.starts_with("text/plain")
        && let Some(bytes) = crate::render::base64_decode(&data)
    {
        return Source::Inline {
            media_type: "text/plain".into(),
            data: base64_encode(&bytes),
        };
    }
    Source::Inline { media_type, data }
}

fn part_of(block: &Value) -> Option<Part> {
    match str_of(block, "kind") {
        Some("text") => {
            let text = str_of(block, "text").unwrap_or("");
            (!text.trim().is_empty()).then(|| Part::Text(text.to_owned()))
        }
        Some("context") => {
            let trust = match str_of(block, "trust") {
                Some("trusted") => Trust::Trusted,
                _ => Trust::Untrusted,
            };
            Some(Part::Text(crate::render::wrap_context(
                str_of(block, "source"),
                trust,
                str_of(block, "text").unwrap_or(""),
            )))
        }
        Some("image") => Some(Part::Image(source_of(block))),
        Some("document") => Some(Part::Document(
            source_of(block),
            str_of(block, "title").map(str::to_owned),
        )),
        _ => {
            let mut copy = block.clone();
            if let Value::Object(map) = &mut copy {
                map.remove("id");
                map.remove("state");
            }
            Some(Part::Other(canonical_text(&copy)))
        }
    }
}

fn arguments_meaning(value: Option<&Value>) -> String {
    let arguments = match value {
        Some(Value::Object(map)) => Arguments::from_object(map.clone()),
        Some(Value::String(text)) => Arguments::from_text(text.clone()),
        Some(other) => return format!("invalid: {}", canonical_text(other)),
        None => return "missing".into(),
    };
    match arguments {
        Arguments::Closed { value, .. } => canonical_text(&Value::Object(value)),
        Arguments::Unclosed { raw, .. } => format!("unclosed: {raw}"),
    }
}

fn result_of(block: &Value) -> ResultMeaning {
    use turnstile_core::conversation::ResultStatus;
    let mut status = str_of(block, "status").unwrap_or("?").to_owned();
    let mut content: Vec<Part> = Vec::new();
    let mut first = true;
    for part in block
        .get("content")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
    {
        if first && str_of(part, "kind") == Some("text") && (status == "success" || status == "error") {
            let text = str_of(part, "text").unwrap_or("");
            if Some(text) == crate::render::status_note(ResultStatus::Error) {
                status = "error".into();
                first = false;
                continue;
            }
            if Some(text) == crate::render::status_note(ResultStatus::Cancel) {
                status = "cancel".into();
                first = false;
                continue;
            }
        }
        first = false;
        if let Some(part) = part_of(part) {
            content.push(part);
        }
    }
    ResultMeaning {
        call_id: str_of(block, "call_id").unwrap_or("").to_owned(),
        status,
        content,
    }
}

impl Meaning {
    fn of(document: &Value) -> Meaning {
        let mut tools = BTreeMap::new();
        for tool in document
            .get("tools")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or(&[])
        {
            let name = str_of(tool, "name").unwrap_or("").to_owned();
            let description = str_of(tool, "description").map(str::to_owned);
            let schema = tool
                .get("input_schema")
                .map(canonical_text)
                .unwrap_or_else(|| "{\"type\":\"object\"}".into());
            tools.insert(name, (description, schema));
        }
        let mut messages: Vec<MessageMeaning> = Vec::new();
        for turn in document
            .get("turns")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or(&[])
        {
            let role = str_of(turn, "role").unwrap_or("?");
            let blocks = turn
                .get("blocks")
                .and_then(Value::as_array)
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            let same_role = messages.last().is_some_and(|last| last.role() == role);
            if !same_role {
                messages.push(match role {
                    "assistant" => MessageMeaning::Assistant {
                        texts: Vec::new(),
                        calls: Vec::new(),
                        reasoning: Vec::new(),
                    },
                    "tool" => MessageMeaning::Tool { results: Vec::new() },
                    other => MessageMeaning::Parts {
                        role: other.to_owned(),
                        parts: Vec::new(),
                    },
                });
            }
            let Some(message) = messages.last_mut() else {
                continue;
            };
            for block in blocks {
                match message {
                    MessageMeaning::Parts { parts, .. } => parts.extend(part_of(block)),
                    MessageMeaning::Assistant {
                        texts,
                        calls,
                        reasoning,
                    } => match str_of(block, "kind") {
                        Some("tool_call") => calls.push(CallMeaning {
                            call_id: str_of(block, "call_id").unwrap_or("").to_owned(),
                            tool: str_of(block, "tool").unwrap_or("").to_owned(),
                            arguments: arguments_meaning(block.get("arguments")),
                        }),
                        Some("reasoning") => reasoning.push(ReasoningMeaning {
                            provider: str_of(block, "provider").unwrap_or("").to_owned(),
                            signature: str_of(block, "signature").map(str::to_owned),
                            encrypted: str_of(block, "encrypted").map(str::to_owned),
                            text: str_of(block, "text").map(str::to_owned),
                        }),
                        _ => texts.extend(part_of(block)),
                    },
                    MessageMeaning::Tool { results } => {
                        if str_of(block, "kind") == Some("tool_result") {
                            results.push(result_of(block));
                        } else {
                            results.push(ResultMeaning {
                                call_id: String::new(),
                                status: "not a tool_result".into(),
                                content: part_of(block).into_iter().collect(),
                            });
                        }
                    }
                }
            }
        }
        for message in &mut messages {
            if let MessageMeaning::Tool { results } = message {
                results.sort_by(|a, b| a.call_id.cmp(&b.call_id));
            }
        }
        Meaning { tools, messages }
    }
}

fn short(text: &str) -> String {
    const SHOWN_MAX: usize = 60;
    let mut out: String = text.chars().take(SHOWN_MAX).collect();
    if text.chars().count() > SHOWN_MAX {
        out.push('…');
    }
    format!("{out:?}")
}

fn diff_tools(
    ours: &BTreeMap<String, (Option<String>, String)>,
    theirs: &BTreeMap<String, (Option<String>, String)>,
    out: &mut Vec<String>,
) {
    for (name, (description, schema)) in ours {
        match theirs.get(name) {
            None => out.push(format!("tool {name:?}: only ours declares it")),
            Some((their_description, their_schema)) => {
                if description != their_description {
                    out.push(format!("tool {name:?}: descriptions differ"));
                }
                if schema != their_schema {
                    out.push(format!("tool {name:?}: input schemas differ"));
                }
            }
        }
    }
    for name in theirs.keys().filter(|name| !ours.contains_key(*name)) {
        out.push(format!("tool {name:?}: only theirs declares it"));
    }
}

fn describe(part: &Part) -> String {
    match part {
        Part::Text(text) => format!("text {}", short(text)),
        Part::Image(source) => format!("image {}", describe_source(source)),
        Part::Document(source, _) => format!("document {}", describe_source(source)),
        Part::Other(json) => format!("block {}", short(json)),
    }
}

fn describe_source(source: &Source) -> String {
    match source {
        Source::Url(url) => format!("url {}", short(url)),
        Source::Inline { media_type, data } => format!("{media_type} ({} base64 chars)", data.len()),
    }
}

fn same_part(a: &Part, b: &Part) -> bool {
    match (a, b) {
        (Part::Text(a), Part::Text(b)) => a == b,
        (Part::Image(a), Part::Image(b)) => a == b,
        (Part::Document(a, title_a), Part::Document(b, title_b)) => {
            a == b
                && match (title_a, title_b) {
                    (Some(x), Some(y)) => x == y,
                    _ => true,
                }
        }
        (Part::Other(a), Part::Other(b)) => a == b,
        _ => false,
    }
}

fn diff_parts(at: &str, ours: &[Part], theirs: &[Part], out: &mut Vec<String>) {
    for index in 0..ours.len().max(theirs.len()) {
        match (ours.get(index), theirs.get(index)) {
            (Some(a), Some(b)) if !same_part(a, b) => out.push(format!(
                "{at} part {}: ours is {}, theirs is {}",
                index + 1,
                describe(a),
                describe(b)
            )),
            (Some(a), None) => out.push(format!("{at} part {}: only ours has {}", index + 1, describe(a))),
            (None, Some(b)) => out.push(format!(
                "{at} part {}: only theirs has {}",
                index + 1,
                describe(b)
            )),
            _ => {}
        }
    }
}

fn diff_message(number: usize, ours: &MessageMeaning, theirs: &MessageMeaning, out: &mut Vec<String>) {
    let at = format!("message {number} ({})", ours.role());
    match (ours, theirs) {
        (
            MessageMeaning::Parts { role, parts },
            MessageMeaning::Parts {
                role: their_role,
                parts: their_parts,
            },
        ) if role == their_role => diff_parts(&at, parts, their_parts, out),
        (
            MessageMeaning::Assistant {
                texts,
                calls,
                reasoning,
            },
            MessageMeaning::Assistant {
                texts: their_texts,
                calls: their_calls,
                reasoning: their_reasoning,
            },
        ) => {
            diff_parts(&at, texts, their_texts, out);
            for index in 0..calls.len().max(their_calls.len()) {
                match (calls.get(index), their_calls.get(index)) {
                    (Some(a), Some(b)) if a != b => out.push(format!(
                        "{at} call {}: ours is {} {} {}, theirs is {} {} {}",
                        index + 1,
                        short(&a.call_id),
                        short(&a.tool),
                        short(&a.arguments),
                        short(&b.call_id),
                        short(&b.tool),
                        short(&b.arguments)
                    )),
                    (Some(a), None) => out.push(format!(
                        "{at} call {}: only ours has {}",
                        index + 1,
                        short(&a.call_id)
                    )),
                    (None, Some(b)) => out.push(format!(
                        "{at} call {}: only theirs has {}",
                        index + 1,
                        short(&b.call_id)
                    )),
                    _ => {}
                }
            }
            for index in 0..reasoning.len().max(their_reasoning.len()) {
                match (reasoning.get(index), their_reasoning.get(index)) {
                    (Some(a), Some(b)) => {
                        let texts_differ = matches!((&a.text, &b.text), (Some(x), Some(y)) if x != y);
                        if a.provider != b.provider
                            || a.signature != b.signature
                            || a.encrypted != b.encrypted
                            || texts_differ
                        {
                            out.push(format!("{at} reasoning {}: differs", index + 1));
                        }
                    }
                    (Some(a), None) => out.push(format!(
                        "{at} reasoning {}: only ours has {} reasoning",
                        index + 1,
                        a.provider
                    )),
                    (None, Some(b)) => out.push(format!(
                        "{at} reasoning {}: only theirs has {} reasoning",
                        index + 1,
                        b.provider
                    )),
                    (None, None) => {}
                }
            }
        }
        (
            MessageMeaning::Tool { results },
            MessageMeaning::Tool {
                results: their_results,
            },
        ) => {
            for index in 0..results.len().max(their_results.len()) {
                match (results.get(index), their_results.get(index)) {
                    (Some(a), Some(b)) => {
                        if a.call_id != b.call_id {
                            out.push(format!(
                                "{at} result {}: ours answers {}, theirs answers {}",
                                index + 1,
                                short(&a.call_id),
                                short(&b.call_id)
                            ));
                            continue;
                        }
                        if a.status != b.status {
                            out.push(format!(
                                "{at} result for {}: status {} vs {}",
                                short(&a.call_id),
                                a.status,
                                b.status
                            ));
                        }
                        diff_parts(
                            &format!("{at} result for {}:", short(&a.call_id)),
                            &a.content,
                            &b.content,
                            out,
                        );
                    }
                    (Some(a), None) => out.push(format!("{at}: only ours answers {}", short(&a.call_id))),
                    (None, Some(b)) => out.push(format!("{at}: only theirs answers {}", short(&b.call_id))),
                    (None, None) => {}
                }
            }
        }
        _ => out.push(format!(
            "message {number}: role {} in ours, {} in theirs",
            ours.role(),
            theirs.role()
        )),
    }
}
