//! Issue 15's recovery defects, each on real processes: gateways sharing one SQLite file (and
//! the simulator as the provider), killed with SIGKILL where a replica dies. Every wait is a
//! bounded poll on an observable state (the dispatch view, the simulator's request log).

use crate::serve::{
    Gateway, assert_safety_metrics_zero, assistant_turns, client, conversation_with_question,
    history_is_legal, sqlite,
};
use crate::sim::SimProcess;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::time::{Duration, Instant};

/// Poll `probe` every 50 ms until it answers `Some`, for at most `limit` (every integration
/// test's bounded wait on an observable state).
pub fn wait_for<T>(limit: Duration, what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(found) = probe() {
            return found;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn terminal(gateway: &Gateway, operation: &str) -> Value {
    wait_for(Duration::from_secs(60), &format!("{operation} to end"), || {
        let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
        let state = dispatch["state"].as_str().unwrap_or("").to_owned();
        ["COMMITTED", "FAILED", "ABANDONED"]
            .contains(&state.as_str())
            .then_some(dispatch)
    })
}

fn requests_for(sim: &SimProcess, model: &str) -> Vec<Value> {
    sim.requests()
        .into_iter()
        .filter(|request| request["body"].as_str().is_some_and(|body| body.contains(model)))
        .collect()
}

fn resumes(sim: &SimProcess) -> usize {
    paths(sim)
        .iter()
        .filter(|path| path.starts_with("/v1/responses/") && path.contains("stream=true"))
        .count()
}

fn paths(sim: &SimProcess) -> Vec<String> {
    sim.requests()
        .iter()
        .filter_map(|request| request["path"].as_str().map(str::to_owned))
        .collect()
}

/// Start a streamed dispatch and return once the first preview arrived (the reader keeps the
/// client's connection open).
pub fn dispatch_until_preview(
    gateway: &Gateway,
    conversation: &str,
    body: Value,
) -> BufReader<reqwest::blocking::Response> {
    let response = client()
        .post(format!(
            "{}/v1/conversations/{conversation}/dispatch",
            gateway.base
        ))
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let mut reader = BufReader::new(response);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "stream ended before a preview"
        );
        if line.contains("event: preview") {
            return reader;
        }
    }
}

/// Defect 1: a resumed attempt taken over by another replica finishes. Replica A streams a
/// background Responses reply and is killed; replica B's sweep finds the lease expired (by
/// the store's clock), resumes by handle *as itself* (the lease moves to B in the same write),
/// renews it while the rest streams for longer than a lease, and commits generation 1.
#[test]
fn a_resume_taken_over_by_another_replica_renews_its_own_lease_and_commits() {
    let sim = SimProcess::start();
    let dir_a = tempfile::tempdir().unwrap();
    let dir_b = tempfile::tempdir().unwrap();
    let store = sqlite(&dir_a);
    let mut a = Gateway::start(&dir_a, &store, &sim, "");
    let b = Gateway::start(&dir_b, &store, &sim, "");
    conversation_with_question(&a, "c-takeover");
    // About 3 s of stream at 100 ms per event against a 400 ms lease.
    let text = "word ".repeat(30);
    sim.script("m-takeover", json!([{"text": text, "faults": {"delay_ms": 100}}]));
    let body = json!({"operation_id": "op-takeover", "stream": true,
                      "target": {"provider": "sim", "model": "m-takeover", "adapter": "openai-responses@1"}});
    let reader = dispatch_until_preview(&a, "c-takeover", body);
    a.kill();
    drop(reader);
    let dispatch = terminal(&b, "op-takeover");
    assert_eq!(dispatch["state"], "COMMITTED", "{dispatch}");
    let attempts = dispatch["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1, "the same generation, resumed: {dispatch}");
    assert!(attempts[0]["resumes"].as_u64().unwrap() >= 1, "{dispatch}");
    assert_eq!(attempts[0]["end_reason"], "committed", "{dispatch}");
    assert_eq!(
        requests_for(&sim, "m-takeover").len(),
        1,
        "one billed request; the rest came by resume"
    );
    let resumed = resumes(&sim);
    assert!(
        (1..=3).contains(&resumed),
        "resumed within the per-generation cap, not again and again: {resumed}"
    );
    let document = history_is_legal(&b, "c-takeover");
    assert_eq!(assistant_turns(&document), 1);
    assert!(document.to_string().contains(text.trim_end()), "{document}");
    assert_eq!(b.metric("turnstile_dispatch_unknown_age_seconds"), 0.0);
    assert_safety_metrics_zero(&b);
}

/// Defect 3: a refused resume is not proof that the attempt ended. The provider refuses to
/// resume (not a background response), so generation 2 waits until generation 1's lease ran
/// out by the store's clock; the attempt records both facts.
#[test]
fn a_refused_resume_waits_for_the_old_lease_before_a_new_generation() {
    const LEASE_MS: u64 = 1_500;
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, &format!("lease_ms = {LEASE_MS}"));
    conversation_with_question(&gateway, "c-refused");
    sim.script(
        "m-refused",
        json!([{"text": "cut early and not resumable", "faults": {"disconnect_after_events": 3, "resumable": false}},
               {"text": "the second generation"}]),
    );
    let events = gateway.dispatch("c-refused", "op-refused", "openai-responses@1", "m-refused");
    let dispatch = gateway.get("/v1/dispatches/op-refused");
    assert_eq!(dispatch["state"], "COMMITTED", "{dispatch} {events:?}");
    let attempts = dispatch["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{dispatch}");
    assert_eq!(resumes(&sim), 1, "one resume was tried and refused");
    assert_eq!(attempts[0]["end_reason"], "resume_refused", "{dispatch}");
    assert_eq!(attempts[0]["confirmed_over"], "lease_expired", "{dispatch}");
    let at = |attempt: &Value, state: &str| {
        attempt["history"]
            .as_array()
            .unwrap()
            .iter()
            .find(|entry| entry["state"] == state)
            .and_then(|entry| entry["at"].as_u64())
            .unwrap_or_else(|| panic!("no {state} in {attempt}"))
    };
    let began_1 = at(&attempts[0], "DISPATCHING");
    let began_2 = at(&attempts[1], "DISPATCHING");
    // The lease was written at the begin and only ever extended: generation 2 can begin no
    // earlier than a whole lease after generation 1 did.
    assert!(
        began_2 >= began_1 + LEASE_MS,
        "generation 2 began {} ms after generation 1, inside its {LEASE_MS} ms lease",
        began_2 - began_1
    );
    assert_eq!(assistant_turns(&history_is_legal(&gateway, "c-refused")), 1);
    assert_safety_metrics_zero(&gateway);
}

