//! What every renderer shares: the render entry point, its outcome types, the placement plan
//! (results gathered per assistant turn), the fragment cache and the JSON writer.
//!
//! Renderers write the request body by hand into one byte buffer, as a sequence of
//! *fragments*. A fragment is the rendered JSON of one block (or of the tool list) and is a
//! pure function of (adapter, tokenizer, fragment tag, block content digest): call-id mapping
//! is a pure function of the id, and nothing about a block's neighbours goes into its own
//! fragment. So fragments and their token counts are cached by block digest
//! ([`RenderCache`]), and rendering turn N+1 costs work for the new turn plus a copy of the
//! cached bytes. Output never goes through `serde_json::Value` maps, so the bytes do not depend
//! on serde_json's `preserve_order` feature; values we do not own (tool schemas, argument
//! objects without raw text) are written in RFC 8785 canonical form.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a request digest is SHA-256 of the exact body, whatever the cache resumed from; an agent step
//!   hashes from the chunk where its body parts from the last one. Enforced in
//!   `adapters/src/render.rs` (`BodyMemos`: bytes compared, never assumed), `prepare.rs`. Tests:
//!   `adapters/tests/it/render_step.rs` (property over arbitrary edits of two conversations and two
//!   adapters; every step of every scenario on every adapter equals a cold prepare; hashed bytes
//!   from the parting chunk; red with the comparison skipped or always failing).
//! - a kept conversation's render goes on from the state kept at the last segment start of its last
//!   render, and gives exactly what a whole render of the same turns gives (body, tokens, policy,
//!   pauses); it resumes only when the turn before that point has the same stamp, the options are
//!   the same and the new turns need nothing the kept part depends on (no system turn towards
//!   Anthropic, no rewritten call id). Enforced in `adapters/src/render.rs` (`ResumeMemos`, one
//!   state per adapter, model and conversation; `resumable`, `Ctx::begin`/`segment_start`), each
//!   renderer's fold, `cache.rs::plan`, `core/src/kept.rs::turn_stamps`. Tests:
//!   `adapters/tests/it/render_resume.rs` (property against cold prepares over random conversations
//!   with marks, rewritten ids, detours and pops on every adapter; red with the stamp check skipped
//!   or the kept cache key dropped; its late system turns are rejected by the validator, so the
//!   Anthropic system-turn fallback is not exercised (review,
//!   docs/decisions/0087-a-kept-conversations-render-goes-on-from-where-the-last.md); a 60-step
//!   loop looks up the same ≤ 8 fragments each step; two models on one adapter each resume, bodies
//!   equal to cold prepares, red with the state keyed without the model), `render_step.rs` (every
//!   scenario step), `core/tests/it/kept.rs::turn_stamps_name_the_turns_they_were_given_to`,
//!   `gateway/tests/it/serve.rs::an_agent_loop_reads_only_the_new_turns_and_sends_what_a_fresh_replica_sends`
//!   (`turnstile_renders_total`: whole, whole, resumed; bytes equal a fresh replica's).

use crate::cache::CachePolicy;
use crate::call_ids::{self, CallIdRule};
use crate::output_format::{OutputFormat, OutputFormatError};
use crate::passthrough::{Passthrough, PassthroughError};
use crate::registry::AdapterId;
use crate::sampling::{Sampling, SamplingError};
use crate::tokens::Tokenizer;
use crate::tool_choice::{ToolChoice, ToolChoiceError};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use turnstile_core::conversation::{Block, BlockBody, Conversation, MediaSource, Role, RoleField, Turn};
use turnstile_core::{CallId, Digest, KeptConversation, MessageSequence, Validated};

/// Format string of the render policy document.
pub const POLICY_FORMAT_V1: &str = "turnstile.render-policy.v1";

/// Request parameters that are not part of the conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderOptions {
    /// Model name (in the body, or in the path for Gemini).
    pub model: String,
    /// Output cap sent in the API's own field.
    pub max_output_tokens: u64,
    /// Whether to ask for a streamed response (the gateway always streams upstream).
    pub stream: bool,
    /// OpenAI Responses only: run in background mode, so an interrupted stream can be resumed
    /// by its response id with `starting_after` (ignored by every other API).
    pub background: bool,
    /// Generation settings, written in the API's own fields; one the API cannot take refuses
    /// the render ([`RenderOutcome::Refused`]). The default (nothing set) writes nothing.
    pub sampling: Sampling,
    /// Tool choice and parallel tool calls, written in the API's own fields; one the API cannot
    /// spell refuses the render ([`RenderOutcome::RefusedToolChoice`]). The default writes
    /// nothing.
    pub tool_choice: ToolChoice,
    /// Structured output, written in the API's own fields; one the API cannot spell refuses
    /// the render ([`RenderOutcome::RefusedOutputFormat`]). The default writes nothing.
    pub output_format: OutputFormat,
    /// Fields only the client's own API takes (`passthrough.rs`): written as given when the
    /// adapter speaks that API, refused by name ([`RenderOutcome::RefusedPassthrough`]) when it
    /// does not. The default writes nothing.
    pub passthrough: Passthrough,
    /// OpenAI Chat only: how a message whose parts are all text carries them (an array of
    /// parts by default). Set per provider; every other API ignores it.
    pub text_content: TextContent,
}

/// How an OpenAI Chat message whose parts are all text carries them. Both forms are legal
/// OpenAI (`ChatCompletionRequestUserMessage.content` is a string or an array of parts);
/// minimal compatible servers take only the string. A message with an image or a file keeps
/// its array either way, and the policy records the choice ([`RenderPolicy::text_content`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TextContent {
    /// An array of `text` parts, one per block (what the adapter always wrote).
    #[default]
    Parts,
    /// One string: the texts of the message's blocks joined by a newline.
    String,
}

impl TextContent {
    /// Whether this is the default ([`TextContent::Parts`]).
    pub fn is_parts(&self) -> bool {
        *self == TextContent::Parts
    }
}

/// A validated, non-waiting conversation together with its `MessageSequence`. Only this type
/// can be rendered: the graph is ready by construction.
#[derive(Clone, Copy, Debug)]
pub struct Graph<'a> {
    conversation: &'a Conversation,
    sequence: &'a MessageSequence,
    /// The turn stamps of a kept conversation ([`Graph::kept`]): a render resumes from the
    /// state it kept after the same turns ([`RenderCache`], "resume").
    stamps: Option<&'a [u64]>,
}

/// Why a validated conversation cannot be rendered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotRenderable {
    /// Tool results are pending: no request is built.
    #[error("waiting for tool results: {pending:?}")]
    Waiting {
        /// Unanswered call ids, in call order.
        pending: Vec<CallId>,
    },
    /// The sequence was built from another conversation or revision.
    #[error("the message sequence does not belong to this conversation revision")]
    SequenceMismatch,
}

impl<'a> Graph<'a> {
    /// Pair a validated conversation with the sequence built from it.
    pub fn new(validated: Validated<'a>, sequence: &'a MessageSequence) -> Result<Graph<'a>, NotRenderable> {
        let conversation = validated.conversation();
        if validated.is_waiting() {
            let pending = sequence
                .edges
                .iter()
                .filter(|edge| edge.result.is_none())
                .map(|edge| edge.call_id.clone())
                .collect();
            return Err(NotRenderable::Waiting { pending });
        }
        let block_count: usize = conversation.turns.iter().map(|turn| turn.blocks.len()).sum();
        if sequence.conversation_id != conversation.conversation_id
            || sequence.revision != conversation.revision
            || sequence.blocks.len() != block_count
        {
            return Err(NotRenderable::SequenceMismatch);
        }
        Ok(Graph {
            conversation,
            sequence,
            stamps: None,
        })
    }

    /// The graph of a kept conversation, `None` when it is rejected. Renders of it resume
    /// from the render state kept after its earlier turns (their stamps say they are the same
    /// turns, `KeptConversation::turn_stamps`), so a step renders the new turns only.
    pub fn kept(kept: &'a KeptConversation) -> Option<Result<Graph<'a>, NotRenderable>> {
        let (validated, sequence) = kept.graph_parts()?;
        Some(Graph::new(validated, sequence).map(|graph| Graph {
            stamps: Some(kept.turn_stamps()),
            ..graph
        }))
    }

    /// The conversation.
    pub fn conversation(&self) -> &'a Conversation {
        self.conversation
    }

    /// The message sequence.
    pub fn sequence(&self) -> &'a MessageSequence {
        self.sequence
    }
}

