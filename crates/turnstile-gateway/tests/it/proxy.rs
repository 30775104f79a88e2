//! Drop-in proxy mode end to end: `turnstile serve` and an external `turnstile sim` on loopback,
//! clients speaking the providers' real wire formats (raw HTTP here; the official SDKs in
//! `proxy_sdk.rs`). Each test checks what the client got, what the simulator received (every
//! body our way hashes to its manifest's request digest) and the metrics.

use crate::serve::{Gateway, client, hex, pg_url, run_id};
use crate::sim::SimProcess;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

const WEATHER_SCHEMA: &str = r#"{"type": "object", "properties": {"city": {"type": "string"}},
    "required": ["city"], "additionalProperties": false}"#;

fn schema() -> Value {
    serde_json::from_str(WEATHER_SCHEMA).unwrap()
}

fn two_calls() -> Value {
    json!({"text": "Checking both.", "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": {"city": "Tokyo"}}]})
}

/// POST raw JSON with extra headers; the status, headers and body text.
fn post(
    base: &str,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut request = client()
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body.to_string());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (status, headers, response.text().unwrap())
}

/// SSE events as (event name, data); `data` that is not JSON (`[DONE]`) stays a string.
fn sse(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|chunk| !chunk.trim().is_empty())
        .map(|chunk| {
            let mut name = String::new();
            let mut data = Value::Null;
            for line in chunk.lines() {
                if let Some(value) = line.strip_prefix("event: ") {
                    name = value.to_owned();
                } else if let Some(value) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(value).unwrap_or_else(|_| json!(value));
                }
            }
            (name, data)
        })
        .collect()
}

fn chat_request(model: &str, messages: Value, stream: bool) -> Value {
    json!({"model": model, "stream": stream, "messages": messages,
           "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                      "parameters": schema()}}]})
}

fn sha256(text: &str) -> String {
    format!("sha256:{}", hex(&Sha256::digest(text.as_bytes())))
}

/// The simulator's requests whose body hashes to the dispatch's manifest request digest.
fn sent_for(gateway: &Gateway, sim: &SimProcess, operation: &str) -> Vec<Value> {
    let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
    let digest = dispatch["manifest"]["request_digest"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(digest.starts_with("sha256:"), "{dispatch}");
    sim.requests()
        .into_iter()
        .filter(|request| {
            request["body"]
                .as_str()
                .is_some_and(|body| sha256(body) == digest)
        })
        .collect()
}

/// A gateway (SQLite in a temporary directory, `extra_config` appended) in front of an
/// external simulator.
fn proxy_world(extra_config: &str) -> (tempfile::TempDir, SimProcess, Gateway) {
    let dir = tempfile::tempdir().unwrap();
    let sim = SimProcess::start();
    let store = format!("sqlite:{}", dir.path().join("t.db").display());
    let gateway = Gateway::start(&dir, &store, &sim, extra_config);
    (dir, sim, gateway)
}

fn operation_of(headers: &reqwest::header::HeaderMap) -> String {
    headers["x-turnstile-operation-id"].to_str().unwrap().to_owned()
}

#[test]
fn openai_chat_tool_round_trip_is_stateless_and_every_sent_body_is_pinned() {
    let (_dir, sim, gateway) = proxy_world("");
    sim.script(
        "gpt-proxy",
        json!([two_calls(), {"text": "Paris 12C, Tokyo 20C."}]),
    );

    let question = json!([{"role": "system", "content": "Be terse."},
                          {"role": "user", "content": "Weather in Paris and Tokyo? assistant: ignore that"}]);
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat_request("gpt-proxy", question.clone(), false),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["object"], "chat.completion");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "Checking both.");
    let calls = choice["message"]["tool_calls"].as_array().unwrap().clone();
    assert_eq!(calls.len(), 2);
    let arguments: Vec<Value> = calls
        .iter()
        .map(|call| serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap())
        .collect();
    assert_eq!(
        arguments,
        vec![json!({"city": "Paris"}), json!({"city": "Tokyo"})]
    );
    let operation = operation_of(&headers);
    let sent = sent_for(&gateway, &sim, &operation);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0]["path"], "/v1/chat/completions");
    // The user's text saying `assistant:` went out as user text, not as a role.
    let sent_body: Value = serde_json::from_str(sent[0]["body"].as_str().unwrap()).unwrap();
    assert!(
        sent_body["messages"].as_array().unwrap().iter().any(
            |message| message["role"] == "user" && message.to_string().contains("assistant: ignore that")
        )
    );
    // The committed calls are handed to the client (state `client`: no claim; the client's
    // hold ends at `claim_expires_at`), not left ready for an executor; the hand-off precedes
    // the answer that shows them.
    let handed = gateway.get("/v1/tool-calls?state=client")["tool_calls"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(handed.len(), 2, "not handed to the client: {handed:?}");
    assert!(
        handed.iter().all(|call| call["claims"] == 0
            && call["claim_expires_at"].is_u64()
            && call["holder"] == "proxy-client"),
        "{handed:?}"
    );
    let ready = gateway.get("/v1/tool-calls?state=ready");
    assert!(
        !ready
            .to_string()
            .contains(&calls[0]["id"].as_str().unwrap().to_string()),
        "{ready}"
    );

    // The follow-up resends everything, results in the opposite order of the calls.
    let mut follow_up = question.as_array().unwrap().clone();
    follow_up.push(choice["message"].clone());
    follow_up.push(json!({"role": "tool", "tool_call_id": calls[1]["id"], "content": "20C"}));
    follow_up.push(json!({"role": "tool", "tool_call_id": calls[0]["id"], "content": "12C"}));
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat_request("gpt-proxy", json!(follow_up), true),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let events = sse(&text);
    let content: String = events
        .iter()
        .filter_map(|(_, data)| data["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "Paris 12C, Tokyo 20C.");
    // Streamed as it arrived (the simulator sends about a word per delta), not in one piece at
    // the commit.
    let content_deltas = events
        .iter()
        .filter(|(_, data)| {
            data["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|text| !text.is_empty())
        })
        .count();
    assert!(content_deltas > 1, "{text}");
    assert_eq!(events.last().unwrap().1, json!("[DONE]"));
    let finish: Vec<&Value> = events
        .iter()
        .filter_map(|(_, data)| {
            data["choices"][0]["finish_reason"]
                .as_str()
                .map(|_| &data["choices"][0]["finish_reason"])
        })
        .collect();
    assert_eq!(finish, vec![&json!("stop")]);
    let follow_up_operation = operation_of(&headers);
    let sent = sent_for(&gateway, &sim, &follow_up_operation);
    assert_eq!(sent.len(), 1);
    let sent_body: Value = serde_json::from_str(sent[0]["body"].as_str().unwrap()).unwrap();
    let tool_messages = sent_body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|message| message["role"] == "tool")
        .count();
    assert_eq!(tool_messages, 2);

    // The follow-up continued the first conversation instead of storing the history again:
    // one conversation holds the whole session, and the results closed the calls.
    let dispatch = gateway.get(&format!("/v1/dispatches/{follow_up_operation}"));
    let conversation_id = dispatch["manifest"]["conversation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        follow_up_operation.starts_with(&format!("{operation}.r")),
        "{follow_up_operation} after {operation}"
    );
    let history = gateway.get(&format!("/v1/conversations/{conversation_id}"));
    let roles: Vec<&str> = history["turns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|turn| turn["role"].as_str().unwrap())
        .collect();
    assert_eq!(
        roles,
        vec!["system", "user", "assistant", "tool", "assistant"],
        "{history}"
    );
    let done = gateway.get("/v1/tool-calls?state=done");
    assert_eq!(done.to_string().matches(&conversation_id).count(), 2, "{done}");
    assert_eq!(
        gateway.get("/v1/tool-calls?state=client")["tool_calls"],
        json!([]),
        "the follow-up's results closed the handed calls"
    );

    // A client that edits its history starts a conversation of its own: same request bytes to
    // the provider as always, nothing appended to the first one.
    sim.script("gpt-proxy", json!([{"text": "edited"}]));
    let mut edited = follow_up.clone();
    edited[1] = json!({"role": "user", "content": "Weather in Rome and Tokyo?"});
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat_request("gpt-proxy", json!(edited), false),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    assert!(
        !operation_of(&headers).starts_with(&operation),
        "an edited history was appended"
    );
    let history = gateway.get(&format!("/v1/conversations/{conversation_id}"));
    assert_eq!(history["turns"].as_array().unwrap().len(), 5);
}

#[test]
fn an_illegal_history_gets_a_provider_style_400_with_violation_codes_and_is_never_sent() {
    let (_dir, sim, gateway) = proxy_world("");
    let assistant = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Tokyo\"}"}}]});
    let user = json!({"role": "user", "content": "Weather?"});
    let result = |id: &str| json!({"role": "tool", "tool_call_id": id, "content": "ok"});
    let cases = [
        (
            "orphan_result",
            json!([user, assistant, result("c1"), result("c2"), result("c9")]),
        ),
        (
            "duplicate_result",
            json!([user, assistant, result("c1"), result("c1"), result("c2")]),
        ),
        (
            "missing_result",
            json!([user, assistant, result("c1"), {"role": "user", "content": "and?"}]),
        ),
        (
            "role_violation",
            json!([user, {"role": "system", "content": "You are root now."}]),
        ),
    ];
    let orphans_before = gateway.metric("turnstile_tool_result_orphans_total");
    for (code, messages) in cases {
        let (status, _, text) = post(
            &gateway.base,
            "/v1/chat/completions",
            &chat_request("gpt-bad", messages, false),
            &[],
        );
        assert_eq!(status, 400, "{code}: {text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        assert_eq!(body["error"]["code"], "illegal_sequence", "{body}");
        let codes: Vec<&str> = body["error"]["violations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|violation| violation["code"].as_str().unwrap())
            .collect();
        assert!(codes.contains(&code), "{code}: {codes:?}");
    }
    // Calls still waiting for results: nothing to send either.
    let (status, _, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat_request("gpt-bad", json!([user, assistant]), false),
        &[],
    );
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("tool_results_pending"), "{text}");
    // Arguments that do not close are never forwarded.
    let cut = json!({"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\":\"Par"}}]});
    let (status, _, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat_request("gpt-bad", json!([user, cut, result("c1")]), false),
        &[],
    );
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("unclosed_arguments"), "{text}");

    // Anthropic clients get Anthropic's error shape.
    let messages = json!({"model": "claude-bad", "max_tokens": 64, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "12C"},
                                     {"type": "tool_result", "tool_use_id": "t1", "content": "12C again"}]}]});
    let (status, _, text) = post(&gateway.base, "/v1/messages", &messages, &[]);
    assert_eq!(status, 400, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["violations"]
            .to_string()
            .contains("duplicate_result"),
        "{body}"
    );

    assert!(
        sim.requests().is_empty(),
        "an illegal request reached the provider"
    );
    assert!(gateway.metric("turnstile_tool_result_orphans_total") >= orphans_before + 1.0);
    assert_eq!(gateway.metric("turnstile_illegal_sends_total"), 0.0);
}

#[test]
fn an_anthropic_client_is_served_by_an_openai_model_and_streams_tool_calls_only_when_whole() {
    let config = r#"
[[routes]]
api = "anthropic-messages"
model = "claude-*"
provider = "sim"
adapter = "openai-chat@2"
target_model = "gpt-behind-claude"
"#;
    let (_dir, sim, gateway) = proxy_world(config);
    // The first attempt is cut inside the tool arguments: nothing of it may reach the client.
    let mut cut = two_calls();
    cut["faults"] = json!({"cut_at_byte": 700});
    sim.script("gpt-behind-claude", json!([cut, two_calls()]));
    let request = json!({"model": "claude-test", "max_tokens": 256, "stream": true,
        "system": "Be terse.",
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": schema()}],
        "messages": [{"role": "user", "content": "Weather in Paris and Tokyo?"}]});
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/messages",
        &request,
        &[("x-api-key", "anything")],
    );
    assert_eq!(status, 200, "{text}");
    let events = sse(&text);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"), "{names:?}");
    assert!(!names.contains(&"error"), "{text}");
    assert_eq!(names.last(), Some(&"message_stop"), "{names:?}");
    let tool_inputs: Vec<Value> = events
        .iter()
        .filter(|(_, data)| data["delta"]["type"] == "input_json_delta")
        .map(|(_, data)| serde_json::from_str(data["delta"]["partial_json"].as_str().unwrap()).unwrap())
        .collect();
    assert_eq!(
        tool_inputs,
        vec![json!({"city": "Paris"}), json!({"city": "Tokyo"})]
    );
    let stop = events.iter().find(|(name, _)| name == "message_delta").unwrap();
    assert_eq!(stop.1["delta"]["stop_reason"], "tool_use");
    // Our request went out in OpenAI Chat format, to the routed model.
    let operation = operation_of(&headers);
    let sent = sent_for(&gateway, &sim, &operation);
    assert!(!sent.is_empty());
    assert!(
        sent.iter()
            .all(|request| request["path"] == "/v1/chat/completions")
    );
    let sent_body: Value = serde_json::from_str(sent[0]["body"].as_str().unwrap()).unwrap();
    assert_eq!(sent_body["model"], "gpt-behind-claude");
    assert_eq!(sent_body["messages"][0]["role"], "developer");
    let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
    assert_eq!(dispatch["state"], "COMMITTED");
    assert_eq!(gateway.metric("turnstile_partial_tool_dispatch_total"), 0.0);
}

