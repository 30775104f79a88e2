//! The stream assembler: normalized stream events in, revocable text preview and at most one
//! whole assistant turn out.
//!
//! It owns the rule "preview is not history" (DESIGN.md): text deltas become
//! [`Output::Preview`]; tool arguments stay in a private buffer per block and are never shown;
//! a turn is offered for commit ([`Output::Commit`]) only after the provider's stop signal
//! *and* its end-of-stream marker, and only when every tool block stopped, parsed to a JSON
//! object, passed its tool's JSON Schema, and has a present, unique call id. Anything else ends
//! in exactly one [`Output::Retract`] that voids the generation's preview, with the reason.
//!
//! Inputs are deduplicated by (handle, generation, block index, delta sequence): handle and
//! generation are fixed per assembler (one assembler per dispatch attempt), block index and
//! sequence come with each event (see [`crate::stream`]). Input from another generation or
//! from a handle other than the bound one is never merged; it is handed back as quarantine
//! material in [`Disposition::Quarantined`].
//!
//! The assembler is sans-IO: no clock, no I/O, no randomness. Schemas are compiled once per
//! toolset digest ([`ToolsetCache`]) and shared by reference.

use crate::conversation::ToolDef;
use crate::digest::Digest;
use crate::ids::Generation;
use crate::limits;
use crate::stream::{BlockIndex, BlockStart, Seq, SeqSource, Sequenced, StopReason, StreamEvent};
use serde::Serialize;
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

/// Most blocks in one assembled turn (the same bound as a committed turn).
pub const ASSEMBLE_BLOCKS_MAX: usize = limits::BLOCKS_PER_TURN_MAX;
/// Most deltas accepted into one block.
pub const ASSEMBLE_DELTAS_PER_BLOCK_MAX: usize = 1 << 20;
/// Largest text, argument or reasoning buffer of one block, in bytes.
pub const ASSEMBLE_BLOCK_BYTES_MAX: usize = 16 * 1024 * 1024;
/// Largest assembled turn, all buffers together, in bytes (the size of a committable file).
pub const ASSEMBLE_TURN_BYTES_MAX: usize = limits::FILE_BYTES_MAX;
/// Most distinct dedupe keys remembered for one generation.
pub const ASSEMBLE_DEDUPE_KEYS_MAX: usize = 4 * 1024 * 1024;

/// A toolset whose JSON Schemas are compiled, keyed by its digest.
pub struct Toolset {
    digest: Digest,
    validators: HashMap<String, jsonschema::Validator>,
}

impl std::fmt::Debug for Toolset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<&String> = self.validators.keys().collect();
        names.sort();
        f.debug_struct("Toolset")
            .field("digest", &self.digest)
            .field("tools", &names)
            .finish()
    }
}

/// A toolset that cannot be compiled.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolsetError {
    /// The tools JSON is not an array of `{name, input_schema}` objects.
    #[error("malformed tools: {0}")]
    Malformed(String),
    /// A tool's `input_schema` is not a valid JSON Schema (or needs a remote `$ref`).
    #[error("tool {tool:?}: invalid input_schema: {detail}")]
    InvalidSchema {
        /// The tool.
        tool: String,
        /// The compiler's message.
        detail: String,
    },
    /// More tools than `limits::TOOLS_MAX`.
    #[error("limit exceeded: TOOLS_MAX is {max}")]
    TooMany {
        /// The limit.
        max: usize,
    },
}

impl Toolset {
    /// Compile the schemas of a decoded conversation's tools. `digest` is the conversation's
    /// `toolset_digest`.
    pub fn compile(digest: Digest, tools: &[ToolDef]) -> Result<Toolset, ToolsetError> {
        if tools.len() > limits::TOOLS_MAX {
            return Err(ToolsetError::TooMany {
                max: limits::TOOLS_MAX,
            });
        }
        let mut validators = HashMap::with_capacity(tools.len());
        for tool in tools {
            // Built without the crate's default features: a remote `$ref` cannot be fetched
            // and fails compilation here instead of reaching the network.
            let validator = jsonschema::validator_for(&tool.input_schema).map_err(|error| {
                ToolsetError::InvalidSchema {
                    tool: tool.name.clone(),
                    detail: error.to_string(),
                }
            })?;
            validators.insert(tool.name.clone(), validator);
        }
        Ok(Toolset { digest, validators })
    }

