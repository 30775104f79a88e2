//! The normalized, provider-neutral stream event: what every decoder in `turnstile-adapters`
//! emits and what the [`crate::assemble::Assembler`] consumes.
//!
//! A provider stream is a sequence of provider events (one SSE event each). A decoder turns each
//! into zero or more [`StreamEvent`]s, each tagged with a [`Seq`]: the provider's own sequence
//! number where the API has one (OpenAI Responses `sequence_number`), else the decoder's receive
//! ordinal of the provider event within its connection. The assembler dedupes on `Seq`, which
//! catches exactly this much: an event handed to it twice (a buffered event fed again, a
//! resumed connection replaying what was received), and, where the provider numbers its events
//! (Responses), a provider event sent twice on the wire. An event the provider (or anything
//! between) sends twice on a wire *without* sequence numbers gets a new receive ordinal and is
//! not a duplicate to the assembler; what the decoders catch of those instead (usage held
//! against the output on OpenAI Chat, a block index started or stopped twice on Anthropic,
//! Gemini's cumulative count) and what nobody can catch (an Anthropic text delta alone) is
//! listed in `turnstile-adapters/src/decode/mod.rs` and
//! `docs/decisions/0048-duplicated-deltas-on-wires-without-sequence-numbers.md` (2026-12-01).
//!
//! Block indices ([`BlockIndex`]) are keys chosen by the decoder from the provider's own keys
//! (Anthropic `index`, OpenAI Chat `tool_calls[].index`, Responses `output_index`), never array
//! positions: they only need to be stable and unique within one response. The committed turn
//! orders its blocks by this key, so parallel blocks that arrive interleaved or reordered still
//! give one canonical turn.

use serde::Serialize;

/// A block key within one provider response (see the module docs: a key, not a position).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct BlockIndex(pub u64);

/// Where an event's sequence number comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SeqSource {
    /// The provider's own, stable across a resumed connection (Responses `sequence_number`).
    Provider,
    /// The decoder's receive ordinal of the provider event on this connection.
    Receive,
}

/// The dedupe sequence of one normalized event: the provider event's number, and the position
/// of this normalized event among those decoded from that one provider event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Seq {
    /// Where `number` comes from.
    pub source: SeqSource,
    /// Provider sequence number or receive ordinal.
    pub number: u64,
    /// Position among the normalized events of one provider event.
    pub part: u32,
}

/// What kind of block starts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BlockStart {
    /// Visible text (previewed, revocable).
    Text,
    /// A tool call. Its arguments arrive as [`StreamEvent::ToolArgsDelta`] fragments and are
    /// never previewed.
    ToolCall {
        /// The provider's call id (`call_…`, `toolu_…`); `None` when the provider gave none.
        call_id: Option<String>,
        /// The tool's name.
        name: String,
    },
    /// Opaque, provider-affine reasoning (never previewed).
    Reasoning {
        /// `anthropic`, `openai` or `gemini`.
        provider: String,
    },
}

/// Why the provider says the response stopped, normalized across APIs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum StopReason {
    /// The model finished (`stop`, `end_turn`, `STOP`, Responses `completed`).
    EndTurn,
    /// The model stopped to call tools (`tool_calls`, `tool_use`).
    ToolUse,
    /// The output-token limit (`length`, `max_tokens`, `MAX_TOKENS`, `max_output_tokens`).
    MaxTokens,
    /// A stop sequence matched.
    StopSequence,
    /// A content or safety filter ended it.
    ContentFilter,
    /// The model refused.
    Refusal,
    /// Anything else, verbatim.
    Other(String),
}

/// One normalized stream event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
#[non_exhaustive]
pub enum StreamEvent {
    /// The provider's handle for this response (response id / message id), surfaced as soon as
    /// it appears.
    Handle {
        /// The id as the provider spells it.
        handle: String,
    },
    /// A block begins.
    BlockStart {
        /// Its key.
        index: BlockIndex,
        /// What it is.
        block: BlockStart,
    },
    /// A fragment of visible text.
    TextDelta {
        /// The block.
        index: BlockIndex,
        /// The fragment.
        text: String,
    },
    /// A fragment of a tool call's raw JSON arguments.
    ToolArgsDelta {
        /// The block.
        index: BlockIndex,
        /// The fragment.
        fragment: String,
    },
    /// A fragment of readable reasoning text (summary or thinking).
    ReasoningDelta {
        /// The block.
        index: BlockIndex,
        /// The fragment.
        text: String,
    },
    /// The opaque part of a reasoning block (Anthropic `signature`, Gemini `thoughtSignature`,
    /// OpenAI `encrypted_content`).
    ReasoningSeal {
        /// The block.
        index: BlockIndex,
        /// Signature, when the provider gave one.
        signature: Option<String>,
        /// Encrypted payload, when the provider gave one.
        encrypted: Option<String>,
    },
    /// A block is complete.
    BlockStop {
        /// The block.
        index: BlockIndex,
        /// The provider's own copy of the complete tool arguments, when it sends one
        /// (Responses `function_call_arguments.done`): the assembler checks its buffer against
        /// it, so a lost delta cannot commit.
        arguments_final: Option<String>,
    },
    /// The provider's stop signal, with its reason.
    Stop {
        /// Why.
        reason: StopReason,
    },
    /// The provider's end-of-stream marker (`[DONE]`, `message_stop`, the Responses terminal
    /// event, the Gemini chunk with `finishReason`). A turn is offered for commit only here,
    /// and only after [`StreamEvent::Stop`].
    End,
    /// Token usage as reported (field by field, the last report wins).
    Usage {
        /// Input tokens, when reported.
        input_tokens: Option<u64>,
        /// Output tokens, when reported.
        output_tokens: Option<u64>,
        /// Anthropic `cache_creation_input_tokens` (input written to the prompt cache, not
        /// counted in `input_tokens`), when reported.
        cache_creation_input_tokens: Option<u64>,
        /// Anthropic `cache_read_input_tokens` (input read from the prompt cache, not counted
        /// in `input_tokens`), when reported.
        cache_read_input_tokens: Option<u64>,
    },
    /// A provider event the decoder could not understand (not JSON, a required field missing,
    /// a content kind v1 cannot hold). The assembler retracts: it never guesses.
    Malformed {
        /// What was wrong.
        detail: String,
    },
    /// Something the decoder noticed that decides nothing about the turn: a heuristic that
    /// did not hold where the upstream need not follow the vendor (a usage count off the
    /// vendor's tokenizer). The driver counts and logs it; the assembler ignores it.
    Notice {
        /// A stable code for metrics (`usage_mismatch`).
        code: String,
        /// What was noticed.
        detail: String,
    },
    /// An error the provider sent inside the stream.
    ProviderError {
        /// The provider's error code or type (`overloaded_error`, `insufficient_quota`).
        code: String,
        /// The provider's message.
        message: String,
    },
}

impl StreamEvent {
    /// The block this event belongs to, if any.
    pub fn block_index(&self) -> Option<BlockIndex> {
        match self {
            StreamEvent::BlockStart { index, .. }
            | StreamEvent::TextDelta { index, .. }
            | StreamEvent::ToolArgsDelta { index, .. }
            | StreamEvent::ReasoningDelta { index, .. }
            | StreamEvent::ReasoningSeal { index, .. }
            | StreamEvent::BlockStop { index, .. } => Some(*index),
            _ => None,
        }
    }
}

/// A normalized event with its dedupe sequence.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Sequenced {
    /// Dedupe sequence.
    pub seq: Seq,
    /// The event.
    pub event: StreamEvent,
}