/// Defect 3, second half: "confirmed terminated" is the provider's own word where it has
/// one. A background Responses reply outlives every connection the gateway makes to it (each
/// is cut at the attempt deadline, then resumed up to the cap); before generation 2 the
/// gateway asks the provider, finds it still in progress and cancels it, and records that.
#[test]
fn a_background_response_still_running_is_cancelled_before_a_new_generation() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "provider_attempt_timeout_ms = 6000");
    conversation_with_question(&gateway, "c-cancel");
    // 300 events at 100 ms: 30 s, far longer than what 1 + 3 connections of 6 s deliver (the
    // simulator's head of a paced stream comes with its first frames, seconds in).
    let text = "word ".repeat(300);
    sim.script(
        "m-cancel",
        json!([{"text": text, "faults": {"delay_ms": 100}}, {"text": "the second generation"}]),
    );
    let events = gateway.dispatch("c-cancel", "op-cancel", "openai-responses@1", "m-cancel");
    let dispatch = gateway.get("/v1/dispatches/op-cancel");
    assert_eq!(dispatch["state"], "COMMITTED", "{dispatch} {events:?}");
    let attempts = dispatch["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{dispatch}");
    assert_eq!(attempts[0]["confirmed_over"], "provider_cancelled", "{dispatch}");
    assert_eq!(attempts[0]["end_reason"], "attempt_timeout", "{dispatch}");
    let log = paths(&sim);
    let handle = attempts[0]["handle"].as_str().unwrap();
    let asked = log
        .iter()
        .position(|path| *path == format!("/v1/responses/{handle}"));
    let cancelled = log
        .iter()
        .position(|path| *path == format!("/v1/responses/{handle}/cancel"));
    let second_send = log
        .iter()
        .enumerate()
        .filter(|(_, path)| *path == "/v1/responses")
        .nth(1)
        .map(|(index, _)| index);
    assert!(
        matches!((asked, cancelled, second_send), (Some(a), Some(c), Some(s)) if a < c && c < s),
        "status, then cancel, then generation 2: {log:?}"
    );
    let document = history_is_legal(&gateway, "c-cancel");
    assert_eq!(assistant_turns(&document), 1);
    assert!(document.to_string().contains("the second generation"));
}

/// Defect 4: a client that leaves while its dispatch is being prepared. The request is
/// written whole and the connection closed at once, before any answer: the dispatch is
/// prepared, driven and committed anyway.
#[test]
fn a_client_that_leaves_during_prepare_leaves_no_dispatch_prepared_for_ever() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    conversation_with_question(&gateway, "c-left");
    sim.script("m-left", json!([{"text": "answered although nobody waited"}]));
    let body = json!({"operation_id": "op-left", "stream": true,
                      "target": {"provider": "sim", "model": "m-left", "adapter": "anthropic-messages@1"}});
    post_and_leave(&gateway, "/v1/conversations/c-left/dispatch", &body);
    let dispatch = wait_for(Duration::from_secs(30), "op-left to commit", || {
        let response = client()
            .get(format!("{}/v1/dispatches/op-left", gateway.base))
            .send()
            .unwrap();
        if response.status().as_u16() != 200 {
            return None;
        }
        let dispatch: Value = response.json().unwrap();
        (dispatch["state"] == "COMMITTED").then_some(dispatch)
    });
    assert_eq!(dispatch["attempts"].as_array().unwrap().len(), 1, "{dispatch}");
    let document = history_is_legal(&gateway, "c-left");
    assert!(document.to_string().contains("answered although nobody waited"));
    assert_eq!(requests_for(&sim, "m-left").len(), 1);
}