    /// Compile a bare tools array (`[{"name", "description"?, "input_schema"?}]`, the v1
    /// `tools` field), or an object holding one under `"tools"` (a whole v1 file).
    pub fn from_json(value: &Value) -> Result<Toolset, ToolsetError> {
        let array = match value {
            Value::Array(_) => value,
            Value::Object(map) => map
                .get("tools")
                .ok_or_else(|| ToolsetError::Malformed("an object without a \"tools\" array".into()))?,
            _ => return Err(ToolsetError::Malformed("not an array of tools".into())),
        };
        let Value::Array(items) = array else {
            return Err(ToolsetError::Malformed("\"tools\" is not an array".into()));
        };
        let mut tools = Vec::with_capacity(items.len());
        for item in items {
            let name = item
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| ToolsetError::Malformed("a tool needs a string name".into()))?;
            let input_schema = item
                .get("input_schema")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            tools.push(ToolDef {
                name: name.to_owned(),
                description: None,
                schema_digest: Digest::of_canonical(&input_schema),
                input_schema,
                cache: None,
            });
        }
        Toolset::compile(Digest::of_canonical(array), &tools)
    }

    /// The toolset digest this was compiled for.
    pub fn digest(&self) -> &Digest {
        &self.digest
    }

    fn check(&self, tool: &str, arguments: &Value) -> Result<(), RetractDetail> {
        let Some(validator) = self.validators.get(tool) else {
            return Err(RetractDetail::UnknownTool);
        };
        match validator.validate(arguments) {
            Ok(()) => Ok(()),
            // The schema location only: the validator's message quotes the instance, and tool
            // arguments are never shown before they commit.
            Err(error) => Err(RetractDetail::Schema(format!(
                "schema keyword {} failed",
                error.schema_path()
            ))),
        }
    }
}

enum RetractDetail {
    UnknownTool,
    Schema(String),
}

/// Compiled toolsets by digest, so a schema is compiled once per toolset however many
/// generations use it.
#[derive(Debug, Default)]
pub struct ToolsetCache {
    by_digest: HashMap<Digest, Arc<Toolset>>,
    compiles: u64,
}

impl ToolsetCache {
    /// An empty cache.
    pub fn new() -> ToolsetCache {
        ToolsetCache::default()
    }

    /// The compiled toolset for `digest`, compiling `tools` only on the first request.
    pub fn compiled(&mut self, digest: &Digest, tools: &[ToolDef]) -> Result<Arc<Toolset>, ToolsetError> {
        if let Some(toolset) = self.by_digest.get(digest) {
            return Ok(Arc::clone(toolset));
        }
        let toolset = Arc::new(Toolset::compile(digest.clone(), tools)?);
        self.compiles += 1;
        self.by_digest.insert(digest.clone(), Arc::clone(&toolset));
        Ok(toolset)
    }

    /// How many compilations this cache has performed.
    pub fn compiles(&self) -> u64 {
        self.compiles
    }
}

/// Why a generation's preview is void and nothing is committed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, thiserror::Error)]
#[serde(tag = "code", rename_all = "snake_case")]
#[non_exhaustive]
pub enum RetractReason {
    /// The input ended before the provider's stop signal and end-of-stream marker.
    #[error("cut stream: the input ended before the provider's stop signal and end marker")]
    CutStream,
    /// The provider ended the stream without a stop signal.
    #[error("missing stop: the stream ended without the provider's stop signal")]
    MissingStop,
    /// The output-token limit was hit while a tool call's arguments were still open.
    #[error("max_tokens inside the arguments of tool block {block}")]
    MaxTokensInToolArguments {
        /// The open block.
        block: u64,
    },
    /// A tool block was still open at the stop signal.
    #[error("tool block {block} never stopped")]
    UnclosedBlock {
        /// The open block.
        block: u64,
    },
    /// A tool call's arguments are not one complete JSON object.
    #[error("tool block {block}: arguments are not a complete JSON object ({state})")]
    InvalidArguments {
        /// The block.
        block: u64,
        /// `open` (cut JSON) or `invalid`.
        state: String,
    },
    /// The arguments do not satisfy the tool's `input_schema`.
    #[error("tool block {block}: arguments of {tool:?} fail its input_schema: {detail}")]
    SchemaViolation {
        /// The block.
        block: u64,
        /// The tool.
        tool: String,
        /// Which schema keyword failed (a schema location, never argument text; not API).
        detail: String,
    },
    /// The call names a tool the toolset does not declare.
    #[error("tool block {block}: unknown tool {tool:?}")]
    UnknownTool {
        /// The block.
        block: u64,
        /// The tool named.
        tool: String,
    },
    /// A tool call without a call id.
    #[error("tool block {block}: no call id")]
    MissingCallId {
        /// The block.
        block: u64,
    },
    /// A call id used twice (in this turn or in earlier history).
    #[error("duplicate call id {call_id:?}")]
    DuplicateCallId {
        /// The id.
        call_id: String,
    },
    /// The provider's final copy of the arguments differs from what the deltas assembled
    /// (a delta was lost).
    #[error("tool block {block}: assembled arguments differ from the provider's final copy")]
    ArgumentsMismatch {
        /// The block.
        block: u64,
    },
    /// Events that cannot belong to a well-formed stream (a delta for a block never started, a
    /// block started twice as different kinds, a delta after its block stopped).
    #[error("protocol violation: {detail}")]
    ProtocolViolation {
        /// What happened.
        detail: String,
    },
    /// The provider sent an error inside the stream.
    #[error("provider error {provider_code}: {message}")]
    ProviderError {
        /// The provider's code.
        provider_code: String,
        /// The provider's message.
        message: String,
    },
    /// A named limit was exceeded.
    #[error("limit exceeded: {what} is {max}")]
    LimitExceeded {
        /// The constant's name.
        what: &'static str,
        /// Its value.
        max: usize,
    },
    /// The provider stopped without any content that could be committed.
    #[error("empty turn: nothing to commit")]
    EmptyTurn,
}

