//! Issue 48: the world's dialects. Compatible servers do things our simulator's reading of the
//! APIs never did: no `data: [DONE]`, usage counted their own way, response ids numbered per
//! process, a JSON answer to a stream request. The simulator speaks each dialect on request
//! (its `faults`), behind a provider entry (`[providers.compat]`) as an operator configures a
//! compatible upstream; each dispatch must commit on its first attempt, once.

use crate::serve::{
    Gateway, assert_safety_metrics_zero, assistant_turns, client, conversation_with_question,
    history_is_legal, named, sqlite,
};
use crate::sim::SimProcess;
use serde_json::{Value, json};

const TEXT: &str = "It is sunny in Paris.";

/// A gateway with the simulator also configured as a compatible provider `compat`.
fn compat_gateway(dir: &tempfile::TempDir, sim: &SimProcess, extra: &str) -> Gateway {
    Gateway::start(
        dir,
        &sqlite(dir),
        sim,
        &format!("{extra}\n[providers.compat]\nbase_url = \"{}\"\n", sim.base),
    )
}

/// Stream a dispatch of `conversation` to one target; the client events.
pub fn dispatch_to(
    gateway: &Gateway,
    conversation: &str,
    operation: &str,
    provider: &str,
    adapter: &str,
    model: &str,
) -> Vec<(String, Value)> {
    let body = json!({"operation_id": operation, "stream": true, "max_output_tokens": 256,
                      "target": {"provider": provider, "model": model, "adapter": adapter}});
    crate::failover::stream_dispatch(gateway, conversation, &body)
}

/// The dispatch committed `TEXT` on its first attempt, with no error and no retraction.
fn committed_first_time(gateway: &Gateway, conversation: &str, operation: &str, events: &[(String, Value)]) {
    let committed = named(events, "committed");
    assert_eq!(committed.len(), 1, "{events:?}");
    assert_eq!(committed[0]["turn"]["blocks"][0]["text"], TEXT, "{events:?}");
    assert!(named(events, "error").is_empty(), "{events:?}");
    assert!(named(events, "retract").is_empty(), "{events:?}");
    let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
    assert_eq!(dispatch["state"], "COMMITTED", "{dispatch}");
    assert_eq!(dispatch["attempts"].as_array().unwrap().len(), 1, "{dispatch}");
    assert_eq!(assistant_turns(&history_is_legal(gateway, conversation)), 1);
}

#[test]
fn a_chat_stream_without_done_commits_on_its_first_attempt() {
    // Item 2: the body ends after the finish reason and the usage chunk.
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = compat_gateway(&dir, &sim, "");
    for (provider, adapter) in [("compat", "openai-chat@2"), ("sim", "openai-chat@1")] {
        let conversation = format!("c-nodone-{provider}");
        let model = format!("m-nodone-{provider}");
        conversation_with_question(&gateway, &conversation);
        sim.script(&model, json!([{"text": TEXT, "faults": {"omit_done": true}}]));
        let operation = format!("op-nodone-{provider}");
        let events = dispatch_to(&gateway, &conversation, &operation, provider, adapter, &model);
        committed_first_time(&gateway, &conversation, &operation, &events);
    }
    let sent = sim
        .requests()
        .iter()
        .filter(|request| {
            request["body"]
                .as_str()
                .is_some_and(|body| body.contains("m-nodone-"))
        })
        .count();
    assert_eq!(sent, 2, "one request each");
    assert_safety_metrics_zero(&gateway);
}

#[test]
fn a_compatible_upstreams_own_usage_count_is_a_notice_not_a_failure() {
    // Item 3: an OpenAI model name served by an upstream that counts its own way.
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = compat_gateway(&dir, &sim, "");
    conversation_with_question(&gateway, "c-usage");
    sim.script(
        "gpt-4o",
        json!([{"text": TEXT, "faults": {"usage_output_tokens": 1}}]),
    );
    let events = dispatch_to(
        &gateway,
        "c-usage",
        "op-usage",
        "compat",
        "openai-chat@2",
        "gpt-4o",
    );
    committed_first_time(&gateway, "c-usage", "op-usage", &events);
    assert_eq!(
        gateway.metric("turnstile_provider_notices_total{provider=\"compat\",code=\"usage_mismatch\"}"),
        1.0
    );
    // The vendor's own count (the simulator as provider `sim` counts as OpenAI does) still
    // holds a short usage to be a delivered-twice delta: retracted, the next attempt commits.
    conversation_with_question(&gateway, "c-usage-vendor");
    sim.script(
        "gpt-4o",
        json!([{"text": TEXT, "faults": {"usage_output_tokens": 1}}, {"text": TEXT}]),
    );
    let events = dispatch_to(
        &gateway,
        "c-usage-vendor",
        "op-usage-vendor",
        "sim",
        "openai-chat@2",
        "gpt-4o",
    );
    let retracts = named(&events, "retract");
    assert_eq!(retracts.len(), 1, "{events:?}");
    assert_eq!(named(&events, "committed").len(), 1, "{events:?}");
    assert_safety_metrics_zero(&gateway);
}

