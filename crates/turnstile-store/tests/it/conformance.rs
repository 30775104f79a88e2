//! The store conformance suite: every case runs against SQLite (a temporary file) and against a
//! real PostgreSQL (`TURNSTILE_PG_URL`; missing → the PostgreSQL cases fail, never skip).

pub use crate::listing::*;
use crate::support::*;
use serde_json::json;
use turnstile_core::dispatch::{
    DispatchState, ProviderRecovery, RecoveryDecision, UnknownAttempt, recovery_decision,
};
use turnstile_core::{Generation, Revision, ViolationCode};
use turnstile_store::*;

macro_rules! instantiate {
    ($backend:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                super::$case($backend, stringify!($case)).await
            }
        )*
    };
}

macro_rules! suite {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            use crate::support::Backend;
            instantiate!(Backend::Sqlite; $($case),*);
        }
        mod postgres {
            use crate::support::Backend;
            instantiate!(Backend::Postgres; $($case),*);
        }
    };
}

suite!(
    a_stale_expected_revision_is_a_conflict_and_an_illegal_history_is_rejected,
    prepare_is_idempotent_on_the_operation_id_and_a_different_manifest_conflicts,
    prepare_refuses_bytes_that_do_not_match_the_manifest_and_stale_revisions,
    a_manifest_integer_above_2_53_is_refused_since_its_digest_cannot_pin_it,
    begin_allocates_a_durable_generation_once_and_refuses_a_second_begin,
    a_full_lifecycle_commits_one_turn_fills_the_tool_call_ledger_and_records_history,
    a_commit_from_another_generation_is_refused_quarantined_and_counted,
    an_illegal_assistant_turn_is_rejected_and_quarantined,
    a_handle_bound_to_another_manifest_is_refused_and_counted,
    a_cancel_bumps_the_cancel_generation_and_a_begin_with_the_old_one_loses,
    leases_are_fenced_by_generation_and_rearm_waits_for_the_old_lease,
    a_lease_that_ran_out_is_not_renewed,
    a_replay_keeps_the_generation_and_its_idempotency_key,
    tool_results_need_the_current_claim_and_append_tool_turns_through_the_validator,
    startup_recovery_marks_live_attempts_unknown_but_not_another_replicas_leased_ones,
    a_drained_holder_releases_only_its_own_live_attempts_to_recovery_at_once,
    recovery_after_a_dead_lease_resends_the_stored_bytes_under_a_new_generation,
    a_drop_before_commit_leaves_nothing_and_a_retry_succeeds,
    a_drop_after_commit_is_answered_by_the_retry_without_a_second_turn,
    quarantine_is_bounded_per_dispatch,
    a_tool_turn_appended_directly_closes_its_calls_in_the_ledger,
    migrations_apply_once_and_a_newer_schema_is_refused,
    attempt_evidence_is_appended_alone_or_with_a_winning_commit_and_never_with_a_losing_one,
    an_import_writes_a_whole_legal_history_at_once_or_nothing,
    the_store_clock_is_the_database_s_own,
    a_live_attempt_past_its_lease_is_seen_as_stuck_by_the_store_s_clock,
    an_attempt_s_resumes_replays_and_end_reasons_are_durable_whoever_writes_them,
    the_render_policy_is_kept_with_its_dispatch_only_when_it_hashes_to_policy_digest,
    failover_targets_keep_their_own_manifests_and_each_attempt_records_the_one_it_sent,
    conversations_are_listed_newest_first_paged_searched_and_tenant_scoped,
    conversation_listing_filters_by_last_dispatch_and_pending_calls,
    the_quarantine_pages_newest_first_within_a_prefix,
    prepare_and_begin_is_one_write_and_the_commit_carries_sent_streaming_and_the_handle,
    appends_and_commits_after_the_first_check_only_the_new_turn_and_refuse_the_same,
    a_reader_s_tail_is_the_turns_after_its_revision_and_names_the_turn_at_it,
    every_stored_turn_carries_the_digest_of_its_decoded_form_and_both_reads_return_it,
    a_version_7_database_keeps_every_request_body_manifest_and_policy_across_migrations_8_and_9,
    a_version_9_database_keeps_its_attempts_handles_and_transitions_and_sweeps_read_live_rows_only,
    a_large_body_is_checked_off_the_writer_and_stored_exactly,
    a_fresh_import_and_its_first_prepare_are_one_write_and_its_commit_checks_the_new_turn_only,
    a_fault_is_the_commit_s_own_when_its_check_must_first_walk_the_history,
    a_begin_at_once_naming_a_target_the_dispatch_lacks_prepares_and_begins_nothing,
    sealed_targets_are_stored_as_checked_ones_and_a_target_that_does_not_match_cannot_be_sealed,
    a_repair_appends_its_turn_and_its_record_together_and_both_survive_a_reopen,
);

/// Targets sealed in this process (`prepare_sealed`, `import_and_prepare_sealed`: what the
/// gateway stores, its digests not computed again) are stored as the checked entry points store
/// them: one write that prepares and begins, the record read back as it was answered, the
/// bytes and fallbacks kept, `Existing` when asked again and `Conflict` for another manifest,
/// PREPARED without a begin, and the bounds still checked. A target whose digests do not match
/// cannot be sealed: `SealedTarget::check` refuses it with the reason a checked prepare gives.
pub async fn sealed_targets_are_stored_as_checked_ones_and_a_target_that_does_not_match_cannot_be_sealed(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    conversation_at_1(&*store, "d").await;
    let begin = begin_at_once();
    let sealed = |(manifest, request_bytes): (turnstile_core::manifest::DispatchManifest, Vec<u8>)| {
        SealedTarget::check(PreparedTarget {
            manifest,
            request_bytes,
            policy: None,
        })
        .expect("a target the test built matches its digests")
    };
    let (manifest_c, bytes_c) = manifest("op-c", "c", 1, "m");
    let fallback = {
        let bytes = b"{\"model\":\"m-b\"}".to_vec();
        let mut body = manifest_c.body.clone();
        body.model = "m-b".into();
        body.request_digest = turnstile_core::Digest::of_bytes(&bytes);
        (body.seal(), bytes)
    };
    let writes = store.write_ops();
    let (prepared, began) = store
        .prepare_sealed(
            sealed((manifest_c.clone(), bytes_c.clone())),
            vec![sealed(fallback.clone())],
            Some(&begin),
            at(10),
        )
        .await
        .unwrap();
    assert_eq!(store.write_ops() - writes, 1, "prepare and begin are one write");
    let PrepareOutcome::Created(record) = prepared else {
        panic!("not created: {prepared:?}")
    };
    assert!(
        matches!(
            began,
            Some(BeginOutcome::Began {
                generation: Generation(1),
                ..
            })
        ),
        "{began:?}"
    );
    assert_eq!(record.state, DispatchState::Dispatching);
    assert_eq!(record.request_bytes, bytes_c);
    assert_eq!(record.manifest_digest, manifest_c.manifest_digest.as_str());
    assert_eq!(store.dispatch("op-c").await.unwrap(), Some(record.clone()));
    let targets = store.dispatch_fallbacks("op-c").await.unwrap();
    assert_eq!(targets.len(), 1);
    assert_eq!(targets[0].request_bytes, fallback.1);
    assert_eq!(targets[0].manifest_digest, fallback.0.manifest_digest.as_str());
    // The checked entry point stores the same dispatch for the same kind of target.
    let (manifest_d, bytes_d) = manifest("op-d", "d", 1, "m");
    let (checked, _) = store
        .prepare_and_begin(&manifest_d, &bytes_d, None, &[], &begin, at(10))
        .await
        .unwrap();
    let PrepareOutcome::Created(checked) = checked else {
        panic!("not created: {checked:?}")
    };
    assert_eq!(
        (checked.state, checked.revision, checked.active_generation),
        (record.state, record.revision, record.active_generation)
    );
    // Asked again: the existing dispatch, not begun again; another manifest: a conflict.
    let (again, began_again) = store
        .prepare_sealed(
            sealed((manifest_c.clone(), bytes_c.clone())),
            vec![sealed(fallback.clone())],
            Some(&begin),
            at(11),
        )
        .await
        .unwrap();
    assert!(matches!(again, PrepareOutcome::Existing(_)), "{again:?}");
    assert_eq!(began_again, None);
    let (other, _) = store
        .prepare_sealed(
            sealed(manifest("op-c", "c", 1, "m-other")),
            vec![],
            Some(&begin),
            at(12),
        )
        .await
        .unwrap();
    assert!(matches!(other, PrepareOutcome::Conflict { .. }), "{other:?}");
    // Without a begin the dispatch is PREPARED.
    conversation_at_1(&*store, "e").await;
    let (unbegun, none) = store
        .prepare_sealed(sealed(manifest("op-e", "e", 1, "m")), vec![], None, at(13))
        .await
        .unwrap();
    assert!(
        matches!(&unbegun, PrepareOutcome::Created(record) if record.state == DispatchState::Prepared),
        "{unbegun:?}"
    );
    assert_eq!(none, None);
    // The bounds are still the store's to check: an integer its digest cannot pin.
    conversation_at_1(&*store, "f").await;
    let (huge, huge_bytes) = manifest("op-f", "f", 1, "m");
    let mut body = huge.body.clone();
    body.prompt_tokens = (1 << 53) + 1;
    let vouched = SealedTarget::vouched(PreparedTarget {
        manifest: body.seal(),
        request_bytes: huge_bytes,
        policy: None,
    });
    let (refused, _) = store
        .prepare_sealed(vouched, vec![], Some(&begin), at(14))
        .await
        .unwrap();
    assert_eq!(
        refused,
        PrepareOutcome::Invalid("a manifest integer is above 2^53, where its digest cannot pin it")
    );
    assert_eq!(store.dispatch("op-f").await.unwrap(), None);
    // A policy the manifest pins is kept with the sealed dispatch.
    conversation_at_1(&*store, "p").await;
    let policy = json!({"sampling": {"temperature": 0.25}});
    let (manifest_p, bytes_p) = manifest("op-p", "p", 1, "m");
    let mut body = manifest_p.body.clone();
    body.policy_digest = turnstile_core::Digest::of_canonical(&policy);
    let with_policy = SealedTarget::check(PreparedTarget {
        manifest: body.seal(),
        request_bytes: bytes_p,
        policy: Some(policy.clone()),
    })
    .unwrap();
    let (kept, _) = store
        .prepare_sealed(with_policy, vec![], Some(&begin), at(14))
        .await
        .unwrap();
    assert!(matches!(kept, PrepareOutcome::Created(_)), "{kept:?}");
    assert_eq!(store.dispatch_policy("op-p").await.unwrap(), Some(policy));
    // A fresh import and its first prepare, sealed: one write, and the validator's state kept,
    // so its commit walks no history.
    let (manifest_g, bytes_g) = manifest("op-g", "g", 1, "m");
    let (writes, walks) = (store.write_ops(), store.history_walks());
    let imported = store
        .import_and_prepare_sealed(
            "g",
            &tools(),
            &[user_turn("g-u1")],
            sealed((manifest_g, bytes_g.clone())),
            vec![],
            Some(&begin),
            at(15),
        )
        .await
        .unwrap();
    assert_eq!(
        store.write_ops() - writes,
        1,
        "import, prepare and begin are one write"
    );
    let ImportPrepared::Prepared {
        revision: Revision(1),
        prepared: PrepareOutcome::Created(imported),
        began: Some(BeginOutcome::Began { generation, .. }),
    } = imported
    else {
        panic!("not imported, prepared and begun: {imported:?}")
    };
    assert_eq!(imported.request_bytes, bytes_g);
    commit_walking_nothing(&*store, "op-g", generation, "g-a", at(16), walks).await;
    // A sealed import whose target is out of bounds writes nothing, the history included.
    let (huge, huge_bytes) = manifest("op-i", "i", 1, "m");
    let mut body = huge.body.clone();
    body.max_output_tokens = (1 << 53) + 1;
    let writes = store.write_ops();
    let refused = store
        .import_and_prepare_sealed(
            "i",
            &tools(),
            &[user_turn("i-u1")],
            SealedTarget::vouched(PreparedTarget {
                manifest: body.seal(),
                request_bytes: huge_bytes,
                policy: None,
            }),
            vec![],
            Some(&begin),
            at(17),
        )
        .await
        .unwrap();
    assert!(
        matches!(refused, ImportPrepared::NotPrepared(PrepareOutcome::Invalid(_))),
        "{refused:?}"
    );
    assert_eq!(store.write_ops(), writes, "nothing is written");
    assert_eq!(store.conversation("i").await.unwrap(), None);
    // Digests that do not match what they name: no seal, and the reason a checked prepare gives.
    let (manifest_h, bytes_h) = manifest("op-h", "c", 1, "m");
    let mut other_bytes = bytes_h.clone();
    other_bytes.push(b' ');
    let mut tampered = manifest_h.clone();
    tampered.body.model = "tampered".into();
    let policy = json!({"sampling": {"temperature": 0.5}});
    for (manifest, bytes, policy, why) in [
        (
            manifest_h.clone(),
            other_bytes,
            None,
            "request bytes do not match request_digest",
        ),
        (
            tampered,
            bytes_h.clone(),
            None,
            "manifest_digest does not match the manifest",
        ),
        (
            manifest_h.clone(),
            bytes_h.clone(),
            Some(policy),
            "the policy does not match policy_digest",
        ),
    ] {
        let checked = store
            .prepare_with_policy(&manifest, &bytes, policy.as_ref(), at(16))
            .await
            .unwrap();
        assert_eq!(checked, PrepareOutcome::Invalid(why));
        let refused = SealedTarget::check(PreparedTarget {
            manifest,
            request_bytes: bytes,
            policy,
        });
        assert_eq!(refused.err(), Some(why));
    }
    assert_eq!(store.dispatch("op-h").await.unwrap(), None);
}

/// `prepare_with_policy` keeps the policy the manifest pins, and refuses one that does not hash
/// to `policy_digest`.
pub async fn the_render_policy_is_kept_with_its_dispatch_only_when_it_hashes_to_policy_digest(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let policy = json!({"sampling": {"temperature": 0.25}, "tool_choice": {"type": "required"}});
    let (manifest, bytes) = manifest("op-p", "c", 1, "m");
    let mut body = manifest.body.clone();
    body.policy_digest = turnstile_core::Digest::of_canonical(&policy);
    let manifest = body.seal();
    let other = json!({"sampling": {"temperature": 0.5}});
    assert!(matches!(
        store
            .prepare_with_policy(&manifest, &bytes, Some(&other), at(10))
            .await
            .unwrap(),
        PrepareOutcome::Invalid(_)
    ));
    assert!(matches!(
        store
            .prepare_with_policy(&manifest, &bytes, Some(&policy), at(11))
            .await
            .unwrap(),
        PrepareOutcome::Created(_)
    ));
    assert_eq!(store.dispatch_policy("op-p").await.unwrap(), Some(policy));
    assert_eq!(store.dispatch_policy("op-none").await.unwrap(), None);
}