impl RetractReason {
    /// The stable code string (API; messages are not).
    pub fn code(&self) -> &'static str {
        match self {
            RetractReason::CutStream => "cut_stream",
            RetractReason::MissingStop => "missing_stop",
            RetractReason::MaxTokensInToolArguments { .. } => "max_tokens_in_tool_arguments",
            RetractReason::UnclosedBlock { .. } => "unclosed_block",
            RetractReason::InvalidArguments { .. } => "invalid_arguments",
            RetractReason::SchemaViolation { .. } => "schema_violation",
            RetractReason::UnknownTool { .. } => "unknown_tool",
            RetractReason::MissingCallId { .. } => "missing_call_id",
            RetractReason::DuplicateCallId { .. } => "duplicate_call_id",
            RetractReason::ArgumentsMismatch { .. } => "arguments_mismatch",
            RetractReason::ProtocolViolation { .. } => "protocol_violation",
            RetractReason::ProviderError { .. } => "provider_error",
            RetractReason::LimitExceeded { .. } => "limit_exceeded",
            RetractReason::EmptyTurn => "empty_turn",
        }
    }
}

/// One committed tool call, as the tool-call ledger needs it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CommittedCall {
    /// The call id.
    pub call_id: String,
    /// The tool.
    pub tool: String,
    /// `sha256:` over the JCS form of the parsed arguments.
    pub args_digest: Digest,
}

/// A whole assistant turn, offered for the canonical commit.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CommitOffer {
    /// The generation that produced it.
    pub generation: Generation,
    /// The provider handle it came from.
    pub handle: Option<String>,
    /// The v1 assistant turn (`{"id","role":"assistant","generation","blocks"}`), without a
    /// revision: the store assigns that when the commit wins.
    pub turn: Value,
    /// Its tool calls, in block order.
    pub calls: Vec<CommittedCall>,
    /// The provider's stop reason.
    pub stop_reason: StopReason,
    /// The usage reported, if any: each field the last value the provider gave for it
    /// (reports may carry some fields only).
    pub usage: Option<Usage>,
}

/// The provider's token counts of one generation, cumulative, field by field as reported
/// (Anthropic's cache counters only when the provider sent them: never invented).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Input tokens (Anthropic: not counting the cache counters below).
    pub input_tokens: Option<u64>,
    /// Output tokens.
    pub output_tokens: Option<u64>,
    /// Input tokens written to the prompt cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_creation_input_tokens: Option<u64>,
    /// Input tokens read from the prompt cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_read_input_tokens: Option<u64>,
}

/// What the assembler asks the caller to do, in order.
#[derive(Clone, Debug, PartialEq)]
#[must_use]
pub enum Output {
    /// Show this text delta as revocable preview.
    Preview {
        /// The generation.
        generation: Generation,
        /// The block key.
        block_index: BlockIndex,
        /// The text.
        delta: String,
    },
    /// Void all preview of this generation; nothing of it is committed.
    Retract {
        /// The generation.
        generation: Generation,
        /// Why.
        reason: RetractReason,
    },
    /// Offer this turn for the canonical compare-and-set commit.
    Commit(Box<CommitOffer>),
}

/// Why input was not merged into the turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum QuarantineReason {
    /// It belongs to another generation (a late block of an older attempt, for one).
    OtherGeneration,
    /// It comes from a provider handle other than the one bound to this generation's manifest.
    ForeignHandle,
}

/// Input handed back unmerged, for the caller to store and count.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Quarantine {
    /// The generation the input claimed.
    pub generation: Generation,
    /// The handle it came from, when known.
    pub handle: Option<String>,
    /// Why it was not merged.
    pub reason: QuarantineReason,
    /// The event itself.
    pub event: Sequenced,
}

/// Why accepted-looking input changed nothing (an operating condition, counted).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum IgnoreReason {
    /// Its dedupe key was seen before (a duplicate or a resumed overlap).
    Duplicate,
    /// The generation already has its outcome (committed or retracted).
    AfterOutcome,
}

/// What became of one input.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub enum Disposition {
    /// Merged (outputs may be ready: poll them).
    Accepted,
    /// Changed nothing.
    Ignored(IgnoreReason),
    /// Not merged; the material is handed back.
    Quarantined(Box<Quarantine>),
}

/// Counters for metrics (`turnstile_late_blocks_total`, `turnstile_preview_retractions_total`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AssemblerStats {
    /// Events merged.
    pub accepted: u64,
    /// Events ignored as duplicates.
    pub duplicates: u64,
    /// Events ignored because the outcome was already decided.
    pub after_outcome: u64,
    /// Events quarantined.
    pub quarantined: u64,
    /// Preview outputs emitted.
    pub previews: u64,
}