/// Why a conversation is paused for an adapter: something in it this adapter version cannot
/// represent. Never rendered lossily instead.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Pause {
    /// The block concerned (None for a rule about the whole request).
    pub block: Option<String>,
    /// Its v1 kind (or part, e.g. `tool_result.image`).
    pub kind: String,
    /// Machine-readable reason.
    pub reason: PauseReason,
}

/// Reason codes of a pause.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum PauseReason {
    /// The adapter version does not represent this block kind.
    UnrepresentableKind,
    /// The kind is representable but this part or source of it is not.
    UnrepresentablePart,
    /// Mapping a call id for this API collided with another id of the conversation.
    CallIdCollision,
    /// The sequence has a shape the API cannot express (e.g. Gemini ending on a model turn).
    UnrepresentableSequence,
}

/// One call id rewritten for the target API.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CallIdMapping {
    /// Our id (in the conversation and the ledger).
    pub call_id: String,
    /// The id sent to the provider.
    pub provider_call_id: String,
}

/// One block left out of the request, with the reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Omission {
    /// Block id.
    pub block: String,
    /// Its kind (`reasoning`; `text` for an empty text block an API rejects).
    pub kind: &'static str,
    /// Provider that produced it (empty for non-reasoning blocks).
    pub provider: String,
    /// Why.
    pub reason: &'static str,
}

/// The rendering policy of one request: everything a reader of the manifest needs to know
/// about choices the adapter made that are not visible in the graph. The manifest's
/// `policy_digest` is the digest of this document; it is stored beside the manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RenderPolicy {
    /// Always [`POLICY_FORMAT_V1`].
    pub format: &'static str,
    /// Adapter id.
    pub adapter: AdapterId,
    /// Whether the request asks for a stream.
    pub stream: bool,
    /// How context blocks were wrapped.
    pub context_wrapping: &'static str,
    /// Call ids rewritten to satisfy the API's id rules.
    pub call_ids: Vec<CallIdMapping>,
    /// Blocks omitted (foreign or non-replayable reasoning).
    pub omitted: Vec<Omission>,
    /// The generation settings sent, in neutral names (left out of the document when none is
    /// set, so a request without settings has the policy digest it always had).
    #[serde(skip_serializing_if = "Sampling::is_unset")]
    pub sampling: Sampling,
    /// The tool choice and parallel switch sent, in neutral names (`tool_choice`,
    /// `parallel_tool_calls`), flattened beside the other fields and left out when unset, so a
    /// request without them has the policy digest it always had.
    #[serde(flatten)]
    pub tool_choice: ToolChoice,
    /// The structured output asked for, in neutral names (left out when unset).
    #[serde(skip_serializing_if = "OutputFormat::is_unset")]
    pub output_format: OutputFormat,
    /// The client-API-only fields (left out when there are none).
    #[serde(skip_serializing_if = "Passthrough::is_unset")]
    pub passthrough: Passthrough,
    /// The conversation's prompt-cache breakpoints and the `prompt_cache_key` derived from
    /// them (`cache.rs`; left out when there are none). Breakpoints are outside every content
    /// digest, so this is where the manifest pins them.
    #[serde(skip_serializing_if = "CachePolicy::is_unset")]
    pub cache: CachePolicy,
    /// How all-text Chat messages carried their text (left out when it is the default array
    /// of parts, so such a request has the policy digest it always had).
    #[serde(skip_serializing_if = "TextContent::is_parts")]
    pub text_content: TextContent,
}

impl RenderPolicy {
    /// `sha256:` over the canonical form of the policy.
    pub fn digest(&self) -> Digest {
        Digest::of_canonical(self)
    }
}

/// A rendered request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    /// Exact body bytes.
    pub body: Vec<u8>,
    /// HTTP method.
    pub method: &'static str,
    /// Path and query, relative to the provider's base URL.
    pub path: String,
    /// Non-secret headers. Credentials are added by the transport and never appear here.
    pub headers: Vec<(&'static str, &'static str)>,
    /// Admission count of the body, tool definitions included.
    pub prompt_tokens: u64,
    /// The policy (call-id mapping, omissions).
    pub policy: RenderPolicy,
}

/// The outcome of rendering.
#[derive(Clone, Debug, PartialEq)]
#[must_use]
// `Rendered` is the common outcome; boxing it would cost an allocation on every render to
// shrink the rare ones.
#[allow(clippy::large_enum_variant)]
pub enum RenderOutcome {
    /// The request.
    Rendered(Rendered),
    /// Every block (or rule) the adapter cannot represent.
    Paused(Vec<Pause>),
    /// A generation setting the API cannot take (no field for it, or a value outside its
    /// documented range). A request error, not a state of the conversation: checked before
    /// anything renders, and nothing is sent without the setting.
    Refused(SamplingError),
    /// A tool choice the API cannot spell, or one naming an undeclared tool. A request error
    /// like [`RenderOutcome::Refused`]; nothing is sent without it.
    RefusedToolChoice(ToolChoiceError),
    /// An output format the API cannot spell. A request error like [`RenderOutcome::Refused`].
    RefusedOutputFormat(OutputFormatError),
    /// A field only the client's API takes, towards another API.
    RefusedPassthrough(PassthroughError),
}

/// Render a graph with one adapter version.
pub fn render(
    adapter: AdapterId,
    graph: Graph<'_>,
    options: &RenderOptions,
    tokenizer: Tokenizer,
    cache: &mut RenderCache,
) -> RenderOutcome {
    if let Err(error) = options.sampling.check(adapter.api()) {
        return RenderOutcome::Refused(error);
    }
    let declared: Vec<&str> = graph
        .conversation()
        .tools
        .iter()
        .map(|tool| tool.name.as_str())
        .collect();
    if let Err(error) = options.tool_choice.check(adapter.api(), &declared) {
        return RenderOutcome::RefusedToolChoice(error);
    }
    if let Err(error) = options.output_format.check(adapter.api()) {
        return RenderOutcome::RefusedOutputFormat(error);
    }
    if let Err(error) = options.passthrough.check(adapter.api()) {
        return RenderOutcome::RefusedPassthrough(error);
    }
    let conversation = graph.conversation();
    cache.renders += 1;
    let mut ctx = Ctx::new(adapter, tokenizer, cache, options);
    if let Some(stamps) = graph.stamps {
        ctx.resume = ctx
            .cache
            .resumes
            .resume(adapter, tokenizer, options, conversation, stamps, |from| {
                resumable(adapter.api(), conversation, from)
            });
        if let Some(resume) = &mut ctx.resume {
            ctx.tokens = resume.tokens;
            ctx.omitted = std::mem::take(&mut resume.omitted);
            ctx.cache.resumes.resumed += 1;
            ctx.cache.resumes.last_from = resume.from;
        }
    }
    if ctx.resume.is_none() && ctx.cache.len == 0 {
        // A whole render into an empty cache misses one fragment per block: room for them at
        // once, not by rehashing as the map grows (1.3 % of a cold 200-block prepare's
        // profile). Not into a cache that holds fragments: its lookups may all hit, and a
        // reserve could grow the table for nothing.
        let blocks: usize = conversation.turns.iter().map(|turn| turn.blocks.len()).sum();
        let room = ctx.cache.bounds().0.saturating_sub(ctx.cache.len);
        ctx.cache.fragments.reserve(blocks.min(room));
    }
    let cache_policy = crate::cache::plan(adapter.api(), conversation, &options.passthrough, &mut ctx);
    ctx.cache_policy = cache_policy;
    let outcome = match adapter {
        AdapterId::OpenaiChatV1 => crate::openai_chat::v1::render::render(graph, options, &mut ctx),
        AdapterId::OpenaiChatV2 => crate::openai_chat::v2::render::render(graph, options, &mut ctx),
        AdapterId::OpenaiResponsesV1 => crate::openai_responses::v1::render::render(graph, options, &mut ctx),
        AdapterId::AnthropicMessagesV1 => {
            crate::anthropic_messages::v1::render::render(graph, options, &mut ctx)
        }
        AdapterId::AnthropicMessagesV2 => {
            crate::anthropic_messages::v2::render::render(graph, options, &mut ctx)
        }
        AdapterId::GeminiV1 => crate::gemini::v1::render::render(graph, options, &mut ctx),
    };
    // Keep the state at the last segment start for the next render of this kept conversation:
    // only after a render that was sent as is (no pause) and mapped no call id (a resumed
    // render checks the new ids only, which is exact only when none before was rewritten).
    // And only where a render of these same turns could resume from it: a kept Anthropic
    // head holds the system array, so a system turn at or after the checkpoint (which a pop
    // could take away without changing the stamp before it) must not be in a kept prefix.
    // Validated conversations have system turns only at their opening, so this is a guard.
    if let (Some(stamps), RenderOutcome::Rendered(rendered), Some(checkpoint)) =
        (graph.stamps, &outcome, ctx.checkpoint)
        && rendered.policy.call_ids.is_empty()
        && resumable(adapter.api(), conversation, checkpoint.turn)
    {
        let resume = ctx.resume.take();
        ctx.cache.resumes.keep(
            adapter,
            tokenizer,
            options,
            conversation,
            stamps,
            resume,
            checkpoint,
            rendered,
        );
    }
    outcome
}

