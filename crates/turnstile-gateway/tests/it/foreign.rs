//! Issue 48: tests against servers we did not write. Mock LLM servers written by others,
//! installed pinned by `scripts/test` (`crates/turnstile-gateway/tests/foreign/`: npm lockfile,
//! pip constraints, their fixture files) and named in `TURNSTILE_AIMOCK` (@copilotkit/aimock's
//! `llmock`), `TURNSTILE_STUBLLM` and `TURNSTILE_FAKELLM`. Each runs as a provider of a gateway
//! that has no simulator at all; each adapter is dispatched against each server that speaks
//! its API, streamed and not, natively and through the drop-in proxy, with text and tool calls,
//! and against the server's own fault modes. Whatever a server does, the invariants hold: a
//! dispatch ends typed, at most one canonical turn is committed and it is whole (complete tool
//! arguments), nothing of a cut stream becomes history, and the attempts are bounded. Without
//! the servers these tests fail, never skip.

use crate::serve::{
    Gateway, assert_safety_metrics_zero, assistant_turns, client, client_events, history_is_legal, named,
    sqlite,
};
use serde_json::{Value, json};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TEXT: &str = "It is sunny in Paris, twelve degrees and a light wind.";
/// `ATTEMPTS_PER_DISPATCH_MAX` (docs/operating.md, "Failure behaviour").
const ATTEMPTS_MAX: usize = 4;
const ADAPTERS: [&str; 3] = ["openai-chat@2", "anthropic-messages@2", "gemini@1"];

/// A foreign server process on loopback, killed on drop.
struct Foreign {
    child: Child,
    base: String,
    log: PathBuf,
}

impl Drop for Foreign {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/foreign")
        .join(name)
        .display()
        .to_string()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Start the executable `$var` names with `args` (`{port}` replaced) and poll `ready` until it
/// answers 200 (bounded: 60 s, or the process exits).
fn start(var: &str, args: &[&str], ready: &str, dir: &tempfile::TempDir) -> Foreign {
    let program = std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} must name the foreign mock server's executable (scripts/test installs it); this test never skips")
    });
    assert!(
        Path::new(&program).exists(),
        "{var}={program} does not exist (scripts/test installs it)"
    );
    let port = free_port().to_string();
    let log = dir.path().join(format!("{var}.log"));
    let child = Command::new(&program)
        .args(args.iter().map(|arg| arg.replace("{port}", &port)))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(dir.path().join(format!("{var}.err"))).unwrap())
        .spawn()
        .unwrap_or_else(|error| panic!("{program}: {error}"));
    let mut server = Foreign {
        child,
        base: format!("http://127.0.0.1:{port}"),
        log,
    };
    let probe = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            panic!(
                "{program} exited ({status}) before it was ready:\n{}\n{}",
                std::fs::read_to_string(&server.log).unwrap_or_default(),
                std::fs::read_to_string(dir.path().join(format!("{var}.err"))).unwrap_or_default()
            );
        }
        if probe
            .get(format!("{}{ready}", server.base))
            .send()
            .is_ok_and(|response| response.status().is_success())
        {
            return server;
        }
        assert!(
            Instant::now() < deadline,
            "{program} not ready at {}{ready} within 60 s",
            server.base
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn aimock(dir: &tempfile::TempDir) -> Foreign {
    let fixtures = fixture("aimock.json");
    start(
        "TURNSTILE_AIMOCK",
        &[
            "-p",
            "{port}",
            "-h",
            "127.0.0.1",
            "-f",
            &fixtures,
            "--log-level",
            "warn",
        ],
        "/ready",
        dir,
    )
}

fn stubllm(dir: &tempfile::TempDir) -> Foreign {
    let fixtures = fixture("stubllm.yaml");
    start(
        "TURNSTILE_STUBLLM",
        &[
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--fixture-file",
            &fixtures,
            "--log-level",
            "warning",
        ],
        "/health",
        dir,
    )
}

fn fakellm(dir: &tempfile::TempDir) -> Foreign {
    let config = fixture("fakellm.yaml");
    start(
        "TURNSTILE_FAKELLM",
        &[
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--config",
            &config,
        ],
        "/_fakellm/stats",
        dir,
    )
}

/// A gateway without a simulator whose provider `name` is `server`, with proxy routes of every
/// API to it, plus `extra` config.
fn gateway_for(dir: &tempfile::TempDir, name: &str, server: &Foreign, extra: &str) -> Gateway {
    let config = format!(
        "{extra}\n[providers.{name}]\nbase_url = \"{}\"\n\
         [[routes]]\napi = \"openai-chat\"\nmodel = \"*\"\nprovider = \"{name}\"\nadapter = \"openai-chat@2\"\n\
         [[routes]]\napi = \"anthropic-messages\"\nmodel = \"*\"\nprovider = \"{name}\"\nadapter = \"anthropic-messages@2\"\n\
         [[routes]]\napi = \"gemini\"\nmodel = \"*\"\nprovider = \"{name}\"\nadapter = \"gemini@1\"\n",
        server.base
    );
    Gateway::start_with(dir, &sqlite(dir), None, &config).unwrap()
}

/// A conversation with the weather tool and one user turn saying `text` (the servers' fixtures
/// match on it).
fn question(gateway: &Gateway, id: &str, text: &str) {
    let tools = json!([{"name": "get_weather", "input_schema": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}}]);
    let (status, body) = gateway.post(
        "/v1/conversations",
        json!({"conversation_id": id, "tools": tools}),
    );
    assert_eq!(status, 201, "{body}");
    let (status, body) = gateway.post(
        &format!("/v1/conversations/{id}/turns"),
        json!({"expected_revision": 0, "turn": {"id": "t1", "role": "user",
               "blocks": [{"id": "u1", "kind": "text", "text": text}]}}),
    );
    assert_eq!((status, body), (200, json!({"revision": 1})));
}

