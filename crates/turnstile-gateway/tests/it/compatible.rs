//! Issue 48: Turnstile in front of OpenAI-compatible servers. A provider entry that asks for
//! string content (`text_content = "string"`) gets every all-text Chat message as one string,
//! end to end through a real `turnstile sim` process; the same server under a default entry
//! still gets arrays of parts.

use crate::serve::{Gateway, assert_sent_bodies_match_manifest, conversation_with_question, named, sqlite};
use crate::sim::SimProcess;
use serde_json::{Value, json};

/// Stream a native dispatch of `conversation` to `provider`'s `model` on openai-chat@2; its
/// client events.
fn dispatch_to(
    gateway: &Gateway,
    conversation: &str,
    operation: &str,
    provider: &str,
) -> Vec<(String, Value)> {
    crate::open_world::dispatch_to(gateway, conversation, operation, provider, "openai-chat@2", "m")
}

/// The `messages` of every Chat body the simulator received, in order.
fn sent_messages(sim: &SimProcess) -> Vec<Vec<Value>> {
    sim.requests()
        .iter()
        .filter_map(|request| request["body"].as_str())
        .filter(|body| !body.is_empty())
        .map(|body| {
            let body: Value = serde_json::from_str(body).unwrap();
            body["messages"].as_array().unwrap().clone()
        })
        .collect()
}

#[test]
fn a_provider_asking_for_string_content_gets_each_all_text_chat_message_as_one_string() {
    let sim = SimProcess::start();
    sim.script("m", json!([{"text": "Sunny."}, {"text": "Sunny."}]));
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "[providers.x]\nbase_url = \"{base}\"\ntext_content = \"string\"\n\
         [providers.y]\nbase_url = \"{base}\"\n",
        base = sim.base
    );
    let gateway = Gateway::start_with(&dir, &sqlite(&dir), None, &config).unwrap();
    conversation_with_question(&gateway, "c-string");
    let events = dispatch_to(&gateway, "c-string", "op-string", "x");
    assert_eq!(named(&events, "committed").len(), 1, "{events:?}");
    let sent = sent_messages(&sim);
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(
        sent[0],
        vec![json!({"role": "user", "content": "Weather in Paris and Tokyo?"})]
    );
    // The body sent is the one the manifest pins, and its policy records the form.
    assert_eq!(assert_sent_bodies_match_manifest(&gateway, &sim, "op-string"), 1);
    let dispatch = gateway.get("/v1/dispatches/op-string");
    assert_eq!(dispatch["policy"]["text_content"], "string", "{dispatch}");

    // The same server under a default entry: arrays of parts, as always.
    conversation_with_question(&gateway, "c-parts");
    let events = dispatch_to(&gateway, "c-parts", "op-parts", "y");
    assert_eq!(named(&events, "committed").len(), 1, "{events:?}");
    let sent = sent_messages(&sim);
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!(
        sent[1],
        vec![json!({"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Tokyo?"}]})]
    );
    let dispatch = gateway.get("/v1/dispatches/op-parts");
    assert!(dispatch["policy"].get("text_content").is_none(), "{dispatch}");
}
