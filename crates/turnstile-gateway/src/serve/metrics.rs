//! The gateway's metrics, with the names fixed by `shared/spec/gateway-api.md`, exported in the
//! Prometheus text format by `metrics-exporter-prometheus`. Every required series exists from
//! start-up (at zero), so a scrape shows a metric that must stay 0 as 0, not as absent.
//!
//! Counts are per gateway process; with several replicas, sum them.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a stuck dispatch anywhere shows in `turnstile_dispatch_unknown_age_seconds` on every replica.
//!   Enforced in `ops.rs::stuck_age_ms` (store clock), `api.rs::metrics_text`. Tests:
//!   `store/tests/it/conformance.rs::a_live_attempt_past_its_lease_is_seen_as_stuck…`.
//!
//! Every family is described (`# HELP`) from [`HELP`], one table, and the tidy test
//! `every_family_on_the_page_is_described` holds the page to it. Histograms are real Prometheus
//! histograms (`_bucket`/`_sum`/`_count`, buckets [`SECONDS_BUCKETS`]), not summaries, so they
//! aggregate across replicas. Label values are bounded: `provider` is a configured name,
//! `tenant` a configured tenant (or `none`), and at most [`TARGET_LABELS_MAX`] distinct
//! `provider`/`model` pairs get their own series; the rest share `model="_other"` and are counted
//! in `turnstile_metric_label_overflow_total` (docs/decisions/0170-metrics-conventions.md).

use metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};
use turnstile_core::ViolationCode;
use turnstile_core::dispatch::DispatchState;

/// Validator rejections by code.
pub const VALIDATOR_REJECTS: &str = "turnstile_validator_rejects_total";
/// Tool results for calls that are not open.
pub const TOOL_RESULT_ORPHANS: &str = "turnstile_tool_result_orphans_total";
/// Second results for one call.
pub const TOOL_RESULT_DUPLICATES: &str = "turnstile_tool_result_duplicates_total";
/// Age of the oldest UNKNOWN attempt (0 when there is none).
pub const DISPATCH_UNKNOWN_AGE: &str = "turnstile_dispatch_unknown_age_seconds";
/// Recoveries of UNKNOWN attempts by outcome.
pub const HANDLE_RECOVERIES: &str = "turnstile_handle_recoveries_total";
/// Blocks that went to the quarantine log.
pub const LATE_BLOCKS: &str = "turnstile_late_blocks_total";
/// Generations whose preview was retracted.
pub const PREVIEW_RETRACTIONS: &str = "turnstile_preview_retractions_total";
/// Canonical commits that lost their compare-and-set.
pub const CANONICAL_CAS_CONFLICTS: &str = "turnstile_canonical_cas_conflicts_total";
/// Tool calls exposed from an uncommitted or incomplete turn. Must stay 0.
pub const PARTIAL_TOOL_DISPATCH: &str = "turnstile_partial_tool_dispatch_total";
/// Requests that would have left with bytes other than their manifest's. Must stay 0.
pub const ILLEGAL_SENDS: &str = "turnstile_illegal_sends_total";
/// Dispatch state transitions.
pub const DISPATCH_TRANSITIONS: &str = "turnstile_dispatch_transitions_total";
/// Provider handles refused because they are bound to another manifest.
pub const FOREIGN_HANDLES: &str = "turnstile_foreign_handle_refusals_total";
/// Proxy requests by endpoint API, mode and outcome (`ours`, `original`, `refused`).
pub const PROXY_REQUESTS: &str = "turnstile_proxy_requests_total";
/// Shadow comparisons by endpoint API.
pub const SHADOW_COMPARISONS: &str = "turnstile_shadow_comparisons_total";
/// Shadow differences by endpoint API and kind (`bytes`, `semantic`, `would_reject`,
/// `not_importable`).
pub const SHADOW_DIFFS: &str = "turnstile_shadow_diffs_total";

/// History repairs applied, by `kind` (the cause of each change: a violation code,
/// `pending_call` or `emptied_turn`) and `route` (`native` for `POST
/// /v1/conversations/{id}/repair`).
pub const HISTORY_REPAIRS: &str = "turnstile_history_repairs_total";

