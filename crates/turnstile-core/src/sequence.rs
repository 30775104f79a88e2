//! `MessageSequence`: the graph every adapter renders from.
//!
//! Built only from a [`Validated`] conversation, so it never holds an uncommitted, unknown or
//! unpaired block. Blocks keep their stable ids, role, kind, content digest, trust label and
//! order; tool edges link each call to its result. Nothing is ever concatenated into one
//! string: the graph is the boundary information adapters need.
//!
//! `sequence_digest` (format `turnstile.sequence.v2`) is `sha256:` over the RFC 8785 canonical
//! JSON of the sequence (this struct's serialisation without the digest field) with its two
//! arrays, `blocks` and `edges`, each replaced by the `sha256:` digest of its own canonical
//! JSON. It covers exactly what v1 covered (the whole graph); v1 hashed the arrays inline, so a
//! digest after one more turn re-hashed every edge. With the arrays digested apart, a sequence
//! kept beside a growing conversation ([`GrowingSequence`]) resumes each array's SHA-256 from a
//! midstate and pays for the new blocks and the open calls only. Equal content gives equal
//! digests on every run and machine (`tests/it/sequence.rs` pins a few and recomputes the
//! definition through the generic canonicaliser).
//!
//! Digest fast path: the structs below declare their fields in sorted order and hold only
//! strings, small integers and `null`s, so serde_json's compact serialisation of them *is*
//! their RFC 8785 form and can be hashed without building a `Value` first. The blocks and edges
//! are written by hand ([`write_block`], [`write_edge`]: serde_json's bytes without its
//! serializer, the structs destructured whole so a new field does not compile until it is
//! written); `tests/it/sequence.rs` checks the serialisation against the canonical form and the
//! digest against the generic definition, on generated sequences and on ids that need escaping.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - `sequence_digest` is SHA-256 over the canonical sequence with each array replaced by its own
//!   canonical digest. Enforced in `core/src/sequence.rs` (`DigestForm`, fast path with
//!   `write_block`/`write_edge` written by hand, and generic path). Tests:
//!   `core/tests/it/sequence.rs` (`generic_digest` recomputes it on generated sequences, on ids
//!   that need escaping, on 240 answered calls across the 16 KiB hashing pieces, built once and
//!   kept to grow; pins; red with an id written unescaped or a status misnamed).

use crate::conversation::{ArgState, BlockBody, Conversation, ResultStatus, Role, RoleField, Trust};
use crate::digest::{Digest, EXACT_INTEGER_MAX, HashState, push_json_string};
use crate::ids::{CallId, Generation, Revision};
use crate::validate::Validated;
use serde::Serialize;
use std::collections::HashMap;

/// Serialised entries are hashed in pieces of about this many bytes (a whole build's edges in
/// one buffer grew to hundreds of KiB, fresh pages each time).
const SCRATCH_FLUSH: usize = 16 * 1024;

/// The `format` string of a message sequence (v2: the digest takes each array's digest,
/// module documentation).
pub const SEQUENCE_FORMAT_V2: &str = "turnstile.sequence.v2";

/// Who vouches for a block's content. Adapters and policies use it; the model never sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TrustLabel {
    /// System turn content written by the operator.
    Operator,
    /// User turn content.
    User,
    /// Model output.
    Model,
    /// Tool output.
    Tool,
    /// A context block marked trusted.
    Trusted,
    /// A context block marked (or defaulted to) untrusted.
    Untrusted,
}

/// One block of the sequence.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SequenceBlock {
    /// Content digest.
    pub digest: Digest,
    /// Generation of the turn (assistant turns).
    pub generation: Option<Generation>,
    /// Stable block id.
    pub id: String,
    /// The v1 kind.
    pub kind: &'static str,
    /// Position of the block in the whole sequence.
    pub order: u32,
    /// The turn's role.
    pub role: Role,
    /// Trust label.
    pub trust: TrustLabel,
    /// Id of its turn.
    pub turn: String,
    /// Index of its turn in the conversation.
    pub turn_index: u32,
}

/// A tool edge: one call and (when answered) its terminal result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ToolEdge {
    /// Digest of the arguments.
    pub args_digest: Option<Digest>,
    /// Argument state (always `closed` in a validated sequence).
    pub args_state: ArgState,
    /// Id of the tool_call block.
    pub call_block: String,
    /// Call id.
    pub call_id: CallId,
    /// Generation of the assistant turn that emitted it.
    pub generation: Option<Generation>,
    /// Id of the tool_result block, None while pending.
    pub result: Option<String>,
    /// Digest of the declared tool's input schema (None when the tool is not declared).
    pub schema_digest: Option<Digest>,
    /// Status of the result, None while pending.
    pub status: Option<ResultStatus>,
    /// Tool name.
    pub tool: String,
}

