//! Issue 49 item 6: SIGTERM drains. Real processes (the gateway and `turnstile sim`), real
//! SQLite files, streams paced by the simulator. A gateway that gets SIGTERM refuses new
//! requests, lets its live streams finish and commit, and exits 0; what outlives
//! `drain_timeout_ms` is handed to recovery with `error shutting_down` to each client, and a
//! restart recovers it at once. The provider's request log proves that nothing that finished
//! was sent twice. Every wait is a bounded poll on an observable state.

use crate::recovery::wait_for;
use crate::serve::{
    Gateway, assistant_turns, client, client_events, conversation_with_question, history_is_legal, sqlite,
};
use crate::sim::SimProcess;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read};
use std::sync::mpsc;
use std::time::Duration;

const ADAPTER: &str = "anthropic-messages@1";

fn requests_for(sim: &SimProcess, model: &str) -> usize {
    let quoted = format!("\"{model}\"");
    sim.requests()
        .iter()
        .filter(|request| {
            request["body"]
                .as_str()
                .is_some_and(|body| body.contains(&quoted))
        })
        .count()
}

/// Start a streamed dispatch on a thread; `previewed` hears once its first preview arrived.
/// The thread reads the stream to its end and answers every event.
fn stream_on_thread(
    base: &str,
    conversation: &str,
    operation: &str,
    model: &str,
    previewed: mpsc::Sender<String>,
) -> std::thread::JoinHandle<Vec<(String, Value)>> {
    let url = format!("{base}/v1/conversations/{conversation}/dispatch");
    let body = json!({"operation_id": operation, "stream": true, "max_output_tokens": 512,
                      "target": {"provider": "sim", "model": model, "adapter": ADAPTER}});
    let operation = operation.to_owned();
    std::thread::spawn(move || {
        let response = client().post(url).json(&body).send().unwrap();
        assert_eq!(response.status().as_u16(), 200);
        let mut reader = BufReader::new(response);
        let mut text = String::new();
        let mut told = false;
        loop {
            let mut line = String::new();
            // A cut connection reads as an error or EOF: both end the stream here; the
            // events read so far say whether it ended properly.
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if !told && line.starts_with("event: preview") {
                told = true;
                let _ = previewed.send(operation.clone());
            }
            text.push_str(&line);
        }
        let mut rest = String::new();
        let _ = reader.read_to_string(&mut rest);
        text.push_str(&rest);
        client_events(&text)
    })
}

fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(name, _)| name.as_str()).collect()
}

/// A new request during the drain: 503 `shutting_down` (polled until the signal took
/// effect); `/healthz` is still answered.
fn refused_while_draining(gateway: &Gateway) {
    wait_for(
        Duration::from_secs(5),
        "a request refused as shutting_down",
        || {
            let (status, body) = gateway.post("/v1/conversations", json!({}));
            (status == 503).then(|| assert_eq!(body["error"]["code"], "shutting_down", "{body}"))
        },
    );
    let health = client().get(format!("{}/healthz", gateway.base)).send().unwrap();
    assert_eq!(health.status().as_u16(), 200);
}

/// The figures, fixed: six streams live at SIGTERM all finish and commit, the process
/// exits 0 (well before the drain bound), the provider saw each request once, and a restart
/// sends nothing again. With the old shutdown the streams were cut after 5 s without an
/// event and the restart sent each of them again.
#[test]
fn sigterm_lets_live_streams_finish_and_the_provider_sees_each_request_once() {
    const STREAMS: usize = 6;
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite(&dir);
    let mut gateway = Gateway::start(&dir, &store, &sim, "drain_timeout_ms = 60000");
    // About 7 s of stream each, at 100 ms per event: longer than the old fixed 5 s.
    let text = "word ".repeat(70);
    let (previewed, previews) = mpsc::channel();
    let mut streams = Vec::new();
    for index in 0..STREAMS {
        let conversation = format!("c-drain-{index}");
        conversation_with_question(&gateway, &conversation);
        let model = format!("m-drain-{index}");
        sim.script(&model, json!([{"text": text, "faults": {"delay_ms": 100}}]));
        streams.push(stream_on_thread(
            &gateway.base,
            &conversation,
            &format!("op-drain-{index}"),
            &model,
            previewed.clone(),
        ));
    }
    for _ in 0..STREAMS {
        previews
            .recv_timeout(Duration::from_secs(30))
            .expect("every stream previews");
    }
    gateway.terminate();
    refused_while_draining(&gateway);
    let status = gateway
        .wait_exit(Duration::from_secs(60))
        .expect("the gateway exits within its drain timeout");
    assert!(status.success(), "exit status {status:?}\n{}", gateway.log_text());
    for (index, stream) in streams.into_iter().enumerate() {
        let events = stream.join().unwrap();
        assert_eq!(
            events.last().map(|(name, _)| name.as_str()),
            Some("committed"),
            "stream {index} ended with its commit: {:?}",
            names(&events)
        );
        assert!(
            !events
                .iter()
                .any(|(name, _)| name == "error" || name == "retract"),
            "stream {index}: {:?}",
            names(&events)
        );
    }
    for index in 0..STREAMS {
        assert_eq!(
            requests_for(&sim, &format!("m-drain-{index}")),
            1,
            "m-drain-{index}"
        );
    }
    // A restart finds nothing to recover: one more dispatch commits, and the provider has
    // seen exactly one more request.
    let dir_b = tempfile::tempdir().unwrap();
    let restarted = Gateway::start(&dir_b, &store, &sim, "");
    conversation_with_question(&restarted, "c-after");
    let events = restarted.dispatch("c-after", "op-after", ADAPTER, "m-after");
    assert_eq!(events.last().unwrap().0, "committed", "{events:?}");
    let sent = sim.requests().len();
    assert_eq!(sent, STREAMS + 1, "nothing was sent twice");
    for index in 0..STREAMS {
        let dispatch = restarted.get(&format!("/v1/dispatches/op-drain-{index}"));
        assert_eq!(dispatch["state"], "COMMITTED", "{dispatch}");
        assert_eq!(dispatch["attempts"].as_array().unwrap().len(), 1, "{dispatch}");
        assert_eq!(
            assistant_turns(&history_is_legal(&restarted, &format!("c-drain-{index}"))),
            1
        );
    }
}

