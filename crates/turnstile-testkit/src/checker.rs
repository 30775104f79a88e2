//! The history checker: the invariants of issue 7, evaluated against the real store (read
//! through the ledger's own API, as an operator would) and the world's record of what clients
//! and executors were shown. Evaluated after every step and at every send.

use crate::report::Invariant;
use crate::world::{CONVERSATION_ID, World, store};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use turnstile_adapters::AdapterId;
use turnstile_core::dispatch::DispatchState;
use turnstile_core::{Conversation, Digest, Generation, Verdict, validate};
use turnstile_store::Ledger;

/// The arguments of a committed call: a complete JSON object, valid for the declared schema
/// (`{"city": string}`, nothing else).
fn arguments_valid(arguments: &Value) -> bool {
    let parsed = match arguments {
        Value::String(text) => match serde_json::from_str::<Value>(text) {
            Ok(value) => value,
            Err(_) => return false,
        },
        other => other.clone(),
    };
    match parsed {
        Value::Object(map) => map.len() == 1 && map.get("city").is_some_and(Value::is_string),
        _ => false,
    }
}

impl World {
    /// At a send: the body is the manifest's bytes (SHA-256 equals its request digest and it
    /// re-renders from the pinned history with the pinned adapter), and a durable DISPATCHING
    /// row of that generation exists (`None`: of any generation).
    pub(crate) fn check_send(&mut self, op: &str, generation: Option<Generation>, target: u32, body: &[u8]) {
        self.report.checks += 1;
        let step = self.step;
        let Ok(Some(record)) = store!(self, dispatch(op)) else {
            self.report.illegal_sends += 1;
            self.report.violate(
                step,
                Invariant::IllegalSend,
                format!("{op}: sent without a stored dispatch"),
            );
            return;
        };
        // The manifest of the target the attempt sends (0: the dispatch's own).
        let manifest = if target == 0 {
            record.manifest.clone()
        } else {
            store!(self, dispatch_fallbacks(op))
                .ok()
                .and_then(|targets| targets.into_iter().find(|found| found.position == target))
                .map_or(serde_json::Value::Null, |found| found.manifest)
        };
        let manifest_digest = manifest["request_digest"].as_str().unwrap_or("").to_owned();
        let key = format!("{op}#{target}");
        let mut illegal = Vec::new();
        if Digest::of_bytes(body).as_str() != manifest_digest {
            illegal.push("body digest differs from the manifest's request_digest".to_owned());
        }
        if !self.history.rerendered.contains_key(&key) {
            let revision = manifest["conversation_revision"].as_u64().unwrap_or(0);
            let max_output = manifest["max_output_tokens"].as_u64();
            let model = manifest["model"].as_str().unwrap_or("").to_owned();
            let adapter = manifest["adapter"]
                .as_str()
                .and_then(|text| text.parse::<AdapterId>().ok());
            let conversation_id = manifest["conversation_id"].as_str().unwrap_or("").to_owned();
            let proxied = self.rerender_proxied(op, &conversation_id, revision, target);
            let digest = match (proxied, adapter) {
                (Some(digest), _) => digest,
                (None, Some(adapter)) => self
                    .render_for(revision, adapter, op, max_output, &model)
                    .map(|(manifest, _)| manifest.body.request_digest.as_str().to_owned()),
                (None, None) => Err("manifest names no known adapter".into()),
            };
            self.history.rerendered.insert(key.clone(), digest);
        }
        match &self.history.rerendered[&key] {
            Ok(digest) if *digest == manifest_digest => {}
            Ok(digest) => illegal.push(format!(
                "re-render gives {digest}, manifest pins {manifest_digest}"
            )),
            Err(error) => illegal.push(format!("history does not re-validate: {error}")),
        }
        if !illegal.is_empty() {
            self.report.illegal_sends += 1;
            self.report.violate(
                step,
                Invariant::IllegalSend,
                format!("{op}: {}", illegal.join("; ")),
            );
        }
        self.report.checks += 1;
        // Read through the independent connection: it sees only committed rows.
        let attempts = {
            let witness = self.witness();
            self.rt.block_on(witness.attempts(op)).unwrap_or_default()
        };
        let durable = attempts.iter().any(|attempt| {
            attempt.state == DispatchState::Dispatching && generation.is_none_or(|g| attempt.generation == g)
        });
        if !durable {
            self.report.violate(
                step,
                Invariant::SendBeforeDurable,
                format!(
                    "{op} g{:?}: bytes sent with no durable DISPATCHING row",
                    generation.map(|g| g.0)
                ),
            );
        }
    }