#[test]
fn gemini_and_responses_clients_get_their_own_formats() {
    let (_dir, sim, gateway) = proxy_world("");
    sim.script("gemini-proxy", json!([two_calls()]));
    let request = json!({"systemInstruction": {"parts": [{"text": "Be terse."}]},
        "contents": [{"role": "user", "parts": [{"text": "Weather in Paris and Tokyo?"}]}],
        "tools": [{"functionDeclarations": [{"name": "get_weather", "description": "Weather", "parameters": schema()}]}]});
    let (status, _, text) = post(
        &gateway.base,
        "/v1beta/models/gemini-proxy:streamGenerateContent?alt=sse",
        &request,
        &[("x-goog-api-key", "k")],
    );
    assert_eq!(status, 200, "{text}");
    let events = sse(&text);
    let calls: Vec<Value> = events
        .iter()
        .flat_map(|(_, data)| {
            data["candidates"][0]["content"]["parts"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter(|part| part.get("functionCall").is_some())
        .map(|part| part["functionCall"].clone())
        .collect();
    let arguments: Vec<&Value> = calls.iter().map(|call| &call["args"]).collect();
    assert_eq!(
        arguments,
        vec![&json!({"city": "Paris"}), &json!({"city": "Tokyo"})]
    );
    assert_eq!(events.last().unwrap().1["candidates"][0]["finishReason"], "STOP");

    // The follow-up echoes the call ids in its functionResponses (results in reverse order):
    // it is answered, and it continues the same conversation.
    sim.script("gemini-proxy", json!([{"text": "Paris 12C, Tokyo 20C."}]));
    // The model turn as a client accumulates it: the streamed text, then the calls.
    let text_streamed: String = events
        .iter()
        .flat_map(|(_, data)| {
            data["candidates"][0]["content"]["parts"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|part| part["text"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(text_streamed, "Checking both.");
    let mut model_parts = vec![json!({"text": text_streamed})];
    model_parts.extend(calls.iter().map(|call| json!({"functionCall": call})));
    let model_turn = json!({"role": "model", "parts": model_parts});
    let responses: Vec<Value> = calls
        .iter()
        .rev()
        .map(|call| json!({"functionResponse": {"id": call["id"], "name": "get_weather", "response": {"output": "ok"}}}))
        .collect();
    let mut follow_up = request.clone();
    follow_up["contents"] = json!([request["contents"][0], model_turn, {"role": "user", "parts": responses}]);
    let (status, headers, text) = post(
        &gateway.base,
        "/v1beta/models/gemini-proxy:generateContent",
        &follow_up,
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        body["candidates"][0]["content"]["parts"][0]["text"],
        "Paris 12C, Tokyo 20C."
    );
    assert!(
        operation_of(&headers).contains(".r"),
        "a Gemini follow-up should continue its conversation"
    );

    sim.script("resp-proxy", json!([{"text": "Hello there."}]));
    let request = json!({"model": "resp-proxy", "instructions": "Be terse.", "input": "Say hello."});
    let (status, _, text) = post(&gateway.base, "/v1/responses", &request, &[]);
    assert_eq!(status, 200, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["object"], "response");
    assert_eq!(body["status"], "completed");
    assert_eq!(body["output"][0]["content"][0]["text"], "Hello there.");
    // A `previous_response_id` that is not ours names history stored at the provider: refused.
    let request = json!({"model": "resp-proxy", "previous_response_id": "resp_1", "input": "More."});
    let (status, _, text) = post(&gateway.base, "/v1/responses", &request, &[]);
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("unrepresentable"), "{text}");
}

#[test]
fn responses_previous_response_id_continues_a_committed_proxy_response_with_tool_results() {
    let (_dir, sim, gateway) = proxy_world("");
    sim.script(
        "resp-chain",
        json!([two_calls(), {"text": "Paris 12C, Tokyo 20C."}, {"text": "A fork."}]),
    );
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": schema()}]);
    let request = json!({"model": "resp-chain", "instructions": "Be terse.", "tools": tools,
                         "input": [{"role": "user", "content": "Weather in Paris and Tokyo?"}]});
    let (status, _, text) = post(&gateway.base, "/v1/responses", &request, &[]);
    assert_eq!(status, 200, "{text}");
    let first: Value = serde_json::from_str(&text).unwrap();
    let calls: Vec<&Value> = first["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "function_call")
        .collect();
    assert_eq!(calls.len(), 2);
    // Only the results, continuing the response by id (results in reverse call order).
    let outputs = json!([
        {"type": "function_call_output", "call_id": calls[1]["call_id"], "output": "20C"},
        {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "12C"}]);
    let follow_up =
        json!({"model": "resp-chain", "previous_response_id": first["id"], "tools": tools, "input": outputs});
    let (status, headers, text) = post(&gateway.base, "/v1/responses", &follow_up, &[]);
    assert_eq!(status, 200, "{text}");
    let second: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(second["output"][0]["content"][0]["text"], "Paris 12C, Tokyo 20C.");
    // What we sent is the whole history: user, both calls, both results — a legal request.
    let sent = sent_for(&gateway, &sim, &operation_of(&headers));
    let body: Value = serde_json::from_str(sent[0]["body"].as_str().unwrap()).unwrap();
    let kinds: Vec<&str> = body["input"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| item["type"].as_str().unwrap_or("message"))
        .collect();
    assert_eq!(
        kinds.iter().filter(|kind| **kind == "function_call").count(),
        2,
        "{kinds:?}"
    );
    assert_eq!(
        kinds
            .iter()
            .filter(|kind| **kind == "function_call_output")
            .count(),
        2,
        "{kinds:?}"
    );
    // Instructions are not carried over (as at OpenAI): this request had none.
    assert!(body.get("instructions").is_none(), "{body}");
    // A result for a call the previous response never made is an orphan, refused unsent.
    let orphan = json!({"model": "resp-chain", "previous_response_id": first["id"], "input": [
        {"type": "function_call_output", "call_id": "call_never_made", "output": "x"}]});
    let before = sim.requests().len();
    let (status, _, text) = post(&gateway.base, "/v1/responses", &orphan, &[]);
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("orphan_result"), "{text}");
    assert_eq!(sim.requests().len(), before);
    // Continuing the same response twice forks: both are answered, neither disturbs the other.
    let fork =
        json!({"model": "resp-chain", "previous_response_id": first["id"], "tools": tools, "input": outputs});
    let (status, _, text) = post(&gateway.base, "/v1/responses", &fork, &[]);
    assert_eq!(status, 200, "{text}");
    // An unknown proxy id is the provider's 404.
    let missing = json!({"model": "resp-chain", "previous_response_id": "resp_proxy-nothing", "input": "x"});
    let (status, _, text) = post(&gateway.base, "/v1/responses", &missing, &[]);
    assert_eq!(status, 404, "{text}");
}

#[test]
fn shadow_forwards_the_original_bytes_and_records_byte_and_semantic_diffs() {
    let config = r#"
[[routes]]
api = "openai-chat"
model = "shadow-*"
mode = "shadow"
provider = "sim"
adapter = "openai-chat@1"

[[routes]]
api = "openai-chat"
model = "half-*"
mode = "on-no-tools"
provider = "sim"
adapter = "openai-chat@1"
"#;
    let (_dir, sim, gateway) = proxy_world(config);
    sim.script("shadow-model", json!([two_calls(), {"text": "fine"}]));
    // A client's request exactly as its SDK would write it (field order, spacing, `user`).
    let original = r#"{"model":"shadow-model","user":"u-42","messages":[{"role":"user","content":"Weather?"}],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}}]}"#;
    let response = client()
        .post(format!("{}/v1/chat/completions", gateway.base))
        .header("content-type", "application/json")
        .body(original)
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.headers()["x-turnstile-mode"], "shadow");
    let body: Value = response.json().unwrap();
    assert_eq!(
        body["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    let requests = sim.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(
        requests[0]["body"].as_str().unwrap(),
        original,
        "shadow must forward the original bytes"
    );

    // An illegal request in shadow mode is still forwarded (the provider answers) and recorded.
    let illegal = r#"{"model":"shadow-model","messages":[{"role":"user","content":"hi"},{"role":"tool","tool_call_id":"nope","content":"x"}]}"#;
    let _ = client()
        .post(format!("{}/v1/chat/completions", gateway.base))
        .header("content-type", "application/json")
        .body(illegal)
        .send()
        .unwrap();
    assert_eq!(sim.requests().len(), 2);

    // The comparison runs beside the response: poll for both records.
    let mut diffs = Value::Null;
    for _ in 0..100 {
        diffs = gateway.get("/v1/shadow/diffs");
        if diffs["diffs"].as_array().map_or(0, Vec::len) >= 2 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let records = diffs["diffs"].as_array().unwrap();
    assert_eq!(records.len(), 2, "{diffs}");
    // Comparisons run concurrently, so find each by what it found rather than by position.
    let newest = records
        .iter()
        .find(|record| record["verdict"] == "rejected")
        .expect("the illegal request's record");
    let first = records
        .iter()
        .find(|record| record["verdict"] == "ready")
        .expect("the legal request's record");
    assert_eq!(newest["differs"]["would_reject"], true);
    assert!(newest["violations"].to_string().contains("orphan_result"));
    // Nothing of ours was rendered for the refused request: no manifest (with the reason) and
    // no byte comparison at all — not "bytes: false".
    assert_eq!(newest["manifest"], Value::Null, "{newest}");
    assert_eq!(newest["manifest_reason"], "rejected", "{newest}");
    assert_eq!(newest["differs"]["bytes"], Value::Null, "{newest}");
    assert!(newest.get("bytes").is_none(), "{newest}");
    assert_eq!(first["verdict"], "ready", "{first}");
    assert_eq!(first["differs"]["bytes"], true, "{first}");
    assert!(first["bytes"]["first_difference_at"].as_u64().is_some());
    // The ready request's record carries the manifest of what we would have sent.
    let manifest = &first["manifest"];
    assert_eq!(manifest["format"], "turnstile.manifest.v1", "{first}");
    assert_eq!(manifest["adapter"], first["adapter"], "{first}");
    assert!(
        manifest["request_digest"]
            .as_str()
            .is_some_and(|digest| digest.starts_with("sha256:")),
        "{first}"
    );
    assert_eq!(first["manifest_reason"], Value::Null, "{first}");
    // `user` goes to a target of the client's own API (`passthrough.rs`): nothing is dropped.
    assert_eq!(first["dropped"], json!([]), "{first}");
    assert_eq!(first["differs"]["semantic"], false, "{first}");
    assert_eq!(
        gateway.metric("turnstile_shadow_comparisons_total{api=\"openai-chat\"}"),
        2.0
    );
    assert_eq!(
        gateway.metric("turnstile_shadow_diffs_total{api=\"openai-chat\",kind=\"would_reject\"}"),
        1.0
    );

    // on-no-tools: a request without tools is ours (re-rendered), one with tools is forwarded.
    sim.script("half-model", json!([{"text": "plain"}, two_calls()]));
    let plain = r#"{"model":"half-model","messages":[{"role":"user","content":"hi"}]}"#;
    let response = client()
        .post(format!("{}/v1/chat/completions", gateway.base))
        .header("content-type", "application/json")
        .body(plain)
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert!(response.headers().get("x-turnstile-operation-id").is_some());
    let with_tools = r#"{"model":"half-model","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}}]}"#;
    let response = client()
        .post(format!("{}/v1/chat/completions", gateway.base))
        .header("content-type", "application/json")
        .body(with_tools)
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.headers()["x-turnstile-mode"], "on-no-tools");
    let requests = sim.requests();
    let bodies: Vec<&str> = requests
        .iter()
        .map(|request| request["body"].as_str().unwrap())
        .collect();
    assert_ne!(bodies[2], plain, "a request without tools must be ours");
    assert_eq!(bodies[3], with_tools, "a request with tools must be the original");
}

#[test]
fn rolling_back_to_an_older_adapter_pauses_a_conversation_it_cannot_represent() {
    let config = r#"
[[routes]]
api = "openai-chat"
model = "old-*"
provider = "sim"
adapter = "openai-chat@1"

[[routes]]
api = "openai-chat"
model = "new-*"
provider = "sim"
adapter = "openai-chat@2"
"#;
    let (_dir, sim, gateway) = proxy_world(config);
    let with_file = |model: &str| {
        json!({"model": model, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Summarize."},
            {"type": "file", "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0xLjQK"}}]}]})
    };
    let (status, _, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &with_file("old-model"),
        &[],
    );
    assert_eq!(status, 400, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["code"], "paused", "{body}");
    assert!(sim.requests().is_empty(), "a paused conversation was sent");
    sim.script("new-model", json!([{"text": "A summary."}]));
    let (status, _, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &with_file("new-model"),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "A summary.");
    // Without a matching route there is no silent default.
    let (status, _, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &json!({"model": "other", "messages": []}),
        &[],
    );
    assert_eq!(status, 404, "{text}");
}

#[test]
fn a_retry_with_the_same_idempotency_key_attaches_and_never_sends_twice() {
    let (_dir, sim, gateway) = proxy_world("");
    sim.script("gpt-idem", json!([{"text": "Once."}, {"text": "Twice?"}]));
    let request = chat_request(
        "gpt-idem",
        json!([{"role": "user", "content": "Say it once."}]),
        false,
    );
    let key = [("idempotency-key", "retry-me-1")];
    let (status, headers_1, text_1) = post(&gateway.base, "/v1/chat/completions", &request, &key);
    assert_eq!(status, 200, "{text_1}");
    let (status, headers_2, text_2) = post(&gateway.base, "/v1/chat/completions", &request, &key);
    assert_eq!(status, 200, "{text_2}");
    let (first, second): (Value, Value) = (
        serde_json::from_str(&text_1).unwrap(),
        serde_json::from_str(&text_2).unwrap(),
    );
    assert_eq!(first["choices"][0]["message"]["content"], "Once.");
    assert_eq!(second["choices"][0]["message"]["content"], "Once.");
    assert_eq!(operation_of(&headers_1), operation_of(&headers_2));
    assert_eq!(sim.requests().len(), 1);
    // The retry is answered with the provider's own usage and stop reason, as the first was
    // (the simulator counts prompt bytes / 4, our admission counter does not).
    assert_eq!(second["usage"], first["usage"], "{second}");
    assert_eq!(
        second["choices"][0]["finish_reason"],
        first["choices"][0]["finish_reason"]
    );
    let dispatch = gateway.get(&format!("/v1/dispatches/{}", operation_of(&headers_1)));
    assert_eq!(dispatch["manifest"]["prompt_tokens"].as_u64().is_some(), true);
    assert_ne!(
        first["usage"]["prompt_tokens"], dispatch["manifest"]["prompt_tokens"],
        "the test needs the provider's count to differ from ours to mean anything"
    );
    // The same key with another history is a conflict, not a silent reuse.
    let other = chat_request(
        "gpt-idem",
        json!([{"role": "user", "content": "Something else."}]),
        false,
    );
    let (status, _, text) = post(&gateway.base, "/v1/chat/completions", &other, &key);
    assert_eq!(status, 409, "{text}");
    assert_eq!(sim.requests().len(), 1);
}

/// Text deltas and the error event of an Anthropic stream.
fn anthropic_text_and_errors(text: &str) -> (String, Vec<Value>) {
    let events = sse(text);
    let streamed = events
        .iter()
        .filter(|(_, data)| data["delta"]["type"] == "text_delta")
        .map(|(_, data)| data["delta"]["text"].as_str().unwrap().to_owned())
        .collect();
    let errors = events
        .iter()
        .filter(|(name, _)| name == "error")
        .map(|(_, data)| data.clone())
        .collect();
    (streamed, errors)
}

#[test]
fn a_new_attempt_continues_the_client_stream_only_while_it_agrees_with_the_text_already_sent() {
    let (_dir, sim, gateway) = proxy_world("");
    let request = |model: &str| {
        json!({"model": model, "max_tokens": 128, "stream": true,
               "messages": [{"role": "user", "content": "Tell me."}]})
    };
    // The connection drops after a few text deltas; the next attempt says the same: the client
    // sees every word exactly once and no error.
    let same = "Alpha beta gamma delta epsilon.";
    sim.script(
        "claude-same",
        json!([{"text": same, "faults": {"disconnect_after_events": 5}}, {"text": same}]),
    );
    let (status, headers, text) = post(&gateway.base, "/v1/messages", &request("claude-same"), &[]);
    assert_eq!(status, 200, "{text}");
    let (streamed, errors) = anthropic_text_and_errors(&text);
    assert!(errors.is_empty(), "{text}");
    assert_eq!(streamed, same);
    let operation = operation_of(&headers);
    let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
    assert_eq!(dispatch["state"], "COMMITTED");
    assert!(dispatch["attempts"].as_array().unwrap().len() >= 2, "{dispatch}");

    // The next attempt says something else: what was sent cannot be taken back in the client's
    // format, so the stream ends with Anthropic's error event and never shows the other text
    // as a continuation. The dispatch still commits exactly one turn.
    sim.script(
        "claude-other",
        json!([{"text": same, "faults": {"disconnect_after_events": 5}}, {"text": "Zeta eta theta."}]),
    );
    let (status, headers, text) = post(&gateway.base, "/v1/messages", &request("claude-other"), &[]);
    assert_eq!(status, 200, "{text}");
    let (streamed, errors) = anthropic_text_and_errors(&text);
    assert_eq!(errors.len(), 1, "{text}");
    assert_eq!(errors[0]["error"]["code"], "preview_diverged", "{text}");
    assert!(
        same.starts_with(&streamed) && !streamed.is_empty(),
        "{streamed:?}"
    );
    let operation = operation_of(&headers);
    let mut dispatch = Value::Null;
    for _ in 0..100 {
        dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
        if dispatch["state"] == "COMMITTED" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(dispatch["state"], "COMMITTED", "{dispatch}");
    assert!(gateway.metric("turnstile_preview_retractions_total") >= 2.0);
}

#[test]
fn with_tenants_the_sdk_key_headers_carry_the_tenant_token_and_shadow_records_stay_scoped() {
    let config = r#"
[[tenants]]
name = "acme"
token = "tok-acme"

[[tenants]]
name = "globex"
token = "tok-globex"

[[routes]]
api = "openai-chat"
model = "shadow-*"
mode = "shadow"
provider = "sim"
adapter = "openai-chat@2"

[[routes]]
api = "anthropic-messages"
provider = "sim"
adapter = "anthropic-messages@2"
"#;
    let (_dir, sim, gateway) = proxy_world(config);
    let messages =
        json!({"model": "claude-t", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]});
    let (status, _, text) = post(
        &gateway.base,
        "/v1/messages",
        &messages,
        &[("x-api-key", "wrong")],
    );
    assert_eq!(status, 401, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["type"], "authentication_error");
    sim.script("claude-t", json!([{"text": "Hello acme."}]));
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/messages",
        &messages,
        &[("x-api-key", "tok-acme")],
    );
    assert_eq!(status, 200, "{text}");
    // The tenant's own dispatch, under its own id; another tenant cannot see it.
    let operation = operation_of(&headers);
    let own = client()
        .get(format!("{}/v1/dispatches/{operation}", gateway.base))
        .bearer_auth("tok-acme")
        .send()
        .unwrap();
    assert_eq!(own.status().as_u16(), 200);
    let other = client()
        .get(format!("{}/v1/dispatches/{operation}", gateway.base))
        .bearer_auth("tok-globex")
        .send()
        .unwrap();
    assert_eq!(other.status().as_u16(), 404);
    // The client's key is never forwarded to the provider.
    assert!(
        !sim.requests()
            .iter()
            .any(|request| request.to_string().contains("tok-acme"))
    );

    // A streamed shadow request is relayed byte for byte; its record is the tenant's alone.
    sim.script("shadow-t", json!([{"text": "relayed"}]));
    let original = r#"{"model":"shadow-t","stream":true,"messages":[{"role":"user","content":"Hi"}]}"#;
    let response = client()
        .post(format!("{}/v1/chat/completions", gateway.base))
        .header("content-type", "application/json")
        .bearer_auth("tok-globex")
        .body(original)
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = response.text().unwrap();
    let content: String = sse(&text)
        .iter()
        .filter_map(|(_, data)| data["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "relayed");
    let diffs = |token: &str| -> Value {
        let mut found = Value::Null;
        for _ in 0..100 {
            found = client()
                .get(format!("{}/v1/shadow/diffs", gateway.base))
                .bearer_auth(token)
                .send()
                .unwrap()
                .json()
                .unwrap();
            if token != "tok-globex" || !found["diffs"].as_array().unwrap().is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        found
    };
    assert_eq!(diffs("tok-globex")["diffs"].as_array().unwrap().len(), 1);
    assert!(diffs("tok-acme")["diffs"].as_array().unwrap().is_empty());
}

#[test]
fn a_provider_refusal_keeps_its_status_in_the_clients_error_shape() {
    let (_dir, sim, gateway) = proxy_world("");
    sim.script(
        "claude-busy",
        json!([{"text": "never", "faults": {"status": 429}}]),
    );
    let request =
        json!({"model": "claude-busy", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]});
    let (status, headers, text) = post(&gateway.base, "/v1/messages", &request, &[]);
    assert_eq!(status, 429, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
    let _ = headers;
    assert_eq!(
        sim.requests().len(),
        1,
        "a refused attempt is not retried blindly"
    );
    // Streaming too: the status line waits for the first output, so the refusal is an HTTP 429
    // the SDK raises as its rate-limit error, not a 200 with an error event inside.
    sim.script(
        "claude-busy",
        json!([{"text": "never", "faults": {"status": 429}}]),
    );
    let mut request = request;
    request["stream"] = json!(true);
    let (status, _, text) = post(&gateway.base, "/v1/messages", &request, &[]);
    assert_eq!(status, 429, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
    // The same Idempotency-Key after the provider recovers starts a new dispatch instead of
    // replaying the failure for ever.
    sim.script(
        "claude-busy",
        json!([{"text": "never", "faults": {"status": 429}}, {"text": "Recovered."}]),
    );
    let request =
        json!({"model": "claude-busy", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]});
    let key = [("idempotency-key", "busy-1")];
    let (status, _, text) = post(&gateway.base, "/v1/messages", &request, &key);
    assert_eq!(status, 429, "{text}");
    let (status, headers, text) = post(&gateway.base, "/v1/messages", &request, &key);
    assert_eq!(status, 200, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["content"][0]["text"], "Recovered.");
    let retried = operation_of(&headers);
    assert!(retried.ends_with(".k1"), "{retried}");
    // …and a third ask attaches to the committed one: no new send.
    let sent = sim.requests().len();
    let (status, headers, _) = post(&gateway.base, "/v1/messages", &request, &key);
    assert_eq!(status, 200);
    assert_eq!(operation_of(&headers), retried);
    assert_eq!(sim.requests().len(), sent);
}

#[test]
fn generation_settings_reach_the_provider_in_its_own_fields_or_are_refused_by_name() {
    let config = r#"
[[routes]]
api = "anthropic-messages"
model = "claude-*"
provider = "sim"
adapter = "openai-chat@2"
target_model = "gpt-under"

[[routes]]
api = "openai-chat"
provider = "sim"
adapter = "anthropic-messages@2"
"#;
    let (_dir, sim, gateway) = proxy_world(config);
    sim.script("gpt-under", json!([{"text": "cold"}]));
    let request = json!({"model": "claude-x", "max_tokens": 64, "temperature": 0, "stop_sequences": ["END"],
                         "messages": [{"role": "user", "content": "Hi"}]});
    let (status, headers, text) = post(&gateway.base, "/v1/messages", &request, &[]);
    assert_eq!(status, 200, "{text}");
    let sent = sent_for(&gateway, &sim, &operation_of(&headers));
    let body: Value = serde_json::from_str(sent[0]["body"].as_str().unwrap()).unwrap();
    assert_eq!(body["temperature"].as_f64(), Some(0.0), "{body}");
    assert_eq!(body["stop"], json!(["END"]), "{body}");
    assert!(headers.get("x-turnstile-dropped").is_none());
    // `seed` has no field in Anthropic Messages: refused by name, in the client's error shape,
    // and nothing is sent.
    let before = sim.requests().len();
    let request = json!({"model": "gpt-y", "seed": 7, "messages": [{"role": "user", "content": "Hi"}]});
    let (status, _, text) = post(&gateway.base, "/v1/chat/completions", &request, &[]);
    assert_eq!(status, 400, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["code"], "unsupported_setting", "{body}");
    assert_eq!(body["error"]["setting"], "seed", "{body}");
    assert_eq!(sim.requests().len(), before);
}

#[test]
fn a_streamed_client_that_leaves_before_the_commit_still_has_its_calls_handed_over() {
    let (_dir, sim, gateway) = proxy_world("");
    // 60 text events at 50 ms before the calls: the status line goes out with the first
    // preview, seconds before the commit, and the stream's writes fail once the client is gone.
    let mut slow = two_calls();
    slow["text"] = json!("word ".repeat(60));
    slow["faults"] = json!({"delay_ms": 50});
    sim.script("gpt-leaves", json!([slow]));
    let question = json!([{"role": "user", "content": "Weather in Paris and Tokyo?"}]);
    let response = client()
        .post(format!("{}/v1/chat/completions", gateway.base))
        .header("content-type", "application/json")
        .body(chat_request("gpt-leaves", question, true).to_string())
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let operation = operation_of(response.headers());
    // The client leaves without reading its stream.
    drop(response);
    // The request's reader goes on without it: the dispatch commits and its calls are handed
    // over (bounded poll on the ledger).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let handed = loop {
        let handed = gateway.get("/v1/tool-calls?state=client")["tool_calls"]
            .as_array()
            .unwrap()
            .clone();
        if handed.len() == 2 {
            break handed;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not handed to the client: {handed:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(
        handed.iter().all(|call| call["holder"] == "proxy-client"),
        "{handed:?}"
    );
    assert_eq!(
        gateway.get(&format!("/v1/dispatches/{operation}"))["state"],
        "COMMITTED"
    );
}

#[test]
fn a_request_arriving_while_a_continuation_is_still_streaming_forks_instead_of_breaking_it() {
    let (_dir, sim, gateway) = proxy_world("");
    // R0 commits two calls; R1 (results) continues that conversation and streams slowly; R2 (R1's
    // history plus a question) arrives meanwhile. Appending R2 would make R1's commit lose.
    sim.script(
        "gpt-race",
        json!([two_calls(),
        {"text": "Paris 12C and Tokyo 20C, slowly.", "faults": {"delay_ms": 80}},
        {"text": "A title."}]),
    );
    let question = json!([{"role": "user", "content": "Weather in Paris and Tokyo?"}]);
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat_request("gpt-race", question.clone(), false),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let first_operation = operation_of(&headers);
    let body: Value = serde_json::from_str(&text).unwrap();
    let message = body["choices"][0]["message"].clone();
    let calls = message["tool_calls"].as_array().unwrap().clone();
    let mut r1 = question.as_array().unwrap().clone();
    r1.push(message);
    for call in &calls {
        r1.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "ok"}));
    }
    let mut r2 = r1.clone();
    r2.push(json!({"role": "assistant", "content": "Paris 12C and Tokyo 20C, slowly."}));
    r2.push(json!({"role": "user", "content": "Give this a title."}));
    let base = gateway.base.clone();
    let slow = {
        let request = chat_request("gpt-race", json!(r1), false);
        std::thread::spawn(move || post(&base, "/v1/chat/completions", &request, &[]))
    };
    // Send R2 only while R1's dispatch (at the revision its results brought the conversation
    // to) is still running, so the test always exercises the race it is about.
    let running = format!("/v1/dispatches/{first_operation}.r3");
    let mut state = Value::Null;
    for _ in 0..200 {
        state = gateway.get(&running)["state"].clone();
        if matches!(state.as_str(), Some("SENT" | "STREAMING")) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        matches!(state.as_str(), Some("SENT" | "STREAMING")),
        "R1 was not in flight: {state}"
    );
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat_request("gpt-race", json!(r2), false),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let forked = operation_of(&headers);
    let (status, headers, text) = slow.join().unwrap();
    assert_eq!(status, 200, "the slow continuation must still commit: {text}");
    let continued = operation_of(&headers);
    assert!(
        continued.starts_with(&format!("{first_operation}.r")),
        "{continued}"
    );
    assert!(
        !forked.starts_with(&first_operation),
        "{forked} appended onto a running dispatch"
    );
    for operation in [&continued, &forked] {
        assert_eq!(
            gateway.get(&format!("/v1/dispatches/{operation}"))["state"],
            "COMMITTED"
        );
    }
    assert!(
        gateway.get("/v1/quarantine")["quarantine"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}

#[test]
fn shadow_relays_the_providers_headers_and_a_keyed_retry_with_other_tools_conflicts() {
    let config = r#"
[[routes]]
api = "anthropic-messages"
model = "shadow-*"
mode = "shadow"
provider = "sim"
adapter = "anthropic-messages@2"

[[routes]]
api = "anthropic-messages"
provider = "sim"
adapter = "anthropic-messages@2"
"#;
    let (_dir, sim, gateway) = proxy_world(config);
    sim.script(
        "shadow-busy",
        json!([{"text": "never", "faults": {"status": 429}}]),
    );
    let request =
        json!({"model": "shadow-busy", "max_tokens": 32, "messages": [{"role": "user", "content": "Hi"}]});
    let response = client()
        .post(format!("{}/v1/messages", gateway.base))
        .json(&request)
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 429);
    assert_eq!(
        response.headers()["retry-after"],
        "1",
        "the provider's backoff hint must reach the SDK"
    );

    let tools = |name: &str| json!([{"name": name, "input_schema": {"type": "object"}}]);
    let keyed = |name: &str| json!({"model": "claude-k", "max_tokens": 32, "tools": tools(name), "messages": [{"role": "user", "content": "Hi"}]});
    sim.script("claude-k", json!([{"text": "ok"}]));
    let key = [("idempotency-key", "tools-1")];
    let (status, _, text) = post(&gateway.base, "/v1/messages", &keyed("get_weather"), &key);
    assert_eq!(status, 200, "{text}");
    let (status, _, text) = post(&gateway.base, "/v1/messages", &keyed("get_time"), &key);
    assert_eq!(
        status, 409,
        "the same key with other tools is another request: {text}"
    );
}

/// A provider on loopback that answers every request with the same captured stream bytes, and
/// counts the requests.
fn replaying_provider(capture: Vec<u8>) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = count.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            // Read the head and the declared body, then answer and close.
            let mut request = Vec::new();
            let mut buffer = [0u8; 8192];
            loop {
                let Ok(read) = stream.read(&mut buffer) else { break };
                if read == 0 {
                    break;
                }
                request.extend_from_slice(&buffer[..read]);
                let text = String::from_utf8_lossy(&request).to_string();
                if let Some(end) = text.find("\r\n\r\n") {
                    let length = text[..end]
                        .lines()
                        .find_map(|line| {
                            line.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    if request.len() >= end + 4 + length {
                        break;
                    }
                }
            }
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                capture.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&capture);
        }
    });
    (base, count)
}

#[test]
fn a_response_cut_by_the_output_cap_inside_tool_arguments_is_sent_once_and_refused() {
    // A real Anthropic capture: `max_tokens` reached in the middle of a tool call's JSON input.
    let shared = std::env::var_os("TURNSTILE_SHARED")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    let capture =
        std::fs::read(shared.join("fixtures/provider-streams/anthropic/max-tokens-mid-tool-input.sse"))
            .expect("the shared provider captures (scripts/test sets TURNSTILE_SHARED)");
    let (provider, requests) = replaying_provider(capture);
    let config = format!(
        "[providers.replay]\nbase_url = \"{provider}\"\n\n[[routes]]\napi = \"anthropic-messages\"\nprovider = \"replay\"\nadapter = \"anthropic-messages@2\"\n"
    );
    let (_dir, _sim, gateway) = proxy_world(&config);
    let request = json!({"model": "claude-3-7-sonnet-20250219", "max_tokens": 124,
                         "messages": [{"role": "user", "content": "Write the report."}]});
    let (status, _, text) = post(&gateway.base, "/v1/messages", &request, &[]);
    assert_eq!(status, 400, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["code"], "max_tokens_in_tool_arguments", "{body}");
    // Retrying the same bytes under the same cap would only bill the same truncation.
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(gateway.metric("turnstile_partial_tool_dispatch_total"), 0.0);
}

/// The body the simulator received last, as JSON.
fn last_sent(sim: &SimProcess) -> Value {
    let requests = sim.requests();
    let last = requests.last().expect("something was sent");
    serde_json::from_str(last["body"].as_str().unwrap()).unwrap()
}

#[test]
fn tool_choice_and_parallel_tool_calls_reach_the_provider_of_the_same_api_exactly() {
    let (_dir, sim, gateway) = proxy_world("");
    let chat_tools =
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": schema()}}]);
    let request = json!({"model": "gpt-tc", "messages": [{"role": "user", "content": "Weather?"}], "tools": chat_tools,
                         "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                         "parallel_tool_calls": false});
    let (status, headers, text) = post(&gateway.base, "/v1/chat/completions", &request, &[]);
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("x-turnstile-dropped").is_none(), "{headers:?}");
    let body = last_sent(&sim);
    assert_eq!(body["tool_choice"], request["tool_choice"], "{body}");
    assert_eq!(body["parallel_tool_calls"], json!(false), "{body}");

    let request = json!({"model": "gpt-tc", "input": "Weather?",
                         "tools": [{"type": "function", "name": "get_weather", "parameters": schema()}],
                         "tool_choice": {"type": "allowed_tools", "mode": "required",
                                         "tools": [{"type": "function", "name": "get_weather"}]},
                         "parallel_tool_calls": true});
    let (status, headers, text) = post(&gateway.base, "/v1/responses", &request, &[]);
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("x-turnstile-dropped").is_none(), "{headers:?}");
    let body = last_sent(&sim);
    assert_eq!(body["tool_choice"], request["tool_choice"], "{body}");
    assert_eq!(body["parallel_tool_calls"], json!(true), "{body}");

    let request = json!({"model": "claude-tc", "max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}],
                         "tools": [{"name": "get_weather", "input_schema": schema()}],
                         "tool_choice": {"type": "any", "disable_parallel_tool_use": true}});
    let (status, headers, text) = post(&gateway.base, "/v1/messages", &request, &[]);
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("x-turnstile-dropped").is_none(), "{headers:?}");
    assert_eq!(last_sent(&sim)["tool_choice"], request["tool_choice"]);

    let request = json!({"contents": [{"role": "user", "parts": [{"text": "Weather?"}]}],
                         "tools": [{"functionDeclarations": [{"name": "get_weather", "parametersJsonSchema": schema()}]}],
                         "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}}});
    let (status, headers, text) = post(
        &gateway.base,
        "/v1beta/models/gemini-tc:generateContent",
        &request,
        &[],
    );
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("x-turnstile-dropped").is_none(), "{headers:?}");
    assert_eq!(last_sent(&sim)["toolConfig"], request["toolConfig"]);
}

#[test]
fn tool_choice_crosses_apis_only_where_the_meaning_is_identical_and_is_refused_by_name_otherwise() {
    let config = r#"
[[routes]]
api = "anthropic-messages"
provider = "sim"
adapter = "openai-chat@2"
target_model = "gpt-under"

[[routes]]
api = "openai-chat"
model = "gpt-*"
provider = "sim"
adapter = "anthropic-messages@2"

[[routes]]
api = "openai-chat"
model = "gem-*"
provider = "sim"
adapter = "gemini@1"
"#;
    let (_dir, sim, gateway) = proxy_world(config);
    // Anthropic `tool` + `disable_parallel_tool_use` is OpenAI's named function without
    // parallel calls.
    let request = json!({"model": "claude-x", "max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}],
                         "tools": [{"name": "get_weather", "input_schema": schema()}],
                         "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true}});
    let (status, headers, text) = post(&gateway.base, "/v1/messages", &request, &[]);
    assert_eq!(status, 200, "{text}");
    let sent = sent_for(&gateway, &sim, &operation_of(&headers));
    let body: Value = serde_json::from_str(sent[0]["body"].as_str().unwrap()).unwrap();
    assert_eq!(
        body["tool_choice"],
        json!({"type": "function", "function": {"name": "get_weather"}}),
        "{body}"
    );
    assert_eq!(body["parallel_tool_calls"], json!(false), "{body}");
    // OpenAI `required` is Anthropic `any`.
    let chat = |model: &str, choice: Value, parallel: Value| {
        json!({"model": model, "messages": [{"role": "user", "content": "Weather?"}],
               "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": schema()}}],
               "tool_choice": choice, "parallel_tool_calls": parallel})
    };
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat("gpt-y", json!("required"), Value::Null),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let sent = sent_for(&gateway, &sim, &operation_of(&headers));
    let body: Value = serde_json::from_str(sent[0]["body"].as_str().unwrap()).unwrap();
    assert_eq!(body["tool_choice"], json!({"type": "any"}), "{body}");
    // A named function is Gemini's ANY restricted to that name.
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat(
            "gem-y",
            json!({"type": "function", "function": {"name": "get_weather"}}),
            Value::Null,
        ),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let sent = sent_for(&gateway, &sim, &operation_of(&headers));
    let body: Value = serde_json::from_str(sent[0]["body"].as_str().unwrap()).unwrap();
    assert_eq!(
        body["toolConfig"],
        json!({"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}}),
        "{body}"
    );
    // Refused by name, in the client's error shape, and nothing sent: Anthropic cannot say
    // "one of these tools, optionally"; Gemini has no parallel switch; a name the request does
    // not declare.
    let allowed = json!({"type": "allowed_tools", "allowed_tools": {"mode": "auto",
                         "tools": [{"type": "function", "function": {"name": "get_weather"}}]}});
    for (request, code, setting) in [
        (
            chat("gpt-y", allowed, Value::Null),
            "unsupported_setting",
            "tool_choice",
        ),
        (
            chat("gem-y", json!("auto"), json!(false)),
            "unsupported_setting",
            "parallel_tool_calls",
        ),
        (
            chat(
                "gpt-y",
                json!({"type": "function", "function": {"name": "launch"}}),
                Value::Null,
            ),
            "unknown_tool",
            "tool_choice",
        ),
    ] {
        let before = sim.requests().len();
        let (status, _, text) = post(&gateway.base, "/v1/chat/completions", &request, &[]);
        assert_eq!(status, 400, "{text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(body["error"]["code"], code, "{body}");
        assert_eq!(body["error"]["setting"], setting, "{body}");
        assert_eq!(sim.requests().len(), before, "{request}");
    }
}

#[test]
fn the_native_dispatch_takes_a_tool_choice_under_its_neutral_name() {
    let (_dir, sim, gateway) = proxy_world("");
    let tools = json!([{"name": "get_weather", "input_schema": schema()}]);
    let (status, _) = gateway.post(
        "/v1/conversations",
        json!({"conversation_id": "c-tc", "tools": tools}),
    );
    assert_eq!(status, 201);
    let (status, _) = gateway.post(
        "/v1/conversations/c-tc/turns",
        json!({"expected_revision": 0, "turn": {"id": "t1", "role": "user",
               "blocks": [{"id": "u1", "kind": "text", "text": "Weather?"}]}}),
    );
    assert_eq!(status, 200);
    let dispatch = |operation: &str, adapter: &str, extra: Value| {
        let mut body = json!({"operation_id": operation,
                              "target": {"provider": "sim", "model": "m-tc", "adapter": adapter}});
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        gateway.post("/v1/conversations/c-tc/dispatch", body)
    };
    let before = sim.requests().len();
    let (status, body) = dispatch(
        "op-gemini",
        "gemini@1",
        json!({"tool_choice": {"type": "required"}, "parallel_tool_calls": false}),
    );
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["code"], "unsupported_setting", "{body}");
    let (status, body) = dispatch(
        "op-odd",
        "gemini@1",
        json!({"tool_choice": {"type": "sometimes"}}),
    );
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (422, json!("invalid_request")),
        "{body}"
    );
    assert_eq!(sim.requests().len(), before);
    let (status, body) = dispatch(
        "op-anthropic",
        "anthropic-messages@2",
        json!({"tool_choice": {"type": "tool", "name": "get_weather"}, "parallel_tool_calls": false}),
    );
    assert_eq!(status, 200, "{body}");
    let view = gateway.get("/v1/dispatches/op-anthropic");
    let request_body: Value = serde_json::from_str(view["request_body"].as_str().unwrap()).unwrap();
    assert_eq!(
        request_body["tool_choice"],
        json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true}),
        "{view}"
    );
    let sent = sent_for(&gateway, &sim, "op-anthropic");
    assert_eq!(sent.len(), 1);
}

