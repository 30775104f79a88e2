//! Full dispatch lifecycles per second: prepare → begin (DISPATCHING) → bind handle → SENT →
//! STREAMING → canonical commit of an assistant turn with 2 tool calls (6 durable
//! transactions), on SQLite with `synchronous=FULL` and on PostgreSQL with fsync on, with one
//! writer and with many concurrent conversations (group commit), beside the floor of the same
//! database measured in the same run: a bare single-row INSERT + COMMIT loop.
//!
//! Run: `cargo bench -p turnstile-store --bench lifecycle` (PostgreSQL cases need
//! `TURNSTILE_PG_URL`; without it they are left out and the run says so). One criterion
//! "element" is one lifecycle (or one floor transaction), so `thrpt` is lifecycles/s.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use turnstile_core::digest::Digest;
use turnstile_core::manifest::{DispatchManifest, MANIFEST_FORMAT_V1, ManifestBody};
use turnstile_core::{Generation, Revision};
use turnstile_store::*;

/// Concurrent conversations in the "concurrent" cases.
const CONCURRENCY: usize = 64;
/// A deeper queue for SQLite's group commit.
const CONCURRENCY_DEEP: usize = 256;
/// PostgreSQL pool size for the concurrent cases.
const PG_POOL: usize = 32;

static RUN: AtomicU64 = AtomicU64::new(0);

struct Prepared {
    conversation_id: String,
    manifest: DispatchManifest,
    bytes: Vec<u8>,
    turn: Value,
}

fn prepared(tag: &str) -> Prepared {
    let conversation_id = format!("c-{tag}");
    let bytes = format!("{{\"model\":\"m\",\"messages\":[{{\"role\":\"user\",\"content\":\"{tag}\"}}]}}")
        .into_bytes();
    let zero = Digest::of_bytes(b"");
    let manifest = ManifestBody {
        format: MANIFEST_FORMAT_V1.into(),
        operation_id: format!("op-{tag}"),
        conversation_id: conversation_id.clone(),
        conversation_revision: Revision(1),
        sequence_digest: zero.clone(),
        adapter: "sim@1".into(),
        adapter_digest: zero.clone(),
        provider: "sim".into(),
        model: "m".into(),
        toolset_digest: zero.clone(),
        policy_digest: zero,
        max_output_tokens: 256,
        prompt_tokens: 12,
        request_digest: Digest::of_bytes(&bytes),
    }
    .seal();
    let turn = json!({"id": format!("a-{tag}"), "role": "assistant", "blocks": [
        {"id": format!("a-{tag}-0"), "kind": "text", "text": "Checking both."},
        {"id": format!("a-{tag}-1"), "kind": "tool_call", "call_id": format!("call-{tag}-1"), "tool": "get_weather",
         "arguments": "{\"city\":\"Paris\"}"},
        {"id": format!("a-{tag}-2"), "kind": "tool_call", "call_id": format!("call-{tag}-2"), "tool": "get_weather",
         "arguments": "{\"city\":\"Tokyo\"}"},
    ]});
    Prepared {
        conversation_id,
        manifest,
        bytes,
        turn,
    }
}

fn now() -> Timestamp {
    Timestamp(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64,
    )
}

async fn lifecycle(store: &dyn Ledger, work: &Prepared) {
    let now = now();
    let operation_id = work.manifest.body.operation_id.as_str();
    let PrepareOutcome::Created(record) = store.prepare(&work.manifest, &work.bytes, now).await.unwrap()
    else {
        panic!("prepare");
    };
    let expect = BeginExpect {
        revision: record.revision,
        cancel_generation: record.cancel_generation,
        target: 0,
    };
    let lease = Lease {
        holder: "bench".into(),
        expires_at: Timestamp(now.0 + 5_000),
    };
    let BeginOutcome::Began { generation, .. } = store
        .begin_attempt(operation_id, expect, &lease, now)
        .await
        .unwrap()
    else {
        panic!("begin");
    };
    assert_eq!(generation, Generation(1));
    let handle = format!("resp-{operation_id}");
    assert_eq!(
        store
            .bind_handle(operation_id, generation, &handle, now)
            .await
            .unwrap(),
        BindOutcome::Bound
    );
    for (from, to) in [
        (DispatchState::Dispatching, DispatchState::Sent),
        (DispatchState::Sent, DispatchState::Streaming),
    ] {
        assert_eq!(
            store
                .transition(operation_id, generation, from, to, now)
                .await
                .unwrap(),
            TransitionOutcome::Applied
        );
    }
    let outcome = store
        .commit(operation_id, generation, Revision(1), &work.turn, now)
        .await
        .unwrap();
    assert!(matches!(outcome, CommitOutcome::Committed { .. }), "{outcome:?}");
}

/// Untimed: conversations at revision 1 and their prepared work, created concurrently.
async fn setup(store: &Arc<dyn Ledger>, count: u64) -> Arc<Vec<Prepared>> {
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let work: Vec<Prepared> = (0..count)
        .map(|index| prepared(&format!("{run}-{index}")))
        .collect();
    let work = Arc::new(work);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..CONCURRENCY_DEEP {
        let (store, work, next) = (store.clone(), work.clone(), next.clone());
        tasks.spawn(async move {
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = work.get(index) else { break };
                let tools = json!([{"name": "get_weather", "input_schema": {"type": "object"}}]);
                store.create_conversation(&item.conversation_id, &tools, now()).await.unwrap();
                let user = json!({"id": format!("u-{}", item.conversation_id), "role": "user",
                    "blocks": [{"id": format!("ub-{}", item.conversation_id), "kind": "text", "text": "Weather?"}]});
                let outcome = store.append_turn(&item.conversation_id, Revision(0), &user, now()).await.unwrap();
                assert_eq!(outcome, AppendOutcome::Appended { revision: Revision(1) });
            }
        });
    }
    while let Some(result) = tasks.join_next().await {
        result.unwrap();
    }
    work
}

