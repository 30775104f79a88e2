//! Round trip and "never panics" for the importers.
//!
//! Round trip, for every adapter version in the registry: a legal conversation `c` (every
//! render scenario in `tests/data/render/`, and random ones from the render property's seeded
//! generator) → `render` → the exact bytes → `import` with the same API's importer, and then:
//! - the imported document is `ready` for the validator;
//! - `semantic_diff(expected, imported)` is empty, where `expected` is `c` with what the
//!   rendering itself declared in its policy applied: omitted blocks (foreign reasoning,
//!   blank text for Anthropic) taken out, and call ids the API forced us to rewrite renamed
//!   as the policy says (Gemini sends no ids at all, so there the k-th call is paired with the
//!   k-th imported call, which is the API's own pairing rule). `semantic_diff` itself
//!   normalizes what an API cannot keep (see its docs): merged same-role turns, `context` as
//!   its wrapped text, Chat's text-before-calls order, status notes as statuses;
//! - the request parameters come back (model, stream, output cap, tools, and the generation
//!   settings rendered with it: a random set the API takes, or none) and the only dropped
//!   fields are the ones the renderer adds that the graph does not carry;
//! - import∘render is a fixpoint after one round: rendering the imported document and
//!   importing that again gives the same bytes.
//!
//! Never panics: arbitrary bytes, arbitrary JSON, JSON built from the APIs' own vocabulary, and
//! real rendered bodies with random JSON-level mutations go through every importer, and every
//! imported document through `semantic_diff`.

use crate::render_props::{Gen, conversation, run_seed};
use crate::render_sampling::{full_sampling, random_sampling};
use crate::render_support::{SCENARIOS, data_dir, model_for, render_sampled};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use serde_json::{Map, Value, json};
use std::collections::{HashMap, HashSet};
use turnstile_adapters::import::{GeminiCall, Imported, import, semantic_diff};
use turnstile_adapters::registry::Api;
use turnstile_adapters::render::{RenderOutcome, Rendered};
use turnstile_adapters::{AdapterId, Sampling};
use turnstile_core::conversation::Conversation;
use turnstile_core::{Verdict, parse, validate};

pub const APIS: [Api; 4] = [
    Api::OpenaiChat,
    Api::OpenaiResponses,
    Api::AnthropicMessages,
    Api::Gemini,
];

/// Import with the Gemini path parameters the gateway would pass.
pub fn import_as(
    api: Api,
    body: &[u8],
    model: &str,
) -> Result<Imported, turnstile_adapters::import::ImportError> {
    let gemini = (api == Api::Gemini).then(|| GeminiCall {
        model: model.to_owned(),
        stream: true,
    });
    import(api, body, "c-imported", gemini)
}

/// Decode an imported document (it must be readable v1).
pub fn decode(document: &Value) -> Conversation {
    Conversation::from_value(document.clone()).expect("an imported document is readable v1")
}

fn blocks_mut(turn: &mut Value) -> &mut Vec<Value> {
    turn["blocks"].as_array_mut().expect("turns have blocks")
}

/// The original with the rendering's declared policy applied (see the module docs).
fn expected_document(original: &Value, rendered: &Rendered, imported: &Value, api: Api) -> Value {
    let omitted: HashSet<&str> = rendered
        .policy
        .omitted
        .iter()
        .map(|omission| omission.block.as_str())
        .collect();
    let mut expected = original.clone();
    let turns = expected["turns"].as_array_mut().expect("turns");
    for turn in turns.iter_mut() {
        blocks_mut(turn).retain(|block| !omitted.contains(block["id"].as_str().unwrap_or("")));
    }
    turns.retain(|turn| !turn["blocks"].as_array().expect("blocks").is_empty());
    let renamed: HashMap<String, String> = if api == Api::Gemini {
        let calls = |document: &Value| -> Vec<String> {
            document["turns"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|turn| turn["blocks"].as_array().into_iter().flatten())
                .filter(|block| block["kind"] == "tool_call")
                .map(|block| block["call_id"].as_str().unwrap_or("").to_owned())
                .collect()
        };
        calls(&expected).into_iter().zip(calls(imported)).collect()
    } else {
        rendered
            .policy
            .call_ids
            .iter()
            .map(|mapping| (mapping.call_id.clone(), mapping.provider_call_id.clone()))
            .collect()
    };
    for turn in expected["turns"].as_array_mut().expect("turns") {
        for block in blocks_mut(turn) {
            if let Some(id) = block["call_id"].as_str()
                && let Some(new_id) = renamed.get(id)
            {
                block["call_id"] = json!(new_id);
            }
        }
    }
    expected
}

