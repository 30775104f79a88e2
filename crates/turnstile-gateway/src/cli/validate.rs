//! `turnstile validate FILE|- [--json]`.

use super::{Exit, read_input};
use serde_json::json;
use turnstile_core::{Verdict, parse, validate};

/// Arguments of `turnstile validate`.
#[derive(clap::Args)]
pub struct ValidateArgs {
    /// A turnstile.conversation.v1 file, or `-` for standard input.
    file: String,
    /// Print the spec's JSON shape instead of a human summary.
    #[arg(long)]
    json: bool,
}

/// Run it.
pub fn run(args: &ValidateArgs) -> Exit {
    let conversation = match read_input(&args.file).and_then(|bytes| {
        parse::conversation_from_slice(&bytes).map_err(|error| format!("{}: {error}", args.file))
    }) {
        Ok(conversation) => conversation,
        Err(message) => {
            eprintln!("turnstile validate: {message}");
            return Exit::Usage;
        }
    };
    let verdict = validate(&conversation);
    if args.json {
        let (pending, violations) = match &verdict {
            Verdict::Ready => (Vec::new(), Vec::new()),
            Verdict::Waiting { pending } => (pending.iter().map(|id| id.0.clone()).collect(), Vec::new()),
            Verdict::Rejected(violations) => (Vec::new(), violations.clone()),
        };
        let body = json!({"status": verdict.status(), "pending": pending, "violations": violations});
        println!("{body}");
    } else {
        match &verdict {
            Verdict::Ready => println!(
                "ready: {} turns, a request may be rendered",
                conversation.turns.len()
            ),
            Verdict::Waiting { pending } => {
                let ids: Vec<&str> = pending.iter().map(|id| id.as_str()).collect();
                println!(
                    "waiting: no request until these calls have results: {}",
                    ids.join(", ")
                );
            }
            Verdict::Rejected(violations) => {
                println!("rejected: {} violation(s)", violations.len());
                for violation in violations {
                    println!(
                        "  {} turn={} block={} call_id={}: {}",
                        violation.code,
                        violation.turn.as_deref().unwrap_or("-"),
                        violation.block.as_deref().unwrap_or("-"),
                        violation.call_id.as_deref().unwrap_or("-"),
                        violation.message
                    );
                }
            }
        }
    }
    match verdict {
        Verdict::Ready => Exit::Ok,
        Verdict::Waiting { .. } => Exit::Waiting,
        Verdict::Rejected(_) => Exit::Rejected,
    }
}