/// How an assembler is set up for one generation.
#[derive(Clone, Debug)]
pub struct AssemblerConfig {
    /// The generation (dispatch attempt) this assembler belongs to.
    pub generation: Generation,
    /// The id the committed turn gets; block ids are `{turn_id}.{n}`.
    pub turn_id: String,
    /// The provider handle already bound to this generation's manifest (on a resume), if any.
    /// Otherwise the first handle seen is bound.
    pub handle_bound: Option<String>,
    /// The compiled toolset, or `None` to accept any tool name with any JSON-object arguments.
    pub toolset: Option<Arc<Toolset>>,
    /// Call ids already used in the conversation's history (they must stay unique).
    pub call_ids_taken: HashSet<String>,
}

impl AssemblerConfig {
    /// A config with no bound handle, no toolset and no prior call ids.
    pub fn new(generation: Generation, turn_id: impl Into<String>) -> AssemblerConfig {
        AssemblerConfig {
            generation,
            turn_id: turn_id.into(),
            handle_bound: None,
            toolset: None,
            call_ids_taken: HashSet::new(),
        }
    }
}

#[derive(Clone, Debug)]
enum BlockBody {
    Text(String),
    ToolCall {
        call_id: Option<String>,
        name: String,
        arguments: String,
        /// Parsed, checked and digested at stop.
        parsed: Option<Digest>,
    },
    Reasoning {
        provider: String,
        text: String,
        signature: Option<String>,
        encrypted: Option<String>,
    },
}

#[derive(Clone, Debug)]
struct Block {
    body: BlockBody,
    stopped: bool,
    deltas: usize,
}

/// Where a generation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Receiving.
    Open,
    /// A commit offer was emitted.
    Committed,
    /// A retract was emitted.
    Retracted,
}

/// Assembles one generation's stream into at most one whole assistant turn.
///
/// ```text
///            handle_event (deltas, blocks)
///   ┌────────┐ ─────────────────────────────┐
///   │  Open  │ ◀────────────────────────────┘
///   └────────┘
///      │ Stop, then End, and every tool block whole      ──▶ Committed (Output::Commit)
///      │ cut input, End without Stop, invalid block,
///      │ provider error, limit                            ──▶ Retracted (Output::Retract)
/// ```
///
/// Polling order: after every `handle_*` call, call [`Assembler::poll_output`] until it returns
/// `None`, and perform the outputs in that order (previews before the retract or commit that
/// follows them). The [`Disposition`] returned by [`Assembler::handle_event`] is immediate:
/// quarantine material is handed back there, never through `poll_output`. After `Committed` or
/// `Retracted` every further event is `Ignored(AfterOutcome)`.
///
/// `Clone` is a snapshot of the whole state (tests cut a stream at every byte with it).
#[derive(Clone, Debug)]
pub struct Assembler {
    config: AssemblerConfig,
    handle: Option<String>,
    /// True while the current connection is speaking for a handle other than the bound one.
    foreign: Option<String>,
    blocks: BTreeMap<BlockIndex, Block>,
    seen: SeenKeys,
    bytes_total: usize,
    stop: Option<StopReason>,
    usage: Option<Usage>,
    phase: Phase,
    outputs: VecDeque<Output>,
    stats: AssemblerStats,
}

impl Assembler {
    /// What this generation produced so far, as quarantine material (JSON): every block with
    /// its text or its arguments as received (never history: a block here is not whole, not
    /// checked, or from a response that may not be ours).
    pub fn material(&self) -> Value {
        let blocks: Vec<Value> = self
            .blocks
            .iter()
            .map(|(index, block)| {
                let mut entry = match &block.body {
                    BlockBody::Text(text) => json!({"kind": "text", "text": text}),
                    BlockBody::ToolCall {
                        call_id,
                        name,
                        arguments,
                        ..
                    } => {
                        json!({"kind": "tool_call", "call_id": call_id, "tool": name, "arguments": arguments})
                    }
                    BlockBody::Reasoning { provider, text, .. } => {
                        json!({"kind": "reasoning", "provider": provider, "text": text})
                    }
                };
                entry["index"] = json!(index.0);
                entry["stopped"] = json!(block.stopped);
                entry
            })
            .collect();
        json!({"generation": self.config.generation.0, "handle": self.handle, "blocks": blocks})
    }

    /// A new assembler for one generation.
    pub fn new(config: AssemblerConfig) -> Assembler {
        Assembler {
            handle: config.handle_bound.clone(),
            config,
            foreign: None,
            blocks: BTreeMap::new(),
            seen: SeenKeys::default(),
            bytes_total: 0,
            stop: None,
            usage: None,
            phase: Phase::Open,
            outputs: VecDeque::new(),
            stats: AssemblerStats::default(),
        }
    }

    /// The generation.
    pub fn generation(&self) -> Generation {
        self.config.generation
    }

