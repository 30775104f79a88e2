//! Client-only fields (`passthrough.rs`): imported out of the dropped list, written byte for
//! byte (in canonical form) when the target speaks the client's API, refused by name towards
//! another API except the inert identifiers, which are left out and reported; pinned by the
//! policy digest. Expectations written here from the providers' docs, not read from the module.

use crate::render_support::{load, options_for, tokenizer_for};
use serde_json::{Value, json};
use turnstile_adapters::AdapterId;
use turnstile_adapters::import::{GeminiCall, import};
use turnstile_adapters::passthrough::Passthrough;
use turnstile_adapters::registry::Api;
use turnstile_adapters::render::{Graph, RenderCache, RenderOptions, RenderOutcome, render};
use turnstile_core::{MessageSequence, Validated};

/// Where a field must reappear in a rendered body: (path, value).
type Placed = Vec<(Vec<&'static str>, Value)>;

/// A request of each API with client-only fields, and where they must reappear in a rendered
/// body of the same API.
fn cases() -> Vec<(Api, Value, Placed)> {
    let user = json!({"role": "user", "content": "Hi"});
    vec![
        (
            Api::OpenaiChat,
            json!({"model": "gpt-5", "messages": [user], "reasoning_effort": "high", "service_tier": "flex",
                   "store": true, "prompt_cache_key": "session-7", "metadata": {"run": "r1"}, "user": "u-1",
                   "logprobs": true, "top_logprobs": 2, "verbosity": "low"}),
            vec![
                (vec!["reasoning_effort"], json!("high")),
                (vec!["service_tier"], json!("flex")),
                (vec!["store"], json!(true)),
                (vec!["prompt_cache_key"], json!("session-7")),
                (vec!["metadata"], json!({"run": "r1"})),
                (vec!["user"], json!("u-1")),
                (vec!["logprobs"], json!(true)),
                (vec!["top_logprobs"], json!(2)),
                (vec!["verbosity"], json!("low")),
            ],
        ),
        (
            Api::OpenaiResponses,
            json!({"model": "gpt-5", "input": "Hi", "reasoning": {"effort": "low", "summary": "auto"},
                   "truncation": "auto", "store": false, "service_tier": "priority", "prompt_cache_key": "k"}),
            vec![
                (vec!["reasoning"], json!({"effort": "low", "summary": "auto"})),
                (vec!["truncation"], json!("auto")),
                (vec!["store"], json!(false)),
                (vec!["service_tier"], json!("priority")),
                (vec!["prompt_cache_key"], json!("k")),
            ],
        ),
        (
            Api::AnthropicMessages,
            json!({"model": "claude-sonnet-4-5", "max_tokens": 4096, "messages": [user],
                   "thinking": {"type": "enabled", "budget_tokens": 2048}, "metadata": {"user_id": "u-1"},
                   "service_tier": "standard_only", "cache_control": {"type": "ephemeral"}}),
            vec![
                (
                    vec!["thinking"],
                    json!({"type": "enabled", "budget_tokens": 2048}),
                ),
                (vec!["metadata"], json!({"user_id": "u-1"})),
                (vec!["service_tier"], json!("standard_only")),
                (vec!["cache_control"], json!({"type": "ephemeral"})),
            ],
        ),
        (
            Api::Gemini,
            json!({"contents": [{"role": "user", "parts": [{"text": "Hi"}]}],
                   "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
                   "generationConfig": {"thinkingConfig": {"thinkingBudget": 1024, "includeThoughts": true},
                                        "responseLogprobs": true, "logprobs": 3}}),
            vec![
                (
                    vec!["safetySettings"],
                    json!([{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}]),
                ),
                (
                    vec!["generationConfig", "thinkingConfig"],
                    json!({"thinkingBudget": 1024, "includeThoughts": true}),
                ),
                (vec!["generationConfig", "responseLogprobs"], json!(true)),
                (vec!["generationConfig", "logprobs"], json!(3)),
            ],
        ),
    ]
}

fn imported_passthrough(api: Api, body: &Value) -> Passthrough {
    let gemini = (api == Api::Gemini).then(|| GeminiCall {
        model: "gemini-2.5-pro".into(),
        stream: true,
    });
    let imported = import(api, body.to_string().as_bytes(), "c-1", gemini).unwrap();
    assert!(imported.dropped.is_empty(), "{api:?}: {:?}", imported.dropped);
    imported.passthrough
}

fn render_with(adapter: AdapterId, passthrough: &Passthrough) -> RenderOutcome {
    let conversation = load("multi_round");
    let validated = Validated::new(&conversation).unwrap();
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).unwrap();
    let options = RenderOptions {
        passthrough: passthrough.clone(),
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

fn at<'a>(body: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(body, |value, key| value.get(*key))
}

#[test]
fn client_only_fields_reach_a_target_of_the_same_api_exactly() {
    for (api, body, expected) in cases() {
        let passthrough = imported_passthrough(api, &body);
        for adapter in AdapterId::ALL.into_iter().filter(|adapter| adapter.api() == api) {
            let RenderOutcome::Rendered(rendered) = render_with(adapter, &passthrough) else {
                panic!("{adapter}: refused its own API's fields");
            };
            let value: Value = serde_json::from_slice(&rendered.body).unwrap();
            for (path, want) in &expected {
                assert_eq!(at(&value, path), Some(want), "{adapter}: {path:?} in {value}");
            }
            let RenderOutcome::Rendered(plain) = render_with(adapter, &Passthrough::default()) else {
                panic!("{adapter}: plain render");
            };
            assert_ne!(rendered.policy.digest(), plain.policy.digest(), "{adapter}");
            assert!(rendered.prompt_tokens > plain.prompt_tokens, "{adapter}");
        }
    }
}

#[test]
fn client_only_fields_towards_another_api_are_refused_by_name_unless_inert() {
    for (api, body, _) in cases() {
        let passthrough = imported_passthrough(api, &body);
        for adapter in AdapterId::ALL.into_iter().filter(|adapter| adapter.api() != api) {
            let RenderOutcome::RefusedPassthrough(error) = render_with(adapter, &passthrough) else {
                panic!("{api:?} → {adapter}: not refused");
            };
            assert_eq!(error.code(), "unsupported_setting");
            // The first field (in the API's documented list) that is not an identifier, named as
            // the client spelt it.
            let first = match api {
                Api::Gemini => "safetySettings",
                _ => "service_tier",
            };
            assert_eq!(error.field(), first, "{api:?} → {adapter}");
        }
    }
    // Identifiers alone are left out towards another API, and reported.
    let body = json!({"model": "gpt-5", "messages": [{"role": "user", "content": "Hi"}],
                      "user": "u-1", "metadata": {"run": "r1"}, "safety_identifier": "s"});
    let passthrough = imported_passthrough(Api::OpenaiChat, &body);
    let RenderOutcome::Rendered(rendered) = render_with(AdapterId::AnthropicMessagesV2, &passthrough) else {
        panic!("identifiers refused");
    };
    let value: Value = serde_json::from_slice(&rendered.body).unwrap();
    for field in ["user", "metadata", "safety_identifier"] {
        assert!(value.get(field).is_none(), "{value}");
    }
    let mut dropped = passthrough.dropped_towards(Api::AnthropicMessages);
    dropped.sort();
    assert_eq!(dropped, ["metadata", "safety_identifier", "user"]);
    assert!(passthrough.dropped_towards(Api::OpenaiChat).is_empty());
}

#[test]
fn rendered_openai_client_only_fields_conform_to_the_official_openapi_request_schemas() {
    use crate::render_openapi::{discriminated_one_of_as_any_of, spec_path, to_json, validator};
    let path = spec_path();
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!(
            "OpenAPI client-only-field conformance NOT RUN: {} is not present",
            path.display()
        );
        return;
    };
    let text = text
        .replace("-9223372036854776000", "-9223372036854775808")
        .replace("9223372036854776000", "9223372036854775807");
    let yaml: serde_yaml::Value = serde_yaml::from_str(&text).expect("the OpenAPI spec is YAML");
    let mut spec = to_json(yaml);
    discriminated_one_of_as_any_of(&mut spec);
    let mut checked = 0;
    for (api, body, expected) in cases() {
        let schema = match api {
            Api::OpenaiChat => validator(&spec, "CreateChatCompletionRequest"),
            Api::OpenaiResponses => validator(&spec, "CreateResponse"),
            _ => continue,
        };
        let passthrough = imported_passthrough(api, &body);
        for adapter in AdapterId::ALL.into_iter().filter(|adapter| adapter.api() == api) {
            let RenderOutcome::Rendered(rendered) = render_with(adapter, &passthrough) else {
                panic!("{adapter}");
            };
            let mut value: Value = serde_json::from_slice(&rendered.body).unwrap();
            let errors: Vec<String> = schema
                .iter_errors(&value)
                .map(|error| error.to_string())
                .collect();
            assert!(errors.is_empty(), "{adapter}: {errors:?}");
            checked += 1;
            // Control: the schema checks these fields.
            value[expected[0].0[0]] = json!(17);
            assert!(
                !schema.is_valid(&value),
                "{adapter}: a broken {:?} passes",
                expected[0].0
            );
        }
    }
    assert_eq!(checked, 3);
}

#[test]
fn responses_include_values_are_written_after_the_one_the_renderer_needs_and_refused_elsewhere() {
    let body = json!({"model": "gpt-5", "input": "Hi",
                      "include": ["message.output_text.logprobs", "reasoning.encrypted_content",
                                  "message.output_text.logprobs"]});
    let passthrough = imported_passthrough(Api::OpenaiResponses, &body);
    let RenderOutcome::Rendered(rendered) = render_with(AdapterId::OpenaiResponsesV1, &passthrough) else {
        panic!("refused");
    };
    let value: Value = serde_json::from_slice(&rendered.body).unwrap();
    assert_eq!(
        value["include"],
        json!(["reasoning.encrypted_content", "message.output_text.logprobs"])
    );
    let RenderOutcome::RefusedPassthrough(error) = render_with(AdapterId::OpenaiChatV2, &passthrough) else {
        panic!("include crossed to Chat");
    };
    assert_eq!(error.field(), "include");
    // Only the value the renderer writes anyway: nothing to carry, nothing to refuse.
    let body = json!({"model": "gpt-5", "input": "Hi", "include": ["reasoning.encrypted_content"]});
    assert!(imported_passthrough(Api::OpenaiResponses, &body).is_unset());
}
