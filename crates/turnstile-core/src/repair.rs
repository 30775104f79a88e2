//! The history doctor: a repair plan for a history the validator rejects, computed from its
//! violations, and its application to the v1 document. Pure and deterministic: the same
//! document (and options) always gives the same plan, with the same digest.
//!
//! A poisoned history (a call without a result, a result without a call, a result sent twice,
//! arguments cut mid-stream) is refused for ever by every provider, and the gateway refuses it
//! too. Nothing here runs unless a caller asks for it (`turnstile repair`, `POST
//! /v1/conversations/{id}/repair`, a proxy route's `repair_history`); the plan is the record of
//! what was changed, kept verbatim.
//!
//! The plan makes the smallest change that makes the history legal, and only these:
//! - a block the validator cannot pair or keep — an orphan, duplicate or mismatched result, a
//!   call whose arguments are unclosed, a second call with the id, tool and arguments of one
//!   earlier in the same turn (a retry appended to the message), a block that is not
//!   committed — is **taken out**, and the plan keeps its JSON verbatim; a turn left with no
//!   block by that is dropped (its envelope kept in the plan);
//! - a call left without a terminal result is given a **`cancel` result attributed to the
//!   gateway** (block id `repair-…`, its text says why), at the end of the last tool turn of
//!   its run, or in a new tool turn right after the call's turn when the run has none (that
//!   turn carries no revision: the store stamps stored turns by position). With
//!   [`Options::close_pending`] the calls still pending at the end of the history are closed
//!   the same way, in a new tool turn appended as the next revision.
//!
//! It never changes a role, never moves a block from one turn to another, never edits a block
//! it keeps and invents no content but those `cancel` results. What cannot be fixed that way
//! (an unknown kind, a block in the wrong role, a scope violation, a malformed field, a call id
//! reused by another turn or with other arguments, a call whose turn has no generation) is
//! left in place and named in [`RepairPlan::needs_person`]: the violations of the repaired
//! document, found by the validator itself.

use crate::conversation::{Arguments, BlockBody, BlockState, Conversation, Role, RoleField, Unreadable};
use crate::digest::Digest;
use crate::ids::Generation;
use crate::validate::{Verdict, validate};
use crate::violation::{Violation, ViolationCode};
use serde::Serialize;
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The `format` string of a repair plan.
pub const FORMAT_REPAIR_V1: &str = "turnstile.repair.v1";

/// The prefix of every id the plan makes (new blocks and turns).
pub const REPAIR_ID_PREFIX: &str = "repair-";

/// What a caller asks of the planner.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Also close the calls still pending at the end of the history (a legal `waiting` history)
    /// with `cancel` results: for a caller that is about to send the history on, or to append a
    /// non-tool turn to it, where a pending call is a `missing_result`.
    pub close_pending: bool,
}

/// Why an action is in the plan: the violation code it fixes, or a call closed while pending.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// `orphan_result`.
    OrphanResult,
    /// `duplicate_result`.
    DuplicateResult,
    /// `result_mismatch`.
    ResultMismatch,
    /// `unclosed_arguments`.
    UnclosedArguments,
    /// `duplicate_call_id` (a repeat of a call earlier in the same turn).
    DuplicateCallId,
    /// `uncommitted_block`.
    UncommittedBlock,
    /// `missing_result`.
    MissingResult,
    /// A call pending at the end of the history, closed on request ([`Options::close_pending`]).
    PendingCall,
    /// A turn left with no block by the plan's take-outs.
    EmptiedTurn,
}

impl Cause {
    /// Every cause.
    pub const ALL: [Cause; 9] = [
        Cause::OrphanResult,
        Cause::DuplicateResult,
        Cause::ResultMismatch,
        Cause::UnclosedArguments,
        Cause::DuplicateCallId,
        Cause::UncommittedBlock,
        Cause::MissingResult,
        Cause::PendingCall,
        Cause::EmptiedTurn,
    ];

    /// The string written in the plan and in metrics' `kind` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::OrphanResult => "orphan_result",
            Cause::DuplicateResult => "duplicate_result",
            Cause::ResultMismatch => "result_mismatch",
            Cause::UnclosedArguments => "unclosed_arguments",
            Cause::DuplicateCallId => "duplicate_call_id",
            Cause::UncommittedBlock => "uncommitted_block",
            Cause::MissingResult => "missing_result",
            Cause::PendingCall => "pending_call",
            Cause::EmptiedTurn => "emptied_turn",
        }
    }
}

