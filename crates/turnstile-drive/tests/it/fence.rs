//! Issue 47: a lease is a promise its holder keeps. A driver stops on its own before the lease
//! it last renewed can run out (by its own clock, a fifth of the lease early): it closes its
//! provider connections, retracts its preview and leaves the attempt to recovery. A renewal
//! that fails is tried again soon and a store that answers in time lets the stream go on; a
//! refused renewal stops the driver at once; a begin answered after the fence sends nothing.

use std::collections::HashSet;
use std::sync::Arc;
use turnstile_adapters::decode::StreamApi;
use turnstile_core::Digest;
use turnstile_core::dispatch::{ProviderRecovery, Timestamp};
use turnstile_core::{Generation, Revision};
use turnstile_drive::*;

const LEASE_MS: u64 = 5_000;
/// The begin is asked for at this moment; with the margin the fence is at 1,000 + 4,000.
const BEGIN_AT: u64 = 1_000;
const FIRST_FENCE: u64 = BEGIN_AT + LEASE_MS - LEASE_MS / FENCE_MARGIN_DIVISOR;

fn spec() -> DriveSpec {
    let bytes = br#"{"model":"m","messages":[]}"#.to_vec();
    let target = DriveTarget {
        request_digest: Digest::of_bytes(&bytes).as_str().to_owned(),
        request_bytes: Arc::new(bytes),
        api: StreamApi::AnthropicMessages,
        recovery: ProviderRecovery {
            resume_by_handle: false,
            honours_idempotency_key: false,
        },
        label: "a/m".to_owned(),
        decoder: turnstile_adapters::decode::DecoderOptions::VENDOR,
        timeouts: None,
    };
    DriveSpec {
        basis: DispatchBasis {
            operation_id: "op-1".into(),
            revision: Revision(3),
            cancel_generation: 0,
            request_digest: target.request_digest.clone(),
            request_bytes: target.request_bytes.clone(),
        },
        targets: vec![target],
        cooling: vec![false],
        last_target: None,
        toolset: None,
        call_ids_taken: HashSet::new(),
        lease_ms: LEASE_MS,
        attempts_before: 0,
        // Production bounds: the attempt may outlive its lease many times over.
        timeouts: Timeouts::default(),
    }
}

const START: &[u8] = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"m\",\"content\":[],\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n\
event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n";

fn delta(text: &str) -> Vec<u8> {
    format!(
        "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"{text}\"}}}}\n\n"
    )
    .into_bytes()
}

/// What a pump saw while performing the driver's actions.
#[derive(Default)]
struct Seen {
    renewals: Vec<u64>,
    closed: bool,
    fenced: Vec<&'static str>,
    previews: Vec<(u64, String)>,
    retracts: Vec<String>,
    errors: Vec<String>,
    opened: u32,
    binds: u32,
}

/// How the store answers lease renewals.
#[derive(Clone, Copy)]
enum Renewals {
    Fail,
    FailOnceThenApply,
    Refuse,
}

struct Pump {
    drive: Drive,
    seen: Seen,
    renewals: Renewals,
    connection: Option<ConnectionId>,
}

impl Pump {
    fn begun() -> Pump {
        let mut pump = Pump {
            drive: Drive::new(spec(), Timestamp(BEGIN_AT)),
            seen: Seen::default(),
            renewals: Renewals::Fail,
            connection: None,
        };
        // The begin lands at once.
        match pump.drive.poll_action() {
            Some(Action::Store(StoreOp::Begin { .. })) => {}
            other => panic!("expected the begin, got {other:?}"),
        }
        pump.drive.handle_store(
            Timestamp(BEGIN_AT + 1),
            StoreResult::Began {
                generation: Generation(1),
                idempotency_key: "key-1".into(),
            },
        );
        pump.perform(BEGIN_AT + 1);
        pump
    }

