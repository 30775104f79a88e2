//! The committed-history model of `turnstile.conversation.v1` and its lenient decoder.
//!
//! The decoder never fails on a malformed turn or block: it records an `invalid_structure`
//! (or `unknown_kind`) violation, keeps a placeholder, and goes on, so the validator can report
//! every problem at once. Only input that is not a v1 file at all (not an object, wrong
//! `format`) or that breaks a named limit is [`Unreadable`].
//!
//! Every block keeps the content digest of its own JSON (RFC 8785, without `id` and `state`),
//! computed once here, so anything derived from a block can be cached by that digest.

use crate::digest::Digest;
use crate::ids::{CallId, Generation, Revision};
use crate::limits;
use crate::violation::{Violation, ViolationCode};
use serde::Serialize;
use serde_json::{Map, Value};

pub(crate) mod typed;

/// The `format` string of a conversation file.
pub const FORMAT_V1: &str = "turnstile.conversation.v1";

/// Input that cannot be read as a v1 conversation at all.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unreadable {
    /// The bytes are not JSON.
    #[error("not JSON: {0}")]
    NotJson(String),
    /// The document is JSON but not a `turnstile.conversation.v1` object.
    #[error("not a turnstile.conversation.v1 file: {0}")]
    NotV1(String),
    /// A named limit was exceeded.
    #[error("limit exceeded: {what} is {actual}, the maximum is {max}")]
    Limit {
        /// Which limit (the constant's name).
        what: &'static str,
        /// What the input had (or a lower bound of it).
        actual: usize,
        /// The limit.
        max: usize,
    },
}

/// A turn's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Operator instructions; only at the start.
    System,
    /// The end user.
    User,
    /// The model.
    Assistant,
    /// Tool results.
    Tool,
}

impl Role {
    /// The v1 string.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// A block's lifecycle state as written in the file. Only `Committed` is legal in history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// The default.
    Committed,
    /// Anything else (`preview`, `planned`, …): rejected as `uncommitted_block`.
    Other(String),
}

/// Trust label of a `context` block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Trust {
    /// Vetted by the operator.
    Trusted,
    /// Anything else; the default when a context block does not say.
    Untrusted,
}

/// Where the bytes of an image or document are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MediaSource {
    /// Inline base64.
    Base64 {
        /// MIME type, e.g. `image/png`.
        media_type: String,
        /// Base64 payload.
        data: String,
    },
    /// By reference.
    Url {
        /// Where to fetch it.
        url: String,
        /// MIME type if known.
        media_type: Option<String>,
    },
}

/// The state of a tool call's arguments.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ArgState {
    /// A complete JSON object.
    Closed,
    /// A prefix of JSON text that ended early (a cut stream).
    Open,
    /// Not a JSON object at all (syntax error, or an array/number/…).
    Invalid,
}

/// A tool call's arguments.
#[derive(Clone, Debug, PartialEq)]
pub enum Arguments {
    /// A complete JSON object.
    Closed {
        /// The parsed object.
        value: Map<String, Value>,
        /// The raw JSON text the model produced, when the file gave a string.
        raw: Option<String>,
        /// `sha256:` over the JCS form of `value`.
        digest: Digest,
    },
    /// Not a complete object: `unclosed_arguments`.
    Unclosed {
        /// Open (cut) or invalid.
        state: ArgState,
        /// What was given, as text.
        raw: String,
    },
}

impl Arguments {
    /// The argument state.
    pub fn state(&self) -> ArgState {
        match self {
            Arguments::Closed { .. } => ArgState::Closed,
            Arguments::Unclosed { state, .. } => state.clone(),
        }
    }

    /// The args digest, when closed.
    pub fn digest(&self) -> Option<&Digest> {
        match self {
            Arguments::Closed { digest, .. } => Some(digest),
            Arguments::Unclosed { .. } => None,
        }
    }