async fn timed_lifecycles(store: Arc<dyn Ledger>, iters: u64, concurrency: usize) -> Duration {
    let work = setup(&store, iters).await;
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (store, work, next) = (store.clone(), work.clone(), next.clone());
        tasks.spawn(async move {
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = work.get(index) else { break };
                lifecycle(&*store, item).await;
            }
        });
    }
    while let Some(result) = tasks.join_next().await {
        result.unwrap();
    }
    started.elapsed()
}

fn sqlite_floor(path: &std::path::Path, iters: u64) -> Duration {
    let connection = rusqlite::Connection::open(path).unwrap();
    connection
        .execute_batch(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; \
             CREATE TABLE IF NOT EXISTS bench_floor (id INTEGER PRIMARY KEY, payload TEXT NOT NULL)",
        )
        .unwrap();
    let started = Instant::now();
    for _ in 0..iters {
        connection
            .execute("INSERT INTO bench_floor (payload) VALUES (?1)", ["x".repeat(200)])
            .unwrap();
    }
    started.elapsed()
}

async fn pg_floor(url: &str, schema: &str, iters: u64, concurrency: usize) -> Duration {
    let mut clients = Vec::new();
    for _ in 0..concurrency {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        client
            .batch_execute(&format!("SET search_path = {schema}"))
            .await
            .unwrap();
        clients.push(client);
    }
    clients[0]
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS bench_floor (id BIGSERIAL PRIMARY KEY, payload TEXT NOT NULL)",
        )
        .await
        .unwrap();
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for client in clients {
        let next = next.clone();
        tasks.spawn(async move {
            let statement = client
                .prepare("INSERT INTO bench_floor (payload) VALUES ($1)")
                .await
                .unwrap();
            let payload = "x".repeat(200);
            while next.fetch_add(1, Ordering::Relaxed) < iters {
                client.execute(&statement, &[&payload]).await.unwrap();
            }
        });
    }
    while let Some(result) = tasks.join_next().await {
        result.unwrap();
    }
    started.elapsed()
}

fn benches(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bench.db");
    let sqlite: Arc<dyn Ledger> = Arc::new(SqliteLedger::open(&path, Synchronous::Full).unwrap());

    let mut group = c.benchmark_group("lifecycle");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(6));

    group.bench_function("sqlite_full/floor_insert_commit", |b| {
        b.iter_custom(|iters| sqlite_floor(&path, iters))
    });
    group.bench_function("sqlite_full/single_writer", |b| {
        b.to_async(&runtime)
            .iter_custom(|iters| timed_lifecycles(sqlite.clone(), iters, 1))
    });
    group.bench_function(format!("sqlite_full/concurrent_{CONCURRENCY}"), |b| {
        b.to_async(&runtime)
            .iter_custom(|iters| timed_lifecycles(sqlite.clone(), iters, CONCURRENCY))
    });

    group.bench_function(format!("sqlite_full/concurrent_{CONCURRENCY_DEEP}"), |b| {
        b.to_async(&runtime)
            .iter_custom(|iters| timed_lifecycles(sqlite.clone(), iters, CONCURRENCY_DEEP))
    });

    // For the NORMAL trade-off only (not durable on power loss): how much of the FULL figure
    // is fsync and how much is CPU.
    let normal_path = dir.path().join("bench-normal.db");
    let normal: Arc<dyn Ledger> = Arc::new(SqliteLedger::open(&normal_path, Synchronous::Normal).unwrap());
    group.bench_function(format!("sqlite_normal/concurrent_{CONCURRENCY_DEEP}"), |b| {
        b.to_async(&runtime)
            .iter_custom(|iters| timed_lifecycles(normal.clone(), iters, CONCURRENCY_DEEP))
    });

    match std::env::var("TURNSTILE_PG_URL") {
        Ok(url) if !url.is_empty() => {
            let schema = format!("bench_{}", std::process::id());
            let postgres: Arc<dyn Ledger> = Arc::new(
                runtime
                    .block_on(PgLedger::connect(&url, Some(&schema), PG_POOL))
                    .unwrap(),
            );
            group.bench_function("postgres/floor_insert_commit", |b| {
                b.to_async(&runtime)
                    .iter_custom(|iters| pg_floor(&url, &schema, iters, 1))
            });
            group.bench_function(
                format!("postgres/floor_insert_commit_concurrent_{PG_POOL}"),
                |b| {
                    b.to_async(&runtime)
                        .iter_custom(|iters| pg_floor(&url, &schema, iters, PG_POOL))
                },
            );
            group.bench_function("postgres/single_writer", |b| {
                b.to_async(&runtime)
                    .iter_custom(|iters| timed_lifecycles(postgres.clone(), iters, 1))
            });
            group.bench_function(format!("postgres/concurrent_{CONCURRENCY}"), |b| {
                b.to_async(&runtime)
                    .iter_custom(|iters| timed_lifecycles(postgres.clone(), iters, CONCURRENCY))
            });
        }
        _ => eprintln!(
            "TURNSTILE_PG_URL is not set: the PostgreSQL lifecycle benchmarks are left out of this run"
        ),
    }
    group.finish();
}

criterion_group!(lifecycle_benches, benches);
criterion_main!(lifecycle_benches);
