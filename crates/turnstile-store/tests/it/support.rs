//! Shared fixtures: opening a real store of either kind, manifests, turns, invariant checks.

use serde_json::{Value, json};
use std::ops::Deref;
use std::path::PathBuf;
use turnstile_core::digest::Digest;
use turnstile_core::manifest::{DispatchManifest, MANIFEST_FORMAT_V1, ManifestBody};
use turnstile_core::{Generation, Revision};
use turnstile_store::*;

/// Environment variable with the PostgreSQL URL (set by `.ci/run`).
pub const PG_URL_VAR: &str = "TURNSTILE_PG_URL";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// A real store with its fault injector.
pub enum Store {
    Sqlite(SqliteLedger),
    Postgres(PgLedger),
}

impl Store {
    pub fn faults(&self) -> &FaultInjector {
        match self {
            Store::Sqlite(ledger) => ledger.faults(),
            Store::Postgres(ledger) => ledger.faults(),
        }
    }
}

impl Deref for Store {
    type Target = dyn Ledger;
    fn deref(&self) -> &(dyn Ledger + 'static) {
        match self {
            Store::Sqlite(ledger) => ledger,
            Store::Postgres(ledger) => ledger,
        }
    }
}

/// Where one test's store lives; keeps the temporary directory alive.
pub struct Place {
    pub backend: Backend,
    pub dir: tempfile::TempDir,
    pub schema: String,
}

impl Place {
    pub fn sqlite_path(&self) -> PathBuf {
        self.dir.path().join("ledger.db")
    }
}

pub fn pg_url() -> String {
    match std::env::var(PG_URL_VAR) {
        Ok(url) if !url.is_empty() => url,
        _ => panic!(
            "{PG_URL_VAR} is not set: the PostgreSQL half of the store conformance suite needs a running \
             PostgreSQL (see .ci/run and README: e.g. postgres://postgres@127.0.0.1:55432/turnstile_test). \
             It never skips."
        ),
    }
}

/// A fresh, empty place for test `name`.
pub async fn place(backend: Backend, name: &str) -> Place {
    let dir = tempfile::tempdir().expect("temporary directory");
    // PostgreSQL identifiers stop at 63 bytes; test names are longer sentences.
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(name, &mut hasher);
    let schema = format!(
        "t_{:016x}_{}",
        std::hash::Hasher::finish(&hasher),
        std::process::id()
    );
    if backend == Backend::Postgres {
        let (client, connection) = tokio_postgres::connect(&pg_url(), tokio_postgres::NoTls)
            .await
            .unwrap_or_else(|error| panic!("cannot connect to {PG_URL_VAR}: {error}"));
        tokio::spawn(connection);
        client
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .await
            .expect("drop old schema");
    }
    Place { backend, dir, schema }
}

/// Open one replica of the store at `place` (each call: its own connection / pool).
pub async fn open_at(place: &Place, pool_size: usize) -> Store {
    match place.backend {
        Backend::Sqlite => {
            Store::Sqlite(SqliteLedger::open(place.sqlite_path(), Synchronous::Full).expect("open sqlite"))
        }
        Backend::Postgres => Store::Postgres(
            PgLedger::connect(&pg_url(), Some(&place.schema), pool_size)
                .await
                .expect("connect postgres"),
        ),
    }
}

pub async fn open_fresh(backend: Backend, name: &str) -> (Place, Store) {
    let place = place(backend, name).await;
    let store = open_at(&place, 8).await;
    (place, store)
}

pub fn at(ms: u64) -> Timestamp {
    Timestamp(ms)
}

pub fn tools() -> Value {
    json!([{"name": "get_weather", "input_schema": {"type": "object"}}])
}

pub fn user_turn(id: &str) -> Value {
    json!({"id": id, "role": "user", "blocks": [{"id": format!("{id}-b"), "kind": "text", "text": "Weather?"}]})
}