    /// The bound provider handle, once known.
    pub fn handle(&self) -> Option<&str> {
        self.handle.as_deref()
    }

    /// Where this generation stands.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Counters.
    pub fn stats(&self) -> AssemblerStats {
        self.stats
    }

    /// A new provider connection begins for this generation (a resume): until it names a
    /// handle, its events are taken to speak for the bound handle.
    pub fn handle_connection_start(&mut self) {
        self.foreign = None;
    }

    /// The input is over (the connection closed, or the replay ended). If no outcome was
    /// reached, the generation is retracted as a cut stream.
    pub fn handle_end_of_input(&mut self) {
        if self.phase == Phase::Open {
            self.retract(RetractReason::CutStream);
        }
    }

    /// Feed one normalized event that claims `generation`.
    pub fn handle_event(&mut self, generation: Generation, input: Sequenced) -> Disposition {
        if generation != self.config.generation {
            return self.quarantine(generation, QuarantineReason::OtherGeneration, input);
        }
        if let StreamEvent::Handle { handle } = &input.event {
            match &self.handle {
                None => self.handle = Some(handle.clone()),
                Some(bound) if bound == handle => self.foreign = None,
                Some(_) => self.foreign = Some(handle.clone()),
            }
        }
        if self.foreign.is_some() {
            return self.quarantine(generation, QuarantineReason::ForeignHandle, input);
        }
        if self.phase != Phase::Open {
            self.stats.after_outcome += 1;
            return Disposition::Ignored(IgnoreReason::AfterOutcome);
        }
        if !self.seen.insert(input.event.block_index(), input.seq) {
            self.stats.duplicates += 1;
            return Disposition::Ignored(IgnoreReason::Duplicate);
        }
        if self.seen.len() > ASSEMBLE_DEDUPE_KEYS_MAX {
            self.retract(RetractReason::LimitExceeded {
                what: "ASSEMBLE_DEDUPE_KEYS_MAX",
                max: ASSEMBLE_DEDUPE_KEYS_MAX,
            });
            return Disposition::Accepted;
        }
        self.stats.accepted += 1;
        if let Err(reason) = self.apply(input.event) {
            self.retract(reason);
        }
        Disposition::Accepted
    }