/// Whether a render may resume at `from`: the turns from there change nothing the kept part
/// of the body depends on. Their call ids all fit the API's rule (so no id is rewritten and
/// none can collide with one before), and for Anthropic none is a system turn (system blocks
/// go in the head, before the messages).
fn resumable(api: crate::registry::Api, conversation: &Conversation, from: usize) -> bool {
    use crate::registry::Api;
    let rule = match api {
        Api::AnthropicMessages => Some(crate::anthropic_messages::CALL_ID_RULE),
        Api::OpenaiChat => Some(crate::openai_chat::CALL_ID_RULE),
        Api::OpenaiResponses => Some(crate::openai_responses::v1::render::CALL_ID_RULE),
        // Gemini sends no ids.
        Api::Gemini => None,
    };
    conversation.turns[from.min(conversation.turns.len())..]
        .iter()
        .all(|turn| {
            !(api == Api::AnthropicMessages && turn.role == RoleField::Known(Role::System))
                && turn.blocks.iter().all(|block| match (&block.body, rule) {
                    (BlockBody::ToolCall { call_id, .. }, Some(rule)) => rule.accepts(call_id.as_str()),
                    _ => true,
                })
        })
}

/// Output of a renderer function before the shared epilogue.
pub(crate) struct Body {
    pub body: Vec<u8>,
    pub path: String,
}

// ---------------------------------------------------------------------------------------------
// Fragment cache.

/// `total` split `shares` ways (0 or 1: not split), but never below `floor` (nor above
/// `total`): a share of the kept bodies and render states still holds one large
/// conversation's, so a cache that is one of many keeps the savings of an agent step on it.
fn share(total: usize, shares: usize, floor: usize) -> usize {
    (total / shares.max(1)).max(floor).min(total)
}

/// A cached rendered fragment and its token count.
#[derive(Clone, Debug)]
struct Fragment {
    bytes: Box<[u8]>,
    tokens: u64,
}

/// Cache of rendered fragments by (adapter, tokenizer, tag, content digest). Keep one per
/// conversation (or share one: keys are content-addressed, so sharing is always correct).
/// Bounded by [`RenderCache::FRAGMENTS_MAX`] fragments and [`RenderCache::BYTES_MAX`] bytes;
/// when either is reached it is cleared, which costs a cold render, never a wrong one.
#[derive(Debug, Default)]
pub struct RenderCache {
    fragments: HashMap<Digest, Vec<(FragmentKey, Fragment)>, DigestHasherBuilder>,
    len: usize,
    bytes: usize,
    /// The bounds are this share of the constants (0 or 1: all of them), see
    /// [`RenderCache::one_of`].
    shares: usize,
    hits: u64,
    misses: u64,
    bodies: BodyMemos,
    resumes: ResumeMemos,
    /// Renders through this cache (whole and resumed).
    renders: u64,
}

/// The last request bodies digested through this cache, one per (adapter, model, conversation), with
/// SHA-256 midstates at every [`BodyMemo::CHUNK`] bytes, so the next body's digest hashes only
/// from the first chunk that differs (an agent step's body is the last one with a turn added
/// near its end). Exact: the bytes are compared, never assumed. At most [`BodyMemos::MAX`]
/// bodies and [`BodyMemos::BYTES_MAX`] bytes (allocated: buffers and midstates) are kept, the
/// least recently used dropped first.
#[derive(Debug, Default)]
struct BodyMemos {
    memos: Vec<BodyMemo>,
    bytes: usize,
    /// The bounds are this share of `MAX` and `BYTES_MAX` (0 or 1: all of them).
    shares: usize,
    clock: u64,
    /// Bytes hashed by the last digest (tests and benchmarks read it).
    hashed: usize,
}

impl BodyMemos {
    const MAX: usize = 256;
    const BYTES_MAX: usize = 64 * 1024 * 1024;
    /// Fewest bodies and bytes a share keeps ([`share`]): a 4 MiB body and its midstates fit
    /// with room for its buffer's growth.
    const MAX_FLOOR: usize = 4;
    const BYTES_FLOOR: usize = 8 * 1024 * 1024;

    fn digest(&mut self, adapter: AdapterId, model: &str, conversation_id: &str, body: &[u8]) -> Digest {
        self.clock += 1;
        let index = match self.memos.iter().position(|memo| {
            memo.adapter == adapter && memo.model == model && memo.conversation_id == conversation_id
        }) {
            Some(index) => index,
            None => {
                if self.memos.len() >= share(Self::MAX, self.shares, Self::MAX_FLOOR)
                    && let Some(oldest) = self.least_recent()
                {
                    self.bytes -= self.memos.swap_remove(oldest).footprint();
                }
                let memo = BodyMemo {
                    adapter,
                    model: model.to_owned(),
                    conversation_id: conversation_id.to_owned(),
                    ..BodyMemo::default()
                };
                self.bytes += memo.footprint();
                self.memos.push(memo);
                self.memos.len() - 1
            }
        };
        let memo = &mut self.memos[index];
        let before = memo.footprint();
        let (digest, hashed) = memo.digest(body);
        memo.used = self.clock;
        self.hashed = hashed;
        // `self.bytes` holds every memo's footprint, this one's `before` included.
        self.bytes = self.bytes + memo.footprint() - before;
        while self.bytes > share(Self::BYTES_MAX, self.shares, Self::BYTES_FLOOR)
            && let Some(oldest) = self.least_recent()
        {
            self.bytes -= self.memos.swap_remove(oldest).footprint();
        }
        digest
    }

    fn least_recent(&self) -> Option<usize> {
        (0..self.memos.len()).min_by_key(|&index| self.memos[index].used)
    }
}

/// One kept body and its midstates.
#[derive(Debug)]
struct BodyMemo {
    adapter: AdapterId,
    model: String,
    conversation_id: String,
    bytes: Vec<u8>,
    /// `states[i]` is the hash of `bytes[..(i + 1) * CHUNK]`.
    states: Vec<turnstile_core::digest::HashState>,
    used: u64,
}

impl Default for BodyMemo {
    fn default() -> BodyMemo {
        BodyMemo {
            adapter: AdapterId::ALL[0],
            model: String::new(),
            conversation_id: String::new(),
            bytes: Vec::new(),
            states: Vec::new(),
            used: 0,
        }
    }
}

impl BodyMemo {
    const CHUNK: usize = 4096;
    /// Largest body kept (a bigger one is hashed whole and not kept).
    const BYTES_MAX: usize = 16 * 1024 * 1024;

