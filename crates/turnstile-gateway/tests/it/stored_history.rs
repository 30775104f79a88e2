//! Issue 49 item 7: a changed byte in stored history is refused, never sent. A stored turn's
//! bytes are changed behind the gateway's back (SQLite through its file, PostgreSQL through a
//! session of its own); the next dispatch of that conversation, whether its history is kept in
//! memory (only the turns since are read) or read whole, answers 500 `stored_history_corrupt`,
//! counts it in `turnstile_stored_history_corrupt_total`, and the provider receives nothing.

use crate::serve::{Gateway, conversation_with_question, named, pg_url, run_id, sqlite};
use crate::sim::SimProcess;
use serde_json::json;

const CORRUPT: &str = "turnstile_stored_history_corrupt_total";

/// Change "4057" into "9057" in the stored turn of `conversation_id` at `revision`.
fn alter_stored_turn(store: &str, conversation_id: &str, revision: i64) {
    let sql =
        "UPDATE turns SET turn = replace(turn, '4057', '9057') WHERE conversation_id = $1 AND revision = $2";
    let changed = if let Some(path) = store.strip_prefix("sqlite:") {
        let connection = rusqlite::Connection::open(path).unwrap();
        connection
            .busy_timeout(std::time::Duration::from_secs(10))
            .unwrap();
        connection
            .execute(
                &sql.replace('$', "?"),
                rusqlite::params![conversation_id, revision],
            )
            .unwrap() as u64
    } else {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (client, connection) = tokio_postgres::connect(store, tokio_postgres::NoTls)
                .await
                .unwrap();
            let driver = tokio::spawn(connection);
            let changed = client.execute(sql, &[&conversation_id, &revision]).await.unwrap();
            drop(client);
            let _ = driver.await;
            changed
        })
    };
    assert_eq!(
        changed, 1,
        "{store}: the turn at revision {revision} of {conversation_id}"
    );
}

/// Append a user turn that mentions the figure the test changes.
fn append_revenue(gateway: &Gateway, id: &str, expected_revision: u64, turn_id: &str) {
    let (status, body) = gateway.post(
        &format!("/v1/conversations/{id}/turns"),
        json!({"expected_revision": expected_revision, "turn": {"id": turn_id, "role": "user",
               "blocks": [{"id": format!("{turn_id}-b"), "kind": "text", "text": "And the revenue was 4057?"}]}}),
    );
    assert_eq!((status, body), (200, json!({"revision": expected_revision + 1})));
}

/// The dispatch is refused with `stored_history_corrupt` before anything is prepared or sent.
fn assert_refused(gateway: &Gateway, sim: &SimProcess, id: &str, operation: &str, model: &str, what: &str) {
    let sent_before = sim.requests().len();
    let corrupt_before = gateway.metric(CORRUPT);
    let (status, events) = gateway.dispatch_raw(id, operation, "openai-chat@1", model);
    assert_eq!(status, 500, "{what}: {events:?}");
    assert_eq!(
        events[0].1["error"]["code"], "stored_history_corrupt",
        "{what}: {events:?}"
    );
    assert_eq!(gateway.metric(CORRUPT), corrupt_before + 1.0, "{what}: counted");
    assert_eq!(
        sim.requests().len(),
        sent_before,
        "{what}: nothing reached the provider"
    );
    let view = gateway.get(&format!("/v1/dispatches/{operation}"));
    assert_eq!(
        view["error"]["code"], "not_found",
        "{what}: no dispatch was prepared: {view}"
    );
}

#[test]
fn a_changed_byte_in_a_stored_turn_refuses_the_dispatch_and_sends_nothing_on_both_stores() {
    let url = pg_url();
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let pg_dir = tempfile::tempdir().unwrap();
    let run = run_id();
    let sqlite_store = sqlite(&dir);
    for (name, store, gateway) in [
        (
            "sqlite",
            sqlite_store.as_str(),
            Gateway::start(&dir, &sqlite_store, &sim, ""),
        ),
        ("postgres", url.as_str(), Gateway::start(&pg_dir, &url, &sim, "")),
    ] {
        assert_eq!(gateway.metric(CORRUPT), 0.0, "{name}: the series exists at zero");
        let model = format!("m-{run}-{name}");

        // A kept history: a first dispatch reads and keeps it, then a turn is appended and
        // changed in the store; the next dispatch reads only that turn and refuses it.
        let kept = format!("c-corrupt-kept-{run}-{name}");
        conversation_with_question(&gateway, &kept);
        sim.script(&model, json!([{"text": "Sunny in both."}]));
        let events = gateway.dispatch(&kept, &format!("op-{kept}-1"), "openai-chat@1", &model);
        assert_eq!(named(&events, "committed").len(), 1, "{name}: {events:?}");
        append_revenue(&gateway, &kept, 2, "t3");
        // Unchanged, the committed assistant turn and the new one pass the check.
        let events = gateway.dispatch(&kept, &format!("op-{kept}-2"), "openai-chat@1", &model);
        assert_eq!(named(&events, "committed").len(), 1, "{name}: {events:?}");
        append_revenue(&gateway, &kept, 4, "t5");
        alter_stored_turn(store, &kept, 5);
        assert_refused(
            &gateway,
            &sim,
            &kept,
            &format!("op-{kept}-3"),
            &model,
            &format!("{name} kept"),
        );
        // The kept history was dropped with the refusal: read whole, it is refused again.
        assert_refused(
            &gateway,
            &sim,
            &kept,
            &format!("op-{kept}-4"),
            &model,
            &format!("{name} again"),
        );

        // A history read whole (never dispatched before), changed in an older turn.
        let whole = format!("c-corrupt-whole-{run}-{name}");
        conversation_with_question(&gateway, &whole);
        append_revenue(&gateway, &whole, 1, "t2");
        sim.script(&model, json!([{"text": "Noted."}]));
        alter_stored_turn(store, &whole, 2);
        assert_refused(
            &gateway,
            &sim,
            &whole,
            &format!("op-{whole}-1"),
            &model,
            &format!("{name} whole"),
        );
        assert_eq!(gateway.metric(CORRUPT), 3.0, "{name}");
    }
}