/// Defect 7: the attempt budget survives restarts. The gateway is killed each time the
/// provider receives the dispatch's request; across six restarts the provider is asked at most
/// four times (the durable budget), and the dispatch ends ABANDONED, not retried for ever.
#[test]
fn kill_nine_on_every_attempt_never_spends_more_than_the_attempt_budget() {
    const ATTEMPTS_MAX: usize = 4;
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite(&dir);
    let mut gateway = Gateway::start(&dir, &store, &sim, "");
    conversation_with_question(&gateway, "c-storm");
    let slow = json!({"text": "a slow reply that never finishes here", "faults": {"delay_ms": 400}});
    sim.script("m-storm", json!(vec![slow; 8]));
    let body = json!({"operation_id": "op-storm", "stream": true,
                      "target": {"provider": "sim", "model": "m-storm", "adapter": "anthropic-messages@1"}});
    // The client sends and leaves: the dispatch goes on without it (defect 4's fix).
    post_and_leave(&gateway, "/v1/conversations/c-storm/dispatch", &body);
    let mut seen = 0;
    for _restart in 0..6 {
        // Wait for the next provider request of this dispatch (or for the budget to end it).
        let next = wait_for(
            Duration::from_secs(30),
            "the next attempt or the dispatch's end",
            || {
                let sent = requests_for(&sim, "m-storm").len();
                if sent > seen {
                    return Some(Some(sent));
                }
                let state = gateway.get("/v1/dispatches/op-storm")["state"].clone();
                (state == "ABANDONED").then_some(None)
            },
        );
        let Some(sent) = next else { break };
        eprintln!(
            "restart after request {sent}: {}",
            gateway.get("/v1/dispatches/op-storm")["attempts"]
        );
        seen = sent;
        gateway.kill();
        gateway = Gateway::start(&dir, &store, &sim, "");
    }
    let dispatch = terminal(&gateway, "op-storm");
    let sent = requests_for(&sim, "m-storm").len();
    assert!(
        sent <= ATTEMPTS_MAX,
        "{sent} provider requests over a budget of {ATTEMPTS_MAX}: {dispatch}"
    );
    assert_eq!(dispatch["state"], "ABANDONED", "{dispatch}");
    assert_eq!(dispatch["attempts"].as_array().unwrap().len(), sent, "{dispatch}");
    assert_eq!(
        gateway.get("/v1/conversations/c-storm")["revision"],
        1,
        "nothing committed"
    );
}

/// Write a whole POST request and close the connection before any answer.
fn post_and_leave(gateway: &Gateway, path: &str, body: &Value) {
    let body = body.to_string();
    let address = gateway.base.trim_start_matches("http://").to_owned();
    let mut socket = std::net::TcpStream::connect(&address).unwrap();
    write!(
        socket,
        "POST {path} HTTP/1.1\r\nhost: {address}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    socket.flush().unwrap();
}

/// Defect 9, memory: one byte budget for provider output across all dispatches. A reply larger
/// than the budget ends its dispatch at once (nothing committed, not retried, the client told
/// `output_budget_exhausted`), its bytes are given back, and the next dispatch is served.
#[test]
fn a_reply_past_the_process_wide_output_budget_ends_its_dispatch_and_gives_the_memory_back() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "provider_output_bytes_max = 4000");
    conversation_with_question(&gateway, "c-budget");
    sim.script("m-huge", json!([{"text": "a long answer ".repeat(1_000)}]));
    let events = gateway.dispatch("c-budget", "op-huge", "anthropic-messages@1", "m-huge");
    let errors: Vec<&Value> = events
        .iter()
        .filter(|(name, _)| name == "error")
        .map(|(_, data)| data)
        .collect();
    assert!(
        errors
            .iter()
            .any(|error| error["code"] == "output_budget_exhausted"),
        "{events:?}"
    );
    assert!(events.iter().all(|(name, _)| name != "committed"), "{events:?}");
    let dispatch = gateway.get("/v1/dispatches/op-huge");
    assert_eq!(dispatch["state"], "ABANDONED", "{dispatch}");
    let attempts = dispatch["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1, "not retried: {dispatch}");
    assert_eq!(attempts[0]["end_reason"], "output_budget_exhausted", "{dispatch}");
    assert_eq!(gateway.metric("turnstile_provider_output_shed_total"), 1.0);
    assert_eq!(
        gateway.metric("turnstile_provider_output_bytes"),
        0.0,
        "the bytes came back"
    );
    assert_eq!(
        gateway.get("/v1/conversations/c-budget")["revision"],
        1,
        "nothing committed"
    );
    // A reply within the budget is served as usual afterwards.
    sim.script("m-small", json!([{"text": "short"}]));
    let events = gateway.dispatch("c-budget", "op-small", "anthropic-messages@1", "m-small");
    assert_eq!(
        events.iter().filter(|(name, _)| name == "committed").count(),
        1,
        "{events:?}"
    );
}
