//! `turnstile serve` end to end: the gateway and the simulator as separate processes on
//! loopback, real SQLite files (and a real PostgreSQL server for the two-replica race), real
//! wire formats. Each test asserts client events, history, quarantine, the simulator's request
//! log (every sent body's SHA-256 equals its manifest's request digest) and metrics.

use crate::sim::SimProcess;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running gateway, killed on drop.
pub struct Gateway {
    child: Child,
    pub base: String,
    log: PathBuf,
}

pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

impl Gateway {
    pub fn start(dir: &tempfile::TempDir, store: &str, sim: &SimProcess, extra_config: &str) -> Gateway {
        Gateway::start_with(dir, store, Some(&sim.base), extra_config).unwrap()
    }

    pub fn start_with(
        dir: &tempfile::TempDir,
        store: &str,
        sim_url: Option<&str>,
        extra_config: &str,
    ) -> Result<Gateway, String> {
        Gateway::start_with_env(dir, store, sim_url, extra_config, &[])
    }

    /// [`Gateway::start_with`] with extra environment variables for the gateway process.
    pub fn start_with_env(
        dir: &tempfile::TempDir,
        store: &str,
        sim_url: Option<&str>,
        extra_config: &str,
        env: &[(&str, &str)],
    ) -> Result<Gateway, String> {
        Gateway::start_in(
            Command::new(env!("CARGO_BIN_EXE_turnstile")),
            dir,
            store,
            sim_url,
            extra_config,
            env,
        )
    }

    /// [`Gateway::start_with`] under a soft and hard descriptor limit of `descriptors`
    /// (`RLIMIT_NOFILE`, set by util-linux `prlimit`).
    pub fn start_with_descriptors(
        dir: &tempfile::TempDir,
        store: &str,
        extra_config: &str,
        descriptors: u64,
    ) -> Result<Gateway, String> {
        let mut command = Command::new("prlimit");
        command.args([
            format!("--nofile={descriptors}:{descriptors}").as_str(),
            "--",
            env!("CARGO_BIN_EXE_turnstile"),
        ]);
        Gateway::start_in(command, dir, store, None, extra_config, &[])
    }

    /// `command` (the `turnstile` binary, or a wrapper that runs it) with `serve` and its
    /// arguments appended.
    fn start_in(
        mut command: Command,
        dir: &tempfile::TempDir,
        store: &str,
        sim_url: Option<&str>,
        extra_config: &str,
        env: &[(&str, &str)],
    ) -> Result<Gateway, String> {
        let config = dir.path().join("turnstile.toml");
        // A short lease unless the test sets its own.
        let lease = if extra_config.contains("lease_ms") {
            ""
        } else {
            "lease_ms = 400\n"
        };
        std::fs::write(&config, format!("{lease}{extra_config}\n")).unwrap();
        let log = dir.path().join(format!(
            "gateway-{}.log",
            Instant::now().elapsed().as_nanos() ^ std::process::id() as u128
        ));
        command.args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store",
            store,
            "--config",
            config.to_str().unwrap(),
        ]);
        if let Some(url) = sim_url {
            command.args(["--sim-url", url]);
        }
        command.envs(env.iter().copied());
        let mut child = command
            .env("TURNSTILE_TEST_PROVIDER_KEY", "sk-test-SECRET-KEY-123")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        if !line.contains("listening on") {
            let _ = child.wait();
            return Err(std::fs::read_to_string(&log).unwrap_or_default());
        }
        let base = line
            .split_whitespace()
            .find(|word| word.starts_with("http://"))
            .unwrap()
            .to_owned();
        Ok(Gateway { child, base, log })
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Send SIGTERM (as Kubernetes and systemd do to stop a process).
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -TERM failed");
    }

    /// The process's exit status once it exited, polled every 50 ms for at most `limit`
    /// (None: still running then).
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What the process logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let response = client()
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json().unwrap_or(Value::Null))
    }

    pub fn get(&self, path: &str) -> Value {
        client()
            .get(format!("{}{path}", self.base))
            .send()
            .unwrap()
            .json()
            .unwrap()
    }

    pub fn metric(&self, name_and_labels: &str) -> f64 {
        let text = client()
            .get(format!("{}/metrics", self.base))
            .send()
            .unwrap()
            .text()
            .unwrap();
        text.lines()
            .filter(|line| !line.starts_with('#'))
            .find_map(|line| {
                line.strip_prefix(name_and_labels)
                    .and_then(|rest| rest.trim().parse().ok())
            })
            .unwrap_or_else(|| panic!("no series {name_and_labels} in\n{text}"))
    }

    /// Stream a dispatch and collect its client events until the gateway ends the stream.
    pub fn dispatch(
        &self,
        conversation: &str,
        operation: &str,
        adapter: &str,
        model: &str,
    ) -> Vec<(String, Value)> {
        let (status, events) = self.dispatch_raw(conversation, operation, adapter, model);
        assert_eq!(status, 200, "{events:?}");
        events
    }

    /// Like `dispatch`, with the HTTP status; an error body comes back as one `http_error` event.
    pub fn dispatch_raw(
        &self,
        conversation: &str,
        operation: &str,
        adapter: &str,
        model: &str,
    ) -> (u16, Vec<(String, Value)>) {
        let body = json!({"operation_id": operation, "target": {"provider": "sim", "model": model, "adapter": adapter},
                          "stream": true, "max_output_tokens": 256});
        let response = client()
            .post(format!("{}/v1/conversations/{conversation}/dispatch", self.base))
            .json(&body)
            .send()
            .unwrap();
        let status = response.status().as_u16();
        let mut text = String::new();
        BufReader::new(response).read_to_string(&mut text).unwrap();
        if status != 200 {
            return (
                status,
                vec![(
                    "http_error".to_owned(),
                    serde_json::from_str(&text).unwrap_or(Value::Null),
                )],
            );
        }
        (status, client_events(&text))
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn client_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|chunk| !chunk.trim().is_empty())
        .map(|chunk| {
            let mut name = String::new();
            let mut data = Value::Null;
            for line in chunk.lines() {
                if let Some(value) = line.strip_prefix("event: ") {
                    name = value.to_owned();
                } else if let Some(value) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(value).unwrap();
                }
            }
            (name, data)
        })
        .collect()
}

pub fn named<'a>(events: &'a [(String, Value)], name: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|(event, _)| event == name)
        .map(|(_, data)| data)
        .collect()
}

const TOOLS: &str = r#"[{"name": "get_weather", "input_schema": {"type": "object",
    "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}}]"#;

pub fn conversation_with_question(gateway: &Gateway, id: &str) {
    let tools: Value = serde_json::from_str(TOOLS).unwrap();
    let (status, _) = gateway.post(
        "/v1/conversations",
        json!({"conversation_id": id, "tools": tools}),
    );
    assert_eq!(status, 201);
    let (status, body) = gateway.post(
        &format!("/v1/conversations/{id}/turns"),
        json!({"expected_revision": 0, "turn": {"id": "t1", "role": "user",
               "blocks": [{"id": "u1", "kind": "text", "text": "Weather in Paris and Tokyo?"}]}}),
    );
    assert_eq!((status, body), (200, json!({"revision": 1})));
}

pub fn two_calls(faults: Value) -> Value {
    json!({"text": "Checking both.", "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": {"city": "Tokyo"}}], "faults": faults})
}

/// Every body the simulator received for a dispatch hashes to its manifest's request digest.
pub fn assert_sent_bodies_match_manifest(gateway: &Gateway, sim: &SimProcess, operation: &str) -> usize {
    let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
    let digest = dispatch["manifest"]["request_digest"]
        .as_str()
        .unwrap()
        .to_owned();
    let requests = sim.requests();
    let mut sent = 0;
    for request in requests
        .iter()
        .filter(|request| request["body"].as_str().is_some_and(|body| !body.is_empty()))
    {
        let body = request["body"].as_str().unwrap();
        let hash = format!("sha256:{}", hex(&Sha256::digest(body.as_bytes())));
        if hash == digest {
            sent += 1;
            assert_eq!(request["headers"]["idempotency-key"].as_str().is_some(), true);
        }
    }
    sent
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn history_is_legal(gateway: &Gateway, id: &str) -> Value {
    let document = gateway.get(&format!("/v1/conversations/{id}"));
    let conversation = turnstile_core::Conversation::from_value(document.clone()).unwrap();
    let verdict = turnstile_core::validate(&conversation);
    assert!(
        !matches!(verdict, turnstile_core::Verdict::Rejected(_)),
        "{verdict:?}"
    );
    document
}

pub fn assistant_turns(document: &Value) -> usize {
    document["turns"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|turn| turn["role"] == "assistant")
        .count()
}

pub fn assert_safety_metrics_zero(gateway: &Gateway) {
    assert_eq!(gateway.metric("turnstile_partial_tool_dispatch_total"), 0.0);
    assert_eq!(gateway.metric("turnstile_illegal_sends_total"), 0.0);
}

/// A provider that accepts connections and never sends a response head: its port.
pub fn silent_provider() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming() {
            match stream {
                Ok(stream) => held.push(stream),
                Err(_) => return,
            }
        }
    });
    port
}

