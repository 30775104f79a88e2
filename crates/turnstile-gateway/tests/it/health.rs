//! `/healthz`, `/readyz` and `/livez` while the store hangs or its writes fail (issue 49 items 4
//! and 7), and bounded store waits seen from the API: a store whose tables another session
//! holds locked answers every request 503 `store_unavailable` within `store_timeout_ms`, and the
//! health views answer within `health_timeout_ms`, instead of all waiting for the lock.

use crate::serve::{Gateway, client, pg_url, run_id, sqlite};
use serde_json::{Value, json};
use std::time::Duration;

/// (status, JSON body) of `GET path`.
fn get(gateway: &Gateway, path: &str) -> (u16, Value) {
    let response = client()
        .get(format!("{}{path}", gateway.base))
        .send()
        .unwrap_or_else(|error| panic!("GET {path} got no answer: {error}"));
    let status = response.status().as_u16();
    (status, response.json().unwrap_or(Value::Null))
}

/// Poll `GET path` (at most 200 times, 25 ms apart) until it answers `status`.
fn eventually(gateway: &Gateway, path: &str, status: u16) -> Value {
    let mut last = Value::Null;
    for _ in 0..200 {
        let (seen, body) = get(gateway, path);
        if seen == status {
            return body;
        }
        last = body;
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("{path} never answered {status}; last {last}");
}

/// Another session's lock on a SQLite ledger (a second process's `BEGIN EXCLUSIVE`): every write
/// fails after the busy timeout while reads go on, as on a full disk. `/healthz` still says ok
/// (the store is reachable); `/readyz` says not ready, writes failing, until a write succeeds
/// again, which its own probe finds once the lock is gone (no traffic needed).
#[test]
fn readiness_reports_failing_writes_that_healthz_does_not_and_recovers_by_its_probe() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(&dir, &sqlite(&dir), None, "health_timeout_ms = 500").unwrap();
    let (status, _) = gateway.post("/v1/conversations", json!({"conversation_id": "c"}));
    assert_eq!(status, 201);
    let (status, body) = get(&gateway, "/readyz");
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (body["status"].as_str(), body["writes"].as_str()),
        (Some("ready"), Some("ok"))
    );

    let locker = rusqlite::Connection::open(dir.path().join("turnstile.db")).unwrap();
    locker.execute_batch("BEGIN EXCLUSIVE").unwrap();
    // Waits out SQLite's busy timeout, then fails typed.
    let (status, body) = gateway.post("/v1/conversations", json!({"conversation_id": "d"}));
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "store_unavailable", "{body}");
    let (status, body) = get(&gateway, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["status"], "not_ready", "{body}");
    assert_eq!(
        (body["store"].as_str(), body["writes"].as_str()),
        (Some("reachable"), Some("failing"))
    );
    assert_eq!(body["error"]["code"], "store_unavailable", "{body}");
    let (status, body) = get(&gateway, "/healthz");
    assert_eq!(
        (status, body["store"].as_str()),
        (200, Some("reachable")),
        "{body}"
    );
    let (status, _) = get(&gateway, "/livez");
    assert_eq!(status, 200);

    locker.execute_batch("ROLLBACK").unwrap();
    drop(locker);
    let body = eventually(&gateway, "/readyz", 200);
    assert_eq!(body["writes"], "ok", "{body}");
    let (status, _) = gateway.post("/v1/conversations", json!({"conversation_id": "d"}));
    assert_eq!(status, 201);
}

/// A runtime and a PostgreSQL session of the test's own, beside the gateway's.
struct PgSession {
    runtime: tokio::runtime::Runtime,
    client: tokio_postgres::Client,
}

impl PgSession {
    fn open() -> PgSession {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let client = runtime.block_on(async {
            let (client, connection) = tokio_postgres::connect(&pg_url(), tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(connection);
            client
        });
        PgSession { runtime, client }
    }

    fn run(&self, sql: &str) {
        self.runtime
            .block_on(self.client.batch_execute(sql))
            .unwrap_or_else(|error| panic!("{sql}: {error}"));
    }

    fn tables(&self, schema: &str) -> Vec<String> {
        self.runtime
            .block_on(self.client.query(
                "SELECT tablename FROM pg_tables WHERE schemaname = $1",
                &[&schema],
            ))
            .unwrap()
            .iter()
            .map(|row| format!("{schema}.{}", row.get::<_, String>(0)))
            .collect()
    }
}

/// Every table of the gateway's PostgreSQL schema locked `ACCESS EXCLUSIVE` by another session
/// (the fault probes waited 25–40 s, as long as the lock was held, for every request and
/// `/healthz`): reads, writes and `/healthz` answer 503 within their bounds, and everything
/// answers again once the lock is gone.
#[test]
fn postgresql_tables_locked_by_another_session_get_bounded_503s_and_health_answers_in_time() {
    let session = PgSession::open();
    let schema = format!("health_{}", run_id());
    session.run(&format!("CREATE SCHEMA {schema}"));
    let separator = if pg_url().contains('?') { '&' } else { '?' };
    let url = format!("{}{separator}options=-c%20search_path%3D{schema}", pg_url());
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(
        &dir,
        &url,
        None,
        "store_timeout_ms = 500\nhealth_timeout_ms = 500",
    )
    .unwrap();
    let (status, _) = gateway.post("/v1/conversations", json!({"conversation_id": "c"}));
    assert_eq!(status, 201);
    let tables = session.tables(&schema);
    assert!(
        tables.iter().any(|table| table.ends_with(".conversations")),
        "{tables:?}"
    );

    session.run(&format!(
        "BEGIN; LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
        tables.join(", ")
    ));
    let (status, body) = gateway.post("/v1/conversations", json!({"conversation_id": "d"}));
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("store_unavailable")),
        "{body}"
    );
    let (status, body) = get(&gateway, "/v1/conversations/c");
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("store_unavailable")),
        "{body}"
    );
    let (status, body) = get(&gateway, "/healthz");
    assert_eq!(
        (status, body["store"].as_str()),
        (503, Some("unreachable")),
        "{body}"
    );
    let (status, body) = get(&gateway, "/readyz");
    assert_eq!(
        (status, body["status"].as_str()),
        (503, Some("not_ready")),
        "{body}"
    );
    let (status, _) = get(&gateway, "/livez");
    assert_eq!(status, 200);

    session.run("ROLLBACK");
    eventually(&gateway, "/healthz", 200);
    let body = eventually(&gateway, "/readyz", 200);
    assert_eq!(body["writes"], "ok", "{body}");
    let (status, _) = gateway.post("/v1/conversations", json!({"conversation_id": "d"}));
    assert_eq!(status, 201);
    drop(gateway);
    session.run(&format!("DROP SCHEMA {schema} CASCADE"));
}
