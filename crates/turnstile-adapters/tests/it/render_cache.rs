//! Prompt-cache breakpoints (`cache.rs`): imported from Anthropic's per-block `cache_control`
//! onto the v1 blocks and tools they mark, kept out of every content digest, written back in
//! place towards Anthropic, turned into a stable `prompt_cache_key` towards OpenAI, left out
//! (and reported) towards Gemini, and pinned by the policy digest. Expectations are written
//! here from Anthropic's prompt-caching guide and OpenAI's API reference, not read from the
//! module.

use crate::render_support::{options_for, tokenizer_for};
use serde_json::{Value, json};
use turnstile_adapters::AdapterId;
use turnstile_adapters::import::import;
use turnstile_adapters::passthrough::Passthrough;
use turnstile_adapters::registry::Api;
use turnstile_adapters::render::{Graph, RenderCache, RenderOptions, RenderOutcome, Rendered, render};
use turnstile_core::conversation::Conversation;
use turnstile_core::{MessageSequence, Validated};

const EPHEMERAL: &str = "ephemeral";

/// An Anthropic tool loop with a breakpoint on the tool, the system prompt, the first user
/// block (one hour) and the tool result's last part.
fn anthropic_request() -> Value {
    json!({
        "model": "claude-sonnet-4-5", "max_tokens": 512,
        "tools": [{"name": "get_weather", "description": "Weather", "cache_control": {"type": EPHEMERAL},
                   "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": EPHEMERAL}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "A long document …", "cache_control": {"type": EPHEMERAL, "ttl": "1h"}},
                {"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "8C"}, {"type": "text", "text": "rain", "cache_control": {"type": EPHEMERAL}}]}]}
        ]
    })
}

fn imported(body: &Value) -> (Value, Passthrough) {
    let imported = import(
        Api::AnthropicMessages,
        body.to_string().as_bytes(),
        "c-cache",
        None,
    )
    .unwrap();
    assert!(imported.dropped.is_empty(), "{:?}", imported.dropped);
    (imported.document, imported.passthrough)
}

fn conversation(document: &Value) -> Conversation {
    Conversation::from_value(document.clone()).unwrap()
}

fn render_doc(
    conversation: &Conversation,
    adapter: AdapterId,
    passthrough: &Passthrough,
    cache: &mut RenderCache,
) -> RenderOutcome {
    let validated = Validated::new(conversation).unwrap();
    let sequence = MessageSequence::build(validated);
    let graph = Graph::new(validated, &sequence).unwrap();
    let options = RenderOptions {
        passthrough: passthrough.clone(),
        ..options_for(adapter)
    };
    render(adapter, graph, &options, tokenizer_for(adapter), cache)
}

fn rendered(conversation: &Conversation, adapter: AdapterId) -> Rendered {
    match render_doc(
        conversation,
        adapter,
        &Passthrough::default(),
        &mut RenderCache::new(),
    ) {
        RenderOutcome::Rendered(rendered) => rendered,
        other => panic!("{adapter}: {other:?}"),
    }
}

fn body(rendered: &Rendered) -> Value {
    serde_json::from_slice(&rendered.body).unwrap()
}

/// The document with every `cache` field taken out.
fn unmarked(document: &Value) -> Value {
    let mut document = document.clone();
    for tool in document["tools"].as_array_mut().unwrap() {
        tool.as_object_mut().unwrap().remove("cache");
    }
    for turn in document["turns"].as_array_mut().unwrap() {
        for block in turn["blocks"].as_array_mut().unwrap() {
            block.as_object_mut().unwrap().remove("cache");
        }
    }
    document
}

#[test]
fn anthropic_breakpoints_are_imported_onto_the_blocks_and_tools_they_mark() {
    let (document, _) = imported(&anthropic_request());
    assert_eq!(document["tools"][0]["cache"], json!({}));
    let turns = document["turns"].as_array().unwrap();
    let marks: Vec<(String, Value)> = turns
        .iter()
        .flat_map(|turn| turn["blocks"].as_array().unwrap())
        .filter(|block| block.get("cache").is_some())
        .map(|block| (block["kind"].as_str().unwrap().to_owned(), block["cache"].clone()))
        .collect();
    assert_eq!(
        marks,
        [
            ("text".to_owned(), json!({})),
            ("text".to_owned(), json!({"ttl": "1h"})),
            ("tool_result".to_owned(), json!({})),
        ]
    );
    // The system block is the first marked one, the user's second block is not marked.
    assert!(turns[0]["blocks"][0].get("cache").is_some());
    assert!(turns[1]["blocks"][1].get("cache").is_none());
}

