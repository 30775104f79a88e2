//! The would-be history check shared by every write that appends a turn: append, canonical
//! commit and tool result. The stored turns up to the expected revision plus the new turn are
//! decoded as one `turnstile.conversation.v1` document and run through the core validator;
//! a `rejected` verdict refuses the write, `ready` and `waiting` accept it.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - the store's append, tool-result and commit checks find exactly what validating the whole
//!   would-be history finds, walking only the new turn when the validator's state after the stored
//!   revision is kept (kept only after the write committed). Enforced in `core/src/validate.rs`
//!   (`Walk<K>`: one walk for `validate` and `History`), `store/src/history.rs` (`ValidationCache`,
//!   `check_next`), `ops.rs::check_turn`. Tests: `core/tests/it/history.rs` (every split of every
//!   data file and of 256 generated histories),
//!   `store/tests/it/conformance.rs::appends_and_commits_after_the_first_check_only_the_new_turn…`
//!   (SQLite and PostgreSQL; `Ledger::history_walks`; red with the state never found), `testkit`
//!   seeds (two replicas on one file).
//! - the validator states a ledger keeps are bounded (65,536 conversations, 1,000,000 turns plus
//!   blocks) and the one put longest ago goes first; a created conversation keeps its empty
//!   history's state. Enforced in `store/src/history.rs::ValidationCache` (`StateMap`),
//!   `create_conversation` on both stores. Tests:
//!   `history.rs::tests::the_state_put_longest_ago_goes_first_at_either_bound`, store conformance
//!   `appends_and_commits_after_the_first_check_only_the_new_turn_and_refuse_the_same` (no walk for
//!   a created conversation's first turn).

use crate::error::StoreError;
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::sync::Mutex;
use turnstile_core::conversation::{Arguments, BlockBody, Conversation, FORMAT_V1, Turn, Unreadable};
use turnstile_core::validate::History;
use turnstile_core::{Digest, Revision, Verdict, Violation, ViolationCode, limits};

/// Most conversations whose validation state a ledger keeps in memory.
pub(crate) const VALIDATION_CACHE_MAX: usize = 65_536;
/// Most turns and blocks, summed over the states kept (a state holds the ids of its history's
/// turns, blocks and calls: about 100 bytes per block, so about 100 MiB at this bound).
pub(crate) const VALIDATION_CACHE_WEIGHT_MAX: usize = 1_000_000;

/// The validator's state after each recently written conversation's last turn, by conversation
/// and revision, so the next append checks the new turn only (issue 21: work proportional to
/// what changed). A revision's history never changes once committed, so a state is valid for
/// as long as it is kept; it is put only after the transaction that wrote that revision
/// committed, and taken (not copied) by the next check, which puts the next one back.
#[derive(Default)]
pub(crate) struct ValidationCache {
    states: Mutex<StateMap>,
    /// Checks that found no state and read and walked the whole history.
    walks: std::sync::atomic::AtomicU64,
    /// Of those, the walks made inside a write transaction (`States::walk`).
    walks_in_transaction: std::sync::atomic::AtomicU64,
}

/// The kept states, and the order they were put in: when either bound is reached, the state
/// put longest ago goes first (an agent loop's conversation is put again at every step, so the
/// ones that go are those nobody wrote to for longest).
#[derive(Default)]
struct StateMap {
    map: HashMap<String, Kept>,
    /// (put number, conversation) in put order; an entry whose conversation was put again
    /// since, or taken, is stale and skipped.
    order: std::collections::VecDeque<(u64, String)>,
    puts: u64,
    /// Turns plus blocks over the states in `map`.
    weight: usize,
    /// Other bounds than the constants (tests).
    bounds: Option<(usize, usize)>,
}

struct Kept {
    revision: Revision,
    history: History,
    put: u64,
}

fn weight_of(history: &History) -> usize {
    let (turns, blocks) = history.counts();
    turns + blocks + 1
}

impl StateMap {
    fn remove(&mut self, conversation_id: &str) -> Option<Kept> {
        let kept = self.map.remove(conversation_id)?;
        self.weight -= weight_of(&kept.history);
        Some(kept)
    }

    fn insert(&mut self, conversation_id: String, revision: Revision, history: History) {
        // Revisions only grow: a state put late (its caller scheduled after a later write's)
        // never replaces a newer one.
        if self
            .map
            .get(&conversation_id)
            .is_some_and(|kept| kept.revision > revision)
        {
            return;
        }
        let _ = self.remove(&conversation_id);
        self.puts += 1;
        self.weight += weight_of(&history);
        self.order.push_back((self.puts, conversation_id.clone()));
        self.map.insert(
            conversation_id,
            Kept {
                revision,
                history,
                put: self.puts,
            },
        );
        let (count_max, weight_max) = self
            .bounds
            .unwrap_or((VALIDATION_CACHE_MAX, VALIDATION_CACHE_WEIGHT_MAX));
        while self.map.len() > count_max || self.weight > weight_max {
            let Some((put, oldest)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&oldest).is_some_and(|kept| kept.put == put) {
                let _ = self.remove(&oldest);
            }
        }
        // Stale entries (states taken or put again) are dropped once they are most of the log.
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order
                .retain(|(put, id)| map.get(id).is_some_and(|kept| kept.put == *put));
        }
    }
}

