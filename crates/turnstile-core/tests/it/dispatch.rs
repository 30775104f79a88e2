//! The sans-IO dispatch state machine: effects in order, the acceptance point, stale inputs,
//! recovery decisions.

use proptest::prelude::*;
use serde_json::json;
use turnstile_core::dispatch::*;
use turnstile_core::{Generation, Revision};

const DIGEST: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000000";

fn machine() -> DispatchMachine {
    DispatchMachine::new(
        Prepared {
            revision: Revision(3),
            cancel_generation: 0,
            request_digest: DIGEST.into(),
        },
        LEASE_MS_DEFAULT,
    )
}

fn drain(machine: &mut DispatchMachine) -> Vec<Effect> {
    std::iter::from_fn(|| machine.poll_effect()).collect()
}

fn began(generation: u64) -> StoreAnswer {
    StoreAnswer::Began {
        generation: Generation(generation),
        idempotency_key: format!("key-{generation}"),
    }
}

fn turn() -> serde_json::Value {
    json!({"id": "a", "role": "assistant", "blocks": [{"id": "b", "kind": "text", "text": "hi"}]})
}

fn is_send(effect: &Effect) -> bool {
    matches!(effect, Effect::Send { .. })
}

#[test]
fn start_asks_for_the_begin_write_and_sends_nothing_yet() {
    let mut machine = machine();
    assert_eq!(machine.start(Timestamp(1_000)), Handled::Accepted);
    let effects = drain(&mut machine);
    assert_eq!(
        effects,
        vec![Effect::Persist(Write::Begin {
            expected_revision: Revision(3),
            expected_cancel_generation: 0,
            lease_expires_at: Timestamp(1_000 + LEASE_MS_DEFAULT),
        })]
    );
    assert_eq!(machine.state(), DispatchState::Prepared);
}

#[test]
fn send_follows_the_acknowledged_dispatching_write_with_the_stored_bytes_digest() {
    let mut machine = machine();
    let _ = machine.start(Timestamp(0));
    let _ = drain(&mut machine);
    assert_eq!(machine.handle_store(Timestamp(1), began(1)), Handled::Accepted);
    let effects = drain(&mut machine);
    assert_eq!(machine.state(), DispatchState::Dispatching);
    assert_eq!(
        effects.last(),
        Some(&Effect::Send {
            generation: Generation(1),
            idempotency_key: "key-1".into(),
            request_digest: DIGEST.into(),
        })
    );
}

#[test]
fn a_refused_begin_never_sends() {
    let mut machine = machine();
    let _ = machine.start(Timestamp(0));
    let _ = drain(&mut machine);
    assert_eq!(
        machine.handle_store(Timestamp(1), StoreAnswer::BeginRefused),
        Handled::Accepted
    );
    let effects = drain(&mut machine);
    assert!(!effects.iter().any(is_send));
    assert_eq!(machine.state(), DispatchState::Prepared);
}

#[test]
fn a_full_lifecycle_persists_each_transition_then_commits_and_exposes_tool_calls() {
    let mut machine = machine();
    let _ = machine.start(Timestamp(0));
    let _ = drain(&mut machine);
    let _ = machine.handle_store(Timestamp(1), began(1));
    let _ = drain(&mut machine);
    let generation = Generation(1);
    assert_eq!(
        machine.handle_provider(Timestamp(2), generation, ProviderInput::Accepted),
        Handled::Accepted
    );
    assert_eq!(
        machine.handle_provider(Timestamp(2), generation, ProviderInput::Handle("resp_1".into())),
        Handled::Accepted
    );
    assert_eq!(
        machine.handle_provider(Timestamp(3), generation, ProviderInput::FirstEvent),
        Handled::Accepted
    );
    let effects = drain(&mut machine);
    let persisted: Vec<_> = effects
        .iter()
        .filter_map(|effect| match effect {
            Effect::Persist(Write::Transition { from, to, .. }) => Some((*from, *to)),
            _ => None,
        })
        .collect();
    assert_eq!(
        persisted,
        vec![
            (DispatchState::Dispatching, DispatchState::Sent),
            (DispatchState::Sent, DispatchState::Streaming)
        ]
    );
    assert!(effects.contains(&Effect::BindHandle {
        generation,
        handle: "resp_1".into()
    }));
    let _ = machine.handle_provider(
        Timestamp(4),
        generation,
        ProviderInput::Completed { turn: turn() },
    );
    assert_eq!(
        drain(&mut machine),
        vec![Effect::Persist(Write::Commit {
            generation,
            expected_revision: Revision(3),
            turn: turn(),
        })]
    );
    let _ = machine.handle_store(
        Timestamp(5),
        StoreAnswer::Committed {
            revision: Revision(4),
        },
    );
    let effects = drain(&mut machine);
    assert_eq!(machine.state(), DispatchState::Committed);
    assert!(effects.contains(&Effect::Emit(ClientEvent::Committed {
        revision: Revision(4)
    })));
    assert_eq!(
        effects.last(),
        Some(&Effect::ExposeToolCalls {
            revision: Revision(4)
        })
    );
}

