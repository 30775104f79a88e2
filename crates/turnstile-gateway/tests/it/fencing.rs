//! Issue 47: a lease is a promise its holder keeps. Two gateways on one PostgreSQL; one is cut
//! off from the database mid-stream (its connections killed, new ones refused) while its
//! provider stream goes on. It must close its provider connection before its lease runs out,
//! so that the other replica's new generation starts only after the provider saw the first
//! request end. Checked from the provider's side (connections, not leases): a provider written
//! here records when each request began and when its connection closed.

use crate::recovery::wait_for;
use crate::serve::{Gateway, conversation_with_question, named, pg_url, run_id};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One request as the provider saw it.
#[derive(Clone, Debug)]
struct Seen {
    began: Instant,
    closed: Option<Instant>,
}

/// A provider speaking OpenAI Chat: its first request streams text every 20 ms until the
/// client closes the connection (or 60 s pass); every later request gets a whole short answer.
struct Provider {
    base: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    chunks: Arc<AtomicU64>,
}

fn chunk(content: Value, finish: Value) -> String {
    let chunk = json!({"id": "chatcmpl-fence", "object": "chat.completion.chunk", "created": 1, "model": "m",
                       "choices": [{"index": 0, "delta": content, "finish_reason": finish}]});
    format!("data: {chunk}\n\n")
}

impl Provider {
    fn start() -> Provider {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let chunks = Arc::new(AtomicU64::new(0));
        let (seen_in, chunks_in) = (seen.clone(), chunks.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let (seen, chunks) = (seen_in.clone(), chunks_in.clone());
                std::thread::spawn(move || serve(stream, &seen, &chunks));
            }
        });
        Provider { base, seen, chunks }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

fn serve(stream: TcpStream, seen: &Mutex<Vec<Seen>>, chunks: &AtomicU64) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        if line == "\r\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap();
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    let index = {
        let mut seen = seen.lock().unwrap();
        seen.push(Seen {
            began: Instant::now(),
            closed: None,
        });
        seen.len() - 1
    };
    let mut out = stream;
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    let mut write = |text: &str| out.write_all(text.as_bytes()).and_then(|()| out.flush());
    let ended = if index == 0 {
        let _ = write(head);
        let _ = write(&chunk(json!({"role": "assistant", "content": ""}), Value::Null));
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            if Instant::now() > until {
                break;
            }
            if write(&chunk(json!({"content": "still streaming "}), Value::Null)).is_err() {
                break;
            }
            chunks.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(20));
        }
        Instant::now()
    } else {
        let whole = [
            head.to_owned(),
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
            chunk(json!({"content": "Recovered."}), Value::Null),
            chunk(json!({}), json!("stop")),
            "data: [DONE]\n\n".to_owned(),
        ]
        .concat();
        let _ = write(&whole);
        let _ = out.shutdown(Shutdown::Write);
        // Wait for the client to close its side.
        let _ = reader.read_to_end(&mut Vec::new());
        Instant::now()
    };
    seen.lock().unwrap()[index].closed = Some(ended);
}

/// A TCP relay in front of PostgreSQL that can cut every connection and refuse new ones.
pub(crate) struct Relay {
    pub(crate) port: u16,
    cut: Arc<AtomicBool>,
    sockets: Arc<Mutex<Vec<TcpStream>>>,
}

impl Relay {
    fn start(upstream: std::net::SocketAddr) -> Relay {
        Relay::start_on(TcpListener::bind("127.0.0.1:0").unwrap(), upstream)
    }

