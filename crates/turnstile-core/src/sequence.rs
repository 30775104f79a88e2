//! `MessageSequence v1`: the graph every adapter renders from.
//!
//! Built only from a [`Validated`] conversation, so it never holds an uncommitted, unknown or
//! unpaired block. Blocks keep their stable ids, role, kind, content digest, trust label and
//! order; tool edges link each call to its result. Nothing is ever concatenated into one
//! string: the graph is the boundary information adapters need.
//!
//! `sequence_digest` is `sha256:` over the RFC 8785 canonical JSON of the sequence (this
//! struct's serialisation without the digest field), so equal content gives equal digests on
//! every run and machine (`tests/it/sequence.rs` pins a few).
//!
//! Digest fast path: the structs below declare their fields in sorted order and hold only
//! strings, small integers and `null`s, so serde_json's compact serialisation of them *is*
//! their RFC 8785 form and can be hashed without building a `Value` first.
//! `tests/it/sequence.rs` checks the two byte-for-byte on generated sequences; any field added
//! out of order fails that test.

use crate::conversation::{ArgState, BlockBody, ResultStatus, Role, RoleField, Trust};
use crate::digest::Digest;
use crate::ids::{CallId, Generation, Revision};
use crate::validate::Validated;
use serde::Serialize;
use std::collections::HashMap;

/// Largest integer that JSON-as-IEEE-double (RFC 8785) and serde_json print identically.
const EXACT_INTEGER_MAX: u64 = 1 << 53;

/// The `format` string of a message sequence.
pub const SEQUENCE_FORMAT_V1: &str = "turnstile.sequence.v1";

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
    /// Always [`SEQUENCE_FORMAT_V1`].
    pub format: &'static str,
    /// Revision it was built at.
    pub revision: Revision,
    /// Digest of the declared tools.
    pub toolset_digest: Digest,
    /// `sha256:` over the canonical JSON of all fields above.
    #[serde(skip)]
    pub sequence_digest: Digest,
}

impl MessageSequence {
    /// Build the graph of a validated conversation.
    pub fn build(validated: Validated<'_>) -> MessageSequence {
        let conversation = validated.conversation();
        let block_count = conversation.turns.iter().map(|turn| turn.blocks.len()).sum();
        let mut blocks = Vec::with_capacity(block_count);
        let mut edges: Vec<ToolEdge> = Vec::new();
        let mut edge_of_call: HashMap<&str, usize> = HashMap::new();
        // The fast digest path below needs every number to print the same in serde_json and
        // in RFC 8785, which holds for integers up to 2^53.
        let mut numbers_exact = conversation.revision.0 <= EXACT_INTEGER_MAX;
        for (turn_index, turn) in conversation.turns.iter().enumerate() {
            // Invariant: validation rejects a turn with a missing id or unknown role and a
            // block with a missing id, so these are present in a `Validated` conversation.
            let turn_id = turn.id.as_deref().expect("validated turns have ids");
            numbers_exact &= turn
                .generation
                .is_none_or(|generation| generation.0 <= EXACT_INTEGER_MAX);
            let RoleField::Known(role) = turn.role else {
                unreachable!("validated turns have known roles")
            };
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
                        edge_of_call.insert(call_id.as_str(), edges.len());
                        edges.push(ToolEdge {
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
                        let edge = &mut edges[edge_of_call[call_id.as_str()]];
                        edge.result = Some(block_id.clone());
                        edge.status = Some(*status);
                    }
                    _ => {}
                }
                blocks.push(SequenceBlock {
                    id: block_id,
                    turn: turn_id.to_owned(),
                    turn_index: turn_index as u32,
                    order: blocks.len() as u32,
                    role,
                    kind: static_kind(&block.body),
                    digest: block.digest.clone(),
                    trust,
                    generation: turn.generation,
                });
            }
        }
        let mut sequence = MessageSequence {
            format: SEQUENCE_FORMAT_V1,
            conversation_id: conversation.conversation_id.clone(),
            revision: conversation.revision,
            toolset_digest: conversation.toolset_digest.clone(),
            blocks,
            edges,
            sequence_digest: Digest::of_bytes(b""),
        };
        sequence.sequence_digest = if numbers_exact {
            Digest::of_sorted_serialization(&sequence)
        } else {
            Digest::of_canonical(&sequence)
        };
        sequence
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
