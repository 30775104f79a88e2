//! Token admission: the one rule that refuses a request before any I/O.
//!
//! `prompt_tokens + max_output_tokens > context_window` → refused. `prompt_tokens` is the
//! adapter's count of the final rendered bytes, tool definitions included (exact for BPE
//! tokenizers, a measured upper bound otherwise), so a refusal here is never a guess that a
//! provider would have accepted a request we could not count. Pure arithmetic: no clock, no
//! I/O, saturating so a huge `max_output_tokens` cannot overflow into an admission.

use serde::Serialize;

/// The admission decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "admission", rename_all = "snake_case")]
#[must_use]
pub enum Admission {
    /// Fits: `headroom` tokens of the window stay unused even if the output cap is reached.
    Admitted {
        /// `context_window - prompt_tokens - max_output_tokens`.
        headroom: u64,
    },
    /// Does not fit.
    Refused(OverBudget),
}

/// A refused request's numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct OverBudget {
    /// Admission count of the rendered request.
    pub prompt_tokens: u64,
    /// Requested output cap.
    pub max_output_tokens: u64,
    /// The model's context window.
    pub context_window: u64,
}

impl OverBudget {
    /// By how many tokens the request is over.
    pub fn excess(&self) -> u64 {
        self.prompt_tokens
            .saturating_add(self.max_output_tokens)
            .saturating_sub(self.context_window)
    }
}

/// Apply the admission rule.
pub fn admit(prompt_tokens: u64, max_output_tokens: u64, context_window: u64) -> Admission {
    let needed = prompt_tokens.saturating_add(max_output_tokens);
    if needed > context_window {
        Admission::Refused(OverBudget {
            prompt_tokens,
            max_output_tokens,
            context_window,
        })
    } else {
        Admission::Admitted {
            headroom: context_window - needed,
        }
    }
}
