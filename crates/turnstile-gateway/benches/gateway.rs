//! Gateway overhead on loopback: client → gateway → simulator against client → simulator
//! directly, in one run, with streamed replies of ~50 events and durability on (SQLite
//! `synchronous=FULL`, the embedded default).
//!
//! Run: `cargo bench -p turnstile-gateway --bench gateway`
//! (`TURNSTILE_BENCH_REQUESTS`, `TURNSTILE_BENCH_CONCURRENCY`, `TURNSTILE_BENCH_RATE` override
//! the defaults 2000, 16 and 200; `TURNSTILE_BENCH_SCRAPE_MS`, default 100, is how often the
//! scraping phase reads `/metrics`.)
//!
//! Metric overhead: the fixed-rate gateway phase runs twice more, once with nobody reading
//! `/metrics` and once with a scraper reading it every `TURNSTILE_BENCH_SCRAPE_MS` (far more
//! often than Prometheus's usual 15 s), and the scrapes' own time and size are reported.
//!
//! A gateway request here is a full dispatch: validate → render → admission → manifest →
//! prepare (durable) → begin CAS (durable) → send → stream → assemble → canonical commit
//! (durable) → answer. The direct request sends the same kind of body to the simulator and
//! reads the whole stream. Both are measured to the last byte of the answer.