/// The message graph of one conversation revision.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MessageSequence {
    /// Blocks in order.
    pub blocks: Vec<SequenceBlock>,
    /// Conversation id.
    pub conversation_id: String,
    /// Tool edges in call order.
    pub edges: Vec<ToolEdge>,
    /// Always [`SEQUENCE_FORMAT_V2`].
    pub format: &'static str,
    /// Revision it was built at.
    pub revision: Revision,
    /// Digest of the declared tools.
    pub toolset_digest: Digest,
    /// `sha256:` over the canonical JSON of all fields above, `blocks` and `edges` each
    /// replaced by the digest of its own canonical JSON (format v2, module documentation).
    #[serde(skip)]
    pub sequence_digest: Digest,
}

impl MessageSequence {
    /// Build the graph of a validated conversation.
    pub fn build(validated: Validated<'_>) -> MessageSequence {
        GrowingSequence::fed(validated, false).sequence
    }
}

/// A [`MessageSequence`] kept beside a conversation that grows by a turn at a time
/// (`crate::kept::KeptConversation`), so the next sequence and its digest cost the new turn's
/// blocks, not the history's.
///
/// Committed history only grows: a block's entry never changes once built, and a tool edge
/// changes once, when its result arrives. So it keeps a SHA-256 midstate over the serialised
/// blocks array, and one over the edges whose results are in ("sealed", a prefix: edges are in
/// call order and only the open tool run's can be unanswered). A digest continues the first
/// with nothing, the second with the open edges, and hashes the small document that holds the
/// two array digests. [`MessageSequence::build`] is this type fed every turn at once, so there
/// is one implementation of the graph, and `tests/it/kept.rs` checks a sequence grown turn by
/// turn against a whole build at every split.
#[derive(Clone, Debug)]
pub struct GrowingSequence {
    sequence: MessageSequence,
    edge_of_call: HashMap<String, usize>,
    /// Whether every number so far prints the same in serde_json and RFC 8785 (integers up to
    /// 2^53): the fast digest path below needs it, the generic one does not.
    numbers_exact: bool,
    /// SHA-256 over `[` and the blocks so far, comma-separated (the blocks array, unclosed).
    blocks_hash: HashState,
    /// Edges `[..sealed]` all have their result; `edges_hash` is SHA-256 over `[` and their
    /// serialisation, comma-separated.
    sealed: usize,
    edges_hash: HashState,
    /// Turns added.
    turns: usize,
    /// Serialised entries waiting for one hash update (reused; empty between calls).
    scratch: Vec<u8>,
}

/// What [`GrowingSequence::pop_turn`] needs to undo one [`GrowingSequence::push_turn`].
#[derive(Clone, Debug)]
#[must_use]
pub struct SequenceMark {
    turns: usize,
    blocks: usize,
    edges: usize,
    answered: Vec<usize>,
    sealed: usize,
    edges_hash: HashState,
    blocks_hash: HashState,
    numbers_exact: bool,
    revision: Revision,
    digest: Digest,
}

impl GrowingSequence {
    /// The sequence of a validated conversation, kept to grow.
    pub fn of(validated: Validated<'_>) -> GrowingSequence {
        GrowingSequence::fed(validated, true)
    }

    /// Every turn of the conversation added; the answered edges sealed when it is to grow (a
    /// one-off build leaves them to the digest).
    fn fed(validated: Validated<'_>, sealed: bool) -> GrowingSequence {
        let conversation = validated.conversation();
        let mut growing = GrowingSequence::start(conversation);
        for turn_index in 0..conversation.turns.len() {
            growing.add_turn(conversation, turn_index);
        }
        if sealed {
            growing.seal_edges();
        }
        growing.finish_revision(conversation);
        growing
    }

    /// The sequence as of the last turn added.
    pub fn sequence(&self) -> &MessageSequence {
        &self.sequence
    }