    /// The digest of `body`, and how many of its bytes were hashed (from the first chunk that
    /// differs from the kept body).
    fn digest(&mut self, body: &[u8]) -> (Digest, usize) {
        let same = self
            .bytes
            .chunks_exact(Self::CHUNK)
            .zip(body.chunks_exact(Self::CHUNK))
            .take_while(|(kept, new)| kept == new)
            .count()
            .min(self.states.len());
        self.states.truncate(same);
        let mut hash = self.states.last().cloned().unwrap_or_default();
        let start = same * Self::CHUNK;
        let keep = body.len() <= Self::BYTES_MAX;
        for chunk in body[start..].chunks(Self::CHUNK) {
            hash.update(chunk);
            if keep && chunk.len() == Self::CHUNK {
                self.states.push(hash.clone());
            }
        }
        self.bytes.truncate(start);
        if keep {
            self.bytes.extend_from_slice(&body[start..]);
            // A body much shorter than the one before gives the rest of the buffer back.
            if self.bytes.capacity() > 2 * self.bytes.len() + Self::CHUNK {
                self.bytes.shrink_to_fit();
                self.states.shrink_to_fit();
            }
        } else {
            self.bytes = Vec::new();
            self.states = Vec::new();
        }
        (hash.finish(), body.len() - start)
    }

    /// Bytes allocated: the body buffer and the midstates.
    fn footprint(&self) -> usize {
        self.bytes.capacity()
            + self.states.capacity() * std::mem::size_of::<turnstile_core::digest::HashState>()
            + self.model.capacity()
            + self.conversation_id.capacity()
    }
}

/// A renderer's own state at the start of a segment, beside the bytes written before it: what
/// the rest of the render needs to go on from there as if it had written those bytes itself.
/// Roles are numbered by the renderer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Fold {
    /// Messages (input items, contents) begun so far.
    pub written: usize,
    /// The role of the last message, still open (its closing bytes not written) when the
    /// renderer merges same-role turns; `None` before the first.
    pub open: Option<u8>,
    /// Calls in the open message (Gemini).
    pub open_calls: usize,
    /// Whether the first message was a model turn with calls (Gemini's rule), once it is closed.
    pub first_model_calls: bool,
}

/// Where a render can go on from: the state after turns `[..turn]`, at the start of a segment.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Checkpoint {
    /// Turns consumed; `turns[turn]` (if any) starts a segment.
    pub turn: usize,
    /// Body bytes written for those turns (the head included).
    pub body_len: usize,
    /// Tokens counted for them.
    pub tokens: u64,
    /// Omissions recorded for them.
    pub omitted: usize,
    pub fold: Fold,
}

/// What a render resumes from (set up by [`render`], taken by the renderer).
pub(crate) struct Resume {
    /// The first turn to render.
    pub from: usize,
    /// The body for turns `[..from]`.
    pub prefix: Vec<u8>,
    pub fold: Fold,
    /// Indices of the system turns among `[..from]`.
    pub system_turns: Vec<usize>,
    /// Block breakpoints among `[..from]`, in order.
    breakpoints: Vec<crate::cache::Breakpoint>,
    /// Whether a block among `[..from]` is marked: the `prompt_cache_key` is then final.
    marked: bool,
    /// The key of the last render (meaningful when `marked`).
    cache_key: Option<String>,
    /// The memo's version and prefix length when this was copied from it.
    version: u64,
    prefix_len: usize,
    /// Tokens counted and omissions recorded for turns `[..from]` (moved into the render).
    tokens: u64,
    omitted: Vec<Omission>,
}

/// The render state kept after one render of a kept conversation ([`Graph::kept`]) with one
/// adapter: the checkpoint at the start of its last segment (the last segment can still
/// change: more results for its calls, a turn merged into its message), the body up to there
/// and what the policy had collected by then. The next render of the same conversation with
/// the same options resumes from it when the turn before the checkpoint still has the same
/// stamp, so it renders the new turns and the last old segment only.
#[derive(Debug)]
struct ResumeMemo {
    adapter: AdapterId,
    tokenizer: Tokenizer,
    conversation_id: String,
    toolset_digest: Digest,
    options: RenderOptions,
    /// The stamp of `turns[checkpoint.turn - 1]`.
    stamp: u64,
    checkpoint: Checkpoint,
    prefix: Vec<u8>,
    omitted: Vec<Omission>,
    system_turns: Vec<usize>,
    breakpoints: Vec<crate::cache::Breakpoint>,
    marked: bool,
    cache_key: Option<String>,
    used: u64,
    /// Changes with every keep (a [`Resume`] names the version it copied).
    version: u64,
}

impl ResumeMemo {
    /// Bytes allocated, roughly: the body prefix and the lists.
    fn footprint(&self) -> usize {
        self.prefix.capacity()
            + self.omitted.capacity() * (std::mem::size_of::<Omission>() + 64)
            + self.system_turns.capacity() * std::mem::size_of::<usize>()
            + self.breakpoints.capacity() * (std::mem::size_of::<crate::cache::Breakpoint>() + 64)
            + self.conversation_id.capacity()
            + self.options.model.capacity()
            + 256
    }
}

/// The kept render states, one per (adapter, model, conversation), at most [`ResumeMemos::MAX`] and
/// [`ResumeMemos::BYTES_MAX`] bytes, the least recently used dropped first. Dropping one costs
/// a whole render of that conversation's next step, never a wrong one.
#[derive(Debug, Default)]
struct ResumeMemos {
    memos: Vec<ResumeMemo>,
    bytes: usize,
    /// The bounds are this share of `MAX` and `BYTES_MAX` (0 or 1: all of them).
    shares: usize,
    clock: u64,
    /// Renders that resumed, and the turns they rendered (tests and benchmarks read them).
    resumed: u64,
    last_from: usize,
}

impl ResumeMemos {
    const MAX: usize = 256;
    const BYTES_MAX: usize = 64 * 1024 * 1024;
    /// Fewest states and bytes a share keeps ([`share`]), as [`BodyMemos`].
    const MAX_FLOOR: usize = 4;
    const BYTES_FLOOR: usize = 8 * 1024 * 1024;

    /// One state per (adapter, model, conversation): failover targets of two models on one
    /// adapter each keep their own.
    fn find(&self, adapter: AdapterId, model: &str, conversation_id: &str) -> Option<usize> {
        self.memos.iter().position(|memo| {
            memo.adapter == adapter && memo.options.model == model && memo.conversation_id == conversation_id
        })
    }

    /// The resume point for this render, when a kept state matches it exactly and `accept`
    /// takes its first turn (checked before the prefix is copied).
    fn resume(
        &mut self,
        adapter: AdapterId,
        tokenizer: Tokenizer,
        options: &RenderOptions,
        conversation: &Conversation,
        stamps: &[u64],
        accept: impl FnOnce(usize) -> bool,
    ) -> Option<Resume> {
        let index = self.find(adapter, &options.model, &conversation.conversation_id)?;
        self.clock += 1;
        let memo = &mut self.memos[index];
        let turn = memo.checkpoint.turn;
        let same = turn >= 1
            && turn <= conversation.turns.len()
            && stamps.len() == conversation.turns.len()
            && stamps[turn - 1] == memo.stamp
            && memo.tokenizer == tokenizer
            && memo.toolset_digest == conversation.toolset_digest
            && memo.options == *options;
        if !same || !accept(turn) {
            return None;
        }
        memo.used = self.clock;
        // Room for the rest: the last old segment and the new turns, usually small.
        let mut prefix = Vec::with_capacity(memo.prefix.len() + memo.prefix.len() / 8 + 8192);
        prefix.extend_from_slice(&memo.prefix);
        Some(Resume {
            from: turn,
            prefix,
            fold: memo.checkpoint.fold,
            system_turns: memo.system_turns.clone(),
            breakpoints: memo.breakpoints.clone(),
            marked: memo.marked,
            cache_key: memo.cache_key.clone(),
            version: memo.version,
            prefix_len: memo.prefix.len(),
            tokens: memo.checkpoint.tokens,
            omitted: memo.omitted.clone(),
        })
    }

