//! The native API's errors, table-driven (issue 17; spec additions "Dispatch guard and strict
//! bodies"): bad bodies, methods, paths and queries on every native endpoint, each answered
//! with its status and `{"error": {"code", "message"}}` JSON: unknown fields and non-object
//! bodies are 422 `invalid_request`, `max_output_tokens` must be ≥ 1, `.`/`..` are not ids, and
//! 404, 405, 413, 414 and the router's own path and query rejections are JSON too.

use crate::serve::{Gateway, client, sqlite};
use serde_json::{Value, json};

struct Case {
    method: &'static str,
    path: String,
    body: Option<Vec<u8>>,
    status: u16,
    code: &'static str,
}

fn case(method: &'static str, path: &str, body: Option<&[u8]>, status: u16, code: &'static str) -> Case {
    Case {
        method,
        path: path.to_owned(),
        body: body.map(<[u8]>::to_vec),
        status,
        code,
    }
}

fn send(gateway: &Gateway, case: &Case) -> (u16, Option<String>, Vec<u8>) {
    let method = reqwest::Method::from_bytes(case.method.as_bytes()).unwrap();
    let mut request = client().request(method, format!("{}{}", gateway.base, case.path));
    if let Some(body) = &case.body {
        request = request
            .header("content-type", "application/json")
            .body(body.clone());
    }
    let response = request.send().unwrap();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    (status, content_type, response.bytes().unwrap().to_vec())
}