/// Store operations of the dispatch driver that failed (the driver ended or left the attempt
/// explicitly; see `turnstile_drive`).
pub const DRIVER_STORE_FAILURES: &str = "turnstile_driver_store_failures_total";
/// Dispatches refused because a stored turn did not match the digest stored with it
/// (`stored_history_corrupt`; `kept.rs`). Nothing of such a dispatch was sent.
pub const STORED_HISTORY_CORRUPT: &str = "turnstile_stored_history_corrupt_total";
/// Drivers that stopped on their own before their attempt's lease could run out, by reason
/// (`lease_ending`: no renewal landed in time; `lease_lost`: a renewal was refused).
pub const SELF_FENCES: &str = "turnstile_lease_self_fences_total";
/// The reasons of [`SELF_FENCES`].
pub const SELF_FENCE_REASONS: [&str; 2] = ["lease_ending", "lease_lost"];
/// Provider connections closed because they waited past a bound (head, idle, whole attempt).
pub const PROVIDER_TIMEOUTS: &str = "turnstile_provider_timeouts_total";
/// Dispatches ended because the process-wide provider output budget was exhausted.
pub const OUTPUT_SHED: &str = "turnstile_provider_output_shed_total";
/// Provider output bytes held in memory by all dispatches of this process.
pub const OUTPUT_BYTES: &str = "turnstile_provider_output_bytes";
/// Gaps told to clients: a client stream read past previews its dispatch's backlog had
/// dropped (the backlog's preview limit, or the output budget needed the room).
pub const CLIENT_STREAM_GAPS: &str = "turnstile_client_stream_gaps_total";
/// Client backlogs whose previews were dropped because the output budget needed the room.
pub const CLIENT_BACKLOG_SHEDS: &str = "turnstile_client_backlog_sheds_total";
/// Client connections closed because the client read nothing for `client_write_timeout_ms`
/// while the gateway had bytes to write to it.
pub const CLIENT_WRITE_TIMEOUTS: &str = "turnstile_client_write_timeouts_total";
/// Requests whose body did not arrive within `body_read_timeout_ms` (answered 408, closed).
pub const BODY_READ_TIMEOUTS: &str = "turnstile_body_read_timeouts_total";
/// Dispatches that moved from one target to the next, by target (`provider/model`) and reason.
pub const FAILOVERS: &str = "turnstile_failovers_total";
/// Inputs the dispatch driver ignored (stale, duplicate, foreign), by reason.
pub const DRIVER_IGNORED: &str = "turnstile_driver_ignored_inputs_total";
/// Provider stream notices by provider and code (`usage_mismatch`): what a decoder noticed
/// that decided nothing about the turn.
pub const PROVIDER_NOTICES: &str = "turnstile_provider_notices_total";
/// Claims granted to executors on the tool-call ledger (takeovers of expired claims included).
pub const TOOL_CALL_CLAIMS: &str = "turnstile_tool_call_claims_total";
/// Claim leases extended by their current claim.
pub const TOOL_CALL_RENEWALS: &str = "turnstile_tool_call_renewals_total";
/// Claims given back by their holder (the call is ready again).
pub const TOOL_CALL_RELEASES: &str = "turnstile_tool_call_releases_total";
/// Claims granted on an `expired` call: an earlier claim's lease ran out (the tool may have run).
pub const TOOL_CALL_EXPIRIES: &str = "turnstile_tool_call_expiries_total";
/// Tool results refused because their claim was not current (released or taken over).
pub const TOOL_RESULT_STALE: &str = "turnstile_tool_result_stale_total";
/// Calls handed to a proxy client that a fork of the same client abandoned
/// (`client_abandoned` before their bound; `proxy/continuation.rs`). Calls whose bound ran out
/// are read from the store, not counted.
pub const TOOL_CALL_CLIENT_FORKS: &str = "turnstile_tool_call_client_forks_total";

