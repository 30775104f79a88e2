//! A CI-sized deterministic simulation run: every seed in the range must satisfy every
//! invariant. A failure names the seed; replay it with `turnstile-dst --seed S`.

use turnstile_testkit::{Bugs, run_seeds};

/// Seeds CI runs (issue 7: at least 2,000).
const CI_SEEDS: u64 = 2_000;

/// The first seed; `TURNSTILE_DST_FIRST` moves the window (the range is printed either way).
fn first_seed() -> u64 {
    std::env::var("TURNSTILE_DST_FIRST")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(0)
}

fn crate_lease_ms() -> u64 {
    turnstile_testkit::LEASE_MS
}

#[test]
fn two_thousand_seeded_fault_schedules_break_no_invariant() {
    let first = first_seed();
    println!(
        "seeds {first}..{} (replay one: turnstile-dst --seed S)",
        first + CI_SEEDS
    );
    let summary = run_seeds(first, CI_SEEDS, 2, Bugs::default(), &|_| {});
    print!("{}", summary.text("test"));
    assert_eq!(summary.seeds, CI_SEEDS);
    assert!(summary.violations.is_empty(), "{}", summary.text("test"));
    assert_eq!(summary.illegal_sends, 0);
    assert_eq!(summary.partial_tool_dispatch, 0);
    assert_eq!(summary.canonical_turns_per_revision_max, 1);
    assert_eq!(summary.unknown_unresolved, 0);
    assert_eq!(summary.liveness_violations, 0);
    assert_eq!(summary.replicas, 2, "every seed runs two replicas on one store");
    assert!(
        summary.clock_skew_ms_max > crate_lease_ms(),
        "skew beyond the lease was exercised"
    );
    assert!(summary.disconnects > 0);
    // Proxy seeds ran the proxy path: requests continued the stored conversation (not every
    // one forked), and answers were decoded and compared with their commits.
    assert!(
        summary.proxy_requests > CI_SEEDS / 10,
        "proxy requests {}",
        summary.proxy_requests
    );
    assert!(
        summary.proxy_forks < summary.proxy_requests,
        "proxy forks {} of {}",
        summary.proxy_forks,
        summary.proxy_requests
    );
    assert!(
        summary.proxy_answers > CI_SEEDS / 20,
        "proxy answers {}",
        summary.proxy_answers
    );
    // The run exercised what it claims to: commits, and every fault kind at least once.
    assert!(summary.commits > CI_SEEDS / 2, "commits {}", summary.commits);
    for kind in [
        "crash",
        "store_drop_before_commit",
        "store_drop_after_commit",
        "provider_429",
        "provider_500",
        "cut_at_byte",
        "disconnect",
        "duplicate_deltas",
        "lost_stop",
        "foreign_handle",
        "old_stream_resumed",
        "resume_refused",
        "adapter_upgrade",
        "orphan_result",
        "duplicate_result",
        "idempotent_replay",
        "hung_head",
        "endless_stream",
        "client_left",
        "racing_operations",
        "clock_skew",
        "client_retry",
        "executor_crash",
        "store_stall",
        "store_late_write",
    ] {
        assert!(
            summary
                .faults
                .iter()
                .any(|(fault, count)| fault.as_str() == kind && *count > 0),
            "fault {kind} never injected"
        );
    }
}

#[test]
fn a_seed_replays_to_the_same_report() {
    let first = turnstile_testkit::run_seed(7, true, Bugs::default());
    let second = turnstile_testkit::run_seed(7, true, Bugs::default());
    println!("seed 7");
    assert_eq!(first.trace, second.trace);
    assert_eq!(first.faults, second.faults);
    assert_eq!(first.steps, second.steps);
}

#[test]
fn the_json_report_has_exactly_the_issues_keys() {
    let summary = run_seeds(0, 3, 1, Bugs::default(), &|_| {});
    println!("seeds 0..3");
    let json = summary.json();
    let mut keys: Vec<&str> = json
        .as_object()
        .map(|map| map.keys().map(String::as_str).collect())
        .unwrap_or_default();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "canonical_turns_per_revision_max",
            "checks",
            "clock_skew_ms_max",
            "disconnects",
            "failovers",
            "faults",
            "illegal_sends",
            "liveness_violations",
            "partial_tool_dispatch",
            "proxy_answers",
            "proxy_forks",
            "proxy_requests",
            "proxy_streamed_answers",
            "replicas",
            "seeds",
            "unknown_unresolved",
            "violations"
        ]
    );
    assert_eq!(json["seeds"], 3);
}
