//! Shared helpers of the render tests: scenario loading, one `render_for` per adapter (and
//! `render_sampled` with generation settings), and a byte-preserving JSON re-indenter for
//! snapshots.

use serde_json::Value;
use turnstile_adapters::render::{Graph, RenderCache, RenderOptions, RenderOutcome, render};
use turnstile_adapters::tokens::Tokenizer;
use turnstile_adapters::{AdapterId, Catalog, Sampling};
use turnstile_core::conversation::Conversation;
use turnstile_core::{MessageSequence, Validated, parse};

/// Every render scenario file in `tests/data/render/`.
pub const SCENARIOS: &[&str] = &[
    "parallel_split_out_of_order",
    "error_cancel",
    "multi_round",
    "consecutive_user",
    "context_role_text",
    "images",
    "result_image",
    "documents",
    "document_url",
    "reasoning",
    "odd_call_ids",
];

pub fn data_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/render")
}

pub fn load(name: &str) -> Conversation {
    let path = data_dir().join(format!("{name}.json"));
    let bytes = std::fs::read(&path).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    parse::conversation_from_slice(&bytes).unwrap_or_else(|error| panic!("{name}: {error}"))
}

/// A model of the adapter's own provider, from the built-in catalog.
pub fn model_for(adapter: AdapterId) -> &'static str {
    match adapter.provider() {
        "openai" => "gpt-4o",
        "anthropic" => "claude-sonnet-4-5",
        _ => "gemini-2.5-pro",
    }
}

pub fn tokenizer_for(adapter: AdapterId) -> Tokenizer {
    Catalog::builtin()
        .lookup(adapter.api(), model_for(adapter))
        .0
        .tokenizer
}

pub fn options_for(adapter: AdapterId) -> RenderOptions {
    RenderOptions {
        model: model_for(adapter).to_owned(),
        max_output_tokens: 1024,
        stream: true,
        background: false,
        text_content: Default::default(),
        sampling: Sampling::default(),
        tool_choice: Default::default(),
        output_format: Default::default(),
        passthrough: Default::default(),
    }
}

/// Validate, build and render with a fresh cache.
pub fn render_for(conversation: &Conversation, adapter: AdapterId) -> RenderOutcome {
    let mut cache = RenderCache::new();
    render_cached(conversation, adapter, &mut cache)
}

/// Validate, build and render with generation settings and a fresh cache.
pub fn render_sampled(conversation: &Conversation, adapter: AdapterId, sampling: &Sampling) -> RenderOutcome {
    let validated = Validated::new(conversation).expect("test conversations are valid");
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).expect("test conversations are ready");
    let options = RenderOptions {
        sampling: sampling.clone(),
        ..options_for(adapter)
    };
    render(
        adapter,
        graph,
        &options,
        tokenizer_for(adapter),
        &mut RenderCache::new(),
    )
}

pub fn render_cached(
    conversation: &Conversation,
    adapter: AdapterId,
    cache: &mut RenderCache,
) -> RenderOutcome {
    let validated = Validated::new(conversation).expect("test conversations are valid");
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).expect("test conversations are ready");
    render(
        adapter,
        graph,
        &options_for(adapter),
        tokenizer_for(adapter),
        cache,
    )
}

/// Re-indent compact JSON bytes without reordering anything: a newline after `{`, `[` and
/// `,` outside strings. Snapshots stay readable while showing the exact key order.
pub fn reindent(bytes: &[u8]) -> String {
    let text = std::str::from_utf8(bytes).expect("bodies are UTF-8");
    let mut out = String::with_capacity(text.len() * 2);
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    let mut chars = text.chars().peekable();
    while let Some(character) = chars.next() {
        if in_string {
            out.push(character);
            if escaped {
                escaped = false;
            } else if character == '\\' {
                escaped = true;
            } else if character == '"' {
                in_string = false;
            }
            continue;
        }
        match character {
            '"' => {
                in_string = true;
                out.push(character);
            }
            '{' | '[' => {
                out.push(character);
                let closing = if character == '{' { '}' } else { ']' };
                if chars.peek() == Some(&closing) {
                    out.push(closing);
                    chars.next();
                } else {
                    depth += 1;
                    out.push('\n');
                    out.push_str(&"  ".repeat(depth));
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                out.push('\n');
                out.push_str(&"  ".repeat(depth));
                out.push(character);
            }
            ',' => {
                out.push_str(",\n");
                out.push_str(&"  ".repeat(depth));
            }
            ':' => out.push_str(": "),
            other => out.push(other),
        }
    }
    out
}

/// Every string value (not key) in a JSON value.
pub fn strings(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::String(text) => out.push(text.clone()),
        Value::Array(items) => items.iter().for_each(|item| strings(item, out)),
        Value::Object(map) => map.values().for_each(|item| strings(item, out)),
        _ => {}
    }
}