/// Store operations of this process that changed a row and were committed (durable writes;
/// `Ledger::write_ops`, read at each scrape).
pub const STORE_WRITE_OPS: &str = "turnstile_store_write_ops_total";
/// Store operations of this process that ended without changing a row (reads that succeeded,
/// and writes that committed having changed nothing; `Ledger::read_ops`, read at each scrape,
/// after the scrape's own read of the store).
pub const STORE_READ_OPS: &str = "turnstile_store_read_ops_total";
/// Dispatches of a stored conversation by how its history was read (`kept.rs`): `kept` (the
/// history kept in memory plus the turns since), `whole` (the whole document); read at each
/// scrape.
pub const CONVERSATION_READS: &str = "turnstile_conversation_reads_total";
/// Renders by where they started (`turnstile_adapters::render`, "resume"): `resumed` (from
/// the state kept after a kept conversation's earlier turns: the new turns rendered only),
/// `whole` (every turn); read at each scrape.
pub const RENDERS: &str = "turnstile_renders_total";
/// Renders run off the async worker, on a thread `tokio::task::block_in_place` hands the
/// worker's other tasks away from (a render of more than `api::RENDER_INLINE_BLOCKS_MAX` blocks
/// not covered by a kept state); read at each scrape.
pub const RENDERS_OFF_WORKER: &str = "turnstile_renders_off_worker_total";

/// Dispatch duration from its acceptance (the prepare) to its end here (committed, failed or
/// abandoned), by provider, model and outcome.
pub const DISPATCH_DURATION: &str = "turnstile_dispatch_duration_seconds";
/// From a dispatch's acceptance to its first preview (the first text a client could see).
pub const TIME_TO_FIRST_PREVIEW: &str = "turnstile_time_to_first_preview_seconds";
/// One provider response connection (an attempt's send or resume), from its request to its end.
pub const ATTEMPT_DURATION: &str = "turnstile_attempt_duration_seconds";
/// From a provider request to its response head.
pub const PROVIDER_HEAD_LATENCY: &str = "turnstile_provider_head_latency_seconds";
/// Provider response connections by provider, model, how they ended and HTTP status.
pub const ATTEMPTS: &str = "turnstile_attempts_total";
/// Tokens the provider reported, by provider, model, tenant and kind.
pub const TOKENS: &str = "turnstile_tokens_total";
/// Input tokens we counted ourselves for the request (the manifest's `prompt_tokens`).
pub const ESTIMATED_TOKENS: &str = "turnstile_estimated_tokens_total";
/// Dispatches that ended here with an error told to their clients, by provider, model and
/// error code (`attempts_exhausted`, `provider_status_503`, …; the codes are the driver's, a
/// bounded set).
pub const DISPATCH_ERRORS: &str = "turnstile_dispatch_errors_total";
/// Failover targets cooling down now (their circuit breaker open; read at each scrape).
pub const BREAKER_OPEN: &str = "turnstile_breaker_open_targets";
/// Cost from the configured price table (`[[prices]]`), in millionths of a US dollar, by
/// provider, model, tenant and whether the attempt committed (an integer counter: `metrics`
/// counters are integers; the fractions are carried, never dropped).
pub const COST: &str = "turnstile_cost_microdollars_total";
/// Always 1; the labels name the build.
pub const BUILD_INFO: &str = "turnstile_build_info";
/// Series that took a shared overflow label value because a label had too many values.
pub const LABEL_OVERFLOW: &str = "turnstile_metric_label_overflow_total";

/// Histogram buckets (seconds) of every `*_seconds` histogram: 5 ms to 10 min, the range
/// between a cached head and `provider_attempt_timeout_ms`.
pub const SECONDS_BUCKETS: [f64; 16] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Distinct `provider`/`model` label pairs before further models share `model="_other"`.
pub const TARGET_LABELS_MAX: usize = 64;

/// The `model` label value past [`TARGET_LABELS_MAX`].
pub const MODEL_OVERFLOW: &str = "_other";

/// How a provider response connection ended, the `end` label of [`ATTEMPTS`]: `committed`
/// (its answer was committed), `clean` (its body ended without a commit: an error status's
/// body, or an answer the driver did not commit), `broken`, `unreachable`, `closed` (closed by
/// the gateway first: a deadline, a retraction, the dispatch ending).
pub const ATTEMPT_ENDS: [&str; 5] = ["committed", "clean", "broken", "unreachable", "closed"];

