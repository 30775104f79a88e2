//! Newtypes for the identifiers that cross crate boundaries.
//!
//! Revisions and generations are plain counters but they must never be mixed up with each other
//! (a revision orders committed turns, a generation names one dispatch attempt), so each gets
//! its own type.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The revision of a conversation: the number of the last committed turn. A new conversation
/// is at revision 0; each committed turn increments it by one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Revision(pub u64);

/// The generation of one dispatch attempt, allocated by the store's compare-and-set. Tool
/// results carry the generation of the assistant turn that emitted their call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Generation(pub u64);

/// A tool call id as the conversation knows it (ours; adapters may map it for a provider).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CallId(pub String);

impl CallId {
    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for CallId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
