//! The driver against scripted store answers: recovery budgets come from the store, and the
//! pair assertions across the store boundary fire when the store answers something impossible.

use std::collections::HashSet;
use std::sync::Arc;
use turnstile_adapters::decode::StreamApi;
use turnstile_core::Digest;
use turnstile_core::dispatch::{DispatchState, ProviderRecovery, Timestamp, UnknownAttempt};
use turnstile_core::{Generation, Revision};
use turnstile_drive::*;

const LEASE_MS: u64 = 5_000;

fn target(body: &[u8], api: StreamApi, recovery: ProviderRecovery, label: &str) -> DriveTarget {
    DriveTarget {
        request_digest: Digest::of_bytes(body).as_str().to_owned(),
        request_bytes: Arc::new(body.to_vec()),
        api,
        recovery,
        label: label.to_owned(),
        decoder: turnstile_adapters::decode::DecoderOptions::VENDOR,
        timeouts: None,
    }
}

fn spec(recovery: ProviderRecovery, attempts_before: u64) -> DriveSpec {
    let bytes = br#"{"model":"m","messages":[]}"#.to_vec();
    let primary = target(&bytes, StreamApi::OpenAiResponses, recovery, "a/m");
    DriveSpec {
        basis: DispatchBasis {
            operation_id: "op-1".into(),
            revision: Revision(3),
            cancel_generation: 0,
            request_digest: primary.request_digest.clone(),
            request_bytes: primary.request_bytes.clone(),
        },
        targets: vec![primary],
        cooling: vec![false],
        last_target: None,
        toolset: None,
        call_ids_taken: HashSet::new(),
        lease_ms: LEASE_MS,
        attempts_before,
        timeouts: Timeouts::default(),
    }
}

fn unknown(generation: u64, lease_expires_at: u64) -> UnknownAttempt {
    UnknownAttempt {
        generation: Generation(generation),
        handle: Some("resp_1".into()),
        idempotency_key: "key-1".into(),
        lease_expires_at: Timestamp(lease_expires_at),
        provider_confirmed_ended: false,
    }
}

/// The driver's next store operation, skipping counts and client events.
fn next_store_op(drive: &mut Drive) -> Option<StoreOp> {
    while let Some(action) = drive.poll_action() {
        if let Action::Store(op) = action {
            return Some(op);
        }
    }
    None
}

const BOTH: ProviderRecovery = ProviderRecovery {
    resume_by_handle: true,
    honours_idempotency_key: true,
};

#[test]
fn a_fresh_recovery_budget_resumes_at_once() {
    let mut drive = Drive::recovered(
        spec(BOTH, 1),
        &unknown(1, 60_000),
        RecoverySpent::default(),
        0,
        Timestamp(1_000),
    );
    assert!(
        matches!(next_store_op(&mut drive), Some(StoreOp::Resume { .. })),
        "a resumable attempt with nothing spent is resumed"
    );
}

#[test]
fn resumes_spent_by_other_drivers_leave_the_replay_and_then_the_lease() {
    // Another replica already resumed this generation to the cap: replay with the same key.
    let resumes_spent = RecoverySpent {
        resumes: RESUMES_PER_GENERATION_MAX,
        replays: 0,
    };
    let mut drive = Drive::recovered(
        spec(BOTH, 1),
        &unknown(1, 60_000),
        resumes_spent,
        0,
        Timestamp(1_000),
    );
    assert!(
        matches!(next_store_op(&mut drive), Some(StoreOp::Replay { .. })),
        "resumes spent elsewhere: the driver replays instead"
    );
    // Both spent: nothing is sent or taken over before the old lease runs out.
    let all_spent = RecoverySpent {
        resumes: RESUMES_PER_GENERATION_MAX,
        replays: REPLAYS_PER_GENERATION_MAX,
    };
    let mut drive = Drive::recovered(spec(BOTH, 1), &unknown(1, 60_000), all_spent, 0, Timestamp(1_000));
    assert_eq!(
        next_store_op(&mut drive),
        None,
        "nothing before the lease runs out"
    );
    assert!(
        drive.poll_timeout().is_some_and(|at| at >= Timestamp(60_000)),
        "it waits for the old lease: {:?}",
        drive.poll_timeout()
    );
    drive.handle_timeout(Timestamp(60_001));
    // After the lease, before a new generation: the provider is asked about the response, and
    // one still in progress is cancelled; its word is what the rearm records.
    let asked = open_request(&mut drive);
    assert_eq!(
        asked.1,
        Request::Status {
            handle: "resp_1".into()
        }
    );
    answer(
        &mut drive,
        asked.0,
        60_002,
        br#"{"id":"resp_1","status":"in_progress"}"#,
    );
    let cancel = open_request(&mut drive);
    assert_eq!(
        cancel.1,
        Request::Cancel {
            handle: "resp_1".into()
        }
    );
    answer(
        &mut drive,
        cancel.0,
        60_003,
        br#"{"id":"resp_1","status":"cancelled"}"#,
    );
    assert_eq!(
        next_store_op(&mut drive),
        Some(StoreOp::AbandonAndRearm {
            generation: Generation(1),
            provider_ended: true,
            provider_word: Some("provider_cancelled".into()),
        }),
        "after the provider's word: abandon and a new generation"
    );
}