    /// The next output, in the order the caller must perform them.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    fn quarantine(
        &mut self,
        generation: Generation,
        reason: QuarantineReason,
        event: Sequenced,
    ) -> Disposition {
        self.stats.quarantined += 1;
        let handle = match reason {
            QuarantineReason::ForeignHandle => self.foreign.clone(),
            QuarantineReason::OtherGeneration => None,
        };
        Disposition::Quarantined(Box::new(Quarantine {
            generation,
            handle,
            reason,
            event,
        }))
    }

    fn retract(&mut self, reason: RetractReason) {
        // Invariant: only an open generation reaches an outcome; our callers check the phase.
        assert_eq!(self.phase, Phase::Open, "a generation reaches one outcome only");
        self.phase = Phase::Retracted;
        // Free the private buffers at once: nothing of them may ever be used.
        self.blocks.clear();
        self.outputs.push_back(Output::Retract {
            generation: self.config.generation,
            reason,
        });
    }

    fn grow(&mut self, index: BlockIndex, added: usize) -> Result<&mut Block, RetractReason> {
        self.bytes_total += added;
        if self.bytes_total > ASSEMBLE_TURN_BYTES_MAX {
            return Err(RetractReason::LimitExceeded {
                what: "ASSEMBLE_TURN_BYTES_MAX",
                max: ASSEMBLE_TURN_BYTES_MAX,
            });
        }
        let block = self
            .blocks
            .get_mut(&index)
            .ok_or_else(|| RetractReason::ProtocolViolation {
                detail: format!("a delta for block {} that never started", index.0),
            })?;
        if block.stopped {
            return Err(RetractReason::ProtocolViolation {
                detail: format!("a delta for block {} after it stopped", index.0),
            });
        }
        block.deltas += 1;
        if block.deltas > ASSEMBLE_DELTAS_PER_BLOCK_MAX {
            return Err(RetractReason::LimitExceeded {
                what: "ASSEMBLE_DELTAS_PER_BLOCK_MAX",
                max: ASSEMBLE_DELTAS_PER_BLOCK_MAX,
            });
        }
        Ok(block)
    }

    fn apply(&mut self, event: StreamEvent) -> Result<(), RetractReason> {
        match event {
            StreamEvent::Handle { .. } => {}
            StreamEvent::BlockStart { index, block } => self.start(index, block)?,
            StreamEvent::TextDelta { index, text } => {
                let added = text.len();
                let block = self.grow(index, added)?;
                let BlockBody::Text(buffer) = &mut block.body else {
                    return Err(kind_mismatch(index, "text"));
                };
                buffer.push_str(&text);
                check_block_bytes(buffer.len())?;
                if !text.is_empty() {
                    self.stats.previews += 1;
                    self.outputs.push_back(Output::Preview {
                        generation: self.config.generation,
                        block_index: index,
                        delta: text,
                    });
                }
            }
            StreamEvent::ToolArgsDelta { index, fragment } => {
                let block = self.grow(index, fragment.len())?;
                let BlockBody::ToolCall { arguments, .. } = &mut block.body else {
                    return Err(kind_mismatch(index, "tool_call"));
                };
                arguments.push_str(&fragment);
                check_block_bytes(arguments.len())?;
            }
            StreamEvent::ReasoningDelta {
                index,
                text: fragment,
            } => {
                let block = self.grow(index, fragment.len())?;
                let BlockBody::Reasoning { text, .. } = &mut block.body else {
                    return Err(kind_mismatch(index, "reasoning"));
                };
                text.push_str(&fragment);
                check_block_bytes(text.len())?;
            }
            StreamEvent::ReasoningSeal {
                index,
                signature: signature_new,
                encrypted: encrypted_new,
            } => {
                let added = signature_new.as_ref().map_or(0, String::len)
                    + encrypted_new.as_ref().map_or(0, String::len);
                let block = self.grow(index, added)?;
                let BlockBody::Reasoning {
                    signature, encrypted, ..
                } = &mut block.body
                else {
                    return Err(kind_mismatch(index, "reasoning"));
                };
                if signature_new.is_some() {
                    *signature = signature_new;
                }
                if encrypted_new.is_some() {
                    *encrypted = encrypted_new;
                }
            }
            StreamEvent::BlockStop {
                index,
                arguments_final,
            } => self.stop_block(index, arguments_final)?,
            StreamEvent::Stop { reason } => self.stop_turn(reason)?,
            StreamEvent::End => self.end()?,
            StreamEvent::Usage {
                input_tokens,
                output_tokens,
                cache_creation_input_tokens,
                cache_read_input_tokens,
            } => {
                // Field by field: Anthropic reports input tokens in `message_start` and only
                // output tokens in `message_delta`; a later report refines, never erases.
                let last = self.usage.unwrap_or_default();
                self.usage = Some(Usage {
                    input_tokens: input_tokens.or(last.input_tokens),
                    output_tokens: output_tokens.or(last.output_tokens),
                    cache_creation_input_tokens: cache_creation_input_tokens
                        .or(last.cache_creation_input_tokens),
                    cache_read_input_tokens: cache_read_input_tokens.or(last.cache_read_input_tokens),
                });
            }
            StreamEvent::Malformed { detail } => return Err(RetractReason::ProtocolViolation { detail }),
            StreamEvent::Notice { .. } => {}
            StreamEvent::ProviderError { code, message } => {
                return Err(RetractReason::ProviderError {
                    provider_code: code,
                    message,
                });
            }
        }
        Ok(())
    }

    fn start(&mut self, index: BlockIndex, start: BlockStart) -> Result<(), RetractReason> {
        if self.stop.is_some() {
            return Err(RetractReason::ProtocolViolation {
                detail: format!("block {} started after the stop signal", index.0),
            });
        }
        if self.blocks.contains_key(&index) {
            return Err(RetractReason::ProtocolViolation {
                detail: format!("block {} started twice", index.0),
            });
        }
        if self.blocks.len() >= ASSEMBLE_BLOCKS_MAX {
            return Err(RetractReason::LimitExceeded {
                what: "ASSEMBLE_BLOCKS_MAX",
                max: ASSEMBLE_BLOCKS_MAX,
            });
        }
        let body = match start {
            BlockStart::Text => BlockBody::Text(String::new()),
            BlockStart::ToolCall { call_id, name } => BlockBody::ToolCall {
                call_id,
                name,
                arguments: String::new(),
                parsed: None,
            },
            BlockStart::Reasoning { provider } => BlockBody::Reasoning {
                provider,
                text: String::new(),
                signature: None,
                encrypted: None,
            },
        };
        self.blocks.insert(
            index,
            Block {
                body,
                stopped: false,
                deltas: 0,
            },
        );
        Ok(())
    }

    fn stop_block(
        &mut self,
        index: BlockIndex,
        arguments_final: Option<String>,
    ) -> Result<(), RetractReason> {
        let toolset = self.config.toolset.clone();
        let block = self
            .blocks
            .get_mut(&index)
            .ok_or_else(|| RetractReason::ProtocolViolation {
                detail: format!("block {} stopped but never started", index.0),
            })?;
        if block.stopped {
            // The same stop delivered under a new sequence (Responses sends two: the arguments
            // `.done` and the item `.done`). Nothing changes.
            return Ok(());
        }
        block.stopped = true;
        let BlockBody::ToolCall {
            call_id,
            name,
            arguments,
            parsed,
        } = &mut block.body
        else {
            return Ok(());
        };
        if let Some(final_copy) = arguments_final
            && final_copy != *arguments
        {
            return Err(RetractReason::ArgumentsMismatch { block: index.0 });
        }
        // An empty argument string means "no arguments": `{}` (provider-rules.md §0 rule 7).
        let text = if arguments.trim().is_empty() {
            "{}"
        } else {
            arguments.as_str()
        };
        let (object, digest) = match parse_object(text) {
            Ok(parsed) => parsed,
            Err(state) => {
                return Err(RetractReason::InvalidArguments {
                    block: index.0,
                    state: state.into(),
                });
            }
        };
        if let Some(toolset) = toolset {
            let value = Value::Object(object);
            match toolset.check(name, &value) {
                Ok(()) => {}
                Err(RetractDetail::UnknownTool) => {
                    return Err(RetractReason::UnknownTool {
                        block: index.0,
                        tool: name.clone(),
                    });
                }
                Err(RetractDetail::Schema(detail)) => {
                    return Err(RetractReason::SchemaViolation {
                        block: index.0,
                        tool: name.clone(),
                        detail,
                    });
                }
            }
        }
        *parsed = Some(digest);
        match call_id.as_deref() {
            None | Some("") => Err(RetractReason::MissingCallId { block: index.0 }),
            Some(_) => Ok(()),
        }
    }

    fn stop_turn(&mut self, reason: StopReason) -> Result<(), RetractReason> {
        if self.stop.is_some() {
            return Ok(());
        }
        for (index, block) in &self.blocks {
            if block.stopped || !matches!(block.body, BlockBody::ToolCall { .. }) {
                continue;
            }
            return Err(if reason == StopReason::MaxTokens {
                RetractReason::MaxTokensInToolArguments { block: index.0 }
            } else {
                RetractReason::UnclosedBlock { block: index.0 }
            });
        }
        self.stop = Some(reason);
        Ok(())
    }

    fn end(&mut self) -> Result<(), RetractReason> {
        let Some(stop_reason) = self.stop.clone() else {
            return Err(RetractReason::MissingStop);
        };
        let turn_id = self.config.turn_id.clone();
        let mut blocks_json = Vec::with_capacity(self.blocks.len());
        let mut calls = Vec::new();
        let mut call_ids_turn: HashSet<&str> = HashSet::new();
        for block in self.blocks.values() {
            let id = format!("{turn_id}.{}", blocks_json.len() + 1);
            match &block.body {
                BlockBody::Text(text) => {
                    // An empty text block carries nothing (Gemini closes with `text:""`).
                    if !text.is_empty() {
                        blocks_json.push(json!({"id": id, "kind": "text", "text": text}));
                    }
                }
                BlockBody::ToolCall {
                    call_id,
                    name,
                    arguments,
                    parsed,
                } => {
                    // Invariant: `stop_turn` refused a stop with an open tool block, and a
                    // stopped tool block has `parsed` set or the generation was retracted.
                    let args_digest = parsed.clone().expect("a stopped tool block is parsed");
                    let call_id = call_id.as_deref().unwrap_or_default();
                    if self.config.call_ids_taken.contains(call_id) || !call_ids_turn.insert(call_id) {
                        return Err(RetractReason::DuplicateCallId {
                            call_id: call_id.to_owned(),
                        });
                    }
                    let arguments_json = if arguments.trim().is_empty() {
                        Value::Object(Map::new())
                    } else {
                        Value::String(arguments.clone())
                    };
                    calls.push(CommittedCall {
                        call_id: call_id.to_owned(),
                        tool: name.clone(),
                        args_digest,
                    });
                    blocks_json.push(json!({"id": id, "kind": "tool_call", "call_id": call_id,
                                            "tool": name, "arguments": arguments_json}));
                }
                BlockBody::Reasoning {
                    provider,
                    text,
                    signature,
                    encrypted,
                } => {
                    // v1 reasoning is replayable opaque state: without a signature or an
                    // encrypted payload there is nothing a provider would accept back.
                    if signature.is_none() && encrypted.is_none() {
                        continue;
                    }
                    let mut map = Map::new();
                    map.insert("id".into(), id.into());
                    map.insert("kind".into(), "reasoning".into());
                    map.insert("provider".into(), provider.clone().into());
                    if let Some(signature) = signature {
                        map.insert("signature".into(), signature.clone().into());
                    }
                    if let Some(encrypted) = encrypted {
                        map.insert("encrypted".into(), encrypted.clone().into());
                    }
                    if !text.is_empty() {
                        map.insert("text".into(), text.clone().into());
                    }
                    blocks_json.push(Value::Object(map));
                }
            }
        }
        if blocks_json.is_empty() {
            return Err(RetractReason::EmptyTurn);
        }
        let turn = json!({
            "id": turn_id,
            "role": "assistant",
            "generation": self.config.generation.0,
            "blocks": blocks_json,
        });
        let offer = CommitOffer {
            generation: self.config.generation,
            handle: self.handle.clone(),
            turn,
            calls,
            stop_reason,
            usage: self.usage,
        };
        self.phase = Phase::Committed;
        self.blocks.clear();
        self.outputs.push_back(Output::Commit(Box::new(offer)));
        Ok(())
    }
}

