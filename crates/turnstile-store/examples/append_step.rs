//! The store's cost of one agent step against the length of the stored history (issue 21):
//! append one user turn to a conversation of N blocks, with the validator's state kept (the
//! ledger wrote the last turn itself) and without it (another ledger on the same file wrote
//! it, so the check reads and walks the whole history). SQLite with `synchronous=NORMAL` in a
//! temporary directory (pass a directory on tmpfs to leave the disk out).
//!
//! `cargo run --release -p turnstile-store --example append_step -- [DIR]`

use serde_json::{Value, json};
use std::time::Instant;
use turnstile_core::Revision;
use turnstile_core::dispatch::Timestamp;
use turnstile_store::{AppendOutcome, Ledger, SqliteLedger, Synchronous};

const STEPS: u64 = 100;

fn history(blocks: usize) -> Vec<Value> {
    let mut turns = Vec::new();
    let mut revision = 0;
    while turns.len() < blocks {
        revision += 1;
        let role = if revision % 2 == 1 { "user" } else { "assistant" };
        turns.push(json!({"id": format!("t{revision}"), "role": role, "revision": revision,
                          "blocks": [{"id": format!("b{revision}"), "kind": "text", "text": "Some words of history here."}]}));
    }
    turns
}

fn user(step: u64) -> Value {
    json!({"id": format!("s{step}"), "role": "user",
           "blocks": [{"id": format!("sb{step}"), "kind": "text", "text": "And then?"}]})
}

async fn append(ledger: &SqliteLedger, id: &str, revision: u64, step: u64) {
    let outcome = ledger
        .append_turn(id, Revision(revision), &user(step), Timestamp(1))
        .await
        .unwrap();
    assert!(matches!(outcome, AppendOutcome::Appended { .. }), "{outcome:?}");
}

#[tokio::main]
async fn main() {
    let dir = std::env::args().nth(1).map(std::path::PathBuf::from);
    let temp = tempfile::tempdir_in(dir.unwrap_or_else(std::env::temp_dir)).unwrap();
    let path = temp.path().join("step.db");
    let a = SqliteLedger::open(&path, Synchronous::Normal).unwrap();
    let b = SqliteLedger::open(&path, Synchronous::Normal).unwrap();
    println!("blocks  kept state (µs/append)  whole walk (µs/append)  walks kept/whole");
    for blocks in [20usize, 200, 2_000] {
        let turns = history(blocks);
        let mut revision = turns.len() as u64;
        let id = format!("c{blocks}");
        a.import_conversation(&id, &json!([]), &turns, Timestamp(1))
            .await
            .unwrap();
        // Kept: the same ledger writes every step (its first step walks once).
        append(&a, &id, revision, 0).await;
        revision += 1;
        let walks = a.history_walks();
        let started = Instant::now();
        for step in 1..=STEPS {
            append(&a, &id, revision, step).await;
            revision += 1;
        }
        let kept = started.elapsed().as_secs_f64() * 1e6 / STEPS as f64;
        let kept_walks = a.history_walks() - walks;
        // Whole: two ledgers take turns, so each finds the other's revision and walks.
        let walks = a.history_walks() + b.history_walks();
        let started = Instant::now();
        for step in 1..=STEPS {
            let ledger = if step % 2 == 0 { &a } else { &b };
            append(ledger, &id, revision, STEPS + step).await;
            revision += 1;
        }
        let whole = started.elapsed().as_secs_f64() * 1e6 / STEPS as f64;
        let whole_walks = a.history_walks() + b.history_walks() - walks;
        println!("{blocks:>6}  {kept:>22.1}  {whole:>22.1}  {kept_walks}/{whole_walks}");
    }
}