    /// Keep the state at `checkpoint` after a render (resumed from `resume`, or whole) that
    /// wrote `rendered`.
    // The key of the state (adapter, tokenizer, options, conversation and its stamps) and what
    // the render gave: bundling them in a struct would only name them twice.
    #[allow(clippy::too_many_arguments)]
    fn keep(
        &mut self,
        adapter: AdapterId,
        tokenizer: Tokenizer,
        options: &RenderOptions,
        conversation: &Conversation,
        stamps: &[u64],
        resume: Option<Resume>,
        checkpoint: Checkpoint,
        rendered: &Rendered,
    ) {
        if checkpoint.turn == 0 || checkpoint.turn > stamps.len() || checkpoint.body_len > rendered.body.len()
        {
            return;
        }
        // What the turns between the resume point and the new checkpoint add to the lists.
        let from = resume.as_ref().map_or(0, |resume| resume.from);
        let between = &conversation.turns[from.min(checkpoint.turn)..checkpoint.turn];
        let (mut system_turns, mut breakpoints, mut marked, resumed) = match resume {
            Some(resume) => (
                resume.system_turns,
                resume.breakpoints,
                resume.marked,
                Some((resume.version, resume.prefix_len)),
            ),
            None => (Vec::new(), Vec::new(), false, None),
        };
        for (offset, turn) in between.iter().enumerate() {
            if turn.role == RoleField::Known(Role::System) {
                system_turns.push(from + offset);
            }
        }
        breakpoints.extend(crate::cache::block_breakpoints(between));
        marked |= between
            .iter()
            .flat_map(|turn| &turn.blocks)
            .any(|block| block.cache.is_some());
        self.clock += 1;
        let index = match self.find(adapter, &options.model, &conversation.conversation_id) {
            Some(index) => index,
            None => {
                if self.memos.len() >= share(Self::MAX, self.shares, Self::MAX_FLOOR)
                    && let Some(oldest) = self.least_recent()
                {
                    self.bytes -= self.memos.swap_remove(oldest).footprint();
                }
                self.memos.push(ResumeMemo {
                    adapter,
                    tokenizer,
                    conversation_id: conversation.conversation_id.clone(),
                    toolset_digest: conversation.toolset_digest.clone(),
                    options: options.clone(),
                    stamp: 0,
                    checkpoint,
                    prefix: Vec::new(),
                    omitted: Vec::new(),
                    system_turns: Vec::new(),
                    breakpoints: Vec::new(),
                    marked: false,
                    cache_key: None,
                    used: 0,
                    version: 0,
                });
                self.bytes += self.memos.last().map_or(0, ResumeMemo::footprint);
                self.memos.len() - 1
            }
        };
        let memo = &mut self.memos[index];
        let before = memo.footprint();
        // When this render resumed from this very memo (same version: nothing kept since), its
        // body began with a copy of the memo's prefix (renderers only append), so only the
        // bytes after it are copied.
        let resumed_from_this = resumed
            .is_some_and(|(version, prefix_len)| version == memo.version && prefix_len == memo.prefix.len());
        if resumed_from_this {
            let prefix_len = memo.prefix.len();
            debug_assert!(memo.prefix[..] == rendered.body[..prefix_len]);
            memo.prefix
                .extend_from_slice(&rendered.body[prefix_len..checkpoint.body_len]);
        } else {
            memo.prefix.clear();
            memo.prefix
                .extend_from_slice(&rendered.body[..checkpoint.body_len]);
        }
        memo.tokenizer = tokenizer;
        memo.toolset_digest.clone_from(&conversation.toolset_digest);
        if memo.options != *options {
            memo.options = options.clone();
        }
        memo.stamp = stamps[checkpoint.turn - 1];
        memo.checkpoint = checkpoint;
        memo.omitted.clear();
        memo.omitted.extend_from_slice(
            &rendered.policy.omitted[..checkpoint.omitted.min(rendered.policy.omitted.len())],
        );
        memo.system_turns = system_turns;
        memo.breakpoints = breakpoints;
        memo.marked = marked;
        memo.cache_key.clone_from(&rendered.policy.cache.prompt_cache_key);
        memo.used = self.clock;
        memo.version = self.clock;
        self.bytes = self.bytes + memo.footprint() - before;
        while self.bytes > share(Self::BYTES_MAX, self.shares, Self::BYTES_FLOOR)
            && let Some(oldest) = self.least_recent()
        {
            self.bytes -= self.memos.swap_remove(oldest).footprint();
        }
    }

    fn least_recent(&self) -> Option<usize> {
        (0..self.memos.len()).min_by_key(|&index| self.memos[index].used)
    }
}

/// Hashes a [`Digest`] key: its text is already the hex of a SHA-256, so folding its bytes with
/// a multiply-rotate spreads keys well at a fraction of SipHash's cost (every render looks up
/// one fragment per block; SipHash was 3.7 % of a warm 200-block prepare's profile, 3.0 % with
/// this, `docs/benchmarks.md` 2026-12-01). Keys are SHA-256 digests of content: many keys that
/// collide under this hash would have to be ground out of SHA-256, unlike the ids a client
/// picks (the validator's id sets keep SipHash).
#[derive(Clone, Copy, Debug, Default)]
struct DigestHasherBuilder;

impl std::hash::BuildHasher for DigestHasherBuilder {
    type Hasher = DigestHasher;
    fn build_hasher(&self) -> DigestHasher {
        DigestHasher(0)
    }
}

struct DigestHasher(u64);

