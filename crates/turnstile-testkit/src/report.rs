//! What one seed found and what a run of many seeds adds up to, as text and as JSON.

use crate::plan::FaultKind;
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// The invariants of the history checker (issue 7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Invariant {
    /// A sent body's SHA-256 differs from its manifest's request digest, or the body does not
    /// re-render from the history the manifest pins.
    IllegalSend,
    /// Bytes went to the provider before a durable DISPATCHING row of that generation.
    SendBeforeDurable,
    /// The tool-call ledger differs from the tool calls of committed turns, a call's arguments
    /// are incomplete or not schema-valid, or an executor saw a call that is not committed.
    PartialToolDispatch,
    /// More than one canonical assistant turn for one dispatch (conversation revision).
    CanonicalTurns,
    /// A block of a non-committed (late or foreign) generation is in the history.
    LateBlockInHistory,
    /// A previewed generation neither committed nor was retracted.
    PreviewUnresolved,
    /// The committed history does not validate.
    HistoryInvalid,
    /// A store counter differs from the checker's own tally.
    MetricsMismatch,
    /// An attempt is still UNKNOWN after the liveness phase (or past lease + ε in it).
    UnknownUnresolved,
    /// A new generation was sent while an older one was not confirmed over (its lease had not
    /// run out by the store's clock and the provider had not ended it).
    EarlyNewGeneration,
    /// A driver showed preview of a generation after a newer generation of its operation was
    /// sent: the old holder read its connection past the hand-over.
    StaleGenerationRead,
    /// An operation made more provider attempts (generations) than the budget.
    AttemptBudget,
    /// An operation was not terminal after the liveness phase.
    OperationNotTerminal,
    /// The tool-call ledger broke an executor's promise: an expired call not listed or not
    /// reclaimable, its key not stable across claims, a taken-over claim's result accepted, or
    /// the current claim's result refused.
    ToolLedger,
    /// A proxied request rendered from a legal history was not admitted or did not render; a
    /// proxy client's answer differs from its operation's committed turn (or it was answered
    /// and nothing committed); or the client's history with its answer did not continue the
    /// stored conversation.
    ProxyAnswer,
    /// A real component panicked (an `assert!` of the core, for one).
    Panic,
}

impl Invariant {
    /// The name used in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Invariant::IllegalSend => "illegal_send",
            Invariant::SendBeforeDurable => "send_before_durable",
            Invariant::PartialToolDispatch => "partial_tool_dispatch",
            Invariant::CanonicalTurns => "canonical_turns_per_revision",
            Invariant::LateBlockInHistory => "late_block_in_history",
            Invariant::PreviewUnresolved => "preview_unresolved",
            Invariant::HistoryInvalid => "history_invalid",
            Invariant::MetricsMismatch => "metrics_mismatch",
            Invariant::UnknownUnresolved => "unknown_unresolved",
            Invariant::EarlyNewGeneration => "early_new_generation",
            Invariant::StaleGenerationRead => "stale_generation_read",
            Invariant::AttemptBudget => "attempt_budget",
            Invariant::OperationNotTerminal => "operation_not_terminal",
            Invariant::ToolLedger => "tool_ledger",
            Invariant::ProxyAnswer => "proxy_answer",
            Invariant::Panic => "panic",
        }
    }
}

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The seed that found it.
    pub seed: u64,
    /// The step after which the checker saw it.
    pub step: u64,
    /// Which invariant.
    pub invariant: Invariant,
    /// What exactly (for the trace; not an API).
    pub detail: String,
}

