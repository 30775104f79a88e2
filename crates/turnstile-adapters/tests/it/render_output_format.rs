//! Structured output on the render and import sides: every adapter writes every format its API
//! can spell in the API's own fields, checked against an expectation table written here from
//! the provider docs (not read from `output_format.rs`); a format the API cannot spell is
//! refused naming `output_format`; what a renderer writes imports back to the same value; the
//! OpenAI bodies conform to the official OpenAPI schemas; nothing set changes nothing.

use crate::render_support::{load, options_for, tokenizer_for};
use serde_json::{Value, json};
use turnstile_adapters::AdapterId;
use turnstile_adapters::import::{GeminiCall, import};
use turnstile_adapters::output_format::{Format, OutputFormat};
use turnstile_adapters::registry::Api;
use turnstile_adapters::render::{Graph, RenderCache, RenderOptions, RenderOutcome, render};
use turnstile_core::conversation::Conversation;
use turnstile_core::{MessageSequence, Validated};

fn schema() -> Value {
    json!({"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
           "additionalProperties": false})
}

fn cases() -> Vec<(&'static str, Format)> {
    vec![
        ("text", Format::Text),
        ("json_object", Format::JsonObject),
        (
            "json_schema",
            Format::JsonSchema {
                name: Some("answer".into()),
                description: None,
                schema: schema(),
                strict: Some(true),
            },
        ),
        (
            "json_schema_described",
            Format::JsonSchema {
                name: Some("answer".into()),
                description: Some("The answer.".into()),
                schema: schema(),
                strict: None,
            },
        ),
        (
            "json_schema_unnamed",
            Format::JsonSchema {
                name: None,
                description: None,
                schema: schema(),
                strict: None,
            },
        ),
        (
            "gemini",
            Format::Gemini {
                mime_type: Some("application/json".into()),
                response_schema: Some(
                    json!({"type": "OBJECT", "properties": {"answer": {"type": "STRING"}}}),
                ),
                response_json_schema: None,
            },
        ),
    ]
}

/// Where each API puts each case: `(path, value)` pairs, or refused. OpenAI:
/// `CreateChatCompletionRequest.response_format`, `CreateResponse.text.format`
/// (<https://platform.openai.com/docs/guides/structured-outputs>); Gemini:
/// <https://ai.google.dev/gemini-api/docs/structured-output> (`responseMimeType`,
/// `responseSchema`, `responseJsonSchema` inside `generationConfig`); Anthropic Messages
/// `2023-06-01` has no such field.
fn expected(api: Api, case: &str) -> Option<Vec<(&'static [&'static str], Value)>> {
    const CHAT: &[&str] = &["response_format"];
    const RESPONSES: &[&str] = &["text", "format"];
    const MIME: &[&str] = &["generationConfig", "responseMimeType"];
    const JSON_SCHEMA: &[&str] = &["generationConfig", "responseJsonSchema"];
    const SCHEMA: &[&str] = &["generationConfig", "responseSchema"];
    let named = |name: &str| json!({"name": name, "schema": schema()});
    Some(match (api, case) {
        (Api::OpenaiChat, "text") => vec![(CHAT, json!({"type": "text"}))],
        (Api::OpenaiResponses, "text") => vec![(RESPONSES, json!({"type": "text"}))],
        (Api::OpenaiChat, "json_object") => vec![(CHAT, json!({"type": "json_object"}))],
        (Api::OpenaiResponses, "json_object") => vec![(RESPONSES, json!({"type": "json_object"}))],
        (Api::OpenaiChat, "json_schema") => vec![(
            CHAT,
            json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema(), "strict": true}}),
        )],
        (Api::OpenaiResponses, "json_schema") => vec![(
            RESPONSES,
            json!({"type": "json_schema", "name": "answer", "schema": schema(), "strict": true}),
        )],
        (Api::OpenaiChat, "json_schema_described") => vec![(
            CHAT,
            json!({"type": "json_schema", "json_schema": {"name": "answer", "description": "The answer.", "schema": schema()}}),
        )],
        (Api::OpenaiResponses, "json_schema_described") => vec![(
            RESPONSES,
            json!({"type": "json_schema", "name": "answer", "description": "The answer.", "schema": schema()}),
        )],
        (Api::OpenaiChat, "json_schema_unnamed") => {
            vec![(
                CHAT,
                json!({"type": "json_schema", "json_schema": named("response")}),
            )]
        }
        (Api::OpenaiResponses, "json_schema_unnamed") => {
            let mut format = named("response");
            format["type"] = json!("json_schema");
            vec![(RESPONSES, format)]
        }
        (Api::Gemini, "text") => vec![(MIME, json!("text/plain"))],
        (Api::Gemini, "json_object") => vec![(MIME, json!("application/json"))],
        (Api::Gemini, "json_schema" | "json_schema_unnamed") => {
            vec![(MIME, json!("application/json")), (JSON_SCHEMA, schema())]
        }
        (Api::Gemini, "gemini") => vec![
            (MIME, json!("application/json")),
            (
                SCHEMA,
                json!({"type": "OBJECT", "properties": {"answer": {"type": "STRING"}}}),
            ),
        ],
        _ => return None,
    })
}