    /// A relay on `listener`, a port chosen by the caller (a store that appears late).
    pub(crate) fn start_on(listener: TcpListener, upstream: std::net::SocketAddr) -> Relay {
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let sockets: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (cut_in, sockets_in) = (cut.clone(), sockets.clone());
        std::thread::spawn(move || {
            // Relays connections until cut (`cut` wakes the accept), then drops the listener:
            // connects are refused.
            for client in listener.incoming() {
                if cut_in.load(Ordering::SeqCst) {
                    return;
                }
                match client {
                    Ok(client) => {
                        let Ok(server) = TcpStream::connect(upstream) else {
                            continue;
                        };
                        let mut kept = sockets_in.lock().unwrap();
                        kept.push(client.try_clone().unwrap());
                        kept.push(server.try_clone().unwrap());
                        drop(kept);
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
                    Err(_) => return,
                }
            }
        });
        Relay { port, cut, sockets }
    }

    /// Kill every relayed connection and refuse new ones.
    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for socket in self.sockets.lock().unwrap().drain(..) {
            let _ = socket.shutdown(Shutdown::Both);
        }
        // Wake the accept so the listener is dropped.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

#[test]
fn a_replica_cut_off_from_postgresql_closes_its_provider_stream_before_another_starts_the_next_generation() {
    let url = pg_url();
    let parsed = reqwest::Url::parse(&url).unwrap();
    let upstream = std::net::ToSocketAddrs::to_socket_addrs(&(
        parsed.host_str().unwrap().to_owned(),
        parsed.port().unwrap_or(5432),
    ))
    .unwrap()
    .next()
    .unwrap();
    let relay = Relay::start(upstream);
    let mut relayed = parsed.clone();
    relayed.set_host(Some("127.0.0.1")).unwrap();
    relayed.set_port(Some(relay.port)).unwrap();
    let provider = Provider::start();
    let config = |replica: &str| {
        format!(
            "replica_id = \"{replica}\"\nlease_ms = 1000\n[providers.slow]\nbase_url = \"{}\"\n",
            provider.base
        )
    };
    let dir_a = tempfile::tempdir().unwrap();
    let dir_b = tempfile::tempdir().unwrap();
    let a = Gateway::start_with(&dir_a, relayed.as_str(), None, &config("replica-a")).unwrap();
    let b = Gateway::start_with(&dir_b, &url, None, &config("replica-b")).unwrap();
    let run = run_id();
    let conversation = format!("c-fence-{run}");
    conversation_with_question(&b, &conversation);
    let operation = format!("op-fence-{run}");
    let body = json!({"operation_id": operation, "stream": true, "max_output_tokens": 256,
                      "target": {"provider": "slow", "model": "m", "adapter": "openai-chat@2"}});
    let client_of_a = std::thread::spawn({
        let (base, conversation, body) = (a.base.clone(), conversation.clone(), body.clone());
        move || {
            let response = crate::serve::client()
                .post(format!("{base}/v1/conversations/{conversation}/dispatch"))
                .json(&body)
                .send()
                .unwrap();
            let mut text = String::new();
            BufReader::new(response).read_to_string(&mut text).unwrap();
            crate::serve::client_events(&text)
        }
    });
    // The first request streams through replica A (and A renews its lease meanwhile).
    wait_for(Duration::from_secs(30), "the first stream", || {
        let streamed = provider.chunks.load(Ordering::SeqCst) >= 100;
        let seen = provider.seen();
        assert!(
            seen.len() <= 1 && seen.iter().all(|request| request.closed.is_none()),
            "the first request was {seen:?} before the cut, after {} chunks",
            provider.chunks.load(Ordering::SeqCst)
        );
        streamed.then_some(())
    });
    relay.cut();
    // Replica B finds the lease run out by the store's clock and finishes the dispatch.
    wait_for(
        Duration::from_secs(60),
        "the dispatch to commit on replica B",
        || (b.get(&format!("/v1/dispatches/{operation}"))["state"] == "COMMITTED").then_some(()),
    );
    let seen = provider.seen();
    assert!(seen.len() >= 2, "{seen:?}");
    let first_closed = seen[0].closed.expect("the first request's connection closed");
    assert!(
        first_closed < seen[1].began,
        "generation 2 began {:?} before the first request's connection closed",
        first_closed.duration_since(seen[1].began)
    );
    let dispatch = b.get(&format!("/v1/dispatches/{operation}"));
    let attempts = dispatch["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{dispatch}");
    // Replica A's clients are told what happened, never a silent end or a commit it cannot see.
    let events = client_of_a.join().unwrap();
    let retracts = named(&events, "retract");
    assert!(
        retracts
            .iter()
            .any(|retract| retract["generation"] == 1 && retract["reason"] == "lease_ending"),
        "{events:?}"
    );
    assert!(named(&events, "committed").is_empty(), "{events:?}");
    let last = events.last().expect("events");
    assert_eq!(last.0, "error", "{events:?}");
    assert_eq!(last.1["code"], "ledger_unreachable", "{events:?}");
    assert!(a.metric("turnstile_lease_self_fences_total{reason=\"lease_ending\"}") >= 1.0);
}