/// Proxy endpoint APIs used as the `api` label.
pub const PROXY_APIS: [&str; 4] = ["openai-chat", "openai-responses", "anthropic-messages", "gemini"];
/// Kinds of shadow difference used as the `kind` label.
pub const SHADOW_DIFF_KINDS: [&str; 4] = ["bytes", "semantic", "would_reject", "not_importable"];

/// Recovery outcomes used as the `outcome` label.
pub const RECOVERY_OUTCOMES: [&str; 4] = ["resumed", "replayed", "new_generation", "waiting"];

const STATES: [DispatchState; 8] = [
    DispatchState::Prepared,
    DispatchState::Dispatching,
    DispatchState::Sent,
    DispatchState::Streaming,
    DispatchState::Committed,
    DispatchState::Unknown,
    DispatchState::Failed,
    DispatchState::Abandoned,
];

/// `# HELP` of every family, one row each (a family missing here fails the tidy test).
pub const HELP: &[(&str, &str)] = &[
    (
        VALIDATOR_REJECTS,
        "Violations found in submitted turns or stored history, by violation code.",
    ),
    (TOOL_RESULT_ORPHANS, "Tool results for calls that are not open."),
    (
        HISTORY_REPAIRS,
        "Changes made by applied history repairs, by cause and route (dry runs not counted).",
    ),
    (TOOL_RESULT_DUPLICATES, "Second results for one tool call."),
    (
        DISPATCH_UNKNOWN_AGE,
        "How long the oldest attempt that is not over has been past its lease, by the store's clock.",
    ),
    (
        HANDLE_RECOVERIES,
        "Recoveries of interrupted attempts, by outcome.",
    ),
    (LATE_BLOCKS, "Blocks sent to the quarantine."),
    (PREVIEW_RETRACTIONS, "Generations whose preview was retracted."),
    (
        CANONICAL_CAS_CONFLICTS,
        "Commits that lost the canonical compare-and-set.",
    ),
    (
        PARTIAL_TOOL_DISPATCH,
        "Tool calls exposed from an incomplete turn; must stay 0.",
    ),
    (
        ILLEGAL_SENDS,
        "Sends whose bytes were not the manifest's; must stay 0.",
    ),
    (DISPATCH_TRANSITIONS, "Persisted dispatch state transitions."),
    (
        FOREIGN_HANDLES,
        "Provider handles refused because they are bound to another manifest.",
    ),
    (
        PROXY_REQUESTS,
        "Proxy requests by endpoint API, mode and outcome.",
    ),
    (SHADOW_COMPARISONS, "Shadow comparisons by endpoint API."),
    (SHADOW_DIFFS, "Shadow differences by endpoint API and kind."),
    (
        DRIVER_STORE_FAILURES,
        "Store operations of the dispatch driver that failed.",
    ),
    (
        STORED_HISTORY_CORRUPT,
        "Dispatches refused because a stored turn no longer matched its digest.",
    ),
    (
        SELF_FENCES,
        "Drivers that stopped before their attempt's lease could run out, by reason.",
    ),
    (
        PROVIDER_TIMEOUTS,
        "Provider connections closed past a bound (head, idle, whole attempt).",
    ),
    (
        OUTPUT_SHED,
        "Dispatches ended because the provider output budget was exhausted.",
    ),
    (OUTPUT_BYTES, "Provider output bytes held in memory now."),
    (
        CLIENT_STREAM_GAPS,
        "Gaps told to clients that read past dropped previews.",
    ),
    (
        CLIENT_BACKLOG_SHEDS,
        "Client backlogs whose previews were dropped for the output budget.",
    ),
    (
        CLIENT_WRITE_TIMEOUTS,
        "Client connections closed after client_write_timeout_ms without taking a byte.",
    ),
    (
        BODY_READ_TIMEOUTS,
        "Requests whose body did not arrive within body_read_timeout_ms.",
    ),
    (
        FAILOVERS,
        "Dispatches that moved from one target to the next, by target and reason.",
    ),
    (DRIVER_IGNORED, "Inputs the dispatch driver ignored, by reason."),
    (
        PROVIDER_NOTICES,
        "Provider stream notices that decided nothing, by provider and code.",
    ),
    (TOOL_CALL_CLAIMS, "Tool-call claims granted to executors."),
    (TOOL_CALL_RENEWALS, "Tool-call claim leases extended."),
    (TOOL_CALL_RELEASES, "Tool-call claims given back."),
    (TOOL_CALL_EXPIRIES, "Tool-call claims granted on an expired call."),
    (
        TOOL_RESULT_STALE,
        "Tool results refused because their claim was not current.",
    ),
    (
        TOOL_CALL_CLIENT_FORKS,
        "Proxy client tool calls abandoned by a fork of their client.",
    ),
    (
        STORE_WRITE_OPS,
        "Store operations of this process that changed a row and were committed.",
    ),
    (
        STORE_READ_OPS,
        "Store operations of this process that ended without changing a row.",
    ),
    (
        CONVERSATION_READS,
        "Dispatches of a stored conversation by how its history was read.",
    ),
    (RENDERS, "Request body renders by where they started."),
    (RENDERS_OFF_WORKER, "Renders run off the async worker."),
    (
        super::traces::TRACE_QUEUE_SPANS,
        "Spans waiting for or in export.",
    ),
    (super::traces::TRACE_SPANS, "Spans by export outcome."),
    (
        DISPATCH_DURATION,
        "Dispatch duration from acceptance to its end here, by provider, model and outcome.",
    ),
    (
        TIME_TO_FIRST_PREVIEW,
        "Time from a dispatch's acceptance to its first preview, by provider and model.",
    ),
    (
        ATTEMPT_DURATION,
        "Provider response connection duration from request to end, by provider and model.",
    ),
    (
        PROVIDER_HEAD_LATENCY,
        "Time from a provider request to its response head, by provider and model.",
    ),
    (
        ATTEMPTS,
        "Provider response connections by provider, model, end and HTTP status.",
    ),
    (
        TOKENS,
        "Tokens the provider reported, by provider, model, tenant and kind.",
    ),
    (
        ESTIMATED_TOKENS,
        "Input tokens the gateway counted for the request body it sent, by provider, model, tenant and kind.",
    ),
    (
        DISPATCH_ERRORS,
        "Dispatches that ended here with an error code told to their clients, by provider, model and code.",
    ),
    (
        BREAKER_OPEN,
        "Failover targets whose circuit breaker is open now.",
    ),
    (
        COST,
        "Cost from the configured price table in millionths of a US dollar, by provider, model, tenant and committed.",
    ),
    (BUILD_INFO, "Always 1; the labels name the build."),
    (
        LABEL_OVERFLOW,
        "Metric series that took a shared overflow label value, by label.",
    ),
];

