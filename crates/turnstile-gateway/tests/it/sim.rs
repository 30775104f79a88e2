//! `turnstile sim` as a separate process on loopback: the four wire formats, every scripted
//! fault, Responses resume, idempotent replay, and the request log.

use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};

/// A running simulator, killed on drop.
pub struct SimProcess {
    child: Child,
    pub base: String,
}

impl SimProcess {
    pub fn start() -> SimProcess {
        let mut child = Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["sim", "--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let base = line.trim().rsplit(' ').next().unwrap().to_owned();
        assert!(
            base.starts_with("http://127.0.0.1:"),
            "unexpected banner {line:?}"
        );
        SimProcess { child, base }
    }

    pub fn script(&self, model: &str, replies: Value) {
        let response = client()
            .post(format!("{}/sim/script", self.base))
            .json(&json!({"model": model, "replies": replies}))
            .send()
            .unwrap();
        assert_eq!(response.status(), 200);
    }

    pub fn requests(&self) -> Vec<Value> {
        client()
            .get(format!("{}/sim/requests", self.base))
            .send()
            .unwrap()
            .json()
            .unwrap()
    }
}

impl Drop for SimProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_secs(20))
        .build()
        .unwrap()
}

/// What a streamed request produced: the bytes received, and whether the body ended cleanly.
struct Received {
    status: u16,
    bytes: Vec<u8>,
    clean_end: bool,
}