    /// At the send of a generation (by a driver on `replica`): no older generation of the
    /// operation still has a provider connection that a live driver reads — the checker looks
    /// at connections, not leases, so "its lease expired" (the code's own assumption) is no
    /// excuse for a holder that keeps reading — and the operation stays within its attempt
    /// budget. A stray stream no live driver reads (one a crash left running) is no
    /// violation: nothing of it can reach a client or the ledger.
    pub(crate) fn check_new_generation(&mut self, op: &str, generation: Generation, replica: usize) {
        self.report.checks += 1;
        let step = self.step;
        let store_now = self.now;
        let mut still_read: Vec<(u64, usize)> = self
            .conns
            .values()
            .filter(|conn| {
                conn.op == op && conn.generation < generation && conn.connection.is_some() && !conn.probe
            })
            .filter(|conn| {
                // A paused replica reads nothing while it is stopped; what it does when it runs
                // again is checked at each preview (`check_stale_read`).
                !self.dead(conn.replica)
                    && self.paused_until(conn.replica).is_none()
                    && (conn.replica == replica
                        || self
                            .drivers
                            .iter()
                            .any(|driver| driver.op == op && driver.replica == conn.replica))
            })
            .map(|conn| (conn.generation.0, conn.replica))
            .collect();
        still_read.sort_unstable();
        still_read.dedup();
        for (old, holder) in still_read {
            self.report.violate(
                step,
                Invariant::EarlyNewGeneration,
                format!(
                    "{op}: g{} sent while g{old} is still read by a live driver on replica {holder} (store now {store_now})",
                    generation.0
                ),
            );
        }
        // And the seed's rule, checked by the world's own facts: every older generation is
        // over because the provider ended it, its lease ran out by the store's clock, or it was
        // abandoned as `connection_closed` by the one process that ever opened it, alive and
        // with every connection of it closed at that moment (`History::closed_by_opener`).
        let attempts = {
            let witness = self.witness();
            self.rt.block_on(witness.attempts(op)).unwrap_or_default()
        };
        for attempt in attempts.iter().filter(|attempt| attempt.generation < generation) {
            let key = (op.to_owned(), attempt.generation.0);
            let provider_ended = self.history.provider_over.contains(&key);
            let expired = attempt.lease_expires_at.0 <= store_now;
            let closed_here = attempt.confirmed_over.as_deref() == Some("connection_closed")
                && self.history.closed_by_opener.contains(&key)
                && !self
                    .conns
                    .values()
                    .chain(self.limbo.iter())
                    .any(|conn| conn.op == op && conn.generation == attempt.generation && !conn.probe);
            if !(provider_ended || expired || closed_here) {
                self.report.violate(
                    step,
                    Invariant::EarlyNewGeneration,
                    format!(
                        "{op}: g{} sent while g{} may still run (lease until {} > store now {store_now}, provider has not ended it, not closed by its only reader: confirmed_over {:?})",
                        generation.0, attempt.generation.0, attempt.lease_expires_at.0, attempt.confirmed_over
                    ),
                );
            }
        }
        if generation.0 > crate::world::ATTEMPTS_PER_DISPATCH_MAX {
            self.report.violate(
                step,
                Invariant::AttemptBudget,
                format!(
                    "{op}: generation {} is over the budget of {} attempts",
                    generation.0,
                    crate::world::ATTEMPTS_PER_DISPATCH_MAX
                ),
            );
        }
    }

    /// A driver shows preview of `generation` only while no newer generation of its operation
    /// was sent: past the hand-over the old holder reads nothing (a paused replica that wakes
    /// past its fence stops before it reads). Red without the fence on a paused holder.
    pub(crate) fn check_stale_read(&mut self, op: &str, generation: Generation, what: &str) {
        self.report.checks += 1;
        let newer = self
            .history
            .opened_by
            .keys()
            .filter(|(opened, sent)| opened == op && *sent > generation.0)
            .map(|(_, sent)| *sent)
            .max();
        if let Some(newer) = newer {
            let step = self.step;
            self.report.violate(
                step,
                Invariant::StaleGenerationRead,
                format!(
                    "{op}: {what} of g{} after g{newer} was sent (now {})",
                    generation.0, self.now
                ),
            );
        }
    }

    /// Every provider request of an operation (first sends, replays and resumes, by every
    /// driver on every replica, across restarts) is within the budgets: each attempt is sent
    /// once and replayed and resumed at most their per-generation caps.
    pub(crate) fn check_provider_requests(&mut self, op: &str) {
        self.report.checks += 1;
        let made = self.history.provider_requests.get(op).copied().unwrap_or(0);
        let per_attempt = 1
            + u64::from(turnstile_drive::REPLAYS_PER_GENERATION_MAX)
            + u64::from(turnstile_drive::RESUMES_PER_GENERATION_MAX);
        let bound = crate::world::ATTEMPTS_PER_DISPATCH_MAX * per_attempt;
        if made > bound {
            let step = self.step;
            self.report.violate(
                step,
                Invariant::AttemptBudget,
                format!("{op}: {made} provider requests, over the budget of {bound}"),
            );
        }
    }

