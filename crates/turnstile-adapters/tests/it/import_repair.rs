//! The history doctor on each API's importer: requests poisoned the way real agents poison
//! them (an aborted stream mid tool call, a retry appended to the same assistant message, a
//! max-iterations exit with an unanswered call, a result sent twice, fewer Gemini function
//! responses than calls) import as they stand, the validator refuses them, and the repair plan
//! (`turnstile_core::repair`, with pending calls closed as the proxy asks) makes a history that
//! every adapter renders legally by the independent rule checker (`render_rules.rs`).

use crate::import_props::{decode, import_as};
use crate::render_rules;
use crate::render_support::render_for;
use serde_json::{Value, json};
use turnstile_adapters::AdapterId;
use turnstile_adapters::registry::Api;
use turnstile_adapters::render::RenderOutcome;
use turnstile_core::repair::{self, Options};
use turnstile_core::{Verdict, validate};

/// Import, check the validator refuses it with `refused` among its codes, repair, and render
/// the repaired history with every adapter; the plan's causes, sorted and deduplicated.
fn repaired(api: Api, body: Value, refused: &str) -> Vec<&'static str> {
    let bytes = serde_json::to_vec(&body).unwrap();
    let imported = import_as(api, &bytes, "m").unwrap_or_else(|error| panic!("{api:?}: {}", error.code()));
    let Verdict::Rejected(violations) = validate(&decode(&imported.document)) else {
        panic!("{api:?}: not refused: {body}");
    };
    assert!(
        violations
            .iter()
            .any(|violation| violation.code.as_str() == refused),
        "{api:?}: {violations:?}"
    );
    let plan = repair::plan(&imported.document, Options { close_pending: true }).unwrap();
    assert!(plan.is_complete(), "{api:?}: left {:?}", plan.needs_person);
    let document = repair::apply(&plan, &imported.document).unwrap();
    let conversation = decode(&document);
    assert_eq!(validate(&conversation), Verdict::Ready, "{api:?}: {document}");
    let mut problems = Vec::new();
    for adapter in AdapterId::ALL {
        match render_for(&conversation, adapter) {
            RenderOutcome::Rendered(rendered) => {
                for problem in render_rules::check(adapter, &conversation, &rendered) {
                    problems.push(format!("{adapter}: {problem}"));
                }
            }
            other => problems.push(format!("{adapter}: not rendered: {other:?}")),
        }
    }
    assert!(problems.is_empty(), "{api:?}: {}", problems.join("\n"));
    let mut causes: Vec<&'static str> = plan
        .actions
        .iter()
        .map(|action| action.cause().as_str())
        .collect();
    causes.sort();
    causes.dedup();
    causes
}

fn chat(messages: Value) -> Value {
    json!({"model": "gpt-4o", "messages": messages, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}}}]})
}

fn chat_call(id: &str, arguments: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}})
}

#[test]
fn openai_chat_histories_poisoned_by_agents_are_repaired_and_render_for_every_adapter() {
    let user = json!({"role": "user", "content": "weather?"});
    let result = |id: &str| json!({"role": "tool", "tool_call_id": id, "content": "ok"});
    let after = json!({"role": "user", "content": "go on"});
    // An aborted stream mid tool call, kept by the client with its cut arguments.
    let cut = json!({"role": "assistant", "content": "Checking.", "tool_calls": [chat_call("call_a", "{\"city\": \"Os")]});
    assert_eq!(
        repaired(
            Api::OpenaiChat,
            chat(json!([user, cut, after])),
            "unclosed_arguments"
        ),
        ["unclosed_arguments"]
    );
    // A retry appended to the same assistant message, then its result twice.
    let retried = json!({"role": "assistant", "tool_calls": [chat_call("call_a", "{\"city\":\"Oslo\"}"), chat_call("call_a", "{\"city\":\"Oslo\"}")]});
    assert_eq!(
        repaired(
            Api::OpenaiChat,
            chat(json!([user, retried, result("call_a"), result("call_a"), after])),
            "duplicate_call_id"
        ),
        ["duplicate_call_id", "duplicate_result"]
    );
    // A max-iterations exit: the call never answered, the user asks again.
    let calls = json!({"role": "assistant", "tool_calls": [chat_call("call_a", "{\"city\":\"Oslo\"}"), chat_call("call_b", "{\"city\":\"Rome\"}")]});
    assert_eq!(
        repaired(
            Api::OpenaiChat,
            chat(json!([user, calls, result("call_a"), after])),
            "missing_result"
        ),
        ["missing_result"]
    );
    // A result sent twice.
    assert_eq!(
        repaired(
            Api::OpenaiChat,
            chat(json!([
                user,
                calls,
                result("call_a"),
                result("call_b"),
                result("call_a"),
                after
            ])),
            "duplicate_result"
        ),
        ["duplicate_result"]
    );
    // "No tool call found for function call output": a result for no call.
    assert_eq!(
        repaired(
            Api::OpenaiChat,
            chat(json!([user, result("call_z"), after])),
            "orphan_result"
        ),
        ["emptied_turn", "orphan_result"]
    );
}