#[test]
fn a_probe_without_an_answer_falls_back_to_the_expired_lease() {
    let all_spent = RecoverySpent {
        resumes: RESUMES_PER_GENERATION_MAX,
        replays: REPLAYS_PER_GENERATION_MAX,
    };
    let mut drive = Drive::recovered(spec(BOTH, 1), &unknown(1, 60_000), all_spent, 0, Timestamp(1_000));
    drive.handle_timeout(Timestamp(60_001));
    let asked = open_request(&mut drive);
    drive.handle_head(Timestamp(60_002), asked.0, 400);
    drive.handle_end(Timestamp(60_003), asked.0, Ending::Clean);
    assert_eq!(
        next_store_op(&mut drive),
        Some(StoreOp::AbandonAndRearm {
            generation: Generation(1),
            provider_ended: false,
            provider_word: None,
        })
    );
}

/// The next connection the driver opens (no store operation may come first).
fn open_request(drive: &mut Drive) -> (ConnectionId, Request) {
    while let Some(action) = drive.poll_action() {
        match action {
            Action::Open {
                connection, request, ..
            } => return (connection, request),
            Action::Store(op) => panic!("a store operation before the probe: {op:?}"),
            _ => {}
        }
    }
    panic!("no connection opened");
}

fn answer(drive: &mut Drive, connection: ConnectionId, at: u64, body: &[u8]) {
    drive.handle_head(Timestamp(at), connection, 200);
    drive.handle_chunk(Timestamp(at), connection, body.to_vec());
    drive.handle_end(Timestamp(at), connection, Ending::Clean);
}

#[test]
fn a_begin_answered_with_an_old_generation_trips_the_pair_assertion() {
    trips("generations only grow", begin_answered_with_an_old_generation);
}

#[test]
fn an_attempt_read_back_with_another_key_trips_the_pair_assertion() {
    trips("another idempotency key", attempt_read_back_with_another_key);
}

/// `scenario` panics with a message containing `expected` (a pair assertion fired).
fn trips(expected: &str, scenario: fn()) {
    let outcome = std::panic::catch_unwind(scenario);
    let payload = outcome.expect_err("the pair assertion did not fire");
    let message = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|text| (*text).to_owned()))
        .unwrap_or_default();
    assert!(message.contains(expected), "another panic: {message}");
}

fn begin_answered_with_an_old_generation() {
    let none = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: false,
    };
    // Two attempts are already stored for this dispatch.
    let mut drive = Drive::new(spec(none, 2), Timestamp(1_000));
    assert!(matches!(next_store_op(&mut drive), Some(StoreOp::Begin { .. })));
    drive.handle_store(
        Timestamp(1_001),
        StoreResult::Began {
            generation: Generation(2),
            idempotency_key: "key-2".into(),
        },
    );
    while drive.poll_action().is_some() {}
}

fn attempt_read_back_with_another_key() {
    let only_replay = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: true,
    };
    let (mut drive, connection) = begun_and_sent(only_replay);
    // The connection breaks before a head: the driver reads the attempt back to decide.
    drive.handle_end(Timestamp(1_003), connection, Ending::Broken);
    let op = next_store_op(&mut drive);
    assert_eq!(op, Some(StoreOp::ReadAttempts));
    drive.handle_store(
        Timestamp(1_004),
        StoreResult::Attempts(vec![AttemptView {
            generation: Generation(1),
            handle: None,
            idempotency_key: "key-other".into(),
            lease_expires_at: Timestamp(6_001),
            spent: RecoverySpent::default(),
            target: 0,
        }]),
    );
    while drive.poll_action().is_some() {}
}

