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
//!
//! The importer is stateless, so it stamps every imported assistant turn with generation 1 and
//! every result with the generation of its call in the imported history. A call we committed
//! may carry another generation (a retried dispatch commits at generation 2 or later), so each
//! appended result takes the generation of the stored call it answers ([`pair_results`]);
//! otherwise the append would be `result_mismatch` and the follow-up would fork, leaving the
//! calls claimed.
//!
//! A follow-up that carries a call we handed to the client but is not appended (the client
//! dropped `tools`, edited or trimmed its history, or retried an earlier step) forks: the
//! client's session goes on in the fresh conversation, and the calls it still held in the
//! stored one would wait there for ever. When the request's call was made by the stored
//! conversation's assistant turn at the same position and the turns before it mean the same
//! (tools aside), it is a follow-up of the same client, and the calls handed to it in that
//! conversation as it stood end now (`client_abandoned`, [`abandon_forked`]). Abandonment is bookkeeping: a later
//! follow-up that does continue that conversation still appends its results, which close the
//! calls. A client that rewrites call ids or sends results as user text leaves no key to find
//! the stored conversation by; its calls end when their bound runs out.
//!
//! Prompt-cache breakpoints belong to the request that carries them: a client moves its
//! breakpoint to the newest turn on every request, so the marks stored with earlier requests'
//! turns are not this request's. The continued history is rendered with exactly the request's
//! marks ([`with_request_marks`]); marks are outside every digest, so this changes no
//! digest and nothing stored.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a stateless follow-up after a retried dispatch continues its conversation (results take the
//!   stored call's generation). Enforced in `proxy/continuation.rs::pair_results`,
//!   `proxy/previous.rs::splice`. Tests:
//!   `proxy.rs::a_stateless_follow_up_after_a_retried_dispatch_continues_its_conversation`.

use super::previous::renamed;
use serde_json::{Value, json};
use turnstile_adapters::import::semantic_diff;
use turnstile_core::Revision;
use turnstile_core::dispatch::Timestamp;
use turnstile_store::{AppendOutcome, Ledger};

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

/// The generation of every call in a stored history, by call id (the generation of the
/// assistant turn that made it).
fn call_generations(turns: &[Value]) -> std::collections::HashMap<String, Value> {
    let mut generations = std::collections::HashMap::new();
    for turn in turns.iter().filter(|turn| turn["role"] == "assistant") {
        let blocks = turn["blocks"].as_array().map_or(&[][..], Vec::as_slice);
        for block in blocks.iter().filter(|block| block["kind"] == "tool_call") {
            if let Some(call_id) = block["call_id"].as_str() {
                generations.insert(call_id.to_owned(), turn["generation"].clone());
            }
        }
    }
    generations
}

/// Give each tool result of `turn` the generation of the stored call it answers (results of
/// calls made in the request's own new turns keep the importer's).
fn pair_results(turn: &mut Value, generations: &std::collections::HashMap<String, Value>) {
    let Some(blocks) = turn["blocks"].as_array_mut() else {
        return;
    };
    for block in blocks.iter_mut().filter(|block| block["kind"] == "tool_result") {
        let generation = block["call_id"]
            .as_str()
            .and_then(|call_id| generations.get(call_id))
            .filter(|generation| generation.is_u64())
            .cloned();
        if let Some(generation) = generation {
            block["generation"] = generation;
        }
    }
}

