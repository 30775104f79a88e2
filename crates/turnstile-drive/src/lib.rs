//! The dispatch driver of Turnstile, sans-IO (the quinn-proto shape): everything that decides
//! what happens to one dispatch — the core [`DispatchMachine`](turnstile_core::dispatch::DispatchMachine),
//! the stream decoders, the assembler, the attempt and resume budgets, retract-once,
//! interruption → recovery, the stored-bytes and tool-argument checks and the error codes —
//! with inputs `handle_*(now, …)` and outputs [`Drive::poll_action`].
//!
//! Two pumps run it: the gateway's tokio task (`turnstile-gateway/src/serve/driver.rs`: the
//! transport, hubs, metrics, the wall clock) and the deterministic simulation
//! (`turnstile-testkit/src/world.rs`: a scheduler, a virtual clock, scripted providers,
//! faults, crashes). Neither contains dispatch policy; the simulation therefore runs the code
//! production runs. The mapping from [`StoreOp`] to `Ledger` calls lives once, in
//! `turnstile_store::drive::perform`.
//!
//! No async, no I/O, no clock, no randomness here (a tidy test holds it).
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - a resume by another replica moves the lease to it. Enforced in `ops.rs::resume_attempt`
//!   (`take_over`), `Drive::persist` (`StoreOp::Resume`). Tests:
//!   `gateway/tests/it/recovery.rs::a_resume_taken_over_by_another_replica_renews_its_own_lease_and_commits`
//!   (two processes, one killed; red with the holder left unmoved),
//!   `planted.rs::a_resume_that_keeps_the_old_holder…`.
//! - a refused resume is no proof that the attempt ended. Enforced in `drive.rs::connection_ended`
//!   (`confirmed_end`). Tests:
//!   `recovery.rs::a_refused_resume_waits_for_the_old_lease_before_a_new_generation` (generation 2
//!   begins ≥ one lease after generation 1), seeds 325, 453, … with the fix reverted
//!   (`docs/reliability.md`, "The checker can fail").
//! - before a new generation replaces a Responses attempt with a known handle, the provider is
//!   asked; a response still running is cancelled first, and its word is recorded
//!   (`confirmed_over`). Enforced in `drive.rs::ask_provider_first`, `probe_ended`;
//!   `ops.rs::abandon_and_rearm_on`. Tests:
//!   `recovery.rs::a_background_response_still_running_is_cancelled_before_a_new_generation`
//!   (status, cancel, then generation 2; red with the probe off).
//! - resume and replay budgets are per generation across drivers, restarts and replicas. Enforced
//!   in `ops.rs::take_over` (counts on the attempt, refuses past the caps),
//!   `store/src/drive.rs::recoverable` (`RecoverySpent`), `Drive::recovered`/`spent`. Tests:
//!   `drive/tests/it/pairs.rs::resumes_spent_by_other_drivers…` (red with `spent` ignored), 2,000
//!   seeds with the store's count (and so its cap) reverted: `attempt_budget` at seed 804.
//! - every attempt's end is stored with its reason and how it was confirmed. Enforced in
//!   `drive.rs::cause` → `StoreOp::Transition{reason}` → `ops.rs::end_attempt`; `recover_startup`
//!   (`lease_expired`/`replica_restarted`), `commit` (`committed`/`revision_moved`),
//!   `abandon_and_rearm_on` (`confirmed_over`). Tests:
//!   `store/tests/it/conformance.rs::an_attempt_s_resumes_replays_and_end_reasons_are_durable…`,
//!   `serve.rs::a_cut_stream…` and `…never_answers…` (`end_reason` in `/v1/dispatches`).
//! - what the driver reads back across the store boundary is what it wrote: generations only grow,
//!   a commit lands at revision + 1, an attempt keeps its key (asserts on in release). Enforced in
//!   `drive.rs::write_answered`, `read_back`. Tests:
//!   `drive/tests/it/pairs.rs::a_begin_answered_with_an_old_generation…`,
//!   `…read_back_with_another_key…`.
//! - every attempt records the target it sent; a handle binds to that target's manifest. Enforced
//!   in `ops.rs::begin_attempt` (`attempts.target`, the target's `request_digest`),
//!   `ops.rs::bind_handle`. Tests:
//!   `store/tests/it/conformance.rs::failover_targets_keep_their_own_manifests…` (SQLite and
//!   PostgreSQL).
//! - a dispatch that lost its revision ends (ABANDONED) in the refusal's transaction. Enforced in
//!   `ops.rs::commit`, `ops.rs::begin_attempt`. Tests:
//!   `store/tests/it/conformance.rs::begin_allocates…`, `model.rs` (reference model), `seeds.rs`
//!   (`operation_not_terminal`).

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod drive;
mod types;

pub use drive::{
    ATTEMPTS_PER_DISPATCH_MAX, Drive, DriveSpec, FENCE_MARGIN_DIVISOR, REPLAYS_PER_GENERATION_MAX,
    RESUMES_PER_GENERATION_MAX, fails_over_on, fence_deadline, refusal_message,
};
pub use types::*;
