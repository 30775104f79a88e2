//! The validator: one pass over a decoded conversation that reports *every* violation of the
//! v1 contract (`shared/spec/conversation-v1.md` §2), or says the history is ready, or that it
//! is waiting for tool results.
//!
//! Pairing rule: the results for one assistant turn's calls live in the run of consecutive
//! `tool` turns directly after it, spread over those turns in any order. A non-tool turn closes
//! the run; calls still unanswered then are `missing_result`. If the conversation ends inside
//! the run (or right after the assistant turn), the unanswered calls are pending: `waiting`.

use crate::conversation::{Arguments, BlockBody, BlockState, Conversation, Role, RoleField, Trust};
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
    let mut turn_ids: HashSet<&str> = HashSet::with_capacity(conversation.turns.len());
    let mut block_ids: HashSet<&str> = HashSet::new();
    let mut call_ids: HashSet<&str> = HashSet::new();
    let mut revision_last = None;
    let mut seen_non_system = false;
    // Calls of the assistant turn whose tool run is open, with whether each is answered.
    let mut open: Option<OpenCalls<'_>> = None;

    for turn in &conversation.turns {
        pass.turn_id = turn.id.as_deref();
        if let Some(id) = turn.id.as_deref() {
            if !turn_ids.insert(id) {
                pass.push(
                    ViolationCode::InvalidStructure,
                    None,
                    None,
                    format!("duplicate turn id {id:?}"),
                );
            }
        }
        if let Some(revision) = turn.revision {
            if let Some(last) = revision_last {
                if revision <= last {
                    pass.push(
                        ViolationCode::InvalidStructure,
                        None,
                        None,
                        format!("turn revision {revision} does not increase (previous {last})"),
                    );
                }
            }
            revision_last = Some(revision);
        }
        let role = match turn.role {
            RoleField::Known(role) => Some(role),
            RoleField::Invalid => None,
        };
        if role != Some(Role::Tool) {
            if let Some(closed) = open.take() {
                closed.report_missing(&mut pass);
            }
        }
        match role {
            Some(Role::System) if seen_non_system => {
                pass.push(
                    ViolationCode::RoleViolation,
                    None,
                    None,
                    "a system turn may only open the conversation".into(),
                );
            }
            Some(Role::System) => {}
            _ => seen_non_system = true,
        }
        let mut calls_here: Vec<CallRecord<'_>> = Vec::new();
        for block in &turn.blocks {
            let block_id = block.id.as_deref();
            if let Some(id) = block_id {
                if !block_ids.insert(id) {
                    pass.push(
                        ViolationCode::InvalidStructure,
                        block_id,
                        None,
                        format!("duplicate block id {id:?}"),
                    );
                }
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
                    if !call_ids.insert(call_id.as_str()) {
                        pass.push(
                            ViolationCode::DuplicateCallId,
                            block_id,
                            Some(call_id.as_str()),
                            format!("call id {call_id:?} is already used by another tool_call"),
                        );
                        continue;
                    }
                    calls_here.push(CallRecord {
                        call_id,
                        tool,
                        args_digest: arguments.digest(),
                        block_id,
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
                        open.as_mut(),
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
            open = Some(OpenCalls {
                turn_id: turn.id.as_deref(),
                generation: turn.generation,
                calls: calls_here,
            });
        }
    }

    let pending: Vec<CallId> = open
        .map(|open| {
            open.calls
                .into_iter()
                .filter(|call| !call.answered)
                .map(|call| call.call_id.clone())
                .collect()
        })
        .unwrap_or_default();
    if !pass.violations.is_empty() {
        Verdict::Rejected(pass.violations)
    } else if !pending.is_empty() {
        Verdict::Waiting { pending }
    } else {
        Verdict::Ready
    }
}

struct Pass<'a> {
    violations: Vec<Violation>,
    turn_id: Option<&'a str>,
}

struct CallRecord<'a> {
    call_id: &'a CallId,
    tool: &'a str,
    args_digest: Option<&'a Digest>,
    block_id: Option<&'a str>,
    answered: bool,
}

struct OpenCalls<'a> {
    turn_id: Option<&'a str>,
    generation: Option<Generation>,
    calls: Vec<CallRecord<'a>>,
}

impl OpenCalls<'_> {
    fn report_missing(self, pass: &mut Pass<'_>) {
        for call in self.calls.iter().filter(|call| !call.answered) {
            pass.violations.push(Violation {
                code: ViolationCode::MissingResult,
                turn: self.turn_id.map(str::to_owned),
                block: call.block_id.map(str::to_owned),
                call_id: Some(call.call_id.0.clone()),
                message: format!(
                    "call {:?} has no terminal result before the next non-tool turn",
                    call.call_id.0
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

    fn result(
        &mut self,
        open: Option<&mut OpenCalls<'_>>,
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
        let Some(call) = open.calls.iter_mut().find(|call| call.call_id == call_id) else {
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
        } else if call.tool != tool {
            differences.push(format!("tool {tool:?} is not the call's {:?}", call.tool));
        }
        match (args_digest, call.args_digest) {
            (None, Some(_)) => differences.push("the result carries no args_digest".to_owned()),
            (Some(given), Some(expected)) if given != expected => {
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