    /// Parse arguments given as raw JSON text (a file string or an assembled stream buffer).
    pub fn from_text(text: String) -> Arguments {
        if crate::parse::value_may_nest_deeper(text.as_bytes(), limits::JSON_DEPTH_MAX) {
            return Arguments::Unclosed {
                state: ArgState::Invalid,
                raw: text,
            };
        }
        match serde_json::from_str::<Value>(&text) {
            Ok(Value::Object(value)) => {
                let digest = Digest::of_map(&value);
                Arguments::Closed {
                    value,
                    raw: Some(text),
                    digest,
                }
            }
            Ok(_) => Arguments::Unclosed {
                state: ArgState::Invalid,
                raw: text,
            },
            Err(error) if error.is_eof() => Arguments::Unclosed {
                state: ArgState::Open,
                raw: text,
            },
            Err(_) => Arguments::Unclosed {
                state: ArgState::Invalid,
                raw: text,
            },
        }
    }

    /// Arguments given as an already-parsed object.
    pub fn from_object(value: Map<String, Value>) -> Arguments {
        let digest = Digest::of_map(&value);
        Arguments::Closed {
            value,
            raw: None,
            digest,
        }
    }
}

/// Terminal status of a tool result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ResultStatus {
    /// The tool ran and returned.
    Success,
    /// The tool ran and failed.
    Error,
    /// The call was cancelled before or while running.
    Cancel,
}

/// One part of a tool result's content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResultPart {
    /// Text.
    Text(String),
    /// An image.
    Image(MediaSource),
}

/// The typed content of a block.
#[derive(Clone, Debug, PartialEq)]
pub enum BlockBody {
    /// Plain text.
    Text {
        /// The text, verbatim (a text saying `assistant:` is still text).
        text: String,
    },
    /// An image.
    Image {
        /// Its bytes or URL.
        source: MediaSource,
    },
    /// A tool call emitted by the model.
    ToolCall {
        /// Our call id.
        call_id: CallId,
        /// Tool name.
        tool: String,
        /// Arguments.
        arguments: Arguments,
    },
    /// The terminal result of a tool call.
    ToolResult {
        /// The call it answers.
        call_id: CallId,
        /// Tool name (must match the call).
        tool: String,
        /// Digest of the arguments it ran with (must match the call when given).
        args_digest: Option<Digest>,
        /// Generation of the call's assistant turn (must match when given).
        generation: Option<Generation>,
        /// success / error / cancel.
        status: ResultStatus,
        /// Content parts.
        content: Vec<ResultPart>,
    },
    /// A scoped input block: retrieval snippet or compaction summary.
    Context {
        /// Where it came from (`retrieval`, `compaction`, …).
        source: Option<String>,
        /// Trust label.
        trust: Trust,
        /// The text, verbatim.
        text: String,
    },
    /// A document (PDF, plain text, …).
    Document {
        /// Its bytes or URL.
        source: MediaSource,
        /// Optional title.
        title: Option<String>,
    },
    /// Provider-affine opaque reasoning.
    Reasoning {
        /// Which provider produced it (`anthropic`, `openai`, `gemini`).
        provider: String,
        /// Anthropic thinking signature / Gemini thought signature.
        signature: Option<String>,
        /// OpenAI `encrypted_content` / Anthropic redacted thinking data.
        encrypted: Option<String>,
        /// Readable reasoning text, when the provider gave one.
        text: Option<String>,
    },
    /// A kind not in v1 (`unknown_kind`).
    Unknown {
        /// The kind string.
        kind: String,
    },
    /// A block whose fields did not decode (already reported as `invalid_structure`).
    Malformed,
}

impl BlockBody {
    /// The v1 kind string (`"?"` for a malformed block).
    pub fn kind(&self) -> &str {
        match self {
            BlockBody::Text { .. } => "text",
            BlockBody::Image { .. } => "image",
            BlockBody::ToolCall { .. } => "tool_call",
            BlockBody::ToolResult { .. } => "tool_result",
            BlockBody::Context { .. } => "context",
            BlockBody::Document { .. } => "document",
            BlockBody::Reasoning { .. } => "reasoning",
            BlockBody::Unknown { kind } => kind,
            BlockBody::Malformed => "?",
        }
    }
}

/// A prompt-cache breakpoint on a block or a tool (`"cache": {"ttl"?: "5m" | "1h"}` in v1):
/// "cache the request up to and including this". It says how the request should be cached,
/// not what the model reads, so it is kept out of every content digest (a breakpoint that
/// moves from one turn to the next changes no block digest, no `sequence_digest` and no
/// `toolset_digest`); the render policy pins it instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct CacheMark {
    /// How long the cached prefix should live; None: the provider's default (Anthropic: 5 min).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl: Option<CacheTtl>,
}

