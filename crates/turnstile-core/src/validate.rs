//! The validator: one pass over a decoded conversation that reports *every* violation of the
//! v1 contract (`shared/spec/conversation-v1.md` §2), or says the history is ready, or that it
//! is waiting for tool results.
//!
//! Pairing rule: the results for one assistant turn's calls live in the run of consecutive
//! `tool` turns directly after it, spread over those turns in any order. A non-tool turn closes
//! the run; calls still unanswered then are `missing_result`. If the conversation ends inside
//! the run (or right after the assistant turn), the unanswered calls are pending: `waiting`.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a result lacking `tool`, `args_digest` or `generation` is `result_mismatch` (it cannot be
//!   shown to match its call). Enforced in `core/src/validate.rs` (`Pass::result`),
//!   `conversation.rs` (a missing `tool` decodes as the empty name). Tests:
//!   `core/tests/it/validator_data.rs::a_result_lacking_tool_args_digest_or_generation_is_result_mismatch`,
//!   `properties.rs` (mutation `OmitResultField`).

use crate::conversation::{Arguments, BlockBody, BlockState, Conversation, Role, RoleField, Trust, Turn};
use crate::digest::Digest;
use crate::ids::{CallId, Generation};
use crate::violation::{Violation, ViolationCode};
use std::collections::HashSet;

/// The validator's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub enum Verdict {
    /// A request may be rendered.
    Ready,
    /// The last assistant turn has calls without a terminal result and nothing else is wrong:
    /// no request is built.
    Waiting {
        /// The unanswered call ids, in call order.
        pending: Vec<CallId>,
    },
    /// One violation per problem found.
    Rejected(Vec<Violation>),
}

impl Verdict {
    /// The spec status string: `ready`, `waiting` or `rejected`.
    pub fn status(&self) -> &'static str {
        match self {
            Verdict::Ready => "ready",
            Verdict::Waiting { .. } => "waiting",
            Verdict::Rejected(_) => "rejected",
        }
    }
}

/// A conversation the validator found ready or waiting. Only this type can be turned into a
/// [`crate::MessageSequence`]: the graph is built from legal committed history or not at all.
#[derive(Clone, Copy, Debug)]
pub struct Validated<'a> {
    conversation: &'a Conversation,
    waiting: bool,
}

