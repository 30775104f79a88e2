//! Running seeds: one world per seed, a panic in a real component caught and reported as a
//! violation of its seed, and seeds spread over threads (each seed stays single-threaded and
//! deterministic; only the order in which seeds finish varies).

use crate::plan::Bugs;
use crate::report::{Invariant, SeedReport, Summary};
pub use crate::world::Options;
use crate::world::World;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Run one seed.
pub fn run_seed(seed: u64, trace: bool, bugs: Bugs) -> SeedReport {
    run_seed_with(seed, Options { trace, bugs })
}

/// Run one seed with all options.
pub fn run_seed_with(seed: u64, options: Options) -> SeedReport {
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| match World::new(seed, options) {
        Ok(world) => world.run(),
        Err(error) => {
            let mut report = SeedReport {
                seed,
                ..SeedReport::default()
            };
            report.violate(0, Invariant::Panic, format!("world setup failed: {error}"));
            report
        }
    }));
    match outcome {
        Ok(report) => report,
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "panic".into());
            let mut report = SeedReport {
                seed,
                ..SeedReport::default()
            };
            report.violate(0, Invariant::Panic, message);
            report
        }
    }
}

/// Run `count` seeds from `first` on `threads` threads; `progress` is called after each seed
/// with the number done.
pub fn run_seeds(
    first: u64,
    count: u64,
    threads: usize,
    bugs: Bugs,
    progress: &(dyn Fn(u64) + Sync),
) -> Summary {
    let options = Options { trace: false, bugs };
    run_seeds_with(first, count, threads, options, progress)
}

/// Run `count` seeds with all options.
pub fn run_seeds_with(
    first: u64,
    count: u64,
    threads: usize,
    options: Options,
    progress: &(dyn Fn(u64) + Sync),
) -> Summary {
    let next = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let summary = Arc::new(Mutex::new(Summary {
        seed_first: first,
        ..Summary::default()
    }));
    let mut reports: Vec<SeedReport> = Vec::new();
    let collected = Mutex::new(&mut reports);
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| {
                loop {
                    let index = next.fetch_add(1, Ordering::SeqCst);
                    if index >= count {
                        return;
                    }
                    let report = run_seed_with(first + index, options);
                    let mut guard = match collected.lock() {
                        Ok(guard) => guard,
                        Err(poisoned) => poisoned.into_inner(),
                    };
                    guard.push(report);
                    drop(guard);
                    progress(done.fetch_add(1, Ordering::SeqCst) + 1);
                }
            });
        }
    });
    // Add in seed order so the summary (kept violations included) is deterministic.
    reports.sort_by_key(|report| report.seed);
    let mut total = match summary.lock() {
        Ok(guard) => guard.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    };
    for report in &reports {
        total.add(report);
    }
    total
}