impl std::hash::Hasher for DigestHasher {
    fn write(&mut self, bytes: &[u8]) {
        // A digest's text (`sha256:` and 64 hex digits): its first 16 hex digits, decoded, are
        // 64 bits of SHA-256 output, uniform in every bit (the hex characters themselves carry
        // 4 bits per byte). Any other text is folded whole. Equal keys hash equal either way.
        if let Some(hex) = bytes.get(7..23)
            && bytes.len() == 71
        {
            // '0'..='9' → 0..=9, 'a'..='f' → 10..=15 (and some value for any other byte).
            let bits = hex.iter().fold(0u64, |bits, &digit| {
                (bits << 4) | u64::from((digit & 0xF) + 9 * (digit >> 6))
            });
            self.0 = (self.0.rotate_left(5) ^ bits).wrapping_mul(0x517c_c1b7_2722_0a95);
            return;
        }
        // Whole words read in place (a short `copy_from_slice` per word was a `memcpy` call);
        // the tail, shorter than a word, byte by byte.
        let mut words = bytes.chunks_exact(8);
        for chunk in &mut words {
            let word = u64::from_le_bytes(chunk.try_into().expect("eight bytes"));
            self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
        for &byte in words.remainder() {
            self.0 = (self.0.rotate_left(5) ^ u64::from(byte)).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FragmentKey {
    adapter: AdapterId,
    tokenizer: Tokenizer,
    tag: u8,
}

impl RenderCache {
    /// Most fragments kept before the cache is cleared.
    pub const FRAGMENTS_MAX: usize = 1_000_000;
    /// Most fragment bytes kept before the cache is cleared.
    pub const BYTES_MAX: usize = 256 * 1024 * 1024;

    /// An empty cache.
    pub fn new() -> RenderCache {
        RenderCache::default()
    }

    /// An empty cache that is one of `shares` (a gateway keeps several, each for its own
    /// conversations, so that renders of different conversations do not wait on one lock):
    /// each of its bounds (fragments, bytes, kept bodies and render states) is that share of
    /// the whole, except that the kept bodies and render states never go below a floor (4 of
    /// each, 8 MiB of each), so that one large conversation still resumes. Up to 8 shares they
    /// keep no more than one cache; at 16, twice its kept bodies and states (128 MiB each).
    pub fn one_of(shares: usize) -> RenderCache {
        let shares = shares.max(1);
        let mut cache = RenderCache {
            shares,
            ..RenderCache::default()
        };
        cache.bodies.shares = shares;
        cache.resumes.shares = shares;
        cache
    }

    /// (most fragments, most fragment bytes) this cache keeps before it is cleared.
    pub fn bounds(&self) -> (usize, usize) {
        (
            share(RenderCache::FRAGMENTS_MAX, self.shares, 0),
            share(RenderCache::BYTES_MAX, self.shares, 0),
        )
    }

    /// (hits, misses) since creation: tests use it to prove incremental work.
    pub fn stats(&self) -> (u64, u64) {
        (self.hits, self.misses)
    }

    /// `sha256:` over `body`, a request body `adapter` rendered for `model` and
    /// `conversation_id`: resumes from the midstate of the part it shares with the last such
    /// body digested here ([`BodyMemos`]). Always equal to [`Digest::of_bytes`] of the body.
    pub fn body_digest(
        &mut self,
        adapter: AdapterId,
        model: &str,
        conversation_id: &str,
        body: &[u8],
    ) -> Digest {
        self.bodies.digest(adapter, model, conversation_id, body)
    }

    /// (bodies kept, bytes they take up: buffers and midstates allocated), for tests of the
    /// bound.
    pub fn body_memos(&self) -> (usize, usize) {
        (self.bodies.memos.len(), self.bodies.bytes)
    }

    /// (renders that resumed from a kept state, the first turn the last of them rendered):
    /// tests use it to prove a step renders its new turns only.
    pub fn resumed(&self) -> (u64, usize) {
        (self.resumes.resumed, self.resumes.last_from)
    }

    /// The turn a render of `conversation_id` for `adapter` and `model` would resume from if
    /// the state kept for it still matches (0: none kept): the turns before it are not
    /// rendered again. A scheduling hint, not a promise: the render checks the state exactly.
    pub fn kept_turn(&self, adapter: AdapterId, model: &str, conversation_id: &str) -> usize {
        self.resumes
            .find(adapter, model, conversation_id)
            .map_or(0, |index| self.resumes.memos[index].checkpoint.turn)
    }

    /// Renders through this cache since creation, whole and resumed (a gateway's metric).
    pub fn renders(&self) -> u64 {
        self.renders
    }

    /// (render states kept, bytes they take up), for tests of the bound.
    pub fn resume_memos(&self) -> (usize, usize) {
        (self.resumes.memos.len(), self.resumes.bytes)
    }

    /// Bytes the last [`RenderCache::body_digest`] hashed (the rest came from a midstate).
    pub fn body_bytes_hashed(&self) -> usize {
        self.bodies.hashed
    }

    /// Drop every cached fragment of one block digest (a block that left the history, or a
    /// benchmark that wants the next render of that block to be a miss again).
    pub fn forget(&mut self, digest: &Digest) {
        if let Some(slot) = self.fragments.remove(digest) {
            self.len -= slot.len();
            self.bytes -= slot
                .iter()
                .map(|(_, fragment)| fragment.bytes.len())
                .sum::<usize>();
        }
    }

    /// Number of cached fragments.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

// ---------------------------------------------------------------------------------------------
// Render context: cache access, pauses, policy.

/// Mutable state of one render.
pub(crate) struct Ctx<'c> {
    pub adapter: AdapterId,
    pub tokenizer: Tokenizer,
    cache: &'c mut RenderCache,
    pub pauses: Vec<Pause>,
    pub call_ids: Vec<CallIdMapping>,
    pub omitted: Vec<Omission>,
    pub tokens: u64,
    stream: bool,
    sampling: Sampling,
    tool_choice: ToolChoice,
    output_format: OutputFormat,
    passthrough: Passthrough,
    cache_policy: CachePolicy,
    /// The text form this render wrote (a renderer that honours [`RenderOptions::text_content`]
    /// sets it; the others leave the default, so their policy does not claim a form).
    pub text_content: TextContent,
    /// The buffer fragments are built in (see [`Ctx::fragment`]).
    scratch: Vec<u8>,
    /// Where this render resumes from ([`render`] sets it up; the renderer takes the body).
    resume: Option<Resume>,
    /// The last segment start the renderer passed ([`Ctx::segment_start`]).
    checkpoint: Option<Checkpoint>,
}

impl<'c> Ctx<'c> {
    fn new(
        adapter: AdapterId,
        tokenizer: Tokenizer,
        cache: &'c mut RenderCache,
        options: &RenderOptions,
    ) -> Ctx<'c> {
        Ctx {
            adapter,
            tokenizer,
            cache,
            pauses: Vec::new(),
            call_ids: Vec::new(),
            omitted: Vec::new(),
            tokens: 0,
            stream: options.stream,
            sampling: options.sampling.clone(),
            tool_choice: options.tool_choice.clone(),
            output_format: options.output_format.clone(),
            passthrough: options.passthrough.clone(),
            cache_policy: CachePolicy::default(),
            text_content: TextContent::Parts,
            scratch: Vec::with_capacity(1024),
            resume: None,
            checkpoint: None,
        }
    }

    /// The first turn to render, the body written before it and the renderer's state there:
    /// `(0, empty, start)` for a whole render, else where the kept state resumes. A renderer
    /// writes its head only when this is a whole render, and only appends to the body.
    pub fn begin(&mut self) -> (usize, Vec<u8>, Fold) {
        match &mut self.resume {
            Some(resume) => (resume.from, std::mem::take(&mut resume.prefix), resume.fold),
            None => (0, Vec::with_capacity(4096), Fold::default()),
        }
    }

    /// The system turns to place at the top, in order: those among the turns before the resume
    /// point (kept), then those of `conversation.turns[from..]`.
    pub fn system_turns<'t>(&self, conversation: &'t Conversation, from: usize) -> Vec<&'t Turn> {
        let kept = self
            .resume
            .as_ref()
            .map_or(&[][..], |resume| &resume.system_turns[..]);
        kept.iter()
            .filter_map(|&index| conversation.turns.get(index))
            .chain(
                conversation.turns[from.min(conversation.turns.len())..]
                    .iter()
                    .filter(|turn| turn.role == RoleField::Known(Role::System)),
            )
            .collect()
    }

    /// On a resumed render: the resume point, the block breakpoints before it, whether one of
    /// those blocks is marked and the last render's `prompt_cache_key` (`cache::plan`).
    pub fn resume_cache(&self) -> Option<(usize, &[crate::cache::Breakpoint], bool, Option<&String>)> {
        self.resume.as_ref().map(|resume| {
            (
                resume.from,
                &resume.breakpoints[..],
                resume.marked,
                resume.cache_key.as_ref(),
            )
        })
    }

    /// A segment starts at `turn` with `out` written before it and the renderer in `fold`:
    /// the last one passed is where the next render of the same kept conversation resumes.
    pub fn segment_start(&mut self, turn: usize, out: &[u8], fold: Fold) {
        self.checkpoint = Some(Checkpoint {
            turn,
            body_len: out.len(),
            tokens: self.tokens,
            omitted: self.omitted.len(),
            fold,
        });
    }

    /// Append the fragment for `digest`/`tag` to `out`, building it on a miss. Counts its
    /// tokens into the request total.
    pub fn fragment(&mut self, out: &mut Vec<u8>, tag: u8, digest: &Digest, build: impl FnOnce(&mut Writer)) {
        let key = FragmentKey {
            adapter: self.adapter,
            tokenizer: self.tokenizer,
            tag,
        };
        if let Some(slot) = self.cache.fragments.get(digest)
            && let Some((_, fragment)) = slot.iter().find(|(existing, _)| *existing == key)
        {
            out.extend_from_slice(&fragment.bytes);
            self.tokens += fragment.tokens;
            self.cache.hits += 1;
            return;
        }
        self.cache.misses += 1;
        // Built in a buffer reused across the render's fragments (a fresh `Vec` per fragment
        // grew by reallocation several times and was then shrunk for the cache).
        let mut writer = Writer {
            out: std::mem::take(&mut self.scratch),
            tokens: 0,
            tokenizer: self.tokenizer,
        };
        writer.out.clear();
        build(&mut writer);
        out.extend_from_slice(&writer.out);
        self.tokens += writer.tokens;
        let (fragments_max, bytes_max) = self.cache.bounds();
        if self.cache.len >= fragments_max || self.cache.bytes >= bytes_max {
            self.cache.fragments.clear();
            self.cache.len = 0;
            self.cache.bytes = 0;
        }
        self.cache.len += 1;
        self.cache.bytes += writer.out.len();
        self.cache.fragments.entry(digest.clone()).or_default().push((
            key,
            Fragment {
                bytes: Box::from(writer.out.as_slice()),
                tokens: writer.tokens,
            },
        ));
        self.scratch = writer.out;
    }

    /// Append a fragment built now and not cached (one that carries a per-request value, such
    /// as a client's image `detail`: its bytes are not a function of the content digest).
    /// Counts its tokens; the writer, for the cache.
    pub fn uncached(&mut self, out: &mut Vec<u8>, build: impl FnOnce(&mut Writer)) -> Writer {
        let mut writer = Writer::new(self.tokenizer);
        build(&mut writer);
        out.extend_from_slice(&writer.out);
        self.tokens += writer.tokens;
        writer
    }

    /// Record a pause.
    pub fn pause(&mut self, block: Option<&Block>, kind: &str, reason: PauseReason) {
        self.pauses.push(Pause {
            block: block.and_then(|block| block.id.clone()),
            kind: kind.to_owned(),
            reason,
        });
    }

    /// Pause every block of `turns[from..]` whose kind this adapter version does not declare
    /// (the turns before a resume point had none: only a render that paused nothing is kept).
    /// Returns whether anything paused.
    pub fn pause_unrepresentable_kinds(&mut self, conversation: &Conversation, from: usize) -> bool {
        let adapter = self.adapter;
        for turn in &conversation.turns[from.min(conversation.turns.len())..] {
            for block in &turn.blocks {
                let kind = block.body.kind();
                if !adapter.represents(kind) {
                    self.pause(Some(block), kind, PauseReason::UnrepresentableKind);
                }
            }
        }
        !self.pauses.is_empty()
    }

    /// Map every call id of the conversation under `rule`, recording rewritten ones in the
    /// policy and pausing on a collision. Renderers call the same pure [`call_ids::map`]
    /// when they write a call or a result, so both ends of a pair always agree. Nothing to do
    /// on a resumed render: it resumes only when every id fits the rule ([`render`]).
    pub fn map_call_ids(&mut self, conversation: &Conversation, rule: CallIdRule) {
        if self.resume.is_some() {
            return;
        }
        // The common case: every id already meets the rule, so nothing is rewritten and
        // nothing can collide (one pass, no sets).
        let every_id_fits = conversation.turns.iter().all(|turn| {
            turn.blocks.iter().all(|block| match &block.body {
                BlockBody::ToolCall { call_id, .. } => rule.accepts(call_id.as_str()),
                _ => true,
            })
        });
        if every_id_fits {
            return;
        }
        let mut ours: HashSet<&str> = HashSet::new();
        for turn in &conversation.turns {
            for block in &turn.blocks {
                if let BlockBody::ToolCall { call_id, .. } = &block.body {
                    ours.insert(call_id.as_str());
                }
            }
        }
        let mut theirs: HashSet<String> = HashSet::new();
        for turn in &conversation.turns {
            for block in &turn.blocks {
                let BlockBody::ToolCall { call_id, .. } = &block.body else {
                    continue;
                };
                let mapped = call_ids::map(call_id.as_str(), rule);
                if mapped != call_id.as_str() {
                    if ours.contains(mapped.as_ref()) || !theirs.insert(mapped.to_string()) {
                        self.pause(Some(block), "tool_call", PauseReason::CallIdCollision);
                        continue;
                    }
                    self.call_ids.push(CallIdMapping {
                        call_id: call_id.0.clone(),
                        provider_call_id: mapped.into_owned(),
                    });
                }
            }
        }
    }

    /// Record an omitted block.
    pub fn omit(&mut self, block: &Block, provider: &str, reason: &'static str) {
        self.omitted.push(Omission {
            block: block.id.clone().unwrap_or_default(),
            kind: if matches!(block.body, BlockBody::Text { .. }) {
                "text"
            } else {
                "reasoning"
            },
            provider: provider.to_owned(),
            reason,
        });
    }

    /// Append the request's tool choice fields in `api`'s names (`tool_choice.rs`), counting
    /// their text into the request total. Nothing when unset.
    pub fn tool_choice_fields(&mut self, api: crate::registry::Api, out: &mut Vec<u8>) {
        let written = self.tool_choice.write_fields(api, out);
        if !written.is_empty() {
            self.tokens += self.tokenizer.count(&written);
        }
    }

    /// Append the request's output format fields in `api`'s names (`output_format.rs`),
    /// counting their text into the request total. Nothing when unset.
    pub fn output_format_fields(&mut self, api: crate::registry::Api, out: &mut Vec<u8>) {
        let written = self.output_format.write(api, out);
        if !written.is_empty() {
            self.tokens += self.tokenizer.count(&written);
        }
    }

    /// The request's client-only fields.
    pub fn passthrough(&self) -> &Passthrough {
        &self.passthrough
    }

    /// Append the client-only top-level fields (`passthrough.rs`) when `api` is the client's,
    /// counting their text.
    pub fn passthrough_fields(&mut self, api: crate::registry::Api, out: &mut Vec<u8>) {
        let written = self.passthrough.write_top(api, out);
        if !written.is_empty() {
            self.tokens += self.tokenizer.count(&written);
        }
        // OpenAI's nearest field to a cache breakpoint (`cache.rs`); not model-visible text.
        if let Some(key) = &self.cache_policy.prompt_cache_key {
            out.extend_from_slice(b",\"prompt_cache_key\":");
            push_json_string(out, key);
        }
    }

    /// Append Gemini's client-only `generationConfig` fields, counting their text.
    pub fn passthrough_config_fields(&mut self, api: crate::registry::Api, out: &mut Vec<u8>) {
        let written = self.passthrough.write_config(api, out);
        if !written.is_empty() {
            self.tokens += self.tokenizer.count(&written);
        }
    }

    /// Finish: pauses win; otherwise the rendered request with its policy.
    pub fn finish(&mut self, body: Body, headers: &[(&'static str, &'static str)]) -> RenderOutcome {
        if !self.pauses.is_empty() {
            return RenderOutcome::Paused(std::mem::take(&mut self.pauses));
        }
        RenderOutcome::Rendered(Rendered {
            body: body.body,
            method: "POST",
            path: body.path,
            headers: headers.to_vec(),
            prompt_tokens: self.tokens,
            policy: RenderPolicy {
                format: POLICY_FORMAT_V1,
                adapter: self.adapter,
                stream: self.stream,
                context_wrapping: self.adapter.rules().context_wrapping,
                call_ids: std::mem::take(&mut self.call_ids),
                omitted: std::mem::take(&mut self.omitted),
                sampling: std::mem::take(&mut self.sampling),
                tool_choice: std::mem::take(&mut self.tool_choice),
                output_format: std::mem::take(&mut self.output_format),
                passthrough: std::mem::take(&mut self.passthrough),
                cache: std::mem::take(&mut self.cache_policy),
                text_content: self.text_content,
            },
        })
    }
}

// ---------------------------------------------------------------------------------------------
// JSON writer.

/// Writes JSON into a buffer and counts tokens of the model-visible strings.
pub(crate) struct Writer {
    pub out: Vec<u8>,
    pub tokens: u64,
    pub tokenizer: Tokenizer,
}

impl Writer {
    pub fn new(tokenizer: Tokenizer) -> Writer {
        Writer {
            out: Vec::new(),
            tokens: 0,
            tokenizer,
        }
    }