    /// Add the last turn of `validated` (the conversation this sequence was built from, with
    /// one turn pushed since), and set the revision and digest.
    ///
    /// # Panics
    /// When `validated` does not hold exactly one more turn than the sequence: a caller bug
    /// (`KeptConversation` pushes both together).
    pub fn push_turn(&mut self, validated: Validated<'_>) -> SequenceMark {
        let conversation = validated.conversation();
        let turn_index = conversation.turns.len() - 1;
        assert_eq!(
            self.turns + 1,
            conversation.turns.len(),
            "a growing sequence takes the turn after its last one"
        );
        let mut mark = SequenceMark {
            turns: self.turns,
            blocks: self.sequence.blocks.len(),
            edges: self.sequence.edges.len(),
            answered: Vec::new(),
            sealed: self.sealed,
            edges_hash: self.edges_hash.clone(),
            blocks_hash: self.blocks_hash.clone(),
            numbers_exact: self.numbers_exact,
            revision: self.sequence.revision,
            digest: self.sequence.sequence_digest.clone(),
        };
        mark.answered = self.add_turn(conversation, turn_index);
        self.seal_edges();
        self.finish_revision(conversation);
        mark
    }

    /// Undo the last [`GrowingSequence::push_turn`].
    pub fn pop_turn(&mut self, mark: SequenceMark) {
        self.turns = mark.turns;
        self.sequence.blocks.truncate(mark.blocks);
        for edge in self.sequence.edges.drain(mark.edges..) {
            self.edge_of_call.remove(edge.call_id.as_str());
        }
        for index in mark.answered {
            let edge = &mut self.sequence.edges[index];
            edge.result = None;
            edge.status = None;
        }
        self.sealed = mark.sealed;
        self.edges_hash = mark.edges_hash;
        self.blocks_hash = mark.blocks_hash;
        self.numbers_exact = mark.numbers_exact;
        self.sequence.revision = mark.revision;
        self.sequence.sequence_digest = mark.digest;
    }

    fn start(conversation: &Conversation) -> GrowingSequence {
        let mut blocks_hash = HashState::new();
        blocks_hash.update(b"[");
        let mut edges_hash = HashState::new();
        edges_hash.update(b"[");
        GrowingSequence {
            sequence: MessageSequence {
                format: SEQUENCE_FORMAT_V2,
                conversation_id: conversation.conversation_id.clone(),
                revision: conversation.revision,
                toolset_digest: conversation.toolset_digest.clone(),
                blocks: Vec::with_capacity(conversation.turns.iter().map(|turn| turn.blocks.len()).sum()),
                edges: Vec::new(),
                sequence_digest: Digest::of_bytes(b""),
            },
            edge_of_call: HashMap::with_capacity(conversation.turns.len()),
            numbers_exact: true,
            blocks_hash,
            sealed: 0,
            edges_hash,
            turns: 0,
            scratch: Vec::with_capacity(4096),
        }
    }

    /// Add one turn's blocks and edges; returns the edges its results answered.
    fn add_turn(&mut self, conversation: &Conversation, turn_index: usize) -> Vec<usize> {
        let turn = &conversation.turns[turn_index];
        self.turns += 1;
        let mut answered = Vec::new();
        // Invariant: validation rejects a turn with a missing id or unknown role and a block
        // with a missing id, so these are present in a `Validated` conversation.
        let turn_id = turn.id.as_deref().expect("validated turns have ids");
        self.numbers_exact &= turn
            .generation
            .is_none_or(|generation| generation.0 <= EXACT_INTEGER_MAX);
        let RoleField::Known(role) = turn.role else {
            unreachable!("validated turns have known roles")
        };
        let sequence = &mut self.sequence;
        for block in &turn.blocks {
            let block_id = block.id.clone().expect("validated blocks have ids");
            let trust = match (&block.body, role) {
                (
                    BlockBody::Context {
                        trust: Trust::Trusted,
                        ..
                    },
                    _,
                ) => TrustLabel::Trusted,
                (
                    BlockBody::Context {
                        trust: Trust::Untrusted,
                        ..
                    },
                    _,
                ) => TrustLabel::Untrusted,
                (_, Role::System) => TrustLabel::Operator,
                (_, Role::User) => TrustLabel::User,
                (_, Role::Assistant) => TrustLabel::Model,
                (_, Role::Tool) => TrustLabel::Tool,
            };
            match &block.body {
                BlockBody::ToolCall {
                    call_id,
                    tool,
                    arguments,
                } => {
                    self.edge_of_call
                        .insert(call_id.as_str().to_owned(), sequence.edges.len());
                    sequence.edges.push(ToolEdge {
                        call_id: call_id.clone(),
                        tool: tool.clone(),
                        schema_digest: conversation.tool(tool).map(|def| def.schema_digest.clone()),
                        args_state: arguments.state(),
                        args_digest: arguments.digest().cloned(),
                        call_block: block_id.clone(),
                        generation: turn.generation,
                        result: None,
                        status: None,
                    });
                }
                BlockBody::ToolResult { call_id, status, .. } => {
                    // Invariant: validation rejects orphan and duplicate results.
                    let index = self.edge_of_call[call_id.as_str()];
                    let edge = &mut sequence.edges[index];
                    edge.result = Some(block_id.clone());
                    edge.status = Some(*status);
                    answered.push(index);
                }
                _ => {}
            }
            let entry = SequenceBlock {
                id: block_id,
                turn: turn_id.to_owned(),
                turn_index: turn_index as u32,
                order: sequence.blocks.len() as u32,
                role,
                kind: static_kind(&block.body),
                digest: block.digest.clone(),
                trust,
                generation: turn.generation,
            };
            if !sequence.blocks.is_empty() {
                self.scratch.push(b',');
            }
            write_block(&mut self.scratch, &entry);
            sequence.blocks.push(entry);
        }
        self.blocks_hash.update(&self.scratch);
        self.scratch.clear();
        answered
    }

