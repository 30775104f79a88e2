//! The API the console runs on (issue 18), over real HTTP against `turnstile serve` on SQLite:
//! the conversation listing (paging, search, filters, limits, tenants), the change feed
//! (`GET /v1/events`, tenant-scoped), proxy refusals (newest first, codes, offending block)
//! and shadow records that keep both bodies.

use crate::serve::{Gateway, client, sqlite};
use crate::sim::SimProcess;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};

const TENANTS: &str = "[[tenants]]\nname = \"acme\"\ntoken = \"tok-acme\"\n[[tenants]]\nname = \"globex\"\ntoken = \"tok-globex\"\n";

fn call(
    gateway: &Gateway,
    token: &str,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut request = client()
        .request(method, format!("{}{path}", gateway.base))
        .bearer_auth(token);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().unwrap();
    (
        response.status().as_u16(),
        response.json::<Value>().unwrap_or(Value::Null),
    )
}

fn get(gateway: &Gateway, token: &str, path: &str) -> (u16, Value) {
    call(gateway, token, reqwest::Method::GET, path, None)
}

fn post(gateway: &Gateway, token: &str, path: &str, body: Value) -> (u16, Value) {
    call(gateway, token, reqwest::Method::POST, path, Some(body))
}

fn user_turn(id: &str, text: &str) -> Value {
    json!({"id": id, "role": "user", "blocks": [{"id": format!("{id}-b"), "kind": "text", "text": text}]})
}

fn listed_ids(page: &Value) -> Vec<String> {
    page["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["conversation_id"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn conversations_are_listed_newest_first_paged_searched_and_scoped_to_the_tenant() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, TENANTS);
    for index in 0..7 {
        let (status, _) = post(
            &gateway,
            "tok-acme",
            "/v1/conversations",
            json!({"conversation_id": format!("chat-{index}")}),
        );
        assert_eq!(status, 201);
    }
    let (status, _) = post(
        &gateway,
        "tok-globex",
        "/v1/conversations",
        json!({"conversation_id": "chat-globex"}),
    );
    assert_eq!(status, 201);
    // A turn moves chat-2 to the front.
    let (status, _) = post(
        &gateway,
        "tok-acme",
        "/v1/conversations/chat-2/turns",
        json!({"expected_revision": 0, "turn": user_turn("t1", "hello")}),
    );
    assert_eq!(status, 200);

    let (status, first) = get(&gateway, "tok-acme", "/v1/conversations?limit=3");
    assert_eq!(status, 200);
    assert_eq!(listed_ids(&first)[0], "chat-2");
    assert_eq!(first["conversations"][0]["revision"], 1);
    assert!(first["conversations"][0]["updated_at"].as_u64().unwrap() > 0);
    assert_eq!(first["conversations"][0]["last_dispatch"], Value::Null);
    let mut seen = listed_ids(&first);
    let mut next = first["next"].clone();
    while let Some(cursor) = next.as_str() {
        let (status, page) = get(
            &gateway,
            "tok-acme",
            &format!("/v1/conversations?limit=3&after={cursor}"),
        );
        assert_eq!(status, 200);
        assert!(page["conversations"].as_array().unwrap().len() <= 3);
        seen.extend(listed_ids(&page));
        next = page["next"].clone();
    }
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 7, "every conversation once: {seen:?}");
    assert!(
        !seen.iter().any(|id| id.contains("globex") || id.contains('~')),
        "{seen:?}"
    );

    let (_, found) = get(&gateway, "tok-acme", "/v1/conversations?q=chat-5");
    assert_eq!(listed_ids(&found), ["chat-5"]);
    let (_, by_tenant_name) = get(&gateway, "tok-acme", "/v1/conversations?q=acme");
    assert_eq!(listed_ids(&by_tenant_name), Vec::<String>::new());
    let (_, globex) = get(&gateway, "tok-globex", "/v1/conversations");
    assert_eq!(listed_ids(&globex), ["chat-globex"]);
    assert_eq!(globex["next"], Value::Null);

    // Bad input: typed errors, never a silent clamp.
    for (path, status, code) in [
        ("/v1/conversations?limit=501", 422, "invalid_request"),
        ("/v1/conversations?limit=0", 422, "invalid_request"),
        ("/v1/conversations?after=nonsense", 422, "invalid_request"),
        ("/v1/conversations?state=BOGUS", 422, "invalid_request"),
        ("/v1/conversations?limit=many", 400, "invalid_request"),
        ("/v1/conversations?colour=red", 400, "invalid_request"),
        ("/v1/quarantine?limit=501", 422, "invalid_request"),
        ("/v1/proxy/refusals?limit=0", 422, "invalid_request"),
    ] {
        let (got, body) = get(&gateway, "tok-acme", path);
        assert_eq!(
            (got, body["error"]["code"].as_str()),
            (status, Some(code)),
            "{path}: {body}"
        );
    }
    let (status, body) = get(&gateway, "", "/v1/conversations");
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (401, Some("unauthorized"))
    );
    let (status, _) = get(&gateway, "tok-acme", "/v1/conversations?limit=500&q=chat");
    assert_eq!(status, 200);
}