#[test]
fn a_turn_from_another_generation_goes_to_quarantine_and_is_ignored() {
    let mut machine = machine();
    let _ = machine.start(Timestamp(0));
    let _ = machine.handle_store(Timestamp(1), began(2));
    let _ = machine.handle_provider(Timestamp(2), Generation(2), ProviderInput::FirstEvent);
    let _ = drain(&mut machine);
    let handled = machine.handle_provider(
        Timestamp(3),
        Generation(1),
        ProviderInput::Completed { turn: turn() },
    );
    assert_eq!(handled, Handled::Ignored(IgnoreReason::ForeignGeneration));
    assert_eq!(
        drain(&mut machine),
        vec![Effect::Quarantine {
            generation: Generation(1),
            reason: QuarantineReason::ForeignGeneration,
            content: turn(),
        }]
    );
    assert_eq!(machine.ignored_total(), 1);
    assert_eq!(machine.state(), DispatchState::Streaming);
}

#[test]
fn a_duplicated_store_answer_is_ignored_and_counted() {
    let mut machine = machine();
    let _ = machine.start(Timestamp(0));
    let _ = machine.handle_store(Timestamp(1), began(1));
    let _ = drain(&mut machine);
    assert_eq!(
        machine.handle_store(Timestamp(2), began(1)),
        Handled::Ignored(IgnoreReason::UnexpectedAnswer)
    );
    assert!(drain(&mut machine).is_empty());
    assert_eq!(machine.ignored_total(), 1);
}

#[test]
fn an_interrupted_stream_becomes_unknown_and_retracts_the_preview() {
    let mut machine = machine();
    let _ = machine.start(Timestamp(0));
    let _ = machine.handle_store(Timestamp(1), began(1));
    let _ = machine.handle_provider(Timestamp(2), Generation(1), ProviderInput::FirstEvent);
    let _ = drain(&mut machine);
    let _ = machine.handle_provider(Timestamp(3), Generation(1), ProviderInput::Interrupted);
    let effects = drain(&mut machine);
    assert_eq!(machine.state(), DispatchState::Unknown);
    assert!(effects.contains(&Effect::Emit(ClientEvent::Retract {
        generation: Generation(1),
        reason: "interrupted"
    })));
    // A completed turn after that is quarantined, never committed.
    let _ = machine.handle_provider(
        Timestamp(4),
        Generation(1),
        ProviderInput::Completed { turn: turn() },
    );
    let effects = drain(&mut machine);
    assert!(matches!(
        effects.as_slice(),
        [Effect::Quarantine {
            reason: QuarantineReason::Late,
            ..
        }]
    ));
}

#[test]
fn a_refused_commit_retracts_and_abandons() {
    let mut machine = machine();
    let _ = machine.start(Timestamp(0));
    let _ = machine.handle_store(Timestamp(1), began(1));
    let _ = machine.handle_provider(Timestamp(2), Generation(1), ProviderInput::FirstEvent);
    let _ = machine.handle_provider(
        Timestamp(3),
        Generation(1),
        ProviderInput::Completed { turn: turn() },
    );
    let _ = drain(&mut machine);
    let _ = machine.handle_store(Timestamp(4), StoreAnswer::CommitRefused);
    assert_eq!(machine.state(), DispatchState::Abandoned);
    assert!(drain(&mut machine).contains(&Effect::Emit(ClientEvent::Retract {
        generation: Generation(1),
        reason: "commit_refused"
    })));
}

#[test]
fn the_lease_is_renewed_with_the_generation_as_fencing_token() {
    let mut machine = machine();
    let _ = machine.start(Timestamp(0));
    let _ = machine.handle_store(Timestamp(0), began(7));
    let _ = drain(&mut machine);
    let at = machine.poll_timeout().unwrap();
    assert_eq!(at, Timestamp(LEASE_MS_DEFAULT / 2));
    assert_eq!(machine.handle_timeout(at), Handled::Accepted);
    assert_eq!(
        drain(&mut machine),
        vec![Effect::Persist(Write::RenewLease {
            generation: Generation(7),
            lease_expires_at: at.plus_ms(LEASE_MS_DEFAULT),
        })]
    );
    // The store refuses: another generation is active now. The machine stops and retracts.
    let _ = machine.handle_store(Timestamp(at.0 + 1), StoreAnswer::LeaseLost);
    assert_eq!(machine.state(), DispatchState::Abandoned);
    assert_eq!(machine.poll_timeout(), None);
}

