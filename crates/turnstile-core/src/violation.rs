//! Violation codes of the validator contract (`shared/spec/conversation-v1.md` §2).

use serde::Serialize;
use std::fmt;

/// One rule of the v1 contract. The serialised strings are fixed by the spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ViolationCode {
    /// Missing/duplicate turn or block id, unknown role, empty turn, revision not increasing,
    /// malformed field.
    InvalidStructure,
    /// Block kind not in v1.
    UnknownKind,
    /// Kind not allowed for the turn's role; system turn after a non-system turn.
    RoleViolation,
    /// A `context` block outside system/user, or an untrusted one in a system turn.
    ScopeViolation,
    /// A call_id used by two tool_call blocks.
    DuplicateCallId,
    /// Tool call arguments are not a complete JSON object.
    UnclosedArguments,
    /// A block whose state is not `committed`.
    UncommittedBlock,
    /// A tool_result whose call_id is not a call of the assistant turn before its tool run.
    OrphanResult,
    /// A second terminal result for the same call.
    DuplicateResult,
    /// A result's tool, args_digest or generation differs from its call.
    ResultMismatch,
    /// A call without a terminal result, followed by a non-tool turn.
    MissingResult,
}

impl ViolationCode {
    /// Every code, in spec table order.
    pub const ALL: [ViolationCode; 11] = [
        ViolationCode::InvalidStructure,
        ViolationCode::UnknownKind,
        ViolationCode::RoleViolation,
        ViolationCode::ScopeViolation,
        ViolationCode::DuplicateCallId,
        ViolationCode::UnclosedArguments,
        ViolationCode::UncommittedBlock,
        ViolationCode::OrphanResult,
        ViolationCode::DuplicateResult,
        ViolationCode::ResultMismatch,
        ViolationCode::MissingResult,
    ];

    /// The spec string of this code.
    pub fn as_str(self) -> &'static str {
        match self {
            ViolationCode::InvalidStructure => "invalid_structure",
            ViolationCode::UnknownKind => "unknown_kind",
            ViolationCode::RoleViolation => "role_violation",
            ViolationCode::ScopeViolation => "scope_violation",
            ViolationCode::DuplicateCallId => "duplicate_call_id",
            ViolationCode::UnclosedArguments => "unclosed_arguments",
            ViolationCode::UncommittedBlock => "uncommitted_block",
            ViolationCode::OrphanResult => "orphan_result",
            ViolationCode::DuplicateResult => "duplicate_result",
            ViolationCode::ResultMismatch => "result_mismatch",
            ViolationCode::MissingResult => "missing_result",
        }
    }
}

impl fmt::Display for ViolationCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One problem found in a conversation. `turn`, `block` and `call_id` point at it where they
/// apply; `message` is for humans (tests assert codes, never messages).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// Which rule.
    pub code: ViolationCode,
    /// The id of the turn it is in, if that turn has an id.
    pub turn: Option<String>,
    /// The id of the block it is in, if any.
    pub block: Option<String>,
    /// The tool call id it concerns, if any.
    pub call_id: Option<String>,
    /// A human explanation.
    pub message: String,
}
