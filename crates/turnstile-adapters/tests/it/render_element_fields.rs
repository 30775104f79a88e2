//! Client-only fields of single elements (`passthrough::ElementField`): a tool's `strict`, a
//! Chat message's `name`, an image's `detail`. Imported out of the dropped list, written back in
//! their place when the target speaks the client's API (and only there: a cached fragment never
//! carries them into another request), refused by their path towards another API, pinned by the
//! policy digest. Expected values are the ones the requests below send (OpenAI docs: `strict`,
//! `name` "to differentiate between participants of the same role", `detail` low/high/auto).

use crate::render_support::{model_for, tokenizer_for};
use serde_json::{Value, json};
use turnstile_adapters::AdapterId;
use turnstile_adapters::import::{Imported, import};
use turnstile_adapters::registry::Api;
use turnstile_adapters::render::{Graph, RenderCache, RenderOptions, RenderOutcome, Rendered, render};
use turnstile_core::conversation::Conversation;
use turnstile_core::{MessageSequence, Validated};

const IMAGE: &str = "data:image/png;base64,iVBORw0KGgo=";

fn chat_request() -> Value {
    json!({"model": "gpt-5", "messages": [
        {"role": "system", "name": "house-rules", "content": "Be brief."},
        {"role": "user", "name": "alice", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": IMAGE, "detail": "high"}},
            {"type": "image_url", "image_url": {"url": "https://example.com/b.png", "detail": "auto"}}
        ]},
        {"role": "assistant", "name": "helper", "content": "A cat."},
        {"role": "user", "content": "Look it up."}
    ], "tools": [
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object",
            "properties": {"q": {"type": "string"}}, "required": ["q"], "additionalProperties": false},
            "strict": true}},
        {"type": "function", "function": {"name": "plain", "parameters": {"type": "object"}, "strict": false}}
    ]})
}

fn responses_request() -> Value {
    json!({"model": "gpt-5", "input": [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What is in this picture?"},
            {"type": "input_image", "image_url": IMAGE, "detail": "low"},
            {"type": "input_image", "image_url": "https://example.com/b.png", "detail": "auto"}
        ]}
    ], "tools": [
        {"type": "function", "name": "lookup", "parameters": {"type": "object",
            "properties": {"q": {"type": "string"}}, "required": ["q"], "additionalProperties": false},
            "strict": true},
        {"type": "function", "name": "plain", "parameters": {"type": "object"}, "strict": false}
    ]})
}

fn imported(api: Api, body: &Value) -> Imported {
    let imported = import(api, body.to_string().as_bytes(), "c-1", None).unwrap();
    assert!(imported.dropped.is_empty(), "{api:?}: {:?}", imported.dropped);
    imported
}

fn render_imported(
    adapter: AdapterId,
    imported: &Imported,
    cache: &mut RenderCache,
    with_fields: bool,
) -> RenderOutcome {
    let conversation = Conversation::from_value(imported.document.clone()).unwrap();
    let validated = Validated::new(&conversation).unwrap();
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).unwrap();
    let options = RenderOptions {
        model: model_for(adapter).to_owned(),
        max_output_tokens: 1024,
        stream: true,
        background: false,
        text_content: Default::default(),
        sampling: imported.sampling.clone(),
        tool_choice: Default::default(),
        output_format: Default::default(),
        passthrough: if with_fields {
            imported.passthrough.clone()
        } else {
            Default::default()
        },
    };
    render(adapter, graph, &options, tokenizer_for(adapter), cache)
}

fn rendered(outcome: RenderOutcome) -> (Rendered, Value) {
    let RenderOutcome::Rendered(rendered) = outcome else {
        panic!("not rendered: {outcome:?}");
    };
    let value = serde_json::from_slice(&rendered.body).unwrap();
    (rendered, value)
}

fn chat_adapters() -> impl Iterator<Item = AdapterId> {
    AdapterId::ALL
        .into_iter()
        .filter(|adapter| adapter.api() == Api::OpenaiChat)
}