    /// The invariants over the committed state, after every step.
    /// A step that changed neither the store nor what executors saw cannot change these
    /// invariants: it is skipped (sends are checked at the send itself).
    pub(crate) fn check(&mut self) {
        if !self.dirty {
            return;
        }
        self.dirty = false;
        let step = self.step;
        let mut committed_calls: HashMap<(String, String), Value> = HashMap::new();
        // The seed's conversation, and any a proxied request forked into (its first `base`
        // turns are the client's imported history, not answers of this gateway).
        let mut conversations = vec![(CONVERSATION_ID.to_owned(), 0)];
        conversations.extend(self.forks.iter().cloned());
        for (conversation_id, base) in conversations {
            if !self.check_conversation(step, &conversation_id, base as usize, &mut committed_calls) {
                return;
            }
        }
        self.check_tool_ledger(step, &committed_calls);
    }

    /// One conversation's committed history: valid, one canonical answer per question and per
    /// dispatch, every assistant turn from a committed generation. False when unreadable.
    fn check_conversation(
        &mut self,
        step: u64,
        conversation_id: &str,
        base: usize,
        committed_calls: &mut HashMap<(String, String), Value>,
    ) -> bool {
        self.report.checks += 1;
        let Ok(Some(document)) = store!(self, conversation(conversation_id)) else {
            self.report.violate(
                step,
                Invariant::HistoryInvalid,
                format!("conversation {conversation_id} unreadable"),
            );
            return false;
        };
        match Conversation::from_value(document.clone()) {
            Ok(conversation) => {
                if let Verdict::Rejected(violations) = validate(&conversation) {
                    let codes: Vec<String> = violations.iter().map(|v| format!("{:?}", v.code)).collect();
                    self.report.violate(
                        step,
                        Invariant::HistoryInvalid,
                        format!("committed history rejected: {codes:?}"),
                    );
                }
            }
            Err(error) => self.report.violate(
                step,
                Invariant::HistoryInvalid,
                format!("committed history unreadable: {error:?}"),
            ),
        }

        // Canonical turns: one per dispatch, from its committed generation only.
        self.report.checks += 1;
        let mut per_op: HashMap<String, Vec<u64>> = HashMap::new();
        for turn in document["turns"].as_array().into_iter().flatten().skip(base) {
            if turn["role"] != "assistant" {
                continue;
            }
            let id = turn["id"].as_str().unwrap_or("");
            match id
                .rsplit_once(".g")
                .and_then(|(op, g)| Some((op, g.parse::<u64>().ok()?)))
            {
                Some((op, generation)) => per_op.entry(op.to_owned()).or_default().push(generation),
                None => self.report.violate(
                    step,
                    Invariant::LateBlockInHistory,
                    format!("assistant turn {id:?} from no dispatch generation"),
                ),
            }
            for block in turn["blocks"].as_array().into_iter().flatten() {
                if block["kind"] == "tool_call"
                    && let Some(call_id) = block["call_id"].as_str()
                {
                    committed_calls.insert(
                        (conversation_id.to_owned(), call_id.to_owned()),
                        block["arguments"].clone(),
                    );
                }
            }
        }
        // Across operations: every assistant turn answers the latest turn before it that is
        // not an assistant's; two turns answering the same one are the same question answered
        // twice (two racing operations, or a loser that arrived after the commit).
        let mut answers: HashMap<usize, u64> = HashMap::new();
        let mut question: Option<usize> = None;
        for (index, turn) in document["turns"].as_array().into_iter().flatten().enumerate() {
            if turn["role"] == "assistant" {
                if index < base {
                    continue;
                }
                if let Some(question) = question {
                    *answers.entry(question).or_default() += 1;
                }
            } else {
                question = Some(index);
            }
        }
        for (question, count) in answers {
            self.report.canonical_turns_per_revision_max =
                self.report.canonical_turns_per_revision_max.max(count);
            if count > 1 {
                self.report.violate(
                    step,
                    Invariant::CanonicalTurns,
                    format!("turn {question}: answered by {count} canonical assistant turns"),
                );
            }
        }
        let mut ops: Vec<_> = per_op.into_iter().collect();
        ops.sort();
        for (op, generations) in ops {
            let count = generations.len() as u64;
            self.report.canonical_turns_per_revision_max =
                self.report.canonical_turns_per_revision_max.max(count);
            if count > 1 {
                self.report.violate(
                    step,
                    Invariant::CanonicalTurns,
                    format!("{op}: {count} canonical assistant turns (generations {generations:?})"),
                );
            }
            let attempts = store!(self, attempts(&op)).unwrap_or_default();
            for generation in generations {
                let committed = attempts.iter().any(|attempt| {
                    attempt.generation.0 == generation && attempt.state == DispatchState::Committed
                });
                if committed {
                    self.history.committed_insert(&op, generation);
                } else {
                    self.report.violate(
                        step,
                        Invariant::LateBlockInHistory,
                        format!(
                            "{op} g{generation}: a turn of a generation that did not commit is in history"
                        ),
                    );
                }
            }
        }

        true
    }