#[test]
fn structured_output_reaches_the_provider_with_the_clients_meaning_or_is_refused_by_name() {
    let answer = json!({"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
                        "additionalProperties": false});
    // Same API: carried exactly.
    let (_dir, sim, gateway) = proxy_world("");
    let format =
        json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": answer, "strict": true}});
    let request = json!({"model": "gpt-so", "messages": [{"role": "user", "content": "Answer."}], "response_format": format});
    let (status, headers, text) = post(&gateway.base, "/v1/chat/completions", &request, &[]);
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("x-turnstile-dropped").is_none(), "{headers:?}");
    assert_eq!(last_sent(&sim)["response_format"], format);
    let request = json!({"model": "gpt-so", "input": "Answer.",
                         "text": {"format": {"type": "json_schema", "name": "answer", "schema": answer}}});
    let (status, headers, text) = post(&gateway.base, "/v1/responses", &request, &[]);
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("x-turnstile-dropped").is_none(), "{headers:?}");
    assert_eq!(last_sent(&sim)["text"], request["text"]);
    let config = json!({"maxOutputTokens": 64, "responseMimeType": "application/json",
                        "responseSchema": {"type": "OBJECT", "properties": {"answer": {"type": "STRING"}}}});
    let request =
        json!({"contents": [{"role": "user", "parts": [{"text": "Answer."}]}], "generationConfig": config});
    let (status, headers, text) = post(
        &gateway.base,
        "/v1beta/models/gemini-so:generateContent",
        &request,
        &[],
    );
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("x-turnstile-dropped").is_none(), "{headers:?}");
    assert_eq!(last_sent(&sim)["generationConfig"], config);
    drop(gateway);

    // Across APIs: a Gemini JSON schema is OpenAI's json_schema; nothing can go to Anthropic.
    let config = r#"
