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

/// `--version`: the package version and the commit it was built from (`build.rs`).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("TURNSTILE_COMMIT"),
    ")"
);

/// The environment the binary reads, for `--help` (docs/operating.md, "Deploying").
const ENVIRONMENT: &str = "\
Environment:
  TURNSTILE_CONFIG, TURNSTILE_LISTEN, TURNSTILE_STORE, TURNSTILE_SIM_URL
                       serve's --config, --listen, --store, --sim-url (a flag wins)
  RUST_LOG             log filter (default info), e.g. RUST_LOG=turnstile_gateway=debug
  NO_COLOR             no colour in logs (none either when stderr is not a terminal)
  OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME
                       traces (OTLP/HTTP); the config's otlp_endpoint wins
  and each variable the config names (tenants' token_env, providers' api_key_env).

serve exits 0 after a drain, 2 on a usage error, 78 on a configuration error, 69 when the
store cannot be reached or refuses it, 71 when it cannot listen.";

/// Turnstile: every request to a model provider legal and complete; every response committed
/// at most once per conversation revision.
#[derive(Parser)]
#[command(name = "turnstile", version = VERSION, after_help = ENVIRONMENT)]
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
    /// Plan (or with --apply, perform) the repair of a poisoned history (exit 0 ready, 3 waiting, 1 a person is needed, 2 unreadable).
    Repair(cli::repair::RepairArgs),
    /// Run the provider simulator (OpenAI Chat, OpenAI Responses, Anthropic, Gemini wire formats on loopback).
    Sim(cli::sim::SimArgs),
    /// Run the gateway (HTTP API, dispatch, recovery, metrics); with no configuration, SQLite + built-in simulator (exit 0 drained, 78 configuration, 69 store, 71 listen).
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
        Command::Repair(args) => cli::repair::run(&args),
        Command::Sim(args) => cli::sim::run(&args),
        Command::Serve(args) => cli::serve::run(args),
    };
    exit.into()
}
