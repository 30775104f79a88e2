//! Native dispatch streams resume by `Last-Event-ID`: every event carries an `id:` (its
//! ordinal in the dispatch's stream), and a request with the same operation id and a
//! `Last-Event-ID` gets exactly the events after that one, the commit exactly once
//! (docs/decisions/0126-native-streams-resume-by-last-event-id-the-proxys.md, "Native streams
//! resume by Last-Event-ID").

use crate::serve::{Gateway, client, conversation_with_question, sqlite};
use crate::sim::SimProcess;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read};

/// One SSE event as sent: its id (None when it has no `id:` line), name and data.
type Event = (Option<u64>, String, Value);

fn parse(text: &str) -> Vec<Event> {
    text.split("\n\n")
        .filter(|chunk| !chunk.trim().is_empty())
        .map(|chunk| {
            let (mut id, mut name, mut data) = (None, String::new(), Value::Null);
            for line in chunk.lines() {
                if let Some(value) = line.strip_prefix("id: ") {
                    id = Some(value.parse().unwrap());
                } else if let Some(value) = line.strip_prefix("event: ") {
                    name = value.to_owned();
                } else if let Some(value) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(value).unwrap();
                }
            }
            (id, name, data)
        })
        .collect()
}

fn request(
    gateway: &Gateway,
    body: &Value,
    last_event_id: Option<&str>,
) -> BufReader<reqwest::blocking::Response> {
    let mut request = client()
        .post(format!("{}/v1/conversations/c-resume/dispatch", gateway.base))
        .json(body);
    if let Some(id) = last_event_id {
        request = request.header("Last-Event-ID", id);
    }
    let response = request.send().unwrap();
    assert_eq!(response.status(), 200);
    BufReader::new(response)
}

fn whole(gateway: &Gateway, body: &Value, last_event_id: Option<&str>) -> Vec<Event> {
    let mut text = String::new();
    request(gateway, body, last_event_id)
        .read_to_string(&mut text)
        .unwrap();
    parse(&text)
}

/// The first `count` events of a stream, then the connection is dropped.
fn first_events(gateway: &Gateway, body: &Value, count: usize) -> Vec<Event> {
    let mut reader = request(gateway, body, None);
    let mut text = String::new();
    while text.matches("\n\n").count() < count {
        let mut line = String::new();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "the stream ended early: {text}"
        );
        text.push_str(&line);
    }
    parse(&text)
}

fn ids(events: &[Event]) -> Vec<u64> {
    events
        .iter()
        .map(|(id, name, _)| id.unwrap_or_else(|| panic!("an event without an id: {name}")))
        .collect()
}

fn committed(events: &[Event]) -> usize {
    events.iter().filter(|(_, name, _)| name == "committed").count()
}

#[test]
fn a_stream_resumed_by_last_event_id_continues_after_it_without_repeating_and_commits_once() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, "");
    conversation_with_question(&gateway, "c-resume");
    // About 5 s of stream at 150 ms per event: room for both clients to attach in the middle
    // on a loaded machine (the attaches are loopback requests made at once; a gate the test
    // releases would remove the margin altogether).
    sim.script(
        "m-resume",
        json!([{"text": "one two three four five six seven eight nine ten ".repeat(3),
                                  "faults": {"delay_ms": 150}}]),
    );
    let body = json!({"operation_id": "op-resume", "stream": true,
                      "target": {"provider": "sim", "model": "m-resume", "adapter": "openai-responses@1"}});

    // A client that leaves after six events (the state changes and the first previews).
    let before = first_events(&gateway, &body, 6);
    let seen = *ids(&before).last().unwrap();
    // A client that stays from the start, attached while the dispatch streams.
    let full = {
        let (gateway_base, body) = (gateway.base.clone(), body.clone());
        std::thread::spawn(move || {
            let mut text = String::new();
            client()
                .post(format!("{gateway_base}/v1/conversations/c-resume/dispatch"))
                .json(&body)
                .send()
                .unwrap()
                .read_to_string(&mut text)
                .unwrap();
            parse(&text)
        })
    };
    // The first client comes back mid-stream with the id of the last event it read.
    let after = whole(&gateway, &body, Some(&seen.to_string()));
    let full = full.join().unwrap();

    // (1) Every event has an id; ids strictly increase.
    let full_ids = ids(&full);
    assert!(full_ids.windows(2).all(|pair| pair[0] < pair[1]), "{full_ids:?}");
    assert_eq!(committed(&full), 1, "{full:?}");
    assert_eq!(full.last().unwrap().1, "committed", "{full:?}");
    // (2) What was read before plus what the resume gave is the whole stream: nothing
    // repeated, nothing missing, the commit once.
    assert!(ids(&after).iter().all(|id| *id > seen), "{after:?}");
    let joined: Vec<Event> = before.iter().chain(&after).cloned().collect();
    assert_eq!(joined, full);
    assert!(
        after.iter().any(|(_, name, _)| name == "preview"),
        "resumed mid-stream: {after:?}"
    );

    // (3) After the commit: from the commit's id, nothing more; from an earlier id, the events
    // still owed (the state changes and the commit, once, under their first ids).
    let committed_id = full.last().unwrap().0.unwrap();
    assert_eq!(
        whole(&gateway, &body, Some(&committed_id.to_string())),
        Vec::<Event>::new()
    );
    let late = whole(&gateway, &body, Some(&seen.to_string()));
    assert_eq!(committed(&late), 1, "{late:?}");
    assert!(
        late.iter()
            .all(|event| event.0.unwrap() > seen && full.contains(event)),
        "{late:?}"
    );
    assert_eq!(late.last(), full.last());
    // A Last-Event-ID that is not one of this dispatch's ids is ignored: from the start.
    let garbage = whole(&gateway, &body, Some("not-an-id"));
    assert_eq!(garbage.first(), full.first());
    assert_eq!(committed(&garbage), 1, "{garbage:?}");
}
