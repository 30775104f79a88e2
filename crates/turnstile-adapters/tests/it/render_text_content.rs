//! A provider's `text_content` on the render side: OpenAI Chat writes a message whose parts
//! are all text as one string when asked (minimal compatible servers take only that form),
//! keeps the array for a message with an image or a file, pins the choice in the policy, and
//! the default renders the bytes and policy it always did. Every other API ignores it.

use crate::render_support::{SCENARIOS, load, model_for, options_for, render_for, tokenizer_for};
use serde_json::Value;
use turnstile_adapters::render::{Graph, RenderCache, RenderOptions, RenderOutcome, Rendered, render};
use turnstile_adapters::{AdapterId, Api, Catalog, PrepareOutcome, PrepareRequest, TextContent};
use turnstile_core::conversation::Conversation;
use turnstile_core::{MessageSequence, Validated};

fn render_with(
    conversation: &Conversation,
    adapter: AdapterId,
    text_content: TextContent,
    cache: &mut RenderCache,
) -> RenderOutcome {
    let validated = Validated::new(conversation).expect("test conversations are valid");
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).expect("test conversations are ready");
    let options = RenderOptions {
        text_content,
        ..options_for(adapter)
    };
    render(adapter, graph, &options, tokenizer_for(adapter), cache)
}

fn messages(rendered: &Rendered) -> Vec<Value> {
    let body: Value = serde_json::from_slice(&rendered.body).unwrap();
    body["messages"].as_array().unwrap().clone()
}

/// The texts of an array of content parts, None when one part is not text.
fn texts_of(parts: &[Value]) -> Option<Vec<&str>> {
    parts
        .iter()
        .map(|part| match part["type"].as_str() {
            Some("text") => part["text"].as_str(),
            _ => None,
        })
        .collect()
}

#[test]
fn string_text_content_writes_each_all_text_chat_message_as_one_string_and_keeps_arrays_otherwise() {
    let mut strings = 0;
    let mut arrays_kept = 0;
    for adapter in [AdapterId::OpenaiChatV1, AdapterId::OpenaiChatV2] {
        // One cache shared by both forms, in both orders: a fragment of one form is never
        // taken for the other.
        let mut cache = RenderCache::new();
        for name in SCENARIOS {
            let conversation = load(name);
            let plain = render_for(&conversation, adapter);
            let first = render_with(&conversation, adapter, TextContent::String, &mut cache);
            let again = render_with(&conversation, adapter, TextContent::Parts, &mut cache);
            assert_eq!(
                again, plain,
                "{name} × {adapter}: the default after the string form"
            );
            let (RenderOutcome::Rendered(plain), RenderOutcome::Rendered(string)) = (plain, first) else {
                continue;
            };
            let (plain_messages, string_messages) = (messages(&plain), messages(&string));
            assert_eq!(plain_messages.len(), string_messages.len(), "{name} × {adapter}");
            for (parts, string) in plain_messages.iter().zip(&string_messages) {
                let mut expected = parts.clone();
                if let Some(Value::Array(content)) = parts.get("content")
                    && let Some(texts) = texts_of(content)
                    && !texts.is_empty()
                {
                    expected["content"] = Value::String(texts.join("\n"));
                    strings += 1;
                } else if matches!(parts.get("content"), Some(Value::Array(_))) {
                    arrays_kept += 1;
                }
                assert_eq!(*string, expected, "{name} × {adapter}");
            }
            let policy = serde_json::to_value(&string.policy).unwrap();
            assert_eq!(policy["text_content"], "string", "{name} × {adapter}");
            assert_ne!(
                string.policy.digest(),
                plain.policy.digest(),
                "{name} × {adapter}"
            );
            let plain_policy = serde_json::to_value(&plain.policy).unwrap();
            assert!(plain_policy.get("text_content").is_none(), "{name} × {adapter}");
        }
    }
    // The scenarios hold both kinds of message.
    assert!(
        strings > 10 && arrays_kept > 0,
        "{strings} strings, {arrays_kept} arrays kept"
    );
}

fn manifest(
    conversation: &Conversation,
    adapter: AdapterId,
    text_content: TextContent,
) -> turnstile_core::manifest::DispatchManifest {
    let validated = Validated::new(conversation).unwrap();
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).unwrap();
    let request = PrepareRequest {
        operation_id: "op-text-content".into(),
        adapter,
        provider: None,
        model: model_for(adapter).into(),
        max_output_tokens: Some(512),
        stream: true,
        background: false,
        text_content,
    };
    match turnstile_adapters::prepare(graph, &request, &Catalog::builtin(), &mut RenderCache::new()) {
        PrepareOutcome::Prepared(prepared) => {
            assert_eq!(prepared.rendered.policy.text_content, {
                if adapter.api() == Api::OpenaiChat {
                    text_content
                } else {
                    TextContent::Parts
                }
            });
            assert_eq!(
                prepared.manifest.body.policy_digest,
                prepared.rendered.policy.digest()
            );
            prepared.manifest
        }
        other => panic!("{adapter}: {other:?}"),
    }
}

#[test]
fn prepare_pins_string_text_content_in_the_digests_of_a_chat_manifest_and_no_other_api_changes() {
    for name in SCENARIOS {
        let conversation = load(name);
        for adapter in AdapterId::ALL {
            if adapter.api() == Api::OpenaiChat {
                continue;
            }
            let string = render_with(
                &conversation,
                adapter,
                TextContent::String,
                &mut RenderCache::new(),
            );
            assert_eq!(string, render_for(&conversation, adapter), "{name} × {adapter}");
        }
    }
    let conversation = load("multi_round");
    for adapter in AdapterId::ALL {
        let parts = manifest(&conversation, adapter, TextContent::Parts);
        let string = manifest(&conversation, adapter, TextContent::String);
        if adapter.api() == Api::OpenaiChat {
            assert_ne!(parts.body.policy_digest, string.body.policy_digest, "{adapter}");
            assert_ne!(parts.body.request_digest, string.body.request_digest, "{adapter}");
        } else {
            assert_eq!(parts, string, "{adapter}");
        }
    }
}
