//! `turnstile-dst`: run seeded deterministic simulations of Turnstile and report.
//!
//! ```text
//! turnstile-dst --seeds N [--first S] [--threads T] [--json]
//! turnstile-dst --seed S [--json]        replay one seed, printing its trace
//! ```
//! Exit status 0 only when no invariant was violated; 1 on a violation; 2 on bad usage.

use std::io::IsTerminal;
use std::process::ExitCode;
use turnstile_testkit::{Bugs, Options, Summary, run_seed_with, run_seeds_with};

struct Args {
    seeds: u64,
    first: u64,
    seed: Option<u64>,
    json: bool,
    threads: usize,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        seeds: 1_000,
        first: 0,
        seed: None,
        json: false,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            it.next()
                .ok_or(format!("{name} needs a value"))?
                .parse()
                .map_err(|_| format!("{name} needs a number"))
        };
        match arg.as_str() {
            "--seeds" => args.seeds = value("--seeds")?,
            "--first" => args.first = value("--first")?,
            "--seed" => args.seed = Some(value("--seed")?),
            "--threads" => args.threads = value("--threads")? as usize,
            "--json" => args.json = true,
            "-h" | "--help" => {
                return Err(
                    "usage: turnstile-dst --seeds N [--first S] [--threads T] [--json] | --seed S [--json]"
                        .into(),
                );
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(args)
}

fn git_commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|output| output.status.success())
        .and_then(|output| String::from_utf8(output.stdout).ok())
        .map_or_else(|| "unknown".to_owned(), |text| text.trim().to_owned())
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let commit = git_commit();
    let options = Options {
        trace: args.seed.is_some(),
        bugs: Bugs::default(),
    };
    let summary = match args.seed {
        Some(seed) => {
            let report = run_seed_with(seed, options);
            if !args.json {
                for line in &report.trace {
                    println!("{line}");
                }
            }
            let mut summary = Summary {
                seed_first: seed,
                ..Summary::default()
            };
            summary.add(&report);
            summary
        }
        None => {
            // indicatif draws only on a terminal; with --json (or a pipe) the bar stays hidden.
            let bar = if std::io::stderr().is_terminal() && !args.json {
                indicatif::ProgressBar::new(args.seeds)
            } else {
                indicatif::ProgressBar::hidden()
            };
            bar.set_style(
                indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} seeds  {per_sec}  eta {eta}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            let progress = {
                let bar = bar.clone();
                move |done: u64| bar.set_position(done)
            };
            let summary = run_seeds_with(args.first, args.seeds, args.threads, options, &progress);
            bar.finish_and_clear();
            summary
        }
    };
    if args.json {
        println!("{}", summary.json());
    } else {
        print!("{}", summary.text(&commit));
    }
    if summary.violations_total == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