/// Dispatch `conversation` to `targets` (provider, model, adapter), streamed (SSE client
/// events) or not (the JSON answer's `events`); the client events either way.
fn dispatch(
    gateway: &Gateway,
    conversation: &str,
    operation: &str,
    targets: &[(&str, &str, &str)],
    stream: bool,
) -> Vec<(String, Value)> {
    let targets: Vec<Value> = targets
        .iter()
        .map(|(provider, model, adapter)| json!({"provider": provider, "model": model, "adapter": adapter}))
        .collect();
    let body =
        json!({"operation_id": operation, "stream": stream, "max_output_tokens": 256, "targets": targets});
    let response = client()
        .post(format!(
            "{}/v1/conversations/{conversation}/dispatch",
            gateway.base
        ))
        .json(&body)
        .send()
        .unwrap();
    let status = response.status().as_u16();
    let mut text = String::new();
    std::io::BufReader::new(response)
        .read_to_string(&mut text)
        .unwrap();
    assert_eq!(status, 200, "{operation}: {text}");
    if stream {
        return client_events(&text);
    }
    let answer: Value = serde_json::from_str(&text).unwrap();
    answer["events"]
        .as_array()
        .unwrap_or_else(|| panic!("{operation}: {answer}"))
        .iter()
        .map(|event| (event["event"].as_str().unwrap().to_owned(), event["data"].clone()))
        .collect()
}

/// The dispatch committed one whole turn on its first attempt; the committed turn.
fn committed_first_time(
    gateway: &Gateway,
    conversation: &str,
    operation: &str,
    events: &[(String, Value)],
) -> Value {
    let committed = named(events, "committed");
    assert_eq!(committed.len(), 1, "{operation}: {events:?}");
    assert!(named(events, "error").is_empty(), "{operation}: {events:?}");
    assert!(named(events, "retract").is_empty(), "{operation}: {events:?}");
    let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
    assert_eq!(dispatch["state"], "COMMITTED", "{operation}: {dispatch}");
    assert_eq!(
        dispatch["attempts"].as_array().unwrap().len(),
        1,
        "{operation}: {dispatch}"
    );
    let document = history_is_legal(gateway, conversation);
    assert_eq!(assistant_turns(&document), 1, "{operation}: {document}");
    assert_eq!(committed[0]["turn"], document["turns"][1], "{operation}");
    committed[0]["turn"].clone()
}

/// The turn's one text block is `TEXT`.
fn assert_text(turn: &Value, operation: &str) {
    let blocks = turn["blocks"].as_array().unwrap();
    let text: String = blocks.iter().filter_map(|block| block["text"].as_str()).collect();
    assert_eq!(text, TEXT, "{operation}: {turn}");
}

