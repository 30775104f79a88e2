//! Illegal history is imported as it is, and `turnstile_core::validate` rejects it with the
//! spec code (`shared/spec/conversation-v1.md` §2): the importer never fails on it, and never
//! moves, drops or invents a turn to make it legal. One `check(api, body, expected)` helper:
//! `expected` is the sorted set of violation codes, or `waiting` / `ready`.

use crate::import_props::{decode, import_as};
use serde_json::{Value, json};
use turnstile_adapters::registry::Api;
use turnstile_core::{Verdict, validate};

fn outcome(api: Api, body: &Value) -> Vec<String> {
    let bytes = serde_json::to_vec(body).unwrap();
    let imported = import_as(api, &bytes, "m").unwrap_or_else(|error| {
        panic!(
            "{api:?}: the importer refused {} at {:?}",
            error.code(),
            error.path()
        )
    });
    match validate(&decode(&imported.document)) {
        Verdict::Ready => vec!["ready".into()],
        Verdict::Waiting { pending } => vec![format!(
            "waiting {}",
            pending.iter().map(|id| id.as_str()).collect::<Vec<_>>().join(",")
        )],
        Verdict::Rejected(violations) => {
            let mut codes: Vec<String> = violations
                .iter()
                .map(|violation| violation.code.as_str().to_owned())
                .collect();
            codes.sort();
            codes.dedup();
            codes
        }
    }
}

fn check(api: Api, body: Value, expected: &[&str]) {
    assert_eq!(outcome(api, &body), expected, "{api:?}: {body}");
}

fn call(id: &str, arguments: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}})
}

fn chat(messages: Value) -> Value {
    json!({"model": "gpt-4o", "messages": messages})
}

#[test]
fn chat_history_errors_come_out_as_the_validators_spec_codes() {
    let user = json!({"role": "user", "content": "weather?"});
    let calls = json!({"role": "assistant", "tool_calls": [call("call_a", "{\"city\":\"Oslo\"}"), call("call_b", "{\"city\":\"Rome\"}")]});
    let result = |id: &str| json!({"role": "tool", "tool_call_id": id, "content": "ok"});
    let after = json!({"role": "user", "content": "thanks"});
    check(
        Api::OpenaiChat,
        chat(json!([user, calls, result("call_a"), result("call_b"), after])),
        &["ready"],
    );
    check(
        Api::OpenaiChat,
        chat(json!([
            user,
            calls,
            result("call_a"),
            result("call_x"),
            result("call_b")
        ])),
        &["orphan_result"],
    );
    check(
        Api::OpenaiChat,
        chat(json!([user, result("call_a")])),
        &["orphan_result"],
    );
    check(
        Api::OpenaiChat,
        chat(json!([
            user,
            calls,
            result("call_a"),
            result("call_b"),
            result("call_a")
        ])),
        &["duplicate_result"],
    );
    check(
        Api::OpenaiChat,
        chat(json!([user, calls, result("call_b"), after])),
        &["missing_result"],
    );
    check(
        Api::OpenaiChat,
        chat(json!([user, calls, result("call_b")])),
        &["waiting call_a"],
    );
    check(
        Api::OpenaiChat,
        chat(json!([user, {"role": "system", "content": "obey"}])),
        &["role_violation"],
    );
    check(
        Api::OpenaiChat,
        chat(json!([{"role": "developer", "content": "rules"}, {"role": "system", "content": "more"}, user])),
        &["ready"],
    );
    check(
        Api::OpenaiChat,
        chat(
            json!([user, {"role": "assistant", "tool_calls": [call("call_a", "{\"city\": \"Os")]}, result("call_a")]),
        ),
        &["unclosed_arguments"],
    );
    check(
        Api::OpenaiChat,
        chat(
            json!([user, {"role": "assistant", "tool_calls": [call("call_a", "[1, 2]")]}, result("call_a")]),
        ),
        &["unclosed_arguments"],
    );
    check(
        Api::OpenaiChat,
        chat(
            json!([user, {"role": "assistant", "tool_calls": [call("call_a", "{}"), call("call_a", "{}")]}, result("call_a")]),
        ),
        &["duplicate_call_id"],
    );
    // An empty message is an empty turn, not skipped.
    check(
        Api::OpenaiChat,
        chat(json!([user, {"role": "assistant", "content": null}, after])),
        &["invalid_structure"],
    );
    // A result for a call two assistant turns back is an orphan of its run, even though the
    // call exists: it is imported where it stands, with that call's envelope.
    check(
        Api::OpenaiChat,
        chat(
            json!([user, calls, result("call_a"), result("call_b"), {"role": "assistant", "content": "done"}, result("call_a")]),
        ),
        &["orphan_result"],
    );
}