/// Find the conversation `imported` continues and append its new turns; None when there is
/// none (or it moved), and the caller stores a fresh conversation instead.
pub async fn find_and_append(
    ledger: &dyn Ledger,
    id_prefix: &str,
    imported: &Value,
    now: Timestamp,
) -> Option<Continued> {
    let (assistant_index, call_id) = last_call_id(imported)?;
    let new_turns = imported["turns"].as_array()?;
    let candidates = match ledger.conversations_with_call(call_id, id_prefix).await {
        Ok(candidates) => candidates,
        Err(error) => {
            tracing::warn!(%error, "continuation lookup failed; storing a fresh conversation");
            return None;
        }
    };
    // Stored conversations of the same client that this request leaves, each with the
    // revision it was read at.
    let mut forked_from = Vec::new();
    for conversation_id in candidates {
        let Ok(Some(stored)) = ledger.conversation(&conversation_id).await else {
            continue;
        };
        let stored_turns = stored["turns"].as_array().map_or(&[][..], Vec::as_slice);
        let stored_count = stored_turns.len();
        // Our history must end at or after the assistant turn the key came from.
        if stored_count <= assistant_index {
            continue;
        }
        match append_onto(ledger, &conversation_id, &stored, imported, now).await {
            Appending::Appended => {
                let document = ledger.conversation(&conversation_id).await.ok()??;
                return Some(Continued {
                    conversation_id,
                    document,
                });
            }
            Appending::Failed => {
                forked_from.push((conversation_id, Revision(stored_count as u64)));
                break;
            }
            Appending::NotContinued => {
                if same_branch(stored_turns, new_turns, assistant_index, call_id) {
                    forked_from.push((conversation_id, Revision(stored_count as u64)));
                }
            }
        }
    }
    abandon_forked(ledger, &forked_from).await;
    None
}

/// A request that never continues a stored conversation (one under an `Idempotency-Key`, which
/// keeps a conversation of its own) still leaves the conversation of its client that made its
/// last call: the calls the client held there end now, as at any fork.
pub async fn abandon_left_behind(ledger: &dyn Ledger, id_prefix: &str, imported: &Value) {
    let Some((assistant_index, call_id)) = last_call_id(imported) else {
        return;
    };
    let new_turns = imported["turns"].as_array().map_or(&[][..], Vec::as_slice);
    let Ok(candidates) = ledger.conversations_with_call(call_id, id_prefix).await else {
        return;
    };
    let mut forked_from = Vec::new();
    for conversation_id in candidates {
        let Ok(Some(stored)) = ledger.conversation(&conversation_id).await else {
            continue;
        };
        let stored_turns = stored["turns"].as_array().map_or(&[][..], Vec::as_slice);
        if same_branch(stored_turns, new_turns, assistant_index, call_id) {
            forked_from.push((conversation_id, Revision(stored_turns.len() as u64)));
        }
    }
    abandon_forked(ledger, &forked_from).await;
}

/// What became of a request's turns offered to one stored conversation.
enum Appending {
    /// Appended: the request continues it.
    Appended,
    /// It does not continue it (nothing was appended).
    NotContinued,
    /// An append failed (the conversation moved under us, or the combination is illegal after
    /// all); turns appended before it stay, as legal history.
    Failed,
}

/// Append the request's turns after `stored`'s when the request continues it.
async fn append_onto(
    ledger: &dyn Ledger,
    conversation_id: &str,
    stored: &Value,
    imported: &Value,
    now: Timestamp,
) -> Appending {
    let stored_turns = stored["turns"].as_array().map_or(&[][..], Vec::as_slice);
    let new_turns = imported["turns"].as_array().map_or(&[][..], Vec::as_slice);
    let stored_count = stored_turns.len();
    // The request must bring something new after our history.
    if stored_count >= new_turns.len() {
        return Appending::NotContinued;
    }
    // Only a conversation that ends with a committed assistant turn takes appends: once a
    // continuation appended after it, a dispatch may be running at that revision, and a
    // second append would make its commit lose (a paid answer quarantined). The append's
    // compare-and-set on the revision decides between two requests continuing at once; the
    // loser forks into a fresh conversation.
    if stored_turns.last().is_none_or(|turn| turn["role"] != "assistant") {
        return Appending::NotContinued;
    }
    let mut prefix = imported.clone();
    prefix["turns"] = Value::Array(new_turns[..stored_count].to_vec());
    prefix["revision"] = json!(stored_count);
    if !semantic_diff(stored, &prefix).is_empty() {
        return Appending::NotContinued;
    }
    let generations = call_generations(stored_turns);
    let rename = format!("r{stored_count}-");
    let mut revision = Revision(stored_count as u64);
    for turn in &new_turns[stored_count..] {
        let mut turn = renamed(turn, &rename);
        if let Some(object) = turn.as_object_mut() {
            object.remove("revision");
        }
        pair_results(&mut turn, &generations);
        match ledger.append_turn(conversation_id, revision, &turn, now).await {
            Ok(AppendOutcome::Appended { revision: next }) => revision = next,
            _ => return Appending::Failed,
        }
    }
    Appending::Appended
}