/// Where a `cancel` result goes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "into", rename_all = "snake_case")]
pub enum Placement {
    /// At the end of an existing tool turn (the last of the call's run).
    Turn {
        /// Index of that turn in the original document.
        turn_index: usize,
    },
    /// In a new tool turn right after the original turn at `after_turn_index` (no revision).
    NewTurn {
        /// Index of the turn it follows in the original document.
        after_turn_index: usize,
        /// The new turn's id.
        turn: String,
    },
    /// In a new tool turn appended at the end as the next revision.
    NewLastTurn {
        /// The new turn's id.
        turn: String,
        /// The new turn's revision (the document's revision + 1).
        revision: u64,
    },
}

/// One change of the plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Action {
    /// A block taken out of its turn, kept verbatim here.
    TakeOut {
        /// Which violation it fixes.
        cause: Cause,
        /// Index of its turn in the original document.
        turn_index: usize,
        /// Its turn's id.
        turn: Option<String>,
        /// Index of the block in its turn.
        block_index: usize,
        /// The block's id.
        block: Option<String>,
        /// The call id it carries, if any.
        call_id: Option<String>,
        /// The block's JSON exactly as it was.
        original: Value,
    },
    /// A turn left empty by the take-outs, dropped (its blocks are recorded by their take-outs).
    DropTurn {
        /// Always [`Cause::EmptiedTurn`].
        cause: Cause,
        /// Index of the turn in the original document.
        turn_index: usize,
        /// Its id.
        turn: Option<String>,
        /// Its JSON without `blocks`, exactly as it was.
        original: Value,
    },
    /// A `cancel` result made by the gateway for a call without one.
    Cancel {
        /// [`Cause::MissingResult`] or [`Cause::PendingCall`].
        cause: Cause,
        /// The call it closes.
        call_id: String,
        /// The new block's id.
        block: String,
        /// Where it goes.
        placement: Placement,
        /// The whole new block.
        result: Value,
    },
}

impl Action {
    /// Why the action is in the plan.
    pub fn cause(&self) -> Cause {
        match self {
            Action::TakeOut { cause, .. } | Action::DropTurn { cause, .. } | Action::Cancel { cause, .. } => {
                *cause
            }
        }
    }
}

/// A repair plan: every change, what it could not fix, and a digest over both and the
/// document it is for.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RepairPlan {
    /// [`FORMAT_REPAIR_V1`].
    pub format: &'static str,
    /// The conversation id of the document.
    pub conversation_id: String,
    /// `sha256:` over the RFC 8785 form of the document the plan is for: a plan applies to that
    /// document only.
    pub document_digest: Digest,
    /// The changes, in document order (take-outs and drops, then cancels).
    pub actions: Vec<Action>,
    /// The violations the repaired document still has: left for a person.
    pub needs_person: Vec<Violation>,
    /// `sha256:` over the RFC 8785 form of this plan without `digest`.
    pub digest: Digest,
}

impl RepairPlan {
    /// Whether the plan changes nothing.
    pub fn is_empty(&self) -> bool {
        self.actions.is_empty()
    }

    /// Whether the repaired document is legal (ready or waiting).
    pub fn is_complete(&self) -> bool {
        self.needs_person.is_empty()
    }

    /// The number of actions per cause (for metrics and summaries).
    pub fn counts(&self) -> BTreeMap<Cause, usize> {
        let mut counts = BTreeMap::new();
        for action in &self.actions {
            *counts.entry(action.cause()).or_insert(0) += 1;
        }
        counts
    }
}

/// A plan applied to a document that is not the one it was made for.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ApplyError {
    /// The document's digest is not the plan's `document_digest`.
    #[error("the plan was made for document {expected}, not {actual}")]
    OtherDocument {
        /// The plan's `document_digest`.
        expected: Digest,
        /// The given document's.
        actual: Digest,
    },
}