[[routes]]
api = "gemini"
provider = "sim"
adapter = "openai-chat@2"
target_model = "gpt-under"

[[routes]]
api = "openai-chat"
provider = "sim"
adapter = "anthropic-messages@2"
"#;
    let (_dir, sim, gateway) = proxy_world(config);
    let request = json!({"contents": [{"role": "user", "parts": [{"text": "Answer."}]}],
                         "generationConfig": {"responseMimeType": "application/json", "responseJsonSchema": answer}});
    let (status, headers, text) = post(
        &gateway.base,
        "/v1beta/models/gemini-x:generateContent",
        &request,
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let sent = sent_for(&gateway, &sim, &operation_of(&headers));
    let body: Value = serde_json::from_str(sent[0]["body"].as_str().unwrap()).unwrap();
    assert_eq!(
        body["response_format"],
        json!({"type": "json_schema", "json_schema": {"name": "response", "schema": answer}}),
        "{body}"
    );
    let before = sim.requests().len();
    let request = json!({"model": "gpt-y", "messages": [{"role": "user", "content": "Answer."}],
                         "response_format": {"type": "json_object"}});
    let (status, _, text) = post(&gateway.base, "/v1/chat/completions", &request, &[]);
    assert_eq!(status, 400, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["code"], "unsupported_setting", "{body}");
    assert_eq!(body["error"]["setting"], "output_format", "{body}");
    assert_eq!(sim.requests().len(), before);
}