/// An assistant turn with `calls` tool calls; ids derived from `tag` so they are unique.
pub fn assistant_turn(tag: &str, calls: usize) -> Value {
    let mut blocks = vec![json!({"id": format!("{tag}-t"), "kind": "text", "text": "Checking."})];
    for index in 0..calls {
        blocks.push(json!({
            "id": format!("{tag}-c{index}"),
            "kind": "tool_call",
            "call_id": format!("{tag}-call-{index}"),
            "tool": "get_weather",
            "arguments": format!("{{\"city\":\"c{index}\"}}"),
        }));
    }
    json!({"id": format!("{tag}-turn"), "role": "assistant", "blocks": blocks})
}

pub fn request_bytes(operation_id: &str) -> Vec<u8> {
    format!("{{\"model\":\"m\",\"op\":\"{operation_id}\"}}").into_bytes()
}

pub fn manifest(
    operation_id: &str,
    conversation_id: &str,
    revision: u64,
    model: &str,
) -> (DispatchManifest, Vec<u8>) {
    let bytes = request_bytes(operation_id);
    let zero = Digest::of_bytes(b"");
    let body = ManifestBody {
        format: MANIFEST_FORMAT_V1.into(),
        operation_id: operation_id.into(),
        conversation_id: conversation_id.into(),
        conversation_revision: Revision(revision),
        sequence_digest: zero.clone(),
        adapter: "sim@1".into(),
        adapter_digest: zero.clone(),
        provider: "sim".into(),
        model: model.into(),
        toolset_digest: zero.clone(),
        policy_digest: zero,
        max_output_tokens: 256,
        prompt_tokens: 10,
        request_digest: Digest::of_bytes(&bytes),
    };
    (body.seal(), bytes)
}

/// Begin the first attempt with the prepare (`prepare_and_begin`): replica-a, a 5 s lease,
/// the primary target.
pub fn begin_at_once() -> BeginAtOnce {
    BeginAtOnce {
        holder: "replica-a".into(),
        lease_ms: 5_000,
        target: 0,
    }
}

pub fn lease(holder: &str, until: u64) -> Lease {
    Lease {
        holder: holder.into(),
        expires_at: Timestamp(until),
    }
}

/// A conversation with one user turn (revision 1).
pub async fn conversation_at_1(store: &dyn Ledger, conversation_id: &str) {
    assert_eq!(
        store
            .create_conversation(conversation_id, &tools(), at(1))
            .await
            .unwrap(),
        CreateOutcome::Created
    );
    assert_eq!(
        store
            .append_turn(
                conversation_id,
                Revision(0),
                &user_turn(&format!("{conversation_id}-u1")),
                at(2)
            )
            .await
            .unwrap(),
        AppendOutcome::Appended {
            revision: Revision(1)
        }
    );
}

/// Prepare + begin; the generation.
pub async fn prepared_and_begun(
    store: &dyn Ledger,
    operation_id: &str,
    conversation_id: &str,
    revision: u64,
) -> Generation {
    let (manifest, bytes) = manifest(operation_id, conversation_id, revision, "m");
    let PrepareOutcome::Created(record) = store.prepare(&manifest, &bytes, at(10)).await.unwrap() else {
        panic!("prepare {operation_id} did not create");
    };
    match store
        .begin_attempt(
            operation_id,
            BeginExpect {
                revision: record.revision,
                cancel_generation: record.cancel_generation,
                target: 0,
            },
            &lease("replica-a", 5_000),
            at(11),
        )
        .await
        .unwrap()
    {
        BeginOutcome::Began { generation, .. } => generation,
        other => panic!("begin {operation_id}: {other:?}"),
    }
}

/// Prepare and begin the first attempt at once (`prepare_and_begin`, [`begin_at_once`]); the
/// generation. Panics unless the dispatch was created and begun.
pub async fn began_at_once(
    store: &dyn Ledger,
    operation_id: &str,
    conversation_id: &str,
    revision: u64,
    now: u64,
) -> Generation {
    let (manifest, bytes) = manifest(operation_id, conversation_id, revision, "m");
    let (prepared, began) = store
        .prepare_and_begin(&manifest, &bytes, None, &[], &begin_at_once(), at(now))
        .await
        .unwrap();
    assert!(matches!(prepared, PrepareOutcome::Created(_)), "{prepared:?}");
    match began {
        Some(BeginOutcome::Began { generation, .. }) => generation,
        other => panic!("begin {operation_id}: {other:?}"),
    }
}