/// Whether the request is a follow-up of the client that received the stored conversation's
/// assistant turn at `assistant_index`, not another conversation that happens to share a call
/// id: that stored turn made `call_id` (the request's key), and the turns before it mean what
/// the request's do, tools aside. The assistant turn itself is not compared: clients rewrite
/// it (a framework that drops the text beside tool calls still carries our call ids).
fn same_branch(stored_turns: &[Value], new_turns: &[Value], assistant_index: usize, call_id: &str) -> bool {
    if stored_turns.len() <= assistant_index || new_turns.len() <= assistant_index {
        return false;
    }
    let made_it = stored_turns[assistant_index]["role"] == "assistant"
        && stored_turns[assistant_index]["blocks"]
            .as_array()
            .is_some_and(|blocks| {
                blocks
                    .iter()
                    .any(|block| block["kind"] == "tool_call" && block["call_id"] == call_id)
            });
    let before = |turns: &[Value]| json!({"tools": [], "turns": turns[..assistant_index].to_vec()});
    made_it && semantic_diff(&before(stored_turns), &before(new_turns)).is_empty()
}

/// A follow-up of the same client forked away from each of these conversations as it stood at
/// its revision: the calls it still held there end now (`client_abandoned`, by the store's
/// clock). Best effort: a failure leaves them to their bound.
async fn abandon_forked(ledger: &dyn Ledger, forked_from: &[(String, Revision)]) {
    for (conversation_id, revision) in forked_from {
        match ledger.abandon_client_calls(conversation_id, *revision).await {
            Ok(0) => {}
            Ok(calls) => {
                crate::serve::metrics::client_forks(calls);
                tracing::info!(
                    conversation_id = %conversation_id,
                    revision = revision.0,
                    calls,
                    "a follow-up of the proxy client forked: its calls there are client_abandoned"
                );
            }
            Err(error) => {
                tracing::warn!(%error, "abandoning a forked proxy conversation's calls failed; their bound ends them");
            }
        }
    }
}

/// `stored` (the continued history) with every block's and tool's `cache` breakpoint replaced by
/// the one `request` (the imported request, whose turns line up with `stored`'s one for one)
/// puts at the same place: a turn whose blocks do not line up keeps no mark.
pub fn with_request_marks(mut stored: Value, request: &Value) -> Value {
    use turnstile_core::conversation::CACHE_FIELD;
    let request_turns = request["turns"].as_array().map_or(&[][..], Vec::as_slice);
    if let Some(turns) = stored["turns"].as_array_mut() {
        for (index, turn) in turns.iter_mut().enumerate() {
            let request_blocks = request_turns
                .get(index)
                .and_then(|turn| turn["blocks"].as_array())
                .map_or(&[][..], Vec::as_slice);
            let Some(blocks) = turn["blocks"].as_array_mut() else {
                continue;
            };
            let lined_up = blocks.len() == request_blocks.len();
            for (position, block) in blocks.iter_mut().enumerate() {
                let mark = request_blocks
                    .get(position)
                    .filter(|_| lined_up)
                    .and_then(|block| block.get(CACHE_FIELD))
                    .cloned();
                set_mark(block, mark);
            }
        }
    }
    let request_tools = request["tools"].as_array().map_or(&[][..], Vec::as_slice);
    if let Some(tools) = stored["tools"].as_array_mut() {
        for tool in tools {
            let mark = request_tools
                .iter()
                .find(|candidate| candidate["name"] == tool["name"])
                .and_then(|candidate| candidate.get(CACHE_FIELD))
                .cloned();
            set_mark(tool, mark);
        }
    }
    stored
}

fn set_mark(object: &mut Value, mark: Option<Value>) {
    let Some(map) = object.as_object_mut() else {
        return;
    };
    match mark {
        Some(mark) => {
            map.insert(turnstile_core::conversation::CACHE_FIELD.to_owned(), mark);
        }
        None => {
            map.remove(turnstile_core::conversation::CACHE_FIELD);
        }
    }
}