fn cases() -> Vec<Case> {
    let turn = r#"{"id": "t1", "role": "user", "blocks": [{"id": "u1", "kind": "text", "text": "hi"}]}"#;
    let target = r#"{"provider": "sim", "model": "m", "adapter": "openai-chat@1"}"#;
    let long_id = "x".repeat(9 * 1024);
    let mut cases = Vec::new();
    for body in [&b"42"[..], b"[]", b"null", b"\"text\"", b"true"] {
        // A body that is not a JSON object, on every endpoint that takes one.
        for path in [
            "/v1/conversations",
            "/v1/conversations/c-known/turns",
            "/v1/conversations/c-known/dispatch",
            "/v1/tool-calls/c-known/call-1/claim",
            "/v1/tool-calls/c-known/call-1/result",
        ] {
            cases.push(case("POST", path, Some(body), 422, "invalid_request"));
        }
    }
    cases.extend([
        // Unknown fields, at the top and nested.
        case("POST", "/v1/conversations", Some(br#"{"conversation_id": "c-new", "bogus": 1}"#), 422, "invalid_request"),
        case("POST", "/v1/conversations/c-known/turns",
             Some(format!(r#"{{"expected_revision": 0, "turn": {turn}, "force": true}}"#).as_bytes()), 422, "invalid_request"),
        case("POST", "/v1/conversations/c-known/dispatch",
             Some(format!(r#"{{"operation_id": "op-1", "target": {target}, "priority": 9}}"#).as_bytes()), 422, "invalid_request"),
        case("POST", "/v1/conversations/c-known/dispatch",
             Some(br#"{"operation_id": "op-1", "target": {"provider": "sim", "model": "m", "adapter": "openai-chat@1", "region": "eu"}}"#),
             422, "invalid_request"),
        case("POST", "/v1/tool-calls/c-known/call-1/claim", Some(br#"{"holder": "x", "lease_ms": 10, "priority": 1}"#), 422, "invalid_request"),
        case("POST", "/v1/tool-calls/c-known/call-1/result", Some(br#"{"claim": 1, "status": "success", "extra": 1}"#), 422, "invalid_request"),
        // Fields of the wrong type or range.
        case("POST", "/v1/conversations/c-known/dispatch",
             Some(format!(r#"{{"operation_id": "op-1", "target": {target}, "max_output_tokens": 0}}"#).as_bytes()), 422, "invalid_request"),
        case("POST", "/v1/conversations/c-known/dispatch",
             Some(format!(r#"{{"operation_id": "op-1", "target": {target}, "max_output_tokens": -5}}"#).as_bytes()), 422, "invalid_request"),
        case("POST", "/v1/conversations/c-known/dispatch", Some(br#"{"operation_id": "op-1"}"#), 422, "invalid_request"),
        case("POST", "/v1/tool-calls/c-known/call-1/claim", Some(br#"{"holder": 5}"#), 422, "invalid_request"),
        case("POST", "/v1/tool-calls/c-known/call-1/claim", Some(br#"{"lease_ms": "soon"}"#), 422, "invalid_request"),
        case("POST", "/v1/tool-calls/c-known/call-1/result", Some(br#"{"claim": 1, "status": 7}"#), 422, "invalid_request"),
        case("POST", "/v1/conversations/c-known/turns", Some(format!(r#"{{"turn": {turn}}}"#).as_bytes()), 422, "invalid_request"),
        // Ids `.` and `..`, and other bad ids.
        case("POST", "/v1/conversations", Some(br#"{"conversation_id": "."}"#), 422, "invalid_id"),
        case("POST", "/v1/conversations", Some(br#"{"conversation_id": ".."}"#), 422, "invalid_id"),
        case("POST", "/v1/conversations", Some(br#"{"conversation_id": "a/b"}"#), 422, "invalid_id"),
        case("POST", "/v1/conversations/c-known/dispatch",
             Some(format!(r#"{{"operation_id": "..", "target": {target}}}"#).as_bytes()), 422, "invalid_id"),
        // Bodies that are not JSON, or too large.
        case("POST", "/v1/conversations", Some(b"{not json"), 400, "invalid_json"),
        case("POST", "/v1/conversations/c-known/turns", Some(&vec![b' '; 70_000]), 413, "body_too_large"),
        // Things that do not exist.
        case("GET", "/v1/conversations/c-missing", None, 404, "not_found"),
        case("GET", "/v1/dispatches/op-missing", None, 404, "not_found"),
        case("POST", "/v1/conversations/c-missing/dispatch",
             Some(format!(r#"{{"operation_id": "op-2", "target": {target}}}"#).as_bytes()), 404, "not_found"),
        case("POST", "/v1/tool-calls/c-known/call-missing/claim", Some(br#"{"holder": "x"}"#), 404, "not_found"),
        case("GET", "/v1/no-such-route", None, 404, "not_found"),
        case("GET", "/v1/conversations/c-known/turns/extra", None, 404, "not_found"),
        // Methods a path does not take.
        case("DELETE", "/v1/conversations", None, 405, "method_not_allowed"),
        case("GET", "/v1/conversations/c-known/turns", None, 405, "method_not_allowed"),
        case("PUT", "/v1/conversations/c-known", Some(b"{}"), 405, "method_not_allowed"),
        case("GET", "/v1/conversations/c-known/dispatch", None, 405, "method_not_allowed"),
        case("DELETE", "/v1/dispatches/op-1", None, 405, "method_not_allowed"),
        case("POST", "/v1/tool-calls", Some(b"{}"), 405, "method_not_allowed"),
        case("GET", "/v1/tool-calls/c-known/call-1/claim", None, 405, "method_not_allowed"),
        case("GET", "/v1/tool-calls/c-known/call-1/result", None, 405, "method_not_allowed"),
        case("POST", "/v1/quarantine", Some(b"{}"), 405, "method_not_allowed"),
        case("POST", "/metrics", Some(b"{}"), 405, "method_not_allowed"),
        case("POST", "/healthz", Some(b"{}"), 405, "method_not_allowed"),
        // Paths and queries the router cannot read.
        case("GET", "/v1/conversations/%FF%FE", None, 400, "invalid_request"),
        case("GET", "/v1/dispatches/%C3", None, 400, "invalid_request"),
        case("POST", "/v1/tool-calls/%FF/call-1/claim", Some(b"{}"), 400, "invalid_request"),
        case("GET", "/v1/tool-calls?state=%FF", None, 422, "invalid_request"), // decoded lossily by the query parser, then no such state
        case("GET", "/v1/tool-calls?bogus=1", None, 400, "invalid_request"),
        case("GET", "/v1/tool-calls?state=ready&state=done", None, 400, "invalid_request"),
        case("GET", "/v1/tool-calls?state=soon", None, 422, "invalid_request"),
        // OpenAI's Conversations API on the native path: refused as that API (its own test below).
        case("POST", "/v1/conversations", Some(br#"{"items": []}"#), 404, "unsupported_endpoint"),
        case("GET", "/v1/conversations/c-known/items", None, 404, "unsupported_endpoint"),
        // A request target over URI_BYTES_MAX.
        case("GET", &format!("/v1/conversations/{long_id}"), None, 414, "uri_too_long"),
        case("POST", &format!("/v1/conversations/{long_id}/dispatch"), Some(b"{}"), 414, "uri_too_long"),
        case("GET", &format!("/v1/tool-calls?state={long_id}"), None, 414, "uri_too_long"),
    ]);
    cases
}

#[test]
fn every_native_endpoint_answers_bad_bodies_methods_paths_and_queries_with_a_typed_json_error() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(&dir, &sqlite(&dir), None, "body_bytes_max = 65536").unwrap();
    let (status, _) = gateway.post("/v1/conversations", json!({"conversation_id": "c-known"}));
    assert_eq!(status, 201);
    let mut failures = Vec::new();
    let cases = cases();
    for case in &cases {
        let (status, content_type, body) = send(&gateway, case);
        let parsed: Option<Value> = serde_json::from_slice(&body).ok();
        let error = parsed.as_ref().map(|value| &value["error"]);
        let ok = status == case.status
            && content_type
                .as_deref()
                .is_some_and(|value| value.starts_with("application/json"))
            && error.is_some_and(|error| error["code"] == case.code && error["message"].is_string());
        if !ok {
            failures.push(format!(
                "{} {} → {status} {content_type:?} {} (wanted {} {})",
                case.method,
                &case.path[..case.path.len().min(80)],
                String::from_utf8_lossy(&body[..body.len().min(200)]),
                case.status,
                case.code
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    // Nothing of the refused requests was created, and the known conversation is untouched.
    assert_eq!(gateway.get("/v1/conversations/c-known")["revision"], 0);
    let (status, _) = gateway.post("/v1/conversations", json!({"conversation_id": "c-new"}));
    assert_eq!(
        status, 201,
        "c-new was not created by the refused request with an unknown field"
    );
}

/// Issue 48, item 14: OpenAI's Conversations API (`POST /v1/conversations` with `items` or
/// `metadata`, `/v1/conversations/{id}/items[/{item_id}]`), which the OpenAI Agents SDK's
/// conversation session calls, shares the native path. It is refused with 404 in OpenAI's
/// error shape, code `unsupported_endpoint`, creating nothing; the native API keeps working.
#[test]
fn openais_conversations_api_is_refused_in_openais_error_shape_and_the_native_api_still_works() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(&dir, &sqlite(&dir), None, "").unwrap();
    let item = json!({"type": "message", "role": "user", "content": "Hello!"});
    let requests = [
        ("POST", "/v1/conversations", Some(json!({"items": []}))),
        ("POST", "/v1/conversations", Some(json!({"items": [item]}))),
        (
            "POST",
            "/v1/conversations",
            Some(json!({"metadata": {"topic": "demo"}})),
        ),
        (
            "POST",
            "/v1/conversations",
            Some(json!({"conversation_id": "c-openai", "items": [item]})),
        ),
        ("GET", "/v1/conversations/conv_123/items?limit=10&order=asc", None),
        (
            "POST",
            "/v1/conversations/conv_123/items",
            Some(json!({"items": [item]})),
        ),
        ("GET", "/v1/conversations/conv_123/items/msg_1", None),
        ("DELETE", "/v1/conversations/conv_123/items/msg_1", None),
    ];
    for (method, path, body) in requests {
        let method_value = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut request = client().request(method_value, format!("{}{path}", gateway.base));
        if let Some(body) = &body {
            request = request.json(body);
        }
        let response = request.send().unwrap();
        let status = response.status().as_u16();
        let body: Value = response.json().unwrap_or(Value::Null);
        let error = &body["error"];
        assert_eq!(status, 404, "{method} {path}: {body}");
        assert_eq!(error["code"], "unsupported_endpoint", "{method} {path}: {body}");
        assert_eq!(error["type"], "not_found_error", "{method} {path}: {body}");
        assert!(error["message"].is_string(), "{method} {path}: {body}");
        assert!(
            error.as_object().is_some_and(|error| error.contains_key("param")),
            "{method} {path}: {body}"
        );
    }
    // Nothing was created, and the native API works as before.
    assert_eq!(gateway.get("/v1/conversations")["conversations"], json!([]));
    let (status, body) = gateway.post("/v1/conversations", json!({"conversation_id": "c-native"}));
    assert_eq!(status, 201, "{body}");
    assert_eq!(gateway.get("/v1/conversations/c-native")["revision"], 0);
    let (status, body) = gateway.post("/v1/conversations", json!({"conversation_id": "c-x", "bogus": 1}));
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (422, json!("invalid_request")),
        "{body}"
    );
}

#[test]
fn a_dispatch_with_max_output_tokens_zero_sends_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(&dir, &sqlite(&dir), None, "").unwrap();
    gateway.post("/v1/conversations", json!({"conversation_id": "c-zero"}));
    let (status, _) = gateway.post(
        "/v1/conversations/c-zero/turns",
        json!({"expected_revision": 0, "turn": {"id": "t1", "role": "user", "blocks": [{"id": "u1", "kind": "text", "text": "hi"}]}}),
    );
    assert_eq!(status, 200);
    let (status, body) = gateway.post(
        "/v1/conversations/c-zero/dispatch",
        json!({"operation_id": "op-zero", "target": {"provider": "sim", "model": "m", "adapter": "openai-chat@1"}, "max_output_tokens": 0}),
    );
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (422, json!("invalid_request")),
        "{body}"
    );
    let response = client()
        .get(format!("{}/v1/dispatches/op-zero", gateway.base))
        .send()
        .unwrap();
    assert_eq!(response.status(), 404, "no dispatch was prepared");
}

/// The proxy endpoints' bad input, table-driven: every error in the client API's own shape
/// (OpenAI `{"error": {"message", "type"}}`, Anthropic `{"type": "error", "error": {"type",
/// "message"}}`, Gemini `{"error": {"code", "status", "message"}}`) with a fitting status, and
/// nothing sent to the provider.
#[test]
fn every_proxy_endpoint_answers_bad_bodies_methods_and_paths_in_the_clients_error_shape() {
    let sim = crate::sim::SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Shape {
        OpenAi,
        Anthropic,
        Gemini,
    }
    let shaped = |shape: Shape, body: &Value| -> bool {
        match shape {
            Shape::OpenAi => body["error"]["message"].is_string() && body["error"]["type"].is_string(),
            Shape::Anthropic => {
                body["type"] == "error"
                    && body["error"]["type"].is_string()
                    && body["error"]["message"].is_string()
            }
            Shape::Gemini => body["error"]["code"].is_u64() && body["error"]["status"].is_string(),
        }
    };
    let endpoints = [
        ("/v1/chat/completions", Shape::OpenAi),
        ("/v1/responses", Shape::OpenAi),
        ("/v1/messages", Shape::Anthropic),
        ("/v1beta/models/m:generateContent", Shape::Gemini),
        ("/v1/models/m:generateContent", Shape::Gemini),
    ];
    let before = sim.requests().len();
    let mut failures = Vec::new();
    for (path, shape) in endpoints {
        let mut cases: Vec<(&str, Option<&[u8]>, u16)> = Vec::new();
        for body in [&b"{"[..], b"42", b"[]", b"null", b"{\"model\": 7}"] {
            cases.push(("POST", Some(body), 400));
        }
        cases.push(("GET", None, 405));
        for (method, body, status) in cases {
            let method_value = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
            let mut request = client().request(method_value, format!("{}{path}", gateway.base));
            if let Some(body) = body {
                request = request
                    .header("content-type", "application/json")
                    .body(body.to_vec());
            }
            let response = request.send().unwrap();
            let got = response.status().as_u16();
            let text = response.text().unwrap();
            let json: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            if got != status || !shaped(shape, &json) {
                failures.push(format!(
                    "{method} {path} {:?} → {got} {text} (wanted {status} in the {shape:?} shape)",
                    body.map(String::from_utf8_lossy)
                ));
            }
        }
    }
    // Unknown paths under each API's prefix: 404 in that API's shape.
    for (path, shape) in [
        ("/v1/chat/nothing", Shape::OpenAi),
        ("/v1/messages/nothing", Shape::Anthropic),
        ("/v1beta/nothing", Shape::Gemini),
    ] {
        let response = client()
            .post(format!("{}{path}", gateway.base))
            .body("{}")
            .send()
            .unwrap();
        let got = response.status().as_u16();
        let json: Value = serde_json::from_str(&response.text().unwrap()).unwrap_or(Value::Null);
        if got != 404 || !shaped(shape, &json) {
            failures.push(format!(
                "POST {path} → {got} {json} (wanted 404 in the {shape:?} shape)"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} cases:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(sim.requests().len(), before, "bad input is never sent");
}
