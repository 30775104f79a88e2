//! `turnstile assemble FILE --adapter ID [--tools TOOLS.json] [--json]`
//! (`shared/spec/conversation-v1.md` §3): replay a captured provider stream (raw SSE bytes as
//! received) through the decoder and the assembler, and print the assistant turn that would be
//! committed, or why nothing would be.
//!
//! Output contract (docs/decisions/0021-turnstile-assemble-reads-a-file-not-a-connection.md): exit
//! 0 prints the v1 turn JSON on standard output (pretty, or one line with `--json`); exit 6 prints
//! the reason (`nothing committed: CODE: message`, or with `--json`
//! `{"status":"retracted","code","message"}`) and never any part of a tool call; exit 2 is a usage
//! error or unreadable input. Input from another handle in the same file (a second response
//! concatenated) is quarantined and reported on standard error.

use super::{Exit, read_input};
use serde_json::{Value, json};
use std::sync::Arc;
use turnstile_adapters::decode::StreamApi;
use turnstile_core::Generation;
use turnstile_core::assemble::{Assembler, AssemblerConfig, Disposition, Output, Toolset};

/// Arguments of `turnstile assemble`.
#[derive(clap::Args)]
pub struct AssembleArgs {
    /// A captured provider stream (raw SSE bytes), or `-` for standard input.
    file: String,
    /// The adapter id whose API produced the stream (`openai-chat@1`, `gemini@1`, …).
    #[arg(long)]
    adapter: String,
    /// Tool declarations to validate arguments against: a v1 `tools` array, or a v1 file.
    #[arg(long)]
    tools: Option<String>,
    /// One-line JSON output, and the reason as JSON when nothing is committed.
    #[arg(long)]
    json: bool,
}

/// The generation a replay is assembled as.
const REPLAY_GENERATION: Generation = Generation(1);
/// The id the replayed turn gets.
const REPLAY_TURN_ID: &str = "t-assembled";

/// Run it.
pub fn run(args: &AssembleArgs) -> Exit {
    let Some(api) = StreamApi::for_adapter(&args.adapter) else {
        eprintln!("turnstile assemble: unknown adapter {:?}", args.adapter);
        return Exit::Usage;
    };
    let toolset = match &args.tools {
        None => None,
        Some(path) => match load_toolset(path) {
            Ok(toolset) => Some(Arc::new(toolset)),
            Err(message) => {
                eprintln!("turnstile assemble: {message}");
                return Exit::Usage;
            }
        },
    };
    let bytes = match read_input(&args.file) {
        Ok(bytes) => bytes,
        Err(message) => {
            eprintln!("turnstile assemble: {message}");
            return Exit::Usage;
        }
    };

    let mut config = AssemblerConfig::new(REPLAY_GENERATION, REPLAY_TURN_ID);
    config.toolset = toolset;
    let mut assembler = Assembler::new(config);
    let mut decoder = api.decoder();
    decoder.handle_bytes(&bytes);
    // A file, not a live connection: a last event that lost its blank line in storage still
    // counts (docs/decisions/0021-turnstile-assemble-reads-a-file-not-a-connection.md); a cut
    // inside an event still commits nothing.
    decoder.handle_end_of_file();
    let mut quarantined = 0u64;
    while let Some(event) = decoder.poll_event() {
        if let Disposition::Quarantined(_) = assembler.handle_event(REPLAY_GENERATION, event) {
            quarantined += 1;
        }
    }
    assembler.handle_end_of_input();
    if quarantined > 0 {
        eprintln!("turnstile assemble: {quarantined} event(s) from another handle quarantined, not merged");
    }

    let mut outcome = None;
    while let Some(output) = assembler.poll_output() {
        match output {
            // A replay has no viewer: preview is dropped (it is never history anyway).
            Output::Preview { .. } => {}
            other => outcome = Some(other),
        }
    }
    match outcome {
        Some(Output::Commit(offer)) => {
            let text = if args.json {
                offer.turn.to_string()
            } else {
                serde_json::to_string_pretty(&offer.turn).unwrap_or_else(|_| offer.turn.to_string())
            };
            println!("{text}");
            Exit::Ok
        }
        Some(Output::Retract { reason, .. }) => {
            if args.json {
                println!(
                    "{}",
                    json!({"status": "retracted", "code": reason.code(), "message": reason.to_string()})
                );
            } else {
                println!("nothing committed: {}: {reason}", reason.code());
            }
            Exit::NothingCommitted
        }
        // Invariant: `handle_end_of_input` always leaves an outcome in the queue (a commit or
        // a retract); reaching here would be a bug in the assembler, reported as nothing
        // committed rather than as success.
        _ => {
            println!("nothing committed: no outcome");
            Exit::NothingCommitted
        }
    }
}

fn load_toolset(path: &str) -> Result<Toolset, String> {
    let bytes = read_input(path)?;
    let value: Value =
        serde_json::from_slice(&bytes).map_err(|error| format!("{path}: not JSON: {error}"))?;
    Toolset::from_json(&value).map_err(|error| format!("{path}: {error}"))
}