/// A tag unique to this run, for ids in a PostgreSQL database other runs share.
pub fn run_id() -> String {
    format!(
        "{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

/// The PostgreSQL server the suite runs against (`TURNSTILE_PG_URL`, which scripts/test sets);
/// a test that calls it fails without one, never skips.
pub fn pg_url() -> String {
    std::env::var("TURNSTILE_PG_URL").expect(
        "TURNSTILE_PG_URL must point at a PostgreSQL server (scripts/test starts one); this test never skips",
    )
}

pub fn sqlite(dir: &tempfile::TempDir) -> String {
    format!("sqlite:{}", dir.path().join("turnstile.db").display())
}

#[test]
fn every_wire_format_dispatches_commits_tool_calls_and_takes_their_results() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    for adapter in [
        "openai-chat@1",
        "openai-chat@2",
        "openai-responses@1",
        "anthropic-messages@1",
        "anthropic-messages@2",
        "gemini@1",
    ] {
        let id = format!("c-{}", adapter.replace('@', "-"));
        let model = format!("model-{id}");
        conversation_with_question(&gateway, &id);
        sim.script(
            &model,
            json!([two_calls(json!({})), {"text": "Paris 12C, Tokyo 18C."}]),
        );
        let events = gateway.dispatch(&id, &format!("op-{id}"), adapter, &model);
        assert!(!named(&events, "preview").is_empty(), "{adapter}: {events:?}");
        assert!(named(&events, "retract").is_empty(), "{adapter}");
        let committed = named(&events, "committed");
        assert_eq!(committed.len(), 1, "{adapter}: {events:?}");
        assert_eq!(committed[0]["revision"], 2);
        let calls: Vec<&Value> = committed[0]["turn"]["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["kind"] == "tool_call")
            .collect();
        assert_eq!(calls.len(), 2, "{adapter}");
        // Tool calls reach the execution ledger only now, committed; executors answer them.
        let ready = gateway.get("/v1/tool-calls?state=ready");
        let mine: Vec<&Value> = ready["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["conversation_id"] == id.as_str())
            .collect();
        assert_eq!(mine.len(), 2, "{adapter}");
        for call in mine.iter().rev() {
            let call_id = call["call_id"].as_str().unwrap();
            let (status, claim) = gateway.post(
                &format!("/v1/tool-calls/{id}/{call_id}/claim"),
                json!({"holder": "serve-test"}),
            );
            assert_eq!(status, 200, "{adapter}: {claim}");
            let (status, result) = gateway.post(
                &format!("/v1/tool-calls/{id}/{call_id}/result"),
                json!({"claim": claim["claim"], "status": "success", "content": [{"kind": "text", "text": "12C"}]}),
            );
            assert_eq!(status, 200, "{adapter}: {result}");
        }
        let second = gateway.dispatch(&id, &format!("op2-{id}"), adapter, &model);
        let committed = named(&second, "committed");
        assert_eq!(committed.len(), 1, "{adapter}: {second:?}");
        assert_eq!(committed[0]["revision"], 5, "{adapter}");
        let document = history_is_legal(&gateway, &id);
        assert_eq!(document["revision"], 5);
        assert_eq!(assistant_turns(&document), 2);
        // The `committed` event carries exactly the turn that became history.
        assert_eq!(committed[0]["turn"], document["turns"][4], "{adapter}");
        assert_eq!(
            assert_sent_bodies_match_manifest(&gateway, &sim, &format!("op-{id}")),
            1,
            "{adapter}"
        );
        assert_eq!(
            assert_sent_bodies_match_manifest(&gateway, &sim, &format!("op2-{id}")),
            1,
            "{adapter}"
        );
    }
    let anthropic = sim
        .requests()
        .into_iter()
        .find(|r| r["path"] == "/v1/messages")
        .unwrap();
    assert_eq!(anthropic["headers"]["anthropic-version"], "2023-06-01");
    assert_safety_metrics_zero(&gateway);
    assert!(
        gateway.metric(r#"turnstile_dispatch_transitions_total{from="STREAMING",to="COMMITTED"}"#) >= 12.0
    );
}

#[test]
fn a_cut_stream_is_retracted_and_a_new_attempt_re_sends_the_same_bytes_and_commits_once() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    conversation_with_question(&gateway, "c-cut");
    sim.script(
        "cut",
        json!([two_calls(json!({"cut_at_byte": 700})), two_calls(json!({}))]),
    );
    let events = gateway.dispatch("c-cut", "op-cut", "anthropic-messages@1", "cut");
    let retracts = named(&events, "retract");
    assert_eq!(retracts.len(), 1, "{events:?}");
    assert_eq!(retracts[0]["generation"], 1);
    let committed = named(&events, "committed");
    assert_eq!(committed.len(), 1, "{events:?}");
    assert_eq!(committed[0]["turn"]["generation"], 2);
    let document = history_is_legal(&gateway, "c-cut");
    assert_eq!(assistant_turns(&document), 1);
    assert_eq!(
        assert_sent_bodies_match_manifest(&gateway, &sim, "op-cut"),
        2,
        "both attempts sent the manifest's bytes"
    );
    let dispatch = gateway.get("/v1/dispatches/op-cut");
    let attempts = dispatch["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0]["state"], "ABANDONED");
    assert_eq!(attempts[1]["state"], "COMMITTED");
    // Why each attempt ended is durable and shown: the cut, how its end was confirmed before
    // the new generation, and the commit.
    // (The assembler's own code for a body that stopped before its stop signal.)
    assert_eq!(attempts[0]["end_reason"], "cut_stream", "{dispatch}");
    assert!(
        ["connection_closed", "provider_ended"]
            .contains(&attempts[0]["confirmed_over"].as_str().unwrap_or("")),
        "{dispatch}"
    );
    assert_eq!(attempts[1]["end_reason"], "committed", "{dispatch}");
    assert_eq!(gateway.metric("turnstile_preview_retractions_total"), 1.0);
    assert!(gateway.metric(r#"turnstile_handle_recoveries_total{outcome="new_generation"}"#) >= 1.0);
    let calls = gateway.get("/v1/tool-calls?state=ready")["tool_calls"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(
        calls, 2,
        "only the committed generation's calls are in the ledger"
    );
    assert_safety_metrics_zero(&gateway);
}

#[test]
fn a_lost_stop_event_or_duplicated_events_never_commit_a_corrupted_turn() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    for adapter in [
        "openai-chat@1",
        "openai-responses@1",
        "anthropic-messages@1",
        "gemini@1",
    ] {
        let id = format!("c-stop-{}", adapter.replace('@', "-"));
        let model = format!("m-{id}");
        conversation_with_question(&gateway, &id);
        let duplicate = json!({"duplicate_events": true});
        sim.script(
            &model,
            json!([
                two_calls(json!({"drop_stop": true})),
                two_calls(duplicate),
                two_calls(json!({}))
            ]),
        );
        let events = gateway.dispatch(&id, &format!("op-{id}"), adapter, &model);
        let committed = named(&events, "committed");
        assert_eq!(committed.len(), 1, "{adapter}: {events:?}");
        let generation = committed[0]["turn"]["generation"].as_u64().unwrap();
        // Every generation before the committed one was retracted, once.
        let retracted: Vec<u64> = named(&events, "retract")
            .iter()
            .map(|r| r["generation"].as_u64().unwrap())
            .collect();
        assert_eq!(
            retracted,
            (1..generation).collect::<Vec<_>>(),
            "{adapter}: {events:?}"
        );
        if adapter == "openai-responses@1" || adapter == "gemini@1" {
            // Responses events carry sequence numbers and Gemini chunks a cumulative token
            // count: the duplicates are dropped, not retried.
            assert_eq!(generation, 2, "{adapter}");
        }
        let blocks = committed[0]["turn"]["blocks"].as_array().unwrap();
        let arguments: Vec<Value> = blocks
            .iter()
            .filter(|b| b["kind"] == "tool_call")
            .map(|b| serde_json::from_str(b["arguments"].as_str().unwrap()).unwrap())
            .collect();
        assert_eq!(
            arguments,
            [json!({"city": "Paris"}), json!({"city": "Tokyo"})],
            "{adapter}"
        );
        let texts: Vec<&Value> = blocks
            .iter()
            .filter(|b| b["kind"] == "text")
            .map(|b| &b["text"])
            .collect();
        assert_eq!(texts, [&json!("Checking both.")], "{adapter}");
        assert_eq!(assistant_turns(&history_is_legal(&gateway, &id)), 1);
    }
    assert_safety_metrics_zero(&gateway);
}

/// Issue 17: a text-only reply (no tool call to break) with every event delivered twice never
/// commits doubled text. Chat has no sequence numbers: its decoder holds the reported
/// `completion_tokens` against the output carried (exact for a model the catalog knows);
/// Anthropic's second `content_block_start`/`stop` of one index is a protocol violation.
#[test]
fn duplicated_events_on_a_text_only_reply_never_commit_doubled_text() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    let text = "Transfer one hundred dollars to savings.";
    for (adapter, model) in [
        ("openai-chat@1", "gpt-4o-dup"),
        ("openai-chat@2", "gpt-4.1-dup"),
        ("anthropic-messages@1", "claude-dup"),
    ] {
        let id = format!("c-dup-{}", adapter.replace('@', "-"));
        conversation_with_question(&gateway, &id);
        sim.script(
            model,
            json!([{"text": text, "faults": {"duplicate_events": true}}, {"text": text}]),
        );
        let events = gateway.dispatch(&id, &format!("op-{id}"), adapter, model);
        let committed = named(&events, "committed");
        assert_eq!(committed.len(), 1, "{adapter}: {events:?}");
        assert_eq!(committed[0]["turn"]["generation"], 2, "{adapter}: {events:?}");
        let retracted = named(&events, "retract");
        assert_eq!(retracted.len(), 1, "{adapter}: {events:?}");
        assert_eq!(retracted[0]["generation"], 1, "{adapter}");
        let history = history_is_legal(&gateway, &id);
        let last = history["turns"].as_array().unwrap().last().unwrap().clone();
        assert_eq!(last["blocks"][0]["text"], text, "{adapter}: {last}");
        assert_eq!(assistant_turns(&history), 1);
    }
    assert_safety_metrics_zero(&gateway);
}

#[test]
fn a_resumable_responses_stream_resumes_by_handle_without_retracting() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    conversation_with_question(&gateway, "c-resume");
    sim.script(
        "resume",
        json!([two_calls(
            // No `resumable` flag: the gateway asks for background mode, which makes the
            // response resumable, as on the real API.
            json!({"disconnect_after_events": 9})
        )]),
    );
    let events = gateway.dispatch("c-resume", "op-resume", "openai-responses@1", "resume");
    assert!(named(&events, "retract").is_empty(), "{events:?}");
    let committed = named(&events, "committed");
    assert_eq!(committed.len(), 1, "{events:?}");
    assert_eq!(
        committed[0]["turn"]["generation"], 1,
        "the same generation, resumed"
    );
    let resumes: Vec<Value> = sim
        .requests()
        .into_iter()
        .filter(|r| r["path"].as_str().unwrap().contains("starting_after"))
        .collect();
    assert_eq!(resumes.len(), 1);
    let sent = sim
        .requests()
        .into_iter()
        .find(|r| r["path"] == "/v1/responses")
        .unwrap();
    assert!(
        sent["body"].as_str().unwrap().contains("\"background\":true"),
        "{sent}"
    );
    assert_eq!(
        assert_sent_bodies_match_manifest(&gateway, &sim, "op-resume"),
        1,
        "nothing was sent twice"
    );
    assert_eq!(
        gateway.metric(r#"turnstile_handle_recoveries_total{outcome="resumed"}"#),
        1.0
    );
    assert_safety_metrics_zero(&gateway);
}

#[test]
fn provider_errors_fail_the_dispatch_and_change_no_history() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    for status in [429, 500] {
        let id = format!("c-status-{status}");
        conversation_with_question(&gateway, &id);
        sim.script(
            &format!("s{status}"),
            json!([{"text": "never", "faults": {"status": status}}]),
        );
        let events = gateway.dispatch(&id, &format!("op-{id}"), "openai-chat@1", &format!("s{status}"));
        let errors = named(&events, "error");
        assert_eq!(
            errors[0]["code"],
            format!("provider_status_{status}"),
            "{events:?}"
        );
        assert!(named(&events, "committed").is_empty());
        assert_eq!(gateway.get(&format!("/v1/dispatches/op-{id}"))["state"], "FAILED");
        assert_eq!(gateway.get(&format!("/v1/conversations/{id}"))["revision"], 1);
    }
    assert_safety_metrics_zero(&gateway);
}

#[test]
fn waiting_history_sends_nothing_and_illegal_turns_are_refused_with_codes() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    conversation_with_question(&gateway, "c-wait");
    sim.script("wait", json!([two_calls(json!({}))]));
    let events = gateway.dispatch("c-wait", "op-wait-1", "anthropic-messages@1", "wait");
    assert_eq!(named(&events, "committed").len(), 1);
    let sent_before = sim.requests().len();
    let events = gateway.dispatch("c-wait", "op-wait-2", "anthropic-messages@1", "wait");
    let waiting = named(&events, "waiting");
    assert_eq!(waiting.len(), 1, "{events:?}");
    assert_eq!(waiting[0]["pending"].as_array().unwrap().len(), 2);
    assert_eq!(
        sim.requests().len(),
        sent_before,
        "no request while calls are pending"
    );

    // An orphan result and a result for the wrong tool: 422 with every code, nothing written.
    let (status, body) = gateway.post(
        "/v1/conversations/c-wait/turns",
        json!({"expected_revision": 2, "turn": {"id": "t-bad", "role": "tool", "blocks": [
            {"id": "r-x", "kind": "tool_result", "call_id": "no-such-call", "tool": "get_weather", "status": "success"}]}}),
    );
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["code"], "rejected");
    assert_eq!(body["error"]["violations"][0]["code"], "orphan_result");
    assert_eq!(gateway.metric("turnstile_tool_result_orphans_total"), 1.0);
    assert!(gateway.metric(r#"turnstile_validator_rejects_total{code="orphan_result"}"#) >= 1.0);
    let (status, body) = gateway.post(
        "/v1/conversations/c-wait/turns",
        json!({"expected_revision": 1, "turn": {"id": "t-late", "role": "user", "blocks": [{"id": "u9", "kind": "text", "text": "x"}]}}),
    );
    assert_eq!(
        (status, body["error"]["current_revision"].clone()),
        (409, json!(2))
    );
    assert_eq!(gateway.get("/v1/conversations/c-wait")["revision"], 2);

    // Results appended as a plain tool turn (in reverse order) close the calls in the ledger.
    let ready: Vec<Value> = gateway.get("/v1/tool-calls?state=ready")["tool_calls"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(ready.len(), 2);
    let results: Vec<Value> = ready
        .iter()
        .rev()
        .enumerate()
        .map(|(i, call)| {
            json!({"id": format!("r{i}"), "kind": "tool_result", "call_id": call["call_id"], "tool": call["tool"],
                   "args_digest": call["args_digest"], "generation": call["generation"], "status": "success",
                   "content": [{"kind": "text", "text": "ok"}]})
        })
        .collect();
    let (status, body) = gateway.post(
        "/v1/conversations/c-wait/turns",
        json!({"expected_revision": 2, "turn": {"id": "t-results", "role": "tool", "blocks": results}}),
    );
    assert_eq!(status, 200, "{body}");
    assert!(
        gateway.get("/v1/tool-calls?state=ready")["tool_calls"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        gateway.get("/v1/tool-calls?state=done")["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

#[test]
fn one_operation_id_is_one_dispatch_even_when_asked_twice_at_once() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    conversation_with_question(&gateway, "c-idem");
    sim.script("idem", json!([{"text": "one reply only", "faults": {"delay_ms": 20}}, {"text": "a second reply must never be used"}]));
    let runs: Vec<Vec<(String, Value)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..3)
            .map(|_| scope.spawn(|| gateway.dispatch("c-idem", "op-idem", "openai-chat@1", "idem")))
            .collect();
        handles.into_iter().map(|handle| handle.join().unwrap()).collect()
    });
    for events in &runs {
        let committed = named(events, "committed");
        assert_eq!(committed.len(), 1, "{events:?}");
        assert_eq!(committed[0]["revision"], 2);
    }
    let again = gateway.dispatch("c-idem", "op-idem", "openai-chat@1", "idem");
    assert_eq!(named(&again, "committed")[0]["revision"], 2);
    assert_eq!(sim.requests().len(), 1);
    let document = history_is_legal(&gateway, "c-idem");
    assert_eq!(assistant_turns(&document), 1);
    assert!(document.to_string().contains("one reply only"));
}

#[test]
fn a_gateway_killed_mid_stream_recovers_on_restart_to_exactly_one_canonical_turn() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite(&dir);
    let mut gateway = Gateway::start(&dir, &store, &sim, "");
    conversation_with_question(&gateway, "c-crash");
    sim.script(
        "crash",
        json!([
        {"text": "this reply is cut by the crash and never committed", "faults": {"delay_ms": 150}},
        {"text": "after recovery"}]),
    );
    let body = json!({"operation_id": "op-crash", "target": {"provider": "sim", "model": "crash", "adapter": "anthropic-messages@1"}, "stream": true});
    let response = client()
        .post(format!("{}/v1/conversations/c-crash/dispatch", gateway.base))
        .json(&body)
        .send()
        .unwrap();
    let mut reader = BufReader::new(response);
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap() > 0 {
        if line.contains("event: preview") {
            break;
        }
    }
    gateway.kill(); // SIGKILL mid-stream: no shutdown path runs.
    drop(reader);
    let gateway = Gateway::start(&dir, &store, &sim, "");
    let deadline = Instant::now() + Duration::from_secs(30);
    let dispatch = loop {
        let dispatch = gateway.get("/v1/dispatches/op-crash");
        if dispatch["state"] == "COMMITTED" || Instant::now() > deadline {
            break dispatch;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(dispatch["state"], "COMMITTED", "{dispatch}");
    let attempts = dispatch["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{dispatch}");
    assert!(
        attempts[0]["history"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h["state"] == "UNKNOWN"),
        "{dispatch}"
    );
    let document = history_is_legal(&gateway, "c-crash");
    assert_eq!(assistant_turns(&document), 1);
    assert!(document.to_string().contains("after recovery"));
    assert!(!document.to_string().contains("never committed"));
    assert_eq!(assert_sent_bodies_match_manifest(&gateway, &sim, "op-crash"), 2);
    // A client that comes back with the same operation id gets the committed outcome.
    let events = gateway.dispatch("c-crash", "op-crash", "anthropic-messages@1", "crash");
    assert_eq!(named(&events, "committed")[0]["revision"], 2);
    assert_safety_metrics_zero(&gateway);
}

#[test]
fn tenants_see_only_their_own_conversations_and_need_a_token() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(
        &dir,
        &sqlite(&dir),
        &sim,
        "[[tenants]]\nname = \"acme\"\ntoken = \"tok-acme\"\n[[tenants]]\nname = \"globex\"\ntoken = \"tok-globex\"\n",
    );
    let as_tenant = |token: &str, method: reqwest::Method, path: &str, body: Option<Value>| {
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
    };
    let (status, _) = as_tenant(
        "tok-acme",
        reqwest::Method::POST,
        "/v1/conversations",
        Some(json!({"conversation_id": "shared-name"})),
    );
    assert_eq!(status, 201);
    let (status, own) = as_tenant(
        "tok-acme",
        reqwest::Method::GET,
        "/v1/conversations/shared-name",
        None,
    );
    assert_eq!(
        (status, own["conversation_id"].clone()),
        (200, json!("shared-name"))
    );
    let (status, other) = as_tenant(
        "tok-globex",
        reqwest::Method::GET,
        "/v1/conversations/shared-name",
        None,
    );
    let (_, missing) = as_tenant(
        "tok-globex",
        reqwest::Method::GET,
        "/v1/conversations/never-created",
        None,
    );
    assert_eq!(status, 404);
    assert_eq!(
        other, missing,
        "another tenant's conversation answers exactly as a missing one"
    );
    let (status, _) = as_tenant(
        "tok-globex",
        reqwest::Method::POST,
        "/v1/conversations",
        Some(json!({"conversation_id": "shared-name"})),
    );
    assert_eq!(status, 201, "the same name is free in another tenant");
    let response = client()
        .get(format!("{}/v1/conversations/shared-name", gateway.base))
        .send()
        .unwrap();
    assert_eq!(response.status(), 401);
    let (status, _) = as_tenant("wrong-token", reqwest::Method::GET, "/v1/tool-calls", None);
    assert_eq!(status, 401);
}

#[test]
fn the_simulators_routes_and_provider_exist_only_on_the_embedded_default() {
    let request =
        |gateway: &Gateway, method: reqwest::Method, path: &str, token: Option<&str>, body: Value| {
            let mut request = client().request(method, format!("{}{path}", gateway.base));
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request.json(&body).send().unwrap();
            (
                response.status().as_u16(),
                response.json::<Value>().unwrap_or(Value::Null),
            )
        };
    let script = json!({"model": "m", "replies": [{"text": "leaked"}]});
    // Tenants and no sim_url: no /sim route for anyone, no provider `sim`, and the proxy with
    // no routes refuses instead of answering from a simulator.
    let dir = tempfile::tempdir().unwrap();
    let tenants = "[[tenants]]\nname = \"acme\"\ntoken = \"tok-acme\"\n";
    let gateway = Gateway::start_with(&dir, &sqlite(&dir), None, tenants).unwrap();
    for token in [None, Some("tok-acme")] {
        for (method, path) in [
            (reqwest::Method::GET, "/sim/requests"),
            (reqwest::Method::POST, "/sim/script"),
            (reqwest::Method::POST, "/sim/reset"),
        ] {
            let (status, _) = request(&gateway, method.clone(), path, token, script.clone());
            assert!(
                status == 404 || status == 401,
                "{method} {path} with {token:?}: {status}"
            );
        }
    }
    conversation_with_question_as(&gateway, "c-nosim", "tok-acme");
    let (status, body) = request(
        &gateway,
        reqwest::Method::POST,
        "/v1/conversations/c-nosim/dispatch",
        Some("tok-acme"),
        json!({"operation_id": "op-nosim", "target": {"provider": "sim", "model": "m", "adapter": "openai-chat@2"}}),
    );
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (422, json!("unknown_provider")),
        "{body}"
    );
    let (status, body) = request(
        &gateway,
        reqwest::Method::POST,
        "/v1/chat/completions",
        Some("tok-acme"),
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found", "{body}");
    drop(gateway);
    // A route to `sim` without a simulator is refused at start-up, with the reason.
    let dir = tempfile::tempdir().unwrap();
    let error = Gateway::start_with(
        &dir,
        &sqlite(&dir),
        None,
        &format!(
            "{tenants}[[routes]]\napi = \"openai-chat\"\nprovider = \"sim\"\nadapter = \"openai-chat@2\"\n"
        ),
    )
    .err()
    .expect("refused");
    assert!(error.contains("embedded default"), "{error}");
    // The embedded default (no tenants, no providers) keeps the simulator and its routes.
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(&dir, &sqlite(&dir), None, "").unwrap();
    let (status, _) = request(&gateway, reqwest::Method::POST, "/sim/script", None, script);
    assert_eq!(status, 200);
    let (status, requests) = request(&gateway, reqwest::Method::GET, "/sim/requests", None, Value::Null);
    assert_eq!((status, requests.is_array()), (200, true));
}

fn conversation_with_question_as(gateway: &Gateway, id: &str, token: &str) {
    let response = client()
        .post(format!("{}/v1/conversations", gateway.base))
        .bearer_auth(token)
        .json(&json!({"conversation_id": id}))
        .send()
        .unwrap();
    assert_eq!(response.status(), 201);
    let response = client()
        .post(format!("{}/v1/conversations/{id}/turns", gateway.base))
        .bearer_auth(token)
        .json(
            &json!({"expected_revision": 0, "turn": {"id": "t1", "role": "user",
               "blocks": [{"id": "u1", "kind": "text", "text": "Hello?"}]}}),
        )
        .send()
        .unwrap();
    assert_eq!(response.status(), 200);
}

#[test]
fn without_tenants_the_gateway_refuses_a_non_loopback_address() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["serve", "--listen", "0.0.0.0:0", "--store", &sqlite(&dir)])
        .output()
        .unwrap();
    // A configuration error: sysexits' EX_CONFIG (docs/operating.md, "Exit statuses of `turnstile serve`").
    assert_eq!(output.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&output.stderr).contains("loopback"));
}

#[test]
fn oversized_and_too_deep_bodies_get_413_and_422() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "body_bytes_max = 65536");
    conversation_with_question(&gateway, "c-limits");
    let big = "x".repeat(70_000);
    let response = client()
        .post(format!("{}/v1/conversations/c-limits/turns", gateway.base))
        .body(format!("{{\"expected_revision\":1,\"turn\":{{\"id\":\"t\",\"role\":\"user\",\"blocks\":[{{\"id\":\"b\",\"kind\":\"text\",\"text\":\"{big}\"}}]}}}}"))
        .send()
        .unwrap();
    assert_eq!(response.status(), 413);
    assert_eq!(
        response.json::<Value>().unwrap()["error"]["code"],
        "body_too_large"
    );
    let deep = format!(
        "{{\"expected_revision\":1,\"turn\":{}{}}}",
        "[".repeat(100),
        "]".repeat(100)
    );
    let response = client()
        .post(format!("{}/v1/conversations/c-limits/turns", gateway.base))
        .body(deep)
        .send()
        .unwrap();
    assert_eq!(response.status(), 422);
    assert_eq!(
        response.json::<Value>().unwrap()["error"]["code"],
        "limit_exceeded"
    );
    let blocks: Vec<Value> = (0..1_025)
        .map(|i| json!({"id": format!("b{i}"), "kind": "text", "text": "x"}))
        .collect();
    let (status, body) = gateway.post(
        "/v1/conversations/c-limits/turns",
        json!({"expected_revision": 1, "turn": {"id": "t", "role": "user", "blocks": blocks}}),
    );
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (422, json!("limit_exceeded"))
    );
    assert_eq!(
        gateway.get("/v1/conversations/c-limits")["revision"],
        1,
        "nothing committed was lost or added"
    );
}