use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Process(Child);
impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[&str]) -> (Process, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the turnstile binary runs");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .split_whitespace()
        .find(|word| word.starts_with("http://"))
        .unwrap()
        .to_owned();
    (Process(child), base)
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// ~45 words: with the envelope events, ~50 SSE events per reply.
fn reply_text() -> String {
    (0..45).map(|i| format!("word{i}")).collect::<Vec<_>>().join(" ")
}

async fn script(client: &reqwest::Client, sim: &str, model: &str, count: usize) {
    let replies: Vec<Value> = (0..count).map(|_| json!({"text": reply_text()})).collect();
    for chunk in replies.chunks(500) {
        client
            .post(format!("{sim}/sim/script"))
            .json(&json!({"model": model, "replies": chunk}))
            .send()
            .await
            .unwrap();
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

/// One request of either kind.
#[derive(Clone)]
enum Kind {
    Direct { sim: String },
    Gateway { gateway: String },
}

async fn one(client: &reqwest::Client, kind: &Kind, index: usize, phase: &str) -> Duration {
    let started = Instant::now();
    match kind {
        Kind::Direct { sim } => {
            let body = json!({"model": format!("direct-{phase}"), "max_tokens": 256, "stream": true,
                              "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello?"}]}]});
            let response = client
                .post(format!("{sim}/v1/messages"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let bytes = response.bytes().await.unwrap();
            assert!(bytes.windows(12).any(|w| w == b"message_stop"));
        }
        Kind::Gateway { gateway } => {
            let body = json!({"operation_id": format!("op-{phase}-{index}"), "stream": false,
                              "target": {"provider": "sim", "model": format!("gw-{phase}"), "adapter": "anthropic-messages@1"}});
            let response = client
                .post(format!("{gateway}/v1/conversations/c-{phase}-{index}/dispatch"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let answer: Value = response.json().await.unwrap();
            assert_eq!(answer["state"], "COMMITTED", "{answer}");
        }
    }
    started.elapsed()
}

async fn prepare_conversations(client: &reqwest::Client, gateway: &str, phase: &str, count: usize) {
    let mut tasks = Vec::new();
    for chunk in (0..count).collect::<Vec<_>>().chunks(count.div_ceil(8)) {
        let (client, gateway, phase, chunk) = (
            client.clone(),
            gateway.to_owned(),
            phase.to_owned(),
            chunk.to_vec(),
        );
        tasks.push(tokio::spawn(async move {
            for index in chunk {
                let id = format!("c-{phase}-{index}");
                client
                    .post(format!("{gateway}/v1/conversations"))
                    .json(&json!({"conversation_id": id}))
                    .send()
                    .await
                    .unwrap();
                let turn = json!({"expected_revision": 0, "turn": {"id": "t1", "role": "user",
                                  "blocks": [{"id": "u1", "kind": "text", "text": "Hello?"}]}});
                client
                    .post(format!("{gateway}/v1/conversations/{id}/turns"))
                    .json(&turn)
                    .send()
                    .await
                    .unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

/// Closed loop: `concurrency` workers, `requests` in all. Returns requests per second.
async fn saturate(
    client: &reqwest::Client,
    kind: Kind,
    phase: &str,
    requests: usize,
    concurrency: usize,
) -> f64 {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (client, kind, next, phase) = (client.clone(), kind.clone(), next.clone(), phase.to_owned());
        workers.push(tokio::spawn(async move {
            loop {
                let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if index >= requests {
                    return;
                }
                one(&client, &kind, index, &phase).await;
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    requests as f64 / started.elapsed().as_secs_f64()
}

/// Open loop at a fixed rate; returns sorted latencies.
async fn fixed_rate(
    client: &reqwest::Client,
    kind: Kind,
    phase: &str,
    requests: usize,
    rate: usize,
) -> Vec<Duration> {
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for index in 0..requests {
        tokio::time::sleep_until(started + interval * index as u32).await;
        let (client, kind, phase) = (client.clone(), kind.clone(), phase.to_owned());
        tasks.push(tokio::spawn(
            async move { one(&client, &kind, index, &phase).await },
        ));
    }
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.push(task.await.unwrap());
    }
    latencies.sort();
    latencies
}

fn main() {
    // `cargo test --benches` runs benches in test mode with --bench absent: do nothing then.
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }
    let requests = env_or("TURNSTILE_BENCH_REQUESTS", 2000);
    let concurrency = env_or("TURNSTILE_BENCH_CONCURRENCY", 16);
    let rate = env_or("TURNSTILE_BENCH_RATE", 200);
    let dir = tempfile::tempdir().unwrap();
    let (_sim, sim) = spawn(&["sim", "--listen", "127.0.0.1:0"]);
    let store = format!("sqlite:{}", dir.path().join("bench.db").display());
    let (_gateway, gateway) = spawn(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--store",
        &store,
        "--sim-url",
        &sim,
    ]);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(256)
            .build()
            .unwrap();
        let fixed = rate * 5;
        for phase in ["warm", "sat", "rate", "quiet", "scraped"] {
            let count = match phase {
                "warm" => 200,
                "sat" => requests,
                _ => fixed,
            };
            prepare_conversations(&client, &gateway, phase, count).await;
            script(&client, &sim, &format!("gw-{phase}"), count).await;
            script(&client, &sim, &format!("direct-{phase}"), count).await;
        }
        let direct = Kind::Direct { sim: sim.clone() };
        let through = Kind::Gateway {
            gateway: gateway.clone(),
        };
        saturate(&client, direct.clone(), "warm", 200, concurrency).await;
        saturate(&client, through.clone(), "warm", 200, concurrency).await;

        let direct_rps = saturate(&client, direct.clone(), "sat", requests, concurrency).await;
        let gateway_rps = saturate(&client, through.clone(), "sat", requests, concurrency).await;
        let direct_latency = fixed_rate(&client, direct, "rate", fixed, rate).await;
        let gateway_latency = fixed_rate(&client, through.clone(), "rate", fixed, rate).await;
        let quiet = fixed_rate(&client, through.clone(), "quiet", fixed, rate).await;
        let scrape_every = Duration::from_millis(env_or("TURNSTILE_BENCH_SCRAPE_MS", 100) as u64);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let scraper = {
            let (client, gateway, stop) = (client.clone(), gateway.clone(), stop.clone());
            tokio::spawn(async move {
                let mut scrapes = Vec::new();
                let mut bytes = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let started = Instant::now();
                    let page = client
                        .get(format!("{gateway}/metrics"))
                        .send()
                        .await
                        .unwrap()
                        .bytes()
                        .await
                        .unwrap();
                    scrapes.push(started.elapsed());
                    bytes = page.len();
                    tokio::time::sleep(scrape_every).await;
                }
                scrapes.sort();
                (scrapes, bytes)
            })
        };
        let scraped = fixed_rate(&client, through.clone(), "scraped", fixed, rate).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (scrapes, page_bytes) = scraper.await.unwrap();
        println!("saturation ({requests} requests, {concurrency} concurrent):");
        println!("  direct  {direct_rps:>8.0} req/s");
        println!(
            "  gateway {gateway_rps:>8.0} req/s  ({:.1}% of direct)",
            100.0 * gateway_rps / direct_rps
        );
        println!("fixed rate {rate} req/s for 5 s:");
        for (name, latencies) in [("direct ", &direct_latency), ("gateway", &gateway_latency)] {
            println!(
                "  {name} p50 {:>8.2} ms  p99 {:>8.2} ms",
                percentile(latencies, 0.50).as_secs_f64() * 1e3,
                percentile(latencies, 0.99).as_secs_f64() * 1e3
            );
        }
        println!(
            "  added p99 {:.2} ms",
            (percentile(&gateway_latency, 0.99).as_secs_f64()
                - percentile(&direct_latency, 0.99).as_secs_f64())
                * 1e3
        );
        println!("metric overhead, gateway at {rate} req/s for 5 s:");
        for (name, latencies) in [("not scraped", &quiet), ("scraped    ", &scraped)] {
            println!(
                "  {name} p50 {:>8.2} ms  p99 {:>8.2} ms",
                percentile(latencies, 0.50).as_secs_f64() * 1e3,
                percentile(latencies, 0.99).as_secs_f64() * 1e3
            );
        }
        println!(
            "  {} scrapes every {} ms: p50 {:.2} ms, p99 {:.2} ms, {page_bytes} bytes",
            scrapes.len(),
            scrape_every.as_millis(),
            percentile(&scrapes, 0.50).as_secs_f64() * 1e3,
            percentile(&scrapes, 0.99).as_secs_f64() * 1e3
        );
    });
}