#[test]
fn a_cancel_persists_and_abandons_and_later_answers_are_ignored() {
    let mut machine = machine();
    let _ = machine.start(Timestamp(0));
    let _ = drain(&mut machine);
    assert_eq!(machine.handle_cancel(Timestamp(1)), Handled::Accepted);
    let effects = drain(&mut machine);
    assert_eq!(
        effects[0],
        Effect::Persist(Write::Cancel {
            expected_cancel_generation: 0
        })
    );
    // The begin write raced the cancel and won in the store: still no Send from here.
    assert_eq!(
        machine.handle_store(Timestamp(2), began(1)),
        Handled::Ignored(IgnoreReason::UnexpectedAnswer)
    );
    assert!(!drain(&mut machine).iter().any(is_send));
}

fn unknown(handle: Option<&str>, lease_expires_at: u64) -> UnknownAttempt {
    UnknownAttempt {
        generation: Generation(1),
        handle: handle.map(str::to_owned),
        idempotency_key: "key-1".into(),
        lease_expires_at: Timestamp(lease_expires_at),
        provider_confirmed_ended: false,
    }
}

#[test]
fn recovery_decisions_follow_what_the_provider_supports() {
    let none = ProviderRecovery::default();
    let resume = ProviderRecovery {
        resume_by_handle: true,
        honours_idempotency_key: false,
    };
    let replay = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: true,
    };
    let cases = [
        (
            unknown(Some("resp_9"), 10),
            resume,
            5,
            RecoveryDecision::ResumeByHandle {
                generation: Generation(1),
                handle: "resp_9".into(),
            },
        ),
        // Resume needs a handle; without one the lease rules apply.
        (
            unknown(None, 10),
            resume,
            5,
            RecoveryDecision::WaitUntil(Timestamp(10)),
        ),
        (
            unknown(None, 10),
            replay,
            5,
            RecoveryDecision::ReplaySameGeneration {
                generation: Generation(1),
                idempotency_key: "key-1".into(),
            },
        ),
        (
            unknown(Some("h"), 10),
            none,
            9,
            RecoveryDecision::WaitUntil(Timestamp(10)),
        ),
        (
            unknown(Some("h"), 10),
            none,
            10,
            RecoveryDecision::AbandonThenNewGeneration {
                generation: Generation(1),
            },
        ),
        (
            UnknownAttempt {
                provider_confirmed_ended: true,
                ..unknown(None, 10)
            },
            none,
            0,
            RecoveryDecision::AbandonThenNewGeneration {
                generation: Generation(1),
            },
        ),
    ];
    for (attempt, provider, now, expected) in cases {
        assert_eq!(
            recovery_decision(&attempt, provider, Timestamp(now)),
            expected,
            "{attempt:?} {provider:?} at {now}"
        );
    }
}

#[test]
fn recovery_waits_for_the_dead_lease_then_rearms_and_resends_the_stored_bytes_under_a_new_generation() {
    let prepared = Prepared {
        revision: Revision(3),
        cancel_generation: 0,
        request_digest: DIGEST.into(),
    };
    let mut machine = DispatchMachine::recover(
        Timestamp(100),
        prepared,
        LEASE_MS_DEFAULT,
        &unknown(None, 5_000),
        ProviderRecovery::default(),
    );
    assert!(
        drain(&mut machine).is_empty(),
        "nothing may start while the old lease runs"
    );
    assert_eq!(machine.poll_timeout(), Some(Timestamp(5_000)));
    assert_eq!(
        machine.handle_timeout(Timestamp(4_999)),
        Handled::Ignored(IgnoreReason::NotInThisState)
    );
    assert_eq!(machine.handle_timeout(Timestamp(5_000)), Handled::Accepted);
    assert_eq!(
        drain(&mut machine),
        vec![Effect::Persist(Write::AbandonAndRearm {
            generation: Generation(1)
        })]
    );
    let _ = machine.handle_store(Timestamp(5_001), StoreAnswer::Rearmed);
    let effects = drain(&mut machine);
    assert!(matches!(
        effects.as_slice(),
        [Effect::Persist(Write::Begin { .. })]
    ));
    let _ = machine.handle_store(Timestamp(5_002), began(2));
    let effects = drain(&mut machine);
    assert_eq!(
        effects.last(),
        Some(&Effect::Send {
            generation: Generation(2),
            idempotency_key: "key-2".into(),
            request_digest: DIGEST.into(),
        })
    );
}