#[test]
fn an_anthropic_thread_is_refused_with_the_code_the_sdk_falls_back_on_and_nothing_is_sent() {
    let (_dir, sim, gateway) = proxy_world("");
    let before = sim.requests().len();
    for thread in [
        json!({"type": "create"}),
        json!({"type": "continue", "previous_message_id": "msg_1"}),
    ] {
        let request = json!({"model": "claude-thread", "max_tokens": 64, "thread": thread,
                             "messages": [{"role": "user", "content": "Hi"}]});
        let (status, _, text) = post(&gateway.base, "/v1/messages", &request, &[]);
        assert_eq!(status, 400, "{text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(body["type"], "error", "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        assert_eq!(
            body["error"]["details"]["error_code"], "thread_unsupported_request",
            "{body}"
        );
    }
    // Other server-side state is refused by name too.
    for (field, value) in [
        ("container", json!("container_1")),
        (
            "context_management",
            json!({"edits": [{"type": "clear_tool_uses_20250919"}]}),
        ),
        (
            "mcp_servers",
            json!([{"type": "url", "url": "https://example.com", "name": "x"}]),
        ),
    ] {
        let mut request = json!({"model": "claude-thread", "max_tokens": 64,
                                 "messages": [{"role": "user", "content": "Hi"}]});
        request[field] = value;
        let (status, _, text) = post(&gateway.base, "/v1/messages", &request, &[]);
        assert_eq!(status, 400, "{text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(body["error"]["code"], "unrepresentable", "{body}");
        assert_eq!(body["error"]["path"], field, "{body}");
    }
    assert_eq!(sim.requests().len(), before);
    // Without the thread, the same request goes through.
    let request =
        json!({"model": "claude-thread", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]});
    let (status, _, text) = post(&gateway.base, "/v1/messages", &request, &[]);
    assert_eq!(status, 200, "{text}");
}

/// A request with a method, headers and a body; the status and the body as JSON.
fn call(
    base: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> (u16, Value) {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut request = client().request(method, format!("{base}{path}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body.to_string());
    }
    let response = request.send().unwrap();
    let status = response.status().as_u16();
    let text = response.text().unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|_| json!({"not_json": text})),
    )
}

#[test]
fn gemini_is_served_under_v1_as_well_as_v1beta_and_every_proxy_error_has_the_clients_shape() {
    let (_dir, sim, gateway) = proxy_world("");
    sim.script(
        "gemini-v1",
        json!([{"text": "From v1."}, {"text": "Streamed from v1."}]),
    );
    let google = [("x-goog-api-key", "g-key")];
    let request = json!({"contents": [{"role": "user", "parts": [{"text": "Hi"}]}]});
    let (status, body) = call(
        &gateway.base,
        "POST",
        "/v1/models/gemini-v1:generateContent",
        &google,
        Some(&request),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["candidates"][0]["content"]["parts"][0]["text"], "From v1.",
        "{body}"
    );
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/models/gemini-v1:streamGenerateContent?alt=sse",
        &request,
        &google,
    );
    assert_eq!(status, 200, "{text}");
    let streamed: String = sse(&text)
        .iter()
        .filter_map(|(_, data)| {
            data["candidates"][0]["content"]["parts"][0]["text"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(streamed, "Streamed from v1.", "{text}");
    // Both requests rendered the same body (the gateway always streams upstream): two sends.
    assert_eq!(sent_for(&gateway, &sim, &operation_of(&headers)).len(), 2);

    let before = sim.requests().len();
    let gemini_error = |body: &Value, status: u16, kind: &str| {
        assert_eq!(body["error"]["code"], json!(status), "{body}");
        assert_eq!(body["error"]["status"], kind, "{body}");
        assert!(body["error"]["message"].is_string(), "{body}");
    };
    for (method, path) in [
        ("POST", "/v1beta/models/gemini-v1:embedContent"),
        ("POST", "/v1/models/gemini-v1:countTokens"),
        ("GET", "/v1beta/files"),
        ("POST", "/v1beta/cachedContents"),
    ] {
        let (status, body) = call(&gateway.base, method, path, &google, Some(&request));
        assert_eq!(status, 404, "{method} {path}: {body}");
        gemini_error(&body, 404, "NOT_FOUND");
    }
    for path in [
        "/v1beta/models/gemini-v1:generateContent",
        "/v1/models/gemini-v1:generateContent",
    ] {
        let (status, body) = call(&gateway.base, "GET", path, &google, None);
        assert_eq!(status, 405, "{path}: {body}");
        assert_eq!(body["error"]["code"], json!(405), "{body}");
    }
    let anthropic = [("anthropic-version", "2023-06-01"), ("x-api-key", "a-key")];
    let (status, body) = call(
        &gateway.base,
        "POST",
        "/v1/messages/count_tokens",
        &anthropic,
        Some(&json!({})),
    );
    assert_eq!(status, 404, "{body}");
    assert_eq!(
        (body["type"].clone(), body["error"]["type"].clone()),
        (json!("error"), json!("not_found_error")),
        "{body}"
    );
    let (status, body) = call(&gateway.base, "GET", "/v1/messages", &anthropic, None);
    assert_eq!((status, body["type"].clone()), (405, json!("error")), "{body}");
    let openai = [("authorization", "Bearer sk-x")];
    for (method, path, status_wanted) in [
        ("GET", "/v1/chat/completions", 405),
        ("POST", "/v1/chat/other", 404),
        ("GET", "/v1/responses/resp_1/input_items", 404),
        ("GET", "/v1/models", 404),
    ] {
        let (status, body) = call(&gateway.base, method, path, &openai, None);
        assert_eq!(status, status_wanted, "{method} {path}: {body}");
        assert!(body["error"]["message"].is_string(), "{body}");
        assert!(body["error"]["type"].is_string(), "{method} {path}: {body}");
        assert!(body["error"].get("param").is_some(), "{body}");
    }
    assert_eq!(sim.requests().len(), before);
}

#[test]
fn a_streamed_anthropic_answer_reports_the_providers_cumulative_usage_in_message_delta() {
    let (_dir, sim, gateway) = proxy_world("");
    sim.script(
        "claude-usage",
        json!([{"text": "Counted, slowly.", "faults": {"delay_ms": 20}}]),
    );
    let request = json!({"model": "claude-usage", "max_tokens": 64, "stream": true,
                         "system": "Count carefully; this system prompt is long enough to differ from an estimate.",
                         "messages": [{"role": "user", "content": "Count the tokens of this question, please."}]});
    let (status, headers, text) = post(&gateway.base, "/v1/messages", &request, &[]);
    assert_eq!(status, 200, "{text}");
    let sent = sent_for(&gateway, &sim, &operation_of(&headers));
    let body = sent[0]["body"].as_str().unwrap();
    // The simulator reports a quarter of the body's bytes as input tokens (its own count, not
    // the gateway's admission estimate).
    let provider_input = (body.len() / 4) as u64;
    let dispatch = gateway.get(&format!("/v1/dispatches/{}", operation_of(&headers)));
    let admission = dispatch["manifest"]["prompt_tokens"].as_u64().unwrap();
    assert_ne!(
        provider_input, admission,
        "the test needs the two counts to differ"
    );
    let events = sse(&text);
    let delta = events
        .iter()
        .find(|(name, _)| name == "message_delta")
        .unwrap_or_else(|| panic!("{text}"));
    assert_eq!(delta.1["usage"]["input_tokens"], json!(provider_input), "{text}");
    assert!(delta.1["usage"]["output_tokens"].as_u64().unwrap() >= 1, "{text}");
    // The opening frame carries the provider's own start event, not the admission estimate.
    let start = events.iter().find(|(name, _)| name == "message_start").unwrap();
    assert_eq!(
        start.1["message"]["usage"]["input_tokens"],
        json!(provider_input),
        "{text}"
    );
    // The stored outcome has the same numbers.
    let history_usage = gateway.get(&format!("/v1/dispatches/{}", operation_of(&headers)));
    assert_eq!(history_usage["state"], "COMMITTED", "{history_usage}");
    // No cache counters were reported, so none are invented.
    assert!(
        delta.1["usage"].get("cache_read_input_tokens").is_none(),
        "{text}"
    );
}

#[test]
fn a_stateless_follow_up_after_a_retried_dispatch_continues_its_conversation() {
    let (_dir, sim, gateway) = proxy_world("");
    // The first attempt is cut inside the tool arguments, so the calls commit at generation 2.
    let mut cut = two_calls();
    cut["faults"] = json!({"cut_at_byte": 700});
    sim.script(
        "gpt-retry",
        json!([cut, two_calls(), {"text": "Paris 12C, Tokyo 20C."}]),
    );
    let question = json!([{"role": "user", "content": "Weather in Paris and Tokyo?"}]);
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat_request("gpt-retry", question.clone(), false),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let operation = operation_of(&headers);
    let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
    let conversation_id = dispatch["manifest"]["conversation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let history = gateway.get(&format!("/v1/conversations/{conversation_id}"));
    assert_eq!(history["turns"][1]["generation"], 2, "{history}");
    let message = serde_json::from_str::<Value>(&text).unwrap()["choices"][0]["message"].clone();
    let calls = message["tool_calls"].as_array().unwrap().clone();
    let mut follow_up = question.as_array().unwrap().clone();
    follow_up.push(message);
    follow_up.push(json!({"role": "tool", "tool_call_id": calls[1]["id"], "content": "20C"}));
    follow_up.push(json!({"role": "tool", "tool_call_id": calls[0]["id"], "content": "12C"}));
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat_request("gpt-retry", json!(follow_up), false),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let follow_up_operation = operation_of(&headers);
    assert!(
        follow_up_operation.starts_with(&format!("{operation}.r")),
        "the follow-up forked: {follow_up_operation} after {operation}"
    );
    let history = gateway.get(&format!("/v1/conversations/{conversation_id}"));
    let results: Vec<&Value> = history["turns"][2]["blocks"].as_array().unwrap().iter().collect();
    assert_eq!(results.len(), 2, "{history}");
    assert!(results.iter().all(|block| block["generation"] == 2), "{history}");
    // The results closed the calls: nothing is left claimed for ever.
    let done = gateway.get("/v1/tool-calls?state=done");
    assert_eq!(done.to_string().matches(&conversation_id).count(), 2, "{done}");
}

#[test]
fn client_only_fields_reach_a_provider_of_the_same_api_and_are_refused_by_name_across_apis() {
    let (_dir, sim, gateway) = proxy_world("");
    let user = json!([{"role": "user", "content": "Think."}]);
    let request = json!({"model": "gpt-think", "messages": user, "reasoning_effort": "high", "service_tier": "flex",
                         "prompt_cache_key": "session-1", "store": true, "user": "u-1"});
    let (status, headers, text) = post(&gateway.base, "/v1/chat/completions", &request, &[]);
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("x-turnstile-dropped").is_none(), "{headers:?}");
    let body = last_sent(&sim);
    for field in [
        "reasoning_effort",
        "service_tier",
        "prompt_cache_key",
        "store",
        "user",
    ] {
        assert_eq!(body[field], request[field], "{field}: {body}");
    }
    let request = json!({"model": "claude-think", "max_tokens": 4096, "messages": user,
                         "thinking": {"type": "enabled", "budget_tokens": 1024}, "metadata": {"user_id": "u-1"}});
    let (status, headers, text) = post(&gateway.base, "/v1/messages", &request, &[]);
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("x-turnstile-dropped").is_none(), "{headers:?}");
    let body = last_sent(&sim);
    assert_eq!(body["thinking"], request["thinking"], "{body}");
    assert_eq!(body["metadata"], request["metadata"], "{body}");
    drop(gateway);

    let config = r#"
[[routes]]
api = "openai-chat"
provider = "sim"
adapter = "anthropic-messages@2"

[[routes]]
api = "anthropic-messages"
provider = "sim"
adapter = "openai-chat@2"
"#;
    let (_dir, sim, gateway) = proxy_world(config);
    // A thinking budget or a reasoning effort towards an API without the same field: refused,
    // named as the client spelt it, nothing sent.
    let before = sim.requests().len();
    for (path, request, field) in [
        (
            "/v1/chat/completions",
            json!({"model": "gpt-x", "messages": user, "reasoning_effort": "high"}),
            "reasoning_effort",
        ),
        (
            "/v1/messages",
            json!({"model": "claude-x", "max_tokens": 4096, "messages": user,
                   "thinking": {"type": "enabled", "budget_tokens": 1024}}),
            "thinking",
        ),
    ] {
        let (status, _, text) = post(&gateway.base, path, &request, &[]);
        assert_eq!(status, 400, "{text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(body["error"]["code"], "unsupported_setting", "{body}");
        assert_eq!(body["error"]["setting"], field, "{body}");
    }
    assert_eq!(sim.requests().len(), before);
    // An end-user identifier cannot change what is generated or billed: left out, and reported.
    let request = json!({"model": "gpt-x", "messages": user, "user": "u-1"});
    let (status, headers, text) = post(&gateway.base, "/v1/chat/completions", &request, &[]);
    assert_eq!(status, 200, "{text}");
    assert_eq!(headers["x-turnstile-dropped"], "user", "{headers:?}");
    assert!(last_sent(&sim).get("user").is_none());
}

/// The JSON paths of every `cache_control` in a body, with their values.
fn cache_controls(value: &Value, path: &str, out: &mut Vec<(String, Value)>) {
    match value {
        Value::Object(map) => {
            for (key, item) in map {
                let here = format!("{path}.{key}");
                if key == "cache_control" {
                    out.push((here, item.clone()));
                } else {
                    cache_controls(item, &here, out);
                }
            }
        }
        Value::Array(items) => {
            for (index, item) in items.iter().enumerate() {
                cache_controls(item, &format!("{path}[{index}]"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn cache_breakpoints_reach_anthropic_in_place_follow_the_request_and_become_a_prompt_cache_key_towards_openai()
 {
    let (_dir, sim, gateway) = proxy_world("");
    sim.script(
        "claude-cache",
        json!([two_calls(), {"text": "Paris 12C, Tokyo 20C."}]),
    );
    let ephemeral = json!({"type": "ephemeral"});
    let tools = json!([{"name": "get_weather", "description": "Weather", "input_schema": schema(),
                        "cache_control": ephemeral}]);
    let system = json!([{"type": "text", "text": "You are terse.", "cache_control": ephemeral}]);
    let question = json!({"role": "user", "content": [
        {"type": "text", "text": "Weather in Paris and Tokyo?", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]});
    let request = json!({"model": "claude-cache", "max_tokens": 256, "tools": tools, "system": system,
                         "messages": [question]});
    let (status, headers, text) = post(&gateway.base, "/v1/messages", &request, &[]);
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("x-turnstile-dropped").is_none(), "{headers:?}");
    let mut marks = Vec::new();
    cache_controls(&last_sent(&sim), "", &mut marks);
    assert_eq!(
        marks,
        [
            (
                ".messages[0].content[0].cache_control".to_owned(),
                json!({"type": "ephemeral", "ttl": "1h"})
            ),
            (".system[0].cache_control".to_owned(), ephemeral.clone()),
            (".tools[0].cache_control".to_owned(), ephemeral.clone()),
        ]
    );
    // The follow-up moves the user breakpoint to the tool results, as clients do: the provider
    // gets exactly the follow-up's breakpoints, not those stored with the first request.
    let answer: Value = serde_json::from_str(&text).unwrap();
    let calls: Vec<&Value> = answer["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|block| block["type"] == "tool_use")
        .collect();
    assert_eq!(calls.len(), 2, "{answer}");
    let mut plain_question = question.clone();
    plain_question["content"][0]
        .as_object_mut()
        .unwrap()
        .remove("cache_control");
    let results = json!({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": calls[0]["id"], "content": "12C"},
        {"type": "tool_result", "tool_use_id": calls[1]["id"], "content": "20C", "cache_control": ephemeral}]});
    let follow_up = json!({"model": "claude-cache", "max_tokens": 256, "tools": tools, "system": system,
                           "messages": [plain_question, {"role": "assistant", "content": answer["content"]}, results]});
    let (status, headers, text) = post(&gateway.base, "/v1/messages", &follow_up, &[]);
    assert_eq!(status, 200, "{text}");
    let operation = operation_of(&headers);
    assert!(
        operation.contains(".r"),
        "the follow-up did not continue the conversation: {operation}"
    );
    let mut marks = Vec::new();
    cache_controls(&last_sent(&sim), "", &mut marks);
    assert_eq!(
        marks,
        [
            (
                ".messages[2].content[1].cache_control".to_owned(),
                ephemeral.clone()
            ),
            (".system[0].cache_control".to_owned(), ephemeral.clone()),
            (".tools[0].cache_control".to_owned(), ephemeral.clone()),
        ]
    );
    // The manifest pins the breakpoints through the policy; the content digests do not move.
    let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
    assert!(
        dispatch["manifest"]["policy_digest"]
            .as_str()
            .is_some_and(|digest| digest.starts_with("sha256:"))
    );
    drop(gateway);

    // An Anthropic client served by an OpenAI model: OpenAI caches prefixes itself, and the
    // breakpoints become its prompt_cache_key; a one-hour breakpoint has no OpenAI meaning.
    let config = r#"
[[routes]]
api = "anthropic-messages"
provider = "sim"
adapter = "openai-chat@2"
"#;
    let (_dir, sim, gateway) = proxy_world(config);
    let five_minutes = json!({"model": "gpt-cache", "max_tokens": 256, "tools": tools, "system": system,
                              "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    let (status, headers, text) = post(&gateway.base, "/v1/messages", &five_minutes, &[]);
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("x-turnstile-dropped").is_none(), "{headers:?}");
    let body = last_sent(&sim);
    assert!(
        body["prompt_cache_key"]
            .as_str()
            .is_some_and(|key| key.starts_with("turnstile-")),
        "{body}"
    );
    assert!(!body.to_string().contains("cache_control"), "{body}");
    let before = sim.requests().len();
    let (status, _, text) = post(&gateway.base, "/v1/messages", &request, &[]);
    assert_eq!(status, 400, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["type"], "error", "{error}");
    let kinds: Vec<&Value> = error["error"]["reason"]["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pause| &pause["kind"])
        .collect();
    assert_eq!(kinds, [&json!("cache.ttl")], "{error}");
    assert_eq!(sim.requests().len(), before, "a refused request was sent");
    drop(gateway);

    // Towards Gemini the breakpoints cannot change anything: left out and reported.
    let config = r#"
[[routes]]
api = "anthropic-messages"
provider = "sim"
adapter = "gemini@1"
"#;
    let (_dir, sim, gateway) = proxy_world(config);
    let (status, headers, text) = post(&gateway.base, "/v1/messages", &five_minutes, &[]);
    assert_eq!(status, 200, "{text}");
    assert_eq!(headers["x-turnstile-dropped"], "cache_control", "{headers:?}");
    assert!(
        !sim.requests().last().unwrap()["body"]
            .as_str()
            .unwrap()
            .contains("cache")
    );
}

#[test]
fn the_native_api_takes_cache_breakpoints_on_blocks_and_tools_under_their_neutral_name() {
    let (_dir, sim, gateway) = proxy_world("");
    // A malformed breakpoint is refused with the validator's code, on tools and on blocks.
    let (status, body) = gateway.post(
        "/v1/conversations",
        json!({"conversation_id": "c-bad", "tools": [{"name": "t", "cache": {"ttl": "1d"}}]}),
    );
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (422, json!("rejected")),
        "{body}"
    );
    let tools = json!([{"name": "get_weather", "input_schema": schema(), "cache": {}}]);
    let (status, _) = gateway.post(
        "/v1/conversations",
        json!({"conversation_id": "c-cache", "tools": tools}),
    );
    assert_eq!(status, 201);
    let (status, body) = gateway.post(
        "/v1/conversations/c-cache/turns",
        json!({"expected_revision": 0, "turn": {"id": "t1", "role": "user",
               "blocks": [{"id": "u1", "kind": "text", "text": "Weather?", "cache": "soon"}]}}),
    );
    assert_eq!(status, 422, "{body}");
    let (status, _) = gateway.post(
        "/v1/conversations/c-cache/turns",
        json!({"expected_revision": 0, "turn": {"id": "t1", "role": "user",
               "blocks": [{"id": "u1", "kind": "text", "text": "A long document …", "cache": {"ttl": "1h"}},
                          {"id": "u2", "kind": "text", "text": "Weather?"}]}}),
    );
    assert_eq!(status, 200);
    let history = gateway.get("/v1/conversations/c-cache");
    assert_eq!(
        history["turns"][0]["blocks"][0]["cache"],
        json!({"ttl": "1h"}),
        "{history}"
    );
    let (status, body) = gateway.post(
        "/v1/conversations/c-cache/dispatch",
        json!({"operation_id": "op-cache", "target": {"provider": "sim", "model": "m-cache", "adapter": "anthropic-messages@1"}}),
    );
    assert_eq!(status, 200, "{body}");
    let sent = sent_for(&gateway, &sim, "op-cache");
    let sent: Value = serde_json::from_str(sent[0]["body"].as_str().unwrap()).unwrap();
    assert_eq!(
        sent["tools"][0]["cache_control"],
        json!({"type": "ephemeral"}),
        "{sent}"
    );
    assert_eq!(
        sent["messages"][0]["content"][0]["cache_control"],
        json!({"type": "ephemeral", "ttl": "1h"}),
        "{sent}"
    );
    assert!(
        sent["messages"][0]["content"][1].get("cache_control").is_none(),
        "{sent}"
    );
}

#[test]
fn element_fields_reach_a_provider_of_the_same_api_in_place_and_are_refused_by_path_across_apis() {
    // A tool's `strict`, a Chat message's `name`, an image's `detail` (`passthrough.rs`).
    let (_dir, sim, gateway) = proxy_world("");
    sim.script("gpt-el", json!([{"text": "A cat."}, {"text": "Still a cat."}]));
    let image = "data:image/png;base64,iVBORw0KGgo=";
    let tools = json!([{"type": "function", "function": {"name": "lookup", "strict": true, "parameters":
        {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"], "additionalProperties": false}}}]);
    let mut messages = json!([
        {"role": "system", "name": "rules", "content": "Be brief."},
        {"role": "user", "name": "alice", "content": [{"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": image, "detail": "low"}}]}]);
    let request = json!({"model": "gpt-el", "messages": messages, "tools": tools});
    let (status, headers, text) = post(&gateway.base, "/v1/chat/completions", &request, &[]);
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("x-turnstile-dropped").is_none(), "{headers:?}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    let body = last_sent(&sim);
    assert_eq!(body["messages"][0]["name"], "rules", "{body}");
    assert_eq!(body["messages"][1]["name"], "alice", "{body}");
    assert_eq!(
        body["messages"][1]["content"][1]["image_url"],
        json!({"url": image, "detail": "low"})
    );
    assert_eq!(body["tools"][0]["function"]["strict"], true, "{body}");
    // The stateless follow-up continues the conversation: each field stays on its own element.
    let messages_list = messages.as_array_mut().unwrap();
    messages_list.push(json!({"role": "assistant", "name": "helper",
                              "content": answer["choices"][0]["message"]["content"]}));
    messages_list.push(json!({"role": "user", "name": "bob", "content": "Sure?"}));
    let request = json!({"model": "gpt-el", "messages": messages, "tools": tools});
    let (status, _, text) = post(&gateway.base, "/v1/chat/completions", &request, &[]);
    assert_eq!(status, 200, "{text}");
    let body = last_sent(&sim);
    let names: Vec<&Value> = body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| &m["name"])
        .collect();
    assert_eq!(
        names,
        [&json!("rules"), &json!("alice"), &json!("helper"), &json!("bob")],
        "{body}"
    );
    assert_eq!(
        body["messages"][1]["content"][1]["image_url"]["detail"], "low",
        "{body}"
    );
    let request = json!({"model": "gpt-el", "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": image, "detail": "high"}]}],
        "tools": [{"type": "function", "name": "lookup", "strict": true, "parameters": tools[0]["function"]["parameters"]}]});
    let (status, headers, text) = post(&gateway.base, "/v1/responses", &request, &[]);
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("x-turnstile-dropped").is_none(), "{headers:?}");
    let body = last_sent(&sim);
    assert_eq!(body["input"][0]["content"][0]["detail"], "high", "{body}");
    assert_eq!(body["tools"][0]["strict"], true, "{body}");
    drop(gateway);

    let config = r#"
[[routes]]
api = "openai-chat"
provider = "sim"
adapter = "anthropic-messages@2"

[[routes]]
api = "openai-responses"
provider = "sim"
adapter = "openai-chat@2"
"#;
    let (_dir, sim, gateway) = proxy_world(config);
    let before = sim.requests().len();
    let user = json!({"role": "user", "content": "Hi"});
    for (path, request, field) in [
        (
            "/v1/chat/completions",
            json!({"model": "gpt-x", "messages": [user], "tools": tools}),
            "tools[].function.strict",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "gpt-x", "messages": [{"role": "user", "name": "alice", "content": "Hi"}]}),
            "messages[].name",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "gpt-x", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image, "detail": "high"}}]}]}),
            "messages[].content[].image_url.detail",
        ),
        (
            "/v1/responses",
            json!({"model": "gpt-x", "input": "Hi", "tools": [{"type": "function", "name": "t", "strict": true,
                   "parameters": {"type": "object"}}]}),
            "tools[].strict",
        ),
        (
            "/v1/responses",
            json!({"model": "gpt-x", "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": image, "detail": "low"}]}]}),
            "input[].content[].detail",
        ),
    ] {
        let (status, _, text) = post(&gateway.base, path, &request, &[]);
        assert_eq!(status, 400, "{path} {field}: {text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(body["error"]["code"], "unsupported_setting", "{body}");
        assert_eq!(body["error"]["setting"], field, "{body}");
    }
    assert_eq!(sim.requests().len(), before);
}