#[test]
fn towards_anthropic_every_breakpoint_is_written_in_place() {
    let (document, _) = imported(&anthropic_request());
    let conversation = conversation(&document);
    for adapter in [AdapterId::AnthropicMessagesV1, AdapterId::AnthropicMessagesV2] {
        let value = body(&rendered(&conversation, adapter));
        let ephemeral = json!({"type": EPHEMERAL});
        assert_eq!(
            value["tools"][0]["cache_control"], ephemeral,
            "{adapter}: {value}"
        );
        assert_eq!(value["system"][0]["cache_control"], ephemeral, "{adapter}");
        assert_eq!(
            value["messages"][0]["content"][0]["cache_control"],
            json!({"type": EPHEMERAL, "ttl": "1h"}),
            "{adapter}"
        );
        assert!(
            value["messages"][0]["content"][1].get("cache_control").is_none(),
            "{adapter}"
        );
        assert!(
            value["messages"][1]["content"][0].get("cache_control").is_none(),
            "{adapter}"
        );
        assert_eq!(value["messages"][2]["content"][0]["type"], "tool_result");
        assert_eq!(
            value["messages"][2]["content"][0]["cache_control"], ephemeral,
            "{adapter}"
        );
        let count = value.to_string().matches("cache_control").count();
        assert_eq!(count, 4, "{adapter}: {value}");
    }
}

#[test]
fn breakpoints_stay_out_of_content_digests_and_are_pinned_by_the_policy() {
    let (document, _) = imported(&five_minute_request());
    let marked = conversation(&document);
    let plain = conversation(&unmarked(&document));
    assert_eq!(marked.toolset_digest, plain.toolset_digest);
    for (a, b) in marked
        .turns
        .iter()
        .flat_map(|turn| &turn.blocks)
        .zip(plain.turns.iter().flat_map(|turn| &turn.blocks))
    {
        assert_eq!(a.digest, b.digest, "{:?}", a.id);
    }
    let sequence = |conversation: &Conversation| {
        MessageSequence::build(Validated::new(conversation).unwrap()).sequence_digest
    };
    assert_eq!(sequence(&marked), sequence(&plain));
    for adapter in AdapterId::ALL {
        let with = rendered(&marked, adapter);
        let without = rendered(&plain, adapter);
        assert_ne!(with.policy.digest(), without.policy.digest(), "{adapter}");
        let breakpoints = serde_json::to_value(&with.policy).unwrap()["cache"]["breakpoints"].clone();
        assert_eq!(
            breakpoints.as_array().map(Vec::len),
            Some(4),
            "{adapter}: {breakpoints}"
        );
        assert!(
            serde_json::to_value(&without.policy)
                .unwrap()
                .get("cache")
                .is_none(),
            "{adapter}"
        );
    }
}

#[test]
fn a_shared_fragment_cache_never_mixes_marked_and_unmarked_blocks() {
    let (document, _) = imported(&anthropic_request());
    let marked = conversation(&document);
    let plain = conversation(&unmarked(&document));
    let mut cache = RenderCache::new();
    let adapter = AdapterId::AnthropicMessagesV2;
    let RenderOutcome::Rendered(first) = render_doc(&marked, adapter, &Passthrough::default(), &mut cache)
    else {
        panic!("marked");
    };
    let RenderOutcome::Rendered(second) = render_doc(&plain, adapter, &Passthrough::default(), &mut cache)
    else {
        panic!("plain");
    };
    assert!(String::from_utf8_lossy(&first.body).contains("cache_control"));
    assert!(!String::from_utf8_lossy(&second.body).contains("cache_control"));
    assert_eq!(second.body, rendered(&plain, adapter).body);
}