/// The validator states a check inside a write transaction may use: the cache, and whether it
/// may read and walk the whole history itself on a miss. The SQLite writer may not (every
/// write of every conversation queues behind it): its check stops with
/// [`StoreError::HistoryNeeded`] instead, before it writes, and the ledger walks the history on
/// the caller ([`state_at`]) and runs the operation again, walking in the writer only if the
/// state is gone again by then.
pub(crate) struct States<'a> {
    pub cache: &'a ValidationCache,
    pub walk: bool,
}

impl States<'_> {
    /// [`ValidationCache::take`]; on a miss, `Ok(None)` when this check may walk (counted as a
    /// walk in a transaction), else `HistoryNeeded`.
    pub(crate) fn take(
        &self,
        conversation_id: &str,
        revision: Revision,
    ) -> Result<Option<History>, StoreError> {
        if let Some(history) = self.cache.take(conversation_id, revision) {
            return Ok(Some(history));
        }
        if !self.walk {
            return Err(StoreError::HistoryNeeded {
                conversation_id: conversation_id.to_owned(),
                revision: revision.0,
            });
        }
        self.cache
            .walks_in_transaction
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(None)
    }
}

impl ValidationCache {
    /// The state after `conversation_id` at `revision`, if kept (and legal); a miss is counted
    /// as a whole-history walk (the caller makes one).
    pub(crate) fn take(&self, conversation_id: &str, revision: Revision) -> Option<History> {
        let mut map = self
            .states
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match map.remove(conversation_id) {
            Some(kept) if kept.revision == revision && kept.history.is_legal() => Some(kept.history),
            _ => {
                self.walks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                None
            }
        }
    }