#[test]
fn no_api_key_appears_in_any_log_response_or_metric() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(
        &dir,
        &sqlite(&dir),
        &sim,
        &format!(
            "[providers.upstream]\nbase_url = \"{}\"\napi_key_env = \"TURNSTILE_TEST_PROVIDER_KEY\"\n",
            sim.base
        ),
    );
    conversation_with_question(&gateway, "c-key");
    sim.script(
        "keyed",
        json!([{"text": "fine", "faults": {"cut_at_byte": 120}}, {"text": "fine"}]),
    );
    let body = json!({"operation_id": "op-key", "target": {"provider": "upstream", "model": "keyed", "adapter": "openai-responses@1"}});
    let answer = client()
        .post(format!("{}/v1/conversations/c-key/dispatch", gateway.base))
        .json(&body)
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(answer.contains("COMMITTED"), "{answer}");
    let mut everything = answer;
    for path in [
        "/v1/dispatches/op-key",
        "/v1/conversations/c-key",
        "/v1/quarantine",
        "/v1/tool-calls",
    ] {
        everything.push_str(
            &client()
                .get(format!("{}{path}", gateway.base))
                .send()
                .unwrap()
                .text()
                .unwrap(),
        );
    }
    everything.push_str(
        &client()
            .get(format!("{}/metrics", gateway.base))
            .send()
            .unwrap()
            .text()
            .unwrap(),
    );
    everything.push_str(&std::fs::read_to_string(&gateway.log).unwrap());
    everything.push_str(&sim.requests().iter().map(Value::to_string).collect::<String>());
    assert!(!everything.contains("SECRET-KEY"), "the provider key leaked");
}