/// The turn holds exactly one tool call, `get_weather` with the complete arguments
/// `{"city": "Paris"}` and the server's call id.
fn assert_one_weather_call(turn: &Value, operation: &str) {
    let calls: Vec<&Value> = turn["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|block| block["kind"] == "tool_call")
        .collect();
    assert_eq!(calls.len(), 1, "{operation}: {turn}");
    assert_eq!(calls[0]["tool"], "get_weather", "{operation}: {turn}");
    let arguments: Value = serde_json::from_str(calls[0]["arguments"].as_str().unwrap())
        .unwrap_or_else(|error| panic!("{operation}: arguments not whole JSON ({error}): {turn}"));
    assert_eq!(arguments, json!({"city": "Paris"}), "{operation}");
    assert!(
        calls[0]["call_id"].as_str().is_some_and(|id| !id.is_empty()),
        "{operation}: {turn}"
    );
}

/// The dispatch ended `state` with nothing committed: no `committed` event, every generation
/// that previewed text retracted, no assistant turn in history, every attempt over with one of
/// `reasons`, at most `ATTEMPTS_MAX` of them. The dispatch.
fn ended_with_nothing_committed(
    gateway: &Gateway,
    conversation: &str,
    operation: &str,
    events: &[(String, Value)],
    state: &str,
    reasons: &[&str],
) -> Value {
    assert!(named(events, "committed").is_empty(), "{operation}: {events:?}");
    for preview in named(events, "preview") {
        assert!(
            named(events, "retract")
                .iter()
                .any(|retract| retract["generation"] == preview["generation"]),
            "{operation}: a previewed generation was not retracted: {events:?}"
        );
    }
    let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
    assert_eq!(dispatch["state"], state, "{operation}: {dispatch}");
    let attempts = dispatch["attempts"].as_array().unwrap();
    assert!(
        (1..=ATTEMPTS_MAX).contains(&attempts.len()),
        "{operation}: {dispatch}"
    );
    for attempt in attempts {
        assert!(
            ["FAILED", "ABANDONED"].contains(&attempt["state"].as_str().unwrap()),
            "{operation}: {dispatch}"
        );
        assert!(
            reasons.contains(&attempt["end_reason"].as_str().unwrap_or("none")),
            "{operation}: end reason not in {reasons:?}: {dispatch}"
        );
    }
    let document = history_is_legal(gateway, conversation);
    assert_eq!(document["revision"], 1, "{operation}: {document}");
    assert_eq!(assistant_turns(&document), 0, "{operation}: {document}");
    dispatch
}

/// A retried fault: every attempt used, each ABANDONED with one of `reasons`.
fn abandoned_after_every_attempt(
    gateway: &Gateway,
    conversation: &str,
    operation: &str,
    events: &[(String, Value)],
    reasons: &[&str],
) {
    let dispatch =
        ended_with_nothing_committed(gateway, conversation, operation, events, "ABANDONED", reasons);
    assert_eq!(
        dispatch["attempts"].as_array().unwrap().len(),
        ATTEMPTS_MAX,
        "{operation}: {dispatch}"
    );
}

/// A refusal: one attempt, FAILED with `provider_status_<status>`, and the client told so.
fn refused_once(
    gateway: &Gateway,
    conversation: &str,
    operation: &str,
    events: &[(String, Value)],
    status: u16,
) {
    let reason = format!("provider_status_{status}");
    let dispatch =
        ended_with_nothing_committed(gateway, conversation, operation, events, "FAILED", &[&reason]);
    assert_eq!(
        dispatch["attempts"].as_array().unwrap().len(),
        1,
        "{operation}: {dispatch}"
    );
    let errors = named(events, "error");
    assert_eq!(errors.len(), 1, "{operation}: {events:?}");
    assert_eq!(errors[0]["code"], reason, "{operation}: {events:?}");
}

fn short(adapter: &str) -> &str {
    adapter.split(['-', '@']).next().unwrap()
}

/// aimock speaks OpenAI Chat, Anthropic Messages and Gemini: each adapter commits its text and
/// its tool call (whole arguments, aimock's call id) on the first attempt, streamed and not.
#[test]
fn foreign_aimock_commits_text_and_tool_calls_for_every_adapter_streamed_and_not() {
    let dir = tempfile::tempdir().unwrap();
    let server = aimock(&dir);
    let gateway = gateway_for(&dir, "aimock", &server, "");
    for adapter in ADAPTERS {
        for stream in [true, false] {
            for case in ["text", "tool"] {
                let id = format!("c-{}-{case}-{stream}", short(adapter));
                question(&gateway, &id, &format!("case:{case}"));
                let operation = format!("op-{id}");
                let events = dispatch(&gateway, &id, &operation, &[("aimock", "m-any", adapter)], stream);
                let turn = committed_first_time(&gateway, &id, &operation, &events);
                match case {
                    "text" => assert_text(&turn, &operation),
                    _ => assert_one_weather_call(&turn, &operation),
                }
                if stream && case == "text" {
                    let previewed: String = named(&events, "preview")
                        .iter()
                        .filter_map(|preview| preview["delta"].as_str())
                        .collect();
                    assert_eq!(
                        previewed, TEXT,
                        "{operation}: aimock streams in 20-character chunks"
                    );
                }
            }
        }
    }
    assert_safety_metrics_zero(&gateway);
}

/// POST raw JSON to the gateway; the status, `content-type` and body text.
fn post_raw(gateway: &Gateway, path: &str, body: &Value) -> (u16, String, String) {
    let response = client()
        .post(format!("{}{path}", gateway.base))
        .json(body)
        .send()
        .unwrap();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|value| value.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, content_type, response.text().unwrap())
}

