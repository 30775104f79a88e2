//! `turnstile render FILE|- --adapter ID --model M [--max-output-tokens N] [--manifest]
//! [--catalog FILE]`.
//!
//! Prints exactly the request body bytes the adapter would send (no trailing newline), or the
//! DispatchManifest v1 JSON with `--manifest`. On every other outcome stdout stays empty and
//! a JSON explanation goes to stderr: 1 rejected (`{"status":"rejected","violations":[…]}`),
//! 3 waiting (`pending`), 4 paused (`pauses`), 5 over budget (the numbers), 2 usage.
//!
//! The CLI renders what the gateway would send upstream, which always streams (`stream:
//! true`). Its manifest's `operation_id` is derived, since no client chose one:
//! `render-` + the first 32 hex digits of SHA-256 over the RFC 8785 form of
//! `{conversation_id, revision, adapter, model, max_output_tokens}`, so rendering the same
//! input twice gives the same manifest.

use super::{Exit, read_input};
use serde_json::json;
use std::io::Write;
use turnstile_adapters::render::NotRenderable;
use turnstile_adapters::{AdapterId, Catalog, Graph, PrepareOutcome, PrepareRequest, RenderCache, prepare};
use turnstile_core::{Digest, MessageSequence, Validated, parse};

/// Arguments of `turnstile render`.
#[derive(clap::Args)]
pub struct RenderArgs {
    /// A turnstile.conversation.v1 file, or `-` for standard input.
    file: String,
    /// Adapter id: openai-chat@1, openai-chat@2, openai-responses@1, anthropic-messages@1,
    /// anthropic-messages@2, gemini@1.
    #[arg(long)]
    adapter: String,
    /// Model name (looked up in the model catalog for its window and tokenizer).
    #[arg(long)]
    model: String,
    /// Output token cap (default: the catalog's per-model default).
    #[arg(long)]
    max_output_tokens: Option<u64>,
    /// Print the DispatchManifest v1 instead of the body.
    #[arg(long)]
    manifest: bool,
    /// JSON catalog overrides: {"models": [{"name", "prefix", "context_window", "tokenizer",
    /// "max_output_tokens_default"}]}.
    #[arg(long)]
    catalog: Option<String>,
}

fn fail(exit: Exit, body: serde_json::Value) -> Exit {
    eprintln!("{body}");
    exit
}

/// Run it.
pub fn run(args: &RenderArgs) -> Exit {
    let adapter: AdapterId = match args.adapter.parse() {
        Ok(adapter) => adapter,
        Err(error) => {
            eprintln!("turnstile render: {error}");
            return Exit::Usage;
        }
    };
    let mut catalog = Catalog::builtin();
    if let Some(path) = &args.catalog {
        let loaded = read_input(path)
            .and_then(|bytes| serde_json::from_slice(&bytes).map_err(|error| format!("{path}: {error}")))
            .and_then(|value| {
                catalog
                    .apply_overrides(value)
                    .map_err(|error| format!("{path}: {error}"))
            });
        if let Err(message) = loaded {
            eprintln!("turnstile render: {message}");
            return Exit::Usage;
        }
    }
    let conversation = match read_input(&args.file).and_then(|bytes| {
        parse::conversation_from_slice(&bytes).map_err(|error| format!("{}: {error}", args.file))
    }) {
        Ok(conversation) => conversation,
        Err(message) => {
            eprintln!("turnstile render: {message}");
            return Exit::Usage;
        }
    };
    let validated = match Validated::new(&conversation) {
        Ok(validated) => validated,
        Err(violations) => {
            return fail(
                Exit::Rejected,
                json!({"status": "rejected", "violations": violations}),
            );
        }
    };
    let sequence = MessageSequence::build(validated);
    let graph = match Graph::new(validated, &sequence) {
        Ok(graph) => graph,
        Err(NotRenderable::Waiting { pending }) => {
            return fail(Exit::Waiting, json!({"status": "waiting", "pending": pending}));
        }
        Err(other) => {
            eprintln!("turnstile render: {other}");
            return Exit::Usage;
        }
    };
    let (model, _) = catalog.lookup(adapter.api(), &args.model);
    let max_output_tokens = args.max_output_tokens.unwrap_or(model.max_output_tokens_default);
    let operation_id = operation_id(
        &conversation.conversation_id,
        conversation.revision.0,
        adapter,
        &args.model,
        max_output_tokens,
    );
    let request = PrepareRequest {
        operation_id,
        adapter,
        provider: None,
        model: args.model.clone(),
        max_output_tokens: Some(max_output_tokens),
        stream: true,
        background: false,
        text_content: Default::default(),
    };
    let mut cache = RenderCache::new();
    match prepare(graph, &request, &catalog, &mut cache) {
        PrepareOutcome::Prepared(prepared) => {
            let mut stdout = std::io::stdout().lock();
            let written = if args.manifest {
                serde_json::to_writer(&mut stdout, &prepared.manifest)
                    .map_err(std::io::Error::from)
                    .and_then(|()| stdout.write_all(b"\n"))
            } else {
                stdout.write_all(&prepared.rendered.body)
            };
            match written.and_then(|()| stdout.flush()) {
                Ok(()) => Exit::Ok,
                Err(error) => {
                    eprintln!("turnstile render: cannot write: {error}");
                    Exit::Usage
                }
            }
        }
        PrepareOutcome::Paused(pauses) => fail(
            Exit::Paused,
            json!({"status": "paused", "adapter": adapter.as_str(), "pauses": pauses}),
        ),
        PrepareOutcome::OverBudget(over) => fail(
            Exit::OverBudget,
            json!({
                "status": "over_budget",
                "prompt_tokens": over.prompt_tokens,
                "max_output_tokens": over.max_output_tokens,
                "context_window": over.context_window,
                "excess": over.excess(),
            }),
        ),
    }
}

/// The CLI's derived operation id (see the module docs).
pub fn operation_id(
    conversation_id: &str,
    revision: u64,
    adapter: AdapterId,
    model: &str,
    max_output_tokens: u64,
) -> String {
    let digest = Digest::of_canonical(&json!({
        "conversation_id": conversation_id,
        "revision": revision,
        "adapter": adapter.as_str(),
        "model": model,
        "max_output_tokens": max_output_tokens,
    }));
    format!(
        "render-{}",
        &digest.as_str()["sha256:".len().."sha256:".len() + 32]
    )
}
