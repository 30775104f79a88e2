//! Tool choice and parallel tool calls on the render and import sides. Every adapter writes
//! every choice its API can spell in the API's own field and shape, checked against an
//! expectation table written here from the provider docs (not read from `tool_choice.rs`); a
//! choice the API cannot spell is refused naming the field, never left out or approximated; a
//! choice naming an undeclared tool is refused; what the renderer writes imports back to the
//! same value (same API: carried exactly); nothing set renders the bytes and policy of a
//! request without a tool choice, and a choice is pinned by the policy digest.

use crate::render_support::{load, options_for, tokenizer_for};
use serde_json::{Value, json};
use turnstile_adapters::import::{GeminiCall, import};
use turnstile_adapters::registry::Api;
use turnstile_adapters::render::{Graph, RenderCache, RenderOptions, RenderOutcome, render};
use turnstile_adapters::tool_choice::{AllowedMode, Choice, Field, Kind, ToolChoice};
use turnstile_adapters::{AdapterId, ToolChoiceError};
use turnstile_core::conversation::Conversation;
use turnstile_core::{MessageSequence, Validated};

/// The scenario used: it declares `get_weather` and `search`.
const SCENARIO: &str = "multi_round";

fn cases() -> Vec<(&'static str, ToolChoice)> {
    let choice = |choice: Choice| ToolChoice {
        tool_choice: Some(choice),
        parallel_tool_calls: None,
    };
    let both = vec!["get_weather".to_owned(), "search".to_owned()];
    vec![
        ("auto", choice(Choice::Auto)),
        ("none", choice(Choice::None)),
        ("required", choice(Choice::Required)),
        (
            "tool",
            choice(Choice::Tool {
                name: "search".into(),
            }),
        ),
        (
            "allowed_required",
            choice(Choice::Allowed {
                mode: AllowedMode::Required,
                tools: both.clone(),
            }),
        ),
        (
            "allowed_auto",
            choice(Choice::Allowed {
                mode: AllowedMode::Auto,
                tools: both.clone(),
            }),
        ),
        ("validated", choice(Choice::Validated { tools: Vec::new() })),
        (
            "parallel_off",
            ToolChoice {
                tool_choice: None,
                parallel_tool_calls: Some(false),
            },
        ),
        (
            "tool_parallel_on",
            ToolChoice {
                tool_choice: Some(Choice::Tool {
                    name: "get_weather".into(),
                }),
                parallel_tool_calls: Some(true),
            },
        ),
    ]
}