/// The `data:` payloads of an SSE body that are JSON.
fn sse_data(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str(data).ok())
        .collect()
}

/// The drop-in proxy in front of a foreign server: an OpenAI Chat, an Anthropic Messages and a
/// Gemini client each get the server's tool call back in their own format with whole
/// arguments, streamed and not, and the server's text too; every proxy dispatch committed.
fn proxy_round_trips(gateway: &Gateway, apis: &[&str]) {
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
    for api in apis {
        for stream in [false, true] {
            for case in ["tool", "text"] {
                let what = format!("{api} stream={stream} {case}");
                let prompt = format!("case:{case}");
                let (path, body) = match *api {
                    "openai-chat" => (
                        "/v1/chat/completions".to_owned(),
                        json!({"model": "m-proxy", "stream": stream, "messages": [{"role": "user", "content": prompt}],
                               "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]}),
                    ),
                    "anthropic-messages" => (
                        "/v1/messages".to_owned(),
                        json!({"model": "m-proxy", "max_tokens": 256, "stream": stream,
                               "messages": [{"role": "user", "content": prompt}],
                               "tools": [{"name": "get_weather", "input_schema": schema}]}),
                    ),
                    _ => (
                        if stream {
                            "/v1beta/models/m-proxy:streamGenerateContent?alt=sse".to_owned()
                        } else {
                            "/v1beta/models/m-proxy:generateContent".to_owned()
                        },
                        json!({"contents": [{"role": "user", "parts": [{"text": prompt}]}],
                               "tools": [{"functionDeclarations": [{"name": "get_weather", "parameters": schema}]}]}),
                    ),
                };
                let (status, content_type, text) = post_raw(gateway, &path, &body);
                assert_eq!(status, 200, "{what}: {text}");
                assert!(
                    content_type.starts_with(if stream {
                        "text/event-stream"
                    } else {
                        "application/json"
                    }),
                    "{what}: {content_type}"
                );
                let chunks = if stream {
                    sse_data(&text)
                } else {
                    vec![serde_json::from_str(&text).unwrap()]
                };
                let (answer, calls) = proxy_answer(api, &chunks);
                if case == "text" {
                    assert_eq!(answer, TEXT, "{what}: {text}");
                    assert!(calls.is_empty(), "{what}: {text}");
                } else {
                    assert_eq!(
                        calls,
                        vec![("get_weather".to_owned(), json!({"city": "Paris"}))],
                        "{what}: {text}"
                    );
                }
            }
        }
    }
}

/// The text and the (name, parsed arguments) of the tool calls of a proxy answer (its one
/// JSON body, or its SSE chunks), read as the client's SDK would.
fn proxy_answer(api: &str, chunks: &[Value]) -> (String, Vec<(String, Value)>) {
    let mut text = String::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    for chunk in chunks {
        match api {
            "openai-chat" => {
                let choice = &chunk["choices"][0];
                let message = if choice.get("delta").is_some() {
                    &choice["delta"]
                } else {
                    &choice["message"]
                };
                text.push_str(message["content"].as_str().unwrap_or_default());
                for call in message["tool_calls"].as_array().into_iter().flatten() {
                    let index = call["index"].as_u64().unwrap_or(calls.len() as u64) as usize;
                    if calls.len() <= index {
                        calls.push((String::new(), String::new()));
                    }
                    if let Some(name) = call["function"]["name"].as_str() {
                        calls[index].0 = name.to_owned();
                    }
                    calls[index]
                        .1
                        .push_str(call["function"]["arguments"].as_str().unwrap_or_default());
                }
            }
            "anthropic-messages" => {
                for block in chunk["content"].as_array().into_iter().flatten() {
                    match block["type"].as_str() {
                        Some("text") => text.push_str(block["text"].as_str().unwrap()),
                        Some("tool_use") => calls.push((
                            block["name"].as_str().unwrap().to_owned(),
                            block["input"].to_string(),
                        )),
                        _ => {}
                    }
                }
                if chunk["type"] == "content_block_start" && chunk["content_block"]["type"] == "tool_use" {
                    calls.push((
                        chunk["content_block"]["name"].as_str().unwrap().to_owned(),
                        String::new(),
                    ));
                }
                match chunk["delta"]["type"].as_str() {
                    Some("text_delta") => text.push_str(chunk["delta"]["text"].as_str().unwrap()),
                    Some("input_json_delta") => calls
                        .last_mut()
                        .unwrap()
                        .1
                        .push_str(chunk["delta"]["partial_json"].as_str().unwrap()),
                    _ => {}
                }
            }
            _ => {
                for part in chunk["candidates"][0]["content"]["parts"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    if let Some(piece) = part["text"].as_str() {
                        text.push_str(piece);
                    }
                    if let Some(call) = part.get("functionCall") {
                        calls.push((
                            call["name"].as_str().unwrap().to_owned(),
                            call["args"].to_string(),
                        ));
                    }
                }
            }
        }
    }
    let calls = calls
        .into_iter()
        .map(|(name, arguments)| {
            let parsed = serde_json::from_str(&arguments)
                .unwrap_or_else(|error| panic!("{api}: arguments not whole JSON ({error}): {arguments}"));
            (name, parsed)
        })
        .collect();
    (text, calls)
}

#[test]
fn foreign_aimock_behind_the_proxy_answers_every_api_streamed_and_not() {
    let dir = tempfile::tempdir().unwrap();
    let server = aimock(&dir);
    let gateway = gateway_for(&dir, "aimock", &server, "");
    proxy_round_trips(&gateway, &["openai-chat", "anthropic-messages", "gemini"]);
    assert_safety_metrics_zero(&gateway);
}

/// aimock's own fault modes, per adapter, streamed: a stream truncated after N chunks, a
/// disconnect after T ms mid-stream, a connection reset before any response (its chaos
/// `disconnectRate`), a malformed 200 JSON body (`malformedRate`) and tool arguments that are not
/// JSON each abandon every attempt and commit nothing; a status from a fixture (429, 503) or its
/// chaos (`dropRate`: 500, `rateLimitRate`: 429) fails the dispatch on its one attempt; a
/// stream truncated once (`sequenceIndex`) commits on the second attempt, once.
#[test]
fn foreign_aimock_faults_end_typed_and_commit_nothing_partial() {
    let dir = tempfile::tempdir().unwrap();
    let server = aimock(&dir);
    let gateway = gateway_for(&dir, "aimock", &server, "");
    for adapter in ADAPTERS {
        let name = short(adapter);
        let run = |case: &str, model: &str| {
            let id = format!("c-{name}-{case}-{model}");
            question(&gateway, &id, &format!("case:{case}"));
            let operation = format!("op-{id}");
            let events = dispatch(&gateway, &id, &operation, &[("aimock", model, adapter)], true);
            (id, operation, events)
        };
        // A broken JSON body is read as a whole answer (it begins with `{`) that is not JSON:
        // a protocol violation, never a turn.
        for (case, reason) in [
            ("truncate", "cut_stream"),
            ("disconnect", "cut_stream"),
            ("reset", "cut_stream"),
            ("malformed", "protocol_violation"),
        ] {
            let (id, operation, events) = run(case, "m-any");
            abandoned_after_every_attempt(&gateway, &id, &operation, &events, &[reason]);
        }
        // Gemini's arguments are an object: aimock sends the broken string as a JSON string,
        // which the tool's schema refuses.
        let (id, operation, events) = run("badargs", "m-any");
        abandoned_after_every_attempt(
            &gateway,
            &id,
            &operation,
            &events,
            &["invalid_arguments", "schema_violation"],
        );
        for (case, model, status) in [
            ("text", "busy-429", 429),
            ("text", "busy-503", 503),
            ("drop", "m-any", 500),
            ("chaos429", "m-any", 429),
        ] {
            let (id, operation, events) = run(case, model);
            refused_once(&gateway, &id, &operation, &events, status);
        }
        let (id, operation, events) = run(&format!("recover-{name}"), "m-any");
        let committed = named(&events, "committed");
        assert_eq!(committed.len(), 1, "{operation}: {events:?}");
        assert_eq!(committed[0]["turn"]["generation"], 2, "{operation}: {events:?}");
        assert_text(&committed[0]["turn"], &operation);
        assert!(
            named(&events, "retract")
                .iter()
                .any(|retract| retract["generation"] == 1),
            "{operation}: the cut first attempt is retracted: {events:?}"
        );
        let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
        let attempts = dispatch["attempts"].as_array().unwrap();
        assert_eq!(attempts.len(), 2, "{operation}: {dispatch}");
        assert_eq!(
            (&attempts[0]["state"], &attempts[0]["end_reason"]),
            (&json!("ABANDONED"), &json!("cut_stream")),
            "{operation}: {dispatch}"
        );
        let document = history_is_legal(&gateway, &id);
        assert_eq!(assistant_turns(&document), 1, "{operation}: {document}");
    }
    assert_safety_metrics_zero(&gateway);
}

/// A 429 from aimock on the first target moves the dispatch to the second (aimock again, another
/// model), which commits once; the client sees no error. Streamed and not.
#[test]
fn foreign_aimock_refusal_fails_over_and_commits_once() {
    let dir = tempfile::tempdir().unwrap();
    let server = aimock(&dir);
    let gateway = gateway_for(&dir, "aimock", &server, "");
    let mut first = true;
    for adapter in ADAPTERS {
        for stream in [true, false] {
            let id = format!("c-fo-{}-{stream}", short(adapter));
            question(&gateway, &id, "case:text");
            let operation = format!("op-{id}");
            let events = dispatch(
                &gateway,
                &id,
                &operation,
                &[("aimock", "busy-429", adapter), ("aimock", "m-fallback", adapter)],
                stream,
            );
            let committed = named(&events, "committed");
            assert_eq!(committed.len(), 1, "{operation}: {events:?}");
            assert_text(&committed[0]["turn"], &operation);
            assert!(named(&events, "error").is_empty(), "{operation}: {events:?}");
            let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
            assert_eq!(dispatch["state"], "COMMITTED", "{operation}: {dispatch}");
            let attempts = dispatch["attempts"].as_array().unwrap();
            // aimock's 429 carries `Retry-After: 1`: the target cools for a second, so a
            // dispatch within it goes to the fallback at once; the first one cannot.
            if first {
                assert_eq!(attempts.len(), 2, "{operation}: {dispatch}");
            }
            first = false;
            assert!((1..=2).contains(&attempts.len()), "{operation}: {dispatch}");
            if attempts.len() == 2 {
                assert_eq!(
                    attempts[0]["end_reason"], "provider_status_429",
                    "{operation}: {dispatch}"
                );
            }
            let last = attempts.last().unwrap();
            assert_eq!(
                (&last["model"], &last["state"]),
                (&json!("m-fallback"), &json!("COMMITTED")),
                "{operation}: {dispatch}"
            );
            assert_eq!(
                assistant_turns(&history_is_legal(&gateway, &id)),
                1,
                "{operation}"
            );
        }
    }
    assert_safety_metrics_zero(&gateway);
}

/// Chunks that come further apart than `provider_idle_timeout_ms` (aimock's per-chunk
/// `latency`, stubllm's `stream_chunk_delay_ms`): every attempt is abandoned, nothing commits.
#[test]
fn foreign_servers_stalling_past_the_idle_timeout_commit_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ai = aimock(&dir);
    let stub = stubllm(&dir);
    let gateway = gateway_for(
        &dir,
        "aimock",
        &ai,
        &format!(
            "provider_idle_timeout_ms = 400\n[providers.stubllm]\nbase_url = \"{}\"\n",
            stub.base
        ),
    );
    // (stubllm's Anthropic stream is a protocol violation before any stall.)
    for (provider, adapters) in [
        ("aimock", &ADAPTERS[..]),
        ("stubllm", &["openai-chat@2", "gemini@1"]),
    ] {
        for &adapter in adapters {
            let id = format!("c-stall-{provider}-{}", short(adapter));
            question(&gateway, &id, "case:stall");
            let operation = format!("op-{id}");
            let events = dispatch(&gateway, &id, &operation, &[(provider, "m-any", adapter)], true);
            // The driver names the stall: the transport's own timer is a later backstop
            // (`IDLE_BACKSTOP`), so the two no longer race to record `cut_stream`.
            abandoned_after_every_attempt(&gateway, &id, &operation, &events, &["idle_timeout"]);
            let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
            assert!(
                dispatch["attempts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|attempt| attempt["end_reason"] == "idle_timeout"),
                "{operation}: {dispatch}"
            );
        }
    }
    assert_safety_metrics_zero(&gateway);
}

/// stubllm, a second and sloppier implementation: what it streams whole (OpenAI Chat and
/// Gemini text) commits on the first attempt, streamed and not; what it streams broken commits
/// nothing and ends typed: OpenAI Chat tool calls with no `finish_reason` (`missing_stop`), an
/// Anthropic stream without `message_start` (`protocol_violation`), an Anthropic tool stream
/// without its arguments or stop reason, Gemini's made-up `TOOL_CALLS` finish; its status faults
/// (429, 400) fail the dispatch on its one attempt.
#[test]
fn foreign_stubllm_commits_only_whole_streams_and_ends_its_faults_typed() {
    let dir = tempfile::tempdir().unwrap();
    let server = stubllm(&dir);
    let gateway = gateway_for(&dir, "stubllm", &server, "");
    for adapter in ["openai-chat@2", "gemini@1"] {
        for stream in [true, false] {
            let id = format!("c-stub-{}-text-{stream}", short(adapter));
            question(&gateway, &id, "case:text");
            let operation = format!("op-{id}");
            let events = dispatch(
                &gateway,
                &id,
                &operation,
                &[("stubllm", "m-any", adapter)],
                stream,
            );
            let turn = committed_first_time(&gateway, &id, &operation, &events);
            assert_text(&turn, &operation);
        }
    }
    for (adapter, case, reasons) in [
        ("openai-chat@2", "tool", &["missing_stop"][..]),
        ("openai-chat@2", "badargs", &["missing_stop", "invalid_arguments"]),
        ("anthropic-messages@2", "text", &["protocol_violation"]),
        (
            "anthropic-messages@2",
            "tool",
            &["missing_stop", "protocol_violation"],
        ),
        ("gemini@1", "tool", &["cut_stream", "protocol_violation"]),
        ("gemini@1", "badargs", &["schema_violation", "invalid_arguments"]),
    ] {
        let id = format!("c-stub-{}-{case}", short(adapter));
        question(&gateway, &id, &format!("case:{case}"));
        let operation = format!("op-{id}");
        let events = dispatch(&gateway, &id, &operation, &[("stubllm", "m-any", adapter)], true);
        abandoned_after_every_attempt(&gateway, &id, &operation, &events, reasons);
    }
    for adapter in ADAPTERS {
        for (case, status) in [("ratelimit", 429), ("badrequest", 400)] {
            let id = format!("c-stub-{}-{case}", short(adapter));
            question(&gateway, &id, &format!("case:{case}"));
            let operation = format!("op-{id}");
            let events = dispatch(&gateway, &id, &operation, &[("stubllm", "m-any", adapter)], false);
            refused_once(&gateway, &id, &operation, &events, status);
        }
    }
    // Through the proxy, the OpenAI Chat and Gemini text it streams whole.
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": "m", "stream": false, "messages": [{"role": "user", "content": "case:text"}]}),
        ),
        (
            "/v1beta/models/m:generateContent",
            json!({"contents": [{"role": "user", "parts": [{"text": "case:text"}]}]}),
        ),
    ] {
        let (status, _, text) = post_raw(&gateway, path, &body);
        assert_eq!(status, 200, "{path}: {text}");
        assert!(text.contains(TEXT), "{path}: {text}");
    }
    assert_safety_metrics_zero(&gateway);
}