fn kind_mismatch(index: BlockIndex, wanted: &str) -> RetractReason {
    RetractReason::ProtocolViolation {
        detail: format!("a {wanted} delta for block {} of another kind", index.0),
    }
}

fn check_block_bytes(len: usize) -> Result<(), RetractReason> {
    if len > ASSEMBLE_BLOCK_BYTES_MAX {
        return Err(RetractReason::LimitExceeded {
            what: "ASSEMBLE_BLOCK_BYTES_MAX",
            max: ASSEMBLE_BLOCK_BYTES_MAX,
        });
    }
    Ok(())
}

/// Parse tool arguments with the same rules as committed history (`Arguments::from_text`:
/// depth limit, object only), returning `open` or `invalid` on failure.
fn parse_object(text: &str) -> Result<(Map<String, Value>, Digest), &'static str> {
    use crate::conversation::{ArgState, Arguments};
    match Arguments::from_text(text.to_owned()) {
        Arguments::Closed { value, digest, .. } => Ok((value, digest)),
        Arguments::Unclosed { state, .. } => Err(match state {
            ArgState::Open => "open",
            _ => "invalid",
        }),
    }
}

/// The dedupe keys seen: a set of (block index, sequence). Decoders number events in the
/// order they arrive, so nearly every key is above every key seen before in its lane (block
/// index and sequence source): those are appended to the lane's sorted list, with no hashing
/// and no rehash of a table that grows by one entry per event (a sixth of the assembler's time
/// on a 100k-event stream). A key at or below its lane's last is looked up in that list, and
/// one that is new there is kept in a hash set beside it (out of order: a resumed overlap, a
/// provider's reordering). A key is in the set exactly when it is in its lane's list or in that
/// hash set: a key that went to the hash set was below its lane's last, which only grows, so
/// it can never be appended to the list as well.
#[derive(Clone, Debug, Default)]
struct SeenKeys {
    lanes: HashMap<Lane, Vec<(u64, u32)>, BuildHasherDefault<SeqHasher>>,
    out_of_order: HashSet<(Option<BlockIndex>, Seq), BuildHasherDefault<SeqHasher>>,
    len: usize,
}

