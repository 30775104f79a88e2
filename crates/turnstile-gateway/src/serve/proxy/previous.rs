//! OpenAI Responses `previous_response_id`: continue from a response this gateway committed.
//!
//! A proxy response id is `resp_<conversation id>`, and that conversation's history ends with
//! the committed turn the client saw. A request naming it is answered like a stateless one whose
//! input is that history followed by the new input: the new input is imported on its own, its
//! turns are appended after the stored ones (ids prefixed so they stay unique), and each of its
//! tool results takes `tool`, `args_digest` and `generation` from the stored call it answers. As
//! at OpenAI, `instructions` and `tools` are not carried over: the new request's own (if any)
//! replace the stored system turn. The result is a new conversation, so two requests continuing
//! the same response fork instead of racing. Only a COMMITTED response can be continued.

use serde_json::{Value, json};
use std::collections::HashMap;
use turnstile_core::Conversation;
use turnstile_core::conversation::BlockBody;

/// Why a previous response cannot be continued.
#[derive(Debug, PartialEq, Eq)]
pub enum NotContinuable {
    /// The stored history cannot be read.
    Unreadable(String),
}

/// The conversation id (local, without tenant prefix) a proxy response id names.
pub fn conversation_of(previous_response_id: &str) -> Option<&str> {
    let local = previous_response_id.strip_prefix("resp_")?;
    local.starts_with("proxy-").then_some(local)
}

/// Splice the stored history and the newly imported document into one v1 document with the
/// new document's `conversation_id` and tools.
pub fn splice(stored: &Value, new: &Value) -> Result<Value, NotContinuable> {
    let conversation = Conversation::from_value(stored.clone())
        .map_err(|error| NotContinuable::Unreadable(error.to_string()))?;
    // call id → (tool, args digest, generation) of every stored call.
    let mut calls: HashMap<String, (String, Option<String>, Option<u64>)> = HashMap::new();
    for turn in &conversation.turns {
        for block in &turn.blocks {
            if let BlockBody::ToolCall {
                call_id,
                tool,
                arguments,
            } = &block.body
            {
                calls.insert(
                    call_id.0.clone(),
                    (
                        tool.clone(),
                        arguments.digest().map(|digest| digest.as_str().to_owned()),
                        turn.generation.map(|generation| generation.0),
                    ),
                );
            }
        }
    }
    let stored_turns = stored["turns"].as_array().cloned().unwrap_or_default();
    let new_turns = new["turns"].as_array().cloned().unwrap_or_default();
    let mut turns: Vec<Value> = Vec::with_capacity(stored_turns.len() + new_turns.len());
    let new_system: Vec<&Value> = new_turns.iter().filter(|turn| turn["role"] == "system").collect();
    let prefix = format!("r{}-", stored_turns.len());
    for turn in &new_system {
        turns.push(renamed(turn, &prefix));
    }
    turns.extend(stored_turns.into_iter().filter(|turn| turn["role"] != "system"));
    for turn in new_turns.iter().filter(|turn| turn["role"] != "system") {
        let mut turn = renamed(turn, &prefix);
        for block in turn["blocks"].as_array_mut().into_iter().flatten() {
            if block["kind"] != "tool_result" {
                continue;
            }
            let Some((tool, digest, generation)) = block["call_id"].as_str().and_then(|id| calls.get(id))
            else {
                continue;
            };
            block["tool"] = json!(tool);
            if let Some(digest) = digest {
                block["args_digest"] = json!(digest);
            }
            if let Some(generation) = generation {
                block["generation"] = json!(generation);
            }
        }
        turns.push(turn);
    }
    for (index, turn) in turns.iter_mut().enumerate() {
        turn["revision"] = json!(index + 1);
    }
    let mut document = new.clone();
    document["revision"] = json!(turns.len());
    document["turns"] = Value::Array(turns);
    Ok(document)
}

/// A turn with `prefix` before its id and its blocks' ids.
pub(crate) fn renamed(turn: &Value, prefix: &str) -> Value {
    let mut turn = turn.clone();
    if let Some(id) = turn["id"].as_str() {
        turn["id"] = json!(format!("{prefix}{id}"));
    }
    for block in turn["blocks"].as_array_mut().into_iter().flatten() {
        if let Some(id) = block["id"].as_str() {
            block["id"] = json!(format!("{prefix}{id}"));
        }
    }
    turn
}