/// A dispatch with failover targets: each target's manifest and bytes are stored beside the
/// dispatch's own in the prepare's transaction; a re-prepare with the same targets is
/// `Existing`, with other targets `Conflict`; a fallback for another revision is refused; a
/// begin records the target and that target's request digest on its attempt; a handle binds
/// to the manifest its attempt sent.
pub async fn failover_targets_keep_their_own_manifests_and_each_attempt_records_the_one_it_sent(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let (primary, primary_bytes) = manifest("op-f", "c", 1, "m-a");
    let fallback_of = |model: &str, provider: &str| {
        let bytes = format!("{{\"model\":\"{model}\",\"op\":\"op-f\"}}").into_bytes();
        let mut body = primary.body.clone();
        body.model = model.into();
        body.provider = provider.into();
        body.adapter = "openai-chat@2".into();
        body.request_digest = turnstile_core::Digest::of_bytes(&bytes);
        PreparedTarget {
            manifest: body.seal(),
            request_bytes: bytes,
            policy: None,
        }
    };
    let fallback = fallback_of("m-b", "b");
    // A fallback for another revision is not this dispatch's.
    let mut stale = fallback_of("m-b", "b");
    let mut body = stale.manifest.body.clone();
    body.conversation_revision = Revision(2);
    stale.manifest = body.seal();
    assert!(matches!(
        store
            .prepare_targets(&primary, &primary_bytes, None, &[stale], at(9))
            .await
            .unwrap(),
        PrepareOutcome::Invalid(_)
    ));
    assert!(store.dispatch("op-f").await.unwrap().is_none(), "nothing stored");
    assert!(matches!(
        store
            .prepare_targets(
                &primary,
                &primary_bytes,
                None,
                std::slice::from_ref(&fallback),
                at(10)
            )
            .await
            .unwrap(),
        PrepareOutcome::Created(_)
    ));
    assert!(matches!(
        store
            .prepare_targets(
                &primary,
                &primary_bytes,
                None,
                std::slice::from_ref(&fallback),
                at(11)
            )
            .await
            .unwrap(),
        PrepareOutcome::Existing(_)
    ));
    for other in [vec![], vec![fallback_of("m-c", "b")]] {
        assert!(
            matches!(
                store
                    .prepare_targets(&primary, &primary_bytes, None, &other, at(12))
                    .await
                    .unwrap(),
                PrepareOutcome::Conflict { .. }
            ),
            "other targets under the same operation id"
        );
    }
    let targets = store.dispatch_fallbacks("op-f").await.unwrap();
    assert_eq!(targets.len(), 1);
    assert_eq!(
        (
            targets[0].position,
            targets[0].provider.as_str(),
            targets[0].model.as_str()
        ),
        (1, "b", "m-b")
    );
    assert_eq!(targets[0].request_bytes, fallback.request_bytes);
    assert_eq!(
        targets[0].manifest_digest,
        fallback.manifest.manifest_digest.as_str()
    );
    // Target 1 begins: its attempt records it and its own digest.
    let expect = |target| BeginExpect {
        revision: Revision(1),
        cancel_generation: 0,
        target,
    };
    assert!(
        matches!(
            store
                .begin_attempt("op-f", expect(7), &lease("a", 1_000), at(20))
                .await
                .unwrap(),
            BeginOutcome::Refused { .. }
        ),
        "no such target"
    );
    let BeginOutcome::Began { generation, .. } = store
        .begin_attempt("op-f", expect(1), &lease("a", 1_000), at(21))
        .await
        .unwrap()
    else {
        panic!("begin refused");
    };
    let attempts = store.attempts("op-f").await.unwrap();
    assert_eq!(attempts[0].target, 1);
    assert_eq!(
        attempts[0].request_digest,
        fallback.manifest.body.request_digest.as_str()
    );
    // Its handle belongs to the fallback's manifest (and provider).
    assert_eq!(
        store
            .bind_handle("op-f", generation, "msg_1", at(22))
            .await
            .unwrap(),
        BindOutcome::Bound
    );
    assert_eq!(
        store
            .bind_handle("op-f", generation, "msg_1", at(23))
            .await
            .unwrap(),
        BindOutcome::AlreadyBound
    );
    // A refused attempt fails over in one write: FAILED with its reason, the dispatch PREPARED.
    assert_eq!(
        store
            .fail_over(
                "op-f",
                generation,
                DispatchState::Dispatching,
                "provider_status_429",
                at(24)
            )
            .await
            .unwrap(),
        TransitionOutcome::Applied
    );
    let record = store.dispatch("op-f").await.unwrap().unwrap();
    assert_eq!(record.state, DispatchState::Prepared);
    let attempt = &store.attempts("op-f").await.unwrap()[0];
    assert_eq!(attempt.state, DispatchState::Failed);
    assert_eq!(attempt.end_reason.as_deref(), Some("provider_status_429"));
    assert_eq!(attempt.confirmed_over.as_deref(), Some("provider_refused"));
    // A second failover of the same attempt (another replica) is refused.
    assert!(matches!(
        store
            .fail_over(
                "op-f",
                generation,
                DispatchState::Dispatching,
                "provider_status_429",
                at(25)
            )
            .await
            .unwrap(),
        TransitionOutcome::Refused { .. }
    ));
    // Generation 2 (target 0) is written FAILED after it may have run (e.g. a refused
    // replay): its rearm without the provider's word waits for its lease.
    let BeginOutcome::Began {
        generation: second, ..
    } = store
        .begin_attempt("op-f", expect(0), &lease("a", 2_000), at(30))
        .await
        .unwrap()
    else {
        panic!("begin refused");
    };
    assert_eq!(
        store
            .end_attempt(
                "op-f",
                second,
                DispatchState::Dispatching,
                DispatchState::Failed,
                "illegal_send",
                at(31)
            )
            .await
            .unwrap(),
        TransitionOutcome::Applied
    );
    assert!(
        matches!(
            store
                .abandon_and_rearm("op-f", second, false, at(1_999))
                .await
                .unwrap(),
            TransitionOutcome::Refused { .. }
        ),
        "no rearm from FAILED before the lease runs out"
    );
    assert_eq!(
        store
            .abandon_and_rearm("op-f", second, false, at(2_000))
            .await
            .unwrap(),
        TransitionOutcome::Applied
    );
}

/// The per-generation recovery budgets and the attempt's story live in the store: every
/// take-over counts (whoever makes it), an ending transition records its reason, a rearm
/// records how the end was confirmed, and the commit records `committed`.
pub async fn an_attempt_s_resumes_replays_and_end_reasons_are_durable_whoever_writes_them(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let generation = prepared_and_begun(&*store, "op-1", "c", 1).await;
    let fresh = &store.attempts("op-1").await.unwrap()[0];
    assert_eq!(
        (fresh.resumes, fresh.replays, fresh.end_reason.as_deref()),
        (0, 0, None)
    );
    let ledger: &dyn Ledger = &*store;
    let unknown = |reason: &'static str, from: DispatchState| async move {
        ledger
            .end_attempt("op-1", generation, from, DispatchState::Unknown, reason, at(20))
            .await
            .unwrap()
    };
    assert_eq!(
        unknown("stream_cut", DispatchState::Dispatching).await,
        TransitionOutcome::Applied
    );
    assert_eq!(
        store.attempts("op-1").await.unwrap()[0].end_reason.as_deref(),
        Some("stream_cut")
    );
    // Two replicas take it over in turn: both take-overs are counted on the attempt.
    let _ = store
        .replay_attempt("op-1", generation, &lease("replica-b", 9_000), at(21))
        .await
        .unwrap();
    assert_eq!(
        unknown("head_timeout", DispatchState::Dispatching).await,
        TransitionOutcome::Applied
    );
    let _ = store
        .resume_attempt("op-1", generation, &lease("replica-c", 9_000), at(22))
        .await
        .unwrap();
    assert_eq!(
        unknown("resume_refused", DispatchState::Streaming).await,
        TransitionOutcome::Applied
    );
    let attempt = &store.attempts("op-1").await.unwrap()[0];
    assert_eq!((attempt.resumes, attempt.replays), (1, 1));
    assert_eq!(attempt.end_reason.as_deref(), Some("resume_refused"));
    // While it runs again it has no end reason.
    let _ = store
        .resume_attempt("op-1", generation, &lease("replica-c", 9_000), at(22))
        .await
        .unwrap();
    assert_eq!(store.attempts("op-1").await.unwrap()[0].end_reason, None);
    assert_eq!(
        unknown("resume_refused", DispatchState::Streaming).await,
        TransitionOutcome::Applied
    );
    // A refused take-over counts nothing.
    assert!(matches!(
        store
            .resume_attempt("op-1", generation, &lease("replica-d", 9_000), at(23))
            .await
            .unwrap(),
        TransitionOutcome::Applied
    ));
    assert!(matches!(
        store
            .resume_attempt("op-1", generation, &lease("replica-d", 9_000), at(24))
            .await
            .unwrap(),
        TransitionOutcome::Refused { .. }
    ));
    assert_eq!(store.attempts("op-1").await.unwrap()[0].resumes, 3);
    assert_eq!(
        unknown("ended_without_stop", DispatchState::Streaming).await,
        TransitionOutcome::Applied
    );
    // The cap is the store's: a fourth resume is refused, whoever asks, and counts nothing.
    assert!(matches!(
        store
            .resume_attempt("op-1", generation, &lease("replica-e", 9_000), at(24))
            .await
            .unwrap(),
        TransitionOutcome::Refused { .. }
    ));
    assert_eq!(store.attempts("op-1").await.unwrap()[0].resumes, 3);
    // The provider's word ends it before its lease: recorded as such.
    assert_eq!(
        store
            .abandon_and_rearm("op-1", generation, true, at(25))
            .await
            .unwrap(),
        TransitionOutcome::Applied
    );
    let attempt = &store.attempts("op-1").await.unwrap()[0];
    assert_eq!(attempt.state, DispatchState::Abandoned);
    assert_eq!(attempt.confirmed_over.as_deref(), Some("provider_ended"));
    assert_eq!(attempt.end_reason.as_deref(), Some("ended_without_stop"));
    // The next generation commits: its reason is `committed`.
    let store_now = store.store_now().await.unwrap().0;
    let next = match store
        .begin_attempt(
            "op-1",
            BeginExpect {
                revision: Revision(1),
                cancel_generation: 0,
                target: 0,
            },
            &Lease {
                holder: "replica-a".into(),
                expires_at: at(store_now + 600_000),
            },
            at(26),
        )
        .await
        .unwrap()
    {
        BeginOutcome::Began { generation, .. } => generation,
        other => panic!("second begin: {other:?}"),
    };
    to_streaming(&*store, "op-1", next).await;
    let committed = store
        .commit("op-1", next, Revision(1), &assistant_turn("a", 0), at(27))
        .await
        .unwrap();
    assert!(
        matches!(committed, CommitOutcome::Committed { .. }),
        "{committed:?}"
    );
    let attempts = store.attempts("op-1").await.unwrap();
    assert_eq!(attempts[1].end_reason.as_deref(), Some("committed"));
    assert_eq!((attempts[1].resumes, attempts[1].replays), (0, 0));
}

/// `stuck_age_ms`: 0 on a fresh store and for an attempt whose lease runs; the time past the
/// lease for one whose lease ran out by the store's clock; 0 again once it is over.
pub async fn a_live_attempt_past_its_lease_is_seen_as_stuck_by_the_store_s_clock(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    assert_eq!(store.stuck_age_ms().await.unwrap(), 0);
    conversation_at_1(&*store, "s").await;
    let (manifest, bytes) = manifest("op-s", "s", 1, "m");
    let _ = store.prepare(&manifest, &bytes, at(10)).await.unwrap();
    let expect = BeginExpect {
        revision: Revision(1),
        cancel_generation: 0,
        target: 0,
    };
    // A lease far in the store's future: not stuck.
    let store_now = store.store_now().await.unwrap().0;
    let running = Lease {
        holder: "replica-a".into(),
        expires_at: at(store_now + 600_000),
    };
    assert!(matches!(
        store
            .begin_attempt("op-s", expect, &running, at(11))
            .await
            .unwrap(),
        BeginOutcome::Began { .. }
    ));
    assert_eq!(store.stuck_age_ms().await.unwrap(), 0);
    // A lease that ended a minute ago by the store's clock: stuck for about that long.
    let ended = Lease {
        holder: "replica-a".into(),
        expires_at: at(store_now.saturating_sub(60_000)),
    };
    assert_eq!(
        store
            .renew_lease("op-s", Generation(1), &ended, at(store_now))
            .await
            .unwrap(),
        TransitionOutcome::Applied
    );
    let age = store.stuck_age_ms().await.unwrap();
    assert!((60_000..120_000).contains(&age), "stuck for {age} ms");
    // Over (cancelled): nothing is stuck.
    let _ = store.cancel("op-s", None, at(12)).await.unwrap();
    assert_eq!(store.stuck_age_ms().await.unwrap(), 0);
}

/// The store's clock is read inside SQL: on a fresh store it is the database host's time (here
/// the same host), whatever the caller passes as `now` elsewhere.
pub async fn the_store_clock_is_the_database_s_own(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64;
    let read = store.store_now().await.expect("store clock").0;
    let after = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64;
    // PostgreSQL truncates to milliseconds; allow one for rounding.
    assert!(
        read + 1 >= before && read <= after + 1,
        "store clock {read} outside [{before}, {after}]"
    );
}

/// A SQLite store opened with a manual clock reads exactly that clock in SQL (the simulation's
/// virtual time), and follows it when it moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_store_with_a_manual_clock_reads_it_in_sql() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let (clock, handle) = StoreClock::manual(1_000);
    let store = SqliteLedger::open_with_clock(dir.path().join("ledger.db"), Synchronous::Full, clock)
        .expect("open sqlite");
    assert_eq!(store.store_now().await.expect("store clock"), Timestamp(1_000));
    handle.store(7_500, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(store.store_now().await.expect("store clock"), Timestamp(7_500));
}

/// Issue 21: the SQLite ledger never parses a cached statement again. The gateway's round trip
/// (read the conversation, prepare and begin with a failover target in one write, SENT,
/// STREAMING, commit, read the dispatch and its attempts and tail, the sweep's scan, the
/// counters), four conversations over, re-prepares nothing. While plans could follow bound
/// values, the turns read and the dispatch read were parsed again at every use (a fifth of the
/// writer's time under load); this test counted 31 re-prepares with the setting off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sqlite_writer_never_parses_a_cached_statement_again() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let store = SqliteLedger::open(dir.path().join("ledger.db"), Synchronous::Full).expect("open sqlite");
    for index in 0..4 {
        let conversation_id = format!("c{index}");
        let operation_id = format!("op-{index}");
        conversation_at_1(&store, &conversation_id).await;
        assert!(store.conversation(&conversation_id).await.unwrap().is_some());
        let (primary, bytes) = manifest(&operation_id, &conversation_id, 1, "m");
        let (second, second_bytes) = manifest(&operation_id, &conversation_id, 1, "m2");
        let fallback = PreparedTarget {
            manifest: second,
            request_bytes: second_bytes,
            policy: None,
        };
        let begin = begin_at_once();
        let (prepared, began) = store
            .prepare_and_begin(&primary, &bytes, None, &[fallback], &begin, at(10))
            .await
            .unwrap();
        assert!(matches!(prepared, PrepareOutcome::Created(_)), "{prepared:?}");
        let Some(BeginOutcome::Began { generation, .. }) = began else {
            panic!("{began:?}")
        };
        assert_eq!(store.dispatch_fallbacks(&operation_id).await.unwrap().len(), 1);
        to_streaming(&store, &operation_id, generation).await;
        let committed = store
            .commit(
                &operation_id,
                generation,
                Revision(1),
                &assistant_turn(&format!("a{index}"), 1),
                at(20),
            )
            .await
            .unwrap();
        assert!(
            matches!(committed, CommitOutcome::Committed { .. }),
            "{committed:?}"
        );
        assert!(store.dispatch(&operation_id).await.unwrap().is_some());
        assert_eq!(store.attempts(&operation_id).await.unwrap().len(), 1);
        let tail = store
            .conversation_since(&conversation_id, Revision(1))
            .await
            .unwrap();
        assert_eq!(tail.map(|tail| tail.turns.len()), Some(1));
        store.prepared_unattended(0, 10).await.unwrap();
        store.counters().await.unwrap();
    }
    assert_eq!(store.reprepares(), 0, "a cached statement was parsed again");
}

/// Issue 21: the two durable writes of a dispatch run only the statements they need. A fresh
/// dispatch's prepare-and-begin inserts its dispatch already DISPATCHING, its body, its attempt
/// and both history rows (PREPARED, DISPATCHING) in one insert, after the existence check, the
/// conversation's head and the store's clock: 7 statements (11 when it inserted a PREPARED row
/// and then ran `begin_attempt`, which read back the rows it had just written). A winning
/// commit carrying a handle moves the attempt and takes its handle in one update that returns
/// its target, and binds the handle without reading the dispatch again, nor the conversation
/// (its revision's claim is the compare-and-set): 10 statements with one tool call (14, then
/// 11 before), its own `SAVEPOINT canonical` and release included. The writer's
/// transaction control around each operation (BEGIN, SAVEPOINT op, RELEASE, COMMIT) is not
/// counted. The history rows are the two-step path's: PREPARED (no generation, the caller's
/// clock), then DISPATCHING at generation 1 on the store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_dispatch_s_prepare_and_commit_run_only_the_statements_they_need() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let store = SqliteLedger::open(dir.path().join("ledger.db"), Synchronous::Full).expect("open sqlite");
    conversation_at_1(&store, "c").await;
    let (manifest, bytes) = manifest("op-c", "c", 1, "m");
    let before = store.statements();
    let (prepared, began) = store
        .prepare_and_begin(&manifest, &bytes, None, &[], &begin_at_once(), at(10))
        .await
        .unwrap();
    assert_eq!(store.statements() - before, 7, "statements of prepare and begin");
    assert!(matches!(prepared, PrepareOutcome::Created(_)), "{prepared:?}");
    let Some(BeginOutcome::Began { generation, .. }) = began else {
        panic!("{began:?}")
    };
    let store_now = i64::try_from(store.store_now().await.unwrap().0).unwrap();
    let history: Vec<(Option<i64>, Option<String>, String, i64)> =
        rusqlite::Connection::open(dir.path().join("ledger.db"))
            .expect("second connection")
            .prepare(
                "SELECT generation, from_state, to_state, at FROM transitions \
                 WHERE operation_id = 'op-c' ORDER BY id",
            )
            .unwrap()
            .query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
    assert_eq!(history.len(), 2, "{history:?}");
    assert_eq!(history[0], (None, None, "PREPARED".to_owned(), 10));
    assert_eq!(
        (history[1].0, history[1].1.as_deref(), history[1].2.as_str()),
        (Some(1), Some("PREPARED"), "DISPATCHING")
    );
    assert!(
        (store_now - 60_000..=store_now).contains(&history[1].3),
        "the begin's row is on the store's clock: {history:?}, now {store_now}"
    );
    let carried = Carried {
        from: DispatchState::Dispatching,
        handle: Some("resp_c".to_owned()),
        bind: true,
        evidence: Vec::new(),
    };
    let before = store.statements();
    let outcome = store
        .commit_carrying(
            "op-c",
            generation,
            Revision(1),
            &assistant_turn("a", 1),
            None,
            &carried,
            at(20),
        )
        .await
        .unwrap();
    assert_eq!(store.statements() - before, 10, "statements of the commit");
    assert!(matches!(outcome, CommitOutcome::Committed { .. }), "{outcome:?}");
    let attempt = &store.attempts("op-c").await.unwrap()[0];
    assert_eq!(
        (attempt.state, attempt.handle.as_deref()),
        (DispatchState::Committed, Some("resp_c"))
    );
}

