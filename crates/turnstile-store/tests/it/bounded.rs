//! Bounded store waits (issue 49 item 4): a store whose tables another session holds locked
//! fails an operation with a typed error within its bound instead of waiting for the lock, the
//! failure is what [`Ledger::write_failing`] reports (readiness), and a write probe clears it
//! once the store takes writes again.

use crate::support::*;
use std::time::Duration;
use turnstile_store::*;

/// The harness's own bound on every store call here: far above the store's, so a pass is not
/// a race, and a store that waits for the lock fails the test instead of hanging it.
const HARNESS_BOUND: Duration = Duration::from_secs(60);

/// The bound the PostgreSQL ledger under test is opened with.
const STORE_TIMEOUT_MS: u64 = 300;

async fn bounded<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(HARNESS_BOUND, call)
        .await
        .unwrap_or_else(|_| panic!("{what}: the store was still waiting after {HARNESS_BOUND:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tables_locked_by_another_session_fail_reads_and_writes_typed_within_the_bound() {
    let place = place(Backend::Postgres, "bounded_postgres_locked_tables").await;
    let store = PgLedger::connect_with(
        &pg_url(),
        Some(&place.schema),
        2,
        StoreOptions {
            timeout_ms: STORE_TIMEOUT_MS,
        },
    )
    .await
    .expect("connect postgres");
    conversation_at_1(&store, "c").await;
    assert!(!store.write_failing());

    // Another session holds ACCESS EXCLUSIVE on the tables every operation here touches.
    let (locker, connection) = tokio_postgres::connect(&pg_url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let schema = &place.schema;
    locker
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE {schema}.conversations, {schema}.turns, {schema}.schema_migrations \
             IN ACCESS EXCLUSIVE MODE"
        ))
        .await
        .unwrap();

    let created = bounded("create", store.create_conversation("d", &tools(), at(2))).await;
    assert!(matches!(created, Err(StoreError::TimedOut(_))), "{created:?}");
    assert!(store.write_failing(), "a write that timed out is a failing write");
    let read = bounded("read", store.conversation("c")).await;
    assert!(matches!(read, Err(StoreError::TimedOut(_))), "{read:?}");
    let probe = bounded("probe", store.write_probe()).await;
    assert!(matches!(probe, Err(StoreError::TimedOut(_))), "{probe:?}");

    locker.batch_execute("ROLLBACK").await.unwrap();
    bounded("probe", store.write_probe())
        .await
        .expect("the probe writes once the lock is gone");
    assert!(!store.write_failing(), "a committed probe clears the failure");
    assert_eq!(
        bounded("create", store.create_conversation("d", &tools(), at(3)))
            .await
            .unwrap(),
        CreateOutcome::Created
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_write_lock_held_by_another_process_fails_a_write_typed_and_is_reported_until_a_probe_writes()
 {
    let place = place(Backend::Sqlite, "bounded_sqlite_write_lock").await;
    let store = SqliteLedger::open(place.sqlite_path(), Synchronous::Full).expect("open sqlite");
    conversation_at_1(&store, "c").await;
    assert!(!store.write_failing());

    let locker = rusqlite::Connection::open(place.sqlite_path()).unwrap();
    locker.execute_batch("BEGIN EXCLUSIVE").unwrap();
    // Waits out SQLITE_BUSY_TIMEOUT_MS, then fails.
    let created = bounded("create", store.create_conversation("d", &tools(), at(2))).await;
    assert!(
        matches!(created, Err(StoreError::Sqlite(_) | StoreError::CommitFailed(_))),
        "{created:?}"
    );
    assert!(store.write_failing(), "a write that failed is a failing write");
    // Reads go on (WAL): the store is reachable while its writes fail, as on a full disk.
    assert!(bounded("read", store.conversation("c")).await.unwrap().is_some());

    locker.execute_batch("ROLLBACK").unwrap();
    bounded("probe", store.write_probe())
        .await
        .expect("the probe writes once the lock is gone");
    assert!(!store.write_failing(), "a committed probe clears the failure");
}

/// Migrations are not bounded by `store_timeout_ms`: a replica starting while another holds the
/// migration lock waits for it (here past ten times its 100 ms store timeout, by the server's
/// own `waitstart`) and then opens, instead of failing its start at `lock_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_waiting_for_another_s_migration_is_not_cut_by_the_store_timeout() {
    /// `postgres.rs`'s `MIGRATION_LOCK_KEY` ("turnstil").
    const MIGRATION_LOCK_KEY: i64 = 0x7475_726e_7374_696c;
    let place = place(Backend::Postgres, "bounded_migration_wait").await;
    let (locker, connection) = tokio_postgres::connect(&pg_url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    locker
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_KEY])
        .await
        .unwrap();
    let (url, schema) = (pg_url(), place.schema.clone());
    let opening = tokio::spawn(async move {
        PgLedger::connect_with(&url, Some(&schema), 2, StoreOptions { timeout_ms: 100 }).await
    });
    // Bounded poll on the server's view: a backend has waited a second for the lock.
    let mut waited = false;
    for _ in 0..600 {
        let waiting = locker
            .query(
                "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                 AND waitstart < now() - interval '1 second'",
                &[],
            )
            .await
            .unwrap();
        if !waiting.is_empty() || opening.is_finished() {
            waited = !waiting.is_empty();
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    locker
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_KEY])
        .await
        .unwrap();
    let opened = bounded("open", opening).await.unwrap();
    assert!(opened.is_ok(), "{opened:?}");
    assert!(waited, "the opening never waited for the migration lock");
}