/// Install the process-wide recorder, describe every family and create every required series
/// at zero.
pub fn install() -> Result<PrometheusHandle, String> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
        .map_err(|error| error.to_string())?
        .install_recorder()
        .map_err(|error| error.to_string())?;
    for (name, help) in HELP {
        if name.ends_with("_seconds") && *name != DISPATCH_UNKNOWN_AGE {
            describe_histogram!(*name, Unit::Seconds, *help);
        } else if name.ends_with("_total") {
            describe_counter!(*name, *help);
        } else {
            describe_gauge!(*name, *help);
        }
    }
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION"), "commit" => env!("TURNSTILE_COMMIT")).set(1.0);
    counter!(LABEL_OVERFLOW, "label" => "model").absolute(0);
    gauge!(BREAKER_OPEN).set(0.0);
    for code in ViolationCode::ALL {
        counter!(VALIDATOR_REJECTS, "code" => code.as_str()).absolute(0);
    }
    for name in [
        TOOL_RESULT_ORPHANS,
        TOOL_RESULT_DUPLICATES,
        LATE_BLOCKS,
        PREVIEW_RETRACTIONS,
        CANONICAL_CAS_CONFLICTS,
        PARTIAL_TOOL_DISPATCH,
        ILLEGAL_SENDS,
        FOREIGN_HANDLES,
        DRIVER_STORE_FAILURES,
        STORED_HISTORY_CORRUPT,
        PROVIDER_TIMEOUTS,
        OUTPUT_SHED,
        CLIENT_STREAM_GAPS,
        CLIENT_BACKLOG_SHEDS,
        CLIENT_WRITE_TIMEOUTS,
        BODY_READ_TIMEOUTS,
        TOOL_CALL_CLAIMS,
        TOOL_CALL_RENEWALS,
        TOOL_CALL_RELEASES,
        TOOL_CALL_EXPIRIES,
        TOOL_RESULT_STALE,
        TOOL_CALL_CLIENT_FORKS,
    ] {
        counter!(name).absolute(0);
    }
    for cause in turnstile_core::repair::Cause::ALL {
        counter!(HISTORY_REPAIRS, "kind" => cause.as_str(), "route" => "native").absolute(0);
    }
    for reason in SELF_FENCE_REASONS {
        counter!(SELF_FENCES, "reason" => reason).absolute(0);
    }
    for outcome in RECOVERY_OUTCOMES {
        counter!(HANDLE_RECOVERIES, "outcome" => outcome).absolute(0);
    }
    for from in STATES {
        for to in STATES {
            if from.can_transition(to) {
                counter!(DISPATCH_TRANSITIONS, "from" => from.as_str(), "to" => to.as_str()).absolute(0);
            }
        }
    }
    for api in PROXY_APIS {
        counter!(SHADOW_COMPARISONS, "api" => api).absolute(0);
        for kind in SHADOW_DIFF_KINDS {
            counter!(SHADOW_DIFFS, "api" => api, "kind" => kind).absolute(0);
        }
    }
    gauge!(DISPATCH_UNKNOWN_AGE).set(0.0);
    gauge!(OUTPUT_BYTES).set(0.0);
    Ok(handle)
}