impl<'a> Validated<'a> {
    /// Validate; `Err` carries the verdict when it is not ready/waiting.
    pub fn new(conversation: &'a Conversation) -> Result<Validated<'a>, Vec<Violation>> {
        match validate(conversation) {
            Verdict::Ready => Ok(Validated {
                conversation,
                waiting: false,
            }),
            Verdict::Waiting { .. } => Ok(Validated {
                conversation,
                waiting: true,
            }),
            Verdict::Rejected(violations) => Err(violations),
        }
    }

    /// Validate once and keep both the verdict (its pending calls or its violations, for the
    /// caller's answer) and, for ready or waiting history, the proof: a caller that reports the
    /// verdict and then builds the graph need not validate twice.
    pub fn with_verdict(conversation: &'a Conversation) -> (Verdict, Option<Validated<'a>>) {
        let verdict = validate(conversation);
        let validated = match &verdict {
            Verdict::Ready => Some(Validated {
                conversation,
                waiting: false,
            }),
            Verdict::Waiting { .. } => Some(Validated {
                conversation,
                waiting: true,
            }),
            Verdict::Rejected(_) => None,
        };
        (verdict, validated)
    }

    /// The proof for a conversation whose verdict a [`History`] walked to the end of it gave
    /// (`crate::kept`): ready or waiting, nothing found.
    pub(crate) fn from_history(conversation: &'a Conversation, history: &History) -> Option<Validated<'a>> {
        if !history.is_legal() || history.counts().0 != conversation.turns.len() {
            return None;
        }
        Some(Validated {
            conversation,
            waiting: history
                .walk
                .open
                .as_ref()
                .is_some_and(|open| open.calls.iter().any(|call| !call.answered)),
        })
    }

    /// The validated conversation.
    pub fn conversation(&self) -> &'a Conversation {
        self.conversation
    }

    /// Whether tool results are still pending (no request may be built).
    pub fn is_waiting(&self) -> bool {
        self.waiting
    }
}

/// Validate a decoded conversation.
pub fn validate(conversation: &Conversation) -> Verdict {
    let mut pass = Pass {
        violations: conversation.decode_violations.clone(),
        turn_id: None,
    };
    let mut walk: Walk<&str> = Walk::new(conversation.turns.len());
    for turn in &conversation.turns {
        walk.turn(turn, &mut pass);
    }
    walk.verdict(pass.violations)
}

/// What the validator knows after a legal history, kept to check one more turn for the cost
/// of that turn: the turn, block and call ids taken, the last revision, whether a non-system
/// turn was seen, and the calls of an open tool run. It is the very walk [`validate`] makes
/// (one implementation), with owned ids, so `History::of(h).push(t)` finds what
/// `validate(h + t)` finds: in the same order when `h` is legal, as a multiset otherwise (the
/// whole file reports every turn's decode findings first; `tests/it/history.rs`).
#[derive(Clone, Debug)]
pub struct History {
    walk: Walk<String>,
    violations: Vec<Violation>,
    turns: usize,
    blocks: usize,
}

impl History {
    /// Walk a whole decoded conversation (its decode findings included).
    pub fn of(conversation: &Conversation) -> History {
        let mut pass = Pass {
            violations: conversation.decode_violations.clone(),
            turn_id: None,
        };
        let mut walk: Walk<String> = Walk::new(conversation.turns.len());
        for turn in &conversation.turns {
            walk.turn(turn, &mut pass);
        }
        History {
            walk,
            violations: pass.violations,
            turns: conversation.turns.len(),
            blocks: conversation.turns.iter().map(|turn| turn.blocks.len()).sum(),
        }
    }

    /// Walk one more turn (decoded, with its own decode findings).
    pub fn push(&mut self, turn: &Turn, decode_violations: Vec<Violation>) {
        let mut pass = Pass {
            violations: std::mem::take(&mut self.violations),
            turn_id: None,
        };
        pass.violations.extend(decode_violations);
        self.walk.turn(turn, &mut pass);
        self.violations = pass.violations;
        self.turns += 1;
        self.blocks += turn.blocks.len();
    }

    /// [`History::push`], keeping what [`History::pop`] needs to undo it.
    pub fn push_marked(&mut self, turn: &Turn, decode_violations: Vec<Violation>) -> HistoryMark {
        let mark = HistoryMark {
            revision_last: self.walk.revision_last,
            seen_non_system: self.walk.seen_non_system,
            open: self.walk.open.clone(),
            violations: self.violations.len(),
            turns: self.turns,
            blocks: self.blocks,
        };
        self.push(turn, decode_violations);
        mark
    }

    /// Undo the [`History::push_marked`] of `turn`. Exact only when that push found nothing
    /// (every id it took was new, so taking them back restores the sets); otherwise nothing is
    /// changed and `false` says so: the caller walks the history again.
    pub fn pop(&mut self, turn: &Turn, mark: HistoryMark) -> bool {
        if self.violations.len() != mark.violations {
            return false;
        }
        if let Some(id) = turn.id.as_deref() {
            self.walk.turn_ids.remove(id);
        }
        for block in &turn.blocks {
            if let Some(id) = block.id.as_deref() {
                self.walk.block_ids.remove(id);
            }
            if let BlockBody::ToolCall { call_id, .. } = &block.body {
                self.walk.call_ids.remove(call_id.as_str());
            }
        }
        self.walk.revision_last = mark.revision_last;
        self.walk.seen_non_system = mark.seen_non_system;
        self.walk.open = mark.open;
        self.turns = mark.turns;
        self.blocks = mark.blocks;
        true
    }

