//! Admission never undercounts tool schemas (issue 17): for every adapter, what the tools add
//! to the prompt count is at least a reference count of the bytes they add to the request,
//! over generated schemas with `$defs`, `allOf`/`anyOf`, nested objects, enums and long
//! descriptions; and a tool with a large `$defs` block is refused over an 8,000-token window
//! on every adapter.

use crate::render_props::run_seed;
use crate::render_support::{model_for, render_for, tokenizer_for};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use serde_json::{Map, Value, json};
use turnstile_adapters::catalog::{Entry, ModelInfo};
use turnstile_adapters::render::{Graph, RenderCache, RenderOutcome};
use turnstile_adapters::tokens::Tokenizer;
use turnstile_adapters::{AdapterId, Catalog, PrepareOutcome, PrepareRequest, prepare};
use turnstile_core::conversation::Conversation;
use turnstile_core::{MessageSequence, Validated, parse};

fn conversation_with(tools: &[Value]) -> Conversation {
    let mut document = json!({
        "format": "turnstile.conversation.v1", "conversation_id": "c-tools", "revision": 1,
        "turns": [{"id": "t-1", "revision": 1, "role": "user",
                   "blocks": [{"id": "u-1", "kind": "text", "text": "Plan the trip."}]}]
    });
    if !tools.is_empty() {
        document["tools"] = Value::Array(tools.to_vec());
    }
    parse::conversation_from_slice(&serde_json::to_vec(&document).unwrap()).unwrap()
}

fn rendered(conversation: &Conversation, adapter: AdapterId) -> (Vec<u8>, u64) {
    match render_for(conversation, adapter) {
        RenderOutcome::Rendered(rendered) => (rendered.body, rendered.prompt_tokens),
        other => panic!("{adapter}: {other:?}"),
    }
}

/// The bytes `with` has and `without` lacks: the tools as the request carries them (the two
/// bodies differ only by the inserted `tools` member).
fn inserted<'a>(with: &'a [u8], without: &[u8]) -> &'a [u8] {
    let prefix = with.iter().zip(without).take_while(|(a, b)| a == b).count();
    let suffix = with[prefix..]
        .iter()
        .rev()
        .zip(without[prefix..].iter().rev())
        .take_while(|(a, b)| a == b)
        .count();
    &with[prefix..with.len() - suffix]
}

/// A reference count of the tool bytes: the adapter's own counter over them, exact BPE for
/// OpenAI models and, for Anthropic and Gemini (no local tokenizer), the estimator whose
/// bound against the real tokenizers is measured in `render_prepare.rs`. (o200k is no
/// reference for those: on random base64-like identifiers it counts more than the estimator,
/// which says nothing about Claude's or Gemma's tokenizer.)
fn reference(tokenizer: Tokenizer, bytes: &[u8]) -> u64 {
    tokenizer.count(std::str::from_utf8(bytes).expect("request bodies are UTF-8"))
}

/// Checks one toolset on every adapter; the first failure as a message.
fn check_tools(tools: &[Value]) -> Result<(), String> {
    let with = conversation_with(tools);
    let without = conversation_with(&[]);
    for adapter in AdapterId::ALL {
        let (body_with, tokens_with) = rendered(&with, adapter);
        let (body_without, tokens_without) = rendered(&without, adapter);
        let tools_bytes = inserted(&body_with, &body_without);
        let charged = tokens_with - tokens_without;
        let expected = reference(tokenizer_for(adapter), tools_bytes);
        if charged < expected {
            return Err(format!(
                "{adapter}: tools charged {charged} tokens, their {} bytes count {expected}",
                tools_bytes.len()
            ));
        }
    }
    Ok(())
}

fn word() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z]{1,12}",
        "[A-Z][a-z]{0,10}",
        "[0-9]{1,6}",
        Just("ÄÖÜ".to_owned()),
        Just("東京".to_owned()),
        Just("naïve".to_owned()),
        "[a-zA-Z0-9+/]{8,40}",
    ]
}

fn description() -> impl Strategy<Value = String> {
    prop::collection::vec(word(), 0..120).prop_map(|words| words.join(" "))
}

fn identifier() -> impl Strategy<Value = String> {
    "[a-z][a-z0-9_]{0,24}"
}

/// A JSON Schema, `depth` levels deep at most.
fn schema(depth: u32) -> BoxedStrategy<Value> {
    let leaf = prop_oneof![
        (description()).prop_map(|text| json!({"type": "string", "description": text})),
        Just(json!({"type": "integer", "minimum": 0})),
        Just(json!({"type": "number"})),
        Just(json!({"type": "boolean"})),
        prop::collection::vec(identifier(), 1..12).prop_map(|items| json!({"type": "string", "enum": items})),
        (1u32..6).prop_map(|n| json!({"$ref": format!("#/$defs/d{n}")})),
    ];
    leaf.prop_recursive(depth, 64, 8, |inner| {
        prop_oneof![
            (
                prop::collection::btree_map(identifier(), inner.clone(), 1..8),
                description()
            )
                .prop_map(|(properties, text)| {
                    let required: Vec<&String> = properties.keys().take(2).collect();
                    json!({"type": "object", "description": text, "properties": properties,
                           "required": required, "additionalProperties": false})
                }),
            inner
                .clone()
                .prop_map(|items| json!({"type": "array", "items": items})),
            prop::collection::vec(inner.clone(), 1..4).prop_map(|any| json!({"anyOf": any})),
            prop::collection::vec(inner.clone(), 1..4).prop_map(|all| json!({"allOf": all})),
            prop::collection::vec(inner, 1..4).prop_map(|one| json!({"oneOf": one})),
        ]
    })
    .boxed()
}

