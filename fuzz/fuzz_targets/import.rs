//! Arbitrary bytes through every importer (provider request → v1 document) → the decoder and
//! validator → and, when ready, the graph, a render with each adapter of the same API, and the
//! semantic comparison shadow mode runs. The stable twins are the never-panics properties in
//! `crates/turnstile-adapters/tests/it/import_props.rs`.
//! Run: `cd fuzz && cargo +nightly fuzz run import`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use turnstile_adapters::import::{GeminiCall, import, semantic_diff};
use turnstile_adapters::render::{Graph, RenderCache};
use turnstile_adapters::{AdapterId, Api, Catalog, PrepareRequest, prepare};
use turnstile_core::{Conversation, MessageSequence, Validated};

const APIS: [Api; 4] = [Api::OpenaiChat, Api::OpenaiResponses, Api::AnthropicMessages, Api::Gemini];

fuzz_target!(|bytes: &[u8]| {
    let Some((&selector, body)) = bytes.split_first() else {
        return;
    };
    let api = APIS[usize::from(selector) % APIS.len()];
    let gemini = Some(GeminiCall { model: "gemini-fuzz".into(), stream: selector & 0x80 != 0 });
    let Ok(imported) = import(api, body, "c-fuzz", gemini.clone()) else {
        return;
    };
    let Ok(conversation) = Conversation::from_value(imported.document.clone()) else {
        return;
    };
    let Ok(validated) = Validated::new(&conversation) else {
        return;
    };
    let sequence = MessageSequence::build(validated);
    let Ok(graph) = Graph::new(validated, &sequence) else {
        return;
    };
    let catalog = Catalog::builtin();
    for adapter in AdapterId::ALL.into_iter().filter(|adapter| adapter.api() == api) {
        let request = PrepareRequest {
            operation_id: "op-fuzz".into(),
            adapter,
            provider: None,
            model: imported.model.clone(),
            max_output_tokens: imported.max_output_tokens,
            stream: imported.stream,
            background: false,
        };
        let mut cache = RenderCache::new();
        if let turnstile_adapters::PrepareOutcome::Prepared(prepared) = prepare(graph, &request, &catalog, &mut cache) {
            if let Ok(again) = import(api, &prepared.rendered.body, "c-fuzz", gemini.clone()) {
                let _ = semantic_diff(&again.document, &imported.document);
            }
        }
    }
});