fn at<'a>(body: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(body, |value, key| value.get(*key))
}

fn render_with(conversation: &Conversation, adapter: AdapterId, format: &Format) -> RenderOutcome {
    let validated = Validated::new(conversation).expect("test conversations are valid");
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).expect("test conversations are ready");
    let options = RenderOptions {
        output_format: OutputFormat {
            format: Some(format.clone()),
        },
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

fn rendered(outcome: RenderOutcome, what: &str) -> turnstile_adapters::Rendered {
    match outcome {
        RenderOutcome::Rendered(rendered) => rendered,
        other => panic!("{what}: {other:?}"),
    }
}

#[test]
fn every_output_format_goes_to_its_api_fields_or_is_refused_by_name() {
    let conversation = load("multi_round");
    for adapter in AdapterId::ALL {
        let api = adapter.api();
        let plain = rendered(crate::render_support::render_for(&conversation, adapter), "plain");
        let plain_value: Value = serde_json::from_slice(&plain.body).unwrap();
        for (case, format) in cases() {
            let outcome = render_with(&conversation, adapter, &format);
            match expected(api, case) {
                Some(fields) => {
                    let with = rendered(outcome, &format!("{adapter} × {case}"));
                    let mut value: Value = serde_json::from_slice(&with.body).unwrap();
                    for (path, want) in &fields {
                        assert_eq!(at(&value, path), Some(want), "{adapter} × {case}: {value}");
                    }
                    // Nothing else is written: remove what the table names and the plain body
                    // remains (Gemini's `generationConfig` keeps its other fields).
                    for (path, _) in &fields {
                        let (last, parents) = path.split_last().unwrap();
                        let mut parent = &mut value;
                        for key in parents {
                            parent = parent.get_mut(*key).unwrap();
                        }
                        parent.as_object_mut().unwrap().remove(*last);
                        // Responses' `text` holds only the format.
                        if parents == ["text"] && value["text"] == json!({}) {
                            value.as_object_mut().unwrap().remove("text");
                        }
                    }
                    assert_eq!(value, plain_value, "{adapter} × {case}");
                    assert_ne!(with.policy.digest(), plain.policy.digest(), "{adapter} × {case}");
                    assert!(with.prompt_tokens > plain.prompt_tokens, "{adapter} × {case}");
                }
                None => {
                    let RenderOutcome::RefusedOutputFormat(error) = outcome else {
                        panic!("{adapter} × {case}: expected a refusal, got {outcome:?}");
                    };
                    assert_eq!(
                        (error.code(), error.field()),
                        ("unsupported_setting", "output_format")
                    );
                }
            }
        }
    }
}

#[test]
fn what_a_renderer_writes_imports_back_to_the_same_output_format() {
    let conversation = load("multi_round");
    for adapter in AdapterId::ALL {
        let api = adapter.api();
        for (case, format) in cases() {
            if expected(api, case).is_none() {
                continue;
            }
            let with = rendered(render_with(&conversation, adapter, &format), case);
            let gemini = (api == Api::Gemini).then(|| GeminiCall {
                model: "gemini-2.5-pro".into(),
                stream: true,
            });
            let imported = import(api, &with.body, "c-1", gemini)
                .unwrap_or_else(|error| panic!("{adapter} × {case}: {error}"));
            let want = match (api, format.clone()) {
                // An unnamed schema gets OpenAI's required name, and comes back with it.
                (
                    Api::OpenaiChat | Api::OpenaiResponses,
                    Format::JsonSchema {
                        name: None,
                        description,
                        schema,
                        strict,
                    },
                ) => Format::JsonSchema {
                    name: Some("response".into()),
                    description,
                    schema,
                    strict,
                },
                // Gemini has no name, description or strict flag.
                (Api::Gemini, Format::JsonSchema { schema, .. }) => Format::JsonSchema {
                    name: None,
                    description: None,
                    schema,
                    strict: None,
                },
                (_, format) => format,
            };
            assert_eq!(imported.output_format.format, Some(want), "{adapter} × {case}");
            let output_fields = ["response_format", "text", "generationConfig"];
            assert!(
                !imported
                    .dropped
                    .iter()
                    .any(|dropped| output_fields.iter().any(|field| dropped.starts_with(field))),
                "{adapter} × {case}: {:?}",
                imported.dropped
            );
        }
    }
}

#[test]
fn an_anthropic_request_asking_for_structured_output_is_refused_on_import() {
    let request = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}],
                         "output_format": {"type": "json_schema", "schema": schema()}});
    let error = import(
        Api::AnthropicMessages,
        request.to_string().as_bytes(),
        "c-1",
        None,
    )
    .unwrap_err();
    assert_eq!((error.code(), error.path()), ("unrepresentable", "output_format"));
    let request = json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}});
    let error = import(Api::OpenaiChat, request.to_string().as_bytes(), "c-1", None).unwrap_err();
    assert_eq!(
        (error.code(), error.path()),
        ("invalid_request", "response_format.json_schema.schema")
    );
}