    fn perform(&mut self, at: u64) {
        while let Some(action) = self.drive.poll_action() {
            match action {
                Action::Open { connection, .. } => {
                    self.seen.opened += 1;
                    self.connection = Some(connection);
                }
                Action::Close { connection } if Some(connection) == self.connection => {
                    self.seen.closed = true
                }
                Action::Store(StoreOp::RenewLease { .. }) => {
                    self.seen.renewals.push(at);
                    let result = match self.renewals {
                        Renewals::Fail => StoreResult::Failed("connection refused".into()),
                        Renewals::Refuse => StoreResult::Refused,
                        Renewals::FailOnceThenApply if self.seen.renewals.len() == 1 => {
                            StoreResult::Failed("connection refused".into())
                        }
                        Renewals::FailOnceThenApply => StoreResult::Applied,
                    };
                    self.drive.handle_store(Timestamp(at), result);
                }
                Action::Store(op) => {
                    if matches!(op, StoreOp::BindHandle { .. }) {
                        self.seen.binds += 1;
                    }
                    self.drive.handle_store(Timestamp(at), StoreResult::Applied)
                }
                Action::Emit(DriveEvent::Preview { delta, .. }) => self.seen.previews.push((at, delta)),
                Action::Emit(DriveEvent::Retract { reason, .. }) => self.seen.retracts.push(reason),
                Action::Emit(DriveEvent::Error { code, .. }) => self.seen.errors.push(code),
                Action::Count(Count::SelfFenced(reason)) => self.seen.fenced.push(reason),
                _ => {}
            }
        }
    }

    /// Stream one text delta every 100 ms from `from` to `to` (the timer fired whenever due,
    /// as a pump's select does), performing every action.
    fn stream(&mut self, from: u64, to: u64) {
        let connection = self.connection.expect("opened");
        let mut at = from;
        while at <= to && !self.drive.is_finished() {
            let mut fired = 0;
            while let Some(due) = self.drive.poll_timeout()
                && due.0 <= at
            {
                fired += 1;
                assert!(fired < 100, "the driver's timer at {} ms does not move", due.0);
                self.drive.handle_timeout(due);
                self.perform(due.0);
            }
            self.drive
                .handle_chunk(Timestamp(at), connection, delta(&format!("t{at} ")));
            self.perform(at);
            at += 100;
        }
    }

    fn head(&mut self) {
        let connection = self.connection.expect("opened");
        self.drive.handle_head(Timestamp(BEGIN_AT + 10), connection, 200);
        self.drive
            .handle_chunk(Timestamp(BEGIN_AT + 20), connection, START.to_vec());
        self.perform(BEGIN_AT + 20);
    }
}

#[test]
fn a_holder_whose_renewals_fail_stops_before_its_lease_ends_and_sends_no_preview_after() {
    let mut pump = Pump::begun();
    pump.head();
    // The store is gone from the first renewal on; the provider streams on for 20 s.
    pump.stream(BEGIN_AT + 100, BEGIN_AT + 20_000);
    assert_eq!(
        pump.seen.fenced,
        vec!["lease_ending"],
        "it fenced itself once, as lease_ending"
    );
    assert!(pump.seen.closed, "its provider connection is closed");
    assert!(pump.drive.fenced() && pump.drive.is_finished());
    // Renewed at half the lease, then tried again every twentieth of a lease until the fence.
    assert_eq!(pump.seen.renewals.first(), Some(&(BEGIN_AT + 1 + LEASE_MS / 2)));
    assert!(
        pump.seen.renewals.len() >= 3,
        "renewals tried: {:?}",
        pump.seen.renewals
    );
    let last_preview = pump.seen.previews.last().expect("previews before the fence").0;
    assert!(
        last_preview < FIRST_FENCE,
        "preview at {last_preview} ms, fence at {FIRST_FENCE} ms"
    );
    assert_eq!(pump.seen.retracts, vec!["lease_ending".to_owned()]);
    assert_eq!(pump.seen.opened, 1, "nothing sent again");
}

