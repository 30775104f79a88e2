//! Issue 20: failover that never splices. Two simulators are two providers (`sim` and `b`);
//! every trigger of the spec (429, 503, a refused connection, no response head, a stream cut
//! before its stop signal) moves the dispatch to its next target while nothing is committed.
//! Each test checks: exactly one canonical turn, from the fallback; every body each provider
//! received hashes to its own attempt's manifest; the fallback's body carries nothing of the
//! first answer; the client stream shows the first target's retract.

use crate::serve::{
    Gateway, assert_safety_metrics_zero, assistant_turns, client, client_events, conversation_with_question,
    hex, history_is_legal, named, silent_provider, sqlite,
};
use crate::sim::SimProcess;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::io::Read;

const FALLBACK_TEXT: &str = "The fallback answers: sunny in Paris.";

fn sha(body: &str) -> String {
    format!("sha256:{}", hex(&Sha256::digest(body.as_bytes())))
}

/// Bodies a simulator received for `model` (the model name is in every wire format's body or
/// path).
fn bodies_for(sim: &SimProcess, model: &str) -> Vec<String> {
    sim.requests()
        .into_iter()
        .filter(|request| {
            request["path"].as_str().is_some_and(|path| path.contains(model))
                || request["body"].as_str().is_some_and(|body| body.contains(model))
        })
        .filter_map(|request| request["body"].as_str().map(str::to_owned))
        .filter(|body| !body.is_empty())
        .collect()
}

/// A gateway whose provider `b` is the second simulator, plus `extra` config.
fn gateway_with_fallback(dir: &tempfile::TempDir, sim: &SimProcess, b: &SimProcess, extra: &str) -> Gateway {
    Gateway::start(
        dir,
        &sqlite(dir),
        sim,
        &format!("{extra}\n[providers.b]\nbase_url = \"{}\"\n", b.base),
    )
}

pub fn stream_dispatch(gateway: &Gateway, conversation: &str, body: &Value) -> Vec<(String, Value)> {
    let response = client()
        .post(format!(
            "{}/v1/conversations/{conversation}/dispatch",
            gateway.base
        ))
        .json(body)
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let mut text = String::new();
    std::io::BufReader::new(response)
        .read_to_string(&mut text)
        .unwrap();
    client_events(&text)
}