/// Reads `event:`/`data:` frames of an SSE response.
struct Frames {
    lines: std::io::Lines<BufReader<reqwest::blocking::Response>>,
}

impl Frames {
    fn next(&mut self) -> (String, Value) {
        let (mut event, mut data) = (String::new(), String::new());
        for line in self.lines.by_ref() {
            let line = line.unwrap();
            if let Some(rest) = line.strip_prefix("event: ") {
                event = rest.to_owned();
            } else if let Some(rest) = line.strip_prefix("data: ") {
                data.push_str(rest);
            } else if line.is_empty() && !event.is_empty() {
                return (event, serde_json::from_str(&data).unwrap());
            }
        }
        panic!("the feed ended");
    }
}

fn subscribe(gateway: &Gateway, token: &str) -> Frames {
    let response = client()
        .get(format!("{}/v1/events", gateway.base))
        .bearer_auth(token)
        .send()
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut frames = Frames {
        lines: BufReader::new(response).lines(),
    };
    assert_eq!(frames.next().0, "ready");
    frames
}

#[test]
fn the_change_feed_announces_a_tenants_own_turns_dispatch_states_and_commits_only() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, TENANTS);
    let (status, _) = post(
        &gateway,
        "tok-acme",
        "/v1/conversations",
        json!({"conversation_id": "c"}),
    );
    assert_eq!(status, 201);
    let (status, _) = post(
        &gateway,
        "tok-globex",
        "/v1/conversations",
        json!({"conversation_id": "g"}),
    );
    assert_eq!(status, 201);
    let mut acme = subscribe(&gateway, "tok-acme");
    // The other tenant's turn comes first and must never reach acme's feed.
    let (status, _) = post(
        &gateway,
        "tok-globex",
        "/v1/conversations/g/turns",
        json!({"expected_revision": 0, "turn": user_turn("t1", "theirs")}),
    );
    assert_eq!(status, 200);
    let (status, _) = post(
        &gateway,
        "tok-acme",
        "/v1/conversations/c/turns",
        json!({"expected_revision": 0, "turn": user_turn("t1", "ours")}),
    );
    assert_eq!(status, 200);
    assert_eq!(
        acme.next(),
        (
            "conversation".to_owned(),
            json!({"conversation_id": "c", "revision": 1})
        )
    );
    let body = json!({"operation_id": "op-feed", "stream": false,
                      "target": {"provider": "sim", "model": "feed", "adapter": "openai-chat@2"}});
    let (status, outcome) = post(&gateway, "tok-acme", "/v1/conversations/c/dispatch", body);
    assert_eq!(
        (status, outcome["state"].as_str()),
        (200, Some("COMMITTED")),
        "{outcome}"
    );
    let mut states = Vec::new();
    loop {
        let (event, data) = acme.next();
        match event.as_str() {
            "dispatch" => {
                assert_eq!(
                    (data["operation_id"].as_str(), data["conversation_id"].as_str()),
                    (Some("op-feed"), Some("c"))
                );
                states.push(data["state"].as_str().unwrap().to_owned());
            }
            "conversation" => {
                assert_eq!(data, json!({"conversation_id": "c", "revision": 2}));
                break;
            }
            other => panic!("unexpected {other}: {data}"),
        }
    }
    assert!(states.contains(&"STREAMING".to_owned()), "{states:?}");
    let (status, body) = get(&gateway, "", "/v1/events");
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (401, Some("unauthorized"))
    );
}