#[test]
fn openai_responses_histories_poisoned_by_agents_are_repaired_and_render_for_every_adapter() {
    let user = json!({"role": "user", "content": "weather?"});
    let call = |id: &str, arguments: &str| json!({"type": "function_call", "call_id": id, "name": "get_weather", "arguments": arguments});
    let output = |id: &str| json!({"type": "function_call_output", "call_id": id, "output": "ok"});
    let input = |items: Value| json!({"model": "gpt-4.1", "input": items, "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]});
    assert_eq!(
        repaired(
            Api::OpenaiResponses,
            input(json!([user, call("c1", "{\"city\": \"Os"), user])),
            "unclosed_arguments"
        ),
        ["emptied_turn", "unclosed_arguments"]
    );
    assert_eq!(
        repaired(
            Api::OpenaiResponses,
            input(json!([
                user,
                call("c1", "{}"),
                call("c1", "{}"),
                output("c1"),
                user
            ])),
            "duplicate_call_id"
        ),
        ["duplicate_call_id"]
    );
    assert_eq!(
        repaired(
            Api::OpenaiResponses,
            input(json!([
                user,
                call("c1", "{}"),
                call("c2", "{}"),
                output("c1"),
                user
            ])),
            "missing_result"
        ),
        ["missing_result"]
    );
    assert_eq!(
        repaired(
            Api::OpenaiResponses,
            input(json!([user, call("c1", "{}"), output("c1"), output("c1"), user])),
            "duplicate_result"
        ),
        ["duplicate_result"]
    );
    // A call the client is about to send on unanswered: pending, closed on the proxy's request.
    assert_eq!(
        repaired(
            Api::OpenaiResponses,
            input(json!([user, call("c1", "{}"), output("c2")])),
            "orphan_result"
        ),
        ["emptied_turn", "orphan_result", "pending_call"]
    );
}

#[test]
fn anthropic_histories_poisoned_by_agents_are_repaired_and_render_for_every_adapter() {
    let user = json!({"role": "user", "content": "weather?"});
    let use_block = |id: &str, city: &str| json!({"type": "tool_use", "id": id, "name": "get_weather", "input": {"city": city}});
    let result = |id: &str| json!({"type": "tool_result", "tool_use_id": id, "content": "ok"});
    let messages = |messages: Value| {
        json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": messages,
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]})
    };
    // "tool_use ids were found without tool_result blocks": a max-iterations exit.
    let calls =
        json!({"role": "assistant", "content": [use_block("toolu_a", "Oslo"), use_block("toolu_b", "Rome")]});
    assert_eq!(
        repaired(
            Api::AnthropicMessages,
            messages(
                json!([user, calls, {"role": "user", "content": [result("toolu_a"), {"type": "text", "text": "and?"}]}])
            ),
            "missing_result"
        ),
        ["missing_result"]
    );
    // "unexpected tool_use_id found in tool_result blocks".
    assert_eq!(
        repaired(
            Api::AnthropicMessages,
            messages(
                json!([user, calls, {"role": "user", "content": [result("toolu_a"), result("toolu_z"), result("toolu_b")]}])
            ),
            "orphan_result"
        ),
        ["orphan_result"]
    );
    // A retry appended to the same message, and a result sent twice.
    let retried =
        json!({"role": "assistant", "content": [use_block("toolu_a", "Oslo"), use_block("toolu_a", "Oslo")]});
    assert_eq!(
        repaired(
            Api::AnthropicMessages,
            messages(
                json!([user, retried, {"role": "user", "content": [result("toolu_a"), result("toolu_a")]}])
            ),
            "duplicate_call_id"
        ),
        ["duplicate_call_id", "duplicate_result"]
    );
}

#[test]
fn gemini_histories_poisoned_by_agents_are_repaired_and_render_for_every_adapter() {
    let user = json!({"role": "user", "parts": [{"text": "weather?"}]});
    let calls = json!({"role": "model", "parts": [
        {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}},
        {"functionCall": {"name": "get_time", "args": {}}}]});
    let response = |name: &str| json!({"functionResponse": {"name": name, "response": {"output": "ok"}}});
    let contents = |contents: Value| {
        json!({"contents": contents, "tools": [{"functionDeclarations": [
        {"name": "get_weather", "parameters": {"type": "object"}}, {"name": "get_time", "parameters": {"type": "object"}}]}]})
    };
    // "the number of function response parts is equal to the number of function call parts":
    // fewer responses than calls, then the user goes on.
    assert_eq!(
        repaired(
            Api::Gemini,
            contents(
                json!([user, calls, {"role": "user", "parts": [response("get_weather"), {"text": "and?"}]}])
            ),
            "missing_result"
        ),
        ["missing_result"]
    );
    // A response sent twice, and one for a call nobody made.
    assert_eq!(
        repaired(
            Api::Gemini,
            contents(
                json!([user, calls, {"role": "user", "parts": [response("get_weather"), response("get_time"), response("get_time")]}])
            ),
            "duplicate_result"
        ),
        ["duplicate_result"]
    );
    assert_eq!(
        repaired(
            Api::Gemini,
            contents(
                json!([user, calls, {"role": "user", "parts": [response("get_weather"), response("get_time"), response("get_news")]}])
            ),
            "orphan_result"
        ),
        ["orphan_result"]
    );
}

#[test]
fn a_legal_imported_history_is_left_exactly_as_it_was() {
    let body = chat(json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [chat_call("call_b", "{}"), chat_call("call_a", "{}")]},
        {"role": "tool", "tool_call_id": "call_a", "content": "ok"},
        {"role": "tool", "tool_call_id": "call_b", "content": "ok"},
    ]));
    let imported = import_as(Api::OpenaiChat, &serde_json::to_vec(&body).unwrap(), "m").unwrap();
    let plan = repair::plan(&imported.document, Options { close_pending: true }).unwrap();
    assert!(plan.is_empty());
    assert_eq!(
        repair::apply(&plan, &imported.document).unwrap(),
        imported.document
    );
}