/// The repair plan of a v1 document. `Err` only when the document is not a v1 file at all or
/// breaks a limit (as [`Conversation::from_value`]), or when the repaired document would break
/// one (a new turn past `TURNS_MAX`).
pub fn plan(document: &Value, options: Options) -> Result<RepairPlan, Unreadable> {
    let conversation = Conversation::from_value(document.clone())?;
    let document_digest = Digest::of_value(document);
    let verdict = validate(&conversation);
    // A legal history (with nothing pending, when pending calls are to be closed) has nothing
    // to repair: no walk, and no second decode of a copy.
    let legal = match &verdict {
        Verdict::Ready => true,
        Verdict::Waiting { .. } => !options.close_pending,
        Verdict::Rejected(_) => false,
    };
    if legal {
        return Ok(seal(
            conversation.conversation_id,
            document_digest,
            Vec::new(),
            Vec::new(),
        ));
    }
    let actions = Planner::new(&conversation, document, options).run();
    let after = if actions.is_empty() {
        verdict
    } else {
        validate(&Conversation::from_value(build(document, &actions))?)
    };
    let needs_person = match after {
        Verdict::Rejected(violations) => violations,
        Verdict::Ready => Vec::new(),
        // Asked to close pending calls and some are still pending (a call in a turn without a
        // generation, which no result can match): named, never reported as repaired.
        Verdict::Waiting { pending } if options.close_pending => pending
            .into_iter()
            .map(|call_id| Violation {
                code: ViolationCode::MissingResult,
                turn: None,
                block: None,
                call_id: Some(call_id.0.clone()),
                message: format!(
                    "call {:?} is pending and cannot be cancelled by the gateway: its turn has no generation for a result to name",
                    call_id.0
                ),
            })
            .collect(),
        Verdict::Waiting { .. } => Vec::new(),
    };
    Ok(seal(
        conversation.conversation_id,
        document_digest,
        actions,
        needs_person,
    ))
}

/// The repaired document: `document` with `plan` applied (the same document when the plan is
/// empty). The plan must have been made for this very document.
pub fn apply(plan: &RepairPlan, document: &Value) -> Result<Value, ApplyError> {
    let actual = Digest::of_value(document);
    if actual != plan.document_digest {
        return Err(ApplyError::OtherDocument {
            expected: plan.document_digest.clone(),
            actual,
        });
    }
    Ok(build(document, &plan.actions))
}

fn seal(
    conversation_id: String,
    document_digest: Digest,
    actions: Vec<Action>,
    needs_person: Vec<Violation>,
) -> RepairPlan {
    let mut plan = RepairPlan {
        format: FORMAT_REPAIR_V1,
        conversation_id,
        document_digest,
        actions,
        needs_person,
        digest: Digest::of_bytes(b""),
    };
    let mut value = serde_json::to_value(&plan).unwrap_or(Value::Null);
    if let Value::Object(map) = &mut value {
        map.remove("digest");
    }
    plan.digest = Digest::of_value(&value);
    plan
}

/// The document with the actions applied (nothing checked: the actions came from this
/// document's plan).
fn build(document: &Value, actions: &[Action]) -> Value {
    if actions.is_empty() {
        return document.clone();
    }
    let mut taken: HashSet<(usize, usize)> = HashSet::new();
    let mut dropped: HashSet<usize> = HashSet::new();
    let mut appended: BTreeMap<usize, Vec<Value>> = BTreeMap::new();
    let mut inserted: BTreeMap<usize, (String, Vec<Value>)> = BTreeMap::new();
    let mut last: Option<(String, u64, Vec<Value>)> = None;
    for action in actions {
        match action {
            Action::TakeOut {
                turn_index,
                block_index,
                ..
            } => {
                taken.insert((*turn_index, *block_index));
            }
            Action::DropTurn { turn_index, .. } => {
                dropped.insert(*turn_index);
            }
            Action::Cancel {
                placement, result, ..
            } => match placement {
                Placement::Turn { turn_index } => {
                    appended.entry(*turn_index).or_default().push(result.clone())
                }
                Placement::NewTurn {
                    after_turn_index,
                    turn,
                } => inserted
                    .entry(*after_turn_index)
                    .or_insert_with(|| (turn.clone(), Vec::new()))
                    .1
                    .push(result.clone()),
                Placement::NewLastTurn { turn, revision } => last
                    .get_or_insert_with(|| (turn.clone(), *revision, Vec::new()))
                    .2
                    .push(result.clone()),
            },
        }
    }
    let mut repaired = document.clone();
    let Some(top) = repaired.as_object_mut() else {
        return repaired;
    };
    let turns = match top.get_mut("turns") {
        Some(Value::Array(turns)) => std::mem::take(turns),
        _ => Vec::new(),
    };
    let mut out = Vec::with_capacity(turns.len() + inserted.len() + 1);
    for (turn_index, mut turn) in turns.into_iter().enumerate() {
        if !dropped.contains(&turn_index) {
            if let Some(Value::Array(blocks)) = turn.get_mut("blocks") {
                let kept: Vec<Value> = std::mem::take(blocks)
                    .into_iter()
                    .enumerate()
                    .filter(|(block_index, _)| !taken.contains(&(turn_index, *block_index)))
                    .map(|(_, block)| block)
                    .collect();
                *blocks = kept;
                if let Some(more) = appended.remove(&turn_index) {
                    blocks.extend(more);
                }
            }
            out.push(turn);
        }
        if let Some((id, blocks)) = inserted.remove(&turn_index) {
            out.push(json!({"id": id, "role": "tool", "blocks": blocks}));
        }
    }
    if let Some((id, revision, blocks)) = last {
        out.push(json!({"id": id, "revision": revision, "role": "tool", "blocks": blocks}));
        top.insert("revision".into(), revision.into());
    }
    top.insert("turns".into(), Value::Array(out));
    repaired
}

