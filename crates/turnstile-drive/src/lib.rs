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

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod drive;
mod types;

pub use drive::{
    ATTEMPTS_PER_DISPATCH_MAX, Drive, DriveSpec, FENCE_MARGIN_DIVISOR, REPLAYS_PER_GENERATION_MAX,
    RESUMES_PER_GENERATION_MAX, fails_over_on, fence_deadline, refusal_message,
};
pub use types::*;