#[test]
fn a_store_that_answers_before_the_fence_lets_the_stream_go_on() {
    let mut pump = Pump::begun();
    pump.renewals = Renewals::FailOnceThenApply;
    pump.head();
    pump.stream(BEGIN_AT + 100, BEGIN_AT + 20_000);
    assert!(pump.seen.fenced.is_empty(), "fenced: {:?}", pump.seen.fenced);
    // The stream's id (`msg_1`) is no identity on this target (no resume, no deduplication):
    // it stays held for the commit to record, and is never bound when the renewals write the
    // held transitions (a server reusing its ids would make that a foreign handle).
    assert_eq!(pump.seen.binds, 0, "a handle that is no identity was bound");
    // A failed renewal decides nothing the client must hear of: no error mid-stream.
    assert!(pump.seen.errors.is_empty(), "errors: {:?}", pump.seen.errors);
    assert!(!pump.seen.closed);
    assert!(!pump.drive.is_finished());
    // The retry came a twentieth of a lease after the failure.
    assert_eq!(
        pump.seen.renewals[1] - pump.seen.renewals[0],
        LEASE_MS / 20,
        "{:?}",
        pump.seen.renewals
    );
    let last_preview = pump.seen.previews.last().expect("previews").0;
    assert!(
        last_preview > BEGIN_AT + 19_000,
        "the stream went on: last preview at {last_preview}"
    );
}

#[test]
fn a_refused_renewal_stops_the_holder_at_once() {
    let mut pump = Pump::begun();
    pump.renewals = Renewals::Refuse;
    pump.head();
    pump.stream(BEGIN_AT + 100, BEGIN_AT + 20_000);
    assert_eq!(pump.seen.fenced, vec!["lease_lost"]);
    assert!(pump.seen.closed);
    let first_renewal = pump.seen.renewals[0];
    assert_eq!(pump.seen.renewals.len(), 1);
    assert!(
        pump.seen.previews.iter().all(|(at, _)| *at <= first_renewal),
        "no preview after the refusal"
    );
    assert_eq!(pump.seen.retracts, vec!["lease_lost".to_owned()]);
}

#[test]
fn a_begin_answered_after_the_fence_sends_nothing() {
    let mut drive = Drive::new(spec(), Timestamp(BEGIN_AT));
    assert!(matches!(
        drive.poll_action(),
        Some(Action::Store(StoreOp::Begin { .. }))
    ));
    // The store took longer than the lease's margin allows to answer.
    drive.handle_store(
        Timestamp(FIRST_FENCE),
        StoreResult::Began {
            generation: Generation(1),
            idempotency_key: "key-1".into(),
        },
    );
    let mut opened = false;
    let mut fenced = Vec::new();
    while let Some(action) = drive.poll_action() {
        match action {
            Action::Open { .. } => opened = true,
            Action::Count(Count::SelfFenced(reason)) => fenced.push(reason),
            Action::Store(op) => panic!("a store operation past the fence: {op:?}"),
            _ => {}
        }
    }
    assert!(!opened, "nothing may go out past the fence");
    assert_eq!(fenced, vec!["lease_ending"]);
    assert!(drive.is_finished());
}

#[test]
fn the_fence_moves_with_each_renewal_that_lands_and_bounds_the_wait_for_the_store() {
    let mut pump = Pump::begun();
    pump.renewals = Renewals::FailOnceThenApply;
    assert_eq!(
        pump.drive.store_wait_deadline(),
        Some(Timestamp(FIRST_FENCE)),
        "an open connection waits for the store only until the fence"
    );
    pump.head();
    pump.stream(BEGIN_AT + 100, BEGIN_AT + 4_000);
    // The second renewal (the first landed) was asked for at `renewals[1]`.
    let landed = pump.seen.renewals[1];
    assert_eq!(
        pump.drive.store_wait_deadline(),
        Some(fence_deadline(Timestamp(landed), LEASE_MS))
    );
}

const STOP: &[u8] = b"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n\
event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":3}}\n\n\
event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";