    /// Move every edge answered since into the sealed bytes (edges in call order: the sealed
    /// prefix stops at the first open call).
    fn seal_edges(&mut self) {
        let answered = self
            .sequence
            .edges
            .iter()
            .skip(self.sealed)
            .take_while(|edge| edge.result.is_some())
            .count();
        let end = self.sealed + answered;
        hash_edges(
            &mut self.edges_hash,
            &mut self.scratch,
            &self.sequence.edges,
            self.sealed..end,
        );
        self.sealed = end;
    }

    /// Set the revision and the digest (after the last turn added).
    fn finish_revision(&mut self, conversation: &Conversation) {
        self.sequence.revision = conversation.revision;
        let sequence = &self.sequence;
        let (blocks, edges) = if self.numbers_exact {
            let mut blocks = self.blocks_hash.clone();
            blocks.update(b"]");
            let mut edges = self.edges_hash.clone();
            let open = self.sealed..sequence.edges.len();
            hash_edges(&mut edges, &mut self.scratch, &sequence.edges, open);
            edges.update(b"]");
            (blocks.finish(), edges.finish())
        } else {
            (
                Digest::of_canonical(&sequence.blocks),
                Digest::of_canonical(&sequence.edges),
            )
        };
        let form = DigestForm {
            blocks,
            conversation_id: &sequence.conversation_id,
            edges,
            format: sequence.format,
            revision: sequence.revision,
            toolset_digest: &sequence.toolset_digest,
        };
        self.sequence.sequence_digest = if sequence.revision.0 <= EXACT_INTEGER_MAX {
            Digest::of_sorted_serialization(&form)
        } else {
            Digest::of_canonical(&form)
        };
    }
}

/// What `sequence_digest` is taken over: the sequence with its two arrays each replaced by
/// the digest of its canonical form (fields in sorted order, as the fast path needs).
#[derive(Serialize)]
struct DigestForm<'a> {
    blocks: Digest,
    conversation_id: &'a str,
    edges: Digest,
    format: &'static str,
    revision: Revision,
    toolset_digest: &'a Digest,
}

/// Feed `edges[range]` to `hash` as members of the edges array (a comma before every edge but
/// the array's first), serialised into `scratch` and hashed in pieces of [`SCRATCH_FLUSH`].
fn hash_edges(
    hash: &mut HashState,
    scratch: &mut Vec<u8>,
    edges: &[ToolEdge],
    range: std::ops::Range<usize>,
) {
    for index in range {
        if index > 0 {
            scratch.push(b',');
        }
        write_edge(scratch, &edges[index]);
        if scratch.len() >= SCRATCH_FLUSH {
            hash.update(scratch);
            scratch.clear();
        }
    }
    hash.update(scratch);
    scratch.clear();
}

