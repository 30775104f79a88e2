//! Probe conversations behind `adapter_digest`.
//!
//! Each adapter renders these fixed conversations (every block kind, every placement rule,
//! odd call ids, reasoning of every provider, a document, an image inside a tool result); the
//! digest covers the adapter's declared rules and every rendering (bytes, path, headers,
//! policy) or pause. A change in what an adapter emits for any probed feature therefore
//! changes its digest, whether or not the rules descriptor was edited.

use crate::registry::AdapterId;
use crate::render::{Graph, RenderCache, RenderOptions, RenderOutcome, render};
use crate::tokens::Tokenizer;
use serde_json::{Value, json};
use turnstile_core::{Digest, MessageSequence, Validated, parse};

/// The probe files, embedded (name, v1 JSON).
pub const PROBE_FILES: [(&str, &str); 3] = [
    ("features", include_str!("probe/features.json")),
    ("document", include_str!("probe/document.json")),
    ("result_image", include_str!("probe/result_image.json")),
];

/// What one adapter does with one probe, as JSON.
fn outcome(adapter: AdapterId, text: &str) -> Value {
    // Invariant: the probes are constants of this crate and `tests/it/registry.rs` proves each
    // one parses and validates as ready; a failure here is a bug in this file.
    let conversation = parse::conversation_from_slice(text.as_bytes()).expect("probe conversations parse");
    let validated = Validated::new(&conversation).expect("probe conversations are valid");
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).expect("probe conversations are ready");
    let options = RenderOptions {
        model: "probe-model".to_owned(),
        max_output_tokens: 1024,
        stream: true,
        background: false,
        // Probes render without settings; the sampling fields are pinned by
        // `tests/it/render_sampling.rs` snapshots instead.
        sampling: crate::sampling::Sampling::default(),
        // Likewise the tool choice (`tests/it/render_tool_choice.rs`).
        tool_choice: crate::tool_choice::ToolChoice::default(),
        output_format: crate::output_format::OutputFormat::default(),
        passthrough: crate::passthrough::Passthrough::default(),
        // Probes and adapter digests render the default text form, as they render no
        // background mode.
        text_content: crate::render::TextContent::Parts,
    };
    let mut cache = RenderCache::new();
    // The estimator keeps digest computation free of tokenizer loading; counts are not
    // part of the digest.
    match render(adapter, graph, &options, Tokenizer::GeminiEstimate, &mut cache) {
        RenderOutcome::Rendered(rendered) => json!({
            "body": String::from_utf8_lossy(&rendered.body),
            "path": rendered.path,
            "headers": rendered.headers,
            "policy": rendered.policy,
        }),
        RenderOutcome::Paused(pauses) => json!({ "paused": pauses }),
        // Unreachable: no setting is set, so nothing can be refused.
        RenderOutcome::Refused(error) => json!({ "refused": error.code() }),
        RenderOutcome::RefusedToolChoice(error) => json!({ "refused": error.code() }),
        RenderOutcome::RefusedOutputFormat(error) => json!({ "refused": error.code() }),
        RenderOutcome::RefusedPassthrough(error) => json!({ "refused": error.code() }),
    }
}

/// The adapter digest (see `registry.rs`).
pub(crate) fn digest(adapter: AdapterId) -> Digest {
    let probes: Vec<Value> = PROBE_FILES
        .iter()
        .map(|(name, text)| json!({ "probe": name, "outcome": outcome(adapter, text) }))
        .collect();
    Digest::of_canonical(&json!({
        "format": "turnstile.adapter-digest.v1",
        "rules": adapter.rules(),
        "probes": probes,
    }))
}

/// Renderings of every probe, for tests.
#[doc(hidden)]
pub fn probe_outcomes(adapter: AdapterId) -> Vec<(&'static str, Value)> {
    PROBE_FILES
        .iter()
        .map(|(name, text)| (*name, outcome(adapter, text)))
        .collect()
}
