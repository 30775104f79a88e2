//! `turnstile repair FILE|- [--apply] [--json]`: the history doctor's plan for a v1 file
//! (`turnstile_core::repair`), a dry run unless `--apply` asks for the repaired document.
//!
//! Exit statuses (`docs/operating.md`, "Repairing a history"), in `validate`'s style and about
//! the history the plan leaves: 0 ready (nothing to repair, or the plan repairs it), 3 waiting
//! (legal, with calls pending at its end; the file's pending calls are never closed), 1 the
//! plan cannot repair everything (what is left is named; `--apply` prints no document), 2
//! unreadable input or usage.

use super::{Exit, read_input};
use serde_json::{Value, json};
use turnstile_core::repair::{self, Action, Options, Placement, RepairPlan};
use turnstile_core::{Conversation, Verdict, validate};

/// Arguments of `turnstile repair`.
#[derive(clap::Args)]
pub struct RepairArgs {
    /// A turnstile.conversation.v1 file, or `-` for standard input.
    file: String,
    /// Print the repaired document instead of the plan (with `--json`: both, as
    /// `{"plan", "document"}`).
    #[arg(long)]
    apply: bool,
    /// Print the plan as JSON instead of a human summary.
    #[arg(long)]
    json: bool,
}

/// Run it.
pub fn run(args: &RepairArgs) -> Exit {
    let document = match read_input(&args.file).and_then(|bytes| {
        turnstile_core::parse::json_from_slice(&bytes).map_err(|error| format!("{}: {error}", args.file))
    }) {
        Ok(document) => document,
        Err(message) => {
            eprintln!("turnstile repair: {message}");
            return Exit::Usage;
        }
    };
    let plan = match repair::plan(&document, Options::default()) {
        Ok(plan) => plan,
        Err(error) => {
            eprintln!("turnstile repair: {}: {error}", args.file);
            return Exit::Usage;
        }
    };
    // The plan was made for this document: applying it cannot fail.
    let repaired = match repair::apply(&plan, &document) {
        Ok(repaired) => repaired,
        Err(error) => {
            eprintln!("turnstile repair: {error}");
            return Exit::Usage;
        }
    };
    let exit = if !plan.is_complete() {
        Exit::Rejected
    } else {
        match Conversation::from_value(repaired.clone()).map(|conversation| validate(&conversation)) {
            Ok(Verdict::Ready) => Exit::Ok,
            Ok(Verdict::Waiting { .. }) => Exit::Waiting,
            Ok(Verdict::Rejected(_)) | Err(_) => Exit::Rejected,
        }
    };
    let plan_json = serde_json::to_value(&plan).unwrap_or(Value::Null);
    match (args.apply, args.json) {
        (true, _) if exit == Exit::Rejected => {
            // No half-repaired document: the plan, with what is left, goes to stderr.
            eprintln!("{plan_json}");
        }
        (true, true) => println!("{}", json!({"plan": plan_json, "document": repaired})),
        (true, false) => println!("{repaired}"),
        (false, true) => println!("{plan_json}"),
        (false, false) => print_summary(&plan),
    }
    exit
}

fn print_summary(plan: &RepairPlan) {
    if plan.is_empty() && plan.is_complete() {
        println!("nothing to repair");
        return;
    }
    println!("plan {}: {} change(s)", plan.digest, plan.actions.len());
    for action in &plan.actions {
        match action {
            Action::TakeOut {
                cause, turn, block, ..
            } => println!(
                "  take out block {} of turn {} ({}), kept in the plan",
                block.as_deref().unwrap_or("-"),
                turn.as_deref().unwrap_or("-"),
                cause.as_str()
            ),
            Action::DropTurn { turn, .. } => {
                println!(
                    "  drop turn {}, left with no block",
                    turn.as_deref().unwrap_or("-")
                )
            }
            Action::Cancel {
                cause,
                call_id,
                placement,
                ..
            } => {
                let place = match placement {
                    Placement::Turn { turn_index } => format!("at the end of turn #{}", turn_index + 1),
                    Placement::NewTurn { turn, .. } | Placement::NewLastTurn { turn, .. } => {
                        format!("in new tool turn {turn}")
                    }
                };
                println!(
                    "  cancel call {call_id} in the gateway's name {place} ({})",
                    cause.as_str()
                );
            }
        }
    }
    if !plan.needs_person.is_empty() {
        println!("left for a person: {} violation(s)", plan.needs_person.len());
        for violation in &plan.needs_person {
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