/// `serde_json::to_writer(out, entry)`, written by hand: the fields in declaration order
/// (sorted, module documentation), strings through serde_json's escapes
/// ([`push_json_string`]). The derived `Serialize` stays the definition;
/// `tests/it/sequence.rs` compares this digest with the generic one on generated sequences and
/// on ids that need escaping.
fn write_block(out: &mut Vec<u8>, entry: &SequenceBlock) {
    let SequenceBlock {
        digest,
        generation,
        id,
        kind,
        order,
        role,
        trust,
        turn,
        turn_index,
    } = entry;
    out.extend_from_slice(b"{\"digest\":");
    push_json_string(out, digest.as_str());
    out.extend_from_slice(b",\"generation\":");
    write_optional_number(out, generation.map(|generation| generation.0));
    out.extend_from_slice(b",\"id\":");
    push_json_string(out, id);
    out.extend_from_slice(b",\"kind\":");
    write_name(out, kind);
    out.extend_from_slice(b",\"order\":");
    write_number(out, u64::from(*order));
    out.extend_from_slice(b",\"role\":");
    write_name(out, role.as_str());
    out.extend_from_slice(b",\"trust\":");
    write_name(out, trust_name(*trust));
    out.extend_from_slice(b",\"turn\":");
    push_json_string(out, turn);
    out.extend_from_slice(b",\"turn_index\":");
    write_number(out, u64::from(*turn_index));
    out.push(b'}');
}

/// `serde_json::to_writer(out, edge)`, written by hand as [`write_block`] is.
fn write_edge(out: &mut Vec<u8>, edge: &ToolEdge) {
    let ToolEdge {
        args_digest,
        args_state,
        call_block,
        call_id,
        generation,
        result,
        schema_digest,
        status,
        tool,
    } = edge;
    out.extend_from_slice(b"{\"args_digest\":");
    write_optional_string(out, args_digest.as_ref().map(Digest::as_str));
    out.extend_from_slice(b",\"args_state\":");
    write_name(
        out,
        match args_state {
            ArgState::Closed => "closed",
            ArgState::Open => "open",
            ArgState::Invalid => "invalid",
        },
    );
    out.extend_from_slice(b",\"call_block\":");
    push_json_string(out, call_block);
    out.extend_from_slice(b",\"call_id\":");
    push_json_string(out, call_id.as_str());
    out.extend_from_slice(b",\"generation\":");
    write_optional_number(out, generation.map(|generation| generation.0));
    out.extend_from_slice(b",\"result\":");
    write_optional_string(out, result.as_deref());
    out.extend_from_slice(b",\"schema_digest\":");
    write_optional_string(out, schema_digest.as_ref().map(Digest::as_str));
    out.extend_from_slice(b",\"status\":");
    match status {
        Some(status) => write_name(
            out,
            match status {
                ResultStatus::Success => "success",
                ResultStatus::Error => "error",
                ResultStatus::Cancel => "cancel",
            },
        ),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b",\"tool\":");
    push_json_string(out, tool);
    out.push(b'}');
}

fn trust_name(trust: TrustLabel) -> &'static str {
    match trust {
        TrustLabel::Operator => "operator",
        TrustLabel::User => "user",
        TrustLabel::Model => "model",
        TrustLabel::Tool => "tool",
        TrustLabel::Trusted => "trusted",
        TrustLabel::Untrusted => "untrusted",
    }
}

fn write_number(out: &mut Vec<u8>, number: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(number).as_bytes());
}

fn write_optional_number(out: &mut Vec<u8>, number: Option<u64>) {
    match number {
        Some(number) => write_number(out, number),
        None => out.extend_from_slice(b"null"),
    }
}

/// A name of ours (kind, role, trust label, state): lowercase ASCII and `_`, nothing to escape.
fn write_name(out: &mut Vec<u8>, name: &'static str) {
    debug_assert!(name.bytes().all(|byte| byte.is_ascii_lowercase() || byte == b'_'));
    out.push(b'"');
    out.extend_from_slice(name.as_bytes());
    out.push(b'"');
}

fn write_optional_string(out: &mut Vec<u8>, text: Option<&str>) {
    match text {
        Some(text) => push_json_string(out, text),
        None => out.extend_from_slice(b"null"),
    }
}

fn static_kind(body: &BlockBody) -> &'static str {
    match body {
        BlockBody::Text { .. } => "text",
        BlockBody::Image { .. } => "image",
        BlockBody::ToolCall { .. } => "tool_call",
        BlockBody::ToolResult { .. } => "tool_result",
        BlockBody::Context { .. } => "context",
        BlockBody::Document { .. } => "document",
        BlockBody::Reasoning { .. } => "reasoning",
        BlockBody::Unknown { .. } | BlockBody::Malformed => {
            unreachable!("validated blocks have v1 kinds")
        }
    }
}