fn path_and_body(api: &str, model: &str, stream: bool) -> (String, Value) {
    match api {
        "chat" => (
            "/v1/chat/completions".into(),
            json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        "responses" => (
            "/v1/responses".into(),
            json!({"model": model, "stream": stream, "input": "hi"}),
        ),
        "anthropic" => (
            "/v1/messages".into(),
            json!({"model": model, "stream": stream, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        "gemini" => (
            format!(
                "/v1beta/models/{model}:{}",
                if stream {
                    "streamGenerateContent?alt=sse"
                } else {
                    "generateContent"
                }
            ),
            json!({"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}),
        ),
        other => panic!("unknown api {other}"),
    }
}

fn send(sim: &SimProcess, api: &str, model: &str, headers: &[(&str, &str)]) -> Received {
    let (path, body) = path_and_body(api, model, true);
    let mut request = client()
        .post(format!("{}{path}", sim.base))
        .body(body.to_string());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let mut response = request.send().unwrap();
    let status = response.status().as_u16();
    let mut bytes = Vec::new();
    let clean_end = response.read_to_end(&mut bytes).is_ok();
    Received {
        status,
        bytes,
        clean_end,
    }
}

/// SSE events as (event name, data) pairs; `[DONE]` kept as data.
fn events(bytes: &[u8]) -> Vec<(Option<String>, String)> {
    let text = String::from_utf8_lossy(bytes);
    text.split("\n\n")
        .filter(|chunk| !chunk.trim().is_empty())
        .map(|chunk| {
            let mut name = None;
            let mut data = String::new();
            for line in chunk.lines() {
                if let Some(value) = line.strip_prefix("event: ") {
                    name = Some(value.to_owned());
                } else if let Some(value) = line.strip_prefix("data: ") {
                    data.push_str(value);
                }
            }
            (name, data)
        })
        .collect()
}

/// Tool-call arguments reassembled from a stream, by call id, in the wire's own way.
fn reassembled_arguments(api: &str, bytes: &[u8]) -> Vec<(String, String)> {
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut by_key: std::collections::HashMap<String, usize> = Default::default();
    for (_, data) in events(bytes) {
        let Ok(event) = serde_json::from_str::<Value>(&data) else {
            continue;
        };
        match api {
            "chat" => {
                for call in event["choices"][0]["delta"]["tool_calls"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    let key = call["index"].to_string();
                    if let Some(id) = call["id"].as_str() {
                        by_key.insert(key.clone(), calls.len());
                        calls.push((id.to_owned(), String::new()));
                    }
                    calls[by_key[&key]]
                        .1
                        .push_str(call["function"]["arguments"].as_str().unwrap_or(""));
                }
            }
            "responses" => match event["type"].as_str().unwrap_or("") {
                "response.output_item.added" if event["item"]["type"] == "function_call" => {
                    by_key.insert(event["item"]["id"].as_str().unwrap().to_owned(), calls.len());
                    calls.push((
                        event["item"]["call_id"].as_str().unwrap().to_owned(),
                        String::new(),
                    ));
                }
                "response.function_call_arguments.delta" => {
                    calls[by_key[event["item_id"].as_str().unwrap()]]
                        .1
                        .push_str(event["delta"].as_str().unwrap());
                }
                _ => {}
            },
            "anthropic" => match event["type"].as_str().unwrap_or("") {
                "content_block_start" if event["content_block"]["type"] == "tool_use" => {
                    by_key.insert(event["index"].to_string(), calls.len());
                    calls.push((
                        event["content_block"]["id"].as_str().unwrap().to_owned(),
                        String::new(),
                    ));
                }
                "content_block_delta" if event["delta"]["type"] == "input_json_delta" => {
                    calls[by_key[&event["index"].to_string()]]
                        .1
                        .push_str(event["delta"]["partial_json"].as_str().unwrap());
                }
                _ => {}
            },
            "gemini" => {
                for part in event["candidates"][0]["content"]["parts"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    if let Some(call) = part.get("functionCall") {
                        calls.push((
                            call["name"].as_str().unwrap().to_owned(),
                            call["args"].to_string(),
                        ));
                    }
                }
            }
            _ => unreachable!(),
        }
    }
    calls
}

fn has_stop(api: &str, bytes: &[u8]) -> bool {
    events(bytes).iter().any(|(name, data)| match api {
        "chat" => {
            data == "[DONE]"
                || data.contains("\"finish_reason\":\"tool_calls\"")
                || data.contains("\"finish_reason\":\"stop\"")
        }
        "responses" => name.as_deref() == Some("response.completed"),
        "anthropic" => name.as_deref() == Some("message_stop") || name.as_deref() == Some("message_delta"),
        "gemini" => data.contains("finishReason"),
        _ => unreachable!(),
    })
}

const APIS: [&str; 4] = ["chat", "responses", "anthropic", "gemini"];

fn two_calls(faults: Value) -> Value {
    json!([{"text": "Checking both cities now.", "tool_calls": [
        {"id": "call_a", "name": "get_weather", "arguments": {"city": "Paris"}},
        {"id": "call_b", "name": "get_weather", "arguments": "{\"city\":\"Tōkyō\",\"days\":3}"}],
        "faults": faults}])
}

#[test]
fn every_wire_format_streams_text_and_parallel_calls_to_a_stop() {
    let sim = SimProcess::start();
    for api in APIS {
        let model = format!("model-{api}");
        sim.script(&model, two_calls(json!({})));
        let received = send(&sim, api, &model, &[]);
        assert_eq!(received.status, 200, "{api}");
        assert!(received.clean_end, "{api}");
        assert!(has_stop(api, &received.bytes), "{api}");
        let calls = reassembled_arguments(api, &received.bytes);
        assert_eq!(calls.len(), 2, "{api}");
        let parsed: Vec<Value> = calls
            .iter()
            .map(|(_, args)| serde_json::from_str(args).unwrap())
            .collect();
        assert_eq!(parsed[0], json!({"city": "Paris"}), "{api}");
        assert_eq!(parsed[1], json!({"city": "Tōkyō", "days": 3}), "{api}");
        if api != "gemini" {
            assert_eq!(calls[0].0, "call_a", "{api}: scripted ids are kept");
        }
        let text = String::from_utf8_lossy(&received.bytes);
        for word in ["Checking", " both", " cities", " now."] {
            assert!(text.contains(word), "{api}: {word}");
        }
    }
}

#[test]
fn a_model_with_nothing_queued_gets_a_short_fixed_text_and_non_streaming_works() {
    let sim = SimProcess::start();
    for api in APIS {
        let (path, body) = path_and_body(api, "unscripted", false);
        let response: Value = client()
            .post(format!("{}{path}", sim.base))
            .body(body.to_string())
            .send()
            .unwrap()
            .json()
            .unwrap();
        assert!(
            response
                .to_string()
                .contains("Hello from the Turnstile simulator."),
            "{api}: {response}"
        );
    }
}

#[test]
fn cut_at_byte_closes_the_connection_after_exactly_n_bytes() {
    let sim = SimProcess::start();
    for api in APIS {
        let model = format!("cut-{api}");
        sim.script(&model, two_calls(json!({"cut_at_byte": 300})));
        let received = send(&sim, api, &model, &[]);
        assert!(!received.clean_end, "{api}: a cut must not look like a clean end");
        assert_eq!(received.bytes.len(), 300, "{api}");
        assert!(!has_stop(api, &received.bytes), "{api}");
    }
}

#[test]
fn drop_stop_leaves_out_the_stop_events_but_ends_cleanly() {
    let sim = SimProcess::start();
    for api in APIS {
        let model = format!("nostop-{api}");
        sim.script(&model, two_calls(json!({"drop_stop": true})));
        let received = send(&sim, api, &model, &[]);
        assert!(received.clean_end, "{api}");
        assert!(!has_stop(api, &received.bytes), "{api}");
        assert_eq!(reassembled_arguments(api, &received.bytes).len(), 2, "{api}");
    }
}

#[test]
fn duplicate_events_sends_each_event_twice() {
    let sim = SimProcess::start();
    for api in APIS {
        let model = format!("dup-{api}");
        sim.script(&model, two_calls(json!({})));
        sim.script(&model, two_calls(json!({"duplicate_events": true})));
        let once = events(&send(&sim, api, &model, &[]).bytes);
        let twice = events(&send(&sim, api, &model, &[]).bytes);
        assert_eq!(twice.len(), once.len() * 2, "{api}");
        for (index, event) in twice.iter().enumerate().step_by(2) {
            assert_eq!(event, &twice[index + 1], "{api}");
        }
    }
}

#[test]
fn reorder_tool_calls_emits_the_second_call_first_with_its_own_key() {
    let sim = SimProcess::start();
    for api in ["chat", "responses", "anthropic"] {
        let model = format!("reorder-{api}");
        sim.script(&model, two_calls(json!({"reorder_tool_calls": true})));
        let calls = reassembled_arguments(api, &send(&sim, api, &model, &[]).bytes);
        assert_eq!(calls[0].0, "call_b", "{api}");
        assert_eq!(calls[1].0, "call_a", "{api}");
    }
}

#[test]
fn disconnect_after_events_delivers_exactly_n_events_then_drops() {
    let sim = SimProcess::start();
    for api in APIS {
        let model = format!("disc-{api}");
        sim.script(&model, two_calls(json!({"disconnect_after_events": 3})));
        let received = send(&sim, api, &model, &[]);
        assert!(!received.clean_end, "{api}");
        assert_eq!(events(&received.bytes).len(), 3, "{api}");
    }
}

#[test]
fn status_faults_answer_with_the_providers_error_body() {
    let sim = SimProcess::start();
    for api in APIS {
        for status in [429u16, 500] {
            let model = format!("status-{api}-{status}");
            sim.script(
                &model,
                json!([{"text": "never sent", "faults": {"status": status}}]),
            );
            let (path, body) = path_and_body(api, &model, true);
            let response = client()
                .post(format!("{}{path}", sim.base))
                .body(body.to_string())
                .send()
                .unwrap();
            assert_eq!(response.status().as_u16(), status, "{api}");
            if status == 429 {
                assert!(response.headers().get("retry-after").is_some(), "{api}");
            }
            let body: Value = response.json().unwrap();
            let error = if api == "anthropic" {
                &body["error"]["type"]
            } else {
                &body["error"]
            };
            assert!(!error.is_null(), "{api}: {body}");
        }
    }
}

#[test]
fn delay_ms_spaces_the_events_out() {
    let sim = SimProcess::start();
    sim.script("slow", json!([{"text": "a b c d", "faults": {"delay_ms": 40}}]));
    let started = std::time::Instant::now();
    let received = send(&sim, "anthropic", "slow", &[]);
    // Lower bound only (never a timing upper bound): 10 events × 40 ms cannot arrive sooner.
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(400),
        "{:?}",
        started.elapsed()
    );
    assert!(received.clean_end);
}

#[test]
fn a_background_response_resumes_after_the_last_sequence_number() {
    let sim = SimProcess::start();
    sim.script("bg", two_calls(json!({"disconnect_after_events": 5})));
    let body = json!({"model": "bg", "stream": true, "background": true, "input": "hi"});
    let mut response = client()
        .post(format!("{}/v1/responses", sim.base))
        .body(body.to_string())
        .send()
        .unwrap();
    let mut first = Vec::new();
    assert!(
        response.read_to_end(&mut first).is_err(),
        "the first stream is cut"
    );
    let first_events = events(&first);
    assert_eq!(first_events.len(), 5);
    let last: Value = serde_json::from_str(&first_events[4].1).unwrap();
    let handle = serde_json::from_str::<Value>(&first_events[0].1).unwrap()["response"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let after = last["sequence_number"].as_u64().unwrap();
    let mut rest = Vec::new();
    client()
        .get(format!(
            "{}/v1/responses/{handle}?stream=true&starting_after={after}",
            sim.base
        ))
        .send()
        .unwrap()
        .read_to_end(&mut rest)
        .unwrap();
    let rest_events = events(&rest);
    let first_rest: Value = serde_json::from_str(&rest_events[0].1).unwrap();
    assert_eq!(first_rest["sequence_number"].as_u64(), Some(after + 1));
    assert!(has_stop("responses", &rest));
    let mut whole = first.clone();
    whole.extend_from_slice(&rest);
    assert_eq!(reassembled_arguments("responses", &whole).len(), 2);
}

#[test]
fn a_non_resumable_response_refuses_to_resume() {
    let sim = SimProcess::start();
    sim.script(
        "fg",
        json!([{"text": "hello there", "faults": {"resumable": false}}]),
    );
    let received = send(&sim, "responses", "fg", &[]);
    let handle = serde_json::from_str::<Value>(&events(&received.bytes)[0].1).unwrap()["response"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let response = client()
        .get(format!(
            "{}/v1/responses/{handle}?stream=true&starting_after=1",
            sim.base
        ))
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
}

#[test]
fn an_idempotent_reply_is_replayed_for_a_repeated_key_and_others_are_not() {
    let sim = SimProcess::start();
    sim.script(
        "idem",
        json!([
        {"text": "first reply", "faults": {"idempotent": true, "cut_at_byte": 400}},
        {"text": "second reply"}]),
    );
    let key = [("idempotency-key", "op-1:gen-1")];
    let cut = send(&sim, "anthropic", "idem", &key);
    assert!(!cut.clean_end);
    let replay = send(&sim, "anthropic", "idem", &key);
    assert!(replay.clean_end, "the replay carries no transport fault");
    let handle_of =
        |bytes: &[u8]| serde_json::from_str::<Value>(&events(bytes)[0].1).unwrap()["message"]["id"].clone();
    let text = String::from_utf8_lossy(&replay.bytes);
    assert!(text.contains("first"), "{text}");
    assert_eq!(
        handle_of(&replay.bytes),
        handle_of(&cut.bytes),
        "the same reply, same handle"
    );
    let next = send(&sim, "anthropic", "idem", &[("idempotency-key", "op-2")]);
    assert!(String::from_utf8_lossy(&next.bytes).contains("second"));
    assert_ne!(handle_of(&next.bytes), handle_of(&cut.bytes));

    sim.script("plain", json!([{"text": "one"}, {"text": "two"}]));
    let key = [("idempotency-key", "op-3")];
    let one = String::from_utf8_lossy(&send(&sim, "anthropic", "plain", &key).bytes).into_owned();
    let two = String::from_utf8_lossy(&send(&sim, "anthropic", "plain", &key).bytes).into_owned();
    assert!(
        one.contains("\"one\"") && two.contains("\"two\""),
        "a key the reply does not honour is ignored"
    );
}

#[test]
fn the_request_log_keeps_bodies_byte_for_byte_without_credentials() {
    let sim = SimProcess::start();
    let body =
        "{\"model\":\"log\",\"stream\":true,  \"messages\":[{\"role\":\"user\",\"content\":\"h\u{e9}\"}]}";
    let mut response = client()
        .post(format!("{}/v1/messages", sim.base))
        .header("x-api-key", "sk-ant-SECRET")
        .header("authorization", "Bearer sk-SECRET")
        .header("x-goog-api-key", "AIzaSECRET")
        .header("anthropic-version", "2023-06-01")
        .body(body)
        .send()
        .unwrap();
    let mut sink = Vec::new();
    response.read_to_end(&mut sink).unwrap();
    let requests = sim.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0]["path"], "/v1/messages");
    assert_eq!(requests[0]["body"], body);
    assert_eq!(requests[0]["headers"]["anthropic-version"], "2023-06-01");
    assert!(!requests[0].to_string().contains("SECRET"));
}
