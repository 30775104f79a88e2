//! Conformance of rendered OpenAI bodies with OpenAI's official OpenAPI spec
//! (`shared/fixtures/openapi/openai-openapi.yaml`, read from `$TURNSTILE_SHARED` or
//! `../shared`, never copied into this repo): `CreateChatCompletionRequest` for both Chat
//! versions and `CreateResponse` for Responses, over every scenario and random graphs, each
//! rendered without generation settings, with every setting the API takes, at the edges of the
//! documented ranges, and with random settings.
//! When the spec is not present the test says so plainly on stderr and checks nothing else.

use crate::render_props::{Gen, conversation as random_conversation};
use crate::render_sampling::{full_sampling, random_sampling};
use crate::render_support::{SCENARIOS, load, render_sampled};
use serde_json::Value;
use turnstile_adapters::registry::Api;
use turnstile_adapters::render::RenderOutcome;
use turnstile_adapters::{AdapterId, Sampling};
use turnstile_core::parse;

pub fn spec_path() -> std::path::PathBuf {
    let shared = std::env::var_os("TURNSTILE_SHARED")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    shared.join("fixtures/openapi/openai-openapi.yaml")
}

/// YAML → JSON. Integers beyond i64/u64 (the spec has `seed.minimum` at −2^63 written as a
/// decimal that overflows) become floats, as a JSON parser would read them.
pub fn to_json(value: serde_yaml::Value) -> Value {
    match value {
        serde_yaml::Value::Null => Value::Null,
        serde_yaml::Value::Bool(flag) => Value::Bool(flag),
        serde_yaml::Value::Number(number) => {
            if let Some(integer) = number.as_i64() {
                Value::from(integer)
            } else if let Some(integer) = number.as_u64() {
                Value::from(integer)
            } else {
                number
                    .as_f64()
                    .and_then(serde_json::Number::from_f64)
                    .map_or(Value::Null, Value::Number)
            }
        }
        serde_yaml::Value::String(text) => Value::String(text),
        serde_yaml::Value::Sequence(items) => Value::Array(items.into_iter().map(to_json).collect()),
        serde_yaml::Value::Mapping(map) => Value::Object(
            map.into_iter()
                .map(|(key, value)| {
                    let key = match key {
                        serde_yaml::Value::String(text) => text,
                        other => serde_yaml::to_string(&other)
                            .unwrap_or_default()
                            .trim()
                            .to_owned(),
                    };
                    (key, to_json(value))
                })
                .collect(),
        ),
        serde_yaml::Value::Tagged(tagged) => to_json(tagged.value),
    }
}

/// OpenAPI `oneOf` + `discriminator` picks the variant by its `type` property; JSON Schema's
/// `oneOf` instead demands that exactly one variant match, and `InputItem` lists overlapping
/// variants (`EasyInputMessage` and `Item` → `InputMessage` both accept a user message). So a
/// discriminated `oneOf` is checked as `anyOf`: the item must still match a variant in full.
pub fn discriminated_one_of_as_any_of(value: &mut Value) {
    match value {
        Value::Object(map) => {
            if map.contains_key("discriminator") {
                if let Some(variants) = map.remove("oneOf") {
                    map.insert("anyOf".into(), variants);
                }
            }
            map.values_mut().for_each(discriminated_one_of_as_any_of);
        }
        Value::Array(items) => items.iter_mut().for_each(discriminated_one_of_as_any_of),
        _ => {}
    }
}

/// No settings, every setting the API takes, the edges of its documented ranges, and a random
/// set.
fn samplings(api: Api, g: &mut Gen) -> Vec<Sampling> {
    let mut all = vec![
        Sampling::default(),
        full_sampling(api),
        Sampling {
            temperature: Some(2.0),
            top_p: Some(0.0),
            ..Sampling::default()
        },
        Sampling {
            temperature: Some(0.0),
            top_p: Some(1.0),
            ..Sampling::default()
        },
    ];
    if api == Api::OpenaiChat {
        all.push(Sampling {
            stop: vec!["a".into(), "\n".into(), "</s>".into(), "".into()],
            seed: Some(i64::MIN),
            presence_penalty: Some(-2.0),
            frequency_penalty: Some(2.0),
            ..Sampling::default()
        });
        all.push(Sampling {
            stop: vec!["only".into()],
            seed: Some(i64::MAX),
            presence_penalty: Some(2.0),
            frequency_penalty: Some(-2.0),
            ..Sampling::default()
        });
    }
    all.push(random_sampling(api, g));
    all
}