/// What one seed did and found.
#[derive(Clone, Debug, Default)]
pub struct SeedReport {
    /// The seed.
    pub seed: u64,
    /// Faults injected, by kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// Steps taken.
    pub steps: u64,
    /// Invariant evaluations.
    pub checks: u64,
    /// Broken invariants (the first few of each kind).
    pub violations: Vec<Violation>,
    /// Provider requests whose body broke the illegal-send invariant.
    pub illegal_sends: u64,
    /// Tool calls exposed or ledgered without a committed, complete call.
    pub partial_tool_dispatch: u64,
    /// Most canonical assistant turns seen for one dispatch.
    pub canonical_turns_per_revision_max: u64,
    /// Attempts left UNKNOWN after the liveness phase.
    pub unknown_unresolved: u64,
    /// Dispatches committed.
    pub commits: u64,
    /// Provider requests sent.
    pub sends: u64,
    /// Gateway replicas sharing the store.
    pub replicas: u64,
    /// The largest clock skew of a replica against the store's clock, in ms.
    pub clock_skew_ms_max: u64,
    /// Client disconnects (left after prepare, or cut by a crash of their replica).
    pub disconnects: u64,
    /// Dispatches that moved to their failover target (the driver's `Count::Failover`).
    pub failovers: u64,
    /// Requests through the drop-in proxy.
    pub proxy_requests: u64,
    /// Proxied requests that were stored as a fresh conversation instead of continuing.
    pub proxy_forks: u64,
    /// Proxy clients' answers decoded and compared with their committed turn.
    pub proxy_answers: u64,
    /// Of those, streamed answers.
    pub proxy_streamed_answers: u64,
    /// Liveness violations (UNKNOWN left, operation not terminal).
    pub liveness_violations: u64,
    /// The trace, when asked for.
    pub trace: Vec<String>,
}

/// Most violations of one invariant kept per seed (the count goes on).
const VIOLATIONS_KEPT_PER_KIND_MAX: usize = 4;

impl SeedReport {
    /// Record a broken invariant.
    pub fn violate(&mut self, step: u64, invariant: Invariant, detail: String) {
        if matches!(
            invariant,
            Invariant::UnknownUnresolved | Invariant::OperationNotTerminal
        ) {
            self.liveness_violations += 1;
        }
        let kept = self
            .violations
            .iter()
            .filter(|violation| violation.invariant == invariant)
            .count();
        if kept < VIOLATIONS_KEPT_PER_KIND_MAX {
            self.violations.push(Violation {
                seed: self.seed,
                step,
                invariant,
                detail,
            });
        }
    }

    /// Count one injected fault.
    pub fn fault(&mut self, kind: FaultKind) {
        *self.faults.entry(kind).or_default() += 1;
    }
}

/// The sum over a range of seeds.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// First seed.
    pub seed_first: u64,
    /// Seeds run.
    pub seeds: u64,
    /// Faults by kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// Steps.
    pub steps: u64,
    /// Checks.
    pub checks: u64,
    /// Violations kept (seeds to replay).
    pub violations: Vec<Violation>,
    /// Violation count.
    pub violations_total: u64,
    /// Headline figures.
    pub illegal_sends: u64,
    /// Headline figures.
    pub partial_tool_dispatch: u64,
    /// Headline figures.
    pub canonical_turns_per_revision_max: u64,
    /// Headline figures.
    pub unknown_unresolved: u64,
    /// Commits over all seeds.
    pub commits: u64,
    /// Provider requests over all seeds.
    pub sends: u64,
    /// Most replicas in one seed.
    pub replicas: u64,
    /// Largest clock skew of a replica against the store, ms.
    pub clock_skew_ms_max: u64,
    /// Client disconnects.
    pub disconnects: u64,
    /// Failovers to a dispatch's next target.
    pub failovers: u64,
    /// Requests through the drop-in proxy.
    pub proxy_requests: u64,
    /// Proxied requests stored as a fresh conversation instead of continuing.
    pub proxy_forks: u64,
    /// Proxy clients' answers decoded and compared with their committed turn.
    pub proxy_answers: u64,
    /// Of those, streamed answers.
    pub proxy_streamed_answers: u64,
    /// Liveness violations.
    pub liveness_violations: u64,
}

/// Most violations kept in a summary.
const SUMMARY_VIOLATIONS_KEPT_MAX: usize = 32;