#[test]
fn chat_strict_name_and_detail_reach_a_chat_target_in_their_places() {
    let imported = imported(Api::OpenaiChat, &chat_request());
    for adapter in chat_adapters() {
        let (_, body) = rendered(render_imported(adapter, &imported, &mut RenderCache::new(), true));
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 4, "{adapter}: {body}");
        assert_eq!(messages[0]["name"], "house-rules", "{adapter}");
        assert_eq!(messages[1]["name"], "alice", "{adapter}");
        assert_eq!(messages[2]["name"], "helper", "{adapter}");
        assert!(messages[3].get("name").is_none(), "{adapter}: {body}");
        let parts = messages[1]["content"].as_array().unwrap();
        assert_eq!(
            parts[1]["image_url"],
            json!({"url": IMAGE, "detail": "high"}),
            "{adapter}"
        );
        // `auto` is the API's default: nothing to carry.
        assert_eq!(
            parts[2]["image_url"],
            json!({"url": "https://example.com/b.png"}),
            "{adapter}"
        );
        assert_eq!(body["tools"][0]["function"]["strict"], true, "{adapter}");
        assert!(
            body["tools"][1]["function"].get("strict").is_none(),
            "{adapter}: {body}"
        );
    }
}

#[test]
fn responses_strict_and_detail_reach_a_responses_target_in_their_places() {
    let imported = imported(Api::OpenaiResponses, &responses_request());
    let (_, body) = rendered(render_imported(
        AdapterId::OpenaiResponsesV1,
        &imported,
        &mut RenderCache::new(),
        true,
    ));
    let parts = body["input"][0]["content"].as_array().unwrap();
    assert_eq!(parts[1]["detail"], "low", "{body}");
    assert_eq!(parts[2]["detail"], "auto", "{body}");
    assert_eq!(body["tools"][0]["strict"], true, "{body}");
    assert_eq!(body["tools"][1]["strict"], false, "{body}");
}

/// The rendered image `detail` and `strict` flag of the first image and tool.
fn image_detail_and_strict(api: Api, body: &Value) -> (Value, Value) {
    match api {
        Api::OpenaiChat => (
            body["messages"][1]["content"][1]["image_url"]["detail"].clone(),
            body["tools"][0]["function"]["strict"].clone(),
        ),
        _ => (
            body["input"][0]["content"][1]["detail"].clone(),
            body["tools"][0]["strict"].clone(),
        ),
    }
}

#[test]
fn a_cached_fragment_never_carries_one_requests_element_fields_into_another() {
    for (api, adapter, body, detail, plain_detail, plain_strict) in [
        (
            Api::OpenaiChat,
            AdapterId::OpenaiChatV2,
            chat_request(),
            "high",
            Value::Null,
            Value::Null,
        ),
        (
            Api::OpenaiResponses,
            AdapterId::OpenaiResponsesV1,
            responses_request(),
            "low",
            json!("auto"),
            json!(false),
        ),
    ] {
        let imported = imported(api, &body);
        // Each order, on one cache: what the first render cached must not reach the second.
        for carried_first in [true, false] {
            let mut cache = RenderCache::new();
            let (_, first) = rendered(render_imported(adapter, &imported, &mut cache, carried_first));
            let (_, second) = rendered(render_imported(adapter, &imported, &mut cache, !carried_first));
            let (carried, plain) = if carried_first {
                (first, second)
            } else {
                (second, first)
            };
            assert_eq!(
                image_detail_and_strict(api, &carried),
                (json!(detail), json!(true)),
                "{adapter}"
            );
            assert_eq!(
                image_detail_and_strict(api, &plain),
                (plain_detail.clone(), plain_strict.clone()),
                "{adapter}"
            );
        }
        let mut cache = RenderCache::new();
        // Plain first (fills the cache), then with the fields, then plain again.
        let (plain, plain_body) = rendered(render_imported(adapter, &imported, &mut cache, false));
        let (carried, carried_body) = rendered(render_imported(adapter, &imported, &mut cache, true));
        let (again, again_body) = rendered(render_imported(adapter, &imported, &mut cache, false));
        assert_ne!(plain_body, carried_body, "{adapter}");
        assert_eq!(plain_body, again_body, "{adapter}");
        assert_eq!(plain.body, again.body, "{adapter}");
        // The render policy pins them.
        assert_ne!(plain.policy.digest(), carried.policy.digest(), "{adapter}");
        assert_eq!(plain.policy.digest(), again.policy.digest(), "{adapter}");
    }
}