/// Issue 21: the SQLite writer's group commits run their operations without a savepoint each
/// (`sqlite.rs::run_batch`); only a group with an operation that failed after writing is rolled
/// back and run again with savepoints. Concurrent dispatches (groups of several prepares and
/// commits), a retried commit (answered before any write) and refusals, which are answers and
/// not failures (a rival dispatch's commit at the revision just taken, which writes: its turn
/// quarantined, a counter, its dispatch abandoned; a prepare on a moved revision), all run with
/// no group run twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_dispatches_and_their_refusals_never_run_a_group_twice() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let store = std::sync::Arc::new(
        SqliteLedger::open(dir.path().join("ledger.db"), Synchronous::Full).expect("open sqlite"),
    );
    let conversations = 24;
    for index in 0..conversations {
        conversation_at_1(store.as_ref(), &format!("c{index}")).await;
    }
    let mut tasks = Vec::new();
    for index in 0..conversations {
        let store = std::sync::Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            let (conversation, operation) = (format!("c{index}"), format!("op-c{index}"));
            let generation = began_at_once(store.as_ref(), &operation, &conversation, 1, 10).await;
            let rival_operation = format!("{operation}-rival");
            let rival_generation =
                began_at_once(store.as_ref(), &rival_operation, &conversation, 1, 11).await;
            let (turn, handle) = (assistant_turn(&format!("a{index}"), 1), format!("resp_{index}"));
            let committed = commit_from_dispatching(
                store.as_ref(),
                &operation,
                generation,
                1,
                &turn,
                Some(&handle),
                20,
            )
            .await;
            assert!(
                matches!(committed, CommitOutcome::Committed { .. }),
                "{committed:?}"
            );
            let again = commit_from_dispatching(
                store.as_ref(),
                &operation,
                generation,
                1,
                &turn,
                Some(&handle),
                30,
            )
            .await;
            assert!(
                matches!(again, CommitOutcome::Committed { .. }),
                "a retry is answered: {again:?}"
            );
            let rival_turn = assistant_turn(&format!("r{index}"), 0);
            let lost = commit_from_dispatching(
                store.as_ref(),
                &rival_operation,
                rival_generation,
                1,
                &rival_turn,
                None,
                35,
            )
            .await;
            assert!(
                matches!(lost, CommitOutcome::Refused(CommitRefusal::RevisionMoved)),
                "{lost:?}"
            );
            let abandoned = store.dispatch(&rival_operation).await.unwrap().unwrap();
            assert_eq!(abandoned.state, DispatchState::Abandoned, "the refusal wrote");
            let (stale, stale_bytes) = manifest(&format!("{operation}-late"), &conversation, 1, "m");
            let refused = store
                .prepare_and_begin(&stale, &stale_bytes, None, &[], &begin_at_once(), at(40))
                .await
                .unwrap()
                .0;
            assert!(
                matches!(refused, PrepareOutcome::StaleRevision { .. }),
                "{refused:?}"
            );
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(store.reruns(), 0, "a group ran twice");
}

/// Issue 21: keeping the live-attempts index (a partial index) costs an insert or a move of an
/// attempt no temporary table. SQLite checks a partial index's term for every row written, and
/// codes an `IN` list of more than two constants with a temporary B-tree built per statement
/// (migration 10's term did: one per insert, two per update, the old row and the new); the
/// term as equalities (migration 11) is coded as comparisons. Red with migration 11 left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writing_an_attempt_builds_no_temporary_table_for_the_live_index() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("ledger.db");
    drop(SqliteLedger::open(&path, Synchronous::Full).expect("open sqlite"));
    let connection = rusqlite::Connection::open(&path).expect("second connection");
    // The index's root page: a statement that keeps the index opens it for writing there
    // (`attempts` is WITHOUT ROWID, so its own rows are index writes too; the page tells the
    // two apart).
    let live_root: i64 = connection
        .query_row(
            "SELECT rootpage FROM sqlite_master WHERE type = 'index' AND name = 'attempts_live'",
            [],
            |row| row.get(0),
        )
        .expect("attempts_live exists");
    for sql in [
        "INSERT INTO attempts (operation_id, generation, state, idempotency_key, request_digest, \
         lease_holder, lease_expires_at, started_at) VALUES (?1, ?2, 'DISPATCHING', ?3, ?4, ?5, ?6, ?7)",
        "UPDATE attempts SET state = 'COMMITTED' WHERE operation_id = ?1 AND generation = ?2 AND state = ?3",
        "UPDATE attempts SET state = 'UNKNOWN' WHERE operation_id = ?1 AND generation = ?2 AND state = ?3",
    ] {
        let mut explain = connection.prepare(&format!("EXPLAIN {sql}")).unwrap();
        let unbound = std::iter::repeat_n(rusqlite::types::Null, explain.parameter_count());
        let program: Vec<(String, i64)> = explain
            .query_map(rusqlite::params_from_iter(unbound), |row| {
                Ok((row.get(1)?, row.get(3)?))
            })
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(
            program
                .iter()
                .any(|(op, page)| op == "OpenWrite" && *page == live_root),
            "{sql} keeps the live index: {program:?}"
        );
        assert!(
            !program.iter().any(|(op, _)| op == "OpenEphemeral"),
            "{sql} builds a temporary table: {program:?}"
        );
    }
}

/// Issue 21: with the validator's state after the stored history kept, the dispatch path (the
/// tail a kept conversation reads, the prepare and its begin, the commit) and an append read a
/// conversation's revision only, never its tools (which only a walk of the whole history
/// needs): the writer does not parse a tool catalogue of many kilobytes at every step of an
/// agent loop. Shown with tools made unreadable behind the ledger's back: the kept path reads
/// its tail, prepares, begins, commits and appends, while a second ledger on the same file,
/// with nothing kept, must walk, reads the tools and reports the corrupt store (so the check
/// does notice a read). Red with the tools read by the commit (`Corrupt` at the commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_check_never_reads_the_conversation_s_tools() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("ledger.db");
    let store = SqliteLedger::open(&path, Synchronous::Full).expect("open sqlite");
    conversation_at_1(&store, "c").await;
    rusqlite::Connection::open(&path)
        .expect("second connection")
        .execute(
            "UPDATE conversations SET tools = 'not json' WHERE conversation_id = 'c'",
            [],
        )
        .expect("tools made unreadable");
    let tail = store.conversation_since("c", Revision(1)).await.unwrap();
    assert_eq!(tail.map(|tail| tail.turns.len()), Some(0));
    let generation = began_at_once(&store, "op-c", "c", 1, 10).await;
    let outcome =
        commit_from_dispatching(&store, "op-c", generation, 1, &assistant_turn("a", 0), None, 20).await;
    assert!(matches!(outcome, CommitOutcome::Committed { .. }), "{outcome:?}");
    let question =
        json!({"id": "u1", "role": "user", "blocks": [{"id": "u1-0", "kind": "text", "text": "Sure?"}]});
    let appended = store
        .append_turn("c", Revision(2), &question, at(21))
        .await
        .unwrap();
    assert_eq!(
        appended,
        AppendOutcome::Appended {
            revision: Revision(3)
        }
    );
    let fresh = SqliteLedger::open(&path, Synchronous::Full).expect("second ledger");
    let next =
        json!({"id": "u2", "role": "user", "blocks": [{"id": "u2-0", "kind": "text", "text": "And?"}]});
    let walked = fresh.append_turn("c", Revision(3), &next, at(22)).await;
    assert!(matches!(walked, Err(StoreError::Corrupt(_))), "{walked:?}");
}

/// Issue 21: a SQLite read never queues behind the writer. While another connection holds the
/// file's write lock, the writer's group cannot begin (it waits out `busy_timeout`), yet the
/// ledger answers reads from what was committed, and the write still queued lands once the lock
/// goes, seen by the next read. With reads sent through the writer, the read waited behind the
/// stuck group and failed with it when its BEGIN timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_read_never_waits_for_the_writer() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("ledger.db");
    let store = std::sync::Arc::new(SqliteLedger::open(&path, Synchronous::Full).expect("open sqlite"));
    conversation_at_1(&*store, "c").await;
    let blocker = rusqlite::Connection::open(&path).expect("second connection");
    blocker
        .execute_batch("BEGIN IMMEDIATE")
        .expect("take the write lock");
    let write = {
        let store = std::sync::Arc::clone(&store);
        tokio::spawn(async move { store.create_conversation("d", &tools(), at(5)).await })
    };
    let document = store
        .conversation("c")
        .await
        .expect("read while the writer waits");
    assert_eq!(document.expect("committed conversation")["revision"], 1);
    let tail = store
        .conversation_since("c", Revision(0))
        .await
        .expect("tail while the writer waits")
        .expect("committed conversation");
    assert_eq!((tail.revision, tail.turns.len()), (Revision(1), 1));
    assert_eq!(
        store.conversation("d").await.unwrap(),
        None,
        "the queued write is not in yet"
    );
    assert!(
        !write.is_finished(),
        "the write cannot land while the lock is held"
    );
    blocker.execute_batch("ROLLBACK").expect("release the write lock");
    assert_eq!(write.await.unwrap().unwrap(), CreateOutcome::Created);
    assert!(
        store.conversation("d").await.unwrap().is_some(),
        "an acknowledged write is read"
    );
}

/// A new SQLite ledger file has the ledger's page size (`SQLITE_PAGE_SIZE_BYTES`); an existing
/// file keeps the page size it was made with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_sqlite_ledger_has_small_pages_and_an_old_one_keeps_its_own() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let page_size = |path: &std::path::Path| -> i64 {
        rusqlite::Connection::open(path)
            .unwrap()
            .query_row("PRAGMA page_size", [], |row| row.get(0))
            .unwrap()
    };
    let new = dir.path().join("new.db");
    drop(SqliteLedger::open(&new, Synchronous::Full).expect("open sqlite"));
    assert_eq!(page_size(&new), turnstile_store::SQLITE_PAGE_SIZE_BYTES as i64);
    let old = dir.path().join("old.db");
    rusqlite::Connection::open(&old)
        .unwrap()
        .execute_batch("PRAGMA page_size = 4096; CREATE TABLE kept (x); PRAGMA journal_mode = WAL;")
        .unwrap();
    let store = SqliteLedger::open(&old, Synchronous::Full).expect("open sqlite");
    conversation_at_1(&store, "c").await;
    drop(store);
    assert_eq!(page_size(&old), 4096);
}

/// Issue 21: the bundled SQLite is built with three of SQLite's recommended compile-time
/// options (`.cargo/config.toml`, `LIBSQLITE3_FLAGS`): no memory statistics (so no global mutex
/// in every `sqlite3_malloc`), LIKE that never matches a BLOB, and `alloca` for scratch space.
/// Read back from the SQLite linked into the store (`PRAGMA compile_options`, on a connection
/// to a ledger file), so the setting cannot be dropped without this test going red.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bundled_sqlite_is_built_with_the_recommended_options() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("ledger.db");
    drop(SqliteLedger::open(&path, Synchronous::Full).expect("open sqlite"));
    let connection = rusqlite::Connection::open(&path).unwrap();
    let mut statement = connection.prepare("PRAGMA compile_options").unwrap();
    let options: Vec<String> = statement
        .query_map([], |row| row.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    for wanted in ["DEFAULT_MEMSTATUS=0", "LIKE_DOESNT_MATCH_BLOBS", "USE_ALLOCA"] {
        assert!(
            options.iter().any(|option| option == wanted),
            "{wanted} is not among SQLite's compile options: {options:?}"
        );
    }
}

pub async fn a_stale_expected_revision_is_a_conflict_and_an_illegal_history_is_rejected(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    assert_eq!(
        store.create_conversation("c", &tools(), at(3)).await.unwrap(),
        CreateOutcome::AlreadyExists
    );
    assert_eq!(
        store
            .append_turn("c", Revision(0), &user_turn("u-late"), at(3))
            .await
            .unwrap(),
        AppendOutcome::Conflict { current: Revision(1) }
    );
    assert_eq!(
        store
            .append_turn("nope", Revision(0), &user_turn("u-x"), at(3))
            .await
            .unwrap(),
        AppendOutcome::NotFound
    );
    // A tool result with no call before it is an orphan: refused, nothing written.
    let orphan = json!({"id": "t-orphan", "role": "tool", "blocks": [{"id": "r", "kind": "tool_result",
        "call_id": "call-none", "tool": "get_weather", "status": "success", "content": []}]});
    let AppendOutcome::Rejected(violations) =
        store.append_turn("c", Revision(1), &orphan, at(4)).await.unwrap()
    else {
        panic!("orphan result accepted");
    };
    assert!(
        violations
            .iter()
            .any(|violation| violation.code == ViolationCode::OrphanResult)
    );
    let document = store.conversation("c").await.unwrap().unwrap();
    assert_eq!(document["revision"], 1);
    assert_eq!(document["turns"].as_array().unwrap().len(), 1);
    assert_eq!(
        store
            .append_turn("c", Revision(1), &user_turn("u2"), at(5))
            .await
            .unwrap(),
        AppendOutcome::Appended {
            revision: Revision(2)
        }
    );
}

pub async fn prepare_is_idempotent_on_the_operation_id_and_a_different_manifest_conflicts(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let (manifest, bytes) = manifest("op-1", "c", 1, "m");
    let PrepareOutcome::Created(first) = store.prepare(&manifest, &bytes, at(10)).await.unwrap() else {
        panic!("not created");
    };
    assert_eq!(first.state, DispatchState::Prepared);
    assert_eq!(first.outcome, None);
    assert_eq!(first.request_bytes, bytes);
    assert_eq!(first.manifest, serde_json::to_value(&manifest).unwrap());
    let PrepareOutcome::Existing(again) = store.prepare(&manifest, &bytes, at(11)).await.unwrap() else {
        panic!("second prepare is not the same dispatch");
    };
    assert_eq!(again, first);
    let (other, other_bytes) = manifest_for_other_model();
    assert_eq!(
        store.prepare(&other, &other_bytes, at(12)).await.unwrap(),
        PrepareOutcome::Conflict {
            existing_manifest_digest: manifest.manifest_digest.as_str().to_owned()
        }
    );
}

fn manifest_for_other_model() -> (turnstile_core::manifest::DispatchManifest, Vec<u8>) {
    manifest("op-1", "c", 1, "another-model")
}

pub async fn prepare_refuses_bytes_that_do_not_match_the_manifest_and_stale_revisions(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let (manifest, _) = manifest("op-1", "c", 1, "m");
    assert!(matches!(
        store.prepare(&manifest, b"other bytes", at(10)).await.unwrap(),
        PrepareOutcome::Invalid(_)
    ));
    let mut tampered = manifest.clone();
    tampered.body.model = "tampered".into();
    assert!(matches!(
        store
            .prepare(&tampered, &request_bytes("op-1"), at(10))
            .await
            .unwrap(),
        PrepareOutcome::Invalid(_)
    ));
    let (stale, bytes) = crate::support::manifest("op-2", "c", 0, "m");
    assert_eq!(
        store.prepare(&stale, &bytes, at(10)).await.unwrap(),
        PrepareOutcome::StaleRevision { current: Revision(1) }
    );
    let (missing, bytes) = crate::support::manifest("op-3", "nope", 0, "m");
    assert_eq!(
        store.prepare(&missing, &bytes, at(10)).await.unwrap(),
        PrepareOutcome::NotFound
    );
    assert_eq!(store.dispatch("op-1").await.unwrap(), None);
}

/// Above 2^53 two integers can be one IEEE double, and so one canonical manifest: a manifest
/// holding such a number is refused (its digest would not pin it), and at 2^53 it is taken.
pub async fn a_manifest_integer_above_2_53_is_refused_since_its_digest_cannot_pin_it(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let (manifest, bytes) = manifest("op-1", "c", 1, "m");
    for field in 0..2 {
        let mut body = manifest.body.clone();
        match field {
            0 => body.max_output_tokens = (1 << 53) + 1,
            _ => body.prompt_tokens = (1 << 53) + 1,
        }
        assert_eq!(
            store.prepare(&body.seal(), &bytes, at(10)).await.unwrap(),
            PrepareOutcome::Invalid("a manifest integer is above 2^53, where its digest cannot pin it"),
            "field {field}"
        );
    }
    assert_eq!(store.dispatch("op-1").await.unwrap(), None);
    let mut body = manifest.body.clone();
    body.max_output_tokens = 1 << 53;
    assert!(matches!(
        store.prepare(&body.seal(), &bytes, at(11)).await.unwrap(),
        PrepareOutcome::Created(_)
    ));
}

/// A prepare that begins at once, asked for a target the dispatch does not have (here 1, with
/// no failover target), stores the dispatch PREPARED, refuses the begin as `begin_attempt`
/// would and starts no attempt; the dispatch then begins normally.
pub async fn a_begin_at_once_naming_a_target_the_dispatch_lacks_prepares_and_begins_nothing(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let (manifest, bytes) = manifest("op-1", "c", 1, "m");
    let begin = BeginAtOnce {
        target: 1,
        ..begin_at_once()
    };
    let (prepared, began) = store
        .prepare_and_begin(&manifest, &bytes, None, &[], &begin, at(10))
        .await
        .unwrap();
    let PrepareOutcome::Created(record) = prepared else {
        panic!("not created: {prepared:?}")
    };
    assert_eq!(
        (record.state, record.active_generation),
        (DispatchState::Prepared, None)
    );
    assert_eq!(
        began,
        Some(BeginOutcome::Refused {
            state: Some(DispatchState::Prepared),
            active_generation: None,
        })
    );
    assert!(store.attempts("op-1").await.unwrap().is_empty());
    let stored = store.dispatch("op-1").await.unwrap().unwrap();
    assert_eq!(
        (stored.state, stored.active_generation),
        (DispatchState::Prepared, None)
    );
    let expect = BeginExpect {
        revision: Revision(1),
        cancel_generation: 0,
        target: 0,
    };
    assert!(matches!(
        store
            .begin_attempt("op-1", expect, &lease("replica-a", 5_000), at(20))
            .await
            .unwrap(),
        BeginOutcome::Began {
            generation: Generation(1),
            ..
        }
    ));
}