/// The lifetimes a cache breakpoint may ask for (Anthropic's `ttl` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum CacheTtl {
    /// `"5m"`.
    #[serde(rename = "5m")]
    FiveMinutes,
    /// `"1h"`.
    #[serde(rename = "1h")]
    OneHour,
}

impl CacheTtl {
    /// The v1 string.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheTtl::FiveMinutes => "5m",
            CacheTtl::OneHour => "1h",
        }
    }
}

/// The field name of a cache breakpoint on a v1 block or tool.
pub const CACHE_FIELD: &str = "cache";

/// Decode a `cache` value: an object with at most `ttl` (`"5m"` or `"1h"`); `null` is none.
pub fn cache_mark(value: Option<Value>) -> Result<Option<CacheMark>, String> {
    let Some(value) = value else {
        return Ok(None);
    };
    let mut map = match value {
        Value::Null => return Ok(None),
        Value::Object(map) => map,
        _ => return Err("cache must be an object".into()),
    };
    let ttl = match map.remove("ttl") {
        None | Some(Value::Null) => None,
        Some(Value::String(ttl)) if ttl == "5m" => Some(CacheTtl::FiveMinutes),
        Some(Value::String(ttl)) if ttl == "1h" => Some(CacheTtl::OneHour),
        Some(_) => return Err("cache.ttl must be \"5m\" or \"1h\"".into()),
    };
    if let Some(key) = map.keys().next() {
        return Err(format!("cache has an unknown field {key:?}"));
    }
    Ok(Some(CacheMark { ttl }))
}

/// One block of a turn.
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    /// Stable id (None when missing: reported).
    pub id: Option<String>,
    /// Lifecycle state.
    pub state: BlockState,
    /// `sha256:` over the JCS form of the block's JSON without `id`, `state` and `cache`.
    pub digest: Digest,
    /// Typed content.
    pub body: BlockBody,
    /// A prompt-cache breakpoint on this block ([`CacheMark`]); not part of `digest`.
    pub cache: Option<CacheMark>,
}

/// A role as written, which may be unknown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RoleField {
    /// One of the four v1 roles.
    Known(Role),
    /// Missing or not one of them (reported).
    Invalid,
}

/// One committed turn.
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    /// Stable id (None when missing: reported).
    pub id: Option<String>,
    /// The revision that committed it, when given.
    pub revision: Option<Revision>,
    /// Role.
    pub role: RoleField,
    /// Dispatch attempt generation (assistant turns).
    pub generation: Option<Generation>,
    /// Blocks in order.
    pub blocks: Vec<Block>,
}

impl Turn {
    /// `sha256:` over everything a reader takes from this decoded turn: its id, revision,
    /// role and generation, and per block its id, state, cache breakpoint and content
    /// [`Block::digest`]. Two turns with the same digest render the same. The store writes it
    /// beside each committed turn and a dispatch compares it after decoding the stored turn
    /// (a changed byte in stored history is refused, never sent: `docs/operating.md`). It
    /// hashes the block digests the decoder computed already, so it costs a few dozen bytes of
    /// SHA-256 per block, not a second pass over the content.
    pub fn digest(&self) -> Digest {
        #[derive(Serialize)]
        struct BlockForm<'a> {
            cache: Option<&'static str>,
            digest: &'a str,
            id: Option<&'a str>,
            state: &'a str,
        }
        // Fields in sorted order, strings and integers only: the compact serialisation is
        // canonical (`Digest::of_sorted_serialization`; `tests/it/digest.rs` compares).
        #[derive(Serialize)]
        struct TurnForm<'a> {
            blocks: Vec<BlockForm<'a>>,
            generation: Option<u64>,
            id: Option<&'a str>,
            revision: Option<u64>,
            role: Option<&'static str>,
        }
        let blocks = self
            .blocks
            .iter()
            .map(|block| BlockForm {
                cache: block
                    .cache
                    .map(|mark| mark.ttl.map_or("default", CacheTtl::as_str)),
                digest: block.digest.as_str(),
                id: block.id.as_deref(),
                state: match &block.state {
                    BlockState::Committed => "committed",
                    BlockState::Other(state) => state,
                },
            })
            .collect();
        Digest::of_sorted_serialization(&TurnForm {
            blocks,
            generation: self.generation.map(|generation| generation.0),
            id: self.id.as_deref(),
            revision: self.revision.map(|revision| revision.0),
            role: match self.role {
                RoleField::Known(role) => Some(role.as_str()),
                RoleField::Invalid => None,
            },
        })
    }
}