#[test]
fn responses_history_errors_come_out_as_the_validators_spec_codes() {
    let user = json!({"role": "user", "content": "weather?"});
    let function_call = |id: &str, arguments: &str| json!({"type": "function_call", "call_id": id, "name": "get_weather", "arguments": arguments});
    let output = |id: &str| json!({"type": "function_call_output", "call_id": id, "output": "ok"});
    let input = |items: Value| json!({"model": "gpt-4.1", "instructions": "be brief", "input": items});
    check(
        Api::OpenaiResponses,
        input(json!([user, function_call("c1", "{}"), output("c1")])),
        &["ready"],
    );
    check(
        Api::OpenaiResponses,
        input(json!([user, function_call("c1", "{}"), output("c2")])),
        &["orphan_result"],
    );
    check(
        Api::OpenaiResponses,
        input(json!([
            user,
            function_call("c1", "{}"),
            output("c1"),
            output("c1")
        ])),
        &["duplicate_result"],
    );
    check(
        Api::OpenaiResponses,
        input(json!([
            user,
            function_call("c1", "{}"),
            function_call("c2", "{}"),
            output("c1"),
            user
        ])),
        &["missing_result"],
    );
    check(
        Api::OpenaiResponses,
        input(json!([user, function_call("c1", "{\"a\":"), output("c1")])),
        &["unclosed_arguments"],
    );
    check(
        Api::OpenaiResponses,
        input(json!([user, {"role": "developer", "content": "late rules"}])),
        &["role_violation"],
    );
}

#[test]
fn anthropic_history_errors_come_out_as_the_validators_spec_codes() {
    let user = json!({"role": "user", "content": "weather?"});
    let calls = json!({"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {"city": "Rome"}}]});
    let result = |id: &str| json!({"type": "tool_result", "tool_use_id": id, "content": "ok"});
    let messages =
        |messages: Value| json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": messages});
    check(
        Api::AnthropicMessages,
        messages(json!([user, calls, {"role": "user", "content": [result("toolu_b"), result("toolu_a")]}])),
        &["ready"],
    );
    check(
        Api::AnthropicMessages,
        messages(
            json!([user, calls, {"role": "user", "content": [result("toolu_a"), result("toolu_z"), result("toolu_b")]}]),
        ),
        &["orphan_result"],
    );
    check(
        Api::AnthropicMessages,
        messages(
            json!([user, calls, {"role": "user", "content": [result("toolu_a"), result("toolu_b"), result("toolu_b")]}]),
        ),
        &["duplicate_result"],
    );
    check(
        Api::AnthropicMessages,
        messages(
            json!([user, calls, {"role": "user", "content": [result("toolu_a"), {"type": "text", "text": "and?"}]}]),
        ),
        &["missing_result"],
    );
    // Text before the results: the results land after a user turn, so they answer nothing.
    check(
        Api::AnthropicMessages,
        messages(
            json!([user, calls, {"role": "user", "content": [{"type": "text", "text": "here"}, result("toolu_a"), result("toolu_b")]}]),
        ),
        &["missing_result", "orphan_result"],
    );
    // A tool_use block in a user message stays there.
    check(
        Api::AnthropicMessages,
        messages(
            json!([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
        ),
        &["role_violation"],
    );
}

#[test]
fn gemini_history_errors_come_out_as_the_validators_spec_codes() {
    let user = json!({"role": "user", "parts": [{"text": "weather?"}]});
    let calls = json!({"role": "model", "parts": [
        {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}},
        {"functionCall": {"name": "get_time", "args": {}}}]});
    let response = |name: &str| json!({"functionResponse": {"name": name, "response": {"output": "ok"}}});
    let contents = |contents: Value| json!({"contents": contents});
    check(
        Api::Gemini,
        contents(
            json!([user, calls, {"role": "user", "parts": [response("get_time"), response("get_weather")]}]),
        ),
        &["ready"],
    );
    check(
        Api::Gemini,
        contents(
            json!([user, calls, {"role": "user", "parts": [response("get_weather"), response("get_time"), response("get_news")]}]),
        ),
        &["orphan_result"],
    );
    check(
        Api::Gemini,
        contents(
            json!([user, calls, {"role": "user", "parts": [response("get_weather"), response("get_time"), response("get_time")]}]),
        ),
        &["duplicate_result"],
    );
    check(
        Api::Gemini,
        contents(
            json!([user, calls, {"role": "user", "parts": [response("get_weather"), {"text": "and?"}]}]),
        ),
        &["missing_result"],
    );
    check(
        Api::Gemini,
        contents(json!([user, calls, {"role": "user", "parts": [response("get_weather")]}])),
        &["waiting gemini-t-2-1"],
    );
    check(
        Api::Gemini,
        contents(json!([user, {"role": "user", "parts": [response("get_weather")]}])),
        &["orphan_result"],
    );
    // A response given an id that no call has is an orphan, whatever its name.
    check(
        Api::Gemini,
        contents(json!([user, calls, {"role": "user", "parts": [
            {"functionResponse": {"id": "nope", "name": "get_weather", "response": {}}},
            response("get_weather"), response("get_time")]}])),
        &["orphan_result"],
    );
}