    /// Raw JSON syntax.
    pub fn raw(&mut self, text: &str) -> &mut Writer {
        self.out.extend_from_slice(text.as_bytes());
        self
    }

    /// A JSON string the model does not see as text (ids, types, media data).
    pub fn string(&mut self, text: &str) -> &mut Writer {
        push_json_string(&mut self.out, text);
        self
    }

    /// A JSON string the model reads: written and counted.
    pub fn text(&mut self, text: &str) -> &mut Writer {
        push_json_string(&mut self.out, text);
        self.tokens += self.tokenizer.count(text);
        self
    }

    /// Count tokens without writing.
    pub fn count(&mut self, text: &str) -> &mut Writer {
        self.tokens += self.tokenizer.count(text);
        self
    }

    /// Add a fixed token charge.
    pub fn charge(&mut self, tokens: u64) -> &mut Writer {
        self.tokens += tokens;
        self
    }

    /// Charge one image (see [`crate::tokens::image_tokens`]).
    pub fn charge_image(&mut self) -> &mut Writer {
        self.tokens += crate::tokens::image_tokens(self.tokenizer);
        self
    }

    /// A value in RFC 8785 canonical form (deterministic whatever serde_json's features).
    pub fn canonical(&mut self, value: &serde_json::Value) -> &mut Writer {
        self.out
            .extend_from_slice(&turnstile_core::digest::canonical_value_bytes(value));
        self
    }
}

/// Append `text` as a JSON string literal (serde_json's bytes).
pub(crate) use turnstile_core::digest::push_json_string;

// ---------------------------------------------------------------------------------------------
// Placement plan shared by all APIs.

/// A stretch of the conversation as the APIs see it: tool turns are folded into the
/// assistant turn whose calls they answer, with the results in call order.
pub(crate) enum Segment<'a> {
    System(&'a Turn),
    User(&'a Turn),
    Assistant { turn: &'a Turn, results: Vec<&'a Block> },
}

/// Fold `conversation.turns[from..]` (`from` starts a segment: 0, or a resume point) into
/// segments, each with the index of the turn it starts at. Results spread over several
/// consecutive tool turns, in any order, are gathered and put in the order of the calls they
/// answer.
pub(crate) fn segments_from(conversation: &Conversation, from: usize) -> Vec<(usize, Segment<'_>)> {
    let turns = &conversation.turns;
    let mut segments = Vec::with_capacity(turns.len().saturating_sub(from));
    let mut index = from;
    while index < turns.len() {
        let start = index;
        let turn = &turns[index];
        index += 1;
        let RoleField::Known(role) = turn.role else {
            continue;
        };
        match role {
            Role::System => segments.push((start, Segment::System(turn))),
            Role::User => segments.push((start, Segment::User(turn))),
            // Unreachable in a validated graph (tool turns always follow an assistant turn);
            // skipped rather than rendered anywhere else.
            Role::Tool => {}
            Role::Assistant => {
                let mut answers: Vec<(&str, &Block)> = Vec::new();
                while index < turns.len() && turns[index].role == RoleField::Known(Role::Tool) {
                    for block in &turns[index].blocks {
                        if let BlockBody::ToolResult { call_id, .. } = &block.body {
                            answers.push((call_id.as_str(), block));
                        }
                    }
                    index += 1;
                }
                // A tool run is a few calls: a linear search beats hashing each id, and a map
                // is built only for a long run (the last result of a call wins either way; a validated
                // run has one per call).
                let by_call: Option<HashMap<&str, &Block>> =
                    (answers.len() > 16).then(|| answers.iter().copied().collect());
                let results = turn
                    .blocks
                    .iter()
                    .filter_map(|block| match &block.body {
                        BlockBody::ToolCall { call_id, .. } => match &by_call {
                            Some(by_call) => by_call.get(call_id.as_str()).copied(),
                            None => answers
                                .iter()
                                .rev()
                                .find(|(answered, _)| *answered == call_id.as_str())
                                .map(|(_, block)| *block),
                        },
                        _ => None,
                    })
                    .collect();
                segments.push((start, Segment::Assistant { turn, results }));
            }
        }
    }
    segments
}

/// The readable text of a `context` block as rendered: wrapped so its provenance and trust
/// are explicit, with `&`, `<` and `>` escaped inside so the text cannot close the wrapper.
/// Text that reads like `assistant:` or `\n\nHuman:` stays text inside its own block.
pub(crate) fn wrap_context(
    source: Option<&str>,
    trust: turnstile_core::conversation::Trust,
    text: &str,
) -> String {
    let trust = match trust {
        turnstile_core::conversation::Trust::Trusted => "trusted",
        turnstile_core::conversation::Trust::Untrusted => "untrusted",
    };
    let mut wrapped = String::with_capacity(text.len() + 64);
    wrapped.push_str("<context source=\"");
    escape_markup(&mut wrapped, source.unwrap_or("unspecified"), true);
    wrapped.push_str("\" trust=\"");
    wrapped.push_str(trust);
    wrapped.push_str("\">\n");
    escape_markup(&mut wrapped, text, false);
    wrapped.push_str("\n</context>");
    wrapped
}

/// The wrapping rule, as declared in every adapter's rules descriptor.
pub(crate) const CONTEXT_WRAPPING: &str = "own text part: <context source=\"S\" trust=\"T\">\\nTEXT\\n</context>, with & < > (and \" in S) escaped as XML entities";

fn escape_markup(out: &mut String, text: &str, attribute: bool) {
    for character in text.chars() {
        match character {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' if attribute => out.push_str("&quot;"),
            other => out.push(other),
        }
    }
}

/// A `data:` URL for inline media.
pub(crate) fn data_url(media_type: &str, data: &str) -> String {
    let mut url = String::with_capacity(media_type.len() + data.len() + 13);
    url.push_str("data:");
    url.push_str(media_type);
    url.push_str(";base64,");
    url.push_str(data);
    url
}

/// Base64 length of an inline source (for token charges).
pub(crate) fn inline_len(source: &MediaSource) -> Option<usize> {
    match source {
        MediaSource::Base64 { data, .. } => Some(data.len()),
        MediaSource::Url { .. } => None,
    }
}

/// Note put before a tool result's content where the API has no status field, so an error or
/// a cancellation is never indistinguishable from success.
pub(crate) fn status_note(status: turnstile_core::conversation::ResultStatus) -> Option<&'static str> {
    use turnstile_core::conversation::ResultStatus;
    match status {
        ResultStatus::Success => None,
        ResultStatus::Error => Some("[tool result status: error]"),
        ResultStatus::Cancel => Some("[tool result status: cancelled; the call did not complete]"),
    }
}

/// What to do with a reasoning block for an adapter.
pub(crate) enum Reasoning<'a> {
    /// Render it back to its own provider.
    Keep {
        signature: Option<&'a str>,
        encrypted: Option<&'a str>,
    },
    /// Leave it out, for this reason.
    Omit { provider: &'a str, reason: &'static str },
}