/// A tool declaration.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolDef {
    /// Tool name.
    pub name: String,
    /// Description for the model.
    pub description: Option<String>,
    /// JSON Schema of the arguments object.
    pub input_schema: Value,
    /// `sha256:` over the JCS form of `input_schema`.
    pub schema_digest: Digest,
    /// A prompt-cache breakpoint on this tool ([`CacheMark`]); not part of any digest.
    pub cache: Option<CacheMark>,
}

/// A decoded v1 conversation. Structural problems found while decoding are kept with it and
/// reported by the validator together with every other violation.
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    /// Conversation id.
    pub conversation_id: String,
    /// Current revision (the last committed turn's).
    pub revision: Revision,
    /// Declared tools.
    pub tools: Vec<ToolDef>,
    /// `sha256:` over the JCS form of the `tools` array as given, without the tools' `cache`
    /// breakpoints.
    pub toolset_digest: Digest,
    /// Turns in order.
    pub turns: Vec<Turn>,
    pub(crate) decode_violations: Vec<Violation>,
}

impl Conversation {
    /// Decode a parsed JSON document. Fails only when it is not a v1 file at all or breaks a
    /// limit; every other problem is kept for the validator.
    pub fn from_value(value: Value) -> Result<Conversation, Unreadable> {
        let Value::Object(mut top) = value else {
            return Err(Unreadable::NotV1("the document is not a JSON object".into()));
        };
        match top.get("format") {
            Some(Value::String(format)) if format == FORMAT_V1 => {}
            Some(other) => {
                return Err(Unreadable::NotV1(format!(
                    "format is {other}, expected \"{FORMAT_V1}\""
                )));
            }
            None => return Err(Unreadable::NotV1("the \"format\" field is missing".into())),
        }
        let mut decoder = Decoder {
            violations: Vec::new(),
            turn_id: None,
        };

        let conversation_id = match top.remove("conversation_id") {
            Some(Value::String(id)) if !id.is_empty() => id,
            _ => {
                decoder.structure(None, "conversation_id must be a non-empty string");
                String::new()
            }
        };
        let revision = match top.get("revision").and_then(Value::as_u64) {
            Some(revision) => Revision(revision),
            None => {
                decoder.structure(None, "revision must be a non-negative integer");
                Revision(0)
            }
        };
        let tools_value = top.remove("tools").unwrap_or(Value::Array(Vec::new()));
        let toolset_digest = Digest::of_value(&without_cache_marks(&tools_value));
        let tools = decoder.tools(tools_value)?;

        let turn_values = match top.remove("turns") {
            Some(Value::Array(turns)) => turns,
            _ => {
                decoder.structure(None, "turns must be an array");
                Vec::new()
            }
        };
        if turn_values.len() > limits::TURNS_MAX {
            return Err(Unreadable::Limit {
                what: "TURNS_MAX",
                actual: turn_values.len(),
                max: limits::TURNS_MAX,
            });
        }
        let mut blocks_total = 0usize;
        let mut turns = Vec::with_capacity(turn_values.len());
        for turn_value in turn_values {
            let turn = decoder.turn(turn_value)?;
            blocks_total += turn.blocks.len();
            if blocks_total > limits::BLOCKS_MAX {
                return Err(Unreadable::Limit {
                    what: "BLOCKS_MAX",
                    actual: blocks_total,
                    max: limits::BLOCKS_MAX,
                });
            }
            turns.push(turn);
        }
        if let Some(last) = turns.iter().rev().find_map(|turn| turn.revision) {
            if last > revision {
                decoder.turn_id = None;
                decoder.structure(
                    None,
                    &format!("conversation revision {revision} is below its last turn's revision {last}"),
                );
            }
        }
        Ok(Conversation {
            conversation_id,
            revision,
            tools,
            toolset_digest,
            turns,
            decode_violations: decoder.violations,
        })
    }