pub fn validator(spec: &Value, schema: &str) -> jsonschema::Validator {
    let mut root = spec.clone();
    root["$ref"] = Value::String(format!("#/components/schemas/{schema}"));
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .should_validate_formats(false)
        .build(&root)
        .unwrap_or_else(|error| panic!("{schema} does not compile: {error}"))
}

#[test]
fn rendered_openai_bodies_conform_to_the_official_openapi_request_schemas() {
    let path = spec_path();
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!(
            "OpenAPI conformance NOT RUN: {} is not present (set TURNSTILE_SHARED)",
            path.display()
        );
        return;
    };
    // The spec writes `seed` bounds as ±9223372036854776000 (2^63 rounded by a float
    // printer), which no YAML integer type holds; read them as the i64 bounds they mean.
    let text = text
        .replace("-9223372036854776000", "-9223372036854775808")
        .replace("9223372036854776000", "9223372036854775807");
    let yaml: serde_yaml::Value = serde_yaml::from_str(&text).expect("the OpenAPI spec is YAML");
    let mut spec = to_json(yaml);
    discriminated_one_of_as_any_of(&mut spec);
    let chat = validator(&spec, "CreateChatCompletionRequest");
    let responses = validator(&spec, "CreateResponse");
    let mut conversations: Vec<(String, turnstile_core::conversation::Conversation)> = SCENARIOS
        .iter()
        .map(|name| (name.to_string(), load(name)))
        .collect();
    for seed in 0..24 {
        let value = random_conversation(seed * 7919 + 1, seed % 2 == 0);
        conversations.push((
            format!("random {seed}"),
            parse::conversation_from_slice(&serde_json::to_vec(&value).unwrap()).unwrap(),
        ));
    }
    let mut failures = Vec::new();
    let mut checked = 0;
    let mut g = Gen::new(0x0A11_5E77_1265);
    for (name, conversation) in &conversations {
        for adapter in [
            AdapterId::OpenaiChatV1,
            AdapterId::OpenaiChatV2,
            AdapterId::OpenaiResponsesV1,
        ] {
            for sampling in samplings(adapter.api(), &mut g) {
                let RenderOutcome::Rendered(rendered) = render_sampled(conversation, adapter, &sampling)
                else {
                    continue;
                };
                let body: Value = serde_json::from_slice(&rendered.body).unwrap();
                let validator = if adapter == AdapterId::OpenaiResponsesV1 {
                    &responses
                } else {
                    &chat
                };
                for error in validator.iter_errors(&body) {
                    failures.push(format!(
                        "{name} × {adapter} × {sampling:?}: {} at {}",
                        error,
                        error.instance_path()
                    ));
                }
                checked += 1;
            }
        }
    }
    eprintln!(
        "OpenAPI conformance: {checked} bodies checked against {}",
        path.display()
    );
    assert!(checked > 360);
    failures.truncate(40);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Control: the schemas do check the settings' ranges, so passing above means something.
    let conversation = load("consecutive_user");
    for (adapter, field, value) in [
        (AdapterId::OpenaiChatV2, "temperature", serde_json::json!(2.5)),
        (
            AdapterId::OpenaiChatV2,
            "stop",
            serde_json::json!(["1", "2", "3", "4", "5"]),
        ),
        (AdapterId::OpenaiChatV1, "presence_penalty", serde_json::json!(-3)),
        (AdapterId::OpenaiResponsesV1, "top_p", serde_json::json!(1.5)),
    ] {
        let RenderOutcome::Rendered(rendered) = render_sampled(&conversation, adapter, &Sampling::default())
        else {
            panic!("{adapter} renders");
        };
        let mut body: Value = serde_json::from_slice(&rendered.body).unwrap();
        body[field] = value;
        let validator = if adapter == AdapterId::OpenaiResponsesV1 {
            &responses
        } else {
            &chat
        };
        assert!(
            !validator.is_valid(&body),
            "{adapter}: {field} out of range passes the schema"
        );
    }
}