/// A call of the open tool run, as the planner pairs results with it.
struct OpenCall {
    call_id: String,
    tool: String,
    args_digest: Digest,
    answered: bool,
}

/// The assistant turn whose tool run is open.
struct Run {
    turn_index: usize,
    turn_id: Option<String>,
    generation: Option<Generation>,
    calls: Vec<OpenCall>,
    /// Calls of the turn left for a person (an id reused): their results are left too.
    unresolved: Vec<String>,
    /// The last tool turn of the run that the plan keeps.
    last_tool_turn: Option<usize>,
}

/// The walk that makes the plan: the validator's pairing rule (`validate.rs`) over the history
/// as it will be once the blocks taken out are gone.
struct Planner<'a> {
    conversation: &'a Conversation,
    document: &'a Value,
    options: Options,
    ids: HashSet<String>,
    /// Call ids of kept calls: (turn index, tool, args digest).
    calls: HashMap<&'a str, (usize, &'a str, Option<&'a Digest>)>,
    open: Option<Run>,
    take_outs: Vec<Action>,
    cancels: Vec<Action>,
    /// New turns already named, by the index they follow (`usize::MAX`: the end).
    new_turns: BTreeMap<usize, String>,
}

impl<'a> Planner<'a> {
    fn new(conversation: &'a Conversation, document: &'a Value, options: Options) -> Planner<'a> {
        let mut ids = HashSet::new();
        for turn in &conversation.turns {
            ids.extend(turn.id.iter().cloned());
            for block in &turn.blocks {
                ids.extend(block.id.iter().cloned());
            }
        }
        Planner {
            conversation,
            document,
            options,
            ids,
            calls: HashMap::new(),
            open: None,
            take_outs: Vec::new(),
            cancels: Vec::new(),
            new_turns: BTreeMap::new(),
        }
    }

    fn run(mut self) -> Vec<Action> {
        let conversation = self.conversation;
        for (turn_index, turn) in conversation.turns.iter().enumerate() {
            let role = match turn.role {
                RoleField::Known(role) => Some(role),
                RoleField::Invalid => None,
            };
            let taken_before = self.take_outs.len();
            let mut taken_here = 0usize;
            let mut calls_here: Vec<OpenCall> = Vec::new();
            let mut unresolved: Vec<String> = Vec::new();
            let mut tool_results: Vec<usize> = Vec::new();
            for (block_index, block) in turn.blocks.iter().enumerate() {
                if let BlockState::Other(_) = block.state {
                    self.take_out(Cause::UncommittedBlock, turn_index, block_index);
                    taken_here += 1;
                    continue;
                }
                match (&block.body, role) {
                    (
                        BlockBody::ToolCall {
                            call_id,
                            tool,
                            arguments,
                        },
                        Some(Role::Assistant),
                    ) => {
                        if let Arguments::Unclosed { .. } = arguments {
                            self.take_out(Cause::UnclosedArguments, turn_index, block_index);
                            taken_here += 1;
                            continue;
                        }
                        let digest = arguments.digest();
                        match self.calls.get(call_id.as_str()) {
                            Some(&(first_turn, first_tool, first_digest))
                                if first_turn == turn_index
                                    && first_tool == tool
                                    && first_digest == digest =>
                            {
                                self.take_out(Cause::DuplicateCallId, turn_index, block_index);
                                taken_here += 1;
                            }
                            // Another turn's call, or other arguments: which call a result
                            // answers cannot be told. Left for a person, with its results.
                            Some(_) => unresolved.push(call_id.0.clone()),
                            None => {
                                self.calls.insert(call_id.as_str(), (turn_index, tool, digest));
                                if let Some(digest) = digest {
                                    calls_here.push(OpenCall {
                                        call_id: call_id.0.clone(),
                                        tool: tool.clone(),
                                        args_digest: digest.clone(),
                                        answered: false,
                                    });
                                }
                            }
                        }
                    }
                    (BlockBody::ToolResult { .. }, Some(Role::Tool)) => tool_results.push(block_index),
                    _ => {}
                }
            }
            if role == Some(Role::Tool) {
                for block_index in tool_results {
                    if let Some(cause) = self.pair(&turn.blocks[block_index].body) {
                        self.take_out(cause, turn_index, block_index);
                        taken_here += 1;
                    }
                }
            }
            let emptied = !turn.blocks.is_empty() && taken_here == turn.blocks.len();
            if emptied {
                // The turn goes: it closes no run and opens none.
                let original = match self.document["turns"].get(turn_index) {
                    Some(Value::Object(map)) => {
                        let mut map = map.clone();
                        map.remove("blocks");
                        Value::Object(map)
                    }
                    _ => Value::Null,
                };
                self.take_outs.push(Action::DropTurn {
                    cause: Cause::EmptiedTurn,
                    turn_index,
                    turn: turn.id.clone(),
                    original,
                });
                continue;
            }
            debug_assert!(self.take_outs.len() >= taken_before);
            if role == Some(Role::Tool) {
                if let Some(run) = self.open.as_mut() {
                    run.last_tool_turn = Some(turn_index);
                }
                continue;
            }
            if let Some(run) = self.open.take() {
                self.close(run, Cause::MissingResult);
            }
            if role == Some(Role::Assistant) && !(calls_here.is_empty() && unresolved.is_empty()) {
                self.open = Some(Run {
                    turn_index,
                    turn_id: turn.id.clone(),
                    generation: turn.generation,
                    calls: calls_here,
                    unresolved,
                    last_tool_turn: None,
                });
            }
        }
        if let Some(run) = self.open.take()
            && self.options.close_pending
        {
            self.close(run, Cause::PendingCall);
        }
        let mut actions = self.take_outs;
        actions.extend(self.cancels);
        actions
    }

    /// Pair one result with the open run: `None` when it is the call's first good result,
    /// else why it is taken out.
    fn pair(&mut self, body: &BlockBody) -> Option<Cause> {
        let BlockBody::ToolResult {
            call_id,
            tool,
            args_digest,
            generation,
            ..
        } = body
        else {
            return None;
        };
        let Some(run) = self.open.as_mut() else {
            return Some(Cause::OrphanResult);
        };
        let run_generation = run.generation;
        if run.unresolved.contains(&call_id.0) {
            // The id names two calls: none of its results is touched, and none is cancelled.
            if let Some(call) = run.calls.iter_mut().find(|call| call.call_id == call_id.0) {
                call.answered = true;
            }
            return None;
        }
        let Some(call) = run.calls.iter_mut().find(|call| call.call_id == call_id.0) else {
            return Some(Cause::OrphanResult);
        };
        if call.answered {
            return Some(Cause::DuplicateResult);
        }
        if run_generation.is_none() {
            // No result can match a call whose turn has no generation: the turn is what is
            // wrong, and a person decides. The result stays and answers the call.
            call.answered = true;
            return None;
        }
        let matches = !tool.is_empty()
            && *tool == call.tool
            && args_digest.as_ref() == Some(&call.args_digest)
            && generation.is_some()
            && *generation == run_generation;
        if !matches {
            return Some(Cause::ResultMismatch);
        }
        call.answered = true;
        None
    }

    fn take_out(&mut self, cause: Cause, turn_index: usize, block_index: usize) {
        let turn = &self.conversation.turns[turn_index];
        let block = &turn.blocks[block_index];
        let call_id = match &block.body {
            BlockBody::ToolCall { call_id, .. } | BlockBody::ToolResult { call_id, .. } => {
                Some(call_id.0.clone())
            }
            _ => None,
        };
        let original = self.document["turns"]
            .get(turn_index)
            .and_then(|turn| turn["blocks"].get(block_index))
            .cloned()
            .unwrap_or(Value::Null);
        self.take_outs.push(Action::TakeOut {
            cause,
            turn_index,
            turn: turn.id.clone(),
            block_index,
            block: block.id.clone(),
            call_id,
            original,
        });
    }

    /// Give each unanswered call of a run a gateway `cancel` result. A turn without a
    /// generation has no result that can match it: left for a person.
    fn close(&mut self, run: Run, cause: Cause) {
        let Some(generation) = run.generation else {
            return;
        };
        for call in run.calls.iter().filter(|call| !call.answered) {
            let placement = match (cause, run.last_tool_turn) {
                (Cause::PendingCall, _) => {
                    let turn = self.new_turn_id(usize::MAX, run.turn_id.as_deref());
                    Placement::NewLastTurn {
                        turn,
                        revision: self.conversation.revision.0.saturating_add(1),
                    }
                }
                (_, Some(turn_index)) => Placement::Turn { turn_index },
                (_, None) => Placement::NewTurn {
                    after_turn_index: run.turn_index,
                    turn: self.new_turn_id(run.turn_index, run.turn_id.as_deref()),
                },
            };
            let block = self.fresh_id(&format!("{REPAIR_ID_PREFIX}{}", call.call_id));
            let reason = match cause {
                Cause::PendingCall => "the call was still pending when its history was repaired",
                _ => "the call had no terminal result before the next turn (missing_result)",
            };
            let mut result = Map::new();
            result.insert("id".into(), block.clone().into());
            result.insert("kind".into(), "tool_result".into());
            result.insert("call_id".into(), call.call_id.clone().into());
            result.insert("tool".into(), call.tool.clone().into());
            result.insert("args_digest".into(), call.args_digest.as_str().into());
            result.insert("generation".into(), generation.0.into());
            result.insert("status".into(), "cancel".into());
            result.insert(
                "content".into(),
                json!([{"kind": "text", "text": format!("cancelled by the turnstile gateway's history repair: {reason}")}]),
            );
            self.cancels.push(Action::Cancel {
                cause,
                call_id: call.call_id.clone(),
                block,
                placement,
                result: Value::Object(result),
            });
        }
    }

    /// The id of the new tool turn after `after` (one per place).
    fn new_turn_id(&mut self, after: usize, assistant_turn: Option<&str>) -> String {
        if let Some(id) = self.new_turns.get(&after) {
            return id.clone();
        }
        let base = match assistant_turn {
            Some(id) => format!("{REPAIR_ID_PREFIX}{id}-results"),
            None => format!("{REPAIR_ID_PREFIX}results"),
        };
        let id = self.fresh_id(&base);
        self.new_turns.insert(after, id.clone());
        id
    }

    /// `base`, or `base-2`, `base-3`, … : the first id no turn or block has.
    fn fresh_id(&mut self, base: &str) -> String {
        let mut candidate = base.to_owned();
        let mut n = 1usize;
        while self.ids.contains(&candidate) {
            n += 1;
            candidate = format!("{base}-{n}");
        }
        self.ids.insert(candidate.clone());
        candidate
    }
}

/// The codes a plan may fix by itself; every other code is left for a person.
pub const REPAIRABLE: [ViolationCode; 7] = [
    ViolationCode::OrphanResult,
    ViolationCode::DuplicateResult,
    ViolationCode::ResultMismatch,
    ViolationCode::UnclosedArguments,
    ViolationCode::DuplicateCallId,
    ViolationCode::UncommittedBlock,
    ViolationCode::MissingResult,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cause_strings_are_their_serialisation() {
        for cause in Cause::ALL {
            assert_eq!(serde_json::to_value(cause).unwrap(), Value::from(cause.as_str()));
        }
    }
}