    /// Decode one more turn (a v1 turn object, as in the file's `turns` array) and append it
    /// as the conversation's revision `revision`: for a conversation that decoded without
    /// findings, the same result as decoding the whole file with that turn at the end and
    /// `revision` as its revision (`tests/it/push_turn.rs`), for the cost of the new turn (and a
    /// count of the blocks held, for `BLOCKS_MAX`).
    /// This is how a conversation kept in memory between dispatches takes the next turn
    /// (`docs/benchmarks.md`, "agent step"); validate it again before building a graph.
    /// `Err` (and nothing appended) when a limit breaks, as `from_value` would.
    pub fn push_turn(&mut self, turn: Value, revision: Revision) -> Result<PushedTurn, Unreadable> {
        if self.turns.len() >= limits::TURNS_MAX {
            return Err(Unreadable::Limit {
                what: "TURNS_MAX",
                actual: self.turns.len() + 1,
                max: limits::TURNS_MAX,
            });
        }
        let mut decoder = Decoder {
            violations: Vec::new(),
            turn_id: None,
        };
        let turn = decoder.turn(turn)?;
        let blocks_total: usize =
            self.turns.iter().map(|turn| turn.blocks.len()).sum::<usize>() + turn.blocks.len();
        if blocks_total > limits::BLOCKS_MAX {
            return Err(Unreadable::Limit {
                what: "BLOCKS_MAX",
                actual: blocks_total,
                max: limits::BLOCKS_MAX,
            });
        }
        let pushed = PushedTurn {
            revision_before: self.revision,
            violations_before: self.decode_violations.len(),
        };
        // `from_value` reports a last turn revision above the conversation's; the whole file
        // would be read with `revision` as its revision, so the same check runs against it.
        let revision_last = turn
            .revision
            .or_else(|| self.turns.iter().rev().find_map(|turn| turn.revision));
        if let Some(last) = revision_last
            && last > revision
        {
            decoder.turn_id = None;
            decoder.structure(
                None,
                &format!("conversation revision {revision} is below its last turn's revision {last}"),
            );
        }
        self.decode_violations.append(&mut decoder.violations);
        self.turns.push(turn);
        self.revision = revision;
        Ok(pushed)
    }

    /// Decode one turn on its own (a v1 turn object): the turn and its decode findings, as
    /// [`Conversation::push_turn`] decodes it. For a caller that keeps the validator's
    /// [`crate::validate::History`] instead of the conversation. The file's limits are the
    /// caller's to check (`History::counts`).
    pub fn decode_turn(turn: Value) -> Result<(Turn, Vec<Violation>), Unreadable> {
        let mut decoder = Decoder {
            violations: Vec::new(),
            turn_id: None,
        };
        let turn = decoder.turn(turn)?;
        Ok((turn, decoder.violations))
    }

    /// Take back the turn [`Conversation::push_turn`] appended (a turn the validator refused,
    /// or a benchmark's step), restoring the revision and the decode findings as they were.
    /// `pushed` must be the value of the last push not yet popped.
    pub fn pop_turn(&mut self, pushed: PushedTurn) -> Option<Turn> {
        let turn = self.turns.pop()?;
        self.revision = pushed.revision_before;
        self.decode_violations.truncate(pushed.violations_before);
        Some(turn)
    }

    /// The tool declaration of that name.
    pub fn tool(&self, name: &str) -> Option<&ToolDef> {
        self.tools.iter().find(|tool| tool.name == name)
    }
}

/// What [`Conversation::pop_turn`] needs to undo one [`Conversation::push_turn`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub struct PushedTurn {
    revision_before: Revision,
    violations_before: usize,
}

struct Decoder {
    violations: Vec<Violation>,
    turn_id: Option<String>,
}

/// Field errors inside one block: the message of the first problem.
type FieldResult<T> = Result<T, String>;

impl Decoder {
    fn push(&mut self, code: ViolationCode, block: Option<&str>, call_id: Option<&str>, message: String) {
        self.violations.push(Violation {
            code,
            turn: self.turn_id.clone(),
            block: block.map(str::to_owned),
            call_id: call_id.map(str::to_owned),
            message,
        });
    }