/// The fields the renderer writes that the graph does not carry.
fn dropped_by_rendering(api: Api) -> Vec<String> {
    match api {
        Api::OpenaiChat => vec!["stream_options".to_owned()],
        // Its `include: ["reasoning.encrypted_content"]` is the renderer's own value, which the
        // importer recognizes as nothing to carry (`passthrough.rs`).
        Api::OpenaiResponses | Api::AnthropicMessages | Api::Gemini => Vec::new(),
    }
}

fn render_value(document: &Value, adapter: AdapterId, sampling: &Sampling) -> RenderOutcome {
    render_sampled(&decode(document), adapter, sampling)
}

/// Every round-trip problem of one conversation with one adapter and generation settings
/// (empty = none). A pause is not a problem here: `render_props.rs` checks that pauses are
/// declared.
pub fn round_trip_problems(original: &Value, adapter: AdapterId, sampling: &Sampling) -> Vec<String> {
    let api = adapter.api();
    let model = model_for(adapter);
    let rendered = match render_value(original, adapter, sampling) {
        RenderOutcome::Rendered(rendered) => rendered,
        RenderOutcome::Paused(_) => return Vec::new(),
        RenderOutcome::Refused(error) => return vec![format!("refused {sampling:?}: {error}")],
        RenderOutcome::RefusedToolChoice(error) => return vec![format!("refused a tool choice: {error}")],
        RenderOutcome::RefusedOutputFormat(error) => {
            return vec![format!("refused an output format: {error}")];
        }
        RenderOutcome::RefusedPassthrough(error) => {
            return vec![format!("refused a client-only field: {error}")];
        }
    };
    let imported = match import_as(api, &rendered.body, model) {
        Ok(imported) => imported,
        Err(error) => {
            return vec![format!(
                "import failed: {} at {:?}: {error}",
                error.code(),
                error.path()
            )];
        }
    };
    let mut problems = Vec::new();
    let conversation = decode(&imported.document);
    let verdict = validate(&conversation);
    if verdict != Verdict::Ready {
        problems.push(format!("imported document is not ready: {verdict:?}"));
    }
    let expected = expected_document(original, &rendered, &imported.document, api);
    problems.extend(semantic_diff(&expected, &imported.document));
    if imported.model != model || !imported.stream || imported.max_output_tokens != Some(1024) {
        problems.push(format!(
            "request parameters: model {:?}, stream {}, max_output_tokens {:?}",
            imported.model, imported.stream, imported.max_output_tokens
        ));
    }
    let has_tools = !original["tools"].as_array().is_none_or(Vec::is_empty);
    if imported.has_tools != has_tools {
        problems.push(format!("has_tools is {}", imported.has_tools));
    }
    if imported.dropped != dropped_by_rendering(api) {
        problems.push(format!("dropped {:?}", imported.dropped));
    }
    if imported.sampling != *sampling {
        problems.push(format!(
            "sampling: rendered {sampling:?}, imported {:?}",
            imported.sampling
        ));
    }
    if !problems.is_empty() {
        return problems;
    }
    // Fixpoint after one round.
    let RenderOutcome::Rendered(second) = render_value(&imported.document, adapter, &imported.sampling)
    else {
        return vec!["the imported document pauses or is refused".into()];
    };
    let again = match import_as(api, &second.body, model) {
        Ok(again) => again,
        Err(error) => return vec![format!("second import failed: {error}")],
    };
    match render_value(&again.document, adapter, &again.sampling) {
        RenderOutcome::Rendered(third) if third.body == second.body => {}
        RenderOutcome::Rendered(third) => problems.push(format!(
            "not a fixpoint:\n{}\n{}",
            String::from_utf8_lossy(&second.body),
            String::from_utf8_lossy(&third.body)
        )),
        RenderOutcome::Paused(pauses) => problems.push(format!("second round pauses: {pauses:?}")),
        RenderOutcome::Refused(error) => problems.push(format!("second round is refused: {error}")),
        RenderOutcome::RefusedToolChoice(error) => {
            problems.push(format!("second round refuses a tool choice: {error}"))
        }
        RenderOutcome::RefusedOutputFormat(error) => {
            problems.push(format!("second round refuses an output format: {error}"))
        }
        RenderOutcome::RefusedPassthrough(error) => {
            problems.push(format!("second round refuses a client-only field: {error}"))
        }
    }
    problems
}