/// A dedupe lane: the block index and where the sequence numbers come from.
type Lane = (Option<BlockIndex>, SeqSource);

impl SeenKeys {
    /// Add a key: `false` if it was already there.
    fn insert(&mut self, block: Option<BlockIndex>, seq: Seq) -> bool {
        let lane = self.lanes.entry((block, seq.source)).or_default();
        let key = (seq.number, seq.part);
        let new = match lane.last() {
            Some(last) if key <= *last => {
                lane.binary_search(&key).is_err() && self.out_of_order.insert((block, seq))
            }
            _ => {
                lane.push(key);
                true
            }
        };
        self.len += usize::from(new);
        new
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// The dedupe set's hasher: keys are small integers chosen by decoders from provider input, so
/// a multiply-rotate mix (the Fx hash of rustc) is enough. It is keyed by nothing secret: a
/// hostile provider could only make its own generation's dedupe slower, and the set is bounded
/// by `ASSEMBLE_DEDUPE_KEYS_MAX`.
#[derive(Clone, Copy, Default)]
struct SeqHasher(u64);

impl Hasher for SeqHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u8(&mut self, value: u8) {
        self.write_u64(u64::from(value));
    }

    fn write_u32(&mut self, value: u32) {
        self.write_u64(u64::from(value));
    }

    fn write_usize(&mut self, value: usize) {
        self.write_u64(value as u64);
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = (self.0.rotate_left(5) ^ value).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Keys the way decoders make them: mostly rising per lane, with repeats (duplicates) and
    /// keys from the past (resumed overlaps) mixed in.
    fn keys() -> impl Strategy<Value = Vec<(Option<u64>, bool, u64, u32)>> {
        prop::collection::vec(
            (
                prop::option::of(0u64..4),
                any::<bool>(),
                prop_oneof![4 => Just(None), 1 => (0u64..40).prop_map(Some)],
                0u32..3,
            ),
            0..200,
        )
        .prop_map(|steps| {
            let mut next = 0u64;
            steps
                .into_iter()
                .map(|(block, provider, back, part)| {
                    let number = match back {
                        None => {
                            next += 1;
                            next
                        }
                        Some(back) => next.saturating_sub(back),
                    };
                    (block, provider, number, part)
                })
                .collect()
        })
    }

    proptest! {
        #[test]
        fn the_dedupe_keys_are_a_set(keys in keys()) {
            let mut seen = SeenKeys::default();
            let mut set = std::collections::HashSet::new();
            for (block, provider, number, part) in keys {
                let seq = Seq {
                    source: if provider { SeqSource::Provider } else { SeqSource::Receive },
                    number,
                    part,
                };
                let block = block.map(BlockIndex);
                prop_assert_eq!(seen.insert(block, seq), set.insert((block, seq)));
                prop_assert_eq!(seen.len(), set.len());
            }
        }
    }
}