/// Issue 49 item 6: past the drain timeout a shutting-down gateway hands each live dispatch
/// over. The driver stops as a self-fence does (`shutting_down`): its provider connection is
/// closed, its preview retracted, and nothing more is read, written or sent; the attempt is
/// left to recovery.
#[test]
fn a_hand_over_closes_the_provider_connection_retracts_and_does_nothing_more() {
    let mut pump = Pump::begun();
    pump.renewals = Renewals::FailOnceThenApply;
    pump.head();
    pump.stream(BEGIN_AT + 100, BEGIN_AT + 1_000);
    assert!(!pump.seen.previews.is_empty());
    pump.drive.handle_hand_over(Timestamp(BEGIN_AT + 1_050));
    pump.perform(BEGIN_AT + 1_050);
    assert_eq!(pump.seen.fenced, vec!["shutting_down"]);
    assert!(pump.seen.closed, "its provider connection is closed");
    assert_eq!(pump.seen.retracts, vec!["shutting_down".to_owned()]);
    assert!(pump.drive.stopped() && pump.drive.is_finished());
    // What still arrives from the provider is not read.
    let previews = pump.seen.previews.len();
    let connection = pump.connection.unwrap();
    pump.drive
        .handle_chunk(Timestamp(BEGIN_AT + 1_100), connection, delta("late "));
    pump.drive
        .handle_chunk(Timestamp(BEGIN_AT + 1_100), connection, STOP.to_vec());
    while let Some(action) = pump.drive.poll_action() {
        assert!(
            !matches!(action, Action::Store(_) | Action::Open { .. } | Action::Emit(_)),
            "after the hand-over: {action:?}"
        );
    }
    assert_eq!(pump.seen.previews.len(), previews);
    assert_eq!(pump.seen.opened, 1, "nothing sent again");
}

/// A dispatch that committed before the hand-over reached its driver keeps its outcome:
/// nothing is retracted after the commit.
#[test]
fn a_hand_over_after_the_commit_changes_nothing() {
    let mut pump = Pump::begun();
    pump.renewals = Renewals::FailOnceThenApply;
    pump.head();
    let connection = pump.connection.unwrap();
    pump.drive
        .handle_chunk(Timestamp(BEGIN_AT + 100), connection, delta("all "));
    pump.drive
        .handle_chunk(Timestamp(BEGIN_AT + 100), connection, STOP.to_vec());
    pump.drive
        .handle_end(Timestamp(BEGIN_AT + 110), connection, Ending::Clean);
    pump.drive.handle_hand_over(Timestamp(BEGIN_AT + 110));
    let mut committed = false;
    while let Some(action) = pump.drive.poll_action() {
        match action {
            Action::Store(StoreOp::Commit { .. }) => pump.drive.handle_store(
                Timestamp(BEGIN_AT + 120),
                StoreResult::Committed {
                    revision: Revision(4),
                },
            ),
            Action::Store(_) => pump
                .drive
                .handle_store(Timestamp(BEGIN_AT + 120), StoreResult::Applied),
            Action::Emit(DriveEvent::Committed { .. }) => committed = true,
            Action::Emit(DriveEvent::Retract { reason, .. }) => panic!("retracted: {reason}"),
            Action::Count(Count::SelfFenced(reason)) => panic!("fenced: {reason}"),
            _ => {}
        }
    }
    assert!(committed, "the commit went out");
    assert!(pump.drive.is_finished() && !pump.drive.stopped());
}

#[test]
fn a_prepare_that_began_the_attempt_too_long_ago_sends_nothing() {
    // The prepare asked for the lease at 1,000 (its own transaction began the attempt); the
    // driver reads the present before anything goes out: past the fence, nothing is sent.
    let mut drive = Drive::begun(spec(), Timestamp(BEGIN_AT), 0, Generation(1), "key-1".into());
    drive.handle_timeout(Timestamp(FIRST_FENCE));
    let mut opened = false;
    let mut fenced = Vec::new();
    while let Some(action) = drive.poll_action() {
        match action {
            Action::Open { .. } => opened = true,
            Action::Count(Count::SelfFenced(reason)) => fenced.push(reason),
            Action::Store(op) => panic!("a store operation past the fence: {op:?}"),
            _ => {}
        }
    }
    assert!(!opened, "nothing may go out past the fence");
    assert_eq!(fenced, vec!["lease_ending"]);
    // Read a moment before the fence, the request goes out.
    let mut drive = Drive::begun(spec(), Timestamp(BEGIN_AT), 0, Generation(1), "key-1".into());
    drive.handle_timeout(Timestamp(FIRST_FENCE - 1));
    let mut opened = false;
    while let Some(action) = drive.poll_action() {
        match action {
            Action::Open { .. } => opened = true,
            Action::Store(_) => drive.handle_store(Timestamp(FIRST_FENCE - 1), StoreResult::Applied),
            _ => {}
        }
    }
    assert!(opened);
}