/// Count a validator rejection (one per violation code).
pub fn rejected(violations: &[turnstile_core::Violation]) {
    for violation in violations {
        counter!(VALIDATOR_REJECTS, "code" => violation.code.as_str()).increment(1);
        match violation.code {
            ViolationCode::OrphanResult => counter!(TOOL_RESULT_ORPHANS).increment(1),
            ViolationCode::DuplicateResult => counter!(TOOL_RESULT_DUPLICATES).increment(1),
            _ => {}
        }
    }
}

/// Count a rejection the store's validator reported by code.
pub fn rejected_codes(codes: &[ViolationCode]) {
    for code in codes {
        counter!(VALIDATOR_REJECTS, "code" => code.as_str()).increment(1);
        match code {
            ViolationCode::OrphanResult => counter!(TOOL_RESULT_ORPHANS).increment(1),
            ViolationCode::DuplicateResult => counter!(TOOL_RESULT_DUPLICATES).increment(1),
            _ => {}
        }
    }
}

/// Count the changes of an applied repair plan, one per action, by cause.
pub fn history_repairs(plan: &turnstile_core::repair::RepairPlan, route: &str) {
    for (cause, count) in plan.counts() {
        counter!(HISTORY_REPAIRS, "kind" => cause.as_str(), "route" => route.to_owned())
            .increment(count as u64);
    }
}

/// Count a driver that fenced itself.
pub fn self_fenced(reason: &'static str) {
    counter!(SELF_FENCES, "reason" => reason).increment(1);
}

/// Count an input the driver ignored.
pub fn ignored(reason: &'static str) {
    counter!(DRIVER_IGNORED, "reason" => reason).increment(1);
}

/// Count a provider stream notice (a heuristic that did not hold and decided nothing).
pub fn notice(provider: &str, code: &str) {
    counter!(PROVIDER_NOTICES, "provider" => provider.to_owned(), "code" => code.to_owned()).increment(1);
}

/// Count a failover.
pub fn failover(from: &str, to: &str, reason: &str) {
    counter!(FAILOVERS, "from" => from.to_owned(), "to" => to.to_owned(), "reason" => reason.to_owned())
        .increment(1);
}

/// The ledger's count of durable writes, at a scrape.
pub fn store_write_ops(total: u64) {
    counter!(STORE_WRITE_OPS).absolute(total);
}