#[test]
fn every_render_scenario_imports_back_to_the_same_meaning_with_every_adapter() {
    for name in SCENARIOS {
        let path = data_dir().join(format!("{name}.json"));
        let original: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        for adapter in AdapterId::ALL {
            for sampling in [Sampling::default(), full_sampling(adapter.api())] {
                let problems = round_trip_problems(&original, adapter, &sampling);
                assert!(
                    problems.is_empty(),
                    "{name} × {adapter} × {sampling:?}: {problems:#?}"
                );
            }
        }
    }
}

fn runner(seed: u64, cases: u32) -> TestRunner {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &bytes),
    )
}

#[test]
fn import_of_render_has_the_meaning_of_every_random_legal_conversation_for_every_adapter() {
    let seed = run_seed("import_round_trip");
    let mut runner = runner(seed, 64);
    let result = runner.run(
        &(proptest::num::u64::ANY, proptest::bool::ANY),
        |(case, documents)| {
            let original = conversation(case, documents);
            let decoded = parse::conversation_from_slice(&serde_json::to_vec(&original).unwrap()).unwrap();
            prop_assert_eq!(validate(&decoded), Verdict::Ready, "case {}", case);
            let mut g = Gen::new(case ^ 0x5A3D_1E7C_0B9F_2468);
            for adapter in AdapterId::ALL {
                let sampling = if g.chance(25) {
                    Sampling::default()
                } else {
                    random_sampling(adapter.api(), &mut g)
                };
                let problems = round_trip_problems(&original, adapter, &sampling);
                prop_assert!(
                    problems.is_empty(),
                    "case {case} × {adapter} × {sampling:?}: {problems:#?}"
                );
            }
            Ok(())
        },
    );
    if let Err(error) = result {
        panic!("seed {seed}: {error}");
    }
}