#[test]
fn blocks_under_a_handle_bound_to_another_manifest_go_to_the_quarantine_with_their_reason() {
    let none = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: false,
    };
    let (mut drive, connection) = begun_and_sent(none);
    drive.handle_head(Timestamp(1_003), connection, 200);
    let stream = concat!(
        "event: response.created\n",
        "data: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_other\",\"status\":\"in_progress\",\"output\":[]}}\n\n",
        "event: response.output_text.delta\n",
        "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"not ours\"}\n\n",
    );
    drive.handle_chunk(Timestamp(1_004), connection, stream.as_bytes().to_vec());
    let mut quarantined = None;
    while let Some(action) = drive.poll_action() {
        match action {
            Action::Store(StoreOp::BindHandle { handle, .. }) => {
                assert_eq!(handle, "resp_other");
                drive.handle_store(Timestamp(1_005), StoreResult::BindRefused);
            }
            Action::Store(StoreOp::Quarantine { reason, content, .. }) => {
                quarantined = Some((reason, content));
                drive.handle_store(Timestamp(1_006), StoreResult::Applied);
            }
            Action::Store(StoreOp::ReadAttempts) => drive.handle_store(
                Timestamp(1_006),
                StoreResult::Attempts(vec![AttemptView {
                    generation: Generation(1),
                    handle: None,
                    idempotency_key: "key-1".into(),
                    lease_expires_at: Timestamp(6_001),
                    spent: RecoverySpent::default(),
                    target: 0,
                }]),
            ),
            Action::Store(_) => drive.handle_store(Timestamp(1_006), StoreResult::Applied),
            _ => {}
        }
    }
    let (reason, content) = quarantined.expect("the foreign handle's material is quarantined");
    assert_eq!(reason, "foreign_handle");
    assert_eq!(content["handle"], "resp_other", "{content}");
    assert_eq!(content["generation"], 1, "{content}");
    assert!(
        content.to_string().contains("not ours"),
        "what arrived is kept: {content}"
    );
    // Another manifest's response is never asked about, cancelled or resumed by this dispatch.
    drive.handle_timeout(Timestamp(60_000));
    while let Some(action) = drive.poll_action() {
        match action {
            Action::Open { request, .. } => {
                panic!("a request about another manifest's response: {request:?}")
            }
            Action::Store(StoreOp::AbandonAndRearm { .. }) => break,
            Action::Store(_) => drive.handle_store(Timestamp(60_001), StoreResult::Applied),
            _ => {}
        }
    }
}

/// A fresh driver whose first attempt began (generation 1, key `key-1`) and was sent.
fn begun_and_sent(recovery: ProviderRecovery) -> (Drive, ConnectionId) {
    let mut drive = Drive::new(spec(recovery, 0), Timestamp(1_000));
    assert!(matches!(next_store_op(&mut drive), Some(StoreOp::Begin { .. })));
    drive.handle_store(
        Timestamp(1_001),
        StoreResult::Began {
            generation: Generation(1),
            idempotency_key: "key-1".into(),
        },
    );
    let mut connection = None;
    while let Some(action) = drive.poll_action() {
        match action {
            Action::Open { connection: id, .. } => connection = Some(id),
            Action::Store(_) => drive.handle_store(Timestamp(1_002), StoreResult::Applied),
            _ => {}
        }
    }
    (drive, connection.expect("opened"))
}

#[test]
fn a_commit_answered_at_another_revision_trips_the_pair_assertion() {
    trips("landed elsewhere", commit_answered_at_another_revision);
}

/// The simulator's Anthropic stream of a one-text reply ("Sunny in Paris.") under `handle`.
fn anthropic_reply(handle: &str) -> Vec<u8> {
    reply_of(turnstile_adapters::simulate::wire::Api::Anthropic, handle)
}

fn reply_of(api: turnstile_adapters::simulate::wire::Api, handle: &str) -> Vec<u8> {
    use turnstile_adapters::simulate::script::Reply;
    let reply = Reply {
        text: "Sunny in Paris.".into(),
        ..Reply::default()
    };
    turnstile_adapters::simulate::wire::frames(api, &reply, handle, "m", &[], 40)
        .into_iter()
        .flat_map(|frame| frame.bytes)
        .collect()
}