impl Summary {
    /// Add one seed.
    pub fn add(&mut self, report: &SeedReport) {
        self.seeds += 1;
        for (kind, count) in &report.faults {
            *self.faults.entry(*kind).or_default() += count;
        }
        self.steps += report.steps;
        self.checks += report.checks;
        self.violations_total += report.violations.len() as u64;
        for violation in &report.violations {
            if self.violations.len() < SUMMARY_VIOLATIONS_KEPT_MAX {
                self.violations.push(violation.clone());
            }
        }
        self.illegal_sends += report.illegal_sends;
        self.partial_tool_dispatch += report.partial_tool_dispatch;
        self.canonical_turns_per_revision_max = self
            .canonical_turns_per_revision_max
            .max(report.canonical_turns_per_revision_max);
        self.unknown_unresolved += report.unknown_unresolved;
        self.commits += report.commits;
        self.sends += report.sends;
        self.replicas = self.replicas.max(report.replicas);
        self.clock_skew_ms_max = self.clock_skew_ms_max.max(report.clock_skew_ms_max);
        self.disconnects += report.disconnects;
        self.failovers += report.failovers;
        self.proxy_requests += report.proxy_requests;
        self.proxy_forks += report.proxy_forks;
        self.proxy_answers += report.proxy_answers;
        self.proxy_streamed_answers += report.proxy_streamed_answers;
        self.liveness_violations += report.liveness_violations;
    }

    /// The headline line of the issue.
    pub fn headline(&self) -> String {
        format!(
            "illegal_sends={} partial_tool_dispatch={} canonical_turns_per_revision_max={} unknown_unresolved={}",
            self.illegal_sends,
            self.partial_tool_dispatch,
            self.canonical_turns_per_revision_max,
            self.unknown_unresolved
        )
    }

    /// The report as text (seed range and commit first, as the issue asks).
    pub fn text(&self, commit: &str) -> String {
        let mut out = String::new();
        let last = self.seed_first + self.seeds.saturating_sub(1);
        out.push_str(&format!(
            "seeds {}..={} ({} seeds)  commit {commit}\n",
            self.seed_first, last, self.seeds
        ));
        out.push_str("faults injected:\n");
        for (kind, count) in &self.faults {
            out.push_str(&format!("  {:<26} {count}\n", kind.as_str()));
        }
        out.push_str(&format!(
            "steps {}  checks {}  sends {}  commits {}  violations {}\n",
            self.steps, self.checks, self.sends, self.commits, self.violations_total
        ));
        out.push_str(&format!(
            "replicas {}  clock skew up to {} ms  client disconnects {}  failovers {}  liveness violations {}\n",
            self.replicas, self.clock_skew_ms_max, self.disconnects, self.failovers, self.liveness_violations
        ));
        out.push_str(&format!(
            "proxy requests {}  proxy forks {}  proxy answers checked {} ({} streamed)\n",
            self.proxy_requests, self.proxy_forks, self.proxy_answers, self.proxy_streamed_answers
        ));
        for violation in &self.violations {
            out.push_str(&format!(
                "  VIOLATION seed {} step {} {}: {}   (replay: turnstile-dst --seed {})\n",
                violation.seed,
                violation.step,
                violation.invariant.as_str(),
                violation.detail,
                violation.seed
            ));
        }
        out.push_str(&self.headline());
        out.push('\n');
        out
    }

    /// The report as one JSON object with the keys.
    pub fn json(&self) -> Value {
        let faults: serde_json::Map<String, Value> = self
            .faults
            .iter()
            .map(|(kind, count)| (kind.as_str().to_owned(), json!(count)))
            .collect();
        json!({
            "seeds": self.seeds,
            "faults": faults,
            "checks": self.checks,
            "violations": self.violations_total,
            "illegal_sends": self.illegal_sends,
            "partial_tool_dispatch": self.partial_tool_dispatch,
            "canonical_turns_per_revision_max": self.canonical_turns_per_revision_max,
            "unknown_unresolved": self.unknown_unresolved,
            "replicas": self.replicas,
            "clock_skew_ms_max": self.clock_skew_ms_max,
            "disconnects": self.disconnects,
            "failovers": self.failovers,
            "proxy_requests": self.proxy_requests,
            "proxy_forks": self.proxy_forks,
            "proxy_answers": self.proxy_answers,
            "proxy_streamed_answers": self.proxy_streamed_answers,
            "liveness_violations": self.liveness_violations,
        })
    }
}