#[test]
fn metrics_expose_every_required_name() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    let text = client()
        .get(format!("{}/metrics", gateway.base))
        .send()
        .unwrap()
        .text()
        .unwrap();
    for name in [
        "turnstile_validator_rejects_total{code=\"orphan_result\"}",
        "turnstile_tool_result_orphans_total",
        "turnstile_tool_result_duplicates_total",
        "turnstile_dispatch_unknown_age_seconds",
        "turnstile_handle_recoveries_total{outcome=",
        "turnstile_late_blocks_total",
        "turnstile_preview_retractions_total",
        "turnstile_canonical_cas_conflicts_total",
        "turnstile_partial_tool_dispatch_total",
        "turnstile_illegal_sends_total",
        "turnstile_dispatch_transitions_total{from=",
    ] {
        assert!(text.contains(name), "{name} missing");
    }
    let health: Value = client()
        .get(format!("{}/healthz", gateway.base))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(health["store"], "reachable");
}

#[test]
fn two_gateways_on_one_postgresql_commit_at_most_one_turn_per_revision() {
    let url = pg_url();
    let sim = SimProcess::start();
    let dir_a = tempfile::tempdir().unwrap();
    let dir_b = tempfile::tempdir().unwrap();
    let a = Gateway::start(&dir_a, &url, &sim, "replica_id = \"replica-a\"");
    let b = Gateway::start(&dir_b, &url, &sim, "replica_id = \"replica-b\"");
    let run = run_id();
    for round in 0..5 {
        let id = format!("c-race-{run}-{round}");
        conversation_with_question(&a, &id);
        let model = format!("race-{run}-{round}");
        sim.script(&model, json!([{"text": "reply one", "faults": {"delay_ms": 5}}, {"text": "reply two", "faults": {"delay_ms": 5}}]));
        let ((status_a, events_a), (status_b, events_b)) = std::thread::scope(|scope| {
            let first =
                scope.spawn(|| a.dispatch_raw(&id, &format!("op-a-{run}-{round}"), "openai-chat@1", &model));
            let second =
                scope.spawn(|| b.dispatch_raw(&id, &format!("op-b-{run}-{round}"), "openai-chat@1", &model));
            (first.join().unwrap(), second.join().unwrap())
        });
        // The loser either finds the revision moved before preparing (409), or loses the begin
        // or the canonical commit compare-and-set (its stream ends without `committed`).
        for (status, events) in [(status_a, &events_a), (status_b, &events_b)] {
            assert!(
                status == 200 || (status == 409 && events[0].1["error"]["code"] == "revision_conflict"),
                "{status} {events:?}"
            );
        }
        // The invariant: a revision gains at most one canonical turn, and a committed turn lands
        // exactly at its manifest's revision + 1. (A request that arrives after the first
        // commit is a legal new dispatch on the next revision, so both may commit, on
        // different base revisions.)
        let mut bases = std::collections::BTreeSet::new();
        for (gateway, operation, events) in [
            (&a, format!("op-a-{run}-{round}"), &events_a),
            (&b, format!("op-b-{run}-{round}"), &events_b),
        ] {
            for committed in named(events, "committed") {
                let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
                let base = dispatch["manifest"]["conversation_revision"].as_u64().unwrap();
                assert_eq!(committed["revision"].as_u64(), Some(base + 1), "round {round}");
                assert!(
                    bases.insert(base),
                    "round {round}: two canonical turns on revision {base}"
                );
            }
        }
        assert!(!bases.is_empty(), "round {round}: somebody commits");
        let document = history_is_legal(&a, &id);
        assert_eq!(
            document["revision"].as_u64(),
            Some(1 + bases.len() as u64),
            "round {round}"
        );
        assert_eq!(assistant_turns(&document), bases.len(), "round {round}");
        assert_eq!(
            document,
            history_is_legal(&b, &id),
            "both replicas read the same history"
        );
    }
    // The same operation id on both replicas at once: one dispatch, one send, and both clients
    // see the committed turn (the replica that loses the begin relays the winner's progress).
    for round in 0..3 {
        let id = format!("c-same-{run}-{round}");
        conversation_with_question(&a, &id);
        let model = format!("same-{run}-{round}");
        sim.script(
            &model,
            json!([{"text": "only once", "faults": {"delay_ms": 5}}, {"text": "never sent"}]),
        );
        let operation = format!("op-same-{run}-{round}");
        let (events_a, events_b) = std::thread::scope(|scope| {
            let first = scope.spawn(|| a.dispatch(&id, &operation, "openai-chat@1", &model));
            let second = scope.spawn(|| b.dispatch(&id, &operation, "openai-chat@1", &model));
            (first.join().unwrap(), second.join().unwrap())
        });
        for events in [&events_a, &events_b] {
            let committed = named(events, "committed");
            assert_eq!(committed.len(), 1, "round {round}: {events:?}");
            assert_eq!(committed[0]["revision"], 2);
            assert!(named(events, "error").is_empty(), "round {round}: {events:?}");
        }
        let sent = sim
            .requests()
            .iter()
            .filter(|r| r["body"].as_str().unwrap_or("").contains(&model))
            .count();
        assert_eq!(sent, 1, "round {round}: one operation id, one send");
        assert_eq!(assistant_turns(&history_is_legal(&a, &id)), 1);
    }
    assert_safety_metrics_zero(&a);
    assert_safety_metrics_zero(&b);
}