    fn structure(&mut self, block: Option<&str>, message: &str) {
        self.push(ViolationCode::InvalidStructure, block, None, message.to_owned());
    }

    fn tools(&mut self, value: Value) -> Result<Vec<ToolDef>, Unreadable> {
        let Value::Array(items) = value else {
            self.structure(None, "tools must be an array");
            return Ok(Vec::new());
        };
        if items.len() > limits::TOOLS_MAX {
            return Err(Unreadable::Limit {
                what: "TOOLS_MAX",
                actual: items.len(),
                max: limits::TOOLS_MAX,
            });
        }
        let mut tools: Vec<ToolDef> = Vec::with_capacity(items.len());
        for item in items {
            let Value::Object(mut map) = item else {
                self.structure(None, "a tool must be an object");
                continue;
            };
            let Some(Value::String(name)) = map.remove("name") else {
                self.structure(None, "a tool needs a string name");
                continue;
            };
            if tools.iter().any(|tool| tool.name == name) {
                self.structure(None, &format!("tool {name:?} is declared twice"));
                continue;
            }
            let description = match map.remove("description") {
                None | Some(Value::Null) => None,
                Some(Value::String(text)) => Some(text),
                Some(_) => {
                    self.structure(None, &format!("tool {name:?}: description must be a string"));
                    None
                }
            };
            let input_schema = match map.remove("input_schema") {
                None => Value::Object(Map::from_iter([("type".to_owned(), Value::from("object"))])),
                Some(schema @ Value::Object(_)) => schema,
                Some(_) => {
                    self.structure(None, &format!("tool {name:?}: input_schema must be an object"));
                    continue;
                }
            };
            let schema_digest = Digest::of_value(&input_schema);
            let cache = match cache_mark(map.remove(CACHE_FIELD)) {
                Ok(cache) => cache,
                Err(message) => {
                    self.structure(None, &format!("tool {name:?}: {message}"));
                    None
                }
            };
            tools.push(ToolDef {
                name,
                description,
                input_schema,
                schema_digest,
                cache,
            });
        }
        Ok(tools)
    }

    fn turn(&mut self, value: Value) -> Result<Turn, Unreadable> {
        self.turn_id = None;
        let Value::Object(mut map) = value else {
            self.structure(None, "a turn must be an object");
            return Ok(Turn {
                id: None,
                revision: None,
                role: RoleField::Invalid,
                generation: None,
                blocks: Vec::new(),
            });
        };
        let id = match map.remove("id") {
            Some(Value::String(id)) if !id.is_empty() => Some(id),
            _ => None,
        };
        self.turn_id = id.clone();
        if id.is_none() {
            self.structure(None, "a turn needs a non-empty string id");
        }
        let revision = match map.remove("revision") {
            None => None,
            Some(value) => match value.as_u64() {
                Some(revision) => Some(Revision(revision)),
                None => {
                    self.structure(None, "turn revision must be a non-negative integer");
                    None
                }
            },
        };
        let role = match map.remove("role") {
            Some(Value::String(role)) => match role_named(&role) {
                Some(role) => RoleField::Known(role),
                None => {
                    self.structure(None, &format!("unknown role {role:?}"));
                    RoleField::Invalid
                }
            },
            _ => {
                self.structure(None, "a turn needs a string role");
                RoleField::Invalid
            }
        };
        let generation = match map.remove("generation") {
            None | Some(Value::Null) => None,
            Some(value) => match value.as_u64() {
                Some(generation) => Some(Generation(generation)),
                None => {
                    self.structure(None, "turn generation must be a non-negative integer");
                    None
                }
            },
        };
        let block_values = match map.remove("blocks") {
            Some(Value::Array(blocks)) => blocks,
            _ => {
                self.structure(None, "a turn needs a blocks array");
                Vec::new()
            }
        };
        if block_values.len() > limits::BLOCKS_PER_TURN_MAX {
            return Err(Unreadable::Limit {
                what: "BLOCKS_PER_TURN_MAX",
                actual: block_values.len(),
                max: limits::BLOCKS_PER_TURN_MAX,
            });
        }
        if block_values.is_empty() {
            self.structure(None, "empty turn: a turn needs at least one block");
        }
        let blocks = block_values.into_iter().map(|block| self.block(block)).collect();
        Ok(Turn {
            id,
            revision,
            role,
            generation,
            blocks,
        })
    }