    /// The verdict on the history walked so far (for the cost of its findings and open calls,
    /// not of the history).
    pub fn verdict(&self) -> Verdict {
        if !self.violations.is_empty() {
            return Verdict::Rejected(self.violations.clone());
        }
        let pending = self.walk.pending();
        if pending.is_empty() {
            Verdict::Ready
        } else {
            Verdict::Waiting { pending }
        }
    }

    /// Whether nothing was found wrong so far (ready or waiting).
    pub fn is_legal(&self) -> bool {
        self.violations.is_empty()
    }

    /// Turns and blocks walked (for the file's limits).
    pub fn counts(&self) -> (usize, usize) {
        (self.turns, self.blocks)
    }
}

/// What [`History::pop`] needs to undo one [`History::push_marked`]: the walk's small state
/// before it (the open tool run is a few calls).
#[derive(Clone, Debug)]
#[must_use]
pub struct HistoryMark {
    revision_last: Option<crate::ids::Revision>,
    seen_non_system: bool,
    open: Option<OpenCalls<String>>,
    violations: usize,
    turns: usize,
    blocks: usize,
}

/// An id as the walk keeps it: borrowed from the conversation ([`validate`]) or owned
/// ([`History`]).
trait Key<'t>: Eq + std::hash::Hash + Clone + std::borrow::Borrow<str> {
    fn of(text: &'t str) -> Self;
}

impl<'t> Key<'t> for &'t str {
    fn of(text: &'t str) -> Self {
        text
    }
}

impl<'t> Key<'t> for String {
    fn of(text: &'t str) -> Self {
        text.to_owned()
    }
}

/// The validator's walk over turns, in order (see the module documentation for the rules).
#[derive(Clone, Debug)]
struct Walk<K> {
    turn_ids: HashSet<K>,
    block_ids: HashSet<K>,
    call_ids: HashSet<K>,
    revision_last: Option<crate::ids::Revision>,
    seen_non_system: bool,
    /// Calls of the assistant turn whose tool run is open, with whether each is answered.
    open: Option<OpenCalls<K>>,
}

impl<K: std::borrow::Borrow<str> + Eq + std::hash::Hash + Clone> Walk<K> {
    fn new(turns: usize) -> Walk<K> {
        Walk {
            turn_ids: HashSet::with_capacity(turns),
            block_ids: HashSet::new(),
            call_ids: HashSet::new(),
            revision_last: None,
            seen_non_system: false,
            open: None,
        }
    }