#[test]
fn a_providers_refusal_reaches_the_client_in_its_own_words() {
    // Item 7: "the provider produced nothing" hid the only clue a user has.
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = compat_gateway(&dir, &sim, "");
    let words = "The model `gpt-9` does not exist or you do not have access to it.";
    conversation_with_question(&gateway, "c-refused");
    sim.script(
        "gpt-9",
        json!([{"text": "never", "faults": {"status": 404, "error_message": words}}]),
    );
    let events = dispatch_to(
        &gateway,
        "c-refused",
        "op-refused",
        "compat",
        "openai-chat@2",
        "gpt-9",
    );
    let errors = named(&events, "error");
    assert_eq!(errors.len(), 1, "{events:?}");
    assert_eq!(errors[0]["code"], "provider_status_404", "{events:?}");
    let message = errors[0]["message"].as_str().unwrap();
    assert!(message.contains(words) && message.contains("404"), "{message}");
    // The drop-in proxy answers in the client's API's error shape, with the same words.
    let config = format!(
        "[[routes]]\napi = \"anthropic-messages\"\nprovider = \"compat\"\nadapter = \"anthropic-messages@2\"\n\
         [providers.compat]\nbase_url = \"{}\"\n",
        sim.base
    );
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(&dir, &sqlite(&dir), None, &config).unwrap();
    sim.script("claude-9", json!([{"text": "never", "faults": {"status": 400, "error_message": "prompt is too long: 210000 tokens > 200000 maximum"}}]));
    let response = client()
        .post(format!("{}/v1/messages", gateway.base))
        .json(
            &json!({"model": "claude-9", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}),
        )
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let body: Value = response.json().unwrap();
    assert_eq!(body["type"], "error", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("prompt is too long: 210000 tokens > 200000 maximum"),
        "{body}"
    );
}

#[test]
fn a_server_that_reuses_its_response_ids_commits_every_dispatch_first_time() {
    // Item 1: `chatcmpl-1` again after the server's restart was a foreign handle: a lease's
    // wait, a resend, and after four attempts a failed dispatch.
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = compat_gateway(&dir, &sim, "");
    for (adapter, handle) in [
        ("openai-chat@2", "chatcmpl-1"),
        ("anthropic-messages@2", "msg_1"),
        ("gemini@1", "resp-1"),
    ] {
        for round in 0..2 {
            let conversation = format!("c-reuse-{}-{round}", adapter.replace('@', "-"));
            let model = format!("m-reuse-{round}");
            conversation_with_question(&gateway, &conversation);
            sim.script(&model, json!([{"text": TEXT, "faults": {"handle": handle}}]));
            let operation = format!("op-{conversation}");
            let events = dispatch_to(&gateway, &conversation, &operation, "compat", adapter, &model);
            committed_first_time(&gateway, &conversation, &operation, &events);
            let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
            assert_eq!(dispatch["attempts"][0]["handle"], handle, "recorded: {dispatch}");
        }
    }
    // Streams under a reused id that are cut are retried as any cut stream: no foreign handle
    // (a cut once bound the id, and the next cut under it was refused as another's).
    for round in 0..2 {
        let conversation = format!("c-reuse-cut-{round}");
        let model = format!("m-reuse-cut-{round}");
        conversation_with_question(&gateway, &conversation);
        sim.script(
            &model,
            json!([{"text": TEXT, "faults": {"handle": "chatcmpl-9", "disconnect_after_events": 2}},
                   {"text": TEXT, "faults": {"handle": "chatcmpl-9"}}]),
        );
        let operation = format!("op-{conversation}");
        let events = dispatch_to(
            &gateway,
            &conversation,
            &operation,
            "compat",
            "openai-chat@2",
            &model,
        );
        assert_eq!(named(&events, "committed").len(), 1, "{events:?}");
        let dispatch = gateway.get(&format!("/v1/dispatches/{operation}"));
        assert_eq!(dispatch["attempts"].as_array().unwrap().len(), 2, "{dispatch}");
    }
    assert_eq!(gateway.metric("turnstile_foreign_handle_refusals_total"), 0.0);
    assert_eq!(
        gateway.metric("turnstile_late_blocks_total"),
        0.0,
        "nothing quarantined"
    );
    assert_safety_metrics_zero(&gateway);
}

#[test]
fn a_whole_json_answer_to_a_stream_request_commits_on_its_first_attempt() {
    // Item 4: a server that ignores `"stream": true` answers `application/json`; read as a
    // stream it was a cut stream, four times.
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = compat_gateway(&dir, &sim, "");
    for adapter in [
        "openai-chat@2",
        "openai-responses@1",
        "anthropic-messages@2",
        "gemini@1",
    ] {
        let conversation = format!("c-json-{}", adapter.replace('@', "-"));
        let model = format!("m-json-{}", adapter.replace('@', "-"));
        conversation_with_question(&gateway, &conversation);
        sim.script(&model, json!([{"text": TEXT, "faults": {"json_answer": true}}]));
        let operation = format!("op-{conversation}");
        let events = dispatch_to(&gateway, &conversation, &operation, "compat", adapter, &model);
        committed_first_time(&gateway, &conversation, &operation, &events);
    }
    // With tool calls too: the calls commit whole, with their ids.
    conversation_with_question(&gateway, "c-json-calls");
    sim.script(
        "m-json-calls",
        json!([{"text": "", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
                "faults": {"json_answer": true}}]),
    );
    let events = dispatch_to(
        &gateway,
        "c-json-calls",
        "op-json-calls",
        "compat",
        "openai-chat@2",
        "m-json-calls",
    );
    let committed = named(&events, "committed");
    assert_eq!(committed.len(), 1, "{events:?}");
    let call = &committed[0]["turn"]["blocks"][0];
    assert_eq!(call["kind"], "tool_call", "{call}");
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "Paris"}), "{call}");
    assert_safety_metrics_zero(&gateway);
}
