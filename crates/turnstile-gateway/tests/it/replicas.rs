//! Issue 55: the documented multi-replica topology (docs/operating.md, "Deploying"), run here
//! with processes: three gateways on one PostgreSQL behind a round-robin TCP load balancer, one
//! simulator as their provider. Under load, one replica is killed with SIGKILL; clients retry
//! through the balancer with the same operation id (as the spec's idempotent dispatch allows),
//! and every dispatch ends exactly once: COMMITTED with exactly one canonical turn, or FAILED
//! with none, and none is lost.

use crate::recovery::wait_for;
use crate::serve::{
    Gateway, assert_safety_metrics_zero, assistant_turns, client, client_events, history_is_legal, named,
    pg_url, run_id,
};
use crate::sim::SimProcess;
use serde_json::{Value, json};
use std::io::Read;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A round-robin TCP load balancer on loopback: each connection goes to the next backend that
/// accepts it (a refused backend is skipped, as a balancer's passive health check does).
struct Balancer {
    base: String,
}

impl Balancer {
    fn start(backends: Vec<SocketAddr>) -> Balancer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let next = Arc::new(AtomicUsize::new(0));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let first = next.fetch_add(1, Ordering::Relaxed);
                let server = (0..backends.len()).find_map(|offset| {
                    let backend = backends[(first + offset) % backends.len()];
                    TcpStream::connect_timeout(&backend, Duration::from_secs(2)).ok()
                });
                let Some(server) = server else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Balancer { base }
    }
}

fn address(gateway: &Gateway) -> SocketAddr {
    gateway.base.trim_start_matches("http://").parse().unwrap()
}

/// One client's dispatch through the balancer: sent again with the same operation id while
/// its stream breaks (a replica died under it), for at most 90 s in all (each try at most
/// 20 s). The events of each try.
fn dispatch_until_answered(
    base: &str,
    conversation: &str,
    operation: &str,
    model: &str,
) -> Vec<Vec<(String, Value)>> {
    let body = json!({"operation_id": operation, "target": {"provider": "sim", "model": model, "adapter": "openai-chat@2"},
                      "stream": true, "max_output_tokens": 256});
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut tries = Vec::new();
    while Instant::now() < deadline {
        let sent = client
            .post(format!("{base}/v1/conversations/{conversation}/dispatch"))
            .json(&body)
            .send();
        let mut text = String::new();
        let complete = match sent {
            Ok(mut response) if response.status() == 200 => response.read_to_string(&mut text).is_ok(),
            _ => false,
        };
        let events = client_events(&text);
        let ended = events
            .iter()
            .any(|(name, _)| name == "committed" || name == "error" || name == "failed");
        tries.push(events);
        if complete && ended {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    tries
}

#[test]
fn three_replicas_behind_a_balancer_end_every_dispatch_once_when_one_is_killed_under_load() {
    const DISPATCHES: usize = 12;
    let url = pg_url();
    let sim = SimProcess::start();
    let run = run_id();
    let model = format!("lb-{run}");
    // Slow streams (~40 deltas, 40 ms apart: over 1.5 s each), so that the kill lands on live
    // ones; replies after these (new generations) are the simulator's short fixed text.
    let words = (0..40)
        .map(|word| format!("w{word}"))
        .collect::<Vec<_>>()
        .join(" ");
    sim.script(
        &model,
        Value::Array(
            (0..DISPATCHES)
                .map(|_| json!({"text": words, "faults": {"delay_ms": 40}}))
                .collect(),
        ),
    );
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut replicas: Vec<Gateway> = dirs
        .iter()
        .enumerate()
        .map(|(index, dir)| Gateway::start(dir, &url, &sim, &format!("replica_id = \"lb-{run}-{index}\"")))
        .collect();
    let balancer = Balancer::start(replicas.iter().map(address).collect());

    let conversations: Vec<String> = (0..DISPATCHES).map(|k| format!("c-lb-{run}-{k}")).collect();
    for id in &conversations {
        let (status, _) = post(
            &balancer.base,
            "/v1/conversations",
            json!({"conversation_id": id}),
        );
        assert_eq!(status, 201);
        let (status, body) = post(
            &balancer.base,
            &format!("/v1/conversations/{id}/turns"),
            json!({"expected_revision": 0, "turn": {"id": "t1", "role": "user",
                   "blocks": [{"id": "u1", "kind": "text", "text": "Tell me a long story."}]}}),
        );
        assert_eq!((status, body), (200, json!({"revision": 1})));
    }

    let victim = 1;
    let outcomes = std::thread::scope(|scope| {
        let clients: Vec<_> = conversations
            .iter()
            .enumerate()
            .map(|(k, id)| {
                let (base, model, operation) = (&balancer.base, &model, format!("op-lb-{run}-{k}"));
                scope.spawn(move || {
                    (
                        operation.clone(),
                        dispatch_until_answered(base, id, &operation, model),
                    )
                })
            })
            .collect();
        // Under load: most streams are running (the simulator received their requests) …
        wait_for(Duration::from_secs(60), "the streams to start", || {
            let started = sim
                .requests()
                .iter()
                .filter(|request| request["body"].as_str().unwrap_or("").contains(&model))
                .count();
            (started >= DISPATCHES * 3 / 4).then_some(())
        });
        // … when one replica dies without a word.
        replicas[victim].kill();
        clients
            .into_iter()
            .map(|client| client.join().unwrap())
            .collect::<Vec<_>>()
    });

    let survivor = &replicas[0];
    let mut committed = 0;
    let mut recovered = 0;
    for (k, (operation, tries)) in outcomes.iter().enumerate() {
        // None lost: the dispatch exists and reaches an end, read from a survivor.
        let view = wait_for(Duration::from_secs(60), &format!("{operation} to end"), || {
            let view = survivor.get(&format!("/v1/dispatches/{operation}"));
            matches!(view["state"].as_str(), Some("COMMITTED" | "FAILED")).then_some(view)
        });
        let document = history_is_legal(survivor, &conversations[k]);
        match view["state"].as_str().unwrap() {
            "COMMITTED" => {
                committed += 1;
                // Exactly once: one canonical turn, at the revision after the user's.
                assert_eq!(assistant_turns(&document), 1, "{operation}: {document}");
                assert_eq!(document["revision"], 2, "{operation}");
            }
            _ => assert_eq!(
                assistant_turns(&document),
                0,
                "{operation} FAILED yet committed: {document}"
            ),
        }
        // A client that saw `committed` saw the revision the store holds.
        for events in tries {
            for event in named(events, "committed") {
                assert_eq!(event["revision"], 2, "{operation}: {events:?}");
            }
        }
        let attempts = view["attempts"].as_array().unwrap();
        if attempts.iter().any(|attempt| {
            attempt["history"]
                .as_array()
                .unwrap()
                .iter()
                .any(|step| step["state"] == "UNKNOWN")
        }) {
            recovered += 1;
        }
    }
    assert!(
        recovered >= 1,
        "the kill landed on live dispatches, which survivors recovered"
    );
    assert_eq!(
        committed, DISPATCHES,
        "every dispatch of a replica that died is still committed once"
    );
    for (index, replica) in replicas.iter().enumerate() {
        if index != victim {
            assert_safety_metrics_zero(replica);
        }
    }
}

fn post(base: &str, path: &str, body: Value) -> (u16, Value) {
    let response = client().post(format!("{base}{path}")).json(&body).send().unwrap();
    let status = response.status().as_u16();
    (status, response.json().unwrap_or(Value::Null))
}