    fn turn<'t>(&mut self, turn: &'t Turn, pass: &mut Pass<'t>)
    where
        K: Key<'t>,
    {
        pass.turn_id = turn.id.as_deref();
        if let Some(id) = turn.id.as_deref()
            && !self.turn_ids.insert(K::of(id))
        {
            pass.push(
                ViolationCode::InvalidStructure,
                None,
                None,
                format!("duplicate turn id {id:?}"),
            );
        }
        if let Some(revision) = turn.revision {
            if let Some(last) = self.revision_last
                && revision <= last
            {
                pass.push(
                    ViolationCode::InvalidStructure,
                    None,
                    None,
                    format!("turn revision {revision} does not increase (previous {last})"),
                );
            }
            self.revision_last = Some(revision);
        }
        let role = match turn.role {
            RoleField::Known(role) => Some(role),
            RoleField::Invalid => None,
        };
        if role != Some(Role::Tool)
            && let Some(closed) = self.open.take()
        {
            closed.report_missing(pass);
        }
        match role {
            Some(Role::System) if self.seen_non_system => {
                pass.push(
                    ViolationCode::RoleViolation,
                    None,
                    None,
                    "a system turn may only open the conversation".into(),
                );
            }
            Some(Role::System) => {}
            _ => self.seen_non_system = true,
        }
        let mut calls_here: Vec<CallRecord<K>> = Vec::new();
        for block in &turn.blocks {
            let block_id = block.id.as_deref();
            if let Some(id) = block_id
                && !self.block_ids.insert(K::of(id))
            {
                pass.push(
                    ViolationCode::InvalidStructure,
                    block_id,
                    None,
                    format!("duplicate block id {id:?}"),
                );
            }
            if let BlockState::Other(state) = &block.state {
                pass.push(
                    ViolationCode::UncommittedBlock,
                    block_id,
                    None,
                    format!("block state is {state:?}; committed history holds only committed blocks"),
                );
            }
            let Some(role) = role else { continue };
            let kind = block.body.kind();
            let allowed = match &block.body {
                BlockBody::Malformed => continue,
                BlockBody::Unknown { kind } => {
                    pass.push(
                        ViolationCode::UnknownKind,
                        block_id,
                        None,
                        format!("block kind {kind:?} is not in v1"),
                    );
                    continue;
                }
                BlockBody::Context { trust, .. } => {
                    match role {
                        Role::User => {}
                        Role::System if *trust == Trust::Trusted => {}
                        Role::System => pass.push(
                            ViolationCode::ScopeViolation,
                            block_id,
                            None,
                            "an untrusted context block cannot sit in a system turn".into(),
                        ),
                        _ => pass.push(
                            ViolationCode::ScopeViolation,
                            block_id,
                            None,
                            format!("a context block cannot cross into a {} turn", role.as_str()),
                        ),
                    }
                    continue;
                }
                BlockBody::Text { .. } => {
                    matches!(role, Role::System | Role::User | Role::Assistant)
                }
                BlockBody::Image { .. } | BlockBody::Document { .. } => role == Role::User,
                BlockBody::Reasoning { .. } | BlockBody::ToolCall { .. } => role == Role::Assistant,
                BlockBody::ToolResult { .. } => role == Role::Tool,
            };
            if !allowed {
                pass.push(
                    ViolationCode::RoleViolation,
                    block_id,
                    None,
                    format!("a {kind} block is not allowed in a {} turn", role.as_str()),
                );
                continue;
            }
            match &block.body {
                BlockBody::ToolCall {
                    call_id,
                    tool,
                    arguments,
                } => {
                    if let Arguments::Unclosed { state, .. } = arguments {
                        pass.push(
                            ViolationCode::UnclosedArguments,
                            block_id,
                            Some(call_id.as_str()),
                            format!("arguments are not a complete JSON object ({state:?})"),
                        );
                    }
                    if !self.call_ids.insert(K::of(call_id.as_str())) {
                        pass.push(
                            ViolationCode::DuplicateCallId,
                            block_id,
                            Some(call_id.as_str()),
                            format!("call id {call_id:?} is already used by another tool_call"),
                        );
                        continue;
                    }
                    calls_here.push(CallRecord {
                        call_id: K::of(call_id.as_str()),
                        tool: K::of(tool),
                        args_digest: arguments.digest().map(|digest| K::of(digest.as_str())),
                        block_id: block_id.map(K::of),
                        answered: false,
                    });
                }
                BlockBody::ToolResult {
                    call_id,
                    tool,
                    args_digest,
                    generation,
                    ..
                } => {
                    pass.result(
                        self.open.as_mut(),
                        block_id,
                        call_id,
                        tool,
                        args_digest.as_ref(),
                        *generation,
                    );
                }
                _ => {}
            }
        }
        if role == Some(Role::Assistant) && !calls_here.is_empty() {
            self.open = Some(OpenCalls {
                turn_id: turn.id.as_deref().map(K::of),
                generation: turn.generation,
                calls: calls_here,
            });
        }
    }

