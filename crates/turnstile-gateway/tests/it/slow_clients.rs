//! Clients that read slowly or not at all (issue 49, items 2 and 3; the fault probes' s4): the
//! end of a dispatch reaches a client that is still connected however far behind it fell (the
//! backlog drops old previews and tells it so, never the commit), what is held for a client
//! counts against the output budget while it is held, and a client that reads nothing for
//! `client_write_timeout_ms` is disconnected while its dispatch commits.
//!
//! The clients are raw sockets with a 4 KiB receive buffer, so that a client that does not read
//! stops the gateway's writes after a few KiB (the gateway's own queues then fill), as a
//! stalled or paused client on a real network does.

use crate::recovery::wait_for;
use crate::serve::{Gateway, client, client_events, conversation_with_question, sqlite};
use crate::sim::SimProcess;
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Longest a test waits for state it polls (a dispatch to commit, a gauge to drop).
const POLL_MAX: Duration = Duration::from_secs(60);

/// A connection to the gateway with a small receive buffer, and `body` posted on it (the
/// response is not read).
fn silent_request(gateway: &Gateway, path: &str, body: &Value) -> TcpStream {
    let address: SocketAddr = gateway.base.trim_start_matches("http://").parse().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap();
    let mut stream = runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        socket.connect(address).await.unwrap().into_std().unwrap()
    });
    stream.set_nonblocking(false).unwrap();
    let body = body.to_string();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    stream.flush().unwrap();
    stream
}

/// The response head, read byte by byte (nothing of the body).
fn read_head(stream: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(
            stream.read(&mut byte).unwrap(),
            1,
            "the connection ended in the head"
        );
        head.push(byte[0]);
    }
    String::from_utf8(head).unwrap()
}

/// The rest of a chunked body, to the end of the connection, de-chunked.
fn read_chunked_body(stream: &mut TcpStream) -> String {
    stream.set_read_timeout(Some(POLL_MAX)).unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let mut body = Vec::new();
    let mut rest = &raw[..];
    loop {
        let line_end = rest
            .windows(2)
            .position(|pair| pair == b"\r\n")
            .expect("a chunk size line");
        let size = usize::from_str_radix(std::str::from_utf8(&rest[..line_end]).unwrap().trim(), 16).unwrap();
        rest = &rest[line_end + 2..];
        if size == 0 {
            break;
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
    String::from_utf8(body).unwrap()
}

fn header<'h>(head: &'h str, name: &str) -> &'h str {
    head.lines()
        .find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.eq_ignore_ascii_case(name).then_some(value.trim())
        })
        .unwrap_or_else(|| panic!("no {name} in {head}"))
}

/// Poll until the dispatch is COMMITTED.
fn wait_committed(gateway: &Gateway, operation_id: &str) {
    wait_for(POLL_MAX, &format!("{operation_id} to commit"), || {
        (gateway.get(&format!("/v1/dispatches/{operation_id}"))["state"] == "COMMITTED").then_some(())
    });
}

/// Poll until `metric` satisfies `done`.
fn wait_metric(gateway: &Gateway, metric: &str, done: impl Fn(f64) -> bool) -> f64 {
    wait_for(POLL_MAX, metric, || {
        Some(gateway.metric(metric)).filter(|value| done(*value))
    })
}