#[test]
fn a_provider_whose_key_variable_is_unset_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("turnstile.toml");
    std::fs::write(&config, "[providers.upstream]\nbase_url = \"http://127.0.0.1:9\"\napi_key_env = \"TURNSTILE_TEST_UNSET_KEY\"\n").unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store",
            &sqlite(&dir),
            "--config",
            config.to_str().unwrap(),
        ])
        .env_remove("TURNSTILE_TEST_UNSET_KEY")
        .output()
        .unwrap();
    // A configuration error: sysexits' EX_CONFIG (docs/operating.md, "Exit statuses of `turnstile serve`").
    assert_eq!(output.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&output.stderr).contains("TURNSTILE_TEST_UNSET_KEY"));
}

// Issue 15: recovery and liveness regressions on the real gateway process.

#[test]
fn an_invalid_tool_schema_is_refused_when_the_conversation_is_created() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    // `type` must be a string or an array of strings: the schema cannot compile.
    let (status, body) = gateway.post(
        "/v1/conversations",
        json!({"conversation_id": "c-bad-schema", "tools": [{"name": "t", "input_schema": {"type": 12}}]}),
    );
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (422, json!("invalid_tool_schema")),
        "{body}"
    );
    // Nothing was created: the id is still free.
    let (status, _) = gateway.post("/v1/conversations", json!({"conversation_id": "c-bad-schema"}));
    assert_eq!(status, 201);
}