#[test]
fn anthropic_takes_at_most_four_breakpoints_and_none_on_thinking() {
    let mut request = anthropic_request();
    request["messages"][0]["content"][1]["cache_control"] = json!({"type": EPHEMERAL});
    let (document, _) = imported(&request);
    let five = conversation(&document);
    for adapter in [AdapterId::AnthropicMessagesV1, AdapterId::AnthropicMessagesV2] {
        let outcome = render_doc(&five, adapter, &Passthrough::default(), &mut RenderCache::new());
        let RenderOutcome::Paused(pauses) = outcome else {
            panic!("{adapter}: five breakpoints were not refused: {outcome:?}");
        };
        assert!(pauses.iter().any(|pause| pause.kind == "cache"), "{pauses:?}");
    }
    // Four on blocks plus the request-level automatic breakpoint is five as well.
    let mut request = anthropic_request();
    request["cache_control"] = json!({"type": EPHEMERAL});
    let (document, passthrough) = imported(&request);
    let outcome = render_doc(
        &conversation(&document),
        AdapterId::AnthropicMessagesV2,
        &passthrough,
        &mut RenderCache::new(),
    );
    assert!(matches!(outcome, RenderOutcome::Paused(_)), "{outcome:?}");
    // A breakpoint on a reasoning block.
    let mut document = json!({"format": "turnstile.conversation.v1", "conversation_id": "c-r", "revision": 3, "turns": [
        {"id": "t-1", "revision": 1, "role": "user", "blocks": [{"id": "u-1", "kind": "text", "text": "Hi"}]},
        {"id": "t-2", "revision": 2, "role": "assistant", "generation": 1, "blocks": [
            {"id": "a-1", "kind": "reasoning", "provider": "anthropic", "signature": "sig", "text": "hm", "cache": {}},
            {"id": "a-2", "kind": "text", "text": "Hello"}]},
        {"id": "t-3", "revision": 3, "role": "user", "blocks": [{"id": "u-2", "kind": "text", "text": "More"}]}]});
    let outcome = render_doc(
        &conversation(&document),
        AdapterId::AnthropicMessagesV2,
        &Passthrough::default(),
        &mut RenderCache::new(),
    );
    let RenderOutcome::Paused(pauses) = outcome else {
        panic!("a marked thinking block was sent: {outcome:?}");
    };
    assert_eq!(pauses[0].block.as_deref(), Some("a-1"));
    // Control: without the mark it renders.
    document["turns"][1]["blocks"][0]
        .as_object_mut()
        .unwrap()
        .remove("cache");
    let outcome = render_doc(
        &conversation(&document),
        AdapterId::AnthropicMessagesV2,
        &Passthrough::default(),
        &mut RenderCache::new(),
    );
    assert!(matches!(outcome, RenderOutcome::Rendered(_)), "{outcome:?}");
}

/// A five-minute version of the request (OpenAI has no one-hour breakpoint).
fn five_minute_request() -> Value {
    let mut request = anthropic_request();
    request["messages"][0]["content"][0]["cache_control"] = json!({"type": EPHEMERAL});
    request
}

#[test]
fn towards_openai_a_marked_conversation_gets_a_stable_prompt_cache_key() {
    let (document, _) = imported(&five_minute_request());
    let marked = conversation(&document);
    for adapter in [
        AdapterId::OpenaiChatV1,
        AdapterId::OpenaiChatV2,
        AdapterId::OpenaiResponsesV1,
    ] {
        let value = body(&rendered(&marked, adapter));
        let key = value["prompt_cache_key"]
            .as_str()
            .unwrap_or_else(|| panic!("{adapter}: {value}"));
        assert!(
            key.starts_with("turnstile-") && key.len() == "turnstile-".len() + 32,
            "{key}"
        );
        assert!(!value.to_string().contains("cache_control"), "{adapter}");
        // The first breakpoint (the tool) is unchanged when the later ones move: same key.
        let mut moved = document.clone();
        moved["turns"][1]["blocks"][0]
            .as_object_mut()
            .unwrap()
            .remove("cache");
        moved["turns"][1]["blocks"][1]["cache"] = json!({});
        let moved_value = body(&rendered(&conversation(&moved), adapter));
        assert_eq!(
            moved_value["prompt_cache_key"], value["prompt_cache_key"],
            "{adapter}"
        );
        // Another conversation with the same prefix gets another key.
        let mut other = document.clone();
        other["conversation_id"] = json!("c-other");
        let other_value = body(&rendered(&conversation(&other), adapter));
        assert_ne!(
            other_value["prompt_cache_key"], value["prompt_cache_key"],
            "{adapter}"
        );
        // Another marked prefix (no tool mark: the system prompt is first) gets another key.
        let mut system_first = document.clone();
        system_first["tools"][0].as_object_mut().unwrap().remove("cache");
        let system_value = body(&rendered(&conversation(&system_first), adapter));
        assert!(system_value["prompt_cache_key"].is_string());
        assert_ne!(
            system_value["prompt_cache_key"], value["prompt_cache_key"],
            "{adapter}"
        );
        // Nothing marked: no key.
        let plain_value = body(&rendered(&conversation(&unmarked(&document)), adapter));
        assert!(plain_value.get("prompt_cache_key").is_none(), "{adapter}");
    }
}