/// The basis answers revision 3, so its commit must land at 4; the store answers 9.
fn commit_answered_at_another_revision() {
    let none = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: false,
    };
    let mut spec = spec(none, 0);
    spec.targets[0].api = StreamApi::AnthropicMessages;
    let body = anthropic_reply("msg_1");
    let mut drive = Drive::new(spec, Timestamp(1_000));
    let mut at = 1_000;
    let mut fed = false;
    loop {
        at += 1;
        match drive.poll_action() {
            Some(Action::Store(StoreOp::Begin { .. })) => drive.handle_store(
                Timestamp(at),
                StoreResult::Began {
                    generation: Generation(1),
                    idempotency_key: "key-1".into(),
                },
            ),
            Some(Action::Store(StoreOp::Commit { .. })) => {
                drive.handle_store(
                    Timestamp(at),
                    StoreResult::Committed {
                        revision: Revision(9),
                    },
                );
            }
            Some(Action::Store(_)) => drive.handle_store(Timestamp(at), StoreResult::Applied),
            Some(Action::Open { connection, .. }) if !fed => {
                fed = true;
                answer(&mut drive, connection, at, &body);
            }
            Some(_) => {}
            None => break,
        }
    }
}

/// Every store operation of a dispatch whose attempts the provider answers with `statuses`
/// in turn (`None`: no connection), a target per attempt as the driver chose it.
fn begins_under_refusals(statuses: &[Option<u16>], targets: usize) -> (Vec<u32>, Vec<StoreOp>) {
    let none = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: false,
    };
    let mut spec = spec(none, 0);
    for index in 1..targets {
        let body = format!("{{\"model\":\"fallback-{index}\"}}");
        spec.targets.push(target(
            body.as_bytes(),
            StreamApi::AnthropicMessages,
            none,
            &format!("b/m{index}"),
        ));
        spec.cooling.push(false);
    }
    let mut drive = Drive::new(spec, Timestamp(1_000));
    let (mut begun, mut ops) = (Vec::new(), Vec::new());
    let mut statuses = statuses.iter();
    let mut generation = 0;
    let mut at = 1_000;
    while let Some(action) = drive.poll_action() {
        at += 1;
        match action {
            Action::Store(op) => {
                let answer = match &op {
                    StoreOp::Begin { target, .. } => {
                        begun.push(*target);
                        generation += 1;
                        StoreResult::Began {
                            generation: Generation(generation),
                            idempotency_key: format!("key-{generation}"),
                        }
                    }
                    _ => StoreResult::Applied,
                };
                ops.push(op);
                drive.handle_store(Timestamp(at), answer);
            }
            Action::Open {
                connection, target, ..
            } => {
                assert_eq!(
                    Some(&target),
                    begun.last(),
                    "the connection goes to the begun target"
                );
                match statuses.next() {
                    Some(Some(status)) => {
                        drive.handle_head(Timestamp(at), connection, *status);
                        drive.handle_end(Timestamp(at), connection, Ending::Clean);
                    }
                    Some(None) => drive.handle_end(Timestamp(at), connection, Ending::Unreachable),
                    None => return (begun, ops),
                }
            }
            _ => {}
        }
    }
    (begun, ops)
}

