//! Deterministic simulation testing (DST) of Turnstile, in the FoundationDB / TigerBeetle VOPR
//! style: one seed owns every choice of a whole run of the real system.
//!
//! The [`world::World`] wires the real parts together — the sans-IO `DispatchMachine`, the real
//! adapters (render, manifest, stream decoders) and assembler, and the real SQLite ledger on a
//! temporary file — and performs the machine's effects the way the gateway's driver does. Only
//! the provider is scripted ([`provider`]), and it emits the exact wire bytes of each API
//! through `turnstile_adapters::simulate`. Time is a virtual clock; randomness is one
//! [`rng::Rng`]. Faults ([`plan::FaultPlan`]) have probabilities drawn per seed, so some seeds
//! are calm and some are storms. The [`checker`] evaluates the history invariants after every
//! step; [`run`] runs seeds and sums their [`report::SeedReport`]s.
//!
//! Proxy seeds send their follow-up requests through the gateway's own drop-in proxy code
//! ([`proxy`]), so the testkit depends on the gateway library.
//!
//! Dev-only (`publish = false`): nothing in the gateway depends on it.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod checker;
pub mod plan;
pub mod provider;
pub mod proxy;
pub mod report;
pub mod rng;
pub mod run;
pub mod world;

pub use plan::{Bugs, FaultKind, FaultPlan};
pub use report::{Invariant, SeedReport, Summary, Violation};
pub use run::{Options, run_seed, run_seed_with, run_seeds, run_seeds_with};
pub use world::LEASE_MS;