#[test]
fn towards_openai_the_clients_own_key_wins_and_a_one_hour_breakpoint_is_refused() {
    let (document, _) = imported(&five_minute_request());
    let marked = conversation(&document);
    let chat = json!({"model": "gpt-5", "messages": [{"role": "user", "content": "Hi"}], "prompt_cache_key": "mine"});
    let own = import(Api::OpenaiChat, chat.to_string().as_bytes(), "c-x", None)
        .unwrap()
        .passthrough;
    let RenderOutcome::Rendered(with_own) =
        render_doc(&marked, AdapterId::OpenaiChatV2, &own, &mut RenderCache::new())
    else {
        panic!("own key");
    };
    let text = String::from_utf8_lossy(&with_own.body).into_owned();
    assert_eq!(text.matches("prompt_cache_key").count(), 1, "{text}");
    assert_eq!(body(&with_own)["prompt_cache_key"], "mine");

    let (document, _) = imported(&anthropic_request());
    let one_hour = conversation(&document);
    for adapter in [
        AdapterId::OpenaiChatV1,
        AdapterId::OpenaiChatV2,
        AdapterId::OpenaiResponsesV1,
    ] {
        let outcome = render_doc(
            &one_hour,
            adapter,
            &Passthrough::default(),
            &mut RenderCache::new(),
        );
        let RenderOutcome::Paused(pauses) = outcome else {
            panic!("{adapter}: a one-hour breakpoint was sent: {outcome:?}");
        };
        assert_eq!(pauses.len(), 1, "{pauses:?}");
        assert_eq!(pauses[0].kind, "cache.ttl");
        assert_eq!(pauses[0].block.as_deref(), Some("t-2-b-1"));
    }
}

#[test]
fn towards_gemini_breakpoints_are_left_out_and_reported() {
    let (document, _) = imported(&anthropic_request());
    let marked = conversation(&document);
    let with = rendered(&marked, AdapterId::GeminiV1);
    let without = rendered(&conversation(&unmarked(&document)), AdapterId::GeminiV1);
    assert_eq!(with.body, without.body);
    assert_eq!(
        turnstile_adapters::cache::dropped_towards(Api::Gemini, &marked),
        ["cache_control"]
    );
    for api in [Api::AnthropicMessages, Api::OpenaiChat, Api::OpenaiResponses] {
        assert!(
            turnstile_adapters::cache::dropped_towards(api, &marked).is_empty(),
            "{api:?}"
        );
    }
    assert!(
        turnstile_adapters::cache::dropped_towards(Api::Gemini, &conversation(&unmarked(&document)))
            .is_empty()
    );
}

#[test]
fn malformed_breakpoints_are_named() {
    for (mark, path) in [
        (json!({"type": "persistent"}), "system[0].cache_control.type"),
        (
            json!({"type": EPHEMERAL, "ttl": "2h"}),
            "system[0].cache_control.ttl",
        ),
    ] {
        let mut request = anthropic_request();
        request["system"][0]["cache_control"] = mark;
        let error = import(Api::AnthropicMessages, request.to_string().as_bytes(), "c", None).unwrap_err();
        assert_eq!(error.path(), path);
    }
    // A breakpoint inside a tool result before its last part cannot be placed on a v1 block.
    let mut request = anthropic_request();
    request["messages"][2]["content"][0]["content"][0]["cache_control"] = json!({"type": EPHEMERAL});
    let error = import(Api::AnthropicMessages, request.to_string().as_bytes(), "c", None).unwrap_err();
    assert_eq!(error.code(), "unrepresentable");
    // A v1 file whose mark is not `{"ttl"?}` is invalid_structure on that block.
    let (mut document, _) = imported(&anthropic_request());
    document["turns"][0]["blocks"][0]["cache"] = json!({"ttl": "forever"});
    let verdict = turnstile_core::validate(&conversation(&document));
    let turnstile_core::Verdict::Rejected(violations) = verdict else {
        panic!("{verdict:?}");
    };
    assert_eq!(violations[0].code.as_str(), "invalid_structure");
}

#[test]
fn rendered_prompt_cache_keys_conform_to_the_official_openapi_request_schemas() {
    use crate::render_openapi::{discriminated_one_of_as_any_of, spec_path, to_json, validator};
    let path = spec_path();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("{}: {error} (set TURNSTILE_SHARED)", path.display()))
        .replace("-9223372036854776000", "-9223372036854775808")
        .replace("9223372036854776000", "9223372036854775807");
    let yaml: serde_yaml::Value = serde_yaml::from_str(&text).expect("the OpenAPI spec is YAML");
    let mut spec = to_json(yaml);
    discriminated_one_of_as_any_of(&mut spec);
    let (document, _) = imported(&five_minute_request());
    let marked = conversation(&document);
    for (adapter, schema) in [
        (AdapterId::OpenaiChatV1, "CreateChatCompletionRequest"),
        (AdapterId::OpenaiChatV2, "CreateChatCompletionRequest"),
        (AdapterId::OpenaiResponsesV1, "CreateResponse"),
    ] {
        let schema = validator(&spec, schema);
        let mut value = body(&rendered(&marked, adapter));
        let errors: Vec<String> = schema
            .iter_errors(&value)
            .map(|error| error.to_string())
            .collect();
        assert!(errors.is_empty(), "{adapter}: {errors:?}");
        // Control: the schema checks the field.
        value["prompt_cache_key"] = json!(17);
        assert!(!schema.is_valid(&value), "{adapter}");
    }
}