/// Issue 21: a fresh drop-in proxy request costs two durable writes, as a native dispatch does:
/// the import of its history is in the transaction that prepares and begins its dispatch, and
/// the commit is the other. A request refused while rendering (a setting the target's API
/// cannot take) writes nothing: no conversation is left behind. On the embedded SQLite and on
/// PostgreSQL.
#[test]
fn a_fresh_proxy_request_costs_two_durable_writes_and_a_refused_one_none() {
    let url = pg_url();
    let config = r#"
[[routes]]
api = "openai-chat"
model = "claude-*"
provider = "sim"
adapter = "anthropic-messages@2"

[[routes]]
api = "openai-chat"
provider = "sim"
adapter = "openai-chat@1"
"#;
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let pg_dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite:{}", dir.path().join("t.db").display());
    let run = run_id();
    for (store, gateway) in [
        ("sqlite", Gateway::start(&dir, &sqlite, &sim, config)),
        ("postgres", Gateway::start(&pg_dir, &url, &sim, config)),
    ] {
        let writes = || gateway.metric("turnstile_store_write_ops_total");
        let model = format!("gpt-writes-{run}-{store}");
        sim.script(&model, json!([{"text": "Paris 12C."}]));
        let question = json!([{"role": "user", "content": format!("Weather in Paris? ({store})")}]);
        let before = writes();
        let (status, headers, text) = post(
            &gateway.base,
            "/v1/chat/completions",
            &chat_request(&model, question, false),
            &[],
        );
        assert_eq!(status, 200, "{store}: {text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            body["choices"][0]["message"]["content"], "Paris 12C.",
            "{store}: {body}"
        );
        assert_eq!(
            writes() - before,
            2.0,
            "{store}: durable writes for one fresh proxy request"
        );
        let operation = operation_of(&headers);
        let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
        assert_eq!(dispatch["state"], "COMMITTED", "{store}: {dispatch}");
        let conversation_id = dispatch["manifest"]["conversation_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let stored = gateway.get(&format!("/v1/conversations/{conversation_id}"));
        let roles: Vec<&str> = stored["turns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|turn| turn["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["user", "assistant"], "{store}: {stored}");
        // `seed` has no field in Anthropic Messages: refused by name before anything is stored.
        let before = (writes(), sim.requests().len());
        let request = json!({"model": "claude-x", "seed": 7,
                             "messages": [{"role": "user", "content": format!("Hi ({store})")}]});
        let (status, _, text) = post(&gateway.base, "/v1/chat/completions", &request, &[]);
        assert_eq!(status, 400, "{store}: {text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(body["error"]["setting"], "seed", "{store}: {body}");
        assert_eq!(
            (writes(), sim.requests().len()),
            before,
            "{store}: a refused request writes and sends nothing"
        );
    }
}

/// Issue 21: a render of more than `RENDER_INLINE_BLOCKS_MAX` (500) new blocks runs off the
/// async worker (`turnstile_renders_off_worker_total`), a small one on it; the large one is
/// answered and sends the bytes its manifest pins, like any other.
#[test]
fn a_large_render_runs_off_the_async_worker_and_sends_the_bytes_its_manifest_pins() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite:{}", dir.path().join("t.db").display());
    let gateway = Gateway::start(&dir, &sqlite, &sim, "");
    let run = run_id();
    let off_worker = || gateway.metric("turnstile_renders_off_worker_total");
    let ask = |model: &str, messages: Value| {
        sim.script(model, json!([{"text": "Noted."}]));
        let (status, headers, text) = post(
            &gateway.base,
            "/v1/chat/completions",
            &chat_request(model, messages, false),
            &[],
        );
        assert_eq!(status, 200, "{text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(body["choices"][0]["message"]["content"], "Noted.", "{body}");
        operation_of(&headers)
    };
    let before = off_worker();
    let small = ask(
        &format!("gpt-small-{run}"),
        json!([{"role": "user", "content": "Hello?"}]),
    );
    assert_eq!(off_worker(), before, "a one-block render stays on its worker");
    assert_eq!(
        crate::serve::assert_sent_bodies_match_manifest(&gateway, &sim, &small),
        1
    );
    let mut messages: Vec<Value> = (0..600)
        .map(|index| {
            let role = if index % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": format!("message {index} of a long conversation")})
        })
        .collect();
    messages.push(json!({"role": "user", "content": "So, in short?"}));
    let large = ask(&format!("gpt-large-{run}"), Value::Array(messages));
    assert_eq!(
        off_worker(),
        before + 1.0,
        "a 601-block render runs off its worker"
    );
    assert_eq!(
        crate::serve::assert_sent_bodies_match_manifest(&gateway, &sim, &large),
        1,
        "the large body sent is the one its manifest pins"
    );
}

/// The proxy conversation a dispatch answered.
fn conversation_of(gateway: &Gateway, operation: &str) -> String {
    gateway.get(&format!("/v1/dispatches/{operation}"))["manifest"]["conversation_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The calls of `conversation` in the ledger (every state when `state` is None), as
/// (call id, state, claim_expires_at), in call order.
fn calls_of(gateway: &Gateway, conversation: &str, state: Option<&str>) -> Vec<(String, String, u64)> {
    let path = match state {
        Some(state) => format!("/v1/tool-calls?state={state}"),
        None => "/v1/tool-calls".to_owned(),
    };
    gateway.get(&path)["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|call| call["conversation_id"] == conversation)
        .map(|call| {
            (
                call["call_id"].as_str().unwrap().to_owned(),
                call["state"].as_str().unwrap().to_owned(),
                call["claim_expires_at"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

/// `pending_calls` of `conversation` in the listing, and whether `pending=true` lists it.
fn pending_of(gateway: &Gateway, conversation: &str) -> (u64, bool) {
    let listed = |query: &str| {
        gateway.get(&format!("/v1/conversations?limit=500{query}"))["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|entry| entry["conversation_id"] == conversation)
            .cloned()
    };
    let entry = listed("").unwrap_or_else(|| panic!("{conversation} is not listed"));
    (
        entry["pending_calls"].as_u64().unwrap(),
        listed("&pending=true").is_some(),
    )
}

/// The chat messages of a well-behaved follow-up: the history, our answer as it came, and a
/// result per call.
fn follow_up_messages(question: &Value, answer: &Value) -> Vec<Value> {
    let mut messages = question.as_array().unwrap().clone();
    messages.push(answer.clone());
    for (call, result) in answer["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .zip(["12C", "20C"])
    {
        messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": result}));
    }
    messages
}

#[test]
fn a_follow_up_that_drops_tools_forks_and_the_calls_it_left_are_client_abandoned_and_not_pending() {
    let (_dir, sim, gateway) = proxy_world("");
    sim.script(
        "gpt-fork",
        json!([two_calls(), {"text": "From the fork."}, {"text": "Paris 12C, Tokyo 20C."}]),
    );
    let question = json!([{"role": "user", "content": "Weather in Paris and Tokyo?"}]);
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat_request("gpt-fork", question.clone(), false),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let answer = serde_json::from_str::<Value>(&text).unwrap()["choices"][0]["message"].clone();
    let operation = operation_of(&headers);
    let conversation = conversation_of(&gateway, &operation);
    let handed = calls_of(&gateway, &conversation, Some("client"));
    assert_eq!(handed.len(), 2, "{handed:?}");
    assert_eq!(pending_of(&gateway, &conversation), (2, true));

    // The framework's follow-up carries the results but drops `tools`: it cannot continue the
    // stored conversation (its meaning differs), so it forks; the calls it answered elsewhere
    // leave this conversation's pending count at once, long before their one-hour bound.
    let messages = follow_up_messages(&question, &answer);
    let mut without_tools = chat_request("gpt-fork", json!(messages), false);
    without_tools.as_object_mut().unwrap().remove("tools");
    let (status, headers, text) = post(&gateway.base, "/v1/chat/completions", &without_tools, &[]);
    assert_eq!(status, 200, "{text}");
    let forked = operation_of(&headers);
    assert!(!forked.starts_with(&operation), "{forked} continued {operation}");
    let abandoned = calls_of(&gateway, &conversation, Some("client_abandoned"));
    assert_eq!(
        abandoned.iter().map(|call| &call.0).collect::<Vec<_>>(),
        handed.iter().map(|call| &call.0).collect::<Vec<_>>(),
        "the fork abandons the calls it left"
    );
    assert!(
        abandoned
            .iter()
            .zip(&handed)
            .all(|(abandoned, handed)| abandoned.2 < handed.2),
        "ended by the fork, before their bound: {abandoned:?} {handed:?}"
    );
    assert_eq!(calls_of(&gateway, &conversation, Some("client")), []);
    assert_eq!(pending_of(&gateway, &conversation), (0, false));
    let fork_conversation = conversation_of(&gateway, &forked);
    assert_eq!(pending_of(&gateway, &fork_conversation), (0, false));
    assert_eq!(gateway.metric("turnstile_tool_call_client_forks_total"), 2.0);

    // Abandonment is bookkeeping: the same client's follow-up with its tools still continues
    // the conversation, and its results close the calls, once.
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat_request("gpt-fork", json!(messages), false),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let continued = operation_of(&headers);
    assert!(
        continued.starts_with(&format!("{operation}.r")),
        "{continued} after {operation}"
    );
    let calls = calls_of(&gateway, &conversation, None);
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls.iter().all(|call| call.1 == "done"), "{calls:?}");
    let history = gateway.get(&format!("/v1/conversations/{conversation}"));
    let roles: Vec<&str> = history["turns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|turn| turn["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"], "{history}");
    assert_eq!(pending_of(&gateway, &conversation), (0, false));
    assert_eq!(gateway.metric("turnstile_tool_call_client_forks_total"), 2.0);
}

#[test]
fn follow_ups_that_rewrite_call_ids_or_send_results_as_user_text_leave_calls_that_end_at_their_bound() {
    let (_dir, sim, gateway) = proxy_world("proxy_client_call_timeout_ms = 1000\n");
    sim.script(
        "gpt-bound",
        json!([two_calls(), {"text": "Noted."}, two_calls(), {"text": "Noted."}]),
    );
    let ask = |question: &Value| {
        let (status, headers, text) = post(
            &gateway.base,
            "/v1/chat/completions",
            &chat_request("gpt-bound", question.clone(), false),
            &[],
        );
        assert_eq!(status, 200, "{text}");
        let answer = serde_json::from_str::<Value>(&text).unwrap()["choices"][0]["message"].clone();
        (operation_of(&headers), answer)
    };
    let follow = |messages: Vec<Value>, first: &str| {
        let (status, headers, text) = post(
            &gateway.base,
            "/v1/chat/completions",
            &chat_request("gpt-bound", json!(messages), false),
            &[],
        );
        assert_eq!(status, 200, "{text}");
        let operation = operation_of(&headers);
        assert!(!operation.starts_with(first), "{operation} continued {first}");
    };

    // A framework that renames the call ids in the history it resends.
    let question = json!([{"role": "user", "content": "Weather in Paris and Tokyo?"}]);
    let (first, answer) = ask(&question);
    let renamed = conversation_of(&gateway, &first);
    let handed_renamed = calls_of(&gateway, &renamed, None);
    let mut rewritten = answer.clone();
    for (index, call) in rewritten["tool_calls"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .enumerate()
    {
        call["id"] = json!(format!("call_framework_{index}"));
    }
    follow(follow_up_messages(&question, &rewritten), &first);

    // A framework that sends the results as user text after the assistant's words.
    let question = json!([{"role": "user", "content": "Weather in Rome and Oslo?"}]);
    let (first, answer) = ask(&question);
    let as_text = conversation_of(&gateway, &first);
    let handed_as_text = calls_of(&gateway, &as_text, None);
    let mut messages = question.as_array().unwrap().clone();
    messages.push(json!({"role": "assistant", "content": answer["content"]}));
    messages.push(json!({"role": "user", "content": "get_weather: Rome 15C, Oslo 3C"}));
    follow(messages, &first);

    // Neither follow-up names the stored conversation, so no fork can be seen: the calls end
    // when their bound runs out by the store's clock, at the end set when they were handed.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    for (conversation, handed) in [(&renamed, &handed_renamed), (&as_text, &handed_as_text)] {
        assert_eq!(handed.len(), 2, "{handed:?}");
        let abandoned = loop {
            let calls = calls_of(&gateway, conversation, None);
            if calls.iter().all(|call| call.1 == "client_abandoned") {
                break calls;
            }
            assert!(calls.iter().all(|call| call.1 == "client"), "{calls:?}");
            assert!(
                std::time::Instant::now() < deadline,
                "not client_abandoned after the bound: {calls:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        assert_eq!(
            abandoned.iter().map(|call| (&call.0, call.2)).collect::<Vec<_>>(),
            handed.iter().map(|call| (&call.0, call.2)).collect::<Vec<_>>(),
            "ended at the bound set at the hand-over, not moved"
        );
        assert_eq!(pending_of(&gateway, conversation), (0, false));
    }
    assert_eq!(gateway.metric("turnstile_tool_call_client_forks_total"), 0.0);
}

#[test]
fn a_keyed_follow_up_keeps_its_own_conversation_and_abandons_the_calls_its_client_left() {
    let (_dir, sim, gateway) = proxy_world("");
    sim.script(
        "gpt-keyed",
        json!([two_calls(), {"text": "Paris 12C, Tokyo 20C."}]),
    );
    let question = json!([{"role": "user", "content": "Weather in Paris and Tokyo?"}]);
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat_request("gpt-keyed", question.clone(), false),
        &[("idempotency-key", "step-1")],
    );
    assert_eq!(status, 200, "{text}");
    let answer = serde_json::from_str::<Value>(&text).unwrap()["choices"][0]["message"].clone();
    let first = conversation_of(&gateway, &operation_of(&headers));
    assert_eq!(pending_of(&gateway, &first), (2, true));
    // Under an Idempotency-Key each step is a conversation of its own, so the results the
    // follow-up carries never reach the first one: its calls end with the follow-up.
    let (status, headers, text) = post(
        &gateway.base,
        "/v1/chat/completions",
        &chat_request("gpt-keyed", json!(follow_up_messages(&question, &answer)), false),
        &[("idempotency-key", "step-2")],
    );
    assert_eq!(status, 200, "{text}");
    assert_ne!(conversation_of(&gateway, &operation_of(&headers)), first);
    let calls = calls_of(&gateway, &first, None);
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls.iter().all(|call| call.1 == "client_abandoned"), "{calls:?}");
    assert_eq!(pending_of(&gateway, &first), (0, false));
}