/// The ledger's count of operations that changed nothing, at a scrape.
pub fn store_read_ops(total: u64) {
    counter!(STORE_READ_OPS).absolute(total);
}

/// The kept-history counts (`KeptConversations::stats`), at a scrape.
pub fn conversation_reads(kept: u64, whole: u64) {
    counter!(CONVERSATION_READS, "history" => "kept").absolute(kept);
    counter!(CONVERSATION_READS, "history" => "whole").absolute(whole);
}

/// The render counts of the shared render cache, at a scrape.
pub fn renders(total: u64, resumed: u64, off_worker: u64) {
    counter!(RENDERS, "from" => "resumed").absolute(resumed);
    counter!(RENDERS, "from" => "whole").absolute(total.saturating_sub(resumed));
    counter!(RENDERS_OFF_WORKER).absolute(off_worker);
}

/// Count a dispatch transition.
pub fn transition(from: DispatchState, to: DispatchState) {
    counter!(DISPATCH_TRANSITIONS, "from" => from.as_str(), "to" => to.as_str()).increment(1);
}

/// Count one event of a labelless counter.
pub fn bump(name: &'static str) {
    counter!(name).increment(1);
}

/// Count `calls` proxy client calls abandoned by a fork of their client.
pub fn client_forks(calls: u64) {
    counter!(TOOL_CALL_CLIENT_FORKS).increment(calls);
}

/// Provider output bytes held now.
pub fn output_bytes(bytes: u64) {
    gauge!(OUTPUT_BYTES).set(bytes as f64);
}

/// Count a recovery outcome.
pub fn recovery(outcome: &'static str) {
    counter!(HANDLE_RECOVERIES, "outcome" => outcome).increment(1);
}

/// Set the age of the oldest UNKNOWN attempt.
pub fn unknown_age(seconds: f64) {
    gauge!(DISPATCH_UNKNOWN_AGE).set(seconds);
}

/// Count a proxy request.
pub fn proxy_request(api: &'static str, mode: &'static str, outcome: &'static str) {
    counter!(PROXY_REQUESTS, "api" => api, "mode" => mode, "outcome" => outcome).increment(1);
}

/// Count a shadow comparison and each kind of difference it found.
pub fn shadow(api: &'static str, kinds: &[&'static str]) {
    counter!(SHADOW_COMPARISONS, "api" => api).increment(1);
    for kind in kinds {
        counter!(SHADOW_DIFFS, "api" => api, "kind" => *kind).increment(1);
    }
}

/// A target's `provider` and `model` label values: the model itself for the first
/// [`TARGET_LABELS_MAX`] pairs seen, [`MODEL_OVERFLOW`] after (counted).
pub fn target_labels(provider: &str, model: &str) -> (String, String) {
    static SEEN: OnceLock<Mutex<HashSet<(String, String)>>> = OnceLock::new();
    let key = (provider.to_owned(), model.to_owned());
    let mut seen = SEEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if seen.contains(&key) {
        return key;
    }
    if seen.len() < TARGET_LABELS_MAX {
        seen.insert(key.clone());
        return key;
    }
    counter!(LABEL_OVERFLOW, "label" => "model").increment(1);
    (key.0, MODEL_OVERFLOW.to_owned())
}

/// One dispatch ended here (`outcome`: `committed`, `failed`, `abandoned`).
pub fn dispatch_ended(labels: &(String, String), outcome: &'static str, seconds: f64) {
    histogram!(DISPATCH_DURATION, "provider" => labels.0.clone(), "model" => labels.1.clone(), "outcome" => outcome)
        .record(seconds);
}

/// A dispatch's first preview.
pub fn first_preview(labels: &(String, String), seconds: f64) {
    histogram!(TIME_TO_FIRST_PREVIEW, "provider" => labels.0.clone(), "model" => labels.1.clone())
        .record(seconds);
}

/// A provider response head arrived.
pub fn head_latency(labels: &(String, String), seconds: f64) {
    histogram!(PROVIDER_HEAD_LATENCY, "provider" => labels.0.clone(), "model" => labels.1.clone())
        .record(seconds);
}