/// The affinity rule: provider-affine reasoning goes back unchanged to the provider that
/// produced it, and is omitted (with the reason in the policy) everywhere else.
pub(crate) fn reasoning_for<'a>(adapter: AdapterId, body: &'a BlockBody) -> Option<Reasoning<'a>> {
    let BlockBody::Reasoning {
        provider,
        signature,
        encrypted,
        ..
    } = body
    else {
        return None;
    };
    if provider != adapter.provider() {
        return Some(Reasoning::Omit {
            provider,
            reason: "foreign_provider",
        });
    }
    Some(Reasoning::Keep {
        signature: signature.as_deref(),
        encrypted: encrypted.as_deref(),
    })
}

/// Decode standard base64 (RFC 4648 §4, padding optional, no whitespace). None when malformed.
pub(crate) fn base64_decode(text: &str) -> Option<Vec<u8>> {
    fn value(byte: u8) -> Option<u32> {
        Some(match byte {
            b'A'..=b'Z' => byte - b'A',
            b'a'..=b'z' => byte - b'a' + 26,
            b'0'..=b'9' => byte - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let trimmed = text.trim_end_matches('=');
    if text.len() - trimmed.len() > 2 || trimmed.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(trimmed.len() / 4 * 3 + 2);
    for chunk in trimmed.as_bytes().chunks(4) {
        let mut accumulator = 0u32;
        for &byte in chunk {
            accumulator = (accumulator << 6) | value(byte)?;
        }
        accumulator <<= 6 * (4 - chunk.len() as u32);
        let bytes = accumulator.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Some(out)
}
