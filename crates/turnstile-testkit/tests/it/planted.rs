//! The checker can fail: for each invariant, a planted bug in the world (the way the gateway
//! could get it wrong) and the proof that the checker reports it within a bounded number of
//! seeds. A checker that never failed would prove nothing.

use turnstile_testkit::{Bugs, Invariant, run_seed};

/// Most seeds tried before a planted bug must have been caught.
const SEEDS_TO_CATCH_MAX: u64 = 300;

/// Run seeds with `bugs` until one violates `invariant`; that seed, or a failure.
fn caught(bugs: Bugs, invariant: Invariant) -> u64 {
    for seed in 0..SEEDS_TO_CATCH_MAX {
        let report = run_seed(seed, false, bugs);
        if report
            .violations
            .iter()
            .any(|violation| violation.invariant == invariant)
        {
            println!("{bugs:?}: {} caught at seed {seed}", invariant.as_str());
            return seed;
        }
    }
    panic!(
        "{bugs:?}: {} not caught in seeds 0..{SEEDS_TO_CATCH_MAX}",
        invariant.as_str()
    );
}

#[test]
fn sending_before_the_begin_write_is_caught_as_a_send_before_a_durable_dispatching_row() {
    let bugs = Bugs {
        send_before_persist: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::SendBeforeDurable);
}

#[test]
fn re_rendering_a_retry_with_the_upgraded_adapter_is_caught_as_an_illegal_send() {
    let bugs = Bugs {
        rerender_on_retry: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::IllegalSend);
}

#[test]
fn a_failover_attempt_sending_the_first_targets_bytes_is_caught_as_an_illegal_send() {
    let bugs = Bugs {
        failover_sends_first_target: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::IllegalSend);
}

#[test]
fn a_proxy_answer_missing_a_committed_call_is_caught() {
    let bugs = Bugs {
        proxy_answer_drops_call: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::ProxyAnswer);
}

#[test]
fn appending_a_late_turn_without_the_generation_condition_is_caught() {
    let bugs = Bugs {
        commit_late_turn: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::LateBlockInHistory);
}

#[test]
fn exposing_tool_calls_before_the_commit_is_caught_as_partial_tool_dispatch() {
    let bugs = Bugs {
        expose_before_commit: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::PartialToolDispatch);
}

#[test]
fn committing_cut_tool_arguments_is_caught() {
    let bugs = Bugs {
        commit_partial_arguments: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::PartialToolDispatch);
}

#[test]
fn dropping_retract_events_is_caught_as_an_unresolved_preview() {
    let bugs = Bugs {
        skip_retract: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::PreviewUnresolved);
}

#[test]
fn never_firing_the_lease_timer_leaves_unknown_attempts_and_is_caught() {
    let bugs = Bugs {
        no_lease_timer: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::UnknownUnresolved);
}

#[test]
fn a_miscounted_metric_is_caught_as_a_metrics_mismatch() {
    let bugs = Bugs {
        miscount_foreign_handles: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::MetricsMismatch);
}

// The defects of issue 15, each planted on the simulation's side of the driver (the same
// defect the gateway had before its fix) and caught by the checker.

#[test]
fn judging_leases_by_each_replica_s_own_clock_is_caught_as_an_early_new_generation() {
    let bugs = Bugs {
        replica_clock_fencing: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::EarlyNewGeneration);
}

#[test]
fn a_resume_that_keeps_the_old_holder_is_caught_as_an_operation_that_never_ends() {
    let bugs = Bugs {
        resume_keeps_holder: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::OperationNotTerminal);
}

#[test]
fn a_sweep_that_ignores_undriven_prepared_dispatches_is_caught_as_an_operation_that_never_ends() {
    let bugs = Bugs {
        sweep_skips_prepared: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::OperationNotTerminal);
}

#[test]
fn no_bound_on_an_endless_stream_is_caught_as_an_operation_that_never_ends() {
    let bugs = Bugs {
        no_attempt_deadline: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::OperationNotTerminal);
}

#[test]
fn a_dead_executor_answering_with_the_current_claim_is_caught_by_the_tool_ledger_check() {
    let bugs = Bugs {
        executor_uses_current_claim: true,
        ..Bugs::default()
    };
    caught(bugs, Invariant::ToolLedger);
}