/// A provider response connection ended (`status`: its head's, or `none`).
pub fn attempt_ended(labels: &(String, String), end: &'static str, status: Option<u16>, seconds: f64) {
    let status = status.map_or_else(|| "none".to_owned(), |status| status.to_string());
    counter!(ATTEMPTS, "provider" => labels.0.clone(), "model" => labels.1.clone(), "end" => end, "status" => status)
        .increment(1);
    histogram!(ATTEMPT_DURATION, "provider" => labels.0.clone(), "model" => labels.1.clone()).record(seconds);
}

/// The `kind` label of [`TOKENS`] for each field of a provider's usage (`Usage` in
/// `turnstile_core::assemble`).
pub const TOKEN_KINDS: [(&str, &str); 4] = [
    ("input_tokens", "input"),
    ("output_tokens", "output"),
    ("cache_read_input_tokens", "cached"),
    ("cache_creation_input_tokens", "cache_write"),
];

/// The price table, set once at start (`[[prices]]`), keyed by provider and model.
static PRICES: OnceLock<std::collections::HashMap<(String, String), super::config::Price>> = OnceLock::new();

/// Install the price table (the first call wins; one process, one configuration).
pub fn set_prices(prices: &[super::config::Price]) {
    let table = prices
        .iter()
        .map(|price| ((price.provider.clone(), price.model.clone()), price.clone()))
        .collect();
    let _ = PRICES.set(table);
}

/// A provider's usage report of one attempt: each count by kind, and its cost where the model
/// is priced; `committed` whether its answer was committed (an uncommitted attempt is billed
/// all the same).
pub fn usage(labels: &(String, String), tenant: &str, committed: bool, usage: &serde_json::Value) {
    let price = PRICES.get().and_then(|prices| prices.get(labels));
    let mut dollars = 0.0;
    for (field, kind) in TOKEN_KINDS {
        if let Some(count) = usage[field].as_u64() {
            tokens(labels, tenant, kind, committed, count);
            if let Some(price) = price {
                dollars += count as f64 * price.per_token(kind);
            }
        }
    }
    if price.is_some() {
        cost(labels, tenant, committed, dollars);
    }
}

/// Add `dollars` to a cost series: the running sum is kept as a float per series and the
/// counter set to its whole millionths, so no fraction of a cent is lost across reports.
fn cost(labels: &(String, String), tenant: &str, committed: bool, dollars: f64) {
    type Key = (String, String, String, bool);
    static SUMS: OnceLock<Mutex<std::collections::HashMap<Key, f64>>> = OnceLock::new();
    let key = (labels.0.clone(), labels.1.clone(), tenant.to_owned(), committed);
    let mut sums = SUMS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let sum = sums.entry(key).or_insert(0.0);
    *sum += dollars;
    let committed = if committed { "true" } else { "false" };
    counter!(COST, "provider" => labels.0.clone(), "model" => labels.1.clone(), "tenant" => tenant.to_owned(), "committed" => committed)
        .absolute((*sum * 1_000_000.0) as u64);
}

/// Input tokens counted by the gateway (an estimate beside the provider's own count).
pub fn estimated_tokens(labels: &(String, String), tenant: &str, count: u64) {
    counter!(ESTIMATED_TOKENS, "provider" => labels.0.clone(), "model" => labels.1.clone(), "tenant" => tenant.to_owned(), "kind" => "input")
        .increment(count);
}

/// Tokens of one kind the provider reported.
fn tokens(labels: &(String, String), tenant: &str, kind: &'static str, committed: bool, count: u64) {
    let committed = if committed { "true" } else { "false" };
    counter!(TOKENS, "provider" => labels.0.clone(), "model" => labels.1.clone(), "tenant" => tenant.to_owned(), "kind" => kind, "committed" => committed)
        .increment(count);
}

/// A dispatch ended here with an error code told to its clients.
pub fn dispatch_error(labels: &(String, String), code: &str) {
    counter!(DISPATCH_ERRORS, "provider" => labels.0.clone(), "model" => labels.1.clone(), "code" => code.to_owned())
        .increment(1);
}

/// Targets cooling down now.
pub fn breaker_open(targets: usize) {
    gauge!(BREAKER_OPEN).set(targets as f64);
}