    /// Whole-history walks so far (`Ledger::history_walks`).
    pub(crate) fn walks(&self) -> u64 {
        self.walks.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Of those, the walks inside a write transaction (`Ledger::history_walks_in_transaction`).
    pub(crate) fn walks_in_transaction(&self) -> u64 {
        self.walks_in_transaction
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the state after `conversation_id` at `revision` is kept (a peek: nothing taken,
    /// no walk counted).
    pub(crate) fn holds(&self, conversation_id: &str, revision: Revision) -> bool {
        self.states
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .map
            .get(conversation_id)
            .is_some_and(|kept| kept.revision == revision)
    }

    /// Keep the state after a committed write (the one put longest ago goes first when a
    /// bound is reached).
    pub(crate) fn put(&self, next: Checked) {
        self.states
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(next.conversation_id, next.revision, next.history);
    }
}

/// The validation state a successful check leaves for the write's revision (for
/// [`ValidationCache::put`] once that write committed).
pub(crate) struct Checked {
    pub conversation_id: String,
    pub revision: Revision,
    pub history: History,
}

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

/// [`check_append`] from the validator's state after the stored history (`state`, from the
/// [`ValidationCache`]): only the new turn is decoded and walked. The same findings, in the
/// same order, as the whole check of a legal history with this turn (`tests/it/history.rs` in
/// turnstile-core; the store's conformance suite checks the refusals on both stores). On success the new turn's calls and the state after it.
pub(crate) fn check_next(mut state: History, new_turn: Value) -> Result<CheckedTurn, Vec<Violation>> {
    let (turn, decode_violations) = match Conversation::decode_turn(new_turn) {
        Ok(decoded) => decoded,
        Err(unreadable) => return Err(shape_violation(&unreadable.to_string())),
    };
    let (turns, blocks) = state.counts();
    if turns + 1 > limits::TURNS_MAX {
        let limit = Unreadable::Limit {
            what: "TURNS_MAX",
            actual: turns + 1,
            max: limits::TURNS_MAX,
        };
        return Err(shape_violation(&limit.to_string()));
    }
    if blocks + turn.blocks.len() > limits::BLOCKS_MAX {
        let limit = Unreadable::Limit {
            what: "BLOCKS_MAX",
            actual: blocks + turn.blocks.len(),
            max: limits::BLOCKS_MAX,
        };
        return Err(shape_violation(&limit.to_string()));
    }
    state.push(&turn, decode_violations);
    if let Verdict::Rejected(violations) = state.verdict() {
        return Err(violations);
    }
    Ok(CheckedTurn {
        calls: calls_of(&turn),
        history: state,
        digest: turn.digest(),
    })
}

/// A new turn that passed the would-be history check: its calls, the validator's state after
/// it, and its [`Turn::digest`] for its row (what a dispatch compares the stored turn with).
pub(crate) struct CheckedTurn {
    pub calls: Vec<NewToolCall>,
    pub history: History,
    pub digest: Digest,
}

/// The closed tool calls of a turn that passed the validator.
fn calls_of(turn: &Turn) -> Vec<NewToolCall> {
    let mut calls = Vec::new();
    for block in &turn.blocks {
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
    calls
}

/// [`check_append`], also giving the validator's state after the new turn.
pub(crate) fn check_append_state(
    conversation_id: &str,
    tools: &Value,
    history: Vec<Value>,
    new_turn: Value,
    new_revision: Revision,
) -> Result<CheckedTurn, Vec<Violation>> {
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
    let state = History::of(&conversation);
    if let Verdict::Rejected(violations) = state.verdict() {
        return Err(violations);
    }
    let Some(last) = conversation.turns.last() else {
        return Err(shape_violation("no turn to append"));
    };
    Ok(CheckedTurn {
        calls: calls_of(last),
        history: state,
        digest: last.digest(),
    })
}

/// The validator's state after a stored history (`turns`, the conversation's turns up to
/// `revision`), walked outside any write transaction, for [`ValidationCache::put`]: `None`
/// when the history does not decode or is not legal (a check inside the transaction then walks
/// it and reports what it finds).
pub(crate) fn state_at(
    conversation_id: &str,
    tools: &Value,
    turns: Vec<Value>,
    revision: Revision,
) -> Option<Checked> {
    let document = json!({
        "format": FORMAT_V1,
        "conversation_id": conversation_id,
        "revision": revision.0,
        "tools": tools,
        "turns": turns,
    });
    let conversation = Conversation::from_value(document).ok()?;
    let history = History::of(&conversation);
    history.is_legal().then(|| Checked {
        conversation_id: conversation_id.to_owned(),
        revision,
        history,
    })
}

/// An imported history, stamped and checked before its transaction: the turns as they will be
/// stored and the validator's state after the last one (for the [`ValidationCache`] once the
/// import committed, so the first commit after an import checks its new turn only).
pub(crate) struct CheckedImport {
    /// Each turn's row, written out here, on the caller: the writer only copies them into its
    /// statement's parameters.
    pub turns: Vec<StampedTurn>,
    pub revision: Revision,
    /// The validator's state after the history, until the write that stored it takes it to
    /// keep (`None` after: a second run of that write keeps nothing, and the next check of
    /// the conversation walks its history).
    pub history: Option<History>,
}

/// A stamped turn as its `turns` row holds it.
pub(crate) struct StampedTurn {
    pub revision: Revision,
    pub generation: Option<u64>,
    pub role: String,
    /// The stamped turn's JSON text.
    pub text: String,
    /// [`Turn::digest`] of the turn as the check decoded it.
    pub digest: Digest,
}

impl StampedTurn {
    /// The row of `turn`, which carries its stamps (`revision`, and `generation` when it has
    /// one) already, with `digest` from the check that decoded it.
    pub(crate) fn of(turn: &Value, revision: Revision, digest: Digest) -> StampedTurn {
        StampedTurn {
            revision,
            generation: turn.get("generation").and_then(Value::as_u64),
            role: role_of(turn),
            text: turn.to_string(),
            digest,
        }
    }
}

/// Stamp and validate a whole history at once (an import), as one document: `rejected`
/// refuses it. It reads nothing stored, so it runs on the caller, never in the writer; the
/// stamped turns move into the document checked, after their rows are written out.
pub(crate) fn check_import(
    conversation_id: &str,
    tools: &Value,
    turns: &[Value],
) -> Result<CheckedImport, Vec<Violation>> {
    if turns.is_empty() {
        return Err(shape_violation("an imported history needs at least one turn"));
    }
    let mut stamped = Vec::with_capacity(turns.len());
    // (revision, generation, role, text) of each row, written out before the turns move into
    // the document; the digests come from its decode.
    let mut rows = Vec::with_capacity(turns.len());
    for (index, turn) in turns.iter().enumerate() {
        let revision = Revision(index as u64 + 1);
        let Some(turn) = stamp_turn(turn, revision, None) else {
            return Err(shape_violation("a turn must be an object"));
        };
        rows.push((
            revision,
            turn.get("generation").and_then(Value::as_u64),
            role_of(&turn),
            turn.to_string(),
        ));
        stamped.push(turn);
    }
    let revision = Revision(stamped.len() as u64);
    let mut document = Map::new();
    document.insert("format".into(), FORMAT_V1.into());
    document.insert("conversation_id".into(), conversation_id.into());
    document.insert("revision".into(), revision.0.into());
    document.insert("tools".into(), tools.clone());
    document.insert("turns".into(), Value::Array(stamped));
    let conversation = match Conversation::from_value(Value::Object(document)) {
        Ok(conversation) => conversation,
        Err(unreadable) => return Err(shape_violation(&unreadable.to_string())),
    };
    let history = History::of(&conversation);
    if let Verdict::Rejected(violations) = history.verdict() {
        return Err(violations);
    }
    let rows = rows
        .into_iter()
        .zip(&conversation.turns)
        .map(|((revision, generation, role, text), turn)| StampedTurn {
            revision,
            generation,
            role,
            text,
            digest: turn.digest(),
        })
        .collect();
    Ok(CheckedImport {
        turns: rows,
        revision,
        history: Some(history),
    })
}

/// The `role` string of a turn, if it has one.
pub(crate) fn role_of(turn: &Value) -> String {
    turn.get("role").and_then(Value::as_str).unwrap_or("").to_owned()
}

#[cfg(test)]
mod tests {
    use super::{Checked, VALIDATION_CACHE_MAX, ValidationCache};
    use serde_json::json;
    use turnstile_core::Revision;
    use turnstile_core::conversation::Conversation;
    use turnstile_core::validate::History;

    /// The state after a history of one user turn of `blocks` text blocks.
    fn state(id: &str, blocks: usize) -> Checked {
        let blocks: Vec<_> = (0..blocks)
            .map(|index| json!({"id": format!("b{index}"), "kind": "text", "text": "x"}))
            .collect();
        let conversation = Conversation::from_value(json!({
            "format": "turnstile.conversation.v1", "conversation_id": id, "revision": 1, "tools": [],
            "turns": [{"id": "t1", "revision": 1, "role": "user", "blocks": blocks}]}))
        .unwrap();
        let history = History::of(&conversation);
        assert!(history.is_legal());
        Checked {
            conversation_id: id.to_owned(),
            revision: Revision(1),
            history,
        }
    }

    /// Issue 21: the cache keeps up to `VALIDATION_CACHE_MAX` conversations (a benchmark or a
    /// busy gateway has well over a thousand live ones), and when a bound is reached the state
    /// put longest ago goes first, never one put since; states put again move to the back.
    #[test]
    fn the_state_put_longest_ago_goes_first_at_either_bound() {
        let cache = ValidationCache::default();
        for index in 0..VALIDATION_CACHE_MAX {
            cache.put(state(&format!("c{index}"), 1));
        }
        // c0 is put again: c1 is now the oldest.
        cache.put(state("c0", 1));
        cache.put(state("one-more", 1));
        assert!(cache.holds("c0", Revision(1)), "put again: kept");
        assert!(!cache.holds("c1", Revision(1)), "the oldest goes");
        assert!(cache.holds("c2", Revision(1)));
        assert!(cache.holds("one-more", Revision(1)));
        assert!(cache.take("c2", Revision(1)).is_some());
        assert!(!cache.holds("c2", Revision(1)), "taken, not copied");
        // A state put late never replaces a newer one.
        let mut newer = state("c3", 1);
        newer.revision = Revision(2);
        cache.put(newer);
        cache.put(state("c3", 1));
        assert!(cache.holds("c3", Revision(2)), "the newer state stays");

        // By weight (a bound of 4,000 turns and blocks here): a state of about a quarter of it,
        // four times and a small one after: the oldest goes first.
        let cache = ValidationCache::default();
        cache.states.lock().unwrap().bounds = Some((VALIDATION_CACHE_MAX, 4_000));
        cache.put(state("small-before", 1));
        let quarter = 1_020;
        for index in 0..4 {
            cache.put(state(&format!("big{index}"), quarter - 10));
        }
        cache.put(state("small-after", 1));
        assert!(cache.holds("small-after", Revision(1)));
        assert!(cache.holds("big3", Revision(1)));
        assert!(!cache.holds("small-before", Revision(1)), "the oldest goes first");
        assert!(!cache.holds("big0", Revision(1)), "then the next oldest");
        assert!(
            cache.holds("big1", Revision(1)),
            "and no more than the bound asks"
        );
        let weight = cache.states.lock().unwrap().weight;
        assert!(weight <= 4_000, "{weight}");
        let kept = cache.states.lock().unwrap().map.len();
        let log = cache.states.lock().unwrap().order.len();
        assert!(
            log <= 2 * kept + 64,
            "the order log is compacted: {log} for {kept}"
        );
    }
}