    fn block(&mut self, value: Value) -> Block {
        let Value::Object(mut map) = value else {
            self.structure(None, "a block must be an object");
            return Block {
                id: None,
                state: BlockState::Committed,
                digest: Digest::of_value(&value),
                body: BlockBody::Malformed,
                cache: None,
            };
        };
        let id = match map.remove("id") {
            Some(Value::String(id)) if !id.is_empty() => Some(id),
            _ => None,
        };
        if id.is_none() {
            self.structure(None, "a block needs a non-empty string id");
        }
        let state = match map.remove("state") {
            None => BlockState::Committed,
            Some(Value::String(state)) if state == "committed" => BlockState::Committed,
            Some(Value::String(state)) => BlockState::Other(state),
            Some(_) => {
                self.structure(id.as_deref(), "block state must be a string");
                BlockState::Other("<malformed>".into())
            }
        };
        let cache = match cache_mark(map.remove(CACHE_FIELD)) {
            Ok(cache) => cache,
            Err(message) => {
                self.structure(id.as_deref(), &message);
                None
            }
        };
        // The digest covers the content only: `id`, `state` and `cache` are already removed.
        let digest = Digest::of_map(&map);
        let body = match map.remove("kind") {
            Some(Value::String(kind)) => match block_body(&kind, map) {
                Ok(body) => body,
                Err(message) => {
                    self.structure(id.as_deref(), &format!("{kind} block: {message}"));
                    BlockBody::Malformed
                }
            },
            _ => {
                self.structure(id.as_deref(), "a block needs a string kind");
                BlockBody::Malformed
            }
        };
        Block {
            id,
            state,
            digest,
            body,
            cache,
        }
    }
}

/// The tools array with each tool's `cache` breakpoint taken out (what `toolset_digest` covers).
fn without_cache_marks(tools: &Value) -> std::borrow::Cow<'_, Value> {
    let Value::Array(items) = tools else {
        return std::borrow::Cow::Borrowed(tools);
    };
    if !items.iter().any(|tool| tool.get(CACHE_FIELD).is_some()) {
        return std::borrow::Cow::Borrowed(tools);
    }
    let mut items = items.clone();
    for tool in &mut items {
        if let Value::Object(map) = tool {
            map.remove(CACHE_FIELD);
        }
    }
    std::borrow::Cow::Owned(Value::Array(items))
}

fn block_body(kind: &str, mut map: Map<String, Value>) -> FieldResult<BlockBody> {
    Ok(match kind {
        "text" => BlockBody::Text {
            text: required_string(&mut map, "text")?,
        },
        "image" => BlockBody::Image {
            source: media_source(&mut map)?,
        },
        "tool_call" => {
            let call_id = call_id(&mut map)?;
            let tool = required_string(&mut map, "tool")?;
            let arguments = match map.remove("arguments") {
                Some(Value::Object(value)) => Arguments::from_object(value),
                Some(Value::String(text)) => Arguments::from_text(text),
                Some(other) => Arguments::Unclosed {
                    state: ArgState::Invalid,
                    raw: other.to_string(),
                },
                None => return Err("arguments are missing".into()),
            };
            BlockBody::ToolCall {
                call_id,
                tool,
                arguments,
            }
        }
        "tool_result" => {
            let call_id = call_id(&mut map)?;
            // A result without `tool` is well-formed but cannot be shown to match its call: the
            // validator reports `result_mismatch` (spec §1), so it decodes as the empty name,
            // which the validator refuses whatever the call is named.
            let tool = optional_string(&mut map, "tool")?.unwrap_or_default();
            let args_digest = match map.remove("args_digest") {
                None | Some(Value::Null) => None,
                Some(Value::String(text)) => {
                    Some(Digest::parse(&text).ok_or("args_digest must be sha256:<64 lowercase hex>")?)
                }
                Some(_) => return Err("args_digest must be a string".into()),
            };
            let generation = match map.remove("generation") {
                None | Some(Value::Null) => None,
                Some(value) => Some(Generation(
                    value
                        .as_u64()
                        .ok_or("generation must be a non-negative integer")?,
                )),
            };
            let status = required_string(&mut map, "status")?;
            let status = status_named(&status)
                .ok_or_else(|| format!("status {status:?} is not success, error or cancel"))?;
            let content = match map.remove("content") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(parts)) => {
                    parts.into_iter().map(result_part).collect::<FieldResult<_>>()?
                }
                Some(_) => return Err("content must be an array of parts".into()),
            };
            BlockBody::ToolResult {
                call_id,
                tool,
                args_digest,
                generation,
                status,
                content,
            }
        }
        "context" => {
            let text = required_string(&mut map, "text")?;
            let source = optional_string(&mut map, "source")?;
            let trust = optional_string(&mut map, "trust")?;
            let trust = trust_named(trust.as_deref()).ok_or_else(|| {
                format!(
                    "trust {:?} is not trusted or untrusted",
                    trust.unwrap_or_default()
                )
            })?;
            BlockBody::Context { source, trust, text }
        }
        "document" => {
            let source = media_source(&mut map)?;
            let title = optional_string(&mut map, "title")?;
            BlockBody::Document { source, title }
        }
        "reasoning" => {
            let provider = required_string(&mut map, "provider")?;
            let signature = optional_string(&mut map, "signature")?;
            let encrypted = optional_string(&mut map, "encrypted")?;
            let text = optional_string(&mut map, "text")?;
            if signature.is_none() && encrypted.is_none() {
                return Err("reasoning needs a signature or encrypted payload".into());
            }
            BlockBody::Reasoning {
                provider,
                signature,
                encrypted,
                text,
            }
        }
        other => BlockBody::Unknown {
            kind: other.to_owned(),
        },
    })
}