    /// The calls of the open tool run still without a result, in call order.
    fn pending(&self) -> Vec<CallId> {
        self.open
            .as_ref()
            .map(|open| {
                open.calls
                    .iter()
                    .filter(|call| !call.answered)
                    .map(|call| CallId(call.call_id.borrow().to_owned()))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn verdict(self, violations: Vec<Violation>) -> Verdict {
        let pending = self.pending();
        if !violations.is_empty() {
            Verdict::Rejected(violations)
        } else if !pending.is_empty() {
            Verdict::Waiting { pending }
        } else {
            Verdict::Ready
        }
    }
}

struct Pass<'a> {
    violations: Vec<Violation>,
    turn_id: Option<&'a str>,
}

#[derive(Clone, Debug)]
struct CallRecord<K> {
    call_id: K,
    tool: K,
    args_digest: Option<K>,
    block_id: Option<K>,
    answered: bool,
}

#[derive(Clone, Debug)]
struct OpenCalls<K> {
    turn_id: Option<K>,
    generation: Option<Generation>,
    calls: Vec<CallRecord<K>>,
}

impl<K: std::borrow::Borrow<str>> OpenCalls<K> {
    fn report_missing(self, pass: &mut Pass<'_>) {
        for call in self.calls.iter().filter(|call| !call.answered) {
            pass.violations.push(Violation {
                code: ViolationCode::MissingResult,
                turn: self.turn_id.as_ref().map(|id| id.borrow().to_owned()),
                block: call.block_id.as_ref().map(|id| id.borrow().to_owned()),
                call_id: Some(call.call_id.borrow().to_owned()),
                message: format!(
                    "call {:?} has no terminal result before the next non-tool turn",
                    call.call_id.borrow()
                ),
            });
        }
    }
}

impl<'a> Pass<'a> {
    fn push(&mut self, code: ViolationCode, block: Option<&str>, call_id: Option<&str>, message: String) {
        self.violations.push(Violation {
            code,
            turn: self.turn_id.map(str::to_owned),
            block: block.map(str::to_owned),
            call_id: call_id.map(str::to_owned),
            message,
        });
    }

    fn result<K: std::borrow::Borrow<str>>(
        &mut self,
        open: Option<&mut OpenCalls<K>>,
        block_id: Option<&str>,
        call_id: &CallId,
        tool: &str,
        args_digest: Option<&Digest>,
        generation: Option<Generation>,
    ) {
        let call_id_text = Some(call_id.as_str());
        let Some(open) = open else {
            self.push(
                ViolationCode::OrphanResult,
                block_id,
                call_id_text,
                "a tool result that follows no assistant tool calls".into(),
            );
            return;
        };
        let call_generation = open.generation;
        let Some(call) = open
            .calls
            .iter_mut()
            .find(|call| call.call_id.borrow() == call_id.as_str())
        else {
            self.push(
                ViolationCode::OrphanResult,
                block_id,
                call_id_text,
                format!(
                    "no call {:?} in the assistant turn before this tool run",
                    call_id.0
                ),
            );
            return;
        };
        if call.answered {
            self.push(
                ViolationCode::DuplicateResult,
                block_id,
                call_id_text,
                format!("call {:?} already has a terminal result", call_id.0),
            );
            return;
        }
        call.answered = true;
        // Spec §1: a result must carry `tool`, `args_digest` and `generation`; one that lacks
        // any of them cannot be shown to match its call and is `result_mismatch`.
        let mut differences = Vec::new();
        if tool.is_empty() {
            differences.push("the result carries no tool".to_owned());
        } else if call.tool.borrow() != tool {
            differences.push(format!(
                "tool {tool:?} is not the call's {:?}",
                call.tool.borrow()
            ));
        }
        match (
            args_digest,
            call.args_digest.as_ref().map(|digest| digest.borrow()),
        ) {
            (None, Some(_)) => differences.push("the result carries no args_digest".to_owned()),
            (Some(given), Some(expected)) if given.as_str() != expected => {
                differences.push(format!("args_digest {given} is not the call's {expected}"));
            }
            // The call's arguments are unclosed, so it has no digest to match (or copy, for an
            // importer): that call is already `unclosed_arguments`, reported once.
            (_, None) | (Some(_), Some(_)) => {}
        }
        match generation {
            None => differences.push("the result carries no generation".to_owned()),
            Some(given) if Some(given) != call_generation => differences.push(format!(
                "generation {given} is not the call's {}",
                call_generation.map_or("none".into(), |g| g.to_string()),
            )),
            Some(_) => {}
        }
        if !differences.is_empty() {
            self.push(
                ViolationCode::ResultMismatch,
                block_id,
                call_id_text,
                differences.join("; "),
            );
        }
    }
}