fn tool() -> impl Strategy<Value = Value> {
    (
        identifier(),
        prop::option::of(description()),
        prop::collection::btree_map(identifier(), schema(3), 0..6),
        prop::collection::vec(schema(2), 0..6),
    )
        .prop_map(|(name, text, properties, defs)| {
            let mut input_schema = json!({"type": "object", "properties": properties});
            if !defs.is_empty() {
                let defs: Map<String, Value> = defs
                    .into_iter()
                    .enumerate()
                    .map(|(index, schema)| (format!("d{}", index + 1), schema))
                    .collect();
                input_schema["$defs"] = Value::Object(defs);
            }
            let mut tool = json!({"name": name, "input_schema": input_schema});
            if let Some(text) = text {
                tool["description"] = json!(text);
            }
            tool
        })
}

fn toolset() -> impl Strategy<Value = Vec<Value>> {
    prop::collection::vec(tool(), 1..4).prop_map(|tools| {
        // Tool names must be unique within a toolset.
        let mut seen = std::collections::HashSet::new();
        tools
            .into_iter()
            .filter(|tool| seen.insert(tool["name"].as_str().unwrap_or_default().to_owned()))
            .collect()
    })
}

#[test]
fn admission_charges_at_least_the_tokens_of_the_tool_bytes_sent_on_every_adapter() {
    let seed = run_seed("admission_charges_at_least_the_tokens_of_the_tool_bytes_sent");
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases: 48,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &bytes),
    );
    let outcome = runner.run(&toolset(), |tools| {
        check_tools(&tools).map_err(|message| TestCaseError::fail(format!("seed {seed}: {message}")))
    });
    if let Err(error) = outcome {
        panic!("{error}");
    }
}

/// A tool whose schema keeps nearly everything in `$defs` (the outside finding: a 438 KB
/// block that the cookbook formula counted as 53 tokens).
pub fn defs_tool() -> Value {
    let mut defs = Map::new();
    for index in 0..400 {
        defs.insert(
            format!("Leg{index}"),
            json!({"type": "object", "description": format!(
                "Leg {index} of the itinerary: departure airport, arrival airport, carrier, fare class and the \
                 baggage allowance that applies to this leg only"),
                "properties": {"from": {"type": "string", "description": "IATA code of the departure airport"},
                               "to": {"type": "string", "description": "IATA code of the arrival airport"},
                               "fare": {"type": "string", "enum": ["economy", "premium", "business", "first"]}},
                "required": ["from", "to"]}),
        );
    }
    json!({"name": "book_trip", "description": "Book a trip.",
           "input_schema": {"type": "object", "properties": {"legs": {"type": "array", "items": {"$ref": "#/$defs/Leg0"}}},
                            "$defs": defs}})
}

#[test]
fn cookbook_formula_would_miss_the_defs_block_and_admission_does_not() {
    let conversation = conversation_with(&[defs_tool()]);
    let schema_text = serde_json::to_string(&defs_tool()["input_schema"]).unwrap();
    let schema_tokens = Tokenizer::O200kBase.count(&schema_text);
    assert!(
        schema_tokens > 8_000,
        "the $defs block alone is {schema_tokens} tokens"
    );
    for adapter in AdapterId::ALL {
        let (_, prompt_tokens) = rendered(&conversation, adapter);
        assert!(
            prompt_tokens > schema_tokens,
            "{adapter}: prompt {prompt_tokens} tokens, the schema alone is {schema_tokens}"
        );
    }
}

#[test]
fn the_defs_tool_over_an_8000_token_window_is_refused_on_every_adapter() {
    let conversation = conversation_with(&[defs_tool()]);
    let validated = Validated::new(&conversation).unwrap();
    let sequence = MessageSequence::build(validated);
    for adapter in AdapterId::ALL {
        let mut catalog = Catalog::builtin();
        let model = model_for(adapter);
        let mut info: ModelInfo = catalog.lookup(adapter.api(), model).0;
        info.context_window = 8_000;
        info.max_output_tokens_default = 1_000;
        catalog.insert(Entry {
            name: model.to_owned(),
            prefix: false,
            info,
        });
        let graph = Graph::new(validated, &sequence).unwrap();
        let request = PrepareRequest {
            operation_id: "op-defs".into(),
            adapter,
            provider: None,
            model: model.into(),
            max_output_tokens: None,
            stream: true,
            background: false,
            text_content: Default::default(),
        };
        match prepare(graph, &request, &catalog, &mut RenderCache::new()) {
            PrepareOutcome::OverBudget(over) => {
                assert_eq!(over.context_window, 8_000, "{adapter}");
            }
            other => panic!("{adapter}: a $defs tool of >8,000 tokens was not refused: {other:?}"),
        }
    }
}