/// What each API's body holds for each case: the top-level fields (and their values) beside
/// the request's others, or the field refused. From the providers' documentation:
/// OpenAI `ChatCompletionToolChoiceOption`, `ToolChoiceParam`, `parallel_tool_calls`
/// (<https://platform.openai.com/docs/api-reference/chat/create>, `…/responses/create>`);
/// Anthropic <https://platform.claude.com/docs/en/agents-and-tools/tool-use/implement-tool-use>
/// (`tool_choice` auto / any / tool / none, `disable_parallel_tool_use`); Gemini
/// <https://ai.google.dev/gemini-api/docs/function-calling> (`tool_config.function_calling_config`,
/// modes AUTO / ANY / NONE / VALIDATED, `allowed_function_names`).
fn expected(api: Api, case: &str) -> Result<Vec<(&'static str, Value)>, &'static str> {
    let chat_function = |name: &str| json!({"type": "function", "function": {"name": name}});
    let responses_function = |name: &str| json!({"type": "function", "name": name});
    let gemini = |config: Value| Ok(vec![("toolConfig", json!({"functionCallingConfig": config}))]);
    match (api, case) {
        (Api::OpenaiChat | Api::OpenaiResponses, "auto") => Ok(vec![("tool_choice", json!("auto"))]),
        (Api::OpenaiChat | Api::OpenaiResponses, "none") => Ok(vec![("tool_choice", json!("none"))]),
        (Api::OpenaiChat | Api::OpenaiResponses, "required") => Ok(vec![("tool_choice", json!("required"))]),
        (Api::OpenaiChat, "tool") => Ok(vec![("tool_choice", chat_function("search"))]),
        (Api::OpenaiResponses, "tool") => Ok(vec![("tool_choice", responses_function("search"))]),
        (Api::OpenaiChat, "allowed_required" | "allowed_auto") => Ok(vec![(
            "tool_choice",
            json!({"type": "allowed_tools", "allowed_tools": {
                "mode": if case == "allowed_auto" { "auto" } else { "required" },
                "tools": [chat_function("get_weather"), chat_function("search")]}}),
        )]),
        (Api::OpenaiResponses, "allowed_required" | "allowed_auto") => Ok(vec![(
            "tool_choice",
            json!({"type": "allowed_tools", "mode": if case == "allowed_auto" { "auto" } else { "required" },
                   "tools": [responses_function("get_weather"), responses_function("search")]}),
        )]),
        (Api::OpenaiChat | Api::OpenaiResponses, "parallel_off") => {
            Ok(vec![("parallel_tool_calls", json!(false))])
        }
        (Api::OpenaiChat, "tool_parallel_on") => Ok(vec![
            ("tool_choice", chat_function("get_weather")),
            ("parallel_tool_calls", json!(true)),
        ]),
        (Api::OpenaiResponses, "tool_parallel_on") => Ok(vec![
            ("tool_choice", responses_function("get_weather")),
            ("parallel_tool_calls", json!(true)),
        ]),
        (Api::OpenaiChat | Api::OpenaiResponses, "validated") => Err("tool_choice"),
        (Api::AnthropicMessages, "auto") => Ok(vec![("tool_choice", json!({"type": "auto"}))]),
        (Api::AnthropicMessages, "none") => Ok(vec![("tool_choice", json!({"type": "none"}))]),
        (Api::AnthropicMessages, "required") => Ok(vec![("tool_choice", json!({"type": "any"}))]),
        (Api::AnthropicMessages, "tool") => {
            Ok(vec![("tool_choice", json!({"type": "tool", "name": "search"}))])
        }
        (Api::AnthropicMessages, "parallel_off") => Ok(vec![(
            "tool_choice",
            json!({"type": "auto", "disable_parallel_tool_use": true}),
        )]),
        (Api::AnthropicMessages, "tool_parallel_on") => Ok(vec![(
            "tool_choice",
            json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": false}),
        )]),
        (Api::AnthropicMessages, _) => Err("tool_choice"),
        (Api::Gemini, "auto") => gemini(json!({"mode": "AUTO"})),
        (Api::Gemini, "none") => gemini(json!({"mode": "NONE"})),
        (Api::Gemini, "required") => gemini(json!({"mode": "ANY"})),
        (Api::Gemini, "tool") => gemini(json!({"mode": "ANY", "allowedFunctionNames": ["search"]})),
        (Api::Gemini, "allowed_required") => {
            gemini(json!({"mode": "ANY", "allowedFunctionNames": ["get_weather", "search"]}))
        }
        (Api::Gemini, "validated") => gemini(json!({"mode": "VALIDATED"})),
        (Api::Gemini, "parallel_off" | "tool_parallel_on") => Err("parallel_tool_calls"),
        (Api::Gemini, _) => Err("tool_choice"),
        _ => panic!("no expectation for {api:?} × {case}"),
    }
}

/// The fields a request without a tool choice never has.
const CHOICE_FIELDS: &[&str] = &["tool_choice", "parallel_tool_calls", "toolConfig"];

fn render_with(conversation: &Conversation, adapter: AdapterId, tool_choice: &ToolChoice) -> RenderOutcome {
    let validated = Validated::new(conversation).expect("test conversations are valid");
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).expect("test conversations are ready");
    let options = RenderOptions {
        tool_choice: tool_choice.clone(),
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

fn body(outcome: RenderOutcome, what: &str) -> (Vec<u8>, Value) {
    match outcome {
        RenderOutcome::Rendered(rendered) => {
            let value = serde_json::from_slice(&rendered.body).unwrap();
            (rendered.body, value)
        }
        other => panic!("{what}: {other:?}"),
    }
}

#[test]
fn every_tool_choice_goes_to_its_api_field_or_is_refused_by_name() {
    let conversation = load(SCENARIO);
    for adapter in AdapterId::ALL {
        let api = adapter.api();
        let (_, plain) = body(
            render_with(&conversation, adapter, &ToolChoice::default()),
            "plain",
        );
        for field in CHOICE_FIELDS {
            assert!(
                plain.get(field).is_none(),
                "{adapter}: {field} without a choice: {plain}"
            );
        }
        for (case, tool_choice) in cases() {
            let outcome = render_with(&conversation, adapter, &tool_choice);
            match expected(api, case) {
                Ok(fields) => {
                    let (_, value) = body(outcome, &format!("{adapter} × {case}"));
                    for field in CHOICE_FIELDS {
                        let want = fields
                            .iter()
                            .find(|(name, _)| name == field)
                            .map(|(_, value)| value);
                        assert_eq!(value.get(field), want, "{adapter} × {case}: {field} in {value}");
                    }
                    // Nothing else moved: the body is the plain one plus these fields.
                    let mut rest = value.clone();
                    for field in CHOICE_FIELDS {
                        rest.as_object_mut().unwrap().remove(*field);
                    }
                    assert_eq!(rest, plain, "{adapter} × {case}");
                }
                Err(field) => {
                    let RenderOutcome::RefusedToolChoice(error) = outcome else {
                        panic!("{adapter} × {case}: expected a refusal of {field}, got {outcome:?}");
                    };
                    assert_eq!(error.code(), "unsupported_setting", "{adapter} × {case}");
                    assert_eq!(error.field().as_str(), field, "{adapter} × {case}");
                }
            }
        }
    }
}

#[test]
fn the_module_table_agrees_with_the_expectation_table() {
    // `takes` is what the gateway documents; it must say what the renderers do.
    for api in [
        Api::OpenaiChat,
        Api::OpenaiResponses,
        Api::AnthropicMessages,
        Api::Gemini,
    ] {
        for (case, kind) in [
            ("auto", Kind::Auto),
            ("none", Kind::None),
            ("required", Kind::Required),
            ("tool", Kind::Tool),
            ("allowed_required", Kind::AllowedRequired),
            ("allowed_auto", Kind::AllowedAuto),
            ("validated", Kind::Validated),
            ("parallel_off", Kind::Parallel),
        ] {
            assert_eq!(
                turnstile_adapters::tool_choice::takes(api, kind),
                expected(api, case).is_ok(),
                "{api:?} × {kind:?}"
            );
        }
    }
}

#[test]
fn a_choice_naming_an_undeclared_tool_is_refused_for_every_adapter() {
    let conversation = load(SCENARIO);
    for adapter in AdapterId::ALL {
        let tool_choice = ToolChoice {
            tool_choice: Some(Choice::Tool {
                name: "launch_rockets".into(),
            }),
            parallel_tool_calls: None,
        };
        let outcome = render_with(&conversation, adapter, &tool_choice);
        assert_eq!(
            outcome,
            RenderOutcome::RefusedToolChoice(ToolChoiceError::UnknownTool {
                name: "launch_rockets".into()
            }),
            "{adapter}"
        );
        assert_eq!(
            ToolChoiceError::UnknownTool { name: String::new() }.field(),
            Field::ToolChoice
        );
    }
}

fn gemini_call(api: Api) -> Option<GeminiCall> {
    (api == Api::Gemini).then(|| GeminiCall {
        model: "gemini-2.5-pro".into(),
        stream: true,
    })
}

#[test]
fn what_a_renderer_writes_imports_back_to_the_same_tool_choice() {
    let conversation = load(SCENARIO);
    for adapter in AdapterId::ALL {
        let api = adapter.api();
        for (case, tool_choice) in cases() {
            if expected(api, case).is_err() {
                continue;
            }
            let (bytes, _) = body(render_with(&conversation, adapter, &tool_choice), case);
            let imported = import(api, &bytes, "c-1", gemini_call(api))
                .unwrap_or_else(|error| panic!("{adapter} × {case}: {error}"));
            let want = match (api, case) {
                // Anthropic has no parallel switch without a choice: `auto` is its default
                // with tools, and it is what the renderer wrote.
                (Api::AnthropicMessages, "parallel_off") => ToolChoice {
                    tool_choice: Some(Choice::Auto),
                    parallel_tool_calls: Some(false),
                },
                _ => tool_choice.clone(),
            };
            assert_eq!(imported.tool_choice, want, "{adapter} × {case}");
            for field in CHOICE_FIELDS {
                assert!(
                    !imported.dropped.iter().any(|dropped| dropped.starts_with(field)),
                    "{adapter} × {case}: {:?}",
                    imported.dropped
                );
            }
        }
    }
}

#[test]
fn tool_choice_spellings_the_api_does_not_document_are_refused_on_import() {
    let messages = json!([{"role": "user", "content": "Hi"}]);
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let cases: Vec<(Api, Value, &str, &str)> = vec![
        (
            Api::OpenaiChat,
            json!({"model": "m", "messages": messages, "tools": tools, "tool_choice": "sometimes"}),
            "invalid_request",
            "tool_choice",
        ),
        (
            Api::OpenaiChat,
            json!({"model": "m", "messages": messages, "tools": tools,
                   "tool_choice": {"type": "custom", "custom": {"name": "f"}}}),
            "unrepresentable",
            "tool_choice.type",
        ),
        (
            Api::OpenaiChat,
            json!({"model": "m", "messages": messages, "tools": tools,
                   "tool_choice": {"type": "function", "function": {"name": "f"}, "extra": 1}}),
            "invalid_request",
            "tool_choice.extra",
        ),
        (
            Api::OpenaiChat,
            json!({"model": "m", "messages": messages, "parallel_tool_calls": "no"}),
            "invalid_request",
            "parallel_tool_calls",
        ),
        (
            Api::OpenaiResponses,
            json!({"model": "m", "input": "Hi", "tool_choice": {"type": "web_search_preview"}}),
            "unrepresentable",
            "tool_choice.type",
        ),
        (
            Api::AnthropicMessages,
            json!({"model": "m", "max_tokens": 5, "messages": messages,
                   "tool_choice": {"type": "none", "disable_parallel_tool_use": true}}),
            "invalid_request",
            "tool_choice.disable_parallel_tool_use",
        ),
        (
            Api::AnthropicMessages,
            json!({"model": "m", "max_tokens": 5, "messages": messages, "tool_choice": {"type": "tool"}}),
            "invalid_request",
            "tool_choice.name",
        ),
        (
            Api::Gemini,
            json!({"contents": [{"role": "user", "parts": [{"text": "Hi"}]}],
                   "toolConfig": {"functionCallingConfig": {"mode": "AUTO", "allowedFunctionNames": ["f"]}}}),
            "invalid_request",
            "toolConfig.functionCallingConfig.allowedFunctionNames",
        ),
        (
            Api::Gemini,
            json!({"contents": [{"role": "user", "parts": [{"text": "Hi"}]}],
                   "tool_config": {"function_calling_config": {"mode": "SOMETIMES"}}}),
            "invalid_request",
            "toolConfig.functionCallingConfig.mode",
        ),
    ];
    for (api, request, code, path) in cases {
        let error = import(api, request.to_string().as_bytes(), "c-1", gemini_call(api))
            .expect_err(&format!("{request}"));
        assert_eq!((error.code(), error.path()), (code, path), "{request}: {error}");
    }
}

#[test]
fn a_tool_choice_is_pinned_by_the_policy_and_unset_changes_nothing() {
    let conversation = load(SCENARIO);
    for adapter in AdapterId::ALL {
        let plain = render_with(&conversation, adapter, &ToolChoice::default());
        let RenderOutcome::Rendered(plain) = plain else {
            panic!("{adapter}: {plain:?}");
        };
        let reference = crate::render_support::render_for(&conversation, adapter);
        let RenderOutcome::Rendered(reference) = reference else {
            panic!("{adapter}: {reference:?}");
        };
        assert_eq!(plain.body, reference.body, "{adapter}");
        assert_eq!(plain.policy.digest(), reference.policy.digest(), "{adapter}");
        let forced = ToolChoice {
            tool_choice: Some(Choice::Required),
            parallel_tool_calls: None,
        };
        let RenderOutcome::Rendered(with) = render_with(&conversation, adapter, &forced) else {
            panic!("{adapter}: required refused");
        };
        assert_ne!(with.policy.digest(), plain.policy.digest(), "{adapter}");
        let policy = serde_json::to_value(&with.policy).unwrap();
        assert_eq!(
            policy["tool_choice"],
            json!({"type": "required"}),
            "{adapter}: {policy}"
        );
        assert!(
            with.prompt_tokens > plain.prompt_tokens,
            "{adapter}: the choice is counted"
        );
    }
}

#[test]
fn rendered_openai_tool_choices_conform_to_the_official_openapi_request_schemas() {
    use crate::render_openapi::{discriminated_one_of_as_any_of, spec_path, to_json, validator};
    let path = spec_path();
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!(
            "OpenAPI tool-choice conformance NOT RUN: {} is not present (set TURNSTILE_SHARED)",
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
    let conversation = load(SCENARIO);
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
        for (case, tool_choice) in cases() {
            if expected(adapter.api(), case).is_err() {
                continue;
            }
            let (_, mut value) = body(render_with(&conversation, adapter, &tool_choice), case);
            let errors: Vec<String> = schema
                .iter_errors(&value)
                .map(|error| error.to_string())
                .collect();
            assert!(errors.is_empty(), "{adapter} × {case}: {errors:?}");
            checked += 1;
            // Control: the schema does check `tool_choice`, so passing means something.
            value["tool_choice"] = json!({"type": "function", "function": 7, "name": 7});
            assert!(
                !schema.is_valid(&value),
                "{adapter} × {case}: a broken choice passes"
            );
        }
    }
    assert_eq!(checked, 3 * 8);
}