/// The committed turn's text blocks, joined.
fn committed_text(turn: &Value) -> String {
    turn["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|block| block["text"].as_str())
        .collect()
}

/// The checks every failover shares: one canonical turn (the fallback's), two attempts on two
/// targets with their own manifests, and every sent body equal to its attempt's manifest.
fn assert_failed_over(
    gateway: &Gateway,
    operation: &str,
    conversation: &str,
    first: (Option<&SimProcess>, &str),
    fallback: (&SimProcess, &str),
) -> Value {
    let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
    assert_eq!(dispatch["state"], "COMMITTED", "{dispatch}");
    let attempts = dispatch["attempts"].as_array().unwrap();
    let last = attempts.last().unwrap();
    assert_eq!(last["state"], "COMMITTED", "{dispatch}");
    assert_eq!(last["provider"], "b", "the fallback committed: {dispatch}");
    assert_eq!(last["model"], fallback.1, "{dispatch}");
    assert_eq!(attempts[0]["model"], first.1, "{dispatch}");
    assert_ne!(
        attempts[0]["manifest_digest"], last["manifest_digest"],
        "each target has its own manifest: {dispatch}"
    );
    for attempt in attempts {
        let target = &dispatch["targets"][attempt["target"].as_u64().unwrap() as usize];
        assert_eq!(attempt["request_digest"], target["request_digest"], "{dispatch}");
        assert_eq!(
            attempt["manifest_digest"], target["manifest_digest"],
            "{dispatch}"
        );
    }
    // Every body each provider got hashes to the request digest of the attempt that sent it.
    let first_digest = attempts[0]["request_digest"].as_str().unwrap();
    let fallback_digest = last["request_digest"].as_str().unwrap();
    let fallback_bodies = bodies_for(fallback.0, fallback.1);
    assert!(!fallback_bodies.is_empty(), "the fallback was called");
    for body in &fallback_bodies {
        assert_eq!(
            sha(body),
            fallback_digest,
            "a fallback body off its manifest: {body}"
        );
    }
    if let Some(sim) = first.0 {
        let bodies = bodies_for(sim, first.1);
        assert!(!bodies.is_empty(), "the first target was called");
        for body in bodies {
            assert_eq!(
                sha(&body),
                first_digest,
                "a first-target body off its manifest: {body}"
            );
        }
    }
    // One canonical turn, the fallback's, and a legal history.
    let document = history_is_legal(gateway, conversation);
    assert_eq!(assistant_turns(&document), 1, "{document}");
    let turn = document["turns"].as_array().unwrap().last().unwrap();
    assert_eq!(committed_text(turn), FALLBACK_TEXT, "{turn}");
    assert_eq!(turn["generation"], last["generation"], "{turn}");
    assert_safety_metrics_zero(gateway);
    dispatch
}

#[test]
fn a_refusal_429_or_503_moves_a_streamed_dispatch_to_the_fallback_and_commits_once() {
    let sim = SimProcess::start();
    let b = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = gateway_with_fallback(&dir, &sim, &b, "");
    for status in [429u16, 503] {
        let conversation = format!("c-fo-{status}");
        let (first, fallback) = (format!("m-first-{status}"), format!("m-fb-{status}"));
        conversation_with_question(&gateway, &conversation);
        sim.script(&first, json!([{"text": "never", "faults": {"status": status}}]));
        b.script(&fallback, json!([{"text": FALLBACK_TEXT}]));
        let operation = format!("op-fo-{status}");
        let body = json!({"operation_id": operation, "stream": true, "targets": [
            {"provider": "sim", "model": first, "adapter": "anthropic-messages@2"},
            {"provider": "b", "model": fallback, "adapter": "anthropic-messages@2"}]});
        let events = stream_dispatch(&gateway, &conversation, &body);
        let committed = named(&events, "committed");
        assert_eq!(committed.len(), 1, "{events:?}");
        assert_eq!(committed_text(&committed[0]["turn"]), FALLBACK_TEXT);
        assert!(
            named(&events, "error").is_empty(),
            "a failover is no error: {events:?}"
        );
        assert!(
            named(&events, "state")
                .iter()
                .all(|state| state["state"] != "FAILED"),
            "the refused attempt is not the dispatch's end: {events:?}"
        );
        let retracts = named(&events, "retract");
        assert!(
            retracts
                .iter()
                .any(|retract| retract["generation"] == 1 && retract["reason"] == "failover"),
            "the client sees the first target retracted: {events:?}"
        );
        let dispatch = assert_failed_over(
            &gateway,
            &operation,
            &conversation,
            (Some(&sim), &first),
            (&b, &fallback),
        );
        let attempts = dispatch["attempts"].as_array().unwrap();
        assert_eq!(attempts.len(), 2, "{dispatch}");
        assert_eq!(attempts[0]["state"], "FAILED", "{dispatch}");
        assert_eq!(
            attempts[0]["end_reason"],
            format!("provider_status_{status}"),
            "{dispatch}"
        );
        assert_eq!(attempts[0]["provider"], "sim", "{dispatch}");
        assert_eq!(
            gateway.metric(&format!(
                "turnstile_failovers_total{{from=\"sim\",to=\"b\",reason=\"provider_status_{status}\"}}"
            )),
            1.0
        );
        // The refused attempt showed nothing: no preview was taken back.
        assert_eq!(gateway.metric("turnstile_preview_retractions_total"), 0.0);
    }
}

#[test]
fn a_primary_that_answers_503_every_time_opens_its_breaker() {
    // The clean end of a 503's error body once counted as a success and reset the count, so
    // the breaker never opened (issue 48, item 6).
    let sim = SimProcess::start();
    let b = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = gateway_with_fallback(
        &dir,
        &sim,
        &b,
        "failover_breaker_failures = 2\nfailover_cooldown_ms = 600000",
    );
    let refusal = json!({"text": "never", "faults": {"status": 503}});
    sim.script("m-brk", json!([refusal, refusal, refusal]));
    b.script(
        "m-brk-fb",
        json!([{"text": FALLBACK_TEXT}, {"text": FALLBACK_TEXT}, {"text": FALLBACK_TEXT}]),
    );
    for round in 0..3 {
        let conversation = format!("c-brk-{round}");
        conversation_with_question(&gateway, &conversation);
        let operation = format!("op-brk-{round}");
        let (status, body) = gateway.post(
            &format!("/v1/conversations/{conversation}/dispatch"),
            json!({"operation_id": operation, "targets": [
                {"provider": "sim", "model": "m-brk", "adapter": "openai-chat@2"},
                {"provider": "b", "model": "m-brk-fb", "adapter": "openai-chat@2"}]}),
        );
        assert_eq!(status, 200, "{body}");
        let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
        assert_eq!(dispatch["state"], "COMMITTED", "{dispatch}");
        let attempts = dispatch["attempts"].as_array().unwrap();
        if round < 2 {
            assert_eq!(attempts.len(), 2, "round {round}: {dispatch}");
            assert_eq!(attempts[0]["provider"], "sim", "round {round}: {dispatch}");
        } else {
            assert_eq!(
                attempts.len(),
                1,
                "the open breaker skips the primary: {dispatch}"
            );
            assert_eq!(attempts[0]["provider"], "b", "{dispatch}");
        }
    }
    assert_eq!(
        bodies_for(&sim, "m-brk").len(),
        2,
        "the primary was called twice, then skipped"
    );
}

#[test]
fn a_dispatch_without_fallbacks_still_fails_on_a_503_and_a_400_never_fails_over() {
    let sim = SimProcess::start();
    let b = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = gateway_with_fallback(&dir, &sim, &b, "");
    conversation_with_question(&gateway, "c-one");
    sim.script("m-one", json!([{"text": "never", "faults": {"status": 503}}]));
    let (status, body) = gateway.post(
        "/v1/conversations/c-one/dispatch",
        json!({"operation_id": "op-one", "target": {"provider": "sim", "model": "m-one", "adapter": "openai-chat@2"}}),
    );
    assert_eq!(status, 200, "{body}");
    let dispatch = gateway.get("/v1/dispatches/op-one");
    assert_eq!(dispatch["state"], "FAILED", "{dispatch}");
    assert_eq!(dispatch["attempts"].as_array().unwrap().len(), 1, "{dispatch}");
    // A 400 is the request's own fault: every provider would refuse it, so it ends there.
    conversation_with_question(&gateway, "c-400");
    sim.script("m-400", json!([{"text": "never", "faults": {"status": 400}}]));
    b.script("m-400-fb", json!([{"text": FALLBACK_TEXT}]));
    let (status, body) = gateway.post(
        "/v1/conversations/c-400/dispatch",
        json!({"operation_id": "op-400", "targets": [
            {"provider": "sim", "model": "m-400", "adapter": "openai-chat@2"},
            {"provider": "b", "model": "m-400-fb", "adapter": "openai-chat@2"}]}),
    );
    assert_eq!(status, 200, "{body}");
    let dispatch = gateway.get("/v1/dispatches/op-400");
    assert_eq!(dispatch["state"], "FAILED", "{dispatch}");
    assert_eq!(dispatch["attempts"].as_array().unwrap().len(), 1, "{dispatch}");
    assert!(
        bodies_for(&b, "m-400-fb").is_empty(),
        "the fallback was never called"
    );
}

#[test]
fn a_refused_connection_fails_over_across_apis_without_streaming() {
    // A port with nothing listening: the connection is refused, nothing was sent.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let sim = SimProcess::start();
    let b = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = gateway_with_fallback(
        &dir,
        &sim,
        &b,
        &format!("[providers.down]\nbase_url = \"http://127.0.0.1:{port}\"\n"),
    );
    conversation_with_question(&gateway, "c-down");
    b.script("m-down-fb", json!([{"text": FALLBACK_TEXT}]));
    let (status, body) = gateway.post(
        "/v1/conversations/c-down/dispatch",
        json!({"operation_id": "op-down", "targets": [
            {"provider": "down", "model": "m-down", "adapter": "anthropic-messages@2"},
            {"provider": "b", "model": "m-down-fb", "adapter": "openai-chat@2"}]}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(committed_text(&body["turn"]), FALLBACK_TEXT, "{body}");
    let dispatch = assert_failed_over(&gateway, "op-down", "c-down", (None, "m-down"), (&b, "m-down-fb"));
    let attempts = dispatch["attempts"].as_array().unwrap();
    assert_eq!(attempts[0]["end_reason"], "provider_unreachable", "{dispatch}");
    assert_eq!(attempts[0]["adapter"], "anthropic-messages@2", "{dispatch}");
    assert_eq!(attempts[1]["adapter"], "openai-chat@2", "{dispatch}");
    // The fallback's body is OpenAI Chat, rendered from the same history.
    let sent: Value = serde_json::from_str(&bodies_for(&b, "m-down-fb")[0]).unwrap();
    assert!(sent["messages"].is_array(), "{sent}");
}

#[test]
fn no_response_head_within_the_timeout_fails_over_once_the_old_attempt_is_over() {
    // A provider that accepts connections and never answers.
    let port = silent_provider();
    let sim = SimProcess::start();
    let b = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = gateway_with_fallback(
        &dir,
        &sim,
        &b,
        &format!(
            "provider_connect_timeout_ms = 300\n[providers.silent]\nbase_url = \"http://127.0.0.1:{port}\"\n"
        ),
    );
    conversation_with_question(&gateway, "c-hung");
    b.script("m-hung-fb", json!([{"text": FALLBACK_TEXT}]));
    let body = json!({"operation_id": "op-hung", "stream": true, "targets": [
        {"provider": "silent", "model": "m-hung", "adapter": "openai-chat@2"},
        {"provider": "b", "model": "m-hung-fb", "adapter": "openai-chat@2"}]});
    let events = stream_dispatch(&gateway, "c-hung", &body);
    assert_eq!(named(&events, "committed").len(), 1, "{events:?}");
    let dispatch = assert_failed_over(&gateway, "op-hung", "c-hung", (None, "m-hung"), (&b, "m-hung-fb"));
    let attempts = dispatch["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{dispatch}");
    assert_eq!(attempts[0]["end_reason"], "head_timeout", "{dispatch}");
    // The request may have reached the silent provider, but this process held its only
    // connection and closed it at the head timeout: no one can read that response any more,
    // so the fallback need not wait for the lease (issue 48, item 5).
    assert_eq!(attempts[0]["confirmed_over"], "connection_closed", "{dispatch}");
    // Generation 2 began after the head timeout closed the first connection.
    let began_first = attempts[0]["history"].as_array().unwrap().first().unwrap()["at"]
        .as_u64()
        .unwrap();
    let began = attempts[1]["history"].as_array().unwrap().first().unwrap()["at"]
        .as_u64()
        .unwrap();
    assert!(
        began >= began_first + 300,
        "generation 2 began before the head timeout: {dispatch}"
    );
}

/// Issue 48, item 11: an upstream that retries internally (a LiteLLM proxy) answers after the
/// global head bound. Its provider entry's own `connect_timeout_ms` lets its late head in: one
/// attempt, committed by it, the fallback never called. With only the global bound (300 ms)
/// the attempt ends as `head_timeout` and the fallback answers instead.
#[test]
fn a_providers_own_head_timeout_waits_for_an_upstream_that_answers_late() {
    let sim = SimProcess::start();
    let b = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    // Provider `slow` is the second simulator too, under its own head bound.
    let gateway = gateway_with_fallback(
        &dir,
        &sim,
        &b,
        &format!(
            "provider_connect_timeout_ms = 300\n[providers.slow]\nbase_url = \"{}\"\nconnect_timeout_ms = 20000\n",
            b.base
        ),
    );
    conversation_with_question(&gateway, "c-late");
    let late_text = "The late upstream answers: rain in Oslo.";
    b.script(
        "m-late",
        json!([{"text": late_text, "faults": {"head_delay_ms": 1500}}]),
    );
    b.script("m-late-fb", json!([{"text": FALLBACK_TEXT}]));
    let body = json!({"operation_id": "op-late", "stream": true, "targets": [
        {"provider": "slow", "model": "m-late", "adapter": "openai-chat@2"},
        {"provider": "b", "model": "m-late-fb", "adapter": "openai-chat@2"}]});
    let events = stream_dispatch(&gateway, "c-late", &body);
    assert_eq!(named(&events, "committed").len(), 1, "{events:?}");
    let dispatch = gateway.get("/v1/dispatches/op-late");
    assert_eq!(dispatch["state"], "COMMITTED", "{dispatch}");
    let attempts = dispatch["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1, "one attempt, no head_timeout: {dispatch}");
    assert_eq!(attempts[0]["provider"], "slow", "{dispatch}");
    assert_eq!(attempts[0]["state"], "COMMITTED", "{dispatch}");
    assert!(
        bodies_for(&b, "m-late-fb").is_empty(),
        "the fallback was not called"
    );
    let document = history_is_legal(&gateway, "c-late");
    assert_eq!(assistant_turns(&document), 1, "{document}");
    let turn = document["turns"].as_array().unwrap().last().unwrap();
    assert_eq!(committed_text(turn), late_text, "{turn}");
    assert_safety_metrics_zero(&gateway);
}

#[test]
fn a_stream_cut_before_its_stop_is_retracted_and_nothing_of_it_reaches_the_fallback() {
    let sim = SimProcess::start();
    let b = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = gateway_with_fallback(&dir, &sim, &b, "");
    conversation_with_question(&gateway, "c-cut");
    let partial = "Zanzibar-partial-answer ".repeat(20);
    sim.script(
        "m-cut",
        json!([{"text": partial, "faults": {"cut_at_byte": 600}}]),
    );
    b.script("m-cut-fb", json!([{"text": FALLBACK_TEXT}]));
    let body = json!({"operation_id": "op-cut", "stream": true, "targets": [
        {"provider": "sim", "model": "m-cut", "adapter": "openai-chat@2"},
        {"provider": "b", "model": "m-cut-fb", "adapter": "anthropic-messages@2"}]});
    let events = stream_dispatch(&gateway, "c-cut", &body);
    let previews = named(&events, "preview");
    assert!(
        previews
            .iter()
            .any(|preview| preview["generation"] == 1
                && preview["delta"].as_str().unwrap().contains("Zanzibar")),
        "the first target's text was previewed: {events:?}"
    );
    let retract_at = events
        .iter()
        .position(|(event, data)| event == "retract" && data["generation"] == 1)
        .expect("generation 1 retracted");
    let fallback_text_at = events
        .iter()
        .position(|(event, data)| event == "preview" && data["generation"] == 2)
        .expect("the fallback's preview");
    assert!(
        retract_at < fallback_text_at,
        "retract before the next target's text: {events:?}"
    );
    let dispatch = assert_failed_over(
        &gateway,
        "op-cut",
        "c-cut",
        (Some(&sim), "m-cut"),
        (&b, "m-cut-fb"),
    );
    assert_eq!(dispatch["attempts"][0]["state"], "ABANDONED", "{dispatch}");
    // The cut request may still run at the provider (no resume, no idempotency key honoured),
    // but its only connection was this process's and it is closed: nothing can deliver it, so
    // the next target did not wait for the lease (issue 48, item 5).
    assert_eq!(
        dispatch["attempts"][0]["confirmed_over"], "connection_closed",
        "{dispatch}"
    );
    // No prefill, no "continue from": the fallback's request has nothing of the first answer.
    for body in bodies_for(&b, "m-cut-fb") {
        assert!(
            !body.contains("Zanzibar"),
            "the first answer leaked into the fallback: {body}"
        );
    }
    let document = gateway.get("/v1/conversations/c-cut");
    assert!(!document.to_string().contains("Zanzibar"), "{document}");
}

fn proxy_config(b: &SimProcess) -> String {
    let mut config = format!("[providers.b]\nbase_url = \"{}\"\n", b.base);
    for api in ["openai-chat", "openai-responses", "anthropic-messages", "gemini"] {
        config.push_str(&format!(
            "\n[[routes]]\napi = \"{api}\"\nmodel = \"m-proxy*\"\nprovider = \"sim\"\n\
             adapter = \"openai-chat@2\"\nfallbacks = [{{provider = \"b\", adapter = \"anthropic-messages@2\", target_model = \"m-proxy-fb\"}}]\n"
        ));
    }
    config
}

/// `x-turnstile-provider` and `x-turnstile-model` of a response.
fn answered_by(response: &reqwest::blocking::Response) -> (String, String) {
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    (header("x-turnstile-provider"), header("x-turnstile-model"))
}

#[test]
fn a_proxy_route_with_fallbacks_answers_in_the_clients_format_streamed_and_not() {
    let sim = SimProcess::start();
    let b = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, &proxy_config(&b));
    sim.script(
        "m-proxy",
        json!([{"text": "never", "faults": {"status": 503}}, {"text": "never", "faults": {"status": 429}}]),
    );
    b.script(
        "m-proxy-fb",
        json!([{"text": FALLBACK_TEXT}, {"text": FALLBACK_TEXT}]),
    );
    let request = |stream: bool, question: &str| {
        client()
            .post(format!("{}/v1/chat/completions", gateway.base))
            .json(&json!({"model": "m-proxy", "stream": stream,
                          "messages": [{"role": "user", "content": question}]}))
            .send()
            .unwrap()
    };
    let fallback = ("b".to_owned(), "m-proxy-fb".to_owned());
    let response = request(false, "Weather in Paris?");
    assert_eq!(response.status().as_u16(), 200);
    // Who answered, after the failover: the fallback, in the headers and the model field.
    assert_eq!(answered_by(&response), fallback);
    let answer: Value = response.json().unwrap();
    assert_eq!(
        answer["choices"][0]["message"]["content"], FALLBACK_TEXT,
        "{answer}"
    );
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    assert_eq!(answer["model"], "m-proxy-fb", "{answer}");
    let response = request(true, "Weather in Lyon?");
    assert_eq!(response.status().as_u16(), 200);
    // The 429 came before any preview: the fallback's generation opened the stream.
    assert_eq!(answered_by(&response), fallback);
    let text = response.text().unwrap();
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|chunk| {
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(streamed, FALLBACK_TEXT, "{text}");
    assert!(
        chunks.iter().all(|chunk| chunk["model"] == "m-proxy-fb"),
        "{text}"
    );
    // Both sent bodies to the fallback are Anthropic Messages, each its attempt's manifest.
    let fallback_bodies = bodies_for(&b, "m-proxy-fb");
    assert_eq!(fallback_bodies.len(), 2, "{fallback_bodies:?}");
    for body in &fallback_bodies {
        let sent: Value = serde_json::from_str(body).unwrap();
        assert!(
            sent["messages"].is_array() && sent["max_tokens"].is_u64(),
            "{sent}"
        );
        assert!(!body.contains("never"), "{body}");
    }
    assert!(
        gateway.metric("turnstile_failovers_total{from=\"sim\",to=\"b\",reason=\"provider_status_503\"}")
            >= 1.0
    );
    assert!(
        gateway.metric("turnstile_failovers_total{from=\"sim\",to=\"b\",reason=\"provider_status_429\"}")
            >= 1.0
    );
    // Without failover the primary answers, and is named, streamed and not. Another model of
    // the route: `sim/m-proxy` cools for the 429's `retry-after` (its breaker), so a request
    // now would rightly begin on the fallback.
    sim.script(
        "m-proxy-primary",
        json!([{"text": "Primary."}, {"text": "Primary."}]),
    );
    let primary = ("sim".to_owned(), "m-proxy-primary".to_owned());
    let request = |stream: bool, question: &str| {
        client()
            .post(format!("{}/v1/chat/completions", gateway.base))
            .json(&json!({"model": "m-proxy-primary", "stream": stream,
                          "messages": [{"role": "user", "content": question}]}))
            .send()
            .unwrap()
    };
    let response = request(false, "Weather in Nice?");
    assert_eq!(answered_by(&response), primary);
    let answer: Value = response.json().unwrap();
    assert_eq!(answer["model"], "m-proxy-primary", "{answer}");
    let response = request(true, "Weather in Metz?");
    assert_eq!(answered_by(&response), primary);
    assert!(response.text().unwrap().contains("Primary."));
    // Each API's own field names the fallback after a 503 on the first target (whole answers).
    let gemini = "/v1beta/models/m-proxy-x:generateContent";
    for (path, body, field) in [
        (
            "/v1/responses",
            json!({"model": "m-proxy-x", "input": "Weather in Rome?"}),
            "/model",
        ),
        (
            "/v1/messages",
            json!({"model": "m-proxy-x", "max_tokens": 64,
                   "messages": [{"role": "user", "content": "Weather in Oslo?"}]}),
            "/model",
        ),
        (
            gemini,
            json!({"contents": [{"role": "user", "parts": [{"text": "Weather in Bern?"}]}]}),
            "/modelVersion",
        ),
    ] {
        sim.script("m-proxy-x", json!([{"text": "never", "faults": {"status": 503}}]));
        b.script("m-proxy-fb", json!([{"text": FALLBACK_TEXT}]));
        let response = client()
            .post(format!("{}{path}", gateway.base))
            .json(&body)
            .send()
            .unwrap();
        assert_eq!(response.status().as_u16(), 200, "{path}");
        assert_eq!(answered_by(&response), fallback, "{path}");
        let answer: Value = response.json().unwrap();
        assert_eq!(
            answer.pointer(field),
            Some(&json!("m-proxy-fb")),
            "{path}: {answer}"
        );
    }
    assert_safety_metrics_zero(&gateway);
}

#[test]
fn targets_are_checked_one_by_one_and_a_setting_one_target_cannot_take_names_it() {
    let sim = SimProcess::start();
    let b = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = gateway_with_fallback(&dir, &sim, &b, "");
    conversation_with_question(&gateway, "c-check");
    // top_k exists for Anthropic, not for OpenAI Chat: the fallback cannot take it.
    let (status, body) = gateway.post(
        "/v1/conversations/c-check/dispatch",
        json!({"operation_id": "op-check", "sampling": {"top_k": 5}, "targets": [
            {"provider": "sim", "model": "m", "adapter": "anthropic-messages@2"},
            {"provider": "b", "model": "m", "adapter": "openai-chat@2"}]}),
    );
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["code"], "unsupported_setting", "{body}");
    assert_eq!(body["error"]["target"], 1, "{body}");
    assert_eq!(body["error"]["setting"], "top_k", "{body}");
    for bad in [
        json!({"operation_id": "op-both", "target": {"model": "m", "adapter": "openai-chat@2"},
               "targets": [{"model": "m", "adapter": "openai-chat@2"}]}),
        json!({"operation_id": "op-none", "targets": []}),
        json!({"operation_id": "op-neither"}),
    ] {
        let (status, body) = gateway.post("/v1/conversations/c-check/dispatch", bad);
        assert_eq!(status, 422, "{body}");
        assert_eq!(body["error"]["code"], "invalid_request", "{body}");
    }
    assert!(
        gateway.get("/v1/dispatches/op-check")["error"].is_object(),
        "nothing was stored"
    );
    assert!(
        sim.requests().is_empty() && b.requests().is_empty(),
        "nothing was sent"
    );
}

/// Issue 48, item 12: a route with `answer = "commit"` forwards nothing of a streamed answer
/// before the commit, so a first target cut after its text began and a fallback that says
/// something else give the client exactly the fallback's text, in the client's stream format,
/// and no error. The same failover on a default route (`stream`) forwarded the first target's
/// text and so ends with `preview_diverged`.
#[test]
fn a_commit_answer_route_streams_the_fallbacks_whole_answer_after_a_cut() {
    let sim = SimProcess::start();
    let b = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let mut routes = String::new();
    for (model, answer) in [("m-commit", "\nanswer = \"commit\""), ("m-stream", "")] {
        routes.push_str(&format!(
            "[[routes]]\napi = \"openai-chat\"\nmodel = \"{model}\"\nprovider = \"sim\"\n\
             adapter = \"openai-chat@2\"{answer}\nfallbacks = [{{provider = \"b\", adapter = \"anthropic-messages@2\", target_model = \"{model}-fb\"}}]\n\n"
        ));
    }
    let gateway = gateway_with_fallback(&dir, &sim, &b, &routes);
    let partial = "Zanzibar-partial-answer ".repeat(20);
    for model in ["m-commit", "m-stream"] {
        sim.script(model, json!([{"text": partial, "faults": {"cut_at_byte": 600}}]));
        b.script(&format!("{model}-fb"), json!([{"text": FALLBACK_TEXT}]));
    }
    let streamed = |model: &str| {
        let response = client()
            .post(format!("{}/v1/chat/completions", gateway.base))
            .json(&json!({"model": model, "stream": true,
                          "messages": [{"role": "user", "content": "Weather in Paris?"}]}))
            .send()
            .unwrap();
        assert_eq!(response.status().as_u16(), 200);
        let text = response.text().unwrap();
        let chunks: Vec<Value> = text
            .lines()
            .filter_map(|line| line.strip_prefix("data: "))
            .filter(|data| *data != "[DONE]")
            .filter_map(|data| serde_json::from_str::<Value>(data).ok())
            .collect();
        let content: String = chunks
            .iter()
            .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str())
            .collect();
        let errors: Vec<Value> = chunks
            .iter()
            .filter(|chunk| !chunk["error"].is_null())
            .cloned()
            .collect();
        (content, errors, text)
    };
    let (content, errors, text) = streamed("m-commit");
    assert!(errors.is_empty(), "{text}");
    assert_eq!(content, FALLBACK_TEXT, "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // The first target's text was produced, and never reached the client.
    assert!(
        !bodies_for(&sim, "m-commit").is_empty(),
        "the first target was called"
    );
    assert!(!text.contains("Zanzibar"), "{text}");
    // The default route: the first target's text went out, the fallback's diverges.
    let (content, errors, text) = streamed("m-stream");
    assert_eq!(errors.len(), 1, "{text}");
    assert_eq!(errors[0]["error"]["code"], "preview_diverged", "{text}");
    assert!(content.starts_with("Zanzibar"), "{text}");
}
