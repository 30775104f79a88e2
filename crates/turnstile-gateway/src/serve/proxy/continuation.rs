//! Stateless clients resend the whole history with every request. When a request continues a
//! conversation this gateway committed — its last assistant turn with tool calls is one we
//! committed, and everything up to where our stored history ends means the same — the new turns
//! (typically the tool results, maybe a new user message) are appended to that conversation
//! instead of storing the whole history again. So storage grows with what is new, not with the
//! square of the session's length; the tool results close their calls in the execution ledger;
//! and `GET /v1/conversations/{id}` shows the agent's whole session.
//!
//! The lookup key is a call id (`Ledger::conversations_with_call`, scoped to the caller's proxy
//! conversations); the match is `semantic_diff` over the stored turns, tools included. Anything
//! else — no call, a different meaning (the client edited or trimmed its history), a stored
//! conversation that does not end with a committed assistant turn (another request already
//! continued it, and its dispatch may be running), a revision that moved under us — falls back to
//! a fresh conversation: continuation saves storage, it never changes what is sent.

use super::super::{Shared, now};
use super::previous::renamed;
use serde_json::{Value, json};
use std::sync::Arc;
use turnstile_adapters::import::semantic_diff;
use turnstile_core::Revision;
use turnstile_store::AppendOutcome;

/// A stored conversation the request continues, with the request's new turns appended.
pub struct Continued {
    /// Store id of the conversation.
    pub conversation_id: String,
    /// Its history after the append (`turnstile.conversation.v1`).
    pub document: Value,
}

/// The first call id of the imported history's last assistant turn that has calls.
fn last_call_id(document: &Value) -> Option<(usize, &str)> {
    let turns = document["turns"].as_array()?;
    turns.iter().enumerate().rev().find_map(|(index, turn)| {
        if turn["role"] != "assistant" {
            return None;
        }
        turn["blocks"]
            .as_array()?
            .iter()
            .find(|block| block["kind"] == "tool_call")
            .and_then(|block| block["call_id"].as_str())
            .map(|call_id| (index, call_id))
    })
}

/// Find the conversation `imported` continues and append its new turns; None when there is
/// none (or it moved), and the caller stores a fresh conversation instead.
pub async fn find_and_append(shared: &Arc<Shared>, id_prefix: &str, imported: &Value) -> Option<Continued> {
    let (assistant_index, call_id) = last_call_id(imported)?;
    let new_turns = imported["turns"].as_array()?;
    let candidates = match shared.ledger.conversations_with_call(call_id, id_prefix).await {
        Ok(candidates) => candidates,
        Err(error) => {
            tracing::warn!(%error, "continuation lookup failed; storing a fresh conversation");
            return None;
        }
    };
    for conversation_id in candidates {
        let Ok(Some(stored)) = shared.ledger.conversation(&conversation_id).await else {
            continue;
        };
        let stored_turns = stored["turns"].as_array().map_or(&[][..], Vec::as_slice);
        let stored_count = stored_turns.len();
        // Our history must end at or after the assistant turn the key came from, and the request
        // must bring something new after it.
        if stored_count <= assistant_index || stored_count >= new_turns.len() {
            continue;
        }
        // Only a conversation that ends with a committed assistant turn takes appends: once a
        // continuation appended after it, a dispatch may be running at that revision, and a
        // second append would make its commit lose (a paid answer quarantined). The append's
        // compare-and-set on the revision decides between two requests continuing at once; the
        // loser forks into a fresh conversation.
        if stored_turns.last().is_none_or(|turn| turn["role"] != "assistant") {
            continue;
        }
        let mut prefix = imported.clone();
        prefix["turns"] = Value::Array(new_turns[..stored_count].to_vec());
        prefix["revision"] = json!(stored_count);
        if !semantic_diff(&stored, &prefix).is_empty() {
            continue;
        }
        let rename = format!("r{stored_count}-");
        let mut revision = Revision(stored_count as u64);
        for turn in &new_turns[stored_count..] {
            let mut turn = renamed(turn, &rename);
            if let Some(object) = turn.as_object_mut() {
                object.remove("revision");
            }
            match shared
                .ledger
                .append_turn(&conversation_id, revision, &turn, now())
                .await
            {
                Ok(AppendOutcome::Appended { revision: next }) => revision = next,
                // Moved under us, or the combination is illegal after all: fresh conversation.
                _ => return None,
            }
        }
        let document = shared.ledger.conversation(&conversation_id).await.ok()??;
        return Some(Continued {
            conversation_id,
            document,
        });
    }
    None
}
