//! The stream assembler on normalized events (the decoders' side is tested in
//! turnstile-adapters): preview vs. commit, whole blocks only, dedupe, quarantine, limits.

use serde_json::{Value, json};
use std::sync::Arc;
use turnstile_core::assemble::{
    ASSEMBLE_BLOCK_BYTES_MAX, ASSEMBLE_BLOCKS_MAX, Assembler, AssemblerConfig, Disposition, IgnoreReason,
    Output, Phase, QuarantineReason, Toolset, ToolsetCache, ToolsetError,
};
use turnstile_core::stream::{BlockIndex, BlockStart, Seq, SeqSource, Sequenced, StopReason, StreamEvent};
use turnstile_core::{Conversation, Digest, Generation, Verdict, validate};

const GENERATION: Generation = Generation(7);

/// Events numbered by receive ordinal, one provider event each.
fn numbered(events: Vec<StreamEvent>) -> Vec<Sequenced> {
    events
        .into_iter()
        .enumerate()
        .map(|(number, event)| Sequenced {
            seq: Seq {
                source: SeqSource::Receive,
                number: number as u64,
                part: 0,
            },
            event,
        })
        .collect()
}

fn weather_tools() -> Value {
    json!([{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"], "additionalProperties": false}},
           {"name": "list_files", "input_schema": {"type": "object", "additionalProperties": false}}])
}

fn assembler_with(toolset: Option<Value>) -> Assembler {
    let mut config = AssemblerConfig::new(GENERATION, "t-9");
    config.toolset = toolset.map(|tools| Arc::new(Toolset::from_json(&tools).unwrap()));
    Assembler::new(config)
}

fn run(assembler: &mut Assembler, events: Vec<StreamEvent>) -> Vec<Output> {
    for event in numbered(events) {
        let _ = assembler.handle_event(GENERATION, event);
    }
    assembler.handle_end_of_input();
    std::iter::from_fn(|| assembler.poll_output()).collect()
}

fn outcome(outputs: &[Output]) -> Result<Value, String> {
    match outputs.last() {
        Some(Output::Commit(offer)) => Ok(offer.turn.clone()),
        Some(Output::Retract { reason, .. }) => Err(reason.code().to_owned()),
        other => panic!("no outcome: {other:?}"),
    }
}

fn text(index: u64, delta: &str) -> StreamEvent {
    StreamEvent::TextDelta {
        index: BlockIndex(index),
        text: delta.into(),
    }
}

fn start_text(index: u64) -> StreamEvent {
    StreamEvent::BlockStart {
        index: BlockIndex(index),
        block: BlockStart::Text,
    }
}

fn start_call(index: u64, call_id: Option<&str>, name: &str) -> StreamEvent {
    StreamEvent::BlockStart {
        index: BlockIndex(index),
        block: BlockStart::ToolCall {
            call_id: call_id.map(str::to_owned),
            name: name.into(),
        },
    }
}

fn args(index: u64, fragment: &str) -> StreamEvent {
    StreamEvent::ToolArgsDelta {
        index: BlockIndex(index),
        fragment: fragment.into(),
    }
}

fn stop_block(index: u64) -> StreamEvent {
    StreamEvent::BlockStop {
        index: BlockIndex(index),
        arguments_final: None,
    }
}

fn stop(reason: StopReason) -> StreamEvent {
    StreamEvent::Stop { reason }
}

/// A text block and one tool call, stopped and ended.
fn text_and_call() -> Vec<StreamEvent> {
    vec![
        StreamEvent::Handle {
            handle: "msg_1".into(),
        },
        start_text(0),
        text(0, "Checking "),
        text(0, "Paris."),
        stop_block(0),
        start_call(1, Some("call_1"), "get_weather"),
        args(1, "{\"ci"),
        args(1, "ty\":\"Paris\"}"),
        stop_block(1),
        stop(StopReason::ToolUse),
        StreamEvent::End,
    ]
}

#[test]
fn text_is_previewed_and_the_whole_turn_commits_only_after_stop_and_end() {
    let mut assembler = assembler_with(Some(weather_tools()));
    let outputs = run(&mut assembler, text_and_call());
    let previews: Vec<&str> = outputs
        .iter()
        .filter_map(|output| match output {
            Output::Preview {
                delta, generation, ..
            } => {
                assert_eq!(*generation, GENERATION);
                Some(delta.as_str())
            }
            _ => None,
        })
        .collect();
    assert_eq!(previews, ["Checking ", "Paris."]);
    let Some(Output::Commit(offer)) = outputs.last() else {
        panic!("{outputs:?}")
    };
    assert_eq!(
        offer.turn,
        json!({"id": "t-9", "role": "assistant", "generation": 7, "blocks": [
            {"id": "t-9.1", "kind": "text", "text": "Checking Paris."},
            {"id": "t-9.2", "kind": "tool_call", "call_id": "call_1", "tool": "get_weather",
             "arguments": "{\"city\":\"Paris\"}"}]})
    );
    assert_eq!(offer.handle.as_deref(), Some("msg_1"));
    assert_eq!(offer.calls.len(), 1);
    assert_eq!(
        offer.calls[0].args_digest,
        Digest::of_canonical(&json!({"city": "Paris"}))
    );
    assert_eq!(assembler.phase(), Phase::Committed);
}

#[test]
fn nothing_is_offered_before_the_end_marker_even_after_the_stop_signal() {
    let mut assembler = assembler_with(None);
    let mut events = text_and_call();
    events.pop(); // no End
    for event in numbered(events) {
        let _ = assembler.handle_event(GENERATION, event);
    }
    let outputs: Vec<Output> = std::iter::from_fn(|| assembler.poll_output()).collect();
    assert!(
        outputs
            .iter()
            .all(|output| matches!(output, Output::Preview { .. }))
    );
    assert_eq!(assembler.phase(), Phase::Open);
}

#[test]
fn tool_arguments_are_never_previewed() {
    let mut assembler = assembler_with(None);
    let outputs = run(&mut assembler, text_and_call());
    for output in &outputs {
        if let Output::Preview { delta, .. } = output {
            assert!(!delta.contains("city"), "{delta}");
        }
    }
}

#[test]
fn an_empty_argument_string_commits_as_an_empty_object() {
    let mut assembler = assembler_with(Some(weather_tools()));
    let events = vec![
        start_call(0, Some("call_e"), "list_files"),
        args(0, ""),
        stop_block(0),
        stop(StopReason::ToolUse),
        StreamEvent::End,
    ];
    let turn = outcome(&run(&mut assembler, events)).unwrap();
    assert_eq!(turn["blocks"][0]["arguments"], json!({}));
}

#[test]
fn a_cut_stream_commits_nothing_and_retracts_its_preview() {
    let mut events = text_and_call();
    events.truncate(7); // inside the tool arguments
    let mut assembler = assembler_with(None);
    let outputs = run(&mut assembler, events);
    assert_eq!(outcome(&outputs), Err("cut_stream".into()));
    assert!(matches!(outputs.last(), Some(Output::Retract { generation, .. }) if *generation == GENERATION));
    assert!(!outputs.iter().any(|output| matches!(output, Output::Commit(_))));
}

#[test]
fn an_end_without_a_stop_signal_commits_nothing() {
    let mut events = text_and_call();
    events.retain(|event| !matches!(event, StreamEvent::Stop { .. }));
    assert_eq!(
        outcome(&run(&mut assembler_with(None), events)),
        Err("missing_stop".into())
    );
}

#[test]
fn max_tokens_inside_tool_json_commits_nothing() {
    let events = vec![
        start_text(0),
        text(0, "Writing the file."),
        stop_block(0),
        start_call(1, Some("call_m"), "get_weather"),
        args(1, "{\"city\": \"Par"),
        stop(StopReason::MaxTokens),
        StreamEvent::End,
    ];
    assert_eq!(
        outcome(&run(&mut assembler_with(None), events)),
        Err("max_tokens_in_tool_arguments".into())
    );
}

#[test]
fn a_tool_block_open_at_an_ordinary_stop_commits_nothing() {
    let events = vec![
        start_call(0, Some("call_u"), "get_weather"),
        args(0, "{\"city\":\"Oslo\"}"),
        stop(StopReason::ToolUse),
        StreamEvent::End,
    ];
    assert_eq!(
        outcome(&run(&mut assembler_with(None), events)),
        Err("unclosed_block".into())
    );
}

#[test]
fn invalid_blocks_commit_nothing_each_with_its_reason() {
    let cases: Vec<(&str, Vec<StreamEvent>, &str)> = vec![
        (
            "cut JSON",
            vec![
                start_call(0, Some("c"), "get_weather"),
                args(0, "{\"city\":"),
                stop_block(0),
            ],
            "invalid_arguments",
        ),
        (
            "not an object",
            vec![
                start_call(0, Some("c"), "get_weather"),
                args(0, "[1]"),
                stop_block(0),
            ],
            "invalid_arguments",
        ),
        (
            "schema",
            vec![
                start_call(0, Some("c"), "get_weather"),
                args(0, "{\"town\":\"Oslo\"}"),
                stop_block(0),
            ],
            "schema_violation",
        ),
        (
            "unknown tool",
            vec![start_call(0, Some("c"), "launch"), args(0, "{}"), stop_block(0)],
            "unknown_tool",
        ),
        (
            "no call id",
            vec![
                start_call(0, None, "get_weather"),
                args(0, "{\"city\":\"Oslo\"}"),
                stop_block(0),
            ],
            "missing_call_id",
        ),
        (
            "duplicate call id",
            vec![
                start_call(0, Some("same"), "get_weather"),
                args(0, "{\"city\":\"Oslo\"}"),
                stop_block(0),
                start_call(1, Some("same"), "get_weather"),
                args(1, "{\"city\":\"Rome\"}"),
                stop_block(1),
            ],
            "duplicate_call_id",
        ),
        (
            "a delta lost before the provider's final copy",
            vec![
                start_call(0, Some("c"), "get_weather"),
                args(0, "{\"city\":\"Os"),
                StreamEvent::BlockStop {
                    index: BlockIndex(0),
                    arguments_final: Some("{\"city\":\"Oslo\"}".into()),
                },
            ],
            "arguments_mismatch",
        ),
        (
            "a delta for a block never started",
            vec![args(3, "{}")],
            "protocol_violation",
        ),
        (
            "a block started twice",
            vec![start_text(0), start_text(0)],
            "protocol_violation",
        ),
        (
            "a provider error",
            vec![
                start_text(0),
                text(0, "Hi"),
                StreamEvent::ProviderError {
                    code: "overloaded_error".into(),
                    message: "Overloaded".into(),
                },
            ],
            "provider_error",
        ),
        ("nothing at all", vec![], "empty_turn"),
    ];
    for (what, mut events, code) in cases {
        events.push(stop(StopReason::ToolUse));
        events.push(StreamEvent::End);
        let outputs = run(&mut assembler_with(Some(weather_tools())), events);
        assert_eq!(outcome(&outputs), Err(code.to_owned()), "{what}");
        assert!(
            !outputs.iter().any(|output| matches!(output, Output::Commit(_))),
            "{what}"
        );
    }
}

#[test]
fn a_call_id_already_used_in_history_is_not_reused() {
    let mut config = AssemblerConfig::new(GENERATION, "t-9");
    config.call_ids_taken.insert("call_1".into());
    let mut assembler = Assembler::new(config);
    assert_eq!(
        outcome(&run(&mut assembler, text_and_call())),
        Err("duplicate_call_id".into())
    );
}

#[test]
fn an_event_seen_twice_under_the_same_key_is_ignored_as_a_duplicate() {
    let mut assembler = assembler_with(None);
    let events = numbered(text_and_call());
    for event in &events {
        assert_eq!(
            assembler.handle_event(GENERATION, event.clone()),
            Disposition::Accepted
        );
        // A replay of what was already received (a resumed connection overlapping).
        if matches!(
            event.event,
            StreamEvent::TextDelta { .. } | StreamEvent::ToolArgsDelta { .. }
        ) {
            assert_eq!(
                assembler.handle_event(GENERATION, event.clone()),
                Disposition::Ignored(IgnoreReason::Duplicate)
            );
        }
        if matches!(event.event, StreamEvent::End) {
            break;
        }
    }
    let outputs: Vec<Output> = std::iter::from_fn(|| assembler.poll_output()).collect();
    assert_eq!(outcome(&outputs).unwrap()["blocks"][0]["text"], "Checking Paris.");
    assert_eq!(assembler.stats().duplicates, 4);
}

#[test]
fn input_from_another_generation_is_quarantined_and_never_merged() {
    let mut assembler = assembler_with(None);
    let late = numbered(vec![start_text(0), text(0, "stale words")]);
    for event in late {
        let Disposition::Quarantined(material) = assembler.handle_event(Generation(6), event.clone()) else {
            panic!("merged");
        };
        assert_eq!(material.reason, QuarantineReason::OtherGeneration);
        assert_eq!(material.generation, Generation(6));
        assert_eq!(material.event, event);
    }
    let turn = outcome(&run(&mut assembler, text_and_call())).unwrap();
    assert!(!turn.to_string().contains("stale"));
    assert_eq!(assembler.stats().quarantined, 2);
}

#[test]
fn input_from_a_handle_other_than_the_bound_one_is_quarantined_until_a_new_connection() {
    let mut config = AssemblerConfig::new(GENERATION, "t-9");
    config.handle_bound = Some("msg_1".into());
    let mut assembler = Assembler::new(config);
    let foreign = numbered(vec![
        StreamEvent::Handle {
            handle: "msg_other".into(),
        },
        start_text(0),
        text(0, "not ours"),
    ]);
    for event in foreign {
        let Disposition::Quarantined(material) = assembler.handle_event(GENERATION, event) else {
            panic!("merged");
        };
        assert_eq!(material.reason, QuarantineReason::ForeignHandle);
        assert_eq!(material.handle.as_deref(), Some("msg_other"));
    }
    assembler.handle_connection_start();
    let turn = outcome(&run(&mut assembler, text_and_call())).unwrap();
    assert_eq!(turn["blocks"][0]["text"], "Checking Paris.");
}

#[test]
fn events_after_the_outcome_change_nothing() {
    let mut assembler = assembler_with(None);
    let _ = run(&mut assembler, text_and_call());
    let more = Sequenced {
        seq: Seq {
            source: SeqSource::Receive,
            number: 99,
            part: 0,
        },
        event: text(0, "late"),
    };
    assert_eq!(
        assembler.handle_event(GENERATION, more),
        Disposition::Ignored(IgnoreReason::AfterOutcome)
    );
    assert!(assembler.poll_output().is_none());
}

#[test]
fn a_retract_is_the_only_outcome_even_if_the_end_marker_follows() {
    let mut assembler = assembler_with(Some(weather_tools()));
    let events = vec![
        start_call(0, Some("c"), "get_weather"),
        args(0, "{\"town\":\"Oslo\"}"),
        stop_block(0),
        stop(StopReason::ToolUse),
        StreamEvent::End,
    ];
    let outputs = run(&mut assembler, events);
    let outcomes = outputs
        .iter()
        .filter(|output| !matches!(output, Output::Preview { .. }))
        .count();
    assert_eq!(outcomes, 1);
}

#[test]
fn more_blocks_than_the_limit_commit_nothing() {
    let mut events: Vec<StreamEvent> = (0..=ASSEMBLE_BLOCKS_MAX as u64).map(start_text).collect();
    events.push(stop(StopReason::EndTurn));
    events.push(StreamEvent::End);
    assert_eq!(
        outcome(&run(&mut assembler_with(None), events)),
        Err("limit_exceeded".into())
    );
}

#[test]
fn a_block_buffer_over_the_limit_commits_nothing() {
    let huge = "x".repeat(ASSEMBLE_BLOCK_BYTES_MAX + 1);
    let events = vec![
        start_call(0, Some("c"), "get_weather"),
        args(0, &huge),
        stop_block(0),
    ];
    assert_eq!(
        outcome(&run(&mut assembler_with(None), events)),
        Err("limit_exceeded".into())
    );
}

#[test]
fn schemas_are_compiled_once_per_toolset_digest() {
    let conversation = Conversation::from_value(json!({
        "format": "turnstile.conversation.v1", "conversation_id": "c", "revision": 1, "tools": weather_tools(),
        "turns": [{"id": "u", "revision": 1, "role": "user", "blocks": [{"id": "u1", "kind": "text", "text": "hi"}]}]
    }))
    .unwrap();
    let mut cache = ToolsetCache::new();
    let first = cache
        .compiled(&conversation.toolset_digest, &conversation.tools)
        .unwrap();
    let second = cache
        .compiled(&conversation.toolset_digest, &conversation.tools)
        .unwrap();
    assert!(Arc::ptr_eq(&first, &second));
    assert_eq!(cache.compiles(), 1);
    assert_eq!(first.digest(), &conversation.toolset_digest);
}

#[test]
fn a_schema_with_a_remote_ref_is_refused_not_fetched() {
    let tools = json!([{"name": "t", "input_schema": {"$ref": "https://example.invalid/schema.json"}}]);
    assert!(matches!(
        Toolset::from_json(&tools),
        Err(ToolsetError::InvalidSchema { .. })
    ));
}

#[test]
fn a_committed_turn_revalidates_as_v1_history() {
    let mut assembler = assembler_with(Some(weather_tools()));
    let mut turn = outcome(&run(&mut assembler, text_and_call())).unwrap();
    turn["revision"] = json!(2);
    let file = json!({
        "format": "turnstile.conversation.v1", "conversation_id": "c", "revision": 2, "tools": weather_tools(),
        "turns": [{"id": "u", "revision": 1, "role": "user", "blocks": [{"id": "u1", "kind": "text", "text": "hi"}]}, turn]
    });
    let verdict = validate(&Conversation::from_value(file).unwrap());
    assert_eq!(
        verdict,
        Verdict::Waiting {
            pending: vec![turnstile_core::CallId("call_1".into())]
        }
    );
}

#[test]
fn usage_reports_merge_field_by_field_so_a_later_output_count_keeps_the_input_count() {
    // Anthropic: input tokens in `message_start`, only output tokens in `message_delta`.
    let mut events = text_and_call();
    let end = events.len() - 2;
    events.insert(
        1,
        StreamEvent::Usage {
            input_tokens: Some(377),
            output_tokens: Some(1),
            cache_creation_input_tokens: Some(1000),
            cache_read_input_tokens: Some(0),
        },
    );
    events.insert(
        end + 1,
        StreamEvent::Usage {
            input_tokens: None,
            output_tokens: Some(42),
            cache_creation_input_tokens: None,
            cache_read_input_tokens: Some(5),
        },
    );
    let mut assembler = assembler_with(Some(weather_tools()));
    let outputs = run(&mut assembler, events);
    let Some(Output::Commit(offer)) = outputs.last() else {
        panic!("{outputs:?}")
    };
    let usage = offer.usage.unwrap();
    assert_eq!(
        (
            usage.input_tokens,
            usage.output_tokens,
            usage.cache_creation_input_tokens,
            usage.cache_read_input_tokens
        ),
        (Some(377), Some(42), Some(1000), Some(5))
    );
}
