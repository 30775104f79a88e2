//! A conversation kept in memory between dispatches, with what the validator and the message
//! sequence know about it, so the next turn costs its own blocks.
//!
//! An agent loop appends a turn and asks for the next request, again and again. Decoding,
//! validating and building the graph of the whole history each time makes a step grow with the
//! history. [`KeptConversation`] holds the decoded [`Conversation`], the validator's walk
//! ([`History`]) and the [`GrowingSequence`]; [`KeptConversation::push_turn`] decodes, checks and
//! adds only the new turn. The results are the same as a whole walk of the grown conversation:
//! the verdict (`History`'s own guarantee, `tests/it/history.rs`) and the sequence with its
//! digest (`tests/it/kept.rs` compares each push with [`MessageSequence::build`]).
//!
//! A push that makes the history illegal keeps the conversation and the verdict (the caller
//! reports it) and drops the sequence; [`KeptConversation::pop_turn`] takes the turn back, and
//! rebuilds from the whole conversation in the one case an exact undo is not possible (a push
//! that found something: the walk's id sets may have refused one of its ids).
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a conversation kept in memory and given one turn at a time has the verdict, proof and message
//!   sequence (digest included) of a whole walk of the grown file, and of each shorter one after a
//!   pop. Enforced in `core/src/kept.rs`, `sequence.rs` (`GrowingSequence`: one implementation with
//!   `build`), `validate.rs` (`History::push_marked`/`pop`). Tests: `core/tests/it/kept.rs` (every
//!   split of every data file and of 64 generated histories; red with a result's edge not reset on
//!   pop or the sealed edges skipped in the digest).

use crate::conversation::{PushedTurn, Turn, Unreadable};
use crate::ids::Revision;
use crate::sequence::{GrowingSequence, SequenceMark};
use crate::validate::{History, HistoryMark, Validated, Verdict};
use crate::{Conversation, MessageSequence};
use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};

/// The next turn stamp (see [`KeptConversation::turn_stamps`]); unique in the process.
static NEXT_STAMP: AtomicU64 = AtomicU64::new(1);

/// `count` fresh stamps.
fn stamps(count: usize) -> impl Iterator<Item = u64> {
    let first = NEXT_STAMP.fetch_add(count as u64, Ordering::Relaxed);
    first..first + count as u64
}

/// A decoded conversation with its validator state and, while it is legal, its sequence.
#[derive(Clone, Debug)]
pub struct KeptConversation {
    conversation: Conversation,
    history: History,
    sequence: Option<GrowingSequence>,
    /// One stamp per turn, given when the turn was added (see [`Self::turn_stamps`]).
    stamps: Vec<u64>,
}

/// What [`KeptConversation::pop_turn`] needs to undo one [`KeptConversation::push_turn`].
#[derive(Debug)]
#[must_use]
pub struct KeptPush {
    turn: PushedTurn,
    history: HistoryMark,
    sequence: Option<SequenceMark>,
}

impl KeptConversation {
    /// Keep a decoded conversation: one whole walk and one sequence build.
    pub fn new(conversation: Conversation) -> KeptConversation {
        let history = History::of(&conversation);
        let sequence = Validated::from_history(&conversation, &history).map(GrowingSequence::of);
        let stamps = stamps(conversation.turns.len()).collect();
        KeptConversation {
            conversation,
            history,
            sequence,
            stamps,
        }
    }

    /// One stamp per turn, in turn order: a number unique in the process, given to a turn when
    /// it was added here (by [`Self::new`] or [`Self::push_turn`]) and never again to another.
    /// The turns are only ever pushed and popped at the end, so equal stamps at index `i` mean
    /// the same turns `[..=i]`: a renderer that kept its state after those turns
    /// (`turnstile_adapters::render`) resumes from it without comparing them. A clone keeps the
    /// stamps with the same turns; what either adds after gets fresh ones.
    pub fn turn_stamps(&self) -> &[u64] {
        &self.stamps
    }

    /// The conversation.
    pub fn conversation(&self) -> &Conversation {
        &self.conversation
    }

    /// The verdict on the whole conversation (for the cost of its findings and open calls).
    pub fn verdict(&self) -> Verdict {
        self.history.verdict()
    }

    /// The proof that the conversation is ready or waiting, or `None` when it is rejected.
    pub fn validated(&self) -> Option<Validated<'_>> {
        Validated::from_history(&self.conversation, &self.history)
    }

    /// The message sequence of the conversation, `None` when it is rejected.
    pub fn sequence(&self) -> Option<&MessageSequence> {
        self.sequence.as_ref().map(GrowingSequence::sequence)
    }

    /// The proof and the sequence together, `None` when the conversation is rejected.
    pub fn graph_parts(&self) -> Option<(Validated<'_>, &MessageSequence)> {
        Some((self.validated()?, self.sequence()?))
    }

    /// Decode one more turn (its JSON object, as in a conversation file) at `revision`, check
    /// it against the history and add it to the sequence. `Err` when the turn is unreadable
    /// (nothing changed); a turn that breaks a rule is kept and shows in [`Self::verdict`].
    pub fn push_turn(&mut self, turn: Value, revision: Revision) -> Result<KeptPush, Unreadable> {
        let violations_before = self.conversation.decode_violations.len();
        let pushed = self.conversation.push_turn(turn, revision)?;
        let found = self.conversation.decode_violations[violations_before..].to_vec();
        let last = self
            .conversation
            .turns
            .last()
            .expect("a pushed turn is the last turn");
        let history = self.history.push_marked(last, found);
        let sequence = match (
            self.sequence.as_mut(),
            Validated::from_history(&self.conversation, &self.history),
        ) {
            (Some(sequence), Some(validated)) => Some(sequence.push_turn(validated)),
            _ => {
                self.sequence = None;
                None
            }
        };
        self.stamps.extend(stamps(1));
        Ok(KeptPush {
            turn: pushed,
            history,
            sequence,
        })
    }

    /// Take back the last [`Self::push_turn`]; returns the turn.
    pub fn pop_turn(&mut self, pushed: KeptPush) -> Option<Turn> {
        let turn = self.conversation.pop_turn(pushed.turn)?;
        self.stamps.pop();
        let exact = self.history.pop(&turn, pushed.history);
        match (exact, pushed.sequence, self.sequence.as_mut()) {
            (true, Some(mark), Some(sequence)) => sequence.pop_turn(mark),
            (true, None, None) => {
                // The push made the history illegal and dropped the sequence, or it was
                // already illegal: build it again if the history is legal again.
                self.sequence =
                    Validated::from_history(&self.conversation, &self.history).map(GrowingSequence::of);
            }
            _ => {
                self.history = History::of(&self.conversation);
                self.sequence =
                    Validated::from_history(&self.conversation, &self.history).map(GrowingSequence::of);
            }
        }
        Some(turn)
    }
}