/// Commit `turn` as the turn after `revision` from DISPATCHING (SENT and STREAMING carried),
/// with the handle the attempt saw, if any; the store's answer.
pub async fn commit_from_dispatching(
    store: &dyn Ledger,
    operation_id: &str,
    generation: Generation,
    revision: u64,
    turn: &Value,
    handle: Option<&str>,
    now: u64,
) -> CommitOutcome {
    let carried = Carried {
        from: DispatchState::Dispatching,
        handle: handle.map(str::to_owned),
        bind: true,
        evidence: Vec::new(),
    };
    store
        .commit_carrying(
            operation_id,
            generation,
            Revision(revision),
            turn,
            None,
            &carried,
            at(now),
        )
        .await
        .unwrap()
}

/// DISPATCHING → SENT → STREAMING.
pub async fn to_streaming(store: &dyn Ledger, operation_id: &str, generation: Generation) {
    for (from, to) in [
        (DispatchState::Dispatching, DispatchState::Sent),
        (DispatchState::Sent, DispatchState::Streaming),
    ] {
        assert_eq!(
            store
                .transition(operation_id, generation, from, to, at(12))
                .await
                .unwrap(),
            TransitionOutcome::Applied
        );
    }
}

/// Invariants that must hold in any reachable ledger state: at most one canonical turn per
/// revision, revisions contiguous, the tool-call ledger equals the tool calls of committed
/// assistant turns, every COMMITTED dispatch's turn is in history.
pub async fn check_invariants(store: &dyn Ledger, conversation_ids: &[String]) {
    let ledger = store.tool_calls(None).await.unwrap();
    let mut ledger_ids: Vec<(String, String)> = ledger
        .iter()
        .map(|call| (call.conversation_id.clone(), call.call_id.clone()))
        .collect();
    ledger_ids.sort();
    let mut history_ids = Vec::new();
    for conversation_id in conversation_ids {
        let Some(document) = store.conversation(conversation_id).await.unwrap() else {
            continue;
        };
        let turns = document["turns"].as_array().unwrap();
        assert_eq!(
            turns.len() as u64,
            document["revision"].as_u64().unwrap(),
            "revisions are contiguous"
        );
        for (index, turn) in turns.iter().enumerate() {
            assert_eq!(
                turn["revision"].as_u64().unwrap(),
                index as u64 + 1,
                "one turn per revision"
            );
            if turn["role"] == "assistant" {
                for block in turn["blocks"].as_array().unwrap() {
                    if block["kind"] == "tool_call" {
                        history_ids.push((
                            conversation_id.clone(),
                            block["call_id"].as_str().unwrap().to_owned(),
                        ));
                    }
                }
            }
        }
        let document = serde_json::to_vec(&document).unwrap();
        let conversation = turnstile_core::parse::conversation_from_slice(&document).unwrap();
        assert!(
            !matches!(
                turnstile_core::validate(&conversation),
                turnstile_core::Verdict::Rejected(_)
            ),
            "committed history is legal"
        );
    }
    history_ids.sort();
    assert_eq!(
        ledger_ids, history_ids,
        "tool-call ledger = tool calls of committed turns"
    );
}

/// Poll the listing (bounded, 10 s) until the call's state is no longer `claimed` (its lease ran
/// out by the store's clock, or it moved on): how tests wait for an expiry without sleeping for it.
pub async fn wait_until_not_claimed(
    store: &dyn Ledger,
    conversation_id: &str,
    call_id: &str,
) -> ToolCallState {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let state = store
            .tool_calls(None)
            .await
            .unwrap()
            .into_iter()
            .find(|call| call.conversation_id == conversation_id && call.call_id == call_id)
            .map(|call| call.state);
        match state {
            Some(ToolCallState::Claimed) => {}
            Some(state) => return state,
            None => panic!("{conversation_id}/{call_id} is not in the ledger"),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{conversation_id}/{call_id} still claimed after 10 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}
