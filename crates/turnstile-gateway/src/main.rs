//! The `turnstile` binary: command-line entry point. Each subcommand lives in its own module
//! under `cli/`; exit statuses come from one table, [`cli::Exit`].
#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use turnstile_gateway::cli;

/// mimalloc instead of the system allocator: the gateway allocates on its async workers and
/// frees on other threads (the SQLite writer, the readers of a stream), where glibc's malloc
/// spent 12 % of the gateway's CPU on the round trip (`malloc_consolidate`, `_int_free`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Turnstile: every request to a model provider legal and complete; every response committed
/// at most once per conversation revision.
#[derive(Parser)]
#[command(
    name = "turnstile",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("TURNSTILE_BUILD_COMMIT"), ")"),
    about
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a turnstile.conversation.v1 file (exit 0 ready, 3 waiting, 1 rejected, 2 unreadable).
    Validate(cli::validate::ValidateArgs),
    /// Replay a captured provider stream; print the turn that would be committed (exit 0) or why nothing would be (exit 6).
    Assemble(cli::assemble::AssembleArgs),
    /// Render the request an adapter would send (exit 0 rendered, 3 waiting, 1 rejected, 4 paused, 5 over budget, 2 usage).
    Render(cli::render::RenderArgs),
    /// Run the provider simulator (OpenAI Chat, OpenAI Responses, Anthropic, Gemini wire formats on loopback).
    Sim(cli::sim::SimArgs),
    /// Run the gateway (HTTP API, dispatch, recovery, metrics) on its embedded default: SQLite + built-in simulator.
    Serve(cli::serve::ServeArgs),
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(error) => {
            // clap prints help/version to stdout with success; usage errors exit 2 (spec).
            let _ = error.print();
            return if error.use_stderr() {
                cli::Exit::Usage.into()
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let exit = match args.command {
        Command::Validate(args) => cli::validate::run(&args),
        Command::Assemble(args) => cli::assemble::run(&args),
        Command::Render(args) => cli::render::run(&args),
        Command::Sim(args) => cli::sim::run(&args),
        Command::Serve(args) => cli::serve::run(args),
    };
    exit.into()
}