pub async fn begin_allocates_a_durable_generation_once_and_refuses_a_second_begin(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let generation = prepared_and_begun(&*store, "op-1", "c", 1).await;
    assert_eq!(generation, Generation(1));
    let expect = BeginExpect {
        revision: Revision(1),
        cancel_generation: 0,
        target: 0,
    };
    assert_eq!(
        store
            .begin_attempt("op-1", expect, &lease("replica-b", 5_000), at(20))
            .await
            .unwrap(),
        BeginOutcome::Refused {
            state: Some(DispatchState::Dispatching),
            active_generation: Some(Generation(1)),
        }
    );
    let attempts = store.attempts("op-1").await.unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].state, DispatchState::Dispatching);
    assert_eq!(
        attempts[0].idempotency_key,
        ops::idempotency_key("op-1", Generation(1))
    );
    assert_eq!(
        attempts[0].request_digest,
        store.dispatch("op-1").await.unwrap().unwrap().request_digest
    );
    // A begin against a revision the conversation left loses too, and ends the dispatch
    // (ABANDONED in the refusal's transaction: it could never begin).
    conversation_at_1(&*store, "d").await;
    let (manifest, bytes) = manifest("op-2", "d", 1, "m");
    let _ = store.prepare(&manifest, &bytes, at(30)).await.unwrap();
    assert_eq!(
        store
            .append_turn("d", Revision(1), &user_turn("d-u2"), at(31))
            .await
            .unwrap(),
        AppendOutcome::Appended {
            revision: Revision(2)
        }
    );
    assert!(matches!(
        store
            .begin_attempt("op-2", expect, &lease("replica-a", 5_000), at(32))
            .await
            .unwrap(),
        BeginOutcome::Refused {
            state: Some(DispatchState::Abandoned),
            ..
        }
    ));
    assert_eq!(
        store.dispatch("op-2").await.unwrap().unwrap().state,
        DispatchState::Abandoned
    );
}

pub async fn a_full_lifecycle_commits_one_turn_fills_the_tool_call_ledger_and_records_history(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let generation = prepared_and_begun(&*store, "op-1", "c", 1).await;
    assert_eq!(
        store
            .bind_handle("op-1", generation, "resp_1", at(12))
            .await
            .unwrap(),
        BindOutcome::Bound
    );
    assert_eq!(
        store
            .bind_handle("op-1", generation, "resp_1", at(12))
            .await
            .unwrap(),
        BindOutcome::AlreadyBound
    );
    to_streaming(&*store, "op-1", generation).await;
    let turn = assistant_turn("a1", 2);
    let facts = json!({"stop_reason": "tool_use", "usage": {"input_tokens": 377, "output_tokens": 42}});
    let outcome = store
        .commit_with_outcome("op-1", generation, Revision(1), &turn, Some(&facts), at(13))
        .await
        .unwrap();
    assert_eq!(
        outcome,
        CommitOutcome::Committed {
            revision: Revision(2),
            tool_calls: vec!["a1-call-0".into(), "a1-call-1".into()],
        }
    );
    let record = store.dispatch("op-1").await.unwrap().unwrap();
    assert_eq!(record.state, DispatchState::Committed);
    assert_eq!(record.committed_revision, Some(Revision(2)));
    // The provider's facts are recorded in the commit's own transaction.
    assert_eq!(record.outcome, Some(facts));
    let document = store.conversation("c").await.unwrap().unwrap();
    assert_eq!(document["revision"], 2);
    assert_eq!(document["turns"][1]["generation"], 1);
    assert_eq!(document["turns"][1]["revision"], 2);
    let ready = store.tool_calls(Some(ToolCallState::Ready)).await.unwrap();
    assert_eq!(ready.len(), 2);
    assert_eq!(ready[0].generation, generation);
    assert_eq!(ready[0].arguments, json!({"city": "c0"}));
    let attempts = store.attempts("op-1").await.unwrap();
    assert_eq!(attempts[0].handle.as_deref(), Some("resp_1"));
    assert_eq!(
        attempts[0].history,
        vec![
            (DispatchState::Dispatching, at(11)),
            (DispatchState::Sent, at(12)),
            (DispatchState::Streaming, at(12)),
            (DispatchState::Committed, at(13)),
        ]
    );
    // Nothing moves a COMMITTED dispatch.
    assert!(matches!(
        store
            .transition(
                "op-1",
                generation,
                DispatchState::Streaming,
                DispatchState::Unknown,
                at(14)
            )
            .await
            .unwrap(),
        TransitionOutcome::Refused { .. }
    ));
    assert!(matches!(
        store.cancel("op-1", None, at(14)).await.unwrap(),
        CancelOutcome::Refused { .. }
    ));
    check_invariants(&*store, &["c".into()]).await;
}

pub async fn a_commit_from_another_generation_is_refused_quarantined_and_counted(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let first = prepared_and_begun(&*store, "op-1", "c", 1).await;
    to_streaming(&*store, "op-1", first).await;
    // The first attempt is lost (UNKNOWN), its lease runs out, a second generation begins.
    assert_eq!(
        store
            .transition(
                "op-1",
                first,
                DispatchState::Streaming,
                DispatchState::Unknown,
                at(100)
            )
            .await
            .unwrap(),
        TransitionOutcome::Applied
    );
    assert_eq!(
        store
            .abandon_and_rearm("op-1", first, false, at(5_000))
            .await
            .unwrap(),
        TransitionOutcome::Applied
    );
    let expect = BeginExpect {
        revision: Revision(1),
        cancel_generation: 0,
        target: 0,
    };
    let BeginOutcome::Began {
        generation: second, ..
    } = store
        .begin_attempt("op-1", expect, &lease("replica-a", 9_000), at(5_001))
        .await
        .unwrap()
    else {
        panic!("second begin refused");
    };
    assert_eq!(second, Generation(2));
    to_streaming(&*store, "op-1", second).await;
    let late = assistant_turn("late", 1);
    assert_eq!(
        store
            .commit("op-1", first, Revision(1), &late, at(5_002))
            .await
            .unwrap(),
        CommitOutcome::Refused(CommitRefusal::ForeignGeneration)
    );
    let quarantined = store.quarantined(10).await.unwrap();
    assert_eq!(quarantined.len(), 1);
    assert_eq!(quarantined[0].entry.generation, first);
    assert_eq!(quarantined[0].entry.content, late);
    let counters = store.counters().await.unwrap();
    assert_eq!(counters.canonical_cas_conflicts, 1);
    assert_eq!(counters.late_blocks, 1);
    assert!(matches!(
        store
            .commit("op-1", second, Revision(1), &assistant_turn("win", 1), at(5_003))
            .await
            .unwrap(),
        CommitOutcome::Committed { .. }
    ));
    assert_eq!(
        store.tool_calls(None).await.unwrap().len(),
        1,
        "only the winner's call"
    );
    check_invariants(&*store, &["c".into()]).await;
}

pub async fn an_illegal_assistant_turn_is_rejected_and_quarantined(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let generation = prepared_and_begun(&*store, "op-1", "c", 1).await;
    to_streaming(&*store, "op-1", generation).await;
    let cut = json!({"id": "a-cut", "role": "assistant", "blocks": [{"id": "a-cut-0", "kind": "tool_call",
        "call_id": "call-cut", "tool": "get_weather", "arguments": "{\"city\":\"Par"}]});
    let CommitOutcome::Rejected(violations) = store
        .commit("op-1", generation, Revision(1), &cut, at(20))
        .await
        .unwrap()
    else {
        panic!("a cut tool call was committed");
    };
    assert!(
        violations
            .iter()
            .any(|violation| violation.code == ViolationCode::UnclosedArguments)
    );
    assert_eq!(store.quarantined(10).await.unwrap().len(), 1);
    assert!(store.tool_calls(None).await.unwrap().is_empty());
    assert_eq!(
        store.dispatch("op-1").await.unwrap().unwrap().state,
        DispatchState::Streaming
    );
    check_invariants(&*store, &["c".into()]).await;
}

pub async fn a_handle_bound_to_another_manifest_is_refused_and_counted(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    conversation_at_1(&*store, "d").await;
    let one = prepared_and_begun(&*store, "op-1", "c", 1).await;
    let two = prepared_and_begun(&*store, "op-2", "d", 1).await;
    assert_eq!(
        store.bind_handle("op-1", one, "resp_x", at(20)).await.unwrap(),
        BindOutcome::Bound
    );
    let digest = store.dispatch("op-1").await.unwrap().unwrap().manifest_digest;
    assert_eq!(
        store.bind_handle("op-2", two, "resp_x", at(21)).await.unwrap(),
        BindOutcome::Refused { bound_to: digest }
    );
    assert_eq!(store.counters().await.unwrap().foreign_handle_refusals, 1);
    assert_eq!(store.attempts("op-2").await.unwrap()[0].handle, None);
    assert_eq!(
        store
            .bind_handle("op-1", Generation(9), "resp_y", at(22))
            .await
            .unwrap(),
        BindOutcome::StaleGeneration
    );
}

pub async fn a_cancel_bumps_the_cancel_generation_and_a_begin_with_the_old_one_loses(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let (manifest, bytes) = manifest("op-1", "c", 1, "m");
    let _ = store.prepare(&manifest, &bytes, at(10)).await.unwrap();
    assert_eq!(
        store.cancel("op-1", Some(5), at(11)).await.unwrap(),
        CancelOutcome::Refused {
            state: Some(DispatchState::Prepared)
        },
        "a cancel with a stale cancel generation loses"
    );
    assert_eq!(
        store.cancel("op-1", Some(0), at(12)).await.unwrap(),
        CancelOutcome::Cancelled { cancel_generation: 1 }
    );
    let record = store.dispatch("op-1").await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.cancel_generation),
        (DispatchState::Abandoned, 1)
    );
    let expect = BeginExpect {
        revision: Revision(1),
        cancel_generation: 0,
        target: 0,
    };
    assert!(matches!(
        store
            .begin_attempt("op-1", expect, &lease("a", 100), at(13))
            .await
            .unwrap(),
        BeginOutcome::Refused { .. }
    ));
    // Cancelling a live attempt abandons it too; a late commit is then refused.
    conversation_at_1(&*store, "d").await;
    let generation = prepared_and_begun(&*store, "op-2", "d", 1).await;
    to_streaming(&*store, "op-2", generation).await;
    assert!(matches!(
        store.cancel("op-2", None, at(20)).await.unwrap(),
        CancelOutcome::Cancelled { .. }
    ));
    assert_eq!(
        store.attempts("op-2").await.unwrap()[0].state,
        DispatchState::Abandoned
    );
    assert_eq!(
        store
            .commit("op-2", generation, Revision(1), &assistant_turn("x", 0), at(21))
            .await
            .unwrap(),
        CommitOutcome::Refused(CommitRefusal::WrongState(DispatchState::Abandoned))
    );
}

/// Issue 47: a lease that ran out by the store's clock is not renewed, even by its holder (who
/// promised to have stopped by then); one still running is.
pub async fn a_lease_that_ran_out_is_not_renewed(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    // Begun with a lease to 5,000 by the store's clock.
    let generation = prepared_and_begun(&*store, "op-1", "c", 1).await;
    assert!(matches!(
        store
            .renew_lease("op-1", generation, &lease("replica-a", 10_000), at(5_000))
            .await
            .unwrap(),
        TransitionOutcome::Refused { .. }
    ));
    assert_eq!(
        store.attempts("op-1").await.unwrap()[0].lease_expires_at,
        at(5_000)
    );
    assert_eq!(
        store
            .renew_lease("op-1", generation, &lease("replica-a", 10_000), at(4_999))
            .await
            .unwrap(),
        TransitionOutcome::Applied
    );
    assert_eq!(
        store.attempts("op-1").await.unwrap()[0].lease_expires_at,
        at(10_000)
    );
}

pub async fn leases_are_fenced_by_generation_and_rearm_waits_for_the_old_lease(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let generation = prepared_and_begun(&*store, "op-1", "c", 1).await;
    assert_eq!(
        store
            .renew_lease("op-1", generation, &lease("replica-a", 8_000), at(4_999))
            .await
            .unwrap(),
        TransitionOutcome::Applied
    );
    assert!(matches!(
        store
            .renew_lease("op-1", generation, &lease("replica-b", 9_000), at(100))
            .await
            .unwrap(),
        TransitionOutcome::Refused { .. }
    ));
    assert!(matches!(
        store
            .renew_lease("op-1", Generation(7), &lease("replica-a", 9_000), at(100))
            .await
            .unwrap(),
        TransitionOutcome::Refused { .. }
    ));
    assert_eq!(
        store
            .transition(
                "op-1",
                generation,
                DispatchState::Dispatching,
                DispatchState::Unknown,
                at(100)
            )
            .await
            .unwrap(),
        TransitionOutcome::Applied
    );
    assert!(
        matches!(
            store
                .abandon_and_rearm("op-1", generation, false, at(7_999))
                .await
                .unwrap(),
            TransitionOutcome::Refused { .. }
        ),
        "no new generation while the old lease runs"
    );
    assert_eq!(
        store.dispatch("op-1").await.unwrap().unwrap().state,
        DispatchState::Unknown
    );
    assert_eq!(
        store
            .abandon_and_rearm("op-1", generation, true, at(200))
            .await
            .unwrap(),
        TransitionOutcome::Applied,
        "the provider confirmed the attempt ended"
    );
    let attempts = store.attempts("op-1").await.unwrap();
    assert_eq!(attempts[0].state, DispatchState::Abandoned);
    assert_eq!(
        store.dispatch("op-1").await.unwrap().unwrap().state,
        DispatchState::Prepared
    );
    assert!(matches!(
        store
            .renew_lease("op-1", generation, &lease("replica-a", 9_000), at(200))
            .await
            .unwrap(),
        TransitionOutcome::Refused { .. }
    ));
    // An illegal edge is our own bug: an error, and nothing is written.
    assert!(matches!(
        store
            .transition(
                "op-1",
                generation,
                DispatchState::Prepared,
                DispatchState::Committed,
                at(201)
            )
            .await,
        Err(StoreError::IllegalTransition { .. })
    ));
}

pub async fn a_replay_keeps_the_generation_and_its_idempotency_key(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let generation = prepared_and_begun(&*store, "op-1", "c", 1).await;
    let key = store.attempts("op-1").await.unwrap()[0].idempotency_key.clone();
    let _ = store
        .transition(
            "op-1",
            generation,
            DispatchState::Dispatching,
            DispatchState::Unknown,
            at(20),
        )
        .await
        .unwrap();
    assert_eq!(
        store
            .replay_attempt("op-1", generation, &lease("replica-b", 9_000), at(21))
            .await
            .unwrap(),
        TransitionOutcome::Applied
    );
    let attempts = store.attempts("op-1").await.unwrap();
    assert_eq!(attempts.len(), 1, "no new generation");
    assert_eq!(attempts[0].state, DispatchState::Dispatching);
    assert_eq!(attempts[0].idempotency_key, key);
    assert_eq!(attempts[0].lease_holder, "replica-b");
    assert!(matches!(
        store
            .replay_attempt("op-1", generation, &lease("replica-b", 9_000), at(22))
            .await
            .unwrap(),
        TransitionOutcome::Refused { .. }
    ));
}

pub async fn tool_results_need_the_current_claim_and_append_tool_turns_through_the_validator(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let generation = prepared_and_begun(&*store, "op-1", "c", 1).await;
    to_streaming(&*store, "op-1", generation).await;
    let _ = store
        .commit("op-1", generation, Revision(1), &assistant_turn("a", 2), at(20))
        .await
        .unwrap();
    // While results are pending, a user turn would leave calls unanswered: refused.
    assert!(matches!(
        store
            .append_turn("c", Revision(2), &user_turn("u-early"), at(21))
            .await
            .unwrap(),
        AppendOutcome::Rejected(_)
    ));
    let content = json!([{"kind": "text", "text": "12C"}]);
    assert_eq!(
        store
            .submit_tool_result("c", "a-call-0", 1, "success", &content, at(22))
            .await
            .unwrap(),
        ResultOutcome::StaleClaim,
        "not claimed yet"
    );
    let ClaimOutcome::Claimed { claim } = store
        .claim_tool_call("c", "a-call-0", &lease("exec-1", 600_023), at(23))
        .await
        .unwrap()
    else {
        panic!("claim failed");
    };
    assert_eq!(
        store
            .claim_tool_call("c", "a-call-0", &lease("exec-2", 2_000), at(24))
            .await
            .unwrap(),
        ClaimOutcome::Unavailable {
            state: ToolCallState::Claimed
        }
    );
    // The first executor's lease expires (shortened to 1 ms; the store's clock decides when it
    // ran out); a second one re-claims with a new fencing token.
    assert!(matches!(
        store.renew_call("c", "a-call-0", claim, 1).await.unwrap(),
        RenewOutcome::Renewed { .. }
    ));
    wait_until_not_claimed(&*store, "c", "a-call-0").await;
    let ClaimOutcome::Claimed { claim: second } = store
        .claim_tool_call("c", "a-call-0", &lease("exec-2", 3_000), at(1_000))
        .await
        .unwrap()
    else {
        panic!("re-claim after expiry failed");
    };
    assert!(second > claim);
    assert_eq!(
        store
            .submit_tool_result("c", "a-call-0", claim, "success", &content, at(1_001))
            .await
            .unwrap(),
        ResultOutcome::StaleClaim
    );
    assert_eq!(
        store
            .submit_tool_result("c", "a-call-0", second, "success", &content, at(1_002))
            .await
            .unwrap(),
        ResultOutcome::Appended {
            revision: Revision(3)
        }
    );
    assert_eq!(
        store
            .submit_tool_result("c", "a-call-0", second, "success", &content, at(1_003))
            .await
            .unwrap(),
        ResultOutcome::Duplicate
    );
    assert_eq!(store.counters().await.unwrap().tool_result_duplicates, 1);
    let ClaimOutcome::Claimed { claim } = store
        .claim_tool_call("c", "a-call-1", &lease("exec-1", 3_000), at(1_004))
        .await
        .unwrap()
    else {
        panic!("claim failed");
    };
    assert!(matches!(
        store
            .submit_tool_result("c", "a-call-1", claim, "not-a-status", &content, at(1_005))
            .await
            .unwrap(),
        ResultOutcome::Rejected(_)
    ));
    assert_eq!(
        store
            .submit_tool_result("c", "a-call-1", claim, "error", &content, at(1_006))
            .await
            .unwrap(),
        ResultOutcome::Appended {
            revision: Revision(4)
        }
    );
    assert_eq!(
        store
            .claim_tool_call("c", "nope", &lease("exec-1", 3_000), at(1_007))
            .await
            .unwrap(),
        ClaimOutcome::NotFound
    );
    let done = store.tool_calls(Some(ToolCallState::Done)).await.unwrap();
    assert_eq!(done.len(), 2);
    assert_eq!(done[0].result_revision, Some(Revision(3)));
    let document = store.conversation("c").await.unwrap().unwrap();
    assert_eq!(document["turns"][2]["blocks"][0]["generation"], 1);
    assert_eq!(
        store
            .append_turn("c", Revision(4), &user_turn("u-next"), at(1_008))
            .await
            .unwrap(),
        AppendOutcome::Appended {
            revision: Revision(5)
        }
    );
    check_invariants(&*store, &["c".into()]).await;
}