#[test]
fn a_dispatch_with_a_stale_expected_revision_is_a_conflict_and_sends_nothing() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    conversation_with_question(&gateway, "c-guard");
    sim.script("m-guard", json!([{"text": "Hello."}]));
    let before = sim.requests().len();
    let (status, body) = gateway.post(
        "/v1/conversations/c-guard/dispatch",
        json!({"operation_id": "op-guard", "expected_revision": 0,
               "target": {"provider": "sim", "model": "m-guard", "adapter": "anthropic-messages@1"}}),
    );
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (409, json!("revision_conflict")),
        "{body}"
    );
    assert_eq!(body["error"]["current_revision"], 1, "{body}");
    assert_eq!(sim.requests().len(), before, "nothing was sent");
    assert!(
        gateway.get("/v1/dispatches/op-guard")["error"]["code"] == "not_found",
        "nothing was prepared"
    );
    // At the right revision the same request goes through and commits.
    let (status, body) = gateway.post(
        "/v1/conversations/c-guard/dispatch",
        json!({"operation_id": "op-guard", "expected_revision": 1,
               "target": {"provider": "sim", "model": "m-guard", "adapter": "anthropic-messages@1"}}),
    );
    assert_eq!(
        (status, body["state"].clone()),
        (200, json!("COMMITTED")),
        "{body}"
    );
}

#[test]
fn a_provider_that_never_answers_is_bounded_by_the_head_timeout_and_the_dispatch_ends() {
    let port = silent_provider();
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(
        &dir,
        &sqlite(&dir),
        &sim,
        &format!(
            "provider_connect_timeout_ms = 300\n[providers.silent]\nbase_url = \"http://127.0.0.1:{port}\"\n"
        ),
    );
    conversation_with_question(&gateway, "c-silent");
    let (status, body) = gateway.post(
        "/v1/conversations/c-silent/dispatch",
        json!({"operation_id": "op-silent",
               "target": {"provider": "silent", "model": "m", "adapter": "openai-chat@1"}}),
    );
    assert_eq!(status, 200, "{body}");
    // The non-streamed answer comes only when the dispatch ended: every attempt was closed at
    // its head timeout, waited for its lease, and the budget ended the dispatch.
    let dispatch = gateway.get("/v1/dispatches/op-silent");
    assert_eq!(dispatch["state"], "ABANDONED", "{dispatch}");
    let attempts = dispatch["attempts"].as_array().unwrap();
    assert!(
        !attempts.is_empty() && attempts.len() <= 4,
        "attempts within the budget: {dispatch}"
    );
    assert!(gateway.metric("turnstile_provider_timeouts_total") >= attempts.len() as f64);
    for attempt in attempts {
        assert_eq!(attempt["end_reason"], "head_timeout", "{dispatch}");
    }
    assert_eq!(gateway.get("/v1/conversations/c-silent")["revision"], 1);
    assert_safety_metrics_zero(&gateway);
}

/// Issue 15, defect 2: a replica whose clock runs 30 s ahead shares one SQLite file with a
/// punctual one. Leases are judged by the store's clock, so its sweep never takes over the
/// punctual replica's healthy stream (which outlives several leases): one attempt, one send,
/// one commit, no retract.
#[test]
fn a_replica_whose_clock_runs_ahead_never_takes_over_a_healthy_stream() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let skewed_dir = tempfile::tempdir().unwrap();
    let store = sqlite(&dir);
    let gateway = Gateway::start(&dir, &store, &sim, "");
    let skewed = Gateway::start(&skewed_dir, &store, &sim, "test_clock_offset_ms = 30000");
    conversation_with_question(&gateway, "c-skew");
    // About 2 s of stream against a 400 ms lease: the skewed replica sweeps ~10 times meanwhile.
    let text = "word ".repeat(20);
    sim.script("m-skew", json!([{"text": text, "faults": {"delay_ms": 100}}]));
    let events = gateway.dispatch("c-skew", "op-skew", "anthropic-messages@1", "m-skew");
    assert_eq!(named(&events, "committed").len(), 1, "{events:?}");
    assert!(named(&events, "retract").is_empty(), "{events:?}");
    let dispatch = skewed.get("/v1/dispatches/op-skew");
    assert_eq!(dispatch["state"], "COMMITTED", "{dispatch}");
    assert_eq!(dispatch["attempts"].as_array().unwrap().len(), 1, "{dispatch}");
    let sent = sim
        .requests()
        .iter()
        .filter(|request| request.to_string().contains("m-skew"))
        .count();
    assert_eq!(sent, 1, "one provider request");
    assert_eq!(
        skewed.metric(r#"turnstile_handle_recoveries_total{outcome="new_generation"}"#),
        0.0
    );
}

/// The render policy the manifest pins is shown with the dispatch and hashes to its
/// `policy_digest`: every setting that reached the provider is visible, not only its digest.
#[test]
fn the_dispatch_view_shows_the_render_policy_that_hashes_to_the_manifests_policy_digest() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    conversation_with_question(&gateway, "c-policy");
    sim.script("m-policy", json!([{"text": "fine"}]));
    let (status, body) = gateway.post(
        "/v1/conversations/c-policy/dispatch",
        json!({"operation_id": "op-policy", "sampling": {"temperature": 0.25, "seed": 1234567890123456789_i64},
               "tool_choice": {"type": "required"},
               "target": {"provider": "sim", "model": "m-policy", "adapter": "openai-chat@1"}}),
    );
    assert_eq!(status, 200, "{body}");
    let dispatch = gateway.get("/v1/dispatches/op-policy");
    let policy = &dispatch["policy"];
    assert!(policy.is_object(), "{dispatch}");
    assert_eq!(
        turnstile_core::Digest::of_canonical(policy).as_str(),
        dispatch["manifest"]["policy_digest"].as_str().unwrap(),
        "{dispatch}"
    );
    let text = policy.to_string();
    assert!(
        text.contains("0.25") && text.contains("1234567890123456789"),
        "{policy}"
    );
    assert!(text.contains("required"), "{policy}");
}