/// fakellm, a conformant OpenAI Chat and Anthropic Messages implementation (no Gemini): text
/// and tool calls commit on the first attempt, streamed and not, natively and through the
/// proxy. (Its status faults apply to non-streamed requests only, and the gateway always
/// streams upstream, so it has no fault case here.)
#[test]
fn foreign_fakellm_commits_text_and_tool_calls_for_openai_and_anthropic() {
    let dir = tempfile::tempdir().unwrap();
    let server = fakellm(&dir);
    let gateway = gateway_for(&dir, "fakellm", &server, "");
    for adapter in ["openai-chat@2", "anthropic-messages@2"] {
        for stream in [true, false] {
            for case in ["text", "tool"] {
                let id = format!("c-fake-{}-{case}-{stream}", short(adapter));
                question(&gateway, &id, &format!("case:{case}"));
                let operation = format!("op-{id}");
                let events = dispatch(
                    &gateway,
                    &id,
                    &operation,
                    &[("fakellm", "m-any", adapter)],
                    stream,
                );
                let turn = committed_first_time(&gateway, &id, &operation, &events);
                match case {
                    "text" => assert_text(&turn, &operation),
                    _ => assert_one_weather_call(&turn, &operation),
                }
            }
        }
    }
    proxy_round_trips(&gateway, &["openai-chat", "anthropic-messages"]);
    assert_safety_metrics_zero(&gateway);
}