pub async fn startup_recovery_marks_live_attempts_unknown_but_not_another_replicas_leased_ones(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    conversation_at_1(&*store, "d").await;
    conversation_at_1(&*store, "e").await;
    let mine = prepared_and_begun(&*store, "op-mine", "c", 1).await; // holder replica-a, lease 5_000
    to_streaming(&*store, "op-mine", mine).await;
    let (manifest, bytes) = manifest("op-theirs", "d", 1, "m");
    let _ = store.prepare(&manifest, &bytes, at(10)).await.unwrap();
    let expect = BeginExpect {
        revision: Revision(1),
        cancel_generation: 0,
        target: 0,
    };
    let _ = store
        .begin_attempt("op-theirs", expect, &lease("replica-b", 50_000), at(11))
        .await
        .unwrap();
    let (manifest, bytes) = crate::support::manifest("op-expired", "e", 1, "m");
    let _ = store.prepare(&manifest, &bytes, at(10)).await.unwrap();
    let _ = store
        .begin_attempt("op-expired", expect, &lease("replica-c", 1_000), at(11))
        .await
        .unwrap();

    let report = store.recover_startup("replica-a", at(2_000)).await.unwrap();
    assert_eq!(report.marked_unknown, 2);
    let unknown: Vec<_> = report
        .unknown
        .iter()
        .map(|attempt| attempt.operation_id.as_str())
        .collect();
    assert_eq!(unknown, vec!["op-expired", "op-mine"]);
    assert_eq!(
        store.dispatch("op-theirs").await.unwrap().unwrap().state,
        DispatchState::Dispatching
    );
    assert_eq!(
        store.dispatch("op-mine").await.unwrap().unwrap().state,
        DispatchState::Unknown
    );
    // Running it again changes nothing.
    assert_eq!(
        store
            .recover_startup("replica-a", at(2_001))
            .await
            .unwrap()
            .marked_unknown,
        0
    );
}

/// Issue 49 item 6: a drained process that closed its provider connections gives its live
/// attempts up. Their leases end at the release (the store's clock) and they become UNKNOWN
/// with `end_reason = shutting_down`, so the sweep of any replica (which sees only expired
/// leases) recovers them at once; another holder's attempt keeps its lease and state.
pub async fn a_drained_holder_releases_only_its_own_live_attempts_to_recovery_at_once(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    conversation_at_1(&*store, "d").await;
    let mine = prepared_and_begun(&*store, "op-mine", "c", 1).await; // holder replica-a, lease 5_000
    to_streaming(&*store, "op-mine", mine).await;
    let (manifest, bytes) = manifest("op-theirs", "d", 1, "m");
    let _ = store.prepare(&manifest, &bytes, at(10)).await.unwrap();
    let expect = BeginExpect {
        revision: Revision(1),
        cancel_generation: 0,
        target: 0,
    };
    let _ = store
        .begin_attempt("op-theirs", expect, &lease("replica-b", 50_000), at(11))
        .await
        .unwrap();
    // Before the release a sweep (a holder no lease uses) finds nothing to recover.
    assert_eq!(
        store
            .recover_startup("sweep", at(1_000))
            .await
            .unwrap()
            .unknown
            .len(),
        0
    );

    assert_eq!(store.release_holder("replica-a", at(1_000)).await.unwrap(), 1);
    let record = store.dispatch("op-mine").await.unwrap().unwrap();
    assert_eq!(record.state, DispatchState::Unknown);
    let attempts = store.attempts("op-mine").await.unwrap();
    assert_eq!(
        attempts[0].lease_expires_at,
        at(1_000),
        "the lease ends at the release"
    );
    assert_eq!(attempts[0].end_reason.as_deref(), Some("shutting_down"));
    assert_eq!(attempts[0].state, DispatchState::Unknown);
    let theirs = store.attempts("op-theirs").await.unwrap();
    assert_eq!(
        theirs[0].lease_expires_at,
        at(50_000),
        "another holder's lease is untouched"
    );
    assert_eq!(
        store.dispatch("op-theirs").await.unwrap().unwrap().state,
        DispatchState::Dispatching
    );
    // A sweep right after finds it, and recovery need not wait for the old lease.
    let report = store.recover_startup("sweep", at(1_001)).await.unwrap();
    let unknown: Vec<_> = report.unknown.iter().map(|a| a.operation_id.as_str()).collect();
    assert_eq!(unknown, vec!["op-mine"]);
    let attempt = &report.unknown[0];
    let decision = recovery_decision(
        &UnknownAttempt {
            generation: attempt.generation,
            handle: attempt.handle.clone(),
            idempotency_key: attempt.idempotency_key.clone(),
            lease_expires_at: attempt.lease_expires_at,
            provider_confirmed_ended: false,
        },
        ProviderRecovery::default(),
        at(1_001),
    );
    assert_eq!(
        decision,
        RecoveryDecision::AbandonThenNewGeneration {
            generation: attempt.generation
        }
    );
    // Releasing again changes nothing.
    assert_eq!(store.release_holder("replica-a", at(1_002)).await.unwrap(), 0);
    check_invariants(&*store, &["c".into(), "d".into()]).await;
}

pub async fn recovery_after_a_dead_lease_resends_the_stored_bytes_under_a_new_generation(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let first = prepared_and_begun(&*store, "op-1", "c", 1).await;
    let report = store.recover_startup("replica-a", at(100)).await.unwrap();
    let attempt = &report.unknown[0];
    let unknown = UnknownAttempt {
        generation: attempt.generation,
        handle: attempt.handle.clone(),
        idempotency_key: attempt.idempotency_key.clone(),
        lease_expires_at: attempt.lease_expires_at,
        provider_confirmed_ended: false,
    };
    let provider = ProviderRecovery::default();
    assert_eq!(
        recovery_decision(&unknown, provider, at(100)),
        RecoveryDecision::WaitUntil(at(5_000))
    );
    let RecoveryDecision::AbandonThenNewGeneration { generation } =
        recovery_decision(&unknown, provider, at(5_000))
    else {
        panic!("no new generation after the lease");
    };
    assert_eq!(generation, first);
    assert_eq!(
        store
            .abandon_and_rearm("op-1", generation, false, at(5_000))
            .await
            .unwrap(),
        TransitionOutcome::Applied
    );
    let record = store.dispatch("op-1").await.unwrap().unwrap();
    let BeginOutcome::Began {
        generation: second,
        idempotency_key,
    } = store
        .begin_attempt(
            "op-1",
            BeginExpect {
                revision: record.revision,
                cancel_generation: record.cancel_generation,
                target: 0,
            },
            &lease("replica-a", 10_000),
            at(5_001),
        )
        .await
        .unwrap()
    else {
        panic!("begin refused");
    };
    assert_eq!(second, Generation(2));
    assert_ne!(idempotency_key, attempt.idempotency_key);
    // The bytes to re-send are the stored ones, byte for byte.
    assert_eq!(record.request_bytes, request_bytes("op-1"));
    assert_eq!(
        turnstile_core::Digest::of_bytes(&record.request_bytes).as_str(),
        record.request_digest
    );
}

pub async fn a_drop_before_commit_leaves_nothing_and_a_retry_succeeds(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let (manifest, bytes) = manifest("op-1", "c", 1, "m");
    store.faults().arm(Fault::DropBeforeCommit);
    assert!(matches!(
        store.prepare(&manifest, &bytes, at(10)).await,
        Err(StoreError::ConnectionLost(_))
    ));
    assert_eq!(store.dispatch("op-1").await.unwrap(), None);
    assert!(matches!(
        store.prepare(&manifest, &bytes, at(11)).await.unwrap(),
        PrepareOutcome::Created(_)
    ));
    let expect = BeginExpect {
        revision: Revision(1),
        cancel_generation: 0,
        target: 0,
    };
    store.faults().arm(Fault::DropBeforeCommit);
    assert!(
        store
            .begin_attempt("op-1", expect, &lease("a", 5_000), at(12))
            .await
            .is_err()
    );
    assert!(
        store.attempts("op-1").await.unwrap().is_empty(),
        "no DISPATCHING row, so nothing may be sent"
    );
    assert!(matches!(
        store
            .begin_attempt("op-1", expect, &lease("a", 5_000), at(13))
            .await
            .unwrap(),
        BeginOutcome::Began {
            generation: Generation(1),
            ..
        }
    ));
}

pub async fn a_drop_after_commit_is_answered_by_the_retry_without_a_second_turn(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let (manifest, bytes) = manifest("op-1", "c", 1, "m");
    store.faults().arm(Fault::DropAfterCommit);
    assert!(store.prepare(&manifest, &bytes, at(10)).await.is_err());
    assert!(matches!(
        store.prepare(&manifest, &bytes, at(11)).await.unwrap(),
        PrepareOutcome::Existing(_)
    ));
    let expect = BeginExpect {
        revision: Revision(1),
        cancel_generation: 0,
        target: 0,
    };
    store.faults().arm(Fault::DropAfterCommit);
    assert!(
        store
            .begin_attempt("op-1", expect, &lease("a", 5_000), at(12))
            .await
            .is_err()
    );
    // The begin landed: a retry is refused and reports the generation to continue with.
    assert_eq!(
        store
            .begin_attempt("op-1", expect, &lease("a", 5_000), at(13))
            .await
            .unwrap(),
        BeginOutcome::Refused {
            state: Some(DispatchState::Dispatching),
            active_generation: Some(Generation(1)),
        }
    );
    to_streaming(&*store, "op-1", Generation(1)).await;
    let turn = assistant_turn("a", 2);
    store.faults().arm(Fault::DropAfterCommit);
    assert!(
        store
            .commit("op-1", Generation(1), Revision(1), &turn, at(20))
            .await
            .is_err()
    );
    assert_eq!(
        store
            .commit("op-1", Generation(1), Revision(1), &turn, at(21))
            .await
            .unwrap(),
        CommitOutcome::Committed {
            revision: Revision(2),
            tool_calls: vec!["a-call-0".into(), "a-call-1".into()],
        }
    );
    assert_eq!(store.conversation("c").await.unwrap().unwrap()["revision"], 2);
    assert!(store.quarantined(10).await.unwrap().is_empty());
    check_invariants(&*store, &["c".into()]).await;
}

pub async fn quarantine_is_bounded_per_dispatch(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let generation = prepared_and_begun(&*store, "op-1", "c", 1).await;
    let entry = QuarantineEntry {
        operation_id: "op-1".into(),
        generation,
        reason: "late".into(),
        content: json!({"kind": "text", "text": "x"}),
    };
    // Concurrently, so SQLite's group commit keeps this quick.
    let store = std::sync::Arc::new(store);
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..QUARANTINE_PER_DISPATCH_MAX + 3 {
        let (store, entry) = (store.clone(), entry.clone());
        tasks.spawn(async move { store.quarantine(&entry, at(index)).await.unwrap() });
    }
    let mut recorded = 0;
    while let Some(result) = tasks.join_next().await {
        if result.unwrap() {
            recorded += 1;
        }
    }
    assert_eq!(recorded, QUARANTINE_PER_DISPATCH_MAX);
    let counters = store.counters().await.unwrap();
    assert_eq!(counters.quarantine_dropped, 3);
    assert_eq!(counters.late_blocks, QUARANTINE_PER_DISPATCH_MAX);
    let unknown = QuarantineEntry {
        operation_id: "nope".into(),
        ..entry
    };
    assert!(!store.quarantine(&unknown, at(0)).await.unwrap());
}

pub async fn a_tool_turn_appended_directly_closes_its_calls_in_the_ledger(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let generation = prepared_and_begun(&*store, "op-1", "c", 1).await;
    to_streaming(&*store, "op-1", generation).await;
    let _ = store
        .commit("op-1", generation, Revision(1), &assistant_turn("a", 2), at(20))
        .await
        .unwrap();
    // A plain commit records no outcome.
    assert_eq!(store.dispatch("op-1").await.unwrap().unwrap().outcome, None);
    // The committed calls find their conversation, filtered by id prefix.
    assert_eq!(
        store.conversations_with_call("a-call-1", "").await.unwrap(),
        vec!["c".to_owned()]
    );
    assert_eq!(
        store.conversations_with_call("a-call-1", "c").await.unwrap(),
        vec!["c".to_owned()]
    );
    assert!(
        store
            .conversations_with_call("a-call-1", "other~")
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .conversations_with_call("a-call-9", "")
            .await
            .unwrap()
            .is_empty()
    );
    let calls = store.tool_calls(None).await.unwrap();
    let digest_of = |call_id: &str| {
        calls
            .iter()
            .find(|call| call.call_id == call_id)
            .map(|call| call.args_digest.clone())
            .unwrap()
    };
    // Every result carries its call's tool, args digest and generation (spec §1).
    let results = json!({"id": "t-results", "role": "tool", "blocks": [
        {"id": "r0", "kind": "tool_result", "call_id": "a-call-0", "tool": "get_weather",
         "args_digest": digest_of("a-call-0"), "generation": 1, "status": "success", "content": []},
        {"id": "r1", "kind": "tool_result", "call_id": "a-call-1", "tool": "get_weather",
         "args_digest": digest_of("a-call-1"), "generation": 1, "status": "success", "content": []}]});
    assert_eq!(
        store
            .append_turn("c", Revision(2), &results, at(21))
            .await
            .unwrap(),
        AppendOutcome::Appended {
            revision: Revision(3)
        }
    );
    let done = store.tool_calls(Some(ToolCallState::Done)).await.unwrap();
    assert_eq!(done.len(), 2);
    assert!(done.iter().all(|call| call.result_revision == Some(Revision(3))));
    assert!(
        store
            .tool_calls(Some(ToolCallState::Ready))
            .await
            .unwrap()
            .is_empty()
    );
    let ClaimOutcome::Unavailable { state } = store
        .claim_tool_call("c", "a-call-0", &lease("exec", 1_000), at(22))
        .await
        .unwrap()
    else {
        panic!("an answered call was claimable");
    };
    assert_eq!(state, ToolCallState::Done);
    check_invariants(&*store, &["c".into()]).await;
}

pub async fn a_repair_appends_its_turn_and_its_record_together_and_both_survive_a_reopen(
    backend: Backend,
    name: &str,
) {
    use turnstile_core::repair::{self, Cause, Options};
    let place = place(backend, name).await;
    let plan = {
        let store = open_at(&place, 2).await;
        conversation_at_1(&*store, "c").await;
        let generation = prepared_and_begun(&*store, "op-1", "c", 1).await;
        to_streaming(&*store, "op-1", generation).await;
        let _ = store
            .commit("op-1", generation, Revision(1), &assistant_turn("a", 2), at(20))
            .await
            .unwrap();
        // Two calls nobody will answer: the repair closes them with gateway cancels.
        let document = store.conversation("c").await.unwrap().unwrap();
        let plan = repair::plan(&document, Options { close_pending: true }).unwrap();
        assert_eq!(plan.counts().get(&Cause::PendingCall), Some(&2));
        let repaired = repair::apply(&plan, &document).unwrap();
        let turn = repaired["turns"].as_array().unwrap().last().unwrap().clone();
        let record = NewRepair {
            plan_digest: plan.digest.as_str().to_owned(),
            plan: serde_json::to_value(&plan).unwrap(),
            tenant: Some("acme".into()),
            actor: Some("ops@example".into()),
        };
        // A stale revision and an illegal turn write neither the turn nor the record.
        assert_eq!(
            store
                .append_repair("c", Revision(1), &turn, &record, at(30))
                .await
                .unwrap(),
            AppendOutcome::Conflict { current: Revision(2) }
        );
        let orphan = json!({"id": "t-orphan", "role": "tool", "blocks": [{"id": "r", "kind": "tool_result",
            "call_id": "call-none", "tool": "get_weather", "status": "success", "content": []}]});
        assert!(matches!(
            store
                .append_repair("c", Revision(2), &orphan, &record, at(30))
                .await
                .unwrap(),
            AppendOutcome::Rejected(_)
        ));
        assert!(store.repairs("c").await.unwrap().is_empty());
        assert_eq!(
            store
                .append_repair("c", Revision(2), &turn, &record, at(31))
                .await
                .unwrap(),
            AppendOutcome::Appended {
                revision: Revision(3)
            }
        );
        // The cancels close the calls in the execution ledger, as any tool turn does.
        assert_eq!(
            store.tool_calls(Some(ToolCallState::Done)).await.unwrap().len(),
            2
        );
        plan
    };
    let store = open_at(&place, 2).await;
    let records = store.repairs("c").await.unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].revision, Revision(3));
    assert_eq!(records[0].plan_digest, plan.digest.as_str());
    assert_eq!(records[0].plan, serde_json::to_value(&plan).unwrap());
    assert_eq!(records[0].tenant.as_deref(), Some("acme"));
    assert_eq!(records[0].actor.as_deref(), Some("ops@example"));
    assert_eq!(records[0].repaired_at, at(31));
    let document = store.conversation("c").await.unwrap().unwrap();
    assert_eq!(document["revision"], 3);
    assert!(store.repairs("nope").await.unwrap().is_empty());
    check_invariants(&*store, &["c".into()]).await;
}