/// Streams that outlast the drain timeout are handed over: their clients get `retract` and
/// `error shutting_down` (never a bare cut), their attempts are released in the store
/// (`end_reason = shutting_down`), and a restart recovers them at once rather than after
/// the old lease; the streams that finished during the drain are never sent again.
#[test]
fn streams_that_outlast_the_drain_are_handed_to_recovery_with_a_typed_event() {
    // A lease far longer than the test: a restart that waited for it would not finish here.
    const LEASE_MS: u64 = 120_000;
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite(&dir);
    let config = format!("lease_ms = {LEASE_MS}\ndrain_timeout_ms = 3000");
    let mut gateway = Gateway::start(&dir, &store, &sim, &config);
    let short = "word ".repeat(5);
    let long = "word ".repeat(300);
    let (previewed, previews) = mpsc::channel();
    let mut streams = Vec::new();
    for (index, kind) in ["short", "short", "long", "long"].into_iter().enumerate() {
        let conversation = format!("c-{kind}-{index}");
        conversation_with_question(&gateway, &conversation);
        let model = format!("m-{kind}-{index}");
        let text = if kind == "short" { &short } else { &long };
        // The long ones' second reply answers the recovered dispatch after the restart.
        sim.script(
            &model,
            json!([{"text": text, "faults": {"delay_ms": 100}}, {"text": "recovered"}]),
        );
        streams.push((
            kind,
            index,
            stream_on_thread(
                &gateway.base,
                &conversation,
                &format!("op-{kind}-{index}"),
                &model,
                previewed.clone(),
            ),
        ));
    }
    for _ in 0..streams.len() {
        previews
            .recv_timeout(Duration::from_secs(30))
            .expect("every stream previews");
    }
    gateway.terminate();
    refused_while_draining(&gateway);
    let status = gateway
        .wait_exit(Duration::from_secs(30))
        .expect("the gateway exits after its drain timeout and the hand-over");
    assert!(status.success(), "exit status {status:?}\n{}", gateway.log_text());
    for (kind, index, stream) in streams {
        let events = stream.join().unwrap();
        let last = events.last().expect("events");
        if kind == "short" {
            assert_eq!(last.0, "committed", "{kind}-{index}: {:?}", names(&events));
        } else {
            assert_eq!(last.0, "error", "{kind}-{index}: {:?}", names(&events));
            assert_eq!(last.1["code"], "shutting_down", "{last:?}");
            assert!(
                events
                    .iter()
                    .any(|(name, data)| name == "retract" && data["reason"] == "shutting_down"),
                "{kind}-{index}: the preview is void: {:?}",
                names(&events)
            );
            assert!(!events.iter().any(|(name, _)| name == "committed"));
        }
    }
    let sent_before_restart = sim.requests().len();
    assert_eq!(sent_before_restart, 4, "one request per dispatch");

    let dir_b = tempfile::tempdir().unwrap();
    let restarted = Gateway::start(&dir_b, &store, &sim, &format!("lease_ms = {LEASE_MS}"));
    for index in [2, 3] {
        let operation = format!("op-long-{index}");
        let dispatch = wait_for(Duration::from_secs(30), &format!("{operation} to commit"), || {
            let dispatch = restarted.get(&format!("/v1/dispatches/{operation}"));
            (dispatch["state"] == "COMMITTED").then_some(dispatch)
        });
        let attempts = dispatch["attempts"].as_array().unwrap();
        assert_eq!(attempts.len(), 2, "{dispatch}");
        assert_eq!(attempts[0]["end_reason"], "shutting_down", "{dispatch}");
        let began = |attempt: &Value| {
            attempt["history"]
                .as_array()
                .unwrap()
                .iter()
                .find(|entry| entry["state"] == "DISPATCHING")
                .and_then(|entry| entry["at"].as_u64())
                .unwrap()
        };
        // By the store's clock: generation 2 did not wait out generation 1's lease.
        assert!(began(&attempts[1]) < began(&attempts[0]) + LEASE_MS, "{dispatch}");
        let document = history_is_legal(&restarted, &format!("c-long-{index}"));
        assert_eq!(assistant_turns(&document), 1);
        assert!(document.to_string().contains("recovered"), "{document}");
        assert_eq!(requests_for(&sim, &format!("m-long-{index}")), 2);
    }
    for index in [0, 1] {
        let dispatch = restarted.get(&format!("/v1/dispatches/op-short-{index}"));
        assert_eq!(dispatch["state"], "COMMITTED", "{dispatch}");
        assert_eq!(dispatch["attempts"].as_array().unwrap().len(), 1, "{dispatch}");
        assert_eq!(
            requests_for(&sim, &format!("m-short-{index}")),
            1,
            "finished: never sent again"
        );
    }
}