#[test]
fn replay_of_the_same_generation_sends_only_after_its_write_is_acknowledged() {
    let prepared = Prepared {
        revision: Revision(3),
        cancel_generation: 0,
        request_digest: DIGEST.into(),
    };
    let provider = ProviderRecovery {
        resume_by_handle: false,
        honours_idempotency_key: true,
    };
    let mut machine = DispatchMachine::recover(
        Timestamp(0),
        prepared,
        LEASE_MS_DEFAULT,
        &unknown(None, 10),
        provider,
    );
    let effects = drain(&mut machine);
    assert!(matches!(
        effects.as_slice(),
        [Effect::Persist(Write::Replay { .. })]
    ));
    let _ = machine.handle_store(
        Timestamp(1),
        StoreAnswer::Replayed {
            generation: Generation(1),
            idempotency_key: "key-1".into(),
        },
    );
    let effects = drain(&mut machine);
    assert_eq!(
        effects.last(),
        Some(&Effect::Send {
            generation: Generation(1),
            idempotency_key: "key-1".into(),
            request_digest: DIGEST.into(),
        })
    );
}

#[test]
fn the_transition_table_matches_the_spec_edges() {
    use DispatchState::*;
    let edges = [
        (Prepared, Dispatching),
        (Prepared, Abandoned),
        (Dispatching, Sent),
        (Dispatching, Unknown),
        (Dispatching, Failed),
        (Dispatching, Abandoned),
        (Sent, Streaming),
        (Sent, Unknown),
        (Sent, Failed),
        (Sent, Abandoned),
        (Streaming, Committed),
        (Streaming, Unknown),
        (Streaming, Abandoned),
        (Unknown, Dispatching),
        (Unknown, Streaming),
        (Unknown, Failed),
        (Unknown, Abandoned),
        (Failed, Prepared),
        (Abandoned, Prepared),
    ];
    for from in DispatchState::ALL {
        for to in DispatchState::ALL {
            assert_eq!(
                from.can_transition(to),
                edges.contains(&(from, to)),
                "{from} -> {to}"
            );
        }
        assert_eq!(DispatchState::parse(from.as_str()), Some(from));
    }
    assert!(!Committed.can_transition(Prepared), "COMMITTED is terminal");
}

#[derive(Clone, Debug)]
enum Input {
    Start,
    Store(u8),
    Provider(u8, u8),
    Timeout(u16),
    Cancel,
}

fn input() -> impl Strategy<Value = Input> {
    prop_oneof![
        Just(Input::Start),
        (0u8..8).prop_map(Input::Store),
        (0u8..3, 0u8..6).prop_map(|(generation, kind)| Input::Provider(generation, kind)),
        any::<u16>().prop_map(Input::Timeout),
        Just(Input::Cancel),
    ]
}

proptest! {
    // proptest prints the failing case and persists its seed under proptest-regressions/.
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn whatever_arrives_send_only_follows_an_acknowledged_dispatching_write(
        inputs in proptest::collection::vec(input(), 0..40)
    ) {
        let mut machine = machine();
        let mut now = 0u64;
        let mut generation_next = 1u64;
        for input in inputs {
            now += 1;
            let acknowledged_dispatching = match input {
                Input::Start => { let _ = machine.start(Timestamp(now)); false }
                Input::Store(kind) => {
                    let answer = match kind {
                        0 => { generation_next += 1; began(generation_next - 1) }
                        1 => StoreAnswer::BeginRefused,
                        2 => StoreAnswer::Rearmed,
                        3 => StoreAnswer::TransitionRefused,
                        4 => StoreAnswer::LeaseLost,
                        5 => StoreAnswer::Committed { revision: Revision(4) },
                        6 => StoreAnswer::CommitRefused,
                        _ => match machine.generation() {
                            Some(generation) => StoreAnswer::Replayed { generation, idempotency_key: "k".into() },
                            None => StoreAnswer::BeginRefused,
                        },
                    };
                    let was = machine.state();
                    let handled = machine.handle_store(Timestamp(now), answer);
                    handled == Handled::Accepted
                        && machine.state() == DispatchState::Dispatching
                        && was != DispatchState::Dispatching
                }
                Input::Provider(generation, kind) => {
                    let generation = Generation(generation as u64 + generation_next.saturating_sub(2));
                    let input = match kind {
                        0 => ProviderInput::Accepted,
                        1 => ProviderInput::Handle("h".into()),
                        2 => ProviderInput::FirstEvent,
                        3 => ProviderInput::Completed { turn: turn() },
                        4 => ProviderInput::Rejected,
                        _ => ProviderInput::Interrupted,
                    };
                    let _ = machine.handle_provider(Timestamp(now), generation, input);
                    false
                }
                Input::Timeout(advance) => {
                    now += advance as u64;
                    let _ = machine.handle_timeout(Timestamp(now));
                    false
                }
                Input::Cancel => { let _ = machine.handle_cancel(Timestamp(now)); false }
            };
            let effects = drain(&mut machine);
            let sends = effects.iter().filter(|effect| is_send(effect)).count();
            prop_assert!(sends <= 1);
            if sends == 1 {
                prop_assert!(acknowledged_dispatching, "Send without an acknowledged DISPATCHING write");
            }
        }
    }
}