pub async fn migrations_apply_once_and_a_newer_schema_is_refused(backend: Backend, name: &str) {
    let place = place(backend, name).await;
    {
        let store = open_at(&place, 2).await;
        conversation_at_1(&*store, "c").await;
    }
    // Reopening applies nothing again and keeps the data.
    {
        let store = open_at(&place, 2).await;
        assert_eq!(store.conversation("c").await.unwrap().unwrap()["revision"], 1);
    }
    let newer = migrations::latest() + 1;
    match backend {
        Backend::Sqlite => {
            let connection = rusqlite::Connection::open(place.sqlite_path()).unwrap();
            let versions: i64 = connection
                .query_row("SELECT COUNT(*) FROM schema_migrations", [], |row| row.get(0))
                .unwrap();
            assert_eq!(versions, migrations::MIGRATIONS.len() as i64);
            connection
                .execute(
                    "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?1, 'future', 0)",
                    [newer],
                )
                .unwrap();
            assert!(matches!(
                SqliteLedger::open(place.sqlite_path(), Synchronous::Full),
                Err(StoreError::SchemaTooNew { .. })
            ));
        }
        Backend::Postgres => {
            let (client, connection) = tokio_postgres::connect(&pg_url(), tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(connection);
            let table = format!("{}.schema_migrations", place.schema);
            let versions: i64 = client
                .query_one(&format!("SELECT COUNT(*) FROM {table}"), &[])
                .await
                .unwrap()
                .get(0);
            assert_eq!(versions, migrations::MIGRATIONS.len() as i64);
            client
                .execute(
                    &format!("INSERT INTO {table} (version, name, applied_at) VALUES ($1, 'future', 0)"),
                    &[&newer],
                )
                .await
                .unwrap();
            assert!(matches!(
                PgLedger::connect(&pg_url(), Some(&place.schema), 2).await,
                Err(StoreError::SchemaTooNew { .. })
            ));
        }
    }
}

pub async fn an_import_writes_a_whole_legal_history_at_once_or_nothing(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    let assistant = {
        let mut turn = assistant_turn("a", 1);
        turn["generation"] = json!(1);
        turn
    };
    // Orphan result after the calls: the whole import is refused and nothing exists afterwards.
    let orphan = json!({"id": "t-r", "role": "tool", "blocks": [{"id": "r", "kind": "tool_result",
        "call_id": "call-none", "tool": "get_weather", "status": "success", "content": []}]});
    let turns = vec![user_turn("u1"), assistant.clone(), orphan];
    let ImportOutcome::Rejected(violations) = store
        .import_conversation("c", &tools(), &turns, at(1))
        .await
        .unwrap()
    else {
        panic!("an orphan result was imported");
    };
    assert!(
        violations
            .iter()
            .any(|violation| violation.code == ViolationCode::OrphanResult)
    );
    assert!(store.conversation("c").await.unwrap().is_none());

    // A legal history: one transaction, revisions 1..n, and no execution-ledger rows.
    let turns = vec![user_turn("u1"), assistant, user_turn("u2")];
    let turns = {
        let mut turns = turns;
        // The call needs its result before the next user turn.
        let digest = turnstile_core::Digest::of_value(&json!({"city": "c0"}))
            .as_str()
            .to_owned();
        turns.insert(
            2,
            json!({"id": "t-r", "role": "tool", "blocks": [{"id": "r", "kind": "tool_result",
            "call_id": "a-call-0", "tool": "get_weather", "args_digest": digest, "generation": 1,
            "status": "success", "content": [{"kind": "text", "text": "sun"}]}]}),
        );
        turns
    };
    assert_eq!(
        store
            .import_conversation("c", &tools(), &turns, at(2))
            .await
            .unwrap(),
        ImportOutcome::Created {
            revision: Revision(4)
        }
    );
    let document = store.conversation("c").await.unwrap().unwrap();
    assert_eq!(document["revision"], 4);
    let revisions: Vec<u64> = document["turns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|turn| turn["revision"].as_u64().unwrap())
        .collect();
    assert_eq!(revisions, vec![1, 2, 3, 4]);
    assert!(store.tool_calls(None).await.unwrap().is_empty());
    // The same id again changes nothing.
    assert_eq!(
        store
            .import_conversation("c", &tools(), &turns[..1], at(3))
            .await
            .unwrap(),
        ImportOutcome::AlreadyExists {
            revision: Revision(4)
        }
    );
    // Imported calls are not in the execution ledger, so nothing finds "c" by them.
    assert!(
        store
            .conversations_with_call("a-call-0", "")
            .await
            .unwrap()
            .is_empty()
    );
    // The imported conversation takes appends like any other.
    assert_eq!(
        store
            .append_turn("c", Revision(4), &assistant_turn("b", 0), at(4))
            .await
            .unwrap(),
        AppendOutcome::Appended {
            revision: Revision(5)
        }
    );
}

/// Issue 21's two durable writes: the prepare that begins the first attempt, then the commit
/// that carries SENT, STREAMING and the handle (a history row each). A carried handle to bind
/// that is bound to another manifest refuses the commit and moves nothing; one only recorded
/// commits; a prepare of an existing dispatch begins nothing.
pub async fn prepare_and_begin_is_one_write_and_the_commit_carries_sent_streaming_and_the_handle(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    conversation_at_1(&*store, "d").await;
    let begin = begin_at_once();
    let writes = store.write_ops();
    let (manifest_c, bytes_c) = manifest("op-c", "c", 1, "m");
    let (prepared, began) = store
        .prepare_and_begin(&manifest_c, &bytes_c, None, &[], &begin, at(10))
        .await
        .unwrap();
    assert_eq!(store.write_ops() - writes, 1, "prepare and begin are one write");
    let PrepareOutcome::Created(record) = prepared else {
        panic!("not created: {prepared:?}")
    };
    assert_eq!(record.state, DispatchState::Dispatching);
    let Some(BeginOutcome::Began {
        generation,
        idempotency_key,
    }) = began
    else {
        panic!("not begun: {began:?}")
    };
    assert_eq!(generation, Generation(1));
    assert!(!idempotency_key.is_empty());
    let attempts = store.attempts("op-c").await.unwrap();
    assert_eq!(attempts[0].state, DispatchState::Dispatching);
    assert_eq!(attempts[0].lease_holder, "replica-a");
    // Asked again (a client's retry), the same manifest is the existing dispatch, not begun.
    let (again, began_again) = store
        .prepare_and_begin(&manifest_c, &bytes_c, None, &[], &begin, at(11))
        .await
        .unwrap();
    assert!(matches!(again, PrepareOutcome::Existing(_)), "{again:?}");
    assert_eq!(began_again, None);
    assert_eq!(store.attempts("op-c").await.unwrap().len(), 1);
    // Another dispatch binds resp_x first; op-c's commit carrying resp_x is refused.
    let (manifest_d, bytes_d) = manifest("op-d", "d", 1, "m");
    let (_, began_d) = store
        .prepare_and_begin(&manifest_d, &bytes_d, None, &[], &begin, at(12))
        .await
        .unwrap();
    let Some(BeginOutcome::Began {
        generation: gen_d, ..
    }) = began_d
    else {
        panic!("op-d not begun")
    };
    assert_eq!(
        store.bind_handle("op-d", gen_d, "resp_x", at(13)).await.unwrap(),
        BindOutcome::Bound
    );
    let carried = |handle: &str| Carried {
        from: DispatchState::Dispatching,
        handle: Some(handle.to_owned()),
        bind: true,
        evidence: Vec::new(),
    };
    let turn = assistant_turn("a", 1);
    assert_eq!(
        store
            .commit_carrying(
                "op-c",
                generation,
                Revision(1),
                &turn,
                None,
                &carried("resp_x"),
                at(14)
            )
            .await
            .unwrap(),
        CommitOutcome::Refused(CommitRefusal::ForeignHandle)
    );
    assert_eq!(store.counters().await.unwrap().foreign_handle_refusals, 1);
    let attempt = &store.attempts("op-c").await.unwrap()[0];
    assert_eq!(
        (attempt.state, attempt.handle.clone()),
        (DispatchState::Dispatching, None)
    );
    assert_eq!(store.conversation("c").await.unwrap().unwrap()["revision"], 1);
    // The same handle recorded without binding it (a fresh send's answer came on its own
    // connection whatever id it names: issue 48, item 1) commits, from DISPATCHING, in one
    // write with every state on the way.
    let writes = store.write_ops();
    let outcome = store
        .commit_carrying(
            "op-c",
            generation,
            Revision(1),
            &turn,
            None,
            &Carried {
                bind: false,
                ..carried("resp_x")
            },
            at(15),
        )
        .await
        .unwrap();
    assert!(
        matches!(&outcome, CommitOutcome::Committed { revision, tool_calls } if *revision == Revision(2) && tool_calls.len() == 1),
        "{outcome:?}"
    );
    assert_eq!(store.write_ops() - writes, 1, "the commit is one write");
    let attempt = &store.attempts("op-c").await.unwrap()[0];
    let states: Vec<DispatchState> = attempt.history.iter().map(|(state, _)| *state).collect();
    assert_eq!(
        states,
        [
            DispatchState::Dispatching,
            DispatchState::Sent,
            DispatchState::Streaming,
            DispatchState::Committed
        ]
    );
    assert_eq!(attempt.handle.as_deref(), Some("resp_x"));
    assert_eq!(store.counters().await.unwrap().foreign_handle_refusals, 1);
    assert_eq!(store.tool_calls(None).await.unwrap().len(), 1);
    // A commit cannot carry an attempt from a state that is not on the way to COMMITTED.
    assert!(
        store
            .commit_carrying(
                "op-d",
                gen_d,
                Revision(1),
                &turn,
                None,
                &Carried {
                    from: DispatchState::Unknown,
                    handle: None,
                    bind: true,
                    evidence: Vec::new(),
                },
                at(16)
            )
            .await
            .is_err()
    );
}

/// Issue 21: the store keeps the validator's state after each write, so the next append or
/// commit checks the new turn only (`Ledger::history_walks` counts the whole-history walks),
/// and refuses exactly what the whole check refuses: a call id already used in the history, a
/// user turn while calls are open. Another ledger on the same store (a second replica) keeps
/// nothing of this one's and walks once.
pub async fn appends_and_commits_after_the_first_check_only_the_new_turn_and_refuse_the_same(
    backend: Backend,
    name: &str,
) {
    let (place, store) = open_fresh(backend, name).await;
    // Whole-history walks inside the write transaction, for `walks` walks: SQLite walks on the
    // caller, never on its one writer thread; PostgreSQL in the operation's own transaction.
    let in_transaction = |walks: u64| match backend {
        Backend::Sqlite => 0,
        Backend::Postgres => walks,
    };
    let walks = store.history_walks();
    conversation_at_1(&*store, "c").await;
    assert_eq!(
        store.history_walks() - walks,
        0,
        "a created conversation keeps the state of its empty history: its first turn walks nothing"
    );
    let walks = store.history_walks();
    // An agent loop: a commit with a call, its result, the next user turn, the next commit.
    let one = prepared_and_begun(&*store, "op-1", "c", 1).await;
    for state in [DispatchState::Sent, DispatchState::Streaming] {
        let from = if state == DispatchState::Sent {
            DispatchState::Dispatching
        } else {
            DispatchState::Sent
        };
        store.transition("op-1", one, from, state, at(20)).await.unwrap();
    }
    let committed = store
        .commit("op-1", one, Revision(1), &assistant_turn("a1", 1), at(21))
        .await
        .unwrap();
    let CommitOutcome::Committed { tool_calls, .. } = committed else {
        panic!("{committed:?}")
    };
    let calls = store.tool_calls(None).await.unwrap();
    let call = &calls[0];
    let claimed = store
        .claim_call("c", &tool_calls[0], "executor", 10_000)
        .await
        .unwrap();
    let CallClaimOutcome::Claimed(CallClaim { claim, .. }) = claimed else {
        panic!("{claimed:?}")
    };
    let result = store
        .submit_tool_result(
            "c",
            &call.call_id,
            claim,
            "success",
            &json!([{"kind": "text", "text": "12C"}]),
            at(22),
        )
        .await
        .unwrap();
    assert!(
        matches!(result, ResultOutcome::Appended { revision } if revision == Revision(3)),
        "{result:?}"
    );
    let appended = store
        .append_turn("c", Revision(3), &user_turn("c-u2"), at(23))
        .await
        .unwrap();
    assert_eq!(
        appended,
        AppendOutcome::Appended {
            revision: Revision(4)
        }
    );
    assert_eq!(
        store.history_walks() - walks,
        0,
        "after the conversation's first turn, the commit, the result and the next turn checked themselves only"
    );
    // The same refusals as the whole check: a user turn after a user turn is legal, but a
    // turn reusing a block id of the history is not, nor one reusing a turn id.
    let reused_block =
        json!({"id": "c-u3", "role": "user", "blocks": [{"id": "c-u2-b", "kind": "text", "text": "Again?"}]});
    let refused = store
        .append_turn("c", Revision(4), &reused_block, at(24))
        .await
        .unwrap();
    let AppendOutcome::Rejected(violations) = refused else {
        panic!("{refused:?}")
    };
    assert_eq!(
        violations[0].code,
        ViolationCode::InvalidStructure,
        "{violations:?}"
    );
    assert!(
        violations[0].message.contains("duplicate block id"),
        "{violations:?}"
    );
    // A refused check leaves no state: the next one walks the history again, and still refuses
    // a reused turn id.
    let (walks, in_tx) = (store.history_walks(), store.history_walks_in_transaction());
    let reused_turn =
        json!({"id": "c-u2", "role": "user", "blocks": [{"id": "c-u4-b", "kind": "text", "text": "Again?"}]});
    let refused = store
        .append_turn("c", Revision(4), &reused_turn, at(25))
        .await
        .unwrap();
    assert!(matches!(refused, AppendOutcome::Rejected(_)), "{refused:?}");
    assert_eq!(store.history_walks() - walks, 1);
    assert_eq!(
        store.history_walks_in_transaction() - in_tx,
        in_transaction(1),
        "{backend:?}: where the refused append walked"
    );
    let fine =
        json!({"id": "c-u5", "role": "user", "blocks": [{"id": "c-u5-b", "kind": "text", "text": "Now?"}]});
    assert_eq!(
        store.append_turn("c", Revision(4), &fine, at(26)).await.unwrap(),
        AppendOutcome::Appended {
            revision: Revision(5)
        }
    );
    // A second ledger on the same store knows nothing of the first one's states.
    let other = open_at(&place, 2).await;
    let (walks, in_tx) = (other.history_walks(), other.history_walks_in_transaction());
    let next =
        json!({"id": "c-u6", "role": "user", "blocks": [{"id": "c-u6-b", "kind": "text", "text": "Later?"}]});
    assert_eq!(
        other.append_turn("c", Revision(5), &next, at(27)).await.unwrap(),
        AppendOutcome::Appended {
            revision: Revision(6)
        }
    );
    assert_eq!(other.history_walks() - walks, 1);
    assert_eq!(
        other.history_walks_in_transaction() - in_tx,
        in_transaction(1),
        "{backend:?}: where the second ledger's append walked"
    );
    // The first ledger's state is for revision 5: the conversation moved on, so it walks too,
    // and refuses a call id the other ledger's history holds.
    let (walks, in_tx) = (store.history_walks(), store.history_walks_in_transaction());
    let two = prepared_and_begun(&*store, "op-2", "c", 6).await;
    for (from, to) in [
        (DispatchState::Dispatching, DispatchState::Sent),
        (DispatchState::Sent, DispatchState::Streaming),
    ] {
        store.transition("op-2", two, from, to, at(28)).await.unwrap();
    }
    let reused_call = assistant_turn("a1", 1);
    let refused = store
        .commit("op-2", two, Revision(6), &reused_call, at(29))
        .await
        .unwrap();
    assert!(matches!(refused, CommitOutcome::Rejected(_)), "{refused:?}");
    assert_eq!(store.history_walks() - walks, 1);
    assert_eq!(
        store.history_walks_in_transaction() - in_tx,
        in_transaction(1),
        "{backend:?}: where the refused commit walked"
    );
}

/// Issue 21: `conversation_since` gives a reader that holds the history up to a revision what
/// it lacks: the current revision, the turns after its own (equal to the same turns of the
/// whole document) and the id of the turn at its revision, so a reader can tell the history it
/// holds from another one; nothing for an unknown conversation.
pub async fn a_reader_s_tail_is_the_turns_after_its_revision_and_names_the_turn_at_it(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    assert_eq!(
        store.conversation_since("nowhere", Revision(0)).await.unwrap(),
        None
    );
    store.create_conversation("c", &tools(), at(1)).await.unwrap();
    let empty = store.conversation_since("c", Revision(0)).await.unwrap().unwrap();
    assert_eq!(
        (empty.revision, empty.turn_id_at, empty.turns.len()),
        (Revision(0), None, 0)
    );
    for (index, id) in ["u1", "u2", "u3"].iter().enumerate() {
        let outcome = store
            .append_turn("c", Revision(index as u64), &user_turn(id), at(2 + index as u64))
            .await
            .unwrap();
        assert!(matches!(outcome, AppendOutcome::Appended { .. }), "{outcome:?}");
    }
    let whole = store.conversation("c").await.unwrap().unwrap();
    let turns = whole["turns"].as_array().unwrap();
    for after in 0..=3u64 {
        let tail = store
            .conversation_since("c", Revision(after))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(tail.revision, Revision(3));
        assert_eq!(tail.turns, turns[after as usize..].to_vec(), "after {after}");
        let at_after = (after > 0).then(|| turns[after as usize - 1]["id"].as_str().unwrap().to_owned());
        assert_eq!(tail.turn_id_at, at_after, "after {after}");
    }
    // A reader ahead of the store (another store's history under the same id) finds no turn at
    // its revision.
    let ahead = store.conversation_since("c", Revision(7)).await.unwrap().unwrap();
    assert_eq!(
        (ahead.revision, ahead.turn_id_at, ahead.turns.len()),
        (Revision(3), None, 0)
    );
}

/// Issue 49 item 7: each turn's row keeps `Turn::digest` of the turn as stored (appended or
/// imported), and the whole read and a reader's tail return it beside the turn, so a dispatch
/// that decodes the stored turn can tell a changed byte. Red while rows carry no digest.
pub async fn every_stored_turn_carries_the_digest_of_its_decoded_form_and_both_reads_return_it(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    let digest_of = |turn: &serde_json::Value| {
        Some(
            turnstile_core::conversation::Conversation::decode_turn(turn.clone())
                .unwrap()
                .0
                .digest()
                .as_str()
                .to_owned(),
        )
    };
    store.create_conversation("c", &tools(), at(1)).await.unwrap();
    for (index, id) in ["u1", "u2"].iter().enumerate() {
        let outcome = store
            .append_turn("c", Revision(index as u64), &user_turn(id), at(2 + index as u64))
            .await
            .unwrap();
        assert!(matches!(outcome, AppendOutcome::Appended { .. }), "{outcome:?}");
    }
    let imported = vec![user_turn("i1"), assistant_turn("i2", 0), user_turn("i3")];
    let outcome = store
        .import_conversation("d", &tools(), &imported, at(5))
        .await
        .unwrap();
    assert!(matches!(outcome, ImportOutcome::Created { .. }), "{outcome:?}");
    for conversation_id in ["c", "d"] {
        let stored = store
            .conversation_with_digests(conversation_id)
            .await
            .unwrap()
            .unwrap();
        let turns = stored.document["turns"].as_array().unwrap();
        let expected: Vec<_> = turns.iter().map(digest_of).collect();
        assert_eq!(stored.turn_digests, expected, "{conversation_id}");
        assert_eq!(
            Some(&stored.document),
            store.conversation(conversation_id).await.unwrap().as_ref()
        );
        let tail = store
            .conversation_since(conversation_id, Revision(1))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(tail.turn_digests, expected[1..], "{conversation_id}");
    }
    assert_eq!(store.conversation_with_digests("nowhere").await.unwrap(), None);
}

/// A database at `place` built by hand at schema `version` (every migration up to it, as an
/// older build left it). PostgreSQL: a client whose `search_path` is the place's schema, for the
/// caller's rows; SQLite: None (the caller opens the file).
async fn built_by_hand_at(place: &Place, version: i64) -> Option<tokio_postgres::Client> {
    let up_to = migrations::MIGRATIONS
        .iter()
        .filter(|migration| migration.version <= version);
    let ddl = "CREATE TABLE schema_migrations (version BIGINT PRIMARY KEY, name TEXT NOT NULL, applied_at BIGINT NOT NULL)";
    match place.backend {
        Backend::Sqlite => {
            let connection = rusqlite::Connection::open(place.sqlite_path()).unwrap();
            connection.execute_batch(ddl).unwrap();
            for migration in up_to {
                connection.execute_batch(migration.sqlite).unwrap();
                connection
                    .execute(
                        "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?1, ?2, 0)",
                        rusqlite::params![migration.version, migration.name],
                    )
                    .unwrap();
            }
            None
        }
        Backend::Postgres => {
            let (client, connection) = tokio_postgres::connect(&pg_url(), tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(connection);
            let schema = &place.schema;
            client
                .batch_execute(&format!(
                    "CREATE SCHEMA {schema}; SET search_path TO {schema}; {ddl}"
                ))
                .await
                .unwrap();
            for migration in up_to {
                client.batch_execute(migration.postgres).await.unwrap();
                client
                    .execute(
                        "INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, 0)",
                        &[&migration.version, &migration.name],
                    )
                    .await
                    .unwrap();
            }
            Some(client)
        }
    }
}

/// Migrations 8 and 9 move each dispatch's request bytes, then its manifest and render policy,
/// into `dispatch_bodies`: a database written at version 7 (all three in the dispatch row)
/// opens at the latest version with every body read back byte for byte and every manifest and
/// policy as stored, on both databases.
pub async fn a_version_7_database_keeps_every_request_body_manifest_and_policy_across_migrations_8_and_9(
    backend: Backend,
    name: &str,
) {
    let place = place(backend, name).await;
    let bodies: Vec<Vec<u8>> = [3usize, 300_000]
        .iter()
        .enumerate()
        .map(|(index, size)| (0..*size).map(|i| (i * 7 + index) as u8).collect())
        .collect();
    let conversation = "INSERT INTO conversations (conversation_id, revision, tools, created_at, updated_at) \
                        VALUES ('c', 0, '[]', 1, 1)";
    let dispatch = "INSERT INTO dispatches (operation_id, conversation_id, revision, manifest, manifest_digest, \
                    request_digest, request_bytes, provider, state, cancel_generation, generation_last, \
                    quarantined, created_at, updated_at, policy) \
                    VALUES ($1, 'c', 0, $2, 'md', 'rd', $3, 'p', 'FAILED', 0, 0, 0, 1, 1, $4)";
    let manifest_of = |index: usize| json!({"kept": index}).to_string();
    // The first dispatch has no policy (NULL, as before migration 6 filled it).
    let policy_of = |index: usize| (index > 0).then(|| json!({"policy": index}).to_string());
    match built_by_hand_at(&place, 7).await {
        None => {
            let connection = rusqlite::Connection::open(place.sqlite_path()).unwrap();
            connection.execute(conversation, []).unwrap();
            for (index, bytes) in bodies.iter().enumerate() {
                connection
                    .execute(
                        dispatch,
                        rusqlite::params![format!("op-{index}"), manifest_of(index), bytes, policy_of(index)],
                    )
                    .unwrap();
            }
        }
        Some(client) => {
            client.batch_execute(conversation).await.unwrap();
            for (index, bytes) in bodies.iter().enumerate() {
                client
                    .execute(
                        dispatch,
                        &[
                            &format!("op-{index}"),
                            &manifest_of(index),
                            bytes,
                            &policy_of(index),
                        ],
                    )
                    .await
                    .unwrap();
            }
        }
    }
    let store = open_at(&place, 2).await;
    for (index, expected) in bodies.iter().enumerate() {
        let record = store.dispatch(&format!("op-{index}")).await.unwrap().unwrap();
        assert_eq!(&record.request_bytes, expected, "op-{index}");
        assert_eq!(record.state, DispatchState::Failed);
        assert_eq!(record.manifest, json!({"kept": index}), "op-{index}");
        assert_eq!(
            store.dispatch_policy(&format!("op-{index}")).await.unwrap(),
            (index > 0).then(|| json!({"policy": index})),
            "op-{index}"
        );
    }
}

/// Migration 10 rebuilds `attempts` and `handles` without rowids and `transitions` without
/// AUTOINCREMENT (SQLite), and replaces both state indexes with partial ones holding only live
/// attempts and PREPARED dispatches (both databases). A database written at version 9 opens at
/// the latest version with every attempt, handle and transition as stored, in order; the
/// sweeps still find the PREPARED dispatch and the UNKNOWN attempt, and on SQLite each sweep's
/// plan reads its partial index, foreign keys hold, and a new transition's id follows the old.
pub async fn a_version_9_database_keeps_its_attempts_handles_and_transitions_and_sweeps_read_live_rows_only(
    backend: Backend,
    name: &str,
) {
    let place = place(backend, name).await;
    let rows = "INSERT INTO conversations (conversation_id, revision, tools, created_at, updated_at) \
                VALUES ('c', 0, '[]', 1, 1);
         INSERT INTO dispatches (operation_id, conversation_id, revision, manifest_digest, request_digest, \
           provider, state, cancel_generation, generation_last, active_generation, quarantined, created_at, updated_at) \
         VALUES ('op-prep', 'c', 0, 'md', 'rd', 'sim', 'PREPARED', 0, 0, NULL, 0, 1, 1), \
                ('op-live', 'c', 0, 'md', 'rd', 'sim', 'UNKNOWN', 0, 1, 1, 0, 1, 4), \
                ('op-done', 'c', 0, 'md', 'rd', 'sim', 'COMMITTED', 0, 1, 1, 0, 1, 6);
         INSERT INTO dispatch_bodies (operation_id, request_bytes, manifest, policy) \
         VALUES ('op-prep', 'x', '{}', NULL), ('op-live', 'x', '{}', NULL), ('op-done', 'x', '{}', NULL);
         INSERT INTO attempts (operation_id, generation, state, idempotency_key, request_digest, handle, \
           lease_holder, lease_expires_at, started_at, resumes, replays, end_reason, confirmed_over, target) \
         VALUES ('op-live', 1, 'UNKNOWN', 'k-live', 'rd', 'h-1', 'gone', 5, 2, 2, 1, 'stream_cut', NULL, 0), \
                ('op-done', 1, 'COMMITTED', 'k-done', 'rd', 'h-2', 'gone', 9, 2, 0, 0, 'committed', 'lease_expired', 1);
         INSERT INTO handles (provider, handle, manifest_digest, operation_id, generation, bound_at) \
         VALUES ('sim', 'h-1', 'md', 'op-live', 1, 3), ('sim', 'h-2', 'md', 'op-done', 1, 4);
         INSERT INTO transitions (operation_id, generation, from_state, to_state, at) \
         VALUES ('op-live', 1, NULL, 'DISPATCHING', 2), ('op-done', 1, NULL, 'DISPATCHING', 2), \
                ('op-live', 1, 'DISPATCHING', 'SENT', 3), ('op-done', 1, 'DISPATCHING', 'STREAMING', 3), \
                ('op-live', 1, 'SENT', 'UNKNOWN', 4), ('op-done', 1, 'STREAMING', 'COMMITTED', 6);";
    match built_by_hand_at(&place, 9).await {
        None => rusqlite::Connection::open(place.sqlite_path())
            .unwrap()
            .execute_batch(rows)
            .unwrap(),
        Some(client) => client.batch_execute(rows).await.unwrap(),
    }
    let store = open_at(&place, 2).await;
    let live = store.attempts("op-live").await.unwrap();
    assert_eq!(live.len(), 1);
    let attempt = &live[0];
    assert_eq!(
        (
            attempt.generation,
            attempt.state,
            attempt.idempotency_key.as_str(),
            attempt.handle.as_deref()
        ),
        (Generation(1), DispatchState::Unknown, "k-live", Some("h-1"))
    );
    assert_eq!(
        (
            attempt.lease_holder.as_str(),
            attempt.lease_expires_at,
            attempt.resumes,
            attempt.replays
        ),
        ("gone", at(5), 2, 1)
    );
    assert_eq!(
        (
            attempt.end_reason.as_deref(),
            attempt.confirmed_over.as_deref(),
            attempt.target
        ),
        (Some("stream_cut"), None, 0)
    );
    assert_eq!(
        attempt.history,
        vec![
            (DispatchState::Dispatching, at(2)),
            (DispatchState::Sent, at(3)),
            (DispatchState::Unknown, at(4))
        ]
    );
    let done = store.attempts("op-done").await.unwrap();
    assert_eq!(
        done.iter()
            .map(|a| (a.state, a.handle.clone(), a.confirmed_over.clone(), a.target))
            .collect::<Vec<_>>(),
        vec![(
            DispatchState::Committed,
            Some("h-2".to_owned()),
            Some("lease_expired".to_owned()),
            1
        )]
    );
    assert_eq!(
        done[0].history,
        vec![
            (DispatchState::Dispatching, at(2)),
            (DispatchState::Streaming, at(3)),
            (DispatchState::Committed, at(6))
        ]
    );
    // The sweeps, through their partial indexes: the PREPARED dispatch nobody drives, the
    // UNKNOWN attempt (long past its lease), nothing of the committed one.
    assert_eq!(
        store.prepared_unattended(0, 10).await.unwrap(),
        vec!["op-prep".to_owned()]
    );
    assert!(
        store.stuck_age_ms().await.unwrap() > 1_000_000_000,
        "the UNKNOWN attempt's lease ran out in 1970"
    );
    let report = store.recover_startup("replica-b", at(10)).await.unwrap();
    assert_eq!(report.marked_unknown, 0);
    assert_eq!(
        report
            .unknown
            .iter()
            .map(|a| (a.operation_id.as_str(), a.generation))
            .collect::<Vec<_>>(),
        vec![("op-live", Generation(1))]
    );
    if let Store::Sqlite(ledger) = &store {
        for (sweep, plan, index) in ledger.sweep_plans().unwrap() {
            assert!(plan.contains(&index), "{sweep} should read {index}: {plan}");
        }
        drop(store);
        let connection = rusqlite::Connection::open(place.sqlite_path()).unwrap();
        let broken: i64 = connection
            .query_row("SELECT COUNT(*) FROM pragma_foreign_key_check", [], |row| {
                row.get(0)
            })
            .unwrap();
        assert_eq!(broken, 0);
        let sql_of = |table: &str| -> String {
            connection
                .query_row(
                    "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?1",
                    [table],
                    |row| row.get(0),
                )
                .unwrap()
        };
        // Every column of every row, as a line (NULL spelled out).
        let lines = |sql: &str| -> Vec<String> {
            connection
                .prepare(sql)
                .unwrap()
                .query_map([], |row| row.get::<_, String>(0))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap()
        };
        assert_eq!(
            lines(
                "SELECT operation_id || '|' || generation || '|' || state || '|' || idempotency_key || '|' || \
                 request_digest || '|' || COALESCE(handle, 'NULL') || '|' || lease_holder || '|' || lease_expires_at \
                 || '|' || started_at || '|' || resumes || '|' || replays || '|' || COALESCE(end_reason, 'NULL') \
                 || '|' || COALESCE(confirmed_over, 'NULL') || '|' || target FROM attempts ORDER BY operation_id"
            ),
            [
                "op-done|1|COMMITTED|k-done|rd|h-2|gone|9|2|0|0|committed|lease_expired|1",
                "op-live|1|UNKNOWN|k-live|rd|h-1|gone|5|2|2|1|stream_cut|NULL|0",
            ]
        );
        assert_eq!(
            lines(
                "SELECT provider || '|' || handle || '|' || manifest_digest || '|' || operation_id || '|' || \
                 generation || '|' || bound_at FROM handles ORDER BY handle"
            ),
            ["sim|h-1|md|op-live|1|3", "sim|h-2|md|op-done|1|4"]
        );
        assert_eq!(
            lines(
                "SELECT id || '|' || operation_id || '|' || generation || '|' || COALESCE(from_state, 'NULL') || '|' \
                 || to_state || '|' || at FROM transitions ORDER BY id"
            ),
            [
                "1|op-live|1|NULL|DISPATCHING|2",
                "2|op-done|1|NULL|DISPATCHING|2",
                "3|op-live|1|DISPATCHING|SENT|3",
                "4|op-done|1|DISPATCHING|STREAMING|3",
                "5|op-live|1|SENT|UNKNOWN|4",
                "6|op-done|1|STREAMING|COMMITTED|6",
            ]
        );
        assert_eq!(
            lines("SELECT \"table\" || '.' || \"to\" FROM pragma_foreign_key_list('attempts')"),
            ["dispatches.operation_id"],
            "the rebuilt attempts still refer to their dispatch"
        );
        assert!(sql_of("attempts").contains("WITHOUT ROWID"));
        assert!(sql_of("handles").contains("WITHOUT ROWID"));
        assert!(!sql_of("transitions").contains("AUTOINCREMENT"));
        connection
            .execute(
                "INSERT INTO transitions (operation_id, generation, from_state, to_state, at) \
                 VALUES ('op-prep', NULL, NULL, 'ABANDONED', 11)",
                [],
            )
            .unwrap();
        assert_eq!(connection.last_insert_rowid(), 7, "ids go on from the largest");
    }
}

/// Issue 21: a prepare's checks run before its transaction, large bodies on tokio's blocking
/// pool (over 1 MiB in all). A 3 MiB body with a failover target is stored exactly and begins
/// its first attempt in the same write; one whose bytes do not match its digest is `Invalid`,
/// stores nothing, and leaves the store as it was for the next prepare.
pub async fn a_large_body_is_checked_off_the_writer_and_stored_exactly(backend: Backend, name: &str) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let large = |operation_id: &str, model: &str, fill: u8| {
        let (manifest, _) = manifest(operation_id, "c", 1, model);
        let bytes = vec![fill; 3 * 1024 * 1024];
        let mut body = manifest.body.clone();
        body.request_digest = turnstile_core::digest::Digest::of_bytes(&bytes);
        (body.seal(), bytes)
    };
    let begin = begin_at_once();
    // Bytes that are not the ones the manifest names: refused before any write.
    let writes = store.write_ops();
    let (manifest_bad, mut bytes_bad) = large("op-bad", "m", b'a');
    bytes_bad[2 * 1024 * 1024] = b'b';
    let (refused, began) = store
        .prepare_and_begin(&manifest_bad, &bytes_bad, None, &[], &begin, at(10))
        .await
        .unwrap();
    assert_eq!(
        refused,
        PrepareOutcome::Invalid("request bytes do not match request_digest")
    );
    assert!(began.is_none());
    assert_eq!(store.dispatch("op-bad").await.unwrap(), None);
    assert_eq!(store.write_ops() - writes, 0, "a refused prepare writes nothing");
    let (primary, bytes) = large("op-1", "m", b'x');
    let (second, second_bytes) = large("op-1", "m2", b'y');
    let fallback = PreparedTarget {
        manifest: second,
        request_bytes: second_bytes.clone(),
        policy: None,
    };
    let (prepared, began) = store
        .prepare_and_begin(&primary, &bytes, None, &[fallback], &begin, at(11))
        .await
        .unwrap();
    let PrepareOutcome::Created(record) = prepared else {
        panic!("{prepared:?}")
    };
    assert_eq!(record.request_bytes, bytes);
    assert!(matches!(began, Some(BeginOutcome::Began { .. })), "{began:?}");
    assert_eq!(store.write_ops() - writes, 1, "prepared and begun in one write");
    let stored = store.dispatch("op-1").await.unwrap().expect("stored");
    assert_eq!(
        stored.request_bytes, bytes,
        "the body read back is the one prepared"
    );
    assert_eq!(stored.state, DispatchState::Dispatching);
    let fallbacks = store.dispatch_fallbacks("op-1").await.unwrap();
    assert_eq!(fallbacks.len(), 1);
    assert_eq!(fallbacks[0].request_bytes, second_bytes);
}

/// Commit the first attempt of `operation_id` (begun at revision 1, carried from DISPATCHING)
/// and check that neither the import before it nor the commit walked the history: the store's
/// walk count is still `walks`.
async fn commit_walking_nothing(
    store: &dyn Ledger,
    operation_id: &str,
    generation: Generation,
    turn_tag: &str,
    now: Timestamp,
    walks: u64,
) {
    let carried = Carried {
        from: DispatchState::Dispatching,
        handle: None,
        bind: true,
        evidence: Vec::new(),
    };
    let committed = store
        .commit_carrying(
            operation_id,
            generation,
            Revision(1),
            &assistant_turn(turn_tag, 1),
            None,
            &carried,
            now,
        )
        .await
        .unwrap();
    assert!(
        matches!(committed, CommitOutcome::Committed { .. }),
        "{operation_id}: {committed:?}"
    );
    assert_eq!(
        store.history_walks() - walks,
        0,
        "{operation_id}: the import kept the validator's state, so neither it nor the commit walked the history"
    );
}

/// Issue 21: a fresh proxy request's import, prepare and acceptance point are one durable write
/// (`import_and_prepare`), and the import leaves the validator's state, so the dispatch's
/// commit checks its own turn only. A history the validator refuses, an id that is taken, a
/// prepare whose bytes do not match its manifest, and a prepare that would be refused (a
/// manifest of another conversation or revision, an operation id that is taken) write nothing
/// at all: no conversation, no dispatch.
pub async fn a_fresh_import_and_its_first_prepare_are_one_write_and_its_commit_checks_the_new_turn_only(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    let begin = begin_at_once();
    let turns = [user_turn("c-u1")];
    let (manifest_c, bytes_c) = manifest("op-c", "c", 1, "m");
    let (writes, walks) = (store.write_ops(), store.history_walks());
    let imported = store
        .import_and_prepare(
            "c",
            &tools(),
            &turns,
            &manifest_c,
            &bytes_c,
            None,
            &[],
            Some(&begin),
            at(10),
        )
        .await
        .unwrap();
    assert_eq!(
        store.write_ops() - writes,
        1,
        "import, prepare and begin are one write"
    );
    let ImportPrepared::Prepared {
        revision,
        prepared: PrepareOutcome::Created(record),
        began: Some(BeginOutcome::Began { generation, .. }),
    } = imported
    else {
        panic!("not imported, prepared and begun: {imported:?}")
    };
    assert_eq!(revision, Revision(1));
    assert_eq!(record.state, DispatchState::Dispatching);
    let stored = store.conversation("c").await.unwrap().expect("imported");
    assert_eq!(stored["turns"].as_array().unwrap().len(), 1, "{stored}");
    assert_eq!(stored["turns"][0]["revision"], 1, "{stored}");
    commit_walking_nothing(&*store, "op-c", generation, "a", at(11), walks).await;

    let nothing_written = |what: &str, writes: u64| {
        assert_eq!(store.write_ops(), writes, "{what}: nothing is written");
    };
    // Refused by the validator: an assistant turn answering a call nobody made.
    let illegal = [
        user_turn("d-u1"),
        json!({"id": "d-t", "role": "tool", "blocks": [{"id": "d-r", "kind": "tool_result",
               "call_id": "nobody-called", "status": "success", "content": [{"kind": "text", "text": "x"}]}]}),
    ];
    let (manifest_d, bytes_d) = manifest("op-d", "d", 2, "m");
    let writes = store.write_ops();
    let refused = store
        .import_and_prepare(
            "d",
            &tools(),
            &illegal,
            &manifest_d,
            &bytes_d,
            None,
            &[],
            Some(&begin),
            at(12),
        )
        .await
        .unwrap();
    assert!(
        matches!(&refused, ImportPrepared::NotImported(ImportOutcome::Rejected(violations)) if !violations.is_empty()),
        "{refused:?}"
    );
    nothing_written("an illegal history", writes);
    assert_eq!(store.conversation("d").await.unwrap(), None);
    assert_eq!(store.dispatch("op-d").await.unwrap(), None);
    // The id is taken: the stored conversation stays as it is, nothing is prepared.
    let (manifest_again, bytes_again) = manifest("op-c2", "c", 1, "m");
    let writes = store.write_ops();
    let taken = store
        .import_and_prepare(
            "c",
            &tools(),
            &turns,
            &manifest_again,
            &bytes_again,
            None,
            &[],
            Some(&begin),
            at(13),
        )
        .await
        .unwrap();
    assert_eq!(
        taken,
        ImportPrepared::NotImported(ImportOutcome::AlreadyExists {
            revision: Revision(2)
        })
    );
    nothing_written("an id that is taken", writes);
    assert_eq!(store.dispatch("op-c2").await.unwrap(), None);
    // Bytes that are not the manifest's: refused before the transaction, the history not
    // imported either.
    let (manifest_e, _) = manifest("op-e", "e", 1, "m");
    let writes = store.write_ops();
    let invalid = store
        .import_and_prepare(
            "e",
            &tools(),
            &[user_turn("e-u1")],
            &manifest_e,
            b"other bytes",
            None,
            &[],
            None,
            at(14),
        )
        .await
        .unwrap();
    assert!(
        matches!(invalid, ImportPrepared::NotPrepared(PrepareOutcome::Invalid(_))),
        "{invalid:?}"
    );
    nothing_written("bytes that are not the manifest's", writes);
    assert_eq!(store.conversation("e").await.unwrap(), None);
    // Without a begin (a cooling target), the dispatch is prepared and left PREPARED.
    let (manifest_f, bytes_f) = manifest("op-f", "f", 1, "m");
    let prepared = store
        .import_and_prepare(
            "f",
            &tools(),
            &[user_turn("f-u1")],
            &manifest_f,
            &bytes_f,
            None,
            &[],
            None,
            at(15),
        )
        .await
        .unwrap();
    let ImportPrepared::Prepared {
        prepared: PrepareOutcome::Created(record),
        began: None,
        ..
    } = prepared
    else {
        panic!("not prepared without a begin: {prepared:?}")
    };
    assert_eq!(record.state, DispatchState::Prepared);

    // The prepare would be refused: the import is not written either (all or nothing). A
    // manifest of another conversation, of another revision than the import's, and an
    // operation id that is taken (by op-c, with another manifest).
    let refusals = [
        (
            "a manifest of another conversation",
            manifest("op-g", "other", 1, "m"),
        ),
        ("a manifest of another revision", manifest("op-g", "g", 3, "m")),
        ("an operation id that is taken", manifest("op-c", "g", 1, "m")),
    ];
    for (what, (manifest_g, bytes_g)) in refusals {
        let writes = store.write_ops();
        let refused = store
            .import_and_prepare(
                "g",
                &tools(),
                &[user_turn("g-u1")],
                &manifest_g,
                &bytes_g,
                None,
                &[],
                Some(&begin),
                at(16),
            )
            .await
            .unwrap();
        let expected = match what {
            "a manifest of another conversation" => {
                matches!(refused, ImportPrepared::NotPrepared(PrepareOutcome::NotFound))
            }
            "a manifest of another revision" => matches!(
                refused,
                ImportPrepared::NotPrepared(PrepareOutcome::StaleRevision { current: Revision(1) })
            ),
            _ => matches!(
                refused,
                ImportPrepared::NotPrepared(PrepareOutcome::Conflict { .. })
            ),
        };
        assert!(expected, "{what}: {refused:?}");
        nothing_written(what, writes);
        assert_eq!(store.conversation("g").await.unwrap(), None, "{what}");
        assert_eq!(store.dispatch("op-g").await.unwrap(), None, "{what}");
    }
}

/// Issue 21: a ledger that keeps no validator state for a conversation (another replica, a
/// restart) walks the history before its commit; on SQLite that walk is a read on the caller
/// and a first run that stops before it writes, neither of which may take a fault armed for
/// the commit. A drop before COMMIT loses the commit and nothing else; a drop after it loses
/// only the answer. Neither walk is made on SQLite's writer thread.
pub async fn a_fault_is_the_commit_s_own_when_its_check_must_first_walk_the_history(
    backend: Backend,
    name: &str,
) {
    let (place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let generation = prepared_and_begun(&*store, "op-1", "c", 1).await;
    to_streaming(&*store, "op-1", generation).await;
    let other = open_at(&place, 2).await;
    let (walks, in_tx) = (other.history_walks(), other.history_walks_in_transaction());
    let turn = assistant_turn("a", 2);
    other.faults().arm(Fault::DropBeforeCommit);
    let lost = other.commit("op-1", generation, Revision(1), &turn, at(20)).await;
    assert!(
        matches!(lost, Err(StoreError::ConnectionLost("before commit"))),
        "{lost:?}"
    );
    assert_eq!(other.conversation("c").await.unwrap().unwrap()["revision"], 1);
    other.faults().arm(Fault::DropAfterCommit);
    let lost = other.commit("op-1", generation, Revision(1), &turn, at(21)).await;
    assert!(
        matches!(lost, Err(StoreError::ConnectionLost("after commit"))),
        "{lost:?}"
    );
    assert_eq!(other.conversation("c").await.unwrap().unwrap()["revision"], 2);
    assert_eq!(other.history_walks() - walks, 2, "each commit walked once");
    let expected_in_tx = match backend {
        Backend::Sqlite => 0,
        Backend::Postgres => 2,
    };
    assert_eq!(
        other.history_walks_in_transaction() - in_tx,
        expected_in_tx,
        "{backend:?}"
    );
    assert!(matches!(
        other
            .commit("op-1", generation, Revision(1), &turn, at(22))
            .await
            .unwrap(),
        CommitOutcome::Committed { .. }
    ));
    check_invariants(&*other, &["c".into()]).await;
}

/// Import conversations of `text_bytes` of text each, named `prefix`0.., until `stop` says so
/// (checked after every import); at most `max` of them. Returns how many were imported.
async fn import_until(
    store: &SqliteLedger,
    prefix: &str,
    text_bytes: usize,
    max: usize,
    mut stop: impl FnMut() -> bool,
) -> usize {
    let text = "x".repeat(text_bytes);
    for index in 0..max {
        let turn = json!({"id": "t", "role": "user", "blocks": [{"id": "b", "kind": "text", "text": text}]});
        let outcome = store
            .import_conversation(&format!("{prefix}{index}"), &tools(), &[turn], at(10))
            .await
            .unwrap();
        assert!(matches!(outcome, ImportOutcome::Created { .. }), "{outcome:?}");
        if stop() {
            return index + 1;
        }
    }
    max
}

/// Issue 21: the writer never copies the WAL back into the database inside its commits
/// (SQLite's automatic checkpoint did, a thousand pages and a sync of the database file with
/// every operation queued behind it waiting): the checkpoint thread does, on its own
/// connection, and the WAL starts over. The WAL's size is what the writer's hook was told
/// after each commit, so the test itself copies nothing. Red with the hook waking nothing, and
/// with SQLite's automatic checkpoint left on (the thread then runs none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checkpoint_thread_copies_the_wal_back_and_the_writer_does_not() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("ledger.db");
    let store = SqliteLedger::open(&path, Synchronous::Normal).expect("open sqlite");
    // About 8 KiB of text: a few pages per import, past the threshold within a few hundred.
    let imported = import_until(&store, "c", 8 * 1024, 2_000, || store.checkpoints().0 > 0).await;
    assert!(
        imported < 2_000,
        "no checkpoint after {imported} imports: {:?}",
        store.checkpoints()
    );
    assert!(store.wal_pages() >= SQLITE_CHECKPOINT_PAGES as u64);
    // The WAL starts over at the first write after a pass that copied all of it; the thread
    // may still be copying: write until it did (a bounded poll on the WAL's size).
    let mut restarted = false;
    for round in 0..500 {
        import_until(&store, &format!("after{round}-"), 16, 1, || true).await;
        if store.wal_pages() < SQLITE_CHECKPOINT_PAGES as u64 {
            restarted = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(
        restarted,
        "the WAL still holds {} pages: {:?}",
        store.wal_pages(),
        store.checkpoints()
    );
    let (by_thread, by_writer, failed) = store.checkpoints();
    assert!(by_thread >= 1);
    assert_eq!(
        (by_writer, failed),
        (0, 0),
        "the writer checkpointed, or a checkpoint failed"
    );
}

/// Issue 21: the WAL stays bounded when the checkpoint thread cannot keep it small: here a
/// reader holds the WAL's first snapshot, so no checkpoint can copy past it and the WAL cannot
/// start over. Past `SQLITE_WAL_PAGES_MAX` the writer checkpoints after its commit
/// itself, as SQLite would have; once the reader ends, the WAL starts over. Meanwhile the
/// thread is woken once per thousand pages, not at every commit. Red with the writer's own
/// checkpoint taken out of its hook, and with the hook waking the thread at every commit past
/// a thousand pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_bound_the_writer_checkpoints_itself() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("ledger.db");
    let store = SqliteLedger::open(&path, Synchronous::Normal).expect("open sqlite");
    import_until(&store, "first", 16, 1, || true).await;
    let reader = rusqlite::Connection::open(&path).unwrap();
    reader.execute_batch("BEGIN").unwrap();
    let _: i64 = reader
        .query_row("SELECT COUNT(*) FROM conversations", [], |row| row.get(0))
        .unwrap();
    // About 64 KiB of text: some 40 pages per import, past the bound within a thousand.
    let imported = import_until(&store, "c", 64 * 1024, 1_000, || store.checkpoints().1 > 0).await;
    let (by_thread, by_writer, failed) = store.checkpoints();
    assert!(
        by_writer >= 1,
        "the writer never checkpointed after {imported} imports"
    );
    assert_eq!(failed, 0);
    // Meanwhile the thread was woken once per thousand pages the WAL grew, not at every
    // commit (it can copy nothing here, so a wake-up per commit is a pass per commit).
    let wakes = (SQLITE_WAL_PAGES_MAX / SQLITE_CHECKPOINT_PAGES) as u64;
    assert!(
        by_thread <= wakes * SQLITE_CHECKPOINT_PASSES_MAX as u64,
        "{by_thread} checkpoint passes over {imported} imports"
    );
    reader.execute_batch("COMMIT").unwrap();
    // With the reader gone, the writer's next checkpoint copies all of the WAL (it is past
    // the bound still), and the write after that starts it over.
    let mut writes = 0;
    while store.wal_pages() >= SQLITE_CHECKPOINT_PAGES as u64 && writes < 10 {
        import_until(&store, &format!("last{writes}-"), 16, 1, || true).await;
        writes += 1;
    }
    assert!(
        store.wal_pages() < SQLITE_CHECKPOINT_PAGES as u64,
        "the WAL still holds {} pages after {writes} writes",
        store.wal_pages()
    );
}

/// Issue 51: attempt evidence (what the provider's side of a connection showed) is appended by
/// its own write or in a winning commit's transaction, read back per dispatch oldest first;
/// a commit that loses writes none of what it carried.
pub async fn attempt_evidence_is_appended_alone_or_with_a_winning_commit_and_never_with_a_losing_one(
    backend: Backend,
    name: &str,
) {
    let (_place, store) = open_fresh(backend, name).await;
    conversation_at_1(&*store, "c").await;
    let generation = began_at_once(&*store, "op", "c", 1, 10).await;
    let rival = began_at_once(&*store, "op-rival", "c", 1, 11).await;
    let failed = json!({"status": 503, "error_body": "overloaded", "provider_request_id": "req_1"});
    store
        .record_evidence("op", &[(generation, failed.clone())], at(12))
        .await
        .unwrap();
    let writes = store.write_ops();
    let won = json!({"status": 200, "end": "committed"});
    let carried = Carried {
        from: DispatchState::Dispatching,
        handle: None,
        bind: true,
        evidence: vec![(generation, won.clone())],
    };
    let committed = store
        .commit_carrying(
            "op",
            generation,
            Revision(1),
            &assistant_turn("a", 1),
            None,
            &carried,
            at(20),
        )
        .await
        .unwrap();
    assert!(
        matches!(committed, CommitOutcome::Committed { .. }),
        "{committed:?}"
    );
    assert_eq!(
        store.write_ops() - writes,
        1,
        "the evidence rode in the commit's write"
    );
    assert_eq!(
        store.evidence("op").await.unwrap(),
        vec![(generation, failed), (generation, won)]
    );
    let lost = Carried {
        evidence: vec![(rival, json!({"status": 200}))],
        ..carried
    };
    let refused = store
        .commit_carrying(
            "op-rival",
            rival,
            Revision(1),
            &assistant_turn("b", 1),
            None,
            &lost,
            at(21),
        )
        .await
        .unwrap();
    assert!(matches!(refused, CommitOutcome::Refused(_)), "{refused:?}");
    assert_eq!(store.evidence("op-rival").await.unwrap(), Vec::new());
}