#[test]
fn a_refused_attempt_moves_to_the_next_target_and_a_request_fault_does_not() {
    // 429, then no connection, then the last target answers: targets 0, 1, 2 in order.
    let (begun, ops) = begins_under_refusals(&[Some(429), None], 3);
    assert_eq!(begun, vec![0, 1, 2]);
    // Each refused attempt is written FAILED with its cause and the dispatch PREPARED in one
    // write; no FAILED transition and no rearm of its own.
    let failed: Vec<&str> = ops
        .iter()
        .filter_map(|op| match op {
            StoreOp::FailOver { reason, .. } => Some(reason.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(failed, vec!["provider_status_429", "provider_unreachable"]);
    assert!(
        !ops.iter().any(|op| matches!(
            op,
            StoreOp::Transition {
                to: turnstile_core::dispatch::DispatchState::Failed,
                ..
            } | StoreOp::AbandonAndRearm { .. }
        )),
        "{ops:?}"
    );
    // A 400 is the request's own fault: no second begin. Nor without a next target.
    assert_eq!(begins_under_refusals(&[Some(400)], 2).0, vec![0]);
    assert_eq!(begins_under_refusals(&[Some(503)], 1).0, vec![0]);
    for status in [408, 409, 500, 502, 503, 504, 529] {
        assert_eq!(
            begins_under_refusals(&[Some(status)], 2).0,
            vec![0, 1],
            "status {status}"
        );
    }
    for status in [400, 401, 403, 404, 413, 422] {
        assert_eq!(
            begins_under_refusals(&[Some(status)], 2).0,
            vec![0],
            "status {status}"
        );
    }
}

/// Issue 21: on the happy path the commit carries SENT, STREAMING and the handle, and nothing
/// else is written between the begin and the commit. When the carried handle is another
/// manifest's, nothing commits, the turn goes to the quarantine log with reason
/// `foreign_handle`, and the held transitions are written, in order, before the attempt ends.
#[test]
fn the_commit_carries_sent_streaming_and_the_handle_and_a_foreign_one_is_quarantined() {
    let none = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: false,
    };
    use turnstile_adapters::simulate::wire::Api;
    // A handle is bound (and can be foreign) only where it is an identity, e.g. a provider that
    // deduplicates by our key. Elsewhere the commit records it without binding it: the answer
    // to a fresh send came on its own connection (issue 48, item 1).
    let idempotent = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: true,
    };
    for (api, wire, handle, recovery, foreign) in [
        (
            StreamApi::AnthropicMessages,
            Api::Anthropic,
            "msg_other",
            none,
            false,
        ),
        (StreamApi::OpenAiChat, Api::OpenAiChat, "chatcmpl-1", none, false),
        (
            StreamApi::AnthropicMessages,
            Api::Anthropic,
            "msg_other",
            idempotent,
            false,
        ),
        (
            StreamApi::AnthropicMessages,
            Api::Anthropic,
            "msg_other",
            idempotent,
            true,
        ),
    ] {
        let body = reply_of(wire, handle);
        let mut spec = spec(recovery, 0);
        spec.targets[0].api = api;
        let mut drive = Drive::begun(spec, Timestamp(1_000), 0, Generation(1), "key-1".into());
        let mut ops = Vec::new();
        let mut quarantined = None;
        let mut at = 1_000;
        let mut fed = false;
        loop {
            at += 1;
            match drive.poll_action() {
                Some(Action::Store(op)) => {
                    let result = match &op {
                        StoreOp::Commit {
                            from,
                            handle: carried,
                            bind,
                            ..
                        } => {
                            assert_eq!(*from, DispatchState::Dispatching, "{ops:?}");
                            assert_eq!(carried.as_deref(), Some(handle));
                            assert_eq!(*bind, recovery.honours_idempotency_key, "{api:?}");
                            if foreign {
                                StoreResult::BindRefused
                            } else {
                                StoreResult::Committed {
                                    revision: Revision(4),
                                }
                            }
                        }
                        StoreOp::Quarantine { reason, content, .. } => {
                            quarantined = Some((*reason, content.clone()));
                            StoreResult::Applied
                        }
                        StoreOp::ReadAttempts => StoreResult::Attempts(vec![AttemptView {
                            generation: Generation(1),
                            handle: None,
                            idempotency_key: "key-1".into(),
                            lease_expires_at: Timestamp(6_001),
                            spent: RecoverySpent::default(),
                            target: 0,
                        }]),
                        _ => StoreResult::Applied,
                    };
                    ops.push(op);
                    drive.handle_store(Timestamp(at), result);
                }
                Some(Action::Open { connection, .. }) if !fed => {
                    fed = true;
                    answer(&mut drive, connection, at, &body);
                }
                Some(_) => {}
                None => break,
            }
        }
        assert!(
            !ops.iter().any(|op| matches!(op, StoreOp::Begin { .. })),
            "the prepare began it: {ops:?}"
        );
        assert!(
            matches!(ops[0], StoreOp::Commit { .. }),
            "nothing is written before the commit: {ops:?}"
        );
        if !foreign {
            assert_eq!(ops.len(), 1, "{ops:?}");
            assert_eq!(drive.state(), DispatchState::Committed);
            continue;
        }
        let (reason, content) = quarantined.expect("the turn under another manifest's handle is quarantined");
        assert_eq!(reason, "foreign_handle");
        assert!(content.to_string().contains("Sunny in Paris."), "{content}");
        let transitions: Vec<(DispatchState, DispatchState)> = ops
            .iter()
            .filter_map(|op| match op {
                StoreOp::Transition { from, to, .. } => Some((*from, *to)),
                _ => None,
            })
            .collect();
        assert_eq!(
            &transitions[..3],
            [
                (DispatchState::Dispatching, DispatchState::Sent),
                (DispatchState::Sent, DispatchState::Streaming),
                (DispatchState::Streaming, DispatchState::Unknown),
            ],
            "{ops:?}"
        );
    }
}

#[test]
fn a_refusal_keeps_the_providers_own_words_in_each_apis_error_shape() {
    let says = |body: &str| refusal_message(Some(400), body.as_bytes());
    let expected = "the provider refused the request with HTTP 400: model \"gpt-9\" does not exist";
    // OpenAI, Anthropic, Gemini (an object, and the array some endpoints send), a plain
    // `{"message"}`, a bare string error, and text.
    for body in [
        r#"{"error": {"message": "model \"gpt-9\" does not exist", "type": "invalid_request_error"}}"#,
        r#"{"type": "error", "error": {"type": "invalid_request_error", "message": "model \"gpt-9\" does not exist"}}"#,
        r#"{"error": {"code": 400, "message": "model \"gpt-9\" does not exist", "status": "INVALID_ARGUMENT"}}"#,
        r#"[{"error": {"code": 400, "message": "model \"gpt-9\" does not exist", "status": "INVALID_ARGUMENT"}}]"#,
        r#"{"message": "model \"gpt-9\" does not exist"}"#,
        r#"{"error": "model \"gpt-9\" does not exist"}"#,
        "model \"gpt-9\" does not exist\n",
    ] {
        assert_eq!(says(body), expected, "{body}");
    }
    assert_eq!(
        says(""),
        "the provider refused the request with HTTP 400 and no message"
    );
    // A provider that echoes the credential does not pass it on; nor bidirectional controls.
    let echoed = says(
        r#"{"error": {"message": "Incorrect API key provided: sk-proj-AbC123xyz456. Header was 'Bearer sk-live-999888777666', key AIzaSyD-abcdefgh12345"}}"#,
    );
    assert!(
        !echoed.contains("AbC123") && !echoed.contains("999888") && !echoed.contains("abcdefgh"),
        "{echoed}"
    );
    assert!(
        echoed.contains("Incorrect API key provided: [redacted]."),
        "{echoed}"
    );
    assert!(!says(r#"{"message": "a\u202eb"}"#).contains('\u{202E}'));
    // Bounded, and cut on a character boundary.
    let long = format!("{{\"error\": {{\"message\": \"{}\"}}}}", "é".repeat(4_000));
    let message = says(&long);
    assert!(message.len() < 1_200, "{}", message.len());
    assert!(message.ends_with('…'));
}

/// Issue 48, item 13: a stream that sends only keep-alives (Anthropic's `ping`) after its last
/// event is stalled: the idle bound closes it as `idle_timeout`, as a silent stream of the
/// other three APIs, not whenever the upstream gives up (`cut_stream`).
#[test]
fn pings_do_not_keep_a_stalled_stream_alive_past_the_idle_bound() {
    let none = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: false,
    };
    let mut spec = spec(none, 0);
    spec.targets[0].api = StreamApi::AnthropicMessages;
    spec.timeouts.idle_ms = 1_000;
    let mut drive = Drive::new(spec, Timestamp(1_000));
    assert!(matches!(next_store_op(&mut drive), Some(StoreOp::Begin { .. })));
    drive.handle_store(
        Timestamp(1_001),
        StoreResult::Began {
            generation: Generation(1),
            idempotency_key: "key-1".into(),
        },
    );
    let mut connection = None;
    while let Some(action) = drive.poll_action() {
        match action {
            Action::Open { connection: id, .. } => connection = Some(id),
            Action::Store(_) => drive.handle_store(Timestamp(1_002), StoreResult::Applied),
            _ => {}
        }
    }
    let connection = connection.expect("opened");
    let start = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"m\",\"content\":[],\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n\
        event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n\
        event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Sunny\"}}\n\n";
    let mut closed = false;
    let mut reasons = Vec::new();
    let at = 2_021;
    let drain = |drive: &mut Drive, closed: &mut bool, reasons: &mut Vec<String>| {
        while let Some(action) = drive.poll_action() {
            match action {
                Action::Close { connection: id } if id == connection => *closed = true,
                Action::Store(op) => {
                    if let StoreOp::Transition {
                        reason: Some(reason), ..
                    } = &op
                    {
                        reasons.push(reason.clone());
                    }
                    drive.handle_store(Timestamp(at), StoreResult::Applied);
                }
                _ => {}
            }
        }
    };
    // As a pump does: each input, then the actions it leads to.
    drive.handle_head(Timestamp(1_010), connection, 200);
    drain(&mut drive, &mut closed, &mut reasons);
    drive.handle_chunk(Timestamp(1_020), connection, start.to_vec());
    drain(&mut drive, &mut closed, &mut reasons);
    // Pings every 400 ms after the last event.
    let ping = b"event: ping\ndata: {\"type\": \"ping\"}\n\n".to_vec();
    for ping_at in [1_420, 1_820] {
        drive.handle_chunk(Timestamp(ping_at), connection, ping.clone());
        drain(&mut drive, &mut closed, &mut reasons);
    }
    // The deadline is the last event's time plus the bound, whatever pings came since.
    assert_eq!(drive.poll_timeout(), Some(Timestamp(2_020)));
    drive.handle_timeout(Timestamp(2_021));
    drain(&mut drive, &mut closed, &mut reasons);
    assert!(closed, "the stalled connection is closed");
    assert!(
        reasons.iter().any(|reason| reason == "idle_timeout"),
        "{reasons:?}"
    );
}

/// Issue 48, item 11: each target's connection is bounded by its own provider's timeouts
/// (`DriveTarget::timeouts`), the spec's where it sets none. Two targets, idle bounds 1 s (the
/// spec's) and 3 s (its own): a stream stalled after its first text closes at its own
/// target's bound, not before, and as `idle_timeout`.
#[test]
fn each_target_closes_a_stalled_stream_at_its_own_idle_bound() {
    let none = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: false,
    };
    let two_targets = |cooling: Vec<bool>| {
        let mut spec = spec(none, 0);
        spec.timeouts.idle_ms = 1_000;
        spec.targets[0].api = StreamApi::AnthropicMessages;
        let mut own = target(
            br#"{"model":"fallback"}"#,
            StreamApi::AnthropicMessages,
            none,
            "b/m",
        );
        own.timeouts = Some(Timeouts {
            idle_ms: 3_000,
            ..spec.timeouts
        });
        spec.targets.push(own);
        spec.cooling = cooling;
        spec
    };
    // Target 0 first; then target 1, the first cooling down.
    assert_eq!(idle_close(two_targets(vec![false, false])), (0, 2_020));
    assert_eq!(idle_close(two_targets(vec![true, false])), (1, 4_020));
}

/// Drives `spec`'s first attempt to a head at 1 010 ms and one text event at 1 020 ms, then
/// only time passes: which target was opened, and when its connection closed.
fn idle_close(spec: DriveSpec) -> (u32, u64) {
    let mut drive = Drive::new(spec, Timestamp(1_000));
    let mut opened = None;
    let mut at = 1_000;
    while let Some(action) = drive.poll_action() {
        at += 1;
        match action {
            Action::Store(StoreOp::Begin { .. }) => drive.handle_store(
                Timestamp(at),
                StoreResult::Began {
                    generation: Generation(1),
                    idempotency_key: "key-1".into(),
                },
            ),
            Action::Store(_) => drive.handle_store(Timestamp(at), StoreResult::Applied),
            Action::Open {
                connection, target, ..
            } => opened = Some((connection, target)),
            _ => {}
        }
    }
    let (connection, target) = opened.expect("opened");
    let text = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"m\",\"content\":[],\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n\
        event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n\
        event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Sunny\"}}\n\n";
    let mut closed = false;
    let mut reasons = Vec::new();
    let mut drain = |drive: &mut Drive, now: u64, closed: &mut bool| {
        while let Some(action) = drive.poll_action() {
            match action {
                Action::Close { connection: id } if id == connection => *closed = true,
                Action::Store(op) => {
                    if let StoreOp::Transition {
                        reason: Some(reason), ..
                    } = &op
                    {
                        reasons.push(reason.clone());
                    }
                    drive.handle_store(Timestamp(now), StoreResult::Applied);
                }
                _ => {}
            }
        }
    };
    drive.handle_head(Timestamp(1_010), connection, 200);
    drain(&mut drive, 1_010, &mut closed);
    drive.handle_chunk(Timestamp(1_020), connection, text.to_vec());
    drain(&mut drive, 1_020, &mut closed);
    // Only time passes: each wake-up the driver asks for, until the connection closes (a
    // bounded number of them: lease renewals may come first).
    for _ in 0..32 {
        let wake = drive.poll_timeout().expect("a deadline while the stream is open");
        // Nothing closes it a millisecond before its deadline.
        drive.handle_timeout(Timestamp(wake.0 - 1));
        drain(&mut drive, wake.0 - 1, &mut closed);
        assert!(!closed, "closed before its bound, at {}", wake.0 - 1);
        drive.handle_timeout(wake);
        drain(&mut drive, wake.0, &mut closed);
        if closed {
            assert!(
                reasons.iter().any(|reason| reason == "idle_timeout"),
                "{reasons:?}"
            );
            return (target, wake.0);
        }
    }
    panic!("the stalled connection never closed");
}

/// Issue 48, item 5: a stream cut under the only driver that read it is confirmed over by that
/// driver (`connection_closed`), and the next generation begins at once; where the response
/// could still be read elsewhere (a provider that deduplicates by our key) the driver's word
/// is not enough and the lease decides.
#[test]
fn a_connection_closed_under_its_only_reader_is_over_without_waiting_for_the_lease() {
    for honours_idempotency_key in [false, true] {
        let recovery = ProviderRecovery {
            resume_by_handle: false,
            honours_idempotency_key,
        };
        let mut spec = spec(recovery, 0);
        spec.targets[0].api = StreamApi::AnthropicMessages;
        let mut drive = Drive::new(spec, Timestamp(1_000));
        assert!(matches!(next_store_op(&mut drive), Some(StoreOp::Begin { .. })));
        drive.handle_store(
            Timestamp(1_001),
            StoreResult::Began {
                generation: Generation(1),
                idempotency_key: "key-1".into(),
            },
        );
        let mut connection = None;
        let mut ops = Vec::new();
        let step =
            |drive: &mut Drive, at: u64, ops: &mut Vec<StoreOp>, connection: &mut Option<ConnectionId>| {
                while let Some(action) = drive.poll_action() {
                    match action {
                        Action::Open { connection: id, .. } => *connection = Some(id),
                        Action::Store(op) => {
                            let result = match &op {
                                StoreOp::ReadAttempts => StoreResult::Attempts(vec![AttemptView {
                                    generation: Generation(1),
                                    handle: None,
                                    idempotency_key: "key-1".into(),
                                    lease_expires_at: Timestamp(6_001),
                                    spent: RecoverySpent::default(),
                                    target: 0,
                                }]),
                                StoreOp::Begin { .. } => StoreResult::Began {
                                    generation: Generation(2),
                                    idempotency_key: "key-2".into(),
                                },
                                _ => StoreResult::Applied,
                            };
                            ops.push(op);
                            drive.handle_store(Timestamp(at), result);
                        }
                        _ => {}
                    }
                }
            };
        step(&mut drive, 1_002, &mut ops, &mut connection);
        let first = connection.take().expect("opened");
        let body = anthropic_reply("msg_1");
        drive.handle_head(Timestamp(1_010), first, 200);
        drive.handle_chunk(Timestamp(1_020), first, body[..body.len() / 2].to_vec());
        step(&mut drive, 1_020, &mut ops, &mut connection);
        drive.handle_end(Timestamp(1_030), first, Ending::Broken);
        step(&mut drive, 1_030, &mut ops, &mut connection);
        let abandoned = ops.iter().find_map(|op| match op {
            StoreOp::AbandonAndRearm {
                provider_ended,
                provider_word,
                ..
            } => Some((*provider_ended, provider_word.clone())),
            _ => None,
        });
        if honours_idempotency_key {
            // A replay under the same key could still bring that response back to someone:
            // the lease decides.
            assert_eq!(abandoned, None, "{ops:?}");
            assert!(
                !ops.iter().any(|op| matches!(op, StoreOp::Begin { .. })),
                "{ops:?}"
            );
            assert!(
                drive.poll_timeout().is_some_and(|at| at.0 >= 6_001),
                "waits for the lease"
            );
        } else {
            assert_eq!(
                abandoned,
                Some((true, Some("connection_closed".to_owned()))),
                "{ops:?}"
            );
            // At once, long before the lease (6,001) ran out: the next generation began.
            assert!(
                ops.iter()
                    .filter(|op| matches!(op, StoreOp::Begin { .. }))
                    .count()
                    == 1
                    && connection.is_some(),
                "{ops:?}"
            );
        }
    }
}