#[test]
fn the_same_request_imports_to_the_same_document() {
    let original = conversation(7, true);
    for adapter in AdapterId::ALL {
        if let RenderOutcome::Rendered(rendered) =
            render_value(&original, adapter, &full_sampling(adapter.api()))
        {
            let first = import_as(adapter.api(), &rendered.body, "m").unwrap();
            let second = import_as(adapter.api(), &rendered.body, "m").unwrap();
            assert_eq!(first, second, "{adapter}");
            assert_eq!(
                turnstile_core::Digest::of_value(&first.document),
                turnstile_core::Digest::of_value(&second.document)
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Never panics.

/// Everything an importer and the comparison do with untrusted bytes; any panic fails.
pub fn everything(bytes: &[u8]) {
    let mut documents = Vec::new();
    for api in APIS {
        if let Ok(imported) = import_as(api, bytes, "m") {
            let _ = parse::conversation_from_slice(&serde_json::to_vec(&imported.document).unwrap())
                .map(|conversation| validate(&conversation));
            documents.push(imported.document);
        }
    }
    let _ = import(Api::Gemini, bytes, "c", None);
    for a in &documents {
        for b in &documents {
            let _ = semantic_diff(a, b);
        }
    }
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(6, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::btree_map(".{0,10}", inner, 0..8)
                .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

const KEYS: &[&str] = &[
    "model",
    "messages",
    "role",
    "content",
    "type",
    "text",
    "tool_calls",
    "id",
    "function",
    "name",
    "arguments",
    "tool_call_id",
    "input",
    "call_id",
    "output",
    "contents",
    "parts",
    "functionCall",
    "function_call",
    "functionResponse",
    "args",
    "response",
    "system",
    "systemInstruction",
    "tool_use_id",
    "is_error",
    "source",
    "media_type",
    "data",
    "url",
    "image_url",
    "file",
    "file_data",
    "filename",
    "file_url",
    "tools",
    "parameters",
    "input_schema",
    "description",
    "functionDeclarations",
    "inlineData",
    "inline_data",
    "fileData",
    "mimeType",
    "fileUri",
    "thought",
    "thoughtSignature",
    "signature",
    "thinking",
    "encrypted_content",
    "summary",
    "instructions",
    "max_tokens",
    "max_output_tokens",
    "stream",
    "n",
    "generationConfig",
    "maxOutputTokens",
    "refusal",
    "title",
    "detail",
    "error",
    "cache_control",
    "temperature",
    "top_p",
    "top_k",
    "topK",
    "stop",
    "stop_sequences",
    "stopSequences",
    "seed",
    "presence_penalty",
    "frequencyPenalty",
];

const VALUES: &[&str] = &[
    "user",
    "assistant",
    "system",
    "developer",
    "tool",
    "model",
    "function",
    "text",
    "image_url",
    "file",
    "input_text",
    "output_text",
    "input_image",
    "input_file",
    "message",
    "function_call",
    "function_call_output",
    "reasoning",
    "summary_text",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
    "image",
    "document",
    "base64",
    "url",
    "image/png",
    "application/pdf",
    "text/plain",
    "data:image/png;base64,iVBORw0KGgo=",
    "data:",
    "{\"a\":1}",
    "{\"a\":",
    "",
    "call_1",
    "gemini-t-2-0",
    "auto",
    "custom",
    "output",
    "error",
];

fn vocabulary_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (0u64..3000).prop_map(Value::from),
        prop::sample::select(VALUES).prop_map(Value::from),
        "[ -~]{0,6}".prop_map(Value::from),
    ];
    leaf.prop_recursive(7, 128, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..7).prop_map(|pairs| {
                Value::Object(
                    pairs
                        .into_iter()
                        .map(|(key, value)| (key.to_owned(), value))
                        .collect::<Map<_, _>>(),
                )
            }),
        ]
    })
}

/// Replace, remove or retype one random sub-value of `value`.
fn mutate(value: &mut Value, g: &mut Gen, replacement: &Value) {
    let mut paths: Vec<Vec<Value>> = Vec::new();
    fn walk(value: &Value, path: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
        out.push(path.clone());
        match value {
            Value::Array(items) => {
                for (index, item) in items.iter().enumerate() {
                    path.push(json!(index));
                    walk(item, path, out);
                    path.pop();
                }
            }
            Value::Object(map) => {
                for (key, item) in map {
                    path.push(json!(key));
                    walk(item, path, out);
                    path.pop();
                }
            }
            _ => {}
        }
    }
    walk(value, &mut Vec::new(), &mut paths);
    let path = &paths[g.below(paths.len() as u64) as usize];
    let Some((last, parent_path)) = path.split_last() else {
        *value = replacement.clone();
        return;
    };
    let mut parent = &mut *value;
    for step in parent_path {
        parent = match step {
            Value::String(key) => &mut parent[key.as_str()],
            index => &mut parent[index.as_u64().unwrap() as usize],
        };
    }
    match (parent, last) {
        (Value::Object(map), Value::String(key)) if g.chance(30) => {
            map.remove(key);
        }
        (Value::Array(items), index) if g.chance(30) => {
            items.remove(index.as_u64().unwrap() as usize);
        }
        (Value::Object(map), Value::String(key)) => {
            map.insert(key.clone(), replacement.clone());
        }
        (Value::Array(items), index) => {
            items[index.as_u64().unwrap() as usize] = replacement.clone();
        }
        _ => {}
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes_never_panic_any_importer(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        everything(&bytes);
    }

    #[test]
    fn arbitrary_json_never_panics_any_importer(value in any_json()) {
        everything(&serde_json::to_vec(&value).unwrap());
        let _ = semantic_diff(&value, &value);
        let _ = semantic_diff(&value, &json!({"turns": [value.clone()], "tools": value.clone()}));
    }

    #[test]
    fn provider_vocabulary_json_never_panics_any_importer(
        top in prop::collection::vec((prop::sample::select(KEYS), vocabulary_json()), 0..8),
    ) {
        let top: Map<String, Value> = top.into_iter().map(|(key, value)| (key.to_owned(), value)).collect();
        everything(&serde_json::to_vec(&Value::Object(top)).unwrap());
    }

    #[test]
    fn mutated_real_request_bodies_never_panic_their_importer(
        case in any::<u64>(),
        replacement in vocabulary_json(),
        mutations in 1usize..4,
    ) {
        let original = conversation(case, true);
        let mut g = Gen::new(case);
        for adapter in AdapterId::ALL {
            let RenderOutcome::Rendered(rendered) = render_value(&original, adapter, &full_sampling(adapter.api())) else {
                continue;
            };
            let mut body: Value = serde_json::from_slice(&rendered.body).unwrap();
            for _ in 0..mutations {
                mutate(&mut body, &mut g, &replacement);
            }
            everything(&serde_json::to_vec(&body).unwrap());
        }
    }
}