/// Issue 21: a dispatch that commits costs two durable writes, the prepare that is also the
/// acceptance point and the canonical commit (which carries SENT, STREAMING, the handle and
/// the tool calls); the attempt's history still names every state it went through. On the
/// embedded SQLite and on PostgreSQL.
#[test]
fn a_committed_dispatch_costs_two_durable_writes_and_keeps_every_transition() {
    let url = pg_url();
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let pg_dir = tempfile::tempdir().unwrap();
    let run = run_id();
    for (store, gateway) in [
        ("sqlite", Gateway::start(&dir, &sqlite(&dir), &sim, "")),
        ("postgres", Gateway::start(&pg_dir, &url, &sim, "")),
    ] {
        for adapter in [
            "openai-chat@1",
            "openai-responses@1",
            "anthropic-messages@1",
            "gemini@1",
        ] {
            let id = format!("c-writes-{run}-{store}-{}", adapter.replace('@', "-"));
            let model = format!("m-{id}");
            conversation_with_question(&gateway, &id);
            sim.script(&model, json!([two_calls(json!({}))]));
            let before = gateway.metric("turnstile_store_write_ops_total");
            let events = gateway.dispatch(&id, &format!("op-{id}"), adapter, &model);
            assert_eq!(
                named(&events, "committed").len(),
                1,
                "{store} {adapter}: {events:?}"
            );
            let writes = gateway.metric("turnstile_store_write_ops_total") - before;
            // The simulator's Responses endpoint resumes by handle (background mode): there the
            // handle is bound as soon as seen, a third write, because recovery resumes by it.
            let expected = if adapter == "openai-responses@1" { 3.0 } else { 2.0 };
            assert_eq!(
                writes, expected,
                "{store} {adapter}: durable writes for one committed dispatch"
            );
            let dispatch = gateway.get(&format!("/v1/dispatches/op-{id}"));
            let attempts = dispatch["attempts"].as_array().unwrap();
            assert_eq!(attempts.len(), 1, "{dispatch}");
            let states: Vec<&str> = attempts[0]["history"]
                .as_array()
                .unwrap()
                .iter()
                .map(|entry| entry["state"].as_str().unwrap())
                .collect();
            assert_eq!(
                states,
                ["DISPATCHING", "SENT", "STREAMING", "COMMITTED"],
                "{store} {adapter}: {dispatch}"
            );
            if adapter != "gemini@1" {
                assert!(
                    attempts[0]["handle"].is_string(),
                    "{store} {adapter}: the commit binds the handle: {dispatch}"
                );
            }
            let ready = gateway.get("/v1/tool-calls?state=ready");
            let mine = ready["tool_calls"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|call| call["conversation_id"] == id.as_str())
                .count();
            assert_eq!(mine, 2, "{store} {adapter}: the commit's tool-call rows");
        }
        assert_safety_metrics_zero(&gateway);
    }
}

/// A successful result for each ready tool call of conversation `id` (two here: the
/// simulator's `two_calls`), as tool-turn blocks.
fn results_of_ready_calls(gateway: &Gateway, id: &str) -> Vec<Value> {
    let ready = gateway.get("/v1/tool-calls?state=ready")["tool_calls"]
        .as_array()
        .unwrap()
        .clone();
    let results: Vec<Value> = ready
        .iter()
        .filter(|call| call["conversation_id"] == id)
        .enumerate()
        .map(|(i, call)| {
            json!({"id": format!("r{i}"), "kind": "tool_result", "call_id": call["call_id"], "tool": call["tool"],
                   "args_digest": call["args_digest"], "generation": call["generation"], "status": "success",
                   "content": [{"kind": "text", "text": format!("{i}C")}]})
        })
        .collect();
    assert_eq!(results.len(), 2, "{id}: {ready:?}");
    results
}

/// Issue 21: a dispatch with a new operation id asks the store nothing before its prepare but
/// its conversation (the prepare answers whether the operation exists), so it costs one read
/// and two durable writes; an agent loop's next dispatch, one read of the turns since. A client
/// asking again with the same operation id still gets that dispatch, though the conversation
/// moved on and now waits for tool results (the render answers "waiting", and only then is the
/// operation looked up), and the same id on another conversation is still a conflict. SQLite
/// and PostgreSQL. (A long lease keeps the lease sweep, a read, out of the counts.)
#[test]
fn a_new_dispatch_reads_only_its_conversation_and_a_repeated_operation_id_still_attaches() {
    let url = pg_url();
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let pg_dir = tempfile::tempdir().unwrap();
    let run = run_id();
    let adapter = "anthropic-messages@1";
    for (store, gateway) in [
        (
            "sqlite",
            Gateway::start(&dir, &sqlite(&dir), &sim, "lease_ms = 600000"),
        ),
        (
            "postgres",
            Gateway::start(&pg_dir, &url, &sim, "lease_ms = 600000"),
        ),
    ] {
        let reads = || gateway.metric("turnstile_store_read_ops_total");
        let writes = || gateway.metric("turnstile_store_write_ops_total");
        // What a scrape itself reads (the oldest stuck attempt), between two scrapes: each
        // count below is taken right before and right after what it counts.
        let first = reads();
        let scrape = reads() - first;
        let id = format!("c-reads-{run}-{store}");
        let other = format!("c-reads-other-{run}-{store}");
        let model = format!("m-{id}");
        conversation_with_question(&gateway, &id);
        conversation_with_question(&gateway, &other);

        // A new operation id, the conversation not kept yet: its whole document, read once.
        sim.script(&model, json!([two_calls(json!({}))]));
        let (writes_before, reads_before) = (writes(), reads());
        let events = gateway.dispatch(&id, &format!("op-{id}-1"), adapter, &model);
        assert_eq!(named(&events, "committed").len(), 1, "{store}: {events:?}");
        assert_eq!(
            reads() - reads_before - scrape,
            1.0,
            "{store}: reads of a new dispatch"
        );
        assert_eq!(
            writes() - writes_before,
            2.0,
            "{store}: durable writes of a new dispatch"
        );
        let sent = sim.requests().len();

        // Asked again: the conversation now waits for the two results, yet the client gets the
        // committed dispatch, and nothing is sent or written.
        let writes_before = writes();
        let again = gateway.dispatch(&id, &format!("op-{id}-1"), adapter, &model);
        assert_eq!(named(&again, "committed").len(), 1, "{store}: {again:?}");
        assert_eq!(named(&again, "committed")[0]["revision"], 2, "{store}");
        assert!(named(&again, "waiting").is_empty(), "{store}: {again:?}");
        let (status, body) = gateway.post(
            &format!("/v1/conversations/{id}/dispatch"),
            json!({"operation_id": format!("op-{id}-1"), "stream": false,
                   "target": {"provider": "sim", "model": model, "adapter": adapter}}),
        );
        assert_eq!(
            (status, &body["state"]),
            (200, &json!("COMMITTED")),
            "{store}: {body}"
        );
        // The same id on another conversation.
        let (status, body) = gateway.post(
            &format!("/v1/conversations/{other}/dispatch"),
            json!({"operation_id": format!("op-{id}-1"), "stream": false,
                   "target": {"provider": "sim", "model": model, "adapter": adapter}}),
        );
        assert_eq!(
            (status, &body["error"]["code"]),
            (409, &json!("operation_conflict")),
            "{store}: {body}"
        );
        assert_eq!(
            sim.requests().len(),
            sent,
            "{store}: a repeated operation id sends nothing"
        );
        assert_eq!(
            writes(),
            writes_before,
            "{store}: a repeated operation id writes nothing"
        );

        // The results, then the agent loop's next dispatch: the kept history plus the one new
        // turn, read once.
        let (status, body) = gateway.post(
            &format!("/v1/conversations/{id}/turns"),
            json!({"expected_revision": 2, "turn": {"id": "t-results", "role": "tool",
                   "blocks": results_of_ready_calls(&gateway, &id)}}),
        );
        assert_eq!(status, 200, "{store}: {body}");
        sim.script(&model, json!([{"text": "Sunny in Paris, rain in Tokyo."}]));
        let (writes_before, reads_before) = (writes(), reads());
        let events = gateway.dispatch(&id, &format!("op-{id}-2"), adapter, &model);
        assert_eq!(
            named(&events, "committed")[0]["revision"],
            4,
            "{store}: {events:?}"
        );
        assert_eq!(
            reads() - reads_before - scrape,
            1.0,
            "{store}: reads of an agent loop's dispatch"
        );
        assert_eq!(writes() - writes_before, 2.0, "{store}");
        assert_safety_metrics_zero(&gateway);
    }
}