/// Issue 48, item 7: a provider's refusal says why, and the client hears it. aimock's 400 and
/// 429 fixtures and stubllm's 400 carry a message in each API's error envelope; the native
/// dispatch's `error` event and the proxy client's error body carry that message, not "the
/// provider produced nothing".
#[test]
fn foreign_servers_refusal_messages_reach_the_client() {
    let dir = tempfile::tempdir().unwrap();
    let ai = aimock(&dir);
    let stub = stubllm(&dir);
    let gateway = gateway_for(
        &dir,
        "aimock",
        &ai,
        &format!("[providers.stubllm]\nbase_url = \"{}\"\n", stub.base),
    );
    for adapter in ADAPTERS {
        for (provider, model, case, status, message) in [
            (
                "aimock",
                "bad-400",
                "text",
                400,
                "aimock says: model bad-400 does not accept this request",
            ),
            ("aimock", "busy-429", "text", 429, "Rate limited by aimock"),
            (
                "stubllm",
                "m-any",
                "badrequest",
                400,
                "stubllm says: this request is invalid",
            ),
        ] {
            let id = format!("c-why-{}-{provider}-{status}", short(adapter));
            question(&gateway, &id, &format!("case:{case}"));
            let operation = format!("op-{id}");
            let events = dispatch(&gateway, &id, &operation, &[(provider, model, adapter)], false);
            refused_once(&gateway, &id, &operation, &events, status);
            let errors = named(&events, "error");
            assert!(
                errors[0]["message"]
                    .as_str()
                    .is_some_and(|text| text.contains(message)),
                "{operation}: the provider's own message is lost: {events:?}"
            );
        }
    }
    // Through the proxy, in each client's error shape.
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": "bad-400", "messages": [{"role": "user", "content": "case:text"}]}),
        ),
        (
            "/v1/messages",
            json!({"model": "bad-400", "max_tokens": 64, "stream": true,
                   "messages": [{"role": "user", "content": "case:text"}]}),
        ),
        (
            "/v1beta/models/bad-400:generateContent",
            json!({"contents": [{"role": "user", "parts": [{"text": "case:text"}]}]}),
        ),
    ] {
        let (status, _, text) = post_raw(&gateway, path, &body);
        assert_eq!(status, 400, "{path}: {text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|text| text.contains("aimock says: model bad-400 does not accept this request")),
            "{path}: the provider's own message is lost: {body}"
        );
    }
}
