//! The would-be history check shared by every write that appends a turn: append, canonical
//! commit and tool result. The stored turns up to the expected revision plus the new turn are
//! decoded as one `turnstile.conversation.v1` document and run through the core validator;
//! a `rejected` verdict refuses the write, `ready` and `waiting` accept it.

use serde_json::{Map, Value, json};
use turnstile_core::conversation::{Arguments, BlockBody, Conversation, FORMAT_V1};
use turnstile_core::{Revision, Verdict, Violation, ViolationCode, validate};

/// A tool call of a turn that passed the validator, ready for the execution ledger.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct NewToolCall {
    pub call_id: String,
    pub tool: String,
    pub arguments: Value,
    pub args_digest: String,
}

/// The new turn as stored: the caller's JSON with `revision` (and `generation`) set.
pub(crate) fn stamp_turn(turn: &Value, revision: Revision, generation: Option<u64>) -> Option<Value> {
    let mut map: Map<String, Value> = turn.as_object()?.clone();
    map.insert("revision".into(), json!(revision.0));
    if let Some(generation) = generation {
        map.insert("generation".into(), json!(generation));
    }
    Some(Value::Object(map))
}

fn shape_violation(message: &str) -> Vec<Violation> {
    vec![Violation {
        code: ViolationCode::InvalidStructure,
        turn: None,
        block: None,
        call_id: None,
        message: message.to_owned(),
    }]
}

/// Validate `history + [new_turn]`; on success the new turn's tool calls (closed arguments
/// only: the validator already refused anything else).
pub(crate) fn check_append(
    conversation_id: &str,
    tools: &Value,
    history: Vec<Value>,
    new_turn: Value,
    new_revision: Revision,
) -> Result<Vec<NewToolCall>, Vec<Violation>> {
    let mut turns = history;
    turns.push(new_turn);
    let document = json!({
        "format": FORMAT_V1,
        "conversation_id": conversation_id,
        "revision": new_revision.0,
        "tools": tools,
        "turns": turns,
    });
    let conversation = match Conversation::from_value(document) {
        Ok(conversation) => conversation,
        Err(unreadable) => return Err(shape_violation(&unreadable.to_string())),
    };
    if let Verdict::Rejected(violations) = validate(&conversation) {
        return Err(violations);
    }
    let Some(last) = conversation.turns.last() else {
        return Err(shape_violation("no turn to append"));
    };
    let mut calls = Vec::new();
    for block in &last.blocks {
        if let BlockBody::ToolCall {
            call_id,
            tool,
            arguments: Arguments::Closed { value, digest, .. },
        } = &block.body
        {
            calls.push(NewToolCall {
                call_id: call_id.0.clone(),
                tool: tool.clone(),
                arguments: Value::Object(value.clone()),
                args_digest: digest.as_str().to_owned(),
            });
        }
    }
    Ok(calls)
}

/// Validate a whole stamped history at once (an import): `rejected` refuses it.
pub(crate) fn check_document(
    conversation_id: &str,
    tools: &Value,
    turns: &[Value],
    revision: Revision,
) -> Result<(), Vec<Violation>> {
    if turns.is_empty() {
        return Err(shape_violation("an imported history needs at least one turn"));
    }
    let document = json!({
        "format": FORMAT_V1,
        "conversation_id": conversation_id,
        "revision": revision.0,
        "tools": tools,
        "turns": turns,
    });
    let conversation = match Conversation::from_value(document) {
        Ok(conversation) => conversation,
        Err(unreadable) => return Err(shape_violation(&unreadable.to_string())),
    };
    match validate(&conversation) {
        Verdict::Rejected(violations) => Err(violations),
        Verdict::Ready | Verdict::Waiting { .. } => Ok(()),
    }
}

/// The `role` string of a turn, if it has one.
pub(crate) fn role_of(turn: &Value) -> String {
    turn.get("role").and_then(Value::as_str).unwrap_or("").to_owned()
}