    /// Tool-call ledger = tool calls of committed turns, complete and schema-valid; executors
    /// saw only those.
    fn check_tool_ledger(&mut self, step: u64, committed_calls: &HashMap<(String, String), Value>) {
        self.report.checks += 1;
        let ledger = store!(self, tool_calls(None)).unwrap_or_default();
        let ledger_ids: HashSet<String> = ledger.iter().map(|call| call.call_id.clone()).collect();
        let ledger_keys: HashSet<(String, String)> = ledger
            .iter()
            .map(|call| (call.conversation_id.clone(), call.call_id.clone()))
            .collect();
        let mut partial = Vec::new();
        // Per conversation: a forked conversation's imported calls are not its own commits.
        for call in &ledger {
            let key = (call.conversation_id.clone(), call.call_id.clone());
            match committed_calls.get(&key) {
                None => partial.push((call.call_id.clone(), "in the ledger, not in a committed turn")),
                Some(arguments) if !arguments_valid(arguments) || !arguments_valid(&call.arguments) => {
                    partial.push((call.call_id.clone(), "arguments incomplete or not schema-valid"))
                }
                Some(_) => {}
            }
        }
        for (conversation_id, call_id) in committed_calls.keys() {
            if !ledger_keys.contains(&(conversation_id.clone(), call_id.clone())) {
                partial.push((call_id.clone(), "committed but missing from the ledger"));
            }
        }
        for call_id in &self.history.exposed {
            if !ledger_ids.contains(call_id) {
                partial.push((call_id.clone(), "shown to an executor, not committed"));
            }
        }
        partial.sort();
        for (call_id, why) in partial {
            if self.history.partial_reported.insert(call_id.clone()) {
                self.report.partial_tool_dispatch += 1;
                self.report.violate(
                    step,
                    Invariant::PartialToolDispatch,
                    format!("call {call_id}: {why}"),
                );
            }
        }
    }

    /// Attempts and dispatches still UNKNOWN.
    pub(crate) fn unknown_count(&mut self) -> u64 {
        let mut count = 0;
        for op in self.ops.clone() {
            for attempt in store!(self, attempts(&op)).unwrap_or_default() {
                if attempt.state == DispatchState::Unknown {
                    count += 1;
                }
            }
        }
        count
    }

    /// After the liveness phase: nothing UNKNOWN, every preview resolved, metrics = tallies.
    pub(crate) fn final_checks(&mut self) {
        let step = self.step;
        self.dirty = true;
        self.check();
        self.report.checks += 1;
        let unknown = self.unknown_count();
        if unknown > 0 {
            self.report.unknown_unresolved += unknown;
            self.report.violate(
                step,
                Invariant::UnknownUnresolved,
                format!("{unknown} attempt(s) still UNKNOWN after the liveness phase"),
            );
        }
        self.report.checks += 1;
        let mut unresolved: Vec<_> = self
            .history
            .previewed
            .iter()
            .filter(|key| {
                !self.history.retracted.contains(*key) && !self.history.committed_contains(&key.0, key.1)
            })
            .cloned()
            .collect();
        unresolved.sort();
        for (op, generation) in unresolved {
            self.report.violate(
                step,
                Invariant::PreviewUnresolved,
                format!("{op} g{generation}: previewed, neither committed nor retracted"),
            );
        }
        self.report.checks += 1;
        if let Ok(counters) = store!(self, counters()) {
            let seen = self.history.bind_refusals;
            let counted = counters.foreign_handle_refusals;
            if counted < seen || counted > seen + self.history.bind_ambiguous {
                self.report.violate(
                    step,
                    Invariant::MetricsMismatch,
                    format!(
                        "store counts {counted} foreign-handle refusals, the checker saw {seen} (+{} hidden by store faults)",
                        self.history.bind_ambiguous
                    ),
                );
            }
        }
        // Liveness: every operation ended (committed, failed or abandoned).
        self.report.checks += 1;
        for op in self.ops.clone() {
            if let Ok(Some(record)) = store!(self, dispatch(&op))
                && !record.state.is_terminal()
            {
                self.report.violate(
                    step,
                    Invariant::OperationNotTerminal,
                    format!("{op}: still {} after the liveness phase", record.state),
                );
            }
        }
        self.report.commits = self.history.committed_count();
    }
}