/// A v1 role by its name.
fn role_named(name: &str) -> Option<Role> {
    match name {
        "system" => Some(Role::System),
        "user" => Some(Role::User),
        "assistant" => Some(Role::Assistant),
        "tool" => Some(Role::Tool),
        _ => None,
    }
}

/// A tool result's status by its name.
fn status_named(name: &str) -> Option<ResultStatus> {
    match name {
        "success" => Some(ResultStatus::Success),
        "error" => Some(ResultStatus::Error),
        "cancel" => Some(ResultStatus::Cancel),
        _ => None,
    }
}

/// A context block's trust by its name (untrusted when absent).
fn trust_named(name: Option<&str>) -> Option<Trust> {
    match name {
        None | Some("untrusted") => Some(Trust::Untrusted),
        Some("trusted") => Some(Trust::Trusted),
        Some(_) => None,
    }
}

fn result_part(value: Value) -> FieldResult<ResultPart> {
    let Value::Object(mut map) = value else {
        return Err("a content part must be an object".into());
    };
    match required_string(&mut map, "kind")?.as_str() {
        "text" => Ok(ResultPart::Text(required_string(&mut map, "text")?)),
        "image" => Ok(ResultPart::Image(media_source(&mut map)?)),
        other => Err(format!("content part kind {other:?} is not text or image")),
    }
}

fn media_source(map: &mut Map<String, Value>) -> FieldResult<MediaSource> {
    let media_type = optional_string(map, "media_type")?;
    if let Some(url) = optional_string(map, "url")? {
        return Ok(MediaSource::Url { url, media_type });
    }
    let data = optional_string(map, "data")?.ok_or("needs data (base64) or url")?;
    let media_type = media_type.ok_or("inline data needs a media_type")?;
    Ok(MediaSource::Base64 { media_type, data })
}

fn call_id(map: &mut Map<String, Value>) -> FieldResult<CallId> {
    let id = required_string(map, "call_id")?;
    if id.is_empty() {
        return Err("call_id must not be empty".into());
    }
    Ok(CallId(id))
}

fn required_string(map: &mut Map<String, Value>, key: &str) -> FieldResult<String> {
    match map.remove(key) {
        Some(Value::String(text)) => Ok(text),
        Some(_) => Err(format!("{key} must be a string")),
        None => Err(format!("{key} is missing")),
    }
}

fn optional_string(map: &mut Map<String, Value>, key: &str) -> FieldResult<Option<String>> {
    match map.remove(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text)),
        Some(_) => Err(format!("{key} must be a string")),
    }
}