#[test]
fn element_fields_towards_another_api_are_refused_by_the_clients_path() {
    // Each field alone, so each refusal is seen.
    let user = |content: Value| json!({"role": "user", "content": content});
    let chat_cases = [
        (
            json!({"model": "gpt-5", "messages": [user(json!("Hi"))], "tools": [
                {"type": "function", "function": {"name": "t", "parameters": {"type": "object"}, "strict": true}}]}),
            "tools[].function.strict",
        ),
        (
            json!({"model": "gpt-5", "messages": [{"role": "user", "name": "alice", "content": "Hi"}]}),
            "messages[].name",
        ),
        (
            json!({"model": "gpt-5", "messages": [user(json!([
                {"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}}]))]}),
            "messages[].content[].image_url.detail",
        ),
    ];
    let responses_cases = [
        (
            json!({"model": "gpt-5", "input": "Hi", "tools": [
                {"type": "function", "name": "t", "parameters": {"type": "object"}, "strict": true}]}),
            "tools[].strict",
        ),
        (
            json!({"model": "gpt-5", "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": IMAGE, "detail": "high"}]}]}),
            "input[].content[].detail",
        ),
    ];
    let cases = chat_cases
        .into_iter()
        .map(|(body, field)| (Api::OpenaiChat, body, field))
        .chain(
            responses_cases
                .into_iter()
                .map(|(body, field)| (Api::OpenaiResponses, body, field)),
        );
    let mut refused = 0;
    for (api, body, field) in cases {
        let imported = imported(api, &body);
        for adapter in AdapterId::ALL.into_iter().filter(|adapter| adapter.api() != api) {
            let outcome = render_imported(adapter, &imported, &mut RenderCache::new(), true);
            let RenderOutcome::RefusedPassthrough(error) = outcome else {
                panic!("{api:?} → {adapter}: {field} not refused: {outcome:?}");
            };
            assert_eq!(error.code(), "unsupported_setting");
            assert_eq!(error.field(), field, "{api:?} → {adapter}");
            refused += 1;
        }
        // Same API it renders.
        for adapter in AdapterId::ALL.into_iter().filter(|adapter| adapter.api() == api) {
            rendered(render_imported(adapter, &imported, &mut RenderCache::new(), true));
        }
    }
    assert!(refused >= 5 * 3, "{refused}");
}

#[test]
fn an_unknown_image_detail_or_one_on_a_tool_output_image_is_refused_at_import() {
    let chat = json!({"model": "gpt-5", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": IMAGE, "detail": "ultra"}}]}]});
    let error = import(Api::OpenaiChat, chat.to_string().as_bytes(), "c-1", None).unwrap_err();
    assert_eq!(error.code(), "invalid_request");
    assert_eq!(error.path(), "messages[0].content[0].image_url.detail");
    let responses = json!({"model": "gpt-5", "input": [
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_image", "image_url": IMAGE, "detail": "high"}]}]});
    let error = import(
        Api::OpenaiResponses,
        responses.to_string().as_bytes(),
        "c-1",
        None,
    )
    .unwrap_err();
    assert_eq!(error.code(), "unrepresentable");
    assert_eq!(error.path(), "input[1].output[0].detail");
}

#[test]
fn rendered_element_fields_conform_to_the_official_openapi_request_schemas() {
    use crate::render_openapi::{discriminated_one_of_as_any_of, spec_path, to_json, validator};
    let text = std::fs::read_to_string(spec_path()).expect("the OpenAPI spec (TURNSTILE_SHARED)");
    let text = text
        .replace("-9223372036854776000", "-9223372036854775808")
        .replace("9223372036854776000", "9223372036854775807");
    let yaml: serde_yaml::Value = serde_yaml::from_str(&text).expect("the OpenAPI spec is YAML");
    let mut spec = to_json(yaml);
    discriminated_one_of_as_any_of(&mut spec);
    let chat = validator(&spec, "CreateChatCompletionRequest");
    let responses = validator(&spec, "CreateResponse");
    let imported_chat = imported(Api::OpenaiChat, &chat_request());
    for adapter in chat_adapters() {
        let (_, mut body) = rendered(render_imported(
            adapter,
            &imported_chat,
            &mut RenderCache::new(),
            true,
        ));
        let errors: Vec<String> = chat.iter_errors(&body).map(|error| error.to_string()).collect();
        assert!(errors.is_empty(), "{adapter}: {errors:?}");
        // Control: the schema checks the field.
        body["messages"][1]["content"][1]["image_url"]["detail"] = json!("ultra");
        assert!(!chat.is_valid(&body), "{adapter}");
    }
    let imported_responses = imported(Api::OpenaiResponses, &responses_request());
    let (_, mut body) = rendered(render_imported(
        AdapterId::OpenaiResponsesV1,
        &imported_responses,
        &mut RenderCache::new(),
        true,
    ));
    let errors: Vec<String> = responses
        .iter_errors(&body)
        .map(|error| error.to_string())
        .collect();
    assert!(errors.is_empty(), "{errors:?}");
    body["tools"][0]["strict"] = json!("yes");
    assert!(!responses.is_valid(&body));
}