#[test]
fn proxy_refusals_are_kept_newest_first_with_codes_and_the_offending_block_and_shadow_keeps_both_bodies() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let shadow_route = "[[routes]]\napi = \"openai-chat\"\nmodel = \"shadow-*\"\nmode = \"shadow\"\nprovider = \"sim\"\nadapter = \"openai-chat@2\"\n[[routes]]\napi = \"openai-chat\"\nmodel = \"*\"\nprovider = \"sim\"\nadapter = \"openai-chat@2\"\n";
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, shadow_route);
    let (status, _) = gateway.post("/v1/chat/completions", json!({"model": "m", "messages": [
        {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_nobody", "content": "orphan"}]}));
    assert_eq!(status, 400);
    let (status, _) = gateway.post(
        "/v1/chat/completions",
        json!({"model": "m2", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_w", "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"}}]}]}),
    );
    assert_eq!(status, 400);
    let refusals = gateway.get("/v1/proxy/refusals");
    let list = refusals["refusals"].as_array().unwrap();
    assert_eq!(list.len(), 2, "{refusals}");
    assert_eq!(
        list[0]["code"], "tool_results_pending",
        "newest first: {refusals}"
    );
    assert_eq!(list[0]["pending"], json!(["call_w"]));
    assert_eq!(list[1]["code"], "illegal_sequence");
    assert_eq!(list[1]["model"], "m");
    assert!(
        list[1]["violations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["code"] == "orphan_result")
    );
    let offending = &list[1]["offending"][0];
    assert_eq!(offending["code"], "orphan_result");
    assert!(
        offending["json"].as_str().unwrap().contains("call_nobody"),
        "{offending}"
    );
    assert!(offending["block"].is_string());
    assert!(list[1]["outline"]["turns"].as_array().unwrap().len() >= 2);
    let older = gateway.get(&format!("/v1/proxy/refusals?limit=1&before={}", list[0]["id"]));
    assert_eq!(older["refusals"][0]["id"], list[1]["id"]);

    // A shadowed request: the record keeps the client's exact body and ours.
    let original = r#"{"model":"shadow-x","messages":[{"role":"user","content":"compare me"}],"seed":1234567890123456789}"#;
    let response = client()
        .post(format!("{}/v1/chat/completions", gateway.base))
        .header("content-type", "application/json")
        .body(original)
        .send()
        .unwrap();
    assert_eq!(response.status(), 200);
    let _ = response.text();
    let mut record = Value::Null;
    // A bounded poll of an observable state (the comparison runs beside the forward): at most
    // 600 looks, 50 ms apart.
    for _ in 0..600 {
        let diffs = gateway.get("/v1/shadow/diffs");
        if let Some(found) = diffs["diffs"].as_array().and_then(|list| list.first()) {
            record = found.clone();
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(record["bodies"]["original"].as_str(), Some(original), "{record}");
    assert_eq!(record["bodies"]["original_truncated"], false);
    let ours = record["bodies"]["ours"].as_str().expect("ours kept");
    assert!(
        ours.contains("compare me") && ours.contains("1234567890123456789"),
        "{ours}"
    );
}