#[test]
fn a_hand_over_before_the_first_action_sends_nothing() {
    // A driver started after the drain timeout passed (its request or a sweep was still in
    // flight): the hand-over comes before the prepared begin's send (review finding 3).
    let mut drive = Drive::begun(spec(), Timestamp(BEGIN_AT), 0, Generation(1), "key-1".into());
    drive.handle_hand_over(Timestamp(BEGIN_AT + 1));
    let mut fenced = Vec::new();
    while let Some(action) = drive.poll_action() {
        match action {
            Action::Open { .. } => panic!("a request went out after the hand-over"),
            Action::Count(Count::SelfFenced(reason)) => fenced.push(reason),
            Action::Store(op) => panic!("a store operation after the hand-over: {op:?}"),
            _ => {}
        }
    }
    assert_eq!(fenced, vec!["shutting_down"]);
    assert!(drive.is_finished());
}

#[test]
fn held_transitions_that_fail_with_a_renewal_are_held_again_and_the_commit_lands() {
    // The store is unreachable for the first renewal's round: the held SENT and STREAMING
    // it flushes fail with it. A store back before the fence loses nothing: they are written
    // with the next write, and the commit lands (the old driver dropped the failed SENT, had
    // STREAMING refused from the wrong state, and stopped).
    use turnstile_core::dispatch::DispatchState as S;
    let outage = (BEGIN_AT + LEASE_MS / 2)..(BEGIN_AT + LEASE_MS / 2 + 100);
    let mut drive = Drive::new(spec(), Timestamp(BEGIN_AT));
    let mut stored = S::Prepared;
    let mut committed = false;
    let mut connection = None;
    let mut perform = |drive: &mut Drive,
                       at: u64,
                       committed: &mut bool,
                       connection: &mut Option<ConnectionId>| {
        while let Some(action) = drive.poll_action() {
            let answer = match action {
                Action::Open { connection: id, .. } => {
                    *connection = Some(id);
                    continue;
                }
                Action::Emit(DriveEvent::Committed { .. }) => {
                    *committed = true;
                    continue;
                }
                Action::Store(_) if outage.contains(&at) => StoreResult::Failed("connection refused".into()),
                Action::Store(StoreOp::Begin { .. }) => {
                    stored = S::Dispatching;
                    StoreResult::Began {
                        generation: Generation(1),
                        idempotency_key: "key-1".into(),
                    }
                }
                Action::Store(StoreOp::Transition { from, to, .. }) if from == stored => {
                    stored = to;
                    StoreResult::Applied
                }
                Action::Store(StoreOp::Transition { .. }) => StoreResult::Refused,
                Action::Store(StoreOp::Commit { from, .. }) if from == stored => {
                    stored = S::Committed;
                    StoreResult::Committed {
                        revision: Revision(4),
                    }
                }
                Action::Store(StoreOp::Commit { .. }) => StoreResult::Refused,
                Action::Store(_) => StoreResult::Applied,
                _ => continue,
            };
            drive.handle_store(Timestamp(at), answer);
        }
    };
    perform(&mut drive, BEGIN_AT, &mut committed, &mut connection);
    let id = connection.expect("opened");
    drive.handle_head(Timestamp(BEGIN_AT + 10), id, 200);
    drive.handle_chunk(Timestamp(BEGIN_AT + 20), id, START.to_vec());
    perform(&mut drive, BEGIN_AT + 20, &mut committed, &mut connection);
    // Timers fire through the outage and after it, text keeps coming.
    let mut at = BEGIN_AT + 100;
    while at < BEGIN_AT + 3_500 {
        while let Some(due) = drive.poll_timeout()
            && due.0 <= at
        {
            drive.handle_timeout(due);
            perform(&mut drive, due.0, &mut committed, &mut connection);
        }
        drive.handle_chunk(Timestamp(at), id, delta("more "));
        perform(&mut drive, at, &mut committed, &mut connection);
        at += 50;
    }
    drive.handle_chunk(Timestamp(at), id, STOP.to_vec());
    drive.handle_end(Timestamp(at), id, Ending::Clean);
    perform(&mut drive, at, &mut committed, &mut connection);
    assert!(!drive.fenced(), "the outage was shorter than the margin");
    assert!(committed, "the commit landed");
}
