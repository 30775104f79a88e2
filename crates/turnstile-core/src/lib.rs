//! Turnstile's core: the committed-history model, the validator, content digests and the
//! `MessageSequence` graph (format v2).
//!
//! This crate is sans-IO by rule (see `ARCHITECTURE.md`): it never reads a socket, a file or a
//! clock and holds no randomness. Callers hand it bytes or values and get decisions back. A tidy
//! test in `tests/it/tidy.rs` fails if that changes.
//!
//! Data flow inside this crate:
//! `parse::conversation_from_slice` (bytes → [`conversation::Conversation`], limits enforced)
//! → [`validate::validate`] ([`validate::Verdict`]: ready / waiting / rejected with every
//! violation) → [`sequence::MessageSequence::build`] (only from a [`validate::Validated`]
//! conversation) → `sequence_digest`.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod admission;
pub mod assemble;
pub mod conversation;
pub mod digest;
pub mod dispatch;
pub mod ids;
pub mod kept;
pub mod limits;
pub mod manifest;
pub mod parse;
pub mod repair;
pub mod sequence;
pub mod stream;
pub mod validate;
pub mod violation;

pub use conversation::Conversation;
pub use digest::Digest;
pub use ids::{CallId, Generation, Revision};
pub use kept::KeptConversation;
pub use sequence::MessageSequence;
pub use validate::{Validated, Verdict, validate};
pub use violation::{Violation, ViolationCode};