/// Issue 21: a gateway keeps a stored conversation decoded between dispatches, so an agent
/// loop's next dispatch reads and checks only the turns committed since its last one
/// (`turnstile_conversation_reads_total`): the first dispatch reads the whole history, the
/// next ones the kept history plus what was appended since, here by another replica too, and
/// their renders go on from the render state kept after the last one
/// (`turnstile_renders_total`). The body a warm replica sends is the one a fresh replica
/// (whole history, whole render) sends for the same revision, and every body sent hashes to
/// its manifest's request digest. SQLite and PostgreSQL.
#[test]
fn an_agent_loop_reads_only_the_new_turns_and_sends_what_a_fresh_replica_sends() {
    let url = pg_url();
    let sim = SimProcess::start();
    let run = run_id();
    let adapter = "anthropic-messages@1";
    for store in ["sqlite", "postgres"] {
        let dirs = [(); 3].map(|_| tempfile::tempdir().unwrap());
        let store_url = if store == "sqlite" {
            sqlite(&dirs[0])
        } else {
            url.clone()
        };
        let warm = Gateway::start(&dirs[0], &store_url, &sim, "");
        let other = Gateway::start(&dirs[1], &store_url, &sim, "");
        let reads = |gateway: &Gateway, history: &str| {
            gateway.metric(&format!(
                "turnstile_conversation_reads_total{{history=\"{history}\"}}"
            ))
        };
        let id = format!("c-kept-{run}-{store}");
        let model = format!("m-{id}");
        let op = |round: &str| format!("op-{id}-{round}");
        let renders = |gateway: &Gateway, from: &str| {
            gateway.metric(&format!("turnstile_renders_total{{from=\"{from}\"}}"))
        };
        conversation_with_question(&warm, &id);
        let (kept_before, whole_before) = (reads(&warm, "kept"), reads(&warm, "whole"));
        let (resumed_before, rendered_whole_before) = (renders(&warm, "resumed"), renders(&warm, "whole"));

        // Round 1 (revision 1 → 2): two calls.
        sim.script(&model, json!([two_calls(json!({}))]));
        let events = warm.dispatch(&id, &op("1"), adapter, &model);
        assert_eq!(named(&events, "committed").len(), 1, "{store}: {events:?}");
        // The results, appended through the other replica (revision 3).
        let (status, body) = other.post(
            &format!("/v1/conversations/{id}/turns"),
            json!({"expected_revision": 2, "turn": {"id": "t-results", "role": "tool",
                   "blocks": results_of_ready_calls(&warm, &id)}}),
        );
        assert_eq!(status, 200, "{store}: {body}");

        // Round 2 (3 → 4) on the warm replica: the kept history plus the other's tool turn.
        sim.script(&model, json!([{"text": "Sunny in Paris, rain in Tokyo."}]));
        let events = warm.dispatch(&id, &op("2"), adapter, &model);
        assert_eq!(named(&events, "committed").len(), 1, "{store}: {events:?}");
        let (status, body) = warm.post(
            &format!("/v1/conversations/{id}/turns"),
            json!({"expected_revision": 4, "turn": {"id": "t3", "role": "user",
                   "blocks": [{"id": "u3", "kind": "text", "text": "And tomorrow?"}]}}),
        );
        assert_eq!((status, body), (200, json!({"revision": 5})), "{store}");

        // Round 3 at revision 5: the warm replica's attempt is refused by the provider (nothing
        // commits), then a replica that never saw the conversation dispatches the same revision.
        sim.script(&model, json!([{"text": "never", "faults": {"status": 400}}]));
        let (status, events) = warm.dispatch_raw(&id, &op("3-warm"), adapter, &model);
        assert_eq!(status, 200, "{store}: {events:?}");
        let fresh = Gateway::start(&dirs[2], &store_url, &sim, "");
        sim.script(&model, json!([{"text": "Rain everywhere."}]));
        let events = fresh.dispatch(&id, &op("3-fresh"), adapter, &model);
        assert_eq!(named(&events, "committed").len(), 1, "{store}: {events:?}");

        assert_eq!(
            (
                reads(&warm, "whole") - whole_before,
                reads(&warm, "kept") - kept_before
            ),
            (1.0, 2.0),
            "{store}: the warm replica read the whole history once, then only what was new"
        );
        assert_eq!(
            (reads(&fresh, "whole"), reads(&fresh, "kept")),
            (1.0, 0.0),
            "{store}"
        );
        assert_eq!(
            (
                renders(&warm, "whole") - rendered_whole_before,
                renders(&warm, "resumed") - resumed_before
            ),
            // Round 1's conversation is one segment (the question): a render keeps its state
            // at the start of its last segment, and there is nothing before this one to keep.
            // Round 2 renders whole and keeps the state at the start of its last segment (the
            // calls and their results); round 3 goes on from there.
            (2.0, 1.0),
            "{store}: the warm replica rendered whole until it had a state to go on from, then went on from it"
        );
        assert_eq!(
            (renders(&fresh, "whole"), renders(&fresh, "resumed")),
            (1.0, 0.0),
            "{store}"
        );
        let manifest = |gateway: &Gateway, operation: &str| {
            let manifest = gateway.get(&format!("/v1/dispatches/{operation}"))["manifest"].clone();
            (
                manifest["conversation_revision"].clone(),
                manifest["sequence_digest"].clone(),
                manifest["request_digest"].clone(),
                manifest["prompt_tokens"].clone(),
            )
        };
        let warm_manifest = manifest(&warm, &op("3-warm"));
        assert_eq!(warm_manifest.0, json!(5), "{store}");
        assert_eq!(
            warm_manifest,
            manifest(&fresh, &op("3-fresh")),
            "{store}: the kept history renders what the whole one does"
        );
        for round in ["1", "2", "3-warm"] {
            assert!(
                assert_sent_bodies_match_manifest(&warm, &sim, &op(round)) >= 1,
                "{store}: the body sent in round {round} hashes to its manifest's digest"
            );
        }
    }
}

/// The `turnstile` binary's SQLite syncs with `fdatasync(2)`, never `fsync(2)`
/// (`-DHAVE_FDATASYNC=1` in `.cargo/config.toml`'s `LIBSQLITE3_FLAGS`;
/// docs/decisions/0115-sqlite-syncs-with-fdatasync.md, "SQLite syncs with fdatasync"). Without the
/// option the amalgamation defines `fdatasync` as `fsync`, and every sync of the WAL and the
/// database file is an `fsync`: the binary then imports `fsync` and not `fdatasync`. Nothing else
/// in the binary syncs a file, so its imports say which call the ledger makes. glibc Linux only: a
/// static (musl) build has no dynamic imports to read, and on macOS SQLite calls `fsync` whatever
/// the option says.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn the_turnstile_binary_syncs_with_fdatasync() {
    use object::{Object as _, ObjectSymbol as _};
    let bytes = std::fs::read(env!("CARGO_BIN_EXE_turnstile")).unwrap();
    let binary = object::File::parse(&*bytes).unwrap();
    let imported: Vec<&str> = binary
        .dynamic_symbols()
        .filter(|symbol| symbol.is_undefined())
        .filter_map(|symbol| symbol.name().ok())
        .collect();
    assert!(
        imported.contains(&"fdatasync"),
        "the binary does not import fdatasync: is -DHAVE_FDATASYNC=1 missing from LIBSQLITE3_FLAGS?"
    );
    assert!(
        !imported.contains(&"fsync"),
        "the binary imports fsync: SQLite built without HAVE_FDATASYNC, or another caller of File::sync_all"
    );
}