/// `count` distinct words of `bytes` bytes: one preview each from the simulator. Digits, so
/// that counting their tokens stays linear (a BPE count of one long run of letters is not).
fn words(count: usize, bytes: usize) -> String {
    (0..count)
        .map(|number| {
            let filler: String = "0123456789"
                .chars()
                .cycle()
                .take(bytes.saturating_sub(6))
                .collect();
            format!("w{number:05}{filler}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The kernel alone takes up to about 4 MiB for a client that reads nothing (loopback's send
/// buffer grows to `tcp_wmem`'s maximum), so every stream here is well past that: a client that
/// stops reading is then behind what the gateway holds for it.
const STREAM_PREVIEWS: usize = 2_500;
const STREAM_PREVIEW_BYTES: usize = 4_000;
/// A short test lease would expire under a loaded debug build while the simulator prepares
/// these long replies, and start a second generation that has nothing to do with this test.
const CONFIG: &str = "lease_ms = 5000\nclient_write_timeout_ms = 600000\n";

fn dispatch_body(operation_id: &str, model: &str) -> Value {
    json!({"operation_id": operation_id, "stream": true,
           "target": {"provider": "sim", "model": model, "adapter": "anthropic-messages@1"}})
}

fn committed_text(turn: &Value) -> String {
    turn["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|block| block["text"].as_str())
        .collect()
}

#[test]
fn a_native_client_far_behind_its_dispatch_gets_a_gap_then_the_commit() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    // A backlog of 50 previews (100,000 by default), far fewer than the stream has.
    let gateway = Gateway::start(
        &dir,
        &sqlite(&dir),
        &sim,
        &format!("{CONFIG}stream_backlog_previews_max = 50"),
    );
    conversation_with_question(&gateway, "c-far");
    let text = words(STREAM_PREVIEWS, STREAM_PREVIEW_BYTES);
    sim.script("m-far", json!([{"text": text}]));
    // The client reads the head, then nothing until the dispatch has committed.
    let mut stream = silent_request(
        &gateway,
        "/v1/conversations/c-far/dispatch",
        &dispatch_body("op-far", "m-far"),
    );
    assert!(read_head(&mut stream).starts_with("HTTP/1.1 200"));
    wait_committed(&gateway, "op-far");
    let body = read_chunked_body(&mut stream);
    let events = client_events(&body);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    // It fell behind the kept previews: told so, with how many it missed.
    let gaps: Vec<&Value> = events
        .iter()
        .filter(|(name, _)| name == "gap")
        .map(|(_, data)| data)
        .collect();
    assert!(!gaps.is_empty(), "{names:?}");
    let missed: u64 = gaps
        .iter()
        .map(|gap| gap["previews_missed"].as_u64().unwrap())
        .sum();
    let previews = names.iter().filter(|name| **name == "preview").count() as u64;
    assert_eq!(
        missed + previews,
        STREAM_PREVIEWS as u64,
        "every preview is read or counted as missed"
    );
    // And the end came: the commit, once, last, with the whole text.
    assert_eq!(
        names.iter().filter(|name| **name == "committed").count(),
        1,
        "{:?}",
        &names[names.len().saturating_sub(5)..]
    );
    let (last, committed) = events.last().unwrap();
    assert_eq!(last, "committed");
    assert_eq!(committed_text(&committed["turn"]), text);
    assert!(events.iter().all(|(name, _)| name != "error"), "no error");
    // Ids increase across the gap: a resume from any of them continues after it.
    let ids: Vec<u64> = body
        .lines()
        .filter_map(|line| line.strip_prefix("id: "))
        .map(|id| id.parse().unwrap())
        .collect();
    assert!(ids.windows(2).all(|pair| pair[0] < pair[1]));
    assert!(gateway.metric("turnstile_client_stream_gaps_total") >= 1.0);
}

#[test]
fn a_proxy_client_far_behind_its_dispatch_gets_the_rest_of_the_answer_and_a_clean_end() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(
        &dir,
        &sqlite(&dir),
        &sim,
        &format!("{CONFIG}stream_backlog_previews_max = 50"),
    );
    let text = words(STREAM_PREVIEWS, STREAM_PREVIEW_BYTES);
    // Its usage is reported, not counted: a BPE count of megabytes in the simulator's debug
    // build would outlast the gateway's head timeout.
    sim.script(
        "m-far-proxy",
        json!([{"text": text, "faults": {"usage_output_tokens": text.len()}}]),
    );
    let mut stream = silent_request(
        &gateway,
        "/v1/chat/completions",
        &json!({"model": "m-far-proxy", "stream": true,
                "messages": [{"role": "user", "content": "A long answer, please."}]}),
    );
    let head = read_head(&mut stream);
    if !head.starts_with("HTTP/1.1 200") {
        let mut rest = String::new();
        let _ = stream.read_to_string(&mut rest);
        let operation_id = header(&head, "x-turnstile-operation-id");
        let dispatch = gateway.get(&format!("/v1/dispatches/{operation_id}"));
        let ends: Vec<(Value, Value)> = dispatch["attempts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|attempt| (attempt["end_reason"].clone(), attempt["history"].clone()))
            .collect();
        panic!("{head}{rest}\n{ends:?}");
    }
    let operation_id = header(&head, "x-turnstile-operation-id").to_owned();
    wait_committed(&gateway, &operation_id);
    let body = read_chunked_body(&mut stream);
    let datas: Vec<&str> = body
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .collect();
    assert_eq!(
        datas.last(),
        Some(&"[DONE]"),
        "{:?}",
        &datas[datas.len().saturating_sub(3)..]
    );
    let chunks: Vec<Value> = datas[..datas.len() - 1]
        .iter()
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    assert!(
        chunks.iter().all(|chunk| chunk.get("error").is_none()),
        "no error: {:?}",
        chunks.iter().find(|chunk| chunk.get("error").is_some())
    );
    // The text the client got is the answer, each part once: what it read before it fell
    // behind, then the rest from the commit.
    let streamed: String = chunks
        .iter()
        .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, text);
    assert_eq!(
        chunks
            .iter()
            .filter_map(|chunk| chunk["choices"][0]["finish_reason"].as_str())
            .collect::<Vec<_>>(),
        vec!["stop"]
    );
    assert!(gateway.metric("turnstile_client_stream_gaps_total") >= 1.0);
}

/// Read a second client's whole stream of the same dispatch: when it ends, the dispatch's
/// driver has ended (it gives its share of the budget back before it finishes the stream).
fn follow_to_the_end(gateway: &Gateway, path: &str, body: &Value) -> Vec<(String, Value)> {
    let text = client()
        .post(format!("{}{path}", gateway.base))
        .json(body)
        .send()
        .unwrap()
        .text()
        .unwrap();
    client_events(&text)
}

#[test]
fn a_client_that_stops_reading_holds_its_backlog_against_the_output_budget_until_it_leaves() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, CONFIG);
    conversation_with_question(&gateway, "c-silent");
    let text = words(STREAM_PREVIEWS, STREAM_PREVIEW_BYTES);
    sim.script("m-silent", json!([{"text": text}]));
    let body = dispatch_body("op-silent", "m-silent");
    let silent = silent_request(&gateway, "/v1/conversations/c-silent/dispatch", &body);
    let events = follow_to_the_end(&gateway, "/v1/conversations/c-silent/dispatch", &body);
    assert_eq!(events.last().unwrap().0, "committed", "{:?}", events.last());
    // The dispatch is over and its driver gone; the silent client still holds the backlog,
    // and the budget's gauge counts it (the previews alone are the text's length).
    let held = gateway.metric("turnstile_provider_output_bytes");
    assert!(
        held >= text.len() as f64,
        "held {held} for a text of {}",
        text.len()
    );
    // It leaves: everything is given back.
    drop(silent);
    wait_metric(&gateway, "turnstile_provider_output_bytes", |bytes| bytes == 0.0);
}

#[test]
fn a_client_that_reads_nothing_is_disconnected_after_the_write_timeout_and_its_dispatch_commits() {
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start(
        &dir,
        &sqlite(&dir),
        &sim,
        "lease_ms = 5000\nclient_write_timeout_ms = 1000",
    );
    conversation_with_question(&gateway, "c-stuck");
    let text = words(STREAM_PREVIEWS, STREAM_PREVIEW_BYTES);
    sim.script("m-stuck", json!([{"text": text}]));
    let body = dispatch_body("op-stuck", "m-stuck");
    let mut stuck = silent_request(&gateway, "/v1/conversations/c-stuck/dispatch", &body);
    wait_committed(&gateway, "op-stuck");
    assert_eq!(gateway.get("/v1/conversations/c-stuck")["revision"], 2);
    // The gateway gives up on it and frees what it held.
    wait_metric(&gateway, "turnstile_client_write_timeouts_total", |count| {
        count == 1.0
    });
    wait_metric(&gateway, "turnstile_provider_output_bytes", |bytes| bytes == 0.0);
    // Its connection was closed: what was already in flight, then the end (no hang).
    stuck.set_read_timeout(Some(POLL_MAX)).unwrap();
    let mut received = Vec::new();
    let ended = stuck.read_to_end(&mut received);
    assert!(
        ended.is_ok()
            || ended
                .as_ref()
                .is_err_and(|error| error.kind() == std::io::ErrorKind::ConnectionReset),
        "{ended:?}"
    );
    let received = String::from_utf8_lossy(&received);
    assert!(received.starts_with("HTTP/1.1 200"));
    assert!(
        !received.ends_with("0\r\n\r\n"),
        "the stream was cut, not finished"
    );
}