#[test]
fn rendered_openai_output_formats_conform_to_the_official_openapi_request_schemas() {
    use crate::render_openapi::{discriminated_one_of_as_any_of, spec_path, to_json, validator};
    let path = spec_path();
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!(
            "OpenAPI output-format conformance NOT RUN: {} is not present",
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
    let chat = validator(&spec, "CreateChatCompletionRequest");
    let responses = validator(&spec, "CreateResponse");
    let conversation = load("multi_round");
    let mut checked = 0;
    for adapter in [
        AdapterId::OpenaiChatV1,
        AdapterId::OpenaiChatV2,
        AdapterId::OpenaiResponsesV1,
    ] {
        let schema = if adapter == AdapterId::OpenaiResponsesV1 {
            &responses
        } else {
            &chat
        };
        for (case, format) in cases() {
            if expected(adapter.api(), case).is_none() {
                continue;
            }
            let with = rendered(render_with(&conversation, adapter, &format), case);
            let mut value: Value = serde_json::from_slice(&with.body).unwrap();
            let errors: Vec<String> = schema
                .iter_errors(&value)
                .map(|error| error.to_string())
                .collect();
            assert!(errors.is_empty(), "{adapter} × {case}: {errors:?}");
            checked += 1;
            // Control: the schema checks the format, so passing means something.
            if adapter == AdapterId::OpenaiResponsesV1 {
                value["text"]["format"]["type"] = json!(7);
            } else {
                value["response_format"]["type"] = json!(7);
            }
            assert!(
                !schema.is_valid(&value),
                "{adapter} × {case}: a broken format passes"
            );
        }
    }
    assert_eq!(checked, 3 * 5);
}
